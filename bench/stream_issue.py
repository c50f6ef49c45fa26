"""What queueing a streamed cold adapter's pages costs the host, by how scattered its pool pages are.

A streamed placement (AdapterTable.place_streamed, then `issue()`) queues each layer's pages as one DMA per run of
consecutive pool pages, before the forward that waits for them is launched: the host's time here delays that launch.
Once the KV cache has churned the free list, an adapter's pages come in many runs. This places a 7B rank-64 adapter
on q, k, v, o (32 layers, 512 pages a layer) into pools whose free pages come in runs of N, and times the host's
queueing (place_streamed + issue) and the wall time until the copies are done, by the two copy paths: `cuda-ext`, the
default (a layer in more than page_pool.MAX_DIRECT_RUNS runs queued by the CUDA extension, `cuda_ext.copy_rows`, in one
call; fewer by a torch copy a run) and `torch` (a torch copy a run, always); from pinned and from pageable memory.

    python3 bench/stream_issue.py --out OUT.json        # the GPU
    python3 bench/stream_issue.py --smoke               # the CPU: that it runs (a small model, no streaming)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from lorad.daemon.bench.report import machine, markdown_table
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, PROJECTIONS, ModelSpec
from lorad.gpu_ops import cuda_ext
from lorad.gpu_ops.page_pool import AdapterTable, PagePool, StagedAdapter, _run_array


def fragmented_pool(pages: int, page_elems: int, run: int, device: torch.device) -> PagePool:
    """A pool whose free pages are runs of `run` pages with as many taken between them (run 0: all free, one run)."""
    pool = PagePool(pages, page_elems, torch.bfloat16, device)
    if run:
        taken = pool.alloc(pool.num_free, "kv")
        pool.free(taken[((taken - taken[0]) // run) % 2 == 0], "kv")
    return pool


def adapter_weights(spec: ModelSpec, rank: int, targets: tuple[str, ...]) -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(spec.num_layers):
        for name in targets:
            proj = PROJECTIONS.index(name)
            in_dim, out_dim = spec.projection_shape(name)
            weights[(layer, proj)] = (torch.randn(rank, in_dim, generator=generator) * 0.01,
                                      torch.randn(out_dim, rank, generator=generator) * 0.01)
    return weights


def time_placements(table: AdapterTable, staged: StagedAdapter, reps: int) -> dict:
    """Host ms of place_streamed + issue, and wall ms until its copies are done, over `reps` placements."""
    host, wall, runs = [], [], 0
    for rep in range(reps + 1):  # the first: warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        load = table.place_streamed(0, staged)
        load.issue()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        if load.error is not None:
            raise RuntimeError(load.error)
        if rep == 0:
            got = table.pool.pages[torch.from_numpy(load.ids).long().to(table.pool.pages.device)].cpu()
            if not torch.equal(got, staged.pages.cpu()):
                raise AssertionError("the pool's pages differ from the staged adapter's")
            runs = len(_run_array(load.ids))
        else:
            host.append((queued - start) * 1e3)
            wall.append((done - start) * 1e3)
        table.evict(0)  # its pages back on top of the free list: the next placement gets the same ids
    return {"host_ms": statistics.median(host), "wall_ms": statistics.median(wall), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--runs", default="0,64,8,1", help="free pages in runs of N (0: one run)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the CPU: a small model, placements not streamed")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama" if args.smoke else args.model_config])
    targets = tuple(args.targets.split(","))
    shapes = [spec.projection_shape(p) for p in PROJECTIONS]
    weights = adapter_weights(spec, args.rank, targets)
    probe = AdapterTable(PagePool(2, spec.page_elems, torch.bfloat16, device), 1, spec.num_layers, shapes)
    needed = probe.pages_needed(weights)
    if args.smoke:
        table = AdapterTable(fragmented_pool(2 * needed + 2, spec.page_elems, 1, device), 1, spec.num_layers, shapes)
        assert table.place(0, weights)
        print(f"smoke: {needed} pages placed in {len(_run_array(table.placements[0].page_ids))} runs")
        return
    results = {"command": "python3 bench/stream_issue.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "smoke") and v is not None),
        "machine": machine(device), "model": args.model_config, "rank": args.rank, "targets": list(targets),
        "pages": needed, "layers": spec.num_layers, "extension": cuda_ext.rows_copy_path(), "rows": []}
    for run in (int(n) for n in args.runs.split(",")):
        pool = fragmented_pool(2 * needed + 2, spec.page_elems, run, device)
        table = AdapterTable(pool, 1, spec.num_layers, shapes)
        table.enable_streaming()
        pinned = table.stage(weights, pin=True)
        pageable = StagedAdapter(pinned.pages.clone(), pinned.layout)
        for source, staged in (("pinned", pinned), ("pageable", pageable)):
            for path in ("cuda-ext", "torch"):
                if path == "cuda-ext" and cuda_ext.rows_copy_path() != "cuda-ext":
                    continue
                table.copy_path = path if path == "cuda-ext" else "torch: chosen by the bench"
                row = {"free_runs_of": run or "one run", "source": source, "path": path,
                       **time_placements(table, staged, args.reps)}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        del table, pool
        torch.cuda.empty_cache()
    header = ["free pages in runs of", "source", "path", "runs an adapter", "host ms", "wall ms"]
    print(markdown_table(header, [[r["free_runs_of"], r["source"], r["path"], r["runs"], r["host_ms"], r["wall_ms"]]
                                  for r in results["rows"]]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
