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
instruction there, so a flag is never seen half-written. On weakly ordered CPUs (aarch64, POWER) the
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
        self._cell = np.frombuffer(buffer, dtype=np.int64, count=1, offset=offset)

    def load(self) -> int:
        return int(self._cell[0])

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
        value = int(cell[0])
        if value >= target:
            return value
        clock = time.monotonic_ns
        start = clock()
        spin_until = start + int(spin_s * 1e9)
        deadline = None if timeout_s is None else start + int(timeout_s * 1e9)
        pause_ns = int(max_pause_s * 1e9)
        next_pause = start + pause_ns
        pause = 10e-6
        while True:
            value = int(cell[0])
            if value >= target:
                return value
            now = clock()
            if now < spin_until:
                continue
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"flag still {value} after {timeout_s} s waiting for {target}")
            if hot is not None and now < int(hot._cell[0]):
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

    def __repr__(self) -> str:
        return f"Flag({self.load()})"
