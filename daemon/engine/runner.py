"""The model on the device and how one step runs on it: the op set and the decoder (daemon/model/), the step's
metadata built once on the host (`build_step`), and its forward, replayed from a decode CUDA graph or a prefill
graph where one fits (decode_graphs.py, prefill_graphs.py), eager otherwise. The engine owns the pool, the
queue and the step loop; it hands the runner the KV cache and adapter table (`bind`), and the adapter residency
and cold starts its steps read.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.decode_graphs import DecodeGraphs
from lorad.daemon.engine.prefill_graphs import PrefillGraphs, StepSeq
from lorad.daemon.model.checkpoint import ModelSpec
from lorad.daemon.model.llama import LlamaModel, Step
from lorad.daemon.model.ops import select_ops
from lorad.errors import BadRequest
from lorad.gpu_ops.attention import AttentionBatch
from lorad.gpu_ops.lora import LoraBatch
from lorad.gpu_ops.page_pool import AdapterTable, KVCache
from lorad.scheduler.batching import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device, weights: dict[str, torch.Tensor],
                 max_model_len: int, kernel_choice):
        self.config, self.spec, self.device, self.max_model_len = config, spec, device, max_model_len
        self.kernel_choice = kernel_choice
        self.lora_pdl = self._lora_pdl()
        self.ops = select_ops(device, config.max_batch_tokens, config.max_lora_rank, kernel_choice,
                              fuse_groups=config.fuse_lora_groups, pdl=self.lora_pdl["on"])
        self.model = LlamaModel(spec, weights, max_model_len, self.ops)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graph_steps = self.prefill_graph_steps = 0
        self.step_spans: list = []  # the last eager step's CPU-assisted spans
        # Set by the engine once they exist: the adapters' place in the pool, the cold starts, and the adapter
        # each request in the engine holds.
        self.residency = self.cold_starts = self.held = None

    def bind(self, kv: KVCache, table: AdapterTable) -> None:
        """The KV cache and adapter table the steps read; on cuda (unless eager) the CUDA graphs captured."""
        self.kv, self.table = kv, table
        self.lora_groups = self._lora_groups()
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

    def _lora_pdl(self) -> dict:
        """Whether decode steps launch the MBGMV expand early (config.lora_pdl): {"on": bool, "why": why it is off};
        logged, in /v1/status. lora_pdl on where the device or triton cannot is refused."""
        wanted = self.config.lora_pdl
        if wanted == "off":
            return {"on": False, "why": "lora_pdl off"}
        if self.device.type != "cuda":
            reason = f"{self.device.type}: reference ops"
        else:
            from lorad.gpu_ops.mbgmv import pdl_unavailable

            reason = pdl_unavailable(self.device)
        if reason is not None and wanted == "on":
            raise BadRequest(f"lora_pdl on cannot run here: {reason}")
        log.info("decode lora pdl=%s", "on" if reason is None else f"off ({reason})")
        return {"on": reason is None, "why": reason}

    def _lora_groups(self) -> dict[str, str]:
        """How decode steps launch the LoRA of q,k,v and of gate,up (config.fuse_lora_groups): "one launch"
        where the members' tiles agree (mbgmv.group_fits), else "per projection"; logged, in /v1/status."""
        if not self.ops.fuses_groups:  # fuse_lora_groups off, or the reference ops
            return {"qkv": "per projection", "gate_up": "per projection"}
        from lorad.gpu_ops.mbgmv import group_fits

        groups = {name: "one launch" if group_fits(self.table, first, members, self.config.max_lora_rank, pdl=self.lora_pdl["on"])
                  else "per projection"
                  for name, first, members in (("qkv", 0, 3), ("gate_up", 4, 2))}
        log.info("decode lora groups %s", " ".join(f"{name}={how.replace(' ', '-')}" for name, how in groups.items()))
        return groups

    def forward(self, plan: list[tuple[Sequence, int]], assisted: dict | None = None,
                 device_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs the step's forward: replayed from a decode CUDA graph when every sequence decodes one token,
        from a prefill graph (daemon/engine/prefill_graphs.py) when the step has prompt rows and fits one; eager
        when CPU assist computes some of its rows. device_tokens: a decode step's input ids, on the device
        (overlapped decode), in place of each sequence's last token."""
        if self.graphs is not None and not assisted and not self.residency.loading \
                and all(count == 1 and seq.num_computed + 1 == seq.num_tokens for seq, count in plan):
            max_blocks = max(len(seq.blocks) for seq, _ in plan)
            if self.graphs.fits(len(plan), max_blocks):
                seqs = [seq for seq, _ in plan]
                logits = self.graphs.run(
                    np.array([seq.tokens[-1] for seq in seqs]),
                    np.array([seq.num_computed for seq in seqs]),
                    np.array([self.residency.slot(seq.adapter) for seq in seqs]),
                    [seq.blocks.array() for seq in seqs],
                    device_tokens,
                )
                self.graph_steps += 1
                return logits, seqs
        if self.prefill_graphs is not None and not assisted and device_tokens is None:
            num_tokens = sum(count for _, count in plan)
            if self.prefill_graphs.fits(num_tokens, len(plan), max(len(seq.blocks) for seq, _ in plan)):
                seqs = [StepSeq(np.asarray(seq.tokens[seq.num_computed : seq.num_computed + count]), seq.num_computed,
                                self.residency.slot(seq.adapter), seq.blocks.array(), seq.num_computed + count == seq.num_tokens)
                        for seq, count in plan]
                logits = self.prefill_graphs.run(seqs)
                # Streamed adapters' pages go out now, while the graph runs: its LoRA kernels wait for each
                # layer on the device (AdapterTable.place_streamed). Nothing above waited for the device.
                self.residency.issue_streams()
                self.prefill_graph_steps += 1
                return logits, [seq for seq, count in plan if seq.num_computed + count == seq.num_tokens]
        # An eager forward may wait for the device (a first launch of a kernel loads it): everything its
        # kernels wait for is queued before it.
        self.residency.issue_streams()
        step, sampled = self.build_step(plan, assisted or {})
        if device_tokens is not None:
            step.input_ids = device_tokens
        return self.model.forward(step, self.kv.view, self.table), sampled

    def build_step(self, plan: list[tuple[Sequence, int]], assisted: dict) -> tuple[Step, list[Sequence]]:
        """The step's metadata, built once on the host and sent to the device. The rows of
        cpu-assisted sequences get slot -1 and a CpuSpan instead: the CPU workers compute their LoRA."""
        tokens_per_page = self.kv.tokens_per_page
        num_layers = self.spec.num_layers
        input_ids, positions, row_slots = [], [], []
        query_start, query_len, kv_len, sample_rows, sampled = [], [], [], [], []
        max_blocks = max(len(seq.blocks) for seq, _ in plan)
        block_table = np.zeros((len(plan), max_blocks, num_layers, 2), dtype=np.int32)
        dest, cpu_spans = [], []
        device = self.device
        for index, (seq, count) in enumerate(plan):
            start, first_row = seq.num_computed, len(input_ids)
            query_start.append(first_row)
            query_len.append(count)
            kv_len.append(start + count)
            input_ids.extend(seq.tokens[start : start + count])
            positions.extend(range(start, start + count))
            adapter_id = assisted.get(seq)
            if adapter_id is None:
                row_slots.extend([self.residency.slot(seq.adapter)] * count)
            else:
                row_slots.extend([-1] * count)
                held = self.held(seq.adapter)
                span = self.cold_starts.cpu_assist.span(seq.request_id, adapter_id, self.residency.slot(seq.adapter),
                                            held.weights.keys(), first_row, first_row + count, rank=held.rank)
                # Its rows on the pool path (a layer whose copy arrived, or a failed job), built here:
                # the forward never builds metadata, which would copy to the device from pageable memory.
                span.gpu_batch = LoraBatch.build([span.slot] * count, device)
                self.ops.prepare_lora(span.gpu_batch, self.table)
                span.load = self.residency.loading.get(seq.adapter)
                cpu_spans.append(span)
            blocks = seq.blocks.array()
            block_table[index, : len(blocks)] = blocks
            dest.append(blocks[np.arange(start, start + count) // tokens_per_page])
            if start + count == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        positions_np = np.asarray(positions, dtype=np.int64)
        attention = AttentionBatch(
            block_table=torch.from_numpy(block_table.transpose(2, 3, 0, 1).copy()).to(device),
            dest_pages=torch.from_numpy(np.concatenate(dest).transpose(1, 2, 0).astype(np.int64)).to(device),
            dest_offsets=torch.from_numpy(positions_np % tokens_per_page).to(device),
            query_start=query_start,
            query_len=query_len,
            kv_len=kv_len,
        )
        step = Step(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(positions_np).to(device),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
            attention=attention,
            lora=LoraBatch.build(row_slots, device),
        )
        step.lora.cpu_spans = self.step_spans = cpu_spans
        step.lora.cpu_assist = self.cold_starts.cpu_assist
        self.ops.prepare_lora(step.lora, self.table)
        return step, sampled
