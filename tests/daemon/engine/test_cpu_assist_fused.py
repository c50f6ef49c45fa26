"""CpuAssist's fused path (daemon/engine/cpu_assist.py `_apply_fused`) on the CPU, with stand-ins for the worker pool
and the CUDA launcher that record what would be enqueued and launched: one copy_and_signal and one wait_and_add
per span, carrying each worker's own seq, wherever the span's workers are the first ones and its rows are
exactly the workers' (a token split tiling the span, a split group); a launch pair per worker otherwise, with a
split group's rows copied first and added last. The kernels themselves run in tests/daemon/engine/test_cold_start_gpu.py."""

from __future__ import annotations

import pytest
import torch

from lorad.daemon.engine import cpu_assist
from lorad.daemon.engine.cpu_assist import CpuAssist, CpuSpan

ROW_BYTES = 8 * 2  # 8 bf16 features
STRIDE = 6  # output row stride, floats


class _Pool:
    """Per-worker seqs that start apart (as after calibration), as WorkerPool.enqueue hands them out."""

    def __init__(self, seqs):
        self.seqs, self.jobs, self.groups = list(seqs), [], 0
        self.exchange = type("Exchange", (), {"config": type("Config", (), {"hidden": 8})()})()

    def enqueue(self, worker, job):
        self.seqs[worker] += 1
        self.jobs.append((worker, self.seqs[worker], job))
        return self.seqs[worker]

    def next_group(self):
        self.groups += 1
        return self.groups


class _Launcher:
    def __init__(self):
        self.calls = []

    def copy_and_signal(self, dst, src, flags, seq, stream):
        self.calls.append(("copy", dst, tuple(src.shape), flags, seq))

    def wait_and_add(self, out, result, stride, flags, seq, timeout_ns, stream, skip_if_error=False):
        self.calls.append(("wait", result, tuple(out.shape), flags, seq))


def _assist(monkeypatch, seqs, batched_workers):
    assist = CpuAssist.__new__(CpuAssist)
    assist.pool, assist.launcher, assist._cut_short, assist.job_timeout_s = _Pool(seqs), _Launcher(), False, 1.0
    workers = len(seqs)
    assist._job_flags_device = [("job", w) for w in range(workers)]
    assist._done_flags_device = [("done", w) for w in range(workers)]
    assist._job_flags_first = [("job", "0..", k) for k in range(1, batched_workers + 1)]
    assist._done_flags_first = [("done", "0..", k) for k in range(1, batched_workers + 1)]
    assist._input_address, assist._input_nbytes, assist._output_address, assist._output_stride = 1000, 1 << 20, 5000, STRIDE
    monkeypatch.setattr(cpu_assist.torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})())
    return assist


def _span(start, end, ranges, parts=1):
    return CpuSpan("r", 3, 0, frozenset({(0, 0)}), start, end, ranges, parts)


def test_one_launch_pair_per_span_with_each_workers_seq(monkeypatch):
    assist = _assist(monkeypatch, seqs=[4, 9, 2], batched_workers=3)
    x, y = torch.zeros(20, 8, dtype=torch.bfloat16), torch.zeros(20, 6, dtype=torch.bfloat16)
    tokens = _span(2, 11, [(2, 5), (5, 8), (8, 11)])
    group = _span(11, 15, [(11, 15)], parts=2)
    assist._apply_fused(x, y, 0, 0, [tokens, group])
    assert assist.launcher.calls == [
        ("copy", 1000 + 2 * ROW_BYTES, (9, 8), ("job", "0..", 3), [5, 10, 3]),
        ("copy", 1000 + 11 * ROW_BYTES, (4, 8), ("job", "0..", 2), [6, 11]),
        ("wait", 5000 + 2 * STRIDE * 4, (9, 6), ("done", "0..", 3), [5, 10, 3]),
        ("wait", 5000 + 11 * STRIDE * 4, (4, 6), ("done", "0..", 2), [6, 11]),
    ]
    jobs = [(worker, seq, job.row_start, job.row_end, job.split, job.splits) for worker, seq, job in assist.pool.jobs]
    assert jobs == [(0, 5, 2, 5, 0, 1), (1, 10, 5, 8, 0, 1), (2, 3, 8, 11, 0, 1), (0, 6, 11, 15, 0, 2), (1, 11, 11, 15, 1, 2)]


def test_spans_one_launch_cannot_serve_take_a_launch_pair_per_worker(monkeypatch):
    """Workers that are not the first ones, ranges that leave rows out, and a group with more parts than one
    launch takes: per worker; the group's rows go with part 0's copy first, and part 0's add comes last."""
    assist = _assist(monkeypatch, seqs=[0, 0, 0], batched_workers=1)
    x, y = torch.zeros(20, 8, dtype=torch.bfloat16), torch.zeros(20, 6, dtype=torch.bfloat16)
    assert not assist._batchable(_span(0, 4, [(0, 2), (3, 4)]), [(0, 1, 0, 2), (1, 1, 3, 4)])  # row 2 unwritten
    assert not assist._batchable(_span(0, 4, [(0, 4)]), [(1, 1, 0, 4)])  # not worker 0
    assist._apply_fused(x, y, 0, 0, [_span(0, 4, [(0, 2), (2, 4)]), _span(4, 9, [(4, 9)], parts=3)])
    copies = [call[1:] for call in assist.launcher.calls if call[0] == "copy"]
    waits = [call[1:] for call in assist.launcher.calls if call[0] == "wait"]
    assert copies == [(1000, (2, 8), ("job", 0), 1), (1000 + 2 * ROW_BYTES, (2, 8), ("job", 1), 1),
                      (1000 + 4 * ROW_BYTES, (5, 8), ("job", 0), 2), (1000 + 4 * ROW_BYTES, (0, 8), ("job", 1), 2),
                      (1000 + 4 * ROW_BYTES, (0, 8), ("job", 2), 1)]
    assert waits == [(5000, (2, 6), ("done", 0), 1), (5000 + 2 * STRIDE * 4, (2, 6), ("done", 1), 1),
                     (5000 + 4 * STRIDE * 4, (0, 6), ("done", 1), 2), (5000 + 4 * STRIDE * 4, (0, 6), ("done", 2), 1),
                     (5000 + 4 * STRIDE * 4, (5, 6), ("done", 0), 2)]


def test_a_full_ring_cuts_the_step_short(monkeypatch):
    assist = _assist(monkeypatch, seqs=[0, 0], batched_workers=2)
    assist.pool.enqueue = lambda worker, job: None
    x, y = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 6, dtype=torch.bfloat16)
    assist._apply_fused(x, y, 0, 0, [_span(0, 4, [(0, 2), (2, 4)])])
    assert assist._cut_short and assist.launcher.calls == []
    with pytest.raises(ValueError, match="do not fit the exchange"):
        assist._cut_short = False
        assist._apply_fused(torch.zeros(2, 16, dtype=torch.bfloat16), y, 0, 0, [])
