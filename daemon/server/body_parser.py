"""Large JSON request bodies parsed in a child process, so a parse never holds the daemon's interpreter lock.

json.loads holds the lock for the whole parse (on the CPU box: a 16 MB text prompt ~30 ms, a million token ids
~65 ms), and a thread does not help: the event loop and the engine's step thread wait for the parse all the same.
The child (json_child.py) parses and sends the value back with marshal, whose load is what the daemon still pays:
~5 ms for the 16 MB prompt, ~8 ms for the million ids. Only bodies of many small containers (a hundred thousand
chat messages) load about as slowly as they parse. The pipes' reads and writes release the lock; they run on one
thread of their own, one body at a time.
"""

from __future__ import annotations

import logging
import marshal
import struct
import subprocess
import sys
import threading
from pathlib import Path

from lorad.errors import ServiceUnavailable

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("json_child.py")
HEADER = struct.Struct("<Q")


class BodyParser:
    """One child process, started on first use and again after it dies; `parse` is called from one thread at a
    time (api.py's large-body executor), the lock only guards against misuse."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def parse(self, raw: bytes):
        """The body's JSON value. Raises what json.loads would (RecursionError, ValueError with its message), or
        ServiceUnavailable if the child died or could not start."""
        with self._lock:
            reply = self._round_trip(raw)
        kind, payload = reply[:1], memoryview(reply)[1:]
        if kind == b"J":
            return marshal.loads(payload)
        if kind == b"R":
            raise RecursionError
        raise ValueError(bytes(payload).decode(errors="replace"))

    def _round_trip(self, raw: bytes) -> bytes:
        process = self._process
        if process is not None and process.poll() is not None:
            log.warning("JSON parser process pid=%d had exited (exit code %s); starting a new one",
                        process.pid, process.returncode)
            self._stop(process)
            process = None
        if process is None:
            process = self._process = self._start()
        try:
            process.stdin.write(HEADER.pack(len(raw)))
            process.stdin.write(raw)
            process.stdin.flush()
            header = process.stdout.read(HEADER.size)
            size = HEADER.unpack(header)[0] if len(header) == HEADER.size else None
            reply = process.stdout.read(size) if size is not None else b""
            if size is None or len(reply) != size:
                raise OSError("the JSON parser process closed its output")
        except OSError as error:
            code = process.poll()
            log.warning("JSON parser process pid=%d failed: %s (exit code %s); a new one starts with the next "
                        "large body", process.pid, error, code)
            self._stop(process)
            self._process = None
            raise ServiceUnavailable("the process that parses large request bodies exited; retry the request") from None
        return reply

    @staticmethod
    def _start() -> subprocess.Popen:
        try:
            process = subprocess.Popen([sys.executable, "-I", "-S", str(CHILD)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, close_fds=True)
        except OSError as error:
            log.error("JSON parser process could not start: %s", error)
            raise ServiceUnavailable(f"the process that parses large request bodies could not start: {error}") from None
        log.info("JSON parser process pid=%d parses request bodies over the inline limit", process.pid)
        return process

    @staticmethod
    def _stop(process: subprocess.Popen) -> None:
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._stop(self._process)
                self._process = None
