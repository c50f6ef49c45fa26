"""The two-rank sum fused with the residual add and RMSNorm (gpu_ops/peer_sum.py) against its reference, in
Triton's CPU interpreter: two ranks' buffers in one process, the second rank's side of the handshake played by the
test (its partial copied in, its flags raised), then the second rank's own call reading what the first left. On the
GPU, with two ranks of their own, `bench/all_reduce.py` checks it against NCCL's sum exactly before timing it, and
tests/gpu_ops/sm90_compile.py compiles it for the H100."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import needs_interpreter, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import fused, peer_sum  # noqa: E402
from lorad.gpu_ops.peer_sum import PeerBuffers, peer_sum_add_rms_norm_ref  # noqa: E402

MAX_ROWS, HIDDEN = 6, 40


@pytest.fixture(scope="module")
def kernels():
    interpreted(peer_sum._peer_sum_add_rms_norm_kernel, fused, peer_sum)  # its norm's store is fused's
    return peer_sum


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def pair(dtype) -> tuple[PeerBuffers, PeerBuffers]:
    """Rank A's and rank B's buffers, each mapping the other's (NaN rows: an unwritten one shows)."""
    mine = [torch.full((peer_sum.HALVES, MAX_ROWS, HIDDEN), float("nan"), dtype=dtype) for _ in range(2)]
    flags = [torch.zeros(peer_sum.HALVES, MAX_ROWS, dtype=torch.int32) for _ in range(2)]
    return (PeerBuffers(mine[0], mine[1], flags[0], flags[1]), PeerBuffers(mine[1], mine[0], flags[1], flags[0]))


def inputs(tokens, dtype, seed, gemma=False):
    generator = torch.Generator().manual_seed(seed)
    h = (torch.randn(tokens, HIDDEN, generator=generator) * 3).to(dtype)
    partials = [torch.randn(tokens, HIDDEN, generator=generator).to(dtype) for _ in range(2)]
    weight = torch.rand(HIDDEN, generator=generator) + 0.5
    return h, partials, weight if gemma else weight.to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("half", [0, 1])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_both_ranks_sum_alike_and_match_the_reference(kernels, dtype, half, gemma):
    a, b = pair(dtype)
    tokens = 4
    h, (part_a, part_b), weight = inputs(tokens, dtype, seed=half + 2 * gemma, gemma=gemma)
    # Rank B's side of the handshake before rank A's call: its partial in its buffer, its flags raised in A's.
    b.mine[half, :tokens] = part_b
    a.flags[half, :tokens] = 1
    h_a = h.clone()
    got_h, got = kernels.peer_sum_add_rms_norm(h_a, part_a, weight, 1e-5, a, half)
    assert got_h.data_ptr() == h_a.data_ptr(), "the residual is updated in place"
    ref_h, reference = peer_sum_add_rms_norm_ref(h.clone(), part_a, part_b, weight, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(got_h, ref_h)
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
    else:  # the interpreter truncates float32 -> bf16 where the GPU rounds: a last place apart, here and there
        assert relative_error(got_h, ref_h) <= 8e-3 and relative_error(got, reference) <= 1.6e-2
    assert torch.equal(a.mine[half, :tokens], part_a), "A's partial is in its buffer for B to read"
    assert a.mine[half, tokens:].isnan().all() and a.mine[1 - half].isnan().all(), "nothing else written"
    assert a.flags[half, :tokens].eq(0).all(), "A lowered the flags B raised"
    assert b.flags[half, :tokens].eq(1).all() and b.flags[half, tokens:].eq(0).all() and b.flags[1 - half].eq(0).all()
    # Rank B's own call: it reads A's partial, lowers the flags A raised and raises A's.
    h_b = h.clone()
    kernels.peer_sum_add_rms_norm(h_b, part_b, weight, 1e-5, b, half)
    assert torch.equal(h_b, got_h), "both ranks hold the same sum"
    assert b.flags.eq(0).all() and a.flags[half, :tokens].eq(1).all()


@needs_interpreter
def test_what_the_buffers_do_not_take_is_refused(kernels):
    a, _ = pair(torch.float32)
    h, (partial, _), weight = inputs(MAX_ROWS + 1, torch.float32, seed=0)
    assert not a.fits(partial) and a.fits(partial[:MAX_ROWS]) and not a.fits(partial[:0])
    assert not a.fits(partial[:2].to(torch.bfloat16)) and not a.fits(torch.zeros(2, HIDDEN + 1))
    with pytest.raises(ValueError, match="must be \\[T <= 6, 40\\] rows of torch.float32"):
        kernels.peer_sum_add_rms_norm(h, partial, weight, 1e-5, a, 0)
    with pytest.raises(ValueError, match="half must be 0 or 1"):
        kernels.peer_sum_add_rms_norm(h[:2], partial[:2], weight, 1e-5, a, 2)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.peer_sum_add_rms_norm(h[:2], partial[:2], weight[:3], 1e-5, a, 0)


@needs_interpreter
def test_two_calls_in_a_row_on_one_half_are_refused(kernels):
    a, b = pair(torch.float32)
    h, (partial, theirs), weight = inputs(2, torch.float32, seed=1)
    b.mine[1, :2] = theirs
    a.flags[1, :2] = 1  # the other rank's side of the first call, on half 1
    kernels.peer_sum_add_rms_norm(h, partial, weight, 1e-5, a, 1)
    with pytest.raises(RuntimeError, match="two peer sums in a row on half 1"):
        kernels.peer_sum_add_rms_norm(h, partial, weight, 1e-5, a, 1)
