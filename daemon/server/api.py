"""The daemon's HTTP face: an OpenAI-compatible subset (/v1/completions, /v1/chat/completions, /v1/models and
/v1/models/{model}, /health), vLLM's adapter admin routes and Prometheus /metrics, served by aiohttp on a Unix
socket. A request is checked (its body by schemas.py, its prompt against the model here), handed to the engine,
and the engine's outputs (called from its step thread) hop onto the event loop through one asyncio.Queue per
request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from pydantic_core import to_json

from lorad.errors import (
    AdmissionDropped, BadRequest, BodyTooLarge, EngineDead, LoradError, MethodNotAllowed, ModelError, ModelNotFound,
    NotFound, Overloaded, PromptTooLong,
)
from lorad.daemon.server import metrics as metrics_format
from lorad.daemon.server.admin_gate import AdminGate
from lorad.daemon.server import body_parser
from lorad.daemon.server.body_parser import MAX_BODY_BYTES, json_body
from lorad.daemon.server.unix_socket import PeerCredentials, peer_credentials
from lorad.daemon.engine.chat_template import (TEMPLATE_FILE, TOKENIZER_CONFIG, AdapterTemplates, ChatTemplate,
                                               load_chat_template)
from lorad.daemon.engine.request import GenerationRequest, RequestOutput, check_prompt
from lorad.daemon.server.schemas import (
    MAX_N, AssistantMessage, ChatChoice, ChatChunkChoice, ChatLogprobs, Chunk, Completion, CompletionChoice,
    CompletionLogprobs, CompletionResponse, Delta, TokenLogprob, TopLogprob, Usage, max_body_values, parse_chat,
    parse_completion,
)

log = logging.getLogger(__name__)

# Prompts longer than this are tokenized off the event loop, so one huge prompt does not stall the others.
_TOKENIZE_INLINE_CHARS = 4096

ENGINE = web.AppKey("engine", object)
STARTED = web.AppKey("started", int)
IN_FLIGHT = web.AppKey("in_flight", set)  # request ids submitted and not yet finished
SHUTTING_DOWN = web.AppKey("shutting_down", asyncio.Event)
CHAT = web.AppKey("chat", object)  # the checkpoint's ChatTemplate, or why there is none (str)
ADAPTER_CHAT = web.AppKey("adapter_chat", AdapterTemplates)  # adapter folders' own templates
ADMIN = web.AppKey("admin", AdminGate)  # who may load and unload adapters
MAX_CHOICES_PER_PROMPT = web.AppKey("max_n", int)  # n's bound (--max-n)


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


# --- handlers -------------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def model_entries(request: web.Request) -> list[dict]:
    """The base model and every registered adapter as OpenAI model objects, with lorad's own fields."""
    # Engine calls that may block (locks, or a round trip when the engine runs in its own process) run
    # off the event loop, so streams keep flowing meanwhile.
    entries = await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].models)
    return [openai_model(request.app, entry) for entry in entries]


def openai_model(app: web.Application, entry: dict) -> dict:
    """An engine's model entry (Engine.models) as an OpenAI model object, with lorad's own fields."""
    extra = {key: value for key, value in entry.items() if key not in ("id", "parent")}
    return {"id": entry["id"], "object": "model", "created": app[STARTED], "owned_by": "lorad",
            "parent": entry.get("parent"), "max_model_len": app[ENGINE].max_model_len, **extra}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": await model_entries(request)})


async def model(request: web.Request) -> web.Response:
    """One entry of /v1/models by its id (the openai client's `models.retrieve`)."""
    wanted = request.match_info["model"]
    for entry in await model_entries(request):
        if entry["id"] == wanted:
            return web.json_response(entry)
    raise ModelNotFound.named(wanted)


async def status(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.get_running_loop().run_in_executor(None, request.app[ENGINE].status))


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    snapshot = await asyncio.get_running_loop().run_in_executor(None, engine.metrics)
    return web.Response(body=metrics_format.render(snapshot).encode(),
                        headers={"Content-Type": metrics_format.CONTENT_TYPE})


# --- adapter admin (vLLM's routes) --------------------------------------------------------------------


def parse_admin(body, required: tuple[str, ...]) -> dict[str, str]:
    """A /v1/load_lora_adapter or /v1/unload_lora_adapter body: exactly `required`, all non-empty strings."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(required))
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    for name in required:
        if body.get(name) is None or body[name] == "":
            raise BadRequest(f"{name} is required: a non-empty string")
        if not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string, not {type(body[name]).__name__}")
        if "\0" in body[name]:
            raise BadRequest(f"{name} must not contain NUL characters")
        if not body[name].isascii():
            try:
                body[name].encode()
            except UnicodeEncodeError:  # JSON's \ud800 escapes: a lone surrogate no path or name can hold
                raise BadRequest(f"{name} must be valid Unicode text (it holds a lone surrogate)") from None
    return body


async def load_lora_adapter(request: web.Request) -> web.Response:
    request.app[ADMIN].check(request)
    engine = request.app[ENGINE]
    fields = parse_admin(await json_body(request), ("lora_name", "lora_path"))
    name, path = fields["lora_name"], fields["lora_path"]
    # load_adapter reads and checks the weights from disk: off the event loop.
    entry = await asyncio.get_running_loop().run_in_executor(None, engine.load_adapter, name, path)
    log.info("adapter loaded through the API name=%s path=%s%s", name, path, _peer_fields(request))
    return web.json_response(openai_model(request.app, entry))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    request.app[ADMIN].check(request)
    engine = request.app[ENGINE]
    name = parse_admin(await json_body(request), ("lora_name",))["lora_name"]
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
    completion = parse_completion(await json_body(request), request.app[MAX_CHOICES_PER_PROMPT])
    for prompt in completion.prompts:  # a cheap bound before any tokenizing
        if isinstance(prompt, str):
            _check_text_length(len(prompt), engine.max_model_len)
    prompts = [await _encode(engine.tokenizer, prompt, special_tokens=True) if isinstance(prompt, str) else prompt
               for prompt in completion.prompts]
    return await _generate(request, completion, prompts, f"cmpl-{uuid.uuid4().hex}", arrived, peer)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    engine = request.app[ENGINE]
    peer = peer_credentials(request.transport)
    completion = parse_chat(await json_body(request), request.app[MAX_CHOICES_PER_PROMPT])
    loop = asyncio.get_running_loop()
    template = None
    if completion.model != engine.model_name:  # an adapter folder may ship its own template
        template = await loop.run_in_executor(None, _adapter_template, request.app, completion.model)
    if template is None:
        template = request.app[CHAT]
        if not isinstance(template, ChatTemplate):
            raise BadRequest(f"model {engine.model_name} has no chat template: {template}; use /v1/completions")
    # Rendering and tokenizing grow with the messages: off the event loop. The template writes the special
    # tokens itself (BOS among them), so the text is tokenized without adding any.
    _check_text_length(sum(len(message["content"]) for message in completion.messages), engine.max_model_len)
    text = await loop.run_in_executor(None, template.render, completion.messages)
    prompt_ids = await _encode(engine.tokenizer, text, special_tokens=False)
    return await _generate(request, completion, [prompt_ids], f"chatcmpl-{uuid.uuid4().hex}", arrived, peer)


MAX_CHARS_PER_TOKEN = 64  # more than any token of the tokenizers lorad serves covers (runs of spaces included)


def _check_text_length(characters: int, max_model_len: int) -> None:
    """PromptTooLong for a text no tokenizing could fit in the context, before spending time tokenizing it."""
    if characters > max_model_len * MAX_CHARS_PER_TOKEN:
        raise PromptTooLong(f"the prompt is {characters} characters: more than a context of {max_model_len} tokens "
                            f"holds at up to {MAX_CHARS_PER_TOKEN} characters a token")


async def _encode(tokenizer, text: str, special_tokens: bool) -> list[int]:
    """Text -> token ids; a long text off the event loop, so one huge prompt does not stall the others."""
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        return tokenizer.encode(text, add_special_tokens=special_tokens)
    return await asyncio.get_running_loop().run_in_executor(None, lambda: tokenizer.encode(text, add_special_tokens=special_tokens))


@dataclass
class _Choice:
    """One choice of a request: its prompt, and the engine request that generates it (with its prompt's other
    choices)."""

    index: int
    prompt_index: int
    generation: GenerationRequest
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprob per token, when asked for
    text_offset: int = 0  # completions' logprobs: where the next token's text starts
    finish_reason: str | None = None
    started: bool = False  # a stream has sent its first chunk


async def _generate(request: web.Request, completion: Completion, prompts: list[list[int]], request_id: str,
                    arrived: float, peer) -> web.StreamResponse:
    """Checks every prompt, submits one engine request per prompt with its n choices (indexed prompt x n + i as
    OpenAI does) and answers: the whole completion, or one stream of events for every choice."""
    engine = request.app[ENGINE]
    loop = asyncio.get_running_loop()
    for prompt_ids in prompts:
        check_prompt(prompt_ids, completion.sampling, engine.vocab_size, engine.max_model_len,
                     completion.max_tokens_field)
    adapter = None if completion.model == engine.model_name else completion.model
    n = completion.n
    outputs = _OutputQueue(loop, len(prompts) * n)
    generations, choices = [], []
    for prompt_index, prompt_ids in enumerate(prompts):
        # One engine request per prompt: its n choices share the prompt's prefill and KV blocks; choice i draws
        # with seed + i, so a seed makes the whole set reproducible, each choice its own draw.
        generation = GenerationRequest(prompt_token_ids=list(prompt_ids), adapter=adapter, sampling=completion.sampling,
                                       request_id=request_id if len(prompts) == 1 else f"{request_id}-{prompt_index}", n=n)
        generation.on_output = functools.partial(outputs.push, prompt_index * n)
        generations.append(generation)
        choices += [_Choice(prompt_index * n + i, prompt_index, generation) for i in range(n)]
    submitted_ids = []
    in_flight = request.app[IN_FLIGHT]
    record = _RequestRecord(request_id, completion.model, sum(len(p) for p in prompts), arrived, peer, len(choices))
    try:
        for generation in generations:
            # submit() may read a cold adapter from disk: off the event loop, so other requests keep streaming.
            submitted = loop.run_in_executor(None, engine.submit, generation)
            try:
                await asyncio.shield(submitted)
            except asyncio.CancelledError:  # the client left while submit() ran: abort once it is queued
                submitted.add_done_callback(
                    lambda done, rid=generation.request_id: done.cancelled() or done.exception() or engine.abort(rid))
                raise
            submitted_ids.append(generation.request_id)
            in_flight.add(generation.request_id)
            if request.app[SHUTTING_DOWN].is_set():  # shutdown began while submit() ran: its abort missed this one
                engine.abort(generation.request_id)
        # echo's prompt texts: a decode grows with the prompt, so off the event loop, once per prompt
        echoes = await loop.run_in_executor(None, _echoes, completion, prompts, engine.tokenizer) if completion.echo else None
        if completion.stream:
            return await _stream_response(request, completion, choices, outputs, record, prompts, request_id, echoes)
        return await _full_response(completion, choices, outputs, record, prompts, request_id, engine.tokenizer, echoes)
    finally:
        for generation in generations:
            rid = generation.request_id
            in_flight.discard(rid)
            going = any(choice.finish_reason is None for choice in choices if choice.generation is generation)
            if rid in submitted_ids and going:  # the client went away, or we failed
                engine.abort(rid)
        if record.finish_reason is None:
            record.finish_reason = "abort"
        record.log()


class _OutputQueue:
    """Carries every choice's RequestOutputs from the engine thread to the handler's task, as (index, output)
    until each of `count` choices has finished."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int = 1):
        self.loop, self.count = loop, count
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    def push(self, first: int, output: RequestOutput) -> None:  # engine thread; first: the request's choice 0's index
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (first + output.choice, output))
        except RuntimeError:  # the loop is closed: the server is gone, nobody is waiting
            pass

    async def __aiter__(self):
        finished = 0
        while finished < self.count:
            index, output = await self.queue.get()
            finished += output.finished
            yield index, output


@dataclass
class _RequestRecord:
    request_id: str
    model: str
    prompt_tokens: int
    arrived: float
    peer: PeerCredentials | None = None  # the client process
    choices: int = 1
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None  # the last choice's, once every choice has finished
    finished: int = 0

    def add(self, output: RequestOutput) -> None:
        if output.new_token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.completion_tokens += len(output.new_token_ids)
        if output.finished:
            self.finished += 1
            if self.finished == self.choices:
                self.finish_reason = output.finish_reason

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    def log(self) -> None:
        ttft = "-" if self.first_token_at is None else f"{(self.first_token_at - self.arrived) * 1e3:.1f}"
        uid, pid = ("-", "-") if self.peer is None else (self.peer.uid, self.peer.pid)
        log.info(
            "request finished request_id=%s adapter=%s prompt_tokens=%d completion_tokens=%d choices=%d ttft_ms=%s "
            "latency_ms=%.1f finish_reason=%s peer_uid=%s peer_pid=%s",
            self.request_id, self.model[:80], self.prompt_tokens, self.completion_tokens, self.choices, ttft,
            (time.monotonic() - self.arrived) * 1e3, self.finish_reason, uid, pid,
        )


def _error_of(output: RequestOutput) -> LoradError:
    if output.error_type == AdmissionDropped.type:
        return AdmissionDropped(output.error)
    if output.error_type == EngineDead.type:
        return EngineDead(f"generation failed: {output.error}")
    return LoradError(f"generation failed: {output.error or 'the engine gave no reason'}")


def _echoes(completion: Completion, prompts: list[list[int]], tokenizer) -> list[str] | None:
    """echo: each prompt's text, set ahead of its choices' (a text prompt as sent, token ids decoded once per
    prompt, whatever n); None when not asked for."""
    if not completion.echo or completion.chat:
        return None
    sent = completion.prompts or [None] * len(prompts)
    return [prompt if isinstance(prompt, str) else tokenizer.decode(ids) for prompt, ids in zip(sent, prompts)]


def _logprobs(completion: Completion, choice: _Choice, token_ids: list[int], entries: list,
              tokenizer) -> ChatLogprobs | CompletionLogprobs | None:
    """The logprobs of these tokens of a choice in OpenAI's form (None when not asked for): chat's `content`
    list of {token, logprob, bytes, top_logprobs}, or completions' tokens, token_logprobs, top_logprobs (one
    {token: logprob} per token) and text_offset (each token's start in the choice's text, by token texts)."""
    if completion.sampling.logprobs is None:
        return None
    texts = [tokenizer.token_text(token) for token in token_ids]
    if completion.chat:
        def item(text, logprob) -> TopLogprob:
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

        return ChatLogprobs(content=[
            TokenLogprob(**item(text, entry.logprob),
                         top_logprobs=[item(tokenizer.token_text(top), value) for top, value in entry.top])
            for text, entry in zip(texts, entries)])
    offsets = []
    for text in texts:
        offsets.append(choice.text_offset)
        choice.text_offset += len(text)
    return CompletionLogprobs(
        tokens=texts, token_logprobs=[entry.logprob for entry in entries],
        top_logprobs=[{tokenizer.token_text(top): value for top, value in entry.top} for entry in entries],
        text_offset=offsets)


async def _full_response(completion, choices: list[_Choice], outputs, record, prompts, request_id,
                         tokenizer, echoes: list[str] | None) -> web.Response:
    failed = None
    async for index, output in outputs:
        record.add(output)
        choice = choices[index]
        choice.text.append(output.text_delta)
        choice.token_ids.extend(output.new_token_ids)
        choice.logprobs.extend(output.logprobs or ())
        if output.finished:
            choice.finish_reason = output.finish_reason
            if output.finish_reason == "error" and failed is None:
                failed = output
    if failed is not None:
        raise _error_of(failed)
    answers = []
    for choice in choices:
        text = "".join(choice.text)
        logprobs = _logprobs(completion, choice, choice.token_ids, choice.logprobs, tokenizer)
        if completion.chat:
            answer = ChatChoice(index=choice.index, message=AssistantMessage(role="assistant", content=text),
                                finish_reason=choice.finish_reason, logprobs=logprobs)
        else:
            if completion.echo:
                text = echoes[choice.prompt_index] + text
            answer = CompletionChoice(index=choice.index, text=text, finish_reason=choice.finish_reason,
                                      logprobs=logprobs)
        if completion.return_token_ids:
            answer["token_ids"] = choice.token_ids
            if len(prompts) > 1:
                answer["prompt_token_ids"] = prompts[choice.prompt_index]
        answers.append(answer)
    body = CompletionResponse(id=request_id, object="chat.completion" if completion.chat else "text_completion",
                              created=int(time.time()), model=completion.model, choices=answers, usage=record.usage())
    if completion.return_token_ids and len(prompts) == 1:
        body["prompt_token_ids"] = prompts[0]
    return web.Response(body=to_json(body), content_type="application/json")


async def _stream_response(request, completion, choices: list[_Choice], outputs, record, prompts,
                           request_id: str, echoes: list[str] | None) -> web.StreamResponse:
    # The headers wait for the first output. A request refused before its first token (dropped by early abort, or
    # the engine gone) then answers with its status, 503 with Retry-After or 500, which clients retry or report as
    # for a whole completion, where a 200 stream would end in an error event.
    events = aiter(outputs)
    first = await anext(events)
    if first[1].finish_reason == "error":
        record.add(first[1])
        choices[first[0]].finish_reason = "error"
        raise _error_of(first[1])
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    kind = "chat.completion.chunk" if completion.chat else "text_completion"
    tokenizer = request.app[ENGINE].tokenizer
    head = Chunk(id=request_id, object=kind, created=created, model=completion.model, choices=[])
    first_chunk = True
    try:
        async for index, output in _after(first, events):
            record.add(output)
            choice = choices[index]
            if output.finished:
                choice.finish_reason = output.finish_reason
            if output.finish_reason == "error":  # after the first output: the stream has begun
                await _send_event(response, error_body(_error_of(output)))
                break
            text = output.text_delta
            logprobs = _logprobs(completion, choice, output.new_token_ids, output.logprobs or [], tokenizer)
            if completion.chat:  # the role in each choice's first delta, as OpenAI sends it
                delta = Delta(role="assistant", content=text) if not choice.started else Delta(content=text)
                entry = ChatChunkChoice(index=index, delta=delta, finish_reason=output.finish_reason, logprobs=logprobs)
            else:
                if completion.echo and not choice.started:
                    text = echoes[choice.prompt_index] + text
                entry = CompletionChoice(index=index, text=text, finish_reason=output.finish_reason, logprobs=logprobs)
            chunk = Chunk(head, choices=[entry])
            if completion.return_token_ids:
                entry["token_ids"] = output.new_token_ids
                if not choice.started:
                    if len(prompts) > 1:
                        entry["prompt_token_ids"] = prompts[choice.prompt_index]
                    elif first_chunk:
                        chunk["prompt_token_ids"] = prompts[0]
            if completion.include_usage:
                chunk["usage"] = None
            await _send_event(response, chunk)
            choice.started = True
            first_chunk = False
        else:
            if completion.include_usage:
                await _send_event(response, Chunk(head, usage=record.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; _generate aborts the choices still running
        log.debug("client disconnected request_id=%s", request_id)
    return response


async def _after(first, rest):
    """`first`, then the items of the async iterator `rest`."""
    yield first
    async for item in rest:
        yield item


async def _send_event(response: web.StreamResponse, chunk: Chunk | dict) -> None:
    await response.write(b"data: " + to_json(chunk) + b"\n\n")


# --- the application --------------------------------------------------------------------------------------


async def _abort_in_flight(app: web.Application) -> None:
    # On shutdown every running request is told to finish now, so handlers answer before the loop stops; one
    # whose submit() is still running is aborted by its handler once it returns (SHUTTING_DOWN).
    app[SHUTTING_DOWN].set()
    for request_id in list(app[IN_FLIGHT]):
        app[ENGINE].abort(request_id)


def _adapter_template(app: web.Application, name: str) -> ChatTemplate | None:
    """The chat template of adapter `name`'s own folder, if it ships one (an unknown name: None, and the
    engine's 404 follows at submit)."""
    path = app[ENGINE].adapter_path(name)
    if path is None:
        return None
    try:
        return app[ADAPTER_CHAT].get(path)
    except ModelError as error:
        raise BadRequest(f"adapter {name}: {error.message}") from None


def _chat_template(engine) -> ChatTemplate | str:
    """The checkpoint's chat template, or why /v1/chat/completions has none."""
    model_dir = getattr(engine, "model_dir", None)
    if model_dir is None:
        return "it was given by shape (--model-config), without a checkpoint directory"
    template = load_chat_template(Path(model_dir))
    if template is None:
        reason = f"neither {Path(model_dir) / TEMPLATE_FILE} nor chat_template in {Path(model_dir) / TOKENIZER_CONFIG}"
        log.info("chat template none: %s (/v1/chat/completions answers 400)", reason)
        return reason
    log.info("chat template source=%s", template.source)
    return template


def create_app(engine, admin: AdminGate | None = None, max_n: int = MAX_N) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app[MAX_CHOICES_PER_PROMPT] = max_n
    body_parser.add_to(app, max_values=max_body_values(engine.max_model_len))
    app[STARTED] = int(time.time())
    app[IN_FLIGHT] = set()
    app[SHUTTING_DOWN] = asyncio.Event()
    app[CHAT] = _chat_template(engine)
    app[ADAPTER_CHAT] = AdapterTemplates()
    app[ADMIN] = admin or AdminGate(os.geteuid())  # the daemon's user and root
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # adapter names may hold slashes
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/metrics", metrics)
    app.on_shutdown.append(_abort_in_flight)
    return app

