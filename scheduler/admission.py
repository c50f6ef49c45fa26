"""Which queued requests join an engine's next prefill step, and which are dropped.

`FCFS` admits in arrival order while they fit. `EarlyAbort` is S-LoRA's admission control (Appendix B):
before each prefill step it predicts, with the prefill model, every queued request's time to first token
if the step started now, drops those that cannot meet the TTFT objective any more (saying why), and
admits the rest first come first served: work on a request already lost only delays the ones that can
still be saved. `AdapterClustering` (S-LoRA A.2) caps the distinct adapters of a batch: once the running
batch holds `max_adapters`, queued requests for those adapters go first, the others fill what is left.
Pure functions of the queue and the engine's room: the simulator uses them now, the engine later.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Iterable, Protocol, Sequence

from lorad.errors import BadRequest
from lorad.scheduler.perf_model import PrefillModel


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


@dataclass(frozen=True)
class Room:
    """What the engine can take in its next prefill step."""

    slots: int  # requests that may still join the running batch
    prefill_tokens: int  # prompt tokens in one prefill step (a longer prompt goes alone)
    kv_tokens: int  # free KV tokens (a request reserves prompt + output)
    batch_empty: bool  # nothing runs: the first request goes in even when it exceeds kv_tokens
    running_adapters: frozenset = frozenset()  # adapters of the running batch


@dataclass(frozen=True)
class Admission:
    admit: tuple[int, ...]  # keys, in the order of the step
    drop: tuple[tuple[int, str], ...] = ()  # (key, reason)


class AdmissionPolicy(Protocol):
    name: str

    def select(self, queue: Sequence[Queued], now: float, room: Room, objectives: Objectives) -> Admission: ...


class _Filler:
    """Takes requests in the order given while they fit; the first that does not stops the step
    (head-of-line: a later, smaller request does not overtake it)."""

    def __init__(self, room: Room):
        self.slots, self.budget, self.kv = room.slots, room.prefill_tokens, room.kv_tokens
        self.empty = room.batch_empty
        self.taken: list[Queued] = []
        self.full = room.slots <= 0

    def fits(self, request: Queued) -> bool:
        if self.full:
            return False
        need = request.prompt_tokens + request.output_tokens
        alone = self.empty and not self.taken
        if (need > self.kv and not alone) or (request.prompt_tokens > self.budget and self.taken):
            self.full = True
            return False
        return True

    def take(self, request: Queued) -> None:
        self.taken.append(request)
        self.slots -= 1
        self.budget -= request.prompt_tokens
        self.kv -= request.prompt_tokens + request.output_tokens
        if self.slots <= 0:
            self.full = True


@dataclass(frozen=True)
class FCFS:
    name: str = "fcfs"

    def select(self, queue, now, room, objectives):
        return Admission(tuple(r.key for r in _fill(queue, room)))


def _fill(queue: Iterable[Queued], room: Room) -> list[Queued]:
    filler = _Filler(room)
    for request in queue:
        if not filler.fits(request):
            break
        filler.take(request)
    return filler.taken


@dataclass(frozen=True)
class EarlyAbort:
    """S-LoRA's early abort with the prefill model as the estimate. For each queued request, in arrival
    order: if it fits in this step, its TTFT is (now - arrival) + the predicted prefill of the step with
    it and those admitted before it; past the step's room it is at least (now - arrival) + this step's
    prefill + its own prefill alone. A request whose estimate exceeds the objective is dropped."""

    prefill: PrefillModel
    name: str = "early_abort"

    def select(self, queue, now, room, objectives):
        filler = _Filler(room)
        features = (0.0, 0.0, 0.0)  # of the step so far: tokens, rank x tokens, tokens squared
        step_s = 0.0
        drops: list[tuple[int, str]] = []
        limit = objectives.ttft_s
        for request in queue:
            waited = now - request.arrival_s
            own = PrefillModel.features([(request.prompt_tokens, request.rank)])
            if not filler.full and filler.fits(request):
                with_it = tuple(a + b for a, b in zip(features, own))
                estimate = waited + self.prefill.from_features(*with_it)
                if estimate <= limit:
                    filler.take(request)
                    features, step_s = with_it, self.prefill.from_features(*with_it)
                    continue
            else:
                estimate = waited + step_s + self.prefill.from_features(*own)
                if estimate <= limit:
                    continue  # waits for a later step
            drops.append((request.key, f"early abort: estimated TTFT {estimate:.3f} s > objective {limit:.3f} s"))
        return Admission(tuple(r.key for r in filler.taken), tuple(drops))


@dataclass(frozen=True)
class AdapterClustering:
    """S-LoRA's adapter clustering around an inner policy: once the running batch (plus what this step
    admits) holds `max_adapters` distinct adapters, queued requests for those adapters are offered first
    (in their order), the rest after them, so they still fill what the clustered ones leave. Fewer
    adapters per batch pays where each one costs: BGMV padding to the batch's largest rank, adapter
    loads into the page pool. Looks `lookahead` requests deep into the queue (the rest keep their place)."""

    inner: AdmissionPolicy
    max_adapters: int
    lookahead: int = 256

    def __post_init__(self):
        if self.max_adapters < 1:
            raise BadRequest(f"max_adapters must be at least 1, not {self.max_adapters}")

    @property
    def name(self) -> str:
        return f"{self.inner.name}+cluster{self.max_adapters}"

    def select(self, queue, now, room, objectives):
        return self.inner.select(self.order(queue, room), now, room, objectives)

    def order(self, queue: Sequence[Queued], room: Room) -> list[Queued]:
        window = list(islice(queue, self.lookahead))
        adapters = set(room.running_adapters)
        first, later = [], []
        for request in window:
            if request.adapter in adapters:
                first.append(request)
            elif len(adapters) < self.max_adapters:
                adapters.add(request.adapter)
                first.append(request)
            else:
                later.append(request)
        return first + later + list(islice(queue, self.lookahead, None))


def make_admission(name: str, prefill: PrefillModel | None = None, max_adapters: int | None = None) -> AdmissionPolicy:
    """`fcfs` or `early-abort` (needs the prefill model), clustered when max_adapters is given."""
    key = name.replace("-", "_")
    if key == "fcfs":
        policy: AdmissionPolicy = FCFS()
    elif key == "early_abort":
        if prefill is None:
            raise BadRequest("early abort needs a prefill model")
        policy = EarlyAbort(prefill)
    else:
        raise BadRequest(f"admission must be fcfs or early-abort, not {name!r}")
    return AdapterClustering(policy, max_adapters) if max_adapters else policy
