"""On an NVIDIA GPU: an engine left to choose its cold-start mode (lorad serve's default) runs auto (its CPU
workers up) and serves cold adapters with it; a first start with profile_at_start measures the kernel profile on the device (the quick plan
here), gives its memory back before the engine's weights and pool take theirs, and the next start finds it."""

from __future__ import annotations

import gc

import pytest
import torch
from lorad.daemon.bench.profile import QUICK_PLAN
from lorad.daemon.engine import start_profile
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.kernel_choice import default_profile_path
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

from lorad.config import EngineConfig

pytestmark = pytest.mark.gpu


def _engine(state_dir, **config) -> Engine:
    return Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, device="cuda", max_model_len=128,
                               max_lora_rank=64, state_dir=str(state_dir), pool_bytes=256 << 20, **config))


def _close(engine: Engine) -> None:
    engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def test_the_default_cold_start_on_one_gpu_is_auto_and_serves(tmp_path):
    engine = _engine(tmp_path, cold_start=None, dummy_adapters=4, dummy_adapter_rank=16, profile_path="off")
    try:
        status = engine.status()
        assert status["cold_start"] == "auto" and "figures 5.1 and 5.2" in status["cold_start_reason"], status
        assert status["cpu_workers"] > 0 and engine.cold_starts.costs is not None
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        requests = [GenerationRequest([5 + i, 6, 7], f"dummy-{i}", greedy) for i in range(4)]
        assert all(len(result.token_ids) == 4 for result in engine.generate(requests))
        assert set(engine.status()["adapters_resident"]) == {f"dummy-{i}" for i in range(4)}  # each came in cold
    finally:
        _close(engine)


def test_a_first_start_measures_the_profile_on_the_gpu_and_frees_its_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(start_profile, "plan_for", lambda device: QUICK_PLAN)  # seconds, not lorad profile's ~40
    measure = start_profile.measure_at_start
    allocated = {}

    def measured(*args):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated["before"] = torch.cuda.memory_allocated()
        origin = measure(*args)
        allocated["peak"], allocated["after"] = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        return origin

    monkeypatch.setattr(start_profile, "measure_at_start", measured)
    path = default_profile_path("tiny-llama", torch.device("cuda"), str(tmp_path))
    first = _engine(tmp_path, profile_at_start=True)
    try:
        origin = first.status()["kernel_profile"]
        assert origin["origin"] == "measured at start" and origin["path"] == str(path), origin
        assert first.status()["lora_kernel_choice"] == f"profile:{path}"
        # the measurement's weights, pool and graphs are gone before the engine's own take the memory
        left, used = allocated["after"] - allocated["before"], allocated["peak"] - allocated["before"]
        assert left < min(used / 20, 4 << 20), allocated
    finally:
        _close(first)
    second = _engine(tmp_path, profile_at_start=True)
    try:
        assert second.status()["kernel_profile"] == {"origin": "found", "path": str(path)}
    finally:
        _close(second)
