"""Phi-3 on an NVIDIA GPU: the tiny longrope checkpoint (partial rotary, fused-module adapters) on cuda against the
CPU engine, which tests/test_hf_parity.py holds to transformers + PEFT: float32 gives the same greedy tokens and
logits, through the CUDA graphs with overlapped decode (a sequence crossing the original context is left out of the
overlapped step and its cache computed again) and eagerly; bfloat16 stays close to float32."""

import gc

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu
pytest.importorskip("peft")  # the fixture checkpoint and adapters are built with transformers and peft

# the checkpoint's original context is 16: short prompts that cross it while generating, and longer ones
PROMPT_LENGTHS = (3, 7, 12, 16, 20, 40, 5, 33)


def _requests(names, vocab_size):
    generator = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    return [GenerationRequest(torch.randint(3, vocab_size, (length,), generator=generator).tolist(),
                              names[i % len(names)], greedy, keep_logits=True)
            for i, length in enumerate(PROMPT_LENGTHS)]


def _run(checkpoint, device, dtype, **config):
    engine = Engine(EngineConfig(model=str(checkpoint.model_dir), device=device, dtype=dtype, max_lora_rank=64,
                                 adapters=tuple((n, str(p)) for n, p in checkpoint.adapters.items()), **config))
    try:
        return engine.generate(_requests([None, *sorted(checkpoint.adapters)], checkpoint.vocab_size)), engine
    finally:
        engine.close()


@pytest.mark.parametrize("eager", [False, True])
def test_cuda_phi3_longrope_float32_equals_cpu(hf_checkpoint, eager):
    torch.backends.cuda.matmul.allow_tf32 = False
    checkpoint = hf_checkpoint("phi3_longrope")
    cpu, _ = _run(checkpoint, "cpu", "float32")
    gpu, engine = _run(checkpoint, "cuda", "float32", eager=eager)
    assert engine.rope_switch == 16 and engine.runner.ops.name.startswith("triton[")
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(b.logits).cpu(), torch.stack(a.logits), atol=2e-4, rtol=2e-4)
    del engine
    gc.collect()


def test_cuda_phi3_bfloat16_close_to_float32(hf_checkpoint):
    checkpoint = hf_checkpoint("phi3_longrope")
    full, _ = _run(checkpoint, "cuda", "float32")
    half, _ = _run(checkpoint, "cuda", "bfloat16")
    for a, b in zip(full, half):
        first_a, first_b = a.logits[0].float(), b.logits[0].float()  # same context: the prompt
        assert (first_a - first_b).norm() / first_a.norm() < 3e-2
    gc.collect()
