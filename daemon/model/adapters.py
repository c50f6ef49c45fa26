"""Host adapters: a PEFT LoRA adapter directory read into plain float32 tensors, and the registry
that maps names to directories, loads an adapter on first use and keeps loaded ones in host memory
under a byte budget (least recently used leave first).

Only safetensors are read: pickled files (.bin, .pt) are refused, never opened.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorad.daemon.model.checkpoint import FUSED_MODULES, PROJECTIONS, ModelSpec
from lorad.errors import AdapterError, NotFound, clip

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")

# The submodule of a decoder layer that holds each projection.
PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "qkv_proj": "self_attn",  # Phi-3's fused modules (checkpoint.FUSED_MODULES)
    "gate_up_proj": "mlp",
}
# PEFT saves `base_model.model.` + the module's name in the base model + `.lora_A.weight`:
# `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` for a LlamaForCausalLM (`layers.3...`
# for a bare LlamaModel). Some saves keep the adapter's name (`lora_A.default.weight`), some tools drop
# the `base_model.model.` prefix. `module` is the name rank_pattern and alpha_pattern are matched against.
# Gemma3ForConditionalGeneration's text decoder is `model.language_model.` (transformers 5) or
# `language_model.model.` (4).
LORA_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:model\.language_model\.|language_model\.model\.|model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z0-9_]+)"
    r"\.(?P<projection>[A-Za-z0-9_]+))\.lora_(?P<factor>[AB])(?:\.(?P<adapter>[A-Za-z0-9_-]+))?\.weight$"
)
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# Initialisations that rewrite the base weights: the saved adapter only fits that modified base
# unless it was converted at save time (PEFT then records init_lora_weights=true).
BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
# LoraConfig keys that change what the adapter computes beyond y += scaling * B A x.
UNSUPPORTED_VARIANTS = {
    "use_dora": "DoRA (use_dora: true) adds a magnitude vector lorad does not apply",
    "lora_bias": "lora_bias: true gives lora_B a bias lorad does not apply",
    "fan_in_fan_out": "fan_in_fan_out: true stores transposed weights of Conv1D layers, not Llama's linear layers",
    "use_qalora": "QA-LoRA (use_qalora: true) pools the input of quantized layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies only after its invocation tokens",
    "layer_replication": "layer_replication changes the base model's layer stack",
    "trainable_token_indices": "trainable_token_indices retrains rows of the embeddings",
    "target_parameters": "target_parameters puts LoRA on raw parameters, not on the seven projections",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) rewrites the base weights",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}


class _Refusal(Exception):
    """Why an adapter cannot be served; load_peft_adapter turns it into an AdapterError naming it."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter in host memory, ready for the page pool.

    weights[(layer, projection index into PROJECTIONS)] = (A [r, in] float32, B [out, r] float32 with
    the LoRA scaling folded in), both contiguous; r may differ per module (PEFT's rank_pattern).

    A module fused in the checkpoint (Phi-3's qkv_proj, gate_up_proj) is held as its member projections: one
    A tensor shared by all of them (the same object), B cut by rows into each member's outputs. The page pool
    and the shared-memory store lay a shared A out once.
    """

    name: str
    path: str
    rank: int  # max over modules
    targets: tuple[str, ...]  # projection names, in PROJECTIONS order
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    scaling: dict[tuple[int, int], float]  # per module, already folded into B; kept for logs
    # the directory's files when they were read (name, inode, size, mtime, ctime each); None: made in memory. A
    # tensor-parallel worker reads its own slices of them and must find what rank 0 read.
    source: tuple | None = None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "rank": self.rank,
            "targets": list(self.targets),
            "nbytes": self.nbytes,
        }


MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
MAX_WEIGHTS_BYTES = 16 << 30
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is refused by safetensors itself


def load_peft_adapter(path: str | Path, spec: ModelSpec, max_rank: int, name: str | None = None,
                      root: Path | None = None, max_bytes: int = MAX_WEIGHTS_BYTES) -> LoraAdapter:
    """Read and validate a PEFT LoRA adapter directory for a base model of shape `spec`.

    root: for an adapter loaded through the API, the adapter root it must stay inside: its files must be
    plain files (no symlinks, opened with O_NOFOLLOW) under it. max_bytes: the weight file's size cap.
    Raises AdapterError, naming the adapter and the reason, for anything lorad cannot serve exactly.
    """
    directory = Path(path)
    name = name or directory.name
    source = _directory_signature(directory)  # before the reads: a file rewritten during them reads as changed
    try:
        weights_path = _adapter_files(directory)
        with _open_confined(directory / CONFIG_FILE, root, MAX_CONFIG_BYTES) as config_file:
            settings = _LoraSettings.from_config(_read_config(Path(config_file)))
        with _open_confined(weights_path, root, max_bytes) as weights_file:
            weights, scaling = _read_weights(Path(weights_file), spec, max_rank, settings)
    except _Refusal as refusal:
        raise AdapterError(f"adapter {name!r} ({directory}): {refusal}") from None
    except OSError as error:  # unreadable directory or file (permissions, I/O)
        raise AdapterError(f"adapter {name!r} ({directory}): cannot read it: {error}") from None
    projections = sorted({projection for _, projection in weights})
    adapter = LoraAdapter(
        name=name,
        path=str(directory),
        rank=max(a.shape[0] for a, _ in weights.values()),
        targets=tuple(PROJECTIONS[p] for p in projections),
        weights=weights,
        nbytes=weights_nbytes(weights),
        scaling=scaling,
        source=source,
    )
    return adapter


@contextlib.contextmanager
def _open_confined(path: Path, root: Path | None, limit: int):
    """The path to read `path` through, checked: at most `limit` bytes; with a root, a plain file (not a
    symlink) that resolves inside it, opened once with O_NOFOLLOW and read through /proc/self/fd, so a file
    swapped after the check is not the one read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if root is not None else 0)  # a FIFO never blocks it
    if root is not None and not path.resolve().is_relative_to(root):
        raise _Refusal(f"{path.name} leads outside the adapter root {root}")
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _Refusal(f"{path.name} is a symlink: adapters loaded through the API are read from plain files") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Refusal(f"{path.name} is not a regular file")
        size = info.st_size
        if size > limit:
            raise _Refusal(f"{path.name} is {size} bytes, more than the {limit} allowed")
        yield f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else str(path)
    finally:
        os.close(fd)


def _adapter_files(directory: Path) -> Path:
    if not directory.exists():
        raise _Refusal("the directory does not exist")
    if not directory.is_dir():
        raise _Refusal("not a directory")
    if not (directory / CONFIG_FILE).is_file():
        raise _Refusal(f"no {CONFIG_FILE} in the directory")
    weights_path = directory / WEIGHTS_FILE
    if weights_path.is_file():
        return weights_path
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise _Refusal(
            f"only pickle files ({', '.join(pickles)}): pickle files are never loaded since they can run code; "
            f"convert the adapter to {WEIGHTS_FILE} (PEFT's save_pretrained writes safetensors by default)"
        )
    raise _Refusal(f"no {WEIGHTS_FILE} in the directory")


def _read_config(config_path: Path) -> dict:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _Refusal(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    except OSError as error:
        raise _Refusal(f"cannot read {CONFIG_FILE}: {error}") from None
    if not isinstance(config, dict):
        raise _Refusal(f"{CONFIG_FILE} must hold a JSON object")
    return config


@dataclass(frozen=True)
class _LoraSettings:
    """The parts of adapter_config.json that decide each module's rank and scaling."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: str | tuple[str, ...] | None = None  # None: not given (every module with weights counts)
    exclude_modules: str | tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict) -> _LoraSettings:
        peft_type = config.get("peft_type")
        if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
            raise _Refusal(f"peft_type is {peft_type!r}: lorad serves LoRA adapters only (peft_type LORA)")
        for key, reason in UNSUPPORTED_VARIANTS.items():
            if config.get(key):
                raise _Refusal(reason)
        if config.get("modules_to_save"):
            raise _Refusal(
                f"modules_to_save={config['modules_to_save']!r} replaces whole modules; "
                "lorad applies only LoRA deltas on the seven projections"
            )
        bias = config.get("bias", "none")
        if bias not in ("none", None):
            raise _Refusal(f"bias={bias!r} trains base-model biases lorad cannot apply (only bias='none')")
        init = config.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower().startswith(BASE_MODIFYING_INITS):
            raise _Refusal(
                f"init_lora_weights={init!r}: the adapter fits a base model rewritten at initialisation; "
                "save it with path_initial_model_for_weight_conversion to get a plain LoRA"
            )
        r = config.get("r", 8)  # PEFT's defaults
        alpha = config.get("lora_alpha", 8)
        use_rslora = config.get("use_rslora", False)
        if not _is_int(r) or r < 1:
            raise _Refusal(f"r={r!r}: the rank must be a positive integer")
        if not _is_number(alpha):
            raise _Refusal(f"lora_alpha={alpha!r} is not a finite number")
        if not isinstance(use_rslora, bool):
            raise _Refusal(f"use_rslora={use_rslora!r} is not a boolean")
        rank_pattern = _pattern(config, "rank_pattern", lambda v: _is_int(v) and v >= 1, "a positive integer")
        alpha_pattern = _pattern(config, "alpha_pattern", _is_number, "a finite number")
        return cls(r, float(alpha), use_rslora, rank_pattern, alpha_pattern,
                   _module_names(config, "target_modules"), _module_names(config, "exclude_modules") or ())

    def targets(self, module: str) -> bool:
        """Whether PEFT puts LoRA on `module` (e.g. `model.layers.0.self_attn.q_proj`) under target_modules and
        exclude_modules, as peft.tuners.tuners_utils.check_target_module_exists does: a string is a regex the
        whole name must match; a list names modules by their last dotted parts; "all-linear" takes every
        projection."""
        if _names_module(self.exclude_modules, module):
            return False
        if self.target_modules is None or self.target_modules == "all-linear":
            return True
        return _names_module(self.target_modules, module)

    def rank_and_scaling(self, module: str) -> tuple[int, float]:
        """The configured rank and scaling of one module, e.g. `model.layers.0.self_attn.q_proj`.

        As PEFT's LoraModel: the first pattern key (in file order) whose regex matches the end of the
        module name at a dot boundary wins; the global r / lora_alpha otherwise.
        """
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)


def _module_names(config: dict, key: str) -> str | tuple[str, ...] | None:
    """target_modules or exclude_modules: a regex string, a list of module names, or None when not given."""
    names = config.get(key)
    if names is None:
        return None
    if isinstance(names, str) and names.lower() == "all-linear":
        return "all-linear"
    if isinstance(names, str):
        try:
            re.compile(names)
        except re.error as error:
            raise _Refusal(f"{key} {names!r} is not a valid regular expression: {error}") from None
        return names
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise _Refusal(f"{key} must be a list of module names or a regular expression, not {names!r}")
    return tuple(names)


def _names_module(names: str | tuple[str, ...], module: str) -> bool:
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return any(module == name or module.endswith("." + name) for name in names)


def _pattern(config: dict, key: str, valid, expected: str) -> dict:
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise _Refusal(f"{key} must be an object mapping module patterns to values")
    for pattern, value in patterns.items():
        if not valid(value):
            raise _Refusal(f"{key}[{pattern!r}]={value!r} is not {expected}")
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as error:
            raise _Refusal(f"{key} key {pattern!r} is not a valid regular expression: {error}") from None
    return patterns


def _pattern_key(patterns: dict, module: str) -> str:
    # peft.utils.other.get_pattern_key: the key may be a regex; it must match a dotted suffix.
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_weights(
    weights_path: Path, spec: ModelSpec, max_rank: int, settings: _LoraSettings
) -> tuple[dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], dict[tuple[int, int], float]]:
    weights, scaling = {}, {}
    try:
        with safe_open(str(weights_path), framework="pt") as file:
            pairs = _lora_pairs(list(file.keys()), spec)
            # Shapes and dtypes come from the header: refuse before reading any data.
            for (_, target), (module, a_name, b_name) in pairs.items():
                if not settings.targets(module):
                    raise _Refusal(f"tensor {a_name} puts LoRA on {module}, which target_modules="
                                   f"{_shown(settings.target_modules)} (exclude_modules="
                                   f"{_shown(settings.exclude_modules)}) does not take: PEFT would not apply it; "
                                   "the config and the weights disagree")
                _check_shapes(file, module, target, a_name, b_name, spec, max_rank, settings)
            for (layer, target), (module, a_name, b_name) in sorted(pairs.items()):
                _, module_scaling = settings.rank_and_scaling(module)
                # get_tensor maps the file: copy, so a later rewrite on disk cannot reach a loaded adapter.
                a = file.get_tensor(a_name).to(torch.float32, copy=True).contiguous()
                b = file.get_tensor(b_name).to(torch.float32, copy=True).contiguous()
                b.mul_(module_scaling)  # in place: no second float32 copy of B
                for factor_name, tensor in ((a_name, a), (b_name, b)):
                    if not _all_finite(tensor):
                        raise _Refusal(f"{factor_name} holds NaN or Inf values")
                for projection, b_rows in module_members(spec, target, b):
                    weights[(layer, projection)] = (a, b_rows)
                    scaling[(layer, projection)] = module_scaling
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise _Refusal(f"{WEIGHTS_FILE} is corrupt or truncated: {error}") from None
    return weights, scaling


def _shown(names: str | tuple[str, ...] | None):
    return list(names) if isinstance(names, tuple) else names


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf in `tensor`: its least and greatest values are finite (a NaN propagates to both). One pass and
    no mask, where isfinite().all() writes a bool per element: that check was 60% of reading a rank-64 7B adapter."""
    if tensor.numel() == 0:
        return True
    least, greatest = torch.aminmax(tensor)
    return bool(torch.isfinite(least) & torch.isfinite(greatest))


def module_members(spec: ModelSpec, target: str, b: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(projection index, its rows of B) for a targeted module: itself, or the members of a fused one.

    A fused module's LoRA, x A^T B^T with B = [B_q; B_k; B_v], is exactly x A^T B_q^T beside x A^T B_k^T and
    x A^T B_v^T: served as its members with A shared, it needs no kernel of its own, and its rows in the fused
    GEMM's output are where lorad's q, k, v (gate, up) already lie. Against a kernel projection whose out-dim is
    the sum, the decode kernels issue the shrink once per member (A read 3 times for qkv_proj, 2 for
    gate_up_proj): for Phi-3-mini at rank r, 58,368 r elements a layer instead of 49,152 r (+19%; Phi-4 +18%).
    The pool stores A once and points the members at the same pages, so those repeated reads are of the same
    bytes, back to back (one launch for the group with fuse_groups), where L2 should serve them rather than HBM
    (A of 64 rank-16 Phi-3-mini adapters is 6 MB a layer; an H100's L2 is 50 MB): bench/fused_lora_decode.py
    times the shared A against copies of it. Left over: the members' shrink FLOPs, small in a memory-bound
    kernel, and B padded to whole pages per member in the pool."""
    members = FUSED_MODULES.get(target)
    if members is None:
        return [(PROJECTIONS.index(target), b)]
    sizes = [spec.projection_shape(member)[1] for member in members]
    return [(PROJECTIONS.index(member), rows) for member, rows in zip(members, b.split(sizes))]


def weights_nbytes(weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Host bytes of an adapter's tensors, a shared A counted once."""
    tensors = {id(t): t for pair in weights.values() for t in pair}
    return sum(t.nbytes for t in tensors.values())


def _lora_pairs(names: list[str], spec: ModelSpec) -> dict[tuple[int, str], tuple[str, str, str]]:
    """(layer, targeted module) -> (module name, A name, B name) for every tensor; refuse any other tensor."""
    factors: dict[tuple[int, str], dict[str, str]] = {}
    modules: dict[tuple[int, str], str] = {}
    for name in names:
        match = LORA_TENSOR.match(name)
        if match is None:
            raise _Refusal(_foreign_tensor_reason(name, spec))
        layer, parent, projection = int(match["layer"]), match["parent"], match["projection"]
        if PARENTS.get(projection) != parent or projection not in spec.lora_modules:
            kind = "the seven projections" if not spec.fused_projections else f"{spec.architecture}'s projections"
            raise _Refusal(
                f"tensor {name} puts LoRA on {parent}.{projection}, which is not one of {kind} "
                f"({', '.join(spec.lora_modules)})"
            )
        if layer >= spec.num_layers:
            raise _Refusal(f"tensor {name} is for layer {layer} but the base model has {spec.num_layers} layers")
        key = (layer, projection)
        factor = "lora_" + match["factor"]
        if factor in factors.setdefault(key, {}):
            raise _Refusal(
                f"two {factor} tensors for {match['module']} ({factors[key][factor]}, {name}): one adapter per file"
            )
        factors[key][factor] = name
        modules.setdefault(key, match["module"])
    if not factors:
        raise _Refusal(f"{WEIGHTS_FILE} holds no LoRA tensors")
    pairs = {}
    for key, found in factors.items():
        missing = {"lora_A", "lora_B"} - found.keys()
        if missing:
            (present,) = found.values()
            raise _Refusal(f"{present} has no matching {missing.pop()} tensor")
        pairs[key] = (modules[key], found["lora_A"], found["lora_B"])
    return pairs


def _foreign_tensor_reason(name: str, spec: ModelSpec) -> str:
    if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
        return f"tensor {name} is LoRA on the embeddings or lm_head; lorad applies LoRA to the seven projections only"
    if "vision_tower" in name or "multi_modal_projector" in name:
        return f"tensor {name} is LoRA on the vision tower; lorad serves Gemma 3's language model only"
    if "lora_magnitude_vector" in name:
        return f"tensor {name} is a DoRA magnitude vector; DoRA is not supported"
    if re.search(r"\.lora_B(\.[^.]+)?\.bias$", name):
        return f"tensor {name} is a bias of lora_B (lora_bias); it is not supported"
    return (
        f"tensor {name} is not a LoRA weight lorad can apply (only lora_A/lora_B of "
        f"model.layers.N.{{self_attn,mlp}}.{{{','.join(spec.lora_modules)}}})"
    )


def _check_shapes(file, module, target, a_name, b_name, spec, max_rank, settings) -> None:
    for name in (a_name, b_name):
        dtype = file.get_slice(name).get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise _Refusal(f"tensor {name} has dtype {dtype}; LoRA weights must be float16, bfloat16 or float32")
    a_shape = list(file.get_slice(a_name).get_shape())
    b_shape = list(file.get_slice(b_name).get_shape())
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise _Refusal(f"{a_name} is {a_shape} and {b_name} is {b_shape}: both must be matrices")
    in_features, out_features = spec.module_shape(target)
    rank = a_shape[0]
    if rank < 1:
        raise _Refusal(f"{a_name} has rank {rank}; the rank must be at least 1")
    if rank > max_rank:
        raise _Refusal(f"{a_name} has rank {rank}, above max_lora_rank={max_rank} (raise --max-lora-rank)")
    if a_shape[1] != in_features:
        raise _Refusal(
            f"{a_name} is {a_shape} but the base model's {target} takes {in_features} inputs: "
            "the adapter was trained for a different base model"
        )
    if b_shape[0] != out_features:
        raise _Refusal(
            f"{b_name} is {b_shape} but the base model's {target} has {out_features} outputs: "
            "the adapter was trained for a different base model"
        )
    if b_shape[1] != rank:
        raise _Refusal(f"{a_name} is {a_shape} but {b_name} is {b_shape}: their ranks differ")
    configured_rank, _ = settings.rank_and_scaling(module)
    if configured_rank != rank:
        # The scaling is alpha over the configured rank; a disagreement means the config is not this file's.
        raise _Refusal(f"{module} has rank {rank} in {WEIGHTS_FILE} but {configured_rank} in {CONFIG_FILE}")


@dataclass(eq=False)
class _Entry:
    name: str
    path: Path
    adapter: LoraAdapter | None = None
    root: Path | None = None  # the adapter root its files must stay inside (loaded through the API)
    # Serialises loads of this adapter so two threads asking at once read the disk once.
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    # (directory signature, message) of the last failed load: retried only once the files change.
    failure: tuple[tuple, str] | None = None


class AdapterRegistry:
    """Adapter names -> directories; adapters are read on first use and kept in host memory while the
    loaded ones fit in `host_bytes_budget` (the least recently used leave first, never the one just
    loaded). Called from the engine and API threads."""

    def __init__(self, spec: ModelSpec, max_rank: int, host_bytes_budget: int, reserved_names: Iterable[str] = ()):
        self.spec = spec
        self.max_rank = max_rank
        self.host_bytes_budget = host_bytes_budget
        self.reserved_names = frozenset(reserved_names)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # a load waits here for another's reservation to end
        self._entries: dict[str, _Entry] = {}
        self._loaded: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._host_bytes = 0
        self._reserved = 0  # bytes the loads in progress will add

    def register(self, name: str, path: str | Path, root: Path | None = None) -> None:
        """Add an adapter by name; reads only its directory listing (weights load on first use). root: the
        adapter root its files must stay inside (those loaded through the API)."""
        entry = self._new_entry(name, path)
        entry.root = root
        with self._lock:
            self._add_locked(entry)
        log.info("adapter registered name=%s path=%s", name, entry.path)

    def register_dir(self, root: str | Path) -> list[str]:
        """Register every immediate subdirectory of `root` holding an adapter_config.json, by its name."""
        root = Path(root)
        if not root.is_dir():
            raise AdapterError(f"adapter directory {root} does not exist or is not a directory")
        entries = [
            self._new_entry(child.name, child)
            for child in sorted(root.iterdir())
            if child.is_dir() and not child.name.startswith(".") and (child / CONFIG_FILE).is_file()
        ]
        with self._lock:
            for entry in entries:  # all or none
                self._check_free_locked(entry)
            for entry in entries:
                self._add_locked(entry)
        log.info("adapters registered root=%s count=%d", root, len(entries))
        return [entry.name for entry in entries]

    def unregister(self, name: str) -> None:
        with self._lock:
            entry = self._entry_locked(name)
            del self._entries[name]
            if self._loaded.pop(name, None) is not None:
                self._host_bytes -= entry.adapter.nbytes
        log.info("adapter unregistered name=%s", name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def path(self, name: str) -> Path | None:
        """The directory a registered adapter is read from; None for an unknown name."""
        with self._lock:
            entry = self._entries.get(name)
        return None if entry is None else entry.path

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def host_bytes(self) -> int:
        """Bytes of the adapters kept in host memory now."""
        with self._lock:
            return self._host_bytes

    def get(self, name: str) -> LoraAdapter:
        """The adapter, read from disk on first use. NotFound for unknown names, AdapterError for broken ones."""
        with self._lock:
            entry = self._entry_locked(name)
            if entry.adapter is not None:
                if name in self._loaded:  # in-memory adapters are outside the LRU
                    self._loaded.move_to_end(name)
                return entry.adapter
        # The disk read happens outside the registry lock: other adapters stay served meanwhile.
        with entry.load_lock:
            with self._lock:
                if entry.adapter is not None:  # another thread loaded it while we waited
                    if name in self._loaded:
                        self._loaded.move_to_end(name)
                    return entry.adapter
            signature = _directory_signature(entry.path)
            if entry.failure is not None and entry.failure[0] == signature:
                raise AdapterError(entry.failure[1])
            started = time.perf_counter()
            reserved = self._reserve(host_bytes_of(entry.path / WEIGHTS_FILE))
            try:
                adapter = load_peft_adapter(entry.path, self.spec, self.max_rank, name, root=entry.root)
            except AdapterError as error:
                entry.failure = (signature, error.message)
                log.warning("adapter load failed name=%s reason=%s", name, error.message)
                raise
            finally:
                with self._lock:
                    self._reserved -= reserved
                    self._room.notify_all()
            entry.failure = None
            with self._lock:
                if self._entries.get(name) is entry:  # else unregistered meanwhile: serve it, keep nothing
                    entry.adapter = adapter
                    self._loaded[name] = entry
                    self._host_bytes += adapter.nbytes
                    self._evict_locked(keep=name)
        scalings = ",".join(f"{value:g}" for value in sorted(set(adapter.scaling.values())))
        log.info(
            "adapter loaded name=%s rank=%d targets=%s nbytes=%d scaling=%s seconds=%.3f",
            name,
            adapter.rank,
            ",".join(adapter.targets),
            adapter.nbytes,
            scalings,
            time.perf_counter() - started,
        )
        return adapter

    def on_disk(self, name: str) -> bool:
        """Whether `get(name)` would read the adapter from disk now (False for a name not registered)."""
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and entry.adapter is None

    def describe(self, name: str) -> dict:
        """For /v1/models: name, path, location ("disk" or "host"), and rank/targets/nbytes once loaded."""
        with self._lock:
            entry = self._entry_locked(name)
            adapter, failure = entry.adapter, entry.failure
        if adapter is not None:
            return {**adapter.describe(), "location": "host"}
        info = {"name": name, "path": str(entry.path), "location": "disk"}
        info.update(rank=None, targets=None, nbytes=None)
        if failure is not None:
            info["error"] = failure[1]
        return info

    def _new_entry(self, name: str, path: str | Path) -> _Entry:
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            raise AdapterError(
                f"adapter name {name!r} is invalid: 1 to 128 letters, digits and . _ : / -, "
                "starting with a letter or digit"
            )
        if name in self.reserved_names:
            raise AdapterError(f"adapter name {name!r} is the base model's name")
        directory = Path(path).expanduser().absolute()
        try:
            if not directory.is_dir():
                raise AdapterError(f"adapter {name!r}: {clip(str(directory))} does not exist or is not a directory")
            if not (directory / CONFIG_FILE).is_file():
                raise AdapterError(f"adapter {name!r}: no {CONFIG_FILE} in {clip(str(directory))}")
        except OSError as error:  # a name or path longer than the file system takes, a directory we may not read
            raise AdapterError(f"adapter {name!r}: {clip(str(directory))} does not exist or cannot be read "
                               f"({error.strerror})") from None
        return _Entry(name, directory)

    def _check_free_locked(self, entry: _Entry) -> None:
        existing = self._entries.get(entry.name)
        if existing is not None and existing.path != entry.path:
            raise AdapterError(f"adapter name {entry.name!r} is already registered for {existing.path}")

    def _add_locked(self, entry: _Entry) -> None:
        self._check_free_locked(entry)
        self._entries.setdefault(entry.name, entry)  # the same name and path again is a no-op

    def add_in_memory(self, adapter: LoraAdapter) -> None:
        """Registers an adapter that exists only in host memory (benchmarks' --dummy-adapters). It has
        no files to be read again from, so the LRU budget never drops it."""
        with self._lock:
            if adapter.name in self._entries:
                raise AdapterError(f"adapter {adapter.name!r} is already registered")
            self._entries[adapter.name] = _Entry(adapter.name, Path(adapter.path), adapter)

    def _entry_locked(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"adapter {name!r} is not registered")
        return entry

    def _reserve(self, nbytes: int) -> int:
        """Room for a load of `nbytes` before it reads anything: the least recently used adapters leave host
        memory, and while loads in progress hold what is left, this one waits for them. A load alone may still
        exceed the budget (one adapter larger than it is served, and kept alone)."""
        with self._room:
            while True:
                while self._host_bytes + self._reserved + nbytes > self.host_bytes_budget and self._loaded:
                    self._evict_one_locked()
                if self._host_bytes + self._reserved + nbytes <= self.host_bytes_budget or not self._reserved:
                    break
                self._room.wait()
            self._reserved += nbytes
        return nbytes

    def _evict_one_locked(self) -> None:
        name, entry = self._loaded.popitem(last=False)
        nbytes = entry.adapter.nbytes
        self._host_bytes -= nbytes
        entry.adapter = None
        log.info("adapter evicted from host name=%s nbytes=%d host_bytes=%d", name, nbytes, self._host_bytes)

    def _evict_locked(self, keep: str) -> None:
        while self._host_bytes > self.host_bytes_budget and len(self._loaded) > 1:
            name = next(iter(self._loaded))
            if name == keep:
                self._loaded.move_to_end(name)
                continue
            self._evict_one_locked()


def host_bytes_of(weights_path: Path) -> int:
    """The host bytes an adapter's weights take once loaded (float32), from its safetensors header alone; 0
    when the header cannot be read (the load then says why)."""
    try:
        fd = os.open(weights_path, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return 0
        with os.fdopen(fd, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            if not 0 < length <= MAX_HEADER_BYTES:
                return 0
            header = json.loads(file.read(length))
    except (OSError, ValueError):
        return 0
    elements = sum(math.prod(info.get("shape", ())) for key, info in header.items()
                   if key != "__metadata__" and isinstance(info, dict))
    return 4 * elements


def _directory_signature(directory: Path) -> tuple | None:
    """What changes when any file of the adapter is rewritten or replaced."""
    files = []
    try:
        for item in os.scandir(directory):
            info = item.stat()
            files.append((item.name, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    except OSError:
        return None
    return tuple(sorted(files))
