"""MBGMV: the decode LoRA with no padding (S-LoRA's Multi-size Batched Gather Matrix-Vector product).
Each row costs only its own rank, reading A rows and B^T rows in place from the unified page pool.
`lora_decode` is what the model calls for a decode step in place of `apply_lora_ref`.

Two launches per projection. Shrink: one program per (row, 8 rank rows, K split) writes a partial
`x @ A^T` to the workspace. Expand: one program per (row, N columns) sums the partials and adds
`v @ B^T` into y. A program does one tile with every load independent, and programs past a row's
rank return at once: a decode call moves ~40 MB in a few thousand small pieces, so what keeps HBM
busy is many loads in flight, not a long loop per program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from lorad.gpu_ops.bgmv import (
    MAX_SPLITS,
    check_operands,
    members_after_first,
    page_block,
    paged_operand,
    table_offsets,
    workspace_view,
)
from lorad.gpu_ops.launch import cdiv, early_options, launching_early, next_power_of_2, require_triton
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable

try:
    import triton
    import triton.language as tl

    from lorad.gpu_ops.bgmv import page_pointers
    from lorad.gpu_ops.launch import let_dependents_start, wait_for_previous
except ImportError:
    triton = None

__all__ = ["DecodeConfig", "decode_config", "group_fits", "lora_decode", "mbgmv",
           "mbgmv_expand", "mbgmv_group", "mbgmv_shrink"]


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of one MBGMV call. A shrink program reads shrink_r rank rows x (k_tiles * block_k)
    columns of A with num_warps warps (K splits: as many as block_k tiles allow, at most
    MAX_SPLITS); an expand program reads expand_r rank rows x block_n columns of B^T per step of its
    rank loop with expand_warps warps."""

    shrink_r: int = 8
    block_k: int = 1024
    k_tiles: int = 1
    num_warps: int = 4
    expand_r: int = 64
    block_n: int = 128
    expand_warps: int = 4


# Per projection shape (in, out): the best shrink and expand of bench/lora_kernels.py's sweep on an
# H100, 64 rows of ranks 8..64, timed together (BENCHMARKS.md). Other shapes take the default.
TUNED = {
    (4096, 4096): DecodeConfig(shrink_r=8, block_k=2048, expand_r=64, block_n=128),  # q, o
    (4096, 1024): DecodeConfig(shrink_r=8, block_k=1024, expand_r=64, block_n=256),  # k, v (GQA)
    (4096, 11008): DecodeConfig(shrink_r=8, block_k=1024, expand_r=64, block_n=128),  # gate, up
    (11008, 4096): DecodeConfig(shrink_r=8, block_k=1024, expand_r=64, block_n=256),  # down
}


# Programmatic dependent launch (Hopper and later; `pdl=True` below): the expand is launched while the shrink
# still runs and loads its B tile (the bulk of its bytes) before waiting for the shrink to complete, so its
# ramp-up hides under the shrink's tail. Tried and dropped: launching the shrink, too, early behind the
# projection's GEMM (no gain over this, measured in the engine).
# With it the best tiles change: bench/lora_kernels.py --pdl-pairs on an H100 timed every shrink x expand pair
# for q/o, gate/up and down (BENCHMARKS.md). Batches of ranks <= 16 (the engine's low-rank decode graphs):
# wider shrink tiles with 8 warps, narrow 2-warp expand programs that wait cheaply while the shrink ends.
# Ranks up to 64: the expand walks the rank in 16-row blocks over 512 columns (its first block is what it
# loads before the wait).
TUNED_LOW_RANK_PDL = {
    shape: DecodeConfig(shrink_r=8, block_k=2048, num_warps=8, expand_r=16, block_n=256, expand_warps=2)
    for shape in ((4096, 4096), (4096, 11008), (11008, 4096))
}
TUNED_PDL = {
    (4096, 4096): DecodeConfig(shrink_r=8, block_k=1024, expand_r=16, block_n=512),  # q, o
    (4096, 11008): DecodeConfig(shrink_r=8, block_k=2048, expand_r=16, block_n=512),  # gate, up
    (11008, 4096): DecodeConfig(shrink_r=8, block_k=1024, expand_r=16, block_n=512),  # down
}


def nearest_shape(shapes, in_dim: int, out_dim: int) -> tuple[int, int]:
    """The tuned shape closest to (in_dim, out_dim) in log scale on both sides: another model's gate/up
    (4096 -> 14336) takes the 7B gate/up tiles, its down the 7B down tiles."""
    def distance(shape):
        return abs(math.log(shape[0] / in_dim)) + abs(math.log(shape[1] / out_dim))

    return min(shapes, key=distance)


@functools.lru_cache(maxsize=None)
def decode_config(in_dim: int, out_dim: int, max_rank: int, pdl: bool = False) -> DecodeConfig:
    """The tiles for a projection shape (pdl: the expand launched early); cached, so the launch path pays a
    dict lookup. The early launch takes the tuned tiles of the nearest shape where its own was not swept:
    the plain tiles' wide expand grid, every program of which waits for the shrink, costs more launched early
    than in stream order (Llama-3-8B's MLP, 14336 wide, with the plain tiles: a decode step 15% longer)."""
    if pdl and max_rank <= 64:
        table = TUNED_LOW_RANK_PDL if max_rank <= 16 else TUNED_PDL
        return table[nearest_shape(table, in_dim, out_dim)]
    config = TUNED.get((in_dim, out_dim)) or DecodeConfig()
    if max_rank <= 16:
        config = dataclasses.replace(config, expand_r=16)
    return config


if triton is not None:

    @triton.jit(do_not_specialize=['num_rows', 'splits', 'rank_blocks', 'slot_stride', 'table_offset', 'chunks_in', 'member_stride'])
    def _mbgmv_shrink_kernel(
        x_ptr, v_ptr, row_slot_ptr, rank_ptr, a_start_ptr, page_ids_ptr, pages_ptr,
        in_dim, max_rank, width, num_rows, splits, rank_blocks, k_per_split,
        stride_xt, stride_xk, slot_stride, table_offset, chunks_in, member_stride,
        PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, ALIGNED: tl.constexpr,
        GROUPED: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        """Program (row, r0, split; member): v[member][split, row, r0:r0 + BLOCK_R] = x[row, K range] @
        A[r0:r0 + BLOCK_R, K range]^T, the K range being K_TILES tiles of BLOCK_K from split * k_per_split.
        GROUPED: grid axis 1 is the member of a projection group (consecutive projections on one x: q, k, v
        or gate, up), each with its own table entries and its own workspace slice member_stride apart.
        PDL: the expand may launch as soon as every shrink program has started. EARLY: this kernel was launched early
        (gpu_ops/launch.py): every program waits for the kernel before it, past the table's reads."""
        let_dependents_start(PDL)
        task = tl.program_id(0)
        if GROUPED:
            member = tl.program_id(1)
            v_ptr += member * member_stride
            table_offset += member
        split = task % splits
        rest = task // splits
        r0 = (rest % rank_blocks) * BLOCK_R
        row = rest // rank_blocks
        slot = tl.load(row_slot_ptr + row)
        entry = tl.maximum(slot, 0) * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        a_start = tl.load(a_start_ptr + entry)
        wait_for_previous(EARLY)
        if (slot >= 0) & (r0 < rank):
            rows = r0 + tl.arange(0, BLOCK_R)
            r_ok = rows < rank
            row_index = a_start + rows * chunks_in
            offs_k = tl.arange(0, BLOCK_K)
            x_row = x_ptr + row.to(tl.int64) * stride_xt
            k_lo = split * k_per_split
            k_hi = tl.minimum(k_lo + k_per_split, in_dim)
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for tile in tl.static_range(K_TILES):  # unrolled: every tile's loads in flight at once
                k0 = k_lo + tile * BLOCK_K
                k_ok = (k0 + offs_k) < k_hi
                xk = tl.load(x_row + (k0 + offs_k) * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
                ptrs = page_pointers(pages_ptr, page_ids_ptr, row_index, r_ok, k0, offs_k, in_dim, PAGE, ALIGNED, True)
                a = tl.load(ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            # An empty K range still stores its zeros: the expand sums every split.
            tl.store(v_ptr + (split * num_rows + row) * width + rows, acc, mask=r_ok)

    @triton.jit
    def _row_partials(v_ptr, row, rows, r_ok, width, num_rows, splits, SPLITS: tl.constexpr):
        """sum over splits of v[:, row, rows], one [SPLITS, R] load from L2."""
        offs_s = tl.arange(0, SPLITS)
        ptrs = v_ptr + (offs_s[:, None] * num_rows + row) * width + rows[None, :]
        partial = tl.load(ptrs, mask=(offs_s < splits)[:, None] & r_ok[None, :], other=0.0, cache_modifier=".cg")
        return tl.sum(partial, axis=0)

    @triton.jit(do_not_specialize=['num_rows', 'splits', 'n_tiles', 'slot_stride', 'table_offset', 'chunks_out',
                                   'member_stride', 'out_dim1', 'out_dim2', 'chunks_out1', 'chunks_out2', 'col1', 'col2'])
    def _mbgmv_expand_kernel(
        v_ptr, y_ptr, row_slot_ptr, rank_ptr, b_start_ptr, page_ids_ptr, pages_ptr,
        out_dim, max_rank, width, num_rows, splits, n_tiles, stride_yt, stride_yn, slot_stride, table_offset, chunks_out,
        member_stride, out_dim1, out_dim2, chunks_out1, chunks_out2, col1, col2,
        PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ALIGNED: tl.constexpr,
        GROUPED: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        """Program (row, n0; member): y[row, col + n0:col + n0 + BLOCK_N] += (sum over splits of
        v[member][:, row, :rank]) @ B^T[:rank, n0:n0 + BLOCK_N]; no atomics, each (row, column tile) has one
        owner. GROUPED: grid axis 1 is the member of a projection group (see the shrink); member 0 writes
        columns from 0 with (out_dim, chunks_out), members 1 and 2 from col1 / col2 with their own.
        PDL: launched while the shrink still runs; the first rank block of B (the bulk of the bytes) is loaded
        before waiting for the shrink to complete, the partials and y after. EARLY: in a step launched early
        (gpu_ops/launch.py), where the kernel after this one may start at once."""
        let_dependents_start(EARLY)
        task = tl.program_id(0)
        if GROUPED:
            member = tl.program_id(1)
            if member == 1:
                out_dim, chunks_out, y_ptr = out_dim1, chunks_out1, y_ptr + col1 * stride_yn
            elif member == 2:
                out_dim, chunks_out, y_ptr = out_dim2, chunks_out2, y_ptr + col2 * stride_yn
            v_ptr += member * member_stride
            table_offset += member
        n0 = (task % n_tiles) * BLOCK_N
        row = task // n_tiles
        slot = tl.load(row_slot_ptr + row)
        entry = tl.maximum(slot, 0) * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        b_start = tl.load(b_start_ptr + entry)
        work = (slot >= 0) & (rank > 0) & (n0 < out_dim)
        if PDL:  # every program waits, so that this kernel completes only after the shrink
            offs_n = tl.arange(0, BLOCK_N)
            n_ok = ((n0 + offs_n) < out_dim) & work
            rows = tl.arange(0, BLOCK_R)
            r_ok = (rows < rank) & work
            ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + rows * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED, False)
            b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
            wait_for_previous(PDL)
        if work:
            if not PDL:
                offs_n = tl.arange(0, BLOCK_N)
                n_ok = (n0 + offs_n) < out_dim
                rows = tl.arange(0, BLOCK_R)
                r_ok = rows < rank
                # The first rank block (the whole rank up to BLOCK_R), y and the partials: all independent.
                ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + rows * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED, False)
                b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
            y_ptrs = y_ptr + row.to(tl.int64) * stride_yt + (n0 + offs_n) * stride_yn
            y = tl.load(y_ptrs, mask=n_ok, other=0.0)
            v = _row_partials(v_ptr, row, rows, r_ok, width, num_rows, splits, SPLITS)
            delta = tl.sum(b.to(tl.float32) * v[:, None], axis=0)
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks past BLOCK_R (> 64 by default)
                rows = r0 + tl.arange(0, BLOCK_R)
                r_ok = rows < rank
                ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + rows * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED, False)
                b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
                v = _row_partials(v_ptr, row, rows, r_ok, width, num_rows, splits, SPLITS)
                delta += tl.sum(b.to(tl.float32) * v[:, None], axis=0)
            tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


@functools.lru_cache(maxsize=4096)
def _shrink_plan(page: int, in_dim: int, splits: int | None, config: DecodeConfig) -> tuple[int, int, int, bool]:
    """(splits, k_per_split, block_k, aligned) of a shrink, cached per shape. splits None: as many K
    splits as block_k tiles allow with k_tiles tiles a program, at most MAX_SPLITS."""
    block_k, aligned = page_block(page, in_dim, config.block_k)
    if splits is None:
        tiles = cdiv(in_dim, block_k)
        splits = cdiv(tiles, max(config.k_tiles, cdiv(tiles, MAX_SPLITS)))
    return splits, cdiv(cdiv(in_dim, splits), block_k) * block_k, block_k, aligned


def _shrink(x, v, layer, proj, row_slot, table, max_rank, config: DecodeConfig, members: int = 1, pdl: bool = False) -> None:
    """v: [members, splits, T, width] (or [splits, T, width] for one); members: consecutive projections
    from `proj` on the same x; pdl: let the expand launch early."""
    splits, num_rows, width = v.shape[-3:]
    page, in_dim, chunks_in, slot_stride, offset = paged_operand(table, layer, proj, side=0)
    _, k_per_split, block_k, aligned = _shrink_plan(page, in_dim, splits, config)
    rank_blocks = cdiv(max_rank, config.shrink_r)
    early = launching_early()
    _mbgmv_shrink_kernel[(num_rows * rank_blocks * splits, members)](
        x, v, row_slot, table.rank, table.a_start, table.page_ids, table.pool.pages,
        in_dim, max_rank, width, num_rows, splits, rank_blocks, k_per_split,
        x.stride(0), x.stride(1), slot_stride, offset, chunks_in, splits * num_rows * width,
        PAGE=page, BLOCK_R=config.shrink_r, BLOCK_K=block_k, K_TILES=k_per_split // block_k, ALIGNED=aligned,
        GROUPED=members > 1, PDL=pdl or early, EARLY=early, num_warps=config.num_warps, num_stages=1, **early_options(early),
    )


def _expand(v, y, layer, proj, row_slot, table, max_rank, config: DecodeConfig, members: int = 1, pdl: bool = False) -> None:
    """y: [T, sum of the members' out] (the members' outputs side by side, as the fused q|k|v or gate|up
    GEMM writes them), or one projection's [T, out]."""
    splits, num_rows, width = v.shape[-3:]
    page = table.pool.page_elems
    outs = [table.shapes[proj + m][1] for m in range(members)]
    chunks = [table.chunks[proj + m][1] for m in range(members)]
    cols = [sum(outs[:m]) for m in range(members)]
    slot_stride, offset = table_offsets(table, layer, proj)
    block_n, aligned = page_block(page, outs[0], config.block_n)
    block_r = min(config.expand_r, max(16, next_power_of_2(max_rank)))
    n_tiles = cdiv(max(outs), block_n)
    early = launching_early()
    pdl = pdl or early  # the expand launched early waits as it does behind the shrink
    _mbgmv_expand_kernel[(num_rows * n_tiles, members)](
        v, y, row_slot, table.rank, table.b_start, table.page_ids, table.pool.pages,
        outs[0], max_rank, width, num_rows, splits, n_tiles, y.stride(0), y.stride(1), slot_stride, offset, chunks[0],
        splits * num_rows * width, *members_after_first(outs), *members_after_first(chunks), *members_after_first(cols),
        PAGE=page, BLOCK_R=block_r, BLOCK_N=block_n, SPLITS=max(2, next_power_of_2(splits)), ALIGNED=aligned,
        GROUPED=members > 1, PDL=pdl, EARLY=early, num_warps=config.expand_warps, num_stages=1, **early_options(pdl),
    )


def mbgmv_shrink(x, v, layer, proj, row_slot, table, max_rank, block_r=8, block_k=1024, num_warps=4):
    """v[s, t, :rank_t] = partial sums of x[t] @ A^T over K split s (columns past the rank unwritten).

    x: [T, in]; v: float32 [splits, T, width >= max_rank] contiguous (splits from its shape);
    row_slot: int32 [T]. One program per (row, block_r rank rows, split); those past the rank return.
    """
    require_triton("LoRA kernels")
    _shrink(x, v, layer, proj, row_slot, table, max_rank, DecodeConfig(shrink_r=block_r, block_k=block_k, num_warps=num_warps))


def mbgmv_expand(v, y, layer, proj, row_slot, table, max_rank, block_r=64, block_n=128, num_warps=4):
    """y[t] += (sum over splits of v[:, t, :rank_t]) @ B^T; rows without an adapter untouched.

    v: float32 [splits, T, width]; y: [T, out], any strides. One program per (row, block_n columns),
    looping over the rank in steps of block_r.
    """
    require_triton("LoRA kernels")
    _expand(v, y, layer, proj, row_slot, table, max_rank, DecodeConfig(expand_r=block_r, block_n=block_n, expand_warps=num_warps))


def mbgmv(x, y, layer, proj, row_slot, table, max_rank, workspace=None, *, config: DecodeConfig | None = None,
          pdl: bool = False):
    """y[t] += (x[t] @ A^T) @ B^T per row with the row's own adapter and rank (apply_lora_ref's
    semantics); two launches, no host sync.

    x: [T, in], y: [T, out] of the model dtype (y may be a strided column slice of a fused output);
    row_slot: int32 [T] on the device (-1: base only, y's row untouched); max_rank: host int >= every
    rank in the batch (the workspace width; `bgmv.batch_max_rank` or the configured max); workspace: optional
    float32 buffer of >= workspace_numel(T, max_rank) elements, reused across calls; config: tiles
    (default: `decode_config` for the shape); pdl: launch the expand early (Hopper and later: the caller
    checks `launch.pdl_unavailable`).
    Roofline: bytes = e*(sum_t r_t*(in+out) + T*(in+2*out)) + small; flops = 2*sum_t r_t*(in+out).
    """
    in_dim, out_dim = check_operands(x, y, proj, table, row_slot)
    num_rows = x.shape[0]
    if num_rows == 0 or max_rank <= 0:
        return
    require_triton("LoRA kernels")
    config = config or decode_config(in_dim, out_dim, max_rank, pdl)
    splits = _shrink_plan(table.pool.page_elems, in_dim, None, config)[0]
    v = workspace_view(workspace, splits, num_rows, max_rank, x.device)
    _shrink(x, v, layer, proj, row_slot, table, max_rank, config, pdl=pdl)
    _expand(v, y, layer, proj, row_slot, table, max_rank, config, pdl=pdl)


def group_fits(table: AdapterTable, proj: int, members: int, max_rank: int, config: DecodeConfig | None = None,
               pdl: bool = False) -> DecodeConfig | None:
    """The tiles for a projection group's single launch pair (`mbgmv_group`; config None: `decode_config`'s,
    pdl as there), or None when it cannot have one: the members must share their input size and, along
    their outputs, the tile and its alignment, and the workspace must hold every member's partials."""
    return _group_config(tuple(table.shapes), table.pool.page_elems, proj, members, max_rank, config, pdl)


@functools.lru_cache(maxsize=256)
def _group_config(shapes: tuple, page: int, proj: int, members: int, max_rank: int, config: DecodeConfig | None,
                  pdl: bool) -> DecodeConfig | None:
    """group_fits per shape (eager decode steps ask it twice a layer)."""
    if not 1 <= members <= 3 or proj + members > len(shapes):
        return None
    in_dim, out_dim = shapes[proj]
    config = config or decode_config(in_dim, out_dim, max_rank, pdl)
    for m in range(1, members):
        other_in, other_out = shapes[proj + m]
        if other_in != in_dim or page_block(page, other_out, config.block_n) != page_block(page, out_dim, config.block_n):
            return None
    splits = _shrink_plan(page, in_dim, None, config)[0]
    if members * splits > MAX_SPLITS:  # workspace_numel sizes the workspace for MAX_SPLITS partials a row
        return None
    return config


def mbgmv_group(x, y, layer, proj, members, row_slot, table, max_rank, workspace=None, *, config: DecodeConfig | None = None,
                pdl: bool = False):
    """`mbgmv` for `members` consecutive projections from `proj` on the same x (q, k, v or gate, up) in one
    shrink and one expand launch: y is their outputs side by side [T, sum of out] (the fused GEMM's output,
    any strides). Same semantics as one `mbgmv` per member on y's column slices. The caller checks
    `group_fits` (config: its answer); pdl as in `mbgmv`."""
    num_rows = x.shape[0]
    in_dim, _ = check_operands(x, y[:, : table.shapes[proj][1]], proj, table, row_slot)
    if y.shape[1] != sum(table.shapes[proj + m][1] for m in range(members)):
        raise ValueError(f"y {tuple(y.shape)} is not the {members} projections' outputs side by side")
    if num_rows == 0 or max_rank <= 0:
        return
    require_triton("LoRA kernels")
    config = config or group_fits(table, proj, members, max_rank, pdl=pdl)
    if config is None:
        raise ValueError(f"projections {proj}..{proj + members - 1} cannot share one launch (see group_fits)")
    splits = _shrink_plan(table.pool.page_elems, in_dim, None, config)[0]
    v = workspace_view(workspace, members * splits, num_rows, max_rank, x.device).view(members, splits, num_rows, -1)
    _shrink(x, v, layer, proj, row_slot, table, max_rank, config, members, pdl)
    _expand(v, y, layer, proj, row_slot, table, max_rank, config, members, pdl)


def lora_decode(x: torch.Tensor, y: torch.Tensor, layer: int, proj: int, batch: LoraBatch, table: AdapterTable, *,
                max_rank: int, workspace: torch.Tensor | None = None, pdl: bool = False) -> None:
    """Drop-in for `apply_lora_ref(x, y, layer, proj, batch, table)` on the GPU, per-row (best when
    rows rarely share an adapter, i.e. decode). max_rank: `bgmv.batch_max_rank(batch, table)` computed once
    per step (or the configured max); workspace and pdl as in `mbgmv`."""
    mbgmv(x, y, layer, proj, batch.row_slot, table, max_rank, workspace, pdl=pdl)
