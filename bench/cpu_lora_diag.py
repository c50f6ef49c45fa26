"""Where the time of BENCHMARKS.md's figure 5.4 goes: 128 tokens of q, k, v LoRA at rank 64 (hidden 4096, fp32)
on 8 cores, pinned worker processes against one process with 8 torch threads.

Rows (median ms over --reps, inputs rotating):
- one_core_full: the whole work on one pinned core (the serial baseline; `lorad bench cpu-lora`'s measure);
- one_core_part: one split-group part's compute alone (input columns 1/N of the shrink, output columns
  1/N of the expand, for q, k, v) on one pinned core; N of these are the work a split group shares;
- concurrent_part: that same part run by N pinned processes at once, no coordination (the median of
  the slowest process per rep): what N busy cores cost each other (clocks, caches);
- threads (`lorad bench cpu-lora`'s measure) / threads_fused_shrink: torch with N threads, q, k, v one after another, or the three shrinks
  as one GEMM against A_q|A_k|A_v (the same math);
- pool_groups_x_in / pool_groups: the worker pool (cpu_lora/worker.py), one split group per projection,
  with x copied into the exchange inside the timing (what `lorad bench cpu-lora` times) or before it
  (as on a GPU host, where the device writes x into the exchange);
- pool_group_1_token: one token through the same three groups: the protocol's own cost.

Usage: python3 bench/cpu_lora_diag.py [--workers 8] [--reps 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time

import torch
from lorad.daemon.bench.cpu_lora import one_core_ms, threaded_ms

TOKENS, HIDDEN, RANK = 128, 4096, 64


def _median_ms(work, reps: int, setup=None) -> float:
    times = []
    for rep in range(reps + 2):
        if setup is not None:
            setup(rep)
        start = time.perf_counter()
        work(rep)
        if rep >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _weights(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(RANK, HIDDEN, generator=generator), torch.randn(RANK, HIDDEN, generator=generator))
            for _ in range(3)]  # (A [r, in], B^T [r, out]) for q, k, v


def _part_work(parts: int, part: int):
    """A closure computing one split-group part's shrink and expand for q, k, v (and its inputs)."""
    weights = _weights()
    inputs = [torch.randn(TOKENS, HIDDEN) for _ in range(4)]
    step = HIDDEN // parts
    k0, k1 = part * step, (part + 1) * step
    partial, out = torch.empty(TOKENS, RANK), torch.empty(TOKENS, HIDDEN)

    def work(rep: int) -> None:
        x = inputs[rep % len(inputs)][:, k0:k1]
        for a, b_t in weights:
            torch.mm(x, a.t()[k0:k1], out=partial)
            torch.mm(partial, b_t[:, k0:k1], out=out[:, k0:k1])
    return work


def _fused_work():
    weights = _weights()
    a_all = torch.cat([a for a, _ in weights]).t().contiguous()  # [in, 3r]
    inputs = [torch.randn(TOKENS, HIDDEN) for _ in range(4)]
    middle, out = torch.empty(TOKENS, 3 * RANK), torch.empty(TOKENS, HIDDEN)

    def work(rep: int) -> None:
        torch.mm(inputs[rep % len(inputs)], a_all, out=middle)
        for index, (_, b_t) in enumerate(weights):
            torch.mm(middle[:, index * RANK:(index + 1) * RANK], b_t, out=out)
    return work


def _pinned(core: int):
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def _concurrent_child(core: int, parts: int, part: int, reps: int, start, results) -> None:
    _pinned(core)
    work = _part_work(parts, part)
    for rep in range(3):
        work(rep)
    times = []
    for rep in range(reps):
        start.wait()  # every process starts each rep together
        begin = time.perf_counter()
        work(rep)
        times.append((time.perf_counter() - begin) * 1e3)
    results.put((part, times))


def concurrent_part(workers: int, cores: list[int], reps: int) -> dict:
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(workers), context.Queue()
    children = [context.Process(target=_concurrent_child, args=(cores[p], workers, p, reps, start, results))
                for p in range(workers)]
    for child in children:
        child.start()
    per_part = dict(results.get(timeout=300) for _ in children)
    for child in children:
        child.join(30)
    slowest = [max(per_part[p][rep] for p in per_part) for rep in range(reps)]
    return {"slowest_median_ms": statistics.median(slowest),
            "each_median_ms": [statistics.median(per_part[p]) for p in sorted(per_part)]}


def pool(workers: int, reps: int, tokens: int, x_in_timing: bool, cores: list[int]) -> float:
    import numpy as np
    from types import SimpleNamespace
    from lorad.cpu_lora.worker import WorkerPool
    from lorad.shm.segment import new_instance
    from lorad.shm.store import AdapterStore

    weights = _weights()
    adapter = SimpleNamespace(name="diag", weights={(0, p): (a, b_t.t()) for p, (a, b_t) in enumerate(weights)})
    inputs = [torch.randn(tokens, HIDDEN).numpy() for _ in range(4)]
    instance = new_instance()
    with AdapterStore.create(instance, 3 * 2 * RANK * HIDDEN * 4 + (1 << 16)) as store:
        adapter_id = store.put(adapter)
        with WorkerPool(workers, store, tokens, HIDDEN, HIDDEN, cores=cores[:workers], instance=instance,
                        max_rank=RANK) as workers_pool:
            rows = workers_pool.exchange.input_rows(0, tokens, HIDDEN).view(np.float32)

            def setup(rep: int) -> None:
                if not x_in_timing:
                    rows[:] = inputs[rep % len(inputs)]
                workers_pool.poll_hot_for(1.0)

            def work(rep: int) -> None:
                if x_in_timing:
                    rows[:] = inputs[rep % len(inputs)]
                for proj in range(3):
                    if not workers_pool.run_split(adapter_id, 0, proj, (0, tokens), workers, HIDDEN, HIDDEN):
                        raise RuntimeError("a split group failed")
            return _median_ms(work, reps, setup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    n = args.workers
    report = {"workers": n, "tokens": TOKENS, "hidden": HIDDEN, "rank": RANK, "cores": len(cores)}
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    _pinned(cores[-1])
    report["one_core_full_ms"] = one_core_ms(TOKENS, RANK, HIDDEN, args.reps, cores[-1])
    report["one_core_part_ms"] = _median_ms(_part_work(n, 0), args.reps)
    report["one_core_fused_ms"] = _median_ms(_fused_work(), args.reps)
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)
    print(json.dumps(report), flush=True)
    report["concurrent_part"] = concurrent_part(n, cores, args.reps)
    print(json.dumps(report["concurrent_part"]), flush=True)
    report["threads_ms"] = threaded_ms(n, TOKENS, RANK, HIDDEN, args.reps)
    torch.set_num_threads(n)
    report["threads_fused_shrink_ms"] = _median_ms(_fused_work(), args.reps)
    torch.set_num_threads(threads)
    if len(cores) > n:  # as the engine: its thread keeps off the workers' cores
        os.sched_setaffinity(0, cores[n:])
    report["pool_groups_x_in_ms"] = pool(n, args.reps, TOKENS, True, cores)
    report["pool_groups_ms"] = pool(n, args.reps, TOKENS, False, cores)
    report["pool_group_1_token_ms"] = pool(n, args.reps, 1, False, cores)
    os.sched_setaffinity(0, affinity)
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
