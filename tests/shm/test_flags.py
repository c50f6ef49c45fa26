"""Sequence-number flags: ordering of data and flag across processes, waiting, timeouts."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np
import pytest
from lorad.shm.flags import ORDERED_STORES, Flag, wait_all
from lorad.shm.segment import Segment, new_instance, segment_name

fork = multiprocessing.get_context("fork")
pytestmark = [
    pytest.mark.skipif(not ORDERED_STORES, reason="flags need x86-64 store ordering"),
    pytest.mark.usefixtures("no_leftover_segments"),  # tests/conftest.py
]

DATA = 64  # data starts on its own cache line
WORDS = 512


@pytest.fixture
def segment():
    with Segment.create(segment_name(new_instance(), "flags"), 1 << 16) as segment:
        yield segment


def _echo(name, rounds):
    # Waits for job n, checks that all of its data is n, answers -n in its own region, flags done n.
    with Segment.attach(name) as segment:
        job, done = Flag(segment.buffer, 0), Flag(segment.buffer, 8)
        request = segment.array(DATA, WORDS, np.int64)
        reply = segment.array(DATA + WORDS * 8, WORDS, np.int64)
        bad = 0
        for n in range(1, rounds + 1):
            job.wait(n, timeout_s=10)
            if request.min() != n or request.max() != n:
                bad += 1
            reply[:] = -n
            done.store(n)
        segment.array(16, 1, np.int64)[0] = bad
        del request, reply, job, done


def test_ping_pong_sees_every_round_whole(segment):
    rounds = 3000
    child = fork.Process(target=_echo, args=(segment.name, rounds))
    child.start()
    job, done = Flag(segment.buffer, 0), Flag(segment.buffer, 8)
    request = segment.array(DATA, WORDS, np.int64)
    reply = segment.array(DATA + WORDS * 8, WORDS, np.int64)
    bad = 0
    for n in range(1, rounds + 1):
        request[:] = n
        job.store(n)
        done.wait(n, timeout_s=10)
        if reply.min() != -n or reply.max() != -n:
            bad += 1
    child.join(20)
    assert child.exitcode == 0
    assert bad == 0 and segment.array(16, 1, np.int64)[0] == 0
    del request, reply, job, done


def _publish_without_waiting(name, rounds):
    with Segment.attach(name) as segment:
        flag = Flag(segment.buffer, 0)
        data = segment.array(DATA, WORDS, np.int64)
        for n in range(1, rounds + 1):
            data[:] = n
            flag.store(n)
        del flag, data


def test_a_reader_never_sees_a_flag_ahead_of_its_data(segment):
    # Data only grows, so if the flag says n every word read after it must be >= n.
    child = fork.Process(target=_publish_without_waiting, args=(segment.name, 200_000))
    flag = Flag(segment.buffer, 0)
    data = segment.array(DATA, WORDS, np.int64)
    child.start()
    checks = violations = 0
    while child.is_alive() or checks == 0:
        seen = flag.load()
        if data.min() < seen:
            violations += 1
        checks += 1
    child.join(20)
    assert child.exitcode == 0 and flag.load() == 200_000
    assert violations == 0, f"{violations} of {checks} reads saw a flag ahead of its data"
    del flag, data


def test_wait_returns_at_once_when_reached(segment):
    flag = Flag(segment.buffer, 0)
    flag.store(5)
    assert flag.wait(3, timeout_s=0) == 5
    assert flag.wait(5, timeout_s=None) == 5
    del flag


def test_wait_times_out_within_bound(segment):
    flag = Flag(segment.buffer, 0)
    pauses = []
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        flag.wait(1, timeout_s=0.05, on_pause=lambda: pauses.append(1))
    elapsed = time.monotonic() - start
    assert 0.05 <= elapsed < 0.5
    assert pauses  # the waiter slept (with its callback) rather than spinning the whole time
    del flag


def test_on_pause_can_abandon_the_wait(segment):
    flag = Flag(segment.buffer, 0)

    def dead():
        raise ChildProcessError("worker died")

    with pytest.raises(ChildProcessError):
        flag.wait(1, timeout_s=5, on_pause=dead)
    del flag


def test_flags_must_be_aligned(segment):
    with pytest.raises(ValueError):
        Flag(segment.buffer, 4)


def test_wait_all_returns_when_every_flag_reaches_or_passes_its_target(segment):
    flags = np.ndarray((4,), np.int64, segment.buffer, 0, (128,))  # one flag per line, as the exchange's
    flags[:] = [3, 5, 7, 9]
    wait_all(flags, np.array([3, 5, 7, 9]), timeout_s=0)
    wait_all(flags, np.array([1, 5, 2, 9]), timeout_s=0.5)  # past their targets: the full comparison
    with pytest.raises(TimeoutError):
        wait_all(flags, np.array([3, 5, 8, 9]), timeout_s=0.02)
    del flags


def test_wait_all_on_pause_may_raise_the_missing_flags(segment):
    flags = np.ndarray((8,), np.int64, segment.buffer, 0, (128,))
    flags[:] = 1
    flags[5] = 0
    calls = []

    def close_the_dead_job():
        calls.append(1)
        flags[5] = 1

    wait_all(flags, np.ones(8, dtype=np.int64), timeout_s=5, on_pause=close_the_dead_job)
    assert calls
    flags = None  # drop the view before the segment closes
