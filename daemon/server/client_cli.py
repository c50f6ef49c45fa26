"""The client side of the `lorad` command: `generate`, `adapters list|load|unload` and `status` talk to a
running daemon over its socket. daemon/server/cli.py hands them `client_main(argv)`.

Exit codes: 0 done, 1 no daemon answers on the socket, 2 bad usage or the daemon refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lorad.daemon.server.cli_args import Parser, parse
from lorad.client import Client

from lorad.config import ServerConfig
from lorad.errors import LoradError

COMMANDS = ("generate", "adapters", "status")
OK, UNREACHABLE, REFUSED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lorad", description="Talk to a running lorad daemon.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    socket_help = f"the daemon's Unix socket (default: {ServerConfig.socket})"

    generate = commands.add_parser("generate", help="stream one completion to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--adapter", "--model", dest="model", metavar="NAME",
                          help="adapter (or base model) name (default: the base model)")
    generate.add_argument("--max-tokens", type=int, metavar="N")
    generate.add_argument("--temperature", type=float, metavar="X")
    generate.add_argument("--top-p", type=float, metavar="X")
    generate.add_argument("--top-k", type=int, metavar="N")
    generate.add_argument("--seed", type=int, metavar="N")
    generate.add_argument("--socket", default=ServerConfig.socket, metavar="PATH", help=socket_help)

    adapters = commands.add_parser("adapters", help="list, load or unload adapters")
    actions = adapters.add_subparsers(dest="action", required=True, parser_class=Parser)
    listing = actions.add_parser("list", help="every registered adapter: rank, targets, size, location")
    listing.add_argument("--json", action="store_true", help="the /v1/models entries as JSON")
    load = actions.add_parser("load", help="register an adapter directory (under the daemon's adapter roots)")
    load.add_argument("name")
    load.add_argument("path")
    unload = actions.add_parser("unload", help="unregister an adapter (its running requests finish first)")
    unload.add_argument("name")
    for sub in (listing, load, unload):
        sub.add_argument("--socket", default=ServerConfig.socket, metavar="PATH", help=socket_help)

    status = commands.add_parser("status", help="the engine's state: device, pool, queues")
    status.add_argument("--json", action="store_true", help="as JSON")
    status.add_argument("--socket", default=ServerConfig.socket, metavar="PATH", help=socket_help)
    return parser


def client_main(argv: list[str]) -> int:
    """Runs `lorad <argv>` where argv[0] is one of COMMANDS, e.g.
    `client_main(["adapters", "load", "sql", "/adapters/sql"])`; returns the exit code."""
    args = parse(build_parser(), argv, COMMANDS)
    if isinstance(args, int):
        return args
    client = Client(args.socket)
    try:
        if args.command == "generate":
            return _generate(client, args)
        if args.command == "status":
            return _status(client, args)
        return _adapters(client, args)
    except _ReaderGone:  # `lorad status | head`: what was read is all that was wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush finds no pipe
        return OK
    except LoradError as error:
        print(f"lorad: the daemon refused: {error.message}", file=sys.stderr)
        return REFUSED
    except OSError as error:  # nothing listens, no permission, or it stopped answering
        reason = error.strerror or str(error) or type(error).__name__
        print(f"lorad: cannot reach the daemon at {args.socket}: {reason} (is `lorad serve` running?)",
              file=sys.stderr)
        return UNREACHABLE
    except KeyboardInterrupt:
        return 130


class _ReaderGone(Exception):
    """Standard output's reader closed the pipe."""


def _say(text: str, end: str = "\n") -> None:
    """`text` on standard output, now; _ReaderGone once nobody reads it (a broken pipe to the daemon stays an
    OSError)."""
    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError:
        raise _ReaderGone from None


def _generate(client: Client, args: argparse.Namespace) -> int:
    fields = {"prompt": args.prompt}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    fields["model"] = args.model or client.models()[0]["id"]
    finish_reason, started = None, False
    try:
        for chunk in client.stream_completions(**fields):
            for choice in chunk["choices"]:
                _say(choice["text"], end="")
                started = True
                finish_reason = choice.get("finish_reason") or finish_reason
    finally:
        if started:  # end the completion's line; a refusal before it prints only its message
            _say("")
    if finish_reason == "abort":
        print("lorad: the daemon stopped the request before it finished", file=sys.stderr)
        return REFUSED
    return OK


def _adapters(client: Client, args: argparse.Namespace) -> int:
    if args.action == "load":
        entry = client.load_adapter(args.name, os.path.abspath(args.path))  # the daemon's cwd is not ours
        _say(f"loaded {entry['id']}: rank {entry.get('rank')}, targets {','.join(entry.get('targets') or [])}, "
              f"{_human_bytes(entry.get('nbytes'))}, from {entry.get('path')}")
        return OK
    if args.action == "unload":
        client.unload_adapter(args.name)
        _say(f"unloaded {args.name} (requests already running finish first)")
        return OK
    adapters = [entry for entry in client.models() if entry.get("kind") == "lora"]
    if args.json:
        _say(json.dumps(adapters, indent=1))
        return OK
    rows = [("NAME", "RANK", "TARGETS", "SIZE", "LOCATION", "PATH")]
    for entry in adapters:
        rows.append((
            entry["id"], "-" if entry.get("rank") is None else str(entry["rank"]),
            ",".join(_projection(t) for t in entry.get("targets") or []) or "-", _human_bytes(entry.get("nbytes")),
            entry.get("location", "-"), entry.get("path", "-") + (f"  ({entry['error']})" if entry.get("error") else ""),
        ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return OK


def _status(client: Client, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        _say(json.dumps(status, indent=1))
        return OK
    for key, value in status.items():
        if isinstance(value, dict):
            value = " ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list):
            value = ",".join(map(str, value)) or "-"
        _say(f"{key}: {value}")
    return OK


def _projection(target: str) -> str:
    return target.removesuffix("_proj")


def _human_bytes(nbytes) -> str:
    if nbytes is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return "-"


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1:]))
