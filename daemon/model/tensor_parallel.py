"""Tensor parallelism (Megatron's column-then-row split, S-LoRA's sharding of LoRA): what each rank holds of the
model and of every adapter, and the one collective the forward needs.

Rank r of N holds, of every layer:
- q, k, v, gate, up (column-parallel): its rows of the weight (its attention heads, its MLP columns). LoRA: A
  whole, its rows of B. Its output is its own slice: no collective.
- o, down (row-parallel): its columns of the weight (the inputs its heads and MLP columns produced). LoRA: its
  columns of A, B whole. Its output is a partial sum over the ranks: one all-reduce of [T, hidden] after the
  projection (`all_reduce`, LlamaModel.reduce), with the LoRA already added in.

The LoRA of o and down is fused into that all-reduce: each rank adds (x_r A_r^T) B^T to its partial y_r, and the
sum over r of (x_r A_r^T) B^T is (x A^T) B^T by linearity, exactly. Reducing the shrink's [T, rank] partials
first and expanding once costs a second all-reduce per projection; the fused order costs none, and each rank's
expand is the same [T, rank] x [rank, hidden] product one GPU runs (the N-fold is in FLOPs summed over the GPUs,
not on any one, so no step is longer).

S-LoRA's own partition (its section 6) holds no weight twice: for a column-parallel projection A is split along
the rank (an all-gather of the shrink's [T, rank / N] parts before the expand), for a row-parallel one B along its
outputs (the shrink's [T, rank] partials all-reduced first). That is four small collectives per layer on top of the
base model's two (q, k, v's all-gathers merged into one, gate and up's into one; seven unmerged), 160 a step on a
40-layer model, each a latency of ~10 us or more however few its bytes, which a decode step of a few milliseconds
cannot hide. Here the adapters add none. The price is memory: a rank holds
(in + out / N) of a column-parallel projection's LoRA and (in / N + out) of a row-parallel one's, about 0.75 of a
whole adapter at N = 2 against S-LoRA's 0.5, and it reads the whole A of q, k, v, gate, up in each shrink (rank x
hidden elements: small beside the base weights a decode step reads).

The embeddings, the LM head and the norms are whole on every rank, so every rank holds the same residual
stream and the same logits (rank 0 samples). The KV heads are split with the query heads that read them; a
size above the KV heads' count replicates each KV head over size / kv_heads ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lorad.daemon.model.adapters import weights_nbytes
from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec, safetensors_files
from lorad.daemon.model.llama import DOWN, GATE, K, O, Q, UP, V
from lorad.errors import BadRequest, ModelError

log = logging.getLogger(__name__)

COLUMN_PARALLEL = (Q, K, V, GATE, UP)  # output features split: A whole, B's rows split
ROW_PARALLEL = (O, DOWN)  # input features split: A's columns split, B whole
# The architectures whose checkpoint names the shard reads (a fused qkv or gate_up tensor would need its own split).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# A collective that has not completed in this long fails (gloo raises; NCCL's watchdog aborts the process): a rank
# that hangs takes the engine down instead of leaving the others waiting forever (one that dies is seen at once:
# daemon/engine/tp_worker.py). Long enough for a rank compiling its kernels while another waits at a collective.
COLLECTIVE_TIMEOUT_S = 300.0


def check_size(spec: ModelSpec, size: int) -> None:
    """BadRequest naming tensor_parallel_size and the shape that refuses it; None when `size` can split `spec`."""
    if size == 1:
        return
    if spec.architecture not in ARCHITECTURES:
        raise BadRequest(f"tensor_parallel_size {size}: {spec.architecture} is not split across GPUs "
                         f"(one of {', '.join(ARCHITECTURES)} is)")
    problems = []
    if spec.num_heads % size:
        problems.append(f"the {spec.num_heads} attention heads")
    if spec.num_kv_heads % size and size % spec.num_kv_heads:
        problems.append(f"the {spec.num_kv_heads} KV heads (a size above them must be a multiple of them: "
                        "each KV head is then replicated)")
    if spec.intermediate_size % size:
        problems.append(f"the intermediate size {spec.intermediate_size}")
    if problems:
        raise BadRequest(f"tensor_parallel_size {size} does not divide {' and '.join(problems)}")
    # A page (ModelSpec.page_elems) holds whole K rows of every KV head: of the rank's share of them (a divisor of
    # them, or one head replicated) too.


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model of shape `spec` (the whole model's)."""

    spec: ModelSpec
    rank: int
    size: int

    def __post_init__(self):
        check_size(self.spec, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.size - 1}")

    @property
    def local(self) -> ModelSpec:
        """The shape this rank computes: its heads, KV heads and MLP columns; hidden size, vocabulary and layers
        whole. LlamaModel, the KV cache and the adapter table are built on it unchanged."""
        spec, size = self.spec, self.size
        return dataclasses.replace(spec, num_heads=spec.num_heads // size, num_kv_heads=max(spec.num_kv_heads // size, 1),
                                   intermediate_size=spec.intermediate_size // size)

    def features(self, projection: int) -> tuple[int, int]:
        """[start, stop) of the features this rank holds of a projection: outputs of a column-parallel one, inputs
        of a row-parallel one."""
        spec, rank, size = self.spec, self.rank, self.size
        if projection in (Q, O):
            width = spec.q_size // size
            return rank * width, (rank + 1) * width
        if projection in (K, V):
            if spec.num_kv_heads >= size:
                width = spec.kv_size // size
                return rank * width, (rank + 1) * width
            head = rank // (size // spec.num_kv_heads)  # the KV head this rank's query heads read
            return head * spec.head_dim, (head + 1) * spec.head_dim
        width = spec.intermediate_size // size
        return rank * width, (rank + 1) * width

    def weight_split(self, name: str) -> tuple[int, int, int] | None:
        """(dimension, start, stop) of this rank's part of checkpoint tensor `name`; None: held whole."""
        for projection, proj_name in enumerate(PROJECTIONS):
            if f".{proj_name}." not in name:
                continue
            start, stop = self.features(projection)
            if name.endswith(".bias"):
                return (0, start, stop) if projection in COLUMN_PARALLEL else None
            return (0 if projection in COLUMN_PARALLEL else 1), start, stop
        return None

    def take(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a whole model's tensors (random weights; tests), each contiguous."""
        taken = {}
        for name, tensor in weights.items():
            split = self.weight_split(name)
            taken[name] = tensor if split is None else tensor.narrow(split[0], split[1], split[2] - split[1]).contiguous()
        return taken

    def read_weights(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's part of every checkpoint tensor, reading only its slices of the safetensors files."""
        weights = {}
        for path in safetensors_files(Path(model_dir)):
            try:
                with safe_open(str(path), framework="pt") as shard:
                    for name in shard.keys():
                        split = self.weight_split(name)
                        if split is None:
                            tensor = shard.get_tensor(name)
                        else:
                            dimension, start, stop = split
                            part = shard.get_slice(name)
                            tensor = part[start:stop] if dimension == 0 else part[:, start:stop]
                        weights[name] = tensor.to(device=device, dtype=dtype).contiguous()
            except (OSError, RuntimeError, SafetensorError) as error:
                raise ModelError(f"cannot read {path}: {error}") from error
        return weights

    def adapter(self, adapter):
        """This rank's part of a LoraAdapter (daemon/model/adapters.py): A whole and B's rows of a column-parallel
        projection, A's columns and B whole of a row-parallel one. Ranks and scaling unchanged."""
        weights = {}
        for (layer, projection), (a, b) in adapter.weights.items():
            start, stop = self.features(projection)
            if projection in COLUMN_PARALLEL:
                weights[(layer, projection)] = (a, b[start:stop].contiguous())
            else:
                weights[(layer, projection)] = (a[:, start:stop].contiguous(), b)
        return dataclasses.replace(adapter, weights=weights, nbytes=weights_nbytes(weights))


def init_group(rank: int, size: int, device: torch.device, address: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> str:
    """Joins the ranks' process group (torch.distributed's default group: NCCL on cuda, gloo on the cpu) through
    `address` (tcp://127.0.0.1:PORT, rank 0 listens) -> the backend. Every collective, the rendezvous included,
    fails after timeout_s."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    options = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device  # NCCL's communicator made now, bound to this GPU
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s), **options)
    log.info("tensor parallel group joined rank=%d size=%d backend=%s device=%s", rank, size, backend, device)
    return backend


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of each rank's partial `tensor`, in place (capturable in a CUDA graph with NCCL)."""
    import torch.distributed as dist

    dist.all_reduce(tensor)
    return tensor


# A decode step's sums go through the fused peer sum up to this many rows (the running cap's top, 256: 2.5 MB of a
# 13B model's rows); steps with more (prompt rows) sum through NCCL, whose ring moves each byte fewer times.
PEER_SUM_MAX_ROWS = 256
# Whether this process has mapped symmetric memory (PeerSum's rendezvous). torch numbers the store exchanges of a
# rendezvous per process, from zero: a process that mapped buffers for an earlier engine (a test's or a script's
# rank 0) would wait on other keys than its new workers, which start from zero, with no timeout. A second engine in
# one process sums through NCCL instead (on two H100s the second fused engine of a process hung in its start: the
# cause inferred from torch's code, not traced).
_mapped_in_this_process = False


class PeerSum:
    """LlamaModel.reduce_norm under tensor parallelism on two GPUs (EngineConfig.all_reduce fused): o's and down's
    partial outputs summed over the two ranks with the residual add and the RMSNorm after them, in one kernel that
    reads the other GPU's partial from its symmetric memory over NVLink (gpu_ops/peer_sum.py), for steps of up to
    max_rows rows; None for larger ones, which LlamaModel sums through `all_reduce`.

    Set up only where the process group is NCCL's over two ranks, every rank allocated and mapped the buffers, and
    a probe summed right on every rank; else `buffers` is None (every sum through NCCL) and `path` says why. Made by
    every rank at the same point (its setup is collective), after the process group and before any CUDA graph is
    captured; its launches are captured in the graphs like any kernel's."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device, max_rows: int = PEER_SUM_MAX_ROWS):
        import torch.distributed as dist

        self.buffers = None
        backend, size = dist.get_backend(), dist.get_world_size()
        if backend != "nccl" or size != 2:
            reason = f"it sums two GPUs' partials (here {size} ranks over {backend})"
        else:
            reason = self._set_up(hidden, dtype, device, max_rows)
        self.path = (f"fused peer sum up to {max_rows} rows, nccl above" if reason is None
                     else f"{backend} (fused peer sum unavailable: {reason})")

    def _set_up(self, hidden: int, dtype: torch.dtype, device: torch.device, max_rows: int) -> str | None:
        """None once both ranks hold the buffers and summed a probe right; else why not (the same on both)."""
        import torch.distributed as dist

        from lorad.gpu_ops.peer_sum import HALVES, PeerBuffers

        global _mapped_in_this_process
        rank, reason = dist.get_rank(), None
        if _mapped_in_this_process:
            reason = "this process mapped symmetric memory for an earlier engine (its exchanges would not match)"
        if not _agreed(reason is None, device):
            return reason or "the other rank mapped symmetric memory for an earlier engine"
        try:  # allocated on both ranks before either waits for the other in the rendezvous
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            if _torch_before(2, 9):  # the group's symmetric memory was opt-in before torch 2.9 (deprecated since)
                symm_mem.enable_symm_mem_for_group(group)
            mine = symm_mem.empty((HALVES, max_rows, hidden), dtype=dtype, device=device)
            flags = symm_mem.empty((HALVES, max_rows), dtype=torch.int32, device=device)
            flags.zero_()
        except Exception as error:  # no symmetric memory here (an older torch, no peer access, a sandbox's syscalls)
            reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        if not _agreed(reason is None, device):
            return reason or "the other rank could not allocate its buffers"
        _mapped_in_this_process = True  # from the first exchange on, whatever its outcome
        try:
            mapped, mapped_flags = symm_mem.rendezvous(mine, group), symm_mem.rendezvous(flags, group)
            peer = 1 - rank
            buffers = PeerBuffers(mine, mapped.get_buffer(peer, tuple(mine.shape), dtype),
                                  flags, mapped_flags.get_buffer(peer, tuple(flags.shape), torch.int32))
        except Exception as error:
            reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        if not _agreed(reason is None, device):  # no rank runs the probe's handshake unless both can
            return reason or "the other rank could not map the buffers"
        torch.cuda.synchronize(device)
        dist.barrier()  # both ranks' flags are zero before either raises one
        self.buffers = buffers
        try:
            for half in (0, 1):  # each half once, in the order the model alternates them
                h = torch.zeros(3, hidden, dtype=dtype, device=device)
                partial = torch.full((3, hidden), float(rank + 1), dtype=dtype, device=device)
                weight = torch.ones(hidden, dtype=dtype, device=device)
                h, _ = self(h, partial, weight, 1e-6, half)
                if not torch.equal(h, torch.full_like(h, 3.0)):
                    reason = "its probe summed wrong"
        except Exception as error:
            reason = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        if not _agreed(reason is None, device):
            self.buffers = None
            return reason or "the other rank's probe failed"
        return None

    def __call__(self, h: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor, eps: float,
                 half: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h, normed) with h += the sum of both ranks' `partial`; None where the buffers do not take it (the same
        answer on both ranks: it depends on the step's rows, the model's shape and dtype, which they share)."""
        if self.buffers is None or not self.buffers.fits(partial) or not partial.is_contiguous() or not h.is_contiguous():
            return None
        from lorad.gpu_ops.peer_sum import peer_sum_add_rms_norm

        return peer_sum_add_rms_norm(h, partial, weight, eps, self.buffers, half)


def _torch_before(major: int, minor: int) -> bool:
    return tuple(int(part) for part in torch.__version__.split(".")[:2]) < (major, minor)


def _agreed(ok: bool, device: torch.device) -> bool:
    """Whether every rank says ok (a collective: every rank asks at the same point)."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank, in place."""
    import torch.distributed as dist

    dist.broadcast(tensor, src=0)
    return tensor


DRAIN_TIMEOUT_S = 20.0  # a rank's device work left at close; longer means a collective waits for a rank not in it


def device_drained(timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Whether this rank's device work ends within timeout_s (True off NCCL: gloo's collectives run on the host).
    Where it does not, a collective waits for a rank that did not launch it (the ranks ran different steps): logged.
    Anything that waits for the device unbounded (torch.cuda.synchronize, releasing CUDA graphs) must come after
    this returned True, or it waits for ever."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return True
    if _device_done(timeout_s):
        return True
    log.error("rank %d: its device work did not finish within %.0f s of leaving the group: a collective waits "
              "for a rank that did not launch it (the ranks ran different steps); aborting the group",
              dist.get_rank(), timeout_s)
    return False


def leave_group(drain: bool = True) -> None:
    """Leaves the group. Gloo's is destroyed. NCCL's is aborted, after this rank's device work is done where `drain`
    (its collectives then have had every rank's part, so no peer is left waiting in one): its orderly teardown
    (destroy_process_group) hung on the GPU machine with every rank in it. Pass drain=False when a rank is gone (a
    collective in flight would never finish), or when device_drained was asked already. Work that does not finish
    within DRAIN_TIMEOUT_S is logged as the ranks being out of step, and the group aborted anyway."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    if drain:
        device_drained()
    distributed_c10d._abort_process_group()  # ends the communicators without waiting for the peers


def _device_done(timeout_s: float) -> bool:
    """Whether the current stream's work ends within timeout_s (torch.cuda.synchronize would wait for ever)."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
