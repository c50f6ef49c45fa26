"""daemon/server/admin_gate.py: over the socket only the daemon's user, root and the admin group may load and
unload adapters (others get 403 and can still generate); over TCP only with the admin key."""

from __future__ import annotations

import json
import socket

import pytest

from lorad.client import Client
from lorad.daemon.server.admin_gate import AdminGate
from lorad.errors import BadRequest, Forbidden

from daemon_harness import raw_request, serve_demo, start_daemon, stop_daemon, wait_healthy


def test_who_the_gate_allows(monkeypatch):
    gate = AdminGate(own_uid=1000)
    assert gate.allows(1000) and gate.allows(0) and not gate.allows(1001)
    import pwd
    from lorad.daemon.server import admin_gate

    member = pwd.struct_passwd(("ann", "x", 1001, 1001, "", "/", "/bin/sh"))
    monkeypatch.setattr(admin_gate.pwd, "getpwuid", lambda uid: member)
    monkeypatch.setattr(admin_gate.os, "getgrouplist", lambda name, gid: [gid, 4242])
    assert AdminGate(own_uid=1000, group_id=4242).allows(1001)
    assert not AdminGate(own_uid=1000, group_id=4243).allows(1001)
    with pytest.raises(BadRequest, match="no such group"):
        AdminGate.from_config("no-such-group-lorad", "")


def test_a_peer_outside_the_gate_gets_403_and_still_generates(demo_assets, monkeypatch):
    from lorad.daemon.server import admin_gate
    from lorad.daemon.server.unix_socket import PeerCredentials

    # the kernel names this test's process as the peer; the gate is told it is another local user
    monkeypatch.setattr(admin_gate, "peer_credentials", lambda transport: PeerCredentials(1, 54321, 54321))
    with serve_demo(demo_assets, "gate.sock") as (server, _):
        client = Client(server.path, timeout=30)
        with pytest.raises(Forbidden, match="uid 54321 may not change adapters"):
            client.unload_adapter("demo-r1")
        with pytest.raises(Forbidden):
            client.load_adapter("x", "/nowhere")
        assert "demo-r1" in {m["id"] for m in client.models()}
        assert client.completions(model="demo-r1", prompt="hi", max_tokens=2)["usage"]["completion_tokens"] <= 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_admin_over_tcp_needs_the_admin_key(demo_assets, short_tmp):
    import http.client

    port, path = free_port(), short_tmp / "lorad.sock"
    daemon = start_daemon(demo_assets, path, "--listen", f"tcp://127.0.0.1:{port}",
                          env={"LORAD_API_KEY": "user-key", "LORAD_ADMIN_API_KEY": "admin-key"})

    def post(route, key, body):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", route, body=json.dumps(body), headers={"Authorization": f"Bearer {key}",
                                                                          "Content-Type": "application/json"})
        response = connection.getresponse()
        status, payload = response.status, json.loads(response.read())
        connection.close()
        return status, payload

    try:
        wait_healthy(daemon, path)
        status, payload = post("/v1/unload_lora_adapter", "user-key", {"lora_name": "demo-r1"})
        assert status == 403 and payload["error"]["type"] == "permission_error"
        assert post("/v1/completions", "user-key", {"model": "demo-r1", "prompt": "hi", "max_tokens": 2})[0] == 200
        assert post("/v1/completions", "admin-key", {"model": "demo-r1", "prompt": "hi", "max_tokens": 2})[0] == 401
        assert post("/v1/unload_lora_adapter", "admin-key", {"lora_name": "demo-r1"})[0] == 200
        # the socket: this test's user is the daemon's own, an admin
        status, _, _ = raw_request(str(path), "POST", "/v1/unload_lora_adapter", json.dumps({"lora_name": "demo-r2"}).encode())
        assert status == 200
    finally:
        stop_daemon(daemon)
