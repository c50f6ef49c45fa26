"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step (every sequence adds one token) launches hundreds of small kernels; replaying a captured
graph removes their launch cost. Everything a graph reads lives in static buffers filled before each
replay: token ids, positions, the KV block table and write destinations, each row's adapter slot and
the attention metadata. Rows beyond the live batch are padding: they read and write only the scratch
page and use no adapter.

Graphs are keyed by the step's decode LoRA kernel too (daemon/engine/kernel_choice.py): MBGMV graphs are
captured for the configured maximum rank (each row's own rank decides its work, so one graph serves
any mix of adapters) and, below it, for batches whose ranks are all <= 16 and all <= 64 (RANK_TIERS): a launch
at a lower maximum takes the tiles tuned for it (mbgmv.decode_config: the expand launched early with narrow
rank tiles) and a quarter of the shrink programs or fewer. At the default maximum of 256 a batch of ranks 8-64
took ~7 ms of MBGMV a decode step of 64 rows in the Azure-conversation run (BENCHMARKS.md, figure 21.1's
kernels). Each MBGMV graph is captured a second time without the MLP's LoRA launches (TARGETS "attention"),
which a batch replays when none of its adapters targets gate, up or down (most PEFT adapters target q, v or
q, k, v, o; the MLP's empty launch pairs cost ~0.6 ms of a 7B decode step of 64 rows, BENCHMARKS.md). BGMV pads every row to the rank it is launched with, so its graphs are captured
per rank bucket (16, 32, 64, ...: one compiled BGMV kernel each), and only for the buckets and batch
sizes where the profile's models say BGMV can ever be the cheaper kernel. Capturing them up front,
not on first use, keeps Triton compilation and capture (hundreds of ms a graph on a 7B model) out of
the serving path; with no profile no BGMV graph is captured at all.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from lorad.daemon.engine.kernel_choice import LoraKernelChoice, rank_bucket, rank_buckets
from lorad.daemon.engine.sampler import to_device
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.model.llama import DOWN, GATE, UP, Step
from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import SCRATCH_PAGE, untargeted

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
LOW_RANK = 16  # mbgmv.decode_config's smaller expand tile
RANK_TIERS = (LOW_RANK, 64)  # MBGMV graphs below the configured maximum rank: mbgmv.decode_config's tuned tiers
# An MBGMV graph's LoRA launches: "all" projections, or the attention's alone (LoraBatch.untargeted: the MLP's)
TARGETS = {"all": frozenset(), "attention": frozenset((GATE, UP, DOWN))}


def mbgmv_tier(highest: int, max_rank: int) -> int:
    """The max rank a decode graph launches MBGMV with for a batch whose highest rank is `highest`: the lowest
    rank tier below max_rank that holds it (each tier has graphs of its own, `DecodeGraphs.plan`), else max_rank."""
    return next((tier for tier in RANK_TIERS if highest <= tier < max_rank), max_rank)


_warmup_streams: dict[int, torch.cuda.Stream] = {}


def warmup_stream() -> torch.cuda.Stream:
    """The current device's one side stream for the warm-up runs before captures. One for every capture: the
    caching allocator reuses a freed block only on the stream it was allocated on, so a new stream for each
    of the ~40 captures kept each warm-up's activations cached for good (8.3 GB of a 70B shard's GPU)."""
    device = torch.cuda.current_device()
    stream = _warmup_streams.get(device)
    if stream is None:
        stream = _warmup_streams[device] = torch.cuda.Stream()
    return stream


def capture(run, pool=None, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, object, object]:
    """run() captured into a CUDA graph after `warmups` runs on a side stream (Triton compiles, the
    allocator settles) -> (the graph, what the captured run returned, the graph's memory pool: pass it
    to the next capture to share the memory)."""
    side = warmup_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output, graph.pool()


class SharedLogits:
    """One logits buffer [rows, vocab] float32 for a set of graphs that replay one at a time on one stream. Each graph
    copies its logits into the buffer's first rows as its last kernel instead of keeping a static output of its own:
    the 119 prefill graphs of 64 sampled rows held 1 GB of logits for the 7B shape's 32k vocabulary, 4 GB for Llama
    3's 128k, 15 GB at 256 running requests (the daemon then failed to start). A graph's logits therefore hold until
    the next replay of any graph of the set; the engine reads them (tokens, logprobs, kept rows) on the device or the
    host before it launches its next step."""

    def __init__(self, rows: int):
        self.rows = rows
        self.buffer: torch.Tensor | None = None

    def take(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] > self.rows:
            raise ValueError(f"a graph's {logits.shape[0]} rows of logits exceed the shared buffer's {self.rows}")
        if self.buffer is None:  # in the first capture's warm-up, outside any graph: a plain allocation
            self.buffer = torch.empty(self.rows, logits.shape[1], dtype=logits.dtype, device=logits.device)
        view = self.buffer[: logits.shape[0]]
        view.copy_(logits)
        return view


def capture_forward(model, step: Step, kv_view: torch.Tensor, table, pool,
                    logits: SharedLogits | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
    """One forward over a static step captured -> (the graph, its logits, its memory pool). logits: the set's shared
    buffer the graph writes them into (its own forward's logits are then a temporary of the pool, reused)."""
    if logits is None:
        return capture(lambda: model.forward(step, kv_view, table), pool)
    return capture(lambda: logits.take(model.forward(step, kv_view, table)), pool)


class BlockStaging:
    """The step's block lists into a graph's block table [L, 2, rows, blocks] on the device, each row sent only what
    it lacks. A table row remembers the list it holds (the sequence's BlockList, how often that was emptied, how many
    blocks): a sequence in the row it had before is sent the blocks added since (a decode step adds at most one), one
    that moved to another row has that row copied on the device and is then topped up, any other is sent whole (the
    whole lists of 64 sequences at ~1000 tokens of a 7B model, one token a page, are 16 MB: a millisecond over PCIe
    ahead of each replay, on its stream). The entries go in one pinned area with their places in the table, one copy
    each, scattered on the device; no host sync. A plan without `lists` (the tests' plans) has its rows sent whole."""

    def __init__(self, num_layers: int, device: torch.device):
        self.num_layers, self.device = num_layers, device
        self.pin = device.type == "cuda"
        self.held: list[tuple | None] = []  # per table row: (BlockList, its clears, blocks held), None: unknown
        self.entries_sent = 0  # block entries ([L, 2] page ids each) sent, and rows moved on the device
        self.rows_moved = 0
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}

    def _area(self, name: str, count: int, dtype) -> np.ndarray:
        """A pinned host area of `count` elements to fill (and its device twin, for `_sent`), grown on demand."""
        host = self._host.get(name)
        if host is None or host.numel() < count:
            grown = max(count, 2 * (0 if host is None else host.numel()), 64)
            self._host[name] = torch.zeros(grown, dtype=dtype, pin_memory=self.pin)
            self._device[name] = torch.zeros(grown, dtype=dtype, device=self.device)
        return self._host[name][:count].numpy()

    def _sent(self, name: str, count: int) -> torch.Tensor:
        """The first `count` elements of area `name`, copied to its device twin without waiting."""
        device = self._device[name][:count]
        device.copy_(self._host[name][:count], non_blocking=True)
        return device

    def send(self, plan, block_table: torch.Tensor) -> None:
        """block_table[:, :, row, :len(list)] = each sequence's blocks, row by row in the plan's order (past a list's
        own blocks: stale ids, never read)."""
        n, layers, width = len(plan.blocks), self.num_layers, block_table.shape[3]
        lists = plan.lists if len(plan.lists) == n else [None] * n
        old = self.held

        def holds(entry, blocks) -> bool:  # a row's entry is this list as it is now (not emptied since)
            return entry is not None and entry[0] is blocks and entry[1] == blocks.clears

        where = {}  # a list held in several rows (one it left, not written since): the row holding the most of it
        for row, entry in enumerate(old):
            if entry is not None and (id(entry[0]) not in where or where[id(entry[0])][1][2] < entry[2]):
                where[id(entry[0])] = (row, entry)
        held = old + [None] * (n - len(old))
        moves, pieces = [], []
        for row, (blocks, rows) in enumerate(zip(lists, plan.blocks)):
            length, first = len(rows), 0
            if length > width:
                raise ValueError(f"a block list of {length} blocks for a table of {width}")
            if blocks is not None:
                source, entry = row, old[row] if row < len(old) else None
                if not holds(entry, blocks):
                    source, entry = where.get(id(blocks), (row, None))
                if holds(entry, blocks) and entry[2] <= length:
                    first = entry[2]
                    if source != row:
                        moves.append((source, row))
            if first < length:
                pieces.append((row, first, rows[first:]))
            held[row] = None if blocks is None else (blocks, blocks.clears, length)
        if moves:  # all read before any is written: a row may be moved out of and into in one step
            self._area("moves", 2 * len(moves), torch.int64)[:] = np.asarray(moves, dtype=np.int64).T.reshape(-1)
            device = self._sent("moves", 2 * len(moves))
            block_table.index_copy_(2, device[len(moves):], block_table.index_select(2, device[: len(moves)]))
            self.rows_moved += len(moves)
        count = sum(len(rows) for _, _, rows in pieces)
        if count:
            values = self._area("values", count * layers * 2, torch.int32)
            places = self._area("places", count, torch.int64)
            values.reshape(count, layers * 2)[:] = np.concatenate([rows.reshape(len(rows), -1) for _, _, rows in pieces])
            places[:] = np.concatenate([row * width + np.arange(first, first + len(rows)) for row, first, rows in pieces])
            flat = block_table.view(layers * 2, -1)
            flat.index_copy_(1, self._sent("places", count), self._sent("values", count * layers * 2).view(count, layers * 2).t())
            self.entries_sent += count
        self.held = held


class DecodeGraphs:
    def __init__(self, model, kv, table, max_batch: int, max_model_len: int, max_lora_rank: int,
                 kernel_choice: LoraKernelChoice | None = None):
        self.model, self.kv, self.table = model, kv, table
        self.kernel_choice = kernel_choice or LoraKernelChoice()
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_rank = max_lora_rank
        self.max_blocks = kv.blocks_for(max_model_len)
        device = kv.view.device
        size, layers = self.buckets[-1], kv.num_layers
        long = {"dtype": torch.long, "device": device}
        int32 = {"dtype": torch.int32, "device": device}
        # The per-row inputs, packed so that a step sends them in two copies from pinned mirrors:
        # int64 rows input_ids, positions, dest_offsets; int32 rows query_start, query_len, kv_len
        # (= seq_info) and row_slot.
        self.packed64 = torch.zeros(3, size, **long)
        self.packed32 = torch.ones(4, size, **int32)
        self.packed32[0] = torch.arange(size, **int32)  # every row is its own decode sequence
        self.pin = device.type == "cuda"
        self.host64 = torch.zeros(3, size, dtype=torch.long, pin_memory=self.pin)
        self.host32 = torch.ones(4, size, dtype=torch.int32, pin_memory=self.pin)
        self.host32[0] = torch.arange(size, dtype=torch.int32)
        self.input_ids, self.positions, self.dest_offsets = self.packed64
        self.seq_info, self.row_slot = self.packed32[:3], self.packed32[3]
        self.seq_ids = self.packed32[0]
        self.dest_pages = torch.full((layers, 2, size), SCRATCH_PAGE, **long)
        # Its pinned mirror, sent whole (128 KiB at most): a copy from pageable memory may wait for the
        # stream, which would stall the host while the step before runs (overlapped decode).
        self.host_dest = torch.full((layers, 2, size), SCRATCH_PAGE, dtype=torch.long, pin_memory=self.pin)
        self.block_table = torch.full((layers, 2, size, self.max_blocks), SCRATCH_PAGE, **int32)
        self.blocks = BlockStaging(layers, device)
        self.rows = torch.arange(size, **long)
        # (bucket, kernel, max rank, targets): kernel "none" (no row has an adapter), "mbgmv" (max_lora_rank or a
        # tier) or "bgmv" (a rank bucket); targets a TARGETS name ("all" but for MBGMV's "attention" graphs).
        self.graphs: dict[tuple[int, str, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.logits = SharedLogits(size)
        self.pool = None
        self.last_key = None  # the graph the last run() replayed (benchmarks read it)
        self.sent: torch.cuda.Event | None = None  # recorded after the last run's copies from pinned memory

    def plan(self) -> list[tuple[int, str, int, str]]:
        """The graphs to capture: per bucket, base-only, MBGMV at each rank tier for every projection and for the
        attention's alone, and BGMV at each rank bucket where the kernel choice says BGMV can win for some batch of
        up to that many LoRA rows."""
        keys = []
        for size in self.buckets:
            keys.append((size, "none", 0, "all"))
            tiers = [tier for tier in RANK_TIERS if tier < self.max_rank] + [self.max_rank]
            keys += [(size, "mbgmv", tier, targets) for targets in TARGETS for tier in tiers]
            low = 1
            for bucket in rank_buckets(self.max_rank):
                if self.kernel_choice.bgmv_can_win(size, low, bucket):
                    keys.append((size, "bgmv", bucket, "all"))
                low = bucket + 1
        return keys

    def capture(self) -> None:
        """Captures every planned graph, largest bucket first so the smaller graphs reuse its memory pool."""
        keys = sorted(self.plan(), key=lambda key: -key[0])
        for key in keys:
            size, kernel, max_rank, targets = key
            graph, logits, self.pool = capture_forward(self.model, self._static_step(size, max_rank, kernel, targets), self.kv.view,
                                                       self.table, self.pool, self.logits)
            self.graphs[key] = (graph, logits)
        bgmv = sorted({(size, rank) for size, kernel, rank, _ in keys if kernel == "bgmv"})
        tiers = sorted({rank for _, kernel, rank, _ in keys if kernel == "mbgmv"})
        log.info("cuda graphs captured buckets=%s max_rank=%d mbgmv_rank_tiers=%s mbgmv_targets=%s bgmv_graphs=%d (%s) "
                 "kernel_choice=%s", ",".join(map(str, self.buckets)), self.max_rank, ",".join(map(str, tiers)),
                 ",".join(TARGETS), len(bgmv),
                 " ".join(f"{size}x{rank}" for size, rank in bgmv) or "none", self.kernel_choice.describe())

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.buckets[-1] and max_blocks <= self.max_blocks

    def run(self, plan: StepPlan) -> torch.Tensor:
        """One decode step (plan.decode) of n sequences -> logits [n, vocab] float32 (a view of static memory,
        valid until the next decode graph replays). plan.device_tokens, where given, are the input ids (overlapped decode).
        No host sync: every copy is from pinned memory, which the last run's copies have finished reading
        (`sent`: long done by the time the host comes back, unless the host runs a step ahead of the device,
        where it waits microseconds)."""
        if self.sent is not None:
            self.sent.synchronize()
        n, positions, slots = len(plan.tokens), plan.starts, plan.slots
        size = next(b for b in self.buckets if b >= n)
        tokens_per_page = self.kv.tokens_per_page
        host64, host32 = self.host64.numpy(), self.host32.numpy()
        host64[:, n:size] = 0
        host64[0, :n], host64[1, :n], host64[2, :n] = np.concatenate(plan.tokens), positions, positions % tokens_per_page
        host32[1:, n:size] = ((1,), (1,), (-1,))  # padding rows: one position of the scratch page, no adapter
        host32[2, :n], host32[3, :n] = positions + 1, slots
        self.packed64[:, :size].copy_(self.host64[:, :size], non_blocking=True)
        self.packed32[:, :size].copy_(self.host32[:, :size], non_blocking=True)
        if plan.every_token_on_device:
            self.input_ids[:n].copy_(plan.device_tokens)
        elif plan.device_tokens is not None:  # a one-token prompt joined the rows launched from the device's tokens
            rows = to_device(torch.from_numpy(plan.device_input_rows()), self.input_ids.device)
            self.input_ids.index_copy_(0, rows, plan.device_tokens)
        dest = self.host_dest.numpy()
        dest[:, :, n:size] = SCRATCH_PAGE  # padding rows write the scratch page
        pages = positions // tokens_per_page
        dest[:, :, :n] = np.stack([rows[page] for rows, page in zip(plan.blocks, pages)]).transpose(1, 2, 0)
        self.dest_pages.copy_(self.host_dest, non_blocking=True)
        self.blocks.send(plan, self.block_table)
        if self.pin:
            self.sent = torch.cuda.Event()
            self.sent.record()
        self.last_key = self._key(size, slots)
        graph, logits = self.graphs[self.last_key]
        graph.replay()
        return logits[:n]

    def _key(self, size: int, slots: np.ndarray) -> tuple[int, str, int, str]:
        if not (slots >= 0).any():
            return size, "none", 0, "all"
        kernel = self.kernel_choice.choose_for_slots(slots, self.table.rank_host)
        used = slots[slots >= 0]
        if kernel == "mbgmv":
            ranks = self.table.rank_host[used]
            unused = untargeted(ranks)
            targets = next(name for name in reversed(TARGETS) if TARGETS[name] <= unused)
            return size, "mbgmv", mbgmv_tier(int(ranks.max()), self.max_rank), targets
        key = (size, "bgmv", rank_bucket(int(self.table.rank_host[used].max()), self.max_rank), "all")
        if key not in self.graphs:  # bgmv_can_win covers every batch choose() can pick BGMV for
            raise RuntimeError(f"no BGMV graph for bucket {size} at rank {key[2]}: the capture plan missed a case")
        return key

    def _static_step(self, size: int, max_rank: int, kernel: str, targets: str = "all") -> Step:
        from lorad.gpu_ops.paged_attention import AttentionMeta

        attention = AttentionBatch(
            block_table=self.block_table[:, :, :size],
            dest_pages=self.dest_pages[:, :, :size],
            dest_offsets=self.dest_offsets[:size],
            query_start=list(range(size)),
            query_len=[1] * size,
            kv_len=[1] * size,
        )
        empty = torch.zeros(0, dtype=torch.int32, device=self.rows.device)
        attention._paged_meta = AttentionMeta(
            seq_info=self.seq_info[:, :size], decode_seqs=self.seq_ids[:size], tile_seq=empty, tile_row=empty,
            num_decode=size, num_tiles=0, max_context=self.max_blocks * self.kv.tokens_per_page,
        )
        lora = LoraBatch(row_slot=self.row_slot[:size], slot_rows=[], max_rank=max_rank, decode=True,
                         decode_kernel="bgmv" if kernel == "bgmv" else "mbgmv", untargeted=TARGETS[targets])
        return Step(self.input_ids[:size], self.positions[:size], self.rows[:size], attention, lora)
