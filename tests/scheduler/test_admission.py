"""scheduler/admission.py: FCFS fills in order and stops at the first request that does not fit; early
abort drops the requests whose predicted TTFT misses the objective and says why; adapter clustering offers
the running batch's adapters first and lets the rest fill the room; in the simulator, drops are misses and
early abort beats FCFS on SLO attainment under a bursty overload."""

from __future__ import annotations

import numpy as np
import pytest

from lorad.errors import BadRequest
from lorad.scheduler.admission import (
    FCFS, AdapterClustering, EarlyAbort, Objectives, Queued, Room, make_admission,
)
from lorad.scheduler.perf_model import PrefillModel, example_profile
from lorad.scheduler.router import MostIdle
from lorad.scheduler.simulator import SimConfig, objectives_for, simulate
from lorad.scheduler.workload import UniformLengths, gamma_workload

# 1 ms per prompt token, nothing else: easy to reason about
PREFILL = PrefillModel(per_token_s=1e-3, per_rank_token_s=0.0, per_square_token_s=0.0, fixed_s=0.0)
ROOMY = Room(slots=8, prefill_tokens=1000, kv_tokens=10_000, batch_empty=True)


def queued(key, arrival=0.0, adapter="a", prompt=100, output=10, rank=8):
    return Queued(key, arrival, adapter, rank, prompt, output)


def test_objectives_are_positive():
    assert Objectives(1.0, 0.05).ttft_s == 1.0
    with pytest.raises(BadRequest):
        Objectives(0.0, 0.05)


def test_fcfs_fills_in_order_and_stops_at_the_first_misfit():
    queue = [queued(0, prompt=600), queued(1, prompt=500), queued(2, prompt=10)]
    assert FCFS().select(queue, 0.0, ROOMY, Objectives(1, 1)).admit == (0,)  # 1 does not fit the budget: 2 waits too
    # slots
    assert FCFS().select(queue[1:], 0.0, Room(1, 1000, 10_000, True), Objectives(1, 1)).admit == (1,)
    # KV: an empty batch takes its first request whatever its size, not a second
    tight = Room(8, 1000, kv_tokens=50, batch_empty=True)
    assert FCFS().select(queue, 0.0, tight, Objectives(1, 1)).admit == (0,)
    assert FCFS().select(queue, 0.0, Room(8, 1000, 50, batch_empty=False), Objectives(1, 1)).admit == ()


def test_early_abort_drops_what_cannot_meet_the_ttft_objective():
    objectives = Objectives(ttft_s=1.0, tpot_s=0.1)
    queue = [
        queued(0, arrival=0.0, prompt=100),  # waited 1.0 s already: 1.1 s > 1.0
        queued(1, arrival=0.5, prompt=100),  # 0.5 + 0.1 = 0.6
        queued(2, arrival=0.6, prompt=200),  # 0.4 + 0.3 (the step with 1 and 2) = 0.7
        queued(3, arrival=0.0, prompt=50),  # would be 1.0 + 0.35: dropped, 4 still joins
        queued(4, arrival=0.9, prompt=100),  # 0.1 + 0.4
    ]
    decision = EarlyAbort(PREFILL).select(queue, 1.0, ROOMY, objectives)
    assert decision.admit == (1, 2, 4)
    assert [key for key, _ in decision.drop] == [0, 3]
    assert "early abort: estimated TTFT 1100.0 ms > objective 1000.0 ms" in decision.drop[0][1]
    # past the step's room a request waits when it can still make it after this step, else it is dropped
    small = Room(slots=1, prefill_tokens=1000, kv_tokens=10_000, batch_empty=True)
    queue = [queued(0, arrival=0.9, prompt=100), queued(1, arrival=0.8, prompt=100), queued(2, arrival=0.5, prompt=300)]
    decision = EarlyAbort(PREFILL).select(queue, 1.0, small, objectives)
    # 0: 0.1 waited + 0.1 = 0.2, admitted; 1: 0.2 + 0.1 (this step) + 0.1 = 0.4 and 2: 0.5 + 0.1 + 0.3 = 0.9
    # can still make it after this step: they wait
    assert decision.admit == (0,) and decision.drop == ()
    decision = EarlyAbort(PREFILL).select(queue, 1.0, small, Objectives(0.8, 0.1))
    assert decision.admit == (0,) and [key for key, _ in decision.drop] == [2]


def test_clustering_prefers_the_running_adapters_and_lets_others_fill():
    queue = [queued(0, adapter="c"), queued(1, adapter="a"), queued(2, adapter="d"), queued(3, adapter="b")]
    running = Room(slots=3, prefill_tokens=1000, kv_tokens=10_000, batch_empty=False,
                   running_adapters=frozenset({"a", "b"}))
    clustered = AdapterClustering(FCFS(), max_adapters=2)
    assert clustered.select(queue, 0.0, running, Objectives(1, 1)).admit == (1, 3, 0)
    # below the cap, new adapters join in arrival order until it is reached
    assert AdapterClustering(FCFS(), 3).select(queue, 0.0, running, Objectives(1, 1)).admit == (0, 1, 3)
    assert clustered.name == "fcfs+cluster2"
    assert make_admission("early-abort", PREFILL, 4).name == "early_abort+cluster4"
    with pytest.raises(BadRequest):
        make_admission("lcfs")
    with pytest.raises(BadRequest):
        AdapterClustering(FCFS(), 0)


def overloaded_trace():
    # bursty (cv 4) traffic at about twice what 4 engines of 16 requests serve
    return gamma_workload(50, 60.0, 30.0, alpha=1.0, cv=4.0, ranks=(8, 16, 32, 64),
                          lengths=UniformLengths((64, 512), (16, 128)), seed=5)


def test_simulator_counts_drops_as_misses_and_early_abort_beats_fcfs():
    profile = example_profile("bgmv")
    trace = overloaded_trace()
    config = SimConfig(num_engines=4, max_running=16)
    objectives = objectives_for(trace, profile, config)
    fcfs = simulate(trace, profile, MostIdle(), config).summary()
    abort_result = simulate(trace, profile, MostIdle(), config, admission=EarlyAbort(profile.prefill))
    abort = abort_result.summary()
    assert fcfs["dropped"] == 0 and fcfs["admission"] == "fcfs"
    assert abort["admission"] == "early_abort" and abort["dropped"] > 0
    assert abort["completed"] + abort["dropped"] == abort["requests"] == len(trace.requests)
    assert abort["drop_reasons"] == {"early abort": abort["dropped"]}
    # a dropped request has no times and misses every objective
    dropped = abort_result.dropped
    assert np.all(np.isnan(abort_result.ttft_s[dropped])) and np.all(np.isfinite(abort_result.latency_s[~dropped]))
    assert abort["slo_ttft_attainment"] <= 1.0 - abort["dropped"] / abort["requests"] + 1e-12
    assert abort["slo_ttft_s"] == pytest.approx(objectives.ttft_s)
    assert abort["slo_attainment"] > fcfs["slo_attainment"] + 0.1, (abort, fcfs)
    # clustering runs through the simulator too, every request accounted for
    clustered = simulate(trace, profile, MostIdle(), config, admission=make_admission("fcfs", max_adapters=4)).summary()
    assert clustered["completed"] == clustered["requests"]
