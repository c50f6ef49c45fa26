"""Split groups: every worker on all of a prompt's rows, each with a chunk of A's input columns and
of B's output columns, meeting at a barrier in shared memory (shm/exchange.py, cpu_lora/worker.py)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from lorad.cpu_lora.worker import WorkerPool
from lorad.shm.exchange import CHUNK_ALIGN, Exchange, ExchangeConfig, Job, chunk
from lorad.shm.segment import new_instance
from lorad.shm.store import AdapterStore

from test_worker import HIDDEN, MAX_OUT, MAX_TOKENS, MODULES, expected, random_adapter, run_and_check

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py


@pytest.fixture
def store():
    with AdapterStore.create(new_instance(), 4 << 20) as store:
        for seed, (name, scale) in enumerate([("full", 1), ("half", 2)]):
            store.put(random_adapter(name, seed, scale))
        yield store


def make_pool(store, workers=3, **kwargs):
    return WorkerPool(workers, store, MAX_TOKENS, HIDDEN, MAX_OUT, max_rank=64, **kwargs)


def run_group_and_check(pool, store, name, layer, proj, rows, parts, seed):
    a, b_t = store.get_views(name)[(layer, proj)]
    in_features, out_features = a.shape[1], b_t.shape[1]
    start, end = rows
    x = torch.randn(end, in_features, generator=torch.Generator().manual_seed(seed))
    assert pool.run_split(store.adapter_id(name), layer, proj, rows, parts, in_features, out_features, x=x)
    got = torch.from_numpy(pool.output[start:end, :out_features])
    torch.testing.assert_close(got, expected(store, name, layer, proj, x[start:end]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [1, 15, 16, 17, 32, 80, 96, 160, 4096, 11008])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_chunks_cover_the_dimension_in_aligned_disjoint_pieces(size, parts):
    pieces = [chunk(size, parts, part) for part in range(parts)]
    assert pieces[0][0] == 0 and pieces[-1][1] == size
    assert all(end == next_start for (_, end), (next_start, _) in zip(pieces, pieces[1:]))
    assert all(start % CHUNK_ALIGN == 0 or start == size for start, _ in pieces)


def test_split_descriptors_round_trip_through_the_exchange():
    config = ExchangeConfig(workers=3, max_tokens=8, hidden=16, max_out=16, ring=4, max_rank=8)
    with Exchange.create(new_instance(), config) as exchange:
        exchange.post_batch(np.array([1, 1, 1]), 5, 2, 3, np.zeros(3, np.int64), np.full(3, 7, np.int64), 16, 16, group=9)
        for worker, slot in enumerate(exchange.slots):
            assert slot.take(1) == Job(5, 2, 3, 0, 7, 16, 16, 0, worker, 3, 9)
        exchange.post_batch(np.array([2, 2]), 5, 2, 3, np.array([0, 4]), np.array([4, 8]), 16, 16)
        assert exchange.slots[1].take(2) == Job(5, 2, 3, 4, 8, 16, 16)  # a plain job again: splits 1
        assert exchange.partials.shape == (3, 8, 8)
        with Exchange.attach(exchange.name) as attached:
            assert attached.config == config


def test_groups_equal_the_in_process_product_and_mix_with_token_splits(store):
    with make_pool(store) as pool:
        seed = 0
        for name in ("full", "half"):
            for layer, proj, _, _, _ in MODULES:  # ranks 1..64; widths 32..160 (chunks may be empty)
                for rows, parts in (((0, 37), 3), ((5, 64), 2), ((0, 1), 3)):
                    run_group_and_check(pool, store, name, layer, proj, rows, parts, seed)
                    seed += 1
                # a token split between groups: the partial buffers and the group ids carry on
                run_and_check(pool, store, name, layer, proj, 30, [(0, 10), (10, 20), (20, 30)], seed)
        assert pool.restarts == 0


def test_a_part_that_fails_voids_the_group_fast_and_the_pool_goes_on(store):
    with make_pool(store, workers=2, job_timeout_s=5.0) as pool:
        full = store.adapter_id("full")
        x = torch.randn(8, 96)
        start = time.monotonic()
        # rank 64 fits; an unknown adapter fails in both parts before either computes
        assert not pool.run_split(full + 100, 0, 0, (0, 8), 2, 96, 96, x=x)
        assert time.monotonic() - start < 2.0
        assert pool.restarts == 0
        run_group_and_check(pool, store, "full", 1, 3, (0, 8), 2, seed=1)


def test_a_rank_past_the_partial_buffers_fails_the_group(store):
    with WorkerPool(2, store, MAX_TOKENS, HIDDEN, MAX_OUT, max_rank=8) as pool:
        assert not pool.run_split(store.adapter_id("full"), 1, 3, (0, 8), 2, 96, 96, x=torch.randn(8, 96))  # rank 64
        run_group_and_check(pool, store, "full", 1, 5, (0, 8), 2, seed=2)  # rank 8
        assert pool.restarts == 0


def test_a_killed_part_is_replaced_and_the_next_group_is_right(store):
    with make_pool(store, workers=2, job_timeout_s=5.0) as pool:
        run_group_and_check(pool, store, "full", 0, 0, (0, 16), 2, seed=3)
        victim = pool._processes[1].pid
        os.kill(victim, signal.SIGSTOP)
        full = store.adapter_id("full")
        count = pool.post(full, 0, 0, np.zeros(2, np.int64), np.full(2, 16, np.int64), 96, 96, split=True)
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        assert pool.wait_posted(count) != []  # the group is void: part 1 died
        assert time.monotonic() - start < 3.0  # part 0 is released by the replacement, not a timeout
        assert pool.restarts == 1
        for seed in range(4, 7):  # the new worker takes its part in later groups, and the results hold
            run_group_and_check(pool, store, "half", 1, 3, (0, 16), 2, seed)


def test_a_stalled_part_fails_its_group_within_the_barrier_wait(store):
    with make_pool(store, workers=2, job_timeout_s=0.6) as pool:
        stalled = pool._processes[1].pid
        os.kill(stalled, signal.SIGSTOP)
        start = time.monotonic()
        assert not pool.run_split(store.adapter_id("full"), 0, 0, (0, 8), 2, 96, 96, x=torch.randn(8, 96))
        assert time.monotonic() - start < 3.0
        assert pool.restarts == 1  # the stalled worker, past the job deadline; part 0 gave up at 0.3 s
        pool._wait_ready(30)  # the replacement up first: a loaded host may start it past the 0.6 s job deadline
        run_group_and_check(pool, store, "full", 0, 0, (0, 8), 2, seed=8)


def test_a_split_group_needs_two_workers_and_partial_buffers(store):
    with WorkerPool(2, store, MAX_TOKENS, HIDDEN, MAX_OUT) as pool:  # max_rank 0
        with pytest.raises(ValueError):
            pool.run_split(store.adapter_id("full"), 0, 0, (0, 8), 2, 96, 96)
    with make_pool(store, workers=2) as pool:
        with pytest.raises(ValueError):
            pool.run_split(store.adapter_id("full"), 0, 0, (0, 8), 3, 96, 96)
