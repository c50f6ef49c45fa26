"""Benchmark mode: a known model shape with random weights and random in-memory adapters."""

import pytest

from lorad.config import EngineConfig
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, PROJECTIONS, ModelSpec
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


@pytest.mark.parametrize("hidden,kv_heads,head_dim,page", [
    (4096, 8, 128, 4096),  # Llama 3 8B: 4 tokens a page
    (4096, 32, 128, 4096),  # Llama 2 7B: 1 token a page
    (2560, 8, 128, 3072),  # Qwen3 4B: K rows of 1024 do not divide 2560
    (3584, 8, 256, 4096),  # Gemma 2 9B
    (48, 2, 16, 64),  # the Qwen3 test checkpoint
])
def test_a_page_holds_whole_k_rows_and_an_a_row(hidden, kv_heads, head_dim, page):
    config = dict(MODEL_CONFIGS["llama-2-7b"], hidden_size=hidden, num_key_value_heads=kv_heads, head_dim=head_dim)
    spec = ModelSpec.from_hf_config(config)
    assert spec.page_elems == page
    assert page % spec.kv_size == 0 and page >= hidden


def test_a_dummy_qwen3_serves_its_adapters():
    engine = Engine(EngineConfig(model_config="tiny-qwen3", dummy_weights=True, dummy_adapters=2, dummy_adapter_rank=4,
                                 device="cpu"))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest([1, 2, 3], adapter="dummy-0", sampling=greedy),
                               GenerationRequest([1, 2, 3], sampling=greedy)])
    assert all(len(r.token_ids) == 4 for r in results)
    assert engine.spec.qk_norm and engine.spec.q_size == 128  # head_dim 32 x 4 heads, over a hidden size of 64


def test_a_dummy_phi3_serves_fused_module_adapters():
    # --dummy-adapter-targets may name Phi-3's fused modules: one A for q, k and v (gate and up), as its real
    # adapters are held, so a --model-config phi-3-mini benchmark moves what they would
    engine = Engine(EngineConfig(model_config="tiny-phi3", dummy_weights=True, dummy_adapters=2, dummy_adapter_rank=4,
                                 dummy_adapter_targets="qkv_proj,o_proj,gate_up_proj,down_proj", device="cpu"))
    adapter = engine.registry.get("dummy-0")
    assert adapter.targets == PROJECTIONS
    assert adapter.weights[(0, 0)][0] is adapter.weights[(0, 1)][0] is adapter.weights[(0, 2)][0]
    assert adapter.weights[(1, 4)][0] is adapter.weights[(1, 5)][0]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest([1, 2, 3], adapter="dummy-0", sampling=greedy),
                               GenerationRequest([1, 2, 3], sampling=greedy)])
    assert all(len(r.token_ids) == 4 for r in results) and results[0].token_ids != results[1].token_ids
    engine.close()
    phi3 = ModelSpec.from_hf_config(MODEL_CONFIGS["phi-3-mini"])
    assert phi3.fused_projections and phi3.module_shape("qkv_proj") == (3072, 9216) and phi3.sliding_window == 2047


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
