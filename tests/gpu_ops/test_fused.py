"""The fused element-wise kernels (gpu_ops/fused.py) against float64 truth and their references, on
fresh random inputs: in Triton's CPU interpreter on small shapes (CI, when triton imports) and compiled
on Llama shapes (`pytest -m gpu`). Outputs are filled with NaN first, so an unwritten element fails.
"""

from __future__ import annotations


import pytest
import torch

from triton_interpreter import CUDA, needs_interpreter, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import fused  # noqa: E402
from lorad.gpu_ops.norm import add_rms_norm_ref, rms_norm_ref  # noqa: E402
from lorad.gpu_ops.rope import rope_cache  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
# Relative error vs float64: the kernels round once, so they are held to about one rounding.
LIMIT = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def exact_rounding(dtype) -> bool:
    """Triton's CPU interpreter (3.9) truncates float32 -> bf16 instead of rounding to nearest, so
    there a bf16 kernel is only held to the truth, not to beating the reference."""
    return CUDA or dtype != torch.bfloat16


@pytest.fixture(scope="module")
def kernels():
    interpreted(fused._rms_norm_kernel, fused)
    return fused


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the output: an unwritten element"
    return float((got.double() - expected).norm() / expected.norm())


def norm_weight(hidden, dtype, generator, gemma):
    """Llama's norm weight, of the model's dtype; or Gemma's (1 + w), float32 (gemma.py), close to 1 and not
    representable in bfloat16, so a kernel that rounds it or the normed row before the scale fails."""
    if gemma:
        return 1 + 0.01 * torch.randn(hidden, generator=generator)
    return (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)


def check_norm_roundings(got, reference, expected, dtype, gemma):
    """Llama casts twice (the normed row, then the product). Gemma's float32 scale rounds once: the reference
    and the kernel as close to the float64 truth as the truth rounded to dtype is (a second rounding is about
    1.4x as far), the kernel only where it rounds to nearest (exact_rounding). In float32 both orders agree."""
    assert relative_error(reference, expected) <= LIMIT[dtype] * 2 and relative_error(got, expected) <= LIMIT[dtype] * 2
    if gemma and dtype != torch.float32:
        once = relative_error(expected.to(dtype), expected)
        assert relative_error(reference, expected) <= 1.15 * once
        if exact_rounding(dtype):
            assert relative_error(got, expected) <= 1.15 * once


def check_rms_norm(kernels, tokens, hidden, dtype, device, seed, gemma=False):
    generator = torch.Generator().manual_seed(seed)
    wide = (torch.randn(tokens, hidden + 8, generator=generator) * 3).to(dtype).to(device)
    x = wide[:, 4 : 4 + hidden]  # strided rows
    weight = norm_weight(hidden, dtype, generator, gemma).to(device)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=device)
    got = kernels.rms_norm(x, weight, 1e-5, out=out)
    h = x.double()
    expected = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    reference = rms_norm_ref(x, weight, 1e-5)
    assert got.dtype == dtype and reference.dtype == dtype
    check_norm_roundings(got, reference, expected, dtype, gemma)
    # The same roundings as the reference: at most a last-place difference on a few elements.
    assert relative_error(got, reference.double()) <= LIMIT[dtype] * (1 if exact_rounding(dtype) else 2)


def check_rope(kernels, tokens, heads, kv_heads, head_dim, dtype, device, seed, inplace, gathered=False, rotary=None):
    """rotary: RoPE on the first `rotary` dimensions of each head only (partial_rotary_factor), the rest kept."""
    generator = torch.Generator().manual_seed(seed)
    rotary = rotary or head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    cos, sin = rope_cache(inv_freq, 4096, dtype, device)
    positions = torch.randint(0, 4096, (tokens,), generator=generator).to(device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    expected = [_rope64(x, cos, sin, positions) for x in (q, k)]
    reference = fused.rope_qk_ref(q.clone(), k.clone(), cos, sin, positions)
    if gathered:
        got = kernels.rope_qk(q, k, cos[positions], sin[positions], inplace=inplace)
    else:
        got = kernels.rope_qk(q, k, cos, sin, positions, inplace=inplace)
    if inplace:
        assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched
    for g, e, r in zip(got, expected, reference):
        assert g.dtype == dtype
        error = relative_error(g, e)
        assert error <= LIMIT[dtype]
        if exact_rounding(dtype):
            assert error <= relative_error(r, e) + 1e-7  # one rounding beats the reference's three


def _rope64(x, cos, sin, positions):
    c, s = cos[positions].double()[:, None, :], sin[positions].double()[:, None, :]
    x = x.double()
    rotary = c.shape[-1]
    kept, x = x[..., rotary:], x[..., :rotary]
    half = rotary // 2
    return torch.cat((x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s, kept), dim=-1)


def check_silu_mul(kernels, tokens, width, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(tokens, 2 * width, generator=generator) * 2).to(dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.full((tokens, width), float("nan"), dtype=dtype, device=device)
    got = kernels.silu_mul(gate, up, out=out)
    g = gate.double()
    expected = g * torch.sigmoid(g) * up.double()
    assert relative_error(got, expected) <= LIMIT[dtype]
    if exact_rounding(dtype):
        assert relative_error(got, expected) <= relative_error(kernels.silu_mul_ref(gate, up), expected) + 1e-7


def check_gelu_tanh_mul(kernels, tokens, width, dtype, device, seed):
    """Gemma's GeGLU against float64 tanh GELU (large |gate| included: tanh saturates, nothing overflows)."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(tokens, 2 * width, generator=generator) * 4).to(dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    gate[0, :4] = torch.tensor([-60.0, 60.0, -9.0, 0.0], dtype=dtype)
    out = torch.full((tokens, width), float("nan"), dtype=dtype, device=device)
    got = kernels.gelu_tanh_mul(gate, up, out=out)
    g = gate.double()
    expected = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * up.double()
    assert relative_error(got, expected) <= LIMIT[dtype]
    assert relative_error(kernels.gelu_tanh_mul_ref(gate, up), expected) <= LIMIT[dtype]
    if exact_rounding(dtype):
        assert relative_error(got, expected) <= relative_error(kernels.gelu_tanh_mul_ref(gate, up), expected) + 1e-7


def check_add_rms_norm(kernels, tokens, hidden, dtype, device, seed, gemma=False):
    generator = torch.Generator().manual_seed(seed)
    h0 = (torch.randn(tokens, hidden, generator=generator) * 3).to(dtype).to(device)
    wide = torch.randn(tokens, hidden + 8, generator=generator).to(dtype).to(device)
    delta = wide[:, 4 : 4 + hidden]  # strided rows, as a column slice of a fused output would be
    weight = norm_weight(hidden, dtype, generator, gemma).to(device)
    h = h0.clone()
    got_h, got = kernels.add_rms_norm(h, delta, weight, 1e-5)
    assert got_h.data_ptr() == h.data_ptr(), "the residual is updated in place"
    ref_h, reference = add_rms_norm_ref(h0.clone(), delta, weight, 1e-5)
    if exact_rounding(dtype):
        assert torch.equal(got_h, ref_h), "the sum is rounded to the residual's dtype as h + delta is"
    else:  # the interpreter truncates to bf16: a last-place difference
        assert relative_error(got_h, ref_h.double()) <= LIMIT[dtype]
    summed = ref_h.double()
    expected = weight.double() * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    check_norm_roundings(got, reference, expected, dtype, gemma)
    assert relative_error(got, reference.double()) <= LIMIT[dtype] * (1 if exact_rounding(dtype) else 2)


# ---------------------------------------------------------------------------------------------------
# CPU: the Triton kernels in the interpreter


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens,hidden", [(5, 64), (1, 200)])
def test_add_rms_norm_interpreted(tokens, hidden, dtype, kernels):
    check_add_rms_norm(kernels, tokens, hidden, dtype, "cpu", seed=hidden)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_norms_interpreted_gemma_float32_weight(dtype, kernels):
    """Gemma's (1 + w) norm weight kept in float32: the normed row scaled in float32 and rounded once."""
    check_rms_norm(kernels, 5, 64, dtype, "cpu", seed=11, gemma=True)
    check_add_rms_norm(kernels, 5, 64, dtype, "cpu", seed=12, gemma=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens,hidden", [(5, 64), (3, 96), (1, 200)])
def test_rms_norm_interpreted(tokens, hidden, dtype, kernels):
    check_rms_norm(kernels, tokens, hidden, dtype, "cpu", seed=hidden)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (6, 3, 24)])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_rope_qk_interpreted(heads, kv_heads, head_dim, dtype, inplace, kernels):
    check_rope(kernels, 7, heads, kv_heads, head_dim, dtype, "cpu", seed=heads, inplace=inplace)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_rope_qk_interpreted_partial_rotary(dtype, inplace, kernels):
    # Phi-4-mini's partial_rotary_factor 0.75: 12 of 16 dimensions rotated, the last 4 of each head kept.
    check_rope(kernels, 7, 4, 2, 16, dtype, "cpu", seed=3, inplace=inplace, rotary=12)


@needs_interpreter
def test_rope_qk_interpreted_gathered_rows(kernels):
    check_rope(kernels, 5, 4, 2, 16, torch.bfloat16, "cpu", seed=1, inplace=False, gathered=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens,width", [(4, 100), (2, 2500)])
def test_silu_mul_interpreted(tokens, width, dtype, kernels):
    check_silu_mul(kernels, tokens, width, dtype, "cpu", seed=width)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens,width", [(4, 100), (2, 2500)])
def test_gelu_tanh_mul_interpreted(tokens, width, dtype, kernels):
    check_gelu_tanh_mul(kernels, tokens, width, dtype, "cpu", seed=width)


def test_refs_and_empty_inputs():
    x = torch.zeros(0, 64)
    assert rms_norm_ref(x, torch.ones(64), 1e-5).shape == (0, 64)
    with pytest.raises(ValueError, match="unit stride"):
        fused._rows(torch.zeros(4, 8).t(), "x")


# ---------------------------------------------------------------------------------------------------
# GPU: Llama shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_fused_gpu(tokens, dtype, kernels):
    check_rms_norm(kernels, tokens, 4096, dtype, "cuda", seed=tokens)
    check_rms_norm(kernels, tokens, 8192, dtype, "cuda", seed=tokens + 1)
    check_add_rms_norm(kernels, tokens, 4096, dtype, "cuda", seed=tokens)
    check_rms_norm(kernels, tokens, 3584, dtype, "cuda", seed=tokens + 2, gemma=True)  # gemma-2-9b
    check_add_rms_norm(kernels, tokens, 3584, dtype, "cuda", seed=tokens + 2, gemma=True)
    check_rope(kernels, tokens, 32, 32, 128, dtype, "cuda", seed=tokens, inplace=False)
    check_rope(kernels, tokens, 32, 8, 128, dtype, "cuda", seed=tokens, inplace=True)
    check_rope(kernels, tokens, 24, 8, 128, dtype, "cuda", seed=tokens, inplace=True, rotary=96)  # Phi-4-mini
    check_silu_mul(kernels, tokens, 11008, dtype, "cuda", seed=tokens)
    check_silu_mul(kernels, tokens, 14336, dtype, "cuda", seed=tokens + 1)
    check_gelu_tanh_mul(kernels, tokens, 14336, dtype, "cuda", seed=tokens + 2)  # Gemma 2 9B's intermediate size
