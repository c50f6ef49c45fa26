"""MBGMV: the decode LoRA with no padding (S-LoRA's Multi-size Batched Gather Matrix-Vector product).
Each row costs only its own rank, reading A rows and B^T rows in place from the unified page pool.
`lora_decode` is what the model calls for a decode step in place of `apply_lora_ref`.

One launch per projection: its first programs are the shrink tiles (row, 16 rank rows, K split), each
writing a partial `x @ A^T` to the workspace and counting itself done on the row's counter; the rest
are the expand tiles (row, N columns), which load their B^T tile, wait until the row's shrink tiles
are all counted, sum the partials and add into y. Every program does one tile with all its loads
independent, which is what a ~40 MB, latency-bound call needs to keep HBM busy.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from lorad.gpu_ops.bgmv import (
    MAX_SPLITS,
    batch_max_rank,
    cdiv,
    check_operands,
    lora_rows_ref,
    page_block,
    require_triton,
    table_offsets,
    triton_next_power_of_2,
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

__all__ = ["DecodeConfig", "decode_config", "decode_sync_errors", "lora_decode", "mbgmv", "mbgmv_ref", "mbgmv_shrink", "mbgmv_expand", "batch_max_rank"]


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of one MBGMV call. A shrink program reads shrink_r rank rows x (k_tiles * block_k)
    columns of A with num_warps warps; an expand program reads expand_r rank rows x block_n columns of
    B^T per step of its rank loop with expand_warps (0: num_warps). fused: one launch, the expand
    waiting on per-row counters (slower on the H100 so far: BENCHMARKS.md), else two launches."""

    shrink_r: int = 16
    block_k: int = 1024
    k_tiles: int = 1
    expand_r: int = 64
    block_n: int = 128
    num_warps: int = 4
    expand_warps: int = 0
    fused: bool = False


# Per projection shape (in, out): the best of bench/lora_kernels.py's sweep on an H100 with 64 rows of
# ranks 8..64 (BENCHMARKS.md). Other shapes take the nearest rule in `decode_config`.
TUNED = {
    (4096, 4096): DecodeConfig(),
    (4096, 1024): DecodeConfig(),
    (4096, 11008): DecodeConfig(),
    (11008, 4096): DecodeConfig(),
}


@functools.lru_cache(maxsize=None)
def decode_config(in_dim: int, out_dim: int, max_rank: int) -> DecodeConfig:
    """The tiles for a projection shape; cached, so the launch path pays a dict lookup."""
    config = TUNED.get((in_dim, out_dim)) or DecodeConfig()
    if max_rank <= 16:
        config = dataclasses.replace(config, expand_r=16)
    return config


# Per-row counters of the fused launch, one buffer per device, zero between launches (the last
# expand program of a row resets its counter). Buffers are never freed: a captured CUDA graph keeps
# the address it saw. One stream at a time per device may run `mbgmv` in fused mode.
_SYNC: dict = {}
_SYNC_KEEP: list = []


def _sync_buffer(device: torch.device, rows: int) -> torch.Tensor:
    """int32 [capacity]: counters for rows 0..capacity-2, then one error cell."""
    buffer = _SYNC.get(device)
    if buffer is None or buffer.numel() < rows + 1:
        buffer = torch.zeros(max(1024, triton_next_power_of_2(rows + 1)), dtype=torch.int32, device=device)
        _SYNC[device] = buffer
        _SYNC_KEEP.append(buffer)
    return buffer


def decode_sync_errors(device: torch.device) -> int:
    """Fused launches whose expand gave up waiting (never expected; a nonzero value means a result
    was wrong). Reads the device: tests and health checks only."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = _SYNC.get(device)
    return 0 if buffer is None else int(buffer[-1].item())


if triton is not None:

    @triton.jit
    def _shrink_task(
        task, x_ptr, v_ptr, row_slot_ptr, rank_ptr, a_start_ptr, page_ids_ptr, pages_ptr, sync_ptr,
        in_dim, max_rank, width, num_rows, splits, rank_blocks, k_per_split,
        stride_xt, stride_xk, slot_stride, table_offset, chunks_in,
        PAGE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, ALIGNED: tl.constexpr,
        SIGNAL: tl.constexpr,
    ):
        """v[split, row, r0:r0 + BLOCK_R] = x[row, K range] @ A[r0:r0 + BLOCK_R, K range]^T, the K range
        being K_TILES tiles of BLOCK_K from split * k_per_split (clipped to in_dim)."""
        split = task % splits
        rest = task // splits
        r0 = (rest % rank_blocks) * BLOCK_R
        row = rest // rank_blocks
        slot = tl.load(row_slot_ptr + row)
        entry = tl.maximum(slot, 0) * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        a_start = tl.load(a_start_ptr + entry)
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
                ptrs = page_pointers(pages_ptr, page_ids_ptr, row_index, r_ok, k0, offs_k, in_dim, PAGE, ALIGNED)
                a = tl.load(ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
                acc += tl.sum(a.to(tl.float32) * xk[None, :], axis=1)
            # An empty K range still stores its zeros: the expand sums every split.
            tl.store(v_ptr + (split * num_rows + row) * width + rows, acc, mask=r_ok)
            if SIGNAL:
                tl.debug_barrier()  # every thread's partial is written before the release below
                tl.atomic_add(sync_ptr + row, 1, sem="release", scope="gpu")

    @triton.jit
    def _row_partials(v_ptr, row, rows, r_ok, width, num_rows, splits, SPLITS: tl.constexpr):
        """sum over splits of v[:, row, rows], one [SPLITS, R] load from L2."""
        offs_s = tl.arange(0, SPLITS)
        ptrs = v_ptr + (offs_s[:, None] * num_rows + row) * width + rows[None, :]
        partial = tl.load(ptrs, mask=(offs_s < splits)[:, None] & r_ok[None, :], other=0.0, cache_modifier=".cg")
        return tl.sum(partial, axis=0)

    @triton.jit
    def _wait_for(counter_ptr, expected, status_ptr, SPIN_LIMIT: tl.constexpr):
        """Spin (acquire) until *counter_ptr >= expected; past SPIN_LIMIT tries, flag an error and go on
        rather than hang the device."""
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins = seen * 0
        while (seen < expected) & (spins < SPIN_LIMIT):
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if seen < expected:
            tl.atomic_or(status_ptr, 1)

    @triton.jit
    def _expand_task(
        task, v_ptr, y_ptr, row_slot_ptr, rank_ptr, b_start_ptr, page_ids_ptr, pages_ptr, sync_ptr, status_ptr,
        out_dim, max_rank, width, num_rows, splits, n_tiles, stride_yt, stride_yn, slot_stride, table_offset, chunks_out,
        PAGE: tl.constexpr, SHRINK_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
        ALIGNED: tl.constexpr, WAIT: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    ):
        """y[row, n0:n0 + BLOCK_N] += (sum over splits of v[:, row, :rank]) @ B^T[:rank, n0:n0 + BLOCK_N]."""
        n0 = (task % n_tiles) * BLOCK_N
        row = task // n_tiles
        slot = tl.load(row_slot_ptr + row)
        entry = tl.maximum(slot, 0) * slot_stride + table_offset
        rank = tl.minimum(tl.load(rank_ptr + entry), max_rank)
        b_start = tl.load(b_start_ptr + entry)
        if (slot >= 0) & (rank > 0):
            offs_n = tl.arange(0, BLOCK_N)
            n_ok = (n0 + offs_n) < out_dim
            rows = tl.arange(0, BLOCK_R)
            r_ok = rows < rank
            # B^T's first rank block and y are loaded before the wait: they do not depend on v.
            ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + rows * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED)
            b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
            y_ptrs = y_ptr + row.to(tl.int64) * stride_yt + (n0 + offs_n) * stride_yn
            y = tl.load(y_ptrs, mask=n_ok, other=0.0)
            expected = splits * tl.cdiv(rank, SHRINK_R)
            if WAIT:
                _wait_for(sync_ptr + row, expected, status_ptr, SPIN_LIMIT)
            v = _row_partials(v_ptr, row, rows, r_ok, width, num_rows, splits, SPLITS)
            delta = tl.sum(b.to(tl.float32) * v[:, None], axis=0)
            for r0 in range(BLOCK_R, rank, BLOCK_R):  # ranks past BLOCK_R (> 64 by default)
                rows = r0 + tl.arange(0, BLOCK_R)
                r_ok = rows < rank
                ptrs = page_pointers(pages_ptr, page_ids_ptr, b_start + rows * chunks_out, r_ok, n0, offs_n, out_dim, PAGE, ALIGNED)
                b = tl.load(ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
                v = _row_partials(v_ptr, row, rows, r_ok, width, num_rows, splits, SPLITS)
                delta += tl.sum(b.to(tl.float32) * v[:, None], axis=0)
            tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_ok)
            if WAIT:
                # The row's last expand program to get here puts its counter back to zero.
                arrived = tl.atomic_add(sync_ptr + row, 1, sem="acq_rel", scope="gpu")
                if arrived == expected + n_tiles - 1:
                    tl.atomic_xchg(sync_ptr + row, 0, sem="relaxed", scope="gpu")

    @triton.jit(do_not_specialize=['num_rows', 'splits', 'rank_blocks', 'n_tiles', 'num_shrink', 'slot_stride', 'table_offset', 'chunks_in', 'chunks_out', 'status_offset'])
    def _mbgmv_kernel(
        x_ptr, v_ptr, y_ptr, row_slot_ptr, rank_ptr, a_start_ptr, b_start_ptr, page_ids_ptr, pages_ptr, sync_ptr,
        in_dim, out_dim, max_rank, width, num_rows, splits, k_per_split, rank_blocks, n_tiles, num_shrink,
        stride_xt, stride_xk, stride_yt, stride_yn, slot_stride, table_offset, chunks_in, chunks_out, status_offset,
        PAGE: tl.constexpr, SHRINK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, EXPAND_R: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, ALIGNED_K: tl.constexpr, ALIGNED_N: tl.constexpr, MODE: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    ):
        """MODE 0: shrink tiles only; 1: expand tiles only; 2: both, programs [0, num_shrink) shrinking.
        Fused safety: programs start in id order, so an expand program waits only on shrink programs
        already running, which never wait."""
        pid = tl.program_id(0)
        if MODE == 0:
            _shrink_task(pid, x_ptr, v_ptr, row_slot_ptr, rank_ptr, a_start_ptr, page_ids_ptr, pages_ptr, sync_ptr,
                         in_dim, max_rank, width, num_rows, splits, rank_blocks, k_per_split,
                         stride_xt, stride_xk, slot_stride, table_offset, chunks_in, PAGE, SHRINK_R, BLOCK_K, K_TILES, ALIGNED_K, False)
        elif MODE == 1:
            _expand_task(pid, v_ptr, y_ptr, row_slot_ptr, rank_ptr, b_start_ptr, page_ids_ptr, pages_ptr, sync_ptr, sync_ptr + status_offset,
                         out_dim, max_rank, width, num_rows, splits, n_tiles, stride_yt, stride_yn, slot_stride, table_offset, chunks_out,
                         PAGE, SHRINK_R, EXPAND_R, BLOCK_N, SPLITS, ALIGNED_N, False, SPIN_LIMIT)
        else:
            if pid < num_shrink:
                _shrink_task(pid, x_ptr, v_ptr, row_slot_ptr, rank_ptr, a_start_ptr, page_ids_ptr, pages_ptr, sync_ptr,
                             in_dim, max_rank, width, num_rows, splits, rank_blocks, k_per_split,
                             stride_xt, stride_xk, slot_stride, table_offset, chunks_in, PAGE, SHRINK_R, BLOCK_K, K_TILES, ALIGNED_K, True)
            else:
                _expand_task(pid - num_shrink, v_ptr, y_ptr, row_slot_ptr, rank_ptr, b_start_ptr, page_ids_ptr, pages_ptr, sync_ptr,
                             sync_ptr + status_offset, out_dim, max_rank, width, num_rows, splits, n_tiles, stride_yt, stride_yn,
                             slot_stride, table_offset, chunks_out, PAGE, SHRINK_R, EXPAND_R, BLOCK_N, SPLITS, ALIGNED_N, True, SPIN_LIMIT)


def _interpreted() -> bool:
    return type(_mbgmv_kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=4096)
def _plan(page: int, in_dim: int, out_dim: int, max_rank: int, splits: int | None, config: DecodeConfig):
    """Host arithmetic of a launch, cached per shape: (splits, k_per_split, rank_blocks, n_tiles,
    constexprs). splits None: as many K splits as block_k tiles allow, at most MAX_SPLITS."""
    block_k, aligned_k = page_block(page, in_dim, config.block_k)
    block_n, aligned_n = page_block(page, out_dim, config.block_n)
    k_tiles_all = cdiv(in_dim, block_k)
    if splits is None:
        per_split = max(config.k_tiles, cdiv(k_tiles_all, MAX_SPLITS))
        splits = cdiv(k_tiles_all, per_split)
    k_per_split = cdiv(cdiv(in_dim, splits), block_k) * block_k
    expand_r = min(config.expand_r, max(16, triton_next_power_of_2(max_rank)))
    constants = dict(
        PAGE=page, SHRINK_R=config.shrink_r, BLOCK_K=block_k, K_TILES=k_per_split // block_k, EXPAND_R=expand_r, BLOCK_N=block_n,
        SPLITS=max(2, triton_next_power_of_2(splits)), ALIGNED_K=aligned_k, ALIGNED_N=aligned_n,
    )
    return splits, k_per_split, cdiv(max_rank, config.shrink_r), cdiv(out_dim, block_n), constants


def _launch(mode: int, x, v, y, layer, proj, row_slot, table, max_rank, config: DecodeConfig) -> None:
    splits, num_rows, width = v.shape
    in_dim, out_dim = table.shapes[proj]
    chunks_in, chunks_out = table.chunks[proj]
    slot_stride, offset = table_offsets(table, layer, proj)
    _, k_per_split, rank_blocks, n_tiles, constants = _plan(table.pool.page_elems, in_dim, out_dim, max_rank, splits, config)
    num_shrink = num_rows * rank_blocks * splits
    num_expand = num_rows * n_tiles
    grid = (num_shrink if mode == 0 else num_expand if mode == 1 else num_shrink + num_expand,)
    sync = _sync_buffer(v.device, num_rows) if mode == 2 else row_slot  # unused outside mode 2
    x_strides = x.stride() if x is not None else (0, 0)
    y_strides = y.stride() if y is not None else (0, 0)
    _mbgmv_kernel[grid](
        x if x is not None else v, v, y if y is not None else v, row_slot, table.rank, table.a_start, table.b_start,
        table.page_ids, table.pool.pages, sync,
        in_dim, out_dim, max_rank, width, num_rows, splits, k_per_split, rank_blocks, n_tiles, num_shrink,
        x_strides[0], x_strides[1], y_strides[0], y_strides[1], slot_stride, offset, chunks_in, chunks_out, sync.numel() - 1,
        MODE=mode, SPIN_LIMIT=16 if _interpreted() else 1 << 20, num_stages=1, **constants,
        num_warps=config.expand_warps if mode == 1 and config.expand_warps else config.num_warps,
    )


def mbgmv_shrink(x, v, layer, proj, row_slot, table, max_rank, block_r=16, block_k=1024, num_warps=4):
    """v[s, t, :rank_t] = partial sums of x[t] @ A^T over K split s (columns past the rank unwritten).

    x: [T, in]; v: float32 [splits, T, width >= max_rank] contiguous; row_slot: int32 [T]. Grid: one
    program per (row, block_r rank rows, split); those past a row's rank return at once.
    """
    require_triton()
    config = DecodeConfig(shrink_r=block_r, block_k=block_k, num_warps=num_warps, fused=False)
    _launch(0, x, v, None, layer, proj, row_slot, table, max_rank, config)


def mbgmv_expand(v, y, layer, proj, row_slot, table, max_rank, block_r=64, block_n=128, num_warps=4):
    """y[t] += (sum over splits of v[:, t, :rank_t]) @ B^T; rows without an adapter untouched.

    v: float32 [splits, T, width]; y: [T, out], any strides. One program per (row, block_n columns),
    looping over the rank in steps of block_r; no atomics: each (row, column tile) has one owner.
    """
    require_triton()
    config = DecodeConfig(expand_r=block_r, block_n=block_n, num_warps=num_warps, fused=False)
    _launch(1, None, v, y, layer, proj, row_slot, table, max_rank, config)


def mbgmv(x, y, layer, proj, row_slot, table, max_rank, workspace=None, *, config: DecodeConfig | None = None):
    """y[t] += (x[t] @ A^T) @ B^T per row with the row's own adapter and rank (apply_lora_ref's
    semantics); one launch (two with config.fused False), no host sync.

    x: [T, in], y: [T, out] of the model dtype (y may be a strided column slice of a fused output);
    row_slot: int32 [T] on the device (-1: base only, y's row untouched); max_rank: host int >= every
    rank in the batch (the workspace width; `batch_max_rank` or the configured max); workspace: optional
    float32 buffer of >= workspace_numel(T, max_rank) elements, reused across calls; config: tiles
    (default: `decode_config` for the shape).
    Roofline: bytes = e*(sum_t r_t*(in+out) + T*(in+2*out)) + small; flops = 2*sum_t r_t*(in+out).
    """
    in_dim, out_dim = check_operands(x, y, proj, table, row_slot)
    num_rows = x.shape[0]
    if num_rows == 0 or max_rank <= 0:
        return
    require_triton()
    config = config or decode_config(in_dim, out_dim, max_rank)
    splits = _plan(table.pool.page_elems, in_dim, out_dim, max_rank, None, config)[0]
    v = workspace_view(workspace, splits, num_rows, max_rank, x.device)
    if config.fused:
        _launch(2, x, v, y, layer, proj, row_slot, table, max_rank, config)
    else:
        _launch(0, x, v, None, layer, proj, row_slot, table, max_rank, config)
        _launch(1, None, v, y, layer, proj, row_slot, table, max_rank, config)


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
