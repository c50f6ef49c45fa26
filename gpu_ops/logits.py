"""The sampler's logits processing from per-slot tables (daemon/engine/sampler_state.py), each in one launch over a
step's rows: `process_rows` (min_tokens bans, logit bias, repetition, frequency and presence penalties, in place)
and `advance_rows` (the step's tokens appended to their slots and counted). The references `process_rows_ref` and
`advance_rows_ref` are the batched torch ops they replace: about twenty launches, and an index sort, a step.

Both are tiny in bytes (a step reads and writes [rows, bias + bans + tokens held] entries of the logits, never
[rows, vocab]): the kernels exist for the launches they save on the decode step's critical path.
"""

from __future__ import annotations

import torch

from lorad.gpu_ops.launch import next_power_of_2, require_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs the references only
    triton = None

__all__ = ["advance_rows", "advance_rows_ref", "process_rows", "process_rows_ref"]

REPETITION, FREQUENCY, PRESENCE = range(3)  # the columns of the penalties table
HELD_BLOCK = 1024  # tokens held, read per iteration of the kernel's loops


def process_rows_ref(logits: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor, banning: torch.Tensor,
                     penalties: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor, banned: torch.Tensor,
                     tokens: torch.Tensor, counts: torch.Tensor | None, scratch: torch.Tensor | None, *,
                     bias_width: int, banned_width: int, held_width: int, repetition: bool) -> None:
    """In place, the rows of logits [N, vocab] float32 (rows [R] int64, or None: all N, in order) of the slots
    slots [R] int64, in this order: the ids banned[slot, :banned_width] to -inf where banning [R] is nonzero;
    bias_values[slot, :bias_width] added at bias_ids (padded with a bias of +0.0); then over each row's tokens
    held tokens[slot, :held_width] (prompt then output, padded with a token it holds): the repetition penalty
    (penalties[slot, 0]: a positive logit divided by it, another multiplied) when `repetition`, and when counts
    [slots, vocab] float32 is given, minus frequency x count and presence x [count > 0] (penalties[slot, 1:3]).
    A token held more than once is computed from its logit before any of them is written, so it is penalized once.
    scratch: the kernel's; unused here."""
    block = logits if rows is None else logits.index_select(0, rows)
    if banned_width:
        ids = banned.index_select(0, slots)[:, :banned_width]
        block.scatter_(1, ids, torch.where(banning[:, None] > 0, float("-inf"), block.gather(1, ids)))
    if bias_width:
        block.scatter_add_(1, bias_ids.index_select(0, slots)[:, :bias_width],
                           bias_values.index_select(0, slots)[:, :bias_width])
    if repetition or counts is not None:
        held = tokens[:, :held_width].index_select(0, slots)
        values = block.gather(1, held)
        rates = penalties.index_select(0, slots)
        if repetition:
            penalty = rates[:, REPETITION : REPETITION + 1]
            values = torch.where(values > 0, values / penalty, values * penalty)
        if counts is not None:
            seen = counts[slots[:, None], held]
            frequency, presence = rates[:, FREQUENCY : FREQUENCY + 1], rates[:, PRESENCE : PRESENCE + 1]
            values = values - frequency * seen - presence * (seen > 0).to(block.dtype)
        block.scatter_(1, held, values)
    if rows is not None:
        logits.index_copy_(0, rows, block)


def process_rows(logits: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor, banning: torch.Tensor,
                 penalties: torch.Tensor, bias_ids: torch.Tensor, bias_values: torch.Tensor, banned: torch.Tensor,
                 tokens: torch.Tensor, counts: torch.Tensor | None, scratch: torch.Tensor | None, *,
                 bias_width: int, banned_width: int, held_width: int, repetition: bool) -> None:
    """process_rows_ref in one launch: a program a row applies the bias, then computes each held token's
    penalized logit into scratch [slots, >= held_width] float32 (reading the biased logits, none written yet),
    then writes them, then the bans (last: a banned logit is -inf whatever the bias and penalties do to it, as
    when banned first). Barriers between the phases order one row's reads and writes; rows never share one.
    Exact against the reference: IEEE division, no fused multiply-add (the reference rounds each product)."""
    require_triton("logits-processing kernels")
    count = slots.shape[0]
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError("process_rows: logits must be contiguous float32")
    penalized = repetition or counts is not None
    if penalized and (scratch is None or scratch.shape[1] < held_width or scratch.stride() != tokens.stride()):
        raise ValueError("process_rows: scratch must be laid out as tokens, at least held_width wide")
    if count == 0:
        return
    _process_kernel[(count,)](
        logits, rows if rows is not None else slots, slots, banning, penalties, bias_ids, bias_values, banned, tokens,
        counts if counts is not None else penalties, scratch if scratch is not None else penalties,
        logits.stride(0), bias_ids.stride(0), banned.stride(0), tokens.stride(0),
        counts.stride(0) if counts is not None else 0, bias_width, banned_width, held_width,
        int(rows is None), int(repetition), int(counts is not None),
        BIAS_BLOCK=next_power_of_2(bias_ids.shape[1]), BANNED_BLOCK=next_power_of_2(max(banned.shape[1], 1)),
        HELD_BLOCK=HELD_BLOCK, num_warps=4, enable_fp_fusion=False,
    )


def advance_rows_ref(tokens: torch.Tensor, counts: torch.Tensor | None, rows: torch.Tensor | None,
                     slots: torch.Tensor, positions: torch.Tensor, drawn: torch.Tensor) -> None:
    """The step's tokens drawn [N] int64 (one per row of its logits) of the rows `rows` [R] (None: all N, in
    order) written to tokens[slot, position] and, when counts is given, counted there (+1.0)."""
    picked = drawn if rows is None else drawn.index_select(0, rows)
    tokens.index_put_((slots, positions), picked)
    if counts is not None:
        counts.index_put_((slots, picked), torch.ones((), dtype=counts.dtype, device=counts.device), accumulate=True)


def advance_rows(tokens: torch.Tensor, counts: torch.Tensor | None, rows: torch.Tensor | None,
                 slots: torch.Tensor, positions: torch.Tensor, drawn: torch.Tensor) -> None:
    """advance_rows_ref in one launch, one row a program (the slots of a step are distinct: no two rows add to
    the same count)."""
    require_triton("logits-processing kernels")
    if drawn.dtype != torch.long:
        raise ValueError("advance_rows: drawn tokens must be int64")
    count = slots.shape[0]
    if count == 0:
        return
    _advance_kernel[(count,)](
        tokens, counts if counts is not None else tokens, rows if rows is not None else slots, slots, positions, drawn,
        tokens.stride(0), counts.stride(0) if counts is not None else 0, int(rows is None), int(counts is not None),
        num_warps=1, enable_fp_fusion=False,
    )


if triton is not None:

    # What changes from step to step is a runtime argument, never specialized on (nor the alignment of the step's
    # index, whose rows are views at offsets of 8 x rows bytes): one compiled kernel serves every step of an engine
    # (the blocks are the tables' widths), instead of a compilation, on the decode loop, per mix.
    @triton.jit(do_not_specialize=["bias_width", "banned_width", "held_width", "all_rows", "repetition", "counted"],
                do_not_specialize_on_alignment=["rows", "slots", "banning"])
    def _process_kernel(logits, rows, slots, banning, penalties, bias_ids, bias_values, banned, tokens, counts, scratch,
                        logits_stride, bias_stride, banned_stride, tokens_stride, counts_stride,
                        bias_width, banned_width, held_width, all_rows, repetition, counted,
                        BIAS_BLOCK: tl.constexpr, BANNED_BLOCK: tl.constexpr, HELD_BLOCK: tl.constexpr):
        i = tl.program_id(0)
        slot = tl.load(slots + i)
        if all_rows != 0:
            row = i.to(tl.int64)
        else:
            row = tl.load(rows + i)
        line = logits + row * logits_stride

        # Bias: a row's ids are distinct (SamplingParams refuses a repeated one), the padding's +0.0 is skipped.
        j = tl.arange(0, BIAS_BLOCK)
        ids = tl.load(bias_ids + slot * bias_stride + j, mask=j < bias_width, other=0)
        add = tl.load(bias_values + slot * bias_stride + j, mask=j < bias_width, other=0.0)
        biased = (j < bias_width) & (add != 0.0)
        tl.store(line + ids, tl.load(line + ids, mask=biased) + add, mask=biased)
        tl.debug_barrier()

        if repetition + counted != 0:
            penalty = tl.load(penalties + slot * 3 + 0)
            frequency = tl.load(penalties + slot * 3 + 1)
            presence = tl.load(penalties + slot * 3 + 2)
            for start in range(0, held_width, HELD_BLOCK):
                k = start + tl.arange(0, HELD_BLOCK)
                inside = k < held_width
                held = tl.load(tokens + slot * tokens_stride + k, mask=inside, other=0)
                values = tl.load(line + held, mask=inside, other=0.0)
                if repetition != 0:
                    values = tl.where(values > 0, tl.math.div_rn(values, penalty), values * penalty)
                if counted != 0:
                    seen = tl.load(counts + slot * counts_stride + held, mask=inside, other=0.0)
                    values = values - frequency * seen - presence * (seen > 0).to(tl.float32)
                tl.store(scratch + slot * tokens_stride + k, values, mask=inside)
            tl.debug_barrier()
            for start in range(0, held_width, HELD_BLOCK):
                k = start + tl.arange(0, HELD_BLOCK)
                inside = k < held_width
                held = tl.load(tokens + slot * tokens_stride + k, mask=inside, other=0)
                tl.store(line + held, tl.load(scratch + slot * tokens_stride + k, mask=inside), mask=inside)
            tl.debug_barrier()

        if tl.load(banning + i) != 0:
            b = tl.arange(0, BANNED_BLOCK)
            bans = tl.load(banned + slot * banned_stride + b, mask=b < banned_width, other=0)
            tl.store(line + bans, tl.full((BANNED_BLOCK,), float("-inf"), tl.float32), mask=b < banned_width)

    @triton.jit(do_not_specialize=["all_rows", "counted"],
                do_not_specialize_on_alignment=["rows", "slots", "positions", "drawn"])
    def _advance_kernel(tokens, counts, rows, slots, positions, drawn, tokens_stride, counts_stride, all_rows, counted):
        i = tl.program_id(0)
        slot = tl.load(slots + i)
        if all_rows != 0:
            token = tl.load(drawn + i)
        else:
            token = tl.load(drawn + tl.load(rows + i))
        tl.store(tokens + slot * tokens_stride + tl.load(positions + i), token)
        if counted != 0:
            where = counts + slot * counts_stride + token
            tl.store(where, tl.load(where) + 1.0)
