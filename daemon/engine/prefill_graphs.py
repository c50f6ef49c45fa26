"""Steps with prompt rows (prefills, chunked prefills mixed with decodes) replayed from CUDA graphs, one
graph per token bucket.

An eager forward of the 7B shape launches ~20 kernels a layer; Triton's launcher costs tens of
microseconds each, so a prefill of 32..512 tokens took 30-40 ms on the host where its kernels take
6-18 ms on the device (bench/prefill_host.py; BENCHMARKS.md). A graph per bucket of step tokens
(TOKEN_BUCKETS: 16 to 256 by powers of two, then every 128 tokens to 1536 and every 256 to max_batch_tokens)
removes that cost. Everything a graph reads lives in static buffers
filled before each replay, and every grid is fixed by the bucket:

- rows past the step's tokens are padding: token 0 at position 0, written to the scratch page, in
  no LoRA segment, never sampled;
- attention runs the prompt rows through the prefill kernel over a fixed number of query tiles (the
  bucket's tokens / the tile height, plus one per sequence) and the one-token sequences (a mixed step's
  decode rows) through the decode kernel over a fixed list of the bucket's sequences, on a second stream
  beside the first (forked and joined inside the graph). Tiles and list entries past the step's point at a
  padding sequence of no rows and no context, which returns at once. The prefill kernel would spend a
  64-row query tile on each decode row, and run a GQA model's query heads in programs of their own, each
  reading its KV head's pages: on the H100 (bench/attention.py) it took 290 us where the decode kernel takes
  99 for 64 rows at context 1024 of Llama 3 8B's shape, 1522 against 367 for 256, 338 against 231 over
  the 7B shape's FP8 pages;
- LoRA runs MBGMM at a rank tier over a fixed list of row tiles (the bucket's tokens / 64, plus one per
  segment, a segment being one adapter's rows); tiles past the step's point at a padding segment of no rows,
  and each program past its adapter's rank returns at once. A step replays the graph of the lowest tier that
  holds its adapters' ranks (RANK_TIERS below the configured maximum rank, as the decode graphs; at the
  maximum, the rank-16 rows of a 1024-token prompt took 5.2 ms of MBGMM in a 48 ms mixed step). The rows of
  one-token sequences (a mixed step's decode rows) among the first max_seqs rows are not in a segment:
  MBGMV takes them, each row with its own adapter, over those max_seqs rows (-1: none), where MBGMM would
  spend a 16-row tile on each;
- logits come back for a fixed number of sampled rows, the first rows of one buffer every prefill graph writes
  (`SharedLogits`); the caller reads the first ones before the next replay.

Graphs are captured per bucket for steps without any adapter row ("none": no LoRA launches), and per bucket
and rank tier with adapter rows in segments only ("lora": MBGMM) and with one-token adapter rows too
("lora+rows": MBGMM and MBGMV).
Steps with CPU-assisted rows, or larger than the largest bucket, run eagerly.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from lorad.daemon.engine.decode_graphs import RANK_TIERS, BlockStaging, SharedLogits, capture_forward
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.model.llama import Step
from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import SCRATCH_PAGE

log = logging.getLogger(__name__)

# Powers of two up to 256, then every 128 tokens to 1536 and every 256 past it (a power of two would pad a step of
# 1100 rows, a prompt beside 64 decode rows, to 2048). A step of one prompt beside up to 64 decode rows, the
# mixed step of a saturated server, lands below 1536 for prompts up to ~1450 tokens: there a step pads to at most
# 127 rows. Larger steps are mostly budget-filled, exactly max_batch_tokens. bench/step_padding.py replays a
# saturated Azure-conversation run: 55 padding rows a mixed step on average, 93 with every 256 past 512.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408, 1536, 1792, 2048)
# A graph per bucket and kind: no adapter row; adapter rows in MBGMM's segments only; and with one-token
# adapter rows (a mixed step's decode rows) in MBGMV as well, whose launches cost ~20 us a projection even
# with no row to compute, so a step without such rows does not pay them.
GRAPH_KINDS = ("none", "lora", "lora+rows")


def bucket_rows(num_tokens: int, buckets) -> int:
    """The rows a step of num_tokens rows runs in: the smallest bucket that holds them (buckets ascending)."""
    return next(tokens for tokens in buckets if tokens >= num_tokens)


class _Bucket:
    """The static metadata of one token bucket: `tokens` rows, at most `seqs` sequences and `seqs` LoRA
    segments (and a padding one of each after them), `tiles` attention tiles of `tile_m` rows, `seg_tiles`
    LoRA row tiles of `seg_tile_m` rows."""

    def __init__(self, tokens: int, seqs: int, tile_m: int, seg_tile_m: int, device: torch.device, pin: bool):
        self.tokens, self.seqs, self.tile_m, self.seg_tile_m = tokens, seqs, tile_m, seg_tile_m
        self.tiles = -(-tokens // tile_m) + seqs
        self.seg_tiles = -(-tokens // seg_tile_m) + seqs
        # int32, one copy: seg_meta [3, seqs + 1] | seg_rows [tokens] | row_slot [tokens] | seq_info [3, seqs + 1]
        # | tile_seq [tiles] | tile_row [tiles] | seg_tile [2, seg_tiles] | one_row_slot [seqs] | decode_seqs [seqs]
        self.sizes = (3 * (seqs + 1), tokens, tokens, 3 * (seqs + 1), self.tiles, self.tiles, 2 * self.seg_tiles, seqs,
                      seqs)
        total = sum(self.sizes)
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.device = torch.zeros(total, dtype=torch.int32, device=device)
        parts = self.device.split(self.sizes)
        self.seg_meta, self.seg_rows, self.row_slot = parts[0].view(3, seqs + 1), parts[1], parts[2]
        self.seq_info, self.tile_seq, self.tile_row = parts[3].view(3, seqs + 1), parts[4], parts[5]
        self.seg_tile = parts[6].view(2, self.seg_tiles)
        self.one_row_slot, self.decode_seqs = parts[7], parts[8]
        self.host_parts = [part.numpy() for part in self.host.split(self.sizes)]


class PrefillGraphs:
    def __init__(self, model, kv, table, max_tokens: int, max_seqs: int, max_model_len: int, max_lora_rank: int,
                 buckets: tuple[int, ...] = TOKEN_BUCKETS):
        from lorad.gpu_ops.mbgmm import GRAPH_BLOCK_M
        from lorad.gpu_ops.paged_attention import PREFILL_BLOCK_M

        self.model, self.kv, self.table = model, kv, table
        self.max_rank = max_lora_rank
        self.rank_tiers = [tier for tier in RANK_TIERS if tier < max_lora_rank] + [max_lora_rank]
        self.max_blocks = kv.blocks_for(max_model_len)
        self.tokens_buckets = [b for b in buckets if b < max_tokens] + [max_tokens]
        device = kv.view.device
        self.pin = device.type == "cuda"
        largest = self.tokens_buckets[-1]
        self.max_seqs = min(max_seqs, largest)
        layers = kv.num_layers
        self.buckets = {t: _Bucket(t, min(t, self.max_seqs), PREFILL_BLOCK_M, GRAPH_BLOCK_M, device, self.pin) for t in self.tokens_buckets}
        # int64 rows: input_ids, positions, dest_offsets, sample_rows, and the rows whose input ids come from the
        # device (a step launched before the tokens of the one in flight are read)
        self.packed64 = torch.zeros(5, largest, dtype=torch.long, device=device)
        self.host64 = torch.zeros(5, largest, dtype=torch.long, pin_memory=self.pin)
        self.dest_pages = torch.full((layers, 2, largest), SCRATCH_PAGE, dtype=torch.long, device=device)
        self.host_dest = torch.full((layers, 2, largest), SCRATCH_PAGE, dtype=torch.long, pin_memory=self.pin)
        self.block_table = torch.full((layers, 2, self.max_seqs + 1, self.max_blocks), SCRATCH_PAGE, dtype=torch.int32,
                                      device=device)
        self.blocks = BlockStaging(layers, device)
        # the stream a step's decode rows' attention runs on beside its prompt tiles (none on the CPU: one after the other)
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # (bucket, kind, rank tier): kind "none" (tier 0), "lora" or "lora+rows"
        self.graphs: dict[tuple[int, str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.logits = SharedLogits(self.max_seqs)
        self.pool = None
        self.last_key = None
        self.sent: torch.cuda.Event | None = None  # recorded after the last fill's copies from pinned memory

    def plan(self) -> list[tuple[int, str, int]]:
        return [(tokens, kind, tier) for tokens in self.tokens_buckets for kind in GRAPH_KINDS
                for tier in ((0,) if kind == "none" else self.rank_tiers)]

    def capture(self, pool=None) -> None:
        """Captures every bucket's graphs, largest first so the smaller ones reuse its memory; `pool`: a
        graph memory pool to share (the engine captures these first and hands their pool to the decode
        graphs; `lorad profile` hands these the decode graphs')."""
        self.pool = pool
        for key in sorted(self.plan(), key=lambda key: -key[0]):
            graph, logits, self.pool = capture_forward(self.model, self.static_step(*key), self.kv.view, self.table, self.pool,
                                                       self.logits)
            self.graphs[key] = (graph, logits)
        log.info("prefill cuda graphs captured token_buckets=%s max_seqs=%d rank_tiers=%s",
                 ",".join(map(str, self.tokens_buckets)), self.max_seqs, ",".join(map(str, self.rank_tiers)))

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int) -> bool:
        return num_tokens <= self.tokens_buckets[-1] and num_seqs <= self.max_seqs and max_blocks <= self.max_blocks

    def run(self, plan: StepPlan) -> torch.Tensor:
        """One step -> logits [sampled sequences, vocab] float32, in the plan's order (a view of static
        memory, valid until the next prefill graph replays). No host sync: every copy is from pinned memory, which the last
        fill's copies have finished reading (`sent`: long done by the time the host comes back, unless the
        host fills a step while the one before it is still queued)."""
        key, num_sampled = self.fill(plan)
        self.last_key = key
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:num_sampled]

    def fill(self, plan: StepPlan) -> tuple[tuple[int, str, int], int]:
        """Fills the static buffers for this step -> (the graph key, the number of sampled rows)."""
        if self.sent is not None:
            self.sent.synchronize()
        lengths, n, num_seqs = plan.counts, plan.num_tokens, len(plan.tokens)
        tokens = bucket_rows(n, self.tokens_buckets)
        bucket = self.buckets[tokens]
        tokens_per_page, layers = self.kv.tokens_per_page, self.kv.num_layers
        starts_row = plan.first_rows()
        first_pos = plan.starts
        positions = np.repeat(first_pos - starts_row, lengths) + np.arange(n)
        row_slot = plan.row_slots()
        sampled = np.flatnonzero(plan.sample)

        host64 = self.host64.numpy()
        host64[:, :tokens] = 0
        host64[0, :n] = np.concatenate(plan.tokens)
        host64[1, :n] = self.model.rope_rows(positions, lengths, (seq.num_tokens for seq in plan.seqs))
        host64[2, :n] = positions % tokens_per_page
        host64[3, : len(sampled)] = starts_row[sampled] + lengths[sampled] - 1
        device_rows = plan.device_input_rows()
        if device_rows is not None:
            host64[4, : len(device_rows)] = device_rows

        seg_meta, seg_rows, slot_rows, seq_info, tile_seq, tile_row, seg_tile, one_row_slot, decode_seqs = bucket.host_parts
        seg_meta[:] = 0  # padding segments (the last one always): no rows
        seg_rows[:] = 0
        slot_rows[:] = -1
        slot_rows[:n] = row_slot
        seg_tile = seg_tile.reshape(2, -1)
        seg_tile[0], seg_tile[1] = bucket.seqs, 0  # unused tiles: the padding segment
        # The rows of one-token sequences (decode rows) among the first bucket.seqs go to MBGMV, each with its
        # own adapter; MBGMM's 16-row tiles would spend a whole tile on each. The other adapter rows to MBGMM.
        head = row_slot[: bucket.seqs]
        one_row = (np.repeat(lengths, lengths)[: bucket.seqs] == 1) & (head >= 0)
        one_row_slot[:] = -1
        one_row_slot[: len(head)][one_row] = head[one_row]
        in_segments = row_slot >= 0
        in_segments[: bucket.seqs][one_row] = False
        used = np.flatnonzero(in_segments)
        if len(used):
            order = used[np.argsort(row_slot[used], kind="stable")]
            seg_slots, seg_first, seg_len = np.unique(row_slot[order], return_index=True, return_counts=True)
            count = len(seg_slots)
            seg_meta.reshape(3, -1)[:, :count] = (seg_slots, seg_first, seg_len)
            seg_rows[: len(order)] = order
            per_segment = -(-seg_len // bucket.seg_tile_m)
            num = int(per_segment.sum())
            seg_tile[0, :num] = np.repeat(np.arange(count), per_segment)
            seg_tile[1, :num] = (np.arange(num) - np.repeat(np.cumsum(per_segment) - per_segment, per_segment)) * bucket.seg_tile_m
        info = seq_info.reshape(3, -1)
        info[:] = 0  # padding sequences (from len(seqs) on, the last one always): no rows, no context
        info[0, :num_seqs] = starts_row
        info[1, :num_seqs] = lengths
        info[2, :num_seqs] = first_pos + lengths
        tile_m = bucket.tile_m
        one_token = np.flatnonzero(lengths == 1)  # the decode kernel's; the others' rows in query tiles
        decode_seqs[:] = bucket.seqs  # the padding sequence
        decode_seqs[: len(one_token)] = one_token
        tiles_per_seq = np.where(lengths == 1, 0, -(-lengths // tile_m))
        num_tiles = int(tiles_per_seq.sum())
        tile_seq[:] = bucket.seqs  # the padding sequence
        tile_row[:] = 0
        tile_seq[:num_tiles] = np.repeat(np.arange(num_seqs), tiles_per_seq)
        tile_row[:num_tiles] = (np.arange(num_tiles) - np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)) * tile_m

        dest = np.empty((n, layers, 2), dtype=np.int64)
        for index, blocks in enumerate(plan.blocks):
            rows = slice(starts_row[index], starts_row[index] + lengths[index])
            dest[rows] = blocks[positions[rows] // tokens_per_page]
        host_dest = self.host_dest.numpy()
        host_dest[:, :, :tokens] = SCRATCH_PAGE
        host_dest[:, :, :n] = dest.transpose(1, 2, 0)

        self.packed64[:, :tokens].copy_(self.host64[:, :tokens], non_blocking=True)
        if device_rows is not None:  # the decode rows' input ids: the step in flight's tokens, on the device
            self.packed64[0].index_copy_(0, self.packed64[4, : len(device_rows)], plan.device_tokens)
        self.dest_pages[:, :, :tokens].copy_(self.host_dest[:, :, :tokens], non_blocking=True)
        bucket.device.copy_(bucket.host, non_blocking=True)
        self.blocks.send(plan, self.block_table)
        if self.pin:
            self.sent = torch.cuda.Event()
            self.sent.record()
        kind = "lora+rows" if one_row.any() else "lora" if len(used) else "none"
        return (tokens, kind, self._tier(row_slot) if kind != "none" else 0), len(sampled)

    def _tier(self, row_slot: np.ndarray) -> int:
        """The lowest rank tier that holds the ranks of the adapters of the step's rows."""
        slots = np.unique(row_slot[row_slot >= 0])
        highest = int(self.table.rank_host[slots].max()) if len(slots) else 0
        return next(tier for tier in self.rank_tiers if highest <= tier)

    def static_step(self, tokens: int, kind: str, max_rank: int) -> Step:
        """The bucket's Step over the static buffers (what its graph is captured from; the CPU tests run
        it eagerly through the kernels in Triton's interpreter)."""
        from lorad.gpu_ops.mbgmm import Segments
        from lorad.gpu_ops.paged_attention import AttentionMeta

        bucket = self.buckets[tokens]
        seqs = bucket.seqs
        attention = AttentionBatch(
            block_table=self.block_table[:, :, : seqs + 1],
            dest_pages=self.dest_pages[:, :, :tokens],
            dest_offsets=self.packed64[2, :tokens],
            query_start=[], query_len=[], kv_len=[],  # the kernels read the static meta below
        )
        attention._paged_meta = AttentionMeta(
            seq_info=bucket.seq_info, decode_seqs=bucket.decode_seqs, tile_seq=bucket.tile_seq, tile_row=bucket.tile_row,
            num_decode=seqs, num_tiles=bucket.tiles, max_context=self.max_blocks * self.kv.tokens_per_page,
            decode_splits=1, side_stream=self.side_stream, tile_m=bucket.tile_m,
        )
        lora = LoraBatch(row_slot=bucket.row_slot, slot_rows=[])
        if kind == "lora+rows":
            lora.one_row_slot = bucket.one_row_slot
        if kind != "none":
            # One program row per tile of the list; the host lengths only size the split-K choice.
            lora.segments = Segments(rows=bucket.seg_rows, meta=bucket.seg_meta, slots=[0] * (seqs + 1),
                                     lengths=[tokens] + [0] * seqs, max_rank=max_rank, tiles=bucket.seg_tile,
                                     block_m=bucket.seg_tile_m)
            lora.max_rank = max_rank
        return Step(self.packed64[0, :tokens], self.packed64[1, :tokens], self.packed64[3, :seqs], attention, lora)
