"""CPU LoRA workers: one process per core computing `x @ A^T @ B^T` for a range of a prompt's tokens
while the adapter streams to the GPU (CaraServe's CPU-assisted prefill).

The engine writes a layer's activations into the exchange segment, posts a job per worker (adapter id,
layer, projection, token rows) and waits for the done flags; the workers read A and B^T straight from
the shared adapter store. Processes rather than threads: each is pinned to its own core and runs one
torch thread, and a crash costs one job, not the daemon. `WorkerPool` starts them, watches them
(process exit, job deadline, heartbeat), replaces the ones that die or stall, and reports their jobs
as failed so that the caller falls back to the GPU path; nothing waits forever.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import numpy as np
import torch
from lorad.shm.exchange import (
    IN_BFLOAT16,
    IN_FLOAT16,
    IN_FLOAT32,
    INPUT_ITEMSIZE,
    STATUS_ERROR,
    STATUS_OK,
    STOP,
    Exchange,
    ExchangeConfig,
    Job,
)
from lorad.shm.segment import new_instance, pid_alive
from lorad.shm.store import AdapterStore

log = logging.getLogger(__name__)

PARENT_CHECK_S = 0.05  # how often an idle worker checks that the engine still lives


class _Orphaned(Exception):
    pass


def worker_main(
    exchange_name: str,
    store_name: str,
    worker: int,
    core: int | None,
    start_seq: int,
    parent_pid: int,
    spin_s: float,
    max_pause_s: float,
) -> None:
    """The worker process: wait for job seq n > start_seq, compute its rows, publish done n; repeat."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    exchange = Exchange.attach(exchange_name)
    store = AdapterStore.attach(store_name)
    slot = exchange.slots[worker]
    outputs = torch.from_numpy(exchange.output)
    scratch = torch.empty(exchange.config.max_tokens * 64)  # x @ A^T; grown for larger ranks
    next_parent_check = 0.0

    def idle() -> None:
        nonlocal next_parent_check
        slot.beat()
        now = time.monotonic()
        if now >= next_parent_check:
            next_parent_check = now + PARENT_CHECK_S
            if not pid_alive(parent_pid):
                raise _Orphaned

    slot.pid = os.getpid()
    seq = start_seq
    try:
        while True:
            slot.beat()
            # Hot (the engine has CPU-assisted work in flight or coming): poll, as CaraServe's pinned
            # workers do; cold: sleep, so that an idle daemon costs no cores.
            raised = slot.job_flag.wait(seq + 1, timeout_s=None, spin_s=spin_s, max_pause_s=max_pause_s, on_pause=idle,
                                        hot=exchange.hot)
            # The flag may have jumped several jobs (a GPU enqueued them): serve them in order.
            while seq < raised:
                seq += 1
                job = slot.take(seq)
                if job is not None and job.adapter_id == STOP:
                    slot.finish(seq, STATUS_OK)
                    return
                status = STATUS_OK
                try:
                    if job is None:
                        raise ValueError(f"ring entry of job seq={seq} holds another job")
                    scratch = _compute(job, exchange, store, outputs, scratch)
                except Exception as error:  # a bad job fails alone; the worker keeps serving
                    log.warning("worker=%d seq=%d job=%s failed: %r", worker, seq, job, error)
                    status = STATUS_ERROR
                slot.finish(seq, status)
    except _Orphaned:
        log.warning("worker=%d parent_pid=%d gone, exiting", worker, parent_pid)
    finally:
        del outputs, slot
        store.close()
        exchange.close()


_TORCH_INPUT = {IN_FLOAT32: torch.float32, IN_FLOAT16: torch.float16, IN_BFLOAT16: torch.bfloat16}


def _compute(job: Job, exchange: Exchange, store: AdapterStore, outputs: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """output[rows, :out] = x @ A^T @ B^T in fp32, x the job's compact input rows in their dtype.
    Returns the scratch buffer (grown when a job needs more)."""
    a, b_t = store.lookup(job.adapter_id, job.layer, job.proj)
    rank, rows = a.shape[0], job.row_end - job.row_start
    _check_job(job, a, b_t, exchange.config)
    dtype = _TORCH_INPUT[job.in_dtype]
    raw = exchange.input_rows(job.row_start, job.row_end, job.in_features, INPUT_ITEMSIZE[job.in_dtype])
    x = torch.from_numpy(raw).view(dtype)  # [rows, in_features], no copy
    if dtype != torch.float32:
        x = x.float()  # the CPU computes in fp32 (faster than bf16 here, and exact for the add)
    if scratch.numel() < rows * rank:
        scratch = torch.empty(rows * rank)
    shrunk = scratch[: rows * rank].view(rows, rank)
    torch.mm(x, a.t(), out=shrunk)
    torch.mm(shrunk, b_t, out=outputs[job.row_start : job.row_end, : job.out_features])
    return scratch


def _check_job(job: Job, a: torch.Tensor, b_t: torch.Tensor, config: ExchangeConfig) -> None:
    if a.shape[1] != job.in_features or b_t.shape[1] != job.out_features:
        raise ValueError(f"adapter module is {tuple(a.shape)} x {tuple(b_t.shape)}, job says {job.in_features} -> {job.out_features}")
    if not 0 <= job.row_start <= job.row_end <= config.max_tokens:
        raise ValueError(f"rows {job.row_start}:{job.row_end} outside 0:{config.max_tokens}")
    if job.in_dtype not in INPUT_ITEMSIZE:
        raise ValueError(f"unknown input dtype code {job.in_dtype}")
    if job.in_features > config.hidden or job.out_features > config.max_out:
        raise ValueError(f"{job.in_features} -> {job.out_features} exceeds the exchange's {config.hidden} -> {config.max_out}")


class WorkerPool:
    """`n` pinned CPU LoRA workers over one exchange segment (owned by the pool) and an adapter store
    (owned by the caller).

    Per layer and projection the engine writes `x` into `pool.input[:T, :in]` (or passes it to `run`),
    posts one job per token range (`partition.split`) and reads `pool.output[:T, :out]`. One job per
    worker is in flight at a time. A worker that exits is noticed within about `max_pause_s` of a
    wait; one that does not finish a job within `job_timeout_s`, or that stops its heartbeat while
    idle for `stall_s` (see `check()`), is killed; either way it is replaced (`restarts` counts them)
    and its job is reported as failed. One thread (the engine's step loop) drives a pool.

    Idle workers sleep between polls (up to `max_pause_s`), so a job posted to a sleeping worker
    waits for its wake-up. `heat(seconds)` makes the workers and the pool's own waits busy-poll for a
    bounded period: call it when CPU-assisted work is in flight or about to be.
    """

    def __init__(
        self,
        workers: int,
        store: AdapterStore,
        max_tokens: int,
        hidden: int,
        max_out: int,
        cores: list[int] | None = None,
        instance: str | None = None,
        job_timeout_s: float = 5.0,
        stall_s: float = 2.0,
        stop_timeout_s: float = 2.0,
        start_timeout_s: float = 60.0,
        spin_s: float = 50e-6,
        max_pause_s: float = 1e-3,
        start_method: str = "forkserver",
    ):
        self.store = store
        self.cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
        self.job_timeout_s, self.stall_s, self.stop_timeout_s = job_timeout_s, stall_s, stop_timeout_s
        self.spin_s, self.max_pause_s = spin_s, max_pause_s
        self.restarts = 0
        # Busy-polling needs a core per poller: the workers' and one for the engine's thread.
        self.hot_polling = workers < len(os.sched_getaffinity(0))
        if not self.hot_polling:
            log.info("workers=%d usable_cores=%d: no core left for the engine, so workers never busy-poll "
                     "(heat() does nothing)", workers, len(os.sched_getaffinity(0)))
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Workers fork from a server that has imported torch once: a restart costs milliseconds.
            self._context.set_forkserver_preload([__name__])
        config = ExchangeConfig(workers=workers, max_tokens=max_tokens, hidden=hidden, max_out=max_out)
        self.exchange = Exchange.create(instance or new_instance(), config)
        self.input, self.output = self.exchange.input, self.exchange.output
        self._processes: list = [None] * workers
        self._seq = [0] * workers
        self._beats = [(-1, time.monotonic())] * workers  # (heartbeat seen, when it last moved)
        try:
            for worker in range(workers):
                self._start(worker)
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> int:
        return len(self._processes)

    def heat(self, seconds: float) -> bool:
        """Workers and waits busy-poll for the next `seconds` (Exchange.heat). Only when every worker
        and the engine's thread have a core of their own (`hot_polling`): pollers sharing a core take
        turns by the scheduler's time slice, milliseconds, far worse than sleeping. -> whether it heated."""
        if self.hot_polling:
            self.exchange.heat(seconds)
        return self.hot_polling

    def cool(self) -> None:
        self.exchange.cool()

    def _start(self, worker: int) -> None:
        slot = self.exchange.slots[worker]
        slot.pid = 0
        core = self.cores[worker % len(self.cores)] if self.cores else None
        process = self._context.Process(
            target=worker_main,
            name=f"lorad-cpu-lora-{worker}",
            args=(self.exchange.name, self.store.name, worker, core, self._seq[worker], os.getpid(),
                  self.spin_s, self.max_pause_s),
            daemon=True,
        )
        process.start()
        self._processes[worker] = process
        self._beats[worker] = (-1, time.monotonic())
        log.info("worker=%d pid=%d core=%s started", worker, process.pid, core)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for worker, process in enumerate(self._processes):
            while self.exchange.slots[worker].pid != process.pid:
                if process.exitcode is not None:
                    raise RuntimeError(f"CPU LoRA worker {worker} exited at start-up (code {process.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CPU LoRA worker {worker} not ready after {timeout_s} s")
                time.sleep(1e-3)

    def _replace(self, worker: int, why: str) -> None:
        process = self._processes[worker]
        if process.exitcode is None:
            process.kill()
        process.join(5)
        self.restarts += 1
        log.warning("worker=%d pid=%d %s (exit code %s); restarting", worker, process.pid, why, process.exitcode)
        process.close()
        # The old worker is gone, so the pool may write its line: close the failed job's books.
        self.exchange.slots[worker].finish(self._seq[worker], STATUS_ERROR)
        self._start(worker)

    def submit(self, worker: int, job: Job) -> int:
        """Post `job` to `worker` (its input rows written already); returns the seq to `wait` for.
        A cold pool first replaces a worker found dead; a hot one skips that syscall (a few µs per job,
        serial over the workers) and lets `wait`'s liveness check catch a death instead."""
        if not self.exchange.is_hot and self._processes[worker].exitcode is not None:
            self._replace(worker, "found dead")
        slot = self.exchange.slots[worker]
        if slot.done_flag.load() < self._seq[worker]:
            raise RuntimeError(f"worker {worker} is still on job seq={self._seq[worker]}: wait for it first")
        self._seq[worker] += 1
        slot.post(self._seq[worker], job)
        return self._seq[worker]

    def enqueue(self, worker: int, job: Job) -> int | None:
        """Describe `job` for `worker` without raising its job flag: a GPU kernel raises it later
        (cuda_ext.copy_and_signal), after the job's input rows. Returns the seq the kernel must store,
        assigned here, in the order the host enqueues (the order the device signals). Jobs of a whole
        forward may be outstanding; when the worker's ring is full the host waits (on shared memory,
        never on the device) for the oldest to finish, at most `job_timeout_s`: None then, and the
        caller stops posting for this step. Call `settle()` once the device work is done."""
        slot = self.exchange.slots[worker]
        seq = self._seq[worker] + 1
        if not slot.free_for(seq):
            try:
                slot.done_flag.wait(seq - slot.ring, timeout_s=self.job_timeout_s, spin_s=self.spin_s,
                                    max_pause_s=self.max_pause_s, hot=self.exchange.hot)
            except TimeoutError:
                return None
        self._seq[worker] = seq
        slot.describe(seq, job)
        return seq

    def settle(self) -> list[int]:
        """After a step whose jobs the device signalled (its kernels have run: call after the step's
        sync): every worker has finished its jobs or has been replaced. Returns the workers with a job
        that failed since the last call (errors, deaths, stalls); the step's CPU results are then
        incomplete."""
        failed = []
        for worker, slot in enumerate(self.exchange.slots):
            if slot.job_flag.load() < self._seq[worker]:  # enqueued but never signalled (a step cut short)
                slot.job_flag.store(self._seq[worker])
            if slot.done_flag.load() < self._seq[worker] or self._processes[worker].exitcode is not None:
                self.wait(worker, self._seq[worker])  # replaces a dead or stalled worker
            if slot.take_failed():
                failed.append(worker)
        return failed

    def wait(self, worker: int, seq: int, timeout_s: float | None = None) -> bool:
        """True once `worker` has done job `seq`; False if it failed: the worker reported an error,
        or died or missed the deadline (then it is replaced). Never waits past the deadline."""
        slot, process = self.exchange.slots[worker], self._processes[worker]

        def alive() -> None:
            if process.exitcode is not None:
                raise ChildProcessError

        try:
            slot.done_flag.wait(
                seq, timeout_s=self.job_timeout_s if timeout_s is None else timeout_s,
                spin_s=self.spin_s, max_pause_s=self.max_pause_s, on_pause=alive, hot=self.exchange.hot,
            )
        except ChildProcessError:
            self._replace(worker, f"died during job seq={seq}")
            return False
        except TimeoutError:
            self._replace(worker, f"stalled on job seq={seq}")
            return False
        return slot.status == STATUS_OK

    def run(
        self,
        adapter_id: int,
        layer: int,
        proj: int,
        ranges: list[tuple[int, int]],
        in_features: int,
        out_features: int,
        x: torch.Tensor | np.ndarray | None = None,
    ) -> list[tuple[int, int]]:
        """Compute `output[rows, :out] = x[rows] @ A^T @ B^T` for every (start, end) in `ranges`, one
        worker each (at most `workers` ranges); `x` ([T, in] fp32, optional) is copied into the compact
        input rows first (`Exchange.input_rows`). Returns the ranges that failed: the caller computes those another way."""
        if len(ranges) > self.workers:
            raise ValueError(f"{len(ranges)} ranges for {self.workers} workers")
        if x is not None:
            x = x.numpy() if isinstance(x, torch.Tensor) else x
            self.exchange.input_rows(0, x.shape[0], x.shape[1]).view(np.float32)[:] = x
        posted = [
            (worker, start, end, self.submit(worker, Job(adapter_id, layer, proj, start, end, in_features, out_features)))
            for worker, (start, end) in enumerate(ranges)
        ]
        return [(start, end) for worker, start, end, seq in posted if not self.wait(worker, seq)]

    def check(self) -> int:
        """Housekeeping between jobs: replace workers that exited or whose heartbeat has not moved
        for `stall_s` while idle. Returns how many were replaced."""
        replaced, now = 0, time.monotonic()
        for worker, process in enumerate(self._processes):
            slot = self.exchange.slots[worker]
            if process.exitcode is not None:
                self._replace(worker, "found dead")
                replaced += 1
                continue
            beat, since = self._beats[worker]
            current = slot.heartbeat.load()
            busy = slot.done_flag.load() < self._seq[worker]
            if current != beat or busy or slot.pid != process.pid:
                self._beats[worker] = (current, now)  # moving, on a job, or still starting
            elif now - since > self.stall_s:
                self._replace(worker, f"heartbeat stalled for {now - since:.2f} s")
                replaced += 1
        return replaced

    def close(self) -> None:
        """Stop the workers (a stop job, then kill what does not exit), unlink the exchange."""
        if self.exchange is None:
            return
        running = [(worker, p) for worker, p in enumerate(self._processes) if p is not None and p.exitcode is None]
        for worker, _ in running:
            self._seq[worker] += 1
            self.exchange.slots[worker].post(self._seq[worker], Job(STOP, 0, 0, 0, 0, 0, 0))
        deadline = time.monotonic() + self.stop_timeout_s
        for _, process in running:
            process.join(max(deadline - time.monotonic(), 0.0))
            if process.exitcode is None:
                process.kill()
                process.join(5)
        for process in self._processes:
            if process is not None:
                process.close()
        self._processes = [None] * len(self._processes)
        self.input = self.output = None
        self.exchange.close()
        self.exchange = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
