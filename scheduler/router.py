"""Which engine serves a new request: routing policies over small views of the engines.

`RankAware` is CaraServe's Algorithm 1: for each candidate engine it predicts, with the fitted
performance models, the extra prefill time (spread over an average response) and the extra decode time
per token that the request would cost the engine's requests, adds a penalty when the engine's decode step
would then break the time-per-token SLO, weighs by the number of requests paying it, and takes the
minimum. `MostIdle`, `FirstFit` (Punica) and `Random` are the baselines. Policies are pure functions of
the views (Random of its seed); no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from lorad.errors import Overloaded
from lorad.scheduler.perf_model import BgmvModel, DecodeStepModel, PrefillModel


@dataclass(frozen=True)
class RouteRequest:
    rank: int  # of its adapter (0: base model only)
    prompt_tokens: int


@dataclass
class EngineView:
    """What the router knows of one engine. "Requests" are running and queued ones together: the batch
    the new request would join (Algorithm 1's `exists`). Kept as aggregates so the simulator can update
    a view in O(1) per event; `EngineView.build` makes one from lists for tests and live engines."""

    engine_id: int
    max_running: int  # the engine's batch limit
    num_running: int = 0
    num_queued: int = 0
    rank_counts: dict[int, int] = field(default_factory=dict)  # rank -> requests of that rank
    rank_sum: int = 0
    max_rank: int = 0  # max(rank_counts), kept by add and remove
    context_tokens: int = 0  # KV positions the requests will hold at their next decode step
    remaining_tokens: int = 0  # output tokens the requests have still to generate, where known
    free_kv_tokens: int = 1 << 62
    has_base_model: bool = True
    tensor_parallel_size: int = 1  # the GPUs the engine spans: which performance models predict its steps

    @classmethod
    def build(
        cls,
        engine_id: int,
        max_running: int,
        running: Sequence[tuple[int, int, int]] = (),  # (rank, remaining output tokens, context tokens)
        queued: Sequence[tuple[int, int]] = (),  # (rank, prompt tokens)
        free_kv_tokens: int = 1 << 62,
        has_base_model: bool = True,
        tensor_parallel_size: int = 1,
    ) -> "EngineView":
        view = cls(engine_id, max_running, free_kv_tokens=free_kv_tokens, has_base_model=has_base_model,
                   tensor_parallel_size=tensor_parallel_size)
        for rank, remaining, context in running:
            view.add(rank, context)
            view.remaining_tokens += remaining
        view.num_running = len(running)
        for rank, prompt in queued:
            view.add(rank, prompt)
        view.num_queued = len(queued)
        return view

    def add(self, rank: int, context_tokens: int) -> None:
        self.rank_counts[rank] = self.rank_counts.get(rank, 0) + 1
        self.rank_sum += rank
        if rank > self.max_rank:
            self.max_rank = rank
        self.context_tokens += context_tokens

    def remove(self, rank: int, context_tokens: int) -> None:
        left = self.rank_counts[rank] - 1
        if left:
            self.rank_counts[rank] = left
        else:
            del self.rank_counts[rank]
            if rank == self.max_rank:
                self.max_rank = max(self.rank_counts, default=0)
        self.rank_sum -= rank
        self.context_tokens -= context_tokens

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_queued


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, engines: Sequence[EngineView]) -> int: ...  # an engine_id


def candidates(request: RouteRequest, engines: Sequence[EngineView]) -> list[EngineView]:
    """Engines with the base model and room for the prompt's KV; when none has room, every engine with
    the base model (the request then waits in a queue rather than being refused)."""
    serving = [e for e in engines if e.has_base_model]
    if not serving:
        raise Overloaded("no engine has the base model loaded")
    roomy = [e for e in serving if e.free_kv_tokens >= request.prompt_tokens]
    return roomy or serving


@dataclass
class RankAware:
    """CaraServe Algorithm 1. total_cost = cost * (running + queued), where
    cost = delta_prefill / avg_response_tokens + delta_decode (+ penalty_s if the decode step with the
    request exceeds slo_tpot_s). The weight makes an idle engine free (it has nobody to slow down).

    delta_prefill = PrePerf(queue + request) - PrePerf(queue): joining a queued prefill adds only the
    marginal part, the prefill model's fixed part (a read of the weights) being paid already. With
    `mixed_steps` (engines that put prefill chunks into their decode steps, as lorad's do) a running batch
    pays it too: the request's prompt rides on a step that reads the weights anyway, so on any busy engine
    only the marginal part counts. Without it (engines that prefill in steps of their own, as the
    simulator models, and as LightLLM did for CaraServe) an engine with no queue pays the whole prefill,
    and the cost favours engines with a queue, whose prefill step would cost its decodes a step anyway.

    An engine spanning N GPUs (tensor parallelism) is one engine whose steps cost what a profile measured at
    that size says: `by_tensor_parallel_size` holds those models, by N; an engine of a size not there is
    predicted with `decode` and `prefill`."""

    decode: DecodeStepModel
    prefill: PrefillModel
    slo_tpot_s: float
    avg_response_tokens: float
    penalty_s: float = 1.0
    mixed_steps: bool = False
    name: str = "rank_aware"
    by_tensor_parallel_size: dict[int, tuple[DecodeStepModel, PrefillModel]] = field(default_factory=dict)

    def models(self, engine: EngineView) -> tuple[DecodeStepModel, PrefillModel]:
        """The decode-step and prefill models of this engine's steps."""
        return self.by_tensor_parallel_size.get(engine.tensor_parallel_size, (self.decode, self.prefill))

    def _prefill_already_paid(self, engine: EngineView) -> bool:
        """Is the prefill's fixed part paid already on this engine (see the class's text)?"""
        return bool(engine.num_queued or (self.mixed_steps and engine.num_running))

    def cost(self, request: RouteRequest, engine: EngineView) -> float:
        decode, prefill = self.models(engine)
        if self._prefill_already_paid(engine):
            delta_prefill = prefill.from_features(
                request.prompt_tokens, request.rank * request.prompt_tokens, request.prompt_tokens**2
            ) - prefill.fixed_s
        else:
            delta_prefill = prefill.predict([(request.prompt_tokens, request.rank)])
        count, max_rank = engine.num_requests, engine.max_rank
        before = decode.from_stats(count, max_rank, engine.rank_sum, engine.context_tokens)
        after = decode.from_stats(
            count + 1, max(max_rank, request.rank), engine.rank_sum + request.rank,
            engine.context_tokens + request.prompt_tokens,
        )
        cost = delta_prefill / self.avg_response_tokens + (after - before)
        if after > self.slo_tpot_s:
            cost += self.penalty_s
        return cost

    def _terms(self, engine: EngineView, request: RouteRequest) -> tuple:
        """What `choose` needs of an engine's models for this request, the same for every engine of its size."""
        decode, prefill = self.models(engine)
        prefill_alone = prefill.predict([(request.prompt_tokens, request.rank)]) / self.avg_response_tokens
        return (decode, decode.lora, isinstance(decode.lora, BgmvModel), prefill_alone,
                prefill_alone - prefill.fixed_s / self.avg_response_tokens,
                decode.per_request_s + decode.per_context_token_s * request.prompt_tokens)

    def choose(self, request, engines):
        """argmin over candidates of cost * requests: `cost` inlined, since the simulator calls this for
        every arrival on every engine (tests check the two agree)."""
        rank = request.rank
        terms: dict[int, tuple] = {}  # tensor_parallel_size -> _terms
        best, best_cost = None, float("inf")
        for engine in candidates(request, engines):
            size = engine.tensor_parallel_size
            if size not in terms:
                terms[size] = self._terms(engine, request)
            decode, lora, padded, prefill_alone, prefill_joining, added_base = terms[size]
            count = engine.num_running + engine.num_queued
            max_rank = engine.max_rank
            if count == 0:
                before = 0.0
                after = decode.fixed_s + added_base + lora.alpha * rank + lora.beta
            else:
                before = (
                    decode.fixed_s + decode.per_request_s * count + decode.per_context_token_s * engine.context_tokens
                    + lora.alpha * (count * max_rank if padded else engine.rank_sum) + lora.beta
                )
                grown = (count + 1) * (rank if rank > max_rank else max_rank) - count * max_rank if padded else rank
                after = before + added_base + lora.alpha * grown
            joins = engine.num_queued or (self.mixed_steps and engine.num_running)
            cost = (prefill_joining if joins else prefill_alone) + (after - before)
            if after > self.slo_tpot_s:
                cost += self.penalty_s
            total = cost * count
            if total < best_cost:
                best, best_cost = engine, total
        return best.engine_id


@dataclass
class MostIdle:
    """The engine with the fewest requests (running + queued); ties: the least output left to generate."""

    name: str = "most_idle"

    def choose(self, request, engines):
        return min(candidates(request, engines), key=lambda e: (e.num_requests, e.remaining_tokens)).engine_id


@dataclass
class FirstFit:
    """Punica: the first engine (in id order) whose batch is below its limit; when all are full, the
    most idle one."""

    name: str = "first_fit"

    def choose(self, request, engines):
        pool = candidates(request, engines)
        for engine in pool:
            if engine.num_requests < engine.max_running:
                return engine.engine_id
        return MostIdle().choose(request, pool)


@dataclass
class Random:
    """A uniformly random candidate, from its own seeded generator."""

    seed: int = 0
    name: str = "random"
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def choose(self, request, engines):
        pool = candidates(request, engines)
        return pool[int(self.rng.integers(len(pool)))].engine_id
