"""Argument parsing shared by the `lorad` commands: errors as one line and exit code 2, never a usage
dump or a traceback."""

from __future__ import annotations

import argparse
import sys

USAGE_EXIT = 2


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump: parse() prints it
        raise UsageError(f"{self.prog}: {message}")


def octal_mode(text: str) -> int:
    """An argparse type: a file mode in octal ("660")."""
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r}") from None


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
