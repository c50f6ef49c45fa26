"""What the engine counts and how GET /metrics shows it.

The engine updates one `Metrics` (thread-safe, a few integer additions per request) and hands out
`snapshot()`, a plain dict that pickles: the engine may live in another process than the API.
`render(snapshot)` writes it in Prometheus' text exposition format (0.0.4) under the names LoRA-aware
routers read (vLLM's `vllm:*`) and lorad's own (`lorad_*`).
"""

from __future__ import annotations

import bisect
import math
import threading
import time

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


# --- the text exposition format ------------------------------------------------------------------------


def render(snapshot: dict) -> str:
    """`snapshot`: Metrics.snapshot() with the engine's gauges: model, running, waiting,
    running_adapters, waiting_adapters (lists of names), max_lora, pool ({pages, free, kv, adapter}),
    adapters_resident, adapter_evictions."""
    model = {"model_name": snapshot["model"]}
    pool = snapshot["pool"]
    out = _Writer()

    # What vLLM exports and LoRA-aware routers (e.g. the Gateway API inference extension) read.
    out.family("vllm:num_requests_running", "gauge", "Requests in the running batch.")
    out.sample("vllm:num_requests_running", model, snapshot["running"])
    out.family("vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted.")
    out.sample("vllm:num_requests_waiting", model, snapshot["waiting"])
    out.family("vllm:gpu_cache_usage_perc", "gauge", "KV-cache pages in use over all page-pool pages (0 to 1).")
    out.sample("vllm:gpu_cache_usage_perc", model, pool["kv"] / pool["pages"] if pool["pages"] else 0.0)
    out.family("vllm:lora_requests_info", "gauge",
               "Adapters of running and waiting requests; the value is the time of this snapshot.")
    out.sample("vllm:lora_requests_info", {
        "running_lora_adapters": ",".join(_unique(snapshot["running_adapters"])),
        "waiting_lora_adapters": ",".join(_unique(snapshot["waiting_adapters"])),
        "max_lora": str(snapshot["max_lora"]),
    }, snapshot["time"])

    out.family("lorad_requests_total", "counter", "Finished requests by finish reason.")
    for reason, count in sorted(snapshot["requests"].items()):
        out.sample("lorad_requests_total", {"finish_reason": reason}, count)
    out.family("lorad_admission_dropped_total", "counter",
               "Queued requests the admission policy dropped (early abort: their TTFT objective was out of reach).")
    for policy, count in sorted(snapshot.get("admission_dropped", {}).items()):
        out.sample("lorad_admission_dropped_total", {"policy": policy}, count)
    out.family("lorad_admission_tpot_held_total", "counter",
               "Queued requests held back (they waited) because the decode step with them would break slo_tpot_ms.")
    out.sample("lorad_admission_tpot_held_total", {}, snapshot.get("admission_tpot_held", 0))
    out.family("lorad_prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
    out.sample("lorad_prompt_tokens_total", {}, snapshot["prompt_tokens"])
    out.family("lorad_generation_tokens_total", "counter", "Tokens generated for finished requests.")
    out.sample("lorad_generation_tokens_total", {}, snapshot["generation_tokens"])
    out.family("lorad_time_to_first_token_seconds", "histogram", "From arrival at the engine to the first token.")
    out.histogram("lorad_time_to_first_token_seconds", {}, snapshot["time_to_first_token"])
    out.family("lorad_time_per_output_token_seconds", "histogram",
               "Mean time between output tokens of a finished request (after the first).")
    out.histogram("lorad_time_per_output_token_seconds", {}, snapshot["time_per_output_token"])
    out.family("lorad_request_latency_seconds", "histogram", "From arrival at the engine to the end of a request.")
    out.histogram("lorad_request_latency_seconds", {}, snapshot["request_latency"])

    out.family("lorad_adapter_loads_total", "counter",
               "Adapter loads by tier: disk_to_host (read and checked), host_to_pool (copied into the page pool).")
    for tier, count in sorted(snapshot["adapter_loads"].items()):
        out.sample("lorad_adapter_loads_total", {"tier": tier}, count)
    out.family("lorad_adapter_load_seconds", "histogram", "Duration of adapter loads by tier.")
    for tier, histogram in sorted(snapshot["adapter_load_seconds"].items()):
        out.histogram("lorad_adapter_load_seconds", {"tier": tier}, histogram)
    out.family("lorad_cold_starts_total", "counter",
               "Requests whose adapter was not in the page pool when they were admitted.")
    out.sample("lorad_cold_starts_total", {}, snapshot["cold_starts"])
    out.family("lorad_adapter_evictions_total", "counter", "Adapters evicted from the page pool.")
    out.sample("lorad_adapter_evictions_total", {}, snapshot["adapter_evictions"])
    out.family("lorad_adapters_resident", "gauge", "Adapters with their weights in the page pool.")
    out.sample("lorad_adapters_resident", {}, snapshot["adapters_resident"])
    out.family("lorad_pool_pages", "gauge", "Page-pool pages by owner (kv, adapter, free).")
    for owner in ("kv", "adapter", "free"):
        out.sample("lorad_pool_pages", {"owner": owner}, pool[owner])
    out.family("lorad_cpu_worker_restarts_total", "counter", "CPU LoRA workers replaced after dying or stalling.")
    out.sample("lorad_cpu_worker_restarts_total", {}, snapshot["worker_restarts"])
    out.family("lorad_cpu_jobs_native_total", "counter",
               "CPU LoRA jobs the workers' native loop served (the others went through their Python loop).")
    out.sample("lorad_cpu_jobs_native_total", {}, snapshot.get("cpu_jobs_native", 0))
    out.family("lorad_cold_start_decisions_total", "counter",
               "Cold admissions by what their first step did: gpu-wait (the adapter placed first), gpu-stream "
               "(placed while the step ran) or cpu-assist.")
    for decision, count in sorted(snapshot.get("cold_start_decisions", {"gpu-wait": 0, "gpu-stream": 0, "cpu-assist": 0}).items()):
        out.sample("lorad_cold_start_decisions_total", {"decision": decision}, count)
    out.family("lorad_cpu_assist_fallbacks_total", "counter",
               "CPU-assisted requests whose LoRA went back to the page pool after a CPU worker's job failed.")
    out.sample("lorad_cpu_assist_fallbacks_total", {}, snapshot.get("cpu_assist_fallbacks", 0))
    out.family("lorad_cpu_assist_layers_total", "counter",
               "Layers of CPU-assisted prefills by the path that served them: cpu (the workers) or gpu (the "
               "adapter's layer had arrived in the pool: layer-wise takeover).")
    for path, count in sorted(snapshot.get("cpu_assist_layers", {"cpu": 0, "gpu": 0}).items()):
        out.sample("lorad_cpu_assist_layers_total", {"path": path}, count)
    out.family("lorad_decode_lora_kernel_steps_total", "counter",
               "Decode steps with LoRA rows by the kernel chosen for them: bgmv or mbgmv (lorad profile's models).")
    for kernel, count in sorted(snapshot.get("lora_kernel_steps", {"bgmv": 0, "mbgmv": 0}).items()):
        out.sample("lorad_decode_lora_kernel_steps_total", {"kernel": kernel}, count)
    return out.text()


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict, value: float) -> None:
        if labels:
            pairs = ",".join(f'{key}="{_escape_label(str(val))}"' for key, val in labels.items())
            name = f"{name}{{{pairs}}}"
        self.lines.append(f"{name} {_number(value)}")

    def histogram(self, name: str, labels: dict, histogram: dict) -> None:
        cumulative = 0
        for bound, count in zip([*histogram["bounds"], math.inf], histogram["counts"]):
            cumulative += count
            self.sample(f"{name}_bucket", {**labels, "le": _number(bound)}, cumulative)
        self.sample(f"{name}_sum", labels, histogram["sum"])
        self.sample(f"{name}_count", labels, cumulative)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _unique(names: list) -> list[str]:
    """Adapter names in first-seen order, without the base model's requests (None)."""
    return list(dict.fromkeys(name for name in names if name is not None))
