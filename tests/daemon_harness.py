"""The daemon under test, shared by the test folders: the API app served in a thread of its own over a
Unix socket, a request written by hand, and `lorad serve --demo` as a real process."""

from __future__ import annotations

import asyncio
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from lorad.client import Client
from lorad.daemon.server.api import create_app
from lorad.daemon.server.unix_socket import serve_unix

LORAD = Path(sys.executable).with_name("lorad")
COMMAND = [str(LORAD)] if LORAD.exists() else [sys.executable, "-m", "lorad.daemon.server.cli"]


class ServerThread:
    """create_app(engine) served on a Unix socket by an event loop in a thread of its own."""

    def __init__(self, engine, path: str):
        self.engine, self.path = engine, path
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.runner = self.loop.run_until_complete(serve_unix(create_app(engine), path))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="api-server", daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextmanager
def serve_engine(engine, socket_name: str):
    """Starts `engine` and serves it on a socket in a fresh short directory under /tmp (AF_UNIX paths are
    limited to 107 bytes); on exit, stops both and removes the directory."""
    engine.start()
    directory = tempfile.mkdtemp(prefix="lorad-", dir="/tmp")
    server = ServerThread(engine, f"{directory}/{socket_name}")
    try:
        yield server
    finally:
        server.close()
        engine.stop()
        shutil.rmtree(directory, ignore_errors=True)


def raw_request(path: str, method: str, target: str, body: bytes = b"", headers: dict | None = None,
                chunked: bool = False):
    """(status, headers, body) of one request written by hand, for what Client would not send."""
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(len(body))}
    head = f"{method} {target} HTTP/1.1\r\nHost: localhost\r\n"
    for name, value in {**framing, **(headers or {})}.items():
        head += f"{name}: {value}\r\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        try:
            sock.sendall(head.encode() + b"\r\n")  # a refused connection (at the cap) may be closed before this
            if chunked:
                for start in range(0, len(body), 1 << 20):
                    piece = body[start:start + (1 << 20)]
                    sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sock.sendall(b"0\r\n\r\n")
            else:
                sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole request was read: the answer is waiting
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, dict(response.getheaders()), response.read()


@contextmanager
def serve_demo(demo_assets, socket_name: str, **config):
    """The built-in demo on the CPU (8 MiB pool, context 128 unless `config` says otherwise) served on a socket
    by serve_engine -> (server, engine)."""
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine

    options = {"pool_bytes": 8 << 20, "max_model_len": 128, **config}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        engine = Engine(EngineConfig(demo=True, device="cpu", **options))
    with serve_engine(engine, socket_name) as server:
        yield server, engine


def start_daemon(demo_assets, path: Path, *extra: str, env: dict | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "LORAD_DEMO_DIR": str(demo_assets.model_dir.parent), **(env or {})}
    return subprocess.Popen(
        COMMAND + ["serve", "--demo", "--socket", str(path), "--device", "cpu", "--pool-bytes", "8M",
                   "--max-model-len", "128", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )


def stop_daemon(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_daemon(process)


def kill_daemon(process: subprocess.Popen) -> None:
    """Kill it if it still runs: a test that failed half-way leaves no daemon behind."""
    if process.poll() is None:
        process.kill()
        process.wait()


def wait_healthy(process: subprocess.Popen, path: Path, timeout: float = 60.0) -> Client:
    client = Client(str(path), timeout=30)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"lorad serve exited {process.returncode}: {process.stderr.read()}")
        try:
            if client.health() == {"status": "ok"}:
                return client
        except OSError:
            pass
        assert time.monotonic() < deadline, "lorad serve did not become healthy"
        time.sleep(0.1)
