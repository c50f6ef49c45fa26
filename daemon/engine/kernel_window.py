"""A diagnostic: the device's kernels over a window of served steps, by name (torch.profiler, which sees inside
CUDA graph replays), beside the engine's own account of the same steps by kind.

    LORAD_PROFILE_KERNELS=FIRST:COUNT:FILE lorad serve ...

profiles steps FIRST .. FIRST+COUNT-1 of the engine and writes FILE (JSON) when the window closes: each kernel's
device time and calls, and the window's steps, busy time, device time and floor by kind (step_account.py). The
steps in the window run slower (the profiler's own work); their share of each kind is what to read.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

KERNELS_ENV = "LORAD_PROFILE_KERNELS"


class KernelWindow:
    def __init__(self, spec: str):
        try:
            first, count, self.path = spec.split(":", 2)
            self.first, self.count = int(first), int(count)
        except ValueError:
            raise ValueError(f"{KERNELS_ENV} must be FIRST:COUNT:FILE (step numbers and a path), got {spec!r}") from None
        if self.first < 0 or self.count <= 0 or not self.path:
            raise ValueError(f"{KERNELS_ENV}: FIRST >= 0, COUNT > 0 and a FILE, got {spec!r}")
        self.profiler = None
        self.before: dict | None = None  # the account's snapshot, and the engine's step count, where the window opened
        self.opened = 0
        self.done = False

    @classmethod
    def from_env(cls) -> "KernelWindow | None":
        spec = os.environ.get(KERNELS_ENV)
        return cls(spec) if spec else None

    def step(self, steps: int, account) -> None:
        """Called before each step with the engine's count of steps so far; opens and closes the window."""
        if self.done:
            return
        if self.profiler is None and steps >= self.first:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self.before, self.opened = account.snapshot(), steps
            log.warning("kernel profile window open at step %d for %d steps (%s): these steps run slower",
                        steps, self.count, KERNELS_ENV)
        elif self.profiler is not None and steps >= self.opened + self.count:
            self.close(steps, account)

    def close(self, steps: int, account) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.done = True
        kernels = {}
        for event in self.profiler.key_averages():
            device_us = getattr(event, "self_device_time_total", 0)
            if device_us > 0:
                kernels[event.key] = {"ms": round(device_us / 1e3, 3), "calls": event.count}
        after = account.snapshot()
        by_kind = {}
        for kind, totals in after["by_kind"].items():
            was = self.before["by_kind"].get(kind, {})
            by_kind[kind] = {key: round(totals[key] - (was.get(key) or 0), 6)
                             for key in ("steps", "busy_s", "device_s", "floor_s", "rows", "prompt_tokens")
                             if totals.get(key) is not None}
        report = {"first_step": self.opened, "steps": steps - self.opened, "by_kind": by_kind,
                  "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["ms"]))}
        with open(self.path, "w") as handle:
            json.dump(report, handle, indent=1)
        log.warning("kernel profile of steps %d..%d written to %s", self.opened, steps - 1, self.path)
