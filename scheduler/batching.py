"""Iteration-level continuous batching: which sequences run in the next step, and how many of their
tokens.

Every step, running sequences go first (decodes take one token, unfinished prompts take the next
chunk), then waiting ones join in arrival order while the token budget, the running-request cap, KV
pages and adapter residency allow. When KV runs out, the newest running sequence is preempted: its
pages go back and it is recomputed later (prompt plus what it generated so far).
The scheduler owns no memory: `memory` and `adapters` do, behind the two small protocols below.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Memory(Protocol):
    def grow(self, blocks: list, num_tokens: int) -> bool: ...  # make room for num_tokens positions
    def release(self, blocks: list) -> None: ...


class Adapters(Protocol):
    def acquire(self, name: str | None) -> bool: ...  # resident and pinned, or False (not now)
    def release(self, name: str | None) -> None: ...


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    adapter: str | None
    num_computed: int = 0  # positions whose K and V are in the cache
    blocks: list = field(default_factory=list)  # KV blocks, owned through Memory
    preemptions: int = 0
    state: Any = None  # the engine's per-request state

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Scheduler:
    def __init__(self, max_running: int, max_batch_tokens: int, memory: Memory, adapters: Adapters):
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.memory = memory
        self.adapters = adapters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, number of its tokens to compute) pairs, running ones first."""
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            count = min(seq.num_tokens - seq.num_computed, budget)
            while not self.memory.grow(seq.blocks, seq.num_computed + count):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.append((seq, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self.adapters.acquire(seq.adapter):
                break
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self.memory.grow(seq.blocks, count):
                self.adapters.release(seq.adapter)
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, count))
            budget -= count
        return plan

    def preempt(self, seq: Sequence) -> None:
        log.info("preempt request=%s tokens=%d", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self.memory.release(seq.blocks)
        self.adapters.release(seq.adapter)
        seq.num_computed = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes a sequence out (finished or aborted), returning what it holds."""
        if seq in self.running:
            self.running.remove(seq)
            self.memory.release(seq.blocks)
            self.adapters.release(seq.adapter)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.memory.release(seq.blocks)
