"""The daemon's side of systemd, in the standard library only: sockets passed by socket activation
(sd_listen_fds), state notifications (sd_notify: READY=1, STOPPING=1, WATCHDOG=1, STATUS=...) and the
watchdog interval. Outside systemd every function is a no-op that says so by its return value.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import typing
from pathlib import Path

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START


def listen_fds(unset_environment: bool = True, environ: typing.MutableMapping[str, str] = os.environ) -> list[int]:
    """The file descriptors systemd passed to this process (3, 4, ...), or [] when none were passed to
    *this* process (LISTEN_PID names another one: an inherited environment). The variables are removed
    afterwards by default, so children (the engine process) do not take the sockets for theirs."""
    try:
        if environ.get("LISTEN_PID") is None or int(environ["LISTEN_PID"]) != os.getpid():
            return []
        count = int(environ.get("LISTEN_FDS", "0"))
    except ValueError:
        log.warning("ignoring malformed LISTEN_PID/LISTEN_FDS")
        return []
    finally:
        if unset_environment:
            for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
                environ.pop(name, None)
    fds = list(range(LISTEN_FDS_START, LISTEN_FDS_START + max(count, 0)))
    for fd in fds:  # systemd leaves them inheritable; nothing we start should hold the listener
        flags = fcntl.fcntl(fd, fcntl.F_GETFD)
        fcntl.fcntl(fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
    return fds


def unix_listener(fd: int) -> socket.socket:
    """The socket object of a passed descriptor, refused unless it is a listening AF_UNIX stream socket
    (the unit file could pass anything)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as error:
        raise ValueError(f"file descriptor {fd} from systemd is not a socket: {error.strerror}") from None
    accepting = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not accepting:
        sock.detach()
        raise ValueError(f"file descriptor {fd} from systemd is not a listening Unix stream socket "
                         "(lorad.socket needs ListenStream=/path and Accept=no)")
    return sock


def notify(state: str, environ: typing.Mapping[str, str] = os.environ) -> bool:
    """Sends `state` ("READY=1", "STOPPING=1", "WATCHDOG=1", "STATUS=...", several joined by newlines)
    to $NOTIFY_SOCKET. False when not under a Type=notify service, or when the send failed (logged: a
    notification is never worth failing the daemon for)."""
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address[0] not in ("/", "@"):
        log.warning("ignoring NOTIFY_SOCKET=%s: only Unix socket paths are supported", address)
        return False
    if address[0] == "@":  # the abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as error:
        log.warning("systemd notification failed state=%s error=%s", state.split("\n")[0], error)
        return False
    return True


def watchdog_interval(environ: typing.Mapping[str, str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec, as sd_watchdog_enabled advises), or None
    when no watchdog is armed for this process."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", "0"))
        pid = environ.get("WATCHDOG_PID")
        if pid is not None and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return usec / 2e6 if usec > 0 else None


# ---- lorad install-systemd --------------------------------------------------------------------------

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"  # in a source checkout (or an editable install)
UNITS = ("lorad.service", "lorad.socket")
DEFAULT_EXEC = "/usr/bin/env lorad"


def install(prefix: str | Path = "/", dry_run: bool = False, lorad_command: str = DEFAULT_EXEC) -> tuple[list[str], list[str]]:
    """Writes the units to <prefix>/etc/systemd/system (ExecStart pointing at `lorad_command`) and the
    sample config to <prefix>/etc/lorad/lorad.toml unless one is there. Returns (what was done, the
    commands to run next)."""
    from lorad.errors import BadRequest

    if not (PACKAGING / "systemd" / UNITS[0]).is_file():
        raise BadRequest(f"the unit files are not at {PACKAGING / 'systemd'}: run install-systemd from a source "
                         "checkout of lorad (or an editable install)")
    prefix = Path(prefix)
    unit_dir, config_dir = prefix / "etc/systemd/system", prefix / "etc/lorad"
    done = []
    for unit in UNITS:
        text = (PACKAGING / "systemd" / unit).read_text()
        if lorad_command != DEFAULT_EXEC:
            text = text.replace(f"ExecStart={DEFAULT_EXEC} ", f"ExecStart={lorad_command} ")
        done.append(_write(unit_dir / unit, text, dry_run, overwrite=True))
    done.append(_write(config_dir / "lorad.toml", (PACKAGING / "lorad.toml").read_text(), dry_run, overwrite=False))
    if lorad_command.startswith(("/home/", "/root/")):
        done.append(f"warning: {lorad_command} is under /home or /root, which ProtectHome=yes hides from the "
                    "service: install lorad elsewhere (e.g. a venv in /opt/lorad) or relax ProtectHome")
    next_steps = [
        "useradd --system --user-group --home-dir /var/lib/lorad --shell /usr/sbin/nologin lorad",
        "usermod -aG lorad $USER    # who may talk to /run/lorad/lorad.sock",
        "$EDITOR /etc/lorad/lorad.toml    # model, adapter_dirs",
        "systemctl daemon-reload",
        "systemctl enable --now lorad.socket    # lorad.service starts on the first connection",
        "systemctl start lorad.service    # or load the model now",
    ]
    return done, next_steps


def _write(path: Path, text: str, dry_run: bool, overwrite: bool) -> str:
    if path.exists() and not overwrite:
        return f"kept {path} (exists)"
    if dry_run:
        return f"would write {path}"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(text)
    partial.chmod(0o644)
    partial.replace(path)
    return f"wrote {path}"
