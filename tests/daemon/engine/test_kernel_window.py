"""daemon/engine/kernel_window.py: LORAD_PROFILE_KERNELS's window opens and closes at the steps asked, and its
report holds the window's own share of the engine's account."""

from __future__ import annotations

import json

import pytest
import torch

from lorad.daemon.engine.kernel_window import KernelWindow


class FakeAccount:
    def __init__(self):
        self.steps = 0

    def snapshot(self):
        return {"by_kind": {"decode": {"steps": self.steps, "busy_s": 0.01 * self.steps, "device_s": None, "floor_s": 0.005 * self.steps,
                                       "rows": 8 * self.steps, "prompt_tokens": 0}}}


@pytest.mark.parametrize("spec", ["", "3", "a:2:f", "3:0:f", "-1:2:f", "3:2:"])
def test_a_bad_window_is_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match="LORAD_PROFILE_KERNELS"):
        KernelWindow(spec) if spec else KernelWindow(":")


def test_the_window_covers_the_steps_asked_and_reports_them(tmp_path):
    window, account = KernelWindow(f"2:3:{tmp_path / 'k.json'}"), FakeAccount()
    for step in range(8):
        window.step(step, account)
        torch.ones(4) @ torch.ones(4)
        account.steps += 1
    report = json.loads((tmp_path / "k.json").read_text())
    assert report["first_step"] == 2 and report["steps"] == 3
    assert report["by_kind"]["decode"] == {"steps": 3, "busy_s": 0.03, "floor_s": 0.015, "rows": 24, "prompt_tokens": 0}
    assert window.done and isinstance(report["kernels"], dict)
