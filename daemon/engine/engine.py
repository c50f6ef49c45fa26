"""The engine: the model, its page pool, the adapters and the step loop.

`submit` may be called from any thread; the step loop (a background thread after `start`, or the
caller's thread in `generate`) takes new requests and aborts at the start of each step, asks the
scheduler for the step's batch, runs one forward for all of it, samples, and reports each request's
new tokens through its `on_output` callback. On cuda, decode steps overlap (see "overlapped
decode" below): a step launches the next one from its tokens on the device before reading them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.daemon.model.adapters import AdapterRegistry, LoraAdapter, module_members, weights_nbytes
from lorad.daemon.model.checkpoint import (FUSED_MODULES, MODEL_CONFIGS, PROJECTIONS, ModelSpec, dummy_weights,
                                          load_spec, longrope_switch, within_sliding_window)
from lorad.daemon.model import quantization
from lorad.daemon.engine.cold_start import ColdStarts, resolve_cold_start, streaming_availability
from lorad.daemon.engine.runner import ModelRunner
from lorad.daemon.engine.kernel_window import KernelWindow
from lorad.daemon.engine.step_account import ENDED_IN_FLIGHT, STEP_LOG_ENV, HostSplit, StepAccount, StepLog
from lorad.daemon.engine.step_watch import StepWatch
from lorad.daemon.engine.step_cost import StepCostModel, measure_device_rates
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.engine.tp_worker import TensorParallel
from lorad.daemon.model.tensor_parallel import check_size
from lorad.daemon.engine import start_profile
from lorad.daemon.engine.adapter_residency import LoraResidency
from lorad.daemon.engine import status
from lorad.daemon.engine.stats import Metrics
from lorad.daemon.engine.request import (MAX_STOP_TOKEN_IDS, GenerationRequest, GenerationResult, RequestOutput,
                                         check_prompt, deliver)
from lorad.daemon.engine.sampler import Draws, History, LogprobCopies, PendingLogprobs, choose, logprobs_of, make_generator, sample, to_device
from lorad.daemon.engine.sampler_state import ProcessedRows, SamplerState
from lorad.daemon.engine.tokenizer import Detokenizer, load_tokenizer
from lorad.errors import AdmissionDropped, BadRequest, LoradError, ModelError, ModelNotFound, Overloaded, clip
from lorad.gpu_ops.page_pool import AdapterTable, BlockList, KVCache, PagePool
from lorad.scheduler.admission import AdmissionPolicy, Objectives, OnlinePrefill, make_admission
from lorad.scheduler.batching import (
    NO_REQUEST_WAITING, RUNNING_PER_KV_TOKENS, RUNNING_RANGE, GrowthReserve, Scheduler, Sequence, default_max_running,
)

log = logging.getLogger(__name__)

PROFILE_ENV = "LORAD_PROFILE_ENGINE"  # a file: the engine thread's cProfile stats, written when it stops

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_DEFAULT_MODEL_LEN = 8192
CPU_POOL_BYTES = 256 << 20
ADAPTER_SLOTS = 1024
PREFETCH_DEPTH = 8  # queued requests whose adapters are loaded ahead, while a step runs
NEXT_USE_DEPTH = 512  # queued requests looked at when an idle adapter is evicted (the furthest needed goes first)
PREPARE_DEPTH = 16  # queued requests whose adapters are read and staged ahead on the stager's thread (cuda)
SAMPLING_FAILED = "sampling failed for this request (its distribution was not valid)"
CLUSTER_MAX_WAIT_MS = 1000.0  # admission cluster without a TTFT objective: how long another adapter's request waits at most
# Why a step's tokens were read before its successor was launched (the device idle while the host hands them back and
# plans the next): the step itself (Engine._read_at_once), or its successor could not be planned ahead of them (a KV
# cache that cannot grow by the token in flight without a preemption, a row crossing longrope's switch, a running
# request outside the step in flight)
NEXT_NOT_PLANNED_AHEAD = "next_not_planned_ahead"
READ_AT_ONCE = ("adapters_streaming", "cpu_assist", "not_every_running_request", "prompt_chunks_alone", "keeps_logits",
                "forks", NEXT_NOT_PLANNED_AHEAD)


@dataclass(eq=False)
class StepInFlight:
    """A step launched whose tokens the host has not read yet (overlapped decode): a decode step, or one whose
    prompt rows all end their prompts in it."""

    seqs: list[Sequence]  # its rows, in order
    tokens: torch.Tensor  # [n] int64 on the device: each row's token (argmax or drawn), the next step's input ids
    host: torch.Tensor  # [n] int64, pinned on cuda: where the tokens are copied to (-1: a failed draw)
    done: torch.cuda.Event | None  # recorded after that copy; None on the cpu (the copy is done)
    logprobs: PendingLogprobs | None = None  # the rows' logprobs, copied to the host before `done`
    prefill: tuple[int, float] | None = None  # a step with prompt rows to time for the prefill model: (its tokens, launched at)


@dataclass(eq=False)
class HeldAdapter:
    """An adapter that requests in the engine use: kept (not re-read from the registry) until the last ends."""

    adapter: LoraAdapter
    requests: int = 0


@dataclass(eq=False)
class ChoiceGroup:
    """The n choices of one request (GenerationRequest.n > 1): the first prefills the prompt; when its prompt is
    done the others are forked from it (`Engine._fork`), sharing the prompt's KV blocks, each with its own
    sampler state, and each finishing on its own."""

    sequences: list[Sequence]  # choice i at index i
    unforked: list[Sequence]  # the choices waiting for the first one's prefill (not in the scheduler), unfinished

    @property
    def finished(self) -> bool:
        return all(seq.state.finished for seq in self.sequences)


@dataclass(eq=False)
class RequestState:
    request: GenerationRequest
    detokenizer: Detokenizer
    generator: Draws | None
    choice: int = 0  # which of the request's choices this sequence is
    group: ChoiceGroup | None = None  # the request's choices, when it has more than one
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    logits: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token, when asked for
    finished: bool = False
    finish_reason: str | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        try:
            self._build(config)
        except BaseException:
            if getattr(self, "tp", None) is not None:  # the workers started, and this process joined their group
                self.tp.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        if config.state_dir and Path(config.state_dir).exists() and not Path(config.state_dir).is_dir():
            raise BadRequest(f"state_dir {config.state_dir} is not a directory")  # before anything is built
        model_dir, demo_adapters = self._model_dir(config)
        self.device = resolve_device(config.device)
        if model_dir is None:  # a known shape with random weights (benchmarks)
            self.spec = ModelSpec.from_hf_config(MODEL_CONFIGS[config.model_config])
            self.model_name = config.model_config
        else:
            self.spec = load_spec(model_dir)
            self.model_name = "lorad-demo" if config.demo else model_dir.name
        self.dtype = resolve_dtype(config.dtype, self.spec.torch_dtype, self.device)
        # cold_start not set: auto or ondemand for this device, settled before anything reads the config
        mode, self.cold_start_reason = resolve_cold_start(config, self.device, self.spec)
        config = self.config = replace(config, cold_start=mode)
        log.info("cold_start=%s why=%r", mode, self.cold_start_reason)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = self.spec.vocab_size
        longest = self.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > longest:
            raise ModelError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                             f"{longest}: serve at most {longest} tokens")
        self.max_model_len = config.max_model_len or min(self.spec.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
        self.max_model_len = within_sliding_window(self.spec, self.max_model_len, config.max_model_len)
        self.rope_switch = longrope_switch(self.spec, self.max_model_len)  # None, or where a cache is recomputed
        if self.rope_switch is not None:
            log.info("longrope switch=%d: a sequence past it runs on the long factors, its cache computed again once",
                     self.rope_switch)

        started = time.perf_counter()
        # The decode LoRA kernel per step, from `lorad profile`'s models when a profile of this engine's
        # tensor-parallel size is found (checked before any rank starts), or measured now, before the weights take
        # the memory (profile_at_start: start_profile.py).
        self.kernel_choice, self.kernel_profile = start_profile.kernel_choice(config, self.spec, self.model_name,
                                                                              self.device, self.dtype)
        # Tensor parallelism: this process is rank 0 of tensor_parallel_size, with its shard of the model (its heads
        # and MLP columns: `local`); the workers it starts hold theirs (daemon/engine/tp_worker.py).
        self.tp = None
        self.kv_dtype = quantization.kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        if config.tensor_parallel_size > 1:
            check_size(self.spec, config.tensor_parallel_size)
            quantization.refuse_under_tensor_parallel(model_dir, config)
            self.tp = TensorParallel.start(config, self.spec, self.device, self.model_name, model_dir, self.max_model_len)
        local = self.spec if self.tp is None else self.tp.shard.local
        if self.tp is not None:
            weights = (dummy_weights(local, self.dtype, self.device, seed=config.seed) if model_dir is None
                       else self.tp.shard.read_weights(model_dir, self.dtype, self.device))
            self.quantization, kv_scales = quantization.Quantization(), None
        else:
            # The projections in FP8 where asked or where the checkpoint is (daemon/model/quantization.py).
            base = quantization.load_base_weights(model_dir, self.spec, config.quantization, self.dtype, self.device, config.seed)
            weights, self.quantization, kv_scales = base.weights, base.quantization, base.kv_scales
            del base
        log.info("decode lora kernel choice=%s profile=%s", self.kernel_choice.describe(), self.kernel_profile)
        self.runner = ModelRunner(config, local, self.device, weights, self.max_model_len, self.kernel_choice)
        del weights
        if self.tp is not None:
            self.tp.attach(self.runner)
        self.kv_cache = quantization.kv_cache_status(self.kv_dtype, kv_scales)
        if self.kv_dtype != self.dtype:
            self.runner.ops.kv_scales = (kv_scales if kv_scales is not None
                                         else torch.ones(self.spec.num_layers, 2, dtype=torch.float32, device=self.device))
        log.info("quantization=%s gemm=%r kv_cache_dtype=%s kv_scales=%r", self.quantization.describe(),
                 self.runner.ops.fp8_gemm if self.quantization.method == "fp8" else "-", self.kv_cache["dtype"],
                 self.kv_cache["scales"])
        # What this device sustains (HBM bandwidth, GEMM rate), measured before the pool takes the memory
        # left: each step's floor in the engine's account of its own time (step_account.py).
        rates = measure_device_rates(self.device, self.dtype)  # its buffers given back by pool_pages' empty_cache
        log.info("device rates hbm_gb_s=%.1f gemm_tflop_s=%.2f (each step's floor: the slower of bytes and FLOPs)",
                 rates.bandwidth_bytes_per_s / 1e9, rates.flops_per_s / 1e12)
        pages = pool_pages(config, self.spec, self.dtype, self.device)
        if self.tp is not None:
            pages = self.tp.agree_pages(pages)
        try:
            self.pool = PagePool(pages, self.spec.page_elems, self.dtype, self.device)
        except (torch.OutOfMemoryError, RuntimeError) as error:  # --pool-bytes beyond the memory there is
            if "alloc" not in str(error).lower() and not isinstance(error, torch.OutOfMemoryError):
                raise
            gib = pages * self.spec.page_elems * self.dtype.itemsize / 2**30
            raise ModelError(f"the page pool of {pages:,} pages ({gib:,.1f} GiB) cannot be allocated on {self.device}: "
                             "lower pool_bytes (--pool-bytes)") from None
        self.kv = KVCache(self.pool, self.spec.num_layers, local.num_kv_heads, local.head_dim, self.kv_dtype,
                          self.spec.layer_windows)
        config = self.config = self.runner.config = self._running_cap(config)
        if self.tp is not None:
            self.tp.send_pool(pages, self.spec.page_elems, config.max_running_requests)
        if self.kv.blocks_for(self.max_model_len) * self.kv.pages_per_block > self.pool.capacity:
            raise ModelError(
                f"the page pool ({self.pool.capacity} pages) cannot hold one sequence of max_model_len="
                f"{self.max_model_len}: give more pool memory or a smaller max_model_len"
            )
        shapes = [local.projection_shape(p) for p in PROJECTIONS]
        self.table = AdapterTable(self.pool, ADAPTER_SLOTS, self.spec.num_layers, shapes)
        # cold_start auto may stream a cold adapter into the pool while its prefill runs (gpu-stream): the LoRA
        # kernels, compiled and captured below, then wait on the device for each streamed layer.
        streaming = streaming_availability(config, self.device, self.runner.ops.name)
        if streaming["on"]:
            self.table.enable_streaming()

        self.registry = AdapterRegistry(self.spec, config.max_lora_rank, config.host_adapter_bytes, reserved_names=(self.model_name,))
        for name, path in (*demo_adapters, *config.adapters):
            self.registry.register(name, path)
        for root in config.adapter_dirs:
            self.registry.register_dir(root)
        for adapter in _dummy_adapters(self.spec, config):
            self.registry.add_in_memory(adapter)
        self._adapter_roots = [Path(root).resolve() for root in config.adapter_roots]
        if demo_adapters:
            self._adapter_roots.append(Path(demo_adapters[0][1]).resolve().parent)
        self._state_file = Path(config.state_dir) / "adapters.json" if config.state_dir else None
        self._api_registrations = self._restore_registrations()
        # Adapters of requests in flight, held by name until their last request ends: an adapter
        # unloaded meanwhile still serves what was admitted before.
        self._held: dict[str, HeldAdapter] = {}
        self._draining: set[str] = set()
        self.stats = Metrics()  # counters for GET /metrics; Engine.metrics() snapshots them
        dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.account = StepAccount(StepCostModel(
            local, dtype_bytes, self._adapter_ranks, weight_bytes=1 if self.quantization.method == "fp8" else dtype_bytes,
            kv_bytes=self.kv.view.element_size()), rates, device_clock=self.device.type == "cuda")
        try:  # a diagnostic: the kernels of a window of served steps (kernel_window.py)
            self.kernel_window = KernelWindow.from_env() if self.device.type == "cuda" else None
        except ValueError as error:
            raise BadRequest(str(error)) from None
        try:  # a diagnostic: every step's line (step_account.py)
            self.account.step_log = StepLog.from_env()
        except OSError as error:
            raise BadRequest(f"{STEP_LOG_ENV}: cannot write the step log: {error}") from None
        if self.account.step_log is not None:
            log.info("step log: %s", self.account.step_log.path)
        self.kernel_choice.on_choice = self.stats.lora_kernel_chosen
        self.overlapped_steps = 0
        self.planned_ahead_steps = 0  # steps planned and launched before the tokens of the step in flight were read
        self.read_at_once = Counter()  # steps whose tokens were read before the next was launched, by cause (READ_AT_ONCE)
        self.forked_choices = 0  # choices that began from another's prefill (n > 1), its prompt's blocks shared
        # Overlapped decode (step(), _launch_next_decode): only where the device runs behind the host. On the cpu a
        # launch is the computation itself, so reading a step's tokens one step late would only delay them.
        self.overlap_decode = config.overlap_decode and self.device.type == "cuda"
        self._in_flight: StepInFlight | None = None
        self._token_buffers = [torch.zeros(config.max_running_requests, dtype=torch.long, pin_memory=self.device.type == "cuda")
                               for _ in range(2)]  # a step in flight and the one launched after it
        self._token_turn = 0
        # Penalties, logit bias and min_tokens from each sequence's state on the device (sampler_state.py), and an
        # overlapped step's logprobs copied to the host beside its tokens.
        self.sampler_state = SamplerState(self.vocab_size, self.device, len(self.spec.eos_token_ids) + MAX_STOP_TOKEN_IDS)
        self._logprob_copies = LogprobCopies(config.max_running_requests, pin=self.device.type == "cuda")
        lookup = self._host_adapter if self.tp is None else self.tp.shard_lookup(self._host_adapter)
        self.residency = LoraResidency(lookup, self.table, self.stats, pinned_bytes=config.pinned_host_bytes,
                                       staged_bytes=config.host_adapter_bytes, stager_threads=config.stager_threads or None)
        self.cold_starts = ColdStarts(config, self.spec, self.device, self.dtype, self.table, self.residency, self.stats,
                                      streaming, held=lambda name: self._held[name].adapter,
                                      fail=lambda seq, reason: self._finish(seq, "error", error=reason))
        self.runner.bind(self.kv, self.table, self.residency, self.cold_starts, held=lambda name: self._held[name].adapter)
        if self.tp is not None:
            self.tp.wait_ready()
        self.online_prefill: OnlinePrefill | None = None  # early abort's estimate when no profile was found
        admission, objectives = self._admission()
        self.scheduler = Scheduler(config.max_running_requests, config.max_batch_tokens, self, self.residency,
                                   admission, objectives, decode=self.tpot_decode,
                                   reserve=GrowthReserve() if config.kv_growth_reserve else None,
                                   headroom=config.kv_admission_headroom)
        self.residency.defer_unstaged = self._defer_unstaged
        self.residency.next_use = self._queued_adapters
        self.admission_dropped = 0

        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._drops: list[str] = []
        self._sequences: dict[str, Sequence] = {}
        self._finished: dict[str, Sequence] = {}  # read back by generate(); unused when started
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.step_watch = StepWatch()  # how long the step now running has run; a warning when one stalls
        self._step_ended: float | None = None  # where the step loop's last step() returned (None: it idled since)
        self._residency_seen: dict[str, float] = {}  # LoraResidency.host_s at the last step's launch (the step log's)
        self.steps = 0
        if config.cold_start == "cached":
            self._place_every_adapter()
        elif config.cold_start in ("cpu", "auto"):
            self.cold_starts.start_cpu_assist()
        log.info(
            "engine ready model=%s arch=%s device=%s dtype=%s quantization=%s kv_cache_dtype=%s ops=%s cuda_graphs=%s "
            "overlap_decode=%s plan_ahead=%s pool_pages=%d page_elems=%d kv_tokens=%d adapters=%d load_s=%.2f",
            self.model_name, self.spec.architecture, self.device, str(self.dtype).removeprefix("torch."),
            self.quantization.method, self.kv_cache["dtype"],
            self.runner.ops.name, "off" if self.runner.graphs is None else "on", "on" if self.overlap_decode else "off",
            "on" if self.plan_ahead["on"] else f"off ({self.plan_ahead['why']})", self.pool.capacity, self.pool.page_elems, self.kv.free_tokens(),
            len(self.registry.names()), time.perf_counter() - started,
        )

    # ---- set-up -------------------------------------------------------------------------------
    @staticmethod
    def _model_dir(config: EngineConfig) -> tuple[Path, list[tuple[str, str]]]:
        if config.demo:
            from lorad.daemon.model.demo import build_demo, default_demo_root

            assets = build_demo(default_demo_root())
            return assets.model_dir, [(name, str(path)) for name, path in assets.adapters.items()]
        if config.model_config is not None:
            if config.model is not None or not config.dummy_weights:
                raise BadRequest("--model-config goes with --dummy-weights and without --model")
            if config.model_config not in MODEL_CONFIGS:
                raise BadRequest(f"unknown model config {config.model_config!r}: one of {', '.join(MODEL_CONFIGS)}")
            return None, []
        if config.model is None:
            raise BadRequest("no model: give --model DIR, --demo, or --model-config NAME --dummy-weights")
        return Path(config.model), []

    def _admission(self) -> tuple[AdmissionPolicy, Objectives]:
        """The admission policy and objectives of EngineConfig. Early abort predicts prefills with the
        loaded profile's PrefillModel, or else with an estimate this engine measures as it runs."""
        config = self.config
        objectives = Objectives(config.slo_ttft_ms / 1e3 or float("inf"), config.slo_tpot_ms / 1e3 or float("inf"))
        prefill = None
        if config.admission == "early-abort":
            profile = self.kernel_choice.profile
            prefill = profile.prefill if profile is not None else OnlinePrefill()
            self.online_prefill = None if profile is not None else prefill
        max_wait_ms = config.slo_ttft_ms or CLUSTER_MAX_WAIT_MS
        policy = make_admission(config.admission, prefill, config.cluster_max_adapters or None,
                                max_wait_s=max_wait_ms / 1e3 if config.cluster_max_adapters else None)
        self.admission_max_wait_ms = max_wait_ms if config.cluster_max_adapters else None
        # The time-per-token rule: no admission into a running batch whose predicted decode step breaks slo_tpot_ms.
        self.tpot_decode = self.kernel_choice.decode_model if config.slo_tpot_ms else None
        self.tpot_rule = (f"profile:{self.kernel_choice.source}" if self.tpot_decode is not None
                          else "off (no slo_tpot_ms)" if not config.slo_tpot_ms else "off (no profile)")
        log.info("admission policy=%s slo_ttft_ms=%s slo_tpot_ms=%s cluster_max_adapters=%d cluster_max_wait_ms=%s "
                 "ttft_estimate=%r tpot_rule=%r", policy.name, config.slo_ttft_ms or "none", config.slo_tpot_ms or "none",
                 config.cluster_max_adapters, self.admission_max_wait_ms or "-", status.admission_estimate_source(self), self.tpot_rule)
        return policy, objectives

    def _host_adapter(self, name: str) -> LoraAdapter:
        held = self._held.get(name)
        return held.adapter if held is not None else self.registry.get(name)

    def _adapter_ranks(self, name: str) -> dict[tuple[int, int], int]:
        """The rank of each (layer, projection) an adapter targets: what a step with it reads (step_cost.py)."""
        return {key: a.shape[0] for key, (a, _) in self._host_adapter(name).weights.items()}

    def _place_every_adapter(self) -> None:
        """cold_start="cached": every registered adapter in the pool before the first request."""
        names = self.registry.names()
        for placed, name in enumerate(names):
            if not self.residency.preload(name):
                raise ModelError(
                    f"cold_start=cached: the page pool ({self.pool.capacity} pages) holds only {placed} of the "
                    f"{len(names)} registered adapters; give more pool memory (pool_bytes) or use cold_start=ondemand"
                )
        needed = self.kv.blocks_for(self.max_model_len) * self.kv.pages_per_block
        if self.pool.num_free < needed:
            raise ModelError(
                f"cold_start=cached: with every adapter placed, {self.pool.num_free} pool pages are left, fewer than "
                f"one sequence of max_model_len={self.max_model_len} needs ({needed}); give more pool memory"
            )
        log.info("cold_start=cached adapters_placed=%d pool_free_pages=%d", len(names), self.pool.num_free)

    def models(self) -> list[dict]:
        """The base model and every registered adapter (GET /v1/models)."""
        base = {"id": self.model_name, "parent": None, "kind": "base"}
        return [base] + [self.adapter_entry(name) for name in self.registry.names()]

    def adapter_entry(self, name: str) -> dict:
        """A registered adapter's /v1/models fields: where it is now (disk, host, or the pool: "gpu" on cuda), and
        its rank, targets and size once read."""
        info = self.registry.describe(name)
        if name in self.residency.slots:
            info["location"] = "gpu" if self.device.type == "cuda" else "pool"
        return {"id": name, "parent": self.model_name, "kind": "lora", **info}

    def adapter_path(self, name: str) -> str | None:
        """The directory of a registered adapter (for its own chat template); None for an unknown name."""
        path = self.registry.path(name)
        return None if path is None else str(path)

    def status(self) -> dict:
        """GET /v1/status: what runs and how (daemon/engine/status.py)."""
        return status.engine_status(self)

    def metrics(self) -> dict:
        """A picklable snapshot of the counters and gauges for GET /metrics (daemon/engine/status.py)."""
        return status.metrics_snapshot(self)

    def reads_adapter(self, request: GenerationRequest) -> bool:
        """Whether `submit(request)` reads its adapter from disk first (a request already holding it does not). Any
        thread; a stale answer only changes which of the engine process's submit threads take the request."""
        name = request.adapter
        return name is not None and name not in self._held and self.registry.on_disk(name)

    def submit(self, request: GenerationRequest) -> None:
        """Checks the request and queues it (with its n choices: ChoiceGroup); raises BadRequest, NotFound,
        AdapterError, Overloaded."""
        prompt = request.prompt_token_ids
        check_prompt(prompt, request.sampling, self.vocab_size, self.max_model_len)
        if request.adapter is not None:
            if request.adapter not in self.registry:
                raise ModelNotFound.named(request.adapter)
            adapter = self._read_adapter(request.adapter)  # read now, in the caller's thread: errors go to the caller
        n = request.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadRequest("n must be a positive integer")
        rank = adapter.rank if request.adapter is not None else 0
        choices = [self._choice_sequence(request, choice, rank) for choice in range(n)]
        seq = choices[0]  # the one that prefills the prompt and stands for the request
        if n > 1:
            group = ChoiceGroup(choices, choices[1:])
            for choice in choices:
                choice.state.group = group
        with self._lock:
            if self._stopping:
                raise Overloaded("the engine is shutting down")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.config.max_waiting_requests:
                raise Overloaded(f"{self.config.max_waiting_requests} requests are already waiting")
            if request.request_id in self._sequences:
                raise BadRequest(f"request id {request.request_id} is already in use")
            self._sequences[request.request_id] = seq
            if request.adapter is not None:
                self._held.setdefault(request.adapter, HeldAdapter(adapter)).requests += n  # one per choice
            self._inbox.append(seq)
            self._lock.notify()

    def _choice_sequence(self, request: GenerationRequest, choice: int, rank: int) -> Sequence:
        state = RequestState(request, Detokenizer(self.tokenizer, request.sampling.stop),
                             make_generator(request.sampling, choice), choice=choice)
        prompt = request.prompt_token_ids
        return Sequence(request.request_id, list(prompt), len(prompt), request.adapter, blocks=BlockList(), state=state,
                        rank=rank, arrival_s=self.scheduler.clock(),
                        max_new_tokens=max(0, min(request.sampling.max_tokens, self.max_model_len - len(prompt))))

    def abort(self, request_id: str) -> None:
        """Ends every choice of the request that is still going (finish_reason "abort")."""
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def load_adapter(self, name: str, path: str) -> dict:
        """Registers an adapter through the API: the path must lie under an adapter root; the adapter is
        read and checked now, and nothing already registered changes if it is refused."""
        resolved, root = self._under_root(path)
        with self._lock:
            if name in self._draining:
                raise BadRequest(f"adapter {name!r} is still finishing its requests after an unload; try again")
            if name == self.model_name:
                raise BadRequest(f"{name!r} is the base model's name")
        self.registry.register(name, str(resolved), root=root)
        try:
            adapter = self._read_adapter(name)
        except LoradError:
            self.registry.unregister(name)
            raise
        self._api_registrations[name] = str(resolved)
        try:
            self._save_registrations()
        except OSError as error:  # served now but not remembered across a restart: refused, as if never loaded
            del self._api_registrations[name]
            self.registry.unregister(name)
            raise LoradError(f"adapter {name!r} was not loaded: it cannot be remembered in {self._state_file}: "
                             f"{error.strerror or error}") from None
        return self.adapter_entry(adapter.name)

    def _running_cap(self, config: EngineConfig) -> EngineConfig:
        """The config with its running cap: as given, or from the KV cache's capacity (default_max_running)."""
        capacity = self.kv.capacity_tokens()
        if config.max_running_requests is not None:
            self.max_running_from = "config"
            log.info("max_running_requests=%d (given; the KV cache holds %d positions)", config.max_running_requests, capacity)
            return config
        running = default_max_running(capacity)
        self.max_running_from = "kv_capacity"
        low, high = RUNNING_RANGE
        log.info("max_running_requests=%d (from the KV cache's %d positions: one per %d, %d to %d; "
                 "--max-running-requests sets it)", running, capacity, RUNNING_PER_KV_TOKENS, low, high)
        return replace(config, max_running_requests=running)

    def _under_root(self, path: str) -> tuple[Path, Path]:
        """The adapter folder resolved (symlinks followed: a link out of the roots is outside) and the adapter
        root it lies under; BadRequest when it lies under none."""
        resolved = Path(path).resolve()
        root = next((root for root in self._adapter_roots if resolved.is_relative_to(root)), None)
        if root is None:
            if not self._adapter_roots:
                raise BadRequest("no adapter roots are configured (adapter_roots): loading through the API is off")
            roots = ", ".join(str(root) for root in self._adapter_roots)
            raise BadRequest(f"{clip(path)} is not under an adapter root ({roots})")
        return resolved, root

    def unload_adapter(self, name: str) -> None:
        """New requests for it are refused at once; requests already submitted finish first, then its
        pool pages go back."""
        if name not in self.registry:
            raise ModelNotFound(f"no adapter {name!r} is registered")
        self.registry.unregister(name)
        with self._lock:
            if name in self._held:
                self._draining.add(name)
            else:
                self._drops.append(name)  # the pool belongs to the engine thread
            self._lock.notify()
        if self._api_registrations.pop(name, None) is not None:
            self._save_registrations()

    def _read_adapter(self, name: str):
        """registry.get, timed as a disk -> host load when the adapter was not in host memory."""
        on_disk = self.registry.describe(name)["location"] == "disk"
        started = time.perf_counter()
        adapter = self.registry.get(name)
        if on_disk:
            self.stats.adapter_loaded("disk_to_host", time.perf_counter() - started)
        return adapter

    def _restore_registrations(self) -> dict[str, str]:
        if self._state_file is None or not self._state_file.exists():
            return {}
        try:
            saved = json.loads(self._state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            log.warning("cannot read %s (%s): API registrations not restored", self._state_file, error)
            return {}
        if not isinstance(saved, dict):
            log.warning("%s does not hold an object of adapter names and paths: API registrations not restored",
                        self._state_file)
            return {}
        restored = {}
        for name, path in saved.items():
            if not isinstance(path, str):
                log.warning("registration not restored name=%s reason=its path is not a string", name)
                continue
            try:
                resolved, root = self._under_root(path)  # the roots may have changed since it was saved
                self.registry.register(name, str(resolved), root=root)
                restored[name] = path
            except LoradError as error:
                log.warning("registration not restored name=%s reason=%s", name, error.message)
        return restored

    def _save_registrations(self) -> None:
        if self._state_file is None:
            return
        self._state_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self._state_file.with_suffix(".tmp")
        partial.write_text(json.dumps(self._api_registrations, indent=1, sort_keys=True))
        partial.replace(self._state_file)  # atomic: a crash leaves the old file or the new one

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Runs the requests together to completion in this thread (the engine must not be started)."""
        if self._thread is not None:
            raise RuntimeError("generate() drives the engine itself; do not call it after start()")
        results: dict[str, GenerationResult] = {}
        for request in requests:
            self.submit(request)
        self._step_ended = None
        while self.scheduler.has_work() or self._inbox:
            self.step()
            self._step_ended = time.perf_counter()
        for request in requests:
            seq = self._finished.pop(request.request_id)
            result = self._result(seq)
            if seq.state.group is not None:
                result.choices = [self._result(choice) for choice in seq.state.group.sequences]
            results[request.request_id] = result
        return [results[r.request_id] for r in requests]

    @staticmethod
    def _result(seq: Sequence) -> GenerationResult:
        state: RequestState = seq.state
        request = state.request
        return GenerationResult(
            request.request_id, seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :],
            state.detokenizer.text, state.finish_reason, state.logits if request.keep_logits else None,
            state.logprobs if request.sampling.logprobs is not None else None,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._profiled_loop if os.environ.get(PROFILE_ENV) else self._loop,
                                        name="lorad-engine", daemon=True)
        self._thread.start()
        self.step_watch.start()

    def _profiled_loop(self) -> None:
        """The step loop under cProfile, its stats written to $LORAD_PROFILE_ENGINE when it stops: where the
        engine thread's host time goes in service (a diagnostic; cProfile slows Python code down ~1.5-2x)."""
        import cProfile

        profile = cProfile.Profile()
        log.warning("the engine thread runs under cProfile (%s=%s): its host work is slower", PROFILE_ENV,
                    os.environ[PROFILE_ENV])
        profile.enable()
        try:
            self._loop()
        finally:
            profile.disable()
            profile.dump_stats(os.environ[PROFILE_ENV])

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self.step_watch.stop()

    def close(self) -> None:
        """Stops the step loop (if started) and the CPU LoRA workers, and unlinks the engine's
        shared-memory segments. Idempotent; the engine serves nothing afterwards."""
        if self._thread is not None:
            self.stop()
        self.cold_starts.close()
        if self.tp is not None:
            self.tp.close()
            self.tp = None
        if self.account.step_log is not None:
            self.account.step_log.close()
            self.account.step_log = None

    # ---- Memory protocol for the scheduler: KV growth may evict idle adapters ---------------------
    def grow(self, blocks: list, num_tokens: int) -> bool:
        if self.kv.grow(blocks, num_tokens):
            return True
        missing = (self.kv.blocks_for(num_tokens) - len(blocks)) * self.kv.pages_per_block
        return self.residency.reclaim(missing) and self.kv.grow(blocks, num_tokens)

    def free_tokens(self) -> int:
        """KV positions the pool's free pages hold (for the scheduler's growth reserve)."""
        return self.kv.free_tokens()

    def missing_tokens(self, blocks: list, num_tokens: int) -> int:
        """KV positions of the blocks `grow(blocks, num_tokens)` would add."""
        return max(0, self.kv.blocks_for(num_tokens) - len(blocks)) * self.kv.tokens_per_page

    def reclaimable_tokens(self) -> int:
        """KV positions the pool's free pages and its idle adapters' pages hold (`grow` evicts idle adapters for
        KV): asked only when the free pages fall short, since it walks the idle adapters."""
        table, slots = self.table, self.residency.slots
        idle = sum(len(table.placements[slots[name]].page_ids) for name in self.residency.idle
                   if slots.get(name) in table.placements)
        return (self.pool.num_free + idle) // self.kv.pages_per_block * self.kv.tokens_per_page

    def release(self, blocks: list) -> None:
        # A step launched and not landed may have a row of this sequence (computed past its end, or aborted), which
        # writes its KV: its pages wait for the device to pass that step before an adapter's copy may take them.
        self.kv.release(blocks, fenced=self.account.in_flight())

    # ---- the step loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self._drops or self.scheduler.has_work()):
                    self.account.idle()
                    self._step_ended = None
                    self._lock.wait()
                if self._stopping:
                    break
            self.step_watch.begin()
            try:
                if self.kernel_window is not None:
                    self.kernel_window.step(self.steps, self.account)
                self.step()
            except Exception:  # a bug must not kill the daemon: fail the step's requests, go on
                log.exception("step failed; failing its requests")
                self._in_flight = None
                self.account.drop_pending()
                for seq in list(self.scheduler.running):
                    self._finish(seq, "error", error="internal error in the engine step")
            finally:
                self.step_watch.end()
                self._step_ended = time.perf_counter()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + inbox:
            self._finish(seq, "abort")

    def step(self) -> None:
        began = time.perf_counter()
        # the step log's split of the host's work before the launch (none without a step log)
        host = HostSplit(began, self._step_ended, on=self.account.step_log is not None)
        self.account.begin(began)
        self._take_inbox()
        host.mark("inbox")
        ahead = None  # the rows of the step in flight that the step planned now takes on from its tokens on the device
        prefetched = 0.0  # the host's time queueing streamed adapters' copies before this step was planned
        landed_first = False  # the step in flight was read before this one could be planned
        if self._in_flight is not None:
            if self._launch_next_decode(host):
                return
            if self.scheduler.waiting and self.cold_starts.streaming["on"]:
                # The host would only wait for the step in flight: queued requests' cold adapters start
                # streaming in meanwhile (their copies hold the host until it is done, at most a layer more).
                asked = time.perf_counter()
                self._prefetch(self._in_flight.done)
                prefetched = time.perf_counter() - asked
                host.mark("prefetch")
            ahead = self._plan_ahead_rows() if self.plan_ahead["on"] else None
            host.mark("rows")
            if ahead is None:
                landed_first = True  # counted below where a step follows
                self._finish_step_in_flight()
                host.mark("landing")
        scheduling = time.perf_counter()
        try:
            if ahead is None:
                batch = self.scheduler.schedule()
            else:
                ending = self._ending(ahead)
                batch = self.scheduler.schedule(ahead=ahead.keys(), ending=ending)
        except LoradError as error:  # an adapter that broke between submit and admission
            self._finish(self.scheduler.blocked, "error", error=error.message)
            return
        host.mark("admit")
        self._drop_by_admission()
        self._release_preempted()
        assisted = self.cold_starts.admit(batch)
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                self._finish(self.scheduler.blocked, "error",
                             error="the request does not fit in the page pool even alone (adapter too large)")
            return
        if landed_first:
            self.read_at_once[NEXT_NOT_PLANNED_AHEAD] += 1
        started = time.perf_counter()
        host.mark("cold_starts")
        streamed = bool(self.residency.streaming())  # this step ran while adapters streamed in
        if ahead is not None and assisted:  # the CPU workers compute from tokens on the host: the tokens landed first
            self._finish_step_in_flight()
            batch = [(seq, count) for seq, count in batch if not seq.state.finished]
            ahead = None
            if not batch:
                return
        for seq, _ in batch:  # sliding-window layers' pages before every window this step reads go back to the pool
            self.kv.trim(seq.blocks, seq.num_computed)
        if ahead is None:
            plan = self.runner.plan(batch, assisted)
        else:
            rows = [index for index, (seq, _) in enumerate(batch) if seq in ahead]
            plan = self.runner.plan(batch, device_tokens=self._flight_tokens([ahead[batch[index][0]] for index in rows]),
                                    device_rows=np.asarray(rows, dtype=np.int64))
        planned = time.perf_counter()
        host.mark("plan")
        self.account.before_forward()
        logits = self.runner.forward(plan)
        launched = time.perf_counter()
        self.account.launched(plan, self.runner.graph_rows, launched, parts=(scheduling, started, planned),
                              empty_slots=self.scheduler.max_running - len(plan.seqs), why_empty=self.scheduler.stopped,
                              notes={"origin": "after_landing" if ahead is None else "planned_ahead",
                                     "prefetch_ms": prefetched * 1e3, **host.notes(launched), **self._residency_notes()})
        sampled = plan.sampled
        # On a GPU the step above is still running: queued requests' adapters are copied meanwhile.
        self._prefetch(_recorded_event() if self.cold_starts.streaming["on"] and self.scheduler.waiting else None)
        self._admit_to_sampler(sampled)
        why = self._read_at_once(plan, streamed, ending=len(ending) if ahead is not None else 0)
        if why is not None and self.overlap_decode:
            self.read_at_once[why] += 1
            self.account.note(read_at_once=why)
        if ahead is not None:
            self.planned_ahead_steps += 1
            if why is None:
                observed = self._prefill_tokens(batch)  # before num_computed moves on
                for seq, count in batch:
                    seq.num_computed += count
                following = self._launch_tokens(logits, sampled)
                self.steps += 1
                self._finish_step_in_flight()
                if observed is not None:  # timed from here, where the device turned to it: the prefill model's cost
                    following.prefill = (observed, time.perf_counter())
                self._in_flight = following
                if all(seq.state.finished for seq in following.seqs):  # every row ended on the tokens just landed
                    self._finish_step_in_flight()
                return
            # Its tokens are read now (`why`: prompt chunks alone, adapters streaming in, checked when it lands): the
            # step in flight's first. A row whose token just landed ended its request (a stop token) is dropped.
            self._finish_step_in_flight()
            started = time.perf_counter()  # where the device turned to it: the prefill model times it from here
            kept = [row for row, seq in enumerate(sampled) if not seq.state.finished]
            if len(kept) < len(sampled):
                logits = logits[to_device(torch.as_tensor(kept), logits.device)]
                sampled = [sampled[row] for row in kept]
            batch = [(seq, count) for seq, count in batch if not seq.state.finished]
        elif why is None:  # its tokens are read by the next step(), after it launches its successor
            observed = None if assisted else self._prefill_tokens(batch)  # before num_computed moves on
            for seq, count in batch:
                seq.num_computed += count
            self._in_flight = self._launch_tokens(logits, sampled, None if observed is None else (observed, started))
            self.steps += 1
            return
        forking = [seq for seq in sampled if seq.state.group is not None and seq.state.group.unforked]
        if forking:  # their other choices draw their first tokens from the same logits rows
            logits, sampled = self._choice_rows(logits, sampled, forking)
            for first in forking:  # each choice's sampler state is its first choice's, just admitted: copied on the device
                if first in self.sampler_state:
                    for choice in first.state.group.unforked:
                        self.sampler_state.fork(first, choice)
        params = [seq.state.request.sampling for seq in sampled]
        processed = self._process_logits(logits, sampled)
        tokens = sample(logits, params, [seq.state.generator for seq in sampled],  # waits for the device
                        queued=self.account.tokens_queued)
        logprobs = logprobs_of(logits, params, tokens)
        self.account.landed(time.perf_counter())
        redo = self.cold_starts.after_cpu_assist(assisted, self.runner.step_spans) if assisted else set()  # its prefill runs again
        if streamed:
            redo |= self.cold_starts.after_streams(batch)  # failed: their step read an adapter that never arrived
            self.cold_starts.count_stream_step(time.perf_counter() - started)
        observed = None if assisted or streamed else self._prefill_tokens(batch)  # before num_computed moves on
        if observed is not None:
            self._observe_prefill(observed, time.perf_counter() - started)
        if processed is not None:
            self._advance_sampler(processed, tokens, redo)
        for seq, count in batch:
            if seq not in redo:
                seq.num_computed += count
        skipped = set(redo)
        for seq in forking:  # before any token is taken: a first choice that ends now gives its blocks back
            if seq in redo:
                skipped.update(seq.state.group.unforked)  # forked when its prompt is computed again
            else:
                self._fork(seq)
        self.steps += 1
        now = time.perf_counter()
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            if seq in skipped:
                continue
            if token is None:  # its sampling failed: this request ends, the step's others go on
                self._finish(seq, "error", error=SAMPLING_FAILED)
                continue
            state: RequestState = seq.state
            if state.request.keep_logits:
                state.logits.append(logits[row].to("cpu", copy=True))  # graph logits live in static memory
            self._take_token(seq, token, now, logprobs[row])

    # ---- the choices of a request (n > 1) -----------------------------------------------------------------
    # The first choice prefills the prompt alone. In the step that finishes it, every other choice samples its
    # first token from the same logits row (with its own generator, penalties and logprobs), then is forked:
    # it holds the prompt's full KV blocks with the first (KVCache.share: no copy, one more holder each) and
    # a copy of the last, partial block, into which its own next positions go. Nobody writes a shared block:
    # each choice writes only positions past the prompt. A choice that ends, is aborted or is preempted gives
    # back its own holds; a block's pages return to the pool with its last holder.

    def _choice_rows(self, logits: torch.Tensor, sampled: list[Sequence], forking: list[Sequence]):
        """The step's logits with one more row for each unforked choice of `forking` (copies of its first
        choice's row), and the sampled sequences with those choices appended in the same order."""
        rows, choices = [], []
        for row, seq in enumerate(sampled):
            if seq in forking:
                rows += [row] * len(seq.state.group.unforked)
                choices += seq.state.group.unforked
        index = torch.tensor(rows, device=logits.device)
        return torch.cat([logits, logits.index_select(0, index)]), sampled + choices

    def _fork(self, first: Sequence) -> None:
        """The unforked choices of `first`'s request, its prompt now in the KV cache: each shares the prompt's
        full blocks and gets a copy of the partial last one, then joins the running batch (or waits at the
        head of the queue while the batch is full). A choice for whose copy no pages are free holds only the
        full blocks and computes the rest of the prompt again when it runs."""
        group = first.state.group
        choices, group.unforked = group.unforked, []
        full = first.num_computed // self.kv.tokens_per_page
        for seq in choices:
            seq.blocks = self.kv.share(first.blocks, full)
            seq.num_computed = full * self.kv.tokens_per_page
            # Under tensor parallelism the workers' pools see no device copy (step messages carry block rows, not
            # copies): there each choice computes the rest of the prompt again instead.
            if seq.num_computed < first.num_computed and self.tp is None and self.grow(seq.blocks, first.num_computed):
                self.kv.copy_block(first.blocks.array()[full], seq.blocks.array()[full])
                seq.num_computed = first.num_computed
        self.forked_choices += len(choices)
        self.scheduler.adopt(choices)

    def _history(self, seq: Sequence) -> History:
        """What the sampler's logits processing reads of a sequence (penalties, min_tokens' banned ids)."""
        sampling = seq.state.request.sampling
        banned = (() if sampling.ignore_eos else tuple(self.spec.eos_token_ids)) + sampling.stop_token_ids
        return History(seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :], banned)

    # ---- logits processing: each sequence's state on the device (sampler_state.py) -----------------
    # A sequence that processes its logits is given a slot, from its history, the first time it samples (and
    # again after a preemption gave it back); each step then processes its rows from their slots and adds
    # its tokens on the device. Slots are taken on the plain path only, where every token is landed: an
    # overlapped step's sequences took theirs in the step that launched the overlap.

    def _admit_to_sampler(self, seqs: list[Sequence]) -> None:
        new = [(seq, seq.state.request.sampling, self._history(seq)) for seq in seqs
               if seq.state.request.sampling.processes_logits and seq not in self.sampler_state]
        if new:
            self.sampler_state.admit(new)

    def _process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> ProcessedRows | None:
        """Penalties, bias and min_tokens, in place, on the rows of the step's logits that ask for them."""
        rows = [row for row, seq in enumerate(seqs) if seq.state.request.sampling.processes_logits]
        return self.sampler_state.process(logits, rows, [seqs[row] for row in rows]) if rows else None

    def _advance_sampler(self, processed: ProcessedRows, tokens: list[int | None], redo) -> None:
        """A plain step's drawn tokens into its rows' state. A row whose token is dropped (its prefill runs again)
        gives its slot back, to be admitted again from its history; a failed row's request ends (_finish)."""
        drawn = torch.tensor([token if token is not None else 0 for token in tokens])
        self.sampler_state.advance(processed, to_device(drawn, self.device))
        for seq in redo:
            self.sampler_state.release(seq)

    def _release_preempted(self) -> None:
        """Slots of sequences the scheduler preempted: their tokens are recomputed before they sample again."""
        if len(self.sampler_state):
            running = set(self.scheduler.running)
            for seq in self.sampler_state.keys():
                if seq not in running:
                    self.sampler_state.release(seq)

    def _take_token(self, seq: Sequence, token: int, now: float, logprob=None) -> None:
        state: RequestState = seq.state
        if state.first_token_time is None:
            state.first_token_time = now
            self.stats.first_token(now - state.arrival)
        seq.tokens.append(token)
        if logprob is not None:
            state.logprobs.append(logprob)
        self._advance(seq, token, logprob)
        if seq.num_tokens - 1 == self.rope_switch and not state.finished:
            # longrope: from S + 1 tokens on, every position of the sequence takes the long factors, as transformers
            # computes it (checkpoint.rope_rows): its cache, rotated with the short ones, is computed again.
            seq.num_computed = 0
            log.debug("longrope cache recomputed request=%s tokens=%d", seq.request_id, seq.num_tokens)

    # ---- overlapped decode -----------------------------------------------------------------------
    # A decode step's next input ids are its tokens, argmax or drawn on the device. So the step after it
    # can be launched before the host has read them: its forward takes its input ids from the device,
    # and the host reads the first step's tokens (and streams them, finishes requests) while the device
    # runs the second. The host's work per step then hides behind the device's, instead of adding to it.
    # A request that stops on a token (EOS, a stop sequence) has one row computed past its end, which is
    # dropped; a request that stops on length is left out of the next step, as that is known in advance.
    # A step that admits waiting requests is planned while the step before it is in flight (_rows_going_on), and
    # launched with its decode rows' input ids from that step's tokens on the device, before they are read.
    # Pages freed while a step is in flight: KV pages are only written by later steps on the same stream; an
    # adapter placement copies on a side stream, so the KV pages of a sequence with a row in a step not landed
    # yet are fenced (`release`), and go out again once the device has passed that step.

    def _read_at_once(self, plan: StepPlan, streamed: bool, ending: int = 0) -> str | None:
        """None where this step's reading of its tokens is deferred: a step of every running request (greedy or drawn
        with a temperature, with penalties, bias, logprobs or not) that samples at least one row: a decode step, or
        one with prompt rows beside (a saturated server's step that admits requests beside the decode rows, the last
        prompt perhaps a chunk that does not end it). The next step is launched from its tokens on the device while
        the host takes them: a decode of them all, or one planned ahead, whose prompt chunks come from the host.
        Otherwise why its tokens are read at once, the device idle until the host launches the next (one of
        READ_AT_ONCE; counted in /v1/status `steps_read_at_once`)."""
        if not self.overlap_decode:
            return "no_overlap"
        if streamed:  # adapters stream in while it runs: their copies are checked when it lands
            return "adapters_streaming"
        if plan.assisted:
            return "cpu_assist"
        if len(plan.seqs) != len(self.scheduler.running) - ending:
            return "not_every_running_request"
        if not len(plan.sampled):  # prompt chunks alone: no token to wait for, nothing gained
            return "prompt_chunks_alone"
        for seq in plan.seqs:
            if seq.state.request.keep_logits:
                return "keeps_logits"
            if seq.state.group is not None and seq.state.group.unforked:  # a fork reads the step's logits
                return "forks"
        return None

    def _launch_tokens(self, logits: torch.Tensor, seqs: list[Sequence],
                       prefill: tuple[int, float] | None = None) -> StepInFlight:
        """The step's tokens on the device (argmax or drawn, from the processed logits where rows ask for it; their
        sampler state advanced there), their logprobs computed there, and their copies to the host started. prefill: (the
        step's tokens, when it was launched) where its time is to be observed when it lands."""
        processed = self._process_logits(logits, seqs)
        params = [seq.state.request.sampling for seq in seqs]
        chosen = choose(logits, params, [seq.state.generator for seq in seqs])  # as sample() does
        greedy = all(p.greedy for p in params)
        tokens = chosen if greedy else chosen.clamp(min=0)  # a failed draw's -1 is read on the host, never an input id
        if processed is not None:
            self.sampler_state.advance(processed, tokens)
        logprobs = self._logprob_copies.launch(logits, params, tokens, argmax=greedy)
        host = self._token_buffers[self._token_turn][: len(seqs)]
        self._token_turn ^= 1
        host.copy_(chosen, non_blocking=True)
        self.account.tokens_queued()
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return StepInFlight(seqs, tokens, host, done, logprobs, prefill)

    def _launch_next_decode(self, host: HostSplit) -> bool:
        """Launches the decode step after the one in flight from its tokens on the device, then lands the
        one in flight. False (nothing done) when the next step is not that same decode batch: requests
        wait to join it and a running slot is free, or one of its KV caches cannot grow without the
        scheduler preempting. host: the step log's split of the host's work since step() began."""
        if self.scheduler.waiting and not self._running_is_full():
            return False
        going = self._rows_going_on()
        if going is None:
            return False
        host.mark("rows")
        seqs, rows = list(going), list(going.values())
        for seq in seqs:
            self.kv.trim(seq.blocks, seq.num_computed)
        plan = self.runner.plan([(seq, 1) for seq in seqs], device_tokens=self._flight_tokens(rows))
        host.mark("plan")
        self.account.before_forward()
        logits = self.runner.forward(plan)
        launched = time.perf_counter()
        self.account.launched(plan, self.runner.graph_rows, launched, empty_slots=self.scheduler.max_running - len(seqs),
                              why_empty=ENDED_IN_FLIGHT if self.scheduler.waiting else NO_REQUEST_WAITING,
                              notes={"origin": "tokens_in_flight", **host.notes(launched), **self._residency_notes()})
        following = self._launch_tokens(logits, seqs)
        for seq in seqs:
            seq.num_computed += 1
        self.steps += 1
        self.overlapped_steps += 1
        self._finish_step_in_flight()
        self._in_flight = following
        if all(seq.state.finished for seq in seqs):  # every row ended on the tokens just landed
            self._finish_step_in_flight()
        return True

    @property
    def plan_ahead(self) -> dict:
        """Whether a step that admits waiting requests is planned while the step before it is in flight (step()):
        {"on": bool, "why": why not}. On wherever the decode overlaps, tensor parallelism included
        (test_tensor_parallel_gpu.py's test_tp2_steps_planned_ahead_on_two_gpus_equal_tp1 shows its tokens TP=1's on two
        GPUs, among adapter index compactions)."""
        why = None if self.overlap_decode else "no overlapped decode"
        return {"on": why is None, "why": why}

    def _flight_tokens(self, rows: list[int]) -> torch.Tensor:
        """The tokens of the step in flight's rows `rows`, on the device (its own tensor when they are its first)."""
        tokens = self._in_flight.tokens
        if rows == list(range(len(rows))):
            return tokens[: len(rows)]
        return tokens[to_device(torch.as_tensor(rows), tokens.device)]

    def _rows_going_on(self, chunks: bool = False) -> dict[Sequence, int] | None:
        """When the next step can be planned and launched before the step in flight's tokens are read (the step
        after an overlapped one that admits waiting requests: a mixed step): its rows that go on -> their row in it.
        None (the tokens are read first) when a running request is not in it, none goes on, or one of their KV
        caches cannot grow by the token in flight without a preemption. Rows that end on length in it are left
        out, as the overlapped decode does. chunks: a running request amid its prompt (a chunk in flight that does
        not end it, no token) may be outside it, its KV grown to the prompt's end first (the scheduler then never
        preempts a request with a row in flight to make room for its next chunk)."""
        flight = self._in_flight
        if not self.overlap_decode:
            return None
        in_flight = set(flight.seqs)
        amid = [seq for seq in self.scheduler.running if seq not in in_flight]
        if amid and not (chunks and all(seq.num_computed < seq.num_tokens for seq in amid)):
            return None
        going = {seq: row for row, seq in enumerate(flight.seqs) if not seq.state.finished and not self._ends_on_length(seq)
                 and seq.num_tokens != self.rope_switch}  # a token in flight that crosses it has its cache recomputed
        if not going or not all(self.grow(seq.blocks, seq.num_computed + 1) for seq in going):
            return None
        if not all(self.grow(seq.blocks, seq.num_tokens) for seq in amid):
            return None
        return going

    def _residency_notes(self) -> dict:
        """For the step log: the engine thread's time in the adapters' residency work (LoraResidency.host_s) since the
        last step's launch, by work, where there was any (nothing without a step log)."""
        if self.account.step_log is None:
            return {}
        spent = {work: seconds - self._residency_seen.get(work, 0.0) for work, seconds in self.residency.host_s.items()}
        self._residency_seen = dict(self.residency.host_s)
        spent = {work: round(seconds * 1e3, 3) for work, seconds in spent.items() if seconds > 0}
        return {"residency_ms": spent} if spent else {}

    def _ending(self, going: dict[Sequence, int]) -> set[Sequence]:
        """The running rows of the step in flight that end on its tokens (on length), and so leave the next step."""
        return {seq for seq in self._in_flight.seqs if seq not in going and not seq.state.finished}

    def _plan_ahead_rows(self) -> dict[Sequence, int] | None:
        """_rows_going_on where the step after the one in flight may be planned before its tokens land: every row of
        it goes on or ends on length (a row whose token crosses longrope's switch has its cache computed again, from
        the landed tokens); running requests amid their prompts go on from the host."""
        going = self._rows_going_on(chunks=True)
        if going is None or any(seq not in going and not seq.state.finished and not self._ends_on_length(seq)
                                for seq in self._in_flight.seqs):
            return None
        return going

    def _defer_unstaged(self) -> bool:
        """Does a request whose cold adapter the stager has not staged yet wait for it (LoraResidency._defer), rather
        than the engine thread staging it with the device idle: while other rows run, except under cold_start cpu,
        whose CPU workers compute the request's first layers from its host copy while the adapter loads."""
        return bool(self.scheduler.running) and self.config.cold_start != "cpu"

    def _queued_adapters(self) -> dict[str, int]:
        """Each adapter the first NEXT_USE_DEPTH waiting requests need -> the place in the queue of the first that
        needs it (LoraResidency.next_use: which idle adapter makes room for KV or another adapter)."""
        uses: dict[str, int] = {}
        for place, seq in enumerate(itertools.islice(self.scheduler.waiting, NEXT_USE_DEPTH)):
            if seq.adapter is not None:
                uses.setdefault(seq.adapter, place)
        return uses

    def _running_is_full(self) -> bool:
        """No waiting request can join the next step: every running slot is taken. A saturated server keeps
        overlapping its decode steps; once a request ends (on the tokens landed by this step), the step after
        is planned by the scheduler and the queue's head joins it."""
        return len(self.scheduler.running) >= self.scheduler.max_running

    def _ends_on_length(self, seq: Sequence) -> bool:
        """Will the token in flight be this sequence's last by length (_advance's rule, one token ahead)?"""
        return seq.num_generated + 1 >= seq.state.request.sampling.max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _finish_step_in_flight(self) -> None:
        """Waits for the step in flight's tokens and hands them to their requests (those still going)."""
        flight, self._in_flight = self._in_flight, None
        asked = time.perf_counter()
        if flight.done is not None:
            flight.done.synchronize()
        now = time.perf_counter()
        self.account.landed(now)
        if flight.prefill is not None:
            tokens, launched = flight.prefill
            self._observe_prefill(tokens, now - launched)
        logprobs = flight.logprobs.read() if flight.logprobs is not None else [None] * len(flight.seqs)
        for seq, token, logprob in zip(flight.seqs, flight.host.tolist(), logprobs):
            if seq.state.finished:
                continue
            if token < 0:  # its draw failed: this request ends, the others go on (the row launched after it is dropped)
                self._finish(seq, "error", error=SAMPLING_FAILED)
                continue
            self._take_token(seq, token, now, logprob)
        # for the step log, on the step launched before this landing (where one was): the device's wait, the tokens' handing
        self.account.note(landing_wait_ms=(now - asked) * 1e3, landing_take_ms=(time.perf_counter() - now) * 1e3)

    def _drop_by_admission(self) -> None:
        """Fails the requests the admission policy dropped this step, each with its reason (503)."""
        for seq, reason in self.scheduler.take_dropped():
            self.admission_dropped += 1
            self.stats.dropped_by_admission(self.scheduler.admission.name)
            log.info("request dropped id=%s adapter=%s policy=%s reason=%r",
                     seq.request_id, seq.adapter, self.scheduler.admission.name, reason)
            self._finish(seq, "error", error=f"dropped by {self.config.admission} admission: {reason}",
                         error_type=AdmissionDropped.type)

    def _prefill_tokens(self, plan: list[tuple[Sequence, int]]) -> int | None:
        """The step's tokens where its time feeds the prefill model (`_observe_prefill`): it has 8 prompt tokens or
        more and a model wants it; else None. Asked before the step moves num_computed on."""
        if self.online_prefill is None and self.config.cold_start != "auto":
            return None
        if sum(count for seq, count in plan if seq.num_computed < seq.prompt_len) < 8:
            return None
        return sum(count for _, count in plan)

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """The base prefill's cost per token, a moving average over steps with prompt tokens: for early abort's
        TTFT estimate when no profile was loaded, and for cold start `auto`."""
        if self.online_prefill is not None:
            self.online_prefill.observe(tokens, seconds)
        self.cold_starts.observe_prefill(tokens, seconds)

    def _prefetch(self, busy=None) -> None:
        """Places the adapters of the first queued requests while the device runs a step. busy: that step's
        event, where cold adapters may stream in (`cold_starts.streaming`): those the admission would stream are
        streamed ahead, their layers queued until the event has passed (LoraResidency.prefetch)."""
        reserve = len(self.scheduler.running) * self.kv.pages_per_block  # one more block for each runner
        queued = list(itertools.islice(self.scheduler.waiting, PREPARE_DEPTH))
        self.residency.prepare(seq.adapter for seq in queued)
        for seq in queued[:PREFETCH_DEPTH]:
            tokens = None if busy is None else seq.num_tokens - seq.num_computed
            if seq.adapter is not None and not self.residency.prefetch(seq.adapter, reserve, tokens):
                break
        if busy is not None:
            self.residency.issue_ahead(busy.query)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            drops, self._drops = self._drops, []
        for name in drops:
            self.residency.drop(name)
        for seq in inbox:
            self.scheduler.add(seq)
        for request_id in aborts:
            seq = self._sequences.get(request_id)
            if seq is not None:
                for choice in seq.state.group.sequences if seq.state.group is not None else (seq,):
                    self._finish(choice, "abort")

    def _advance(self, seq: Sequence, token: int, logprob=None) -> None:
        state: RequestState = seq.state
        sampling = state.request.sampling
        stopped = state.detokenizer.add(token)
        reason = None
        if stopped:
            reason = "stop"
        elif not sampling.ignore_eos and token in self.spec.eos_token_ids:
            reason = "stop"
        elif token in sampling.stop_token_ids:
            reason = "stop"
        elif seq.num_generated >= sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        logprobs = None if logprob is None else [logprob]
        if reason is not None:
            self._finish(seq, reason, new_tokens=[token], logprobs=logprobs)
        else:
            self._emit(seq, RequestOutput(seq.request_id, [token], state.detokenizer.take(final=False), logprobs=logprobs,
                                          choice=state.choice))

    def _finish(self, seq: Sequence, reason: str, new_tokens: list[int] | None = None, error: str | None = None,
                error_type: str | None = None, logprobs: list | None = None) -> None:
        state: RequestState = seq.state
        if state.finished:
            return
        state.finished = True
        state.finish_reason = reason
        now = time.perf_counter()
        decode_s = None if state.first_token_time is None else now - state.first_token_time
        self.stats.request_finished(reason, seq.prompt_len, seq.num_generated, now - state.arrival, decode_s)
        self.scheduler.finish(seq, completed=reason in ("stop", "length"))
        self.sampler_state.release(seq)
        group = state.group
        if group is not None and seq in group.unforked:
            group.unforked.remove(seq)
        done = group is None or group.finished  # every choice of the request
        with self._lock:
            if done:
                self._sequences.pop(seq.request_id, None)
            if seq.adapter is not None:
                held = self._held[seq.adapter]
                held.requests -= 1
                if held.requests == 0:
                    del self._held[seq.adapter]
                    self.account.cost_model.forget(seq.adapter)
                    if seq.adapter in self._draining:
                        self._draining.discard(seq.adapter)
                        self.residency.drop(seq.adapter)
        if self._thread is None and done:
            self._finished[seq.request_id] = seq if group is None else group.sequences[0]
        text = state.detokenizer.take(final=True) if reason in ("stop", "length") else ""
        self._emit(seq, RequestOutput(seq.request_id, new_tokens or [], text, True, reason, seq.prompt_len, seq.num_generated, error,
                                      error_type, logprobs, state.choice))
        if reason in ("stop", "length", "abort", "error"):
            ttft = (state.first_token_time - state.arrival) * 1e3 if state.first_token_time else -1
            log.debug("request done id=%s choice=%d adapter=%s reason=%s generated=%d ttft_ms=%.1f", seq.request_id,
                      state.choice, seq.adapter, reason, seq.num_generated, ttft)
        if group is not None and group.unforked and state.choice == 0:  # the prompt will not be computed: nor the choices
            for choice in list(group.unforked):                         # that were to be forked from it
                self._finish(choice, reason, error=error, error_type=error_type)

    @staticmethod
    def _emit(seq: Sequence, output: RequestOutput) -> None:
        deliver(seq.state.request.on_output, output)


def pool_pages(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> int:
    """The page pool's pages on this device (a tensor-parallel worker asks for its own GPU too)."""
    element = torch.tensor([], dtype=dtype).element_size()
    page_bytes = spec.page_elems * element
    if config.pool_bytes is not None:
        budget = config.pool_bytes
    elif device.type == "cuda":
        # The allocator's cached blocks (the weights' build leaves GBs: a 70B shard's 8 GB on an 80 GB GPU) are
        # free memory too, but only once given back to the driver: mem_get_info does not count them.
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        # Leave room for the activations of the largest step (a generous multiple of its hidden states).
        activations = config.max_batch_tokens * (spec.hidden_size * 8 + spec.intermediate_size * 4) * element
        if not config.eager:  # the CUDA graphs' memory pool holds one such step's activations for good
            activations *= 2
            # and their logits: the decode and the prefill graphs' shared buffers (decode_graphs.SharedLogits) and the
            # largest graph's own float32 and model-dtype logits, a temporary of the pool
            # (for the largest running cap it may derive where none is given: the pool's size comes first)
            activations += (config.max_running_requests or RUNNING_RANGE[1]) * spec.vocab_size * (3 * 4 + element)
        budget = int(free * config.gpu_memory_utilization) - activations
    else:
        budget = CPU_POOL_BYTES
    return max(2, budget // page_bytes)


def dummy_adapter_projections(spec: ModelSpec) -> tuple[str, ...]:
    """What dummy_adapter_targets may name on this model: the seven projections, and Phi-3's fused modules too (one
    A shared by their members, as its real adapters are loaded)."""
    return PROJECTIONS + (tuple(FUSED_MODULES) if spec.fused_projections else ())


def _dummy_adapters(spec: ModelSpec, config: EngineConfig) -> list[LoraAdapter]:
    """`dummy_adapters` random adapters of one rank and target set, straight into host memory.

    A handful of distinct weight sets is shared by all of them (generating thousands of 7B-sized
    adapters would take minutes and tens of GB); each still has its own name, its own pool pages and
    its own host->device load, which is what serving costs depend on."""
    if config.dummy_adapters <= 0:
        return []
    targets = tuple(t.strip() for t in config.dummy_adapter_targets.split(",") if t.strip())
    allowed = dummy_adapter_projections(spec)
    unknown = [t for t in targets if t not in allowed]
    if unknown or not targets:
        raise BadRequest(f"dummy_adapter_targets: unknown projections {unknown}; use {', '.join(allowed)}")
    rank = config.dummy_adapter_rank
    if not 1 <= rank <= config.max_lora_rank:
        raise BadRequest(f"dummy_adapter_rank must be in 1..{config.max_lora_rank}")
    generator = torch.Generator().manual_seed(config.seed)
    weight_sets = []
    for _ in range(min(4, config.dummy_adapters)):
        weights = {}
        for layer in range(spec.num_layers):
            for module in targets:
                fan_in, fan_out = spec.module_shape(module)
                a = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
                b = torch.randn(fan_out, rank, generator=generator) * (0.5 / rank)
                for projection, rows in module_members(spec, module, b):
                    weights[(layer, projection)] = (a, rows)
        weight_sets.append(weights)
    nbytes = weights_nbytes(weight_sets[0])
    projections = sorted({projection for _, projection in weight_sets[0]})
    return [
        LoraAdapter(
            name=f"dummy-{index}", path="<memory>", rank=rank, targets=tuple(PROJECTIONS[p] for p in projections),
            weights=weight_sets[index % len(weight_sets)], nbytes=nbytes,
            scaling={key: 1.0 for key in weight_sets[0]},
        )
        for index in range(config.dummy_adapters)
    ]


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadRequest("device cuda was asked for, but torch sees no CUDA GPU")
    return torch.device(device)


def resolve_dtype(dtype: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return TORCH_DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16
