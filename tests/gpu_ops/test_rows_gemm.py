"""The decode-batch projection kernel (gpu_ops/rows_gemm.py) against float64 truth and F.linear, on fresh random
inputs: in Triton's CPU interpreter on small shapes with ragged rows, N and K (CI, when triton imports), and
compiled on the Llama-2-7B shapes at the decode graphs' batch sizes (`pytest -m gpu`). Outputs are filled with NaN
first, so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import needs_interpreter, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import rows_gemm as rows_gemm_module  # noqa: E402

# Relative error vs float64: float32 accumulation over K, one rounding of the output.
LIMIT = {torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
SHAPES_7B = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]  # qkv, o, gate|up, down


@pytest.fixture(scope="module")
def kernels():
    interpreted(rows_gemm_module._rows_gemm_kernel, rows_gemm_module)
    return rows_gemm_module


def check(kernels, m, n, k, dtype, device, seed, bias=False, config=None):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(dtype).to(device)
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype).to(device)
    b = torch.randn(n, generator=generator).to(dtype).to(device) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    got = kernels.rows_gemm(x, weight, b, config=config, out=out)
    assert got is out and not torch.isnan(got).any(), "NaN in the output: an unwritten element"
    truth = x.double() @ weight.double().t() + (b.double() if bias else 0)
    error = float((got.double() - truth).norm() / truth.norm())
    assert error <= LIMIT[dtype], (m, n, k, dtype, error)
    reference = F.linear(x, weight, b)
    reference_error = float((reference.double() - truth).norm() / truth.norm())
    assert error <= max(LIMIT[dtype], 2 * reference_error)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rows_gemm_interpreted(kernels, dtype):
    small = kernels.RowsConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
    for seed, (m, n, k, bias) in enumerate([(1, 37, 200, False), (5, 64, 128, True), (17, 9, 64, True),
                                            (33, 50, 96, False)]):
        check(kernels, m, n, k, dtype, torch.device("cpu"), seed, bias=bias, config=small)
    check(kernels, 3, 24, 96, dtype, torch.device("cpu"), 9)  # the default tiles: wider than N, K masked


@needs_interpreter
def test_rows_gemm_refuses_what_it_does_not_take(kernels):
    with pytest.raises(ValueError, match="T <= 128"):
        kernels.rows_gemm(torch.randn(129, 16), torch.randn(8, 16))
    with pytest.raises(ValueError, match="unit stride"):
        kernels.rows_gemm(torch.randn(16, 4).t(), torch.randn(8, 4))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.rows_gemm(torch.randn(4, 16), torch.randn(16, 8).t())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 16, 48, 64, 96, 128])
def test_rows_gemm_gpu(rows):
    for seed, (n, k) in enumerate(SHAPES_7B):
        check(rows_gemm_module, rows, n, k, torch.bfloat16, torch.device("cuda"), seed, bias=seed == 1)
        config = rows_gemm_module.RowsConfig(128, 64, 8, 4)
        check(rows_gemm_module, rows, n, k, torch.float16, torch.device("cuda"), seed + 10, config=config)
