"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3; Gemma's variant in gemma.py) over plain tensors.

One forward serves a whole step: every sequence's new tokens side by side in the rows, prefill and
decode mixed. LoRA enters through one call per projection; attention reads and writes the paged KV
cache in the unified pool. The per-step metadata (`Step`) is built once by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorad.daemon.model.checkpoint import ModelSpec, rope_inv_freq, rope_rows, rope_tables
from lorad.daemon.model.ops import TorchOps
from lorad.errors import ModelError
from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.fp8 import Fp8Weight
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.rope import rope_cache

Q, K, V, O, GATE, UP, DOWN = range(7)


@dataclass
class Step:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    sample_rows: torch.Tensor  # int64 [S'] rows whose logits are wanted (last token of a sequence)
    attention: AttentionBatch
    lora: LoraBatch


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, hidden]: one GEMM for the three projections
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: [head_dim], each head of q (and k) normed before RoPE
    k_norm: torch.Tensor | None = None
    window: int | None = None  # a sliding-window layer's window (Mistral, Gemma's local layers); None: global
    rope: int = 0  # which of the model's RoPE tables: 1 for Gemma 3's local layers


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int, ops: TorchOps):
        self.spec = spec
        self.ops = ops
        take = _Taker(weights)
        self.embed = take("model.embed_tokens.weight")
        self.layers = [self.load_layer(take, index) for index in range(spec.num_layers)]
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if spec.tie_word_embeddings else take("lm_head.weight")
        take.check_shapes(spec)
        # RoPE tables (cos, sin) [rows, rope_dim], picked by Layer.rope: the model's ([positions (+ longrope's long
        # rows)]: a token's row is checkpoint.rope_rows'), and Gemma 3's local one.
        dtype, device = self.embed.dtype, self.embed.device
        self.rotations = [rope_tables(spec, max_positions, dtype, device)]
        if spec.local_rope_theta is not None:
            self.rotations.append(rope_cache(rope_inv_freq(spec, local=True), max_positions, dtype, device))
        self.max_positions = max_positions
        self.scale = (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5
        self.softcap = spec.attn_logit_softcapping
        self.splits = (spec.q_size, spec.kv_size, spec.kv_size)
        # Tensor parallelism (daemon/model/tensor_parallel.py): o's and down's outputs are partial sums over the
        # ranks, LoRA included; this sums them. The identity on one GPU.
        self.reduce = _whole
        # Where set (tensor_parallel.PeerSum): (h, partial, norm weight, eps, half) -> the sum, the residual add and
        # the norm after it in one kernel, (h, normed), or None for rows it does not take (summed by `reduce`).
        self.reduce_norm = None

    def rope_rows(self, positions, counts, lengths):
        """The cos/sin row of each token (Step.positions) from its position: checkpoint.rope_rows."""
        return rope_rows(self.spec, self.max_positions, positions, counts, lengths)

    def load_layer(self, take, index: int) -> Layer:
        p = f"model.layers.{index}."
        attn = p + "self_attn."
        spec = self.spec
        bias = None
        if spec.qkv_bias:
            bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
        if spec.fused_projections:  # Phi-3 stores them fused already, in lorad's order
            qkv, gate_up = take(attn + "qkv_proj.weight"), take(p + "mlp.gate_up_proj.weight")
        else:
            qkv = _stack([take(attn + f"{n}_proj.weight") for n in "qkv"])
            gate_up = _stack([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        return Layer(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            o=take(attn + "o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=gate_up,
            down=take(p + "mlp.down_proj.weight"),
            q_norm=take(attn + "q_norm.weight") if spec.qk_norm else None,
            k_norm=take(attn + "k_norm.weight") if spec.qk_norm else None,
            window=spec.window(index),
            rope=int(spec.local_rope_theta is not None and spec.window(index) is not None),
        )

    @torch.inference_mode()
    def forward(self, step: Step, kv_view: torch.Tensor, table) -> torch.Tensor:
        """-> logits [len(sample_rows), vocab] float32."""
        with self.ops.launches(step.lora.decode, len(step.input_ids)):
            return self._forward(step, kv_view, table)

    def _forward(self, step: Step, kv_view: torch.Tensor, table) -> torch.Tensor:
        h = self.embed_tokens(step.input_ids)
        rotations = [(cos[step.positions], sin[step.positions]) for cos, sin in self.rotations]
        x = self.ops.rms_norm(h, self.layers[0].input_norm, self.spec.rms_norm_eps, feeds=self.layers[0].qkv)
        for index, layer in enumerate(self.layers):
            cos, sin = rotations[layer.rope]
            h, down = self.layer_forward(index, layer, h, x, cos, sin, step, kv_view, table)
            if index + 1 < len(self.layers):  # the residual add, fused into the next layer's input norm
                h, x = self.add_layer_output(h, down, self.layers[index + 1])
        return self.logits(self.final_rows(h, down, step.sample_rows))

    def sum_add_rms_norm(self, h: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor, half: int, feeds=None):
        """h += partial summed over the ranks, -> (h, rms_norm(h)): in one kernel where `reduce_norm` takes the rows
        (`half`: 0 for o's sums, 1 for down's, so that the calls alternate its buffers), else `reduce`, then the
        fused add and norm. feeds: the projection that reads the normed rows (ops.py)."""
        eps = self.spec.rms_norm_eps
        if self.reduce_norm is not None:
            fused = self.reduce_norm(h, partial, weight, eps, half)
            if fused is not None:
                return fused
        return self.ops.add_rms_norm(h, self.reduce(partial), weight, eps, feeds=feeds)

    def add_layer_output(self, h: torch.Tensor, down: torch.Tensor, following: Layer):
        """A layer's MLP output (layer_forward's, partial over the ranks) added to the residual stream, -> (h, the
        following layer's input norm)."""
        return self.sum_add_rms_norm(h, down, following.input_norm, half=1, feeds=following.qkv)

    def final_rows(self, h: torch.Tensor, down: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
        """The last layer's MLP output (partial over the ranks) added to the residual stream, the sampled rows
        normed by the final norm."""
        if self.reduce_norm is not None:
            fused = self.reduce_norm(h, down, self.norm, self.spec.rms_norm_eps, 1)  # every row normed: a decode step's are all sampled
            if fused is not None:
                return fused[1][sample_rows]
        down = self.reduce(down)
        h = h[sample_rows] + down[sample_rows]
        return self.ops.rms_norm(h, self.norm, self.spec.rms_norm_eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over the final norm's rows -> [rows, vocab] float32 (no copy where the model is float32)."""
        return self.ops.linear(h, self.lm_head).float()

    def layer_forward(self, index, layer: Layer, h, x, cos, sin, step: Step, kv_view, table):
        """h: the residual stream into the layer, x: its input norm (computed by the caller, fused
        with the previous layer's residual add). -> (h after attention, the MLP's output, partial over the
        tensor-parallel ranks): the caller sums and adds the latter (add_layer_output, final_rows)."""
        o = self.attention_block(index, layer, x, cos, sin, step, kv_view, table, summed=False)
        h, x = self.sum_add_rms_norm(h, o, layer.post_norm, half=0, feeds=layer.gate_up)
        return h, self.mlp_block(index, layer, x, step, table, summed=False)

    def attention_block(self, index, layer: Layer, x, cos, sin, step: Step, kv_view, table,
                        summed: bool = True) -> torch.Tensor:
        """qkv, RoPE, the paged KV cache and attention, o: x [T, hidden] -> [T, hidden], summed over the
        tensor-parallel ranks unless `summed` is False."""
        spec, ops, lora = self.spec, self.ops, step.lora
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split(self.splits, dim=-1)
        ops.lora_group(x, qkv, (q, k, v), index, Q, lora, table)
        if layer.q_norm is not None:  # Qwen3, Gemma 3: each head normed after its projection (LoRA included), before RoPE
            q = ops.rms_norm(q.reshape(-1, spec.head_dim), layer.q_norm, spec.rms_norm_eps)
            k = ops.rms_norm(k.reshape(-1, spec.head_dim), layer.k_norm, spec.rms_norm_eps)
        q, k = ops.rope_qk(q.view(-1, spec.num_heads, spec.head_dim), k.view(-1, spec.num_kv_heads, spec.head_dim), cos, sin)
        ops.write_kv(kv_view, index, k, v.view(-1, spec.num_kv_heads, spec.head_dim), step.attention)
        attended = ops.attention(q, kv_view, index, step.attention, self.scale, layer.window, self.softcap)
        o = ops.linear(attended, layer.o)
        ops.lora(attended, o, index, O, lora, table)
        return self.reduce(o) if summed else o

    def mlp_block(self, index, layer: Layer, x, step: Step, table, summed: bool = True) -> torch.Tensor:
        """gate/up, the gated activation, down: x [T, hidden] -> [T, hidden], summed over the tensor-parallel ranks
        unless `summed` is False."""
        ops, lora = self.ops, step.lora
        gate_up = ops.linear(x, layer.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        ops.lora_group(x, gate_up, (gate, up), index, GATE, lora, table)
        act = self.activation(gate, up)
        down = ops.linear(act, layer.down)
        ops.lora(act, down, index, DOWN, lora, table)
        return self.reduce(down) if summed else down

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_mul(gate, up)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _stack(weights: list) -> torch.Tensor | Fp8Weight:
    """Projections that share an input as one weight (FP8 ones with their scales, gpu_ops/fp8.py)."""
    return Fp8Weight.cat(weights) if isinstance(weights[0], Fp8Weight) else torch.cat(weights)


class _Taker:
    """Hands out checkpoint tensors by name, so that missing or unexpected ones get a clear error. Each is removed
    from `weights` as it is taken: the parts of a fused projection (q, k, v; gate, up) are freed once it is built,
    so building needs no more memory than the weights themselves and one layer's fused copy (a 70B shard fills
    an 80 GB GPU)."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.taken: dict[str, tuple[int, ...]] = {}  # name -> shape

    def __call__(self, name: str) -> torch.Tensor:
        try:
            tensor = self.weights.pop(name)
        except KeyError:
            raise ModelError(f"the checkpoint has no tensor {name}"
                             + (" (taken twice)" if name in self.taken else "")) from None
        self.taken[name] = tuple(tensor.shape)
        return tensor

    def check_shapes(self, spec: ModelSpec) -> None:
        h = spec.hidden_size
        expected = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}."
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                fan_in, fan_out = spec.projection_shape(proj)
                expected[f"{p}self_attn.{proj}.weight"] = (fan_out, fan_in)
            for proj in ("gate_proj", "up_proj", "down_proj"):
                fan_in, fan_out = spec.projection_shape(proj)
                expected[f"{p}mlp.{proj}.weight"] = (fan_out, fan_in)
            for parent, proj in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
                fan_in, fan_out = spec.module_shape(proj)
                expected[f"{p}{parent}.{proj}.weight"] = (fan_out, fan_in)
            expected[f"{p}input_layernorm.weight"] = (h,)
            expected[f"{p}self_attn.q_norm.weight"] = (spec.head_dim,)
            expected[f"{p}self_attn.k_norm.weight"] = (spec.head_dim,)
            expected[f"{p}post_attention_layernorm.weight"] = (h,)
            expected[f"{p}pre_feedforward_layernorm.weight"] = (h,)  # Gemma
            expected[f"{p}post_feedforward_layernorm.weight"] = (h,)
        for name, shape in expected.items():
            if name in self.taken and self.taken[name] != shape:
                raise ModelError(f"{name} has shape {self.taken[name]}, config.json implies {shape}")
