"""scheduler/cold_start.py: gpu-wait or cpu-assist from injected costs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lorad.scheduler.cold_start import CPU_ASSIST, GPU_STREAM, GPU_WAIT, ColdStart, ColdStartCosts, decide

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


def test_layerwise_assist_is_bounded_by_the_load_and_uses_the_cpu_for_the_first_layers():
    from lorad.scheduler.cold_start import hybrid_ms

    # 10 layers, prefill 10 ms (1 ms a layer), CPU LoRA 100 ms (10 ms a layer), load 20 ms (2 ms a layer).
    total, cpu_layers = hybrid_ms(10.0, 100.0, 20.0, 10, overlapped=True)
    assert cpu_layers == 2  # layer 0 at 0 ms and layer 1 at 10 ms are early; at 20 ms every layer is in
    assert total == pytest.approx(2 * 10.0 + 8 * 1.0)
    # Serial: the same split, the CPU layers cost prefill + LoRA.
    assert hybrid_ms(10.0, 100.0, 20.0, 10, overlapped=False) == (pytest.approx(2 * 11.0 + 8 * 1.0), 2)
    # A load already done: the GPU serves every layer.
    assert hybrid_ms(10.0, 100.0, 0.0, 10, overlapped=True) == (pytest.approx(10.0), 0)


def test_layerwise_turns_a_losing_assist_into_a_winning_one():
    costs = dataclasses.replace(COSTS, overlapped=True, prefill_ms_per_token=0.05)
    cold = request(tokens=512, rank=64, modules=7 * 32)
    whole = decide(cold, costs)
    hybrid = decide(cold, dataclasses.replace(costs, layerwise=True, num_layers=32))
    assert hybrid.cpu_assist_ms <= whole.cpu_assist_ms
    assert hybrid.cpu_assist_ms <= hybrid.gpu_wait_ms + 1e-9 or hybrid.choice == GPU_WAIT
    assert 0 <= hybrid.cpu_layers <= 32 and whole.cpu_layers == 1  # COSTS has num_layers 1 (the default)
    if hybrid.choice == CPU_ASSIST:
        assert hybrid.cpu_layers < 32


# ---- gpu-stream: the prefill runs while the copy streams in, each layer waiting for its pages --------

STREAMING = dataclasses.replace(COSTS, streaming=True, num_layers=32, workers=0)


def walked(prefill_ms: float, load_ms: float, layers: int) -> float:
    """The streamed forward by events: layer l ends at max(its arrival, the last layer's end) + its share."""
    ends = []
    for layer in range(layers):
        arrival = load_ms * (layer + 1) / layers
        ends.append(max(arrival, ends[-1] if ends else 0.0) + prefill_ms / layers)
    return ends[-1]


@pytest.mark.parametrize("tier, tokens", [("pinned", 512), ("pageable", 64), ("pageable", 512), ("slow", 64)])
def test_streaming_costs_the_slower_of_copy_and_prefill_and_a_layer(tier, tokens):
    decision = decide(request(tokens=tokens, tier=tier), STREAMING)
    assert decision.choice == GPU_STREAM
    prefill, load = decision.prefill_ms, decision.gpu_wait_ms - decision.prefill_ms
    assert decision.gpu_stream_ms == pytest.approx(walked(prefill, load, 32))
    assert max(prefill, load) < decision.gpu_stream_ms <= max(prefill, load) + min(prefill, load) / 32 + 1e-9
    assert decision.gpu_stream_ms < decision.gpu_wait_ms


def test_no_streaming_where_it_is_off_or_the_step_takes_the_decode_kernels():
    assert decide(request(tier="pageable"), dataclasses.replace(STREAMING, streaming=False)).choice == GPU_WAIT
    one_token = decide(request(tokens=1, tier="pageable"), STREAMING)
    assert one_token.choice == GPU_WAIT and math.isinf(one_token.gpu_stream_ms)


def test_cpu_assist_must_beat_streaming_not_waiting():
    costs = dataclasses.replace(STREAMING, workers=4)
    # a slow tier: the CPU's LoRA of a short prompt beats both
    assert decide(request(tokens=64, tier="slow"), costs).choice == CPU_ASSIST
    # where the CPU beats waiting by far but streaming not by the margin, the GPU streams
    slow_prefill = dataclasses.replace(costs, prefill_ms_per_token=2.0)
    decision = decide(request(tokens=64, tier="slow"), slow_prefill)
    assert decision.cpu_assist_ms * (1 + costs.margin) < decision.gpu_wait_ms
    assert decision.cpu_assist_ms * (1 + costs.margin) >= decision.gpu_stream_ms
    assert decision.choice == GPU_STREAM


def test_streaming_must_save_its_margin():
    """A short copy (a small pinned adapter) saves less than the margin: gpu-wait, as measured on the H100."""
    small = request(tier="pinned", adapter_bytes=4 * MB, tokens=512)
    decision = decide(small, STREAMING)
    assert decision.gpu_wait_ms - decision.gpu_stream_ms < STREAMING.stream_margin_ms
    assert decision.choice == GPU_WAIT
    assert decide(small, dataclasses.replace(STREAMING, stream_margin_ms=0.0)).choice == GPU_STREAM
