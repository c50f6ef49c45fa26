"""Turning a step's logits into tokens: the rows that ask for it processed first (penalties, logit bias,
min_tokens), then greedy rows in one argmax, the rest with temperature, top-k and top-p, each request drawing
from its own generator when it gave a seed; and the log-probabilities of the tokens drawn.

The engine processes logits from each sequence's state on the device (sampler_state.py); `process_logits` here,
which rebuilds every row from its whole history, is the definition it matches (and what `sample` runs when
given histories)."""

from __future__ import annotations

import logging
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


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[History | None] | None = None) -> list[int | None]:
    """logits: [N, vocab] float32 -> N token ids; None for a row whose sampling failed (its request alone
    ends with an error: the step's other rows go on). histories: per row, for the rows whose params process
    their logits (the others may be None); the logits of those rows are changed in place."""
    if histories is not None:
        with torch.inference_mode():  # the forward's logits are inference tensors: changed in place in this mode
            process_logits(logits, params, histories)
    tokens = logits.argmax(dim=-1)
    failed = []
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            try:
                tokens[row] = _sample_row(logits[row], p, generator)
            except (RuntimeError, ValueError) as error:  # e.g. a distribution torch.multinomial refuses
                log.warning("sampling failed for one row: %s", error)
                failed.append(row)
    out = tokens.tolist()
    for row in failed:
        out[row] = None
    return out


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # Draw on the CPU so that a seed gives the same tokens on every device.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def make_generator(p: SamplingParams, choice: int = 0) -> torch.Generator | None:
    """The generator of a request's choice `choice` (GenerationRequest.n): seeded with seed + choice, so the set
    of choices repeats with the seed and its choices are distinct draws; None (the global one) without a seed."""
    if p.greedy or p.seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(p.seed if choice == 0 else (p.seed + choice) % 2**64)
    return generator


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
