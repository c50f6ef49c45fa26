"""scheduler/simulator.py: one engine under light load gives the models' own times, requests are
conserved (a serial engine's makespan is the sum of its service times), KV limits serialise, runs are
deterministic, rank-aware routing beats MostIdle and Random on time-per-token SLO attainment for a
mixed-rank heavy BGMV workload, and 60 engines x 20,000 requests simulate quickly."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from lorad.errors import BadRequest
from lorad.scheduler.perf_model import example_profile
from lorad.scheduler.router import FirstFit, MostIdle, Random, RankAware
from lorad.scheduler.simulator import SimConfig, simulate
from lorad.scheduler.workload import Trace, TraceRequest, UniformLengths, gamma_workload, serverless_workload

PROFILE = example_profile("bgmv")


def unloaded_service(request: TraceRequest, rank: int) -> tuple[float, float]:
    """(prefill time, decode time) of a request alone on an engine: the models summed step by step."""
    prefill = PROFILE.prefill.predict([(request.prompt_tokens, rank)])
    decode = sum(
        PROFILE.decode.predict([rank], request.prompt_tokens + 1 + step) for step in range(request.output_tokens - 1)
    )
    return prefill, decode


def sparse_trace() -> Trace:
    requests = [TraceRequest(100.0 * i, f"a{i % 3}", 50 + 40 * i, 1 + 7 * i) for i in range(6)]
    return Trace(requests, {"a0": 8, "a1": 64, "a2": 128})


def test_single_engine_light_load_follows_the_models():
    trace = sparse_trace()
    result = simulate(trace, PROFILE, MostIdle(), SimConfig(num_engines=1))
    for i, request in enumerate(trace.requests):
        prefill, decode = unloaded_service(request, trace.adapter_ranks[request.adapter])
        assert result.ttft_s[i] == pytest.approx(prefill)
        assert result.latency_s[i] == pytest.approx(prefill + decode)
        if request.output_tokens > 1:
            assert result.tpot_s[i] == pytest.approx(decode / (request.output_tokens - 1))
        else:
            assert math.isnan(result.tpot_s[i])
    with pytest.raises(BadRequest, match="no rank"):
        simulate(Trace(trace.requests, {"a0": 8}), PROFILE, MostIdle())
    summary = result.summary()
    assert summary["slo_tpot_attainment"] == 1.0 and summary["slo_ttft_attainment"] == 1.0
    assert summary["prefill_steps"] == 6 and summary["decode_steps"] == sum(r.output_tokens - 1 for r in trace.requests)


def test_serial_engine_conserves_requests_and_time():
    """Everything arrives at once on one engine that runs one request at a time: every request finishes
    once, in order, and the last finishes at the sum of all service times."""
    trace = gamma_workload(20, 100.0, 2.0, seed=1, lengths=UniformLengths((40, 64), (1, 16)))
    requests = [TraceRequest(0.0, r.adapter, r.prompt_tokens, r.output_tokens) for r in trace.requests]
    trace = Trace(requests, trace.adapter_ranks)
    result = simulate(trace, PROFILE, FirstFit(), SimConfig(num_engines=1, max_running=1))
    total = sum(sum(unloaded_service(r, trace.adapter_ranks[r.adapter])) for r in requests)
    assert np.all(np.isfinite(result.latency_s))
    assert np.all(np.diff(result.latency_s) > 0)  # FCFS
    assert result.latency_s.max() == pytest.approx(total)
    # every request needs 41..80 KV tokens: a capacity of 80 holds one at a time, the same schedule
    by_memory = simulate(trace, PROFILE, FirstFit(), SimConfig(num_engines=1, max_running=64, kv_tokens=80))
    assert np.allclose(by_memory.latency_s, result.latency_s)


def test_many_engines_conserve_requests():
    trace = serverless_workload(2000, 60.0, 20.0, ranks=(8, 32, 128), lengths=UniformLengths((8, 256), (1, 128)), seed=2)
    result = simulate(trace, PROFILE, Random(seed=1), SimConfig(num_engines=6, max_running=16, kv_tokens=4000))
    assert len(result.latency_s) == len(trace.requests)
    assert np.all(np.isfinite(result.latency_s)) and np.all(result.ttft_s > 0)
    assert np.all(result.ttft_s <= result.latency_s + 1e-12)
    assert set(result.engine.tolist()) == set(range(6))
    assert result.output_tokens.tolist() == [r.output_tokens for r in trace.requests]
    # every token after the first takes a decode step of at least the model's fixed cost...
    decode_time = result.latency_s - result.ttft_s
    assert np.all(decode_time >= PROFILE.decode.fixed_s * (result.output_tokens - 1) - 1e-9)
    # ...and one step gives one token to at most max_running requests of one engine
    assert result.decode_steps >= (result.output_tokens - 1).sum() / 16
    again = simulate(trace, PROFILE, Random(seed=1), SimConfig(num_engines=6, max_running=16, kv_tokens=4000))
    assert np.array_equal(again.latency_s, result.latency_s)  # deterministic


def test_rank_aware_beats_most_idle_and_random_on_tpot_slo():
    """Mixed ranks 8 and 128 under BGMV: spreading them (MostIdle, Random) pads every engine's batch to
    rank 128; Algorithm 1 keeps low ranks together and meets the time-per-token SLO far more often."""
    trace = gamma_workload(200, 40.0, 30.0, alpha=0.5, cv=1.0, ranks=(8, 128),
                           lengths=UniformLengths((8, 256), (8, 128)), seed=3)
    config = SimConfig(num_engines=8, max_running=64)
    slo = config.slo_scale * PROFILE.decode.predict([128])
    average_output = float(np.mean([r.output_tokens for r in trace.requests]))
    rank_aware = RankAware(PROFILE.decode, PROFILE.prefill, slo_tpot_s=slo, avg_response_tokens=average_output)
    attainment = {
        policy.name: simulate(trace, PROFILE, policy, config).summary()
        for policy in (rank_aware, MostIdle(), Random(seed=0))
    }
    assert attainment["rank_aware"]["slo_tpot_s"] == pytest.approx(slo)
    best = attainment["rank_aware"]["slo_tpot_attainment"]
    assert best > 0.85
    assert best > attainment["most_idle"]["slo_tpot_attainment"] + 0.1
    assert best > attainment["random"]["slo_tpot_attainment"] + 0.1
    assert attainment["rank_aware"]["tpot_s"]["mean"] < attainment["most_idle"]["tpot_s"]["mean"]


def test_sixty_engines_twenty_thousand_requests_is_fast():
    # CaraServe's large-scale simulation: ~340 requests/s over 60 servers, serverless-style traffic
    trace = serverless_workload(20_000, 340.0, 62.0, ranks=(8, 16, 32, 64, 128),
                                lengths=UniformLengths((8, 512), (8, 128)), seed=4)
    assert len(trace.requests) >= 20_000
    average_output = float(np.mean([r.output_tokens for r in trace.requests]))
    policy = RankAware(PROFILE.decode, PROFILE.prefill, 1.5 * PROFILE.decode.predict([128]), average_output)
    start = time.perf_counter()
    result = simulate(trace, PROFILE, policy, SimConfig(num_engines=60))
    elapsed = time.perf_counter() - start
    assert np.all(np.isfinite(result.latency_s))
    assert elapsed < 30.0, f"{elapsed:.1f} s for {len(trace.requests)} requests on 60 engines"
