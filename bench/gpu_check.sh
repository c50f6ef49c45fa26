#!/usr/bin/env bash
# One run on the GPU machine: install lorad, run the GPU tests and the GPU benchmarks, and leave logs
# and JSON in OUTDIR. Usage, from the repository root:
#   bash bench/gpu_check.sh OUTDIR            # every step
#   bash bench/gpu_check.sh OUTDIR STEP...    # the install, then only the named steps (a device call is
#                                             # at most 10 minutes: the full check takes two or three)
# On a host with two GPUs, two lists at once (one install first, each list on its own GPU):
#   bash bench/gpu_check.sh OUT/a STEP && export GPU_CHECK_INSTALLED=1 &&
#   { CUDA_VISIBLE_DEVICES=0 bash bench/gpu_check.sh OUT/b STEP... & CUDA_VISIBLE_DEVICES=1 bash bench/gpu_check.sh OUT/c STEP...; wait; }
# Steps: see `all_steps` below (pytest_fused: one test file, for a quick re-check). Wheels the machine lacks (posix_ipc, see ../shared/GPU.md)
# travel in the ignored .devcarry/ folder. Every step runs even when one before it failed; the exit
# status says whether any failed. A step's output lands in OUTDIR/NAME.log.

set -u
OUTDIR=${1:?usage: bench/gpu_check.sh OUTDIR [STEP...]}
shift
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
failed=()

step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    # SIGINT first: pytest then prints its summary (which tests failed, and why) and a script its traceback
    timeout -s INT -k 30 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    local status=$?
    tail -n 25 "$OUTDIR/$name.log"
    echo "=== $name: exit $status after $((SECONDS - start)) s"
    [ "$status" -eq 0 ] || failed+=("$name")
    return "$status"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -a; python3 --version
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$OUTDIR/machine.txt" 2>&1
cat "$OUTDIR/machine.txt"

# --- install (GPU_CHECK_INSTALLED=1: done already, e.g. by another run of this script beside it) ----------
if compgen -G ".devcarry/*.whl" >/dev/null; then
    [ "${GPU_CHECK_INSTALLED:-0}" = 1 ] || step install_wheels 120 python3 -m pip install -q --no-index --no-deps --target /tmp/site .devcarry/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ "${GPU_CHECK_INSTALLED:-0}" = 1 ] || step install 150 python3 -m pip install -q --no-deps --no-build-isolation -e .

# --- steps ----------------------------------------------------------------------------------------
run_step() {
    case $1 in
    lora_kernels) step bench_lora_kernels 300 python3 bench/lora_kernels.py --out "$OUTDIR/lora_kernels.json" ;;
    # the decode tiles for batches of ranks <= 16 (the engine's low-rank graphs), 64 rows of rank 16
    lora_kernels_r16) step bench_lora_kernels_r16 240 python3 bench/lora_kernels.py --ranks 16,16 --no-prefill --budget-s 150 --out "$OUTDIR/lora_kernels_r16.json" ;;
    # figure 3.2 alone: the q_proj decode methods (MBGMV plain and with the expand launched early, BGMV, ...)
    lora_kernels_decode) step bench_lora_kernels_decode 150 python3 bench/lora_kernels.py --no-sweep --no-prefill \
        --out "$OUTDIR/lora_kernels_decode.json" ;;
    # the rank-16 tiles with the expand launched early (lora_pdl on): every shrink x expand pair on the 7B shapes
    lora_kernels_pdl) step bench_lora_kernels_pdl 300 python3 bench/lora_kernels.py --ranks 16,16 --no-prefill --pdl-pairs \
        --only-shapes q_proj,gate_proj,down_proj --budget-s 230 --out "$OUTDIR/lora_kernels_pdl.json" ;;
    # the same over ranks 8..64 (the default decode graphs' tiles)
    lora_kernels_pdl_mixed) step bench_lora_kernels_pdl_mixed 300 python3 bench/lora_kernels.py --no-prefill --pdl-pairs \
        --only-shapes q_proj,gate_proj,down_proj --budget-s 230 --out "$OUTDIR/lora_kernels_pdl_mixed.json" ;;
    attention) step bench_attention 240 python3 bench/attention.py --out "$OUTDIR/attention.json" ;;
    gemv) step bench_gemv 240 python3 bench/gemv.py --out "$OUTDIR/gemv.json" ;;
    gemv_fp8) step bench_gemv_fp8 200 python3 bench/gemv.py --fp8 --out "$OUTDIR/gemv_fp8.json" ;;
    engine_decode) step bench_engine_decode 150 python3 bench/engine_decode.py --breakdown-batch --out "$OUTDIR/engine_decode.json" ;;
    # the same with one decode LoRA launch pair per projection (fuse_lora_groups off): run it beside engine_decode
    engine_decode_per_projection) step bench_engine_decode_per_projection 150 python3 bench/engine_decode.py --breakdown-batch \
        --no-fuse-lora-groups --out "$OUTDIR/engine_decode_per_projection.json" ;;
    # the decode MBGMV's expand without programmatic dependent launch (lora_pdl off; on by default on Hopper):
    # run beside engine_decode_plain (the default engine, no breakdown)
    engine_decode_pdl_off) step bench_engine_decode_pdl_off 150 python3 bench/engine_decode.py --lora-pdl off \
        --out "$OUTDIR/engine_decode_pdl_off.json" ;;
    # Phi-3's fused-module adapters: A shared by q, k, v (gate, up) in the pool against a separate A each, and the base
    fused_lora_decode) step bench_fused_lora_decode 200 python3 bench/fused_lora_decode.py --out "$OUTDIR/fused_lora_decode.json" ;;
    # the FP8 figures: FP8 weights + FP8 KV against bf16 on the 7B shape (accuracy, batch-1 floor, 64x1024 decode,
    # KV capacity, LoRA/base), then the FP8 GPU tests
    fp8) step bench_fp8 420 python3 bench/fp8.py --out "$OUTDIR/fp8.json" ;;
    # the FP8 kernels of decode batches beside what they replaced: the rows GEMM against torch._scaled_mm, the decode
    # attention's launch over FP8 pages against four warps
    fp8_rows) step bench_fp8_rows 300 python3 bench/fp8_rows.py --attention --out "$OUTDIR/fp8_rows.json" ;;
    # figure 25.4: the saturated Azure-conv run with FP8 weights + KV against bf16, this commit served twice
    serve_fp8) step serve_fp8 560 env CURRENT_SERVE_ARGS="--quantization fp8 --kv-cache-dtype fp8" \
        bash bench/serve_compare.sh "$OUTDIR/serve_fp8" . ;;
    # figure 21.1 at the running cap: 64 running (served first) beside the default cap, which follows the KV cache
    # (96 on the 7B shape), this commit both; the overlapped decode steps, preemptions and adapter evictions of each in
    # NAME.status.json
    serve_cap) step serve_cap 560 env BASELINE_SERVE_ARGS="--max-running-requests 64" \
        bash bench/serve_compare.sh "$OUTDIR/serve_cap" . ;;
    # figure 21.1 served once by this commit at its defaults with the engine's step log, and where the device waited
    # (a fresh machine's first start profiles the GPU for ~2 minutes: 300 s did not hold install, adapters and run)
    serve_steps) step serve_steps 450 env STEP_LOG=1 bash bench/serve_compare.sh "$OUTDIR/serve_steps" &&
        step step_log_report 60 python3 bench/step_log_report.py "$OUTDIR/serve_steps/current.steps.jsonl" \
            --out "$OUTDIR/step_log_report.json" ;;
    pytest_fp8) step pytest_fp8 300 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 tests/gpu_ops/test_fp8.py \
        tests/daemon/engine/test_fp8_gpu.py tests/gpu_ops/test_paged_attention.py tests/gpu_ops/test_gemv.py ;;
    engine_decode_plain) step bench_engine_decode_plain 150 python3 bench/engine_decode.py --out "$OUTDIR/engine_decode_plain.json" ;;
    pytest_pdl) step pytest_pdl 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu_ops/test_lora_kernels.py \
        -k "pdl or mbgmv_group_gpu or no_host_sync" tests/daemon/engine/test_engine_gpu.py::test_cuda_lora_pdl_gives_the_same_tokens ;;
    # decode_pdl (a decode step's kernels launched early): its GPU tests, whose failures print by how much the logits
    # differ and whose FP8 test first compares two engines in stream order; then the step with and without it, FP8 and bf16
    decode_pdl) step pytest_decode_pdl 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k decode_pdl \
            tests/daemon/engine/test_fp8_gpu.py tests/daemon/engine/test_engine_gpu.py
        step bench_decode_pdl_fp8 200 bash -c "cd bench && python3 decode_pdl.py --quantization fp8 --kv-cache-dtype fp8 \
            --out '$OUTDIR/decode_pdl_fp8.json'"
        step bench_decode_pdl_bf16 200 bash -c "cd bench && python3 decode_pdl.py --out '$OUTDIR/decode_pdl_bf16.json'" ;;
    # where an eager prefill's time goes (host launches vs device), with a cProfile of the host
    prefill_host) step prefill_host 200 python3 bench/prefill_host.py --out "$OUTDIR/prefill_host.json" ;;
    invoke) step bench_invoke 240 python3 bench/invoke.py --out "$OUTDIR/invoke.json" ;;
    # figure 3.6: S-LoRA's workload on lorad, then the transformers + PEFT server on the first
    # requests of the same n=100 trace
    slora) step bench_slora 420 python3 bench/slora_workload.py --out "$OUTDIR/slora_workload.json" ;;
    slora_peft)  # figure 3.6 from one device call: lorad's S1/S2 runs, then the PEFT server on the n = 100 trace
        step bench_slora 330 python3 bench/slora_workload.py --out "$OUTDIR/slora_workload.json"
        step bench_peft 220 python3 bench/peft_baseline.py --adapters 100 --requests 33 --budget-s 110 --out "$OUTDIR/peft_baseline.json" ;;
    peft) step bench_peft 200 python3 bench/peft_baseline.py --adapters 100 --requests 33 --budget-s 110 --out "$OUTDIR/peft_baseline.json" ;;
    pytest_cold_start) step pytest_cold_start 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/daemon/engine/test_cold_start_gpu.py tests/gpu_ops/test_cuda_ext.py ;;
    # the engine on the GPU (graphs vs eager vs the CPU) and the profile's fits
    pytest_engine) step pytest_engine 420 python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider --durations=8 tests/daemon/engine/test_engine_gpu.py tests/daemon/bench/test_profile_gpu.py ;;
    pytest_profile) step pytest_profile 400 python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider --durations=4 tests/daemon/bench/test_profile_gpu.py ;;
    pytest_gemv) step pytest_gemv 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu_ops/test_gemv.py ;;
    pytest_fused) step pytest_fused 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu_ops/test_fused.py ;;
    # figure 6.1: the performance models fitted on this GPU
    profile) step profile 120 python3 -m lorad.daemon.server.cli profile --model-config llama-2-7b --max-lora-rank 64 --out "$OUTDIR/profile.json" ;;
    # figures 5.x: the cold-start microbenchmarks
    mb_load) step mb_load 200 python3 -m lorad.daemon.server.cli bench load --disk-dir "$PWD" --out "$OUTDIR/mb_load.json" ;;
    mb_invoke) step mb_invoke 150 python3 -m lorad.daemon.server.cli bench invoke --require-fused --out "$OUTDIR/mb_invoke.json" ;;
    mb_ipc) step mb_ipc 240 python3 -m lorad.daemon.server.cli bench ipc --out "$OUTDIR/mb_ipc.json" ;;
    # the CPU side of the workers on this host's cores: the shm protocol, the pool, the native loop
    pytest_workers) step pytest_workers 200 python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/cpu_lora tests/shm ;;
    # where the times of figures 5.4 and 5.3 go: the parts of the work, and the kernels with no worker
    diag_cpu_lora) step diag_cpu_lora 200 python3 bench/cpu_lora_diag.py --out "$OUTDIR/diag_cpu_lora.json" ;;
    diag_cores) step diag_cores 200 python3 bench/cpu_cores_diag.py --out "$OUTDIR/diag_cores.json" ;;
    mb_cpu_lora) step mb_cpu_lora 120 python3 -m lorad.daemon.server.cli bench cpu-lora --out "$OUTDIR/mb_cpu_lora.json" ;;
    mb_cold_start) step mb_cold_start 420 python3 -m lorad.daemon.server.cli bench cold-start --out "$OUTDIR/mb_cold_start.json" ;;
    # figure 1: adapters in pageable memory (nothing pinned), the modes side by side in alternating rounds
    mb_cold_start_pageable) step mb_cold_start_pageable 450 python3 -m lorad.daemon.server.cli bench cold-start \
        --modes cached,ondemand,auto --pinned-host-bytes 0 --adapters 128 --rounds 2 --no-ablation \
        --out "$OUTDIR/mb_cold_start_pageable.json" ;;
    # figure 2: pinned adapters, auto against ondemand in alternating rounds
    mb_cold_start_pinned) step mb_cold_start_pinned 450 python3 -m lorad.daemon.server.cli bench cold-start \
        --modes ondemand,auto --rounds 3 --no-prime --no-ablation --out "$OUTDIR/mb_cold_start_pinned.json" ;;
    stream_wait) step stream_wait 150 python3 bench/stream_wait.py --out "$OUTDIR/stream_wait.json" ;;
    pytest_stream) step pytest_stream 300 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 60 \
        tests/gpu_ops/test_adapter_stream.py tests/daemon/engine/test_adapter_stream_gpu.py ;;
    pytest_gpu)  # both halves below (about 8 minutes: more than one device call holds with other steps)
        run_step pytest_gpu_ops
        run_step pytest_gpu_daemon ;;
    pytest_gpu_ops)
        if ! step pytest_gpu_ops 330 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 tests/gpu_ops; then
            # A collection error elsewhere (a conftest another change broke) must not hide the kernels' results.
            if grep -q "ERROR collecting\|ImportError while loading conftest" "$OUTDIR/pytest_gpu_ops.log"; then
                step pytest_gpu_lora_only 120 env PYTHONPATH="tests:${PYTHONPATH:-}" python3 -m pytest -m gpu --noconftest \
                    tests/gpu_ops/test_lora_kernels.py -q -p no:cacheprovider  # tests/: triton_interpreter.py
            fi
        fi ;;
    pytest_gpu_daemon) step pytest_gpu_daemon 540 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 \
        --ignore=tests/gpu_ops tests ;;
    # tensor parallelism, on a host with 2 GPUs (not in all_steps): the TP=2 tests, then figures 26.1-26.2 (llama-2-13b
    # shape: TP=2 vs TP=1, LoRA vs base at TP=2, the all-reduces' share) and 26.3 (llama-2-70b, batch 1 vs its floor)
    pytest_tp) step pytest_tp 400 python3 -m pytest -m gpu -q -p no:cacheprovider tests/daemon/engine/test_tensor_parallel_gpu.py ;;
    tp_throughput) step bench_tp_throughput 560 python3 bench/tensor_parallel.py --big-config none \
        --out "$OUTDIR/tensor_parallel_throughput.json" ;;
    tp_70b) step bench_tp_70b 560 python3 bench/tensor_parallel.py --only big_batch1_tp2 --out "$OUTDIR/tensor_parallel_70b.json" ;;
    all_reduce) step bench_all_reduce 120 python3 bench/all_reduce.py --out "$OUTDIR/all_reduce.json" ;;
    # the TP=2 profile of the 13B shape with the engine's default sums (fused) and with NCCL's: their decode fits
    profile_tp) step profile_tp 300 python3 -m lorad.daemon.server.cli profile --model-config llama-2-13b \
        --tensor-parallel-size 2 --out "$OUTDIR/profile_tp2.json" ;;
    profile_tp_nccl) step profile_tp_nccl 300 python3 -m lorad.daemon.server.cli profile --model-config llama-2-13b \
        --tensor-parallel-size 2 --all-reduce nccl --out "$OUTDIR/profile_tp2_nccl.json" ;;
    *) echo "unknown step $1"; failed+=("$1") ;;
    esac
}

all_steps=(lora_kernels lora_kernels_r16 attention gemv engine_decode invoke slora_peft profile mb_load mb_invoke mb_ipc mb_cpu_lora mb_cold_start pytest_gpu)
for name in "${@:-${all_steps[@]}}"; do
    run_step "$name"
done

if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all steps passed"
