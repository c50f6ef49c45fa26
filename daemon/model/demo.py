"""The built-in demo: a tiny random Llama checkpoint, its byte-level BPE tokenizer and eight PEFT LoRA
adapters, written by hand in the Hugging Face and PEFT on-disk formats (no transformers, no peft), so
`lorad --demo` serves something real without downloading anything.

The weights are random: the text is nonsense, but it is deterministic nonsense, which is what tests and
benchmarks need. `write_random_adapter` is public for the benchmarks' `lorad demo adapters`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec
from lorad.errors import ModelError

log = logging.getLogger(__name__)

# Bump when anything written below changes: a cached demo of another version is rebuilt.
FORMAT_VERSION = 2  # 2: tokenizer_config.json with a chat template
MARKER = "lorad-demo.json"
MODEL_NAME = "lorad-demo-llama"
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2
TOKENIZER_VOCAB = 512

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# The demo's chat template (lorad's own, plain text turns): /v1/chat/completions renders messages with it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# name -> (rank, targets, use_rslora, seed)
DEMO_ADAPTERS: dict[str, tuple[int, tuple[str, ...], bool, int]] = {
    "demo-r1": (1, ("q_proj", "v_proj"), False, 101),
    "demo-r2": (2, ATTENTION, False, 102),
    "demo-r4": (4, PROJECTIONS, False, 104),
    "demo-r8": (8, ("q_proj", "k_proj", "v_proj"), False, 108),
    "demo-r16": (16, PROJECTIONS, False, 116),
    "demo-r16-mlp": (16, MLP, False, 117),
    "demo-r32": (32, ("o_proj", "down_proj"), True, 132),
    "demo-r64": (64, PROJECTIONS, False, 164),
}

# The tokenizer's training text (written for lorad; any English prose would do).
CORPUS = """\
The lighthouse keeper woke before the sun, as he had every morning for thirty years. He climbed the
spiral stairs, counted the one hundred and twelve steps, and wiped the salt from the great lens. Out on
the water the fishing boats were already moving, small lights rocking on a grey sea. The wind came from
the north and smelled of rain.

In the village below, the baker was pulling the first loaves from the oven. Bread, she liked to say, is
only flour, water, salt and patience. The children who passed her window on their way to school pressed
their noses to the glass and argued about which loaf was the largest. Their teacher, a tall woman with a
green umbrella, told them that the answer was the one they would never get to eat.

A river runs through the valley behind the village. In spring it is fast and brown with melted snow; in
late summer it is slow and clear, and you can see the stones on the bottom and the small fish that hide
between them. Farmers use its water for their fields of wheat, barley and potatoes. An old stone bridge
crosses it near the mill, and on market days the bridge is so crowded with carts that nobody can move.

Computers are machines that follow instructions. A program is a list of those instructions, written in
a language that both people and machines can read. When the program runs, the computer reads each
instruction in turn, stores numbers in its memory, adds and compares them, and decides what to do next.
Modern processors do billions of these small steps every second, which is why a phone can play music,
show a map and answer a message at the same time.

Language models are programs that predict the next word of a text. They are trained on large amounts of
writing, and they learn which words tend to follow which. A small adapter, trained for one task, can
change what the model prefers to say without changing the model itself. Many adapters can share one
model: a server keeps the large weights once and swaps the small ones for each request.

The weather report for tomorrow: cloudy in the morning, with showers spreading from the west after
noon. Temperatures between 9 and 14 degrees. Winds from the southwest at 20 to 30 kilometres per hour,
stronger near the coast. On Sunday the sky should clear, and the evening will be cold and bright.

To make a simple soup, cut two onions, three carrots and a potato into small pieces. Warm a spoon of
oil in a large pot and cook the onions until they are soft. Add the other vegetables, a litre of water
and a pinch of salt, and let it simmer for twenty minutes. Taste it, add pepper, and serve it hot with
bread. The soup keeps for three days in a cold place and tastes better on the second day.

The history of the town begins with a road. Merchants travelling between the mountains and the sea
needed a place to rest their horses, and an inn was built where the road met the river. Houses grew
around the inn, then a church, a school and a market square. In 1850 the railway arrived, and the town
doubled in size within ten years. Today most of the old buildings are gone, but the inn still stands,
and its sign, a painted ship, is older than anyone can remember.

Questions people often ask: What time does the library open? Where is the nearest station? How much
does a ticket cost? Can I pay by card? Is there a room with a view of the sea? Why is the sky blue? Who
wrote this book, and when? Which way is north? How long does it take to walk to the harbour?

Numbers and symbols also appear in text: 0 1 2 3 4 5 6 7 8 9, 10, 100, 1000, 3.14, 2024-06-01, 50%,
$12.99, a + b = c, x * y, (one), [two], {three}, "quoted", 'single', #tag, @name, email@example.com.
"""


@dataclass(frozen=True)
class DemoAssets:
    model_dir: Path
    adapters: dict[str, Path]


def default_demo_root() -> Path:
    """$LORAD_DEMO_DIR, else $XDG_CACHE_HOME/lorad/demo, else ~/.cache/lorad/demo."""
    if os.environ.get("LORAD_DEMO_DIR"):
        return Path(os.environ["LORAD_DEMO_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "lorad" / "demo"


def build_demo(root: Path | None = None) -> DemoAssets:
    """The demo under `root` (default: default_demo_root()), built there first if it is missing.

    Built in a sibling temporary directory and renamed into place, so `root` holds either nothing or a
    whole demo: a crash leaves at most a stray temporary directory, and two racing builders both end
    with the same files.
    """
    root = Path(root) if root is not None else default_demo_root()
    if _is_complete(root):
        return _assets(root)
    if root.exists() and not root.is_dir():
        raise ModelError(f"{root} is a file, not a directory for the demo")
    if root.exists() and not (root / MARKER).exists() and any(root.iterdir()):
        raise ModelError(f"{root} is not empty and holds no lorad demo: refusing to overwrite it")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
    try:
        _write_demo(staging)
        _move_into_place(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("built demo root=%s version=%d", root, FORMAT_VERSION)
    return _assets(root)


def _assets(root: Path) -> DemoAssets:
    return DemoAssets(
        model_dir=root / "model",
        adapters={name: root / "adapters" / name for name in DEMO_ADAPTERS},
    )


def _is_complete(root: Path) -> bool:
    try:
        marker = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION


def _move_into_place(staging: Path, root: Path) -> None:
    """Move the finished `staging` to `root`, setting aside an older demo found there."""
    old = None
    if root.exists():
        if _is_complete(root):  # another builder won the race
            return
        if any(root.iterdir()):  # an older version of the demo (checked by the caller)
            old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
            os.rename(root, old / "demo")
    try:
        os.rename(staging, root)  # replaces an empty directory atomically
    except OSError:
        if not _is_complete(root):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _write_demo(root: Path) -> None:
    tokenizer = build_tokenizer()
    model_dir = root / "model"
    model_dir.mkdir()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    })
    config = demo_config(tokenizer.get_vocab_size())
    _write_json(model_dir / "config.json", config)
    _write_json(
        model_dir / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False, "max_new_tokens": 64},
    )
    spec = ModelSpec.from_hf_config(config)
    weights = random_llama_weights(spec, seed=0)
    # Damp the tokens that would print as garbage (lone bytes of multi-byte characters, control bytes,
    # <s>, <unk>) so that the demo's text, though nonsense, is readable.
    garbage = [token for token in range(spec.vocab_size) if not _is_printable(tokenizer.decode([token]))]
    weights["lm_head.weight"][garbage] *= 0.1
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    for name, (rank, targets, use_rslora, seed) in DEMO_ADAPTERS.items():
        write_random_adapter(root / "adapters" / name, spec, rank, targets, seed, use_rslora=use_rslora)
    # Written last: its presence means everything above is complete.
    _write_json(root / MARKER, {"format_version": FORMAT_VERSION, "adapters": sorted(DEMO_ADAPTERS)})
    _apply_umask_modes(root)


def _is_printable(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and all(c.isprintable() or c in "\n\t" for c in text)


def _apply_umask_modes(root: Path) -> None:
    """Give the demo the modes of the umask (mkdtemp and safetensors create them private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def build_tokenizer(corpus: str = CORPUS, vocab_size: int = TOKENIZER_VOCAB):
    """A byte-level BPE (vocab ~vocab_size) trained on `corpus`, by default the demo's CORPUS: every UTF-8
    string round-trips through encode and decode. Special tokens <s>=0, </s>=1, <unk>=2; the post-processor
    adds no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def demo_config(vocab_size: int) -> dict:
    """config.json of the demo model, in the keys transformers writes for a LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": 0.05,
        "use_cache": True,
    }


def random_llama_weights(spec: ModelSpec, seed: int, std: float = 0.08) -> dict[str, torch.Tensor]:
    """Every tensor of a Llama checkpoint by its HF name, float32, linear weights [out, in].

    Linear weights ~ N(0, std): large enough that greedy text depends on the prompt (HF's 0.02 makes
    every prompt decode to the same token). Embeddings ~ N(0, 1) keep the token's identity strong in
    the residual stream; norm weights are 1 + small noise.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale + mean

    h = spec.hidden_size
    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, h, scale=1.0)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.input_layernorm.weight"] = normal(h, mean=1.0, scale=0.05)
        for projection in PROJECTIONS:
            in_features, out_features = spec.projection_shape(projection)
            module = "self_attn" if projection in ATTENTION else "mlp"
            weights[f"{prefix}.{module}.{projection}.weight"] = normal(out_features, in_features)
        weights[f"{prefix}.post_attention_layernorm.weight"] = normal(h, mean=1.0, scale=0.05)
    weights["model.norm.weight"] = normal(h, mean=1.0, scale=0.05)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = normal(spec.vocab_size, h, scale=0.25)
    return weights


def write_random_adapter(
    directory: str | Path,
    spec: ModelSpec,
    rank: int,
    targets: tuple[str, ...] | list[str],
    seed: int,
    alpha: float | None = None,
    use_rslora: bool = False,
    base_model_name_or_path: str = MODEL_NAME,
) -> Path:
    """A PEFT LoRA adapter with random A and B for every layer and each projection in `targets` (among the
    modules the model has: `spec.lora_modules`, Phi-3's fused ones included).

    alpha defaults to 2 * rank. A ~ N(0, 1/in) and B is sized so that the folded update
    scaling * B @ A moves each output by ~0.3 per unit of input: visibly, whatever the rank.
    """
    unknown = set(targets) - set(spec.lora_modules)
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {spec.lora_modules}, not {targets}")
    if rank < 1:
        raise ValueError("rank must be positive")
    alpha = float(2 * rank if alpha is None else alpha)
    scaling = alpha / (rank**0.5 if use_rslora else rank)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for projection in spec.lora_modules:
            if projection not in targets:
                continue
            in_features, out_features = spec.module_shape(projection)
            module = "self_attn" if projection in ATTENTION or projection == "qkv_proj" else "mlp"
            name = f"base_model.model.model.layers.{layer}.{module}.{projection}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * (0.3 / (scaling * rank**0.5))
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = b
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = _peft_config(rank, alpha, targets, use_rslora, base_model_name_or_path)
    _write_json(directory / "adapter_config.json", config)
    return directory


def write_adapter_set(out: str | Path, spec: ModelSpec, count: int, ranks: list[int], targets: list[str], seed: int = 0) -> list[Path]:
    """`count` random PEFT adapters under `out` (adapter-0000, ...), ranks taken round robin (S-LoRA's
    S2 workload), for `lorad serve --adapter-dir out` and the benchmarks. Targets may be short names
    (q, k, v, o, gate, up, down; Phi-3's qkv, o, gate_up, down)."""
    full = [t if t.endswith("_proj") else f"{t}_proj" for t in targets]
    unknown = [t for t in full if t not in spec.lora_modules]
    if unknown or not full:
        raise ValueError(f"targets must name projections among {', '.join(spec.lora_modules)}; not {unknown or targets}")
    if count < 1 or not ranks or min(ranks) < 1:
        raise ValueError("count and every rank must be positive")
    width = max(4, len(str(count - 1)))
    return [
        write_random_adapter(Path(out) / f"adapter-{index:0{width}d}", spec, ranks[index % len(ranks)], full, seed + index)
        for index in range(count)
    ]


def _peft_config(rank: int, alpha: float, targets, use_rslora: bool, base_model: str) -> dict:
    """adapter_config.json with the fields PEFT writes for a plain LoRA."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(targets),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }
