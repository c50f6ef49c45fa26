"""Decode rows that share adapters: MBGMV (a row at a time, each row reads its adapter's pages; also with its expand launched early) against MBGMM (rows
grouped by adapter, each adapter read once) on 64 rows, their adapters drawn Zipf(1) over 100 (~31 distinct, as a
popular-adapter trace puts them) or all distinct; ranks 16 and 64; q (4096 -> 4096), gate (4096 -> 11008) and down
(11008 -> 4096) of the 7B shape; CUDA-graph replays over 4 layers. Each beside two floors over the measured copy
bandwidth: every row reading its adapter, and every adapter read once. Each result checked against `mbgmm_ref`.

    python3 bench/lora_decode_sharing.py --out OUT.json
    python3 bench/lora_decode_sharing.py --smoke   # tiny shapes on the CPU (Triton interpreter): checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lora_kernels import build_table  # noqa: E402
from timing import Timer, copy_bandwidth  # noqa: E402

from lorad.gpu_ops import bgmv, launch, mbgmm, mbgmv  # noqa: E402
from lorad.gpu_ops.lora import LoraBatch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    timer = Timer(device, reps=1 if smoke else 20, graph_on_cpu=True)
    bandwidth = copy_bandwidth(device, timer, 1 if smoke else 256)
    layers, rows, adapters = (2, 8, 6) if smoke else (4, 64, 100)
    shapes = ((64, 128),) if smoke else ((4096, 4096), (4096, 11008), (11008, 4096))
    rng = np.random.default_rng(0)
    weights = 1 / np.arange(1, adapters + 1)
    pdl_off = launch.pdl_unavailable(device)  # the expand launched early (the engine's default on Hopper)
    out = {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(), "bandwidth_GBps": bandwidth,
           "mbgmv_pdl": pdl_off or "timed", "cases": []}
    for sharing in ("zipf", "distinct"):
        slots = (rng.choice(adapters, size=rows, p=weights / weights.sum()) if sharing == "zipf"
                 else np.arange(rows) % adapters).tolist()
        distinct = len(set(slots))
        for rank in (16, 64):
            for in_dim, out_dim in shapes:
                table = build_table(64, in_dim, out_dim, [rank] * adapters, layers, torch.bfloat16, device, seed=3)
                batch = LoraBatch.build(slots, device)
                segments = mbgmm.Segments.build(batch, table)
                xs = [torch.randn(rows, in_dim, device=device, dtype=torch.bfloat16) for _ in range(layers)]
                ys = [torch.randn(rows, out_dim + 256, device=device, dtype=torch.bfloat16)[:, :out_dim] for _ in range(layers)]
                workspace = torch.empty(bgmv.workspace_numel(rows, rank), device=device)
                start = 0.1 * torch.randn(rows, out_dim, device=device, dtype=torch.bfloat16)
                expected = start.clone()
                mbgmm.mbgmm_ref(xs[0], expected, 0, 0, segments, table)
                methods = {
                    "mbgmv": lambda x, y, i: mbgmv.lora_decode(x, y, i, 0, batch, table, max_rank=rank, workspace=workspace),
                    "mbgmv_pdl": lambda x, y, i: mbgmv.lora_decode(x, y, i, 0, batch, table, max_rank=rank, workspace=workspace,
                                                                   pdl=True),
                    "mbgmm": lambda x, y, i: mbgmm.lora_prefill(x, y, i, 0, batch, table, segments=segments, workspace=workspace),
                }
                activations = rows * (in_dim + 2 * out_dim) * 2
                case = {"sharing": sharing, "distinct": distinct, "rank": rank, "in_out": [in_dim, out_dim],
                        "floor_each_row_us": round((rows * rank * (in_dim + out_dim) * 2 + activations) / bandwidth / 1e3, 2),
                        "floor_each_adapter_once_us": round((distinct * rank * (in_dim + out_dim) * 2 + activations) / bandwidth / 1e3, 2)}
                if pdl_off is not None:
                    del methods["mbgmv_pdl"]
                for name, fn in methods.items():
                    y = start.clone()
                    fn(xs[0], y, 0)
                    error = float((y.float() - expected.float()).norm() / (expected.float() - start.float()).norm())
                    assert error < 1e-2, f"{name} differs from mbgmm_ref: relative error {error:.3g}"
                    us = timer.graph([lambda i=i: fn(xs[i], ys[i], i) for i in range(layers)], layers)
                    case[name] = {"us": round(us, 2), "rel_error": round(error, 5)}
                print(case, flush=True)
                out["cases"].append(case)
                if args.out:  # after every case: a run cut short by a time limit keeps what it measured
                    with open(args.out, "w") as handle:
                        json.dump(out, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
