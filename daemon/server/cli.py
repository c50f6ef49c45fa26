"""The `lorad` command: `lorad serve` runs the daemon on a Unix socket (flags over the config file over
lorad.config's defaults, which are the only ones), `lorad generate` streams one completion from a running
daemon, `lorad install-systemd` puts the unit files and a sample config in place.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from lorad.daemon.server import unix_socket
from lorad.daemon.server.cli_args import SEED, Parser, number, octal_mode, parse
from lorad.config import DTYPE_CHOICES, SERVE_DEFAULTS, Config, EngineConfig, ServerConfig
from lorad.errors import BadRequest, LoradError

log = logging.getLogger(__name__)

# Flags whose name or shape differs from their field; every other field of EngineConfig/ServerConfig
# becomes --field-name with the field's type.
_ENGINE_FLAG_HELP = {
    "model": "Hugging Face checkpoint directory of the base model",
    "demo": "serve the built-in tiny random Llama and its adapters (no other flags needed)",
    "adapters": "register an adapter: NAME=DIR (repeatable)",
    "adapter_dirs": "register every adapter found in the subdirectories of DIR, by name (repeatable)",
    "adapter_roots": "where adapters may be loaded from through the API (repeatable; none: API loads refused)",
    "state_dir": "where adapters registered through the API are remembered across restarts",
    "device": "auto|cpu|cuda|cuda:N",
    "dtype": "|".join(DTYPE_CHOICES),
    "quantization": "auto|fp8|none: the base model's projection weights in FP8 E4M3 (fp8: a bf16/fp16 checkpoint "
                    "quantized at load, per output channel; auto: as the checkpoint holds them; needs compute capability 8.9)",
    "kv_cache_dtype": "auto|fp8: KV pages in the model dtype (auto) or FP8 E4M3 with a scale per layer for K and V "
                      "(twice the tokens in the pool)",
    "max_model_len": "default: the checkpoint's max_position_embeddings, capped at 8192",
    "max_running_requests": "requests decoding at once (default: one per 1024 positions the KV cache holds, "
                            "64 to 256; /v1/status and the start-up log say which)",
    "pool_bytes": "unified page pool bytes (K/M/G suffixes accepted)",
    "host_adapter_bytes": "host-memory budget of loaded adapters (K/M/G suffixes accepted)",
    "cold_start": "cached|ondemand|cpu|auto: what a request whose adapter is not in the pool waits for (default: auto "
                  "on cuda with --tensor-parallel-size 1, ondemand elsewhere; the log and /v1/status say which and why)",
    "cpu_workers": "CPU LoRA worker processes for --cold-start cpu|auto (0: min(4, cores - 1))",
    "cpu_lora_split": "auto|tokens|groups: how the CPU workers share an assisted prompt's LoRA: each its own tokens, "
                      "or all the tokens and a chunk of the adapter's columns (auto: from the costs measured at start)",
    "pinned_host_bytes": "on cuda: adapters kept staged in pinned host memory, pinned at start-up (K/M/G suffixes accepted)",
    "stager_threads": "on cuda: background threads that read cold adapters and lay them out in pages (0: min(4, cores))",
    "layerwise": "--cold-start cpu|auto: copy a cold adapter layer by layer and move each layer of a "
                 "cpu-assisted prefill to the GPU as soon as it has arrived",
    "profile_path": "lorad profile's performance models, from which each decode step's LoRA kernel is chosen "
                    "(default: STATE_DIR or ~/.cache/lorad, /profile-MODEL-DEVICE.json, -tpN.json under tensor parallelism, "
                    "when it exists; off: none, MBGMV)",
    "profile_at_start": "with no profile at the default --profile-path: on cuda, measure one before the model loads "
                        "(as lorad profile does; about 100 s for a 7B model on an H200) and save it there for the next "
                        "starts (default: on; --no-profile-at-start: off)",
    "lora_kernel": "auto|bgmv|mbgmv: the decode steps' LoRA kernel (auto: chosen per step from the profile's models; "
                   "MBGMV without a profile)",
    "admission": "fcfs|early-abort|cluster: which waiting requests join a step (early-abort drops those that "
                 "cannot meet --slo-ttft-ms; cluster caps the running batch's distinct adapters)",
    "slo_ttft_ms": "time-to-first-token objective in ms (0: none; early-abort needs one)",
    "fuse_lora_groups": "on cuda: a decode step's LoRA over q, k, v (and over gate, up) in one launch pair instead "
                        "of one per projection, a mixed step's decode rows likewise, and a step's prompt rows' "
                        "shrinks in one launch (--no-fuse-lora-groups: one per projection)",
    "lora_pdl": "auto|on|off: on Hopper and later, a decode step's LoRA expand kernel starts loading its adapter "
                "weights while the shrink still runs (programmatic dependent launch); auto: on where supported",
    "decode_pdl": "auto|on|off: on Hopper and later, each kernel of a decode step is launched while the one before it "
                  "still runs and waits for it on the device (programmatic dependent launch); auto: on where supported (with FP8 "
                  "weights: in one-row steps)",
    "kv_growth_reserve": "a request joins the running batch only while the KV cache left holds what the running "
                         "requests are expected to generate (the share of their max_tokens that finished requests "
                         "used), so that the batch does not outgrow the cache and preempt; without it, it joins when "
                         "its prompt's KV is free",
    "kv_admission_headroom": "KV positions a request joining the running batch leaves free for each running request "
                             "and itself (0: none): a full cache preempts its newest request as the batch grows, and "
                             "that request would rejoin and be preempted again",
    "overlap_decode": "greedy decode steps launched one ahead of the host, from the sampled tokens on the device "
                      "(--no-overlap-decode: each step waits for its tokens first)",
    "slo_tpot_ms": "time-per-output-token objective in ms (0: none); with a profile loaded, no request joins a running "
                   "batch whose predicted decode step would break it",
    "tensor_parallel_size": "split the model over N GPUs of this host (one engine process per GPU, NCCL); N divides "
                            "the attention heads and the intermediate size; not with --cold-start cpu|auto",
    "all_reduce": "auto|nccl|fused: under tensor parallelism, how o's and down's partial outputs are summed over "
                  "the GPUs (fused, two GPUs only: a decode step's sums in one kernel with the residual add and "
                  "RMSNorm after them, reading the other GPU's partial over NVLink, NCCL for larger steps; auto: fused "
                  "on two GPUs, nccl on more; the log and /v1/status say which runs)",
    "cluster_max_adapters": "--admission cluster (or early-abort): distinct adapters in the running batch before "
                            "other adapters' requests wait (at most the TTFT objective, else 1 s)",
}
_SERVER_FLAG_HELP = {
    "socket": "Unix socket to listen on",
    "socket_mode": "permissions of the socket, in octal",
    "listen": "also listen on TCP: tcp://HOST:PORT (a non-loopback host needs an API key)",
    "admin_group": "a group whose members may load and unload adapters over the socket (beside the daemon's user "
                   "and root)",
    "admin_api_key": "the key adapter admin over TCP needs (prefer LORAD_ADMIN_API_KEY); none: admin closed to TCP",
    "api_key": "the key TCP clients send as 'Authorization: Bearer KEY' (prefer LORAD_API_KEY in the environment or "
               "the config file: a flag shows in the process list)",
    "max_connections": "client connections at once, the socket's and TCP's together; past it a 503 and closed",
    "max_n": "choices per prompt a completion may ask for (n); a request's prompts x n stays at most 256",
    "header_timeout_s": "seconds a new connection has to send its first request's headers",
    "keepalive_timeout_s": "seconds an idle connection is kept between requests",
    "log_level": "debug|info|warning|error",
    "shutdown_grace_s": "on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted",
}


def _byte_size(text: str) -> int:
    from lorad.daemon.server.settings import parse_byte_size

    try:
        return parse_byte_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _adapter_pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, not {text!r}")
    return name, path


def _converter(field: dataclasses.Field):
    kind = str(field.type).replace(" | None", "")
    if field.name.endswith("_bytes"):
        return _byte_size
    if field.name.endswith("_mode"):
        return octal_mode
    return {"int": int, "float": float, "str": str}.get(kind)


def _add_config_flags(parser: argparse.ArgumentParser, config_class, helps: dict, dest_prefix: str) -> None:
    """One flag per field; a flag not given is not passed, so the dataclass's default applies."""
    for field in dataclasses.fields(config_class):
        flag, metavar = f"--{field.name.replace('_', '-')}", field.name.upper()
        options = {"dest": f"{dest_prefix}{field.name}", "default": argparse.SUPPRESS}
        # lorad serve's own defaults (config.SERVE_DEFAULTS) are told by the field's help
        shown = field.name not in SERVE_DEFAULTS and field.default not in (None, ())
        default_note = f" (default: {_default_text(field)})" if shown else ""
        help_text = (helps.get(field.name, "") + default_note).strip()
        if field.name == "adapters":  # repeated NAME=DIR pairs
            parser.add_argument("--adapter", action="append", type=_adapter_pair, metavar="NAME=DIR",
                                help=help_text, **options)
        elif str(field.type) == "tuple[str, ...]":  # repeated: adapter_dirs is --adapter-dir DIR ...
            singular = field.name.removesuffix("s").replace("_", "-")
            parser.add_argument(f"--{singular}", action="append", metavar="DIR", help=help_text, **options)
        elif str(field.type) == "bool":  # --flag; --flag/--no-flag when it is on by default
            on = field.default is True or SERVE_DEFAULTS.get(field.name) is True
            action = argparse.BooleanOptionalAction if on else "store_true"
            parser.add_argument(flag, action=action, help=helps.get(field.name), **options)
        else:
            converter = _converter(field)
            if converter is None:
                raise TypeError(f"no flag type for {config_class.__name__}.{field.name}: {field.type}")
            metavar = {"model": "DIR", "socket": "PATH"}.get(field.name) or {
                _byte_size: "BYTES", octal_mode: "MODE", int: "N", float: "X"}.get(converter, metavar)
            parser.add_argument(flag, type=converter, metavar=metavar, help=help_text, **options)


def _default_text(field: dataclasses.Field) -> str:
    if field.name.endswith("_mode"):
        return oct(field.default)[2:]
    return str(field.default)


def _config_values(args: argparse.Namespace, prefix: str) -> dict:
    values = {name[len(prefix):]: value for name, value in vars(args).items() if name.startswith(prefix)}
    for name, value in values.items():
        if isinstance(value, list):  # repeated flags
            values[name] = tuple(value)
    return values


def _ranks(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive ranks."""
    try:
        ranks = tuple(int(rank) for rank in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks, not {text!r}") from None
    if min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ranks, not {text!r}")
    return ranks


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lorad", description="Serve many LoRA adapters on one base model.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    serve = commands.add_parser("serve", help="run the daemon on a Unix socket")
    serve.add_argument("--config", metavar="PATH",
                       help="TOML config file ([engine], [server]; flags given win over it) "
                            "(default: /etc/lorad/lorad.toml when it exists)")
    _add_config_flags(serve, EngineConfig, _ENGINE_FLAG_HELP, "engine.")
    _add_config_flags(serve, ServerConfig, _SERVER_FLAG_HELP, "server.")

    for name, what in (("generate", "stream one completion from a running daemon"),
                       ("adapters", "list, load or unload the adapters of a running daemon"),
                       ("status", "the running daemon's engine state")):
        commands.add_parser(name, help=f"{what} (lorad {name} --help)", add_help=False)  # client_cli.py parses these
    for name, what in (("trace", "make a request trace (trace make)"),
                       ("simulate", "simulate engines serving a trace under routing policies"),
                       ("bench", "replay a trace against a running daemon (bench trace)")):
        commands.add_parser(name, help=f"{what} (lorad {name} --help)", add_help=False)  # daemon/bench/cli.py parses these
    commands.add_parser("profile", help="measure this machine's LoRA kernels, decode steps and prefills; fit and save "
                        "the performance models (lorad profile --help)", add_help=False)  # daemon/bench/profile.py parses it
    commands.add_parser("router", help="one socket in front of several lorad engines (lorad router --help)",
                        add_help=False)  # daemon/router/cli.py parses it

    demo = commands.add_parser("demo", help="write random PEFT adapters for a model shape (benchmarks)")
    demo_commands = demo.add_subparsers(dest="demo_command", required=True, parser_class=Parser)
    adapters = demo_commands.add_parser("adapters", help="write N random PEFT adapters")
    shape = adapters.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model", metavar="DIR", help="a checkpoint directory whose config.json gives the shape")
    shape.add_argument("--model-config", metavar="NAME", help="a known shape, e.g. llama-2-7b or tiny-llama")
    adapters.add_argument("--count", type=number(int, 1, 100_000), required=True, metavar="N")
    adapters.add_argument("--ranks", type=_ranks, default=(8,), metavar="R,R,...",
                          help="ranks, round robin (default: 8)")
    adapters.add_argument("--targets", default="q,k,v,o", metavar="P,P,...", help="projections (default: q,k,v,o)")
    adapters.add_argument("--seed", type=SEED, default=0)
    adapters.add_argument("--out", required=True, metavar="DIR")

    install = commands.add_parser("install-systemd", help="install lorad.service, lorad.socket and a sample config")
    install.add_argument("--prefix", default="/", help="root to install under (default: /)")
    install.add_argument("--dry-run", action="store_true", help="say what would be written, write nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from lorad.daemon.server.client_cli import COMMANDS, client_main

    if argv and argv[0] in COMMANDS:  # the commands that talk to a running daemon
        return client_main(argv)
    from lorad.daemon.bench.cli import COMMANDS as BENCH_COMMANDS
    from lorad.daemon.bench.cli import bench_main

    if argv and argv[0] in BENCH_COMMANDS:  # traces, simulation, replay
        return bench_main(argv)
    if argv and argv[0] == "profile":  # performance models of this machine
        from lorad.daemon.bench.profile import profile_main

        return profile_main(argv[1:])
    if argv and argv[0] == "router":  # one front socket over several engines
        from lorad.daemon.router.cli import router_main

        return router_main(argv[1:])
    args = parse(build_parser(), argv)
    if isinstance(args, int):
        return args
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "demo":
            return demo_adapters(args)
        return install_systemd(args)
    except LoradError as error:
        print(f"lorad: {error.message}", file=sys.stderr)
        return 2
    except OSError as error:  # a path to write under that is a file, or not ours (demo adapters, install-systemd)
        where = f"{error.filename}: " if error.filename is not None else ""
        print(f"lorad: {where}{error.strerror or error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# --- lorad serve --------------------------------------------------------------------------------------
#
# Two processes: this one (the API: aiohttp on the Unix socket, no torch) and the engine's
# (daemon/engine/process.py). Signals come here: SIGTERM/SIGINT stop accepting, let running requests
# finish for shutdown_grace_s, abort the rest and exit 0; SIGHUP re-reads the config file's adapters.
# If the engine process dies, every request in flight fails at once and serve exits 1 (systemd's
# Restart=on-failure starts a fresh daemon).

EXIT_ENGINE_DIED = 1


def serve(args: argparse.Namespace) -> int:
    from lorad.daemon.server import systemd
    from lorad.daemon.server.settings import resolve

    cli_engine, cli_server = _config_values(args, "engine."), _config_values(args, "server.")
    config_path = getattr(args, "config", None)
    config, used_path = resolve(cli_engine, cli_server, config_path)
    setup_logging(config.server.log_level)
    if used_path is not None:
        log.info("config file=%s", used_path)

    from lorad.daemon.server import tcp

    api_key = config.server.api_key or os.environ.get(tcp.API_KEY_ENV, "")
    tcp_address = tcp.check_listen(config.server.listen, api_key)  # before the model loads: a refusal is quick
    from lorad.daemon.server.admin_gate import ADMIN_API_KEY_ENV, AdminGate

    admin = AdminGate.from_config(config.server.admin_group,
                                  config.server.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV, ""))
    _raise_descriptor_limit()
    passed = systemd.listen_fds()
    if len(passed) > 1:
        raise BadRequest(f"systemd passed {len(passed)} sockets; lorad.socket must have exactly one ListenStream")
    if passed:
        try:
            listener = systemd.unix_listener(passed[0])
        except ValueError as error:
            raise BadRequest(str(error)) from None
        path = listener.getsockname()
        path = path.decode(errors="replace") if isinstance(path, bytes) else path
    else:
        listener, path = None, config.server.socket
        try:
            unix_socket.claim_path(path)
        except OSError as error:
            raise BadRequest(f"cannot use the socket {path}: {error.strerror or error}") from None

    from lorad.daemon.engine.process import EngineProcess

    engine = EngineProcess(config.engine)
    # Until the event loop takes the signals over: a stop is a clean stop (SIGINT already raises
    # KeyboardInterrupt), a reload has nothing to reload yet.
    previous_term = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        model = "demo" if config.engine.demo else config.engine.model or config.engine.model_config
        systemd.notify(f"STATUS=loading the model ({model})")
        engine.start()
        _log_engine(engine, config.engine)

        def reload_config() -> Config:
            return resolve(cli_engine, cli_server, config_path)[0]

        return run_event_loop(_serve(engine, config, listener, path, reload_config, tcp_address, api_key, admin))
    except KeyboardInterrupt:
        log.info("stopped while loading the model" if engine.model_name is None else "stop signal before serving")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGHUP, previous_hup)
        engine.stop()
        if listener is None:  # a socket systemd passed is systemd's to remove
            unix_socket.remove(path)
        if engine.model_name is not None:
            log.info("stopped")


def _raise_descriptor_limit() -> None:
    """The soft limit on open descriptors up to the hard one: each client connection holds one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open file limit raised from %d to %d", soft, hard)
        except (ValueError, OSError) as error:
            log.warning("open file limit stays %d (raising it to %d failed: %s)", soft, hard, error)


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def setup_logging(level_name: str) -> None:
    level = logging.getLevelName(level_name.upper())
    if not isinstance(level, int):
        raise BadRequest(f"log level must be one of debug, info, warning, error, not {level_name!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)


def _log_engine(engine, config: EngineConfig) -> None:
    adapter_paths = [path for _, path in config.adapters] + list(config.adapter_dirs)
    log.info(
        "serving model=%s model_dir=%s device=%s dtype=%s max_model_len=%d adapters=%d adapter_paths=%s engine_pid=%d",
        engine.model_name, engine.model_dir, engine.device, engine.dtype, engine.max_model_len,
        len(engine.models()) - 1, ",".join(adapter_paths) or "-", engine.pid,
    )


def run_event_loop(main_coroutine):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_coroutine)
    return uvloop.run(main_coroutine)


async def _serve(engine, config: Config, listener: socket.socket | None, path: str, reload_config,
                 tcp_address: tuple[str, int] | None = None, api_key: str = "", admin=None) -> int:
    from aiohttp import web

    from lorad.daemon.server import systemd, tcp
    from lorad.daemon.server.api import IN_FLIGHT, create_app

    server = config.server
    loop = asyncio.get_running_loop()
    stop, died = asyncio.Event(), asyncio.Event()
    engine.on_death = lambda reason: loop.call_soon_threadsafe(died.set)
    if not engine.alive:
        died.set()
    hurry = asyncio.Event()  # a second SIGTERM/SIGINT: no more grace

    def on_stop_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_stop_signal)
    reloads: set[asyncio.Task] = set()

    def on_sighup() -> None:
        task = loop.create_task(_reload_adapters(engine, config.engine, reload_config))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)

    app = create_app(engine, admin, server.max_n)
    app.middlewares.insert(0, unix_socket.log_connection_peer)
    if tcp_address is not None and api_key:
        app.middlewares.append(tcp.require_api_key(api_key))  # inside the error middleware: a 401 is JSON
    runner = None
    try:
        if listener is None:
            try:
                listener = unix_socket.bind(path, server.socket_mode)
            except OSError as error:
                raise BadRequest(f"cannot listen on {path}: {error.strerror or error}") from None
            log.info("listening socket=%s mode=%o event_loop=%s", path, server.socket_mode, type(loop).__module__)
        else:
            log.info("listening socket=%s (from systemd) event_loop=%s", path, type(loop).__module__)
        runner = await unix_socket.serve(app, listener, server.max_connections, server.header_timeout_s,
                                         server.keepalive_timeout_s)
        if tcp_address is not None:
            host, port = tcp_address
            site = web.TCPSite(runner, host, port, backlog=unix_socket.LISTEN_BACKLOG)
            try:
                await site.start()
            except OSError as error:
                raise BadRequest(f"cannot listen on tcp://{host}:{port}: {error.strerror or error}") from None
            log.info("listening tcp=%s:%d api_key=%s", host, port, "required" if api_key else "off (loopback)")
        systemd.notify(f"READY=1\nSTATUS=serving model={engine.model_name} socket={path}")
        watchdog = systemd.watchdog_interval()
        pinger = loop.create_task(_watchdog(engine, watchdog)) if watchdog else None

        waiters = [loop.create_task(stop.wait()), loop.create_task(died.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        engine_died = died.is_set()
        systemd.notify("STOPPING=1\nSTATUS=" + ("the engine process died" if engine_died else "stopping"))
        for site in runner.sites:
            await site.stop()  # the listener is closed: no new connections
        runner.server.pre_shutdown()  # idle keep-alive connections close; running requests go on
        in_flight = app[IN_FLIGHT]
        if not engine_died and in_flight:
            log.info("shutting down: no new connections, %d requests running, grace_s=%.0f", len(in_flight), server.shutdown_grace_s)
            deadline = loop.time() + server.shutdown_grace_s
            while in_flight and loop.time() < deadline and not hurry.is_set():
                await asyncio.sleep(0.02)
            if in_flight:
                log.warning("shutdown grace over: aborting %d requests still running", len(in_flight))
        else:
            log.info("shutting down: no new connections, nothing running" if not engine_died else
                     "shutting down: the engine process died")
        if pinger is not None:
            pinger.cancel()
    finally:
        if runner is not None:
            await runner.cleanup()  # the API aborts whatever still runs, handlers answer, connections close
        # Before the loop closes: that waits for its executor's threads, and a call to an engine that
        # stopped answering only returns once the engine process is gone.
        engine.stop()
    return EXIT_ENGINE_DIED if engine_died else 0


async def _watchdog(engine, interval: float) -> None:
    """WATCHDOG=1 every `interval` while the engine process lives and answers: each ping waits for the
    answer to a status() sent one interval before, so an engine that stopped answering (a deadlock, a
    wedged device call holding its lock) stops the pings and systemd restarts the daemon."""
    from lorad.daemon.server import systemd

    loop = asyncio.get_running_loop()
    probe = None
    while True:
        answered = probe is None or (probe.done() and probe.exception() is None)
        if engine.alive and answered:  # a dead engine gets no pings either
            systemd.notify("WATCHDOG=1")
        if probe is None or probe.done():
            probe = loop.run_in_executor(None, engine.status)
        await asyncio.sleep(interval)


async def _reload_adapters(engine, current: EngineConfig, reload_config) -> None:
    """SIGHUP: the config file's adapters become the registered ones (API registrations untouched)."""
    log.info("SIGHUP: reloading the adapters of the config file")
    try:
        fresh = reload_config()
    except LoradError as error:
        log.error("reload refused, nothing changed: %s", error.message)
        return
    ignored = [field.name for field in dataclasses.fields(EngineConfig)
               if field.name not in ("adapters", "adapter_dirs") and getattr(fresh.engine, field.name) != getattr(current, field.name)]
    if ignored:
        log.warning("reload: changes to %s take effect at the next restart", ",".join(ignored))
    loop = asyncio.get_running_loop()
    try:
        changes = await loop.run_in_executor(None, engine.reload_adapters, fresh.engine.adapters, fresh.engine.adapter_dirs)
    except LoradError as error:
        log.error("reload failed: %s", error.message)
        return
    log.info(
        "adapters reloaded added=%s removed=%s changed=%s restored=%s failed=%d",
        ",".join(changes["added"]) or "-", ",".join(changes["removed"]) or "-", ",".join(changes["changed"]) or "-",
        ",".join(changes["restored"]) or "-", len(changes["failed"]),
    )
    for name, reason in changes["failed"].items():
        log.error("adapter not registered name=%s reason=%s", name, reason)


# --- lorad demo adapters --------------------------------------------------------------------------------


def demo_adapters(args: argparse.Namespace) -> int:
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec, load_spec
    from lorad.daemon.model.demo import write_adapter_set

    if args.model_config is not None:
        if args.model_config not in MODEL_CONFIGS:
            raise BadRequest(f"unknown model config {args.model_config!r}: one of {', '.join(MODEL_CONFIGS)}")
        spec = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config])
    else:
        spec = load_spec(args.model)
    try:
        written = write_adapter_set(args.out, spec, args.count, list(args.ranks), args.targets.split(","), args.seed)
    except ValueError as error:
        raise BadRequest(str(error)) from None
    print(f"wrote {len(written)} adapters under {args.out} (serve them with --adapter-dir {args.out})")
    return 0


# --- lorad install-systemd ---------------------------------------------------------------------------------


def install_systemd(args: argparse.Namespace) -> int:
    from lorad.daemon.server.systemd import install

    actions, next_steps = install(args.prefix, args.dry_run, _lorad_command())
    for line in actions:
        print(line)
    print("\nnext:" if not args.dry_run else "\nthen:")
    for line in next_steps:
        print(f"  {line}")
    return 0


def _lorad_command() -> str:
    """How the unit should start this lorad: the script next to this Python (a venv's), else via PATH."""
    script = Path(sys.executable).with_name("lorad")
    return str(script) if script.exists() else "/usr/bin/env lorad"


if __name__ == "__main__":
    sys.exit(main())
