"""Iteration-level continuous batching: which sequences run in the next step, and how many of their
tokens.

Every step, running sequences go first (decodes take one token, unfinished prompts take the next chunk), then
waiting ones join while the token budget, the running-request cap, KV pages and adapter residency allow, in the
order the admission policy (admission.py) gives: arrival order (FCFS), with early abort's drops taken out
(`take_dropped`), or clustered by adapter. A sequence whose adapter is being staged in the background
(`Adapters.staging`) keeps its place but is passed over, up to PASS_STAGING of them a step, for those behind it
whose adapters are ready: waiting for it would leave running slots empty for the ~100-250 ms a cold adapter
takes to stage. With a decode-step model and a time-per-token objective, a waiting sequence does not join a
non-empty running batch whose next decode step, with it, would break the objective
(admission.decode_step_allows); it waits at the head of the queue. With a headroom, a waiting sequence joins only
while the KV left would hold the rest of its prompt and `headroom` positions more for each running sequence and it;
with a growth reserve (`GrowthReserve`), the tokens the running ones and it are expected to generate, so that a
batch does not outgrow the cache. When KV runs out all the same, the newest
running sequence is preempted: its pages go back (those it shares with the other choices of its request stay
theirs) and it is recomputed later (prompt plus what it generated so far). The scheduler owns no memory:
`memory` and `adapters` do, behind the two small protocols below.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorad.scheduler.admission import (
    FCFS,
    AdmissionPolicy,
    Objectives,
    Queued,
    Room,
    RunningBatch,
    decode_step_allows,
)
from lorad.scheduler.perf_model import DecodeStepModel

log = logging.getLogger(__name__)


class Memory(Protocol):
    def grow(self, blocks: list, num_tokens: int) -> bool: ...  # make room for num_tokens positions
    def release(self, blocks: list) -> None: ...


class Reservable(Protocol):  # a Memory that says how much it can still give (for the growth reserve)
    def free_tokens(self) -> int: ...  # positions its free blocks hold
    def reclaimable_tokens(self) -> int: ...  # the same once what may be evicted for KV is (>= free_tokens)
    def missing_tokens(self, blocks: list, num_tokens: int) -> int: ...  # positions of the blocks `grow` would add


class Adapters(Protocol):
    # Resident and pinned, or False (not now); `tokens`: those of the sequence's first step, for how a
    # cold adapter is placed.
    def acquire(self, name: str | None, tokens: int | None = None) -> bool: ...
    def release(self, name: str | None) -> None: ...
    # Was the last acquire(name) refused only because the adapter is being staged in the background (it will be
    # ready by itself)? Such a waiting sequence is passed over for those behind it (Scheduler).
    def staging(self, name: str | None) -> bool: ...


PASS_STAGING = 8  # waiting sequences an admission passes over while their adapters are staged

# The running cap by default: one running request for each RUNNING_PER_KV_TOKENS positions the KV cache holds, in
# multiples of 8, within RUNNING_RANGE. A fixed cap either leaves a large cache idle or runs a small one into
# preemptions; tied to the capacity, a request of a chat trace's size (the Azure conversations: ~1,000 prompt
# tokens, ~250 generated) finds its KV at admission. On the H100 with the 7B shape (104,584 positions in bf16) it
# is 96: served saturated beside 64 (7f7418f), the same output tok/s within one build's spread, though the full cache
# then preempts and takes idle adapters' pages (BENCHMARKS.md, figure 21.1);
# served over rate sweeps, goodput 12 req/s where 64 gave 11, 13 with every point warm (figure 21.3).
RUNNING_PER_KV_TOKENS = 1024
RUNNING_RANGE = (64, 256)


def default_max_running(kv_tokens: int) -> int:
    """The running cap for a KV cache of `kv_tokens` positions, where none is given."""
    low, high = RUNNING_RANGE
    return max(low, min(high, kv_tokens // RUNNING_PER_KV_TOKENS // 8 * 8))


# Why the last step's admission stopped (`Scheduler.stopped`): what keeps any running slot it leaves empty.
NO_REQUEST_WAITING = "no_request_waiting"  # the queue was empty
RUNNING_FULL = "running_full"  # every running slot was taken
TOKEN_BUDGET = "token_budget"  # the step's tokens were spent (a long prompt's chunk)
ADAPTER_STAGING = "adapter_staging"  # the next ones wait for their adapters' staging (passed over as far as allowed)
KV_OR_ADAPTER_PAGES = "kv_or_adapter_pages"  # the next one's KV or adapter did not fit in the page pool now
TIME_PER_TOKEN = "time_per_token"  # held back by the time-per-token objective
ADMISSION_POLICY = "admission_policy"  # a policy other than FCFS chose to admit no more
ADMISSION_STOPS = (NO_REQUEST_WAITING, RUNNING_FULL, TOKEN_BUDGET, ADAPTER_STAGING, KV_OR_ADAPTER_PAGES, TIME_PER_TOKEN,
                   ADMISSION_POLICY)


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    adapter: str | None
    num_computed: int = 0  # positions whose K and V are in the cache
    blocks: list = field(default_factory=list)  # KV blocks, owned through Memory
    preemptions: int = 0
    state: Any = None  # the engine's per-request state
    rank: int = 0  # its adapter's rank (0: the base model), for the admission policy's prefill estimate
    arrival_s: float | None = None  # when it was submitted, on the scheduler's clock; None: when added
    queued: Queued | None = None  # how the admission policy sees it while it waits
    held_for_tpot: bool = False  # the time-per-token rule has held it back at least once
    max_new_tokens: int | None = None  # the most tokens it may generate (None: unknown, nothing reserved for them)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class GrowthReserve:
    """The KV positions held back at admission for the tokens running sequences have yet to generate.

    Admitting by a prompt's KV alone (as vLLM does) lets a batch outgrow the cache as its sequences generate:
    the newest are then preempted and their prompts computed again (the saturated Azure-conv run at 96 and 128
    running preempted 57 and 71 times, BENCHMARKS.md). Reserving each sequence's whole `max_new_tokens` instead
    starves the batch when clients ask for far more than they use (a max_tokens of thousands for answers of
    hundreds). So each sequence reserves `ratio` of what it may still generate, where ratio is the QUANTILE of the
    share of their `max_new_tokens` that the last WINDOW sequences to end by a stop or their length generated
    (1.0 until one has). SGLang's scheduler keeps such a ratio too (its new-token ratio, decayed over time and
    raised on retraction); this one follows what requests have used."""

    WINDOW = 256
    QUANTILE = 0.9

    def __init__(self):
        self.used: deque[float] = deque(maxlen=self.WINDOW)
        self.ratio = 1.0

    def ended(self, seq: Sequence) -> None:
        """A sequence ended by a stop or its length: the share of its max_new_tokens it generated counts."""
        if seq.max_new_tokens:
            self.used.append(min(1.0, seq.num_generated / seq.max_new_tokens))
            ordered = sorted(self.used)
            self.ratio = ordered[min(len(ordered) - 1, math.ceil(self.QUANTILE * len(ordered)) - 1)]

    def tokens(self, seq: Sequence) -> int:
        """The positions held back for what `seq` may still generate."""
        if seq.max_new_tokens is None:
            return 0
        return math.ceil(self.ratio * max(0, seq.max_new_tokens - seq.num_generated))


class Scheduler:
    """`admission` picks the order in which waiting sequences join and which are dropped, judged by
    `objectives` on `clock` (seconds; the engine's time.perf_counter, or a test's simulated time).
    `decode` (the profile's decode-step model) turns on the time-per-token rule for `objectives.tpot_s`;
    `reserve` (a GrowthReserve, with a `memory` that is also Reservable) holds KV back for the running sequences'
    next tokens at admission."""

    def __init__(self, max_running: int, max_batch_tokens: int, memory: Memory, adapters: Adapters,
                 admission: AdmissionPolicy | None = None, objectives: Objectives | None = None,
                 clock=time.perf_counter, decode: DecodeStepModel | None = None, reserve: GrowthReserve | None = None,
                 pass_staging: int = PASS_STAGING, headroom: int = 0):
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.memory = memory
        self.adapters = adapters
        self.admission = admission or FCFS()
        self.objectives = objectives or Objectives(math.inf, math.inf)  # none
        self.clock = clock
        tpot_rule = decode is not None and math.isfinite(self.objectives.tpot_s)
        self.decode = decode if tpot_rule else None
        self.tpot_held = 0  # sequences the time-per-token rule held back (each counted once)
        self.preemptions = 0  # running sequences preempted for KV (each time; their tokens are recomputed)
        self.reserve = reserve
        self.headroom = headroom  # KV positions an admission leaves free for each running sequence (0: none)
        self.pass_staging = pass_staging  # how many waiting sequences whose adapters are being staged may be passed over
        self.past_staging = 0  # sequences admitted past one whose adapter was being staged, for /v1/status
        self._held: int | None = None  # KV positions the running sequences' reserves hold (None: to be summed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.dropped: list[tuple[Sequence, str]] = []  # by the admission policy, for the engine to fail
        self.blocked: Sequence | None = None  # the waiting sequence the last step's admission stopped at
        self.stopped = NO_REQUEST_WAITING  # why the last step's admission stopped, one of ADMISSION_STOPS
        self._keys = itertools.count()
        self._by_key: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        if seq.arrival_s is None:
            seq.arrival_s = self.clock()
        self.waiting.append(seq)

    def take_dropped(self) -> list[tuple[Sequence, str]]:
        """The sequences the admission policy dropped since the last call, with why; they hold nothing."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, ahead: frozenset | set = frozenset(), ending: frozenset | set = frozenset()) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, number of its tokens to compute) pairs, running ones first.

        Planned while a step is still in flight (the engine launches the next before reading its tokens): each
        running sequence of `ahead` has one token more than its `tokens`, the one in flight; those of `ending`
        end on theirs, so they are left out and their slots count as free."""
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        self.blocked = None
        self._held = None
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq in ending:  # preempted below to make room for an older one; ends
                continue
            count = min(seq.num_tokens + (seq in ahead) - seq.num_computed, budget)
            while not self.memory.grow(seq.blocks, seq.num_computed + count):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.append((seq, count))
                budget -= count
        if type(self.admission) is FCFS:  # what FCFS.select would give, without building its view of the queue
            batch = self._running_batch() if self.decode is not None else RunningBatch()
            passed: list[Sequence] = []  # waiting for their adapters' staging: back at the front, in order, below
            try:
                while True:
                    if not self.waiting:
                        self.stopped = ADAPTER_STAGING if passed else NO_REQUEST_WAITING
                        break
                    if budget <= 0:
                        self.stopped = TOKEN_BUDGET
                        break
                    if len(self.running) - len(ending) >= self.max_running:
                        self.stopped = RUNNING_FULL
                        break
                    head = self.waiting[0]
                    context = head.num_tokens - head.num_computed + 1
                    if not decode_step_allows(self.decode, batch, head.rank, context, self.objectives.tpot_s):
                        self._hold_for_tpot(head)
                        self.stopped = TIME_PER_TOKEN
                        break
                    if not self._admit(head, budget, plan):
                        if len(passed) < self.pass_staging and self.adapters.staging(head.adapter):
                            passed.append(self.waiting.popleft())
                            continue
                        self.stopped = ADAPTER_STAGING if self.adapters.staging(head.adapter) else KV_OR_ADAPTER_PAGES
                        break
                    self.waiting.popleft()
                    self.past_staging += bool(passed)
                    budget -= plan[-1][1]
                    batch = batch.plus(head.rank, context)
            finally:  # also when an adapter raises at its admission: the passed-over ones keep their places
                self.waiting.extendleft(reversed(passed))
        elif self.waiting:
            self._admit_by_policy(budget, plan, len(ending))
        else:
            self.stopped = NO_REQUEST_WAITING
        return plan

    def _admit(self, seq: Sequence, budget: int, plan: list) -> bool:
        """Moves a waiting sequence into the running batch when its adapter and KV are to be had; else
        (or when acquiring its adapter raises) it is `blocked`. The KV is asked about before the adapter too: one
        whose KV would not fit is not placed (a placed adapter left idle is the first thing the running sequences'
        growth evicts, and the next step would place it again)."""
        self.blocked = seq
        count = min(seq.num_tokens - seq.num_computed, budget)
        if not self._kv_allows(seq):
            return False
        if not self.adapters.acquire(seq.adapter, count):
            return False
        if not self._kv_allows(seq) or not self.memory.grow(seq.blocks, seq.num_computed + count):
            self.adapters.release(seq.adapter)  # (a forked sequence waits with its blocks)
            return False
        self._held = None
        self.blocked = None
        self.running.append(seq)
        plan.append((seq, count))
        return True

    def _kv_allows(self, seq: Sequence) -> bool:
        """Without a growth reserve or a headroom, or with nothing running (the first sequence goes in as it would
        alone): yes. Else: do the KV positions left hold the blocks `seq` needs for the rest of its prompt, and

        - with a growth reserve: the running sequences' reserves and its own;
        - with a headroom: `headroom` positions more for each running sequence and it?

        The headroom keeps an admission from filling the cache to its last block: a full cache preempts its newest
        sequence as soon as the running ones grow, and a preempted sequence rejoins as soon as its prompt fits
        again, to be preempted again a few steps later, its prompt computed each time. Idle adapters' pages count
        only when the free ones fall short."""
        if (self.reserve is None and not self.headroom) or not self.running:
            return True
        if self.reserve is None:
            need = self.memory.missing_tokens(seq.blocks, seq.num_tokens)
        else:
            def end(s: Sequence) -> int:  # the positions it is expected to reach
                return s.num_tokens + self.reserve.tokens(s)

            if self._held is None:
                self._held = sum(self.memory.missing_tokens(s.blocks, end(s)) for s in self.running)
            need = self._held + self.memory.missing_tokens(seq.blocks, end(seq))
        need += self.headroom * (len(self.running) + 1)
        return need <= self.memory.free_tokens() or need <= self.memory.reclaimable_tokens()

    def _admit_by_policy(self, budget: int, plan: list, ending: int = 0) -> None:
        room = Room(
            slots=self.max_running - len(self.running) + ending, prefill_tokens=budget, kv_tokens=0,
            batch_empty=not self.running, chunked_prefill=True,
            running_adapters=frozenset(seq.adapter for seq in self.running if seq.adapter is not None),
            running=self._running_batch() if self.decode is not None else RunningBatch(), decode=self.decode,
        )
        decision = self.admission.select([self._queue_entry(seq) for seq in self.waiting], self.clock(), room, self.objectives)
        gone = set()
        for key, reason in decision.drop:
            seq = self._by_key.pop(key)
            self.memory.release(seq.blocks)
            self.dropped.append((seq, reason))
            gone.add(seq)
        for key in decision.held:
            self._hold_for_tpot(self._by_key[key])
        passed = 0  # sequences passed over while their adapters are staged
        self.stopped = TIME_PER_TOKEN if decision.held else ADMISSION_POLICY  # unless one of the below stops it first
        try:
            for key in decision.admit:  # in the policy's order, until one does not get its adapter or KV
                seq = self._by_key[key]
                if budget <= 0 or len(self.running) - ending >= self.max_running:
                    self.stopped = TOKEN_BUDGET if budget <= 0 else RUNNING_FULL
                    break
                if not self._admit(seq, budget, plan):
                    if passed < self.pass_staging and self.adapters.staging(seq.adapter):
                        passed += 1
                        continue
                    self.stopped = ADAPTER_STAGING if self.adapters.staging(seq.adapter) else KV_OR_ADAPTER_PAGES
                    break
                self.past_staging += passed > 0
                del self._by_key[key]
                seq.queued = None
                budget -= plan[-1][1]
                gone.add(seq)
        finally:  # also when an adapter raises at its admission: those admitted before it leave the queue
            if gone:
                self.waiting = deque(seq for seq in self.waiting if seq not in gone)
        if not self.waiting:
            self.stopped = NO_REQUEST_WAITING

    def _running_batch(self) -> RunningBatch:
        """The running batch as the decode-step model reads it (context: every position of each sequence)."""
        ranks = [seq.rank for seq in self.running]
        return RunningBatch(len(ranks), max(ranks, default=0), sum(ranks), sum(seq.num_tokens for seq in self.running))

    def _hold_for_tpot(self, seq: Sequence) -> None:
        if not seq.held_for_tpot:
            seq.held_for_tpot = True
            self.tpot_held += 1
            log.debug("held for the time-per-token objective request=%s rank=%d running=%d",
                      seq.request_id, seq.rank, len(self.running))

    def _queue_entry(self, seq: Sequence) -> Queued:
        """The policy's view of a waiting sequence, built once per stay in the queue."""
        if seq.queued is None:
            key = next(self._keys)
            self._by_key[key] = seq
            seq.queued = Queued(key, seq.arrival_s, seq.adapter, seq.rank, seq.num_tokens - seq.num_computed, 0,
                                started=seq.num_generated > 0)
        return seq.queued

    def adopt(self, seqs: list[Sequence]) -> None:
        """Sequences forked from a running one (the other choices of its request, their prompt's blocks shared
        with it): they run from the next step while the batch has room, the rest wait at the head of the queue,
        in order, keeping their blocks. They are part of a request already admitted: no admission policy or
        time-per-token rule is asked."""
        waiting = []
        for seq in seqs:
            if len(self.running) < self.max_running and self.adapters.acquire(seq.adapter):
                self.running.append(seq)
            else:
                waiting.append(seq)
        self.waiting.extendleft(reversed(waiting))

    def preempt(self, seq: Sequence) -> None:
        log.info("preempt request=%s tokens=%d", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self.memory.release(seq.blocks)
        self.adapters.release(seq.adapter)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        seq.queued = None  # it has more tokens to compute now
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, completed: bool = False) -> None:
        """Takes a sequence out (finished or aborted), returning what it holds. completed: it ended by a stop or
        its length (what it generated informs the growth reserve)."""
        if completed and self.reserve is not None:
            self.reserve.ended(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.memory.release(seq.blocks)
            self.adapters.release(seq.adapter)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.memory.release(seq.blocks)
        if seq.queued is not None:
            self._by_key.pop(seq.queued.key, None)
            seq.queued = None
