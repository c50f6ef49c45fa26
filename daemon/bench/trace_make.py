"""`lorad trace make`: a request trace (JSON) from a workload generator of scheduler/workload.py, synthetic
(Poisson, Gamma, serverless) or from the Azure LLM inference trace's CSVs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lorad.daemon.bench.trace_report import print_attribution
from lorad.errors import BadRequest
from lorad.scheduler import workload

AZURE_FILES = {"azure-conv": "azure_llm_inference_2023_conv.csv", "azure-code": "azure_llm_inference_2023_code.csv"}
MAX_REQUESTS = 10_000_000  # a trace of --rate x --duration requests (a trace file of ~250 MB)


def default_data_dir() -> Path:
    """../shared/data next to the repository (this file is daemon/bench/trace_make.py in it), else next to the
    working directory."""
    for base in (Path(__file__).resolve().parents[2], Path.cwd()):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def run(args: argparse.Namespace) -> None:
    """`lorad trace make`: writes the trace and says what it holds."""
    if args.requests is not None and args.kind not in AZURE_FILES:  # the others make --rate x --duration of them
        raise BadRequest(f"--requests is for the azure kinds; {args.kind} makes --rate x --duration requests")
    if args.kind in AZURE_FILES:
        directory = Path(args.data_dir) if args.data_dir else default_data_dir()
        rows = workload.read_azure_csv(directory / AZURE_FILES[args.kind])
        trace = workload.azure_workload(
            rows, args.adapters, rate=args.rate, num_requests=args.requests,
            popularity=args.popularity.replace("-", "_"), alpha=args.alpha, sigma=args.sigma,
            ranks=args.ranks, seed=args.seed,
        )
        if args.duration is not None:
            trace.requests = [r for r in trace.requests if r.arrival_s < args.duration]
            used = {r.adapter for r in trace.requests}
            trace.adapter_ranks = {name: rank for name, rank in trace.adapter_ranks.items() if name in used}
            trace.source["duration_s"] = args.duration
    else:
        rate = 10.0 if args.rate is None else args.rate
        duration = 60.0 if args.duration is None else args.duration
        if not 0 < rate * duration <= MAX_REQUESTS:
            raise BadRequest(f"--rate x --duration is {rate * duration:g} requests; "
                             f"a trace holds at most {MAX_REQUESTS:,}")
        lengths = workload.UniformLengths(tuple(args.prompt_len), tuple(args.output_len))
        common = {"lengths": lengths, "ranks": args.ranks, "seed": args.seed}
        if args.kind == "poisson":
            trace = workload.poisson_workload(args.adapters, rate, duration, alpha=args.alpha, **common)
        elif args.kind == "gamma":
            trace = workload.gamma_workload(args.adapters, rate, duration, alpha=args.alpha, cv=args.cv, **common)
        else:
            trace = workload.serverless_workload(args.adapters, rate, duration, sigma=args.sigma, **common)
    if not trace.requests:
        raise BadRequest("the trace has no requests (raise --rate or --duration)")
    trace.save(args.out)
    print(f"wrote {args.out}: {len(trace.requests)} requests over {trace.duration_s:.1f} s "
          f"({trace.requests_per_s:.1f} req/s), {len(trace.adapter_ranks)} adapters used of {args.adapters}, "
          f"kind {args.kind}")
    print_attribution(trace)
