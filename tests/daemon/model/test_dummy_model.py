"""Benchmark mode: a known model shape with random weights and random in-memory adapters."""

import pytest

from lorad.config import EngineConfig
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.errors import BadRequest


def test_known_shapes_parse():
    shapes = {name: ModelSpec.from_hf_config(config) for name, config in MODEL_CONFIGS.items()}
    assert shapes["llama-2-7b"].projection_shape("down_proj") == (11008, 4096)
    assert shapes["llama-3-8b"].kv_size == 1024
    assert shapes["qwen3-8b"].qk_norm and shapes["qwen3-8b"].q_size == 4096 and shapes["qwen3-8b"].kv_size == 1024
    gemma2, gemma3 = shapes["gemma-2-9b"], shapes["gemma-3-12b"]
    assert gemma2.layer_windows == (4096, None) * 21 and gemma2.attn_logit_softcapping == 50.0 and gemma2.page_elems == 4096
    assert gemma3.layer_windows == ((1024,) * 5 + (None,)) * 8 and gemma3.qk_norm and gemma3.vocab_size == 262208


@pytest.mark.parametrize("shape", ["tiny-gemma2", "tiny-gemma3"])
def test_a_dummy_gemma_serves_its_adapters_past_its_window(shape):
    engine = Engine(EngineConfig(model_config=shape, dummy_weights=True, dummy_adapters=2, dummy_adapter_rank=4,
                                 device="cpu"))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(2, 42))  # 40 tokens over a window of 16
    results = engine.generate([GenerationRequest(prompt, adapter="dummy-0", sampling=greedy),
                               GenerationRequest(prompt, sampling=greedy)])
    assert all(len(r.token_ids) == 4 for r in results)
    assert engine.spec.gemma and engine.spec.window(0) == 16 and engine.spec.window(engine.spec.num_layers - 1) is None


def test_a_dummy_qwen3_serves_its_adapters():
    engine = Engine(EngineConfig(model_config="tiny-qwen3", dummy_weights=True, dummy_adapters=2, dummy_adapter_rank=4,
                                 device="cpu"))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest([1, 2, 3], adapter="dummy-0", sampling=greedy),
                               GenerationRequest([1, 2, 3], sampling=greedy)])
    assert all(len(r.token_ids) == 4 for r in results)
    assert engine.spec.qk_norm and engine.spec.q_size == 128  # head_dim 32 x 4 heads, over a hidden size of 64


def test_dummy_model_serves_dummy_adapters_in_one_batch():
    engine = Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, dummy_adapters=6,
                                 dummy_adapter_rank=4, dummy_adapter_targets="q_proj,down_proj", device="cpu"))
    models = engine.models()
    assert models[0]["id"] == "tiny-llama" and len(models) == 7
    assert models[1]["targets"] == ["q_proj", "down_proj"] and models[1]["rank"] == 4
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    requests = [GenerationRequest([1, 2, 3], adapter=f"dummy-{i}", sampling=greedy) for i in range(6)]
    results = engine.generate(requests + [GenerationRequest([1, 2, 3], sampling=greedy)])
    assert all(len(r.token_ids) == 4 for r in results)
    # Adapters 0 and 4 share weights (4 distinct sets), 0 and 1 do not; the base differs from both.
    assert results[0].token_ids == results[4].token_ids
    assert {tuple(results[0].token_ids), tuple(results[1].token_ids), tuple(results[6].token_ids)} != {tuple(results[0].token_ids)}
    assert engine.status()["adapters_resident"] == [f"dummy-{i}" for i in range(6)]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"model_config": "tiny-llama"}, "--dummy-weights"),
        ({"model_config": "gpt-9", "dummy_weights": True}, "unknown model config"),
        ({"model_config": "tiny-llama", "dummy_weights": True, "dummy_adapters": 2, "dummy_adapter_targets": "lm_head"}, "unknown projections"),
        ({"model_config": "tiny-llama", "dummy_weights": True, "dummy_adapters": 2, "dummy_adapter_rank": 0}, "dummy_adapter_rank"),
    ],
)
def test_bad_benchmark_settings_are_refused(fields, message):
    with pytest.raises(BadRequest, match=message):
        Engine(EngineConfig(device="cpu", **fields))
