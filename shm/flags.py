"""Sequence-number flags in shared memory: how one process tells another "data n is ready".

A writer fills the shared data, then stores n into the flag; a reader waits until the flag reaches n,
then reads the data. Flags only grow, so a reader never confuses job n with job n-1 and nobody resets
them between jobs.

Memory ordering. The data write (a numpy/torch copy into the segment) and the flag store are separate
plain stores made by separate C calls of the interpreter: no lock, no atomic instruction, no fence.
The compiler cannot move a store across those opaque calls; the CPU is what remains. On x86-64 (TSO)
stores are not reordered with other stores, loads not with other loads, and loads not with later
stores, so publish-data-then-flag on one side and read-flag-then-data on the other is safe, and so is
reusing a buffer after its reader has published "done". An aligned 8-byte store or load is a single
instruction there, so a flag is never seen half-written. A `Flag` reads and writes its cell through a
memoryview of format "q": CPython moves such an item with an 8-byte `memcpy`, which compilers emit
as one `mov` (as numpy's scalar access does), and it builds no numpy scalar per load, so a poll loop
allocates nothing but the int it returns.

Many flags at once (`wait_all`; `shm/exchange.py`'s batched post): a numpy store of N flags, or of N
descriptors, is a loop of plain stores made by one thread, so TSO makes every store of an earlier
call (the data, the descriptors) visible before any store of a later one (the flags); the order
among the N flags of one call does not matter, each guards only its own worker's data. A reader
that loads N flags with one numpy call and then reads data sees, for each flag it saw raised, the
data published before it (loads are not reordered with loads).

On weakly ordered CPUs (aarch64, POWER) the
same code could let the reader see the new flag before the data; it needs a release fence before the
flag store and an acquire fence after the flag load, which pure Python cannot issue (ctypes reaches no
fence function in libc, and a syscall is not a barrier by the architecture's rules). Until the
project's C++ extension provides one, `Flag` refuses to run anywhere but x86-64 rather than be
silently wrong: `ORDERED_STORES` says which case this machine is.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable

import numpy as np

ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
FLAG_BYTES = 8


def check_platform() -> None:
    if not ORDERED_STORES:
        raise RuntimeError(
            f"lorad's shared-memory flags rely on x86-64 store ordering (TSO); on {platform.machine()} "
            "they need acquire/release fences, which are not implemented yet"
        )


class Flag:
    """A 64-bit sequence number at an 8-byte aligned offset of a shared buffer (an mmap, a Segment's
    `buffer`). One process stores, any number load."""

    __slots__ = ("_cell",)

    def __init__(self, buffer, offset: int):
        check_platform()
        if offset % FLAG_BYTES:
            raise ValueError(f"a flag must be 8-byte aligned, offset {offset} is not")
        self._cell = memoryview(buffer).cast("B")[offset : offset + FLAG_BYTES].cast("q")

    def load(self) -> int:
        return self._cell[0]

    def store(self, value: int) -> None:
        """Publish `value`. Everything written to shared memory before this call is visible to a
        reader that has seen `value` (see the module's note on ordering)."""
        self._cell[0] = value

    def wait(
        self,
        target: int,
        timeout_s: float | None,
        spin_s: float = 50e-6,
        max_pause_s: float = 1e-3,
        on_pause: Callable[[], None] | None = None,
        hot: Flag | None = None,
    ) -> int:
        """Wait until the flag is >= `target`; returns the value seen.

        Spins for `spin_s` (the common case: the other side is about to publish), then sleeps with
        a pause doubling from 10 µs up to `max_pause_s`, so an idle waiter costs almost no CPU and a
        busy one answers within about `max_pause_s`. `hot` (optional) holds a `time.monotonic_ns()`
        deadline: until it passes the waiter busy-polls instead of sleeping (a job is expected any
        moment, and a sleeper's wake-up would cost more than the job), and a sleeper that sees it
        rise starts polling at its next pause. `on_pause` runs before every sleep, and about every
        `max_pause_s` while polling hot: a heartbeat to bump, or a liveness check that raises to
        abandon the wait. Raises TimeoutError after `timeout_s` (None: never).
        """
        cell = self._cell
        value = cell[0]
        if value >= target:
            return value
        _wait_until(lambda: cell[0] >= target, timeout_s, spin_s, max_pause_s, on_pause, hot,
                    lambda: f"flag still {cell[0]} after {timeout_s} s waiting for {target}")
        return cell[0]

    def __repr__(self) -> str:
        return f"Flag({self.load()})"


_POLLS = (None,) * 32  # fast polls between two looks at the clock (about 5 µs at 8 flags)


def wait_all(
    flags: np.ndarray,
    targets: np.ndarray,
    timeout_s: float | None,
    spin_s: float = 50e-6,
    max_pause_s: float = 1e-3,
    on_pause: Callable[[], None] | None = None,
    hot: Flag | None = None,
) -> None:
    """Wait until `flags[i] >= targets[i]` for every i: `Flag.wait` for many flags at once (the same
    spin, hot polling, pauses, `on_pause` and TimeoutError), with O(1) Python work per poll whatever
    their number. `flags`: an int64 view of shared memory (any stride, e.g. one flag per worker
    line); `targets`: contiguous int64 of the same shape, unchanged during the wait.

    A poll compares the flags' bytes with the targets' (one small copy and a memcmp, no ufunc): the
    common case, where each flag stops at its target (one job in flight per worker). A flag that
    passes its target is seen by the full comparison `flags >= targets`, made before every look at
    the clock (every 32 polls) and so within `max_pause_s` at worst. `on_pause` may itself raise
    flags (a dead worker's, closed by its replacement) and the wait goes on.
    """
    expected = targets.tobytes()
    if flags.tobytes() == expected or (flags >= targets).all():
        return

    def poll() -> bool:
        for _ in _POLLS:
            if flags.tobytes() == expected:
                return True
        return bool((flags >= targets).all())

    _wait_until(poll, timeout_s, spin_s, max_pause_s, on_pause, hot,
                lambda: f"flags {flags.tolist()} after {timeout_s} s waiting for {targets.tolist()}")


def _wait_until(
    poll: Callable[[], bool],
    timeout_s: float | None,
    spin_s: float,
    max_pause_s: float,
    on_pause: Callable[[], None] | None,
    hot: Flag | None,
    timed_out: Callable[[], str],
) -> None:
    """The waiting of `Flag.wait` and `wait_all` around poll() (True: done): spin for spin_s, then poll
    hot while `hot` holds a future deadline (on_pause about every max_pause_s), else sleep with a pause
    doubling from 10 µs to max_pause_s (on_pause before each sleep); TimeoutError(timed_out()) after
    timeout_s."""
    clock = time.monotonic_ns
    start = clock()
    spin_until = start + int(spin_s * 1e9)
    deadline = None if timeout_s is None else start + int(timeout_s * 1e9)
    pause_ns = int(max_pause_s * 1e9)
    next_pause = start + pause_ns
    pause = 10e-6
    hot_cell = None if hot is None else hot._cell
    while True:
        if poll():
            return
        now = clock()
        if now < spin_until:
            continue
        if deadline is not None and now >= deadline:
            raise TimeoutError(timed_out())
        if hot_cell is not None and now < hot_cell[0]:
            pause = 10e-6  # back from cold: the first sleep after a hot period is short again
            if now >= next_pause:
                next_pause = now + pause_ns
                if on_pause is not None:
                    on_pause()
            continue
        if on_pause is not None:
            on_pause()
        time.sleep(pause if deadline is None else min(pause, max(deadline - now, 0) / 1e9))
        pause = min(pause * 2, max_pause_s)
