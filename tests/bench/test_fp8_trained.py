"""bench/fp8_trained.py on the CPU: the smoke run trains, writes both checkpoints and the prompts, and compare serves
them in float32, bf16 and FP8 (the reference path) and reports the agreements; `agreement` counts flips by hand."""

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
