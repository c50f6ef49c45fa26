"""What programmatic dependent launch saves between the small kernels of a batch-1 decode, apart from the engine:
chains of 64 one-row FP8 gemvs (o's shape, a copy of gpu_ops/gemv.py's loop) with and without a one-row RMSNorm before
each, in one CUDA graph: in stream order, launched early with the wait at the top, and launched early with the first
weight tile read before the wait. Per layer (norm + gemv), microseconds.

    python3 -P bench/decode_pdl_chain.py OUT.json
"""
import json, sys, os
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import Timer, copy_bandwidth  # noqa


@triton.jit
def _gemv(x_ptr, w_ptr, scale_ptr, y_ptr, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, PREFETCH: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PREFETCH:
        w = tl.load(w_rows + offs_k[None, :])
        if PDL:
            gdc_wait()
        x = tl.load(x_ptr + offs_k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        start = BLOCK_K
    else:
        if PDL:
            gdc_wait()
        start = 0
    for k0 in range(start, K, BLOCK_K):
        w = tl.load(w_rows + (k0 + offs_k)[None, :])
        x = tl.load(x_ptr + k0 + offs_k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    acc *= tl.load(scale_ptr + offs_n)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _norm(x_ptr, w_ptr, y_ptr, N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    offs = tl.arange(0, N)
    w = tl.load(w_ptr + offs).to(tl.float32)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + offs).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    tl.store(y_ptr + offs, (x * r * w).to(y_ptr.dtype.element_ty))


def main():
    out = sys.argv[1]
    device = torch.device("cuda")
    timer = Timer(device, 30)
    bw = copy_bandwidth(device, timer, 1024)
    n = k = 4096
    layers = 64
    weights = [(torch.randn(n, k, device=device) * 0.05).to(torch.float8_e4m3fn) for _ in range(layers)]
    scales = torch.full((n,), 0.02, device=device)
    norm_w = torch.ones(n, device=device, dtype=torch.bfloat16)
    xs = [torch.randn(k, device=device, dtype=torch.bfloat16) for _ in range(layers + 1)]
    hs = [torch.empty(k, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    rows = {"copy_GBps": bw, "floor_us_per_gemv": n * k / (bw * 1e9) * 1e6}

    def chain(pdl, prefetch, with_norm, block_n=4, block_k=2048, warps=4):
        extra = {"launch_pdl": True} if pdl else {}
        def call(i):
            src = xs[i]
            if with_norm:
                _norm[(1,)](xs[i], norm_w, hs[i], N=n, PDL=pdl, num_warps=8, **extra)
                src = hs[i]
            _gemv[(n // block_n,)](src, weights[i], scales, xs[i + 1], k, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                   PDL=pdl, PREFETCH=prefetch, num_warps=warps, **extra)
        return [lambda i=i: call(i) for i in range(layers)]

    # the same result either way
    for c in chain(False, False, True): c()
    want = xs[-1].float().clone()
    for c in chain(True, True, True): c()
    rows["max_diff_pdl_vs_plain"] = float((xs[-1].float() - want).abs().max())
    for with_norm in (False, True):
        for pdl, prefetch in ((False, False), (True, False), (True, True), (False, True)):
            key = f"{'norm+gemv' if with_norm else 'gemv'} pdl={pdl} prefetch={prefetch}"
            rows[key] = round(timer.graph(chain(pdl, prefetch, with_norm)), 2)
            print(key, rows[key], flush=True)
    json.dump(rows, open(out, "w"), indent=1)
    print(json.dumps(rows))

main()
