"""Reading a Hugging Face checkpoint directory: config.json into a ModelSpec, the safetensors
shards into plain tensors by name, tokenizer.json and generation_config.json.

No framework model classes: the runtime owns plain tensors (daemon/model/llama.py).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorad.errors import ModelError

log = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# The seven projections a LoRA adapter may target, in the order lorad keeps them everywhere
# (adapter tables, page-pool layout, kernels index projections by this position).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
        hidden = _field(config, "hidden_size", int)
        heads = _field(config, "num_attention_heads", int)
        max_positions = _field(config, "max_position_embeddings", int, 2048)
        if architecture == "MistralForCausalLM":
            window = config.get("sliding_window")
            if window is not None and int(window) < max_positions:
                raise ModelError(
                    f"sliding_window={window} is smaller than the context ({max_positions}): "
                    "lorad does not implement sliding-window attention"
                )
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and config.get("use_sliding_window"):
            raise ModelError(f"{architecture.removesuffix('ForCausalLM')} with use_sliding_window=true is not supported")
        rope_scaling = _rope_scaling(config)
        rope_theta = (rope_scaling or {}).pop("rope_theta", None) or _field(config, "rope_theta", float, 10000.0)
        eos = (generation_config or {}).get("eos_token_id", config.get("eos_token_id"))
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return cls(
            architecture=architecture,
            vocab_size=_field(config, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_field(config, "intermediate_size", int),
            num_layers=_field(config, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=_field(config, "num_key_value_heads", int, heads),
            head_dim=_field(config, "head_dim", int, hidden // heads),
            rms_norm_eps=_field(config, "rms_norm_eps", float, 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling or None,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            bos_token_id=(generation_config or {}).get("bos_token_id", config.get("bos_token_id")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


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
    """The rope scaling lorad implements: none (default) or llama3. Anything else is refused.

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
    if rope_type != "llama3":
        raise ModelError(f"rope scaling {rope_type!r} is not supported (lorad implements default and llama3)")
    scaling["rope_type"] = "llama3"
    return scaling


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with llama3 scaling when configured."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
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


def dummy_weights(spec: ModelSpec, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the right names and shapes, drawn on the device (seconds for a 7B model on
    a GPU). Scaled like a trained model's (std ~ 1/sqrt(fan_in)) so activations stay finite."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    h = spec.hidden_size
    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h, std=1.0), "model.norm.weight": ones(h)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = ones(h)
        weights[prefix + "post_attention_layernorm.weight"] = ones(h)
        for projection in PROJECTIONS:
            fan_in, fan_out = spec.projection_shape(projection)
            module = "mlp." if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn."
            weights[prefix + module + projection + ".weight"] = normal(fan_out, fan_in, std=fan_in**-0.5)
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
        raise ModelError(f"model directory {model_dir} does not exist")
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


def load_weights(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by its HF name, cast to dtype, on device."""
    weights = {}
    for path in safetensors_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():
                    weights[name] = shard.get_tensor(name).to(device=device, dtype=dtype)
        except (OSError, RuntimeError, SafetensorError) as error:
            raise ModelError(f"cannot read {path}: {error}") from error
    return weights
