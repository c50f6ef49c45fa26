"""The workload side of the `lorad` command: `trace make` writes a request trace, `simulate` runs it through
N simulated engines under each routing policy, `bench trace` replays it against a running daemon.
`simulate` and `bench trace` print the same table and write a JSON report. `bench load|invoke|ipc|
cpu-lora|cold-start` are the cold-start microbenchmarks, run in this process (daemon/bench_*.py).
daemon/server/cli.py hands them `bench_main(argv)`.

Exit codes: 0 done, 1 no daemon answers on the socket, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from lorad.daemon.server.cli_args import Parser, parse

from lorad.config import ServerConfig
from lorad.errors import LoradError, Overloaded

log = logging.getLogger(__name__)

COMMANDS = ("simulate", "bench", "trace")
OK, UNREACHABLE, REFUSED = 0, 1, 2
TRACE_KINDS = ("poisson", "gamma", "serverless", "azure-conv", "azure-code")
AZURE_FILES = {"azure-conv": "azure_llm_inference_2023_conv.csv", "azure-code": "azure_llm_inference_2023_code.csv"}
POLICIES = ("rank-aware", "most-idle", "first-fit", "random")
NOT_MEASURED = "NOT MEASURED: the example profile's illustrative coefficients (scheduler/perf_model.py), not this machine's"
CDF_POINTS = 201  # quantiles kept per metric in the JSON report


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return values


def _range(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, not {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lorad", description="Make request traces, simulate them, replay them against a daemon.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    trace = commands.add_parser("trace", help="make a request trace")
    trace_actions = trace.add_subparsers(dest="action", required=True, parser_class=Parser)
    make = trace_actions.add_parser("make", help="write a trace (JSON) from a workload generator")
    make.add_argument("--kind", choices=TRACE_KINDS, required=True,
                      help="poisson: one Poisson stream, Zipf(alpha) adapters; gamma: S-LoRA's per-adapter Gamma "
                           "arrivals of cv; serverless: skewed on/off per-adapter traffic (MAF-like); azure-conv, "
                           "azure-code: the Azure LLM inference trace 2023 (CC BY 4.0) arrivals and lengths")
    make.add_argument("--adapters", type=int, default=100, metavar="N", help="distinct adapters (default: 100)")
    make.add_argument("--alpha", type=float, default=1.0, metavar="A", help="Zipf exponent of popularity (default: 1)")
    make.add_argument("--cv", type=float, default=1.0, metavar="C", help="gamma: coefficient of variation (default: 1)")
    make.add_argument("--sigma", type=float, default=2.5, metavar="S",
                      help="serverless (and --popularity serverless): log-normal spread (default: 2.5)")
    make.add_argument("--rate", type=float, metavar="R",
                      help="requests per second, all adapters together (azure: rescales its arrivals; "
                           "default: 10, azure: as recorded)")
    make.add_argument("--duration", type=float, metavar="S", help="seconds of arrivals (default: 60; azure: all)")
    make.add_argument("--requests", type=int, metavar="N", help="azure: the first N rows (default: all)")
    make.add_argument("--popularity", choices=("power-law", "serverless"), default="power-law",
                      help="azure: how adapters are drawn for its requests (default: power-law)")
    make.add_argument("--ranks", type=_int_list, default=(8, 16, 32, 64), metavar="R,R,...",
                      help="LoRA ranks, assigned round robin over adapters (default: 8,16,32,64)")
    make.add_argument("--prompt-len", type=_range, default=(8, 512), metavar="LOW,HIGH",
                      help="synthetic kinds: prompt tokens, uniform (default: 8,512)")
    make.add_argument("--output-len", type=_range, default=(8, 512), metavar="LOW,HIGH",
                      help="synthetic kinds: output tokens, uniform (default: 8,512)")
    make.add_argument("--seed", type=int, default=0, metavar="N")
    make.add_argument("--data-dir", metavar="DIR",
                      help="where the Azure CSVs are (default: ../shared/data relative to the repository)")
    make.add_argument("--out", required=True, metavar="PATH")

    simulate = commands.add_parser("simulate", help="simulate N engines serving a trace under routing policies")
    simulate.add_argument("--trace", required=True, metavar="PATH")
    simulate.add_argument("--engines", type=int, default=60, metavar="N", help="(default: 60)")
    simulate.add_argument("--policy", choices=POLICIES + ("all",), default="all", help="(default: all)")
    simulate.add_argument("--admission", choices=("fcfs", "early-abort", "both"), default="fcfs",
                          help="which queued requests a prefill step takes (default: fcfs)")
    simulate.add_argument("--cluster", type=int, metavar="D",
                          help="adapter clustering: prefer the running batch's adapters once it holds D")
    simulate.add_argument("--profile", metavar="PATH",
                          help="performance models from `lorad profile` (default: the example profile, NOT MEASURED)")
    simulate.add_argument("--kernel", choices=("bgmv", "mbgmv"), default=None,
                          help="the engines' decode LoRA kernel: the example profile's (default: bgmv), or with --profile "
                               "the decode model of engines run with --lora-kernel KERNEL (default: the profile's choice)")
    simulate.add_argument("--max-running", type=int, default=64, metavar="N", help="batch limit per engine (64)")
    simulate.add_argument("--max-prefill-tokens", type=int, default=4096, metavar="N", help="(default: 4096)")
    simulate.add_argument("--slo-scale", type=float, default=1.5, metavar="X",
                          help="time-per-token objective: X times the unloaded decode step at the trace's "
                               "largest rank (default: 1.5)")
    simulate.add_argument("--slo-tpot-s", type=float, metavar="S", help="time-per-token objective in seconds")
    simulate.add_argument("--slo-ttft-s", type=float, metavar="S",
                          help="TTFT objective in seconds (default: 5x the unloaded prefill of the mean prompt)")
    simulate.add_argument("--tpot-admission", action="store_true",
                          help="engines keep the time-per-token objective when admitting (as `lorad serve` with "
                               "--slo-tpot-ms and a profile): a request does not join a batch whose next step would break it")
    simulate.add_argument("--seed", type=int, default=0, metavar="N", help="the random policy's seed")
    simulate.add_argument("--out", metavar="PATH", help="JSON report (and PATH's .png CDFs when matplotlib is there)")

    bench = commands.add_parser("bench", help="replay a trace against a running daemon; cold-start microbenchmarks")
    bench_actions = bench.add_subparsers(dest="action", required=True, parser_class=Parser)
    replay = bench_actions.add_parser("trace", help="send a trace's requests at its arrival times, streaming")
    replay.add_argument("--trace", required=True, metavar="PATH")
    replay.add_argument("--socket", default=ServerConfig.socket, metavar="PATH",
                        help=f"the daemon's Unix socket (default: {ServerConfig.socket})")
    replay.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                        help="arrival times are multiplied by X (0.5: twice the rate; default: 1)")
    replay.add_argument("--max-requests", type=int, metavar="N", help="the first N requests only")
    replay.add_argument("--max-prompt-tokens", type=int, default=1024, metavar="N",
                        help="longer prompts are cut to N tokens (default: 1024)")
    replay.add_argument("--max-output-tokens", type=int, default=256, metavar="N",
                        help="longer outputs are cut to N tokens (default: 256)")
    replay.add_argument("--slo-ttft-s", type=float, metavar="S", help="TTFT objective (default: none)")
    replay.add_argument("--slo-tpot-s", type=float, metavar="S", help="time-per-token objective (default: none)")
    replay.add_argument("--out", metavar="PATH", help="JSON report")
    add_microbench_parsers(bench_actions)
    return parser


def _name_list(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, not {text!r}")
    return values


def _positive(kind, what: str, unparsed: str):
    """An argparse type: text -> kind(text) > 0 (finite), else 'expected <what>' ('<unparsed>' when kind
    cannot read it)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unparsed}, not {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}")
        return value

    return parse


_positive_float = _positive(float, "a positive number", "a number")
_positive_int = _positive(int, "a positive integer", "a positive integer")


def add_microbench_parsers(actions) -> None:
    """The cold-start microbenchmarks (daemon/bench/load.py, bench_invoke.py, bench_ipc.py,
    bench_cpu_lora.py, bench_cold_start.py): in-process, no daemon. Defaults: the 7B shape on cuda,
    a tiny one on the CPU, so that CI runs them in seconds."""
    def common(parser):
        parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                            help="auto: cuda when torch sees a GPU (default: auto)")
        parser.add_argument("--out", metavar="PATH.json", help="JSON report (and PATH.png when matplotlib is there)")

    load = actions.add_parser("load", help="adapter load latency host -> device by rank, targets and host tier")
    load.add_argument("--ranks", type=_int_list, metavar="R,R,...", help="(default: 8,16,32,64,128)")
    load.add_argument("--targets", type=_name_list, metavar="SET,...",
                      help="target module sets among qkv, qkvo, all (default: all three)")
    load.add_argument("--tiers", type=_name_list, metavar="TIER,...",
                      help="among pinned, pageable, host, disk (default: all; no pinned on the CPU)")
    load.add_argument("--model-config", metavar="NAME", help="the shape (default: llama-2-7b on cuda, tiny-llama on cpu)")
    load.add_argument("--reps", type=_positive_int, default=5, metavar="N", help="timed loads per row (default: 5)")
    load.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed loads first (default: 1)")
    load.add_argument("--disk-dir", metavar="DIR", help="where the disk tier's adapters are written (default: $TMPDIR)")
    load.add_argument("--seed", type=int, default=0, metavar="N")
    common(load)

    invoke = actions.add_parser("invoke", help="prefill latency: fused copy+signal vs native copy+sync+signal")
    invoke.add_argument("--tokens", type=_int_list, metavar="N,N,...",
                        help="prompt tokens (default: 16,128,512,2048 on cuda; 4,16,64 on cpu)")
    invoke.add_argument("--hidden", type=_positive_int, metavar="N", help="(default: 4096 on cuda, 256 on cpu)")
    invoke.add_argument("--layers", type=_positive_int, metavar="N", help="(default: 32 on cuda, 4 on cpu)")
    invoke.add_argument("--reps", type=_positive_int, default=15, metavar="N", help="(default: 15)")
    invoke.add_argument("--require-fused", action="store_true",
                        help="exit 2 if the fused CUDA path is not usable (instead of measuring without it)")
    common(invoke)

    ipc = actions.add_parser("ipc", help="CPU LoRA round trip: shared memory vs Unix socket, by workers")
    ipc.add_argument("--workers", type=_int_list, metavar="N,N,...",
                     help="receiving workers (default: those of 1,2,4,8 below the usable cores)")
    ipc.add_argument("--tokens", type=_positive_int, default=1, metavar="N", help="token rows per worker (default: 1)")
    ipc.add_argument("--rank", type=_positive_int, default=1, metavar="R", help="(default: 1: the invocation, not the math)")
    ipc.add_argument("--hidden", type=_positive_int, metavar="N", help="(default: 4096 on cuda hosts, 256 on cpu)")
    ipc.add_argument("--reps", type=_positive_int, metavar="N", help="(default: 2000 on cuda hosts, 200 on cpu)")
    common(ipc)

    cpu_lora = actions.add_parser("cpu-lora", help="tokens per core; pinned worker processes vs torch threads")
    cpu_lora.add_argument("--ranks", type=_int_list, metavar="R,R,...", help="profile ranks (default: 16,64)")
    cpu_lora.add_argument("--tokens", type=_int_list, metavar="N,N,...",
                          help="profile token counts (default: 1,16,64,128,256,512 on cuda hosts; 1,8,32,64 on cpu)")
    cpu_lora.add_argument("--workers", type=_int_list, metavar="N,N,...",
                          help="core counts compared (default: those of 1,2,4,8 below the usable cores)")
    cpu_lora.add_argument("--scaling-tokens", type=_positive_int, default=128, metavar="N", help="(default: 128)")
    cpu_lora.add_argument("--scaling-rank", type=_positive_int, default=64, metavar="R", help="(default: 64)")
    cpu_lora.add_argument("--hidden", type=_positive_int, metavar="N", help="(default: 4096 on cuda hosts, 256 on cpu)")
    cpu_lora.add_argument("--reps", type=_positive_int, default=9, metavar="N", help="(default: 9)")
    common(cpu_lora)

    cold = actions.add_parser("cold-start", help="the engine under Poisson arrivals in each cold-start mode")
    cold.add_argument("--requests", type=_positive_int, metavar="N", help="per workload (default: 32 on cuda, 6 on cpu)")
    cold.add_argument("--rate", type=_positive_float, metavar="R", help="requests per second (default: 8 on cuda, 50 on cpu)")
    cold.add_argument("--adapters", type=_int_list, metavar="N,N,...",
                      help="skewed workloads' adapter counts (default: 128,256,512 on cuda; 8,16 on cpu)")
    cold.add_argument("--alpha", type=float, default=1.0, metavar="A", help="Zipf exponent of popularity (default: 1)")
    cold.add_argument("--modes", type=_name_list, metavar="MODE,...",
                      help="among cached, ondemand, cpu, auto (default: all four)")
    cold.add_argument("--prompt-tokens", type=_positive_int, metavar="N", help="(default: 256 on cuda, 16 on cpu)")
    cold.add_argument("--output-tokens", type=_positive_int, metavar="N", help="(default: 32 on cuda, 4 on cpu)")
    cold.add_argument("--rank", type=_positive_int, metavar="R", help="the adapters' rank (default: 32 on cuda, 8 on cpu)")
    cold.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", metavar="P,P,...",
                      help="the adapters' projections (default: q_proj,k_proj,v_proj,o_proj)")
    cold.add_argument("--cpu-workers", type=int, default=0, metavar="N", help="CPU LoRA workers (default: 0, the engine's)")
    cold.add_argument("--pinned-host-bytes", type=int, metavar="BYTES",
                      help="every engine's pinned host budget for staged adapters (default: the engine's; 0: every "
                           "load copies from pageable memory)")
    cold.add_argument("--model-config", metavar="NAME", help="(default: llama-2-7b on cuda, tiny-llama on cpu)")
    cold.add_argument("--rounds", type=_positive_int, default=1, metavar="N",
                      help="fresh engines for every mode N times, the modes' order reversed each round (ABBA), "
                           "each row pooling the rounds' requests (default: 1)")
    cold.add_argument("--no-ablation", dest="ablation", action="store_false", help="skip the ablation table")
    cold.add_argument("--no-prime", dest="prime", action="store_false",
                      help="skip the unreported first workload that compiles every kernel variant the workloads use")
    cold.add_argument("--seed", type=int, default=0, metavar="N")
    common(cold)


def bench_main(argv: list[str]) -> int:
    """Runs `lorad <argv>` where argv[0] is one of COMMANDS; returns the exit code."""
    args = parse(build_parser(), argv, COMMANDS)
    if isinstance(args, int):
        return args
    args.argv = list(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stderr)
    try:
        if args.command == "trace":
            return trace_make(args)
        if args.command == "simulate":
            return simulate_command(args)
        if args.action != "trace":
            return microbench(args)
        return bench_trace(args)
    except LoradError as error:
        print(f"lorad: {error.message}", file=sys.stderr)
        return REFUSED
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        replaying = args.command == "bench" and args.action == "trace"
        print(f"lorad: cannot reach the daemon at {args.socket}: {reason} (is `lorad serve` running?)"
              if replaying else f"lorad: {reason}", file=sys.stderr)
        return UNREACHABLE if replaying else REFUSED
    except KeyboardInterrupt:
        return 130


def microbench(args: argparse.Namespace) -> int:
    """`lorad bench load|invoke|ipc|cpu-lora|cold-start`: each module's run(args) prints its table and
    writes its report."""
    from importlib import import_module

    module = {"load": "load", "invoke": "invoke", "ipc": "ipc", "cpu-lora": "cpu_lora", "cold-start": "cold_start"}[args.action]
    from lorad.errors import BadRequest

    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise BadRequest(f"--out {args.out}: the directory {Path(args.out).resolve().parent} does not exist")
    args.command_line = "lorad " + " ".join(args.argv)
    import_module(f"lorad.daemon.bench.{module}").run(args)
    return OK


# --- lorad trace make -------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """../shared/data next to the repository (this file is daemon/bench/cli.py in it), else next to the
    working directory."""
    for base in (Path(__file__).resolve().parents[2], Path.cwd()):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def trace_make(args: argparse.Namespace) -> int:
    from lorad.scheduler import workload

    from lorad.errors import BadRequest

    if args.adapters < 1:
        raise BadRequest("--adapters must be at least 1")
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
        if rate <= 0 or duration <= 0:
            raise BadRequest("--rate and --duration must be positive")
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
    span = trace.duration_s
    print(f"wrote {args.out}: {len(trace.requests)} requests over {span:.1f} s "
          f"({len(trace.requests) / span if span > 0 else 0:.1f} req/s), {len(trace.adapter_ranks)} adapters used "
          f"of {args.adapters}, kind {args.kind}")
    if "attribution" in trace.source:
        print(f"data: {trace.source['attribution']}")
    return OK


# --- lorad simulate ----------------------------------------------------------------------------------------


def simulate_command(args: argparse.Namespace) -> int:
    from lorad.scheduler.admission import make_admission
    from lorad.scheduler.perf_model import profile_for
    from lorad.scheduler.router import FirstFit, MostIdle, Random, RankAware
    from lorad.scheduler.simulator import SimConfig, objectives_for, simulate
    from lorad.scheduler.workload import Trace

    from lorad.errors import BadRequest

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
    span = trace.duration_s
    print(f"trace {args.trace}: {len(trace.requests)} requests, {len(trace.adapter_ranks)} adapters, "
          f"{len(trace.requests) / span if span > 0 else 0:.1f} req/s over {span:.1f} s; {args.engines} engines; "
          f"objectives: TTFT {objectives.ttft_s * 1e3:.1f} ms, time per token {objectives.tpot_s * 1e3:.2f} ms")
    if "attribution" in trace.source:
        print(f"data: {trace.source['attribution']}")

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
            summary["cdf"] = {"tpot_s": _quantiles(result.tpot_s[~result.dropped]),
                              "ttft_s": _quantiles(result.ttft_s[~result.dropped]),
                              "latency_s": _quantiles(result.latency_s[~result.dropped])}
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
        _write_json(args.out, report)
        print(f"wrote {args.out}")
        plot_cdfs(summaries, Path(args.out).with_suffix(".png"), objectives.tpot_s,
                  note="example profile, NOT MEASURED" if not measured else "")
    return OK


def _quantiles(values: np.ndarray) -> list[float]:
    values = values[~np.isnan(values)]
    if not len(values):
        return []
    return [float(v) for v in np.quantile(values, np.linspace(0.0, 1.0, CDF_POINTS))]


def plot_cdfs(summaries: list[dict], path: Path, slo_tpot_s: float | None, note: str = "") -> Path | None:
    """Time-per-token and TTFT CDFs of each run in one PNG; skipped, with the reason logged, without
    matplotlib (`pip install lorad[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        log.warning("no plot written: matplotlib is not installed (%s); pip install 'lorad[bench]'", error)
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for summary in summaries:
        label = f"{summary['policy']} / {summary['admission']}"
        for axis, metric in zip(axes, ("tpot_s", "ttft_s")):
            points = summary["cdf"][metric]
            if points:
                axis.plot(np.array(points) * 1e3, np.linspace(0, 1, len(points)), label=label)
    if slo_tpot_s:
        axes[0].axvline(slo_tpot_s * 1e3, color="grey", linestyle="--", label="objective")
    axes[0].set_xlabel("time per output token (ms)")
    axes[1].set_xlabel("time to first token (ms)")
    axes[1].set_xscale("log")
    for axis in axes:
        axis.set_ylabel("CDF")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if note:
        figure.suptitle(note, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    log.info("plot written path=%s", path)
    return path


# --- the table --------------------------------------------------------------------------------------------


def format_table(summaries: list[dict]) -> str:
    """One row per run: requests done and dropped, throughput, TTFT / time per token / latency (mean, p50,
    p90, p99, in ms) and SLO attainment (drops count as misses)."""
    header = ["policy", "admission", "done", "dropped", "req/s", "tok/s"]
    for metric in ("TTFT", "TPOT", "latency"):
        header += [f"{metric} {stat}" for stat in ("mean", "p50", "p90", "p99")]
    header += ["SLO TTFT", "SLO TPOT", "SLO both"]
    rows = [header]
    for s in summaries:
        row = [s["policy"], s["admission"], str(s["completed"]), str(s["dropped"]),
               f"{s['throughput_rps']:.1f}", f"{s['throughput_tokens_per_s']:.0f}"]
        for metric, digits in (("ttft_s", 1), ("tpot_s", 2), ("latency_s", 0)):
            row += [_ms(s[metric][stat], digits) for stat in ("mean", "p50", "p90", "p99")]
        row += [_percent(s.get(key)) for key in ("slo_ttft_attainment", "slo_tpot_attainment", "slo_attainment")]
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.rjust(width) if i > 1 else cell.ljust(width) for i, (cell, width) in
                       enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines + ["(times in ms; SLO: share of all requests meeting the objective, drops are misses)"])


def _ms(seconds, digits: int) -> str:
    return "-" if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)) else f"{seconds * 1e3:.{digits}f}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _write_json(path: str, report: dict) -> None:
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    Path(path).write_text(json.dumps(clean(report), indent=1, allow_nan=False) + "\n")


# --- lorad bench trace -------------------------------------------------------------------------------------


def bench_trace(args: argparse.Namespace) -> int:
    from lorad.scheduler.workload import Trace

    from lorad.errors import BadRequest

    if args.time_scale <= 0 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        raise BadRequest("--time-scale, --max-prompt-tokens and --max-output-tokens must be positive")
    trace = Trace.load(args.trace)
    requests = trace.requests[: args.max_requests] if args.max_requests else trace.requests
    if not requests:
        raise BadRequest(f"the trace {args.trace} has no requests")
    report = asyncio.run(replay(args.socket, trace, requests, args))
    print(report["mapping"]["note"])
    if "attribution" in trace.source:
        print(f"data: {trace.source['attribution']}")
    print(format_table([report["summary"]]))
    errors = report["summary"]["drop_reasons"]
    if errors:
        print("not served: " + ", ".join(f"{reason} x{count}" for reason, count in errors.items()))
    if args.out:
        _write_json(args.out, report)
        print(f"wrote {args.out}")
    return OK


async def replay(socket_path: str, trace, requests, args: argparse.Namespace) -> dict:
    """Sends each request at its (scaled) arrival time, streaming, and times its tokens as they come."""
    from lorad.client import AsyncClient
    from lorad.scheduler.simulator import distribution

    async with AsyncClient(socket_path, max_connections=0) as client:
        models = await client.models()
        status = await client.status()
        base = models[0]["id"]
        adapters = [entry["id"] for entry in models if entry.get("kind") == "lora"]
        trace_adapters = sorted({r.adapter for r in requests})
        index = {name: i for i, name in enumerate(trace_adapters)}
        target = {name: adapters[i % len(adapters)] if adapters else base for name, i in index.items()}
        note = (f"adapters: the trace's {len(trace_adapters)} (sorted by name) mapped onto the daemon's "
                f"{len(adapters)} by index modulo {len(adapters)}" if adapters else
                f"adapters: the daemon lists none; every request goes to the base model {base}")
        max_model_len = status.get("max_model_len") if isinstance(status, dict) else None
        rng = np.random.default_rng(0)
        plans, clipped = [], 0
        for request in requests:
            prompt = min(request.prompt_tokens, args.max_prompt_tokens)
            output = min(max(1, request.output_tokens), args.max_output_tokens)
            if isinstance(max_model_len, int) and prompt + output > max_model_len:
                prompt = max(1, min(prompt, max_model_len // 2))
                output = max(1, min(output, max_model_len - prompt))
            clipped += (prompt, output) != (request.prompt_tokens, max(1, request.output_tokens))
            # token ids 16..255: inside any vocabulary, clear of the usual special tokens
            plans.append((request.arrival_s * args.time_scale, target[request.adapter],
                          rng.integers(16, 256, size=prompt).tolist(), output))

        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05
        outcomes = await asyncio.gather(*(_one(client, loop, start, *plan) for plan in plans))

    count = len(plans)
    arrival = np.array([p[0] for p in plans])
    sent = np.array([o["sent"] for o in outcomes])
    first = np.array([o["first"] for o in outcomes])
    last = np.array([o["last"] for o in outcomes])
    tokens = np.array([o["tokens"] for o in outcomes])
    failed = np.array([o["error"] is not None for o in outcomes])
    ttft = first - sent
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(tokens > 1, (last - first) / (tokens - 1), math.nan)
    latency = last - sent
    served = ~failed
    makespan = float(np.nanmax(last[served]) - start) if served.any() else 0.0
    reasons: dict[str, int] = {}
    for outcome in outcomes:
        if outcome["error"]:
            reasons[outcome["error"]] = reasons.get(outcome["error"], 0) + 1
    objectives = {"ttft_s": args.slo_ttft_s, "tpot_s": args.slo_tpot_s}
    ttft_ok = served & (ttft <= args.slo_ttft_s) if args.slo_ttft_s else None
    tpot_ok = served & (np.isnan(tpot) | (tpot <= args.slo_tpot_s)) if args.slo_tpot_s else None
    both = None
    if ttft_ok is not None or tpot_ok is not None:
        both = served.copy()
        for ok in (ttft_ok, tpot_ok):
            if ok is not None:
                both &= ok
    summary = {
        "policy": "daemon",
        "admission": "daemon",
        "requests": count,
        "completed": int(served.sum()),
        "dropped": int(failed.sum()),
        "drop_reasons": reasons,
        "makespan_s": makespan,
        "throughput_rps": int(served.sum()) / makespan if makespan > 0 else 0.0,
        "throughput_tokens_per_s": float(tokens[served].sum()) / makespan if makespan > 0 else 0.0,
        "ttft_s": distribution(ttft[served]),
        "tpot_s": distribution(tpot[served]),
        "latency_s": distribution(latency[served]),
        "slo_ttft_s": args.slo_ttft_s,
        "slo_tpot_s": args.slo_tpot_s,
        "slo_ttft_attainment": float(ttft_ok.mean()) if ttft_ok is not None else None,
        "slo_tpot_attainment": float(tpot_ok.mean()) if tpot_ok is not None else None,
        "slo_attainment": float(both.mean()) if both is not None else None,
        "send_lag_s": distribution(sent - (start + arrival)),
    }
    return {
        "version": 1,
        "kind": "replay",
        "socket": socket_path,
        "trace": {"path": args.trace, "requests_replayed": count, "source": trace.source,
                  "time_scale": args.time_scale, "clipped_requests": clipped,
                  "max_prompt_tokens": args.max_prompt_tokens, "max_output_tokens": args.max_output_tokens},
        "daemon": {"base_model": base, "adapters": len(adapters), "status": status},
        "mapping": {"note": note, "adapters": target},
        "objectives": objectives,
        "summary": summary,
        "requests": [
            {"arrival_s": float(a), "model": p[1], "prompt_tokens": len(p[2]), "max_tokens": p[3],
             "output_tokens": int(o["tokens"]), "ttft_s": _finite(t), "tpot_s": _finite(tp), "latency_s": _finite(la),
             "error": o["error"]}
            for a, p, o, t, tp, la in zip(arrival, plans, outcomes, ttft, tpot, latency)
        ],
        **({"attribution": trace.source["attribution"]} if "attribution" in trace.source else {}),
    }


async def _one(client, loop, start: float, at: float, model: str, prompt: list[int], max_tokens: int) -> dict:
    delay = start + at - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
    outcome = {"sent": loop.time(), "first": math.nan, "last": math.nan, "tokens": 0, "error": None}
    try:
        async for chunk in client.stream_completions(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, ignore_eos=True, return_token_ids=True):
            new = sum(len(choice.get("token_ids") or ()) for choice in chunk.get("choices", ()))
            if new:
                now = loop.time()
                if not outcome["tokens"]:
                    outcome["first"] = now
                outcome["last"] = now
                outcome["tokens"] += new
        if not outcome["tokens"]:
            outcome["error"] = "no tokens"
    except Overloaded as error:
        outcome["error"] = f"overloaded: {error.message}"
    except LoradError as error:
        outcome["error"] = f"{type(error).__name__}: {error.message}"
    except (OSError, asyncio.TimeoutError) as error:  # connection refused or dropped mid-stream
        outcome["error"] = f"connection: {error or type(error).__name__}"
    except Exception as error:  # aiohttp's ClientError (payload, disconnect): the request is lost, the replay goes on
        if type(error).__module__.split(".")[0] != "aiohttp":
            raise
        outcome["error"] = f"connection: {type(error).__name__}: {error}"
    if outcome["error"]:
        outcome["first"] = outcome["last"] = math.nan
    return outcome


def _finite(value) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
