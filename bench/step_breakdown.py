"""Where a served step's time goes: the engine's own forward (its CUDA graphs and ops, as `lorad serve` runs
them) on the steps a saturated trace makes, timed and broken down by kernel, beside each step's floor from
the engine's account (daemon/engine/step_cost.py).

Steps (7B shape by default, `--running` sequences each with its own adapter of rank `--rank`, every context
`--context` tokens):
- decode: every running sequence adds one token;
- mixed: the same decode rows but one, beside one `--prompt`-token prompt with an adapter (what a saturated
  engine runs whenever a request ends and the next one takes its place);
- prefill: the prompt alone;
- with `--prompt-adapters N`: one prompt step of `--prompt` tokens over N prompts, each with its own adapter, and the
  same step for the base model alone (figure 21.5: `--prompt 2048 --prompt-adapters 8`).

Each is timed as the engine runs it (runner.forward on a StepPlan, graph replays, the host filling their
buffers included; CUDA events around `--reps` runs after a warm-up), then once under torch.profiler for its
kernels by name. Usage: python3 bench/step_breakdown.py [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.errors import BadRequest
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.step_cost import SequenceInStep
from lorad.daemon.engine.step_plan import StepPlan
from lorad.gpu_ops.page_pool import BlockList


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, help="the engine's max_lora_rank, the rank its prefill graphs' "
                                                          "LoRA kernels are launched for (default: the config's)")
    parser.add_argument("--prompt-adapters", type=int, default=0,
                        help="also a prompt step of --prompt tokens split over this many prompts, each with its own "
                             "adapter, and the same step for the base model alone (figure 21.5)")
    parser.add_argument("--quantization", default="auto", help="the engine's --quantization (fp8: FP8 weights)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype (fp8: FP8 KV pages)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any other EngineConfig field as lorad.toml's [engine] takes it, e.g. lora_pdl=off, "
                             "fuse_lora_groups=false or pool_bytes=20GiB; repeatable")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (with --model-config tiny-llama; no kernels)")
    parser.add_argument("--out")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("step_breakdown: no GPU here (--device cpu --model-config tiny-llama tries the script on the torch references)", file=sys.stderr)
        return 2
    try:
        overrides = config_overrides(args.set)
    except (ValueError, BadRequest) as error:
        print(f"step_breakdown: {error}", file=sys.stderr)
        return 2
    engine = Engine(EngineConfig(model_config=args.model_config, dummy_weights=True, dummy_adapters=args.running + 1,
                                 dummy_adapter_rank=args.rank, device=args.device, max_running_requests=args.running,
                                 max_model_len=max(args.context, args.prompt) + 16,
                                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                                 **({"max_lora_rank": args.max_lora_rank} if args.max_lora_rank else {}), **overrides))
    names = engine.registry.names()[: args.running + 1]
    for name in names:
        assert engine.residency.preload(name), "the adapters fit in the pool"
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size

    def blocks_for(tokens: int) -> BlockList:
        blocks = BlockList()
        assert engine.kv.grow(blocks, tokens)
        return blocks

    decode_rows = [(rng.integers(0, vocab, size=1), args.context - 1, names[i], blocks_for(args.context), True)
                   for i in range(args.running)]
    prompt = (rng.integers(0, vocab, size=args.prompt), 0, names[args.running], blocks_for(args.prompt), True)
    steps = {"decode": decode_rows, "mixed": decode_rows[:-1] + [prompt], "prefill": [prompt]}
    if args.prompt_adapters:  # one prompt step of --prompt tokens over that many prompts, each with its own adapter, and alone
        share = args.prompt // args.prompt_adapters
        prompts = [(rng.integers(0, vocab, size=share), 0, names[i], blocks_for(share), True) for i in range(args.prompt_adapters)]
        steps[f"prefill, {args.prompt_adapters} adapters"] = prompts
        steps["prefill, base model"] = [(tokens, start, None, blocks, sample) for tokens, start, _, blocks, sample in prompts]

    def plan_of(rows) -> StepPlan:
        tokens, starts, adapters, blocks, sample = zip(*rows)
        # The lists themselves, as the engine's plans carry them: a replay sends each table row only what it lacks
        return StepPlan(list(tokens), np.array(starts), np.array([engine.residency.slot(a) for a in adapters]),
                        [b.array() for b in blocks], np.array(sample), lists=list(blocks))

    rates = engine.account.rates
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "args": vars(args),
              "rates": {"hbm_gb_s": rates.bandwidth_bytes_per_s / 1e9, "gemm_tflop_s": rates.flops_per_s / 1e12},
              "lora_kernel_choice": engine.kernel_choice.describe(), "steps": {}}
    for kind, rows in steps.items():
        plan = plan_of(rows)
        before = (engine.runner.graph_steps, engine.runner.prefill_graph_steps)

        def run(plan=plan):
            engine.runner.forward(plan)

        for _ in range(3):
            run()
        ms = timed_ms(run, args.reps, cuda)
        path = ("decode graph" if engine.runner.graph_steps > before[0] else
                "prefill graph" if engine.runner.prefill_graph_steps > before[1] else "eager")
        cost = engine.account.cost_model.cost([SequenceInStep(len(t), s + len(t), True, a) for t, s, a, _, _ in rows])
        memory_ms, compute_ms = cost.bytes / rates.bandwidth_bytes_per_s * 1e3, cost.flops / rates.flops_per_s * 1e3
        serial_ms = cost.serial_floor_s(rates.bandwidth_bytes_per_s, rates.flops_per_s) * 1e3
        kernels = kernel_times(run) if cuda else {}
        graph_rows = engine.runner.graph_rows or int(plan.num_tokens)  # None: eager, its own rows
        report["steps"][kind] = {"path": path, "ms": ms, "floor_ms": max(memory_ms, compute_ms), "memory_ms": memory_ms,
                                 "compute_ms": compute_ms, "serial_floor_ms": serial_ms, "rows": int(plan.num_tokens), "graph_rows": graph_rows,
                                 "padding_rows": graph_rows - int(plan.num_tokens), "kernels_ms": kernels,
                                 "graph_key": list(engine.runner.prefill_graphs.last_key) if path == "prefill graph" else None,
                                 # the decode graph replayed: (bucket, LoRA kernel, launch rank, targets); the kernel is
                                 # the one a profile at the default path picks (report["lora_kernel_choice"])
                                 "decode_graph_key": list(engine.runner.graphs.last_key) if path == "decode graph" else None}
        print(f"{kind}: {ms:.2f} ms ({path}), floor {max(memory_ms, compute_ms):.2f} ms "
              f"(memory {memory_ms:.2f}, compute {compute_ms:.2f}; serial {serial_ms:.2f}), {plan.num_tokens} rows in "
              f"{graph_rows}")
        for name, kernel_ms in list(kernels.items())[:12]:
            print(f"    {kernel_ms:8.3f} ms  {name}")
    engine.close()
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)
    return 0


def config_overrides(pairs: list[str]) -> dict:
    """--set FIELD=VALUE pairs as EngineConfig keywords: each value read as a TOML value where it is one (false, 64),
    else as a string (off, 20GiB), then typed and checked as lorad.toml's [engine] table."""
    import tomllib

    from lorad.daemon.server.settings import engine_values

    table = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--set takes FIELD=VALUE, got {pair!r}")
        try:
            table[name] = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            table[name] = text
    return engine_values(table, "--set")


def timed_ms(run, reps: int, cuda: bool) -> float:
    """Mean ms of one run() over `reps` back to back (CUDA events on a GPU)."""
    if not cuda:
        import time

        began = time.perf_counter()
        for _ in range(reps):
            run()
        return (time.perf_counter() - began) / reps * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def kernel_times(run) -> dict[str, float]:
    """Device time of one run() by kernel name, ms, largest first (torch.profiler sees inside graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us:
            times[event.key[:90]] = times.get(event.key[:90], 0.0) + device_us / 1e3
    return dict(sorted(times.items(), key=lambda item: -item[1]))


if __name__ == "__main__":
    sys.exit(main())
