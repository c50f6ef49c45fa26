"""Benchmark of the LoRA kernels (gpu_ops/bgmv.py, mbgmv.py, mbgmm.py) against apply_lora_ref.

Decode: 64 rows, each its own adapter, ranks drawn from 8..64, q_proj of a 7B model (4096 -> 4096),
bf16, weights in the unified page pool. Prefill: 2048 rows in 4 segments. Each figure is set against
the bytes the call must move over the device-to-device copy bandwidth measured in the same run.

    python3 bench/lora_kernels.py --out bench/results/lora_kernels.json
    python3 bench/lora_kernels.py --smoke   # tiny shapes on the CPU (Triton interpreter): checks the script

Timing: CUDA events, warm-up first, median of many; the inputs rotate over 4 layers of adapters
(~150 MB of weights, 3x the H100's 50 MB L2) and 4 activation buffers; random data, never zeros.
"graph" times replay a CUDA graph of many calls (device time); "eager" times Python launches back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lorad.gpu_ops import bgmv, mbgmm, mbgmv  # noqa: E402
from lorad.gpu_ops.lora import LoraBatch, apply_lora_ref  # noqa: E402
from lorad.gpu_ops.page_pool import AdapterTable, PagePool  # noqa: E402

Q = 0


class Timer:
    """Per-call times in microseconds: CUDA events on the GPU, perf_counter on the CPU (smoke)."""

    def __init__(self, device: torch.device, reps: int):
        self.cuda = device.type == "cuda"
        self.reps = reps

    def _span(self, body) -> float:
        if not self.cuda:
            start = time.perf_counter()
            body()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        body()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    def eager(self, calls: list, reps: int | None = None) -> float:
        for call in calls:  # warm-up: compilation, caches
            call()
        self._sync()

        def body():
            for call in calls:
                call()

        times = [self._span(body) for _ in range(reps or self.reps)]
        return statistics.median(times) / len(calls) * 1e3

    def graph(self, calls: list, repeat_inside: int, reps: int | None = None) -> float | None:
        """Device time per call from replays of one CUDA graph holding repeat_inside rounds of calls."""
        if not self.cuda:
            return None
        for call in calls:
            call()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat_inside):
                for call in calls:
                    call()
        graph.replay()
        self._sync()
        times = [self._span(graph.replay) for _ in range(reps or self.reps)]
        del graph
        return statistics.median(times) / (len(calls) * repeat_inside) * 1e3

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, timer: Timer, mebibytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    elements = mebibytes * (1 << 20) // 2
    source = torch.randn(elements, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    microseconds = timer.eager([lambda: target.copy_(source)], reps=max(10, timer.reps // 4))
    del source, target
    return 2 * elements * 2 / (microseconds * 1e-6) / 1e9


def build_table(page: int, hidden: int, ranks: list[int], layers: int, dtype, device, seed: int):
    """A pool holding len(ranks) adapters targeting q_proj in every layer, rank ranks[slot]."""
    shapes = [(hidden, hidden)] * 7
    generator = torch.Generator().manual_seed(seed)
    chunks = -(-hidden // page)
    pages = 1 + 2 * chunks * sum(ranks) * layers + 8
    pool = PagePool(pages, page, dtype, device)
    table = AdapterTable(pool, len(ranks), layers, shapes)
    for slot, rank in enumerate(ranks):
        adapter = {}
        for layer in range(layers):
            a = torch.randn(rank, hidden, generator=generator) / hidden**0.5
            b = torch.randn(hidden, rank, generator=generator) / rank**0.5
            adapter[(layer, Q)] = (a, b)
        assert table.place(slot, adapter)
    return table


def lora_bytes(row_ranks: list[int], in_dim: int, out_dim: int, element: int) -> int:
    """The least bytes a call moves: each row's A and B^T rows once, x read, y read and written."""
    return element * (sum(row_ranks) * (in_dim + out_dim) + len(row_ranks) * (in_dim + 2 * out_dim))


def decode_bench(args, device, timer: Timer, bandwidth: float) -> dict:
    rng = np.random.default_rng(0)
    rows, hidden, layers = args.decode_rows, args.hidden, args.layers
    ranks = [int(r) for r in rng.integers(args.min_rank, args.max_rank + 1, size=rows)]
    dtype = torch.bfloat16
    table = build_table(args.page, hidden, ranks, layers, dtype, device, seed=1)
    batch = LoraBatch.build(list(range(rows)), device)
    max_rank = bgmv.batch_max_rank(batch, table)
    kv = hidden // 4
    xs = [torch.randn(rows, hidden, device=device, dtype=dtype) for _ in range(layers)]
    fused = [torch.randn(rows, hidden + 2 * kv, device=device, dtype=dtype) for _ in range(layers)]
    ys = [f[:, :hidden] for f in fused]  # q's columns of a fused qkv output: a strided view
    workspace = torch.empty(bgmv.workspace_numel(rows, max_rank), device=device)
    segments = mbgmm.Segments.build(batch, table)
    moved = lora_bytes(ranks, hidden, hidden, 2)
    flops = 2 * sum(ranks) * 2 * hidden
    floor_us = moved / (bandwidth * 1e9) * 1e6

    def calls(fn):
        return [lambda layer=layer: fn(xs[layer], ys[layer], layer) for layer in range(layers)]

    methods = {
        "mbgmv": lambda x, y, layer: mbgmv.lora_decode(x, y, layer, Q, batch, table, max_rank=max_rank, workspace=workspace),
        "bgmv": lambda x, y, layer: bgmv.bgmv(x, y, layer, Q, batch.row_slot, table, max_rank, workspace),
        "mbgmm": lambda x, y, layer: mbgmm.lora_prefill(x, y, layer, Q, batch, table, segments=segments, workspace=workspace),
        "apply_lora_ref": lambda x, y, layer: apply_lora_ref(x, y, layer, Q, batch, table),
    }
    results = {}
    for name, fn in methods.items():
        is_ref = name == "apply_lora_ref"
        try:
            eager = timer.eager(calls(fn), reps=max(5, timer.reps // 10) if is_ref else None)
        except Exception as error:  # one broken method must not cost the run's other figures
            results[name] = {"error": repr(error)[:2000]}
            print(f"decode {name}: FAILED {error!r}"[:2000], flush=True)
            continue
        try:
            graph = timer.graph(calls(fn), repeat_inside=2 if is_ref else args.graph_rounds, reps=max(5, timer.reps // 10) if is_ref else None)
        except RuntimeError as error:  # a reference that cannot be captured is still timed eagerly
            graph = None
            print(f"graph capture of {name} failed: {error}", file=sys.stderr)
        best = graph if graph is not None else eager
        results[name] = {
            "eager_us": round(eager, 2),
            "graph_us": None if graph is None else round(graph, 2),
            "achieved_GBps": round(moved / (best * 1e-6) / 1e9, 1),
            "roofline_percent": round(100 * floor_us / best, 1),
        }
        print(f"decode {name:15s} eager {eager:9.2f} us  graph {graph if graph is None else round(graph, 2)} us  "
              f"{results[name]['roofline_percent']}% of roofline", flush=True)

    try:
        sweep = mbgmv_sweep(args, device, timer, table, batch, xs, ys, max_rank, moved, floor_us)
    except Exception as error:
        sweep = {"error": repr(error)[:2000]}
        print(f"mbgmv sweep: FAILED {error!r}"[:2000], flush=True)
    return {
        "rows": rows,
        "in_out": [hidden, hidden],
        "ranks": ranks,
        "mean_rank": round(sum(ranks) / rows, 2),
        "max_rank": max_rank,
        "dtype": "bfloat16",
        "layers_rotated": layers,
        "weight_bytes_all_layers": 2 * sum(ranks) * 2 * hidden * layers,
        "bytes_per_call": moved,
        "flops_per_call": flops,
        "roofline_floor_us": round(floor_us, 2),
        "methods": results,
        "mbgmv_sweep": sweep,
    }


def relative_error(result: torch.Tensor, before: torch.Tensor, expected: torch.Tensor) -> float:
    delta = result.float() - before.float()
    want = expected.float() - before.float()
    return float((delta - want).norm() / want.norm().clamp_min(1e-30))


def mbgmv_sweep(args, device, timer: Timer, table, batch, xs, ys, max_rank, moved, floor_us) -> dict:
    """Block shapes, warps and split counts of MBGMV's two kernels, timed apart (graph replays); every
    configuration's result is checked against the reference on one layer first."""
    rows, hidden = xs[0].shape
    layers = len(xs)
    row_slot = batch.row_slot
    splits_options = [s for s in (4, 8, 16) if s * 256 <= hidden] or [1]
    start = 0.1 * torch.randn_like(ys[0])  # fresh: the timed buffers have grown by many adds
    expected = start.clone()
    bgmv.lora_rows_ref(xs[0], expected, 0, Q, row_slot, table, max_rank)
    default_splits = splits_options[len(splits_options) // 2]

    def checked(shrink_config, expand_config, splits):
        v = torch.empty(splits, rows, max_rank, device=device)
        out = start.clone()
        mbgmv.mbgmv_shrink(xs[0], v, 0, Q, row_slot, table, max_rank, *shrink_config)
        mbgmv.mbgmv_expand(v, out, 0, Q, row_slot, table, max_rank, *expand_config)
        return round(relative_error(out, start, expected), 5)

    shrink, expand = [], []
    v_by_splits = {s: torch.randn(s, rows, max_rank, device=device) for s in splits_options}
    for block_r, block_k in ((16, 256), (16, 512), (16, 1024), (32, 256), (32, 128), (64, 128)):
        for warps in (4, 8):
            for splits in splits_options:
                config = (block_r, block_k, warps)
                try:
                    error = checked(config, (), splits)
                    v = v_by_splits[splits]
                    calls = [lambda layer=layer: mbgmv.mbgmv_shrink(xs[layer], v, layer, Q, row_slot, table, max_rank, *config) for layer in range(layers)]
                    us = timer.graph(calls, args.graph_rounds) or timer.eager(calls)
                except Exception as failure:
                    shrink.append({"block_r": block_r, "block_k": block_k, "num_warps": warps, "splits": splits, "error": repr(failure)[:300]})
                    continue
                shrink.append({"block_r": block_r, "block_k": block_k, "num_warps": warps, "splits": splits, "us": round(us, 2), "rel_error": error})
    v = v_by_splits[default_splits]
    for block_r, block_n in ((16, 256), (32, 256), (16, 512), (32, 128), (64, 64), (16, 128), (64, 128)):
        for warps in (4, 8):
            config = (block_r, block_n, warps)
            try:
                error = checked((), config, default_splits)
                calls = [lambda layer=layer: mbgmv.mbgmv_expand(v, ys[layer], layer, Q, row_slot, table, max_rank, *config) for layer in range(layers)]
                us = timer.graph(calls, args.graph_rounds) or timer.eager(calls)
            except Exception as failure:
                expand.append({"block_r": block_r, "block_n": block_n, "num_warps": warps, "error": repr(failure)[:300]})
                continue
            expand.append({"block_r": block_r, "block_n": block_n, "num_warps": warps, "us": round(us, 2), "rel_error": error})
    valid = lambda entry: "us" in entry and entry["rel_error"] < 2e-2  # noqa: E731
    best_shrink = min(filter(valid, shrink), key=lambda r: r["us"])
    best_expand = min(filter(valid, expand), key=lambda r: r["us"])
    shrink_config = (best_shrink["block_r"], best_shrink["block_k"], best_shrink["num_warps"])
    expand_config = (best_expand["block_r"], best_expand["block_n"], best_expand["num_warps"])
    v_best = v_by_splits[best_shrink["splits"]]

    def both(layer):
        mbgmv.mbgmv_shrink(xs[layer], v_best, layer, Q, row_slot, table, max_rank, *shrink_config)
        mbgmv.mbgmv_expand(v_best, ys[layer], layer, Q, row_slot, table, max_rank, *expand_config)

    calls = [lambda layer=layer: both(layer) for layer in range(layers)]
    us = timer.graph(calls, args.graph_rounds) or timer.eager(calls)
    eager = timer.eager(calls)
    error = checked(shrink_config, expand_config, best_shrink["splits"])
    print(f"decode mbgmv best blocks  graph {us:.2f} us  eager {eager:.2f} us  ({100 * floor_us / us:.1f}% of roofline, error {error})  "
          f"shrink {best_shrink}  expand {best_expand}", flush=True)
    return {
        "shrink": shrink,
        "expand": expand,
        "best_shrink": best_shrink,
        "best_expand": best_expand,
        "best_total_us": round(us, 2),
        "best_total_eager_us": round(eager, 2),
        "best_rel_error": error,
        "best_roofline_percent": round(100 * floor_us / us, 1),
    }


def mbgmm_sweep(args, device, timer: Timer, table, segments, xs, ys, floor_us) -> dict:
    """Tile shapes, warps, stages and splits of MBGMM's two kernels on the prefill batch, each
    checked against the reference first, timed apart (graph replays)."""
    rows, hidden = xs[0].shape
    max_rank = segments.max_rank
    start = 0.1 * torch.randn_like(ys[0])  # fresh: the timed buffers have grown by many adds
    expected = start.clone()
    mbgmm.mbgmm_ref(xs[0], expected, 0, Q, segments, table)

    def checked(shrink_config, expand_config, splits):
        v = torch.empty(splits, rows, max_rank, device=device)
        out = start.clone()
        mbgmm.mbgmm_shrink(xs[0], v, 0, Q, segments, table, *shrink_config)
        mbgmm.mbgmm_expand(v, out, 0, Q, segments, table, *expand_config)
        return round(relative_error(out, start, expected), 5)

    shrink, expand = [], []
    shrink_configs = [  # block_m, block_r, block_k, warps, stages
        (64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (128, 64, 64, 8, 3), (128, 64, 128, 8, 3),
        (64, 32, 128, 4, 4), (32, 64, 128, 4, 4), (128, 32, 64, 4, 3), (64, 64, 64, 4, 4),
    ]
    v_by_splits = {s: torch.randn(s, rows, max_rank, device=device) for s in (1, 2, 4)}
    for config in shrink_configs:
        for splits in (1, 2, 4):
            entry = dict(zip(("block_m", "block_r", "block_k", "num_warps", "num_stages"), config), splits=splits)
            try:
                entry["rel_error"] = checked(config, (), splits)
                v = v_by_splits[splits]
                calls = [lambda i=i: mbgmm.mbgmm_shrink(xs[i % 2], v, i, Q, segments, table, *config) for i in range(args.layers)]
                entry["us"] = round(timer.graph(calls, 4) or timer.eager(calls), 2)
            except Exception as failure:
                entry["error"] = repr(failure)[:300]
            shrink.append(entry)
    expand_configs = [  # block_m, block_r, block_n, warps, stages
        (64, 32, 128, 4, 2), (64, 64, 128, 4, 2), (128, 32, 128, 8, 2), (64, 32, 256, 8, 2),
        (128, 64, 256, 8, 2), (32, 32, 128, 4, 2), (64, 16, 128, 4, 3), (128, 32, 64, 4, 2),
    ]
    for config in expand_configs:
        for splits in (1, 4):
            entry = dict(zip(("block_m", "block_r", "block_n", "num_warps", "num_stages"), config), splits=splits)
            try:
                entry["rel_error"] = checked((), config, splits)
                v = v_by_splits[splits]
                calls = [lambda i=i: mbgmm.mbgmm_expand(v, ys[i % 2], i, Q, segments, table, *config) for i in range(args.layers)]
                entry["us"] = round(timer.graph(calls, 4) or timer.eager(calls), 2)
            except Exception as failure:
                entry["error"] = repr(failure)[:300]
            expand.append(entry)
    valid = lambda entry: "us" in entry and entry["rel_error"] < 2e-2  # noqa: E731
    result = {"shrink": shrink, "expand": expand}
    for splits in (1, 2, 4):
        candidates_shrink = [e for e in shrink if valid(e) and e["splits"] == splits]
        candidates_expand = [e for e in expand if valid(e) and e["splits"] == min(splits, 4) and splits in (1, 4)]
        if not candidates_shrink or not candidates_expand:
            continue
        best_shrink = min(candidates_shrink, key=lambda e: e["us"])
        best_expand = min(candidates_expand, key=lambda e: e["us"])
        shrink_config = tuple(best_shrink[k] for k in ("block_m", "block_r", "block_k", "num_warps", "num_stages"))
        expand_config = tuple(best_expand[k] for k in ("block_m", "block_r", "block_n", "num_warps", "num_stages"))
        v_best = v_by_splits[splits]

        def both(i):
            mbgmm.mbgmm_shrink(xs[i % 2], v_best, i, Q, segments, table, *shrink_config)
            mbgmm.mbgmm_expand(v_best, ys[i % 2], i, Q, segments, table, *expand_config)

        calls = [lambda i=i: both(i) for i in range(args.layers)]
        us = timer.graph(calls, 4) or timer.eager(calls)
        error = checked(shrink_config, expand_config, splits)
        result[f"best_splits_{splits}"] = {"shrink": best_shrink, "expand": best_expand, "total_us": round(us, 2),
                                           "rel_error": error, "roofline_percent": round(100 * floor_us / us, 1)}
        print(f"prefill mbgmm best (splits {splits}) graph {us:.2f} us ({100 * floor_us / us:.1f}% of the bytes roofline, error {error})  "
              f"shrink {best_shrink}  expand {best_expand}", flush=True)
    return result


def prefill_bench(args, device, timer: Timer, bandwidth: float) -> dict:
    hidden, layers = args.hidden, args.layers
    segment_ranks = [16, 64, 8, 32]
    rows = args.prefill_rows
    dtype = torch.bfloat16
    table = build_table(args.page, hidden, segment_ranks, layers, dtype, device, seed=2)
    per = rows // len(segment_ranks)
    row_slots = [min(t // per, len(segment_ranks) - 1) for t in range(rows)]
    batch = LoraBatch.build(row_slots, device)
    segments = mbgmm.Segments.build(batch, table)
    max_rank = segments.max_rank
    xs = [torch.randn(rows, hidden, device=device, dtype=dtype) for _ in range(2)]
    ys = [torch.randn(rows, hidden, device=device, dtype=dtype) for _ in range(2)]
    workspace = torch.empty(bgmv.workspace_numel(rows, max_rank), device=device)
    row_ranks = [segment_ranks[s] for s in row_slots]
    moved = 2 * (sum(segment_ranks) * 2 * hidden + rows * 3 * hidden)
    flops = 2 * sum(row_ranks) * 2 * hidden
    floor_us = moved / (bandwidth * 1e9) * 1e6

    def calls(fn):
        return [lambda i=i: fn(xs[i % 2], ys[i % 2], i % layers) for i in range(layers)]

    methods = {
        "mbgmm": lambda x, y, layer: mbgmm.lora_prefill(x, y, layer, Q, batch, table, segments=segments, workspace=workspace),
        "mbgmv": lambda x, y, layer: mbgmv.lora_decode(x, y, layer, Q, batch, table, max_rank=max_rank, workspace=workspace),
        "apply_lora_ref": lambda x, y, layer: apply_lora_ref(x, y, layer, Q, batch, table),
    }
    results = {}
    for name, fn in methods.items():
        try:
            eager = timer.eager(calls(fn))
        except Exception as error:
            results[name] = {"error": repr(error)[:2000]}
            print(f"prefill {name}: FAILED {error!r}"[:2000], flush=True)
            continue
        try:
            graph = timer.graph(calls(fn), repeat_inside=4)
        except RuntimeError as error:
            graph = None
            print(f"graph capture of {name} failed: {error}", file=sys.stderr)
        best = graph if graph is not None else eager
        results[name] = {
            "eager_us": round(eager, 2),
            "graph_us": None if graph is None else round(graph, 2),
            "achieved_GBps": round(moved / (best * 1e-6) / 1e9, 1),
            "achieved_TFLOPs": round(flops / (best * 1e-6) / 1e12, 2),
            "roofline_percent": round(100 * floor_us / best, 1),
        }
        print(f"prefill {name:15s} eager {eager:9.2f} us  graph {graph if graph is None else round(graph, 2)} us  "
              f"{results[name]['roofline_percent']}% of the bytes roofline", flush=True)
    try:
        sweep = mbgmm_sweep(args, device, timer, table, segments, xs, ys, floor_us)
    except Exception as error:
        sweep = {"error": repr(error)[:2000]}
        print(f"mbgmm sweep: FAILED {error!r}"[:2000], flush=True)
    return {
        "mbgmm_sweep": sweep,
        "rows": rows,
        "segments": [[slot, length] for slot, length in zip(segments.slots, segments.lengths)],
        "segment_ranks": segment_ranks,
        "in_out": [hidden, hidden],
        "dtype": "bfloat16",
        "bytes_per_call": moved,
        "flops_per_call": flops,
        "roofline_floor_us": round(floor_us, 2),
        "methods": results,
    }


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed: checks the script runs")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("no GPU: run on the GPU machine (bench/gpu_check.sh), or with --smoke")
    if args.smoke:
        args.page = args.hidden = 64
        args.decode_rows, args.prefill_rows, args.layers = 4, 32, 2
        args.min_rank, args.max_rank, args.graph_rounds = 8, 24, 1
        timer, copy_mib = Timer(device, reps=2), 1
    else:
        args.page = args.hidden = 4096
        args.decode_rows, args.prefill_rows, args.layers = 64, 2048, 4
        args.min_rank, args.max_rank, args.graph_rounds = 8, 64, 16
        timer, copy_mib = Timer(device, reps=100), 1024
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device, timer, copy_mib)
    print(f"device-to-device copy: {bandwidth:.0f} GB/s (read + write)", flush=True)
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine(device),
        "copy_bandwidth_GBps": round(bandwidth, 1),
        "decode": decode_bench(args, device, timer, bandwidth),
        "prefill": prefill_bench(args, device, timer, bandwidth),
    }
    decode, prefill = report["decode"], report["prefill"]
    print("\n| case | method | eager us | graph us | % of HBM roofline |")
    print("| --- | --- | --- | --- | --- |")
    for case, section in (("decode", decode), ("prefill", prefill)):
        for name, result in section["methods"].items():
            if "error" in result:
                print(f"| {case} | {name} | failed | | |")
                continue
            print(f"| {case} | {name} | {result['eager_us']} | {result['graph_us']} | {result['roofline_percent']} |")
    print(f"decode floor {decode['roofline_floor_us']} us, prefill floor {prefill['roofline_floor_us']} us, copy {bandwidth:.0f} GB/s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
