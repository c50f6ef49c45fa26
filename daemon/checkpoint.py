"""Reading a Hugging Face checkpoint directory: config.json into a ModelSpec, the safetensors
shards into plain tensors by name, tokenizer.json and generation_config.json.

No framework model classes: the runtime owns plain tensors (daemon/model.py).
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

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# The seven projections a LoRA adapter may target, in the order lorad keeps them everywhere
# (adapter tables, page-pool layout, kernels index projections by this position).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
        if architecture == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
            raise ModelError("Qwen2 with use_sliding_window=true is not supported")
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
