"""gpu_ops/page_pool.py: the free list's accounting, KV blocks, and adapter weights laid out in pages
and read back through the table (gather_rows) after placement, eviction and index compaction."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from lorad.gpu_ops.page_pool import SCRATCH_PAGE, AdapterTable, BlockList, KVCache, PagePool, gather_rows

HIDDEN, INTERMEDIATE, LAYERS = 64, 172, 3
Q, KV = 64, 32  # 4 heads of 16; 2 KV heads of 16 (GQA)
SHAPES = [(HIDDEN, Q), (HIDDEN, KV), (HIDDEN, KV), (Q, HIDDEN), (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]


def make_pool(num_pages: int, page: int = HIDDEN) -> PagePool:
    return PagePool(num_pages, page, torch.float32, torch.device("cpu"))


# --- PagePool ---------------------------------------------------------------------------------------


def test_pool_needs_two_pages():
    with pytest.raises(ValueError):
        make_pool(1)


def test_alloc_free_accounting_never_hands_out_scratch():
    rng = random.Random(0)
    pool = make_pool(50)
    assert pool.capacity == 49 and pool.num_free == 49
    held: dict[str, list[list[int]]] = {"kv": [], "adapter": []}
    for _ in range(300):
        owner = rng.choice(["kv", "adapter"])
        if rng.random() < 0.55:
            count = rng.randint(0, 12)
            free_before = pool.num_free
            ids = pool.alloc(count, owner)
            if count > free_before:
                assert ids is None
                assert pool.num_free == free_before
            else:
                assert ids is not None and len(ids) == count
                assert SCRATCH_PAGE not in ids
                assert all(1 <= i < 50 for i in ids)
                held[owner].append(ids)
        elif held[owner]:
            ids = held[owner].pop(rng.randrange(len(held[owner])))
            pool.free(ids, owner)
        everything = [i for lists in held.values() for ids in lists for i in ids]
        assert len(everything) == len(set(everything)), "a page was handed out twice"
        for name in ("kv", "adapter"):
            assert pool.used[name] == sum(len(ids) for ids in held[name])
        occupancy = pool.occupancy()
        assert occupancy["free"] + occupancy["kv"] + occupancy["adapter"] == occupancy["pages"] == 49
        assert occupancy["page_bytes"] == HIDDEN * 4


def test_alloc_beyond_free_takes_nothing():
    pool = make_pool(10)
    first = pool.alloc(6, "kv")
    assert pool.alloc(4, "adapter") is None
    assert pool.num_free == 3 and pool.used == {"kv": 6, "adapter": 0}
    rest = pool.alloc(3, "adapter")
    assert sorted([*first.tolist(), *rest.tolist()]) == list(range(1, 10))
    assert pool.alloc(1, "kv") is None


class FakeEvent:
    """A device event the test passes by hand: query() says whether the device is past it; synchronize() waits."""

    made: list[FakeEvent] = []

    def __init__(self):
        self.passed = self.recorded = False
        self.waited = 0
        FakeEvent.made.append(self)

    def record(self):
        self.recorded = True

    def query(self):
        return self.passed

    def synchronize(self):
        self.waited += 1
        self.passed = True


def test_fenced_pages_go_out_again_only_after_the_device_passed_their_step():
    """Pages a step in flight may still write come back counted free, but are handed out only once their event
    has passed, or, when the others are too few, after waiting for it; unfenced pages go out first."""
    pool = make_pool(10)
    pool.fences, pool.new_event = True, FakeEvent
    FakeEvent.made.clear()
    written = pool.alloc(4, "kv")  # a sequence's pages, a step in flight writing them
    pool.free(written, "kv", fenced=True)
    event = FakeEvent.made[-1]
    assert event.recorded and pool.num_free == 9 and pool.used["kv"] == 0
    other = pool.alloc(5, "adapter")  # the 5 never written: no wait
    assert not set(other.tolist()) & set(written.tolist()) and event.waited == 0
    taken = pool.alloc(2, "adapter")  # only the fenced ones are left: waits for the step, then hands them out
    assert event.waited == 1 and set(taken.tolist()) <= set(written.tolist())
    assert pool.num_free == 2 and pool.used == {"kv": 0, "adapter": 7}
    pool.free(taken, "adapter")
    pool.free(other, "adapter", fenced=True)
    FakeEvent.made[-1].passed = True  # the device passed it: back without a wait at the next short alloc
    assert pool.alloc(9, "kv") is not None and FakeEvent.made[-1].waited == 0 and pool.num_free == 0
    assert pool.used == {"kv": 9, "adapter": 0}


def test_kv_takes_fenced_pages_without_waiting_for_their_step():
    """KV is written by the steps alone, on the compute stream, after the step that fenced its pages: an ordered
    alloc takes fenced pages at once when the others are too few, the oldest batch first, part of one if need be,
    and never more than are free; an adapter's (copied on another stream) still waits for the step."""
    pool = make_pool(10)
    pool.fences, pool.new_event = True, FakeEvent
    FakeEvent.made.clear()
    first, second = pool.alloc(3, "kv"), pool.alloc(3, "kv")
    pool.free(first, "kv", fenced=True)
    pool.free(second, "kv", fenced=True)
    assert pool.num_free == 9
    assert pool.alloc(10, "kv", ordered=True) is None and pool.num_free == 9  # nothing taken
    taken = pool.alloc(5, "kv", ordered=True)  # the 3 never written, then 2 of the oldest fenced batch
    assert all(event.waited == 0 for event in FakeEvent.made) and list(taken) == sorted(taken.tolist())
    assert len(set(taken.tolist()) & set(first.tolist())) == 2 and not set(taken.tolist()) & set(second.tolist())
    assert pool.num_free == 4 and pool.used["kv"] == 5
    rest = pool.alloc(4, "adapter")  # the fenced ones alone are left: an adapter's copy waits for their steps
    assert set(rest.tolist()) == (set(first.tolist()) - set(taken.tolist())) | set(second.tolist())
    assert [event.waited for event in FakeEvent.made] == [1, 1] and pool.num_free == 0


def test_fenced_free_is_plain_on_the_cpu():
    pool = make_pool(6)
    ids = pool.alloc(5, "kv")
    pool.free(ids, "kv", fenced=True)  # no device queue on the cpu: free at once
    assert pool.alloc(5, "kv") is not None


# --- KVCache ----------------------------------------------------------------------------------------


def test_kv_layout_gqa():
    pool = make_pool(40)
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16)
    assert kv.tokens_per_page == HIDDEN // KV == 2
    assert kv.pages_per_block == 2 * LAYERS
    assert kv.view.shape == (40, 2, 2, 16)
    assert kv.view.data_ptr() == pool.pages.data_ptr()
    kv.view[5, 1, 0] = 7.0  # token offset 1, KV head 0 lies at elements 32..47 of page 5
    assert torch.all(pool.pages[5, 32:48] == 7.0) and pool.pages[5].count_nonzero() == 16
    for tokens in range(0, 11):
        assert kv.blocks_for(tokens) == math.ceil(tokens / 2)


def test_kv_page_must_hold_whole_rows():
    with pytest.raises(ValueError):
        KVCache(make_pool(8, page=48), num_layers=1, num_kv_heads=2, head_dim=32)


def test_kv_grow_and_release():
    pool = make_pool(1 + 6 * 5)  # room for exactly 5 blocks of 3 layers
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16)
    assert kv.free_tokens() == 10
    a, b = [], []
    assert kv.grow(a, 3)  # 2 blocks
    assert len(a) == 2 and all(block.shape == (LAYERS, 2) for block in a)
    assert kv.grow(a, 4) and len(a) == 2  # still fits
    assert kv.grow(a, 0) and len(a) == 2
    assert pool.used["kv"] == 12
    assert kv.grow(b, 5)  # 3 blocks
    assert pool.num_free == 0 and kv.free_tokens() == 0
    before = [block.copy() for block in a]
    assert not kv.grow(a, 5)  # short: nothing taken, nothing changed
    assert len(a) == 2 and all((x == y).all() for x, y in zip(a, before))
    ids = np.concatenate([np.stack(a).ravel(), np.stack(b).ravel()])
    assert len(set(ids.tolist())) == 30 and SCRATCH_PAGE not in ids
    kv.release(a)
    assert a == [] and pool.used["kv"] == 18 and pool.num_free == 12
    assert not kv.grow(a, 5)  # 3 blocks, 2 free
    assert kv.grow(a, 4) and pool.num_free == 0
    kv.release(a)
    kv.release(b)
    assert pool.used["kv"] == 0 and pool.num_free == 30


def test_shared_blocks_go_back_with_their_last_holder():
    pool = make_pool(1 + 6 * 8)  # 8 blocks of 3 layers
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16)  # 2 tokens a page
    first = BlockList()
    assert kv.grow(first, 7)  # 4 blocks, the last half used
    children = [kv.share(first, 3) for _ in range(3)]  # the 3 full blocks, no page taken
    assert pool.used["kv"] == 24 and all(len(child) == 3 for child in children)
    assert all((child.array() == first.array()[:3]).all() for child in children)
    assert kv.sharing() == {"shared_blocks": 3, "pages_saved": 3 * 3 * 6, "window_pages_freed": 0}
    kv.release(first)  # its own last block goes back; the shared ones stay with the children
    assert pool.used["kv"] == 18 and len(first) == 0
    kv.release(children[0])
    kv.release(children[1])
    assert pool.used["kv"] == 18 and kv.sharing() == {"shared_blocks": 0, "pages_saved": 0, "window_pages_freed": 0}
    assert kv.grow(children[2], 8)  # one holder left: it grows past them like any sequence
    assert pool.used["kv"] == 24
    kv.release(children[2])
    assert pool.used["kv"] == 0 and pool.num_free == 48 and kv.holders == {}


def test_released_shared_pages_are_never_handed_out_while_held():
    rng = random.Random(5)
    pool = make_pool(1 + 6 * 40)
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16)
    live: list[BlockList] = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            kv.release(live.pop(rng.randrange(len(live))))
        elif live and rng.random() < 0.5:
            parent = rng.choice(live)
            live.append(kv.share(parent, rng.randint(0, len(parent))))
        else:
            blocks = BlockList()
            if kv.grow(blocks, rng.randint(1, 12)):
                live.append(blocks)
        held = [page for blocks in live for page in np.unique(blocks.array()).tolist()]
        assert pool.used["kv"] == len(set(held))  # a page held by several sequences is counted once
        assert not set(held) & set(pool.free_ids().tolist())  # and none of them is free
    for blocks in live:
        kv.release(blocks)
    assert pool.used["kv"] == 0 and kv.holders == {}


WINDOWS = (4, None, 2)  # layer 0 reads the last 4 positions, layer 1 all of them, layer 2 the last 2


def test_trim_gives_back_the_window_layers_pages_before_every_window():
    pool = make_pool(1 + 6 * 12)
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16, layer_windows=WINDOWS)  # 2 tokens a page
    blocks = BlockList()
    assert kv.grow(blocks, 20)  # 10 blocks, 60 pages
    before = blocks.array().copy()
    # A query at 12 reads 9..12 in layer 0 (blocks 4-6: 0-3 dead) and 11..12 in layer 2 (blocks 5-6: 0-4 dead).
    assert kv.trim(blocks, 12) == 4 + 10  # layer 0's V pages (its K page is the block's key), layer 2's K and V
    rows = blocks.array()
    assert (rows[:4, 0, 1] == SCRATCH_PAGE).all() and (rows[:5, 2] == SCRATCH_PAGE).all()
    assert (rows[:, 0, 0] == before[:, 0, 0]).all() and (rows[:, 1] == before[:, 1]).all()
    assert (rows[4:, 0, 1] == before[4:, 0, 1]).all() and (rows[5:, 2] == before[5:, 2]).all()
    freed = set(before[:4, 0, 1].tolist()) | set(before[:5, 2].ravel().tolist())
    assert freed <= set(pool.free_ids().tolist()) and pool.used["kv"] == 60 - 14
    # The previous step's first query (12) may still be on the device: 16 trims nothing until the step after it.
    assert kv.trim(blocks, 16) == 0
    assert kv.trim(blocks, 17) == 2 + 4  # horizon 16: layer 0's blocks 4-5, layer 2's 5-6
    assert kv.sharing()["window_pages_freed"] == 20
    kv.release(blocks)  # the rest, each page once
    assert pool.used["kv"] == 0 and pool.num_free == 72 and len(set(pool.free_ids().tolist())) == 72
    assert blocks.trimmed == {} and blocks.last_start is None  # a preempted sequence starts over
    assert kv.grow(blocks, 4) and kv.trim(blocks, 0) == 0


def test_trim_leaves_shared_blocks_to_their_release():
    pool = make_pool(1 + 6 * 12)
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16, layer_windows=WINDOWS)
    first = BlockList()
    assert kv.grow(first, 20)
    child = kv.share(first, 3)
    before = first.array().copy()
    assert kv.trim(first, 12) == 1 + 4  # blocks 3 (layer 0's V) and 3-4 (layer 2): 0-2 are the child's too
    assert (first.array()[:3] == before[:3]).all() and (child.array() == before[:3]).all()
    kv.release(first)
    kv.release(child)
    assert pool.used["kv"] == 0 and pool.num_free == 72 and kv.holders == {}


def test_trimmed_pages_are_never_handed_out_while_held_and_each_goes_back_once():
    rng = random.Random(7)
    pool = make_pool(1 + 6 * 40)
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16, layer_windows=WINDOWS)
    live: list[tuple[BlockList, int]] = []  # (blocks, tokens computed)
    for _ in range(400):
        action = rng.random()
        if live and action < 0.2:
            kv.release(live.pop(rng.randrange(len(live)))[0])
        elif live and action < 0.35:
            parent, tokens = rng.choice(live)
            full = rng.randint(0, len(parent))
            live.append((kv.share(parent, full), full * kv.tokens_per_page))
        elif live and action < 0.8:
            index = rng.randrange(len(live))
            blocks, tokens = live[index]
            count = rng.randint(1, 5)
            if kv.grow(blocks, tokens + count):
                kv.trim(blocks, tokens)
                live[index] = (blocks, tokens + count)
        else:
            blocks = BlockList()
            if kv.grow(blocks, rng.randint(1, 12)):
                live.append((blocks, 0))
        held = {page for blocks, _ in live for page in np.unique(blocks.array()).tolist()} - {SCRATCH_PAGE}
        assert pool.used["kv"] == len(held) and not held & set(pool.free_ids().tolist())
    for blocks, _ in live:
        kv.release(blocks)
    assert pool.used["kv"] == 0 and len(set(pool.free_ids().tolist())) == pool.num_free == 240 and kv.holders == {}
    assert kv.window_pages_freed > 0


def test_copy_block_copies_every_page_of_the_block():
    pool = make_pool(1 + 6 * 2)
    kv = KVCache(pool, num_layers=LAYERS, num_kv_heads=2, head_dim=16)
    source, target = BlockList(), BlockList()
    assert kv.grow(source, 2) and kv.grow(target, 2)
    pool.pages[torch.as_tensor(source.array().ravel(), dtype=torch.long)] = torch.randn(6, HIDDEN)
    kv.copy_block(source.array()[0], target.array()[0])
    source_pages = pool.pages[torch.as_tensor(source.array()[0].ravel(), dtype=torch.long)]
    assert torch.equal(pool.pages[torch.as_tensor(target.array()[0].ravel(), dtype=torch.long)], source_pages)


# --- AdapterTable -----------------------------------------------------------------------------------


def random_adapter(generator: torch.Generator, max_rank: int = 6, density: float = 0.6) -> dict:
    """Random A [r, in], B [out, r] for a random subset of (layer, proj), ranks differing per entry."""
    weights = {}
    while not weights:
        for layer in range(LAYERS):
            for proj, (fan_in, fan_out) in enumerate(SHAPES):
                if torch.rand((), generator=generator) < density:
                    rank = int(torch.randint(1, max_rank + 1, (), generator=generator))
                    weights[(layer, proj)] = (
                        torch.randn(rank, fan_in, generator=generator),
                        torch.randn(fan_out, rank, generator=generator),
                    )
    return weights


def pages_of(weights: dict, page: int = HIDDEN) -> int:
    return sum(
        a.shape[0] * (math.ceil(SHAPES[proj][0] / page) + math.ceil(SHAPES[proj][1] / page))
        for (_, proj), (a, _) in weights.items()
    )


def check_reads_back(table: AdapterTable, slot: int, weights: dict) -> None:
    pages = table.pool.pages
    for layer in range(LAYERS):
        for proj, (fan_in, fan_out) in enumerate(SHAPES):
            rank_host = int(table.rank_host[slot, layer, proj])
            assert int(table.rank[slot, layer, proj]) == rank_host  # the device copy agrees
            if (layer, proj) not in weights:
                assert rank_host == 0
                continue
            a, b = weights[(layer, proj)]
            assert rank_host == a.shape[0]
            chunks_in, chunks_out = math.ceil(fan_in / HIDDEN), math.ceil(fan_out / HIDDEN)
            assert table.chunks[proj] == (chunks_in, chunks_out)
            for starts in (table.a_start_host, table.a_start):
                got_a = gather_rows(pages, table.page_ids, int(starts[slot, layer, proj]), rank_host, chunks_in, fan_in)
                assert torch.equal(got_a.cpu(), a)
            for starts in (table.b_start_host, table.b_start):
                got_b = gather_rows(pages, table.page_ids, int(starts[slot, layer, proj]), rank_host, chunks_out, fan_out)
                assert torch.equal(got_b.cpu(), b.t())
            # DESIGN.md's element formula, on a few random elements of A
            a_start = int(table.a_start_host[slot, layer, proj])
            rng = random.Random(slot * 100 + layer * 10 + proj)
            for _ in range(3):
                j, k = rng.randrange(rank_host), rng.randrange(fan_in)
                page_id = int(table.page_ids[a_start + j * chunks_in + k // HIDDEN])
                assert page_id != SCRATCH_PAGE
                assert pages[page_id, k % HIDDEN].item() == a[j, k].item()


def test_place_reads_back_with_partial_pages():
    generator = torch.Generator().manual_seed(1)
    pool = make_pool(2000)
    table = AdapterTable(pool, num_slots=8, num_layers=LAYERS, shapes=SHAPES)
    assert table.chunks[4] == (1, 3) and table.chunks[6] == (3, 1)  # 172 = 2 pages + 44 elements
    placed = {}
    for slot in (3, 0, 5):
        weights = random_adapter(generator)
        assert table.pages_needed(weights) == pages_of(weights)
        assert table.place(slot, weights)
        placed[slot] = weights
    assert pool.used["adapter"] == sum(pages_of(w) for w in placed.values())
    all_ids = [i for p in table.placements.values() for i in p.page_ids]
    assert len(all_ids) == len(set(all_ids)) and SCRATCH_PAGE not in all_ids
    for slot, weights in placed.items():
        check_reads_back(table, slot, weights)
    assert table.free_slot() == 1
    for slot in (1, 2, 4, 6, 7):
        assert table.rank_host[slot].sum() == 0 and int(table.rank[slot].sum()) == 0


def test_staged_rows_are_padded_with_zeros_past_their_width():
    # The staging buffer is not cleared first: every row's padding to whole pages is written as zeros.
    generator = torch.Generator().manual_seed(5)
    table = AdapterTable(make_pool(8), num_slots=2, num_layers=LAYERS, shapes=SHAPES)
    weights = {(0, 4): (torch.randn(3, HIDDEN, generator=generator) + 5, torch.randn(INTERMEDIATE, 3, generator=generator) + 5),
               (1, 6): (torch.randn(2, INTERMEDIATE, generator=generator) + 5, torch.randn(HIDDEN, 2, generator=generator) + 5)}
    staged = table.stage(weights, pin=False)
    padded = 0
    for layer, proj, rank, a_offset, b_offset in staged.layout:
        a, b = weights[(layer, proj)]
        for offset, rows, chunks in ((a_offset, a, table.chunks[proj][0]), (b_offset, b.t(), table.chunks[proj][1])):
            block = staged.pages[offset : offset + rank * chunks].reshape(rank, chunks * HIDDEN)
            assert torch.equal(block[:, : rows.shape[1]], rows)
            assert not block[:, rows.shape[1] :].any()
            padded += chunks * HIDDEN > rows.shape[1]
    assert padded == 2  # B^T of up and A of down: INTERMEDIATE = 2 pages + 44 elements


def test_rows_of_several_whole_pages_stage_without_padding():
    # A row as wide as two pages exactly (no padding anywhere, so the staging buffer is not cleared first) beside one
    # of a single page: each lands row by row, in the pool's dtype.
    generator = torch.Generator().manual_seed(6)
    table = AdapterTable(make_pool(8), num_slots=2, num_layers=1, shapes=[(2 * HIDDEN, HIDDEN)] + [(HIDDEN, HIDDEN)] * 6)
    a, b = torch.randn(3, 2 * HIDDEN, generator=generator), torch.randn(HIDDEN, 3, generator=generator)
    staged = table.stage({(0, 0): (a, b)}, pin=False)
    (_, _, rank, a_offset, b_offset), = staged.layout
    assert (rank, a_offset, b_offset, staged.pages.shape[0]) == (3, 0, 6, 9)
    assert torch.equal(staged.pages[:6].reshape(3, 2 * HIDDEN), a.to(staged.pages.dtype))
    assert torch.equal(staged.pages[6:], b.t().to(staged.pages.dtype))


def test_a_shared_a_is_placed_once_and_read_by_each_member():
    """A fused module's members (Phi-3's qkv_proj as q, k, v) share one A tensor: its pages are staged and placed
    once, every member's a_start points at them, each member's B^T has its own pages."""
    generator = torch.Generator().manual_seed(7)
    shared_a = torch.randn(3, HIDDEN, generator=generator)
    weights = {(1, proj): (shared_a, torch.randn(SHAPES[proj][1], 3, generator=generator)) for proj in (0, 1, 2)}
    weights[(1, 4)] = (torch.randn(2, HIDDEN, generator=generator), torch.randn(INTERMEDIATE, 2, generator=generator))
    weights[(1, 5)] = (weights[(1, 4)][0], torch.randn(INTERMEDIATE, 2, generator=generator))  # gate, up
    copies = {key: (a.clone(), b) for key, (a, b) in weights.items()}  # the same values, A not shared
    pool = make_pool(500)
    table = AdapterTable(pool, num_slots=2, num_layers=LAYERS, shapes=SHAPES)
    saved = 2 * 3 * 1 + 1 * 2 * 1  # q, k, v: two A copies of 3 rows of 1 page; gate, up: one of 2 rows
    assert table.pages_needed(weights) == pages_of(copies) - saved
    assert table.place(0, weights) and table.place(1, copies)
    assert pool.used["adapter"] == 2 * pages_of(copies) - saved
    check_reads_back(table, 0, weights)
    check_reads_back(table, 1, copies)
    assert table.a_start_host[0, 1, 0] == table.a_start_host[0, 1, 1] == table.a_start_host[0, 1, 2]
    assert table.a_start_host[0, 1, 4] == table.a_start_host[0, 1, 5]
    assert len({table.a_start_host[1, 1, proj] for proj in (0, 1, 2)}) == 3
    assert len(set(table.b_start_host[0, 1, :3])) == 3


def test_evict_frees_pages_and_zeroes_rank():
    generator = torch.Generator().manual_seed(2)
    pool = make_pool(2000)
    table = AdapterTable(pool, num_slots=4, num_layers=LAYERS, shapes=SHAPES)
    first, second = random_adapter(generator), random_adapter(generator)
    assert table.place(0, first) and table.place(1, second)
    table.evict(0)
    assert pool.used["adapter"] == pages_of(second)
    assert pool.num_free == pool.capacity - pages_of(second)
    assert table.rank_host[0].sum() == 0 and int(table.rank[0].sum()) == 0
    assert 0 not in table.placements and table.free_slot() == 0
    check_reads_back(table, 1, second)
    table.evict(1)
    assert pool.used["adapter"] == 0 and pool.num_free == pool.capacity


def test_place_when_pool_is_short_takes_nothing():
    generator = torch.Generator().manual_seed(3)
    weights = random_adapter(generator)
    needed = pages_of(weights)
    pool = make_pool(needed)  # capacity needed - 1
    table = AdapterTable(pool, num_slots=2, num_layers=LAYERS, shapes=SHAPES)
    before = pool.pages.clone()
    assert not table.place(0, weights)
    assert pool.num_free == pool.capacity and pool.used["adapter"] == 0
    assert 0 not in table.placements and table.rank_host.sum() == 0 and int(table.rank.sum()) == 0
    assert torch.equal(pool.pages, before)
    # One page more and it fits exactly.
    pool = make_pool(needed + 1)
    table = AdapterTable(pool, num_slots=2, num_layers=LAYERS, shapes=SHAPES)
    assert table.place(1, weights) and pool.num_free == 0
    check_reads_back(table, 1, weights)


def test_churn_forces_compaction():
    """The index (page_ids) has one entry per pool page; placing and evicting in the middle leaves
    holes, so a later placement must compact it and everything resident must still read back."""
    generator = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    pool = make_pool(700)
    table = AdapterTable(pool, num_slots=16, num_layers=LAYERS, shapes=SHAPES)
    compactions = 0
    original = table._compact

    def counting_compact():
        nonlocal compactions
        compactions += 1
        original()

    table._compact = counting_compact
    resident: dict[int, dict] = {}
    for round_ in range(60):
        if resident and (rng.random() < 0.45 or table.free_slot() is None):
            # evict one in the middle of the index when there is one
            order = sorted(resident, key=lambda s: table.placements[s].index_start)
            slot = order[len(order) // 2]
            table.evict(slot)
            del resident[slot]
        else:
            weights = random_adapter(generator, max_rank=4, density=0.4)
            slot = table.free_slot()
            free_before = pool.num_free
            if table.place(slot, weights):
                resident[slot] = weights
            else:
                assert pages_of(weights) > free_before
                assert pool.num_free == free_before and slot not in table.placements
        used = sum(pages_of(w) for w in resident.values())
        assert pool.used["adapter"] == used and pool.num_free == pool.capacity - used
        assert table._index_end <= len(table.page_ids_host)
        for slot, weights in resident.items():
            check_reads_back(table, slot, weights)
    assert compactions > 0, "the churn never filled the index: make the test place more"


class FakeStream:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def wait_stream(self, other) -> None:
        self.calls.append(f"{self.name} waits for {other.name}")


def test_a_compaction_orders_the_copy_stream_after_the_moves_and_the_moves_after_the_copy_stream(monkeypatch):
    """What the GPU test below checks on the device, as the order of the waits around the moves: the compute stream
    first waits for what the copy stream had queued, the moves go on it, then the copy stream waits for it."""
    generator = torch.Generator().manual_seed(6)
    first, second = random_adapter(generator), random_adapter(generator)
    table = AdapterTable(make_pool(1 + pages_of(first) + pages_of(second)), num_slots=4, num_layers=LAYERS, shapes=SHAPES)
    assert table.place(0, first) and table.place(1, second)
    table.evict(0)
    calls = []
    compute = FakeStream("compute", calls)
    monkeypatch.setattr(table, "_copy_stream", FakeStream("copy", calls))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: compute)
    publish = table._publish
    monkeypatch.setattr(table, "_publish", lambda slot, *args: calls.append(f"publish {slot}") or publish(slot, *args))
    table._record_placement(2, table.stage(first), table.pool.alloc(pages_of(first), "adapter"))
    assert calls == ["compute waits for copy", "publish 1", "copy waits for compute"]
    assert table.placements[1].index_start == 0 and table.placements[2].index_start == pages_of(second)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_placement_that_compacts_the_index_leaves_a_step_in_flight_the_entries_it_reads():
    """A step in flight reads each adapter's index entries where they were when it was queued (here: the device
    asleep, then a copy of the tables as the step's kernels would read them). A placement made meanwhile (a
    prefetch) that compacts the index publishes on the table's copy stream, past the compacted end, where the
    moved adapter's entries were: it must wait for the step, or the step reads the new adapter's pages as the
    moved one's."""
    generator = torch.Generator().manual_seed(6)
    first, second = random_adapter(generator), random_adapter(generator)
    a, b = pages_of(first), pages_of(second)
    pool = PagePool(1 + a + b, HIDDEN, torch.float32, torch.device("cuda"))
    table = AdapterTable(pool, num_slots=4, num_layers=LAYERS, shapes=SHAPES)
    assert table.place(0, first) and table.place(1, second)  # first's entries at [0, a), second's at [a, a + b)
    table.evict(0)
    assert table._index_end + a > len(table.page_ids_host)  # placing first again compacts: second's to [0, b)
    staged = table.stage(first)  # pinned before the race: no new pinned allocation inside it
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 * 2e9))  # the step in flight, ~0.1 s
    page_ids, a_start, b_start = table.page_ids.clone(), table.a_start.clone(), table.b_start.clone()
    assert table.place(2, staged)  # into first's old pages; its entries at [b, b + a), over second's old ones
    torch.cuda.synchronize()
    assert table.placements[1].index_start == 0
    for (layer, proj), (weight_a, weight_b) in second.items():
        fan_in, fan_out = SHAPES[proj]
        rank, chunks_in, chunks_out = weight_a.shape[0], math.ceil(fan_in / HIDDEN), math.ceil(fan_out / HIDDEN)
        read_a = gather_rows(pool.pages, page_ids, int(a_start[1, layer, proj]), rank, chunks_in, fan_in)
        read_b = gather_rows(pool.pages, page_ids, int(b_start[1, layer, proj]), rank, chunks_out, fan_out)
        assert torch.equal(read_a.cpu(), weight_a) and torch.equal(read_b.cpu(), weight_b.t()), (layer, proj)
    check_reads_back(table, 1, second)  # and after the step, from where the compaction moved them
    check_reads_back(table, 2, first)


def test_giving_back_more_than_was_taken_is_refused():
    pool = PagePool(8, 4, torch.float32, torch.device("cpu"))
    taken = pool.alloc(3, "kv")
    with pytest.raises(ValueError, match="given back"):
        pool.free([*taken.tolist(), 4, 5, 6, 7, 1], "kv")
    assert pool.num_free == 4 and pool.used["kv"] == 3


def test_freed_pages_come_back_as_one_ascending_run():
    pool = PagePool(64, 16, torch.float32, torch.device("cpu"))
    first = pool.alloc(20, "adapter")
    assert first.tolist() == list(range(1, 21))
    pool.free(first, "adapter")
    assert pool.alloc(20, "adapter").tolist() == list(range(1, 21))


def test_alloc_is_ascending_after_interleaved_frees():
    """place() takes ids[-1] - ids[0] == count - 1 for one run of pages: it needs ascending ids."""
    pool = PagePool(16, 4, torch.float32, torch.device("cpu"))
    taken = pool.alloc(15, "kv")
    pool.free([6, 8], "kv")
    pool.free([5, 7], "kv")  # the stack's top now reads 5, 7, 6, 8
    assert pool.alloc(4, "kv").tolist() == [5, 6, 7, 8]
    pool.free(taken[:3], "kv")
    pool.free([12, 10], "kv")
    ids = pool.alloc(5, "kv").tolist()
    assert ids == sorted(ids) and ids[-1] - ids[0] != len(ids) - 1  # not one run: place() copies run by run
