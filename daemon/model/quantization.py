"""The base model's weights in FP8 (E4M3, gpu_ops/fp8.py) and the FP8 KV cache's scales.

What a checkpoint carries is read from config.json's `quantization_config`. lorad loads two FP8 layouts as they
are: llm-compressor's `compressed-tensors` (format float-quantized or naive-quantized; 8-bit float weights with a
`weight_scale` per tensor or per output channel; activations dynamic, or static with an `input_scale`) and the
older `quant_method: "fp8"` (a `weight_scale`, or `weight_scale_inv`, which despite its name multiplies the
stored values, per tensor or channel; activation_scheme dynamic or static). Any other method or scheme (int8,
int4, AWQ, GPTQ, block-wise FP8...) is refused with a message naming it. A bf16/fp16/fp32 checkpoint (or
`--dummy-weights`) is quantized at load with `--quantization fp8`: per-output-channel scales. Either way the
seven projections become `Fp8Weight`s; the embeddings, norms and LM head stay in the model dtype, as do the
adapters (their LoRA is added to the FP8 GEMM's output).

The FP8 KV cache has one scale per layer for K and one for V (stored = value / scale): the checkpoint's
`self_attn.k_scale`/`v_scale` (or `k_proj.output_scale`/`v_proj.output_scale`) where it has them (a
calibrated kv_cache_scheme), else 1.0, what serving engines use without calibration: E4M3 then holds
|K|, |V| up to 448 with 3 mantissa bits, and values below 2^-6 lose precision.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec, dummy_weights, load_weights, read_json
from lorad.errors import BadRequest, ModelError
from lorad.gpu_ops.fp8 import FP8, Fp8Weight, fp8_unavailable, quantize_weight

log = logging.getLogger(__name__)

REFERENCE_GEMM = "fp8 weights dequantized per GEMM (reference path)"
_GPU_ROWS = ("activations quantized per token (triton; q|k|v's and gate|up's by the norm before them); 2-64 rows: "
             "triton fp8 GEMM, more: torch._scaled_mm; one row: ")
GPU_GEMM = _GPU_ROWS + "gemv over the fp8 weights"
# where one row of q|k|v and gate|up takes the triton GEMM (gpu_ops/fp8_gemm.py's takes_gemv: an H200)
GPU_GEMM_WIDE_ONE_ROW = _GPU_ROWS + "gemv over the fp8 weights for o and down, triton fp8 GEMM for q|k|v and gate|up"
_PROJECTION_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "k_scale", "v_scale", "output_scale")


@dataclass(frozen=True)
class CheckpointScheme:
    """An FP8 checkpoint's layout, from its quantization_config."""

    method: str  # "compressed-tensors" or "fp8"
    weight_scales: str  # "tensor" or "channel" (compressed-tensors says which; fp8: read from the shapes)
    static_activations: bool  # input_scale tensors give each projection's activation scale
    kv_scales: bool  # k_scale / v_scale tensors (a calibrated FP8 KV cache scheme)


@dataclass(frozen=True)
class Quantization:
    """How the base model's projection weights are held: `method` none or fp8; `source` where the FP8 weights
    came from (the checkpoint's layout, or "load": quantized here); `activations` how a GEMM's rows are scaled."""

    method: str = "none"
    source: str = "none"
    weight_scales: str = "-"
    activations: str = "-"

    def status(self, gemm: str) -> dict:
        """For /v1/status (`gemm`: the path the op set runs, ops.fp8_gemm)."""
        if self.method == "none":
            return {"method": "none"}
        return {"method": self.method, "source": self.source, "weight_scales": self.weight_scales,
                "activations": self.activations, "gemm": gemm}

    def describe(self) -> str:
        if self.method == "none":
            return "none"
        return f"{self.method}(source={self.source},weight_scales={self.weight_scales},activations={self.activations})"


@dataclass
class BaseWeights:
    weights: dict  # HF name -> tensor (Fp8Weight for the projections when quantized)
    quantization: Quantization
    kv_scales: torch.Tensor | None  # float32 [L, 2] from the checkpoint, or None


def checkpoint_scheme(config: dict) -> CheckpointScheme | None:
    """config.json's quantization_config -> the FP8 layout it describes; None without one. Anything lorad does
    not load is a ModelError naming it."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ModelError("config.json: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ModelError(f"block-wise FP8 checkpoints (weight_block_size {qc['weight_block_size']}) are not supported: "
                             "lorad reads FP8 weights with per-tensor or per-channel scales")
        activations = qc.get("activation_scheme", "dynamic")
        if activations not in ("dynamic", "static"):
            raise ModelError(f"quantization_config.activation_scheme {activations!r} is not supported (dynamic or static)")
        return CheckpointScheme("fp8", "as stored (tensor or channel)", activations == "static", kv_scales=True)
    raise ModelError(f"quantization_config.quant_method {method!r} is not supported: lorad loads FP8 checkpoints "
                     "(compressed-tensors with 8-bit float weights, or quant_method fp8) and bf16/fp16/fp32 ones")


def _compressed_tensors_scheme(qc: dict) -> CheckpointScheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ModelError(f"compressed-tensors format {fmt!r} is not supported: lorad loads float-quantized FP8 checkpoints")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ModelError("compressed-tensors quantization_config has no config_groups")
    strategies, statics = set(), set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if kind != "float" or bits != 8:
            raise ModelError(f"compressed-tensors group {name}: {bits}-bit {kind} weights are not supported "
                             "(lorad loads 8-bit float weights: FP8 E4M3)")
        if strategy not in ("tensor", "channel"):
            raise ModelError(f"compressed-tensors group {name}: weight strategy {strategy!r} is not supported "
                             "(tensor or channel scales)")
        strategies.add(strategy)
        inputs = group.get("input_activations")
        if inputs:
            if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
                raise ModelError(f"compressed-tensors group {name}: {inputs.get('num_bits')}-bit {inputs.get('type')} "
                                 "activations are not supported (8-bit float)")
            if not inputs.get("dynamic") and inputs.get("strategy") != "tensor":
                raise ModelError(f"compressed-tensors group {name}: static activation strategy "
                                 f"{inputs.get('strategy')!r} is not supported (tensor)")
            statics.add(not inputs.get("dynamic"))
        else:
            statics.add(False)  # weight-only: the GEMM quantizes its rows per token
    if len(statics) > 1:
        raise ModelError("compressed-tensors groups mix static and dynamic activations: not supported")
    kv = qc.get("kv_cache_scheme")
    if kv and (kv.get("type") != "float" or kv.get("num_bits") != 8 or kv.get("strategy", "tensor") != "tensor"):
        raise ModelError(f"compressed-tensors kv_cache_scheme {kv} is not supported (8-bit float, one scale per tensor)")
    return CheckpointScheme("compressed-tensors", "/".join(sorted(strategies)), statics.pop(), kv_scales=bool(kv))


def load_base_weights(model_dir: Path | None, spec: ModelSpec, requested: str, dtype: torch.dtype, device: torch.device,
                      seed: int = 0) -> BaseWeights:
    """The base model's weights as `requested` (EngineConfig.quantization: auto, fp8, none) on `device`:
    model_dir None is --dummy-weights. Refused (BadRequest) where FP8 cannot run: a GPU without FP8, or shapes
    torch._scaled_mm does not take."""
    scheme = checkpoint_scheme(read_json(model_dir / "config.json")) if model_dir is not None else None
    if scheme is not None and requested == "none":
        raise BadRequest(f"the checkpoint is FP8-quantized ({scheme.method}): serve it with --quantization fp8 or auto")
    fp8 = scheme is not None or requested == "fp8"
    if fp8:
        _check_device(spec, device)
    if model_dir is None:
        weights = dummy_weights(spec, dtype, device, seed=seed)
    elif scheme is None:
        weights = load_weights(model_dir, dtype, device)
    else:
        weights = load_weights(model_dir, dtype, device, cast=_fp8_cast(dtype, device))
    if not fp8:
        return BaseWeights(weights, Quantization(), None)
    kv_scales = _kv_scales(weights, spec, device) if scheme is not None and scheme.kv_scales else None
    if scheme is None:
        quantization = Quantization("fp8", "load", "channel", "dynamic per token")
    else:
        activations = "static per tensor (input_scale)" if scheme.static_activations else "dynamic per token"
        quantization = Quantization("fp8", scheme.method, scheme.weight_scales, activations)
    return BaseWeights(fp8_projections(weights, spec, static_activations=scheme is not None and scheme.static_activations),
                       quantization, kv_scales)


def refuse_under_tensor_parallel(model_dir: Path | None, config) -> None:
    """FP8 weights and KV pages are not sharded over tensor-parallel ranks (an FP8 weight's channel scales would
    follow its rows in column-parallel layers and stay whole in row-parallel ones; the workers' KV pages would take
    the dtype and scales): refused there, naming what to drop."""
    scheme = checkpoint_scheme(read_json(model_dir / "config.json")) if model_dir is not None else None
    asked = [flag for flag, on in (("--quantization fp8", config.quantization == "fp8"),
                                   ("--kv-cache-dtype fp8", config.kv_cache_dtype == "fp8"),
                                   (f"an FP8 checkpoint ({scheme.method if scheme else ''})", scheme is not None)) if on]
    if asked:
        raise BadRequest(f"{' and '.join(asked)}: not served with tensor_parallel_size > 1 (FP8 is not sharded); "
                         "serve FP8 on one GPU, or the model in its own dtype across GPUs")


def _check_device(spec: ModelSpec, device: torch.device) -> None:
    why = fp8_unavailable(device)
    if why is not None:
        raise BadRequest(f"--quantization fp8 cannot run here: {why}")
    if device.type == "cuda":
        for projection in PROJECTIONS:
            fan_in, fan_out = spec.projection_shape(projection)
            if fan_in % 16 or fan_out % 16:
                raise BadRequest(f"--quantization fp8: {projection} is [{fan_out}, {fan_in}]; the FP8 GEMM "
                                 "(torch._scaled_mm) needs in and out features that are multiples of 16")


def _fp8_cast(dtype: torch.dtype, device: torch.device):
    """load_weights' cast for an FP8 checkpoint: FP8 tensors as they are, scales in float32, the rest in dtype."""
    def cast(path: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == FP8:
            return tensor.to(device)
        if name.endswith(_SCALE_SUFFIXES):
            return tensor.to(device=device, dtype=torch.float32)
        if tensor.dtype in (torch.float8_e5m2, torch.int8, torch.int32, torch.uint8):
            raise ModelError(f"{path.name}: {name} is {tensor.dtype}; lorad loads float8_e4m3fn weights")
        return tensor.to(device=device, dtype=dtype)

    return cast


def fp8_projections(weights: dict, spec: ModelSpec, static_activations: bool = False) -> dict:
    """`weights` with each projection's weight (every `model.layers.N.self_attn|mlp.*_proj.weight`, fused ones
    such as a qkv_proj included) an Fp8Weight and its scale tensors taken out: a checkpoint's FP8 weight with its
    weight_scale (or weight_scale_inv) and input_scale, any other weight quantized here (per output channel; a
    layer a checkpoint left unquantized, or every layer of a bf16 checkpoint)."""
    out = dict(weights)
    names = [name for name in weights if _PROJECTION_WEIGHT.fullmatch(name)]
    quantized_here = 0
    for name in names:
        prefix = name.removesuffix("weight")
        weight = out.pop(name)
        scale = out.pop(prefix + "weight_scale", None)
        scale_inv = out.pop(prefix + "weight_scale_inv", None)
        input_scale = out.pop(prefix + "input_scale", None)
        if weight.dtype != FP8:
            out[name] = quantize_weight(weight)
            quantized_here += 1
            continue
        if scale is None:
            scale = scale_inv
        if scale is None:
            raise ModelError(f"{name} is FP8 but the checkpoint has no {prefix}weight_scale (or weight_scale_inv)")
        if static_activations and input_scale is None:
            raise ModelError(f"the checkpoint's activations are static but it has no {prefix}input_scale")
        out[name] = Fp8Weight(weight, _channel_scales(scale, weight.shape[0], prefix + "weight_scale"),
                              _scalar(input_scale, prefix + "input_scale") if static_activations else None)
    if not names:
        raise ModelError(f"the checkpoint has no projection weights (model.layers.N.self_attn|mlp.*_proj.weight) "
                         f"for {spec.architecture}")
    if quantized_here and quantized_here < len(names):
        log.info("fp8 checkpoint: %d projection weights stored unquantized were quantized at load (per channel)", quantized_here)
    return out


def _channel_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A weight scale per tensor ([] or [1]) or per output channel ([out] or [out, 1]) -> float32 [out]."""
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        return flat.expand(rows).contiguous()
    if flat.numel() == rows:
        return flat.contiguous()
    raise ModelError(f"{name} has shape {tuple(scale.shape)}: lorad reads one scale per tensor or per output channel "
                     f"({rows}); block or group scales are not supported")


def _scalar(scale: torch.Tensor, name: str) -> torch.Tensor:
    flat = scale.float().reshape(-1)
    if flat.numel() != 1:
        raise ModelError(f"{name} has shape {tuple(scale.shape)}: lorad reads one static activation scale per tensor")
    return flat.contiguous()


def _kv_scales(weights: dict, spec: ModelSpec, device: torch.device) -> torch.Tensor | None:
    """The checkpoint's K and V scales per layer, float32 [L, 2], taken out of `weights`; None where it has none."""
    scales = torch.ones(spec.num_layers, 2, dtype=torch.float32)
    found = 0
    for layer in range(spec.num_layers):
        attn = f"model.layers.{layer}.self_attn."
        for column, (short, long) in enumerate((("k_scale", "k_proj.output_scale"), ("v_scale", "v_proj.output_scale"))):
            scale = weights.pop(attn + short, None)
            if scale is None:
                scale = weights.pop(attn + long, None)
            if scale is not None:
                scales[layer, column] = _scalar(scale, attn + short).item()
                found += 1
    if found == 0:
        return None
    if found != 2 * spec.num_layers:
        raise ModelError(f"the checkpoint has K/V cache scales for some layers only ({found} of {2 * spec.num_layers})")
    return scales.to(device)


def kv_cache_dtype(requested: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the KV pages' dtype: auto is the model dtype; fp8 is float8_e4m3fn,
    refused on a GPU without FP8."""
    if requested == "auto":
        return model_dtype
    why = fp8_unavailable(device)
    if why is not None:
        raise BadRequest(f"--kv-cache-dtype fp8 cannot run here: {why}")
    return FP8


def kv_cache_status(dtype: torch.dtype, checkpoint_scales: torch.Tensor | None) -> dict:
    """/v1/status's kv_cache: the pages' dtype and where the FP8 scales come from."""
    if dtype != FP8:
        return {"dtype": str(dtype).removeprefix("torch."), "scales": "-"}
    return {"dtype": "fp8_e4m3", "scales": "checkpoint (k_scale, v_scale per layer)" if checkpoint_scales is not None
            else "1.0 (no k_scale/v_scale in the checkpoint)"}
