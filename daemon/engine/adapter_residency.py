"""Which adapters have their weights in the page pool, and which may leave.

An adapter is pinned while requests that use it run; unpinned resident adapters stay (a warm cache)
until the pool needs their pages for KV or for another adapter, least recently used first.

A cold adapter is placed at admission as the engine's `placement_for` (cold_start cpu|auto) says for the
request admitted (its adapter, tier and first step's tokens):
- "whole": in one copy that the compute stream waits for, as ondemand does;
- "layerwise": layer by layer with an event per layer, for a prefill that is to be cpu-assisted: its
  `LayerwiseLoad` stays in `loading` until the engine decides the request's cold start, and each layer
  takes over from the CPU as it arrives (daemon/engine/cpu_assist.py);
- "stream": layer by layer while the prefill runs on the GPU, its LoRA kernels waiting on the device for
  each layer (`AdapterTable.place_streamed`): the engine issues the copies right after launching the
  forward, and the `StreamedLoad` stays in `loading` until that step has been sampled.

On cuda, the host's part of a cold load (reading the adapter from disk, laying it out in pages, pinning it) runs
on background threads (`Stager`) for the adapters of the first queued requests (`prepare`), so the engine
thread finds them staged; an adapter admitted before its staging is done waits while other rows run (`_defer`),
else is staged on the engine thread, once: a staging a stager thread has begun is waited for (`_take_over`).

A queued request's cold adapter may be placed before its admission (`prefetch`, while a step runs): whole,
or, where its placement would be "stream", streamed ahead. A streamed-ahead copy waits in `ahead` and the
engine queues its layers while the host would otherwise only wait for the device (`issue_ahead`); at
admission it moves to `loading` as a streamed cold start whose first layers are already in.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from lorad.daemon.engine.step_account import pin_clock
from lorad.gpu_ops.page_pool import AdapterTable, LayerwiseLoad, StagedAdapter, StreamedLoad, issue_streamed
from lorad.gpu_ops.pinned_arena import PinnedArena

PLACEMENTS = ("whole", "layerwise", "stream")
RESIDENCY_WORK = ("lookup", "stage", "pin", "place", "evict")  # LoraResidency.host_s

log = logging.getLogger(__name__)


class LoraResidency:
    def __init__(self, lookup, table: AdapterTable, metrics=None, pinned_bytes: int = 4 << 30,
                 staged_bytes: int = 8 << 30, stager_threads: int | None = None):
        self.lookup = lookup  # name -> LoraAdapter (host copy)
        self.table = table
        self.pinned = StagedCache(pinned_bytes)  # cuda: staged adapters in pinned host memory (`arena`)
        self.pageable = StagedCache(staged_bytes)  # cuda: every staged adapter, in pageable host memory
        self.metrics = metrics  # daemon/engine/stats.py's Metrics, or None
        self.slots: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned, oldest first
        # -> each adapter the queued requests need, with the place of the first that needs it (the engine's queue,
        # looked at when an idle adapter must make room: `_evict_idle`); None: none known
        self.next_use: Callable[[], dict[str, int]] | None = None
        self.permanent: set[str] = set()  # placed by preload (cold_start="cached"): pinned until dropped
        # (name, tier) of the adapters acquire() placed since the engine last cleared it: the requests
        # admitted with them found them cold. tier: "host" (the CPU pool), "pinned" or "pageable".
        self.admitted_cold: list[tuple[str, str]] = []
        # (adapter, tier, tokens of its first step or None) -> how this cold adapter is placed, one of
        # PLACEMENTS (see the module's note); None: always "whole".
        self.placement_for: Callable[[object, str, int | None], str] | None = None
        self.loading: dict[str, LayerwiseLoad | StreamedLoad] = {}  # copies the compute stream has not joined
        # streamed ahead for a queued request (prefetch): name -> (its copy, the tier it comes from); no
        # kernel reads these slots until acquire() moves them to `loading`
        self.ahead: dict[str, tuple[StreamedLoad, str]] = {}
        # cuda: the background stager, whose staged adapters go into `pinned` and `pageable`; and name -> the key of
        # its last staged copy (`staging_key`), so that `prepare` and `prefetch` learn whether a queued request's
        # adapter is staged without looking it up (a tensor-parallel lookup shards the adapter on this thread)
        self.stager = Stager(lookup, self._stage_off_thread, stager_threads) if table.pool.pages.is_cuda else None
        # cuda: the pinned memory of `pinned`'s entries, pinned once here (gpu_ops/pinned_arena.py)
        self.arena = _pin_arena(pinned_bytes, table) if table.pool.pages.is_cuda and pinned_bytes > 0 else None
        self.pinned_misses = 0  # adapters within the pinned budget left pageable: no range of the arena was free
        self._keys: dict[str, Hashable] = {}
        self.generation: dict[str, int] = {}  # bumped when a name is dropped: a staging begun before is stale
        self.staged_off_thread = 0  # adapters the stager staged that the engine thread took
        # cuda: whether an admission whose adapter the stager has not staged yet waits for it (`_defer`): set by the
        # engine, true while it has running rows to step meanwhile; names waiting so, how many adapters ever did, and
        # names whose background staging failed (their admission stages on the caller's thread and meets the error)
        self.defer_unstaged: Callable[[], bool] | None = None
        self.deferred: set[str] = set()
        self.admissions_deferred = 0
        self._stage_failed: set[str] = set()
        self.placed = dict.fromkeys(PLACEMENTS, 0)  # cold placements by kind
        self.issue_seconds = 0.0  # host time spent issuing streamed copies after their forward's launch
        self.ahead_seconds = 0.0  # host time spent issuing streamed-ahead copies (while a step ran)
        self.ahead_layers = 0  # layers queued ahead of their request's admission
        self.loads = 0
        self.prefetches = 0
        self.streamed_ahead = 0  # prefetches streamed ahead
        self.evictions = 0
        # the engine thread's time in the work that may hold it (the step log's residency_ms, per step): looking
        # adapters up, staging one here, pinning a pageable copy, placing copies into the pool, evicting
        self.host_s = dict.fromkeys(RESIDENCY_WORK, 0.0)

    def acquire(self, name: str | None, tokens: int | None = None) -> bool:
        """Resident and pinned, or False (not now). `tokens`: the admitted request's first step, for the
        choice of placement when the adapter is cold."""
        if name is None:
            return True
        if name in self.slots:
            self.pins[name] += 1
            self.idle.pop(name, None)
            if name in self.ahead:  # still streaming in: a cold start whose first layers are in already
                load, tier = self.ahead.pop(name)
                self.loading[name] = load
                self.admitted_cold.append((name, tier))
                if self.metrics is not None:
                    self.metrics.cold_start()
            return True
        self._absorb()
        started = time.perf_counter()
        adapter = self.lookup(name)
        self.host_s["lookup"] += time.perf_counter() - started
        if not self._is_staged(adapter):
            if self._defer(name):
                return False
            self._take_over(name)
        self.deferred.discard(name)
        slot = self.table.free_slot()
        uses = None
        while slot is None:
            if not self.idle:
                return False
            uses = self._evict_idle(uses)
            slot = self.table.free_slot()
        started = time.perf_counter()
        staged, tier = self._staged(name, adapter)
        kind = "whole" if self.placement_for is None else self.placement_for(adapter, tier, tokens)
        placing = time.perf_counter()
        while not self._place(name, slot, staged, kind):
            if not self.idle:
                self.host_s["place"] += time.perf_counter() - placing
                return False
            uses = self._evict_idle(uses)
        self.host_s["place"] += time.perf_counter() - placing
        self.loads += 1
        self.placed[kind] += 1
        seconds = time.perf_counter() - started
        if self.metrics is not None:  # the request being admitted waited for this load: a cold start
            self.metrics.adapter_loaded("host_to_pool", seconds)
            self.metrics.cold_start()
        log.info("adapter resident name=%s slot=%d ms=%.2f", name, slot, seconds * 1e3)
        self.slots[name] = slot
        self.pins[name] = 1
        self.admitted_cold.append((name, tier))
        return True

    def staging(self, name: str | None) -> bool:
        """Was `name`'s last acquire refused because its admission waits for the stager (`_defer`)? It becomes ready
        by itself, so the scheduler passes its request over for those behind it meanwhile."""
        return name in self.deferred

    def _place(self, name: str, slot: int, staged: StagedAdapter, kind: str) -> bool:
        if kind == "whole":
            return self.table.place(slot, staged)
        if kind == "stream":
            load = self.table.place_streamed(slot, staged)
        elif kind == "layerwise":
            load = self.table.place_layerwise(slot, staged)
        else:
            raise ValueError(f"unknown placement {kind!r}")
        if load is None:
            return False
        self.loading[name] = load
        return True

    def join(self, names=None) -> None:
        """The compute stream waits for the layer-wise and streamed copies of `names` (default: all of
        them); then any kernel may read those adapters. Enqueues waits only (a streamed copy not yet issued
        is issued first)."""
        for name in list(self.loading) if names is None else names:
            load = self.loading.pop(name, None)
            if load is not None:
                load.join()

    def issue_streams(self) -> None:
        """Queues the pages of every streamed copy not yet queued (`StreamedLoad.issue`), before the forward that
        waits for them is launched (AdapterTable.place_streamed)."""
        started = time.perf_counter()
        loads = [load for load in self.loading.values() if isinstance(load, StreamedLoad) and not load.issued]
        if loads:
            issue_streamed(loads)
            self.issue_seconds += time.perf_counter() - started

    def streaming(self) -> list[str]:
        """The adapters whose streamed copy the compute stream has not joined."""
        return [name for name, load in self.loading.items() if isinstance(load, StreamedLoad)]

    def finish_streams(self) -> dict[str, str]:
        """Joins every streamed copy -> {adapter: why its copy failed} for those that failed (their
        steps read garbage: the engine fails their requests and drops them)."""
        failed = {}
        for name in self.streaming():
            load = self.loading.pop(name)
            load.join()
            if load.error is not None:
                failed[name] = load.error
        return failed

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

    def _staged(self, name: str, adapter) -> tuple[StagedAdapter, str]:
        """The adapter in page layout and the tier its copy comes from. On cuda every adapter staged once
        stays staged in pageable host memory (`pageable`, within `staged_bytes`), and the most recently
        used ones also in pinned memory (`pinned`, within `pinned_bytes`): a cold load is one DMA from
        pinned memory, or one copy from pageable memory (which the driver stages through its own pinned
        buffers, ~5x slower), never a new staging. Keyed by `staging_key`."""
        if not self.table.pool.pages.is_cuda:
            return self.table.stage(adapter.weights), "host"
        key = staging_key(adapter)  # the stager's finished work is absorbed by the callers (acquire, prefetch)
        pinned = self.pinned.get(key)
        if pinned is not None:
            return pinned, "pinned"
        staged = self.pageable.get(key)
        if staged is None:
            started = time.perf_counter()
            staged, pinned = self._stage_pages(adapter)
            self._keep(name, adapter, staged, pinned)
            self.host_s["stage"] += time.perf_counter() - started
        else:
            pinned, seconds = self._pinned_copy(staged, wait=False)
            if pinned is not None:
                self.pinned.put(key, held_for_key(adapter, key), pinned)
            self.host_s["pin"] += seconds
        return (staged, "pageable") if pinned is None else (pinned, "pinned")

    def _stage_pages(self, adapter, parts: dict | None = None, wait: bool = False) -> tuple[StagedAdapter, StagedAdapter | None]:
        """(pageable pages, their pinned copy or None when larger than the pinned budget). Reads only the
        adapter and the table's fixed layout, and takes pinned memory from the arena: safe on the stager's thread
        (which may wait there for copies from memory that is being given back). parts: gets the seconds of the layout
        and of the pinning."""
        started = time.perf_counter()
        staged = self.table.stage(adapter.weights, pin=False)
        laid_out = time.perf_counter()
        pinned, pinning = self._pinned_copy(staged, wait)
        if parts is not None:
            parts["layout"], parts["pin"] = laid_out - started, pinning
        return staged, pinned

    def _stage_off_thread(self, adapter, parts: dict) -> tuple[StagedAdapter, StagedAdapter | None]:
        """`_stage_pages` on a stager thread, which may wait for pinned memory."""
        return self._stage_pages(adapter, parts, wait=True)

    def _pinned_copy(self, staged: StagedAdapter, wait: bool) -> tuple[StagedAdapter | None, float]:
        """A staged adapter's pages copied into the arena's pinned memory (any thread), or None (not pinned: past
        the budget, or no range free), and the seconds that took (also counted by the step log's pin clock). Where
        no range is free, the least recently used pinned entries are dropped: on a stager thread (`wait`: it waits
        for their copies to the GPU) until one is; on the engine thread only while the budget is exceeded, so that
        it never waits."""
        nbytes = staged.pages.nbytes
        if self.arena is None or nbytes > min(self.pinned.budget, self.arena.largest_range):
            return None, 0.0
        started = time.perf_counter()
        while (buffer := self.arena.alloc(nbytes, wait)) is None:
            if not (wait or self.pinned.used + nbytes > self.pinned.budget) or not self.pinned.drop_oldest():
                break
        pinned = None
        if buffer is None:
            self.pinned_misses += 1
        else:
            pages = buffer.view(staged.pages.dtype).view(staged.pages.shape)
            pages.copy_(staged.pages)
            pinned = StagedAdapter(pages, staged.layout)
        seconds = time.perf_counter() - started
        pin_clock.add(seconds)
        return pinned, seconds

    def _keep(self, name: str, adapter, staged: StagedAdapter, pinned: StagedAdapter | None) -> None:
        key = self._keys[name] = staging_key(adapter)
        if key not in self.pageable:
            self.pageable.put(key, held_for_key(adapter, key), staged)
        if pinned is not None and key not in self.pinned:
            self.pinned.put(key, held_for_key(adapter, key), pinned)

    def _take_over(self, name: str) -> None:
        """An admission that stages its adapter on this thread (nothing else runs): where a stager thread has begun
        staging it, wait for that instead (it ends no later than a staging begun here, and the two would slow each
        other down); where it is only queued there, the thread will skip it. An idle server hit by a burst of requests
        for cold adapters stages them on the stager's threads and this one, each adapter once."""
        if self.stager is not None and not self.stager.claim(name):
            if not self.stager.wait(name, STAGER_WAIT_S):
                log.warning("adapter %s: its staging on the stager's thread took over %.0f s; staged here", name,
                            STAGER_WAIT_S)
            self._absorb()

    def _is_staged(self, adapter) -> bool:
        """Is the adapter's staged copy in either tier (cuda)?"""
        return self._in_tiers(staging_key(adapter))

    def _name_staged(self, name: str) -> bool:
        """Is the last copy staged under `name` still in either tier? (Without a lookup: its files may have changed
        since, which the admission's lookup finds.)"""
        key = self._keys.get(name)
        return key is not None and self._in_tiers(key)

    def _in_tiers(self, key: Hashable) -> bool:
        return key in self.pinned or key in self.pageable

    def _absorb(self) -> None:
        """Takes the stager's finished work into the caches (engine thread only): stale ones (their name
        dropped since) and failed ones are left out; a failure is met again, and reported, at admission."""
        if self.stager is None:
            return
        for name, generation, adapter, result in self.stager.take():
            if isinstance(result, BaseException):
                log.debug("background staging of adapter %s failed: %s", name, result)
                self._stage_failed.add(name)
            elif generation == self.generation.get(name, 0):
                self._keep(name, adapter, *result)
                self.staged_off_thread += 1

    def _defer(self, name: str) -> bool:
        """Does the admission of a request whose adapter is not staged yet wait for the stager (asked here)? While the
        engine has other rows to run (`defer_unstaged`): the device runs their steps while the stager reads and stages
        the adapter, where staging it on the engine thread would leave the device idle for as long (~100-250 ms for a
        rank-64 7B adapter). Not where nothing else runs or the engine says not to (Engine._defer_unstaged), nor after
        the stager failed on it (staged here, the admission meets the error and the request fails with it)."""
        if self.stager is None or self.defer_unstaged is None or not self.defer_unstaged():
            return False
        if name in self._stage_failed:
            self._stage_failed.discard(name)
            return False
        self.stager.ask(name, self.generation.get(name, 0))
        if name not in self.deferred:
            self.deferred.add(name)
            self.admissions_deferred += 1
            log.debug("admission waits for the stager adapter=%s", name)
        return True

    def prepare(self, names) -> None:
        """Has the stager read and stage the adapters among `names` that are not staged yet (cuda; a
        no-op elsewhere): those of the first queued requests, while the engine thread runs steps."""
        if self.stager is None:
            return
        self._absorb()
        for name in names:
            if name is not None and name not in self.slots and not self._name_staged(name):
                self.stager.ask(name, self.generation.get(name, 0))

    def prefetch(self, name: str, reserve_pages: int, tokens: int | None = None) -> bool:
        """Places a queued request's adapter into free pages while a step runs, evicting nothing and leaving
        `reserve_pages` free for KV growth; it waits idle until admitted. False: no room now.

        tokens: the request's first step, to ask `placement_for` how the adapter would be placed at
        admission: where it would be streamed it is streamed ahead (`issue_ahead` queues its layers later,
        a few at a time); otherwise, and without tokens, it is placed whole (a request admitted with its
        adapter resident needs no cold start at all)."""
        if name in self.slots:
            return True
        slot = self.table.free_slot()
        if slot is None:
            return False
        self._absorb()
        if self.stager is not None and not self._name_staged(name):  # the stager stages it; this thread does not wait
            self.stager.ask(name, self.generation.get(name, 0))
            return False
        started = time.perf_counter()
        adapter = self.lookup(name)
        self.host_s["lookup"] += time.perf_counter() - started
        if self.stager is not None and not self._is_staged(adapter):  # its files changed since: staged anew there too
            self.stager.ask(name, self.generation.get(name, 0))
            return False
        staged, tier = self._staged(name, adapter)
        if self.table.pool.num_free - staged.pages.shape[0] < reserve_pages:
            return False
        kind = "whole"
        if tokens is not None and self.placement_for is not None and self.placement_for(adapter, tier, tokens) == "stream":
            kind = "stream"
        placing = time.perf_counter()
        try:
            if kind == "stream":
                load = self.table.place_streamed(slot, staged)
                if load is None:
                    return False
                self.ahead[name] = (load, tier)
                self.streamed_ahead += 1
                self.placed["stream"] += 1
            elif not self.table.place(slot, staged):
                return False
        finally:
            self.host_s["place"] += time.perf_counter() - placing
        self.loads += 1
        self.prefetches += 1
        self.slots[name] = slot
        self.pins[name] = 0
        self.idle[name] = None
        log.debug("adapter prefetched name=%s slot=%d placement=%s tier=%s", name, slot, kind, tier)
        return True

    def issue_ahead(self, until: Callable[[], bool]) -> None:
        """Queues layers of the streamed-ahead copies (forward order, layer-major) until `until()` says stop
        (the step the host waits for is done): host time that was idle. Nothing on the device waits for
        these copies yet, so stopping anywhere is safe."""
        loads = [load for load, _ in self.ahead.values() if not load.issued]
        if not loads:
            return
        started = time.perf_counter()
        before = sum(load.layers_left for load in loads)
        issue_streamed(loads, until)
        self.ahead_layers += before - sum(load.layers_left for load in loads)
        self.ahead_seconds += time.perf_counter() - started

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self.pins[name] -= 1
        if self.pins[name] == 0:
            self.idle[name] = None

    def reclaim(self, pages: int) -> bool:
        """Evicts idle adapters until `pages` pool pages are free; False if that is not possible."""
        uses = None
        while self.table.pool.num_free < pages and self.idle:
            uses = self._evict_idle(uses)
        return self.table.pool.num_free >= pages

    def slot(self, name: str | None) -> int:
        return -1 if name is None else self.slots[name]

    def drop(self, name: str) -> None:
        """Forget an idle adapter's pool copy (it was unregistered or replaced); a staging of it begun before is stale."""
        self.generation[name] = self.generation.get(name, 0) + 1
        self._keys.pop(name, None)
        if name in self.permanent:
            self.permanent.discard(name)
            self.release(name)
        if name in self.idle:
            self.idle.pop(name)
            self._evict(name)

    def _evict_idle(self, uses: dict[str, int] | None) -> dict[str, int]:
        """Evicts one idle adapter: the longest idle of those no queued request needs, else the one whose first
        queued request comes last (the queue is the future: Belady's choice). With the KV cache full (a saturated
        server at the default cap), KV growth takes idle adapters' pages step after step, and the oldest idle was
        often the next one a queued request needed, placed again for it: evicted furthest-needed first, fewer are.
        uses: next_use()'s answer for this round of evictions (None: asked now) -> the same, for the next one."""
        if uses is None:
            uses = self.next_use() if self.next_use is not None else {}
        name = next((name for name in self.idle if name not in uses), None)
        if name is None:
            name = max(self.idle, key=uses.__getitem__)
        del self.idle[name]
        self._evict(name)
        return uses

    def _evict(self, name: str) -> None:
        started = time.perf_counter()
        self.join([name])  # its copy is ordered before the pages go to another owner
        if name in self.ahead:
            self.ahead.pop(name)[0].abandon()
        self.table.evict(self.slots.pop(name))
        self.host_s["evict"] += time.perf_counter() - started
        del self.pins[name]
        self.evictions += 1
        log.debug("adapter evicted name=%s", name)


STAGER_THREADS = 4  # the stager's threads, at most one per core the engine may use
STAGER_WAIT_S = 30.0  # an admission waits this long at most for a staging a stager thread has begun


def _pin_arena(capacity: int, table: AdapterTable) -> PinnedArena:
    try:
        arena = PinnedArena(capacity, fence=table.copy_fence)
    except RuntimeError as error:
        raise RuntimeError(f"could not pin {capacity} bytes of host memory for staged adapters (lower "
                           f"--pinned-host-bytes): {error}") from error
    log.info("pinned host memory for staged adapters bytes=%d blocks=%d ms=%.0f", arena.capacity, len(arena.segments),
             arena.start_seconds * 1e3)
    return arena


class Stager:
    """Background threads that read adapters (`lookup`, maybe from disk) and stage them (`stage`: page layout,
    pinning), for the engine thread to take (`take`). `ask` and `take` are the engine thread's; a name asked again
    while it is being staged is not staged twice. Several adapters stage at once, each on its own thread (the
    reads, casts and copies run in torch and the OS with the GIL released): a saturated server's first requests
    bring dozens of cold adapters at once, and staged one after another they kept running slots empty for seconds
    (BENCHMARKS.md, figure 21.1). The threads hold the stager only weakly while they wait, so an engine that is
    dropped is freed (its GPU memory with it), and they end.

    An adapter the engine thread must stage now (`claim`) is not staged twice: one a thread has started, the engine
    waits for (`wait`); one still queued, the threads skip."""

    def __init__(self, lookup, stage, threads: int | None = None):
        self.lookup = lookup
        self.stage = stage
        self.threads = threads or max(1, min(STAGER_THREADS, len(os.sched_getaffinity(0))))
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, float] = {}  # names asked for and not yet taken -> when each was asked
        self._lock = threading.Lock()  # _started and _claimed, between the threads and the engine thread
        self._started: set[str] = set()  # names a thread is staging now
        self._claimed: set[str] = set()  # pending names the engine thread stages itself: the threads skip them
        self._early: list[tuple] = []  # results `wait` received, for the next `take`
        self._threads: list[threading.Thread] = []  # started at the first ask
        self.staged = 0  # adapters staged (taken by the engine thread), and the threads' seconds on them
        self.seconds = 0.0
        self.ready_seconds = 0.0  # and the seconds from each one's ask to its take (its wait for a thread included)
        # the threads' seconds by part (read: the lookup, from disk where it is not in host memory; layout: the page
        # layout; pin: the pinned copy) and their CPU seconds: wall well above CPU is a thread kept waiting
        self.part_seconds = {"read": 0.0, "layout": 0.0, "pin": 0.0, "cpu": 0.0}

    def ask(self, name: str, generation: int = 0) -> None:
        if name in self._pending:
            return
        self._pending[name] = time.perf_counter()
        if not self._threads:
            # Started from the engine thread, after it left the CPU workers' cores (cpu_assist.keep_off_cores): the
            # threads inherit its affinity.
            self._threads = [threading.Thread(target=_stage_loop, args=(weakref.ref(self), self._todo, self._done),
                                              name=f"lorad-stager-{index}", daemon=True) for index in range(self.threads)]
            for thread in self._threads:
                thread.start()
            weakref.finalize(self, _stop_threads, self._todo, self.threads)  # ends them once the stager is gone
        self._todo.put((name, generation))

    def take(self) -> list[tuple[str, int, object, object]]:
        """(name, generation, adapter or None, (pageable, pinned) or the exception) for each one done."""
        done = []
        items, self._early = self._early, []
        while True:
            try:
                items.append(self._done.get_nowait())
            except queue.Empty:
                break
        now = time.perf_counter()
        for name, generation, adapter, result, seconds, parts in items:
            asked_at = self._pending.pop(name, now)
            with self._lock:
                self._claimed.discard(name)
            if result is _SKIPPED:  # claimed by the engine thread before a thread reached it
                continue
            self.staged += 1
            self.seconds += seconds
            for part, part_seconds in parts.items():
                self.part_seconds[part] += part_seconds
            self.ready_seconds += now - asked_at
            done.append((name, generation, adapter, result))
        return done

    def claim(self, name: str) -> bool:
        """The engine thread is about to stage `name` itself. True: no thread has started it (one that reaches it
        skips it); False: a thread is staging it, which ends no later than a staging begun now would (`wait`)."""
        with self._lock:
            if name in self._started:
                return False
            if name in self._pending:
                self._claimed.add(name)
            return True

    def wait(self, name: str, timeout_s: float) -> bool:
        """Blocks until the staging of `name` is done (True) or `timeout_s` has passed (False); every result that
        comes meanwhile goes to the next `take`."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                item = self._done.get(timeout=remaining)
            except queue.Empty:
                return False
            self._early.append(item)
            if item[0] == name:
                return True

    def pending(self) -> int:
        return len(self._pending)


_SKIPPED = object()  # a thread's result for a name the engine thread claimed before the thread reached it


def _stop_threads(todo: queue.SimpleQueue, threads: int) -> None:
    for _ in range(threads):
        todo.put(None)


def _stage_loop(stager_ref, todo: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
    """A stager thread: until it is told to stop (None) or its stager is gone. Its torch ops run on this thread
    alone: with OpenMP each thread that runs a parallel op gets its own team of the process's intra-op threads (one
    per core), so a team per stager thread beside the engine's would oversubscribe the cores, and each of an
    adapter's thousands of ops would wait for its team's slowest thread. On a loaded 2-core machine one thread each
    staged 1.12x as fast with four stager threads and 3.8x with one (BENCHMARKS.md, figure 21.1)."""
    torch.set_num_threads(1)  # this thread's team only (OpenMP's setting is per thread)
    while True:
        item = todo.get()
        stager = stager_ref()
        if item is None or stager is None:
            return
        name, generation = item
        with stager._lock:
            skip = name in stager._claimed
            if not skip:
                stager._started.add(name)
        if skip:
            del stager
            done.put((name, generation, None, _SKIPPED, 0.0, {}))
            continue
        adapter = None
        started, cpu_started = time.perf_counter(), time.thread_time()
        parts = {}
        try:
            adapter = stager.lookup(name)
            parts["read"] = time.perf_counter() - started
            result = stager.stage(adapter, parts)
        except Exception as error:  # noqa: BLE001 - reported by take(); admission meets it again
            result = error
        with stager._lock:
            stager._started.discard(name)
        del stager
        parts["cpu"] = time.thread_time() - cpu_started
        done.put((name, generation, adapter, result, time.perf_counter() - started, parts))
        del adapter, result  # while this thread waits for the next one, it keeps no adapter alive


def staging_key(adapter) -> Hashable:
    """What an adapter's staged copy is cached by. One read from files: by those files (its directory and
    `LoraAdapter.source`), so the same files stage alike whichever object holds them (read again after the host
    store let it go, say), new files under the same name are a new key, and the staged copy keeps no float32 host
    copy alive. One made in memory (the dummy adapters, which share a handful of weight sets; benchmarks): by its
    weights' identity, which its cache entry keeps unique by holding them (`held_for_key`); such an adapter stays in
    host memory while registered anyway."""
    source = getattr(adapter, "source", None)
    return ("memory", id(adapter.weights)) if source is None else ("files", adapter.path, source)


def held_for_key(adapter, key: Hashable):
    """What a cache entry holds beside the staged copy: the weights for a key that is their id, else nothing."""
    return adapter.weights if key[0] == "memory" else None


class StagedCache:
    """Staged adapters (`staging_key`; a tensor-parallel worker: by name, directory and files), least recently used
    dropped first beyond `budget` bytes (the newest always stays). An entry may hold what keeps its key unique.
    Thread-safe: a stager thread drops entries to free pinned memory (`drop_oldest`)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self.entries: OrderedDict[Hashable, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Hashable) -> StagedAdapter | None:
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                return None
            self.entries.move_to_end(key)
            return entry[1]

    def put(self, key: Hashable, holds, staged: StagedAdapter) -> None:
        dropped = []  # let go outside the lock: a pinned entry's last tensor gives its memory back
        with self._lock:
            if key in self.entries:
                self.used -= self.entries[key][1].pages.nbytes
            self.entries[key] = (holds, staged)
            self.entries.move_to_end(key)
            self.used += staged.pages.nbytes
            while self.used > self.budget and len(self.entries) > 1:
                dropped.append(self._pop_oldest())

    def drop_oldest(self) -> bool:
        """Drops the least recently used entry; False where there is none."""
        with self._lock:
            if not self.entries:
                return False
            entry = self._pop_oldest()
        del entry  # let go outside the lock
        return True

    def _pop_oldest(self) -> tuple:
        _, entry = self.entries.popitem(last=False)
        self.used -= entry[1].pages.nbytes
        return entry
