"""Reading the JSON files the scheduler's models are saved in (traces, profiles): a file that cannot be
read or parsed is a BadRequest naming what it should have been."""

from __future__ import annotations

import json
from pathlib import Path

from lorad.errors import BadRequest


def read_json(path: str | Path, what: str):
    """The parsed contents of `path`; `what` names the file in the error ("trace", "profile")."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: not JSON (JSONDecodeError), or not UTF-8
        raise BadRequest(f"cannot read {what} {path}: {error}") from None
