"""Tensor parallelism on two GPUs (NCCL): with the Triton kernels, CUDA graphs (all-reduces captured in them) and
overlapped decode (the next step's input ids broadcast on the device), TP=2 gives the greedy tokens of TP=1 on the
same GPUs and of transformers + PEFT, float32, every fixture adapter in one batch, adapters evicted and placed again;
and with many steps planned ahead among the adapter index's compactions.

    pytest -m gpu tests/daemon/engine/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.model.checkpoint import PROJECTIONS

from test_hf_parity import MAX_TOKENS, make_cases, mismatches

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def fixture_engine(model_dir, adapters: dict, **config) -> Engine:
    """A float32 engine on cuda of the fixture checkpoint at `model_dir` with its `adapters`."""
    return Engine(EngineConfig(model=str(model_dir), adapters=tuple((name, str(path)) for name, path in adapters.items()),
                               device="cuda", dtype="float32", **config))


def generate(model_dir, adapters: dict, cases, **config):
    """The cases' greedy results twice from one engine: keeping their logits (which takes them off the overlapped
    decode path), then without (overlapped) -> (with logits, without, the engine's status)."""
    engine = fixture_engine(model_dir, adapters, **config)

    def requests(keep_logits: bool):
        return [GenerationRequest(prompt_token_ids=list(prompt), adapter=adapter, keep_logits=keep_logits,
                                  sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
                for prompt, adapter in cases]

    try:
        kept = engine.generate(requests(True))
        overlapped = engine.generate(requests(False))
        return kept, overlapped, engine.status()
    finally:
        engine.close()


@pytest.mark.parametrize("arch,all_reduce", [("llama", "nccl"), ("llama_tied", "nccl"), ("qwen2", "nccl"), ("llama", "auto")])
def test_tp2_on_two_gpus_equals_tp1_and_hf_peft(arch, all_reduce, hf_checkpoint, hf_reference):
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    config = dict(max_running_requests=4, max_batch_tokens=64, pool_bytes=1600 * 256)
    single, _, _ = generate(checkpoint.model_dir, checkpoint.adapters, cases, **config)
    split, overlapped, status = generate(checkpoint.model_dir, checkpoint.adapters, cases, tensor_parallel_size=2,
                                         all_reduce=all_reduce, **config)
    tp = status["tensor_parallel"]
    assert tp["backend"] == "nccl" and tp["gpus"] == ["cuda:0", "cuda:1"]
    # auto on two GPUs is fused: the decode steps' sums (and the prompt steps' up to its rows) through gpu_ops/peer_sum.py
    assert tp["all_reduce"] == ("nccl" if all_reduce == "nccl" else "fused peer sum up to 256 rows, nccl above")
    assert status["cuda_graph_steps"] > 0 and status["overlapped_decode_steps"] > 0
    assert status["adapter_evictions"] > 0
    for index, (one, two, three) in enumerate(zip(single, split, overlapped)):
        assert two.token_ids == one.token_ids, f"request {index} (adapter {cases[index][1]})"
        assert three.token_ids == one.token_ids, f"request {index} (adapter {cases[index][1]}), overlapped decode"
    problems = mismatches(f"{arch} tp=2 cuda", cases, split, hf_reference(checkpoint.model_dir, checkpoint.adapters))
    assert not problems, "\n".join(problems)


def test_tp2_13b_shape_serves_64_lora_requests():
    # The benchmark's case, short: a llama-2-13b shape split over 2 GPUs in bf16, 64 distinct rank-16 adapters.
    engine = Engine(EngineConfig(model_config="llama-2-13b", dummy_weights=True, dummy_adapters=64, dummy_adapter_rank=16,
                                 dummy_adapter_targets=",".join(PROJECTIONS), device="cuda", dtype="bfloat16",
                                 max_running_requests=64, max_model_len=512, tensor_parallel_size=2))
    try:
        results = engine.generate([GenerationRequest(prompt_token_ids=list(range(3, 35)), adapter=f"dummy-{index}",
                                                     sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
                                   for index in range(64)])
        status = engine.status()
    finally:
        engine.close()
    assert all(len(result.token_ids) == 16 for result in results)
    assert status["cuda_graph_steps"] > 0


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2"])
def test_tp2_steps_planned_ahead_on_two_gpus_equal_tp1(arch, hf_checkpoint):
    """Planning ahead (a step that admits the queue's head planned and launched while the step before it is in
    flight) at TP=2: two running slots for every case at lengths of 3 to 12 tokens, adapters evicted and placed
    again (the index compacted) while steps run, twice over in one engine. Its steps give TP=1's tokens, with many
    steps planned ahead."""
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    limits = [3 + (index * 5) % 10 for index in range(len(cases))]
    config = dict(max_running_requests=2, max_batch_tokens=64, pool_bytes=1600 * 256)

    def run(**more):
        engine = fixture_engine(checkpoint.model_dir, checkpoint.adapters, **config, **more)
        try:
            passes = [engine.generate([GenerationRequest(prompt_token_ids=list(prompt), adapter=adapter,
                                                         sampling=SamplingParams(max_tokens=limit, temperature=0, ignore_eos=True))
                                       for (prompt, adapter), limit in zip(cases, limits)]) for _ in range(2)]
            return passes, engine.status()
        finally:
            engine.close()

    (single, _), status_one = run()
    passes, status = run(tensor_parallel_size=2, all_reduce="nccl")  # fused maps once a process: the test above's
    assert status["planned_ahead_steps"] >= 8, (status["planned_ahead_steps"], status_one["planned_ahead_steps"])
    assert status["adapter_evictions"] > 0 and status["overlapped_decode_steps"] > 0
    for number, results in enumerate(passes):
        for index, (one, two) in enumerate(zip(single, results)):
            assert two.token_ids == one.token_ids, f"pass {number}, request {index} (adapter {cases[index][1]})"
