"""One request never harms the others: numerically unsafe sampling parameters, oversized or malformed bodies,
huge prompts and echoed names get a 4xx, a sampling failure ends only its own request, and a concurrent
well-formed request completes with the right output meanwhile."""

from __future__ import annotations

import json
from pathlib import Path
import threading
import time

import pytest
import torch

from lorad.client import Client
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.errors import BadRequest

from daemon_harness import raw_request, serve_demo, start_daemon, stop_daemon, wait_healthy


def make_engine(demo_assets):
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine

    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items())
    return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu", pool_bytes=4096 * 256,
                               max_model_len=64))


@pytest.mark.parametrize("fields, fragment", [
    (dict(temperature=1e-40), "temperature must be 0 .greedy. or a number from 0.01"),
    (dict(temperature=1e6), "temperature"),
    (dict(top_p=5e-324), "top_p must be a number from 1e-06"),
    (dict(seed=2**64), "seed must be an integer from"),
    (dict(seed=-(2**63) - 1), "seed must be an integer from"),
    (dict(stop_token_ids=list(range(257))), "at most 256 token ids"),
])
def test_numerically_unsafe_or_oversized_parameters_are_refused(fields, fragment):
    with pytest.raises(BadRequest, match=fragment):
        SamplingParams(**fields)
    SamplingParams(temperature=0.01, top_p=1e-6, seed=2**64 - 1)  # the edges themselves pass


def test_a_row_whose_sampling_fails_ends_alone(demo_assets, monkeypatch):
    from lorad.daemon.engine import sampler

    engine = make_engine(demo_assets)
    prompts = [[40, 41, 42, 43], [50, 51, 52], [60, 61, 62, 63, 64]]
    alone = [engine.generate([GenerationRequest(p, "demo-r8", SamplingParams(max_tokens=5, temperature=0))])[0].token_ids
             for p in prompts[:2]]
    original = sampler.draw

    def failing(logits, params, keys):  # the seed-13 row as if its logits had no finite value
        tokens = original(logits, params, keys)
        return torch.where(torch.tensor([p.seed == 13 for p in params], device=tokens.device), -1, tokens)

    monkeypatch.setattr(sampler, "draw", failing)
    results = engine.generate([GenerationRequest(prompts[0], "demo-r8", SamplingParams(max_tokens=5, temperature=0)),
                               GenerationRequest(prompts[1], "demo-r8", SamplingParams(max_tokens=5, temperature=0)),
                               GenerationRequest(prompts[2], "demo-r8", SamplingParams(max_tokens=5, temperature=1.0, seed=13))])
    assert [r.finish_reason for r in results] == ["length", "length", "error"]
    assert [r.token_ids for r in results[:2]] == alone
    assert results[2].token_ids == []


@pytest.fixture(scope="module")
def demo(demo_assets):
    with serve_demo(demo_assets, "harden.sock") as served:
        yield served


def post(server, body: bytes) -> tuple[int, dict]:
    status, _, payload = raw_request(server.path, "POST", "/v1/completions", body)
    return status, json.loads(payload)


@pytest.mark.parametrize("body, fragment", [
    (b'{"model": "lorad-demo", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}", "an integer of more than 4300 digits"),
    # the same in a body large enough for the parser's process
    (b'{"model": "lorad-demo", "prompt": "' + b"x" * (1 << 20) + b'", "seed": ' + b"9" * 5000 + b"}",
     "an integer of more than 4300 digits"),
    (b'{"model": "lorad-demo", "prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    (b'{"model": "lorad-demo", "prompt": "hi", "seed": 18446744073709551616}', "seed must be"),
    (b'{"model": "lorad-demo", "prompt": "hi", "temperature": 1e-40}', "temperature"),
    (b'{"model": "lorad-demo", "prompt": "hi", "top_p": 5e-324}', "top_p"),
    (json.dumps({"model": "lorad-demo", "prompt": "hi", "stop_token_ids": [5] * 300}).encode(), "at most 256"),
    (json.dumps({"model": "lorad-demo", "prompt": "hi", "stop": ["x"] * 20}).encode(), "at most 16 stop"),
    # more values than any request holds: refused by the parser's process, before they reach the daemon's
    (json.dumps({"model": "lorad-demo", "prompt": "hi", "stop_token_ids": [5] * 5_000_000}).encode(), "JSON values"),
    (json.dumps({"model": "lorad-demo", "prompt": "hi", "stop": ["x"] * 1_000_000}).encode(), "JSON values"),
])
def test_bodies_that_were_500s_are_400s(demo, body, fragment):
    server, engine = demo
    client = Client(server.path, timeout=30)
    fields = dict(model="demo-r8", prompt="The lighthouse", max_tokens=8, temperature=0, ignore_eos=True)
    reference = client.completions(**fields)["choices"][0]["text"]
    streamed = []
    beside = threading.Thread(target=lambda: streamed.extend(
        chunk["choices"][0]["text"] for chunk in client.stream_completions(**fields) if chunk["choices"]))
    beside.start()  # a well-formed request at the same time
    status, payload = post(server, body)
    beside.join(30)
    assert status == 400 and fragment in payload["error"]["message"]
    assert "".join(streamed) == reference


def test_a_huge_model_name_is_not_echoed(demo):
    server, _ = demo
    status, payload = post(server, json.dumps({"model": "m" * 10_000_000, "prompt": "hi"}).encode())
    assert status == 404 and len(json.dumps(payload)) < 400


def test_health_answers_while_huge_prompts_are_refused(demo_assets, short_tmp):
    # A daemon of its own (lorad serve): the probes time its event loop, not this process's threads.
    path = short_tmp / "lorad.sock"
    daemon = start_daemon(demo_assets, path)
    try:
        client = wait_healthy(daemon, path)
        text = "lighthouse " * 1_500_000  # 16.5 MB of JSON, just under the 16 MiB body cap
        token_ids = [5] * 1_000_000
        outcomes, latencies, answers = [], [], []

        def send(body: bytes, times: int):
            for _ in range(times):
                status, _, payload = raw_request(str(path), "POST", "/v1/completions", body)
                outcomes.append((status, json.loads(payload)["error"]["type"]))

        body = json.dumps({"model": "lorad-demo", "prompt": text}).encode()
        workers = [threading.Thread(target=send, args=(body, 2)) for _ in range(2)]  # two at once, twice each
        workers.append(threading.Thread(target=lambda: answers.append(
            client.completions(model="demo-r8", prompt="The lighthouse", max_tokens=4, temperature=0))))
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers) or len(latencies) < 5:
            started = time.perf_counter()
            assert client.health() == {"status": "ok"}
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
        assert sorted(outcomes) == [(400, "context_length_exceeded")] * 4
        assert max(latencies) < 0.1, latencies
        again = client.completions(model="demo-r8", prompt="The lighthouse", max_tokens=4, temperature=0)
        assert answers[0]["choices"][0]["text"] == again["choices"][0]["text"]
        # a million token ids: more values than a request of this context holds, refused by the body parser's
        # process without sending them back
        status, _, payload = raw_request(str(path), "POST", "/v1/completions",
                                         json.dumps({"model": "lorad-demo", "prompt": token_ids}).encode())
        assert status == 400 and "JSON values" in json.loads(payload)["error"]["message"]
        # as many as fit that count but not the context: refused by their count, before any is looked at
        too_long = [5] * (client.models()[0]["max_model_len"] + 1)
        status, _, payload = raw_request(str(path), "POST", "/v1/completions",
                                         json.dumps({"model": "lorad-demo", "prompt": too_long}).encode())
        assert status == 400 and json.loads(payload)["error"]["type"] == "context_length_exceeded"
    finally:
        stop_daemon(daemon)


# --- the socket's directory ---------------------------------------------------------------------------------


def test_the_socket_directory_is_ours_and_closed(short_tmp, monkeypatch):
    import os

    from lorad.daemon.server import unix_socket

    fresh = short_tmp / "fresh" / "lorad.sock"
    unix_socket.claim_path(str(fresh))
    assert os.stat(fresh.parent).st_mode & 0o777 == unix_socket.SOCKET_DIR_MODE
    unix_socket.claim_path(str(fresh))  # ours: fine the second time

    open_dir = short_tmp / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(BadRequest, match="writable by others"):
        unix_socket.claim_path(str(open_dir / "lorad.sock"))
    os.chmod(open_dir, 0o1777)  # sticky, as /tmp: others cannot remove or replace our socket
    unix_socket.claim_path(str(open_dir / "lorad.sock"))

    (short_tmp / "link").symlink_to(short_tmp / "fresh")
    with pytest.raises(BadRequest, match="is a symlink"):
        unix_socket.claim_path(str(short_tmp / "link" / "lorad.sock"))

    foreign = short_tmp / "foreign"
    foreign.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(foreign, 4243, 4243)  # as another user would have made it first
    else:
        monkeypatch.setattr(unix_socket.os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(BadRequest, match="belongs to uid"):
        unix_socket.claim_path(str(foreign / "lorad.sock"))


def test_serve_refuses_a_directory_others_can_write(demo_assets, short_tmp):
    import os

    hostile = short_tmp / "hostile"
    hostile.mkdir()
    os.chmod(hostile, 0o777)
    daemon = start_daemon(demo_assets, hostile / "lorad.sock")
    try:
        _, stderr = daemon.communicate(timeout=60)
        assert daemon.returncode == 2 and "writable by others" in stderr and "Traceback" not in stderr
    finally:
        stop_daemon(daemon)


def test_serve_raises_its_open_file_limit(demo_assets, short_tmp):
    import resource

    path = short_tmp / "lorad.sock"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 256) if hard == resource.RLIM_INFINITY or hard > 256 else soft
    daemon = start_daemon(demo_assets, path, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    try:
        wait_healthy(daemon, path)
        limits = (Path("/proc") / str(daemon.pid) / "limits").read_text()
        line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        soft_now, hard_now = line.split()[3:5]
        assert soft_now == hard_now and int(soft_now) > low
    finally:
        stop_daemon(daemon)


# --- connections ------------------------------------------------------------------------------------------


def test_connections_are_capped_and_idle_ones_timed_out(demo_assets, short_tmp):
    import socket as socket_module

    path = short_tmp / "lorad.sock"
    daemon = start_daemon(demo_assets, path, "--max-connections", "4", "--header-timeout-s", "1")
    idle = []
    try:
        client = wait_healthy(daemon, path)
        for _ in range(4):  # connected, silent: they hold the cap
            sock = socket_module.socket(socket_module.AF_UNIX)
            sock.connect(str(path))
            idle.append(sock)
        time.sleep(0.2)
        status, _, payload = raw_request(str(path), "GET", "/health")
        assert status == 503 and json.loads(payload)["error"]["type"] == "overloaded_error"
        slow = idle[0]
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers begun, never finished
        for sock in idle:  # the header timeout closes every one of them, unanswered
            sock.settimeout(5)
            assert sock.recv(1024) == b""
        assert client.health() == {"status": "ok"}  # room again
        answer = client.completions(model="demo-r8", prompt="The lighthouse", max_tokens=3)
        assert answer["usage"]["completion_tokens"] <= 3
    finally:
        for sock in idle:
            sock.close()
        stop_daemon(daemon)
