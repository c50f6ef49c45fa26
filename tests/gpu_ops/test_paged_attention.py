"""The paged attention kernels (gpu_ops/paged_attention.py) against float64 attention and the
references of gpu_ops/attention.py, on fresh random inputs:

- host-side metadata and split choice (CPU, CI);
- the Triton kernels in Triton's CPU interpreter on small shapes (CPU, CI, when triton imports);
- the compiled kernels on Llama shapes (`pytest -m gpu`): 7B (32 heads x 128, MHA, 1 token per page)
  and Llama-3-8B (32 q heads, 8 kv heads, 4 tokens per page), plus CUDA-graph capture and a sync check.

The pool is filled with NaN before the cache is written, so a read of a position past a sequence's
kv_len, of another page, or of the padding page 0, turns the result into NaN; outputs are filled with
NaN before each call, so an unwritten row fails too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from triton_interpreter import needs_interpreter, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.gpu_ops import paged_attention  # noqa: E402
from lorad.gpu_ops.attention import AttentionBatch, paged_attention_ref, scattered_block_table, write_kv_ref  # noqa: E402



@pytest.fixture(scope="module")
def kernels():
    """The kernel module, its kernels interpreted when there is no GPU."""
    interpreted(paged_attention._decode_kernel, paged_attention)
    return paged_attention


# ---------------------------------------------------------------------------------------------------
# A paged cache with scattered pages, and the float64 truth


@dataclass
class Case:
    kv_view: torch.Tensor  # [pages, tokens_per_page, kv_heads, head_dim], NaN where nothing was written
    batch: AttentionBatch
    keys: list[torch.Tensor]  # per sequence [layers, kv_len, kv_heads, head_dim] as stored
    values: list[torch.Tensor]
    heads: int
    shapes: list[tuple[int, int]]  # (kv_len, query_len) per sequence
    layers: int


def build_case(heads, kv_heads, head_dim, tokens_per_page, shapes, dtype, device, layers=2, seed=0) -> Case:
    """Sequences of (kv_len, query_len); each block's pages drawn at random from the pool, the K/V of
    every position 0..kv_len-1 already in the cache (the step's own rows included)."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    blocks = [-(-kv_len // tokens_per_page) for kv_len, _ in shapes]
    num_pages = 1 + 2 * layers * sum(blocks) + 5
    kv_view = torch.full((num_pages, tokens_per_page, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    table = scattered_block_table(blocks, layers, num_pages, rng)  # page 0: padding of the block table
    keys, values = [], []
    for seq, (kv_len, _) in enumerate(shapes):
        k = torch.randn(layers, kv_len, kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(layers, kv_len, kv_heads, head_dim, generator=generator).to(dtype)
        positions = np.arange(kv_len)
        for layer in range(layers):
            k_pages = torch.from_numpy(table[layer, 0, seq, positions // tokens_per_page].astype(np.int64))
            v_pages = torch.from_numpy(table[layer, 1, seq, positions // tokens_per_page].astype(np.int64))
            offsets = torch.from_numpy(positions % tokens_per_page)
            kv_view[k_pages.to(device), offsets.to(device)] = k[layer].to(device)
            kv_view[v_pages.to(device), offsets.to(device)] = v[layer].to(device)
        keys.append(k)
        values.append(v)
    batch = AttentionBatch.from_block_table(table, shapes, tokens_per_page, device)
    return Case(kv_view, batch, keys, values, heads, list(shapes), layers)


def truth(case: Case, q: torch.Tensor, layer: int, scale: float, window: int | None = None,
          softcap: float | None = None) -> torch.Tensor:
    """float64 [T, heads * head_dim]: causal softmax attention of each new row over its sequence (over the
    positions in (p - window, p] of a row at position p with a window), scores soft-capped with softcap."""
    heads = case.heads
    group = heads // case.kv_view.shape[2]
    rows = []
    for seq, (kv_len, query_len) in enumerate(case.shapes):
        start = case.batch.query_start[seq]
        k = case.keys[seq][layer].double().repeat_interleave(group, dim=1).to(q.device)  # [kv_len, heads, d]
        v = case.values[seq][layer].double().repeat_interleave(group, dim=1).to(q.device)
        queries = q[start : start + query_len].double()  # [query_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", queries, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        position = torch.arange(kv_len - query_len, kv_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= position[:, None]
        if window is not None:
            visible &= torch.arange(kv_len, device=q.device)[None, :] > position[:, None] - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        rows.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).reshape(query_len, -1))
    return torch.cat(rows)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the output: an unwritten row or a read of a poisoned position"
    return float((got.double() - expected).norm() / expected.norm())


LIMIT = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def unseen_positions(shapes, window: int) -> list[int]:
    """Per sequence, how many of its first positions no new row sees through a window: those before the
    first new row's window, (kv_len - query_len) - window + 1."""
    return [max(0, kv_len - query_len - window + 1) for kv_len, query_len in shapes]


def poison(case: Case, counts: list[int], whole_pages: bool = False) -> None:
    """NaN into K and V of each sequence's first `counts[s]` positions (every layer), or only into the
    pages that these positions fill wholly: a read of any of them turns a result into NaN."""
    tokens_per_page = case.kv_view.shape[1]
    table = case.batch.block_table
    for seq, count in enumerate(counts):
        count = count // tokens_per_page * tokens_per_page if whole_pages else count
        for position in range(count):
            pages = table[:, :, seq, position // tokens_per_page].reshape(-1).long()
            case.kv_view[pages, position % tokens_per_page] = float("nan")


def check_attention(kernels, case: Case, dtype, seed: int, layer: int = 1, limit=None, window=None,
                    softcap=None) -> float:
    """The kernels against the float64 truth, and no worse than the reference. With a window, K and V
    that no row sees are NaN for the kernels (they must not read them) and, for the reference, the
    pages wholly before every row's window."""
    generator = torch.Generator().manual_seed(seed)
    device = case.kv_view.device
    total = sum(query_len for _, query_len in case.shapes)
    head_dim = case.kv_view.shape[3]
    scale = head_dim**-0.5
    q = (2 * torch.randn(total, case.heads, head_dim, generator=generator)).to(dtype).to(device)
    out = torch.full((total, case.heads * head_dim), float("nan"), dtype=dtype, device=device)
    expected = truth(case, q, layer, scale, window, softcap)
    if window is not None:
        poison(case, unseen_positions(case.shapes, window), whole_pages=True)
        reference = paged_attention_ref(q, case.kv_view, layer, case.batch, scale, window, softcap)
        poison(case, unseen_positions(case.shapes, window))
    got = kernels.attention(q, case.kv_view, layer, case.batch, scale, out=out, window=window, softcap=softcap)
    assert got is out
    error = relative_error(got, expected)
    bound = limit or LIMIT[dtype]
    assert error <= bound, f"relative error {error:.2e} > {bound:.0e}"
    if window is None:
        reference = paged_attention_ref(q, case.kv_view, layer, case.batch, scale, window, softcap)
    reference_error = relative_error(reference, expected)
    assert error <= max(2 * reference_error, bound / 4), f"kernel {error:.2e} vs reference {reference_error:.2e}"
    return error


# ---------------------------------------------------------------------------------------------------
# CPU: metadata (always)


def test_meta_splits_decode_and_prefill_rows():
    batch = AttentionBatch(
        block_table=torch.zeros(2, 2, 4, 9, dtype=torch.int32),
        dest_pages=torch.zeros(2, 2, 140, dtype=torch.int64),
        dest_offsets=torch.zeros(140, dtype=torch.int64),
        query_start=[0, 1, 131, 132],
        query_len=[1, 130, 1, 8],
        kv_len=[40, 130, 7, 20],
    )
    meta = paged_attention.AttentionMeta.build(batch, 4, torch.device("cpu"))
    assert meta.seq_info.tolist() == [[0, 1, 131, 132], [1, 130, 1, 8], [40, 130, 7, 20]]
    assert meta.decode_seqs.tolist() == [0, 2] and meta.num_decode == 2
    assert meta.tile_seq.tolist() == [1, 1, 1, 3] and meta.tile_row.tolist() == [0, 64, 128, 0]
    assert meta.num_tiles == 4 and meta.max_context == 36
    assert all(t.dtype == torch.int32 for t in (meta.seq_info, meta.decode_seqs, meta.tile_seq, meta.tile_row))
    assert paged_attention.attention_meta(batch, 4, torch.device("cpu")) is paged_attention.attention_meta(batch, 4, torch.device("cpu"))


def test_decode_splits():
    cpu = torch.device("cpu")  # 4 "SMs" on the CPU: 8 programs wanted
    assert paged_attention.decode_splits(1, 1, 4096, cpu) == 8
    assert paged_attention.decode_splits(1, 1, 200, cpu) == 1  # too short to split
    assert paged_attention.decode_splits(1, 1, 512, cpu) == 4  # splits of >= 128 positions
    assert paged_attention.decode_splits(8, 1, 4096, cpu) == 1  # enough programs already
    assert paged_attention.decode_splits(1, 2, 1 << 20, cpu) == 4


def test_bad_operands_rejected():
    kv_view = torch.zeros(4, 2, 2, 16)
    with pytest.raises(ValueError, match="share"):
        paged_attention._check_q(torch.zeros(3, 3, 16), kv_view)
    with pytest.raises(ValueError, match="unit stride"):
        paged_attention._check_q(torch.zeros(3, 16, 4).transpose(1, 2), kv_view)
    with pytest.raises(ValueError, match="KV pages hold"):
        paged_attention._check_q(torch.zeros(3, 4, 16, dtype=torch.float16), kv_view)


def test_truth_matches_reference():
    """The test's own float64 truth agrees with paged_attention_ref (so both judge the same thing)."""
    case = build_case(4, 2, 16, 4, [(9, 1), (7, 7), (13, 5)], torch.float32, torch.device("cpu"))
    q = torch.randn(13, 4, 16)
    expected = truth(case, q, 1, 0.25)
    assert relative_error(paged_attention_ref(q, case.kv_view, 1, case.batch, 0.25), expected) < 1e-5


# ---------------------------------------------------------------------------------------------------
# CPU: the Triton kernels in the interpreter (small shapes)

# (kv_len, query_len): decodes (one at a page edge, one of a single position), a fresh prompt, a
# chunk over a cached prefix, a prompt of two query tiles, a decode long enough for several steps.
MIXED = [(9, 1), (7, 7), (70, 5), (8, 1), (1, 1), (90, 70), (150, 1)]
LAYOUTS = {
    "mha_tpp1": (4, 4, 16, 1),
    "gqa4_tpp4": (8, 2, 16, 4),
    "mqa_d64_tpp2": (4, 1, 64, 2),
    "gqa2_d24_tpp3": (4, 2, 24, 3),  # head_dim padded to 32, tokens_per_page not a power of two
}


@needs_interpreter
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_attention_interpreted_mixed(layout, dtype, kernels):
    heads, kv_heads, head_dim, tokens_per_page = LAYOUTS[layout]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, MIXED, dtype, torch.device("cpu"), seed=len(layout))
    check_attention(kernels, case, dtype, seed=3)


# Windows below, at and above the contexts of MIXED (1..150): a window of 1 sees the row's own position only;
# 16 is shorter than a prefill tile (rows of one tile start at different positions), 64 cuts the long decode.
WINDOWS = [1, 5, 16, 64, 200]


@needs_interpreter
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", ["gqa4_tpp4", "gqa2_d24_tpp3"])
def test_attention_interpreted_sliding_window(window, layout, kernels):
    heads, kv_heads, head_dim, tokens_per_page = LAYOUTS[layout]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, MIXED, torch.float32, torch.device("cpu"), seed=window)
    check_attention(kernels, case, torch.float32, seed=window, window=window)


@needs_interpreter
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_interpreted_softcap(window, dtype, kernels):
    """Gemma 2's capped scores (cap 3: below the scores of these inputs, so the cap bites), on global and
    sliding layers."""
    heads, kv_heads, head_dim, tokens_per_page = LAYOUTS["mha_tpp1"]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, MIXED, dtype, torch.device("cpu"), seed=2)
    check_attention(kernels, case, dtype, seed=5, window=window, softcap=3.0)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_interpreted_sliding_window_splits(splits, kernels):
    """Flash-decoding splits over the window alone: every split starts inside it, none reads before it."""
    heads, kv_heads, head_dim, tokens_per_page = LAYOUTS["gqa4_tpp4"]
    shapes = [(200, 1), (3, 1), (64, 1), (129, 1)]
    window = 37
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, shapes, torch.float32, torch.device("cpu"), seed=splits)
    q = torch.randn(len(shapes), heads, head_dim)
    expected = truth(case, q, 0, 0.3, window)
    poison(case, unseen_positions(shapes, window))
    meta = kernels.AttentionMeta.build(case.batch, tokens_per_page, "cpu")
    out = torch.full((len(shapes), heads * head_dim), float("nan"))
    table = case.batch.block_table
    kernels.decode_attention(
        q, case.kv_view, table[0, 0], table[0, 1], meta.decode_seqs, meta.query_start, meta.kv_len, out, 0.3,
        num_seqs=meta.num_decode, splits=splits, block_n=16, window=window,
    )
    assert relative_error(out, expected) < 1e-5


def test_reference_window_and_softcap():
    """paged_attention_ref with a window reads no page wholly before it (NaN there), equal to the truth."""
    shapes = [(9, 1), (7, 7), (70, 5), (90, 70)]
    case = build_case(4, 2, 16, 4, shapes, torch.float32, torch.device("cpu"))
    q = torch.randn(sum(length for _, length in shapes), 4, 16)
    expected = truth(case, q, 1, 0.25, window=10, softcap=2.0)
    poison(case, unseen_positions(shapes, 10), whole_pages=True)
    got = paged_attention_ref(q, case.kv_view, 1, case.batch, 0.25, window=10, softcap=2.0)
    assert relative_error(got, expected) < 1e-5


def test_bad_window_and_softcap_rejected():
    with pytest.raises(ValueError, match="window"):
        paged_attention._score_args(0.1, 0, None)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention._score_args(0.1, None, -1.0)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("layout,mma", [("mha_tpp1", None), ("mha_tpp1", True), ("gqa4_tpp4", None), ("gqa4_tpp4", False)])
def test_decode_interpreted_splits(splits, layout, mma, kernels):
    """Flash-decoding partials and their combine, incl. splits left empty by short contexts; with and
    without tensor cores (mma) for either layout."""
    heads, kv_heads, head_dim, tokens_per_page = LAYOUTS[layout]
    shapes = [(200, 1), (3, 1), (64, 1), (129, 1)]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, shapes, torch.float32, torch.device("cpu"), seed=splits)
    meta = kernels.AttentionMeta.build(case.batch, tokens_per_page, "cpu")
    q = torch.randn(len(shapes), heads, head_dim)
    out = torch.full((len(shapes), heads * head_dim), float("nan"))
    table = case.batch.block_table
    kernels.decode_attention(
        q, case.kv_view, table[0, 0], table[0, 1], meta.decode_seqs, meta.query_start, meta.kv_len, out, 0.3,
        num_seqs=meta.num_decode, splits=splits, block_n=32, mma=mma,
    )
    assert relative_error(out, truth(case, q, 0, 0.3)) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("tile_m,block_n", [(64, 64), (64, 128), (128, 64), (128, 128)])
@pytest.mark.parametrize("window", [None, 16])
def test_prefill_interpreted_tiles(tile_m, block_n, window, kernels):
    """The prompt rows through prefill tiles of 64 and 128 rows (the meta's tile_m, as bench/attention.py sweeps them)
    and blocks of 64 and 128 positions: prompts shorter and longer than a tile, fresh and over a cached prefix, a
    partial last tile; with and without a window."""
    heads, kv_heads, head_dim, tokens_per_page = LAYOUTS["gqa4_tpp4"]
    shapes = [(200, 150), (7, 7), (300, 70), (9, 1)]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, shapes, torch.bfloat16, torch.device("cpu"), seed=tile_m)
    meta = kernels.AttentionMeta.build(case.batch, tokens_per_page, "cpu", tile_m=tile_m)
    assert meta.tile_m == tile_m and meta.tile_row.tolist() == [row for length in (150, 7, 70) for row in range(0, length, tile_m)]
    q = (2 * torch.randn(sum(length for _, length in shapes), heads, head_dim)).bfloat16()
    out = torch.full((q.shape[0], heads * head_dim), float("nan"), dtype=torch.bfloat16)
    table = case.batch.block_table
    if window is not None:
        poison(case, unseen_positions(shapes, window))
    kernels.prefill_attention(q, case.kv_view, table[1, 0], table[1, 1], meta, out, head_dim**-0.5, window=window,
                              block_n=block_n)
    prompt_rows = slice(0, 227)  # the three prompts; the decode row (227) is the decode kernel's
    assert relative_error(out[prompt_rows], truth(case, q, 1, head_dim**-0.5, window)[prompt_rows]) < 2e-2
    assert torch.isnan(out[227]).all()


@needs_interpreter
def test_attention_interpreted_strided_q_and_decode_only(kernels):
    """q as a view of a fused qkv output (row stride > heads * head_dim); a decode-only batch."""
    heads, kv_heads, head_dim = 4, 2, 16
    shapes = [(5, 1), (33, 1), (17, 1)]
    case = build_case(heads, kv_heads, head_dim, 2, shapes, torch.bfloat16, torch.device("cpu"))
    qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim).bfloat16()
    q = qkv[:, : heads * head_dim].view(3, heads, head_dim)
    got = kernels.attention(q, case.kv_view, 0, case.batch, 0.25)
    assert relative_error(got, truth(case, q, 0, 0.25)) < 2e-2


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_interpreted(dtype, kernels):
    """write_kv stores exactly what write_kv_ref stores, and nothing else; v a strided qkv view."""
    heads, kv_heads, head_dim = 4, 2, 16
    case = build_case(heads, kv_heads, head_dim, 4, [(9, 1), (7, 7), (13, 5)], dtype, torch.device("cpu"))
    tokens = 13
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    expected = case.kv_view.clone()
    write_kv_ref(expected, 1, k, v, case.batch)
    kernels.write_kv(case.kv_view, 1, k, v, case.batch)
    assert torch.equal(case.kv_view.nan_to_num(7.0), expected.nan_to_num(7.0))


# ---------------------------------------------------------------------------------------------------
# GPU: the compiled kernels on Llama shapes

GPU_LAYOUTS = {"llama7b": (32, 32, 128, 1), "llama3_8b": (32, 8, 128, 4)}


def gpu_shapes(batch: int, seed: int, max_context: int = 4096, prefill: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    contexts = rng.integers(1, max_context + 1, size=batch)
    contexts[0] = max_context
    if batch > 2:
        contexts[-1] = 1
    shapes = [(int(c), 1) for c in contexts]
    for i in range(prefill):  # a fresh prompt, a chunk over a cached prefix
        shapes.append((300 + 37 * i, 300 + 37 * i) if i % 2 == 0 else (2000 + i, 129))
    return shapes


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
@pytest.mark.parametrize("batch", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_attention_gpu_decode(layout, batch, dtype, kernels):
    heads, kv_heads, head_dim, tokens_per_page = GPU_LAYOUTS[layout]
    max_context = 4096 if batch <= 16 else 1024
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, gpu_shapes(batch, batch, max_context), dtype, torch.device("cuda"), layers=1)
    check_attention(kernels, case, dtype, seed=batch, layer=0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_attention_gpu_mixed(layout, kernels):
    heads, kv_heads, head_dim, tokens_per_page = GPU_LAYOUTS[layout]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, gpu_shapes(12, 5, 2048, prefill=4), torch.bfloat16, torch.device("cuda"), layers=1)
    check_attention(kernels, case, torch.bfloat16, seed=7, layer=0)


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_decode_gpu_mma_either_way(layout, mma, kernels):
    """Both decode variants (tensor cores on the padded group, or CUDA-core dot products) on cuda."""
    heads, kv_heads, head_dim, tokens_per_page = GPU_LAYOUTS[layout]
    case = build_case(heads, kv_heads, head_dim, tokens_per_page, gpu_shapes(16, 3, 2048), torch.bfloat16, torch.device("cuda"), layers=1)
    meta = kernels.AttentionMeta.build(case.batch, tokens_per_page, "cuda")
    q = torch.randn(16, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(16, heads * head_dim, device="cuda", dtype=torch.bfloat16)
    table = case.batch.block_table
    for block_n in (32, 64):
        kernels.decode_attention(
            q, case.kv_view, table[0, 0], table[0, 1], meta.decode_seqs, meta.query_start, meta.kv_len, out, 0.1,
            num_seqs=meta.num_decode, block_n=block_n, mma=mma,
        )
        assert relative_error(out, truth(case, q, 0, 0.1)) < 2e-2


@pytest.mark.gpu
def test_attention_gpu_fp32(kernels):
    case = build_case(32, 8, 128, 4, gpu_shapes(4, 2, 1000, prefill=2), torch.float32, torch.device("cuda"), layers=1)
    check_attention(kernels, case, torch.float32, seed=2, layer=0, limit=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [256, 1024, 4096])
@pytest.mark.parametrize("softcap", [None, 50.0])
def test_attention_gpu_sliding_window(window, softcap, kernels):
    """Gemma 2 9B's attention shape (16 q heads, 8 kv heads, head_dim 256) with Mistral's and Gemma's windows,
    decodes and prefills mixed, capped or not."""
    case = build_case(16, 8, 256, 4, gpu_shapes(12, 5, 4096, prefill=4), torch.bfloat16, torch.device("cuda"), layers=1)
    check_attention(kernels, case, torch.bfloat16, seed=7, layer=0, window=window, softcap=softcap)


@pytest.mark.gpu
def test_attention_gpu_sliding_window_fp32(kernels):
    case = build_case(32, 8, 128, 4, gpu_shapes(4, 2, 3000, prefill=2), torch.float32, torch.device("cuda"), layers=1)
    check_attention(kernels, case, torch.float32, seed=2, layer=0, limit=1e-4, window=700, softcap=30.0)


@pytest.mark.gpu
def test_write_kv_gpu(kernels):
    heads, kv_heads, head_dim = 32, 8, 128
    case = build_case(heads, kv_heads, head_dim, 4, gpu_shapes(64, 1, 512, prefill=2), torch.bfloat16, torch.device("cuda"), layers=2)
    tokens = case.batch.dest_offsets.shape[0]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    expected = case.kv_view.clone()
    write_kv_ref(expected, 1, k, v, case.batch)
    kernels.write_kv(case.kv_view, 1, k, v, case.batch)
    assert torch.equal(case.kv_view.nan_to_num(7.0), expected.nan_to_num(7.0))


@pytest.mark.gpu
def test_attention_gpu_no_host_sync_and_graph_capture(kernels):
    """The decode path never synchronises once its metadata exists, and a CUDA graph of write_kv +
    attention replays to the eager result."""
    heads, kv_heads, head_dim = 32, 8, 128
    case = build_case(heads, kv_heads, head_dim, 4, gpu_shapes(8, 3, 2048), torch.bfloat16, torch.device("cuda"), layers=1)
    batch = case.batch
    meta = kernels.AttentionMeta.build(batch, 4, "cuda")
    q = torch.randn(8, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(8, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(8, heads * head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        kernels.write_kv(case.kv_view, 0, k, v, batch)
        kernels.attention(q, case.kv_view, 0, batch, 0.1, meta=meta, out=out)

    step()
    torch.cuda.synchronize()
    eager = out.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
