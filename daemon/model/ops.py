"""The ops the decoder calls, as two sets with one interface: `TorchOps`, the pure-torch references (the
CPU engine, and any device where the kernels cannot run), and `TritonOps`, the Triton kernels on cuda.
`select_ops` picks the set for a device; `ops.name` says which runs (the engine logs it, /v1/status shows it).
The kernel modules are imported when a set is made, not with this module: the tests set Triton's interpreter
up before any kernel is decorated.

The norms take `feeds`, the weight of the projection that reads their output: with an FP8 weight, TritonOps
quantizes the rows for its GEMM in the same kernel (gpu_ops/fused.py's `*_fp8`) and `linear` takes them for that
weight and that tensor, where it would quantize them in a launch of its own; the references ignore it (their FP8
GEMM dequantizes the weight instead).

`launches(decode, rows)` is the context a step's forward runs in: with decode_pdl, a decode step's kernels are
launched early (gpu_ops/launch.py).

LoRA enters through `lora(x, y, layer, proj, batch, table)` per projection and `lora_group` for q, k, v and
gate, up, whose outputs lie side by side in one fused GEMM's output. Rows that the CPU workers compute for a
cold adapter (`batch.cpu_spans`) are handed to `batch.cpu_assist`, which runs the pool path for a layer that
has arrived.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from lorad.daemon.model.quantization import GPU_GEMM, GPU_GEMM_WIDE_ONE_ROW, REFERENCE_GEMM
from lorad.gpu_ops.fp8 import Fp8Weight
from lorad.gpu_ops.lora import LoraBatch, apply_lora_ref
from lorad.gpu_ops.page_pool import AdapterTable


class TorchOps:
    """The pure-torch references. kernel_choice (daemon/engine/kernel_choice.py): with a profile (or while
    `lorad profile` measures), decode steps are counted by the kernel chosen and run bgmv_ref, the reference
    of both decode kernels the profile timed; otherwise every step runs apply_lora_ref."""

    fuses_groups = False  # lora_group launches a group at once (TritonOps with fuse_groups only)
    fp8_gemm = REFERENCE_GEMM  # how linear multiplies an Fp8Weight
    # FP8 KV pages' scales, float32 [L, 2] (K, V per layer; gpu_ops/attention.py): set by the runner with the cache
    kv_scales: torch.Tensor | None = None

    def __init__(self, name: str = "torch-reference", kernel_choice=None):
        from lorad.gpu_ops import attention, fp8, fused, norm

        self._fp8 = fp8
        self.kernel_choice = kernel_choice if kernel_choice is not None and kernel_choice.active else None
        self.name = name + ("[decode lora: bgmv_ref]" if self.kernel_choice is not None else "")
        self._attention, self._fused, self._norm = attention, fused, norm
        if self.kernel_choice is not None:
            from lorad.gpu_ops import bgmv

            self._bgmv_ref, self._batch_max_rank = bgmv.bgmv_ref, bgmv.batch_max_rank

    def launches(self, decode: bool, rows: int):
        """The context a step's forward runs in (decode: a decode step's, of `rows` rows): here nothing changes."""
        return contextlib.nullcontext()

    # The base model's ops.
    def linear(self, x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T + bias; weight: [out, in], or an FP8 weight (gpu_ops/fp8.py), dequantized here."""
        if isinstance(weight, Fp8Weight):
            return self._fp8.fp8_linear_ref(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, feeds=None):
        """feeds: the projection weight that reads the output (the module's docstring)."""
        return self._norm.rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps, feeds=None):
        """h += delta, then (h, rms_norm(h)): the residual add fused into the norm after it."""
        return self._norm.add_rms_norm_ref(h, delta, weight, eps)

    def rope_qk(self, q, k, cos, sin):
        return self._fused.rope_qk_ref(q, k, cos, sin)

    def silu_mul(self, gate, up):
        return self._fused.silu_mul_ref(gate, up)

    def gelu_tanh_mul(self, gate, up):
        return self._fused.gelu_tanh_mul_ref(gate, up)

    def write_kv(self, kv_view, layer, k, v, attention):
        self._attention.write_kv_ref(kv_view, layer, k, v, attention, self.kv_scales)

    def attention(self, q, kv_view, layer, attention, scale, window=None, softcap=None):
        """window: a sliding-window layer's (None: global); softcap: Gemma 2's cap on the scores."""
        return self._attention.paged_attention_ref(q, kv_view, layer, attention, scale, window, softcap,
                                                   kv_scales=self.kv_scales)

    # LoRA.
    def prepare_lora(self, batch: LoraBatch, table: AdapterTable) -> None:
        """The per-step LoRA metadata the kernels need beyond LoraBatch (segments, max rank, the decode
        kernel, the projections no row's adapter targets): built once per step by the runner, never per layer."""
        mark_untargeted(batch, table)
        if self.kernel_choice is None:
            return
        if batch.decode and batch.slot_rows:
            batch.max_rank = self._batch_max_rank(batch, table)
            batch.decode_kernel = self.kernel_choice.choose(row_ranks(batch, table))

    def lora(self, x, y, layer: int, proj: int, batch: LoraBatch, table: AdapterTable) -> None:
        """y += (x @ A^T) @ B^T for every row with an adapter: the pool's rows here, the CPU-assisted rows
        by batch.cpu_assist. x: [T, in]; y: [T, out], accumulated in place. A projection no pool row's adapter
        targets (batch.untargeted) launches nothing for the pool's rows."""
        if proj not in batch.untargeted:
            self.pool_lora(x, y, layer, proj, batch, table)
        if batch.cpu_spans:
            batch.cpu_assist.apply(
                x, y, layer, proj, batch.cpu_spans,
                lambda x_rows, y_rows, layer, proj, span: self.pool_lora(x_rows, y_rows, layer, proj, span.gpu_batch, table),
            )

    def pool_lora(self, x, y, layer: int, proj: int, batch: LoraBatch, table: AdapterTable) -> None:
        """The LoRA of the rows whose adapter is in the page pool."""
        if self.kernel_choice is not None and batch.max_rank:
            self._bgmv_ref(x, y, layer, proj, batch.row_slot, table, batch.max_rank)
        else:
            apply_lora_ref(x, y, layer, proj, batch, table)

    def lora_group(self, x, fused, outs, layer: int, first: int, batch: LoraBatch, table: AdapterTable) -> None:
        """The LoRA of consecutive projections on one x (q, k, v; gate, up) whose outputs `outs` lie side by
        side in `fused`, starting at projection `first`: here one projection after another."""
        for member, out in enumerate(outs):
            self.lora(x, out, layer, first + member, batch, table)


class TritonOps(TorchOps):
    """The Triton kernels (on the CPU they run only in Triton's interpreter: the tests): gemv for one-row
    projections, paged attention, fused norm / RoPE / SiLU-mul, MBGMV or BGMV for decode LoRA (chosen per
    step by kernel_choice; MBGMV without one), MBGMM for prefill LoRA. fuse_groups: a decode step's MBGMV, and a mixed
    step's MBGMV of its decode rows, take q, k, v in one launch pair and gate, up in one (where their tiles agree:
    mbgmv.group_fits); a step's prompt rows take the MBGMM shrinks of q, k, v in one launch and those of gate, up in
    one (mbgmm.group_fits). pdl: the decode MBGMV's expand launched early (the caller checks launch.pdl_unavailable);
    decode_pdl: every kernel of a decode step that can be, launched early (`launches`), in steps of at most
    decode_pdl_rows rows (None: any)."""

    def __init__(self, device: torch.device, max_batch_tokens: int, max_lora_rank: int, kernel_choice=None,
                 fuse_groups: bool = False, pdl: bool = False, decode_pdl: bool = False,
                 decode_pdl_rows: int | None = None):
        from lorad.gpu_ops import bgmv, fp8_gemm, fused, gemv, launch, mbgmm, mbgmv, paged_attention

        groups = ",lora-groups:qkv|gate-up(mbgmv,mbgmm-shrink)" if fuse_groups else ""
        groups += ",mbgmv-pdl" if pdl else ""
        groups += ",decode-pdl" if decode_pdl else ""
        super().__init__(f"triton[lora:mbgmv|bgmv+mbgmm{groups},paged-attention,fused-norm-rope-silu-gelu,"
                         f"gemv(rows<={gemv.GEMV_MAX_ROWS})]")
        self.decode_choice = kernel_choice
        self._fused, self._paged_attention, self._gemv = fused, paged_attention, gemv
        self._bgmv, self._mbgmv, self._mbgmm, self._fp8_gemm = bgmv, mbgmv, mbgmm, fp8_gemm
        self.fuses_groups, self.pdl, self.decode_pdl, self.decode_pdl_rows = fuse_groups, pdl, decode_pdl, decode_pdl_rows
        self._launch = launch
        self.workspace = torch.empty(bgmv.workspace_numel(max_batch_tokens, max_lora_rank), dtype=torch.float32,
                                     device=device)
        # (x, the FP8 weight it feeds, x's rows quantized for it): left by a norm, taken by linear
        self._quantized = None
        wide_one_row_gemv = fp8_gemm.takes_gemv(1, fp8_gemm.NARROW_OUT_FEATURES + 1, device)
        self.fp8_gemm = GPU_GEMM if wide_one_row_gemv else GPU_GEMM_WIDE_ONE_ROW

    def launches(self, decode: bool, rows: int):
        """A decode step's kernels launched early with decode_pdl (up to decode_pdl_rows rows); any other step's as
        before."""
        fits = self.decode_pdl_rows is None or rows <= self.decode_pdl_rows
        return self._launch.early_launch(decode and self.decode_pdl and fits)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, Fp8Weight):
            quantized = None
            if self._quantized is not None and self._quantized[0] is x and self._quantized[1] is weight:
                quantized, self._quantized = self._quantized[2], None
            return self._fp8_gemm.fp8_linear(x, weight, bias, quantized)
        if 0 < x.shape[0] <= self._gemv.GEMV_MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous():  # 0: a step that samples no row
            return self._gemv.gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def _quantizes_for(self, feeds, tokens: int) -> bool:
        """Whether the kernel writing the input of `feeds` quantizes its rows too: an FP8 weight whose GEMM takes
        quantized rows (not the gemv, which reads x in its own dtype)."""
        return (isinstance(feeds, Fp8Weight)
                and not self._fp8_gemm.takes_gemv(tokens, feeds.weight.shape[0], feeds.device))

    def _keep_quantized(self, x, feeds, rows, scale):
        self._quantized = (x, feeds, (rows, scale))
        return x

    def rms_norm(self, x, weight, eps, feeds=None):
        if self._quantizes_for(feeds, x.shape[0]):
            normed, rows, scale = self._fused.rms_norm_fp8(x, weight, eps, feeds.input_scale)
            return self._keep_quantized(normed, feeds, rows, scale)
        return self._fused.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps, feeds=None):
        if self._quantizes_for(feeds, h.shape[0]):
            h, normed, rows, scale = self._fused.add_rms_norm_fp8(h, delta, weight, eps, feeds.input_scale)
            return h, self._keep_quantized(normed, feeds, rows, scale)
        return self._fused.add_rms_norm(h, delta, weight, eps)

    def rope_qk(self, q, k, cos, sin):
        return self._fused.rope_qk(q, k, cos, sin, inplace=True)

    def silu_mul(self, gate, up):
        return self._fused.silu_mul(gate, up)

    def gelu_tanh_mul(self, gate, up):
        return self._fused.gelu_tanh_mul(gate, up)

    def write_kv(self, kv_view, layer, k, v, attention):
        self._paged_attention.write_kv(kv_view, layer, k, v, attention, self.kv_scales)

    def attention(self, q, kv_view, layer, attention, scale, window=None, softcap=None):
        return self._paged_attention.attention(q, kv_view, layer, attention, scale, kv_scales=self.kv_scales,
                                               window=window, softcap=softcap)

    def prepare_lora(self, batch, table):
        mark_untargeted(batch, table)
        if batch.slot_rows:
            batch.segments = self._mbgmm.Segments.build(batch, table)
            batch.max_rank = batch.segments.max_rank
            if batch.decode and self.decode_choice is not None:
                batch.decode_kernel = self.decode_choice.choose(row_ranks(batch, table))

    def pool_lora(self, x, y, layer, proj, batch, table):
        if batch.max_rank == 0:  # no row uses an adapter
            return
        if batch.decode:
            if batch.decode_kernel == "bgmv":
                self._bgmv.bgmv(x, y, layer, proj, batch.row_slot, table, batch.max_rank, self.workspace)
            else:
                self._mbgmv.lora_decode(x, y, layer, proj, batch, table, max_rank=batch.max_rank, workspace=self.workspace,
                                  pdl=self.pdl)
        else:
            self._mbgmm.lora_prefill(x, y, layer, proj, batch, table, segments=batch.segments, workspace=self.workspace)
            if batch.one_row_slot is not None:  # a mixed step's decode rows, not in MBGMM's segments
                rows = batch.one_row_slot.shape[0]
                # not launched early: beside MBGMM the early expand's tiles took 1.2x as long (BENCHMARKS.md, MBGMM)
                self._mbgmv.mbgmv(x[:rows], y[:rows], layer, proj, batch.one_row_slot, table, batch.max_rank,
                                  self.workspace, pdl=False)

    def lora_group(self, x, fused, outs, layer, first, batch, table):
        """With fuse_groups, a decode step's group in one MBGMV launch pair where the members' tiles agree (none
        where no member is targeted); a step's prompt rows in one MBGMM shrink launch where the members share their
        input (mbgmm.group_fits), and a mixed step's decode rows then in one MBGMV launch pair; otherwise one
        projection after another."""
        if self.fuses_groups and batch.max_rank and not batch.cpu_spans:
            if batch.untargeted.issuperset(range(first, first + len(outs))):
                return
            if batch.decode and batch.decode_kernel == "mbgmv":
                config = self._mbgmv.group_fits(table, first, len(outs), batch.max_rank, pdl=self.pdl)
                if config is not None:
                    self._mbgmv.mbgmv_group(x, fused, layer, first, len(outs), batch.row_slot, table, batch.max_rank,
                                            self.workspace, config=config, pdl=self.pdl)
                    return
            elif not batch.decode:
                members = len(outs)
                config = None
                if batch.one_row_slot is not None:
                    config = self._mbgmv.group_fits(table, first, members, batch.max_rank)
                    if config is None:
                        return super().lora_group(x, fused, outs, layer, first, batch, table)
                if self._mbgmm.group_fits(table, first, members):
                    self._mbgmm.mbgmm_group(x, fused, layer, first, members, batch.segments, table, self.workspace,
                                            untargeted=batch.untargeted)
                else:
                    for member, out in enumerate(outs):
                        if first + member not in batch.untargeted:
                            self._mbgmm.lora_prefill(x, out, layer, first + member, batch, table,
                                                     segments=batch.segments, workspace=self.workspace)
                if config is not None:
                    rows = batch.one_row_slot.shape[0]
                    self._mbgmv.mbgmv_group(x[:rows], fused[:rows], layer, first, members, batch.one_row_slot, table,
                                            batch.max_rank, self.workspace, config=config, pdl=False)  # as above
                return
        super().lora_group(x, fused, outs, layer, first, batch, table)


def mark_untargeted(batch: LoraBatch, table: AdapterTable) -> None:
    """batch.untargeted: the projections none of its pool rows' adapters targets (their LoRA is not launched)."""
    if batch.slot_rows:
        batch.untargeted = table.untargeted([slot for slot, _ in batch.slot_rows])


def row_ranks(batch: LoraBatch, table: AdapterTable) -> list[int]:
    """The largest rank of each adapter row's adapter (what the decode kernel choice weighs, row by row)."""
    return [int(table.rank_host[slot].max()) for slot, rows in batch.slot_rows for _ in range(rows.numel())]


def select_ops(device: torch.device, max_batch_tokens: int, max_lora_rank: int, kernel_choice=None,
               fuse_groups: bool = False, pdl: bool = False, decode_pdl: bool = False,
               decode_pdl_rows: int | None = None) -> TorchOps:
    """TritonOps on cuda where Triton works; TorchOps elsewhere, named with the reason on a GPU."""
    if device.type != "cuda":
        return TorchOps(kernel_choice=kernel_choice)
    try:
        from lorad.gpu_ops.launch import require_triton

        require_triton("LoRA kernels")
    except (ImportError, RuntimeError) as error:
        return TorchOps(f"torch-reference (triton unavailable: {error})", kernel_choice)
    return TritonOps(device, max_batch_tokens, max_lora_rank, kernel_choice, fuse_groups, pdl, decode_pdl,
                     decode_pdl_rows)
