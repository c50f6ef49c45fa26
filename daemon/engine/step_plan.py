"""One step's work as the forward reads it, built once per step from the scheduler's batch (`StepPlan.build`).

The eager forward (ModelRunner.build_step), the decode CUDA graphs and the prefill CUDA graphs all read the
same plan: each sequence's new token ids, the position of the first, its adapter slot, its KV block list and
whether its last row is sampled; which sequences the CPU workers assist; and `decode`, the one place where a
step is called a decode step (every sequence adds the one token after its prompt and output so far). What
kind of step it is decides the graph that replays it, the LoRA kernels it launches (LoraBatch.decode) and
whether the engine may overlap it with the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lorad.gpu_ops.page_pool import BlockList
from lorad.scheduler.batching import Sequence


@dataclass
class StepPlan:
    tokens: list[np.ndarray]  # each sequence's new token ids (placeholders where device_tokens holds them)
    starts: np.ndarray  # int64 [n]: the position of each sequence's first new token
    slots: np.ndarray  # int64 [n]: each sequence's adapter slot in the page pool (-1: the base model alone)
    blocks: list[np.ndarray]  # each sequence's KV block list [blocks, L, 2] of page ids
    sample: np.ndarray  # bool [n]: its last row's logits are taken (its prompt is done)
    seqs: list[Sequence] = field(default_factory=list)  # the engine's sequences, in the same order
    # each sequence's BlockList, whose identity and length the graphs' block tables send only the new rows by
    # (decode_graphs.BlockStaging); empty: every list sent whole
    lists: list[BlockList] = field(default_factory=list)
    assisted: dict[Sequence, int] = field(default_factory=dict)  # CPU-assisted sequences -> their adapter id
    # the one new token of some sequences, already on the device (a step launched before the tokens of the step
    # in flight are read): [len(device_rows)] input ids for the sequences device_rows (all of them when None)
    device_tokens: torch.Tensor | None = None
    device_rows: np.ndarray | None = None
    counts: np.ndarray = field(init=False)  # int64 [n]: new tokens per sequence
    decode: bool = field(init=False)  # every sequence adds one token, and it is sampled

    def __post_init__(self):
        self.counts = np.fromiter((len(tokens) for tokens in self.tokens), dtype=np.int64, count=len(self.tokens))
        self.decode = bool((self.counts == 1).all() and self.sample.all())

    @classmethod
    def build(cls, batch: list[tuple[Sequence, int]], slot_of, assisted: dict[Sequence, int] | None = None,
              device_tokens: torch.Tensor | None = None, device_rows: np.ndarray | None = None) -> StepPlan:
        """From the scheduler's batch (each sequence and its new tokens this step); slot_of(adapter name) -> its
        slot. With device_tokens (a step launched before the one in flight has landed) each sequence of
        device_rows (every one when None) adds the one token the device holds for it, which its `tokens` do not
        have yet."""
        if device_tokens is not None and device_rows is None:
            device_rows = np.arange(len(batch))
        on_device = set() if device_rows is None else set(device_rows.tolist())
        tokens = [np.zeros(1, dtype=np.int64) if index in on_device
                  else np.asarray(seq.tokens[seq.num_computed : seq.num_computed + count], dtype=np.int64)
                  for index, (seq, count) in enumerate(batch)]
        starts = np.fromiter((seq.num_computed for seq, _ in batch), dtype=np.int64, count=len(batch))
        ends = starts + np.fromiter((count for _, count in batch), dtype=np.int64, count=len(batch))
        return cls(
            tokens=tokens,
            starts=starts,
            slots=np.fromiter((slot_of(seq.adapter) for seq, _ in batch), dtype=np.int64, count=len(batch)),
            blocks=[seq.blocks.array() for seq, _ in batch],
            sample=ends >= np.fromiter((seq.num_tokens for seq, _ in batch), dtype=np.int64, count=len(batch)),
            seqs=[seq for seq, _ in batch],
            lists=[seq.blocks for seq, _ in batch],
            assisted=assisted or {},
            device_tokens=device_tokens,
            device_rows=device_rows,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.counts.sum())

    @property
    def max_blocks(self) -> int:
        return max(len(blocks) for blocks in self.blocks)

    def first_rows(self) -> np.ndarray:
        """int64 [n]: each sequence's first row among the step's tokens."""
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]])

    def device_input_rows(self) -> np.ndarray | None:
        """int64: the rows whose input ids are device_tokens, in their order; None without device_tokens."""
        if self.device_tokens is None:
            return None
        first = self.first_rows()
        return first if self.device_rows is None else first[self.device_rows]

    @property
    def every_token_on_device(self) -> bool:
        """Every sequence's input is its one token in device_tokens (an overlapped decode step)."""
        return self.device_tokens is not None and (self.device_rows is None or len(self.device_rows) == len(self.tokens))

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences whose logits the step returns, in their order."""
        return [seq for seq, sample in zip(self.seqs, self.sample) if sample]

    def row_slots(self) -> np.ndarray:
        """int64 [num_tokens]: each row's adapter slot; -1 for the base model and for CPU-assisted rows."""
        slots = self.slots.copy()
        for index, seq in enumerate(self.seqs):
            if seq in self.assisted:
                slots[index] = -1
        return np.repeat(slots, self.counts)
