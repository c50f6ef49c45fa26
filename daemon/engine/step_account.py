"""The engine's account of its own time: every step's kind, rows and prompt tokens, its bytes and FLOPs
(step_cost.py) and so its floor on this device, against the wall time the engine spent on it.

A step's time runs from where the engine's previous step landed (its tokens read on the host), or from when
the engine took up work after idling, to where this one lands. So every second the engine is busy is
charged to one step: the host's work between steps (scheduling, building the plan, handing tokens back) to
the step it prepares, and an overlapped decode step, launched before the one ahead of it landed, only for
the time after that one. Busy time summed over steps against their summed floor is the engine's efficiency:
1.0 would be a GPU that never waits for the host and runs every step at its HBM bandwidth or its GEMM rate.

Where the time went, per kind: `host_before_launch_s`, the host's work from where the previous step landed to
this step's launch (the device had no step of the engine's to run), split by part where the step loop gives
them (HOST_PARTS: the landed tokens handed back, the scheduler's admission, the step's plan, the forward's
launch), and on cuda
`device_s`, the step's span on the device's clock (CUDA events before and after its forward: from its first
kernel to its forward's last). busy - device is the device's work between forwards and the time it waited for
the host, which the device's clock splits in two: `tokens_device_s`, from the forward's end to where the step's
tokens are queued for the host (the sampler's admission, processing, the argmax or draw, logprobs, the copies),
and `before_forward_s`, from the previous step's tokens to this step's forward: the device waiting for the host
to launch it (an overlapped step launched late included), or work the host queued between steps. The time
between a step that idled the engine and the next is nobody's.

Kinds: `decode` (every sequence adds its next token), `prefill` (every sequence is in its prompt), `mixed`
(prompt rows beside decode rows). A step replayed from a CUDA graph computes its bucket's rows; those past the
step's own are its padding rows, counted apart (GEMM work on no token, which the floor does not include).

A diagnostic, the steps one by one: `LORAD_STEP_LOG=FILE lorad serve ...` appends a JSON line per step to FILE
(`StepLog`): its kind, rows, the account's times above for it alone, and the engine's notes on how it was launched
(from the tokens in flight, planned ahead, or after the host read the step before it), why its own tokens were
read at once, and where the host's time before its launch went (`HostSplit`).

Empty running slots: a step of fewer requests than the running cap leaves slots empty, and a decode step's
floor is mostly its weights, read the same for any number of rows: a saturated server's steps should be full.
Each step counts its empty slots under why the engine did not fill them (`EMPTY_CAUSES`: the admission's
stop, scheduler/batching.py, or rows that ended on the step before it, whose slots the next step fills).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from lorad.daemon.engine.stats import Histogram
from lorad.daemon.engine.step_cost import DeviceRates, StepCost, StepCostModel
from lorad.daemon.engine.step_plan import StepPlan
from lorad.scheduler.batching import ADMISSION_STOPS

STEP_KINDS = ("decode", "prefill", "mixed")
HOST_PARTS = ("tokens", "schedule", "plan", "launch")
ENDED_IN_FLIGHT = "ended_in_flight"  # the requests that ended on the step in flight left, the queue's head joins next
EMPTY_CAUSES = (*ADMISSION_STOPS, ENDED_IN_FLIGHT)
log = logging.getLogger(__name__)

STEP_LOG_ENV = "LORAD_STEP_LOG"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass
class KindTotals:
    steps: int = 0
    busy_s: float = 0.0
    floor_s: float = 0.0
    serial_floor_s: float = 0.0  # the floor with each step's phases one after the other (StepCost.serial_floor_s)
    memory_s: float = 0.0  # bytes / bandwidth, summed
    compute_s: float = 0.0  # FLOPs / GEMM rate, summed
    rows: int = 0
    padding_rows: int = 0  # rows of the steps' graph buckets past their own rows
    prompt_tokens: int = 0
    bytes: int = 0
    flops: int = 0
    host_before_launch_s: float = 0.0
    host_parts_s: dict = field(default_factory=lambda: dict.fromkeys(HOST_PARTS, 0.0))
    empty_slots: dict = field(default_factory=lambda: dict.fromkeys(EMPTY_CAUSES, 0))  # slot-steps, by cause
    device_s: float | None = None  # None: no device clock (the CPU)
    tokens_device_s: float | None = None  # the device's work on the steps' tokens after their forwards
    before_forward_s: float | None = None  # the device's time from the previous step's tokens to each forward

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "busy_s": round(self.busy_s, 6),
            "floor_s": round(self.floor_s, 6),
            "efficiency": round(self.floor_s / self.busy_s, 4) if self.busy_s else None,
            "serial_floor_s": round(self.serial_floor_s, 6),
            "memory_floor_s": round(self.memory_s, 6),
            "compute_floor_s": round(self.compute_s, 6),
            "mean_step_ms": round(self.busy_s / self.steps * 1e3, 3) if self.steps else None,
            "rows": self.rows,
            "padding_rows": self.padding_rows,
            "padding_rows_per_step": round(self.padding_rows / self.steps, 1) if self.steps else None,
            "prompt_tokens": self.prompt_tokens,
            "bytes": self.bytes,
            "flops": self.flops,
            "host_before_launch_s": round(self.host_before_launch_s, 6),
            "host_before_launch_by_part_s": {part: round(seconds, 6) for part, seconds in self.host_parts_s.items()},
            "empty_slots": sum(self.empty_slots.values()),
            "empty_slots_by_cause": {cause: count for cause, count in self.empty_slots.items() if count},
            "device_s": None if self.device_s is None else round(self.device_s, 6),
            "tokens_device_s": None if self.tokens_device_s is None else round(self.tokens_device_s, 6),
            "before_forward_s": None if self.before_forward_s is None else round(self.before_forward_s, 6),
        }


@dataclass(eq=False)
class DeviceSpan:
    """A step's events on the device's clock: before and after its forward, and where its tokens were queued for
    the host (None: not told); after_idle: the engine idled before it (no time before its forward is counted)."""

    kind: str
    start: object
    end: object
    tokens: object = None
    after_idle: bool = False
    record: dict | None = None  # the step's line for the step log, written once its device times are read

    def passed(self) -> bool:
        return (self.tokens or self.end).query()


@dataclass(frozen=True)
class LaunchedStep:
    kind: str
    rows: int
    padding_rows: int
    prompt_tokens: int
    cost: StepCost
    launched_at: float | None  # host time of the launch; None: not given
    parts: tuple | None  # host times where the scheduling, the plan and the forward's launch began
    span: DeviceSpan | None  # its events on the device; None without a device clock
    empty_slots: int = 0  # running slots the step left empty
    why_empty: str | None = None  # one of EMPTY_CAUSES where empty_slots > 0
    notes: dict = field(default_factory=dict)  # the engine's, for the step log (how it was launched, ...)


class StepAccount:
    """Called from the step loop (begin, launched, landed, idle, drop_pending); read from any thread
    (snapshot, metrics)."""

    def __init__(self, cost_model: StepCostModel, rates: DeviceRates, device_clock: bool = False, new_event=None,
                 step_log: "StepLog | None" = None):
        """device_clock: time each step's forward on the device too (the engine on cuda); new_event: makes the
        recorded events (default: timing CUDA events on the current stream); step_log: where each step's line goes."""
        self.cost_model, self.rates, self.device_clock = cost_model, rates, device_clock
        self.step_log = step_log
        self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._pending: deque[LaunchedStep] = deque()
        self._mark: float | None = None  # where the next step's time starts; None while idle
        self._lock = threading.Lock()
        self.totals = {kind: KindTotals() for kind in STEP_KINDS}
        self.step_seconds = {kind: Histogram(STEP_BUCKETS) for kind in STEP_KINDS}
        self._start_event = None  # recorded by before_forward, taken by the launched step
        self._spans: deque[DeviceSpan] = deque()  # of landed steps, until the device has passed them
        self._after_idle = True  # the next launched step follows an idle engine
        self._last_passed = None  # the event where the last step read off the device ended (its tokens, or forward)

    def before_forward(self) -> None:
        """On cuda: an event on the current stream where the next step's forward begins (its device span's start)."""
        if self.device_clock:
            self._start_event = self._new_event()
            self._start_event.record()

    def begin(self, now: float) -> None:
        """The step loop takes up work: time counts from here unless a step is already being timed."""
        if self._mark is None:
            self._mark = now

    def idle(self) -> None:
        """The step loop waits for work (nothing in flight): the time until it is woken is nobody's."""
        if not self._pending:
            self._mark = None
            self._after_idle = True

    def tokens_queued(self) -> None:
        """On cuda: the last launched step's tokens (their draw, logprobs and copies to the host) are queued on the
        current stream: an event marks where the device is done with the step."""
        if self.device_clock and self._pending and self._pending[-1].span is not None:
            event = self._new_event()
            event.record()
            self._pending[-1].span.tokens = event

    def launched(self, plan: StepPlan, graph_rows: int | None = None, now: float | None = None,
                 parts: tuple[float, float, float] | None = None, empty_slots: int = 0, why_empty: str | None = None,
                 notes: dict | None = None) -> None:
        """A step's forward was launched; its time is taken when it lands (FIFO: steps land in launch order).
        graph_rows: the rows its forward computed (a CUDA graph's bucket); None: the step's own (eager).
        now: the host's clock at the launch (for host_before_launch_s); parts: where the scheduling, the plan
        and the forward's launch began on it (HOST_PARTS after `tokens`). After before_forward, its device span
        ends here. empty_slots: the running slots it left empty, why_empty: why (one of EMPTY_CAUSES). notes: the
        engine's, for the step log (`note` adds to them after the launch)."""
        if empty_slots > 0 and why_empty not in EMPTY_CAUSES:
            raise ValueError(f"why_empty {why_empty!r} is not one of {EMPTY_CAUSES}")
        counts, starts = plan.counts, plan.starts
        prompt_lens = np.fromiter((seq.prompt_len for seq in plan.seqs), dtype=np.int64, count=len(plan.seqs))
        prompt_tokens = int(np.clip(np.minimum(starts + counts, prompt_lens) - starts, 0, None).sum())
        decoding = (counts == 1) & (starts >= prompt_lens)  # rows after the prompt (a 1-token prompt chunk is not)
        kind = "decode" if decoding.all() else "mixed" if decoding.any() else "prefill"
        adapter_rows: dict[str, int] = {}
        for seq, count, slot in zip(plan.seqs, counts, plan.slots):
            if slot >= 0 and seq not in plan.assisted:  # CPU-assisted rows' LoRA is not read on the device
                adapter_rows[seq.adapter] = adapter_rows.get(seq.adapter, 0) + int(count)
        cost = self.cost_model.cost_of(counts, starts + counts, int(plan.sample.sum()), adapter_rows)
        rows = int(counts.sum())
        padding = 0 if graph_rows is None else graph_rows - rows
        if padding < 0:
            raise ValueError(f"graph_rows {graph_rows} < the step's {rows} rows")
        span = None
        if self._start_event is not None:
            end = self._new_event()
            end.record()
            span = DeviceSpan(kind, self._start_event, end, after_idle=self._after_idle)
            self._start_event, self._after_idle = None, False
        self._pending.append(LaunchedStep(kind, rows, padding, prompt_tokens, cost, now, parts, span, max(empty_slots, 0),
                                          why_empty, dict(notes or {})))

    def note(self, **notes) -> None:
        """Adds to the last launched step's notes (for the step log)."""
        if self._pending and self.step_log is not None:
            self._pending[-1].notes.update(notes)

    def landed(self, now: float) -> None:
        """The oldest launched step's tokens are on the host: its time and floor are counted."""
        step = self._pending.popleft()
        start = self._mark if self._mark is not None else now
        seconds = now - start
        self._mark = now
        # an overlapped step was launched before the one ahead of it landed: no host time of its own before it
        host = 0.0 if step.launched_at is None else min(max(step.launched_at - start, 0.0), seconds)
        split = None
        if host > 0 and step.parts is not None:  # each part's share of the host's time, from `start` on
            bounds = [start, *(min(max(at, start), step.launched_at) for at in step.parts), step.launched_at]
            split = [later - earlier for earlier, later in zip(bounds, bounds[1:])]
        if step.span is not None:
            self._spans.append(step.span)
        memory_s = step.cost.bytes / self.rates.bandwidth_bytes_per_s
        compute_s = step.cost.flops / self.rates.flops_per_s
        serial_s = step.cost.serial_floor_s(self.rates.bandwidth_bytes_per_s, self.rates.flops_per_s)
        if self.step_log is not None:
            record = {"kind": step.kind, "rows": step.rows, "padding_rows": step.padding_rows,
                      "prompt_tokens": step.prompt_tokens, "landed_s": now, "busy_ms": seconds * 1e3,
                      "host_before_launch_ms": host * 1e3,
                      "host_parts_ms": {part: value * 1e3 for part, value in zip(HOST_PARTS, split or ())},
                      "floor_ms": max(memory_s, compute_s) * 1e3,
                      "serial_floor_ms": serial_s * 1e3,
                      "empty_slots": step.empty_slots, "why_empty": step.why_empty, **step.notes}
            if step.span is not None:
                step.span.record = record  # written with its device times
            else:
                self.step_log.write(record)
        with self._lock:
            totals = self.totals[step.kind]
            totals.steps += 1
            totals.busy_s += seconds
            totals.floor_s += max(memory_s, compute_s)
            totals.serial_floor_s += serial_s
            totals.memory_s += memory_s
            totals.compute_s += compute_s
            totals.rows += step.rows
            totals.padding_rows += step.padding_rows
            totals.prompt_tokens += step.prompt_tokens
            totals.bytes += step.cost.bytes
            totals.flops += step.cost.flops
            totals.host_before_launch_s += host
            for part, seconds_in in zip(HOST_PARTS, split or ()):
                totals.host_parts_s[part] += seconds_in
            if step.empty_slots:
                totals.empty_slots[step.why_empty] += step.empty_slots
            # Spans are read once the device has passed them (without waiting: a prompt chunk's step lands before
            # its device work is done); one stream, so they pass in launch order.
            while self._spans and self._spans[0].passed():
                self._read_span(self._spans.popleft())
            self.step_seconds[step.kind].observe(seconds)

    def _read_span(self, span: DeviceSpan) -> None:
        totals = self.totals[span.kind]
        forward_ms = span.start.elapsed_time(span.end)
        totals.device_s = (totals.device_s or 0.0) + forward_ms / 1e3
        tokens_ms = wait_ms = None
        if span.tokens is not None:
            tokens_ms = span.end.elapsed_time(span.tokens)
            totals.tokens_device_s = (totals.tokens_device_s or 0.0) + tokens_ms / 1e3
        if self._last_passed is not None and not span.after_idle:
            wait_ms = self._last_passed.elapsed_time(span.start)
            totals.before_forward_s = (totals.before_forward_s or 0.0) + wait_ms / 1e3
        self._last_passed = span.tokens or span.end
        if span.record is not None and self.step_log is not None:
            self.step_log.write({**span.record, "forward_ms": forward_ms, "tokens_ms": tokens_ms, "wait_before_ms": wait_ms})

    def in_flight(self) -> bool:
        """A step was launched whose tokens have not landed."""
        return bool(self._pending)

    def drop_pending(self) -> None:
        """A step failed: what it had launched is not timed."""
        self._pending.clear()
        self._start_event = None
        self._mark = None
        self._after_idle = True

    def snapshot(self) -> dict:
        """For /v1/status: the device's rates, and busy time against the floor, in all and by kind."""
        with self._lock:
            by_kind = {kind: totals.as_dict() for kind, totals in self.totals.items()}
        busy = sum(kind["busy_s"] for kind in by_kind.values())
        floor = sum(kind["floor_s"] for kind in by_kind.values())
        serial = sum(kind["serial_floor_s"] for kind in by_kind.values())

        def device_sum(key):
            values = [kind[key] for kind in by_kind.values() if kind[key] is not None]
            return round(sum(values), 6) if values else None

        return {
            "device_rates": {"hbm_gb_s": round(self.rates.bandwidth_bytes_per_s / 1e9, 1),
                             "gemm_tflop_s": round(self.rates.flops_per_s / 1e12, 2)},
            "busy_s": round(busy, 6),
            "floor_s": round(floor, 6),
            "efficiency": round(floor / busy, 4) if busy else None,
            "serial_floor_s": round(serial, 6),
            "host_before_launch_s": round(sum(kind["host_before_launch_s"] for kind in by_kind.values()), 6),
            "host_before_launch_by_part_s": {
                part: round(sum(kind["host_before_launch_by_part_s"][part] for kind in by_kind.values()), 6)
                for part in HOST_PARTS},
            "device_s": device_sum("device_s"),
            "tokens_device_s": device_sum("tokens_device_s"),
            "before_forward_s": device_sum("before_forward_s"),
            "empty_slots": sum(kind["empty_slots"] for kind in by_kind.values()),
            "empty_slots_by_cause": {cause: count for cause in EMPTY_CAUSES
                                     if (count := sum(kind["empty_slots_by_cause"].get(cause, 0) for kind in by_kind.values()))},
            "by_kind": by_kind,
        }

    def metrics(self) -> dict:
        """For /metrics: per kind, the step-time histogram and the summed busy time, floor, rows, padding rows,
        prompt tokens, the host's time before the launches by part, the empty running slots by cause and the
        device's time (None: no device clock)."""
        with self._lock:
            return {kind: {"seconds": self.step_seconds[kind].snapshot(), "busy_s": totals.busy_s,
                           "floor_s": totals.floor_s, "serial_floor_s": totals.serial_floor_s, "rows": totals.rows,
                           "padding_rows": totals.padding_rows,
                           "prompt_tokens": totals.prompt_tokens, "steps": totals.steps,
                           "host_parts_s": dict(totals.host_parts_s), "empty_slots": dict(totals.empty_slots),
                           "device_s": totals.device_s, "tokens_device_s": totals.tokens_device_s,
                           "before_forward_s": totals.before_forward_s}
                    for kind, totals in self.totals.items()}


class HostSplit:
    """Where the engine thread's time in one step() went before the step's launch, for the step log: named marks on
    the host's clock from step()'s beginning (each part: from the mark before it), the thread's own CPU time over
    the same span (a wall time well above it: the thread waited, for the GIL, a lock or the device), the time from
    where the step loop's step() before it returned (`between_ms`: its outputs queued for the API process, the
    loop's own work; absent after an idle engine), and the time Python's garbage collector ran and the time any
    thread spent pinning staged adapters since the last step's launch (`gc_ms`, `pin_ms`, while a step log is open).
    on: a step log reads it (off: nothing is marked, no notes)."""

    def __init__(self, began: float, previous_end: float | None = None, on: bool = True):
        self.began = began
        self.previous_end = previous_end
        self.on = on
        self._cpu = time.thread_time() if on else 0.0
        self._marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        if self.on:
            self._marks.append((name, time.perf_counter()))

    def notes(self, launched: float) -> dict:
        if not self.on:
            return {}
        split, at = {}, self.began
        for name, when in self._marks:
            split[name] = round((when - at) * 1e3, 3)
            at = when
        split["launch"] = round((launched - at) * 1e3, 3)
        notes = {"host_ms": (launched - self.began) * 1e3, "host_split_ms": split,
                 "host_cpu_ms": round((time.thread_time() - self._cpu) * 1e3, 3)}
        if self.previous_end is not None:
            notes["between_ms"] = round((self.began - self.previous_end) * 1e3, 3)
        if _gc_clock.on:
            notes["gc_ms"] = round(_gc_clock.take() * 1e3, 3)
            notes["pin_ms"] = round(pin_clock.take() * 1e3, 3)
        return notes


class _GcClock:
    """The time Python's collector ran (gc.callbacks), summed until `take`; on while a step log is open."""

    def __init__(self):
        self.on = False
        self._seconds = 0.0
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._started = None

    def start(self) -> None:
        if not self.on:
            gc.callbacks.append(self)
            self.on = True

    def stop(self) -> None:
        if self.on:
            gc.callbacks.remove(self)
            self.on = False

    def take(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds


_gc_clock = _GcClock()


class PinClock:
    """The time any thread spent copying staged adapters into pinned host memory (the adapter residency's arena,
    waits for a free range included), summed until `take`: the step log's `pin_ms`, counted while a step log is open
    (the adapter residency adds each pinning), to set beside the launches whose host time is far above their CPU time.
    When each pinning took fresh memory from the driver (cudaHostAlloc), such launches came with ~45 ms of pinning
    against ~4 ms beside the steps launched on time (BENCHMARKS.md, figure 21.1)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds = 0.0

    def add(self, seconds: float) -> None:
        """Counts `seconds` while a step log is open (nothing otherwise)."""
        if self.on:
            with self._lock:
                self._seconds += seconds

    def take(self) -> float:
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
        return seconds

    @property
    def on(self) -> bool:
        return _gc_clock.on


pin_clock = PinClock()


class StepLog:
    """The steps one by one, a JSON line each appended to a file (`LORAD_STEP_LOG=FILE`, a diagnostic): what the
    account sums, per step, with `landed_s` on the host's clock (perf_counter) and, on cuda, `forward_ms`,
    `tokens_ms` and `wait_before_ms` on the device's (written once the device has passed the step)."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", buffering=1)  # a line at a time: what a killed daemon had logged stays
        self._file.write(json.dumps({"step_log": 1, "pid": os.getpid(), "started": time.time()}) + "\n")
        _gc_clock.start()

    @classmethod
    def from_env(cls) -> "StepLog | None":
        path = os.environ.get(STEP_LOG_ENV)
        return cls(path) if path else None

    def write(self, record: dict) -> None:
        """One line; a diagnostic never fails a step: a write that fails (a full disk) stops the log, said once."""
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
        except OSError as error:
            log.warning("step log %s stopped: %s", self.path, error)
            self.close()

    def close(self) -> None:
        _gc_clock.stop()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
