"""Which adapters have their weights in the page pool, and which may leave.

An adapter is pinned while requests that use it run; unpinned resident adapters stay (a warm cache)
until the pool needs their pages for KV or for another adapter, least recently used first.

A cold adapter is placed at admission, in one copy as ondemand does, or layer by layer where the
engine's `layerwise_for` (cold_start cpu|auto) says so for the request admitted (its adapter, tier and
first step's tokens): where its prefill is to be cpu-assisted. A layer-wise copy does not make the
compute stream wait at once: its `LayerwiseLoad` stays in `loading` until the engine decides the
request's cold start: a cpu-assisted prefill lets each layer take over from the CPU as it arrives
(daemon/cpu_assist.py); everything else `join`s first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from lorad.gpu_ops.page_pool import AdapterTable, LayerwiseLoad, StagedAdapter

log = logging.getLogger(__name__)


class LoraResidency:
    def __init__(self, lookup, table: AdapterTable, metrics=None, pinned_bytes: int = 4 << 30):
        self.lookup = lookup  # name -> LoraAdapter (host copy)
        self.table = table
        self.pinned: OrderedDict[int, tuple] = OrderedDict()  # staged adapters in pinned host memory
        self.pinned_bytes = pinned_bytes
        self.pinned_used = 0
        self.metrics = metrics  # daemon/metrics.py's Metrics, or None
        self.slots: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned, oldest first
        self.permanent: set[str] = set()  # placed by preload (cold_start="cached"): pinned until dropped
        # (name, tier) of the adapters acquire() placed since the engine last cleared it: the requests
        # admitted with them found them cold. tier: "host" (the CPU pool), "pinned" or "pageable".
        self.admitted_cold: list[tuple[str, str]] = []
        # (adapter, tier, tokens of its first step or None) -> whether this cold placement is layer-wise
        # (see the module's note); None: never.
        self.layerwise_for: Callable[[object, str, int | None], bool] | None = None
        self.loading: dict[str, LayerwiseLoad] = {}  # layer-wise copies the compute stream has not joined
        self.loads = 0
        self.prefetches = 0
        self.evictions = 0

    def acquire(self, name: str | None, tokens: int | None = None) -> bool:
        """Resident and pinned, or False (not now). `tokens`: the admitted request's first step, for the
        choice of placement when the adapter is cold."""
        if name is None:
            return True
        if name in self.slots:
            self.pins[name] += 1
            self.idle.pop(name, None)
            return True
        adapter = self.lookup(name)
        slot = self.table.free_slot()
        while slot is None:
            if not self.idle:
                return False
            self._evict_oldest()
            slot = self.table.free_slot()
        started = time.perf_counter()
        staged, tier = self._staged(adapter)
        layerwise = self.layerwise_for is not None and self.layerwise_for(adapter, tier, tokens)
        while not self._place(name, slot, staged, layerwise):
            if not self.idle:
                return False
            self._evict_oldest()
        self.loads += 1
        seconds = time.perf_counter() - started
        if self.metrics is not None:  # the request being admitted waited for this load: a cold start
            self.metrics.adapter_loaded("host_to_pool", seconds)
            self.metrics.cold_start()
        log.info("adapter resident name=%s slot=%d ms=%.2f", name, slot, seconds * 1e3)
        self.slots[name] = slot
        self.pins[name] = 1
        self.admitted_cold.append((name, tier))
        return True

    def _place(self, name: str, slot: int, staged: StagedAdapter, layerwise: bool) -> bool:
        if not layerwise:
            return self.table.place(slot, staged)
        load = self.table.place_layerwise(slot, staged)
        if load is None:
            return False
        self.loading[name] = load
        return True

    def join(self, names=None) -> None:
        """The compute stream waits for the layer-wise copies of `names` (default: all of them); then
        any kernel may read those adapters. Enqueues waits only: the host never blocks."""
        for name in list(self.loading) if names is None else names:
            load = self.loading.pop(name, None)
            if load is not None:
                load.join()

    def preload(self, name: str) -> bool:
        """Places an adapter for good (cold_start="cached"): pinned by the engine itself, so never
        evicted until `drop`. False if it does not fit. Not counted as a request's cold start."""
        metrics, self.metrics = self.metrics, None
        try:
            if not self.acquire(name):
                return False
        finally:
            self.metrics = metrics
        self.admitted_cold.clear()
        self.join([name])
        self.permanent.add(name)
        return True

    def _staged(self, adapter) -> tuple[StagedAdapter, str]:
        """The adapter in page layout and the tier it came from; on cuda kept pinned (keyed by its
        weights, which benchmark adapters share) within `pinned_bytes`, least recently used dropped first."""
        if not self.table.pool.pages.is_cuda:
            return self.table.stage(adapter.weights), "host"
        key = id(adapter.weights)
        if key in self.pinned:
            self.pinned.move_to_end(key)
            return self.pinned[key][1], "pinned"
        staged = self.table.stage(adapter.weights)
        self.pinned[key] = (adapter.weights, staged)  # holding the weights keeps the id unique
        self.pinned_used += staged.pages.nbytes
        while self.pinned_used > self.pinned_bytes and len(self.pinned) > 1:
            _, (_, dropped) = self.pinned.popitem(last=False)
            self.pinned_used -= dropped.pages.nbytes
        return staged, "pageable"

    def prefetch(self, name: str, reserve_pages: int) -> bool:
        """Loads a queued request's adapter into free pages while the current step runs, evicting
        nothing and leaving `reserve_pages` free for KV growth. It waits idle until admitted."""
        if name in self.slots:
            return True
        slot = self.table.free_slot()
        if slot is None:
            return False
        staged, _ = self._staged(self.lookup(name))
        if self.table.pool.num_free - staged.pages.shape[0] < reserve_pages or not self.table.place(slot, staged):
            return False
        self.loads += 1
        self.prefetches += 1
        self.slots[name] = slot
        self.pins[name] = 0
        self.idle[name] = None
        return True

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self.pins[name] -= 1
        if self.pins[name] == 0:
            self.idle[name] = None

    def reclaim(self, pages: int) -> bool:
        """Evicts idle adapters until `pages` pool pages are free; False if that is not possible."""
        while self.table.pool.num_free < pages and self.idle:
            self._evict_oldest()
        return self.table.pool.num_free >= pages

    def slot(self, name: str | None) -> int:
        return -1 if name is None else self.slots[name]

    def drop(self, name: str) -> None:
        """Forget an idle adapter's pool copy (it was unregistered or replaced)."""
        if name in self.permanent:
            self.permanent.discard(name)
            self.release(name)
        if name in self.idle:
            self.idle.pop(name)
            self._evict(name)

    def _evict_oldest(self) -> None:
        name, _ = self.idle.popitem(last=False)
        self._evict(name)

    def _evict(self, name: str) -> None:
        self.join([name])  # its copy is ordered before the pages go to another owner
        self.table.evict(self.slots.pop(name))
        del self.pins[name]
        self.evictions += 1
        log.debug("adapter evicted name=%s", name)
