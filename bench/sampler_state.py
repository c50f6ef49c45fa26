"""The sampler's logits processing per decode step, alone: rebuilt from every row's whole history (sampler.py's
`process_logits`, the reference) against each sequence's state kept on the device (sampler_state.py: `process`,
then `advance` with the step's tokens), and the logprobs of the step both ways (`logprobs_of`, which reads them
on the host at once, against `LogprobCopies`, whose copy is read afterwards). Rows carry every control at once, as
bench/engine_decode.py --sampler-overhead sends them.

    python3 bench/sampler_state.py --rows 64 --prompt 512 --steps 48 --vocab 32000 [--device cuda]

The state's time is `process` plus `advance`; the argmax between them, which both ways need, is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lorad.daemon.engine.request import SamplingParams
from lorad.daemon.engine.sampler import History, LogprobCopies, logprobs_of, process_logits
from lorad.daemon.engine.sampler_state import SamplerState

PROCESSED = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                 logit_bias=tuple((token, 5.0) for token in range(0, 8000, 1000)), logprobs=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch's cpu threads (1: no spinning on a busy host)")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0, max_tokens=args.steps + 1, **PROCESSED)] * args.rows
    prompts = torch.randint(0, args.vocab, (args.rows, args.prompt), generator=generator).tolist()
    logits = [torch.randn(args.rows, args.vocab, generator=generator).to(device) for _ in range(4)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Both ways see the same tokens: the reference's argmax, step by step.
    outputs: list[list[int]] = [[] for _ in range(args.rows)]
    reference = {"process_ms": [], "logprobs_ms": []}
    for step in range(args.steps):
        step_logits = logits[step % len(logits)].clone()
        sync()
        started = time.perf_counter()
        process_logits(step_logits, params, [History(prompt, output) for prompt, output in zip(prompts, outputs)])
        sync()
        reference["process_ms"].append((time.perf_counter() - started) * 1e3)
        tokens = step_logits.argmax(dim=-1).tolist()
        started = time.perf_counter()
        logprobs_of(step_logits, params, tokens)
        reference["logprobs_ms"].append((time.perf_counter() - started) * 1e3)
        for output, token in zip(outputs, tokens):
            output.append(token)

    state = SamplerState(args.vocab, device, max_banned=1)
    keys = list(range(args.rows))
    state.admit((key, p, History(prompt, [])) for key, p, prompt in zip(keys, params, prompts))
    copies = LogprobCopies(args.rows, pin=device.type == "cuda")
    incremental = {"process_ms": [], "logprobs_ms": []}
    rows = list(range(args.rows))
    for step in range(args.steps):
        step_logits = logits[step % len(logits)].clone()
        sync()
        started = time.perf_counter()
        processed = state.process(step_logits, rows, keys)
        sync()
        elapsed = time.perf_counter() - started
        tokens = step_logits.argmax(dim=-1)
        sync()
        started = time.perf_counter()
        state.advance(processed, tokens)
        sync()
        incremental["process_ms"].append((elapsed + time.perf_counter() - started) * 1e3)  # process and advance
        started = time.perf_counter()
        copies.launch(step_logits, params, tokens).read()
        incremental["logprobs_ms"].append((time.perf_counter() - started) * 1e3)
        if tokens.tolist() != [output[step] for output in outputs]:
            raise AssertionError(f"step {step}: the state's tokens are not the reference's")

    result = {"device": str(device), "rows": args.rows, "prompt": args.prompt, "steps": args.steps, "vocab": args.vocab,
              "threads": torch.get_num_threads(), "processed": {k: str(v) for k, v in PROCESSED.items()}}
    for name, times in (("reference", reference), ("state", incremental)):
        result[name] = {key: statistics.median(values) for key, values in times.items()}
    result["process_speedup"] = result["reference"]["process_ms"] / result["state"]["process_ms"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
