"""Gemma 2 and Gemma 3's text decoder: the Llama decoder (llama.py) with Gemma's differences.

Four norms a layer (the attention's and the MLP's outputs are normed before their residual adds), GeGLU
(tanh GELU), embeddings scaled by sqrt(hidden), soft-capped logits (Gemma 2). What Gemma shares with other
families is read from the ModelSpec by LlamaModel itself: sliding-window layers, the attention scale
(query_pre_attn_scalar), soft-capped attention scores, per-layer RoPE tables and q/k norms (Gemma 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorad.daemon.model.checkpoint import ModelSpec
from lorad.daemon.model.llama import Layer, LlamaModel
from lorad.daemon.model.ops import TorchOps


@dataclass
class GemmaLayer(Layer):
    # post_norm (inherited) is the norm before the MLP: Gemma's pre_feedforward_layernorm.
    attention_out_norm: torch.Tensor | None = None  # HF's post_attention_layernorm: on o, before the residual add
    mlp_out_norm: torch.Tensor | None = None  # HF's post_feedforward_layernorm: on down, before the residual add


class GemmaModel(LlamaModel):
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int, ops: TorchOps):
        # Gemma's RMSNorm scales by (1 + w) where Llama's scales by w: 1 is added to every norm weight once here,
        # so the norm references and kernels serve both. Kept in float32: Gemma scales the normed row in float32
        # and rounds the product once (a float32 weight tells rms_norm_ref and the kernels so); (1 + w) rounded to
        # bfloat16 and the normed row rounded before the scale put lorad's bfloat16 logits up to 4x further from
        # float32 than transformers' own bfloat16 on the tiny test checkpoints.
        weights = {name: tensor.float() + 1 if name.endswith("norm.weight") else tensor
                   for name, tensor in weights.items()}
        super().__init__(spec, weights, max_positions, ops)
        # HF multiplies the embeddings by sqrt(hidden) rounded to their dtype (bfloat16: sqrt(3584) = 59.87 -> 60.0).
        self.embed_scale = float(torch.tensor(spec.hidden_size**0.5, dtype=self.embed.dtype))

    def load_layer(self, take, index: int) -> GemmaLayer:
        p = f"model.layers.{index}."
        layer = super().load_layer(take, index)  # its post_norm: the checkpoint's post_attention_layernorm
        return GemmaLayer(**{**vars(layer), "attention_out_norm": layer.post_norm,
                             "post_norm": take(p + "pre_feedforward_layernorm.weight"),
                             "mlp_out_norm": take(p + "post_feedforward_layernorm.weight")})

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids] * self.embed_scale

    def layer_forward(self, index, layer: GemmaLayer, h, x, cos, sin, step, kv_view, table):
        ops, eps = self.ops, self.spec.rms_norm_eps
        o = ops.rms_norm(self.attention_block(index, layer, x, cos, sin, step, kv_view, table), layer.attention_out_norm, eps)
        h, x = ops.add_rms_norm(h, o, layer.post_norm, eps, feeds=layer.gate_up)
        return h, ops.rms_norm(self.mlp_block(index, layer, x, step, table), layer.mlp_out_norm, eps)

    # Gemma norms each block's output after its sum over the ranks: layer_forward returns the MLP's output summed
    # and normed, which the residual stream takes as it is.
    def add_layer_output(self, h: torch.Tensor, down: torch.Tensor, following: GemmaLayer):
        return self.ops.add_rms_norm(h, down, following.input_norm, self.spec.rms_norm_eps, feeds=following.qkv)

    def final_rows(self, h: torch.Tensor, down: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(h[sample_rows] + down[sample_rows], self.norm, self.spec.rms_norm_eps)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_mul(gate, up)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().logits(h)
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # in place on the float32 logits: no second [rows, vocab] tensor
            logits.div_(cap).tanh_().mul_(cap)
        return logits


def build_model(spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int, ops: TorchOps) -> LlamaModel:
    """The decoder of spec's architecture: GemmaModel for Gemma 2 and 3, LlamaModel for the rest. It takes the
    tensors out of `weights` (the dict is left with those the model does not use)."""
    return (GemmaModel if spec.gemma else LlamaModel)(spec, weights, max_positions, ops)
