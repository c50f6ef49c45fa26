"""Do this host's cores slow each other down? One split-group part of BENCHMARKS.md's figure 5.4 (q, k, v LoRA, 128
tokens, rank 64, 1/8 of the columns; bench/cpu_lora_diag.py) timed on each core alone, on every pair of
cores at once, and on sets of 8 cores at once. A pair whose members each run much slower together than
alone shares something (a physical core under two vCPUs, a cache, a power budget).

Usage: python3 bench/cpu_cores_diag.py [--reps 20] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import time

import torch

TOKENS, HIDDEN, RANK, PARTS = 128, 4096, 64, 8


def _work():
    generator = torch.Generator().manual_seed(0)
    step = HIDDEN // PARTS
    a = [torch.randn(step, RANK, generator=generator) for _ in range(3)]
    b = [torch.randn(RANK, step, generator=generator) for _ in range(3)]
    x = torch.randn(TOKENS, step, generator=generator)
    partial, out = torch.empty(TOKENS, RANK), torch.empty(TOKENS, step)

    def work() -> None:
        for a_part, b_part in zip(a, b):
            torch.mm(x, a_part, out=partial)
            torch.mm(partial, b_part, out=out)
    return work


def _child(core: int, reps: int, barrier, results) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    work = _work()
    for _ in range(3):
        work()
    times = []
    for _ in range(reps):
        barrier.wait()
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1e3)
    results.put((core, statistics.median(times)))


def together(cores: list[int], reps: int) -> dict[int, float]:
    """Median ms of the work on each core of `cores`, all running at once (each rep starts together)."""
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(len(cores)), context.Queue()
    children = [context.Process(target=_child, args=(core, reps, barrier, results)) for core in cores]
    for child in children:
        child.start()
    measured = dict(results.get(timeout=120) for _ in children)
    for child in children:
        child.join(30)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    alone = {core: together([core], args.reps)[core] for core in cores}
    print("alone", json.dumps({c: round(v, 3) for c, v in alone.items()}), flush=True)
    pairs = {}
    for i, j in itertools.combinations(cores, 2):
        measured = together([i, j], args.reps)
        pairs[f"{i},{j}"] = max(measured[i] / alone[i], measured[j] / alone[j])
    worst = sorted(pairs.items(), key=lambda item: -item[1])[:16]
    print("pairs: slowest (max slowdown of the two)", json.dumps([(p, round(s, 2)) for p, s in worst]), flush=True)
    sets = {}
    half = len(cores) // 2
    for name, chosen in (("first half", cores[:half]), ("second half", cores[half:]),
                         ("even", cores[0::2]), ("odd", cores[1::2]), ("all", cores)):
        measured = together(chosen, args.reps)
        sets[name] = {"cores": chosen, "slowest_ms": max(measured.values()),
                      "mean_slowdown": statistics.mean(measured[c] / alone[c] for c in chosen),
                      "each_ms": [round(measured[c], 3) for c in chosen]}
        print(name, json.dumps(sets[name]), flush=True)
    report = {"alone_ms": alone, "pair_slowdown": pairs, "sets": sets}
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
