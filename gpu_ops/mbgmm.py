"""MBGMM: the prefill LoRA as a segmented GEMM on tensor cores (S-LoRA's MBGMM, Punica's SGMV).
Rows are grouped by adapter into segments once per step; each program multiplies a tile of one
segment's rows by that adapter's A^T (shrink) or B^T (expand) read in place from the unified page pool.
`lora_prefill` is what the model calls in place of `apply_lora_ref` for steps with prompt rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lorad.gpu_ops.bgmv import (
    MAX_SPLITS,
    batch_max_rank,
    check_operands,
    members_after_first,
    num_splits,
    page_block,
    paged_operand,
    workspace_view,
)
from lorad.gpu_ops.launch import cdiv, next_power_of_2, require_triton, sm_count, widen_bf16_dots
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import STREAM_TIMEOUT_NS, AdapterTable, gather_rows

try:
    import triton
    import triton.language as tl

    from lorad.gpu_ops.bgmv import page_pointers
except ImportError:
    triton = None

__all__ = ["Segments", "group_fits", "lora_prefill", "mbgmm", "mbgmm_expand", "mbgmm_group", "mbgmm_ref", "mbgmm_shrink"]

BLOCK_K = 128  # shrink's reduction tile along `in` (the H100 sweep's best; BENCHMARKS.md)
BLOCK_N = 128  # expand's output tile along `out`, at ranks up to EXPAND_TILE_ELEMS / BLOCK_N
EXPAND_TILE_ELEMS = 128 * 128  # the expand's B^T tile (the whole rank x its output tile), at most
EXPAND_PROGRAMS_PER_SM = 2
# Split-K of the shrink: up to MAX_SPLITS (the workspace's bound) while the expand sums at most SPLIT_PARTIALS
# partial values a row (splits x workspace width): on the H100 the 7B q_proj over 2048 rows took 36 / 21 / 16 us at
# 4 / 8 / 16 splits with rank 16, and at width 64 8 splits beat both 4 and 16 (BENCHMARKS.md). Over at most
# FEW_TILES row tiles (short prompts) always MAX_SPLITS: otherwise its few programs read A serially.
SPLIT_PARTIALS = 512
FEW_TILES = 2
GRAPH_BLOCK_M = 64  # the row tile of fixed-grid (tile list) launches


@dataclass
class Segments:
    """The step's rows grouped by adapter slot; built once per step, read by every layer.

    rows: int32 [N] on the device, the row indices of every segment, one after the other;
    meta: int32 [3, S] on the device, per segment (slot, offset of its first row in `rows`, length);
    slots, lengths: the same on the host (grids and the reference read these); max_rank: host int,
    the largest rank of any slot in any layer/projection (the workspace width).
    tiles: None, or int32 [2, n] on the device, the (segment, first row) of each row tile of
    `block_m` rows: launches then take one program row per tile instead of a segments x longest
    segment grid; a fixed-grid caller (CUDA graphs, daemon/engine/prefill_graphs.py) points its unused
    tiles at a segment of length 0. Host `lengths` then only size the split-K choice.
    """

    rows: torch.Tensor
    meta: torch.Tensor
    slots: list[int]
    lengths: list[int]
    max_rank: int
    tiles: torch.Tensor | None = None
    block_m: int | None = None
    _m_blocks: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return len(self.slots)

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    def m_blocks(self, block_m: int) -> int:
        """Row tiles of block_m over all segments (host arithmetic, cached per step)."""
        if block_m not in self._m_blocks:
            self._m_blocks[block_m] = sum(-(-length // block_m) for length in self.lengths)
        return self._m_blocks[block_m]

    @classmethod
    def build(cls, batch: LoraBatch, table: AdapterTable) -> Segments:
        """From `batch.slot_rows` (rows need not be sorted; a segment is the row list of one slot).
        No host read of device data: lengths are shapes, the rows are concatenated on the device."""
        slots = [slot for slot, _ in batch.slot_rows]
        lengths = [int(rows.numel()) for _, rows in batch.slot_rows]
        device = batch.row_slot.device
        if slots:
            rows = torch.cat([rows for _, rows in batch.slot_rows]).to(torch.int32)
        else:
            rows = torch.zeros(0, dtype=torch.int32, device=device)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if slots else np.zeros(0)
        meta = torch.from_numpy(np.stack([np.asarray(slots), offsets, np.asarray(lengths)]).astype(np.int32).reshape(3, -1))
        if device.type == "cuda":
            meta = meta.pin_memory().to(device, non_blocking=True)
        else:
            meta = meta.to(device)
        return cls(rows, meta, slots, lengths, batch_max_rank(batch, table))


def _block_m(max_len: int) -> int:
    return 16 if max_len <= 16 else 32 if max_len <= 32 else 64


def _segments_block_m(segments: Segments) -> int:
    return segments.block_m or _block_m(segments.max_len)


def _grid_rows(segments: Segments, block_m: int) -> tuple[int, int, torch.Tensor, int]:
    """(grid dim 0, grid dim 1, the tile list or a placeholder, its length) of a launch."""
    if segments.tiles is not None:
        return segments.tiles.shape[1], 1, segments.tiles, segments.tiles.shape[1]
    return segments.num_segments, cdiv(segments.max_len, block_m), segments.meta, 0


def _block_r_shrink(max_rank: int) -> int:
    return 16 if max_rank <= 16 else 32 if max_rank <= 32 else 64


if triton is not None:

    @triton.jit
    def _segment_tile(tiles_ptr, num_tiles, BLOCK_M: tl.constexpr, USE_TILES: tl.constexpr):
        """This program's (segment, first row within it): from the tile list, or the grid's first two axes."""
        if USE_TILES:
            segment = tl.load(tiles_ptr + tl.program_id(0))
            m0 = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
        else:
            segment = tl.program_id(0)
            m0 = tl.program_id(1) * BLOCK_M
        return segment, m0

    @triton.jit
    def _globaltimer():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _wait_streamed(ready_ptr, error_ptr, slot, layer, TIMEOUT_NS: tl.constexpr):
        """Spins until ready[slot] > layer: the slot's pages of this layer are in the pool
        (AdapterTable.place_streamed). Past TIMEOUT_NS it raises error[0] and returns."""
        if tl.load(ready_ptr + slot, volatile=True) <= layer:
            began = _globaltimer()
            waiting = 1
            while waiting != 0:
                arrived = tl.load(ready_ptr + slot, volatile=True) > layer
                late = (_globaltimer() - began) > TIMEOUT_NS
                waiting = tl.where(arrived | late, 0, 1)
            if tl.load(ready_ptr + slot, volatile=True) <= layer:
                tl.atomic_xchg(error_ptr, 1)

    @triton.jit(do_not_specialize=['num_segments', 'num_rows', 'slot_stride', 'table_offset', 'chunks_in', 'rank_blocks', 'num_tiles', 'layer',
                                   'member_blocks'])
    def _mbgmm_shrink_kernel(
        x_ptr, v_ptr, rows_ptr, meta_ptr, num_segments, rank_ptr, a_start_ptr, page_ids_ptr, pages_ptr,
        in_dim, max_rank, num_rows, stride_xt, stride_xk, slot_stride, table_offset, chunks_in, k_per_split, rank_blocks,
        tiles_ptr, num_tiles, ready_ptr, error_ptr, layer, member_blocks, v1_ptr, v2_ptr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        ALIGNED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TILES: tl.constexpr,
        STREAM: tl.constexpr, TIMEOUT_NS: tl.constexpr, GROUPED: tl.constexpr,
    ):
        # GROUPED: grid axis 2 also counts the member of a projection group (consecutive projections on one x:
        # q, k, v or gate, up), member_blocks programs each, with its own table entries and workspace slice (v1, v2:
        # pointer arguments, so that the compiler knows them aligned as it knows v)
        segment, m0 = _segment_tile(tiles_ptr, num_tiles, BLOCK_M, USE_TILES)
        task = tl.program_id(2)
        if GROUPED:
            member = task // member_blocks
            task = task % member_blocks
            if member == 1:
                v_ptr = v1_ptr
            elif member == 2:
                v_ptr = v2_ptr
            table_offset += member
        split = task // rank_blocks
        r0 = (task % rank_blocks) * BLOCK_R
        length = tl.load(meta_ptr + 2 * num_segments + segment)
        if m0 >= length:
            return
        slot = tl.load(meta_ptr + segment)
        entry = slot * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        if r0 >= rank:
            return
        if STREAM:  # the expand runs after this kernel on the same stream: it needs no wait of its own
            _wait_streamed(ready_ptr, error_ptr, slot, layer, TIMEOUT_NS)
        first = tl.load(meta_ptr + num_segments + segment)
        a_start = tl.load(a_start_ptr + entry)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < length
        t = tl.load(rows_ptr + first + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        row_index = a_start + offs_r * chunks_in
        offs_k = tl.arange(0, BLOCK_K)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, in_dim)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + offs_k) < k_hi
            x = tl.load(x_ptr + t[:, None] * stride_xt + (k0 + offs_k)[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            ptrs = page_pointers(pages_ptr, page_ids_ptr, row_index, r_ok, k0, offs_k, in_dim, PAGE, ALIGNED, True)
            a = tl.load(ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [R, K]
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc = tl.dot(x, tl.trans(a), acc, input_precision=PRECISION)
        v_ptrs = v_ptr + (split * num_rows + t[:, None]) * max_rank + offs_r[None, :]
        tl.store(v_ptrs, acc, mask=m_ok[:, None] & r_ok[None, :])

    @triton.jit(do_not_specialize=['num_segments', 'num_rows', 'splits', 'slot_stride', 'table_offset', 'chunks_out', 'num_tiles', 'n_per_program'])
    def _mbgmm_expand_kernel(
        v_ptr, y_ptr, rows_ptr, meta_ptr, num_segments, rank_ptr, b_start_ptr, page_ids_ptr, pages_ptr,
        out_dim, max_rank, num_rows, splits, stride_yt, stride_yn, slot_stride, table_offset, chunks_out,
        tiles_ptr, num_tiles, n_per_program,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        ALIGNED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_TILES: tl.constexpr,
    ):
        # One program: a row tile of one segment times n_per_program consecutive output tiles. The
        # split sums of v are added once, held at the full rank (BLOCK_R >= max_rank), and the loop over
        # the output tiles copies the next tiles' B^T asynchronously while this one's dot and store run (Triton 3.6
        # does so only with page_pointers' WIDE); y, which no dot takes, is loaded when its tile comes.
        segment, m0 = _segment_tile(tiles_ptr, num_tiles, BLOCK_M, USE_TILES)
        n_first = tl.program_id(2) * n_per_program * BLOCK_N
        length = tl.load(meta_ptr + 2 * num_segments + segment)
        if m0 >= length:
            return
        slot = tl.load(meta_ptr + segment)
        entry = slot * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        if rank == 0:
            return
        first = tl.load(meta_ptr + num_segments + segment)
        b_start = tl.load(b_start_ptr + entry)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < length
        t = tl.load(rows_ptr + first + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        v_mask = m_ok[:, None] & r_ok[None, :]
        v = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for split in range(0, splits):
            v += tl.load(v_ptr + (split * num_rows + t[:, None]) * max_rank + offs_r[None, :], mask=v_mask, other=0.0)
        v = v.to(pages_ptr.dtype.element_ty)
        if UPCAST:
            v = v.to(tl.float32)
        b_rows = b_start + offs_r * chunks_out
        offs_n = tl.arange(0, BLOCK_N)
        n_last = tl.minimum(n_first + n_per_program * BLOCK_N, out_dim)
        for n0 in range(n_first, n_last, BLOCK_N):
            n_ok = (n0 + offs_n) < out_dim
            ptrs = page_pointers(pages_ptr, page_ids_ptr, b_rows, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED, True)
            b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R, N]
            y_ptrs = y_ptr + t[:, None] * stride_yt + (n0 + offs_n)[None, :] * stride_yn
            y_mask = m_ok[:, None] & n_ok[None, :]
            y = tl.load(y_ptrs, mask=y_mask, other=0.0)
            if UPCAST:
                b = b.to(tl.float32)
            delta = tl.dot(v, b, input_precision=PRECISION)
            tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def _precision(dtype: torch.dtype) -> str:
    # float32 pools get exact fp32 products; bf16/fp16 run on the tensor cores as they are.
    return "ieee" if dtype == torch.float32 else "tf32"


def mbgmm_shrink(x, v, layer, proj, segments: Segments, table, block_m=None, block_r=None, block_k=BLOCK_K, num_warps=4,
                 num_stages=3, members: int = 1):
    """v[s, t, :rank] = partial sums over K split s of x[t] @ A^T for every row t of every segment.

    x: [T, in]; v: float32 [splits, T, max_rank] contiguous, or [members, splits, T, max_rank] for `members`
    consecutive projections from `proj` on this x (each member's partials in its own slice). Grid (segments,
    max_len / block_m, members * rank blocks * splits); programs past their segment's length or rank return at once.
    """
    require_triton("LoRA kernels")
    splits, num_rows, width = v.shape[-3:]
    page, in_dim, chunks_in, slot_stride, offset = paged_operand(table, layer, proj, side=0)
    block_m = block_m or _segments_block_m(segments)
    block_r = block_r or _block_r_shrink(width)
    block_k, aligned = page_block(page, in_dim, block_k)
    k_per_split = cdiv(cdiv(in_dim, splits), block_k) * block_k
    rank_blocks = cdiv(width, block_r)
    grid0, grid1, tiles, num_tiles = _grid_rows(segments, block_m)
    member_slices = list(v) if members > 1 else [v]  # each member's partials, passed as its own pointer argument
    _mbgmm_shrink_kernel[(grid0, grid1, members * rank_blocks * splits)](
        x, v, segments.rows, segments.meta, segments.num_segments, table.rank, table.a_start, table.page_ids, table.pool.pages,
        in_dim, width, num_rows, x.stride(0), x.stride(1), slot_stride, offset, chunks_in, k_per_split, rank_blocks,
        tiles, num_tiles, table.ready, table.stream_error, layer, rank_blocks * splits, *members_after_first(member_slices),
        PAGE=page, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, ALIGNED=aligned,
        PRECISION=_precision(x.dtype), UPCAST=widen_bf16_dots(x.dtype, _mbgmm_shrink_kernel), USE_TILES=segments.tiles is not None,
        STREAM=table.streaming, TIMEOUT_NS=STREAM_TIMEOUT_NS, GROUPED=members > 1, num_warps=num_warps, num_stages=num_stages,
    )


def expand_tiles(width: int, out_dim: int, page_elems: int) -> tuple[int, int, bool]:
    """(rank block, output tile, whether the tile lies in one page) of an expand over a workspace of
    `width` ranks: the whole rank in one block, the B^T tile at most EXPAND_TILE_BYTES of bf16."""
    block_r = next_power_of_2(max(width, 16))
    block_n, aligned = page_block(page_elems, out_dim, max(16, min(BLOCK_N, EXPAND_TILE_ELEMS // block_r)))
    return block_r, block_n, aligned


def expand_groups(segments: Segments, block_m: int, n_tiles: int, device) -> int:
    """Output tiles a program of the expand loops over: enough programs for EXPAND_PROGRAMS_PER_SM a
    SM, then as many tiles each as that allows (a longer loop re-reads less of v, pipelines more)."""
    want = EXPAND_PROGRAMS_PER_SM * sm_count(device, otherwise=8)
    groups = min(n_tiles, max(1, cdiv(want, max(1, segments.m_blocks(block_m)))))
    return cdiv(n_tiles, groups)


def mbgmm_expand(v, y, layer, proj, segments: Segments, table, block_m=None, n_per_program=None, num_warps=4, num_stages=3):
    """y[t] += (sum over splits of v[:, t, :rank]) @ B^T for every row of every segment; other rows
    untouched. v: float32 [splits, T, max_rank]; y: [T, out], any strides. Grid (row tiles, output
    tile groups): each program sums its rows' v once and loops over n_per_program output tiles
    (`expand_groups` unless given)."""
    require_triton("LoRA kernels")
    splits, num_rows, width = v.shape
    page, out_dim, chunks_out, slot_stride, offset = paged_operand(table, layer, proj, side=1)
    block_m = block_m or _segments_block_m(segments)
    block_r, block_n, aligned = expand_tiles(width, out_dim, page)
    n_tiles = cdiv(out_dim, block_n)
    n_per_program = n_per_program or expand_groups(segments, block_m, n_tiles, y.device)
    grid0, grid1, tiles, num_tiles = _grid_rows(segments, block_m)
    _mbgmm_expand_kernel[(grid0, grid1, cdiv(n_tiles, n_per_program))](
        v, y, segments.rows, segments.meta, segments.num_segments, table.rank, table.b_start, table.page_ids, table.pool.pages,
        out_dim, width, num_rows, splits, y.stride(0), y.stride(1), slot_stride, offset, chunks_out, tiles, num_tiles,
        n_per_program,
        PAGE=page, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, ALIGNED=aligned,
        PRECISION=_precision(table.pool.pages.dtype), UPCAST=widen_bf16_dots(table.pool.pages.dtype, _mbgmm_expand_kernel),
        USE_TILES=segments.tiles is not None, num_warps=num_warps, num_stages=num_stages,
    )


def mbgmm_splits(segments: Segments, in_dim: int, page_elems: int, device) -> int:
    """Split-K of the shrink: enough programs for the SMs, at most MAX_SPLITS and, past FEW_TILES row
    tiles, at most SPLIT_PARTIALS / width (each split adds a float32 [T, width] partial that the expand
    sums once a program)."""
    block_m = _segments_block_m(segments)
    block_k, _ = page_block(page_elems, in_dim, BLOCK_K)
    m_blocks = segments.m_blocks(block_m)
    programs = m_blocks * cdiv(segments.max_rank, _block_r_shrink(segments.max_rank))
    width = cdiv(segments.max_rank, 16) * 16
    most = MAX_SPLITS if m_blocks <= FEW_TILES else max(1, min(MAX_SPLITS, SPLIT_PARTIALS // width))
    return num_splits(programs, cdiv(in_dim, block_k), device, per_sm=2, most=most)


def mbgmm(x, y, layer, proj, segments: Segments, table, workspace=None):
    """y[t] += (x[t] @ A^T) @ B^T for the rows of each segment with the segment's adapter
    (apply_lora_ref's semantics); two launches, no host sync.

    x: [T, in], y: [T, out] of the model dtype (y may be a strided column slice of a fused output);
    segments: `Segments.build(batch, table)`, once per step; workspace: optional float32 buffer of
    >= workspace_numel(T, segments.max_rank) elements. Rows in no segment are untouched.
    Roofline: bytes ~ e*(sum_seg r_s*(in+out) + T*(in+2*out)) (+ x re-read per 64 ranks, from L2);
    flops = 2*sum_seg len_s*r_s*(in+out), on the tensor cores.
    """
    in_dim, _ = check_operands(x, y, proj, table)
    num_rows = x.shape[0]
    if num_rows == 0 or segments.num_segments == 0 or segments.max_rank <= 0:
        return
    splits = mbgmm_splits(segments, in_dim, table.pool.page_elems, x.device)
    v = workspace_view(workspace, splits, num_rows, segments.max_rank, x.device)
    mbgmm_shrink(x, v, layer, proj, segments, table)
    mbgmm_expand(v, y, layer, proj, segments, table)


def group_fits(table: AdapterTable, proj: int, members: int) -> bool:
    """Can `members` consecutive projections from `proj` (q, k, v or gate, up) share one MBGMM shrink launch
    (`mbgmm_group`): one to three of them with the same input size. Their outputs may differ (GQA's k and v): each
    member's expand is its own launch."""
    if not 1 <= members <= 3 or proj + members > len(table.shapes):
        return False
    return all(table.shapes[proj + m][0] == table.shapes[proj][0] for m in range(1, members))


def mbgmm_group(x, y, layer, proj, members, segments: Segments, table, workspace=None, untargeted: frozenset = frozenset()):
    """`mbgmm` for `members` consecutive projections from `proj` on the same x, their shrinks in one launch (x read
    by one launch, its programs counted over the members on the grid's third axis), then each member's expand: y is
    their outputs side by side [T, sum of out] (the fused GEMM's output, any strides). Same result as one `mbgmm` per
    member on y's column slices. The members' partials share the workspace, so the shrink splits K at most
    MAX_SPLITS / members ways, and each expand sums as many partials. untargeted: projections no segment's adapter
    targets (`AdapterTable.untargeted`), whose expand is not launched (its programs would all return at once). The
    caller checks `group_fits`."""
    in_dim, _ = check_operands(x, y[:, : table.shapes[proj][1]], proj, table)
    if y.shape[1] != sum(table.shapes[proj + m][1] for m in range(members)):
        raise ValueError(f"y {tuple(y.shape)} is not the {members} projections' outputs side by side")
    num_rows = x.shape[0]
    if num_rows == 0 or segments.num_segments == 0 or segments.max_rank <= 0:
        return
    if not group_fits(table, proj, members):
        raise ValueError(f"projections {proj}..{proj + members - 1} cannot share one launch (see group_fits)")
    splits = mbgmm_splits(segments, in_dim, table.pool.page_elems, x.device)
    while splits * members > MAX_SPLITS:
        splits //= 2
    v = workspace_view(workspace, members * splits, num_rows, segments.max_rank, x.device).view(members, splits, num_rows, -1)
    mbgmm_shrink(x, v, layer, proj, segments, table, members=members)
    col = 0
    for member in range(members):  # the expand per member: grouped, it took 1.75x as long (BENCHMARKS.md, MBGMM)
        width = table.shapes[proj + member][1]
        if proj + member not in untargeted:
            mbgmm_expand(v[member], y[:, col : col + width], layer, proj + member, segments, table)
        col += width


def mbgmm_ref(x, y, layer, proj, segments: Segments, table, workspace=None):
    """Pure-torch `mbgmm` (same signature and result): per segment one gather and two fp32 GEMMs.
    Ranks come from the table's host mirror, like apply_lora_ref."""
    in_dim, out_dim = check_operands(x, y, proj, table)
    chunks_in, chunks_out = table.chunks[proj]
    pages = table.pool.pages
    offset = 0
    for slot, length in zip(segments.slots, segments.lengths):
        rows = segments.rows[offset : offset + length].long()
        offset += length
        rank = min(int(table.rank_host[slot, layer, proj]), segments.max_rank)
        if rank == 0 or length == 0:
            continue
        a = gather_rows(pages, table.page_ids, int(table.a_start_host[slot, layer, proj]), rank, chunks_in, in_dim)
        b_t = gather_rows(pages, table.page_ids, int(table.b_start_host[slot, layer, proj]), rank, chunks_out, out_dim)
        delta = (x.index_select(0, rows).float() @ a.float().t()) @ b_t.float()
        y[rows] = (y.index_select(0, rows).float() + delta).to(y.dtype)


def lora_prefill(x: torch.Tensor, y: torch.Tensor, layer: int, proj: int, batch: LoraBatch, table: AdapterTable, *,
                 segments: Segments, workspace: torch.Tensor | None = None) -> None:
    """Drop-in for `apply_lora_ref(x, y, layer, proj, batch, table)` on the GPU for steps whose rows
    share adapters (prefill, chunked prefill mixed with decode). segments: `Segments.build(batch,
    table)` once per step; `batch` itself is not read again (its rows are in `segments`)."""
    mbgmm(x, y, layer, proj, segments, table, workspace)
