"""Reading a Hugging Face checkpoint directory: config.json into a ModelSpec, the safetensors
shards into plain tensors by name, tokenizer.json and generation_config.json.

No framework model classes: the runtime owns plain tensors (daemon/model/llama.py).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from lorad.errors import ModelError
from lorad.gpu_ops.rope import rope_cache

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Gemma's decoder (daemon/model/gemma.py). Of Gemma3ForConditionalGeneration lorad serves the text decoder
# alone: its config is `text_config`, its weights lie under a prefix beside a vision tower (TEXT_PREFIXES).
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' Gemma3TextConfig defaults: the hub's Gemma 3 configs leave many fields to them.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "bos_token_id": 2, "eos_token_id": 1,
}
# Gemma3ForConditionalGeneration's text decoder as transformers 4 (`language_model.model.`) and 5
# (`model.language_model.`) save it; the vision tower and projector are not read.
TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}
VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")
# The seven projections a LoRA adapter may target, in the order lorad keeps them everywhere
# (adapter tables, page-pool layout, kernels index projections by this position).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoint holds these fused modules (and adapters trained on it target them): each is its
# members' weights stacked by rows, in this order.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# Shapes of well-known models (from their public config.json), for benchmarks with random weights
# (`--model-config NAME --dummy-weights`): no checkpoint is read.
_LLAMA = {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
MODEL_CONFIGS = {
    "llama-2-7b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                   "max_position_embeddings": 4096, "rope_theta": 10000.0},
    "llama-2-13b": {**_LLAMA, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                    "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
                    "max_position_embeddings": 4096, "rope_theta": 10000.0},
    "llama-3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0, "bos_token_id": 128000,
                   "eos_token_id": 128001},
    # 70B shapes for tensor parallelism (--tensor-parallel-size 2 on two 141 GB GPUs in bf16).
    "llama-2-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
                    "max_position_embeddings": 4096, "rope_theta": 10000.0},
    "llama-3-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                    "max_position_embeddings": 8192, "rope_theta": 500000.0, "bos_token_id": 128000,
                    "eos_token_id": 128001},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
                 "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rope_theta": 1000000.0, "bos_token_id": 151643, "eos_token_id": 151645},
    # The demo's shape: lets the dummy-weights path run in CI.
    "tiny-llama": {**_LLAMA, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                   "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "float32"},
    "tiny-qwen3": {"architectures": ["Qwen3ForCausalLM"], "rms_norm_eps": 1e-6, "torch_dtype": "float32",
                   "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 2048,
                   "rope_theta": 1000000.0, "bos_token_id": 0, "eos_token_id": 1},
    # microsoft/Phi-3-mini-4k-instruct (its 2047-token sliding window caps the served context) and microsoft/phi-4.
    "phi-3-mini": {"architectures": ["Phi3ForCausalLM"], "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
                   "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
                   "original_max_position_embeddings": 4096, "sliding_window": 2047, "rope_theta": 10000.0,
                   "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 32000},
    "phi-4": {"architectures": ["Phi3ForCausalLM"], "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
              "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
              "num_key_value_heads": 10, "vocab_size": 100352, "max_position_embeddings": 16384,
              "original_max_position_embeddings": 16384, "rope_theta": 250000.0, "hidden_act": "silu",
              "bos_token_id": 100257, "eos_token_id": 100265},
    "tiny-phi3": {"architectures": ["Phi3ForCausalLM"], "rms_norm_eps": 1e-5, "torch_dtype": "float32",
                  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                  "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1},
    "gemma-2-9b": {"architectures": ["Gemma2ForCausalLM"], "torch_dtype": "bfloat16", "hidden_size": 3584,
                   "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                   "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1},
    "gemma-3-12b": {"architectures": ["Gemma3ForCausalLM"], "torch_dtype": "bfloat16", "hidden_size": 3840,
                    "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
                    "sliding_window": 1024, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "tiny-gemma2": {"architectures": ["Gemma2ForCausalLM"], "torch_dtype": "float32", "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 2048, "query_pre_attn_scalar": 16,
                    "sliding_window": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                    "bos_token_id": 0, "eos_token_id": 1},
    "tiny-gemma3": {"architectures": ["Gemma3ForCausalLM"], "torch_dtype": "float32", "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 2048, "query_pre_attn_scalar": 32,
                    "sliding_window": 16, "sliding_window_pattern": 3, "bos_token_id": 0, "eos_token_id": 1},
}


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder, read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3: an RMSNorm of each head of q and k (weights [head_dim]) before RoPE
    torch_dtype: str  # as stored; used when --dtype auto on cuda
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint and in its adapters
    sliding_window: int | None = None  # Phi-3: the context served must not exceed it (no sliding-window attention)
    rotary_dim: int | None = None  # Phi-4-mini's partial_rotary_factor: RoPE on the first rotary_dim of each head

    @property
    def rope_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The module names an adapter for this model may target (as PEFT names them)."""
        if self.fused_projections:
            return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        return PROJECTIONS

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a module an adapter targets: a projection, or a fused module
        whose outputs are its members' side by side."""
        members = FUSED_MODULES.get(module)
        if members is None:
            return self.projection_shape(module)
        return self.projection_shape(members[0])[0], sum(self.projection_shape(m)[1] for m in members)
    # Sliding windows and Gemma; the defaults are the Llama family's.
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None for global attention; (): all global
    local_rope_theta: float | None = None  # Gemma 3: the RoPE base of sliding-window layers (unscaled)
    query_pre_attn_scalar: float | None = None  # Gemma: the attention scale is its -1/2 power (head_dim's otherwise)
    attn_logit_softcapping: float | None = None  # Gemma 2: scores capped to softcap * tanh(s / softcap)
    final_logit_softcapping: float | None = None  # Gemma 2: the logits likewise

    @property
    def gemma(self) -> bool:
        return self.architecture in GEMMA

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def page_elems(self) -> int:
        """Elements of a page of the unified pool: hidden_size, S-LoRA's choice (an A row of a projection
        from the hidden state fills one page), where whole K rows fit it; otherwise the smallest multiple
        of kv_size above it (Qwen3-4B: hidden 2560, K rows of 1024 -> 3072; Gemma 2 9B: 3584, 2048 -> 4096),
        so that a KV page holds whole tokens and an A row still fits one page."""
        return -(-self.hidden_size // self.kv_size) * self.kv_size

    def projection_shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection's weight."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[projection]

    @classmethod
    def from_hf_config(cls, config: dict, generation_config: dict | None = None) -> ModelSpec:
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else config.get("model_type", "<none>")
        if architecture not in ARCHITECTURES:
            raise ModelError(
                f"unsupported architecture {architecture!r}: lorad serves {', '.join(ARCHITECTURES)}"
            )
        if architecture == "Gemma3ForConditionalGeneration":
            if not isinstance(config.get("text_config"), dict):
                raise ModelError("config.json: Gemma3ForConditionalGeneration without a text_config")
            config = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **config["text_config"]}
        if architecture in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            config = {**_GEMMA3_TEXT_DEFAULTS, **config}
        hidden = _field(config, "hidden_size", int)
        heads = _field(config, "num_attention_heads", int)
        max_positions = _field(config, "max_position_embeddings", int, 2048)
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and config.get("use_sliding_window"):
            raise ModelError(f"{architecture.removesuffix('ForCausalLM')} with use_sliding_window=true is not supported")
        layers = _field(config, "num_hidden_layers", int)
        windows = _layer_windows(architecture, config, layers, max_positions)
        gemma = architecture in GEMMA
        phi3 = architecture == "Phi3ForCausalLM"
        if phi3 and config.get("hidden_act", "silu") != "silu":
            raise ModelError(f"config.json: hidden_act={config['hidden_act']!r}: lorad's Phi3ForCausalLM runs silu only")
        local_rope_theta = None
        rope_parameters = config.get("rope_parameters") or {}
        if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:
            # Gemma 3 as transformers 5 writes it: the global layers' RoPE (scaled) and the local layers' base.
            local_rope_theta = float((rope_parameters.get("sliding_attention") or {}).get("rope_theta", 10000.0))
            config = {**config, "rope_parameters": rope_parameters.get("full_attention")}
        elif architecture in ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"):
            local_rope_theta = _field(config, "rope_local_base_freq", float)
        head_dim = _field(config, "head_dim", int, hidden // heads)
        rope_scaling = _rope_scaling(config)
        rope_theta = (rope_scaling or {}).pop("rope_theta", None) or _field(config, "rope_theta", float, 10000.0)
        rotary_dim = _rotary_dim(config, head_dim)
        if (rope_scaling or {}).get("rope_type") == "longrope":
            _check_longrope(rope_scaling, rotary_dim)
        activation = config.get("hidden_activation") or config.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if activation != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ModelError(f"config.json: hidden_activation {activation!r} is not supported for {architecture}")
        eos = (generation_config or {}).get("eos_token_id", config.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(
            architecture=architecture,
            vocab_size=_field(config, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_field(config, "intermediate_size", int),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=_field(config, "num_key_value_heads", int, heads),
            head_dim=head_dim,
            rms_norm_eps=_field(config, "rms_norm_eps", float, 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            bos_token_id=(generation_config or {}).get("bos_token_id", config.get("bos_token_id")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            fused_projections=phi3,
            sliding_window=_field(config, "sliding_window", int) if phi3 and config.get("sliding_window") else None,
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            layer_windows=windows,
            local_rope_theta=local_rope_theta,
            query_pre_attn_scalar=_field(config, "query_pre_attn_scalar", float, 256.0) if gemma else None,
            attn_logit_softcapping=_softcap(config, "attn_logit_softcapping") if gemma else None,
            final_logit_softcapping=_softcap(config, "final_logit_softcapping") if gemma else None,
        )


def within_sliding_window(spec: ModelSpec, max_model_len: int, asked: int | None) -> int:
    """The context served under Phi-3's sliding window, which lorad applies to Mistral and Gemma but not to Phi-3
    (its windows are not in `layer_windows`): a context no longer than the window attends to every earlier token, as
    the window would let it. Without --max-model-len the
    context is capped at the window (logged); a max_model_len above it is refused, naming both."""
    window = spec.sliding_window
    if window is None or max_model_len <= window:
        return max_model_len
    if asked:
        raise ModelError(f"max_model_len={asked} exceeds the model's sliding_window={window}: lorad does not apply "
                         f"the sliding window of {spec.architecture}; serve at most {window} tokens")
    log.info("context capped at the sliding window max_model_len=%d sliding_window=%d architecture=%s "
             "reason=the window is not applied to this architecture", window, window, spec.architecture)
    return window


def _layer_windows(architecture: str, config: dict, layers: int, max_positions: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global). Mistral: every layer's, where the window is below the
    context; Gemma: `layer_types` ("sliding_attention" / "full_attention"), else Gemma 2's alternation (even
    layers local) or Gemma 3's `sliding_window_pattern` (every N-th layer global)."""
    window = config.get("sliding_window")
    if architecture == "MistralForCausalLM":
        if window is None or int(window) >= max_positions:
            return ()
        return (_field(config, "sliding_window", int),) * layers
    if architecture not in GEMMA:
        return ()
    if config.get("use_bidirectional_attention"):
        raise ModelError("config.json: use_bidirectional_attention (an encoder's attention) is not supported")
    window = _field(config, "sliding_window", int)
    types = config.get("layer_types")
    if types is None:
        pattern = 2 if architecture == "Gemma2ForCausalLM" else _field(config, "sliding_window_pattern", int)
        types = ["sliding_attention" if (layer + 1) % pattern else "full_attention" for layer in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelError(f"config.json: layer_types must give each of the {layers} layers sliding_attention or "
                         f"full_attention, got {types!r}")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _softcap(config: dict, name: str) -> float | None:
    return None if config.get(name) is None else _field(config, name, float)


def _field(config: dict, name: str, kind, default=None):
    """A positive number from config.json; a missing (without default) or bad one is a ModelError naming it."""
    value = config.get(name)
    if value is None:
        if default is None:
            raise ModelError(f"config.json has no {name}")
        return default
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ModelError(f"config.json: {name} must be a number, not {value!r}") from None
    if isinstance(value, bool) or number <= 0:
        raise ModelError(f"config.json: {name} must be positive, not {value!r}")
    return number


def _rope_scaling(config: dict) -> dict | None:
    """The rope scaling lorad implements: none (default), linear (Gemma 3's global layers), llama3, or Phi-3's longrope
    (also written "su").
    Anything else is refused.

    transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x writes `rope_scaling`.
    """
    scaling = config.get("rope_parameters") or config.get("rope_scaling")
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        theta = scaling.get("rope_theta")
        return {"rope_theta": theta} if theta is not None else None
    if rope_type in ("longrope", "su") and "Phi3ForCausalLM" in (config.get("architectures") or []):
        scaling["rope_type"] = "longrope"
        # Phi-3 keeps its pretraining context beside rope_scaling, and transformers' Phi3Config prefers that
        # copy (4096 when absent) to one inside the scaling.
        scaling["original_max_position_embeddings"] = config.get("original_max_position_embeddings", 4096)
        return scaling
    if rope_type not in ("llama3", "linear"):
        raise ModelError(f"rope scaling {rope_type!r} is not supported (lorad implements default, linear, llama3, and "
                         "longrope for Phi3ForCausalLM)")
    scaling["rope_type"] = rope_type
    return scaling


def _rotary_dim(config: dict, head_dim: int) -> int:
    """How many dimensions of each head RoPE rotates: head_dim, or Phi-3's partial_rotary_factor of it (Phi-4-mini:
    0.75), read from the rope parameters first, then config.json's top level, as transformers reads it."""
    if "Phi3ForCausalLM" not in (config.get("architectures") or []):
        return head_dim
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = parameters.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not _is_number(factor) or not 0 < factor <= 1:
        raise ModelError(f"config.json: partial_rotary_factor must be in (0, 1], not {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ModelError(f"config.json: partial_rotary_factor={factor} rotates {rotary_dim} of {head_dim} dimensions "
                         "of a head; RoPE needs an even number")
    return rotary_dim


def _check_longrope(scaling: dict, rotary_dim: int) -> None:
    original = scaling["original_max_position_embeddings"]
    if not _is_number(original) or int(original) != original or original < 1:
        raise ModelError(f"config.json: original_max_position_embeddings must be a positive integer, not {original!r}")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2 or not all(
                _is_number(f) and f > 0 for f in factors):
            raise ModelError(f"config.json: longrope {key} must be a list of {rotary_dim // 2} positive numbers "
                             f"(half the rotary dimensions), not {factors!r}")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and (not _is_number(value) or value <= 0):
            raise ModelError(f"config.json: longrope {key} must be a positive number, not {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rope_inv_freq(spec: ModelSpec, long: bool = False, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rope_dim // 2] in float32, with linear or llama3 scaling when configured; with longrope,
    divided by the short factors (by the long ones with long=True). local: those of Gemma 3's sliding-window layers
    (base local_rope_theta, never scaled)."""
    dim = spec.rope_dim
    theta = spec.local_rope_theta if local else spec.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = None if local else spec.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is not None and scaling.get("rope_type") == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling is None or scaling.get("rope_type") != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def longrope_split(spec: ModelSpec) -> int | None:
    """With longrope, the pretraining context (original_max_position_embeddings) beyond which the long factors
    apply; None for any other RoPE."""
    scaling = spec.rope_scaling
    if scaling is None or scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def rope_attention_factor(spec: ModelSpec) -> float:
    """What longrope multiplies cos and sin by (for short and long factors alike): attention_factor, else
    sqrt(1 + ln(factor) / ln(original context)) where factor (max_position_embeddings over the original context
    unless given) exceeds 1; 1 for any other RoPE."""
    split = longrope_split(spec)
    if split is None:
        return 1.0
    if spec.rope_scaling.get("attention_factor") is not None:
        return float(spec.rope_scaling["attention_factor"])
    factor = spec.rope_scaling.get("factor") or spec.max_position_embeddings / split
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(split))


def rope_tables(spec: ModelSpec, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, rope_dim]: row p rotates position p. With longrope (original context S below max_positions):
    rows p < S hold the short factors, rows S <= p < max_positions the long ones, and rows max_positions + p
    (p < S) position p with the long factors, for the sequences longer than S (`rope_rows`). Scaled by the
    attention factor in float32, then cast once."""
    split = longrope_split(spec)
    if split is None or max_positions <= split:
        cos, sin = rope_cache(rope_inv_freq(spec), max_positions, torch.float32, "cpu")
    else:
        short_cos, short_sin = rope_cache(rope_inv_freq(spec), split, torch.float32, "cpu")
        long_cos, long_sin = rope_cache(rope_inv_freq(spec, long=True), max_positions, torch.float32, "cpu")
        cos = torch.cat((short_cos, long_cos[split:], long_cos[:split]))
        sin = torch.cat((short_sin, long_sin[split:], long_sin[:split]))
    scale = rope_attention_factor(spec)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def longrope_switch(spec: ModelSpec, max_positions: int) -> int | None:
    """The sequence length S past which longrope's long factors apply, where a served sequence can exceed it."""
    split = longrope_split(spec)
    return split if split is not None and max_positions > split else None


def rope_rows(spec: ModelSpec, max_positions: int, positions: np.ndarray, counts: np.ndarray,
              lengths: Iterable[int]) -> np.ndarray:
    """The row of `rope_tables` each token reads: its position, except in a sequence longer than S (longrope),
    whose tokens at positions below S read position p with the long factors.

    transformers' Phi-3 rotates a sequence of at most S tokens with the short factors and a longer one with the
    long factors throughout: its generate drops the KV cache at the step that reaches S + 1 tokens and computes
    the whole sequence again. lorad does the same (the engine recomputes a sequence's cache once it reaches
    S + 1 tokens: Engine._take_token), decided per sequence, so a batch mixing short and long sequences gives
    each what it would get alone. A decode row at position p of a sequence of p + 1 tokens reads row p either
    way: decode graphs pass positions as they are. positions: int64 [rows]; counts: rows per sequence; lengths:
    each sequence's tokens so far (prompt and generated; read only with longrope)."""
    split = longrope_switch(spec, max_positions)
    if split is None:
        return positions
    long_sequence = np.repeat(np.fromiter(lengths, dtype=np.int64, count=len(counts)) > split, counts)
    return np.where(long_sequence & (positions < split), positions + max_positions, positions)


def dummy_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the right names and shapes, drawn on the device (seconds for a 7B model on
    a GPU). Scaled like a trained model's (std ~ 1/sqrt(fan_in)) so activations stay finite."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(size: int) -> torch.Tensor:  # a norm's identity weight: Gemma's norms scale by (1 + w)
        return torch.full((size,), 0.0 if spec.gemma else 1.0, device=device, dtype=dtype)

    h = spec.hidden_size
    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h, std=1.0), "model.norm.weight": ones(h)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = ones(h)
        weights[prefix + "post_attention_layernorm.weight"] = ones(h)
        if spec.gemma:
            weights[prefix + "pre_feedforward_layernorm.weight"] = ones(h)
            weights[prefix + "post_feedforward_layernorm.weight"] = ones(h)
        modules = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if spec.fused_projections else PROJECTIONS
        for module in modules:
            fan_in, fan_out = spec.module_shape(module)
            parent = "mlp." if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn."
            weights[prefix + parent + module + ".weight"] = normal(fan_out, fan_in, std=fan_in**-0.5)
        if spec.qkv_bias:
            for projection in ("q_proj", "k_proj", "v_proj"):
                weights[prefix + f"self_attn.{projection}.bias"] = normal(spec.projection_shape(projection)[1], std=0.02)
        if spec.qk_norm:
            weights[prefix + "self_attn.q_norm.weight"] = ones(spec.head_dim)
            weights[prefix + "self_attn.k_norm.weight"] = ones(spec.head_dim)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(spec.vocab_size, h, std=h**-0.5)
    return weights


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ModelError(f"{path} not found") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelError(f"{path} is not valid JSON: {error}") from error


def load_spec(model_dir: str | Path) -> ModelSpec:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        why = "is not a directory" if model_dir.exists() else "does not exist"
        raise ModelError(f"model directory {model_dir} {why}")
    generation = model_dir / "generation_config.json"
    return ModelSpec.from_hf_config(
        read_json(model_dir / "config.json"), read_json(generation) if generation.exists() else None
    )


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors in {model_dir} (pickled checkpoints are not loaded)")
    return files


def text_decoder_name(name: str) -> str | None:
    """A tensor's name in a text-only checkpoint (TEXT_PREFIXES); None for a vision tower's (not read)."""
    if name.startswith(VISION_PREFIXES):
        return None
    for prefix, text_prefix in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return text_prefix + name.removeprefix(prefix)
    return name


def load_weights(model_dir: str | Path, dtype: torch.dtype, device: torch.device, cast=None) -> dict[str, torch.Tensor]:
    """Every tensor of the text decoder by its HF name in a text-only checkpoint, cast to dtype, on device.
    cast(path, name, tensor) -> tensor on device: in place of that cast (an FP8 checkpoint's, quantization.py)."""
    weights = {}
    for path in safetensors_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():
                    text_name = text_decoder_name(name)
                    if text_name is not None:
                        tensor = shard.get_tensor(name)
                        weights[text_name] = (tensor.to(device=device, dtype=dtype) if cast is None
                                              else cast(path, text_name, tensor))
        except (OSError, RuntimeError, SafetensorError) as error:
            raise ModelError(f"cannot read {path}: {error}") from error
    return weights
