"""Decode with adapters on Phi-3's fused modules (qkv_proj, gate_up_proj) against the base model alone, in one
run on one GPU: the A of a fused module shared by its members in the pool (how lorad loads such adapters) beside
the same adapters with a separate A per member, which issues the same reads from distinct pages.

Both issue one shrink per member (A read 3 times for qkv_proj, twice for gate_up_proj); a kernel projection whose
out-dim is the sum would read it once. If the shared run is as fast as the floor of the fused bytes allows and
faster than the copies, the repeated reads of the same pages are served from L2 (daemon/model/adapters.py,
module_members, says why lorad holds fused modules this way).

    python3 bench/fused_lora_decode.py --model-config phi-3-mini --out bench/results/fused_lora_decode.json
"""

from __future__ import annotations

import argparse
import json

import torch

from engine_decode import decode_rate, device_copy_bandwidth  # bench/, run as a script

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.model.checkpoint import FUSED_MODULES, PROJECTIONS, MODEL_CONFIGS, ModelSpec

FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def lora_elements(spec: ModelSpec, rank: int, fused_reads: bool) -> int:
    """A and B elements one adapter on every module moves per decode step: A once per fused module (a kernel
    projection whose out-dim is the sum) or once per member (what the per-member shrinks issue)."""
    per_layer = 0
    for module in FUSED_TARGETS:
        in_features, out_features = spec.module_shape(module)
        reads = 1 if fused_reads else len(FUSED_MODULES.get(module, (module,)))
        per_layer += rank * (reads * in_features + out_features)
    return spec.num_layers * per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="phi-3-mini")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()

    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    if not spec.fused_projections:
        parser.error(f"{args.model_config} has no fused modules (a Phi3ForCausalLM shape: phi-3-mini, phi-4)")
    hbm = device_copy_bandwidth()
    runs = {}
    for name, targets in (("shared_a", ",".join(FUSED_TARGETS)), ("separate_a", ",".join(PROJECTIONS))):
        engine = Engine(EngineConfig(
            model_config=args.model_config, dummy_weights=True, dummy_adapters=args.batch, dummy_adapter_rank=args.rank,
            dummy_adapter_targets=targets, device="cuda", dtype="bfloat16", max_running_requests=args.batch,
            max_batch_tokens=max(2048, args.batch * args.prompt), max_lora_rank=max(64, args.rank),
            max_model_len=min(2047, args.prompt + args.steps + 16),
        ))
        base_rate, base_ms = decode_rate(engine, [None] * args.batch, args.prompt, args.steps)
        lora_rate, lora_ms = decode_rate(engine, [f"dummy-{i}" for i in range(args.batch)], args.prompt, args.steps)
        runs[name] = {"base_tok_s": base_rate, "lora_tok_s": lora_rate, "lora_over_base": lora_rate / base_rate,
                      "base_step_ms": base_ms, "lora_step_ms": lora_ms, "lora_ms_over_base": lora_ms - base_ms,
                      "ops": engine.runner.ops.name}
        engine.close()
        del engine
        torch.cuda.empty_cache()
    fused_bytes = 2 * args.batch * lora_elements(spec, args.rank, fused_reads=True)
    issued_bytes = 2 * args.batch * lora_elements(spec, args.rank, fused_reads=False)
    result = {
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model_config,
        "batch": args.batch, "rank": args.rank, "prompt": args.prompt, "steps": args.steps, "hbm_copy_GBps": hbm / 1e9,
        # the adapters' bytes a step must move with A read once per fused module, and as the kernels issue them
        "lora_bytes_fused": fused_bytes, "lora_bytes_issued": issued_bytes,
        "lora_floor_ms_fused": fused_bytes / hbm * 1e3, "lora_floor_ms_issued": issued_bytes / hbm * 1e3,
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
