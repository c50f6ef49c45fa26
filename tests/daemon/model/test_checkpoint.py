"""daemon/model/checkpoint.py: config.json (as transformers writes it) into a ModelSpec, every refusal, the RoPE
frequencies against transformers' own init functions, and reading the checkpoint's files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hf_fixtures import LLAMA3_ROPE
from lorad.daemon.model.checkpoint import ModelSpec, load_spec, load_weights, rope_inv_freq, safetensors_files, text_decoder_name
from lorad.errors import ModelError

CPU = torch.device("cpu")

# --- rope_inv_freq and ModelSpec.from_hf_config -----------------------------------------------------


@pytest.mark.parametrize(
    "parameters,head_dim",
    [
        (LLAMA3_ROPE, 16),
        (dict(LLAMA3_ROPE, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=512), 64),
        (dict(LLAMA3_ROPE, original_max_position_embeddings=8192, rope_theta=500000.0), 128),
    ],
)
def test_rope_inv_freq_llama3_matches_transformers(parameters, head_dim):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4 * parameters["original_max_position_embeddings"],
        rope_parameters=dict(parameters),
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, CPU)
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    spec = ModelSpec.from_hf_config(config_dict)
    assert spec.rope_theta == parameters["rope_theta"]
    assert spec.rope_scaling["rope_type"] == "llama3"
    got = rope_inv_freq(spec)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    torch.testing.assert_close(got, expected)
    # the three bands are all present in the first case, so the comparison covers each formula
    plain = 1.0 / (parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert (got == plain).any() and (got < plain).any()


def test_rope_inv_freq_llama3_old_style_rope_scaling():
    """transformers 4.x wrote `rope_scaling` (and rope_theta beside it); the result is the same."""
    base = llama_dict()
    new_style = dict(base, rope_parameters=dict(LLAMA3_ROPE))
    old_style = dict(base, rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    old_style.pop("rope_parameters", None)
    torch.testing.assert_close(
        rope_inv_freq(ModelSpec.from_hf_config(new_style)), rope_inv_freq(ModelSpec.from_hf_config(old_style))
    )


def test_rope_inv_freq_default():
    spec = ModelSpec.from_hf_config(dict(llama_dict(), rope_parameters={"rope_type": "default", "rope_theta": 1234.0}))
    assert spec.rope_scaling is None and spec.rope_theta == 1234.0
    expected = torch.tensor([1234.0 ** (-i / 16) for i in range(0, 16, 2)], dtype=torch.float64)
    torch.testing.assert_close(rope_inv_freq(spec).double(), expected, rtol=1e-6, atol=0)


def llama_dict(**overrides) -> dict:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        **overrides,
    ).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]  # as save_pretrained writes it
    return config


def test_from_hf_config_llama():
    spec = ModelSpec.from_hf_config(llama_dict())
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers) == (300, 64, 172, 3)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert spec.rms_norm_eps == 1e-5 and spec.rope_theta == 10000.0 and spec.rope_scaling is None
    assert spec.max_position_embeddings == 512 and not spec.tie_word_embeddings and not spec.qkv_bias
    assert spec.bos_token_id == 0 and spec.eos_token_ids == (1,)
    assert spec.projection_shape("k_proj") == (64, 32) and spec.projection_shape("down_proj") == (172, 64)
    # generation_config.json's ids win, and a list of EOS ids is kept whole
    spec = ModelSpec.from_hf_config(llama_dict(), {"eos_token_id": [1, 7], "bos_token_id": 5})
    assert spec.eos_token_ids == (1, 7) and spec.bos_token_id == 5


def test_from_hf_config_mistral_and_qwen2():
    from transformers import MistralConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, max_position_embeddings=1024)
    mistral = MistralConfig(num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=None, **common).to_dict()
    mistral["architectures"] = ["MistralForCausalLM"]
    spec = ModelSpec.from_hf_config(mistral)
    assert spec.architecture == "MistralForCausalLM"
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.q_size) == (8, 2, 16, 128)
    assert spec.projection_shape("o_proj") == (128, 64)
    # a window as long as the context is full attention
    mistral_window = MistralConfig(num_attention_heads=4, sliding_window=1024, **common).to_dict()
    mistral_window["architectures"] = ["MistralForCausalLM"]
    assert ModelSpec.from_hf_config(mistral_window).num_kv_heads == 8  # MistralConfig's default

    qwen = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common).to_dict()
    qwen["architectures"] = ["Qwen2ForCausalLM"]
    spec = ModelSpec.from_hf_config(qwen)
    assert spec.architecture == "Qwen2ForCausalLM" and spec.qkv_bias and spec.tie_word_embeddings
    assert spec.head_dim == 16 and spec.eos_token_ids == ()


def refused(config: dict, *words: str) -> None:
    with pytest.raises(ModelError) as error:
        ModelSpec.from_hf_config(config)
    for word in words:
        assert word in error.value.message, error.value.message


def test_sliding_windows_per_layer():
    from transformers import Gemma2Config, MistralConfig

    mistral = MistralConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, max_position_embeddings=8192,
                            sliding_window=4096).to_dict()
    mistral["architectures"] = ["MistralForCausalLM"]
    spec = ModelSpec.from_hf_config(mistral)
    assert spec.layer_windows == (4096,) * 3 and spec.window(2) == 4096
    gemma2 = Gemma2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, head_dim=16).to_dict()
    gemma2["architectures"] = ["Gemma2ForCausalLM"]
    del gemma2["layer_types"]  # as older configs: even layers local
    spec = ModelSpec.from_hf_config(gemma2)
    assert spec.layer_windows == (4096, None, 4096, None) and spec.gemma and spec.tie_word_embeddings
    assert (spec.attn_logit_softcapping, spec.final_logit_softcapping, spec.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    refused(dict(gemma2, layer_types=["sliding_attention", "chunked_attention"]), "layer_types")
    refused(dict(gemma2, use_bidirectional_attention=True), "use_bidirectional_attention")
    refused(dict(gemma2, hidden_activation="gelu"), "hidden_activation")


def test_gemma3_text_of_a_conditional_generation_config():
    """The hub's Gemma 3 configs (transformers 4 format): the text decoder's fields under text_config, many left to
    Gemma3TextConfig's defaults; the global RoPE base scaled, the local one not."""
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "vision_config": {"hidden_size": 1152}, "text_config": {
                  "hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16, "num_hidden_layers": 48,
                  "num_key_value_heads": 8, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}
    spec = ModelSpec.from_hf_config(config)
    assert spec.architecture == "Gemma3ForConditionalGeneration" and spec.gemma and spec.qk_norm
    assert (spec.head_dim, spec.vocab_size, spec.query_pre_attn_scalar) == (256, 262208, 256.0)
    assert spec.layer_windows[:6] == (1024,) * 5 + (None,) and spec.layer_windows.count(None) == 8
    assert (spec.rope_theta, spec.local_rope_theta, spec.rope_scaling) == (1e6, 1e4, {"rope_type": "linear", "factor": 8.0})
    assert spec.page_elems == 4096  # K rows of 8 x 256 do not divide 3840: two rows a page
    torch.testing.assert_close(rope_inv_freq(spec), 1e6 ** -(torch.arange(0, 256, 2) / 256) / 8.0)
    torch.testing.assert_close(rope_inv_freq(spec, local=True), 1e4 ** -(torch.arange(0, 256, 2) / 256))
    refused({"architectures": ["Gemma3ForConditionalGeneration"]}, "text_config")


def test_text_decoder_names():
    assert text_decoder_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_decoder_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert text_decoder_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_decoder_name("model.norm.weight") == "model.norm.weight"
    assert text_decoder_name("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") is None
    assert text_decoder_name("model.multi_modal_projector.mm_input_projection_weight") is None


def test_from_hf_config_refusals():
    from transformers import Qwen2Config

    refused(dict(llama_dict(), architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel", "LlamaForCausalLM")
    refused(dict(llama_dict(), architectures=["GemmaForCausalLM"]), "unsupported architecture")

    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, use_sliding_window=True, sliding_window=64).to_dict()
    qwen["architectures"] = ["Qwen2ForCausalLM"]
    refused(qwen, "sliding")

    for rope_type in ("yarn", "dynamic", "longrope"):
        refused(dict(llama_dict(), rope_parameters={"rope_type": rope_type, "factor": 4.0, "rope_theta": 1e4}), rope_type)
        old = dict(llama_dict(), rope_scaling={"type": rope_type, "factor": 4.0})
        old.pop("rope_parameters")
        refused(old, rope_type)

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        config = llama_dict()
        del config[field]
        refused(config, field)
    refused(dict(llama_dict(), vocab_size="many"), "many")
    refused(dict(llama_dict(), hidden_size=None), "config.json")


def test_from_hf_config_bad_value_names_its_field():
    refused(dict(llama_dict(), hidden_size=None), "hidden_size")


def test_from_hf_config_zero_heads_is_a_model_error():
    config = llama_dict()
    del config["head_dim"]
    config["num_attention_heads"] = 0
    refused(config, "num_attention_heads")


# --- the checkpoint's files -------------------------------------------------------------------------


def test_load_spec_reads_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(llama_dict()))
    assert load_spec(tmp_path).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 9]}))
    assert load_spec(tmp_path).eos_token_ids == (1, 9)


def test_load_spec_refusals(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_spec(tmp_path / "absent")
    with pytest.raises(ModelError, match="not found"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_spec(tmp_path)


def test_safetensors_files_and_load_weights(tmp_path):
    generator = torch.Generator().manual_seed(0)
    one = {"a.weight": torch.randn(3, 4, generator=generator), "b.weight": torch.randn(2, generator=generator)}
    two = {"c.weight": torch.randn(5, 1, generator=generator).to(torch.bfloat16)}
    with pytest.raises(ModelError, match="safetensors"):
        safetensors_files(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelError, match="pickled"):
        safetensors_files(tmp_path)
    save_file(one, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(two, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00001-of-00002.safetensors",
                            "c.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in safetensors_files(tmp_path)] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weights = load_weights(tmp_path, torch.float32, CPU)
    assert set(weights) == {"a.weight", "b.weight", "c.weight"}
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert torch.equal(weights["a.weight"], one["a.weight"])
    assert torch.equal(weights["c.weight"], two["c.weight"].float())


def test_load_weights_corrupt_file_is_a_model_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ModelError, match="cannot read"):
        load_weights(tmp_path, torch.float32, CPU)


# --- Phi-3: longrope, partial rotary, sliding window -------------------------------------------------


def phi3_config(**overrides):
    from transformers import Phi3Config

    options = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    return Phi3Config(**{**options, **overrides})


def phi3_dict(config) -> dict:
    config_dict = config.to_dict()
    config_dict["architectures"] = ["Phi3ForCausalLM"]
    return config_dict


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["full", "partial-rotary"])
@pytest.mark.parametrize("attention_factor", [None, 1.25], ids=["derived-attention-factor", "given-attention-factor"])
def test_longrope_tables_match_transformers_rotary_embedding(partial, attention_factor):
    """lorad's cos/sin rows against Phi3RotaryEmbedding's own output: a forward whose positions stay below the
    original context (short factors), one reaching past it (long factors for every position), and the rows
    rope_rows picks for a prompt longer than it."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from lorad.daemon.model.checkpoint import rope_attention_factor, rope_rows, rope_tables

    half = int(16 * partial) // 2
    parameters = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=partial,
                      short_factor=[1.0 + 0.3 * i for i in range(half)], long_factor=[1.0 + 2.5 * i for i in range(half)])
    if attention_factor is not None:
        parameters["attention_factor"] = attention_factor
    config = phi3_config(rope_parameters=parameters, original_max_position_embeddings=32)
    spec = ModelSpec.from_hf_config(phi3_dict(config))
    assert spec.rope_dim == 2 * half and (spec.rotary_dim is None) == (partial == 1.0)
    expected_factor = attention_factor or (1 + torch.tensor(512 / 32).log() / torch.tensor(32.0).log()).sqrt().item()
    assert rope_attention_factor(spec) == pytest.approx(expected_factor)

    max_positions = 100
    cos, sin = rope_tables(spec, max_positions, torch.float32, CPU)
    probe = torch.zeros(1, dtype=torch.float32)
    for length in (20, 32, 33, 90):  # the forward of a sequence of `length` tokens, as transformers runs it
        rotary = Phi3RotaryEmbedding(config)
        positions = torch.arange(length)
        want_cos, want_sin = rotary(probe, positions[None])
        # the sequence computed at once (a prompt, or a cache computed again): rope_rows picks each row
        rows = rope_rows(spec, max_positions, positions.numpy(), [length], [length])
        torch.testing.assert_close(cos[rows], want_cos[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[rows], want_sin[0], rtol=1e-6, atol=1e-6)
        # its last token alone (a decode step), beside a short sequence's decode row: each as it would be alone
        rows = rope_rows(spec, max_positions, np.array([length - 1, 3]), np.array([1, 1]), [length, 4])
        torch.testing.assert_close(cos[rows[:1]], want_cos[0, -1:], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cos[rows[1:]], cos[3:4], rtol=0, atol=0)
    # the short and long factors differ, so the rows above told them apart
    assert not torch.allclose(cos[:32], cos[max_positions:])


def test_longrope_spec_parsing_and_refusals():
    from lorad.daemon.model.checkpoint import longrope_split, rope_inv_freq

    factors = dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    # transformers 4.x: rope_scaling {"type": "su"} and the original context beside it, at the top level
    old = phi3_dict(phi3_config())
    old.pop("rope_parameters")
    old.update(rope_theta=10000.0, rope_scaling=dict(type="su", **factors), original_max_position_embeddings=64)
    spec = ModelSpec.from_hf_config(old)
    assert spec.rope_scaling["rope_type"] == "longrope" and longrope_split(spec) == 64
    torch.testing.assert_close(rope_inv_freq(spec, long=True), rope_inv_freq(spec) / 2)
    # the top-level original context wins over one inside the scaling, as in Phi3Config
    inside = dict(old, rope_scaling=dict(type="longrope", original_max_position_embeddings=128, **factors))
    assert longrope_split(ModelSpec.from_hf_config(inside)) == 64

    refused(dict(old, rope_scaling=dict(type="longrope", short_factor=[1.0] * 7, long_factor=[2.0] * 8)),
            "short_factor", "8")
    refused(dict(old, rope_scaling=dict(type="longrope", short_factor=[1.0] * 8, long_factor="long")), "long_factor")
    refused(dict(old, hidden_act="gelu"), "hidden_act", "gelu")
    refused(dict(old, partial_rotary_factor=0.1, rope_scaling=None), "partial_rotary_factor", "even")
    refused(dict(old, partial_rotary_factor=1.5, rope_scaling=None), "partial_rotary_factor")
    # longrope stays refused where lorad does not implement it (checked above for Llama too)
    refused(dict(llama_dict(), rope_parameters=dict(rope_type="longrope", rope_theta=1e4, **factors)), "longrope")


def test_phi3_spec_fused_modules_and_sliding_window():
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, within_sliding_window

    spec = ModelSpec.from_hf_config(phi3_dict(phi3_config(sliding_window=48)))
    assert spec.fused_projections and spec.sliding_window == 48
    assert spec.lora_modules == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert spec.module_shape("qkv_proj") == (64, 64 + 2 * 32) and spec.module_shape("gate_up_proj") == (64, 192)
    assert spec.module_shape("o_proj") == spec.projection_shape("o_proj")
    # the served context: capped at the window by default, refused above it when asked for, kept below it
    assert within_sliding_window(spec, 512, None) == 48
    assert within_sliding_window(spec, 40, 40) == 40
    with pytest.raises(ModelError, match="sliding_window=48.*Phi3ForCausalLM"):
        within_sliding_window(spec, 100, 100)
    # the public shapes parse; Phi-4's GQA splits qkv_proj into 5120 + 1280 + 1280
    phi4 = ModelSpec.from_hf_config(MODEL_CONFIGS["phi-4"])
    assert phi4.module_shape("qkv_proj") == (5120, 7680) and phi4.sliding_window is None
    assert ModelSpec.from_hf_config(MODEL_CONFIGS["phi-3-mini"]).sliding_window == 2047


def test_an_unserved_architecture_is_refused_at_start_naming_the_served_ones(tmp_path):
    # what `lorad serve --model DIR` prints (lorad: MESSAGE, exit 2) for a checkpoint of another family
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine
    from lorad.daemon.model.checkpoint import ARCHITECTURES

    (tmp_path / "config.json").write_text(json.dumps(dict(llama_dict(), architectures=["GPTNeoXForCausalLM"])))
    with pytest.raises(ModelError) as error:
        Engine(EngineConfig(model=str(tmp_path), device="cpu"))
    assert "unsupported architecture 'GPTNeoXForCausalLM'" in error.value.message
    assert all(name in error.value.message for name in ARCHITECTURES) and "Phi3ForCausalLM" in ARCHITECTURES
