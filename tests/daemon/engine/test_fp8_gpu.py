"""The engine with FP8 weights and FP8 KV pages on an FP8 GPU (compute capability >= 8.9), end to end on the demo
checkpoint with an intermediate size of 176 (its projections multiples of 16, as torch._scaled_mm needs) and random
adapters on every projection: the Triton/_scaled_mm path against the CPU reference of the same FP8 weights, against
bf16, and CUDA graphs (decode and prefill) against the eager path."""

import gc
import json
import shutil

from safetensors.torch import save_file

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.model.quantization import GPU_GEMM, GPU_GEMM_WIDE_ONE_ROW
from lorad.gpu_ops import fp8_gemm
from lorad.gpu_ops.fp8 import fp8_unavailable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or fp8_unavailable(torch.device("cuda")) is not None,
                       reason="needs a GPU with FP8 (compute capability >= 8.9)"),
]
ADAPTERS = 4


@pytest.fixture(scope="module")
def model_dir(demo_assets, tmp_path_factory):
    """The demo's tokenizer and shape, intermediate 176, random weights drawn on the CPU (the same on every device)."""
    from lorad.daemon.model.checkpoint import ModelSpec, dummy_weights

    target = tmp_path_factory.mktemp("aligned") / "model"
    shutil.copytree(demo_assets.model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] = 176
    (target / "config.json").write_text(json.dumps(config))
    weights = dummy_weights(ModelSpec.from_hf_config(config), torch.float32, torch.device("cpu"), seed=3)
    save_file(weights, str(target / "model.safetensors"))
    return target


def _engine(model_dir, device: str, dtype: str, **config) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dummy_adapters=ADAPTERS, dummy_adapter_rank=8,
                               dummy_adapter_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                               device=device, dtype=dtype, max_model_len=512, max_running_requests=16,
                               pool_bytes=64 << 20, **config))


def _requests(count: int, max_tokens: int) -> list[GenerationRequest]:
    generator = torch.Generator().manual_seed(count)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    names = [None] + [f"dummy-{i}" for i in range(ADAPTERS)]
    return [GenerationRequest(torch.randint(2, 512, (int(torch.randint(3, 200, (1,), generator=generator)),),
                                            generator=generator).tolist(), names[i % len(names)], greedy, keep_logits=True)
            for i in range(count)]


def _run(engine: Engine, count: int = 64, max_tokens: int = 8, preload: bool = False):
    """preload: the adapters placed before the requests come, so that none waits for its copy (or is computed on the
    CPU while it streams) and two engines run the same steps."""
    for name in [f"dummy-{i}" for i in range(ADAPTERS)] if preload else []:
        assert engine.residency.preload(name)
    results = engine.generate(_requests(count, max_tokens))
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _agreement(a, b) -> float:
    return sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a, b)) / len(a)


# This fixture's random weights give flat next-token distributions: over half the prompts' top two logits lie
# within 0.25 of each other, and E4M3 activations quantized per token (the GPU's _scaled_mm path; the CPU's
# reference keeps them unquantized) move a first-token logit by 0.17-0.24 at the median and 0.51 at most. Emulated
# on the CPU (gpu_ops/fp8.py's scaled_mm_ref in the reference's place, 192 prompts), that alone flips 10-12% of the
# first tokens, each between candidates at most 0.21 apart, with the mean KL at 0.0016-0.003. So first tokens must
# agree wherever the reference's top two lie further apart than DECIDED_MARGIN (above any one logit's move seen,
# three times the widest gap a flip crossed; about one prompt in ten), and the distributions be close (KL below).
DECIDED_MARGIN = 0.62
DECIDING_PROMPTS = 192


def _decided_agree(a, b) -> None:
    decided = [(x, y) for x, y in zip(a, b) if float(x.logits[0].float().topk(2).values.diff().abs()) > DECIDED_MARGIN]
    assert len(decided) >= len(a) // 16, f"only {len(decided)} of {len(a)} prompts decided: the check says little"
    flipped = [(x.request_id, x.token_ids[0], y.token_ids[0]) for x, y in decided if x.token_ids[0] != y.token_ids[0]]
    assert not flipped, f"first tokens differ where the reference's top two are over {DECIDED_MARGIN} apart: {flipped}"


def _kl(a, b) -> float:
    log_p = torch.stack([r.logits[0] for r in a]).log_softmax(-1)
    log_q = torch.stack([r.logits[0] for r in b]).log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def test_fp8_engine_status_and_graphs(model_dir):
    engine = _engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8")
    status = engine.status()
    wide_one_row_gemv = fp8_gemm.takes_gemv(1, fp8_gemm.NARROW_OUT_FEATURES + 1, torch.device("cuda"))
    assert status["quantization"]["gemm"] == (GPU_GEMM if wide_one_row_gemv else GPU_GEMM_WIDE_ONE_ROW)
    assert status["kv_cache_dtype"] == "fp8_e4m3"
    assert engine.runner.graphs is not None and engine.runner.prefill_graphs is not None
    engine.generate(_requests(16, 8))
    assert engine.runner.graph_steps > 0 and engine.runner.prefill_graph_steps > 0


def test_fp8_gpu_against_its_cpu_reference(model_dir):
    """The same FP8 weights (quantized at load from the same bf16 draws) and FP8 KV: the GPU's kernels (rows
    quantized per token) against the CPU's dequantized reference in float32."""
    gpu = _run(_engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8"), DECIDING_PROMPTS)
    cpu = _run(_engine(model_dir, "cpu", "bfloat16", quantization="fp8", kv_cache_dtype="fp8"), DECIDING_PROMPTS)
    _decided_agree(cpu, gpu)
    assert _kl(cpu, gpu) < 0.02


def test_fp8_against_bf16_and_graphs_against_eager(model_dir):
    bf16 = _run(_engine(model_dir, "cuda", "bfloat16"), DECIDING_PROMPTS)
    graphs = _run(_engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8"), DECIDING_PROMPTS)
    eager = _run(_engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8", eager=True), DECIDING_PROMPTS)
    _decided_agree(bf16, graphs)
    assert _kl(bf16, graphs) < 0.02
    # the graphs pad their rows to a bucket (another GEMM tile choice): the same tokens but for near ties
    assert _agreement(graphs, eager) >= 0.95
    assert _kl(graphs, eager) < 1e-3


def test_fp8_decode_pdl_gives_the_same_tokens(model_dir):
    """decode_pdl: the FP8 decode step's kernels (the norms that quantize their rows, the rows GEMM, the FP8-page
    attention, MBGMV) launched early (decode_pdl on) give the tokens and logits of stream order to the bit, in graphs
    of several rows and of one; auto launches only the steps of one row early (DECODE_PDL_FP8_ROWS)."""
    from lorad.gpu_ops.launch import pdl_unavailable

    reason = pdl_unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    for count in (24, 1):
        plain = _run(_engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8", decode_pdl="off"),
                     count, max_tokens=12, preload=True)
        again = _run(_engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8", decode_pdl="off"),
                     count, max_tokens=12, preload=True)
        for a, b in zip(plain, again):  # the control: two engines in stream order agree to the bit
            x, y = torch.stack(a.logits), torch.stack(b.logits)
            assert torch.equal(x, y), f"two engines in stream order differ by up to {float((x - y).abs().max()):.3g}"
        early = _run(_engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8", decode_pdl="on"),
                     count, max_tokens=12, preload=True)
        for a, b in zip(plain, early):
            assert a.token_ids == b.token_ids
            x, y = torch.stack(a.logits), torch.stack(b.logits)
            assert torch.equal(x, y), f"logits differ by up to {float((x - y).abs().max()):.3g} (steps {(x != y).any(-1).nonzero().flatten().tolist()})"
    auto = _engine(model_dir, "cuda", "bfloat16", quantization="fp8", kv_cache_dtype="fp8")
    assert auto.status()["decode_pdl"] == {"on": True, "why": None, "max_rows": 1}
