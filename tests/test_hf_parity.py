"""lorad against Hugging Face transformers + PEFT: the same checkpoints and adapters, greedy decoding,
token ids equal and every step's logits within float32 tolerance.

All requests of a test go to the engine in one `generate` call, so base-model rows and rows of several
adapters (and two rows of one adapter) share batches; the reference decodes each request alone.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from hf_fixtures import ARCHITECTURES as FIXTURE_ARCHITECTURES
from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

MAX_TOKENS = 12
ATOL = RTOL = 1e-4
# Prompt lengths 1..40, one per request.
PROMPT_LENGTHS = (1, 7, 40, 16, 3, 29, 11, 2, 33, 24, 5, 40, 9, 19, 13)

# Every fixture checkpoint (tests/hf_fixtures.py): a family added there is checked here. phi3_longrope has
# tests of its own below (its prompts are chosen around its 16-token original context).
ARCHITECTURES = tuple(arch for arch in FIXTURE_ARCHITECTURES if arch != "phi3_longrope")

# transformers warns about its own deprecated internals while PEFT wraps the models.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


def make_cases(adapters: list[str], vocab_size: int, seed: int = 0,
               lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[tuple[list[int], str | None]]:
    """(prompt token ids, adapter) for every adapter and the base model, some of them twice, with
    prompt lengths 1..40; the last case repeats the third exactly (same prompt, same adapter)."""
    names = [None, *adapters]
    order = names + [adapters[0], None, adapters[2 % len(adapters)], adapters[-1], adapters[1 % len(adapters)]]
    order += [adapters[0], adapters[3 % len(adapters)]]
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for length, adapter in zip(lengths, order):
        prompt = torch.randint(3, vocab_size, (length,), generator=generator).tolist()  # no special tokens
        cases.append((prompt, adapter))
    cases.append(cases[2])
    return cases


def run_lorad(model_dir, adapters: dict, cases, status: dict | None = None, **config):
    """The cases' greedy results from a fresh engine (its /v1/status into `status` when given)."""
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            adapters=tuple((name, str(path)) for name, path in adapters.items()),
            **{"device": "cpu", "dtype": "float32", "max_running_requests": 64, **config},
        )
    )
    requests = [
        GenerationRequest(
            prompt_token_ids=list(prompt),
            adapter=adapter,
            sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
            keep_logits=True,
        )
        for prompt, adapter in cases
    ]
    try:
        results = engine.generate(requests)
        if status is not None:
            status.update(engine.status())
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    assert [r.request_id for r in results] == [r.request_id for r in requests], "results out of request order"
    return results


def mismatches(label: str, cases, results, reference, atol: float = ATOL) -> list[str]:
    """One line per request whose tokens or logits differ from HF's, saying where and by how much."""
    problems = []
    for index, ((prompt, adapter), result) in enumerate(zip(cases, results)):
        where = f"{label} request {index} (adapter={adapter}, prompt_len={len(prompt)})"
        expected_tokens, expected_logits = reference.greedy(prompt, adapter, MAX_TOKENS)
        if result.logits is None or len(result.logits) != len(result.token_ids):
            problems.append(f"{where}: keep_logits gave {result.logits and len(result.logits)} logits "
                            f"for {len(result.token_ids)} tokens")
            continue
        for step, (expected_token, expected) in enumerate(zip(expected_tokens, expected_logits)):
            if step >= len(result.token_ids):
                problems.append(f"{where}: only {len(result.token_ids)} tokens, expected {MAX_TOKENS}")
                break
            actual = result.logits[step].detach().to("cpu", torch.float32).reshape(-1)
            if actual.shape != expected.shape:
                problems.append(f"{where} step {step}: logits of shape {tuple(actual.shape)}, "
                                f"expected {tuple(expected.shape)}")
                break
            gap = (actual - expected).abs()
            top2 = expected.topk(2).values
            detail = (f"max |logit diff| {gap.max():.3e} at token {int(gap.argmax())}, "
                      f"|logits| max {expected.abs().max():.2f}, HF top1-top2 margin {top2[0] - top2[1]:.3e}")
            if result.token_ids[step] != expected_token:
                problems.append(f"{where}: first differing token at step {step}: lorad {result.token_ids[step]} "
                                f"vs HF {expected_token}; {detail}")
                break
            if not torch.allclose(actual, expected, atol=atol, rtol=atol):
                problems.append(f"{where} step {step}: logits differ (tokens equal): {detail}")
                break
        else:
            if len(result.token_ids) != MAX_TOKENS:
                problems.append(f"{where}: {len(result.token_ids)} tokens, expected {MAX_TOKENS} (ignore_eos)")
    return problems


def check_parity(label, model_dir, adapters, cases, reference, atol: float = ATOL, **config):
    results = run_lorad(model_dir, adapters, cases, **config)
    problems = mismatches(label, cases, results, reference, atol)
    assert not problems, f"{len(problems)} of {len(cases)} requests differ from HF + PEFT:\n" + "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_hf_peft(arch, hf_checkpoint, hf_reference):
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    check_parity(arch, checkpoint.model_dir, checkpoint.adapters, cases, reference)


@pytest.mark.parametrize("arch", ["mistral_window", "gemma2"])
def test_window_layers_pages_go_back_and_the_tokens_stay_hf_peft(arch, hf_checkpoint, hf_reference):
    """Prompts up to 5x the window: the sliding-window layers' pages before every window go back to the pool as the
    sequences advance (KVCache.trim), and every request still gives HF + PEFT's tokens and logits."""
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    status: dict = {}
    results = run_lorad(checkpoint.model_dir, checkpoint.adapters, cases, status)
    problems = mismatches(arch, cases, results, reference)
    assert not problems, "\n".join(problems)
    assert status["kv_sharing"]["window_pages_freed"] > 0
    assert status["pool"]["kv"] == 0  # every page back once the requests ended: none freed twice or kept


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_hf_peft_on_cuda(arch, hf_checkpoint, hf_reference):
    """The Triton ops and CUDA graphs in float32 (no TF32): HF + PEFT's greedy tokens, logits within 2e-4
    (the CPU reference's 1e-4 plus the kernels' different summation order)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    check_parity(f"{arch} cuda", checkpoint.model_dir, checkpoint.adapters, cases, reference, atol=2e-4, device="cuda")


# bfloat16 against HF + PEFT in float32: each request's first logits (the prompt alone decides them) within
# 3e-2 relative distance, as the engine's own bfloat16 test allows against its float32, or within 2.5x the
# distance of transformers' own bfloat16 on that request (the Gemma fixtures' (1 + w) norms near 2 and soft caps
# amplify bfloat16's rounding: transformers' own reaches 0.05-0.10 on some prompts); and the mean over the
# requests within 1.25x transformers' mean (or 1.5e-2). Measured on the CPU references over three sets of
# prompts: the mean 0.87-1.05x on every fixture, single requests up to 2.1x where transformers happens to land
# close. Rounding Gemma's norms where transformers does not put gemma3's mean at 1.45x and a request at 4.9x.
BF16_CASE_BOUND, BF16_CASE_FACTOR = 3e-2, 2.5
BF16_MEAN_BOUND, BF16_MEAN_FACTOR = 1.5e-2, 1.25


def relative_distance(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def check_bfloat16_close_to_hf(arch, hf_checkpoint, hf_reference, device: str) -> None:
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    reference_bf16 = hf_reference(checkpoint.model_dir, checkpoint.adapters, torch.bfloat16)
    results = run_lorad(checkpoint.model_dir, checkpoint.adapters, cases, device=device, dtype="bfloat16")
    ours, theirs, lines, over = [], [], [], []

    def check(label, distance, their_distance, bound):
        over.append(distance > bound)
        lines.append(f"{label}: {distance:.3e} (transformers' bfloat16 {their_distance:.3e}, bound {bound:.3e})"
                     + (" OVER" if over[-1] else ""))

    for (prompt, adapter), result in zip(cases, results):
        expected = reference.greedy(prompt, adapter, 1)[1][0]
        ours.append(relative_distance(result.logits[0].detach().to("cpu", torch.float32).reshape(-1), expected))
        theirs.append(relative_distance(reference_bf16.greedy(prompt, adapter, 1)[1][0], expected))
        check(f"adapter={adapter} prompt_len={len(prompt)}", ours[-1], theirs[-1],
              max(BF16_CASE_BOUND, BF16_CASE_FACTOR * theirs[-1]))
    mean, their_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
    check("mean", mean, their_mean, max(BF16_MEAN_BOUND, BF16_MEAN_FACTOR * their_mean))
    assert not any(over), (f"{arch} {device} bfloat16, relative distance of the first logits to HF + PEFT's "
                           "float32:\n" + "\n".join(lines))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bfloat16_on_cuda_close_to_hf_peft(arch, hf_checkpoint, hf_reference):
    """The Triton ops in bfloat16: within the bounds above (BF16_*)."""
    check_bfloat16_close_to_hf(arch, hf_checkpoint, hf_reference, "cuda")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bfloat16_on_cpu_close_to_hf_peft(arch, hf_checkpoint, hf_reference):
    """The torch references in bfloat16: within the same bounds as on cuda."""
    check_bfloat16_close_to_hf(arch, hf_checkpoint, hf_reference, "cpu")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gemma3_multimodal"])
def test_bfloat16_gemma_base_model_rounds_as_transformers(arch, hf_checkpoint, hf_reference):
    """One-token prompts on the base model, where attention is the value row itself: lorad's bfloat16 references
    round Gemma's embeddings, norms, GeGLU and residual adds as transformers' bfloat16 does, so the logits are
    equal (Gemma 3), or 3e-3 apart where Gemma 2 soft-caps the logits (lorad in float32, transformers in
    bfloat16). Rounding the norms' (1 + w) and normed rows to bfloat16 put them 1.2e-2 to 2.1e-2 apart."""
    checkpoint = hf_checkpoint(arch)
    reference_bf16 = hf_reference(checkpoint.model_dir, checkpoint.adapters, torch.bfloat16)
    prompts = [[token] for token in (3, 17, 100, checkpoint.vocab_size - 1)]
    results = run_lorad(checkpoint.model_dir, checkpoint.adapters, [(prompt, None) for prompt in prompts],
                        dtype="bfloat16")
    for prompt, result in zip(prompts, results):
        expected = reference_bf16.greedy(prompt, None, 1)[1][0]
        distance = relative_distance(result.logits[0].detach().float().reshape(-1), expected)
        bound = 5e-3 if arch == "gemma2" else 1e-3
        assert distance <= bound, f"{arch} prompt {prompt}: relative distance {distance:.3e} from transformers' bfloat16"


def test_prefill_split_over_several_steps(hf_checkpoint, hf_reference):
    # 15 prompts of 1..40 tokens, 64 tokens a step: prefills land in different steps, beside decodes.
    checkpoint = hf_checkpoint("llama")
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    check_parity("llama max_batch_tokens=64", checkpoint.model_dir, checkpoint.adapters, cases, reference,
                 max_batch_tokens=64)


def test_queued_requests_join_running_batch(hf_checkpoint, hf_reference):
    # Three run at a time: the other twelve wait and join as earlier ones finish.
    checkpoint = hf_checkpoint("qwen2")
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size, seed=1)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    check_parity("qwen2 max_running_requests=3", checkpoint.model_dir, checkpoint.adapters, cases, reference,
                 max_running_requests=3)


def test_demo_matches_hf_peft(demo_assets, hf_reference):
    # Proves daemon/model/demo.py writes a checkpoint and adapters that transformers and PEFT read as lorad does.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_assets.model_dir / "tokenizer.json"))
    texts = ["The", "The lighthouse keeper woke before the sun", "Why is the sky blue?",
             "To make a simple soup, cut two onions, three carrots and a potato into small pieces. Warm a spoon"]
    names = list(demo_assets.adapters)
    cases = [(tokenizer.encode(texts[i % len(texts)]).ids, adapter) for i, adapter in enumerate([None, *names])]
    cases += [(tokenizer.encode(text).ids, "demo-r16") for text in texts[1:]]
    reference = hf_reference(demo_assets.model_dir, demo_assets.adapters)
    check_parity("demo", demo_assets.model_dir, demo_assets.adapters, cases, reference)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_fixture_adapters_change_the_output(arch, hf_checkpoint, hf_reference):
    # Parity means little if an adapter's update were too small to move a token: each one must.
    checkpoint = hf_checkpoint(arch)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    prompts = [case[0] for case in make_cases(list(checkpoint.adapters), checkpoint.vocab_size)[:4]]
    base = [reference.greedy(prompt, None, MAX_TOKENS)[0] for prompt in prompts]
    for adapter in checkpoint.adapters:
        outputs = [reference.greedy(prompt, adapter, MAX_TOKENS)[0] for prompt in prompts]
        assert outputs != base, f"adapter {adapter} leaves every greedy output unchanged"


# phi3_longrope's original context is 16 tokens: these prompts either stay within it to their last generated
# token (prompt + MAX_TOKENS - 1 <= 16: short factors throughout) or exceed it from the start (long factors
# throughout), so that the reference, which recomputes the whole sequence every step, rotates each token as a
# KV cache keeps it. Sequences that cross it while generating: test_phi3_longrope_crossing_matches_hf_generate.
LONGROPE_LENGTHS = (1, 17, 40, 5, 3, 29, 20, 2, 33, 24, 5, 40, 4, 19, 1)


def test_phi3_longrope_matches_hf_peft(hf_checkpoint, hf_reference):
    """Short and long prompts in one batch, each rotated with its own factors (and partial rotary, and the
    attention factor): the fused-module adapters and the base model, as transformers + PEFT compute them."""
    checkpoint = hf_checkpoint("phi3_longrope")
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size, lengths=LONGROPE_LENGTHS)
    assert all(len(p) + MAX_TOKENS - 1 <= 16 or len(p) > 16 for p, _ in cases)
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    check_parity("phi3_longrope", checkpoint.model_dir, checkpoint.adapters, cases, reference)


@pytest.mark.parametrize("max_batch_tokens", [None, 8], ids=["whole-prompts", "prompt-chunks-of-8"])
def test_phi3_longrope_crossing_matches_hf_generate(hf_checkpoint, hf_reference, max_batch_tokens):
    """Prompts that cross the original context while generating, or are longer than it, against transformers'
    generate with its KV cache: the short factors until a token's position reaches 16, the long ones from there
    on (the earlier keys stay as cached), and a prompt longer than 16 on the long factors throughout, also when
    it is prefilled in chunks of 8 that start below 16."""
    checkpoint = hf_checkpoint("phi3_longrope")
    names = list(checkpoint.adapters)
    cases = make_cases(names, checkpoint.vocab_size, seed=2, lengths=(7, 11, 16, 13, 9, 20, 15))[:7]
    reference = hf_reference(checkpoint.model_dir, checkpoint.adapters)
    results = run_lorad(checkpoint.model_dir, checkpoint.adapters, cases,
                        **({"max_batch_tokens": max_batch_tokens} if max_batch_tokens else {}))
    model = reference.model
    problems = []
    for index, ((prompt, adapter), result) in enumerate(zip(cases, results)):
        if adapter is None:
            context = model.disable_adapter()
        else:
            model.set_adapter(adapter)
            context = nullcontext()
        with context, torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        where = f"request {index} (adapter={adapter}, prompt_len={len(prompt)})"
        if result.token_ids != tokens:
            problems.append(f"{where}: lorad {result.token_ids} vs HF generate {tokens}")
            continue
        for step, expected in enumerate(out.logits):
            if not torch.allclose(result.logits[step].float(), expected[0].float(), atol=ATOL, rtol=RTOL):
                problems.append(f"{where} step {step}: logits differ by {(result.logits[step] - expected[0]).abs().max():.3e}")
                break
    assert not problems, "\n".join(problems)
