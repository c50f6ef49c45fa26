"""Is the decode attention over FP8 pages bound by widening FP8 to float16? (BENCHMARKS.md, the FP8 kernels on the
H200.) paged_attention._widen_kv swapped before the kernel compiles for one of: `cvt` (the kernel as it is: the
hardware conversion), `garbage` (one shift, wrong values: a bound on any widening), `bits16` / `bits32` (exact: the
byte's bits placed in a float16 of value byte * 2^-8, the scales times 256, on 16- or 32-bit integers), `asm` (the
same in PTX, two bytes at a time; it did not compile, the message cut off, not pursued). Each timed on the 7B shape
(MHA, FP8 pages of 2 tokens, context 1024) at 64 and 128 sequences over a grid of launches, layer 0 checked against
the reference; with `cvt`, bf16 pages beside it.

    python3 -P bench/fp8_attention_widening.py cvt OUT.json        # one variant a process (the swap precedes compiling)
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


VARIANTS = {"cvt": None, "bits16": _widen_bits, "bits32": _widen_bits32, "asm": _widen_asm, "garbage": _widen_garbage}


def main():
    which = sys.argv[1]
    out = sys.argv[2]
    device = torch.device("cuda")
    timer = Timer(device, 30)
    bw = copy_bandwidth(device, timer, 1024)
    if VARIANTS[which] is not None:
        pa._widen_kv = VARIANTS[which]
    rows = []
    for batch in (64, 128):
        shapes = [(1024, 1)] * batch
        layers = layers_for(2 * batch * 1024 * 32 * 128)
        cache = PagedCache(32, 32, 128, 2, shapes, layers, torch.bfloat16, device, seed=batch, kv_fp8=True)
        scales = cache.kv_scales
        if which != "cvt":
            cache.kv_scales = scales * 256
        error = None
        if batch == 64:  # layer 0 against the reference (the pool is small enough at 64 sequences)
            try:
                got = pa.attention(cache.q[0], cache.kv_view, 0, cache.batch, cache.scale, meta=cache.meta,
                                   kv_scales=cache.kv_scales).float()
                want = paged_attention_ref(cache.q[0].double(), cache.kv_view, 0, cache.batch, cache.scale, None, None,
                                           kv_scales=scales.double()).float()
                error = float((got - want).norm() / want.norm())
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is data
                error = repr(exc)[:200]
        floor = cache.kv_bytes() / (bw * 1e9) * 1e6
        row = {"variant": which, "batch": batch, "floor_us": round(floor, 1), "rel_error": error}
        for n, w, st in ((64, 1, 4), (64, 2, 3), (128, 2, 3), (64, 2, 4), (128, 4, 3), (64, 4, 3), (32, 1, 4), (128, 1, 4)):
            try:
                row[f"n{n}w{w}s{st}"] = round(timer.graph(cache.kernel_calls(splits=1, block_n=n, num_warps=w, num_stages=st)), 1)
            except Exception as exc:  # noqa: BLE001
                row[f"n{n}w{w}s{st}"] = repr(exc)[:100]
        print(json.dumps(row), flush=True)
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
    # bf16 pages beside, once
    if which == "cvt":
        for batch in (64, 128):
            shapes = [(1024, 1)] * batch
            layers = layers_for(2 * batch * 1024 * 32 * 128 * 2)
            cache = PagedCache(32, 32, 128, 1, shapes, layers, torch.bfloat16, device, seed=batch)
            floor = cache.kv_bytes() / (bw * 1e9) * 1e6
            row = {"variant": "bf16 pages", "batch": batch, "floor_us": round(floor, 1),
                   "default": round(timer.graph(cache.kernel_calls()), 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del cache
            torch.cuda.empty_cache()
    with open(out, "w") as file:
        json.dump({"copy_GBps": bw, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
