"""The unified page pool (S-LoRA's Unified Paging): one preallocated tensor whose pages hold both
the paged KV cache and the resident adapters' weights, handed out from one free list.

Layouts are fixed by DESIGN.md: a page is `page_elems` (= hidden_size, rounded up to whole K rows: `ModelSpec.page_elems`) elements; a KV page holds
`tokens_per_page` tokens of K or V of one layer; an adapter's A rows and B^T rows are cut into pages
and found through `AdapterTable`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lorad.gpu_ops import cuda_ext

log = logging.getLogger(__name__)

NUM_PROJECTIONS = 7
SCRATCH_PAGE = 0  # never handed out: padded rows and table entries point here
MAX_DIRECT_RUNS = 16  # an adapter (a streamed layer) in at most this many runs of pages is copied run by run in torch
# A kernel waiting for a streamed layer (`AdapterTable.ready`) gives up after this long, raises
# `stream_error` and goes on: a lost copy must fail its requests, never hang the device.
STREAM_TIMEOUT_NS = 10_000_000_000


class PagePool:
    """pages: [num_pages, page_elems] of the model dtype, on the model device."""

    def __init__(self, num_pages: int, page_elems: int, dtype: torch.dtype, device: torch.device):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages, got {num_pages}")
        self.pages = torch.zeros(num_pages, page_elems, dtype=dtype, device=device)
        self.page_elems = page_elems
        self.num_pages = num_pages
        # A stack of the free ids, lowest on top (the end): long runs reuse the same low pages, which keeps
        # the occupied region compact and the occupancy figure easy to read. An int32 array: a 1000-token
        # prompt of the 7B shape takes 64,000 pages at once, and its sequence gives as many back when it ends.
        self._stack = np.arange(num_pages - 1, SCRATCH_PAGE, -1, dtype=np.int32)
        self._top = len(self._stack)  # the free ids: _stack[:_top]
        self.used = {"kv": 0, "adapter": 0}
        # Pages given back while a step launched before may still write them (`free(..., fenced=True)`): each batch
        # with an event recorded after that step, back on the stack once the device has passed it. Counted free.
        self._fenced: deque[tuple[object, np.ndarray]] = deque()
        self._fenced_count = 0
        self.fences = self.pages.is_cuda  # on the cpu every launch is done when it returns: nothing to fence
        self.new_event = torch.cuda.Event  # recorded on the current stream where the fenced pages' last writer ends

    @property
    def num_free(self) -> int:
        return self._top + self._fenced_count

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def free_ids(self) -> np.ndarray:
        """The free page ids (a copy), the next to be handed out last (fenced ones once the device has passed them)."""
        self._unfence(self.num_free)
        return self._stack[: self._top].copy()

    def alloc(self, count: int, owner: str, ordered: bool = False) -> np.ndarray | None:
        """`count` page ids (int32, ascending), or None (and nothing taken) when fewer are free. Fenced pages are
        taken once the device has passed their event; when the others are too few it waits for it. ordered: the
        caller's writes to the pages go on the compute stream, after every step already queued there (KV), so fenced
        pages are safe for it at once: taken without a wait when the others are too few (a host that plans the next
        step while one is in flight, with the cache full, would otherwise wait for that step to end)."""
        if count > self._top and self._fenced:
            self._unfence(0 if ordered else count)
        if count > self._top + (self._fenced_count if ordered else 0):
            return None
        short = max(0, count - self._top)
        # ascending (the stack holds descending stretches): a run iff last - first == count - 1
        taken = self._stack[self._top - (count - short) : self._top]
        self._top -= count - short
        if short:
            taken = np.concatenate([taken, self._take_fenced(short)])
        self.used[owner] += count
        return np.sort(taken)

    def _take_fenced(self, count: int) -> np.ndarray:
        """`count` fenced page ids, the oldest first, off their batches without waiting (for an ordered caller)."""
        parts = []
        while count:
            event, ids = self._fenced[0]
            if len(ids) <= count:
                self._fenced.popleft()
                parts.append(ids)
            else:
                self._fenced[0] = (event, ids[count:])
                parts.append(ids[:count])
            count -= len(parts[-1])
            self._fenced_count -= len(parts[-1])
        return np.concatenate(parts)

    def free(self, page_ids, owner: str, fenced: bool = False) -> None:
        """Gives back ids `alloc` handed out (any sequence of ints). fenced (cuda): a step queued on the current
        stream may still write them (a sequence's row computed past its end, or aborted while in flight): they are
        handed out again only after the device has passed that step, since an adapter's pages are copied on
        another stream, which would not wait for it."""
        ids = np.asarray(page_ids, dtype=np.int32)
        if self._top + self._fenced_count + len(ids) > len(self._stack):
            raise ValueError(f"{len(ids)} pages given back with only {len(self._stack) - self._top - self._fenced_count} out")
        self.used[owner] -= len(ids)
        if fenced and self.fences and len(ids):
            event = self.new_event()
            event.record()
            self._fenced.append((event, ids))
            self._fenced_count += len(ids)
        else:
            self._push(ids)

    def _push(self, ids: np.ndarray) -> None:
        # Highest first, so the freed pages come back out ascending: an adapter freed and placed again
        # gets consecutive pages, which load with one copy.
        self._stack[self._top : self._top + len(ids)] = np.sort(ids)[::-1]
        self._top += len(ids)

    def _unfence(self, count: int) -> None:
        """Fenced pages back on the stack: those the device has passed, then, while fewer than `count` are free,
        the oldest after waiting for them."""
        while self._fenced and (self._fenced[0][0].query() or count > self._top):
            event, ids = self._fenced.popleft()
            if not event.query():
                event.synchronize()
            self._fenced_count -= len(ids)
            self._push(ids)

    def occupancy(self) -> dict:
        return {
            "pages": self.capacity,
            "free": self.num_free,
            "kv": self.used["kv"],
            "adapter": self.used["adapter"],
            "page_bytes": self.page_elems * self.pages.element_size(),
        }


class KVCache:
    """Paged KV cache in the pool. A block is `tokens_per_page` positions of one sequence (or of several
    that read the same prompt: `share`) and costs 2 * num_layers pages (K and V of every layer); its page
    ids are a row [num_layers, 2].

    dtype: what the pages hold of K and V, the pool's dtype by default. A page is the same bytes whatever
    it holds (the pool stays one tensor of the model dtype, adapters' pages in it unchanged), so a KV dtype of
    fewer bytes fits more tokens in a page: FP8 (float8_e4m3fn) in a bf16 pool, twice as many."""

    def __init__(self, pool: PagePool, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | None = None,
                 layer_windows: tuple[int | None, ...] = ()):
        dtype = dtype or pool.pages.dtype
        kv_size = num_kv_heads * head_dim
        page_bytes = pool.page_elems * pool.pages.element_size()
        row_bytes = kv_size * torch.empty((), dtype=dtype).element_size()
        if page_bytes % row_bytes:
            raise ValueError(f"page of {page_bytes} bytes cannot hold whole K rows of {kv_size} {dtype}")
        self.pool = pool
        self.num_layers = num_layers
        self.dtype = dtype
        self.tokens_per_page = page_bytes // row_bytes
        self.pages_per_block = 2 * num_layers
        # K or V pages seen as [num_pages, tokens_per_page, num_kv_heads, head_dim] of dtype.
        self.view = pool.pages.view(dtype).view(pool.num_pages, self.tokens_per_page, num_kv_heads, head_dim)
        # Blocks held by more than one sequence (`share`: the n choices of one request read their prompt's
        # blocks): the block's first page id (K of layer 0) -> how many sequences hold it. A block not
        # here has one holder; its pages go back to the pool when that one releases it.
        self.holders: dict[int, int] = {}
        # Sliding-window layers (ModelSpec.layer_windows: a query at p reads keys in (p - window, p]), grouped by
        # window: (window, their layers, a mask [len(layers), 2] of the pages `trim` frees: all but layer 0's K
        # page, which stays as the block's key, what `holders` and `release` know a block by).
        self._windows = []
        for window in sorted({w for w in layer_windows if w is not None}):
            layers = np.array([layer for layer, w in enumerate(layer_windows) if w == window])
            freed = np.ones((len(layers), 2), dtype=bool)
            freed[layers == 0, 0] = False
            self._windows.append((window, layers, freed))
        self.window_pages_freed = 0  # pages `trim` gave back, in all

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_page)

    def grow(self, blocks: list[np.ndarray], num_tokens: int) -> bool:
        """Extend a sequence's block list to hold num_tokens positions; False if the pool is short."""
        missing = self.blocks_for(num_tokens) - len(blocks)
        if missing <= 0:
            return True
        page_ids = self.pool.alloc(missing * self.pages_per_block, "kv", ordered=True)  # written by the steps alone
        if page_ids is None:
            return False
        rows = page_ids.reshape(self.num_layers, 2, missing).transpose(2, 0, 1)
        blocks.extend(rows)
        return True

    def release(self, blocks, fenced: bool = False) -> None:
        """Gives back a sequence's blocks: the pages of each block it was the last holder of go back to the pool
        (those `trim` gave back already, SCRATCH_PAGE in the rows, not again). fenced: a step still queued on the
        device may write them (PagePool.free)."""
        if len(blocks):
            rows = np.asarray(blocks.array() if isinstance(blocks, BlockList) else blocks)
            if self.holders:
                rows = rows[self._last_holder(rows[:, 0, 0])]
            ids = rows.ravel()
            self.pool.free(ids[ids != SCRATCH_PAGE], "kv", fenced)
        blocks.clear()

    def trim(self, blocks: BlockList, start: int) -> int:
        """A step is about to compute a sequence's positions from `start` on: gives back the pages no query of it
        or of a later step reads, and -> how many. Those are, for each sliding-window layer, the K and V pages of
        the blocks that end before the window of the step's first query and of the previous step's (which may
        still run on the device while this one is planned: overlapped decode), but layer 0's K page, the
        block's key; their entries become SCRATCH_PAGE, which the attention kernels never reach (they start
        at the window). A block shared with another sequence (`share`) keeps its pages until its release."""
        if not self._windows or not len(blocks):
            return 0
        horizon = min(start, blocks.last_start) if blocks.last_start is not None else start
        blocks.last_start = start
        rows, freed = blocks.array(), 0
        for window, layers, mask in self._windows:
            dead = min(max(0, horizon - window + 1) // self.tokens_per_page, len(rows))
            done = blocks.trimmed.get(window, 0)
            if dead <= done:
                continue
            blocks.trimmed[window] = dead
            span = rows[done:dead]  # a view: the entries below are rewritten in the sequence's own rows
            sole = ~self._shared(span[:, 0, 0]) if self.holders else np.ones(len(span), dtype=bool)
            pages = span[:, layers, :]  # [blocks, len(layers), 2], a copy
            take = mask[None] & sole[:, None, None] & (pages != SCRATCH_PAGE)
            ids = pages[take]
            if len(ids):
                pages[take] = SCRATCH_PAGE
                span[:, layers, :] = pages
                self.pool.free(ids, "kv")
                freed += len(ids)
        self.window_pages_freed += freed
        return freed

    def _shared(self, keys: np.ndarray) -> np.ndarray:
        """bool [blocks]: which of these blocks (by first page id) more than one sequence holds."""
        return np.isin(keys, np.fromiter(self.holders, dtype=keys.dtype, count=len(self.holders)))

    def _last_holder(self, keys: np.ndarray) -> np.ndarray:
        """bool [blocks]: which of these blocks (by first page id) lose their last holder; one holder fewer
        for each shared one."""
        shared = self._shared(keys)
        for key in keys[shared].tolist():
            count = self.holders[key] - 1
            if count == 1:
                del self.holders[key]
            else:
                self.holders[key] = count
        return ~shared

    def share(self, blocks: BlockList, count: int) -> BlockList:
        """A new block list holding the first `count` blocks of `blocks` too (no page copied): for a sequence
        that reads the same positions and never writes them. Each block goes back to the pool once its last
        holder releases it."""
        rows = blocks.array()[:count]
        for key in rows[:, 0, 0].tolist():
            self.holders[key] = self.holders.get(key, 1) + 1
        shared = BlockList()
        shared.extend(rows)
        return shared

    def copy_block(self, source: np.ndarray, target: np.ndarray) -> None:
        """The pages of block `source` ([num_layers, 2] page ids) copied into block `target`'s, on the device
        (ordered after the steps that wrote `source` on the same stream): a sequence forked inside a block
        writes its next positions into a copy of its own."""
        device = self.pool.pages.device
        source_ids = torch.as_tensor(np.ascontiguousarray(source).ravel(), dtype=torch.long).to(device)
        target_ids = torch.as_tensor(np.ascontiguousarray(target).ravel(), dtype=torch.long).to(device)
        self.pool.pages.index_copy_(0, target_ids, self.pool.pages.index_select(0, source_ids))

    def sharing(self) -> dict:
        """For /v1/status: the blocks held by more than one sequence, and the pool pages that saves."""
        extra = sum(self.holders.values()) - len(self.holders)
        return {"shared_blocks": len(self.holders), "pages_saved": extra * self.pages_per_block,
                "window_pages_freed": self.window_pages_freed}

    def free_tokens(self) -> int:
        return self.pool.num_free // self.pages_per_block * self.tokens_per_page

    def capacity_tokens(self) -> int:
        """Positions the whole pool would hold as KV (adapters' pages counted as free)."""
        return self.pool.capacity // self.pages_per_block * self.tokens_per_page


class BlockList:
    """A sequence's KV blocks, page ids [n, num_layers, 2], in one growing numpy buffer: the runner
    reads them as one array each step instead of stacking per-block rows."""

    def __init__(self):
        self._buffer: np.ndarray | None = None
        self._length = 0
        self.clears = 0  # how many times it was emptied (a preemption): a tensor-parallel rank's copy starts over
        # KVCache.trim's progress: per window, the blocks before this index are trimmed; the last step's start
        self.trimmed: dict[int, int] = {}
        self.last_start: int | None = None

    def __len__(self) -> int:
        return self._length

    def extend(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        needed = self._length + len(rows)
        if self._buffer is None or needed > len(self._buffer):
            grown = np.empty((max(needed, 2 * self._length, 16), *rows.shape[1:]), dtype=np.int32)
            if self._buffer is not None:
                grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : needed] = rows
        self._length = needed

    def array(self) -> np.ndarray:
        """A view of the blocks [n, num_layers, 2]; valid until the next extend."""
        if self._buffer is None:
            return np.empty((0, 0, 2), dtype=np.int32)
        return self._buffer[: self._length]

    def __iter__(self):
        return iter(self.array())

    def clear(self) -> None:
        self._length = 0
        self.clears += 1
        self.trimmed = {}
        self.last_start = None


@dataclass
class StagedAdapter:
    """pages: [n, page_elems] host tensor (pinned on cuda); layout: (layer, proj, rank, a_offset,
    b_offset) per module, offsets in pages from the adapter's first page."""

    pages: torch.Tensor
    layout: list[tuple[int, int, int, int, int]]


@dataclass
class AdapterPlacement:
    slot: int
    page_ids: np.ndarray  # int32, as PagePool.alloc hands them out
    index_start: int
    index_len: int


class AdapterTable:
    """Where each resident adapter's weights lie in the pool, as device tensors the kernels read:

    rank, a_start, b_start: int32 [num_slots, num_layers, 7]; page_ids: int32 [index_capacity].
    Row j, chunk c of A of (slot, layer, proj) is page page_ids[a_start + j * chunks_in + c].
    Host mirrors are kept so that placement never reads back from the device.
    """

    def __init__(self, pool: PagePool, num_slots: int, num_layers: int, shapes: list[tuple[int, int]]):
        self.pool = pool
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.shapes = shapes  # (in, out) per projection
        page = pool.page_elems
        self.chunks = [(math.ceil(i / page), math.ceil(o / page)) for i, o in shapes]
        device = pool.pages.device
        table_shape = (num_slots, num_layers, NUM_PROJECTIONS)
        self.rank_host = np.zeros(table_shape, dtype=np.int32)
        self.a_start_host = np.zeros(table_shape, dtype=np.int32)
        self.b_start_host = np.zeros(table_shape, dtype=np.int32)
        self.page_ids_host = np.zeros(pool.num_pages, dtype=np.int32)
        self.rank = torch.zeros(table_shape, dtype=torch.int32, device=device)
        self.a_start = torch.zeros(table_shape, dtype=torch.int32, device=device)
        self.b_start = torch.zeros(table_shape, dtype=torch.int32, device=device)
        self.page_ids = torch.zeros(pool.num_pages, dtype=torch.int32, device=device)
        self.placements: dict[int, AdapterPlacement] = {}
        self._index_end = 0  # bump allocator over page_ids; compacted when it runs out
        self._copy_stream = None
        # Streamed placement (`place_streamed`): ready[slot] = how many of the slot's first layers are in
        # the pool; the LoRA kernels that read a slot wait on the device until it passes their layer.
        # num_layers for every slot that is not streaming. stream_error: set by a kernel that gave up.
        self.ready = torch.full((num_slots,), num_layers, dtype=torch.int32, device=device)
        self.stream_error = torch.zeros(1, dtype=torch.int32, device=device)
        self.streaming = False  # enable_streaming(): the kernels are built with the wait
        self._streamer: _Streamer | None = None
        # how runs of pages are queued on cuda: "cuda-ext" (one driver call per run, from C++), else "torch: why not"
        self.copy_path = cuda_ext.rows_copy_path() if device.type == "cuda" else "cpu"
        self.streamed_runs = {"layers": 0, "runs": 0}  # streamed layers queued, and their runs of pages
        if self.copy_path.startswith("torch"):
            log.warning("adapter page copies path=%r (one torch copy per run of pages: more host time a placement)",
                        self.copy_path)

    def pages_needed(self, weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> int:
        total, seen = 0, set()
        for (_, proj), (a, _) in weights.items():
            chunks_in, chunks_out = self.chunks[proj]
            total += a.shape[0] * ((chunks_in if id(a) not in seen else 0) + chunks_out)
            seen.add(id(a))
        return total

    def free_slot(self) -> int | None:
        for slot in range(self.num_slots):
            if slot not in self.placements:
                return slot
        return None

    def stage(self, weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], pin: bool = True) -> StagedAdapter:
        """An adapter laid out as whole pool pages in host memory, in the pool's dtype: every A row and
        B^T row padded to whole pages. On cuda the pages are pinned unless `pin` is False, so a load is
        one DMA copy (from pageable memory, one the driver stages through its own pinned buffers).

        An A shared by several projections of a layer (the same tensor: a fused module's members,
        daemon/model/adapters.py) is staged once, and each member's table entry points at it."""
        page = self.pool.page_elems
        rows, layout, cursor, staged_a = [], [], 0, {}  # rows: (matrix, chunks) in page order
        for (layer, proj), (a, b) in sorted(weights.items()):
            chunks_in, chunks_out = self.chunks[proj]
            a_offset = staged_a.get(id(a))
            if a_offset is None:
                a_offset = staged_a[id(a)] = cursor
                rows.append((a, chunks_in))
                cursor += a.shape[0] * chunks_in
            layout.append((layer, proj, a.shape[0], a_offset, cursor))
            rows.append((b.t(), chunks_out))
            cursor += b.shape[1] * chunks_out
        pages = _stage_rows(rows, cursor, page, self.pool.pages.dtype)
        if pin and self.pool.pages.is_cuda:
            pages = pages.pin_memory()
        return StagedAdapter(pages, layout)

    def place(self, slot: int, staged: StagedAdapter | dict) -> bool:
        """Sends a staged adapter (or its weights, staged here) into free pool pages and publishes its
        table rows. False (nothing taken) when the pool is short.

        On cuda the copy runs on a side stream; the compute stream waits for it on an event, so the
        host never blocks and a prefetch overlaps the step in flight. Free pages are never read by work
        in flight (their last owner's steps ended before they were freed), so the copy needs no wait."""
        load = self._place(slot, staged, layerwise=False)
        if load is None:
            return False
        load.join()
        return True

    def place_layerwise(self, slot: int, staged: StagedAdapter | dict) -> LayerwiseLoad | None:
        """Like `place`, but the compute stream does not wait: the table rows go first, then the pages
        layer by layer in forward order on the copy stream, with one event per layer. The caller
        makes the compute stream wait per layer (`LayerwiseLoad.wait`) before a kernel reads that
        layer of this slot, and `join()`s before the slot is used without such care (at the latest
        before the next step). None (nothing taken) when the pool is short."""
        return self._place(slot, staged, layerwise=True)

    def enable_streaming(self) -> None:
        """Makes `place_streamed` available (cuda only). Call before any kernel that reads the table is
        compiled or captured: the LoRA kernels check `ready` only when this is on."""
        if not self.pool.pages.is_cuda:
            raise RuntimeError("streamed adapter placement needs the pool on a cuda device")
        if self._streamer is None:
            self._streamer = _Streamer(self)
        # `ready` was filled on the current stream; the copy stream writes it from now on
        torch.cuda.current_stream().synchronize()
        self.streaming = True

    def place_streamed(self, slot: int, staged: StagedAdapter) -> StreamedLoad | None:
        """Like `place_layerwise`, but the compute stream waits for no event: the table rows go out now (the
        compute stream waits for those: `StreamedLoad.publish`), and the pages follow when the caller
        `issue()`s them, layer by layer in forward order on the table's stream for streamed copies, each
        layer then raising `ready[slot]`. A LoRA kernel reading layer l of the slot waits on the device until
        ready[slot] > l, so the forward that needs the adapter can be launched before its pages are sent, as
        one CUDA graph, and each layer's kernels start as soon as its pages are in.

        The caller must `issue()` before launching that forward: a kernel on the device may then wait only
        for copies queued before it. Launching first and queueing the pages after deadlocks wherever the
        compute stream and the streaming stream share one of the device's hardware work queues (the driver
        multiplexes streams onto CUDA_DEVICE_MAX_CONNECTIONS queues, 8 by default, each in order): the copies
        then sit behind the kernel that spins for them, until its timeout, launch after launch. Which streams
        share a queue is the driver's choice, so only the order is safe; the copies still run beside the
        forward on the copy engine. From a pageable source each layer's copy returns once the driver has
        staged it through its own pinned buffers (~10 GB/s on the H100 host): `issue()` then holds the host a
        few milliseconds before the launch; from a pinned one it only queues.
        `StreamedLoad.join` before the slot is used without that care. None when the pool is short."""
        if not self.streaming:
            raise RuntimeError("place_streamed needs enable_streaming() first")
        ids = self.pool.alloc(staged.pages.shape[0], "adapter")
        if ids is None:
            return None
        start = self._record_placement(slot, staged, ids)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.pool.pages.device)
        streamer = self._streamer
        with torch.cuda.stream(self._copy_stream):
            # ready first, then the rows: no kernel can see the new rows with the last owner's ready
            self.ready[slot : slot + 1].copy_(streamer.values[:1], non_blocking=True)
            self._publish(slot, start, len(ids))
            published = _recorded()
        streamer.stream.wait_event(published)
        return StreamedLoad(slot, published, self, staged, ids)

    def _record_placement(self, slot: int, staged: StagedAdapter, ids: np.ndarray) -> int:
        """The slot's host table rows and index entries -> the start of its page ids in the index."""
        needed = len(ids)
        if self._index_end + needed > len(self.page_ids_host):
            self._compact()
        start = self._index_end
        for layer, proj, rank, a_offset, b_offset in staged.layout:
            self.rank_host[slot, layer, proj] = rank
            self.a_start_host[slot, layer, proj] = start + a_offset
            self.b_start_host[slot, layer, proj] = start + b_offset
        self.page_ids_host[start : start + needed] = ids
        self._index_end = start + needed
        self.placements[slot] = AdapterPlacement(slot, ids, start, needed)
        return start

    def _place(self, slot: int, staged: StagedAdapter | dict, layerwise: bool) -> LayerwiseLoad | None:
        if not isinstance(staged, StagedAdapter):
            staged = self.stage(staged)
        needed = staged.pages.shape[0]
        ids = self.pool.alloc(needed, "adapter")
        if ids is None:
            return None
        pages = self.pool.pages
        one_run = ids[-1] - ids[0] == needed - 1  # alloc's ids are ascending and distinct
        if pages.is_cuda:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(pages.device)
            if one_run and not layerwise:  # the common case: the DMA starts before any bookkeeping below
                with torch.cuda.stream(self._copy_stream):
                    pages[ids[0] : ids[0] + needed].copy_(staged.pages, non_blocking=True)
        start = self._record_placement(slot, staged, ids)
        if not pages.is_cuda:
            pages.index_copy_(0, torch.from_numpy(ids).long(), staged.pages)
            self._publish(slot, start, needed)
            return LayerwiseLoad(slot, [None] * self.num_layers, None)
        with torch.cuda.stream(self._copy_stream):  # every copy here is async: the host goes on
            if not layerwise:
                if not one_run:
                    _copy_pages(pages, staged.pages, ids)
                self._publish(slot, start, needed)
                return LayerwiseLoad(slot, [None] * self.num_layers, _recorded())
            self._publish(slot, start, needed)  # small: every layer's event covers the table rows
            events: list = [None] * self.num_layers
            for layer, (first, last) in _layer_bounds(staged.layout, needed).items():
                _copy_pages(pages, staged.pages[first:last], ids[first:last])
                events[layer] = _recorded()
            return LayerwiseLoad(slot, events, _recorded())

    def place_at(self, slot: int, staged: StagedAdapter, page_ids: np.ndarray) -> None:
        """Places a staged adapter into pages another pool chose: a tensor-parallel rank mirrors rank 0's placements
        into the same page ids (daemon/engine/tp_worker.py), whose pool keeps the free list. The copy and the table
        rows go on the current stream, after any step that read those pages before."""
        ids = np.asarray(page_ids, dtype=np.int32)
        if len(ids) != staged.pages.shape[0]:
            raise ValueError(f"{len(ids)} page ids for an adapter of {staged.pages.shape[0]} pages")
        self.pool.used["adapter"] += len(ids)
        start = self._record_placement(slot, staged, ids)
        pages = self.pool.pages
        pages.index_copy_(0, torch.from_numpy(ids).long().to(pages.device), staged.pages.to(pages.device))
        self._publish(slot, start, len(ids))

    def evict(self, slot: int) -> None:
        placement = self.placements.pop(slot)
        self.pool.free(placement.page_ids, "adapter")
        self.rank_host[slot] = 0
        if self._copy_stream is not None:  # ordered before the next placement's rows, which it publishes
            with torch.cuda.stream(self._copy_stream):
                self.rank[slot] = 0
        else:
            self.rank[slot] = 0

    def copy_fence(self) -> list:
        """Events recorded now (any thread) on each stream that copies from staged adapters (placements, streamed
        ones), as blocking events: once all have completed, no copy queued before this call reads its source."""
        fence = []
        for stream in (self._copy_stream, self._streamer.stream if self._streamer is not None else None):
            if stream is not None:
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                fence.append(event)
        return fence

    def untargeted(self, slots) -> frozenset[int]:
        """The projections that none of the adapters in `slots` targets in any layer (host mirrors, no sync)."""
        return untargeted(self.rank_host[np.asarray(slots, dtype=np.int64)])

    def _publish(self, slot: int, start: int, length: int) -> None:
        """Sends a slot's table rows and its page ids to the device in one copy, from pinned memory on
        cuda so that it never makes the host wait (torch's pinned-host cache recycles the buffer only
        once the copy is done)."""
        rows = np.concatenate((
            self.rank_host[slot].ravel(), self.a_start_host[slot].ravel(), self.b_start_host[slot].ravel(),
            self.page_ids_host[start : start + length],
        ))
        host = torch.from_numpy(rows)
        if self.rank.is_cuda:
            host = host.pin_memory()
        packed = host.to(self.rank.device, non_blocking=True)
        width = self.rank_host[slot].size
        self.rank[slot] = packed[:width].view(self.rank.shape[1:])
        self.a_start[slot] = packed[width : 2 * width].view(self.rank.shape[1:])
        self.b_start[slot] = packed[2 * width : 3 * width].view(self.rank.shape[1:])
        self.page_ids[start : start + length] = packed[3 * width :]

    def _compact(self) -> None:
        """Close the holes evicted adapters left in page_ids: each resident adapter's entries move
        down and its starts shift by the same amount.

        On cuda the moves go on the current stream, behind the steps queued there, which read the entries where they
        were. The copy stream publishes a placement without waiting for those steps, into index entries past the
        compacted end, where a moved adapter's entries may have been: from here on it waits for them (a step in
        flight would read the new adapter's page ids as the moved one's: wrong LoRA for its rows in that step). The
        moves wait for the publications queued on the copy stream before (a streamed placement's, not joined yet),
        which write their slot's starts from before the move."""
        copy = self._copy_stream
        if copy is not None:
            torch.cuda.current_stream().wait_stream(copy)
        end = 0
        for slot in sorted(self.placements, key=lambda s: self.placements[s].index_start):
            placement = self.placements[slot]
            shift = placement.index_start - end
            if shift:
                old = slice(placement.index_start, placement.index_start + placement.index_len)
                self.page_ids_host[end : end + placement.index_len] = self.page_ids_host[old].copy()
                targeted = self.rank_host[slot] > 0
                self.a_start_host[slot][targeted] -= shift
                self.b_start_host[slot][targeted] -= shift
                placement.index_start = end
                self._publish(slot, end, placement.index_len)
            end += placement.index_len
        self._index_end = end
        if copy is not None:
            copy.wait_stream(torch.cuda.current_stream())
        log.debug("adapter index compacted end=%d", end)


@dataclass
class LayerwiseLoad:
    """The copy of one adapter into the pool, as the compute stream sees it.

    events[layer]: a CUDA event recorded on the copy stream once that layer's pages (and the slot's
    table rows) are in the pool; None where the layer has no pages, and on the CPU, where the copy
    was done before `place` returned. `done`: the event after the whole copy (None on the CPU).
    Nothing here blocks the host: `arrived` is a query, `wait` and `join` enqueue waits."""

    slot: int
    events: list
    done: object

    @property
    def on_device(self) -> bool:
        return self.done is not None

    def arrived(self, layer: int) -> bool:
        """Whether layer `layer` of the adapter is in the pool now (a non-blocking event query)."""
        event = self.events[layer]
        return event is None or event.query()

    def wait(self, layer: int) -> None:
        """The current stream waits for layer `layer`'s pages (free when `arrived` said so)."""
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def join(self) -> None:
        """The current stream waits for the whole copy: afterwards any kernel may read the slot."""
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)


@dataclass
class StreamedLoad:
    """One adapter's streamed copy (`AdapterTable.place_streamed`).

    published: the event after the slot's table rows (and ready[slot] = 0) were sent; `make_current_stream_wait()` makes
    the current stream wait for it, which any kernel reading the slot needs. `issue()` queues the pages
    not yet queued; `issue_streamed(..., until=...)` may queue only the first layers, the rest later.
    `join()` issues what is left, then makes the current stream wait for the whole copy. `abandon()` ends
    it where it stands (an adapter evicted before any kernel read it). `error`: why queueing the copy
    failed, if it did (ready[slot] was then raised to the end, so no kernel waits for it: the requests that
    read the slot must be failed and the adapter dropped)."""

    slot: int
    published: object
    table: AdapterTable
    source: StagedAdapter | None  # the staged pages, until issued
    ids: np.ndarray
    done: object = None  # the event after the last copy
    error: str | None = None
    layers: list = field(init=False)  # [(layer, (first, last))] not yet queued, in forward order

    def __post_init__(self):
        self.layers = list(_layer_bounds(self.source.layout, len(self.ids)).items())

    @property
    def issued(self) -> bool:
        return self.done is not None

    @property
    def layers_left(self) -> int:
        return len(self.layers)

    def make_current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.published)

    def issue(self) -> None:
        """Queues every layer's pages and ready word not yet queued (`issue_streamed`). Idempotent."""
        issue_streamed([self])

    def _send_next(self) -> None:
        """The next layer's pages (staged rows first..last), then ready[slot] = layer + 1, on the current
        stream, by DMA alone (no kernel may run on the streaming stream): past MAX_DIRECT_RUNS runs of pages, queued
        from C++ in one call where the extension is usable (a torch copy a run costs the host ~10 us); the load ended
        after its last layer."""
        layer, (first, last) = self.layers[0]
        table, source = self.table, self.source.pages
        runs = _run_array(self.ids[first:last])
        if len(runs) > MAX_DIRECT_RUNS and table.copy_path == "cuda-ext":
            runs[:, 0] += first
            cuda_ext.copy_rows(table.pool.pages, source, runs, tail=table._streamer.ready_word(self.slot, layer + 1))
        else:
            _dma_runs(table.pool.pages, source[first:last], runs.tolist())
            table._streamer.raise_ready(self.slot, layer + 1)
        table.streamed_runs["layers"] += 1
        table.streamed_runs["runs"] += len(runs)
        self.layers.pop(0)
        if not self.layers:
            self._end(None)

    def _end(self, error: str | None) -> None:
        """ready[slot] to the end (on the current stream), the done event; the source let go (the staged
        caches keep it alive while its copies run)."""
        self.error = error
        self.layers = []
        self.table._streamer.raise_ready(self.slot, self.table.num_layers)
        self.done = _recorded()
        self.source = None

    def join(self) -> None:
        self.issue()
        torch.cuda.current_stream().wait_event(self.done)

    def abandon(self) -> None:
        """Ends the copy without queueing the layers left (ready[slot] raised to the end, as a placement
        that is not streamed expects), and orders the current stream and the table's copy stream after what
        was queued: the slot's pages may then go to another owner."""
        if self.done is None:
            with torch.cuda.stream(self.table._streamer.stream):
                self._end("abandoned")
        torch.cuda.current_stream().wait_event(self.done)
        if self.table._copy_stream is not None:
            self.table._copy_stream.wait_event(self.done)


def issue_streamed(loads: list[StreamedLoad], until: Callable[[], bool] | None = None) -> bool:
    """Queues the layers not yet queued of `loads` on the streaming stream, layer-major: layer 0 of every
    adapter, then layer 1, ..., so a forward reading several streamed adapters waits for each of its layers
    only as long as that layer takes. `until`: asked before each layer; once it says True the rest stays for
    a later call (a copy queued ahead, while the host would otherwise wait for the device). -> whether every
    load is fully queued. No call here waits for the device (a pageable source's copy waits for the driver's
    staging of the host memory and for earlier copies on the streaming stream, nothing else). A load that
    fails is ended at once (its `error` set, its kernels released); the others go on."""
    pending = [load for load in loads if load.done is None]
    if not pending:
        return True
    work = sorted((layer, order, load) for order, load in enumerate(pending) for layer, _ in load.layers)
    with torch.cuda.stream(pending[0].table._streamer.stream):
        for load in pending:
            if not load.layers:  # nothing to copy: ended at once
                load._end(None)
        for _, _, load in work:
            if load.done is not None:  # failed on an earlier layer
                continue
            if until is not None and until():
                return False
            try:
                load._send_next()
            except Exception as error:  # the requests on this slot fail; the engine goes on
                log.exception("streamed adapter copy failed slot=%d", load.slot)
                load._end(f"the adapter's copy to the GPU failed: {error}")
    return True


class _Streamer:
    """The stream of streamed placements and the pinned sources of their `ready` words. Only copies run on
    that stream (DMA, no kernel), so a LoRA kernel spinning on `ready` never holds up a copy it waits for."""

    def __init__(self, table: AdapterTable):
        self.table = table
        self.stream = torch.cuda.Stream(table.pool.pages.device)
        self.values = torch.arange(table.num_layers + 1, dtype=torch.int32).pin_memory()

    def raise_ready(self, slot: int, value: int) -> None:
        """ready[slot] = value, by a 4-byte DMA on the current stream."""
        target, word = self.ready_word(slot, value)
        target.copy_(word, non_blocking=True)

    def ready_word(self, slot: int, value: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ready[slot], the pinned word holding `value`): the copy that raises it."""
        return self.table.ready[slot : slot + 1], self.values[value : value + 1]


def _recorded():
    event = torch.cuda.Event()
    event.record()  # on the current stream: the copy stream, inside `with torch.cuda.stream(...)`
    return event


def _copy_pages(pages: torch.Tensor, staged: torch.Tensor, ids: np.ndarray) -> None:
    """pages[ids[i]] = staged[i], on the current stream, never waiting on the host: straight DMA from
    pinned memory per run of consecutive ids, or one copy up and a scatter when the ids are scattered."""
    runs = _runs(ids)
    if len(runs) <= MAX_DIRECT_RUNS:
        _dma_runs(pages, staged, runs)
    else:
        ids_device = torch.from_numpy(ids.astype(np.int64)).pin_memory().to(pages.device, non_blocking=True)
        pages.index_copy_(0, ids_device, staged.to(pages.device, non_blocking=True))


def _dma_runs(pages: torch.Tensor, staged: torch.Tensor, runs) -> None:
    """pages[first : first + length] = staged[offset : offset + length] for each (offset, first, length), one torch copy
    (a DMA from pinned memory) a run, on the current stream."""
    for offset, first, length in runs:
        pages[first : first + length].copy_(staged[offset : offset + length], non_blocking=True)


def _layer_bounds(layout: list[tuple[int, int, int, int, int]], total: int) -> dict[int, tuple[int, int]]:
    """layer -> [first, last) of its pages in a staged adapter (`stage` writes layers in order)."""
    firsts: dict[int, int] = {}
    for layer, _, _, a_offset, _ in layout:
        firsts.setdefault(layer, a_offset)
    layers = sorted(firsts)
    ends = [firsts[layer] for layer in layers[1:]] + [total]
    return {layer: (firsts[layer], end) for layer, end in zip(layers, ends)}


def _run_array(ids: np.ndarray) -> np.ndarray:
    """Each run of consecutive page ids as a row (offset in ids, first page, length) of an int64 array [R, 3]."""
    if not len(ids):
        return np.empty((0, 3), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    runs = np.empty((len(starts), 3), dtype=np.int64)
    runs[:, 0] = starts
    runs[:, 1] = ids[starts]
    runs[:, 2] = np.diff(np.concatenate((starts, [len(ids)])))
    return runs


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(offset in ids, first page, length) of each run of consecutive page ids."""
    return [tuple(run) for run in _run_array(ids).tolist()]


def _stage_rows(rows: list[tuple[torch.Tensor, int]], count: int, page: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` pages of `dtype` holding each matrix [r, d] of `rows` in turn, every row padded with zeros to its
    `chunks` whole pages. In few torch calls (one split, a view of each matrix that does not fill whole pages of one
    row, one copy of them all with the cast to the pool's dtype): a stager thread takes the GIL for each call, and
    beside the engine thread's host work the ~6 calls a matrix of a copy each made a 7B adapter's layout 3-4x slower
    (BENCHMARKS.md, figure 21.1)."""
    padded = any(matrix.shape[1] != chunks * page for matrix, chunks in rows)
    pages = (torch.zeros if padded else torch.empty)(count, page, dtype=dtype)  # empty: every row is written
    targets = []
    for block, (matrix, chunks) in zip(pages.split([matrix.shape[0] * chunks for matrix, chunks in rows]), rows):
        if chunks > 1:  # a row over several pages
            block = block.view(matrix.shape[0], chunks * page)
        targets.append(block if matrix.shape[1] == chunks * page else block[:, : matrix.shape[1]])
    if targets:
        torch._foreach_copy_(targets, [matrix for matrix, _ in rows])
    return pages


def gather_rows(pages: torch.Tensor, page_ids: torch.Tensor, start: int, rank: int, chunks: int, width: int) -> torch.Tensor:
    """The [rank, width] matrix stored from index `start` (the reference path's view of a weight)."""
    ids = page_ids[start : start + rank * chunks].long()
    return pages[ids].view(rank, chunks * pages.shape[1])[:, :width]


def untargeted(ranks: np.ndarray) -> frozenset[int]:
    """The projections with rank 0 in every row of `ranks` [slots, layers, projections] (AdapterTable.rank_host rows)."""
    return frozenset(int(proj) for proj in np.flatnonzero(~(ranks > 0).any(axis=(0, 1))))
