"""Each running sequence's logits-processing state on the device, kept up to date as it generates, so that a step
never rebuilds it from the token history: slot-indexed tables of its settings (penalties, logit bias, the ids that
min_tokens bans), its tokens (prompt, then output) and, for frequency and presence penalties, the counts of its
generated tokens over the vocabulary.

A step gathers its rows' slots with one small index and processes them all in one launch (`process`); after
sampling it appends its tokens and counts them on the device, in one more (`advance`): gpu_ops/logits.py's kernels on
cuda, their torch references elsewhere. Nothing waits for the device, so a decode step with such rows can overlap the
next. The penalties only touch the tokens a row holds, so a
step reads and writes [rows, tokens held] entries of the logits, never [rows, vocab]. sampler.py's
`process_logits`, which reads the whole history, is the reference this matches exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from lorad.daemon.engine.request import MAX_LOGIT_BIAS, SamplingParams
from lorad.daemon.engine.sampler import History, to_device
from lorad.gpu_ops.logits import advance_rows, advance_rows_ref, process_rows, process_rows_ref

log = logging.getLogger(__name__)

FIRST_SLOTS = 8  # slots of the first tables; they double when full
FIRST_TOKENS = 256  # tokens a slot holds at first; doubled for the longest sequence


@dataclass(frozen=True)
class ProcessedRows:
    """What `process` did to one step's logits, for `advance` once the step's tokens are drawn."""

    rows: torch.Tensor | None  # [R] int64 on the device: the processed rows of the step's logits; None: all, in order
    slots: torch.Tensor  # [R] int64 on the device: their slots
    positions: torch.Tensor  # [R] int64 on the device: where each row's next token goes in its token list
    host_slots: list[int]


class SamplerState:
    """Slots of logits-processing state, one per sequence that processes its logits (SamplingParams.processes_logits),
    keyed by whatever the caller names its sequences with. The tables are allocated at the first `admit` and grow by
    doubling: slots x (tokens x 8 + about 6 KB) bytes for the token lists, bias and bans, and, once a sequence asks for a
    frequency or presence penalty, slots x vocab x 4 bytes of counts (float32, as the penalties are computed): 64
    slots of a 256k vocabulary hold 64 MiB of counts, 64 slots of 8192 tokens 4 MiB of token lists (and, with the
    kernels, 2 MiB of the process kernel's scratch); all outside the page pool.

    A slot whose sequence has no frequency or presence penalty still has a row of counts, only ever read as
    0 x count: finite, so without effect. `advance` must follow each `process`, once: it is what moves a slot's
    length on."""

    def __init__(self, vocab_size: int, device: torch.device, max_banned: int, kernels: bool | None = None):
        """kernels: a step's processing and advance each in one Triton launch (gpu_ops/logits.py); by default on
        cuda only, the torch references elsewhere."""
        self.vocab_size, self.device, self.max_banned = vocab_size, device, max_banned
        self.kernels = device.type == "cuda" if kernels is None else kernels
        self._process, self._advance = (process_rows, advance_rows) if self.kernels else (process_rows_ref, advance_rows_ref)
        self._slots: dict[Hashable, int] = {}
        self._free: list[int] = []
        # By slot, on the host: its params, how many ids min_tokens bans (0: none can be), its prompt's length and its
        # tokens' (what `advance` has appended so far, known without reading the device).
        self._params: list[SamplingParams | None] = []
        self._banned: list[int] = []
        self._prompt_lens: list[int] = []
        self._lengths: list[int] = []
        self.capacity = 0
        self.penalties: torch.Tensor | None = None  # [slots, 3] float32: repetition, frequency, presence
        self.bias_ids: torch.Tensor | None = None  # [slots, MAX_LOGIT_BIAS] int64, padded with token 0 ...
        self.bias_values: torch.Tensor | None = None  # [slots, MAX_LOGIT_BIAS] float32 ... and a bias of +0.0
        self.banned: torch.Tensor | None = None  # [slots, max_banned] int64, padded with the row's first id
        self.tokens: torch.Tensor | None = None  # [slots, width] int64: prompt then output, padded with its first token
        self.counts: torch.Tensor | None = None  # [slots, vocab] float32: how often each token was generated
        self.scratch: torch.Tensor | None = None  # [slots, width] float32: the kernel's penalized logits, as tokens

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[Hashable]:
        return list(self._slots)

    def slot(self, key: Hashable) -> int:
        return self._slots[key]

    # ---- slots --------------------------------------------------------------------------------------

    @torch.inference_mode()  # the tables are inference tensors, written where the forward's logits are read
    def admit(self, entries: Iterable[tuple[Hashable, SamplingParams, History]]) -> list[int]:
        """Gives each key a slot filled from its params and history (the prompt and the output so far): the slow
        path, once per sequence (and again after a preemption gave its slot back), in a few ops for all of them."""
        entries = list(entries)
        if not entries:
            return []
        if any(key in self._slots for key, _, _ in entries):
            raise ValueError("a sequence already holds a sampler slot")
        if any(len(history.banned) > self.max_banned for _, _, history in entries):
            raise ValueError(f"more banned ids than the sampler state's {self.max_banned}")
        if any(not history.prompt for _, _, history in entries):
            raise ValueError("an empty prompt has no sampler state")
        lists = [history.prompt + history.output for _, _, history in entries]
        self._reserve(len(self._slots) + len(entries), max(len(tokens) for tokens in lists) + 1,
                      self.counts is not None or any(_uses_counts(p) for _, p, _ in entries))
        slots = [self._take(key) for key, _, _ in entries]
        n, width = len(entries), self.tokens.shape[1]
        penalties = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for _, p, _ in entries],
                                 dtype=torch.float32)
        bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.long)
        bias_values = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.float32)
        banned = torch.zeros(n, self.max_banned, dtype=torch.long)
        tokens = torch.empty(n, width, dtype=torch.long)
        for i, (slot, (_, p, history), held) in enumerate(zip(slots, entries, lists)):
            if p.logit_bias:
                bias_ids[i, : len(p.logit_bias)] = torch.tensor([token for token, _ in p.logit_bias])
                bias_values[i, : len(p.logit_bias)] = torch.tensor([value for _, value in p.logit_bias], dtype=torch.float32)
            # Padded with a token of the row: a gather and scatter over the padding then reads and writes that token
            # exactly as over the real entry, so duplicates agree.
            if history.banned:
                banned[i] = history.banned[0]
                banned[i, : len(history.banned)] = torch.tensor(history.banned)
            tokens[i] = held[0]
            tokens[i, : len(held)] = torch.tensor(held)
            self._params[slot] = p
            self._banned[slot] = len(history.banned) if p.min_tokens else 0
            self._prompt_lens[slot], self._lengths[slot] = len(history.prompt), len(held)
        device = self.device
        index = to_device(torch.tensor(slots), device)
        for table, rows in ((self.penalties, penalties), (self.bias_ids, bias_ids), (self.bias_values, bias_values),
                            (self.banned, banned), (self.tokens, tokens)):
            table.index_copy_(0, index, to_device(rows, device))
        if self.counts is not None:
            counts = torch.zeros(n, self.vocab_size, dtype=torch.float32)
            for i, (_, _, history) in enumerate(entries):
                if history.output:
                    counts[i].index_put_((torch.tensor(history.output),), torch.tensor(1.0), accumulate=True)
            self.counts.index_copy_(0, index, to_device(counts, device))
        return slots

    @torch.inference_mode()
    def fork(self, parent: Hashable, child: Hashable) -> int:
        """A slot for `child` holding a copy of `parent`'s state (a sequence forked after a shared prefill)."""
        if child in self._slots:
            raise ValueError("a sequence already holds a sampler slot")
        self._reserve(len(self._slots) + 1, 0, False)
        source = self._slots[parent]
        slot = self._take(child)
        for column in (self._params, self._banned, self._prompt_lens, self._lengths):
            column[slot] = column[source]
        for table in (self.penalties, self.bias_ids, self.bias_values, self.banned, self.tokens, self.counts):
            if table is not None:
                table[slot] = table[source]
        return slot

    def release(self, key: Hashable) -> None:
        """Frees the key's slot, if it holds one. A step still in flight may write to the slot afterwards (a row
        computed past its sequence's end): harmless, as `admit` and `fork` overwrite all of a slot they give, after
        that step in stream order."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._params[slot] = None
            self._free.append(slot)

    def _take(self, key: Hashable) -> int:
        slot = self._free.pop()
        self._slots[key] = slot
        return slot

    def _reserve(self, slots: int, tokens: int, counts: bool) -> None:
        """Room for `slots` slots of `tokens` tokens each, and the counts table if asked for."""
        capacity = self.capacity
        while capacity < slots:
            capacity = max(FIRST_SLOTS, 2 * capacity)
        width = 0 if self.tokens is None else self.tokens.shape[1]
        while width < tokens:
            width = max(FIRST_TOKENS, 2 * width)
        device, old, changed = self.device, self.capacity, False
        if capacity != old:
            self.penalties = _grown(self.penalties, (capacity, 3), torch.float32, device)
            self.bias_ids = _grown(self.bias_ids, (capacity, MAX_LOGIT_BIAS), torch.long, device)
            self.bias_values = _grown(self.bias_values, (capacity, MAX_LOGIT_BIAS), torch.float32, device)
            self.banned = _grown(self.banned, (capacity, self.max_banned), torch.long, device)
            if self.counts is not None:
                self.counts = _grown(self.counts, (capacity, self.vocab_size), torch.float32, device)
            for column, fill in ((self._params, None), (self._banned, 0), (self._prompt_lens, 0), (self._lengths, 0)):
                column += [fill] * (capacity - old)
            self._free += range(capacity - 1, old - 1, -1)  # the lowest slot is taken first
            self.capacity, changed = capacity, True
        if capacity != old or self.tokens is None or width != self.tokens.shape[1]:
            grown = torch.zeros(capacity, width, dtype=torch.long, device=device)
            if self.tokens is not None:
                rows, held = self.tokens.shape
                grown[:rows, :held] = self.tokens
                grown[:rows, held:] = self.tokens[:, :1]  # each row's padding: its first token
            self.tokens, changed = grown, True
            if self.kernels:
                self.scratch = torch.empty(capacity, width, dtype=torch.float32, device=device)
        if counts and self.counts is None:
            self.counts, changed = torch.zeros(capacity, self.vocab_size, dtype=torch.float32, device=device), True
        if changed:
            log.info("sampler state slots=%d tokens=%d counts=%s", capacity, width, "on" if self.counts is not None else "off")

    # ---- a step ------------------------------------------------------------------------------------

    @torch.inference_mode()  # the forward's logits are inference tensors: changed in place in this mode
    def process(self, logits: torch.Tensor, rows: list[int], keys: list[Hashable]) -> ProcessedRows:
        """In place, the rows `rows` of logits [N, vocab] float32, of the sequences `keys` (each holding a slot),
        as process_logits does with their histories, in the same order: min_tokens bans, logit bias, repetition
        penalty, frequency and presence penalties. One launch whatever the number of rows, over [rows, bias],
        [rows, bans] and [rows, tokens held] entries; one copy to the device (from pinned memory, without waiting)."""
        if logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits of {logits.shape[1]} tokens, the sampler state's vocabulary is {self.vocab_size}")
        slots = [self._slots[key] for key in keys]
        params = [self._params[slot] for slot in slots]
        lengths = [self._lengths[slot] for slot in slots]
        under = [int(self._banned[slot] > 0 and length - self._prompt_lens[slot] < p.min_tokens)
                 for slot, length, p in zip(slots, lengths, params)]
        self._reserve(self.capacity, max(lengths) + 1, False)  # room for the token this step appends
        whole = rows == list(range(logits.shape[0]))
        index = to_device(torch.tensor(([] if whole else rows) + slots + lengths + under), self.device).view(-1, len(slots))
        row_index = None if whole else index[0]
        slot_index, positions, banning = index[-3], index[-2], index[-1]
        banned = max((self._banned[slot] for slot, u in zip(slots, under) if u), default=0)
        repetition = any(p.repetition_penalty != 1 for p in params)
        counted = any(_uses_counts(p) for p in params)
        # Only the tokens a row holds are penalized: the others have no repetition and a count of 0.
        self._process(logits, row_index, slot_index, banning, self.penalties, self.bias_ids, self.bias_values, self.banned,
                      self.tokens, self.counts if counted else None, self.scratch,
                      bias_width=max(len(p.logit_bias) for p in params), banned_width=banned,
                      held_width=max(lengths) if repetition or counted else 0, repetition=repetition)
        return ProcessedRows(row_index, slot_index, positions, slots)

    @torch.inference_mode()
    def advance(self, processed: ProcessedRows, tokens: torch.Tensor) -> None:
        """Appends the step's tokens ([N] int64 on the device, one per row of its logits) to the processed rows'
        state, and counts them, on the device. Rows whose token the caller drops must give their slot back."""
        self._advance(self.tokens, self.counts, processed.rows, processed.slots, processed.positions,
                      tokens.to(device=self.device, dtype=torch.long))
        for slot in processed.host_slots:
            self._lengths[slot] += 1


def _uses_counts(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty)


def _grown(table: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    grown = torch.zeros(shape, dtype=dtype, device=device)
    if table is not None:
        grown[: table.shape[0]] = table
    return grown
