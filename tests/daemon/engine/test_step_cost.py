"""daemon/engine/step_cost.py: a step's bytes and FLOPs for the demo model, against the same numbers worked out
by hand from its config (hidden 64, intermediate 172, 4 layers, 4 heads and 2 KV heads of 16, vocabulary 512,
float32) and its rank-8 q, k, v adapter."""

from __future__ import annotations

import pytest

from lorad.daemon.engine.step_cost import SequenceInStep, StepCost, StepCostModel
from lorad.daemon.model.adapters import load_peft_adapter
from lorad.daemon.model.checkpoint import load_spec


@pytest.fixture(scope="module")
def model(demo_assets):
    spec = load_spec(demo_assets.model_dir)
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.vocab_size) == (64, 172, 4, 4, 2, 16, 512)
    adapter = load_peft_adapter(demo_assets.adapters["demo-r8"], spec, max_rank=64)
    ranks = {key: a.shape[0] for key, (a, _) in adapter.weights.items()}
    return StepCostModel(spec, dtype_bytes=4, adapter_ranks=lambda name: ranks)


def test_a_mixed_step_by_hand(model):
    # a 5-token prompt with the rank-8 adapter, and one decode row of the base model at context 10
    cost = model.cost([SequenceInStep(new_tokens=5, context=5, sampled=True, adapter="demo-r8"),
                       SequenceInStep(new_tokens=1, context=10, sampled=True, adapter=None)])
    layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 172  # q, k, v, o, gate, up, down: 45312
    weights = 4 * layer + (4 * 2 * 64 + 64) + 6 * 64 + 512 * 64  # layers, norms, 6 embedding rows, LM head
    kv = (5 + 5) * 2 * 4 * 32 + (10 + 1) * 2 * 4 * 32  # context read plus new tokens written, K and V, 4 layers
    adapter = 4 * 8 * ((64 + 64) + (64 + 32) + (64 + 32))  # rank 8: A [8, in] and B [out, 8] of q, k, v
    attention = 4 * 4 * 64 * (15 + 10)  # 1+2+3+4+5 and 10 query-key pairs, 4 layers, 64 q dims
    lora = 2 * 5 * adapter  # shrink and expand for the adapter's 5 rows
    flops = (2 * 6 * 4 * layer  # the projections, 6 rows
             + 2 * 2 * 512 * 64  # the LM head for 2 sampled rows
             + attention + lora)
    assert cost == StepCost(weight_bytes=4 * weights, kv_bytes=4 * kv, adapter_bytes=4 * adapter, flops=flops,
                            attention_flops=attention, adapter_flops=lora)
    assert (weights, kv, adapter, flops, attention, lora) == (214976, 5376, 10240, 2434048, 25600, 102400)


def test_a_decode_only_step_reads_no_head_without_samples_and_counts_each_adapter_once(model):
    cost = model.cost([SequenceInStep(1, 20, False, "demo-r8"), SequenceInStep(1, 30, False, "demo-r8")])
    assert cost.weight_bytes == 4 * (4 * 45312 + 576 + 2 * 64)
    assert cost.adapter_bytes == 4 * 10240  # one adapter, two rows: its pages are read once
    assert cost.kv_bytes == 4 * (21 + 31) * 256


def test_the_floor_is_the_slower_of_memory_and_compute():
    cost = StepCost(weight_bytes=600, kv_bytes=300, adapter_bytes=100, flops=4000)
    assert cost.bytes == 1000
    assert cost.floor_s(bandwidth_bytes_per_s=100.0, flops_per_s=1000.0) == 10.0  # memory: 10 s against 4 s
    assert cost.floor_s(bandwidth_bytes_per_s=1000.0, flops_per_s=100.0) == 40.0  # compute


def test_the_serial_floor_adds_up_the_phases_each_at_its_own_bound():
    # projections: 600 bytes, 2000 FLOPs; attention: 300 bytes, 1500 FLOPs; LoRA: 100 bytes, 500 FLOPs
    cost = StepCost(weight_bytes=600, kv_bytes=300, adapter_bytes=100, flops=4000, attention_flops=1500, adapter_flops=500)
    # at 100 B/s and 100 FLOP/s: 20 (compute) + 15 (compute) + 5 (compute); the floor: 40 s of compute
    assert cost.serial_floor_s(100.0, 100.0) == 40.0 == cost.floor_s(100.0, 100.0)
    # at 100 B/s and 500 FLOP/s: projections 6 (memory), attention 3 (memory), LoRA 1 (memory): 10, as the floor
    assert cost.serial_floor_s(100.0, 500.0) == 10.0 == cost.floor_s(100.0, 500.0)
    # a mixed step: the prompt rows' projections bound by compute, the decode rows' KV read by memory
    mixed = StepCost(weight_bytes=100, kv_bytes=900, adapter_bytes=0, flops=3000)
    assert mixed.floor_s(100.0, 100.0) == 30.0  # the FLOPs hide the KV read
    assert mixed.serial_floor_s(100.0, 100.0) == 30.0 + 9.0  # not where the phases run one after the other
    # every phase bound by memory: the phases' quotients summed round below the whole's quotient here, and the serial
    # floor still does not fall below the floor
    bound = StepCost(weight_bytes=273878288, kv_bytes=126614243, adapter_bytes=531969375, flops=0)
    assert sum(part / 3.35e12 for part in (273878288, 126614243, 531969375)) < bound.floor_s(3.35e12, 1e15)
    assert bound.serial_floor_s(3.35e12, 1e15) == bound.floor_s(3.35e12, 1e15)


def test_the_device_rates_are_measured():
    import torch

    from lorad.daemon.engine.step_cost import measure_device_rates

    rates = measure_device_rates(torch.device("cpu"), torch.float32, repeats=2)
    # a CPU core copies more than 100 MB/s and multiplies at more than 100 MFLOP/s; no device reaches 100 TB/s
    assert 1e8 < rates.bandwidth_bytes_per_s < 1e14 and 1e8 < rates.flops_per_s < 1e16


def test_sliding_window_layers_count_only_the_window():
    """gemma-2-9b: 21 global and 21 local layers (window 4096), K and V of 8 x 256 per token and layer, bf16.
    A decode at context 10000 reads 10000 positions on a global layer and 4096 on a local one; a 300-token
    chunk ending at 5000 reads 5000 and the last 300 + 4095 (its first row's window onwards)."""
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["gemma-2-9b"])
    model = StepCostModel(spec, dtype_bytes=2, adapter_ranks=lambda name: {})
    kv_row = 2 * 8 * 256 * 2  # K and V of one token in one layer, bytes
    decode = model.cost([SequenceInStep(new_tokens=1, context=10000, sampled=True, adapter=None)])
    assert decode.kv_bytes == kv_row * (21 * (10000 + 1) + 21 * (4096 + 1))
    chunk = model.cost([SequenceInStep(new_tokens=300, context=5000, sampled=False, adapter=None)])
    assert chunk.kv_bytes == kv_row * (21 * (5000 + 300) + 21 * (300 + 4095 + 300))
    # query-key pairs: a global row at position p sees p + 1 keys, a local one min(p + 1, 4096)
    q_dims, layer_flops = 16 * 256, 2 * sum(i * o for i, o in (spec.projection_shape(n) for n in
                                                               ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    global_pairs = sum(p + 1 for p in range(4700, 5000))
    local_pairs = sum(min(p + 1, 4096) for p in range(4700, 5000))
    assert chunk.flops == 300 * 42 * layer_flops + 4 * q_dims * (21 * global_pairs + 21 * local_pairs)
    assert local_pairs == 300 * 4096  # every row of the chunk is past the window
