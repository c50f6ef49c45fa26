"""Timing helpers shared by the benchmarks: per-call microseconds from CUDA events (or perf_counter on
the CPU, for --smoke runs), eagerly or from replays of a CUDA graph, the device copy bandwidth that
every roofline figure is measured against, and an earlier commit's module file loaded to be timed beside
the current one (--baseline)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch


class Timer:
    """Per-call times in microseconds: CUDA events on the GPU, perf_counter on the CPU (smoke)."""

    def __init__(self, device: torch.device, reps: int, graph_on_cpu: bool = False):
        self.cuda = device.type == "cuda"
        self.reps = reps
        self.graph_on_cpu = graph_on_cpu  # graph() without CUDA: eager time (True) or None (False)

    def _span(self, body) -> float:
        if not self.cuda:
            start = time.perf_counter()
            body()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        body()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    def eager(self, calls: list, reps: int | None = None) -> float:
        for call in calls:  # warm-up: compilation, caches
            call()
        self._sync()

        def body():
            for call in calls:
                call()

        times = [self._span(body) for _ in range(reps or self.reps)]
        return statistics.median(times) / len(calls) * 1e3

    def graph(self, calls: list, repeat_inside: int = 1, reps: int | None = None) -> float | None:
        """Device time per call from replays of one CUDA graph holding repeat_inside rounds of calls."""
        if not self.cuda:
            return self.eager(calls, reps=1) if self.graph_on_cpu else None
        for call in calls:
            call()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat_inside):
                for call in calls:
                    call()
        graph.replay()
        self._sync()
        times = [self._span(graph.replay) for _ in range(reps or self.reps)]
        del graph
        return statistics.median(times) / (len(calls) * repeat_inside) * 1e3

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, timer: Timer, mebibytes: int, reps: int | None = None) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    elements = mebibytes * (1 << 20) // 2
    source = torch.randn(elements, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    microseconds = timer.eager([lambda: target.copy_(source)], reps=reps or max(10, timer.reps // 4))
    del source, target
    return 2 * elements * 2 / (microseconds * 1e-6) / 1e9


def load_module_file(path: str, name: str):
    """The module in file `path` (an earlier commit's source, `git show REV:FILE > OLD.py`) under the name `name`,
    registered in sys.modules (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
