"""How far ahead the paged attention kernels read K and V: their page ids loaded as the kernel loads them, or by an
instruction Triton's software pipeliner does not see. One variant a process (the swap must precede compiling):

- `pipelined`: gpu_ops/paged_attention.py as it is.
- `asm`: `_load_kv_block` with its two page-id loads written as `ld.global.nc` in inline PTX.

Why: compiled by Triton 3.6 for sm90, the loops of `_prefill_kernel` and `_decode_kernel` load a block's page ids
and then the block's K and V rows at those ids. The pipeliner turns both into asynchronous copies: the ids two
blocks ahead, K and V one block ahead, whatever `num_stages`. The loop's one wait then covers the ids it needs for
the next copies and, with them, every copy issued before: the K and V of the next block, issued after this block's
P @ V. A block's bytes are in flight only while that last dot runs. With the page ids out of its sight the
pipeliner issues K and V `num_stages - 1` blocks ahead and waits with that many still in flight.

What it found on one H200 (BENCHMARKS.md, "Paged attention"; bench/results/attention_page_ids_h200.json): `asm` is
slower over bf16 pages at every launch (prefill 1.00-2.4x), about even over FP8 pages (0.86-1.11x, but 1.8-2.1x on
blocks of 128 over four warps), and 1.25-3.5x in decode at the engine's launches. Its page ids arrive just before the
copies that need them, so each block's copies wait for a load of the table, which costs more than the deeper
pipeline gains. The kernels keep their loads.

Times, each launch's against the same launch of the other variant (run both):
- prefill: the prompts of a mixed step of the Azure conversation trace (bench/attention.py's prefill_sweep cases)
  on the 7B shape, over bf16 pages (one token a page) and FP8 pages (two), at six launches, with TFLOP/s and each
  launch's error against the float64 reference;
- decode: the 7B shape (MHA) at 64 and 128 sequences of context 1024 over bf16 and FP8 pages, and Llama 3 8B's
  (GQA) at 64 and 256, at the engine's launch and a few others.

    python3 -P bench/attention_page_ids.py pipelined OUT.json
    python3 -P bench/attention_page_ids.py asm OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import PagedCache, layers_for, page_tokens, prefill_sweep  # noqa: E402  (bench/attention.py)
from timing import Timer, copy_bandwidth  # noqa: E402
from lorad.gpu_ops import paged_attention as pa  # noqa: E402

PREFILL_CASES = [
    ("fresh 1x2048", [(2048, 2048)]), ("fresh 1x1536", [(1536, 1536)]), ("fresh 4x512", [(512, 512)] * 4),
    ("chunk 512 on 1536 cached", [(2048, 512)]), ("fresh 3x500 + chunk 536 on 800", [(500, 500)] * 3 + [(1336, 536)]),
]
PREFILL_LAUNCHES = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
# (name, heads, kv_heads, bf16 tokens a page, batches)
DECODE_SHAPES = [("7b", 32, 32, 1, (64, 128)), ("llama3_8b", 32, 8, 4, (64, 256))]
DECODE_LAUNCHES = {"bf16": [(128, 4, None), (64, 4, 3), (128, 4, 3), (64, 2, 3), (128, 8, 3)],
                   "fp8": [(64, 1, 4), (64, 2, 3), (64, 2, 4), (128, 2, 3), (128, 4, 3), (64, 4, 3), (32, 1, 4)]}


@triton.jit
def _page_id(pointers):
    return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [pointers], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _load_kv_block_asm(
    kv_ptr, k_table_ptr, v_table_ptr, table_row, positions, n_ok, kv_head, offs_d, d_ok,
    HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr, TOKENS_PER_PAGE: tl.constexpr,
):
    block = tl.where(n_ok, positions // TOKENS_PER_PAGE, 0)  # masked rows read the row's first id: in bounds
    slot = (positions % TOKENS_PER_PAGE) * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
    k_page = _page_id(k_table_ptr + table_row + block).to(tl.int64)
    v_page = _page_id(v_table_ptr + table_row + block).to(tl.int64)
    kv_mask = n_ok[:, None] & d_ok[None, :]
    page_elems = TOKENS_PER_PAGE * KV_HEADS * HEAD_DIM
    k = tl.load(kv_ptr + (k_page * page_elems + slot)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(kv_ptr + (v_page * page_elems + slot)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


def prefill(device, timer: Timer) -> list:
    rows = []
    for name, shapes in PREFILL_CASES:
        heads, head_dim = 32, 128
        flops = sum(4 * heads * head_dim * (q * (kv - q) + q * (q + 1) / 2) for kv, q in shapes)
        row = {"case": name}
        for pages in ("bf16", "fp8"):
            cache = PagedCache(heads, heads, head_dim, page_tokens(1, pages == "fp8"), shapes, 1, torch.bfloat16, device,
                               kv_fp8=pages == "fp8")
            row[pages] = prefill_sweep(cache, timer, flops, device, PREFILL_LAUNCHES)
            del cache
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def decode(device, timer: Timer, bandwidth: float) -> list:
    rows = []
    for name, heads, kv_heads, tpp, batches in DECODE_SHAPES:
        for batch in batches:
            for pages in ("bf16", "fp8"):
                fp8 = pages == "fp8"
                layers = layers_for(2 * batch * 1024 * kv_heads * 128 * (1 if fp8 else 2))
                cache = PagedCache(heads, kv_heads, 128, page_tokens(tpp, fp8), [(1024, 1)] * batch, layers,
                                   torch.bfloat16, device, seed=batch, kv_fp8=fp8)
                row = {"shape": name, "batch": batch, "pages": pages,
                       "floor_us": round(cache.kv_bytes() / (bandwidth * 1e9) * 1e6, 1),
                       "engine_launch": round(timer.graph(cache.kernel_calls()), 1)}
                if batch == min(batches):
                    row["relative_error"] = cache.error()
                for block_n, warps, stages in DECODE_LAUNCHES[pages]:
                    key = f"n{block_n}w{warps}s{stages}"
                    try:
                        row[key] = round(timer.graph(cache.kernel_calls(splits=1, block_n=block_n, num_warps=warps,
                                                                        num_stages=stages), reps=20), 1)
                    except Exception as exc:  # noqa: BLE001 - a launch that does not fit or compile is data
                        row[key] = repr(exc)[:160]
                print(json.dumps(row), flush=True)
                rows.append(row)
                del cache
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    variant, out = sys.argv[1], sys.argv[2]
    if variant not in ("pipelined", "asm"):
        sys.exit(f"variant must be pipelined or asm, got {variant!r}")
    if variant == "asm":
        pa._load_kv_block = _load_kv_block_asm
    device = torch.device("cuda")
    timer = Timer(device, 30)
    bandwidth = copy_bandwidth(device, timer, 1024)
    result = {"variant": variant, "copy_GBps": bandwidth, "device": torch.cuda.get_device_name(device),
              "decode": decode(device, timer, bandwidth), "prefill": prefill(device, timer)}
    with open(out, "w") as file:
        json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
