"""The host adapter store: many adapters' A and B^T (float32) in one shared segment, so that CPU LoRA
workers compute from the very bytes the engine loaded, with no copy and no pickling.

Layout:
    header  one line: MAGIC, VERSION, index_bytes, generation (a seqlock flag), index length
    index   index_bytes of JSON: {"next_id", "adapters": {name: {"id", "offset", "size", "modules":
            [[layer, proj, rank, in, out, a_offset, b_offset], ...]}}}
    data    one first-fit block per adapter holding, per (layer, proj), A [r, in] then B^T [r, out],
            each 64-byte aligned (B^T as DESIGN.md stores it: the LoRA scaling already folded in)

One process (the owner, the engine) writes; any number attach and read. The owner copies an adapter's
matrices first and publishes the index after, under a seqlock: `generation` is odd while the index is
being rewritten, and a reader retries when it saw an odd or a changed generation. Ids are never
reused, so a job naming a removed adapter fails instead of reading someone else's weights. The owner
must not `remove()` an adapter while a job on it is in flight: its block may be reused at once.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from lorad.shm.flags import Flag
from lorad.shm.segment import ALIGNMENT, Segment, align, segment_name

from lorad.errors import Overloaded

MAGIC = 0x6C6F7261646C7374  # "loradlst"
VERSION = 1
HEADER = ALIGNMENT
GENERATION_OFFSET, LENGTH_OFFSET = 24, 32
FLOAT_BYTES = 4


class StoreFull(Overloaded):
    """The adapter (or its index entry) does not fit; the owner evicts and retries, or serves it
    without CPU assistance."""


class AdapterStore:
    """`AdapterStore.create(instance, capacity_bytes)` in the engine, `AdapterStore.attach(name)` in a
    worker. `put(adapter)` (owner) -> adapter id; `get_views(name or id)` -> {(layer, proj): (A, B^T)}
    torch views of the shared memory; `lookup(adapter_id, layer, proj)` is the workers' hot path."""

    def __init__(self, segment: Segment):
        self.segment = segment
        magic, version, self.index_bytes = segment.array(0, 3, np.int64).tolist()
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"{segment.name} is not a lorad adapter store of version {VERSION}")
        self.generation = Flag(segment.buffer, GENERATION_OFFSET)
        self._length = segment.array(LENGTH_OFFSET, 1, np.int64)
        self._index_text = segment.array(HEADER, self.index_bytes, np.uint8)
        self.data_offset = align(HEADER + self.index_bytes)
        # The parsed index of `_seen` generation: name -> entry, id -> {(layer, proj): (A, B^T) views}.
        self._seen = -1
        self._index: dict = {"next_id": 0, "adapters": {}}
        self._by_id: dict[int, dict] = {}
        self._views: dict[int, dict] = {}
        self._free: list[tuple[int, int]] = []  # the owner's allocator: sorted (offset, size)
        if segment.owner:
            self._free = [(self.data_offset, segment.size - self.data_offset)]

    @classmethod
    def create(
        cls, instance: str, capacity_bytes: int, index_bytes: int = 1 << 20, purpose: str = "store"
    ) -> AdapterStore:
        index_bytes = align(index_bytes)
        size = align(HEADER + index_bytes) + align(capacity_bytes)
        segment = Segment.create(segment_name(instance, purpose), size)
        segment.array(0, 3, np.int64)[:] = (MAGIC, VERSION, index_bytes)
        store = cls(segment)
        store._publish()
        return store

    @classmethod
    def attach(cls, name: str) -> AdapterStore:
        segment = Segment.attach(name)
        try:
            return cls(segment)
        except BaseException:
            segment.close()
            raise

    @property
    def name(self) -> str:
        return self.segment.name

    # The owner's side.

    def put(self, adapter) -> int:
        """Copy `adapter.weights` {(layer, proj): (A [r, in], B [out, r])} in (B stored transposed);
        returns its id. An adapter of the same name is replaced (and gets a new id)."""
        self._require_owner()
        modules, cursor, stored_a = [], 0, {}  # an A shared by projections (a fused module's members) is stored once
        for (layer, proj), (a, b) in sorted(adapter.weights.items()):
            rank, in_features = a.shape
            out_features = b.shape[0]
            if b.shape[1] != rank:
                raise ValueError(f"{adapter.name} ({layer}, {proj}): A {tuple(a.shape)} and B {tuple(b.shape)} disagree")
            a_offset = stored_a.get(id(a))
            if a_offset is None:
                a_offset = stored_a[id(a)] = cursor
                cursor = align(a_offset + rank * in_features * FLOAT_BYTES)
            b_offset = cursor
            cursor = align(b_offset + rank * out_features * FLOAT_BYTES)
            modules.append([layer, proj, rank, in_features, out_features, a_offset, b_offset])
        size = max(cursor, ALIGNMENT)
        if adapter.name in self._index["adapters"]:
            self.remove(adapter.name)
        offset = self._allocate(size)
        weights = adapter.weights
        for module in modules:
            layer, proj, rank, in_features, out_features, a_offset, b_offset = module
            module[5], module[6] = a_offset + offset, b_offset + offset
            a, b = weights[(layer, proj)]
            self.segment.array(module[5], (rank, in_features), np.float32)[:] = _numpy(a)
            self.segment.array(module[6], (rank, out_features), np.float32)[:] = _numpy(b).T
        adapter_id = self._index["next_id"]
        self._index["next_id"] += 1
        self._index["adapters"][adapter.name] = {"id": adapter_id, "offset": offset, "size": size, "modules": modules}
        try:
            self._publish()
        except StoreFull:
            del self._index["adapters"][adapter.name]
            self._release(offset, size)
            raise
        return adapter_id

    def remove(self, name: str) -> None:
        self._require_owner()
        entry = self._index["adapters"].pop(name)
        self._publish()
        self._release(entry["offset"], entry["size"])

    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def _require_owner(self) -> None:
        if not self.segment.owner:
            raise PermissionError(f"only the process that created {self.name} writes to it")

    def _allocate(self, size: int) -> int:
        for position, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[position]
                else:
                    self._free[position] = (offset + size, free - size)
                return offset
        raise StoreFull(f"adapter store {self.name}: no free block of {size} bytes ({self.free_bytes()} free in all)")

    def _release(self, offset: int, size: int) -> None:
        blocks = sorted(self._free + [(offset, size)])
        merged = [blocks[0]]
        for start, length in blocks[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self._free = merged

    def _publish(self) -> None:
        text = json.dumps(self._index, separators=(",", ":")).encode()
        if len(text) > self.index_bytes:
            raise StoreFull(f"adapter store {self.name}: index of {len(text)} bytes exceeds {self.index_bytes}")
        generation = self.generation.load()
        self.generation.store(generation + 1)  # odd: being rewritten
        self._index_text[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        self._length[0] = len(text)
        self.generation.store(generation + 2)

    # Everyone's side.

    def refresh(self, timeout_s: float = 1.0) -> None:
        """Re-read the index if the owner has published a new one since."""
        deadline = time.monotonic() + timeout_s
        while True:
            before = self.generation.load()
            if before == self._seen:
                return
            if before % 2 == 0:
                text = self._index_text[: int(self._length[0])].tobytes()
                if self.generation.load() == before:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"adapter store {self.name}: index kept changing for {timeout_s} s")
            time.sleep(10e-6)
        index = json.loads(text)
        self._by_id = {entry["id"]: entry for entry in index["adapters"].values()}
        self._views = {}
        self._seen = before
        if not self.segment.owner:
            self._index = index

    @property
    def seen_generation(self) -> int:
        """The generation of the index this reader last parsed (`refresh`): the views it hands out
        are that index's."""
        return self._seen

    def names(self) -> list[str]:
        self.refresh()
        return sorted(self._index["adapters"])

    def adapter_id(self, name: str) -> int:
        self.refresh()
        return self._index["adapters"][name]["id"]

    def get_views(self, adapter: str | int) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """{(layer, proj): (A [r, in], B^T [r, out])}: float32 torch views of the shared memory.
        Raises KeyError for an adapter that is not (or no longer) stored."""
        self.refresh()
        adapter_id = self._index["adapters"][adapter]["id"] if isinstance(adapter, str) else adapter
        views = self._views.get(adapter_id)
        if views is None:
            views = {}
            for layer, proj, rank, in_features, out_features, a_offset, b_offset in self._by_id[adapter_id]["modules"]:
                views[(layer, proj)] = (
                    self.segment.tensor(a_offset, (rank, in_features)),
                    self.segment.tensor(b_offset, (rank, out_features)),
                )
            self._views[adapter_id] = views
        return views

    def lookup(self, adapter_id: int, layer: int, proj: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B^T [r, out]) of one module; KeyError if the adapter or the module is absent."""
        return self.get_views(adapter_id)[(layer, proj)]

    def close(self) -> None:
        self._views = {}
        self.generation = self._length = self._index_text = None
        self.segment.close()

    def __enter__(self) -> AdapterStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _numpy(matrix) -> np.ndarray:
    if isinstance(matrix, torch.Tensor):
        return matrix.detach().to("cpu", torch.float32).numpy()
    return np.asarray(matrix, dtype=np.float32)
