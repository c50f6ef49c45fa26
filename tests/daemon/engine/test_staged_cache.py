"""daemon/engine/adapter_residency.py's StagedCache: the pinned and pageable tiers of staged adapters, least recently
used dropped first beyond the byte budget, the newest always kept."""

from __future__ import annotations

import torch

from lorad.daemon.engine.adapter_residency import StagedCache
from lorad.gpu_ops.page_pool import StagedAdapter


def staged(pages: int) -> StagedAdapter:
    return StagedAdapter(torch.zeros(pages, 8, dtype=torch.float32), [])  # 32 bytes a page


def test_least_recently_used_leave_first_and_the_budget_holds():
    cache = StagedCache(budget=3 * 32 * 10)
    for key in range(3):
        cache.put(key, object(), staged(10))
    assert cache.used == 960 and len(cache) == 3
    assert cache.get(0) is not None  # 0 is now the most recent: 1 leaves first
    cache.put(3, object(), staged(10))
    assert 1 not in cache and {0, 2, 3} == set(cache.entries) and cache.used == 960
    assert cache.get(1) is None


def test_the_newest_stays_even_over_budget_and_a_zero_budget_keeps_one():
    cache = StagedCache(budget=0)
    cache.put("a", object(), staged(4))
    assert "a" in cache and cache.used == 128
    cache.put("b", object(), staged(4))
    assert list(cache.entries) == ["b"] and cache.used == 128


def test_drop_oldest_and_a_key_put_again_counted_once():
    cache = StagedCache(budget=1 << 20)
    cache.put("a", None, staged(4))
    cache.put("b", None, staged(4))
    cache.put("a", None, staged(2))  # replaced, and now the most recent
    assert cache.used == 192 and list(cache.entries) == ["b", "a"]
    assert cache.drop_oldest() and list(cache.entries) == ["a"] and cache.used == 64
    assert cache.drop_oldest() and cache.used == 0 and not cache.drop_oldest()
