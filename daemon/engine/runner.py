"""The model on the device and how one step runs on it: the op set and the decoder (daemon/model/), the step's
plan built once from the scheduler's batch (`plan`, daemon/engine/step_plan.py), and its forward, replayed from a
decode CUDA graph or a prefill graph where one fits (decode_graphs.py, prefill_graphs.py), eager otherwise
(`build_step`). The engine owns the pool, the queue and the step loop; it hands the runner what its steps read
(`bind`): the KV cache, the adapter table, the adapters' residency and the cold starts.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.adapter_residency import LoraResidency
from lorad.daemon.engine.cold_start import ColdStarts
from lorad.daemon.engine.decode_graphs import DecodeGraphs
from lorad.daemon.engine.prefill_graphs import PrefillGraphs
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.model.checkpoint import ModelSpec
from lorad.daemon.model.gemma import build_model
from lorad.daemon.model.llama import GATE, Q, Step
from lorad.daemon.model.ops import select_ops
from lorad.errors import BadRequest
from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.fp8 import Fp8Weight
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable, KVCache
from lorad.scheduler.batching import Sequence

log = logging.getLogger(__name__)
PROJECTION_GROUPS = (("qkv", Q, 3), ("gate_up", GATE, 2))  # consecutive projections on one input: name, first, members

DECODE_GRAPH, PREFILL_GRAPH, EAGER = "decode_graph", "prefill_graph", "eager"  # ModelRunner.path


def lora_pdl_state(setting: str, device: torch.device, name: str = "lora_pdl") -> dict:
    """Whether decode steps on `device` launch the MBGMV expand early under lora_pdl `setting` (auto|on|off):
    {"on": bool, "why": why it is off, or None}; /v1/status `decode_lora_pdl`. `on` where the device or triton
    cannot is refused. The engine's runner and `lorad profile` (which times the launches the engine makes) both
    decide it here; and, `name` decode_pdl, whether a decode step's kernels are launched early (`decode_pdl`)."""
    if setting == "off":
        return {"on": False, "why": f"{name} off"}
    if device.type != "cuda":
        reason = f"{device.type}: reference ops"
    else:
        from lorad.gpu_ops.launch import pdl_unavailable

        reason = pdl_unavailable(device)
    if reason is not None and setting == "on":
        raise BadRequest(f"{name} on cannot run here: {reason}")
    return {"on": reason is None, "why": reason}


# decode_pdl auto with FP8 weights launches early only the decode steps of this many rows: on an H200 the FP8 7B step
# of 1 row took 0.95x with it, those of 16 and 64 rows 1.03x and 1.02x (bf16's 0.97-0.99x at 1, 16 and 64 rows;
# bench/decode_pdl.py, BENCHMARKS.md).
DECODE_PDL_FP8_ROWS = 1


def decode_pdl_state(setting: str, device: torch.device, fp8: bool) -> dict:
    """Whether a decode step's kernels are launched early (decode_pdl `setting`): `lora_pdl_state`'s answer and
    max_rows, the most rows of a step that does (None: any; auto with FP8 weights: DECODE_PDL_FP8_ROWS)."""
    state = lora_pdl_state(setting, device, "decode_pdl")
    state["max_rows"] = DECODE_PDL_FP8_ROWS if state["on"] and fp8 and setting == "auto" else None
    return state


def lora_launch(fuse_groups: bool, pdl: bool) -> dict:
    """How a decode step's LoRA is launched: q,k,v and gate,up each in one MBGMV launch pair (fuse_groups), the expand
    launched early (pdl). `lorad profile` records it with the timings it made so (from its ops), and an engine whose
    own (from its config) differs measures its profile again (start_profile.py): one record, compared as it is."""
    return {"fuse_lora_groups": bool(fuse_groups), "lora_pdl": bool(pdl)}


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device, weights: dict[str, torch.Tensor],
                 max_model_len: int, kernel_choice):
        self.config, self.spec, self.device, self.max_model_len = config, spec, device, max_model_len
        self.kernel_choice = kernel_choice
        self.lora_pdl = self._lora_pdl()
        fp8 = any(isinstance(weight, Fp8Weight) for weight in weights.values())
        self.decode_pdl = decode_pdl_state(config.decode_pdl, device, fp8)
        pdl = self.decode_pdl
        log.info("decode pdl=%s", f"off ({pdl['why']})" if not pdl["on"] else
                 "on" if pdl["max_rows"] is None else f"on in steps of at most {pdl['max_rows']} rows (FP8 weights)")
        self.ops = select_ops(device, config.max_batch_tokens, config.max_lora_rank, kernel_choice,
                              fuse_groups=config.fuse_lora_groups, pdl=self.lora_pdl["on"],
                              decode_pdl=pdl["on"], decode_pdl_rows=pdl["max_rows"])
        self.model = build_model(spec, weights, max_model_len, self.ops)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graph_steps = self.prefill_graph_steps = 0
        self.graph_rows: int | None = None  # the rows the last forward computed: its graph's bucket; None: eager
        self.step_spans: list = []  # the last eager step's CPU-assisted spans

    def bind(self, kv: KVCache, table: AdapterTable, residency: LoraResidency, cold_starts: ColdStarts, held) -> None:
        """What the steps read, from the engine that owns it: the KV cache, the adapter table, each adapter's
        residency in the pool, the cold starts (CPU assist) and held(name), the adapter a request in the
        engine holds. On cuda (unless eager) the CUDA graphs are captured here."""
        self.kv, self.table, self.residency, self.cold_starts, self.held = kv, table, residency, cold_starts, held
        self.lora_groups = self._lora_groups()
        self.prompt_lora_groups = self._prompt_lora_groups()
        config = self.config
        if self.device.type == "cuda" and not config.eager and self.ops.name.startswith("triton"):
            self.graphs = DecodeGraphs(self.model, kv, table, config.max_running_requests, self.max_model_len,
                                       config.max_lora_rank, self.kernel_choice)
            # Steps with prompt rows too: captured first (their largest bucket needs the most memory), the
            # decode graphs then share their memory pool.
            self.prefill_graphs = PrefillGraphs(self.model, kv, table, config.max_batch_tokens,
                                                config.max_running_requests, self.max_model_len, config.max_lora_rank)
            self.prefill_graphs.capture()
            self.graphs.pool = self.prefill_graphs.pool
            self.graphs.capture()

    def release_graphs(self) -> None:
        """Drops the CUDA graphs and their memory: a graph that captured a collective holds on to NCCL's
        communicator, which cannot be torn down while such a graph lives (tensor parallelism's close)."""
        self.graphs = self.prefill_graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _lora_pdl(self) -> dict:
        """Whether decode steps launch the MBGMV expand early (config.lora_pdl): `lora_pdl_state`, logged."""
        state = lora_pdl_state(self.config.lora_pdl, self.device)
        log.info("decode lora pdl=%s", "on" if state["on"] else f"off ({state['why']})")
        return state

    def _lora_groups(self) -> dict[str, str]:
        """How decode steps launch the LoRA of q,k,v and of gate,up (config.fuse_lora_groups): "one launch"
        where the members' tiles agree (mbgmv.group_fits), else "per projection"; logged, in /v1/status."""
        if not self.ops.fuses_groups:  # fuse_lora_groups off, or the reference ops
            return {"qkv": "per projection", "gate_up": "per projection"}
        from lorad.gpu_ops.mbgmv import group_fits

        groups = {name: "one launch" if group_fits(self.table, first, members, self.config.max_lora_rank, pdl=self.lora_pdl["on"])
                  else "per projection"
                  for name, first, members in PROJECTION_GROUPS}
        log.info("decode lora groups %s", " ".join(f"{name}={how.replace(' ', '-')}" for name, how in groups.items()))
        return groups

    def _prompt_lora_groups(self) -> dict[str, str]:
        """How steps with prompt rows launch the MBGMM shrinks of q,k,v and of gate,up (config.fuse_lora_groups): "one
        shrink launch" where the members share their input (mbgmm.group_fits; each member's expand is its own launch),
        else "per projection" (a mixed step's also where its decode rows' MBGMV cannot group: decode_lora_groups);
        logged, in /v1/status."""
        if not self.ops.fuses_groups:
            return {"qkv": "per projection", "gate_up": "per projection"}
        from lorad.gpu_ops.mbgmm import group_fits

        groups = {name: "one shrink launch" if group_fits(self.table, first, members) else "per projection"
                  for name, first, members in PROJECTION_GROUPS}
        log.info("prompt lora groups %s", " ".join(f"{name}={how.replace(' ', '-')}" for name, how in groups.items()))
        return groups

    def plan(self, batch: list[tuple[Sequence, int]], assisted: dict | None = None,
             device_tokens: torch.Tensor | None = None, device_rows=None) -> StepPlan:
        """The step's plan from the scheduler's batch (daemon/engine/step_plan.py), each adapter's slot read
        from its residency. device_tokens: the input ids of the sequences device_rows (all when None), on the
        device: the tokens of the step in flight (StepPlan.build)."""
        return StepPlan.build(batch, self.residency.slot, assisted, device_tokens, device_rows)

    def forward(self, plan: StepPlan, path: str | None = None) -> torch.Tensor:
        """Runs the step's forward -> logits [len(plan.sampled), vocab], in plan.sampled's order: replayed from a
        decode CUDA graph for a decode step, from a prefill graph (daemon/engine/prefill_graphs.py) for a step
        with prompt rows that fits one; eager when CPU assist computes some of its rows or adapters stream in.
        path: the one `path(plan)` chose (a tensor-parallel worker runs rank 0's choice: each path launches its
        own collectives)."""
        path = path or self.path(plan)
        if path == DECODE_GRAPH:
            logits = self.graphs.run(plan)
            self.graph_steps += 1
            self.graph_rows = self.graphs.last_key[0]
            return logits
        if path == PREFILL_GRAPH:
            # Streamed adapters' pages are queued before the graph that waits for them, layer by layer on their
            # own stream: the graph's LoRA kernels then wait on the device only for copies already queued
            # (AdapterTable.place_streamed says why that order, and not the launch first, is the safe one).
            self.residency.issue_streams()
            logits = self.prefill_graphs.run(plan)
            self.prefill_graph_steps += 1
            self.graph_rows = self.prefill_graphs.last_key[0]
            return logits
        # An eager forward as well (it may also wait for the device: a first launch of a kernel loads it).
        self.graph_rows = None
        self.residency.issue_streams()
        return self.model.forward(self.build_step(plan), self.kv.view, self.table)

    def path(self, plan: StepPlan) -> str:
        """How the step runs: DECODE_GRAPH, PREFILL_GRAPH or EAGER."""
        if self.graphs is not None and plan.decode and not plan.assisted and not self.residency.loading \
                and self.graphs.fits(len(plan.seqs), plan.max_blocks):
            return DECODE_GRAPH
        if self.prefill_graphs is not None and not plan.assisted \
                and self.prefill_graphs.fits(plan.num_tokens, len(plan.seqs), plan.max_blocks):
            return PREFILL_GRAPH
        return EAGER

    def build_step(self, plan: StepPlan) -> Step:
        """The eager forward's tensors from the plan, sent to the device. The rows of CPU-assisted sequences
        get slot -1 and a CpuSpan instead: the CPU workers compute their LoRA."""
        tokens_per_page, device = self.kv.tokens_per_page, self.device
        n = len(plan.tokens)
        first_rows = plan.first_rows()
        positions = np.concatenate([np.arange(start, start + count) for start, count in zip(plan.starts, plan.counts)])
        block_table = np.zeros((n, plan.max_blocks, self.spec.num_layers, 2), dtype=np.int32)
        dest, cpu_spans = [], []
        for index, blocks in enumerate(plan.blocks):
            block_table[index, : len(blocks)] = blocks
            dest.append(blocks[np.arange(plan.starts[index], plan.starts[index] + plan.counts[index]) // tokens_per_page])
        for index, seq in enumerate(plan.seqs):
            adapter_id = plan.assisted.get(seq)
            if adapter_id is None:
                continue
            first, count = int(first_rows[index]), int(plan.counts[index])
            held = self.held(seq.adapter)
            span = self.cold_starts.cpu_assist.span(seq.request_id, adapter_id, int(plan.slots[index]),
                                                    held.weights.keys(), first, first + count, rank=held.rank)
            # Its rows on the pool path (a layer whose copy arrived, or a failed job), built here:
            # the forward never builds metadata, which would copy to the device from pageable memory.
            span.gpu_batch = LoraBatch.build([span.slot] * count, device)
            self.ops.prepare_lora(span.gpu_batch, self.table)
            span.load = self.residency.loading.get(seq.adapter)
            cpu_spans.append(span)
        attention = AttentionBatch(
            block_table=torch.from_numpy(block_table.transpose(2, 3, 0, 1).copy()).to(device),
            dest_pages=torch.from_numpy(np.concatenate(dest).transpose(1, 2, 0).astype(np.int64)).to(device),
            dest_offsets=torch.from_numpy(positions % tokens_per_page).to(device),
            query_start=first_rows.tolist(),
            query_len=plan.counts.tolist(),
            kv_len=(plan.starts + plan.counts).tolist(),
        )
        sample_rows = (first_rows + plan.counts - 1)[plan.sample]
        if plan.every_token_on_device:
            input_ids = plan.device_tokens
        else:
            input_ids = torch.from_numpy(np.concatenate(plan.tokens)).to(device)
            if plan.device_tokens is not None:  # the decode rows of a step launched before the one in flight landed
                input_ids.index_copy_(0, torch.from_numpy(plan.device_input_rows()).to(device), plan.device_tokens)
        step = Step(
            input_ids=input_ids,
            positions=torch.from_numpy(self.model.rope_rows(positions, plan.counts, (s.num_tokens for s in plan.seqs))).to(device),
            sample_rows=torch.from_numpy(sample_rows).to(device),
            attention=attention,
            lora=LoraBatch.build(plan.row_slots().tolist(), device, decode=plan.decode),
        )
        step.lora.cpu_spans = self.step_spans = cpu_spans
        step.lora.cpu_assist = self.cold_starts.cpu_assist
        self.ops.prepare_lora(step.lora, self.table)
        return step
