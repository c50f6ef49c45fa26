"""daemon/bench/cli.py and the modules it runs: `lorad trace make` writes replayable traces (the Azure kinds
with their CC BY 4.0 attribution), `lorad simulate` prints one row per policy and admission and writes the JSON report, saying
the example profile is not measured, and `lorad bench trace` replays a tiny trace against `lorad serve
--demo` as a real process, streaming, with the adapters mapped onto the daemon's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lorad.daemon.server.cli import main
from lorad.scheduler.workload import AZURE_ATTRIBUTION, Trace

# test_cli.py's helpers (pytest puts this folder on sys.path)
from daemon_harness import start_daemon, stop_daemon, wait_healthy

DATA_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "data"


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("kind, extra", [
    ("poisson", ["--alpha", "0.5"]),
    ("gamma", ["--cv", "4"]),
    ("serverless", ["--sigma", "2"]),
])
def test_trace_make_synthetic(capsys, tmp_path, kind, extra):
    out = tmp_path / "trace.json"
    argv = ["trace", "make", "--kind", kind, "--adapters", 200, "--rate", 50, "--duration", 4,
            "--ranks", "8,64", "--output-len", "4,16", "--seed", 3, "--out", out, *extra]
    code, stdout, err = run_main(capsys, *argv)
    assert code == 0, err
    trace = Trace.load(out)
    assert "wrote" in stdout and f"{len(trace.requests)} requests" in stdout
    assert trace.source["generator"] == kind and set(trace.adapter_ranks.values()) <= {8, 64}
    assert all(4 <= r.output_tokens <= 16 for r in trace.requests)
    assert run_main(capsys, *argv)[0] == 0 and Trace.load(out).requests == trace.requests  # seeded


@pytest.mark.skipif(not DATA_DIR.is_dir(), reason="the Azure traces are in ../shared/data")
def test_trace_make_azure_records_the_attribution(capsys, tmp_path):
    out = tmp_path / "azure.json"
    code, stdout, err = run_main(capsys, "trace", "make", "--kind", "azure-code", "--adapters", 50, "--rate", 5,
                                 "--requests", 100, "--data-dir", DATA_DIR, "--out", out)
    assert code == 0, err
    trace = Trace.load(out)
    assert len(trace.requests) == 100 and trace.source["attribution"] == AZURE_ATTRIBUTION
    assert "CC BY 4.0" in stdout
    code, _, err = run_main(capsys, "trace", "make", "--kind", "azure-conv", "--data-dir", tmp_path, "--out", out)
    assert code == 2 and "cannot read Azure trace" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, fragment", [
    (["trace"], "required: action"),
    (["trace", "make", "--out", "x.json"], "required: --kind"),
    (["trace", "make", "--kind", "gamma", "--ranks", "8,x", "--out", "x.json"], "comma-separated integers"),
    (["trace", "make", "--kind", "poisson", "--requests", "50", "--out", "x.json"], "--requests is for the azure kinds"),
    (["simulate", "--trace", "/nonexistent.json"], "cannot read trace"),
    (["simulate", "--trace", "x.json", "--policy", "psychic"], "invalid choice"),
    (["bench", "trace"], "required: --trace"),
    (["trace", "make", "--kind", "poisson", "--rate", "inf", "--out", "x.json"], "--rate: expected a positive number"),
    (["trace", "make", "--kind", "poisson", "--rate", "1e9", "--out", "x.json"], "a trace holds at most 10,000,000"),
    (["trace", "make", "--kind", "poisson", "--adapters", "10000000", "--out", "x.json"], "from 1 to 1000000"),
    (["trace", "make", "--kind", "poisson", "--seed", "-1", "--out", "x.json"], "--seed: expected an integer from 0"),
    (["trace", "make", "--kind", "serverless", "--sigma", "-1", "--out", "x.json"], "--sigma: expected a positive"),
    (["simulate", "--trace", "x.json", "--engines", "100000000"], "--engines: expected an integer from 1 to 10000"),
    (["simulate", "--trace", "x.json", "--max-prefill-tokens", "0"], "--max-prefill-tokens: expected a positive"),
    (["bench", "trace", "--trace", "x.json", "--time-scale", "nan"], "--time-scale: expected a positive number"),
    (["bench", "ipc", "--workers", "1000"], "--workers: expected integers from 1 to 256"),
    (["bench", "load", "--warmup", "-1"], "--warmup: expected an integer of at least 0"),
])
def test_bad_usage_exits_2_with_one_line(capsys, argv, fragment):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and fragment in err, err


@pytest.mark.parametrize("text, fragment", [
    ('{"version": 1}', "malformed trace: it has no 'requests' field"),
    ('{"version": 1, "requests": [[0, "a", 1]], "adapter_ranks": {"a": 8}}', "malformed trace: not enough values"),
    ('{"version": 2}', "unknown trace version 2"),
    ('{"version": 1, "requests": [[0, "a", -5, 4]], "adapter_ranks": {"a": 8}}', "malformed trace: request 0 [0.0, 'a', -5, 4]"),
    ('{"version": 1, "requests": [[NaN, "a", 5, 4]], "adapter_ranks": {"a": 8}}', "needs a finite arrival_s >= 0"),
    ('{"version": 1, "requests": [[0, "a", 5, 0]], "adapter_ranks": {"a": 8}}', "at least one prompt and one output"),
    ('{"version": 1, "requests": [[0, "a", 5, 4]], "adapter_ranks": {"a": -1}}', "adapter ranks must be at least 1"),
])
def test_a_malformed_trace_is_one_line_naming_what_is_wrong(capsys, tmp_path, text, fragment):
    (tmp_path / "trace.json").write_text(text)
    code, out, err = run_main(capsys, "simulate", "--trace", tmp_path / "trace.json")
    assert code == 2 and out == "" and err.startswith("lorad: ") and fragment in err and err.count("\n") == 1, err


def test_an_out_path_that_cannot_be_written_names_it(capsys, tmp_path):
    out = tmp_path / "missing" / "trace.json"
    code, _, err = run_main(capsys, "trace", "make", "--kind", "poisson", "--adapters", 4, "--rate", 2, "--duration", 5,
                            "--out", out)
    assert code == 2 and err == f"lorad: --out {out}: the directory {out.parent} does not exist\n"
    code, _, err = run_main(capsys, "simulate", "--trace", tmp_path / "none.json", "--out", tmp_path)
    assert code == 2 and err == f"lorad: --out {tmp_path} is a directory: give a file's path\n"


def test_simulate_prints_a_row_per_run_and_writes_the_report(capsys, caplog, tmp_path):
    trace_path, report_path = tmp_path / "trace.json", tmp_path / "report.json"
    assert run_main(capsys, "trace", "make", "--kind", "gamma", "--adapters", 100, "--rate", 40, "--duration", 10,
                    "--cv", 4, "--output-len", "8,64", "--out", trace_path)[0] == 0
    code, out, err = run_main(capsys, "simulate", "--engines", 3, "--trace", trace_path, "--policy", "all",
                              "--admission", "both", "--out", report_path)
    assert code == 0, err
    assert "NOT MEASURED" in out
    for policy in ("rank_aware", "most_idle", "first_fit", "random"):
        assert sum(line.startswith(policy) for line in out.splitlines()) == 2  # fcfs and early_abort
    report = json.loads(report_path.read_text())
    assert report["profile"]["measured"] is False and "NOT MEASURED" in report["profile"]["note"]
    assert report["config"]["num_engines"] == 3 and len(report["results"]) == 8
    for result in report["results"]:
        assert result["completed"] + result["dropped"] == result["requests"] == report["trace"]["requests"]
        assert 0.0 <= result["slo_attainment"] <= 1.0 and len(result["cdf"]["tpot_s"]) == 201
    if report_path.with_suffix(".png").exists():
        assert report_path.with_suffix(".png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in caplog.text  # the reason the plot was skipped
    # one policy, clustered admission
    code, out, _ = run_main(capsys, "simulate", "--engines", 2, "--trace", trace_path, "--policy", "most-idle",
                            "--cluster", 4)
    assert code == 0 and "fcfs+cluster4" in out
    # the engines' time-per-token admission rule, with a tight objective: requests are held back
    code, out, err = run_main(capsys, "simulate", "--engines", 2, "--trace", trace_path, "--policy", "most-idle",
                              "--tpot-admission", "--slo-tpot-s", 0.03, "--out", report_path)
    report = json.loads(report_path.read_text())
    assert code == 0 and report["config"]["tpot_admission"] is True, err
    assert report["results"][0]["tpot_held"] > 0


def test_bench_trace_replays_against_the_demo_daemon(capsys, demo_assets, short_tmp):
    trace_path, report_path = short_tmp / "tiny.json", short_tmp / "replay.json"
    assert run_main(capsys, "trace", "make", "--kind", "poisson", "--adapters", 12, "--rate", 20, "--duration", 1,
                    "--prompt-len", "4,24", "--output-len", "2,8", "--seed", 1, "--out", trace_path)[0] == 0
    trace = Trace.load(trace_path)
    assert 12 <= len(trace.requests) <= 30
    socket_path = short_tmp / "lorad.sock"
    process = start_daemon(demo_assets, socket_path)
    try:
        wait_healthy(process, socket_path)
        code, out, err = run_main(capsys, "bench", "trace", "--socket", socket_path, "--trace", trace_path,
                                  "--time-scale", 0.5, "--max-output-tokens", 6, "--slo-ttft-s", 30,
                                  "--slo-tpot-s", 10, "--out", report_path)
        assert code == 0, err
    finally:
        stop_daemon(process, timeout=30)
    assert "mapped onto the daemon's 8 by index modulo 8" in out and "daemon" in out
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert summary["requests"] == len(trace.requests) and summary["completed"] == len(trace.requests)
    assert summary["slo_attainment"] == 1.0 and summary["ttft_s"]["p50"] > 0
    assert set(report["mapping"]["adapters"].values()) <= {f"demo-r{r}" for r in (1, 2, 4, 8, 16, 32, 64)} | {"demo-r16-mlp"}
    for request, replayed in zip(trace.requests, report["requests"]):
        assert replayed["error"] is None
        assert replayed["output_tokens"] == min(request.output_tokens, 6) == replayed["max_tokens"]
        assert replayed["arrival_s"] == pytest.approx(request.arrival_s * 0.5)
        assert 0 < replayed["ttft_s"] <= replayed["latency_s"]
    # no daemon: exit 1 with one line
    code, _, err = run_main(capsys, "bench", "trace", "--socket", short_tmp / "nobody.sock", "--trace", trace_path)
    assert code == 1 and "cannot reach the daemon" in err and err.count("\n") == 1
    assert os.path.exists(trace_path)
