"""Where the fused round trip of issue 5's figure 3 goes (`lorad bench ipc`'s shm-fused rows): the same two
kernels (one copy_and_signal of every worker's rows, one wait_and_add on every done flag) with no worker
behind them, so that what is left is the device's own cost of moving the rows both ways over PCIe.

Per worker count (one token of hidden 4096 each, fp32, as `lorad bench ipc`): the device time from the
copy's start to the add's end (CUDA events, the device idling 1 ms first so that the host has enqueued
both kernels), with every done flag already raised before the launch: the wait returns at its first poll.
Also the copy alone and the wait alone. Median and p90 over --reps, in us.

Then the python path's round trip (host wall clock; no GPU) with an 8-worker pool, the pool hot: one job
on worker w alone, for each w (does a worker's core make it slower?), and one job on every worker.

Usage: python3 bench/ipc_diag.py [--reps 2000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

HIDDEN = 4096
LEAD_S = 1e-3


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))]}


def floor(workers: int, reps: int) -> dict:
    from lorad.gpu_ops import cuda_ext
    from lorad.shm.exchange import Exchange, ExchangeConfig
    from lorad.shm.segment import new_instance

    device = torch.device("cuda")
    x = torch.randn(workers, HIDDEN, device=device)
    y = torch.zeros(workers, HIDDEN, device=device)
    lead_cycles = int(LEAD_S * torch.cuda.get_device_properties(device).clock_rate * 1e3)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    times = {"round_trip": [], "copy": [], "wait_and_add": []}
    with Exchange.create(new_instance(), ExchangeConfig(workers, workers, HIDDEN, HIDDEN)) as exchange:
        error = torch.from_numpy(exchange.error_word)
        mapping = cuda_ext.register_host(exchange.segment.buffer)
        try:
            launcher = cuda_ext.FusedLauncher(mapping, error)
            jobs = launcher.flags(exchange.job_flags[:workers])
            done = launcher.flags(exchange.done_flags[:workers])
            input_address, output_address = exchange.input_bytes.ctypes.data, exchange.output.ctypes.data
            stride = exchange.output.shape[1]
            stream = torch.cuda.current_stream(device).cuda_stream
            for rep in range(reps + 50):
                seqs = [rep + 1] * workers
                exchange.done_flags[:workers] = rep + 1  # the "workers" have answered already
                torch.cuda._sleep(lead_cycles)
                events[0].record()
                launcher.copy_and_signal(input_address, x, jobs, seqs, stream)
                events[1].record()
                launcher.wait_and_add(y, output_address, stride, done, seqs, 5 * 10**9, stream, skip_if_error=True)
                events[2].record()
                events[2].synchronize()
                if int(error[0]):
                    raise RuntimeError("a wait timed out")
                if rep >= 50:
                    times["round_trip"].append(events[0].elapsed_time(events[2]) * 1e3)
                    times["copy"].append(events[0].elapsed_time(events[1]) * 1e3)
                    times["wait_and_add"].append(events[1].elapsed_time(events[2]) * 1e3)
            if not np.array_equal(exchange.job_flags[:workers], np.full(workers, reps + 50)):
                raise RuntimeError("copy_and_signal did not raise the job flags")
        finally:
            torch.cuda.synchronize(device)
            del error
            mapping.close()
    return {name: _stats(values) for name, values in times.items()}


def per_worker_python(workers: int, reps: int, cores: list[int]) -> dict:
    from types import SimpleNamespace

    from lorad.cpu_lora.worker import WorkerPool
    from lorad.shm.exchange import Job
    from lorad.shm.segment import new_instance
    from lorad.shm.store import AdapterStore

    a, b = torch.randn(1, HIDDEN), torch.randn(HIDDEN, 1)
    probe = SimpleNamespace(name="ipc-diag", weights={(0, 0): (a, b)})
    instance = new_instance()
    report = {}
    with AdapterStore.create(instance, 2 * HIDDEN * 4 + (1 << 16)) as store:
        adapter_id = store.put(probe)
        with WorkerPool(workers, store, workers, HIDDEN, HIDDEN, cores=cores[:workers], instance=instance) as pool:
            pool.exchange.input[:workers, :HIDDEN] = np.random.default_rng(0).standard_normal((workers, HIDDEN))
            report["cores"] = pool.worker_cores
            for worker in range(workers):
                times = []
                for rep in range(reps + 50):
                    pool.heat(0.05)
                    start = time.perf_counter_ns()
                    seq = pool.submit(worker, Job(adapter_id, 0, 0, worker, worker + 1, HIDDEN, HIDDEN))
                    if not pool.wait(worker, seq):
                        raise RuntimeError(f"worker {worker} failed")
                    if rep >= 50:
                        times.append((time.perf_counter_ns() - start) / 1e3)
                report[f"worker {worker} alone"] = _stats(times)
            times = []
            ranges = [(w, w + 1) for w in range(workers)]
            for rep in range(reps + 50):
                pool.heat(0.05)
                start = time.perf_counter_ns()
                if pool.run(adapter_id, 0, 0, ranges, HIDDEN, HIDDEN):
                    raise RuntimeError("a job failed")
                if rep >= 50:
                    times.append((time.perf_counter_ns() - start) / 1e3)
            report["every worker"] = _stats(times)
            pool.cool()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {"hidden": HIDDEN, "tokens_per_worker": 1, "rows": []}
    for workers in (1, 2, 4, 8):
        row = {"workers": workers, "bytes_each_way": workers * HIDDEN * 4, **floor(workers, args.reps)}
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 8:  # as the engine: this thread keeps off the workers' cores (0..7)
        os.sched_setaffinity(0, cores[8:])
    report["python_path_8_workers"] = per_worker_python(8, args.reps, cores)
    print(json.dumps(report["python_path_8_workers"]), flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
