"""scheduler/batching.py with fake memory and adapters: FCFS admission, the token budget and chunked
prefill, the running cap, preemption of the newest when memory runs out, adapter-blocked admission,
and that finish() gives back what a sequence holds exactly once."""

from __future__ import annotations

import random

import pytest

from lorad.scheduler import batching
from lorad.scheduler.batching import PASS_STAGING, GrowthReserve, Scheduler, Sequence

TOKENS_PER_BLOCK = 4


class FakeMemory:
    """Blocks of TOKENS_PER_BLOCK positions out of `capacity` blocks; records every block it hands out."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.next_id = 0
        self.out: set[int] = set()
        self.released: list[int] = []

    @property
    def free(self) -> int:
        return self.capacity - len(self.out)

    def grow(self, blocks: list, num_tokens: int) -> bool:
        missing = -(-num_tokens // TOKENS_PER_BLOCK) - len(blocks)
        if missing <= 0:
            return True
        if missing > self.free:
            return False
        for _ in range(missing):
            self.out.add(self.next_id)
            blocks.append(self.next_id)
            self.next_id += 1
        return True

    def release(self, blocks: list) -> None:
        for block in blocks:
            assert block in self.out, f"block {block} released twice"
            self.out.remove(block)
            self.released.append(block)
        blocks.clear()


class FakeAdapters:
    """`unavailable` adapters are refused; those also in `staged` are being staged (they will be ready by themselves)."""

    def __init__(self, unavailable: set[str] = frozenset(), staged: set[str] = frozenset()):
        self.unavailable = set(unavailable)
        self.staged = set(staged)
        self.pins: dict[str | None, int] = {}
        self.calls: list[tuple[str, str | None]] = []

    def acquire(self, name, tokens=None):
        self.calls.append(("acquire", name))
        if name in self.unavailable:
            return False
        self.pins[name] = self.pins.get(name, 0) + 1
        return True

    def release(self, name):
        self.calls.append(("release", name))
        assert self.pins.get(name, 0) > 0, f"adapter {name} released more often than acquired"
        self.pins[name] -= 1

    def held(self) -> int:
        return sum(self.pins.values())

    def staging(self, name) -> bool:
        return name in self.unavailable and name in self.staged


def seq(name: str, prompt_len: int, adapter: str | None = None) -> Sequence:
    return Sequence(name, list(range(prompt_len)), prompt_len, adapter)


def run_step(scheduler: Scheduler, plan) -> None:
    """What the engine does after a forward: advance num_computed, append a token to finished prefills."""
    for s, count in plan:
        s.num_computed += count
        assert s.num_computed <= s.num_tokens
        if s.num_computed == s.num_tokens:
            s.tokens.append(7)


def names(plan) -> list[tuple[str, int]]:
    return [(s.request_id, count) for s, count in plan]


def test_fcfs_admission_and_decode_before_prefill():
    memory, adapters = FakeMemory(100), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=64, memory=memory, adapters=adapters)
    a, b = seq("a", 10), seq("b", 6)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 10), ("b", 6)]
    run_step(scheduler, plan)
    c = seq("c", 20)
    scheduler.add(c)
    plan = scheduler.schedule()
    # the running ones decode first (one token each), then the new prompt
    assert names(plan) == [("a", 1), ("b", 1), ("c", 20)]
    assert scheduler.running == [a, b, c] and not scheduler.waiting


def test_token_budget_and_chunked_prefill():
    memory, adapters = FakeMemory(100), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=16, memory=memory, adapters=adapters)
    a, b, c = seq("a", 40), seq("b", 5), seq("c", 3)
    for s in (a, b, c):
        scheduler.add(s)
    steps = []
    for _ in range(4):
        plan = scheduler.schedule()
        assert sum(count for _, count in plan) <= 16
        steps.append(names(plan))
        run_step(scheduler, plan)
    assert steps[0] == [("a", 16)]  # b waits behind a (FCFS) while the budget is spent
    assert steps[1] == [("a", 16)]
    assert steps[2] == [("a", 8), ("b", 5), ("c", 3)]  # the last chunk of a, then the others join
    assert steps[3] == [("a", 1), ("b", 1), ("c", 1)]
    assert a.num_tokens == 42 and a.num_computed == 41 and len(a.blocks) == -(-41 // TOKENS_PER_BLOCK)
    # every chunk of a sat on top of what was computed before: the blocks cover num_computed
    for s in (a, b, c):
        assert len(s.blocks) * TOKENS_PER_BLOCK >= s.num_computed


def test_max_running_cap():
    memory, adapters = FakeMemory(100), FakeAdapters()
    scheduler = Scheduler(max_running=2, max_batch_tokens=100, memory=memory, adapters=adapters)
    seqs = [seq(f"s{i}", 3) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule()
    assert names(plan) == [("s0", 3), ("s1", 3)]
    assert list(scheduler.waiting) == seqs[2:]
    run_step(scheduler, plan)
    assert names(scheduler.schedule()) == [("s0", 1), ("s1", 1)]
    scheduler.finish(seqs[0])
    plan = scheduler.schedule()
    assert names(plan) == [("s1", 1), ("s2", 3)]
    assert len(scheduler.running) == 2


def test_preempts_newest_when_memory_runs_out():
    # 6 blocks = 24 positions; a and b take 2 blocks each (8 tokens), c takes 2 (6 tokens)
    memory, adapters = FakeMemory(6), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters)
    a, b, c = seq("a", 8, "x"), seq("b", 8, "y"), seq("c", 6, "z")
    for s in (a, b, c):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 8), ("b", 8), ("c", 6)] and memory.free == 0
    run_step(scheduler, plan)  # a, b now 9 tokens (need a 3rd block each); c 7
    c_blocks = list(c.blocks)
    plan = scheduler.schedule()
    # a needs a block: c (the newest) is preempted; b then needs one too and takes c's other block
    assert c not in scheduler.running and list(scheduler.waiting) == [c]
    assert c.num_computed == 0 and c.blocks == [] and c.preemptions == 1 and scheduler.preemptions == 1
    assert set(c_blocks) <= set(memory.released)
    assert adapters.pins["z"] == 0 and adapters.pins["x"] == 1 and adapters.pins["y"] == 1
    assert names(plan) == [("a", 1), ("b", 1)]
    assert c.tokens == list(range(6)) + [7]  # what it generated is kept, to be recomputed
    run_step(scheduler, plan)
    # c comes back first when room appears, recomputing prompt + generated tokens
    d = seq("d", 2)
    scheduler.add(d)
    scheduler.finish(a)
    plan = scheduler.schedule()
    assert names(plan) == [("b", 1), ("c", 7), ("d", 2)]


def test_preempting_several_keeps_their_order():
    memory, adapters = FakeMemory(4), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters)
    seqs = [seq(f"s{i}", 4) for i in range(4)]  # one block each: the pool is full
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule()
    run_step(scheduler, plan)
    seqs[0].tokens.extend([7] * 8)  # s0 suddenly needs 3 more blocks (e.g. a long chunk)
    plan = scheduler.schedule()
    assert names(plan) == [("s0", 9)]
    assert list(scheduler.waiting) == [seqs[1], seqs[2], seqs[3]]  # oldest first, as they arrived
    assert all(s.preemptions == 1 and s.num_computed == 0 for s in seqs[1:])
    assert scheduler.preemptions == 3  # the scheduler's count, for /v1/status and /metrics


def test_preempts_itself_when_alone_and_short():
    memory, adapters = FakeMemory(2), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters)
    a = seq("a", 8, "x")
    scheduler.add(a)
    run_step(scheduler, scheduler.schedule())
    assert a.num_tokens == 9 and memory.free == 0
    plan = scheduler.schedule()
    # a cannot grow and nobody else can make room: it goes back to waiting, holding nothing,
    # and cannot be readmitted (9 tokens need 3 blocks)
    assert plan == [] and list(scheduler.waiting) == [a] and not scheduler.running
    assert memory.free == 2 and a.blocks == [] and adapters.held() == 0


def test_unavailable_adapter_blocks_admission_in_order():
    memory, adapters = FakeMemory(100), FakeAdapters(unavailable={"busy"})
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters)
    a, b, c = seq("a", 3), seq("b", 3, "busy"), seq("c", 3, "free")
    for s in (a, b, c):
        scheduler.add(s)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 3)]  # c does not jump ahead of b
    assert list(scheduler.waiting) == [b, c] and b.blocks == [] and c.blocks == []
    assert ("acquire", "free") not in adapters.calls
    run_step(scheduler, plan)
    adapters.unavailable.clear()
    plan = scheduler.schedule()
    assert names(plan) == [("a", 1), ("b", 3), ("c", 3)]
    assert adapters.pins == {None: 1, "busy": 1, "free": 1}


def test_memory_short_on_admission_gives_the_adapter_back():
    memory, adapters = FakeMemory(2), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters)
    a, b = seq("a", 8, "x"), seq("b", 4, "y")
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 8)]
    assert adapters.pins == {"x": 1, "y": 0} and list(scheduler.waiting) == [b]


def test_finish_releases_everything_exactly_once():
    memory, adapters = FakeMemory(100), FakeAdapters()
    scheduler = Scheduler(max_running=1, max_batch_tokens=100, memory=memory, adapters=adapters)
    running, waiting = seq("r", 9, "x"), seq("w", 3, "y")
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler, scheduler.schedule())
    assert len(running.blocks) == 3 and waiting in scheduler.waiting
    for _ in range(2):  # the second call finds nothing to give back
        scheduler.finish(running)
        scheduler.finish(waiting)
    assert memory.out == set() and adapters.held() == 0
    assert adapters.calls.count(("release", "x")) == 1 and ("release", "y") not in adapters.calls
    assert not scheduler.has_work()


def test_random_workload_invariants():
    """Random prompts, budgets and a small memory: nothing leaks, nothing is computed twice in a step,
    every request finishes, and the pins match the running sequences."""
    rng = random.Random(5)
    memory, adapters = FakeMemory(8), FakeAdapters()
    scheduler = Scheduler(max_running=4, max_batch_tokens=10, memory=memory, adapters=adapters)
    pending = [seq(f"s{i}", rng.randint(1, 14), rng.choice([None, "x", "y"])) for i in range(25)]
    targets = {s.request_id: rng.randint(1, 8) for s in pending}
    done = []
    for _ in range(2000):
        if pending and rng.random() < 0.6:
            scheduler.add(pending.pop(0))
        if not scheduler.has_work() and not pending:
            break
        plan = scheduler.schedule()
        assert sum(count for _, count in plan) <= 10
        assert len(scheduler.running) <= 4
        assert len({id(s) for s, _ in plan}) == len(plan)
        for s, count in plan:
            assert s in scheduler.running and count > 0
            assert len(s.blocks) * TOKENS_PER_BLOCK >= s.num_computed + count
        for s in scheduler.waiting:
            assert s.blocks == [] and s.num_computed == 0
        run_step(scheduler, plan)
        for s, _ in plan:
            if s.num_generated >= targets[s.request_id] and s.num_computed == s.num_tokens - 1:
                scheduler.finish(s)
                done.append(s)
        pins = {}
        for s in scheduler.running:
            pins[s.adapter] = pins.get(s.adapter, 0) + 1
        assert {k: v for k, v in adapters.pins.items() if v} == pins
        held = sum(len(s.blocks) for s in scheduler.running)
        assert len(memory.out) == held
    assert len(done) == 25 and memory.out == set() and adapters.held() == 0
    assert any(s.preemptions for s in done), "the workload never preempted: make memory smaller"


@pytest.mark.parametrize("budget", [2, 3])  # (with 1, a running decode takes it every step)
def test_tiny_budget_still_progresses(budget):
    memory, adapters = FakeMemory(100), FakeAdapters()
    scheduler = Scheduler(max_running=4, max_batch_tokens=budget, memory=memory, adapters=adapters)
    a, b = seq("a", 5), seq("b", 2)
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(20):
        plan = scheduler.schedule()
        assert 0 < sum(count for _, count in plan) <= budget
        run_step(scheduler, plan)
    assert a.num_generated > 0 and b.num_generated > 0


def test_adopted_sequences_run_while_there_is_room_and_wait_first_with_their_blocks():
    memory, adapters = FakeMemory(100), FakeAdapters()
    scheduler = Scheduler(max_running=3, max_batch_tokens=100, memory=memory, adapters=adapters)
    first, later = seq("first", 5, "a"), seq("later", 3)
    scheduler.add(first)
    scheduler.add(later)
    run_step(scheduler, scheduler.schedule())
    forks = []
    for index in range(3):  # forked after first's prefill: 4 of 5 positions computed in blocks of their own
        fork = Sequence(f"fork{index}", first.tokens[:5] + [9], 5, "a", num_computed=4)
        assert memory.grow(fork.blocks, 4)
        forks.append(fork)
    scheduler.adopt(forks)
    assert scheduler.running == [first, later, forks[0]] and list(scheduler.waiting) == forks[1:]
    assert adapters.pins["a"] == 2  # only the adopted one that runs holds the adapter
    assert names(scheduler.schedule()) == [("first", 1), ("later", 1), ("fork0", 2)]
    scheduler.finish(later)
    plan = scheduler.schedule()  # the first waiting fork takes the slot, computing only what it lacks
    assert names(plan)[-1] == ("fork1", 2) and len(forks[1].blocks) == 2
    scheduler.finish(forks[2])  # a waiting fork that ends gives its blocks back
    assert forks[2].blocks == [] and forks[2] not in scheduler.waiting


# --- the growth reserve ------------------------------------------------------------------------------------


class ReservableMemory(FakeMemory):
    """FakeMemory that says what it can still give; `evictable` blocks are free once reclaimed (idle adapters)."""

    def __init__(self, capacity: int, evictable: int = 0):
        super().__init__(capacity)
        self.evictable = evictable
        self.reclaim_asks = 0

    def free_tokens(self) -> int:
        return self.free * TOKENS_PER_BLOCK

    def reclaimable_tokens(self) -> int:
        self.reclaim_asks += 1
        return (self.free + self.evictable) * TOKENS_PER_BLOCK

    def missing_tokens(self, blocks: list, num_tokens: int) -> int:
        return max(0, -(-num_tokens // TOKENS_PER_BLOCK) - len(blocks)) * TOKENS_PER_BLOCK

    def grow(self, blocks: list, num_tokens: int) -> bool:  # evicts what it must first, as the engine's does
        short = self.missing_tokens(blocks, num_tokens) // TOKENS_PER_BLOCK - self.free
        if 0 < short <= self.evictable:
            self.capacity += short
            self.evictable -= short
        return super().grow(blocks, num_tokens)


def limited(name: str, prompt_len: int, max_new: int) -> Sequence:
    sequence = seq(name, prompt_len)
    sequence.max_new_tokens = max_new
    return sequence


def test_growth_reserve_ratio_is_a_high_quantile_of_what_ended_sequences_used():
    reserve = GrowthReserve()
    assert reserve.ratio == 1.0 and reserve.tokens(limited("a", 4, 10)) == 10  # nothing ended yet: all of it
    assert reserve.tokens(seq("b", 4)) == 0  # no max_new_tokens: nothing to reserve
    for generated in range(1, 11):  # ten sequences that used 10%, 20%, ... 100% of their max_new_tokens
        ended = limited(f"e{generated}", 4, 10)
        ended.tokens.extend([0] * generated)
        reserve.ended(ended)
    assert reserve.ratio == pytest.approx(0.9)  # the 9th of 10 shares
    running = limited("r", 4, 100)
    running.tokens.extend([0] * 40)  # 60 of its 100 still to come: 0.9 of them held
    assert reserve.tokens(running) == 54
    for _ in range(GrowthReserve.WINDOW):  # the window forgets the older ones
        short = limited("s", 4, 10)
        short.tokens.append(0)
        reserve.ended(short)
    assert reserve.ratio == pytest.approx(0.1)


def test_growth_reserve_holds_a_join_that_would_outgrow_the_cache():
    # 10 blocks = 40 positions. a: 8-token prompt, 16 new tokens to come -> reaches 24 (6 blocks). b's prompt (8,
    # 2 blocks) fits beside a's today, but a's growth and b's own would need 6 + 6 blocks: b waits.
    memory, adapters = ReservableMemory(10), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters, reserve=GrowthReserve())
    a, b = limited("a", 8, 16), limited("b", 8, 16)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 8)] and scheduler.blocked is b and list(scheduler.waiting) == [b]
    assert adapters.held() == 1  # b's adapter acquired for the check went back
    for _ in range(16):  # a runs to its length without a preemption, then b joins
        run_step(scheduler, plan)
        plan = scheduler.schedule()
    assert scheduler.preemptions == 0
    scheduler.finish(a, completed=True)
    assert names(scheduler.schedule()) == [("b", 8)]
    # without the reserve, both join at once and a growing batch preempts b
    memory, adapters = ReservableMemory(10), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters)
    a, b = limited("a", 8, 16), limited("b", 8, 16)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 8), ("b", 8)]
    for _ in range(16):  # at 21 tokens each they would need 12 blocks
        run_step(scheduler, plan)
        plan = scheduler.schedule()
    assert scheduler.preemptions >= 1


def test_growth_reserve_counts_evictable_blocks_only_when_the_free_ones_fall_short():
    memory, adapters = ReservableMemory(6, evictable=6), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters, reserve=GrowthReserve())
    a, b, c = limited("a", 4, 4), limited("b", 4, 4), limited("c", 4, 4)  # each reaches 8 positions: 2 blocks
    for sequence in (a, b, c):
        scheduler.add(sequence)
    plan = scheduler.schedule()
    # a and b fit in the 6 free blocks with their growth (4 blocks); c's 2 more fit too: no reclaim asked
    assert names(plan) == [("a", 4), ("b", 4), ("c", 4)] and memory.reclaim_asks == 0
    d = limited("d", 4, 8)  # 3 blocks: only with the evictable ones
    scheduler.add(d)
    run_step(scheduler, plan)
    scheduler.schedule()
    assert d in scheduler.running and memory.reclaim_asks == 2  # once before its adapter is placed, once after


# --- the admission headroom ---------------------------------------------------------------------------------


def run_to_the_end(scheduler: Scheduler, seqs: list[Sequence]) -> dict[str, int]:
    """Steps until every sequence generated its max_new_tokens (each then finished, completed) -> each one's
    preemptions."""
    for s in seqs:
        scheduler.add(s)
    for _ in range(1000):
        if not scheduler.has_work():
            break
        plan = scheduler.schedule()
        run_step(scheduler, plan)
        for s, _ in plan:
            if s.num_generated >= s.max_new_tokens:
                scheduler.finish(s, completed=True)
    assert not scheduler.has_work()
    return {s.request_id: s.preemptions for s in seqs}


def test_the_headroom_rule():
    # 10 blocks of 4 positions; a runs with 17 positions (5 blocks). b's 16-token prompt takes 4 of the 5 free
    # blocks: it joins without a headroom; with one block's headroom for a and for b it needs 6 and waits.
    for headroom, joins in ((0, True), (TOKENS_PER_BLOCK, False)):
        scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=ReservableMemory(10), adapters=FakeAdapters(),
                              headroom=headroom)
        a, b = seq("a", 16), seq("b", 16)
        scheduler.add(a)
        run_step(scheduler, scheduler.schedule())
        scheduler.add(b)
        plan = scheduler.schedule()
        assert (("b", 16) in names(plan)) is joins, headroom


def test_the_headroom_keeps_a_preempted_sequence_from_rejoining_a_full_cache():
    # 12 blocks = 48 positions; six 6-token prompts that each generate 20. Without a headroom the cache fills to its
    # last block: the newest is preempted as the batch grows, rejoins as soon as its prompt fits, and is preempted
    # again, its tokens computed each time. With two blocks' headroom for each running sequence it joins only where
    # the batch can grow.
    def preemptions(headroom: int) -> dict[str, int]:
        scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=ReservableMemory(12), adapters=FakeAdapters(),
                              headroom=headroom)
        return run_to_the_end(scheduler, [limited(f"s{index}", 6, 20) for index in range(6)])

    without, within = preemptions(0), preemptions(2 * TOKENS_PER_BLOCK)
    assert max(without.values()) >= 2, without  # preempted again after rejoining
    assert sum(within.values()) < sum(without.values()) and max(within.values()) <= 1, within


def test_no_adapter_is_placed_for_a_sequence_whose_kv_does_not_fit():
    # a fills the cache but for a block; b's prompt needs two: b's adapter is not even acquired (a placed adapter
    # left idle is what the running sequences' growth evicts first, to be placed again at the next step)
    memory, adapters = ReservableMemory(4), FakeAdapters()
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=memory, adapters=adapters, headroom=1)
    a, b = limited("a", 12, 4), seq("b", 8, adapter="x")
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(3):
        run_step(scheduler, scheduler.schedule())
    assert scheduler.running == [a] and scheduler.blocked is b
    assert ("acquire", "x") not in adapters.calls


def test_without_a_headroom_or_reserve_an_admission_asks_the_memory_nothing_more():
    # the fakes without free_tokens and reclaimable_tokens still drive a scheduler that has neither
    scheduler = Scheduler(max_running=8, max_batch_tokens=100, memory=FakeMemory(4), adapters=FakeAdapters())
    a, b = seq("a", 8), seq("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    assert names(scheduler.schedule()) == [("a", 8), ("b", 8)]


# --- passing over sequences whose adapters are being staged ------------------------------------------------


def test_a_sequence_whose_adapter_stages_is_passed_over_and_keeps_its_place():
    memory, adapters = FakeMemory(100), FakeAdapters(unavailable={"cold"}, staged={"cold"})
    scheduler = Scheduler(max_running=4, max_batch_tokens=100, memory=memory, adapters=adapters)
    running = seq("r", 4, "warm")
    scheduler.add(running)
    run_step(scheduler, scheduler.schedule())
    cold, after, later = seq("c", 4, "cold"), seq("d", 4, "warm"), seq("e", 4, None)
    for sequence in (cold, after, later):
        scheduler.add(sequence)
    plan = scheduler.schedule()
    # c waits for its adapter's staging; d and e, behind it, join meanwhile; c keeps the head of the queue
    assert names(plan) == [("r", 1), ("d", 4), ("e", 4)] and list(scheduler.waiting) == [cold]
    assert scheduler.past_staging == 2 and adapters.pins.get("cold", 0) == 0
    run_step(scheduler, plan)
    adapters.unavailable.discard("cold")  # staged
    assert ("c", 4) in names(scheduler.schedule())


def test_a_refused_adapter_that_is_not_staging_still_holds_the_queue():
    memory, adapters = FakeMemory(100), FakeAdapters(unavailable={"full"})  # e.g. no room for it: not passed over
    scheduler = Scheduler(max_running=4, max_batch_tokens=100, memory=memory, adapters=adapters)
    running = seq("r", 4)
    scheduler.add(running)
    run_step(scheduler, scheduler.schedule())
    blocked, after = seq("b", 4, "full"), seq("d", 4)
    scheduler.add(blocked)
    scheduler.add(after)
    assert names(scheduler.schedule()) == [("r", 1)] and scheduler.blocked is blocked
    assert list(scheduler.waiting) == [blocked, after] and scheduler.past_staging == 0


def test_at_most_pass_staging_sequences_are_passed_over_a_step():
    names_staging = {f"cold{i}" for i in range(PASS_STAGING + 1)}
    memory, adapters = FakeMemory(100), FakeAdapters(unavailable=names_staging, staged=names_staging)
    scheduler = Scheduler(max_running=16, max_batch_tokens=200, memory=memory, adapters=adapters)
    running = seq("r", 4)
    scheduler.add(running)
    run_step(scheduler, scheduler.schedule())
    cold = [seq(f"c{i}", 4, f"cold{i}") for i in range(PASS_STAGING + 1)]
    for sequence in cold + [seq("d", 4)]:
        scheduler.add(sequence)
    assert names(scheduler.schedule()) == [("r", 1)]  # the ninth staging one stops the step: d is not reached
    assert list(scheduler.waiting)[:len(cold)] == cold
    # with passing turned off, the first holds the queue
    scheduler = Scheduler(max_running=16, max_batch_tokens=200, memory=FakeMemory(100), adapters=adapters, pass_staging=0)
    for sequence in (seq("r2", 4), seq("c", 4, "cold0"), seq("e", 4)):
        scheduler.add(sequence)
    assert names(scheduler.schedule()) == [("r2", 4)]


def test_passed_over_sequences_keep_their_places_when_an_adapter_raises_behind_them():
    class Broken(FakeAdapters):
        def acquire(self, name, tokens=None):
            if name == "broken":
                raise RuntimeError("the adapter's files are gone")
            return super().acquire(name, tokens)

    memory, adapters = FakeMemory(100), Broken(unavailable={"cold"}, staged={"cold"})
    scheduler = Scheduler(max_running=4, max_batch_tokens=100, memory=memory, adapters=adapters)
    scheduler.add(seq("r", 4))
    run_step(scheduler, scheduler.schedule())
    cold, broken, after = seq("c", 4, "cold"), seq("b", 4, "broken"), seq("d", 4)
    for sequence in (cold, broken, after):
        scheduler.add(sequence)
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    assert scheduler.blocked is broken and list(scheduler.waiting) == [cold, broken, after]


# --- why admission stopped (what keeps the running slots a step leaves empty) ------------------------------


def test_the_scheduler_says_why_its_admission_stopped():
    memory, adapters = FakeMemory(100), FakeAdapters(unavailable={"cold", "full"}, staged={"cold"})
    scheduler = Scheduler(max_running=3, max_batch_tokens=12, memory=memory, adapters=adapters, pass_staging=1)
    assert names(scheduler.schedule()) == [] and scheduler.stopped == batching.NO_REQUEST_WAITING
    first, long = seq("a", 4), seq("b", 20)
    scheduler.add(first)
    scheduler.add(long)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 4), ("b", 8)] and scheduler.stopped == batching.NO_REQUEST_WAITING
    run_step(scheduler, plan)
    scheduler.add(seq("c", 4))
    plan = scheduler.schedule()  # a decodes, b's next 11 tokens fill the budget: c waits with a slot free
    assert names(plan) == [("a", 1), ("b", 11)] and scheduler.stopped == batching.TOKEN_BUDGET
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    assert names(plan) == [("a", 1), ("b", 1), ("c", 4)] and scheduler.stopped == batching.NO_REQUEST_WAITING
    run_step(scheduler, plan)
    scheduler.add(seq("d", 4))
    assert names(scheduler.schedule()) == [("a", 1), ("b", 1), ("c", 1)] and scheduler.stopped == batching.RUNNING_FULL
    # a slot free: the head's adapter stages and is passed over (pass_staging=1), the next one's too: staging
    scheduler.finish(first)
    scheduler.waiting.clear()
    for sequence in (seq("e", 4, "cold"), seq("f", 4, "cold")):
        scheduler.add(sequence)
    scheduler.schedule()
    assert scheduler.stopped == batching.ADAPTER_STAGING and len(scheduler.waiting) == 2
    scheduler.waiting.clear()
    scheduler.add(seq("g", 4, "cold"))  # passed over, then nothing behind it: still waiting for the staging
    scheduler.schedule()
    assert scheduler.stopped == batching.ADAPTER_STAGING
    scheduler.waiting.clear()
    scheduler.add(seq("h", 4, "full"))  # refused, not staging: the pool has no room for it now
    scheduler.schedule()
    assert scheduler.stopped == batching.KV_OR_ADAPTER_PAGES
    assert set(batching.ADMISSION_STOPS) >= {batching.NO_REQUEST_WAITING, batching.TOKEN_BUDGET, batching.RUNNING_FULL,
                                             batching.ADAPTER_STAGING, batching.KV_OR_ADAPTER_PAGES}


def test_the_default_running_cap_follows_the_kv_cache():
    # one running request a 1024 positions, in multiples of 8, from 64 to 256
    assert batching.default_max_running(104_584) == 96  # the 7B shape's bf16 cache on an H100
    assert batching.default_max_running(231_990) == 224  # the same in FP8
    assert batching.default_max_running(411_428) == 256  # Llama 3 8B's GQA cache: at the top
    assert batching.default_max_running(20_000) == batching.default_max_running(0) == 64  # small caches keep 64
    assert batching.default_max_running(80 * 1024 - 1) == 72
