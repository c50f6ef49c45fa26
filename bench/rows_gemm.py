"""The base model's projections for a decode batch (tens of rows): the rows GEMM kernel (gpu_ops/rows_gemm.py)
against cuBLAS and cuBLASLt (torch's F.linear under each `preferred_blas_library`) on the Llama-2-7B projection
shapes, device time per call from CUDA-graph replays, each call reading another copy of the weight (together
larger than the L2 cache, so every call reads HBM), as GB/s of weight bytes and against the device copy bandwidth
measured in the same run. A sweep of tile configs shows what `rows_config` should pick.

    python3 bench/rows_gemm.py --out bench/results/rows_gemm_h100.json
    python3 bench/rows_gemm.py --smoke        # the CPU: the script runs (the interpreter, a small shape)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import Timer, copy_bandwidth  # bench/timing.py, beside this script

from lorad.gpu_ops import rows_gemm

SHAPES = {"7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008)}
SWEEP = [rows_gemm.RowsConfig(n, k, w, s) for n, k, (w, s) in
         itertools.product((32, 64, 128), (64, 128, 256), ((4, 3), (4, 5), (8, 4)))]
L2_FLUSH_BYTES = 512 << 20


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(L2_FLUSH_BYTES / nbytes))


def with_blas(library: str, measure):
    """measure() with torch's matmuls sent to `library` (captured into the graph as chosen then)."""
    preferred = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return measure()
    finally:
        torch.backends.cuda.preferred_blas_library(preferred)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,48,64,96,128")
    parser.add_argument("--sweep-rows", default="16,64,96", help="rows at which every config of the sweep is timed")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="the CPU: one small shape through the interpreter")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    device = torch.device("cuda")
    timer = Timer(device, args.reps)
    copy_gbps = copy_bandwidth(device, timer, 1024)
    sweep_rows = {int(r) for r in args.sweep_rows.split(",")}
    results = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies_for(nbytes))]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
            expected = F.linear(x.float(), weights[0].float())

            def kernel_us(config):
                got = rows_gemm.rows_gemm(x, weights[0], config=config, out=out).float()
                torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
                return timer.graph([lambda w=w: rows_gemm.rows_gemm(x, w, config=config, out=out) for w in weights])

            cublas = with_blas("cublas", lambda: timer.graph([lambda w=w: F.linear(x, w) for w in weights]))
            cublaslt = with_blas("cublaslt", lambda: timer.graph([lambda w=w: F.linear(x, w) for w in weights]))
            default = rows_gemm.rows_config(rows, n, k)
            entry = {"shape": name, "n": n, "k": k, "rows": rows, "weight_bytes": nbytes, "cublas_us": cublas,
                     "cublaslt_us": cublaslt, "default": repr(default), "default_us": kernel_us(default)}
            if rows in sweep_rows:
                sweep = []
                for config in SWEEP:
                    try:
                        sweep.append({"config": repr(config), "us": kernel_us(config)})
                    except Exception as error:  # a config the compiler refuses (shared memory)
                        sweep.append({"config": repr(config), "error": repr(error)[:300]})
                timed = [e for e in sweep if "us" in e]
                entry.update(best=min(timed, key=lambda e: e["us"]) if timed else None, sweep=sweep)
            floor_us = nbytes / copy_gbps / 1e3  # the weight's bytes over the copy bandwidth (BENCHMARKS.md)
            entry["floor_us"] = floor_us
            results.append(entry)
            line = (f"{name:12s} rows={rows:3d} floor {floor_us:6.1f} us  cublas {cublas:6.1f}  cublaslt {cublaslt:6.1f}  "
                    f"rows_gemm {entry['default_us']:6.1f}")
            if entry.get("best"):
                line += f"  best {entry['best']['us']:6.1f} {entry['best']['config']}"
            print(line, flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    report = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_gbps,
              "notes": "us: device time per call (CUDA-graph replays, each call on another copy of the weight); "
                       "floor_us: the weight's bytes over the copy bandwidth",
              "results": results}
    print(f"device copy bandwidth {copy_gbps:.0f} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def smoke() -> None:
    x = torch.randn(5, 64)
    w = torch.randn(48, 64)
    got = rows_gemm.rows_gemm(x, w, config=rows_gemm.RowsConfig(32, 32, 4, 2))
    torch.testing.assert_close(got, rows_gemm.rows_gemm_ref(x, w), rtol=1e-4, atol=1e-4)
    print("smoke: rows_gemm equals F.linear on a 5 x 64 @ 64 x 48 product (the interpreter)")


if __name__ == "__main__":
    main()
