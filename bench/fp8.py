"""FP8 weights and FP8 KV pages against bf16, side by side in one run on one GPU (the FP8 figures of BENCHMARKS.md):

1. accuracy: the first generated token and the next-token distribution (mean KL) of FP8 weights + FP8 KV against
   bf16, over --prompts prompts with the 64 adapters in turn (random weights give flat distributions, whose
   argmax flips on small errors and whose KL is small anyway: a weak check); the FP8 GEMM of each 7B projection
   against its dequantized reference and the bf16 product;
2. batch-1 decode with FP8 weights: its step against the floor (the weights' bytes over the measured HBM copy
   bandwidth) and against the bf16 step; the batch-1 projection kernels (gemv over FP8 weights, torch._scaled_mm,
   bf16 gemv) timed alone;
3. decode of 64 running requests, prompts 1024, 64 distinct rank-16 adapters on every projection: output tok/s,
   FP8 weights + FP8 KV against bf16;
4. the KV capacity (tokens) each engine reports (its pool is what memory the weights left; per page, FP8 fits 2x);
5. the LoRA/base decode ratio (64 distinct rank-16 adapters, prompt 512) of both engines.

The random-weights model of --model-config (--dummy-weights), run on cuda:

    python3 bench/fp8.py --model-config llama-2-7b --out bench/results/fp8_h100.json

`--smoke` runs the same on the CPU with the tiny shape and a few prompts (the script's own check, no figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F

from engine_decode import decode_rate, device_copy_bandwidth  # bench/engine_decode.py, beside this script
from timing import Timer  # bench/timing.py

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, PROJECTIONS, ModelSpec
from lorad.gpu_ops.fp8 import Fp8Weight

ADAPTERS = 64
RANK = 16


def engine_config(args, quantization: str, kv_cache_dtype: str) -> EngineConfig:
    return EngineConfig(
        model_config=args.model_config, dummy_weights=True, dummy_adapters=ADAPTERS, dummy_adapter_rank=RANK,
        dummy_adapter_targets=",".join(PROJECTIONS), device=args.device, dtype="bfloat16",
        max_running_requests=ADAPTERS, max_batch_tokens=args.max_batch_tokens, max_lora_rank=64,
        max_model_len=2048, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        **({"pool_bytes": 64 << 20} if args.smoke else {}),
    )


def weight_bytes(engine: Engine) -> int:
    """The bytes a decode step reads of the weights: every projection (FP8 ones with their scales), the norms,
    the LM head (the embedding table is gathered, not streamed)."""
    model = engine.runner.model
    total = model.lm_head.nbytes + model.norm.nbytes
    for layer in model.layers:
        for value in vars(layer).values():
            if isinstance(value, (torch.Tensor, Fp8Weight)):
                total += value.nbytes
    return total


def first_tokens(engine: Engine, count: int, vocab: int, seed: int = 11) -> tuple[list[int], torch.Tensor]:
    """Greedy first tokens and their logits (float32, on the host) of `count` random prompts of 16 to 256 tokens,
    each with adapter dummy-(i % 64)."""
    generator = torch.Generator().manual_seed(seed)
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    requests = []
    for i in range(count):
        length = int(torch.randint(16, 257, (1,), generator=generator))
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        requests.append(GenerationRequest(prompt, f"dummy-{i % ADAPTERS}", greedy, keep_logits=True))
    results = engine.generate(requests)
    return [r.token_ids[0] for r in results], torch.stack([r.logits[0].float().cpu() for r in results])


def measure_engine(args, quantization: str, kv_cache_dtype: str, hbm: float) -> tuple[dict, list[int], torch.Tensor]:
    started = time.perf_counter()
    engine = Engine(engine_config(args, quantization, kv_cache_dtype))
    built_s = time.perf_counter() - started
    spec, status = engine.spec, engine.status()
    result = {"quantization": status["quantization"], "kv_cache_dtype": status["kv_cache_dtype"], "ops": status["ops"],
              "build_s": built_s, "kv_capacity_tokens": status["kv_capacity_tokens"],
              "kv_tokens_per_page": engine.kv.tokens_per_page, "pool_pages": engine.pool.capacity,
              "lora_kernel_choice": status["lora_kernel_choice"]}  # a profile at the default path picks the decode kernel
    needed = ADAPTERS * (args.long_prompt + args.steps + 16)
    if status["kv_capacity_tokens"] < needed:  # the decode runs would wait for pages forever
        raise SystemExit(f"{quantization}/{kv_cache_dtype}: the pool holds {status['kv_capacity_tokens']} KV tokens, "
                         f"the 64x{args.long_prompt} run needs {needed} (device memory held by an earlier engine?)")
    tokens, logits = first_tokens(engine, args.prompts, spec.vocab_size)
    weights = weight_bytes(engine)
    _, single_ms = decode_rate(engine, [None], 128, args.steps)
    floor_ms = weights / hbm * 1e3
    result["batch1"] = {"step_ms": single_ms, "weight_bytes": weights, "floor_ms": floor_ms, "over_floor": single_ms / floor_ms}
    adapters = [f"dummy-{i}" for i in range(ADAPTERS)]
    rate, step_ms = decode_rate(engine, adapters, args.long_prompt, args.steps)
    result["decode_64x1024"] = {"prompt": args.long_prompt, "lora_tok_s": rate, "lora_step_ms": step_ms}
    base_rate, base_ms = decode_rate(engine, [None] * ADAPTERS, args.ratio_prompt, args.steps)
    lora_rate, lora_ms = decode_rate(engine, adapters, args.ratio_prompt, args.steps)
    context = args.ratio_prompt + args.steps // 2
    kv_bytes = ADAPTERS * context * 2 * spec.num_layers * spec.kv_size * engine.kv.view.element_size()
    lora_bytes = ADAPTERS * spec.num_layers * RANK * 2 * sum(sum(spec.projection_shape(p)) for p in PROJECTIONS)
    result["lora_over_base_512"] = {
        "prompt": args.ratio_prompt, "base_tok_s": base_rate, "lora_tok_s": lora_rate, "lora_over_base": lora_rate / base_rate,
        "base_step_ms": base_ms, "lora_step_ms": lora_ms, "weight_bytes": weights, "kv_bytes": kv_bytes,
        "lora_bytes": lora_bytes, "ratio_at_floor": (weights + kv_bytes) / (weights + kv_bytes + lora_bytes),
    }
    result["graph_steps"] = engine.runner.graph_steps
    result["lora_kernel_steps"] = dict(engine.kernel_choice.steps)  # decode steps with LoRA rows, by kernel
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        result["device_bytes_left_allocated"] = torch.cuda.memory_allocated()
    return result, tokens, logits


def gemm_table(spec: ModelSpec, device: torch.device, smoke: bool) -> list[dict]:
    """Each fused projection of the shape: the FP8 GEMM's error against the dequantized reference and the bf16
    product, and (on cuda) the batch-1 kernels timed from CUDA-graph replays: bf16 gemv (the bf16 engine's path),
    gemv over FP8 weights (the FP8 engine's), torch._scaled_mm with the row quantized (the GEMM path), and 64 rows
    bf16 F.linear against fp8_linear."""
    from lorad.gpu_ops import fp8, fp8_gemm, gemv

    h, i = spec.hidden_size, spec.intermediate_size
    shapes = {"qkv": (h, spec.q_size + 2 * spec.kv_size), "o": (spec.q_size, h), "gate_up": (h, 2 * i), "down": (i, h)}
    timer = Timer(device, reps=20)
    rows = []
    for name, (fan_in, fan_out) in shapes.items():
        generator = torch.Generator(device=device).manual_seed(fan_out)
        weight = (torch.randn(fan_out, fan_in, device=device, generator=generator) * fan_in**-0.5).bfloat16()
        quantized = fp8.quantize_weight(weight)
        x64 = torch.randn(64, fan_in, device=device, generator=generator).bfloat16()
        row = {"projection": name, "in": fan_in, "out": fan_out}
        if device.type == "cuda":
            got = fp8_gemm.fp8_linear(x64, quantized).double()
            exact = (x64.double() @ weight.double().t())
            dequantized = fp8.fp8_linear_ref(x64.float(), quantized).double()
            row["rel_error_vs_dequantized"] = float((got - dequantized).norm() / dequantized.norm())
            row["rel_error_vs_bf16_weights"] = float((got - exact).norm() / exact.norm())
            x1 = x64[:1].contiguous()
            row["us_bf16_gemv_1row"] = timer.graph([lambda: gemv.gemv(x1, weight)])
            row["us_fp8_gemv_1row"] = timer.graph([lambda: gemv.gemv(x1, quantized.weight, scale=quantized.scale)])

            def scaled_mm_one_row():
                rows_fp8, scale = fp8_gemm.quantize_rows(x1)
                torch._scaled_mm(rows_fp8, quantized.weight.t(), scale_a=scale, scale_b=quantized.scale.view(1, -1),
                                 out_dtype=torch.bfloat16)

            row["us_fp8_scaled_mm_1row"] = timer.graph([scaled_mm_one_row])
            row["us_bf16_linear_64rows"] = timer.graph([lambda: F.linear(x64, weight)])
            row["us_fp8_linear_64rows"] = timer.graph([lambda: fp8_gemm.fp8_linear(x64, quantized)])
            row["fp8_gemv_GBps"] = quantized.nbytes / row["us_fp8_gemv_1row"] / 1e3
        else:  # the smoke run: the reference's error only
            dequantized = fp8.fp8_linear_ref(x64.float(), quantized).double()
            exact = x64.double() @ weight.double().t()
            row["rel_error_vs_bf16_weights"] = float((dequantized - exact).norm() / exact.norm())
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--prompts", type=int, default=256, help="prompts of the accuracy check")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per figure")
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--ratio-prompt", type=int, default=512)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="on the CPU, tiny shape, few prompts: checks the script")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.smoke:
        args.model_config, args.prompts, args.steps, args.long_prompt, args.ratio_prompt = "tiny-llama", 16, 2, 24, 16
        args.device = "cpu"
        torch.cuda.synchronize = lambda *a, **k: None  # engine_decode's timers synchronise the device
        hbm = 10e9  # no figure is read from a smoke run
    else:
        args.device = "cuda"
        hbm = device_copy_bandwidth()
    started = time.perf_counter()
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    gemms = gemm_table(spec, torch.device(args.device), args.smoke)
    bf16, bf16_tokens, bf16_logits = measure_engine(args, "none", "auto", hbm)
    fp8, fp8_tokens, fp8_logits = measure_engine(args, "fp8", "fp8", hbm)
    log_p, log_q = bf16_logits.double().log_softmax(-1), fp8_logits.double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agreement = sum(a == b for a, b in zip(bf16_tokens, fp8_tokens)) / len(bf16_tokens)
    result = {
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__, "model": args.model_config, "weights": "random (--dummy-weights)",
        "adapters": f"{ADAPTERS} distinct rank-{RANK} on all seven projections", "hbm_copy_GBps": hbm / 1e9,
        "accuracy": {"prompts": args.prompts, "first_token_agreement": agreement, "mean_kl": float(kl.mean()),
                     "max_kl": float(kl.max()), "median_kl": float(kl.median()),
                     "note": "fp8 weights + fp8 kv against bf16 on random weights: flat distributions, a weak check"},
        "gemm": gemms,
        "bf16": bf16, "fp8": fp8,
        "batch1_fp8_over_floor": fp8["batch1"]["over_floor"],
        "batch1_fp8_over_bf16": fp8["batch1"]["step_ms"] / bf16["batch1"]["step_ms"],
        "decode_64x1024_fp8_over_bf16": fp8["decode_64x1024"]["lora_tok_s"] / bf16["decode_64x1024"]["lora_tok_s"],
        "kv_capacity_fp8_over_bf16": fp8["kv_capacity_tokens"] / bf16["kv_capacity_tokens"],
        "kv_tokens_per_page_fp8_over_bf16": fp8["kv_tokens_per_page"] / bf16["kv_tokens_per_page"],
        "lora_over_base_512": {"bf16": bf16["lora_over_base_512"]["lora_over_base"],
                               "fp8": fp8["lora_over_base_512"]["lora_over_base"]},
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(result, indent=1))
    print(f"first-token agreement {agreement:.1%}, mean KL {float(kl.mean()):.4f}; batch-1 fp8 step "
          f"{fp8['batch1']['step_ms']:.2f} ms = {result['batch1_fp8_over_floor']:.2f}x floor, "
          f"{result['batch1_fp8_over_bf16']:.2f}x bf16; 64x1024 LoRA decode fp8/bf16 {result['decode_64x1024_fp8_over_bf16']:.2f}x; "
          f"kv capacity {result['kv_capacity_fp8_over_bf16']:.2f}x; lora/base bf16 "
          f"{result['lora_over_base_512']['bf16']:.2f} fp8 {result['lora_over_base_512']['fp8']:.2f}; {result['wall_s']:.0f} s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
