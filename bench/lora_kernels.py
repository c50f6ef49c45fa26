"""Benchmark of the LoRA kernels (gpu_ops/bgmv.py, mbgmv.py, mbgmm.py) against apply_lora_ref.

Decode: 64 rows, each its own adapter, ranks drawn from 8..64, q_proj of a 7B model (4096 -> 4096),
bf16, weights in the unified page pool; then MBGMV's tiles swept on each projection shape (q/o, k/v
with GQA out 1024, gate/up 4096 -> 11008, down 11008 -> 4096). Prefill: 2048 rows in 4 segments. Each
figure is set against the bytes the call must move over the device-to-device copy bandwidth measured
in the same run.

    python3 bench/lora_kernels.py --out bench/results/lora_kernels.json [--baseline OLD_MBGMV.py]
    python3 bench/lora_kernels.py --smoke   # tiny shapes on the CPU (Triton interpreter): checks the script

--baseline times an earlier gpu_ops/mbgmv.py beside the current one (`git show REV:gpu_ops/mbgmv.py`).
Timing: CUDA events, warm-up first, median of many; the inputs rotate over 4 layers of adapters
(~150 MB of weights for q_proj, 3x the H100's 50 MB L2) and 4 activation buffers; random data, never
zeros. "graph" times replay a CUDA graph of many calls (device time); "eager" times Python launches
back to back.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import time

import numpy as np
import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lorad.gpu_ops import bgmv, launch, mbgmm, mbgmv  # noqa: E402
from timing import Timer, copy_bandwidth, load_module_file  # noqa: E402  (bench/timing.py, beside this script)
from lorad.gpu_ops.lora import LoraBatch, apply_lora_ref  # noqa: E402
from lorad.gpu_ops.page_pool import AdapterTable, PagePool  # noqa: E402

Q = 0


ENGINE_MAX_RANK = 256  # EngineConfig.max_lora_rank's default


def build_table(page: int, in_dim: int, out_dim: int, ranks: list[int], layers: int, dtype, device, seed: int):
    """A pool holding len(ranks) adapters of rank ranks[slot] on projection 0 (in_dim -> out_dim) of
    every layer."""
    shapes = [(in_dim, out_dim)] * 7
    generator = torch.Generator().manual_seed(seed)
    chunks = -(-in_dim // page) + -(-out_dim // page)
    pages = 1 + chunks * sum(ranks) * layers + 8
    pool = PagePool(pages, page, dtype, device)
    table = AdapterTable(pool, len(ranks), layers, shapes)
    for slot, rank in enumerate(ranks):
        adapter = {}
        for layer in range(layers):
            a = torch.randn(rank, in_dim, generator=generator) / in_dim**0.5
            b = torch.randn(out_dim, rank, generator=generator) / rank**0.5
            adapter[(layer, Q)] = (a, b)
        assert table.place(slot, adapter)
    return table


def lora_bytes(row_ranks: list[int], in_dim: int, out_dim: int, element: int) -> int:
    """The least bytes a call moves: each row's A and B^T rows once, x read, y read and written."""
    return element * (sum(row_ranks) * (in_dim + out_dim) + len(row_ranks) * (in_dim + 2 * out_dim))


def load_baseline(path: str | None):
    """An earlier gpu_ops/mbgmv.py (e.g. `git show REV:gpu_ops/mbgmv.py > .devcarry/mbgmv_before.py`),
    timed beside the current one in the same run."""
    return load_module_file(path, "mbgmv_before") if path else None


class DecodeCase:
    """One decode benchmark input: `rows` rows, each its own adapter (ranks uniform in min..max_rank),
    on projection in_dim -> out_dim, rotating over args.layers layers; y a column slice of a wider output."""

    def __init__(self, args, device, in_dim: int, out_dim: int, bandwidth: float):
        rng = np.random.default_rng(0)  # the same ranks for every shape
        rows, layers = args.decode_rows, args.layers
        self.ranks = [int(r) for r in rng.integers(args.min_rank, args.max_rank + 1, size=rows)]
        self.in_dim, self.out_dim = in_dim, out_dim
        self.table = build_table(args.page, in_dim, out_dim, self.ranks, layers, torch.bfloat16, device, seed=in_dim + out_dim)
        self.batch = LoraBatch.build(list(range(rows)), device)
        self.max_rank = bgmv.batch_max_rank(self.batch, self.table)
        self.xs = [torch.randn(rows, in_dim, device=device, dtype=torch.bfloat16) for _ in range(layers)]
        fused = [torch.randn(rows, out_dim + 256, device=device, dtype=torch.bfloat16) for _ in range(layers)]
        self.ys = [f[:, :out_dim] for f in fused]  # a strided view, as a fused qkv output's q columns
        self.workspace = torch.empty(bgmv.workspace_numel(rows, self.max_rank), device=device)
        self.moved = lora_bytes(self.ranks, in_dim, out_dim, 2)
        self.floor_us = self.moved / (bandwidth * 1e9) * 1e6
        self.start = 0.1 * torch.randn_like(self.ys[0])  # fresh: the timed buffers grow by many adds
        self.expected = self.start.clone()
        bgmv.bgmv_ref(self.xs[0], self.expected, 0, Q, self.batch.row_slot, self.table, self.max_rank)

    def calls(self, fn) -> list:
        return [lambda layer=layer: fn(self.xs[layer], self.ys[layer], layer) for layer in range(len(self.xs))]

    def error(self, fn) -> float:
        out = self.start.clone()
        fn(self.xs[0], out, 0)
        return round(relative_error(out, self.start, self.expected), 5)

    def figures(self, us: float) -> dict:
        return {"achieved_GBps": round(self.moved / (us * 1e-6) / 1e9, 1), "roofline_percent": round(100 * self.floor_us / us, 1)}


def decode_methods(case: DecodeCase, baseline) -> dict:
    """Every decode implementation on one case, by name: fn(x, y, layer)."""
    table, batch, max_rank, workspace = case.table, case.batch, case.max_rank, case.workspace
    segments = mbgmm.Segments.build(batch, table)
    methods = {
        "mbgmv": lambda x, y, layer: mbgmv.lora_decode(x, y, layer, Q, batch, table, max_rank=max_rank, workspace=workspace),
    }
    if launch.pdl_unavailable(case.xs[0].device) is None:  # the expand launched early, as the engine does on Hopper
        methods["mbgmv_pdl"] = lambda x, y, layer: mbgmv.lora_decode(x, y, layer, Q, batch, table, max_rank=max_rank,
                                                                      workspace=workspace, pdl=True)
        if max_rank < ENGINE_MAX_RANK:  # the same rows launched at the engine's default maximum rank, as a graph captured for it
            wide = torch.empty(bgmv.workspace_numel(len(case.ranks), ENGINE_MAX_RANK), device=workspace.device)
            methods[f"mbgmv_pdl_launched_at_{ENGINE_MAX_RANK}"] = lambda x, y, layer: mbgmv.lora_decode(
                x, y, layer, Q, batch, table, max_rank=ENGINE_MAX_RANK, workspace=wide, pdl=True)
    if baseline is not None:
        methods["mbgmv_before"] = lambda x, y, layer: baseline.lora_decode(x, y, layer, Q, batch, table, max_rank=max_rank, workspace=workspace)
    methods["bgmv"] = lambda x, y, layer: bgmv.bgmv(x, y, layer, Q, batch.row_slot, table, max_rank, workspace)
    methods["mbgmm"] = lambda x, y, layer: mbgmm.lora_prefill(x, y, layer, Q, batch, table, segments=segments, workspace=workspace)
    methods["apply_lora_ref"] = lambda x, y, layer: apply_lora_ref(x, y, layer, Q, batch, table)
    return methods


def decode_bench(args, device, timer: Timer, bandwidth: float, baseline) -> dict:
    """q_proj: every method, eager and graph, each checked against the reference."""
    case = DecodeCase(args, device, args.hidden, args.hidden, bandwidth)
    results = {}
    for name, fn in decode_methods(case, baseline).items():
        is_ref = name == "apply_lora_ref"
        reps = max(5, timer.reps // 10) if is_ref else None
        try:
            error = case.error(fn)
            eager = timer.eager(case.calls(fn), reps=reps)
        except Exception as failure:  # one broken method must not cost the run's other figures
            results[name] = {"error": repr(failure)[:2000]}
            print(f"decode {name}: FAILED {failure!r}"[:2000], flush=True)
            continue
        try:
            graph = timer.graph(case.calls(fn), repeat_inside=2 if is_ref else args.graph_rounds, reps=reps)
        except RuntimeError as failure:  # a reference that cannot be captured is still timed eagerly
            graph = None
            print(f"graph capture of {name} failed: {failure}", file=sys.stderr)
        results[name] = {"eager_us": round(eager, 2), "graph_us": None if graph is None else round(graph, 2), "rel_error": error,
                         **case.figures(graph if graph is not None else eager)}
        print(f"decode {name:18s} eager {eager:9.2f} us  graph {graph if graph is None else round(graph, 2)} us  "
              f"{results[name]['roofline_percent']}% of roofline  error {error}", flush=True)
    ranks = case.ranks
    return {
        "rows": len(ranks),
        "in_out": [case.in_dim, case.out_dim],
        "ranks": ranks,
        "mean_rank": round(sum(ranks) / len(ranks), 2),
        "max_rank": case.max_rank,
        "dtype": "bfloat16",
        "layers_rotated": len(case.xs),
        "weight_bytes_all_layers": 2 * sum(ranks) * (case.in_dim + case.out_dim) * len(case.xs),
        "bytes_per_call": case.moved,
        "flops_per_call": 2 * sum(ranks) * (case.in_dim + case.out_dim),
        "roofline_floor_us": round(case.floor_us, 2),
        "methods": results,
    }


def relative_error(result: torch.Tensor, before: torch.Tensor, expected: torch.Tensor) -> float:
    delta = result.float() - before.float()
    want = expected.float() - before.float()
    return float((delta - want).norm() / want.norm().clamp_min(1e-30))


# Candidates of the per-shape sweep: the shrink's (rank rows, columns, warps) and the expand's (rank
# rows, columns, warps), each kernel timed apart, then the best pair timed together.
# gpu_ops/mbgmv.py's TUNED table comes from this sweep.
SHRINK_TILES = [(16, 512, 4), (16, 1024, 4), (8, 1024, 4), (16, 1024, 8), (8, 2048, 4), (8, 2048, 8), (16, 2048, 8), (32, 1024, 8), (4, 4096, 4)]
EXPAND_TILES = [(64, 128, 4), (64, 64, 4), (64, 256, 4), (64, 256, 8), (64, 512, 8), (32, 256, 4), (32, 512, 8), (16, 512, 4)]
# Batches of ranks <= 16 (the engine's low-rank decode graphs): one 16-row rank tile, wider columns.
EXPAND_TILES_LOW_RANK = [(16, 128, 4), (16, 256, 4), (16, 512, 4), (16, 1024, 4), (16, 1024, 8), (16, 2048, 8), (16, 256, 2)]


def shape_sweep(args, device, timer: Timer, bandwidth: float, baseline, deadline: float) -> dict:
    """Each projection shape of a 7B model: the shipped config, the baseline, the shrink and expand
    tiles timed apart (graph replays) and the best pair together; every whole call checked against
    the reference. Stops starting new measurements past `deadline`."""
    report = {}
    for name, (in_dim, out_dim) in args.shapes.items():
        if time.monotonic() > deadline:
            report[name] = {"skipped": "time budget"}
            continue
        case = DecodeCase(args, device, in_dim, out_dim, bandwidth)
        table, batch, max_rank, workspace = case.table, case.batch, case.max_rank, case.workspace
        row_slot, page = batch.row_slot, table.pool.page_elems
        shipped = mbgmv.decode_config(in_dim, out_dim, max_rank)
        entries, shrinks, expands = [], [], []

        def run_config(config, pdl=False):
            return lambda x, y, layer: mbgmv.mbgmv(x, y, layer, Q, row_slot, table, max_rank, workspace, config=config, pdl=pdl)

        def measure(label: str, fn, config=None, check=True, into=entries, **fields):
            entry = {"label": label, **fields, **({} if config is None else dataclasses.asdict(config))}
            if time.monotonic() > deadline:
                entry["skipped"] = "time budget"
                into.append(entry)
                return entry
            try:
                if check:
                    entry["rel_error"] = case.error(fn)
                us = timer.graph(case.calls(fn), args.graph_rounds, reps=max(5, timer.reps * 3 // 10)) or timer.eager(case.calls(fn))
                entry.update(us=round(us, 2), **case.figures(us))
            except Exception as failure:
                entry["error"] = repr(failure)[:300]
            into.append(entry)
            print(f"  {name} {label:8s} {entry.get('us')} us {entry.get('roofline_percent')}% err {entry.get('rel_error')} "
                  f"{entry.get('error', '')} {fields or ''} {'' if config is None else config}", flush=True)
            return entry

        def splits_of(config) -> int:
            return mbgmv._shrink_plan(page, in_dim, None, config)[0]

        def view(splits: int):
            return bgmv.workspace_view(workspace, splits, len(case.ranks), max_rank, device)

        print(f"decode sweep {name} {in_dim}->{out_dim}: floor {case.floor_us:.2f} us", flush=True)
        measure("shipped", run_config(shipped), shipped)
        pdl_pairs = []
        shipped_pdl = mbgmv.decode_config(in_dim, out_dim, max_rank, True)  # the tiles the engine takes with PDL
        if args.pdl_pairs:  # the whole call with the expand launched early (lora_pdl on), per tile pair
            measure("shipped-pdl", run_config(shipped_pdl, True), shipped_pdl)
            for (block_r, block_k, warps), (er, bn, ew) in itertools.product(SHRINK_TILES, EXPAND_TILES_LOW_RANK if max_rank <= 16 else EXPAND_TILES):
                config = mbgmv.DecodeConfig(shrink_r=block_r, block_k=block_k, num_warps=warps, expand_r=er, block_n=bn, expand_warps=ew)
                measure("pdl-pair", run_config(config, True), config, into=pdl_pairs)
            measure("shipped", run_config(shipped), shipped)  # again: the drift over the sweep
            measure("shipped-pdl", run_config(shipped_pdl, True), shipped_pdl)
        if baseline is not None:
            measure("before", lambda x, y, layer: baseline.lora_decode(x, y, layer, Q, batch, table, max_rank=max_rank, workspace=workspace))
        for block_r, block_k, warps in SHRINK_TILES:  # alone: the figure counts the whole call's bytes
            config = mbgmv.DecodeConfig(shrink_r=block_r, block_k=block_k, num_warps=warps)
            v = view(splits_of(config))
            measure("shrink", lambda x, y, layer, v=v, t=(block_r, block_k, warps): mbgmv.mbgmv_shrink(x, v, layer, Q, row_slot, table, max_rank, *t),
                    check=False, into=shrinks, shrink=[block_r, block_k, warps], splits=v.shape[0])
        v_shipped = view(splits_of(shipped))
        mbgmv.mbgmv_shrink(case.xs[0], v_shipped, 0, Q, row_slot, table, max_rank, shipped.shrink_r, shipped.block_k, shipped.num_warps)
        for block_r, block_n, warps in (EXPAND_TILES_LOW_RANK if max_rank <= 16 else EXPAND_TILES):
            measure("expand", lambda x, y, layer, t=(block_r, block_n, warps): mbgmv.mbgmv_expand(v_shipped, y, layer, Q, row_slot, table, max_rank, *t),
                    check=False, into=expands, expand=[block_r, block_n, warps])
        timed = lambda group: [e for e in group if "us" in e]  # noqa: E731
        if timed(shrinks) and timed(expands):
            (sr, bk, sw), (er, bn, ew) = min(timed(shrinks), key=lambda e: e["us"])["shrink"], min(timed(expands), key=lambda e: e["us"])["expand"]
            pair = mbgmv.DecodeConfig(shrink_r=sr, block_k=bk, num_warps=sw, expand_r=er, block_n=bn, expand_warps=ew)
            measure("pair", run_config(pair), pair)
            measure("pair", run_config(pair), pair)  # twice: the spread between identical runs
        valid = [e for e in entries if "us" in e and e["rel_error"] < 2e-2 and e["label"] != "before"]
        best = min(valid, key=lambda e: e["us"]) if valid else None
        report[name] = {"in_out": [in_dim, out_dim], "bytes_per_call": case.moved, "roofline_floor_us": round(case.floor_us, 2),
                        "entries": entries, "shrink_alone": shrinks, "expand_alone": expands, "best": best}
        if pdl_pairs:
            checked = [e for e in pdl_pairs if "us" in e and e["rel_error"] < 2e-2]
            report[name].update(pdl_pairs=pdl_pairs, best_pdl=min(checked, key=lambda e: e["us"]) if checked else None)
        del case
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return report


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
    table = build_table(args.page, hidden, hidden, segment_ranks, layers, dtype, device, seed=2)
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
        sweep = mbgmm_sweep(args, device, timer, table, segments, xs, ys, floor_us) if args.prefill_sweep else {"skipped": "no --prefill-sweep"}
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
    parser.add_argument("--baseline", help="an earlier gpu_ops/mbgmv.py to time beside the current one")
    parser.add_argument("--no-sweep", action="store_true", help="skip the per-shape MBGMV tile sweep")
    parser.add_argument("--prefill-sweep", action="store_true", help="also sweep MBGMM's tiles")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting sweep configs after this many seconds")
    parser.add_argument("--ranks", help="LOW,HIGH: the decode rows' ranks (default 8,64); 16,16 sweeps the low-rank tiles")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill (MBGMM) figures")
    parser.add_argument("--pdl-pairs", action="store_true",
                        help="per shape, the whole call with the expand launched early (PDL) for every shrink x expand tile")
    parser.add_argument("--only-shapes", help="the sweep's shapes, a comma-separated subset of q_proj,down_proj,gate_proj,k_proj")
    args = parser.parse_args()
    began = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("no GPU: run on the GPU machine (bench/gpu_check.sh), or with --smoke")
    if args.smoke:
        args.page = args.hidden = 64
        args.shapes = {"q_proj": (64, 64), "down_proj": (160, 64)}
        args.decode_rows, args.prefill_rows, args.layers = 4, 32, 2
        args.min_rank, args.max_rank, args.graph_rounds = 8, 24, 1
        timer, copy_mib = Timer(device, reps=2), 1
    else:
        args.page = args.hidden = 4096
        args.shapes = {"q_proj": (4096, 4096), "down_proj": (11008, 4096), "gate_proj": (4096, 11008), "k_proj": (4096, 1024)}
        args.decode_rows, args.prefill_rows, args.layers = 64, 2048, 4
        args.min_rank, args.max_rank, args.graph_rounds = 8, 64, 16
        timer, copy_mib = Timer(device, reps=100), 1024
    if args.ranks:
        args.min_rank, args.max_rank = (int(r) for r in args.ranks.split(","))
    if args.only_shapes:
        args.shapes = {name: shape for name, shape in args.shapes.items() if name in args.only_shapes.split(",")}
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device, timer, copy_mib)
    print(f"device-to-device copy: {bandwidth:.0f} GB/s (read + write)", flush=True)
    baseline = load_baseline(args.baseline)
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine(device),
        "copy_bandwidth_GBps": round(bandwidth, 1),
        "decode": decode_bench(args, device, timer, bandwidth, baseline),
    }
    if not args.no_sweep:
        report["decode_shapes"] = shape_sweep(args, device, timer, bandwidth, baseline, began + args.budget_s)
    report["prefill"] = {"methods": {}, "roofline_floor_us": None} if args.no_prefill else prefill_bench(args, device, timer, bandwidth)
    decode, prefill = report["decode"], report["prefill"]
    print("\n| case | method | eager us | graph us | % of HBM roofline |")
    print("| --- | --- | --- | --- | --- |")
    for case, section in (("decode", decode), ("prefill", prefill)):
        for name, result in section["methods"].items():
            if "error" in result:
                print(f"| {case} | {name} | failed | | |")
                continue
            print(f"| {case} | {name} | {result['eager_us']} | {result['graph_us']} | {result['roofline_percent']} |")
    for name, section in report.get("decode_shapes", {}).items():
        if isinstance(section, dict) and section.get("best"):
            shipped = next((e for e in section["entries"] if e.get("label") == "shipped" and "us" in e), {})
            before = next((e for e in section["entries"] if e.get("label") == "before" and "us" in e), {})
            best = section["best"]
            print(f"| decode {name} {section['in_out']} | shipped {shipped.get('us')} us ({shipped.get('roofline_percent')}%) | "
                  f"best {best['us']} us ({best['roofline_percent']}%) | before {before.get('us')} us ({before.get('roofline_percent')}%) | "
                  f"best config {({k: best[k] for k in ('shrink_r', 'block_k', 'num_warps', 'expand_r', 'block_n', 'expand_warps')})}")
    print(f"decode floor {decode['roofline_floor_us']} us, prefill floor {prefill['roofline_floor_us']} us, copy {bandwidth:.0f} GB/s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
