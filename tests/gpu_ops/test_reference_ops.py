"""The pure-torch reference ops (gpu_ops/*_ref) against slow, obvious implementations and against
transformers' own functions: LoRA over paged weights, paged attention, RMSNorm, RoPE."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from lorad.gpu_ops.attention import AttentionBatch, paged_attention_ref, write_kv_ref
from lorad.gpu_ops.lora import LoraBatch, apply_lora_ref
from lorad.gpu_ops.norm import rms_norm_ref
from lorad.gpu_ops.page_pool import AdapterTable, KVCache, PagePool
from lorad.gpu_ops.rope import apply_rope_ref, rope_cache

CPU = torch.device("cpu")

# --- LoRA -------------------------------------------------------------------------------------------

HIDDEN, INTERMEDIATE, LAYERS = 64, 172, 2
SHAPES = [(HIDDEN, 64), (HIDDEN, 32), (HIDDEN, 32), (64, HIDDEN), (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]


def test_lora_batch_build():
    batch = LoraBatch.build([2, -1, 0, 2, -1, 0, 0], CPU)
    assert batch.row_slot.dtype == torch.int32 and batch.row_slot.tolist() == [2, -1, 0, 2, -1, 0, 0]
    assert [(slot, rows.tolist()) for slot, rows in batch.slot_rows] == [(0, [2, 5, 6]), (2, [0, 3])]


@pytest.mark.parametrize("seed", range(3))
def test_apply_lora_ref_matches_dense_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pool = PagePool(3000, HIDDEN, torch.float32, CPU)
    table = AdapterTable(pool, num_slots=6, num_layers=LAYERS, shapes=SHAPES)
    adapters = {}
    for slot in (0, 2, 5):
        weights = {}
        for layer in range(LAYERS):
            for proj, (fan_in, fan_out) in enumerate(SHAPES):
                if rng.random() < 0.7:
                    rank = rng.randint(1, 8)
                    weights[(layer, proj)] = (
                        torch.randn(rank, fan_in, generator=generator),
                        torch.randn(fan_out, rank, generator=generator),
                    )
        assert table.place(slot, weights)
        adapters[slot] = weights
    tokens = 13
    row_slots = [rng.choice([-1, 0, 2, 5, -1]) for _ in range(tokens)]
    row_slots[0], row_slots[-1] = -1, 5
    batch = LoraBatch.build(row_slots, CPU)
    for layer in range(LAYERS):
        for proj, (fan_in, fan_out) in enumerate(SHAPES):
            x = torch.randn(tokens, fan_in, generator=generator)
            # y is a column slice of a bigger tensor, as q/k/v are slices of one qkv GEMM's output
            big = torch.randn(tokens, fan_out + 40, generator=generator)
            before = big.clone()
            y = big[:, 24 : 24 + fan_out]
            assert not y.is_contiguous()
            apply_lora_ref(x, y, layer, proj, batch, table)
            expected = before.clone()
            for t, slot in enumerate(row_slots):
                if slot >= 0 and (layer, proj) in adapters[slot]:
                    a, b = adapters[slot][(layer, proj)]
                    expected[t, 24 : 24 + fan_out] += x[t] @ a.T @ b.T
            torch.testing.assert_close(big, expected, rtol=1e-5, atol=1e-4)
            # untouched: the rows without an adapter, and the columns outside the slice
            assert torch.equal(big[:, :24], before[:, :24]) and torch.equal(big[:, 24 + fan_out :], before[:, 24 + fan_out :])
            assert torch.equal(big[0], before[0])


def test_apply_lora_ref_evicted_slot_adds_nothing():
    generator = torch.Generator().manual_seed(7)
    pool = PagePool(200, HIDDEN, torch.float32, CPU)
    table = AdapterTable(pool, num_slots=2, num_layers=1, shapes=SHAPES)
    assert table.place(1, {(0, 0): (torch.randn(3, 64, generator=generator), torch.randn(64, 3, generator=generator))})
    table.evict(1)
    x, y = torch.randn(4, 64), torch.zeros(4, 64)
    apply_lora_ref(x, y, 0, 0, LoraBatch.build([1, 1, -1, 1], CPU), table)
    assert torch.count_nonzero(y) == 0


def test_projections_no_row_targets_launch_nothing():
    """The step's LoRA metadata names the projections none of its rows' adapters targets in any layer; the ops
    launch nothing for those (a fused group only where every member is one), and the sums are unchanged."""
    from lorad.daemon.model.ops import TorchOps

    generator = torch.Generator().manual_seed(3)
    pool = PagePool(800, HIDDEN, torch.float32, CPU)
    table = AdapterTable(pool, num_slots=3, num_layers=LAYERS, shapes=SHAPES)
    q_v = {(layer, proj): (torch.randn(4, SHAPES[proj][0], generator=generator), torch.randn(SHAPES[proj][1], 4, generator=generator))
           for layer in range(LAYERS) for proj in (0, 2)}
    down = {(1, 6): (torch.randn(2, INTERMEDIATE, generator=generator), torch.randn(HIDDEN, 2, generator=generator))}
    assert table.place(0, q_v) and table.place(2, down)  # q and v in every layer; down in layer 1 alone
    ops = TorchOps()
    launched = []
    ops.pool_lora = lambda x, y, layer, proj, batch, table: launched.append(proj)
    for row_slots, expected in (([0, -1, 0], {1, 3, 4, 5, 6}), ([0, 2], {1, 3, 4, 5}), ([-1, -1], set())):
        batch = LoraBatch.build(row_slots, CPU)
        ops.prepare_lora(batch, table)
        assert batch.untargeted == expected, row_slots
        launched.clear()
        for proj, (fan_in, fan_out) in enumerate(SHAPES):
            ops.lora(torch.zeros(len(row_slots), fan_in), torch.zeros(len(row_slots), fan_out), 1, proj, batch, table)
        assert launched == [proj for proj in range(7) if proj not in expected], row_slots
    del ops.pool_lora
    batch = LoraBatch.build([0, 2, -1], CPU)
    ops.prepare_lora(batch, table)
    for layer in range(LAYERS):
        for proj, (fan_in, fan_out) in enumerate(SHAPES):
            x = torch.randn(3, fan_in, generator=generator)
            y, reference = torch.zeros(3, fan_out), torch.zeros(3, fan_out)
            ops.lora(x, y, layer, proj, batch, table)
            apply_lora_ref(x, reference, layer, proj, LoraBatch.build([0, 2, -1], CPU), table)
            assert torch.equal(y, reference), (layer, proj)


# --- paged attention --------------------------------------------------------------------------------


def dense_causal_attention(q, k, v, query_len, scale):
    """q: [n, H, D] (the last n positions); k, v: [kv_len, Hkv, D]. One head, one query at a time."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    kv_len = k.shape[0]
    out = torch.empty(query_len, heads, q.shape[2], dtype=torch.float64)
    for i in range(query_len):
        position = kv_len - query_len + i
        for h in range(heads):
            keys = k[: position + 1, h // group].double()
            scores = keys @ q[i, h].double() * scale
            weights = torch.softmax(scores, dim=0)
            out[i, h] = weights @ v[: position + 1, h // group].double()
    return out.reshape(query_len, -1)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 8), (4, 4, 8)])
def test_paged_attention_matches_dense(heads, kv_heads, head_dim):
    seed = heads * 100 + kv_heads * 10 + head_dim
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    page_elems = 64
    layers = 2
    pool = PagePool(400, page_elems, torch.float32, CPU)
    kv = KVCache(pool, layers, kv_heads, head_dim)
    tokens_per_page = kv.tokens_per_page
    assert tokens_per_page > 1
    # Shuffle the free list so blocks land in scattered, out-of-order pages.
    rng.shuffle(pool._stack)
    # (kv_len, query_len): a decode, a fresh prefill, a chunk in the middle, a decode at a page edge
    shapes = [(9, 1), (7, 7), (13, 5), (tokens_per_page * 3, 1), (1, 1)]
    blocks = [[] for _ in shapes]
    for seq, (kv_len, _) in enumerate(shapes):
        assert kv.grow(blocks[seq], kv_len)
    # Earlier positions (the cache) are written in an earlier "step"; the new queries' K/V now.
    full_k = [torch.randn(layers, kv_len, kv_heads, head_dim, generator=generator) for kv_len, _ in shapes]
    full_v = [torch.randn(layers, kv_len, kv_heads, head_dim, generator=generator) for kv_len, _ in shapes]
    max_blocks = max(len(b) for b in blocks)

    def build(ranges):
        table = np.zeros((len(shapes), max_blocks, layers, 2), dtype=np.int32)
        dest, positions, query_start, query_len, kv_lens, start = [], [], [], [], [], 0
        for seq, (first, last) in enumerate(ranges):
            stacked = np.stack(blocks[seq])
            table[seq, : len(stacked)] = stacked
            pos = np.arange(first, last)
            dest.append(stacked[pos // tokens_per_page])
            positions.append(pos)
            query_start.append(start)
            query_len.append(last - first)
            kv_lens.append(last)
            start += last - first
        positions = np.concatenate(positions)
        return AttentionBatch(
            block_table=torch.from_numpy(table.transpose(2, 3, 0, 1).copy()),
            dest_pages=torch.from_numpy(np.concatenate(dest).transpose(1, 2, 0).astype(np.int64)),
            dest_offsets=torch.from_numpy(positions % tokens_per_page),
            query_start=query_start,
            query_len=query_len,
            kv_len=kv_lens,
        )

    cached = [(0, kv_len - query_len) for kv_len, query_len in shapes]
    new = [(kv_len - query_len, kv_len) for kv_len, query_len in shapes]
    for ranges in (cached, new):
        live = [(seq, r) for seq, r in enumerate(ranges) if r[1] > r[0]]
        if not live:
            continue
        batch = build([r if r[1] > r[0] else (0, 0) for r in ranges])
        for layer in range(layers):
            k = torch.cat([full_k[seq][layer, first:last] for seq, (first, last) in enumerate(ranges)])
            v = torch.cat([full_v[seq][layer, first:last] for seq, (first, last) in enumerate(ranges)])
            write_kv_ref(kv.view, layer, k, v, batch)
    # The cache now holds every position; check the pages directly, then attention.
    for seq, (kv_len, _) in enumerate(shapes):
        for layer in range(layers):
            for position in range(kv_len):
                block = blocks[seq][position // tokens_per_page]
                offset = position % tokens_per_page
                assert torch.equal(kv.view[block[layer, 0], offset], full_k[seq][layer, position])
                assert torch.equal(kv.view[block[layer, 1], offset], full_v[seq][layer, position])
    batch = build(new)
    total = sum(query_len for _, query_len in shapes)
    scale = head_dim**-0.5
    for layer in range(layers):
        q = torch.randn(total, heads, head_dim, generator=generator)
        got = paged_attention_ref(q, kv.view, layer, batch, scale)
        assert got.shape == (total, heads * head_dim)
        for seq, (kv_len, query_len) in enumerate(shapes):
            start = batch.query_start[seq]
            expected = dense_causal_attention(
                q[start : start + query_len], full_k[seq][layer], full_v[seq][layer], query_len, scale
            )
            torch.testing.assert_close(got[start : start + query_len].double(), expected, rtol=1e-5, atol=1e-5)


# --- RMSNorm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref(dtype):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 48, generator=generator) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(48, generator=generator)).to(dtype)
    eps = 1e-5
    got = rms_norm_ref(x, weight, eps)
    assert got.dtype == dtype
    expected = torch.empty(7, 48, dtype=torch.float64)
    for t in range(7):
        row = x[t].double()
        expected[t] = row / math.sqrt(float((row**2).mean()) + eps)
    expected = weight.double() * expected.to(torch.float32).to(dtype).double()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


def test_rms_norm_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(32, generator=generator))
    x = torch.randn(5, 32, generator=generator)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.detach(), 1e-6), norm(x).detach())


# --- RoPE -------------------------------------------------------------------------------------------


def test_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from lorad.daemon.model.checkpoint import ModelSpec, rope_inv_freq

    generator = torch.Generator().manual_seed(2)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(config_dict)
    cos_cache, sin_cache = rope_cache(rope_inv_freq(spec), 256, torch.float32, CPU)
    positions = torch.tensor([0, 1, 2, 77, 5, 255, 3])
    q = torch.randn(7, 4, 16, generator=generator)
    k = torch.randn(7, 2, 16, generator=generator)
    # transformers' own cos/sin for these positions, and its rotation ([batch, heads, tokens, dim])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    torch.testing.assert_close(cos_cache[positions], hf_cos[0])
    torch.testing.assert_close(sin_cache[positions], hf_sin[0])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    got_q = apply_rope_ref(q, cos_cache[positions], sin_cache[positions])
    got_k = apply_rope_ref(k, cos_cache[positions], sin_cache[positions])
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1))


def test_rope_is_a_rotation_by_position():
    """Scores between rotated q and k depend only on the distance between their positions."""
    generator = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = rope_cache(inv_freq, 64, torch.float64, CPU)
    q, k = torch.randn(1, 1, 16, generator=generator).double(), torch.randn(1, 1, 16, generator=generator).double()

    def score(pq, pk):
        return float((apply_rope_ref(q, cos[[pq]], sin[[pq]]) * apply_rope_ref(k, cos[[pk]], sin[[pk]])).sum())

    # cos/sin are computed in float32 (as HF does): equal up to float32 rounding of position * freq
    assert score(10, 3) == pytest.approx(score(40, 33), rel=1e-5)
    assert score(10, 3) != pytest.approx(score(40, 30), rel=1e-3)
    assert torch.allclose(apply_rope_ref(q, cos[[0]], sin[[0]]), q)
