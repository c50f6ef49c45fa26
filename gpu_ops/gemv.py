"""The base model's projections for a few rows (batch-1 to batch-4 decode): y = x @ W^T (+ bias), W [N, K]
row-major as checkpoints store it. At so few rows the product is a pass over the weights, and its time is
the weights' bytes over the memory bandwidth it reaches; on the H100 cuBLAS's kernels for these shapes
read at about 2.5-2.7 TB/s (bench/engine_decode.py's kernel table). This kernel streams W once with wide,
coalesced loads along K, each program a band of BLOCK_N output columns over the whole of K (no split-K, so
one launch and no reduction pass: the bands alone give thousands of programs for a 7B layer), and keeps
every row of x's products in float32. The reference is `gemv_ref` (torch's F.linear).

bench/gemv.py measures it against cuBLAS (H100, bench/results/gemv_h100.json): with one row and 4-column
bands read 1024 elements deep it reads the 7B projections at 2.36-2.95 TB/s where cuBLAS reads 2.02-2.62
(o_proj +17%, lm_head +13%, gate|up +11%, qkv +4%, down +4%); with two rows it wins on some shapes and
loses on others, with four it loses on all. So `TritonOps.linear` (daemon/model/ops.py) takes it for one row only
(`GEMV_MAX_ROWS`): batch-1 decode; the kernel itself takes up to `KERNEL_MAX_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lorad.gpu_ops.launch import cdiv, next_power_of_2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs the reference only
    triton = None

__all__ = ["GEMV_MAX_ROWS", "KERNEL_MAX_ROWS", "GemvConfig", "gemv", "gemv_config", "gemv_ref"]

GEMV_MAX_ROWS = 1  # rows (tokens) up to which TritonOps.linear takes this kernel on cuda: where it beat cuBLAS
KERNEL_MAX_ROWS = 4


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # elements of K read per row and iteration
    num_warps: int


def gemv_config(n: int, k: int, element_size: int = 2) -> GemvConfig:
    """Bands of 4 output columns, K read 1024 elements (2 KiB of bf16 a row) per iteration, 4 warps: the
    sweep's best for one row on every 7B and 8B projection but the 8B's qkv (within 3% of its best). An FP8
    weight (element_size 1) is read 2048 elements deep: the same 2 KiB a row."""
    return GemvConfig(4, min(2048 if element_size == 1 else 1024, next_power_of_2(k)), 4)


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_ym,
                     M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < N
        m_ok = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            else:
                k_ok = k < K
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            product = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]  # [BLOCK_M, BLOCK_N, BLOCK_K]
            acc += tl.sum(product, axis=2)
        if HAS_SCALE:  # an FP8 weight's per-output-channel scales (gpu_ops/fp8.py)
            acc *= tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None,
         out: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= KERNEL_MAX_ROWS, unit stride along K), weight [N, K] contiguous, bias [N] or None
    -> y [M, N] in x's dtype (into `out` when given). scale: float32 [N], output column n multiplied by
    scale[n] (an FP8 weight's channel scales; the weight may then be float8_e4m3fn). No host sync; capturable
    in a CUDA graph."""
    require_triton("gemv kernel")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"gemv wants x [M, K] with unit stride along K and a contiguous weight [N, K]; "
                         f"got x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    if not 1 <= m <= KERNEL_MAX_ROWS:
        raise ValueError(f"gemv takes 1..{KERNEL_MAX_ROWS} rows, not {m}")
    config = config or gemv_config(n, k, weight.element_size())
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (cdiv(n, config.block_n),)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, out, n, k,
        x.stride(0), weight.stride(0), out.stride(0), M=m, BLOCK_M=next_power_of_2(m), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, EVEN_K=k % config.block_k == 0, num_warps=config.num_warps,
    )
    return out
