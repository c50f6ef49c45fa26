"""`lorad simulate`: N simulated engines serve a trace under each routing policy (and admission policy),
timed by the performance models of a profile (scheduler/simulator.py); no daemon, no GPU.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from lorad.daemon.bench.trace_report import format_table, plot_cdfs, print_attribution, quantiles, write_json
from lorad.errors import BadRequest
from lorad.scheduler.admission import make_admission
from lorad.scheduler.perf_model import NOT_MEASURED, profile_for
from lorad.scheduler.router import FirstFit, MostIdle, Random, RankAware
from lorad.scheduler.simulator import SimConfig, objectives_for, simulate
from lorad.scheduler.workload import Trace

log = logging.getLogger(__name__)

POLICIES = ("rank-aware", "most-idle", "first-fit", "random")


def run(args: argparse.Namespace) -> None:
    """`lorad simulate`: each policy (and admission) over the trace; prints the table, writes the report."""
    if args.engines < 1 or args.max_running < 1:
        raise BadRequest("--engines and --max-running must be at least 1")
    trace = Trace.load(args.trace)
    if not trace.requests:
        raise BadRequest(f"the trace {args.trace} has no requests")
    profile = profile_for(args.profile, args.kernel)
    measured = bool(profile.machine.get("measured")) and args.profile is not None
    profile_note = (f"profile {args.profile}: {profile.machine}, decode kernel {profile.decode.lora.kernel}" if args.profile
                    else f"profile: example ({profile.decode.lora.kernel})")
    if not measured:
        profile_note += f" -- {NOT_MEASURED}"
    print(profile_note)
    config = SimConfig(
        num_engines=args.engines, max_running=args.max_running, max_prefill_tokens=args.max_prefill_tokens,
        slo_tpot_s=args.slo_tpot_s, slo_ttft_s=args.slo_ttft_s, slo_scale=args.slo_scale,
        tpot_admission=args.tpot_admission,
    )
    objectives = objectives_for(trace, profile, config)
    average_output = float(np.mean([max(1, r.output_tokens) for r in trace.requests]))
    print(f"trace {args.trace}: {len(trace.requests)} requests, {len(trace.adapter_ranks)} adapters, "
          f"{trace.requests_per_s:.1f} req/s over {trace.duration_s:.1f} s; {args.engines} engines; "
          f"objectives: TTFT {objectives.ttft_s * 1e3:.1f} ms, time per token {objectives.tpot_s * 1e3:.2f} ms")
    print_attribution(trace)

    def policy(name: str):
        return {
            "rank-aware": lambda: RankAware(profile.decode, profile.prefill, objectives.tpot_s, average_output),
            "most-idle": MostIdle,
            "first-fit": FirstFit,
            "random": lambda: Random(seed=args.seed),
        }[name]()

    names = POLICIES if args.policy == "all" else (args.policy,)
    admissions = ("fcfs", "early-abort") if args.admission == "both" else (args.admission,)
    results, summaries = [], []
    for admission_name in admissions:
        for name in names:
            admission = make_admission(admission_name, profile.prefill, args.cluster)
            start = time.perf_counter()
            result = simulate(trace, profile, policy(name), config, admission=admission)
            elapsed = time.perf_counter() - start
            summary = result.summary()
            summary["simulated_in_s"] = elapsed
            summary["cdf"] = {"tpot_s": quantiles(result.tpot_s[~result.dropped]),
                              "ttft_s": quantiles(result.ttft_s[~result.dropped]),
                              "latency_s": quantiles(result.latency_s[~result.dropped])}
            log.info("simulated policy=%s admission=%s requests=%d seconds=%.1f", summary["policy"],
                     summary["admission"], summary["requests"], elapsed)
            results.append(result)
            summaries.append(summary)
    print(format_table(summaries))
    if args.out:
        report = {
            "version": 1,
            "kind": "simulation",
            "command": "lorad " + " ".join(args.argv),
            "profile": {"path": args.profile, "kernel": profile.decode.lora.kernel, "machine": profile.machine,
                        "measured": measured, "note": None if measured else NOT_MEASURED},
            "trace": {"path": args.trace, "requests": len(trace.requests), "adapters": len(trace.adapter_ranks),
                      "source": trace.source},
            "config": asdict(config),
            "objectives": asdict(objectives),
            "cluster": args.cluster,
            "results": summaries,
        }
        if "attribution" in trace.source:
            report["attribution"] = trace.source["attribution"]
        write_json(args.out, report)
        print(f"wrote {args.out}")
        plot_cdfs(summaries, Path(args.out).with_suffix(".png"), objectives.tpot_s,
                  note="example profile, NOT MEASURED" if not measured else "")
