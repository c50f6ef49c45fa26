"""What the device-side wait of streamed adapter placement costs the prefill LoRA when nothing streams.

With streaming on (cold_start auto, AdapterTable.enable_streaming) every MBGMM shrink program first reads
its slot's `ready` word (gpu_ops/mbgmm.py, _wait_streamed). This times MBGMM (shrink + expand, from CUDA
graph replays) over the 7B projections for prefill steps of a few sizes, with the wait compiled in and
without, alternating the two several times in one process, adapters resident (ready never holds anyone).

    python3 bench/stream_wait.py --out OUT/stream_wait.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.gpu_ops import mbgmm
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable, PagePool

from timing import Timer  # noqa: E402  (bench/timing.py, beside this script)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,256,1024", help="prefill rows per step")
    parser.add_argument("--segments", type=int, default=2, help="adapters among the rows")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="off/on alternations")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["llama-2-7b"])
    shapes = [spec.projection_shape(p) for p in PROJECTIONS]
    page = spec.page_elems
    chunks = sum(-(-i // page) + -(-o // page) for i, o in shapes)
    pool = PagePool(args.segments * args.rank * chunks + 64, page, torch.bfloat16, device)
    table = AdapterTable(pool, args.segments, 1, shapes)
    generator = torch.Generator().manual_seed(0)
    for slot in range(args.segments):
        weights = {(0, proj): (torch.randn(args.rank, i, generator=generator) * 0.01,
                               torch.randn(o, args.rank, generator=generator) * 0.01)
                   for proj, (i, o) in enumerate(shapes)}
        assert table.place(slot, weights)
    if device.type == "cuda":
        table.enable_streaming()
    timer = Timer(device, args.reps, graph_on_cpu=True)  # on the cpu (a smoke run): eager, interpreted
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row_slots = [row * args.segments // tokens for row in range(tokens)]  # equal runs per adapter
        segments = mbgmm.Segments.build(LoraBatch.build(row_slots, device), table)
        xs = [torch.randn(tokens, i, device=device, dtype=torch.bfloat16) for i, _ in shapes]
        ys = [torch.zeros(tokens, o, device=device, dtype=torch.bfloat16) for _, o in shapes]
        calls = [lambda proj=proj: mbgmm.mbgmm(xs[proj], ys[proj], 0, proj, segments, table) for proj in range(len(shapes))]
        times = {"off": [], "on": []}
        for _ in range(args.rounds):
            for state in ("off", "on"):
                table.streaming = state == "on" and device.type == "cuda"
                times[state].append(timer.graph(calls) * len(calls))  # us for the 7 projections
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        rows.append({"tokens": tokens, "segments": args.segments, "rank": args.rank, "off_us": off, "on_us": on,
                     "on_over_off": on / off, "rounds_off_us": times["off"], "rounds_on_us": times["on"]})
        print(f"tokens {tokens:5d}: 7 projections' MBGMM {off:8.1f} us without the wait, {on:8.1f} us with it "
              f"({on / off:.3f}x; a 32-layer step: {(on - off) * 32 / 1e3:+.3f} ms)")
    report = {"kind": "stream-wait", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "rows": rows}
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
