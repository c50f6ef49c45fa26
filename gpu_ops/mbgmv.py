"""MBGMV: the decode LoRA with no padding (S-LoRA's Multi-size Batched Gather Matrix-Vector product).
Each program loops over its own row's rank only, reading A rows and B^T rows in place from the unified
page pool. `lora_decode` is what the model calls for a decode step in place of `apply_lora_ref`.
"""

from __future__ import annotations

import torch

from lorad.gpu_ops.bgmv import (
    cdiv,
    require_triton,
    batch_max_rank,
    check_operands,
    lora_rows_ref,
    num_splits,
    page_block,
    table_offsets,
    workspace_view,
)
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable

try:
    import triton
    import triton.language as tl

    from lorad.gpu_ops.bgmv import page_pointers
except ImportError:
    triton = None

__all__ = ["lora_decode", "mbgmv", "mbgmv_ref", "mbgmv_shrink", "mbgmv_expand", "batch_max_rank"]

# Tiles: a program reads 16 rank rows x 512 columns (16 KB of bf16, 16-byte loads) per step of its
# rank loop, so a rank-8 row wastes half a step and no bytes (masked rows are never loaded).
# bench/lora_kernels.py sweeps these on the GPU; the defaults are its best on an H100 (BENCHMARKS.md).
SHRINK_BLOCK_R = 16
BLOCK_K = 512
EXPAND_BLOCK_R = 32
BLOCK_N = 128


if triton is not None:

    @triton.jit(do_not_specialize=['num_rows', 'slot_stride', 'table_offset', 'chunks_in'])
    def _mbgmv_shrink_kernel(
        x_ptr, v_ptr, row_slot_ptr, rank_ptr, a_start_ptr, page_ids_ptr, pages_ptr,
        in_dim, max_rank, num_rows, stride_xt, stride_xk, slot_stride, table_offset, chunks_in, k_per_split,
        PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr,
    ):
        row = tl.program_id(0)
        split = tl.program_id(1)
        slot = tl.load(row_slot_ptr + row)
        if slot < 0:
            return
        entry = slot * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        a_start = tl.load(a_start_ptr + entry)
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        x_row = x_ptr + row.to(tl.int64) * stride_xt
        v_row = v_ptr + (split * num_rows + row).to(tl.int64) * max_rank
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, in_dim)
        for r0 in range(0, rank, BLOCK_R):
            rows = r0 + offs_r
            r_ok = rows < rank
            row_index = a_start + rows * chunks_in
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k_ok = (k0 + offs_k) < k_hi
                xk = tl.load(x_row + (k0 + offs_k) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
                ptrs = page_pointers(pages_ptr, page_ids_ptr, row_index, r_ok, k0, offs_k, in_dim, PAGE, ALIGNED)
                a = tl.load(ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            tl.store(v_row + rows, acc, mask=r_ok)

    @triton.jit(do_not_specialize=['num_rows', 'splits', 'slot_stride', 'table_offset', 'chunks_out'])
    def _mbgmv_expand_kernel(
        v_ptr, y_ptr, row_slot_ptr, rank_ptr, b_start_ptr, page_ids_ptr, pages_ptr,
        out_dim, max_rank, num_rows, splits, stride_yt, stride_yn, slot_stride, table_offset, chunks_out,
        PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr,
    ):
        row = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        slot = tl.load(row_slot_ptr + row)
        if slot < 0:
            return
        entry = slot * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        if rank == 0:
            return
        b_start = tl.load(b_start_ptr + entry)
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = tl.arange(0, BLOCK_N)
        n_ok = (n0 + offs_n) < out_dim
        delta = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rows = r0 + offs_r
            r_ok = rows < rank
            v = tl.zeros([BLOCK_R], dtype=tl.float32)
            for split in range(0, splits):
                v_row = v_ptr + (split * num_rows + row).to(tl.int64) * max_rank
                v += tl.load(v_row + rows, mask=r_ok, other=0.0)
            ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + rows * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED)
            b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            delta += tl.sum(b.to(tl.float32) * v[:, None], axis=0)
        y_ptrs = y_ptr + row.to(tl.int64) * stride_yt + (n0 + offs_n) * stride_yn
        y = tl.load(y_ptrs, mask=n_ok, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


def mbgmv_shrink(x, v, layer, proj, row_slot, table, max_rank, block_r=SHRINK_BLOCK_R, block_k=BLOCK_K, num_warps=4):
    """v[s, t, :rank_t] = partial sums of x[t] @ A^T over K split s (columns past the rank unwritten).

    x: [T, in]; v: float32 [splits, T, max_rank] contiguous; row_slot: int32 [T]. Grid (T, splits): each
    program walks its row's rank in steps of block_r, so a rank-8 row costs an eighth of a rank-64 one.
    """
    require_triton()
    splits, num_rows, width = v.shape
    page = table.pool.page_elems
    in_dim, _ = table.shapes[proj]
    chunks_in, _ = table.chunks[proj]
    slot_stride, offset = table_offsets(table, layer, proj)
    block_k, aligned = page_block(page, in_dim, block_k)
    k_per_split = cdiv(cdiv(in_dim, splits), block_k) * block_k
    _mbgmv_shrink_kernel[(num_rows, splits)](
        x, v, row_slot, table.rank, table.a_start, table.page_ids, table.pool.pages,
        in_dim, width, num_rows, x.stride(0), x.stride(1), slot_stride, offset, chunks_in, k_per_split,
        PAGE=page, BLOCK_R=block_r, BLOCK_K=block_k, ALIGNED=aligned, num_warps=num_warps,
    )


def mbgmv_expand(v, y, layer, proj, row_slot, table, max_rank, block_r=EXPAND_BLOCK_R, block_n=BLOCK_N, num_warps=4):
    """y[t] += (sum over splits of v[:, t, :rank_t]) @ B^T; rows without an adapter untouched.

    v: float32 [splits, T, max_rank]; y: [T, out], any strides. Grid (T, out / block_n), no atomics:
    each (row, column tile) has one owner.
    """
    require_triton()
    splits, num_rows, width = v.shape
    page = table.pool.page_elems
    _, out_dim = table.shapes[proj]
    _, chunks_out = table.chunks[proj]
    slot_stride, offset = table_offsets(table, layer, proj)
    block_n, aligned = page_block(page, out_dim, block_n)
    grid = (num_rows, cdiv(out_dim, block_n))
    _mbgmv_expand_kernel[grid](
        v, y, row_slot, table.rank, table.b_start, table.page_ids, table.pool.pages,
        out_dim, width, num_rows, splits, y.stride(0), y.stride(1), slot_stride, offset, chunks_out,
        PAGE=page, BLOCK_R=block_r, BLOCK_N=block_n, ALIGNED=aligned, num_warps=num_warps,
    )


def mbgmv(x, y, layer, proj, row_slot, table, max_rank, workspace=None):
    """y[t] += (x[t] @ A^T) @ B^T per row with the row's own adapter and rank (apply_lora_ref's
    semantics); two launches, no host sync.

    x: [T, in], y: [T, out] of the model dtype (y may be a strided column slice of a fused output);
    row_slot: int32 [T] on the device (-1: base only, y's row untouched); max_rank: host int >= every
    rank in the batch (the workspace width; `batch_max_rank` or the configured max); workspace: optional
    float32 buffer of >= workspace_numel(T, max_rank) elements, reused across calls.
    Roofline: bytes = e*(sum_t r_t*(in+out) + T*(in+2*out)) + small; flops = 2*sum_t r_t*(in+out).
    """
    in_dim, _ = check_operands(x, y, proj, table, row_slot)
    num_rows = x.shape[0]
    if num_rows == 0 or max_rank <= 0:
        return
    block_k, _ = page_block(table.pool.page_elems, in_dim, BLOCK_K)
    splits = num_splits(num_rows, cdiv(in_dim, block_k), x.device)
    v = workspace_view(workspace, splits, num_rows, max_rank, x.device)
    mbgmv_shrink(x, v, layer, proj, row_slot, table, max_rank)
    mbgmv_expand(v, y, layer, proj, row_slot, table, max_rank)


def mbgmv_ref(x, y, layer, proj, row_slot, table, max_rank, workspace=None):
    """Pure-torch `mbgmv` (same signature and result; the workspace is unused)."""
    lora_rows_ref(x, y, layer, proj, row_slot, table, max_rank)


def lora_decode(
    x: torch.Tensor,
    y: torch.Tensor,
    layer: int,
    proj: int,
    batch: LoraBatch,
    table: AdapterTable,
    *,
    max_rank: int,
    workspace: torch.Tensor | None = None,
) -> None:
    """Drop-in for `apply_lora_ref(x, y, layer, proj, batch, table)` on the GPU, per-row (best when
    rows rarely share an adapter, i.e. decode). max_rank: `batch_max_rank(batch, table)` computed once
    per step (or the configured max); workspace as in `mbgmv`."""
    mbgmv(x, y, layer, proj, batch.row_slot, table, max_rank, workspace)
