"""Benchmark of CPU LoRA invocation: the fused sync-free ops (gpu_ops/cuda_ext.py, CaraServe §4.2)
against CaraServe's "native" PyTorch path (async copy + stream sync + host flag store; host wait + copy
back + add) and against the base model alone, as in CaraServe's Fig. 16.

A prefill of `layers` layers, each: cast x to fp32 into the staging buffer, hand it to the CPU workers,
run the base projection (x @ W^T, 4096 x 4096, bf16), add the workers' result. One worker process (pinned
to the last core) answers each job at once: the CPU LoRA computation is the same on both paths and is
left out, so what remains is the invocation overhead. Times are host wall clock for the whole prefill
(launch to synchronize), median over `reps` after warm-up, with fresh random activations.
Also: the latency from launching copy_and_signal on an idle stream until the host sees the flag.

    python3 bench/invoke.py --out bench/results/invoke_h100.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time

import numpy as np
import torch

from lorad.gpu_ops import cuda_ext
from lorad.shm.exchange import DONE_SEQ, JOB_SEQ, Exchange, ExchangeConfig
from lorad.shm.flags import Flag
from lorad.shm.segment import new_instance


def echo_worker(exchange_name: str, core: int) -> None:
    """Answers job n with done n as soon as it sees it (spinning): invocation overhead only."""
    os.sched_setaffinity(0, {core})
    exchange = Exchange.attach(exchange_name)
    slot = exchange.slots[0]
    slot.pid = os.getpid()
    seq = 0
    while True:
        seq = slot.job_flag.wait(seq + 1, timeout_s=None, spin_s=3600.0)
        slot.finish(seq, 0)


class Bench:
    def __init__(self, max_tokens: int, hidden: int, layers: int):
        self.hidden, self.layers = hidden, layers
        config = ExchangeConfig(workers=1, max_tokens=max_tokens, hidden=hidden, max_out=hidden)
        self.exchange = Exchange.create(new_instance(), config)
        self.mapping = cuda_ext.register_host(self.exchange.segment.buffer) if cuda_ext.available() else None
        buffer, layout = self.exchange.segment.buffer, self.exchange.layout
        self.job_flags = np.ndarray((1,), np.int64, buffer=buffer, offset=layout.job_line(0) + JOB_SEQ * 8)
        self.done_flags = np.ndarray((1,), np.int64, buffer=buffer, offset=layout.worker_line(0) + DONE_SEQ * 8)
        self.exchange.output[:] = np.random.randn(*self.exchange.output.shape).astype(np.float32) * 1e-3
        self.weights = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5 for _ in range(4)]
        self.staged = torch.empty(max_tokens, hidden, device="cuda")
        self.error = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.seq = 0
        self.worker = multiprocessing.get_context("spawn").Process(
            target=echo_worker, args=(self.exchange.name, max(os.sched_getaffinity(0))), daemon=True
        )
        self.worker.start()
        while self.exchange.slots[0].pid != self.worker.pid:
            if self.worker.exitcode is not None:
                raise RuntimeError("echo worker died")
            time.sleep(1e-3)

    def prefill(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        tokens = x.shape[0]
        inputs = torch.from_numpy(self.exchange.input)[:tokens]
        results = torch.from_numpy(self.exchange.output)[:tokens, : self.hidden]
        copy = cuda_ext.fused_copy_and_signal if mode == "fused" else cuda_ext.python_copy_and_signal
        add = cuda_ext.fused_wait_and_add if mode == "fused" else cuda_ext.python_wait_and_add
        for layer in range(self.layers):
            weight = self.weights[layer % len(self.weights)]
            if mode != "base":
                self.seq += 1
                staged = self.staged[:tokens]
                staged.copy_(x)
                copy(inputs, staged, self.job_flags, self.seq)
            y = x @ weight.t()
            if mode != "base":
                add(y, results, self.done_flags, self.seq, self.error, 10.0)
            x = y
        return x

    def time_prefill(self, tokens: int, mode: str, reps: int) -> list[float]:
        xs = [torch.randn(tokens, self.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        times = []
        for rep in range(reps + 2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            self.prefill(xs[rep % len(xs)], mode)
            torch.cuda.synchronize()
            if rep >= 2:
                times.append((time.perf_counter() - start) * 1e3)
        if int(self.error):
            raise RuntimeError(f"a wait timed out (seq {int(self.error)})")
        return times

    def flag_latency_us(self, tokens: int, mode: str, reps: int) -> list[float]:
        """Launch copy_and_signal on an idle stream, spin on the host until the worker's done flag."""
        inputs = torch.from_numpy(self.exchange.input)[:tokens]
        staged = self.staged[:tokens].normal_()
        copy = cuda_ext.fused_copy_and_signal if mode == "fused" else cuda_ext.python_copy_and_signal
        done = Flag(self.exchange.segment.buffer, self.exchange.layout.worker_line(0) + DONE_SEQ * 8)
        times = []
        for rep in range(reps + 5):
            torch.cuda.synchronize()
            self.seq += 1
            start = time.perf_counter()
            copy(inputs, staged, self.job_flags, self.seq)
            while done.load() < self.seq:
                pass
            if rep >= 5:
                times.append((time.perf_counter() - start) * 1e6)
        return times

    def close(self) -> None:
        self.worker.kill()
        self.worker.join(5)
        if self.mapping is not None:
            self.mapping.close()
        self.exchange.close()


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p10": ordered[len(ordered) // 10],
        "p90": ordered[(len(ordered) * 9) // 10],
        "n": len(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16,128,512,2048")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    modes = ["base", "native", "fused"] if cuda_ext.available() else ["base", "native"]
    print(f"invocation_path: {cuda_ext.invocation_path()}")
    bench = Bench(max(token_counts), args.hidden, args.layers)
    rows = []
    try:
        for tokens in token_counts:
            for mode in modes:
                rows.append({"what": "prefill_ms", "tokens": tokens, "mode": mode,
                             **summary(bench.time_prefill(tokens, mode, args.reps))})
        for tokens in (16, 512):
            for mode in modes[1:]:
                rows.append({"what": "flag_latency_us", "tokens": tokens, "mode": mode,
                             **summary(bench.flag_latency_us(tokens, mode, 200))})
    finally:
        bench.close()
    result = {
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
                    "cpus": os.cpu_count()},
        "config": {"hidden": args.hidden, "layers": args.layers, "reps": args.reps,
                   "invocation_path": cuda_ext.invocation_path()},
        "rows": rows,
    }
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)
    print(f"{'what':<16} {'tokens':>6} " + " ".join(f"{mode:>18}" for mode in modes))
    for what in ("prefill_ms", "flag_latency_us"):
        for tokens in sorted({row["tokens"] for row in rows if row["what"] == what}):
            cells = {row["mode"]: row for row in rows if row["what"] == what and row["tokens"] == tokens}
            line = " ".join(
                f"{cells[m]['median']:>8.3f} ({cells[m]['p10']:.2f}-{cells[m]['p90']:.2f})" if m in cells else f"{'-':>18}"
                for m in modes
            )
            print(f"{what:<16} {tokens:>6} {line}")


if __name__ == "__main__":
    main()
