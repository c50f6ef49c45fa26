"""bench/tensor_parallel.py: its arguments, its cases, and a dry run on the CPU (gloo, tiny-llama, each case in its
own process) that produces every figure's field."""

from __future__ import annotations

import json

import pytest

import bench_scripts


def test_arguments_and_cases():
    bench = bench_scripts.load("tensor_parallel")
    args = bench.parse_args([])
    assert (args.model_config, args.big_config, args.batch, args.rank, args.size) == ("llama-2-13b", "llama-2-70b", 64, 16, 2)
    names = [case["name"] for case in bench.cases(args)]
    assert names == ["base_tp1", "base_tp2", "lora_tp2", "big_batch1_tp2"]
    assert [case["name"] for case in bench.cases(bench.parse_args(["--big-config", "none"]))] == names[:3]
    dry = bench.parse_args(["--dry-run"])
    assert (dry.model_config, dry.batch, dry.steps) == ("tiny-llama", 4, 4)
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch", "0"])
    only = bench.cases(bench.parse_args(["--only", "base_tp1,big_batch1_tp2"]))
    assert [case["name"] for case in only] == ["base_tp1", "big_batch1_tp2"]
    with pytest.raises(SystemExit, match="no case lora_tp4"):
        bench.cases(bench.parse_args(["--only", "lora_tp4"]))
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    both = bench.cases(bench.parse_args(["--all-reduce", "nccl,fused"]))
    assert [case["name"] for case in both] == names + ["base_tp2_fused", "lora_tp2_fused", "big_batch1_tp2_fused"]
    assert [case["all_reduce"] for case in both[1:]] == ["nccl"] * 3 + ["fused"] * 3 and "all_reduce" not in both[0]
    with pytest.raises(SystemExit):
        bench.parse_args(["--all-reduce", "one-shot"])


def test_rounds_report_each_case_s_median_run():
    bench = bench_scripts.load("tensor_parallel")
    runs = [{"name": "a", "tok_s": 10.0, "step_ms": 1}, {"name": "a", "tok_s": 30.0, "step_ms": 3},
            {"name": "a", "tok_s": 20.0, "step_ms": 2}]
    assert bench.median_run(runs) == {"name": "a", "tok_s": 20.0, "step_ms": 2, "tok_s_runs": [10.0, 30.0, 20.0]}
    assert bench.median_run(runs[:2])["tok_s"] == 10.0  # an even count: the lower middle
    failed = [{"name": "a", "error": "exit code 1"}, {"name": "a", "tok_s": 5.0}]
    assert bench.median_run(failed) == {"name": "a", "tok_s": 5.0, "tok_s_runs": [None, 5.0]}
    assert bench.median_run(failed[:1]) == failed[0]


@pytest.mark.slow
def test_dry_run_on_the_cpu(tmp_path, capsys):
    bench = bench_scripts.load("tensor_parallel")
    out = tmp_path / "tp.json"
    bench.main(["--dry-run", "--out", str(out)])
    document = json.loads(out.read_text())
    cases = document["cases"]
    assert not [name for name, case in cases.items() if "error" in case], cases
    assert cases["base_tp2"]["tensor_parallel"]["size"] == 2 and cases["base_tp1"]["tensor_parallel"]["size"] == 1
    assert cases["base_tp2"]["all_reduce_ms_per_step"] > 0
    assert set(document["summary"]) == {"tp2_over_tp1_decode", "lora_over_base_tp2", "all_reduce_share_of_decode_step",
                                        "big_batch1_over_floor"}


def test_a_step_s_kernels_summed_by_kind_with_overlaps_counted_once():
    bench = bench_scripts.load("tensor_parallel")
    assert bench.kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "all_reduce"
    assert bench.kernel_kind("_mbgmv_shrink_kernel") == "lora"
    assert bench.kernel_kind("_paged_decode_attention_kernel") == bench.kernel_kind("_decode_kernel") == "attention"
    assert bench.kernel_kind("_fused_add_rms_norm_kernel") == "fused"
    assert bench.kernel_kind("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert bench.kernel_kind("elementwise_kernel") == "other"
    # two steps: a GEMM 0-100 us overlapping an all-reduce 50-150, a gap to 200, then attention 200-300
    kernels = [("sm90_xmma_gemm", 0.0, 100.0), ("ncclDevKernel_AllReduce", 50.0, 150.0), ("paged_attention", 200.0, 300.0)]
    out = bench.summarize_kernels(kernels, steps=2)
    assert (out["gemm"], out["all_reduce"], out["attention"], out["other"]) == (0.05, 0.05, 0.05, 0.0)
    assert (out["kernels"], out["busy"], out["span"], out["idle"]) == (0.15, 0.125, 0.15, 0.025)
    assert out["top"][0][1] == 0.05 and len(out["top"]) == 3
    assert bench.summarize_kernels([], steps=1)["busy"] == 0.0
