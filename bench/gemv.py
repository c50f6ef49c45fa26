"""The few-row projection kernel (gpu_ops/gemv.py) against cuBLAS (torch's F.linear) on the Llama-2-7B and
Llama-3-8B projection shapes, for 1, 2 and 4 rows: device time per call from CUDA-graph replays, each call
reading another copy of the weight (together larger than the L2 cache, so every call reads HBM), as GB/s
of weight bytes and against the device copy bandwidth measured in the same run. A sweep of tile configs
shows what `gemv_config` should pick.

    python3 bench/gemv.py --out bench/results/gemv_h100.json

With --fp8, one row over FP8 weights (per-channel scales, gpu_ops/fp8.py) on the 7B projections: the
default config, the bf16 gemv on the same shapes, the row quantized and multiplied by the FP8 rows GEMM
(gpu_ops/fp8_gemm.py, what fp8_linear takes past one row), and a sweep of the tiles:

    python3 bench/gemv.py --fp8 --out bench/results/gemv_fp8_h100.json
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

from lorad.gpu_ops import gemv

SHAPES = {
    "7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008),
    "7b.lm_head": (32000, 4096),
    "8b.qkv": (6144, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336), "8b.lm_head": (128256, 4096),
}
SWEEP = [gemv.GemvConfig(n, k, w) for n, k, w in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))]
FP8_SWEEP = [gemv.GemvConfig(n, k, w) for n, k, w in itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8))]
L2_FLUSH_BYTES = 512 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-sweep", action="store_true", help="only the default config against cuBLAS")
    parser.add_argument("--fp8", action="store_true", help="one row over FP8 weights: default, bf16 and a sweep")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda")
    timer = Timer(device, args.reps)
    copy_gbps = copy_bandwidth(device, timer, 1024)
    if args.fp8:
        results = fp8_sweep(device, timer, args.no_sweep)
        notes = "one row; " + NOTES
    else:
        results = bf16_sweep(device, timer, [int(r) for r in args.rows.split(",")], args.no_sweep)
        notes = NOTES + "; copy_GBps: device copy, bytes read + written per second"
    report = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_gbps,
              "results": results, "notes": notes}
    print(f"device copy bandwidth {copy_gbps:.0f} GB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


NOTES = "us: device time per call (CUDA-graph replays, each call on another copy of the weight); GB/s: weight bytes per second"


def copies_for(nbytes: int) -> int:
    """Copies of a weight of nbytes that together exceed the L2 cache, so that every call reads HBM."""
    return max(2, math.ceil(L2_FLUSH_BYTES / nbytes))


def sweep_configs(configs, measure) -> dict:
    """measure(config) -> its entry ({"us": ...}) for each config -> {"best": the fastest, "sweep": every entry};
    a config the compiler refuses (registers) is skipped, said in its entry."""
    sweep = []
    for config in configs:
        try:
            sweep.append(measure(config))
        except Exception as error:
            sweep.append({"config": repr(config), "error": repr(error)[:300]})
    timed = [entry for entry in sweep if "us" in entry]
    return {"best": min(timed, key=lambda entry: entry["us"]) if timed else None, "sweep": sweep}


def bf16_sweep(device: torch.device, timer: Timer, rows_list: list[int], no_sweep: bool) -> list[dict]:
    results = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies_for(nbytes))]
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
            cublas_us = timer.graph([lambda w=w: F.linear(x, w) for w in weights])
            default = gemv.gemv_config(n, k)
            entry = {"shape": name, "n": n, "k": k, "rows": rows, "weight_bytes": nbytes, "cublas_us": cublas_us,
                     "cublas_GBps": nbytes / cublas_us / 1e3, "default": repr(default)}
            torch.testing.assert_close(gemv.gemv(x, weights[0]), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
            default_us = timer.graph([lambda w=w: gemv.gemv(x, w, config=default, out=out) for w in weights])
            entry.update(default_us=default_us, default_GBps=nbytes / default_us / 1e3, speedup_vs_cublas=cublas_us / default_us)
            if not no_sweep:

                def measure(config) -> dict:
                    us = timer.graph([lambda w=w: gemv.gemv(x, w, config=config, out=out) for w in weights])
                    return {"config": repr(config), "us": us, "GBps": nbytes / us / 1e3}

                entry.update(sweep_configs(SWEEP, measure))
            results.append(entry)
            print(f"{name:12s} rows={rows} cublas {entry['cublas_GBps']:7.0f} GB/s  gemv default {entry['default_GBps']:7.0f} GB/s "
                  f"({entry['speedup_vs_cublas']:.3f}x)" + (f"  best {entry['best']['GBps']:7.0f} GB/s {entry['best']['config']}"
                                                           if entry.get("best") else ""), flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    return results


def fp8_sweep(device: torch.device, timer: Timer, no_sweep: bool) -> list[dict]:
    from lorad.gpu_ops import fp8, fp8_gemm

    results = []
    for name in ("7b.qkv", "7b.o", "7b.gate_up", "7b.down"):
        n, k = SHAPES[name]
        nbytes = n * k
        bf16 = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        quantized = fp8.quantize_weight(bf16)
        weights = [quantized.weight.clone() for _ in range(copies_for(nbytes))]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        out = torch.empty(1, n, device=device, dtype=torch.bfloat16)
        expected = F.linear(x.float(), quantized.dequantize(torch.float32)).double()
        bf16_copies = [bf16.clone() for _ in range(copies_for(2 * nbytes))]
        bf16_us = timer.graph([lambda w=w: gemv.gemv(x, w, out=out) for w in bf16_copies])
        del bf16_copies

        def measure(config) -> dict:
            got = gemv.gemv(x, weights[0], config=config, out=out, scale=quantized.scale).double()
            error = float((got - expected).norm() / expected.norm())
            us = timer.graph([lambda w=w: gemv.gemv(x, w, config=config, out=out, scale=quantized.scale) for w in weights])
            return {"config": repr(config), "us": us, "GBps": nbytes / us / 1e3, "rel_error": error}

        entry = {"shape": name, "n": n, "k": k, "weight_bytes": nbytes, "bf16_gemv_us": bf16_us,
                 "default": measure(gemv.gemv_config(n, k, 1))}
        # what fp8_linear does past one row: the row quantized per token, then the FP8 rows GEMM (tensor cores)
        fp8_weights = [fp8.Fp8Weight(w, quantized.scale) for w in weights]
        entry["quantized_rows_gemm_us"] = timer.graph([lambda w=w: fp8_gemm.fp8_rows_gemm(
            *fp8_gemm.quantize_rows(x), w, None, torch.bfloat16) for w in fp8_weights])
        if not no_sweep:
            entry.update(sweep_configs(FP8_SWEEP, measure))
        results.append(entry)
        line = (f"{name:12s} fp8 default {entry['default']['GBps']:6.0f} GB/s ({entry['default']['us']:.1f} us), bf16 gemv "
                f"{bf16_us:.1f} us, row quantized + rows GEMM {entry['quantized_rows_gemm_us']:.1f} us")
        if entry.get("best"):
            line += f"\n    best: {entry['best']['GBps']:6.0f} GB/s {entry['best']['us']:.1f} us {entry['best']['config']}"
        print(line, flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
