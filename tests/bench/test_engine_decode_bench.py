"""bench/engine_decode.py's decode runs, on the CPU: every timed step decodes every request, however many steps
their admission took (a request that ended early would shrink the batch and the step time with it)."""

from __future__ import annotations

import pytest
import torch

import bench_scripts
from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine


@pytest.fixture
def engine():
    engine = Engine(EngineConfig(
        model_config="tiny-llama", dummy_weights=True, dummy_adapters=8, dummy_adapter_rank=8, device="cpu",
        dtype="float32", max_running_requests=8, max_batch_tokens=64, max_model_len=256, pool_bytes=64 << 20))
    yield engine
    engine.close()


def test_every_timed_step_decodes_every_request(engine, monkeypatch):
    bench = bench_scripts.load("engine_decode")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # its timers synchronise the device
    adapters = [f"dummy-{i}" for i in range(8)]
    # 8 prompts of 48 tokens at 64 tokens a step: the first admitted decodes for ~7 steps before the last joins
    requests = bench.start_decoding(engine, adapters, 48, 12)
    generated = [s.num_generated for s in engine.scheduler.running]
    assert len(generated) == 8 and max(generated) >= 7 + 3
    rows = []
    for _ in range(12):
        rows.append(len(engine.scheduler.running))
        engine.step()
    assert rows == [8] * 12 and len(engine.scheduler.running) == 8
    for request in requests:
        engine.abort(request.request_id)
    engine.step()
    assert not engine.scheduler.has_work()
    rate, step_ms = bench.decode_rate(engine, adapters, 48, 12)
    assert rate > 0 and step_ms > 0 and not engine.scheduler.has_work()
