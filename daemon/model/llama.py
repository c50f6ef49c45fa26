"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over plain tensors.

One forward serves a whole step: every sequence's new tokens side by side in the rows, prefill and
decode mixed. LoRA enters through one call per projection; attention reads and writes the paged KV
cache in the unified pool. The per-step metadata (`Step`) is built once by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lorad.daemon.model.checkpoint import ModelSpec, rope_inv_freq
from lorad.errors import ModelError
from lorad.gpu_ops.attention import AttentionBatch
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


class Ops:
    """The op functions the model calls. `Ops.reference()`: the pure-torch references (the CPU engine,
    and any device where the kernels cannot run); `Ops.for_device()` picks the Triton kernels on cuda.
    `name` says which set runs: the engine logs it and /v1/status shows it."""

    def __init__(self, name: str, rms_norm, add_rms_norm, rope_qk, silu_mul, write_kv, attention, lora,
                 prepare_lora=None, linear=F.linear):
        self.name = name
        self.linear = linear  # the base model's projections: (x, weight [out, in], bias or None) -> x @ weight^T + bias
        self.rms_norm = rms_norm
        # h += delta, then (h, rms_norm(h)): the residual add fused into the norm after it.
        self.add_rms_norm = add_rms_norm
        self.rope_qk = rope_qk
        self.silu_mul = silu_mul
        self.write_kv = write_kv
        self.attention = attention
        self.lora = lora
        # Per-step LoRA metadata the kernels need beyond LoraBatch (segments, max rank): built once
        # per step by the runner, never per layer.
        self.prepare_lora = prepare_lora or (lambda batch, table: None)
        # The LoRA of consecutive projections on one x (q, k, v; gate, up) whose outputs lie side by side
        # in `fused`: (x, fused, outs, layer, first projection, batch, table). Default: `lora` per member
        # (looked up at call time: the engine may wrap `lora`); the GPU ops launch decode steps' groups at once.
        self.lora_group = self._lora_each

    def _lora_each(self, x, fused, outs, layer, first, batch, table) -> None:
        for member, out in enumerate(outs):
            self.lora(x, out, layer, first + member, batch, table)

    @classmethod
    def reference(cls, name: str = "torch-reference") -> Ops:
        from lorad.gpu_ops.attention import paged_attention_ref, write_kv_ref
        from lorad.gpu_ops.fused import rope_qk_ref, silu_mul_ref
        from lorad.gpu_ops.lora import apply_lora_ref
        from lorad.gpu_ops.norm import add_rms_norm_ref, rms_norm_ref

        return cls(name, rms_norm_ref, add_rms_norm_ref, rope_qk_ref, silu_mul_ref, write_kv_ref, paged_attention_ref,
                   apply_lora_ref)

    @classmethod
    def for_device(cls, device: torch.device, max_batch_tokens: int, max_lora_rank: int, kernel_choice=None,
                   fuse_groups: bool = False, pdl: bool = False) -> Ops:
        """kernel_choice (daemon/engine/kernel_choice.py): picks each decode step's LoRA kernel, BGMV or MBGMV,
        in `prepare_lora`; None: MBGMV. On the CPU only a profile (or `lorad profile` measuring) makes
        decode steps run the kernels' references, bgmv_ref or mbgmv_ref; otherwise apply_lora_ref."""
        if device.type != "cuda":
            return cls._reference_with_choice(cls.reference(), kernel_choice)
        try:
            from lorad.gpu_ops import bgmv

            bgmv.require_triton()
        except (ImportError, RuntimeError) as error:
            return cls._reference_with_choice(cls.reference(f"torch-reference (triton unavailable: {error})"), kernel_choice)
        return cls.triton(device, max_batch_tokens, max_lora_rank, kernel_choice, fuse_groups, pdl)

    @classmethod
    def triton(cls, device: torch.device, max_batch_tokens: int, max_lora_rank: int, kernel_choice=None,
               fuse_groups: bool = False, pdl: bool = False) -> Ops:
        """The Triton kernels (on the CPU they run only in Triton's interpreter: the tests). fuse_groups: a
        decode step's MBGMV takes q, k, v in one launch pair and gate, up in one (where their tiles agree:
        mbgmv.group_fits), not one pair per projection. pdl: the decode MBGMV's expand launched early (the
        caller checks mbgmv.pdl_unavailable)."""
        from lorad.gpu_ops import bgmv, fused, mbgmm, mbgmv, paged_attention

        from lorad.gpu_ops import gemv

        groups = ",mbgmv-groups:qkv|gate-up" if fuse_groups else ""
        groups += ",mbgmv-pdl" if pdl else ""
        ops = cls.reference(f"triton[lora:mbgmv|bgmv+mbgmm{groups},paged-attention,fused-norm-rope-silu,"
                            f"gemv(rows<={gemv.GEMV_MAX_ROWS})]")

        def linear(x, weight, bias=None):
            if x.shape[0] <= gemv.GEMV_MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous():
                return gemv.gemv(x, weight, bias)
            return F.linear(x, weight, bias)

        ops.linear = linear
        ops.attention = paged_attention.attention
        ops.write_kv = paged_attention.write_kv
        ops.rms_norm = fused.rms_norm
        ops.add_rms_norm = fused.add_rms_norm
        ops.rope_qk = lambda q, k, cos, sin: fused.rope_qk(q, k, cos, sin, inplace=True)
        ops.silu_mul = fused.silu_mul
        workspace = torch.empty(bgmv.workspace_numel(max_batch_tokens, max_lora_rank), dtype=torch.float32, device=device)

        def prepare_lora(batch, table):
            if batch.slot_rows:
                batch.segments = mbgmm.Segments.build(batch, table)
                batch.max_rank = batch.segments.max_rank
                if batch.segments.max_len == 1 and kernel_choice is not None:  # a decode step
                    batch.decode_kernel = kernel_choice.choose([int(table.rank_host[slot].max()) for slot, _ in batch.slot_rows])

        def lora(x, y, layer, proj, batch, table):
            if batch.max_rank == 0:  # no row uses an adapter
                return
            if batch.segments is None or batch.segments.max_len == 1:  # each adapter has one row: decode
                if batch.decode_kernel == "bgmv":
                    bgmv.bgmv(x, y, layer, proj, batch.row_slot, table, batch.max_rank, workspace)
                else:
                    mbgmv.lora_decode(x, y, layer, proj, batch, table, max_rank=batch.max_rank, workspace=workspace, pdl=pdl)
            else:
                mbgmm.lora_prefill(x, y, layer, proj, batch, table, segments=batch.segments, workspace=workspace)

        def lora_group(x, fused_out, outs, layer, first, batch, table):
            if (batch.max_rank and batch.decode_kernel == "mbgmv" and not batch.cpu_spans
                    and (batch.segments is None or batch.segments.max_len == 1)):
                config = mbgmv.group_fits(table, first, len(outs), batch.max_rank, pdl=pdl)
                if config is not None:
                    mbgmv.mbgmv_group(x, fused_out, layer, first, len(outs), batch.row_slot, table, batch.max_rank,
                                      workspace, config=config, pdl=pdl)
                    return
            ops._lora_each(x, fused_out, outs, layer, first, batch, table)

        ops.lora = lora
        ops.prepare_lora = prepare_lora
        if fuse_groups:
            ops.lora_group = lora_group
        return ops

    @staticmethod
    def _reference_with_choice(ops: Ops, kernel_choice) -> Ops:
        """The reference ops; with a profile (or while `lorad profile` measures), decode steps run
        bgmv_ref or mbgmv_ref as chosen: the references of what the profile timed on this device."""
        if kernel_choice is None or not kernel_choice.active:
            return ops
        from lorad.gpu_ops.bgmv import batch_max_rank, bgmv_ref
        from lorad.gpu_ops.lora import apply_lora_ref
        from lorad.gpu_ops.mbgmv import mbgmv_ref

        kernels = {"bgmv": bgmv_ref, "mbgmv": mbgmv_ref}
        ops.name += "[decode lora: bgmv_ref|mbgmv_ref]"

        def prepare_lora(batch, table):
            if batch.slot_rows and all(rows.numel() == 1 for _, rows in batch.slot_rows):  # a decode step
                batch.max_rank = batch_max_rank(batch, table)
                batch.decode_kernel = kernel_choice.choose([int(table.rank_host[slot].max()) for slot, _ in batch.slot_rows])

        def lora(x, y, layer, proj, batch, table):
            if batch.max_rank:
                kernels[batch.decode_kernel](x, y, layer, proj, batch.row_slot, table, batch.max_rank)
            else:
                apply_lora_ref(x, y, layer, proj, batch, table)

        ops.lora = lora
        ops.prepare_lora = prepare_lora
        return ops


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_positions: int, ops: Ops):
        self.spec = spec
        self.ops = ops
        take = _Taker(weights)
        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            bias = None
            if spec.qkv_bias:
                bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                Layer(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"]),
                    qkv_bias=bias,
                    o=take(attn + "o_proj.weight"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                    down=take(p + "mlp.down_proj.weight"),
                )
            )
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if spec.tie_word_embeddings else take("lm_head.weight")
        take.check_shapes(spec)
        self.cos, self.sin = rope_cache(rope_inv_freq(spec), max_positions, self.embed.dtype, self.embed.device)
        self.scale = spec.head_dim**-0.5
        self.splits = (spec.q_size, spec.kv_size, spec.kv_size)

    @torch.inference_mode()
    def forward(self, step: Step, kv_view: torch.Tensor, table) -> torch.Tensor:
        """-> logits [len(sample_rows), vocab] float32."""
        h = self.embed[step.input_ids]
        cos, sin = self.cos[step.positions], self.sin[step.positions]
        x = self.ops.rms_norm(h, self.layers[0].input_norm, self.spec.rms_norm_eps)
        for index, layer in enumerate(self.layers):
            h, down = self.layer_forward(index, layer, h, x, cos, sin, step, kv_view, table)
            if index + 1 < len(self.layers):  # the residual add, fused into the next layer's input norm
                h, x = self.ops.add_rms_norm(h, down, self.layers[index + 1].input_norm, self.spec.rms_norm_eps)
        h = h[step.sample_rows] + down[step.sample_rows]
        h = self.ops.rms_norm(h, self.norm, self.spec.rms_norm_eps)
        return self.ops.linear(h, self.lm_head).float()

    def layer_forward(self, index, layer: Layer, h, x, cos, sin, step: Step, kv_view, table):
        """h: the residual stream into the layer, x: its input norm (computed by the caller, fused
        with the previous layer's residual add). -> (h after attention, the MLP's output): the caller
        adds the latter."""
        spec, ops, lora = self.spec, self.ops, step.lora
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split(self.splits, dim=-1)
        ops.lora_group(x, qkv, (q, k, v), index, Q, lora, table)
        q, k = ops.rope_qk(q.view(-1, spec.num_heads, spec.head_dim), k.view(-1, spec.num_kv_heads, spec.head_dim), cos, sin)
        ops.write_kv(kv_view, index, k, v.view(-1, spec.num_kv_heads, spec.head_dim), step.attention)
        attended = ops.attention(q, kv_view, index, step.attention, self.scale)
        o = ops.linear(attended, layer.o)
        ops.lora(attended, o, index, O, lora, table)

        h, x = ops.add_rms_norm(h, o, layer.post_norm, spec.rms_norm_eps)
        gate_up = ops.linear(x, layer.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        ops.lora_group(x, gate_up, (gate, up), index, GATE, lora, table)
        act = ops.silu_mul(gate, up)
        down = ops.linear(act, layer.down)
        ops.lora(act, down, index, DOWN, lora, table)
        return h, down


class _Taker:
    """Hands out checkpoint tensors by name, so that missing or unexpected ones get a clear error."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.taken: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        try:
            tensor = self.weights[name]
        except KeyError:
            raise ModelError(f"the checkpoint has no tensor {name}") from None
        self.taken[name] = tensor
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
            expected[f"{p}input_layernorm.weight"] = (h,)
            expected[f"{p}post_attention_layernorm.weight"] = (h,)
        for name, shape in expected.items():
            if name in self.taken and tuple(self.taken[name].shape) != shape:
                raise ModelError(f"{name} has shape {tuple(self.taken[name].shape)}, config.json implies {shape}")
