"""The base model's projections for a decode batch in bf16 / fp16: y = x @ W^T (+ bias) for tens of rows, W [N, K]
row-major as checkpoints store it. At these rows the product is a pass over the weight's bytes, and what decides
its time is how evenly the weight's bands are spread over the SMs. A program multiplies all the batch's rows
(up to BLOCK_M, one row tile for the whole batch, so the weight is read once) by a band of BLOCK_N output
columns over the whole of K, K read BLOCK_K deep through num_stages stages, the products on the tensor cores in
float32. The reference is `rows_gemm_ref` (torch's F.linear).

Roofline of one projection: bytes = N * K * e (the weight) + T * (K + N) * e; flops = 2 * T * K * N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lorad.gpu_ops.launch import cdiv, next_power_of_2, require_triton, widen_bf16_dots

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs the reference only
    triton = None

__all__ = ["KERNEL_MAX_ROWS", "RowsConfig", "rows_config", "rows_gemm", "rows_gemm_ref"]

KERNEL_MAX_ROWS = 128  # one row tile: past it the weight would be read once a tile


def rows_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class RowsConfig:
    block_n: int  # output columns per program
    block_k: int  # depth of K per stage
    num_warps: int
    num_stages: int


def rows_config(rows: int, n: int, k: int) -> RowsConfig:
    """The default tiles: bands of 64 columns, K 128 deep, four stages, four warps."""
    return RowsConfig(64, min(128, max(16, next_power_of_2(k))), 4, 4)


def block_m(rows: int) -> int:
    """The row tile holding the whole batch: a power of two, at least 16 (the tensor cores' smallest)."""
    return max(16, next_power_of_2(rows))


if triton is not None:

    @triton.jit
    def _rows_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
        """y[m, n0:n0 + BLOCK_N] = x[m, :] @ w[n0:n0 + BLOCK_N, :]^T (+ bias) for every row m < M: one program a
        band of output columns."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            else:
                k_ok = k0 + offs_k < K
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            if UPCAST:  # the interpreter's bf16 dot (launch.widen_bf16_dots)
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: RowsConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `rows_gemm_ref` on the GPU: x [T, K] (T <= KERNEL_MAX_ROWS, unit stride along K) @ weight [N, K]
    (contiguous, x's dtype) (+ bias [N]) -> [T, N]; out: an optional [T, N] buffer (unit stride along N). One
    launch, no host sync; capturable in a CUDA graph."""
    require_triton("rows GEMM kernel")
    tokens, width = x.shape
    if tokens > KERNEL_MAX_ROWS or x.stride(1) != 1 or not weight.is_contiguous() or weight.shape[1] != width:
        raise ValueError(f"rows_gemm wants x [T <= {KERNEL_MAX_ROWS}, K] with unit stride along K and a contiguous "
                         f"weight [N, K]; got x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    n = weight.shape[0]
    if out is None:
        out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens:
        config = config or rows_config(tokens, n, width)
        _rows_gemm_kernel[(cdiv(n, config.block_n),)](
            x, weight, bias if bias is not None else weight, out, tokens, n, width,
            x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m(tokens), BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, EVEN_K=width % config.block_k == 0, HAS_BIAS=bias is not None,
            UPCAST=widen_bf16_dots(x.dtype, _rows_gemm_kernel), num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out
