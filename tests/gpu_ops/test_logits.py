"""The logits-processing kernels (gpu_ops/logits.py) against their torch references on fresh random tables: the
processed logits and the advanced tables exactly equal, with tokens held many times, banned tokens that are also
biased and held, rows in any order or all of them, and each control alone. In Triton's CPU interpreter (CI, when
triton imports) and compiled (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from triton_interpreter import CUDA, HAS_TRITON, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import logits as logits_ops  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")


@pytest.fixture(scope="module")
def kernels():
    interpreted(logits_ops._process_kernel, logits_ops)
    return logits_ops


def random_tables(generator: torch.Generator, slots: int, vocab: int, width: int, device) -> dict:
    """Tables as SamplerState fills them: distinct bias ids padded with (token 0, +0.0), bans padded with the
    row's first, token lists padded with their first token, counts of a few tokens."""
    bias_ids = torch.zeros(slots, 12, dtype=torch.long)
    bias_values = torch.zeros(slots, 12)
    banned = torch.zeros(slots, 4, dtype=torch.long)
    tokens = torch.zeros(slots, width, dtype=torch.long)
    for slot in range(slots):
        n = int(torch.randint(0, 13, (), generator=generator))
        bias_ids[slot, :n] = torch.randperm(vocab, generator=generator)[:n]
        bias_values[slot, :n] = torch.tensor([-100.0, -3.5, 0.25, 7.0, 100.0])[torch.randint(0, 5, (n,), generator=generator)]
        banned[slot] = torch.randint(0, vocab, (4,), generator=generator)
        held = int(torch.randint(1, width + 1, (), generator=generator))
        row = torch.randint(0, vocab // 2, (held,), generator=generator)  # half the vocabulary: many repeats
        tokens[slot] = row[0]
        tokens[slot, :held] = row
    counts = torch.zeros(slots, vocab)
    counts.scatter_add_(1, tokens[:, : width // 2], torch.ones(slots, width // 2))
    penalties = torch.stack([torch.tensor([0.7, 1.0, 1.3])[torch.randint(0, 3, (slots,), generator=generator)],
                             torch.tensor([-1.0, 0.0, 0.5])[torch.randint(0, 3, (slots,), generator=generator)],
                             torch.tensor([-0.5, 0.0, 2.0])[torch.randint(0, 3, (slots,), generator=generator)]], dim=1)
    tables = {"penalties": penalties, "bias_ids": bias_ids, "bias_values": bias_values, "banned": banned,
              "tokens": tokens, "counts": counts}
    return {name: table.to(device) for name, table in tables.items()}


def check_process(kernels, seed: int, device, all_rows: bool, repetition: bool, counted: bool, bias_width: int,
                  banned_width: int, vocab: int = 97, width: int = 40) -> None:
    generator = torch.Generator().manual_seed(seed)
    slots = 9
    tables = random_tables(generator, slots, vocab, width, device)
    tables["bias_ids"][0, 0], tables["bias_values"][0, 0] = 0, 4.0  # a real bias on token 0 beside the padding's
    tables["tokens"][1, :3] = tables["banned"][1, 0]  # a banned token also held (and maybe biased)
    logits = torch.randn(6, vocab, generator=generator) * 4
    logits[:, 5] = 0.0  # exact zeros: the repetition penalty's sign rule at its edge
    logits = logits.to(device)
    order = torch.randperm(slots, generator=generator)[:6 if all_rows else 4]
    rows = None if all_rows else torch.tensor([4, 0, 2, 5])
    slot_index = order.to(device)
    banning = torch.randint(0, 2, (len(order),), generator=generator).to(device)
    kwargs = dict(bias_width=bias_width, banned_width=banned_width, held_width=width - 3, repetition=repetition)
    args = lambda: (tables["penalties"], tables["bias_ids"], tables["bias_values"], tables["banned"],  # noqa: E731
                    tables["tokens"], tables["counts"] if counted else None)
    want, got = logits.clone(), logits.clone()
    row_index = None if rows is None else rows.to(device)
    logits_ops.process_rows_ref(want, row_index, slot_index, banning, *args(), None, **kwargs)
    scratch = torch.full(tables["tokens"].shape, float("nan"), device=device)
    kernels.process_rows(got, row_index, slot_index, banning, *args(), scratch, **kwargs)
    assert torch.equal(got, want)


CASES = [(True, True, True, 12, 4), (False, True, True, 12, 4), (True, True, False, 0, 0), (False, False, True, 0, 0),
         (True, False, False, 12, 0), (False, False, False, 0, 4), (True, False, False, 0, 0)]


@needs_triton
@pytest.mark.skipif(CUDA, reason="a GPU is present: the compiled kernels are tested by -m gpu")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("all_rows,repetition,counted,bias_width,banned_width", CASES)
def test_process_rows_equals_the_reference(kernels, seed, all_rows, repetition, counted, bias_width, banned_width):
    check_process(kernels, seed, torch.device("cpu"), all_rows, repetition, counted, bias_width, banned_width)


@needs_triton
@pytest.mark.skipif(CUDA, reason="a GPU is present: the compiled kernels are tested by -m gpu")
def test_process_rows_loops_over_long_token_lists(kernels, monkeypatch):
    monkeypatch.setattr(logits_ops, "HELD_BLOCK", 16)  # three blocks of held tokens, repeats across blocks
    check_process(kernels, 7, torch.device("cpu"), True, True, True, 12, 4)


def check_advance(kernels, device, all_rows: bool, counted: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (8, 16), generator=generator).to(device)
    counts = torch.randint(0, 3, (8, 50), generator=generator).float().to(device)
    slots = torch.tensor([6, 1, 3]).to(device)
    positions = torch.tensor([0, 15, 7]).to(device)
    drawn = torch.tensor([9, 9, 42, 9, 0]).to(device)
    rows = None if all_rows else torch.tensor([4, 1, 2]).to(device)
    if all_rows:
        drawn = drawn[:3]
    want_tokens, want_counts = tokens.clone(), counts.clone()
    logits_ops.advance_rows_ref(want_tokens, want_counts if counted else None, rows, slots, positions, drawn)
    kernels.advance_rows(tokens, counts if counted else None, rows, slots, positions, drawn)
    assert torch.equal(tokens, want_tokens) and torch.equal(counts, want_counts)


@needs_triton
@pytest.mark.skipif(CUDA, reason="a GPU is present: the compiled kernels are tested by -m gpu")
@pytest.mark.parametrize("all_rows", [True, False])
@pytest.mark.parametrize("counted", [True, False])
def test_advance_rows_equals_the_reference(kernels, all_rows, counted):
    check_advance(kernels, torch.device("cpu"), all_rows, counted)


def test_reference_penalizes_a_repeated_token_once():
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    penalties = torch.tensor([[2.0, 0.5, 1.0]])
    tokens = torch.tensor([[0, 0, 1, 0]])  # token 0 three times, once generated per counts
    counts = torch.tensor([[3.0, 0.0, 0.0]])
    empty = torch.zeros(1, 1, dtype=torch.long)
    logits_ops.process_rows_ref(logits, None, torch.tensor([0]), torch.tensor([0]), penalties, empty,
                                torch.zeros(1, 1), empty, tokens, counts, None,
                                bias_width=0, banned_width=0, held_width=4, repetition=True)
    assert logits.tolist() == [[2.0 / 2 - 0.5 * 3 - 1.0, -1.0 * 2, 3.0]]


# Compiled for the H100 without one (Triton's own ptxas), in a process without the interpreter: what the interpreter
# accepts and the compiler does not (a name whose type changes across a branch) fails in CI, not on the device.
COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lorad.gpu_ops import logits
pointers = dict(logits="*fp32", rows="*i64", slots="*i64", banning="*i64", penalties="*fp32", bias_ids="*i64",
                bias_values="*fp32", banned="*i64", tokens="*i64", counts="*fp32", scratch="*fp32")
ints = "logits_stride bias_stride banned_stride tokens_stride counts_stride bias_width banned_width held_width".split()
flags = ["all_rows", "repetition", "counted"]
signature = {**pointers, **{name: "i32" for name in ints + flags},
             **{name: "constexpr" for name in ("BIAS_BLOCK", "BANNED_BLOCK", "HELD_BLOCK")}}
source = ASTSource(logits._process_kernel, signature, constexprs=dict(BIAS_BLOCK=512, BANNED_BLOCK=8, HELD_BLOCK=1024))
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=False)).asm["ptx"]
assert "div.rn.f32" in ptx and "fma.rn.f32" not in ptx and ptx.count("bar.sync") == 3, "IEEE division, no FMA, 3 barriers"
for counts in ("*fp32", "*i64"):
    signature = dict(tokens="*i64", counts=counts, rows="*i64", slots="*i64", positions="*i64", drawn="*i64",
                     tokens_stride="i32", counts_stride="i32", all_rows="i32", counted="i32")
    triton.compile(ASTSource(logits._advance_kernel, signature, constexprs={}), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=1, enable_fp_fusion=False))
"""


@needs_triton
@pytest.mark.skipif(CUDA, reason="a GPU is present: the kernels compile and run under -m gpu")
def test_kernels_compile_for_the_h100_without_one():
    import os
    import subprocess
    import sys

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    assert os.path.exists(ptxas), f"the triton torch pins ships its own ptxas; this one has none at {ptxas}"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("all_rows,repetition,counted,bias_width,banned_width", CASES)
def test_cuda_process_rows_equals_the_reference(seed, all_rows, repetition, counted, bias_width, banned_width):
    check_process(logits_ops, seed, torch.device("cuda"), all_rows, repetition, counted, bias_width, banned_width)


@pytest.mark.gpu
def test_cuda_process_rows_on_long_token_lists_of_a_large_vocabulary():
    """Several HELD_BLOCKs of held tokens per row, where a race between a row's threads would show."""
    for seed in range(4):
        check_process(logits_ops, seed, torch.device("cuda"), seed % 2 == 0, True, True, 12, 4, vocab=32000, width=3000)


@pytest.mark.gpu
@pytest.mark.parametrize("all_rows", [True, False])
@pytest.mark.parametrize("counted", [True, False])
def test_cuda_advance_rows_equals_the_reference(all_rows, counted):
    check_advance(logits_ops, torch.device("cuda"), all_rows, counted)
