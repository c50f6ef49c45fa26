"""Cold start, per request: wait for the adapter's copy into the pool ("gpu-wait"), run the prefill on the
GPU while the copy streams in, each layer's LoRA waiting on the device for that layer's pages
("gpu-stream"), or run the prefill's LoRA on the CPU workers while it is copied ("cpu-assist",
CaraServe §4).

A pure cost comparison over numbers measured at start-up (or injected by tests and benchmarks):

    gpu-wait   = load_ms + prefill_ms
    gpu-stream = the forward walked layer by layer, layer l starting once both the layer before it is done
                 and its pages are in, at (l + 1) / L * load_ms: max(load_ms, prefill_ms) and a layer's share
    cpu-assist = correction * stage_ms + prefill_ms (+) correction * cpu_lora_ms   (+: max when overlapped, sum when serial)
    load_ms     = adapter_bytes / bytes_per_s of its tier (pinned, pageable host, ...)
    stage_ms    = adapter_bytes / stage_bytes_per_s when the adapter is not in the workers' store yet
    cpu_lora_ms = modules * (invoke_ms + cpu_scale * compute_ms)
    compute_ms  = min over workers_used of workers_used * dispatch_ms + overhead_ms
                  + per_token_rank_ms * rank * ceil(T / workers_used)

`invoke_ms` and `cpu_scale` come from an end-to-end probe at start-up (a prefill's LoRA through the
workers, the exchange and the invocation path in use, synchronised as the forward is): the fixed cost
of one module's invocation, and how far the one-core compute model is off. `correction` is corrected
online from the assisted prefills the engine observes (`observe_assisted`). cpu-assist is chosen only
when predicted faster than gpu-wait by `margin` (a fraction): a wrong cpu-assist stalls the whole step,
every request in it, so near-ties go to the GPU.

`overlapped`: the fused CUDA path lets the device run ahead of the host, so the workers' LoRA overlaps
the base model's kernels (CaraServe's sync-free invocation); the python path and the CPU engine run
the two one after the other.

`streaming`: the engine can stream (cuda, layer-wise copies on, the Triton kernels, CUDA graphs or not).
The LoRA kernels' wait needs a prefill kernel (MBGMM): a first step of one token runs the decode kernels,
so it never streams.

`layerwise` (the engine's layer-wise takeover): the adapter streams in layer by layer in forward order,
layer l complete at (l + 1) / L * load_ms, and a layer whose pages have arrived when the forward gets
there runs on the GPU. cpu-assist is then the forward walked layer by layer: a layer costs
prefill_ms / L on the GPU, or prefill_ms / L (+) cpu_lora_ms / L on the CPU. The CPU serves the first
layers, the GPU the rest, and the assist costs at most the load's time, never the whole prefill's LoRA.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

GPU_WAIT, GPU_STREAM, CPU_ASSIST = "gpu-wait", "gpu-stream", "cpu-assist"
DECISIONS = (GPU_WAIT, GPU_STREAM, CPU_ASSIST)


@dataclass(frozen=True)
class ColdStartCosts:
    load_bytes_per_s: dict[str, float]  # tier -> host -> pool copy bandwidth
    cpu_per_token_rank_ms: float  # one core, one module: ms per token per unit of rank
    cpu_overhead_ms: float  # one core, per job (wake-up, lookup, BLAS set-up)
    dispatch_ms: float  # the engine's side of one job (post and wait), serial
    workers: int
    prefill_ms_per_token: float  # the base model's prefill on the engine's device
    overlapped: bool = False
    layerwise: bool = False  # the GPU takes over each layer as its pages arrive
    num_layers: int = 1
    invoke_ms: float = 0.0  # per module invocation on the assisted path, end to end (probe)
    cpu_scale: float = 1.0  # measured / modelled compute on the assisted path (probe)
    correction: float = 1.0  # observed / predicted extra time of assisted prefills (online)
    stage_bytes_per_s: float = 0.0  # copying an adapter into the workers' store (0: free)
    margin: float = 0.1  # cpu-assist must be predicted this fraction faster
    streaming: bool = False  # gpu-stream is available (see the module's note)
    # gpu-stream must be predicted to save this much over gpu-wait. Measured on the H100 (BENCHMARKS.md, cold starts):
    # streaming pinned rank-32 q,k,v,o 7B adapters (1.4 ms copies) gained nothing measurable (auto / ondemand
    # 0.98-1.03 over four workloads), pageable ones (~6.5 ms) 4-7 ms of mean TTFT.
    stream_margin_ms: float = 2.0
    observed_assists: int = 0  # assisted prefills folded into `correction`

    def load_ms(self, adapter_bytes: int, tier: str) -> float:
        bandwidth = self.load_bytes_per_s.get(tier)
        if not bandwidth:
            raise KeyError(f"no measured bandwidth for tier {tier!r} (known: {', '.join(self.load_bytes_per_s)})")
        return adapter_bytes / bandwidth * 1e3

    def cpu_lora_ms(self, prompt_tokens: int, rank: int, modules: int) -> float:
        """The prefill's LoRA on the workers: the best worker count for one module, times the modules
        (projections run one after the other: each waits for its layer's input)."""
        best = math.inf
        for used in range(1, max(1, min(self.workers, prompt_tokens)) + 1):
            per_job = self.cpu_overhead_ms + self.cpu_per_token_rank_ms * rank * math.ceil(prompt_tokens / used)
            best = min(best, used * self.dispatch_ms + per_job)
        return modules * (self.invoke_ms + self.cpu_scale * best)

    def stage_ms(self, adapter_bytes: int) -> float:
        return adapter_bytes / self.stage_bytes_per_s * 1e3 if self.stage_bytes_per_s else 0.0


@dataclass(frozen=True)
class ColdStart:
    """What is known of the request at admission."""

    prompt_tokens: int  # tokens of its first step
    adapter_bytes: int
    rank: int  # the adapter's largest rank
    modules: int  # (layer, projection) pairs it targets
    tier: str  # where its weights lie now: a key of ColdStartCosts.load_bytes_per_s
    staged: bool = True  # already in the CPU workers' store (else cpu-assist copies it there first)
    copy_bytes: int | None = None  # what the copy into the pool moves (pages in the pool's dtype); None: adapter_bytes


@dataclass(frozen=True)
class Decision:
    choice: str  # GPU_WAIT, GPU_STREAM or CPU_ASSIST
    gpu_wait_ms: float
    cpu_assist_ms: float
    gpu_stream_ms: float = math.inf  # inf where streaming is not available
    cpu_layers: int = 0  # layers the CPU serves in the cpu-assist prediction (all of them without layerwise)
    prefill_ms: float = 0.0  # the base prefill both predictions include
    correction: float = 1.0  # the costs' correction the prediction used

    @property
    def cpu_extra_ms(self) -> float:
        """What cpu-assist is predicted to add to the base prefill."""
        return self.cpu_assist_ms - self.prefill_ms


def hybrid_ms(prefill_ms: float, cpu_lora_ms: float, load_ms: float, num_layers: int, overlapped: bool) -> tuple[float, int]:
    """The layer-wise cpu-assisted forward: (its time, the layers the CPU serves). Layer l runs on the
    GPU when the copy has delivered it by the time the forward reaches it, else with the CPU's LoRA."""
    per_layer, per_layer_cpu = prefill_ms / num_layers, cpu_lora_ms / num_layers
    on_cpu = max(per_layer, per_layer_cpu) if overlapped else per_layer + per_layer_cpu
    now, cpu_layers = 0.0, 0
    for layer in range(num_layers):
        if now >= load_ms * (layer + 1) / num_layers:
            now += per_layer
        else:
            now += on_cpu
            cpu_layers += 1
    return now, cpu_layers


def stream_ms(prefill_ms: float, load_ms: float, num_layers: int) -> float:
    """The streamed forward: layer l runs once the layer before it is done and its pages are in."""
    per_layer, now = prefill_ms / num_layers, 0.0
    for layer in range(num_layers):
        now = max(now, load_ms * (layer + 1) / num_layers) + per_layer
    return now


def decide(request: ColdStart, costs: ColdStartCosts) -> Decision:
    """The fastest of the predicted first steps: gpu-stream only by `costs.stream_margin_ms` over gpu-wait,
    cpu-assist only by `costs.margin` over the better GPU one; ties and no workers to the GPU."""
    prefill_ms = costs.prefill_ms_per_token * request.prompt_tokens
    load_ms = costs.load_ms(request.adapter_bytes if request.copy_bytes is None else request.copy_bytes, request.tier)
    gpu_wait_ms = load_ms + prefill_ms
    gpu_stream_ms = math.inf
    if costs.streaming and request.prompt_tokens >= 2:
        gpu_stream_ms = stream_ms(prefill_ms, load_ms, max(costs.num_layers, 1))
    gpu_choice = GPU_STREAM if gpu_stream_ms + costs.stream_margin_ms <= gpu_wait_ms else GPU_WAIT
    if costs.workers < 1 or request.prompt_tokens < 1:
        return Decision(gpu_choice, gpu_wait_ms, math.inf, gpu_stream_ms, prefill_ms=prefill_ms, correction=costs.correction)
    cpu_ms = costs.correction * costs.cpu_lora_ms(request.prompt_tokens, request.rank, request.modules)
    # Staging runs before the forward, while the copy to the pool already streams: it delays the CPU's
    # layers, never the GPU's.
    stage_ms = 0.0 if request.staged else costs.correction * costs.stage_ms(request.adapter_bytes)
    if costs.layerwise and costs.num_layers > 1:
        forward_ms, cpu_layers = hybrid_ms(prefill_ms, cpu_ms, max(load_ms - stage_ms, 0.0), costs.num_layers,
                                           costs.overlapped)
    else:
        forward_ms = max(prefill_ms, cpu_ms) if costs.overlapped else prefill_ms + cpu_ms
        cpu_layers = costs.num_layers
    cpu_assist_ms = stage_ms + forward_ms
    choice = CPU_ASSIST if cpu_assist_ms * (1.0 + costs.margin) < min(gpu_wait_ms, gpu_stream_ms) else gpu_choice
    return Decision(choice, gpu_wait_ms, cpu_assist_ms, gpu_stream_ms, cpu_layers, prefill_ms, costs.correction)


def observe_assisted(costs: ColdStartCosts, decisions: list[Decision], observed_extra_ms: float,
                     weight: float = 0.3, bounds: tuple[float, float] = (0.2, 50.0)) -> ColdStartCosts:
    """Fold one assisted step into `costs.correction`: `observed_extra_ms` is what the step took beyond
    its base prefill, `decisions` the cpu-assist predictions of its assisted requests (made with their
    own correction). The ratio observed / uncorrected prediction enters an exponential moving average
    (the first observation replaces the start-up value), clamped to `bounds`."""
    raw = sum(decision.cpu_extra_ms / decision.correction for decision in decisions if decision.correction > 0)
    if raw <= 0 or not math.isfinite(raw):
        return costs
    sample = min(max(max(observed_extra_ms, 0.0) / raw, bounds[0]), bounds[1])
    correction = sample if costs.observed_assists == 0 else (1 - weight) * costs.correction + weight * sample
    return dataclasses.replace(costs, correction=correction, observed_assists=costs.observed_assists + 1)
