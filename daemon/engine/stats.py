"""What the engine counts: one `Metrics` (thread-safe, a few integer additions per request) whose
`snapshot()` is a plain dict that pickles, as the engine may live in another process than the API.
daemon/server/metrics.py renders it for GET /metrics.
"""

from __future__ import annotations

import bisect
import threading
import time

# Bucket upper bounds in seconds (the +Inf bucket is implicit).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Adapter load tiers: a read from disk into host memory, a copy from host memory into the page pool.
TIERS = ("disk_to_host", "host_to_pool")
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Counts per bucket (not cumulative: `render` sums them), their sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # bucket `le` holds value <= le
        self.sum += value

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class Metrics:
    """The engine's counters. Every method may be called from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(FINISH_REASONS, 0)  # finished requests by finish_reason
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cold_starts = 0
        self.worker_restarts = 0
        self.cold_start_decisions = {"gpu-wait": 0, "gpu-stream": 0, "cpu-assist": 0}  # scheduler/cold_start.py's choices
        self.cpu_assist_fallbacks = 0  # cpu-assisted requests sent back to the pool path by a failed job
        self.cpu_assist_layers_total = {"cpu": 0, "gpu": 0}  # layers of cpu-assisted prefills, by the path that served them
        self.lora_kernel_steps = {"bgmv": 0, "mbgmv": 0}  # decode steps by LoRA kernel (daemon/engine/kernel_choice.py)
        self.admission_dropped = {}  # queued requests dropped by the admission policy, by policy name
        self.adapter_loads = dict.fromkeys(TIERS, 0)
        self.adapter_load_seconds = {tier: Histogram(LOAD_BUCKETS) for tier in TIERS}
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.time_per_output_token = Histogram(TPOT_BUCKETS)
        self.request_latency = Histogram(LATENCY_BUCKETS)

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def request_finished(self, reason: str, prompt_tokens: int, generation_tokens: int, latency_s: float,
                         decode_s: float | None) -> None:
        """`decode_s`: time from the first token to the last (None when no token came)."""
        with self._lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.request_latency.observe(latency_s)
            if decode_s is not None and generation_tokens > 1:
                self.time_per_output_token.observe(decode_s / (generation_tokens - 1))

    def adapter_loaded(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.adapter_loads[tier] += 1
            self.adapter_load_seconds[tier].observe(seconds)

    def cold_start(self) -> None:
        with self._lock:
            self.cold_starts += 1

    def worker_restarted(self) -> None:
        with self._lock:
            self.worker_restarts += 1

    def cold_start_decided(self, decision: str) -> None:
        with self._lock:
            self.cold_start_decisions[decision] = self.cold_start_decisions.get(decision, 0) + 1

    def lora_kernel_chosen(self, kernel: str) -> None:
        with self._lock:
            self.lora_kernel_steps[kernel] = self.lora_kernel_steps.get(kernel, 0) + 1

    def cpu_assist_layers(self, path: str, count: int) -> None:
        with self._lock:
            self.cpu_assist_layers_total[path] = self.cpu_assist_layers_total.get(path, 0) + count

    def dropped_by_admission(self, policy: str) -> None:
        with self._lock:
            self.admission_dropped[policy] = self.admission_dropped.get(policy, 0) + 1

    def cpu_assist_fell_back(self) -> None:
        with self._lock:
            self.cpu_assist_fallbacks += 1

    def snapshot(self, **gauges) -> dict:
        """Everything counted so far plus the caller's gauges (see `render` for the keys it reads)."""
        with self._lock:
            return {
                "time": time.time(),
                "requests": dict(self.requests),
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "cold_starts": self.cold_starts,
                "worker_restarts": self.worker_restarts,
                "cold_start_decisions": dict(self.cold_start_decisions),
                "cpu_assist_fallbacks": self.cpu_assist_fallbacks,
                "cpu_assist_layers": dict(self.cpu_assist_layers_total),
                "lora_kernel_steps": dict(self.lora_kernel_steps),
                "admission_dropped": dict(self.admission_dropped),
                "adapter_loads": dict(self.adapter_loads),
                "adapter_load_seconds": {tier: h.snapshot() for tier, h in self.adapter_load_seconds.items()},
                "time_to_first_token": self.time_to_first_token.snapshot(),
                "time_per_output_token": self.time_per_output_token.snapshot(),
                "request_latency": self.request_latency.snapshot(),
                **gauges,
            }
