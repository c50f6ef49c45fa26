"""The paged attention kernels, the peer sum and the norms that quantize their rows for FP8 compile for the H100 (sm90) on a machine without a GPU (sm90_compile.py, in a
process of its own without Triton's interpreter): CI's kernel tests run them interpreted, which skips the
compiler's own checks. The LoRA shrinks and MBGMM's expand read adapter pages 16 bytes at a time there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_the_kernels_compile_for_sm90(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # compiled here, not found in a cache from an earlier run
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.count("ok ") >= 20 and done.stdout.count("ok      peer sum") == 3
    assert done.stdout.count("ok      norm fp8") == 8
    assert done.stdout.count("ok      lora wide loads") == 4
    shutil.rmtree(tmp_path / "triton", ignore_errors=True)
