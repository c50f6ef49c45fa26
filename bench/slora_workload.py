"""S-LoRA's synthetic workload on lorad (BENCHMARKS.md, figure 3.6): throughput as the number of adapters grows.

Adapter popularity is a power law (alpha = 1), arrivals per adapter Gamma with cv = 1, prompt and output
lengths uniform in [8, 512]; adapters on q, k, v, o. S1: every adapter rank 8; S2: ranks 64/32/16/8
round robin. The arrival rate is set above what the engine serves, so the throughput measured is its
capacity. One engine (7B shape, random weights) holds every adapter in host memory; between runs its
pool is emptied of adapters so each run starts cold.

    python3 bench/slora_workload.py --out bench/results/slora_workload.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.daemon.model.adapters import LoraAdapter
from lorad.daemon.model.checkpoint import PROJECTIONS
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.scheduler.workload import Trace, UniformLengths, gamma_workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def register(engine: Engine, prefix: str, count: int, ranks: list[int]) -> list[str]:
    """count random adapters in host memory, ranks round robin; a few weight sets per rank are shared
    (each adapter still has its own name, pool pages and host->GPU load)."""
    spec = engine.spec
    generator = torch.Generator().manual_seed(len(prefix))
    sets = {}
    for rank in sorted(set(ranks)):
        sets[rank] = []
        for _ in range(2):
            weights = {}
            for layer in range(spec.num_layers):
                for projection in TARGETS:
                    fan_in, fan_out = spec.projection_shape(projection)
                    weights[(layer, PROJECTIONS.index(projection))] = (
                        torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5,
                        torch.randn(fan_out, rank, generator=generator) * (0.5 / rank),
                    )
            sets[rank].append(weights)
    names = []
    for index in range(count):
        rank = ranks[index % len(ranks)]
        weights = sets[rank][index % 2]
        name = f"{prefix}-{index:04d}"
        engine.registry.add_in_memory(LoraAdapter(
            name=name, path="<memory>", rank=rank, targets=TARGETS, weights=weights,
            nbytes=sum(a.nbytes + b.nbytes for a, b in weights.values()), scaling={key: 1.0 for key in weights},
        ))
        names.append(name)
    return names


LENGTHS_SEED = 777  # the one sequence of request lengths every run serves (unless --trace-lengths)


def slora_trace(num_adapters: int, ranks: list[int], num_requests: int, rate: float, seed: int,
                lengths_seed: int | None = LENGTHS_SEED) -> Trace:
    """The first `num_requests` arrivals of the Gamma trace of `seed` (S-LoRA's: alpha 1, cv 1, lengths
    U[8, 512]). With `lengths_seed`, the i-th request's prompt and output lengths come from that seed
    instead of the trace's, so runs with different adapter counts serve the same sequence of lengths
    and differ only in arrivals and adapters. bench/peft_baseline.py serves the same requests."""
    trace = gamma_workload(num_adapters, rate, 2.0 * num_requests / rate, alpha=1.0, cv=1.0, lengths=UniformLengths(),
                           ranks=ranks, seed=seed)
    requests = trace.requests[:num_requests]
    if len(requests) < num_requests:
        raise RuntimeError(f"the trace of seed {seed} holds {len(requests)} requests, fewer than {num_requests}")
    if lengths_seed is not None:
        prompts, outputs = UniformLengths().sample(num_requests, np.random.default_rng(lengths_seed))
        requests = [dataclasses.replace(request, prompt_tokens=int(p), output_tokens=int(o))
                    for request, p, o in zip(requests, prompts, outputs)]
    trace.requests = requests
    return trace


def replay(engine: Engine, names: list[str], ranks: list[int], num_requests: int, rate: float, seed: int,
           lengths_seed: int | None = LENGTHS_SEED) -> dict:
    """One run of `slora_trace`'s requests, arriving in real time, on `engine`."""
    trace = slora_trace(len(names), ranks, num_requests, rate, seed, lengths_seed)
    requests = trace.requests
    index = {name: i for i, name in enumerate(sorted(trace.adapter_ranks))}
    engine.residency.reclaim(engine.pool.capacity)  # start cold: no adapter in the pool
    generator = torch.Generator().manual_seed(seed)
    finished, first_token, generated = {}, {}, {}

    def on_output(output):
        now = time.perf_counter()
        if output.new_token_ids and output.request_id not in first_token:
            first_token[output.request_id] = now
        generated[output.request_id] = generated.get(output.request_id, 0) + len(output.new_token_ids)
        if output.finished:
            finished[output.request_id] = now

    started = time.perf_counter()
    arrivals = {}
    pending = list(enumerate(requests))
    while pending or engine.scheduler.has_work():
        now = time.perf_counter() - started
        while pending and pending[0][1].arrival_s <= now:
            number, request = pending.pop(0)
            prompt = torch.randint(0, engine.vocab_size, (request.prompt_tokens,), generator=generator).tolist()
            request_id = f"r{number}"
            arrivals[request_id] = started + request.arrival_s
            engine.submit(GenerationRequest(
                prompt, adapter=names[index[request.adapter]], request_id=request_id, on_output=on_output,
                sampling=SamplingParams(max_tokens=request.output_tokens, temperature=0, ignore_eos=True),
            ))
        if engine.scheduler.has_work() or engine._inbox:
            engine.step()
        else:
            time.sleep(0.0005)
    elapsed = max(finished.values()) - started
    ttft = [first_token[r] - arrivals[r] for r in finished]
    return {
        "adapters": len(names), "requests": len(finished), "seconds": elapsed,
        "throughput_req_s": len(finished) / elapsed, "tokens_s": sum(generated.values()) / elapsed,
        "ttft_s_mean": statistics.mean(ttft), "adapter_loads": engine.residency.loads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--s1", default="5,100,1000,2000", help="adapter counts of S1 (rank 8)")
    parser.add_argument("--s2", default="5,100,500", help="adapter counts of S2 (ranks 64/32/16/8)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup-requests", type=int, default=48, help="requests of the unreported warm-up run")
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second (above capacity)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trace-lengths", action="store_true",
                        help="each run's lengths from its own trace (the second to fourth sessions' runs; default: "
                             "every run serves the same sequence of lengths, so runs differ only in adapters)")
    parser.add_argument("--out")
    args = parser.parse_args()
    s1, s2 = [int(n) for n in args.s1.split(",")], [int(n) for n in args.s2.split(",")]
    engine = Engine(EngineConfig(
        model_config=args.model_config, dummy_weights=True, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_running_requests=128, max_batch_tokens=4096, max_lora_rank=64, max_model_len=1100,
    ))
    s1_names = register(engine, "s1", max(s1), [8])
    s2_names = register(engine, "s2", max(s2), [64, 32, 16, 8])
    # Warm-up, not reported: the engine's first traffic compiles kernels and fills caches, which would
    # slow whichever run came first (the n=5 baseline).
    warm = replay(engine, s2_names[:5], [64, 32, 16, 8], args.warmup_requests, args.rate, seed=12345)
    print(json.dumps({"warmup": warm}))
    runs = []
    for setting, counts, names, ranks in (("S1", s1, s1_names, [8]), ("S2", s2, s2_names, [64, 32, 16, 8])):
        for count in counts:
            result = {"setting": setting, **replay(engine, names[:count], ranks, args.requests, args.rate, seed=count,
                                                   lengths_seed=None if args.trace_lengths else LENGTHS_SEED)}
            print(json.dumps(result))
            runs.append(result)
    for setting in ("S1", "S2"):
        mine = [r for r in runs if r["setting"] == setting]
        print(f"{setting}: throughput at n={mine[-1]['adapters']} is {mine[-1]['throughput_req_s'] / mine[0]['throughput_req_s']:.3f}x n={mine[0]['adapters']}")
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"machine": machine, "model": args.model_config, "ops": engine.runner.ops.name,
              "requests_per_run": args.requests, "rate": args.rate, "warmup": warm, "runs": runs,
              "lengths": "each run's own trace" if args.trace_lengths else f"one sequence for every run (seed {LENGTHS_SEED})"}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
