"""FP8 weights and KV pages against bf16 on a trained model: figure 25.1's accuracy check where the next-token
distributions are not flat. No trained checkpoint can be downloaded on these machines, and on random weights the
top logits lie so close that any rounding swaps them; so `train` makes one on the CPU: a small Llama
(transformers) and LoRA adapters (PEFT), trained on Python's own standard library source (the interpreter's,
PSF licence), whose held-out files give the prompts. It writes beside them the same shape with random weights
and random adapters of the same names, the contrast.

`compare` serves each checkpoint in lorad in float32, in bf16, with `--quantization fp8 --kv-cache-dtype fp8` (bf16
activations) and with each of the two alone. Over the held-out prompts (each with one of the adapters, in turn) it
reports the share whose greedy first token is the same and the mean KL divergence of the next-token distributions:
FP8 against bf16 (the figure), each against float32 (what bf16's own rounding does to the same prompts: the
baseline), and FP8 weights alone and the FP8 KV cache alone against bf16; the margins where the tokens differ; and
the distributions' own (bf16's top-1 probability, its top-1 minus top-2 logit), which make the check meaningful or
not. On cuda that is the FP8 GEMMs with per-token activation scales and the FP8 attention kernels; on the CPU the
reference path (weights dequantized per GEMM, activations not quantized): a check of the script, not of FP8.

`rounding` asks which scales could do better. It runs the trained model in transformers + PEFT in bf16 on the CPU
and rounds to E4M3 at one place or several: the weights (a scale per output channel, lorad's), the GEMMs' inputs (a
scale per token, lorad's; the adapters read them unrounded, as in lorad), K and V as the pages hold them (after
RoPE; at scale 1.0, lorad's without checkpoint scales, or at each layer's max over these very prompts / 448, the
best a calibration could find), and everything with a scale per 16 elements instead. Against the same model
unrounded it reports what `compare` does.

    python3 bench/fp8_trained.py train DIR                 # the CPU (2 cores): ~20 minutes; --smoke: seconds
    python3 bench/fp8_trained.py compare DIR --out OUT.json [--device cpu] [--models trained]
    python3 bench/fp8_trained.py rounding DIR --out OUT.json   # the CPU (2 cores): ~1 minute
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec, dummy_weights
from lorad.daemon.model.demo import build_tokenizer, write_random_adapter
from lorad.gpu_ops import fp8

VOCAB = 1024
SEQ = 256
PROMPTS = 256
# Each adapter is trained on one package of the standard library; the prompts of its turn come from that
# package's held-out files. The base model is trained on the rest.
ADAPTER_PACKAGES = {"asyncio": 8, "email": 16, "unittest": 32, "idlelib": 64}  # package: rank


def config_json() -> dict:
    """Multi-head attention and a SiLU MLP, as the 7B shape has, at a size the CPU trains in minutes."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 1024, "vocab_size": VOCAB, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02,
        "use_cache": False,
    }


def corpus_files() -> dict[str, list[Path]]:
    """The standard library's .py files (tests left out), split into held-in and held-out (one in ten, by a
    hash of the path), each side keyed by package ("" for the rest)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    split: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in ("test", "site-packages", "lib2to3") or "tests" in relative.parts:
            continue
        package = relative.parts[0] if relative.parts[0] in ADAPTER_PACKAGES else ""
        side = "held_out" if zlib.crc32(str(relative).encode()) % 10 == 0 else "held_in"
        split.setdefault(f"{side}:{package}", []).append(path)
    return split


def read_text(paths: list[Path], limit: int | None = None) -> str:
    """The files joined, cut at `limit` characters (the smoke run's)."""
    text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in paths)
    return text[:limit] if limit else text


def batches(ids: torch.Tensor, batch: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, ids.numel() - SEQ - 1, (batch,), generator=generator)
        yield torch.stack([ids[s: s + SEQ] for s in starts.tolist()])


def fit(model, ids: torch.Tensor, steps: int, lr: float, batch: int, seed: int, label: str) -> dict:
    """AdamW over `steps` batches of random windows of ids, the rate warmed up over 20 steps and then
    cosine-decayed (to a twentieth)."""
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    started, losses = time.perf_counter(), []
    model.train()
    for step, tokens in zip(range(steps), batches(ids, batch, generator)):
        scale = min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        loss = model(input_ids=tokens, labels=tokens).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 50 == 0:
            print(f"{label}: step {step + 1}/{steps} loss {sum(losses[-50:]) / 50:.3f}", flush=True)
    return {"steps": steps, "seconds": time.perf_counter() - started, "final_loss": sum(losses[-10:]) / len(losses[-10:])}


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor, windows: int = 16) -> float:
    """The mean next-token loss (nats) over `windows` random windows of held-out tokens."""
    model.eval()
    tokens = next(batches(ids, windows, torch.Generator().manual_seed(7)))
    return float(model(input_ids=tokens, labels=tokens).loss)


def train(args) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = Path(args.dir)
    files = corpus_files()
    limit = 256 << 10 if args.smoke else None
    base_text = read_text(files.get("held_in:", []), limit)
    tokenizer = build_tokenizer(base_text[: 8 << 20], VOCAB)
    encode = lambda text: torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)  # noqa: E731
    base_ids = encode(base_text)
    print(f"corpus: {len(base_text) / 1e6:.1f} MB, {base_ids.numel() / 1e6:.2f}M tokens", flush=True)

    config = config_json()
    model = LlamaForCausalLM(LlamaConfig(**config))
    base_steps, adapter_steps = (10, 10) if args.smoke else (args.steps, args.adapter_steps)
    report = {"config": config, "base": fit(model, base_ids, base_steps, 3e-3, 16, 0, "base")}
    held_out_ids = encode(read_text(files.get("held_out:", []), limit))
    report["base"]["held_out_loss"] = held_out_loss(model, held_out_ids)
    model_dir = out / "trained"
    model.save_pretrained(model_dir, safe_serialization=True)
    # the keys above, as the demo's and the tests' checkpoints carry them, over transformers' rewrite of them
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))

    held_out = {package: encode(read_text(files[f"held_out:{package}"], limit)) for package in ADAPTER_PACKAGES}
    report["adapters"] = {}
    for index, (package, rank) in enumerate(ADAPTER_PACKAGES.items()):
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), lora_dropout=0.0)
        wrapped = get_peft_model(model, lora)
        ids = encode(read_text(files[f"held_in:{package}"], limit))
        report["adapters"][package] = fit(wrapped, ids, adapter_steps, 2e-3, 8, 1 + index, package)
        report["adapters"][package]["held_out_loss"] = held_out_loss(wrapped, held_out[package])
        wrapped.save_pretrained(model_dir / "adapters" / package)
        model = wrapped.unload()  # the base weights back, untouched by the adapter's training

    # The same shape with random weights (as figure 25.1's 7B model) and random adapters (`lorad demo adapters`),
    # of the same names: the contrast.
    spec = ModelSpec.from_hf_config(config)
    random_dir = out / "random"
    random_dir.mkdir(parents=True, exist_ok=True)
    weights = dummy_weights(spec, torch.float32, torch.device("cpu"))  # what --dummy-weights draws
    save_file(weights, str(random_dir / "model.safetensors"), metadata={"format": "pt"})
    (random_dir / "config.json").write_text(json.dumps(config, indent=1))
    for index, (package, rank) in enumerate(ADAPTER_PACKAGES.items()):
        write_random_adapter(random_dir / "adapters" / package, spec, rank, PROJECTIONS, seed=index)

    # Prompts: windows of 16 to 256 tokens of the held-out files of each adapter's package, the adapters in turn.
    rng = random.Random(11)
    names = list(ADAPTER_PACKAGES)
    prompts = []
    for i in range(PROMPTS):
        adapter = names[i % len(names)]
        ids = held_out[adapter]
        length = rng.randint(16, 256)
        start = rng.randrange(0, ids.numel() - length)
        prompts.append({"adapter": adapter, "ids": ids[start: start + length].tolist()})
    (out / "prompts.json").write_text(json.dumps(prompts))
    (out / "train.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=1))
    return 0


def first_tokens(engine, prompts: list[dict]) -> tuple[list[int], torch.Tensor]:
    from lorad.daemon.engine.request import GenerationRequest, SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest(p["ids"], p["adapter"], greedy, keep_logits=True) for p in prompts])
    return [r.token_ids[0] for r in results], torch.stack([r.logits[0].float().cpu() for r in results])


# (name, dtype, quantization, kv_cache_dtype): float32 is the reference both others round away from
# FP8 weights alone and the FP8 KV cache alone: which of the two moves the distributions
ENGINES = (("float32", "float32", "none", "auto"), ("bf16", "bfloat16", "none", "auto"),
           ("fp8", "bfloat16", "fp8", "fp8"), ("fp8_weights", "bfloat16", "fp8", "auto"),
           ("fp8_kv", "bfloat16", "none", "fp8"))


def agreement(reference: tuple[list[int], torch.Tensor], other: tuple[list[int], torch.Tensor]) -> dict:
    """How `other`'s greedy first tokens and next-token distributions follow `reference`'s: the share of equal
    tokens, the KL divergence (reference || other), and the reference's top-1 minus top-2 logit where they differ."""
    (tokens, logits), (other_tokens, other_logits) = reference, other
    log_p, log_q = F.log_softmax(logits, -1), F.log_softmax(other_logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top2 = logits.topk(2, dim=-1).values
    flips = [i for i, (a, b) in enumerate(zip(tokens, other_tokens)) if a != b]
    return {"first_token_agreement": 1 - len(flips) / len(tokens), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "flips_reference_margin": sorted(round(float(top2[i, 0] - top2[i, 1]), 4) for i in flips)}


def serve_all(model_dir: Path, prompts: list[dict], device: str) -> dict:
    """The prompts' first tokens from each of ENGINES on model_dir, one engine at a time; FP8 against bf16 (the
    figure), and each against float32 (how far bf16's own rounding moves them)."""
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine

    outputs, status = {}, {}
    for name, dtype, quantization, kv_cache_dtype in ENGINES:
        engine = Engine(EngineConfig(
            model=str(model_dir), adapter_dirs=(str(model_dir / "adapters"),), device=device, dtype=dtype,
            max_model_len=1024, max_running_requests=64, max_lora_rank=64, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype))
        status[name] = {key: engine.status()[key] for key in ("quantization", "kv_cache_dtype")}
        outputs[name] = first_tokens(engine, prompts)
        engine.close()
        del engine
        gc.collect()
    bf16_logits = outputs["bf16"][1]
    top2 = bf16_logits.topk(2, dim=-1).values
    return {
        "prompts": len(prompts), "with_adapters": sum(p["adapter"] is not None for p in prompts),
        "fp8_vs_bf16": agreement(outputs["bf16"], outputs["fp8"]),
        "bf16_vs_float32": agreement(outputs["float32"], outputs["bf16"]),
        "fp8_vs_float32": agreement(outputs["float32"], outputs["fp8"]),
        "fp8_weights_vs_bf16": agreement(outputs["bf16"], outputs["fp8_weights"]),
        "fp8_kv_vs_bf16": agreement(outputs["bf16"], outputs["fp8_kv"]),
        "bf16_top1_probability_mean": float(F.softmax(bf16_logits, -1).max(-1).values.mean()),
        "bf16_top1_minus_top2_logit_median": float((top2[:, 0] - top2[:, 1]).median()),
        "fp8_status": status["fp8"],
    }


# (name, weights, activations, kv): where E4M3 rounding is simulated, and at what scale ("channel": one per output
# channel; "token": one per row; "group": one per 16 elements; kv also "one": 1.0, "calibrated": one per layer)
ROUNDINGS = (("weights", "channel", None, None), ("activations", None, "token", None),
             ("weights_activations", "channel", "token", None), ("kv_scale_one", None, None, "one"),
             ("kv_calibrated", None, None, "calibrated"), ("all_kv_scale_one", "channel", "token", "one"),
             ("all_kv_calibrated", "channel", "token", "calibrated"), ("all_groups_of_16", "group", "group", "group"))
GROUP = 16


def round_e4m3(x: torch.Tensor, scale) -> torch.Tensor:
    """x rounded to E4M3 at one scale, as the KV write stores K and V (gpu_ops.fp8.to_kv), read back in x's dtype."""
    return fp8.from_kv(fp8.to_kv(x, scale), scale, x.dtype)


def round_scaled(x: torch.Tensor, per: str) -> torch.Tensor:
    """x rounded to E4M3 with a scale per row of its last dim ("channel", "token": gpu_ops.fp8.quantize_rows_ref,
    as the FP8 GEMM scales its weights' rows and its input rows) or per 16 of its elements ("group"), each its
    block's max / 448; back in x's dtype."""
    rows, scale = fp8.quantize_rows_ref(x.reshape(-1, GROUP if per == "group" else x.shape[-1]))
    return (rows.float() * scale).reshape(x.shape).to(x.dtype)


def rounding(args) -> int:
    from peft import PeftModel
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    root = Path(args.dir)
    prompts = json.loads((root / "prompts.json").read_text())[: args.prompts]
    model_dir = root / "trained"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    names = sorted({p["adapter"] for p in prompts})
    model = PeftModel.from_pretrained(model, model_dir / "adapters" / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(model_dir / "adapters" / name, adapter_name=name)
    model.eval()
    place = {"weights": None, "activations": None, "kv": None}
    kv_max: dict[tuple[int, int], float] = {}
    kv_scales: dict[tuple[int, int], float] = {}

    def attention(module, query, key, value, *rest, **kwargs):
        layer = module.layer_idx
        if not kv_scales:  # the unrounded run: each layer's K and V max
            for column, tensor in enumerate((key, value)):
                kv_max[layer, column] = max(kv_max.get((layer, column), 0.0), float(tensor.abs().amax()))
        if place["kv"] == "group":
            key, value = round_scaled(key, "group"), round_scaled(value, "group")
        elif place["kv"] is not None:
            key, value = (round_e4m3(t, 1.0 if place["kv"] == "one" else kv_scales[layer, column])
                          for column, t in enumerate((key, value)))
        return sdpa_attention_forward(module, query, key, value, *rest, **kwargs)

    AttentionInterface.register("e4m3_kv", attention)
    model.base_model.model.set_attn_implementation("e4m3_kv")
    # the projections under the adapters: PEFT's LoRA layers call base_layer(x) and add the adapter's own x @ A @ B
    bases = [module.base_layer for module in model.modules() if hasattr(module, "base_layer")]
    original = {id(base): base.weight.detach().clone() for base in bases}
    rounded = {per: {id(base): round_scaled(original[id(base)], per) for base in bases} for per in ("channel", "group")}

    def round_input(module, inputs):
        if place["activations"] is not None:
            return (round_scaled(inputs[0], place["activations"]),)

    for base in bases:
        base.register_forward_pre_hook(round_input)

    @torch.no_grad()
    def run() -> tuple[list[int], torch.Tensor]:
        for base in bases:
            base.weight.copy_(rounded[place["weights"]][id(base)] if place["weights"] else original[id(base)])
        tokens, logits = [], []
        for prompt in prompts:
            model.set_adapter(prompt["adapter"])
            last = model(input_ids=torch.tensor([prompt["ids"]])).logits[0, -1].float()
            tokens.append(int(last.argmax()))
            logits.append(last)
        return tokens, torch.stack(logits)

    reference = run()  # unrounded; it also finds each layer's K and V max over the prompts
    kv_scales.update({key: value / fp8.FP8_MAX for key, value in kv_max.items()})
    report = {"prompts": len(prompts), "model": model_dir.name, "kv_max": {f"{layer}.{'kv'[column]}": round(value, 3)
                                                                          for (layer, column), value in kv_max.items()}}
    for name, weights, activations, kv in ROUNDINGS:
        place.update(weights=weights, activations=activations, kv=kv)
        report[name] = agreement(reference, run())
        print(name, json.dumps(report[name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def compare(args) -> int:
    root = Path(args.dir)
    prompts = json.loads((root / "prompts.json").read_text())[: args.prompts]
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (reference path)",
              "torch": torch.__version__, "train": json.loads((root / "train.json").read_text())}
    for kind in args.models.split(","):
        report[kind] = serve_all(root / kind, prompts, args.device)
        print(kind, json.dumps(report[kind]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train the model and adapters on the CPU, write DIR")
    train_parser.add_argument("dir")
    train_parser.add_argument("--steps", type=int, default=600, help="the base model's, 16 windows of 256 tokens each")
    train_parser.add_argument("--adapter-steps", type=int, default=250, help="each adapter's, 8 windows each")
    train_parser.add_argument("--smoke", action="store_true", help="a small corpus and 10 steps each: checks the script")
    compare_parser = commands.add_parser("compare", help="serve DIR's models in float32, bf16 and FP8")
    compare_parser.add_argument("dir")
    compare_parser.add_argument("--device", default="cuda")
    compare_parser.add_argument("--prompts", type=int, default=PROMPTS)
    compare_parser.add_argument("--models", default="trained,random", choices=("trained,random", "trained", "random"))
    compare_parser.add_argument("--out")
    rounding_parser = commands.add_parser("rounding", help="E4M3 rounding at each place and scale, on the CPU")
    rounding_parser.add_argument("dir")
    rounding_parser.add_argument("--prompts", type=int, default=PROMPTS)
    rounding_parser.add_argument("--out")
    args = parser.parse_args()
    return {"train": train, "compare": compare, "rounding": rounding}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
