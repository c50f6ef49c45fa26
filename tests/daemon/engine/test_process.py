"""daemon/engine/process.py: the demo engine in its own process behaves as in-process (same tokens, same
exception types and messages), aborts free their KV pages (100 streaming clients leaving in a row through
the real API), a SIGKILLed engine fails what is in flight at once and refuses the rest (EngineDead), a
reader that stops reading costs requests, not memory."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time

import pytest

from lorad.config import EngineConfig
from lorad.daemon.engine.process import SHED_MESSAGE, EngineProcess, _Outbox, _wire_error
from lorad.daemon.engine.request import GenerationRequest, RequestOutput, SamplingParams
from lorad.errors import (
    AdapterError, BadRequest, EngineDead, LoradError, ModelNotFound, NotFound, Overloaded, PromptTooLong,
)

from daemon_harness import ServerThread  # create_app(engine) on a Unix socket in a thread


def demo_config(**overrides) -> EngineConfig:
    return EngineConfig(**{"demo": True, "device": "cpu", "pool_bytes": 8 << 20, "max_model_len": 128, **overrides})


def start_engine(demo_assets, config: EngineConfig, **kwargs) -> EngineProcess:
    with pytest.MonkeyPatch.context() as patch:  # the engine process inherits the environment at start
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        engine = EngineProcess(config, **kwargs)
        engine.start()
    return engine


class Collector:
    """An on_output callback that keeps the outputs and says when the last one came (of every one of `choices`)."""

    def __init__(self, choices: int = 1):
        self.outputs: list[RequestOutput] = []
        self.done = threading.Event()
        self.first = threading.Event()
        self.going = choices

    def __call__(self, output: RequestOutput) -> None:
        self.outputs.append(output)
        self.first.set()
        self.going -= output.finished
        if not self.going:
            self.done.set()

    def wait(self, timeout: float = 30) -> RequestOutput:
        assert self.done.wait(timeout), "no finished output"
        return self.outputs[-1]

    @property
    def tokens(self) -> list[int]:
        return [token for output in self.outputs for token in output.new_token_ids]


def request(prompt, adapter=None, collector=None, **sampling) -> GenerationRequest:
    return GenerationRequest(list(prompt), adapter, SamplingParams(**sampling), on_output=collector)


@pytest.fixture(scope="module")
def broken_adapter():
    directory = tempfile.mkdtemp(prefix="lorad-broken-")
    with open(os.path.join(directory, "adapter_config.json"), "w") as file:
        file.write('{"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as file:
        file.write(b"not safetensors")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(demo_assets, broken_adapter):
    engine = start_engine(demo_assets, demo_config(adapters=(("broken", broken_adapter), ("extra", str(demo_assets.adapters["demo-r2"])))))
    yield engine
    engine.stop()


# --- the interface, as in-process ----------------------------------------------------------------------


def test_start_reports_the_model(engine, demo_assets):
    assert engine.model_name == "lorad-demo" and engine.device == "cpu" and engine.dtype == "float32"
    assert engine.max_model_len == 128 and engine.vocab_size > 0 and engine.alive
    assert engine.model_dir == demo_assets.model_dir
    assert engine.tokenizer.encode("hello") and engine.pid != os.getpid()


def test_tokens_match_the_engine_in_process(engine, demo_assets):
    from lorad.daemon.engine.engine import Engine

    prompt = engine.tokenizer.encode("Once upon a time")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        local = Engine(demo_config())
    for adapter in (None, "demo-r8"):
        expected = local.generate([request(prompt, adapter, max_tokens=12, temperature=0, ignore_eos=True)])[0]
        collector = Collector()
        engine.submit(request(prompt, adapter, collector, max_tokens=12, temperature=0, ignore_eos=True))
        last = collector.wait()
        assert collector.tokens == expected.token_ids
        assert "".join(output.text_delta for output in collector.outputs) == expected.text
        assert last.finish_reason == "length" and last.num_generated_tokens == 12 and last.num_prompt_tokens == len(prompt)


def test_submit_errors_keep_their_type_and_message(engine):
    cases = [
        (request([1, 2], "nope"), ModelNotFound, "the model 'nope' does not exist"),
        (request([1] * 120, max_tokens=16), PromptTooLong, "over this model's context of 128"),
        (request([]), BadRequest, "the prompt is empty"),
        (request([engine.vocab_size]), BadRequest, "prompt token ids must be integers"),
        (request([1, 2], "broken"), AdapterError, "broken"),
    ]
    for generation, cls, fragment in cases:
        with pytest.raises(cls) as caught:
            engine.submit(generation)
        assert type(caught.value) is cls and fragment in caught.value.message, caught.value.message
        assert caught.value.status == cls.status
    # a request id in use
    collector = Collector()
    first = request([1, 2, 3], None, collector, max_tokens=100, ignore_eos=True)
    engine.submit(first)
    with pytest.raises(BadRequest, match="already in use"):
        engine.submit(GenerationRequest([1], request_id=first.request_id))
    engine.abort(first.request_id)
    assert collector.wait().finish_reason == "abort"
    assert engine.alive  # refusals change nothing


def test_abort_frees_the_pages(engine):
    idle = engine.status()["pool"]["kv"]
    collector = Collector()
    generation = request([5, 6, 7], "demo-r4", collector, max_tokens=120, ignore_eos=True)
    engine.submit(generation)
    assert collector.first.wait(10)
    engine.abort(generation.request_id)
    last = collector.wait()
    assert last.finish_reason == "abort" and len(collector.tokens) < 120
    assert engine.status()["pool"]["kv"] == idle


def test_every_choice_crosses_the_pipe_and_an_abort_ends_them_all(engine):
    idle = engine.status()["pool"]["kv"]
    alone = Collector()
    engine.submit(request([5, 6, 7, 8, 9], "demo-r4", alone, max_tokens=6, ignore_eos=True, temperature=0))
    alone.wait()
    collector = Collector(choices=3)
    engine.submit(dataclasses.replace(request([5, 6, 7, 8, 9], "demo-r4", collector, max_tokens=6, ignore_eos=True, temperature=0), n=3))
    collector.wait()
    for choice in range(3):
        outputs = [output for output in collector.outputs if output.choice == choice]
        assert [token for output in outputs for token in output.new_token_ids] == alone.tokens
        assert [output.finished for output in outputs].count(True) == 1 and outputs[-1].finish_reason == "length"
    collector = Collector(choices=3)
    generation = dataclasses.replace(request([5, 6, 7], "demo-r4", collector, max_tokens=120, ignore_eos=True), n=3)
    engine.submit(generation)
    assert collector.first.wait(10)
    engine.abort(generation.request_id)
    collector.wait()
    assert sorted(output.choice for output in collector.outputs if output.finish_reason == "abort") == [0, 1, 2]
    assert engine.status()["pool"]["kv"] == idle and engine.status()["kv_sharing"]["shared_blocks"] == 0


def test_queries_through_the_generic_call(engine, demo_assets):
    status = engine.status()
    assert status["model"] == "lorad-demo" and status["engine_pid"] == engine.pid
    # the engine process froze its start-up objects (the model, its tables) out of Python's collections
    assert status["gc"]["frozen_objects"] > 1000 and len(status["gc"]["collections_by_generation"]) == 3
    names = {entry["id"] for entry in engine.models()}
    assert {"lorad-demo", "demo-r1", "extra", "broken"} <= names
    assert isinstance(engine.metrics(), dict)
    with pytest.raises(BadRequest, match="step cannot be called"):
        engine.call("step")
    # adapters through the API: under the demo's adapter root
    entry = engine.load_adapter("api-made", str(demo_assets.adapters["demo-r1"]))
    assert entry["rank"] == 1
    with pytest.raises(BadRequest, match="not under an adapter root"):
        engine.load_adapter("outside", "/etc")
    collector = Collector()
    engine.submit(request([1, 2], "api-made", collector, max_tokens=2))
    assert collector.wait().finish_reason in ("length", "stop")
    engine.unload_adapter("api-made")
    with pytest.raises(NotFound):
        engine.unload_adapter("api-made")


def test_reload_adapters_touches_only_the_config_ones(engine, demo_assets, tmp_path):
    engine.load_adapter("api-kept", str(demo_assets.adapters["demo-r1"]))
    scanned = tmp_path / "scanned"
    scanned.mkdir()
    shutil.copytree(demo_assets.adapters["demo-r4"], scanned / "from-dir")
    changes = engine.reload_adapters((("broken", "/nonexistent/adapter"), ("fresh", str(demo_assets.adapters["demo-r8"]))),
                                     (str(scanned),))
    assert changes["added"] == ["fresh", "from-dir"] and changes["removed"] == ["extra"]
    assert changes["changed"] == [] and "broken" in changes["failed"]
    names = {entry["id"] for entry in engine.models()}
    assert {"fresh", "from-dir", "api-kept", "demo-r1"} <= names and not {"extra", "broken"} & names
    # unchanged: nothing happens
    again = engine.reload_adapters((("fresh", str(demo_assets.adapters["demo-r8"])),), (str(scanned),))
    assert again == {"added": [], "removed": [], "changed": [], "restored": [], "failed": {}}
    # a configured adapter unloaded through the API comes back with the config on the next reload
    engine.unload_adapter("fresh")
    assert "fresh" not in {entry["id"] for entry in engine.models()}
    back = engine.reload_adapters((("fresh", str(demo_assets.adapters["demo-r8"])),), (str(scanned),))
    assert back["restored"] == ["fresh"] and "fresh" in {entry["id"] for entry in engine.models()}
    engine.unload_adapter("api-kept")


def test_errors_cross_the_pipe_whole():
    error = pickle.loads(pickle.dumps(_wire_error(Overloaded("full", retry_after_s=2.5), "ctx")))
    assert type(error) is Overloaded and error.message == "full" and error.retry_after_s == 2.5
    bug = _wire_error(KeyError("x"), "internal error in the engine")
    assert type(bug) is LoradError and bug.status == 500 and "KeyError" in bug.message


# --- disconnects through the real API ----------------------------------------------------------------------


def test_100_clients_leaving_mid_stream_leak_no_pages(engine):
    from lorad.client import Client

    directory = tempfile.mkdtemp(prefix="lorad-", dir="/tmp")
    server = ServerThread(engine, f"{directory}/api.sock")
    try:
        client = Client(server.path, timeout=30)
        idle = client.status()["pool"]["kv"]
        for index in range(100):
            chunks = client.stream_completions(model=("demo-r8", "lorad-demo")[index % 2], prompt="Tell me a story",
                                               max_tokens=100, ignore_eos=True)
            next(chunks)
            chunks.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 20
        while True:
            status = client.status()
            if status["pool"]["kv"] == idle and status["running"] == 0 and status["waiting"] == 0:
                break
            assert time.monotonic() < deadline, f"pages not freed: {status}"
            time.sleep(0.05)
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)


# --- the engine dies ----------------------------------------------------------------------------------------


def test_engine_killed_fails_in_flight_and_refuses_new(demo_assets):
    deaths = []
    engine = start_engine(demo_assets, demo_config(max_model_len=1024), on_death=deaths.append)
    try:
        collectors = [Collector(choices=n) for n in (1, 1, 2)]
        for collector, n in zip(collectors, (1, 1, 2)):
            engine.submit(dataclasses.replace(request([1, 2, 3], "demo-r8", collector, max_tokens=1000, ignore_eos=True), n=n))
        assert all(collector.first.wait(10) for collector in collectors)
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        for collector in collectors:
            last = collector.wait(5)  # every choice of each request
            assert last.finish_reason == "error" and "killed by SIGKILL" in last.error
            assert last.error_type == EngineDead.type  # the API answers it as EngineDead
        assert time.monotonic() - killed < 5
        assert not engine.alive and len(deaths) == 1 and "died" in deaths[0]
        with pytest.raises(EngineDead, match="engine process died"):
            engine.submit(request([1, 2]))
        with pytest.raises(EngineDead):
            engine.status()
        engine.abort("anything")  # a no-op, never an error
    finally:
        engine.stop()
    assert len(deaths) == 1  # stop() after a death is quiet


def test_start_failure_is_the_engines_error(demo_assets, tmp_path):
    engine = EngineProcess(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))
    with pytest.raises(LoradError) as caught:
        engine.start()
    assert "does not exist" in caught.value.message and not engine.alive


# --- a reader that stops reading -------------------------------------------------------------------------------


def test_outbox_sheds_the_requests_with_most_undelivered_outputs():
    class StuckConnection:  # the API process stopped reading: the pipe is full
        def __init__(self):
            self.sent, self.release = [], threading.Event()

        def send(self, message):
            self.release.wait()
            self.sent.append(message)

        def close(self):
            pass

    connection = StuckConnection()
    outbox = _Outbox(connection, max_outputs=40)
    sender = threading.Thread(target=outbox.run, daemon=True)
    sender.start()
    shed = []
    for step in range(30):  # request "fast" has 2 outputs per step, "slow" 1, "short" finishes early
        outputs = [RequestOutput("fast", [step], "x"), RequestOutput("fast", [step], "x"), RequestOutput("slow", [step], "y")]
        if step < 3:
            outputs.append(RequestOutput("short", [step], "z", finished=step == 2, finish_reason="length" if step == 2 else None))
        shed += outbox.put_outputs(outputs)
        assert outbox._pending_total <= 40 + 4  # bounded, whatever the reader does
    assert shed[0] == "fast"  # the most undelivered outputs go first
    # the engine aborts a shed request; its final output becomes an error that says why
    outbox.put_outputs([RequestOutput("fast", [], "", finished=True, finish_reason="abort")])
    connection.release.set()
    outbox.close()
    sender.join(5)
    delivered = [output for message in connection.sent if message[0] == "outputs" for output in message[1]]
    fast = [output for output in delivered if output.request_id == "fast"]
    assert fast[-1].finished and fast[-1].finish_reason == "error" and fast[-1].error == SHED_MESSAGE
    short = [output for output in delivered if output.request_id == "short"]
    assert short[-1].finish_reason == "length"  # finished before the reader stalled: delivered whole
    assert outbox._pending_total == 0 and not outbox._pending


def test_a_stalled_reader_costs_requests_not_memory(demo_assets):
    """The API process's reader thread blocks (its callback hangs): the pipe fills, the engine's outbox
    reaches its bound, and requests are aborted with an error that says why, instead of piling up."""
    engine = start_engine(demo_assets, demo_config(max_model_len=512), max_pending_outputs=32)
    stalled, release = threading.Event(), threading.Event()
    try:
        collectors = []

        def stall(output: RequestOutput) -> None:
            stalled.set()
            release.wait()

        for _ in range(8):
            collectors.append(Collector())
            engine.submit(request([4, 5, 6], "demo-r1", collectors[-1], max_tokens=400, ignore_eos=True))
        # Last: a submit waits for its answer on the reader thread, which the stalled callback holds.
        engine.submit(request([1, 2, 3], None, stall, max_tokens=400, ignore_eos=True))
        assert stalled.wait(10)
        time.sleep(3)  # the step loop goes on, the pipe fills, the outbox sheds
        release.set()
        finals = [collector.wait(30) for collector in collectors]
        assert any(final.finish_reason == "error" and final.error == SHED_MESSAGE for final in finals), finals
        assert engine.alive and engine.status()["running"] == 0
    finally:
        release.set()  # a failure above must not leave stop() waiting on the stalled callback
        engine.stop()
