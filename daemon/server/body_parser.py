"""Request bodies read and parsed as JSON for the daemon's API and the router's: capped in size, small ones parsed
at once, large ones in a child process, so that a parse never holds the interpreter lock.

json.loads holds the lock for the whole parse (on the CPU box: a 16 MB text prompt ~30 ms, a million token ids
~65 ms), and a thread does not help: the event loop (and an engine in the same process) waits for the parse all the
same. The child (json_child.py) parses and sends the value back with marshal, whose load is what this process still
pays: ~5 ms for the 16 MB prompt, ~8 ms for the million ids. A body of more values than a request can hold is
refused in the child (`max_values`), so what comes back is bounded too; bodies of many small containers within it
(tens of thousands of chat messages) load about as slowly as they parse. The pipes' reads and writes release the
lock; they run on one thread of their own, one body at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import marshal
import struct
import subprocess
import sys
import threading
from pathlib import Path

from aiohttp import web

from lorad.errors import BadRequest, BodyTooLarge, ServiceUnavailable

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("json_child.py")
HEADER = struct.Struct("<Q")
MAX_BODY_BYTES = 16 << 20
PARSE_INLINE_BYTES = 256 << 10  # bodies larger than this are parsed in the child process, one at a time
_pipes = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lorad-json")  # the child's pipes, one body at a time

BODY_PARSER = web.AppKey("body_parser", object)  # the app's BodyParser
# Held while a large body is parsed: the next body is handed to the thread only after the loop has run once, so
# other requests wait for one result's load at most, never for two back to back (the thread would otherwise take
# the next one from its queue and the interpreter lock with it before the loop got a turn).
LARGE_BODY_TURN = web.AppKey("large_body_turn", asyncio.Lock)


def add_to(app: web.Application, max_values: int = 0) -> None:
    """Gives `app` a body parser (its child starts with the first large body) that ends with the app. max_values:
    a large body holding more JSON values is refused by the child, before they reach this process (0: none)."""
    app[BODY_PARSER] = BodyParser(max_values)
    app[LARGE_BODY_TURN] = asyncio.Lock()
    app.on_cleanup.append(_close)


async def _close(app: web.Application) -> None:
    await asyncio.get_running_loop().run_in_executor(_pipes, app[BODY_PARSER].close)


async def read_body(request: web.Request) -> bytes:
    """The body's bytes, refused past MAX_BODY_BYTES before they are read where the client says how many."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise BodyTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    return await request.read()  # aiohttp raises 413 past client_max_size


async def parse_json(app: web.Application, raw: bytes):
    """The body's JSON value (`app` has add_to's parser); BadRequest for what is not JSON Python reads."""
    try:
        if len(raw) <= PARSE_INLINE_BYTES:
            return json.loads(raw)
        async with app[LARGE_BODY_TURN]:
            parsed = await asyncio.get_running_loop().run_in_executor(_pipes, app[BODY_PARSER].parse, raw)
            await asyncio.sleep(0)  # the loop's turn, before the next parse takes the lock
        return parsed
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        if "integer string conversion" in str(error):  # its advice (sys.set_int_max_str_digits) is for the server
            raise BadRequest(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                             "digits") from None
        raise BadRequest(f"the request body is not JSON lorad accepts: {str(error)[:200]}") from None


async def json_body(request: web.Request):
    return await parse_json(request.app, await read_body(request))


class BodyParser:
    """One child process, started on first use and again after it dies; `parse` is called from one thread at a
    time (the pipes' executor), the lock only guards against misuse."""

    def __init__(self, max_values: int = 0):
        self.max_values = max_values
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def parse(self, raw: bytes):
        """The body's JSON value. Raises what json.loads would (RecursionError, ValueError with its message),
        BadRequest for a body of more than max_values values, or ServiceUnavailable if the child died or could not
        start."""
        with self._lock:
            reply = self._round_trip(raw)
        kind, payload = reply[:1], memoryview(reply)[1:]
        if kind == b"J":
            return marshal.loads(payload)
        if kind == b"R":
            raise RecursionError
        if kind == b"C":
            raise BadRequest(f"the request body holds more than {self.max_values} JSON values (numbers, strings, "
                             f"lists and objects): more than a request lorad serves can hold")
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

    def _start(self) -> subprocess.Popen:
        try:
            process = subprocess.Popen([sys.executable, "-I", "-S", str(CHILD), str(self.max_values)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
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
