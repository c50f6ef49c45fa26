"""daemon/server/api.py over a real Unix socket: every refusal in the error shape, full and streamed completions,
disconnects that abort the request in the engine, and many requests at once. Most tests drive a fake
engine (an echo with the engine's interface); the last ones serve the demo model with the real engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lorad.daemon.server.api import MAX_BODY_BYTES
from lorad.client import Client
from lorad.daemon.engine.request import RequestOutput
from daemon_harness import ServerThread, raw_request, serve_engine
from lorad.errors import (
    AdapterError, AdmissionDropped, BadRequest, LoradError, ModelNotFound, NotFound, Overloaded, PromptTooLong,
)

EOS = 0


class ByteTokenizer:
    """One token per UTF-8 byte."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


class FakeEngine:
    """The engine's interface with an echo for a model: the k-th generated token is the prompt's
    (k mod len)-th, for each of the request's n choices. Token 0 is EOS. Adapters: `sql`, `chat` (echo), `slow` (a token every 20 ms),
    `broken` (AdapterError on submit), `explode` (a bug: RuntimeError), `failing` (finishes with an error), `late`
    (fails after its first token), `dropped` (early abort drops it before its first token).
    """

    model_name = "fake-base"
    vocab_size = 256
    max_model_len = 128

    def __init__(self):
        self.tokenizer = ByteTokenizer()
        self.max_waiting = 1000
        self.submitted: dict[str, object] = {}
        self.aborted: list[str] = []
        self._active: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = None

    def adapter_path(self, name: str) -> str | None:
        return None  # no adapter folder ships a chat template here

    def models(self) -> list[dict]:
        base = [{"id": self.model_name, "parent": None, "kind": "base"}]
        names = ("sql", "chat", "slow", "failing", "late", "dropped")
        return base + [{"id": name, "parent": self.model_name, "kind": "lora", "rank": 8} for name in names]

    def status(self) -> dict:
        with self._lock:
            return {"model": self.model_name, "running": len(self._active)}

    def submit(self, request) -> None:
        adapter = request.adapter
        if adapter == "broken":
            raise AdapterError("adapter 'broken' has a corrupt adapter_model.safetensors")
        if adapter == "explode":
            raise RuntimeError("a bug in the engine")
        if adapter is not None and adapter not in {m["id"] for m in self.models()}:
            raise ModelNotFound(f"the model {adapter!r} does not exist")
        with self._lock:
            if len(self._active) >= self.max_waiting:
                raise Overloaded("the queue is full", retry_after_s=2.5)
            self.submitted[request.request_id] = request
            for choice in range(request.n):
                self._active[request.request_id, choice] = {
                    "request": request, "choice": choice, "generated": [], "emitted": 0, "next_at": 0.0,
                    "interval": 0.02 if adapter == "slow" else 0.0,
                }

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted.append(request_id)
            states = [self._active.pop(key) for key in list(self._active) if key[0] == request_id]
        for state in states:
            self._emit(state, [], "", "abort")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            now = time.monotonic()
            with self._lock:
                due = [state for state in self._active.values() if state["next_at"] <= now]
            for state in due:
                state["next_at"] = now + state["interval"]
                self._step(state)
            time.sleep(0.001)

    def _step(self, state: dict) -> None:
        request = state["request"]
        sampling = request.sampling
        prompt = request.prompt_token_ids
        token = prompt[len(state["generated"]) % len(prompt)]
        if request.adapter == "failing" or (request.adapter == "late" and state["generated"]):
            return self._finish(state, [], "", "error", error="the adapter's pages vanished")
        if request.adapter == "dropped":
            return self._finish(state, [], "", "error", error="early abort: estimated TTFT 2000.0 ms > objective 1000.0 ms",
                                error_type=AdmissionDropped.type)
        if token in sampling.stop_token_ids or (token == EOS and not sampling.ignore_eos):
            return self._finish(state, [], "", "stop")
        state["generated"].append(token)
        text = self.tokenizer.decode(state["generated"])
        emitted = state["emitted"]
        for stop in sampling.stop:
            at = text.find(stop)
            if at >= 0:
                return self._finish(state, [token], text[emitted:at], "stop")
        if len(state["generated"]) >= sampling.max_tokens:
            return self._finish(state, [token], text[emitted:], "length")
        # hold back what could still become a stop string, as the engine does
        holdback = max((len(stop) for stop in sampling.stop), default=1) - 1
        state["emitted"] = max(emitted, len(text) - holdback)
        self._emit(state, [token], text[emitted:state["emitted"]], None)

    def _finish(self, state, tokens, delta, reason, error=None, error_type=None) -> None:
        with self._lock:
            if self._active.pop((state["request"].request_id, state["choice"]), None) is None:
                return  # aborted meanwhile
        self._emit(state, tokens, delta, reason, error, error_type)

    @staticmethod
    def _emit(state, tokens, delta, reason, error=None, error_type=None) -> None:
        request = state["request"]
        request.on_output(
            RequestOutput(request.request_id, tokens, delta, reason is not None, reason,
                          len(request.prompt_token_ids), len(state["generated"]), error, error_type,
                          choice=state["choice"])
        )


@pytest.fixture
def engine():
    engine = FakeEngine()
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture
def server(engine, short_tmp):
    server = ServerThread(engine, f"{short_tmp}/api.sock")
    yield server
    server.close()


@pytest.fixture
def client(server) -> Client:
    return Client(server.path, timeout=10)


def expect_error(client: Client, cls, fragment: str, **fields) -> LoradError:
    with pytest.raises(cls) as caught:
        client.completions(**fields)
    assert fragment in caught.value.message, caught.value.message
    return caught.value


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# --- health and models ---------------------------------------------------------------------------------


def test_health(client):
    assert client.health() == {"status": "ok"}


def test_models(client):
    models = client.models()
    assert [m["id"] for m in models] == ["fake-base", "sql", "chat", "slow", "failing", "late", "dropped"]
    base, sql = models[0], models[1]
    assert base["parent"] is None and sql["parent"] == "fake-base"
    for entry in models:
        assert entry["object"] == "model" and entry["owned_by"] == "lorad" and isinstance(entry["created"], int)
    assert sql["rank"] == 8 and sql["kind"] == "lora"
    assert all(entry["max_model_len"] == 128 for entry in models)  # as vLLM lists it: clients size prompts by it


def test_model_by_id(client, engine):
    """GET /v1/models/{id} (the openai client's models.retrieve): the entry /v1/models lists, or 404 naming it."""
    listed = {entry["id"]: entry for entry in client.models()}
    assert client.model("sql") == listed["sql"] and client.model("fake-base") == listed["fake-base"]
    with pytest.raises(ModelNotFound, match="the model 'nope' does not exist"):
        client.model("nope")
    # an adapter loaded under a name with a slash, a space and a percent sign
    named = {"id": "team/sql 100%", "parent": "fake-base", "kind": "lora", "rank": 8}
    engine.models = lambda: FakeEngine.models(engine) + [named]
    assert client.model("team/sql 100%")["id"] == "team/sql 100%"
    with pytest.raises(ModelNotFound, match="'team/sql'"):
        client.model("team/sql")


def test_status(client):
    assert client.status() == {"model": "fake-base", "running": 0}


# --- completions ----------------------------------------------------------------------------------------


def test_completion(client):
    answer = client.completions(model="fake-base", prompt="hello", max_tokens=3)
    assert answer["id"].startswith("cmpl-") and answer["object"] == "text_completion"
    assert answer["model"] == "fake-base" and isinstance(answer["created"], int)
    assert answer["choices"] == [{"index": 0, "text": "hel", "finish_reason": "length", "logprobs": None}]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert "prompt_token_ids" not in answer


def test_adapter_and_sampling_reach_the_engine(client, engine):
    answer = client.completions(
        model="sql", prompt="abc", max_tokens=4, temperature=0.5, top_p=0.9, top_k=40, seed=7,
        stop_token_ids=[200], ignore_eos=True, user="someone", n=1, echo=False, logprobs=None,
    )
    request = engine.submitted[answer["id"]]
    assert request.adapter == "sql"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (
        4, 0.5, 0.9, 40, 7)
    assert sampling.stop_token_ids == (200,) and sampling.ignore_eos
    # null means "not set" (what many OpenAI clients send)
    answer = client.completions(model="fake-base", prompt="abc", max_tokens=None, temperature=None, stop=None)
    assert engine.submitted[answer["id"]].sampling.max_tokens == 16
    assert answer["usage"]["completion_tokens"] == 16


def test_default_max_tokens_and_the_base_model_has_no_adapter(client, engine):
    answer = client.completions(model="fake-base", prompt="xy")
    assert answer["choices"][0]["text"] == "xy" * 8
    assert engine.submitted[answer["id"]].adapter is None


def test_prompt_forms(client):
    for prompt in ("hi!", [104, 105, 33], ["hi!"], [[104, 105, 33]]):
        answer = client.completions(model="chat", prompt=prompt, max_tokens=3)
        assert answer["choices"][0]["text"] == "hi!", prompt
        assert answer["usage"]["prompt_tokens"] == 3


def test_stop_strings_and_tokens(client):
    answer = client.completions(model="fake-base", prompt="hello world", max_tokens=11, stop="wor")
    assert answer["choices"][0] == {"index": 0, "text": "hello ", "finish_reason": "stop", "logprobs": None}
    answer = client.completions(model="fake-base", prompt="hello world", max_tokens=11, stop=["xx", "lo"])
    assert answer["choices"][0]["text"] == "hel"
    answer = client.completions(model="fake-base", prompt="hello", max_tokens=5, stop_token_ids=[ord("l")])
    assert answer["choices"][0]["text"] == "he" and answer["choices"][0]["finish_reason"] == "stop"


def test_eos_and_ignore_eos(client):
    answer = client.completions(model="fake-base", prompt=[65, 66, EOS], max_tokens=5)
    assert answer["choices"][0]["text"] == "AB" and answer["choices"][0]["finish_reason"] == "stop"
    answer = client.completions(model="fake-base", prompt=[65, 66, EOS], max_tokens=5, ignore_eos=True)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 5


def test_return_token_ids(client):
    answer = client.completions(model="fake-base", prompt="abc", max_tokens=4, return_token_ids=True)
    assert answer["prompt_token_ids"] == [97, 98, 99]
    assert answer["choices"][0]["token_ids"] == [97, 98, 99, 97]


# --- streaming ------------------------------------------------------------------------------------------


def test_stream(client):
    chunks = list(client.stream_completions(model="sql", prompt="hello", max_tokens=4))
    assert len(chunks) == 4
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "hell"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, None, "length"]
    assert len({chunk["id"] for chunk in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(chunk["object"] == "text_completion" and chunk["model"] == "sql" for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)


def test_stream_usage_and_token_ids(client):
    chunks = list(client.stream_completions(
        model="fake-base", prompt="hey", max_tokens=3, return_token_ids=True,
        stream_options={"include_usage": True},
    ))
    *deltas, last = chunks
    assert [chunk["choices"][0]["token_ids"] for chunk in deltas] == [[104], [101], [121]]
    assert deltas[0]["prompt_token_ids"] == [104, 101, 121]
    assert all(chunk["usage"] is None for chunk in deltas)
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_stream_wire_format(server):
    body = json.dumps({"model": "fake-base", "prompt": "ab", "max_tokens": 2, "stream": True}).encode()
    status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body,
                                           {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    text = payload.decode()
    assert '"text":"a"' in text and '"finish_reason":"length"' in text
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]" and len(events) == 4
    assert all(event.startswith("data: {") for event in events[:2])


def test_stream_that_fails_before_its_first_token_is_a_500(server, client):
    body = json.dumps({"model": "failing", "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body)
    assert status == 500 and headers["Content-Type"].startswith("application/json")
    assert json.loads(payload)["error"]["message"] == "generation failed: the adapter's pages vanished"
    with pytest.raises(LoradError) as caught:
        list(client.stream_completions(model="failing", prompt="hi", max_tokens=3))
    assert "the adapter's pages vanished" in caught.value.message and caught.value.status == 500


def test_stream_that_fails_after_its_first_token_ends_in_an_error_event(server, client):
    body = json.dumps({"model": "late", "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = payload.decode().split("\n\n")
    assert json.loads(events[0][len("data: "):])["choices"][0]["text"] == "h"
    assert json.loads(events[1][len("data: "):])["error"]["message"] == "generation failed: the adapter's pages vanished"
    assert events[2:] == ["data: [DONE]", ""]
    with pytest.raises(LoradError) as caught:
        list(client.stream_completions(model="late", prompt="hi", max_tokens=3))
    assert "the adapter's pages vanished" in caught.value.message and caught.value.status == 500


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_dropped_by_admission_is_a_503_with_retry_after(server, stream):
    body = json.dumps({"model": "dropped", "prompt": "hi", "max_tokens": 3, "stream": stream}).encode()
    status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body)
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert json.loads(payload)["error"]["type"] == "admission_dropped"
    with pytest.raises(AdmissionDropped):
        list(Client(server.path).stream_completions(model="dropped", prompt="hi"))


def test_completion_that_fails_is_a_500(client):
    error = expect_error(client, LoradError, "the adapter's pages vanished", model="failing", prompt="x")
    assert error.status == 500


# --- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"prompt": "hi"}, "model is required"),
        ({"model": "", "prompt": "hi"}, "model is required"),
        ({"model": 5, "prompt": "hi"}, "model must be a string"),
        ({"model": "fake-base"}, "prompt is required"),
        ({"model": "fake-base", "prompt": ""}, "prompt is empty"),
        ({"model": "fake-base", "prompt": []}, "prompt is empty"),
        ({"model": "fake-base", "prompt": [""]}, "prompt is empty"),
        ({"model": "fake-base", "prompt": [[]]}, "prompt is empty"),
        ({"model": "fake-base", "prompt": ["a"] * 65}, "65 prompts, more than the 64"),
        ({"model": "fake-base", "prompt": ["a", [1, 2], ""]}, "prompt is empty"),
        ({"model": "fake-base", "prompt": ["a"] * 20, "n": 16}, "n x prompts is 320, more than the 256"),
        ({"model": "fake-base", "prompt": 5}, "prompt must be"),
        ({"model": "fake-base", "prompt": [1, "a"]}, "prompt must be"),
        ({"model": "fake-base", "prompt": [1, True]}, "prompt must be"),
        ({"model": "fake-base", "prompt": [1.5]}, "prompt must be"),
        ({"model": "fake-base", "prompt": [1, 256]}, "out of the vocabulary"),
        ({"model": "fake-base", "prompt": [-1]}, "out of the vocabulary"),
        ({"model": "fake-base", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"model": "fake-base", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "fake-base", "prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
        ({"model": "fake-base", "prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"model": "fake-base", "prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"model": "fake-base", "prompt": "hi", "temperature": -1}, "temperature"),
        ({"model": "fake-base", "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": "fake-base", "prompt": "hi", "top_k": 1.5}, "top_k"),
        ({"model": "fake-base", "prompt": "hi", "seed": "x"}, "seed"),
        ({"model": "fake-base", "prompt": "hi", "stop": 5}, "stop must be"),
        ({"model": "fake-base", "prompt": "hi", "stop": [""]}, "stop must be"),
        ({"model": "fake-base", "prompt": "hi", "stop": ["a", 1]}, "stop must be"),
        ({"model": "fake-base", "prompt": "hi", "stop_token_ids": 3}, "stop_token_ids"),
        ({"model": "fake-base", "prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"model": "fake-base", "prompt": "hi", "stop_token_ids": [999]}, "out of the vocabulary"),
        ({"model": "fake-base", "prompt": "hi", "ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"model": "fake-base", "prompt": "hi", "return_token_ids": 1}, "return_token_ids must be"),
        ({"model": "fake-base", "prompt": "hi", "n": 17}, "n must be an integer from 1 to 16"),
        ({"model": "fake-base", "prompt": "hi", "n": 0}, "n must be an integer from 1 to 16"),
        ({"model": "fake-base", "prompt": "hi", "n": "1"}, "n must be an integer"),
        ({"model": "fake-base", "prompt": "hi", "echo": 1}, "echo must be true or false"),
        ({"model": "fake-base", "prompt": "hi", "suffix": "x"}, "suffix is not supported"),
        ({"model": "fake-base", "prompt": "hi", "logprobs": 21}, "logprobs must be an integer from 0 to 20"),
        ({"model": "fake-base", "prompt": "hi", "logprobs": True}, "logprobs must be an integer"),
        ({"model": "fake-base", "prompt": "hi", "logprobs": 2, "echo": True}, "logprobs with echo"),
        ({"model": "fake-base", "prompt": "hi", "stream_options": {"bogus": 1}}, "stream_options"),
        ({"model": "fake-base", "prompt": "hi", "stream_options": {"include_usage": 1}}, "include_usage"),
        ({"model": "fake-base", "prompt": "hi", "best_of": 2, "bogus": "x"}, "unknown field(s): best_of, bogus"),
    ],
)
def test_bad_request(client, engine, fields, fragment):
    with pytest.raises(BadRequest) as caught:
        client.completions(**fields)
    assert fragment in caught.value.message, caught.value.message
    assert caught.value.status == 400 and not engine.submitted


def test_stream_flag_must_be_a_boolean(server):
    body = json.dumps({"model": "fake-base", "prompt": "x", "stream": "yes"}).encode()
    status, _, payload = raw_request(server.path, "POST", "/v1/completions", body)
    assert status == 400 and "stream must be true or false" in json.loads(payload)["error"]["message"]


def test_prompt_too_long_names_both_numbers(client):
    error = expect_error(client, PromptTooLong, "120", model="fake-base", prompt="x" * 120, max_tokens=9)
    assert "129" in error.message and "128" in error.message and "9" in error.message
    assert error.type == "context_length_exceeded"
    # exactly the context is fine
    assert client.completions(model="fake-base", prompt="x" * 120, max_tokens=8)["usage"]["total_tokens"] == 128


def test_unknown_model_is_404(client):
    error = expect_error(client, NotFound, "'nope'", model="nope", prompt="hi")
    assert error.type == "model_not_found" and error.status == 404


def test_broken_adapter(client):
    error = expect_error(client, AdapterError, "corrupt", model="broken", prompt="hi")
    assert error.status == 400 and error.type == "adapter_error"


def test_overloaded_sets_retry_after(server, engine):
    engine.max_waiting = 0
    body = json.dumps({"model": "fake-base", "prompt": "hi"}).encode()
    status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body)
    assert status == 503 and headers["Retry-After"] == "3"
    assert json.loads(payload) == {"error": {"message": "the queue is full", "type": "overloaded_error", "code": 503}}
    with pytest.raises(Overloaded) as caught:
        Client(server.path).completions(model="fake-base", prompt="hi")
    assert caught.value.retry_after_s == 3


def test_engine_bug_is_a_generic_500_and_the_server_goes_on(client, caplog):
    with caplog.at_level(logging.ERROR, logger="lorad.daemon.server.api"):
        error = expect_error(client, LoradError, "internal error", model="explode", prompt="hi")
    assert error.status == 500 and error.type == "internal_error"
    assert "a bug in the engine" not in error.message
    assert any("a bug in the engine" in (record.exc_text or "") for record in caplog.records)
    assert client.completions(model="fake-base", prompt="ok", max_tokens=2)["choices"][0]["text"] == "ok"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"prompt"', b"\xff\xfe", b""])
def test_body_not_a_json_object(server, body):
    status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body)
    error = json.loads(payload)["error"]
    assert status == 400 and error["code"] == 400 and error["type"] == "invalid_request_error"
    assert headers["Content-Type"].startswith("application/json")


def test_body_over_16_mib_is_413(server):
    # announced too large: refused before the body is read
    status, _, payload = raw_request(server.path, "POST", "/v1/completions",
                                     headers={"Content-Length": str(MAX_BODY_BYTES + 1)})
    assert status == 413 and json.loads(payload)["error"]["code"] == 413
    # sent in chunks with no length: refused once the limit is crossed
    body = json.dumps({"model": "fake-base", "prompt": "x" * MAX_BODY_BYTES}).encode()
    status, _, payload = raw_request(server.path, "POST", "/v1/completions", body, chunked=True)
    assert status == 413 and json.loads(payload)["error"]["type"] == "request_too_large"
    # through the client, which sends the whole body first
    with pytest.raises(LoradError) as caught:
        Client(server.path, timeout=30).completions(model="fake-base", prompt="x" * (MAX_BODY_BYTES + 10))
    assert caught.value.status == 413 and caught.value.type == "request_too_large"


def test_unknown_route_and_wrong_method_are_json(server):
    status, _, payload = raw_request(server.path, "GET", "/v2/nothing")
    assert status == 404
    assert json.loads(payload) == {"error": {"message": "no route GET /v2/nothing", "type": "not_found_error", "code": 404}}
    status, headers, payload = raw_request(server.path, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    error = json.loads(payload)["error"]
    assert error["code"] == 405 and error["type"] == "method_not_allowed" and "POST" in error["message"]
    status, _, payload = raw_request(server.path, "POST", "/health")
    assert status == 405 and json.loads(payload)["error"]["code"] == 405


# --- disconnects, logs, concurrency ---------------------------------------------------------------------------


def _open_completion(path: str, fields: dict) -> socket.socket:
    body = json.dumps(fields).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    return sock


def test_disconnect_aborts_a_full_completion(server, engine):
    sock = _open_completion(server.path, {"model": "slow", "prompt": "abc", "max_tokens": 100})
    wait_until(lambda: len(engine.submitted) == 1)
    (request_id,) = engine.submitted
    time.sleep(0.05)
    sock.close()
    wait_until(lambda: request_id in engine.aborted)


def test_disconnect_aborts_a_stream(server, engine):
    client = Client(server.path, timeout=10)
    chunks = client.stream_completions(model="slow", prompt="abc", max_tokens=100)
    first = next(chunks)
    assert first["choices"][0]["text"] == "a"
    chunks.close()  # closes the connection
    wait_until(lambda: first["id"] in engine.aborted)
    assert client.health() == {"status": "ok"}


def test_disconnect_aborts_every_choice(server, engine):
    client = Client(server.path, timeout=10)
    chunks = client.stream_completions(model="slow", prompt=["abc", "de"], n=2, max_tokens=100)
    first = next(chunks)
    assert first["id"].startswith("cmpl-")
    wait_until(lambda: len(engine.submitted) == 2)  # one engine request per prompt, with its n choices
    assert sorted(engine.submitted) == [f"{first['id']}-{index}" for index in range(2)]
    assert [request.n for request in engine.submitted.values()] == [2, 2]
    chunks.close()
    wait_until(lambda: set(engine.aborted) == set(engine.submitted))


def test_choices_of_several_prompts_are_indexed_prompt_times_n(client, engine):
    answer = client.completions(model="chat", prompt=["abc", [100, 101]], n=2, max_tokens=3, echo=True,
                                return_token_ids=True)
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    assert [choice["text"] for choice in answer["choices"]] == ["abcabc"] * 2 + ["deded"] * 2  # echo: the prompt first
    assert [choice["prompt_token_ids"] for choice in answer["choices"]] == [[97, 98, 99]] * 2 + [[100, 101]] * 2
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_finished_requests_are_not_aborted(client, engine):
    client.completions(model="fake-base", prompt="abc", max_tokens=2)
    list(client.stream_completions(model="fake-base", prompt="abc", max_tokens=2))
    time.sleep(0.05)
    assert engine.aborted == []


def test_shutdown_aborts_running_requests(engine, short_tmp):
    server = ServerThread(engine, f"{short_tmp}/api.sock")
    results = []
    worker = threading.Thread(target=lambda: results.append(
        Client(server.path, timeout=10).completions(model="slow", prompt="abc", max_tokens=100)))
    worker.start()
    wait_until(lambda: len(engine.submitted) == 1)
    server.close()
    worker.join(10)
    assert results[0]["choices"][0]["finish_reason"] == "abort"


def test_one_log_line_per_finished_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="lorad.daemon.server.api"):
        answer = client.completions(model="sql", prompt="hello", max_tokens=3)
    lines = [record.getMessage() for record in caplog.records if "request finished" in record.getMessage()]
    assert len(lines) == 1
    fields = dict(part.split("=", 1) for part in lines[0].split() if "=" in part)
    assert fields["request_id"] == answer["id"] and fields["adapter"] == "sql"
    assert fields["prompt_tokens"] == "5" and fields["completion_tokens"] == "3"
    assert fields["finish_reason"] == "length"
    assert float(fields["ttft_ms"]) <= float(fields["latency_ms"])
    # the client is this process, at the other end of the Unix socket
    assert fields["peer_uid"] == str(os.getuid()) and fields["peer_pid"] == str(os.getpid())


def test_fifty_requests_at_once(client):
    def one(i: int):
        prompt = f"request {i:02d} "
        if i % 2:
            return prompt, client.completions(model=("sql", "chat", "fake-base")[i % 3], prompt=prompt, max_tokens=12)
        chunks = list(client.stream_completions(model="chat", prompt=prompt, max_tokens=12))
        return prompt, {"choices": [{"text": "".join(c["choices"][0]["text"] for c in chunks)}]}

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    for prompt, answer in results:
        assert answer["choices"][0]["text"] == (prompt * 2)[:12]


# --- the real engine on the demo model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_server(demo_assets):
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine
    from lorad.daemon.engine.request import GenerationRequest, SamplingParams

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        engine = Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64))
    prompt = engine.tokenizer.encode("The quick brown fox")
    # Offline references, each request alone, before the step thread owns the engine.
    references = {
        adapter: engine.generate(
            [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=8, temperature=0))]
        )[0]
        for adapter in (None, "demo-r8")
    }
    with serve_engine(engine, "demo.sock") as server:
        yield server, engine, references


def test_demo_models(demo_server):
    server, engine, _ = demo_server
    models = Client(server.path).models()
    assert models[0]["id"] == "lorad-demo" and models[0]["parent"] is None
    assert {"demo-r1", "demo-r8", "demo-r64"} <= {m["id"] for m in models[1:]}
    assert all(m["parent"] == "lorad-demo" for m in models[1:])
    status = Client(server.path).status()
    assert status["model"] == "lorad-demo" and status["device"] == "cpu"


@pytest.mark.parametrize("model, adapter", [("lorad-demo", None), ("demo-r8", "demo-r8")])
def test_demo_greedy_matches_offline_generate(demo_server, model, adapter):
    server, _, references = demo_server
    reference = references[adapter]
    client = Client(server.path, timeout=30)
    answer = client.completions(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                return_token_ids=True)
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"] == reference.prompt_token_ids
    assert choice["token_ids"] == reference.token_ids and choice["text"] == reference.text
    assert choice["finish_reason"] == reference.finish_reason
    chunks = list(client.stream_completions(model=model, prompt=reference.prompt_token_ids, max_tokens=8,
                                            temperature=0, return_token_ids=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference.text
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference.token_ids


def test_demo_refusals(demo_server):
    server, engine, _ = demo_server
    client = Client(server.path)
    expect_error(client, NotFound, "'demo-nope'", model="demo-nope", prompt="hi")
    error = expect_error(client, PromptTooLong, str(engine.max_model_len), model="lorad-demo",
                         prompt=[5] * 60, max_tokens=10)
    assert "70" in error.message
    expect_error(client, BadRequest, "out of the vocabulary", model="lorad-demo", prompt=[engine.vocab_size])


def test_demo_concurrent_adapters_and_disconnect(demo_server):
    server, engine, _ = demo_server
    client = Client(server.path, timeout=60)
    models = ["lorad-demo", "demo-r1", "demo-r2", "demo-r8", "demo-r16-mlp"] * 3

    def one(model):
        return client.completions(model=model, prompt="Once upon a time", max_tokens=6, temperature=0.8,
                                  seed=1, ignore_eos=True)

    with ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(one, models))
    assert all(a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == 6
               for a in answers)
    # a stream left early is aborted: the engine holds no sequence for it afterwards
    chunks = client.stream_completions(model="demo-r2", prompt="abc", max_tokens=50, ignore_eos=True)
    next(chunks)
    chunks.close()
    wait_until(lambda: engine.status()["running"] == 0 and engine.status()["waiting"] == 0)


# --- bad input and load on the demo engine ------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b'{"model": "lorad-demo", "prompt": "hi"', 400, "not JSON"),
        (b'{"model": "lorad-demo", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
        (b'{"model": "lorad-demo", "prompt": "hi", "max_tokens": 1e999}', 400, "max_tokens"),
        (b'{"model": ["lorad-demo"], "prompt": "hi"}', 400, "model must be a string, the base model's name or an adapter's, not list"),
        (b'{"model": "lorad-demo", "prompt": {"text": "hi"}}', 400, "prompt must be"),
        (b'{"model": "lorad-demo", "prompt": "hi", "max_tokens": "4"}', 400, "max_tokens"),
        (b'{"model": "lorad-demo", "prompt": "hi", "extra": 1}', 400, "unknown field(s): extra"),
        (b'{"model": "demo-nope", "prompt": "hi"}', 404, "'demo-nope'"),
        (b'{"model": "lorad-demo", "prompt": ""}', 400, "prompt is empty"),
        (b'{"model": "lorad-demo", "prompt": "' + b"word " * 100 + b'"}', 400, "context"),
        (b'{"model": "lorad-demo", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"model": "lorad-demo", "prompt": "hi", "max_tokens": -3}', 400, "max_tokens"),
        (b'{"model": "lorad-demo", "prompt": "hi", "max_tokens": 100000000000000000000}', 400, "context"),
        (b'{"model": "lorad-demo", "prompt": "hi", "max_tokens": 64}', 400, "context"),
        (b'{"model": "lorad-demo", "prompt": "hi", "temperature": -0.5}', 400, "temperature"),
        (b'{"model": "lorad-demo", "prompt": "hi", "top_p": 1.5}', 400, "top_p"),
        (b'{"model": "lorad-demo", "prompt": "hi", "top_k": -2}', 400, "top_k"),
        (b'{"model": "lorad-demo", "prompt": "hi", "seed": 1.5}', 400, "seed"),
        (b'{"model": "lorad-demo", "prompt": [1, 2, 99999]}', 400, "out of the vocabulary"),
        (b'{"model": "lorad-demo", "prompt": "hi", "stop": [""]}', 400, "stop must be"),
        (b'{"model": "lorad-demo", "prompt": "hi", "stream": 1}', 400, "stream must be true or false"),
    ],
)
def test_demo_bad_input_is_refused_and_serving_goes_on(demo_server, body, status, fragment):
    server, engine, _ = demo_server
    answer_status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body,
                                                  {"Content-Type": "application/json"})
    error = json.loads(payload)["error"]
    assert answer_status == status and error["code"] == status and fragment in error["message"], error
    assert headers["Content-Type"].startswith("application/json")
    answer = Client(server.path, timeout=30).completions(model="demo-r1", prompt="hi", max_tokens=2, ignore_eos=True)
    assert answer["usage"]["completion_tokens"] == 2


def _demo_engine(demo_assets, **config):
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        return Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64, **config))


def test_demo_full_queue_is_503_with_retry_after(demo_assets, short_tmp):
    engine = _demo_engine(demo_assets, max_running_requests=1, max_waiting_requests=2)
    forward = engine.runner.model.forward

    def slow_forward(*args, **kwargs):  # about 20 ms a step, so the queue stays full while we look
        time.sleep(0.02)
        return forward(*args, **kwargs)

    engine.runner.model.forward = slow_forward
    engine.start()
    server = ServerThread(engine, f"{short_tmp}/queue.sock")
    client = Client(server.path, timeout=30)
    try:
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(client.completions, model="demo-r1", prompt="abc", max_tokens=20, ignore_eos=True)
            wait_until(lambda: engine.status()["running"] == 1)
            waiting = [pool.submit(client.completions, model="demo-r2", prompt="abc", max_tokens=2, ignore_eos=True)
                       for _ in range(2)]
            wait_until(lambda: engine.status()["waiting"] == 2)
            body = json.dumps({"model": "demo-r1", "prompt": "abc", "max_tokens": 2, "stream": True}).encode()
            status, headers, payload = raw_request(server.path, "POST", "/v1/completions", body)
            assert status == 503 and int(headers["Retry-After"]) >= 1
            assert json.loads(payload)["error"]["type"] == "overloaded_error"
            with pytest.raises(Overloaded):
                client.completions(model="lorad-demo", prompt="abc", max_tokens=2)
            assert running.result(30)["usage"]["completion_tokens"] == 20
            assert all(w.result(30)["usage"]["completion_tokens"] == 2 for w in waiting)
        assert client.completions(model="demo-r1", prompt="abc", max_tokens=2)["choices"][0]["finish_reason"]
    finally:
        server.close()
        engine.stop()


def test_demo_500_concurrent_streams_are_answered_or_refused(demo_assets, short_tmp, caplog):
    from lorad.client import AsyncClient

    engine = _demo_engine(demo_assets, max_running_requests=64, max_waiting_requests=64)
    engine.start()
    server = ServerThread(engine, f"{short_tmp}/load.sock")
    adapters = ["lorad-demo", "demo-r1", "demo-r2", "demo-r4", "demo-r8", "demo-r16", "demo-r16-mlp", "demo-r32"]

    async def one(client, index):
        try:
            chunks = [chunk async for chunk in client.stream_completions(
                model=adapters[index % len(adapters)], prompt=f"request {index}", max_tokens=4, ignore_eos=True)]
        except Overloaded as refusal:
            assert refusal.retry_after_s >= 1
            return 503
        assert len(chunks) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        return 200

    async def burst():
        async with AsyncClient(server.path, timeout=120, max_connections=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(500))), 120)

    try:
        with caplog.at_level(logging.WARNING):
            outcomes = asyncio.run(burst())
        print(f"answered={outcomes.count(200)} refused={outcomes.count(503)}")
        assert len(outcomes) == 500 and set(outcomes) <= {200, 503}
        assert outcomes.count(200) >= 64, outcomes.count(200)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
        wait_until(lambda: engine.status()["running"] == 0 and engine.status()["waiting"] == 0)
        answer = Client(server.path).completions(model="demo-r1", prompt="ok", max_tokens=2, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 2
    finally:
        server.close()
        engine.stop()
