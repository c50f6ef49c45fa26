"""daemon/engine/sampler_state.py against sampler.py's process_logits, which rebuilds every row from its whole
history: exactly the same processed logits, step after step, with sequences joining, finishing, preempted (their
slot given back and admitted again from the history), forked, and the tables growing; and the overlapped decode's
logprobs (LogprobCopies) against logprobs_of."""

from __future__ import annotations

import random

import pytest
import torch
from triton_interpreter import CUDA, HAS_TRITON

from lorad.daemon.engine.request import SamplingParams
from lorad.daemon.engine.sampler import History, LogprobCopies, logprobs_of, process_logits
from lorad.daemon.engine import sampler_state
from lorad.daemon.engine.sampler_state import FIRST_SLOTS, SamplerState

VOCAB = 61
MAX_BANNED = 6


def random_params(rng: random.Random) -> SamplingParams:
    """Any mix of the controls, each often off (rows that use a table beside rows that do not), or none."""
    fields = {}
    if rng.random() < 0.5:
        fields["presence_penalty"] = rng.choice([-2.0, -0.5, 0.5, 1.5])
    if rng.random() < 0.5:
        fields["frequency_penalty"] = rng.choice([-1.0, 0.3, 2.0])
    if rng.random() < 0.5:
        fields["repetition_penalty"] = rng.choice([0.7, 1.1, 1.8])
    if rng.random() < 0.5:
        tokens = rng.sample(range(VOCAB), rng.randint(1, 8))
        fields["logit_bias"] = {str(t): rng.choice([-100, -3.5, 0.25, 7, 100]) for t in tokens}
    if rng.random() < 0.5:
        fields["min_tokens"] = rng.randint(1, 6)
    return SamplingParams(temperature=0, max_tokens=64, **fields)


class Running:
    """A sequence of the randomized test: what process_logits reads, kept by hand."""

    def __init__(self, rng: random.Random, name: int):
        self.name = name
        self.params = random_params(rng)
        self.prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        self.output = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 3]))]  # 3: resumed after a preemption
        self.banned = tuple(rng.sample(range(VOCAB), rng.randint(0, MAX_BANNED)))

    def history(self) -> History:
        return History(list(self.prompt), list(self.output), self.banned)

    def admit(self, state: SamplerState) -> None:
        if self.params.processes_logits:
            state.admit([(self, self.params, self.history())])

    def fork(self, state: SamplerState, child: Running) -> None:
        child.params, child.prompt, child.output, child.banned = self.params, self.prompt, list(self.output), self.banned
        if self.params.processes_logits:
            state.fork(self, child)


def check_step(state: SamplerState, seqs: list[Running], generator: torch.Generator) -> list[int]:
    """One step of `seqs`: the state's processed logits equal process_logits' on the whole histories exactly;
    returns the tokens drawn (at random: to reach many tokens), added to the state on the device."""
    logits = torch.randn(len(seqs), VOCAB, generator=generator) * 4
    logits[:, 5] = 0.0  # exact zeros: the repetition penalty's sign rule at its edge
    logits = logits.to(state.device)
    params = [seq.params for seq in seqs]
    want = logits.clone()
    process_logits(want, params, [seq.history() if p.processes_logits else None for seq, p in zip(seqs, params)])
    got = logits.clone()
    rows = [row for row, p in enumerate(params) if p.processes_logits]
    processed = state.process(got, rows, [seqs[row] for row in rows]) if rows else None
    assert torch.equal(got, want)
    tokens = torch.multinomial(torch.softmax(want.cpu().clamp(min=-30), -1), 1, generator=generator)[:, 0]
    if processed is not None:
        state.advance(processed, tokens.to(state.device))
    return tokens.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_incremental_state_equals_process_logits_on_the_whole_history(seed, monkeypatch):
    monkeypatch.setattr(sampler_state, "FIRST_SLOTS", 2)  # the tables grow many times over, slots and tokens
    monkeypatch.setattr(sampler_state, "FIRST_TOKENS", 4)
    run_randomized(seed, torch.device("cpu"))


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="the compiled kernels are tested by -m gpu (or triton is absent)")
@pytest.mark.parametrize("seed", range(2))
def test_state_through_the_kernels_equals_process_logits(seed, monkeypatch):
    """The same, with process and advance in gpu_ops/logits.py's kernels (Triton's interpreter)."""
    monkeypatch.setattr(sampler_state, "FIRST_SLOTS", 2)
    monkeypatch.setattr(sampler_state, "FIRST_TOKENS", 4)
    run_randomized(seed, torch.device("cpu"), kernels=True)


def run_randomized(seed: int, device: torch.device, kernels: bool | None = None) -> None:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    state = SamplerState(VOCAB, device, MAX_BANNED, kernels=kernels)
    assert state.kernels == (kernels if kernels is not None else device.type == "cuda")
    running: list[Running] = []
    names = iter(range(10**6))
    steps = 0
    for _ in range(60):
        # Between steps: some join, some finish, some are preempted (their slot given back, admitted again from
        # the history when they resume), some fork.
        for seq in [Running(rng, next(names)) for _ in range(rng.randint(0, 4))]:
            seq.admit(state)
            running.append(seq)
        for seq in rng.sample(running, min(len(running), rng.randint(0, 2))):
            running.remove(seq)
            state.release(seq)
        for seq in rng.sample(running, min(len(running), rng.randint(0, 1))):
            state.release(seq)
            seq.admit(state)
        if running and rng.random() < 0.3:
            child = Running(rng, next(names))
            rng.choice(running).fork(state, child)
            running.append(child)
        if not running:
            continue
        order = rng.sample(running, len(running))  # rows in any order, slots in any order
        for seq, token in zip(order, check_step(state, order, generator)):
            seq.output.append(token)
        steps += 1
    assert steps > 40 and state.capacity >= 16 and state.tokens.shape[1] >= 64  # they grew while holding sequences
    assert len(state) == sum(seq.params.processes_logits for seq in running)
    assert state.counts is not None and state.tokens.shape[1] >= 32


def test_bans_stop_at_min_tokens_and_rows_processed_in_place_where_all_are():
    state = SamplerState(VOCAB, torch.device("cpu"), MAX_BANNED)
    params = SamplingParams(temperature=0, min_tokens=2, logit_bias={"3": 100})
    state.admit([("a", params, History([1], [], banned=(3, 4)))])
    for generated in range(4):
        logits = torch.zeros(1, VOCAB)
        processed = state.process(logits, [0], ["a"])
        assert processed.rows is None  # the whole step: no gather, no copy back
        banned = generated < 2
        assert (logits[0, 3] == float("-inf")) == banned and (logits[0, 4] == float("-inf")) == banned
        state.advance(processed, torch.tensor([7]))


def test_tables_only_for_the_controls_in_use_and_slots_reused():
    state = SamplerState(VOCAB, torch.device("cpu"), MAX_BANNED)
    bias_only = SamplingParams(temperature=0, logit_bias={"2": 1.0}, min_tokens=1)
    state.admit([(i, bias_only, History([1], [])) for i in range(3)])
    assert state.counts is None and state.capacity == FIRST_SLOTS
    state.admit([("rep", SamplingParams(temperature=0, repetition_penalty=1.2), History([1, 2], [3]))])
    assert state.counts is None  # the repetition penalty reads the token lists alone
    slot = state.slot(1)
    state.release(1)
    state.admit([("freq", SamplingParams(temperature=0, frequency_penalty=1.0), History([1], [4, 4]))])
    assert state.counts is not None and state.slot("freq") == slot  # the slot given back is taken again
    assert state.counts[slot, 4] == 2 and state.counts[slot].sum() == 2
    with pytest.raises(ValueError, match="already holds"):
        state.admit([("freq", bias_only, History([1], []))])
    with pytest.raises(ValueError, match="banned ids"):
        state.admit([("many", bias_only, History([1], [], banned=tuple(range(MAX_BANNED + 1))))])
    with pytest.raises(ValueError, match="empty prompt"):
        state.admit([("empty", bias_only, History([], []))])
    assert "many" not in state and "empty" not in state and len(state) == 4


def test_fork_copies_the_parent_then_each_goes_its_own_way():
    state = SamplerState(VOCAB, torch.device("cpu"), MAX_BANNED)
    params = SamplingParams(temperature=0, frequency_penalty=1.0, repetition_penalty=1.5, logit_bias={"9": 2.0})
    state.admit([("parent", params, History([1, 2], [3]))])
    state.fork("parent", "child")
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    processed = state.process(logits.clone(), [0, 1], ["parent", "child"])
    state.advance(processed, torch.tensor([10, 11]))
    for key, output in (("parent", [3, 10]), ("child", [3, 11])):
        got, want = logits[:1].clone(), logits[:1].clone()
        state.process(got, [0], [key])
        process_logits(want, [params], [History([1, 2], output)])
        assert torch.equal(got, want)


def test_rows_of_a_step_that_are_not_processed_are_untouched():
    state = SamplerState(VOCAB, torch.device("cpu"), MAX_BANNED)
    params = SamplingParams(temperature=0, presence_penalty=1.0, logit_bias={"0": -5.0})
    state.admit([("x", params, History([1], [2]))])
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    got = logits.clone()
    processed = state.process(got, [1], ["x"])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2]) and not torch.equal(got[1], logits[1])
    state.advance(processed, torch.tensor([7, 8, 9]))  # row 1's token, 8, is the one added
    assert state.counts[state.slot("x"), 8] == 1 and state.counts[state.slot("x"), 7] == 0


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_logprob_copies_equal_logprobs_of(rows, argmax):
    check_logprob_copies(rows, torch.device("cpu"), argmax)


def check_logprob_copies(rows: list[int], device: torch.device, argmax: bool) -> None:
    """rows: those asking for 3 top logprobs (row 2 asks for none but its token's; alone, no top ones at all)."""
    logits = (torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 3).to(device)
    logits[1, 7] = logits[1, 8] = logits[1].max() + 1  # a tie for the first
    params = [SamplingParams(temperature=0, logprobs=3 if row in rows else None) for row in range(4)]
    if 2 in rows:
        params[2] = SamplingParams(temperature=0, logprobs=0)
    tokens = logits.argmax(dim=-1)
    want = logprobs_of(logits, params, tokens.tolist())
    copies = LogprobCopies(max_rows=8, pin=device.type == "cuda")
    first = copies.launch(logits, params, tokens, argmax=argmax)
    second = copies.launch(logits * 0.5, params, tokens, argmax=argmax)  # the other buffer: the first is still readable
    assert (first.values.shape[1] == first.ids.shape[1]) == (argmax and rows != [2])  # the drawn token's not apart
    if device.type == "cuda":
        torch.cuda.synchronize()  # as the engine waits for the step's event
    assert first.read() == want
    assert second.read() == logprobs_of(logits * 0.5, params, tokens.tolist())
    assert copies.launch(logits, [SamplingParams(temperature=0)] * 4, tokens) is None
