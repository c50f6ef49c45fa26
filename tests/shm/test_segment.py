"""Segments: creation and attachment by name, views, cross-process visibility, cleanup, stale sweep."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import posix_ipc
import pytest
import torch

from lorad.shm.segment import Segment, creator_pid, lorad_segments, new_instance, segment_name, sweep_stale

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

fork = multiprocessing.get_context("fork")


def test_names_carry_the_creating_pid():
    instance = new_instance()
    name = segment_name(instance, "exchange")
    assert name.startswith(f"/lorad-{os.getpid()}x")
    assert creator_pid(name) == os.getpid()
    assert creator_pid("/lorad-foo") is None
    with pytest.raises(ValueError):
        segment_name(instance, "a/b")
    with pytest.raises(ValueError):
        segment_name("not-an-instance", "store")


def test_owner_unlinks_on_close_and_attacher_does_not():
    name = segment_name(new_instance(), "t")
    with Segment.create(name, 4096):
        assert name in lorad_segments()
        with Segment.attach(name) as other:
            assert other.size == 4096 and not other.owner
        assert name in lorad_segments()  # the attacher's close leaves the name
        with pytest.raises(posix_ipc.ExistentialError):
            Segment.create(name, 4096)  # names are exclusive
    assert name not in lorad_segments()
    with pytest.raises(posix_ipc.ExistentialError):
        Segment.attach(name)


def test_views_share_memory_and_check_bounds():
    name = segment_name(new_instance(), "views")
    with Segment.create(name, 1 << 16) as segment:
        array = segment.array(128, (4, 8), np.float32)
        tensor = segment.tensor(128, (4, 8))
        array[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
        assert torch.equal(tensor, torch.arange(32, dtype=torch.float32).reshape(4, 8))
        tensor[1, 2] = -1.0
        assert array[1, 2] == -1.0
        with pytest.raises(ValueError):
            segment.array((1 << 16) - 8, 4, np.float32)  # past the end
        with pytest.raises(ValueError):
            segment.array(2, 1, np.float32)  # misaligned
        del array, tensor


def test_close_with_live_views_still_unlinks():
    name = segment_name(new_instance(), "live")
    segment = Segment.create(name, 4096)
    view = segment.array(0, 16, np.int64)
    segment.close()
    assert name not in lorad_segments()
    del view


def _child_reads_then_writes(name, queue):
    with Segment.attach(name) as segment:
        data = segment.array(0, 1000, np.float64)
        queue.put(float(data.sum()))
        data[:] = 2.0
        del data


def test_cross_process_visibility_both_ways():
    name = segment_name(new_instance(), "xproc")
    with Segment.create(name, 8000) as segment:
        data = segment.array(0, 1000, np.float64)
        data[:] = np.arange(1000)
        queue = fork.Queue()
        child = fork.Process(target=_child_reads_then_writes, args=(name, queue))
        child.start()
        assert queue.get(timeout=20) == float(np.arange(1000).sum())  # parent wrote, child read
        child.join(20)
        assert child.exitcode == 0
        assert (data == 2.0).all()  # child wrote, parent reads
        del data


def _child_creates_and_waits(queue):
    segment = Segment.create(segment_name(new_instance(), "orphan"), 4096)
    segment.array(0, 4, np.int64)[:] = 7
    queue.put(segment.name)
    signal.pause()


def test_sweep_removes_the_segments_of_a_killed_process():
    queue = fork.Queue()
    child = fork.Process(target=_child_creates_and_waits, args=(queue,))
    child.start()
    name = queue.get(timeout=20)
    assert creator_pid(name) == child.pid
    mine = segment_name(new_instance(), "alive")
    with Segment.create(mine, 4096):
        # (Sweeps are limited to our own names: other test sessions may be running beside us.)
        assert sweep_stale(prefix=f"/lorad-{child.pid}x") == []  # the child is alive: kept
        assert name in lorad_segments()
        os.kill(child.pid, signal.SIGKILL)
        child.join(20)
        assert sweep_stale(prefix=f"/lorad-{child.pid}x") == [name]
        assert name not in lorad_segments()
        assert sweep_stale(prefix=f"/lorad-{os.getpid()}x") == []  # a live process's segment survives
        assert mine in lorad_segments()
    assert not [n for n in lorad_segments() if creator_pid(n) in (child.pid, os.getpid())]


def test_sweep_treats_an_unreaped_zombie_as_dead():
    queue = fork.Queue()
    child = fork.Process(target=_child_creates_and_waits, args=(queue,))
    child.start()
    name = queue.get(timeout=20)
    os.kill(child.pid, signal.SIGKILL)
    # Not joined yet, so it turns into a zombie: dead, but `kill(pid, 0)` still succeeds.
    for _ in range(2000):
        with open(f"/proc/{child.pid}/stat", "rb") as stat:
            if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        time.sleep(0.001)
    assert sweep_stale(prefix=f"/lorad-{child.pid}x") == [name]
    child.join(20)
    assert name not in lorad_segments()


def test_sweep_leaves_another_users_and_another_namespaces_segments(monkeypatch):
    from lorad.shm import segment as segment_module

    queue = fork.Queue()
    child = fork.Process(target=_child_creates_and_waits, args=(queue,))
    child.start()
    name = queue.get(timeout=20)
    os.kill(child.pid, signal.SIGKILL)
    child.join(20)
    prefix = f"/lorad-{child.pid}x"
    try:
        # owned by someone else (as another user's daemon would leave it): logged, kept, no error
        monkeypatch.setattr(segment_module.os, "geteuid", lambda: os.getuid() + 1)
        assert sweep_stale(prefix=prefix) == [] and name in lorad_segments()
        monkeypatch.undo()
        # created in another pid namespace: its pid means nothing here
        monkeypatch.setattr(segment_module, "pid_namespace", lambda: segment_module.creator_namespace(name) + 1)
        assert sweep_stale(prefix=prefix) == [] and name in lorad_segments()
        monkeypatch.undo()
        assert sweep_stale(prefix=prefix) == [name]  # ours, and our namespace's: swept
    finally:
        monkeypatch.undo()
        sweep_stale(prefix=prefix)


def test_an_old_name_without_a_namespace_is_still_judged_by_its_pid():
    assert creator_pid("/lorad-123xab12-flags") == 123
    from lorad.shm.segment import creator_namespace

    assert creator_namespace("/lorad-123xab12-flags") is None
    assert creator_namespace("/lorad-123xab12n4026531836-flags") == 4026531836
