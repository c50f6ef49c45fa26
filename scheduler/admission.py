"""Which queued requests join an engine's next prefill step, and which are dropped.

`FCFS` admits in arrival order while they fit. `EarlyAbort` is S-LoRA's admission control (Appendix B):
before each prefill step it predicts, with the prefill model, every queued request's time to first token
if the step started now, drops those that cannot meet the TTFT objective any more (saying why), and
admits the rest first come first served: work on a request already lost only delays the ones that can
still be saved. `AdapterClustering` (S-LoRA A.2) caps the distinct adapters of a batch: once the running
batch holds `max_adapters`, queued requests for those adapters go first; the others fill what is left
(the simulator), or wait until they have waited `max_wait_s` (the engine: a hard cap without starvation).
Every policy also keeps the time-per-token objective (`decode_step_allows`): a request does not join a
non-empty running batch whose decode step, with it, the decode-step model predicts above the objective; it
waits, stopping the step there (head of line, like a request that does not fit). Pure functions of the
queue and the engine's room, used by the simulator and by the engine's scheduler (scheduler/batching.py,
whose steps chunk long prompts: `Room.chunked_prefill`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from lorad.scheduler.perf_model import DecodeStepModel, PrefillModel

from lorad.errors import BadRequest


@dataclass(frozen=True)
class Objectives:
    """Service-level objectives of one request: time to first token and time per output token (decode
    phase), in seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self):
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise BadRequest(f"objectives must be positive, not ttft_s={self.ttft_s} tpot_s={self.tpot_s}")


@dataclass(frozen=True)
class Queued:
    """A waiting request as admission sees it; `key` is the caller's handle."""

    key: int
    arrival_s: float
    adapter: str
    rank: int
    prompt_tokens: int
    output_tokens: int  # expected (max_tokens): the KV it reserves
    started: bool = False  # its first token is out already (a preempted request): no TTFT left to miss


@dataclass(frozen=True)
class RunningBatch:
    """The batch the next decode step runs, as the decode-step model reads it."""

    size: int = 0
    max_rank: int = 0
    rank_sum: int = 0
    context_tokens: int = 0

    def plus(self, rank: int, context_tokens: int) -> RunningBatch:
        return RunningBatch(self.size + 1, max(self.max_rank, rank), self.rank_sum + rank,
                            self.context_tokens + context_tokens)


def decode_step_allows(decode: DecodeStepModel | None, batch: RunningBatch, rank: int, context_tokens: int,
                       tpot_s: float) -> bool:
    """Whether a request of `rank` with `context_tokens` may join `batch` under the time-per-token
    objective: yes when the batch is empty (nothing starves), when there is no model or no objective
    (inf), else when the predicted decode step with it stays within tpot_s."""
    if batch.size == 0 or decode is None or not math.isfinite(tpot_s):
        return True
    with_it = batch.plus(rank, context_tokens)
    return decode.from_stats(with_it.size, with_it.max_rank, with_it.rank_sum, with_it.context_tokens) <= tpot_s


@dataclass(frozen=True)
class Room:
    """What the engine can take in its next prefill step."""

    slots: int  # requests that may still join the running batch
    prefill_tokens: int  # prompt tokens in one prefill step (a longer prompt goes alone)
    kv_tokens: int  # free KV tokens (a request reserves prompt + output)
    batch_empty: bool  # nothing runs: the first request goes in even when it exceeds kv_tokens
    running_adapters: frozenset = frozenset()  # adapters of the running batch
    # The engine's steps: a prompt longer than what is left of prefill_tokens takes what is left and goes on
    # in the next step, and KV is checked page by page by the caller (kv_tokens and output_tokens unused).
    chunked_prefill: bool = False
    # The time-per-token rule (decode_step_allows): the running batch, and the model of its decode step
    # (None: the rule is off).
    running: RunningBatch = RunningBatch()
    decode: DecodeStepModel | None = None


@dataclass(frozen=True)
class Admission:
    admit: tuple[int, ...]  # keys, in the order of the step
    drop: tuple[tuple[int, str], ...] = ()  # (key, reason)
    held: tuple[int, ...] = ()  # keys held back by the time-per-token rule (they wait; at most one a step)


class AdmissionPolicy(Protocol):
    name: str

    def select(self, queue: Sequence[Queued], now: float, room: Room, objectives: Objectives) -> Admission: ...


class _StepFiller:
    """Takes requests in the order given while they fit; the first that does not stops the step
    (head-of-line: a later, smaller request does not overtake it). A request fits when the step has room
    for it and the decode step with it keeps the time-per-token objective (`held` when only that fails)."""

    def __init__(self, room: Room, tpot_s: float = math.inf):
        self.slots, self.budget, self.kv = room.slots, room.prefill_tokens, room.kv_tokens
        self.empty = room.batch_empty
        self.chunked = room.chunked_prefill
        self.decode, self.batch, self.tpot_s = room.decode, room.running, tpot_s
        self.taken: list[Queued] = []
        self.held: list[int] = []
        self.full = room.slots <= 0 or (self.chunked and self.budget <= 0)

    def chunk(self, request: Queued) -> int:
        """The prompt tokens of `request` this step would compute."""
        return min(request.prompt_tokens, self.budget) if self.chunked else request.prompt_tokens

    def fits(self, request: Queued) -> bool:
        if self.full:
            return False
        if not decode_step_allows(self.decode, self.batch, request.rank, request.prompt_tokens + 1, self.tpot_s):
            self.full = True
            self.held.append(request.key)
            return False
        if self.chunked:
            return True
        need = request.prompt_tokens + request.output_tokens
        alone = self.empty and not self.taken
        if (need > self.kv and not alone) or (request.prompt_tokens > self.budget and self.taken):
            self.full = True
            return False
        return True

    def take(self, request: Queued) -> None:
        self.taken.append(request)
        self.slots -= 1
        self.budget -= self.chunk(request)
        self.kv -= request.prompt_tokens + request.output_tokens
        self.batch = self.batch.plus(request.rank, request.prompt_tokens + 1)  # its first token is decoded next
        if self.slots <= 0 or (self.chunked and self.budget <= 0):
            self.full = True


@dataclass(frozen=True)
class FCFS:
    name: str = "fcfs"

    def select(self, queue, now, room, objectives):
        filler = _fill_step(queue, room, objectives.tpot_s)
        return Admission(tuple(r.key for r in filler.taken), held=tuple(filler.held))


def _fill_step(queue: Iterable[Queued], room: Room, tpot_s: float = math.inf) -> _StepFiller:
    filler = _StepFiller(room, tpot_s)
    for request in queue:
        if not filler.fits(request):
            break
        filler.take(request)
    return filler


@dataclass(frozen=True)
class EarlyAbort:
    """S-LoRA's early abort with the prefill model as the estimate. For each queued request, in arrival
    order: if it fits in this step, its TTFT is (now - arrival) + the predicted prefill of the step with
    it and those admitted before it; past the step's room it is at least (now - arrival) + this step's
    prefill + its own prefill alone. A request whose estimate exceeds the objective is dropped. In chunked
    steps (the engine) a prompt cut by the step's budget adds the prefill of its rest alone; a request whose
    first token is out already is never dropped. Each estimate is a lower bound under the model: a drop
    is a request that cannot make it, not one that might not. A request held back by the time-per-token
    rule waits like one past the step's room: its estimate, and its drop, count that wait.

    `prefill` is the profile's PrefillModel or an `OnlinePrefill` (anything with `from_features`)."""

    prefill: PrefillModel | OnlinePrefill
    name: str = "early_abort"

    def select(self, queue, now, room, objectives):
        filler = _StepFiller(room, objectives.tpot_s)
        features = (0.0, 0.0, 0.0)  # of the step so far: tokens, rank x tokens, tokens squared
        step_s = 0.0
        drops: list[tuple[int, str]] = []
        limit = objectives.ttft_s
        for request in queue:
            if request.started:  # TTFT is behind it: it only waits for room
                if filler.fits(request):
                    filler.take(request)
                continue
            waited = now - request.arrival_s
            own = PrefillModel.features([(request.prompt_tokens, request.rank)])
            if not filler.full and filler.fits(request):
                chunk = filler.chunk(request)
                rest = request.prompt_tokens - chunk
                with_it = tuple(a + b for a, b in zip(features, PrefillModel.features([(chunk, request.rank)])))
                later = self.prefill.from_features(*PrefillModel.features([(rest, request.rank)])) if rest else 0.0
                estimate = waited + self.prefill.from_features(*with_it) + later
                if estimate <= limit:
                    filler.take(request)
                    features, step_s = with_it, self.prefill.from_features(*with_it)
                    continue
            else:
                estimate = waited + step_s + self.prefill.from_features(*own)
                if estimate <= limit:
                    continue  # waits for a later step
            why = f"early abort: estimated TTFT {estimate * 1e3:.1f} ms > objective {limit * 1e3:.1f} ms"
            drops.append((request.key, why))
        dropped = {key for key, _ in drops}
        held = tuple(key for key in filler.held if key not in dropped)
        return Admission(tuple(r.key for r in filler.taken), tuple(drops), held)


class OnlinePrefill:
    """A prefill estimate measured by the engine itself, for early abort without a profile: the cost per
    token of recent prefill steps, a moving average (weight `smoothing` on each new step). Until the
    first step is measured it predicts 0 s: early abort then drops only requests that already waited
    longer than the objective. Not thread-safe; the engine's step thread observes and predicts."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.per_token_s = 0.0
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        sample = seconds / tokens
        self.per_token_s = sample if self.steps == 0 else (1 - self.smoothing) * self.per_token_s + self.smoothing * sample
        self.steps += 1

    def from_features(self, tokens: float, rank_tokens: float, square_tokens: float) -> float:
        return self.per_token_s * tokens

    def describe(self) -> str:
        return f"online: {self.per_token_s * 1e3:.4f} ms per prompt token over {self.steps} measured prefill steps"


@dataclass(frozen=True)
class AdapterClustering:
    """S-LoRA's adapter clustering around an inner policy: once the running batch (plus what this step
    admits) holds `max_adapters` distinct adapters, queued requests for those adapters are offered first
    (in their order). Fewer adapters per batch pays where each one costs: BGMV padding to the batch's
    largest rank, adapter loads into the page pool. Looks `lookahead` requests deep into the queue (the
    rest keep their place). Requests without an adapter (None: the base model) always count as clustered.

    `max_wait_s` None: the cap is soft, the other requests are offered after the clustered ones and fill
    what they leave (the simulator). A number: the cap is hard, the others wait, except those queued
    longer than `max_wait_s`: they are offered first, whatever their adapter (no starvation; the only way
    the batch exceeds the cap)."""

    inner: AdmissionPolicy
    max_adapters: int
    lookahead: int = 256
    max_wait_s: float | None = None

    def __post_init__(self):
        if self.max_adapters < 1:
            raise BadRequest(f"max_adapters must be at least 1, not {self.max_adapters}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise BadRequest(f"max_wait_s must be positive, not {self.max_wait_s}")

    @property
    def name(self) -> str:
        return f"{self.inner.name}+cluster{self.max_adapters}"

    def select(self, queue, now, room, objectives):
        return self.inner.select(self.order(queue, room, now), now, room, objectives)

    def order(self, queue: Sequence[Queued], room: Room, now: float = math.inf) -> list[Queued]:
        window = list(islice(queue, self.lookahead))
        adapters = set(room.running_adapters)
        overdue, first, later = [], [], []
        for request in window:
            if self.max_wait_s is not None and now - request.arrival_s > self.max_wait_s:
                overdue.append(request)
            elif request.adapter is None or request.adapter in adapters:
                first.append(request)
            elif len(adapters) < self.max_adapters:
                adapters.add(request.adapter)
                first.append(request)
            else:
                later.append(request)
        if self.max_wait_s is not None:
            return overdue + first
        return first + later + list(islice(queue, self.lookahead, None))


def make_admission(name: str, prefill: PrefillModel | OnlinePrefill | None = None, max_adapters: int | None = None,
                   max_wait_s: float | None = None) -> AdmissionPolicy:
    """`fcfs` or `early-abort` (needs the prefill model), clustered when max_adapters is given (a hard cap
    when max_wait_s is given too); `cluster` is FCFS clustered and needs max_adapters."""
    key = name.replace("-", "_")
    if key in ("fcfs", "cluster"):
        if key == "cluster" and not max_adapters:
            raise BadRequest("cluster admission needs max_adapters (cluster_max_adapters) >= 1")
        policy: AdmissionPolicy = FCFS()
    elif key == "early_abort":
        if prefill is None:
            raise BadRequest("early abort needs a prefill model")
        policy = EarlyAbort(prefill)
    else:
        raise BadRequest(f"admission must be fcfs, early-abort or cluster, not {name!r}")
    return AdapterClustering(policy, max_adapters, max_wait_s=max_wait_s) if max_adapters else policy
