"""Clients of the daemon's HTTP API over its Unix socket: `Client` (blocking, http.client, no extra
dependencies) and `AsyncClient` (aiohttp). Both speak every route and raise the lorad.errors class the
daemon names, carrying its message, type and status; OSError means no daemon answers on the socket.
Also importable as `lorad.client`.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import AsyncIterator, Iterator
from urllib.parse import quote

from lorad.config import ServerConfig
from lorad.errors import (
    AdapterError, AdmissionDropped, BackendError, BadRequest, BodyTooLarge, EngineDead, LoradError, MethodNotAllowed,
    ModelError, ModelNotFound, NotFound, Overloaded, PromptTooLong, Unauthorized, Forbidden,
)

_BY_TYPE = {
    cls.type: cls
    for cls in (BadRequest, PromptTooLong, NotFound, ModelNotFound, MethodNotAllowed, BodyTooLarge, AdapterError,
                ModelError, EngineDead, BackendError, Unauthorized, Forbidden)
}
_BY_STATUS = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 405: MethodNotAllowed, 413: BodyTooLarge,
              502: BackendError, 503: Overloaded}


def error_from_response(status: int, body: bytes, retry_after: str | None = None) -> LoradError:
    """The lorad.errors exception for an error answer of the daemon (or anything else on the socket)."""
    try:
        detail = json.loads(body)["error"]
        message, kind = str(detail["message"]), detail.get("type")
    except (ValueError, KeyError, TypeError):
        message, kind = body.decode("utf-8", "replace").strip() or f"HTTP {status}", None
    if status == 503:  # Overloaded, or its AdmissionDropped: both carry Retry-After
        cls = AdmissionDropped if kind == AdmissionDropped.type else Overloaded
        try:
            error = cls(message, retry_after_s=float(retry_after)) if retry_after else cls(message)
        except ValueError:
            error = cls(message)
    else:
        cls = _BY_TYPE.get(kind)
        if cls is None or cls.status != status:
            cls = _BY_STATUS.get(status, LoradError)
        error = cls(message)
    error.status, error.type = status, kind or error.type  # what the server said, e.g. model_not_found
    return error


def _stream_chunk(line: bytes) -> dict | None:
    """One server-sent event line of a streamed completion: its chunk, None for anything else.
    Raises StopIteration's stand-in `_Done` at [DONE] and the error an error event carries."""
    if not line.startswith(b"data: "):
        return None
    data = line[len(b"data: "):].strip()
    if data == b"[DONE]":
        raise _Done
    chunk = json.loads(data)
    if "error" in chunk:  # the request failed after the stream began
        raise error_from_response(chunk["error"].get("code", 500), data)
    return chunk


def model_path(name: str) -> str:
    """GET /v1/models/{name}'s path: the name percent-encoded, its slashes kept (the route takes the rest of the
    path)."""
    return "/v1/models/" + quote(name, safe="/")


class _Done(Exception):
    pass


# --- blocking ---------------------------------------------------------------------------------------------


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float | None = None):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Client:
    """`Client("/tmp/lorad/lorad.sock").completions(model="demo-r16", prompt="hello", max_tokens=16)`.

    One connection per call, so a Client may be shared by threads."""

    def __init__(self, socket_path: str = ServerConfig.socket, timeout: float | None = 600.0):
        self.socket_path = socket_path
        self.timeout = timeout

    def health(self) -> dict:
        return self._json("GET", "/health")

    def models(self) -> list[dict]:
        """The base model first, then each adapter (the `data` of GET /v1/models)."""
        return self._json("GET", "/v1/models")["data"]

    def model(self, name: str) -> dict:
        """One /v1/models entry by its id; ModelNotFound when the daemon serves no such model."""
        return self._json("GET", model_path(name))

    def status(self) -> dict:
        """The engine's state: device, dtype, page-pool occupancy, resident adapters, queue lengths."""
        return self._json("GET", "/v1/status")

    def metrics(self) -> str:
        """GET /metrics: Prometheus text."""
        connection, response = self._send("GET", "/metrics", None)
        try:
            return response.read().decode()
        finally:
            connection.close()

    def load_adapter(self, name: str, path: str) -> dict:
        """Registers the adapter at `path` (under one of the daemon's adapter roots) as `name`; returns its
        /v1/models entry. AdapterError or BadRequest with the reason when the daemon refuses it."""
        return self._json("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> dict:
        """New requests for `name` are refused from now on; those already submitted finish."""
        return self._json("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def completions(self, **fields) -> dict:
        """POST /v1/completions with `fields` (model, prompt, max_tokens, temperature...)."""
        return self._json("POST", "/v1/completions", {**fields, "stream": False})

    def chat_completions(self, **fields) -> dict:
        """POST /v1/chat/completions with `fields` (model, messages, max_completion_tokens, temperature...)."""
        return self._json("POST", "/v1/chat/completions", {**fields, "stream": False})

    def stream_completions(self, **fields) -> Iterator[dict]:
        """Yields the parsed chunks of a streamed completion. Leaving the loop early closes the
        connection, which aborts the request in the daemon."""
        return self._stream("/v1/completions", fields)

    def stream_chat_completions(self, **fields) -> Iterator[dict]:
        """The same for a chat completion (chat.completion.chunk objects)."""
        return self._stream("/v1/chat/completions", fields)

    def _stream(self, path: str, fields: dict) -> Iterator[dict]:
        connection, response = self._send("POST", path, {**fields, "stream": True})
        try:
            yield from (chunk for chunk in map(_stream_chunk, response) if chunk is not None)
            raise LoradError("the stream ended without [DONE]")
        except _Done:
            return
        finally:
            connection.close()

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        connection, response = self._send(method, path, body)
        try:
            return json.loads(response.read())
        finally:
            connection.close()

    def _send(self, method: str, path: str, body: dict | None):
        connection = UnixHTTPConnection(self.socket_path, timeout=self.timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            try:
                connection.request(method, path, body=payload, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server may refuse (413) before reading the whole body: its answer is waiting
            response = connection.getresponse()
            if response.status >= 400:
                raise error_from_response(response.status, response.read(), response.getheader("Retry-After"))
        except BaseException:
            connection.close()
            raise
        return connection, response


# --- asyncio ------------------------------------------------------------------------------------------------


class AsyncClient:
    """The same calls as Client, awaited, over one aiohttp session (kept-alive connections):

        async with AsyncClient(path) as client:
            async for chunk in client.stream_completions(model="demo-r8", prompt="hi"):
                ...

    `max_connections`: connections open at once (0: no limit); further calls wait for one. The session
    opens on the first call; `close()` (or leaving `async with`) closes it.
    """

    def __init__(self, socket_path: str = ServerConfig.socket, timeout: float | None = 600.0,
                 max_connections: int = 100):
        self.socket_path = socket_path
        self.timeout = timeout
        self.max_connections = max_connections
        self._session = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def health(self) -> dict:
        return await self._json("GET", "/health")

    async def models(self) -> list[dict]:
        return (await self._json("GET", "/v1/models"))["data"]

    async def model(self, name: str) -> dict:
        return await self._json("GET", model_path(name))

    async def status(self) -> dict:
        return await self._json("GET", "/v1/status")

    async def metrics(self) -> str:
        async with self._request("GET", "/metrics", None) as response:
            await self._check(response)
            return await response.text()

    async def load_adapter(self, name: str, path: str) -> dict:
        return await self._json("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_adapter(self, name: str) -> dict:
        return await self._json("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def completions(self, **fields) -> dict:
        return await self._json("POST", "/v1/completions", {**fields, "stream": False})

    async def chat_completions(self, **fields) -> dict:
        return await self._json("POST", "/v1/chat/completions", {**fields, "stream": False})

    def stream_completions(self, **fields) -> AsyncIterator[dict]:
        """Yields the parsed chunks; leaving early (or `aclose()`) drops the connection, which aborts
        the request in the daemon."""
        return self._stream("/v1/completions", fields)

    def stream_chat_completions(self, **fields) -> AsyncIterator[dict]:
        return self._stream("/v1/chat/completions", fields)

    async def _stream(self, path: str, fields: dict) -> AsyncIterator[dict]:
        async with self._request("POST", path, {**fields, "stream": True}) as response:
            await self._check(response)
            try:
                async for line in response.content:
                    if (chunk := _stream_chunk(line)) is not None:
                        yield chunk
                raise LoradError("the stream ended without [DONE]")
            except _Done:
                return
            finally:
                if not response.content.at_eof():
                    response.close()  # never hand a half-read connection back to the pool

    async def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        async with self._request(method, path, body) as response:
            await self._check(response)
            return json.loads(await response.read())

    def _request(self, method: str, path: str, body: dict | None):
        if self._session is None:
            import aiohttp  # only for those who use the async client

            connector = aiohttp.UnixConnector(self.socket_path, limit=self.max_connections)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout), raise_for_status=False,
            )
        return self._session.request(method, f"http://localhost{path}", json=body)

    @staticmethod
    async def _check(response) -> None:
        if response.status >= 400:
            raise error_from_response(response.status, await response.read(), response.headers.get("Retry-After"))
