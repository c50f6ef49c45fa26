"""The engine's side of cold starts (CaraServe): for each request whose adapter the page pool does not hold
yet, the choice between waiting for the copy (gpu-wait), running while it streams in layer by layer
(gpu-stream) and having the CPU workers compute its prefill's LoRA (cpu-assist); how the adapter is placed
to match; what happens when the assisted or streamed step is over; and the costs `auto` decides from,
measured at start-up and corrected online. scheduler/cold_start.py holds the decision model itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable

import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.adapter_residency import LoraResidency
from lorad.daemon.engine.cpu_assist import PROFILE_RANK, CpuAssist, default_workers, keep_off_cores
from lorad.daemon.engine.stats import Metrics
from lorad.daemon.model.adapters import LoraAdapter
from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec
from lorad.gpu_ops.page_pool import AdapterTable, StreamedLoad
from lorad.shm.exchange import ExchangeConfig, ExchangeLayout
from lorad.shm.segment import SHM_DIR
from lorad.scheduler.batching import Sequence
from lorad.scheduler.cold_start import (
    CPU_ASSIST,
    DECISIONS,
    GPU_STREAM,
    GPU_WAIT,
    ColdStart,
    ColdStartCosts,
    Decision,
    decide,
    observe_assisted,
)

log = logging.getLogger(__name__)

CPU_STORE_BYTES = 1 << 30  # the CPU workers' shared adapter store (fp32; least recently used make room)
CPU_JOB_TIMEOUT_S = 5.0  # a CPU LoRA job not done by then has a dead or stalled worker: the pool path takes over


def resolve_cold_start(config: EngineConfig, device: torch.device, spec: ModelSpec,
                       shm_free_bytes: Callable[[], int | None] | None = None) -> tuple[str, str]:
    """The cold-start mode an engine runs and why (logged, in /v1/status): cold_start when it is set; else auto on
    cuda at tensor_parallel_size 1, never slower than ondemand in BENCHMARKS.md's cold-start figures (5.1: 0.76x
    ondemand's mean TTFT with pageable adapters, 1.04x cached's; 5.2: 0.97-0.99x ondemand's with pinned ones), and
    ondemand elsewhere, or where /dev/shm cannot hold what auto's CPU workers share."""
    if config.cold_start is not None:
        return config.cold_start, "set (cold_start)"
    if device.type != "cuda":
        return "ondemand", (f"the default on {device.type} (auto's CPU workers would take the cores the engine "
                            "computes on)")
    if config.tensor_parallel_size > 1:
        return "ondemand", (f"the default at tensor_parallel_size {config.tensor_parallel_size} (auto's CPU workers "
                            "compute whole-model LoRA, the ranks hold shards)")
    needed = cpu_assist_shm_bytes(config, spec)
    free = (shm_free_bytes or _shm_free_bytes)()
    if free is not None and free < needed:
        return "ondemand", (f"the default where {SHM_DIR} is short: {free >> 20} MiB free, auto's CPU workers share "
                            f"{needed >> 20} MiB there")
    return "auto", "the default on cuda (never slower than ondemand: BENCHMARKS.md, figures 5.1 and 5.2)"


def cpu_assist_shm_bytes(config: EngineConfig, spec: ModelSpec) -> int:
    """The shared memory the CPU workers of cold_start cpu|auto map: the adapter store and the job exchange (at its
    largest: partial buffers for split groups)."""
    shapes = [spec.projection_shape(p) for p in PROJECTIONS]
    exchange = ExchangeConfig(workers=default_workers(config.cpu_workers), max_tokens=config.max_batch_tokens,
                              hidden=max(fan_in for fan_in, _ in shapes), max_out=max(fan_out for _, fan_out in shapes),
                              max_rank=config.max_lora_rank)
    return CPU_STORE_BYTES + (2 << 20) + ExchangeLayout.of(exchange).size  # (2 MiB: the store's header and index)


def _shm_free_bytes() -> int | None:
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return None  # no /dev/shm to measure: nothing to say against auto
    return stats.f_bavail * stats.f_frsize


def streaming_availability(config: EngineConfig, device: torch.device, ops_name: str) -> dict:
    """Whether cold adapters may stream in during their prefill (`gpu-stream`, a choice of cold_start auto):
    {"on": bool, "why": why it is off}; logged, in /v1/status."""
    if config.cold_start != "auto":
        reason = f"cold_start {config.cold_start} (only auto streams)"
    elif not config.layerwise:
        reason = "layerwise off"
    elif device.type != "cuda" or not ops_name.startswith("triton"):
        reason = f"{device.type}: reference ops (the device-side wait is a Triton kernel's)"
    else:
        reason = None
    log.info("cold adapter streaming=%s", "on" if reason is None else f"off ({reason})")
    return {"on": reason is None, "why": reason}


class ColdStarts:
    """Cold starts for one engine. `held(name)`: the adapter a request in the engine holds; `fail(seq,
    reason)`: ends a request with an error. With cold_start cpu|auto, `start_cpu_assist` starts the workers."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 table: AdapterTable, residency: LoraResidency, stats: Metrics, streaming: dict,
                 held: Callable[[str], LoraAdapter], fail: Callable[[Sequence, str], None]):
        self.config, self.spec, self.device, self.dtype = config, spec, device, dtype
        self.table, self.residency, self.stats, self.streaming = table, residency, stats, streaming
        self.held, self.fail = held, fail
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.stream_steps = {"steps": 0, "seconds": 0.0}  # steps run while adapters streamed in, their wall time
        self.cpu_assist: CpuAssist | None = None
        self.costs: ColdStartCosts | None = None  # measured at start-up (auto); tests may replace it
        # (thread, its cpu affinity before keep_off_cores) on cuda with CPU workers, restored by close()
        self._affinity: tuple = (None, None)
        self._assist_began = 0.0
        self._assist_predictions: list[Decision] = []
        self._assist_step_tokens = 0

    # ---- start-up ---------------------------------------------------------------------------------
    def start_cpu_assist(self) -> None:
        """cold_start cpu|auto: the workers and their shared memory; the engine's thread kept off their cores on
        cuda; cold adapters placed as the coming decision wants them; and auto's costs measured."""
        shapes = [self.spec.projection_shape(p) for p in PROJECTIONS]
        self.cpu_assist = assist = CpuAssist(
            default_workers(self.config.cpu_workers), self.config.max_batch_tokens,
            max(fan_in for fan_in, _ in shapes), max(fan_out for _, fan_out in shapes), CPU_STORE_BYTES,
            job_timeout_s=CPU_JOB_TIMEOUT_S, device=self.device, max_rank=self.config.max_lora_rank,
            split=self.config.cpu_lora_split,
        )
        try:
            if self.device.type == "cuda":  # the GPU engine's host work never shares a core with a worker
                self._affinity = (threading.get_ident(), keep_off_cores(assist.pool.worker_cores))
                log.info("engine threads on cores %s, cpu lora workers on %s",
                         sorted(os.sched_getaffinity(0)), assist.pool.worker_cores)
            # Cold adapters of cpu-assisted prefills are copied layer by layer, so each layer passes to
            # the GPU as it arrives; the others are placed as ondemand places them.
            self.residency.placement_for = self.placement
            log.info("cpu_assist_invocation path=%r layerwise=%s", assist.invocation, self.config.layerwise)
            self.costs = self.measure_costs()
        except BaseException:
            self.close()
            raise

    def measure_costs(self) -> ColdStartCosts:
        """What `auto` decides from: host -> pool bandwidth per tier, the workers' profiled cost."""
        probe = 8 << 20
        bandwidth = {}
        if self.device.type == "cuda":
            device_buffer = torch.empty(probe, dtype=torch.uint8, device=self.device)
            for tier, pinned in (("pinned", True), ("pageable", False)):
                source = torch.ones(probe, dtype=torch.uint8, pin_memory=pinned)
                bandwidth[tier] = probe / _best_seconds(
                    lambda: device_buffer.copy_(source, non_blocking=pinned), self.device)  # noqa: B023 (called at once)
        else:
            source, destination = torch.ones(probe, dtype=torch.uint8), torch.empty(probe, dtype=torch.uint8)
            bandwidth["host"] = probe / _best_seconds(lambda: destination.copy_(source), self.device)
        cost = self.cpu_assist.cost
        # The profile is of one hidden x hidden module: scale to this model's mean projection.
        shapes = [self.spec.projection_shape(p) for p in PROJECTIONS]
        mean_width = sum(fan_in + fan_out for fan_in, fan_out in shapes) / len(shapes)
        per_token_rank = cost.per_token_ms / cost.rank * mean_width / (cost.in_features + cost.out_features)
        modelled = ColdStartCosts(
            load_bytes_per_s=bandwidth, cpu_per_token_rank_ms=per_token_rank, cpu_overhead_ms=cost.overhead_ms,
            dispatch_ms=cost.dispatch_ms, workers=self.cpu_assist.workers, prefill_ms_per_token=0.0,
            # Serial on both paths: a layer's next kernels need its LoRA output, so the device's
            # wait_and_add (fused) or the host's wait (python) holds the forward until the workers are done.
            overlapped=False,
            layerwise=self.config.layerwise and self.device.type == "cuda",
            num_layers=self.spec.num_layers,
            streaming=self.streaming["on"],
        )
        # What the one-core model misses (exchange copies, wake-ups, the per-invocation sync, workers
        # sharing memory bandwidth) comes from a probe through the real path: per module invocation
        # ms = invoke_ms + cpu_scale * modelled compute, fitted over the probe's prompt lengths.
        probe = self.cpu_assist.calibrate(shapes, self.device, self.dtype)
        points = [(modelled.cpu_lora_ms(tokens, PROFILE_RANK, 1), ms) for tokens, ms in probe["per_module_ms"]]
        (x0, y0), (x1, y1) = points[0], points[-1]
        cpu_scale = max((y1 - y0) / (x1 - x0), 0.1) if x1 > x0 else 1.0
        invoke_ms = max(y0 - cpu_scale * x0, 0.0)
        costs = dataclasses.replace(modelled, invoke_ms=invoke_ms, cpu_scale=cpu_scale,
                                    stage_bytes_per_s=probe["stage_bytes_per_s"])
        log.info("cold start costs %s probe_points=%s", costs, [(round(x, 4), round(y, 4)) for x, y in points])
        return costs

    def close(self) -> None:
        """Stops the CPU workers and gives the thread that started them its cores back. Idempotent."""
        assist, self.cpu_assist = self.cpu_assist, None
        if assist is not None:
            assist.close()
        thread, before = self._affinity
        if before is not None and thread == threading.get_ident():  # affinity is per thread: only the one that set it
            os.sched_setaffinity(0, before)
            self._affinity = (None, None)

    # ---- each step ----------------------------------------------------------------------------------
    def admit(self, plan: list[tuple[Sequence, int]]) -> dict[Sequence, int]:
        """The requests this step admitted whose adapter the pool did not hold: each one's first step
        waits for the placement (gpu-wait), runs while it streams in (gpu-stream: its adapter was placed
        so, see `placement`) or has its LoRA computed by the CPU workers (cpu-assist).
        -> {sequence: its adapter's id in the CPU store} for the cpu-assisted ones."""
        if not self.residency.admitted_cold:
            return {}
        cold = dict(self.residency.admitted_cold)
        self.residency.admitted_cold.clear()
        assisted = {}
        self._assist_began = time.perf_counter()  # staging included: the prediction includes it
        self._assist_predictions = []
        self._assist_step_tokens = sum(count for _, count in plan)
        for seq, count in plan:
            if seq.num_computed or seq.adapter not in cold:
                continue
            adapter = self.held(seq.adapter)
            if isinstance(self.residency.loading.get(seq.adapter), StreamedLoad):
                choice, decision = GPU_STREAM, None
            else:
                choice, decision = self.choice(adapter, count, cold[seq.adapter])
                choice = GPU_WAIT if choice == GPU_STREAM else choice  # placed whole after all
            if choice == CPU_ASSIST:
                # The workers poll from now on: their first job is moments away. Only then: a gpu-wait
                # cold start must not set the workers spinning on cores the engine may need.
                self.cpu_assist.keep_workers_hot()
                adapter_id = self.cpu_assist.stage(adapter)
                if adapter_id is None:
                    choice = GPU_WAIT
                else:
                    assisted[seq] = adapter_id
                    if decision is not None:
                        self._assist_predictions.append(decision)
            self.decisions[choice] += 1
            self.stats.cold_start_decided(choice)
        # Layer-wise copies of adapters whose rows take the pool path this step: joined before the forward.
        # (An assisted request whose copy was placed in one piece has nothing in `loading`: the CPU
        # serves all its layers.) Streamed ones: the forward waits for their table rows only.
        streaming = set(self.residency.streaming())
        for name in streaming:
            self.residency.loading[name].make_current_stream_wait()
        self.residency.join([name for name in self.residency.loading
                             if name not in streaming and name not in {seq.adapter for seq in assisted}])
        return assisted

    def placement(self, adapter: LoraAdapter, tier: str, tokens: int | None) -> str:
        """At admission, before the copy starts: how this cold adapter is placed (adapter_residency.PLACEMENTS),
        from the same decision `admit` makes next: layer by layer for a prefill that will be cpu-assisted,
        streamed for a gpu-stream one, whole otherwise (a gpu-wait cold start would pay per-layer copies
        and events, then join them all, for nothing)."""
        if not self.config.layerwise or (tokens is None and self.config.cold_start != "cpu"):
            return "whole"
        choice = self.choice(adapter, tokens or 0, tier)[0]
        return {CPU_ASSIST: "layerwise", GPU_STREAM: "stream"}.get(choice, "whole")

    def choice(self, adapter: LoraAdapter, tokens: int, tier: str) -> tuple[str, Decision | None]:
        """-> (the choice, the `auto` decision with its predicted costs; None in a forced mode)."""
        mode = self.config.cold_start
        if self.cpu_assist is None or mode not in ("cpu", "auto"):
            return GPU_WAIT, None
        if mode == "cpu":
            return CPU_ASSIST, None
        # what the copy into the pool moves: the staged pages (the pool's dtype), not the float32 host weights
        pool = self.table.pool
        copy_bytes = self.table.pages_needed(adapter.weights) * pool.page_elems * pool.pages.element_size()
        request = ColdStart(tokens, adapter.nbytes, adapter.rank, len(adapter.weights), tier,
                            staged=self.cpu_assist.is_staged(adapter), copy_bytes=copy_bytes)
        try:
            decision = decide(request, self.costs)
        except KeyError as error:  # a tier not measured at start-up
            log.warning("cold start decision impossible (%s): gpu-wait", error)
            return GPU_WAIT, None
        log.debug("cold start adapter=%s tier=%s tokens=%d staged=%s choice=%s gpu_wait_ms=%.3f cpu_assist_ms=%.3f "
                  "prefill_ms=%.3f cpu_layers=%d correction=%.3f", adapter.name, tier, tokens, request.staged,
                  decision.choice, decision.gpu_wait_ms, decision.cpu_assist_ms, decision.prefill_ms,
                  decision.cpu_layers, decision.correction)
        return decision.choice, decision

    def after_cpu_assist(self, assisted: dict, spans: list) -> set:
        """After the step's sync (sampling): the layer-wise copies joined, the counters moved on, and
        -> the sequences whose step must be recomputed (a failed fused-path job: cpu_assist.after_step);
        their prefill runs again next step on the pool path, where the adapter now is."""
        assist = self.cpu_assist
        self.residency.join()
        broken = {span.request_id for span in assist.after_step(spans)}
        redo = {seq for seq in assisted if seq.request_id in broken}
        predictions, self._assist_predictions = self._assist_predictions, []
        if predictions and not redo and self.costs is not None:
            # auto's online check: what the assisted step took beyond the base prefill's moving average.
            elapsed_ms = (time.perf_counter() - self._assist_began) * 1e3
            base_ms = self.costs.prefill_ms_per_token * self._assist_step_tokens
            self.costs = observe_assisted(self.costs, predictions, elapsed_ms - base_ms)
            log.debug("cold start observed assisted step ms=%.3f base_ms=%.3f predicted_extra_ms=%.3f correction=%.3f",
                      elapsed_ms, base_ms, sum(d.cpu_extra_ms for d in predictions), self.costs.correction)
        assist.assisted += len(assisted) - len(redo)
        for _ in range(assist.pool.restarts - assist.restarts_seen):
            self.stats.worker_restarted()
        for _ in range(assist.fallbacks - assist.fallbacks_seen):
            self.stats.cpu_assist_fell_back()
        for path, count in assist.layers.items():
            self.stats.cpu_assist_layers(path, count - assist.layers_seen[path])
        assist.restarts_seen, assist.fallbacks_seen, assist.layers_seen = assist.pool.restarts, assist.fallbacks, dict(assist.layers)
        return redo

    def after_streams(self, plan: list[tuple[Sequence, int]]) -> set[Sequence]:
        """After a step that ran while adapters streamed in (its sampling synchronised the device): their
        copies joined -> the sequences of the step that read a copy that failed or came too late (a LoRA
        kernel gave up waiting). Those are failed with the reason and their adapters dropped from the pool;
        the engine goes on."""
        names = self.residency.streaming()
        if not names:
            return set()
        failed = self.residency.finish_streams()
        if self.table.stream_error.item():  # which slot a kernel gave up on is not kept: all of the step's
            self.table.stream_error.zero_()
            failed.update({name: "the adapter's copy to the GPU did not arrive in time" for name in names if name not in failed})
        if not failed:
            return set()
        broken = {seq for seq, _ in plan if seq.adapter in failed}
        for seq in broken:
            log.error("request failed id=%s adapter=%s: %s", seq.request_id, seq.adapter, failed[seq.adapter])
            self.fail(seq, failed[seq.adapter])
        for name in failed:
            self.residency.drop(name)
        return broken

    def count_stream_step(self, seconds: float) -> None:
        """A step ran while adapters streamed in, in `seconds` of wall time (its streams' checks included)."""
        self.stream_steps["steps"] += 1
        self.stream_steps["seconds"] += seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """auto: the base prefill's cost per token, a moving average over plain steps with prompt tokens."""
        if self.costs is None or self.config.cold_start != "auto":
            return
        previous = self.costs.prefill_ms_per_token
        sample = seconds * 1e3 / tokens
        self.costs = dataclasses.replace(
            self.costs, prefill_ms_per_token=sample if previous == 0 else 0.8 * previous + 0.2 * sample)


def _best_seconds(copy, device: torch.device, repeats: int = 3) -> float:
    """The fastest of a few runs of `copy` (synchronised on cuda): a bandwidth probe."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        copy()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)
