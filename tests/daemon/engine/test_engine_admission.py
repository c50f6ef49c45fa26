"""Admission policies in the real engine (demo model, CPU): early abort drops the requests that cannot meet
the TTFT objective with an error the client sees through the API (503, full and streamed), counts them in
/metrics and /v1/status, and beats FCFS on TTFT attainment in an overloaded burst (simulated time); FCFS is
the default; bad admission settings are refused at start-up."""

from __future__ import annotations

import pytest
from daemon_harness import ServerThread
from lorad.daemon.server.cli import main
from lorad.client import Client
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.scheduler.admission import EarlyAbort
from lorad.scheduler.perf_model import PrefillModel

from lorad.config import EngineConfig
from lorad.errors import BadRequest, Overloaded


def demo_engine(demo_assets, **config):
    from lorad.daemon.engine.engine import Engine

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORAD_DEMO_DIR", str(demo_assets.model_dir.parent))
        return Engine(EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=64, **config))


def test_early_abort_drops_what_cannot_make_it_and_the_client_is_told(demo_assets, short_tmp):
    engine = demo_engine(demo_assets, admission="early-abort", slo_ttft_ms=1000)
    assert engine.status()["admission"]["ttft_estimate"].startswith("online:")  # no profile on this machine
    # injected: 0.1 s per prompt token, so 10 tokens or more cannot make 1 s
    engine.scheduler.admission = EarlyAbort(PrefillModel(0.1, 0.0, 0.0, 0.0))
    engine.start()
    server = ServerThread(engine, f"{short_tmp}/admission.sock")
    client = Client(server.path, timeout=30)
    try:
        with pytest.raises(Overloaded) as caught:
            client.completions(model="demo-r8", prompt=list(range(5, 25)), max_tokens=2)
        assert caught.value.status == 503
        message = caught.value.message  # the estimate: 2 s of prefill plus the few ms it waited
        assert message.startswith("dropped by early-abort admission: early abort: estimated TTFT 20"), message
        assert message.endswith(" ms > objective 1000.0 ms"), message
        with pytest.raises(Overloaded) as caught:  # a stream ends with an error event saying the same
            list(client.stream_completions(model="lorad-demo", prompt=list(range(5, 20)), max_tokens=2))
        assert "dropped by early-abort admission" in caught.value.message
        answer = client.completions(model="demo-r8", prompt=[5, 6, 7], max_tokens=2, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 2
        status = client.status()["admission"]
        assert status["policy"] == "early_abort" and status["dropped"] == 2 and status["slo_ttft_ms"] == 1000
        assert 'lorad_admission_dropped_total{policy="early_abort"} 2' in client.metrics()
    finally:
        server.close()
        engine.stop()


def test_fcfs_is_the_default_and_drops_nothing(demo_assets):
    engine = demo_engine(demo_assets, max_running_requests=2)
    status = engine.status()["admission"]
    assert status == {"policy": "fcfs", "slo_ttft_ms": None, "slo_tpot_ms": None, "cluster_max_adapters": None,
                      "cluster_max_wait_ms": None, "ttft_estimate": "none (no early abort)", "dropped": 0,
                      "tpot_rule": "off (no slo_tpot_ms)", "tpot_held": 0}
    requests = [GenerationRequest([5 + i] * 30, "demo-r8", SamplingParams(max_tokens=3, ignore_eos=True))
                for i in range(6)]
    assert all(r.finish_reason == "length" for r in engine.generate(requests))
    assert engine.admission_dropped == 0


def burst_attainment(engine, objective_s: float) -> tuple[float, int]:
    """Simulated time: every step costs 20 ms + 2 ms per token it computes; 12 requests at once, then 8 more
    spread out while the burst is still queued. -> (share of requests whose first token came within the
    objective, requests dropped)."""
    step_s, per_token_s = 0.02, 0.002
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    forward = engine.runner.forward

    def timed_forward(plan):
        now[0] += step_s + per_token_s * plan.num_tokens
        return forward(plan)

    engine.runner.forward = timed_forward
    arrivals = [0.0] * 12 + [0.5 + 0.05 * i for i in range(8)]
    first_token: dict[str, float] = {}
    errors: list[str] = []

    def on_output(output):
        if output.new_token_ids and output.request_id not in first_token:
            first_token[output.request_id] = now[0]
        if output.finish_reason == "error":
            errors.append(output.error)

    arrived = {}
    pending = list(enumerate(arrivals))
    while pending or engine.scheduler.has_work():
        if not engine.scheduler.has_work() and pending:
            now[0] = max(now[0], pending[0][1])
        while pending and pending[0][1] <= now[0]:
            index, at = pending.pop(0)
            request = GenerationRequest([5 + index % 50] * 8, "demo-r8", SamplingParams(max_tokens=6, ignore_eos=True),
                                        request_id=f"burst-{index}", on_output=on_output)
            engine.submit(request)
            arrived[request.request_id] = at
        engine.step()
    met = sum(1 for rid, at in arrived.items() if rid in first_token and first_token[rid] - at <= objective_s)
    assert all(e.startswith("dropped by early-abort admission") for e in errors)
    return met / len(arrivals), len(errors)


def test_early_abort_beats_fcfs_on_ttft_attainment_in_an_overloaded_burst(demo_assets):
    fcfs, fcfs_dropped = burst_attainment(demo_engine(demo_assets, max_running_requests=2), 0.4)
    engine = demo_engine(demo_assets, max_running_requests=2, admission="early-abort", slo_ttft_ms=400)
    engine.scheduler.admission = EarlyAbort(PrefillModel(0.002, 0.0, 0.0, 0.02))  # the simulated cost
    abort, abort_dropped = burst_attainment(engine, 0.4)
    assert fcfs_dropped == 0 and abort_dropped > 0
    assert abort > fcfs + 0.2, (abort, fcfs)


def test_clustered_engine_caps_adapters_and_serves_everything(demo_assets):
    engine = demo_engine(demo_assets, admission="cluster", cluster_max_adapters=1)
    assert engine.status()["admission"]["cluster_max_wait_ms"] == 1000.0
    seen = []
    schedule = engine.scheduler.schedule

    def watched():
        plan = schedule()
        seen.append({s.adapter for s in engine.scheduler.running})
        return plan

    engine.scheduler.schedule = watched
    names = ["demo-r1", "demo-r8", "demo-r1", "demo-r8"]
    requests = [GenerationRequest([5, 6, 7], name, SamplingParams(max_tokens=3, ignore_eos=True)) for name in names]
    results = engine.generate(requests)
    assert all(r.finish_reason == "length" for r in results)
    assert max(len(adapters) for adapters in seen) == 1  # fast steps: nobody waited a whole second


@pytest.mark.parametrize("config, fragment", [
    ({"admission": "early-abort"}, "give it one with slo_ttft_ms > 0"),
    ({"admission": "cluster"}, "cluster_max_adapters >= 1"),
    ({"admission": "lifo"}, "admission must be one of fcfs, early-abort, cluster"),
    ({"slo_ttft_ms": -1.0}, "slo_ttft_ms must be a number"),
    ({"cluster_max_adapters": 2}, "not fcfs"),
])
def test_bad_admission_settings_are_refused(config, fragment):
    with pytest.raises(BadRequest) as caught:
        EngineConfig(demo=True, **config)
    assert fragment in caught.value.message


def test_cli_refuses_early_abort_without_an_objective(capsys):
    assert main(["serve", "--demo", "--admission", "early-abort"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "slo_ttft_ms > 0 (--slo-ttft-ms)" in err, err
    assert main(["serve", "--demo", "--slo-ttft-ms", "soon"]) == 2
    assert "--slo-ttft-ms: invalid float value" in capsys.readouterr().err
