"""A request's n choices on an NVIDIA GPU, with the CUDA graphs and overlapped decode on: the prompt prefilled
once (a prefill graph, or a decode-shaped step for a 1-token prompt, which must not be overlapped: the fork reads
its logits), its blocks shared and the partial one copied on the device; every choice equals the single request,
beside other requests, and the pool's KV pages all come back."""

import gc

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[7], list(range(20, 33)), list(range(40, 72))]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(demo_assets, request):
    torch.backends.cuda.matmul.allow_tf32 = False
    config = EngineConfig(model=str(demo_assets.model_dir), adapters=tuple((n, str(p)) for n, p in demo_assets.adapters.items()),
                          device="cuda", dtype=request.param, max_batch_tokens=64, pool_bytes=256 << 20)
    engine = Engine(config)
    yield engine
    del engine
    gc.collect()  # the pool and the graphs' memory go back before the next dtype's engine


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda prompt: f"{len(prompt)}-tokens")
def test_cuda_greedy_choices_equal_the_single_request_beside_others(engine, prompt):
    assert engine.overlap_decode and engine.runner.graphs is not None
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    beside = [GenerationRequest([5, 6, 7, 8, 9], "demo-r4", greedy), GenerationRequest([11] * 9, None, greedy)]
    alone = engine.generate([GenerationRequest(prompt, "demo-r16", greedy)])[0].token_ids
    beside_alone = [engine.generate([GenerationRequest(r.prompt_token_ids, r.adapter, greedy)])[0].token_ids for r in beside]
    free, steps = engine.pool.num_free, engine.steps
    results = engine.generate([*beside, GenerationRequest(prompt, "demo-r16", greedy, n=4)])
    choices = [choice.token_ids for choice in results[2].choices]
    assert choices == [choices[0]] * 4  # identical rows of one batch, over the same (shared or copied) pages
    if engine.dtype == torch.float32:  # bfloat16 batches of other sizes round differently
        assert [result.token_ids for result in results[:2]] == beside_alone
        assert choices[0] == alone
    assert engine.steps - steps <= 16 + 1  # one prefill step for the whole batch, then decode steps
    assert engine.pool.num_free == free and engine.pool.used["kv"] == 0 and engine.kv.holders == {}


@pytest.mark.parametrize("engine", ["float32"], indirect=True)  # bfloat16 rows of other batch sizes round differently
def test_cuda_seeded_choices_equal_requests_seeded_seed_plus_i(engine):
    sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    choices = [choice.token_ids for choice in engine.generate([GenerationRequest(PROMPTS[1], None, sampling, n=3)])[0].choices]
    for i, tokens in enumerate(choices):
        alone = GenerationRequest(PROMPTS[1], None, SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i, ignore_eos=True))
        assert engine.generate([alone])[0].token_ids == tokens
    assert len({tuple(tokens) for tokens in choices}) == 3
