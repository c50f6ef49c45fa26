"""bench/goodput_replay.py: the engine's scheduler over Poisson arrivals on a clock of modelled step times. A lone
request's TTFT and TPOT are its steps' modelled times; a burst behind a small running cap queues, and a larger cap
lets it in."""

from __future__ import annotations

import numpy as np

import bench_scripts
from lorad.daemon.bench.serve import send_times
from lorad.daemon.engine.step_cost import DeviceRates, SequenceInStep, StepCostModel
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

RATES = DeviceRates(1e12, 1e14)


def cost_model() -> StepCostModel:
    return StepCostModel(ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"]), 2, adapter_ranks=lambda name: {})


def test_arrivals_are_bench_serves():
    bench = bench_scripts.load("goodput_replay")
    assert bench.arrivals(50, 7.0, seed=3) == send_times([None] * 50, 7.0, 1.0, np.random.default_rng(3))


def test_a_lone_request_takes_its_steps_modelled_times():
    bench = bench_scripts.load("goodput_replay")
    cost = cost_model()
    [request] = bench.replay([(8, 3)], [0.5], None, kv_tokens=1000, max_running=4, max_batch_tokens=64, reserve=False,
                             cost=cost, rates=RATES)

    def seconds(kind: str, rows: int, context: int) -> float:
        step = cost.cost([SequenceInStep(rows, context, True, None)])
        return bench.BUSY_OVER_FLOOR[kind] * step.floor_s(RATES.bandwidth_bytes_per_s, RATES.flops_per_s)

    prefill = seconds("prefill", 8, 8)
    assert request["first_s"] == 0.5 + prefill  # it arrived at 0.5 s and ran at once
    assert np.isclose(request["end_s"], request["first_s"] + seconds("decode", 1, 9) + seconds("decode", 1, 10))


def test_a_larger_running_cap_lets_a_burst_in():
    bench = bench_scripts.load("goodput_replay")
    lengths = [(16, 40)] * 12
    at = [0.0] * 12  # all at once
    runs = {cap: bench.summarize(bench.replay(lengths, at, None, kv_tokens=10_000, max_running=cap, max_batch_tokens=256,
                                              reserve=False, cost=cost_model(), rates=RATES), ttft_s=1.0, tpot_s=1.0)
            for cap in (2, 12)}
    assert runs[12]["ttft_ms"]["p99"] < runs[2]["ttft_ms"]["p99"] / 3  # the small cap's last requests waited for slots
    assert runs[12]["tpot_ms"]["p50"] > runs[2]["tpot_ms"]["p50"]  # each step of the larger batch is longer
    assert runs[2]["share_met"] == runs[12]["share_met"] == 1.0  # against loose objectives, both meet them


def test_the_command_writes_its_sweep(tmp_path, monkeypatch, capsys):
    import json
    import sys

    bench = bench_scripts.load("goodput_replay")
    out = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", ["goodput_replay.py", "--dataset", "random", "--num-prompts", "24", "--input-len", "64",
                                      "--output-len", "16", "--model-config", "tiny-llama", "--rates", "1,1000",
                                      "--running", "2,16", "--reserve", "off", "--adapters", "4", "--out", str(out)])
    bench.main()
    report = json.loads(out.read_text())
    assert [config["max_running_requests"] for config in report["configs"]] == [2, 16]
    for config in report["configs"]:
        slow, fast = config["points"]
        assert slow["share_met"] == 1.0 and config["goodput_rate"] in (1.0, 1000.0)
        assert fast["ttft_ms"]["p99"] >= slow["ttft_ms"]["p99"]  # all at once, some wait
    assert "goodput:" in capsys.readouterr().out
