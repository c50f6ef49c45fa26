"""daemon/model/demo.py: the demo is deterministic, built once and reused, atomic, and its checkpoint,
tokenizer and adapters are what lorad and PEFT expect. (That transformers + PEFT compute what lorad
computes on it is tests/test_hf_parity.py::test_demo_matches_hf_peft.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from lorad.daemon.model import demo
from lorad.daemon.model.checkpoint import PROJECTIONS, load_spec, load_weights
from lorad.daemon.model.demo import DEMO_ADAPTERS, build_demo, default_demo_root, write_random_adapter
from lorad.errors import ModelError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def files_of(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}


def test_two_builds_write_identical_files(tmp_path):
    first = build_demo(tmp_path / "one")
    second = build_demo(tmp_path / "two")
    assert first.model_dir == tmp_path / "one" / "model"
    assert second.adapters["demo-r16"] == tmp_path / "two" / "adapters" / "demo-r16"
    one, two = files_of(tmp_path / "one"), files_of(tmp_path / "two")
    assert one.keys() == two.keys()
    assert [name for name in one if one[name] != two[name]] == []
    assert {"model/config.json", "model/generation_config.json", "model/model.safetensors",
            "model/tokenizer.json", demo.MARKER} <= one.keys()


def test_build_in_a_fresh_process_is_identical(tmp_path, demo_assets):
    # Tokenizer training and the random weights must not depend on the process (hash seeds, threads).
    code = "import sys; from lorad.daemon.model.demo import build_demo; build_demo(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "demo")], check=True,
                   env={**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"})
    assert files_of(tmp_path / "demo") == files_of(demo_assets.model_dir.parent)


def test_second_build_reuses_the_first(tmp_path, monkeypatch):
    root = tmp_path / "demo"
    first = build_demo(root)
    before = {path: path.stat().st_mtime_ns for path in root.rglob("*")}
    monkeypatch.setattr(demo, "_write_demo", lambda staging: pytest.fail("rebuilt a complete demo"))
    second = build_demo(root)
    assert second == first
    assert {path: path.stat().st_mtime_ns for path in root.rglob("*")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging directories left


def test_racing_builders_agree(tmp_path, demo_assets):
    code = "import sys; from lorad.daemon.model.demo import build_demo; build_demo(sys.argv[1])"
    builders = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "demo")]) for _ in range(3)]
    assert [builder.wait(timeout=120) for builder in builders] == [0, 0, 0]
    assert files_of(tmp_path / "demo") == files_of(demo_assets.model_dir.parent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_empty_directory_is_filled(tmp_path):
    (tmp_path / "demo").mkdir()
    assets = build_demo(tmp_path / "demo")
    assert (assets.model_dir / "model.safetensors").is_file()


def test_other_version_is_replaced(tmp_path):
    root = tmp_path / "demo"
    build_demo(root)
    marker = json.loads((root / demo.MARKER).read_text())
    (root / demo.MARKER).write_text(json.dumps({**marker, "format_version": demo.FORMAT_VERSION - 1}))
    (root / "model" / "stale-file").write_text("old")
    build_demo(root)
    assert not (root / "model" / "stale-file").exists()
    assert json.loads((root / demo.MARKER).read_text())["format_version"] == demo.FORMAT_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_crash_while_building_leaves_nothing_behind(tmp_path, monkeypatch):
    def crash(staging):
        (staging / "model").mkdir()
        (staging / "model" / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_write_demo", crash)
    with pytest.raises(KeyboardInterrupt):
        build_demo(tmp_path / "demo")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert build_demo(tmp_path / "demo").model_dir.is_dir()


def test_refuses_a_directory_that_is_not_a_demo(tmp_path):
    (tmp_path / "precious.txt").write_text("mine")
    with pytest.raises(ModelError, match="not empty"):
        build_demo(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "mine"


def test_default_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAD_DEMO_DIR", str(tmp_path / "explicit"))
    assert default_demo_root() == tmp_path / "explicit"
    monkeypatch.delenv("LORAD_DEMO_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_demo_root() == tmp_path / "cache" / "lorad" / "demo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_root() == tmp_path / "home" / ".cache" / "lorad" / "demo"


def test_runtime_does_not_import_transformers_or_peft(tmp_path):
    code = (
        "import sys; from lorad.daemon.model.demo import build_demo; build_demo(sys.argv[1]); "
        "bad = [m for m in ('transformers', 'peft') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "demo")], check=True)


# The checkpoint.


def test_checkpoint_reads_as_the_spec_says(demo_assets):
    spec = load_spec(demo_assets.model_dir)
    tokenizer = Tokenizer.from_file(str(demo_assets.model_dir / "tokenizer.json"))
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers) == (64, 172, 4)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert spec.vocab_size == tokenizer.get_vocab_size()
    assert spec.rope_scaling is None and spec.rope_theta == 10000.0 and not spec.tie_word_embeddings
    assert spec.bos_token_id == tokenizer.token_to_id("<s>")
    assert spec.eos_token_ids == (tokenizer.token_to_id("</s>"),)

    weights = load_weights(demo_assets.model_dir, torch.float32, torch.device("cpu"))
    expected = {"model.embed_tokens.weight": (spec.vocab_size, 64), "model.norm.weight": (64,),
                "lm_head.weight": (spec.vocab_size, 64)}
    for layer in range(spec.num_layers):
        expected[f"model.layers.{layer}.input_layernorm.weight"] = (64,)
        expected[f"model.layers.{layer}.post_attention_layernorm.weight"] = (64,)
        for projection in PROJECTIONS:
            module = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            in_features, out_features = spec.projection_shape(projection)
            expected[f"model.layers.{layer}.{module}.{projection}.weight"] = (out_features, in_features)
    assert {name: tuple(tensor.shape) for name, tensor in weights.items()} == expected
    assert all(tensor.dtype == torch.float32 for tensor in weights.values())
    norms = torch.cat([t for name, t in weights.items() if "norm" in name])
    assert (norms - 1).abs().max() < 0.5
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert 0.05 <= q.std() <= 0.1


def test_greedy_text_depends_on_the_prompt_and_the_adapter(demo_assets, hf_reference):
    tokenizer = Tokenizer.from_file(str(demo_assets.model_dir / "tokenizer.json"))
    reference = hf_reference(demo_assets.model_dir, demo_assets.adapters)
    prompts = [tokenizer.encode(text).ids for text in ("The", "Hello", "Why is the sky blue?", "bread and salt")]
    base = [tuple(reference.greedy(prompt, None, 16)[0]) for prompt in prompts]
    assert len(set(base)) == len(prompts), "different prompts decode to the same text"
    assert all(len(set(tokens)) > 3 for tokens in base), "greedy text is a repeated token"
    for name in demo_assets.adapters:
        adapted = [tuple(reference.greedy(prompt, name, 16)[0]) for prompt in prompts]
        assert adapted != base, f"{name} does not change the output"


# The tokenizer.


def random_text(rng: random.Random, length: int) -> str:
    # Any code point but the surrogates, weighted toward ASCII, whitespace and the common planes.
    pools = [(0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x2FF), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF),
             (0xE000, 0xF8FF), (0x10000, 0x10FFFF), (0x0, 0x1F)]
    chars = []
    for _ in range(length):
        low, high = rng.choice(pools)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


def test_tokenizer_round_trips_any_text(demo_assets):
    tokenizer = Tokenizer.from_file(str(demo_assets.model_dir / "tokenizer.json"))
    rng = random.Random(0)
    texts = ["", " ", "  leading and trailing  ", "\n\n\t\r\n", "héllo wörld", "日本語のテキスト",
             "🙂👍🏽 emoji", "\x00\x01 control", "ﬁ ligature (no normalisation)", "a\u0301 combining",
             "\ufeffBOM", "💩" * 20, demo.CORPUS, *(random_text(rng, rng.randint(1, 200)) for _ in range(200))]
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
        assert all(0 <= token < tokenizer.get_vocab_size() for token in ids)
    # Special tokens written in the text are matched as such; they come back unless skipped.
    ids = tokenizer.encode("a <s> b </s>").ids
    assert tokenizer.token_to_id("<s>") in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == "a <s> b </s>"


def test_tokenizer_is_a_trained_byte_level_bpe(demo_assets):
    tokenizer = Tokenizer.from_file(str(demo_assets.model_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == demo.TOKENIZER_VOCAB
    assert [tokenizer.token_to_id(token) for token in ("<s>", "</s>", "<unk>")] == [0, 1, 2]
    assert len(tokenizer.encode("The lighthouse keeper woke before the sun").ids) < 20  # merges learnt
    assert tokenizer.encode("hello").ids[0] != tokenizer.token_to_id("<s>")  # no BOS added


# The adapters.


def test_adapters_are_valid_peft_loras(demo_assets):
    spec = load_spec(demo_assets.model_dir)
    assert "demo-r16" in demo_assets.adapters and len(demo_assets.adapters) == 8
    seen_targets = set()
    for name, directory in demo_assets.adapters.items():
        rank, targets, use_rslora, _ = DEMO_ADAPTERS[name]
        config = json.loads((directory / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == rank and config["use_rslora"] == use_rslora
        assert sorted(config["target_modules"]) == sorted(targets)
        assert config["lora_alpha"] == 2 * rank and config["task_type"] == "CAUSAL_LM"
        assert not config["use_dora"] and config["bias"] == "none" and not config["fan_in_fan_out"]
        tensors = read_tensors(directory / "adapter_model.safetensors")
        expected = {}
        for layer in range(spec.num_layers):
            for projection in targets:
                module = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{module}.{projection}"
                in_features, out_features = spec.projection_shape(projection)
                expected[f"{prefix}.lora_A.weight"] = (rank, in_features)
                expected[f"{prefix}.lora_B.weight"] = (out_features, rank)
        assert {key: tuple(tensor.shape) for key, tensor in tensors.items()} == expected, name
        assert all(tensor.dtype == torch.float32 and tensor.abs().min() > 0 for tensor in tensors.values())
        seen_targets.add(frozenset(targets))
    assert frozenset(PROJECTIONS) in seen_targets  # all seven
    assert frozenset(("gate_proj", "up_proj", "down_proj")) in seen_targets  # mlp only
    assert any(use_rslora for _, _, use_rslora, _ in DEMO_ADAPTERS.values())


def test_lorad_loads_every_demo_adapter(demo_assets):
    from lorad.daemon.model.adapters import load_peft_adapter

    spec = load_spec(demo_assets.model_dir)
    for name, directory in demo_assets.adapters.items():
        rank, targets, use_rslora, _ = DEMO_ADAPTERS[name]
        adapter = load_peft_adapter(directory, spec, max_rank=64, name=name)
        assert adapter.rank == rank and set(adapter.targets) == set(targets)
        assert len(adapter.weights) == spec.num_layers * len(targets)
        scaling = 2 * rank / (rank**0.5 if use_rslora else rank)
        assert all(value == pytest.approx(scaling) for value in adapter.scaling.values())


def test_write_random_adapter(demo_assets, tmp_path):
    spec = load_spec(demo_assets.model_dir)
    directory = write_random_adapter(tmp_path / "a", spec, rank=3, targets=["k_proj", "down_proj"], seed=7,
                                     alpha=5, use_rslora=True)
    config = json.loads((directory / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (3, 5, True)
    tensors = read_tensors(directory / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * spec.num_layers
    assert tensors["base_model.model.model.layers.3.mlp.down_proj.lora_A.weight"].shape == (3, 172)
    assert tensors["base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"].shape == (32, 3)
    again = write_random_adapter(tmp_path / "b", spec, rank=3, targets=["k_proj", "down_proj"], seed=7,
                                 alpha=5, use_rslora=True)
    assert files_of(directory) == files_of(again)
    other = read_tensors(write_random_adapter(tmp_path / "c", spec, 3, ["k_proj", "down_proj"], seed=8)
                         / "adapter_model.safetensors")
    assert not torch.equal(other["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"],
                           tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"])
    with pytest.raises(ValueError):
        write_random_adapter(tmp_path / "d", spec, 4, ["qkv_proj"], seed=0)
    with pytest.raises(ValueError):
        write_random_adapter(tmp_path / "e", spec, 0, ["q_proj"], seed=0)


def test_write_random_adapter_on_phi3_fused_modules(tmp_path):
    # `lorad demo adapters --model-config phi-3-mini`: adapters on the modules Phi-3 has, which lorad loads back
    from lorad.daemon.model.adapters import load_peft_adapter
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
    from lorad.daemon.model.demo import write_adapter_set

    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-phi3"])
    (directory,) = write_adapter_set(tmp_path, spec, 1, [4], ["qkv", "gate_up", "down"])
    tensors = read_tensors(directory / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"].shape == (64 + 2 * 32, 4)
    adapter = load_peft_adapter(directory, spec, max_rank=8)
    assert adapter.targets == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    with pytest.raises(ValueError, match="qkv_proj"):
        write_adapter_set(tmp_path / "x", spec, 1, [4], ["q"])
