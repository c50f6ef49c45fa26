"""Pinned host memory for staged adapters, pinned once at start-up and handed out in ranges.

torch's `pin_memory` pins a fresh block (cudaHostAlloc) for each staged adapter it has no cached block of that size
for: the driver locks and maps the pages at ~1 GB/s, and while it does, other threads' launches wait for it. On the
Azure trace the stager threads pinned ~80 cold adapters (53.6 ms each) in a run's first seconds, and the engine
thread's steps launched late beside them (BENCHMARKS.md, figure 21.1). From an arena a staged adapter's pinned copy
is a plain memcpy.

The memory is pinned as blocks whose sizes are powers of two (`segment_sizes`), because torch's pinned allocator rounds
each block up to one: a 5 GiB budget pinned as one block would pin 8. A range lies within one block.

A range is handed out as a uint8 tensor; it comes back when the last tensor viewing its memory is gone (its storage's
deleter) and the copies queued from it have run: `fence` gives events recorded on the streams that copy from staged
adapters at that moment, and the range is reused once they have all completed.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

ALIGN = 4096  # every range starts on a host page
_SPACING = 1 << 48  # offsets of block i start at i * _SPACING, so that no range or merge crosses blocks

log = logging.getLogger(__name__)


class PinnedArena:
    """Up to `capacity` bytes of host memory (`segment_sizes`), pinned (cudaHostAlloc) unless `pin` is False (tests on
    the CPU), handed out best fit; `fence() -> events` (anything with `query()`), asked when a range comes back.
    Thread-safe: stager threads allocate, whichever thread drops a range's last tensor returns it."""

    def __init__(self, capacity: int, pin: bool = True, fence: Callable[[], list] | None = None):
        started = time.perf_counter()
        self.segments = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in segment_sizes(capacity)]
        self.start_seconds = time.perf_counter() - started
        self.capacity = sum(segment.numel() for segment in self.segments)
        self.largest_range = max((segment.numel() for segment in self.segments), default=0)  # the most one alloc gets
        self.fence = fence
        self._addresses = [segment.data_ptr() for segment in self.segments]
        self._lock = threading.Lock()
        # (offset, length), by offset; block i's offsets from i * _SPACING
        self._free: list[tuple[int, int]] = [(index * _SPACING, segment.numel()) for index, segment in enumerate(self.segments)]
        self._fenced: list[tuple[int, int, list]] = []  # back, waiting for their copies: (offset, length, events)
        self._returned: collections.deque = collections.deque()  # appended by storage deleters, on any thread
        self.used = 0  # bytes handed out and not back yet (fenced ones included)
        self.allocations = 0
        self.failed = 0  # allocations that found no range

    def alloc(self, nbytes: int, wait: bool = False) -> torch.Tensor | None:
        """A uint8 tensor [nbytes] of the arena's memory, or None where no free range is large enough. `wait`: first
        wait (blocking this thread only) for the fences of ranges that have come back, while they alone stand in
        the way."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        while True:
            with self._lock:
                self._reclaim()
                offset = self._take(size)
                if offset is not None:
                    self.used += size
                    self.allocations += 1
                    break
                fenced = self._fenced[0][2] if self._fenced else None
                if not wait or fenced is None:
                    self.failed += 1
                    return None
            for event in fenced:
                event.synchronize()
        view = np.asarray(_Range(self, offset, size, nbytes))
        return torch.from_numpy(view)  # holds `view`, whose base is the range: its deleter returns it

    def stats(self) -> dict:
        with self._lock:
            self._reclaim()
            free = [length for _, length in self._free]
            fenced = sum(length for _, length, _ in self._fenced)
        return {"capacity_bytes": self.capacity, "used_bytes": self.used - fenced, "fenced_bytes": fenced,
                "largest_free_bytes": max(free, default=0), "free_ranges": len(free), "allocations": self.allocations,
                "failed": self.failed, "segments": len(self.segments),
                "pinned": all(segment.is_pinned() for segment in self.segments), "start_ms": round(self.start_seconds * 1e3, 1)}

    def address(self, offset: int) -> int:
        """The host address of an arena offset."""
        return self._addresses[offset // _SPACING] + offset % _SPACING

    def _give_back(self, offset: int, size: int) -> None:
        """A range's last tensor is gone (any thread, maybe inside another call of this arena: no lock here)."""
        try:
            events = self.fence() if self.fence is not None else []
        except Exception:  # noqa: BLE001 - interpreter shutdown, a device gone: never reuse this range
            log.debug("pinned range offset=%d kept out of use: its fence failed", offset, exc_info=True)
            return
        self._returned.append((offset, size, events))

    def _reclaim(self) -> None:
        """Under the lock: ranges given back go to `_fenced`; those whose fences have passed go back to `_free`."""
        while self._returned:
            self._fenced.append(self._returned.popleft())
        waiting = []
        for offset, size, events in self._fenced:
            if all(event.query() for event in events):
                self._insert(offset, size)
                self.used -= size
            else:
                waiting.append((offset, size, events))
        self._fenced = waiting

    def _take(self, size: int) -> int | None:
        """The smallest free range of at least `size` bytes, its front cut off -> its offset."""
        best = None
        for index, (_, length) in enumerate(self._free):
            if length >= size and (best is None or length < self._free[best][1]):
                best = index
        if best is None:
            return None
        offset, length = self._free[best]
        if length == size:
            del self._free[best]
        else:
            self._free[best] = (offset + size, length - size)
        return offset

    def _insert(self, offset: int, size: int) -> None:
        """A range back into `_free`, merged with the free ranges it touches."""
        free = self._free
        index = bisect.bisect_left(free, (offset,))
        if index < len(free) and offset + size == free[index][0]:
            size += free[index][1]
            del free[index]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == offset:
            offset, size = free[index - 1][0], free[index - 1][1] + size
            index -= 1
            del free[index]
        free.insert(index, (offset, size))


class _Range:
    """One range of an arena, as numpy sees it (`__array_interface__`): the array made from it keeps it alive,
    the tensor made from that array keeps the array alive, and when the tensor's storage is freed this goes back."""

    def __init__(self, arena: PinnedArena, offset: int, size: int, nbytes: int):
        self.arena, self.offset, self.size = arena, offset, size
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (arena.address(offset), False),
                                    "version": 3}

    def __del__(self):
        self.arena._give_back(self.offset, self.size)


def segment_sizes(capacity: int) -> list[int]:
    """The blocks pinned for `capacity` bytes, largest first: its binary digits of ALIGN and above (one block for the
    default 4 GiB)."""
    return [1 << bit for bit in reversed(range(capacity.bit_length())) if capacity >> bit & 1 and 1 << bit >= ALIGN]
