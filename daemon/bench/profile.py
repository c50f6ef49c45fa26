"""`lorad profile`: measures one model shape on the machine at hand and fits CaraServe's performance
models (scheduler/perf_model.py, §5): the two decode LoRA kernels (BGMV: alpha * |S| * max rank + beta;
MBGMV: alpha * sum of ranks + beta), the whole decode step, and the prefill. The fitted `Profile` is
saved where the engine looks for it (daemon/engine/kernel_choice.py: default_profile_path), and the engine
then picks each decode step's LoRA kernel from it.

What is timed is what the engine runs. On cuda: the Triton kernels, launched as the engine's CUDA
graphs launch them (through the model's ops: MBGMV at the batch's rank tier, q,k,v and gate,up each in one launch
pair with the expand launched early where the engine's are (`LoraLaunch`, its fuse_lora_groups and lora_pdl);
BGMV at the batch's rank bucket, one launch pair a projection), timed
from replays of CUDA graphs with CUDA events; decode steps are replays of the engine's own decode
graphs (daemon/engine/decode_graphs.py); prefills are replays of its prefill graphs (daemon/engine/prefill_graphs.py)
where they fit them, eager forwards beyond. On the CPU: the torch references
(bgmv_ref, the reference of both; the CPU engine's ops), timed with perf_counter. Inputs are random, never zeros;
adapter weights are random windows of a weight bank far larger than L2, and every timed replay reads
other windows than the one before.

`--tensor-parallel-size N` profiles an engine spanning N GPUs as it runs: N processes (this one rank 0), each
with its shard of the model (daemon/model/tensor_parallel.py: Shard.local) and the all-reduces of its forward,
run every measurement in step (same seed, same order), so a timed decode step or prefill is one of the TP
engine's, its two all-reduces a layer and the wait for the slowest rank included; rank 0's timings are kept.
The ranks sum as the engine would with the same `--all-reduce` (auto: on two GPUs the fused peer sum, with the add
and norm after it, for steps of up to 256 rows; NCCL's all-reduce otherwise), and the profile records which
(`machine.all_reduce`); an engine that sums otherwise warns that its predictions may be off.
NCCL's all-reduce alone is timed too, over the steps' token counts, and saved as the profile's `collectives`:
what share of a step the ranks spend reducing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from lorad.daemon.model.checkpoint import (
    MODEL_CONFIGS,
    PROJECTIONS,
    ModelSpec,
    dummy_weights,
    load_spec,
    load_weights,
)
from lorad.daemon.server.cli_args import SEED, Parser, check_out, log_level, parse
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.engine.decode_graphs import mbgmv_tier
from lorad.daemon.engine.kernel_choice import (
    LoraKernelChoice,
    default_profile_path,
    device_tag,
    rank_bucket,
)
from lorad.daemon.engine.runner import PROJECTION_GROUPS, lora_launch, lora_pdl_state
from lorad.daemon.model.gemma import build_model
from lorad.daemon.model.llama import Step
from lorad.daemon.model.ops import select_ops
from lorad.daemon.model import tensor_parallel
from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable, KVCache, PagePool
from lorad.scheduler.perf_model import (
    KERNELS,
    BgmvModel,
    CollectiveModel,
    MbgmvModel,
    Profile,
    choose_kernel,
    fit_bgmv,
    fit_collective,
    fit_decode_step,
    fit_mbgmv,
    fit_prefill,
)

from lorad.errors import BadRequest, LoradError

log = logging.getLogger(__name__)

L2_MULTIPLE = 40  # the weight bank is at least this many times a 50 MB L2 (H100) on cuda
REDUCES_PER_TIMING = 8  # all-reduces timed together (in one CUDA graph on cuda), as a step's run back to back


@dataclass(frozen=True)
class LoraLaunch:
    """How the profiled engine launches a decode step's LoRA: its fuse_lora_groups and lora_pdl (auto|on|off). The
    kernel and decode-step samples are timed with these launches, and the profile records what they came to
    (`machine.lora_launch`), so that an engine launching otherwise knows the profile is not of its steps."""

    fuse_groups: bool = True
    pdl: str = "auto"


@dataclass(frozen=True)
class Plan:
    """What is measured. Kernel samples: every batch size x every rank mix; decode-step samples: the
    step batch sizes x contexts x the mixes all-min, all-max, uniform, skewed; prefill samples: each
    prompt length alone at the min and max rank, and pairs of prompts of mixed ranks."""

    batch_sizes: tuple[int, ...]
    ranks: tuple[int, ...]  # rank mixes draw from these
    step_batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    rounds: int  # layers' worth of kernel calls in one timed replay
    variants: int  # adapter windows rotated between timed replays
    reps: int  # timed replays per kernel sample (median)
    step_reps: int  # timed decode steps per sample
    prefill_reps: int
    bank_bytes: int  # adapter weight bank

    def max_tokens(self) -> int:
        return max(max(self.prefill_tokens) * 2, max(self.batch_sizes), max(self.step_batch_sizes))


CUDA_PLAN = Plan(
    batch_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64), ranks=(8, 16, 32, 64), step_batch_sizes=(1, 8, 16, 32, 64),
    contexts=(128, 512, 2048), prefill_tokens=(32, 128, 512, 1024, 2048), rounds=8, variants=4, reps=20,
    step_reps=8, prefill_reps=3, bank_bytes=L2_MULTIPLE * (50 << 20),
)
CPU_PLAN = Plan(
    batch_sizes=(1, 2, 4, 8, 16), ranks=(8, 16, 32, 64), step_batch_sizes=(1, 4, 8, 16), contexts=(32, 128),
    prefill_tokens=(16, 64, 256), rounds=2, variants=2, reps=5, step_reps=5, prefill_reps=3, bank_bytes=64 << 20,
)
QUICK_PLAN = Plan(  # CI: a tiny model in seconds
    batch_sizes=(1, 2, 4, 8), ranks=(8, 16), step_batch_sizes=(1, 2, 4), contexts=(8, 32), prefill_tokens=(4, 16, 32),
    rounds=2, variants=2, reps=3, step_reps=3, prefill_reps=2, bank_bytes=4 << 20,
)


def rank_mixes(batch_size: int, ranks: tuple[int, ...], rng: np.random.Generator, every_equal: bool = True) -> dict[str, list[int]]:
    """Named rank lists of batch_size rows: all-equal (each rank, or only the min and max), uniform over
    `ranks`, and skewed (an eighth of the rows, at least one, at the max rank, the rest at the min)."""
    low, high = min(ranks), max(ranks)
    equal = ranks if every_equal else (low, high)
    mixes = {f"equal-{rank}": [rank] * batch_size for rank in equal}
    mixes["uniform"] = [int(rank) for rank in rng.choice(ranks, size=batch_size)]
    high_rows = max(1, batch_size // 8)
    mixes["skewed"] = [int(rank) for rank in rng.permutation([high] * high_rows + [low] * (batch_size - high_rows))]
    return mixes


class Clock:
    """Seconds of a call: CUDA events on the GPU (device time), perf_counter on the CPU; the median
    over reps, `before(rep)` run outside the timed span."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def median(self, run: Callable[[], object], reps: int, before: Callable[[int], None] | None = None) -> float:
        times = []
        for rep in range(reps):
            if before is not None:
                before(rep)
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                run()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) * 1e-3)
            else:
                started = time.perf_counter()
                run()
                times.append(time.perf_counter() - started)
        return statistics.median(times)


class AdapterBank:
    """Random adapter weights in the page pool and table rows pointing at them, for timing.

    A bank of random pages holds no adapter in particular: each (slot, layer, projection) gets a
    random window of it (page_ids is the identity over the bank), so thousands of slots of any rank
    cost only the bank's memory, and every variant of the windows reads other data."""

    def __init__(self, table: AdapterTable, first_page: int, num_pages: int, rng: np.random.Generator):
        self.table, self.rng = table, rng
        self.num_pages = num_pages
        table.page_ids_host[:num_pages] = np.arange(first_page, first_page + num_pages, dtype=np.int32)
        table.page_ids[:num_pages].copy_(torch.from_numpy(table.page_ids_host[:num_pages]))
        self.chunks_in = np.array([chunks_in for chunks_in, _ in table.chunks], dtype=np.int64)
        self.chunks_out = np.array([chunks_out for _, chunks_out in table.chunks], dtype=np.int64)

    def windows(self, slot_ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rank, a_start, b_start) int32 [slots, L, 7] for slots of these ranks on every layer and
        projection, each at a random window of the bank."""
        shape = (len(slot_ranks), self.table.num_layers, len(PROJECTIONS))
        rank = np.broadcast_to(np.asarray(slot_ranks, dtype=np.int64)[:, None, None], shape)
        need = rank * (self.chunks_in + self.chunks_out)
        if need.max(initial=0) > self.num_pages:
            raise BadRequest(f"the weight bank ({self.num_pages} pages) cannot hold one adapter of rank {int(rank.max())}")
        a_start = (self.rng.random(shape) * (self.num_pages - need + 1)).astype(np.int64)
        b_start = a_start + rank * self.chunks_in
        return rank.astype(np.int32), a_start.astype(np.int32), b_start.astype(np.int32)

    def load(self, slot_ranks: np.ndarray, variants: int) -> Callable[[int], None]:
        """Publishes slots 0..len-1 with these ranks; -> use(variant): points them at that variant's
        windows (a device-to-device copy of the starts, stream-ordered before what follows)."""
        table, count = self.table, len(slot_ranks)
        sets = [self.windows(slot_ranks) for _ in range(variants)]
        rank, a_start, b_start = sets[0]
        table.rank_host[:count], table.a_start_host[:count], table.b_start_host[:count] = rank, a_start, b_start
        table.rank_host[count:] = 0
        table.rank.zero_()
        table.rank[:count].copy_(torch.from_numpy(rank))
        device = table.rank.device
        starts = [(torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)) for _, a, b in sets]

        def use(variant: int) -> None:
            a, b = starts[variant % len(starts)]
            table.a_start[:count].copy_(a)
            table.b_start[:count].copy_(b)

        use(0)
        return use


class Bench:
    """The model, the pool (weight bank + KV region) and the ops of one profiling run, the ops launching the decode
    LoRA as the engine's do (`launch`: groups and the early expand). Under tensor parallelism
    `spec` is the rank's shard (Shard.local), `page_elems` the whole model's page (the engine's pool pages), and
    the model sums o's and down's outputs over the group as the engine's ranks do with `all_reduce` (nccl or fused,
    auto resolved; a collective: every rank makes its Bench at the same point)."""

    def __init__(self, spec: ModelSpec, weights: dict, dtype: torch.dtype, device: torch.device, plan: Plan,
                 max_lora_rank: int, seed: int, page_elems: int | None = None, tensor_parallel_size: int = 1,
                 all_reduce: str = "nccl", launch: LoraLaunch = LoraLaunch()):
        self.spec, self.dtype, self.device, self.plan = spec, dtype, device, plan
        self.tensor_parallel_size = tensor_parallel_size
        self.max_lora_rank = max_lora_rank
        self.rng = np.random.default_rng(seed)
        self.clock = Clock(device)
        self.choice = LoraKernelChoice.measuring_ranks(min(plan.ranks), max(plan.ranks))
        self.max_tokens = plan.max_tokens()
        if device.type == "cuda":  # the Triton kernels are what is timed there, never the references
            from lorad.gpu_ops.launch import require_triton

            require_triton("LoRA kernels")
        pdl = lora_pdl_state(launch.pdl, device)["on"]
        self.ops = select_ops(device, self.max_tokens, max_lora_rank, self.choice, fuse_groups=launch.fuse_groups, pdl=pdl)
        self.lora_launch = lora_launch(self.ops.fuses_groups, getattr(self.ops, "pdl", False))  # the CPU's ops: neither
        self.max_model_len = max(max(plan.contexts), max(plan.prefill_tokens)) + 1
        self.model = build_model(spec, weights, self.max_model_len, self.ops)
        self.all_reduce_path = None  # how the ranks sum (tp_worker.set_reduce), under tensor parallelism
        if tensor_parallel_size > 1:
            from lorad.daemon.engine.tp_worker import set_reduce

            self.all_reduce_path = set_reduce(self.model, all_reduce, device)
        page = page_elems or spec.page_elems
        page_bytes = page * torch.tensor([], dtype=dtype).element_size()
        bank_pages = max(plan.bank_bytes // page_bytes, max(plan.ranks) * 8)
        kv_size = spec.num_kv_heads * spec.head_dim
        tokens_per_page = page // kv_size
        # KV: enough distinct pages for the longest context of the largest batch, at most 4 GiB; sequences
        # draw their pages from it at random (sharing pages changes no cost: far more than L2 is read).
        kv_tokens = max(plan.contexts) * max(plan.step_batch_sizes)
        kv_pages = min(-(-kv_tokens // tokens_per_page) * 2 * spec.num_layers, max(1, (4 << 30) // page_bytes))
        kv_pages = max(kv_pages, -(-max(plan.contexts) // tokens_per_page) * 2 * spec.num_layers)
        self.pool = PagePool(1 + bank_pages + kv_pages, page, dtype, device)
        generator = torch.Generator(device=device).manual_seed(seed)
        for chunk in self.pool.pages.split(1 << 16):  # random, never zeros; in chunks to bound the float32 temporary
            chunk.copy_(torch.randn(chunk.shape, generator=generator, device=device) * 0.02)
        self.kv = KVCache(self.pool, spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.kv_pages = (1 + bank_pages, kv_pages)
        slots = max(plan.rounds * max(plan.batch_sizes), max(plan.step_batch_sizes))
        shapes = [spec.projection_shape(p) for p in PROJECTIONS]
        self.table = AdapterTable(self.pool, slots, spec.num_layers, shapes)
        self.bank = AdapterBank(self.table, 1, bank_pages, self.rng)
        self.graphs = None
        self.prefill_graphs = None

    # ---- (a) the LoRA kernels -------------------------------------------------------------------
    def launch_rank(self, kernel: str, ranks: list[int]) -> int:
        """The max rank the engine launches a kernel with: on cuda its decode graphs' (MBGMV at the lowest rank tier
        that holds the batch, BGMV at the batch's rank bucket), on the CPU the batch's max (eager)."""
        if self.device.type != "cuda":
            return max(ranks)
        if kernel == "mbgmv":
            return mbgmv_tier(max(ranks), self.max_lora_rank)
        return rank_bucket(max(ranks), self.max_lora_rank)

    def kernel_seconds(self, kernel: str, ranks: list[int]) -> float:
        """Seconds of one decode step's LoRA with this kernel: the seven projections of `rounds` layers, each layer
        on other rows' adapters, timed together, per layer, times the model's layers. Launched as a decode step of
        the engine launches them (the model's ops: q,k,v and gate,up through `lora_group`, so MBGMV takes each group
        in one launch pair where the engine's does, with its expand launched early where the engine's is)."""
        rows, rounds = len(ranks), self.plan.rounds
        use = self.bank.load(np.tile(np.asarray(ranks), rounds), self.plan.variants)
        max_rank = self.launch_rank(kernel, ranks)
        batches = []
        for round_ in range(rounds):
            batch = LoraBatch.build(list(range(round_ * rows, (round_ + 1) * rows)), self.device, decode=True)
            batch.max_rank, batch.decode_kernel = max_rank, kernel
            batches.append(batch)

        def operands(projections):
            fan_in = self.spec.projection_shape(PROJECTIONS[projections[0]])[0]
            widths = [self.spec.projection_shape(PROJECTIONS[proj])[1] for proj in projections]
            x = torch.randn(rows, fan_in, dtype=self.dtype, device=self.device)
            y = torch.randn(rows, sum(widths), dtype=self.dtype, device=self.device)
            return x, y, y.split(widths, dim=-1)

        grouped = {first + member for _, first, members in PROJECTION_GROUPS for member in range(members)}
        groups = [(first, operands(range(first, first + members))) for _, first, members in PROJECTION_GROUPS]
        alone = [(proj, operands([proj])) for proj in range(len(PROJECTIONS)) if proj not in grouped]
        layers = self.spec.num_layers

        def calls():
            for round_, batch in enumerate(batches):
                layer = round_ % layers
                for first, (x, fused, outs) in groups:
                    self.ops.lora_group(x, fused, outs, layer, first, batch, self.table)
                for proj, (x, y, _) in alone:
                    self.ops.lora(x, y, layer, proj, batch, self.table)

        run = _graphed(calls) if self.device.type == "cuda" else calls
        run()  # warm-up (and, on the CPU, the allocator)
        seconds = self.clock.median(run, self.plan.reps, before=lambda rep: use(rep + 1))
        return seconds / rounds * layers

    # ---- (b) decode steps ------------------------------------------------------------------------
    def decode_seconds(self, kernel: str, ranks: list[int], context: int) -> float:
        """Seconds of one decode step of len(ranks) sequences of `context` tokens each (the new one
        included), each with its own adapter; on cuda a replay of the engine's decode graph."""
        self.choice.forced = kernel
        rows = len(ranks)
        use = self.bank.load(np.asarray(ranks), self.plan.variants)
        first, count = self.kv_pages
        blocks = self.kv.blocks_for(context)
        block_pages = self.rng.integers(first, first + count, size=(rows, blocks, self.spec.num_layers, 2), dtype=np.int32)
        tokens = self.rng.integers(0, self.spec.vocab_size, size=rows)
        positions = np.full(rows, context - 1)
        slots = np.arange(rows)
        if self.device.type == "cuda":
            if self.graphs is None:
                from lorad.daemon.engine.decode_graphs import DecodeGraphs

                self.graphs = DecodeGraphs(self.model, self.kv, self.table, max(self.plan.step_batch_sizes),
                                           self.max_model_len, self.max_lora_rank, self.choice)
                self.graphs.capture()

            plan = StepPlan([np.array([token]) for token in tokens], positions, slots, list(block_pages), np.ones(rows, dtype=bool))

            def run():
                self.graphs.run(plan)
        else:
            step = self.step([(1, context, slot) for slot in slots], block_pages)

            def run():
                self.model.forward(step, self.kv.view, self.table)
        run()
        return self.clock.median(run, self.plan.step_reps, before=lambda rep: use(rep + 1))

    # ---- (c) prefills ------------------------------------------------------------------------------
    def prefill_seconds(self, prompts: list[tuple[int, int]]) -> float:
        """Seconds of one step over these prompts [(tokens, rank)], each with its own adapter: on cuda a
        replay of the engine's prefill graph for the step's bucket (with the host's filling of its
        buffers) when it fits the engine's default step (max_batch_tokens), else an eager forward."""
        use = self.bank.load(np.asarray([rank for _, rank in prompts]), self.plan.variants)
        tokens_per_page = self.kv.tokens_per_page
        longest = max(tokens for tokens, _ in prompts)
        first, count = self.kv_pages
        block_pages = self.rng.integers(first, first + count, size=(len(prompts), -(-longest // tokens_per_page), self.spec.num_layers, 2), dtype=np.int32)
        graphs = self._prefill_graphs() if self.device.type == "cuda" else None
        if graphs is not None and graphs.fits(sum(tokens for tokens, _ in prompts), len(prompts), block_pages.shape[1]):
            plan = StepPlan([self.rng.integers(0, self.spec.vocab_size, size=tokens) for tokens, _ in prompts],
                            np.zeros(len(prompts), dtype=np.int64), np.arange(len(prompts)), list(block_pages),
                            np.ones(len(prompts), dtype=bool))

            def run():
                graphs.run(plan)
        else:
            step = self.step([(tokens, tokens, slot) for slot, (tokens, _) in enumerate(prompts)], block_pages)

            def run():
                self.model.forward(step, self.kv.view, self.table)

        run()
        return self.clock.median(run, self.plan.prefill_reps, before=lambda rep: use(rep + 1))

    def _prefill_graphs(self):
        """The engine's prefill graphs for its default step size, captured on first use."""
        if self.prefill_graphs is None:
            from lorad.config import EngineConfig
            from lorad.daemon.engine.prefill_graphs import PrefillGraphs

            from lorad.scheduler.batching import RUNNING_RANGE

            defaults = EngineConfig()  # (the running cap: the least a default engine runs, more than any profiled step's)
            self.prefill_graphs = PrefillGraphs(self.model, self.kv, self.table, min(defaults.max_batch_tokens, self.max_tokens),
                                                RUNNING_RANGE[0], self.max_model_len, self.max_lora_rank)
            self.prefill_graphs.capture(pool=self.graphs.pool if self.graphs is not None else None)
        return self.prefill_graphs

    def step(self, sequences: list[tuple[int, int, int]], block_pages: np.ndarray) -> Step:
        """A step of sequences (new tokens, context after the step, adapter slot) over these KV pages
        [sequences, blocks, L, 2], as the engine's runner builds it."""
        device, tokens_per_page = self.device, self.kv.tokens_per_page
        input_ids, positions, row_slots, query_start, query_len, kv_len, sample_rows, dest = [], [], [], [], [], [], [], []
        for index, (new, context, slot) in enumerate(sequences):
            query_start.append(len(input_ids))
            query_len.append(new)
            kv_len.append(context)
            span = np.arange(context - new, context)
            input_ids.extend(self.rng.integers(0, self.spec.vocab_size, size=new).tolist())
            positions.extend(span.tolist())
            row_slots.extend([int(slot)] * new)
            dest.append(block_pages[index, span // tokens_per_page])  # [new, L, 2]
            sample_rows.append(len(input_ids) - 1)
        positions_np = np.asarray(positions, dtype=np.int64)
        attention = AttentionBatch(
            block_table=torch.from_numpy(block_pages.transpose(2, 3, 0, 1).copy()).to(device),
            dest_pages=torch.from_numpy(np.concatenate(dest).transpose(1, 2, 0).astype(np.int64)).to(device),
            dest_offsets=torch.from_numpy(positions_np % tokens_per_page).to(device),
            query_start=query_start, query_len=query_len, kv_len=kv_len,
        )
        lora = LoraBatch.build(row_slots, device, decode=all(new == 1 for new, _, _ in sequences))  # every row sampled
        self.ops.prepare_lora(lora, self.table)
        return Step(torch.tensor(input_ids, dtype=torch.long, device=device), torch.from_numpy(positions_np).to(device),
                    torch.tensor(sample_rows, dtype=torch.long, device=device), attention, lora)


def _graphed(calls: Callable[[], None]) -> Callable[[], None]:
    """A CUDA graph of calls() (warmed up on a side stream first, so Triton compiles outside it) -> its replay."""
    from lorad.daemon.engine.decode_graphs import capture

    return capture(calls, warmups=1)[0].replay


# ---- the whole run ------------------------------------------------------------------------------


def measure(bench: Bench, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Every sample of the plan: {"kernels": {kernel: [[ranks, seconds], ...]}, "decode": {kernel:
    [[ranks, context tokens, seconds], ...]}, "prefill": [[[(tokens, rank), ...], seconds], ...]}."""
    plan, rng = bench.plan, bench.rng
    samples = {"kernels": {k: [] for k in KERNELS}, "decode": {k: [] for k in KERNELS}, "prefill": []}
    for rows in plan.batch_sizes:
        for name, ranks in rank_mixes(rows, plan.ranks, rng).items():
            for kernel in KERNELS:
                seconds = bench.kernel_seconds(kernel, ranks)
                samples["kernels"][kernel].append([ranks, seconds])
            progress(f"kernels rows={rows} mix={name} bgmv_us={samples['kernels']['bgmv'][-1][1] * 1e6:.1f} "
                     f"mbgmv_us={samples['kernels']['mbgmv'][-1][1] * 1e6:.1f}")
    for rows in plan.step_batch_sizes:
        for context in plan.contexts:
            for name, ranks in rank_mixes(rows, plan.ranks, rng, every_equal=False).items():
                for kernel in KERNELS:
                    seconds = bench.decode_seconds(kernel, ranks, context)
                    samples["decode"][kernel].append([ranks, rows * context, seconds])
                progress(f"decode rows={rows} context={context} mix={name} bgmv_ms={samples['decode']['bgmv'][-1][2] * 1e3:.2f} "
                         f"mbgmv_ms={samples['decode']['mbgmv'][-1][2] * 1e3:.2f}")
    low, high = min(plan.ranks), max(plan.ranks)
    prompt_sets = [[(tokens, rank)] for tokens in plan.prefill_tokens for rank in (low, high)]
    prompt_sets += [[(tokens, low), (tokens // 2, high)] for tokens in plan.prefill_tokens]
    for prompts in prompt_sets:
        seconds = bench.prefill_seconds(prompts)
        samples["prefill"].append([prompts, seconds])
        progress(f"prefill prompts={prompts} ms={seconds * 1e3:.2f}")
    return samples


def measure_collectives(bench: Bench, progress: Callable[[str], None] = lambda line: None) -> list[list]:
    """[[tokens, seconds of one all-reduce of [tokens, hidden] in the model's dtype], ...] over the token counts of
    the plan's decode steps and prefills; every rank runs it in step. Each timing starts from a barrier (and, on
    cuda, an idle device) and runs REDUCES_PER_TIMING all-reduces back to back, in a CUDA graph on cuda as the
    engine's graphs hold them. (The sums grow from call to call; an all-reduce's time does not depend on them.)"""
    import torch.distributed as dist

    plan, device, cuda = bench.plan, bench.device, bench.device.type == "cuda"
    samples = []
    for tokens in sorted({*plan.step_batch_sizes, *plan.prefill_tokens, plan.max_tokens()}):
        buffer = torch.randn(tokens, bench.spec.hidden_size, dtype=bench.dtype, device=device)

        def reduces():
            for _ in range(REDUCES_PER_TIMING):
                tensor_parallel.all_reduce(buffer)

        def together(rep: int) -> None:
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()

        together(0)
        run = _graphed(reduces) if cuda else reduces
        if not cuda:
            run()  # warm-up: gloo's buffers for this size
        seconds = bench.clock.median(run, plan.reps, before=together) / REDUCES_PER_TIMING
        samples.append([tokens, seconds])
        progress(f"all-reduce tokens={tokens} us={seconds * 1e6:.1f}")
    return samples


def fit(samples: dict, num_layers: int = 0, tensor_parallel_size: int = 1) -> dict:
    """The models of the samples: bgmv, mbgmv (per-step LoRA cost), decode_bgmv, decode_mbgmv (whole
    steps running that kernel), prefill; and with tensor_parallel_size > 1, allreduce (two a layer)."""
    decode = samples["decode"]
    fits = {
        "bgmv": fit_bgmv((ranks, seconds) for ranks, seconds in samples["kernels"]["bgmv"]),
        "mbgmv": fit_mbgmv((ranks, seconds) for ranks, seconds in samples["kernels"]["mbgmv"]),
        "decode_bgmv": fit_decode_step(decode["bgmv"], "bgmv"),
        "decode_mbgmv": fit_decode_step(decode["mbgmv"], "mbgmv"),
        "prefill": fit_prefill([([tuple(p) for p in prompts], s) for prompts, s in samples["prefill"]]),
    }
    if tensor_parallel_size > 1:
        fits["allreduce"] = fit_collective(samples["allreduce"], 2 * num_layers, tensor_parallel_size)
    return fits


def collective_shares(collectives: CollectiveModel, samples: dict, kernel: str) -> dict:
    """The all-reduces' predicted share of each measured step (decode steps running `kernel`, prefills):
    {"decode": [min, median, max], "prefill": [...]}."""
    decode = [collectives.step_seconds(len(ranks)) / seconds for ranks, _, seconds in samples["decode"][kernel]]
    prefill = [collectives.step_seconds(sum(tokens for tokens, _ in prompts)) / seconds
               for prompts, seconds in samples["prefill"]]
    return {name: [round(min(shares), 4), round(statistics.median(shares), 4), round(max(shares), 4)]
            for name, shares in (("decode", decode), ("prefill", prefill))}


CLEAR_MARGIN = 0.05  # decode steps of the two kernels this far apart (relative) have a faster one the choice must pick


def choice_check(bgmv: BgmvModel, mbgmv: MbgmvModel, decode_samples: dict) -> dict:
    """Whether the kernel models pick, for the decode steps measured with both kernels (the same ranks and
    contexts, measured in turn), the kernel whose whole step was faster wherever one was clearly faster
    (CLEAR_MARGIN): {"clear": pairs with a clearly faster kernel, "agree": of them, those the models pick,
    "disagree": up to five that they do not, each with its rows, max rank, context tokens, both steps' ms and the
    pick}. The kernel models are fitted on the LoRA launches alone; a pick against the measured steps says they
    timed something other than what the steps run."""
    clear, agree, disagree = 0, 0, []
    for (ranks, context, bgmv_s), (_, _, mbgmv_s) in zip(decode_samples["bgmv"], decode_samples["mbgmv"]):
        if not ranks or max(bgmv_s, mbgmv_s) < (1 + CLEAR_MARGIN) * min(bgmv_s, mbgmv_s):
            continue
        clear += 1
        faster = "bgmv" if bgmv_s < mbgmv_s else "mbgmv"
        picked = choose_kernel(ranks, bgmv, mbgmv)
        if picked == faster:
            agree += 1
        elif len(disagree) < 5:
            disagree.append({"rows": len(ranks), "max_rank": max(ranks), "context_tokens": context,
                             "bgmv_ms": round(bgmv_s * 1e3, 3), "mbgmv_ms": round(mbgmv_s * 1e3, 3), "picked": picked})
    return {"clear": clear, "agree": agree, "disagree": disagree}


def build_profile(fits: dict, samples: dict, machine: dict) -> Profile:
    """The Profile the engine and the simulator read. Its one decode-step model is the kernel's that the
    kernel models predict cheaper over the profiled rank mixes (the engine still picks per step); the
    other kernel's step model is kept in notes."""
    batches = [ranks for ranks, _ in samples["kernels"]["mbgmv"]]
    total = {kernel: sum(fits[kernel].predict(ranks) for ranks in batches) for kernel in KERNELS}
    kernel = min(KERNELS, key=lambda name: total[name])
    other = "bgmv" if kernel == "mbgmv" else "mbgmv"
    other_fit = fits[f"decode_{other}"]
    collectives = fits.get("allreduce")
    notes = {
        "decode_kernel": f"{kernel}: predicted cheaper over the profiled rank mixes "
                         f"({total[kernel] * 1e3:.3f} ms against {total[other] * 1e3:.3f} ms of LoRA in all)",
        f"decode_{other}": other_fit.to_json(),
        "kernel_choice_check": choice_check(fits["bgmv"], fits["mbgmv"], samples["decode"]),
        "samples": samples,
    }
    if collectives is not None:
        notes["collective_share"] = collective_shares(collectives, samples, kernel)
    return Profile(
        machine=machine,
        decode=fits[f"decode_{kernel}"],
        prefill=fits["prefill"],
        bgmv=fits["bgmv"],
        mbgmv=fits["mbgmv"],
        notes=notes,
        collectives=collectives,
    )


FORMS = {
    "bgmv": "alpha * |S| * max_rank + beta (per decode step)",
    "mbgmv": "alpha * sum(ranks) + per_row * |S| + beta (per decode step)",
    "decode_bgmv": "fixed + per_request * |S| + per_context_token * ctx + alpha * |S| * max_rank",
    "decode_mbgmv": "fixed + per_request * |S| + per_context_token * ctx + alpha * sum(ranks)",
    "prefill": "per_token * T + per_rank_token * sum(r*t) + per_square_token * sum(t^2) + fixed",
    "allreduce": "fixed + per_token * T (one all-reduce of [T, hidden]; calls_per_step a step)",
}


def coefficients(model) -> dict[str, float]:
    values = {key: value for key, value in dataclasses.asdict(model).items()
              if not key.startswith("r2") and not isinstance(value, dict)}
    if hasattr(model, "lora"):
        values["alpha"] = model.lora.alpha
    return values


def fit_table(fits: dict, samples: dict) -> str:
    counts = {"bgmv": len(samples["kernels"]["bgmv"]), "mbgmv": len(samples["kernels"]["mbgmv"]),
              "decode_bgmv": len(samples["decode"]["bgmv"]), "decode_mbgmv": len(samples["decode"]["mbgmv"]),
              "prefill": len(samples["prefill"]), "allreduce": len(samples.get("allreduce", ()))}
    lines = ["| model | form | coefficients (seconds) | R^2 | samples |", "| --- | --- | --- | --- | --- |"]
    for name, model in fits.items():
        shown = ", ".join(f"{key}={value:.4g}" for key, value in coefficients(model).items())
        r2 = f"{model.r2:.4f}"
        if getattr(model, "r2_rank_sum_only", None) is not None:  # CaraServe's form, without per_row
            r2 += f" (alpha * sum(ranks) + beta alone: {model.r2_rank_sum_only:.4f})"
        lines.append(f"| {name} | {FORMS[name]} | {shown} | {r2} | {counts[name]} |")
    return "\n".join(lines)


def run_profile(spec: ModelSpec, weights: dict, model_name: str, dtype: torch.dtype, device: torch.device, plan: Plan,
                max_lora_rank: int, seed: int = 0, progress: Callable[[str], None] = lambda line: None,
                ranks: ProfileRanks | None = None, launch: LoraLaunch = LoraLaunch()) -> tuple[Profile, dict]:
    """Measures and fits; -> (the Profile, the fits by name). spec is the whole model's. With `ranks` (a
    tensor-parallel profile) this process is rank 0 of their group, `weights` its shard, and the other ranks
    measure beside it (with the same `launch`). `launch`: how the engine launches a decode step's LoRA."""
    if max(plan.ranks) > max_lora_rank:
        raise BadRequest(f"ranks up to {max(plan.ranks)} need max_lora_rank >= {max(plan.ranks)}")
    size = 1 if ranks is None else ranks.size
    started = time.perf_counter()
    bench = rank_bench(spec, weights, dtype, device, plan, max_lora_rank, seed, 0, size,
                       "nccl" if ranks is None else ranks.all_reduce, launch)
    samples = measure(bench, progress)
    if size > 1:
        samples["allreduce"] = measure_collectives(bench, progress)
    fits = fit(samples, spec.num_layers, size)
    machine = {
        "model": model_name, "device": device_tag(device), "dtype": str(dtype).removeprefix("torch."),
        "kernels": "triton (gpu_ops/bgmv.py, mbgmv.py)" if device.type == "cuda" else "torch references (one function, bgmv_ref)",
        "ops": bench.ops.name, "lora_launch": bench.lora_launch, "max_lora_rank": max_lora_rank, "plan": dataclasses.asdict(plan),
        "tensor_parallel_size": size, "gpus": [str(device)] if ranks is None else [str(d) for d in ranks.devices],
        "torch": torch.__version__, "measured": True, "seconds": round(time.perf_counter() - started, 1),
    }
    if ranks is not None:
        machine["collective_backend"] = ranks.backend
        machine["all_reduce"] = bench.all_reduce_path
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    profile = build_profile(fits, samples, machine)
    check = profile.notes["kernel_choice_check"]
    if check["disagree"]:
        log.warning("the kernel models pick the slower decode LoRA kernel for %d of the %d decode steps measured with a "
                    "clearly faster one (notes.kernel_choice_check), e.g. %s", check["clear"] - check["agree"],
                    check["clear"], check["disagree"][0])
    return profile, fits


# ---- tensor parallelism: every rank measures, in step -------------------------------------------------------


def rank_weights(spec: ModelSpec, model_dir: str | None, rank: int, size: int, dtype: torch.dtype,
                 device: torch.device, seed: int) -> dict:
    """What rank `rank` of `size` holds of the model, as the engine's ranks load it: random weights of its local
    shape (model_dir None), or its slices of the checkpoint."""
    if size == 1:
        return dummy_weights(spec, dtype, device, seed=seed) if model_dir is None else load_weights(model_dir, dtype, device)
    shard = tensor_parallel.Shard(spec, rank, size)
    return dummy_weights(shard.local, dtype, device, seed=seed) if model_dir is None else shard.read_weights(model_dir, dtype, device)


def rank_bench(spec: ModelSpec, weights: dict, dtype: torch.dtype, device: torch.device, plan: Plan, max_lora_rank: int,
               seed: int, rank: int, size: int, all_reduce: str = "nccl", launch: LoraLaunch = LoraLaunch()) -> Bench:
    """The Bench of rank `rank`: its shard of the model on pages of the whole model's size (the engine's pool),
    summing over the ranks with `all_reduce`, launching the decode LoRA as `launch` says (Bench)."""
    local = spec if size == 1 else tensor_parallel.Shard(spec, rank, size).local
    return Bench(local, weights, dtype, device, plan, max_lora_rank, seed, page_elems=spec.page_elems,
                 tensor_parallel_size=size, all_reduce=all_reduce, launch=launch)


class ProfileRanks:
    """Rank 0's side of a tensor-parallel profile: starts ranks 1..size-1 (`rank_main`, one process each, spawned),
    joins their group, and ends this process if one of them fails (rank 0 would otherwise wait at a collective
    until its timeout). Every rank sums with `all_reduce` (nccl or fused, auto resolved)."""

    def __init__(self, size: int, spec: ModelSpec, model_dir: str | None, dtype: torch.dtype, device: torch.device,
                 plan: Plan, max_lora_rank: int, seed: int, all_reduce: str = "nccl", launch: LoraLaunch = LoraLaunch()):
        from lorad.daemon.engine.tp_worker import free_port, rank_devices

        self.size, self.devices, self.all_reduce = size, rank_devices(device, size), all_reduce
        self.closing = False  # close() joins the ranks from here on, and judges how they ended
        address = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(target=rank_main, name=f"lorad-profile-rank{rank}", daemon=True,
                            args=(rank, size, spec, model_dir, str(dtype).removeprefix("torch."), str(self.devices[rank]),
                                  plan, max_lora_rank, seed, address, logging.getLogger().getEffectiveLevel(), all_reduce,
                                  launch))
            for rank in range(1, size)]
        for process in self.processes:
            process.start()
        threading.Thread(target=self._watch, name="lorad-profile-rank-watch", daemon=True).start()
        self.backend = tensor_parallel.init_group(0, size, self.devices[0], address)

    def _watch(self) -> None:
        waiting = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        while waiting:
            for sentinel in multiprocessing.connection.wait(list(waiting)):
                process = self.processes[waiting.pop(sentinel) - 1]
                if self.closing:
                    return
                process.join(1)
                if process.exitcode != 0:
                    print(f"lorad profile: rank {process.name.removeprefix('lorad-profile-rank')} exited with code "
                          f"{process.exitcode} (its traceback is above); stopping", file=sys.stderr, flush=True)
                    os._exit(1)

    def close(self, check: bool = True) -> None:
        """Waits for the other ranks to finish their last measurement (check: that they did), and leaves the group."""
        self.closing = True
        gc.collect()  # rank 0's CUDA graphs (they hold NCCL's communicator) gone with its Bench
        tensor_parallel.leave_group()  # beside the other ranks: NCCL's teardown may wait for every rank
        for process in self.processes:
            process.join(60)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        failed = [process.name for process in self.processes if process.exitcode != 0]
        if failed and check:
            raise LoradError(f"{', '.join(failed)} did not finish cleanly")


def rank_main(rank: int, size: int, spec: ModelSpec, model_dir: str | None, dtype: str, device: str, plan: Plan,
              max_lora_rank: int, seed: int, address: str, log_level: int, all_reduce: str = "nccl",
              launch: LoraLaunch = LoraLaunch()) -> None:
    """Rank `rank` of a tensor-parallel profile: the same measurements as rank 0, in the same order with the same
    seed, so that every forward meets the others' at its all-reduces; its timings are dropped."""
    from lorad.daemon.engine.tp_worker import exit_with_parent

    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s rank={rank} %(message)s")
    device = torch.device(device)
    if device.type == "cpu":  # the ranks share the host's cores, as the engine's do
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    threading.Thread(target=exit_with_parent, name="lorad-parent-watch", daemon=True).start()
    torch_dtype = getattr(torch, dtype)
    tensor_parallel.init_group(rank, size, device, address)
    weights = rank_weights(spec, model_dir, rank, size, torch_dtype, device, seed)
    bench = rank_bench(spec, weights, torch_dtype, device, plan, max_lora_rank, seed, rank, size, all_reduce, launch)
    del weights
    measure(bench)
    measure_collectives(bench)
    del bench  # its CUDA graphs hold NCCL's communicator
    gc.collect()
    tensor_parallel.leave_group()


# ---- the command ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lorad profile", description=(
        "Measure the LoRA decode kernels (BGMV, MBGMV), decode steps and prefills of a model shape on this "
        "machine, fit CaraServe's performance models and save them where `lorad serve` finds them."))
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model", metavar="DIR", help="a Hugging Face checkpoint directory (its weights are loaded)")
    shape.add_argument("--model-config", metavar="NAME", help=f"a known shape with random weights: {', '.join(MODEL_CONFIGS)}")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda|cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16 (default: auto, as lorad serve)")
    parser.add_argument("--max-lora-rank", type=int, default=256, metavar="N",
                        help="the engine's max_lora_rank: MBGMV's CUDA graphs are captured for it (default: 256, lorad serve's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="profile an engine spanning N GPUs (lorad serve --tensor-parallel-size N): one process per "
                             "rank, each timing its shard with the all-reduces (NCCL on cuda, gloo on the cpu); the "
                             "profile goes to ...-tpN.json (default: 1)")
    parser.add_argument("--all-reduce", default="auto", metavar="HOW",
                        help="how the ranks sum, as lorad serve --all-reduce: auto (fused on two GPUs, nccl "
                             "elsewhere), nccl, fused (default: auto)")
    parser.add_argument("--no-fuse-lora-groups", action="store_true",
                        help="time a decode step's LoRA as lorad serve --no-fuse-lora-groups launches it: one launch pair "
                             "per projection (default: q,k,v and gate,up each in one, as lorad serve)")
    parser.add_argument("--lora-pdl", default="auto", metavar="HOW",
                        help="as lorad serve --lora-pdl: auto|on|off, the decode MBGMV's expand launched early "
                             "(default: auto)")
    parser.add_argument("--quick", action="store_true", help="a few samples of tiny batches: seconds on a CPU (tests)")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--state-dir", metavar="DIR", help="the daemon's state_dir: the profile goes there (default: ~/.cache/lorad)")
    parser.add_argument("--out", metavar="PATH", help="where to write the profile (default: <state-dir>/profile-<model>-<device>"
                                                      "[-tpN].json)")
    parser.add_argument("--log-level", type=log_level, default="info", help="debug|info|warning|error")
    return parser


def profile_main(argv: list[str]) -> int:
    """`lorad profile ...` (argv without the leading "profile"); 0 done, 2 bad usage or input."""
    args = parse(build_parser(), argv, ("profile",))
    if isinstance(args, int):
        return args
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _profile(args)
    except LoradError as error:
        print(f"lorad profile: {error.message}", file=sys.stderr)
        return 2


def _profile(args: argparse.Namespace) -> int:
    from lorad.daemon.engine.engine import resolve_device, resolve_dtype
    from lorad.daemon.engine.tp_worker import resolve_all_reduce

    from lorad.config import MAX_TENSOR_PARALLEL_SIZE, EngineConfig

    EngineConfig(device=args.device, dtype=args.dtype, max_lora_rank=args.max_lora_rank,
                 all_reduce=args.all_reduce, lora_pdl=args.lora_pdl)  # the engine's checks
    launch = LoraLaunch(fuse_groups=not args.no_fuse_lora_groups, pdl=args.lora_pdl)
    size = args.tensor_parallel_size
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise BadRequest(f"--tensor-parallel-size must be in 1..{MAX_TENSOR_PARALLEL_SIZE}, not {size}")
    device = resolve_device(args.device)
    lora_pdl_state(args.lora_pdl, device)  # `on` where the expand cannot launch early: refused before anything is built
    if args.model_config is not None:
        if args.model_config not in MODEL_CONFIGS:
            raise BadRequest(f"unknown model config {args.model_config!r}: one of {', '.join(MODEL_CONFIGS)}")
        spec, name = ModelSpec.from_hf_config(MODEL_CONFIGS[args.model_config]), args.model_config
    else:
        spec, name = load_spec(args.model), Path(args.model).resolve().name
    tensor_parallel.check_size(spec, size)
    dtype = resolve_dtype(args.dtype, spec.torch_dtype, device)
    plan = QUICK_PLAN if args.quick else CUDA_PLAN if device.type == "cuda" else CPU_PLAN
    out = Path(args.out) if args.out else default_profile_path(name, device, args.state_dir, size)
    check_out(out, "--out" if args.out else "--state-dir", make_parents=True)  # before minutes of measurement
    kernels = "the Triton kernels" if device.type == "cuda" else "the torch references of both kernels (one function, bgmv_ref): no GPU"
    all_reduce = resolve_all_reduce(args.all_reduce, size, device)
    spans = f" x {size} ranks (each its shard, its sums included: {all_reduce} asked)" if size > 1 else ""
    print(f"profiling {name} on {device_tag(device)}{spans} ({str(dtype).removeprefix('torch.')}), timing {kernels}; "
          f"the profile goes to {out}", flush=True)
    if max(plan.ranks) > args.max_lora_rank:  # run_profile's check, before any other rank starts
        raise BadRequest(f"ranks up to {max(plan.ranks)} need --max-lora-rank >= {max(plan.ranks)}")
    model_dir = None if args.model_config else args.model
    ranks = None if size == 1 else ProfileRanks(size, spec, model_dir, dtype, device, plan, args.max_lora_rank, args.seed,
                                                all_reduce, launch)
    device = device if ranks is None else ranks.devices[0]
    try:
        weights = rank_weights(spec, model_dir, 0, size, dtype, device, args.seed)
        profile, fits = run_profile(spec, weights, name, dtype, device, plan, args.max_lora_rank, args.seed,
                                    progress=lambda line: print("  " + line, flush=True), ranks=ranks, launch=launch)
        del weights
    except BaseException:
        if ranks is not None:
            ranks.close(check=False)
        raise
    if ranks is not None:
        ranks.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print()
    print(fit_table(fits, profile.notes["samples"]))
    print()
    summary = {name: {"r2": model.r2, **coefficients(model)} for name, model in fits.items()}
    shown = {"profile": str(out), "machine": profile.machine["device"], "tensor_parallel_size": size,
             "decode_kernel": profile.notes["decode_kernel"], "kernel_choice_check": profile.notes["kernel_choice_check"],
             "fits": summary}
    if size > 1:
        shown["all_reduce"] = profile.machine["all_reduce"]
    if "collective_share" in profile.notes:  # [min, median, max] over the measured steps
        shown["collective_share"] = profile.notes["collective_share"]
    print(json.dumps(shown, indent=1))
    print(f"wrote {out} in {profile.machine['seconds']} s; `lorad serve` on this machine and model loads it "
          f"(or give --profile-path), `lorad simulate --profile {out}` simulates with it")
    return 0
