"""LlamaModel's hook for a sum fused with the residual add and norm after it (LlamaModel.reduce_norm, set under
tensor parallelism with all_reduce fused: tensor_parallel.PeerSum): where it takes the rows the model uses its
result, in the order o, down, o, ... with their buffers' halves 0 and 1 alternating; where it declines (None), the
model sums through `reduce` as without it. Here on one rank, where the sum is the partial itself."""

from __future__ import annotations

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.gpu_ops.norm import add_rms_norm_ref

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def greedy(engine: Engine) -> list[list[int]]:
    requests = [GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=5, temperature=0,
                                                                                   ignore_eos=True))
                for prompt in PROMPTS]
    return [result.token_ids for result in engine.generate(requests)]


def test_the_model_takes_a_fused_sum_where_offered_and_sums_otherwise():
    engine = Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, device="cpu", dtype="float32"))
    try:
        expected = greedy(engine)
        model = engine.runner.model
        halves, declined = [], []

        def one_rank_sum(h, partial, weight, eps, half):  # what PeerSum computes with a single rank's partial
            halves.append(half)
            return add_rms_norm_ref(h, partial, weight, eps)

        model.reduce_norm = one_rank_sum
        assert greedy(engine) == expected
        layers = engine.spec.num_layers
        assert halves[: 2 * layers] == [0, 1] * layers, "o's sums on half 0, down's on half 1, the last one too"
        assert len(halves) % (2 * layers) == 0  # every forward: two sums a layer

        def decline(h, partial, weight, eps, half):
            declined.append(half)
            return None

        model.reduce_norm = decline
        summed = []
        model.reduce = lambda tensor: summed.append(tensor.shape) or tensor
        assert greedy(engine) == expected
        assert declined and len(summed) == len(declined), "every declined sum went through reduce"
    finally:
        engine.close()
