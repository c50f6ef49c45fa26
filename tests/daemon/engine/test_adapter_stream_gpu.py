"""`pytest -m gpu`: cold adapters streamed into the pool during their prefill (cold_start auto's gpu-stream).
With the pages held back on the device, the prefill (replayed from a CUDA graph, or eager), launched after
they were queued, waits there for each layer and gives cached mode's greedy tokens, also with every stream on
one hardware work queue; a copy that fails fails its request with the reason, and the engine goes on."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine import adapter_residency as lora_residency
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.gpu_ops import page_pool
from lorad.gpu_ops.page_pool import StreamedLoad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], "demo-r8"), ([20, 21, 22, 23, 24, 25, 26], "demo-r16")]
HOLD_CYCLES = 500_000_000  # ~0.3 s of the H100's clock: how long the streamed copies are held on the device


def engine_for(demo_assets, **config) -> Engine:
    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items())
    return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                               max_model_len=64, pool_bytes=64 << 20, cpu_workers=2, **config))


def run(engine: Engine, prompts=PROMPTS) -> list:
    requests = [GenerationRequest(prompt, adapter, SamplingParams(max_tokens=6, temperature=0)) for prompt, adapter in prompts]
    return engine.generate(requests)


def always_stream(engine: Engine) -> None:
    """No workers and no margin in the costs: auto streams every cold start (a demo adapter is tiny)."""
    engine.cold_starts.costs = dataclasses.replace(engine.cold_starts.costs, workers=0, stream_margin_ms=0.0)


@pytest.fixture(scope="module")
def cached_tokens(demo_assets):
    engine = engine_for(demo_assets, cold_start="cached", eager=True)
    try:
        return [result.token_ids for result in run(engine)]
    finally:
        engine.close()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_streamed_cold_starts_give_the_cached_tokens(demo_assets, cached_tokens, eager, monkeypatch):
    engine = engine_for(demo_assets, cold_start="auto", eager=eager)
    try:
        assert engine.status()["cold_adapter_streaming"] == {"on": True, "why": None}
        always_stream(engine)
        issue, held = lora_residency.issue_streamed, []

        def held_back(loads, until=None):  # the copies wait on the device first: the forward must wait for them there
            if until is None and any(not load.issued for load in loads):
                held.append(True)
                with torch.cuda.stream(engine.table._streamer.stream):
                    torch.cuda._sleep(HOLD_CYCLES)
            return issue(loads, until)

        launches = []  # per forward launched: (any streamed copy not yet queued, the device done right after it)
        owner, name = (engine.runner.model, "forward") if eager else (engine.runner.prefill_graphs, "run")
        forward = getattr(owner, name)

        def launch(*args, **kwargs):
            unqueued = any(isinstance(load, StreamedLoad) and not load.issued for load in engine.residency.loading.values())
            streamed = bool(engine.residency.streaming())
            out = forward(*args, **kwargs)
            if streamed:
                launches.append((unqueued, torch.cuda.current_stream().query()))
            return out

        monkeypatch.setattr(lora_residency, "issue_streamed", held_back)
        monkeypatch.setattr(owner, name, launch)
        assert [result.token_ids for result in run(engine)] == cached_tokens
        status = engine.status()
        assert status["cold_start_decisions"]["gpu-stream"] == 2
        assert status["cold_placements"]["stream"] == 2
        assert engine.table.stream_error.item() == 0 and not engine.residency.loading
        assert held and launches, "no step ran while adapters streamed in"
        assert not any(unqueued for unqueued, _ in launches), "a forward was launched before the pages it waits for"
        if not eager:  # (an eager forward may synchronise the context: a kernel's first launch loads its module)
            assert not any(done for _, done in launches), "the graph did not wait on the device for the held pages"
    finally:
        engine.close()


def test_streamed_cold_starts_with_one_hardware_queue():
    """The same with CUDA_DEVICE_MAX_CONNECTIONS=1 (in a process of its own: it is read when CUDA starts), so the
    compute and streaming streams share one in-order hardware queue: a forward launched before the copies it waits
    for would hold them behind it until each layer's wait timed out. The child runs only the test above, with this
    interpreter's -P where it has it: from the repository root, the source folder lorad/ would shadow an installed
    lorad."""
    test = f"{Path(__file__).resolve()}::test_streamed_cold_starts_give_the_cached_tokens"
    safe_path = ["-P"] if sys.flags.safe_path else []
    child = subprocess.run([sys.executable, *safe_path, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                            test],
                           env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1"), capture_output=True, text=True,
                           timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    assert "2 passed" in child.stdout, child.stdout[-2000:]


def test_a_failed_stream_fails_its_request_and_the_engine_goes_on(demo_assets, cached_tokens, monkeypatch):
    engine = engine_for(demo_assets, cold_start="auto")
    try:
        always_stream(engine)
        runs, failures = page_pool._run_array, []

        def lost_once(ids):  # the first layer of the first streamed adapter (`StreamedLoad._send_next`)
            if not failures:
                failures.append(True)
                raise RuntimeError("the copy was lost")
            return runs(ids)

        monkeypatch.setattr(page_pool, "_run_array", lost_once)
        first, second = run(engine)
        assert failures
        assert first.finish_reason == "error" and first.token_ids == []
        assert second.finish_reason == "length" and second.token_ids == cached_tokens[1]
        assert "demo-r8" not in engine.residency.slots  # dropped: its pages were never filled
        again = run(engine, PROMPTS[:1])[0]  # placed afresh
        assert again.finish_reason == "length" and again.token_ids == cached_tokens[0]
    finally:
        engine.close()


def ahead_budget(monkeypatch, layers: int) -> None:
    """Copies streamed ahead (`issue_ahead`) queue `layers` layers in all, whatever the device does: the
    streamed-ahead adapters are partly in at their admission, whose forward must wait for the rest."""
    issue, left = lora_residency.issue_streamed, [layers]

    def budgeted(loads, until=None):
        if until is None:
            return issue(loads)

        def stop() -> bool:
            left[0] -= 1
            return left[0] < 0

        done = issue(loads, stop)
        left[0] = max(left[0], 0)
        return done

    monkeypatch.setattr(lora_residency, "issue_streamed", budgeted)


def staged_by_the_stager(engine: Engine, names: list[str], timeout_s: float = 30.0) -> None:
    """Has the engine's stager stage `names` (as `prepare` does for queued requests) and waits until it has."""
    residency, deadline = engine.residency, time.monotonic() + timeout_s
    residency.prepare(names)
    while not all(residency._name_staged(name) for name in names):
        assert time.monotonic() < deadline, f"the stager did not stage {names} in {timeout_s:.0f} s"
        time.sleep(0.01)
        residency.prepare(names)  # takes in what the stager finished


def test_queued_cold_adapters_stream_in_ahead_and_give_the_cached_tokens(demo_assets, monkeypatch):
    prompts = PROMPTS + [([30, 31, 32, 33, 34], "demo-r16-mlp")]
    cached = engine_for(demo_assets, cold_start="cached", max_running_requests=1)
    try:
        expected = [result.token_ids for result in run(cached, prompts)]
    finally:
        cached.close()
    engine = engine_for(demo_assets, cold_start="auto", max_running_requests=1)  # the others wait their turn
    try:
        always_stream(engine)
        ahead_budget(monkeypatch, 3)  # layer 0 of both queued adapters, layer 1 of the first (layer-major)
        # Staged before the run: a prefetch places only what the stager has staged, and on the demo model the first
        # request lives a few milliseconds, less than the stager thread may take to stage the queued two.
        staged_by_the_stager(engine, ["demo-r16", "demo-r16-mlp"])
        assert [result.token_ids for result in run(engine, prompts)] == expected
        status = engine.status()
        assert status["cold_streamed_ahead"]["adapters"] == 2 and status["cold_streamed_ahead"]["layers"] == 3
        assert status["cold_start_decisions"]["gpu-stream"] == 3  # each still a streamed cold start
        assert status["adapter_prefetches"] == 2 and status["adapter_loads"] == 3
        assert engine.table.stream_error.item() == 0 and not engine.residency.loading and not engine.residency.ahead
    finally:
        engine.close()


def test_an_adapter_dropped_while_it_streams_ahead_frees_its_slot(demo_assets, cached_tokens, monkeypatch):
    engine = engine_for(demo_assets, cold_start="auto")
    try:
        always_stream(engine)
        ahead_budget(monkeypatch, 1)
        residency = engine.residency
        deadline = time.monotonic() + 30
        while not residency.prefetch("demo-r8", 0, tokens=12):  # False until the stager thread has staged it
            assert time.monotonic() < deadline, "the stager never staged demo-r8"
            time.sleep(0.01)
        assert "demo-r8" in residency.ahead
        slot = residency.slots["demo-r8"]
        residency.issue_ahead(lambda: False)  # one layer of four
        assert residency.ahead_layers == 1
        residency.drop("demo-r8")
        torch.cuda.synchronize()
        assert "demo-r8" not in residency.slots and not residency.ahead
        assert engine.table.ready[slot].item() == engine.table.num_layers  # a later owner placed whole never waits
        assert [result.token_ids for result in run(engine)] == cached_tokens
    finally:
        engine.close()
