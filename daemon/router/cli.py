"""`lorad router`: one front Unix socket over several running lorad engines (each a `lorad serve` with its
own socket), routing each completion with a policy of scheduler/router.py. daemon/server/cli.py hands it
`router_main(argv)`.

Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad usage (flags, profile, socket in use).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from lorad.daemon.server.cli_args import SEED, Parser, log_level, number, octal_mode, parse

from lorad.config import ServerConfig
from lorad.errors import BadRequest, LoradError

log = logging.getLogger(__name__)

POLICIES = ("rank-aware", "most-idle", "first-fit", "random")
DEFAULT_SOCKET = "/tmp/lorad/router.sock"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lorad router", description="One Unix socket in front of several lorad engines.")
    parser.add_argument("--backend", action="append", required=True, metavar="PATH",
                        help="a backend daemon's Unix socket (repeatable, one per engine)")
    parser.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                        help=f"the router's Unix socket, created with --socket-mode (default: {DEFAULT_SOCKET})")
    parser.add_argument("--socket-mode", type=octal_mode, default=ServerConfig.socket_mode,
                        metavar="MODE", help=f"in octal (default: {ServerConfig.socket_mode:o})")
    parser.add_argument("--policy", choices=POLICIES, default="rank-aware",
                        help="rank-aware: CaraServe's Algorithm 1 (needs --tpot-slo-ms); most-idle: fewest requests; "
                             "first-fit: Punica's first engine below its batch limit; random (default: rank-aware)")
    parser.add_argument("--profile", metavar="PATH", action="append",
                        help="rank-aware: performance models from `lorad profile` (default: the example profile, "
                             "NOT MEASURED); repeatable, one per tensor-parallel size of the backends: each engine's "
                             "steps are predicted with the profile of its size (the first given where none is)")
    parser.add_argument("--kernel", choices=("bgmv", "mbgmv"), default=None,
                        help="the engines' decode LoRA kernel: the example profile's (default: bgmv), or with --profile "
                             "the decode model of engines run with --lora-kernel KERNEL (default: the profile's choice)")
    parser.add_argument("--tpot-slo-ms", type=number(float, positive=True), metavar="MS",
                        help="rank-aware: the time-per-output-token objective; an engine whose decode step would "
                             "exceed it with the request pays a penalty")
    parser.add_argument("--ttft-slo-ms", type=number(float, positive=True), metavar="MS",
                        help="the time-to-first-token objective: a request an engine refuses (early abort, or no room) "
                             "is routed to another only while it has waited less (default: none, every candidate "
                             "is tried once)")
    parser.add_argument("--avg-response-tokens", type=number(float, positive=True), default=128.0, metavar="N",
                        help="rank-aware: tokens of an average answer, over which a prefill's cost is spread "
                             "(default: 128)")
    parser.add_argument("--poll-interval-ms", type=number(float, positive=True), default=200.0, metavar="MS",
                        help="how often each backend's /v1/status is read (default: 200)")
    parser.add_argument("--seed", type=SEED, default=0, metavar="N", help="the random policy's seed")
    parser.add_argument("--log-level", type=log_level, default="info", help="debug|info|warning|error (default: info)")
    return parser


def make_policy(args: argparse.Namespace) -> tuple[object, dict]:
    """The policy and what /v1/status says about it (profile, objective)."""
    from lorad.scheduler.perf_model import NOT_MEASURED
    from lorad.scheduler.router import FirstFit, MostIdle, Random, RankAware

    if args.policy == "most-idle":
        return MostIdle(), {}
    if args.policy == "first-fit":
        return FirstFit(), {}
    if args.policy == "random":
        return Random(seed=args.seed), {"seed": args.seed}
    from lorad.scheduler.perf_model import profile_for

    if args.tpot_slo_ms is None or args.tpot_slo_ms <= 0:
        raise BadRequest("--policy rank-aware needs --tpot-slo-ms MS, the time-per-output-token objective (> 0)")
    by_size: dict[int, tuple[str | None, object]] = {}  # tensor_parallel_size -> (path, profile)
    for path in args.profile or [None]:
        profile = profile_for(path, args.kernel)
        size = profile.tensor_parallel_size
        if size in by_size:
            raise BadRequest(f"--profile {path} and --profile {by_size[size][0]} were both measured at "
                             f"tensor_parallel_size {size}: give one profile per size")
        by_size[size] = (path, profile)
    path, profile = next(iter(by_size.values()))  # engines of a size without a profile of their own
    measured = all(path is not None and bool(p.machine.get("measured")) for path, p in by_size.values())
    if not measured:
        log.warning("rank-aware routing with %s", NOT_MEASURED)
    # lorad's engines put prefill chunks into their decode steps (see RankAware.mixed_steps).
    policy = RankAware(profile.decode, profile.prefill, args.tpot_slo_ms / 1e3, args.avg_response_tokens, mixed_steps=True,
                       by_tensor_parallel_size={size: (p.decode, p.prefill) for size, (_, p) in by_size.items()})
    about = {"profile": {"path": path, "kernel": profile.decode.lora.kernel, "machine": profile.machine,
                         "measured": measured, "tensor_parallel_size": profile.tensor_parallel_size},
             "profiles_by_tensor_parallel_size": {size: path for size, (path, _) in by_size.items()},
             "tpot_slo_s": args.tpot_slo_ms / 1e3, "avg_response_tokens": args.avg_response_tokens,
             "mixed_steps": policy.mixed_steps}
    return policy, about


def router_main(argv: list[str]) -> int:
    """Runs `lorad router <argv>` until SIGTERM/SIGINT; returns the exit code."""
    from lorad.daemon.server import unix_socket
    from lorad.daemon.server.cli import run_event_loop, setup_logging

    args = parse(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        setup_logging(args.log_level)
        policy, about = make_policy(args)
        try:
            unix_socket.claim_path(args.socket)
        except OSError as error:
            raise BadRequest(f"cannot use the socket {args.socket}: {error.strerror or error}") from None
    except LoradError as error:
        print(f"lorad router: {error.message}", file=sys.stderr)
        return 2
    try:
        return run_event_loop(_serve(args, policy, about))
    except LoradError as error:
        print(f"lorad router: {error.message}", file=sys.stderr)
        return 2
    finally:
        unix_socket.remove(args.socket)


async def _serve(args: argparse.Namespace, policy, about: dict) -> int:
    from lorad.daemon.server.unix_socket import serve_unix
    from lorad.daemon.router.server import Router, create_app

    ttft_slo_s = args.ttft_slo_ms / 1e3 if args.ttft_slo_ms else None
    router = Router(args.backend, policy, args.poll_interval_ms / 1e3, about, ttft_slo_s=ttft_slo_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await router.start()
    try:
        try:
            runner = await serve_unix(create_app(router), args.socket, args.socket_mode)
        except OSError as error:
            raise BadRequest(f"cannot listen on {args.socket}: {error.strerror or error}") from None
        log.info("router listening socket=%s mode=%o policy=%s backends=%s retry_refused_within_ms=%s", args.socket,
                 args.socket_mode, policy.name, ",".join(args.backend), args.ttft_slo_ms or "any")
        await stop.wait()
        log.info("stopping: requests still streaming are closed, their backends abort them")
        await runner.cleanup()
    finally:
        await router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(router_main(sys.argv[1:]))
