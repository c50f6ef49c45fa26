"""Tensor parallelism on a 2-GPU host, side by side in one run (each case in a fresh process, so each has the GPUs'
memory to itself and its own process group):

- decode throughput at --batch running requests, --model-config (llama-2-13b) with random weights, TP=1 against
  TP=2 (the base model);
- at TP=2, LoRA (--batch distinct rank --rank adapters, all seven projections) against the base model alone;
- the all-reduces' share of a TP=2 decode step (their kernels' device time on rank 0 per step, from the profiler,
  which sees inside CUDA graph replays; it includes any wait for the other rank);
- where each throughput case's step goes on rank 0 (`device_ms_per_step`): its kernels' device time by kind (GEMMs,
  LoRA, attention, the fused norm/RoPE/activation kernels, all-reduces, the rest), the time the GPU is busy in a
  step and the time it waits for the host;
- a 70B shape (--big-config, llama-2-70b) at TP=2 in bf16: the batch-1 decode step against its floor, the weight
  bytes a rank reads per step / the HBM bandwidth measured on its GPU (a 1 GiB device copy; on the CPU, the
  engine's own measure), plus the step's all-reduces as measured.

    python3 bench/tensor_parallel.py --out bench/results/tensor_parallel_h200x2.json
    python3 bench/tensor_parallel.py --dry-run     # the CPU (gloo, tiny-llama): that the script and the engines run

Prints one JSON document (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="llama-2-13b", help="the throughput cases' shape")
    parser.add_argument("--big-config", default="llama-2-70b", help="the batch-1 floor case's shape ('none': skip it)")
    parser.add_argument("--batch", type=int, default=64, help="running requests of the throughput cases")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of every request")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per case")
    parser.add_argument("--size", type=int, default=2, help="the tensor-parallel size compared with 1")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU with gloo: tiny-llama, 4 requests, 4 steps (checks the script, times nothing real)")
    parser.add_argument("--only", help="run only these cases (comma-separated names: base_tp1, base_tpN, lora_tpN, "
                                       "big_batch1_tpN, and with --all-reduce fused each TP one's *_fused), e.g. to "
                                       "fit a time limit")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the cases this many times, every other round in reverse order (2: A B C C B A), "
                             "and report each case's median: a case's place in the run moves its figure (a case "
                             "run last on two H100s read 7%% slower)")
    parser.add_argument("--all-reduce", default="nccl",
                        help="the TP cases' sums (EngineConfig.all_reduce), comma-separated: nccl, fused; with both, "
                             "the TP throughput cases run with each (fused ones named *_fused)")
    parser.add_argument("--case-timeout", type=float, default=300.0,
                        help="seconds a case's process may take before it is killed (what it measured is kept)")
    parser.add_argument("--trace", metavar="DIR",
                        help="write the profiled steps of each throughput case on rank 0 as a Chrome trace here "
                             "(CASE.json.gz: the host's ops beside the GPU's kernels)")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process: JSON on stdout's last line
    args = parser.parse_args(argv)
    for name in ("batch", "rank", "prompt", "steps", "size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    args.all_reduces = [value.strip() for value in args.all_reduce.split(",") if value.strip()]
    if not args.all_reduces or set(args.all_reduces) - {"nccl", "fused"}:
        parser.error(f"--all-reduce: nccl, fused or both, not {args.all_reduce!r}")
    if args.dry_run:
        args.model_config = "tiny-llama"
        args.big_config = "tiny-llama" if args.big_config != "none" else "none"
        args.batch, args.steps, args.prompt, args.rank = min(args.batch, 4), min(args.steps, 4), min(args.prompt, 8), min(args.rank, 4)
    return args


def case_suffix(all_reduce: str) -> str:
    """What a TP case's name ends in for its --all-reduce: nothing for nccl, _fused for fused."""
    return "" if all_reduce == "nccl" else f"_{all_reduce}"


def cases(args) -> list[dict]:
    """The cases run, each in its own process."""
    listed = [
        {"name": "base_tp1", "model": args.model_config, "size": 1, "batch": args.batch, "lora": False,
         "profile": True},
        {"name": f"base_tp{args.size}", "model": args.model_config, "size": args.size, "batch": args.batch, "lora": False,
         "profile": True},
        {"name": f"lora_tp{args.size}", "model": args.model_config, "size": args.size, "batch": args.batch, "lora": True,
         "profile": True},
    ]
    if args.big_config != "none":
        listed.append({"name": f"big_batch1_tp{args.size}", "model": args.big_config, "size": args.size, "batch": 1,
                       "lora": False, "profile": True, "floor": True,
                       # a 70B shard leaves ~12 GB of an 80 GB GPU: fewer prefill graphs and a smaller pool, so the
                       # graphs' own device memory fits beside it (the defaults ran out of memory capturing them)
                       "max_batch_tokens": 512, "gpu_memory_utilization": 0.8})
    tp_cases = [case for case in listed if case["size"] > 1]  # each with every --all-reduce asked
    listed = [case for case in listed if case["size"] == 1]
    for all_reduce in args.all_reduces:
        listed += [{**case, "name": case["name"] + case_suffix(all_reduce), "all_reduce": all_reduce} for case in tp_cases]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {case["name"] for case in listed}
        if unknown:
            raise SystemExit(f"--only: no case {', '.join(sorted(unknown))} (the cases: {', '.join(c['name'] for c in listed)})")
        listed = [case for case in listed if case["name"] in wanted]
    return listed


def run_case(case: dict, args) -> dict:
    """One engine, `case["batch"]` requests decoding: tokens/s, ms per step, and where asked the all-reduces' time
    per step and the step's floor. Runs in a child process."""
    import torch

    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine
    from lorad.daemon.engine.step_cost import measure_device_rates
    from lorad.daemon.model.checkpoint import PROJECTIONS

    from engine_decode import device_copy_bandwidth, start_decoding  # bench/, beside this script

    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for the stacks of a case that hangs
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    cuda = not args.dry_run
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch = case["batch"]
    # The floor's bandwidth, measured before the engine's pool takes the GPU's memory (a 1 GiB copy then finds none;
    # the copy's buffers go back to the driver with the allocator's cache, which the engine empties before sizing it)
    hbm = device_copy_bandwidth() if cuda and case.get("floor") else None
    engine = Engine(EngineConfig(
        model_config=case["model"], dummy_weights=True, dummy_adapters=batch if case["lora"] else 0,
        dummy_adapter_rank=args.rank, dummy_adapter_targets=",".join(PROJECTIONS), device="cuda" if cuda else "cpu",
        dtype="bfloat16" if cuda else "float32", max_running_requests=max(batch, 1),
        max_batch_tokens=case.get("max_batch_tokens", max(2048, batch * args.prompt)), max_lora_rank=max(64, args.rank),
        max_model_len=2048, tensor_parallel_size=case["size"], pool_bytes=None if cuda else 64 << 20,
        gpu_memory_utilization=case.get("gpu_memory_utilization", EngineConfig.gpu_memory_utilization),
        all_reduce=case.get("all_reduce", "nccl"),
    ))
    try:
        adapters = [f"dummy-{index}" for index in range(batch)] if case["lora"] else [None] * batch
        requests = start_decoding(engine, adapters, args.prompt, args.steps * 2 + 16)
        sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        elapsed = time.perf_counter() - started
        result = {**case, "tok_s": batch * args.steps / elapsed, "step_ms": elapsed / args.steps * 1e3,
                  "ops": engine.runner.ops.name, "cuda_graph_steps": engine.runner.graph_steps,
                  "tensor_parallel": engine.status()["tensor_parallel"],
                  # the engine's own account of its decode steps (the timed ones and those starting the requests)
                  "decode_account": engine.account.snapshot()["by_kind"]["decode"]}
        if case.get("profile") and cuda:
            result["device_ms_per_step"] = device_breakdown(engine)
            # the timed steps ran without the profiler's host overhead: their wait for the host is this
            result["device_ms_per_step"]["step_minus_busy"] = round(result["step_ms"] - result["device_ms_per_step"]["busy"], 4)
            result["all_reduce_ms_per_step"] = result["device_ms_per_step"]["all_reduce"]
            if args.trace:
                write_trace(engine, os.path.join(args.trace, f"{case['name']}.json.gz"))
        elif case.get("profile"):
            result["all_reduce_ms_per_step"] = gloo_all_reduce_ms(engine)
        if case.get("profile") and case["size"] > 1:
            result["all_reduce_share"] = result["all_reduce_ms_per_step"] / result["step_ms"]
        if case.get("floor"):
            weight_bytes = step_weight_bytes(engine)
            hbm = hbm or measure_device_rates(engine.device, engine.dtype).bandwidth_bytes_per_s
            floor_ms = weight_bytes / hbm * 1e3 + result["all_reduce_ms_per_step"]
            result.update({"weight_bytes_per_gpu": weight_bytes, "hbm_copy_GBps": hbm / 1e9, "floor_ms": floor_ms,
                           "over_floor": result["step_ms"] / floor_ms})
        for request in requests:
            engine.abort(request.request_id)
        engine.step()
        if cuda:
            result["machine"] = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}"
        print(json.dumps(result), flush=True)  # before closing: the parent keeps it if the engine fails to close
        return result
    finally:
        engine.close()


def run_child(command: list[str], timeout_s: float) -> tuple[str, str]:
    """A case's process -> (its stdout, how it ended). One still running at timeout_s first has every process of
    it (rank 0 and the workers it started) print its threads' stacks (SIGUSR1), then is killed: a hang says where."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        output, _ = child.communicate(timeout=timeout_s)
        return output, f"exit code {child.returncode}"
    except subprocess.TimeoutExpired:
        for pid in [child.pid, *descendants(child.pid)]:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(3)
        child.kill()
        output, _ = child.communicate()
        return output or "", f"killed after --case-timeout {timeout_s:.0f} s"


def descendants(pid: int) -> list[int]:
    """The processes below pid (from /proc; none where there is no /proc)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as handle:
                children = [int(word) for word in handle.read().split()]
        except OSError:
            children = []
        found += children
        frontier += children
    return found


# A kernel's kind from its name (the first that matches, lowercased)
KERNEL_KINDS = (
    ("all_reduce", ("nccl", "all_reduce", "allreduce", "peer_sum")),  # the fused peer sum: its add and norm included
    ("lora", ("bgmv", "mbgm", "lora")),
    ("attention", ("attention", "attn", "write_kv", "paged", "_decode_kernel", "_combine_kernel", "_prefill_kernel")),
    ("fused", ("norm", "rope", "silu", "gelu")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "matmul", "sm90_", "sm80_")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def write_trace(engine, path: str, steps: int = 4) -> None:
    """`steps` more steps as a Chrome trace at `path` (gzipped where it ends in .gz): the host's Python functions and
    ops beside the GPU's kernels. Recording the functions slows the host: the trace shows where its time goes, not
    how long a step takes untraced."""
    prof = profiled_steps(engine, steps, with_stack=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path)


def profiled_steps(engine, steps: int, **options):
    """The profiler (host and GPU) over `steps` engine steps, the device's work done."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **options) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return prof


def device_breakdown(engine, steps: int = 8) -> dict:
    """Where a decode step goes on this process's GPU (rank 0), from the profiler over `steps` steps, per step in ms:
    the kernels' device time by kind (KERNEL_KINDS; NCCL's includes any wait for the other rank), `busy` (the union
    of the kernels' intervals: streams that overlap count once), `span` (first kernel's start to the last one's end)
    and `idle` (span - busy: the GPU waiting for the host). `top` lists the ten kernels of most time."""
    from torch.autograd import DeviceType

    kernels = [(event.name, event.time_range.start, event.time_range.end)
               for event in profiled_steps(engine, steps).events() if event.device_type == DeviceType.CUDA]
    return summarize_kernels(kernels, steps)


def summarize_kernels(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """(name, start us, end us) of every kernel over `steps` steps -> device_breakdown's figures, ms a step."""
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KERNEL_KINDS}
    by_kind["other"] = 0.0
    by_name: dict[str, float] = {}
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] += end - start
        by_name[name] = by_name.get(name, 0.0) + end - start
    busy, reach = 0.0, None
    for _, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    span = (max(end for *_, end in kernels) - min(start for _, start, _ in kernels)) if kernels else 0.0
    per_step = lambda us: round(us / steps / 1e3, 4)  # noqa: E731 (microseconds over the steps -> ms a step)
    out = {kind: per_step(us) for kind, us in by_kind.items()}
    out.update({"kernels": per_step(sum(by_kind.values())), "busy": per_step(busy), "span": per_step(span),
                "idle": per_step(span - busy),
                "top": [[name[:80], per_step(us)] for name, us in sorted(by_name.items(), key=lambda item: -item[1])[:10]]})
    return out


def gloo_all_reduce_ms(engine, steps: int = 8) -> float:
    """The all-reduces' time per decode step on rank 0 on the CPU (gloo): the ops' own time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    total_us = sum(event.cpu_time_total for event in prof.key_averages()
                   if "allreduce" in event.key.lower().replace("_", "") and event.key.lower().startswith("c10d::"))
    return total_us / steps / 1e3


def step_weight_bytes(engine) -> int:
    """The weights rank 0 reads in a decode step: its layers' shards, the norms and the LM head (the embedding
    table is gathered, not streamed)."""
    import torch

    model = engine.runner.model
    total = model.lm_head.nbytes + model.norm.nbytes
    for layer in model.layers:
        total += sum(value.nbytes for value in vars(layer).values() if isinstance(value, torch.Tensor))
    return total


def median_run(runs: list[dict]) -> dict:
    """A case's runs -> the one of median tok/s (the lower middle of an even count), with every run's tok/s beside
    it; the last run where none measured."""
    measured = sorted((run for run in runs if "tok_s" in run), key=lambda run: run["tok_s"])
    if not measured:
        return runs[-1]
    return {**measured[(len(measured) - 1) // 2], "tok_s_runs": [run.get("tok_s") for run in runs]}


def summary(results: dict, args) -> dict:
    out = {}
    for suffix in map(case_suffix, args.all_reduces):
        names = ("base_tp1", f"base_tp{args.size}{suffix}", f"lora_tp{args.size}{suffix}")
        base1, base_n, lora_n = (case if case and "tok_s" in case else None for case in map(results.get, names))
        if base1 and base_n:
            out[f"tp{args.size}_over_tp1_decode{suffix}"] = base_n["tok_s"] / base1["tok_s"]
        if base_n and lora_n:
            out[f"lora_over_base_tp{args.size}{suffix}"] = lora_n["tok_s"] / base_n["tok_s"]
        if base_n and "all_reduce_share" in base_n:
            out[f"all_reduce_share_of_decode_step{suffix}"] = base_n["all_reduce_share"]
        big = results.get(f"big_batch1_tp{args.size}{suffix}")
        if big and "over_floor" in big:
            out[f"big_batch1_over_floor{suffix}"] = big["over_floor"]
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        run_case(json.loads(args.case), args)  # prints its result
        return
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("batch", "rank", "prompt", "steps", "size", "all_reduce")]
    forwarded += [f"--trace={args.trace}"] if args.trace else []
    forwarded += ["--dry-run"] if args.dry_run else []
    runs: dict[str, list[dict]] = {}
    listed = cases(args)
    for round_ in range(args.rounds):
        for case in listed if round_ % 2 == 0 else listed[::-1]:
            started = time.perf_counter()
            output, ended = run_child([sys.executable, __file__, *forwarded, "--case", json.dumps(case)], args.case_timeout)
            printed = [line for line in output.splitlines() if line.startswith("{")]
            if printed:
                result = json.loads(printed[-1])
                if ended != "exit code 0":
                    result["close"] = f"measured, then the engine did not close cleanly: {ended}"
            else:
                result = {**case, "error": f"{ended} (its log is above)"}
            runs.setdefault(case["name"], []).append(result)
            print(f"case {case['name']} (round {round_ + 1}) done in {time.perf_counter() - started:.0f} s: "
                  f"{json.dumps(result)}", file=sys.stderr, flush=True)
    results = {name: median_run(measured) for name, measured in runs.items()}
    document = {"args": {key: value for key, value in vars(args).items() if key != "case"}, "summary": summary(results, args),
                "cases": results}
    print(json.dumps(document, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(document, handle, indent=1)


if __name__ == "__main__":
    main()
