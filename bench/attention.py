"""Benchmark of the paged attention kernels (gpu_ops/paged_attention.py) and the fused element-wise
kernels (gpu_ops/fused.py) against the pure-torch references.

Decode: the Llama-7B shape (32 heads x 128, MHA, 1 token per page), bf16, batch 1/16/64/256 at
context 512/2048, and at the unequal contexts of a replayed Azure conversation trace against their mean
(`--data-dir`); the Llama-3-8B shape (8 kv heads, 4 tokens per page) and Gemma 2 9B's (16 heads, 8 kv
heads of 256, 1 token per page, capped scores) on a local layer (window 4096) and a global one. Each time is set against
the bytes floor: the K and V bytes the call must read over the device-to-device copy bandwidth measured
in the same run. Prefill: the Triton kernel vs the reference (gather + SDPA per sequence), vs SDPA on K/V
already contiguous, and (section prefill_flash) vs torch's flash attention on contiguous K/V, every prompt in
one call (`varlen_attn`): what a flash kernel does without paging.

    python3 bench/attention.py --out bench/results/attention.json
    python3 bench/attention.py --smoke   # tiny shapes on the CPU (Triton interpreter): checks the script
    python3 bench/attention.py --only decode_gemma2_9b_local,decode_gemma2_9b_global   # some sections alone

Timing: CUDA events around replays of a CUDA graph that holds one call per rotated layer (device time),
median of many; pages are scattered at random over a pool and the layers rotated so that each timed
round reads >= 256 MB (5x the H100's L2); random data, never zeros.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from lorad.gpu_ops import fused, paged_attention  # noqa: E402
from lorad.gpu_ops.fp8 import FP8  # noqa: E402
from timing import Timer, copy_bandwidth  # noqa: E402  (bench/timing.py, beside this script)
from lorad.gpu_ops.attention import AttentionBatch, paged_attention_ref, scattered_block_table, write_kv_ref  # noqa: E402
from lorad.gpu_ops.norm import rms_norm_ref  # noqa: E402
from lorad.gpu_ops.rope import rope_cache  # noqa: E402

ROTATE_BYTES = 256 << 20


def page_tokens(tokens_per_page: int, kv_fp8: bool) -> int:
    """The tokens a page holds as the engine lays pages out, given the bf16 pages' `tokens_per_page`: a page of the
    same bytes holds twice as many FP8 rows (KVCache in gpu_ops/page_pool.py: page bytes // row bytes)."""
    return tokens_per_page * (2 if kv_fp8 else 1)


class PagedCache:
    """A pool of random K/V pages for `layers` layers of `shapes` [(kv_len, query_len)], each block's
    pages drawn at random from the whole pool."""

    def __init__(self, heads, kv_heads, head_dim, tokens_per_page, shapes, layers, dtype, device, seed=0, window=None,
                 softcap=None, kv_fp8=False):
        rng = np.random.default_rng(seed)
        self.window, self.softcap = window, softcap
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.shapes, self.layers = shapes, layers
        blocks = [-(-kv // tokens_per_page) for kv, _ in shapes]
        num_pages = 1 + 2 * layers * sum(blocks)
        self.kv_view = torch.empty(num_pages, tokens_per_page, kv_heads, head_dim, dtype=dtype, device=device).normal_()
        # FP8 pages (--kv-cache-dtype fp8): values of the same spread over per-layer scales as the engine keeps them
        self.kv_scales = torch.tensor([[0.02, 0.015]] * layers, device=device) if kv_fp8 else None
        if kv_fp8:
            self.kv_view = (self.kv_view * 64).to(FP8)
        table = scattered_block_table(blocks, layers, num_pages, rng)
        self.tokens = sum(query_len for _, query_len in shapes)
        self.batch = AttentionBatch.from_block_table(table, shapes, tokens_per_page, device)
        self.meta = paged_attention.AttentionMeta.build(self.batch, tokens_per_page, device)
        self.q = [torch.randn(self.tokens, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.out = torch.empty(self.tokens, heads * head_dim, dtype=dtype, device=device)
        self.scale = head_dim**-0.5

    def kv_bytes(self) -> int:
        """K and V bytes one layer's attention must read (every cached position once; with a window, the positions
        some new row sees)."""
        element = self.kv_view.element_size()
        seen = [kv if self.window is None else min(kv, query + self.window - 1) for kv, query in self.shapes]
        return sum(2 * positions * self.kv_heads * self.head_dim * element for positions in seen)

    def layer_scale(self, layer):
        return None if self.kv_scales is None else self.kv_scales[layer]

    def kernel_calls(self, **decode_options):
        def call(layer):
            if decode_options:
                table = self.batch.block_table
                paged_attention.decode_attention(
                    self.q[layer], self.kv_view, table[layer, 0], table[layer, 1], self.meta.decode_seqs,
                    self.meta.query_start, self.meta.kv_len, self.out, self.scale, num_seqs=self.meta.num_decode,
                    window=self.window, softcap=self.softcap, kv_scale=self.layer_scale(layer), **decode_options,
                )
            else:
                paged_attention.attention(self.q[layer], self.kv_view, layer, self.batch, self.scale, meta=self.meta, out=self.out,
                                          window=self.window, softcap=self.softcap, kv_scales=self.kv_scales)

        return [lambda layer=layer: call(layer) for layer in range(self.layers)]

    def prefill_kernel_calls(self, **options):
        """The prefill kernel over the same rows: every decode sequence a one-row query tile."""
        meta = self.meta
        seqs = meta.decode_seqs
        meta = paged_attention.AttentionMeta(meta.seq_info, seqs[:0], seqs, torch.zeros_like(seqs), 0, meta.num_decode, meta.max_context)
        table = self.batch.block_table
        return [
            lambda layer=layer: paged_attention.prefill_attention(
                self.q[layer], self.kv_view, table[layer, 0], table[layer, 1], meta, self.out, self.scale,
                kv_scale=self.layer_scale(layer), **options)
            for layer in range(self.layers)
        ]

    def reference_call(self):
        return lambda: paged_attention_ref(self.q[0], self.kv_view, 0, self.batch, self.scale, self.window, self.softcap)

    def error(self) -> float | None:
        """Relative error of layer 0 against the reference run in float64 (None for pools over 1 GB)."""
        if self.kv_view.numel() * self.kv_view.element_size() > (1 << 30):
            return None
        got = paged_attention.attention(self.q[0], self.kv_view, 0, self.batch, self.scale, meta=self.meta, window=self.window,
                                        softcap=self.softcap, kv_scales=self.kv_scales).double()
        pages = self.kv_view.double() if self.kv_scales is None else self.kv_view  # FP8: the reference reads them times their scales
        expected = paged_attention_ref(self.q[0].double(), pages, 0, self.batch, self.scale, self.window, self.softcap,
                                       kv_scales=None if self.kv_scales is None else self.kv_scales.double())
        return float((got - expected).norm() / expected.norm())


def trace_contexts(rows, batch: int, rng: np.random.Generator, max_len: int = 4096) -> list[int]:
    """The contexts of `batch` running sequences as a server replaying the Azure conversation trace (`rows`:
    read_azure_csv's) holds them: requests drawn from its first 2000 rows, each part way through its output
    (prompt + a uniform share of it), prompts fitted to a `max_len` context as `lorad bench serve` fits them."""
    picks = rng.choice(min(2000, len(rows.prompt_tokens)), batch, replace=False)
    contexts = []
    for index in picks:
        prompt = min(int(rows.prompt_tokens[index]), max_len - 256)
        output = min(int(rows.output_tokens[index]), max_len - prompt)
        contexts.append(prompt + int(rng.integers(0, max(output, 1))))
    return contexts


def decode_trace_bench(args, device, timer: Timer, bandwidth: float, batches) -> list:
    """The 7B shape's decode attention over the contexts a trace replay holds (long and short together) against
    the same batch at their mean context: what unequal lengths cost the kernel, which runs one sequence's heads
    in a program each."""
    from lorad.scheduler.workload import read_azure_csv

    rows = read_azure_csv(os.path.join(args.data_dir, "azure_llm_inference_2023_conv.csv"))
    results = []
    for batch in batches:
        contexts = trace_contexts(rows, batch, np.random.default_rng(batch))
        mean = int(np.mean(contexts))
        for label, shape in (("trace", contexts), ("mean", [mean] * batch)):
            cache = PagedCache(32, 32, 128, 1, [(context, 1) for context in shape], 2, args.dtype, device, seed=batch)
            floor_us = cache.kv_bytes() / (bandwidth * 1e9) * 1e6
            kernel = timer.graph(cache.kernel_calls())
            row = {"shape": "llama7b", "contexts": label, "batch": batch, "max_context": max(shape), "mean_context": mean,
                   "kv_bytes": cache.kv_bytes(), "floor_us": round(floor_us, 2), "kernel_us": round(kernel, 2),
                   "floor_percent": round(100 * floor_us / kernel, 1)}
            print(row, flush=True)
            results.append(row)
    return results


def decode_fp8_bench(args, device, timer: Timer, bandwidth: float, shape_name: str, heads, kv_heads, head_dim, tpp, batches,
                     contexts) -> list:
    """Decode attention over FP8 pages (--kv-cache-dtype fp8) beside the same batch over bf16 pages, each against
    its own bytes' floor: the kernel with each choice of dot operands (paged_attention.FP8_KV_DOTS), a few tiles,
    and the prefill kernel on the same rows (one-row query tiles, as a prefill graph runs a mixed step's decode rows).
    `tpp`: the bf16 pages' tokens a page; FP8 pages hold twice as many, as the engine lays them out."""
    results = []
    for context in contexts:
        for batch in batches:
            shapes = [(context, 1)] * batch
            layers = layers_for(2 * batch * context * kv_heads * head_dim) if not SMOKE else 1
            row = {"shape": shape_name, "batch": batch, "context": context, "layers_rotated": layers}
            for pages in ("bf16", "fp8"):
                cache = PagedCache(heads, kv_heads, head_dim, page_tokens(tpp, pages == "fp8"), shapes, layers, args.dtype,
                                   device, seed=batch, kv_fp8=pages == "fp8")
                floor_us = cache.kv_bytes() / (bandwidth * 1e9) * 1e6
                splits = paged_attention.decode_splits(batch, kv_heads, context, device)
                default_n = paged_attention.DECODE_BLOCK_N["gqa" if heads > kv_heads else "mha"]  # bf16's: the sweep's centre
                times = {"default": timer.graph(cache.kernel_calls())}
                dots = paged_attention.FP8_KV_DOTS_CHOICES if pages == "fp8" else [None]
                for dot in dots:
                    label = f"dots={dot}," if dot else ""
                    for block_n, warps in ((default_n, 4), (default_n, 8), (2 * default_n, 4), (2 * default_n, 8), (default_n // 2, 4)):
                        options = dict(splits=splits, block_n=block_n, num_warps=warps, **({"fp8_dots": dot} if dot else {}))
                        try:
                            times[f"{label}block_n={block_n},warps={warps}"] = timer.graph(cache.kernel_calls(**options), reps=20)
                        except Exception as error:  # noqa: BLE001 - a tile that does not compile is data
                            times[f"{label}block_n={block_n},warps={warps}"] = repr(error)[:200]
                    times[f"{label}prefill kernel on the decode rows"] = timer.graph(
                        cache.prefill_kernel_calls(**({"fp8_dots": dot} if dot else {})), reps=20)
                best = min(value for value in times.values() if isinstance(value, float))
                row[pages] = {"kv_bytes": cache.kv_bytes(), "floor_us": round(floor_us, 2), "splits": splits,
                              "times_us": {key: round(value, 2) if isinstance(value, float) else value for key, value in times.items()},
                              "default_floor_percent": round(100 * floor_us / times["default"], 1),
                              "best_floor_percent": round(100 * floor_us / best, 1),
                              "relative_error_vs_fp64_ref": cache.error()}
                del cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"decode fp8 {shape_name} b={batch} ctx={context}: {row}", flush=True)
            results.append(row)
    return results


def layers_for(bytes_per_layer: int, cap: int = 64) -> int:
    return max(1, min(cap, -(-ROTATE_BYTES // bytes_per_layer)))


def decode_bench(args, device, timer: Timer, bandwidth: float, shape_name: str, heads, kv_heads, head_dim, tpp, batches, contexts,
                 sweep_at=None, window=None, softcap=None) -> list:
    results = []
    for context in contexts:
        for batch in batches:
            shapes = [(context, 1)] * batch
            per_layer = 2 * batch * context * kv_heads * head_dim * 2
            layers = layers_for(per_layer) if not SMOKE else 1
            cache = PagedCache(heads, kv_heads, head_dim, tpp, shapes, layers, args.dtype, device, seed=batch, window=window,
                               softcap=softcap)
            floor_us = cache.kv_bytes() / (bandwidth * 1e9) * 1e6
            splits = paged_attention.decode_splits(batch, kv_heads, context if window is None else min(context, window), device)
            kernel = timer.graph(cache.kernel_calls())
            row = {
                "shape": shape_name, "batch": batch, "context": context, "window": window, "softcap": softcap,
                "splits": splits, "layers_rotated": layers,
                "kv_bytes": cache.kv_bytes(), "floor_us": round(floor_us, 2), "kernel_us": round(kernel, 2),
                "achieved_GBps": round(cache.kv_bytes() / (kernel * 1e-6) / 1e9, 1),
                "floor_percent": round(100 * floor_us / kernel, 1),
                "relative_error_vs_fp64_ref": cache.error(),
            }
            if args.reference and (batch <= 64 or SMOKE):
                row["reference_eager_us"] = round(timer.eager([cache.reference_call()], reps=5), 1)
                row["speedup_vs_reference"] = round(row["reference_eager_us"] / kernel, 1)
            if sweep_at and (batch, context) in sweep_at:
                sweep = {}
                configs = [dict(block_n=32), dict(block_n=64), dict(block_n=128), dict(block_n=64, num_warps=8),
                           dict(block_n=128, num_warps=8), dict(block_n=64, splits=max(1, splits // 2)),
                           dict(block_n=64, splits=min(16, splits * 2)), dict(block_n=32, num_stages=4)]
                configs += [dict(mma=True, block_n=n, num_warps=w, num_stages=st) for n, w, st in
                            [(32, 4, None), (64, 4, None), (64, 4, 2), (64, 4, 4), (128, 4, None), (128, 8, None), (64, 8, 3)]]
                for config in configs:
                    config = {"splits": splits, "num_warps": 4, **config}
                    key = ",".join(f"{name}={value}" for name, value in config.items() if value is not None)
                    try:
                        sweep[key] = round(timer.graph(cache.kernel_calls(**config), reps=20), 2)
                    except Exception as error:  # noqa: BLE001 - a config that does not compile is data
                        sweep[key] = repr(error)[:200]
                sweep["prefill kernel on the decode rows"] = round(timer.graph(cache.prefill_kernel_calls(), reps=20), 2)
                print(f"  sweep: {sweep}", flush=True)
                row["sweep_us"] = sweep
            print(f"decode {shape_name} b={batch:3d} ctx={context:5d} splits={splits:2d}: {kernel:9.2f} us, floor {floor_us:8.2f} us "
                  f"({row['floor_percent']}%), ref {row.get('reference_eager_us', '-')} us, err {row['relative_error_vs_fp64_ref']}", flush=True)
            results.append(row)
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


# The prefill launches swept beside the default: (tile_m, block_n, warps, stages; None: Triton's default).
PREFILL_SWEEP = [(64, 64, 4, None), (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4),
                 (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3)]


def prefill_sweep(cache: "PagedCache", timer: Timer, flops: float, device, launches=None) -> dict:
    """The prefill kernel alone over the cache's prompt rows, at each launch (tile_m, block_n, warps, stages) of
    `launches`, PREFILL_SWEEP by default (its tiles cut to the launch's tile_m): us, TFLOP/s and the prompt rows'
    relative error against the float64 reference, or the error of a launch that does not compile."""
    table = cache.batch.block_table
    prompt = torch.cat([torch.arange(start, start + length) for start, length in
                        zip(cache.batch.query_start, cache.batch.query_len) if length > 1]).to(device)
    pages = cache.kv_view.double() if cache.kv_scales is None else cache.kv_view
    expected = paged_attention_ref(cache.q[0].double(), pages, 0, cache.batch, cache.scale,
                                   kv_scales=None if cache.kv_scales is None else cache.kv_scales.double())[prompt]
    sweep = {}
    for tile_m, block_n, warps, stages in launches or PREFILL_SWEEP:
        key = f"tile_m={tile_m},block_n={block_n},warps={warps},stages={stages}"
        meta = paged_attention.AttentionMeta.build(cache.batch, cache.kv_view.shape[1], device, tile_m=tile_m)
        options = dict(block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            us = timer.graph([lambda: paged_attention.prefill_attention(
                cache.q[0], cache.kv_view, table[0, 0], table[0, 1], meta, cache.out, cache.scale,
                kv_scale=cache.layer_scale(0), **options)], reps=20)
            relative = float((cache.out[prompt].double() - expected).norm() / expected.norm())
            sweep[key] = {"us": round(us, 1), "TFLOPs": round(flops / (us * 1e-6) / 1e12, 1), "relative_error": relative}
        except Exception as error:  # noqa: BLE001 - a launch that does not compile is data
            sweep[key] = repr(error)[:200]
    return sweep


def flash_varlen_call(q, shapes, kv_heads: int, scale: float):
    """torch's flash attention over the prompts' K/V laid out contiguously, all sequences in one call
    (`torch.nn.attention.varlen.varlen_attn`, causal from the bottom right: a chunk's rows see its cached prefix):
    what a flash kernel does without paging. (None, why) where this torch has no such call."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        return None, f"unavailable: {error}"
    if q.device.type != "cuda":
        return None, "unavailable: flash attention needs cuda"
    kv_lens = [kv for kv, _ in shapes]
    k = torch.randn(sum(kv_lens), kv_heads, q.shape[2], dtype=q.dtype, device=q.device)
    v = torch.randn_like(k)
    rows = torch.tensor([0] + [query for _, query in shapes], device=q.device).cumsum(0).to(torch.int32)
    positions = torch.tensor([0] + kv_lens, device=q.device).cumsum(0).to(torch.int32)
    queries = q[: int(rows[-1])]
    common = dict(scale=scale)
    if kv_heads != q.shape[1]:
        common["enable_gqa"] = True
    longest_q, longest_k = max(query for _, query in shapes), max(kv_lens)
    refusals = []
    for causal in (dict(window_size=(-1, 0)), dict(is_causal=True)):  # the keyword differs between torch versions
        call = lambda causal=causal: varlen_attn(queries, k, v, rows, positions, longest_q, longest_k, **common, **causal)
        try:
            out = call()
        except TypeError as error:  # this torch's varlen_attn lacks the keyword (or enable_gqa)
            refusals.append(str(error))
            continue
        # the last sequence's rows against SDPA with the mask the engine applies (each row sees its prefix)
        kv_len, query_len = shapes[-1]
        last_k = k[int(positions[-2]):].transpose(0, 1).float().repeat_interleave(q.shape[1] // kv_heads, 0)
        last_v = v[int(positions[-2]):].transpose(0, 1).float().repeat_interleave(q.shape[1] // kv_heads, 0)
        seen = torch.arange(kv_len, device=q.device)[None, :] <= torch.arange(kv_len - query_len, kv_len, device=q.device)[:, None]
        expected = F.scaled_dot_product_attention(queries[int(rows[-2]):].transpose(0, 1).float(), last_k, last_v,
                                                  attn_mask=seen, scale=scale).transpose(0, 1)
        error = float((out[int(rows[-2]):].float() - expected).norm() / expected.norm())
        return call, f"{next(iter(causal))}, relative error {error:.1e} against the masked reference"
    return None, "unavailable: " + "; ".join(refusals)


def prefill_bench(args, device, timer: Timer, cases, heads=32, kv_heads=32, tokens_per_page=1, sweep=False) -> list:
    """cases: (name, [(kv_len, query_len)]) on the 7B shape (or `heads` over `kv_heads` of 128); `sweep`: each case's
    prefill launches swept (prefill_sweep), over bf16 pages and FP8 pages (twice the tokens a page)."""
    head_dim = 128
    results = []
    for name, shapes in cases:
        cache = PagedCache(heads, kv_heads, head_dim, tokens_per_page, shapes, 1, args.dtype, device)
        kernel = timer.graph(cache.kernel_calls())
        reference = timer.eager([cache.reference_call()], reps=10)
        # SDPA on K/V already contiguous per sequence (no gather): the unpaged lower bound.
        contiguous = []
        for seq, (kv_len, query_len) in enumerate(shapes):
            start = cache.batch.query_start[seq]
            q = cache.q[0][start : start + query_len].transpose(0, 1)
            k = torch.randn(heads, kv_len, head_dim, dtype=args.dtype, device=device)
            v = torch.randn(heads, kv_len, head_dim, dtype=args.dtype, device=device)
            if kv_len == query_len:
                contiguous.append(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            else:
                mask = torch.arange(kv_len, device=device)[None, :] <= torch.arange(kv_len - query_len, kv_len, device=device)[:, None]
                contiguous.append(lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        sdpa = timer.eager([lambda: [c() for c in contiguous]], reps=10)
        # each new row's scores and P @ V over the positions it sees: its cached prefix and itself and the rows before it
        per_shape = [(q, 4 * heads * head_dim * (q * (kv - q) + q * (q + 1) / 2)) for kv, q in shapes]
        flops = sum(count for _, count in per_shape)
        prompt_flops = sum(count for q, count in per_shape if q > 1)
        row = {
            "case": name, "heads": heads, "kv_heads": kv_heads, "tokens_per_page": tokens_per_page,
            "shapes": shapes if len(shapes) <= 8 else f"{len(shapes)} sequences", "kernel_us": round(kernel, 1),
            "reference_eager_us": round(reference, 1), "sdpa_contiguous_eager_us": round(sdpa, 1),
            "kernel_TFLOPs": round(flops / (kernel * 1e-6) / 1e12, 1), "relative_error_vs_fp64_ref": cache.error(),
        }
        if all(query > 1 for _, query in shapes):  # prompts only: flash attention on their K/V laid out contiguously
            flash, how = flash_varlen_call(cache.q[0], shapes, kv_heads, cache.scale)
            row["flash_varlen_causal_by"] = how
            if flash is not None:
                us = timer.graph([flash])
                row["flash_varlen_contiguous_us"] = round(us, 1)
                row["flash_varlen_TFLOPs"] = round(flops / (us * 1e-6) / 1e12, 1)
                print(f"  flash varlen (contiguous K/V, {how}): {us:9.1f} us ({row['flash_varlen_TFLOPs']} TFLOP/s)",
                      flush=True)
        if sweep:
            row["sweep_bf16"] = prefill_sweep(cache, timer, prompt_flops, device)
            print(f"  sweep bf16 pages: {row['sweep_bf16']}", flush=True)
            fp8 = PagedCache(heads, kv_heads, head_dim, page_tokens(tokens_per_page, True), shapes, 1, args.dtype, device,
                             kv_fp8=True)
            row["sweep_fp8"] = prefill_sweep(fp8, timer, prompt_flops, device)
            print(f"  sweep fp8 pages: {row['sweep_fp8']}", flush=True)
            del fp8
        print(f"prefill {name:28s}: kernel {kernel:9.1f} us ({row['kernel_TFLOPs']} TFLOP/s), reference {reference:9.1f} us, "
              f"SDPA contiguous {sdpa:9.1f} us, err {row['relative_error_vs_fp64_ref']}", flush=True)
        results.append(row)
        del cache
    return results


def fused_bench(args, device, timer: Timer, bandwidth: float, token_counts) -> list:
    dtype, results = args.dtype, []
    hidden, heads, kv_heads, head_dim, inter = (4096, 32, 32, 128, 11008) if not SMOKE else (64, 4, 4, 16, 96)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_cache(inv_freq, 4096, dtype, device)
    for tokens in token_counts:
        rounds = 4 if not SMOKE else 1
        xs = [torch.randn(tokens, hidden, dtype=dtype, device=device) for _ in range(rounds)]
        weight = torch.randn(hidden, dtype=dtype, device=device)
        qkvs = [torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device) for _ in range(rounds)]
        positions = torch.randint(0, 4096, (tokens,), device=device)
        gate_ups = [torch.randn(tokens, 2 * inter, dtype=dtype, device=device) for _ in range(rounds)]

        def qk(i):
            qkv = qkvs[i]
            return qkv[:, : heads * head_dim].view(tokens, heads, head_dim), qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)

        cases = {
            "rms_norm": ([lambda i=i: fused.rms_norm(xs[i], weight, 1e-5) for i in range(rounds)],
                         [lambda i=i: rms_norm_ref(xs[i], weight, 1e-5) for i in range(rounds)], 2 * tokens * hidden * 2),
            "rope_qk": ([lambda i=i: fused.rope_qk(*qk(i), cos, sin, positions, inplace=True) for i in range(rounds)],
                        [lambda i=i: fused.rope_qk_ref(*qk(i), cos, sin, positions) for i in range(rounds)], 2 * tokens * (heads + kv_heads) * head_dim * 2),
            "silu_mul": ([lambda i=i: fused.silu_mul(*gate_ups[i].chunk(2, dim=-1)) for i in range(rounds)],
                         [lambda i=i: fused.silu_mul_ref(*gate_ups[i].chunk(2, dim=-1)) for i in range(rounds)], 3 * tokens * inter * 2),
        }
        for name, (kernel_calls, reference_calls, moved) in cases.items():
            kernel = timer.graph(kernel_calls)
            reference = timer.graph(reference_calls)
            kernel_eager = timer.eager(kernel_calls)
            reference_eager = timer.eager(reference_calls)
            floor_us = moved / (bandwidth * 1e9) * 1e6
            row = {"op": name, "tokens": tokens, "kernel_graph_us": round(kernel, 2), "reference_graph_us": round(reference, 2),
                   "kernel_eager_us": round(kernel_eager, 2), "reference_eager_us": round(reference_eager, 2), "floor_us": round(floor_us, 2)}
            print(f"fused {name:8s} T={tokens:5d}: kernel {kernel:8.2f} us (eager {kernel_eager:7.1f}), reference {reference:8.2f} us "
                  f"(eager {reference_eager:7.1f}), floor {floor_us:7.2f} us", flush=True)
            results.append(row)
    return results


def write_kv_bench(args, device, timer: Timer, batch: int) -> dict:
    cache = PagedCache(32, 32, 128, 1, [(1024, 1)] * batch, 1, args.dtype, device) if not SMOKE else PagedCache(4, 4, 16, 1, [(9, 1)] * batch, 1, args.dtype, device)
    k = torch.randn(batch, cache.kv_heads, cache.head_dim, dtype=args.dtype, device=device)
    v = torch.randn(batch, cache.kv_heads, cache.head_dim, dtype=args.dtype, device=device)
    kernel = timer.graph([lambda: paged_attention.write_kv(cache.kv_view, 0, k, v, cache.batch)])
    reference = timer.graph([lambda: write_kv_ref(cache.kv_view, 0, k, v, cache.batch)])
    row = {"tokens": batch, "kernel_graph_us": round(kernel, 2), "reference_graph_us": round(reference, 2)}
    print(f"write_kv T={batch}: kernel {kernel:.2f} us, reference {reference:.2f} us", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument("--budget-s", type=float, default=240.0, help="sections past this many seconds are skipped")
    parser.add_argument("--data-dir", default="../shared/data", help="where the Azure trace CSVs are (decode_7b_azure_conv)")
    parser.add_argument("--only", default=None, help="comma-separated section names (e.g. decode_gemma2_9b_local,decode_gemma2_9b_global)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not SMOKE:
        sys.exit("no GPU: run with --smoke to check the script on the CPU")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = Timer(device, 3 if SMOKE else args.reps, graph_on_cpu=True)
    started = time.perf_counter()
    report = {
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": getattr(paged_attention.triton, "__version__", None),
            "python": platform.python_version(),
        },
        "dtype": str(args.dtype),
    }
    bandwidth = copy_bandwidth(device, timer, 1024 if not SMOKE else 8, reps=20)
    report["copy_bandwidth_GBps"] = round(bandwidth, 1)
    print(f"device copy bandwidth: {bandwidth:.0f} GB/s (read + write)", flush=True)

    def save():
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(report, handle, indent=1)

    if SMOKE:
        sections = [
            ("decode_7b", lambda: decode_bench(args, device, timer, bandwidth, "tiny", 4, 4, 16, 1, [1, 3], [40], sweep_at={(3, 40)})),
            ("decode_gqa", lambda: decode_bench(args, device, timer, bandwidth, "tiny gqa", 4, 2, 16, 2, [3], [40], sweep_at={(3, 40)})),
            ("prefill", lambda: prefill_bench(args, device, timer, [("fresh 20", [(20, 20)]), ("chunk 5 on 30", [(35, 5)])],
                                              heads=4, kv_heads=4, sweep=True)),
            ("fused", lambda: fused_bench(args, device, timer, bandwidth, [3])),
            ("write_kv", lambda: write_kv_bench(args, device, timer, 3)),
            ("decode_window", lambda: decode_bench(args, device, timer, bandwidth, "tiny", 4, 2, 16, 1, [1, 3], [40], window=16,
                                                   softcap=5.0)),
            ("decode_fp8", lambda: decode_fp8_bench(args, device, timer, bandwidth, "tiny gqa", 4, 2, 16, 2, [3], [40])),
        ]
    else:
        sections = [
            ("decode_7b", lambda: decode_bench(args, device, timer, bandwidth, "llama7b", 32, 32, 128, 1, [1, 16, 64, 256], [512, 2048], sweep_at={(64, 2048), (1, 2048), (64, 512)})),
            ("prefill", lambda: prefill_bench(args, device, timer, [
                ("fresh 1x2048", [(2048, 2048)]), ("fresh 4x512", [(512, 512)] * 4),
                ("chunk 512 on 1536 cached", [(2048, 512)]), ("mixed 63 decodes ctx1024 + 512", [(1024, 1)] * 63 + [(512, 512)]),
            ])),
            # the launches of the prompt tiles, at the prompts of a mixed step of the Azure conversation trace
            ("prefill_sweep", lambda: prefill_bench(args, device, timer, [
                ("fresh 1x2048", [(2048, 2048)]), ("fresh 1x1536", [(1536, 1536)]), ("fresh 4x512", [(512, 512)] * 4),
                ("chunk 512 on 1536 cached", [(2048, 512)]), ("fresh 3x500 + chunk 536 on 800", [(500, 500)] * 3 + [(1336, 536)]),
            ], sweep=True)),
            # the same prompts, the Triton kernel beside torch's flash attention on contiguous K/V (no sweep)
            ("prefill_flash", lambda: prefill_bench(args, device, timer, [
                ("fresh 1x2048", [(2048, 2048)]), ("fresh 1x1536", [(1536, 1536)]), ("fresh 4x512", [(512, 512)] * 4),
                ("chunk 512 on 1536 cached", [(2048, 512)]), ("fresh 3x500 + chunk 536 on 800", [(500, 500)] * 3 + [(1336, 536)]),
            ])),
            ("prefill_flash_llama3_8b", lambda: prefill_bench(args, device, timer, [
                ("fresh 1x2048", [(2048, 2048)]), ("fresh 4x512", [(512, 512)] * 4), ("chunk 512 on 1536 cached", [(2048, 512)]),
            ], kv_heads=8, tokens_per_page=4)),
            ("prefill_sweep_llama3_8b", lambda: prefill_bench(args, device, timer, [
                ("fresh 1x2048", [(2048, 2048)]), ("chunk 512 on 1536 cached", [(2048, 512)]),
            ], kv_heads=8, tokens_per_page=4, sweep=True)),
            ("fused", lambda: fused_bench(args, device, timer, bandwidth, [64, 2048])),
            ("write_kv", lambda: write_kv_bench(args, device, timer, 256)),
            ("decode_llama3_8b", lambda: decode_bench(args, device, timer, bandwidth, "llama3_8b", 32, 8, 128, 4, [1, 64, 256], [2048])),
            ("decode_7b_azure_conv", lambda: decode_trace_bench(args, device, timer, bandwidth, [32, 52, 64])),
            # Gemma 2 9B: a local layer at twice its window reads half the context, at the same share of the floor
            ("decode_gemma2_9b_local", lambda: decode_bench(args, device, timer, bandwidth, "gemma2_9b", 16, 8, 256, 1, [1, 64],
                                                            [8192], window=4096, softcap=50.0)),
            ("decode_gemma2_9b_global", lambda: decode_bench(args, device, timer, bandwidth, "gemma2_9b", 16, 8, 256, 1, [1, 64],
                                                             [8192], softcap=50.0)),
            ("decode_7b_fp8", lambda: decode_fp8_bench(args, device, timer, bandwidth, "llama7b", 32, 32, 128, 1, [64, 128], [1024])),
            ("decode_llama3_8b_fp8", lambda: decode_fp8_bench(args, device, timer, bandwidth, "llama3_8b", 32, 8, 128, 4, [64, 256],
                                                              [1024])),
        ]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {name for name, _ in sections})
        if unknown:
            sys.exit(f"--only: no section {', '.join(unknown)}; the sections: {', '.join(name for name, _ in sections)}")
        sections = [(name, section) for name, section in sections if name in wanted]
    for name, section in sections:
        if time.perf_counter() - started > args.budget_s:
            report[name] = "skipped: over the time budget"
            print(f"{name}: skipped (budget)", flush=True)
            continue
        try:
            report[name] = section()
        except Exception as error:  # noqa: BLE001 - one broken section must not cost the others
            report[name] = {"error": repr(error)[:2000]}
            print(f"{name}: FAILED {error!r}"[:2000], flush=True)
        save()
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    save()
    print(f"done in {report['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
