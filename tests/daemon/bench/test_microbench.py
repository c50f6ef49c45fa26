"""The cold-start microbenchmarks (`lorad bench load|invoke|ipc|cpu-lora|cold-start`, daemon/bench_*.py) on
the CPU at tiny sizes: each writes a JSON report with the rows it promises and sane (positive) times and
prints its markdown table; bad arguments exit 2 with one line and no traceback."""

from __future__ import annotations

import os

import json

import pytest
from lorad.daemon.server.cli import main


def run_bench(capsys, tmp_path, *argv) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    code = main(["bench", *[str(a) for a in argv], "--device", "cpu", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(out.read_text())
    assert report["version"] == 1 and report["command"].startswith("lorad bench ")
    assert "| --- |" in captured.out  # the markdown table
    assert report["plot"] is None or report["plot"].endswith(".png")
    return report, captured.out


def test_load_rows_by_rank_targets_and_tier(capsys, tmp_path):
    report, _ = run_bench(capsys, tmp_path, "load", "--ranks", "4,8", "--targets", "qkv,all", "--reps", 2,
                          "--disk-dir", tmp_path)
    assert report["kind"] == "bench-load"
    assert set(report["bandwidth_bytes_per_s"]) == {"pageable", "disk"}
    assert all(value > 0 for value in report["bandwidth_bytes_per_s"].values())
    keys = {(r["targets"], r["rank"], r["tier"]) for r in report["rows"]}
    assert keys == {(t, r, tier) for t in ("qkv", "all") for r in (4, 8) for tier in ("pageable", "host", "disk")}
    for row in report["rows"]:
        assert row["ms"]["n"] == 2 and row["ms"]["median"] > 0 and row["bound_ms"] > 0
        assert row["staged_bytes"] > 0 and (row["file_bytes"] > 0) == (row["tier"] == "disk")
    size = {(r["targets"], r["rank"]): r["staged_bytes"] for r in report["rows"]}
    assert size[("qkv", 4)] < size[("qkv", 8)] < size[("all", 8)]
    assert list(tmp_path.glob("lorad-bench-load-*")) == []  # the disk tier's files are gone


def test_invoke_native_against_base(capsys, tmp_path, no_leftover_segments):
    report, out = run_bench(capsys, tmp_path, "invoke", "--tokens", "4,16", "--hidden", 64, "--layers", 2, "--reps", 3)
    assert report["kind"] == "bench-invoke" and "python path" in out
    prefill = {(r["tokens"], r["mode"]) for r in report["rows"] if r["what"] == "prefill_ms"}
    assert prefill == {(t, m) for t in (4, 16) for m in ("base", "native")}  # no fused path without CUDA
    assert {r["mode"] for r in report["rows"] if r["what"] == "flag_latency_us"} == {"native"}
    assert all(r["median"] > 0 and r["n"] >= 3 for r in report["rows"])


def test_ipc_shared_memory_and_socket_by_workers(capsys, tmp_path, no_leftover_segments):
    report, _ = run_bench(capsys, tmp_path, "ipc", "--workers", "1,2", "--hidden", 64, "--reps", 40)
    assert report["kind"] == "bench-ipc"
    assert {(r["method"], r["workers"]) for r in report["rows"]} == {
        (m, w) for m in ("shm", "shm-python-loop", "unix-socket") for w in (1, 2)}
    for row in report["rows"]:
        assert row["us"]["n"] == 40 and 0 < row["us"]["median"] <= row["us"]["p99"]
        assert row["bytes_each_way"] == row["workers"] * 64 * 4
    shares = {(r["method"], r["workers"]): r.get("native_share") for r in report["rows"]}
    assert shares[("shm-python-loop", 1)] == shares[("shm-python-loop", 2)] == 0
    if report["config"]["worker_loop"] == "native" and len(os.sched_getaffinity(0)) >= 2:
        # One worker leaves this process a core, so the pool runs hot: the native loop served the hot
        # jobs (the module was taught by the cold round trips before; the first hot job may still find
        # the worker asleep in its Python loop).
        assert shares[("shm", 1)] >= 0.9


def test_cpu_lora_profile_and_processes_vs_threads(capsys, tmp_path, no_leftover_segments):
    report, _ = run_bench(capsys, tmp_path, "cpu-lora", "--ranks", "4,16", "--tokens", "1,8,32", "--workers", "1,2",
                          "--scaling-tokens", 16, "--scaling-rank", 8, "--hidden", 64, "--reps", 3)
    assert report["kind"] == "bench-cpu-lora"
    assert [p["rank"] for p in report["profile"]] == [4, 16]
    for entry in report["profile"]:
        assert [s["tokens"] for s in entry["samples"]] == [1, 8, 32] and all(s["ms"] > 0 for s in entry["samples"])
        assert entry["fit"]["tokens_per_ms"] > 0
    one, two = report["scaling"]
    assert one["cores"] == 1 and one["processes_ms"] > 0 and one["threads_ms"] > 0
    assert one["speedup"] == pytest.approx(one["threads_ms"] / one["processes_ms"])
    assert one["processes_groups_ms"] is None  # a split group needs two workers
    assert two["cores"] == 2 and two["processes_groups_ms"] > 0
    assert two["speedup_groups"] == pytest.approx(two["threads_ms"] / two["processes_groups_ms"])
    assert report["serial_ms"] == min(report["serial_ms_by_core"].values()) > 0  # the fastest core's
    for row in (one, two):  # the bound: the serial work split perfectly over the row's cores
        assert row["perfect_split_ms"] == pytest.approx(report["serial_ms"] / row["cores"])
        assert row["perfect_split_speedup"] == pytest.approx(row["threads_ms"] / row["perfect_split_ms"])


def test_cold_start_modes_workloads_and_ablation(capsys, tmp_path, no_leftover_segments):
    report, out = run_bench(capsys, tmp_path, "cold-start", "--requests", 3, "--rate", 100, "--adapters", 4,
                            "--modes", "ondemand,cpu", "--prompt-tokens", 8, "--output-tokens", 3, "--cpu-workers", 1)
    assert report["kind"] == "bench-cold-start"
    assert [(r["mode"], r["workload"]) for r in report["rows"]] == [
        (m, w) for m in ("ondemand", "cpu") for w in ("distinct", "skewed-4")]
    for row in report["rows"] + report["ablation"]:
        assert row["requests"] == row["completed"] == 3 and row["errors"] == 0
        for metric in ("ttft_ms", "tpot_ms", "latency_ms"):
            assert row[metric]["median"] > 0
        assert row["ttft_ms"]["median"] <= row["latency_ms"]["median"]
    distinct = {r["mode"]: r for r in report["rows"] if r["workload"] == "distinct"}
    assert distinct["ondemand"]["engine"]["adapter_loads"] == 3  # every request a cold start
    assert distinct["cpu"]["engine"]["cpu_assisted_prefills"] == 3
    labels = [a["config"] for a in report["ablation"]]
    assert labels[:2] == ["cpu assist off, pinned host copies", "cpu assist on, pinned host copies"]
    assert "no pinned vs pageable rows on the CPU" in out


def test_cold_start_rounds_pool_fresh_engines_in_abba_order(capsys, tmp_path, no_leftover_segments):
    report, out = run_bench(capsys, tmp_path, "cold-start", "--requests", 2, "--rate", 100, "--adapters", 4,
                            "--modes", "ondemand,auto", "--prompt-tokens", 8, "--output-tokens", 3, "--cpu-workers", 1,
                            "--rounds", 3, "--no-ablation")
    assert report["config"]["rounds"] == 3
    assert [line for line in out.splitlines() if line.startswith("round ")] == [
        "round 1 of 3: ondemand, auto", "round 2 of 3: auto, ondemand", "round 3 of 3: ondemand, auto"]
    assert out.count("engine cold_start=ondemand: built") == out.count("engine cold_start=auto: built") == 3
    for row in report["rows"]:
        assert row["requests"] == row["completed"] == 6 and row["ttft_ms"]["n"] == 6  # 2 requests x 3 rounds
        assert len(row["rounds"]) == 3 and "samples" not in row
        means = [r["ttft_mean_ms"] for r in row["rounds"]]
        assert row["ttft_ms"]["mean"] == pytest.approx(sum(means) / 3)  # equal rounds: the pooled mean
    distinct = next(r for r in report["rows"] if r["mode"] == "ondemand" and r["workload"] == "distinct")
    assert distinct["engine"]["adapter_loads"] == 6  # every request of every round a cold start


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "load", "--ranks", "0"], "positive integers"),
    (["bench", "load", "--device", "tpu"], "invalid choice"),
    (["bench", "load", "--device", "cpu", "--tiers", "pinned"], "needs --device cuda"),
    (["bench", "load", "--device", "cpu", "--targets", "qk"], "unknown set"),
    (["bench", "ipc", "--workers", "two"], "comma-separated integers"),
    (["bench", "cpu-lora", "--reps", "0"], "positive integer"),
    (["bench", "cold-start", "--rate", "-1"], "positive number"),
    (["bench", "cold-start", "--device", "cpu", "--modes", "warp"], "unknown mode"),
    (["bench", "cold-start", "--device", "cpu", "--model-config", "gpt-5"], "unknown --model-config"),
    (["bench", "invoke", "--device", "cpu", "--out", "/nonexistent/dir/x.json"], "does not exist"),
    (["bench", "load", "--device", "cpu", "--tiers", "tape"], "unknown tier 'tape'"),
    (["bench", "cold-start", "--device", "cpu", "--targets", "q_proj,lm_head"], "unknown projection 'lm_head'"),
    (["bench", "invoke", "--device", "cpu", "--hidden", "10000000"], "--hidden: expected an integer from 1 to 65536"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, fragment):
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", captured
    assert captured.err.count("\n") == 1 and fragment in captured.err and "Traceback" not in captured.err, captured.err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    assert main(["bench", "ipc", "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
