"""`lorad bench invoke`: the cost of invoking CPU LoRA from a prefill (CaraServe §4.2, Fig. 16): the fused
sync-free ops (gpu_ops/cuda_ext.py: one kernel copies x into shared memory and raises the flag; one
waits for the workers' flag and adds) against the "native" path (async copy, stream synchronize, host
flag store; host wait, copy back, add), and the base model alone, by prompt tokens.

A prefill of `layers` layers, each: x into the staging buffer, handed to the CPU worker, the base
projection (x @ W^T, hidden x hidden), the worker's result added. One echo worker process (pinned to
the last core) answers each job at once: the CPU LoRA computation is the same on every path and left
out, so what remains is the invocation overhead. Times are host wall clock for the whole prefill
(launch to synchronize), median over `reps` after warm-up, with fresh random activations. Also: the
latency from launching copy+signal on an idle stream until the host sees the worker's done flag.
On the CPU the native (python) path and the base run; the fused path needs the CUDA extension.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
import torch
from lorad.daemon.bench.report import (
    finish,
    machine,
    markdown_table,
    model_dtype,
    resolve_device,
    summary,
    sync,
)
from lorad.gpu_ops import cuda_ext
from lorad.shm.exchange import DONE_SEQ, JOB_SEQ, Exchange, ExchangeConfig
from lorad.shm.flags import Flag
from lorad.shm.segment import new_instance

from lorad.errors import BadRequest

WARMUP = 2
FLAG_REPS = 200
FLAG_TOKENS = (16, 512)


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


class InvokeBench:
    """The exchange, its echo worker, base weights and staging buffers on `device`; close() ends them."""

    def __init__(self, device: torch.device, max_tokens: int, hidden: int, layers: int):
        self.device, self.hidden, self.layers = device, hidden, layers
        self.dtype = model_dtype(device)
        config = ExchangeConfig(workers=1, max_tokens=max_tokens, hidden=hidden, max_out=hidden)
        self.exchange = Exchange.create(new_instance(), config)
        self.worker = self.mapping = None
        try:
            fused = device.type == "cuda" and cuda_ext.available()
            self.mapping = cuda_ext.register_host(self.exchange.segment.buffer) if fused else None
            buffer, layout = self.exchange.segment.buffer, self.exchange.layout
            self.job_flags = np.ndarray((1,), np.int64, buffer=buffer, offset=layout.job_line(0) + JOB_SEQ * 8)
            self.done_flags = np.ndarray((1,), np.int64, buffer=buffer, offset=layout.worker_line(0) + DONE_SEQ * 8)
            self.exchange.output[:] = np.random.randn(*self.exchange.output.shape).astype(np.float32) * 1e-3
            self.weights = [torch.randn(hidden, hidden, device=device, dtype=self.dtype) / hidden**0.5 for _ in range(4)]
            self.staged = torch.empty(max_tokens, hidden, device=device)
            self.error = torch.zeros(1, dtype=torch.int64, device=device)
            self.seq = 0
            context = multiprocessing.get_context("forkserver")
            self.worker = context.Process(target=echo_worker, args=(self.exchange.name, max(os.sched_getaffinity(0))),
                                          name="lorad-bench-echo", daemon=True)
            self.worker.start()
            deadline = time.monotonic() + 60
            while self.exchange.slots[0].pid != self.worker.pid:
                if self.worker.exitcode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the echo worker did not start (exit code {self.worker.exitcode})")
                time.sleep(1e-3)
        except BaseException:
            self.close()
            raise

    def _ops(self, mode: str):
        if mode == "fused":
            return cuda_ext.fused_copy_and_signal, cuda_ext.fused_wait_and_add
        return cuda_ext.python_copy_and_signal, cuda_ext.python_wait_and_add

    def prefill(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        tokens = x.shape[0]
        inputs = torch.from_numpy(self.exchange.input)[:tokens]  # rows are exactly hidden wide (run() checks)
        results = torch.from_numpy(self.exchange.output)[:tokens, : self.hidden]
        copy, add = self._ops(mode)
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
        xs = [torch.randn(tokens, self.hidden, device=self.device, dtype=self.dtype) for _ in range(4)]
        times = []
        for rep in range(reps + WARMUP):
            sync(self.device)
            start = time.perf_counter()
            self.prefill(xs[rep % len(xs)], mode)
            sync(self.device)
            if rep >= WARMUP:
                times.append((time.perf_counter() - start) * 1e3)
        if int(self.error):
            raise RuntimeError(f"a wait for the echo worker timed out (seq {int(self.error)})")
        return times

    def flag_latency_us(self, tokens: int, mode: str, reps: int) -> list[float]:
        """Launch copy+signal on an idle stream, spin on the host until the worker's done flag."""
        inputs = torch.from_numpy(self.exchange.input)[:tokens]  # rows are exactly hidden wide (run() checks)
        staged = self.staged[:tokens].normal_()
        copy, _ = self._ops(mode)
        done = Flag(self.exchange.segment.buffer, self.exchange.layout.worker_line(0) + DONE_SEQ * 8)
        times = []
        for rep in range(reps + 5):
            sync(self.device)
            self.seq += 1
            start = time.perf_counter()
            copy(inputs, staged, self.job_flags, self.seq)
            while done.load() < self.seq:
                pass
            if rep >= 5:
                times.append((time.perf_counter() - start) * 1e6)
        return times

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker.join(5)
            self.worker = None
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None


def run(args) -> dict:
    device = resolve_device(args.device)
    tokens_list = args.tokens or ((16, 128, 512, 2048) if device.type == "cuda" else (4, 16, 64))
    hidden = args.hidden or (4096 if device.type == "cuda" else 256)
    layers = args.layers or (32 if device.type == "cuda" else 4)
    if hidden % 16:
        raise BadRequest(f"--hidden must be a multiple of 16 (whole 64-byte exchange rows), not {hidden}")
    fused = device.type == "cuda" and cuda_ext.available()
    modes = ["base", "native"] + (["fused"] if fused else [])
    path_note = cuda_ext.invocation_path() if device.type == "cuda" else "cpu: the python path (no fused op without CUDA)"
    print(f"invocation path: {path_note}")
    if args.require_fused and not fused:
        raise BadRequest(f"--require-fused: the fused path is not usable: {path_note}")
    bench = InvokeBench(device, max(max(tokens_list), max(FLAG_TOKENS)), hidden, layers)
    rows = []
    try:
        for tokens in tokens_list:
            for mode in modes:
                rows.append({"what": "prefill_ms", "tokens": tokens, "mode": mode,
                             **summary(bench.time_prefill(tokens, mode, args.reps))})
        for tokens in FLAG_TOKENS:
            for mode in modes[1:]:
                rows.append({"what": "flag_latency_us", "tokens": tokens, "mode": mode,
                             **summary(bench.flag_latency_us(tokens, mode, FLAG_REPS))})
    finally:
        bench.close()
    report = {
        "version": 1, "kind": "bench-invoke", "command": args.command_line, "machine": machine(device),
        "config": {"hidden": hidden, "layers": layers, "reps": args.reps, "tokens": list(tokens_list),
                   "dtype": str(model_dtype(device)).removeprefix("torch."), "invocation_path": path_note,
                   "modes": modes},
        "rows": rows,
        "notes": ["prefill_ms: host wall clock of a prefill of `layers` layers, each invoking the (echo) CPU worker once",
                  "flag_latency_us: from launching copy+signal on an idle stream until the host sees the done flag"],
    }
    table_rows = []
    for what in ("prefill_ms", "flag_latency_us"):
        for tokens in dict.fromkeys(r["tokens"] for r in rows if r["what"] == what):
            cells = {r["mode"]: r for r in rows if r["what"] == what and r["tokens"] == tokens}
            base = cells.get("base")
            row = [what, tokens] + [cells[m]["median"] if m in cells else None for m in ("base", "native", "fused")]
            overhead = [(cells[m]["median"] - base["median"]) if base and m in cells else None for m in ("native", "fused")]
            table_rows.append(row + overhead)
    print(markdown_table(["what", "tokens", "base", "native", "fused", "native - base", "fused - base"], table_rows))
    finish(args.out, report, lambda plt: _plot(plt, rows, modes))
    return report


def _plot(plt, rows: list[dict], modes: list[str]):
    figure, axis = plt.subplots(figsize=(6.5, 4))
    prefill = [r for r in rows if r["what"] == "prefill_ms"]
    tokens = list(dict.fromkeys(r["tokens"] for r in prefill))
    width = 0.8 / len(modes)
    for index, mode in enumerate(modes):
        values = [next(r["median"] for r in prefill if r["tokens"] == t and r["mode"] == mode) for t in tokens]
        axis.bar(np.arange(len(tokens)) + index * width, values, width, label=mode)
    axis.set_xticks(np.arange(len(tokens)) + width * (len(modes) - 1) / 2, [str(t) for t in tokens])
    axis.set_xlabel("prompt tokens")
    axis.set_ylabel("prefill latency (ms)")
    axis.set_title("CPU LoRA invocation: fused vs native")
    axis.legend()
    axis.grid(alpha=0.3, axis="y")
    return figure
