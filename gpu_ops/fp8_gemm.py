"""The FP8 GEMM on the GPU (weights: gpu_ops/fp8.py's `Fp8Weight`):

- `quantize_rows`: x [T, K] -> FP8 rows and their float32 scales [T, 1], a Triton kernel (each row's amax / 448, or a
  checkpoint's static scale); drop-in for `fp8.quantize_rows_ref`.
- `fp8_linear`: x @ W^T. The rows quantized per token and multiplied with the row scales and the weight's channel
  scales (capturable in a CUDA graph): decode batches by `fp8_rows_gemm` (`takes_rows_kernel`: up to
  `ROWS_KERNEL_MAX_ROWS` rows, up to `NARROW_MAX_ROWS` for a projection of at most `NARROW_OUT_FEATURES` columns), more
  by `torch._scaled_mm` (rowwise scaling, fast accumulation: `SCALED_MM_FAST_ACCUM`, bf16 output). One row (batch-1
  decode) goes to the gemv kernel instead (gpu_ops/gemv.py with the channel scales): a pass over the FP8 weight
  bytes with x kept in bf16, where a GEMM launch would pad the row to a tile; but on the GPUs of
  `ONE_ROW_ROWS_KERNEL_GPUS` a projection wider than `NARROW_OUT_FEATURES` takes the rows kernel at one row too
  (`takes_gemv`). The rows may come quantized already, by the norm that wrote them (gpu_ops/fused.py). Its
  reference is `fp8.scaled_mm_ref` (several rows) or `fp8.fp8_linear_ref` (one).
- `fp8_rows_gemm`: the FP8 GEMM of a decode batch, a Triton kernel: tiles of 64 rows by 64 output columns (16 by
  32 for up to 16 rows), K read 256 deep through six stages, the FP8 products on the tensor cores, added into
  float32 every 256 of K (as cuBLAS's accumulation without fast accumulation), the scales and the bias applied once
  at the end. At these rows a projection is a pass over its weight bytes, and cuBLAS's kernel for them (tiles 128
  columns wide) leaves o and down (4096 columns) on 32 programs of the H100's 132 SMs. A 7B layer's four
  projections take 0.72-0.86x torch._scaled_mm's time at 2-64 rows (o 0.65-0.77x, down 0.55-0.71x; `python3
  bench/fp8_rows.py`, bench/results/fp8_rows_h100.json). At 128 rows it takes 1.6-1.8x cuBLAS's time on q|k|v and
  gate|up, which stay with cuBLAS there, and 0.77x on o and down (bench/results/fp8_rows_12b89ab_h100.json).

Roofline of one projection: bytes = in * out (FP8) + 4 * out (scales) + the rows; flops = 2 * rows * in * out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lorad.gpu_ops import gemv
from lorad.gpu_ops.fp8 import FP8, Fp8Weight
from lorad.gpu_ops.launch import cdiv, early_options, launching_early, named_gpu, next_power_of_2, require_triton

try:
    import triton
    import triton.language as tl

    from lorad.gpu_ops.launch import let_dependents_start, wait_for_previous
except ImportError:  # the CPU engine runs the references only
    triton = None

__all__ = ["NARROW_MAX_ROWS", "NARROW_OUT_FEATURES", "ONE_ROW_ROWS_KERNEL_GPUS", "ROWS_KERNEL_MAX_ROWS", "RowsGemmConfig",
           "SCALED_MM_FAST_ACCUM", "fp8_linear", "fp8_rows_gemm", "quantize_rows", "rows_gemm_config", "takes_gemv",
           "takes_rows_kernel"]

ROWS_KERNEL_MAX_ROWS = 64  # rows up to which fp8_linear takes fp8_rows_gemm for every projection (more: torch._scaled_mm)
# ... and up to which for a projection of at most NARROW_OUT_FEATURES output columns: at 128 rows the 7B shape's o and
# down took 11.0 and 24.2 us against cuBLAS's 14.3 and 31.3 (fast accumulation; cuBLAS's tiles 128 columns wide put
# 4096 columns on 32 of the H100's 132 SMs), where q|k|v and gate|up took 1.6-1.8x cuBLAS's time (`python3
# bench/fp8_rows.py --rows 2,64,128`, bench/results/fp8_rows_12b89ab_h100.json; past 128 rows not measured)
NARROW_MAX_ROWS = 128
NARROW_OUT_FEATURES = 4096
# torch._scaled_mm's products summed in the tensor cores' own FP8 accumulator (fast accumulation), as vLLM's CUTLASS
# FP8 GEMMs for Hopper do: a 7B layer's projections 1.08x faster at 1152 rows (a mixed step), 1.04-1.10x at
# 128-2048, for a relative error against the float64 product of 0.0020-0.0028 instead of 0.0017 (the bf16
# output's rounding), a tenth of the activations' FP8 rounding (bench/results/fp8_fast_accum_h100.json)
SCALED_MM_FAST_ACCUM = True
# GPUs (a word of the device's name) on which one row of a projection wider than NARROW_OUT_FEATURES (q|k|v, gate|up)
# goes to the rows kernel, quantized, instead of the gemv: on one H200 the 7B shape's q|k|v took 18.5 us and gate|up
# 27.1 that way (the row's quantization launched apart; the norm before them now writes it) against the gemv's 19.3 and
# 31.8, where o and down are even or the gemv's (`python3 bench/gemv.py --fp8`, bench/results/gemv_fp8_h200.json). On
# the H100 the gemv is the faster on all four (gemv_fp8_h100.json).
ONE_ROW_ROWS_KERNEL_GPUS = ("H200",)


@dataclass(frozen=True)
class RowsGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def rows_gemm_config(rows: int, k: int, n: int, shared_memory: int) -> RowsGemmConfig:
    """Tiles by the projection's width, chosen from the sweeps of the 7B projections on the H100 and the H200
    (`python3 bench/fp8_rows.py --sweep`; bench/results/fp8_rows_sweep_h100.json, fp8_rows_sweep_h200.json) where
    one tile served all before (64 by 64, K 256 deep, six stages; 16 by 32 up to 16 rows):
    - at most NARROW_OUT_FEATURES columns (o, down) up to 64 rows: 64 rows by 32 columns, K 256 deep, six stages;
      on 4096 columns that is 128 programs where 64-column tiles leave half of the SMs idle;
    - wider (q|k|v, gate|up) up to 16 rows: 16 by 64, K 256 deep, three stages;
    - wider past 16 rows: 64 by 64, K 128 deep, four stages;
    - o and down past 64 rows (fp8_linear's NARROW_MAX_ROWS): 64 by 64, K 256 deep, six stages, as before.
    Beside the one tile in one run on the H200 (`python3 bench/fp8_rows.py --rows 2,16,64,128`,
    bench/results/fp8_rows_h200.json) a 7B layer's four projections take 0.93x its time at 2 and 16 rows and 0.86x at
    64 (73.2 against 84.7 us), every projection faster but q|k|v up to 16 rows (17.6-17.9 against 17.0-17.4 us); on
    the H100's sweep each is as fast or faster (at 64 rows o 9.5 against 10.8 us, down 20.5 against 21.7, q|k|v 23.4
    against 24.6, gate|up 39.0 against 40.0). Stages: fewer where the device's shared memory per block
    (`shared_memory`, bytes) holds fewer; K read no deeper than it is (at least 32: one FP8 MMA's depth)."""
    if n <= NARROW_OUT_FEATURES:
        block_m, block_n, block_k, stages = (64, 32, 256, 6) if rows <= 64 else (64, 64, 256, 6)
    else:
        block_m, block_n, block_k, stages = (16, 64, 256, 3) if rows <= 16 else (64, 64, 128, 4)
    block_k = max(32, min(block_k, next_power_of_2(k)))
    stage_bytes = (block_m + block_n) * block_k  # one FP8 byte an element
    stages = max(2, min(stages, shared_memory // stage_bytes - 1))
    return RowsGemmConfig(block_m, block_n, block_k, 4, stages)


@functools.lru_cache(maxsize=None)
def _shared_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return 228 * 1024  # the interpreter: the H100's, so the configuration is the one it would compile

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, static_ptr, K, stride_x, stride_out,
                              STATIC: tl.constexpr, BLOCK: tl.constexpr, EARLY: tl.constexpr):
        """One program per row: its amax (a first pass over the row, skipped with a static scale), then the
        row over its scale, saturated, in FP8. EARLY: launched early (gpu_ops/launch.py), as the GEMM below."""
        let_dependents_start(EARLY)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        wait_for_previous(EARLY)
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

    @triton.jit
    def _rows_gemm_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K,
                          stride_xm, stride_wn, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, EARLY: tl.constexpr):
        """y[m, n] = x_scale[m] * w_scale[n] * sum_k x[m, k] * w[n, k] (+ bias[n]): x FP8 [M, K], w FP8 [N, K]
        row-major (K-major: the tensor cores' FP8 operand order). A program per tile of BLOCK_M rows by BLOCK_N
        columns over the whole of K, the column tiles first (the programs that run together share x's rows)."""
        let_dependents_start(EARLY)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        wait_for_previous(EARLY)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = k0 + offs_k < K
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            # the tensor cores' FP8 accumulator is narrower than float32: its sums go into acc every BLOCK_K
            acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


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
        early = launching_early()
        _quantize_rows_kernel[(tokens,)](
            x, out, scale, static_scale if static_scale is not None else scale, width, x.stride(0), out.stride(0),
            STATIC=static_scale is not None, BLOCK=block, EARLY=early, num_warps=4 if block <= 1024 else 8,
            **early_options(early),
        )
    return out, scale


def fp8_rows_gemm(rows: torch.Tensor, row_scale: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, config: RowsGemmConfig | None = None) -> torch.Tensor:
    """rows FP8 [T, in] (unit stride along in) with their float32 scales [T, 1] (quantize_rows) times the FP8
    weight [out, in] and its channel scales (+ bias) -> [T, out] in out_dtype; what torch._scaled_mm computes
    with rowwise scales. No host sync; capturable in a CUDA graph. Roofline: bytes = out * in (the weight) +
    T * in + T * out * 2; flops = 2 * T * in * out."""
    require_triton("fp8 rows GEMM kernel")
    tokens, width = rows.shape
    w = weight.weight
    if w.shape[1] != width or not w.is_contiguous() or rows.stride(1) != 1:
        raise ValueError(f"fp8_rows_gemm wants rows [T, K] with unit stride along K and a contiguous weight [N, K]; "
                         f"got rows {tuple(rows.shape)} strides {rows.stride()}, weight {tuple(w.shape)}")
    out = torch.empty(tokens, w.shape[0], dtype=out_dtype, device=rows.device)
    if tokens:
        config = config or rows_gemm_config(tokens, width, w.shape[0], _shared_memory(rows.device))
        grid = (cdiv(w.shape[0], config.block_n), cdiv(tokens, config.block_m))
        early = launching_early()
        _rows_gemm_kernel[grid](
            rows, w, row_scale, weight.scale, bias if bias is not None else weight.scale, out,
            tokens, w.shape[0], width,
            rows.stride(0), w.stride(0), out.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, EVEN_K=width % config.block_k == 0, HAS_BIAS=bias is not None, EARLY=early,
            num_warps=config.num_warps, num_stages=config.num_stages, **early_options(early),
        )
    return out


def takes_gemv(rows: int, out_features: int, device: torch.device) -> bool:
    """Does fp8_linear multiply `rows` rows by a projection of `out_features` columns with the gemv (x in its own
    dtype, not quantized): up to gemv.GEMV_MAX_ROWS rows, but for a projection wider than NARROW_OUT_FEATURES on a GPU
    of ONE_ROW_ROWS_KERNEL_GPUS."""
    return rows <= gemv.GEMV_MAX_ROWS and (out_features <= NARROW_OUT_FEATURES
                                           or named_gpu(device, ONE_ROW_ROWS_KERNEL_GPUS) is None)


def takes_rows_kernel(rows: int, out_features: int) -> bool:
    """Does fp8_linear multiply `rows` rows by a projection of `out_features` columns with fp8_rows_gemm (else
    torch._scaled_mm): up to ROWS_KERNEL_MAX_ROWS rows, and up to NARROW_MAX_ROWS for at most NARROW_OUT_FEATURES."""
    return rows <= ROWS_KERNEL_MAX_ROWS or (rows <= NARROW_MAX_ROWS and out_features <= NARROW_OUT_FEATURES)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, in] @ W^T (+ bias) -> [T, out] in x's dtype, on the GPU: one row through the gemv kernel with the
    channel scales (x in its own dtype: a static activation scale is not needed there; `takes_gemv`), more rows
    quantized per token and multiplied by fp8_rows_gemm (`takes_rows_kernel`) or torch._scaled_mm (rowwise scales,
    fast accumulation, bf16 out). in and out must be multiples of 16 (torch._scaled_mm; checked at load).
    quantized: x's rows already quantized with the weight's activation scale (FP8 [T, in], float32 [T, 1]), as
    the `*_fp8` kernels of gpu_ops/fused.py write them beside x; then no quantization is launched here."""
    if takes_gemv(x.shape[0], weight.weight.shape[0], x.device) and x.stride(-1) == 1:
        return gemv.gemv(x, weight.weight, bias, scale=weight.scale)
    if quantized is not None:
        rows, row_scale = quantized
        if rows.shape != x.shape or rows.dtype != FP8 or row_scale.shape != (x.shape[0], 1):
            raise ValueError(f"quantized rows {tuple(rows.shape)} {rows.dtype} and scales {tuple(row_scale.shape)} "
                             f"do not match x {tuple(x.shape)}")
    else:
        rows, row_scale = quantize_rows(x if x.stride(-1) == 1 else x.contiguous(), weight.input_scale)
    if takes_rows_kernel(x.shape[0], weight.weight.shape[0]):
        return fp8_rows_gemm(rows, row_scale, weight, bias, x.dtype)
    out = torch._scaled_mm(rows, weight.weight.t(), scale_a=row_scale, scale_b=weight.scale.view(1, -1),
                           out_dtype=torch.bfloat16, use_fast_accum=SCALED_MM_FAST_ACCUM)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if bias is not None:
        out += bias
    return out
