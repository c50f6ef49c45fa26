"""Turning a step's logits into tokens: the rows that ask for it processed first (penalties, logit bias,
min_tokens), then greedy rows in one argmax, the rest with temperature, top-k and top-p, each request drawing
from its own generator when it gave a seed; and the log-probabilities of the tokens drawn.

The engine processes logits from each sequence's state on the device (sampler_state.py); `process_logits` here,
which rebuilds every row from its whole history, is the definition it matches (and what `sample` runs when
given histories)."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lorad.daemon.engine.request import MAX_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class History:
    """What a row's logits processing reads: its prompt and the tokens it generated so far, and the token ids
    banned while it is under min_tokens (EOS and its stop token ids)."""

    prompt: list[int]
    output: list[int]
    banned: tuple[int, ...] = ()


class Draws:
    """A seeded request's random stream: its seed and how many tokens it has drawn. Draw i of a row reads the
    uniforms hash(seed, i, token id) (`_uniforms`): integer arithmetic, the same on every device, so a seed gives the
    same draws wherever the logits agree, and no generator state lives on a device."""

    __slots__ = ("seed", "count")

    def __init__(self, seed: int):
        self.seed, self.count = seed % 2**64, 0

    def take(self) -> tuple[int, int]:
        """(seed as a signed 64-bit integer, this draw's index); the next draw gets the next index."""
        index, self.count = self.count, self.count + 1
        return self.seed - 2**64 if self.seed >= 2**63 else self.seed, index


DRAW_ELEMENTS = 1 << 22  # logits a `draw` takes at once: its int64 and sort temporaries stay ~100-200 MB
_UNSEEDED = random.Random(int.from_bytes(os.urandom(8), "little"))  # unseeded requests' draws: a fresh seed each


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[Draws | None],
           histories: list[History | None] | None = None, queued: Callable[[], None] | None = None) -> list[int | None]:
    """logits: [N, vocab] float32 -> N token ids; None for a row whose sampling failed (no finite logit: its request
    alone ends with an error, the step's other rows go on). histories: per row, for the rows whose params process
    their logits (the others may be None); the logits of those rows are changed in place. generators as in
    `choose`; one copy of the tokens to the host. queued: called once the tokens' work is queued on the device,
    before the host waits for it."""
    if histories is not None:
        with torch.inference_mode():  # the forward's logits are inference tensors: changed in place in this mode
            process_logits(logits, params, histories)
    chosen = choose(logits, params, generators)
    if queued is not None:
        queued()
    out = chosen.tolist()
    failed = [row for row, token in enumerate(out) if token < 0]
    if failed:
        log.warning("sampling failed for %d row(s): no finite logit", len(failed))
    return [None if token < 0 else token for token in out]


def choose(logits: torch.Tensor, params: list[SamplingParams], generators: list[Draws | None]) -> torch.Tensor:
    """Each row's token on the logits' device, int64 [N], without waiting for it: the argmax of a greedy row, a draw
    (`draw`, all such rows together) for the others; -1 for a row whose draw failed. generators: each row's Draws (a
    seeded request's), None for the others; rows of one Draws take its draws in order."""
    tokens = logits.argmax(dim=-1)
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if rows:
        keys = [generators[row].take() if generators[row] is not None else (_UNSEEDED.getrandbits(63), 0) for row in rows]
        step = max(1, DRAW_ELEMENTS // logits.shape[1])  # rows a draw: its temporaries (sorts, hashes) stay bounded
        for first in range(0, len(rows), step):
            part = rows[first : first + step]
            index = to_device(torch.tensor(part), logits.device)
            drawn = draw(logits.index_select(0, index), [params[row] for row in part], keys[first : first + step])
            tokens.index_copy_(0, index, drawn)
    return tokens


def draw(logits: torch.Tensor, params: list[SamplingParams], keys: list[tuple[int, int]]) -> torch.Tensor:
    """One token a row from softmax(logits / temperature) cut to its top_k tokens, then to the smallest set of most
    likely tokens whose mass reaches top_p (the most likely always kept), by the Gumbel-max trick: the argmax of the
    cut logits over the temperature plus -log(-log(u)), u the row's uniforms for key (seed, draw index). logits:
    [R, vocab] float32 -> int64 [R] on its device; -1 for a row with no finite logit."""
    vocab, device = logits.shape[1], logits.device
    scaled = logits / to_device(torch.tensor([[p.temperature] for p in params], dtype=logits.dtype), device)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        kth = scaled.topk(max(top_k), dim=-1).values.gather(1, to_device(torch.tensor([[max(k, 1) - 1] for k in top_k]), device))
        cut = to_device(torch.tensor([[k > 0] for k in top_k]), device)
        scaled = scaled.masked_fill(cut & (scaled < kth), float("-inf"))
    nucleus = [row for row, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        index = to_device(torch.tensor(nucleus), device)
        part = scaled.index_select(0, index)
        sorted_probs, order = torch.softmax(part, dim=-1).sort(dim=-1, descending=True)
        top_p = to_device(torch.tensor([[params[row].top_p] for row in nucleus], dtype=sorted_probs.dtype), device)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        part = part.masked_fill(torch.zeros_like(outside).scatter_(1, order, outside), float("-inf"))
        scaled = scaled.index_copy(0, index, part)
    uniforms = _uniforms(to_device(torch.tensor(keys, dtype=torch.int64), device), vocab)
    tokens = (scaled - torch.log(-torch.log(uniforms))).argmax(dim=-1)
    valid = torch.isfinite(scaled).any(dim=-1) & ~torch.isnan(scaled).any(dim=-1)
    return torch.where(valid, tokens, torch.full_like(tokens, -1))


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (a murmur3-style finalizer) on int64 tensors holding values below 2^32: every
    product stays below 2^59, so it is exact on every device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def _uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys: int64 [R, 2] (seed, draw index) -> float32 [R, vocab] uniforms in (0, 1), 23 bits each, a function of
    (seed, index, token id) alone."""
    seed, index = keys[:, 0], keys[:, 1]
    row = _mix32(_mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32)) ^ (index & _MASK32))
    row = _mix32(row ^ ((index >> 32) & _MASK32))
    tokens = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _mix32((row[:, None] + tokens[None, :] * 0x9E3779B1) & _MASK32)  # a Weyl sequence from the row's key, mixed
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))  # exact in float32: 23 bits and a half


def make_generator(p: SamplingParams, choice: int = 0) -> Draws | None:
    """The random stream of a request's choice `choice` (GenerationRequest.n): seeded with seed + choice, so the set
    of choices repeats with the seed and its choices are distinct draws; None (a fresh seed each draw) without a
    seed."""
    if p.greedy or p.seed is None:
        return None
    return Draws(p.seed if choice == 0 else p.seed + choice)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the `logprobs` most likely tokens' (id, log-probability), best
    first, under the distribution it was drawn from: the processed logits over the temperature (1 for greedy)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
    """For the rows whose params ask for logprobs (None for the others), from the logits sample() read (processed
    in place): one log_softmax, gather and top-k over those rows, one copy to the host for the step."""
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return [None] * len(params)
    picked = [tokens[row] if tokens[row] is not None else 0 for row in rows]  # a failed row's value is not used
    chosen, top_values, top_ids = logprob_tensors(logits, params, rows, to_device(torch.tensor(picked), logits.device))
    return token_logprobs(params, rows, chosen.tolist(), top_values.tolist(), top_ids.tolist())


def logprob_tensors(logits: torch.Tensor, params: list[SamplingParams], rows: list[int],
                    picked: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """On the logits' device, without waiting for it, for the rows `rows` of logits [N, vocab] and their drawn
    tokens picked [len(rows)] int64: the tokens' log-probabilities [R] (None when picked is), and the k most likely
    ones' [R, k] and their ids [R, k], k the most any of the rows asks for."""
    device = logits.device
    whole = rows == list(range(logits.shape[0]))
    selected = logits if whole else logits.index_select(0, to_device(torch.tensor(rows), device))
    temperatures = [params[row].temperature or 1.0 for row in rows]
    if any(t != 1.0 for t in temperatures):
        selected = selected.float() / to_device(torch.tensor(temperatures, dtype=torch.float32), device)[:, None]
    log_probs = torch.log_softmax(selected.float(), dim=-1)
    chosen = None if picked is None else log_probs.gather(1, picked[:, None])[:, 0]
    k = max(params[row].logprobs for row in rows)
    top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
    return chosen, top_values, top_ids


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device; on cuda from pinned memory, without waiting: a copy from pageable memory
    waits for the work queued before it (in overlapped decode, the step in flight)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def token_logprobs(params: list[SamplingParams], rows: list[int], chosen: list[float], top_values: list[list[float]],
                   top_ids: list[list[int]]) -> list[TokenLogprob | None]:
    """logprob_tensors' values, read on the host -> a TokenLogprob for each of the rows, None for the others."""
    out: list[TokenLogprob | None] = [None] * len(params)
    for i, row in enumerate(rows):
        want = params[row].logprobs
        out[row] = TokenLogprob(chosen[i], tuple(zip(top_ids[i][:want], top_values[i][:want])))
    return out


class LogprobCopies:
    """Overlapped decode's logprobs: computed on the device after the step's tokens, copied without waiting into
    pinned host buffers (two: the step in flight's and the one launched after it, as the engine's token buffers),
    read once the step's tokens are."""

    def __init__(self, max_rows: int, pin: bool):
        size = max_rows * (MAX_LOGPROBS + 1)  # each row's chosen log-probability and its top ones
        self._values = [torch.zeros(size, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._ids = [torch.zeros(max_rows * MAX_LOGPROBS, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor,
               argmax: bool = False) -> PendingLogprobs | None:
        """For the rows of logits [N, vocab] that ask for logprobs, of their drawn tokens [N] on the device; None
        when no row asks. argmax: the tokens are the logits' argmax, so a drawn token's log-probability is the
        first of the top ones (log_softmax keeps the order): not gathered apart when a row asks for top ones."""
        rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        k = max(params[row].logprobs for row in rows)
        if argmax and k:
            picked = None
        else:
            picked = tokens if len(rows) == len(params) else tokens.index_select(0, to_device(torch.tensor(rows), tokens.device))
        chosen, top_values, top_ids = logprob_tensors(logits, params, rows, picked)
        count, columns = len(rows), k + (chosen is not None)
        values = self._values[self._turn][: count * columns].view(count, columns)  # contiguous: copied without waiting
        ids = self._ids[self._turn][: count * k].view(count, k)
        self._turn ^= 1
        values.copy_(top_values if chosen is None else torch.cat([chosen[:, None], top_values], dim=1), non_blocking=True)
        ids.copy_(top_ids, non_blocking=True)
        return PendingLogprobs(params, rows, values, ids)


@dataclass(frozen=True)
class PendingLogprobs:
    """A step's logprobs on their way to the host (LogprobCopies.launch): `read` once the copy is done."""

    params: list[SamplingParams]
    rows: list[int]
    # float32 on the host: [R, k + 1], the drawn token's then the top k; or [R, k], the top k alone, the drawn
    # token's being the first of them (LogprobCopies.launch with argmax)
    values: torch.Tensor
    ids: torch.Tensor  # [R, k] int64 on the host

    def read(self) -> list[TokenLogprob | None]:
        values = self.values.tolist()
        first = self.values.shape[1] - self.ids.shape[1]  # 1: the drawn token's apart
        return token_logprobs(self.params, self.rows, [row[0] for row in values], [row[first:] for row in values],
                              self.ids.tolist())


def process_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[History | None]) -> None:
    """In place, for the rows whose params ask for it (SamplingParams.processes_logits), in this order:
    min_tokens (banned ids to -inf while the output is shorter), logit_bias (added), repetition_penalty (HF:
    a prompt or output token's logit divided by it when positive, multiplied when not), frequency and
    presence penalties (OpenAI: minus frequency x count and presence x [count > 0] over the output). Each
    step is one batched op over those rows, whatever their number."""
    rows = [row for row, p in enumerate(params) if p.processes_logits]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    index = torch.tensor(rows, device=device)
    chosen = [params[row] for row in rows]
    seen = [histories[row] for row in rows]
    block = logits.index_select(0, index)

    banned = [(i, token) for i, (p, history) in enumerate(zip(chosen, seen))
              if len(history.output) < p.min_tokens for token in history.banned]
    if banned:
        at = torch.tensor(banned, device=device).T
        block[at[0], at[1]] = float("-inf")
    bias = [(i, token, value) for i, p in enumerate(chosen) for token, value in p.logit_bias]
    if bias:
        at = torch.tensor([(i, token) for i, token, _ in bias], device=device).T
        block.index_put_((at[0], at[1]), torch.tensor([v for *_, v in bias], dtype=block.dtype, device=device),
                         accumulate=True)
    if any(p.repetition_penalty != 1 for p in chosen):
        ids = padded_ids([history.prompt + history.output for history in seen], vocab, device)
        present = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        present.scatter_(1, ids, True)
        present = present[:, :vocab]
        penalty = torch.tensor([p.repetition_penalty for p in chosen], dtype=block.dtype, device=device)[:, None]
        block = torch.where(present, torch.where(block > 0, block / penalty, block * penalty), block)
    if any(p.frequency_penalty or p.presence_penalty for p in chosen):
        ids = padded_ids([history.output for history in seen], vocab, device)
        counts = torch.zeros(len(rows), vocab + 1, dtype=block.dtype, device=device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=block.dtype))
        counts = counts[:, :vocab]
        frequency = torch.tensor([p.frequency_penalty for p in chosen], dtype=block.dtype, device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in chosen], dtype=block.dtype, device=device)[:, None]
        block = block - frequency * counts - presence * (counts > 0).to(block.dtype)
    logits.index_copy_(0, index, block)


def padded_ids(sequences: list[list[int]], pad: int, device) -> torch.Tensor:
    """int64 [rows, longest] of token ids, padded with `pad` (the vocabulary size: the callers' tables have
    one column more, dropped after the scatter)."""
    longest = max(1, max(len(ids) for ids in sequences))
    table = torch.full((len(sequences), longest), pad, dtype=torch.long)
    for row, ids in enumerate(sequences):
        if ids:
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return table.to(device)
