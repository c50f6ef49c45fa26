"""MBGMM's launch choices on the shapes of a 2048-token prompt step: the shrink's split-K and the expand's output
tiles a program, each combination checked against `mbgmm_ref` and timed apart (CUDA-graph replays over 4 layers of
adapters), beside an earlier gpu_ops/mbgmm.py on the same inputs.

Labels: `n_per=N wW sS` is the expand with N output tiles a program (None: `mbgmm.expand_groups`' choice), W warps
and S stages, the shrink at the splits named beside it. Cases, on the 7B projections q (4096 -> 4096), up (4096 -> 11008) and down (11008 -> 4096), bf16, 2048 rows:
- 8 segments of 256 rows, rank 16, over the fixed 64-row tile list and rank tier 16 of the prefill graphs
  (the engine's prompt steps);
- 4 segments of 512 rows, ranks 16 / 64 / 8 / 32 (the workspace 64 wide).
Floors: the shrink's bytes (x read, A read) and the expand's (y read and written, B^T read) over the copy
bandwidth measured in the same run.
    python3 bench/mbgmm_configs.py --out OUT.json [--baseline OLD_MBGMM.py]
    python3 bench/mbgmm_configs.py --smoke   # tiny shapes on the CPU (Triton interpreter): checks the script
--baseline: `git show REV:gpu_ops/mbgmm.py > OLD.py`, timed with its own launch choices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lora_kernels import build_table  # noqa: E402  (bench/, beside this script)
from timing import Timer, copy_bandwidth, load_module_file  # noqa: E402

from lorad.gpu_ops import mbgmm  # noqa: E402
from lorad.gpu_ops.lora import LoraBatch  # noqa: E402

Q = 0
CASES = (("8 x 256 rows, rank 16, graph tiles, tier 16", [16] * 8, True), ("4 x 512 rows, ranks 16/64/8/32", [16, 64, 8, 32], False))
SPLITS = (4, 8, 16)
TILES_A_PROGRAM = (None, 1, 2, 4, 8)  # None: mbgmm.expand_groups' choice
WARPS_STAGES = ((4, 3), (4, 2), (8, 3), (4, 4))  # the expand's, swept at 8 splits with its own tile choice
SHRINK_TILES = ((64, 4), (128, 4), (256, 3))  # the shrink's K tile and stages, at 8 splits


def segments_for(ranks: list[int], rows: int, in_dim: int, out_dim: int, layers: int, graph_tiles: bool, page: int, device):
    """(table, the segments the kernels read, the segments the reference reads): with graph_tiles, a tile list
    of 64-row tiles at the rank tier of 16, as daemon/engine/prefill_graphs.py builds them."""
    per = rows // len(ranks)
    row_slots = [min(t // per, len(ranks) - 1) for t in range(rows)]
    table = build_table(page, in_dim, out_dim, ranks, layers, torch.bfloat16, device, seed=1)
    plain = mbgmm.Segments.build(LoraBatch.build(row_slots, device), table)
    if not graph_tiles:
        return table, plain, plain
    tiles = [(s, m0) for s, length in enumerate(plain.lengths) for m0 in range(0, length, mbgmm.GRAPH_BLOCK_M)]
    tile_list = torch.tensor(tiles, dtype=torch.int32, device=device).t().contiguous()
    graph = mbgmm.Segments(plain.rows, plain.meta, plain.slots, [rows], max(ranks), tiles=tile_list, block_m=mbgmm.GRAPH_BLOCK_M)
    return table, graph, plain


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--baseline", help="an earlier gpu_ops/mbgmm.py, timed beside this one")
    parser.add_argument("--page", type=int, default=64, help="the pool's page in elements (the engine's: the hidden size)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, on the CPU when there is no GPU")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(device, reps=1 if args.smoke else 20, graph_on_cpu=True)
    bandwidth = copy_bandwidth(device, timer, 1 if args.smoke else 256)
    layers, rows = (2, 64) if args.smoke else (4, 2048)
    shapes = ((64, 128), (128, 64)) if args.smoke else ((4096, 4096), (4096, 11008), (11008, 4096))
    baseline = load_module_file(args.baseline, "mbgmm_baseline") if args.baseline else None
    results = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "copy_bandwidth_GBps": round(bandwidth, 1), "rows": rows, "cases": []}
    for in_dim, out_dim in shapes:
        for name, ranks, graph_tiles in CASES:
            table, segments, ref_segments = segments_for(ranks, rows, in_dim, out_dim, layers, graph_tiles, args.page, device)
            width = -(-segments.max_rank // 16) * 16
            xs = [torch.randn(rows, in_dim, device=device, dtype=torch.bfloat16) for _ in range(layers)]
            ys = [torch.randn(rows, out_dim + 256, device=device, dtype=torch.bfloat16)[:, :out_dim] for _ in range(layers)]
            start = 0.1 * torch.randn(rows, out_dim, device=device, dtype=torch.bfloat16)
            expected = start.clone()
            mbgmm.mbgmm_ref(xs[0], expected, 0, Q, ref_segments, table)
            case = {"in_out": [in_dim, out_dim], "case": name,
                    "floor_shrink_us": round((rows * in_dim + sum(ranks) * in_dim) * 2 / bandwidth / 1e3, 2),
                    "floor_expand_us": round((rows * out_dim * 2 + sum(ranks) * out_dim) * 2 / bandwidth / 1e3, 2),
                    "splits_chosen": mbgmm.mbgmm_splits(segments, in_dim, table.pool.page_elems, device), "runs": []}

            def run(label: str, shrink, expand, splits: int) -> None:
                v = torch.empty(splits, rows, width, device=device)
                out = start.clone()
                entry = {"label": label, "splits": splits}
                try:
                    shrink(xs[0], v, 0)
                    expand(v, out, 0)
                    delta = (expected.float() - start.float()).norm()
                    entry["rel_error"] = round(float((out.float() - expected.float()).norm() / delta), 5)
                    entry["shrink_us"] = round(timer.graph([lambda i=i: shrink(xs[i], v, i) for i in range(layers)], 4), 2)
                    entry["expand_us"] = round(timer.graph([lambda i=i: expand(v, ys[i], i) for i in range(layers)], 4), 2)
                    entry["total_us"] = round(entry["shrink_us"] + entry["expand_us"], 2)
                except Exception as error:  # noqa: BLE001  (a configuration that fails to compile is a result)
                    entry["error"] = repr(error)[:400]
                case["runs"].append(entry)
                print(in_dim, out_dim, name, entry, flush=True)

            for block_k, stages in SHRINK_TILES:
                run(f"shrink block_k={block_k} s{stages}", lambda x, v, i, block_k=block_k, stages=stages: mbgmm.mbgmm_shrink(
                    x, v, i, Q, segments, table, block_k=block_k, num_stages=stages),
                    lambda v, y, i: mbgmm.mbgmm_expand(v, y, i, Q, segments, table), 8)
            if baseline is not None:
                run("baseline", lambda x, v, i: baseline.mbgmm_shrink(x, v, i, Q, segments, table),
                    lambda v, y, i: baseline.mbgmm_expand(v, y, i, Q, segments, table),
                    baseline.mbgmm_splits(segments, in_dim, table.pool.page_elems, device))
            for splits in SPLITS:
                for per in TILES_A_PROGRAM:
                    for warps, stages in WARPS_STAGES:
                        if (per is not None or splits != 8) and (warps, stages) != WARPS_STAGES[0]:
                            continue
                        run(f"n_per={per} w{warps} s{stages}",
                            lambda x, v, i: mbgmm.mbgmm_shrink(x, v, i, Q, segments, table),
                            lambda v, y, i, per=per, warps=warps, stages=stages: mbgmm.mbgmm_expand(
                                v, y, i, Q, segments, table, n_per_program=per, num_warps=warps, num_stages=stages), splits)
            results["cases"].append(case)
    bad = [r for c in results["cases"] for r in c["runs"] if "error" in r or r["rel_error"] > 2e-2]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    if bad:
        print(f"{len(bad)} runs failed or disagree with mbgmm_ref", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
