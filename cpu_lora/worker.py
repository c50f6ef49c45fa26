"""CPU LoRA workers: one process per core computing `x @ A^T @ B^T` for a range of a prompt's tokens
while the adapter streams to the GPU (CaraServe's CPU-assisted prefill).

Two ways to share a prompt's LoRA among N workers (partition.py picks one from measured costs): a
token split, each worker on its own rows with all of A and B (CaraServe's), or a split group, every
worker on all the rows with a chunk of A's input columns and of B's output columns (shm/exchange.py
says how the parts meet: one barrier in shared memory between the shrink and the expand). A token
split has each of the N workers read the whole adapter; a split group reads it once in all, which
is what short prompts are bound by.

The engine writes a layer's activations into the exchange segment, posts a job per worker (adapter id,
layer, projection, token rows) and waits for the done flags; the workers read A and B^T straight from
the shared adapter store. Processes rather than threads: each is pinned to its own core and runs one
torch thread, and a crash costs one job, not the daemon. `WorkerPool` starts them, watches them
(process exit, job deadline, heartbeat), replaces the ones that die or stall, and reports their jobs
as failed so that the caller falls back to the GPU path; nothing waits forever.

While the pool is hot, a worker hands its polling to a native loop (csrc/native_loop.cpp, where it is
built). It serves the small jobs of modules this Python loop has already served, with no interpreter
work per job: up to the rows x rank where the worker's start-up timing found it no slower than torch.
It returns every other job here. `worker_loop_path()` says which loop the workers run.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time

import numpy as np
import torch
from lorad.cpu_lora.native_loop import IDLE, NativeServer, worker_loop_path
from lorad.shm.exchange import (
    ADAPTER,
    IN_BFLOAT16,
    IN_FLOAT16,
    IN_FLOAT32,
    INPUT_ITEMSIZE,
    SPLITS,
    STATUS_ERROR,
    STATUS_OK,
    STOP,
    Exchange,
    ExchangeConfig,
    Job,
    chunk,
)
from lorad.shm.flags import wait_all
from lorad.shm.segment import new_instance, pid_alive
from lorad.shm.store import AdapterStore

log = logging.getLogger(__name__)

PARENT_CHECK_S = 0.05  # how often an idle worker checks that the engine still lives


class _Orphaned(Exception):
    pass


@torch.inference_mode()  # no autograd bookkeeping per op: 0.6 of the 4.8 us a one-row job's two matmuls take
def worker_main(
    exchange_name: str,
    store_name: str,
    worker: int,
    core: int | None,
    start_seq: int,
    parent_pid: int,
    spin_s: float,
    max_pause_s: float,
    split_wait_s: float = 1.0,
    native_loop: bool = True,
    native_max_work: int | None = None,
    log_level: int | None = None,
) -> None:
    """The worker process: wait for job seq n > start_seq, compute its rows, publish done n; repeat.
    native_loop: hand the hot polling to the native loop where it is built (see the module's note), for
    jobs up to native_max_work rows x rank (None: measured here at start-up). log_level: the engine's,
    when it logs (a forkserver child inherits no handler): the worker's lines join the engine's stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    if log_level is not None and not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s worker_pid={os.getpid()} "
                                                      "%(message)s")
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    exchange = Exchange.attach(exchange_name)
    store = AdapterStore.attach(store_name)
    slot = exchange.slots[worker]
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
    seq = int(start_seq)
    runner = _JobRunner(exchange, store, worker, split_wait_s)
    job_flag, hot, fields_of, finish, run = slot.job_flag, exchange.hot, slot.fields, slot.finish, runner.run
    native = NativeServer.build(exchange, store, worker, native_max_work) if native_loop else None
    idle_ns = int(max_pause_s * 1e9)
    try:
        while True:
            if native is not None:
                seq, why = native.serve(seq, idle_ns)
                if why == IDLE:
                    idle()
                    continue
            slot.beat()
            # Hot (the engine has CPU-assisted work in flight or coming): poll, as CaraServe's pinned
            # workers do; cold: sleep, so that an idle daemon costs no cores.
            raised = job_flag.wait(seq + 1, timeout_s=None, spin_s=spin_s, max_pause_s=max_pause_s, on_pause=idle, hot=hot)
            # The flag may have jumped several jobs (a GPU enqueued them): serve them in order.
            while seq < raised:
                seq += 1
                fields = fields_of(seq)
                if fields is not None and fields[0] == STOP:
                    finish(seq, STATUS_OK)
                    return
                try:
                    if fields is None:
                        raise ValueError(f"ring entry of job seq={seq} holds another job")
                    run(fields)
                except Exception as error:  # a bad job fails alone; the worker keeps serving
                    log.warning("worker=%d seq=%d job=%s failed: %r", worker, seq, fields and Job(*fields), error)
                    finish(seq, STATUS_ERROR)
                else:
                    finish(seq, STATUS_OK)  # the result rows are written: status, then the done flag
                    if native is not None and fields[SPLITS - ADAPTER] == 1:  # a job of its own rows
                        native.learn(fields, runner.modules)
    except _Orphaned:
        log.warning("worker=%d parent_pid=%d gone, exiting", worker, parent_pid)
    finally:
        del runner, run, finish, fields_of, job_flag, hot, slot, native
        store.close()
        exchange.close()


_TORCH_INPUT = {IN_FLOAT32: torch.float32, IN_FLOAT16: torch.float16, IN_BFLOAT16: torch.bfloat16}
PLAN_LIMIT = 4096  # cached entries of each kind before a cache starts over


class _JobRunner:
    """A worker's jobs with the per-job Python work cached: the tensors a job reads and writes depend
    on its descriptor only, so they are built once per distinct rows (every projection of a step
    shares its token ranges), per module (validated against the store's current view at each job),
    and per (rows, rank) intermediate; a repeated job then builds no view and allocates nothing
    (half inputs are converted into a cached fp32 buffer). Output rows: `x @ A^T @ B^T` in fp32,
    x the job's compact input rows in their dtype."""

    def __init__(self, exchange: Exchange, store: AdapterStore, worker: int = 0, split_wait_s: float = 1.0):
        self.exchange, self.store = exchange, store
        self.worker, self.split_wait_s = worker, split_wait_s
        self.outputs = torch.from_numpy(exchange.output)
        config = exchange.config
        # Split groups: this worker's partial buffer and everyone's, flat [workers, max_tokens * max_rank]
        self.partials = torch.from_numpy(exchange.partials).view(config.workers, config.max_tokens * config.max_rank)
        self.phases, self.reads = exchange.phases, exchange.reads
        self.last_group, self.last_parts = 0, 0  # the split group this worker's partial buffer holds
        self.scratch = torch.empty(exchange.config.max_tokens * 64)  # x @ A^T; grown for larger ranks
        self.rows: dict[tuple, tuple] = {}  # (start, end, in, out, dtype) -> (x, fp32 staging or None, out)
        self.modules: dict[tuple, tuple] = {}  # (adapter, layer, proj) -> (A, A^T, B^T)
        self.middles: dict[tuple, torch.Tensor] = {}  # (rows, rank) -> view of scratch

    def run(self, fields: tuple) -> None:
        """output[rows, :out] = x @ A^T @ B^T for the job of descriptor `fields` (Job's fields); a
        split group's part: its chunk of the output columns."""
        adapter_id, layer, proj, row_start, row_end, in_features, out_features, _, part, parts, group = fields
        a, b_t = self.store.lookup(adapter_id, layer, proj)
        module = self.modules.get((adapter_id, layer, proj))
        if module is None or module[0] is not a:
            module = self._module(adapter_id, layer, proj, a, b_t)
        if module[3] != in_features or module[4] != out_features:  # also checked per module: cached rows are shared
            raise ValueError(f"adapter module is {tuple(a.shape)} x {tuple(b_t.shape)}, job says {in_features} -> {out_features}")
        rows = self.rows.get(fields[3:8])
        if rows is None:
            rows = self._rows(Job(*fields), a, b_t)
        x, staging, out = rows
        middle = self.middles.get((row_end - row_start, a.shape[0]))
        if middle is None:
            middle = self._middle(row_end - row_start, a.shape[0])
        if parts > 1:
            self._run_part(module, x, staging, out, middle, row_end - row_start, in_features, out_features, part, parts, group)
            return
        if staging is not None:
            x = staging.copy_(x)  # the CPU computes in fp32 (faster than bf16 here, and exact for the add)
        torch.mm(x, module[1], out=middle)
        torch.mm(middle, module[2], out=out)

    def _run_part(self, module: tuple, x: torch.Tensor, staging, out: torch.Tensor, middle: torch.Tensor, rows: int,
                  in_features: int, out_features: int, part: int, parts: int, group: int) -> None:
        """Part `part` of split group `group` (see shm/exchange.py): shrink over this part's input
        columns into the partial buffer, meet the other parts, sum, expand this part's output columns.
        PHASE and READ are published even when the part fails, so the others never wait on it for
        long (the failed status voids the group's result for the engine)."""
        rank = module[1].shape[1]
        config = self.exchange.config
        if part != self.worker or not 1 < parts <= config.workers or group <= self.last_group:
            raise ValueError(f"split part {part}/{parts} of group {group} on worker {self.worker} (last group "
                             f"{self.last_group}): not this worker's, or out of order")
        try:
            if rank > config.max_rank:
                raise ValueError(f"rank {rank} exceeds the exchange's split rank {config.max_rank}")
            if self.last_parts:  # every part that summed this buffer's last partial has done so
                self._wait_for_parts(self.reads, self.last_parts, self.last_group, "read")
            k0, k1 = chunk(in_features, parts, part)
            n0, n1 = chunk(out_features, parts, part)
            partial = self.partials[part, : rows * rank].view(rows, rank)
            if k1 > k0:
                if staging is not None:  # only this part's columns go to fp32
                    x = staging[:, k0:k1].copy_(x[:, k0:k1])
                else:
                    x = x[:, k0:k1]
                torch.mm(x, module[1][k0:k1], out=partial)
            else:
                partial.zero_()
            self.phases[part] = group
            self._wait_for_parts(self.phases, parts, group, "partial")
            torch.sum(self.partials[:parts, : rows * rank], dim=0, out=middle.view(-1))
            self.reads[part] = group
            if n1 > n0:
                torch.mm(middle, module[2][:, n0:n1], out=out[:, n0:n1])
        finally:
            self.phases[part] = max(int(self.phases[part]), group)
            self.reads[part] = max(int(self.reads[part]), group)
            self.last_group, self.last_parts = group, parts

    def _wait_for_parts(self, cells: np.ndarray, parts: int, group: int, what: str) -> None:
        """Spin until cells[:parts] (PHASE or READ of workers 0..parts-1) all reach `group`; a part
        that has not after `split_wait_s` (its worker died or stalled) fails this one too."""
        view, polls, deadline = cells[:parts], 0, None
        while view.min() < group:
            polls += 1
            if polls > 64:  # ~100 us of spinning: give the core to whoever shares it (the part awaited?)
                os.sched_yield()
            if polls % 256 == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.split_wait_s
                elif now > deadline:
                    late = np.flatnonzero(view < group).tolist()
                    raise TimeoutError(f"split group {group}: workers {late} did not publish their {what} "
                                       f"within {self.split_wait_s} s")

    def _module(self, adapter_id: int, layer: int, proj: int, a: torch.Tensor, b_t: torch.Tensor) -> tuple:
        if len(self.modules) >= PLAN_LIMIT:
            self.modules.clear()
        module = self.modules[(adapter_id, layer, proj)] = (a, a.t(), b_t, a.shape[1], b_t.shape[1])
        return module

    def _rows(self, job: Job, a: torch.Tensor, b_t: torch.Tensor) -> tuple:
        _check_job(job, a, b_t, self.exchange.config)
        dtype = _TORCH_INPUT[job.in_dtype]
        raw = self.exchange.input_rows(job.row_start, job.row_end, job.in_features, INPUT_ITEMSIZE[job.in_dtype])
        x = torch.from_numpy(raw).view(dtype)  # [rows, in_features], no copy
        staging = None if dtype == torch.float32 else torch.empty(x.shape)
        if len(self.rows) >= PLAN_LIMIT:
            self.rows.clear()
        rows = self.rows[(job.row_start, job.row_end, job.in_features, job.out_features, job.in_dtype)] = (
            x, staging, self.outputs[job.row_start : job.row_end, : job.out_features])
        return rows

    def _middle(self, rows: int, rank: int) -> torch.Tensor:
        if self.scratch.numel() < rows * rank:
            self.scratch = torch.empty(rows * rank)
            self.middles.clear()  # their views are of the old buffer
        if len(self.middles) >= PLAN_LIMIT:
            self.middles.clear()
        middle = self.middles[(rows, rank)] = self.scratch[: rows * rank].view(rows, rank)
        return middle


def can_poll_hot(workers: int, worker_cores: list[int], caller_cores) -> bool:
    """Whether busy-polling gives every poller a core of its own: each worker its own core (pinned
    workers on distinct cores; unpinned, fewer workers than the caller's cores), and the caller's
    thread a core that no worker is pinned to."""
    if not worker_cores:
        return workers < len(caller_cores)
    return len(set(worker_cores)) == workers and bool(set(caller_cores) - set(worker_cores))


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
    worker is in flight at a time. `post` + `wait_posted` (what `run` uses) cost O(1) Python work
    whatever the number of workers: one vectorised write of the descriptors and one of the job
    flags, then one vectorised comparison of the done flags per poll; `submit` + `wait` do the same
    for one worker. A worker that exits is noticed within about `max_pause_s` of a
    wait; one that does not finish a job within `job_timeout_s`, or that stops its heartbeat while
    idle for `stall_s` (see `check()`), is killed; either way it is replaced (`restarts` counts them)
    and its job is reported as failed. One thread (the engine's step loop) drives a pool.

    Idle workers sleep between polls (up to `max_pause_s`), so a job posted to a sleeping worker
    waits for its wake-up. `poll_hot_for(seconds)` makes the workers and the pool's own waits busy-poll for a
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
        max_rank: int = 0,
        native_loop: bool = True,
        native_max_work: int | None = None,
    ):
        self.store = store
        self.native_loop, self.native_max_work = native_loop, native_max_work
        self._native_jobs_closed = 0
        self.cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
        self.job_timeout_s, self.stall_s, self.stop_timeout_s = job_timeout_s, stall_s, stop_timeout_s
        self.spin_s, self.max_pause_s = spin_s, max_pause_s
        self.restarts = 0
        pinned = [self.cores[worker % len(self.cores)] for worker in range(workers)] if self.cores else []
        self.hot_polling = can_poll_hot(workers, pinned, os.sched_getaffinity(0))
        if not self.hot_polling:
            log.info("workers=%d on cores %s, caller's cores %s: no core for each poller, so workers never "
                     "busy-poll (poll_hot_for() does nothing)", workers, pinned or "unpinned", sorted(os.sched_getaffinity(0)))
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Workers fork from a server that has imported torch once: a restart costs milliseconds.
            self._context.set_forkserver_preload([__name__])
        # A split group's parts wait for each other at most half a job's deadline, so that a part left
        # waiting on a dead one fails before the pool would kill it as stalled.
        self.split_wait_s = job_timeout_s / 2
        self._group = 0  # the last split group id handed out
        config = ExchangeConfig(workers=workers, max_tokens=max_tokens, hidden=hidden, max_out=max_out, max_rank=max_rank)
        self.exchange = Exchange.create(instance or new_instance(), config)
        self.input, self.output = self.exchange.input, self.exchange.output
        self._processes: list = [None] * workers
        self._seq = np.zeros(workers, dtype=np.int64)  # the last seq posted to each worker
        self._all_ok = [bytes(8 * count) for count in range(workers + 1)]  # `count` STATUS_OK words
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

    @property
    def worker_cores(self) -> list[int]:
        """The core each worker is pinned to (empty: none pinned)."""
        return [self.cores[worker % len(self.cores)] for worker in range(self.workers)] if self.cores else []

    @property
    def worker_loop(self) -> str:
        """"native" (the workers hand hot polling and small jobs to the native loop, each as far as its
        start-up measurement allows), or "python: <why not>"."""
        return worker_loop_path() if self.native_loop else "python: the pool was started with native_loop=False"

    @property
    def native_jobs(self) -> int:
        """Jobs the workers' native loops have served since the pool started (kept after `close`)."""
        exchange = self.exchange
        return self._native_jobs_closed if exchange is None else int(exchange.native_jobs.sum())

    @property
    def max_rank(self) -> int:
        """The widest rank a split group may have (0: the pool takes token splits only)."""
        return self.exchange.config.max_rank

    def next_group(self) -> int:
        """A new split group id, for jobs the caller enqueues itself (`enqueue`; `post` takes its own)."""
        self._group += 1
        return self._group

    def poll_hot_for(self, seconds: float) -> bool:
        """Workers and waits busy-poll for the next `seconds` (Exchange.poll_hot_for). Only when every worker
        and the engine's thread have a core of their own (`hot_polling`): pollers sharing a core take
        turns by the scheduler's time slice, milliseconds, far worse than sleeping. -> whether it heated."""
        if self.hot_polling:
            self.exchange.poll_hot_for(seconds)
        return self.hot_polling

    def stop_hot_polling(self) -> None:
        self.exchange.stop_hot_polling()

    def _start(self, worker: int) -> None:
        slot = self.exchange.slots[worker]
        slot.pid = 0
        core = self.cores[worker % len(self.cores)] if self.cores else None
        process = self._context.Process(
            target=worker_main,
            name=f"lorad-cpu-lora-{worker}",
            args=(self.exchange.name, self.store.name, worker, core, int(self._seq[worker]), os.getpid(),
                  self.spin_s, self.max_pause_s, self.split_wait_s, self.native_loop, self.native_max_work,
                  root.getEffectiveLevel() if (root := logging.getLogger()).handlers else None),
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
        # The old worker is gone, so the pool may write its line: close the failed job's books, and
        # release the parts of split groups handed out so far from waiting on it (their results are
        # void: this worker's part reports failure).
        self.exchange.slots[worker].finish(int(self._seq[worker]), STATUS_ERROR)
        self.exchange.phases[worker] = max(int(self.exchange.phases[worker]), self._group)
        self.exchange.reads[worker] = max(int(self.exchange.reads[worker]), self._group)
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
        seq = int(self._seq[worker]) + 1
        self._seq[worker] = seq
        slot.post(seq, job)
        return seq

    def post(self, adapter_id: int, layer: int, proj: int, row_starts: np.ndarray, row_ends: np.ndarray,
             in_features: int, out_features: int, in_dtype: int = IN_FLOAT32, split: bool = False) -> int:
        """Post one job to each of workers 0..n-1, n = len(row_starts): rows row_starts[w]:row_ends[w]
        (int64 arrays), the other fields shared (`adapter_id` may also be an array, one per job), the
        input rows written already. `split`: the n jobs are the parts of one split group (every row
        range the same; n >= 2, and the adapter's rank at most `max_rank`). O(1) Python work
        (`Exchange.post_batch`) unless the pool is cold, when the workers found dead are replaced
        first (as `submit`). Returns n, for `wait_posted`. One job goes the scalar way (`submit`),
        cheaper than numpy's per-call cost."""
        count = len(row_starts)
        if count > self.workers:
            raise ValueError(f"{count} jobs for {self.workers} workers")
        if split and (count < 2 or not self.max_rank):
            raise ValueError(f"a split group needs 2 workers or more and a pool with max_rank (count {count}, "
                             f"max_rank {self.max_rank})")
        if count == 1:
            adapter = adapter_id if np.ndim(adapter_id) == 0 else adapter_id[0]
            self.submit(0, Job(int(adapter), layer, proj, int(row_starts[0]), int(row_ends[0]), in_features,
                               out_features, in_dtype))
            return 1
        exchange = self.exchange
        if not exchange.is_hot:
            for worker in range(count):
                if self._processes[worker].exitcode is not None:
                    self._replace(worker, "found dead")
        seqs, done = self._seq[:count], exchange.done_flags[:count]
        if done.tobytes() != seqs.tobytes() and (done < seqs).any():
            busy = int(np.flatnonzero(done < seqs)[0])
            raise RuntimeError(f"worker {busy} is still on job seq={self._seq[busy]}: wait for it first")
        seqs += 1
        exchange.post_batch(seqs, adapter_id, layer, proj, row_starts, row_ends, in_features, out_features, in_dtype,
                            group=self.next_group() if split else 0)
        return count

    def wait_posted(self, count: int, timeout_s: float | None = None) -> list[int]:
        """Wait for the jobs `post` gave workers 0..count-1 (one vectorised look at their done flags
        per poll, `shm.flags.wait_all`). Returns the workers whose job failed: it reported an
        error, or the worker died (seen within about `max_pause_s`) or missed the deadline; those
        are replaced, the others keep waiting. Never waits past the deadline."""
        if count == 1:
            return [] if self.wait(0, int(self._seq[0]), timeout_s) else [0]
        exchange = self.exchange
        seqs, done = self._seq[:count], exchange.done_flags[:count]

        def replace_dead() -> None:
            for worker in range(count):
                if self._processes[worker].exitcode is not None and done[worker] < seqs[worker]:
                    self._replace(worker, f"died during job seq={seqs[worker]}")  # closes its job: done rises

        try:
            wait_all(done, seqs, timeout_s=self.job_timeout_s if timeout_s is None else timeout_s, spin_s=self.spin_s,
                     max_pause_s=self.max_pause_s, on_pause=replace_dead, hot=exchange.hot)
        except TimeoutError:
            for worker in np.flatnonzero(done < seqs).tolist():
                self._replace(worker, f"stalled on job seq={seqs[worker]}")
        statuses = exchange.statuses[:count]  # read after the done flags: each is its job's
        if statuses.tobytes() == self._all_ok[count]:
            return []
        return np.flatnonzero(statuses != STATUS_OK).tolist()

    def enqueue(self, worker: int, job: Job) -> int | None:
        """Describe `job` for `worker` without raising its job flag: a GPU kernel raises it later
        (cuda_ext.copy_and_signal), after the job's input rows. Returns the seq the kernel must store,
        assigned here, in the order the host enqueues (the order the device signals). Jobs of a whole
        forward may be outstanding; when the worker's ring is full the host waits (on shared memory,
        never on the device) for the oldest to finish, at most `job_timeout_s`: None then, and the
        caller stops posting for this step. Call `settle()` once the device work is done."""
        slot = self.exchange.slots[worker]
        seq = int(self._seq[worker]) + 1
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
                slot.job_flag.store(int(self._seq[worker]))
            if slot.done_flag.load() < self._seq[worker] or self._processes[worker].exitcode is not None:
                self.wait(worker, int(self._seq[worker]))  # replaces a dead or stalled worker
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
        worker each (at most `workers` ranges: pairs, or int64 [n, 2]); `x` ([T, in] fp32, optional) is
        copied into the compact input rows first (`Exchange.input_rows`). Returns the ranges that
        failed: the caller computes those another way."""
        if len(ranges) > self.workers:
            raise ValueError(f"{len(ranges)} ranges for {self.workers} workers")
        if x is not None:
            x = x.numpy() if isinstance(x, torch.Tensor) else x
            self.exchange.input_rows(0, x.shape[0], x.shape[1]).view(np.float32)[:] = x
        if len(ranges) == 1:  # no array to build
            (start, end), = ranges
            count = self.post(adapter_id, layer, proj, (start,), (end,), in_features, out_features)
        else:
            bounds = ranges if isinstance(ranges, np.ndarray) else np.array(ranges, dtype=np.int64).reshape(-1, 2)
            count = self.post(adapter_id, layer, proj, bounds[:, 0], bounds[:, 1], in_features, out_features)
        return [tuple(ranges[worker]) for worker in self.wait_posted(count)]

    def run_split(
        self,
        adapter_id: int,
        layer: int,
        proj: int,
        rows: tuple[int, int],
        parts: int,
        in_features: int,
        out_features: int,
        x: torch.Tensor | np.ndarray | None = None,
    ) -> bool:
        """`output[rows, :out] = x[rows] @ A^T @ B^T` by one split group over workers 0..parts-1 (see
        shm/exchange.py); `x` as in `run`. -> True when every part succeeded (else the rows' output is
        void: the caller computes them another way)."""
        if not 2 <= parts <= self.workers:
            raise ValueError(f"a split group over {parts} of {self.workers} workers")
        if x is not None:
            x = x.numpy() if isinstance(x, torch.Tensor) else x
            self.exchange.input_rows(0, x.shape[0], x.shape[1]).view(np.float32)[:] = x
        start, end = rows
        count = self.post(adapter_id, layer, proj, np.full(parts, start, dtype=np.int64),
                          np.full(parts, end, dtype=np.int64), in_features, out_features, split=True)
        return not self.wait_posted(count)

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
            self.exchange.slots[worker].post(int(self._seq[worker]), Job(STOP, 0, 0, 0, 0, 0, 0))
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
        self._native_jobs_closed = int(self.exchange.native_jobs.sum())
        self.exchange.close()
        self.exchange = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
