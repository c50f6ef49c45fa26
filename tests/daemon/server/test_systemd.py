"""daemon/server/systemd.py and the unit files: notifications reach a fake NOTIFY_SOCKET, listen_fds follows
sd_listen_fds, `lorad serve --demo` serves on a socket passed as fd 3 (READY=1, WATCHDOG=1, STOPPING=1,
the socket left in place), `systemd-analyze verify` accepts the units, `lorad install-systemd` installs."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lorad.daemon.server import systemd
from lorad.daemon.server.cli import _watchdog, main
from lorad.client import Client

from daemon_harness import COMMAND, kill_daemon

PACKAGING = Path(__file__).resolve().parents[3] / "packaging"


@pytest.fixture
def notify_socket(short_tmp):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(short_tmp / "notify")
    sock.bind(path)
    sock.settimeout(30)
    yield path, sock
    sock.close()


def received(sock: socket.socket, wanted: str, timeout: float = 60) -> list[str]:
    """Datagrams until one holds the line `wanted`; all of them."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        message = sock.recv(4096).decode()
        seen.append(message)
        if wanted in message.split("\n"):
            return seen
    pytest.fail(f"no {wanted} among {seen}")


def test_notify(notify_socket):
    path, sock = notify_socket
    assert systemd.notify("READY=1\nSTATUS=serving", {"NOTIFY_SOCKET": path})
    assert sock.recv(100) == b"READY=1\nSTATUS=serving"
    assert not systemd.notify("READY=1", {})  # not under systemd
    assert not systemd.notify("READY=1", {"NOTIFY_SOCKET": "vsock:1:2"})
    assert not systemd.notify("READY=1", {"NOTIFY_SOCKET": path + "-gone"})  # logged, never raised


def test_notify_abstract_namespace():
    name = f"lorad-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        assert systemd.notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(100) == b"STOPPING=1"


def test_listen_fds_is_for_this_process_only():
    environ = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "lorad.socket"}
    assert systemd.listen_fds(environ=environ) == [] and environ == {}  # unset even when not ours
    environ = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0"}
    assert systemd.listen_fds(environ=environ) == [] and environ == {}
    assert systemd.listen_fds(environ={"LISTEN_PID": "x", "LISTEN_FDS": "1"}) == []
    assert systemd.listen_fds(environ={}) == []


def test_listen_fds_in_a_process_with_fd_3(short_tmp):
    code = ("import os, socket; from lorad.daemon.server import systemd; fds = systemd.listen_fds(); "
            "sock = systemd.unix_listener(fds[0]); "
            "print(fds, sock.getsockname(), 'LISTEN_FDS' in os.environ, os.get_inheritable(3))")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(short_tmp / "l.sock"))
        listener.listen()
        fd = listener.fileno()
        out = subprocess.run(["bash", "-c", f'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" -c "$1" 3<&{fd} {fd}<&-',
                              sys.executable, code],
                             pass_fds=(fd,), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[3] {short_tmp / 'l.sock'} False False"


def test_unix_listener_refuses_what_is_not_a_listening_stream_socket(short_tmp):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as datagram:
        with pytest.raises(ValueError, match="not a listening Unix stream socket"):
            systemd.unix_listener(datagram.fileno())
        assert datagram.fileno() >= 0  # left open for its owner
    with open(short_tmp / "file", "w") as file:
        with pytest.raises(ValueError, match="not a socket"):
            systemd.unix_listener(file.fileno())


def test_watchdog_interval():
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert systemd.watchdog_interval({}) is None and systemd.watchdog_interval({"WATCHDOG_USEC": "0"}) is None


def test_watchdog_pings_only_while_the_engine_lives(notify_socket, monkeypatch):
    path, sock = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)

    class Engine:
        alive = True
        answers = threading.Event()

        def status(self):
            self.answers.wait()
            return {}

    engine = Engine()
    engine.answers.set()

    async def run(seconds: float) -> None:
        task = asyncio.ensure_future(_watchdog(engine, 0.01))
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(run(0.05))
    assert received(sock, "WATCHDOG=1", timeout=1)
    sock.settimeout(0)
    while True:  # drain
        try:
            sock.recv(100)
        except BlockingIOError:
            break
    engine.alive = False
    asyncio.run(run(0.05))
    with pytest.raises(BlockingIOError):
        sock.recv(100)
    # alive but not answering: the first ping goes out, then none while status() hangs
    engine.alive = True
    engine.answers.clear()
    threading.Timer(0.5, engine.answers.set).start()  # asyncio.run waits for the executor's threads
    asyncio.run(run(0.05))
    assert sock.recv(100) == b"WATCHDOG=1"
    with pytest.raises(BlockingIOError):
        sock.recv(100)
    engine.answers.set()


def test_serve_on_a_socket_passed_by_systemd(demo_assets, short_tmp, notify_socket):
    """What lorad.socket + lorad.service do: fd 3 is the listening socket, LISTEN_PID is serve's pid."""
    notify_path, notify = notify_socket
    path = short_tmp / "run" / "lorad.sock"
    path.parent.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)  # systemd's SocketMode: serve must leave it as it is
    listener.listen()
    fd = listener.fileno()
    env = {**os.environ, "LORAD_DEMO_DIR": str(demo_assets.model_dir.parent), "NOTIFY_SOCKET": notify_path,
           "WATCHDOG_USEC": "200000", "LISTEN_FDS": "1"}
    argv = COMMAND + ["serve", "--demo", "--device", "cpu", "--pool-bytes", "8M", "--max-model-len", "64",
                      "--socket", str(short_tmp / "unused.sock")]
    process = subprocess.Popen(["bash", "-c", f'LISTEN_PID=$$ exec "$@" 3<&{fd} {fd}<&-', "sh", *argv],
                               pass_fds=(fd,), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    listener.close()  # the daemon holds it now (as systemd would keep its own copy)
    try:
        messages = received(notify, "READY=1")
        assert any(line.startswith("STATUS=serving model=lorad-demo") for m in messages for line in m.split("\n"))
        client = Client(str(path), timeout=30)
        answer = client.completions(model="demo-r4", prompt="Hi", max_tokens=3, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 3
        received(notify, "WATCHDOG=1", timeout=5)
        process.terminate()
        received(notify, "STOPPING=1", timeout=30)
        assert process.wait(30) == 0
    finally:
        kill_daemon(process)
    log = process.stderr.read()
    assert "Traceback" not in log and "(from systemd)" in log
    assert path.exists() and stat.S_IMODE(os.stat(path).st_mode) == 0o600  # systemd's, not removed
    assert not (short_tmp / "unused.sock").exists()


def test_sigterm_while_the_model_loads_exits_0(demo_assets, short_tmp, notify_socket):
    notify_path, notify = notify_socket
    path = short_tmp / "lorad.sock"
    env = {**os.environ, "LORAD_DEMO_DIR": str(demo_assets.model_dir.parent), "NOTIFY_SOCKET": notify_path}
    process = subprocess.Popen(COMMAND + ["serve", "--demo", "--device", "cpu", "--socket", str(path)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        messages = received(notify, "STATUS=loading the model (demo)")
        process.terminate()
        assert process.wait(30) == 0
    finally:
        kill_daemon(process)
    log = process.stderr.read()
    assert "stopped while loading the model" in log and "Traceback" not in log, log
    assert not path.exists() and not any("READY=1" in message for message in messages)


# --- the unit files -------------------------------------------------------------------------------------


def verify(*units: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    result = subprocess.run([analyze, "verify", "--man=no", *map(str, units)], capture_output=True, text=True,
                            timeout=60)
    # it exits 0 on unknown keys too, only warning: any line about our files is a failure
    complaints = [line for line in result.stderr.splitlines() if any(unit.name in line for unit in units)]
    assert result.returncode == 0 and not complaints, result.stderr


def test_units_verify():
    verify(PACKAGING / "systemd" / "lorad.socket", PACKAGING / "systemd" / "lorad.service")


def test_unit_contents():
    service = (PACKAGING / "systemd" / "lorad.service").read_text()
    socket_unit = (PACKAGING / "systemd" / "lorad.socket").read_text()
    for line in ("Type=notify", "Restart=on-failure", "WatchdogSec=30", "User=lorad", "Group=lorad",
                 "DynamicUser=no", "StateDirectory=lorad", "RuntimeDirectory=lorad", "ConfigurationDirectory=lorad",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RestrictAddressFamilies=AF_UNIX", "KillMode=mixed", "RuntimeDirectoryPreserve=yes",
                 "ExecStart=/usr/bin/env lorad serve --config /etc/lorad/lorad.toml"):
        assert f"\n{line}\n" in service, line
    assert "\nMemoryDenyWriteExecute" not in service and "\nPrivateDevices" not in service  # CUDA, Triton
    for line in ("ListenStream=/run/lorad/lorad.sock", "SocketMode=0660", "SocketGroup=lorad", "Accept=no"):
        assert f"\n{line}\n" in socket_unit, line


def test_install_systemd(short_tmp, capsys):
    assert main(["install-systemd", "--prefix", str(short_tmp), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would write" in out and "systemctl enable --now lorad.socket" in out
    assert not (short_tmp / "etc").exists()

    assert main(["install-systemd", "--prefix", str(short_tmp)]) == 0
    out = capsys.readouterr().out
    units = short_tmp / "etc/systemd/system"
    config = short_tmp / "etc/lorad/lorad.toml"
    assert (units / "lorad.socket").read_text() == (PACKAGING / "systemd/lorad.socket").read_text()
    service = (units / "lorad.service").read_text()
    exec_line = next(line for line in service.splitlines() if line.startswith("ExecStart="))
    assert exec_line.endswith(" serve --config /etc/lorad/lorad.toml")
    assert config.read_text() == (PACKAGING / "lorad.toml").read_text()
    for command in ("useradd --system", "systemctl daemon-reload", "systemctl enable --now lorad.socket"):
        assert command in out
    verify(units / "lorad.socket", units / "lorad.service")

    config.write_text("# mine\n")  # an existing config is never overwritten
    assert main(["install-systemd", "--prefix", str(short_tmp)]) == 0
    assert f"kept {config} (exists)" in capsys.readouterr().out and config.read_text() == "# mine\n"
