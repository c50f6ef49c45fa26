"""Triton's CPU interpreter for the kernel tests. Triton picks the interpreter when a kernel is decorated,
so without a GPU this module sets TRITON_INTERPRET before any kernel module is imported: test modules
import it first (and reload a kernel module that another test imported earlier, compiled)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_interpreter = pytest.mark.skipif(
    not HAS_TRITON or CUDA,
    reason="triton is not importable" if not HAS_TRITON else "a GPU is present: the compiled kernels are tested by -m gpu",
)


def interpreted(probe, *modules) -> None:
    """Without a GPU: reload `modules`, in the order given (a module imports names of those before it), when
    `probe` or any kernel of theirs was decorated compiled (a module imported them before TRITON_INTERPRET was
    set), so that their kernels run in the interpreter."""
    if CUDA or not HAS_TRITON:
        return
    kernels = [probe] + [value for module in modules for value in vars(module).values()
                         if type(value).__module__.startswith("triton.runtime")]
    if any(type(kernel).__name__ == "JITFunction" for kernel in kernels):
        for module in modules:
            importlib.reload(module)
