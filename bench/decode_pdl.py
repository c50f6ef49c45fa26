"""A decode step with its kernels launched early (`decode_pdl`, gpu_ops/launch.py) against the same step in stream
order, side by side in one run on one GPU: two engines of the same random-weights model, `decode_pdl=off` then `on`,
each timing the batch-1 step of the base model (prompt --prompt) and the step of 64 running requests with 64
distinct rank-16 adapters on every projection (prompt --long-prompt: figure 25.3's step), the median of --rounds
runs of --steps steps.

    python3 bench/decode_pdl.py --out OUT.json                                              # bf16
    python3 bench/decode_pdl.py --quantization fp8 --kv-cache-dtype fp8 --out OUT.json      # FP8 weights and KV
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from engine_decode import decode_rate  # bench/engine_decode.py, beside this script

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.model.checkpoint import PROJECTIONS

ADAPTERS = 64


def measure(args, setting: str) -> dict:
    engine = Engine(EngineConfig(
        model_config=args.model_config, dummy_weights=True, dummy_adapters=ADAPTERS, dummy_adapter_rank=16,
        dummy_adapter_targets=",".join(PROJECTIONS), device="cuda", dtype="bfloat16", max_running_requests=ADAPTERS,
        max_lora_rank=64, max_model_len=2048, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        decode_pdl=setting))
    status = engine.status()
    adapters = [f"dummy-{i}" for i in range(ADAPTERS)]
    decode_rate(engine, adapters, args.long_prompt, 8)  # warm-up: an engine's first 64-row run took 1.1-1.2x its next
    one = [decode_rate(engine, [None], args.prompt, args.steps)[1] for _ in range(args.rounds)]
    many = [decode_rate(engine, adapters, args.long_prompt, args.steps)[1] for _ in range(args.rounds)]
    result = {"decode_pdl": status["decode_pdl"], "ops": status["ops"], "batch1_ms": statistics.median(one),
              "batch1_runs_ms": one, "lora64_ms": statistics.median(many), "lora64_runs_ms": many}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    report["off"] = measure(args, "off")
    report["on"] = measure(args, "on")
    report["batch1_on_over_off"] = report["on"]["batch1_ms"] / report["off"]["batch1_ms"]
    report["lora64_on_over_off"] = report["on"]["lora64_ms"] / report["off"]["lora64_ms"]
    print(f"batch-1 step {report['off']['batch1_ms']:.3f} -> {report['on']['batch1_ms']:.3f} ms "
          f"({report['batch1_on_over_off']:.3f}x); 64 adapters x {args.long_prompt} {report['off']['lora64_ms']:.3f} -> "
          f"{report['on']['lora64_ms']:.3f} ms ({report['lora64_on_over_off']:.3f}x)")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
