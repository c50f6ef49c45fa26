"""What a request is, inside the engine and across its boundary: sampling parameters and the prompt
(each checked in one place, here, by the API and the engine alike), the request itself, and what the
engine reports back after each step."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from lorad.errors import BadRequest, PromptTooLong, clip

log = logging.getLogger(__name__)

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logits processing, before temperature (daemon/engine/sampler.py process_logits):
    presence_penalty: float = 0.0  # OpenAI: minus this for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the times a token was generated
    repetition_penalty: float = 1.0  # HF: logits of prompt and generated tokens divided (> 0) or multiplied by it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits
    min_tokens: int = 0  # EOS and the stop token ids are banned until this many tokens are generated
    logprobs: int | None = None  # each sampled token's logprob and this many most likely (None: off)

    def __post_init__(self):
        # A lone stop string is one stop, not its characters; lists become tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer")
        # Bounds the sampler's float32 arithmetic stays finite in: logits of at most ~1e3 over 1e-2 are 1e5, far
        # from overflow in softmax after its max is subtracted; a top_p under 1e-6 would round to 0 in float32.
        if not _real(self.temperature) or not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 100):
            raise BadRequest(f"temperature must be 0 (greedy) or a number from {MIN_TEMPERATURE} to 100")
        if not _real(self.top_p) or not MIN_TOP_P <= self.top_p <= 1:
            raise BadRequest(f"top_p must be a number from {MIN_TOP_P} to 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise BadRequest("top_k must be an integer >= -1 (-1 or 0: off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise BadRequest("seed must be an integer from -2**63 to 2**64 - 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise BadRequest("stop must be a non-empty string or a list of them")
        if len(self.stop) > 16:
            raise BadRequest("at most 16 stop strings")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise BadRequest("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _real(value) or not -2 <= value <= 2:
                raise BadRequest(f"{name} must be a number in [-2, 2]")
        if not _real(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise BadRequest("repetition_penalty must be a number in (0, 10]")
        if isinstance(self.logit_bias, dict):  # OpenAI's form: {"token id": bias}
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        elif not (isinstance(self.logit_bias, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in self.logit_bias)):
            raise BadRequest("logit_bias must be an object mapping token ids to biases")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise BadRequest(f"logit_bias: {token!r} is not a token id")
            if not _real(bias) or not -100 <= bias <= 100:
                raise BadRequest(f"logit_bias: the bias of token {token} must be a number in [-100, 100]")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):  # e.g. the keys "7" and "07"
            raise BadRequest("logit_bias: a token id is given more than once")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise BadRequest("min_tokens must be an integer >= 0")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise BadRequest(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}")
        if self.min_tokens > self.max_tokens:
            raise BadRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Are the logits changed before sampling (penalties, bias, min_tokens)?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


MIN_TEMPERATURE = 1e-2
MIN_TOP_P = 1e-6
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_LOGPROBS = 20  # OpenAI's limit of top_logprobs


def _bias_pairs(bias: dict) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias: {key!r} is not a token id") from None
        pairs.append((token, value))
    return tuple(sorted(pairs))


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_prompt(prompt_token_ids: list[int], sampling: SamplingParams, vocab_size: int, max_model_len: int,
                 max_tokens_field: str = "max_tokens") -> None:
    """Raises BadRequest unless the prompt is a non-empty list of token ids in the vocabulary and every stop
    token id is in it too, and PromptTooLong unless the prompt plus max_tokens fits the model's context (named as
    the client's `max_tokens_field`: chat's max_completion_tokens)."""
    if not prompt_token_ids:
        raise BadRequest("the prompt is empty")
    total = len(prompt_token_ids) + sampling.max_tokens
    if total > max_model_len:  # first: a cheap bound before a look at every token
        raise PromptTooLong(
            f"the prompt ({len(prompt_token_ids)} tokens) plus {max_tokens_field} ({sampling.max_tokens}) is "
            f"{total} tokens, over this model's context of {max_model_len}"
        )
    for token in prompt_token_ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise BadRequest(
                f"prompt token id {clip(token)} is out of the vocabulary: prompt token ids must be integers in "
                f"[0, {vocab_size})"
            )
    bad = next((t for t in sampling.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise BadRequest(f"stop token id {bad} is out of the vocabulary (0..{vocab_size - 1})")
    bad = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise BadRequest(f"logit_bias: token id {bad} is out of the vocabulary (0..{vocab_size - 1})")


@dataclass
class RequestOutput:
    """One step's news for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    error: str | None = None
    error_type: str | None = None  # the LoradError type of a failure the API answers as that error
    logprobs: list | None = None  # TokenLogprob per new token (daemon/engine/sampler.py), when asked for
    choice: int = 0  # which of the request's n choices this is news of (each finishes on its own)


def deliver(on_output: Callable[[RequestOutput], None] | None, output: RequestOutput) -> None:
    """Hands `output` to its request's callback: a callback that fails is logged, never the engine's failure."""
    if on_output is None:
        return
    try:
        on_output(output)
    except Exception:
        log.exception("on_output callback failed request=%s", output.request_id)


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    adapter: str | None = None  # None: the base model alone
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_output: Callable[[RequestOutput], None] | None = None
    keep_logits: bool = False  # record the logits each token was sampled from (tests)
    # Choices: n sequences from one prefill of the prompt, sharing its KV blocks; choice i draws with seed + i.
    # Outputs carry their `choice`; the request is over when every choice has finished.
    n: int = 1


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logits: list | None = None  # [vocab] float32 tensors, one per generated token, when keep_logits
    logprobs: list | None = None  # TokenLogprob per generated token, when sampling.logprobs is set
    choices: list[GenerationResult] | None = None  # every choice's result (this one first), when n > 1
