"""BGMV: the decode LoRA, one row at a time, every row padded to the batch's max rank (Punica's BGMV on
pool pages). Shrink `v = x @ A^T` then expand `y += v @ B^T`, both reading A rows and B^T rows in place
from the unified page pool through `AdapterTable` (layout: DESIGN.md).

Also the helpers the other LoRA kernel files share: page-aligned tile sizes, split-K choice, argument
checks and the float32 workspace.
"""

from __future__ import annotations

import functools

import torch

from lorad.gpu_ops.launch import cdiv, next_power_of_2, require_triton, sm_count
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs the references only
    triton = None

TARGET_PROGRAMS_PER_SM = 4
MAX_SPLITS = 16


# ---------------------------------------------------------------------------------------------------
# Shared helpers (host side: shapes and dtypes only, never a device read)


def batch_max_rank(batch: LoraBatch, table: AdapterTable) -> int:
    """The largest rank any slot of the batch has in any layer or projection, from the host mirror.
    Computed once per step; 0 when no row uses an adapter (the kernels are then skipped)."""
    slots = [slot for slot, _ in batch.slot_rows]
    if not slots:
        return 0
    return int(table.rank_host[slots].max())


@functools.lru_cache(maxsize=None)
def page_block(page_elems: int, dim: int, want: int, minimum: int = 16) -> tuple[int, bool]:
    """A power-of-two tile along a paged dimension of `dim` elements, and whether it divides the page
    (then a tile never straddles pages and one page id serves a whole tile row). Pages whose size has
    no power-of-two factor >= minimum fall back to a page lookup per element."""
    block = max(minimum, min(want, next_power_of_2(dim)))
    aligned_block = min(block, page_elems & -page_elems)
    if aligned_block >= minimum:
        return aligned_block, True
    return block, False


def num_splits(programs: int, inner_tiles: int, device: torch.device, per_sm: int = TARGET_PROGRAMS_PER_SM, most: int = MAX_SPLITS) -> int:
    """Split-K factor (a power of two <= most) so that about per_sm programs run per SM."""
    want = per_sm * sm_count(device, otherwise=8)
    splits = 1
    while splits < most and programs * splits < want and splits * 2 <= inner_tiles:
        splits *= 2
    return splits


def table_offsets(table: AdapterTable, layer: int, proj: int) -> tuple[int, int]:
    """(slot stride, offset of (layer, proj)) into the [num_slots, L, 7] int32 tables, which
    AdapterTable allocates contiguous and only ever writes in place."""
    _, num_layers, num_projections = table.rank.shape
    if not (0 <= layer < num_layers and 0 <= proj < num_projections):
        raise ValueError(f"layer {layer} / projection {proj} outside the table")
    return num_layers * num_projections, layer * num_projections + proj


def paged_operand(table: AdapterTable, layer: int, proj: int, side: int) -> tuple[int, int, int, int, int]:
    """What a launcher passes for one side of (layer, proj) in the pool: (page elements, the side's dim,
    pages per row, slot stride, offset into the tables). side 0: A's rows (in_dim); 1: B^T's rows (out_dim)."""
    slot_stride, offset = table_offsets(table, layer, proj)
    return table.pool.page_elems, table.shapes[proj][side], table.chunks[proj][side], slot_stride, offset


def check_operands(x: torch.Tensor, y: torch.Tensor, proj: int, table: AdapterTable, row_slot: torch.Tensor | None = None) -> tuple[int, int]:
    """Shapes, dtypes and devices of x [T, in], y [T, out] (y may be a strided column slice) and
    row_slot int32 [T]."""
    in_dim, out_dim = table.shapes[proj]
    if row_slot is not None:
        if row_slot.dtype != torch.int32 or row_slot.shape != (x.shape[0],) or row_slot.device != x.device:
            raise ValueError(f"row_slot must be int32 [{x.shape[0]}] on {x.device}, got {row_slot.dtype} {tuple(row_slot.shape)}")
    pages = table.pool.pages
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, in] and [T, out]")
    if x.shape[1] != in_dim or y.shape[1] != out_dim:
        raise ValueError(f"projection {proj} is {in_dim} -> {out_dim}, got x {tuple(x.shape)}, y {tuple(y.shape)}")
    if x.dtype != pages.dtype:
        raise ValueError(f"x is {x.dtype} but the page pool holds {pages.dtype}")
    if y.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"y must be a float tensor, got {y.dtype}")
    if not pages.is_contiguous():
        raise ValueError("the page pool must be contiguous")
    if not (x.device == y.device == pages.device == table.page_ids.device):
        raise ValueError("x, y, the pool and the table must be on one device")
    return in_dim, out_dim


def workspace_view(workspace: torch.Tensor | None, splits: int, num_rows: int, max_rank: int, device) -> torch.Tensor:
    """The shrink output v: float32 [splits, T, width] with width = max_rank rounded up to 16 (rows
    16-aligned, so the kernels load them 16 bytes at a time); it holds partial sums over the K splits,
    entries past a row's rank undefined. From `workspace` (a contiguous float32 buffer of at least
    workspace_numel elements, reused across calls) or freshly allocated."""
    width = cdiv(max_rank, 16) * 16
    if workspace is None:
        return torch.empty(splits, num_rows, width, dtype=torch.float32, device=device)
    needed = splits * num_rows * width
    if workspace.dtype != torch.float32 or workspace.numel() < needed or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous float32 buffer of >= {needed} elements")
    return workspace.as_strided((splits, num_rows, width), (num_rows * width, width, 1))


def members_after_first(values: list) -> list:
    """The values of projection-group members 1 and 2 as the group kernels take them, as separate arguments (member 0's
    where there are fewer members: the kernels never read them then)."""
    return (values + [values[0]] * 2)[1:3]


def workspace_numel(max_tokens: int, max_rank: int) -> int:
    """Elements of a workspace big enough for any launch of up to max_tokens rows (all LoRA files)."""
    return MAX_SPLITS * max_tokens * cdiv(max_rank, 16) * 16


# ---------------------------------------------------------------------------------------------------
# Kernels. Sizes that change from call to call (dims, ranks, row counts, table offsets) are left
# unspecialised, so one compiled kernel serves every layer and projection; strides are specialised
# (a unit stride makes the loads vector-wide).


if triton is not None:

    @triton.jit
    def page_pointers(pages_ptr, page_ids_ptr, row_index, row_ok, k0, offs, dim, PAGE: tl.constexpr, ALIGNED: tl.constexpr,
                      WIDE: tl.constexpr):
        """Pointers [ROWS, BLOCK] to elements k0 + offs of the paged rows whose first page-table entry is
        row_index [ROWS] (entry = start + j * chunks). ALIGNED: the tile lies inside one page. WIDE (with ALIGNED):
        tell the compiler that the tile starts a multiple of 16 elements into its page (k0 steps by a tile width of
        at least 16, page_block). Triton 3.6 (the GPU machine's) does not see that through `k0 % PAGE` and loads the
        tile one element at a time; told, 16 bytes at a time. The shrinks and MBGMM's expand pass True. MBGMV's
        expand, which sums its tile over the rank rows on CUDA cores, took longer with wide loads (BENCHMARKS.md,
        "The LoRA kernels' page loads"), and BGMV's, which sums the same way, was not measured: both pass False."""
        if ALIGNED:
            page = tl.load(page_ids_ptr + row_index + k0 // PAGE, mask=row_ok, other=0).to(tl.int64)
            if WIDE:
                inner = tl.multiple_of(k0 % PAGE, 16) + offs
            else:
                inner = k0 % PAGE + offs
            return pages_ptr + page[:, None] * PAGE + inner[None, :]
        else:
            k = k0 + offs
            ok = row_ok[:, None] & (k < dim)[None, :]
            page = tl.load(page_ids_ptr + row_index[:, None] + (k // PAGE)[None, :], mask=ok, other=0).to(tl.int64)
            return pages_ptr + page * PAGE + (k % PAGE)[None, :]

    @triton.jit(do_not_specialize=['num_rows', 'slot_stride', 'table_offset', 'chunks_in'])
    def _bgmv_shrink_kernel(
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
        r_ok = offs_r < rank
        row_index = a_start + offs_r * chunks_in
        x_row = x_ptr + row.to(tl.int64) * stride_xt
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, in_dim)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + offs_k) < k_hi
            xk = tl.load(x_row + (k0 + offs_k) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            ptrs = page_pointers(pages_ptr, page_ids_ptr, row_index, r_ok, k0, offs_k, in_dim, PAGE, ALIGNED, True)
            a = tl.load(ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
        # Padded: every column up to max_rank is written (zeros past the row's rank).
        v_row = v_ptr + (split * num_rows + row).to(tl.int64) * max_rank
        tl.store(v_row + offs_r, acc, mask=offs_r < max_rank)

    @triton.jit(do_not_specialize=['num_rows', 'splits', 'slot_stride', 'table_offset', 'chunks_out'])
    def _bgmv_expand_kernel(
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
        r_ok = offs_r < rank
        n_ok = (n0 + offs_n) < out_dim
        v = tl.zeros([BLOCK_R], dtype=tl.float32)
        for split in range(0, splits):
            v_row = v_ptr + (split * num_rows + row).to(tl.int64) * max_rank
            v += tl.load(v_row + offs_r, mask=offs_r < max_rank, other=0.0)
        ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + offs_r * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED, False)
        b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        delta = tl.sum(b.to(tl.float32) * v[:, None], axis=0)
        y_ptrs = y_ptr + row.to(tl.int64) * stride_yt + (n0 + offs_n) * stride_yn
        y = tl.load(y_ptrs, mask=n_ok, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------------------------------
# Launchers


def bgmv_shrink(x, v, layer, proj, row_slot, table, max_rank):
    """v[s, t, :max_rank] = partial sums of x[t] @ A^T over K split s, zero past row t's rank.

    x: [T, in] model dtype (row stride free); v: float32 [splits, T, max_rank] contiguous (splits from
    its shape); row_slot: int32 [T] (-1: rows skipped, v left unwritten); max_rank: the batch's max.
    """
    require_triton("LoRA kernels")
    splits, num_rows, width = v.shape
    pages = table.pool.pages
    page, in_dim, chunks_in, slot_stride, offset = paged_operand(table, layer, proj, side=0)
    block_r = max(16, next_power_of_2(max_rank))
    block_k, aligned = page_block(page, in_dim, max(16, 8192 // block_r))
    k_per_split = cdiv(cdiv(in_dim, splits), block_k) * block_k
    _bgmv_shrink_kernel[(num_rows, splits)](
        x, v, row_slot, table.rank, table.a_start, table.page_ids, pages,
        in_dim, width, num_rows, x.stride(0), x.stride(1), slot_stride, offset, chunks_in, k_per_split,
        PAGE=page, BLOCK_R=block_r, BLOCK_K=block_k, ALIGNED=aligned, num_warps=4 if block_r <= 64 else 8,
    )


def bgmv_expand(v, y, layer, proj, row_slot, table, max_rank):
    """y[t] += (sum over splits of v[:, t]) @ B^T for rows with an adapter; y's other rows untouched.

    v: float32 [splits, T, max_rank]; y: [T, out] (any strides: a column slice of a fused output works).
    """
    require_triton("LoRA kernels")
    splits, num_rows, width = v.shape
    page, out_dim, chunks_out, slot_stride, offset = paged_operand(table, layer, proj, side=1)
    block_r = max(16, next_power_of_2(max_rank))
    block_n, aligned = page_block(page, out_dim, min(256, max(32, 8192 // block_r)))
    grid = (num_rows, cdiv(out_dim, block_n))
    _bgmv_expand_kernel[grid](
        v, y, row_slot, table.rank, table.b_start, table.page_ids, table.pool.pages,
        out_dim, width, num_rows, splits, y.stride(0), y.stride(1), slot_stride, offset, chunks_out,
        PAGE=page, BLOCK_R=block_r, BLOCK_N=block_n, ALIGNED=aligned, num_warps=4 if block_r <= 64 else 8,
    )


def bgmv(x, y, layer, proj, row_slot, table, max_rank, workspace=None):
    """y[t] += (x[t] @ A^T) @ B^T per row with the row's adapter (apply_lora_ref's semantics), every
    row padded to max_rank (>= each rank in the batch, e.g. `batch_max_rank`; host-known).

    x: [T, in] and y: [T, out] of the model dtype, y possibly a strided column slice; row_slot: int32
    [T] on the device; workspace: optional float32 buffer of >= workspace_numel(T, max_rank) elements.
    Roofline: bytes ~ e*(sum_t r_t*(in+out) + T*(in+2*out)), flops 2*T*max_rank*(in+out) (padded).
    """
    in_dim, _ = check_operands(x, y, proj, table, row_slot)
    num_rows = x.shape[0]
    if num_rows == 0 or max_rank <= 0:
        return
    block_r = max(16, next_power_of_2(max_rank))
    block_k, _ = page_block(table.pool.page_elems, in_dim, max(16, 8192 // block_r))
    splits = num_splits(num_rows, cdiv(in_dim, block_k), x.device)
    v = workspace_view(workspace, splits, num_rows, max_rank, x.device)
    bgmv_shrink(x, v, layer, proj, row_slot, table, max_rank)
    bgmv_expand(v, y, layer, proj, row_slot, table, max_rank)


# ---------------------------------------------------------------------------------------------------
# Reference


def gather_weights(table: AdapterTable, start: torch.Tensor, rank: torch.Tensor, chunks: int, width: int, max_rank: int) -> torch.Tensor:
    """float32 [N, max_rank, width]: the paged rows from page-table entries `start` [N], rows past
    `rank` [N] zero. Pure torch on device tensors (no host read)."""
    pages = table.pool.pages
    page = table.pool.page_elems
    rows = torch.arange(max_rank, device=start.device)
    chunk = torch.arange(chunks, device=start.device)
    valid = rows[None, :] < rank[:, None]  # [N, R]
    index = start.long()[:, None, None] + rows[None, :, None] * chunks + chunk[None, None, :]
    index = torch.where(valid[:, :, None], index, torch.zeros_like(index))
    weights = pages[table.page_ids[index].long()].float()  # [N, R, chunks, P]
    weights = weights.reshape(len(start), max_rank, chunks * page)[:, :, :width]
    return torch.where(valid[:, :, None], weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


def bgmv_ref(x, y, layer, proj, row_slot, table, max_rank, workspace=None, rows_per_chunk: int = 64) -> None:
    """The per-row LoRA in pure torch on device tensors, with `bgmv`'s signature (the workspace is unused):
    the reference of bgmv and of mbgmv, which compute the same function (padding changes only the work).
    fp32 math, y accumulated in its own dtype."""
    in_dim, out_dim = check_operands(x, y, proj, table, row_slot)
    if x.shape[0] == 0 or max_rank <= 0:
        return
    chunks_in, chunks_out = table.chunks[proj]
    for lo in range(0, x.shape[0], rows_per_chunk):
        hi = min(lo + rows_per_chunk, x.shape[0])
        slot = row_slot[lo:hi].long()
        active = slot >= 0
        safe = slot.clamp(min=0)
        rank = table.rank[safe, layer, proj].clamp(max=max_rank) * active
        a = gather_weights(table, table.a_start[safe, layer, proj], rank, chunks_in, in_dim, max_rank)
        b_t = gather_weights(table, table.b_start[safe, layer, proj], rank, chunks_out, out_dim, max_rank)
        v = torch.einsum("tk,trk->tr", x[lo:hi].float(), a)
        delta = torch.einsum("tr,trn->tn", v, b_t)
        block = y[lo:hi]
        touched = (rank > 0)[:, None]
        block.copy_(torch.where(touched, (block.float() + delta).to(y.dtype), block))
