"""The benchmark commands of `lorad`, parsed here and run by one module each: `trace make` writes a request
trace (trace_make.py), `simulate` runs it through N simulated engines under each routing policy
(simulate.py), `bench trace` replays it against a running daemon (trace_replay.py); the last two print
the same table and write a JSON report (trace_report.py). `bench serve` loads a running daemon as
`vllm bench serve` does (serve.py). `bench load|invoke|ipc|cpu-lora|cold-start`
are the cold-start microbenchmarks, run in this process (load.py, invoke.py, ipc.py, cpu_lora.py,
cold_start.py). daemon/server/cli.py hands them `bench_main(argv)`.

Exit codes: 0 done, 1 no daemon answers on the socket, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys

from lorad.config import ServerConfig
from lorad.daemon.bench import serve
from lorad.daemon.server.cli_args import SEED, Parser, check_out, number, parse
from lorad.errors import LoradError

log = logging.getLogger(__name__)

COMMANDS = ("simulate", "bench", "trace")
OK, UNREACHABLE, REFUSED = 0, 1, 2
TRACE_KINDS = ("poisson", "gamma", "serverless", "azure-conv", "azure-code")
MAX_ADAPTERS = 1_000_000  # what a generated trace or workload may name
MAX_ENGINES = 10_000
MAX_WORKERS = 256  # CPU worker processes, as EngineConfig.cpu_workers

_positive_float = number(float, positive=True)
_positive_int = number(int, positive=True)
_share = number(float, least=0)  # a Zipf exponent
_hidden = number(int, 1, 65_536)


def _int_list(text: str, most: int | None = None) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    if most is not None and max(values) > most:
        raise argparse.ArgumentTypeError(f"expected integers from 1 to {most}, not {text!r}")
    return values


def _worker_list(text: str) -> tuple[int, ...]:
    return _int_list(text, MAX_WORKERS)


def _range(text: str) -> tuple[int, int]:
    values = _int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, not {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from lorad.daemon.bench.simulate import POLICIES

    parser = Parser(prog="lorad", description="Make request traces, simulate them, replay them against a daemon.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    trace = commands.add_parser("trace", help="make a request trace")
    trace_actions = trace.add_subparsers(dest="action", required=True, parser_class=Parser)
    make = trace_actions.add_parser("make", help="write a trace (JSON) from a workload generator")
    make.add_argument("--kind", choices=TRACE_KINDS, required=True,
                      help="poisson: one Poisson stream, Zipf(alpha) adapters; gamma: S-LoRA's per-adapter Gamma "
                           "arrivals of cv; serverless: skewed on/off per-adapter traffic (MAF-like); azure-conv, "
                           "azure-code: the Azure LLM inference trace 2023 (CC BY 4.0) arrivals and lengths")
    make.add_argument("--adapters", type=number(int, 1, MAX_ADAPTERS), default=100, metavar="N",
                      help="distinct adapters (default: 100)")
    make.add_argument("--alpha", type=_share, default=1.0, metavar="A", help="Zipf exponent of popularity (default: 1)")
    make.add_argument("--cv", type=_positive_float, default=1.0, metavar="C",
                      help="gamma: coefficient of variation (default: 1)")
    make.add_argument("--sigma", type=_positive_float, default=2.5, metavar="S",
                      help="serverless (and --popularity serverless): log-normal spread (default: 2.5)")
    make.add_argument("--rate", type=_positive_float, metavar="R",
                      help="requests per second, all adapters together (azure: rescales its arrivals; "
                           "default: 10, azure: as recorded)")
    make.add_argument("--duration", type=_positive_float, metavar="S",
                      help="seconds of arrivals (default: 60; azure: all)")
    make.add_argument("--requests", type=_positive_int, metavar="N", help="azure: the first N rows (default: all)")
    make.add_argument("--popularity", choices=("power-law", "serverless"), default="power-law",
                      help="azure: how adapters are drawn for its requests (default: power-law)")
    make.add_argument("--ranks", type=_int_list, default=(8, 16, 32, 64), metavar="R,R,...",
                      help="LoRA ranks, assigned round robin over adapters (default: 8,16,32,64)")
    make.add_argument("--prompt-len", type=_range, default=(8, 512), metavar="LOW,HIGH",
                      help="synthetic kinds: prompt tokens, uniform (default: 8,512)")
    make.add_argument("--output-len", type=_range, default=(8, 512), metavar="LOW,HIGH",
                      help="synthetic kinds: output tokens, uniform (default: 8,512)")
    make.add_argument("--seed", type=SEED, default=0, metavar="N")
    make.add_argument("--data-dir", metavar="DIR",
                      help="where the Azure CSVs are (default: ../shared/data relative to the repository)")
    make.add_argument("--out", required=True, metavar="PATH")

    simulate = commands.add_parser("simulate", help="simulate N engines serving a trace under routing policies")
    simulate.add_argument("--trace", required=True, metavar="PATH")
    simulate.add_argument("--engines", type=number(int, 1, MAX_ENGINES), default=60, metavar="N", help="(default: 60)")
    simulate.add_argument("--policy", choices=POLICIES + ("all",), default="all", help="(default: all)")
    simulate.add_argument("--admission", choices=("fcfs", "early-abort", "both"), default="fcfs",
                          help="which queued requests a prefill step takes (default: fcfs)")
    simulate.add_argument("--cluster", type=_positive_int, metavar="D",
                          help="adapter clustering: prefer the running batch's adapters once it holds D")
    simulate.add_argument("--profile", metavar="PATH",
                          help="performance models from `lorad profile` (default: the example profile, NOT MEASURED)")
    simulate.add_argument("--kernel", choices=("bgmv", "mbgmv"), default=None,
                          help="the engines' decode LoRA kernel: the example profile's (default: bgmv), or with --profile "
                               "the decode model of engines run with --lora-kernel KERNEL (default: the profile's choice)")
    simulate.add_argument("--max-running", type=_positive_int, default=64, metavar="N",
                          help="batch limit per engine (64)")
    simulate.add_argument("--max-prefill-tokens", type=_positive_int, default=4096, metavar="N", help="(default: 4096)")
    simulate.add_argument("--slo-scale", type=_positive_float, default=1.5, metavar="X",
                          help="time-per-token objective: X times the unloaded decode step at the trace's "
                               "largest rank (default: 1.5)")
    simulate.add_argument("--slo-tpot-s", type=_positive_float, metavar="S", help="time-per-token objective in seconds")
    simulate.add_argument("--slo-ttft-s", type=_positive_float, metavar="S",
                          help="TTFT objective in seconds (default: 5x the unloaded prefill of the mean prompt)")
    simulate.add_argument("--tpot-admission", action="store_true",
                          help="engines keep the time-per-token objective when admitting (as `lorad serve` with "
                               "--slo-tpot-ms and a profile): a request does not join a batch whose next step would break it")
    simulate.add_argument("--seed", type=SEED, default=0, metavar="N", help="the random policy's seed")
    simulate.add_argument("--out", metavar="PATH", help="JSON report (and PATH's .png CDFs when matplotlib is there)")

    bench = commands.add_parser("bench", help="load a running daemon, replay a trace against it; cold-start "
                                              "microbenchmarks")
    bench_actions = bench.add_subparsers(dest="action", required=True, parser_class=Parser)
    replay = bench_actions.add_parser("trace", help="send a trace's requests at its arrival times, streaming")
    replay.add_argument("--trace", required=True, metavar="PATH")
    replay.add_argument("--socket", default=ServerConfig.socket, metavar="PATH",
                        help=f"the daemon's Unix socket (default: {ServerConfig.socket})")
    replay.add_argument("--time-scale", type=number(float, most=1e6, positive=True), default=1.0, metavar="X",
                        help="arrival times are multiplied by X (0.5: twice the rate; default: 1)")
    replay.add_argument("--max-requests", type=_positive_int, metavar="N", help="the first N requests only")
    replay.add_argument("--max-prompt-tokens", type=_positive_int, default=1024, metavar="N",
                        help="longer prompts are cut to N tokens (default: 1024)")
    replay.add_argument("--max-output-tokens", type=_positive_int, default=256, metavar="N",
                        help="longer outputs are cut to N tokens (default: 256)")
    replay.add_argument("--slo-ttft-s", type=_positive_float, metavar="S", help="TTFT objective (default: none)")
    replay.add_argument("--slo-tpot-s", type=_positive_float, metavar="S",
                        help="time-per-token objective (default: none)")
    replay.add_argument("--out", metavar="PATH", help="JSON report")
    serve.add_parser(bench_actions, ServerConfig.socket)
    add_microbench_parsers(bench_actions)
    return parser


def _name_list(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, not {text!r}")
    return values


def add_microbench_parsers(actions) -> None:
    """The cold-start microbenchmarks (daemon/bench/load.py, invoke.py, ipc.py, cpu_lora.py,
    cold_start.py): in-process, no daemon. Defaults: the 7B shape on cuda,
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
    load.add_argument("--warmup", type=number(int, 0), default=1, metavar="N", help="untimed loads first (default: 1)")
    load.add_argument("--disk-dir", metavar="DIR", help="where the disk tier's adapters are written (default: $TMPDIR)")
    load.add_argument("--seed", type=SEED, default=0, metavar="N")
    common(load)

    invoke = actions.add_parser("invoke", help="prefill latency: fused copy+signal vs native copy+sync+signal")
    invoke.add_argument("--tokens", type=_int_list, metavar="N,N,...",
                        help="prompt tokens (default: 16,128,512,2048 on cuda; 4,16,64 on cpu)")
    invoke.add_argument("--hidden", type=_hidden, metavar="N", help="(default: 4096 on cuda, 256 on cpu)")
    invoke.add_argument("--layers", type=_positive_int, metavar="N", help="(default: 32 on cuda, 4 on cpu)")
    invoke.add_argument("--reps", type=_positive_int, default=15, metavar="N", help="(default: 15)")
    invoke.add_argument("--require-fused", action="store_true",
                        help="exit 2 if the fused CUDA path is not usable (instead of measuring without it)")
    common(invoke)

    ipc = actions.add_parser("ipc", help="CPU LoRA round trip: shared memory vs Unix socket, by workers")
    ipc.add_argument("--workers", type=_worker_list, metavar="N,N,...",
                     help="receiving workers (default: those of 1,2,4,8 below the usable cores)")
    ipc.add_argument("--tokens", type=_positive_int, default=1, metavar="N", help="token rows per worker (default: 1)")
    ipc.add_argument("--rank", type=_positive_int, default=1, metavar="R", help="(default: 1: the invocation, not the math)")
    ipc.add_argument("--hidden", type=_hidden, metavar="N", help="(default: 4096 on cuda hosts, 256 on cpu)")
    ipc.add_argument("--reps", type=_positive_int, metavar="N", help="(default: 2000 on cuda hosts, 200 on cpu)")
    common(ipc)

    cpu_lora = actions.add_parser("cpu-lora", help="tokens per core; pinned worker processes vs torch threads")
    cpu_lora.add_argument("--ranks", type=_int_list, metavar="R,R,...", help="profile ranks (default: 16,64)")
    cpu_lora.add_argument("--tokens", type=_int_list, metavar="N,N,...",
                          help="profile token counts (default: 1,16,64,128,256,512 on cuda hosts; 1,8,32,64 on cpu)")
    cpu_lora.add_argument("--workers", type=_worker_list, metavar="N,N,...",
                          help="core counts compared (default: those of 1,2,4,8 below the usable cores)")
    cpu_lora.add_argument("--scaling-tokens", type=_positive_int, default=128, metavar="N", help="(default: 128)")
    cpu_lora.add_argument("--scaling-rank", type=_positive_int, default=64, metavar="R", help="(default: 64)")
    cpu_lora.add_argument("--hidden", type=_hidden, metavar="N", help="(default: 4096 on cuda hosts, 256 on cpu)")
    cpu_lora.add_argument("--reps", type=_positive_int, default=9, metavar="N", help="(default: 9)")
    common(cpu_lora)

    cold = actions.add_parser("cold-start", help="the engine under Poisson arrivals in each cold-start mode")
    cold.add_argument("--requests", type=_positive_int, metavar="N", help="per workload (default: 32 on cuda, 6 on cpu)")
    cold.add_argument("--rate", type=_positive_float, metavar="R", help="requests per second (default: 8 on cuda, 50 on cpu)")
    cold.add_argument("--adapters", type=_int_list, metavar="N,N,...",
                      help="skewed workloads' adapter counts (default: 128,256,512 on cuda; 8,16 on cpu)")
    cold.add_argument("--alpha", type=_share, default=1.0, metavar="A", help="Zipf exponent of popularity (default: 1)")
    cold.add_argument("--modes", type=_name_list, metavar="MODE,...",
                      help="among cached, ondemand, cpu, auto (default: all four)")
    cold.add_argument("--prompt-tokens", type=_positive_int, metavar="N", help="(default: 256 on cuda, 16 on cpu)")
    cold.add_argument("--output-tokens", type=_positive_int, metavar="N", help="(default: 32 on cuda, 4 on cpu)")
    cold.add_argument("--rank", type=_positive_int, metavar="R", help="the adapters' rank (default: 32 on cuda, 8 on cpu)")
    cold.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", metavar="P,P,...",
                      help="the adapters' projections (default: q_proj,k_proj,v_proj,o_proj)")
    cold.add_argument("--cpu-workers", type=number(int, 0, MAX_WORKERS), default=0, metavar="N",
                      help="CPU LoRA workers (default: 0, the engine's)")
    cold.add_argument("--pinned-host-bytes", type=number(int, 0), metavar="BYTES",
                      help="every engine's pinned host budget for staged adapters (default: the engine's; 0: every "
                           "load copies from pageable memory)")
    cold.add_argument("--model-config", metavar="NAME", help="(default: llama-2-7b on cuda, tiny-llama on cpu)")
    cold.add_argument("--rounds", type=_positive_int, default=1, metavar="N",
                      help="fresh engines for every mode N times, the modes' order reversed each round (ABBA), "
                           "each row pooling the rounds' requests (default: 1)")
    cold.add_argument("--no-ablation", dest="ablation", action="store_false", help="skip the ablation table")
    cold.add_argument("--no-prime", dest="prime", action="store_false",
                      help="skip the unreported first workload that compiles every kernel variant the workloads use")
    cold.add_argument("--seed", type=SEED, default=0, metavar="N")
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
        check_out(getattr(args, "out", None))  # before the work, not after it
        if args.command == "trace":
            from lorad.daemon.bench import trace_make as command
        elif args.command == "simulate":
            from lorad.daemon.bench import simulate as command
        elif args.action == "trace":
            from lorad.daemon.bench import trace_replay as command
        elif args.action == "serve":
            return serve.run(args)
        else:
            return microbench(args)
        command.run(args)
        return OK
    except LoradError as error:
        print(f"lorad: {error.message}", file=sys.stderr)
        return REFUSED
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        if error.filename is not None:  # a file the command reads or writes (a socket's errors name none)
            print(f"lorad: {error.filename}: {reason}", file=sys.stderr)
            return REFUSED
        replaying = args.command == "bench" and args.action in ("trace", "serve")
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
    args.command_line = "lorad " + " ".join(args.argv)
    import_module(f"lorad.daemon.bench.{module}").run(args)
    return OK


if __name__ == "__main__":
    sys.exit(bench_main(sys.argv[1:]))
