"""bench/fp8_trained.py on the CPU: the smoke run trains, writes both checkpoints and the prompts, compare serves them
in float32, bf16 and FP8 (the reference path) and reports the agreements, and rounding reports each place's; `agreement`
counts flips by hand, and the E4M3 rounding's scales are checked by hand."""

from __future__ import annotations

import json
import math
import sys

import pytest

from bench_scripts import load

pytestmark = pytest.mark.slow


def test_train_then_compare_on_the_cpu(tmp_path, monkeypatch):
    fp8_trained = load("fp8_trained")
    monkeypatch.setattr(sys, "argv", ["fp8_trained.py", "train", str(tmp_path), "--smoke"])
    assert fp8_trained.main() == 0
    trained = json.loads((tmp_path / "train.json").read_text())
    assert trained["base"]["steps"] == 10
    assert trained["base"]["held_out_loss"] < math.log(fp8_trained.VOCAB)  # below a uniform guess: it learned
    assert set(trained["adapters"]) == set(fp8_trained.ADAPTER_PACKAGES)
    prompts = json.loads((tmp_path / "prompts.json").read_text())
    assert len(prompts) == fp8_trained.PROMPTS
    assert {p["adapter"] for p in prompts} == set(fp8_trained.ADAPTER_PACKAGES)
    assert all(16 <= len(p["ids"]) <= 256 and max(p["ids"]) < fp8_trained.VOCAB for p in prompts)

    out = tmp_path / "compare.json"
    monkeypatch.setattr(sys, "argv", ["fp8_trained.py", "compare", str(tmp_path), "--device", "cpu", "--prompts", "10",
                                      "--out", str(out)])
    assert fp8_trained.main() == 0
    report = json.loads(out.read_text())
    for kind in ("trained", "random"):
        result = report[kind]
        assert result["prompts"] == result["with_adapters"] == 10
        for pair in ("fp8_vs_bf16", "bf16_vs_float32", "fp8_vs_float32", "fp8_weights_vs_bf16", "fp8_kv_vs_bf16"):
            figures = result[pair]
            assert 0.0 <= figures["first_token_agreement"] <= 1.0
            assert 0.0 <= figures["mean_kl"] <= figures["max_kl"]
            flips = round((1 - figures["first_token_agreement"]) * 10)
            assert len(figures["flips_reference_margin"]) == flips
        assert 0.0 < result["bf16_top1_probability_mean"] <= 1.0
        assert result["fp8_status"]["quantization"]["method"] == "fp8"
        assert "reference path" in result["fp8_status"]["quantization"]["gemm"]
        assert result["fp8_status"]["kv_cache_dtype"] == "fp8_e4m3"

    out = tmp_path / "rounding.json"
    monkeypatch.setattr(sys, "argv", ["fp8_trained.py", "rounding", str(tmp_path), "--prompts", "6", "--out", str(out)])
    assert fp8_trained.main() == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 6
    layers = json.loads((tmp_path / "trained" / "config.json").read_text())["num_hidden_layers"]
    assert sorted(report["kv_max"]) == sorted(f"{layer}.{kv}" for layer in range(layers) for kv in "kv")
    assert all(value > 0 for value in report["kv_max"].values())
    for name, *_ in fp8_trained.ROUNDINGS:
        assert 0.0 <= report[name]["first_token_agreement"] <= 1.0
        assert report[name]["mean_kl"] > 0  # every place rounds something


def test_agreement_counts_the_flips_and_their_margins():
    import torch

    fp8_trained = load("fp8_trained")
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.5]])
    same = fp8_trained.agreement(([0, 1], logits), ([0, 1], logits))
    assert same["first_token_agreement"] == 1.0 and same["max_kl"] == pytest.approx(0.0, abs=1e-7)
    assert same["flips_reference_margin"] == []
    moved = fp8_trained.agreement(([0, 1], logits), ([0, 2], torch.tensor([[3.0, 1.0, 0.0], [0.0, 1.5, 2.0]])))
    assert moved["first_token_agreement"] == 0.5
    assert moved["flips_reference_margin"] == [0.5]
    assert moved["mean_kl"] > 0


def test_e4m3_rounding_scales_each_block_to_its_max():
    import torch

    fp8_trained = load("fp8_trained")
    x = torch.tensor([[1.0, -3.0, 0.5, 2.0] * 8, [100.0] + [1e-4] * 31])
    for per in ("channel", "group"):
        rounded = fp8_trained.round_scaled(x, per)
        assert rounded.shape == x.shape
        # each block's max maps to 448, which E4M3 holds exactly
        assert rounded.abs().amax(-1).tolist() == pytest.approx(x.abs().amax(-1).tolist())
        assert torch.allclose(rounded[0], x[0], rtol=2 ** -4)
    # one scale for the whole row: 1e-4 next to 100 falls below half E4M3's smallest step (2^-9 * 100 / 448): lost
    assert fp8_trained.round_scaled(x, "channel")[1, 1:].abs().max() == 0
    # a scale per 16 elements keeps the second group's 1e-4, its max, exactly
    assert fp8_trained.round_scaled(x, "group")[1, 16:].tolist() == pytest.approx([1e-4] * 16)
    assert fp8_trained.round_e4m3(torch.tensor([1000.0, -1000.0]), 1.0).tolist() == [448.0, -448.0]
