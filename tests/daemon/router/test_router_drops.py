"""`lorad router` when engines refuse requests (fake engines, in one event loop): a request an engine drops
(early abort's 503 `admission_dropped`, plain or streamed before any token) or has no room for (503
`overloaded_error`) is routed again to the next candidate in the policy's order, forgotten at once in the
dropping engine's view, counted per engine in /metrics and /v1/status; when every candidate refuses, or
the TTFT budget is spent, the client gets 503 naming the engines; a stream that already carried tokens is
never repeated elsewhere."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from lorad.daemon.server.unix_socket import serve_unix
from lorad.daemon.router.server import Router, create_app
from lorad.scheduler.router import FirstFit

MODEL = "adapter"


def event(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def drop_error(kind: str = "admission_dropped") -> dict:
    message = "dropped by early-abort admission: early abort: estimated TTFT 2000.0 ms > objective 1000.0 ms"
    if kind == "overloaded_error":
        message = "64 requests are already waiting"
    return {"error": {"message": message, "type": kind, "code": 503}}


class FakeEngine:
    """A lorad engine's routes as the router reads them. `mode`: answer, drop (early abort), full (no room to
    queue), tokens_then_drop (streams a token, then the drop's error event). `gate`: answers wait for it."""

    def __init__(self, path: str, mode: str):
        self.path, self.mode = path, mode
        self.posts = 0
        self.gate: asyncio.Event | None = None
        self.waiting = asyncio.Event()  # set while an answer waits at the gate

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/status", self.status)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request):
        return web.json_response({"data": [{"id": "base", "kind": "base"},
                                           {"id": MODEL, "kind": "adapter", "parent": "base", "rank": 8}]})

    async def status(self, request):
        return web.json_response({"max_running_requests": 8, "free_kv_tokens": 10_000,
                                  "running_batch": [], "waiting_batch": []})

    async def completions(self, request):
        self.posts += 1
        body = await request.json()
        if self.mode == "full" or (self.mode == "drop" and not body.get("stream")):
            kind = "overloaded_error" if self.mode == "full" else "admission_dropped"
            return web.json_response(drop_error(kind), status=503, headers={"Retry-After": "2"})
        if self.gate is not None:
            self.waiting.set()
            await self.gate.wait()
        chunk = {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                 "choices": [{"index": 0, "text": "x", "finish_reason": None, "logprobs": None}]}
        if not body.get("stream"):
            return web.json_response({**chunk, "answered_by": self.path})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.mode == "drop":
            await response.write(event(drop_error()))
        else:
            await response.write(event(chunk))
            await response.write(event(drop_error()) if self.mode == "tokens_then_drop" else event(chunk))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def short_tmp():
    directory = tempfile.mkdtemp(prefix="lorad-rd-", dir="/tmp")  # Unix socket paths must stay short
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


def run(short_tmp: Path, modes: list[str], scenario, ttft_slo_s: float | None = None):
    """Starts one fake engine per mode and a router (first-fit: engines are preferred in their order) on
    Unix sockets, then awaits scenario(router, engines, client) with an aiohttp client to the router."""

    async def main():
        engines, runners = [], []
        for index, mode in enumerate(modes):
            engine = FakeEngine(str(short_tmp / f"e{index}.sock"), mode)
            engines.append(engine)
            runners.append(await serve_unix(engine.app(), engine.path))
        router = Router([e.path for e in engines], FirstFit(), poll_interval_s=0.05, ttft_slo_s=ttft_slo_s)
        await router.start()
        router_path = str(short_tmp / "router.sock")
        runners.append(await serve_unix(create_app(router), router_path))
        client = aiohttp.ClientSession(connector=aiohttp.UnixConnector(router_path))
        try:
            await scenario(router, engines, client)
        finally:
            await client.close()
            for runner in reversed(runners):
                await runner.cleanup()
            await router.stop()

    asyncio.run(main())


async def post(client, **fields) -> tuple[int, bytes]:
    async with client.post("http://router/v1/completions", json={"model": MODEL, "prompt": "hi", **fields}) as answer:
        return answer.status, await answer.read()


async def router_metrics(client) -> list[str]:
    async with client.get("http://router/metrics") as answer:
        return (await answer.text()).splitlines()


async def router_status(client) -> dict:
    async with client.get("http://router/v1/status") as answer:
        return await answer.json()


def test_a_dropped_request_is_retried_on_the_next_engine_and_counted(short_tmp):
    async def scenario(router, engines, client):
        dropper, server = engines
        server.gate = asyncio.Event()
        pending = asyncio.create_task(post(client))
        await asyncio.wait_for(server.waiting.wait(), 10)
        # while it runs on the second engine, the first no longer counts it in its view
        assert router.backends[0].engine_view().num_requests == 0 and not router.backends[0].in_flight
        assert router.backends[1].engine_view().num_requests == 1
        server.gate.set()
        status, body = await pending
        assert status == 200 and json.loads(body)["answered_by"] == server.path
        assert (dropper.posts, server.posts) == (1, 1)
        lines = await router_metrics(client)
        assert f'lorad_router_backend_drops_total{{backend="{dropper.path}",reason="admission_dropped"}} 1' in lines
        assert f'lorad_router_backend_drops_total{{backend="{server.path}",reason="admission_dropped"}} 0' in lines
        assert f'lorad_router_retries_total{{backend="{server.path}"}} 1' in lines
        assert f'lorad_router_retries_total{{backend="{dropper.path}"}} 0' in lines
        assert "lorad_router_refused_everywhere_total 0" in lines
        backends = (await router_status(client))["backends"]
        assert backends[0]["drops"] == {"admission_dropped": 1} and backends[0]["retries"] == 0
        assert backends[1]["drops"] == {} and backends[1]["retries"] == 1
        assert all(b["in_flight"] == 0 for b in backends)

    run(short_tmp, ["drop", "answer"], scenario)


def test_a_stream_dropped_before_its_first_token_is_retried(short_tmp):
    async def scenario(router, engines, client):
        status, body = await post(client, stream=True)
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 3 and events[-1] == b"data: [DONE]"  # two tokens from the second engine
        assert all(b'"error"' not in e for e in events)
        assert [e.posts for e in engines] == [1, 1]
        assert router.backends[0].drops == {"admission_dropped": 1} and router.backends[1].retries == 1

    run(short_tmp, ["drop", "answer"], scenario)


def test_every_engine_refusing_gives_one_503_naming_them(short_tmp):
    async def scenario(router, engines, client):
        for stream in (False, True):
            status, body = await post(client, stream=stream)
            assert status == 503
            error = json.loads(body)["error"]
            assert error["type"] == "overloaded_error" and error["code"] == 503  # mixed reasons
            assert error["message"].startswith(f"every engine serving {MODEL!r} refused the request")
            for engine in engines:
                assert engine.path in error["message"]
            assert "admission_dropped" in error["message"] and "overloaded_error" in error["message"]
        assert [e.posts for e in engines] == [2, 2, 2]  # each tried once per request
        lines = await router_metrics(client)
        assert "lorad_router_refused_everywhere_total 2" in lines
        assert f'lorad_router_backend_drops_total{{backend="{engines[1].path}",reason="overloaded_error"}} 2' in lines
        assert (await router_status(client))["router"]["refused_everywhere"] == 2

    run(short_tmp, ["drop", "full", "drop"], scenario)


def test_all_drops_keep_the_admission_dropped_type(short_tmp):
    async def scenario(router, engines, client):
        async with client.post("http://router/v1/completions", json={"model": MODEL, "prompt": "hi"}) as answer:
            assert answer.status == 503 and answer.headers["Retry-After"] == "2"
            assert (await answer.json())["error"]["type"] == "admission_dropped"

    run(short_tmp, ["drop", "drop"], scenario)


def test_no_retry_once_the_ttft_budget_is_spent(short_tmp):
    async def scenario(router, engines, client):
        status, body = await post(client)
        assert status == 503
        message = json.loads(body)["error"]["message"]
        assert engines[0].path in message and "budget" in message and engines[1].path not in message.split(";")[0]
        assert [e.posts for e in engines] == [1, 0]

    run(short_tmp, ["drop", "answer"], scenario, ttft_slo_s=1e-9)


def test_a_stream_that_already_carried_tokens_is_not_retried(short_tmp):
    async def scenario(router, engines, client):
        status, body = await post(client, stream=True)
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert json.loads(events[0][len(b"data: "):])["choices"][0]["text"] == "x"  # the token went out
        assert json.loads(events[1][len(b"data: "):])["error"]["type"] == "admission_dropped"  # passed through
        assert events[-1] == b"data: [DONE]"
        assert [e.posts for e in engines] == [1, 0]
        assert router.backends[0].drops == {"admission_dropped": 1} and router.backends[1].retries == 0

    run(short_tmp, ["tokens_then_drop", "answer"], scenario)
