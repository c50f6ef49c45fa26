"""What a request's n choices sharing one prefill saves: one request with `--n` choices against `--n` requests of
the same prompt submitted together (what the API sent before choices shared their prompt), on the engine as
`lorad serve` runs it (7B shape with random weights by default, one adapter of rank `--rank`, CUDA graphs).

For each: the wall time to every choice's first token and to the last token, the prompt tokens the engine
computed (its step account), and the most KV pages in use at once. Usage:
python3 bench/n_choices.py [--n 8] [--prompt 2048] [--tokens 128] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams


def run(engine: Engine, requests: list[GenerationRequest], choices: int) -> dict:
    first_tokens: dict[tuple[str, int], float] = {}

    def on_output(output):
        first_tokens.setdefault((output.request_id, output.choice), time.perf_counter())

    for request in requests:
        request.on_output = on_output
    before = sum(totals.prompt_tokens for totals in engine.account.totals.values())
    peak = [0]
    step = engine.step

    def step_and_measure():
        step()
        peak[0] = max(peak[0], engine.pool.used["kv"])

    engine.step = step_and_measure
    started = time.perf_counter()
    engine.generate(requests)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    done = time.perf_counter()
    engine.step = step
    assert len(first_tokens) == choices and engine.pool.used["kv"] == 0
    return {
        "all_first_tokens_s": round(max(first_tokens.values()) - started, 4),
        "total_s": round(done - started, 4),
        "prompt_tokens_computed": sum(totals.prompt_tokens for totals in engine.account.totals.values()) - before,
        "peak_kv_pages": peak[0],
        "peak_kv_gib": round(peak[0] * engine.pool.occupancy()["page_bytes"] / 2**30, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="llama-2-7b")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (tiny-llama)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("n_choices: no GPU here (--device cpu --model-config tiny-llama tries the script)", file=sys.stderr)
        return 2
    engine = Engine(EngineConfig(model_config=args.model_config, dummy_weights=True, dummy_adapters=1,
                                 dummy_adapter_rank=args.rank, device=args.device, max_running_requests=max(16, args.n),
                                 max_model_len=args.prompt + args.tokens + 16, max_batch_tokens=max(2048, args.prompt)))
    adapter = engine.registry.names()[0]
    prompt = np.random.default_rng(0).integers(3, engine.vocab_size, args.prompt).tolist()
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)

    def shared(tag):
        return [GenerationRequest(prompt, adapter, sampling, request_id=f"shared-{tag}", n=args.n)]

    def separate(tag):
        return [GenerationRequest(prompt, adapter, sampling, request_id=f"separate-{tag}-{i}") for i in range(args.n)]

    run(engine, separate("warm-up"), args.n)
    run(engine, shared("warm-up"), args.n)
    results = {"shared": [], "separate": []}
    for repeat in range(args.repeats):  # ABBA, so a drift in the machine does not favour one
        order = ("shared", "separate") if repeat % 2 == 0 else ("separate", "shared")
        for kind in order:
            requests = shared(repeat) if kind == "shared" else separate(repeat)
            results[kind].append(run(engine, requests, args.n))
    summary = {kind: {key: float(np.median([r[key] for r in runs])) for key in runs[0]} for kind, runs in results.items()}
    report = {"config": vars(args), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "ops": engine.runner.ops.name, "median": summary, "runs": results}
    print(json.dumps(report["median"], indent=1))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
