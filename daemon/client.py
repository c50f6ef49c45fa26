"""A small synchronous client of the daemon's HTTP API over its Unix socket (http.client, no extra
dependencies). The tests and `lorad generate` use it; errors come back as lorad.errors exceptions.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Iterator

from lorad.config import ServerConfig
from lorad.errors import (
    AdapterError, BadRequest, EngineDead, LoradError, ModelError, NotFound, Overloaded, PromptTooLong,
)

_BY_TYPE = {cls.type: cls for cls in (BadRequest, PromptTooLong, NotFound, AdapterError, ModelError, EngineDead)}
_BY_STATUS = {400: BadRequest, 404: NotFound, 503: Overloaded}


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


def error_from_response(status: int, body: bytes, retry_after: str | None = None) -> LoradError:
    """The lorad.errors exception for an error answer of the daemon (or anything else on the socket)."""
    try:
        detail = json.loads(body)["error"]
        message, kind = str(detail["message"]), detail.get("type")
    except (ValueError, KeyError, TypeError):
        message, kind = body.decode("utf-8", "replace").strip() or f"HTTP {status}", None
    if status == 503:
        try:
            return Overloaded(message, retry_after_s=float(retry_after)) if retry_after else Overloaded(message)
        except ValueError:
            return Overloaded(message)
    cls = _BY_TYPE.get(kind)
    if cls is None or cls.status != status:
        cls = _BY_STATUS.get(status, LoradError)
    error = cls(message)
    error.status, error.type = status, kind or error.type  # what the server said, e.g. model_not_found
    return error


class Client:
    def __init__(self, socket_path: str = ServerConfig.socket, timeout: float | None = 600.0):
        self.socket_path = socket_path
        self.timeout = timeout

    def health(self) -> dict:
        return self._json("GET", "/health")

    def models(self) -> list[dict]:
        """The base model first, then each adapter (the `data` of GET /v1/models)."""
        return self._json("GET", "/v1/models")["data"]

    def status(self) -> dict:
        """The engine's state: device, dtype, page-pool occupancy, resident adapters, queue lengths."""
        return self._json("GET", "/v1/status")

    def completions(self, **fields) -> dict:
        return self._json("POST", "/v1/completions", {**fields, "stream": False})

    def stream_completions(self, **fields) -> Iterator[dict]:
        """Yields the parsed chunks of a streamed completion. Leaving the loop early closes the
        connection, which aborts the request in the daemon."""
        connection, response = self._send("POST", "/v1/completions", {**fields, "stream": True})
        try:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):].strip()
                if data == b"[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:  # the request failed after the stream began
                    raise error_from_response(chunk["error"].get("code", 500), data)
                yield chunk
            raise LoradError("the stream ended without [DONE]")
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
