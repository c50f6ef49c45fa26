"""bench/kv_admission.py: its replay of the engine's scheduler against a bounded KV cache. Admitted by their prompts'
KV alone, requests that together outgrow the cache are preempted and their prompts computed again; with the growth
reserve none is, every output token is still generated, and the replay's floor counts each step once."""

from __future__ import annotations

import bench_scripts
from lorad.daemon.engine.step_cost import DeviceRates, StepCostModel
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec


def test_the_growth_reserve_replays_without_preemption():
    bench = bench_scripts.load("kv_admission")
    cost = StepCostModel(ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"]), 2, adapter_ranks=lambda name: {})
    rates = DeviceRates(1e12, 1e14)
    lengths = [(20, 30)] * 6  # 50 positions each at the end; the cache holds 120: two at full length
    plain = bench.replay(lengths, kv_tokens=120, max_running=6, max_batch_tokens=64, reserve=False, cost=cost, rates=rates)
    held = bench.replay(lengths, kv_tokens=120, max_running=6, max_batch_tokens=64, reserve=True, cost=cost, rates=rates)
    assert plain["preemptions"] > 0 and plain["prompt_tokens_again"] >= 20 * plain["preemptions"]
    assert held["preemptions"] == 0 and held["prompt_tokens_again"] == 0 and held["most_running"] == 2
    # every request's prompt and its 29 tokens after the first (the first comes from its prompt's step) were computed
    # once with the reserve; without it, a preempted request's prompt and tokens so far were computed again
    rows = {name: sum(kind["rows"] for kind in run["steps"].values()) for name, run in (("plain", plain), ("held", held))}
    assert rows["held"] == 6 * (20 + 29) and rows["plain"] >= 6 * (20 + 29) + plain["prompt_tokens_again"]
    assert held["steps"]["decode"]["steps"] > plain["steps"]["decode"]["steps"]  # fewer rows a decode step
    assert 0 < held["floor_s"] < held["estimated_busy_s"]


def test_passing_over_staging_adapters_fills_the_batch():
    """Requests whose adapters stage for 6 steps on first use: holding the queue behind them leaves slots empty
    (more decode steps, fewer rows each); passing them over (the scheduler's default) does not."""
    bench = bench_scripts.load("kv_admission")
    cost = StepCostModel(ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"]), 2, adapter_ranks=lambda name: {})
    lengths = [(8, 12)] * 24
    adapters = [None if index % 3 else f"a{index}" for index in range(24)]  # every third request a cold adapter
    runs = {passing: bench.replay(lengths, kv_tokens=10_000, max_running=4, max_batch_tokens=64, reserve=False, cost=cost,
                                  rates=DeviceRates(1e12, 1e14), adapters=adapters, staging_steps=6, pass_staging=passing)
            for passing in (0, 8)}
    held, passed = runs[0], runs[8]
    assert passed["admitted_past_staging"] > 0 and held["admitted_past_staging"] == 0
    assert passed["steps"]["decode"]["steps"] < held["steps"]["decode"]["steps"]
    assert passed["mean_decode_rows"] > held["mean_decode_rows"]
    for run in (held, passed):  # the same work either way
        assert sum(kind["rows"] for kind in run["steps"].values()) == 24 * (8 + 11)


def test_adapters_staged_by_fewer_workers_leave_more_slots_empty():
    """The engine's stager modelled: cold adapters staged in turn by a number of workers, each taking 5 steps. One
    worker stages them one after another, so requests wait longer for theirs than with four; the replay counts the
    running slots left empty while they wait, as the engine's account does."""
    bench = bench_scripts.load("kv_admission")
    cost = StepCostModel(ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"]), 2, adapter_ranks=lambda name: {})
    lengths = [(8, 12)] * 24
    adapters = [f"a{index % 8}" for index in range(24)]  # eight adapters, each cold at first
    runs = {threads: bench.replay(lengths, kv_tokens=10_000, max_running=8, max_batch_tokens=64, reserve=False, cost=cost,
                                  rates=DeviceRates(1e12, 1e14), adapters=adapters, staging_steps=5, stager_threads=threads)
            for threads in (1, 4)}
    one, four = runs[1]["empty_slots_by_cause"], runs[4]["empty_slots_by_cause"]
    assert one["adapter_staging"] > four["adapter_staging"] > 0
    assert runs[1]["steps"]["decode"]["steps"] > runs[4]["steps"]["decode"]["steps"]
    for run in runs.values():  # the same work either way
        assert sum(kind["rows"] for kind in run["steps"].values()) == 24 * (8 + 11)


def test_a_stager_asked_deeper_into_the_queue_keeps_its_workers_busy():
    """Asked for the first queued request's adapter alone, eight workers stage one adapter at a time (besides those
    an admission waits for); asked for every queued request's, they stage them side by side and fewer slots wait."""
    bench = bench_scripts.load("kv_admission")
    cost = StepCostModel(ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"]), 2, adapter_ranks=lambda name: {})
    lengths = [(8, 12)] * 24
    adapters = [f"a{index % 8}" for index in range(24)]
    runs = {depth: bench.replay(lengths, kv_tokens=10_000, max_running=8, max_batch_tokens=64, reserve=False, cost=cost,
                                rates=DeviceRates(1e12, 1e14), adapters=adapters, staging_steps=5, stager_threads=8,
                                pass_staging=0, prepare_depth=depth)
            for depth in (1, 24)}
    assert runs[1]["prepare_depth"] == 1 and runs[24]["prepare_depth"] == 24
    shallow, deep = runs[1]["empty_slots_by_cause"], runs[24]["empty_slots_by_cause"]
    assert shallow["adapter_staging"] > deep["adapter_staging"]
