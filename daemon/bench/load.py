"""`lorad bench load`: how long an adapter takes to reach the page pool, by rank, target modules and the
host tier it starts from (CaraServe Fig. 3, right), against its bytes over the copy bandwidth measured
in the same run.

Every load goes through the engine's own path (gpu_ops/page_pool.py: `AdapterTable.stage` lays the
adapter out as pool pages, `place` copies them on a side stream and publishes the table rows), timed on
the host from the call until the device has the pages. Tiers:
- pinned: place() from staged pages in pinned memory (the engine's pinned-cache hit; cuda only)
- pageable: place() from the same staged pages in pageable memory
- host: stage() from the fp32 host adapter, then place() (the engine's pinned-cache miss)
- disk: read and check the PEFT safetensors file (daemon/model/adapters.py, the OS page cache dropped
  first), stage(), place() (a first request for an adapter never used)
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from lorad.daemon.bench.report import (
    TARGET_SETS,
    finish,
    machine,
    markdown_table,
    model_dtype,
    model_spec,
    resolve_device,
    summary,
    sync,
    timed_ms,
)

from lorad.errors import BadRequest

log = logging.getLogger(__name__)

TIERS = ("pinned", "pageable", "host", "disk")
DEFAULT_RANKS = (8, 16, 32, 64, 128)
PROBE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}  # bandwidth probes: well past any cache on each


def run(args) -> dict:
    from lorad.daemon.model.adapters import load_peft_adapter
    from lorad.daemon.model.checkpoint import PROJECTIONS
    from lorad.daemon.model.demo import write_random_adapter
    from lorad.gpu_ops.page_pool import AdapterTable, PagePool, StagedAdapter

    device = resolve_device(args.device)
    model_name, spec = model_spec(args.model_config, device)
    dtype = model_dtype(device)
    tiers = args.tiers or (TIERS if device.type == "cuda" else TIERS[1:])
    for tier in tiers:
        if tier not in TIERS:
            raise BadRequest(f"--tiers: unknown tier {tier!r}; one of {', '.join(TIERS)}")
    if "pinned" in tiers and device.type != "cuda":
        raise BadRequest("--tiers pinned needs --device cuda: pinned host memory is a CUDA notion")
    ranks, target_sets = args.ranks or DEFAULT_RANKS, args.targets or tuple(TARGET_SETS)
    for name in target_sets:
        if name not in TARGET_SETS:
            raise BadRequest(f"--targets: unknown set {name!r}; one of {', '.join(TARGET_SETS)}")
    disk_dir = Path(tempfile.mkdtemp(prefix="lorad-bench-load-", dir=args.disk_dir)) if "disk" in tiers else None
    try:
        bandwidth = measure_bandwidth(device, tiers, disk_dir)
        print("bandwidth (GB/s, measured now): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in bandwidth.items()))
        shapes = [spec.projection_shape(p) for p in PROJECTIONS]
        page = spec.page_elems
        largest = max(_pages(shapes, page, max(ranks), TARGET_SETS[t], spec.num_layers) for t in target_sets)
        pool = PagePool(largest + 2, page, dtype, device)
        table = AdapterTable(pool, 1, spec.num_layers, shapes)
        master = _random_weights(spec, max(ranks), shapes, args.seed)  # sliced for each rank and target set
        rows = []
        for set_name in target_sets:
            projections = [PROJECTIONS.index(p) for p in TARGET_SETS[set_name]]
            for rank in ranks:
                weights = {(layer, proj): (a[:rank], b[:, :rank]) for (layer, proj), (a, b) in master.items()
                           if proj in projections}
                staged = table.stage(weights)  # pinned on cuda
                pageable = StagedAdapter(torch.empty(staged.pages.shape, dtype=staged.pages.dtype), staged.layout)
                pageable.pages.copy_(staged.pages)  # the same pages in plain (pageable) host memory
                host_bytes = sum(a.numel() + b.numel() for a, b in weights.values()) * 4
                adapter_dir = None
                if "disk" in tiers:
                    adapter_dir = write_random_adapter(disk_dir / f"{set_name}-r{rank}", spec, rank, TARGET_SETS[set_name], seed=rank)
                    flush_files(adapter_dir)

                def disk_load(path=adapter_dir):
                    adapter = load_peft_adapter(path, spec, max_rank=max(ranks))
                    table.place(0, table.stage(adapter.weights))

                loads = {
                    "pinned": lambda staged=staged: table.place(0, staged),
                    "pageable": lambda pageable=pageable: table.place(0, pageable),
                    "host": lambda weights=weights: table.place(0, table.stage(weights)),
                    "disk": disk_load,
                }
                for tier in tiers:
                    times = []
                    for rep in range(args.warmup + args.reps):
                        if 0 in table.placements:
                            table.evict(0)
                            sync(device)
                        if tier == "disk":
                            drop_page_cache(adapter_dir)
                        ms = timed_ms(loads[tier], device)
                        if rep >= args.warmup:
                            times.append(ms)
                    table.evict(0)
                    file_bytes = _dir_bytes(adapter_dir) if tier == "disk" else 0
                    rows.append(_row(set_name, rank, tier, staged.pages.nbytes, host_bytes, file_bytes, times, bandwidth))
                del staged, pageable
                if adapter_dir is not None:
                    shutil.rmtree(adapter_dir)
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    report = {
        "version": 1, "kind": "bench-load", "command": args.command_line, "machine": machine(device),
        "config": {"model_config": model_name, "dtype": str(dtype).removeprefix("torch."), "ranks": list(ranks),
                   "targets": {name: list(TARGET_SETS[name]) for name in target_sets}, "tiers": list(tiers),
                   "reps": args.reps, "warmup": args.warmup, "disk_dir": str(disk_dir.parent) if disk_dir else None,
                   "disk_filesystem": _filesystem(disk_dir.parent) if disk_dir else None},
        "bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
        "notes": [
            "ms: host wall clock from the call until the device holds the pages (median of reps)",
            ("bound_ms: staged bytes / the tier's copy bandwidth (disk: + file bytes / disk read bandwidth); "
             "host and disk also lay the adapter out as pages on the CPU, which the bound leaves out"),
        ],
    }
    if device.type != "cuda":
        report["notes"].append("cpu: the pool is in host memory, so a load is a host copy; no pinned tier")
    print(markdown_table(
        ["targets", "rank", "tier", "staged MiB", "ms", "p90 ms", "bound ms", "x bound", "GB/s"],
        [[r["targets"], r["rank"], r["tier"], r["staged_bytes"] / 2**20, r["ms"]["median"], r["ms"]["p90"],
          r["bound_ms"], r["over_bound"], r["effective_gb_per_s"]] for r in rows],
    ))
    finish(args.out, report, lambda plt: _plot(plt, rows, model_name))
    return report


def measure_bandwidth(device: torch.device, tiers, disk_dir: Path | None) -> dict[str, float]:
    """Bytes per second of one large copy into device memory from pinned and from pageable host memory
    (best of 5), and of reading a file with its page cache dropped (best of 3)."""
    size = PROBE_BYTES[device.type]
    target = torch.empty(size, dtype=torch.uint8, device=device)
    result = {}
    kinds = [("pageable", False)] + ([("pinned", True)] if device.type == "cuda" else [])
    for tier, pinned in kinds:
        source = torch.randint(0, 255, (size,), dtype=torch.uint8)
        if pinned:
            source = source.pin_memory()
        best = min(timed_ms(lambda source=source, pinned=pinned: target.copy_(source, non_blocking=pinned), device)
                   for _ in range(5))
        result[tier] = size / (best / 1e3)
    if "disk" in tiers:
        probe = disk_dir / "bandwidth-probe.bin"
        probe.write_bytes(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes())
        flush_files(probe)
        buffer = bytearray(size)
        best = math.inf
        for _ in range(3):
            drop_page_cache(probe)
            start = time.perf_counter()
            with open(probe, "rb", buffering=0) as file:
                file.readinto(buffer)
            best = min(best, time.perf_counter() - start)
        probe.unlink()
        result["disk"] = size / best
    return result


def _row(targets: str, rank: int, tier: str, staged_bytes: int, host_bytes: int, file_bytes: int,
         times: list[float], bandwidth: dict) -> dict:
    copy = bandwidth["pinned" if tier == "pinned" else "pageable"]
    bound_ms = staged_bytes / copy * 1e3 + (file_bytes / bandwidth["disk"] * 1e3 if tier == "disk" else 0.0)
    ms = summary(times)
    return {"targets": targets, "rank": rank, "tier": tier, "staged_bytes": staged_bytes, "host_fp32_bytes": host_bytes,
            "file_bytes": file_bytes, "ms": ms, "bound_ms": bound_ms, "over_bound": ms["median"] / bound_ms,
            "effective_gb_per_s": staged_bytes / (ms["median"] / 1e3) / 1e9}


def _pages(shapes, page: int, rank: int, projections, layers: int) -> int:
    from lorad.daemon.model.checkpoint import PROJECTIONS

    return layers * sum(rank * (math.ceil(shapes[PROJECTIONS.index(p)][0] / page) + math.ceil(shapes[PROJECTIONS.index(p)][1] / page))
                        for p in projections)


def _random_weights(spec, rank: int, shapes, seed: int) -> dict:
    """Every projection of every layer at `rank`, float32 as the host adapter cache holds them."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(spec.num_layers):
        for proj, (fan_in, fan_out) in enumerate(shapes):
            weights[(layer, proj)] = (torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5,
                                      torch.randn(fan_out, rank, generator=generator) * (0.5 / rank))
    return weights


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def flush_files(path: Path) -> None:
    """fsync, so that the pages are clean and drop_page_cache can drop them."""
    for file in _files(path):
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the cached pages of the files (no root needed; clean pages only)."""
    for file in _files(path):
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def _dir_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in _files(path))


def _filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (tmpfs means the "disk" tier is memory)."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3 and resolved.startswith(fields[1]) and len(fields[1]) > len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        return "unknown"
    return kind


def _plot(plt, rows: list[dict], model_name: str):
    figure, axis = plt.subplots(figsize=(7, 4.5))
    colors = {"pinned": "tab:blue", "pageable": "tab:orange", "host": "tab:green", "disk": "tab:red"}
    for tier in dict.fromkeys(r["tier"] for r in rows):
        points = sorted((r["staged_bytes"] / 2**20, r["ms"]["median"], r["bound_ms"]) for r in rows if r["tier"] == tier)
        mib, ms, bound = zip(*points)
        axis.plot(mib, ms, "o-", color=colors[tier], label=f"{tier} (measured)")
        axis.plot(mib, bound, "--", color=colors[tier], alpha=0.6, label=f"{tier} bytes / bandwidth")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("adapter size in pool pages (MiB)")
    axis.set_ylabel("load latency (ms)")
    axis.set_title(f"adapter load by host tier, {model_name}")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=7)
    return figure
