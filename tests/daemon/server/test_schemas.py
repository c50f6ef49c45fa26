"""daemon/server/schemas.py: every field of /v1/completions and /v1/chat/completions refused with a 400 that names
it, unknown fields refused at every level, vLLM's extra fields accepted, the schema's defaults and bounds those of
the engine's SamplingParams, n bounded by --max-n, and the daemon's answers in the declared response shapes."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import TypeAdapter, ValidationError

from lorad.config import ServerConfig
from lorad.daemon.engine.request import SamplingParams
from lorad.daemon.server.schemas import (
    ChatCompletionRequest, Chunk, CompletionRequest, CompletionResponse, parse_chat, parse_completion,
)
from lorad.client import Client
from lorad.errors import BadRequest

from daemon_harness import serve_demo, start_daemon, stop_daemon, wait_healthy

COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ENDPOINTS = {"completions": (parse_completion, COMPLETION), "chat": (parse_chat, CHAT)}

# (field, a value it refuses, how the message begins); on both endpoints
SHARED_REFUSALS = [
    ("model", 5, "model must be a string, the base model's name or an adapter's, not int"),
    ("model", ["x"], "model must be a string"),
    ("model", "", "model is required"),
    ("max_tokens", 0, "max_tokens must be a positive integer (got 0)"),
    ("max_tokens", "5", "max_tokens must be a positive integer (got '5')"),
    ("max_tokens", 2.0, "max_tokens must be a positive integer"),
    ("temperature", -1, "temperature must be 0 (greedy) or a number from 0.01 to 100"),
    ("temperature", 0.005, "temperature must be 0 (greedy) or a number from 0.01 to 100 (got 0.005)"),
    ("temperature", True, "temperature must be"),
    ("top_p", 0, "top_p must be a number from 1e-06 to 1"),
    ("top_k", -2, "top_k must be an integer >= -1"),
    ("seed", 1.5, "seed must be an integer from -2**63 to 2**64 - 1"),
    ("stop", 5, "stop must be a non-empty string or a list of at most 16 stop strings"),
    ("stop", ["a", ""], "stop must be"),
    ("stop", ["a"] * 17, "stop must be"),
    ("stop_token_ids", 3, "stop_token_ids must be a list of at most 256 token ids"),
    ("stop_token_ids", [-1], "stop_token_ids must be"),
    ("stop_token_ids", [1] * 257, "stop_token_ids must be"),
    ("ignore_eos", "yes", "ignore_eos must be true or false"),
    ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be a number in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be a number in (0, 10]"),
    ("logit_bias", {"x": 1}, "logit_bias must be an object of at most 300 token ids"),
    ("logit_bias", {"5": 101}, "logit_bias must be"),
    ("logit_bias", [5], "logit_bias must be"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("min_tokens", 17, "min_tokens (17) must not exceed max_tokens (16)"),
    ("stream", 1, "stream must be true or false"),
    ("stream_options", [], 'stream_options must be an object with only "include_usage"'),
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage must be true or false"),
    ("return_token_ids", "no", "return_token_ids must be true or false"),
    ("n", 0, "n must be an integer from 1 to 16"),
    ("n", 17, "n must be an integer from 1 to 16"),
    ("n", True, "n must be an integer from 1 to 16"),
    ("user", 5, "user must be a string"),
]
COMPLETION_REFUSALS = [
    ("prompt", 5, "prompt must be a string, a list of token ids, or a list of those"),
    ("prompt", [1, "a"], "prompt must be"),
    ("prompt", [[1], []], "prompt is empty"),
    ("prompt", ["a"] * 65, "prompt: 65 prompts, more than the 64"),
    ("prompt", "\ud800", "prompt is not valid unicode"),
    ("echo", 1, "echo must be true or false"),
    ("logprobs", 21, "logprobs must be an integer from 0 to 20"),
    ("logprobs", True, "logprobs must be an integer from 0 to 20"),
    ("suffix", "x", "suffix is not supported"),
]
CHAT_REFUSALS = [
    ("messages", [], "messages must be a non-empty list"),
    ("messages", "hi", "messages must be a non-empty list"),
    ("messages", [{"role": "robot", "content": "x"}], "messages[0].role must be one of system, developer, user, "
                                                      "assistant (got 'robot')"),
    ("messages", [{"role": "user"}], "messages[0].content is required"),
    ("messages", [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}],
     "messages[1].content[0].type must be \"text\""),
    ("messages", [{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text is required"),
    ("messages", [{"role": "user", "content": "\udfff"}], "messages[0].content is not valid unicode"),
    ("max_completion_tokens", 0, "max_completion_tokens must be a positive integer"),
    ("logprobs", 2, "logprobs must be true or false"),
    ("top_logprobs", 21, "top_logprobs must be an integer from 0 to 20"),
]


@pytest.mark.parametrize("endpoint, field, value, start", [
    *[(endpoint, *case) for endpoint in ENDPOINTS for case in SHARED_REFUSALS],
    *[("completions", *case) for case in COMPLETION_REFUSALS],
    *[("chat", *case) for case in CHAT_REFUSALS],
])
def test_each_field_is_refused_by_name(endpoint, field, value, start):
    parse, body = ENDPOINTS[endpoint]
    with pytest.raises(BadRequest) as caught:
        parse({**body, field: value})
    assert caught.value.status == 400 and caught.value.message.startswith(start), caught.value.message


@pytest.mark.parametrize("endpoint, fields, message", [
    ("completions", {"best_of": 2, "bogus": 1}, "unknown field(s): best_of, bogus"),
    ("completions", {"messages": [], "top_logprobs": 2}, "unknown field(s): messages, top_logprobs"),
    ("completions", {"max_completion_tokens": 4}, "unknown field(s): max_completion_tokens"),
    ("chat", {"prompt": "x"}, "unknown field(s): prompt"),
    ("chat", {"echo": True, "suffix": "x"}, "unknown field(s): echo, suffix"),
    ("chat", {"tools": [], "response_format": {}}, "unknown field(s): response_format, tools"),
    ("completions", {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options: unknown field(s): continuous_usage_stats"),
    ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": []}]},
     "messages[1]: unknown field(s): tool_calls"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]},
     "messages[0].content[0]: unknown field(s): cache"),
    ("completions", {"bogus": 1, "max_tokens": "x"}, "unknown field(s): bogus"),  # unknown fields first
])
def test_unknown_fields_are_refused_at_every_level(endpoint, fields, message):
    parse, body = ENDPOINTS[endpoint]
    with pytest.raises(BadRequest) as caught:
        parse({**body, **fields})
    assert caught.value.message == message


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_vllms_extra_fields_are_accepted(endpoint):
    parse, body = ENDPOINTS[endpoint]
    completion = parse({**body, "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [3, 4],
                        "ignore_eos": True, "return_token_ids": True, "top_k": 5, "user": "ann"})
    sampling = completion.sampling
    assert (sampling.repetition_penalty, sampling.min_tokens, sampling.stop_token_ids, sampling.ignore_eos,
            sampling.top_k) == (1.2, 2, (3, 4), True, 5)
    assert completion.return_token_ids


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_null_means_not_set(endpoint):
    parse, body = ENDPOINTS[endpoint]
    fields = {"max_tokens": None, "temperature": None, "seed": None, "stop": None, "stream_options": None,
              "logit_bias": None, "n": None, "user": None, "logprobs": None}
    assert parse({**body, **fields}) == parse(body)


def test_the_schema_defaults_are_the_engines():
    assert parse_completion(COMPLETION).sampling == SamplingParams()
    assert parse_chat(CHAT).sampling == SamplingParams()
    engine = SamplingParams()
    for schema in (CompletionRequest, ChatCompletionRequest):
        for field in dataclasses.fields(SamplingParams):
            if field.name not in schema.model_fields or (schema is ChatCompletionRequest and field.name == "logprobs"):
                continue  # chat's logprobs is a flag (off by default), not a count
            default = schema.model_fields[field.name].get_default(call_default_factory=True)
            if isinstance(default, list):
                default = tuple(default)
            elif isinstance(default, dict):
                default = tuple(sorted(default.items()))
            assert default == getattr(engine, field.name), (schema.__name__, field.name)


# (field, the edge both accept, the value past it both refuse)
EDGES = [
    ("max_tokens", 1, 0),
    ("temperature", 0.01, 0.0099),
    ("temperature", 100, 100.01),
    ("temperature", 0, -0.001),
    ("top_p", 1e-6, 9e-7),
    ("top_p", 1, 1.01),
    ("top_k", -1, -2),
    ("seed", 2**64 - 1, 2**64),
    ("seed", -(2**63), -(2**63) - 1),
    ("stop", ["s"] * 16, ["s"] * 17),
    ("stop_token_ids", [0] * 256, [0] * 257),
    ("stop_token_ids", [0], [-1]),
    ("presence_penalty", -2, -2.01),
    ("frequency_penalty", 2, 2.01),
    ("repetition_penalty", 10, 10.01),
    ("repetition_penalty", 1e-9, 0),
    ("logit_bias", {str(token): 100 for token in range(300)}, {str(token): 1 for token in range(301)}),
    ("logit_bias", {"5": -100}, {"5": -100.5}),
    ("min_tokens", 0, -1),
    ("logprobs", 20, 21),
    ("logprobs", 0, -1),
]


@pytest.mark.parametrize("field, edge, past", EDGES)
def test_the_schema_and_the_engine_hold_the_same_bounds(field, edge, past):
    """The schema (alone: parse_completion would also build the engine's SamplingParams) and SamplingParams
    each take the edge and each refuse the value past it."""
    CompletionRequest.model_validate({**COMPLETION, field: edge})
    SamplingParams(**{field: edge})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({**COMPLETION, field: past})
    with pytest.raises(BadRequest):
        SamplingParams(**{field: past})
    with pytest.raises(BadRequest) as caught:
        parse_completion({**COMPLETION, field: past})
    assert caught.value.message.startswith(field), caught.value.message


def test_n_is_bounded_by_max_n():
    assert parse_completion({**COMPLETION, "n": 32}, max_n=32).n == 32
    assert parse_chat({**CHAT, "n": 32}, max_n=32).n == 32
    with pytest.raises(BadRequest, match="n must be an integer from 1 to 32"):
        parse_completion({**COMPLETION, "n": 33}, max_n=32)
    with pytest.raises(BadRequest, match="n x prompts is 264, more than the 256"):
        parse_completion({**COMPLETION, "prompt": ["a"] * 11, "n": 24}, max_n=32)
    for bad in (0, 257, True):
        with pytest.raises(BadRequest, match="max_n must be an integer from 1 to 256"):
            ServerConfig(max_n=bad)


def test_lorad_serve_holds_n_to_its_max_n(demo_assets, short_tmp):
    path = short_tmp / "lorad.sock"
    daemon = start_daemon(demo_assets, path, "--max-n", "3")
    try:
        client = wait_healthy(daemon, path)
        with pytest.raises(BadRequest, match="n must be an integer from 1 to 3"):
            client.completions(model="demo-r8", prompt="hi", n=4)
        answer = client.completions(model="demo-r8", prompt="hi", n=3, max_tokens=2)
        assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    finally:
        stop_daemon(daemon)


# --- the answers, in the shapes declared ----------------------------------------------------------------------

RESPONSE = TypeAdapter(CompletionResponse)
CHUNK = TypeAdapter(Chunk)


@pytest.fixture(scope="module")
def demo(demo_assets):
    with serve_demo(demo_assets, "schemas.sock") as (server, engine):
        yield Client(server.path, timeout=60), engine


@pytest.mark.parametrize("fields", [
    dict(prompt="The lighthouse", max_tokens=4),
    dict(prompt=["The lighthouse", [5, 6, 7]], n=2, max_tokens=3, logprobs=2, return_token_ids=True, seed=3),
    dict(prompt="The lighthouse", max_tokens=3, echo=True, return_token_ids=True),
    dict(messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=4),
    dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}], max_completion_tokens=3, n=2,
         logprobs=True, top_logprobs=2, return_token_ids=True, temperature=0.5, seed=1),
])
def test_answers_and_chunks_have_the_declared_shapes(demo, fields):
    client, _ = demo
    chat = "messages" in fields
    fields = dict(model="demo-r8", ignore_eos=True, **fields)
    answer = (client.chat_completions if chat else client.completions)(**fields)
    RESPONSE.validate_python(answer)
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    chunks = list((client.stream_chat_completions if chat else client.stream_completions)(
        stream_options={"include_usage": True}, **fields))
    for chunk in chunks:
        CHUNK.validate_python(chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == answer["usage"]
    with pytest.raises(ValidationError):  # a key the shapes do not declare is caught
        CHUNK.validate_python({**chunks[0], "choices": [{**chunks[0]["choices"][0], "undeclared": 1}]})
