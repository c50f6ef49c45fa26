"""Cold-start modes on the demo model: cpu (the prefill's LoRA on the CPU workers through shared memory)
gives what ondemand gives, token for token; a worker killed mid-run costs nothing but a fallback and a
restart; close() leaves no segment; cached places everything at start-up; auto decides and counts."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.model.checkpoint import load_spec
from lorad.daemon.engine.cpu_assist import keep_off_cores
from lorad.daemon.model.demo import write_random_adapter
from lorad.daemon.engine.engine import Engine
from lorad.daemon.server.metrics import render
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.errors import BadRequest, ModelError
from lorad.shm.segment import lorad_segments, pid_alive

PAGE_BYTES = 64 * 4  # the demo's hidden size, float32
# Ranks 3..48 on other target sets than the demo's own eight (ranks 1..64).
EXTRA = {"extra-r3": (3, ("k_proj", "down_proj")), "extra-r12": (12, ("q_proj", "up_proj", "o_proj")),
         "extra-r24": (24, ("v_proj", "gate_proj")), "extra-r48": (48, ("q_proj", "k_proj", "v_proj", "o_proj"))}


@pytest.fixture(autouse=True)
def no_leftover_segments(no_leftover_segments):
    """conftest.py's check, for every test here and in the modules that import this fixture."""
    yield


@pytest.fixture(scope="module")
def adapters(demo_assets, tmp_path_factory) -> tuple[tuple[str, str], ...]:
    spec = load_spec(demo_assets.model_dir)
    root = tmp_path_factory.mktemp("cold-start-adapters")
    extra = {name: write_random_adapter(root / name, spec, rank, targets, seed=500 + index)
             for index, (name, (rank, targets)) in enumerate(EXTRA.items())}
    return tuple((name, str(path)) for name, path in {**demo_assets.adapters, **extra}.items())


def make_engine(demo_assets, adapters, pages: int = 32768, **config) -> Engine:
    return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu",
                               pool_bytes=pages * PAGE_BYTES, max_model_len=64, **config))


def batch(adapters, count: int = 24, seed: int = 0, max_tokens: int = 6) -> list[GenerationRequest]:
    """Prompts of 3..20 tokens; every adapter more than once, and some base-model rows."""
    generator = torch.Generator().manual_seed(seed)
    names = [name for name, _ in adapters] + [None]
    out = []
    for index in range(count):
        length = int(torch.randint(3, 21, (1,), generator=generator))
        prompt = torch.randint(3, 512, (length,), generator=generator).tolist()
        out.append(GenerationRequest(prompt, names[index % len(names)], SamplingParams(max_tokens=max_tokens, temperature=0),
                                     keep_logits=True))
    return out


def assert_same(reference, results):
    for expected, got in zip(reference, results, strict=True):
        assert got.finish_reason == expected.finish_reason == "length"
        assert got.token_ids == expected.token_ids
        for a, b in zip(expected.logits, got.logits, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def reference(demo_assets, adapters):
    engine = make_engine(demo_assets, adapters)
    results = engine.generate(batch(adapters))
    status = engine.status()
    assert status["cold_start"] == "ondemand" and status["cpu_workers"] == 0
    assert status["cold_start_decisions"]["gpu-wait"] > 0 and status["cold_start_decisions"]["cpu-assist"] == 0
    return results


def count_calls(obj, method: str, before=None) -> list:
    calls, original = [], getattr(obj, method)

    def wrapper(*args, **kwargs):
        calls.append(args)
        if before is not None:
            before(len(calls), *args)
        return original(*args, **kwargs)

    setattr(obj, method, wrapper)
    return calls


def test_cpu_assisted_prefills_give_the_ondemand_tokens(demo_assets, adapters, reference):
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2, cpu_lora_split="tokens")
    try:
        jobs = count_calls(engine.cold_starts.cpu_assist.pool, "submit")
        results = engine.generate(batch(adapters))
        assert_same(reference, results)
        status = engine.status()
        assert status["cold_start"] == "cpu" and status["cpu_workers"] == 2
        assert status["cpu_lora_invocation"].startswith("python")  # no GPU here
        assert status["cpu_assisted_prefills"] == status["cold_start_decisions"]["cpu-assist"] > 0
        assert status["cpu_assist_fallbacks"] == 0 and status["cpu_worker_restarts"] == 0
        assert status["cpu_worker_loop"] == engine.cold_starts.cpu_assist.pool.worker_loop  # "native", or "python: why"
        assert status["cpu_jobs_native"] == engine.cold_starts.cpu_assist.pool.native_jobs >= 0
        assert {worker for worker, _ in jobs} == {0, 1}  # both workers computed rows
        # Adapters already in the pool take the normal op: nothing more is posted to the workers.
        posted = len(jobs)
        engine.generate(batch(adapters, count=6, seed=1, max_tokens=3))
        assert len(jobs) == posted and engine.status()["cpu_assisted_prefills"] == status["cpu_assisted_prefills"]
    finally:
        engine.close()


def test_one_hot_worker_serves_small_jobs_natively_and_gives_the_ondemand_tokens(demo_assets, adapters, reference):
    # One worker leaves the engine a core, so the pool runs hot during cold starts and the worker's native
    # loop serves the jobs it has learnt (the demo's jobs are a few rows at ranks 1..64, 64 wide).
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the pool never runs hot, so the native loop never serves")
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=1, cpu_lora_split="tokens")
    try:
        assert engine.cold_starts.cpu_assist.pool.hot_polling
        assert_same(reference, engine.generate(batch(adapters)))
        status = engine.status()
        assert status["cpu_assisted_prefills"] > 0 and status["cpu_assist_fallbacks"] == 0
        if status["cpu_worker_loop"] == "native":
            assert status["cpu_jobs_native"] > 0
        assert f'lorad_cpu_jobs_native_total {status["cpu_jobs_native"]}' in render(engine.metrics())
    finally:
        engine.close()


@pytest.mark.parametrize("split", ["tokens", "groups"])
def test_a_worker_killed_mid_run_costs_a_fallback_and_a_restart(demo_assets, adapters, reference, split):
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2, cpu_lora_split=split)
    try:
        pool = engine.cold_starts.cpu_assist.pool
        victims = []
        # A token split posts one job per worker (submit, then wait), a split group one post for both parts
        # (post, then wait_posted); either way the victim is stopped in the middle of the first prefill
        # step's layers, so that it cannot finish its job before it is killed.
        post, wait, stop_at = ("submit", "wait", 40) if split == "tokens" else ("post", "wait_posted", 20)

        def stop_once(call, *args, **kwargs):
            if call == stop_at:
                worker = args[0] if split == "tokens" else 1
                victims.append(pool._processes[worker].pid)
                os.kill(victims[0], signal.SIGSTOP)

        def kill(call, *args, **kwargs):
            if victims and pid_alive(victims[0]):
                os.kill(victims[0], signal.SIGKILL)

        count_calls(pool, post, before=stop_once)
        count_calls(pool, wait, before=kill)
        results = engine.generate(batch(adapters))
        assert_same(reference, results)
        status = engine.status()
        assert victims and not pid_alive(victims[0])
        assert status["cpu_worker_restarts"] == 1 and status["cpu_assist_fallbacks"] == 1
        metrics = engine.metrics()
        assert metrics["worker_restarts"] == 1 and metrics["cpu_assist_fallbacks"] == 1
        assert metrics["cold_start_decisions"]["cpu-assist"] == status["cold_start_decisions"]["cpu-assist"]
        rendered = render(metrics)
        assert "lorad_cpu_assist_fallbacks_total 1" in rendered
        assert f'lorad_cold_start_decisions_total{{decision="cpu-assist"}} {status["cold_start_decisions"]["cpu-assist"]}' in rendered
        assert status["cpu_assisted_prefills"] > 0
    finally:
        engine.close()


def test_split_groups_give_the_ondemand_tokens(demo_assets, adapters, reference):
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2, cpu_lora_split="groups")
    try:
        groups = count_calls(engine.cold_starts.cpu_assist.pool, "run_split")
        assert_same(reference, engine.generate(batch(adapters)))
        status = engine.status()
        assert status["cpu_lora_split"] == "groups"
        plans = status["cpu_lora_plans"]
        assert plans["tokens"] == 0 and plans["groups"] >= status["cpu_assisted_prefills"] > 0 and groups
        assert {args[4] for args in groups} == {2}  # every group over both workers
        assert status["cpu_assist_fallbacks"] == 0 and status["cpu_worker_restarts"] == 0
    finally:
        engine.close()


def test_cpu_lora_split_is_checked(demo_assets, adapters):
    with pytest.raises(BadRequest, match="cpu_lora_split must be one of auto, tokens, groups"):
        make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2, cpu_lora_split="columns")
    with pytest.raises(BadRequest, match="needs 2 workers or more"):
        make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=1, cpu_lora_split="groups")


def test_close_stops_the_workers_and_unlinks_the_segments(demo_assets, adapters):
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2)
    pids = [process.pid for process in engine.cold_starts.cpu_assist.pool._processes]
    names = lorad_segments(f"/lorad-{os.getpid()}x")
    assert len(names) >= 2  # the adapter store and the exchange
    engine.close()
    assert lorad_segments(f"/lorad-{os.getpid()}x") == []
    assert not any(pid_alive(pid) for pid in pids)
    engine.close()  # twice is fine
    assert engine.status()["cpu_workers"] == 0


def test_cached_places_every_adapter_at_start(demo_assets, adapters, reference):
    engine = make_engine(demo_assets, adapters, cold_start="cached")
    names = sorted(name for name, _ in adapters)
    status = engine.status()
    assert status["adapters_resident"] == names and status["adapter_loads"] == len(names)
    results = engine.generate(batch(adapters))
    assert_same(reference, results)
    status = engine.status()
    assert status["adapter_loads"] == len(names) and status["adapter_evictions"] == 0
    assert status["cold_start_decisions"] == {"gpu-wait": 0, "gpu-stream": 0, "cpu-assist": 0}
    assert engine.metrics()["cold_starts"] == 0


def test_cached_refuses_adapters_that_do_not_fit(demo_assets, adapters):
    with pytest.raises(ModelError, match="cold_start=cached: the page pool"):
        make_engine(demo_assets, adapters, pages=2048, cold_start="cached")


def test_auto_decides_from_the_costs_and_counts(demo_assets, adapters, reference):
    engine = make_engine(demo_assets, adapters, cold_start="auto", cpu_workers=1)
    try:
        costs = engine.cold_starts.costs
        assert costs.workers == 1 and costs.load_bytes_per_s["host"] > 0 and costs.cpu_per_token_rank_ms > 0
        requests = batch(adapters)
        first = [r for r in requests if r.adapter in (None, "demo-r1", "demo-r2", "demo-r4", "demo-r8", "demo-r16")]
        rest = [r for r in requests if r not in first]
        # Measured: copying a few KB into the pool beats any round trip to the workers.
        results = engine.generate(first)
        decisions = engine.status()["cold_start_decisions"]
        assert decisions["gpu-wait"] > 0 and decisions["cpu-assist"] == 0
        # Injected: a tier at 1 KB/s makes every cold adapter worth the CPU.
        engine.cold_starts.costs = dataclasses.replace(costs, load_bytes_per_s={"host": 1e3})
        results += engine.generate(rest)
        status = engine.status()
        assert status["cold_start_decisions"]["cpu-assist"] > 0
        assert status["cpu_assisted_prefills"] == status["cold_start_decisions"]["cpu-assist"]
        by_id = {r.request_id: r for r in results}
        assert_same(reference, [by_id[r.request_id] for r in requests])
    finally:
        engine.close()


def test_auto_keeps_the_workers_hot_only_for_cpu_assisted_cold_starts(demo_assets, adapters):
    """A gpu-wait cold start sets no worker spinning (on the H100 that cost auto ~30 ms of TTFT on
    every-request-cold traffic: 4 workers busy-polling 0.1 s after each cold admission)."""
    engine = make_engine(demo_assets, adapters, cold_start="auto", cpu_workers=1)
    try:
        pool = engine.cold_starts.cpu_assist.pool
        heats = count_calls(pool, "poll_hot_for")
        sampling = SamplingParams(max_tokens=2, temperature=0)
        engine.generate([GenerationRequest([5, 6, 7], "demo-r4", sampling)])
        assert engine.status()["cold_start_decisions"] == {"gpu-wait": 1, "gpu-stream": 0, "cpu-assist": 0}
        assert heats == [] and not pool.exchange.is_hot
        engine.cold_starts.costs = dataclasses.replace(engine.cold_starts.costs, load_bytes_per_s={"host": 1e3})
        engine.generate([GenerationRequest([5, 6, 7], "demo-r8", sampling)])
        assert engine.status()["cold_start_decisions"]["cpu-assist"] == 1 and heats
    finally:
        engine.close()


@pytest.mark.parametrize("settings, message", [
    (dict(cold_start="lazy"), "cold_start must be one of cached, ondemand, cpu, auto"),
    (dict(cpu_workers=-1), "cpu_workers must be an integer in 0..256"),
    (dict(cpu_workers=1.5), "cpu_workers must be an integer"),
    (dict(pinned_host_bytes=-1), "pinned_host_bytes must be >= 0"),
    (dict(stager_threads=-1), "stager_threads must be an integer in 0..64"),
    (dict(stager_threads=True), "stager_threads must be an integer"),
])
def test_invalid_settings_are_refused(settings, message):
    with pytest.raises(BadRequest, match=message):
        EngineConfig(demo=True, **settings)


def test_the_engine_process_serves_cpu_assisted_and_cleans_up_at_stop(demo_assets):
    from test_process import Collector, demo_config, start_engine

    engine = start_engine(demo_assets, demo_config(cold_start="cpu", cpu_workers=1))
    try:
        collector = Collector()
        engine.submit(GenerationRequest([5, 6, 7, 8], "demo-r4", SamplingParams(max_tokens=3, temperature=0),
                                        on_output=collector))
        assert collector.wait().finish_reason == "length"
        status = engine.status()
        assert status["cold_start"] == "cpu" and status["cpu_workers"] == 1 and status["cpu_assisted_prefills"] == 1
        engine_pid = status["engine_pid"]
        assert lorad_segments(f"/lorad-{engine_pid}x")
    finally:
        engine.stop()
    assert lorad_segments(f"/lorad-{engine_pid}x") == []


def test_keep_off_cores_moves_the_calling_thread_off_the_workers_cores():
    cores = sorted(os.sched_getaffinity(0))
    assert keep_off_cores([]) is None and keep_off_cores(cores) is None  # nothing taken, or nothing would be left
    assert os.sched_getaffinity(0) == set(cores)
    if len(cores) < 2:  # one usable core: the calls above are all there is to check (CI has two)
        return
    seen = {}

    def engine_thread():  # affinity is per thread: the test process's own stays as it is
        seen["before"] = keep_off_cores([cores[0]])
        seen["during"] = os.sched_getaffinity(0)
        os.sched_setaffinity(0, seen["before"])

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == {"before": set(cores), "during": set(cores[1:])}
    assert os.sched_getaffinity(0) == set(cores)


def test_an_adapter_read_again_is_copied_to_the_workers_again_even_at_its_old_weights_address(demo_assets, adapters):
    # The store's copy was matched to an adapter by its weights' id: an adapter read again under its name (new
    # files) whose weights dict landed where the freed old one was would have its prefill LoRA computed from the old
    # weights. Here the second adapter's weights are the first's dict with other tensors in it, as such a dict is.
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2)
    try:
        assist = engine.cold_starts.cpu_assist
        first = engine.registry.get(adapters[0][0])
        first_id = assist.stage(first)
        assert assist.is_staged(first) and assist.stage(first) == first_id
        weights = first.weights
        for key, (a, b) in list(weights.items()):
            weights[key] = (a * 2, b)
        second = dataclasses.replace(first)
        assert second.weights is weights and not assist.is_staged(second)
        second_id = assist.stage(second)
        assert second_id != first_id and assist.is_staged(second)
        key, (a, b) = next(iter(weights.items()))
        stored_a, stored_b = assist.store.get_views(first.name)[key]
        torch.testing.assert_close(stored_a, a, rtol=0, atol=0)
        torch.testing.assert_close(stored_b, b.t(), rtol=0, atol=0)
    finally:
        engine.close()
