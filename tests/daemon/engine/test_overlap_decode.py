"""Overlapped decode (daemon/engine/engine.py): a greedy decode step launched from the tokens of the step before
it while they are still "on the device", and those tokens read afterwards. The engine turns it on only on
cuda; these tests turn it on for the CPU demo model, where every launch completes at once, to check the
bookkeeping: the same tokens, finish reasons, text and streamed outputs as plain stepping, through stop
tokens and strings (a row computed past its end), length limits (rows left out), arrivals and aborts
while a step is in flight, preemption in a tiny pool, and the requests it must not touch."""

from __future__ import annotations

import time

import pytest
import torch
from test_engine import GREEDY, count_calls, make_engine, prompts, requests

from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

ADAPTERS = [None, "demo-r1", "demo-r2", "demo-r8", "demo-r16"]


def overlapped(engine: Engine) -> Engine:
    engine.overlap_decode = True
    return engine


@pytest.fixture(scope="module")
def plain(demo_assets) -> Engine:
    return make_engine(demo_assets)


def mixed_requests(plain: Engine) -> list[GenerationRequest]:
    """Mixed adapters and lengths; one stops on a token and one on a string, mid-stream."""
    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(7, seed=21, low=3, high=18))]
    reqs = [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=4 + 3 * i, **GREEDY))
            for i, (prompt, adapter) in enumerate(cases)]
    full = plain.generate([GenerationRequest(cases[5][0], cases[5][1], SamplingParams(max_tokens=19, **GREEDY))])[0]
    reqs[5] = GenerationRequest(cases[5][0], cases[5][1], SamplingParams(max_tokens=19, stop_token_ids=(full.token_ids[6],), **GREEDY))
    text = plain.generate([GenerationRequest(cases[6][0], cases[6][1], SamplingParams(max_tokens=22, **GREEDY))])[0].text
    reqs[6] = GenerationRequest(cases[6][0], cases[6][1], SamplingParams(max_tokens=22, stop=(text[len(text) // 2 : len(text) // 2 + 2],), **GREEDY))
    return reqs


def streamed(reqs: list[GenerationRequest]) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for request in reqs:
        outputs[request.request_id] = []
        request.on_output = outputs[request.request_id].append
    return outputs


def test_off_on_the_cpu_by_default_and_said(demo_assets):
    engine = make_engine(demo_assets)
    assert engine.config.overlap_decode and not engine.overlap_decode  # nothing to overlap with on the cpu
    status = engine.status()
    assert status["overlap_decode"] is False and status["overlapped_decode_steps"] == 0
    assert status["plan_ahead"] == {"on": False, "why": "no overlapped decode"} and status["planned_ahead_steps"] == 0
    assert status["steps_read_at_once"] == {}  # nothing is deferred, so nothing counted as read at once


def test_same_tokens_text_and_stream_as_plain_stepping(demo_assets, plain):
    expected = plain.generate(mixed_requests(plain))
    reqs = mixed_requests(plain)
    outputs = streamed(reqs)
    engine = overlapped(make_engine(demo_assets))
    results = engine.generate(reqs)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
    assert [r.text for r in results] == [r.text for r in expected]
    assert {r.finish_reason for r in results} == {"length", "stop"}
    assert results[5].finish_reason == "stop" and len(results[5].token_ids) < 19  # ended with rows still in flight
    assert results[6].finish_reason == "stop" and len(results[6].token_ids) < 22
    assert engine.overlapped_steps > 10
    for request, result in zip(reqs, results):
        chunks = outputs[request.request_id]
        assert [t for o in chunks for t in o.new_token_ids] == result.token_ids
        assert "".join(o.text_delta for o in chunks) == result.text
        assert sum(o.finished for o in chunks) == 1 and chunks[-1].finished
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_a_full_running_batch_overlaps_while_others_wait(demo_assets, plain):
    """Two running slots for seven requests: the steps overlap while the others wait for a slot, and each joins
    once one ends (the step after it is planned by the scheduler): the plain engine's tokens and texts."""
    expected = plain.generate(mixed_requests(plain))
    engine = overlapped(make_engine(demo_assets, max_running_requests=2))
    overlaps = []
    step = engine._launch_next_decode

    def watched(began):
        launched = step(began)
        if launched:
            overlaps.append(len(engine.scheduler.waiting))
        return launched

    engine._launch_next_decode = watched
    results = engine.generate(mixed_requests(plain))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.text for r in results] == [r.text for r in expected]
    assert any(waiting > 0 for waiting in overlaps)  # overlapped with requests queued
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_a_step_that_admits_a_request_beside_the_decode_rows_overlaps_the_next(demo_assets, plain):
    """Two running slots for seven requests: a step that admits a queued request beside the running one's decode
    row (its whole prompt in the step) hands its tokens to the next step on the device, as a decode step does;
    its time still feeds the prefill model, taken when it lands. The plain engine's tokens and texts."""
    expected = plain.generate(mixed_requests(plain))
    engine = overlapped(make_engine(demo_assets, max_running_requests=2))
    launched = count_calls(engine.runner, "forward")
    observed = count_calls(engine, "_observe_prefill")
    engine.cold_starts.observe_prefill = lambda tokens, seconds: None  # what auto would learn; counted above
    engine.config = type(engine.config)(**{**vars(engine.config), "cold_start": "auto"})  # a model that wants it
    results = engine.generate(mixed_requests(plain))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.text for r in results] == [r.text for r in expected]
    plans = [call[0] for call in launched]
    mixed = [i for i, plan in enumerate(plans[:-1]) if not plan.decode and any(c == 1 for c in plan.counts)]
    assert mixed and all(plans[i + 1].device_tokens is not None for i in mixed)  # the next launched from its tokens
    prompt_tokens = [sum(int(count) for seq, count, start in zip(plan.seqs, plan.counts, plan.starts) if start < seq.prompt_len)
                     for plan in plans]
    timed = [i for i, tokens in enumerate(prompt_tokens) if tokens >= 8]  # the steps the prefill model takes
    assert set(timed) & set(mixed)
    assert [tokens for tokens, _ in observed] == [int(plans[i].counts.sum()) for i in timed]
    assert all(seconds >= 0 for _, seconds in observed)
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_a_step_admitting_the_queue_is_planned_and_launched_before_the_step_in_flight_lands(demo_assets, plain):
    """Two running slots for seven requests, a stop token and a stop string among them: each step that admits the
    queue's head beside the running rows is planned while the step before it is in flight, its decode rows' input ids
    that step's tokens on the device, and launched before they are read. The plain engine's tokens and texts; a row
    that ended on the landed tokens (a stop) was computed past its end and dropped."""
    expected = plain.generate(mixed_requests(plain))
    engine = overlapped(make_engine(demo_assets, max_running_requests=2))
    launched = count_calls(engine.runner, "forward")
    landed = []
    finish = engine._finish_step_in_flight

    def watched():
        landed.append(len(launched))
        finish()

    engine._finish_step_in_flight = watched
    results = engine.generate(mixed_requests(plain))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
    assert [r.text for r in results] == [r.text for r in expected]
    plans = [call[0] for call in launched]
    ahead = [plan for plan in plans if plan.device_tokens is not None and not plan.every_token_on_device]
    assert engine.planned_ahead_steps >= 4 and len(ahead) >= 4  # the queue's head joined beside a row in flight
    for plan in ahead:
        prompt_rows = [i for i, seq in enumerate(plan.seqs) if plan.starts[i] < seq.prompt_len]
        assert prompt_rows and set(prompt_rows).isdisjoint(plan.device_rows.tolist())
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_a_step_planned_ahead_is_timed_for_the_prefill_model_from_the_landing_before_it(demo_assets, plain):
    """The prefill model (cold_start auto, early abort) takes a step's time from where the device turned to it: for a
    step launched behind the one in flight, from that one's landing, not from its own launch. Here the step in flight
    takes 0.4 s more to land whenever a step planned ahead was launched behind it (a slow device, as the host sees
    it): no observed time holds those 0.4 s."""
    engine = overlapped(make_engine(demo_assets, max_running_requests=2))
    engine.cold_starts.observe_prefill = lambda tokens, seconds: None
    engine.config = type(engine.config)(**{**vars(engine.config), "cold_start": "auto"})  # a model that wants it
    observed = count_calls(engine, "_observe_prefill")
    launched = count_calls(engine.runner, "forward")
    finish, slowed = engine._finish_step_in_flight, []

    def slow_landing():
        last = launched[-1][0]
        if last.device_tokens is not None and not last.every_token_on_device and engine._in_flight.seqs != last.seqs:
            time.sleep(0.4)  # the step in flight, with a step planned ahead behind it
            slowed.append(last)
        finish()

    engine._finish_step_in_flight = slow_landing
    results = engine.generate(mixed_requests(plain))
    assert [r.token_ids for r in results] == [r.token_ids for r in plain.generate(mixed_requests(plain))]
    assert slowed and observed
    assert all(seconds < 0.3 for _, seconds in observed), observed


@pytest.mark.parametrize("case", ["chunked", "sampled", "one_token_prompt"])
def test_steps_planned_ahead_beside_prompt_chunks_draws_and_one_token_prompts(demo_assets, case):
    """A prompt chunk that does not end its prompt, beside decode rows, is planned ahead and its step overlapped, the
    chunks after it coming from the host; a row drawn with a temperature is planned ahead like a greedy one; a
    one-token prompt joins the decode rows as a decode step with some input ids from the host. The plain engine's
    tokens either way."""
    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(4, seed=8, low=5, high=12))]
    config = {"max_running_requests": 2}
    if case == "chunked":
        cases[2] = (prompts(1, seed=9, low=40, high=40)[0], "demo-r2")
        config["max_batch_tokens"] = 16
    if case == "one_token_prompt":
        cases[2] = ([77], "demo-r1")

    def reqs() -> list[GenerationRequest]:
        made = [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=3 + 4 * i, **GREEDY))
                for i, (prompt, adapter) in enumerate(cases)]
        if case == "sampled":
            made[2] = GenerationRequest(list(cases[2][0]), cases[2][1], SamplingParams(max_tokens=11, temperature=0.8, seed=4))
        return made

    plain_engine = make_engine(demo_assets, **config)
    expected = [plain_engine.generate([request])[0].token_ids for request in reqs()]
    engine = overlapped(make_engine(demo_assets, **config))
    launched = count_calls(engine.runner, "forward")
    results = engine.generate(reqs())
    assert [r.token_ids for r in results] == expected
    assert engine.planned_ahead_steps > 0
    plans = [call[0] for call in launched]
    if case == "one_token_prompt":
        assert any(plan.decode and plan.device_tokens is not None and not plan.every_token_on_device for plan in plans)
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_a_long_prompt_in_chunks_beside_decode_rows_leaves_no_step_read_at_once(demo_assets, plain):
    """A 40-token prompt admitted in chunks of a 16-token budget beside running requests: each chunk's step samples
    the decode rows beside it, so it is overlapped and the next planned ahead; no step after the first waits for
    the tokens of the one before it (which a chunk's step made every step after it do)."""
    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(3, seed=5, low=4, high=8))]
    cases.append((prompts(1, seed=6, low=40, high=40)[0], "demo-r4"))
    reqs = lambda: [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=20, **GREEDY))  # noqa: E731
                    for prompt, adapter in cases]
    expected = [plain.generate([request])[0].token_ids for request in reqs()]
    engine = overlapped(make_engine(demo_assets, max_running_requests=4, max_batch_tokens=16))
    read_first = []  # steps begun with requests running and no step in flight: they waited for its tokens
    step = engine.step

    def counted_step():
        if engine._in_flight is None and engine.scheduler.running:
            read_first.append(engine.steps)
        step()

    engine.step = counted_step
    results = engine.generate(reqs())
    assert [r.token_ids for r in results] == expected
    assert engine.account.totals["mixed"].steps >= 4  # the long prompt's chunks beside decode rows
    assert read_first == [], read_first
    assert engine.status()["steps_read_at_once"] == {}
    alone = overlapped(make_engine(demo_assets, max_running_requests=4, max_batch_tokens=16))
    assert alone.generate(reqs()[-1:])[0].token_ids == expected[-1]
    assert alone.status()["steps_read_at_once"] == {"prompt_chunks_alone": 2}  # 16 + 16 of its 40 tokens, then 8
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_the_step_log_has_a_line_per_step_with_how_it_was_launched(demo_assets, plain, tmp_path, monkeypatch):
    """LORAD_STEP_LOG: a header, then each step's kind, rows, times and the engine's notes: launched from the tokens
    in flight, planned ahead or after the host read the step before it, and why a step was read at once."""
    import json

    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LORAD_STEP_LOG", str(path))
    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(6, seed=5, low=4, high=8))]
    reqs = [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=4 + i, **GREEDY)) for i, (prompt, adapter)
            in enumerate(cases)]
    reqs.append(GenerationRequest(prompts(1, seed=6, low=40, high=40)[0], "demo-r4", SamplingParams(max_tokens=3, **GREEDY)))
    engine = overlapped(make_engine(demo_assets, max_running_requests=3, max_batch_tokens=16))
    engine.generate(reqs)
    engine.close()
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["step_log"] == 1 and len(lines) == engine.steps
    origins = {line["origin"] for line in lines}
    assert origins == {"after_landing", "planned_ahead", "tokens_in_flight"}
    assert sum(line["kind"] == "decode" for line in lines) == engine.account.totals["decode"].steps
    assert sum(line["rows"] for line in lines) == sum(totals.rows for totals in engine.account.totals.values())
    read_at_once = [line["read_at_once"] for line in lines if "read_at_once" in line]
    assert sorted(read_at_once) == sorted(cause for cause, count in engine.read_at_once.items() for _ in range(count))
    assert all(line["busy_ms"] >= line["host_before_launch_ms"] >= 0 and line["floor_ms"] > 0 for line in lines)
    assert all("forward_ms" not in line for line in lines)  # no device clock on the cpu
    assert all(line["host_ms"] >= 0 for line in lines)  # the host's time from its step() to its launch
    for line in lines:  # split into parts that add up to it, each by where it is marked in step()
        split = line["host_split_ms"]
        assert split["launch"] >= 0 and abs(sum(split.values()) - line["host_ms"]) < 0.01, line
        assert "inbox" in split and ("rows" in split) == (line["origin"] != "after_landing" or "landing" in split)
        assert line["host_cpu_ms"] >= 0 and line["gc_ms"] >= 0 and line["pin_ms"] == 0  # nothing pinned on the cpu
    assert sum("between_ms" in line for line in lines) >= len(lines) - 1  # all but the first after an idle engine
    assert all(("admit" in line["host_split_ms"]) == (line["origin"] != "tokens_in_flight") for line in lines)
    residency = [line["residency_ms"] for line in lines if "residency_ms" in line]  # the adapters' placements
    assert residency and all(set(spent) <= {"lookup", "stage", "pin", "place", "evict"} for spent in residency)
    landings = [line for line in lines if "landing_wait_ms" in line]  # a step launched before its predecessor landed
    assert landings and all(line["origin"] != "after_landing" and line["landing_take_ms"] >= 0 for line in landings)
    assert all(line.get("prefetch_ms", 0) == 0 for line in lines)  # no cold adapter streams in on the cpu
    assert [line["landed_s"] for line in lines] == sorted(line["landed_s"] for line in lines)


def test_a_step_log_that_cannot_be_written_is_a_clear_error(demo_assets, tmp_path, monkeypatch):
    from lorad.errors import BadRequest

    monkeypatch.setenv("LORAD_STEP_LOG", str(tmp_path / "no" / "such" / "dir" / "steps.jsonl"))
    with pytest.raises(BadRequest, match="LORAD_STEP_LOG: cannot write the step log"):
        make_engine(demo_assets)


@pytest.mark.parametrize("seed", range(6))
def test_random_queues_give_the_plain_engines_tokens(demo_assets, seed):
    """Fourteen requests of 1-40 prompt tokens and 1-12 output tokens over the base model and five adapters, in a few
    running slots, small token budgets (chunked prompts) and small pools (adapters evicted while steps are in flight):
    overlapped and planned ahead, each request gets the tokens it gets alone from a plain engine."""
    import random

    rng = random.Random(seed)
    names = [None, "demo-r1", "demo-r2", "demo-r4", "demo-r8", "demo-r16"]
    cases = [(prompt, rng.choice(names), rng.randint(1, 12)) for prompt in prompts(14, seed=seed, low=1, high=40)]
    config = dict(max_running_requests=rng.choice([2, 3, 4]), max_batch_tokens=rng.choice([16, 32, 64]),
                  pages=rng.choice([300, 600, 4096]), kv_admission_headroom=0)

    def reqs() -> list[GenerationRequest]:
        return [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=limit, **GREEDY))
                for prompt, adapter, limit in cases]

    plain_engine = make_engine(demo_assets, **config)
    expected = [plain_engine.generate([request])[0].token_ids for request in reqs()]
    engine = overlapped(make_engine(demo_assets, **config))
    results = engine.generate(reqs())
    assert [r.token_ids for r in results] == expected
    assert engine.planned_ahead_steps > 0 and engine.overlapped_steps > 0
    assert engine.pool.occupancy()["kv"] == 0 and not engine.scheduler.has_work() and engine._in_flight is None


def test_arrivals_and_aborts_while_a_step_is_in_flight(demo_assets, plain):
    cases = [(prompt, ADAPTERS[i]) for i, prompt in enumerate(prompts(4, seed=5, low=4, high=12))]
    expected = [plain.generate(requests([case], 12))[0].token_ids for case in cases]
    engine = overlapped(make_engine(demo_assets))
    reqs = requests(cases, 12)
    outputs = streamed(reqs)
    engine.submit(reqs[0])
    engine.submit(reqs[1])
    engine.submit(reqs[2])
    while engine.overlapped_steps < 3:
        engine.step()
    assert engine._in_flight is not None
    engine.submit(reqs[3])  # joins: planned and launched beside the others before the step in flight lands
    engine.abort(reqs[1].request_id)  # its row in flight is dropped
    steps, ahead = engine.overlapped_steps, engine.planned_ahead_steps
    engine.step()
    assert engine.overlapped_steps == steps and engine.planned_ahead_steps == ahead + 1
    assert outputs[reqs[1].request_id][-1].finish_reason == "abort"
    aborted_at = len([t for o in outputs[reqs[1].request_id] for t in o.new_token_ids])
    while engine.scheduler.has_work():
        engine.step()
    tokens = {r.request_id: [t for o in outputs[r.request_id] for t in o.new_token_ids] for r in reqs}
    assert tokens[reqs[0].request_id] == expected[0]
    assert tokens[reqs[2].request_id] == expected[2]
    assert tokens[reqs[3].request_id] == expected[3]
    assert tokens[reqs[1].request_id] == expected[1][:aborted_at]  # nothing after the abort
    assert engine.overlapped_steps > steps
    assert engine._in_flight is None and engine.pool.occupancy()["kv"] == 0


def test_tiny_pool_preempts_and_tokens_do_not_change(demo_assets, plain):
    cases = [(prompt, [None, "demo-r1", "demo-r2"][i % 3]) for i, prompt in enumerate(prompts(6, seed=1, low=8, high=16))]
    expected = [plain.generate(requests([case], 14))[0].token_ids for case in cases]
    engine = overlapped(make_engine(demo_assets, pages=200, max_model_len=32, kv_admission_headroom=0))
    preemptions = count_calls(engine.scheduler, "preempt")
    results = engine.generate(requests(cases, 14))
    assert preemptions, "the pool was large enough to run without preemption"
    assert [r.token_ids for r in results] == expected
    assert engine.overlapped_steps > 0
    assert engine.pool.occupancy()["kv"] == 0


def test_rows_ending_on_length_are_not_launched(demo_assets, plain):
    prompt = prompts(1, seed=3, low=20, high=20)[0]
    engine = overlapped(make_engine(demo_assets))
    launched = count_calls(engine.runner, "forward")
    result = engine.generate(requests([(prompt, "demo-r2")], 8))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 8
    assert result.token_ids == plain.generate(requests([(prompt, "demo-r2")], 8))[0].token_ids
    # a prefill and 7 decodes, none past the 8th token; each decode launched from the tokens of the step before it
    # (the prefill's too: every running request ends its prompt in it)
    assert len(launched) == 8 and engine.overlapped_steps == 7


def test_steps_with_a_request_that_keeps_its_logits_stay_plain(demo_assets, plain):
    cases = [(prompt, ADAPTERS[i]) for i, prompt in enumerate(prompts(3, seed=11))]
    reqs = requests(cases, 6)
    reqs[1] = GenerationRequest(cases[1][0], cases[1][1], SamplingParams(max_tokens=6, **GREEDY), keep_logits=True)
    engine = overlapped(make_engine(demo_assets))
    results = engine.generate(reqs)
    assert engine.overlapped_steps == 0
    assert results[0].token_ids == plain.generate(requests([cases[0]], 6))[0].token_ids
    assert len(results[1].logits) == 6
    # the three run together: each of their steps is read at once for the one that keeps its logits
    assert engine.status()["steps_read_at_once"] == {"keeps_logits": engine.steps} and engine.steps == 6


def test_rows_drawn_with_a_temperature_overlap_and_draw_the_plain_engines_tokens(demo_assets, plain):
    """Seeded rows with a temperature, top-k and top-p beside greedy ones: drawn on the device as the steps launch,
    each seed's draws in order, so the overlapped engine gives the plain engine's tokens."""
    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(4, seed=12))]
    drawn = [dict(temperature=0.8, seed=3), dict(temperature=1.0, top_p=0.9, seed=5), dict(temperature=1.3, top_k=20, seed=9)]

    def reqs() -> list[GenerationRequest]:
        made = requests(cases, 9)
        for index, fields in enumerate(drawn, start=1):
            made[index] = GenerationRequest(cases[index][0], cases[index][1], SamplingParams(max_tokens=9, **fields))
        return made

    expected = [r.token_ids for r in plain.generate(reqs())]
    engine = overlapped(make_engine(demo_assets))
    results = engine.generate(reqs())
    assert engine.overlapped_steps > 0
    assert [r.token_ids for r in results] == expected
    assert len({tuple(r.token_ids) for r in results}) == len(results)


def test_a_failed_draw_under_overlap_ends_its_request_alone(demo_assets, plain, monkeypatch):
    """A row whose draw fails (as a row with no finite logit does) comes back -1: its request ends with an error when
    the step lands, the row launched after it never reads -1, and the other requests keep the plain engine's tokens."""
    from lorad.daemon.engine import sampler

    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(3, seed=13))]
    reqs = requests(cases, 7)
    reqs[2] = GenerationRequest(cases[2][0], cases[2][1], SamplingParams(max_tokens=7, temperature=1.0, seed=13))
    expected = [r.token_ids for r in plain.generate(reqs[:2])]
    original = sampler.draw
    calls = []

    def failing(logits, params, keys):  # the seed-13 row fails from its third draw on
        calls.append(keys)
        tokens = original(logits, params, keys)
        fail = [p.seed == 13 and key[1] >= 2 for p, key in zip(params, keys)]
        return torch.where(torch.tensor(fail, device=tokens.device), -1, tokens)

    monkeypatch.setattr(sampler, "draw", failing)
    engine = overlapped(make_engine(demo_assets))
    results = engine.generate(reqs)
    assert engine.overlapped_steps > 0
    assert [r.finish_reason for r in results] == ["length", "length", "error"]
    assert [r.token_ids for r in results[:2]] == expected
    assert len(results[2].token_ids) == 2
    assert engine.pool.occupancy()["kv"] == 0 and engine._in_flight is None


def test_a_sequence_crossing_longrope_s_switch_is_left_out_and_recomputed(hf_checkpoint):
    """Phi-3 longrope (switch at 16 tokens): a row whose token in flight takes its sequence past the switch is not
    launched (its cache is computed again on the long factors first), the others go on overlapped; the tokens are
    plain stepping's, which tests/test_hf_parity.py holds to transformers' generate."""
    from lorad.config import EngineConfig

    checkpoint = hf_checkpoint("phi3_longrope")

    def engine() -> Engine:
        adapters = tuple((name, str(path)) for name, path in checkpoint.adapters.items())
        return Engine(EngineConfig(model=str(checkpoint.model_dir), adapters=adapters, device="cpu", dtype="float32"))

    cases = [(list(range(3, 3 + length)), adapter) for length, adapter in ((10, "all-r8"), (12, None), (30, "qkv-r1"))]
    plain_engine = engine()
    expected = [r.token_ids for r in plain_engine.generate(requests(cases, 12, temperature=0, ignore_eos=True))]
    plain_engine.close()
    overlapping = overlapped(engine())
    assert overlapping.rope_switch == 16
    recomputed = []
    original = overlapping._take_token

    def take_token(seq, *args, **kwargs):
        original(seq, *args, **kwargs)
        if seq.num_computed == 0:
            recomputed.append(seq.request_id)

    overlapping._take_token = take_token
    results = overlapping.generate(requests(cases, 12, temperature=0, ignore_eos=True))
    assert [r.token_ids for r in results] == expected
    assert len(recomputed) == 2 and overlapping.overlapped_steps > 0  # the two short prompts crossed 16 tokens
    overlapping.close()


# --- greedy rows with penalties, bias, min_tokens and logprobs: processed from their state on the device --------

PROCESSED = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={"7": 2.0, "9": -3.0},
                 logprobs=3)


def processed_requests(engine: Engine, cases, max_tokens: int) -> list[GenerationRequest]:
    """Every kind of greedy row side by side: all the controls, logprobs alone, penalties alone, none, and one whose
    EOS is forced by its bias but banned by min_tokens for its first 3 tokens."""
    eos = engine.spec.eos_token_ids[0]
    kinds = [PROCESSED, dict(logprobs=2), dict(frequency_penalty=1.5, repetition_penalty=0.8), {},
             dict(logit_bias={str(eos): 100}, min_tokens=3, logprobs=1)]
    return [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=max_tokens, **GREEDY, **kinds[i % len(kinds)]))
            for i, (prompt, adapter) in enumerate(cases)]


def assert_same_logprobs(got, want, tolerance: float = 1e-5):
    assert (got is None) == (want is None)
    assert len(got or []) == len(want or [])
    for entry, expected in zip(got or [], want or []):
        assert abs(entry.logprob - expected.logprob) < tolerance
        assert [token for token, _ in entry.top] == [token for token, _ in expected.top]
        assert all(abs(a - b) < tolerance for (_, a), (_, b) in zip(entry.top, expected.top))


def test_processed_greedy_rows_overlap_with_the_same_tokens_and_logprobs(demo_assets, plain):
    cases = [(prompt, ADAPTERS[i % len(ADAPTERS)]) for i, prompt in enumerate(prompts(10, seed=8, low=3, high=16))]
    expected = plain.generate(processed_requests(plain, cases, 12))
    engine = overlapped(make_engine(demo_assets))
    reqs = processed_requests(engine, cases, 12)
    outputs = streamed(reqs)
    results = engine.generate(reqs)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
    for result, want in zip(results, expected):
        assert_same_logprobs(result.logprobs, want.logprobs)
    for request, result in zip(reqs, results):  # streamed: each token with its logprob
        chunks = outputs[request.request_id]
        assert [t for o in chunks for t in o.new_token_ids] == result.token_ids
        if request.sampling.logprobs is not None:
            assert [entry for o in chunks for entry in o.logprobs or []] == result.logprobs
    eos = engine.spec.eos_token_ids[0]
    held = [r for r, q in zip(results, reqs) if q.sampling.min_tokens]
    assert held and all(r.token_ids[-1] == eos and len(r.token_ids) == 4 and r.finish_reason == "stop" for r in held)
    assert engine.overlapped_steps > 5
    assert len(engine.sampler_state) == 0 and engine._in_flight is None  # every slot given back


def test_fenced_pages_taken_by_kv_keep_the_tokens(demo_assets, plain):
    """Pages released while a step is in flight are fenced (an adapter's copy waits for that step); KV takes them at
    once when the others are too few (PagePool.alloc, ordered). Fences forced on the cpu, their steps never passing:
    sequences ending and preempted in a tiny pool while steps are in flight give their pages to others' KV, and every
    request gets the plain engine's tokens; the pool is whole at the end (test_engine_gpu.py has this on cuda)."""
    class NeverPassed:
        def record(self):
            pass

        def query(self):
            return False

        def synchronize(self):
            pass

    generator = torch.Generator().manual_seed(3)
    cases = [(torch.randint(3, 512, (int(n),), generator=generator).tolist(), [None, "demo-r1", "demo-r2"][i % 3])
             for i, n in enumerate(torch.randint(4, 13, (12,), generator=generator))]

    def reqs():
        return [GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=6 + i % 9, **GREEDY))
                for i, (prompt, adapter) in enumerate(cases)]

    expected = [r.token_ids for r in make_engine(demo_assets, pages=200, max_model_len=32).generate(reqs())]
    engine = overlapped(make_engine(demo_assets, pages=200, max_model_len=32, kv_admission_headroom=0))
    engine.pool.fences, engine.pool.new_event = True, NeverPassed
    taken = []
    take_fenced = engine.pool._take_fenced
    engine.pool._take_fenced = lambda count: taken.append(count) or take_fenced(count)
    assert [r.token_ids for r in engine.generate(reqs())] == expected
    assert taken and engine.status()["preemptions"] > 0
    assert engine.pool.occupancy()["kv"] == 0 and engine.pool.num_free == engine.pool.capacity - engine.pool.used["adapter"]


def test_processed_rows_through_preemption_keep_their_tokens(demo_assets, plain):
    cases = [(prompt, [None, "demo-r1", "demo-r2"][i % 3]) for i, prompt in enumerate(prompts(6, seed=1, low=8, high=16))]
    params = SamplingParams(max_tokens=14, **GREEDY, **PROCESSED)
    expected = [plain.generate([GenerationRequest(list(p), a, params)])[0] for p, a in cases]
    engine = overlapped(make_engine(demo_assets, pages=200, max_model_len=32, kv_admission_headroom=0))
    preemptions = count_calls(engine.scheduler, "preempt")
    admitted = count_calls(engine.sampler_state, "admit")
    results = engine.generate([GenerationRequest(list(p), a, params) for p, a in cases])
    assert preemptions, "the pool was large enough to run without preemption"
    assert sum(len(entries) for entries, in admitted) > len(cases)  # admitted again from the history after a preemption
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for result, want in zip(results, expected):
        assert_same_logprobs(result.logprobs, want.logprobs)
    assert engine.overlapped_steps > 0 and len(engine.sampler_state) == 0
