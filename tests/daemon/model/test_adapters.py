"""daemon/model/adapters.py: PEFT adapters read into float32 A / scaled B, checked against what PEFT itself
computes; every refusal; the registry's lazy loads, LRU host cache and isolation of broken adapters."""

from __future__ import annotations

import copy
import json
import math
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lorad.daemon.model import adapters as adapters_module
from lorad.daemon.model.adapters import AdapterRegistry, LoraAdapter, load_peft_adapter
from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec
from lorad.errors import AdapterError, NotFound

# transformers warns about its own deprecated internals while PEFT wraps the tiny model.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 172, 2, 4, 2, 128
PREFIX = "base_model.model.model.layers"


def tiny_spec(**overrides) -> ModelSpec:
    fields = dict(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=False,
        qkv_bias=False, qk_norm=False, torch_dtype="float32", bos_token_id=1, eos_token_ids=(2,),
    )
    fields.update(overrides)
    return ModelSpec(**fields)


SPEC = tiny_spec()


# --- PEFT-made adapters, compared with PEFT's own forward -------------------------------------


@pytest.fixture(scope="module")
def base_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, vocab_size=VOCAB)
    return transformers.LlamaForCausalLM(config).eval()


def make_peft_adapter(base_model, directory: Path, seed: int = 1, **lora_kwargs):
    """Save a PEFT adapter with random nonzero A and B (PEFT zero-inits B); return the PEFT model."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base_model), peft.LoraConfig(**lora_kwargs))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                torch.nn.init.normal_(module.lora_A["default"].weight, std=0.2)
                torch.nn.init.normal_(module.lora_B["default"].weight, std=0.2)
    model.save_pretrained(str(directory))
    return model


def peft_deltas(peft_model) -> dict[tuple[int, int], tuple[torch.nn.Module, float, int]]:
    """(layer, projection index) -> (PEFT's LoRA linear layer, its scaling, its rank)."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            match = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            key = (int(match[1]), PROJECTIONS.index(match[2]))
            found[key] = (module, module.scaling["default"], module.r["default"])
    return found


def assert_matches_peft(adapter: LoraAdapter, peft_model) -> None:
    expected = peft_deltas(peft_model)
    assert set(adapter.weights) == set(expected)
    torch.manual_seed(123)
    for key, (module, scaling, rank) in expected.items():
        a, b = adapter.weights[key]
        in_features, out_features = SPEC.projection_shape(PROJECTIONS[key[1]])
        assert a.shape == (rank, in_features) and b.shape == (out_features, rank)
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
        assert adapter.scaling[key] == pytest.approx(scaling)
        x = torch.randn(5, in_features)
        with torch.no_grad():
            peft_delta = module(x) - module.get_base_layer()(x)
        torch.testing.assert_close(x @ a.T @ b.T, peft_delta, rtol=1e-4, atol=1e-5)
    assert adapter.rank == max(rank for _, _, rank in expected.values())
    assert adapter.targets == tuple(p for i, p in enumerate(PROJECTIONS) if any(k[1] == i for k in expected))
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def test_all_projections_match_peft(base_model, tmp_path):
    model = make_peft_adapter(base_model, tmp_path / "all", r=8, lora_alpha=16, target_modules=list(PROJECTIONS))
    adapter = load_peft_adapter(tmp_path / "all", SPEC, max_rank=16, name="all")
    assert_matches_peft(adapter, model)
    assert adapter.targets == PROJECTIONS and adapter.rank == 8
    assert len(adapter.weights) == LAYERS * len(PROJECTIONS)
    assert set(adapter.scaling.values()) == {2.0}
    assert adapter.describe() == {
        "name": "all",
        "path": str(tmp_path / "all"),
        "rank": 8,
        "targets": list(PROJECTIONS),
        "nbytes": adapter.nbytes,
    }


@pytest.mark.parametrize("targets", [["q_proj", "down_proj"], ["self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"],
                                     r".*\.(q_proj|down_proj)", "all-linear", "ALL-LINEAR", None])
def test_target_modules_that_take_every_weighted_module_load(tmp_path, targets):
    config = {"target_modules": targets} if targets is not None else {}
    directory = write_adapter(tmp_path / "a", lora_tensors({(0, "q_proj"): 4, (1, "down_proj"): 4}), **config)
    if targets is None:
        saved = json.loads((directory / "adapter_config.json").read_text())
        del saved["target_modules"]
        (directory / "adapter_config.json").write_text(json.dumps(saved))
    assert load_peft_adapter(directory, SPEC, max_rank=8, name="a").targets == ("q_proj", "down_proj")


def test_rslora_and_regex_target_modules_match_peft(base_model, tmp_path):
    model = make_peft_adapter(
        base_model, tmp_path / "rs", r=4, lora_alpha=8, use_rslora=True, target_modules=r".*\.(v_proj|q_proj)"
    )
    adapter = load_peft_adapter(tmp_path / "rs", SPEC, max_rank=8, name="rs")
    assert_matches_peft(adapter, model)
    assert adapter.targets == ("q_proj", "v_proj")
    assert set(adapter.scaling.values()) == {8 / math.sqrt(4)}  # 4, not 8 / 4


@pytest.mark.filterwarnings("ignore:The following alpha_pattern keys")
def test_rank_and_alpha_patterns_match_peft(base_model, tmp_path):
    model = make_peft_adapter(
        base_model,
        tmp_path / "patterns",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
        # A full module name, a bare suffix and a regex; "proj" must not match "q_proj" (dot boundary).
        rank_pattern={"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
        alpha_pattern={"proj": 100, r"layers\.0\..*v_proj": 3, "gate_proj": 5},
    )
    adapter = load_peft_adapter(tmp_path / "patterns", SPEC, max_rank=8, name="patterns")
    assert_matches_peft(adapter, model)
    q = PROJECTIONS.index("q_proj")
    assert adapter.weights[(0, q)][0].shape[0] == 4 and adapter.weights[(1, q)][0].shape[0] == 2
    assert adapter.rank == 6
    assert adapter.scaling[(0, PROJECTIONS.index("v_proj"))] == pytest.approx(3 / 4)
    assert adapter.scaling[(1, PROJECTIONS.index("v_proj"))] == pytest.approx(8 / 4)
    assert adapter.scaling[(0, PROJECTIONS.index("down_proj"))] == pytest.approx(8 / 6)


@pytest.mark.filterwarnings("ignore:The following rank_pattern keys")
def test_adapter_of_a_bare_llama_model_matches_patterns_as_peft_does(base_model, tmp_path):
    # Saved as base_model.model.layers.N...: PEFT's module names lack the "model." of LlamaForCausalLM,
    # so this rank_pattern key matches nothing there, and must match nothing here.
    model = make_peft_adapter(
        base_model.model,
        tmp_path / "bare",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj"],
        rank_pattern={"model.layers.1.self_attn.q_proj": 2, "layers.1.self_attn.o_proj": 3},
    )
    adapter = load_peft_adapter(tmp_path / "bare", SPEC, max_rank=8, name="bare")
    assert_matches_peft(adapter, model)
    assert adapter.weights[(1, PROJECTIONS.index("q_proj"))][0].shape[0] == 4
    assert adapter.weights[(1, PROJECTIONS.index("o_proj"))][0].shape[0] == 3


@pytest.fixture(scope="module")
def phi3_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                                     pad_token_id=None)
    spec = ModelSpec.from_hf_config(dict(config.to_dict(), architectures=["Phi3ForCausalLM"]))
    return transformers.Phi3ForCausalLM(config).eval(), spec


@pytest.mark.filterwarnings("ignore:The following alpha_pattern keys")
def test_phi3_fused_modules_split_into_their_projections_as_peft_computes(phi3_model, tmp_path):
    """An adapter on Phi-3's qkv_proj and gate_up_proj is held as q, k, v and gate, up: the fused module's A
    shared (one tensor), its B cut by rows; each member's x A^T B^T is PEFT's delta on the fused module's
    columns of that member."""
    base, spec = phi3_model
    model = make_peft_adapter(base, tmp_path / "phi3", r=4, lora_alpha=8, use_rslora=True,
                              target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                              rank_pattern={"layers.1.self_attn.qkv_proj": 2})
    adapter = load_peft_adapter(tmp_path / "phi3", spec, max_rank=8, name="phi3")
    assert adapter.targets == PROJECTIONS and len(adapter.weights) == LAYERS * len(PROJECTIONS)
    from peft.tuners.lora import LoraLayer

    q, kv, inter = spec.q_size, spec.kv_size, INTERMEDIATE
    members = {"qkv_proj": ((0, 0, q), (1, q, q + kv), (2, q + kv, q + 2 * kv)),
               "gate_up_proj": ((4, 0, inter), (5, inter, 2 * inter)), "o_proj": ((3, 0, HIDDEN),),
               "down_proj": ((6, 0, HIDDEN),)}
    torch.manual_seed(5)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        layer, fused = int(re.search(r"layers\.(\d+)\.", name)[1]), name.rsplit(".", 1)[1]
        x = torch.randn(3, module.in_features)
        with torch.no_grad():
            peft_delta = module(x) - module.get_base_layer()(x)
        shared = {id(adapter.weights[(layer, proj)][0]) for proj, _, _ in members[fused]}
        assert len(shared) == 1, f"{name}: one A for every member"
        for proj, first, last in members[fused]:
            a, b = adapter.weights[(layer, proj)]
            assert a.shape[0] == (2 if (layer, fused) == (1, "qkv_proj") else 4) and b.shape == (last - first, a.shape[0])
            torch.testing.assert_close(x @ a.T @ b.T, peft_delta[:, first:last], rtol=1e-4, atol=1e-5)
            checked += 1
    assert checked == LAYERS * len(PROJECTIONS)
    # host bytes count the shared A once
    unique = {id(t): t.nbytes for pair in adapter.weights.values() for t in pair}
    assert adapter.nbytes == sum(unique.values()) < sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def test_adapters_on_modules_the_model_lacks_are_refused_naming_them(base_model, phi3_model, tmp_path):
    phi3, spec = phi3_model
    make_peft_adapter(base_model, tmp_path / "llama", r=2, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"self_attn.q_proj, which is not one of Phi3ForCausalLM's projections "
                                           r"\(qkv_proj, o_proj, gate_up_proj, down_proj\)"):
        load_peft_adapter(tmp_path / "llama", spec, max_rank=8)
    make_peft_adapter(phi3, tmp_path / "phi3", r=2, lora_alpha=4, target_modules=["gate_up_proj"])
    with pytest.raises(AdapterError, match=r"mlp.gate_up_proj, which is not one of the seven projections"):
        load_peft_adapter(tmp_path / "phi3", SPEC, max_rank=8)


def test_layers_to_transform_gives_weights_for_present_layers_only(base_model, tmp_path):
    model = make_peft_adapter(
        base_model,
        tmp_path / "layer1",
        r=2,
        lora_alpha=4,
        target_modules=["k_proj", "up_proj"],
        layers_to_transform=[1],
    )
    adapter = load_peft_adapter(tmp_path / "layer1", SPEC, max_rank=8, name="layer1")
    assert_matches_peft(adapter, model)
    assert {layer for layer, _ in adapter.weights} == {1}
    assert adapter.targets == ("k_proj", "up_proj")


# --- hand-written adapters -----------------------------------------------------------------------


def lora_tensors(modules: dict[tuple[int, str], int], dtype=torch.float32, infix: str = "") -> dict:
    """PEFT-named random A and B for {(layer, projection): rank}."""
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for (layer, projection), rank in modules.items():
        in_features, out_features = SPEC.projection_shape(projection)
        parent = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        stem = f"{PREFIX}.{layer}.{parent}.{projection}"
        tensors[f"{stem}.lora_A{infix}.weight"] = torch.randn(rank, in_features, generator=generator).to(dtype)
        tensors[f"{stem}.lora_B{infix}.weight"] = torch.randn(out_features, rank, generator=generator).to(dtype)
    return tensors


def write_adapter(directory: Path, tensors: dict | None = None, **config) -> Path:
    """An adapter folder of `tensors` (one rank-4 q_proj by default); target_modules, unless given, names the modules
    the tensors are on."""
    directory.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = lora_tensors({(0, "q_proj"): 4})
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors if ".lora_" in name})
    full_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": modules or ["q_proj"], "bias": "none"}
    full_config.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(full_config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype_becomes_float32_with_scaling_in_b(tmp_path, dtype):
    tensors = lora_tensors({(0, "q_proj"): 4, (1, "down_proj"): 4}, dtype=dtype)
    adapter = load_peft_adapter(write_adapter(tmp_path / "a", tensors, lora_alpha=2), SPEC, 8, "a")
    for (layer, projection), (a, b) in adapter.weights.items():
        stem = f"{PREFIX}.{layer}.{'self_attn' if projection == 0 else 'mlp'}.{PROJECTIONS[projection]}"
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, tensors[f"{stem}.lora_A.weight"].float())
        torch.testing.assert_close(b, tensors[f"{stem}.lora_B.weight"].float() * 0.5)
    assert adapter.targets == ("q_proj", "down_proj")


def test_adapter_name_inside_tensor_names_is_accepted(tmp_path):
    tensors = lora_tensors({(1, "o_proj"): 4}, infix=".default")
    adapter = load_peft_adapter(write_adapter(tmp_path / "a", tensors), SPEC, 8, "a")
    assert list(adapter.weights) == [(1, PROJECTIONS.index("o_proj"))]


@pytest.mark.parametrize("text_prefix", ["model.language_model", "language_model.model"])
def test_gemma3_conditional_generation_adapter_of_the_language_model(tmp_path, text_prefix):
    """PEFT names in a Gemma3ForConditionalGeneration adapter (transformers 5, then 4); a pattern matches as on
    a text-only model; LoRA on the vision tower is refused naming it."""
    tensors = {name.replace(PREFIX, f"base_model.model.{text_prefix}.layers"): tensor
               for name, tensor in lora_tensors({(0, "q_proj"): 4, (1, "q_proj"): 2}).items()}
    adapter = load_peft_adapter(write_adapter(tmp_path / "a", tensors, rank_pattern={"layers.1.self_attn.q_proj": 2}),
                                SPEC, 8, "a")
    assert sorted(adapter.weights) == [(0, 0), (1, 0)] and adapter.weights[(1, 0)][0].shape[0] == 2
    tensors["base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 8)
    with pytest.raises(AdapterError, match="vision tower"):
        load_peft_adapter(write_adapter(tmp_path / "b", tensors, rank_pattern={"layers.1.self_attn.q_proj": 2}), SPEC, 8, "b")


def test_loaded_weights_do_not_follow_later_rewrites_of_the_file(tmp_path):
    directory = write_adapter(tmp_path / "a")
    adapter = load_peft_adapter(directory, SPEC, 8, "a")
    before = [t.clone() for pair in adapter.weights.values() for t in pair]
    weights_file = directory / "adapter_model.safetensors"
    size = weights_file.stat().st_size
    with open(weights_file, "r+b") as file:  # zero every tensor in place: the pages a memory map sees
        data_start = 8 + int.from_bytes(file.read(8), "little")
        file.seek(data_start)
        file.write(bytes(size - data_start))
    after = [t for pair in adapter.weights.values() for t in pair]
    for old, new in zip(before, after):
        assert torch.equal(old, new)


# --- refusals ------------------------------------------------------------------------------------


def good_tensors():
    return lora_tensors({(0, "q_proj"): 4})


def with_extra(name, tensor):
    tensors = good_tensors()
    tensors[name] = tensor
    return tensors


def replaced(suffix, tensor):
    tensors = good_tensors()
    tensors[f"{PREFIX}.0.self_attn.q_proj.{suffix}"] = tensor
    return tensors


def without(suffix):
    tensors = good_tensors()
    del tensors[f"{PREFIX}.0.self_attn.q_proj.{suffix}"]
    return tensors


def nan_at(suffix, value):
    tensors = good_tensors()
    tensors[f"{PREFIX}.0.self_attn.q_proj.{suffix}"][0, 0] = value
    return tensors


REFUSED_ADAPTERS = {
    # case: (tensors, config overrides, message pattern)
    "not lora": (None, {"peft_type": "IA3"}, r"peft_type is 'IA3'"),
    "no peft_type": (None, {"peft_type": None}, r"peft_type is None"),
    "dora": (None, {"use_dora": True}, r"DoRA"),
    "modules_to_save": (None, {"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\]"),
    "fan_in_fan_out": (None, {"fan_in_fan_out": True}, r"fan_in_fan_out"),
    "bias all": (None, {"bias": "all"}, r"bias='all'"),
    "bias lora_only": (None, {"bias": "lora_only"}, r"bias='lora_only'"),
    "lora_bias": (None, {"lora_bias": True}, r"lora_bias"),
    "pissa": (None, {"init_lora_weights": "pissa_niter_4"}, r"init_lora_weights='pissa_niter_4'.*rewritten"),
    "aLoRA": (None, {"alora_invocation_tokens": [5, 6]}, r"activated LoRA"),
    "layer replication": (None, {"layer_replication": [[0, 2], [1, 2]]}, r"layer_replication"),
    "r zero in config": (None, {"r": 0}, r"r=0: the rank must be a positive integer"),
    "r not int": (None, {"r": "4"}, r"r='4'"),
    "alpha not number": (None, {"lora_alpha": "8"}, r"lora_alpha='8'"),
    "bad rank_pattern": (None, {"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\]=0"),
    "bad regex": (None, {"alpha_pattern": {"q_proj(": 2}}, r"not a valid regular expression"),
    "config rank differs": (None, {"r": 8}, r"rank 4 in adapter_model.safetensors but 8 in adapter_config.json"),
    "embed_tokens": (
        with_extra("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(4, VOCAB)),
        {},
        r"embed_tokens.lora_embedding_A is LoRA on the embeddings or lm_head",
    ),
    "lm_head": (
        with_extra("base_model.model.lm_head.lora_A.weight", torch.zeros(4, HIDDEN)),
        {},
        r"lm_head.lora_A.weight is LoRA on the embeddings or lm_head",
    ),
    "not a projection": (
        with_extra(f"{PREFIX}.0.self_attn.q_norm.lora_A.weight", torch.zeros(4, 16)),
        {},
        r"self_attn.q_norm, which is not one of the seven projections",
    ),
    "projection under the wrong parent": (
        with_extra(f"{PREFIX}.0.mlp.q_proj.lora_A.weight", torch.zeros(4, HIDDEN)),
        {},
        r"mlp.q_proj, which is not one of the seven projections",
    ),
    "dora magnitude": (
        with_extra(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", torch.ones(HIDDEN)),
        {},
        r"DoRA magnitude vector",
    ),
    "lora_B bias tensor": (
        with_extra(f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", torch.zeros(HIDDEN)),
        {},
        r"bias of lora_B",
    ),
    "base weight": (
        with_extra(f"{PREFIX}.0.self_attn.q_proj.weight", torch.zeros(HIDDEN, HIDDEN)),
        {},
        r"is not a LoRA weight lorad can apply",
    ),
    "layer out of range": (lora_tensors({(2, "q_proj"): 4}), {}, r"layer 2 but the base model has 2 layers"),
    "rank zero": (
        {
            f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(0, HIDDEN),
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(HIDDEN, 0),
        },
        {},
        r"has rank 0; the rank must be at least 1",
    ),
    "rank above max": (lora_tensors({(0, "q_proj"): 16}), {"r": 16}, r"rank 16, above max_lora_rank=8"),
    "A of another base": (replaced("lora_A.weight", torch.zeros(4, 32)), {}, r"takes 64 inputs"),
    "B of another base": (replaced("lora_B.weight", torch.zeros(32, 4)), {}, r"has 64 outputs"),
    "A and B ranks differ": (replaced("lora_B.weight", torch.zeros(HIDDEN, 3)), {}, r"their ranks differ"),
    "not a matrix": (replaced("lora_A.weight", torch.zeros(4, HIDDEN, 1)), {}, r"both must be matrices"),
    "integer weights": (replaced("lora_A.weight", torch.zeros(4, HIDDEN, dtype=torch.int8)), {}, r"dtype I8"),
    "NaN": (nan_at("lora_A.weight", float("nan")), {}, r"lora_A.weight holds NaN or Inf"),
    "Inf": (nan_at("lora_B.weight", float("inf")), {}, r"lora_B.weight holds NaN or Inf"),
    "-Inf": (nan_at("lora_A.weight", float("-inf")), {}, r"lora_A.weight holds NaN or Inf"),
    "A without B": (without("lora_B.weight"), {}, r"q_proj.lora_A.weight has no matching lora_B tensor"),
    "B without A": (without("lora_A.weight"), {}, r"q_proj.lora_B.weight has no matching lora_A tensor"),
    "two adapters in one file": (
        {**good_tensors(), **lora_tensors({(0, "q_proj"): 4}, infix=".other")},
        {},
        r"two lora_A tensors",
    ),
    "no tensors": ({}, {}, r"holds no LoRA tensors"),
    "weights on a module target_modules leaves out": (
        lora_tensors({(0, "q_proj"): 4, (1, "down_proj"): 4}), {"target_modules": ["gate_proj", "q_proj"]},
        r"layers.1.mlp.down_proj.lora_A.weight puts LoRA on model.layers.1.mlp.down_proj, which "
        r"target_modules=\['gate_proj', 'q_proj'\] \(exclude_modules=\[\]\) does not take",
    ),
    "weights on a module a regex target_modules leaves out": (
        lora_tensors({(0, "q_proj"): 4, (0, "v_proj"): 4}), {"target_modules": r".*\.q_proj"}, r"self_attn.v_proj, which"),
    "weights on an excluded module": (
        lora_tensors({(0, "q_proj"): 4, (1, "q_proj"): 4}),
        {"target_modules": ["q_proj"], "exclude_modules": ["layers.1.self_attn.q_proj"]}, r"layers.1.self_attn.q_proj, which"),
    "target_modules of another type": (good_tensors(), {"target_modules": {"q_proj": 1}}, r"target_modules must be a list"),
    "target_modules not a regex": (good_tensors(), {"target_modules": "q_proj("}, r"target_modules 'q_proj\(' is not a valid"),
}


@pytest.mark.parametrize("case", REFUSED_ADAPTERS)
def test_refused_adapter(tmp_path, case):
    tensors, config, pattern = REFUSED_ADAPTERS[case]
    directory = write_adapter(tmp_path / "bad", copy.deepcopy(tensors), **config)
    with pytest.raises(AdapterError, match=pattern) as raised:
        load_peft_adapter(directory, SPEC, max_rank=8, name="customer-7")
    assert raised.value.message.startswith(f"adapter 'customer-7' ({directory}): ")


def assert_refused(directory, pattern):
    with pytest.raises(AdapterError, match=pattern) as raised:
        load_peft_adapter(directory, SPEC, max_rank=8, name="customer-7")
    assert "'customer-7'" in raised.value.message
    assert raised.value.__cause__ is None  # a message, not a chained traceback


def test_missing_directory(tmp_path):
    assert_refused(tmp_path / "absent", r"the directory does not exist")


def test_missing_config(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_config.json").unlink()
    assert_refused(directory, r"no adapter_config.json")


def test_missing_weights(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").unlink()
    assert_refused(directory, r"no adapter_model.safetensors")


@pytest.mark.parametrize("pickle_name", ["adapter_model.bin", "adapter.pt"])
def test_pickle_only_adapter_is_never_unpickled(tmp_path, pickle_name, monkeypatch):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").unlink()
    (directory / pickle_name).write_bytes(b"\x80\x04 not even a real pickle")

    def refuse_to_unpickle(*args, **kwargs):
        raise AssertionError("a pickle was opened")

    monkeypatch.setattr(torch, "load", refuse_to_unpickle)
    assert_refused(directory, rf"only pickle files \({re.escape(pickle_name)}\).*never loaded.*safetensors")


def test_invalid_json(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_config.json").write_text('{"peft_type": "LORA", ')
    assert_refused(directory, r"adapter_config.json is not valid JSON")


def test_config_not_an_object(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_config.json").write_text("[1, 2]")
    assert_refused(directory, r"must hold a JSON object")


def test_garbage_safetensors(tmp_path):
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").write_bytes(b"\x00" * 5)
    assert_refused(directory, r"adapter_model.safetensors is corrupt or truncated")


def test_truncated_safetensors(tmp_path):
    directory = write_adapter(tmp_path / "a")
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert_refused(directory, r"adapter_model.safetensors is corrupt or truncated")


# --- the registry --------------------------------------------------------------------------------


def adapter_bytes(rank: int) -> int:
    in_features, out_features = SPEC.projection_shape("q_proj")
    return 4 * rank * (in_features + out_features)


def registry(tmp_path, names=("a", "b", "c"), budget=1 << 30, **kwargs) -> AdapterRegistry:
    result = AdapterRegistry(SPEC, max_rank=8, host_bytes_budget=budget, **kwargs)
    for name in names:
        result.register(name, write_adapter(tmp_path / name))
    return result


def test_register_reads_nothing_until_get(tmp_path):
    adapters = registry(tmp_path, names=("a",))
    assert adapters.names() == ["a"] and "a" in adapters and "z" not in adapters and len(adapters) == 1
    assert adapters.describe("a") == {
        "name": "a",
        "path": str(tmp_path / "a"),
        "rank": None,
        "targets": None,
        "nbytes": None,
        "location": "disk",
    }
    assert adapters.on_disk("a") and not adapters.on_disk("z")  # z: not registered, nothing to read
    adapter = adapters.get("a")
    assert adapters.get("a") is adapter and not adapters.on_disk("a")
    assert adapters.describe("a") == {**adapter.describe(), "location": "host"}
    assert adapters.host_bytes == adapter.nbytes == adapter_bytes(4)


def test_unknown_names_are_not_found(tmp_path):
    adapters = registry(tmp_path, names=())
    for call in (adapters.get, adapters.describe, adapters.unregister):
        with pytest.raises(NotFound, match="'nope' is not registered"):
            call("nope")


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("", r"invalid"),
        ("-leading-dash", r"invalid"),
        ("has space", r"invalid"),
        ("x" * 129, r"invalid"),
        ("base-model", r"the base model's name"),
    ],
)
def test_register_refuses_bad_names(tmp_path, name, pattern):
    adapters = AdapterRegistry(SPEC, 8, 1 << 20, reserved_names=["base-model"])
    with pytest.raises(AdapterError, match=pattern):
        adapters.register(name, write_adapter(tmp_path / "a"))


def test_register_accepts_path_like_names(tmp_path):
    adapters = registry(tmp_path, names=())
    adapters.register("org/team:v1.2_x-y", write_adapter(tmp_path / "a"))
    assert adapters.get("org/team:v1.2_x-y").name == "org/team:v1.2_x-y"


def test_register_refuses_missing_directory_or_config(tmp_path):
    adapters = registry(tmp_path, names=())
    with pytest.raises(AdapterError, match="does not exist"):
        adapters.register("a", tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        adapters.register("a", tmp_path / "empty")
    assert adapters.names() == []


def test_register_same_name_twice(tmp_path):
    adapters = registry(tmp_path, names=("a",))
    adapters.register("a", tmp_path / "a")  # same directory: nothing changes
    with pytest.raises(AdapterError, match="already registered"):
        adapters.register("a", write_adapter(tmp_path / "other"))


def test_lru_eviction_under_a_small_budget(tmp_path):
    adapters = registry(tmp_path, budget=2 * adapter_bytes(4))
    adapters.get("a")
    adapters.get("b")
    adapters.get("a")  # b is now the least recently used
    adapters.get("c")
    assert [adapters.describe(n)["location"] for n in "abc"] == ["host", "disk", "host"]
    assert adapters.host_bytes == 2 * adapter_bytes(4)
    adapters.get("b")  # read again from disk; a leaves
    assert [adapters.describe(n)["location"] for n in "abc"] == ["disk", "host", "host"]


def test_an_adapter_larger_than_the_budget_is_still_served(tmp_path):
    adapters = registry(tmp_path, budget=1)
    a = adapters.get("a")
    assert adapters.describe("a")["location"] == "host"
    adapters.get("b")  # the one just loaded stays; the older one leaves
    assert [adapters.describe(n)["location"] for n in "ab"] == ["disk", "host"]
    assert a.weights  # a caller holding an evicted adapter keeps valid tensors


def test_unregister_frees_host_bytes(tmp_path):
    adapters = registry(tmp_path)
    adapters.get("a")
    adapters.get("b")
    adapters.unregister("a")
    assert adapters.names() == ["b", "c"] and adapters.host_bytes == adapter_bytes(4)


def test_a_broken_adapter_leaves_others_served_and_can_be_fixed(tmp_path):
    adapters = registry(tmp_path, names=("good",))
    broken = write_adapter(tmp_path / "broken", use_dora=True)
    adapters.register("broken", broken)
    with pytest.raises(AdapterError, match="'broken'.*DoRA"):
        adapters.get("broken")
    with pytest.raises(AdapterError, match="'broken'.*DoRA"):  # remembered while the files are unchanged
        adapters.get("broken")
    assert adapters.get("good").weights
    assert adapters.describe("broken")["location"] == "disk"
    assert "DoRA" in adapters.describe("broken")["error"]
    write_adapter(broken)  # fixed on disk
    assert adapters.get("broken").targets == ("q_proj",)
    assert "error" not in adapters.describe("broken")


def test_concurrent_gets_read_the_disk_once(tmp_path, monkeypatch):
    adapters = registry(tmp_path, names=("a",))
    calls = []
    real_load = adapters_module.load_peft_adapter

    def counting_load(*args, **kwargs):
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(adapters_module, "load_peft_adapter", counting_load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(adapters.get("a"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)


def test_register_dir(tmp_path):
    root = tmp_path / "adapters"
    write_adapter(root / "alpha")
    write_adapter(root / "beta")
    (root / "no-config").mkdir()
    write_adapter(root / ".hidden")
    (root / "README.md").write_text("not an adapter")
    adapters = registry(tmp_path, names=())
    assert adapters.register_dir(root) == ["alpha", "beta"]
    assert adapters.names() == ["alpha", "beta"]
    assert adapters.get("beta").targets == ("q_proj",)


def test_register_dir_is_all_or_nothing(tmp_path):
    root = tmp_path / "adapters"
    write_adapter(root / "alpha")
    write_adapter(root / "zeta")
    adapters = registry(tmp_path, names=())
    adapters.register("zeta", write_adapter(tmp_path / "elsewhere"))
    with pytest.raises(AdapterError, match="'zeta' is already registered"):
        adapters.register_dir(root)
    assert adapters.names() == ["zeta"]
    with pytest.raises(AdapterError, match="does not exist"):
        adapters.register_dir(tmp_path / "absent")


def test_concurrent_loads_reserve_host_memory_before_they_read(tmp_path, monkeypatch):
    one = adapter_bytes(4)
    adapters = registry(tmp_path, names=("a", "b", "c", "d"), budget=2 * one)
    assert adapters_module.host_bytes_of(tmp_path / "a" / adapters_module.WEIGHTS_FILE) == one  # from the header
    seen, reading, lock = [], [0], threading.Lock()
    original = adapters_module.load_peft_adapter

    def slow_load(*args, **kwargs):
        with lock:
            reading[0] += 1
            seen.append(adapters.host_bytes + reading[0] * one)  # held, plus every load reading now
        try:
            threading.Event().wait(0.05)
            return original(*args, **kwargs)
        finally:
            with lock:
                reading[0] -= 1

    monkeypatch.setattr(adapters_module, "load_peft_adapter", slow_load)
    threads = [threading.Thread(target=adapters.get, args=(name,)) for name in "abcd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(seen) == 4 and max(seen) <= 2 * one  # four loads at once never hold more than the budget
    assert adapters.host_bytes <= 2 * one and adapters._reserved == 0
