"""Fused element-wise kernels of the decoder layer: RMSNorm, the residual add with the RMSNorm after it,
RoPE on q and k together, SiLU(gate) * up and Gemma's GELU(gate) * up (tanh GELU). Each replaces several PyTorch launches (and their
intermediate tensors) by one pass over the rows; the references are `rms_norm_ref` and
`add_rms_norm_ref` (gpu_ops/norm.py), `rope_qk_ref` (from apply_rope_ref in gpu_ops/rope.py) and
`silu_mul_ref`, `gelu_tanh_mul_ref`. All are memory-bound: one read and one write of each row.

The `*_fp8` forms of the norms also quantize the rows they write for the FP8 GEMM that reads them (q|k|v's,
gate|up's; gpu_ops/fp8_gemm.py) in the same pass, from the registers that hold the row: each row over its amax / 448
(or a checkpoint's static scale), what `fp8.quantize_rows_ref` gives for the rows stored, where a quantization
launch of its own read them again (references: `rms_norm_fp8_ref`, `add_rms_norm_fp8_ref`). The gated activations
have no such form: at decode batches a program per row (the amax wants the whole row) left half of the SMs idle,
and SiLU * up with the quantization in one kernel took longer than the two launches it replaced (BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lorad.gpu_ops.fp8 import FP8, quantize_rows_ref
from lorad.gpu_ops.launch import cdiv, early_options, launching_early, next_power_of_2, require_triton
from lorad.gpu_ops.norm import add_rms_norm_ref, rms_norm_ref
from lorad.gpu_ops.rope import apply_rope_ref

try:
    import triton
    import triton.language as tl

    from lorad.gpu_ops.launch import let_dependents_start, wait_for_previous
except ImportError:  # the CPU engine runs the references only
    triton = None

__all__ = ["add_rms_norm", "add_rms_norm_fp8", "add_rms_norm_fp8_ref", "gelu_tanh_mul", "gelu_tanh_mul_ref", "rms_norm",
           "rms_norm_fp8", "rms_norm_fp8_ref", "rope_qk", "rope_qk_ref", "silu_mul", "silu_mul_ref"]

SILU_BLOCK = 1024


def _warps(elements: int) -> int:
    return max(1, min(16, elements // 512))


if triton is not None:

    @triton.jit
    def _store_scaled(normed, weight_ptr, out_row_ptr, cols, ok, SCALE_F32: tl.constexpr):
        """The float32 normed row times the weight, stored; -> the stored row in float32. Llama (a weight of the
        row's dtype): the normed row is rounded to that dtype before the scale; Gemma (SCALE_F32, a float32 weight):
        scaled in float32, rounded once."""
        if not SCALE_F32:
            normed = normed.to(out_row_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        stored = (normed * weight).to(out_row_ptr.dtype.element_ty)
        tl.store(out_row_ptr + cols, stored, mask=ok)
        return stored.to(tl.float32)

    @triton.jit
    def _row_scale(amax, static_ptr, STATIC: tl.constexpr):
        """A row's FP8 scale: its amax / 448, or the static scale."""
        if STATIC:
            return tl.load(static_ptr)
        return tl.maximum(amax, 1e-12) / 448.0  # fp8.MIN_AMAX, fp8.FP8_MAX

    @triton.jit
    def _store_fp8(values, scale, rows_row_ptr, cols, ok):
        """values (float32) over the row's scale, saturated to +-448, stored as FP8."""
        quantized = tl.minimum(tl.maximum(values / scale, -448.0), 448.0)
        tl.store(rows_row_ptr + cols, quantized.to(rows_row_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _norm_fp8_kernel(h_ptr, delta_ptr, weight_ptr, out_ptr, rows_ptr, scale_ptr, static_ptr, stride_ht, stride_dt,
                         stride_ot, stride_rt, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SCALE_F32: tl.constexpr,
                         ADD: tl.constexpr, STATIC: tl.constexpr, EARLY: tl.constexpr):
        """rms_norm (ADD false: h is x) or add_rms_norm, the stored rows then quantized to FP8 from registers.
        EARLY: launched early (gpu_ops/launch.py), as every kernel here."""
        let_dependents_start(EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < HIDDEN
        wait_for_previous(EARLY)
        if ADD:
            delta = tl.load(delta_ptr + row * stride_dt + cols, mask=ok, other=0.0).to(tl.float32)
            stored = _add_norm_row(h_ptr + row * stride_ht, delta, weight_ptr, out_ptr + row * stride_ot, cols, ok, eps,
                                   HIDDEN, SCALE_F32)
        else:
            x = tl.load(h_ptr + row * stride_ht + cols, mask=ok, other=0.0).to(tl.float32)
            stored = _norm_row(x, weight_ptr, out_ptr + row * stride_ot, cols, ok, eps, HIDDEN, SCALE_F32)
        scale = _row_scale(tl.max(tl.where(ok, tl.abs(stored), 0.0), axis=0), static_ptr, STATIC)
        tl.store(scale_ptr + row, scale)
        _store_fp8(stored, scale, rows_ptr + row * stride_rt, cols, ok)

    @triton.jit
    def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_xt, stride_ot, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                         SCALE_F32: tl.constexpr, EARLY: tl.constexpr):
        let_dependents_start(EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < HIDDEN
        wait_for_previous(EARLY)
        x = tl.load(x_ptr + row * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
        _norm_row(x, weight_ptr, out_ptr + row * stride_ot, cols, ok, eps, HIDDEN, SCALE_F32)

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, delta_ptr, weight_ptr, out_ptr, stride_ht, stride_dt, stride_ot, eps,
                             HIDDEN: tl.constexpr, BLOCK: tl.constexpr, SCALE_F32: tl.constexpr, EARLY: tl.constexpr):
        let_dependents_start(EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < HIDDEN
        wait_for_previous(EARLY)
        delta = tl.load(delta_ptr + row * stride_dt + cols, mask=ok, other=0.0).to(tl.float32)
        _add_norm_row(h_ptr + row * stride_ht, delta, weight_ptr, out_ptr + row * stride_ot, cols, ok, eps, HIDDEN,
                      SCALE_F32)

    @triton.jit
    def _add_norm_row(h_row_ptr, delta, weight_ptr, out_row_ptr, cols, ok, eps, HIDDEN: tl.constexpr,
                      SCALE_F32: tl.constexpr):
        """h_row += delta (a float32 row) in place, then its RMSNorm stored at out_row_ptr; -> the stored norm in
        float32. The sum is rounded to the residual's dtype, as `h + delta` is, and normalised from that value."""
        h = tl.load(h_row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        h = (h + delta).to(h_row_ptr.dtype.element_ty)
        tl.store(h_row_ptr + cols, h, mask=ok)
        return _norm_row(h.to(tl.float32), weight_ptr, out_row_ptr, cols, ok, eps, HIDDEN, SCALE_F32)

    @triton.jit
    def _norm_row(x, weight_ptr, out_row_ptr, cols, ok, eps, HIDDEN: tl.constexpr, SCALE_F32: tl.constexpr):
        """x (a float32 row) normalised by its RMS and stored at out_row_ptr; -> the stored norm in float32."""
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
        return _store_scaled(x * rstd, weight_ptr, out_row_ptr, cols, ok, SCALE_F32)

    @triton.jit
    def _rope_rows(x_ptr, out_ptr, token, stride_t, stride_h, stride_ot, stride_oh, cos1, cos2, sin1, sin2,
                   HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        heads = tl.arange(0, HEADS_PAD)
        offs = tl.arange(0, HALF_PAD)
        mask = (heads < HEADS)[:, None] & (offs < HALF)[None, :]
        first = x_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
        out = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs[None, :]
        tl.store(out, (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, positions_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cos,
        HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_POSITIONS: tl.constexpr, EARLY: tl.constexpr,
    ):
        let_dependents_start(EARLY)
        token = tl.program_id(0).to(tl.int64)
        wait_for_previous(EARLY)
        if HAS_POSITIONS:
            position = tl.load(positions_ptr + token).to(tl.int64)
        else:
            position = token  # cos, sin already hold each token's row
        offs = tl.arange(0, HALF_PAD)
        ok = offs < HALF
        row = position * stride_cos + offs
        cos1 = tl.load(cos_ptr + row, mask=ok, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(cos_ptr + row + HALF, mask=ok, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(sin_ptr + row, mask=ok, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(sin_ptr + row + HALF, mask=ok, other=0.0).to(tl.float32)[None, :]
        _rope_rows(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos1, cos2, sin1, sin2, HEADS, HEADS_PAD, HALF, HALF_PAD)
        _rope_rows(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos1, cos2, sin1, sin2, KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gt, stride_ut, stride_ot, width, BLOCK: tl.constexpr,
                         EARLY: tl.constexpr):
        let_dependents_start(EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        wait_for_previous(EARLY)
        gate = tl.load(gate_ptr + row * stride_gt + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * stride_ut + cols, mask=ok, other=0.0).to(tl.float32)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_ot + cols, act.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gelu_tanh_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_gt, stride_ut, stride_ot, width, BLOCK: tl.constexpr,
                              EARLY: tl.constexpr):
        let_dependents_start(EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        wait_for_previous(EARLY)
        gate = tl.load(gate_ptr + row * stride_gt + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * stride_ut + cols, mask=ok, other=0.0).to(tl.float32)
        # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(z) = 1 - 2 / (1 + e^(2z)): exact at both ends
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (1.0 + tl.exp2(2.8853900817779268 * inner))  # e^(2z) = 2^(2 log2(e) z)
        act = 0.5 * gate * (1.0 + tanh) * up
        tl.store(out_ptr + row * stride_ot + cols, act.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be [T, n] with unit stride along n, got {tuple(x.shape)} strides {x.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `rms_norm_ref`: x [T, hidden] (rows may be strided), weight [hidden] -> [T, hidden] of
    x's dtype. One program per row. Bytes: 2 * T * hidden * element size (+ the weight, cached)."""
    _norm_inputs(x, weight)
    tokens, hidden = x.shape
    if out is None:
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens:
        block = next_power_of_2(hidden)
        early = launching_early()
        _rms_norm_kernel[(tokens,)](x, weight, out, x.stride(0), out.stride(0), eps, HIDDEN=hidden, BLOCK=block,
                                    SCALE_F32=weight.dtype == torch.float32, EARLY=early, num_warps=_warps(block),
                                    **early_options(early))
    return out


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `add_rms_norm_ref`: h += delta (in place, h [T, hidden] contiguous rows), then
    -> (h, rms_norm(h)). One program per row. Bytes: 4 * T * hidden * element size (read h and delta,
    write h and the normed rows)."""
    _norm_inputs(h, weight, delta)
    tokens, hidden = h.shape
    out = torch.empty(tokens, hidden, dtype=h.dtype, device=h.device)
    if tokens:
        block = next_power_of_2(hidden)
        early = launching_early()
        _add_rms_norm_kernel[(tokens,)](h, delta, weight, out, h.stride(0), delta.stride(0), out.stride(0), eps,
                                        HIDDEN=hidden, BLOCK=block, SCALE_F32=weight.dtype == torch.float32,
                                        EARLY=early, num_warps=_warps(block), **early_options(early))
    return h, out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, static_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm, and its rows quantized for an FP8 GEMM in the same pass: -> (normed [T, hidden] of x's dtype, FP8
    [T, hidden], float32 scales [T, 1]); the last two are fp8.quantize_rows_ref(normed, static_scale). Bytes: those
    of rms_norm plus T * hidden (the FP8 rows)."""
    _norm_inputs(x, weight)
    return _norm_fp8(x, None, weight, eps, static_scale)


def add_rms_norm_fp8(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                     static_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm, and its normed rows quantized for an FP8 GEMM in the same pass: -> (h, normed, FP8 [T, hidden],
    float32 scales [T, 1]); the last two are fp8.quantize_rows_ref(normed, static_scale). Bytes: those of
    add_rms_norm plus T * hidden."""
    _norm_inputs(h, weight, delta)
    return (h, *_norm_fp8(h, delta, weight, eps, static_scale))


def _norm_inputs(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> None:
    """The norms' checks: rows of unit stride, a weight [hidden], and delta (the residual add's) like x."""
    require_triton("fused kernels")
    _rows(x, "h" if delta is not None else "x")
    if delta is not None:
        _rows(delta, "delta")
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} must match h {tuple(x.shape)} {x.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}")


def _norm_fp8(x, delta, weight, eps, static_scale):
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    rows = torch.empty(tokens, hidden, dtype=FP8, device=x.device)
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens:
        block = next_power_of_2(hidden)
        early = launching_early()
        _norm_fp8_kernel[(tokens,)](
            x, delta if delta is not None else x, weight, out, rows, scale,
            static_scale if static_scale is not None else scale, x.stride(0),
            delta.stride(0) if delta is not None else 0, out.stride(0), rows.stride(0), eps, HIDDEN=hidden, BLOCK=block,
            SCALE_F32=weight.dtype == torch.float32, ADD=delta is not None, STATIC=static_scale is not None,
            EARLY=early, num_warps=_warps(block), **early_options(early),
        )
    return out, rows, scale


def rms_norm_fp8_ref(x, weight, eps, static_scale=None):
    normed = rms_norm_ref(x, weight, eps)
    return (normed, *quantize_rows_ref(normed, static_scale))


def add_rms_norm_fp8_ref(h, delta, weight, eps, static_scale=None):
    h, normed = add_rms_norm_ref(h, delta, weight, eps)
    return (h, normed, *quantize_rows_ref(normed, static_scale))


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (HF Llama's half-split layout) of q [T, heads, head_dim] and k [T, kv_heads,
    head_dim] in one launch, computed in float32 and rounded once.

    cos, sin: the cache [max_positions, rotary_dim] (`rope_cache`) with positions: int [T] on the device,
    or, with positions None, the rows already gathered per token ([T, rotary_dim], as apply_rope_ref takes).
    rotary_dim is head_dim, or less (partial_rotary_factor): the dimensions past it are kept as they are.
    q and k may be strided views (e.g. of a fused qkv output) with unit stride along head_dim;
    inplace=True rotates them where they are and returns them, else new contiguous tensors.
    Bytes: 2 * T * (heads + kv_heads) * head_dim * element size + the cos/sin rows.
    """
    require_triton("fused kernels")
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != (tokens, kv_heads, head_dim) or q.stride(2) != 1 or k.stride(2) != 1 or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, head_dim] with unit stride on an even head_dim")
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] > head_dim or cos.shape[1] % 2
            or cos.stride(1) != 1 or sin.stride(1) != 1):
        raise ValueError(f"cos and sin must be [rows, an even rotary_dim <= {head_dim}] with unit stride, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if positions is None and cos.shape[0] != tokens:
        raise ValueError(f"without positions, cos and sin must hold one row per token ({tokens}), got {cos.shape[0]}")
    rotary = cos.shape[1]
    if inplace:
        q_out, k_out = q, k
    elif rotary == head_dim:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    else:  # the kernel writes only the rotated dimensions
        q_out, k_out = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
    if tokens:
        half = rotary // 2
        early = launching_early()
        _rope_qk_kernel[(tokens,)](
            q, k, q_out, k_out, cos, sin, positions if positions is not None else cos,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos.stride(0),
            HEADS=heads, HEADS_PAD=next_power_of_2(heads), KV_HEADS=kv_heads, KV_HEADS_PAD=next_power_of_2(kv_heads),
            HALF=half, HALF_PAD=next_power_of_2(half), HAS_POSITIONS=positions is not None, EARLY=early,
            num_warps=_warps(next_power_of_2(heads) * next_power_of_2(half)), **early_options(early),
        )
    return q_out, k_out


def rope_qk_ref(q, k, cos, sin, positions=None, *, inplace: bool = False):
    """`rope_qk` through apply_rope_ref (the model dtype throughout, as HF computes it)."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    q_out, k_out = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
    if inplace:
        q.copy_(q_out)
        k.copy_(k_out)
        return q, k
    return q_out, k_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(gate) * up -> [T, n] of gate's dtype; gate, up [T, n] may be column slices of a fused gate_up
    output. Computed in float32, rounded once. Bytes: 3 * T * n * element size."""
    return _gated(_silu_mul_kernel, gate, up, out)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma's GeGLU: GELU(gate) with the tanh approximation (HF's gelu_pytorch_tanh) * up; shapes, precision
    and bytes as `silu_mul`."""
    return _gated(_gelu_tanh_mul_kernel, gate, up, out)


def _gated(kernel, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    require_triton("fused kernels")
    _rows(gate, "gate")
    _rows(up, "up")
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    tokens, width = gate.shape
    if out is None:
        out = torch.empty(tokens, width, dtype=gate.dtype, device=gate.device)
    if tokens:
        grid = (tokens, cdiv(width, SILU_BLOCK))
        early = launching_early()
        kernel[grid](gate, up, out, gate.stride(0), up.stride(0), out.stride(0), width, BLOCK=SILU_BLOCK, EARLY=early,
                     num_warps=4, **early_options(early))
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    result = F.silu(gate) * up
    if out is not None:
        out.copy_(result)
        return out
    return result



def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    result = F.gelu(gate, approximate="tanh") * up
    if out is not None:
        out.copy_(result)
        return out
    return result
