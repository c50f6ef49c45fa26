"""The prefill attention kernel called five times over one fresh 2048-token prompt on the 7B shape (32 heads of 128,
MHA), at the engine's launch, over bf16 pages (one token a page) or FP8 pages (two), for Nsight Compute to take the
fourth call. No timing: the kernel's rate is bench/attention.py's prefill sections.

    ncu --kernel-name regex:_prefill_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --section InstructionStats --section ComputeWorkloadAnalysis --page details \
        python3 -P bench/prefill_profile.py bf16
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import PagedCache, page_tokens  # noqa: E402  (bench/attention.py, beside this script)


def main() -> None:
    pages = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    if pages not in ("bf16", "fp8"):
        sys.exit(f"pages must be bf16 or fp8, got {pages!r}")
    fp8 = pages == "fp8"
    cache = PagedCache(32, 32, 128, page_tokens(1, fp8), [(2048, 2048)], 1, torch.bfloat16, torch.device("cuda"),
                       kv_fp8=fp8)
    call = cache.kernel_calls()[0]
    for _ in range(5):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
