"""scheduler/perf_model.py: least-squares fits recover known coefficients from noisy synthetic timings
(R^2 near 1), a wrong model form fits badly (low R^2), the kernel choice follows the models, and a
Profile survives a JSON round trip."""

from __future__ import annotations

import numpy as np
import pytest

from lorad.errors import BadRequest
from lorad.scheduler.perf_model import (
    BgmvModel,
    DecodeStepModel,
    LinearModel,
    MbgmvModel,
    PrefillModel,
    Profile,
    choose_kernel,
    example_profile,
    fit_bgmv,
    fit_collective,
    fit_decode_step,
    fit_mbgmv,
    fit_prefill,
)

RANKS = (8, 16, 32, 64, 128)


def random_batches(rng, count, max_batch=64):
    return [list(rng.choice(RANKS, size=rng.integers(1, max_batch + 1))) for _ in range(count)]


def test_linear_model_exact_and_noisy():
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 10, size=(200, 2))
    y = 3.0 * x[:, 0] - 2.0 * x[:, 1] + 5.0
    exact = LinearModel.fit(["a", "b"], x, y)
    assert exact.coef == pytest.approx((3.0, -2.0))
    assert exact.intercept == pytest.approx(5.0)
    assert exact.r2 == pytest.approx(1.0)
    assert exact.predict([1.0, 1.0]) == pytest.approx(6.0)
    noisy = LinearModel.fit(["a", "b"], x, y + rng.normal(0, 0.5, size=200))
    assert noisy.coef == pytest.approx((3.0, -2.0), abs=0.05)
    assert 0.98 < noisy.r2 < 1.0
    with pytest.raises(BadRequest):
        LinearModel.fit(["a", "b"], x[:2], y[:2])


def test_fit_bgmv_recovers_coefficients():
    rng = np.random.default_rng(1)
    truth = BgmvModel(alpha=4e-6, beta=2e-4)
    batches = random_batches(rng, 300)
    samples = [(b, truth.predict(b) * rng.normal(1.0, 0.02)) for b in batches]
    fitted = fit_bgmv(samples)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=0.03)
    assert fitted.beta == pytest.approx(truth.beta, abs=1e-4)
    assert fitted.r2 > 0.99


def test_fit_mbgmv_recovers_coefficients():
    rng = np.random.default_rng(2)
    truth = MbgmvModel(alpha=5e-6, beta=4e-4)
    samples = [(b, truth.predict(b) + rng.normal(0, 1e-4)) for b in random_batches(rng, 300)]
    fitted = fit_mbgmv(samples)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=0.03)
    assert fitted.r2 > 0.99


def test_wrong_model_form_fits_badly():
    """Timings that follow MBGMV (sum of ranks) on batches of one high rank among many low ones do not
    follow BGMV's batch * max rank; the R^2 says so."""
    rng = np.random.default_rng(3)
    truth = MbgmvModel(alpha=5e-6, beta=4e-4)
    batches = []
    for _ in range(300):
        size = int(rng.integers(1, 64))
        batch = [8] * size
        if rng.random() < 0.5:
            batch[0] = 128
        batches.append(batch)
    samples = [(b, truth.predict(b)) for b in batches]
    assert fit_mbgmv(samples).r2 > 0.999
    assert fit_bgmv(samples).r2 < 0.6
    # pure noise: nothing to explain
    noise = [(b, float(rng.normal(1e-3, 1e-4))) for b in batches]
    assert fit_mbgmv(noise).r2 < 0.1


def test_fit_decode_step_recovers_base_and_kernel():
    rng = np.random.default_rng(4)
    truth = DecodeStepModel(0.03, 5e-5, 2e-8, BgmvModel(4e-6, 0.0))
    samples = []
    for batch in random_batches(rng, 400):
        context = int(rng.integers(1, 2000)) * len(batch)
        samples.append((batch, context, truth.predict(batch, context) * rng.normal(1.0, 0.005)))
    fitted = fit_decode_step(samples, "bgmv")
    assert isinstance(fitted.lora, BgmvModel)
    assert fitted.fixed_s == pytest.approx(0.03, rel=0.02)
    assert fitted.per_request_s == pytest.approx(5e-5, rel=0.15)
    assert fitted.per_context_token_s == pytest.approx(2e-8, rel=0.1)
    assert fitted.lora.alpha == pytest.approx(4e-6, rel=0.05)
    assert fitted.r2 > 0.99
    assert fitted.predict([]) == 0.0
    with pytest.raises(BadRequest):
        fit_decode_step(samples, "sgmv")


def test_fit_prefill_recovers_coefficients():
    rng = np.random.default_rng(5)
    truth = PrefillModel(2e-4, 2e-8, 1e-8, 5e-3)
    samples = []
    for _ in range(300):
        prompts = [(int(rng.integers(8, 2048)), int(rng.choice(RANKS))) for _ in range(rng.integers(1, 8))]
        samples.append((prompts, truth.predict(prompts) * rng.normal(1.0, 0.01)))
    fitted = fit_prefill(samples)
    assert fitted.per_token_s == pytest.approx(2e-4, rel=0.05)
    assert fitted.per_square_token_s == pytest.approx(1e-8, rel=0.2)
    assert fitted.fixed_s == pytest.approx(5e-3, abs=2e-3)
    assert fitted.r2 > 0.99


def test_choose_kernel():
    bgmv = BgmvModel(alpha=4e-6, beta=2e-4)
    mbgmv = MbgmvModel(alpha=5e-6, beta=4e-4)
    assert choose_kernel([32] * 32, bgmv, mbgmv) == "bgmv"  # homogeneous: no padding to waste
    assert choose_kernel([128] + [8] * 31, bgmv, mbgmv) == "mbgmv"  # one high rank pads 31 low ones


def test_caraserve_figure5_ordering():
    """BGMV: batch * max rank decides; MBGMV: the sum of ranks does (CaraServe Fig. 5)."""
    instance1, instance2 = [32] * 24, [64] * 16
    bgmv, mbgmv = BgmvModel(4e-6, 0.0), MbgmvModel(5e-6, 0.0)
    assert bgmv.predict(instance1 + [64]) > bgmv.predict(instance2 + [64])
    assert mbgmv.predict(instance1 + [64]) < mbgmv.predict(instance2 + [64])


def test_profile_json_round_trip(tmp_path):
    for kernel in ("bgmv", "mbgmv"):
        profile = example_profile(kernel)
        path = tmp_path / f"{kernel}.json"
        profile.save(path)
        loaded = Profile.load(path)
        assert loaded == profile
        assert loaded.decode.lora.kernel == kernel
    (tmp_path / "bad.json").write_text('{"version": 1, "machine": {}}')
    with pytest.raises(BadRequest):
        Profile.load(tmp_path / "bad.json")
    with pytest.raises(BadRequest):
        Profile.load(tmp_path / "missing.json")


def test_fit_collective_recovers_coefficients_and_never_goes_negative():
    tokens = [1, 2, 4, 16, 32, 64]
    model = fit_collective([(t, 2e-5 + 1e-8 * t) for t in tokens], calls_per_step=80, size=2)
    assert (model.fixed_s, model.per_token_s) == pytest.approx((2e-5, 1e-8)) and model.r2 == pytest.approx(1.0)
    assert model.step_seconds(64) == pytest.approx(80 * (2e-5 + 64e-8)) and model.step_seconds(0) == 0.0
    # One slow sample at the largest size would pull the line's intercept below 0: it goes through the origin.
    spiked = fit_collective([(t, 3e-4 if t < 64 else 5e-3) for t in tokens], 4, 2)
    assert spiked.fixed_s == 0.0 and spiked.per_token_s > 0 and spiked.step_seconds(1) > 0
    # Times falling with size (noise): no negative slope, the mean alone.
    falling = fit_collective([(t, 3e-4 - 1e-6 * t) for t in tokens], 4, 2)
    assert falling.per_token_s == 0.0 and falling.fixed_s == pytest.approx(np.mean([3e-4 - 1e-6 * t for t in tokens]))
