"""`lorad bench serve` (daemon/bench/serve.py) against `lorad serve --demo` as a real process: the report's
fields and counts, a sweep with its plot, the Azure dataset at its own arrivals, goodput, and the clear errors
and partial report when the daemon is not there or dies mid-run. The metrics themselves are checked on
outcomes made by hand."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from lorad.daemon.bench.serve import Outcome, format_table, step_time_delta, summarize, sweep_goodput, warmup_models
from lorad.daemon.server.cli import main
from lorad.scheduler.workload import AZURE_ATTRIBUTION

from daemon_harness import COMMAND, kill_daemon, start_daemon, stop_daemon, wait_healthy

DATA_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "data"


@pytest.fixture(scope="module")
def daemon(demo_assets, tmp_path_factory):
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="lorad-", dir="/tmp"))  # AF_UNIX paths are short
    path = directory / "lorad.sock"
    process = start_daemon(demo_assets, path)
    try:
        wait_healthy(process, path)
        yield path
    finally:
        stop_daemon(process)
        shutil.rmtree(directory, ignore_errors=True)


def bench(capsys, *argv) -> tuple[int, str, str]:
    code = main(["bench", "serve", "--no-progress", *[str(a) for a in argv]])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_metrics_of_outcomes_made_by_hand():
    one = Outcome("a", prompt_len=10, max_tokens=3, sent=0.0, chunk_times=[0.1, 0.3, 0.6], tokens=3)
    two = Outcome("b", prompt_len=20, max_tokens=2, sent=1.0, chunk_times=[1.5, 1.6], tokens=2)
    lost = Outcome("c", prompt_len=5, max_tokens=4, sent=1.0, error="connection: reset")
    summary = summarize([one, two, lost], duration_s=2.0, goodput={"ttft": 200.0})
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 2, 1)
    assert summary["errors"] == {"connection: reset": 1}
    assert summary["total_input_tokens"] == 30 and summary["total_output_tokens"] == 5
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 2.5
    assert summary["total_token_throughput"] == 17.5
    assert summary["ttft_ms"]["mean"] == pytest.approx(300.0)  # 100 and 500
    assert summary["tpot_ms"]["median"] == pytest.approx(175.0)  # 250 and 100
    assert sorted(round(x * 1e3) for x in one.inter_token_latencies() + two.inter_token_latencies()) == [100, 200, 300]
    assert summary["e2el_ms"]["p99"] == pytest.approx(600.0)  # both took 600 ms
    assert summary["goodput"]["requests_met"] == 1 and summary["goodput"]["request_goodput"] == 0.5
    assert summary["goodput"]["share_met"] == pytest.approx(1 / 3)


def test_the_runs_step_time_is_the_daemons_after_less_before_with_its_device_clock():
    def status(busy, device, tokens, waits, with_clock=True):
        kind = {"steps": 10, "busy_s": busy, "floor_s": 1.0, "rows": 10, "prompt_tokens": 0, "host_before_launch_s": 0.1,
                "host_before_launch_by_part_s": {"tokens": 0.1}}
        if with_clock:  # (a daemon without the clock predates the serial floor too)
            kind.update(device_s=device, tokens_device_s=tokens, before_forward_s=waits, serial_floor_s=1.5 * busy)
        return {"by_kind": {"decode": kind}, "device_rates": {}}

    engine = step_time_delta(status(2.0, 1.5, 0.2, 0.1), status(5.0, 4.0, 0.5, 0.3))
    decode = engine["by_kind"]["decode"]
    assert decode["device_s"] == pytest.approx(2.5) and decode["tokens_device_s"] == pytest.approx(0.3)
    assert decode["before_forward_s"] == pytest.approx(0.2) and engine["before_forward_s"] == pytest.approx(0.2)
    assert step_time_delta(status(0, None, None, None), status(1.0, None, None, None))["tokens_device_s"] is None
    older = step_time_delta(status(2.0, 0, 0, 0, False), status(5.0, 0, 0, 0, False))  # a daemon without the clock
    assert "device_s" not in older and "before_forward_s" not in older["by_kind"]["decode"]
    assert engine["serial_floor_s"] == pytest.approx(4.5) and "serial_floor_s" not in older
    run = {"request_rate": 1.0, "completed": 1, "failed": 0, "request_throughput": 1.0, "output_throughput": 1.0,
           "total_token_throughput": 1.0, "engine": {**engine, "preemptions": 0},
           **{metric: dict.fromkeys(("mean", "median", "p99"), 1.0) for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}}
    header, row = format_table([run], "request-rate").splitlines()[:2]
    assert "busy s device s tokens s waits s floor s floor/busy serial floor s preempted" in " ".join(header.split())
    assert row.split()[-8:] == ["3.00", "2.50", "0.30", "0.20", "0.00", "0.00", "4.50", "0"]  # floor: 1.0 less 1.0


def test_a_sweeps_goodput_is_its_highest_point_with_the_share_met():
    def report(key, points, shares):
        field = "request_rate" if key == "request-rate" else "max_concurrency"
        return {"sweep": {"key": key}, "runs": [{field: point, "goodput": {"share_met": share}}
                                                for point, share in zip(points, shares)]}

    rates = report("request-rate", [5.0, 7.0, 8.0, "inf"], [1.0, 0.956, 0.728, 0.5])
    assert sweep_goodput(rates, 0.9) == {"share": 0.9, "highest": 7.0}
    assert sweep_goodput(rates, 0.5)["highest"] == "inf"
    assert sweep_goodput(rates, 1.0)["highest"] == 5.0
    # the highest point that meets it, even past one that does not
    assert sweep_goodput(report("max-concurrency", [8, 1, 32, 64], [0.95, 1.0, 0.5, 0.92]), 0.9)["highest"] == 64
    assert sweep_goodput(report("request-rate", [9.0], [0.6]), 0.9)["highest"] is None


def test_a_sweep_reports_every_point_and_plots_it(capsys, daemon, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "serve.json"
    code, stdout, err = bench(capsys, "--socket", daemon, "--input-len", 12, "--output-len", 6, "--ignore-eos",
                              "--num-prompts", 8, "--adapters", 3, "--alpha", 1.2,
                              "--sweep", "max-concurrency=1,4", "--goodput", "ttft:60000", "tpot:60000", "--out", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["kind"] == "serve" and (report["sweep"]["key"], report["sweep"]["points"]) == ("max-concurrency", [1, 4])
    assert report["models"]["adapters"] == 3 and report["dataset"]["dataset"] == "random"
    assert [run["max_concurrency"] for run in report["runs"]] == [1, 4]
    for run in report["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0
        assert run["total_output_tokens"] == 8 * 6 and run["total_input_tokens"] == 8 * 12  # --ignore-eos
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(run[metric]) == {"mean", "median", "p50", "p90", "p99"}
            assert 0 < run[metric]["median"] <= run[metric]["p99"]
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0
        assert run["goodput"]["requests_met"] == 8
        engine = run["engine"]  # the daemon's account of this run's steps: every prompt row was computed
        assert sum(kind["prompt_tokens"] for kind in engine["by_kind"].values()) == 8 * 12
        assert sum(kind["rows"] for kind in engine["by_kind"].values()) == 8 * (12 + 6 - 1)
        assert sum(kind["padding_rows"] for kind in engine["by_kind"].values()) == 0  # eager on the cpu
        assert 0 < engine["floor_s"] and 0 < engine["busy_s"] and engine["efficiency"] == engine["floor_s"] / engine["busy_s"]
        assert engine["serial_floor_s"] >= engine["floor_s"]
        assert 0 < engine["host_before_launch_s"] < engine["busy_s"] and engine["device_s"] is None  # no device clock on the cpu
        assert engine["tokens_device_s"] is None and engine["before_forward_s"] is None
        assert engine["preemptions"] == 0  # the demo's KV holds every request
        assert engine["max_running_requests"] >= 4 and engine["kv_capacity_tokens"] > 0  # the daemon's limits
        if run["max_concurrency"] == 1:  # one request at a time: every other running slot empty, nothing waiting
            assert engine["empty_slots"] > 0 and set(engine["empty_slots_by_cause"]) == {"no_request_waiting"}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "max-concurrency" in stdout and "preempted" in stdout and "wrote" in stdout
    assert "max-concurrency 1: empty running slots (slot-steps) by cause: no_request_waiting" in stdout
    assert f"the daemon: {engine['max_running_requests']} running requests at most, a KV cache of " in stdout
    # every request met the (loose) objectives at both points: the sweep's goodput is its highest point
    assert report["sweep"]["goodput"] == {"share": 0.9, "highest": 4}
    assert "goodput: max-concurrency 4, the highest with >= 90% of the requests at ttft <= 60000 ms, tpot <= 60000 ms" in stdout


def test_warm_up_requests_go_to_the_most_requested_models_first():
    models = ["b", "a", "c", "a", "b", "a", "d"]  # a 3, b 2, then c and d once each, c used first
    assert warmup_models(models, 3) == ["a", "b", "c"]
    assert warmup_models(models, 6) == ["a", "b", "c", "d", "a", "b"]
    assert warmup_models(["base"] * 4, 2) == ["base", "base"]


def test_warm_up_requests_come_before_the_run_and_count_in_no_point(capsys, daemon, tmp_path):
    out = tmp_path / "warm.json"
    code, stdout, err = bench(capsys, "--socket", daemon, "--input-len", 12, "--output-len", 4, "--ignore-eos",
                              "--num-prompts", 6, "--adapters", 3, "--warmup-requests", 5, "--out", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    warmup = report["warmup"]
    assert warmup["requests"] == 5 and warmup["failed"] == 0 and warmup["errors"] == {} and warmup["seconds"] > 0
    assert 1 <= warmup["models"] <= 3
    assert f"warm-up: 5 requests over {warmup['models']} models in " in stdout
    run = report["runs"][0]
    assert run["requests"] == 6 and run["completed"] == 6 and run["total_output_tokens"] == 6 * 4
    engine = run["engine"]  # the daemon's steps in the run alone: the warm-up's 5 prompts of 12 tokens are not in them
    assert sum(kind["prompt_tokens"] for kind in engine["by_kind"].values()) == 6 * 12


def test_requests_drawn_with_a_temperature(capsys, daemon, tmp_path):
    out = tmp_path / "sampled.json"
    code, _, err = bench(capsys, "--socket", daemon, "--input-len", 10, "--output-len", 5, "--ignore-eos",
                         "--num-prompts", 6, "--temperature", 0.9, "--top-p", 0.8, "--top-k", 20, "--out", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["dataset"]["sampling"] == {"temperature": 0.9, "top_p": 0.8, "top_k": 20}
    run = report["runs"][0]
    assert run["completed"] == 6 and run["total_output_tokens"] == 6 * 5


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="the Azure traces are in ../shared/data")
def test_azure_prompts_at_their_own_arrivals(capsys, daemon, tmp_path):
    out = tmp_path / "azure.json"
    code, stdout, err = bench(capsys, "--socket", daemon, "--dataset", "azure-conv", "--data-dir", DATA_DIR,
                              "--num-prompts", 6, "--max-input-len", 24, "--request-rate", "trace",
                              "--time-scale", 0.001, "--out", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["dataset"]["attribution"] == AZURE_ATTRIBUTION and "CC BY 4.0" in stdout
    assert report["dataset"]["prompts"] == 6 and report["models"] == {"base_model": "lorad-demo", "adapters": 0}
    run = report["runs"][0]
    assert run["request_rate"] == "trace" and run["completed"] == 6
    assert run["total_input_tokens"] <= 6 * 24  # cut to --max-input-len, and to fit the context of 128


@pytest.mark.parametrize("argv, fragment", [
    (["--sweep", "speed=1,2"], "expected request-rate=R,R,... or max-concurrency=N,N,..."),
    (["--request-rate", "0"], "not a positive number, inf or trace"),
    (["--goodput", "ttft:fast"], "--goodput ttft:fast"),
    (["--num-prompts", "0"], "argument --num-prompts: expected an integer from 1 to 1000000, not '0'"),
    (["--seed", "-1"], "argument --seed: expected an integer from 0"),
    (["--time-scale", "nan"], "argument --time-scale: expected a positive number, not 'nan'"),
    (["--alpha", "nan"], "argument --alpha: expected a number, not 'nan'"),
    (["--temperature", "-1"], "--temperature must be from 0 to 100"),
    (["--top-p", "0"], "--top-p above 0 and at most 1"),
    (["--warmup-requests", "-1"], "argument --warmup-requests: expected an integer from 0 to 1000000"),
    (["--out", "/"], "--out / is a directory"),
])
def test_bad_flags_are_one_line(capsys, argv, fragment, tmp_path):
    code, _, err = bench(capsys, "--socket", tmp_path / "none.sock", *argv)
    assert code == 2 and fragment in err and err.count("\n") == 1, err


def test_no_daemon_is_a_clear_error(capsys, tmp_path):
    code, _, err = bench(capsys, "--socket", tmp_path / "none.sock", "--num-prompts", 2)
    assert code == 1 and "cannot reach the daemon" in err and "lorad serve" in err, err


def test_a_daemon_that_dies_mid_run_leaves_a_partial_report(demo_assets, short_tmp, tmp_path):
    path = short_tmp / "lorad.sock"
    daemon = start_daemon(demo_assets, path)
    out = tmp_path / "partial.json"
    try:
        wait_healthy(daemon, path)
        load = subprocess.Popen(
            COMMAND + ["bench", "serve", "--no-progress", "--socket", str(path), "--input-len", "8", "--output-len", "64",
                       "--ignore-eos", "--num-prompts", "400", "--max-concurrency", "2", "--out", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3.0)
        assert load.poll() is None, load.communicate()
        kill_daemon(daemon)
        stdout, stderr = load.communicate(timeout=60)
    finally:
        kill_daemon(daemon)
    assert load.returncode == 1, stderr
    assert "the daemon stopped answering" in stderr and "Traceback" not in stderr
    report = json.loads(out.read_text())
    run = report["runs"][0]
    assert run["completed"] > 0 and run["failed"] > 0 and run["completed"] + run["failed"] == 400
    assert "lost their connection" in report["stopped"]
    assert all(error.startswith("connection") for error in run["errors"]), run["errors"]
    assert not math.isnan(run["ttft_ms"]["median"])
