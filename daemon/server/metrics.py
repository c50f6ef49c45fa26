"""How GET /metrics shows what the engine counts (daemon/engine/stats.py): `render(snapshot)` writes the
engine's snapshot in Prometheus' text exposition format (0.0.4) under the names LoRA-aware routers read
(vLLM's `vllm:*`) and lorad's own (`lorad_*`).
"""

from __future__ import annotations

import math

from lorad.daemon.engine.step_watch import STALL_WARN_S

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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

    out.family("lorad_engine_info", "gauge",
               "What the engine serves: its base model's weights (quantization none or fp8) and its KV pages' dtype; value 1.")
    out.sample("lorad_engine_info", {**model, "quantization": snapshot.get("quantization", "none"),
                                     "kv_cache_dtype": snapshot.get("kv_cache_dtype", "")}, 1)
    out.family("lorad_kv_capacity_tokens", "gauge", "KV-cache positions the whole page pool holds (no adapter resident).")
    out.sample("lorad_kv_capacity_tokens", {}, snapshot.get("kv_capacity_tokens", 0))
    out.family("lorad_engine_step_running_seconds", "gauge",
               "How long the engine's step now running has run (0 between steps); steps take milliseconds.")
    out.sample("lorad_engine_step_running_seconds", {}, snapshot.get("step_running_s", 0.0))
    out.family("lorad_engine_stalled_steps_total", "counter",
               f"Engine steps that ran {STALL_WARN_S:.0f} s or more (each logged with where the engine thread waited).")
    out.sample("lorad_engine_stalled_steps_total", {}, snapshot.get("stalled_steps", 0))
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
    out.family("lorad_preemptions_total", "counter",
               "Running requests preempted when the KV cache ran short; their tokens are computed again.")
    out.sample("lorad_preemptions_total", {}, snapshot.get("preemptions", 0))
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
    if snapshot.get("tensor_parallel_ranks"):
        out.family("lorad_tensor_parallel_rank_up", "gauge",
                   "Each rank of a tensor-parallel engine (one process and GPU each; every rank's pool mirrors rank 0's "
                   "pages): 1 while its process lives.")
        for rank, device, alive in snapshot["tensor_parallel_ranks"]:
            out.sample("lorad_tensor_parallel_rank_up", {"rank": str(rank), "device": device}, int(alive))
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
    steps = snapshot.get("steps", {})
    out.family("lorad_step_seconds", "histogram",
               "Engine steps by kind (decode, prefill, mixed): the wall time each took, from the previous step's landing.")
    for kind, account in steps.items():
        out.histogram("lorad_step_seconds", {"kind": kind}, account["seconds"])
    for name, key, help_text in (
        ("lorad_step_busy_seconds_total", "busy_s", "Wall time of engine steps by kind (the sum of lorad_step_seconds)."),
        ("lorad_step_floor_seconds_total", "floor_s",
         "The least time the same steps could take on this device: bytes / HBM bandwidth or FLOPs / GEMM rate, "
         "the slower, measured at start-up. Floor over busy is the engine's efficiency."),
        ("lorad_step_serial_floor_seconds_total", "serial_floor_s",
         "The same steps' least time with each step's phases one after the other: the projections, attention and "
         "LoRA, each bound by its own bytes or FLOPs. Above the floor where a step's GEMMs (compute) and attention "
         "(memory) cannot hide each other, as in a mixed step."),
        ("lorad_step_rows_total", "rows", "Token rows computed by engine steps, by kind."),
        ("lorad_step_padding_rows_total", "padding_rows",
         "Rows of CUDA-graph token buckets past the steps' own rows (computed for no token), by kind."),
        ("lorad_step_prompt_tokens_total", "prompt_tokens", "Prompt tokens computed by engine steps, by kind."),
    ):
        out.family(name, "counter", help_text)
        for kind, account in steps.items():
            out.sample(name, {"kind": kind}, account[key])
    for name, key, label, help_text in (  # by kind and one more label
        ("lorad_step_host_before_launch_seconds_total", "host_parts_s", "part",
         "The host's work from the previous step's landing to a step's launch (the device had no step to run), "
         "by kind and part: tokens (handed back), schedule (admission), plan, launch."),
        ("lorad_step_empty_slots_total", "empty_slots", "cause",
         "Running slots engine steps left empty (slot-steps), by kind and cause: no_request_waiting, running_full, "
         "token_budget, adapter_staging, kv_or_adapter_pages, time_per_token, admission_policy, ended_in_flight."),
    ):
        out.family(name, "counter", help_text)
        for kind, account in steps.items():
            for value_of, value in account.get(key, {}).items():
                out.sample(name, {"kind": kind, label: value_of}, value)
    if any(account.get("device_s") is not None for account in steps.values()):  # a device clock (cuda)
        out.family("lorad_step_device_seconds_total", "counter",
                   "Engine steps' forwards on the device's clock, by kind: busy minus device is the device's work on "
                   "the tokens and its waits for the host (the two counters below).")
        for kind, account in steps.items():
            out.sample("lorad_step_device_seconds_total", {"kind": kind}, account["device_s"] or 0.0)
        for name, key, help_text in (
            ("lorad_step_tokens_device_seconds_total", "tokens_device_s",
             "The device's work on engine steps' tokens after their forwards (sampling, logprobs, the copies to the "
             "host), by kind."),
            ("lorad_step_before_forward_seconds_total", "before_forward_s",
             "The device's time from the previous step's tokens to a step's forward (waiting for the host's launch), "
             "by kind."),
        ):
            out.family(name, "counter", help_text)
            for kind, account in steps.items():
                out.sample(name, {"kind": kind}, account.get(key) or 0.0)
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
