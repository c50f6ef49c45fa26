"""Attention over the paged KV cache on the GPU: Triton kernels that read K and V pages in place from
the unified pool (layout: DESIGN.md), with `gpu_ops/attention.py`'s references as their semantics.

- `write_kv`: a step's k and v into their pages, one launch (drop-in for `write_kv_ref`).
- `decode_attention`: sequences with one new token; a program per (sequence, kv head, split) reads
  each K/V row once for all the query heads sharing it (GQA), online softmax, split-K over the context
  (flash-decoding) when there are too few sequences to fill the GPU, then a small combine launch.
- `prefill_attention`: sequences with several new tokens (a prompt, or a chunk of one whose earlier
  chunks are cached): causal flash attention over query tiles of 64 rows, K/V gathered from pages.
- Both take a per-layer sliding `window` (a query at position p sees (p - window, p]: the loops start at
  the first position some row of the program sees, so no K/V before the window is read) and Gemma 2's
  `softcap` of the scores (softcap * tanh(s / softcap)).
- `attention`: drop-in for `paged_attention_ref` on a mixed batch: decode rows to the first, prefill
  rows to the second. Its device metadata (`AttentionMeta`) is built once per step.

Nothing here reads the device from the host: grids come from host-known sizes, so a decode step can be
captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.fp8 import FP8
from lorad.gpu_ops.launch import (early_options, launching_early, named_gpu, next_power_of_2, require_triton, sm_count,
                                  widen_bf16_dots)

try:
    import triton
    import triton.language as tl

    from lorad.gpu_ops.launch import let_dependents_start, wait_for_previous
except ImportError:  # the CPU engine runs the references only
    triton = None

__all__ = [
    "AttentionMeta",
    "attention",
    "attention_meta",
    "decode_attention",
    "decode_launch",
    "decode_splits",
    "prefill_attention",
    "write_kv",
]

LOG2E = 1.4426950408889634
# Query rows per prefill program, where AttentionMeta cuts prompts into tiles of this by default; the launch takes blocks
# of 64 positions on four warps. Swept on one H200 at the prompts of a mixed step (`python3 bench/attention.py --only
# prefill_sweep,prefill_sweep_llama3_8b`: tiles of 64 and 128 rows, blocks of 64 and 128, 4 and 8 warps, 2-4 stages;
# bench/results/attention_prefill_sweep_h200.json), no launch is faster on fresh prompts by more than 4%; 128-row tiles
# gain only on chunks over a long cached prefix (0.79-0.93x), and lose up to 1.16x on fresh prompts.
PREFILL_BLOCK_M = 64
# Context positions per step of the decode loop, and whether its dot products run on tensor cores (tl.dot on
# the query group padded to 16 rows; for MHA 15 of them are padding). The H100 sweep (bench/attention.py,
# BENCHMARKS.md) on the 7B MHA shape, 1 token a page: tensor cores at block_n 128 take b=64 ctx=2048 to
# 717 us against 980 us on CUDA cores at their best block_n (32), i.e. to the copy floor; b=64 ctx=512 192 vs
# 275 us; b=1 ctx=2048 19.3 vs 23.7 us. GQA (8 kv heads, 4 tokens a page): 64, at 94-99% of the floor. Over FP8
# pages (float16 dots) GQA takes 128: 67.7 against 88.5 us at b=64 ctx=1024, 239 against 266 at b=256; MHA stays
# at 128 (bench/attention.py's decode_*_fp8 sections, their FP8 pages then holding as many tokens as bf16's, where the
# engine's hold twice as many; the launches below were measured in the engine's layout).
DECODE_BLOCK_N = {"mha": 128, "gqa": 64, "mha_fp8": 128, "gqa_fp8": 128}
# Warps and pipeline stages of a decode program (None: Triton's default stages). Over FP8 pages two warps and three
# stages, where four warps leave each program too few bytes in flight: on the 7B shape (MHA) 209 against 232 us at
# b=64 ctx=1024 (the floor 182), 400 against 449 at b=128; Llama 3 8B (GQA) 59 against 67 at b=64, 215 against 241
# at b=256; CUDA-core dots are slower still. Over bf16 pages two warps change nothing (within 1%).
# (bench/fp8_rows.py --attention, bench/results/fp8_rows_h100.json.)
DECODE_LAUNCH = {"mha": (4, None), "gqa": (4, None), "mha_fp8": (2, 3), "gqa_fp8": (2, 3)}
# Where another GPU's sweep chose otherwise, its launches by kind as (block_n, warps, stages), matched on a word of
# the device's name. The H200 (the H100's SMs beside 1.4x its HBM bandwidth) reads FP8 pages of the 7B shape (MHA)
# fastest in programs of 64 positions on one warp with four stages: 170.9 against the H100's launch's 194.3 us at b=64
# ctx=1024 (the floor 131.3), 332.9 against 361.5 at b=128 (`python3 bench/fp8_rows.py --attention`,
# bench/results/fp8_rows_h200.json; chosen from the grid of `--attention-sweep`, fp8_attention_sweep_h200.json). Llama
# 3 8B's GQA gained at b=256 (184.1 against 191.7) and lost at b=64 (56.9 against 53.8) with its best there (64
# positions, two warps, two stages), so it keeps the H100's launch. Not measured on the H100, whose launches stay as
# above.
DECODE_LAUNCH_BY_GPU = {"H200": {"mha_fp8": (64, 1, 4)}}
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 128  # a split shorter than this costs more in the combine than it saves
PROGRAMS_PER_SM = 2
# The dot operands beside FP8 pages: "float16" (K and V widened exactly, the query and P rounded to float16, whose
# mantissa is wider than bfloat16's) or "model" (widened to the model dtype).
FP8_KV_DOTS = "float16"
FP8_KV_DOTS_CHOICES = ("float16", "model")


# ---------------------------------------------------------------------------------------------------
# Per-step metadata


@dataclass
class AttentionMeta:
    """Device metadata for `attention`, built once per step from an AttentionBatch (host lists).

    seq_info: int32 [3, S] rows query_start, query_len, kv_len (device).
    decode_seqs: int32 [num_decode] the sequences with query_len == 1.
    tile_seq, tile_row: int32 [num_tiles] each prefill tile's sequence and first query row within it.
    num_decode, num_tiles: host ints (grid sizes); max_context: host int, the widest block table row in
    positions (block_table.shape[-1] * tokens_per_page), for the split choice.
    decode_splits: the decode launch's split-K factor, fixed (a prefill graph's, whose decode entries past its
    step's point at a padding sequence of no context: 1, which stores nothing for them), or None: chosen per step.
    side_stream: a CUDA stream the decode launch runs on beside the prefill launch (a prefill graph's, where a
    mixed step's decode rows need not wait for its prompt tiles, nor few of them leave the GPU idle), or None.
    tile_m: the query rows of a prefill tile (the tile_row entries step by it), which the prefill launch takes as its
    BLOCK_M.
    """

    seq_info: torch.Tensor
    decode_seqs: torch.Tensor
    tile_seq: torch.Tensor
    tile_row: torch.Tensor
    num_decode: int
    num_tiles: int
    max_context: int
    decode_splits: int | None = None
    side_stream: object = None
    tile_m: int = PREFILL_BLOCK_M

    @property
    def query_start(self) -> torch.Tensor:
        return self.seq_info[0]

    @property
    def query_len(self) -> torch.Tensor:
        return self.seq_info[1]

    @property
    def kv_len(self) -> torch.Tensor:
        return self.seq_info[2]

    @staticmethod
    def build(batch: AttentionBatch, tokens_per_page: int, device, tile_m: int = PREFILL_BLOCK_M) -> "AttentionMeta":
        """One host-to-device copy of a few int32 rows; prompts cut into tiles of `tile_m` query rows."""
        num_seqs = len(batch.query_len)
        decode = [seq for seq, length in enumerate(batch.query_len) if length == 1]
        tile_seq, tile_row = [], []
        for seq, length in enumerate(batch.query_len):
            if length > 1:
                for row in range(0, length, tile_m):
                    tile_seq.append(seq)
                    tile_row.append(row)
        packed = torch.tensor(
            [*batch.query_start, *batch.query_len, *batch.kv_len, *decode, *tile_seq, *tile_row], dtype=torch.int32
        ).to(device, non_blocking=True)
        parts = packed.split([3 * num_seqs, len(decode), len(tile_seq), len(tile_row)])
        return AttentionMeta(
            seq_info=parts[0].view(3, num_seqs),
            decode_seqs=parts[1],
            tile_seq=parts[2],
            tile_row=parts[3],
            num_decode=len(decode),
            num_tiles=len(tile_seq),
            max_context=batch.block_table.shape[-1] * tokens_per_page,
            tile_m=tile_m,
        )


def attention_meta(batch: AttentionBatch, tokens_per_page: int, device) -> AttentionMeta:
    """The step's AttentionMeta, built on the first layer's call and kept on the batch for the rest."""
    meta = getattr(batch, "_paged_meta", None)
    if meta is None:
        meta = AttentionMeta.build(batch, tokens_per_page, device)
        batch._paged_meta = meta
    return meta


def decode_launch(kind: str, device: torch.device) -> tuple[int, int, int | None]:
    """(block_n, warps, stages) of a decode launch of `kind` ("mha", "gqa", "mha_fp8", "gqa_fp8") on `device`:
    DECODE_LAUNCH_BY_GPU's entry for the device where it has one, else DECODE_BLOCK_N's and DECODE_LAUNCH's."""
    launch = DECODE_LAUNCH_BY_GPU.get(named_gpu(device, DECODE_LAUNCH_BY_GPU), {}).get(kind)
    return launch if launch is not None else (DECODE_BLOCK_N[kind], *DECODE_LAUNCH[kind])


def decode_splits(num_seqs: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split-K factor (a power of two) so that about PROGRAMS_PER_SM programs run per SM, each split
    keeping at least MIN_SPLIT_TOKENS positions of the longest context."""
    want = PROGRAMS_PER_SM * sm_count(device, otherwise=4)
    splits = 1
    while splits < MAX_SPLITS and num_seqs * kv_heads * splits < want and max_context >= 2 * splits * MIN_SPLIT_TOKENS:
        splits *= 2
    return splits


# ---------------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _as_operand(p, q_ptr, UPCAST: tl.constexpr, F16_DOTS: tl.constexpr):
        """Probabilities as the P @ V operand: rounded to the model dtype (float32 when upcast, float16 for
        FP8 pages read as float16)."""
        if F16_DOTS:
            p = p.to(tl.float16)
        else:
            p = p.to(q_ptr.dtype.element_ty)
            if UPCAST:
                p = p.to(tl.float32)
        return p

    @triton.jit
    def _query_operand(q, UPCAST: tl.constexpr, F16_DOTS: tl.constexpr):
        """The query as the scores' operand: float16 beside FP8 pages read as float16 (saturated at its
        range, which real queries stay far within), float32 when upcast, else as loaded."""
        if F16_DOTS:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        elif UPCAST:
            q = q.to(tl.float32)
        return q

    @triton.jit
    def _widen_kv(k, v, q_ptr, F16_DOTS: tl.constexpr):
        """FP8 K and V as dot operands: float16 (exact: every E4M3 value is one, one conversion instruction a
        pair on sm89+) or the model dtype."""
        if F16_DOTS:
            k, v = k.to(tl.float16), v.to(tl.float16)
        else:
            k, v = k.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty)
        return k, v

    @triton.jit
    def _tanh(x):
        """tanh from one exp2, exact at both ends (no overflow for large |x|)."""
        t = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        y = (1.0 - t) / (1.0 + t)
        return tl.where(x < 0, -y, y)

    @triton.jit
    def _log2_scores(dots, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
        """Scores in base 2 for exp2. Plain: dots * scale * log2(e) (qk_scale). Soft-capped: qk_scale is
        scale / softcap and cap_log2 softcap * log2(e): softcap * tanh(dots * scale / softcap) * log2(e)."""
        if SOFTCAP:
            return _tanh(dots * qk_scale) * cap_log2
        return dots * qk_scale

    @triton.jit
    def _load_kv_block(
        kv_ptr, k_table_ptr, v_table_ptr, table_row, positions, n_ok, kv_head, offs_d, d_ok,
        HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr,
    ):
        """K and V [BLOCK_N, HEAD_PAD] of one KV head at `positions` of one sequence, through its rows of
        the block tables (`table_row`); rows where `n_ok` is false and columns past HEAD_DIM read 0."""
        block = positions // TOKENS_PER_PAGE
        slot = (positions % TOKENS_PER_PAGE) * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        k_page = tl.load(k_table_ptr + table_row + block, mask=n_ok, other=0).to(tl.int64)
        v_page = tl.load(v_table_ptr + table_row + block, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        page_elems = TOKENS_PER_PAGE * KV_HEADS * HEAD_DIM
        k = tl.load(kv_ptr + (k_page * page_elems + slot)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + (v_page * page_elems + slot)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, kv_ptr, dest_k_ptr, dest_v_ptr, dest_offset_ptr, kv_scale_ptr, stride_kt, stride_vt,
        ROW: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, KV_FP8: tl.constexpr, EARLY: tl.constexpr,
    ):
        let_dependents_start(EARLY)  # EARLY: launched early (gpu_ops/launch.py), as the decode kernels below
        token = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < ROW
        wait_for_previous(EARLY)
        offset = tl.load(dest_offset_ptr + token)
        k_page = tl.load(dest_k_ptr + token)
        v_page = tl.load(dest_v_ptr + token)
        k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + cols, mask=ok)
        v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + cols, mask=ok)
        if KV_FP8:  # over the layer's per-tensor scales, saturated (gpu_ops/fp8.py: to_kv)
            k = tl.minimum(tl.maximum(k.to(tl.float32) / tl.load(kv_scale_ptr), -448.0), 448.0).to(kv_ptr.dtype.element_ty)
            v = tl.minimum(tl.maximum(v.to(tl.float32) / tl.load(kv_scale_ptr + 1), -448.0), 448.0).to(kv_ptr.dtype.element_ty)
        tl.store(kv_ptr + k_page.to(tl.int64) * PAGE + offset * ROW + cols, k, mask=ok)
        tl.store(kv_ptr + v_page.to(tl.int64) * PAGE + offset * ROW + cols, v, mask=ok)

    @triton.jit
    def _decode_kernel(
        q_ptr, kv_ptr, k_table_ptr, v_table_ptr, seqs_ptr, query_start_ptr, kv_len_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, kv_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_table, qk_scale, cap_log2, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        KV_HEADS: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, F16_DOTS: tl.constexpr, EARLY: tl.constexpr,
    ):
        let_dependents_start(EARLY)
        kv_head = tl.program_id(0)  # head-major: the programs that run together read the same sequences' pages
        index = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(seqs_ptr + index)
        row = tl.load(query_start_ptr + seq)
        kv_len = tl.load(kv_len_ptr + seq)
        # The positions the query sees, [first, kv_len), cut into SPLITS parts; a sliding window's first
        # position is the window's, so the splits and the loop never touch what lies before it.
        first = tl.maximum(kv_len - window, 0) if SLIDING else kv_len * 0
        per_split = tl.cdiv(tl.cdiv(kv_len - first, SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, kv_len)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < GROUP
        d_ok = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        wait_for_previous(EARLY)  # q and this step's K and V: the kernels before wrote them
        q_ptrs = q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = _query_operand(tl.load(q_ptrs, mask=g_ok[:, None] & d_ok[None, :], other=0.0), UPCAST, F16_DOTS)
        table_row = seq.to(tl.int64) * stride_table
        v_scale = 1.0
        if KV_FP8:  # FP8 pages: K's scale folded into the scores, V's into the result
            qk_scale = qk_scale * tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            positions = start + offs_n
            n_ok = positions < hi
            k, v = _load_kv_block(kv_ptr, k_table_ptr, v_table_ptr, table_row, positions, n_ok, kv_head, offs_d, d_ok,
                                  HEAD_DIM, KV_HEADS, TOKENS_PER_PAGE)
            if KV_FP8:
                k, v = _widen_kv(k, v, q_ptr, F16_DOTS)
            if UPCAST:
                k = k.to(tl.float32)
            if USE_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            else:
                scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            scores = tl.where(n_ok[None, :], _log2_scores(scores, qk_scale, cap_log2, SOFTCAP), float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                acc = acc * alpha[:, None] + tl.dot(_as_operand(p, q_ptr, UPCAST, F16_DOTS), v.to(k.dtype), input_precision=PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m = m_new

        has = l > 0
        result = acc * v_scale / tl.where(has, l, 1.0)[:, None]
        store_mask = g_ok[:, None] & d_ok[None, :]
        if SPLITS == 1:  # a padding sequence (no context: a prefill graph's unused decode entries) stores nothing
            out_ptrs = out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :]
            stored = (g_ok & (offs_g * 0 + kv_len > 0))[:, None] & d_ok[None, :]
            tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=stored)
        else:
            # partials: [num_decode, heads, SPLITS, HEAD_PAD] and lse (base 2) [num_decode, heads, SPLITS]
            part = (index.to(tl.int64) * (KV_HEADS * GROUP) + heads) * SPLITS + split
            tl.store(part_out_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], result, mask=store_mask)
            lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=g_ok)

    @triton.jit
    def _combine_kernel(
        part_out_ptr, part_lse_ptr, seqs_ptr, query_start_ptr, out_ptr, stride_ot,
        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS: tl.constexpr, EARLY: tl.constexpr,
    ):
        let_dependents_start(EARLY)
        index = tl.program_id(0)
        head = tl.program_id(1)
        wait_for_previous(EARLY)
        row = tl.load(query_start_ptr + tl.load(seqs_ptr + index))
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, HEAD_PAD)
        base = (index.to(tl.int64) * HEADS + head) * SPLITS
        lse = tl.load(part_lse_ptr + base + offs_s)
        weights = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always has positions (window or not): the max is finite
        parts = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
        parts = tl.where(weights[:, None] > 0, parts, 0.0)  # empty splits hold undefined values
        result = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
        out_ptrs = out_ptr + row.to(tl.int64) * stride_ot + head * HEAD_DIM + offs_d
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)

    @triton.jit
    def _prefill_kernel(
        q_ptr, kv_ptr, k_table_ptr, v_table_ptr, tile_seq_ptr, tile_row_ptr,
        query_start_ptr, query_len_ptr, kv_len_ptr, out_ptr, kv_scale_ptr,
        stride_qt, stride_qh, stride_ot, stride_table, qk_scale, cap_log2, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
        TOKENS_PER_PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
        UPCAST: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, F16_DOTS: tl.constexpr,
    ):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_row_ptr + tile)
        query_start = tl.load(query_start_ptr + seq)
        query_len = tl.load(query_len_ptr + seq)
        kv_len = tl.load(kv_len_ptr + seq)

        offs_m = first + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        m_ok = offs_m < query_len
        d_ok = offs_d < HEAD_DIM
        query_pos = kv_len - query_len + offs_m  # rows past query_len see everything: finite, never stored
        rows = (query_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        q = _query_operand(q, UPCAST, F16_DOTS)
        table_row = seq.to(tl.int64) * stride_table
        v_scale = 1.0
        if KV_FP8:  # as in the decode kernel
            qk_scale = qk_scale * tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)
        # The scores stay in the dot's units and m with them; the scale goes into the exponents, one fused multiply-add
        # an element where scaling them first took a multiply and a subtract. It is positive, so the row maxima commute
        # with it (floored so that a masked score, -inf, times it is never NaN). Capped scores are in base 2 already.
        if SOFTCAP:
            exp_scale = 1.0
        else:
            exp_scale = tl.maximum(qk_scale, 1e-30)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        # Causal: the tile's last row sees up to its own position. Without a window the first block
        # (position 0) is visible to every row, so m is finite after the first step and fully masked
        # blocks add zeros. With one, the loop starts at the first row's window (no block wholly before
        # it is read), and a later row may see nothing in the first blocks: its m stays -inf until it does.
        hi = tl.minimum(kv_len, kv_len - query_len + first + BLOCK_M)
        lo = tl.maximum(kv_len - query_len + first - window + 1, 0) if SLIDING else 0
        for start in range(lo, hi, BLOCK_N):
            positions = start + offs_n
            n_ok = positions < hi
            k, v = _load_kv_block(kv_ptr, k_table_ptr, v_table_ptr, table_row, positions, n_ok, kv_head, offs_d, d_ok,
                                  HEAD_DIM, KV_HEADS, TOKENS_PER_PAGE)
            if KV_FP8:
                k, v = _widen_kv(k, v, q_ptr, F16_DOTS)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if SOFTCAP:
                scores = _log2_scores(scores, qk_scale, cap_log2, SOFTCAP)
            # Causal. A stored row's own position lies below hi, so the positions it sees are all read (n_ok); a row
            # past query_len may see positions past hi, whose K and V read as 0: finite, never stored.
            visible = positions[None, :] <= query_pos[:, None]
            if SLIDING:
                visible = visible & (positions[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            shift = m_new * exp_scale
            if SLIDING:  # a row that has seen nothing yet: exp2(-inf - 0) = 0 rather than exp2(-inf + inf)
                shift = tl.where(m_new == float("-inf"), 0.0, shift)
            alpha = tl.exp2(m * exp_scale - shift)
            p = tl.exp2(scores * exp_scale - shift[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(_as_operand(p, q_ptr, UPCAST, F16_DOTS), v, input_precision=PRECISION)
            m = m_new

        result = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]  # l is 0 only in rows past query_len (not stored)
        out_ptrs = out_ptr + rows[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------------
# Launchers


def _check_q(q: torch.Tensor, kv_view: torch.Tensor) -> tuple[int, int, int, int]:
    """q: [T, heads, head_dim] with unit stride along head_dim (it may be a view of a fused qkv)."""
    if kv_view.dim() != 4 or not kv_view.is_contiguous():
        raise ValueError(f"kv_view must be a contiguous [pages, tokens_per_page, kv_heads, head_dim] view, got {tuple(kv_view.shape)}")
    _, tokens_per_page, kv_heads, head_dim = kv_view.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.stride(2) != 1:
        raise ValueError(f"q must be [T, heads, {head_dim}] with unit stride on the last dim, got {tuple(q.shape)} strides {q.stride()}")
    heads = q.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} kv heads")
    if kv_view.dtype not in (q.dtype, FP8):
        raise ValueError(f"q is {q.dtype} but the KV pages hold {kv_view.dtype}")
    if q.device != kv_view.device:
        raise ValueError("q and the KV pages must be on one device")
    return heads, kv_heads, head_dim, tokens_per_page


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    return widen_bf16_dots(dtype, _decode_kernel)


def _dot_args(q_dtype: torch.dtype, kv_fp8: bool, fp8_dots: str | None) -> dict:
    """PRECISION, UPCAST and F16_DOTS of a launch: float16 dots beside FP8 pages of a bfloat16 model (FP8_KV_DOTS,
    or `fp8_dots` for a benchmark's sweep); float16 models widen to their own dtype, which is float16."""
    fp8_dots = fp8_dots or FP8_KV_DOTS
    if fp8_dots not in FP8_KV_DOTS_CHOICES:
        raise ValueError(f"fp8_dots must be one of {FP8_KV_DOTS_CHOICES}, got {fp8_dots!r}")
    f16 = kv_fp8 and q_dtype == torch.bfloat16 and fp8_dots == "float16"
    return dict(PRECISION="tf32" if f16 else _precision(q_dtype), UPCAST=_upcast(q_dtype) and not f16, F16_DOTS=f16)


def _score_args(scale: float, window: int | None, softcap: float | None) -> dict:
    """The kernels' score and window arguments: (qk_scale, cap_log2) as `_log2_scores` reads them, and
    the window (0 and SLIDING=False for a global layer)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of positions or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    qk_scale = scale * LOG2E if softcap is None else scale / softcap
    return dict(qk_scale=qk_scale, cap_log2=(softcap or 1.0) * LOG2E, window=window or 0,
                SLIDING=window is not None, SOFTCAP=softcap is not None)


def write_kv(kv_view: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
             kv_scales: torch.Tensor | None = None) -> None:
    """Drop-in for `write_kv_ref`: k, v [T, kv_heads, head_dim] (strided rows allowed, e.g. views of a
    fused qkv output) into kv_view[dest_pages[layer, 0|1, t], dest_offsets[t]]; FP8 pages over
    kv_scales[layer] (float32 [L, 2]). One launch, one program per token. Bytes: 2 * T * kv_heads *
    head_dim * (element size + page element size)."""
    require_triton("paged attention kernels")
    _, tokens_per_page, kv_heads, head_dim = kv_view.shape
    row = kv_heads * head_dim
    tokens = k.shape[0]
    if tokens == 0:
        return
    kv_fp8 = _kv_fp8(kv_view, kv_scales)
    for name, x in (("k", k), ("v", v)):
        if x.shape != (tokens, kv_heads, head_dim) or (x.dtype != kv_view.dtype and not kv_fp8):
            raise ValueError(f"{name} must be [{tokens}, {kv_heads}, {head_dim}] {kv_view.dtype}, got {tuple(x.shape)} {x.dtype}")
    k = k if k.stride(2) == 1 and k.stride(1) == head_dim else k.contiguous()
    v = v if v.stride(2) == 1 and v.stride(1) == head_dim else v.contiguous()
    dest = batch.dest_pages[layer]
    dest_k, dest_v = dest[0].contiguous(), dest[1].contiguous()
    early = launching_early()
    _write_kv_kernel[(tokens,)](
        k, v, kv_view, dest_k, dest_v, batch.dest_offsets,
        kv_scales[layer] if kv_fp8 else k, k.stride(0), v.stride(0),
        ROW=row, PAGE=tokens_per_page * row, BLOCK=next_power_of_2(row), num_warps=4 if row <= 2048 else 8,
        KV_FP8=kv_fp8, EARLY=early, **early_options(early),
    )


def _kv_fp8(kv_view: torch.Tensor, kv_scales: torch.Tensor | None) -> bool:
    """Whether the pages are FP8 (gpu_ops/fp8.py), which then need their scales."""
    if kv_view.dtype != FP8:
        return False
    if kv_scales is None or kv_scales.dtype != torch.float32:
        raise ValueError("FP8 KV pages need their float32 scales (kv_scales [layers, 2] or kv_scale [2])")
    return True


def decode_attention(
    q: torch.Tensor,
    kv_view: torch.Tensor,
    k_table: torch.Tensor,
    v_table: torch.Tensor,
    seqs: torch.Tensor,
    query_start: torch.Tensor,
    kv_len: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    num_seqs: int,
    splits: int = 1,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    mma: bool | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    fp8_dots: str | None = None,
) -> None:
    """out[query_start[s]] = attention of that row's query over positions 0..kv_len[s)-1 of sequence s
    (the last `window` of them on a sliding-window layer), for s in seqs[:num_seqs] (all on the device, int32).

    q: [T, heads, head_dim]; kv_view: [pages, tokens_per_page, kv_heads, head_dim]; k_table, v_table:
    int32 [S, max_blocks] (block_table[layer, 0|1], unit stride on blocks); out: [T, heads * head_dim].
    Grid (kv_heads, num_seqs, splits): each program reads its kv head's K and V rows once for the
    `heads / kv_heads` queries sharing them. splits > 1: flash-decoding partials (float32) and a
    combine launch; workspace: optional (out [>= num_seqs*heads*splits*head_pad], lse [>= num_seqs*heads*splits]).
    mma: scores and P @ V on tensor cores (tl.dot on the group padded to 16 rows, the default); False: dot
    products on CUDA cores.
    kv_scale: float32 [2], the layer's K and V scales when kv_view holds FP8; fp8_dots: their dots' operands
    (FP8_KV_DOTS when None).
    Roofline: bytes = sum_s 2 * kv_len[s] * kv_heads * head_dim * element size; flops = 4 * that / size * group.
    With a window: min(kv_len[s], window) positions in place of kv_len[s]. softcap: scores capped as Gemma 2's
    (softcap * tanh(s / softcap)).
    """
    require_triton("paged attention kernels")
    heads, kv_heads, head_dim, tokens_per_page = _check_q(q, kv_view)
    if num_seqs == 0:
        return
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    group = heads // kv_heads
    head_pad = max(16, next_power_of_2(head_dim))
    use_dot = True if mma is None else mma
    kv_fp8 = _kv_fp8(kv_view, kv_scale)
    kind = ("gqa" if group > 1 else "mha") + ("_fp8" if kv_fp8 else "")
    launch = decode_launch(kind, q.device)
    if block_n is None:
        block_n = launch[0]
    if num_warps is None:
        num_warps, num_stages = launch[1], num_stages or launch[2]
    group_pad = max(16, next_power_of_2(group)) if use_dot else next_power_of_2(group)
    if splits > 1:
        if workspace is None:
            part_out = torch.empty(num_seqs * heads * splits * head_pad, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(num_seqs * heads * splits, dtype=torch.float32, device=q.device)
        else:
            part_out, part_lse = workspace
    else:
        part_out = part_lse = out  # unused
    early = launching_early()
    _decode_kernel[(kv_heads, num_seqs, splits)](
        q, kv_view, k_table, v_table, seqs, query_start, kv_len, out, part_out, part_lse, kv_scale if kv_fp8 else q,
        q.stride(0), q.stride(1), out.stride(0), k_table.stride(0), **_score_args(scale, window, softcap),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_PAD=head_pad, KV_HEADS=kv_heads,
        TOKENS_PER_PAGE=tokens_per_page, BLOCK_N=block_n, SPLITS=splits, USE_DOT=use_dot,
        KV_FP8=kv_fp8, EARLY=early, num_warps=num_warps, **_dot_args(q.dtype, kv_fp8, fp8_dots),
        **({} if num_stages is None else {"num_stages": num_stages}), **early_options(early),
    )
    if splits > 1:
        _combine_kernel[(num_seqs, heads)](
            part_out, part_lse, seqs, query_start, out, out.stride(0),
            HEADS=heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, SPLITS=splits, EARLY=early, num_warps=4,
            **early_options(early),
        )


def prefill_attention(
    q: torch.Tensor,
    kv_view: torch.Tensor,
    k_table: torch.Tensor,
    v_table: torch.Tensor,
    meta: AttentionMeta,
    out: torch.Tensor,
    scale: float,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    fp8_dots: str | None = None,
) -> None:
    """Causal attention for the prefill tiles of `meta` (query rows of sequences with query_len > 1
    over all their cached positions, or the last `window` of each row's, the rows' own K/V already
    written). Grid (num_tiles, heads); query tiles of meta.tile_m rows. Shapes, window and softcap as in
    `decode_attention`."""
    require_triton("paged attention kernels")
    heads, kv_heads, head_dim, tokens_per_page = _check_q(q, kv_view)
    if meta.num_tiles == 0:
        return
    head_pad = max(16, next_power_of_2(head_dim))
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 or head_pad > 128 else 64
    extra = {} if num_stages is None else {"num_stages": num_stages}
    kv_fp8 = _kv_fp8(kv_view, kv_scale)
    _prefill_kernel[(meta.num_tiles, heads)](
        q, kv_view, k_table, v_table, meta.tile_seq, meta.tile_row, meta.query_start, meta.query_len, meta.kv_len, out,
        kv_scale if kv_fp8 else q,
        q.stride(0), q.stride(1), out.stride(0), k_table.stride(0), **_score_args(scale, window, softcap),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, KV_HEADS=kv_heads,
        TOKENS_PER_PAGE=tokens_per_page, BLOCK_M=meta.tile_m, BLOCK_N=block_n,
        KV_FP8=kv_fp8, num_warps=num_warps, **_dot_args(q.dtype, kv_fp8, fp8_dots), **extra,
    )


def attention(
    q: torch.Tensor,
    kv_view: torch.Tensor,
    layer: int,
    batch: AttentionBatch,
    scale: float,
    meta: AttentionMeta | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Drop-in for `paged_attention_ref` on any batch (decode and prefill rows mixed): q [T, heads,
    head_dim] -> [T, heads * head_dim]; window and softcap as there. Decode sequences (query_len 1) go to `decode_attention`
    (split-K chosen from the batch's sizes), the others to `prefill_attention`; two launches at most
    (three with the split combine), no host sync. meta: the step's AttentionMeta (built on the first
    call and kept on the batch when not given; its side_stream, if any, runs the decode launch beside the prefill
    one). kv_scales: float32 [L, 2] when kv_view holds FP8."""
    heads, kv_heads, head_dim, tokens_per_page = _check_q(q, kv_view)
    if meta is None:
        meta = attention_meta(batch, tokens_per_page, q.device)
    if out is None:
        out = torch.empty(q.shape[0], heads * head_dim, dtype=q.dtype, device=q.device)
    k_table, v_table = batch.block_table[layer, 0], batch.block_table[layer, 1]
    kv_scale = kv_scales[layer] if kv_scales is not None else None
    side = meta.side_stream if meta.num_decode else None  # the decode launch's stream, beside the prefill one
    if meta.num_decode:
        splits = meta.decode_splits
        if splits is None:
            context = meta.max_context if window is None else min(meta.max_context, window)
            splits = decode_splits(meta.num_decode, kv_heads, context, q.device)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(q.device))  # q and the step's KV written
        with torch.cuda.stream(side):  # None: the current stream
            decode_attention(q, kv_view, k_table, v_table, meta.decode_seqs, meta.query_start, meta.kv_len, out, scale,
                             num_seqs=meta.num_decode, splits=splits, kv_scale=kv_scale, window=window, softcap=softcap)
    prefill_attention(q, kv_view, k_table, v_table, meta, out, scale, kv_scale=kv_scale, window=window, softcap=softcap)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)  # both halves of out written
    return out

