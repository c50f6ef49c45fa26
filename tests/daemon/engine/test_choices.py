"""A request's n choices (GenerationRequest.n) on the demo model: the prompt is prefilled once and its KV blocks
shared (a KV page holds 2 tokens, so an odd prompt leaves a partial block that each choice copies); every choice
produces what an independent request would (greedy: the n=1 tokens; seeded: the tokens of seed + i), with its own
penalties and logprobs; a choice that ends, is aborted or preempted gives back only its own holds, so the pool
returns to where it was and no page another choice reads is ever handed out."""

from __future__ import annotations

import dataclasses

import pytest

from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.errors import AdmissionDropped, BadRequest
from lorad.scheduler.admission import EarlyAbort
from lorad.scheduler.perf_model import PrefillModel

from test_engine import GREEDY, make_engine, prompts

PROMPTS = [[7], [5, 9, 11, 13], list(range(20, 33)), list(range(40, 57))]  # 1, 4, 13 and 17 tokens
SEEDED = dict(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def engine(demo_assets):
    return make_engine(demo_assets, max_model_len=96)


def choice_tokens(result) -> list[list[int]]:
    return [choice.token_ids for choice in result.choices]


def assert_back_to_baseline(engine, free: int) -> None:
    assert engine.pool.num_free == free and engine.pool.used["kv"] == 0
    assert engine.kv.holders == {} and not engine.scheduler.has_work() and not engine._sequences


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda prompt: f"{len(prompt)}-tokens")
def test_greedy_choices_are_the_single_request_from_one_prefill(engine, prompt):
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    alone = engine.generate([GenerationRequest(prompt, "demo-r8", sampling)])[0]
    free = engine.pool.num_free  # the adapter stays resident
    before = {kind: dataclasses.replace(totals) for kind, totals in engine.account.totals.items()}
    result = engine.generate([GenerationRequest(prompt, "demo-r8", sampling, n=4)])[0]
    assert choice_tokens(result) == [alone.token_ids] * 4
    assert [choice.text for choice in result.choices] == [alone.text] * 4
    assert result.token_ids == alone.token_ids  # the request's own result is its first choice's
    computed = sum(engine.account.totals[kind].prompt_tokens - before[kind].prompt_tokens for kind in before)
    assert computed == len(prompt)  # the prompt computed once, not once per choice
    steps = sum(engine.account.totals[kind].steps - before[kind].steps for kind in before)
    assert steps == 12  # one prefill (which gave every choice its first token), then 11 decode steps of 4 rows
    assert engine.account.totals["decode"].rows - before["decode"].rows == 4 * 11
    assert_back_to_baseline(engine, free)


def test_seeded_choices_repeat_and_differ_each_as_seed_plus_i(engine):
    prompt = PROMPTS[2]
    request = GenerationRequest(prompt, None, SamplingParams(max_tokens=10, seed=11, **SEEDED), n=4)
    first = choice_tokens(engine.generate([request])[0])
    again = choice_tokens(engine.generate([dataclasses.replace(request, request_id="again")])[0])
    assert again == first and len({tuple(tokens) for tokens in first}) == 4
    for choice, tokens in enumerate(first):  # choice i draws as a request of its own with seed + i would
        alone = GenerationRequest(prompt, None, SamplingParams(max_tokens=10, seed=11 + choice, **SEEDED))
        assert engine.generate([alone])[0].token_ids == tokens
    unseeded = choice_tokens(engine.generate([GenerationRequest(prompt, None, SamplingParams(max_tokens=10, **SEEDED), n=4)])[0])
    assert len({tuple(tokens) for tokens in unseeded}) > 1


def test_penalties_min_tokens_and_logprobs_per_choice(engine):
    sampling = SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
                              repetition_penalty=1.3, min_tokens=3, logprobs=3, logit_bias=((33, 2.0),))
    alone = engine.generate([GenerationRequest(PROMPTS[3], "demo-r4", sampling)])[0]
    result = engine.generate([GenerationRequest(PROMPTS[3], "demo-r4", sampling, n=3)])[0]
    for choice in result.choices:
        assert choice.token_ids == alone.token_ids
        assert [[token for token, _ in entry.top] for entry in choice.logprobs] == [[token for token, _ in entry.top]
                                                                                for entry in alone.logprobs]
        values = [[entry.logprob, *(value for _, value in entry.top)] for entry in choice.logprobs]
        # a batch of 3 rows rounds differently from a batch of 1
        assert values == [pytest.approx([entry.logprob, *(value for _, value in entry.top)], abs=1e-4)
                          for entry in alone.logprobs]


def test_a_choice_that_stops_early_leaves_the_others_their_shared_pages(demo_assets):
    """One choice hits a stop token after two tokens; requests beside it then take the pool's free pages (the
    pool hands out the most recently freed first). Had the ending choice freed a page the others read, those
    requests would overwrite it and the others' tokens would change."""
    engine = make_engine(demo_assets, pages=8 * 60, max_model_len=40)
    free = engine.pool.num_free
    sampling = SamplingParams(max_tokens=14, seed=3, ignore_eos=True, **SEEDED)
    prompt = PROMPTS[2]
    free_run = choice_tokens(engine.generate([GenerationRequest(prompt, None, sampling, n=4)])[0])
    stop = next((tokens[1], index) for index, tokens in enumerate(free_run)
                if tokens[1] not in tokens[:1] and all(tokens[1] not in other for other in free_run if other is not tokens))
    stop_token, early = stop
    beside = [GenerationRequest(list(p), None, SamplingParams(max_tokens=14, **GREEDY)) for p in prompts(3, seed=4)]
    beside_alone = [engine.generate([dataclasses.replace(r, request_id=f"alone-{i}")])[0].token_ids for i, r in enumerate(beside)]
    stopping = GenerationRequest(prompt, None, dataclasses.replace(sampling, stop_token_ids=(stop_token,)), n=4)
    results = engine.generate([stopping, *beside])
    tokens = choice_tokens(results[0])
    assert tokens[early] == free_run[early][:2] and results[0].choices[early].finish_reason == "stop"
    assert [t for i, t in enumerate(tokens) if i != early] == [t for i, t in enumerate(free_run) if i != early]
    assert [result.token_ids for result in results[1:]] == beside_alone
    assert_back_to_baseline(engine, free)


def test_preempted_and_waiting_choices_still_produce_the_single_request(demo_assets):
    """A pool too small for 4 long choices (they are preempted and computed again, prompt blocks and all) and a
    running cap under n (the choices past it wait at the head of the queue with their blocks)."""
    for config in (dict(pages=8 * 32), dict(max_running_requests=2)):  # 30 blocks beside the adapter; 52 wanted
        engine = make_engine(demo_assets, max_model_len=48, **config)
        sampling = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
        alone = engine.generate([GenerationRequest(PROMPTS[3], "demo-r1", sampling)])[0].token_ids
        free = engine.pool.num_free
        preemptions = []
        original = engine.scheduler.preempt
        engine.scheduler.preempt = lambda seq: (preemptions.append(seq.state.choice), original(seq))
        result = engine.generate([GenerationRequest(PROMPTS[3], "demo-r1", sampling, n=4)])[0]
        assert choice_tokens(result) == [alone] * 4, config
        if "pages" in config:
            assert preemptions, "the pool was meant to be too small for every choice at once"
        assert engine.status()["preemptions"] == len(preemptions)  # counted for /v1/status and /metrics
        assert_back_to_baseline(engine, free)


def test_the_pool_counts_shared_blocks_once(engine):
    """Mid-run, /v1/status's kv pages are the distinct pages the choices hold: the prompt's full blocks once."""
    prompt = PROMPTS[3]  # 17 tokens: 8 full blocks shared, the 9th copied per choice
    engine.submit(GenerationRequest(prompt, None, SamplingParams(max_tokens=6, ignore_eos=True, **GREEDY), n=4,
                                    request_id="shared"))
    engine.step()  # the prefill, and the fork
    engine.step()
    per_block = engine.kv.pages_per_block
    status = engine.status()
    held = sum(len(seq.blocks) for seq in engine.scheduler.running) * per_block
    assert len(engine.scheduler.running) == 4
    assert status["pool"]["kv"] == (8 + 4) * per_block  # the shared prompt blocks once; block 9 (16-17) per choice
    assert status["kv_sharing"]["shared_blocks"] == 8 and status["kv_sharing"]["pages_saved"] == 3 * 8 * per_block
    assert status["pool"]["kv"] + status["kv_sharing"]["pages_saved"] == held
    while engine.scheduler.has_work():
        engine.step()
    engine._finished.clear()
    assert engine.status()["pool"]["kv"] == 0 and engine.status()["kv_sharing"]["shared_blocks"] == 0


def test_abort_ends_every_choice_before_or_after_the_fork(demo_assets):
    engine = make_engine(demo_assets, max_model_len=96)
    free = engine.pool.num_free
    outputs = []
    for steps_before_abort in (0, 1, 4):
        outputs.clear()
        request = GenerationRequest(PROMPTS[2], None, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY), n=3,
                                    request_id=f"abort-{steps_before_abort}", on_output=outputs.append)
        engine.submit(request)
        for _ in range(steps_before_abort):
            engine.step()
        engine.abort(request.request_id)
        engine.step()
        finished = sorted((output.choice, output.finish_reason) for output in outputs if output.finished)
        assert finished == [(0, "abort"), (1, "abort"), (2, "abort")], steps_before_abort
        assert {output.choice for output in outputs if output.new_token_ids} == (set() if steps_before_abort == 0 else {0, 1, 2})
        engine._finished.clear()
        assert_back_to_baseline(engine, free)


def test_a_request_dropped_before_its_prefill_fails_every_choice(demo_assets):
    engine = make_engine(demo_assets, max_model_len=96, admission="early-abort", slo_ttft_ms=1000)
    engine.scheduler.admission = EarlyAbort(PrefillModel(0.1, 0.0, 0.0, 0.0))  # 10 prompt tokens cannot make 1 s
    free, outputs = engine.pool.num_free, []
    engine.submit(GenerationRequest(list(range(20, 40)), None, SamplingParams(max_tokens=4, **GREEDY), n=2,
                                    request_id="dropped", on_output=outputs.append))
    engine.step()
    assert sorted((output.choice, output.finish_reason) for output in outputs) == [(0, "error"), (1, "error")]
    assert all(output.error_type == AdmissionDropped.type for output in outputs)
    engine._finished.clear()
    assert_back_to_baseline(engine, free)


def test_n_must_be_a_positive_integer(engine):
    for n in (0, -1, 1.5, True):
        with pytest.raises(BadRequest, match="n must be a positive integer"):
            engine.submit(GenerationRequest([5, 6], None, SamplingParams(max_tokens=2), n=n, request_id=f"bad-{n}"))
