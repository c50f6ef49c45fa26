"""Two tensor-parallel ranks' partial rows summed, then the residual add and the RMSNorm after it, in one kernel
that reads the other rank's partial over NVLink: what a decode step needs after each row-parallel projection (o,
down), where NCCL's all-reduce (~12 us for 64 rows of a 13B model on two H100s, BENCHMARKS.md) and the
add_rms_norm kernel after it are two launches and a fork to NCCL's stream and back. The reference is
`peer_sum_add_rms_norm_ref`.

Each rank holds `PeerBuffers` in torch's symmetric memory (allocated on both ranks, each mapping the other's): two
halves of [max_rows, hidden] partial rows and two halves of max_rows int32 flags. A call uses one half; the
engine's calls alternate them (the o sums half 0, the down sums half 1: a forward's sums alternate o, down, o, ...).
Program p of a call on half k:
1. copies this rank's partial row p into its buffer's half k;
2. raises flag p of half k in the *other* rank's flags (a release at system scope, after a barrier of the
   program's threads: every thread's copy is visible before the flag is);
3. waits until the other rank raised flag p of half k here (an acquire), then lowers it;
4. reads the other rank's row p (bypassing the caches: the same addresses hold an older call's rows), sums it with
   its own in float32 and rounds the sum to the partial's dtype (the exact sum of two bf16 values rounded once,
   which is what NCCL's sum gives: bench/all_reduce.py checks the two equal on the GPUs), adds it to the residual
   row h (rounded to h's dtype, as add_rms_norm does) and writes h and rms_norm(h).
Both ranks add the same two values, so both hold the same sum.

Why two halves and a flag per row suffice: a rank writes half k again two calls later, after its kernel of the
call between has finished; that kernel waited for the other rank's flags of that call, which the other rank raised
after its kernel of call k (reading half k) had finished, the kernels of one rank running in stream order. The
same order keeps a flag's next raise after its lowering.

A rank whose partner never raises its flag (the ranks ran different steps: a bug, or a rank hung) waits
TIMEOUT_S, then traps: the CUDA context fails, the rank's step raises and the engine goes down as it does for a
NCCL collective's timeout (daemon/engine/tp_worker.py), never a hang.
"""

from __future__ import annotations

import dataclasses

import torch

from lorad.gpu_ops.launch import next_power_of_2, require_triton
from lorad.gpu_ops.norm import add_rms_norm_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine runs the references only
    triton = None

__all__ = ["PeerBuffers", "peer_sum_add_rms_norm", "peer_sum_add_rms_norm_ref"]

# As the NCCL collectives' timeout (daemon/model/tensor_parallel.COLLECTIVE_TIMEOUT_S): long enough for the other
# rank to compile its kernels at their first launch while this one waits
TIMEOUT_S = 300.0
HALVES = 2


def peer_sum_add_rms_norm_ref(h: torch.Tensor, partial: torch.Tensor, theirs: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h += partial + theirs (the sum rounded to the partials' dtype first), in place -> (h, rms_norm(h))."""
    summed = (partial.float() + theirs.float()).to(partial.dtype)
    return add_rms_norm_ref(h, summed, weight, eps)


@dataclasses.dataclass
class PeerBuffers:
    """This rank's half of the pair: `mine` [HALVES, max_rows, hidden] and `flags` [HALVES, max_rows] int32 in its
    symmetric memory; `theirs` and `their_flags`, the other rank's, mapped here."""

    mine: torch.Tensor
    theirs: torch.Tensor
    flags: torch.Tensor
    their_flags: torch.Tensor
    last_half: int | None = None  # the half the last call launched on: the next must take the other

    @property
    def max_rows(self) -> int:
        return self.mine.shape[1]

    def fits(self, partial: torch.Tensor) -> bool:
        """Whether `partial` [T, hidden] can be summed here: its rows within max_rows, its hidden and dtype the buffers'."""
        return (partial.dim() == 2 and 0 < partial.shape[0] <= self.max_rows and partial.shape[1] == self.mine.shape[2]
                and partial.dtype == self.mine.dtype)


if triton is not None:

    from lorad.gpu_ops.fused import _add_norm_row
    from lorad.gpu_ops.mbgmm import _globaltimer

    @triton.jit
    def _trap():
        tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait_raised(flag_ptr, TIMEOUT_NS: tl.constexpr):
        """Spins until the flag is raised (an acquire at system scope), then lowers it; traps past TIMEOUT_NS."""
        raised = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if raised == 0:
            began = _globaltimer()
            waiting = 1
            while waiting != 0:
                raised = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
                late = (_globaltimer() - began) > TIMEOUT_NS
                waiting = tl.where((raised != 0) | late, 0, 1)
            if raised == 0:
                _trap()
        tl.atomic_xchg(flag_ptr, 0, sem="relaxed", scope="sys")

    @triton.jit
    def _peer_sum_add_rms_norm_kernel(partial_ptr, mine_ptr, theirs_ptr, flags_ptr, their_flags_ptr, h_ptr, weight_ptr,
                                      out_ptr, stride_pt, stride_ht, stride_ot, eps, HIDDEN: tl.constexpr,
                                      BLOCK: tl.constexpr, SCALE_F32: tl.constexpr, TIMEOUT_NS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < HIDDEN
        part = tl.load(partial_ptr + row * stride_pt + cols, mask=ok, other=0.0)
        tl.store(mine_ptr + row * HIDDEN + cols, part, mask=ok)
        tl.debug_barrier()  # every thread's copy before the flag that publishes it
        tl.atomic_xchg(their_flags_ptr + row, 1, sem="release", scope="sys")
        _wait_raised(flags_ptr + row, TIMEOUT_NS)
        tl.debug_barrier()  # no thread reads the other rank's row before the acquire
        theirs = tl.load(theirs_ptr + row * HIDDEN + cols, mask=ok, other=0.0, cache_modifier=".cv")
        summed = (part.to(tl.float32) + theirs.to(tl.float32)).to(partial_ptr.dtype.element_ty).to(tl.float32)
        _add_norm_row(h_ptr + row * stride_ht, summed, weight_ptr, out_ptr + row * stride_ot, cols, ok, eps, HIDDEN,
                      SCALE_F32)


def peer_sum_add_rms_norm(h: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor, eps: float,
                          buffers: PeerBuffers, half: int, timeout_s: float = TIMEOUT_S) -> tuple[torch.Tensor, torch.Tensor]:
    """peer_sum_add_rms_norm_ref with the other rank's partial read from `buffers` (half `half`), which that rank
    calls at the same point with its own partial: h [T, hidden] updated in place -> (h, rms_norm(h)). One program
    per row; both ranks must run the same T."""
    require_triton("peer-sum kernel")
    tokens, hidden = h.shape
    if not buffers.fits(partial) or partial.shape != h.shape or partial.stride(1) != 1 or h.stride(1) != 1:
        raise ValueError(f"partial {tuple(partial.shape)} {partial.dtype} and h {tuple(h.shape)} must be [T <= "
                         f"{buffers.max_rows}, {buffers.mine.shape[2]}] rows of {buffers.mine.dtype}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if half not in range(HALVES):
        raise ValueError(f"half must be 0 or 1, got {half}")
    if half == buffers.last_half:  # the other rank may still be reading this half's rows of the last call
        raise RuntimeError(f"two peer sums in a row on half {half}: calls must alternate the halves")
    buffers.last_half = half
    out = torch.empty(tokens, hidden, dtype=h.dtype, device=h.device)
    block = next_power_of_2(hidden)
    _peer_sum_add_rms_norm_kernel[(tokens,)](
        partial, buffers.mine[half], buffers.theirs[half], buffers.flags[half], buffers.their_flags[half], h, weight,
        out, partial.stride(0), h.stride(0), out.stride(0), eps, HIDDEN=hidden, BLOCK=block,
        SCALE_F32=weight.dtype == torch.float32, TIMEOUT_NS=int(timeout_s * 1e9), num_warps=max(1, min(16, block // 512)))
    return h, out
