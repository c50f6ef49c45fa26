"""What `lorad simulate` and `lorad bench trace` (trace replay) both report: one table row per run, the
time-per-token and TTFT CDFs (quantiles in the JSON, a PNG when matplotlib is there) and the JSON file.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

CDF_POINTS = 201  # quantiles kept per metric in the JSON report


def print_attribution(trace) -> None:
    """The data's attribution (the Azure traces' licence asks for it), when the trace carries one."""
    if "attribution" in trace.source:
        print(f"data: {trace.source['attribution']}")


def quantiles(values: np.ndarray) -> list[float]:
    values = values[~np.isnan(values)]
    if not len(values):
        return []
    return [float(v) for v in np.quantile(values, np.linspace(0.0, 1.0, CDF_POINTS))]


def plot_cdfs(summaries: list[dict], path: Path, slo_tpot_s: float | None, note: str = "") -> Path | None:
    """Time-per-token and TTFT CDFs of each run in one PNG; skipped, with the reason logged, without
    matplotlib (`pip install lorad[bench]`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        log.warning("no plot written: matplotlib is not installed (%s); pip install 'lorad[bench]'", error)
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for summary in summaries:
        label = f"{summary['policy']} / {summary['admission']}"
        for axis, metric in zip(axes, ("tpot_s", "ttft_s")):
            points = summary["cdf"][metric]
            if points:
                axis.plot(np.array(points) * 1e3, np.linspace(0, 1, len(points)), label=label)
    if slo_tpot_s:
        axes[0].axvline(slo_tpot_s * 1e3, color="grey", linestyle="--", label="objective")
    axes[0].set_xlabel("time per output token (ms)")
    axes[1].set_xlabel("time to first token (ms)")
    axes[1].set_xscale("log")
    for axis in axes:
        axis.set_ylabel("CDF")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if note:
        figure.suptitle(note, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    log.info("plot written path=%s", path)
    return path


# --- the table --------------------------------------------------------------------------------------------


def format_table(summaries: list[dict]) -> str:
    """One row per run: requests done and dropped, throughput, TTFT / time per token / latency (mean, p50,
    p90, p99, in ms) and SLO attainment (drops count as misses)."""
    header = ["policy", "admission", "done", "dropped", "req/s", "tok/s"]
    for metric in ("TTFT", "TPOT", "latency"):
        header += [f"{metric} {stat}" for stat in ("mean", "p50", "p90", "p99")]
    header += ["SLO TTFT", "SLO TPOT", "SLO both"]
    rows = [header]
    for s in summaries:
        row = [s["policy"], s["admission"], str(s["completed"]), str(s["dropped"]),
               f"{s['throughput_rps']:.1f}", f"{s['throughput_tokens_per_s']:.0f}"]
        for metric, digits in (("ttft_s", 1), ("tpot_s", 2), ("latency_s", 0)):
            row += [_ms(s[metric][stat], digits) for stat in ("mean", "p50", "p90", "p99")]
        row += [_percent(s.get(key)) for key in ("slo_ttft_attainment", "slo_tpot_attainment", "slo_attainment")]
        rows.append(row)
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.rjust(width) if i > 1 else cell.ljust(width) for i, (cell, width) in
                       enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines + ["(times in ms; SLO: share of all requests meeting the objective, drops are misses)"])


def _ms(seconds, digits: int) -> str:
    return "-" if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)) else f"{seconds * 1e3:.{digits}f}"


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def write_json(path: str, report: dict) -> None:
    """`report` as JSON at `path`, non-finite numbers as null (the microbenchmarks' reports too)."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    Path(path).write_text(json.dumps(clean(report), indent=1, allow_nan=False) + "\n")
