"""What an engine settles at start when the config leaves it open (`lorad serve`'s defaults): the cold-start mode
(auto on cuda at tensor_parallel_size 1, ondemand elsewhere; daemon/engine/cold_start.py: resolve_cold_start) and the kernel profile
measured on a first start (daemon/engine/start_profile.py), forced onto the CPU here with a tiny plan: measured and
saved by the first engine, found by the second, and a failed measurement leaves the engine up, saying why."""

from __future__ import annotations

import logging

import pytest
import torch
from lorad.daemon.bench import profile as bench_profile
from lorad.daemon.bench.profile import Plan
from lorad.daemon.engine import start_profile
from lorad.daemon.engine.cold_start import CPU_STORE_BYTES, cpu_assist_shm_bytes, resolve_cold_start
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.kernel_choice import default_profile_path
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.scheduler.perf_model import Profile, example_profile

from lorad.config import EngineConfig
from lorad.errors import BadRequest

SEVEN_B = ModelSpec.from_hf_config(MODEL_CONFIGS["llama-2-7b"])
CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU: resolution only reads its type
PLENTY = lambda: 64 << 30  # noqa: E731 -- /dev/shm's free bytes
# The fewest samples every fit of daemon/bench/profile.py still determines: a second or so on the CPU.
TINY_PLAN = Plan(batch_sizes=(1, 2, 4), ranks=(8, 16), step_batch_sizes=(1, 2), contexts=(8, 16),
                 prefill_tokens=(4, 8, 16), rounds=1, variants=1, reps=1, step_reps=1, prefill_reps=1, bank_bytes=1 << 20)


def test_cold_start_is_auto_on_one_gpu_and_ondemand_elsewhere():
    unset = EngineConfig(cold_start=None)  # lorad serve's default (SERVE_DEFAULTS)
    mode, why = resolve_cold_start(unset, CUDA, SEVEN_B, PLENTY)
    assert mode == "auto" and "figures 5.1 and 5.2" in why
    mode, why = resolve_cold_start(unset, CPU, SEVEN_B, PLENTY)
    assert mode == "ondemand" and why.startswith("the default on cpu")
    mode, why = resolve_cold_start(EngineConfig(cold_start=None, tensor_parallel_size=2), CUDA, SEVEN_B, PLENTY)
    assert mode == "ondemand" and "tensor_parallel_size 2" in why
    # /dev/shm too small for the CPU workers' store and exchange (a container's default 64 MiB): ondemand, and why
    mode, why = resolve_cold_start(unset, CUDA, SEVEN_B, lambda: 64 << 20)
    assert mode == "ondemand" and "64 MiB free" in why
    assert resolve_cold_start(unset, CUDA, SEVEN_B, lambda: None)[0] == "auto"  # nothing to measure
    # An engine built directly (tests, benchmarks) runs ondemand unless told otherwise.
    assert resolve_cold_start(EngineConfig(), CUDA, SEVEN_B, PLENTY) == ("ondemand", "set (cold_start)")
    # An explicit mode always wins, on any device.
    for mode in ("cached", "ondemand", "cpu", "auto"):
        assert resolve_cold_start(EngineConfig(cold_start=mode), CPU, SEVEN_B, PLENTY) == (mode, "set (cold_start)")
        assert resolve_cold_start(EngineConfig(cold_start=mode), CUDA, SEVEN_B, lambda: 0) == (mode, "set (cold_start)")
    with pytest.raises(BadRequest, match="cold_start auto does not run with tensor_parallel_size > 1"):
        EngineConfig(cold_start="auto", tensor_parallel_size=2)
    with pytest.raises(BadRequest, match="cold_start must be one of"):
        EngineConfig(cold_start="default")


def test_the_shared_memory_auto_needs_is_the_store_and_the_exchange():
    config = EngineConfig(cpu_workers=2)
    # the exchange: input and output rows of the widest projection (7B: 11008 wide), a partial buffer per worker
    exchange = 2048 * 11008 * 4 * 2 + 2 * 2048 * 256 * 4
    needed = cpu_assist_shm_bytes(config, SEVEN_B)
    assert CPU_STORE_BYTES + exchange < needed < CPU_STORE_BYTES + exchange + (3 << 20)


@pytest.fixture
def one_thread():
    """The tiny model's ops are launch-bound: more threads only contend on a shared CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(state_dir, **config) -> Engine:
    return Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, device="cpu", max_model_len=64,
                               max_lora_rank=16, state_dir=str(state_dir), **config))


def test_an_engine_on_the_cpu_says_which_cold_start_it_runs_and_why(tmp_path):
    engine = _engine(tmp_path, cold_start=None)
    status = engine.status()
    assert status["cold_start"] == "ondemand" and status["cold_start_reason"].startswith("the default on cpu")
    assert engine.cold_starts.cpu_assist is None
    assert _engine(tmp_path, cold_start="cached").status()["cold_start_reason"] == "set (cold_start)"


def test_the_first_start_measures_the_profile_and_the_next_finds_it(tmp_path, monkeypatch, caplog, one_thread):
    monkeypatch.setattr(start_profile, "plan_for", lambda device: TINY_PLAN)  # the CPU, as cuda is
    path = default_profile_path("tiny-llama", CPU, str(tmp_path))
    caplog.set_level(logging.INFO)
    first = _engine(tmp_path, profile_at_start=True)
    measured = first.status()["kernel_profile"]
    assert measured["origin"] == "measured at start" and measured["path"] == str(path) and measured["seconds"] > 0
    assert first.status()["lora_kernel_choice"] == f"profile:{path}"
    saved = Profile.load(path)
    assert saved.machine["model"] == "tiny-llama" and saved.machine["max_lora_rank"] == 16
    assert saved.machine["plan"]["batch_sizes"] == [1, 2, 4] and "lorad serve" in saved.machine["measured_by"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left beside it
    messages = [record.getMessage() for record in caplog.records]
    began = next(i for i, m in enumerate(messages) if m.startswith("profiling this GPU for tiny-llama on first start (~"))
    assert messages[began].endswith(f"cached at {path}")
    loaded = next(i for i, m in enumerate(messages) if m.startswith("decode lora kernel choice="))  # after the weights
    assert began < loaded
    # The next start finds it and measures nothing.
    monkeypatch.setattr(start_profile, "_measure", lambda *args: pytest.fail("measured again"))
    second = _engine(tmp_path, profile_at_start=True)
    assert second.status()["kernel_profile"] == {"origin": "found", "path": str(path)}
    assert second.kernel_choice.profile == saved


def test_no_measurement_when_off_given_or_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(start_profile, "_measure", lambda *args: pytest.fail("measured"))
    status = _engine(tmp_path, profile_at_start=True).status()  # the CPU: only cuda measures at start
    assert status["kernel_profile"]["origin"] == "none" and "on cuda only, not on cpu" in status["kernel_profile"]["why"]
    assert status["lora_kernel_choice"].startswith("default:mbgmv (no profile")
    assert _engine(tmp_path).status()["kernel_profile"]["why"].endswith("not measured at start: profile_at_start off")
    monkeypatch.setattr(start_profile, "plan_for", lambda device: TINY_PLAN)
    off = _engine(tmp_path, profile_at_start=True, profile_path="off").status()
    assert off["kernel_profile"] == {"origin": "off", "why": "profile_path off"}
    given = tmp_path / "given.json"
    example_profile().save(given)
    assert _engine(tmp_path, profile_at_start=True, profile_path=str(given)).status()["kernel_profile"] == {
        "origin": "given", "path": str(given)}


def test_why_no_profile_is_measured_on_a_gpu():
    on = dict(profile_at_start=True)
    assert start_profile.why_not_measured(EngineConfig(**on), CUDA) is None
    assert "tensor_parallel_size 2" in start_profile.why_not_measured(EngineConfig(**on, tensor_parallel_size=2), CUDA)
    assert "max_lora_rank 32" in start_profile.why_not_measured(EngineConfig(**on, max_lora_rank=32), CUDA)
    assert start_profile.why_not_measured(EngineConfig(), CUDA) == "profile_at_start off"


def test_a_failed_measurement_leaves_the_engine_up_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(start_profile, "plan_for", lambda device: TINY_PLAN)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(bench_profile, "run_profile", fail)
    engine = _engine(tmp_path, profile_at_start=True)
    status = engine.status()
    assert status["kernel_profile"]["origin"] == "failed"
    assert "profiling at start failed" in status["kernel_profile"]["why"]
    assert "RuntimeError: out of memory, say" in status["kernel_profile"]["why"]
    assert status["lora_kernel_choice"].startswith("default:mbgmv (no profile")
    assert list(tmp_path.iterdir()) == []  # nothing saved, nothing partial
    assert any("the engine starts without one" in record.getMessage() for record in caplog.records)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(engine.generate([GenerationRequest([5, 6, 7], None, greedy)])[0].token_ids) == 3


def _saved_profile(path, lora_launch=None):
    profile = example_profile()
    if lora_launch is not None:
        profile.machine["lora_launch"] = lora_launch
    profile.save(path)
    return profile


def test_a_profile_of_other_lora_launches_is_one_the_engine_does_not_run(tmp_path):
    """On cuda a profile records how its decode LoRA was launched (groups, the early expand); one that timed other
    launches than the engine's, or that predates the record, times steps the engine does not run."""
    config = EngineConfig(lora_pdl="off")  # off: no device is asked whether it could launch early
    path = tmp_path / "profile.json"
    _saved_profile(path)
    assert "measured before profiles recorded their LoRA launches" in start_profile.launches_differ(path, config, CUDA)
    _saved_profile(path, {"fuse_lora_groups": True, "lora_pdl": False})
    assert start_profile.launches_differ(path, config, CUDA) is None
    why = start_profile.launches_differ(path, EngineConfig(lora_pdl="off", fuse_lora_groups=False), CUDA)
    assert "'fuse_lora_groups': True" in why and "this engine launches {'fuse_lora_groups': False" in why
    _saved_profile(path)
    assert start_profile.launches_differ(path, config, CPU) is None  # the CPU's engine runs the references whatever
    (tmp_path / "broken.json").write_text("{")
    assert start_profile.launches_differ(tmp_path / "broken.json", config, CUDA) is None  # left to the loader's error


def test_a_found_profile_of_other_launches_is_measured_again_or_said_stale(tmp_path, monkeypatch, caplog):
    """At start on cuda (forced here: the profile's path and loading stubbed, nothing asks the device), a profile
    at the default path whose launches differ from the engine's is measured again; one that is not measured again
    (profile_at_start off) is loaded with a warning, and /v1/status `kernel_profile` says why."""
    path = tmp_path / "profile-tiny-llama-cuda-x.json"
    monkeypatch.setattr(start_profile, "default_profile_path", lambda *args: path)
    monkeypatch.setattr(start_profile, "plan_for", lambda device: TINY_PLAN)

    class Loaded:
        @staticmethod
        def for_engine(profile_path, *args):
            from lorad.daemon.engine.kernel_choice import LoraKernelChoice

            return LoraKernelChoice(Profile.load(profile_path or path), str(profile_path or path))

    monkeypatch.setattr(start_profile, "LoraKernelChoice", Loaded)
    engine_launch = {"fuse_lora_groups": True, "lora_pdl": False}
    measured = []

    def measure(*args):
        measured.append(args)
        profile = example_profile()
        profile.machine["lora_launch"] = dict(engine_launch)
        return profile

    monkeypatch.setattr(start_profile, "_measure", measure)
    caplog.set_level(logging.INFO)
    config = EngineConfig(lora_pdl="off", profile_at_start=True)
    _saved_profile(path)  # before profiles recorded their launches
    choice, origin = start_profile.kernel_choice(config, SEVEN_B, "tiny-llama", CUDA, torch.bfloat16)
    assert len(measured) == 1 and origin["origin"] == "measured at start" and "stale" not in origin
    assert Profile.load(path).machine["lora_launch"] == engine_launch == choice.profile.machine["lora_launch"]
    assert any("measuring it again" in record.getMessage() for record in caplog.records)
    # The same launches: found, not measured.
    choice, origin = start_profile.kernel_choice(config, SEVEN_B, "tiny-llama", CUDA, torch.bfloat16)
    assert len(measured) == 1 and origin == {"origin": "found", "path": str(path)}
    # Other launches, not measured at start: loaded, and said to be stale.
    _saved_profile(path, {"fuse_lora_groups": False, "lora_pdl": False})
    choice, origin = start_profile.kernel_choice(EngineConfig(lora_pdl="off"), SEVEN_B, "tiny-llama", CUDA, torch.bfloat16)
    assert len(measured) == 1 and origin["origin"] == "found" and "measured with LoRA launches" in origin["stale"]
    assert choice.profile is not None
    assert any(record.levelno == logging.WARNING and "its kernel choices may be off" in record.getMessage()
               for record in caplog.records)

    def fail(*args):
        raise RuntimeError("out of memory, say")

    # Measured again and failed: the engine loads the stale profile, and says both.
    monkeypatch.setattr(start_profile, "_measure", fail)
    choice, origin = start_profile.kernel_choice(config, SEVEN_B, "tiny-llama", CUDA, torch.bfloat16)
    assert origin["origin"] == "found" and "measured with LoRA launches" in origin["stale"]
    assert "RuntimeError: out of memory, say" in origin["why"] and choice.profile is not None
