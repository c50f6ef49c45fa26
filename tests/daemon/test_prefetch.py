"""Adapters of queued requests are loaded into free pool pages while a step runs, and serve the
request when it is admitted; nothing changes in what is generated."""

from lorad.config import EngineConfig
from lorad.daemon.engine import Engine
from lorad.daemon.request import GenerationRequest, SamplingParams


def _run(max_running):
    engine = Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, dummy_adapters=5, dummy_adapter_rank=8,
                                 device="cpu", max_running_requests=max_running))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest([4, 5, 6, 7], adapter=f"dummy-{i}", sampling=greedy) for i in range(5)])
    return [r.token_ids for r in results], engine.status()


def test_queued_adapters_are_prefetched_and_outputs_do_not_change():
    together, status_together = _run(max_running=8)
    queued, status_queued = _run(max_running=1)
    assert status_together["adapter_prefetches"] == 0  # all admitted at once: nothing to fetch ahead
    assert status_queued["adapter_prefetches"] >= 3  # each waiting request's adapter went up early
    assert status_queued["adapter_loads"] == 5  # and was not loaded a second time on admission
    assert together == queued
