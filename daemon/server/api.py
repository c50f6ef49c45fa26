"""The daemon's HTTP face: an OpenAI-compatible subset (/v1/completions, /v1/chat/completions, /v1/models, /health), vLLM's
adapter admin routes and Prometheus /metrics, served by aiohttp on a Unix socket. A request is checked
here, handed to the engine, and the engine's outputs (called from its step thread) hop onto the event
loop through one asyncio.Queue per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from lorad.errors import (
    AdmissionDropped, BadRequest, BodyTooLarge, LoradError, MethodNotAllowed, NotFound, Overloaded,
)
from lorad.daemon.server import metrics as metrics_format
from lorad.daemon.server.unix_socket import PeerCredentials, peer_credentials
from lorad.daemon.engine.chat_template import ChatTemplate, check_messages, load_chat_template
from lorad.daemon.engine.request import GenerationRequest, RequestOutput, SamplingParams, check_prompt

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
# Prompts longer than this are tokenized off the event loop, so one huge prompt does not stall the others.
_TOKENIZE_INLINE_CHARS = 4096

ENGINE = web.AppKey("engine", object)
STARTED = web.AppKey("started", int)
IN_FLIGHT = web.AppKey("in_flight", set)  # request ids submitted and not yet finished
CHAT = web.AppKey("chat", object)  # the checkpoint's ChatTemplate, or why there is none (str)
MAX_CHAT_MESSAGES = 1024


# --- errors: the one place a LoradError becomes an HTTP answer ---------------------------------------


def error_body(error: LoradError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "code": error.status}}


def _from_http(error: web.HTTPException, request: web.Request) -> LoradError:
    """aiohttp's own refusals (no route, wrong method, body too large) in lorad's shape."""
    if isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path} (allowed: {allowed})")
    if isinstance(error, web.HTTPNotFound):
        return NotFound(f"no route {request.method} {request.path}")
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return BodyTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    mapped = LoradError(error.reason)
    mapped.status, mapped.type = error.status, "http_error"
    return mapped


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    headers = {}
    try:
        return await handler(request)
    except web.HTTPException as http_error:
        if http_error.status < 400:
            raise
        error = _from_http(http_error, request)
        if "Allow" in http_error.headers:
            headers["Allow"] = http_error.headers["Allow"]
    except LoradError as lorad_error:
        error = lorad_error
    except Exception:
        log.exception("unhandled error method=%s path=%s", request.method, request.path)
        error = LoradError("internal error in lorad; the daemon's log has the details")
    if isinstance(error, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    log.info(
        "request refused method=%s path=%s status=%d type=%s message=%r",
        request.method, request.path, error.status, error.type, error.message,
    )
    return web.json_response(error_body(error), status=error.status, headers=headers)


# --- the completion request ---------------------------------------------------------------------------

_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
    "stream", "stream_options", "return_token_ids", "n", "logprobs", "user",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
}
_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "min_tokens")


@dataclass
class Completion:
    """A checked /v1/completions or /v1/chat/completions body; the prompt is still text or token ids (chat:
    None until the messages are rendered)."""

    model: str
    prompt: str | list[int] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    messages: list[dict] | None = None  # chat: the checked messages

    @property
    def chat(self) -> bool:
        return self.messages is not None


def parse_completion(body) -> Completion:
    fields = _fields(body, _FIELDS)
    if "prompt" not in fields:
        raise BadRequest("prompt is required")
    prompt = _one_prompt(fields["prompt"])
    if _flag(fields, "echo"):
        raise BadRequest("echo is not supported")
    if "logprobs" in fields:
        raise BadRequest("logprobs are not supported (send null)")
    return _common(fields, prompt)


def parse_chat(body) -> Completion:
    """A /v1/chat/completions body: messages checked (chat_template.check_messages), max_completion_tokens
    taken over max_tokens where both are given, as OpenAI's newer name."""
    fields = _fields(body, _CHAT_FIELDS)
    if "messages" not in fields:
        raise BadRequest("messages is required")
    messages = check_messages(fields["messages"], MAX_CHAT_MESSAGES)
    if _flag(fields, "logprobs") or "top_logprobs" in fields:
        raise BadRequest("logprobs are not supported (send false or null)")
    fields.pop("logprobs", None)
    if "max_completion_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_completion_tokens")
    completion = _common(fields, None)
    completion.messages = messages
    return completion


def _fields(body, allowed: set[str]) -> dict:
    """The body's fields, none unknown, model present; OpenAI clients send null for "not set": dropped."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    fields = {name: value for name, value in body.items() if value is not None}
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required: the base model's name or an adapter's")
    return fields


def _common(fields: dict, prompt) -> Completion:
    """The fields both endpoints share: streaming, n, sampling and stops."""
    stream = _flag(fields, "stream")
    n = fields.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int):
        raise BadRequest("n must be an integer")
    if n != 1:
        raise BadRequest("only n=1 is supported")
    options = fields.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest('stream_options must be an object with only "include_usage"')
    include_usage = _flag(options, "include_usage")

    stop = fields.get("stop", [])
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list):
        stop = tuple(stop)
    else:
        raise BadRequest("stop must be a string or a list of strings")
    stop_token_ids = fields.get("stop_token_ids", [])
    if not isinstance(stop_token_ids, list):
        raise BadRequest("stop_token_ids must be a list of token ids")
    sampling = SamplingParams(  # checks types and ranges
        **{name: fields[name] for name in _SAMPLING_FIELDS if name in fields},
        stop=stop,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=_flag(fields, "ignore_eos"),
    )
    return Completion(fields["model"], prompt, sampling, stream, include_usage, _flag(fields, "return_token_ids"))


def _one_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise BadRequest(f"one prompt per request (got a list of {len(prompt)})")
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise BadRequest(f"prompt is not valid unicode: {error.reason}") from None
    elif not isinstance(prompt, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
        raise BadRequest("prompt must be a string, a list of token ids, or a list holding one of those")
    if not prompt:
        raise BadRequest("prompt is empty")
    return prompt


def _flag(fields: dict, name: str) -> bool:
    value = fields.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


# --- handlers -------------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    created = request.app[STARTED]
    data = []
    # Engine calls that may block (locks, or a round trip when the engine runs in its own process) run
    # off the event loop, so streams keep flowing meanwhile.
    entries = await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].models)
    for entry in entries:
        extra = {key: value for key, value in entry.items() if key not in ("id", "parent")}
        data.append(
            {"id": entry["id"], "object": "model", "created": created, "owned_by": "lorad",
             "parent": entry.get("parent"), "max_model_len": request.app[ENGINE].max_model_len, **extra}
        )
    return web.json_response({"object": "list", "data": data})


async def status(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].status))


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    snapshot = await asyncio.get_running_loop().run_in_executor(None, engine.metrics)
    return web.Response(body=metrics_format.render(snapshot).encode(),
                        headers={"Content-Type": metrics_format.CONTENT_TYPE})


async def _json_body(request: web.Request):
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise BodyTooLarge(f"request body is larger than {MAX_BODY_BYTES} bytes")
    raw = await request.read()  # aiohttp raises 413 past client_max_size
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"the request body is not JSON: {error}") from None


# --- adapter admin (vLLM's routes) --------------------------------------------------------------------


def parse_admin(body, required: tuple[str, ...]) -> dict[str, str]:
    """A /v1/load_lora_adapter or /v1/unload_lora_adapter body: exactly `required`, all non-empty strings."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(required))
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    for name in required:
        if not isinstance(body.get(name), str) or not body[name]:
            raise BadRequest(f"{name} is required: a non-empty string")
        if "\0" in body[name]:
            raise BadRequest(f"{name} must not contain NUL characters")
    return body


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    fields = parse_admin(await _json_body(request), ("lora_name", "lora_path"))
    name, path = fields["lora_name"], fields["lora_path"]
    # load_adapter reads and checks the weights from disk: off the event loop.
    description = await asyncio.get_running_loop().run_in_executor(None, engine.load_adapter, name, path)
    log.info("adapter loaded through the API name=%s path=%s%s", name, path, _peer_fields(request))
    entry = {"id": name, "object": "model", "created": request.app[STARTED], "owned_by": "lorad",
             "parent": engine.model_name, "kind": "lora", "location": "host", **description}
    return web.json_response(entry)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = parse_admin(await _json_body(request), ("lora_name",))["lora_name"]
    await asyncio.get_running_loop().run_in_executor(None, engine.unload_adapter, name)
    log.info("adapter unloaded through the API name=%s%s", name, _peer_fields(request))
    return web.json_response({"id": name, "object": "model", "deleted": True})


def _peer_fields(request: web.Request) -> str:
    peer = peer_credentials(request.transport)
    return "" if peer is None else f" peer_uid={peer.uid} peer_pid={peer.pid}"


# --- completions ------------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    engine = request.app[ENGINE]
    peer = peer_credentials(request.transport)  # now: the transport is gone once the client leaves
    completion = parse_completion(await _json_body(request))
    prompt_ids = completion.prompt
    if isinstance(prompt_ids, str):
        prompt_ids = await _encode(engine.tokenizer, prompt_ids, special_tokens=True)
    return await _generate(request, completion, prompt_ids, f"cmpl-{uuid.uuid4().hex}", arrived, peer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    engine = request.app[ENGINE]
    peer = peer_credentials(request.transport)
    completion = parse_chat(await _json_body(request))
    template = request.app[CHAT]
    if not isinstance(template, ChatTemplate):
        raise BadRequest(f"model {engine.model_name} has no chat template: {template}; use /v1/completions")
    loop = asyncio.get_running_loop()
    # Rendering and tokenizing grow with the messages: off the event loop. The template writes the special
    # tokens itself (BOS among them), so the text is tokenized without adding any.
    text = await loop.run_in_executor(None, template.render, completion.messages)
    prompt_ids = await _encode(engine.tokenizer, text, special_tokens=False)
    return await _generate(request, completion, prompt_ids, f"chatcmpl-{uuid.uuid4().hex}", arrived, peer)


async def _encode(tokenizer, text: str, special_tokens: bool) -> list[int]:
    """Text -> token ids; a long text off the event loop, so one huge prompt does not stall the others."""
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        return tokenizer.encode(text, add_special_tokens=special_tokens)
    return await asyncio.get_running_loop().run_in_executor(None, lambda: tokenizer.encode(text, add_special_tokens=special_tokens))


async def _generate(request: web.Request, completion: Completion, prompt_ids: list[int], request_id: str,
                    arrived: float, peer) -> web.StreamResponse:
    """Checks the prompt, submits it and answers: the whole completion, or a stream of events."""
    engine = request.app[ENGINE]
    loop = asyncio.get_running_loop()
    check_prompt(prompt_ids, completion.sampling, engine.vocab_size, engine.max_model_len)

    generation = GenerationRequest(
        prompt_token_ids=list(prompt_ids),
        adapter=None if completion.model == engine.model_name else completion.model,
        sampling=completion.sampling,
        request_id=request_id,
    )
    outputs = _OutputQueue(loop)
    generation.on_output = outputs.push
    # submit() may read a cold adapter from disk: off the event loop, so other requests keep streaming.
    submitted = loop.run_in_executor(None, engine.submit, generation)
    try:
        await asyncio.shield(submitted)
    except asyncio.CancelledError:  # the client left while submit() ran: abort once it is queued
        submitted.add_done_callback(lambda done: done.cancelled() or done.exception() or engine.abort(request_id))
        raise

    in_flight = request.app[IN_FLIGHT]
    in_flight.add(request_id)
    record = _RequestRecord(request_id, completion.model, len(prompt_ids), arrived, peer)
    try:
        if completion.stream:
            return await _stream_response(request, completion, generation, outputs, record)
        return await _full_response(completion, generation, outputs, record)
    finally:
        in_flight.discard(request_id)
        if record.finish_reason is None:  # the client went away, or we failed: the engine must let go
            engine.abort(request_id)
            record.finish_reason = "abort"
        record.log()


class _OutputQueue:
    """Carries RequestOutputs from the engine thread to the handler's task."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def push(self, output: RequestOutput) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is waiting
            pass

    async def __aiter__(self):
        while True:
            output = await self.queue.get()
            yield output
            if output.finished:
                return


@dataclass
class _RequestRecord:
    request_id: str
    model: str
    prompt_tokens: int
    arrived: float
    peer: PeerCredentials | None = None  # the client process
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None

    def add(self, output: RequestOutput) -> None:
        if output.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.completion_tokens += len(output.new_token_ids)
        if output.finished:
            self.finish_reason = output.finish_reason

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def log(self) -> None:
        ttft = "-" if self.first_token_at is None else f"{(self.first_token_at - self.arrived) * 1e3:.1f}"
        uid, pid = ("-", "-") if self.peer is None else (self.peer.uid, self.peer.pid)
        log.info(
            "request finished request_id=%s adapter=%s prompt_tokens=%d completion_tokens=%d ttft_ms=%s "
            "latency_ms=%.1f finish_reason=%s peer_uid=%s peer_pid=%s",
            self.request_id, self.model, self.prompt_tokens, self.completion_tokens, ttft,
            (time.monotonic() - self.arrived) * 1e3, self.finish_reason, uid, pid,
        )


def _error_of(output: RequestOutput) -> LoradError:
    if output.error_type == AdmissionDropped.type:
        return AdmissionDropped(output.error)
    return LoradError(f"generation failed: {output.error or 'the engine gave no reason'}")


async def _full_response(completion, generation, outputs, record) -> web.Response:
    text, token_ids = [], []
    async for output in outputs:
        record.add(output)
        text.append(output.text_delta)
        token_ids.extend(output.new_token_ids)
    if output.finish_reason == "error":
        raise _error_of(output)
    if completion.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                  "finish_reason": output.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": "".join(text), "finish_reason": output.finish_reason, "logprobs": None}
    answer = {
        "id": generation.request_id, "object": "chat.completion" if completion.chat else "text_completion",
        "created": int(time.time()), "model": completion.model, "choices": [choice], "usage": record.usage(),
    }
    if completion.return_token_ids:
        choice["token_ids"] = token_ids
        answer["prompt_token_ids"] = generation.prompt_token_ids
    return web.json_response(answer)


async def _stream_response(request, completion, generation, outputs, record) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    kind = "chat.completion.chunk" if completion.chat else "text_completion"
    head = {"id": generation.request_id, "object": kind, "created": created, "model": completion.model}
    first = True
    try:
        async for output in outputs:
            record.add(output)
            if output.finish_reason == "error":
                await _send_event(response, error_body(_error_of(output)))
                break
            if completion.chat:  # the role in the first delta, as OpenAI sends it
                delta = {"role": "assistant", "content": output.text_delta} if first else {"content": output.text_delta}
                choice = {"index": 0, "delta": delta, "finish_reason": output.finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": output.text_delta, "finish_reason": output.finish_reason,
                          "logprobs": None}
            chunk = {**head, "choices": [choice]}
            if completion.return_token_ids:
                choice["token_ids"] = output.new_token_ids
                if first:
                    chunk["prompt_token_ids"] = generation.prompt_token_ids
            if completion.include_usage:
                chunk["usage"] = None
            await _send_event(response, chunk)
            first = False
        else:
            if completion.include_usage:
                await _send_event(response, {**head, "choices": [], "usage": record.usage()})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; completions() aborts the request if still running
        log.debug("client disconnected request_id=%s", generation.request_id)
    return response


async def _send_event(response: web.StreamResponse, chunk: dict) -> None:
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


# --- the application --------------------------------------------------------------------------------------


async def _abort_in_flight(app: web.Application) -> None:
    # On shutdown every running request is told to finish now, so handlers answer before the loop stops.
    for request_id in list(app[IN_FLIGHT]):
        app[ENGINE].abort(request_id)


def _chat_template(engine) -> ChatTemplate | str:
    """The checkpoint's chat template, or why /v1/chat/completions has none."""
    model_dir = getattr(engine, "model_dir", None)
    if model_dir is None:
        return "it was given by shape (--model-config), without a checkpoint directory"
    template = load_chat_template(Path(model_dir))
    if template is None:
        reason = f"neither {Path(model_dir) / 'chat_template.jinja'} nor chat_template in {Path(model_dir) / 'tokenizer_config.json'}"
        log.info("chat template none: %s (/v1/chat/completions answers 400)", reason)
        return reason
    log.info("chat template source=%s", template.source)
    return template


def create_app(engine) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[STARTED] = int(time.time())
    app[IN_FLIGHT] = set()
    app[CHAT] = _chat_template(engine)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/metrics", metrics)
    app.on_shutdown.append(_abort_in_flight)
    return app

