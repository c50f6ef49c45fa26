"""The decode attention over FP8 pages (7B shape, MHA, context 1024, 64 and 128 sequences) with the next block's K
and V loaded into registers before this block's math, beside the kernel as it is (BENCHMARKS.md, the FP8 kernels on
the H200): the compiled kernel's loop reads each block through shared memory in one stage whatever num_stages says,
so a program's loads do not overlap its math. The prefetching loop, a copy of the kernel's (MHA only, no window,
one split), at several launches, each result against the kernel's.

    python3 -P bench/fp8_attention_prefetch.py OUT.json
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
from lorad.gpu_ops.paged_attention import _as_operand, _load_kv_block, _log2_scores, _query_operand, _widen_kv  # noqa: E402


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


def main():
    out = sys.argv[1]
    device = torch.device("cuda")
    timer = Timer(device, 30)
    bw = copy_bandwidth(device, timer, 1024)
    rows = []
    for batch in (64, 128):
        shapes = [(1024, 1)] * batch
        layers = layers_for(2 * batch * 1024 * 32 * 128)
        cache = PagedCache(32, 32, 128, 2, shapes, layers, torch.bfloat16, device, seed=batch, kv_fp8=True)
        row = {"batch": batch, "floor_us": round(cache.kv_bytes() / (bw * 1e9) * 1e6, 1),
               "current_n64w2s4": round(timer.graph(cache.kernel_calls(splits=1, block_n=64, num_warps=2, num_stages=4)), 1),
               "current_default": round(timer.graph(cache.kernel_calls()), 1)}
        want = pa.attention(cache.q[0], cache.kv_view, 0, cache.batch, cache.scale, meta=cache.meta,
                            kv_scales=cache.kv_scales).float()
        for n, w, st in ((64, 1, 1), (64, 2, 1), (64, 4, 1), (32, 1, 1), (32, 2, 1), (128, 2, 1), (128, 4, 1),
                         (64, 1, 2), (64, 2, 2), (64, 2, 3), (32, 1, 3)):
            key = f"pf_n{n}w{w}s{st}"
            try:
                calls = pf_calls(cache, n, w, st)
                calls[0]()
                got = cache.out.float()
                diff = float((got - want).abs().max())
                row[key] = (round(timer.graph(calls), 1), diff)
            except Exception as exc:  # noqa: BLE001 - a launch that does not fit is data
                row[key] = repr(exc)[:160]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
    with open(out, "w") as file:
        json.dump({"copy_GBps": bw, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
