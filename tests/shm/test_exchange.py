"""The exchange segment: layout, attach by name, jobs posted by one process and answered by another."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from lorad.shm.exchange import (
    ERROR_WORD,
    STATUS_ERROR,
    STATUS_OK,
    Exchange,
    ExchangeConfig,
    ExchangeLayout,
    Job,
)
from lorad.shm.segment import lorad_segments, new_instance

pytestmark = pytest.mark.usefixtures("no_leftover_segments")  # tests/conftest.py

fork = multiprocessing.get_context("fork")


def test_layout_is_aligned_and_disjoint():
    config = ExchangeConfig(workers=3, max_tokens=7, hidden=30, max_out=45)
    layout = ExchangeLayout.of(config)
    assert config.in_stride == 32 and config.out_stride == 48  # rows padded to 64 bytes
    lines = [layout.job_line(w) for w in range(3)] + [layout.worker_line(w) for w in range(3)]
    assert all(offset % 64 == 0 for offset in lines + [layout.input, layout.output, layout.size])
    assert len(set(lines)) == 6 and max(lines) + 64 <= layout.input
    assert layout.input + 7 * 32 * 4 <= layout.output
    assert layout.output + 7 * 48 * 4 <= layout.size
    with pytest.raises(ValueError):
        ExchangeConfig(workers=0, max_tokens=1, hidden=1, max_out=1)


def test_attach_reads_the_layout_back():
    config = ExchangeConfig(workers=2, max_tokens=16, hidden=64, max_out=96)
    with Exchange.create(new_instance(), config) as exchange:
        exchange.input[3, :64] = 1.5
        other = Exchange.attach(exchange.name)
        assert other.config == config
        assert (other.input[3, :64] == 1.5).all()
        other.close()
        assert exchange.name in lorad_segments()


def _answer_jobs(name, worker, jobs):
    # A stand-in worker: for each job, output rows = 2 * input rows (or an error for adapter 99).
    exchange = Exchange.attach(name)
    slot = exchange.slots[worker]
    slot.pid = 1234
    for seq in range(1, jobs + 1):
        slot.job_flag.wait(seq, timeout_s=10)
        job = slot.take()
        rows = slice(job.row_start, job.row_end)
        if job.adapter_id == 99:
            slot.finish(seq, STATUS_ERROR)
            continue
        exchange.output[rows, : job.out_features] = 2 * exchange.input[rows, : job.out_features]
        slot.finish(seq, STATUS_OK)
    exchange.close()


def test_jobs_round_trip_between_processes():
    config = ExchangeConfig(workers=2, max_tokens=32, hidden=16, max_out=16)
    rng = np.random.default_rng(0)
    with Exchange.create(new_instance(), config) as exchange:
        children = [fork.Process(target=_answer_jobs, args=(exchange.name, w, 50)) for w in range(2)]
        for child in children:
            child.start()
        for seq in range(1, 51):
            x = rng.standard_normal((32, 16), dtype=np.float32)
            exchange.input[:, :16] = x
            for worker, (start, end) in enumerate([(0, 20), (20, 32)]):
                adapter = 99 if seq == 25 and worker == 1 else seq
                exchange.slots[worker].post(seq, Job(adapter, 1, 2, start, end, 16, 16))
            for slot in exchange.slots:
                slot.done_flag.wait(seq, timeout_s=10)
            assert exchange.slots[0].status == STATUS_OK
            if seq == 25:
                assert exchange.slots[1].status == STATUS_ERROR
                assert np.array_equal(exchange.output[:20, :16], 2 * x[:20])
            else:
                assert exchange.slots[1].status == STATUS_OK
                assert np.array_equal(exchange.output[:, :16], 2 * x)
        for child in children:
            child.join(20)
            assert child.exitcode == 0
        assert exchange.slots[0].pid == 1234
        assert exchange.slots[1].take() == Job(50, 1, 2, 20, 32, 16, 16)


def _watch_batches(name, rounds, workers, result):
    # Reads every worker's job flag, then its descriptor and input row: both must be of that seq or later.
    exchange = Exchange.attach(name)
    bad = checks = 0
    while checks == 0 or int(exchange.job_flags.min()) < rounds:
        seen = exchange.job_flags.copy()
        for worker in range(workers):
            seq = int(seen[worker])
            if seq == 0:
                continue
            job = exchange.slots[worker].take(seq)
            if job is None or job.row_start != worker or exchange.input[worker, 0] < seq:
                bad += 1
            checks += 1
    exchange.header[ERROR_WORD] = bad if bad else -checks
    exchange.close()


def test_post_batch_publishes_descriptors_and_data_before_flags():
    workers, rounds = 4, 3000
    config = ExchangeConfig(workers=workers, max_tokens=workers, hidden=16, max_out=16, ring=4096)
    with Exchange.create(new_instance(), config) as exchange:
        child = fork.Process(target=_watch_batches, args=(exchange.name, rounds, workers, None))
        child.start()
        starts = np.arange(workers, dtype=np.int64)
        seqs = np.zeros(workers, dtype=np.int64)
        for seq in range(1, rounds + 1):
            exchange.input[:, 0] = seq  # the data, then the descriptors, then the flags
            seqs[:] = seq
            exchange.post_batch(seqs, 7, 1, 2, starts, starts + 1, 16, 16)
        child.join(20)
        assert child.exitcode == 0
        assert exchange.header[ERROR_WORD] < 0, f"{exchange.header[ERROR_WORD]} reads saw a flag ahead of its job"
        assert [slot.take() for slot in exchange.slots] == [Job(7, 1, 2, w, w + 1, 16, 16) for w in range(workers)]
        assert exchange.job_flags.tolist() == [rounds] * workers


def test_post_batch_matches_one_post_per_worker():
    config = ExchangeConfig(workers=3, max_tokens=8, hidden=16, max_out=16, ring=4)
    with Exchange.create(new_instance(), config) as exchange:
        seqs = np.array([5, 9, 2], dtype=np.int64)  # workers at different seqs: different ring entries
        exchange.post_batch(seqs, np.array([3, 4, 5]), 1, 6, np.array([0, 2, 5]), np.array([2, 5, 8]), 16, 8, 2)
        assert [slot.job_flag.load() for slot in exchange.slots] == [5, 9, 2]
        assert [slot.take() for slot in exchange.slots] == [
            Job(3, 1, 6, 0, 2, 16, 8, 2), Job(4, 1, 6, 2, 5, 16, 8, 2), Job(5, 1, 6, 5, 8, 16, 8, 2)]
        exchange.slots[1].finish(9, STATUS_ERROR)
        assert exchange.done_flags.tolist() == [0, 9, 0] and exchange.statuses.tolist() == [0, STATUS_ERROR, 0]
