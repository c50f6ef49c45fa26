"""The time-per-token rule of admission (scheduler/admission.py's decode_step_allows) with injected decode
models and simulated time: a request does not join a non-empty batch whose predicted decode step with it
breaks the objective, an empty batch always admits, early abort counts the wait against the TTFT
objective, the engine's scheduler and the simulator apply the same rule, and without a model or an
objective nothing changes."""

from __future__ import annotations

import math

from lorad.scheduler.admission import (
    FCFS,
    AdapterClustering,
    EarlyAbort,
    Objectives,
    Queued,
    Room,
    RunningBatch,
    decode_step_allows,
)
from lorad.scheduler.batching import Scheduler, Sequence
from lorad.scheduler.perf_model import BgmvModel, DecodeStepModel, PrefillModel, Profile
from lorad.scheduler.router import MostIdle
from lorad.scheduler.simulator import SimConfig, simulate
from lorad.scheduler.workload import Trace, TraceRequest
from scheduler_fakes import Adapters, Clock, Memory

# 10 ms a step plus 1 ms per row and 0.1 ms per rank of the largest row, times the rows (padded BGMV)
DECODE = DecodeStepModel(fixed_s=0.010, per_request_s=0.001, per_context_token_s=0.0, lora=BgmvModel(1e-4, 0.0))
NO_TTFT = math.inf


def step_s(ranks):
    return DECODE.predict(ranks)


def test_the_rule_alone():
    empty = RunningBatch()
    assert decode_step_allows(DECODE, empty, 64, 10, 0.001)  # an empty batch always admits
    batch = empty.plus(8, 10)
    assert batch == RunningBatch(1, 8, 8, 10)
    # with it: 2 rows padded to rank 16: 10 + 2 + 0.1 * 2 * 16 = 15.2 ms
    assert math.isclose(step_s([8, 16]), 0.0152)
    assert decode_step_allows(DECODE, batch, 16, 10, 0.0153)
    assert not decode_step_allows(DECODE, batch, 16, 10, 0.0151)
    assert decode_step_allows(None, batch, 16, 10, 0.0001)  # no model: off
    assert decode_step_allows(DECODE, batch, 16, 10, math.inf)  # no objective: off


def queue(*ranks):
    return [Queued(i, 0.0, f"a{i}", rank, 4, 4) for i, rank in enumerate(ranks)]


def room(running=None, decode=DECODE, **fields):
    running = running or RunningBatch()
    defaults = {"slots": 8, "prefill_tokens": 1000, "kv_tokens": 10_000, "batch_empty": running.size == 0}
    return Room(**{**defaults, **fields}, running=running, decode=decode)


def test_fcfs_holds_the_request_that_would_break_the_objective_and_those_behind_it():
    running = RunningBatch(1, 8, 8, 100)
    objectives = Objectives(NO_TTFT, 0.016)
    # rank 8 joins (2 x 8: 11.6 + 0.2... ms), rank 64 would pad 3 rows to 64: held; rank 8 behind it waits too
    decision = FCFS().select(queue(8, 64, 8), 0.0, room(running), objectives)
    assert decision.admit == (0,) and decision.held == (1,) and decision.drop == ()
    # the same queue into an empty batch: the first goes in whatever it costs, the rest are judged with it
    decision = FCFS().select(queue(64, 8), 0.0, room(), objectives)
    assert decision.admit == (0,) and decision.held == (1,)
    # no model, or no objective: exactly FCFS
    assert FCFS().select(queue(8, 64, 8), 0.0, room(running, decode=None), objectives).admit == (0, 1, 2)
    assert FCFS().select(queue(8, 64, 8), 0.0, room(running), Objectives(NO_TTFT, math.inf)).admit == (0, 1, 2)
    # clustering passes the rule through to its inner policy
    clustered = AdapterClustering(FCFS(), max_adapters=8)
    assert clustered.select(queue(8, 64, 8), 0.0, room(running), objectives).held == (1,)


def test_early_abort_counts_the_wait_of_a_held_request():
    prefill = PrefillModel(0.001, 0.0, 0.0, 0.0)  # 1 ms per prompt token: 4 ms per request here
    policy = EarlyAbort(prefill)
    running = RunningBatch(1, 8, 8, 100)
    objectives = Objectives(1.0, 0.016)
    held = [Queued(0, 0.0, "a", 64, 4, 4)]
    # waited 0.5 s: it would still make 1 s, so it waits
    decision = policy.select(held, 0.5, room(running), objectives)
    assert decision.admit == () and decision.held == (0,) and decision.drop == ()
    # waited 0.999 s: 0.999 + its own 4 ms of prefill > 1 s, dropped (and not counted as held)
    decision = policy.select(held, 0.999, room(running), objectives)
    assert decision.admit == () and decision.held == () and [key for key, _ in decision.drop] == [0]
    # without the rule it would have been admitted at 0.5 s
    assert policy.select(held, 0.5, room(running, decode=None), objectives).admit == (0,)


def seq(name, rank, prompt_len=4):
    return Sequence(name, list(range(prompt_len)), prompt_len, f"adapter-{rank}", rank=rank)


def run_step(scheduler, clock, step_s=0.01):
    plan = scheduler.schedule()
    for s, count in plan:
        s.num_computed += count
        if s.num_computed == s.num_tokens:
            s.tokens.append(1)
    clock.now += step_s
    return [s.request_id for s, _ in plan]


def test_the_engine_scheduler_holds_back_and_never_starves():
    for admission in (FCFS(), AdapterClustering(FCFS(), max_adapters=8, max_wait_s=1e9)):  # fast path and policy path
        clock = Clock()
        scheduler = Scheduler(8, 64, Memory(), Adapters(), admission, Objectives(NO_TTFT, 0.016), clock, decode=DECODE)
        low, high, later = seq("low", 8), seq("high", 64), seq("later", 8)
        for s in (low, high, later):
            scheduler.add(s)
        assert run_step(scheduler, clock) == ["low"]  # high would make the step 10 + 2 + 12.8 ms
        assert run_step(scheduler, clock) == ["low"]  # and it waits at the head: later waits behind it
        assert scheduler.tpot_held == 1 and high.held_for_tpot and not later.held_for_tpot
        scheduler.finish(low)
        assert run_step(scheduler, clock) == ["high"]  # an empty batch admits it whatever it costs
        assert run_step(scheduler, clock) == ["high"]  # later (rank 8) would pad to 64: held
        assert scheduler.tpot_held == 2
        scheduler.finish(high)
        assert run_step(scheduler, clock) == ["later"]
        assert not scheduler.has_work() or scheduler.running == [later]


def test_the_engine_scheduler_without_model_or_objective_is_unchanged():
    for decode, objectives in ((None, Objectives(NO_TTFT, 0.016)), (DECODE, None)):
        clock = Clock()
        scheduler = Scheduler(8, 64, Memory(), Adapters(), FCFS(), objectives, clock, decode=decode)
        for s in (seq("low", 8), seq("high", 64), seq("later", 8)):
            scheduler.add(s)
        assert run_step(scheduler, clock) == ["low", "high", "later"]
        assert scheduler.tpot_held == 0


def test_the_simulator_keeps_the_objective_with_the_rule():
    profile = Profile(machine={}, decode=DECODE, prefill=PrefillModel(1e-5, 0.0, 0.0, 0.001))
    requests = [TraceRequest(arrival_s=i * 0.001, adapter=f"r{rank}", prompt_tokens=8, output_tokens=40)
                for i, rank in enumerate([8, 64, 8, 64, 8, 64, 8, 64])]
    trace = Trace(requests=requests, adapter_ranks={"r8": 8, "r64": 64})
    loose = SimConfig(slo_tpot_s=0.02, slo_ttft_s=10.0)
    held = SimConfig(slo_tpot_s=0.02, slo_ttft_s=10.0, tpot_admission=True)
    without = simulate(trace, profile, MostIdle(), loose).summary()
    with_rule = simulate(trace, profile, MostIdle(), held).summary()
    assert without["tpot_held"] == 0 and without["slo_tpot_attainment"] < 1.0  # 8 rows padded to 64 break it
    assert with_rule["tpot_held"] > 0 and with_rule["completed"] == 8
    assert with_rule["slo_tpot_attainment"] == 1.0
    assert with_rule["tpot_s"]["p99"] <= 0.02
