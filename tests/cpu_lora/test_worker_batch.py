"""The batched invocation (WorkerPool.post / wait_posted, what `run` uses): results with 8 workers at
diverging seqs, a dead or stalled worker among 8, and the host's cost flat in the number of workers."""

from __future__ import annotations

import os
import signal
import statistics
import time

import numpy as np
import pytest
from lorad.cpu_lora.worker import WorkerPool
from lorad.shm.segment import new_instance, pid_alive
from lorad.shm.store import AdapterStore
from test_worker import HIDDEN, MAX_OUT, MAX_TOKENS, random_adapter, run_and_check

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

WORKERS = 8


@pytest.fixture
def store():
    with AdapterStore.create(new_instance(), 4 << 20) as store:
        store.put(random_adapter("full", 0))
        yield store


def eight_ranges(tokens: int = 40) -> list[tuple[int, int]]:
    step = tokens // WORKERS
    return [(w * step, (w + 1) * step) for w in range(WORKERS)]


def test_eight_workers_at_diverging_seqs(store):
    with WorkerPool(WORKERS, store, MAX_TOKENS, HIDDEN, MAX_OUT) as pool:
        for seed, ranges in enumerate([eight_ranges(), [(0, 5), (5, 9), (9, 30)], [(0, 3)], eight_ranges(64)]):
            run_and_check(pool, store, "full", 1, 3, ranges[-1][1], ranges, seed)
        assert pool.exchange.done_flags.tolist() == pool.exchange.job_flags.tolist() == [4, 3, 3, 2, 2, 2, 2, 2]
        assert pool.restarts == 0


def test_a_dead_worker_among_eight_fails_its_job_alone(store):
    with WorkerPool(WORKERS, store, MAX_TOKENS, HIDDEN, MAX_OUT, job_timeout_s=5.0) as pool:
        dead = pool._processes[5].pid
        os.kill(dead, signal.SIGSTOP)  # it cannot finish its job before it is killed
        count = pool.post(store.adapter_id("full"), 0, 0, np.arange(8) * 4, np.arange(1, 9) * 4, 96, 96)
        os.kill(dead, signal.SIGKILL)
        start = time.monotonic()
        assert pool.wait_posted(count) == [5]
        assert time.monotonic() - start < 1.0  # the liveness check, long before the 5 s deadline
        assert pool.restarts == 1 and not pid_alive(dead)
        run_and_check(pool, store, "full", 0, 0, 40, eight_ranges(), seed=1)


def test_stalled_workers_among_eight_miss_the_deadline(store):
    with WorkerPool(WORKERS, store, MAX_TOKENS, HIDDEN, MAX_OUT, job_timeout_s=0.3) as pool:
        stalled = [pool._processes[2].pid, pool._processes[6].pid]
        for pid in stalled:
            os.kill(pid, signal.SIGSTOP)
        ranges = eight_ranges()
        start = time.monotonic()
        assert pool.run(store.adapter_id("full"), 0, 0, ranges, 96, 96) == [ranges[2], ranges[6]]
        assert 0.3 <= time.monotonic() - start < 3.0
        assert pool.restarts == 2 and not any(pid_alive(pid) for pid in stalled)
        pool._wait_ready(30)  # the replacements up first: a loaded host may start them past the 0.3 s job deadline
        run_and_check(pool, store, "full", 0, 0, 40, ranges, seed=2)


def host_cost_us(store, workers: int, reps: int = 3000) -> float:
    """Median host time of one `run` (post + wait) with instantly answering done flags: the workers
    are stopped and their done flags preset far ahead, so every wait returns at its first look."""
    with WorkerPool(workers, store, MAX_TOKENS, HIDDEN, MAX_OUT, stop_timeout_s=0.05) as pool:
        for process in pool._processes:
            os.kill(process.pid, signal.SIGSTOP)
        pool.exchange.done_flags[:] = 1 << 60
        pool.hot_polling = True
        pool.poll_hot_for(600)  # as the engine runs it: no liveness syscall per job
        ranges, adapter_id, times = [(4 * w, 4 * w + 4) for w in range(workers)], store.adapter_id("full"), []
        for _ in range(reps):
            begun = time.perf_counter_ns()
            failed = pool.run(adapter_id, 0, 0, ranges, 96, 96)
            times.append(time.perf_counter_ns() - begun)
            assert failed == []
        pool.stop_hot_polling()
    return statistics.median(times[reps // 10 :]) / 1e3


def test_host_cost_is_flat_in_the_number_of_workers(store):
    costs = {workers: host_cost_us(store, workers) for workers in (1, 2, 4, 8)}
    print("host post+wait median us by workers:", {w: round(us, 2) for w, us in costs.items()})
    assert costs[8] < 2 * costs[2]  # flat: posting and waiting per worker in Python (~5 us each) would give 2.6x at 8
