"""Stand-ins for the step account's inputs, shared by its tests (tests/daemon/engine/test_step_account.py) and the
metrics' (tests/daemon/server/test_metrics.py): a sequence, a step plan of rows, and a CUDA event on a fake
device clock."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lorad.daemon.engine.step_plan import StepPlan


@dataclass(eq=False)
class Seq:
    prompt_len: int
    adapter: str | None = None


def plan(rows: list[tuple[Seq, int, int, bool]]) -> StepPlan:
    """rows: (sequence, first position, new tokens, sampled)."""
    return StepPlan([np.zeros(count, dtype=np.int64) for _, _, count, _ in rows],
                    np.array([start for _, start, _, _ in rows]), np.full(len(rows), -1),
                    [np.zeros((1, 1, 2), dtype=np.int32) for _ in rows], np.array([sampled for *_, sampled in rows]),
                    seqs=[seq for seq, *_ in rows])


class FakeEvent:
    """A CUDA event on a fake device clock: `clock` is where the device is, `at` where the event was recorded."""
    clock = 0.0
    next_at = 0.0

    def __init__(self):
        self.at = None

    def record(self):
        self.at = FakeEvent.next_at
        FakeEvent.next_at += 0.25  # each event recorded 250 ms of device time after the one before

    def query(self):
        return self.at <= FakeEvent.clock

    def elapsed_time(self, end):
        assert self.query() and end.query(), "read before the device passed it"
        return (end.at - self.at) * 1e3
