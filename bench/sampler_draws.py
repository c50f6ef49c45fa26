"""The sampler's draws on the device against an earlier sampler.py: `sample()` over 64 and 256 rows of 32000 and
128256 logits, each row drawn with a temperature (plain, top-p, seeded top-k) or greedy; wall time a call with the
device drained (the median of 7), every row the same parameters.

    python3 bench/sampler_draws.py --out OUT.json [--baseline OLD_SAMPLER.py]

--baseline: `git show REV:daemon/engine/sampler.py > OLD.py` (its own `make_generator` and `sample`), timed beside
this one. On the CPU it runs the same cases (no figure to quote).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from timing import load_module_file  # bench/, beside this script

from lorad.daemon.engine import sampler
from lorad.daemon.engine.request import SamplingParams

CASES = (("temperature 1", SamplingParams(temperature=1.0)),
         ("temperature 0.8 top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95)),
         ("seeded, top_k 50", SamplingParams(temperature=0.7, top_k=50, seed=3)),
         ("greedy", SamplingParams(temperature=0)))


def median_ms(module, logits: torch.Tensor, params: SamplingParams, device: torch.device) -> float:
    rows = logits.shape[0]
    generators = [module.make_generator(params) for _ in range(rows)]
    module.sample(logits.clone(), [params] * rows, generators)  # warm: compiles, allocates
    times = []
    for _ in range(7):
        x = logits.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        module.sample(x, [params] * rows, generators)  # returns host ints: the device has drained
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--baseline", help="an earlier daemon/engine/sampler.py, timed beside this one")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    modules = {"current": sampler}
    if args.baseline:
        modules["baseline"] = load_module_file(args.baseline, "sampler_baseline")
    results = []
    for rows in (64, 256):
        for vocab in (32000, 128256):
            logits = torch.randn(rows, vocab, device=device) * 3
            for label, params in CASES:
                entry = {"rows": rows, "vocab": vocab, "params": label}
                for name, module in modules.items():
                    entry[f"{name}_ms"] = round(median_ms(module, logits, params, device), 3)
                print(entry, flush=True)
                results.append(entry)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "baseline": args.baseline, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
