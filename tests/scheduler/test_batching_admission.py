"""scheduler/batching.py with an admission policy: the policy path admits exactly what the FCFS path does
when it changes nothing, early abort's drops leave the queue and are handed to the engine, and adapter
clustering keeps the running batch's distinct adapters within the cap while others wait, until they
have waited max_wait_s (no starvation)."""

from __future__ import annotations

import random

import pytest

from lorad.scheduler.admission import FCFS, AdapterClustering, EarlyAbort, Objectives
from lorad.scheduler.batching import Scheduler, Sequence
from lorad.scheduler.perf_model import PrefillModel
from scheduler_fakes import Adapters, Clock, Memory


def seq(name, prompt_len=4, adapter=None, rank=0):
    return Sequence(name, list(range(prompt_len)), prompt_len, adapter, rank=rank)


def advance(scheduler, plan, finish_after=3):
    """The engine's side of a step: tokens computed, one sampled; a sequence finishes after a few tokens."""
    for s, count in plan:
        s.num_computed += count
        if s.num_computed == s.num_tokens:
            s.tokens.append(1)
            if s.num_generated >= finish_after:
                scheduler.finish(s)


def test_a_policy_that_changes_nothing_admits_what_fcfs_admits():
    rng = random.Random(3)
    names = ["a", "b", "c", None]
    work = [(f"r{i}", rng.randint(1, 40), rng.choice(names)) for i in range(60)]
    plans = []
    for admission in (FCFS(), AdapterClustering(FCFS(), max_adapters=100, max_wait_s=1e9)):
        scheduler = Scheduler(4, 32, Memory(), Adapters(), admission)
        for name, length, adapter in work:
            scheduler.add(seq(name, length, adapter))
        steps = []
        while scheduler.has_work():
            plan = scheduler.schedule()
            steps.append([(s.request_id, count) for s, count in plan])
            advance(scheduler, plan)
        plans.append(steps)
    assert plans[0] == plans[1]


def test_early_abort_drops_from_the_queue_and_hands_them_over():
    clock = Clock()
    prefill = PrefillModel(per_token_s=0.01, per_rank_token_s=0.0, per_square_token_s=0.0, fixed_s=0.0)
    scheduler = Scheduler(2, 1000, Memory(), Adapters(), EarlyAbort(prefill), Objectives(0.5, 0.1), clock)
    for name, length in (("short", 10), ("long", 80), ("short2", 10)):
        scheduler.add(seq(name, length))
    plan = scheduler.schedule()
    # long: 0.1 (short) + 0.8 of its own > 0.5: dropped at once; short2 still makes it
    assert [s.request_id for s, _ in plan] == ["short", "short2"]
    dropped = scheduler.take_dropped()
    assert [(s.request_id, reason.startswith("early abort: estimated TTFT 900.0 ms")) for s, reason in dropped] == [
        ("long", True)]
    assert scheduler.take_dropped() == [] and not scheduler.waiting
    # a request that waits for a slot is dropped once waiting has made it late
    scheduler.add(seq("late", 10))
    clock.now = 0.3
    assert scheduler.schedule() and not scheduler.take_dropped()  # 0.3 waited + 0.1: may still make it
    clock.now = 0.45
    scheduler.schedule()
    assert [s.request_id for s, _ in scheduler.take_dropped()] == ["late"]
    # a preempted sequence (its first token out) is never dropped
    running = scheduler.running[0]
    running.tokens.append(1)
    scheduler.preempt(running)
    clock.now = 100.0
    scheduler.schedule()
    assert scheduler.take_dropped() == [] and running in scheduler.running


def test_clustering_caps_distinct_adapters_until_a_request_waits_too_long():
    clock = Clock()
    scheduler = Scheduler(8, 1000, Memory(), Adapters(), AdapterClustering(FCFS(), 2, max_wait_s=1.0),
                          clock=clock)
    for index, adapter in enumerate(["a", "b", "c", "a", "d", None, "b"]):
        scheduler.add(seq(f"r{index}", 4, adapter))
    plan = scheduler.schedule()
    assert [s.adapter for s, _ in plan] == ["a", "b", "a", None, "b"]
    assert [s.adapter for s in scheduler.waiting] == ["c", "d"]
    for step in range(5):  # the batch keeps running (nobody finishes): c and d wait, under the cap
        clock.now = 0.2 * step
        for s, count in scheduler.schedule():
            s.num_computed += count
            s.tokens.append(1)
        assert len({s.adapter for s in scheduler.running} - {None}) <= 2
        assert [s.adapter for s in scheduler.waiting] == ["c", "d"]
    clock.now = 1.01  # waited longer than max_wait_s: admitted regardless
    scheduler.schedule()
    assert not scheduler.waiting and {s.adapter for s in scheduler.running} == {"a", "b", "c", "d", None}
    # once the batch drains, a new adapter's request joins at once
    for s in list(scheduler.running):
        scheduler.finish(s)
    scheduler.add(seq("new", 4, "e"))
    assert [s.adapter for s, _ in scheduler.schedule()] == ["e"]


def test_a_policys_admission_passes_over_a_request_whose_adapter_stages():
    """The policies' path (here clustering) passes over a request whose adapter is being staged, as FCFS does."""

    class Staging(Adapters):
        def __init__(self):
            self.cold = {"c"}

        def acquire(self, name, tokens=None):
            return name not in self.cold

        def staging(self, name):
            return name in self.cold

    adapters = Staging()
    scheduler = Scheduler(8, 1000, Memory(), adapters, AdapterClustering(FCFS(), 4, max_wait_s=1.0), clock=Clock())
    scheduler.add(seq("r0", 4, "a"))
    scheduler.schedule()
    for index, adapter in enumerate(["c", "a", None], start=1):
        scheduler.add(seq(f"r{index}", 4, adapter))
    plan = scheduler.schedule()
    assert [s.request_id for s, _ in plan] == ["r0", "r2", "r3"] and [s.request_id for s in scheduler.waiting] == ["r1"]
    assert scheduler.past_staging == 2
    adapters.cold.clear()
    assert "r1" in [s.request_id for s, _ in scheduler.schedule()]


def test_a_policys_admission_that_raises_leaves_the_admitted_out_of_the_queue():
    class Broken(Adapters):
        def acquire(self, name, tokens=None):
            if name == "broken":
                raise RuntimeError("the adapter's files are gone")
            return True

    scheduler = Scheduler(8, 1000, Memory(), Broken(), AdapterClustering(FCFS(), 4, max_wait_s=1.0), clock=Clock())
    first, broken, last = seq("r0", 4, "a"), seq("r1", 4, "broken"), seq("r2", 4, "a")
    for sequence in (first, broken, last):
        scheduler.add(sequence)
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    assert scheduler.running == [first] and list(scheduler.waiting) == [broken, last] and scheduler.blocked is broken
