"""daemon/engine/engine.py end to end on the demo model (a tiny random Llama: hidden 64, 4 layers, 2 KV heads of
16, so a KV page holds 2 tokens and a block costs 8 pages): request checks, aborts giving back every
page, preemption and adapter eviction in a small pool without changing what greedy decoding produces,
the finish reasons, and the online path with its engine thread."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.model.demo import write_random_adapter
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.errors import BadRequest, NotFound, Overloaded, PromptTooLong

PAGE_BYTES = 64 * 4  # hidden_size float32
GREEDY = dict(temperature=0)
SMALL_ADAPTERS = ("demo-r1", "demo-r2", "demo-r8")  # 16, 64 and 192 pages


def make_engine(demo_assets, pages: int = 4096, max_model_len: int = 64, extra_adapters=(), **config) -> Engine:
    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items()) + tuple(extra_adapters)
    return Engine(
        EngineConfig(
            model=str(demo_assets.model_dir),
            adapters=adapters,
            device="cpu",
            pool_bytes=pages * PAGE_BYTES,
            max_model_len=max_model_len,
            **config,
        )
    )


def prompts(count: int, seed: int, low: int = 3, high: int = 20) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def requests(cases, max_tokens: int, **sampling) -> list[GenerationRequest]:
    return [
        GenerationRequest(list(prompt), adapter, SamplingParams(max_tokens=max_tokens, **(sampling or GREEDY)))
        for prompt, adapter in cases
    ]


def count_calls(obj, method: str) -> list:
    calls = []
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    setattr(obj, method, wrapper)
    return calls


@pytest.fixture(scope="module")
def big_engine(demo_assets) -> Engine:
    return make_engine(demo_assets)


def reference_tokens(big_engine: Engine, cases, max_tokens: int) -> list[list[int]]:
    """Each request alone in the roomy engine."""
    return [big_engine.generate(requests([case], max_tokens))[0].token_ids for case in cases]


# --- submit's checks --------------------------------------------------------------------------------


def test_submit_refusals(demo_assets):
    engine = make_engine(demo_assets, max_model_len=32, max_waiting_requests=2)
    ok = SamplingParams(max_tokens=4)
    for prompt in ([], [512], [-1], [5, True], [5, 1.0], [5, "7"]):
        with pytest.raises(BadRequest):
            engine.submit(GenerationRequest(prompt, None, ok))
    with pytest.raises(PromptTooLong):
        engine.submit(GenerationRequest([5] * 29, None, SamplingParams(max_tokens=4)))
    with pytest.raises(NotFound):
        engine.submit(GenerationRequest([5, 6], "no-such-adapter", ok))
    assert engine.status()["waiting"] == 0  # nothing refused was queued
    engine.submit(GenerationRequest([5] * 28, None, SamplingParams(max_tokens=4), request_id="exact"))
    with pytest.raises(BadRequest):
        engine.submit(GenerationRequest([5], None, ok, request_id="exact"))
    engine.submit(GenerationRequest([5], "demo-r1", ok))
    with pytest.raises(Overloaded):
        engine.submit(GenerationRequest([5], None, ok))
    assert engine.status()["waiting"] == 2


# --- aborts -----------------------------------------------------------------------------------------


def test_abort_running_waiting_and_queued_free_every_page(demo_assets):
    engine = make_engine(demo_assets, max_running_requests=1, max_batch_tokens=8)
    outputs: dict[str, list] = {}

    def request(request_id, adapter=None, length=20):
        outputs[request_id] = []
        return GenerationRequest(
            list(range(3, 3 + length)), adapter, SamplingParams(max_tokens=40, **GREEDY),
            request_id=request_id, on_output=outputs[request_id].append,
        )

    engine.submit(request("running", "demo-r2"))
    engine.submit(request("waiting"))
    for _ in range(4):  # a chunked prefill (8 tokens a step), then decodes
        engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["running"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["waiting"]
    assert engine.pool.occupancy()["kv"] > 0 and outputs["running"]
    engine.submit(request("queued"))  # still in the inbox
    engine.abort("running")
    engine.abort("waiting")
    engine.abort("queued")
    engine.abort("never-existed")
    engine.step()
    occupancy = engine.pool.occupancy()
    assert occupancy["kv"] == 0
    assert occupancy["free"] + occupancy["adapter"] == occupancy["pages"]
    assert not engine.scheduler.has_work()
    for request_id in ("running", "waiting", "queued"):
        final = outputs[request_id][-1]
        assert final.finished and final.finish_reason == "abort"
        assert sum(o.finished for o in outputs[request_id]) == 1
    assert engine.residency.pins == {"demo-r2": 0}  # resident, idle: may be evicted
    # the engine still serves afterwards, and the pool is whole again when it is done
    result = engine.generate(requests([([5, 6, 7], "demo-r2")], 5))[0]
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert engine.pool.occupancy()["kv"] == 0


# --- small pools --------------------------------------------------------------------------------------


def test_tiny_pool_preempts_and_greedy_tokens_do_not_change(demo_assets, big_engine):
    cases = [(prompt, [None, "demo-r1", "demo-r2"][i % 3]) for i, prompt in enumerate(prompts(6, seed=1, low=8, high=16))]
    max_tokens = 14
    expected = reference_tokens(big_engine, cases, max_tokens)
    # 2 * 8 * (30 / 2) = 240 pages hold two sequences at full length, and 80 pages of adapters. Admitted by their
    # prompts' KV alone (the default, no growth reserve), the batch outgrows the pool and its newest are preempted.
    engine = make_engine(demo_assets, pages=200, max_model_len=32, kv_admission_headroom=0)
    preemptions = count_calls(engine.scheduler, "preempt")
    results = engine.generate(requests(cases, max_tokens))
    assert len(preemptions) > 0, "the pool was large enough to run without preemption"
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert engine.pool.occupancy()["kv"] == 0
    # the batched roomy run agrees too
    assert [r.token_ids for r in big_engine.generate(requests(cases, max_tokens))] == expected


def test_the_admission_headroom_preempts_less_and_tokens_do_not_change(demo_assets, big_engine):
    # The tiny pool above, with the default headroom: a request joins only while the pool keeps 16 positions free
    # for each running one, so the batch grows into room it was left rather than preempting its newest.
    cases = [(prompt, [None, "demo-r1", "demo-r2"][i % 3]) for i, prompt in enumerate(prompts(6, seed=1, low=8, high=16))]
    expected = reference_tokens(big_engine, cases, 14)
    counts = {}
    for headroom in (0, EngineConfig.kv_admission_headroom):
        engine = make_engine(demo_assets, pages=200, max_model_len=32, kv_admission_headroom=headroom)
        results = engine.generate(requests(cases, 14))
        assert [r.token_ids for r in results] == expected
        assert engine.status()["kv_admission_headroom"] == headroom and engine.pool.occupancy()["kv"] == 0
        counts[headroom] = engine.status()["preemptions"]
    assert counts[EngineConfig.kv_admission_headroom] < counts[0], counts


@pytest.mark.parametrize("pages", [200, 320, 400])
def test_the_growth_reserve_keeps_a_small_pool_from_preempting(demo_assets, big_engine, pages):
    """Pools where admission by the prompts' KV alone preempts (3 or 4 times): with the growth reserve, requests
    join only while the KV left holds what the running ones will still generate, so none is preempted, and the
    tokens are the same."""
    cases = [(prompt, [None, "demo-r1", "demo-r2"][i % 3]) for i, prompt in enumerate(prompts(6, seed=1, low=8, high=16))]
    expected = reference_tokens(big_engine, cases, 14)
    engine = make_engine(demo_assets, pages=pages, max_model_len=32, kv_growth_reserve=True,
                         kv_admission_headroom=0)
    preemptions = count_calls(engine.scheduler, "preempt")
    most_running = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *args, **kwargs: (most_running.append(len(engine.scheduler.running)),
                                                         schedule(*args, **kwargs))[1]
    results = engine.generate(requests(cases, 14))
    assert [r.token_ids for r in results] == expected
    assert not preemptions and engine.status()["preemptions"] == 0
    assert max(most_running) == {200: 1, 320: 2, 400: 3}[pages]  # as many as the pool holds at their full length
    assert engine.status()["kv_growth_reserve"] == {"on": True, "ratio": 1.0}  # every request used its max_tokens
    assert engine.pool.occupancy()["kv"] == 0


def test_chunked_prefill_and_running_cap_do_not_change_tokens(demo_assets, big_engine):
    cases = [(prompt, [None, "demo-r4", "demo-r16"][i % 3]) for i, prompt in enumerate(prompts(5, seed=13, low=9, high=20))]
    expected = reference_tokens(big_engine, cases, 7)
    engine = make_engine(demo_assets, max_batch_tokens=7, max_running_requests=3)
    steps = count_calls(engine.scheduler, "schedule")
    results = engine.generate(requests(cases, 7))
    assert [r.token_ids for r in results] == expected
    # chunks of at most 7 tokens: the prompts alone need more steps than there are tokens to generate
    assert len(steps) >= sum(len(prompt) for prompt, _ in cases) // 7 + 7


def test_seeded_sampling_survives_preemption(demo_assets, big_engine):
    cases = [(prompt, [None, "demo-r2"][i % 2]) for i, prompt in enumerate(prompts(4, seed=14, low=10, high=16))]
    sampling = dict(temperature=1.3, top_k=50, top_p=0.95)

    def seeded(seed_base):
        batch = requests(cases, 14, **sampling)
        for index, request in enumerate(batch):
            request.sampling = dataclasses.replace(request.sampling, seed=seed_base + index)
        return batch

    expected = [r.token_ids for r in big_engine.generate(seeded(100))]
    assert [r.token_ids for r in big_engine.generate(seeded(100))] == expected
    assert [r.token_ids for r in big_engine.generate(seeded(200))] != expected
    engine = make_engine(demo_assets, pages=200, max_model_len=32, kv_admission_headroom=0)
    preemptions = count_calls(engine.scheduler, "preempt")
    assert [r.token_ids for r in engine.generate(seeded(100))] == expected
    assert preemptions


def test_adapters_evicted_when_kv_needs_pages(demo_assets, big_engine):
    engine = make_engine(demo_assets, pages=400, max_model_len=32)
    cases = [(prompt, adapter) for prompt, adapter in zip(prompts(3, seed=2), ("demo-r8", "demo-r2", "demo-r1"))]
    expected = reference_tokens(big_engine, cases, 6)
    for case, tokens in zip(cases, expected):  # one at a time: each stays resident, idle
        assert engine.generate(requests([case], 6))[0].token_ids == tokens
    assert set(engine.residency.slots) == set(SMALL_ADAPTERS) and engine.residency.evictions == 0
    assert engine.pool.occupancy()["adapter"] == 16 + 64 + 192
    # a long base-model request needs 128 pages of KV: only the idle adapters' pages can give them
    long_case = (prompts(1, seed=3, low=20, high=20)[0], None)
    result = engine.generate(requests([long_case], 12))[0]
    assert result.token_ids == reference_tokens(big_engine, [long_case], 12)[0]
    assert engine.residency.evictions >= 1 and "demo-r8" not in engine.residency.slots  # least recently used
    # demo-r4 (320 pages) fits only once the others are gone; then the evicted ones come back right
    again = [(cases[0][0], "demo-r4"), cases[0], cases[1]]
    expected_again = reference_tokens(big_engine, again, 6)
    assert [engine.generate(requests([case], 6))[0].token_ids for case in again] == expected_again
    assert engine.pool.occupancy()["kv"] == 0


def test_many_adapters_wait_for_room_and_are_never_failed(demo_assets, big_engine, tmp_path):
    """Eight adapters of 64 pages each and requests for all of them in one batch, in a pool that holds
    three adapters beside the KV: they take turns, idle ones are evicted, every answer is right."""
    spec = big_engine.spec
    extra = []
    for index in range(8):
        path = write_random_adapter(tmp_path / f"extra-{index}", spec, 4, ("q_proj", "v_proj"), seed=500 + index)
        extra.append((f"extra-{index}", str(path)))
    big = make_engine(demo_assets, extra_adapters=extra)
    cases = [(prompt, f"extra-{i % 8}") for i, prompt in enumerate(prompts(12, seed=4, low=3, high=8))]
    expected = reference_tokens(big, cases, 6)
    # distinct adapters really give distinct answers here
    assert len({tuple(tokens) for tokens in expected}) > 6
    engine = make_engine(demo_assets, pages=400, max_model_len=32, extra_adapters=extra)
    results = engine.generate(requests(cases, 6))
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert engine.residency.evictions >= 3
    assert engine.pool.occupancy()["kv"] == 0


def test_adapter_changes_the_output(big_engine):
    prompt = prompts(1, seed=5)[0]
    tokens = [big_engine.generate(requests([(prompt, name)], 8))[0].token_ids for name in (None, "demo-r16", "demo-r64")]
    assert tokens[0] != tokens[1] and tokens[0] != tokens[2] and tokens[1] != tokens[2]


# --- finish reasons ---------------------------------------------------------------------------------


def test_length(big_engine):
    result = big_engine.generate(requests([(prompts(1, seed=6)[0], None)], 9))[0]
    assert result.finish_reason == "length" and len(result.token_ids) == 9
    assert result.text == big_engine.tokenizer.decode(result.token_ids)


def test_stop_token_ids(big_engine):
    prompt = prompts(1, seed=7)[0]
    full = big_engine.generate(requests([(prompt, "demo-r4")], 16))[0].token_ids
    stop_token = full[5]
    first = full.index(stop_token)
    request = GenerationRequest(prompt, "demo-r4", SamplingParams(max_tokens=16, stop_token_ids=(stop_token,), **GREEDY))
    result = big_engine.generate([request])[0]
    assert result.finish_reason == "stop" and result.token_ids == full[: first + 1]


def test_eos(demo_assets):
    engine = make_engine(demo_assets)
    prompt = prompts(1, seed=8)[0]
    full = engine.generate(requests([(prompt, None)], 16))[0].token_ids
    eos = full[4]
    first = full.index(eos)
    engine.spec = dataclasses.replace(engine.spec, eos_token_ids=(999, eos))  # as if the model's EOS
    result = engine.generate(requests([(prompt, None)], 16))[0]
    assert result.finish_reason == "stop" and result.token_ids == full[: first + 1]
    ignoring = GenerationRequest(prompt, None, SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY))
    result = engine.generate([ignoring])[0]
    assert result.finish_reason == "length" and result.token_ids == full


def test_stop_string(big_engine):
    prompt = prompts(1, seed=9)[0]
    full = big_engine.generate(requests([(prompt, "demo-r2")], 24))[0]
    text = full.text
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    outputs = []
    request = GenerationRequest(
        prompt, "demo-r2", SamplingParams(max_tokens=24, stop=("\x00never", stop), **GREEDY), on_output=outputs.append
    )
    result = big_engine.generate([request])[0]
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert "".join(o.text_delta for o in outputs) == text[:cut]
    assert full.token_ids[: len(result.token_ids)] == result.token_ids
    assert len(result.token_ids) < 24
    assert big_engine.tokenizer.decode(result.token_ids).find(stop) >= 0  # the token that completed it
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert outputs[-1].num_generated_tokens == len(result.token_ids) == sum(len(o.new_token_ids) for o in outputs)


# --- online ---------------------------------------------------------------------------------------


def test_online_start_submit_stop(demo_assets, big_engine):
    cases = [(prompt, adapter) for prompt, adapter in zip(prompts(4, seed=10), (None, "demo-r1", "demo-r8", None))]
    expected = reference_tokens(big_engine, cases, 8)
    engine = make_engine(demo_assets)
    engine.start()
    try:
        with pytest.raises(RuntimeError):
            engine.generate(requests(cases[:1], 2))
        lock = threading.Lock()
        collected: dict[str, list] = {}
        threads: set[str] = set()
        done = {}
        for index, request in enumerate(requests(cases, 8)):
            request.request_id = f"online-{index}"
            collected[request.request_id] = []
            done[request.request_id] = threading.Event()

            def on_output(output, request_id=request.request_id):
                with lock:
                    collected[request_id].append(output)
                    threads.add(threading.current_thread().name)
                if output.finished:
                    done[request_id].set()

            request.on_output = on_output
            engine.submit(request)
        for event in done.values():
            assert event.wait(timeout=30)
        # a request that is aborted from its own callback after its first token
        aborted = []
        aborted_done = threading.Event()

        def abort_early(output):
            aborted.append(output)
            if len(aborted) == 1:
                engine.abort("online-abort")
            if output.finished:
                aborted_done.set()

        engine.submit(GenerationRequest(cases[0][0], None, SamplingParams(max_tokens=40, **GREEDY), "online-abort", abort_early))
        assert aborted_done.wait(timeout=30)
        # one left running when the engine stops is finished with "abort"
        stopped = []
        started = threading.Event()

        def on_stop_output(output):
            stopped.append(output)
            started.set()

        engine.submit(GenerationRequest(cases[1][0], None, SamplingParams(max_tokens=40, **GREEDY), "online-stop", on_stop_output))
        assert started.wait(timeout=30)
    finally:
        engine.stop()
    assert threads == {"lorad-engine"}
    for index, tokens in enumerate(expected):
        outputs = collected[f"online-{index}"]
        assert [t for o in outputs for t in o.new_token_ids] == tokens
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].finish_reason == "length" and outputs[-1].num_generated_tokens == 8
        assert outputs[-1].num_prompt_tokens == len(cases[index][0])
        assert "".join(o.text_delta for o in outputs) == engine.tokenizer.decode(tokens)
    assert aborted[-1].finished and aborted[-1].finish_reason == "abort" and len(aborted) < 40
    assert stopped[-1].finished and stopped[-1].finish_reason == "abort"
    assert not engine._thread.is_alive()
    assert engine.pool.occupancy()["kv"] == 0


def test_demo_flag_uses_lorad_demo_dir(demo_assets, monkeypatch):
    monkeypatch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
    engine = Engine(EngineConfig(demo=True, device="cpu", pool_bytes=2048 * PAGE_BYTES, max_model_len=64))
    assert engine.model_name == "lorad-demo"
    assert set(demo_assets.adapters) <= set(engine.registry.names())
    result = engine.generate(requests([([5, 6, 7], "demo-r16-mlp")], 3))[0]
    assert len(result.token_ids) == 3


def test_request_that_cannot_fit_alone_fails_and_the_rest_go_on(demo_assets, big_engine):
    engine = make_engine(demo_assets, pages=400, max_model_len=32)
    cases = [(prompts(1, seed=11)[0], None), ([5, 6, 7], "demo-r64"), (prompts(1, seed=12)[0], "demo-r1")]
    results = engine.generate(requests(cases, 5))
    assert results[1].finish_reason == "error" and results[1].token_ids == []  # 5120 pages of adapter
    assert [results[0].token_ids, results[2].token_ids] == reference_tokens(big_engine, [cases[0], cases[2]], 5)
    assert engine.pool.occupancy()["kv"] == 0


def test_stop_finishes_requests_still_in_the_inbox(demo_assets):
    engine = make_engine(demo_assets)
    in_callback, release = threading.Event(), threading.Event()
    finals: dict[str, str] = {}

    def blocking(output):
        if output.finished:
            finals["first"] = output.finish_reason
        in_callback.set()
        release.wait(timeout=30)

    def record(output):
        if output.finished:
            finals["second"] = output.finish_reason

    engine.start()
    engine.submit(GenerationRequest([5, 6, 7], None, SamplingParams(max_tokens=30, **GREEDY), "first", blocking))
    assert in_callback.wait(timeout=30)  # the engine thread is inside a step, in the callback
    engine.submit(GenerationRequest([8, 9], None, SamplingParams(max_tokens=30, **GREEDY), "second", record))
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    while not engine._stopping:
        pass
    release.set()
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert finals.get("first") == "abort"
    assert finals.get("second") == "abort"


def test_pool_too_small_for_one_sequence_is_refused(demo_assets):
    from lorad.errors import ModelError

    with pytest.raises(ModelError, match="max_model_len"):
        make_engine(demo_assets, pages=100, max_model_len=32)  # 16 blocks of 8 pages > 99
    engine = make_engine(demo_assets, pages=129, max_model_len=32)  # exactly one sequence
    result = engine.generate(requests([([5] * 20, None)], 12))[0]
    assert len(result.token_ids) == 12


def test_max_model_len_past_the_checkpoints_context_is_refused(demo_assets):
    from lorad.errors import ModelError

    with pytest.raises(ModelError, match="max_model_len=4096 exceeds the model's max_position_embeddings=2048"):
        make_engine(demo_assets, max_model_len=4096)
    assert make_engine(demo_assets, pages=9000, max_model_len=2048).max_model_len == 2048
    assert make_engine(demo_assets, pages=9000, max_model_len=None).max_model_len == 2048  # unset: the checkpoint's


def test_lora_pdl_is_off_on_the_cpu_and_said(demo_assets):
    """Programmatic dependent launch is a Hopper feature: auto turns it off on the CPU and says why; on where it
    cannot run is refused, an unknown value too."""
    status = make_engine(demo_assets).status()
    assert status["decode_lora_pdl"] == {"on": False, "why": "cpu: reference ops"}
    assert "mbgmv-pdl" not in status["ops"]
    assert make_engine(demo_assets, lora_pdl="off").status()["decode_lora_pdl"] == {"on": False, "why": "lora_pdl off"}
    with pytest.raises(BadRequest, match="lora_pdl on cannot run here: cpu"):
        make_engine(demo_assets, lora_pdl="on")
    with pytest.raises(BadRequest, match="lora_pdl must be one of auto, on, off"):
        make_engine(demo_assets, lora_pdl="always")


def test_each_forward_runs_in_its_steps_launch_context(demo_assets, monkeypatch):
    """The model enters ops.launches(decode) around every forward: a decode step's (where TritonOps with decode_pdl
    launches early) and the prompt's steps apart."""
    import contextlib

    engine = make_engine(demo_assets)
    seen = []

    def launches(decode, rows):
        seen.append((decode, rows))
        return contextlib.nullcontext()

    monkeypatch.setattr(engine.runner.ops, "launches", launches)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.generate([GenerationRequest([5, 6, 7], None, greedy)])
    assert seen[0] == (False, 3) and seen[1:] and all(seen[1:]), seen
    assert all(rows == 1 for _, rows in seen[1:]), seen


def test_decode_pdl_is_off_on_the_cpu_and_said(demo_assets):
    """decode_pdl (a decode step's kernels launched early) likewise: off on the CPU with the reason, refused where
    asked for and impossible, an unknown value too."""
    status = make_engine(demo_assets).status()
    assert status["decode_pdl"] == {"on": False, "why": "cpu: reference ops", "max_rows": None}
    assert "decode-pdl" not in status["ops"]
    off = {"on": False, "why": "decode_pdl off", "max_rows": None}
    assert make_engine(demo_assets, decode_pdl="off").status()["decode_pdl"] == off
    with pytest.raises(BadRequest, match="decode_pdl on cannot run here: cpu"):
        make_engine(demo_assets, decode_pdl="on")
    with pytest.raises(BadRequest, match="decode_pdl must be one of auto, on, off"):
        make_engine(demo_assets, decode_pdl="always")


def test_decode_pdl_auto_keeps_fp8_steps_of_more_rows_in_stream_order(monkeypatch):
    """Where it can run, auto launches every decode step early, but with FP8 weights only the steps of one row (its
    steps of 16 and 64 rows measured longer with it); on launches them all; TritonOps launches by that."""
    from lorad.daemon.engine import runner
    from lorad.daemon.model.ops import TorchOps, TritonOps
    from lorad.gpu_ops import launch

    monkeypatch.setattr(launch, "pdl_unavailable", lambda device: None)
    cuda = torch.device("cuda")
    assert runner.decode_pdl_state("auto", cuda, fp8=False) == {"on": True, "why": None, "max_rows": None}
    assert runner.decode_pdl_state("auto", cuda, fp8=True) == {"on": True, "why": None, "max_rows": 1}
    assert runner.decode_pdl_state("on", cuda, fp8=True) == {"on": True, "why": None, "max_rows": None}
    assert runner.decode_pdl_state("off", cuda, fp8=True) == {"on": False, "why": "decode_pdl off", "max_rows": None}
    ops = TorchOps()  # with TritonOps' fields: its launches, without the GPU its constructor builds for
    ops._launch, ops.decode_pdl = launch, True
    for max_rows, decode, rows, early in ((1, True, 1, True), (1, True, 16, False), (1, False, 1, False),
                                          (None, True, 64, True)):
        ops.decode_pdl_rows = max_rows
        with TritonOps.launches(ops, decode, rows):
            assert launch.launching_early() == early, (max_rows, decode, rows)


def test_adapter_streaming_is_off_on_the_cpu_and_said(demo_assets):
    """gpu-stream needs the device-side wait of the Triton kernels: on the CPU auto never streams, and
    says why; the other modes never stream at all."""
    for config, why in (({"cold_start": "auto"}, "cpu: reference ops (the device-side wait is a Triton kernel's)"),
                        ({"cold_start": "auto", "layerwise": False}, "layerwise off"),
                        ({}, "cold_start ondemand (only auto streams)")):
        engine = make_engine(demo_assets, cpu_workers=1, **config)
        try:
            status = engine.status()
            assert status["cold_adapter_streaming"] == {"on": False, "why": why}
            assert status["cold_placements"] == {"whole": 0, "layerwise": 0, "stream": 0}
        finally:
            engine.close()


# --- logits processing in the engine ---------------------------------------------------------------------


def test_penalties_bias_and_min_tokens_in_the_engine(big_engine):
    eos = big_engine.spec.eos_token_ids[0]
    prompt = list(range(40, 52))

    def run(**sampling):
        return big_engine.generate([GenerationRequest(prompt, "demo-r8", SamplingParams(temperature=0, **sampling))])[0]

    forced = run(max_tokens=5, logit_bias={"77": 100}, ignore_eos=True)
    assert forced.token_ids == [77] * 5
    # EOS forced by its bias, but banned for the first 3 tokens: exactly 3 other tokens, then EOS stops it
    held = run(max_tokens=10, logit_bias={str(eos): 100}, min_tokens=3)
    assert len(held.token_ids) == 4 and held.token_ids[-1] == eos and eos not in held.token_ids[:3]
    assert held.finish_reason == "stop"
    # every step's processed logits (kept) equal the reference processing of the raw logits of the same tokens
    from test_sampler import reference_processed
    from lorad.daemon.engine.sampler import History

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5,
                            repetition_penalty=1.8, logit_bias={"77": 3, "5": -50})
    processed = big_engine.generate([GenerationRequest(prompt, "demo-r8", params, keep_logits=True)])[0]
    for step, token in enumerate(processed.token_ids):
        output = processed.token_ids[:step]
        raw = big_engine.generate([GenerationRequest(prompt + output, "demo-r8", SamplingParams(max_tokens=1, temperature=0),
                                                     keep_logits=True)])[0].logits[0]
        want = reference_processed(raw, params, History(prompt, output))
        torch.testing.assert_close(processed.logits[step], want, rtol=1e-4, atol=1e-4)
        assert token == int(want.argmax())


def test_logprobs_come_with_each_generated_token(big_engine):
    result = big_engine.generate([GenerationRequest(list(range(40, 52)), "demo-r8",
                                                    SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True),
                                                    keep_logits=True)])[0]
    assert len(result.logprobs) == 4
    for token, entry, logits in zip(result.token_ids, result.logprobs, result.logits):
        assert entry.top[0][0] == token and len(entry.top) == 2
        assert abs(entry.logprob - float(torch.log_softmax(logits, dim=-1)[token])) < 1e-5


def test_the_running_cap_follows_the_kv_cache_unless_given(demo_assets):
    from lorad.scheduler.batching import default_max_running

    derived = make_engine(demo_assets, pages=420_000)
    capacity = derived.kv.capacity_tokens()
    assert 64 < derived.config.max_running_requests == default_max_running(capacity) < 256
    assert derived.scheduler.max_running == derived.config.max_running_requests == derived.runner.config.max_running_requests
    status = derived.status()
    assert (status["max_running_requests"], status["max_running_requests_from"]) == (derived.scheduler.max_running, "kv_capacity")
    given = make_engine(demo_assets, pages=420_000, max_running_requests=5)
    assert given.scheduler.max_running == 5 and given.status()["max_running_requests_from"] == "config"


def test_reads_adapter_says_which_submissions_read_from_disk(demo_assets):
    """The engine process routes a submission that will read its adapter to threads of their own: it must say so
    for a registered adapter not yet read, and not for one in host memory, the base model or an unknown name."""
    engine = make_engine(demo_assets)
    try:
        name = sorted(demo_assets.adapters)[0]
        sampling = SamplingParams(max_tokens=1, temperature=0)
        cold = GenerationRequest([5, 6, 7], name, sampling)
        assert engine.reads_adapter(cold)
        assert not engine.reads_adapter(GenerationRequest([5, 6, 7], None, sampling))
        assert not engine.reads_adapter(GenerationRequest([5, 6, 7], "no-such-adapter", sampling))
        engine.generate([cold])
        assert not engine.reads_adapter(GenerationRequest([5, 6, 7], name, sampling))
    finally:
        engine.close()
