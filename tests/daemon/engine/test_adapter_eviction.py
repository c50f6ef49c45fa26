"""Which idle adapter makes room (for KV growth or another adapter): the longest idle of those no queued request
needs, else the one whose first queued request comes last. On a saturated engine whose pool the KV cache fills,
that places the queue's adapters again fewer times than evicting the longest idle first, and changes no token."""

from __future__ import annotations

import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

from test_prefetch import _residency


def test_the_idle_adapter_no_queued_request_needs_goes_first_then_the_furthest_needed():
    residency, _ = _residency("whole")
    for name in ("a", "b", "c"):  # idle in this order, the longest idle first
        assert residency.prefetch(name, 0)
    uses = {"a": 0, "c": 4}  # a's request is the queue's head, c's fifth; none needs b

    def make_room():  # KV growth asks for a page more than are free: one adapter goes
        assert residency.reclaim(residency.table.pool.num_free + 1)

    residency.next_use = lambda: dict(uses)
    make_room()
    assert list(residency.idle) == ["a", "c"]  # b, needed by none, though a was idle longer
    uses.update(a=7, c=2)
    make_room()
    assert list(residency.idle) == ["c"]  # a, needed later than c
    residency.next_use = None  # nothing known of the queue: the longest idle
    assert residency.prefetch("d", 0)
    make_room()
    assert list(residency.idle) == ["d"] and residency.evictions == 3


def _saturated(next_use: bool):
    """240 requests over 60 rank-16 adapters (Zipf popularity), 24 running, in a pool the KV cache fills."""
    engine = Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, dummy_adapters=60, dummy_adapter_rank=16,
                                 device="cpu", max_running_requests=24, max_batch_tokens=256, pool_bytes=3 << 20,
                                 max_model_len=256))
    engine.overlap_decode = True
    if not next_use:
        engine.residency.next_use = None
    generator = torch.Generator().manual_seed(0)
    popularity = torch.tensor([1.0 / (rank + 1) for rank in range(60)])
    requests = []
    for _ in range(240):
        adapter = f"dummy-{int(torch.multinomial(popularity, 1, generator=generator))}"
        prompt = torch.randint(3, 500, (int(torch.randint(20, 120, (1,), generator=generator)),), generator=generator)
        limit = int(torch.randint(10, 60, (1,), generator=generator))
        requests.append(GenerationRequest(prompt.tolist(), adapter, SamplingParams(max_tokens=limit, temperature=0,
                                                                                    ignore_eos=True)))
    try:
        results = engine.generate(requests)
        return [result.token_ids for result in results], engine.status(), len({r.adapter for r in requests})
    finally:
        engine.close()


def test_a_saturated_engine_places_the_queues_adapters_again_fewer_times():
    oldest, status_oldest, adapters = _saturated(next_use=False)
    furthest, status, _ = _saturated(next_use=True)
    assert furthest == oldest
    assert status_oldest["adapter_evictions"] > 0 and status["preemptions"] == status_oldest["preemptions"]
    assert adapters <= status["adapter_loads"] < status_oldest["adapter_loads"] - 8, (status["adapter_loads"],
                                                                                       status_oldest["adapter_loads"])
