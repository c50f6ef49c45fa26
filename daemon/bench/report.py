"""What the cold-start microbenchmarks (`lorad bench load|invoke|ipc|cpu-lora|cold-start`) share: the
device and model shape they run on, summary statistics, the markdown table they print, the JSON report
and the optional PNG plot they write."""

from __future__ import annotations

import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lorad.daemon.bench.trace_report import write_json
from lorad.errors import BadRequest

log = logging.getLogger(__name__)

# The shape each device runs by default: the paper's 7B on a GPU, the demo's tiny Llama on the CPU (CI).
DEFAULT_MODEL = {"cuda": "llama-2-7b", "cpu": "tiny-llama"}
TARGET_SETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "qkvo": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


def resolve_device(name: str) -> torch.device:
    """auto: cuda when torch sees a GPU. Asking for cuda without one is a usage error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise BadRequest(f"--device cuda: torch {torch.__version__} sees no CUDA GPU (use --device cpu)")
    return torch.device(name)


def model_spec(model_config: str | None, device: torch.device):
    """The ModelSpec of a known shape (daemon/model/checkpoint.py's MODEL_CONFIGS), the device's default if None."""
    from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec

    name = model_config or DEFAULT_MODEL[device.type]
    if name not in MODEL_CONFIGS:
        raise BadRequest(f"unknown --model-config {name!r}: one of {', '.join(MODEL_CONFIGS)}")
    return name, ModelSpec.from_hf_config(MODEL_CONFIGS[name])


def model_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(call, device: torch.device) -> float:
    """Host wall clock of `call()` until the device has finished it: what a waiting request sees."""
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def summary(values) -> dict:
    """median, mean, p10, p90, p99 and n of a list of numbers (empty: n 0 and the rest None)."""
    values = np.asarray(list(values), dtype=np.float64)
    if not len(values):
        return {"median": None, "mean": None, "p10": None, "p90": None, "p99": None, "n": 0}
    p10, p90, p99 = np.quantile(values, (0.1, 0.9, 0.99))
    return {"median": float(statistics.median(values)), "mean": float(values.mean()), "p10": float(p10),
            "p90": float(p90), "p99": float(p99), "n": len(values)}


def machine(device: torch.device) -> dict:
    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores_usable": len(os.sched_getaffinity(0)), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; floats get 3 significant decimals, None prints as '-'."""
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(path: str | None, report: dict, say: bool = True) -> None:
    """JSON (non-finite numbers as null) at `path`, if given, and its PNG beside it: report["plot"] says
    which, or why there is none. say: print where it went."""
    if not path:
        return
    write_json(path, report)
    if say:
        print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot (Agg), or None with the reason printed: the plots are optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        print(f"no plot: matplotlib is not installed ({error}); pip install 'lorad[bench]'")
        return None
    return plt


def save_plot(path: str | None, draw) -> str | None:
    """`draw(plt)` -> figure, saved as PATH's .png; returns where, None without --out or matplotlib."""
    if not path:
        return None
    plt = pyplot()
    if plt is None:
        return None
    figure = draw(plt)
    png = str(Path(path).with_suffix(".png"))
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    plt.close(figure)
    print(f"wrote {png}")
    return png


def finish(path: str | None, report: dict, draw) -> None:
    """Write the JSON report, then the plot (`draw(plt)` -> figure) beside it, then record in the report
    where the plot is (None: no --out, or no matplotlib). The data is on disk before any plotting."""
    report["plot"] = None
    write_report(path, report)
    report["plot"] = save_plot(path, draw)
    if report["plot"] is not None:
        write_report(path, report, say=False)  # the same file again, now naming its plot

