"""The engine <-> CPU LoRA worker exchange: one segment holding the prompt's activations, the LoRA
results and, per worker, a job descriptor with its two flags.

Activations and results are indexed by token row and shared by all workers: the engine copies a
layer's `x` in once (one device-to-host copy for the whole prompt), each worker reads and writes only
the rows of its job, and the results go back in one copy. Row strides are padded to 64 bytes, so two
workers' rows never share a cache line.

Layout (every region 64-byte aligned):
    header   one line: MAGIC, VERSION, workers, max_tokens, hidden, max_out
    slots    per worker two lines: the job line (written by the engine: job seq flag + descriptor)
             and the worker line (written by the worker: done seq flag, status, heartbeat, pid)
    input    [max_tokens, in_stride] float32   (x; columns past in_features unused)
    output   [max_tokens, out_stride] float32  (x @ A^T @ B^T; columns past out_features unused)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lorad.shm.flags import Flag
from lorad.shm.segment import ALIGNMENT, Segment, align, segment_name

MAGIC = 0x6C6F726164786368  # "loradxch"
VERSION = 1
FLOAT_BYTES = 4
LINE = ALIGNMENT
STOP = -1  # adapter id of the job that tells a worker to exit

# Job line (int64 fields), written by the engine; the job seq flag goes last.
JOB_SEQ, ADAPTER, LAYER, PROJ, ROW_START, ROW_END, IN_FEATURES, OUT_FEATURES = range(8)
# Worker line, written by the worker.
DONE_SEQ, STATUS, HEARTBEAT, PID = range(4)
STATUS_OK, STATUS_ERROR = 0, 1


@dataclass(frozen=True)
class ExchangeConfig:
    workers: int
    max_tokens: int  # rows of the input and output regions
    hidden: int  # widest input (in_features) of a projection
    max_out: int  # widest output (out_features) of a projection

    def __post_init__(self):
        for name in ("workers", "max_tokens", "hidden", "max_out"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExchangeConfig.{name} must be positive")

    @property
    def in_stride(self) -> int:
        return align(self.hidden * FLOAT_BYTES) // FLOAT_BYTES

    @property
    def out_stride(self) -> int:
        return align(self.max_out * FLOAT_BYTES) // FLOAT_BYTES


@dataclass(frozen=True)
class ExchangeLayout:
    slots: int  # byte offsets
    input: int
    output: int
    size: int

    @classmethod
    def of(cls, config: ExchangeConfig) -> "ExchangeLayout":
        slots = LINE
        input_offset = align(slots + config.workers * 2 * LINE)
        output = align(input_offset + config.max_tokens * config.in_stride * FLOAT_BYTES)
        size = align(output + config.max_tokens * config.out_stride * FLOAT_BYTES)
        return cls(slots, input_offset, output, size)

    def job_line(self, worker: int) -> int:
        return self.slots + worker * 2 * LINE

    def worker_line(self, worker: int) -> int:
        return self.job_line(worker) + LINE


@dataclass(frozen=True)
class Job:
    adapter_id: int
    layer: int
    proj: int
    row_start: int
    row_end: int
    in_features: int
    out_features: int


class WorkerSlot:
    """One worker's job descriptor and flags. The engine calls `post()`, the worker `take()` and
    `finish()`; each side only writes its own line."""

    def __init__(self, segment: Segment, layout: ExchangeLayout, worker: int):
        self.worker = worker
        job_line, worker_line = layout.job_line(worker), layout.worker_line(worker)
        self.job_fields = segment.array(job_line, 8, np.int64)
        self.worker_fields = segment.array(worker_line, 8, np.int64)
        self.job_flag = Flag(segment.buffer, job_line + JOB_SEQ * 8)
        self.done_flag = Flag(segment.buffer, worker_line + DONE_SEQ * 8)
        self.heartbeat = Flag(segment.buffer, worker_line + HEARTBEAT * 8)

    def post(self, seq: int, job: Job) -> None:
        """Engine: describe job `seq` (the input rows are already written), then publish it."""
        fields = self.job_fields
        fields[ADAPTER], fields[LAYER], fields[PROJ] = job.adapter_id, job.layer, job.proj
        fields[ROW_START], fields[ROW_END] = job.row_start, job.row_end
        fields[IN_FEATURES], fields[OUT_FEATURES] = job.in_features, job.out_features
        self.job_flag.store(seq)

    def take(self) -> Job:
        """Worker: the descriptor of the job whose seq it has seen in `job_flag`."""
        fields = self.job_fields.tolist()
        return Job(*fields[ADAPTER : OUT_FEATURES + 1])

    def finish(self, seq: int, status: int) -> None:
        """Worker: the output rows are written; publish the status, then the done flag."""
        self.worker_fields[STATUS] = status
        self.done_flag.store(seq)

    @property
    def status(self) -> int:
        return int(self.worker_fields[STATUS])

    @property
    def pid(self) -> int:
        return int(self.worker_fields[PID])

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
        self.output = segment.array(self.layout.output, (config.max_tokens, config.out_stride), np.float32)
        self.slots = [WorkerSlot(segment, self.layout, worker) for worker in range(config.workers)]

    @classmethod
    def create(cls, instance: str, config: ExchangeConfig, purpose: str = "exchange") -> "Exchange":
        layout = ExchangeLayout.of(config)
        segment = Segment.create(segment_name(instance, purpose), layout.size)
        segment.array(0, 6, np.int64)[:] = (
            MAGIC, VERSION, config.workers, config.max_tokens, config.hidden, config.max_out
        )
        return cls(segment, config)

    @classmethod
    def attach(cls, name: str) -> "Exchange":
        segment = Segment.attach(name)
        magic, version, *dims = segment.array(0, 6, np.int64).tolist()
        if magic != MAGIC or version != VERSION:
            segment.close()
            raise ValueError(f"{name} is not a lorad exchange of version {VERSION}")
        return cls(segment, ExchangeConfig(*dims))

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        # Drop the views first so that the mapping can really be unmapped.
        self.input = self.output = None
        self.slots = []
        self.segment.close()

    def __enter__(self) -> "Exchange":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
