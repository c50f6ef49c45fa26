"""Configuration of a lorad daemon: frozen dataclasses, the only place defaults live.

The CLI flags (daemon/server/cli.py) and the TOML keys map onto these fields one to one:
`--max-lora-rank` is `EngineConfig.max_lora_rank`, `[engine] max_lora_rank` in lorad.toml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# What a request whose adapter is not in the page pool waits for (DESIGN.md, CPU-assisted cold start):
# cached: every adapter placed at start-up (refused if they do not fit); ondemand: the adapter is
# placed at admission, then the prefill runs; cpu: the prefill's LoRA runs on the CPU workers while
# the adapter is placed; auto: ondemand or cpu per request, from costs measured at start-up. None (`lorad
# serve`'s default), the engine picks at start (daemon/engine/cold_start.py: resolve_cold_start): auto on cuda
# with tensor_parallel_size 1, no slower than ondemand in BENCHMARKS.md's cold-start figures 5.1 and 5.2;
# ondemand elsewhere.
COLD_STARTS = ("cached", "ondemand", "cpu", "auto")
CPU_LORA_SPLITS = ("auto", "tokens", "groups")
LORA_KERNELS = ("auto", "bgmv", "mbgmv")
# Programmatic dependent launch of the decode MBGMV expand (gpu_ops/mbgmv.py): auto is on where the device
# (Hopper and later) and triton support it, else off; on where they do not is refused.
LORA_PDL = ("auto", "on", "off")
# Which waiting requests join a step (scheduler/admission.py): fcfs: in arrival order; early-abort: queued
# requests whose predicted TTFT exceeds slo_ttft_ms are dropped with an error (S-LoRA App. B); cluster:
# once the running batch holds cluster_max_adapters distinct adapters, other adapters' requests wait
# (S-LoRA App. A), at most slo_ttft_ms (or CLUSTER_MAX_WAIT_MS without one) before they go in anyway.
ADMISSIONS = ("fcfs", "early-abort", "cluster")
MAX_TENSOR_PARALLEL_SIZE = 64
# The sum of o's and down's partial outputs over the tensor-parallel ranks: nccl, NCCL's all-reduce (gloo on the cpu);
# fused, on two GPUs, the decode steps' sums (up to tensor_parallel.PEER_SUM_MAX_ROWS rows) through one kernel that
# reads the other GPU's partial over NVLink and does the residual add and RMSNorm after it (gpu_ops/peer_sum.py),
# NCCL for the rest; where it cannot be set up, NCCL for all (the log and /v1/status say which). auto: fused at
# tensor_parallel_size 2 on cuda (1.71x TP=1's decode throughput against NCCL's 1.57x, BENCHMARKS.md figure 26.1),
# nccl elsewhere.
ALL_REDUCES = ("auto", "nccl", "fused")
# The base model's projection weights (daemon/model/quantization.py): auto, as the checkpoint holds them (an FP8
# checkpoint's scales read as they are, else the model dtype); fp8, FP8 E4M3 (a bf16/fp16 checkpoint quantized at
# load, per output channel); none, the model dtype (an FP8 checkpoint is refused). GPUs need compute capability 8.9.
QUANTIZATIONS = ("auto", "fp8", "none")
# What the KV pages hold: auto, the model dtype; fp8, E4M3 with a scale per layer for K and V (twice the tokens
# of a bf16 page).
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF checkpoint directory; None with demo=True
    demo: bool = False  # serve the built-in tiny random Llama and its adapters
    model_config: str | None = None  # a known shape instead of --model (benchmarks): llama-2-7b, llama-2-13b, llama-3-8b, tiny-llama
    dummy_weights: bool = False  # with model_config: random base weights drawn on the device
    dummy_adapters: int = 0  # register this many random adapters held in host memory only (benchmarks)
    dummy_adapter_rank: int = 8
    dummy_adapter_targets: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated projections
    adapters: tuple[tuple[str, str], ...] = ()  # (name, directory) pairs
    adapter_dirs: tuple[str, ...] = ()  # every subdirectory holding an adapter is registered by its name
    adapter_roots: tuple[str, ...] = ()  # where POST /v1/load_lora_adapter may read from (none: API loads refused)
    state_dir: str | None = None  # adapters registered through the API are remembered here across restarts
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype on cuda, float32 on the cpu
    max_lora_rank: int = 256
    max_running_requests: int | None = None  # None: from the KV cache's capacity (scheduler/batching.py default_max_running)
    max_batch_tokens: int = 2048  # tokens (prefill + decode) in one step
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings, capped at 8192
    max_waiting_requests: int = 1024  # beyond it new requests are refused (503)
    pool_bytes: int | None = None  # unified page pool; default: 256 MiB on cpu, most of free memory on cuda
    # cuda: the pool's share of the memory free once the weights are loaded (engine.pool_pages), not of the whole GPU
    gpu_memory_utilization: float = 0.85
    # host-memory budget of loaded adapters, and on cuda of their staged pages (LRU beyond it)
    host_adapter_bytes: int = 8 << 30
    seed: int = 0
    # on cuda: decode steps' MBGMV over q,k,v and over gate,up in one launch pair each (where their tiles agree).
    # Measured on the H100 beside one launch pair per projection (bench/engine_decode.py, BENCHMARKS.md): LoRA
    # decode steps of 64 distinct rank-16 adapters 4% shorter, the same tokens.
    fuse_lora_groups: bool = True
    # on cuda (Hopper and later): the decode MBGMV's expand kernel is launched while its shrink still runs and
    # loads its adapter weights before waiting for the shrink (LORA_PDL), with tiles tuned for that. Measured on
    # the H100 beside off (bench/engine_decode.py, BENCHMARKS.md): LoRA decode steps of 64 distinct rank-16
    # adapters 3-4% shorter (0.82-0.83x the base model's throughput -> 0.86x at prompt 512), the same tokens.
    lora_pdl: str = "auto"
    # on cuda (Hopper and later): a decode step's kernels (gpu_ops/launch.py: the norms, RoPE, the KV write, the
    # attention, the FP8 rows quantization and GEMM, MBGMV) are launched early, each while the kernel before it still
    # runs, and wait for it on the device (LORA_PDL's choices; auto: on where supported, with FP8 weights only in
    # one-row steps: runner.DECODE_PDL_FP8_ROWS). On one H200 beside off: bf16 decode steps 0.97-0.99x as long.
    decode_pdl: str = "auto"
    # Greedy decode steps run one ahead of the host (daemon/engine/engine.py, overlapped decode): the next step is
    # launched from the device's sampled tokens before the host reads them, so the host's bookkeeping
    # hides behind the device's work. Off: every step waits for its tokens before the next is launched.
    overlap_decode: bool = True
    # Admission holds KV back for what the running requests are expected to generate (scheduler/batching.py,
    # GrowthReserve), so that a batch does not outgrow the cache and preempt: for a larger max_running_requests.
    # Off (the default; at 256 running it served within 1% of the defaults on the H100, BENCHMARKS.md figure 21.1):
    # a request joins when its prompt's KV is free, as in vLLM, and the newest are preempted (their tokens
    # computed again) when the cache runs short.
    kv_growth_reserve: bool = False
    # KV positions an admission leaves free for each running request and the one joining (scheduler/batching.py,
    # Scheduler._kv_allows): without it a saturated cache preempts its newest request as soon as the batch grows, and
    # that request rejoins as soon as its prompt fits, to be preempted again. 16 (1.5% of the 7B shape's cache at
    # 96 running) took the Azure-conv replay's preemptions from 56 to 2 (BENCHMARKS.md, figure 21.1). 0: none.
    kv_admission_headroom: int = 16
    quantization: str = "auto"  # auto|fp8|none (see QUANTIZATIONS)
    kv_cache_dtype: str = "auto"  # auto|fp8 (see KV_CACHE_DTYPES)
    eager: bool = False  # on cuda: no CUDA graphs for decode steps (slower; for comparison and debugging)
    # cached|ondemand|cpu|auto; None: chosen by the engine at start (see COLD_STARTS), `lorad serve`'s default
    # (SERVE_DEFAULTS). Engines built directly (tests, benchmarks) run ondemand unless told otherwise.
    cold_start: str | None = "ondemand"
    cpu_workers: int = 0  # CPU LoRA worker processes for cold_start cpu|auto; 0: min(4, cores - 1)
    # How an assisted prompt's LoRA is shared among the workers (cpu_lora/partition.py): auto, whichever the
    # costs measured at start-up predict faster; tokens, each worker its own rows (CaraServe's split); groups,
    # every worker all the rows and a chunk of the adapter's columns (needs 2 workers or more).
    cpu_lora_split: str = "auto"
    pinned_host_bytes: int = 4 << 30  # on cuda: adapters staged in pinned host memory, pinned at start-up (LRU beyond it)
    # on cuda: the background threads that read and stage cold adapters (daemon/engine/adapter_residency.py,
    # Stager); 0: min(4, the cores the engine may use)
    stager_threads: int = 0
    # cold_start cpu|auto: the cold adapter of a request that will be cpu-assisted is copied into the pool layer
    # by layer, and its prefill moves each layer from the CPU workers to the GPU kernels as soon as that layer
    # has arrived (a gpu-wait cold start is copied whole, as under ondemand). On cuda with auto it also allows
    # gpu-stream: the prefill launched at once, each layer's LoRA waiting on the device for its pages. Measured
    # on the H100 with pageable rank-32 7B adapters (BENCHMARKS.md, figure 5.1): mean TTFT 0.75-0.83x ondemand's.
    layerwise: bool = True
    # `lorad profile`'s performance models, from which each decode step's LoRA kernel (BGMV or MBGMV) is
    # chosen. None: <state_dir or ~/.cache/lorad>/profile-<model>-<device>.json (-tpN.json at tensor_parallel_size
    # N > 1) when it exists (daemon/engine/kernel_choice.py); "off": none, MBGMV always.
    profile_path: str | None = None
    # With profile_path None and no profile at its default path: on cuda at tensor_parallel_size 1 (and max_lora_rank
    # >= 64, the profile's highest rank) the engine measures one before it loads its weights (`lorad profile`'s
    # measurement, daemon/engine/start_profile.py: about 100 s for a 7B shape on an H200), saves it there and loads
    # it. Off for engines built directly (tests, benchmarks); `lorad serve` turns it on (SERVE_DEFAULTS).
    profile_at_start: bool = False
    # The decode steps' LoRA kernel: auto (the profile's models choose per step; MBGMV without a profile), or
    # bgmv / mbgmv for every step (to compare, or to serve as CaraServe's and Punica's engines do).
    lora_kernel: str = "auto"
    admission: str = "fcfs"  # fcfs|early-abort|cluster (see ADMISSIONS)
    slo_ttft_ms: float = 0.0  # time-to-first-token objective (0: none); early-abort needs one
    slo_tpot_ms: float = 0.0  # time-per-output-token objective (0: none); with a profile, no request joins a batch whose step would break it
    cluster_max_adapters: int = 0  # distinct adapters in the running batch: cluster needs >= 1, early-abort may add it
    # One engine process per GPU, the model's heads and MLP columns split among them (daemon/model/tensor_parallel.py,
    # daemon/engine/tp_worker.py): NCCL on cuda (GPUs cuda:0..N-1), gloo on the cpu (tests). The size must divide the
    # attention heads and the intermediate size, and divide or be a multiple of the KV heads (replicated then).
    tensor_parallel_size: int = 1
    all_reduce: str = "auto"  # auto|nccl|fused (see ALL_REDUCES)

    def __post_init__(self):
        # Values that come from the user (CLI, TOML) are checked here, once.
        from lorad.errors import BadRequest

        if self.dtype not in DTYPE_CHOICES:
            raise BadRequest(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, not {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise BadRequest(f"device must be one of {', '.join(DEVICES)} or cuda:N, not {self.device!r}")
        if not 1 <= self.max_lora_rank <= 1024:
            raise BadRequest(f"max_lora_rank must be in 1..1024, not {self.max_lora_rank}")
        for name in ("max_running_requests", "max_batch_tokens", "max_waiting_requests", "max_model_len", "pool_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise BadRequest(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("host_adapter_bytes", "dummy_adapters"):
            if getattr(self, name) < 0:
                raise BadRequest(f"{name} must be >= 0, not {getattr(self, name)}")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise BadRequest(f"gpu_memory_utilization must be a share in (0, 1], not {self.gpu_memory_utilization!r}")
        if isinstance(self.kv_admission_headroom, bool) or not isinstance(self.kv_admission_headroom, int) \
                or not 0 <= self.kv_admission_headroom <= 4096:
            raise BadRequest(f"kv_admission_headroom must be an integer in 0..4096, not {self.kv_admission_headroom!r}")
        if self.quantization not in QUANTIZATIONS:
            raise BadRequest(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BadRequest(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.cold_start is not None and self.cold_start not in COLD_STARTS:
            raise BadRequest(f"cold_start must be one of {', '.join(COLD_STARTS)}, not {self.cold_start!r}")
        if self.lora_kernel not in LORA_KERNELS:
            raise BadRequest(f"lora_kernel must be one of {', '.join(LORA_KERNELS)}, not {self.lora_kernel!r}")
        if self.lora_pdl not in LORA_PDL:
            raise BadRequest(f"lora_pdl must be one of {', '.join(LORA_PDL)}, not {self.lora_pdl!r}")
        if self.decode_pdl not in LORA_PDL:
            raise BadRequest(f"decode_pdl must be one of {', '.join(LORA_PDL)}, not {self.decode_pdl!r}")
        if self.cpu_lora_split not in CPU_LORA_SPLITS:
            raise BadRequest(f"cpu_lora_split must be one of {', '.join(CPU_LORA_SPLITS)}, not {self.cpu_lora_split!r}")
        if isinstance(self.cpu_workers, bool) or not isinstance(self.cpu_workers, int) or not 0 <= self.cpu_workers <= 256:
            raise BadRequest(f"cpu_workers must be an integer in 0..256 (0: min(4, cores - 1)), not {self.cpu_workers!r}")
        if self.pinned_host_bytes < 0:
            raise BadRequest(f"pinned_host_bytes must be >= 0, not {self.pinned_host_bytes}")
        if isinstance(self.stager_threads, bool) or not isinstance(self.stager_threads, int) or not 0 <= self.stager_threads <= 64:
            raise BadRequest(f"stager_threads must be an integer in 0..64 (0: min(4, cores)), not {self.stager_threads!r}")
        if self.admission not in ADMISSIONS:
            raise BadRequest(f"admission must be one of {', '.join(ADMISSIONS)}, not {self.admission!r}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise BadRequest(f"{name} must be a number of milliseconds >= 0 (0: no objective), not {value!r}")
        if isinstance(self.cluster_max_adapters, bool) or not isinstance(self.cluster_max_adapters, int) \
                or self.cluster_max_adapters < 0:
            raise BadRequest(f"cluster_max_adapters must be an integer >= 0, not {self.cluster_max_adapters!r}")
        if self.admission == "early-abort" and self.slo_ttft_ms <= 0:
            raise BadRequest("admission early-abort drops requests that cannot meet the TTFT objective: "
                             "give it one with slo_ttft_ms > 0 (--slo-ttft-ms)")
        if self.admission == "cluster" and self.cluster_max_adapters < 1:
            raise BadRequest("admission cluster needs cluster_max_adapters >= 1 (--cluster-max-adapters)")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise BadRequest(f"tensor_parallel_size must be an integer in 1..{MAX_TENSOR_PARALLEL_SIZE}, "
                             f"not {self.tensor_parallel_size!r}")
        if self.all_reduce not in ALL_REDUCES:
            raise BadRequest(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, not {self.all_reduce!r}")
        if self.tensor_parallel_size > 1 and self.cold_start in ("cpu", "auto"):
            raise BadRequest(f"cold_start {self.cold_start} does not run with tensor_parallel_size > 1 (the CPU workers "
                             "compute whole-model LoRA, the ranks hold shards): use cold_start ondemand or cached")
        if self.admission == "fcfs" and self.cluster_max_adapters:
            raise BadRequest("cluster_max_adapters goes with admission cluster or early-abort, not fcfs")


# `lorad serve`'s defaults where they differ from an engine built directly: under config.py's own, beneath the config
# file and the flags (daemon/server/settings.py). The daemon measures its kernel profile on a first start and runs
# the cold-start mode chosen for its device; an engine built directly in a test or a benchmark does neither, so that
# it starts in a second and starts no CPU workers it was not asked for.
SERVE_DEFAULTS = {"profile_at_start": True, "cold_start": None}


@dataclass(frozen=True)
class ServerConfig:
    socket: str = "/tmp/lorad/lorad.sock"
    socket_mode: int = 0o660
    listen: str = ""  # tcp://HOST:PORT beside the Unix socket ("": none); daemon/server/tcp.py
    api_key: str = ""  # required over TCP (Authorization: Bearer KEY); else LORAD_API_KEY from the environment
    admin_group: str = ""  # its members may load and unload adapters over the socket (and the daemon's user, root)
    admin_api_key: str = ""  # adapter admin over TCP; else LORAD_ADMIN_API_KEY; none: admin is closed to TCP
    max_connections: int = 4096  # client connections at once (socket and TCP); past it: 503 and closed
    max_n: int = 16  # choices per prompt a completion may ask for (n); prompts x n stays at most 256
    header_timeout_s: float = 30.0  # a new connection's first request headers must arrive within this
    keepalive_timeout_s: float = 60.0  # an idle connection between requests is closed after this
    log_level: str = "info"
    shutdown_grace_s: float = 30.0  # on SIGTERM/SIGINT, running requests get this long to finish, then are aborted

    def __post_init__(self):
        from lorad.errors import BadRequest

        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise BadRequest(f"max_connections must be an integer >= 1, not {self.max_connections!r}")
        if isinstance(self.max_n, bool) or not isinstance(self.max_n, int) or not 1 <= self.max_n <= 256:
            raise BadRequest(f"max_n must be an integer from 1 to 256, not {self.max_n!r}")
        for name in ("header_timeout_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise BadRequest(f"{name} must be a number of seconds > 0, not {value!r}")
        mode = self.socket_mode
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise BadRequest(f"socket_mode must be permission bits from 0 to 0o777, not {mode!r}")
        value = self.shutdown_grace_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise BadRequest(f"shutdown_grace_s must be a number of seconds >= 0, not {value!r}")


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
