"""The FP8 kernels of a decode batch on the GPU, each beside what it replaced, in one run:

1. the projections' GEMM at decode row counts: gpu_ops/fp8_gemm.py's `fp8_rows_gemm` (what `fp8_linear` takes for
   decode batches: `takes_rows_kernel`) at its tiles by width and at the one tile it used before, beside
   torch._scaled_mm with the same per-token and per-channel scales and fp8_linear's accumulation
   (SCALED_MM_FAST_ACCUM), on the 7B projections (q|k|v, o, gate|up, down) at --rows, each against its weight bytes
   over the measured copy bandwidth; every call reads another copy of the weight (more copies than the L2 holds),
   so every call reads HBM;
2. `--attention`: the decode attention over FP8 pages on the 7B shape (MHA) and the Llama 3 8B shape (GQA) at
   context 1024 (pages of the engine's tokens: twice bf16's in FP8), at this device's launch
   (paged_attention.decode_launch) beside the H100's, four warps at Triton's default stages, and two warps at three
   and four stages, and bf16 pages beside them, each against its KV bytes' floor; `--attention-sweep`: also, over
   FP8 pages, the grid of positions a step (32-256), warps (1-8) and stages (2-4) that DECODE_LAUNCH_BY_GPU's entries
   were chosen from, and CUDA-core dots;
3. `--accumulation ROWS`: torch._scaled_mm with and without fast accumulation at those rows (time and error);
4. `--sweep`: the tile grid fp8_rows_gemm's configuration was chosen from (tiles of 16-128 rows by 32-128
   columns, K 128 or 256 deep, 3-6 stages) at each --rows.

    python3 bench/fp8_rows.py --attention --out bench/results/fp8_rows_h100.json
    python3 bench/fp8_rows.py --rows 16,64,128 --sweep --attention --attention-sweep --out OUT.json   # ~6 min

Needs a GPU with FP8 (compute capability >= 8.9).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from timing import Timer, copy_bandwidth  # bench/timing.py

from lorad.gpu_ops import fp8_gemm, paged_attention
from lorad.gpu_ops.fp8 import FP8, Fp8Weight, fp8_unavailable
from lorad.gpu_ops.launch import next_power_of_2

PROJECTIONS = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}  # (out, in)
ROTATE_BYTES = 160e6  # the weight copies one timed round reads: past the H100's 50 MB L2


def projection_case(rows: int, out_features: int, in_features: int, device) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Random FP8 copies of one projection's weight (more bytes than the L2 holds, so that a round of calls reads
    HBM) and `rows` random rows quantized per token: (weights, FP8 rows, their scales)."""
    copies = max(2, int(ROTATE_BYTES // (out_features * in_features)) + 1)
    weights = [Fp8Weight((torch.randn(out_features, in_features, device=device) * 0.05).to(FP8),
                         torch.rand(out_features, device=device) * 0.01 + 0.005) for _ in range(copies)]
    quantized, scale = fp8_gemm.quantize_rows(torch.randn(rows, in_features, device=device, dtype=torch.bfloat16))
    return weights, quantized, scale


def scaled_mm(quantized: torch.Tensor, scale: torch.Tensor, weight: Fp8Weight, fast: bool) -> torch.Tensor:
    """torch._scaled_mm of FP8 rows by an FP8 weight with per-token and per-channel scales, as fp8_linear calls it
    (`fast`: its fast accumulation)."""
    return torch._scaled_mm(quantized, weight.weight.t(), scale_a=scale, scale_b=weight.scale.view(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=fast)


def one_tile_config(rows: int, k: int, shared_memory: int) -> fp8_gemm.RowsGemmConfig:
    """The one tile rows_gemm_config gave every projection before it chose by width (its H100 sweep's best): 16 rows
    by 32 columns up to 16 rows, 64 by 64 past, K 256 deep, six stages; timed beside today's choice."""
    block_m, block_n = (16, 32) if rows <= 16 else (64, 64)
    block_k = max(32, min(256, next_power_of_2(k)))
    stages = max(2, min(6, shared_memory // ((block_m + block_n) * block_k) - 1))
    return fp8_gemm.RowsGemmConfig(block_m, block_n, block_k, 4, stages)


def gemm_rows(args, device, timer: Timer, bandwidth: float) -> list:
    results = []
    for rows in args.rows:
        for name, (out_features, in_features) in PROJECTIONS.items():
            weights, quantized, scale = projection_case(rows, out_features, in_features, device)
            floor_us = out_features * in_features / (bandwidth * 1e9) * 1e6

            def cublas(weight):
                return scaled_mm(quantized, scale, weight, fp8_gemm.SCALED_MM_FAST_ACCUM)

            def rows_gemm(weight, config=None):
                return fp8_gemm.fp8_rows_gemm(quantized, scale, weight, None, torch.bfloat16, config)

            expected = cublas(weights[0]).float()
            error = float((rows_gemm(weights[0]).float() - expected).norm() / expected.norm())
            row = {"rows": rows, "proj": name, "floor_us": round(floor_us, 2),
                   "scaled_mm_us": round(timer.graph([lambda w=w: cublas(w) for w in weights]), 2),
                   "rows_gemm_us": round(timer.graph([lambda w=w: rows_gemm(w) for w in weights]), 2),
                   "rows_gemm_config": vars(fp8_gemm.rows_gemm_config(
                       rows, in_features, out_features, fp8_gemm._shared_memory(device))),
                   "relative_difference_vs_scaled_mm": error}
            row["ratio"] = round(row["rows_gemm_us"] / row["scaled_mm_us"], 3)
            previous = one_tile_config(rows, in_features, fp8_gemm._shared_memory(device))
            row["one_tile_us"] = round(timer.graph([lambda w=w: rows_gemm(w, previous) for w in weights]), 2)
            if args.sweep:
                sweep = {}
                for block_m in sorted({max(16, min(128, 1 << (rows - 1).bit_length())), 64}):
                    for block_n in (32, 64, 128):
                        for block_k in (128, 256):
                            for stages in (3, 4, 6):
                                config = fp8_gemm.RowsGemmConfig(block_m, block_n, block_k, 4, stages)
                                key = f"{block_m}x{block_n}x{block_k},s{stages}"
                                try:
                                    sweep[key] = round(timer.graph(
                                        [lambda w=w, c=config: rows_gemm(w, c) for w in weights], reps=15), 2)
                                except Exception as exc:  # noqa: BLE001 - a tile that does not fit is data
                                    sweep[key] = repr(exc)[:120]
                row["sweep_us"] = sweep
            print(f"rows {rows} {name}: {({k: v for k, v in row.items() if k != 'sweep_us'})}", flush=True)
            results.append(row)
            del weights
            torch.cuda.empty_cache()
    return results


def fast_accumulation(rows_list: list, device, timer: Timer) -> list:
    """torch._scaled_mm with and without fast accumulation on the 7B projections at `rows_list` rows: time (each
    call reading HBM) and relative error against the float64 product of the same FP8 operands and scales."""
    results = []
    for rows in rows_list:
        for name, (out_features, in_features) in PROJECTIONS.items():
            weights, quantized, scale = projection_case(rows, out_features, in_features, device)

            dequantized = weights[0].weight.double() * weights[0].scale.double()[:, None]
            exact = (quantized.double() * scale.double()) @ dequantized.t()
            row = {"rows": rows, "proj": name}
            for fast, key in ((False, "float32"), (True, "fast")):
                row[f"{key}_error"] = float((scaled_mm(quantized, scale, weights[0], fast).double() - exact).norm()
                                            / exact.norm())
                row[f"{key}_us"] = round(timer.graph([lambda w=w, f=fast: scaled_mm(quantized, scale, w, f)
                                                      for w in weights]), 2)
            row["speedup"] = round(row["float32_us"] / row["fast_us"], 3)
            print(f"accumulation {row}", flush=True)
            results.append(row)
            del weights
            torch.cuda.empty_cache()
    return results


def attention_launch(device, timer: Timer, bandwidth: float, sweep: bool) -> list:
    """The decode attention over FP8 and bf16 pages at this device's launch (paged_attention.decode_launch) beside
    the H100's (DECODE_BLOCK_N, DECODE_LAUNCH) and other warps and stages; `sweep`: over FP8 pages, the grid of
    positions a step x warps x stages that DECODE_LAUNCH_BY_GPU's entries were chosen from, and CUDA-core dots."""
    from attention import PagedCache, layers_for, page_tokens  # bench/attention.py

    results = []
    for shape, heads, kv_heads, tokens_per_page, batches in (("llama7b", 32, 32, 1, (64, 128)),
                                                             ("llama3_8b", 32, 8, 4, (64, 256))):
        for batch in batches:
            for pages in ("fp8", "bf16"):
                shapes = [(1024, 1)] * batch
                layers = layers_for(2 * batch * 1024 * kv_heads * 128)
                tokens = page_tokens(tokens_per_page, pages == "fp8")
                cache = PagedCache(heads, kv_heads, 128, tokens, shapes, layers, torch.bfloat16, device,
                                   seed=batch, kv_fp8=pages == "fp8")
                kind = ("gqa" if heads > kv_heads else "mha") + ("_fp8" if pages == "fp8" else "")
                splits = paged_attention.decode_splits(batch, kv_heads, 1024, device)
                h100 = (paged_attention.DECODE_BLOCK_N[kind], *paged_attention.DECODE_LAUNCH[kind])
                row = {"shape": shape, "batch": batch, "context": 1024, "pages": pages, "tokens_per_page": tokens,
                       "floor_us": round(cache.kv_bytes() / (bandwidth * 1e9) * 1e6, 1),
                       "launch": list(paged_attention.decode_launch(kind, device)), "h100_launch": list(h100),
                       "default_us": round(timer.graph(cache.kernel_calls()), 1),
                       "h100_launch_us": round(timer.graph(cache.kernel_calls(
                           splits=splits, block_n=h100[0], num_warps=h100[1], num_stages=h100[2])), 1),
                       "four_warps_us": round(timer.graph(cache.kernel_calls(
                           splits=splits, block_n=h100[0], num_warps=4)), 1)}
                for warps, stages in ((2, 3), (2, 4)):
                    row[f"warps{warps}_stages{stages}_us"] = round(timer.graph(
                        cache.kernel_calls(splits=splits, block_n=h100[0], num_warps=warps, num_stages=stages)), 1)
                if sweep and pages == "fp8":
                    grid = [(n, w, st, True) for n, w, st in itertools.product((32, 64, 128, 256), (1, 2, 4, 8), (2, 3, 4))
                            if not (n == 256 and w == 1)]
                    grid += [(n, w, st, False) for n, w, st in itertools.product((16, 32, 64), (2, 4), (2, 3))]
                    row["sweep_us"] = {}
                    for n, w, st, mma in grid:
                        key = f"block_n={n},warps={w},stages={st}{'' if mma else ',cuda_cores'}"
                        try:
                            row["sweep_us"][key] = round(timer.graph(cache.kernel_calls(
                                splits=splits, block_n=n, num_warps=w, num_stages=st, mma=mma), reps=15), 1)
                        except Exception as exc:  # noqa: BLE001 - a launch that does not fit is data
                            row["sweep_us"][key] = repr(exc)[:120]
                print(f"attention {({k: v for k, v in row.items() if k != 'sweep_us'})}", flush=True)
                results.append(row)
                del cache
                torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=lambda text: [int(x) for x in text.split(",")], default=[2, 16, 32, 64, 128])
    parser.add_argument("--attention", action="store_true", help="also the FP8 decode attention's launch")
    parser.add_argument("--attention-sweep", action="store_true", help="with --attention: its launch grid over FP8 pages")
    parser.add_argument("--sweep", action="store_true", help="also the GEMM's tile grid at each --rows")
    parser.add_argument("--accumulation", type=lambda text: [int(x) for x in text.split(",")], default=None,
                        metavar="ROWS", help="also torch._scaled_mm with and without fast accumulation at these rows")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8_rows.py needs a GPU with FP8 (compute capability >= 8.9); there is none here")
    device = torch.device("cuda")
    why = fp8_unavailable(device)
    if why is not None:
        sys.exit(f"bench/fp8_rows.py needs a GPU with FP8: {why}")
    timer = Timer(device, args.reps)
    bandwidth = copy_bandwidth(device, timer, 1024, reps=20)
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s", flush=True)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "triton": getattr(fp8_gemm.triton, "__version__", None), "copy_bandwidth_GBps": round(bandwidth, 1),
              "gemm": gemm_rows(args, device, timer, bandwidth)}
    if args.accumulation:
        report["accumulation"] = fast_accumulation(args.accumulation, device, timer)
    if args.attention:
        report["attention"] = attention_launch(device, timer, bandwidth, args.attention_sweep)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
