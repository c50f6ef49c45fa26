"""daemon/engine/step_watch.py: how long the engine's step has run, and the warning, with where the engine thread
waits, once a step runs past the threshold and at each doubling; on a fake clock, and its watcher thread on the real
one."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from lorad.daemon.engine.step_watch import StepWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def wait_for_the_device(entered: threading.Event, release: threading.Event, watch: StepWatch) -> None:
    watch.begin()
    entered.set()
    release.wait(30)
    watch.end()


def test_a_long_step_is_reported_at_the_threshold_and_each_doubling(caplog):
    clock = Clock()
    watch = StepWatch(warn_s=30, clock=clock)
    entered, release = threading.Event(), threading.Event()
    engine = threading.Thread(target=wait_for_the_device, args=(entered, release, watch))
    engine.start()
    try:
        assert entered.wait(10)
        with caplog.at_level(logging.WARNING, logger="lorad.daemon.engine.step_watch"):
            clock.now += 29.9
            assert not watch.check()
            assert watch.running_s() == pytest.approx(29.9)
            clock.now += 0.1
            assert watch.check()
            assert "engine step running for 30 s" in caplog.text
            assert "wait_for_the_device" in caplog.text, "the warning says where the engine thread waits"
            clock.now += 15
            assert not watch.check(), "once per threshold"
            clock.now += 15
            assert watch.check(), "again at twice the threshold"
            assert watch.stalled_steps == 1
    finally:
        release.set()
        engine.join()
    assert watch.running_s() == 0.0 and not watch.check()


def test_each_step_is_measured_from_its_own_start():
    clock = Clock()
    watch = StepWatch(warn_s=30, clock=clock)
    watch.begin()
    clock.now += 40
    assert watch.check()
    watch.end()
    watch.begin()
    clock.now += 10
    assert watch.running_s() == 10 and not watch.check()
    clock.now += 20
    assert watch.check(), "a new step starts at the first threshold again"
    assert watch.stalled_steps == 2
    watch.end()


def test_the_watcher_thread_reports_a_stalled_step(caplog):
    watch = StepWatch(warn_s=0.05, check_s=0.01)
    entered, release = threading.Event(), threading.Event()
    engine = threading.Thread(target=wait_for_the_device, args=(entered, release, watch))
    with caplog.at_level(logging.WARNING, logger="lorad.daemon.engine.step_watch"):
        watch.start()
        engine.start()
        try:
            assert entered.wait(10)
            deadline = time.monotonic() + 10
            while watch.stalled_steps == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            release.set()
            engine.join()
            watch.stop()
    assert watch.stalled_steps == 1 and "wait_for_the_device" in caplog.text
