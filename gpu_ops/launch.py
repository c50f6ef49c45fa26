"""What every kernel launcher in gpu_ops shares: whether Triton is there, and the host-side arithmetic of
grids and tiles (ceil-division, powers of two, the device's SM count), and when the interpreter needs bf16
dot operands widened. Shapes only, never a device read.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
except ImportError:  # the CPU engine runs the references only
    triton = None


def require_triton(kernels: str) -> None:
    """Raises RuntimeError naming `kernels` when Triton is not installed (their *_ref functions need none)."""
    if triton is None:
        raise RuntimeError(f"the {kernels} need triton (pip install triton); the *_ref functions do not")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device, otherwise: int) -> int:
    """The device's streaming multiprocessors; `otherwise` on a device that has none (Triton's interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return otherwise


@functools.lru_cache(maxsize=None)
def gpu_name(device: torch.device) -> str:
    """The device's name as the driver gives it ("NVIDIA H200"); "" on a device that has none (Triton's
    interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return ""


def named_gpu(device: torch.device, gpus) -> str | None:
    """The first of `gpus` (names such as "H200") that is a word of the device's name, or None: "NVIDIA H200" and
    "NVIDIA H200 NVL" are H200s; "NVIDIA GH200 480GB" (an H100 beside a Grace CPU) is not one. What per-GPU launch
    tables are looked up by."""
    words = gpu_name(device).split()
    return next((gpu for gpu in gpus if gpu in words), None)


def widen_bf16_dots(dtype: torch.dtype, kernel) -> bool:
    """Whether `kernel` must widen its bf16 dot operands to float32: Triton's CPU interpreter multiplies
    bf16 dot operands as raw bits (triton 3.9), and the operands are exact in fp32. Compiled kernels never
    take this branch."""
    return dtype == torch.bfloat16 and type(kernel).__name__ == "InterpretedFunction"
