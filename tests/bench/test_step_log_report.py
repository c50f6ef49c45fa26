"""bench/step_log_report.py: the device's waits of a step log put down to what kept the host, against a log written
by hand, and the report of a log the CPU engine wrote (no device clock: nothing to put down)."""

from __future__ import annotations

import json

import bench_scripts


def step(kind, origin, wait, read_at_once=None, **times):
    record = {"kind": kind, "origin": origin, "busy_ms": 20.0, "host_before_launch_ms": 0.0, "forward_ms": 18.0,
              "tokens_ms": 0.1, "wait_before_ms": wait, **times}
    if read_at_once:
        record["read_at_once"] = read_at_once
    return record


def test_waits_are_put_down_to_what_kept_the_host(tmp_path):
    bench = bench_scripts.load("step_log_report")
    steps = [
        step("decode", "after_landing", None),  # after an idle engine: no wait counted
        step("decode", "tokens_in_flight", 0.5),  # launched from the tokens in flight, yet the device waited: late
        step("mixed", "planned_ahead", 2.0, read_at_once="adapters_streaming"),  # late, and then read at once
        step("decode", "after_landing", 6.0),  # waited for the reading of the streamed step before it
        step("mixed", "after_landing", 4.0),  # the step before was in flight: this one could not be planned ahead
        step("mixed", "planned_ahead", 0.0, read_at_once="prompt_chunks_alone"),
        step("decode", "after_landing", 3.0),
    ]
    log = tmp_path / "steps.jsonl"
    lines = [{"step_log": 1}, step("decode", "after_landing", 99.0), {"step_log": 1}] + steps  # an earlier run first
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert bench.read_steps(log) == steps
    result = bench.report(steps)
    assert result["steps"] == 7 and result["device_clock"]
    assert result["waits_by_cause"] == {
        "adapters_streaming": {"steps": 1, "wait_ms": 6.0, "mean_ms": 6.0},
        "next_not_planned_ahead": {"steps": 1, "wait_ms": 4.0, "mean_ms": 4.0},
        "prompt_chunks_alone": {"steps": 1, "wait_ms": 3.0, "mean_ms": 3.0},
        "launched_late": {"steps": 2, "wait_ms": 2.5, "mean_ms": 1.25},
        "queued": {"steps": 1, "wait_ms": 0.0, "mean_ms": 0.0},  # planned ahead and on the queue in time
    }
    assert list(result["waits_by_cause"]) == ["adapters_streaming", "next_not_planned_ahead", "prompt_chunks_alone",
                                              "launched_late", "queued"]  # the largest first
    assert result["by_kind"]["mixed"]["steps"] == 3 and result["by_kind"]["mixed"]["wait_before_ms"] == 6.0
    assert result["by_kind"]["decode"]["busy_ms"] == 80.0
    assert result["by_kind"]["decode"]["floor_ms"] == 0.0  # a log without floors (written by hand, or before them)


def test_the_hosts_time_is_averaged_by_origin_and_for_the_steps_launched_late():
    bench = bench_scripts.load("step_log_report")
    steps = [
        step("decode", "tokens_in_flight", 0.0, host_ms=2.0, host_cpu_ms=1.5, host_split_ms={"inbox": 0.5, "launch": 1.5}),
        step("decode", "tokens_in_flight", 3.0, host_ms=10.0, host_cpu_ms=2.5, gc_ms=6.0,
             host_split_ms={"inbox": 7.0, "launch": 3.0}),  # late: its host time went to the collector
        step("mixed", "planned_ahead", 0.0, host_ms=4.0, between_ms=1.0, host_split_ms={"schedule": 4.0}),
    ]
    host = bench.report(steps)["host_by_origin"]
    assert host["tokens_in_flight"] == {"steps": 2, "host_ms": 6.0, "host_cpu_ms": 2.0, "gc_ms": 6.0,
                                        "split.inbox": 3.75, "split.launch": 2.25}  # gc: the one step that has it
    assert host["launched_late"] == {"steps": 1, "host_ms": 10.0, "host_cpu_ms": 2.5, "gc_ms": 6.0, "split.inbox": 7.0,
                                     "split.launch": 3.0}
    assert host["planned_ahead"] == {"steps": 1, "host_ms": 4.0, "between_ms": 1.0, "split.schedule": 4.0}


def test_a_line_that_is_not_json_is_named(tmp_path, capsys, monkeypatch):
    bench = bench_scripts.load("step_log_report")
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step_log": 1}\n{"kind": "decode"\n')
    monkeypatch.setattr("sys.argv", ["step_log_report.py", str(log)])
    assert bench.main() == 2
    assert f"{log}:2: not a JSON line" in capsys.readouterr().err


def test_the_cpu_engines_step_log_reads_without_a_device_clock(demo_assets, tmp_path, monkeypatch, capsys):
    from lorad.config import EngineConfig
    from lorad.daemon.engine.engine import Engine
    from lorad.daemon.engine.request import GenerationRequest, SamplingParams

    bench = bench_scripts.load("step_log_report")
    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LORAD_STEP_LOG", str(log))
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), device="cpu", max_model_len=64))
    engine.generate([GenerationRequest([5, 6, 7], None, SamplingParams(max_tokens=4, temperature=0))])
    engine.close()
    result = bench.report(bench.read_steps(log))
    assert result["steps"] == engine.steps == 4 and not result["device_clock"] and result["waits_by_cause"] == {}
    assert result["by_kind"]["prefill"]["steps"] == 1 and result["by_kind"]["decode"]["steps"] == 3
    for kind in result["by_kind"].values():  # the engine's floors, summed by kind
        assert kind["serial_floor_ms"] >= kind["floor_ms"] > 0
