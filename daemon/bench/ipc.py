"""`lorad bench ipc`: the round trip of one layer invocation of CPU LoRA (CaraServe Fig. 17), through
lorad's shared memory (shm/exchange.py + cpu_lora/worker.py's WorkerPool: activations written into the
exchange, one job posted per worker, done flags awaited, results read back) against a Unix domain
socket baseline (the same rows sent to each worker as a message, its result sent back), by the number
of receiving workers.

Each worker gets `tokens` token rows and a LoRA of rank `rank` (default 1): the compute is kept tiny, so
the times are the invocation's cost. Host wall clock per round trip; median and p99 over `reps`.

The shared-memory rows run the pool hot, as the engine does during a cold start (`WorkerPool.poll_hot_for`
before each invocation: workers and the host busy-poll); `us_cold` beside them is the same round trip
with the pool cold (idle workers sleep between polls, so each job waits for a wake-up).

Those rows are the python invocation path (the host copies x in, posts, waits, copies the result out):
the CPU engine's, and the fallback. On a GPU host with the CUDA extension the engine takes the fused
path instead (daemon/engine/cpu_assist.py): one `copy_and_signal` kernel writes the span's rows of x from
device memory into the exchange and raises every worker's job flag, each to that worker's own seq,
then one `wait_and_add` kernel waits for every done flag and adds the results into the device output;
the host only enqueues. The `shm-fused` rows time that round trip on the device (CUDA events from the
copy to the add), the host's enqueueing beside it (`host_us`); the device first idles for LEAD_S so
that the host has enqueued everything before the copy starts, as in a forward where the host runs
ahead. `shm-fused-per-worker`: a launch pair per worker (the engine's path before, and its fallback
for spans one launch cannot serve). `shm-fused-no-worker`: the same two kernels with every done flag
raised before the launch and no worker behind them, so the wait passes at its first poll: the
device's own share of the round trip (the rows both ways over PCIe, the flags, the launches), which
the shm-fused rows less this one leave to the workers.

The workers run as the engine's do: a hot worker polls in its native loop (cpu_lora/csrc/native_loop.cpp)
and serves these small jobs there. `shm-python-loop` and `shm-fused-python-loop` are the same round
trips with the workers' Python loop only (`WorkerPool(native_loop=False)`), measured in the same run.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from lorad.cpu_lora.native_loop import worker_loop_path
from lorad.daemon.bench.report import (
    finish,
    machine,
    markdown_table,
    resolve_device,
    summary,
)

from lorad.errors import BadRequest

HEADER = struct.Struct("<5q")  # seq, rows, in_features, out_features, stop
TARGET_MEDIAN_US = 50.0  # CaraServe's figure on its machine; the H100 host's goal at 8 workers
ACCEPT_TIMEOUT_S = 60.0
HOT_S = 0.05  # hot period set before each round trip
LEAD_S = 1e-3  # fused rows: the device idles this long before the timed round trip (the host enqueues meanwhile)


def run(args) -> dict:
    if args.tokens < 1 or args.rank < 1:
        raise BadRequest("--tokens and --rank must be at least 1")
    device = resolve_device(args.device)
    cores = sorted(os.sched_getaffinity(0))
    worker_counts = args.workers or tuple(n for n in (1, 2, 4, 8) if n <= max(1, len(cores) - 1)) or (1,)
    hidden = args.hidden or (4096 if device.type == "cuda" else 256)
    reps = args.reps or (2000 if device.type == "cuda" else 200)
    warmup = max(10, reps // 20)
    rows, notes = [], []
    fused_note = _fused_unavailable(device)
    if fused_note is not None:
        notes.append(f"no shm-fused rows: {fused_note}")
    for workers in worker_counts:
        if workers + 1 > len(cores):
            notes.append(f"{workers} workers and the engine share {len(cores)} usable cores: oversubscribed")
        tokens = workers * args.tokens
        x = torch.randn(tokens, hidden)
        ranges = [(w * args.tokens, (w + 1) * args.tokens) for w in range(workers)]
        for method, native in (("shm", True), ("shm-python-loop", False)):
            shm_times, shm_cold_times, native_share = _shm_round_trips(workers, x, ranges, args.rank, hidden, reps, warmup,
                                                                       native_loop=native)
            rows.append({"method": method, "workers": workers, "tokens_per_worker": args.tokens,
                         "bytes_each_way": tokens * hidden * 4, "us": summary(shm_times),
                         "us_cold": summary(shm_cold_times), "native_share": native_share})
        socket_times = _socket_round_trips(workers, cores, x, ranges, args.rank, hidden, reps, warmup)
        if fused_note is None:
            for method, batched, native in (("shm-fused", True, True), ("shm-fused-python-loop", True, False),
                                            ("shm-fused-per-worker", False, True)):
                device_times, host_times, lead_misses, host_phases, native_share = _fused_round_trips(
                    workers, x, ranges, args.rank, hidden, reps, warmup, device, batched=batched, native_loop=native)
                rows.append({"method": method, "workers": workers, "tokens_per_worker": args.tokens,
                             "bytes_each_way": tokens * hidden * 4, "us": summary(device_times),
                             "host_us": summary(host_times), "host_phase_median_us": host_phases,
                             "lead_misses": lead_misses, "native_share": native_share})
            round_trips, copies, adds = _fused_no_worker(workers, x, hidden, reps, warmup, device)
            rows.append({"method": "shm-fused-no-worker", "workers": workers, "tokens_per_worker": args.tokens,
                         "bytes_each_way": tokens * hidden * 4, "us": summary(round_trips),
                         "copy_and_signal_us": summary(copies), "wait_and_add_us": summary(adds)})
        rows.append({"method": "unix-socket", "workers": workers, "tokens_per_worker": args.tokens,
                     "bytes_each_way": tokens * hidden * 4, "us": summary(socket_times)})
    report = {
        "version": 1, "kind": "bench-ipc", "command": args.command_line, "machine": machine(device),
        "config": {"hidden": hidden, "rank": args.rank, "tokens_per_worker": args.tokens, "reps": reps,
                   "warmup": warmup, "workers": list(worker_counts), "worker_loop": worker_loop_path()},
        "rows": rows,
        "target": f"median <= {TARGET_MEDIAN_US:.0f} us with 8 workers, flat in the number of workers (H100 host)",
        "notes": ["us: host wall clock of one round trip: x written, one job per worker, every result back",
                  ("shm us: the pool hot (heated before each round trip, as the engine does in a cold start); "
                   "us_cold: the pool cold (idle workers sleep between polls)"),
                  ("the workers hand hot polling and small jobs to their native loop where it is built (config "
                   "worker_loop); the *-python-loop rows are the same round trips with the workers' Python loop only "
                   "(WorkerPool(native_loop=False)); native_share: the share of the row's jobs the native loops served"),
                  ("shm-fused us: the engine's fused CUDA path (one copy_and_signal raising every worker's job flag "
                   "to its own seq, one wait_and_add on every done flag), device time from the copy to the add (CUDA "
                   "events), the pool hot; host_us: the host's enqueueing of those kernels and jobs; lead_misses: "
                   "round trips whose copy started before the host had enqueued all"),
                  ("shm-fused-per-worker: the same with a copy_and_signal and a wait_and_add per worker (the "
                   "engine's fallback, and its path before)"),
                  ("shm-fused-no-worker: the shm-fused kernels with the done flags raised before the launch and no "
                   "worker: the device's own share of the round trip; copy_and_signal_us and wait_and_add_us split "
                   "it (CUDA events between the kernels)"),
                  *notes],
    }
    print(markdown_table(
        ["workers", "shm hot median us", "shm hot p99 us", "shm cold median us", "shm cold p99 us",
         "socket median us", "socket p99 us", "socket / shm hot"],
        [[w, s["us"]["median"], s["us"]["p99"], s["us_cold"]["median"], s["us_cold"]["p99"], u["us"]["median"],
          u["us"]["p99"], u["us"]["median"] / s["us"]["median"]]
         for w in worker_counts
         for s in [next(r for r in rows if r["workers"] == w and r["method"] == "shm")]
         for u in [next(r for r in rows if r["workers"] == w and r["method"] == "unix-socket")]],
    ))
    fused_rows = [r for r in rows if r["method"] in ("shm-fused", "shm-fused-per-worker")]
    if fused_rows:
        print()
        print(markdown_table(
            ["method", "workers", "device median us", "p99 us", "host enqueue median us", "of it: jobs",
             "copy_and_signal launches", "wait_and_add launches", "lead misses"],
            [[r["method"], r["workers"], r["us"]["median"], r["us"]["p99"], r["host_us"]["median"], *r["host_phase_median_us"].values(),
              r["lead_misses"]] for r in fused_rows]))
    by_method = {(r["method"], r["workers"]): r for r in rows}
    loop_rows = [(r, by_method[(r["method"] + "-python-loop", r["workers"])]) for r in rows
                 if (r["method"] + "-python-loop", r["workers"]) in by_method]
    if loop_rows:
        print()
        print(markdown_table(
            ["method", "workers", "workers' native loop median us", "python loop median us", "python / native",
             "native share of jobs"],
            [[r["method"], r["workers"], r["us"]["median"], p["us"]["median"], p["us"]["median"] / r["us"]["median"],
              r["native_share"]] for r, p in loop_rows]))
    floor_rows = [r for r in rows if r["method"] == "shm-fused-no-worker"]
    if floor_rows:
        print()
        print(markdown_table(
            ["workers", "shm-fused device median us", "no worker: device median us", "of it: copy_and_signal us",
             "wait_and_add us", "left to the workers us"],
            [[r["workers"], fused["us"]["median"], r["us"]["median"], r["copy_and_signal_us"]["median"],
              r["wait_and_add_us"]["median"], fused["us"]["median"] - r["us"]["median"]]
             for r in floor_rows
             for fused in [next(f for f in rows if f["workers"] == r["workers"] and f["method"] == "shm-fused")]]))
    for note in notes:
        print(note)
    finish(args.out, report, lambda plt: _plot(plt, rows))
    return report


def _fused_unavailable(device: torch.device) -> str | None:
    """Why the fused rows cannot run here, or None."""
    if device.type != "cuda":
        return "not a cuda device"
    from lorad.gpu_ops import cuda_ext

    if not cuda_ext.available():
        return cuda_ext.invocation_path()
    return None


def _fused_round_trips(workers: int, x: torch.Tensor, ranges, rank: int, hidden: int, reps: int, warmup: int,
                       device: torch.device, batched: bool = False,
                       native_loop: bool = True) -> tuple[list[float], list[float], int, dict, float]:
    """The engine's fused path (CpuAssist._apply_fused, a token split), all on the current stream. batched
    (the engine's): a job enqueued per worker, one copy_and_signal of every worker's rows raising each job
    flag to its worker's seq, then one wait_and_add on every done flag: two kernels in all. Else a
    copy_and_signal of its rows per worker and, after every copy, a wait_and_add of its result per worker.
    native_loop: the workers' (WorkerPool's). -> (device round trips us, host enqueue us, round trips whose
    lead ran out, host phase medians, the share of the jobs the workers' native loops served)."""
    from lorad.cpu_lora.worker import WorkerPool
    from lorad.gpu_ops import cuda_ext
    from lorad.shm.exchange import DONE_SEQ, IN_FLOAT32, JOB_SEQ, Job
    from lorad.shm.segment import new_instance
    from lorad.shm.store import AdapterStore

    tokens = x.shape[0]
    a, b = torch.randn(rank, hidden) * hidden**-0.5, torch.randn(hidden, rank)
    probe = SimpleNamespace(name="bench-ipc-fused", weights={(0, 0): (a, b)})
    instance = new_instance()
    x_device = x.to(device)
    y = torch.zeros(tokens, hidden, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    lead_cycles = int(LEAD_S * torch.cuda.get_device_properties(device).clock_rate * 1e3)  # clock_rate: kHz
    device_times, host_times, misses = [], [], 0
    phases = {"enqueue": [], "copy_and_signal": [], "wait_and_add": []}  # host us per round trip, all workers
    with AdapterStore.create(instance, 2 * rank * hidden * 4 + (1 << 16)) as store:
        adapter_id = store.put(probe)
        with WorkerPool(workers, store, tokens, hidden, hidden, instance=instance, native_loop=native_loop) as pool:
            exchange = pool.exchange
            buffer, layout = exchange.segment.buffer, exchange.layout
            job_flags = [np.ndarray((1,), np.int64, buffer, layout.job_line(w) + JOB_SEQ * 8) for w in range(workers)]
            done_flags = [np.ndarray((1,), np.int64, buffer, layout.worker_line(w) + DONE_SEQ * 8) for w in range(workers)]
            outputs = torch.from_numpy(pool.output)
            error = torch.from_numpy(exchange.error_word)
            inputs = [torch.from_numpy(exchange.input_rows(lo, hi, hidden, 4)).view(torch.float32) for lo, hi in ranges]
            mapping = cuda_ext.register_host(buffer)
            try:  # the timed loops launch as the engine does (CpuAssist._apply_fused: a FusedLauncher)
                launcher = cuda_ext.FusedLauncher(mapping, error)
                job_device = [launcher.flags(flags) for flags in job_flags]
                done_device = [launcher.flags(flags) for flags in done_flags]
                all_jobs, all_done = launcher.flags(exchange.job_flags[:workers]), launcher.flags(exchange.done_flags[:workers])
                input_address, output_address = exchange.input_bytes.ctypes.data, pool.output.ctypes.data
                stride, row_bytes, timeout_ns = pool.output.shape[1], hidden * 4, 5 * 10**9
                for rep in range(warmup + reps):
                    pool.poll_hot_for(HOT_S)
                    torch.cuda._sleep(lead_cycles)
                    start.record()
                    began = time.perf_counter_ns()
                    pending, spent = [], [0, 0, 0]  # ns in enqueue, copy launches, wait launches
                    stream = torch.cuda.current_stream(device).cuda_stream
                    if batched:
                        t0 = time.perf_counter_ns()
                        seqs = [pool.enqueue(worker, Job(adapter_id, 0, 0, lo, hi, hidden, hidden, IN_FLOAT32))
                                for worker, (lo, hi) in enumerate(ranges)]
                        if None in seqs:
                            raise RuntimeError(f"a worker's job ring stayed full: {seqs}")
                        t1 = time.perf_counter_ns()
                        launcher.copy_and_signal(input_address, x_device, all_jobs, seqs, stream)
                        t2 = time.perf_counter_ns()
                        launcher.wait_and_add(y, output_address, stride, all_done, seqs, timeout_ns, stream, skip_if_error=True)
                        spent = [t1 - t0, t2 - t1, time.perf_counter_ns() - t2]
                        ranges_now = ()
                    else:
                        ranges_now = ranges
                    for worker, (lo, hi) in enumerate(ranges_now):
                        t0 = time.perf_counter_ns()
                        seq = pool.enqueue(worker, Job(adapter_id, 0, 0, lo, hi, hidden, hidden, IN_FLOAT32))
                        if seq is None:
                            raise RuntimeError(f"worker {worker}'s job ring stayed full")
                        t1 = time.perf_counter_ns()
                        launcher.copy_and_signal(input_address + lo * row_bytes, x_device[lo:hi], job_device[worker], seq,
                                                 stream)
                        spent[0] += t1 - t0
                        spent[1] += time.perf_counter_ns() - t1
                        pending.append((worker, seq, lo, hi))
                    t0 = time.perf_counter_ns()
                    for worker, seq, lo, hi in pending:
                        launcher.wait_and_add(y[lo:hi], output_address + lo * stride * 4, stride, done_device[worker], seq,
                                              timeout_ns, stream, skip_if_error=True)
                    spent[2] += time.perf_counter_ns() - t0
                    end.record()
                    enqueued = (time.perf_counter_ns() - began) / 1e3
                    missed = start.query()  # the device reached the first copy before the host was done
                    end.synchronize()
                    failed = pool.settle()  # as the engine does after a step's sync
                    if int(error[0]) or failed:
                        raise RuntimeError(f"fused round trip {rep}: a wait timed out (seq {int(error[0])}) or "
                                           f"workers {failed} failed")
                    if rep >= warmup:
                        device_times.append(start.elapsed_time(end) * 1e3)
                        host_times.append(enqueued)
                        for phase, ns in zip(phases, spent):
                            phases[phase].append(ns / 1e3)
                        misses += bool(missed)
                pool.stop_hot_polling()
                native_share = pool.native_jobs / ((warmup + reps) * workers)
                expected = x @ a.t() @ b.t()
                # every timed round trip added its rows into y: all of them were right, not just the last
                drift = (y.cpu() - (warmup + reps) * expected).norm() / ((warmup + reps) * expected).norm()
                if not drift < 2e-4:  # one round trip of 2000 missing would be 5e-4; fp32 sums stay far below
                    raise RuntimeError(f"the timed fused round trips added wrong results (relative error {drift:.2e})")
                y.zero_()  # one more round trip, through the general functions, checked
                for worker, (lo, hi) in enumerate(ranges):
                    seq = pool.enqueue(worker, Job(adapter_id, 0, 0, lo, hi, hidden, hidden, IN_FLOAT32))
                    cuda_ext.fused_copy_and_signal(inputs[worker], x_device[lo:hi], job_flags[worker], seq)
                    cuda_ext.fused_wait_and_add(y[lo:hi], outputs[lo:hi, :hidden], done_flags[worker], seq, error, 5.0,
                                                skip_if_error=True)
                torch.cuda.synchronize(device)
                if not torch.allclose(y.cpu(), expected, rtol=1e-3, atol=1e-3):
                    raise RuntimeError("the fused round trip returned a wrong result")
            finally:
                torch.cuda.synchronize(device)
                del inputs, outputs, error, job_flags, done_flags
                mapping.close()
    phase_medians = {phase: summary(values)["median"] for phase, values in phases.items()}
    return device_times, host_times, misses, phase_medians, native_share


def _fused_no_worker(workers: int, x: torch.Tensor, hidden: int, reps: int, warmup: int,
                     device: torch.device) -> tuple[list[float], list[float], list[float]]:
    """The shm-fused rows' two kernels over an exchange with no worker: the done flags are raised before
    each launch, so wait_and_add passes at its first poll. -> device us per round trip, of the copy, of
    the wait and add (CUDA events). Checks that the copy raised the job flags and the add added the rows."""
    from lorad.gpu_ops import cuda_ext
    from lorad.shm.exchange import Exchange, ExchangeConfig
    from lorad.shm.segment import new_instance

    tokens = x.shape[0]
    x_device = x.to(device)
    y = torch.zeros(tokens, hidden, device=device)
    lead_cycles = int(LEAD_S * torch.cuda.get_device_properties(device).clock_rate * 1e3)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    round_trips, copies, adds = [], [], []
    with Exchange.create(new_instance(), ExchangeConfig(workers, tokens, hidden, hidden)) as exchange:
        error = torch.from_numpy(exchange.error_word)
        results = exchange.output[:tokens, :hidden]
        results[:] = np.random.default_rng(0).standard_normal((tokens, hidden))
        mapping = cuda_ext.register_host(exchange.segment.buffer)
        try:
            launcher = cuda_ext.FusedLauncher(mapping, error)
            jobs, done = launcher.flags(exchange.job_flags[:workers]), launcher.flags(exchange.done_flags[:workers])
            input_address, output_address = exchange.input_bytes.ctypes.data, exchange.output.ctypes.data
            stride = exchange.output.shape[1]
            stream = torch.cuda.current_stream(device).cuda_stream
            total = warmup + reps
            for rep in range(total):
                seqs = [rep + 1] * workers
                exchange.done_flags[:workers] = rep + 1  # as if every worker had answered already
                torch.cuda._sleep(lead_cycles)
                events[0].record()
                launcher.copy_and_signal(input_address, x_device, jobs, seqs, stream)
                events[1].record()
                launcher.wait_and_add(y, output_address, stride, done, seqs, 5 * 10**9, stream, skip_if_error=True)
                events[2].record()
                events[2].synchronize()
                if int(error[0]):
                    raise RuntimeError(f"no-worker round trip {rep}: the wait timed out")
                if rep >= warmup:
                    round_trips.append(events[0].elapsed_time(events[2]) * 1e3)
                    copies.append(events[0].elapsed_time(events[1]) * 1e3)
                    adds.append(events[1].elapsed_time(events[2]) * 1e3)
            if not (exchange.job_flags[:workers] == total).all():
                raise RuntimeError("copy_and_signal did not raise the job flags")
            rows_in = torch.from_numpy(exchange.input_rows(0, tokens, hidden).view(np.float32).copy())
            if not torch.equal(rows_in, x) or not torch.allclose(
                    y.cpu(), total * torch.from_numpy(results.copy()), rtol=1e-3, atol=1e-2):
                raise RuntimeError("the no-worker round trip moved the wrong rows")
        finally:
            torch.cuda.synchronize(device)
            del error, results
            mapping.close()
    return round_trips, copies, adds


def _shm_round_trips(workers: int, x: torch.Tensor, ranges, rank: int, hidden: int, reps: int,
                     warmup: int, native_loop: bool = True) -> tuple[list[float], list[float], float]:
    """lorad's path: a WorkerPool over the exchange segment, a rank-`rank` adapter in the shared store;
    per round trip x goes in, one job per worker, the results come out (checked once at the end).
    native_loop: the workers' (WorkerPool's). -> (round trips with the pool hot, round trips with it cold, the
    share of the hot round trips' jobs the workers' native loops served)."""
    from lorad.cpu_lora.worker import WorkerPool
    from lorad.shm.segment import new_instance
    from lorad.shm.store import AdapterStore

    tokens = x.shape[0]
    a, b = torch.randn(rank, hidden) * hidden**-0.5, torch.randn(hidden, rank)
    probe = SimpleNamespace(name="bench-ipc", weights={(0, 0): (a, b)})  # one module: layer 0, q_proj
    out = torch.empty(tokens, hidden)
    instance = new_instance()
    with AdapterStore.create(instance, 2 * rank * hidden * 4 + (1 << 16)) as store:
        adapter_id = store.put(probe)
        with WorkerPool(workers, store, tokens, hidden, hidden, instance=instance, native_loop=native_loop) as pool:
            output = torch.from_numpy(pool.output)

            def round_trip():
                failed = pool.run(adapter_id, 0, 0, ranges, hidden, hidden, x=x)
                out.copy_(output[:tokens, :hidden])
                return failed

            def hot_round_trip():
                pool.poll_hot_for(HOT_S)  # what CpuAssist does before each invocation
                return round_trip()

            cold = _time_us(round_trip, reps, warmup)
            before = pool.native_jobs  # a cold pool's jobs are the Python loop's
            times = _time_us(hot_round_trip, reps, warmup)
            native_share = (pool.native_jobs - before) / ((warmup + reps) * workers)
            pool.stop_hot_polling()
            output = None  # drop the view, so that closing the pool unmaps the exchange
    if not torch.allclose(out, x @ a.t() @ b.t(), rtol=1e-3, atol=1e-3):
        raise RuntimeError("the shared-memory workers returned a wrong result")
    return times, cold, native_share


def _time_us(round_trip, reps: int, warmup: int) -> list[float]:
    times = []
    for rep in range(warmup + reps):
        start = time.perf_counter_ns()
        failed = round_trip()
        elapsed = (time.perf_counter_ns() - start) / 1e3
        if failed:
            raise RuntimeError(f"round trip {rep} failed: {failed}")
        if rep >= warmup:
            times.append(elapsed)
    return times


# ---- the Unix domain socket baseline -------------------------------------------------------------------


def socket_worker(path: str, index: int, core: int, rank: int, hidden: int, seed: int) -> None:
    """Receive (header, rows of x), answer (header, x @ A^T @ B^T), until a stop header."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(rank, hidden, generator=generator) * hidden**-0.5
    b_t = torch.randn(rank, hidden, generator=generator)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    connection.sendall(struct.pack("<q", index))
    buffer = bytearray(0)
    try:
        while True:
            seq, rows, in_features, out_features, stop = HEADER.unpack(_receive(connection, HEADER.size))
            if stop:
                break
            if len(buffer) < rows * in_features * 4:
                buffer = bytearray(rows * in_features * 4)
            view = memoryview(buffer)[: rows * in_features * 4]
            _receive_into(connection, view)
            x = torch.frombuffer(view, dtype=torch.float32).view(rows, in_features)
            result = (x @ a.t()) @ b_t[:, :out_features]
            connection.sendall(HEADER.pack(seq, rows, in_features, out_features, 0))
            connection.sendall(result.numpy().data)
    finally:
        connection.close()


def _socket_round_trips(workers: int, cores: list[int], x: torch.Tensor, ranges, rank: int, hidden: int,
                        reps: int, warmup: int) -> list[float]:
    """Start `workers` socket workers (pinned as the WorkerPool pins), time `reps` round trips, stop them."""
    context = multiprocessing.get_context("forkserver")
    directory = tempfile.mkdtemp(prefix="lorad-ipc-")
    path = str(Path(directory) / "ipc.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.settimeout(ACCEPT_TIMEOUT_S)
    processes, connections = [], [None] * workers
    try:
        listener.bind(path)
        listener.listen(workers)
        for index in range(workers):
            process = context.Process(target=socket_worker, args=(path, index, cores[index % len(cores)], rank, hidden, index),
                                      name=f"lorad-bench-socket-{index}", daemon=True)
            process.start()
            processes.append(process)
        for _ in range(workers):
            connection, _ = listener.accept()
            connection.settimeout(None)
            (index,) = struct.unpack("<q", _receive(connection, 8))
            connections[index] = connection
        x_np = x.numpy()
        results = np.empty((x.shape[0], hidden), dtype=np.float32)
        seq = 0

        def round_trip():
            nonlocal seq
            seq += 1
            for connection, (start, end) in zip(connections, ranges):
                connection.sendall(HEADER.pack(seq, end - start, hidden, hidden, 0))
                connection.sendall(x_np[start:end].data)
            for connection, (start, end) in zip(connections, ranges):
                answer = HEADER.unpack(_receive(connection, HEADER.size))
                if answer[0] != seq:
                    return [f"worker answered seq {answer[0]}, expected {seq}"]
                _receive_into(connection, memoryview(results[start:end]).cast("B"))
            return []

        return _time_us(round_trip, reps, warmup)
    finally:
        for connection in connections:
            if connection is not None:
                try:
                    connection.sendall(HEADER.pack(0, 0, 0, 0, 1))
                except OSError:
                    pass
                connection.close()
        for process in processes:
            process.join(2)
            if process.exitcode is None:
                process.kill()
                process.join(5)
        listener.close()
        Path(path).unlink(missing_ok=True)
        os.rmdir(directory)


def _receive(connection: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    _receive_into(connection, memoryview(data))
    return bytes(data)


def _receive_into(connection: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        count = connection.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("a socket worker closed its connection")
        got += count


def _plot(plt, rows: list[dict]):
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for method, color in (("shm", "tab:blue"), ("shm-python-loop", "tab:cyan"), ("shm-fused", "tab:green"),
                          ("shm-fused-python-loop", "tab:red"), ("shm-fused-per-worker", "tab:olive"),
                          ("unix-socket", "tab:orange")):
        points = sorted((r["workers"], r["us"]["median"], r["us"]["p99"]) for r in rows if r["method"] == method)
        if not points:
            continue
        workers, median, p99 = zip(*points)
        axis.plot(workers, median, "o-", color=color, label=f"{method} median")
        axis.plot(workers, p99, "s--", color=color, alpha=0.6, label=f"{method} p99")
    axis.axhline(TARGET_MEDIAN_US, color="grey", linestyle=":", label=f"target median {TARGET_MEDIAN_US:.0f} us")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("receiving workers")
    axis.set_ylabel("round trip (us)")
    axis.set_title("CPU LoRA invocation round trip")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return figure
