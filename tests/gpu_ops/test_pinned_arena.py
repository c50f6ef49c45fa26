"""gpu_ops/pinned_arena.py: ranges handed out best fit, back when their last tensor is gone and their fence has passed,
merged with their free neighbours, never across the power-of-two blocks the memory is pinned in; on the GPU, a copy queued from a range finishes before the range is written again."""

from __future__ import annotations

import threading

import pytest
import torch

from lorad.gpu_ops.pinned_arena import ALIGN, PinnedArena, segment_sizes


class Fence:
    """An event the test completes by hand; `synchronize` completes it (a waiting allocation)."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def offset(arena: PinnedArena, tensor: torch.Tensor) -> int:
    return tensor.data_ptr() - arena.segments[0].data_ptr()


def test_ranges_are_disjoint_aligned_and_come_back_with_their_last_view():
    arena = PinnedArena(16 * ALIGN, pin=False)
    first, second = arena.alloc(ALIGN + 1), arena.alloc(100)
    assert first.shape == (ALIGN + 1,) and first.dtype == torch.uint8
    assert offset(arena, first) % ALIGN == 0 and offset(arena, second) == 2 * ALIGN  # the first takes two pages
    first.fill_(7)
    second.fill_(9)
    assert int(first.sum()) == 7 * (ALIGN + 1)  # no overlap
    view = first[: 2 * 1024].view(torch.bfloat16).view(32, 32)
    del first
    assert arena.stats()["used_bytes"] == 3 * ALIGN  # the view holds it
    del view
    assert arena.stats()["used_bytes"] == ALIGN
    del second
    stats = arena.stats()
    assert stats["used_bytes"] == 0 and stats["free_ranges"] == 1 and stats["largest_free_bytes"] == 16 * ALIGN


def test_best_fit_and_neighbours_merged():
    arena = PinnedArena(16 * ALIGN, pin=False)
    blocks = [arena.alloc(size * ALIGN) for size in (5, 1, 4, 1, 5)]  # the arena full
    assert arena.alloc(1) is None and arena.failed == 1
    hole_five, hole_four = offset(arena, blocks[0]), offset(arena, blocks[2])
    blocks[0] = blocks[2] = None  # holes of 5 and 4 pages
    assert offset(arena, arena.alloc(4 * ALIGN)) == hole_four  # the smallest hole that fits (dropped at once)
    assert offset(arena, arena.alloc(5 * ALIGN)) == hole_five
    blocks = [None] * 5  # everything back: one range again
    stats = arena.stats()
    assert stats["free_ranges"] == 1 and stats["largest_free_bytes"] == 16 * ALIGN and stats["used_bytes"] == 0


def test_a_budget_is_pinned_as_power_of_two_blocks_and_no_range_crosses_them():
    """torch's pinned allocator rounds a block up to a power of two: 5 GiB as one block would pin 8."""
    assert segment_sizes(4 << 30) == [4 << 30]
    assert segment_sizes((5 << 30) + 100) == [4 << 30, 1 << 30]  # what is below ALIGN is left out
    arena = PinnedArena(6 * ALIGN + 5, pin=False)
    assert [segment.numel() for segment in arena.segments] == [4 * ALIGN, 2 * ALIGN]
    assert arena.capacity == 6 * ALIGN and arena.stats()["segments"] == 2
    first = arena.alloc(3 * ALIGN)
    assert arena.alloc(2 * ALIGN) is not None  # the second block whole (dropped at once)
    assert arena.alloc(3 * ALIGN) is None  # one page left in the first, two in the second: no three in one block
    small = [arena.alloc(ALIGN) for _ in range(3)]
    assert all(block is not None for block in small) and arena.alloc(1) is None
    del first, small
    stats = arena.stats()
    assert stats["free_ranges"] == 2 and stats["largest_free_bytes"] == 4 * ALIGN and stats["used_bytes"] == 0


def test_a_range_is_reused_only_once_its_fence_has_passed():
    fences = []

    def fence():
        fences.append(Fence())
        return [fences[-1]]

    arena = PinnedArena(2 * ALIGN, pin=False, fence=fence)
    held = arena.alloc(2 * ALIGN)
    del held  # its copies may still run
    assert arena.alloc(ALIGN) is None and arena.stats()["fenced_bytes"] == 2 * ALIGN
    fences[0].done = True
    again = arena.alloc(ALIGN)
    assert again is not None and offset(arena, again) == 0
    del again
    waited = arena.alloc(2 * ALIGN, wait=True)  # waits for the fence instead of failing
    assert waited is not None and fences[1].waited == 1
    assert arena.alloc(ALIGN, wait=True) is None  # nothing fenced to wait for: no range


def test_threads_allocating_and_dropping_leave_the_arena_whole():
    arena = PinnedArena(64 * ALIGN, pin=False, fence=lambda: [])
    errors = []

    def churn(seed: int):
        generator = torch.Generator().manual_seed(seed)
        held = []
        try:
            for _ in range(300):
                size = int(torch.randint(1, 4 * ALIGN, (1,), generator=generator))
                block = arena.alloc(size)
                if block is not None:
                    block.fill_(seed)
                    held.append((block, seed))
                if len(held) > 3:
                    block, value = held.pop(0)
                    assert bool((block == value).all())  # nobody else wrote into it
        except AssertionError as error:
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    stats = arena.stats()
    assert stats["used_bytes"] == 0 and stats["free_ranges"] == 1 and stats["allocations"] > 1000


@pytest.mark.gpu
def test_a_copy_queued_from_a_range_finishes_before_the_range_is_written_again():
    """The copy waits on its stream behind a kernel that spins ~50 ms; its source is dropped and allocated again
    at once, and the new owner fills it: the copy must still deliver the first contents."""
    stream = torch.cuda.Stream()

    def fence():
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return [event]

    arena = PinnedArena(64 << 20, fence=fence)
    assert arena.stats()["pinned"]
    source = arena.alloc(64 << 20)
    assert source.is_pinned()
    source.fill_(3)
    target = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        target.copy_(source, non_blocking=True)
    del source
    assert arena.alloc(64 << 20) is None  # fenced: the copy has not run
    reused = arena.alloc(64 << 20, wait=True)
    assert reused is not None
    reused.fill_(5)
    torch.cuda.synchronize()
    assert bool((target == 3).all())
