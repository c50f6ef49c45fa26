"""`lorad profile` on the CPU (the torch references, a tiny model, --quick): a finite Profile saved where the
engine looks and read back; the fit recovers injected coefficients; the decode LoRA kernel choice follows
an injected profile, through the engine, whose status and metrics say which kernel ran."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.kernel_choice import (
    LoraKernelChoice,
    default_profile_path,
    rank_bucket,
    rank_buckets,
)
from lorad.daemon.server.metrics import render
from lorad.daemon.bench.profile import (
    QUICK_PLAN,
    Bench,
    build_profile,
    choice_check,
    fit,
    profile_main,
    rank_mixes,
    rank_weights,
)
from lorad.daemon.engine.decode_graphs import mbgmv_tier
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, ModelSpec
from lorad.daemon.model.llama import DOWN, GATE, O, Q
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.scheduler.perf_model import BgmvModel, CollectiveModel, MbgmvModel, Profile, example_profile, profile_for

from lorad.config import EngineConfig
from lorad.errors import BadRequest

CHEAP, DEAR = (0.0, 0.0), (1.0, 1.0)  # (alpha, beta)


def injected(bgmv: tuple[float, float], mbgmv: tuple[float, float]) -> Profile:
    return dataclasses.replace(example_profile(), bgmv=BgmvModel(*bgmv), mbgmv=MbgmvModel(*mbgmv))


def test_quick_cpu_profile_is_saved_where_the_engine_looks(tmp_path, capsys):
    assert profile_main(["--model-config", "tiny-llama", "--device", "cpu", "--quick", "--state-dir", str(tmp_path)]) == 0
    path = default_profile_path("tiny-llama", torch.device("cpu"), str(tmp_path))
    assert path == tmp_path / "profile-tiny-llama-cpu.json"
    out = capsys.readouterr().out
    assert "torch references" in out and "| bgmv |" in out and "| prefill |" in out and str(path) in out
    profile = Profile.load(path)
    assert profile.machine["measured"] and profile.machine["device"] == "cpu"
    models = [profile.bgmv, profile.mbgmv, profile.decode, profile.prefill]
    for model in models:
        values = [value for value in dataclasses.asdict(model).values() if not isinstance(value, dict)]
        assert all(math.isfinite(value) for value in values), model
    assert profile.notes["samples"]["kernels"]["bgmv"] and profile.notes["samples"]["prefill"]
    check = profile.notes["kernel_choice_check"]  # the models' picks against the decode steps measured with both
    assert 0 <= check["agree"] <= check["clear"] <= len(profile.notes["samples"]["decode"]["bgmv"])
    # The CPU's ops launch one projection at a time, never early: what an engine on the CPU launches.
    assert profile.machine["lora_launch"] == {"fuse_lora_groups": False, "lora_pdl": False}
    # The engine finds it by default, for this model on this device.
    assert LoraKernelChoice.for_engine(None, "tiny-llama", torch.device("cpu"), str(tmp_path), "float32").profile == profile


@pytest.mark.slow
def test_quick_cpu_profile_at_tensor_parallel_size_2(tmp_path, capsys):
    """Two ranks on gloo, each timing its shard with the all-reduces: the profile says its size, holds a measured
    all-reduce term, goes to the -tp2 path, and only a size-2 engine takes it."""
    cpu = torch.device("cpu")
    argv = ["--model-config", "tiny-llama", "--device", "cpu", "--quick", "--state-dir", str(tmp_path)]
    assert profile_main([*argv, "--tensor-parallel-size", "2"]) == 0
    path = default_profile_path("tiny-llama", cpu, str(tmp_path), 2)
    assert path == tmp_path / "profile-tiny-llama-cpu-tp2.json" and path.exists()
    out = capsys.readouterr().out
    assert "x 2 ranks" in out and "| allreduce |" in out and "collective_share" in out
    profile = Profile.load(path)
    assert profile.tensor_parallel_size == 2 and profile.machine["gpus"] == ["cpu", "cpu"]
    assert profile.machine["collective_backend"] == "gloo" and profile.machine["all_reduce"] == "gloo"
    assert '"all_reduce": "gloo"' in out
    collectives = profile.collectives
    assert collectives.size == 2 and collectives.calls_per_step == 2 * 2  # two a layer, tiny-llama's 2 layers
    assert collectives.step_seconds(1) > 0 and collectives.step_seconds(0) == 0
    assert [tokens for tokens, _ in profile.notes["samples"]["allreduce"]] == [1, 2, 4, 16, 32, 64]
    assert all(0 < share for share in profile.notes["collective_share"]["decode"])
    # The TP=2 engine finds it at its default path; a TP=1 engine looks elsewhere (the size is in the name).
    found = LoraKernelChoice.for_engine(None, "tiny-llama", cpu, str(tmp_path), "float32", tensor_parallel_size=2)
    assert found.profile == profile and found.describe() == f"profile:{path}"
    alone = LoraKernelChoice.for_engine(None, "tiny-llama", cpu, str(tmp_path), "float32")
    assert alone.profile is None and alone.source == f"none at {tmp_path / 'profile-tiny-llama-cpu.json'}"
    # A profile of another size: refused when given, ignored (and said) when found at the default path.
    with pytest.raises(BadRequest, match="measured at tensor_parallel_size 2, the engine runs 1"):
        LoraKernelChoice.for_engine(str(path), "tiny-llama", cpu, None, "float32")
    path.rename(default_profile_path("tiny-llama", cpu, str(tmp_path)))
    ignored = LoraKernelChoice.for_engine(None, "tiny-llama", cpu, str(tmp_path), "float32")
    assert ignored.profile is None
    assert ignored.describe().startswith("default:mbgmv (no profile: ignored at ")
    assert "measured at tensor_parallel_size 2, the engine runs 1" in ignored.describe()
    # A size that does not split the model, or sums the engine does not know, are refused before any rank starts.
    assert profile_main([*argv, "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size 3 does not divide" in capsys.readouterr().err
    assert profile_main([*argv, "--tensor-parallel-size", "2", "--all-reduce", "one-shot"]) == 2
    assert "all_reduce must be one of auto, nccl, fused, not 'one-shot'" in capsys.readouterr().err


def test_the_profile_refuses_launches_the_engine_would_refuse(tmp_path, capsys):
    """--lora-pdl as lorad serve takes it: a value it does not know, or `on` where the expand cannot launch early (the
    CPU), is refused with the engine's message and exit code 2, before anything is measured."""
    argv = ["--model-config", "tiny-llama", "--device", "cpu", "--quick", "--state-dir", str(tmp_path)]
    assert profile_main([*argv, "--lora-pdl", "sometimes"]) == 2
    assert "lora_pdl must be one of" in capsys.readouterr().err
    assert profile_main([*argv, "--lora-pdl", "on"]) == 2
    assert "lora_pdl on cannot run here: cpu: reference ops" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_profile_without_a_size_is_of_one_gpu(tmp_path):
    profile = example_profile()
    assert profile.tensor_parallel_size == 1 and profile.collectives is None
    path = tmp_path / "old.json"
    profile.save(path)
    assert LoraKernelChoice.for_engine(str(path), "m", torch.device("cpu"), None, "float32").profile == profile
    with pytest.raises(BadRequest, match="tensor_parallel_size 1, the engine runs 2"):
        LoraKernelChoice.for_engine(str(path), "m", torch.device("cpu"), None, "float32", tensor_parallel_size=2)
    sized = dataclasses.replace(profile, machine={"tensor_parallel_size": 2},
                                collectives=CollectiveModel(1e-5, 1e-8, 64, 2, 0.99))
    assert Profile.from_json(sized.to_json()) == sized and sized.collectives.step_seconds(10) == pytest.approx(64 * (1e-5 + 1e-7))


def test_fit_recovers_injected_coefficients():
    rng = np.random.default_rng(1)
    bgmv, mbgmv = (3e-6, 2e-4), (4e-6, 5e-4)
    samples = {"kernels": {"bgmv": [], "mbgmv": []}, "decode": {"bgmv": [], "mbgmv": []}, "prefill": []}
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for ranks in rank_mixes(rows, (8, 16, 32, 64), rng).values():
            samples["kernels"]["bgmv"].append([ranks, bgmv[0] * rows * max(ranks) + bgmv[1]])
            samples["kernels"]["mbgmv"].append([ranks, mbgmv[0] * sum(ranks) + mbgmv[1]])
            for context in (128, 1024):
                base = 0.02 + 1e-5 * rows + 2e-8 * rows * context
                samples["decode"]["bgmv"].append([ranks, rows * context, base + bgmv[0] * rows * max(ranks)])
                samples["decode"]["mbgmv"].append([ranks, rows * context, base + mbgmv[0] * sum(ranks)])
    for tokens in (32, 128, 512, 2048):
        for prompts in ([(tokens, 8)], [(tokens, 64)], [(tokens, 8), (tokens // 2, 64)]):
            seconds = 1e-4 * sum(t for t, _ in prompts) + 1e-8 * sum(t * r for t, r in prompts) + 1e-9 * sum(t * t for t, _ in prompts) + 3e-3
            samples["prefill"].append([prompts, seconds])
    fits = fit(samples)
    assert (fits["bgmv"].alpha, fits["bgmv"].beta) == pytest.approx(bgmv)
    assert (fits["mbgmv"].alpha, fits["mbgmv"].beta) == pytest.approx(mbgmv)
    assert fits["decode_mbgmv"].per_context_token_s == pytest.approx(2e-8) and fits["decode_mbgmv"].lora.alpha == pytest.approx(4e-6)
    assert fits["prefill"].per_rank_token_s == pytest.approx(1e-8, rel=1e-3)
    for model in fits.values():
        assert model.r2 == pytest.approx(1.0)
    profile = build_profile(fits, samples, {"measured": False})
    assert profile.decode.lora.kernel in ("bgmv", "mbgmv")
    assert Profile.from_json(profile.to_json()) == profile


def test_choice_follows_the_models():
    skewed, equal = [64] + [8] * 31, [32] * 32
    both = injected(bgmv=(1e-6, 0.0), mbgmv=(2e-6, 0.0))  # BGMV wins unless padding more than doubles the work
    choice = LoraKernelChoice(both, "test")
    assert choice.choose(equal) == "bgmv" and choice.choose(skewed) == "mbgmv"
    assert choice.steps == {"bgmv": 1, "mbgmv": 1} and choice.describe() == "profile:test"
    assert LoraKernelChoice(injected(CHEAP, DEAR), "t").choose(skewed) == "bgmv"
    assert LoraKernelChoice(injected(DEAR, CHEAP), "t").choose(equal) == "mbgmv"
    default = LoraKernelChoice(source="none")
    assert default.choose(equal) == "mbgmv" and not default.active and default.describe().startswith("default:mbgmv")
    # bgmv_can_win decides which BGMV graphs are captured.
    assert not LoraKernelChoice(injected(DEAR, CHEAP), "t").bgmv_can_win(64, 1, 256)
    assert LoraKernelChoice(injected(CHEAP, DEAR), "t").bgmv_can_win(1, 1, 16)
    fixed_cost = injected(bgmv=(1e-6, 0.0), mbgmv=(0.0, 40e-6))  # BGMV wins only below 40 rows x rank
    assert LoraKernelChoice(fixed_cost, "t").bgmv_can_win(2, 1, 16)
    assert not LoraKernelChoice(fixed_cost, "t").bgmv_can_win(64, 33, 64) or fixed_cost.bgmv.from_stats(1, 33, 33) <= 40e-6
    assert rank_buckets(256) == [16, 32, 64, 128, 256] and rank_buckets(48) == [16, 32, 48]
    assert rank_bucket(9, 256) == 16 and rank_bucket(33, 256) == 64 and rank_bucket(40, 48) == 48


def test_a_forced_kernel_runs_every_step_whatever_the_models_say():
    skewed, equal = [64] + [8] * 31, [32] * 32
    forced = LoraKernelChoice(injected(DEAR, CHEAP), "t", kernel="bgmv")  # the models prefer MBGMV
    assert forced.choose(skewed) == forced.choose(equal) == "bgmv" and forced.active
    assert forced.bgmv_can_win(64, 1, 256) and forced.describe() == "forced:bgmv (lora_kernel; profile: t)"
    no_profile = LoraKernelChoice(source="off", kernel="bgmv")
    assert no_profile.active and no_profile.choose(equal) == "bgmv" and no_profile.decode_model is None
    mbgmv_only = LoraKernelChoice(injected(CHEAP, DEAR), "t", kernel="mbgmv")
    assert mbgmv_only.choose(equal) == "mbgmv" and not mbgmv_only.bgmv_can_win(1, 1, 16)
    with pytest.raises(BadRequest, match="lora_kernel"):
        LoraKernelChoice(source="off", kernel="sgmv")


def test_the_decode_model_of_either_kernel_comes_from_one_profile(tmp_path):
    profile = example_profile("mbgmv")
    other = example_profile("bgmv").decode
    profile = dataclasses.replace(profile, notes={"decode_bgmv": {**dataclasses.asdict(other),
                                                                  "lora": {"kernel": "bgmv", **dataclasses.asdict(other.lora)}}})
    assert profile.decode_for("mbgmv") is profile.decode
    assert profile.decode_for("bgmv") == other
    with pytest.raises(BadRequest, match="no decode model for mbgmv"):
        example_profile("bgmv").decode_for("mbgmv")
    path = tmp_path / "p.json"
    profile.save(path)
    assert profile_for(str(path)).decode.lora.kernel == "mbgmv"
    assert profile_for(str(path), "bgmv").decode == other
    assert profile_for(None).decode.lora.kernel == "bgmv" and profile_for(None, "mbgmv").decode.lora.kernel == "mbgmv"
    choice = LoraKernelChoice(dataclasses.replace(profile, bgmv=BgmvModel(*CHEAP), mbgmv=MbgmvModel(*DEAR)), "t",
                              kernel="bgmv")
    assert choice.decode_model == other


def _engine(demo_assets, profile_path: str | None, state_dir=None, **config) -> Engine:
    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items())
    return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu", max_model_len=64,
                               profile_path=profile_path, state_dir=state_dir, **config))


def _requests(adapters) -> list[GenerationRequest]:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    names = [*sorted(adapters), None]  # one request per adapter: decode steps run the per-row kernels
    return [GenerationRequest([5 + i, 6, 7, 8], name, greedy) for i, name in enumerate(names)]


def test_engine_runs_the_kernel_the_profile_picks_and_says_so(demo_assets, tmp_path):
    bgmv_path, mbgmv_path = tmp_path / "bgmv.json", tmp_path / "mbgmv.json"
    injected(CHEAP, DEAR).save(bgmv_path)
    injected(DEAR, CHEAP).save(mbgmv_path)
    results, statuses, engines = {}, {}, {}
    for name, path in (("bgmv", bgmv_path), ("mbgmv", mbgmv_path), ("off", "off")):
        engine = _engine(demo_assets, str(path))
        results[name] = [r.token_ids for r in engine.generate(_requests(demo_assets.adapters))]
        statuses[name], engines[name] = engine.status(), engine
    assert statuses["bgmv"]["lora_kernel_choice"] == f"profile:{bgmv_path}"
    assert statuses["bgmv"]["lora_kernel_steps"]["bgmv"] > 0 and statuses["bgmv"]["lora_kernel_steps"]["mbgmv"] == 0
    assert statuses["mbgmv"]["lora_kernel_steps"]["mbgmv"] > 0 and statuses["mbgmv"]["lora_kernel_steps"]["bgmv"] == 0
    assert statuses["off"]["lora_kernel_choice"].startswith("default:mbgmv (no profile")
    assert results["bgmv"] == results["mbgmv"] == results["off"]
    metrics = render(engines["bgmv"].metrics())
    steps = statuses["bgmv"]["lora_kernel_steps"]["bgmv"]
    assert f'lorad_decode_lora_kernel_steps_total{{kernel="bgmv"}} {steps}' in metrics


def test_engine_with_a_forced_kernel_runs_it_and_gives_the_same_tokens(demo_assets, tmp_path):
    mbgmv_path = tmp_path / "mbgmv.json"
    injected(DEAR, CHEAP).save(mbgmv_path)  # the profile would pick MBGMV
    reference = [r.token_ids for r in _engine(demo_assets, "off").generate(_requests(demo_assets.adapters))]
    for path in (str(mbgmv_path), "off"):
        engine = _engine(demo_assets, path, lora_kernel="bgmv")
        assert [r.token_ids for r in engine.generate(_requests(demo_assets.adapters))] == reference
        status = engine.status()
        assert status["lora_kernel_choice"].startswith("forced:bgmv")
        assert status["lora_kernel_steps"]["bgmv"] > 0 and status["lora_kernel_steps"]["mbgmv"] == 0
    with pytest.raises(BadRequest, match="lora_kernel must be one of auto, bgmv, mbgmv"):
        _engine(demo_assets, "off", lora_kernel="sgmv")


def test_engine_discovers_the_default_profile_and_refuses_a_missing_one(demo_assets, tmp_path):
    engine = _engine(demo_assets, None, state_dir=str(tmp_path))
    default = tmp_path / f"profile-{engine.model_name}-cpu.json"
    assert engine.status()["lora_kernel_choice"] == f"default:mbgmv (no profile: none at {default})"
    injected(CHEAP, DEAR).save(default)
    engine = _engine(demo_assets, None, state_dir=str(tmp_path))
    assert engine.status()["lora_kernel_choice"] == f"profile:{default}"
    with pytest.raises(BadRequest, match="does not exist"):
        _engine(demo_assets, str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(BadRequest, match="profile"):
        _engine(demo_assets, str(tmp_path / "bad.json"))


def test_the_kernel_samples_launch_the_decode_lora_as_the_model_does(monkeypatch):
    """The kernel samples go through the model's ops as a decode step's forward does: q,k,v and gate,up through
    lora_group (one launch pair each where the engine's ops fuse them), o and down alone, on decode batches of the
    kernel timed at its launch rank."""
    cpu = torch.device("cpu")
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS["tiny-llama"])
    bench = Bench(spec, rank_weights(spec, None, 0, 1, torch.float32, cpu, 0), torch.float32, cpu, QUICK_PLAN, 64, 0)
    calls, inside = [], []
    group, alone = bench.ops.lora_group, bench.ops.lora

    def record_group(x, fused, outs, layer, first, batch, table):
        assert sum(out.shape[1] for out in outs) == fused.shape[1] and all(out.data_ptr() >= fused.data_ptr() for out in outs)
        calls.append(("group", first, len(outs), layer, batch.decode, batch.decode_kernel, batch.max_rank, x.shape[0]))
        inside.append(True)  # the CPU's ops launch the members one by one, through lora: not the sample's own calls
        group(x, fused, outs, layer, first, batch, table)
        inside.pop()

    def record(x, y, layer, proj, batch, table):
        if not inside:
            calls.append(("alone", proj, 1, layer, batch.decode, batch.decode_kernel, batch.max_rank, x.shape[0]))
        alone(x, y, layer, proj, batch, table)

    monkeypatch.setattr(bench.ops, "lora_group", record_group)
    monkeypatch.setattr(bench.ops, "lora", record)
    for kernel in ("bgmv", "mbgmv"):
        calls.clear()
        seconds = bench.kernel_seconds(kernel, [8, 16, 8])
        assert seconds > 0 and math.isfinite(seconds)
        one_replay = calls[: 4 * QUICK_PLAN.rounds]  # the warm-up: every round's layer, four launches a layer
        assert [(how, first, members) for how, first, members, *_ in one_replay[:4]] == [
            ("group", Q, 3), ("group", GATE, 2), ("alone", O, 1), ("alone", DOWN, 1)]
        assert [layer for _, _, _, layer, *_ in one_replay] == [r % spec.num_layers for r in range(QUICK_PLAN.rounds) for _ in range(4)]
        # decode batches of this kernel, at the batch's max rank (the CPU's launch rank), of the three rows
        assert {tuple(call[4:]) for call in calls} == {(True, kernel, 16, 3)}


def test_mbgmv_launches_at_the_lowest_rank_tier_that_holds_the_batch():
    """The rank a decode graph (and the profile's kernel samples) launch MBGMV with: the tiers 16 and 64 below
    max_lora_rank, else max_lora_rank."""
    assert [mbgmv_tier(highest, 256) for highest in (1, 16, 17, 64, 65, 256)] == [16, 16, 64, 64, 256, 256]
    assert [mbgmv_tier(highest, 64) for highest in (8, 16, 17, 64)] == [16, 16, 64, 64]
    assert [mbgmv_tier(highest, 16) for highest in (8, 16)] == [16, 16]
    assert mbgmv_tier(24, 32) == 32


def test_the_profile_checks_its_kernel_choice_against_the_steps_it_measured():
    """notes.kernel_choice_check: where one kernel's whole decode step measured clearly faster (5%), do the kernel
    models pick it? Kernel models that timed other launches than the steps run (BGMV predicted cheaper while MBGMV's
    steps are faster) show up there, with the steps they pick wrong."""
    decode = {"bgmv": [[[16] * 64, 65536, 0.020], [[8, 64], 2048, 0.0100], [[16], 128, 0.0050]],
              "mbgmv": [[[16] * 64, 65536, 0.015], [[8, 64], 2048, 0.0080], [[16], 128, 0.0051]]}  # the last: a tie
    right = choice_check(BgmvModel(1.0, 1.0), MbgmvModel(0.0, 0.0), decode)  # MBGMV always cheaper
    assert right == {"clear": 2, "agree": 2, "disagree": []}
    wrong = choice_check(BgmvModel(0.0, 0.0), MbgmvModel(1.0, 1.0), decode)  # BGMV always cheaper
    assert wrong["clear"] == 2 and wrong["agree"] == 0
    assert wrong["disagree"][0] == {"rows": 64, "max_rank": 16, "context_tokens": 65536, "bgmv_ms": 20.0,
                                    "mbgmv_ms": 15.0, "picked": "bgmv"}
