"""CPU-assisted cold start (CaraServe §4): the LoRA of a prefill whose adapter is not yet in the page
pool, computed by the CPU workers (cpu_lora/worker.py) through shared memory while it is placed.

The engine owns one `CpuAssist`: the adapter store and the worker pool's exchange (both shm segments)
and the worker processes; `close()` stops and unlinks them. Per step the runner builds one `CpuSpan`
per CPU-assisted sequence (its rows of the step, split over the workers by partition.py's profiled
cost); per layer and projection the engine's lora op calls `apply()`, right after the base GEMM and
the GPU LoRA of the other rows, by one of two invocation paths (`invocation`):

- fused-cuda (a cuda engine with lorad.gpu_ops._lorad_cuda): per worker range, one kernel on the
  compute stream copies the rows of `x` into the exchange (mapped pinned shm) and raises the worker's
  job flag, and one kernel waits on the GPU for its done flag and adds the result into `y`. Job
  descriptors and their seqs are written by the host at enqueue time, in launch order; the host never
  waits on the device in the forward. A wait that times out (a dead or stalled worker) writes the
  exchange's error word and every later wait of the step gives up at once; `after_step()`, after the
  step's sync (sampling), reads it and the workers' sticky failures, replaces broken workers and
  returns the requests whose step must be recomputed: their prefill runs again next step on the GPU
  path (the adapter is in the pool by then), so a failure costs a step, never a wrong token.
- python (the CPU engine, or cuda without the extension): the host copies x's rows in, posts the
  jobs, waits and adds (on cuda: a sync per projection, CaraServe's "native" baseline). A job that
  fails sends its request to the pool path at once, for the rest of the step.

Layer-wise takeover: the adapter of a cpu-assisted request is copied into the pool layer by layer
(`AdapterTable.place_layerwise`). At each layer's first projection the host asks, without blocking,
whether that layer's copy has completed (`LayerwiseLoad.arrived`: an event query); if so the span's
rows of that layer take the GPU LoRA kernels (after a stream wait on the completed event, free) and
the CPU is not asked. `layers` counts the layers served each way. On the CPU engine the copy is
synchronous, so there is nothing to overlap: the workers serve every layer unless `layers_arrived`
(tests, benchmarks) says a layer has arrived.

Hot polling: idle workers sleep between polls, and a job posted to a sleeping worker waits for its
wake-up (hundreds of µs at 8 workers). `keep_workers_hot()` (the engine calls it when it admits a cold request,
and every invocation calls it) keeps the workers and the host's waits busy-polling for HOT_S more.

`calibrate()` measures, at start-up, what `auto` must know of this path: a probe adapter's LoRA
through the workers, the exchange and the invocation path in use, per module, synchronised as the
forward is, at two prompt lengths; and the copy into the store.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from lorad.cpu_lora.partition import (
    CostModel,
    plan,
    profile_cpu_lora,
    profile_dispatch,
    profile_group_dispatch,
)
from lorad.cpu_lora.worker import WorkerPool
from lorad.gpu_ops import cuda_ext
from lorad.shm.exchange import (
    IN_BFLOAT16,
    IN_FLOAT16,
    IN_FLOAT32,
    Job,
)
from lorad.errors import BadRequest
from lorad.shm.segment import new_instance, sweep_stale
from lorad.shm.store import AdapterStore, StoreFull

log = logging.getLogger(__name__)

PROFILE_RANK = 16
HOT_S = 0.1  # how long the workers keep polling after the last sign of CPU-assisted work
PROBE_NAME = "__lorad-probe__"
CPU, GPU = "cpu", "gpu"  # the path a layer of a cpu-assisted request took
_IN_DTYPES = {torch.float32: IN_FLOAT32, torch.float16: IN_FLOAT16, torch.bfloat16: IN_BFLOAT16}


def keep_off_cores(taken) -> set[int] | None:
    """The calling thread (the engine's, and every thread it starts later, which inherit it) leaves the
    cores in `taken` (the CPU workers'), so that it never shares a core with a worker: a sleeping worker
    wakes every millisecond or so to poll, and each wake-up on the engine's core preempts the engine's
    host work. Returns the affinity it had, to restore; None (nothing changed) when no core would be left
    or none is taken."""
    before = os.sched_getaffinity(0)
    left = before - set(taken)
    if not left or left == before:
        return None
    os.sched_setaffinity(0, left)
    return before


def default_workers(requested: int) -> int:
    """`cpu_workers` 0: one per core but one (the engine's), at most 4."""
    if requested > 0:
        return requested
    return max(1, min(4, len(os.sched_getaffinity(0)) - 1))


@dataclass(eq=False)
class CpuSpan:
    """One CPU-assisted sequence's rows [start, end) of the step."""

    request_id: str
    adapter_id: int  # in the adapter store
    slot: int  # its pool slot: where the fallback reads it
    modules: frozenset  # the (layer, proj) it targets
    start: int
    end: int
    ranges: list[tuple[int, int]]  # absolute rows, one range per worker (a split group: its one range)
    parts: int = 1  # > 1: one split group over workers 0..parts-1 on all the rows (cpu_lora/worker.py)
    load: object = None  # its adapter's LayerwiseLoad (gpu_ops/page_pool.py), when copied layer by layer
    gpu_batch: object = field(default=None, repr=False)  # LoraBatch of its rows on the pool path, built per step
    failed: bool = False  # python path: a job failed, the pool path computes its rows for the rest of the step
    paths: dict = field(default_factory=dict, repr=False)  # layer -> CPU or GPU, decided at its first projection


class CpuAssist:
    def __init__(self, workers: int, max_tokens: int, hidden: int, max_out: int, store_bytes: int,
                 job_timeout_s: float = 5.0, device: torch.device | None = None, max_rank: int = 0,
                 split: str = "auto"):
        swept = sweep_stale()
        if swept:
            log.info("swept %d stale shared-memory segments of dead lorad processes", len(swept))
        instance = new_instance()
        self.store = AdapterStore.create(instance, store_bytes)
        try:
            # Split groups (partition.plan) need 2 workers or more and a partial buffer per worker.
            if split == "groups" and (workers < 2 or max_rank < 1):
                raise BadRequest(f"cpu_lora_split=groups needs 2 workers or more (cpu_workers), not {workers}")
            self.split = split
            self.max_rank = max_rank if split != "tokens" and workers >= 2 else 0
            self.pool = WorkerPool(workers, self.store, max_tokens, hidden, max_out, instance=instance,
                                   job_timeout_s=job_timeout_s, max_rank=self.max_rank)
        except BaseException:
            self.store.close()
            raise
        self.job_timeout_s = job_timeout_s
        exchange = self.pool.exchange
        self.outputs = torch.from_numpy(self.pool.output)
        self.error = torch.from_numpy(exchange.error_word)  # int64 [1]: a GPU wait timed out (seq), 0: none
        buffer = exchange.segment.buffer
        # name -> (a weak reference to the LoraAdapter whose weights the store holds, its id in the store). Not the
        # weights' id: an adapter read again (new files under its name) may get the address of the one freed before.
        self._stored: OrderedDict[str, tuple[weakref.ref, int]] = OrderedDict()
        self.assisted = 0  # prefills whose LoRA the workers computed
        self.plans = {"tokens": 0, "groups": 0}  # spans (a prompt's rows in a step) planned each way
        self.fallbacks = 0  # requests sent back to the pool path after a failed job
        self.restarts_seen = self.fallbacks_seen = 0  # what the engine has counted in its metrics
        self.layers = {CPU: 0, GPU: 0}  # layers of cpu-assisted prefills served by each path
        self.layers_seen = dict(self.layers)
        self.layers_arrived = None  # (span, layer) -> bool: replaces the copy's event query (tests)
        self._cut_short = False  # fused path: the ring was full past the deadline, posting stopped
        self.mapping = self.launcher = None
        self.fused = device is not None and device.type == "cuda" and cuda_ext.available()
        if self.fused:
            self.invocation = "fused-cuda"
        elif device is not None and device.type == "cuda":
            self.invocation = cuda_ext.invocation_path()
        else:
            self.invocation = "python: the CPU engine (no device to overlap)"
        try:
            if self.fused:  # once at start-up: registering pins the pages and may synchronise
                self.mapping = cuda_ext.register_host(buffer)
                # The fused path's launches take device addresses worked out here, not per call.
                self.launcher = cuda_ext.FusedLauncher(self.mapping, self.error)
                self._job_flags_device = [self.launcher.flags(exchange.job_flags[w : w + 1]) for w in range(workers)]
                self._done_flags_device = [self.launcher.flags(exchange.done_flags[w : w + 1]) for w in range(workers)]
                # Workers 0..k-1 at once (one launch each way per span): entry k - 1.
                batched = range(1, min(workers, cuda_ext.MAX_FLAG_SEQS) + 1)
                self._job_flags_first = [self.launcher.flags(exchange.job_flags[:k]) for k in batched]
                self._done_flags_first = [self.launcher.flags(exchange.done_flags[:k]) for k in batched]
                self._input_address, self._input_nbytes = exchange.input_bytes.ctypes.data, exchange.input_bytes.size
                self._output_address, self._output_stride = self.pool.output.ctypes.data, self.pool.output.shape[1]
            self.cost = self._profile(hidden)
        except BaseException:
            self.close()
            raise
        log.info("cpu_assist_invocation path=%r workers=%d", self.invocation, self.workers)

    @property
    def workers(self) -> int:
        return self.pool.workers

    def _profile(self, hidden: int) -> CostModel:
        """One core's line at PROFILE_RANK and the round trip of a job through the pool."""
        cost = profile_cpu_lora(PROFILE_RANK, hidden, hidden, token_counts=(1, 16, 64, 256), repeats=5)

        class Probe:  # one module, rank 1: the dispatch cost, not the compute
            name = "__lorad-profile__"
            weights = {(0, 0): (torch.zeros(1, hidden), torch.zeros(hidden, 1))}

        adapter_id = self.store.put(Probe)
        try:
            dispatch_ms = profile_dispatch(self.pool, adapter_id, 0, 0, hidden, hidden, repeats=20)
            group_ms = (profile_group_dispatch(self.pool, adapter_id, 0, 0, hidden, hidden, repeats=20)
                        if self.max_rank else None)
        finally:
            self.store.remove(Probe.name)
            self.pool.stop_hot_polling()
        cost = cost.with_dispatch(dispatch_ms, group_ms)
        log.info("cpu lora profile rank=%d per_token_ms=%.5f overhead_ms=%.4f dispatch_ms=%.4f group_dispatch_ms=%s "
                 "workers=%d", cost.rank, cost.per_token_ms, cost.overhead_ms, cost.dispatch_ms,
                 "off" if group_ms is None else f"{group_ms:.4f}", self.workers)
        return cost

    def keep_workers_hot(self) -> None:
        """CPU-assisted work is in flight or about to be: workers poll for the next HOT_S."""
        self.pool.poll_hot_for(HOT_S)

    def is_staged(self, adapter) -> bool:
        """Whether `stage(adapter)` would find it in the store already (no copy)."""
        entry = self._stored.get(adapter.name)
        return entry is not None and entry[0]() is adapter

    def calibrate(self, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
                  rank: int = PROFILE_RANK, token_counts: tuple[int, ...] = (16, 128), layers: int = 2,
                  repeats: int = 3) -> dict:
        """End-to-end probe of the assisted path: a rank-`rank` adapter over `layers` layers and every
        projection of `shapes` ([(in, out)] by projection index), its LoRA run through `apply()` as the
        forward runs it (x and y on `device` in `dtype`, the invocation path in use, a device sync and
        `after_step` at the end), for each token count; the median of `repeats` after a warm-up.
        -> {"per_module_ms": [(tokens, ms per module invocation)], "stage_bytes_per_s": float}.
        The layer and plan counters are left as they were, and the workers cool (sleeping) at the end."""
        generator = torch.Generator().manual_seed(0)
        weights = {(layer, proj): (torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5,
                                   torch.randn(fan_out, rank, generator=generator) * (0.5 / rank))
                   for layer in range(layers) for proj, (fan_in, fan_out) in enumerate(shapes)}

        class Probe:
            name = PROBE_NAME

        Probe.weights = weights
        nbytes = sum(a.nbytes + b.nbytes for a, b in weights.values())
        layers_before, assisted_before, plans_before = dict(self.layers), self.assisted, dict(self.plans)
        started = time.perf_counter()
        adapter_id = self.store.put(Probe)
        stage_bytes_per_s = nbytes / max(time.perf_counter() - started, 1e-9)

        def no_gpu(x, y, layer, proj, span):
            raise RuntimeError(f"the calibration probe fell back to the pool path at layer {layer} proj {proj}")

        samples = []
        try:
            for tokens in token_counts:
                xs = [torch.randn(tokens, fan_in, generator=generator).to(device, dtype) for fan_in, _ in shapes]
                ys = [torch.zeros(tokens, fan_out, device=device, dtype=dtype) for _, fan_out in shapes]
                times = []
                for rep in range(repeats + 1):
                    span = self.span(PROBE_NAME, adapter_id, -1, weights.keys(), 0, tokens, rank=rank)
                    self.keep_workers_hot()
                    begun = time.perf_counter()
                    for layer in range(layers):
                        for proj in range(len(shapes)):
                            self.apply(xs[proj], ys[proj], layer, proj, [span], no_gpu)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if self.after_step([span]) or span.failed:
                        raise RuntimeError(f"the calibration probe's CPU jobs failed at {tokens} tokens")
                    if rep:  # the first run warms up
                        times.append((time.perf_counter() - begun) * 1e3)
                samples.append((tokens, statistics.median(times) / (layers * len(shapes))))
        finally:
            self.pool.stop_hot_polling()  # the probe is over: no worker spins until a real cold start keeps them hot
            self.store.remove(PROBE_NAME)
            self.layers, self.layers_seen, self.assisted = layers_before, dict(layers_before), assisted_before
            self.plans = plans_before
        log.info("cpu assist probe invocation=%r rank=%d per_module_ms=%s stage_gb_per_s=%.2f", self.invocation,
                 rank, [(tokens, round(ms, 4)) for tokens, ms in samples], stage_bytes_per_s / 1e9)
        return {"per_module_ms": samples, "stage_bytes_per_s": stage_bytes_per_s}

    def stage(self, adapter) -> int | None:
        """The adapter's id in the shared store, copying it in if needed (least recently used ones
        make room: no job is in flight between steps). None if it cannot fit."""
        if self.is_staged(adapter):
            self._stored.move_to_end(adapter.name)
            return self._stored[adapter.name][1]
        while True:
            try:
                adapter_id = self.store.put(adapter)
                break
            except StoreFull:
                others = [name for name in self._stored if name != adapter.name]
                if not others:
                    log.warning("adapter %s does not fit the CPU adapter store", adapter.name)
                    return None
                self.store.remove(others[0])
                del self._stored[others[0]]
        self._stored[adapter.name] = (weakref.ref(adapter), adapter_id)
        self._stored.move_to_end(adapter.name)
        return adapter_id

    def forget(self, name: str) -> None:
        if self._stored.pop(name, None) is not None:
            self.store.remove(name)

    def span(self, request_id: str, adapter_id: int, slot: int, modules, start: int, end: int,
             rank: int | None = None) -> CpuSpan:
        """The span of rows [start, end) of an adapter of (max) rank `rank`, planned over the workers:
        a token split, or a split group where the measured costs say it is faster."""
        chosen = plan(end - start, self.workers, self.cost, rank=rank, max_rank=self.max_rank, choice=self.split)
        self.plans["groups" if chosen.parts > 1 else "tokens"] += 1
        ranges = [(start + a, start + b) for a, b in chosen.ranges]
        return CpuSpan(request_id, adapter_id, slot, frozenset(modules), start, end, ranges, chosen.parts)

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer: int, proj: int, spans: list[CpuSpan], gpu_lora) -> None:
        """y[rows] += (x[rows] @ A^T) @ B^T for every span's rows: on the GPU for a layer whose copy
        has arrived (or, python path, after a failed job), else on the workers. `gpu_lora(x_rows,
        y_rows, layer, proj, span)` runs the pool path on a span's rows (span.gpu_batch).
        x: [T, in], y: [T, out] (a column slice of a fused projection output is fine), model dtype."""
        on_cpu = []
        for span in spans:
            path = self._path(span, layer)
            if (layer, proj) not in span.modules:
                continue
            if path == GPU or span.failed:
                gpu_lora(x[span.start : span.end], y[span.start : span.end], layer, proj, span)
            else:
                on_cpu.append(span)
        if not on_cpu:
            return
        self.pool.poll_hot_for(HOT_S)
        if self.fused:
            self._apply_fused(x, y, layer, proj, on_cpu)
        else:
            self._apply_python(x, y, layer, proj, on_cpu, gpu_lora)

    def _path(self, span: CpuSpan, layer: int) -> str:
        """CPU or GPU for the span's rows of `layer`, decided once, at the layer's first projection,
        from a non-blocking look at the layer's copy."""
        path = span.paths.get(layer)
        if path is None:
            if self.layers_arrived is not None:
                arrived = self.layers_arrived(span, layer)
            else:
                arrived = span.load is not None and span.load.on_device and span.load.arrived(layer)
            if arrived and span.load is not None:
                span.load.wait(layer)  # complete already: orders the kernels after the copy at no cost
            path = span.paths[layer] = GPU if arrived else CPU
            self.layers[path] += 1
        return path

    def _apply_fused(self, x: torch.Tensor, y: torch.Tensor, layer: int, proj: int, spans: list[CpuSpan]) -> None:
        """Per span: one copy_and_signal of its rows raising the job flag of every worker it uses, each to
        that worker's own seq, then (after every span's copy) one wait_and_add for all their done flags that
        adds the span's rows; all on the current stream. Seqs come from the pool in enqueue order, which is
        the device's signal order. A span one launch cannot serve (`_batchable`) takes a launch pair per
        worker."""
        if self._cut_short:
            return  # this step is recomputed (after_step): the kernels would only wait in vain
        in_features, out_features = x.shape[1], y.shape[1]
        dtype_code, itemsize = _IN_DTYPES[x.dtype], x.element_size()
        row_bytes = in_features * itemsize
        if (in_features > self.pool.exchange.config.hidden or x.shape[0] * row_bytes > self._input_nbytes
                or out_features > self._output_stride):
            raise ValueError(f"{x.shape[0]} rows of {in_features} -> {out_features} do not fit the exchange")
        launcher, pending = self.launcher, []
        stream = torch.cuda.current_stream(x.device).cuda_stream
        for span in spans:
            jobs = self._span_jobs(span, layer, proj, in_features, out_features, dtype_code)
            if jobs is None:
                break
            if not jobs:
                continue
            if self._batchable(span, jobs):
                seqs = [seq for _, seq, _, _ in jobs]
                source = x[span.start : span.end]
                launcher.copy_and_signal(self._input_address + span.start * row_bytes,
                                         source if source.is_contiguous() else source.contiguous(),
                                         self._job_flags_first[len(jobs) - 1], seqs, stream)
                pending.append((self._done_flags_first[len(jobs) - 1], seqs, span.start, span.end))
                continue
            # One launch pair per worker. A split group (more parts than one launch takes): part 0's copy carries
            # the rows and comes first, the others raise their flags only; part 0's wait adds the whole result
            # and comes last, the others add nothing.
            group = span.parts > 1
            waits = []
            for index, (worker, seq, start, end) in enumerate(jobs):
                if group and index > 0:
                    start = end = span.start
                source = x[start:end]
                launcher.copy_and_signal(self._input_address + start * row_bytes,
                                         source if source.is_contiguous() else source.contiguous(),
                                         self._job_flags_device[worker], seq, stream)
                waits.append((self._done_flags_device[worker], seq, start, end))
            pending.extend(waits[1:] + waits[:1] if group else waits)
        timeout_ns, stride = max(1, int(self.job_timeout_s * 1e9)), self._output_stride
        for flags, seq, start, end in pending:
            launcher.wait_and_add(y[start:end], self._output_address + start * stride * 4, stride, flags, seq,
                                  timeout_ns, stream, skip_if_error=True)

    def _batchable(self, span: CpuSpan, jobs: list[tuple[int, int, int, int]]) -> bool:
        """Whether one launch pair serves the span's jobs: their workers are 0..k-1 (the flags one launch
        takes lie side by side) and their rows, together, are exactly the span's (a group's parts each
        read all of them; a token split's ranges must tile them, so that the one add reads no row that
        no worker wrote)."""
        if len(jobs) > len(self._job_flags_first) or any(job[0] != index for index, job in enumerate(jobs)):
            return False
        if span.parts > 1:
            return True
        return (jobs[0][2] == span.start and jobs[-1][3] == span.end
                and all(before[3] == after[2] for before, after in zip(jobs, jobs[1:])))

    def _span_jobs(self, span: CpuSpan, layer: int, proj: int, in_features: int, out_features: int,
                   dtype_code: int) -> list[tuple[int, int, int, int]] | None:
        """Enqueue the span's jobs: (worker, seq, first row, end row) each; a split group's parts all read the
        span's rows. None when posting was cut short (a full ring): the jobs enqueued so far are released by
        settle() (a group's fail at their barrier)."""
        if span.parts > 1:
            group = self.pool.next_group()
            work = [(part, Job(span.adapter_id, layer, proj, span.start, span.end, in_features, out_features,
                               dtype_code, part, span.parts, group), span.start, span.end) for part in range(span.parts)]
        else:
            work = [(worker, Job(span.adapter_id, layer, proj, start, end, in_features, out_features, dtype_code), start, end)
                    for worker, (start, end) in enumerate(span.ranges) if start < end]
        jobs = []
        for worker, job, start, end in work:
            seq = self.pool.enqueue(worker, job)
            if seq is None:
                self._cut_short = True
                log.warning("cpu lora ring of worker %d full past %.1f s: the step is cut short", worker, self.job_timeout_s)
                return None
            jobs.append((worker, seq, start, end))
        return jobs

    def _apply_python(self, x, y, layer: int, proj: int, spans: list[CpuSpan], gpu_lora) -> None:
        """The host copies, posts, waits and adds; a failed job sends its span to the pool path."""
        in_features, out_features = x.shape[1], y.shape[1]
        exchange, jobs, pool, done = self.pool.exchange, [], self.pool, []
        for span in spans:
            rows = torch.from_numpy(exchange.input_rows(span.start, span.end, in_features)).view(torch.float32)
            rows.copy_(x[span.start : span.end])
            if span.parts > 1:  # one split group, alone on the workers
                if pool.run_split(span.adapter_id, layer, proj, (span.start, span.end), span.parts, in_features,
                                  out_features):
                    done.append((span, span.start, span.end))
                else:
                    span.failed = True
                    self.fallbacks += 1
                    log.warning("cpu lora split group failed request=%s layer=%d proj=%d; the pool path takes over",
                                span.request_id, layer, proj)
                continue
            jobs.extend((span, start, end) for start, end in span.ranges)
        for first in range(0, len(jobs), pool.workers):  # one job per worker in flight
            posted = [
                (worker, span, start, end,
                 pool.submit(worker, Job(span.adapter_id, layer, proj, start, end, in_features, out_features)))
                for worker, (span, start, end) in enumerate(jobs[first : first + pool.workers])
            ]
            for worker, span, start, end, seq in posted:
                if pool.wait(worker, seq):
                    done.append((span, start, end))
                elif not span.failed:
                    span.failed = True
                    self.fallbacks += 1
                    log.warning("cpu lora job failed request=%s layer=%d proj=%d rows=%d:%d; the pool path takes over",
                                span.request_id, layer, proj, start, end)
        for span, start, end in done:
            if not span.failed:
                y[start:end] += self.outputs[start:end, :out_features].to(y.device, y.dtype)
        for span in spans:
            if span.failed:
                gpu_lora(x[span.start : span.end], y[span.start : span.end], layer, proj, span)

    def after_step(self, spans: list[CpuSpan]) -> list[CpuSpan]:
        """Call once the step's device work is done (after sampling's sync). Returns the spans whose
        LoRA output is incomplete, so their step must be recomputed: a GPU-side wait timed out, a
        worker failed a job, or posting was cut short. Broken workers are replaced here, and the
        error word is cleared for the next step. Plain loads of shared memory: no device sync."""
        failed_workers = self.pool.settle()
        if not self.fused:  # the python path sent a failed job's span to the pool path in the step already
            failed_workers = []
        timed_out = int(self.error[0])
        cut_short, self._cut_short = self._cut_short, False
        if timed_out:
            self.error.zero_()
        if not (timed_out or failed_workers or cut_short):
            return []
        broken = [span for span in spans if not span.failed and CPU in span.paths.values()]
        self.fallbacks += len(broken)
        log.warning("cpu lora step failed (wait timed out at seq=%d, failed workers=%s, cut short=%s): "
                    "recomputing requests %s on the pool path", timed_out, failed_workers, cut_short,
                    [span.request_id for span in broken])
        return broken

    def close(self) -> None:
        mapping, self.mapping = getattr(self, "mapping", None), None
        if mapping is not None:
            mapping.close()
        pool, self.pool = getattr(self, "pool", None), None
        if pool is not None:
            self.outputs = self.error = None
            pool.close()
        store, self.store = getattr(self, "store", None), None
        if store is not None:
            store.close()
