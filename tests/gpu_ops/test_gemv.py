"""The few-row projection kernel (gpu_ops/gemv.py) against float64 truth and F.linear, on fresh random
inputs: in Triton's CPU interpreter on small shapes with ragged N and K (CI, when triton imports), and
compiled on Llama-2-7B and Llama-3-8B shapes (`pytest -m gpu`). Outputs are filled with NaN first, so an
unwritten element fails."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import needs_interpreter, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import gemv as gemv_module  # noqa: E402

# Relative error vs float64: float32 accumulation over K, one rounding of the output.
LIMIT = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
SHAPES_7B = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]  # qkv, o, gate|up, down, lm_head
SHAPES_8B = [(6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.fixture(scope="module")
def kernels():
    interpreted(gemv_module._gemv_kernel, gemv_module)
    return gemv_module


def check(kernels, m, n, k, dtype, device, seed, bias=False, strided=False, config=None):
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + 8, generator=generator)
    x = (wide[:, 3 : 3 + k] if strided else wide[:, :k].contiguous()).to(dtype).to(device)  # strided: rows apart
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype).to(device)
    b = torch.randn(n, generator=generator).to(dtype).to(device) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    got = kernels.gemv(x, weight, b, config=config, out=out)
    assert got is out and not torch.isnan(got).any(), "NaN in the output: an unwritten element"
    truth = x.double() @ weight.double().t() + (b.double() if bias else 0)
    error = float((got.double() - truth).norm() / truth.norm())
    assert error <= LIMIT[dtype], (m, n, k, dtype, error)
    reference = F.linear(x, weight, b)
    reference_error = float((reference.double() - truth).norm() / truth.norm())
    assert error <= max(LIMIT[dtype], 2 * reference_error)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_gemv_interpreted(kernels, dtype):
    small = kernels.GemvConfig(block_n=8, block_k=64, num_warps=4)
    for seed, (m, n, k, bias, strided) in enumerate([(1, 37, 200, False, False), (2, 64, 128, True, True),
                                                     (3, 9, 64, True, False), (4, 50, 300, False, True)]):
        check(kernels, m, n, k, dtype, torch.device("cpu"), seed, bias=bias, strided=strided, config=small)
    check(kernels, 1, 24, 96, dtype, torch.device("cpu"), 9)  # the default tiles: block_k covers K, masked


@needs_interpreter
def test_gemv_refuses_what_it_does_not_take(kernels):
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="1..4 rows"):
        kernels.gemv(x, w)
    with pytest.raises(ValueError, match="contiguous weight"):
        kernels.gemv(x[:2], torch.randn(16, 8).t())
    with pytest.raises(ValueError, match="unit stride"):
        kernels.gemv(torch.randn(16, 2).t(), w)


def test_ops_linear_takes_the_kernel_for_few_rows_only(monkeypatch):
    """TritonOps.linear: gemv up to GEMV_MAX_ROWS rows (one), F.linear beyond (and for a strided x)."""
    pytest.importorskip("triton")
    from lorad.daemon.model.ops import TritonOps

    ops = TritonOps(torch.device("cpu"), 64, 16)
    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, b=None: calls.append(x.shape[0]) or F.linear(x, w, b))
    w = torch.randn(8, 16)
    for rows in (1, 2, 4, 64):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(ops.linear(x, w), x @ w.t())
    assert calls == [1]
    ops.linear(torch.randn(1, 32)[:, ::2], w)  # strided along K: F.linear
    assert calls == [1]
    assert "gemv(rows<=1)" in ops.name


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_gpu_llama_shapes(kernels, rows):
    for seed, (n, k) in enumerate(SHAPES_7B + SHAPES_8B):
        check(kernels, rows, n, k, torch.bfloat16, torch.device("cuda"), seed, bias=(seed == 0))
    for dtype in (torch.float16, torch.float32):
        check(kernels, rows, 12288, 4096, dtype, torch.device("cuda"), 99, strided=True)
