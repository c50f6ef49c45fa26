"""`pytest -m gpu`: CPU-assisted cold start inside the cuda forward. A cold request with --cold-start cpu
takes the fused path (no host sync in the forward) and gives cached mode's greedy tokens; with the
copy of the adapter held back, the first layers run on the CPU workers and the later ones on the GPU,
and the tokens stay the same."""

from __future__ import annotations

import time

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.gpu_ops import cuda_ext, page_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], "demo-r8"), ([20, 21, 22, 23, 24, 25, 26], "demo-r16")]


def engine_for(demo_assets, **config) -> Engine:
    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items())
    return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                               max_model_len=64, pool_bytes=64 << 20, cpu_workers=2, eager=True, **config))


def run(engine: Engine) -> list[list[int]]:
    requests = [GenerationRequest(prompt, adapter, SamplingParams(max_tokens=6, temperature=0)) for prompt, adapter in PROMPTS]
    return [result.token_ids for result in engine.generate(requests)]


@pytest.fixture(scope="module")
def cached_tokens(demo_assets):
    engine = engine_for(demo_assets, cold_start="cached")
    try:
        return run(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("split", ["tokens", "groups"])
def test_the_fused_path_gives_the_cached_tokens_without_a_host_sync(demo_assets, cached_tokens, split):
    assert cuda_ext.available(), cuda_ext.invocation_path()
    engine = engine_for(demo_assets, cold_start="cpu", layerwise=False, cpu_lora_split=split)
    try:
        forward = engine.runner.model.forward
        synced_forwards = []

        def forward_without_sync(step, kv_view, table):
            # Any sync in the forward (item(), cpu(), pageable copies, stream/event synchronize) raises here.
            torch.cuda.set_sync_debug_mode("error")
            try:
                return forward(step, kv_view, table)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                synced_forwards.append(bool(step.lora.cpu_spans))

        engine.runner.model.forward = forward_without_sync
        assert run(engine) == cached_tokens
        status = engine.status()
        assert status["cpu_assist_invocation"] == "fused-cuda"
        assert status["cpu_assisted_prefills"] == 2 and status["cpu_assist_fallbacks"] == 0
        assert status["cpu_assist_layers"] == {"cpu": 2 * engine.spec.num_layers, "gpu": 0}
        assert status["cpu_lora_plans"][split] >= 2 and sum(status["cpu_lora_plans"].values()) == status["cpu_lora_plans"][split]
        assert any(synced_forwards)  # the assisted forward ran under the check
    finally:
        engine.close()


@pytest.mark.parametrize("split, stalled", [("tokens", 0), ("groups", 0), ("groups", 1)])
def test_a_stalled_worker_costs_a_recompute_not_a_hang(demo_assets, cached_tokens, split, stalled):
    engine = engine_for(demo_assets, cold_start="cpu", layerwise=False, cpu_lora_split=split)
    try:
        import os
        import signal

        engine.cold_starts.cpu_assist.job_timeout_s = 0.2
        victim = engine.cold_starts.cpu_assist.pool._processes[stalled].pid
        os.kill(victim, signal.SIGSTOP)  # worker 0 never answers: the GPU wait times out
        started = time.monotonic()
        assert run(engine) == cached_tokens
        assert time.monotonic() - started < 30
        status = engine.status()
        assert status["cpu_assist_fallbacks"] >= 1 and status["cpu_worker_restarts"] >= 1
    finally:
        engine.close()


def test_layerwise_hands_the_later_layers_to_the_gpu(demo_assets, cached_tokens, monkeypatch):
    engine = engine_for(demo_assets, cold_start="cpu")
    try:
        layers = engine.spec.num_layers
        copy_pages, first = page_pool._copy_pages, []

        def held_back_copy(pages, staged, ids):
            if not first:  # hold the copy stream back ~0.3 s before the first layer of the first adapter
                first.append(True)
                torch.cuda._sleep(int(0.3 * 2e9))
            copy_pages(pages, staged, ids)

        arrived = page_pool.LayerwiseLoad.arrived

        def slow_host_arrived(self, layer):
            time.sleep(0.25)  # the host reaches layer l at ~0.25 (l + 1) s: layer 0 before the copy
            return arrived(self, layer)

        monkeypatch.setattr(page_pool, "_copy_pages", held_back_copy)
        monkeypatch.setattr(page_pool.LayerwiseLoad, "arrived", slow_host_arrived)
        assert run(engine) == cached_tokens
        counts = engine.status()["cpu_assist_layers"]
        assert counts["cpu"] >= 1 and counts["gpu"] >= 1 and counts["cpu"] + counts["gpu"] == 2 * layers
        assert engine.metrics()["cpu_assist_layers"] == counts
    finally:
        engine.close()
