"""daemon/engine/adapter_residency.py's Stager (the background threads that read and stage cold adapters for
the engine thread, several at once) and LoraResidency's use of it: staged once, stale or failed work left out, and an adapter
the stager has prepared placed by a prefetch without looking it up again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lorad.daemon.engine.adapter_residency import LoraResidency, Stager
from lorad.gpu_ops.page_pool import StagedAdapter


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

    stager = Stager(lookup, lambda adapter: (adapter.upper(), None))
    for name in ("a", "b", "a", "a"):
        stager.ask(name, 0)
    assert stager.pending() == 2
    release.set()
    done = wait_for(stager, 2)
    assert sorted((name, result) for name, _, _, result in done) == [("a", ("ADAPTER A", None)), ("b", ("ADAPTER B", None))]
    assert sorted(calls) == ["a", "b"] and stager.pending() == 0 and stager.staged == 2
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

    stager = Stager(lookup, lambda adapter: (adapter, None), threads=threads)
    for name in ("a", "b", "c"):
        stager.ask(name, 0)
    done = wait_for(stager, threads)
    assert sorted(name for name, *_ in done) == ["a", "b", "c"]
    assert all(not isinstance(result, BaseException) for *_, result in done)  # no barrier timed out
    assert stager.seconds > 0


def test_the_stager_threads_run_torch_on_one_thread_each_and_leave_the_callers_setting():
    before = torch.get_num_threads()
    seen = []
    stager = Stager(lambda name: seen.append(torch.get_num_threads()) or name, lambda adapter: (adapter, None), threads=2)
    for name in ("a", "b"):
        stager.ask(name, 0)
    assert len(wait_for(stager, 2)) == 2
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_a_failure_is_reported_not_raised():
    def lookup(name):
        raise ValueError(f"{name} is broken")

    stager = Stager(lookup, lambda adapter: (adapter, None))
    stager.ask("bad", 0)
    (name, _, adapter, result), = wait_for(stager, 1)
    assert name == "bad" and adapter is None and isinstance(result, ValueError)


class FakeAdapter:
    def __init__(self, name):
        self.name = name
        self.weights = {"of": name}


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


@pytest.fixture
def residency(monkeypatch):
    looked_up = []

    def lookup(name):
        looked_up.append(name)
        return FakeAdapter(name)

    residency = LoraResidency(lookup, FakeTable(), pinned_bytes=1 << 20, staged_bytes=1 << 20)
    def stage(adapter):  # (pageable, "pinned": the same pages here, no CUDA to pin them with)
        staged = StagedAdapter(torch.zeros(2, 4), [adapter.name])
        return staged, staged

    monkeypatch.setattr(residency, "_stage_pages", stage)
    residency.stager.stage = residency._stage_pages
    residency.looked_up = looked_up
    return residency


def settle(residency):
    deadline = time.monotonic() + 10
    while residency.stager.pending() and time.monotonic() < deadline:
        residency._absorb()
        time.sleep(0.005)


def test_a_prefetch_waits_for_nothing_and_places_what_the_stager_prepared(residency):
    assert not residency.prefetch("x", reserve_pages=0)  # not staged yet: asked for, not done here
    settle(residency)
    assert residency.staged_off_thread == 1 and residency.looked_up == ["x"]
    assert residency.prefetch("x", reserve_pages=0)
    assert residency.looked_up == ["x"]  # placed from the prepared copy: no second lookup
    assert residency.table.placed[0].layout == ["x"]


def test_work_for_a_dropped_name_is_left_out(residency):
    residency.prepare(["y"])
    residency.drop("y")  # unregistered (or replaced) while its staging ran
    settle(residency)
    assert residency._ready("y") is None and residency.staged_off_thread == 0


def test_a_dropped_stager_is_freed_and_its_thread_ends():
    """The thread must not keep its stager (and through `lookup` the engine, with its GPU memory) alive."""
    import gc
    import weakref

    stager = Stager(lambda name: name, lambda adapter: (adapter, None))
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
    assert residency.looked_up == ["x"] and residency.slots["x"] == 0 and not residency.deferred
    running[0] = False  # nothing else runs: the engine thread stages it itself, as without a stager
    assert residency.acquire("y", 8)
    assert residency.looked_up == ["x", "y"] and residency.admissions_deferred == 1


def test_an_adapter_the_stager_failed_on_is_staged_at_admission_and_fails_there(residency):
    broken = {"z"}

    def lookup(name):
        residency.looked_up.append(name)
        if name in broken:
            raise ValueError(f"adapter {name} is broken")
        return FakeAdapter(name)

    residency.lookup = residency.stager.lookup = lookup
    residency.defer_unstaged = lambda: True
    assert not residency.acquire("z", 8)
    settle(residency)
    with pytest.raises(ValueError, match="z is broken"):  # not deferred forever: the request meets the error
        residency.acquire("z", 8)
    assert residency.looked_up == ["z", "z"]


def test_the_engine_defers_while_rows_run_and_not_under_cold_start_cpu():
    from types import SimpleNamespace

    from lorad.daemon.engine.engine import Engine

    def engine(running, cold_start):
        return SimpleNamespace(scheduler=SimpleNamespace(running=running), config=SimpleNamespace(cold_start=cold_start))

    assert Engine._defer_unstaged(engine(["a row"], "auto"))
    assert Engine._defer_unstaged(engine(["a row"], "ondemand"))
    assert not Engine._defer_unstaged(engine([], "auto"))  # nothing else to run: staged on the engine thread
    assert not Engine._defer_unstaged(engine(["a row"], "cpu"))  # its CPU workers start while the adapter loads


def test_adapters_whose_staged_copies_left_both_tiers_are_not_kept_alive(residency):
    """`prepared` hands a staged adapter to its admission without a second lookup; once the caches drop its staged
    copy it must let the float32 host copy go too, or host memory grows with every adapter ever staged."""
    import gc
    import weakref

    class Heavy:
        def __init__(self, name):
            self.name = name
            self.weights = {(0, 0): (torch.zeros(4), torch.zeros(4))}

    alive = {}

    def lookup(name):
        adapter = Heavy(name)
        alive[name] = weakref.ref(adapter.weights[(0, 0)][0])
        return adapter

    residency.lookup = residency.stager.lookup = lookup
    residency.pageable.budget = residency.pinned.budget = 2 * 32  # two staged copies of 32 bytes in each tier
    names = [f"a{index}" for index in range(6)]
    for name in names:
        residency.prepare([name])
        settle(residency)
    gc.collect()
    assert set(residency.prepared) == {"a4", "a5"} and residency._ready("a5") is not None
    assert [name for name in names if alive[name]() is not None] == ["a4", "a5"]
    assert set(residency._prepared_names) == {id(residency.prepared[name].weights) for name in ("a4", "a5")}
    residency.drop("a4")  # unregistered: forgotten at once
    assert set(residency.prepared) == {"a5"} and len(residency._prepared_names) == 1


def test_a_name_staged_again_keeps_its_new_copy_when_the_old_one_leaves(residency):
    residency.pageable.budget = residency.pinned.budget = 32  # one staged copy in each tier
    residency.prepare(["x"])
    settle(residency)
    first = residency.prepared["x"]
    residency.drop("x")  # replaced: its new weights are staged under a new key
    residency.prepare(["x"])
    settle(residency)
    second = residency.prepared["x"]
    assert second is not first
    residency.prepare(["y"])  # pushes the newest "x" out of both tiers
    settle(residency)
    assert "x" not in residency.prepared and residency._ready("y") is not None
