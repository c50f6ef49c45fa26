"""A discrete-event simulator of N engines serving a request trace, for comparing routing policies.

Each engine batches at iteration level the way LightLLM (S-LoRA, CaraServe) does: when queued requests
fit (batch limit, KV tokens, prefill token budget) the next step prefills them, taking the prefill
model's time, and each gets its first token at its end; otherwise the step decodes every running request
by one token, taking the decode-step model's time for the batch's ranks and context. A request reserves
KV for its prompt and whole output at admission (no preemption). Adapter loading is not modelled: every
adapter is resident everywhere. Each arriving request is routed by a policy of router.py, which sees the
engines' `EngineView`s, kept up to date in O(1) per event. Which queued requests a prefill step takes, and
which it drops, is an admission policy's choice (admission.py; FCFS by default). With `tpot_admission`
the engines keep the time-per-token rule as lorad's engine does: a queued request does not join a running
batch whose decode step, with it, the profile's decode model predicts above the objective.

Per request: TTFT (arrival to first token), time per token (first to last token over the output tokens
after the first, CaraServe's "time per token" of the decode phase), latency (arrival to last token).
A dropped request has none of them (NaN) and counts as a miss of every objective.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from lorad.errors import BadRequest
from lorad.scheduler.admission import FCFS, AdmissionPolicy, Objectives, Queued, Room, RunningBatch
from lorad.scheduler.perf_model import Profile
from lorad.scheduler.router import EngineView, Policy, RouteRequest
from lorad.scheduler.workload import Trace


@dataclass(frozen=True)
class SimConfig:
    num_engines: int = 1
    max_running: int = 64  # batch limit of one engine
    max_prefill_tokens: int = 4096  # prompt tokens in one prefill step (a longer prompt goes alone)
    kv_tokens: int = 1 << 40  # KV capacity of one engine in tokens
    slo_tpot_s: float | None = None  # None: slo_scale x the unloaded decode step at the trace's largest rank
    slo_ttft_s: float | None = None  # None: slo_ttft_scale x the unloaded prefill of the trace's mean prompt
    slo_scale: float = 1.5
    slo_ttft_scale: float = 5.0
    tpot_admission: bool = False  # hold back admissions that would break the time-per-token objective


@dataclass
class SimResult:
    """Per-request outcomes (numpy arrays in trace order) and the SLOs they were judged by."""

    policy: str
    arrival_s: np.ndarray
    engine: np.ndarray
    output_tokens: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray  # NaN for one-token outputs (no decode phase)
    latency_s: np.ndarray
    slo_tpot_s: float
    slo_ttft_s: float
    decode_steps: int
    prefill_steps: int
    admission: str = "fcfs"
    tpot_held: int = 0  # requests the time-per-token rule held back at least once
    dropped: np.ndarray | None = None  # bool per request; None: nothing dropped
    drop_reasons: dict | None = None  # request index -> why it was dropped

    def summary(self) -> dict:
        count = len(self.arrival_s)
        dropped = self.dropped if self.dropped is not None else np.zeros(count, dtype=bool)
        served = ~dropped
        finish = self.arrival_s + self.latency_s
        makespan = float(np.nanmax(finish[served]) - np.min(self.arrival_s)) if served.any() else 0.0
        tpot_ok = served & (np.isnan(self.tpot_s) | (self.tpot_s <= self.slo_tpot_s))
        ttft_ok = served & (self.ttft_s <= self.slo_ttft_s)
        reasons: dict[str, int] = {}
        for reason in (self.drop_reasons or {}).values():
            kind = reason.split(":")[0]
            reasons[kind] = reasons.get(kind, 0) + 1
        return {
            "policy": self.policy,
            "admission": self.admission,
            "requests": int(count),
            "completed": int(served.sum()),
            "dropped": int(dropped.sum()),
            "drop_reasons": reasons,
            "makespan_s": makespan,
            "throughput_rps": int(served.sum()) / makespan if makespan > 0 else 0.0,
            "throughput_tokens_per_s": float(self.output_tokens[served].sum()) / makespan if makespan > 0 else 0.0,
            "ttft_s": distribution(self.ttft_s),
            "tpot_s": distribution(self.tpot_s),
            "latency_s": distribution(self.latency_s),
            "slo_tpot_s": self.slo_tpot_s,
            "slo_ttft_s": self.slo_ttft_s,
            "slo_tpot_attainment": float(tpot_ok.mean()) if len(tpot_ok) else 1.0,
            "slo_ttft_attainment": float(ttft_ok.mean()) if len(ttft_ok) else 1.0,
            "slo_attainment": float((tpot_ok & ttft_ok).mean()) if len(tpot_ok) else 1.0,
            "decode_steps": self.decode_steps,
            "prefill_steps": self.prefill_steps,
            "tpot_held": self.tpot_held,
        }


def distribution(values: np.ndarray) -> dict:
    """Mean, p50, p90, p99 of the values that are not NaN (all NaN when none is)."""
    values = values[~np.isnan(values)]
    if not len(values):
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


class _Engine:
    """One engine's state besides its view: the queue, the running batch's aggregates (the step's
    cost depends on running requests only, the view's on running and queued), and the running
    requests ordered by the decode step on which they finish."""

    def __init__(self, engine_id: int, config: SimConfig):
        self.view = EngineView(engine_id, config.max_running, free_kv_tokens=config.kv_tokens)
        self.queue: deque[Queued] = deque()
        self.finishing: list[tuple[int, int]] = []  # heap of (decode step of the last token, request)
        self.decode_steps = 0
        self.rank_counts: dict[int, int] = {}
        self.adapter_counts: dict[str, int] = {}  # adapters of the running batch
        self.rank_sum = 0
        self.context_tokens = 0
        self.reserved = 0  # KV tokens held by admitted requests (prompt + whole output)
        self.busy = False
        self.prefilling: list[int] = []  # the requests of the prefill step in flight


def objectives_for(trace: Trace, profile: Profile, config: SimConfig = SimConfig()) -> Objectives:
    """The objectives a simulation judges by: the config's, else slo_scale x the unloaded decode step at
    the trace's largest rank (time per token) and slo_ttft_scale x the unloaded prefill of its mean
    prompt at that rank (TTFT)."""
    ranks = [trace.adapter_ranks[r.adapter] for r in trace.requests if r.adapter in trace.adapter_ranks]
    top = max(ranks, default=0)
    tpot = config.slo_tpot_s
    if tpot is None:
        tpot = config.slo_scale * profile.decode.predict([top], 0)
    ttft = config.slo_ttft_s
    if ttft is None:
        mean_prompt = int(round(float(np.mean([r.prompt_tokens for r in trace.requests])))) if trace.requests else 0
        ttft = config.slo_ttft_scale * profile.prefill.predict([(mean_prompt, top)])
    return Objectives(float(ttft), float(tpot))


def simulate(
    trace: Trace, profile: Profile, policy: Policy, config: SimConfig = SimConfig(),
    admission: AdmissionPolicy | None = None,
) -> SimResult:
    admission = admission or FCFS()
    if config.num_engines < 1 or config.max_running < 1:
        raise BadRequest("num_engines and max_running must be at least 1")
    requests = trace.requests
    count = len(requests)
    unranked = {r.adapter for r in requests} - trace.adapter_ranks.keys()
    if unranked:
        raise BadRequest(f"the trace gives no rank for adapters {sorted(unranked)[:5]}")
    arrival = np.array([r.arrival_s for r in requests], dtype=np.float64)
    prompt = [r.prompt_tokens for r in requests]
    output = [max(1, r.output_tokens) for r in requests]
    rank = [trace.adapter_ranks[r.adapter] for r in requests]
    adapter = [r.adapter for r in requests]
    decode, prefill = profile.decode, profile.prefill
    objectives = objectives_for(trace, profile, config)
    slo_tpot, slo_ttft = objectives.tpot_s, objectives.ttft_s

    engines = [_Engine(i, config) for i in range(config.num_engines)]
    views = [e.view for e in engines]
    engine_of = np.full(count, -1, dtype=np.int64)
    first_token = np.full(count, math.nan)
    finish = np.full(count, math.nan)
    dropped = np.zeros(count, dtype=bool)
    drop_reasons: dict[int, str] = {}
    held: set[int] = set()  # requests the time-per-token rule held back
    tpot_model = decode if config.tpot_admission else None
    events: list[tuple[float, int, int]] = []  # (time, tie-break, engine) of step ends
    sequence = 0
    prefill_steps = 0

    def start_step(engine: _Engine, now: float) -> None:
        nonlocal sequence, prefill_steps
        view = engine.view
        batch: list[int] = []
        if engine.queue:
            room = Room(
                slots=config.max_running - view.num_running,
                prefill_tokens=config.max_prefill_tokens,
                kv_tokens=config.kv_tokens - engine.reserved,
                batch_empty=view.num_running == 0,
                running_adapters=frozenset(engine.adapter_counts),
                running=RunningBatch(view.num_running, max(engine.rank_counts, default=0), engine.rank_sum,
                                     engine.context_tokens),
                decode=tpot_model,
            )
            decision = admission.select(engine.queue, now, room, objectives)
            batch = list(decision.admit)
            held.update(decision.held)
            for index, reason in decision.drop:
                drop_request(engine, index, reason)
            leaving = len(batch) + len(decision.drop)
            if leaving:
                gone = set(batch).union(index for index, _ in decision.drop)
                if all(engine.queue[i].key in gone for i in range(leaving)):
                    for _ in range(leaving):
                        engine.queue.popleft()
                else:
                    engine.queue = deque(q for q in engine.queue if q.key not in gone)
            for index in batch:
                engine.reserved += prompt[index] + output[index]
            if engine.queue and not batch and not view.num_running:
                raise RuntimeError(f"admission {admission.name} left an idle engine with a queue")
        if batch:
            duration = prefill.predict([(prompt[i], rank[i]) for i in batch])
            engine.prefilling = batch
            prefill_steps += 1
        elif view.num_running:
            duration = decode.from_stats(
                view.num_running, max(engine.rank_counts), engine.rank_sum, engine.context_tokens
            )
        else:
            engine.busy = False
            return
        engine.busy = True
        sequence += 1
        heapq.heappush(events, (now + duration, sequence, view.engine_id))

    def end_step(engine: _Engine, now: float) -> None:
        view = engine.view
        if engine.prefilling:
            for index in engine.prefilling:
                first_token[index] = now
                view.num_queued -= 1
                view.context_tokens += 1  # the first generated token joins the context
                if output[index] == 1:
                    finish_request(engine, index, now)
                    continue
                view.num_running += 1
                view.remaining_tokens += output[index] - 1
                engine.rank_counts[rank[index]] = engine.rank_counts.get(rank[index], 0) + 1
                engine.adapter_counts[adapter[index]] = engine.adapter_counts.get(adapter[index], 0) + 1
                engine.rank_sum += rank[index]
                engine.context_tokens += prompt[index] + 1
                heapq.heappush(engine.finishing, (engine.decode_steps + output[index] - 1, index))
            engine.prefilling = []
        else:
            engine.decode_steps += 1
            view.context_tokens += view.num_running
            view.remaining_tokens -= view.num_running
            engine.context_tokens += view.num_running
            while engine.finishing and engine.finishing[0][0] <= engine.decode_steps:
                _, index = heapq.heappop(engine.finishing)
                view.num_running -= 1
                left = engine.rank_counts[rank[index]] - 1
                if left:
                    engine.rank_counts[rank[index]] = left
                else:
                    del engine.rank_counts[rank[index]]
                left = engine.adapter_counts[adapter[index]] - 1
                if left:
                    engine.adapter_counts[adapter[index]] = left
                else:
                    del engine.adapter_counts[adapter[index]]
                engine.rank_sum -= rank[index]
                engine.context_tokens -= prompt[index] + output[index]
                finish_request(engine, index, now)
        start_step(engine, now)

    def drop_request(engine: _Engine, index: int, reason: str) -> None:
        dropped[index] = True
        drop_reasons[index] = reason
        view = engine.view
        view.num_queued -= 1
        view.free_kv_tokens += prompt[index] + output[index]
        view.remove(rank[index], prompt[index])

    def finish_request(engine: _Engine, index: int, now: float) -> None:
        finish[index] = now
        need = prompt[index] + output[index]
        engine.reserved -= need
        engine.view.free_kv_tokens += need
        engine.view.remove(rank[index], prompt[index] + output[index])

    next_arrival = 0
    while next_arrival < count or events:
        if next_arrival < count and (not events or arrival[next_arrival] <= events[0][0]):
            index = next_arrival
            next_arrival += 1
            now = float(arrival[index])
            chosen = policy.choose(RouteRequest(rank[index], prompt[index]), views)
            engine = engines[chosen]
            engine_of[index] = chosen
            view = engine.view
            view.num_queued += 1
            view.add(rank[index], prompt[index])
            view.free_kv_tokens -= prompt[index] + output[index]
            engine.queue.append(Queued(index, now, adapter[index], rank[index], prompt[index], output[index]))
            if not engine.busy:
                start_step(engine, now)
        else:
            now, _, engine_id = heapq.heappop(events)
            end_step(engines[engine_id], now)

    output_array = np.asarray(output, dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output_array > 1, (finish - first_token) / (output_array - 1), math.nan)
    return SimResult(
        policy=getattr(policy, "name", type(policy).__name__),
        arrival_s=arrival,
        engine=engine_of,
        output_tokens=output_array,
        ttft_s=first_token - arrival,
        tpot_s=tpot,
        latency_s=finish - arrival,
        slo_tpot_s=float(slo_tpot),
        slo_ttft_s=float(slo_ttft),
        decode_steps=sum(e.decode_steps for e in engines),
        prefill_steps=prefill_steps,
        admission=admission.name,
        tpot_held=len(held),
        dropped=dropped,
        drop_reasons=drop_reasons,
    )
