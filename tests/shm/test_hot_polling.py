"""Hot polling (shm/exchange.py's hot deadline, cpu_lora/worker.py): no job lost or served twice across
hot and cold periods, and a worker that dies while the pool is hot is still detected and replaced."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from lorad.cpu_lora.worker import WorkerPool
from lorad.shm.exchange import Exchange, ExchangeConfig
from lorad.shm.flags import Flag
from lorad.shm.segment import new_instance
from lorad.shm.store import AdapterStore


def test_heat_extends_and_expires():
    with Exchange.create(new_instance(), ExchangeConfig(workers=1, max_tokens=4, hidden=8, max_out=8)) as exchange:
        assert not exchange.is_hot
        exchange.poll_hot_for(0.05)
        assert exchange.is_hot
        until = exchange.hot.load()
        exchange.poll_hot_for(0.001)  # never shortens
        assert exchange.hot.load() == until
        time.sleep(0.06)
        assert not exchange.is_hot
        exchange.poll_hot_for(10)
        exchange.stop_hot_polling()
        assert not exchange.is_hot


def test_a_hot_wait_polls_and_still_times_out_and_checks_liveness():
    buffer = bytearray(16)
    flag, hot = Flag(buffer, 0), Flag(buffer, 8)
    hot.store(time.monotonic_ns() + int(10e9))
    calls = []
    with pytest.raises(TimeoutError):
        flag.wait(1, timeout_s=0.02, max_pause_s=1e-3, on_pause=lambda: calls.append(1), hot=hot)
    assert len(calls) >= 5  # the liveness check runs while polling hot


@pytest.fixture
def pool():
    hidden = 16
    generator = torch.Generator().manual_seed(0)
    adapter = SimpleNamespace(name="hot", weights={(0, 0): (torch.randn(2, hidden, generator=generator),
                                                            torch.randn(hidden, 2, generator=generator))})
    instance = new_instance()
    with AdapterStore.create(instance, 1 << 16) as store:
        adapter_id = store.put(adapter)
        with WorkerPool(1, store, 8, hidden, hidden, instance=instance, job_timeout_s=2.0) as pool:
            pool.hot_polling = True  # one worker and this thread may share cores in CI: polling is still correct
            yield pool, adapter_id, adapter.weights[(0, 0)]


def test_no_job_lost_or_duplicated_across_hot_and_cold(pool):
    pool, adapter_id, (a, b) = pool
    slot = pool.exchange.slots[0]
    for index in range(60):
        if index % 20 == 0:
            pool.poll_hot_for(0.05) if index % 40 == 0 else pool.stop_hot_polling()
        if index % 7 == 0:
            time.sleep(0.003)  # let a cold worker fall asleep
        x = torch.randn(3, 16)
        assert pool.run(adapter_id, 0, 0, [(0, 3)], 16, 16, x=x) == []
        assert torch.allclose(torch.from_numpy(pool.output[:3, :16]), x @ a.t() @ b.t(), rtol=1e-4, atol=1e-4)
        assert slot.done_flag.load() == slot.job_flag.load() == index + 1  # every job served exactly once


def test_a_worker_dying_while_hot_is_replaced(pool):
    pool, adapter_id, _ = pool
    pool.poll_hot_for(10)
    assert pool.run(adapter_id, 0, 0, [(0, 2)], 16, 16, x=torch.randn(2, 16)) == []
    os.kill(pool.exchange.slots[0].pid, signal.SIGKILL)
    time.sleep(0.05)
    failed = pool.run(adapter_id, 0, 0, [(0, 2)], 16, 16, x=torch.randn(2, 16))
    assert failed == [(0, 2)] and pool.restarts == 1  # a hot submit skips the exit check: the wait catches it
    assert pool.run(adapter_id, 0, 0, [(0, 2)], 16, 16, x=torch.randn(2, 16)) == []
    pool.stop_hot_polling()


def test_hot_polling_needs_a_core_for_every_poller():
    from lorad.cpu_lora.worker import can_poll_hot

    assert can_poll_hot(2, [0, 1], {0, 1, 2})  # the pool's default: workers on the first cores, one left
    assert not can_poll_hot(2, [0, 1], {0, 1})  # the caller would share a worker's core
    assert can_poll_hot(8, list(range(8)), set(range(8, 16)))  # the caller already keeps off the workers
    assert not can_poll_hot(3, [0, 1, 0], {0, 1, 2, 3})  # two workers pinned to one core
    assert can_poll_hot(2, [], {0, 1, 2}) and not can_poll_hot(3, [], {0, 1, 2})  # unpinned: count them
