"""daemon/engine/adapter_residency.py's Stager (the background threads that read and stage cold adapters for
the engine thread, several at once) and LoraResidency's use of it: staged once, stale or failed work left out, an
adapter the stager staged placed by a prefetch without staging it again; staged copies keyed by the adapter's files
(or an in-memory adapter's weights), keeping no float32 host copy of an adapter read from files alive."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lorad.daemon.engine import adapter_residency
from lorad.daemon.engine.adapter_residency import STAGER_THREADS, LoraResidency, Stager
from lorad.daemon.engine.status import staging_status
from lorad.gpu_ops.page_pool import StagedAdapter
from lorad.gpu_ops.pinned_arena import ALIGN, PinnedArena


PIN_ARENA = adapter_residency._pin_arena


@pytest.fixture(autouse=True)
def unpinned_arena(monkeypatch):
    """The residency's arena in plain host memory (no CUDA to pin it with here)."""
    monkeypatch.setattr(adapter_residency, "_pin_arena", lambda capacity, table: PinnedArena(capacity, pin=False))


def wait_for(stager: Stager, count: int, timeout: float = 10.0) -> list:
    done, deadline = [], time.monotonic() + timeout
    while len(done) < count and time.monotonic() < deadline:
        done += stager.take()
        time.sleep(0.005)
    return done


def test_each_name_staged_once_while_pending_and_off_the_callers_thread():
    calls, threads = [], set()
    release = threading.Event()

    def lookup(name):
        release.wait(5)
        calls.append(name)
        threads.add(threading.current_thread().name)
        return f"adapter {name}"

    stager = Stager(lookup, lambda adapter, parts: (adapter.upper(), None))
    for name in ("a", "b", "a", "a"):
        stager.ask(name, 0)
    assert stager.pending() == 2
    release.set()
    done = wait_for(stager, 2)
    assert sorted((name, result) for name, _, _, result in done) == [("a", ("ADAPTER A", None)), ("b", ("ADAPTER B", None))]
    assert sorted(calls) == ["a", "b"] and stager.pending() == 0 and stager.staged == 2
    assert stager.part_seconds["read"] > 0 and stager.part_seconds["cpu"] >= 0  # the reads waited for `release`
    assert stager.part_seconds["read"] <= stager.seconds
    assert threads and all(name.startswith("lorad-stager-") for name in threads)
    stager.ask("a", 1)  # asked again once done: staged again (e.g. after it left the caches)
    assert [item[:2] for item in wait_for(stager, 1)] == [("a", 1)]


def test_several_adapters_stage_at_once():
    # Each lookup waits until `threads` of them run together: done only if the stager's threads work side by side.
    threads = 3
    together = threading.Barrier(threads, timeout=5)

    def lookup(name):
        together.wait()
        return name

    stager = Stager(lookup, lambda adapter, parts: (adapter, None), threads=threads)
    for name in ("a", "b", "c"):
        stager.ask(name, 0)
    done = wait_for(stager, threads)
    assert sorted(name for name, *_ in done) == ["a", "b", "c"]
    assert all(not isinstance(result, BaseException) for *_, result in done)  # no barrier timed out
    assert stager.seconds > 0


def test_the_stager_threads_run_torch_on_one_thread_each_and_leave_the_callers_setting():
    before = torch.get_num_threads()
    seen = []
    stager = Stager(lambda name: seen.append(torch.get_num_threads()) or name, lambda adapter, parts: (adapter, None), threads=2)
    for name in ("a", "b"):
        stager.ask(name, 0)
    assert len(wait_for(stager, 2)) == 2
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_a_failure_is_reported_not_raised():
    def lookup(name):
        raise ValueError(f"{name} is broken")

    stager = Stager(lookup, lambda adapter, parts: (adapter, None))
    stager.ask("bad", 0)
    (name, _, adapter, result), = wait_for(stager, 1)
    assert name == "bad" and adapter is None and isinstance(result, ValueError)


class FakeAdapter:
    """An adapter read from files: `source` stands for them (LoraAdapter.source)."""

    def __init__(self, name, files=0):
        self.name, self.path, self.source = name, f"/adapters/{name}", (name, files)
        self.weights = {(0, 0): (torch.zeros(4), torch.zeros(4))}


class FakeTable:
    """What LoraResidency reads of an AdapterTable for staging; pages "on cuda" so that the stager is used."""

    class pool:
        class pages:
            is_cuda = True

        num_free = 1000

    def __init__(self):
        self.placed = {}

    def free_slot(self):
        return len(self.placed)

    def place(self, slot, staged):
        self.placed[slot] = staged
        return True

    def evict(self, slot):
        del self.placed[slot]

    def copy_fence(self):
        return []


@pytest.fixture
def residency(monkeypatch):
    """A residency whose lookup is the engine's (the adapters its requests hold: one object per name), recording the
    adapters read (`reads`) and each staging (`staged_on`: name and thread); `broken`: names whose staging raises;
    `gate`: an event each staging waits for."""
    adapters, reads, staged_on, broken = {}, [], [], set()

    def lookup(name):
        if name not in adapters:
            reads.append(name)
            adapters[name] = FakeAdapter(name)
        return adapters[name]

    residency = LoraResidency(lookup, FakeTable(), pinned_bytes=1 << 20, staged_bytes=1 << 20)

    def stage(adapter, parts=None):  # (pageable, "pinned": the same pages here, no CUDA to pin them with)
        staged_on.append((adapter.name, threading.current_thread().name))
        assert residency.gate.wait(10)
        if adapter.name in broken:
            raise ValueError(f"adapter {adapter.name} is broken")
        staged = StagedAdapter(torch.zeros(2, 4), [adapter.name])  # 32 bytes
        return staged, staged

    monkeypatch.setattr(residency, "_stage_pages", stage)
    residency.stager.stage = residency._stage_pages
    residency.adapters, residency.reads, residency.staged_on, residency.broken = adapters, reads, staged_on, broken
    residency.gate = threading.Event()  # a staging waits for it (set: none waits)
    residency.gate.set()
    return residency


def stagings(residency) -> list[str]:
    return [name for name, _ in residency.staged_on]


def settle(residency):
    deadline = time.monotonic() + 10
    while residency.stager.pending() and time.monotonic() < deadline:
        residency._absorb()
        time.sleep(0.005)


def test_a_prefetch_waits_for_nothing_and_places_what_the_stager_staged(residency):
    assert not residency.prefetch("x", reserve_pages=0)  # not staged yet: asked for, not done here
    settle(residency)
    assert residency.staged_off_thread == 1 and stagings(residency) == ["x"]
    assert residency.prefetch("x", reserve_pages=0)
    assert stagings(residency) == ["x"] and residency.reads == ["x"]  # placed from the stager's copy
    assert residency.table.placed[0].layout == ["x"]


def test_work_for_a_dropped_name_is_left_out(residency):
    residency.prepare(["y"])
    residency.drop("y")  # unregistered (or replaced) while its staging ran
    settle(residency)
    assert not residency._is_staged(residency.lookup("y")) and residency.staged_off_thread == 0


def test_a_dropped_stager_is_freed_and_its_thread_ends():
    """The thread must not keep its stager (and through `lookup` the engine, with its GPU memory) alive."""
    import gc
    import weakref

    stager = Stager(lambda name: name, lambda adapter, parts: (adapter, None))
    stager.ask("a", 0)
    wait_for(stager, 1)
    threads, alive = list(stager._threads), weakref.ref(stager)
    del stager
    gc.collect()
    assert alive() is None
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()


def test_an_admission_waits_for_the_stager_while_other_rows_run(residency):
    running = [True]
    residency.defer_unstaged = lambda: running[0]
    assert not residency.acquire("x", 8)  # not staged: the stager is asked, the step goes on without it
    assert residency.stager.pending() == 1 and "x" in residency.deferred
    assert not residency.acquire("x", 8)  # asked again in the next step: counted once
    assert residency.admissions_deferred == 1
    settle(residency)
    assert residency.acquire("x", 8)  # staged now: admitted from the stager's copy
    assert stagings(residency) == ["x"] and residency.slots["x"] == 0 and not residency.deferred
    running[0] = False  # nothing else runs: the engine thread stages it itself, as without a stager
    assert residency.acquire("y", 8)
    assert stagings(residency) == ["x", "y"] and residency.admissions_deferred == 1


def test_an_adapter_the_stager_failed_on_is_staged_at_admission_and_fails_there(residency):
    residency.broken.add("z")
    residency.defer_unstaged = lambda: True
    assert not residency.acquire("z", 8)
    settle(residency)
    with pytest.raises(ValueError, match="z is broken"):  # not deferred forever: the request meets the error
        residency.acquire("z", 8)
    assert stagings(residency) == ["z", "z"]


def test_the_engine_defers_while_rows_run_and_not_under_cold_start_cpu():
    from lorad.daemon.engine.engine import Engine

    def engine(running, cold_start):
        return SimpleNamespace(scheduler=SimpleNamespace(running=running), config=SimpleNamespace(cold_start=cold_start))

    assert Engine._defer_unstaged(engine(["a row"], "auto"))
    assert Engine._defer_unstaged(engine(["a row"], "ondemand"))
    assert not Engine._defer_unstaged(engine([], "auto"))  # nothing else to run: staged on the engine thread
    assert not Engine._defer_unstaged(engine(["a row"], "cpu"))  # its CPU workers start while the adapter loads


def test_staged_copies_keep_no_host_copy_of_an_adapter_read_from_files(residency):
    """The host store decides how long an adapter's float32 copy lives: once the engine lets one go (its requests
    done, the store full), its staged copies must not keep it, however many adapters were staged."""
    import gc
    import weakref

    names = [f"a{index}" for index in range(6)]
    for name in names:
        residency.prepare([name])
        settle(residency)
    alive = {name: weakref.ref(residency.adapters[name].weights[(0, 0)][0]) for name in names}
    residency.adapters.clear()
    gc.collect()
    assert [name for name in names if alive[name]() is not None] == []
    assert all(holds is None for holds, _ in residency.pageable.entries.values())
    assert len(residency.pageable) == 6  # 192 bytes, within the budget: all still staged


def test_an_adapter_read_again_from_the_same_files_finds_its_copy_and_new_files_are_staged_again(residency):
    residency.prepare(["x"])
    settle(residency)
    residency.adapters["x"] = FakeAdapter("x")  # read again (another object, other tensors): the same files
    assert residency._is_staged(residency.lookup("x"))
    assert residency.acquire("x", 8) and stagings(residency) == ["x"]
    residency.release("x")
    residency.drop("x")  # replaced: loaded again with new files
    residency.adapters["x"] = FakeAdapter("x", files=1)
    assert not residency._is_staged(residency.lookup("x"))
    assert residency.acquire("x", 8) and stagings(residency) == ["x", "x"]


def test_an_adapter_made_in_memory_is_keyed_by_its_weights_which_its_copy_holds(residency):
    shared = FakeAdapter("d0")
    shared.source = None  # a dummy adapter: no files; two names share one weight set
    twin = FakeAdapter("d1")
    twin.source, twin.weights = None, shared.weights
    residency.adapters.update(d0=shared, d1=twin)
    assert residency.acquire("d0", 8) and residency.acquire("d1", 8)
    assert stagings(residency) == ["d0"]  # staged once for both
    (holds, _), = residency.pageable.entries.values()
    assert holds is shared.weights


def test_a_queued_name_the_engine_thread_claims_is_skipped_and_a_started_one_is_waited_for():
    gate, calls = threading.Event(), []

    def lookup(name):
        calls.append(name)
        assert gate.wait(10)
        return name

    stager = Stager(lookup, lambda adapter, parts: (adapter, None), threads=1)
    stager.ask("a", 0)
    stager.ask("b", 0)  # queued behind "a" on the one thread
    deadline = time.monotonic() + 10
    while "a" not in stager._started:
        assert time.monotonic() < deadline, "the thread never started"
        time.sleep(0.001)
    assert not stager.claim("a")  # being staged: wait for it
    assert stager.claim("b")  # only queued: the engine thread stages it, the thread skips it
    assert not stager.wait("a", 0.05)  # still at it
    gate.set()
    assert stager.wait("a", 10)
    assert stager.wait("b", 10)  # the thread reached "b" and skipped it: its mark comes through too
    done = stager.take()
    assert [name for name, *_ in done] == ["a"] and calls == ["a"]
    assert stager.pending() == 0 and not stager._claimed and not stager._started


def test_an_idle_admission_waits_for_the_staging_a_stager_thread_began_instead_of_staging_it_again(residency):
    residency.defer_unstaged = lambda: False  # nothing else runs: the admission's adapter is staged now
    residency.gate.clear()
    residency.prepare(["x"])
    deadline = time.monotonic() + 10
    while "x" not in residency.stager._started:
        assert time.monotonic() < deadline, "the stager never started"
        time.sleep(0.001)
    admitted = []
    admission = threading.Thread(target=lambda: admitted.append(residency.acquire("x", 8)))
    admission.start()
    time.sleep(0.05)
    assert admission.is_alive()  # waiting for the stager's staging, not staging it again
    residency.gate.set()
    admission.join(10)
    assert admitted == [True] and residency.slots["x"] == 0
    assert [thread.startswith("lorad-stager-") for _, thread in residency.staged_on] == [True]  # staged once


def test_an_idle_admission_takes_over_a_staging_still_queued(residency):
    residency.stager.threads = 1
    residency.defer_unstaged = lambda: False
    residency.gate.clear()
    residency.prepare(["x", "y"])  # the one thread starts "x"; "y" waits behind it
    deadline = time.monotonic() + 10
    while "x" not in residency.stager._started:
        assert time.monotonic() < deadline, "the stager never started"
        time.sleep(0.001)
    residency.adapters["y"] = FakeAdapter("y")
    residency.gate.set()  # (the admission's own staging must not wait)
    assert residency.acquire("y", 8)  # staged on this thread at once: not behind "x"
    settle(residency)
    assert sorted(stagings(residency)) == ["x", "y"]  # "y" once, by the admission; the thread skipped it
    assert residency.stager.pending() == 0 and residency.stager.staged == 1


def test_prepare_asks_by_name_without_looking_adapters_up(residency):
    # A tensor-parallel lookup shards the adapter: prepare and prefetch run each step on the engine thread, and must
    # leave the reading (and the sharding) of a queued adapter to the stager's threads.
    residency.prepare(["x"])
    settle(residency)
    lookups = []
    residency.lookup = lambda name: lookups.append(name) or residency.adapters[name]
    residency.prepare(["x", "y"])
    assert not residency.prefetch("y", reserve_pages=0)  # asked of the stager, not looked up here
    assert lookups == [] and residency.stager.pending() == 1
    settle(residency)


def test_the_time_from_ask_to_take_counts_the_wait_for_a_thread():
    # One thread: b waits while a is staged (a's lookup holds until released), so b's ask-to-take time is at least
    # a's staging time, and the two together exceed the threads' staging seconds.
    release = threading.Event()

    def lookup(name):
        if name == "a":
            release.wait(5)
        return name

    stager = Stager(lookup, lambda adapter, parts: (adapter, None), threads=1)
    for name in ("a", "b"):
        stager.ask(name, 0)
    time.sleep(0.1)
    release.set()
    assert len(wait_for(stager, 2)) == 2
    assert stager.staged == 2 and stager.seconds >= 0.1
    assert stager.ready_seconds > stager.seconds


def test_status_gives_the_stagers_counts_and_means():
    stager = Stager(lambda name: name, lambda adapter, parts: parts.update(layout=0.001, pin=0.002) or (adapter, None),
                    threads=2)
    engine = SimpleNamespace(residency=SimpleNamespace(stager=stager, staged_off_thread=2, admissions_deferred=1, arena=None),
                             scheduler=SimpleNamespace(past_staging=3))
    assert staging_status(engine)["stage_ms_mean"] is None and staging_status(engine)["ready_ms_mean"] is None
    for name in ("a", "b"):
        stager.ask(name, 0)
    assert len(wait_for(stager, 2)) == 2
    status = staging_status(engine)
    assert status == {"off_thread": 2, "pending": 0, "threads": 2,
                      "stage_ms_mean": round(stager.seconds / 2 * 1e3, 1),
                      "ready_ms_mean": round(stager.ready_seconds / 2 * 1e3, 1),
                      "parts_ms_mean": {"read": round(stager.part_seconds["read"] / 2 * 1e3, 1), "layout": 1.0, "pin": 2.0,
                                        "cpu": round(stager.part_seconds["cpu"] / 2 * 1e3, 1)},
                      "admissions_deferred": 1, "admitted_past_staging": 3, "pinned_arena": None}
    assert status["ready_ms_mean"] >= status["stage_ms_mean"]
    assert staging_status(SimpleNamespace(residency=SimpleNamespace(stager=None))) is None


def test_the_stagers_threads_are_the_configured_number_or_the_default():
    table = FakeTable()
    assert LoraResidency(lambda name: name, table, stager_threads=7).stager.threads == 7
    default = LoraResidency(lambda name: name, table).stager.threads
    assert default == max(1, min(STAGER_THREADS, len(os.sched_getaffinity(0))))



def pages(count: int) -> StagedAdapter:
    """A staged adapter of `count` arena pages (pageable)."""
    return StagedAdapter(torch.arange(count * ALIGN // 4, dtype=torch.float32).view(count, -1), [])


def test_pinned_copies_come_from_the_arena_and_a_full_arena_drops_the_oldest_only_where_that_may_wait():
    residency = LoraResidency(lambda name: name, FakeTable(), pinned_bytes=4 * ALIGN, staged_bytes=1 << 20)
    for key in "ab":
        pinned, _ = residency._pinned_copy(pages(1), wait=False)
        assert pinned.pages.data_ptr() - residency.arena.segments[0].data_ptr() in (0, ALIGN)
        assert torch.equal(pinned.pages, pages(1).pages)
        residency.pinned.put(key, None, pinned)
    del pinned
    untaken = residency.arena.alloc(2 * ALIGN)  # a stager thread's copy the engine thread has not taken yet
    held = residency.pinned.get("a")  # a placement still copying from "a" ("b" is now the least recently used)
    # The engine thread: the cache is within its budget, the arena full: left pageable, nothing dropped.
    assert residency._pinned_copy(pages(1), wait=False)[0] is None
    assert residency.pinned_misses == 1 and len(residency.pinned) == 2
    # A stager thread drops the least recently used entries until a range is free: "b" frees one.
    third, _ = residency._pinned_copy(pages(1), wait=True)
    assert third is not None and list(residency.pinned.entries) == ["a"]
    # Two pages: "a" is dropped, but its memory comes back only with `held`.
    assert residency._pinned_copy(pages(2), wait=True)[0] is None and len(residency.pinned) == 0
    del held, third
    assert residency._pinned_copy(pages(2), wait=True)[0] is not None
    assert residency._pinned_copy(pages(5), wait=True)[0] is None and residency.pinned_misses == 2  # past the budget
    del untaken


def test_an_adapter_larger_than_any_pinned_block_stays_pageable_and_drops_nothing():
    residency = LoraResidency(lambda name: name, FakeTable(), pinned_bytes=6 * ALIGN, staged_bytes=1 << 20)  # 4 + 2
    residency.pinned.put("a", None, residency._pinned_copy(pages(1), wait=False)[0])
    assert residency._pinned_copy(pages(5), wait=True)[0] is None  # within the budget, but no block holds it
    assert list(residency.pinned.entries) == ["a"]


def test_pinned_memory_that_cannot_be_had_stops_the_start_naming_the_flag(monkeypatch):
    def refused(capacity, pin=True, fence=None):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(adapter_residency, "_pin_arena", PIN_ARENA)  # the real one, PinnedArena refusing
    monkeypatch.setattr(adapter_residency, "PinnedArena", refused)
    with pytest.raises(RuntimeError, match=r"could not pin 1048576 bytes .*--pinned-host-bytes.*out of memory"):
        LoraResidency(lambda name: name, FakeTable(), pinned_bytes=1 << 20)
    assert LoraResidency(lambda name: name, FakeTable(), pinned_bytes=0).arena is None  # none asked for, none pinned
