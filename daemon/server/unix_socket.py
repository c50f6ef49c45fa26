"""The Unix socket the daemon and `lorad router` listen on: claiming its path, binding it with its
permissions, serving an aiohttp application on it, removing it, and reading the credentials
(SO_PEERCRED) of the process at the other end of a connection.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import weakref
from pathlib import Path
from typing import NamedTuple

from aiohttp import web

from lorad.errors import BadRequest

log = logging.getLogger(__name__)

SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
LISTEN_BACKLOG = 1024  # connections the kernel holds before accept(): bursts of many clients


def claim_path(path: str) -> None:
    """Make `path` free to bind: create its parent, remove a stale socket; refuse if a daemon listens, or if
    the parent directory is not safe to put the socket in (`check_directory`)."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise BadRequest(f"socket path is longer than {SOCKET_PATH_MAX} bytes: {path}")
    parent = Path(path).parent
    try:
        parent.mkdir(mode=SOCKET_DIR_MODE, parents=True)
    except FileExistsError:
        check_directory(parent)
    else:
        os.chmod(parent, SOCKET_DIR_MODE)  # not the umask's
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise BadRequest(f"{path} exists and is not a socket; not touching it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as error:
        if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        log.info("removing stale socket path=%s", path)
        os.unlink(path)
        return
    finally:
        probe.close()
    raise BadRequest(f"another lorad is already listening on {path}")


# The socket's directory when lorad creates it: the owner's, and the group may reach the socket (whose own mode,
# 0660 by default, is the user gate) but not list or change the directory.
SOCKET_DIR_MODE = 0o710


def check_directory(directory: Path) -> None:
    """Refuse a socket directory another local user could have prepared: a symlink, one owned by someone other
    than this user or root, or one others may write to (unless sticky, as /tmp, where they cannot remove or
    replace what is ours)."""
    try:
        info = os.lstat(directory)
    except OSError as error:
        raise BadRequest(f"cannot use the socket directory {directory}: {error.strerror or error}") from None
    if stat.S_ISLNK(info.st_mode):
        raise BadRequest(f"the socket directory {directory} is a symlink; give a real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise BadRequest(f"{directory} is not a directory")
    if info.st_uid not in (os.geteuid(), 0):
        raise BadRequest(f"the socket directory {directory} belongs to uid {info.st_uid}, not this user "
                         f"({os.geteuid()}): another user could replace the socket; use a directory of your own")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise BadRequest(f"the socket directory {directory} is writable by others (mode {info.st_mode & 0o777:o}); "
                         f"chmod go-w it or use another")


def remove(path: str) -> None:
    """Remove the socket at `path`, if a socket is there."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def bind(path: str, mode: int) -> socket.socket:
    """A listening Unix socket at `path` (which must not exist) with permissions `mode`."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        os.chmod(path, mode)  # before listen(): nobody connects while the mode is still the umask's
        listener.listen(LISTEN_BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener


async def serve(app: web.Application, listener: socket.socket, max_connections: int = 4096,
                header_timeout_s: float = 30.0, keepalive_timeout_s: float = 60.0) -> web.AppRunner:
    """Serve `app` on `listener`; `await runner.cleanup()` stops serving. Connections are capped and timed
    (daemon/server/connections.py) for this site and any the caller adds to the runner."""
    from lorad.daemon.server.connections import guard

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=keepalive_timeout_s)
    await runner.setup()
    guard(runner, max_connections, header_timeout_s)
    try:
        site = web.SockSite(runner, listener, backlog=LISTEN_BACKLOG)  # aiohttp re-listens: keep the depth
        await site.start()
    except BaseException:
        listener.close()
        await runner.cleanup()
        raise
    return runner


async def serve_unix(app: web.Application, path: str, mode: int = 0o660) -> web.AppRunner:
    """Serve `app` on a new Unix socket at `path` (which must not exist) with permissions `mode`.

    The caller owns the socket file: `await runner.cleanup()` stops serving, then remove `path`.
    """
    return await serve(app, bind(path, mode))


# --- who is at the other end ------------------------------------------------------------------------


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(transport) -> PeerCredentials | None:
    """The credentials of the process at the other end of a Unix-socket connection, when the kernel says."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        return PeerCredentials(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))
    except OSError:
        return None


_logged_connections: "weakref.WeakSet" = weakref.WeakSet()


@web.middleware
async def log_connection_peer(request: web.Request, handler) -> web.StreamResponse:
    """At debug level, the credentials of each connection's client, once per connection."""
    transport = request.transport
    if log.isEnabledFor(logging.DEBUG) and transport is not None:
        try:
            first = transport not in _logged_connections
            _logged_connections.add(transport)
        except TypeError:  # a transport that cannot be weakly referenced: log every request's
            first = True
        peer = peer_credentials(transport) if first else None
        if peer is not None:
            log.debug("connection peer_pid=%d peer_uid=%d peer_gid=%d", *peer)
    return await handler(request)
