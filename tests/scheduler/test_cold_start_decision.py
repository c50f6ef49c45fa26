"""scheduler/cold_start.py: gpu-wait or cpu-assist from injected costs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lorad.scheduler.cold_start import CPU_ASSIST, GPU_WAIT, ColdStart, ColdStartCosts, decide

MB = 1 << 20
# A 7B-like server: 25 GB/s pinned, 3 GB/s pageable, 0.5 GB/s from a slow tier; one core does a
# rank-1 token of a 4096 x 4096 module in ~1.6 us.
COSTS = ColdStartCosts(
    load_bytes_per_s={"pinned": 25e9, "pageable": 3e9, "slow": 0.5e9},
    cpu_per_token_rank_ms=1.6e-3,
    cpu_overhead_ms=0.02,
    dispatch_ms=0.01,
    workers=4,
    prefill_ms_per_token=0.05,
    overlapped=True,
)


def request(tokens=64, adapter_bytes=64 * MB, rank=16, modules=128, tier="slow") -> ColdStart:
    return ColdStart(tokens, adapter_bytes, rank, modules, tier)


def test_a_slow_tier_picks_cpu_assist():
    decision = decide(request(tier="slow"), COSTS)
    assert decision.choice == CPU_ASSIST
    assert decision.cpu_assist_ms < decision.gpu_wait_ms


def test_a_fast_pinned_tier_picks_gpu_wait():
    assert decide(request(tier="pinned", adapter_bytes=4 * MB), COSTS).choice == GPU_WAIT


def test_long_prompts_at_high_rank_pick_gpu_wait():
    assert decide(request(tokens=64, rank=16), COSTS).choice == CPU_ASSIST
    assert decide(request(tokens=4096, rank=128), COSTS).choice == GPU_WAIT


def test_more_workers_make_cpu_assist_cheaper():
    few = decide(request(tokens=512, rank=64, tier="pageable"), dataclasses.replace(COSTS, workers=1))
    many = decide(request(tokens=512, rank=64, tier="pageable"), dataclasses.replace(COSTS, workers=8))
    assert many.cpu_assist_ms < few.cpu_assist_ms
    assert few.gpu_wait_ms == many.gpu_wait_ms


def test_serial_invocation_costs_the_sum():
    overlapped = decide(request(), COSTS)
    serial = decide(request(), dataclasses.replace(COSTS, overlapped=False))
    assert serial.cpu_assist_ms == pytest.approx(overlapped.gpu_wait_ms - COSTS.load_ms(64 * MB, "slow") + COSTS.cpu_lora_ms(64, 16, 128))
    assert serial.cpu_assist_ms > overlapped.cpu_assist_ms


def test_no_workers_or_no_tokens_wait_for_the_gpu():
    assert decide(request(), dataclasses.replace(COSTS, workers=0)).choice == GPU_WAIT
    decision = decide(request(tokens=0), COSTS)
    assert decision.choice == GPU_WAIT and math.isinf(decision.cpu_assist_ms)


def test_an_unmeasured_tier_is_an_error():
    with pytest.raises(KeyError, match="tier 'disk'"):
        decide(request(tier="disk"), COSTS)


def test_the_worker_count_is_only_raised_while_it_pays():
    # One token cannot use two workers; extra workers only add dispatch.
    one = COSTS.cpu_lora_ms(1, 16, 1)
    assert one == pytest.approx(COSTS.dispatch_ms + COSTS.cpu_overhead_ms + COSTS.cpu_per_token_rank_ms * 16)
