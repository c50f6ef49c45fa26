"""The FP8 GEMM on the GPU (weights: gpu_ops/fp8.py's `Fp8Weight`):

- `quantize_rows`: x [T, K] -> FP8 rows and their float32 scales [T, 1], a Triton kernel (each row's amax / 448, or a
  checkpoint's static scale); drop-in for `fp8.quantize_rows_ref`.
- `fp8_linear`: x @ W^T. The rows quantized per token and multiplied by `torch._scaled_mm` with the row scales and
  the weight's channel scales (rowwise scaling, bf16 output; capturable in a CUDA graph). One row (batch-1 decode)
  goes to the gemv kernel instead (gpu_ops/gemv.py with the channel scales): a pass over the FP8 weight bytes
  with x kept in bf16, where a GEMM launch would pad the row to a tile. Its reference is `fp8.scaled_mm_ref`
  (several rows) or `fp8.fp8_linear_ref` (one).

Roofline of one projection: bytes = in * out (FP8) + 4 * out (scales) + the rows; flops = 2 * rows * in * out.
"""

from __future__ import annotations

import torch

from lorad.gpu_ops import gemv
from lorad.gpu_ops.fp8 import FP8, Fp8Weight
from lorad.gpu_ops.launch import next_power_of_2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs the references only
    triton = None

__all__ = ["fp8_linear", "quantize_rows"]

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, static_ptr, K, stride_x, stride_out,
                              STATIC: tl.constexpr, BLOCK: tl.constexpr):
        """One program per row: its amax (a first pass over the row, skipped with a static scale), then the
        row over its scale, saturated, in FP8."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
                amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
            scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            ok = k0 + offs < K
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=ok, other=0.0)
            q = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
            tl.store(out_ptr + row * stride_out + k0 + offs, q.to(out_ptr.dtype.element_ty), mask=ok)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `quantize_rows_ref`: x [T, K] (unit stride along K) -> (FP8 [T, K], float32 [T, 1]).
    One launch, a program per row; bytes: T * K * (element size + 1) (+ T * K * element size for the amax
    pass). No host sync."""
    require_triton("fp8 row quantization kernel")
    tokens, width = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along K, got strides {x.stride()}")
    out = torch.empty(tokens, width, dtype=FP8, device=x.device)
    scale = torch.empty(tokens, 1, dtype=torch.float32, device=x.device)
    if tokens:
        block = min(4096, next_power_of_2(width))
        _quantize_rows_kernel[(tokens,)](
            x, out, scale, static_scale if static_scale is not None else scale, width, x.stride(0), out.stride(0),
            STATIC=static_scale is not None, BLOCK=block, num_warps=4 if block <= 1024 else 8,
        )
    return out, scale


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ W^T (+ bias) -> [T, out] in x's dtype, on the GPU: one row through the gemv kernel with the
    channel scales (x in its own dtype: a static activation scale is not needed there), more rows quantized per token and multiplied by torch._scaled_mm
    (rowwise scales, bf16 out). in and out must be multiples of 16 (torch._scaled_mm; checked at load)."""
    if x.shape[0] <= gemv.GEMV_MAX_ROWS and x.stride(-1) == 1:
        return gemv.gemv(x, weight.weight, bias, scale=weight.scale)
    rows, row_scale = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), weight.input_scale)
    out = torch._scaled_mm(rows, weight.weight.t(), scale_a=row_scale, scale_b=weight.scale.view(1, -1),
                           out_dtype=torch.bfloat16)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out += bias
    return out
