"""Which LoRA kernel a decode step runs: BGMV (every row padded to the batch's max rank) or MBGMV (each
row its own rank), picked per step from the fitted performance models of `lorad profile`
(scheduler/perf_model.py, CaraServe §5). With no profile the engine runs MBGMV and says so.

Where the profile lives by default: `<state_dir or ~/.cache/lorad>/profile-<model>-<device>.json`, and
`profile-<model>-<device>-tp<N>.json` for an engine spanning N GPUs (`default_profile_path`); `lorad profile`
writes there and the engine looks there. A profile holds for the tensor-parallel size it was measured at (a rank
computes 1/N of the heads and MLP columns, and the ranks all-reduce twice a layer): one of another size given as
profile_path is refused, one found at the default path is ignored, and the log and status say so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from lorad.scheduler.perf_model import KERNELS, Profile, choose_kernel

from lorad.errors import BadRequest

log = logging.getLogger(__name__)

DEFAULT_KERNEL = "mbgmv"
PROFILE_OFF = "off"  # EngineConfig.profile_path: never load a profile, always MBGMV


def device_tag(device: torch.device) -> str:
    """`cpu`, or `cuda-<gpu name>` in lower case (`cuda-nvidia-h100-80gb-hbm3`): a profile holds for one
    kind of device."""
    if device.type != "cuda":
        return device.type
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def default_profile_path(model_name: str, device: torch.device, state_dir: str | None, tensor_parallel_size: int = 1) -> Path:
    root = Path(state_dir) if state_dir else Path.home() / ".cache" / "lorad"
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name)
    size = f"-tp{tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    return root / f"profile-{model}-{device_tag(device)}{size}.json"


def rank_bucket(max_rank: int, max_lora_rank: int) -> int:
    """The max rank a BGMV launch is padded to: the next power of two >= 16 (BGMV compiles one kernel
    per such bucket: its rank tile is that power of two), capped at max_lora_rank (the workspace width)."""
    return min(max(16, 1 << max(0, (max_rank - 1).bit_length())), max_lora_rank)


def rank_buckets(max_lora_rank: int) -> list[int]:
    buckets, bucket = [], 16
    while True:
        buckets.append(min(bucket, max_lora_rank))
        if bucket >= max_lora_rank:
            return buckets
        bucket *= 2


class LoraKernelChoice:
    """The decode LoRA kernel of each step, and how many steps ran each.

    Three kinds: from a profile (the kernel its models predict cheaper for the step's ranks), the
    default (MBGMV, no profile), and `measuring` (for `lorad profile`: `forced` is the kernel, and every
    kernel may run for ranks in `rank_range`, so both kinds of CUDA graph get captured).
    """

    def __init__(self, profile: Profile | None = None, source: str | None = None,
                 measuring: tuple[int, int] | None = None, kernel: str | None = None):
        if profile is not None and (profile.bgmv is None or profile.mbgmv is None):
            raise BadRequest(f"the profile {source} has no BGMV and MBGMV kernel models: run `lorad profile` again")
        if kernel is not None and kernel not in KERNELS:
            raise BadRequest(f"lora_kernel must be auto or one of {', '.join(KERNELS)}, not {kernel!r}")
        self.profile = profile
        self.source = source
        self.measuring = measuring
        self.kernel = kernel  # every step runs this kernel (the lora_kernel setting), whatever the profile says
        self.forced = DEFAULT_KERNEL
        self.steps = dict.fromkeys(KERNELS, 0)  # decode steps with LoRA rows, by kernel
        self.on_choice = None  # called with the kernel after each choice (the engine's metrics)

    @classmethod
    def for_engine(cls, profile_path: str | None, model_name: str, device: torch.device, state_dir: str | None,
                   dtype: str, lora_kernel: str = "auto", tensor_parallel_size: int = 1) -> LoraKernelChoice:
        """profile_path: a file (must exist), None (the default path, when a profile is there) or "off".
        lora_kernel: auto (from the profile, MBGMV without one), or bgmv / mbgmv for every step.
        tensor_parallel_size: the engine's; a profile measured at another size is refused when given, ignored (with
        a warning, and said by describe()) when found at the default path."""
        kernel = None if lora_kernel == "auto" else lora_kernel
        if profile_path == PROFILE_OFF:
            return cls(source="off", kernel=kernel)
        path = (Path(profile_path) if profile_path
                else default_profile_path(model_name, device, state_dir, tensor_parallel_size))
        if not path.exists():
            if profile_path:
                raise BadRequest(f"profile_path {path} does not exist (write it with `lorad profile --out {path}`"
                                 + (f" --tensor-parallel-size {tensor_parallel_size}" if tensor_parallel_size > 1 else "")
                                 + ")")
            return cls(source=f"none at {path}", kernel=kernel)
        profile = Profile.load(path)  # a malformed file is an error, never ignored
        if profile.tensor_parallel_size != tensor_parallel_size:
            mismatch = (f"measured at tensor_parallel_size {profile.tensor_parallel_size}, the engine runs "
                        f"{tensor_parallel_size} (measure it with `lorad profile --tensor-parallel-size "
                        f"{tensor_parallel_size}`)")
            if profile_path:
                raise BadRequest(f"profile_path {path} was {mismatch}")
            log.warning("profile %s ignored: %s", path, mismatch)
            return cls(source=f"ignored at {path}: {mismatch}", kernel=kernel)
        measured = profile.machine.get("dtype")
        if measured is not None and measured != dtype:
            log.warning("profile %s was measured in %s, the engine runs %s: its predictions may be off", path, measured, dtype)
        return cls(profile, str(path), kernel=kernel)

    @classmethod
    def measuring_ranks(cls, low: int, high: int) -> LoraKernelChoice:
        return cls(source="measuring", measuring=(low, high))

    @property
    def active(self) -> bool:
        """Whether steps may run anything but the default kernel."""
        return self.profile is not None or self.measuring is not None or self.kernel is not None

    @property
    def decode_model(self):
        """The profile's decode-step model of the kernel the steps run (None without a profile)."""
        if self.profile is None:
            return None
        return self.profile.decode_for(self.kernel) if self.kernel is not None else self.profile.decode

    def describe(self) -> str:
        """What /v1/status and the start-up log show."""
        if self.measuring is not None:
            return f"measuring:{self.forced}"
        if self.kernel is not None:
            return f"forced:{self.kernel} (lora_kernel; profile: {self.source})"
        if self.profile is not None:
            return f"profile:{self.source}"
        return f"default:{DEFAULT_KERNEL} (no profile: {self.source})"

    def choose(self, ranks: Sequence[int]) -> str:
        """The kernel for a decode step whose LoRA rows have these ranks (rows without an adapter left
        out); counted."""
        if self.measuring is not None:
            kernel = self.forced
        elif self.kernel is not None:
            kernel = self.kernel
        elif self.profile is not None:
            kernel = choose_kernel(ranks, self.profile.bgmv, self.profile.mbgmv)
        else:
            kernel = DEFAULT_KERNEL
        self.steps[kernel] += 1
        if self.on_choice is not None:
            self.on_choice(kernel)
        return kernel

    def choose_for_slots(self, slots: np.ndarray, rank_host: np.ndarray) -> str:
        """`choose` for rows given as adapter slots (-1: no adapter); a slot's rank is its largest over
        layers and projections (rank_host: AdapterTable's [slots, L, 7] host mirror)."""
        used = slots[slots >= 0]
        return self.choose(rank_host[used].reshape(len(used), -1).max(axis=1).tolist())

    def bgmv_can_win(self, max_rows: int, low_rank: int, high_rank: int) -> bool:
        """Whether BGMV is predicted cheaper for some batch of 1..max_rows LoRA rows whose max rank lies
        in low_rank..high_rank. Both models are linear, so the extremes (rows and ranks at the box's
        corners, the rank sum as favourable to BGMV as it can be) decide."""
        if self.measuring is not None:
            low, high = self.measuring
            return low_rank <= high and high_rank >= low
        if self.kernel is not None:
            return self.kernel == "bgmv"
        if self.profile is None:
            return False
        bgmv, mbgmv = self.profile.bgmv, self.profile.mbgmv
        for rows in (1, max_rows):
            for rank in (low_rank, high_rank):
                # Every row at the max rank is BGMV's best case when MBGMV's alpha is >= 0; otherwise
                # one row at the max and the rest at rank 1.
                rank_sum = rows * rank if mbgmv.alpha >= 0 else rank + rows - 1
                if bgmv.from_stats(rows, rank, rank_sum) <= mbgmv.from_stats(rows, rank, rank_sum):
                    return True
        return False
