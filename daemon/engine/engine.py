"""The engine: the model, its page pool, the adapters and the step loop.

`submit` may be called from any thread; the step loop (a background thread after `start`, or the
caller's thread in `generate`) takes new requests and aborts at the start of each step, asks the
scheduler for the step's batch, runs one forward for all of it, samples, and reports each request's
new tokens through its `on_output` callback. On cuda, greedy decode steps overlap (see "overlapped
decode" below): a step launches the next one from its tokens on the device before reading them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorad.config import EngineConfig
from lorad.daemon.model.adapters import AdapterRegistry, LoraAdapter
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, PROJECTIONS, ModelSpec, dummy_weights, load_spec, load_weights
from lorad.daemon.engine.cold_start import ColdStarts, streaming_availability
from lorad.daemon.engine.runner import ModelRunner
from lorad.daemon.engine.step_account import StepAccount
from lorad.daemon.engine.step_cost import StepCostModel, measure_device_rates
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.engine.kernel_choice import LoraKernelChoice
from lorad.daemon.engine.adapter_residency import LoraResidency
from lorad.daemon.engine import status
from lorad.daemon.engine.stats import Metrics
from lorad.daemon.engine.request import GenerationRequest, GenerationResult, RequestOutput, check_prompt, deliver
from lorad.daemon.engine.sampler import History, logprobs_of, make_generator, sample
from lorad.daemon.engine.tokenizer import Detokenizer, load_tokenizer
from lorad.errors import AdmissionDropped, BadRequest, LoradError, ModelError, ModelNotFound, Overloaded, clip
from lorad.gpu_ops.page_pool import AdapterTable, BlockList, KVCache, PagePool
from lorad.scheduler.admission import AdmissionPolicy, Objectives, OnlinePrefill, make_admission
from lorad.scheduler.batching import Scheduler, Sequence

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_DEFAULT_MODEL_LEN = 8192
CPU_POOL_BYTES = 256 << 20
ADAPTER_SLOTS = 1024
PREFETCH_DEPTH = 8  # queued requests whose adapters are loaded ahead, while a step runs
CLUSTER_MAX_WAIT_MS = 1000.0  # admission cluster without a TTFT objective: how long another adapter's request waits at most


@dataclass(eq=False)
class StepInFlight:
    """A greedy decode step launched whose tokens the host has not read yet (overlapped decode)."""

    seqs: list[Sequence]  # its rows, in order
    tokens: torch.Tensor  # [n] int64 on the device: each row's argmax, the next step's input ids
    host: torch.Tensor  # [n] int64, pinned on cuda: where the tokens are copied to
    done: torch.cuda.Event | None  # recorded after that copy; None on the cpu (the copy is done)


@dataclass(eq=False)
class HeldAdapter:
    """An adapter that requests in the engine use: kept (not re-read from the registry) until the last ends."""

    adapter: LoraAdapter
    requests: int = 0


@dataclass(eq=False)
class RequestState:
    request: GenerationRequest
    detokenizer: Detokenizer
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    logits: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per generated token, when asked for
    finished: bool = False
    finish_reason: str | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir, demo_adapters = self._model_dir(config)
        self.device = resolve_device(config.device)
        if model_dir is None:  # a known shape with random weights (benchmarks)
            self.spec = ModelSpec.from_hf_config(MODEL_CONFIGS[config.model_config])
            self.model_name = config.model_config
        else:
            self.spec = load_spec(model_dir)
            self.model_name = "lorad-demo" if config.demo else model_dir.name
        self.dtype = resolve_dtype(config.dtype, self.spec.torch_dtype, self.device)
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = self.spec.vocab_size
        self.max_model_len = min(config.max_model_len or min(self.spec.max_position_embeddings, MAX_DEFAULT_MODEL_LEN), self.spec.max_position_embeddings)

        started = time.perf_counter()
        if model_dir is None:
            weights = dummy_weights(self.spec, self.dtype, self.device, seed=config.seed)
        else:
            weights = load_weights(model_dir, self.dtype, self.device)
        # The decode LoRA kernel per step, from `lorad profile`'s models when a profile is found.
        self.kernel_choice = LoraKernelChoice.for_engine(
            config.profile_path, self.model_name, self.device, config.state_dir, str(self.dtype).removeprefix("torch."),
            config.lora_kernel)
        log.info("decode lora kernel choice=%s", self.kernel_choice.describe())
        self.runner = ModelRunner(config, self.spec, self.device, weights, self.max_model_len, self.kernel_choice)
        del weights
        # What this device sustains (HBM bandwidth, GEMM rate), measured before the pool takes the memory
        # left: each step's floor in the engine's account of its own time (step_account.py).
        rates = measure_device_rates(self.device, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("device rates hbm_gb_s=%.1f gemm_tflop_s=%.2f (each step's floor: the slower of bytes and FLOPs)",
                 rates.bandwidth_bytes_per_s / 1e9, rates.flops_per_s / 1e12)
        self.pool = PagePool(self._pool_pages(), self.spec.page_elems, self.dtype, self.device)
        self.kv = KVCache(self.pool, self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim)
        if self.kv.blocks_for(self.max_model_len) * self.kv.pages_per_block > self.pool.capacity:
            raise ModelError(
                f"the page pool ({self.pool.capacity} pages) cannot hold one sequence of max_model_len="
                f"{self.max_model_len}: give more pool memory or a smaller max_model_len"
            )
        shapes = [self.spec.projection_shape(p) for p in PROJECTIONS]
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
        self.account = StepAccount(StepCostModel(self.spec, dtype_bytes, self._adapter_ranks), rates)
        self.kernel_choice.on_choice = self.stats.lora_kernel_chosen
        self.overlapped_steps = 0
        # Overlapped decode (step(), _launch_next_decode): only where the device runs behind the host. On the cpu a
        # launch is the computation itself, so reading a step's tokens one step late would only delay them.
        self.overlap_decode = config.overlap_decode and self.device.type == "cuda"
        self._in_flight: StepInFlight | None = None
        self._token_buffers = [torch.zeros(config.max_running_requests, dtype=torch.long, pin_memory=self.device.type == "cuda")
                               for _ in range(2)]  # a step in flight and the one launched after it
        self._token_turn = 0
        self.residency = LoraResidency(self._host_adapter, self.table, self.stats, pinned_bytes=config.pinned_host_bytes,
                                       staged_bytes=config.host_adapter_bytes)
        self.cold_starts = ColdStarts(config, self.spec, self.device, self.dtype, self.table, self.residency, self.stats,
                                      streaming, held=lambda name: self._held[name].adapter,
                                      fail=lambda seq, reason: self._finish(seq, "error", error=reason))
        self.runner.bind(self.kv, self.table, self.residency, self.cold_starts, held=lambda name: self._held[name].adapter)
        self.online_prefill: OnlinePrefill | None = None  # early abort's estimate when no profile was found
        admission, objectives = self._admission()
        self.scheduler = Scheduler(config.max_running_requests, config.max_batch_tokens, self, self.residency,
                                   admission, objectives, decode=self.tpot_decode)
        self.admission_dropped = 0

        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._drops: list[str] = []
        self._sequences: dict[str, Sequence] = {}
        self._finished: dict[str, Sequence] = {}  # read back by generate(); unused when started
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        if config.cold_start == "cached":
            self._place_every_adapter()
        elif config.cold_start in ("cpu", "auto"):
            self.cold_starts.start_cpu_assist()
        log.info(
            "engine ready model=%s arch=%s device=%s dtype=%s ops=%s cuda_graphs=%s overlap_decode=%s pool_pages=%d "
            "page_elems=%d kv_tokens=%d adapters=%d load_s=%.2f",
            self.model_name, self.spec.architecture, self.device, str(self.dtype).removeprefix("torch."),
            self.runner.ops.name, "off" if self.runner.graphs is None else "on", "on" if self.overlap_decode else "off", self.pool.capacity, self.pool.page_elems, self.kv.free_tokens(),
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

    def _pool_pages(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        page_bytes = self.spec.page_elems * element
        if self.config.pool_bytes is not None:
            budget = self.config.pool_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # Leave room for the activations of the largest step (a generous multiple of its hidden states).
            activations = self.config.max_batch_tokens * (self.spec.hidden_size * 8 + self.spec.intermediate_size * 4) * element
            if not self.config.eager:  # the CUDA graphs' memory pool holds one such step's activations for good
                activations *= 2
            budget = int(free * self.config.gpu_memory_utilization) - activations
        else:
            budget = CPU_POOL_BYTES
        return max(2, budget // page_bytes)

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
        resident = set(self.residency.slots)
        entries = [{"id": self.model_name, "parent": None, "kind": "base"}]
        for name in self.registry.names():
            info = self.registry.describe(name)
            if name in resident:
                info["location"] = "gpu" if self.device.type == "cuda" else "pool"
            entries.append({"id": name, "parent": self.model_name, "kind": "lora", **info})
        return entries

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

    def submit(self, request: GenerationRequest) -> None:
        """Checks the request and queues it; raises BadRequest, NotFound, AdapterError, Overloaded."""
        prompt = request.prompt_token_ids
        check_prompt(prompt, request.sampling, self.vocab_size, self.max_model_len)
        if request.adapter is not None:
            if request.adapter not in self.registry:
                raise ModelNotFound(
                    f"the model {clip(request.adapter)} does not exist (GET /v1/models lists the base model and adapters)"
                )
            adapter = self._read_adapter(request.adapter)  # read now, in the caller's thread: errors go to the caller
        state = RequestState(request, Detokenizer(self.tokenizer, request.sampling.stop), make_generator(request.sampling))
        seq = Sequence(request.request_id, list(prompt), len(prompt), request.adapter, blocks=BlockList(), state=state,
                       rank=adapter.rank if request.adapter is not None else 0, arrival_s=self.scheduler.clock())
        with self._lock:
            if self._stopping:
                raise Overloaded("the engine is shutting down")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.config.max_waiting_requests:
                raise Overloaded(f"{self.config.max_waiting_requests} requests are already waiting")
            if request.request_id in self._sequences:
                raise BadRequest(f"request id {request.request_id} is already in use")
            self._sequences[request.request_id] = seq
            if request.adapter is not None:
                self._held.setdefault(request.adapter, HeldAdapter(adapter)).requests += 1
            self._inbox.append(seq)
            self._lock.notify()

    def abort(self, request_id: str) -> None:
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
        self._save_registrations()
        return adapter.describe()

    def _under_root(self, path: str) -> tuple[Path, Path]:
        """The adapter folder resolved (symlinks followed: a link out of the roots is outside) and the adapter
        root it lies under; BadRequest when it lies under none."""
        resolved = Path(path).resolve()
        root = next((root for root in self._adapter_roots if resolved.is_relative_to(root)), None)
        if root is None:
            if not self._adapter_roots:
                raise BadRequest("no adapter roots are configured (adapter_roots): loading through the API is off")
            roots = ", ".join(str(root) for root in self._adapter_roots)
            raise BadRequest(f"{path} is not under an adapter root ({roots})")
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
            saved = json.loads(self._state_file.read_text())
        except (OSError, ValueError) as error:
            log.warning("cannot read %s (%s): API registrations not restored", self._state_file, error)
            return {}
        restored = {}
        for name, path in saved.items():
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
        while self.scheduler.has_work() or self._inbox:
            self.step()
        for request in requests:
            seq = self._finished.pop(request.request_id)
            state: RequestState = seq.state
            results[request.request_id] = GenerationResult(
                request.request_id, seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :],
                state.detokenizer.text, state.finish_reason, state.logits if request.keep_logits else None,
                state.logprobs if request.sampling.logprobs is not None else None,
            )
        return [results[r.request_id] for r in requests]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lorad-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stops the step loop (if started) and the CPU LoRA workers, and unlinks the engine's
        shared-memory segments. Idempotent; the engine serves nothing afterwards."""
        if self._thread is not None:
            self.stop()
        self.cold_starts.close()

    # ---- Memory protocol for the scheduler: KV growth may evict idle adapters ---------------------
    def grow(self, blocks: list, num_tokens: int) -> bool:
        if self.kv.grow(blocks, num_tokens):
            return True
        missing = (self.kv.blocks_for(num_tokens) - len(blocks)) * self.kv.pages_per_block
        return self.residency.reclaim(missing) and self.kv.grow(blocks, num_tokens)

    def release(self, blocks: list) -> None:
        self.kv.release(blocks)

    # ---- the step loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._aborts or self._drops or self.scheduler.has_work()):
                    self.account.idle()
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception:  # a bug must not kill the daemon: fail the step's requests, go on
                log.exception("step failed; failing its requests")
                self._in_flight = None
                self.account.drop_pending()
                for seq in list(self.scheduler.running):
                    self._finish(seq, "error", error="internal error in the engine step")
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting) + inbox:
            self._finish(seq, "abort")

    def step(self) -> None:
        self.account.begin(time.perf_counter())
        self._take_inbox()
        if self._in_flight is not None:
            if self._launch_next_decode():
                return
            if self.scheduler.waiting and self.cold_starts.streaming["on"]:
                # The host would only wait for the step in flight: queued requests' cold adapters start
                # streaming in meanwhile (their copies hold the host until it is done, at most a layer more).
                self._prefetch(self._in_flight.done)
            self._finish_step_in_flight()
        try:
            batch = self.scheduler.schedule()
        except LoradError as error:  # an adapter that broke between submit and admission
            self._finish(self.scheduler.blocked, "error", error=error.message)
            return
        self._drop_by_admission()
        assisted = self.cold_starts.admit(batch)
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                self._finish(self.scheduler.blocked, "error",
                             error="the request does not fit in the page pool even alone (adapter too large)")
            return
        started = time.perf_counter()
        streamed = bool(self.residency.streaming())  # this step ran while adapters streamed in
        plan = self.runner.plan(batch, assisted)
        logits = self.runner.forward(plan)
        self.account.launched(plan)
        sampled = plan.sampled
        # On a GPU the step above is still running: queued requests' adapters are copied meanwhile.
        self._prefetch(_recorded_event() if self.cold_starts.streaming["on"] and self.scheduler.waiting else None)
        if not streamed and self._overlappable(plan):  # its tokens are read by the next step(), after it launches its successor
            for seq in sampled:
                seq.num_computed += 1
            self._in_flight = self._launch_tokens(logits, sampled)
            self.steps += 1
            return
        params = [seq.state.request.sampling for seq in sampled]
        histories = [self._history(seq) if p.processes_logits else None for seq, p in zip(sampled, params)]
        tokens = sample(logits, params, [seq.state.generator for seq in sampled],  # waits for the device
                        histories if any(histories) else None)
        logprobs = logprobs_of(logits, params, tokens) if any(p.logprobs is not None for p in params) else None
        self.account.landed(time.perf_counter())
        redo = self.cold_starts.after_cpu_assist(assisted, self.runner.step_spans) if assisted else set()  # its prefill runs again
        if streamed:
            redo |= self.cold_starts.after_streams(batch)  # failed: their step read an adapter that never arrived
            self.cold_starts.count_stream_step(time.perf_counter() - started)
        if not assisted and not streamed and (self.online_prefill is not None or self.config.cold_start == "auto"):
            self._observe_prefill(batch, time.perf_counter() - started)  # before num_computed moves on
        for seq, count in batch:
            if seq not in redo:
                seq.num_computed += count
        self.steps += 1
        now = time.perf_counter()
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            if seq in redo:
                continue
            if token is None:  # its sampling failed: this request ends, the step's others go on
                self._finish(seq, "error", error="sampling failed for this request (its distribution was not valid)")
                continue
            state: RequestState = seq.state
            if state.request.keep_logits:
                state.logits.append(logits[row].to("cpu", copy=True))  # graph logits live in static memory
            self._take_token(seq, token, now, logprobs[row] if logprobs is not None else None)

    def _history(self, seq: Sequence) -> History:
        """What the sampler's logits processing reads of a sequence (penalties, min_tokens' banned ids)."""
        sampling = seq.state.request.sampling
        banned = (() if sampling.ignore_eos else tuple(self.spec.eos_token_ids)) + sampling.stop_token_ids
        return History(seq.tokens[: seq.prompt_len], seq.tokens[seq.prompt_len :], banned)

    def _take_token(self, seq: Sequence, token: int, now: float, logprob=None) -> None:
        state: RequestState = seq.state
        if state.first_token_time is None:
            state.first_token_time = now
            self.stats.first_token(now - state.arrival)
        seq.tokens.append(token)
        if logprob is not None:
            state.logprobs.append(logprob)
        self._advance(seq, token, logprob)

    # ---- overlapped decode -----------------------------------------------------------------------
    # A greedy decode step's next input ids are its argmax, already on the device. So the step after it
    # can be launched before the host has read them: its forward takes its input ids from the device,
    # and the host reads the first step's tokens (and streams them, finishes requests) while the device
    # runs the second. The host's work per step then hides behind the device's, instead of adding to it.
    # A request that stops on a token (EOS, a stop sequence) has one row computed past its end, which is
    # dropped; a request that stops on length is left out of the next step, as that is known in advance.
    # Pages freed while a step is in flight are safe: KV pages are only written by later steps on the
    # same stream, and adapter pages are only overwritten by a placement, which only the scheduler's
    # admission and prefetch make, on the plain path, after the step in flight has been landed.

    def _overlappable(self, plan: StepPlan) -> bool:
        """Is this step's reading of its tokens deferred: a greedy decode step of every running request."""
        if not (self.overlap_decode and plan.decode) or plan.assisted or len(plan.seqs) != len(self.scheduler.running):
            return False
        return all(seq.state.request.sampling.greedy and not seq.state.request.sampling.processes_logits
                   and seq.state.request.sampling.logprobs is None and not seq.state.request.keep_logits
                   for seq in plan.seqs)

    def _launch_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> StepInFlight:
        """The step's greedy tokens on the device, and their copy to the host started."""
        tokens = logits.argmax(dim=-1)  # as sample() does for greedy rows
        host = self._token_buffers[self._token_turn][: len(seqs)]
        self._token_turn ^= 1
        host.copy_(tokens, non_blocking=True)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return StepInFlight(seqs, tokens, host, done)

    def _launch_next_decode(self) -> bool:
        """Launches the decode step after the one in flight from its tokens on the device, then lands the
        one in flight. False (nothing done) when the next step is not that same decode batch: requests
        wait to join it, or one of its KV caches cannot grow without the scheduler preempting."""
        flight = self._in_flight
        if self.scheduler.waiting or not self.overlap_decode:
            return False
        in_flight = set(flight.seqs)
        if any(seq not in in_flight for seq in self.scheduler.running):
            return False
        rows = [row for row, seq in enumerate(flight.seqs) if not seq.state.finished and not self._ends_on_length(seq)]
        seqs = [flight.seqs[row] for row in rows]
        if not seqs or not all(self.grow(seq.blocks, seq.num_computed + 1) for seq in seqs):
            return False
        if rows == list(range(len(rows))):
            device_tokens = flight.tokens[: len(rows)]
        else:
            index = torch.as_tensor(rows)
            if flight.tokens.is_cuda:  # from pinned memory: a pageable copy may wait for the step in flight
                index = index.pin_memory().to(flight.tokens.device, non_blocking=True)
            device_tokens = flight.tokens[index]
        plan = self.runner.plan([(seq, 1) for seq in seqs], device_tokens=device_tokens)
        logits = self.runner.forward(plan)
        self.account.launched(plan)
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

    def _ends_on_length(self, seq: Sequence) -> bool:
        """Will the token in flight be this sequence's last by length (_advance's rule, one token ahead)?"""
        return seq.num_generated + 1 >= seq.state.request.sampling.max_tokens or seq.num_tokens + 1 >= self.max_model_len

    def _finish_step_in_flight(self) -> None:
        """Waits for the step in flight's tokens and hands them to their requests (those still going)."""
        flight, self._in_flight = self._in_flight, None
        if flight.done is not None:
            flight.done.synchronize()
        now = time.perf_counter()
        self.account.landed(now)
        for seq, token in zip(flight.seqs, flight.host.tolist()):
            if not seq.state.finished:
                self._take_token(seq, token, now)

    def _drop_by_admission(self) -> None:
        """Fails the requests the admission policy dropped this step, each with its reason (503)."""
        for seq, reason in self.scheduler.take_dropped():
            self.admission_dropped += 1
            self.stats.dropped_by_admission(self.scheduler.admission.name)
            log.info("request dropped id=%s adapter=%s policy=%s reason=%r",
                     seq.request_id, seq.adapter, self.scheduler.admission.name, reason)
            self._finish(seq, "error", error=f"dropped by {self.config.admission} admission: {reason}",
                         error_type=AdmissionDropped.type)

    def _observe_prefill(self, plan: list[tuple[Sequence, int]], seconds: float) -> None:
        """The base prefill's cost per token, a moving average over steps with prompt tokens: for early abort's
        TTFT estimate when no profile was loaded, and for cold start `auto`."""
        if sum(count for seq, count in plan if seq.num_computed < seq.prompt_len) < 8:
            return
        tokens = sum(count for _, count in plan)
        if self.online_prefill is not None:
            self.online_prefill.observe(tokens, seconds)
        self.cold_starts.observe_prefill(tokens, seconds)

    def _prefetch(self, busy=None) -> None:
        """Places the adapters of the first queued requests while the device runs a step. busy: that step's
        event, where cold adapters may stream in (`cold_starts.streaming`): those the admission would stream are
        streamed ahead, their layers queued until the event has passed (LoraResidency.prefetch)."""
        reserve = len(self.scheduler.running) * self.kv.pages_per_block  # one more block for each runner
        for seq in list(self.scheduler.waiting)[:PREFETCH_DEPTH]:
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
                self._finish(seq, "abort")

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
            self._emit(seq, RequestOutput(seq.request_id, [token], state.detokenizer.take(final=False), logprobs=logprobs))

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
        self.scheduler.finish(seq)
        with self._lock:
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
        if self._thread is None:
            self._finished[seq.request_id] = seq
        text = state.detokenizer.take(final=True) if reason in ("stop", "length") else ""
        self._emit(seq, RequestOutput(seq.request_id, new_tokens or [], text, True, reason, seq.prompt_len, seq.num_generated, error,
                                      error_type, logprobs))
        if reason in ("stop", "length", "abort", "error"):
            ttft = (state.first_token_time - state.arrival) * 1e3 if state.first_token_time else -1
            log.debug("request done id=%s adapter=%s reason=%s generated=%d ttft_ms=%.1f", seq.request_id, seq.adapter, reason, seq.num_generated, ttft)

    @staticmethod
    def _emit(seq: Sequence, output: RequestOutput) -> None:
        deliver(seq.state.request.on_output, output)


def _dummy_adapters(spec: ModelSpec, config: EngineConfig) -> list[LoraAdapter]:
    """`dummy_adapters` random adapters of one rank and target set, straight into host memory.

    A handful of distinct weight sets is shared by all of them (generating thousands of 7B-sized
    adapters would take minutes and tens of GB); each still has its own name, its own pool pages and
    its own host->device load, which is what serving costs depend on."""
    if config.dummy_adapters <= 0:
        return []
    targets = tuple(t.strip() for t in config.dummy_adapter_targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in PROJECTIONS]
    if unknown or not targets:
        raise BadRequest(f"dummy_adapter_targets: unknown projections {unknown}; use {', '.join(PROJECTIONS)}")
    rank = config.dummy_adapter_rank
    if not 1 <= rank <= config.max_lora_rank:
        raise BadRequest(f"dummy_adapter_rank must be in 1..{config.max_lora_rank}")
    generator = torch.Generator().manual_seed(config.seed)
    weight_sets = []
    for _ in range(min(4, config.dummy_adapters)):
        weights = {}
        for layer in range(spec.num_layers):
            for projection in targets:
                fan_in, fan_out = spec.projection_shape(projection)
                a = torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
                b = torch.randn(fan_out, rank, generator=generator) * (0.5 / rank)
                weights[(layer, PROJECTIONS.index(projection))] = (a, b)
        weight_sets.append(weights)
    nbytes = sum(a.nbytes + b.nbytes for a, b in weight_sets[0].values())
    return [
        LoraAdapter(
            name=f"dummy-{index}", path="<memory>", rank=rank, targets=tuple(p for p in PROJECTIONS if p in targets),
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
