"""`lorad bench cpu-lora`: what the CPU can do for a cold start (CaraServe Fig. 18), for q, k and v of one
layer (hidden x hidden each; the 7B shape on cuda hosts, a tiny one on the CPU):

- profile: one core's time for `x @ A^T @ B^T` over q, k, v by prompt tokens at ranks 16 and 64, and
  the line fitted through it (cpu_lora/partition.py's CostModel: overhead + per-token cost, tokens/ms);
- scaling: N pinned worker processes (cpu_lora/worker.py's WorkerPool over shared memory) against one
  process running torch with N threads, for 128 tokens at rank 64, the processes sharing the work both
  ways partition.plan chooses between: the tokens split evenly (CaraServe's), and one split group (each
  worker all the tokens and a chunk of A's and B's columns). CaraServe's multi-process design aims at
  1.5x over the threaded one;
- the bound: the same work on one idle core divided by N (`perfect_split_ms`), and threads over it: what
  no process split can beat, so whether that 1.5x is within reach on the host at hand.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from types import SimpleNamespace

import torch
from lorad.daemon.bench.report import (
    finish,
    machine,
    markdown_table,
    resolve_device,
)

from lorad.errors import BadRequest

PROJECTIONS_QKV = (0, 1, 2)
TARGET_SPEEDUP = 1.5


def run(args) -> dict:
    from lorad.cpu_lora.partition import fit_cost

    device = resolve_device(args.device)
    cores = sorted(os.sched_getaffinity(0))
    hidden = args.hidden or (4096 if device.type == "cuda" else 256)
    token_counts = args.tokens or ((1, 16, 64, 128, 256, 512) if device.type == "cuda" else (1, 8, 32, 64))
    worker_counts = args.workers or tuple(n for n in (1, 2, 4, 8) if n <= max(1, len(cores) - 1)) or (1,)
    ranks = args.ranks or (16, 64)
    if args.scaling_tokens < 1 or args.scaling_rank < 1:
        raise BadRequest("--scaling-tokens and --scaling-rank must be at least 1")
    profile = []
    for rank in ranks:
        samples = [(tokens, one_core_ms(tokens, rank, hidden, args.reps, cores[-1])) for tokens in token_counts]
        cost = fit_cost(samples, rank=rank, in_features=hidden, out_features=hidden) if len(samples) > 1 else None
        profile.append({
            "rank": rank, "modules": "q,k,v", "samples": [{"tokens": t, "ms": ms} for t, ms in samples],
            "fit": None if cost is None else {"overhead_ms": cost.overhead_ms, "per_token_ms": cost.per_token_ms,
                                              "tokens_per_ms": cost.tokens_per_ms},
        })
    # The most any split over N cores can gain: the whole work on one idle core, divided by N (every part
    # as fast as the whole, nothing spent to coordinate them). A target above threads_ms / that is out of
    # reach on this host, whatever the protocol. The fastest core's time, as cores of a VM differ.
    serial_on = {core: one_core_ms(args.scaling_tokens, args.scaling_rank, hidden, args.reps, core) for core in cores}
    serial_ms = min(serial_on.values())
    scaling, notes = [], []
    for workers in worker_counts:
        if workers + 1 > len(cores):
            notes.append(f"{workers} workers and the engine share {len(cores)} usable cores: oversubscribed")
        processes_ms = pool_ms(workers, args.scaling_tokens, args.scaling_rank, hidden, args.reps)
        groups_ms = (pool_ms(workers, args.scaling_tokens, args.scaling_rank, hidden, args.reps, groups=True)
                     if workers >= 2 else None)
        threads_ms = threaded_ms(workers, args.scaling_tokens, args.scaling_rank, hidden, args.reps)
        scaling.append({"cores": workers, "processes_ms": processes_ms, "processes_groups_ms": groups_ms,
                        "threads_ms": threads_ms, "speedup": threads_ms / processes_ms,
                        "speedup_groups": None if groups_ms is None else threads_ms / groups_ms,
                        "perfect_split_ms": serial_ms / workers,
                        "perfect_split_speedup": threads_ms / (serial_ms / workers)})
    report = {
        "version": 1, "kind": "bench-cpu-lora", "command": args.command_line, "machine": machine(device),
        "config": {"hidden": hidden, "modules": "q,k,v (hidden x hidden each)", "dtype": "float32",
                   "ranks": list(ranks), "tokens": list(token_counts), "reps": args.reps,
                   "scaling_tokens": args.scaling_tokens, "scaling_rank": args.scaling_rank},
        "serial_ms": serial_ms,
        "serial_ms_by_core": serial_on,
        "profile": profile,
        "scaling": scaling,
        "target": f"processes at least {TARGET_SPEEDUP}x faster than threads at the same core count",
        "notes": ["profile ms: one thread pinned to one core, median of reps, q+k+v together",
                  ("processes_ms: the engine writes x into shared memory and runs q, k, v as three rounds of one "
                   "job per worker on its own tokens (what CPU assist does per layer); processes_groups_ms: the "
                   "same as three split groups (every worker all the tokens, a chunk of the columns); "
                   "threads_ms: torch with N threads, same math"),
                  ("perfect_split_ms: serial_ms (the scaling work on one idle pinned core, the fastest of "
                   "serial_ms_by_core) / N, the least N "
                   "processes could take if every part ran as fast as the whole and coordinating cost nothing; "
                   "perfect_split_speedup: threads_ms over it, the most any process split can gain here"),
                  *notes],
    }
    print(markdown_table(
        ["rank", "tokens", "ms (1 core)", "tokens/ms (fit)"],
        [[p["rank"], s["tokens"], s["ms"], p["fit"]["tokens_per_ms"] if p["fit"] else None]
         for p in profile for s in p["samples"]],
    ))
    print()
    print(markdown_table(
        ["cores", f"{args.scaling_tokens} tokens rank {args.scaling_rank}: processes, token split ms",
         "processes, split group ms", "threads ms", "speedup (token split)", "speedup (split group)",
         "perfect split ms", "perfect split speedup (the bound)"],
        [[s["cores"], s["processes_ms"], s["processes_groups_ms"], s["threads_ms"], s["speedup"], s["speedup_groups"],
          s["perfect_split_ms"], s["perfect_split_speedup"]]
         for s in scaling],
    ))
    finish(args.out, report, lambda plt: _plot(plt, profile, scaling))
    return report


def _weights(rank: int, hidden: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {(0, proj): (torch.randn(rank, hidden, generator=generator) * hidden**-0.5,
                        torch.randn(hidden, rank, generator=generator) * (0.5 / rank))
            for proj in PROJECTIONS_QKV}


def one_core_ms(tokens: int, rank: int, hidden: int, reps: int, core: int) -> float:
    """Median ms of q, k, v's LoRA for `tokens` rows on one torch thread pinned to `core`; inputs rotate."""
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})
    try:
        return _qkv_lora_ms(tokens, rank, hidden, reps)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def threaded_ms(threads: int, tokens: int, rank: int, hidden: int, reps: int) -> float:
    """One process, torch with `threads` threads: median ms of q, k, v's LoRA for `tokens` rows."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _qkv_lora_ms(tokens, rank, hidden, reps)
    finally:
        torch.set_num_threads(previous)


def _qkv_lora_ms(tokens: int, rank: int, hidden: int, reps: int) -> float:
    """Median ms of q, k, v's LoRA for `tokens` rows in this thread's torch settings (2 warm-up runs)."""
    weights = [(a, b.t().contiguous()) for a, b in _weights(rank, hidden).values()]
    inputs = [torch.randn(tokens, hidden) for _ in range(4)]
    middle, out = torch.empty(tokens, rank), torch.empty(tokens, hidden)
    times = []
    for rep in range(reps + 2):
        x = inputs[rep % len(inputs)]
        start = time.perf_counter()
        for a, b_t in weights:
            torch.mm(torch.mm(x, a.t(), out=middle), b_t, out=out)
        if rep >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def pool_ms(workers: int, tokens: int, rank: int, hidden: int, reps: int, groups: bool = False) -> float:
    """`workers` pinned worker processes over shared memory: median ms of q, k, v's LoRA for `tokens`
    rows split evenly (`groups`: one split group per projection over all the workers), x copied into the
    exchange each time, results checked once against torch."""
    from lorad.cpu_lora.worker import WorkerPool
    from lorad.shm.segment import new_instance
    from lorad.shm.store import AdapterStore

    adapter = SimpleNamespace(name="bench-cpu-lora", weights=_weights(rank, hidden))

    count = min(workers, tokens)
    base, extra = divmod(tokens, count)
    bounds = [0]
    for index in range(count):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    ranges = list(itertools.pairwise(bounds))
    inputs = [torch.randn(tokens, hidden) for _ in range(4)]
    instance = new_instance()
    with AdapterStore.create(instance, 3 * 2 * rank * hidden * 4 + (1 << 16)) as store:
        adapter_id = store.put(adapter)
        with WorkerPool(workers, store, tokens, hidden, hidden, instance=instance, max_rank=rank if groups else 0) as pool:
            output = torch.from_numpy(pool.output)
            times = []
            for rep in range(reps + 2):
                x = inputs[rep % len(inputs)]
                pool.poll_hot_for(1.0)  # as the engine runs the pool in a cold start: workers poll, no wake-ups
                start = time.perf_counter()
                for proj in PROJECTIONS_QKV:
                    if groups:
                        if not pool.run_split(adapter_id, 0, proj, (0, tokens), workers, hidden, hidden,
                                              x=x if proj == 0 else None):
                            raise RuntimeError("a CPU LoRA split group failed")
                        continue
                    failed = pool.run(adapter_id, 0, proj, ranges, hidden, hidden, x=x if proj == 0 else None)
                    if failed:
                        raise RuntimeError(f"CPU LoRA jobs failed: {failed}")
                if rep >= 2:
                    times.append((time.perf_counter() - start) * 1e3)
            a, b = adapter.weights[(0, PROJECTIONS_QKV[-1])]
            if not torch.allclose(output[:tokens, :hidden], x @ a.t() @ b.t(), rtol=1e-3, atol=1e-3):
                raise RuntimeError("the CPU LoRA workers returned a wrong result")
    return statistics.median(times)


def _plot(plt, profile: list[dict], scaling: list[dict]):
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for entry in profile:
        tokens = [s["tokens"] for s in entry["samples"]]
        left.plot(tokens, [s["ms"] for s in entry["samples"]], "o-", label=f"rank {entry['rank']}")
    left.set_xlabel("prompt tokens")
    left.set_ylabel("q,k,v LoRA on one core (ms)")
    left.set_title("tokens per core")
    left.grid(alpha=0.3)
    left.legend()
    cores = [s["cores"] for s in scaling]
    right.plot(cores, [s["processes_ms"] for s in scaling], "o-", label="pinned worker processes, token split")
    grouped = [s for s in scaling if s["processes_groups_ms"] is not None]
    right.plot([s["cores"] for s in grouped], [s["processes_groups_ms"] for s in grouped], "^-",
               label="pinned worker processes, split groups")
    right.plot(cores, [s["threads_ms"] for s in scaling], "s-", label="one process, torch threads")
    right.set_xlabel("cores")
    right.set_ylabel("ms")
    right.set_title("processes vs threads")
    right.grid(alpha=0.3)
    right.legend()
    return figure
