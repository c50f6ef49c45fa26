"""A decode step with its kernels launched early (`decode_pdl`, gpu_ops/launch.py) against the same step in stream
order, side by side in one run on one GPU: two engines of the same random-weights model, `decode_pdl=off` then `on`,
each timing the batch-1 step of the base model (prompt --prompt) and the steps of 16 and of 64 running requests
with as many distinct rank-16 adapters on every projection (prompt --long-prompt; 64 rows is figure 25.3's step),
the median of --rounds runs of --steps steps.

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
        max_batch_tokens=8192, max_lora_rank=64, max_model_len=2048, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, decode_pdl=setting))
    status = engine.status()
    result = {"decode_pdl": status["decode_pdl"], "ops": status["ops"]}
    for rows in (1, 16, ADAPTERS):
        adapters = [None] if rows == 1 else [f"dummy-{i}" for i in range(rows)]
        runs = [decode_rate(engine, adapters, args.prompt if rows == 1 else args.long_prompt, args.steps)[1]
                for _ in range(args.rounds)]
        result[f"rows{rows}_ms"], result[f"rows{rows}_runs_ms"] = statistics.median(runs), runs
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
    for rows in (1, 16, ADAPTERS):
        report[f"rows{rows}_on_over_off"] = report["on"][f"rows{rows}_ms"] / report["off"][f"rows{rows}_ms"]
    print("; ".join(f"{rows} rows {report['off'][f'rows{rows}_ms']:.3f} -> {report['on'][f'rows{rows}_ms']:.3f} ms "
                    f"({report[f'rows{rows}_on_over_off']:.3f}x)" for rows in (1, 16, ADAPTERS)))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
