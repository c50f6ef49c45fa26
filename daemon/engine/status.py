"""What the engine reports about itself: GET /v1/status (what runs, which paths are on and why, the pool, the
adapters, the cold-start and admission choices, the batch as `lorad router` reads it) and the snapshot of
counters and gauges that GET /metrics renders. Read under the engine's lock, from any thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorad.daemon.engine.gc_heap import gc_status
from lorad.gpu_ops import cuda_ext
from lorad.scheduler.batching import Sequence

if TYPE_CHECKING:
    from lorad.daemon.engine.engine import Engine


def engine_status(engine: Engine) -> dict:
    """GET /v1/status: the model, the ops and paths that run (and why others do not), the pool, the adapters,
    the cold-start and admission choices, and the batch as a router sees it."""
    with engine._lock:
        return {
            "model": engine.model_name,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "ops": engine.runner.ops.name,
            # the projections' weights (FP8: where from, and which GEMM path runs) and what the KV pages hold
            "quantization": engine.quantization.status(engine.runner.ops.fp8_gemm),
            "kv_cache_dtype": engine.kv_cache["dtype"],
            "kv_cache_scales": engine.kv_cache["scales"],
            "kv_capacity_tokens": engine.kv.capacity_tokens(),
            # whether the running cap (max_running_requests, below) was given ("config") or follows the KV
            # capacity ("kv_capacity")
            "max_running_requests_from": engine.max_running_from,
            "pool": engine.pool.occupancy(),
            # the choices of n > 1 requests: KV blocks held by several of them (counted once in pool.kv)
            "kv_sharing": {**engine.kv.sharing(), "forked_choices": engine.forked_choices},
            # the GPUs the engine spans and each rank's pool (daemon/engine/tp_worker.py); size 1: this device alone
            "tensor_parallel": (engine.tp.status(engine.pool) if engine.tp is not None
                                else {"size": 1, "gpus": [str(engine.device)]}),
            "adapters_resident": sorted(engine.residency.slots),
            "adapter_loads": engine.residency.loads,
            "adapter_prefetches": engine.residency.prefetches,
            "adapter_evictions": engine.residency.evictions,
            "adapter_staging": staging_status(engine),
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting) + len(engine._inbox),
            # how long the engine's step now running has run (0 between steps), and the steps that ran past
            # step_watch.STALL_WARN_S (each logged with where the engine thread waits)
            "step_running_s": round(engine.step_watch.running_s(), 3),
            "stalled_steps": engine.step_watch.stalled_steps,
            # running requests preempted when the KV cache ran short (each time; their tokens computed again)
            "preemptions": engine.scheduler.preemptions,
            # admission holds KV back for what running requests are expected to generate: ratio, the share of
            # their remaining max_tokens held (scheduler/batching.py GrowthReserve)
            "kv_growth_reserve": {"on": False} if (reserve := engine.scheduler.reserve) is None else
                                 {"on": True, "ratio": round(reserve.ratio, 4)},
            # KV positions an admission leaves free for each running request (scheduler/batching.py)
            "kv_admission_headroom": engine.scheduler.headroom,
            "steps": engine.steps,
            # Python's garbage collector: the start-up objects an engine process froze out of it (gc_heap.py; 0
            # where the engine runs in another program's process) and the collections of each generation
            "gc": gc_status(),
            # each step's wall time against its floor on this device (step_account.py): busy_s, floor_s, efficiency,
            # serial_floor_s (the floor with each step's phases one after the other)
            "step_time": engine.account.snapshot(),
            "cuda_graph_steps": engine.runner.graph_steps,
            "cuda_graphs": engine.runner.graphs.buckets if engine.runner.graphs is not None else "off",
            "prefill_cuda_graph_steps": engine.runner.prefill_graph_steps,
            "overlap_decode": engine.overlap_decode,
            "overlapped_decode_steps": engine.overlapped_steps,
            "plan_ahead": engine.plan_ahead,
            "planned_ahead_steps": engine.planned_ahead_steps,
            "steps_read_at_once": dict(engine.read_at_once),
            "prefill_cuda_graphs": engine.runner.prefill_graphs.tokens_buckets if engine.runner.prefill_graphs is not None else "off",
            "lora_kernel_choice": engine.kernel_choice.describe(),
            # where the profile came from: measured at start, found, given, off, none or failed (with why)
            "kernel_profile": dict(engine.kernel_profile),
            "decode_lora_groups": engine.runner.lora_groups,
            "prompt_lora_groups": engine.runner.prompt_lora_groups,
            "decode_lora_pdl": dict(engine.runner.lora_pdl),
            "decode_pdl": dict(engine.runner.decode_pdl),  # a decode step's kernels launched early
            "lora_kernel_steps": dict(engine.kernel_choice.steps),
            "cold_start": engine.config.cold_start,
            "cold_start_reason": engine.cold_start_reason,  # set, or the default for this device and why
            "cold_start_decisions": dict(engine.cold_starts.decisions),
            "cpu_workers": engine.cold_starts.cpu_assist.workers if engine.cold_starts.cpu_assist is not None else 0,
            "cpu_lora_invocation": cuda_ext.invocation_path(),
            "cpu_assist_invocation": engine.cold_starts.cpu_assist.invocation if engine.cold_starts.cpu_assist is not None else "off",
            "cpu_assist_layerwise": engine.config.layerwise,
            "cold_adapter_streaming": dict(engine.cold_starts.streaming),
            # how a streamed layer's runs of pool pages are queued past 16 of them: "cuda-ext" (one call into the CUDA
            # extension), "torch: why not" (a torch copy a run), "cpu"
            "adapter_copy_path": engine.table.copy_path,
            "cold_placements": dict(engine.residency.placed),
            "cold_stream_steps": {"steps": engine.cold_starts.stream_steps["steps"],
                                  "wall_ms": round(engine.cold_starts.stream_steps["seconds"] * 1e3, 3),
                                  "issue_ms": round(engine.residency.issue_seconds * 1e3, 3),
                                  # every streamed layer, ahead or not: runs of pool pages a layer (one copy each)
                                  "page_runs_per_layer": round(engine.table.streamed_runs["runs"]
                                                               / max(1, engine.table.streamed_runs["layers"]), 2)},
            # cold adapters streamed ahead of their request's admission, while the host waited for a step
            "cold_streamed_ahead": {"adapters": engine.residency.streamed_ahead,
                                    "layers": engine.residency.ahead_layers,
                                    "issue_ms": round(engine.residency.ahead_seconds * 1e3, 3)},
            "cpu_assist_layers": dict(engine.cold_starts.cpu_assist.layers) if engine.cold_starts.cpu_assist is not None else {"cpu": 0, "gpu": 0},
            "cpu_assisted_prefills": engine.cold_starts.cpu_assist.assisted if engine.cold_starts.cpu_assist is not None else 0,
            "cpu_assist_fallbacks": engine.cold_starts.cpu_assist.fallbacks if engine.cold_starts.cpu_assist is not None else 0,
            "cpu_worker_restarts": engine.cold_starts.cpu_assist.pool.restarts if engine.cold_starts.cpu_assist is not None else 0,
            # "native": hot polling and small jobs in the workers' C++ loop; else "python: why not"
            "cpu_worker_loop": engine.cold_starts.cpu_assist.pool.worker_loop if engine.cold_starts.cpu_assist is not None else "off",
            "cpu_jobs_native": assist.pool.native_jobs if (assist := engine.cold_starts.cpu_assist) is not None else 0,
            # how assisted prefills were shared among the workers: token splits or split groups
            "cpu_lora_split": engine.config.cpu_lora_split,
            "cpu_lora_plans": dict(engine.cold_starts.cpu_assist.plans) if engine.cold_starts.cpu_assist is not None else {},
            "cpu_lora_group_dispatch_ms": (engine.cold_starts.cpu_assist.cost.group_dispatch_ms
                                           if engine.cold_starts.cpu_assist is not None else None),
            "admission": {
                "policy": engine.scheduler.admission.name,
                "slo_ttft_ms": engine.config.slo_ttft_ms or None,
                "slo_tpot_ms": engine.config.slo_tpot_ms or None,
                "cluster_max_adapters": engine.config.cluster_max_adapters or None,
                "cluster_max_wait_ms": engine.admission_max_wait_ms,
                "ttft_estimate": admission_estimate_source(engine),
                "dropped": engine.admission_dropped,
                "tpot_rule": engine.tpot_rule,
                "tpot_held": engine.scheduler.tpot_held,
            },
            **_batch_locked(engine),
        }


def _batch_locked(engine: Engine) -> dict:
    """The batch as a router sees it (scheduler/router.py's EngineView), for `lorad router`: each running
    request as [adapter rank (0: base), context tokens, output tokens still allowed], each waiting one as
    [adapter rank, tokens to prefill]; the batch limit and the KV positions free in the pool."""

    def rank(seq: Sequence) -> int:  # _held keeps every in-flight request's adapter until it finishes
        return 0 if seq.adapter is None else engine._held[seq.adapter].adapter.rank

    return {
        "max_running_requests": engine.config.max_running_requests,
        "free_kv_tokens": engine.kv.free_tokens(),
        "running_batch": [
            [rank(seq), seq.num_tokens, seq.state.request.sampling.max_tokens - seq.num_generated]
            for seq in list(engine.scheduler.running)
        ],
        # (a choice forked from another's prefill may wait with its prompt's blocks: only the rest is to compute)
        "waiting_batch": [[rank(seq), seq.num_tokens - seq.num_computed] for seq in (*engine.scheduler.waiting, *engine._inbox)],
    }


def metrics_snapshot(engine: Engine) -> dict:
    """A picklable snapshot of the counters (daemon/engine/stats.py) and the gauges, for GET /metrics
    (daemon/server/metrics.py renders it)."""
    with engine._lock:
        running = [seq.adapter for seq in list(engine.scheduler.running)]
        waiting = [seq.adapter for seq in list(engine.scheduler.waiting) + engine._inbox]
    return engine.stats.snapshot(
        model=engine.model_name, quantization=engine.quantization.method, kv_cache_dtype=engine.kv_cache["dtype"],
        kv_capacity_tokens=engine.kv.capacity_tokens(),
        running=len(running), waiting=len(waiting), running_adapters=running,
        waiting_adapters=waiting, max_lora=engine.table.num_slots, pool=engine.pool.occupancy(),
        adapters_resident=len(engine.residency.slots), adapter_evictions=engine.residency.evictions,
        admission_tpot_held=engine.scheduler.tpot_held, preemptions=engine.scheduler.preemptions,
        steps=engine.account.metrics(), step_running_s=engine.step_watch.running_s(),
        stalled_steps=engine.step_watch.stalled_steps,
        cpu_jobs_native=assist.pool.native_jobs if (assist := engine.cold_starts.cpu_assist) is not None else 0,
        tensor_parallel_ranks=engine.tp.ranks() if engine.tp is not None else [],
    )


def admission_estimate_source(engine: Engine) -> str:
    """Where early abort's prefill estimate comes from: the profile, or the engine's online fit."""
    if engine.config.admission != "early-abort":
        return "none (no early abort)"
    if engine.online_prefill is not None:
        return engine.online_prefill.describe()
    return f"profile:{engine.kernel_choice.source}"


def staging_status(engine: Engine) -> dict | None:
    """cuda: adapters read and staged on the stager's threads ("off_thread") against those the engine thread had to
    stage itself at admission or prefetch; the stager's threads, the mean time one took to read and stage an adapter
    ("stage_ms_mean"; by part, with the threads' CPU time, in "parts_ms_mean") and the mean from its ask to the engine's
    take, once a step ("ready_ms_mean": its wait for a free thread included); the adapters whose admission waited for
    the stager while other rows ran ("admissions_deferred"), and the requests admitted past such a waiting one
    ("admitted_past_staging"); the pinned memory staged adapters are copied into, pinned once at start-up
    ("pinned_arena": gpu_ops/pinned_arena.py's stats, with "misses", the adapters left pageable for want of a free
    range). None where staging is not backgrounded (the CPU)."""
    stager = engine.residency.stager
    if stager is None:
        return None

    def mean_ms(seconds: float) -> float | None:
        return round(seconds / stager.staged * 1e3, 1) if stager.staged else None

    return {"off_thread": engine.residency.staged_off_thread, "pending": stager.pending(), "threads": stager.threads,
            "stage_ms_mean": mean_ms(stager.seconds), "ready_ms_mean": mean_ms(stager.ready_seconds),
            "parts_ms_mean": {part: mean_ms(seconds) for part, seconds in stager.part_seconds.items()},
            "admissions_deferred": engine.residency.admissions_deferred,
            "admitted_past_staging": engine.scheduler.past_staging, "pinned_arena": pinned_arena_status(engine)}


def pinned_arena_status(engine: Engine) -> dict | None:
    arena = engine.residency.arena
    if arena is None:
        return None
    return {**arena.stats(), "misses": engine.residency.pinned_misses}
