"""The time-per-token rule in the real engine (demo model, CPU): without a profile it is off and says so;
with a decode-step model (injected here: no profile on this machine) a request waits instead of joining a
batch whose predicted step would break slo_tpot_ms, every request still finishes, and the holds are
counted in /v1/status and /metrics."""

from __future__ import annotations

from lorad.daemon.server.metrics import render
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.scheduler.perf_model import BgmvModel, DecodeStepModel

# test_engine_admission.py's engine builder (pytest puts this folder on sys.path).
from test_engine_admission import demo_engine

# 4 ms a step plus 2 ms a row: one row fits 7 ms, two do not
DECODE = DecodeStepModel(fixed_s=0.004, per_request_s=0.002, per_context_token_s=0.0, lora=BgmvModel(0.0, 0.0))


def test_the_rule_is_off_without_a_profile_or_objective(demo_assets):
    engine = demo_engine(demo_assets, slo_tpot_ms=7)
    assert engine.status()["admission"]["tpot_rule"] == "off (no profile)"
    assert engine.scheduler.decode is None
    engine = demo_engine(demo_assets)
    assert engine.status()["admission"]["tpot_rule"] == "off (no slo_tpot_ms)"


def test_a_request_waits_rather_than_break_the_objective(demo_assets):
    engine = demo_engine(demo_assets, slo_tpot_ms=7)
    engine.scheduler.decode = DECODE
    requests = [GenerationRequest([5 + i] * 6, "demo-r8", SamplingParams(max_tokens=3, ignore_eos=True))
                for i in range(3)]
    results = engine.generate(requests)
    assert [r.finish_reason for r in results] == ["length"] * 3  # one at a time, none starved
    assert engine.status()["admission"]["tpot_held"] == 2
    assert "lorad_admission_tpot_held_total 2" in render(engine.metrics()).splitlines()
