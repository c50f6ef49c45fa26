"""The engine <-> CPU LoRA worker exchange: one segment holding the prompt's activations, the LoRA
results and, per worker, a ring of job descriptors with two flags.

Activations and results are indexed by token row and shared by all workers: the engine copies a
layer's `x` in once (one device-to-host copy for the whole prompt), each worker reads and writes only
the rows of its job, and the results go back in one copy. Output row strides are padded to 64 bytes,
so two workers' rows never share a cache line.

Jobs are published by raising the worker's job flag to the job's seq; the descriptor of job n lies in
ring entry n % ring, written by the engine's host thread before the flag rises. The flag may be
raised by the host (the python path) or by a GPU kernel long after the host wrote the descriptor
(gpu_ops/cuda_ext.py's copy_and_signal: the host enqueues a whole forward's jobs ahead of the device),
so a worker serves every job up to the flag's value, in order. An entry is reused only once its
worker's done flag has passed it (`WorkerSlot.free_for`).

Split jobs: a job may be one of `splits` parts of a group spread over workers 0..splits-1, all on the
same rows. Part i reads input columns chunk i and writes into its partial buffer
`partials[i] = x[:, chunk_i] @ A[:, chunk_i]^T`, publishes PHASE = group, waits for the other parts'
PHASE, sums the partials into `x @ A^T`, publishes READ = group (done reading the others' partials),
then writes output columns chunk i: `(x @ A^T) @ B^T[:, chunk_i]`. So every weight is read once, by
one worker, however few the tokens (a token split has each worker read all of A and B). Group ids
grow over the pool; a worker writes its partial for a group only once every part of its previous
group has published READ for it, so one buffer per worker suffices.

Posting to many workers (`Exchange.post_batch`, the python path) costs O(1) Python work: the
workers' flags, statuses and descriptor fields are strided numpy views across the slots and rings,
so N jobs are one vectorised write per descriptor field, the tags, then one write of the N job
flags; waiting is one comparison of the N done flags per poll (shm/flags.py's `wait_all`, whose
note says why one thread's vectorised stores keep data -> descriptor -> flag order on x86-64).

Layout (every region 64-byte aligned):
    header   one line: MAGIC, VERSION, workers, max_tokens, hidden, max_out, ring, error word (written
             by the GPU's wait_and_add when a wait timed out; the host clears it)
    control  one line: the hot deadline (a `time.monotonic_ns()` value, written by the engine): until it
             passes, workers and the host busy-poll their flags instead of sleeping (`Exchange.poll_hot_for`);
             max_rank (the partial buffers' width)
    slots    per worker two lines: the job line (job seq flag, written by the host or the GPU) and the
             worker line (written by the worker: done seq flag, status, heartbeat, pid, first failed seq,
             PHASE and READ of split jobs, jobs its native loop served)
    rings    per worker `ring` descriptors of two lines each (written by the engine's host thread)
    input    max_tokens * in_stride float32 worth of bytes. The padded view `input` [max_tokens,
             in_stride] float32, or per job the compact rows `input_rows()`: [rows, in_features] of the
             job's input dtype, row r at byte (r * in_features * itemsize), which a device can fill
             with one contiguous copy of x's rows.
    output   [max_tokens, out_stride] float32  (x @ A^T @ B^T; columns past out_features unused)
    partials [workers, max_tokens, max_rank] float32 (split jobs' x[:, chunk] @ A[:, chunk]^T; none when
             max_rank is 0)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from lorad.shm.flags import Flag
from lorad.shm.segment import ALIGNMENT, Segment, align, segment_name

MAGIC = 0x6C6F726164786368  # "loradxch"
VERSION = 4
FLOAT_BYTES = 4
LINE = ALIGNMENT
STOP = -1  # adapter id of the job that tells a worker to exit
DEFAULT_RING = 1024  # descriptors per worker: a forward of 32 layers x 7 projections x 4 spans fits
ERROR_WORD = 7  # int64 field of the header line
HOT_UNTIL, MAX_RANK = 0, 1  # int64 fields of the control line
CHUNK_ALIGN = 16  # split jobs' column chunks start at multiples of 16 floats: 64 bytes, a cache line

# Job line: the job seq flag. Ring descriptor (int64 fields): the seq it describes (a tag the worker
# checks), then the job.
JOB_SEQ = 0
TAG, ADAPTER, LAYER, PROJ, ROW_START, ROW_END, IN_FEATURES, OUT_FEATURES, IN_DTYPE, SPLIT, SPLITS, GROUP = range(12)
DESCRIPTOR_BYTES = 2 * LINE
# Worker line, written by the worker. FAILED: the seq of its first job that failed since the engine
# last cleared it (0: none); sticky, because a device-signalled forward only looks after the step.
# PHASE, READ: the last split group whose partial it has published, whose partials it has summed.
# NATIVE_JOBS: how many of its jobs the worker's native loop served (cpu_lora/csrc/native_loop.cpp).
DONE_SEQ, STATUS, HEARTBEAT, PID, FAILED, PHASE, READ, NATIVE_JOBS = range(8)
STATUS_OK, STATUS_ERROR = 0, 1
# Input dtypes a job's rows may have (codes shared with gpu_ops/cuda_ext.py's kernels).
IN_FLOAT32, IN_FLOAT16, IN_BFLOAT16 = 0, 1, 2
INPUT_ITEMSIZE = {IN_FLOAT32: 4, IN_FLOAT16: 2, IN_BFLOAT16: 2}


@dataclass(frozen=True)
class ExchangeConfig:
    workers: int
    max_tokens: int  # rows of the input and output regions
    hidden: int  # widest input (in_features) of a projection
    max_out: int  # widest output (out_features) of a projection
    ring: int = DEFAULT_RING  # job descriptors per worker
    max_rank: int = 0  # widest rank a split job may have (0: no partial buffers, no split jobs)

    def __post_init__(self):
        for name in ("workers", "max_tokens", "hidden", "max_out", "ring"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExchangeConfig.{name} must be positive")
        if self.max_rank < 0:
            raise ValueError("ExchangeConfig.max_rank must not be negative")

    @property
    def in_stride(self) -> int:
        return align(self.hidden * FLOAT_BYTES) // FLOAT_BYTES

    @property
    def out_stride(self) -> int:
        return align(self.max_out * FLOAT_BYTES) // FLOAT_BYTES


@dataclass(frozen=True)
class ExchangeLayout:
    slots: int  # byte offsets
    rings: int
    ring: int  # descriptors per worker
    input: int
    output: int
    partials: int
    size: int

    @classmethod
    def of(cls, config: ExchangeConfig) -> ExchangeLayout:
        slots = 2 * LINE  # header, control
        rings = align(slots + config.workers * 2 * LINE)
        input_offset = align(rings + config.workers * config.ring * DESCRIPTOR_BYTES)
        output = align(input_offset + config.max_tokens * config.in_stride * FLOAT_BYTES)
        partials = align(output + config.max_tokens * config.out_stride * FLOAT_BYTES)
        size = align(partials + config.workers * config.max_tokens * config.max_rank * FLOAT_BYTES)
        return cls(slots, rings, config.ring, input_offset, output, partials, size)

    def job_line(self, worker: int) -> int:
        return self.slots + worker * 2 * LINE

    def worker_line(self, worker: int) -> int:
        return self.job_line(worker) + LINE

    def descriptor(self, worker: int, seq: int) -> int:
        return self.rings + (worker * self.ring + seq % self.ring) * DESCRIPTOR_BYTES


@dataclass(frozen=True)
class Job:
    adapter_id: int
    layer: int
    proj: int
    row_start: int
    row_end: int
    in_features: int
    out_features: int
    in_dtype: int = IN_FLOAT32  # of the input rows (IN_FLOAT32, IN_FLOAT16, IN_BFLOAT16)
    split: int = 0  # this job's part of a split group (= its worker), 0..splits-1
    splits: int = 1  # parts in the group: 1, a job of its own rows; > 1, workers 0..splits-1 share the rows
    group: int = 0  # the split group's id (growing over the pool); 0 for a job of its own


def chunk(size: int, parts: int, part: int) -> tuple[int, int]:
    """Columns [start, end) of part `part` of `parts` of a dimension of `size`: equal chunks whose
    starts are multiples of CHUNK_ALIGN (the last parts may be short, or empty)."""
    step = -(-size // (parts * CHUNK_ALIGN)) * CHUNK_ALIGN
    start = min(part * step, size)
    return start, min(start + step, size)


class WorkerSlot:
    """One worker's flags and descriptor ring. The engine calls `describe()` and raises the job flag
    (`post()` does both; a GPU kernel may raise it instead), the worker `take()` and `finish()`; each
    side only writes its own lines."""

    def __init__(self, segment: Segment, layout: ExchangeLayout, worker: int):
        self.worker = worker
        self.ring = layout.ring
        job_line, worker_line = layout.job_line(worker), layout.worker_line(worker)
        self.descriptors = segment.array(layout.descriptor(worker, 0), (layout.ring, DESCRIPTOR_BYTES // 8), np.int64)
        # The worker's side reads and writes through memoryviews: no numpy scalar per access.
        bytes_view = memoryview(segment.buffer).cast("B")
        ring_start = layout.descriptor(worker, 0)
        self._ring_cells = bytes_view[ring_start : ring_start + layout.ring * DESCRIPTOR_BYTES].cast("q")
        self.worker_fields = bytes_view[worker_line : worker_line + LINE].cast("q")
        self.job_flag = Flag(segment.buffer, job_line + JOB_SEQ * 8)
        self.done_flag = Flag(segment.buffer, worker_line + DONE_SEQ * 8)
        self.heartbeat = Flag(segment.buffer, worker_line + HEARTBEAT * 8)

    def free_for(self, seq: int) -> bool:
        """Engine: whether job `seq`'s ring entry may be written (the job it held last is done)."""
        return self.done_flag.load() >= seq - self.ring

    def describe(self, seq: int, job: Job) -> None:
        """Engine: write job `seq`'s descriptor; the job flag is raised later (by the host or a GPU
        kernel). The tag goes last, so a worker that sees the tag sees the whole descriptor."""
        fields = self.descriptors[seq % self.ring]
        fields[ADAPTER], fields[LAYER], fields[PROJ] = job.adapter_id, job.layer, job.proj
        fields[ROW_START], fields[ROW_END] = job.row_start, job.row_end
        fields[IN_FEATURES], fields[OUT_FEATURES], fields[IN_DTYPE] = job.in_features, job.out_features, job.in_dtype
        fields[SPLIT], fields[SPLITS], fields[GROUP] = job.split, job.splits, job.group
        fields[TAG] = seq

    def post(self, seq: int, job: Job) -> None:
        """Engine: describe job `seq` (the input rows are already written), then publish it."""
        self.describe(seq, job)
        self.job_flag.store(seq)

    def fields(self, seq: int) -> tuple | None:
        """Worker: job `seq`'s descriptor as the tuple of `Job`'s fields (hashable, so a worker may
        key its per-job tensors by it); None when its ring entry does not hold that job (the
        engine never wrote it: a protocol error). The caller has seen the job flag reach `seq`."""
        start = (seq % self.ring) * (DESCRIPTOR_BYTES // 8)
        fields = self._ring_cells[start : start + GROUP + 1].tolist()
        if fields[TAG] != seq:
            return None
        return tuple(fields[ADAPTER:])

    def take(self, seq: int | None = None) -> Job | None:
        """Worker: the descriptor of job `seq` (default: the seq now in `job_flag`) as a Job; None
        when its ring entry does not hold that job."""
        fields = self.fields(self.job_flag.load() if seq is None else seq)
        return None if fields is None else Job(*fields)

    def finish(self, seq: int, status: int) -> None:
        """Worker: the output rows are written; publish the status, then the done flag (plain stores
        in that order, nothing between them but the interpreter). A failure is also kept in FAILED
        (the first since the engine cleared it)."""
        fields = self.worker_fields
        fields[STATUS] = status
        if status != STATUS_OK and fields[FAILED] == 0:
            fields[FAILED] = seq
        fields[DONE_SEQ] = seq  # the done flag (`done_flag`'s cell)

    def take_failed(self) -> int:
        """Engine: the first failed seq since the last call (0: none), cleared. Call it only when no
        job is in flight (between steps): the worker may set it again."""
        failed = self.worker_fields[FAILED]
        self.worker_fields[FAILED] = 0
        return failed

    @property
    def status(self) -> int:
        return self.worker_fields[STATUS]

    @property
    def pid(self) -> int:
        return self.worker_fields[PID]

    @pid.setter
    def pid(self, value: int) -> None:
        self.worker_fields[PID] = value

    def beat(self) -> None:
        self.heartbeat.store(self.heartbeat.load() + 1)


class Exchange:
    """The exchange segment and its views. `Exchange.create(instance, config)` in the engine (owner),
    `Exchange.attach(name)` in a worker: the layout is read back from the header."""

    def __init__(self, segment: Segment, config: ExchangeConfig):
        self.segment = segment
        self.config = config
        self.layout = ExchangeLayout.of(config)
        if segment.size < self.layout.size:
            raise ValueError(f"{segment.name} holds {segment.size} bytes, the layout needs {self.layout.size}")
        self.input = segment.array(self.layout.input, (config.max_tokens, config.in_stride), np.float32)
        self.input_bytes = segment.array(self.layout.input, config.max_tokens * config.in_stride * FLOAT_BYTES, np.uint8)
        self.output = segment.array(self.layout.output, (config.max_tokens, config.out_stride), np.float32)
        self.partials = segment.array(self.layout.partials, (config.workers, config.max_tokens, config.max_rank), np.float32)
        self.header = segment.array(0, 8, np.int64)
        self.hot = Flag(segment.buffer, LINE + HOT_UNTIL * 8)
        self.slots = [WorkerSlot(segment, self.layout, worker) for worker in range(config.workers)]
        # Every worker's job flag, done flag and status ([workers], one slot apart), and each field of
        # every descriptor ([workers * ring], entry w * ring + seq % ring): the batched views.
        layout, buffer, slot_stride = self.layout, segment.buffer, (2 * LINE,)
        self.job_flags = np.ndarray((config.workers,), np.int64, buffer, layout.job_line(0) + JOB_SEQ * 8, slot_stride)
        self.done_flags = np.ndarray((config.workers,), np.int64, buffer, layout.worker_line(0) + DONE_SEQ * 8, slot_stride)
        self.statuses = np.ndarray((config.workers,), np.int64, buffer, layout.worker_line(0) + STATUS * 8, slot_stride)
        self.phases = np.ndarray((config.workers,), np.int64, buffer, layout.worker_line(0) + PHASE * 8, slot_stride)
        self.reads = np.ndarray((config.workers,), np.int64, buffer, layout.worker_line(0) + READ * 8, slot_stride)
        self.native_jobs = np.ndarray((config.workers,), np.int64, buffer, layout.worker_line(0) + NATIVE_JOBS * 8,
                                      slot_stride)
        table = segment.array(layout.rings, (config.workers * config.ring, DESCRIPTOR_BYTES // 8), np.int64)
        self._columns = [table[:, field] for field in range(GROUP + 1)]
        self._ring_base = np.arange(config.workers, dtype=np.int64) * config.ring
        self._entries = np.empty(config.workers, dtype=np.int64)
        self._parts = np.arange(config.workers, dtype=np.int64)

    def post_batch(self, seqs: np.ndarray, adapter_id: int, layer: int, proj: int, row_starts: np.ndarray,
                   row_ends: np.ndarray, in_features: int, out_features: int, in_dtype: int = IN_FLOAT32,
                   group: int = 0) -> None:
        """Engine: describe and publish job `seqs[w]` to every worker w < len(seqs) (int64 arrays, one
        entry per worker; rows row_starts[w]:row_ends[w], the other fields shared), the input rows
        written already. `group` > 0: the jobs are the parts of split group `group` (part w on
        worker w; every row range the same). What `WorkerSlot.post` does for one worker, in O(1)
        Python work: each
        descriptor field of all N jobs in one vectorised store, the tags after the fields, then the
        N job flags in one store; one thread's plain stores in that order are seen in that order
        (x86-64 TSO, see shm/flags.py). Every entry must be free (`free_for`)."""
        count = len(seqs)
        entries = self._entries[:count]
        np.remainder(seqs, self.layout.ring, out=entries)
        entries += self._ring_base[:count]
        columns = self._columns
        columns[ADAPTER][entries] = adapter_id
        columns[LAYER][entries] = layer
        columns[PROJ][entries] = proj
        columns[ROW_START][entries] = row_starts
        columns[ROW_END][entries] = row_ends
        columns[IN_FEATURES][entries] = in_features
        columns[OUT_FEATURES][entries] = out_features
        columns[IN_DTYPE][entries] = in_dtype
        if group:
            columns[SPLIT][entries] = self._parts[:count]
            columns[SPLITS][entries] = count
        else:
            columns[SPLIT][entries] = 0
            columns[SPLITS][entries] = 1
        columns[GROUP][entries] = group
        columns[TAG][entries] = seqs
        self.job_flags[:count] = seqs

    def input_rows(self, start: int, end: int, in_features: int, itemsize: int = FLOAT_BYTES) -> np.ndarray:
        """The compact input rows [start, end) of a job of width `in_features`, as raw bytes
        [end - start, in_features * itemsize] (view them as the job's dtype)."""
        row_bytes = in_features * itemsize
        if not 0 <= start <= end or end * row_bytes > self.input_bytes.size or in_features > self.config.hidden:
            raise ValueError(f"rows {start}:{end} of width {in_features} do not fit the exchange's input")
        return self.input_bytes[start * row_bytes : end * row_bytes].reshape(end - start, row_bytes)

    def poll_hot_for(self, seconds: float) -> None:
        """Keep the workers (and the host's waits) busy-polling for the next `seconds`: a job is in
        flight or about to be. Only ever extends the hot period; it ends by itself, so an engine that
        stops heating (or dies) leaves the workers sleeping again within `seconds`."""
        until = time.monotonic_ns() + int(seconds * 1e9)
        if until > self.hot.load():
            self.hot.store(until)

    def stop_hot_polling(self) -> None:
        """End the hot period now (the workers go back to sleeping at their next check)."""
        self.hot.store(0)

    @property
    def is_hot(self) -> bool:
        return time.monotonic_ns() < self.hot.load()

    @property
    def error_word(self) -> np.ndarray:
        """int64 [1]: 0, or the seq of the first GPU-side wait that timed out (cuda_ext.wait_and_add)."""
        return self.header[ERROR_WORD : ERROR_WORD + 1]

    @classmethod
    def create(cls, instance: str, config: ExchangeConfig, purpose: str = "exchange") -> Exchange:
        layout = ExchangeLayout.of(config)
        segment = Segment.create(segment_name(instance, purpose), layout.size)
        segment.array(0, 8, np.int64)[:] = (
            MAGIC, VERSION, config.workers, config.max_tokens, config.hidden, config.max_out, config.ring, 0
        )
        segment.array(LINE + MAX_RANK * 8, 1, np.int64)[0] = config.max_rank
        return cls(segment, config)

    @classmethod
    def attach(cls, name: str) -> Exchange:
        segment = Segment.attach(name)
        magic, version, *dims = segment.array(0, 7, np.int64).tolist()
        if magic != MAGIC or version != VERSION:
            segment.close()
            raise ValueError(f"{name} is not a lorad exchange of version {VERSION}")
        max_rank = int(segment.array(LINE + MAX_RANK * 8, 1, np.int64)[0])
        return cls(segment, ExchangeConfig(*dims, max_rank=max_rank))

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        # Drop the views first so that the mapping can really be unmapped.
        self.input = self.input_bytes = self.output = self.partials = self.header = self.hot = None
        self.job_flags = self.done_flags = self.statuses = self.phases = self.reads = self.native_jobs = None
        self._columns = []
        self.slots = []
        self.segment.close()

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
