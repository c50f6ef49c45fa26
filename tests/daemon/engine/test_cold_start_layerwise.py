"""Layer-wise takeover and step recompute on the CPU engine, by simulation: an injected "layers arrived"
function moves the point where the GPU path takes over from the workers, and the greedy tokens stay
those of ondemand; an error word raised in the forward (what the fused path's timed-out wait writes)
makes the step run again on the pool path, token for token the same."""

from __future__ import annotations

import pytest
from test_cold_start import adapters, assert_same, batch, make_engine, no_leftover_segments, reference  # noqa: F401

from lorad.daemon.server.metrics import render


@pytest.mark.parametrize("takeover", [0, 1, None])  # None: no layer arrives during the cold step
def test_the_takeover_point_moves_and_the_tokens_stay(demo_assets, adapters, reference, takeover):  # noqa: F811
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2)
    try:
        layers = engine.spec.num_layers
        arrived = layers if takeover is None else takeover
        seen = []

        def layers_arrived(span, layer):
            seen.append(layer)
            return layer >= arrived

        engine.cold_starts.cpu_assist.layers_arrived = layers_arrived
        assert_same(reference, engine.generate(batch(adapters)))
        status = engine.status()
        prefills = status["cpu_assisted_prefills"]
        assert prefills > 0 and status["cpu_assist_layerwise"] is True
        assert status["cpu_assist_invocation"].startswith("python")
        counts = status["cpu_assist_layers"]
        assert counts["cpu"] == arrived * prefills and counts["gpu"] == (layers - arrived) * prefills
        assert sorted(set(seen)) == list(range(layers))  # asked once per layer of each assisted prefill
        assert len(seen) == layers * prefills
        rendered = render(engine.metrics())
        assert f'lorad_cpu_assist_layers_total{{path="gpu"}} {counts["gpu"]}' in rendered
        assert f'lorad_cpu_assist_layers_total{{path="cpu"}} {counts["cpu"]}' in rendered
    finally:
        engine.close()


def test_a_reported_timeout_recomputes_the_step_on_the_pool_path(demo_assets, adapters, reference):  # noqa: F811
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=2)
    try:
        assist = engine.cold_starts.cpu_assist
        calls = []

        def layers_arrived(span, layer):
            calls.append(layer)
            if len(calls) == 1:
                assist.error[0] = 42  # what wait_and_add writes after its timeout, read after the step
            return False

        assist.layers_arrived = layers_arrived
        results = engine.generate(batch(adapters))
        assert_same(reference, results)
        status = engine.status()
        assert status["cpu_assist_fallbacks"] > 0 and int(assist.error[0]) == 0
        assert engine.metrics()["cpu_assist_fallbacks"] == status["cpu_assist_fallbacks"]
        # The recomputed requests ran on the pool path: fewer assisted prefills than cpu-assist decisions.
        decided = status["cold_start_decisions"]["cpu-assist"]
        assert status["cpu_assisted_prefills"] == decided - status["cpu_assist_fallbacks"]
    finally:
        engine.close()


def test_no_layerwise_joins_every_copy(demo_assets, adapters, reference):  # noqa: F811
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=1, layerwise=False)
    try:
        assert_same(reference, engine.generate(batch(adapters)))
        status = engine.status()
        assert status["cpu_assist_layerwise"] is False and not engine.residency.loading
        assert status["cpu_assist_layers"]["gpu"] == 0 and status["cpu_assist_layers"]["cpu"] > 0
    finally:
        engine.close()
