"""The `lorad` command: bad flags and config errors end in one line and exit code 2; `lorad serve --demo`
as a real process (stale socket removed, 0660, health, completions, clean exit on SIGTERM and SIGINT);
`lorad generate` streaming from a daemon."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import threading
import time

import pytest

from lorad.daemon.server.cli import main
from lorad.client import Client
from lorad.errors import EngineDead

# test_api.py's fake engine (pytest puts this folder on sys.path).
from test_api import FakeEngine
from daemon_harness import COMMAND, ServerThread, kill_daemon, start_daemon, wait_healthy  # noqa: F401



def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- refusals before anything starts ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "required: command"),
        (["frobnicate"], "invalid choice"),
        (["serve"], "--model DIR (or --demo)"),
        (["serve", "--demo", "--model", "x"], "leave out --model"),
        (["serve", "--demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["serve", "--demo", "--max-lora-rank", "abc"], "--max-lora-rank: invalid int value"),
        (["serve", "--demo", "--max-lora-rank", "0"], "max_lora_rank must be in 1..1024"),
        (["serve", "--demo", "--max-running-requests", "0"], "max_running_requests must be positive"),
        (["serve", "--demo", "--max-model-len", "-5"], "max_model_len must be positive, not -5"),
        (["serve", "--demo", "--pool-bytes", "0"], "pool_bytes must be positive"),
        (["serve", "--demo", "--host-adapter-bytes", "-1"], "host_adapter_bytes must be >= 0"),
        (["serve", "--demo", "--dummy-adapters", "-1"], "dummy_adapters must be >= 0"),
        (["serve", "--demo", "--gpu-memory-utilization", "2"], "gpu_memory_utilization must be a share in (0, 1]"),
        (["serve", "--demo", "--gpu-memory-utilization", "0"], "gpu_memory_utilization must be a share in (0, 1]"),
        (["serve", "--demo", "--shutdown-grace-s", "-1"], "shutdown_grace_s must be a number of seconds >= 0"),
        (["serve", "--demo", "--dtype", "float8"], "dtype must be one of"),
        (["serve", "--demo", "--device", "tpu"], "device must be one of"),
        (["serve", "--demo", "--adapter", "no-equals-sign"], "expected NAME=DIR"),
        (["serve", "--demo", "--host-adapter-bytes", "lots"], "not a byte size"),
        (["serve", "--demo", "--socket-mode", "rw"], "not an octal mode"),
        (["serve", "--demo", "--socket-mode", "7777"], "not a mode of permission bits from 0 to 777"),
        (["demo", "adapters", "--model-config", "tiny-llama", "--count", "1", "--ranks", "8,x", "--out", "d"],
         "argument --ranks: expected comma-separated ranks"),
        (["serve", "--demo", "--log-level", "loud"], "log level must be one of"),
        (["serve", "--demo", "--socket", "/tmp/" + "x" * 120], "longer than 107 bytes"),
        (["generate"], "required: prompt"),
        (["generate", "hi", "--max-tokens", "many"], "invalid int value"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, argv, fragment):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("lorad") and fragment in err, err


def test_help_exits_0(capsys):
    code, out, _ = run_main(capsys, "serve", "--help")
    assert code == 0 and "--max-lora-rank" in out and "(default: 256)" in out and "--adapter NAME=DIR" in out
    assert "--profile-at-start, --no-profile-at-start" in out and "auto on cuda" in " ".join(out.split())


def test_readme_names_every_serve_flag():
    """A user finds the flags in README.md: every `lorad serve` flag is named there (most in its flag table, the
    benchmarks', FP8's and the TCP listener's in their own sections)."""
    import argparse
    from pathlib import Path

    from lorad.daemon.server.cli import build_parser

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    flags = {flag for action in commands.choices["serve"]._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"}
    assert len(flags) > 40
    missing = sorted(flag for flag in flags if re.search(re.escape(flag) + r"(?![\w-])", readme) is None)
    assert not missing, f"README.md does not name these lorad serve flags: {missing}"


def test_flags_map_onto_the_config(monkeypatch):
    import lorad.daemon.server.cli as cli

    seen = {}

    def fake_serve(args):
        seen["engine"] = cli._config_values(args, "engine.")
        seen["server"] = cli._config_values(args, "server.")
        return 0

    monkeypatch.setattr(cli, "serve", fake_serve)
    argv = ["serve", "--model", "/m", "--adapter", "a=/x", "--adapter", "b=/y=z", "--adapter-dir", "/d",
            "--max-lora-rank", "16", "--host-adapter-bytes", "2G", "--dtype", "bfloat16", "--max-model-len",
            "4096", "--socket", "/tmp/s.sock", "--socket-mode", "600", "--log-level", "debug"]
    assert main(argv) == 0
    assert seen["engine"] == {
        "model": "/m", "adapters": (("a", "/x"), ("b", "/y=z")), "adapter_dirs": ("/d",), "max_lora_rank": 16,
        "host_adapter_bytes": 2 << 30, "dtype": "bfloat16", "max_model_len": 4096,
    }
    assert seen["server"] == {"socket": "/tmp/s.sock", "socket_mode": 0o600, "log_level": "debug"}
    # what is not given is not passed: the defaults are config.py's
    assert main(["serve", "--demo"]) == 0 and seen["engine"] == {"demo": True} and seen["server"] == {}
    # lorad serve measures a kernel profile on a first start unless told not to; cold_start left to the engine
    assert main(["serve", "--demo", "--no-profile-at-start", "--cold-start", "cached"]) == 0
    assert seen["engine"] == {"demo": True, "profile_at_start": False, "cold_start": "cached"}


def test_refuses_a_socket_path_that_is_a_file(capsys, short_tmp):
    path = short_tmp / "not-a-socket"
    path.write_text("keep me")
    code, _, err = run_main(capsys, "serve", "--demo", "--socket", str(path))
    assert code == 2 and "is not a socket" in err and path.read_text() == "keep me"


def test_refuses_when_another_daemon_listens(capsys, short_tmp):
    path = short_tmp / "taken.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        code, _, err = run_main(capsys, "serve", "--demo", "--socket", str(path))
    assert code == 2 and "already listening" in err and err.count("\n") == 1
    assert path.exists()


def test_bad_model_directory_is_one_line(capsys, short_tmp):
    code, _, err = run_main(capsys, "serve", "--model", str(short_tmp / "missing"), "--socket",
                            str(short_tmp / "s.sock"))
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    assert not (short_tmp / "s.sock").exists()


# --- lorad generate -----------------------------------------------------------------------------------------


@pytest.fixture
def fake_daemon(short_tmp):
    engine = FakeEngine()
    engine.start()
    server = ServerThread(engine, str(short_tmp / "fake.sock"))
    yield server
    server.close()
    engine.stop()


def test_generate_streams_to_stdout(capsys, fake_daemon):
    code, out, err = run_main(capsys, "generate", "--socket", fake_daemon.path, "--model", "sql", "hello",
                              "--max-tokens", "7", "--temperature", "0")
    assert (code, out, err) == (0, "hellohe\n", "")
    request = next(iter(fake_daemon.engine.submitted.values()))
    assert request.adapter == "sql" and request.sampling.temperature == 0 and request.sampling.max_tokens == 7
    # without --model: the base model
    code, out, _ = run_main(capsys, "generate", "--socket", fake_daemon.path, "abc", "--max-tokens", "2")
    assert code == 0 and out == "ab\n"


def test_generate_errors(capsys, fake_daemon, short_tmp):
    code, out, err = run_main(capsys, "generate", "--socket", fake_daemon.path, "--model", "nope", "hi")
    assert (code, out) == (2, "") and "'nope' does not exist" in err and err.count("\n") == 1
    code, out, err = run_main(capsys, "generate", "--socket", str(short_tmp / "nobody.sock"), "hi")
    assert code == 1 and "cannot reach the daemon" in err


# --- lorad serve --demo as a process --------------------------------------------------------------------------


def test_serve_demo_then_sigterm(demo_assets, short_tmp):
    path = short_tmp / "run" / "lorad.sock"  # the parent is created by serve
    path.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a socket file nobody listens on: a crashed daemon's
    stale.close()
    process = start_daemon(demo_assets, path)
    try:
        client = wait_healthy(process, path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert client.models()[0]["id"] == "lorad-demo"
        answer = client.completions(model="demo-r4", prompt="Hello there", max_tokens=5, ignore_eos=True)
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 5

        generated = subprocess.run(COMMAND + ["generate", "--socket", str(path), "--model", "demo-r1", "Hi",
                                              "--max-tokens", "4", "--temperature", "0"],
                                   capture_output=True, text=True, timeout=60)
        assert generated.returncode == 0 and generated.stdout.endswith("\n"), generated.stderr

        second = subprocess.run(COMMAND + ["serve", "--demo", "--socket", str(path)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and "already listening" in second.stderr
        assert "Traceback" not in second.stderr

        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        kill_daemon(process)
    log = process.stderr.read()
    assert not path.exists()
    assert "Traceback" not in log and "leaked" not in log  # nor libtriton's warnings of objects alive at exit
    assert "listening socket=" in log and "request finished" in log and "device=cpu" in log


@pytest.mark.parametrize("grace, signals, finish_reason", [(None, 1, "length"), ("0", 1, "abort"), (None, 2, "abort")])
def test_sigint_during_a_stream_exits_0(demo_assets, short_tmp, grace, signals, finish_reason):
    """The running request finishes within the grace period (30 s by default), or is aborted at once
    with --shutdown-grace-s 0 or a second signal; either way its stream ends properly and serve exits 0."""
    path = short_tmp / "lorad.sock"
    process = start_daemon(demo_assets, path, *(["--shutdown-grace-s", grace] if grace else []))
    try:
        client = wait_healthy(process, path)
        chunks = client.stream_completions(model="demo-r8", prompt="Once", max_tokens=100, ignore_eos=True)
        next(chunks)
        process.send_signal(signal.SIGINT)
        if signals == 2:
            next(chunks)
            process.send_signal(signal.SIGINT)
        rest = list(chunks)
        assert rest[-1]["choices"][0]["finish_reason"] == finish_reason
        assert process.wait(30) == 0
    finally:
        kill_daemon(process)
    assert not path.exists()
    assert "Traceback" not in process.stderr.read()


# --- the config file, SIGHUP, SIGTERM's grace, a dying engine -------------------------------------------------


@pytest.mark.parametrize("text, fragment", [
    ("[engine]\ndemo = true\nmax_lora_ranks = 8\n", "unknown key 'max_lora_ranks' in [engine]"),
    ("[engine]\ndemo = 'yes'\n", "[engine] demo must be true or false"),
    ("[engine\n", "not valid TOML"),
])
def test_bad_config_file_is_one_line(capsys, short_tmp, text, fragment):
    path = short_tmp / "lorad.toml"
    path.write_text(text)
    code, out, err = run_main(capsys, "serve", "--config", str(path), "--socket", str(short_tmp / "s.sock"))
    assert code == 2 and out == "" and err.count("\n") == 1 and fragment in err, err
    code, _, err = run_main(capsys, "serve", "--config", str(short_tmp / "none.toml"))
    assert code == 2 and "does not exist" in err


def _models(client: Client) -> set[str]:
    return {entry["id"] for entry in client.models()}


def test_sighup_reloads_adapters_and_sigterm_lets_a_request_finish(demo_assets, short_tmp):
    adapters = demo_assets.adapters
    config = short_tmp / "lorad.toml"
    config.write_text(f'[engine]\ndemo = true\n[engine.adapters]\nold = "{adapters["demo-r1"]}"\n'
                      f'[server]\nshutdown_grace_s = 20\n')
    path = short_tmp / "lorad.sock"
    process = start_daemon(demo_assets, path, "--config", str(config))
    try:
        client = wait_healthy(process, path)
        assert "old" in _models(client)
        client.load_adapter("by-api", str(adapters["demo-r2"]))  # not the file's: SIGHUP leaves it alone

        config.write_text(f'[engine]\ndemo = true\n[engine.adapters]\nnew = "{adapters["demo-r4"]}"\n'
                          f'bad = "{short_tmp / "missing"}"\n[server]\nshutdown_grace_s = 20\n')
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not ("new" in _models(client) and "old" not in _models(client)):
            assert time.monotonic() < deadline, _models(client)
            time.sleep(0.05)
        assert "by-api" in _models(client) and "bad" not in _models(client)
        answer = client.completions(model="new", prompt="hi", max_tokens=2, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 2

        # SIGTERM with a request running: it finishes (within the grace), then serve exits 0
        result = {}
        running = threading.Thread(target=lambda: result.update(client.completions(
            model="demo-r8", prompt="Once", max_tokens=100, ignore_eos=True)))
        running.start()
        deadline = time.monotonic() + 10
        while client.status()["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        process.send_signal(signal.SIGTERM)
        running.join(30)
        assert result["choices"][0]["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 100
        assert process.wait(30) == 0
    finally:
        kill_daemon(process)
    log = process.stderr.read()
    assert "Traceback" not in log and not path.exists()
    assert "adapters reloaded added=new removed=old" in log and "adapter not registered name=bad" in log
    assert "requests running, grace_s=20" in log


def test_engine_death_ends_serve_with_exit_1(demo_assets, short_tmp):
    path = short_tmp / "lorad.sock"
    process = start_daemon(demo_assets, path)
    try:
        client = wait_healthy(process, path)
        chunks = client.stream_completions(model="demo-r8", prompt="Once", max_tokens=100, ignore_eos=True)
        next(chunks)
        os.kill(client.status()["engine_pid"], signal.SIGKILL)
        with pytest.raises(EngineDead, match="engine process died"):  # the stream's error event: engine_error
            list(chunks)
        assert process.wait(30) == 1  # systemd's Restart=on-failure starts a fresh one
    finally:
        kill_daemon(process)
    log = process.stderr.read()
    assert "killed by SIGKILL" in log and "Traceback" not in log and not path.exists()
