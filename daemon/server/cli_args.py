"""Argument parsing shared by the `lorad` commands: errors as one line and exit code 2, never a usage
dump or a traceback."""

from __future__ import annotations

import argparse
import math
import sys

USAGE_EXIT = 2


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: parse() prints it
        raise UsageError(f"{self.prog}: {message}")


def octal_mode(text: str) -> int:
    """An argparse type: a file's permission bits in octal ("660"), at most 777 (no setuid, setgid or sticky bit)."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"not a mode of permission bits from 0 to 777: {text!r}")
    return mode


def number(kind=float, least=None, most=None, positive: bool = False):
    """An argparse type: `kind(text)` (int, or a finite float) that is > 0 when `positive`, and within [least, most]
    where given; otherwise the flag's error says what it takes."""
    what = ("a positive " if positive else "an " if kind is int else "a ") + ("integer" if kind is int else "number")

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}") from None
        if not math.isfinite(value) or (positive and not value > 0):
            raise argparse.ArgumentTypeError(f"expected {what}, not {text!r}")
        if least is not None and value < least or most is not None and value > most:
            bounds = f"from {least} to {most}" if least is not None and most is not None else \
                f"of at least {least}" if least is not None else f"of at most {most}"
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}, not {text!r}")
        return value

    return convert


SEED = number(int, 0, 2**63 - 1)  # numpy's and torch's generators take seeds >= 0
LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level(text: str) -> str:
    """An argparse type: one of LOG_LEVELS."""
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LOG_LEVELS)}, not {text!r}")
    return text.lower()


def check_out(path, flag: str = "--out", make_parents: bool = False) -> None:
    """Refuses, before any work, a path a command's result could not be written to: a directory, a path under a
    file, or (unless the command makes them: `make_parents`) under a directory that does not exist."""
    from pathlib import Path

    from lorad.errors import BadRequest

    if path is None:
        return
    path = Path(path).resolve()
    if path.is_dir():
        raise BadRequest(f"{flag} {path} is a directory: give a file's path")
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        raise BadRequest(f"{flag} {path}: {existing} is not a directory")
    if existing != path.parent and not make_parents:
        raise BadRequest(f"{flag} {path}: the directory {path.parent} does not exist")


def parse(parser: argparse.ArgumentParser, argv: list[str], commands: tuple[str, ...] = ()) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code to return (2 after a one-line message; --help's code)."""
    try:
        return parser.parse_args(argv)
    except UsageError as error:
        hint = f"lorad {argv[0]} --help" if argv and argv[0] in commands else "lorad --help"
        print(f"{error} (see {hint})", file=sys.stderr)
        return USAGE_EXIT
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
