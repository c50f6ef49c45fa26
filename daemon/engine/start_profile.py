"""The kernel profile a daemon measures on its first start. When `lorad serve` runs on cuda and no profile of this
GPU and model is at the default path (kernel_choice.default_profile_path: under state_dir, one file per GPU model,
base model and tensor-parallel size), the engine process measures one before it loads its own weights and pool, so
the memory is free: `lorad profile`'s measurement (daemon/bench/profile.py) of the engine's model shape, dtype and
max_lora_rank, on random weights of that shape (the timings depend on shapes alone). It is saved there, the memory
given back, and the engine loads it as it would a profile found there; later starts find it. A profile found there
whose LoRA launches (`machine.lora_launch`: the decode MBGMV's groups and early expand) are not this engine's timed
other steps than the engine runs, and is measured again; one written before the profile recorded them counts as
such. A failure is logged and the engine starts without a profile. /v1/status `kernel_profile` says where the
engine's profile came from.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.kernel_choice import PROFILE_OFF, LoraKernelChoice, default_profile_path
from lorad.daemon.model.checkpoint import ModelSpec

log = logging.getLogger(__name__)

EXPECTED_SECONDS = 100  # the 7B shape on an H200 (bench/results/profile_h200_engine_launches.json: 97.2 s)


def kernel_choice(config: EngineConfig, spec: ModelSpec, model_name: str, device: torch.device,
                  dtype: torch.dtype) -> tuple[LoraKernelChoice, dict]:
    """The engine's decode LoRA kernel choice (LoraKernelChoice.for_engine), after measuring the profile it loads
    where config.profile_at_start asks for it; -> (the choice, /v1/status `kernel_profile`: {"origin": "measured
    at start" | "found" | "given" | "off" | "none" | "failed", with "path" and "seconds", or "why"})."""
    size = config.tensor_parallel_size
    path = default_profile_path(model_name, device, config.state_dir, size)
    origin = None
    failed = None  # why measuring a stale profile again failed (the engine then loads the stale one)
    if config.profile_path is None and not path.exists():
        origin = measure_at_start(config, spec, model_name, device, dtype, path)
    elif config.profile_path is None and why_not_measured(config, device) is None:
        stale = launches_differ(path, config, device)
        if stale:
            log.info("kernel profile at %s: %s; measuring it again", path, stale)
            origin = measure_at_start(config, spec, model_name, device, dtype, path)
            if origin["origin"] == "failed":
                origin, failed = None, origin["why"]
    choice = LoraKernelChoice.for_engine(config.profile_path, model_name, device, config.state_dir,
                                         str(dtype).removeprefix("torch."), config.lora_kernel, size)
    if config.profile_path == PROFILE_OFF:
        origin = {"origin": "off", "why": "profile_path off"}
    elif config.profile_path:
        origin = {"origin": "given", "path": config.profile_path}
    elif origin is None:
        origin = ({"origin": "found", "path": str(path)} if choice.profile is not None
                  else {"origin": "none", "why": choice.source})  # a profile of another tensor-parallel size
    if choice.profile is not None and origin["origin"] != "measured at start":
        stale = _launches_differ(choice.profile.machine.get("lora_launch"), config, device)  # as loaded, not read again
        if stale:  # not measured again (a given profile, or none measured at start): its predictions may be off
            log.warning("kernel profile %s: %s; its kernel choices may be off (`lorad profile` measures it again)",
                        config.profile_path or path, stale)
            origin["stale"] = stale
            if failed:
                origin["why"] = failed
    return choice, origin


def engine_lora_launch(config: EngineConfig, device: torch.device) -> dict:
    """How this engine's decode steps will launch their LoRA, as `runner.lora_launch` reports it once the ops exist
    (on cuda, where a profile is measured at start: the Triton ops with the config's groups and early expand)."""
    from lorad.daemon.engine.runner import lora_launch, lora_pdl_state

    return lora_launch(config.fuse_lora_groups, lora_pdl_state(config.lora_pdl, device)["on"])


def launches_differ(path: Path, config: EngineConfig, device: torch.device) -> str | None:
    """Why the profile at `path` timed other decode LoRA launches than this engine makes (None: the same, or not on
    cuda, where the engine runs the references whatever the flags). A file that cannot be read is left to the
    profile's loader, which says what is wrong with it."""
    if device.type != "cuda":
        return None
    try:
        recorded = json.loads(path.read_text()).get("machine", {}).get("lora_launch")
    except (OSError, ValueError, AttributeError):
        return None
    return _launches_differ(recorded, config, device)


def _launches_differ(recorded: dict | None, config: EngineConfig, device: torch.device) -> str | None:
    """`launches_differ` for a profile's recorded `machine.lora_launch` (None: not recorded)."""
    if device.type != "cuda":
        return None
    engine = engine_lora_launch(config, device)
    if recorded is None:
        return f"measured before profiles recorded their LoRA launches; this engine launches {engine}"
    if recorded != engine:
        return f"measured with LoRA launches {recorded}, this engine launches {engine}"
    return None


def plan_for(device: torch.device):
    """What is measured at start on this device (daemon/bench/profile.py's Plan): `lorad profile`'s own plan on
    cuda; None on the CPU, whose engine runs the torch references (`lorad profile --device cpu` measures them)."""
    if device.type != "cuda":
        return None
    from lorad.daemon.bench.profile import CUDA_PLAN

    return CUDA_PLAN


def why_not_measured(config: EngineConfig, device: torch.device) -> str | None:
    """Why no profile is measured at this start (None: one is)."""
    if not config.profile_at_start:
        return "profile_at_start off"
    plan = plan_for(device)
    if plan is None:
        return f"on cuda only, not on {device.type} (`lorad profile --device {device.type}` measures it)"
    if config.tensor_parallel_size > 1:
        # `lorad profile --tensor-parallel-size N` starts a process group of its own, which this process would have
        # to leave before the engine's ranks form theirs: measured once by hand instead.
        return (f"tensor_parallel_size {config.tensor_parallel_size}: measure it once with `lorad profile "
                f"--tensor-parallel-size {config.tensor_parallel_size}` and the same model and --state-dir")
    highest = max(plan.ranks)
    if config.max_lora_rank < highest:
        return f"max_lora_rank {config.max_lora_rank}: the profile's rank mixes go up to {highest}"
    return None


def measure_at_start(config: EngineConfig, spec: ModelSpec, model_name: str, device: torch.device,
                     dtype: torch.dtype, path: Path) -> dict:
    """Measures and saves the profile at `path` where config and device allow it; -> its `kernel_profile` status.
    Never raises for a failed measurement: the engine then starts without a profile."""
    why = why_not_measured(config, device)
    if why is not None:
        log.info("kernel profile: none at %s; not measured at start: %s", path, why)
        return {"origin": "none", "why": f"none at {path}; not measured at start: {why}"}
    log.info("profiling this GPU for %s on first start (~%d s for a 7B model on an H200); cached at %s",
             model_name, EXPECTED_SECONDS, path)
    started = time.perf_counter()
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")  # another daemon may be reading or writing path
    try:
        measured = _measure(config, spec, model_name, device, dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        measured.save(partial)
        os.replace(partial, path)
    except Exception as error:  # noqa: BLE001 -- a failed measurement never stops the daemon
        seconds = time.perf_counter() - started
        why = f"profiling at start failed after {seconds:.1f} s: {type(error).__name__}: {error}"
        log.warning("kernel profile: %s; the engine starts without one", why, exc_info=True)
        partial.unlink(missing_ok=True)
        return {"origin": "failed", "why": why}
    finally:
        gc.collect()  # the measurement's model, pool and CUDA graphs, before the engine takes the memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = round(time.perf_counter() - started, 1)
    log.info("kernel profile measured in %.1f s, saved at %s", seconds, path)
    return {"origin": "measured at start", "path": str(path), "seconds": seconds}


def _measure(config: EngineConfig, spec: ModelSpec, model_name: str, device: torch.device, dtype: torch.dtype):
    """`lorad profile`'s measurement of this shape on random weights -> the Profile (its model, pool and graphs are
    gone with this call's frame)."""
    from lorad.daemon.bench import profile

    weights = profile.rank_weights(spec, None, 0, 1, dtype, device, config.seed)
    measured, _ = profile.run_profile(spec, weights, model_name, dtype, device, plan_for(device), config.max_lora_rank,
                                      config.seed, launch=profile.LoraLaunch(config.fuse_lora_groups, config.lora_pdl))
    measured.machine["measured_by"] = "lorad serve, before its first start (daemon/engine/start_profile.py)"
    return measured
