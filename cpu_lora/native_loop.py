"""The CPU LoRA workers' native serving loop (csrc/native_loop.cpp, module `_lorad_cpu`): how a worker
builds one over its slot of the exchange, which jobs it leaves to it, and what the daemon reports.

A worker measures at start-up, on its own core, the native arithmetic against its torch path for a few
job sizes, and lets the loop serve jobs up to the largest size (rows x rank) where native was not
slower; the Python loop serves the rest, validates every module before the loop may serve it, and
reports every error. So the native loop changes when a job's flags move, never what it computes.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import torch
from lorad.shm import exchange as layout_names
from lorad.shm.exchange import DESCRIPTOR_BYTES, HOT_UNTIL, JOB_SEQ, LINE, Exchange
from lorad.shm.store import GENERATION_OFFSET, AdapterStore

try:
    from lorad.cpu_lora import _lorad_cpu as _native

    _IMPORT_ERROR: BaseException | None = None
except ImportError as error:  # not built (not an x86-64 host): the Python loop only
    _native = None
    _IMPORT_ERROR = error

log = logging.getLogger(__name__)

NEEDS_PYTHON, COLD, IDLE = 0, 1, 2  # why NativeLoop.serve returned (the module's own values, checked)
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32)  # job sizes timed native vs torch, at CALIBRATION_RANK
CALIBRATION_RANK = 16
CALIBRATION_REPS = 7
MAX_MODULES = 4096  # modules a loop knows before it starts over


def _build_mismatch() -> str | None:
    """What the built module numbers differently from shm/exchange.py (a stale build), or None."""
    for name, value in _native.FIELDS.items():
        ours = getattr(layout_names, name, None)
        if ours != value:
            return f"{name} is {value} in the native loop and {ours} in shm/exchange.py"
    if (_native.NEEDS_PYTHON, _native.COLD, _native.IDLE) != (NEEDS_PYTHON, COLD, IDLE):
        return "its return codes differ from cpu_lora/native_loop.py's"
    return None


@functools.cache
def worker_loop_path() -> str:
    """"native", or "python: <why the workers run their Python loop only>"."""
    if _native is None:
        return (f"python: the native worker loop lorad.cpu_lora._lorad_cpu is not built ({_IMPORT_ERROR}); "
                "it is built on x86-64 hosts by `pip install -e .`")
    disagreement = _build_mismatch()
    if disagreement is not None:
        return f"python: the native worker loop is stale ({disagreement}); reinstall lorad (`pip install -e .`)"
    return "native"


def calibrate(hidden: int, max_out: int, max_tokens: int) -> tuple[int, dict[int, tuple[float, float]]]:
    """Time one job of `rows` x CALIBRATION_RANK, `hidden` -> `max_out`, both ways on this core (`_best_times`).
    -> (the largest rows x rank up to which native was never slower, 0 if it was slower at one row;
    {rows: (native us, torch us)}). Raises RuntimeError if the two disagree."""
    rank = CALIBRATION_RANK
    sizes = [rows for rows in CALIBRATION_ROWS if rows <= max_tokens]
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rank, hidden, generator=generator) * hidden**-0.5
    b_t = torch.randn(rank, max_out, generator=generator)
    x = torch.randn(sizes[-1], hidden, generator=generator)
    middle, out, native_out = torch.empty(sizes[-1], rank), torch.empty(sizes[-1], max_out), torch.empty(sizes[-1], max_out)
    a_t, addresses = a.t(), (x.data_ptr(), a.data_ptr(), b_t.data_ptr(), native_out.data_ptr())
    compute = _native.NativeLoop.compute
    max_work, timings = 0, {}
    with torch.inference_mode():
        for rows in sizes:
            def native() -> None:
                compute(addresses[0], hidden, addresses[1], addresses[2], addresses[3], max_out, rows, hidden, rank,
                        max_out)

            def reference() -> None:
                torch.mm(x[:rows], a_t, out=middle[:rows])
                torch.mm(middle[:rows], b_t, out=out[:rows])

            native_us, torch_us = _best_times(native, reference)
            if not torch.allclose(native_out[:rows], out[:rows], rtol=1e-3, atol=1e-3):
                raise RuntimeError(f"the native loop's arithmetic disagrees with torch at {rows} rows x rank {rank}")
            timings[rows] = (native_us, torch_us)
            if native_us > torch_us:
                break
            max_work = rows * rank
    return max_work, timings


def _best_times(native, reference) -> tuple[float, float]:
    """The fastest of CALIBRATION_REPS runs of each, in turns: a worker calibrates while its siblings
    start up on their cores, and taking turns exposes both ways to the same disturbances. -> us."""
    native()  # warm: first touch of the buffers, the first dispatch
    reference()
    best = [float("inf"), float("inf")]
    for _ in range(CALIBRATION_REPS):
        for way, run in enumerate((native, reference)):
            start = time.perf_counter_ns()
            run()
            best[way] = min(best[way], (time.perf_counter_ns() - start) / 1e3)
    return best[0], best[1]


class NativeServer:
    """A worker's native loop over its slot (`build`), and what the Python loop tells it (`learn`)."""

    def __init__(self, loop, store: AdapterStore):
        self.loop, self.store = loop, store
        self.serve = loop.serve  # (seq, idle_ns) -> (last seq served, NEEDS_PYTHON / COLD / IDLE)
        self._taught: dict[tuple, int] = {}  # (adapter, layer, proj) -> the store generation it was taught at

    @classmethod
    def build(cls, exchange: Exchange, store: AdapterStore, worker: int, max_work: int | None = None) -> NativeServer | None:
        """The loop for `worker`'s slot, or None (logged: not built, stale, or never faster than torch
        here). max_work: jobs up to this many rows x rank go native (default: `calibrate` decides)."""
        path = worker_loop_path()
        if path != "native":
            log.info("worker=%d loop=%s", worker, path)
            return None
        config, layout = exchange.config, exchange.layout
        if max_work is None:
            try:
                max_work, timings = calibrate(config.hidden, config.max_out, config.max_tokens)
            except RuntimeError as error:
                log.error("worker=%d loop=python: %s", worker, error)
                return None
            shown = " ".join(f"{rows}:{native:.1f}/{torch_us:.1f}" for rows, (native, torch_us) in timings.items())
            if max_work == 0:  # unexpected on x86-64, where a torch call costs more than a one-row job: say so
                log.warning("worker=%d loop=python: torch was faster than the native loop even for one row here "
                            "(rows:native/torch us at rank %d: %s)", worker, CALIBRATION_RANK, shown)
                return None
            log.info("worker=%d native_max_work=%d (rows x rank; rows:native/torch us at rank %d: %s)", worker, max_work,
                     CALIBRATION_RANK, shown)
        if max_work <= 0:
            log.info("worker=%d loop=python: native_max_work=%d", worker, max_work)
            return None

        def address(offset: int) -> int:  # no view is kept: the worker must be able to unmap the segments
            return int(exchange.segment.array(offset, 1, np.int64).ctypes.data)

        loop = _native.NativeLoop(
            job_flag=address(layout.job_line(worker) + JOB_SEQ * 8),
            worker_line=address(layout.worker_line(worker)),
            ring=address(layout.descriptor(worker, 0)),
            ring_entries=config.ring,
            descriptor_words=DESCRIPTOR_BYTES // 8,
            hot_until=address(LINE + HOT_UNTIL * 8),
            input=int(exchange.input_bytes.ctypes.data),
            input_bytes=int(exchange.input_bytes.size),
            output=int(exchange.output.ctypes.data),
            out_stride=int(exchange.output.shape[1]),
            max_tokens=config.max_tokens,
            store_generation=int(store.segment.array(GENERATION_OFFSET, 1, np.int64).ctypes.data),
            max_work=max_work,
        )
        return cls(loop, store)

    def learn(self, fields: tuple, modules: dict) -> None:
        """After the Python loop served job `fields` (Job's fields, not a split part): let the native
        loop serve its module from now on. `modules`: the worker's _JobRunner.modules, (adapter, layer, proj) ->
        (A, A^T, B^T, in, out), views of the store's index of generation `store.seen_generation`."""
        key = fields[:3]
        generation = self.store.seen_generation
        if self._taught.get(key) == generation:
            return
        module = modules.get(key)
        if module is None:
            return
        a, _, b_t, in_features, out_features = module
        if len(self._taught) >= MAX_MODULES:  # both forget together, so that taught means known
            self._taught.clear()
            self.loop.forget()
        self.loop.learn(*key, a.data_ptr(), b_t.data_ptr(), a.shape[0], in_features, out_features, generation)
        self._taught[key] = generation
