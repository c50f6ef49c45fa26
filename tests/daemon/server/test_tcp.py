"""daemon/server/tcp.py: `lorad serve --listen tcp://HOST:PORT` beside the Unix socket, the API key required over
TCP (every route but /health), refused without a key on a non-loopback address; the Unix socket asks for none."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from lorad.daemon.server.tcp import check_listen, parse_listen
from lorad.errors import BadRequest

from daemon_harness import kill_daemon, start_daemon, stop_daemon, wait_healthy


@pytest.mark.parametrize("text, address", [
    ("tcp://127.0.0.1:8000", ("127.0.0.1", 8000)),
    ("tcp://localhost:1", ("localhost", 1)),
    ("tcp://[::1]:9000", ("::1", 9000)),
])
def test_listen_addresses(text, address):
    assert parse_listen(text) == address
    assert check_listen(text, api_key="") == address  # loopback: no key needed


@pytest.mark.parametrize("text", ["127.0.0.1:8000", "http://127.0.0.1:8000", "tcp://127.0.0.1", "tcp://:80",
                                  "tcp://127.0.0.1:99999", "tcp://127.0.0.1:80/v1"])
def test_bad_listen_addresses_say_the_form(text):
    with pytest.raises(BadRequest, match="tcp://HOST:PORT"):
        parse_listen(text)


def test_a_non_loopback_address_needs_a_key():
    with pytest.raises(BadRequest, match="API key is required"):
        check_listen("tcp://0.0.0.0:8000", api_key="")
    assert check_listen("tcp://0.0.0.0:8000", api_key="k") == ("0.0.0.0", 8000)
    assert check_listen("", api_key="") is None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(port: int, path: str, key: str | None = None, body: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    connection.request("POST" if body else "GET", path, body=json.dumps(body) if body else None, headers=headers)
    response = connection.getresponse()
    status, payload = response.status, json.loads(response.read())
    connection.close()
    return status, payload


def test_the_tcp_listener_asks_for_the_key_and_the_socket_does_not(demo_assets, short_tmp):
    port, path = free_port(), short_tmp / "lorad.sock"
    daemon = start_daemon(demo_assets, path, "--listen", f"tcp://127.0.0.1:{port}", env={"LORAD_API_KEY": "sekrit"})
    try:
        unix = wait_healthy(daemon, path)
        assert unix.models()  # the Unix socket: no key
        assert get(port, "/health") == (200, {"status": "ok"})
        status, payload = get(port, "/v1/models")
        assert status == 401 and payload["error"]["type"] == "authentication_error"
        assert get(port, "/v1/models", key="wrong")[0] == 401
        assert get(port, "/metrics", key="wrong")[0] == 401
        status, payload = get(port, "/v1/models", key="sekrit")
        assert status == 200 and payload["data"][0]["id"] == "lorad-demo"
        status, payload = get(port, "/v1/chat/completions", key="sekrit",
                              body={"model": "demo-r8", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200 and payload["object"] == "chat.completion"

        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sekrit", max_retries=0)
        answer = client.completions.create(model="demo-r8", prompt="The lighthouse", max_tokens=3)
        assert answer.usage.completion_tokens <= 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
    finally:
        stop_daemon(daemon)


def test_a_public_address_without_a_key_is_refused_before_the_model_loads(demo_assets, short_tmp):
    daemon = start_daemon(demo_assets, short_tmp / "lorad.sock", "--listen", f"tcp://0.0.0.0:{free_port()}",
                          env={"LORAD_API_KEY": ""})
    try:
        _, stderr = daemon.communicate(timeout=60)
        assert daemon.returncode == 2 and "API key is required" in stderr and "Traceback" not in stderr
    finally:
        kill_daemon(daemon)
