"""CPU LoRA workers: results against the in-process product, pinning, failures reported and survived."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest
import torch

from lorad.cpu_lora.partition import profile_dispatch
from lorad.cpu_lora.worker import WorkerPool
from lorad.shm.exchange import Job
from lorad.shm.segment import creator_pid, lorad_segments, new_instance, pid_alive, sweep_stale
from lorad.shm.store import AdapterStore

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

HIDDEN, MAX_OUT, MAX_TOKENS = 96, 160, 64
# (layer, proj, rank, in, out): mixed ranks and shapes, as PEFT's rank_pattern allows.
MODULES = ((0, 0, 4, 96, 96), (0, 2, 16, 96, 32), (1, 3, 64, 96, 96), (1, 5, 8, 96, 160), (1, 6, 1, 80, 96))


@dataclass
class FakeAdapter:
    name: str
    weights: dict


def random_adapter(name: str, seed: int, rank_scale: int = 1) -> FakeAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer, proj, rank, in_features, out_features in MODULES:
        rank = max(1, rank // rank_scale)
        weights[(layer, proj)] = (
            torch.randn(rank, in_features, generator=generator),
            torch.randn(out_features, rank, generator=generator) / rank,
        )
    return FakeAdapter(name, weights)


@pytest.fixture
def store():
    with AdapterStore.create(new_instance(), 4 << 20) as store:
        for seed, (name, scale) in enumerate([("full", 1), ("half", 2), ("quarter", 4)]):
            store.put(random_adapter(name, seed, scale))
        yield store


@pytest.fixture
def pool(store):
    with WorkerPool(2, store, MAX_TOKENS, HIDDEN, MAX_OUT, job_timeout_s=5.0) as pool:
        yield pool


def expected(store: AdapterStore, name: str, layer: int, proj: int, x: torch.Tensor) -> torch.Tensor:
    a, b_t = store.get_views(name)[(layer, proj)]
    return x @ a.T @ b_t


def run_and_check(pool, store, name, layer, proj, tokens, ranges, seed):
    a, b_t = store.get_views(name)[(layer, proj)]
    in_features, out_features = a.shape[1], b_t.shape[1]
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(seed))
    failed = pool.run(store.adapter_id(name), layer, proj, ranges, in_features, out_features, x=x)
    assert failed == []
    got = torch.from_numpy(pool.output[:tokens, :out_features])
    torch.testing.assert_close(got, expected(store, name, layer, proj, x), rtol=1e-5, atol=1e-5)


def test_results_equal_the_in_process_product(pool, store):
    seed = 0
    for name in ("full", "half", "quarter"):
        for layer, proj, _, _, _ in MODULES:
            for tokens, ranges in ((37, [(0, 19), (19, 37)]), (64, [(0, 64)]), (1, [(0, 1)])):
                run_and_check(pool, store, name, layer, proj, tokens, ranges, seed)
                seed += 1
    assert pool.restarts == 0


def test_dispatch_cost_is_measured_through_the_pool(pool, store):
    dispatch_ms = profile_dispatch(pool, store.adapter_id("full"), 0, 0, 96, 96, repeats=20)
    assert 0 < dispatch_ms < 50  # a wake-up and two flags, not a pickled tensor


def test_workers_are_pinned_one_core_each(pool):
    cores = sorted(os.sched_getaffinity(0))
    for worker, process in enumerate(pool._processes):
        assert os.sched_getaffinity(process.pid) == {cores[worker % len(cores)]}


def test_a_bad_job_fails_alone(pool, store):
    full = store.adapter_id("full")
    assert pool.run(full + 100, 0, 0, [(0, 8)], 96, 96) == [(0, 8)]  # unknown adapter
    assert pool.run(full, 0, 0, [(0, 8), (8, 16)], 96, 32) == [(0, 8), (8, 16)]  # wrong shape
    assert pool.run(full, 0, 0, [(0, MAX_TOKENS + 1)], 96, 96) == [(0, MAX_TOKENS + 1)]  # past the rows
    assert pool.restarts == 0
    run_and_check(pool, store, "full", 0, 0, 16, [(0, 8), (8, 16)], seed=1)


def test_one_job_per_worker_at_a_time(pool, store):
    os.kill(pool._processes[0].pid, signal.SIGSTOP)
    job = Job(store.adapter_id("full"), 0, 0, 0, 8, 96, 96)
    seq = pool.submit(0, job)
    with pytest.raises(RuntimeError):
        pool.submit(0, job)  # it would overwrite the descriptor the worker may be reading
    os.kill(pool._processes[0].pid, signal.SIGCONT)
    assert pool.wait(0, seq) is True
    assert pool.wait(0, pool.submit(0, job)) is True


def test_a_killed_worker_is_detected_restarted_and_its_job_failed(pool, store):
    old_pid = pool._processes[0].pid
    os.kill(old_pid, signal.SIGSTOP)  # so that it cannot finish the job before it is killed
    seq = pool.submit(0, Job(store.adapter_id("full"), 0, 0, 0, 8, 96, 96))
    os.kill(old_pid, signal.SIGKILL)
    start = time.monotonic()
    assert pool.wait(0, seq) is False
    assert time.monotonic() - start < 1.0  # seen by the exit check, long before the 5 s job deadline
    assert pool.restarts == 1 and pool._processes[0].pid != old_pid
    assert not pid_alive(old_pid)
    run_and_check(pool, store, "half", 1, 3, 40, [(0, 20), (20, 40)], seed=2)  # the new worker serves
    assert pool.restarts == 1


def test_a_stalled_worker_misses_its_deadline_and_is_replaced(store):
    with WorkerPool(2, store, MAX_TOKENS, HIDDEN, MAX_OUT, job_timeout_s=0.3) as pool:
        stalled = pool._processes[1].pid
        os.kill(stalled, signal.SIGSTOP)
        start = time.monotonic()
        failed = pool.run(store.adapter_id("full"), 0, 0, [(0, 8), (8, 16)], 96, 96)
        assert failed == [(8, 16)]  # worker 0 did its half
        assert 0.3 <= time.monotonic() - start < 3.0
        assert pool.restarts == 1 and not pid_alive(stalled)
        pool._wait_ready(30)  # the replacement up first: a loaded host may start it past the 0.3 s job deadline
        run_and_check(pool, store, "full", 0, 0, 16, [(0, 8), (8, 16)], seed=3)


def test_check_replaces_dead_and_silent_idle_workers(store):
    with WorkerPool(2, store, MAX_TOKENS, HIDDEN, MAX_OUT, stall_s=0.2) as pool:
        assert pool.check() == 0
        dead, silent = pool._processes[0].pid, pool._processes[1].pid
        os.kill(dead, signal.SIGKILL)
        os.kill(silent, signal.SIGSTOP)
        deadline = time.monotonic() + 2.0
        replaced = 0
        while replaced < 2 and time.monotonic() < deadline:
            replaced += pool.check()
            time.sleep(0.05)
        assert replaced == 2 and pool.restarts == 2
        assert not pid_alive(dead) and not pid_alive(silent)
        time.sleep(0.3)
        assert pool.check() == 0  # healthy idle workers keep beating
        run_and_check(pool, store, "quarter", 1, 5, 30, [(0, 15), (15, 30)], seed=4)


def test_close_stops_workers_and_unlinks_the_exchange(store):
    pool = WorkerPool(2, store, MAX_TOKENS, HIDDEN, MAX_OUT, stop_timeout_s=0.3)
    name, processes = pool.exchange.name, list(pool._processes)
    pids = [process.pid for process in processes]
    os.kill(pids[1], signal.SIGSTOP)  # one that cannot take the stop job is killed
    pool.close()
    assert not any(pid_alive(pid) for pid in pids)
    assert name not in lorad_segments()
    pool.close()  # twice is fine


ENGINE = textwrap.dedent(
    """
    import sys, time
    from lorad.cpu_lora.worker import WorkerPool
    from lorad.shm.segment import new_instance
    from lorad.shm.store import AdapterStore
    store = AdapterStore.create(new_instance(), 1 << 20)
    pool = WorkerPool(2, store, 8, 8, 8)
    print(" ".join(str(p.pid) for p in pool._processes), flush=True)
    time.sleep(60)
    """
)


def test_workers_of_a_killed_engine_exit_and_its_segments_are_swept():
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE, text=True)
    try:
        worker_pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(worker_pids) == 2
        mine = [name for name in lorad_segments() if creator_pid(name) == engine.pid]
        assert len(mine) == 2  # the store and the exchange
    finally:
        engine.kill()
        engine.wait(10)
        engine.stdout.close()
    deadline = time.monotonic() + 5.0
    while any(pid_alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(pid_alive(pid) for pid in worker_pids)
    assert sorted(sweep_stale(prefix=f"/lorad-{engine.pid}x")) == sorted(mine)
