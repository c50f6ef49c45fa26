"""`lorad.client`: the daemon's clients, `Client` (blocking) and `AsyncClient` (asyncio), over its Unix
socket. They live in lorad/daemon/client.py; this name is the one to import from applications."""

from lorad.daemon.client import AsyncClient, Client, error_from_response

__all__ = ["AsyncClient", "Client", "error_from_response"]
