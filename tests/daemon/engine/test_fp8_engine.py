"""The engine with FP8 weights (--quantization fp8) and FP8 KV pages (--kv-cache-dtype fp8) on the CPU, through
the reference ops: the demo model's greedy tokens against float32's, the KV capacity of the same pool, what
/v1/status, /metrics and the start-up log say, and an FP8 checkpoint (compressed-tensors) served as it is."""

from __future__ import annotations

import logging

import pytest
import torch

from triton_interpreter import CUDA, HAS_TRITON, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.server.metrics import render
from lorad.errors import BadRequest

POOL_BYTES = 4 << 20
PROMPTS = 48


def make_engine(demo_assets, model_dir=None, **config) -> Engine:
    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items())
    return Engine(EngineConfig(model=str(model_dir or demo_assets.model_dir), adapters=adapters, device="cpu",
                               pool_bytes=POOL_BYTES, max_model_len=128, **config))


def first_tokens(engine: Engine, adapters: list[str | None]) -> tuple[list[int], torch.Tensor]:
    """The greedy first token and its logits [n, vocab] for PROMPTS random prompts, the adapters taken in turn."""
    generator = torch.Generator().manual_seed(5)
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    requests = [GenerationRequest(torch.randint(3, 512, (int(torch.randint(4, 40, (1,), generator=generator)),),
                                                generator=generator).tolist(),
                                  adapters[i % len(adapters)], greedy, keep_logits=True) for i in range(PROMPTS)]
    results = engine.generate(requests)
    return [r.token_ids[0] for r in results], torch.stack([r.logits[0] for r in results])


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference || other) of the next-token distributions."""
    log_p, log_q = reference.log_softmax(-1), other.log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


@pytest.fixture(scope="module")
def baseline(demo_assets):
    engine = make_engine(demo_assets)
    adapters = [None, *sorted(demo_assets.adapters)]
    return adapters, first_tokens(engine, adapters)


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("fp8", "auto"), ("auto", "fp8"), ("fp8", "fp8")])
def test_demo_first_tokens_match_float32(quantization, kv_cache_dtype, demo_assets, baseline):
    """FP8 weights and/or FP8 KV against float32, every demo adapter and the base model: the first generated
    token equal for at least 90% of the prompts and the next-token distributions close (the demo's random
    weights give flat distributions, whose argmax flips on small errors: a weak check)."""
    adapters, (tokens, logits) = baseline
    engine = make_engine(demo_assets, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    got_tokens, got_logits = first_tokens(engine, adapters)
    agreement = sum(a == b for a, b in zip(tokens, got_tokens)) / len(tokens)
    assert agreement >= 0.9, f"first tokens agree on {agreement:.0%} of {len(tokens)} prompts"
    assert mean_kl(logits, got_logits) < 0.02
    assert not torch.equal(logits, got_logits)  # FP8 did change something


def test_kv_capacity_doubles_in_a_bf16_pool(demo_assets):
    """A page is the same bytes whatever it holds: FP8 KV fits twice the tokens of bf16 (four times float32's)
    in the same pool, and the daemon reports it."""
    bf16 = make_engine(demo_assets, dtype="bfloat16")
    fp8 = make_engine(demo_assets, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fp8.pool.capacity == bf16.pool.capacity and fp8.pool.pages.dtype == torch.bfloat16
    assert fp8.kv.tokens_per_page == 2 * bf16.kv.tokens_per_page
    assert fp8.status()["kv_capacity_tokens"] == 2 * bf16.status()["kv_capacity_tokens"]
    assert fp8.status()["free_kv_tokens"] == 2 * bf16.status()["free_kv_tokens"]
    float32 = make_engine(demo_assets)
    float32_fp8 = make_engine(demo_assets, kv_cache_dtype="fp8")
    assert float32_fp8.status()["kv_capacity_tokens"] == 4 * float32.status()["kv_capacity_tokens"]
    # adapters keep their pages in the pool's dtype next to the FP8 KV pages
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    results = fp8.generate([GenerationRequest([5, 6, 7], "demo-r8", greedy), GenerationRequest([5, 6, 7], None, greedy)])
    assert all(len(r.token_ids) == 3 for r in results) and fp8.status()["pool"]["adapter"] > 0


def test_status_metrics_and_log_say_what_runs(demo_assets, caplog):
    with caplog.at_level(logging.INFO, logger="lorad.daemon.engine.engine"):
        engine = make_engine(demo_assets, quantization="fp8", kv_cache_dtype="fp8")
    status = engine.status()
    assert status["quantization"] == {"method": "fp8", "source": "load", "weight_scales": "channel",
                                      "activations": "dynamic per token",
                                      "gemm": "fp8 weights dequantized per GEMM (reference path)"}
    assert status["kv_cache_dtype"] == "fp8_e4m3"
    assert status["kv_cache_scales"] == "1.0 (no k_scale/v_scale in the checkpoint)"
    text = render(engine.metrics())
    assert 'lorad_engine_info{model_name="model",quantization="fp8",kv_cache_dtype="fp8_e4m3"} 1' in text
    assert f"lorad_kv_capacity_tokens {status['kv_capacity_tokens']}" in text
    log = caplog.text
    assert "gemm='fp8 weights dequantized per GEMM (reference path)'" in log
    assert "quantization=fp8 kv_cache_dtype=fp8_e4m3" in log
    plain = make_engine(demo_assets)
    assert plain.status()["quantization"] == {"method": "none"} and plain.status()["kv_cache_dtype"] == "float32"
    assert 'quantization="none",kv_cache_dtype="float32"' in render(plain.metrics())


def test_bad_values_are_refused():
    with pytest.raises(BadRequest, match="quantization must be one of auto, fp8, none, not 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(BadRequest, match="kv_cache_dtype must be one of auto, fp8, not 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")


def test_a_compressed_tensors_checkpoint_serves_as_it_is(demo_assets, baseline, tmp_path):
    """An FP8 checkpoint (per-channel weight scales, dynamic activations, K/V scales) with --quantization auto:
    its scales read, its tokens close to the float32 checkpoint's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
    from test_quantization import compressed_tensors, fp8_checkpoint

    fp8_checkpoint(demo_assets.model_dir, tmp_path / "ckpt", compressed_tensors(kv=True), kv_scales=True)
    engine = make_engine(demo_assets, model_dir=tmp_path / "ckpt", kv_cache_dtype="fp8")
    status = engine.status()
    assert status["quantization"]["source"] == "compressed-tensors"
    assert status["kv_cache_scales"] == "checkpoint (k_scale, v_scale per layer)"
    assert engine.runner.ops.kv_scales[3].tolist() == [3.5, 3.25]
    adapters, (tokens, logits) = baseline
    got_tokens, got_logits = first_tokens(engine, adapters)
    # K/V stored over scales of 0.5 to 3.5 (values of ~1 near E4M3's subnormals): coarser than scale 1.0
    assert sum(a == b for a, b in zip(tokens, got_tokens)) / len(tokens) >= 0.8


def test_the_flags_map_onto_the_config(monkeypatch):
    import lorad.daemon.server.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "serve", lambda args: seen.update(cli._config_values(args, "engine.")) or 0)
    assert cli.main(["serve", "--demo", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]) == 0
    assert seen == {"demo": True, "quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert EngineConfig(**seen).quantization == "fp8"


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="Triton's interpreter on the CPU (a GPU runs the compiled kernels: -m gpu)")
def test_rows_quantized_by_the_norms_and_activations_give_the_unfused_logits(demo_assets, monkeypatch):
    """FP8 weights through the Triton ops (the interpreter): the input norms and the post-attention norms quantize the
    rows for the FP8 GEMM that reads them (q|k|v, gate|up), and the tokens and logits equal, to the bit, those of the
    same ops quantizing in launches of their own (the same arithmetic, in one pass fewer)."""
    from lorad.daemon.model.ops import TritonOps
    from lorad.gpu_ops import bgmv, fp8_gemm, fused, gemv, mbgmm, mbgmv, paged_attention

    interpreted(fused._norm_fp8_kernel, bgmv, mbgmv, mbgmm, paged_attention, fused, gemv, fp8_gemm)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    adapters = [None, *sorted(demo_assets.adapters)][:3]

    def run(quantizing: bool):
        engine = make_engine(demo_assets, quantization="fp8", max_running_requests=4)
        ops = engine.runner.ops = engine.runner.model.ops = TritonOps(engine.device, 128, 64)
        if not quantizing:
            monkeypatch.setattr(ops, "_quantizes_for", lambda feeds, tokens: False)
        requests = [GenerationRequest(torch.randint(3, 512, (9 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist(),
                                      adapters[i % len(adapters)], greedy, keep_logits=True) for i in range(3)]
        try:
            return engine.generate(requests)
        finally:
            engine.close()

    launched = {"fused": 0, "rows": 0}

    def counted(kind, function):
        def call(*args):
            launched[kind] += 1
            return function(*args)
        return call

    for name in ("rms_norm_fp8", "add_rms_norm_fp8"):
        monkeypatch.setattr(fused, name, counted("fused", getattr(fused, name)))
    monkeypatch.setattr(fp8_gemm, "quantize_rows", counted("rows", fp8_gemm.quantize_rows))
    fused_results = run(True)
    assert launched["fused"] > 0 and launched["rows"] > 0  # o's and down's inputs are quantized by linear
    rows_alone = launched["rows"]
    unfused = run(False)
    assert launched["rows"] - rows_alone == 2 * rows_alone  # without the fused norms: q|k|v's and gate|up's inputs too
    for got, want in zip(fused_results, unfused):
        assert got.token_ids == want.token_ids
        assert torch.equal(torch.stack(got.logits), torch.stack(want.logits))
