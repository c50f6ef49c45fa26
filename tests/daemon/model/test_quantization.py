"""daemon/model/quantization.py: the base model's projections in FP8. A bf16/fp32 checkpoint quantized at load
(per-output-channel scales); FP8 checkpoints written here with safetensors in the compressed-tensors layout
(per-tensor and per-channel weight scales, dynamic and static activations, K/V cache scales) and the older
quant_method fp8 layout (weight_scale_inv), read as they are; and the refusals, each naming what it refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorad.daemon.model import quantization
from lorad.daemon.model.checkpoint import PROJECTIONS, load_spec
from lorad.errors import BadRequest, ModelError
from lorad.gpu_ops import fp8
from lorad.gpu_ops.fp8 import Fp8Weight

CPU = torch.device("cpu")


def projection_name(layer: int, projection: str) -> str:
    module = "mlp." if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn."
    return f"model.layers.{layer}.{module}{projection}"


def fp8_checkpoint(source: Path, target: Path, quantization_config: dict, scales: str = "channel",
                   scale_name: str = "weight_scale", input_scale: bool = False, kv_scales: bool = False,
                   skip: tuple[str, ...] = ()) -> dict:
    """`source`'s checkpoint with its projections stored in FP8 (scales per channel [out, 1] or per tensor [1]) in
    `target`, config.json carrying `quantization_config`. -> the tensors written."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    spec = load_spec(source)
    for layer in range(spec.num_layers):
        for projection in PROJECTIONS:
            name = projection_name(layer, projection)
            if name in skip:
                continue
            weight = tensors[name + ".weight"].float()
            if scales == "channel":
                scale = weight.abs().amax(dim=1, keepdim=True) / 448
            else:
                scale = (weight.abs().amax() / 448).reshape(1)
            tensors[name + ".weight"] = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[f"{name}.{scale_name}"] = scale
            if input_scale:
                tensors[name + ".input_scale"] = torch.tensor([0.01 * (1 + layer)])
        if kv_scales:
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5 + layer)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.25 + layer)
    (target / "model.safetensors").unlink()
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return tensors


def compressed_tensors(weights: str = "channel", activations: dict | None = None, kv: bool = False, **weight_fields) -> dict:
    """A compressed-tensors quantization_config as llm-compressor writes it (FP8_DYNAMIC by default)."""
    activations = activations if activations is not None else {"num_bits": 8, "type": "float", "dynamic": True,
                                                               "strategy": "token", "symmetric": True}
    group = {"targets": ["Linear"], "input_activations": activations, "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "strategy": weights, "dynamic": False, "symmetric": True,
                         **weight_fields}}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
              "ignore": ["lm_head"], "quantization_status": "compressed"}
    if kv:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    return config


# --- quantized at load ---------------------------------------------------------------------------


def test_quantize_at_load_per_channel(demo_assets):
    model_dir = demo_assets.model_dir
    spec = load_spec(model_dir)
    plain = load_file(str(model_dir / "model.safetensors"))
    base = quantization.load_base_weights(model_dir, spec, "fp8", torch.float32, CPU)
    assert base.quantization == quantization.Quantization("fp8", "load", "channel", "dynamic per token")
    assert base.kv_scales is None
    for layer in range(spec.num_layers):
        for projection in PROJECTIONS:
            name = projection_name(layer, projection) + ".weight"
            weight, original = base.weights[name], plain[name].float()
            assert isinstance(weight, Fp8Weight) and weight.input_scale is None
            assert torch.allclose(weight.scale, original.abs().amax(dim=1) / 448, rtol=1e-6)
            error = (weight.dequantize(torch.float32) - original).abs()
            assert (error <= original.abs() * 2**-4 + weight.scale[:, None] * 2**-10 + 1e-12).all()
    # embeddings, norms and the LM head stay in the model dtype
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert base.weights[name].dtype == torch.float32
    assert quantization.load_base_weights(model_dir, spec, "auto", torch.float32, CPU).quantization.method == "none"


def test_dummy_weights_quantized_at_load():
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"])
    base = quantization.load_base_weights(None, spec, "fp8", torch.bfloat16, CPU)
    assert isinstance(base.weights["model.layers.1.mlp.down_proj.weight"], Fp8Weight)
    assert base.weights["lm_head.weight"].dtype == torch.bfloat16


# --- FP8 checkpoints read as they are -----------------------------------------------------------------


@pytest.mark.parametrize("scales", ["channel", "tensor"])
def test_compressed_tensors_weights_and_scales_read_as_written(scales, demo_assets, tmp_path):
    written = fp8_checkpoint(demo_assets.model_dir, tmp_path / "ckpt", compressed_tensors(scales), scales=scales)
    spec = load_spec(tmp_path / "ckpt")
    base = quantization.load_base_weights(tmp_path / "ckpt", spec, "auto", torch.float32, CPU)
    assert base.quantization == quantization.Quantization("fp8", "compressed-tensors", scales, "dynamic per token")
    for layer in range(spec.num_layers):
        for projection in PROJECTIONS:
            name = projection_name(layer, projection)
            weight = base.weights[name + ".weight"]
            assert torch.equal(weight.weight.view(torch.uint8), written[name + ".weight"].view(torch.uint8))
            expected = written[name + ".weight_scale"].reshape(-1).expand(weight.shape[0])
            assert torch.equal(weight.scale, expected) and weight.input_scale is None
            assert name + ".weight_scale" not in base.weights
    assert base.kv_scales is None


def test_compressed_tensors_static_activations_and_kv_scales(demo_assets, tmp_path):
    static = {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor", "symmetric": True}
    fp8_checkpoint(demo_assets.model_dir, tmp_path / "ckpt", compressed_tensors("tensor", static, kv=True),
                   scales="tensor", input_scale=True, kv_scales=True)
    spec = load_spec(tmp_path / "ckpt")
    base = quantization.load_base_weights(tmp_path / "ckpt", spec, "fp8", torch.float32, CPU)
    assert base.quantization.activations == "static per tensor (input_scale)"
    assert base.weights["model.layers.2.self_attn.o_proj.weight"].input_scale.tolist() == [pytest.approx(0.03)]
    assert base.kv_scales.tolist() == [[0.5 + layer, 0.25 + layer] for layer in range(spec.num_layers)]
    assert "model.layers.0.self_attn.k_scale" not in base.weights


def test_fp8_quant_method_with_weight_scale_inv_and_an_unquantized_layer(demo_assets, tmp_path):
    """The older layout: quant_method fp8 with weight_scale_inv (a multiplier, despite its name); a projection
    the checkpoint left in its dtype (its `ignored_layers`) is quantized at load."""
    left = projection_name(1, "down_proj")
    written = fp8_checkpoint(demo_assets.model_dir, tmp_path / "ckpt", {"quant_method": "fp8", "activation_scheme": "dynamic",
                             "ignored_layers": [left]}, scale_name="weight_scale_inv", skip=(left,))
    spec = load_spec(tmp_path / "ckpt")
    base = quantization.load_base_weights(tmp_path / "ckpt", spec, "auto", torch.float32, CPU)
    assert base.quantization.source == "fp8"
    name = projection_name(0, "q_proj")
    assert torch.equal(base.weights[name + ".weight"].scale, written[name + ".weight_scale_inv"].reshape(-1))
    kept = base.weights[left + ".weight"]
    assert isinstance(kept, Fp8Weight)
    assert torch.allclose(kept.scale, written[left + ".weight"].abs().amax(dim=1) / 448)


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "block-wise FP8"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme 'sometimes'"),
    (compressed_tensors(type="int", num_bits=4, strategy="group"), "4-bit int weights are not supported"),
    (compressed_tensors(type="int"), "8-bit int weights"),
    (compressed_tensors("block"), "weight strategy 'block'"),
    (compressed_tensors(activations={"num_bits": 8, "type": "int", "dynamic": True}), "8-bit int activations"),
    (compressed_tensors(activations={"num_bits": 8, "type": "float", "dynamic": False, "strategy": "token"}),
     "static activation strategy 'token'"),
    ({**compressed_tensors(), "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**compressed_tensors(), "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, "kv_cache_scheme"),
])
def test_unsupported_schemes_are_refused_by_name(config, message):
    with pytest.raises(ModelError, match=message):
        quantization.checkpoint_scheme({"quantization_config": config})


def test_an_fp8_checkpoint_with_quantization_none_is_refused(demo_assets, tmp_path):
    fp8_checkpoint(demo_assets.model_dir, tmp_path / "ckpt", compressed_tensors())
    with pytest.raises(BadRequest, match="FP8-quantized \\(compressed-tensors\\): serve it with --quantization fp8 or auto"):
        quantization.load_base_weights(tmp_path / "ckpt", load_spec(tmp_path / "ckpt"), "none", torch.float32, CPU)


def test_missing_and_block_scales_are_refused(demo_assets, tmp_path):
    tensors = fp8_checkpoint(demo_assets.model_dir, tmp_path / "ckpt", compressed_tensors())
    spec = load_spec(tmp_path / "ckpt")
    name = projection_name(0, "k_proj")
    missing = dict(tensors)
    del missing[name + ".weight_scale"]
    with pytest.raises(ModelError, match=f"{name}.weight is FP8 but the checkpoint has no {name}.weight_scale"):
        quantization.fp8_projections(missing, spec)
    blocks = dict(tensors, **{name + ".weight_scale": torch.ones(2, 2)})
    with pytest.raises(ModelError, match="block or group scales are not supported"):
        quantization.fp8_projections(blocks, spec)
    static = dict(tensors)
    with pytest.raises(ModelError, match="activations are static but it has no .*input_scale"):
        quantization.fp8_projections(static, spec, static_activations=True)


def test_gpus_without_fp8_are_refused(monkeypatch):
    """Compute capability below 8.9 (an A100 here, faked): --quantization fp8 and --kv-cache-dtype fp8 are
    refused with the reason; on an FP8 GPU, projection shapes torch._scaled_mm cannot take are refused."""
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda")
    why = fp8.fp8_unavailable(cuda)
    assert why == "NVIDIA A100-SXM4-80GB has compute capability 8.0; FP8 needs 8.9 or later (Ada, Hopper)"
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["llama-2-7b"])
    with pytest.raises(BadRequest, match="--quantization fp8 cannot run here: NVIDIA A100.*8.0; FP8 needs 8.9"):
        quantization.load_base_weights(None, spec, "fp8", torch.bfloat16, cuda)
    with pytest.raises(BadRequest, match="--kv-cache-dtype fp8 cannot run here: NVIDIA A100"):
        quantization.kv_cache_dtype("fp8", torch.bfloat16, cuda)
    assert quantization.kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    quantization._check_device(spec, cuda)  # the 7B's shapes are multiples of 16
    tiny = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"])
    with pytest.raises(BadRequest, match=r"gate_proj is \[172, 64\]; the FP8 GEMM \(torch._scaled_mm\) needs .* multiples of 16"):
        quantization._check_device(tiny, cuda)


def test_the_cpu_runs_the_reference_path():
    """FP8 on the CPU is not refused: the reference ops dequantize (and say so, tests/daemon/engine/test_fp8_engine.py)."""
    assert fp8.fp8_unavailable(CPU) is None
    assert quantization.kv_cache_dtype("fp8", torch.float32, CPU) == torch.float8_e4m3fn
    assert quantization.REFERENCE_GEMM == "fp8 weights dequantized per GEMM (reference path)"


def test_fused_projection_weights_are_quantized_too():
    """A checkpoint that stores q|k|v and gate|up fused (qkv_proj, gate_up_proj) has them quantized by name."""
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"])
    weights = {"model.layers.0.self_attn.qkv_proj.weight": torch.randn(128, 64),
               "model.layers.0.mlp.gate_up_proj.weight": torch.randn(344, 64), "model.norm.weight": torch.ones(64)}
    out = quantization.fp8_projections(weights, spec)
    assert isinstance(out["model.layers.0.self_attn.qkv_proj.weight"], Fp8Weight)
    assert isinstance(out["model.layers.0.mlp.gate_up_proj.weight"], Fp8Weight)
    assert torch.equal(out["model.norm.weight"], torch.ones(64))
    with pytest.raises(ModelError, match="no projection weights"):
        quantization.fp8_projections({"model.norm.weight": torch.ones(64)}, spec)
