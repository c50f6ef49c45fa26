"""Where a cold adapter's host work goes, and how it scales with the stager's threads.

The engine's stager (daemon/engine/adapter_residency.py) reads each cold adapter from disk through the registry
(daemon/model/adapters.py: the PEFT safetensors read, checked and kept in float32), lays it out in pool pages
(`AdapterTable.stage`, pageable) and copies those into pinned memory. This times each part for a set of PEFT
adapter folders (the served figures' 7B adapters of ranks 8-64 on q, k, v, o by default), with the files in the
page cache or dropped from it first (`--cold`), then stages them all with 1, 2, 4 and 8 threads at once, as the
stager does: the wall time for all, and each part's mean time under that concurrency. `--gil-load BUSY:IDLE` runs a
thread beside them that runs Python for BUSY ms and sleeps IDLE ms, over and over, as the engine thread's host work
does in the daemon (its steps' host work takes the GIL from the stager's threads); `--baseline FILE` stages with the
AdapterTable of another commit's gpu_ops/page_pool.py (`git show REV:gpu_ops/page_pool.py > OLD.py`) beside this one.

    python3 bench/adapter_staging.py [--adapters DIR] [--count 16] [--threads 1,2,4,8] [--torch-threads default,1]
                                     [--gil-load off,10:5] [--baseline OLD.py] [--cold] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from lorad.daemon.bench.load import drop_page_cache, flush_files
from lorad.daemon.bench.report import machine
from lorad.daemon.model.adapters import load_peft_adapter
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, PROJECTIONS, ModelSpec
from lorad.daemon.model.demo import write_random_adapter
from lorad.gpu_ops.page_pool import AdapterTable, PagePool, StagedAdapter

from timing import load_module_file  # noqa: E402  (bench/timing.py, beside this script)

PARTS = ("read", "stage", "pin")


def stage_one(folder: Path, spec: ModelSpec, table: AdapterTable, pin: bool) -> dict[str, float]:
    """One adapter through the stager's parts, each timed (ms)."""
    started = time.perf_counter()
    adapter = load_peft_adapter(folder, spec, 64, folder.name)
    read = time.perf_counter()
    staged = table.stage(adapter.weights, pin=False)
    laid_out = time.perf_counter()
    if pin:
        StagedAdapter(staged.pages.pin_memory(), staged.layout)
    pinned = time.perf_counter()
    return {"read": (read - started) * 1e3, "stage": (laid_out - read) * 1e3, "pin": (pinned - laid_out) * 1e3}


def stage_all(folders: list[Path], threads: int, spec: ModelSpec, table: AdapterTable, pin: bool,
              torch_threads: int | None = None) -> dict:
    """Every folder staged by `threads` threads taking them in turn: the wall time and each part's mean.
    torch_threads: each thread's own intra-op threads (None: the process's, each thread a team of that many)."""
    todo, lock, times = list(folders), threading.Lock(), []

    def work():
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)  # this thread's OpenMP team only
        while True:
            with lock:
                if not todo:
                    return
                folder = todo.pop(0)
            part = stage_one(folder, spec, table, pin)
            with lock:
                times.append(part)

    started = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - started
    return {"threads": threads, "torch_threads": torch_threads or torch.get_num_threads(), "adapters": len(folders),
            "wall_ms": round(wall * 1e3, 1), "adapters_per_s": round(len(folders) / wall, 2),
            "mean_ms": {part: round(sum(t[part] for t in times) / len(times), 1) for part in PARTS}}


class GilLoad:
    """A thread that runs Python for `busy_ms`, then sleeps `idle_ms`, until stopped (with: for a block)."""

    def __init__(self, busy_ms: float, idle_ms: float):
        self.busy_s, self.idle_s = busy_ms / 1e3, idle_ms / 1e3
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            end, count = time.perf_counter() + self.busy_s, 0
            while time.perf_counter() < end:
                count += 1
            self.stop.wait(self.idle_s)

    def __enter__(self) -> GilLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=Path, help="PEFT adapter folders (default: written here, 7B, ranks 8-64)")
    parser.add_argument("--count", type=int, default=16, help="adapters to write when --adapters is not given")
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--cold", action="store_true", help="drop the files from the page cache before each pass")
    parser.add_argument("--torch-threads", default="default",
                        help="each staging thread's intra-op threads, comma-separated settings to compare (default: "
                             "the process's; the engine's stager threads use 1)")
    parser.add_argument("--gil-load", default="off",
                        help="comma-separated settings: off, or BUSY:IDLE (ms) of a thread running Python beside them")
    parser.add_argument("--baseline", help="another commit's gpu_ops/page_pool.py, whose AdapterTable stages beside this one's")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    if args.adapters is None:
        root = Path(tempfile.mkdtemp(prefix="lorad-staging-"))
        for index in range(args.count):
            write_random_adapter(root / f"adapter-{index:04d}", spec, (8, 16, 32, 64)[index % 4], ("q_proj", "k_proj", "v_proj", "o_proj"),
                                 seed=index)
        args.adapters = root
    folders = sorted(path for path in args.adapters.iterdir() if path.is_dir())
    pin = torch.cuda.is_available()
    shapes = [spec.projection_shape(p) for p in PROJECTIONS]
    modules = {"current": (AdapterTable, PagePool)}
    if args.baseline:
        old = load_module_file(args.baseline, "baseline_page_pool")
        modules = {"baseline": (old.AdapterTable, old.PagePool), **modules}
    tables = {name: table_type(pool_type(2, spec.page_elems, torch.bfloat16, torch.device("cpu")), 1, spec.num_layers, shapes)
              for name, (table_type, pool_type) in modules.items()}
    for table in tables.values():
        stage_all(folders[:2], 1, spec, table, pin)  # warm-up: imports, allocator
    runs = []
    for load in args.gil_load.split(","):
        busy_idle = None if load == "off" else tuple(float(ms) for ms in load.split(":"))
        for torch_threads in (None if t == "default" else int(t) for t in args.torch_threads.split(",")):
            for threads in (int(t) for t in args.threads.split(",")):
                for name, table in tables.items():
                    if args.cold:  # the next reads come from the disk
                        for folder in folders:
                            flush_files(folder)
                            drop_page_cache(folder)
                    with GilLoad(*busy_idle) if busy_idle else contextlib.nullcontext():
                        run = stage_all(folders, threads, spec, table, pin, torch_threads)
                    run.update(table=name, gil_load=load)
                    runs.append(run)
                    print(f"{name}, GIL load {load}, threads {threads} of {run['torch_threads']} torch threads: "
                          f"{run['adapters']} adapters in {run['wall_ms']:.0f} ms ({run['adapters_per_s']}/s); mean ms "
                          + ", ".join(f"{part} {ms}" for part, ms in run["mean_ms"].items()), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.device("cuda" if pin else "cpu")
        args.out.write_text(json.dumps({"machine": machine(device), "model_config": args.model_config, "cold": args.cold,
                                        "pinned": pin, "torch_threads": torch.get_num_threads(),
                                        "adapters": [path.name for path in folders], "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
