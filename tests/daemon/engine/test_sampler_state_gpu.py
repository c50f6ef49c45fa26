"""The sampler state on cuda: the same processed logits as process_logits on the whole history, exactly, and the
overlapped decode with greedy rows that carry penalties, bias, min_tokens and logprobs: the tokens and logprobs of
plain stepping on the same GPU and of the CPU reference."""

from __future__ import annotations

import gc

import pytest
import torch
from test_overlap_decode import assert_same_logprobs, processed_requests
from test_sampler_state import check_logprob_copies, run_randomized

from lorad.config import EngineConfig
from lorad.daemon.engine import sampler_state
from lorad.daemon.engine.engine import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", range(2))
def test_cuda_state_equals_process_logits(seed, monkeypatch):
    monkeypatch.setattr(sampler_state, "FIRST_SLOTS", 2)
    monkeypatch.setattr(sampler_state, "FIRST_TOKENS", 4)
    run_randomized(seed, torch.device("cuda"))


@pytest.mark.parametrize("argmax", [False, True])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_cuda_logprob_copies_equal_logprobs_of(rows, argmax):
    check_logprob_copies(rows, torch.device("cuda"), argmax)


@pytest.mark.parametrize("eager", [False, True])
def test_cuda_processed_greedy_rows_overlap_with_the_tokens_of_plain_steps(demo_assets, eager):
    torch.backends.cuda.matmul.allow_tf32 = False
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    names = [None, *sorted(demo_assets.adapters)]
    cases = [([5, 6, 7], names[0]), (list(range(20, 60)), names[1 % len(names)]), ([9] * 11, names[2 % len(names)]),
             (list(range(100, 103)), names[3 % len(names)]), ([40, 41, 42, 43], None), (list(range(60, 75)), names[-1])]
    cpu = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu", dtype="float32"))
    want = cpu.generate(processed_requests(cpu, cases, 12))
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                                 eager=eager, max_running_requests=12, max_lora_rank=64))
    assert engine.overlap_decode
    got = engine.generate(processed_requests(engine, cases, 12))
    overlapped = engine.overlapped_steps
    engine.overlap_decode = False
    plain = engine.generate(processed_requests(engine, cases, 12))
    assert overlapped > 5 and engine._in_flight is None and len(engine.sampler_state) == 0
    del engine
    gc.collect()
    for a, b, c in zip(got, plain, want):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.finish_reason == b.finish_reason == c.finish_reason
        assert_same_logprobs(a.logprobs, b.logprobs)
        assert_same_logprobs(a.logprobs, c.logprobs, tolerance=1e-3)


def test_cuda_a_step_never_waits_for_the_device():
    """process, advance and the logprobs' launch, as an overlapped step runs them: any synchronizing call raises."""
    from lorad.daemon.engine.request import SamplingParams
    from lorad.daemon.engine.sampler import History, LogprobCopies

    vocab, rows = 32000, 64
    device = torch.device("cuda")
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                            logit_bias={"5": 5.0, "1000": -2.0}, min_tokens=2, logprobs=5)
    state = sampler_state.SamplerState(vocab, device, max_banned=2)
    assert state.kernels  # gpu_ops/logits.py's, on cuda
    state.admit((key, params, History(list(range(key, key + 300)), [], banned=(2,))) for key in range(rows))
    copies = LogprobCopies(rows, pin=True)
    logits = torch.randn(rows, vocab, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # with every row, then with a subset of the rows
            processed = state.process(logits, list(range(rows)), list(range(rows)))
            tokens = logits.argmax(dim=-1)
            state.advance(processed, tokens)
            copies.launch(logits, [params] * rows, tokens, argmax=True)
            copies.launch(logits, [params] * rows, tokens)
            processed = state.process(logits, list(range(0, rows, 2)), list(range(0, rows, 2)))
            state.advance(processed, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
