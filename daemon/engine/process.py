"""The engine in a process of its own, behind the interface the API uses (submit, abort, models, status,
load_adapter...): a crash, a hang or a CUDA fault of the engine cannot take the API process down with it,
and the API process never imports torch.

Two one-way pipes carry pickled tuples. Each side has one sender thread draining an outbox, so neither
the engine's step loop nor the API's event loop ever blocks on a pipe:

    API -> engine   ("submit", call_id, request) ("abort", request_id) ("call", call_id, method, args) ("stop",)
    engine -> API   ("ready", info) ("failed", error) ("reply", call_id, ok, value_or_error)
                    ("outputs", [RequestOutput, ...])  -- all outputs of one step in one message

A submit is answered at once with the engine's verdict (the same exception type and message as
in-process), checked in a small thread pool of the engine process: a cold adapter's disk read happens
there, never in the step loop.

Memory bound: if the API process stops reading, the engine's outbox holds at most `max_pending_outputs`
outputs. Past that the requests with the most undelivered outputs are aborted (their queued outputs are
dropped, they finish with finish_reason "error" and a message saying why) until half the room is free:
a stalled reader costs some requests, never the daemon's memory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from pathlib import Path

from lorad.config import EngineConfig
from lorad.daemon.engine.gc_heap import freeze_start_up_heap
from lorad.daemon.engine.request import GenerationRequest, RequestOutput, deliver
from lorad.daemon.engine.tokenizer import load_tokenizer
from lorad.errors import BadRequest, EngineDead, LoradError, NotFound

log = logging.getLogger(__name__)

# What `call` may run in the engine process; everything else of the engine stays private to it.
QUERY_METHODS = frozenset({"models", "adapter_path", "status", "metrics", "load_adapter", "unload_adapter",
                           "reload_adapters"})
MAX_PENDING_OUTPUTS = 1 << 16
SHED_MESSAGE = ("the API process fell behind reading the engine's outputs; the request was aborted to "
                "bound the engine's memory")
_SUBMIT_THREADS = 4  # the submissions whose adapter is in host memory (or that have none), and the calls
_READ_THREADS = 4  # the submissions that read their adapter from disk first, and the calls that read adapters
_READING_CALLS = frozenset({"load_adapter", "reload_adapters"})
_STOP_TIMEOUT_S = 30.0


class EngineProcess:
    """Engine(config) in a child process ('spawn'), with the Engine's interface in this one.

    `on_output` callbacks run in this process's reader thread; `on_death(reason)` is called once from it
    if the engine process goes away without being asked to."""

    def __init__(self, config: EngineConfig, on_death=None, max_pending_outputs: int = MAX_PENDING_OUTPUTS):
        self.config = config
        self.on_death = on_death
        self.max_pending_outputs = max_pending_outputs
        self.model_name: str | None = None
        self.vocab_size = self.max_model_len = 0
        self.device = self.dtype = self.model_dir = None
        self.tokenizer = None
        self.pid: int | None = None
        self._process = None
        self._outbox: _Outbox | None = None
        self._lock = threading.Lock()
        self._call_ids = itertools.count()
        self._calls: dict[int, concurrent.futures.Future] = {}
        # request id -> (on_output, its choices not finished yet), until every choice's finished output
        self._requests: dict[str, tuple[object, set[int]]] = {}
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._dead: str | None = None  # why the engine is gone, once it is
        self._stopping = False
        self._threads: list[threading.Thread] = []

    # ---- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine process and waits until the model is loaded; the engine's start-up error is
        raised here as the same LoradError (EngineDead if the process died without one)."""
        context = multiprocessing.get_context("spawn")
        from_engine, engine_end_out = context.Pipe(duplex=False)
        engine_end_in, to_engine = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_engine_main, name="lorad-engine", daemon=True,
            args=(self.config, engine_end_in, engine_end_out, logging.getLogger().getEffectiveLevel(),
                  self.max_pending_outputs),
        )
        self._outbox = _Outbox(to_engine)
        try:
            self._process.start()
            self.pid = self._process.pid
            engine_end_in.close()  # ours closed: the engine's reads end when this process does
            engine_end_out.close()
            self._threads = [
                threading.Thread(target=self._outbox.run, name="lorad-engine-sender", daemon=True),
                threading.Thread(target=self._read, args=(from_engine,), name="lorad-engine-reader", daemon=True),
            ]
            for thread in self._threads:
                thread.start()
            info = self._ready.result()
            # the API process tokenizes prompts itself, with the engine's tokenizer.json
            tokenizer = load_tokenizer(None if info["model_dir"] is None else Path(info["model_dir"]))
        except KeyboardInterrupt:  # a stop asked for while the model loads: nothing to wait for
            self.stop(timeout=0)
            raise
        except BaseException:
            self.stop(timeout=5)
            raise
        self.model_name, self.vocab_size, self.max_model_len = info["model_name"], info["vocab_size"], info["max_model_len"]
        self.device, self.dtype = info["device"], info["dtype"]
        self.model_dir = None if info["model_dir"] is None else Path(info["model_dir"])
        self.tokenizer = tokenizer
        log.info("engine process ready pid=%d model=%s device=%s dtype=%s", self.pid, self.model_name, self.device, self.dtype)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Asks the engine to abort what runs and exit; kills it if it has not within `timeout`."""
        if self._process is None or self._process.pid is None:  # never started
            self._process = None
            return
        self._stopping = True
        if self._dead is None:
            self._outbox.put(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("engine process did not stop within %.0f s; killing it pid=%d", timeout, self.pid)
            self._process.kill()
            self._process.join(5)
        self._outbox.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(5)
        self._died("the engine was stopped")  # whatever is still waiting hears so

    @property
    def alive(self) -> bool:
        return self._dead is None and self._process is not None and self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self._process is None else self._process.exitcode

    # ---- the Engine's interface -------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> None:
        """Returns once the engine accepted the request; raises what Engine.submit raised there."""
        self._check_alive()
        with self._lock:
            if request.request_id in self._requests:
                raise BadRequest(f"request id {request.request_id} is already in use")
            self._requests[request.request_id] = (request.on_output, set(range(request.n)))
        try:
            self._request("submit", dataclasses.replace(request, on_output=None))
        except BaseException:
            with self._lock:
                self._requests.pop(request.request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._outbox.put(("abort", request_id))

    def models(self) -> list[dict]:
        return self.call("models")

    def adapter_path(self, name: str) -> str | None:
        return self.call("adapter_path", name)

    def status(self) -> dict:
        return {**self.call("status"), "engine_pid": self.pid}

    def metrics(self) -> dict:
        return self.call("metrics")

    def load_adapter(self, name: str, path: str) -> dict:
        return self.call("load_adapter", name, path)

    def unload_adapter(self, name: str) -> None:
        return self.call("unload_adapter", name)

    def reload_adapters(self, adapters: tuple[tuple[str, str], ...], adapter_dirs: tuple[str, ...]) -> dict:
        """Makes the adapters of the config file (pairs and directories to scan) those registered from
        it: new ones registered, removed ones unloaded, API registrations untouched. Returns
        {"added": [...], "removed": [...], "changed": [...], "failed": {name: reason}}."""
        return self.call("reload_adapters", tuple(adapters), tuple(adapter_dirs))

    def call(self, method: str, *args):
        """Runs engine.<method>(*args) in the engine process (one of QUERY_METHODS) and returns its result."""
        self._check_alive()
        return self._request("call", method, args)

    # ---- the channel ------------------------------------------------------------------------------------
    def _request(self, kind: str, *payload):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDead(self._dead)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._outbox.put((kind, call_id, *payload))
        return future.result()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._process is None or self._outbox is None:
            raise EngineDead("the engine process is not started")

    def _read(self, connection) -> None:
        try:
            while True:
                message = connection.recv()
                kind = message[0]
                if kind == "outputs":
                    self._deliver(message[1])
                elif kind == "reply":
                    _, call_id, ok, value = message
                    with self._lock:
                        future = self._calls.pop(call_id, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "ready":
                    self._ready.set_result(message[1])
                elif kind == "failed":
                    self._ready.set_exception(message[1])
        except (EOFError, OSError):
            pass  # the engine process is gone
        except Exception:
            log.exception("engine channel broke")
        finally:
            connection.close()
        if self._stopping:
            self._died("the engine was stopped")
        else:
            self._process.join(5)
            self._died(f"the engine process died ({_describe_exit(self._process.exitcode)})")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                callback, going = self._requests.get(output.request_id, (None, None))
                if output.finished and going is not None:
                    going.discard(output.choice)
                    if not going:
                        del self._requests[output.request_id]
            if callback is not None:
                deliver(callback, output)

    def _died(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            calls, self._calls = self._calls, {}
            requests, self._requests = self._requests, {}
        unexpected = not self._stopping
        if unexpected:
            log.error("%s; failing %d requests in flight", reason, len(requests))
        if not self._ready.done():
            self._ready.set_exception(EngineDead(f"{reason} while loading the model; its log above says why"))
        for future in calls.values():
            future.set_exception(EngineDead(reason))
        for request_id, (callback, going) in requests.items():
            for choice in sorted(going):
                deliver(callback, RequestOutput(request_id, [], "", True, "error", error=reason,
                                                error_type=EngineDead.type, choice=choice))
        if unexpected and self.on_death is not None:
            self.on_death(reason)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Outbox:
    """Messages for the other process, sent in order by one thread (`run`) so that whoever queues them
    never waits on the pipe. Outputs are counted per request; `put_outputs` says which requests to shed
    when more than `max_outputs` wait (see the module's docstring)."""

    def __init__(self, connection, max_outputs: int | None = None):
        self.connection = connection
        self.max_outputs = max_outputs
        self._cond = threading.Condition(threading.Lock())
        self._messages: collections.deque = collections.deque()
        self._pending: collections.Counter = collections.Counter()  # request id -> queued outputs
        self._pending_total = 0
        self._shed: set[str] = set()
        self._closed = False

    def put(self, message: tuple) -> None:
        with self._cond:
            self._messages.append(message)
            self._cond.notify()

    def put_outputs(self, outputs: list[RequestOutput]) -> list[str]:
        """Queues one step's outputs; returns the ids of requests to abort now to stay in bounds."""
        with self._cond:
            if self._shed:
                outputs = [self._shed_output(output) for output in outputs if output.finished or output.request_id not in self._shed]
            if not outputs:
                return []
            self._messages.append(("outputs", outputs))
            for output in outputs:
                self._pending[output.request_id] += 1
            self._pending_total += len(outputs)
            self._cond.notify()
            if self.max_outputs is None or self._pending_total <= self.max_outputs:
                return []
            return self._shed_locked()

    def _shed_output(self, output: RequestOutput) -> RequestOutput:
        if output.request_id not in self._shed:
            return output
        self._shed.discard(output.request_id)  # its last output: finished, as an error that says why
        return dataclasses.replace(output, new_token_ids=[], text_delta="", finish_reason="error", error=SHED_MESSAGE,
                                   logprobs=None)

    def _shed_locked(self) -> list[str]:
        shed = []
        while self._pending_total > self.max_outputs // 2 and self._pending:
            request_id, _ = self._pending.most_common(1)[0]
            shed.append(request_id)
            self._pending_total -= self._pending.pop(request_id)
        self._shed.update(shed)
        gone = set(shed)
        kept = collections.deque()
        for message in self._messages:
            if message[0] == "outputs":
                message = ("outputs", [output for output in message[1] if output.request_id not in gone])
                if not message[1]:
                    continue
            kept.append(message)
        self._messages = kept
        log.warning("API process not reading: aborting %d requests with the most undelivered outputs", len(shed))
        return shed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._messages and not self._closed:
                    self._cond.wait()
                if not self._messages:  # closed and drained
                    break
                batch = self._take_locked()
            try:
                for message in batch:
                    self.connection.send(message)
            except (OSError, ValueError):  # the other side is gone
                break
            finally:
                self._delivered(batch)
        try:
            self.connection.close()
        except OSError:
            pass

    def _take_locked(self) -> list[tuple]:
        """Everything queued, consecutive outputs merged into one message (fewer, larger writes)."""
        batch = []
        while self._messages:
            message = self._messages.popleft()
            if message[0] == "outputs" and batch and batch[-1][0] == "outputs":
                batch[-1] = ("outputs", batch[-1][1] + message[1])
            else:
                batch.append(message)
        return batch

    def _delivered(self, batch: list[tuple]) -> None:
        with self._cond:
            for message in batch:
                if message[0] != "outputs":
                    continue
                for output in message[1]:
                    left = self._pending.get(output.request_id)
                    if left is None:
                        continue  # shed meanwhile: already uncounted
                    self._pending_total -= 1
                    if left <= 1:
                        del self._pending[output.request_id]
                    else:
                        self._pending[output.request_id] = left - 1


# ---- the engine process ------------------------------------------------------------------------------


def _engine_main(config: EngineConfig, inbox, outbox_connection, log_level: int, max_pending_outputs: int) -> None:
    # Stopping is the API process's decision (it drains requests first): a Ctrl-C or a SIGTERM sent to
    # the whole process group must not kill the engine under it. If the API process dies, our reads end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s engine_pid={os.getpid()} %(message)s")
    outbox = _Outbox(outbox_connection, max_pending_outputs)
    # This process is a daemonic child of the API process (it must not outlive it), and multiprocessing
    # refuses children to those; the engine's CPU LoRA workers (cold_start cpu|auto) are its children,
    # daemonic themselves, and watch that the engine still lives. Only this process's view changes.
    multiprocessing.current_process().daemon = False
    try:
        from lorad.daemon.engine.engine import Engine

        engine = Engine(config)
        model_dir, _ = Engine._model_dir(config)
    except BaseException as error:  # noqa: BLE001 -- every start-up failure goes back to the API process
        outbox_connection.send(("failed", _wire_error(error, "the engine failed to start")))
        outbox_connection.close()
        return
    freeze_start_up_heap("engine process")
    sender = threading.Thread(target=outbox.run, name="lorad-engine-sender", daemon=True)
    sender.start()
    server = _EngineServer(engine, outbox, config)
    outbox.put(("ready", {
        "model_name": engine.model_name, "vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
        "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
        "model_dir": None if model_dir is None else str(model_dir),  # None: a --model-config shape, no files
    }))
    engine.start()
    try:
        server.serve(inbox)
    finally:
        engine.stop()  # aborts what still runs; those outputs are queued before the outbox closes
        server.close()
        engine.close()  # the CPU LoRA workers and the shared-memory segments
        outbox.close()
        sender.join(_STOP_TIMEOUT_S)
        # The frozen start-up heap back into the collections, so that the interpreter's exit frees it (kernels'
        # compiler objects included: libtriton warns of every one still alive then).
        gc.unfreeze()
        gc.collect()


class _EngineServer:
    """The engine process's end of the channel: requests from the API process, and the step loop's
    outputs batched one message per step."""

    def __init__(self, engine, outbox: _Outbox, config: EngineConfig):
        self.engine = engine
        self.outbox = outbox
        self.pool = concurrent.futures.ThreadPoolExecutor(_SUBMIT_THREADS, thread_name_prefix="lorad-submit")
        # A submission that reads its adapter from disk holds its thread for that read (0.1-0.5 s for a 7B adapter
        # beside a busy engine): on threads of their own, so that a burst of requests for cold adapters never keeps
        # the requests behind it, whose adapters are in host memory, out of the engine's queue.
        self.readers = concurrent.futures.ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="lorad-submit-read")
        self._step_outputs: list[RequestOutput] = []
        self._in_step = False
        self._config_adapters = _config_adapters(config.adapters, config.adapter_dirs)
        self._reload_lock = threading.Lock()
        # One message per step: the step loop's outputs are gathered while step() runs and queued at its
        # end (outputs outside a step -- the aborts at stop, a failed step's errors -- go one by one).
        step = engine.step

        def step_and_flush() -> None:
            self._in_step = True
            try:
                step()
            finally:
                self._in_step = False
                self._flush()

        engine.step = step_and_flush

    def serve(self, inbox) -> None:
        while True:
            try:
                message = inbox.recv()
            except (EOFError, OSError):
                log.warning("the API process is gone; stopping the engine")
                return
            kind = message[0]
            if kind == "abort":
                self.engine.abort(message[1])
            elif kind == "submit":
                pool = self.readers if self.engine.reads_adapter(message[2]) else self.pool
                pool.submit(self._answer, message[1], self._submit, message[2])
            elif kind == "call":
                pool = self.readers if message[2] in _READING_CALLS else self.pool
                pool.submit(self._answer, message[1], self._call, message[2], message[3])
            elif kind == "stop":
                return

    def close(self) -> None:
        """Ends the submit threads, letting the submissions under way finish and dropping those not begun."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.readers.shutdown(wait=True, cancel_futures=True)

    def _answer(self, call_id: int, function, *args) -> None:
        try:
            value = function(*args)
        except BaseException as error:  # noqa: BLE001 -- the caller in the API process gets it
            self.outbox.put(("reply", call_id, False, _wire_error(error, "internal error in the engine")))
        else:
            self.outbox.put(("reply", call_id, True, value))

    def _submit(self, request: GenerationRequest) -> None:
        request.on_output = self._on_output
        self.engine.submit(request)

    def _call(self, method: str, args: tuple):
        if method not in QUERY_METHODS:
            raise BadRequest(f"{method} cannot be called on the engine")
        if method == "reload_adapters":
            return self._reload_adapters(*args)
        function = getattr(self.engine, method, None)
        if function is None:
            raise NotFound(f"this engine has no {method}()")
        return function(*args)

    def _on_output(self, output: RequestOutput) -> None:  # the engine thread
        if self._in_step:
            self._step_outputs.append(output)
        else:
            self._queue([output])

    def _flush(self) -> None:
        if self._step_outputs:
            outputs, self._step_outputs = self._step_outputs, []
            self._queue(outputs)

    def _queue(self, outputs: list[RequestOutput]) -> None:
        for request_id in self.outbox.put_outputs(outputs):
            self.engine.abort(request_id)

    def _reload_adapters(self, adapters: tuple, adapter_dirs: tuple) -> dict:
        with self._reload_lock:
            wanted = _config_adapters(adapters, adapter_dirs)
            previous = self._config_adapters
            changes = {"added": [], "removed": [], "changed": [], "restored": [], "failed": {}}
            for name, path in previous.items():
                if wanted.get(name) == path:
                    continue
                try:
                    self.engine.unload_adapter(name)
                except NotFound:
                    pass  # already unloaded through the API
                changes["changed" if name in wanted else "removed"].append(name)
            for name, path in wanted.items():
                unchanged = previous.get(name) == path
                if unchanged and name in self.engine.registry:
                    continue  # a configured adapter unloaded through the API since is registered again below
                if name in self.engine._draining:  # its old requests still run under this name
                    changes["failed"][name] = "still finishing requests from before the change; send SIGHUP again"
                    continue
                try:
                    self.engine.registry.register(name, path)
                    try:
                        self.engine.registry.get(name)  # read and checked now, as the API's loads are
                    except LoradError:
                        self.engine.registry.unregister(name)
                        raise
                except LoradError as error:
                    changes["failed"][name] = error.message
                    continue
                if name not in previous:
                    changes["added"].append(name)
                elif unchanged:
                    changes["restored"].append(name)
            failed = changes["failed"]
            self._config_adapters = {name: path for name, path in wanted.items() if name not in failed}
            # a changed adapter whose new path failed is gone: it was unloaded above
            changes["changed"] = [name for name in changes["changed"] if name not in failed]
            return changes


def _config_adapters(adapters, adapter_dirs) -> dict[str, str]:
    """name -> directory of the adapters a config names: the pairs, then each directory's adapters."""
    found = {name: os.path.abspath(path) for name, path in adapters}
    for root in adapter_dirs:
        root = Path(root)
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            if child.is_dir() and not child.name.startswith(".") and (child / "adapter_config.json").is_file():
                found.setdefault(child.name, os.path.abspath(child))
    return found


def _wire_error(error: BaseException, context: str) -> LoradError:
    """The error as it crosses to the API process: LoradErrors as they are (type, message, status,
    retry_after_s), anything else as a LoradError after logging its traceback here."""
    if isinstance(error, LoradError):
        try:
            pickle.dumps(error)
            return error
        except Exception:  # noqa: BLE001 -- an unpicklable attribute: keep the type's name and message
            wired = LoradError(error.message)
            wired.status, wired.type = error.status, error.type
            return wired
    log.error("%s", context, exc_info=error)
    return LoradError(f"{context} ({type(error).__name__}: {error}); the daemon's log has the details")
