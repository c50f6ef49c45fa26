"""The LoRA part of a projection, `y += (x @ A^T) @ B^T` per row with each row's own adapter, reading
the adapter weights where they lie in the unified page pool.

This file holds the batch metadata and the pure-torch reference; the Triton kernels (BGMV, MBGMV for
decode, MBGMM for prefill) sit in their own files with the same semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorad.gpu_ops.page_pool import AdapterTable, gather_rows


@dataclass
class LoraBatch:
    """Built once per step by the runner; every layer and projection reads it.

    row_slot: int32 [T] on the device, the adapter slot of each row (-1: base model only).
    slot_rows: host list of (slot, row indices as a device int64 tensor), one entry per slot present.
    decode: a decode step's batch (each row one sequence's next token: daemon/engine/step_plan.py), whose
    LoRA the decode kernels (BGMV, MBGMV) take; any other batch's goes to MBGMM.
    one_row_slot: in a batch that is not a decode step, int32 [n] on the device for its first n rows: the
    slot of each row MBGMV computes (one-token rows, each with its own adapter), -1 for the others, which
    MBGMM's segments hold (daemon/engine/prefill_graphs.py); None: MBGMM takes every row.
    untargeted: the projections (llama.py's Q..DOWN) that no row's adapter targets in any layer: their LoRA
    is not launched (an empty launch still schedules every program of its grid, ~10 us a projection pair on a
    64-row decode step). Empty: every projection is launched.
    """

    row_slot: torch.Tensor
    slot_rows: list[tuple[int, torch.Tensor]]
    decode: bool = False
    one_row_slot: torch.Tensor | None = None
    segments: object = None  # the kernels' per-step metadata (mbgmm.Segments), when they run
    max_rank: int = 0
    untargeted: frozenset[int] = frozenset()
    decode_kernel: str = "mbgmv"  # the step's decode LoRA kernel, bgmv|mbgmv (daemon/engine/kernel_choice.py)
    # Rows whose LoRA the CPU workers compute (their row_slot is -1 here): daemon/engine/cpu_assist.py's
    # CpuSpan per CPU-assisted sequence, and the CpuAssist that computes them (daemon/model/ops.py calls it).
    cpu_spans: list = field(default_factory=list)
    cpu_assist: object = None

    @classmethod
    def build(cls, row_slots: list[int], device: torch.device, decode: bool = False) -> LoraBatch:
        row_slot = torch.tensor(row_slots, dtype=torch.int32)
        slot_rows = []
        for slot in sorted(set(row_slots)):
            if slot >= 0:
                rows = (row_slot == slot).nonzero().squeeze(1)
                slot_rows.append((slot, rows.to(device)))
        return cls(row_slot.to(device), slot_rows, decode=decode)


def apply_lora_ref(
    x: torch.Tensor, y: torch.Tensor, layer: int, proj: int, batch: LoraBatch, table: AdapterTable
) -> None:
    """x: [T, in]; y: [T, out], accumulated in place. One gather + two GEMMs per adapter present.

    Reads the table's host mirrors for ranks and starts, so it never synchronises with the device.
    """
    in_dim, out_dim = table.shapes[proj]
    chunks_in, chunks_out = table.chunks[proj]
    pages = table.pool.pages
    for slot, rows in batch.slot_rows:
        rank = int(table.rank_host[slot, layer, proj])
        if rank == 0:
            continue
        a = gather_rows(pages, table.page_ids, int(table.a_start_host[slot, layer, proj]), rank, chunks_in, in_dim)
        b_t = gather_rows(pages, table.page_ids, int(table.b_start_host[slot, layer, proj]), rank, chunks_out, out_dim)
        y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b_t)
