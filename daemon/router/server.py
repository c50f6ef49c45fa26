"""`lorad router`'s HTTP face: one Unix socket in front of several lorad engines. A completion is checked
as a daemon checks it (schemas.parse_completion), given to a routing policy of scheduler/router.py over the
live views of the backends that serve its model (daemon/router/backends.py), and forwarded to the one
chosen: a streamed answer passes through piece by piece as it arrives, a plain one whole. A client that
leaves closes the upstream connection, and the backend aborts the request. A backend that refuses a
request before its first token (503: `admission_dropped` by early abort, or `overloaded_error`: no room to
queue it) has it routed again among the candidates that have not refused it, while the request's
time-to-first-token budget lasts; when all have refused, the client gets 503 naming them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from lorad.daemon.server import metrics as metrics_format
from lorad.daemon.server import body_parser
from lorad.daemon.server.api import error_body, error_middleware
from lorad.daemon.server.body_parser import MAX_BODY_BYTES
from lorad.daemon.server.schemas import MAX_CHOICES, parse_chat, parse_completion
from lorad.daemon.router.backends import Backend, InFlightRequest
from lorad.scheduler.router import RouteRequest

from lorad.errors import (
    AdmissionDropped,
    BackendError,
    BadRequest,
    ModelNotFound,
    Overloaded,
)

log = logging.getLogger(__name__)

ROUTER = web.AppKey("router", object)
NOT_ON_ANY_BACKEND = "on any backend (GET /v1/models lists them)"  # where the router refuses an unknown model
BYTES_PER_TOKEN = 4  # text prompts: the router has no tokenizer, so their length is estimated (BPE, English)
MODELS_REFRESH_MIN_S = 1.0  # an unknown model re-reads the backends' /v1/models at most this often
_DONE = b"data: [DONE]"
RETRYABLE = (AdmissionDropped.type, Overloaded.type)  # refusals before any work: safe to send elsewhere


class Router:
    """The backends, the policy, and the decisions taken. `start()` polls every backend once and then
    keeps polling in the background; `stop()` ends the polls and closes the connections."""

    def __init__(self, backend_sockets: list[str], policy, poll_interval_s: float = 0.2, about: dict | None = None,
                 ttft_slo_s: float | None = None):
        if not backend_sockets:
            raise BadRequest("the router needs at least one backend socket")
        if len(set(backend_sockets)) != len(backend_sockets):
            raise BadRequest("a backend socket is given twice")
        self.backends = [Backend(index, path) for index, path in enumerate(backend_sockets)]
        self.policy = policy
        self.poll_interval_s = poll_interval_s
        self.about = about or {}  # profile, objectives: shown in /v1/status
        self.decisions = {backend.socket_path: 0 for backend in self.backends}
        self.ttft_slo_s = ttft_slo_s  # a refused request is routed again only within it (None: always)
        self.refused_everywhere = 0  # requests answered 503 after every candidate refused them
        self.started = int(time.time())
        self._polls: list[asyncio.Task] = []
        self._models_refreshed = -1e9
        self._unknown_rank_warned: set[str] = set()
        self._sizes_warned: set[int] = set()  # tensor-parallel sizes predicted with another size's profile

    async def start(self) -> None:
        for backend in self.backends:
            backend.open()
        await asyncio.gather(*(backend.poll(refresh_models=True) for backend in self.backends))
        for backend in self.backends:
            log.info("backend socket=%s up=%s%s", backend.socket_path, backend.up,
                     f" tensor_parallel_size={backend.tensor_parallel_size}" if backend.up else f" reason={backend.down_reason}")
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
        raise ModelNotFound.named(model, NOT_ON_ANY_BACKEND)

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
        for backend in pool:
            self._check_profile(backend)
        chosen = self.backends[self.policy.choose(request, [backend.engine_view() for backend in pool])]
        self.decisions[chosen.socket_path] += 1
        return chosen

    def _check_profile(self, backend: Backend) -> None:
        """Says once per tensor-parallel size when the policy predicts engines of that size with a profile measured
        at another (rank-aware, with no --profile of that size)."""
        sized = getattr(self.policy, "by_tensor_parallel_size", None)
        size = backend.tensor_parallel_size
        if sized is None or size in sized or size in self._sizes_warned:
            return
        self._sizes_warned.add(size)
        profile = self.about.get("profile", {})
        log.warning("backend socket=%s spans %d GPUs (tensor_parallel_size %d) and no --profile was measured at that "
                    "size: its steps are predicted with %s (tensor_parallel_size %d); measure one with `lorad profile "
                    "--tensor-parallel-size %d`", backend.socket_path, size, size, profile.get("path") or "the example profile",
                    profile.get("tensor_parallel_size", 1), size)

    def describe(self) -> dict:
        return {
            "router": {"policy": self.policy.name, "poll_interval_s": self.poll_interval_s,
                       "decisions": dict(self.decisions), "ttft_slo_s": self.ttft_slo_s,
                       "refused_everywhere": self.refused_everywhere, **self.about},
            "backends": [backend.describe() for backend in self.backends],
        }


# --- handlers ------------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    up = sum(backend.up for backend in router.backends)
    if not up:
        raise Overloaded("no backend engine is up")
    return web.json_response({"status": "ok", "backends_up": up, "backends": len(router.backends)})


def model_entries(router: Router) -> list[dict]:
    """The union of the models of the backends that are up, each once (the first backend's entry), with
    `backends`: the sockets that serve it; the base models first."""
    entries: dict[str, dict] = {}
    for backend in router.backends:
        if not backend.up:
            continue
        for entry in backend.models:
            merged = entries.setdefault(entry["id"], {**entry, "backends": []})
            merged["backends"].append(backend.socket_path)
    # The base models first: clients (lorad bench trace) take the first entry for the base.
    return sorted(entries.values(), key=lambda entry: entry.get("kind") != "base")


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": model_entries(request.app[ROUTER])})


async def model(request: web.Request) -> web.Response:
    """One entry of /v1/models by its id (the openai client's `models.retrieve`)."""
    wanted = request.match_info["model"]
    for entry in model_entries(request.app[ROUTER]):
        if entry["id"] == wanted:
            return web.json_response(entry)
    raise ModelNotFound.named(wanted, NOT_ON_ANY_BACKEND)


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
    lines += [f'lorad_router_in_flight{{backend="{b.socket_path}"}} {len(b.in_flight)}' for b in router.backends]
    lines.append("# TYPE lorad_router_backend_failures_total counter")
    lines += [f'lorad_router_backend_failures_total{{backend="{b.socket_path}"}} {b.failed}' for b in router.backends]
    lines.append("# TYPE lorad_router_backend_drops_total counter")
    lines += [f'lorad_router_backend_drops_total{{backend="{b.socket_path}",reason="{kind}"}} {b.drops.get(kind, 0)}'
              for b in router.backends for kind in RETRYABLE]
    lines.append("# TYPE lorad_router_retries_total counter")
    lines += [f'lorad_router_retries_total{{backend="{b.socket_path}"}} {b.retries}' for b in router.backends]
    lines.append("# TYPE lorad_router_refused_everywhere_total counter")
    lines.append(f"lorad_router_refused_everywhere_total {router.refused_everywhere}")
    return web.Response(body=("\n".join(lines) + "\n").encode(), headers={"Content-Type": metrics_format.CONTENT_TYPE})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _route(request, "/v1/completions", parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _route(request, "/v1/chat/completions", parse_chat)


def _prompt_tokens(completion) -> int:
    """The request's prompt tokens for the policy: exact for token ids, BYTES_PER_TOKEN a token for text (chat:
    the messages' text), times its choices."""
    prompts = completion.prompts if completion.prompts is not None else ["".join(m["content"] for m in completion.messages)]
    tokens = sum(len(p) if isinstance(p, list) else max(1, len(p.encode()) // BYTES_PER_TOKEN) for p in prompts)
    return tokens * completion.n


async def _route(request: web.Request, path: str, parse) -> web.StreamResponse:
    router = request.app[ROUTER]
    raw = await body_parser.read_body(request)
    body = await body_parser.parse_json(request.app, raw)  # a large one in the parser's process, as the daemon does
    # refused here as a backend would refuse it, but for n: each backend holds its own --max-n
    completion = parse(body, max_n=MAX_CHOICES)
    pool = await router.candidates(completion.model)
    route = RouteRequest(router.rank(completion.model, pool), _prompt_tokens(completion))
    arrived = time.monotonic()
    refusals: list[_Refusal] = []
    while True:  # once per backend at most: one that refuses before any token is left out of the next choice
        backend, flight, upstream = await _forward(router, route, pool, completion, raw, path)
        backend.routed += 1
        if refusals:
            backend.retries += 1
        try:
            refusal, head = await _refused(upstream, completion.stream, backend)
        except BaseException:
            upstream.close()
            backend.in_flight.pop(flight.id, None)
            raise
        if refusal is None:
            break
        upstream.close()
        backend.dropped(flight, refusal.kind)
        refusals.append(refusal)
        pool = [b for b in pool if b.up and all(b is not r.backend for r in refusals)]
        stop = _reason_not_to_retry(router, request, pool, arrived)
        log.info("request refused model=%s rank=%d backend=%s reason=%s retry=%s", completion.model, route.rank,
                 backend.socket_path, refusal.kind, "no: " + stop if stop else "yes")
        if stop:
            raise _refused_everywhere(router, completion.model, refusals, stop)

    outcome = "client_left"
    try:
        if upstream.status >= 400:  # the backend's own refusal, as it gave it
            headers = {k: v for k, v in upstream.headers.items() if k == "Retry-After"}
            outcome = f"refused_{upstream.status}"
            return web.Response(body=await upstream.read(), status=upstream.status, headers=headers,
                                content_type="application/json")
        if completion.stream:
            response, outcome = await _pass_stream(request, upstream, backend, flight, head)
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
        backend.in_flight.pop(flight.id, None)
        log.info("request routed model=%s rank=%d prompt_tokens=%d backend=%s outcome=%s tokens_seen=%d latency_ms=%.1f "
                 "refused_by=%d", completion.model, route.rank, route.prompt_tokens, backend.socket_path, outcome,
                 flight.generated, (time.monotonic() - flight.started) * 1e3, len(refusals))


async def _forward(router: Router, route: RouteRequest, pool: list[Backend], completion, raw: bytes, path: str):
    """Chooses a backend of `pool` and posts the request to it -> (backend, flight, upstream response). A
    backend that refuses the connection is marked down and another chosen (nothing was sent)."""
    while True:
        backend = router.choose(route, pool)
        flight = InFlightRequest(route.rank, route.prompt_tokens, completion.sampling.max_tokens, completion.stream)
        backend.in_flight[flight.id] = flight
        try:
            upstream = await backend.session.post(
                f"http://localhost{path}", data=raw, headers={"Content-Type": "application/json"})
            return backend, flight, upstream
        except aiohttp.ClientConnectorError as error:  # nothing was sent: safe to send elsewhere
            del backend.in_flight[flight.id]
            backend.mark_down(f"connection refused: {error.os_error}")
            pool = [b for b in pool if b.up]
            if not pool:
                raise BackendError(f"no backend serving {completion.model!r} accepts connections "
                                   f"(last tried {backend.socket_path}: {error.os_error})") from None
        except (aiohttp.ClientError, OSError) as error:  # sent, then lost: it may have run, do not repeat it
            del backend.in_flight[flight.id]
            raise _backend_failed(backend, error) from None
        except asyncio.CancelledError:  # the client left while waiting: the cancelled post closed the connection
            del backend.in_flight[flight.id]
            raise


class _Refusal:
    def __init__(self, backend: Backend, kind: str, message: str, retry_after_s: float):
        self.backend, self.kind, self.message, self.retry_after_s = backend, kind, message, retry_after_s


async def _refused(upstream, stream: bool, backend: Backend) -> tuple[_Refusal | None, bytes]:
    """Whether the backend refused the request before any token, as a retryable 503 (a plain answer, as lorad serve
    gives, or the first event of a stream begun before its first token, as other OpenAI servers may) -> (the
    refusal or None, the stream's bytes read so far,
    which the caller passes on). A stream is read up to its first complete event before the client's
    response starts, so that a refusal can still be routed elsewhere."""
    if upstream.status == 503:
        body = await upstream.read()
        # read() keeps the body: the caller passes on a refusal that is not retried as it came
        return _retryable_refusal(body, backend, upstream.headers.get("Retry-After")), b""
    if not stream or upstream.status != 200:
        return None, b""
    head = b""
    while b"\n\n" not in head:
        try:
            data = await upstream.content.readany()
        except (aiohttp.ClientError, OSError) as error:
            raise _backend_failed(backend, error) from None
        if not data:
            break  # ended early: _pass_stream reports it
        head += data
    event = head.split(b"\n\n", 1)[0]
    if event.startswith(b"data: {"):
        return _retryable_refusal(event[len(b"data: "):], backend, None), head
    return None, head


def _retryable_refusal(body: bytes, backend: Backend, retry_after: str | None) -> _Refusal | None:
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("type") not in RETRYABLE:
        return None
    try:
        retry_after_s = float(retry_after) if retry_after else 1.0
    except ValueError:
        retry_after_s = 1.0
    return _Refusal(backend, error["type"], str(error.get("message", "")), retry_after_s)


def _reason_not_to_retry(router: Router, request: web.Request, pool: list[Backend], arrived: float) -> str | None:
    """Why a refused request is not routed again (None: it is)."""
    if request.transport is None or request.transport.is_closing():
        return "the client left"
    if not pool:
        return "no other candidate"
    waited = time.monotonic() - arrived
    if router.ttft_slo_s is not None and waited >= router.ttft_slo_s:
        return f"its time-to-first-token budget of {router.ttft_slo_s * 1e3:.0f} ms is spent ({waited * 1e3:.0f} ms)"
    return None


def _refused_everywhere(router: Router, model: str, refusals: list[_Refusal], stop: str) -> Overloaded:
    """The 503 the client gets: AdmissionDropped when every refusal was an early-abort drop."""
    router.refused_everywhere += 1
    each = "; ".join(f"{r.backend.socket_path} ({r.kind}: {r.message})" for r in refusals)
    kind = AdmissionDropped if all(r.kind == AdmissionDropped.type for r in refusals) else Overloaded
    names = ", ".join(r.backend.socket_path for r in refusals)
    if stop == "no other candidate":
        message = f"every engine serving {model!r} refused the request: {names}. Why: {each}"
    else:
        message = f"refused by the engines {names}; not routed again: {stop}. Why: {each}"
    return kind(message, retry_after_s=max(r.retry_after_s for r in refusals))


def _backend_failed(backend: Backend, error: BaseException) -> BackendError:
    reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    backend.failed += 1
    backend.mark_down(f"a forwarded request failed: {reason}")
    return BackendError(f"the backend {backend.socket_path} failed during the request: {reason}")


async def _pass_stream(request, upstream, backend: Backend, flight: InFlightRequest,
                       head: bytes = b"") -> tuple[web.StreamResponse, str]:
    """Writes each piece of the backend's event stream to the client as it arrives (`head` first: what
    was read already), counting the tokens of the complete events for the router's view. A backend that
    breaks off ends the stream with an error event (502) and [DONE], as the daemon ends a failed
    generation; a drop after tokens were streamed passes through (counted, not repeated elsewhere).
    Returns the response and how it ended: streamed, client_left, dropped or backend_failed."""
    response = web.StreamResponse(status=upstream.status,
                                  headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    partial, done, dropped = b"", False, False
    while True:
        if head:
            data, head, failure = head, b"", None
        else:
            try:
                data = await upstream.content.readany()
            except (aiohttp.ClientError, OSError) as error:
                data, failure = b"", _backend_failed(backend, error)
            else:
                failure = None
        if failure is None and not data and not done:
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
            flight.generated += _tokens_in_event(event)
            refusal = _retryable_refusal(event[len(b"data: "):], backend, None) if event.startswith(b"data: {\"error\"") else None
            if refusal is not None:
                backend.drops[refusal.kind] = backend.drops.get(refusal.kind, 0) + 1
                dropped = True
    await response.write_eof()
    return response, "backend_failed" if failure is not None else "dropped" if dropped else "streamed"


def _tokens_in_event(event: bytes) -> int:
    """Tokens one server-sent event carries: its token_ids when the client asked for them, else one per
    choice (the daemon sends a chunk per engine step, one token each)."""
    if not event.startswith(b"data: {"):
        return 0
    try:
        chunk = json.loads(event[len(b"data: "):])
    except json.JSONDecodeError:
        return 0
    return sum(len(choice["token_ids"]) if "token_ids" in choice else 1 for choice in chunk.get("choices") or ())


def create_app(router: Router) -> web.Application:
    """The router's routes. The caller owns the router: `await router.start()` before serving,
    `await router.stop()` after."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ROUTER] = router
    body_parser.add_to(app)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # adapter names may hold slashes
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
