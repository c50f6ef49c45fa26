"""What every kernel launcher in gpu_ops shares: whether Triton is there, and the host-side arithmetic of
grids and tiles (ceil-division, powers of two, the device's SM count), and when the interpreter needs bf16
dot operands widened. Shapes only, never a device read.

And the early launch (programmatic dependent launch, Hopper and later): inside `early_launch(True)` the launchers
that support it launch their kernel while the kernel before it still runs. Such a kernel lets its own dependents
start at once (`let_dependents_start`), reads before its wait only what no kernel of the step writes (weights, the
step's metadata), and every one of its programs waits for the kernel before it to complete (`wait_for_previous`)
before it reads or writes anything else: so its CTAs are resident when the previous kernel ends, and a kernel's
completion still implies that of every kernel before it. A launcher that does not support it launches as before,
and the kernel after it then starts when it completes. The model turns it on for a decode step's forward
(daemon/model/ops.py). The one-row gemv (gpu_ops/gemv.py) is not launched early: beside the FP8 rows GEMM launched
early it made the batch-1 step slower, and so it did with its first weight tile read before its wait, and with its
weight rows prefetched into L2 there (BENCHMARKS.md, 25.2).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

try:
    import triton
    import triton.language as tl

    try:  # grid dependency control (Hopper and later); an older triton has none, and nothing launches early
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        gdc_launch_dependents = gdc_wait = None
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


def pdl_unavailable(device: torch.device) -> str | None:
    """Why programmatic dependent launch cannot be used on `device`, or None when it can."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda":
        return f"{device.type} is not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"compute capability {major}.{minor} < 9.0"
    if gdc_wait is None:
        return f"triton {triton.__version__} has no grid dependency control"
    from triton.backends.nvidia.compiler import CUDAOptions

    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        return f"triton {triton.__version__} cannot launch with PDL"
    return None


_EARLY = contextvars.ContextVar("lorad_early_launch", default=False)


@contextlib.contextmanager
def early_launch(on: bool = True):
    """Kernels launched inside, by the launchers that support it, are launched early (the module's docstring). The
    caller checks `pdl_unavailable`."""
    token = _EARLY.set(bool(on))
    try:
        yield
    finally:
        _EARLY.reset(token)


def launching_early() -> bool:
    """Whether a launcher now launches its kernel early (inside `early_launch(True)`)."""
    return _EARLY.get()


def early_options(early: bool) -> dict:
    """The launch options of a kernel launched early, or none."""
    return {"launch_pdl": True} if early else {}


if triton is not None:

    @triton.jit
    def let_dependents_start(EARLY: tl.constexpr):
        """A kernel launched early: the kernel after it may start now (it waits for this one to complete)."""
        if EARLY:
            gdc_launch_dependents()

    @triton.jit
    def wait_for_previous(EARLY: tl.constexpr):
        """A kernel launched early: the kernel before it completed and its writes are visible past this point."""
        if EARLY:
            gdc_wait()
