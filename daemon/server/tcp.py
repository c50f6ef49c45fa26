"""Listening beyond the Unix socket, for use behind a gateway or load balancer: `--listen tcp://HOST:PORT` adds
a TCP listener to the same application (routes, metrics), off by default. Over TCP every route but /health
needs the API key (`--api-key`, or LORAD_API_KEY in the environment) as `Authorization: Bearer KEY`, compared
in constant time; without a key the daemon listens only on a loopback address. The Unix socket keeps its own
access control, its file mode, and asks for no key.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp import web

from lorad.errors import BadRequest, Unauthorized

API_KEY_ENV = "LORAD_API_KEY"
OPEN_PATHS = ("/health",)  # for load balancers' probes
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # the admin key's (admin_gate.py), not this one's


def parse_listen(text: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (host, port); IPv6 hosts in brackets. A clear BadRequest otherwise."""
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path or parts.query:
        raise BadRequest(f"--listen {text!r}: expected tcp://HOST:PORT (e.g. tcp://127.0.0.1:8000)")
    return parts.hostname, port


def is_loopback(host: str) -> bool:
    """Does `host` (a name or an address) resolve to loopback addresses only?"""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as error:
        raise BadRequest(f"--listen: cannot resolve {host!r}: {error.strerror}") from None
    return bool(addresses) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def check_listen(listen: str, api_key: str) -> tuple[str, int] | None:
    """The TCP address to listen on, or None; refuses a non-loopback address without an API key."""
    if not listen:
        return None
    host, port = parse_listen(listen)
    if not api_key and not is_loopback(host):
        raise BadRequest(f"--listen {listen}: {host} is not a loopback address, so an API key is required "
                         f"(--api-key, api_key in [server], or {API_KEY_ENV} in the environment)")
    return host, port


def over_tcp(request: web.Request) -> bool:
    """Did the request come over TCP (not the Unix socket)?"""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    return sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)


def carries_key(request: web.Request, key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time; never for an empty key."""
    return bool(key) and hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {key}".encode())


def require_api_key(api_key: str):
    """A middleware: requests over TCP (not the Unix socket) carry `Authorization: Bearer <api_key>`."""

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if over_tcp(request) and request.path not in OPEN_PATHS + ADMIN_PATHS and not carries_key(request, api_key):
            raise Unauthorized("a valid API key is required: Authorization: Bearer KEY")
        return await handler(request)

    return check
