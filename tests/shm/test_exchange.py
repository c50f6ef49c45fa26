"""The exchange segment: layout, attach by name, jobs posted by one process and answered by another."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

from lorad.shm.exchange import STATUS_ERROR, STATUS_OK, Exchange, ExchangeConfig, ExchangeLayout, Job
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
