"""The shared adapter store: put, views, first-fit reuse, index read by attaching, other processes."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from lorad.shm.segment import new_instance
from lorad.shm.store import AdapterStore, StoreFull

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

fork = multiprocessing.get_context("fork")


@dataclass
class FakeAdapter:
    name: str
    weights: dict


def random_adapter(name, seed, modules=((0, 0, 4, 24, 24), (0, 2, 8, 24, 12), (1, 6, 2, 40, 24))):
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer, proj, rank, in_features, out_features in modules:
        a = torch.randn(rank, in_features, generator=generator)
        b = torch.randn(out_features, rank, generator=generator)
        weights[(layer, proj)] = (a, b)
    return FakeAdapter(name, weights)


def test_put_and_views_hold_a_and_b_transposed():
    adapter = random_adapter("alpha", 0)
    with AdapterStore.create(new_instance(), 1 << 20) as store:
        adapter_id = store.put(adapter)
        assert store.adapter_id("alpha") == adapter_id and store.names() == ["alpha"]
        views = store.get_views("alpha")
        assert set(views) == set(adapter.weights)
        for key, (a, b) in adapter.weights.items():
            stored_a, stored_bt = views[key]
            assert torch.equal(stored_a, a) and torch.equal(stored_bt, b.T)
            assert stored_a.data_ptr() % 64 == 0 and stored_bt.data_ptr() % 64 == 0
        assert store.lookup(adapter_id, 1, 6)[0].shape == (2, 40)
        with pytest.raises(KeyError):
            store.lookup(adapter_id, 5, 0)
        del views, stored_a, stored_bt


def test_a_shared_a_is_stored_once():
    # Phi-3's qkv_proj as q, k, v: one A tensor for the three, each B its own
    generator = torch.Generator().manual_seed(3)
    shared = torch.randn(4, 24, generator=generator)
    weights = {(0, proj): (shared, torch.randn(8, 4, generator=generator)) for proj in (0, 1, 2)}
    copies = {key: (a.clone(), b) for key, (a, b) in weights.items()}
    with AdapterStore.create(new_instance(), 1 << 20) as store:
        store.put(FakeAdapter("shared", weights))
        store.put(FakeAdapter("copies", copies))
        views = store.get_views("shared")
        assert len({views[(0, proj)][0].data_ptr() for proj in (0, 1, 2)}) == 1
        for key, (a, b) in weights.items():
            assert torch.equal(views[key][0], a) and torch.equal(views[key][1], b.T)
        assert store._index["adapters"]["shared"]["size"] < store._index["adapters"]["copies"]["size"]
        del views


def test_first_fit_reuses_freed_blocks_and_reports_full():
    with AdapterStore.create(new_instance(), 64 << 10) as store:
        first = store.put(random_adapter("a", 1))
        store.put(random_adapter("b", 2))
        free = store.free_bytes()
        store.remove("a")
        assert store.free_bytes() > free
        third = store.put(random_adapter("c", 3))
        assert store.get_views("c")[(0, 0)][0].data_ptr() == store.segment.array(store.data_offset, 1, np.float32).ctypes.data
        assert third != first  # ids are never reused
        with pytest.raises(KeyError):
            store.get_views(first)
        big = random_adapter("big", 4, modules=((0, 0, 64, 512, 512),))
        with pytest.raises(StoreFull):
            store.put(big)
        assert store.names() == ["b", "c"]  # a failed put changes nothing
        store.remove("b")
        store.remove("c")
        assert store.free_bytes() == 64 << 10  # coalesced back into one block
        assert store._free == [(store.data_offset, 64 << 10)]


def test_replacing_an_adapter_gives_a_new_id():
    with AdapterStore.create(new_instance(), 1 << 20) as store:
        old = store.put(random_adapter("a", 1))
        new = store.put(random_adapter("a", 2))
        assert new != old and store.names() == ["a"]
        assert torch.equal(store.get_views("a")[(0, 0)][0], random_adapter("a", 2).weights[(0, 0)][0])


def test_a_full_index_is_refused():
    with AdapterStore.create(new_instance(), 1 << 20, index_bytes=256) as store:
        store.put(random_adapter("a", 1, modules=((0, 0, 1, 8, 8),)))
        with pytest.raises(StoreFull):
            for n in range(20):
                store.put(random_adapter(f"n{n}", n, modules=((0, 0, 1, 8, 8),)))
        assert "a" in store.names()


def _read_store(name, replies, go):
    store = AdapterStore.attach(name)
    try:
        replies.put({store.adapter_id(n): {key: (a.numpy().copy(), bt.numpy().copy())
                     for key, (a, bt) in store.get_views(n).items()} for n in store.names()})
        go.get(timeout=20)  # the owner has changed the store meanwhile
        replies.put(store.names())
        with pytest.raises(PermissionError):
            store.put(random_adapter("x", 9))
    finally:
        store.close()


def test_another_process_reads_the_index_by_attaching():
    adapters = [random_adapter("alpha", 1), random_adapter("beta", 2)]
    with AdapterStore.create(new_instance(), 1 << 20) as store:
        ids = [store.put(adapter) for adapter in adapters]
        replies, go = fork.Queue(), fork.Queue()
        child = fork.Process(target=_read_store, args=(store.name, replies, go))
        child.start()
        seen = replies.get(timeout=20)
        for adapter_id, adapter in zip(ids, adapters):
            for key, (a, b) in adapter.weights.items():
                assert np.array_equal(seen[adapter_id][key][0], a.numpy())
                assert np.array_equal(seen[adapter_id][key][1], b.T.numpy())
        store.put(random_adapter("gamma", 3))
        store.remove("alpha")
        go.put("go")
        assert replies.get(timeout=20) == ["beta", "gamma"]
        child.join(20)
        assert child.exitcode == 0


def _read_while_rewritten(name, queue):
    store = AdapterStore.attach(name)
    reads = errors = 0
    try:
        while reads < 100_000:
            try:
                for adapter in store.names():
                    store.get_views(adapter)
            except KeyError:
                pass  # removed between names() and get_views(): allowed
            except Exception:
                errors += 1
            reads += 1
            if store.segment.array(store.data_offset, 1, np.float32)[0] == -1:
                break
    finally:
        store.close()
    queue.put((reads, errors))


def test_readers_never_see_a_half_written_index():
    with AdapterStore.create(new_instance(), 1 << 20) as store:
        queue = fork.Queue()
        child = fork.Process(target=_read_while_rewritten, args=(store.name, queue))
        child.start()
        for n in range(300):
            store.put(random_adapter(f"a{n % 7}", n))
            if n % 3 == 0:
                store.remove(f"a{n % 7}")
        for name in store.names():
            store.remove(name)
        store.segment.array(store.data_offset, 1, np.float32)[0] = -1  # tells the reader to stop
        reads, errors = queue.get(timeout=20)
        child.join(20)
        assert child.exitcode == 0 and reads > 0 and errors == 0
