"""Connections as a resource: at most `max_connections` at once, each given `header_timeout_s` to send its first
request's headers, and closed after `keepalive_timeout_s` idle between requests. A connection past the cap gets
a 503 JSON answer and is closed at once, so descriptors never run out and idle or slow clients cannot hold the
daemon. `guard(runner, ...)` wraps the aiohttp server every site of the runner accepts through.
"""

from __future__ import annotations

import asyncio
import json
import logging

log = logging.getLogger(__name__)

_REFUSAL = json.dumps({"error": {"message": "too many connections: try again shortly", "type": "overloaded_error",
                                 "code": 503}}).encode()
_REFUSAL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL)).encode() + b"\r\n\r\n" + _REFUSAL)


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport):
        transport.write(_REFUSAL_RESPONSE)
        transport.close()


class ConnectionGuard:
    """The protocol factory of the runner's sites: counts connections, refuses past the cap, and closes a
    connection whose first request's headers have not arrived in time. Everything else is the aiohttp server's."""

    def __init__(self, server, max_connections: int, header_timeout_s: float):
        self._server, self.max_connections, self.header_timeout_s = server, max_connections, header_timeout_s
        self.open = 0
        self.refused = 0

    def __getattr__(self, name):
        return getattr(self._server, name)

    def __call__(self):
        if self.open >= self.max_connections:
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("connections refused at the cap max_connections=%d refused=%d", self.max_connections,
                            self.refused)
            return _Refuse()
        self.open += 1
        return _Guarded(self._server(), self)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind a timer for its first request's headers."""

    def __init__(self, inner, guard: ConnectionGuard):
        self.inner, self.guard = inner, guard
        self.timer: asyncio.TimerHandle | None = None
        self.tail = b""

    def connection_made(self, transport):
        def too_slow():
            if self.timer is not None:
                log.info("connection closed: no request headers within %.0f s", self.guard.header_timeout_s)
                transport.close()

        self.timer = asyncio.get_running_loop().call_later(self.guard.header_timeout_s, too_slow)
        self.inner.connection_made(transport)

    def data_received(self, data):
        if self.timer is not None:
            seen = self.tail + data
            if b"\r\n\r\n" in seen:  # the first request's headers are complete
                self.timer.cancel()
                self.timer, self.tail = None, b""
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()

    def connection_lost(self, error):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.guard.open -= 1
        self.inner.connection_lost(error)


def guard(runner, max_connections: int, header_timeout_s: float) -> ConnectionGuard:
    """Puts a ConnectionGuard in front of `runner`'s server (before any site starts)."""
    runner._server = ConnectionGuard(runner.server, max_connections, header_timeout_s)
    return runner._server
