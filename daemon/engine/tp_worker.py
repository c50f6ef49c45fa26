"""Tensor parallelism across processes: the engine process is rank 0 and starts one worker process per other
GPU (`TensorParallel.start`); each worker holds its shard of the model (daemon/model/tensor_parallel.py) and a page
pool of the same pages, and runs every step the engine runs.

Every decision is made once, in the engine: the scheduler's batch, KV blocks, adapter slots and their pool pages.
Before each forward the engine sends the workers one `StepMessage` on a pipe: the adapter placements and
evictions since the last step (slot, name, directory, page ids: each rank stages its own shard of the adapter
into the same pages) and the step's plan (tokens, positions, slots, the KV blocks added since the last step,
sampled rows). A worker applies the placements and runs the same forward; the ranks meet in the forward's
all-reduces. A decode step whose input ids are on rank 0's device (overlapped decode) has them broadcast on the
device.

The worker reads its pipe with no timeout (an idle engine sends nothing) and exits when rank 0's end closes; the
collectives have COLLECTIVE_TIMEOUT_S (`kill -USR1` a worker prints its threads' stacks). A worker that dies takes the engine process down (`_watch`): the API
process then fails every request and the daemon exits non-zero, for systemd to restart it.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import queue
import signal
import socket
import threading
import time
import types

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.adapter_residency import StagedCache, held_for_key, staging_key
from lorad.daemon.engine.gc_heap import freeze_start_up_heap
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.model import tensor_parallel
from lorad.daemon.model.checkpoint import ModelSpec
from lorad.errors import BadRequest, ModelError
from lorad.gpu_ops.page_pool import BlockList, PagePool

log = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # a worker loading a 70B shard and capturing its graphs
MEMORY_ADAPTER = "<memory>"  # LoraAdapter.path of the --dummy-adapters, which every rank makes alike
RANK_DIED_EXIT = 1  # the engine process's exit when a worker died: the daemon's "engine died", restarted
STOP_TIMEOUT_S = 30.0  # a worker's time to finish its step and leave the group when the engine closes


@dataclasses.dataclass
class Placement:
    slot: int
    name: str
    path: str  # the adapter's directory (MEMORY_ADAPTER: a dummy adapter)
    page_ids: np.ndarray  # int32, rank 0's pages, which every rank uses
    source: tuple | None = None  # its files as rank 0 read them (LoraAdapter.source)


@dataclasses.dataclass
class StepMessage:
    """One step as every worker runs it: the pool changes first, then the plan (StepPlan's arrays; of each sequence's
    KV blocks only the rows the worker has not seen: `BlockSync`)."""

    evicted: list[int]
    placed: list[Placement]
    tokens: np.ndarray  # int64, the sequences' new tokens one after another
    counts: np.ndarray
    starts: np.ndarray
    slots: np.ndarray
    blocks: tuple[list[int], list[int], list[np.ndarray]]  # BlockSync.updates: keys, first new row, new rows
    sample: np.ndarray
    device_rows: np.ndarray | None  # the sequences whose input id comes from rank 0's device (a broadcast), not `tokens`
    path: str  # how rank 0 runs the step (ModelRunner.path): a worker runs it the same way

    @classmethod
    def of(cls, plan: StepPlan, evicted: list[int], placed: list[Placement], blocks: tuple, path: str) -> StepMessage:
        if plan.assisted:
            raise RuntimeError("a CPU-assisted step cannot run tensor-parallel")  # refused by EngineConfig
        return cls(evicted, placed, np.concatenate(plan.tokens), plan.counts, plan.starts, plan.slots,
                   blocks, plan.sample, None if plan.device_tokens is None else plan.device_rows, path)

    def plan(self, lists: list[BlockList]) -> StepPlan:
        tokens = np.split(self.tokens, np.cumsum(self.counts)[:-1])
        return StepPlan(tokens=tokens, starts=self.starts, slots=self.slots, blocks=[blocks.array() for blocks in lists],
                        sample=self.sample, seqs=[None] * len(tokens), lists=lists)


class BlockSync:
    """The sequences' KV block lists on a worker, kept equal to rank 0's by sending each step only the rows added
    since the last step (a decode step adds at most one block a sequence; the whole lists of a 64-request batch
    are megabytes a step on a model with few tokens a page).

    Both sides keep the sequences of the last step only: one not in a step is forgotten and sent whole when it
    comes back. Rank 0 sends a list whole again when it is another list, or was emptied (preempted) since."""

    def __init__(self):
        self.sent: dict[int, tuple] = {}  # rank 0: id(seq) -> (seq, its BlockList, its clears, rows sent)
        self.held: dict[int, BlockList] = {}  # a worker: key -> its copy

    def updates(self, plan: StepPlan) -> tuple[list[int], list[int], list[np.ndarray]]:
        """Rank 0: (a key per sequence, the first row sent, the rows from there)."""
        sent, self.sent = self.sent, {}
        keys, firsts, rows = [], [], []
        for seq, blocks in zip(plan.seqs, plan.blocks):
            key, first = id(seq), 0
            entry = sent.get(key)
            if entry is not None and entry[0] is seq and entry[1] is seq.blocks and entry[2] == seq.blocks.clears \
                    and entry[3] <= len(blocks):
                first = entry[3]
            keys.append(key)
            firsts.append(first)
            rows.append(blocks[first:])
            self.sent[key] = (seq, seq.blocks, seq.blocks.clears, len(blocks))
        return keys, firsts, rows

    def apply(self, update: tuple[list[int], list[int], list[np.ndarray]]) -> list[BlockList]:
        """A worker: each sequence's whole block list, from rank 0's update (the same BlockList from step to step
        while rank 0 sends it rows, as the graphs' block tables expect)."""
        held, self.held = self.held, {}
        lists = []
        for key, first, rows in zip(*update):
            blocks = held.get(key) if first else BlockList()
            if blocks is None or len(blocks) != first:
                raise RuntimeError(f"tensor parallel: blocks of sequence {key} from row {first}, but this rank holds "
                                   f"{'none' if blocks is None else len(blocks)}")
            if len(rows):
                blocks.extend(rows)
            self.held[key] = blocks
            lists.append(blocks)
        return lists


class TensorParallel:
    """Rank 0's side: the workers, the pipes to them, and what was last sent of the pool's placements."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device):
        self.config, self.size = config, config.tensor_parallel_size
        self.shard = tensor_parallel.Shard(spec, 0, self.size)
        self.devices = rank_devices(device, self.size)
        self.processes: list = []
        self.connections: list = []
        self.workers: list[dict] = []  # what each worker reported when ready
        self.backend = ""
        self._closing = False
        self._sent: dict[int, object] = {}  # slot -> the AdapterPlacement the workers hold there
        self._blocks = BlockSync()
        self._paths: dict[str, tuple] = {}  # adapter name -> (its directory, its files as read: LoraAdapter.source)
        # staging_key(whole adapter) -> (what keeps that key unique, rank 0's shard)
        self._shards: collections.OrderedDict = collections.OrderedDict()
        self._shard_bytes = 0
        self.runner = None  # rank 0's ModelRunner, once attached (an engine can fail, and close, before it is)
        self.all_reduce_path: str | None = None  # how the ranks sum (set_reduce), once attached
        self.steps_sent = 0
        self.send_seconds = 0.0
        self._send_lock = threading.Lock()  # the engine thread's steps and the stager thread's hints share the pipes
        self._hinted: set[tuple[str, str]] = set()

    @classmethod
    def start(cls, config: EngineConfig, spec: ModelSpec, device: torch.device, model_name: str, model_dir,
              max_model_len: int) -> TensorParallel:
        """Starts the workers (ranks 1..size-1, each loading its shard) and joins their process group. model_name and
        max_model_len are rank 0's: the workers pick the same profile and capture the same graphs."""
        tp = cls(config, spec, device)
        address = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        for rank in range(1, tp.size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=worker_main, name=f"lorad-rank{rank}", daemon=True,
                args=(rank, config, spec, model_name, None if model_dir is None else str(model_dir), max_model_len,
                      str(tp.devices[rank]), address, theirs, logging.getLogger().getEffectiveLevel()))
            process.start()
            theirs.close()
            tp.processes.append(process)
            tp.connections.append(ours)
        threading.Thread(target=tp._watch, name="lorad-rank-watch", daemon=True).start()
        tp.backend = tensor_parallel.init_group(0, tp.size, tp.devices[0], address)
        log.info("tensor parallel size=%d backend=%s devices=%s worker_pids=%s", tp.size, tp.backend,
                 ",".join(map(str, tp.devices)), ",".join(str(p.pid) for p in tp.processes))
        return tp

    def attach(self, runner) -> None:
        """Rank 0's model sums o's and down's partial outputs over the ranks, and each step is sent to the
        workers before it runs here."""
        self.runner = runner
        self.all_reduce_path = set_reduce(runner.model, all_reduce_asked(self.config, self.devices[0]), self.devices[0])
        check_profile_sums(runner.kernel_choice.profile, self.all_reduce_path)
        forward = runner.forward

        def forward_on_every_rank(plan: StepPlan) -> torch.Tensor:
            try:
                path = runner.path(plan)  # the workers run the same: each path launches its own collectives
                self.send_step(plan, runner.table, runner.residency, path)
                if plan.device_tokens is not None:
                    plan.device_tokens = tensor_parallel.broadcast(plan.device_tokens.contiguous())
                return forward(plan, path)
            except BaseException:
                # The ranks may now be at different collectives (a timeout, a rank gone, a bug here): no later
                # step can be trusted, and the engine's step loop would go on to the next one.
                log.exception("tensor parallel step failed on rank 0: the ranks are out of step; exiting")
                self._reap()
                _exit(RANK_DIED_EXIT)

        runner.forward = forward_on_every_rank

    def agree_pages(self, pages: int) -> int:
        """The pool's pages: the fewest any rank can hold (each worker reported its own after loading)."""
        reports = [self._receive(rank, "loaded") for rank in range(1, self.size)]
        return min([pages, *(report["pages"] for report in reports)])

    def send_pool(self, pages: int, page_elems: int, max_running: int) -> None:
        """The agreed pages, rank 0's page size and running cap, to every worker: they then build their pools and
        capture their graphs beside rank 0's."""
        for connection in self.connections:
            connection.send(("pool", (pages, page_elems, max_running)))

    def wait_ready(self) -> None:
        self.workers = [self._receive(rank, "ready") for rank in range(1, self.size)]

    def shard_lookup(self, lookup):
        """The engine's name -> LoraAdapter, as rank 0's shard (what its pool stages). Shards are kept by their whole
        adapter's files (or, made in memory, its weights' identity: adapter_residency.staging_key), within
        host_adapter_bytes / size."""
        budget = self.config.host_adapter_bytes // self.size
        lock = threading.Lock()  # the engine thread and the adapter stager's thread both look adapters up

        def sharded(name: str):
            adapter = lookup(name)
            self.hint(name, adapter.path, adapter.source)
            with lock:
                self._paths[name] = (adapter.path, adapter.source)
                key = staging_key(adapter)
                entry = self._shards.get(key)
                if entry is None:
                    entry = (held_for_key(adapter, key), self.shard.adapter(adapter))
                    self._shards[key] = entry
                    self._shard_bytes += entry[1].nbytes
                    while self._shard_bytes > budget and len(self._shards) > 1:
                        _, (_, dropped) = self._shards.popitem(last=False)
                        self._shard_bytes -= dropped.nbytes
                self._shards.move_to_end(key)
                return entry[1]

        return sharded

    def hint(self, name: str, path: str, source: tuple | None = None) -> None:
        """Tells the workers that rank 0 is reading an adapter (its stager, ahead of the request's admission, or
        the engine thread), so that each stages its own shard on a thread of its own meanwhile, instead of in the
        step that places it, which every rank would wait for. Once per adapter, directory and files."""
        key = (name, path, source)
        with self._send_lock:
            if key in self._hinted or self._closing:
                return
            self._hinted.add(key)
            for connection in self.connections:
                try:
                    connection.send(("stage", key))
                except (OSError, ValueError):  # a worker gone: _watch ends the engine
                    pass

    def send_step(self, plan: StepPlan, table, residency, path: str) -> None:
        """The pool's changes since the last step and the step's plan, to every worker."""
        started = time.perf_counter()
        placements = table.placements
        evicted = [slot for slot, sent in self._sent.items() if placements.get(slot) is not sent]
        changed = [slot for slot, placement in placements.items() if self._sent.get(slot) is not placement]
        placed = []
        if evicted or changed:
            names = {slot: name for name, slot in residency.slots.items()}
            for slot in changed:
                adapter_path, source = self._paths[names[slot]]
                page_ids = np.asarray(placements[slot].page_ids, dtype=np.int32)
                placed.append(Placement(slot, names[slot], adapter_path, page_ids, source))
            self._sent = dict(placements)
        message = StepMessage.of(plan, evicted, placed, self._blocks.updates(plan), path)
        payload = multiprocessing.reduction.ForkingPickler.dumps(("step", message))  # pickled once for every worker
        with self._send_lock:
            for connection in self.connections:
                connection.send_bytes(payload)
        self.steps_sent += 1
        self.send_seconds += time.perf_counter() - started

    def status(self, pool) -> dict:
        """/v1/status's tensor_parallel: the size, each rank's GPU and pool. Every rank's pool has the same pages
        and the same adapter and KV pages in them (rank 0's placements, mirrored), so one occupancy serves all."""
        occupancy = pool.occupancy()
        ranks = [{"rank": 0, "pid": os.getpid(), "device": str(self.devices[0]), "alive": True,
                  "pool_pages": occupancy["pages"], "page_bytes": occupancy["page_bytes"]}]
        for rank, (process, report) in enumerate(zip(self.processes, self.workers), start=1):
            ranks.append({"rank": rank, "pid": process.pid, "device": report.get("device"), "alive": process.is_alive(),
                          "pool_pages": report.get("pages"), "page_bytes": occupancy["page_bytes"]})
        return {"size": self.size, "backend": self.backend, "all_reduce": self.all_reduce_path,
                "gpus": [str(device) for device in self.devices],
                "ranks": ranks, "kv_pages_each_rank": occupancy["kv"], "adapter_pages_each_rank": occupancy["adapter"],
                "steps_sent": self.steps_sent, "send_ms": round(self.send_seconds * 1e3, 3)}

    def ranks(self) -> list[tuple[int, str, bool]]:
        """(rank, device, alive) of every rank, for /metrics."""
        return [(0, str(self.devices[0]), True)] + [(rank, str(self.devices[rank]), process.is_alive())
                                                   for rank, process in enumerate(self.processes, start=1)]

    def close(self) -> None:
        """Stops the workers (they finish the step they run, report their steps, drop their CUDA graphs and leave
        the group) and leaves the group beside them: NCCL's teardown may wait for every rank, so rank 0 must not
        first wait for the workers to exit."""
        with self._send_lock:
            self._closing = True
            for connection in self.connections:
                try:
                    connection.send(("stop",))
                except (OSError, ValueError):
                    pass
        reported = self._compare_step_paths()
        # Releasing the graphs waits for the device, for ever where a collective waits for a stuck rank: only once
        # this rank's work has ended within the drain's bound; else the group is aborted with them held.
        if reported and tensor_parallel.device_drained() and self.runner is not None:
            self.runner.release_graphs()
        tensor_parallel.leave_group(drain=False)
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                log.warning("tensor parallel worker did not stop; killing it pid=%d", process.pid)
                process.kill()
                process.join(5)
        for connection in self.connections:
            connection.close()

    def _compare_step_paths(self) -> bool:
        """Each worker's steps by the path they ran (decode graph, prefill graph, eager), against rank 0's: every
        path launches its own collectives (a graph's over its bucket's rows), so ranks whose paths differ wait
        on each other's collectives for ever. Logged as an error where they differ. -> whether every worker
        reported (none is stuck in a step)."""
        ours, every = step_paths(self.steps_sent, self.runner), True
        for rank, connection in enumerate(self.connections, start=1):
            try:
                if not connection.poll(STOP_TIMEOUT_S):
                    log.error("tensor parallel rank %d did not report its steps at stop (stuck in a step?); rank 0 "
                              "ran %s", rank, ours)
                    every = False
                    continue
                kind, theirs = connection.recv()
            except (EOFError, OSError, ValueError):
                every = False
                continue
            if kind == "stopped" and theirs != ours:
                log.error("tensor parallel rank %d ran its steps on other paths than rank 0: %s against rank 0's %s",
                          rank, theirs, ours)
        return every

    def _receive(self, rank: int, kind: str) -> dict:
        connection, process = self.connections[rank - 1], self.processes[rank - 1]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not connection.poll(1.0):
            if not process.is_alive() or time.monotonic() > deadline:
                raise ModelError(f"tensor parallel rank {rank} ({process.pid}) "
                                 f"{'died' if not process.is_alive() else 'did not answer'} while starting; its log says why")
        message = connection.recv()
        if message[0] == "failed":
            raise ModelError(f"tensor parallel rank {rank} failed to start: {message[1]}")
        if message[0] != kind:
            raise ModelError(f"tensor parallel rank {rank} sent {message[0]!r} where {kind!r} was expected")
        return message[1]

    def _reap(self) -> None:
        """Collects the workers that have ended, before the engine process exits: a rank killed mid-step is often
        seen first as a collective's error here, and left unreaped it would stay a zombie until init reaped it. The
        live ones end by themselves once this process is gone (exit_with_parent)."""
        for process in self.processes:
            process.join(0.1)

    def _watch(self) -> None:
        """A worker that exits unasked takes the engine process down: the ranks cannot go on without it, and a
        collective waiting for it must not hang the daemon."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ended = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ended[0]]
        process = self.processes[rank - 1]
        process.join(1)
        log.error("tensor parallel rank %d died (pid %d, exit code %s): the engine cannot go on without it; exiting",
                  rank, process.pid, process.exitcode)
        _exit(RANK_DIED_EXIT)


def _exit(code: int) -> None:
    """Ends the engine process now (a collective may hold its other threads): the API process sees it die, fails
    every request and exits non-zero."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def all_reduce_asked(config: EngineConfig, device: torch.device) -> str:
    """config.all_reduce with auto resolved (resolve_all_reduce)."""
    return resolve_all_reduce(config.all_reduce, config.tensor_parallel_size, device)


def resolve_all_reduce(asked: str, size: int, device: torch.device) -> str:
    """An all_reduce setting (config.ALL_REDUCES) with auto resolved: fused on two GPUs, nccl elsewhere (gloo's sum
    on the cpu)."""
    if asked != "auto":
        return asked
    return "fused" if device.type == "cuda" and size == 2 else "nccl"


def set_reduce(model, all_reduce: str, device: torch.device) -> str:
    """Sets how the model sums o's and down's partial outputs over the ranks (`all_reduce`: nccl or fused, auto
    resolved): NCCL's (gloo's) all-reduce, and for fused the decode steps' sums fused with the add and norm after
    them (tensor_parallel.PeerSum, whose setup is collective: every rank calls this at the same point). -> which, as
    logged and in /v1/status (its first word: fused, nccl or gloo)."""
    model.reduce, model.reduce_norm = tensor_parallel.all_reduce, None
    path = "nccl" if device.type == "cuda" else "gloo"
    if all_reduce == "fused":
        fused = tensor_parallel.PeerSum(model.spec.hidden_size, model.embed.dtype, device)
        model.reduce_norm = fused if fused.buffers is not None else None
        path = fused.path
    log.info("tensor parallel all-reduce: %s", path)
    return path


def check_profile_sums(profile, path: str) -> None:
    """Logs a warning where the engine's profile timed its steps with other sums than the engine's (`path`, as
    set_reduce says it): its decode predictions are then off by the difference (~0.7 ms a 13B step on two H100s
    between NCCL's and the fused sums). A profile that does not say summed through its collective backend."""
    timed = None if profile is None else profile.machine.get("all_reduce") or profile.machine.get("collective_backend")
    if timed is None:
        return
    timed, summed = timed.split()[0], path.split()[0]  # fused, nccl or gloo
    if timed != summed:
        log.warning("the profile's steps were timed with %s sums, the engine sums with %s: its decode predictions "
                    "may be off (measure it again with `lorad profile --all-reduce ...` as the engine runs)",
                    timed, summed)


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        raise BadRequest(f"tensor_parallel_size {size} from {device} needs GPUs cuda:{first}..cuda:{first + size - 1}; "
                         f"torch sees {torch.cuda.device_count()}")
    return [torch.device("cuda", first + rank) for rank in range(size)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- a worker process ----------------------------------------------------------------------------------------


class _MirrorPool(PagePool):
    """A worker's pool: rank 0 hands out the pages; this one counts what its placements hold."""

    def alloc(self, count: int, owner: str):
        raise RuntimeError("a tensor-parallel worker's pool takes rank 0's page ids; it allocates none")

    def free(self, page_ids: list[int], owner: str) -> None:
        self.used[owner] -= len(page_ids)


class RankWorker:
    """Rank r's model, pool and adapter shards, driven by rank 0's StepMessages."""

    def __init__(self, rank: int, config: EngineConfig, spec: ModelSpec, model_name: str, model_dir: str | None,
                 max_model_len: int, device: torch.device):
        from lorad.daemon.engine.engine import resolve_dtype
        from lorad.daemon.engine.kernel_choice import LoraKernelChoice
        from lorad.daemon.engine.runner import ModelRunner
        from lorad.daemon.model.checkpoint import dummy_weights

        self.config, self.spec, self.rank, self.device = config, spec, rank, device
        self.shard = tensor_parallel.Shard(spec, rank, config.tensor_parallel_size)
        self.dtype = resolve_dtype(config.dtype, spec.torch_dtype, device)
        local = self.shard.local
        if model_dir is None:  # every rank draws the same local shapes from the same seed, as rank 0 does
            weights = dummy_weights(local, self.dtype, device, seed=config.seed)
        else:
            weights = self.shard.read_weights(model_dir, self.dtype, device)
        self.weight_bytes = sum(tensor.nbytes for tensor in weights.values())
        kernel_choice = LoraKernelChoice.for_engine(config.profile_path, model_name, device, config.state_dir,
                                                    str(self.dtype).removeprefix("torch."), config.lora_kernel,
                                                    config.tensor_parallel_size)
        self.runner = ModelRunner(config, local, device, weights, max_model_len, kernel_choice)
        set_reduce(self.runner.model, all_reduce_asked(config, device), device)  # as rank 0's attach, at the same point
        del weights
        self._adapters = StagedCache(config.host_adapter_bytes)  # (name, path, source) -> staged shard
        self._staging: dict[tuple, threading.Event] = {}  # keys the staging thread is on (rank 0's hints)
        self._lock = threading.Lock()  # _adapters and _staging: the step's thread and the staging thread
        self._hints = None  # the staging thread's queue, made at the first hint
        self._dummy_lock = threading.Lock()
        self.blocks = BlockSync()
        self._dummies = None
        self.steps = 0

    def pages(self) -> int:
        from lorad.daemon.engine.engine import pool_pages

        return pool_pages(self.config, self.spec, self.dtype, self.device)

    def bind(self, pages: int, page_elems: int, max_running: int) -> None:
        from lorad.daemon.model.checkpoint import PROJECTIONS
        from lorad.gpu_ops.page_pool import AdapterTable, KVCache

        self.config = self.runner.config = dataclasses.replace(self.config, max_running_requests=max_running)  # rank 0's graphs' rows
        local = self.shard.local
        self.pool = _MirrorPool(pages, page_elems, self.dtype, self.device)
        self.kv = KVCache(self.pool, local.num_layers, local.num_kv_heads, local.head_dim)
        from lorad.daemon.engine.engine import ADAPTER_SLOTS

        self.table = AdapterTable(self.pool, ADAPTER_SLOTS, local.num_layers, [local.projection_shape(p) for p in PROJECTIONS])
        # The runner asks the residency for streamed copies (none here) and the cold starts for CPU assist (refused).
        residency = types.SimpleNamespace(loading={}, issue_streams=lambda: None)
        self.runner.bind(self.kv, self.table, residency, types.SimpleNamespace(cpu_assist=None), held=None)

    def run(self, message: StepMessage) -> None:
        self.steps += 1
        for slot in message.evicted:
            self.table.evict(slot)
        for placement in message.placed:
            self.table.place_at(placement.slot, self._staged(placement.name, placement.path, placement.source),
                                placement.page_ids)
        plan = message.plan(self.blocks.apply(message.blocks))
        if message.device_rows is not None:
            plan.device_rows = message.device_rows
            plan.device_tokens = tensor_parallel.broadcast(torch.empty(len(message.device_rows), dtype=torch.long, device=self.device))
        self.runner.forward(plan, message.path)

    def hint(self, name: str, path: str, source: tuple | None = None) -> None:
        """Rank 0 is reading this adapter: its shard is staged on this rank's staging thread meanwhile."""
        if self._hints is None:
            self._hints = queue.SimpleQueue()
            threading.Thread(target=self._stage_hinted, name="lorad-rank-stager", daemon=True).start()
        self._hints.put((name, path, source))

    def _stage_hinted(self) -> None:
        while True:
            name, path, source = self._hints.get()
            try:
                self._staged(name, path, source)
            except Exception:  # noqa: BLE001 -- the step that places it stages it again and fails there
                log.exception("staging adapter %s ahead failed; the step placing it will try again", name)

    def _staged(self, name: str, path: str, source: tuple | None = None):
        """This rank's shard of an adapter in page layout: read from its directory (or made, for a dummy adapter).
        Staged by whichever thread asks first (the step's or the staging thread); the other waits for it.

        source: the adapter's files as rank 0 read them (LoraAdapter.source). Keyed by them, so an adapter loaded
        again under its name and directory with new files is read again; files that differ from rank 0's (changed
        on disk since it read them, without a new load) raise AdapterError: this rank would compute with other
        weights than rank 0's."""
        from lorad.daemon.model.adapters import AdapterError, load_peft_adapter

        adapter = self._dummy(name) if path == MEMORY_ADAPTER else None
        # Dummy adapters share a handful of weight sets (as on rank 0, staged once each); a real one is its files.
        key = (MEMORY_ADAPTER, id(adapter.weights)) if adapter is not None else (name, path, source)
        while True:
            with self._lock:
                staged = self._adapters.get(key)
                if staged is not None:
                    return staged
                busy = self._staging.get(key)
                if busy is None:
                    busy = self._staging[key] = threading.Event()
                    break
            busy.wait()  # the other thread's staging of it: taken from the cache, or staged here if it failed
        try:
            if adapter is None:
                adapter = load_peft_adapter(path, self.spec, self.config.max_lora_rank, name=name)
                if source is not None and adapter.source != source:
                    raise AdapterError(f"adapter {name!r} ({path}) changed on disk after rank 0 read it: every rank must "
                                       "read the same files (load it again under its name to serve the new ones)")
            staged = self.table.stage(self.shard.adapter(adapter).weights, pin=False)
            with self._lock:
                self._adapters.put(key, None, staged)  # keyed by its files (a dummy's weights live in _dummies)
            return staged
        finally:
            with self._lock:
                self._staging.pop(key).set()

    def _dummy(self, name: str):
        with self._dummy_lock:  # made once, by whichever thread asks first
            if self._dummies is None:
                from lorad.daemon.engine.engine import _dummy_adapters

                self._dummies = {adapter.name: adapter for adapter in _dummy_adapters(self.spec, self.config)}
        return self._dummies[name]

    def describe(self) -> dict:
        return {"device": str(self.device), "pages": self.pool.num_pages - 1, "weight_bytes": self.weight_bytes,
                "ops": self.runner.ops.name}


def worker_main(rank: int, config: EngineConfig, spec: ModelSpec, model_name: str, model_dir: str | None,
                max_model_len: int, device: str, address: str, connection, log_level: int) -> None:
    # Stopping is rank 0's decision; a Ctrl-C to the process group must not take one rank out from under the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a stuck rank is, on stderr
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s rank={rank} pid={os.getpid()} %(message)s")
    device = torch.device(device)
    # The ranks share the host's cores: on the CPU their forwards; on GPUs a worker's host work (staging adapter
    # shards) runs beside rank 0's and NCCL's threads spinning on the devices, and torch's default of a thread per
    # core then has each of its parallel regions wait on descheduled threads (on two H100s a worker was still
    # staging a 13B shape's adapters 110 s in; on 2 cores with 2 spinning processes one adapter's staging takes
    # 2.1 s with 2 threads, 0.18 s with 1).
    share = (os.cpu_count() or 1) // config.tensor_parallel_size
    torch.set_num_threads(max(1, share if device.type == "cpu" else share // 2))
    threading.Thread(target=exit_with_parent, name="lorad-parent-watch", daemon=True).start()
    try:
        tensor_parallel.init_group(rank, config.tensor_parallel_size, device, address)
        worker = RankWorker(rank, config, spec, model_name, model_dir, max_model_len, device)
        connection.send(("loaded", {"pages": worker.pages()}))
        kind, (pages, page_elems, max_running) = connection.recv()
        worker.bind(pages, page_elems, max_running)
        freeze_start_up_heap(f"tensor parallel rank {rank}")
        connection.send(("ready", worker.describe()))
    except BaseException as error:  # noqa: BLE001 -- rank 0 reports it
        log.exception("tensor parallel rank %d failed to start", rank)
        try:
            connection.send(("failed", f"{type(error).__name__}: {error}"))
        except (OSError, ValueError):
            pass
        os._exit(2)
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            log.warning("rank 0 is gone; rank %d exits", rank)
            os._exit(RANK_DIED_EXIT)
        if message[0] == "stop":
            break
        if message[0] == "stage":
            worker.hint(*message[1])
            continue
        worker.run(message[1])  # an error here ends this process, and rank 0's watch ends the engine
    connection.send(("stopped", step_paths(worker.steps, worker.runner)))
    if tensor_parallel.device_drained():  # releasing the graphs waits for the device: only once it is done
        worker.runner.release_graphs()
    tensor_parallel.leave_group(drain=False)


def step_paths(steps: int, runner) -> dict[str, int]:
    """A rank's steps by the path they ran (runner None: none built, no step run)."""
    decode, prefill = (0, 0) if runner is None else (runner.graph_steps, runner.prefill_graph_steps)
    return {"steps": steps, "decode_graph": decode, "prefill_graph": prefill, "eager": steps - decode - prefill}


def exit_with_parent() -> None:
    """Rank 0 (the engine process) gone, killed in a collective perhaps: this rank goes too."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(RANK_DIED_EXIT)
