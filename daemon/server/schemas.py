"""The bodies of /v1/completions and /v1/chat/completions: requests as pydantic models (each field's type, bounds
and meaning said once; anything else refused as a 400 naming the field), checked into a `Completion` for the
engine, and the answers' shapes as TypedDicts that api.py fills and serializes as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from typing_extensions import NotRequired, TypedDict  # typing's TypedDict is not pydantic's before Python 3.12

from lorad.config import ServerConfig
from lorad.daemon.engine.chat_template import ROLES
from lorad.daemon.engine.request import (
    MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams,
)
from lorad.errors import BadRequest, clip

MAX_CHAT_MESSAGES = 1024
MAX_PROMPTS = 64  # prompts in one /v1/completions request
VALUES_BESIDE_PROMPTS = 65_536  # JSON values a request holds besides its prompts' token ids, at most (generously)

MAX_N = ServerConfig.max_n  # choices per prompt, unless the daemon is given another (--max-n)
MAX_CHOICES = 256  # prompts x n
MAX_STOPS = 16  # as SamplingParams holds them
MAX_TEMPERATURE = 100

_ENGINE = SamplingParams()  # the engine's defaults are the API's


def max_body_values(max_model_len: int) -> int:
    """The most JSON values a body lorad serves can hold: MAX_PROMPTS prompts of token ids that each fit the
    context, and VALUES_BESIDE_PROMPTS for the rest (up to 1024 chat messages, the stops, the logit bias...)."""
    return MAX_PROMPTS * max_model_len + VALUES_BESIDE_PROMPTS


# --- requests -------------------------------------------------------------------------------------------
# A field's `description` says what it must be: a value pydantic refuses (or a validator of the field, with a
# bare ValueError()) is answered "{field} must be {description} (got {value})". A validator that refuses in
# words of its own, ValueError("..."), names the field itself. The bounds are the engine's (request.py's
# SamplingParams checks them again for every caller): tests/daemon/server/test_schemas.py holds the two equal.


class _Body(BaseModel):
    # strict: no "5" for 5, no 2.0 for 2, no 1 for true; unknown fields refused, as OpenAI's API refuses them.
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, body):
        # OpenAI's clients send null for a field they leave unset.
        if isinstance(body, dict):
            return {name: value for name, value in body.items() if value is not None}
        return body


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="true or false")


TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
BiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]  # JSON's keys are strings: OpenAI's "50256": -100
StopString = Annotated[str, Field(min_length=1)]


class _Generation(_Body):
    """The fields both endpoints share: the model, sampling, stops, streaming and n."""

    model: str = Field(description="the base model's name or an adapter's")
    max_tokens: int = Field(_ENGINE.max_tokens, ge=1, description="a positive integer")
    temperature: float = Field(_ENGINE.temperature, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                               description=f"0 (greedy) or a number from {MIN_TEMPERATURE} to {MAX_TEMPERATURE}")
    top_p: float = Field(_ENGINE.top_p, ge=MIN_TOP_P, le=1, allow_inf_nan=False,
                         description=f"a number from {MIN_TOP_P} to 1")
    top_k: int = Field(_ENGINE.top_k, ge=-1, description="an integer >= -1 (-1 or 0: off)")
    seed: int | None = Field(_ENGINE.seed, ge=-(2**63), le=2**64 - 1, description="an integer from -2**63 to 2**64 - 1")
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOPS)]] = Field(
        list(_ENGINE.stop), description=f"a non-empty string or a list of at most {MAX_STOPS} stop strings, none empty")
    stop_token_ids: list[TokenId] = Field(list(_ENGINE.stop_token_ids), max_length=MAX_STOP_TOKEN_IDS,
                                          description=f"a list of at most {MAX_STOP_TOKEN_IDS} token ids")
    ignore_eos: bool = Field(_ENGINE.ignore_eos, description="true or false")
    presence_penalty: float = Field(_ENGINE.presence_penalty, ge=-2, le=2, allow_inf_nan=False,
                                    description="a number in [-2, 2]")
    frequency_penalty: float = Field(_ENGINE.frequency_penalty, ge=-2, le=2, allow_inf_nan=False,
                                     description="a number in [-2, 2]")
    repetition_penalty: float = Field(_ENGINE.repetition_penalty, gt=0, le=10, allow_inf_nan=False,
                                      description="a number in (0, 10]")
    logit_bias: dict[BiasKey, Bias] = Field(
        dict(_ENGINE.logit_bias), max_length=MAX_LOGIT_BIAS,
        description=f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings) to biases in [-100, 100]")
    min_tokens: int = Field(_ENGINE.min_tokens, ge=0, description="an integer >= 0")
    stream: bool = Field(False, description="true or false")
    stream_options: StreamOptions = Field(default_factory=StreamOptions,
                                          description='an object with only "include_usage"')
    return_token_ids: bool = Field(False, description="true or false")
    n: int = Field(1, description=f"an integer from 1 to {MAX_N} (--max-n)")
    user: str | None = Field(None, description="a string")

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, model):
        if model is None or model == "":
            raise ValueError("model is required: the base model's name or an adapter's")
        if not isinstance(model, str):
            raise ValueError("model must be a string, the base model's name or an adapter's, "
                             f"not {type(model).__name__}")
        return model

    @field_validator("n", mode="before")
    @classmethod
    def _n(cls, n, info: ValidationInfo):
        max_n = (info.context or {}).get("max_n", MAX_N)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
            raise ValueError(f"n must be an integer from 1 to {max_n}")
        return n

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, temperature):
        if 0 < temperature < MIN_TEMPERATURE:  # the sampler's float32 logits over it would overflow
            raise ValueError()
        return temperature

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters (which check min_tokens against max_tokens)."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            logprobs=logprobs,
        )


Prompt = Union[str, list[int], list[Union[str, list[int]]]]


class CompletionRequest(_Generation):
    prompt: Prompt = Field(description="a string, a list of token ids, or a list of those")
    echo: bool = Field(False, description="true or false")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"an integer from 0 to {MAX_LOGPROBS}")
    suffix: Any = Field(None, description="not supported")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, suffix):
        raise ValueError("suffix is not supported (lorad does not fill in the middle)")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, one choice each: a batch as sent, a lone prompt in a list of one."""
        batch = isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int)
        return self.prompt if batch else [self.prompt]

    @model_validator(mode="after")
    def _check(self):
        prompts = self.prompts
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"prompt: {len(prompts)} prompts, more than the {MAX_PROMPTS} a request may have")
        for prompt in prompts:
            if not prompt:
                raise ValueError("prompt is empty")
            if isinstance(prompt, str):
                _check_unicode("prompt", prompt)
        if len(prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"n x prompts is {len(prompts) * self.n}, more than the {MAX_CHOICES} choices a "
                             "request may have")
        if self.logprobs is not None and self.echo:
            raise ValueError("logprobs with echo is not supported (the prompt's own logprobs are not computed)")
        return self


class TextPart(_Body):
    type: Literal["text"] = Field(description='"text" (lorad reads text parts only)')
    text: str = Field(description="a string")


class ChatMessage(_Body):
    role: Literal[ROLES] = Field(description=f"one of {', '.join(ROLES)}")
    content: Union[str, list[TextPart]] = Field(description="a string or a list of text parts {type: text, text}")
    name: str | None = Field(None, description="a string")

    def for_template(self) -> dict:
        """{role, content: str[, name]} as chat templates read it: text parts joined by newlines."""
        content = self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)
        entry = {"role": self.role, "content": content}
        if self.name is not None:
            entry["name"] = self.name
        return entry


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES,
                                        description=f"a non-empty list of at most {MAX_CHAT_MESSAGES} {{role, content}} objects")
    max_completion_tokens: int | None = Field(None, ge=1, description="a positive integer")  # OpenAI's newer name
    logprobs: bool = Field(False, description="true or false")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"an integer from 0 to {MAX_LOGPROBS}")

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        for index, message in enumerate(self.messages):
            parts = [message.content] if isinstance(message.content, str) else [part.text for part in message.content]
            for text in parts:
                _check_unicode(f"messages[{index}].content", text)
        return self


def _check_unicode(field: str, text: str) -> None:
    try:  # JSON's "\ud800" escapes give lone surrogates, which no tokenizer (nor UTF-8) takes
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{field} is not valid unicode: {error.reason}") from None


# --- the checked request ----------------------------------------------------------------------------------


@dataclass
class Completion:
    """A checked /v1/completions or /v1/chat/completions body; the prompt is still text or token ids (chat:
    None until the messages are rendered)."""

    model: str
    prompts: list[str | list[int]] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: each choice's text starts with its prompt's
    messages: list[dict] | None = None  # chat: [{role, content: str[, name]}] for the template
    max_tokens_field: str = "max_tokens"  # the field the client gave the length in, for the messages that name it

    @property
    def chat(self) -> bool:
        return self.messages is not None


def parse_completion(body, max_n: int = MAX_N) -> Completion:
    request = _validate(CompletionRequest, body, max_n)
    return Completion(request.model, request.prompts, request.sampling(request.max_tokens, request.logprobs),
                      request.stream, request.stream_options.include_usage, request.return_token_ids, request.n,
                      echo=request.echo)


def parse_chat(body, max_n: int = MAX_N) -> Completion:
    """A /v1/chat/completions body: max_completion_tokens taken over max_tokens where both are given; chat's
    logprobs (true, and top_logprobs N) as the sampler's (N top tokens)."""
    request = _validate(ChatCompletionRequest, body, max_n)
    max_tokens = request.max_completion_tokens or request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return Completion(request.model, None, request.sampling(max_tokens, logprobs), request.stream,
                      request.stream_options.include_usage, request.return_token_ids, request.n,
                      messages=[message.for_template() for message in request.messages],
                      max_tokens_field="max_completion_tokens" if request.max_completion_tokens else "max_tokens")


def _validate(schema: type[BaseModel], body, max_n: int):
    try:
        return schema.model_validate(body, context={"max_n": max_n})
    except ValidationError as error:
        raise BadRequest(_refusal(schema, error.errors(include_url=False))) from None


def _refusal(schema: type[BaseModel], errors: list[dict]) -> str:
    """One message for pydantic's errors, naming the field: unknown fields first, all of them; else the first
    error (of a union's alternatives, the one the value came furthest in)."""
    unknown = [str(error["loc"][0]) for error in errors if error["type"] == "extra_forbidden" and len(error["loc"]) == 1]
    if unknown:
        return f"unknown field(s): {', '.join(name[:64] for name in sorted(unknown)[:20])}"
    error = errors[0]
    if error["type"] == "extra_forbidden":  # inside an object of the body: messages[0]
        parent = error["loc"][:-1]
        names = sorted(str(e["loc"][-1]) for e in errors if e["type"] == "extra_forbidden" and e["loc"][:-1] == parent)
        path, _, _ = _where(schema, parent, indexed=True)
        return f"{path}: unknown field(s): {', '.join(name[:64] for name in names[:20])}"
    _, _, union_at = _where(schema, error["loc"])
    if union_at is not None:
        prefix = error["loc"][:union_at]
        error = max((e for e in errors if e["loc"][:union_at] == prefix), key=lambda e: len(e["loc"]))
        if error["type"] == "extra_forbidden":
            return _refusal(schema, [error])
    path, rule, _ = _where(schema, error["loc"])
    kind = error["type"]
    if kind == "model_type" and not path:
        return "the request body must be a JSON object"
    if kind == "value_error" and str(error["ctx"]["error"]):
        return str(error["ctx"]["error"])
    if kind == "missing":
        return f"{path} is required: {rule}"
    value = error.get("input")
    short = isinstance(value, (int, float)) or isinstance(value, str) and len(value) <= 40  # no repr of 16 MB
    got = f" (got {clip(value, 40)})" if short else ""
    return f"{path} must be {rule}{got}"


def _where(schema: type[BaseModel], loc: tuple, indexed: bool = False) -> tuple[str, str, int | None]:
    """The field an error's location names ("messages[1].content[0].type"), what that field must be, and where
    in the location a union's alternative begins (None: no union). An index is named on the way to a field
    inside the indexed item, and at the end only when `indexed`: of a list of token ids, the field is the list."""
    path, pending, rule, union_at = "", "", "", None
    model: type[BaseModel] | None = schema
    for position, part in enumerate(loc):
        if isinstance(part, int):
            pending += f"[{part}]"
        elif model is not None and part in model.model_fields:
            field = model.model_fields[part]
            path += pending + ("." if path else "") + part
            pending, rule = "", field.description or ""
            model = _model_in(field.annotation)
        elif union_at is None:  # pydantic tags the alternative it tried ('str', 'list[int]'...)
            union_at = position
    return path + pending if indexed else path, rule, union_at


def _model_in(annotation) -> type[BaseModel] | None:
    """The model a field holds, directly or in a list or union (messages: ChatMessage), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in getattr(annotation, "__args__", ()):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


# --- responses: OpenAI's shapes, as api.py builds them ------------------------------------------------------
# Plain dicts at run time (built and serialized at the cost of a dict); pydantic checks answers against them in
# the tests (TypeAdapter(Chunk).validate_python), where a key not declared here is refused.


class _Shape(TypedDict):
    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Shape):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]  # per token: {token text: logprob} of the most likely
    text_offset: list[int]  # each token's start in the choice's text


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int]  # the token text's UTF-8


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[TokenLogprob]


class CompletionChoice(_Shape):
    index: int  # prompt x n + i
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"; None until the choice's last chunk
    logprobs: CompletionLogprobs | None
    token_ids: NotRequired[list[int]]  # return_token_ids
    prompt_token_ids: NotRequired[list[int]]  # return_token_ids with several prompts: this choice's


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    token_ids: NotRequired[list[int]]
    prompt_token_ids: NotRequired[list[int]]


class Delta(_Shape):
    role: NotRequired[Literal["assistant"]]  # in each choice's first chunk
    content: str


class ChatChunkChoice(_Shape):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None
    token_ids: NotRequired[list[int]]
    prompt_token_ids: NotRequired[list[int]]


class CompletionResponse(_Shape):
    id: str
    object: Literal["text_completion", "chat.completion"]
    created: int
    model: str
    choices: list[CompletionChoice] | list[ChatChoice]
    usage: Usage
    prompt_token_ids: NotRequired[list[int]]  # return_token_ids with one prompt


class Chunk(_Shape):
    """One server-sent event of a stream; with include_usage, every chunk carries "usage": null and a last one
    with no choices carries the usage."""

    id: str
    object: Literal["text_completion", "chat.completion.chunk"]  # completions' chunks are text_completion too
    created: int
    model: str
    choices: list[CompletionChoice] | list[ChatChunkChoice]
    usage: NotRequired[Usage | None]
    prompt_token_ids: NotRequired[list[int]]  # return_token_ids with one prompt: in the first chunk
