"""`lorad router`'s HTTP face: one Unix socket in front of several lorad engines. A completion is checked
as a daemon checks it (api.parse_completion), given to a routing policy of scheduler/router.py over the
live views of the backends that serve its model (daemon/router_backends.py), and forwarded to the one
chosen: a streamed answer passes through piece by piece as it arrives, a plain one whole. A client that
leaves closes the upstream connection, and the backend aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from lorad.daemon import metrics as metrics_format
from lorad.daemon.api import (
    MAX_BODY_BYTES,
    error_body,
    error_middleware,
    parse_completion,
)
from lorad.daemon.router_backends import Backend, Flight
from lorad.scheduler.router import RouteRequest

from lorad.errors import (
    BackendError,
    BadRequest,
    BodyTooLarge,
    ModelNotFound,
    Overloaded,
)

log = logging.getLogger(__name__)

ROUTER = web.AppKey("router", object)
BYTES_PER_TOKEN = 4  # text prompts: the router has no tokenizer, so their length is estimated (BPE, English)
MODELS_REFRESH_MIN_S = 1.0  # an unknown model re-reads the backends' /v1/models at most this often
_DONE = b"data: [DONE]"


class Router:
    """The backends, the policy, and the decisions taken. `start()` polls every backend once and then
    keeps polling in the background; `stop()` ends the polls and closes the connections."""

    def __init__(self, backend_sockets: list[str], policy, poll_interval_s: float = 0.2, about: dict | None = None):
        if not backend_sockets:
            raise BadRequest("the router needs at least one backend socket")
        if len(set(backend_sockets)) != len(backend_sockets):
            raise BadRequest("a backend socket is given twice")
        self.backends = [Backend(index, path) for index, path in enumerate(backend_sockets)]
        self.policy = policy
        self.poll_interval_s = poll_interval_s
        self.about = about or {}  # profile, objectives: shown in /v1/status
        self.decisions = {backend.socket_path: 0 for backend in self.backends}
        self.started = int(time.time())
        self._polls: list[asyncio.Task] = []
        self._models_refreshed = -1e9
        self._unknown_rank_warned: set[str] = set()

    async def start(self) -> None:
        for backend in self.backends:
            backend.open()
        await asyncio.gather(*(backend.poll(refresh_models=True) for backend in self.backends))
        for backend in self.backends:
            log.info("backend socket=%s up=%s%s", backend.socket_path, backend.up,
                     "" if backend.up else f" reason={backend.down_reason}")
        self._polls = [asyncio.create_task(backend.poll_forever(self.poll_interval_s)) for backend in self.backends]

    async def stop(self) -> None:
        for task in self._polls:
            task.cancel()
        await asyncio.gather(*self._polls, return_exceptions=True)
        for backend in self.backends:
            await backend.close()

    # --- choosing a backend ------------------------------------------------------------------------------

    async def candidates(self, model: str) -> list[Backend]:
        """The backends that are up and serve `model`. Overloaded (503) when none is up, or when those
        that serve it are all down; ModelNotFound (404) when no backend knows it."""
        if not any(backend.up for backend in self.backends):
            reasons = "; ".join(f"{b.socket_path}: {b.down_reason}" for b in self.backends)
            raise Overloaded(f"no backend engine is up ({reasons})")
        pool = [backend for backend in self.backends if backend.up and backend.serves(model)]
        if not pool and time.monotonic() - self._models_refreshed >= MODELS_REFRESH_MIN_S:
            self._models_refreshed = time.monotonic()  # an adapter may have been loaded since the last read
            await asyncio.gather(*(b.poll(refresh_models=True) for b in self.backends if b.up))
            pool = [backend for backend in self.backends if backend.up and backend.serves(model)]
        if pool:
            return pool
        down = [backend for backend in self.backends if not backend.up and backend.serves(model)]
        if down:
            reasons = "; ".join(f"{b.socket_path}: {b.down_reason}" for b in down)
            raise Overloaded(f"every backend serving {model!r} is down ({reasons})")
        raise ModelNotFound(f"the model {model!r} does not exist on any backend (GET /v1/models lists them)")

    def rank(self, model: str, pool: list[Backend]) -> int:
        """The adapter's rank as the backends list it (or its adapter_config.json declares it). Unknown:
        the largest rank the router knows of, so that the policy errs on the side of a heavier request."""
        known = next((b.ranks[model] for b in pool if b.ranks[model] is not None), None)
        if known is not None:
            return known
        largest = max((r for b in self.backends for r in b.ranks.values() if r is not None), default=0)
        if model not in self._unknown_rank_warned:
            self._unknown_rank_warned.add(model)
            log.warning("adapter rank unknown model=%s routed_as_rank=%d", model, largest)
        return largest

    def choose(self, request: RouteRequest, pool: list[Backend]) -> Backend:
        chosen = self.backends[self.policy.choose(request, [backend.view() for backend in pool])]
        self.decisions[chosen.socket_path] += 1
        return chosen

    def describe(self) -> dict:
        return {
            "router": {"policy": self.policy.name, "poll_interval_s": self.poll_interval_s,
                       "decisions": dict(self.decisions), **self.about},
            "backends": [backend.describe() for backend in self.backends],
        }


# --- handlers ------------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    up = sum(backend.up for backend in router.backends)
    if not up:
        raise Overloaded("no backend engine is up")
    return web.json_response({"status": "ok", "backends_up": up, "backends": len(router.backends)})


async def models(request: web.Request) -> web.Response:
    """The union of the models of the backends that are up, each once (the first backend's entry), with
    `backends`: the sockets that serve it."""
    router = request.app[ROUTER]
    entries: dict[str, dict] = {}
    for backend in router.backends:
        if not backend.up:
            continue
        for entry in backend.models:
            merged = entries.setdefault(entry["id"], {**entry, "backends": []})
            merged["backends"].append(backend.socket_path)
    # The base models first: clients (lorad bench trace) take the first entry for the base.
    data = sorted(entries.values(), key=lambda entry: entry.get("kind") != "base")
    return web.json_response({"object": "list", "data": data})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[ROUTER].describe())


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text (0.0.4): decisions, health and requests in flight per backend."""
    router = request.app[ROUTER]
    lines = ["# TYPE lorad_router_decisions_total counter"]
    lines += [f'lorad_router_decisions_total{{backend="{path}"}} {count}' for path, count in router.decisions.items()]
    lines.append("# TYPE lorad_router_backend_up gauge")
    lines += [f'lorad_router_backend_up{{backend="{b.socket_path}"}} {int(b.up)}' for b in router.backends]
    lines.append("# TYPE lorad_router_in_flight gauge")
    lines += [f'lorad_router_in_flight{{backend="{b.socket_path}"}} {len(b.flights)}' for b in router.backends]
    lines.append("# TYPE lorad_router_backend_failures_total counter")
    lines += [f'lorad_router_backend_failures_total{{backend="{b.socket_path}"}} {b.failed}' for b in router.backends]
    return web.Response(body=("\n".join(lines) + "\n").encode(), headers={"Content-Type": metrics_format.CONTENT_TYPE})


async def completions(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    raw = await _read_body(request)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not JSON: {error}") from None
    completion = parse_completion(body)  # refused here exactly as a backend would refuse it
    pool = await router.candidates(completion.model)
    prompt = completion.prompt
    prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(prompt.encode()) // BYTES_PER_TOKEN)
    route = RouteRequest(router.rank(completion.model, pool), prompt_tokens)

    while True:  # a backend that refuses the connection is marked down and the request routed again
        backend = router.choose(route, pool)
        flight = Flight(route.rank, prompt_tokens, completion.sampling.max_tokens, completion.stream)
        backend.flights[flight.id] = flight
        try:
            upstream = await backend.session.post(
                "http://localhost/v1/completions", data=raw, headers={"Content-Type": "application/json"})
            break
        except aiohttp.ClientConnectorError as error:  # nothing was sent: safe to send elsewhere
            del backend.flights[flight.id]
            backend.mark_down(f"connection refused: {error.os_error}")
            pool = [b for b in pool if b.up]
            if not pool:
                raise BackendError(f"no backend serving {completion.model!r} accepts connections "
                                   f"(last tried {backend.socket_path}: {error.os_error})") from None
        except (aiohttp.ClientError, OSError) as error:  # sent, then lost: it may have run, do not repeat it
            del backend.flights[flight.id]
            raise _backend_failed(backend, error) from None
        except asyncio.CancelledError:  # the client left while waiting: the cancelled post closed the connection
            del backend.flights[flight.id]
            raise

    backend.routed += 1
    outcome = "client_left"
    try:
        if upstream.status >= 400:  # the backend's own refusal, as it gave it
            headers = {k: v for k, v in upstream.headers.items() if k == "Retry-After"}
            outcome = f"refused_{upstream.status}"
            return web.Response(body=await upstream.read(), status=upstream.status, headers=headers,
                                content_type="application/json")
        if completion.stream:
            response, outcome = await _pass_stream(request, upstream, backend, flight)
            return response
        try:
            answer = await upstream.read()
        except (aiohttp.ClientError, OSError) as error:
            outcome = "backend_failed"
            raise _backend_failed(backend, error) from None
        outcome = "answered"
        return web.Response(body=answer, status=upstream.status, content_type="application/json")
    finally:
        upstream.close()  # if the client left early, this is what aborts the request in the backend
        backend.flights.pop(flight.id, None)
        log.info("request routed model=%s rank=%d prompt_tokens=%d backend=%s outcome=%s tokens_seen=%d latency_ms=%.1f",
                 completion.model, route.rank, prompt_tokens, backend.socket_path, outcome, flight.generated,
                 (time.monotonic() - flight.started) * 1e3)


def _backend_failed(backend: Backend, error: BaseException) -> BackendError:
    reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    backend.failed += 1
    backend.mark_down(f"a forwarded request failed: {reason}")
    return BackendError(f"the backend {backend.socket_path} failed during the request: {reason}")


async def _pass_stream(request, upstream, backend: Backend, flight: Flight) -> tuple[web.StreamResponse, str]:
    """Writes each piece of the backend's event stream to the client as it arrives, counting the tokens
    of the complete events for the router's view. A backend that breaks off ends the stream with an
    error event (502) and [DONE], as the daemon ends a failed generation. Returns the response and how
    it ended: streamed, client_left or backend_failed."""
    response = web.StreamResponse(status=upstream.status,
                                  headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    partial, done = b"", False
    while True:
        try:
            data = await upstream.content.readany()
        except (aiohttp.ClientError, OSError) as error:
            data, failure = b"", _backend_failed(backend, error)
        else:
            failure = None
            if not data and not done:
                failure = _backend_failed(backend, ConnectionError("the stream ended without [DONE]"))
        if failure is not None:
            data = (b"data: " + json.dumps(error_body(failure)).encode() + b"\n\n" + _DONE + b"\n\n")
        if not data:
            break
        try:
            await response.write(data)
        except ConnectionResetError:  # the client left: the caller closes the upstream connection
            return response, "client_left"
        if failure is not None:
            break
        events = (partial + data).split(b"\n\n")
        partial = events.pop()
        for event in events:
            done |= event.startswith(_DONE)
            flight.generated += _tokens_in(event)
    await response.write_eof()
    return response, "streamed" if failure is None else "backend_failed"


def _tokens_in(event: bytes) -> int:
    """Tokens one server-sent event carries: its token_ids when the client asked for them, else one per
    choice (the daemon sends a chunk per engine step, one token each)."""
    if not event.startswith(b"data: {"):
        return 0
    try:
        chunk = json.loads(event[len(b"data: "):])
    except json.JSONDecodeError:
        return 0
    return sum(len(choice["token_ids"]) if "token_ids" in choice else 1 for choice in chunk.get("choices") or ())


async def _read_body(request: web.Request) -> bytes:
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise BodyTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    return await request.read()  # aiohttp raises 413 past client_max_size


def create_app(router: Router) -> web.Application:
    """The router's routes. The caller owns the router: `await router.start()` before serving,
    `await router.stop()` after."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ROUTER] = router
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app
