"""bench/stream_issue.py on the CPU: the pools it fragments hand an adapter its pages in the runs it names."""

from __future__ import annotations

import sys

import numpy as np
import torch

from bench_scripts import load


def test_a_fragmented_pool_hands_out_runs_of_the_size_asked():
    stream_issue = load("stream_issue")
    for run, expected in ((0, 1), (4, 16), (1, 64)):
        pool = stream_issue.fragmented_pool(130, 8, run, torch.device("cpu"))
        ids = pool.alloc(64, "adapter")
        runs = np.flatnonzero(np.diff(ids) != 1).size + 1
        assert runs == expected, (run, runs)


def test_the_smoke_run_places_a_small_adapter(monkeypatch, capsys):
    stream_issue = load("stream_issue")
    monkeypatch.setattr(sys, "argv", ["stream_issue.py", "--smoke", "--rank", "4"])
    stream_issue.main()
    assert "pages placed in" in capsys.readouterr().out
