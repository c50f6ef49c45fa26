"""What bounds the decode attention over FP8 pages on the 7B shape (MHA, pages of 2 tokens, context 1024, 64 and 128
sequences; BENCHMARKS.md, the FP8 kernels on the H200), two experiments on the kernel alone, each at a grid of
launches and checked against the reference or the kernel:

- `widening VARIANT`: paged_attention._widen_kv swapped before the kernel compiles: `cvt` (the kernel as it is, the
  hardware conversion; bf16 pages beside it), `garbage` (one shift, wrong values: a bound on any widening),
  `bits16` / `bits32` (exact: the byte's bits placed in a float16 of value byte * 2^-8, the scales times 256, on
  16- or 32-bit integers), `asm` (the same in PTX, two bytes at a time; it did not compile, the message cut off, not
  pursued), `split_join` (exact, the hardware conversion; V's columns then split in pairs and joined back, which
  changes how the compiler takes V's operand layout: see its comment). One variant a process: the swap must precede
  compiling.
- `prefetch`: the next block's K and V loaded into registers before this block's math (at the H200's launch the
  compiled loop reads each block through a single shared-memory buffer, so a program's loads do not overlap its math), a copy of the kernel's loop for MHA without a window or splits, beside the kernel.

- `profile fp8|bf16`: no timing; the kernel over FP8 (or bf16) pages at b=64 called five times, at the device's
  launch, for Nsight Compute to take the fourth.

    python3 -P bench/fp8_attention_bound.py widening cvt OUT.json
    python3 -P bench/fp8_attention_bound.py prefetch OUT.json
    ncu --kernel-name regex:_decode_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --section InstructionStats --page details \
        python3 -P bench/fp8_attention_bound.py profile fp8
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import PagedCache, layers_for  # noqa: E402  (bench/attention.py, beside this script)
from timing import Timer, copy_bandwidth  # noqa: E402
from lorad.gpu_ops import paged_attention as pa  # noqa: E402
from lorad.gpu_ops.attention import paged_attention_ref  # noqa: E402
from lorad.gpu_ops.paged_attention import _as_operand, _load_kv_block, _log2_scores, _query_operand, _widen_kv  # noqa: E402

BATCHES = (64, 128)


@triton.jit
def _widen_bits(k, v, q_ptr, F16_DOTS: tl.constexpr):
    # exact: an E4M3 byte b as the f16 of value b * 2^-8 (the caller's scales times 256)
    kb = k.to(tl.uint8, bitcast=True).to(tl.uint16)
    vb = v.to(tl.uint8, bitcast=True).to(tl.uint16)
    k = (((kb & 0x80) << 8) | ((kb & 0x7F) << 7)).to(tl.float16, bitcast=True)
    v = (((vb & 0x80) << 8) | ((vb & 0x7F) << 7)).to(tl.float16, bitcast=True)
    return k, v


@triton.jit
def _widen_bits32(k, v, q_ptr, F16_DOTS: tl.constexpr):
    # the same on 32-bit integers (the compiler may pack differently)
    kb = k.to(tl.uint8, bitcast=True).to(tl.uint32)
    vb = v.to(tl.uint8, bitcast=True).to(tl.uint32)
    k = (((kb & 0x80) << 8) | ((kb & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    v = (((vb & 0x80) << 8) | ((vb & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    return k, v


@triton.jit
def _widen_garbage(k, v, q_ptr, F16_DOTS: tl.constexpr):
    # wrong values, one shift: the bound of any conversion
    k = (k.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    v = (v.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    return k, v


@triton.jit
def _widen_asm(k, v, q_ptr, F16_DOTS: tl.constexpr):
    # exact, two bytes at a time in PTX: prmt each byte to a half's high byte, then sign | magnitude >> 1
    asm = ("{ .reg .b32 t, u; mov.b32 t, {$1, 0}; prmt.b32 t, t, 0, 0x1404; and.b32 u, t, 0x7F007F00; "
           "shr.b32 u, u, 1; and.b32 t, t, 0x80008000; or.b32 $0, t, u; }")
    k = tl.inline_asm_elementwise(asm, "=r,h", [k.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=2)
    v = tl.inline_asm_elementwise(asm, "=r,h", [v.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=2)
    return k, v


@triton.jit
def _widen_split_join(k, v, q_ptr, F16_DOTS: tl.constexpr):
    # exact, the hardware conversion as in the kernel; then V's columns split in pairs and joined back, the same tile.
    # Compiled by Triton 3.6 the dot then takes V's operand layout from float16 (ldmatrix.trans) instead of reading
    # its bytes one at a time out of shared memory: 30-36% fewer instructions a loop iteration at every launch. Yet on
    # an H200 it takes 1.32-1.93x as long (BENCHMARKS.md): the float16 V's round trip through shared memory takes a
    # program's shared memory from 21 to 39 KB, so at most 5 one-warp programs share an SM, where 8 did.
    k, v = k.to(tl.float16), v.to(tl.float16)
    even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1] // 2, 2]))
    return k, tl.reshape(tl.join(even, odd), [v.shape[0], v.shape[1]])


VARIANTS = {"cvt": None, "bits16": _widen_bits, "bits32": _widen_bits32, "asm": _widen_asm, "garbage": _widen_garbage,
            "split_join": _widen_split_join}
EXACT = ("cvt", "split_join")  # the widened values are the pages' own (the others': the bytes times 2^-8)


@triton.jit
def _decode_pf(
    q_ptr, kv_ptr, k_table_ptr, v_table_ptr, seqs_ptr, query_start_ptr, kv_len_ptr, out_ptr, kv_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_table, qk_scale,
    HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    kv_head = tl.program_id(0)
    index = tl.program_id(1)
    seq = tl.load(seqs_ptr + index)
    row = tl.load(query_start_ptr + seq)
    kv_len = tl.load(kv_len_ptr + seq)
    offs_g = tl.arange(0, 16)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < 1
    d_ok = offs_d < HEAD_DIM
    heads = kv_head + offs_g
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    q = _query_operand(q, False, True)
    table_row = seq.to(tl.int64) * stride_table
    qk_scale = qk_scale * tl.load(kv_scale_ptr)
    v_scale = tl.load(kv_scale_ptr + 1)
    m = tl.full([16], float("-inf"), tl.float32)
    l = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    positions = offs_n
    n_ok = positions < kv_len
    k, v = _load_kv_block(kv_ptr, k_table_ptr, v_table_ptr, table_row, positions, n_ok, kv_head, offs_d, d_ok,
                          HEAD_DIM, KV_HEADS, TOKENS_PER_PAGE)
    for start in range(0, kv_len, BLOCK_N):
        nxt = start + BLOCK_N + offs_n
        nxt_ok = nxt < kv_len
        k_next, v_next = _load_kv_block(kv_ptr, k_table_ptr, v_table_ptr, table_row, nxt, nxt_ok, kv_head, offs_d,
                                        d_ok, HEAD_DIM, KV_HEADS, TOKENS_PER_PAGE)
        kk, vv = _widen_kv(k, v, q_ptr, True)
        scores = tl.dot(q, tl.trans(kk), input_precision="tf32")
        scores = tl.where(n_ok[None, :], _log2_scores(scores, qk_scale, 0.0, False), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(_as_operand(p, q_ptr, False, True), vv, input_precision="tf32")
        m = m_new
        k, v, n_ok = k_next, v_next, nxt_ok
    result = acc * v_scale / tl.where(l > 0, l, 1.0)[:, None]
    out_ptrs = out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def pf_calls(cache, block_n, warps, stages):
    table = cache.batch.block_table
    meta = cache.meta
    _, tpp, kv_heads, head_dim = cache.kv_view.shape

    def call(layer):
        q = cache.q[layer]
        _decode_pf[(kv_heads, meta.num_decode)](
            q, cache.kv_view, table[layer, 0], table[layer, 1], meta.decode_seqs, meta.query_start, meta.kv_len,
            cache.out, cache.kv_scales[layer], q.stride(0), q.stride(1), cache.out.stride(0), table[layer, 0].stride(0),
            cache.scale * pa.LOG2E, HEAD_DIM=head_dim, KV_HEADS=kv_heads, TOKENS_PER_PAGE=tpp, BLOCK_N=block_n,
            num_warps=warps, num_stages=stages)
    return [lambda layer=layer: call(layer) for layer in range(cache.layers)]


def fp8_cache(batch: int, device, pages: str = "fp8") -> PagedCache:
    """`batch` sequences of context 1024 on the 7B shape, over FP8 pages of 2 tokens or bf16 pages of one."""
    fp8 = pages == "fp8"
    layers = layers_for(2 * batch * 1024 * 32 * 128 * (1 if fp8 else 2))
    return PagedCache(32, 32, 128, 2 if fp8 else 1, [(1024, 1)] * batch, layers, torch.bfloat16, device, seed=batch,
                      kv_fp8=fp8)


def timed(row: dict, key: str, measure) -> None:
    try:
        row[key] = measure()
    except Exception as exc:  # noqa: BLE001 - a launch that does not fit or compile is data
        row[key] = repr(exc)[:160]


def widening(which: str, device, timer: Timer, bandwidth: float) -> list:
    if VARIANTS[which] is not None:
        pa._widen_kv = VARIANTS[which]
    rows = []
    for batch in BATCHES:
        cache = fp8_cache(batch, device)
        scales = cache.kv_scales
        if which not in EXACT:  # the widened values are the bytes' times 2^-8
            cache.kv_scales = scales * 256
        row = {"variant": which, "batch": batch, "floor_us": round(cache.kv_bytes() / (bandwidth * 1e9) * 1e6, 1)}
        if batch == 64:  # layer 0 against the reference (the pool is small enough at 64 sequences)
            def error():
                got = pa.attention(cache.q[0], cache.kv_view, 0, cache.batch, cache.scale, meta=cache.meta,
                                   kv_scales=cache.kv_scales).float()
                want = paged_attention_ref(cache.q[0].double(), cache.kv_view, 0, cache.batch, cache.scale, None, None,
                                           kv_scales=scales.double()).float()
                return float((got - want).norm() / want.norm())
            timed(row, "rel_error", error)
        for n, w, st in ((64, 1, 4), (64, 2, 3), (128, 2, 3), (64, 2, 4), (128, 4, 3), (64, 4, 3), (32, 1, 4), (128, 1, 4)):
            timed(row, f"n{n}w{w}s{st}", lambda: round(timer.graph(cache.kernel_calls(
                splits=1, block_n=n, num_warps=w, num_stages=st)), 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if which == "cvt":  # bf16 pages beside
        for batch in BATCHES:
            cache = fp8_cache(batch, device, pages="bf16")
            row = {"variant": "bf16 pages", "batch": batch, "floor_us": round(cache.kv_bytes() / (bandwidth * 1e9) * 1e6, 1),
                   "default": round(timer.graph(cache.kernel_calls()), 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def prefetch(device, timer: Timer, bandwidth: float) -> list:
    rows = []
    for batch in BATCHES:
        cache = fp8_cache(batch, device)
        row = {"batch": batch, "floor_us": round(cache.kv_bytes() / (bandwidth * 1e9) * 1e6, 1),
               "current_n64w2s4": round(timer.graph(cache.kernel_calls(splits=1, block_n=64, num_warps=2, num_stages=4)), 1),
               "current_default": round(timer.graph(cache.kernel_calls()), 1)}
        want = pa.attention(cache.q[0], cache.kv_view, 0, cache.batch, cache.scale, meta=cache.meta,
                            kv_scales=cache.kv_scales).float()
        for n, w, st in ((64, 1, 1), (64, 2, 1), (64, 4, 1), (32, 1, 1), (32, 2, 1), (128, 2, 1), (128, 4, 1),
                         (64, 1, 2), (64, 2, 2), (64, 2, 3), (32, 1, 3)):
            def measure():
                calls = pf_calls(cache, n, w, st)
                calls[0]()
                diff = float((cache.out.float() - want).abs().max())
                return (round(timer.graph(calls), 1), diff)
            timed(row, f"pf_n{n}w{w}s{st}", measure)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def profile(pages: str, device) -> None:
    """Five calls of the kernel over layer 0 of `pages` at b=64, context 1024 (for ncu; no timing)."""
    call = fp8_cache(64, device, pages).kernel_calls(splits=1)[0]
    for _ in range(5):
        call()
    torch.cuda.synchronize()


def main() -> None:
    device = torch.device("cuda")
    if sys.argv[1] == "profile":
        profile(sys.argv[2], device)
        return
    timer = Timer(device, 30)
    bandwidth = copy_bandwidth(device, timer, 1024)
    if sys.argv[1] == "widening":
        rows, out = widening(sys.argv[2], device, timer, bandwidth), sys.argv[3]
    else:
        rows, out = prefetch(device, timer, bandwidth), sys.argv[2]
    with open(out, "w") as file:
        json.dump({"copy_GBps": bandwidth, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
