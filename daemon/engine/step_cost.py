"""What one step must move and compute, and so the least time it can take on this device: the engine's own
accounting against its floor, the larger of bytes / HBM bandwidth and FLOPs / dense GEMM rate.

A step reads every weight once (each layer's projections and norms, the final norm, the embedding rows of
its tokens, the LM head when a row is sampled), reads each sequence's KV cache over its whole context (on a
sliding-window layer only the positions some new row sees: the last new_tokens + window - 1) and writes its
new tokens' K and V, and reads the A and B rows of every adapter in it once per targeted projection. Its
FLOPs are 2 per weight per row for the projections (the LM head for sampled rows only), attention's QK^T and
PV over each row's causal context (or window), and each adapter row's shrink and expand.

Two floors follow. The floor (`floor_s`) lets the step's reads and its arithmetic overlap in full: a mixed step's
prompt GEMMs, bound by the tensor cores, would hide its decode rows' KV reads, bound by HBM. The serial floor
(`serial_floor_s`) takes the step's three phases one after the other, as its kernels run them: the projections
(the weights read, their FLOPs), attention (the KV read, its FLOPs) and LoRA (the adapters' rows, their FLOPs),
each bound by memory or compute. Busy time over the serial floor is what the kernels lose to their own floors;
the serial floor over the floor is what running the phases one after the other costs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from lorad.daemon.model.checkpoint import PROJECTIONS, ModelSpec


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int
    kv_bytes: int
    adapter_bytes: int
    flops: int  # all of the step's: the projections', attention's and LoRA's
    attention_flops: int = 0  # of which QK^T and PV
    adapter_flops: int = 0  # of which the adapters' shrinks and expands

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.adapter_bytes

    def floor_s(self, bandwidth_bytes_per_s: float, flops_per_s: float) -> float:
        """The least time the step can take: bound by memory or by compute, whichever is slower."""
        return max(self.bytes / bandwidth_bytes_per_s, self.flops / flops_per_s)

    def serial_floor_s(self, bandwidth_bytes_per_s: float, flops_per_s: float) -> float:
        """The least time with its phases one after the other: the projections, attention and LoRA, each bound
        by its own bytes or its own FLOPs, whichever is slower; never below floor_s (where every phase is bound
        by memory the two are equal but for rounding, which max settles)."""
        projection_flops = self.flops - self.attention_flops - self.adapter_flops
        phases = sum(max(moved / bandwidth_bytes_per_s, computed / flops_per_s) for moved, computed in (
            (self.weight_bytes, projection_flops), (self.kv_bytes, self.attention_flops),
            (self.adapter_bytes, self.adapter_flops)))
        return max(phases, self.floor_s(bandwidth_bytes_per_s, flops_per_s))


@dataclass(frozen=True)
class SequenceInStep:
    new_tokens: int  # rows this sequence adds to the step
    context: int  # tokens in its KV cache once the step has run (earlier tokens + new_tokens)
    sampled: bool  # its last row's logits are computed
    adapter: str | None  # None: the base model alone


class StepCostModel:
    """StepCost of a step from its sequences, for one model shape and dtype. `adapter_ranks(name)` gives
    an adapter's rank per (layer, projection index) it targets."""

    def __init__(self, spec: ModelSpec, dtype_bytes: int, adapter_ranks, weight_bytes: int | None = None,
                 kv_bytes: int | None = None):
        """weight_bytes, kv_bytes: bytes of a projection weight's and a KV element where they differ from the
        model dtype's (FP8: 1; daemon/model/quantization.py)."""
        self.spec, self.dtype_bytes, self.adapter_ranks = spec, dtype_bytes, adapter_ranks
        self.weight_bytes, self.kv_bytes = weight_bytes or dtype_bytes, kv_bytes or dtype_bytes
        self.shapes = [spec.projection_shape(name) for name in PROJECTIONS]
        # q, k, v, o, gate, up, down: in * out weights each, in every layer
        self.layer_weights = sum(inputs * outputs for inputs, outputs in self.shapes)
        norms = (4 if spec.gemma else 2) * spec.hidden_size + (2 * spec.head_dim if spec.qk_norm else 0)
        self.norm_weights = spec.num_layers * norms + spec.hidden_size
        self.head_weights = spec.vocab_size * spec.hidden_size
        self.kv_per_token = 2 * spec.kv_size  # K and V elements of one token in one layer
        # How many layers attend globally, and how many through each window size.
        windows = Counter(spec.window(layer) for layer in range(spec.num_layers))
        self.global_layers = windows.pop(None, 0)
        self.window_layers = sorted(windows.items())
        self._adapter_elements: dict[str, tuple[int, int]] = {}

    def cost(self, sequences: list[SequenceInStep]) -> StepCost:
        adapter_rows: dict[str, int] = {}
        for seq in sequences:
            if seq.adapter is not None:
                adapter_rows[seq.adapter] = adapter_rows.get(seq.adapter, 0) + seq.new_tokens
        return self.cost_of(np.array([seq.new_tokens for seq in sequences], dtype=np.int64),
                            np.array([seq.context for seq in sequences], dtype=np.int64),
                            sum(seq.sampled for seq in sequences), adapter_rows)

    def cost_of(self, new_tokens: np.ndarray, contexts: np.ndarray, sampled: int, adapter_rows: dict[str, int]) -> StepCost:
        """The same from arrays, as the engine has them once per step: new_tokens and contexts int64 [n] (the
        fields of SequenceInStep), the number of sampled rows, and each adapter's rows in the step."""
        spec = self.spec
        rows = int(new_tokens.sum())
        projections = spec.num_layers * self.layer_weights
        weights = self.norm_weights + rows * spec.hidden_size + (self.head_weights if sampled else 0)
        flops = 2 * rows * spec.num_layers * self.layer_weights + 2 * sampled * self.head_weights
        # Global layers: the context read, the new tokens written; row i (0-based) of a sequence's new tokens
        # attends to its earlier tokens and i + 1 more.
        kv = self.global_layers * int((contexts + new_tokens).sum())
        pairs = self.global_layers * int((new_tokens * (contexts - new_tokens) + new_tokens * (new_tokens + 1) // 2).sum())
        for window, layers in self.window_layers:
            kv += layers * int((np.minimum(contexts, new_tokens + window - 1) + new_tokens).sum())
            pairs += layers * int((_window_pairs(contexts, window) - _window_pairs(contexts - new_tokens, window)).sum())
        kv *= self.kv_per_token
        attention_flops = 4 * spec.q_size * pairs  # QK^T and PV, 2 FLOPs per multiply-add
        adapter_elements = adapter_flops = 0
        for name, count in adapter_rows.items():
            elements = self._adapter_size(name)
            adapter_elements += elements
            adapter_flops += 2 * count * elements  # shrink x @ A^T and expand @ B^T: rank * (in + out) per row
        return StepCost(projections * self.weight_bytes + weights * self.dtype_bytes, kv * self.kv_bytes,
                        adapter_elements * self.dtype_bytes, flops + attention_flops + adapter_flops,
                        attention_flops, adapter_flops)

    def _adapter_size(self, name: str) -> int:
        """Elements of an adapter's A and B over every (layer, projection) it targets: sum of rank * (in + out)."""
        if name not in self._adapter_elements:
            self._adapter_elements[name] = sum(
                rank * sum(self.shapes[projection]) for (_, projection), rank in self.adapter_ranks(name).items()
            )
        return self._adapter_elements[name]

    def forget(self, name: str) -> None:
        """An adapter was unloaded (or reloaded with other weights): its size is computed again next time."""
        self._adapter_elements.pop(name, None)


def _window_pairs(positions: np.ndarray, window: int) -> np.ndarray:
    """Query-key pairs of the rows at positions 0..n-1 of a sliding-window layer, for each n in `positions`:
    sum over j = 1..n of min(j, window)."""
    inside = np.minimum(positions, window)
    return inside * (inside + 1) // 2 + (positions - inside) * window


@dataclass(frozen=True)
class DeviceRates:
    """What the device sustains, measured at start-up: bytes per second read and written (a device-to-device
    copy counts its bytes twice) and dense GEMM FLOPs per second in the model's dtype."""

    bandwidth_bytes_per_s: float
    flops_per_s: float


def measure_device_rates(device, dtype, repeats: int = 5) -> DeviceRates:
    """The fastest of `repeats` timed runs of a large copy and a large square matmul on `device` (CUDA events
    on a GPU; the host's clock elsewhere, at sizes that keep a CPU start-up short)."""
    import time

    import torch

    cuda = device.type == "cuda"
    copy_elements = (512 << 20) // torch.empty((), dtype=dtype).element_size() if cuda else 8 << 20
    side = 8192 if cuda else 256
    source = torch.randn(copy_elements, device=device).to(dtype)
    target = torch.empty_like(source)
    a = torch.randn(side, side, device=device).to(dtype)
    b = torch.randn(side, side, device=device).to(dtype)

    def best_seconds(run) -> float:
        run()  # warm-up: first launches, allocations
        times = []
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                run()
                times.append(time.perf_counter() - began)
        return min(times)

    copy_s = best_seconds(lambda: target.copy_(source))
    gemm_s = best_seconds(lambda: torch.mm(a, b))
    return DeviceRates(bandwidth_bytes_per_s=2 * source.numel() * source.element_size() / copy_s,
                       flops_per_s=2 * side**3 / gemm_s)
