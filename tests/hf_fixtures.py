"""Tiny random Hugging Face checkpoints and PEFT adapters built with transformers and peft, and the
HF + PEFT greedy reference lorad is compared with. Imported by conftest.py, whose fixtures tests reach
these through; test_checkpoint.py takes LLAMA3_ROPE from here too.

Weights are re-initialised with a larger spread than HF's 0.02 so that greedy decoding depends on the
prompt and the adapter (with std 0.02 every prompt decodes to one repeated token, and parity on that
proves little).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lorad.daemon.model.demo import build_tokenizer

# llama3 rope scaling, with an original context short enough that at head_dim 16 some frequencies are kept,
# some interpolated and some divided by `factor`.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)

# Phi-3's longrope with an original context of 16 tokens, so that prompts longer than it run on the long
# factors; with Phi-4-mini's partial rotary factor (12 of 16 dimensions of a head rotated: 6 factors each).
PHI3_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                     short_factor=[1.0, 1.1, 1.3, 1.7, 2.2, 3.0], long_factor=[1.0, 1.5, 2.5, 4.0, 9.0, 20.0])

# Every architecture lorad serves, in the shapes that exercise its code paths.
COMMON = dict(hidden_size=64, rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
ARCHITECTURES: dict[str, dict] = {
    # GQA (4 query heads share 2 KV heads), default RoPE, intermediate not a multiple of hidden.
    "llama": dict(family="llama", intermediate_size=172, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2),
    "llama3_rope": dict(family="llama", intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, rope_parameters=dict(LLAMA3_ROPE)),
    # lm_head shares the embedding: the checkpoint holds no lm_head.weight.
    "llama_tied": dict(family="llama", intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1, tie_word_embeddings=True),
    # head_dim * heads (128) != hidden (64), as in Mistral-Nemo; no sliding window.
    "mistral": dict(family="mistral", intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=16, sliding_window=None),
    # q/k/v biases (nonzero after re-initialisation).
    "qwen2": dict(family="qwen2", intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, use_sliding_window=False, tie_word_embeddings=False),
    # per-head q and k norms before RoPE; head_dim * heads (64) != hidden (48) as in Qwen3's larger sizes.
    "qwen3": dict(family="qwen3", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, use_sliding_window=False, tie_word_embeddings=False),
    # fused qkv_proj and gate_up_proj in the checkpoint and its adapters; GQA, so q, k and v differ in size.
    # (pad_token_id: Phi3Config's default, 32000, lies outside the tiny vocabulary.)
    "phi3": dict(family="phi3", intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=False, pad_token_id=None),
    # longrope and partial rotary (PHI3_LONGROPE); attention factor sqrt(1 + ln(512 / 16) / ln 16) = 1.5.
    "phi3_longrope": dict(family="phi3", intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=None,
                          rope_parameters=dict(PHI3_LONGROPE), original_max_position_embeddings=16),
    # A sliding window of 8 positions on every layer, below the prompts (up to 40) and the context.
    "mistral_window": dict(family="mistral", intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=8),
    # Local (window 8) and global layers alternating, capped attention scores and logits (caps low enough to
    # bite at these scales), an attention scale apart from head_dim, tanh GeGLU, four norms of (1 + w).
    "gemma2": dict(family="gemma2", intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
                   attn_logit_softcapping=3.0, final_logit_softcapping=6.0),
    # Local layers (window 8, RoPE base 10^4) around a global one (base 10^6 scaled linearly by 4), per-head
    # q and k norms; head_dim 24: K rows of 48 do not divide the hidden size (64), as in Gemma 3 12B.
    "gemma3": dict(family="gemma3", intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_scaling=dict(rope_type="linear", factor=4.0)),
    # gemma3 as the text decoder of a Gemma3ForConditionalGeneration checkpoint beside a tiny vision tower; its
    # adapters target the language model's projections alone (a regex: the tower has q_proj, k_proj, v_proj too).
    "gemma3_multimodal": dict(family="gemma3_multimodal", text=dict(
        intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        sliding_window=8, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        vision=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14), mm_tokens_per_image=4),
    # Saved in several shards: model.safetensors.index.json maps names to files.
    "llama_sharded": dict(family="llama", intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_shard_size="400KB"),
}

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> LoraConfig arguments. Ranks 1..32, several target sets, rslora, rank/alpha patterns.
ADAPTERS: dict[str, dict] = {
    "qv-r1": dict(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules=list(ALL)),
    "mlp-r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "o-down-r4": dict(r=4, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
    "rslora-r32": dict(r=32, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                       use_rslora=True),
    "pattern-r16": dict(
        r=16,
        lora_alpha=32,
        target_modules=list(ALL),
        rank_pattern={"k_proj": 2, "layers.1.mlp.down_proj": 5},
        alpha_pattern={"v_proj": 7, "layers.0.self_attn.o_proj": 64},
    ),
}

# Adapters of Phi-3, on the modules it has: the fused ones split into q, k, v (gate, up) by lorad.
PHI3_ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PHI3_ADAPTERS: dict[str, dict] = {
    "qkv-r1": dict(r=1, lora_alpha=2, target_modules=["qkv_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules=list(PHI3_ALL)),
    "mlp-r16": dict(r=16, lora_alpha=8, target_modules=["gate_up_proj", "down_proj"]),
    "o-down-r4": dict(r=4, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
    "rslora-r32": dict(r=32, lora_alpha=16, target_modules=["qkv_proj", "o_proj"], use_rslora=True),
    "pattern-r16": dict(
        r=16,
        lora_alpha=32,
        target_modules=list(PHI3_ALL),
        rank_pattern={"qkv_proj": 2, "layers.1.mlp.down_proj": 5},
        alpha_pattern={"gate_up_proj": 7, "layers.0.self_attn.o_proj": 64},
    ),
}


@dataclass
class Checkpoint:
    arch: str
    model_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)
    vocab_size: int = 0


def _config(arch: str, vocab_size: int):
    from transformers import (Gemma2Config, Gemma3Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    options = dict(COMMON, **ARCHITECTURES[arch])
    family = options.pop("family")
    options.pop("max_shard_size", None)
    if family == "gemma3_multimodal":
        text = {key: options.pop(key) for key in COMMON} | options.pop("text")
        return Gemma3Config(text_config=dict(vocab_size=vocab_size, **text), **options)
    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                    "phi3": Phi3Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}[family]
    return config_class(vocab_size=vocab_size, **options)


def _reinit(model, seed: int) -> None:
    """Every parameter ~ N(0, 0.1), norms ~ 1 + N(0, 0.05), embeddings ~ N(0, 1).

    A tied embedding stays at 0.1: at N(0, 1) the input token's own embedding dominates the last
    hidden state and every step predicts the token it was fed."""
    generator = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # a tied lm_head is not listed twice
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(1 + 0.05 * noise)
            elif "embed_tokens" in name:
                parameter.copy_((0.1 if tied else 1.0) * noise)
            elif "lm_head" in name:
                parameter.copy_(0.25 * noise)
            else:
                parameter.copy_(0.1 * noise)


def build_checkpoint(directory: Path, arch: str, seed: int = 0) -> Checkpoint:
    """A random HF checkpoint of `arch` (one of ARCHITECTURES) with tokenizer.json, saved by transformers."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    torch.manual_seed(seed)
    config = _config(arch, vocab_size)
    if ARCHITECTURES[arch]["family"] == "gemma3_multimodal":
        from transformers import Gemma3ForConditionalGeneration

        model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit(model, seed)
    model_dir = Path(directory) / "model"
    model.save_pretrained(model_dir, max_shard_size=ARCHITECTURES[arch].get("max_shard_size", "50GB"))
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return Checkpoint(arch=arch, model_dir=model_dir, vocab_size=vocab_size)


def load_base(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    return model.eval()


def build_adapter(model_dir: Path, directory: Path, options: dict, seed: int) -> Path:
    """A PEFT LoRA adapter on the checkpoint at model_dir, A and B random, saved by peft.

    PEFT initialises B to zero (an adapter that changes nothing); B is drawn so that each adapted
    projection's output moves by ~0.3 per unit of input whatever the rank and scaling.
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    base = load_base(model_dir)
    if type(base).__name__ == "Gemma3ForConditionalGeneration":  # the language model's projections only
        options = dict(options, target_modules=rf".*language_model.*\.({'|'.join(options['target_modules'])})")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, LoraLayer):
                continue
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            rank, in_features = a.shape
            scaling = module.scaling["default"]
            a.copy_(torch.randn(a.shape, generator=generator) / in_features**0.5)
            b.copy_(torch.randn(b.shape, generator=generator) * (0.3 / (scaling * rank**0.5)))
    model.save_pretrained(directory)
    return Path(directory)


def build_checkpoint_with_adapters(directory: Path, arch: str, seed: int = 0) -> Checkpoint:
    checkpoint = build_checkpoint(directory, arch, seed)
    adapters = PHI3_ADAPTERS if ARCHITECTURES[arch]["family"] == "phi3" else ADAPTERS
    for index, (name, options) in enumerate(adapters.items()):
        checkpoint.adapters[name] = build_adapter(
            checkpoint.model_dir, Path(directory) / "adapters" / name, options, seed=1000 * (seed + 1) + index
        )
    return checkpoint


class HFReference:
    """transformers + PEFT with every adapter loaded: greedy decoding of one request at a time. dtype: the base
    model's (bfloat16: as a user loads it in bfloat16; PEFT keeps the adapters in float32, its default)."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path], dtype: torch.dtype = torch.float32):
        from peft import PeftModel

        base = load_base(model_dir, dtype)
        names = list(adapters)
        if names:
            self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
            for name in names[1:]:
                self.model.load_adapter(adapters[name], adapter_name=name)
        else:
            self.model = base
        self.model.eval()
        self._memo: dict = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], adapter: str | None, max_tokens: int) -> tuple[list[int], list]:
        """(generated token ids, the [vocab] float32 logits each was picked from), no EOS stop.

        Every step recomputes the whole sequence (no KV cache): slower, but the plainest reference.
        """
        key = (tuple(prompt), adapter, max_tokens)
        if key in self._memo:
            return self._memo[key]
        if adapter is None:
            context = self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else nullcontext()
        else:
            self.model.set_adapter(adapter)
            context = nullcontext()
        ids = list(prompt)
        tokens, logits = [], []
        with context:
            for _ in range(max_tokens):
                step = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = int(step.argmax())
                tokens.append(token)
                logits.append(step.clone())
                ids.append(token)
        self._memo[key] = (tokens, logits)
        return tokens, logits
