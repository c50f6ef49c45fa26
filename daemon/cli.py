"""The `lorad` command: `lorad serve` runs the daemon on a Unix socket, `lorad generate` streams one
completion from a running daemon. Flags map one to one onto lorad.config's fields, whose defaults are
the only ones.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import signal
import socket
import stat
import sys
from pathlib import Path

from lorad.config import DTYPES, Config, EngineConfig, ServerConfig
from lorad.errors import BadRequest, LoradError

log = logging.getLogger(__name__)

_SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL

# Flags whose name or shape differs from their field; every other field of EngineConfig/ServerConfig
# becomes --field-name with the field's type.
_ENGINE_FLAG_HELP = {
    "model": "Hugging Face checkpoint directory of the base model",
    "demo": "serve the built-in tiny random Llama and its adapters (no other flags needed)",
    "adapters": "register an adapter: NAME=DIR (repeatable)",
    "adapter_dirs": "register every adapter found in the subdirectories of DIR, by name (repeatable)",
    "device": "auto|cpu|cuda|cuda:N",
    "dtype": "|".join(DTYPES),
    "max_model_len": "default: the checkpoint's max_position_embeddings, capped at 8192",
    "pool_bytes": "unified page pool bytes (K/M/G suffixes accepted)",
    "host_adapter_bytes": "host-memory budget of loaded adapters (K/M/G suffixes accepted)",
}
_SERVER_FLAG_HELP = {
    "socket": "Unix socket to listen on",
    "socket_mode": "permissions of the socket, in octal",
    "log_level": "debug|info|warning|error",
}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: the caller prints it and exits 2
        raise _UsageError(f"{self.prog}: {message}")


def _byte_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(value[-1:], 1)
    if scale != 1:
        value = value[:-1]
    try:
        return int(float(value) * scale) if scale != 1 else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 8G, 512M, 1048576)") from None


def _adapter_pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, not {text!r}")
    return name, path


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None


def _converter(field: dataclasses.Field):
    kind = str(field.type).replace(" | None", "")
    if field.name.endswith("_bytes"):
        return _byte_size
    if field.name.endswith("_mode"):
        return _octal
    return {"int": int, "float": float, "str": str}.get(kind)


def _add_config_flags(parser: argparse.ArgumentParser, config_class, helps: dict, dest_prefix: str) -> None:
    """One flag per field; a flag not given is not passed, so the dataclass's default applies."""
    for field in dataclasses.fields(config_class):
        flag, metavar = f"--{field.name.replace('_', '-')}", field.name.upper()
        options = {"dest": f"{dest_prefix}{field.name}", "default": argparse.SUPPRESS}
        default_note = "" if field.default in (None, ()) else f" (default: {_show(field)})"
        help_text = (helps.get(field.name, "") + default_note).strip()
        if field.name == "adapters":  # repeated NAME=DIR pairs
            parser.add_argument("--adapter", action="append", type=_adapter_pair, metavar="NAME=DIR",
                                help=help_text, **options)
        elif field.name == "adapter_dirs":
            parser.add_argument("--adapter-dir", action="append", metavar="DIR", help=help_text, **options)
        elif str(field.type) == "bool":
            parser.add_argument(flag, action="store_true", help=helps.get(field.name), **options)
        else:
            converter = _converter(field)
            if converter is None:
                raise TypeError(f"no flag type for {config_class.__name__}.{field.name}: {field.type}")
            metavar = {"model": "DIR", "socket": "PATH"}.get(field.name) or {
                _byte_size: "BYTES", _octal: "MODE", int: "N", float: "X"}.get(converter, metavar)
            parser.add_argument(flag, type=converter, metavar=metavar, help=help_text, **options)


def _show(field: dataclasses.Field) -> str:
    if field.name.endswith("_mode"):
        return oct(field.default)[2:]
    return str(field.default)


def _config_values(args: argparse.Namespace, prefix: str) -> dict:
    values = {name[len(prefix):]: value for name, value in vars(args).items() if name.startswith(prefix)}
    for name in ("adapters", "adapter_dirs"):
        if name in values:
            values[name] = tuple(values[name])
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lorad", description="Serve many LoRA adapters on one base model.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser("serve", help="run the daemon on a Unix socket")
    _add_config_flags(serve, EngineConfig, _ENGINE_FLAG_HELP, "engine.")
    _add_config_flags(serve, ServerConfig, _SERVER_FLAG_HELP, "server.")

    generate = commands.add_parser("generate", help="stream one completion from a running daemon")
    generate.add_argument("prompt")
    generate.add_argument("--socket", default=ServerConfig.socket, help=f"(default: {ServerConfig.socket})")
    generate.add_argument("--model", help="base model or adapter name (default: the base model)")
    generate.add_argument("--max-tokens", type=int)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--seed", type=int)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as error:
        print(f"{error} (see lorad --help)", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    try:
        if args.command == "serve":
            return serve(args)
        return generate(args)
    except LoradError as error:
        print(f"lorad: {error.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# --- lorad serve --------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    engine_values = _config_values(args, "engine.")
    if not engine_values.get("demo") and not engine_values.get("model"):
        raise BadRequest("serve needs --model DIR (or --demo)")
    if engine_values.get("demo") and engine_values.get("model"):
        raise BadRequest("--demo serves the built-in model: leave out --model")
    server_values = _config_values(args, "server.")
    config = Config(engine=EngineConfig(**engine_values), server=ServerConfig(**server_values))
    _setup_logging(config.server.log_level)
    path = config.server.socket
    try:
        _claim_socket_path(path)
    except OSError as error:
        raise BadRequest(f"cannot use the socket {path}: {error.strerror or error}") from None

    # A stop asked for while the model loads is a clean stop too (SIGINT already raises KeyboardInterrupt).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        from lorad.daemon.engine import Engine  # torch and the model: only once the flags are good

        engine = Engine(config.engine)
    except KeyboardInterrupt:
        log.info("stopped while loading the model")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    _log_engine(engine, config.engine)
    engine.start()
    try:
        _run_event_loop(_serve(engine, config.server))
    finally:
        engine.stop()
        _remove_socket(path)
        log.info("stopped")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _setup_logging(level_name: str) -> None:
    level = logging.getLevelName(level_name.upper())
    if not isinstance(level, int):
        raise BadRequest(f"log level must be one of debug, info, warning, error, not {level_name!r}")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)


def _claim_socket_path(path: str) -> None:
    """Make `path` free to bind: create its parent, remove a stale socket; refuse if a daemon listens."""
    if len(os.fsencode(path)) > _SOCKET_PATH_MAX:
        raise BadRequest(f"socket path is longer than {_SOCKET_PATH_MAX} bytes: {path}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BadRequest(f"{path} exists and is not a socket; not touching it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as error:
        if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        log.info("removing stale socket path=%s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise BadRequest(f"another lorad is already listening on {path}")


def _remove_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _log_engine(engine, config: EngineConfig) -> None:
    model_dir, adapter_paths = config.model, [path for _, path in config.adapters] + list(config.adapter_dirs)
    if config.demo:
        from lorad.daemon.demo import default_demo_root

        model_dir = default_demo_root() / "model"
        adapter_paths.append(str(default_demo_root() / "adapters"))
    log.info(
        "serving model=%s model_dir=%s device=%s dtype=%s max_model_len=%d adapters=%d adapter_paths=%s",
        engine.model_name,
        model_dir,
        engine.device,
        str(engine.dtype).removeprefix("torch."),
        engine.max_model_len,
        len(engine.models()) - 1,
        ",".join(adapter_paths) or "-",
    )


def _run_event_loop(main_coroutine) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coroutine)
    else:
        uvloop.run(main_coroutine)


async def _serve(engine, server: ServerConfig) -> None:
    from lorad.daemon.api import create_app, serve_unix

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        runner = await serve_unix(create_app(engine), server.socket, server.socket_mode)
    except OSError as error:
        raise BadRequest(f"cannot listen on {server.socket}: {error.strerror or error}") from None
    log.info("listening socket=%s mode=%o event_loop=%s", server.socket, server.socket_mode, type(loop).__module__)
    await stop.wait()
    log.info("shutting down: no new connections, aborting running requests")
    await runner.cleanup()


# --- lorad generate -------------------------------------------------------------------------------------


def generate(args: argparse.Namespace) -> int:
    from lorad.daemon.client import Client

    client = Client(args.socket)
    fields = {"prompt": args.prompt}
    for name in ("max_tokens", "temperature", "seed"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    try:
        fields["model"] = args.model or client.models()[0]["id"]
        for chunk in client.stream_completions(**fields):
            if chunk["choices"]:
                sys.stdout.write(chunk["choices"][0]["text"])
                sys.stdout.flush()
    except OSError as error:
        print(f"lorad: cannot talk to the daemon at {args.socket}: {error.strerror or error}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
