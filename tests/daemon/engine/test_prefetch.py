"""Adapters of queued requests are loaded into free pool pages while a step runs, and serve the
request when it is admitted; nothing changes in what is generated."""

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams


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


def _residency(placement):
    """A CPU pool with room for two small adapters, and a residency whose placement rule is `placement`."""
    from types import SimpleNamespace

    import torch

    from lorad.daemon.engine.adapter_residency import LoraResidency
    from lorad.gpu_ops.page_pool import AdapterTable, PagePool

    pool = PagePool(64, 16, torch.float32, torch.device("cpu"))
    table = AdapterTable(pool, 4, 2, [(16, 16)] * 7)
    weights = {(layer, 0): (torch.ones(2, 16), torch.ones(16, 2)) for layer in range(2)}
    residency = LoraResidency(lambda name: SimpleNamespace(name=name, weights=weights), table)
    asked = []

    def placement_for(adapter, tier, tokens):
        asked.append((adapter.name, tier, tokens))
        return placement

    residency.placement_for = placement_for
    return residency, asked


def test_a_prefetch_asks_the_admissions_placement_only_with_tokens():
    residency, asked = _residency("layerwise")
    assert residency.prefetch("a", 0) and "a" in residency.slots  # without tokens: whole, nothing asked
    assert asked == [] and residency.prefetches == 1 and residency.loads == 1
    # a cpu-assisted cold start at admission: placed whole now, so that the request needs no assist at all
    assert residency.prefetch("b", 0, tokens=12) and "b" in residency.slots and residency.pins["b"] == 0
    assert asked == [("b", "host", 12)] and not residency.ahead
    assert residency.acquire("b") and not residency.admitted_cold  # admitted warm
