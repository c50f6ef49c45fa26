"""The configuration file, /etc/lorad/lorad.toml: sections [engine] and [server] whose keys are exactly
the fields of lorad.config's EngineConfig and ServerConfig, checked here once (unknown keys and wrong
types are refused naming the key and the section). Precedence, lowest first: config.py's defaults, `lorad
serve`'s own (config.SERVE_DEFAULTS: the profile measured at start, the cold-start mode chosen for the
device), what systemd tells us ($STATE_DIRECTORY, $RUNTIME_DIRECTORY), the file, the flags the user gave.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import typing
from pathlib import Path

from lorad.config import SERVE_DEFAULTS, Config, EngineConfig, ServerConfig
from lorad.errors import BadRequest

DEFAULT_PATH = "/etc/lorad/lorad.toml"
SECTIONS = {"engine": EngineConfig, "server": ServerConfig}
# Relative paths in the file are relative to the file's directory, not to wherever the daemon starts.
_PATH_FIELDS = {"model", "adapter_dirs", "adapter_roots", "state_dir", "socket"}


def resolve(cli_engine: dict, cli_server: dict, config_path: str | None = None,
            environ: typing.Mapping[str, str] = os.environ) -> tuple[Config, Path | None]:
    """The daemon's Config and the file it came from (None: no file). `cli_*` hold only the flags the
    user gave. Without `config_path` the default file is read when it exists."""
    path = Path(config_path) if config_path else Path(DEFAULT_PATH)
    if config_path and not path.is_file():
        raise BadRequest(f"config file {path} {'is not a file' if path.exists() else 'does not exist'}")
    used = path if path.is_file() else None
    sections = read_file(path) if used else {}
    engine = {**SERVE_DEFAULTS, **_systemd_engine(environ), **sections.get("engine", {}), **cli_engine}
    server = {**_systemd_server(environ), **sections.get("server", {}), **cli_server}
    if not engine.get("demo") and not engine.get("model") and not engine.get("model_config"):
        raise BadRequest('serve needs --model DIR (or --demo), or model = "DIR" in [engine] of the config file')
    if engine.get("demo") and engine.get("model"):
        raise BadRequest("--demo serves the built-in model: leave out --model (from the flags or the config file)")
    return Config(engine=EngineConfig(**engine), server=ServerConfig(**server)), used


def read_file(path: str | Path) -> dict[str, dict]:
    """{"engine": {field: value}, "server": {...}} from a lorad.toml, values already of the field's type."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"{path}: not valid TOML: {error}") from None
    except OSError as error:
        raise BadRequest(f"cannot read the config file {path}: {error.strerror or error}") from None
    sections = {}
    for section, table in document.items():
        config_class = SECTIONS.get(section)
        if config_class is None:
            raise BadRequest(f"{path}: unknown section [{section}] (a lorad config has [engine] and [server])")
        if not isinstance(table, dict):
            raise BadRequest(f"{path}: {section} must be a table: [{section}]")
        sections[section] = _section(path, section, config_class, table)
    return sections


def engine_values(table: dict, where: str) -> dict:
    """EngineConfig keywords from {field: value} as an [engine] table of lorad.toml holds them (benchmarks' overrides),
    typed and checked as the config file's; `where` names them in errors."""
    return _section(Path(where), "engine", EngineConfig, table)


def _section(path: Path, section: str, config_class, table: dict) -> dict:
    fields = {field.name: field for field in dataclasses.fields(config_class)}
    types = typing.get_type_hints(config_class)
    values = {}
    for key, value in table.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known keys: {', '.join(fields)})"
            raise BadRequest(f"{path}: unknown key {key!r} in [{section}]{hint}")
        where = f"{path}: [{section}] {key}"
        value = _typed(where, key, types[key], value)
        if key in _PATH_FIELDS:
            value = _relative_to(path.parent, value)
        elif key == "adapters":
            value = tuple((name, _relative_to(path.parent, directory)) for name, directory in value)
        values[key] = value
    return values


def _typed(where: str, key: str, annotation, value):
    """`value` as the field's type, or a BadRequest that says what was expected."""
    optional = type(None) in typing.get_args(annotation)
    if optional:  # TOML has no null: an optional field is either given or left out
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    if key == "adapters":
        if not isinstance(value, dict) or not all(isinstance(path, str) and path for path in value.values()):
            raise BadRequest(f'{where} must be a table of name = "directory" ([engine.adapters] sql = "/adapters/sql")')
        return tuple((name, path) for name, path in value.items())
    if annotation is bool:
        if not isinstance(value, bool):
            raise BadRequest(f"{where} must be true or false, not {value!r}")
        return value
    if annotation is int:
        if key.endswith("_bytes") and isinstance(value, str):
            try:
                return parse_byte_size(value)
            except ValueError as error:
                raise BadRequest(f"{where}: {error}") from None
        if key.endswith("_mode") and isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise BadRequest(f"{where} must be an octal mode such as 0o660 or \"0660\", not {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"{where} must be an integer, not {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"{where} must be a number, not {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise BadRequest(f"{where} must be a string, not {value!r}")
        return value
    if typing.get_origin(annotation) is tuple:  # tuple[str, ...]
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise BadRequest(f"{where} must be a list of strings, not {value!r}")
        return tuple(value)
    raise TypeError(f"no TOML reading for {where}: {annotation}")  # a new field of an unforeseen type


def _relative_to(directory: Path, value):
    if isinstance(value, str):
        return str(directory / value) if not os.path.isabs(value) else value
    return tuple(_relative_to(directory, item) for item in value)


def _systemd_engine(environ) -> dict:
    # StateDirectory=lorad: systemd creates /var/lib/lorad for the service user and says so here.
    state = environ.get("STATE_DIRECTORY", "").split(":")[0]
    return {"state_dir": state} if state else {}


def _systemd_server(environ) -> dict:
    runtime = environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return {"socket": str(Path(runtime) / "lorad.sock")} if runtime else {}


def parse_byte_size(text: str) -> int:
    """'8G', '512M', '1.5GiB', '1048576' -> bytes (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(value[-1:], 1)
    if scale != 1:
        value = value[:-1]
    try:
        return int(float(value) * scale) if scale != 1 else int(value)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (e.g. 8G, 512M, 1048576)") from None
