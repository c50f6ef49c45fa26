"""The engine thread's step, watched from another thread: how long the step now running has run (`/v1/status`
`step_running_s`, `/metrics` `lorad_engine_step_running_seconds`), and a warning in the log, with where the engine
thread is, once a step has run STALL_WARN_S and again each time that doubles.

A step takes milliseconds. One that runs for seconds waits on something that does not come: the device (a kernel
spinning for a copy queued behind it, a collective whose peer is gone) or the host. Requests then get no tokens
while the daemon answers /health and /v1/status; this makes that visible, and says where the engine thread waits.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

STALL_WARN_S = 30.0  # a step this long is reported (a Triton kernel compiled at its first launch takes seconds)
CHECK_S = 5.0  # how often the watcher looks
STACK_FRAMES = 8  # the engine thread's innermost frames in the warning


class StepWatch:
    """begin() / end() around each step, on the engine thread; running_s() and check() from any thread; start()
    runs check() every CHECK_S on a thread of its own until stop()."""

    def __init__(self, warn_s: float = STALL_WARN_S, check_s: float = CHECK_S, clock=time.monotonic):
        self.warn_s, self.check_s, self._clock = warn_s, check_s, clock
        self._step: tuple[float, int] | None = None  # (when the running step began, the engine thread's id)
        self._next_warn = warn_s
        self.stalled_steps = 0  # steps that ran past warn_s
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def begin(self) -> None:
        self._next_warn = self.warn_s
        self._step = (self._clock(), threading.get_ident())

    def end(self) -> None:
        self._step = None

    def running_s(self) -> float:
        """How long the step now running has run; 0 between steps."""
        step = self._step
        return 0.0 if step is None else max(0.0, self._clock() - step[0])

    def check(self) -> bool:
        """Logs a warning when the step now running has passed the next threshold (warn_s, then twice that, ...)
        -> whether it did."""
        step = self._step
        if step is None:
            return False
        running = self._clock() - step[0]
        if running < self._next_warn:
            return False
        if self._next_warn == self.warn_s:
            self.stalled_steps += 1
        self._next_warn *= 2
        frame = sys._current_frames().get(step[1])
        where = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]) if frame is not None else "  (thread gone)\n"
        log.warning("engine step running for %.0f s: no token comes out until it ends (it waits for the device or a "
                    "lock); the engine thread is at:\n%s", running, where.rstrip("\n"))
        return True

    def start(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="lorad-step-watch", daemon=True)
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def _watch(self) -> None:
        while not self._stop.wait(self.check_s):
            self.check()
