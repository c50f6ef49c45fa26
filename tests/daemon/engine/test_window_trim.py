"""Sliding-window layers' pages given back as sequences advance (KVCache.trim, called by the engine before each step),
end to end on the mistral_window fixture (every layer a window of 8, 2 tokens a page): the same tokens as the engine
with trimming off, through a request's n choices (their shared prompt blocks keep their pages until released),
preemption in a pool too small for every context at once, and chunked prompts; every page back at the end."""

from __future__ import annotations

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def run(checkpoint, trim: bool, **config):
    engine = Engine(EngineConfig(model=str(checkpoint.model_dir), device="cpu", dtype="float32",
                                 adapters=tuple((name, str(path)) for name, path in checkpoint.adapters.items()),
                                 **config))
    if not trim:
        engine.kv._windows = []  # every layer's pages kept for the whole context, as for global attention
    preempted = []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: preempted.append(seq) or preempt(seq)
    generator = torch.Generator().manual_seed(3)
    names = [None, *sorted(checkpoint.adapters)]
    requests = []
    for index in range(8):
        prompt = torch.randint(3, checkpoint.vocab_size, (int(torch.randint(5, 45, (1,), generator=generator)),),
                               generator=generator).tolist()
        sampling = (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if index % 2 else
                    SamplingParams(max_tokens=24, temperature=1.0, seed=index, ignore_eos=True))
        requests.append(GenerationRequest(prompt, names[index % len(names)], sampling, n=1 if index % 3 else 3))
    try:
        results = engine.generate(requests)
        status = engine.status()
        assert engine.pool.used["kv"] == 0 and engine.kv.holders == {}  # every KV page back, each once
    finally:
        engine.close()
    tokens = [[choice.token_ids for choice in result.choices] if result.choices else [result.token_ids]
              for result in results]
    return tokens, {**status, "preempted": len(preempted)}


def test_trimmed_pages_change_no_token(hf_checkpoint):
    checkpoint = hf_checkpoint("mistral_window")
    # 4 running, 32 tokens a step (prompts split over steps), a pool that preempts (about 5 whole contexts)
    config = dict(max_running_requests=4, max_batch_tokens=32, max_model_len=96, pool_bytes=700 * 256)
    kept, kept_status = run(checkpoint, False, **config)
    trimmed, status = run(checkpoint, True, **config)
    assert trimmed == kept
    assert status["kv_sharing"]["window_pages_freed"] > 0 and kept_status["kv_sharing"]["window_pages_freed"] == 0
    assert kept_status["preempted"] > 0, "the pool held every context: nothing was preempted"
    assert status["preempted"] < kept_status["preempted"]  # the pages given back left room (here 0 against 5)
