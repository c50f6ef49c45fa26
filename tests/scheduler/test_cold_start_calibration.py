"""scheduler/cold_start.py: the calibrated CPU cost, the margin and the online correction."""

from __future__ import annotations

import dataclasses

from lorad.scheduler.cold_start import (
    CPU_ASSIST,
    GPU_WAIT,
    ColdStart,
    ColdStartCosts,
    decide,
    observe_assisted,
)

MB = 1 << 20
COSTS = ColdStartCosts(
    load_bytes_per_s={"pinned": 50e9, "pageable": 8e9},
    cpu_per_token_rank_ms=1.6e-4, cpu_overhead_ms=0.02, dispatch_ms=0.01, workers=4,
    prefill_ms_per_token=0.05, invoke_ms=0.3, cpu_scale=2.0,
)
REQUEST = ColdStart(prompt_tokens=256, adapter_bytes=130 * MB, rank=32, modules=128, tier="pinned")


def test_a_slow_cpu_path_waits_for_a_fast_load():
    assert decide(REQUEST, COSTS).choice == GPU_WAIT


def test_a_slow_load_takes_the_cpu_when_it_is_cheap():
    cheap = dataclasses.replace(COSTS, invoke_ms=0.0, cpu_scale=0.1)
    decision = decide(dataclasses.replace(REQUEST, tier="pageable"), cheap)
    assert decision.choice == CPU_ASSIST and decision.cpu_assist_ms < decision.gpu_wait_ms


def test_the_margin_sends_near_ties_to_the_gpu():
    request = dataclasses.replace(REQUEST, tier="pageable", modules=1)
    decision = decide(request, dataclasses.replace(COSTS, margin=0.0))
    tie = decision.gpu_wait_ms / decision.cpu_assist_ms - 1  # how much faster cpu-assist is predicted
    assert decision.choice == CPU_ASSIST and tie > 0
    assert decide(request, dataclasses.replace(COSTS, margin=tie * 1.01)).choice == GPU_WAIT


def test_staging_counts_when_the_adapter_is_not_in_the_store():
    costs = dataclasses.replace(COSTS, stage_bytes_per_s=1e9)
    staged = decide(dataclasses.replace(REQUEST, staged=True), costs)
    unstaged = decide(dataclasses.replace(REQUEST, staged=False), costs)
    assert unstaged.cpu_assist_ms > staged.cpu_assist_ms


def test_observed_slow_assists_turn_auto_to_gpu_wait():
    request = dataclasses.replace(REQUEST, tier="pageable", modules=1)
    costs = dataclasses.replace(COSTS, margin=0.0)
    decision = decide(request, costs)
    assert decision.choice == CPU_ASSIST
    # The step took 20 times what was predicted beyond the base prefill.
    costs = observe_assisted(costs, [decision], 20 * decision.cpu_extra_ms)
    assert costs.observed_assists == 1 and costs.correction > 10
    assert decide(request, costs).choice == GPU_WAIT
    # Faster observations pull the correction back down (a moving average), never below its bound.
    for _ in range(30):
        costs = observe_assisted(costs, [decide(request, costs)], 0.0)
    assert 0.2 <= costs.correction < 0.21 and decide(request, costs).choice == CPU_ASSIST
