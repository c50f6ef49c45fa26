"""How a cold adapter is placed is decided at admission: layer by layer only for a prefill that will be
cpu-assisted (`cpu`, or `auto` when its costs say so), else in one copy as ondemand places it, with
nothing left in `loading` to join and no worker heated. A cpu-assisted request whose copy was placed in
one piece runs every layer on the CPU and gives the ondemand tokens."""

from __future__ import annotations

import dataclasses

from test_cold_start import (  # noqa: F401
    adapters,
    assert_same,
    batch,
    count_calls,
    make_engine,
    no_leftover_segments,
    reference,
)

CHEAP_COPY = {"host": 1e15}  # bytes/s: the copy costs nothing, gpu-wait wins every time
SLOW_COPY = {"host": 1e3}  # bytes/s: every cold adapter is worth the CPU


def cold_loads(engine) -> int:
    """Adapters placed at admission (the rest of the loads were prefetches)."""
    return engine.residency.loads - engine.residency.prefetches


def watch_placements(engine) -> dict:
    """The pool placements made while admitting (acquire), by kind, and whether `loading` was empty
    after each admission; prefetches (one copy, outside acquire) are left out."""
    seen = {"place": 0, "place_layerwise": 0, "tokens": [], "loading_after": []}
    table, residency = engine.table, engine.residency
    admitting = [False]
    for method in ("place", "place_layerwise"):
        original = getattr(table, method)

        def wrapper(*args, _original=original, _method=method):
            if admitting[0]:
                seen[_method] += 1
            return _original(*args)

        setattr(table, method, wrapper)
    acquire = residency.acquire

    def watched_acquire(name, tokens=None):
        admitting[0] = True
        try:
            return acquire(name, tokens)
        finally:
            admitting[0] = False
            if name is not None:
                seen["tokens"].append((name, tokens))
                seen["loading_after"].append(dict(residency.loading))

    residency.acquire = watched_acquire  # the scheduler calls it through the same object
    return seen


def test_auto_gpu_wait_places_as_ondemand_does(demo_assets, adapters, reference):  # noqa: F811
    engine = make_engine(demo_assets, adapters, cold_start="auto", cpu_workers=1)
    try:
        engine.cold_starts.costs = dataclasses.replace(engine.cold_starts.costs, load_bytes_per_s=CHEAP_COPY)
        seen = watch_placements(engine)
        heats = count_calls(engine.cold_starts.cpu_assist.pool, "poll_hot_for")
        assert_same(reference, engine.generate(batch(adapters)))
        decisions = engine.status()["cold_start_decisions"]
        assert decisions["cpu-assist"] == 0 and decisions["gpu-wait"] > 0
        assert seen["place_layerwise"] == 0 and seen["place"] == cold_loads(engine) > 0
        assert not any(seen["loading_after"]) and not engine.residency.loading
        assert heats == [] and not engine.cold_starts.cpu_assist.pool.exchange.is_hot
    finally:
        engine.close()


def test_auto_cpu_assist_places_layer_by_layer(demo_assets, adapters, reference):  # noqa: F811
    engine = make_engine(demo_assets, adapters, cold_start="auto", cpu_workers=1)
    try:
        engine.cold_starts.costs = dataclasses.replace(engine.cold_starts.costs, load_bytes_per_s=SLOW_COPY)
        seen = watch_placements(engine)
        assert_same(reference, engine.generate(batch(adapters)))
        status = engine.status()
        decisions = status["cold_start_decisions"]
        assert decisions["gpu-wait"] == 0 and decisions["cpu-assist"] > 0
        assert seen["place"] == 0 and seen["place_layerwise"] == cold_loads(engine) > 0
        assert any(seen["loading_after"]) and not engine.residency.loading  # joined after the step
        assert status["cpu_assisted_prefills"] == decisions["cpu-assist"]
    finally:
        engine.close()


def test_cpu_places_every_cold_adapter_layer_by_layer(demo_assets, adapters):  # noqa: F811
    engine = make_engine(demo_assets, adapters, cold_start="cpu", cpu_workers=1)
    try:
        seen = watch_placements(engine)
        engine.generate(batch(adapters, count=10, max_tokens=2))
        assert engine.status()["cold_start_decisions"]["gpu-wait"] == 0
        assert seen["place"] == 0 and seen["place_layerwise"] == cold_loads(engine) > 0
    finally:
        engine.close()


def test_admission_decides_with_the_first_steps_tokens(demo_assets, adapters):  # noqa: F811
    """Chunked prompts (a small token budget): the decision at admission and the one of the step that
    follows see the same adapter, tier and tokens."""
    engine = make_engine(demo_assets, adapters, cold_start="auto", cpu_workers=1, max_batch_tokens=128)
    try:
        calls = count_calls(engine.cold_starts, "choice")
        seen = watch_placements(engine)
        requests = batch(adapters, count=24, max_tokens=2)
        engine.generate(requests)
        lengths = {}
        for request in requests:
            lengths.setdefault(request.adapter, set()).add(len(request.prompt_token_ids))
        assert all(1 <= tokens <= max(lengths[name]) for name, tokens in seen["tokens"])
        assert any(tokens not in lengths[name] for name, tokens in seen["tokens"])  # a chunk of a prompt
        by_adapter = {}
        for adapter, tokens, tier in calls:
            by_adapter.setdefault(adapter.name, []).append((tokens, tier))
        assert by_adapter and all(len(made) == 2 and made[0] == made[1] for made in by_adapter.values())
    finally:
        engine.close()


def test_an_assisted_request_placed_in_one_copy_runs_every_layer_on_the_cpu(demo_assets, adapters, reference):  # noqa: F811
    """The admission said gpu-wait, the step's decision cpu-assist (the costs moved between the two):
    nothing to join, the CPU serves every layer, and the tokens are those of ondemand."""
    engine = make_engine(demo_assets, adapters, cold_start="auto", cpu_workers=1)
    try:
        engine.cold_starts.costs = dataclasses.replace(engine.cold_starts.costs, load_bytes_per_s=SLOW_COPY)
        engine.residency.placement_for = lambda adapter, tier, tokens: "whole"
        seen = watch_placements(engine)
        assert_same(reference, engine.generate(batch(adapters)))
        status = engine.status()
        assert seen["place_layerwise"] == 0 and not any(seen["loading_after"])
        assert status["cpu_assisted_prefills"] == status["cold_start_decisions"]["cpu-assist"] > 0
        assert status["cpu_assist_layers"]["gpu"] == 0 and status["cpu_assist_layers"]["cpu"] > 0
    finally:
        engine.close()
