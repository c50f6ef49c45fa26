"""daemon/server/settings.py: lorad.toml's sections and keys are exactly the config's fields, checked with
messages that name the key and the section; precedence defaults < systemd's directories < file < flags."""

from __future__ import annotations

import pytest

import lorad.daemon.server.settings as settings
from lorad.config import EngineConfig, ServerConfig
from lorad.daemon.server.settings import read_file, resolve
from lorad.errors import BadRequest


def write(tmp_path, text: str, name: str = "lorad.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(path, fragment: str) -> str:
    with pytest.raises(BadRequest) as caught:
        read_file(path)
    assert fragment in caught.value.message, caught.value.message
    return caught.value.message


def test_every_field_has_a_toml_reading(tmp_path):
    path = write(tmp_path, """
[engine]
model = "/models/llama"
adapter_dirs = ["/adapters", "more"]
adapter_roots = ["/adapters"]
state_dir = "/var/lib/lorad"
device = "cpu"
dtype = "bfloat16"
max_lora_rank = 64
max_running_requests = 8
max_batch_tokens = 512
max_model_len = 4096
max_waiting_requests = 10
pool_bytes = "512M"
gpu_memory_utilization = 1
host_adapter_bytes = 1048576
seed = 7

[engine.adapters]
sql = "/adapters/sql"
chat = "chat-lora"

[server]
socket = "/run/lorad/lorad.sock"
socket_mode = 0o600
log_level = "debug"
shutdown_grace_s = 5
""")
    sections = read_file(path)
    engine, server = sections["engine"], sections["server"]
    assert engine["adapters"] == (("sql", "/adapters/sql"), ("chat", str(tmp_path / "chat-lora")))
    assert engine["adapter_dirs"] == ("/adapters", str(tmp_path / "more"))  # relative to the file
    assert engine["pool_bytes"] == 512 << 20 and engine["host_adapter_bytes"] == 1 << 20
    assert engine["gpu_memory_utilization"] == 1.0 and isinstance(engine["gpu_memory_utilization"], float)
    assert server == {"socket": "/run/lorad/lorad.sock", "socket_mode": 0o600, "log_level": "debug",
                      "shutdown_grace_s": 5.0}
    # and they build the dataclasses
    EngineConfig(**engine), ServerConfig(**server)


def test_every_field_has_a_toml_reading_even_new_ones():
    import typing

    samples = {bool: True, int: 1, float: 1.0, str: "x"}
    for config_class in (EngineConfig, ServerConfig):
        for name, annotation in typing.get_type_hints(config_class).items():
            args = typing.get_args(annotation)
            base = next(arg for arg in args if arg is not type(None)) if type(None) in args else annotation
            sample = {"a": "/a"} if name == "adapters" else samples.get(base, ["/x"])
            settings._typed(f"[{name}]", name, annotation, sample)  # TypeError: a field type without a reading


@pytest.mark.parametrize("text, fragment", [
    ("[engine]\nmax_lora_ranks = 8\n", "unknown key 'max_lora_ranks' in [engine] (did you mean max_lora_rank?)"),
    ("[server]\nport = 80\n", "unknown key 'port' in [server] (known keys: socket,"),
    ("[engin]\nmodel = 'x'\n", "unknown section [engin]"),
    ("model = 'x'\n", "unknown section [model]"),
    ("[engine]\nmax_lora_rank = '16'\n", "[engine] max_lora_rank must be an integer, not '16'"),
    ("[engine]\nmax_lora_rank = 16.0\n", "[engine] max_lora_rank must be an integer"),
    ("[engine]\ndemo = 1\n", "[engine] demo must be true or false, not 1"),
    ("[engine]\nmodel = 3\n", "[engine] model must be a string, not 3"),
    ("[engine]\nadapter_dirs = '/adapters'\n", "[engine] adapter_dirs must be a list of strings"),
    ("[engine]\nadapters = ['sql=/x']\n", "[engine] adapters must be a table of name = \"directory\""),
    ("[engine]\npool_bytes = 'lots'\n", "[engine] pool_bytes: not a byte size: 'lots'"),
    ("[engine]\ngpu_memory_utilization = true\n", "gpu_memory_utilization must be a number"),
    ("[server]\nsocket_mode = 'rw'\n", "[server] socket_mode must be an octal mode"),
    ("[server]\nshutdown_grace_s = '30s'\n", "[server] shutdown_grace_s must be a number"),
    ("[engine\nmodel = 'x'\n", "not valid TOML"),
])
def test_refusals_name_the_key_and_section(tmp_path, text, fragment):
    path = write(tmp_path, text)
    assert refused(path, fragment).startswith(str(path))


def test_precedence_defaults_systemd_file_flags(tmp_path):
    path = write(tmp_path, """
[engine]
demo = true
max_lora_rank = 32
max_running_requests = 16
[engine.adapters]
a = "/a"
[server]
log_level = "warning"
""")
    environ = {"STATE_DIRECTORY": "/var/lib/lorad", "RUNTIME_DIRECTORY": "/run/lorad:/run/other"}
    config, used = resolve({"max_lora_rank": 8}, {"log_level": "debug"}, str(path), environ)
    assert used == path
    assert config.engine.max_lora_rank == 8  # the flag wins
    assert config.engine.max_running_requests == 16  # the file over the default
    assert config.engine.max_batch_tokens == EngineConfig.max_batch_tokens  # the default
    assert config.engine.adapters == (("a", "/a"),)
    assert config.engine.state_dir == "/var/lib/lorad"  # systemd's StateDirectory=
    assert config.server.socket == "/run/lorad/lorad.sock"  # systemd's RuntimeDirectory=
    assert config.server.log_level == "debug"
    # the file wins over what systemd suggests, flags over both
    path.write_text('[engine]\ndemo = true\nstate_dir = "/srv/state"\n[server]\nsocket = "/srv/s.sock"\n')
    config, _ = resolve({}, {"socket": "/tmp/x.sock"}, str(path), environ)
    assert config.engine.state_dir == "/srv/state" and config.server.socket == "/tmp/x.sock"
    # adapters given as flags replace the file's table (a flag replaces its field)
    path.write_text('[engine]\ndemo = true\n[engine.adapters]\na = "/a"\n')
    config, _ = resolve({"adapters": (("b", "/b"),)}, {}, str(path), {})
    assert config.engine.adapters == (("b", "/b"),)


def test_default_file_only_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "DEFAULT_PATH", str(tmp_path / "missing.toml"))
    config, used = resolve({"demo": True}, {}, None, {})
    # config.py's defaults, and lorad serve's own: the kernel profile measured on a first start, the cold-start mode
    # chosen by the engine for its device
    assert used is None and config.engine == EngineConfig(demo=True, profile_at_start=True, cold_start=None)
    assert config.server == ServerConfig()
    default = write(tmp_path, "[engine]\nmax_lora_rank = 16\n")
    monkeypatch.setattr(settings, "DEFAULT_PATH", str(default))
    config, used = resolve({"demo": True}, {}, None, {})
    assert used == default and config.engine.max_lora_rank == 16


def test_serve_defaults_lie_under_the_file_and_the_flags(tmp_path):
    assert EngineConfig().profile_at_start is False and EngineConfig().cold_start == "ondemand"  # built directly
    off = write(tmp_path, "[engine]\ndemo = true\nprofile_at_start = false\ncold_start = \"ondemand\"\n")
    config, _ = resolve({}, {}, str(off), {})
    assert config.engine.profile_at_start is False and config.engine.cold_start == "ondemand"
    on = write(tmp_path, "[engine]\ndemo = true\n", "on.toml")
    config, _ = resolve({}, {}, str(on), {})
    assert config.engine.profile_at_start is True and config.engine.cold_start is None  # settled by the engine
    config, _ = resolve({"profile_at_start": False}, {}, str(on), {})
    assert config.engine.profile_at_start is False


def test_missing_explicit_file_and_model_checks(tmp_path):
    with pytest.raises(BadRequest, match="config file .*nope.toml does not exist"):
        resolve({"demo": True}, {}, str(tmp_path / "nope.toml"), {})
    empty = write(tmp_path, "")
    with pytest.raises(BadRequest, match=r"--model DIR \(or --demo\)"):
        resolve({}, {}, str(empty), {})
    both = write(tmp_path, "[engine]\ndemo = true\n", "both.toml")
    with pytest.raises(BadRequest, match="leave out --model"):
        resolve({"model": "/m"}, {}, str(both), {})
    ranged = write(tmp_path, "[engine]\ndemo = true\nmax_lora_rank = 0\n", "ranged.toml")
    with pytest.raises(BadRequest, match="max_lora_rank must be in 1..1024"):  # config.py's own checks
        resolve({}, {}, str(ranged), {})


def test_the_sample_config_is_valid():
    from pathlib import Path

    sample = Path(__file__).resolve().parents[3] / "packaging" / "lorad.toml"
    sections = read_file(sample)
    EngineConfig(**sections["engine"]), ServerConfig(**sections["server"])
    assert sections["server"]["socket"] == "/run/lorad/lorad.sock" and sections["engine"]["state_dir"] == "/var/lib/lorad"
