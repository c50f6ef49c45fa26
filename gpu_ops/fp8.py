"""FP8 (E4M3) for the base model on Hopper: projection weights stored as float8_e4m3fn with one float32 scale
per output channel, the references of the GEMMs over them, and the scaled conversions the FP8 KV cache is written
and read with. The GPU's GEMM path is gpu_ops/fp8_gemm.py; this module imports no Triton (the model code imports
it, and the tests set Triton's interpreter up before any kernel is decorated).

- `Fp8Weight`: a projection's weight [out, in] in FP8 and its scales [out] (row o is weight[o] * scale[o]),
  with a checkpoint's static activation scale when it has one. `quantize_weight` makes one from a bf16/fp16
  weight (per-output-channel amax / 448).
- `fp8_linear_ref`: the reference, the weight dequantized per GEMM; `scaled_mm_ref`: the arithmetic of
  gpu_ops/fp8_gemm.py's `fp8_linear` (rows quantized per token, then dequantized) for tight kernel tests.
- `to_kv` / `from_kv`: K and V into FP8 pages with a per-tensor scale and back (the references of the KV
  write and attention kernels, gpu_ops/attention.py).

Roofline of one projection: bytes = in * out (FP8) + 4 * out (scales) + the rows; flops = 2 * rows * in * out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "FP8",
    "FP8_MAX",
    "Fp8Weight",
    "fp8_linear_ref",
    "fp8_unavailable",
    "from_kv",
    "quantize_rows_ref",
    "quantize_weight",
    "scaled_mm_ref",
    "to_kv",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value
MIN_AMAX = 1e-12  # a row of zeros gets this amax: its scale stays finite and positive
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores and the E4M3 conversions: Ada (8.9) and Hopper (9.0) onwards


@dataclass
class Fp8Weight:
    """A projection's weight in FP8: `weight` float8_e4m3fn [out, in] row-major, `scale` float32 [out] (row o
    of the real weight is weight[o] * scale[o]); `input_scale` float32 [1], a checkpoint's static activation
    scale (None: each row's own, computed per GEMM)."""

    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.weight.dtype != FP8 or self.weight.dim() != 2:
            raise ValueError(f"an Fp8Weight holds a 2-D {FP8} weight, not {self.weight.dtype} {tuple(self.weight.shape)}")
        if self.scale.shape != (self.weight.shape[0],) or self.scale.dtype != torch.float32:
            raise ValueError(f"scale must be float32 [{self.weight.shape[0]}], not {self.scale.dtype} {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        """What a GEMM reads of it: the FP8 weight and its scales."""
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """Projections that share an input (q, k, v; gate, up) stacked into one weight, each row keeping its
        scale. Static activation scales: the largest of the parts (one quantization of the shared input, and a
        larger scale never overflows); parts with and without one do not mix."""
        statics = [part.input_scale for part in parts]
        if any(s is None for s in statics) and not all(s is None for s in statics):
            raise ValueError("projections sharing an input mix static and dynamic activation scales")
        input_scale = None if statics[0] is None else torch.stack([s.reshape(()) for s in statics]).max().reshape(1)
        return Fp8Weight(torch.cat([part.weight for part in parts]), torch.cat([part.scale for part in parts]), input_scale)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A bf16/fp16/fp32 weight [out, in] -> FP8 with per-output-channel scales (amax / 448): every row's
    largest element maps to +-448, so the relative error of an element is at most 2^-4 (3 mantissa bits)
    above E4M3's smallest normal, 2^-6 of its row's amax."""
    wide = weight.float()
    scale = wide.abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
    return Fp8Weight(_saturate(wide / scale[:, None]), scale)


def _saturate(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3, out-of-range values clamped to +-448 (torch's cast would make them NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (FP8 [T, K], float32 scales [T, 1]): each row over its amax / 448, or over the static scale."""
    wide = x.float()
    if static_scale is None:
        scale = wide.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return _saturate(wide / scale), scale


def fp8_linear_ref(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + bias with the weight dequantized per GEMM (the CPU engine's path; x kept in its dtype)."""
    return F.linear(x, weight.dequantize(x.dtype), bias)


def scaled_mm_ref(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `fp8_linear` computes for several rows, in float32: rows quantized per token, times the FP8
    weight, each product scaled by its row's and its channel's scale."""
    rows, row_scale = quantize_rows_ref(x, weight.input_scale)
    out = (rows.float() @ weight.weight.float().t()) * row_scale * weight.scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def to_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V rows into FP8 pages: x / scale, saturated (scale: a float32 scalar tensor)."""
    return _saturate(x.float() / scale)


def from_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 K or V back to the model dtype: x * scale."""
    return (x.float() * scale).to(dtype)


def fp8_unavailable(device: torch.device) -> str | None:
    """Why FP8 weights or KV pages cannot run on `device` with the GPU kernels, or None where they can. The CPU
    runs the references (dequantized), which the caller says separately."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; FP8 needs "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (Ada, Hopper)")
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    return None
