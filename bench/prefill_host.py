"""Where an eager prefill's time goes: device time against host time, and the host time by function.

The profile (`lorad profile`) fits a prefill of 32..1024 tokens of the 7B shape at ~30 ms whatever the
length, where its GEMMs take ~5 ms: the forward is bound by the host launching ~30 kernels a layer.
This bench measures, for a few prompt lengths, the eager forward's wall time (host-bound) against the
same forward replayed from a CUDA graph (device time alone) and through the engine's prefill graphs
(daemon/engine/prefill_graphs.py: padded to a token bucket, the host filling the static buffers), with and
without LoRA rows, and lists the Python functions the host spends the eager forward in (cProfile).

    python3 bench/prefill_host.py --out OUT/prefill_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import numpy as np
import torch
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec, dummy_weights
from lorad.daemon.engine.decode_graphs import capture
from lorad.daemon.bench.profile import Bench, Plan


def wall_ms(run, reps: int, drain_after: bool = True) -> float:
    """Median wall time of run(), the device drained before it and (drain_after) after it: what a step
    costs; without drain_after, the host's time alone (launches queue up on the device)."""
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if cuda and drain_after:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def host_ms(run, reps: int) -> float:
    return wall_ms(run, reps, drain_after=False)


def graph_ms(run, reps: int) -> float | None:
    """Device time of run() captured once into a CUDA graph and replayed (no host launches)."""
    if not torch.cuda.is_available():
        return None
    graph, _, _ = capture(run, warmups=1)
    return wall_ms(graph.replay, reps)


def kernel_table(run) -> str:
    """The device time of run()'s kernels, by kernel (torch.profiler sees inside graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--tokens", default="32,128,512")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    tokens = [int(t) for t in args.tokens.split(",")]
    plan = Plan(batch_sizes=(1,), ranks=(args.rank,), step_batch_sizes=(1,), contexts=(max(tokens),), prefill_tokens=tuple(tokens),
                rounds=1, variants=1, reps=1, step_reps=1, prefill_reps=1, bank_bytes=256 << 20)
    weights = dummy_weights(spec, dtype, device)
    bench = Bench(spec, weights, dtype, device, plan, max_lora_rank=max(64, args.rank), seed=0)
    bench.bank.load(np.asarray([args.rank]), 1)
    first, count = bench.kv_pages
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "model": args.model_config, "rank": args.rank, "rows": []}
    profiles, kernel_tables = {}, {}
    for n in tokens:
        blocks = -(-n // bench.kv.tokens_per_page)
        block_pages = bench.rng.integers(first, first + count, size=(1, blocks, spec.num_layers, 2), dtype=np.int32)
        for label, slot in (("lora", 0), ("base", -1)):
            step = bench.step([(n, n, slot)], block_pages)

            def run(step=step):
                bench.model.forward(step, bench.kv.view, bench.table)

            run()
            run()
            row = {"tokens": n, "rows": label, "wall_ms": wall_ms(run, args.reps), "host_ms": host_ms(run, args.reps),
                   "graph_ms": graph_ms(run, args.reps)}
            if device.type == "cuda":  # the engine's path: its prefill graphs, the host filling their buffers
                from lorad.daemon.engine.step_plan import StepPlan

                graphs = bench._prefill_graphs()
                seqs = StepPlan([bench.rng.integers(0, spec.vocab_size, size=n)], np.array([0]), np.array([slot]),
                                [block_pages[0]], np.array([True]))
                row["prefill_graphs_ms"] = wall_ms(lambda seqs=seqs, graphs=graphs: graphs.run(seqs), args.reps)
                row["prefill_graphs_key"] = list(graphs.last_key)
                if label == "lora":  # the kernels of both graphs, by device time
                    fill_ms = host_ms(lambda seqs=seqs, graphs=graphs: graphs.fill(seqs), args.reps)
                    row["prefill_graphs_fill_ms"] = fill_ms
                    kernel_tables[f"{n} eager-captured"] = kernel_table(lambda run=run: graph_ms(run, 3))
                    kernel_tables[f"{n} prefill-graphs"] = kernel_table(lambda seqs=seqs, graphs=graphs: [graphs.run(seqs) for _ in range(3)])
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            if n == tokens[0]:
                profiler = cProfile.Profile()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                profiler.enable()
                for _ in range(3):
                    run()
                profiler.disable()
                text = io.StringIO()
                stats = pstats.Stats(profiler, stream=text)
                stats.sort_stats("tottime").print_stats(35)
                stats.sort_stats("cumulative").print_stats(35)
                profiles[label] = text.getvalue()
                print(text.getvalue(), flush=True)
    report["cprofile"] = profiles
    report["kernels"] = kernel_tables
    for name, table in kernel_tables.items():
        print(f"--- {name}\n{table}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
