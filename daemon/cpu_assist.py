"""CPU-assisted cold start (CaraServe §4): the LoRA of a prefill whose adapter is not yet in the page
pool, computed by the CPU workers (cpu_lora/worker.py) through shared memory while it is placed.

The engine owns one `CpuAssist`: the adapter store and the worker pool's exchange (both shm segments)
and the worker processes; `close()` stops and unlinks them. Per step the runner builds one `CpuSpan`
per CPU-assisted sequence (its rows of the step, split over the workers by partition.py's profiled
cost); per layer and projection `apply()` copies those rows of `x` into the exchange's fp32 input,
posts the jobs, waits for them and adds the results into the projection output: the semantics of
gpu_ops/cuda_ext.py's python path (copy, then signal; wait, then add). A job that fails (the worker
died, stalled or erred) sends its request back to the pool path for the rest of the step: the adapter
was placed at admission, so its rows are computed by the normal op and nothing is lost.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from lorad.cpu_lora.partition import CostModel, profile_cpu_lora, profile_dispatch, split
from lorad.cpu_lora.worker import WorkerPool
from lorad.shm.exchange import Job
from lorad.shm.segment import new_instance, sweep_stale
from lorad.shm.store import AdapterStore, StoreFull

log = logging.getLogger(__name__)

PROFILE_RANK = 16


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
    ranges: list[tuple[int, int]]  # absolute rows, one range per worker
    failed: bool = False  # a job failed: the pool path computes its rows for the rest of the step
    fallback_batch: object = field(default=None, repr=False)


class CpuAssist:
    def __init__(self, workers: int, max_tokens: int, hidden: int, max_out: int, store_bytes: int,
                 job_timeout_s: float = 5.0):
        swept = sweep_stale()
        if swept:
            log.info("swept %d stale shared-memory segments of dead lorad processes", len(swept))
        instance = new_instance()
        self.store = AdapterStore.create(instance, store_bytes)
        try:
            self.pool = WorkerPool(workers, self.store, max_tokens, hidden, max_out, instance=instance,
                                   job_timeout_s=job_timeout_s)
        except BaseException:
            self.store.close()
            raise
        self.inputs = torch.from_numpy(self.pool.input)
        self.outputs = torch.from_numpy(self.pool.output)
        self._stored: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (id(weights), adapter id)
        self.assisted = 0  # prefills whose LoRA the workers computed
        self.fallbacks = 0  # requests sent back to the pool path after a failed job
        self.restarts_seen = self.fallbacks_seen = 0  # what the engine has counted in its metrics
        try:
            self.cost = self._profile(hidden)
        except BaseException:
            self.close()
            raise

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
        finally:
            self.store.remove(Probe.name)
        cost = CostModel(cost.overhead_ms, cost.per_token_ms, dispatch_ms, cost.rank, cost.in_features,
                         cost.out_features, cost.samples)
        log.info("cpu lora profile rank=%d per_token_ms=%.5f overhead_ms=%.4f dispatch_ms=%.4f workers=%d",
                 cost.rank, cost.per_token_ms, cost.overhead_ms, cost.dispatch_ms, self.workers)
        return cost

    def stage(self, adapter) -> int | None:
        """The adapter's id in the shared store, copying it in if needed (least recently used ones
        make room: no job is in flight between steps). None if it cannot fit."""
        key = id(adapter.weights)
        entry = self._stored.get(adapter.name)
        if entry is not None and entry[0] == key:
            self._stored.move_to_end(adapter.name)
            return entry[1]
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
        self._stored[adapter.name] = (key, adapter_id)
        self._stored.move_to_end(adapter.name)
        return adapter_id

    def forget(self, name: str) -> None:
        if self._stored.pop(name, None) is not None:
            self.store.remove(name)

    def span(self, request_id: str, adapter_id: int, slot: int, modules, start: int, end: int) -> CpuSpan:
        ranges = [(start + a, start + b) for a, b in split(end - start, self.workers, self.cost)]
        return CpuSpan(request_id, adapter_id, slot, frozenset(modules), start, end, ranges)

    def apply(self, x: torch.Tensor, y: torch.Tensor, layer: int, proj: int, spans: list[CpuSpan], fallback) -> None:
        """y[rows] += (x[rows] @ A^T) @ B^T for every span's rows, on the workers. `fallback(x_rows,
        y_rows, layer, proj, span)` computes a span on the pool path once one of its jobs has failed."""
        in_features, out_features = x.shape[1], y.shape[1]
        jobs = []
        for span in spans:
            if (layer, proj) not in span.modules:
                continue
            if span.failed:
                fallback(x[span.start : span.end], y[span.start : span.end], layer, proj, span)
                continue
            self.inputs[span.start : span.end, :in_features].copy_(x[span.start : span.end])
            jobs.extend((span, start, end) for start, end in span.ranges)
        pool, done = self.pool, []
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
                y[start:end] += self.outputs[start:end, :out_features].to(y.dtype)
        for span in {span for span, _, _ in jobs if span.failed}:
            fallback(x[span.start : span.end], y[span.start : span.end], layer, proj, span)

    def close(self) -> None:
        pool, self.pool = getattr(self, "pool", None), None
        if pool is not None:
            self.inputs = self.outputs = None
            pool.close()
        store, self.store = getattr(self, "store", None), None
        if store is not None:
            store.close()
