"""The engine process's submit threads: a request whose adapter must be read from disk first does not keep the
requests behind it, whose adapters are in host memory, out of the engine's queue (daemon/engine/process.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from lorad.daemon.engine import process
from lorad.daemon.engine.process import _EngineServer


class SlowReadEngine:
    """Submits at once, but a request for a cold adapter holds its thread until `release` is set (its disk read)."""

    def __init__(self, cold: set[str]):
        self.cold, self.release = cold, threading.Event()
        self.queued: list[str] = []
        self.lock = threading.Lock()

    def step(self) -> None:
        pass

    def reads_adapter(self, request) -> bool:
        return request.adapter in self.cold

    def submit(self, request) -> None:
        if request.adapter in self.cold:
            assert self.release.wait(10)
        with self.lock:
            self.queued.append(request.request_id)

    def load_adapter(self, name: str, path: str) -> dict:  # the API's load: a read from disk
        assert self.release.wait(10)
        return {"name": name}


class Outbox:
    def __init__(self):
        self.items = []

    def put(self, item) -> None:
        self.items.append(item)


class Inbox:
    def __init__(self, messages):
        self.messages = list(messages)

    def recv(self):
        return self.messages.pop(0) if self.messages else ("stop",)


def request(request_id: str, adapter: str | None):
    return SimpleNamespace(request_id=request_id, adapter=adapter, on_output=None)


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_requests_for_adapters_in_host_memory_pass_those_reading_from_disk_and_the_apis_loads():
    cold = {f"cold-{i}" for i in range(process._READ_THREADS + 2)}  # more reads than read threads, all held
    engine = SlowReadEngine(cold)
    server = _EngineServer(engine, Outbox(), SimpleNamespace(adapters=(), adapter_dirs=()))
    messages = [("submit", index, request(name, name)) for index, name in enumerate(sorted(cold))]
    messages += [("call", 50 + index, "load_adapter", (f"new-{index}", "/adapters/new")) for index in range(4)]
    messages += [("submit", 100 + index, request(f"hot-{index}", "hot" if index % 2 else None)) for index in range(8)]
    try:
        server.serve(Inbox(messages))
        # every cold read still holds its thread, and the hot requests are queued all the same
        assert wait_until(lambda: len(engine.queued) == 8), engine.queued
        assert all(name.startswith("hot-") for name in engine.queued)
        engine.release.set()
        assert wait_until(lambda: len(engine.queued) == 8 + len(cold))
    finally:
        engine.release.set()
        server.close()
    assert sorted(item[1] for item in server.outbox.items) == sorted(message[1] for message in messages)
    assert all(item[0] == "reply" and item[2] for item in server.outbox.items)
