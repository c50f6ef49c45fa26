"""Tensor parallelism on the CPU (gloo, 2 processes, float32): the shards' algebra against the whole model's
projections, a rank reading only its slices of the checkpoint, and whole engines at tensor_parallel_size 2 giving
the greedy tokens of the single-process engine and of transformers + PEFT, with every fixture adapter (ranks 1 to
32, different targets) in one batch and a pool small enough that adapters are evicted and placed again while the
ranks run. A rank killed mid-request takes the engine down: every request errors, nothing hangs."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import time

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.kernel_choice import default_profile_path
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.daemon.model.adapters import LoraAdapter
from lorad.daemon.model.checkpoint import MODEL_CONFIGS, PROJECTIONS, ModelSpec, dummy_weights, load_spec, load_weights
from lorad.daemon.engine.tp_worker import free_port
from lorad.daemon.model.tensor_parallel import COLUMN_PARALLEL, Shard, check_size
from lorad.daemon.server.metrics import render
from lorad.errors import BadRequest, EngineDead
from lorad.scheduler.perf_model import example_profile

from test_hf_parity import MAX_TOKENS, make_cases, mismatches

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def spec_of(**shape) -> ModelSpec:
    return ModelSpec.from_hf_config({**MODEL_CONFIGS["tiny-llama"], **shape})


# --- which sizes split which shapes ---------------------------------------------------------------------------


def test_sizes_that_do_not_split_the_model_are_refused_naming_the_shape():
    spec = spec_of(num_attention_heads=4, num_key_value_heads=2, intermediate_size=172)
    check_size(spec, 2)
    check_size(spec, 4)  # 2 KV heads, each replicated on 2 ranks
    with pytest.raises(BadRequest, match=r"tensor_parallel_size 3 does not divide the 4 attention heads and the 2 KV "
                                         r"heads .* and the intermediate size 172"):
        check_size(spec, 3)
    with pytest.raises(BadRequest, match="intermediate size 170"):
        check_size(spec_of(intermediate_size=170), 4)
    with pytest.raises(BadRequest, match="6 KV heads"):
        check_size(spec_of(num_attention_heads=12, num_key_value_heads=6, hidden_size=96), 4)


def test_config_refuses_a_bad_size_and_cpu_assisted_cold_starts():
    for size in (0, -1, True, 2.0, 65):
        with pytest.raises(BadRequest, match="tensor_parallel_size must be an integer in 1..64"):
            EngineConfig(tensor_parallel_size=size)
    for cold_start in ("cpu", "auto"):
        with pytest.raises(BadRequest, match=f"cold_start {cold_start} does not run with tensor_parallel_size > 1"):
            EngineConfig(tensor_parallel_size=2, cold_start=cold_start)
    EngineConfig(tensor_parallel_size=2, cold_start="cached")
    with pytest.raises(BadRequest, match="all_reduce must be one of auto, nccl, fused, not 'one-shot'"):
        EngineConfig(all_reduce="one-shot")


def test_auto_sums_two_gpus_through_the_fused_kernel_and_more_or_the_cpu_through_the_groups_all_reduce():
    from lorad.daemon.engine.tp_worker import all_reduce_asked

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert EngineConfig().all_reduce == "auto"
    assert all_reduce_asked(EngineConfig(tensor_parallel_size=2), cuda) == "fused"
    assert all_reduce_asked(EngineConfig(tensor_parallel_size=4), cuda) == "nccl"
    assert all_reduce_asked(EngineConfig(tensor_parallel_size=2), cpu) == "nccl"
    for asked in ("nccl", "fused"):
        assert all_reduce_asked(EngineConfig(tensor_parallel_size=4, all_reduce=asked), cuda) == asked


def test_an_engine_warns_when_its_profile_timed_other_sums(caplog):
    from lorad.daemon.engine.tp_worker import check_profile_sums

    def warned(machine: dict, path: str) -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lorad.daemon.engine.tp_worker"):
            check_profile_sums(dataclasses.replace(example_profile(), machine=machine), path)
        return "may be off" in caplog.text

    fused, nccl = "fused peer sum up to 256 rows, nccl above", "nccl"
    assert warned({"all_reduce": nccl}, fused) and warned({"all_reduce": fused}, nccl)
    assert warned({"all_reduce": fused}, "nccl (fused peer sum unavailable: it sums two GPUs' partials)")
    assert not warned({"all_reduce": fused}, fused) and not warned({"all_reduce": "gloo"}, "gloo")
    assert warned({"collective_backend": "nccl"}, fused)  # a profile from before it said: NCCL's sums
    assert not warned({}, fused)  # nothing said at all
    caplog.clear()
    check_profile_sums(None, fused)
    assert not caplog.text


def test_engine_refuses_a_size_before_starting_any_rank(hf_checkpoint):
    checkpoint = hf_checkpoint("llama")  # 4 heads
    with pytest.raises(BadRequest, match="tensor_parallel_size 8 does not divide the 4 attention heads"):
        Engine(EngineConfig(model=str(checkpoint.model_dir), device="cpu", tensor_parallel_size=8))


@pytest.mark.parametrize("flags", [dict(quantization="fp8"), dict(kv_cache_dtype="fp8")])
def test_fp8_is_refused_across_ranks_before_any_starts(flags):
    with pytest.raises(BadRequest, match="not served with tensor_parallel_size > 1"):
        Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, device="cpu", tensor_parallel_size=2, **flags))


def test_a_profile_of_another_size_is_refused_before_any_rank_starts(tmp_path):
    path = tmp_path / "one-gpu.json"
    example_profile().save(path)  # a profile of one GPU (no tensor_parallel_size: 1)
    with pytest.raises(BadRequest, match="measured at tensor_parallel_size 1, the engine runs 2 .*--tensor-parallel-size 2"):
        Engine(EngineConfig(model_config="tiny-llama", dummy_weights=True, device="cpu", tensor_parallel_size=2,
                            profile_path=str(path)))
    assert multiprocessing.active_children() == []


# --- the shards' algebra ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads,size", [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_shards_compute_the_whole_projections_with_lora(kv_heads, size):
    """Column-parallel outputs side by side, and row-parallel partial sums (their LoRA included: the fused
    all-reduce), give the whole model's projection plus its LoRA, for every projection, with GQA and with KV heads
    replicated (1 KV head at 2 ranks, 2 at 4)."""
    spec = spec_of(num_attention_heads=4, num_key_value_heads=kv_heads, intermediate_size=176)
    generator = torch.Generator().manual_seed(kv_heads * 10 + size)
    weights = dummy_weights(spec, torch.float64, torch.device("cpu"), seed=3)
    rank = 5
    lora = {}
    for projection, name in enumerate(PROJECTIONS):
        fan_in, fan_out = spec.projection_shape(name)
        lora[(0, projection)] = (torch.randn(rank, fan_in, generator=generator, dtype=torch.float64),
                                 torch.randn(fan_out, rank, generator=generator, dtype=torch.float64))
    adapter = LoraAdapter("a", "<memory>", rank, PROJECTIONS, lora, 0, {key: 1.0 for key in lora})
    shards = [Shard(spec, r, size) for r in range(size)]
    group = spec.num_heads // spec.num_kv_heads
    for projection, name in enumerate(PROJECTIONS):
        module = "mlp." if name in ("gate_proj", "up_proj", "down_proj") else "self_attn."
        key = f"model.layers.0.{module}{name}.weight"
        fan_in, _ = spec.projection_shape(name)
        x = torch.randn(3, fan_in, generator=generator, dtype=torch.float64)
        a, b = lora[(0, projection)]
        whole = x @ weights[key].t() + (x @ a.t()) @ b.t()
        parts = []
        for shard in shards:
            w = shard.take({key: weights[key]})[key]
            a_r, b_r = shard.adapter(adapter).weights[(0, projection)]
            x_r = x if projection in COLUMN_PARALLEL else x[:, slice(*shard.features(projection))]
            parts.append(x_r @ w.t() + (x_r @ a_r.t()) @ b_r.t())
        if projection in COLUMN_PARALLEL:
            if name in ("k_proj", "v_proj") and size > spec.num_kv_heads:
                # each KV head on size / kv_heads ranks: the first rank of each group, side by side
                parts = parts[:: size // spec.num_kv_heads]
            torch.testing.assert_close(torch.cat(parts, dim=1), whole)
        else:
            torch.testing.assert_close(sum(parts), whole)
    # each rank's query heads read the KV heads it holds
    for shard in shards:
        q_heads = range(*[edge // spec.head_dim for edge in shard.features(0)])
        kv_heads_held = range(*[edge // spec.head_dim for edge in shard.features(1)])
        assert {head // group for head in q_heads} <= set(kv_heads_held)
    assert shards[0].local.num_heads * size == spec.num_heads


def test_a_rank_reads_only_its_slices_of_a_sharded_checkpoint(hf_checkpoint):
    checkpoint = hf_checkpoint("llama_sharded")  # several safetensors files and an index
    spec = load_spec(checkpoint.model_dir)
    whole = load_weights(checkpoint.model_dir, torch.float32, torch.device("cpu"))
    for rank in range(2):
        shard = Shard(spec, rank, 2)
        read = shard.read_weights(checkpoint.model_dir, torch.float32, torch.device("cpu"))
        expected = shard.take(whole)
        assert read.keys() == expected.keys()
        for name in read:
            assert torch.equal(read[name], expected[name]), name
        assert read["model.layers.0.self_attn.q_proj.weight"].shape == (spec.q_size // 2, spec.hidden_size)
        assert read["model.layers.0.mlp.down_proj.weight"].shape == (spec.hidden_size, spec.intermediate_size // 2)


# --- whole engines ---------------------------------------------------------------------------------------------


def generate(model_dir, adapters: dict, cases, overlap_on_cpu: bool = False, max_tokens=None, **config):
    """-> (results, the engine's status at the end). overlap_on_cpu: decode steps overlapped as on cuda (requests
    that keep their logits are never overlapped: they keep none then). max_tokens: each request's (MAX_TOKENS)."""
    engine = Engine(EngineConfig(model=str(model_dir), adapters=tuple((name, str(path)) for name, path in adapters.items()),
                                 device="cpu", dtype="float32", **config))
    engine.overlap_decode = overlap_on_cpu
    requests = [GenerationRequest(prompt_token_ids=list(prompt), adapter=adapter, keep_logits=not overlap_on_cpu,
                                  sampling=SamplingParams(max_tokens=limit, temperature=0, ignore_eos=True))
                for (prompt, adapter), limit in zip(cases, max_tokens or [MAX_TOKENS] * len(cases))]
    try:
        results = engine.generate(requests)
        return results, engine.status()
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "llama_tied", "mistral_window"])
def test_tp2_greedy_tokens_equal_tp1_and_hf_peft(arch, hf_checkpoint, hf_reference):
    # llama: 4 heads over 2 KV heads (GQA, one KV head a rank); llama_tied: one KV head, replicated on both ranks;
    # mistral_window: a window of 8, so rank 0 gives back pages before it (KVCache.trim) that the workers' copies of
    # the block lists still name, and hands them out again, in this small pool, to other sequences and adapters.
    # 16 requests of 1..40 tokens over the base model and six adapters, 3 running at once, 64 tokens a step
    # (prefills split over steps, beside decodes), in a pool that holds about two adapters beside the KV cache.
    checkpoint = hf_checkpoint(arch)
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)
    config = dict(max_running_requests=3, max_batch_tokens=64, pool_bytes=1600 * 256)
    single, _ = generate(checkpoint.model_dir, checkpoint.adapters, cases, **config)
    split, status = generate(checkpoint.model_dir, checkpoint.adapters, cases, tensor_parallel_size=2, **config)
    tp = status["tensor_parallel"]
    assert tp["size"] == 2 and tp["backend"] == "gloo" and [rank["rank"] for rank in tp["ranks"]] == [0, 1]
    assert tp["all_reduce"] == "gloo"  # all_reduce auto: the fused sum is for two GPUs
    assert all(rank["alive"] and rank["pool_pages"] == status["pool"]["pages"] for rank in tp["ranks"])
    assert status["adapter_evictions"] > 0, "the pool was large enough that no adapter was evicted"
    assert (status["kv_sharing"]["window_pages_freed"] > 0) == (arch == "mistral_window")
    for index, (one, two) in enumerate(zip(single, split)):
        assert two.token_ids == one.token_ids, f"request {index} (adapter {cases[index][1]})"
    problems = mismatches(f"{arch} tp=2", cases, split, hf_reference(checkpoint.model_dir, checkpoint.adapters))
    assert not problems, f"{len(problems)} of {len(cases)} requests differ from HF + PEFT:\n" + "\n".join(problems)


@pytest.mark.slow
def test_tp2_preempted_sequences_stay_in_step(hf_checkpoint, caplog):
    # A pool so small that growing KV preempts running sequences (their blocks freed, recomputed later): the workers'
    # block lists follow rank 0's, and the tokens stay those of TP=1.
    checkpoint = hf_checkpoint("llama")
    adapters = {name: checkpoint.adapters[name] for name in ("qv-r1", "o-down-r4")}
    cases = [(prompt, [None, "qv-r1", "o-down-r4"][index % 3])
             for index, (prompt, _) in enumerate(make_cases(list(checkpoint.adapters), checkpoint.vocab_size)[:9])]
    config = dict(max_running_requests=8, pool_bytes=300 * 256, max_model_len=64, kv_admission_headroom=0)
    single, _ = generate(checkpoint.model_dir, adapters, cases, **config)
    caplog.clear()
    with caplog.at_level("INFO", logger="lorad.scheduler.batching"):
        split, _ = generate(checkpoint.model_dir, adapters, cases, tensor_parallel_size=2, **config)
    assert any("preempt" in record.getMessage() for record in caplog.records), "no sequence was preempted"
    for index, (one, two) in enumerate(zip(single, split)):
        assert two.token_ids == one.token_ids, f"request {index} (adapter {cases[index][1]})"


@pytest.mark.slow
def test_tp2_choices_of_one_prompt_equal_tp1(hf_checkpoint):
    # n = 3 seeded choices per request share the prompt's full blocks; under TP each recomputes the partial last one
    # (rank 0's device copy would not reach the workers): the tokens are TP=1's, which copies it.
    checkpoint = hf_checkpoint("llama")
    adapters = {name: checkpoint.adapters[name] for name in ("qv-r1", "all-r8")}
    cases = [(prompt, [None, "qv-r1", "all-r8"][index]) for index, (prompt, _) in
             enumerate(make_cases(list(checkpoint.adapters), checkpoint.vocab_size)[2:5])]

    def run(**config):
        engine = Engine(EngineConfig(model=str(checkpoint.model_dir), device="cpu", dtype="float32",
                                     adapters=tuple((name, str(path)) for name, path in adapters.items()), **config))
        try:
            return [[choice.token_ids for choice in result.choices] for result in engine.generate([
                        GenerationRequest(prompt_token_ids=list(prompt), adapter=adapter, n=3,
                                          sampling=SamplingParams(max_tokens=6, temperature=0.9, seed=11 + index))
                        for index, (prompt, adapter) in enumerate(cases)])]
        finally:
            engine.close()

    single = run()
    assert all(len({tuple(tokens) for tokens in choices}) > 1 for choices in single)  # the choices differ
    assert run(tensor_parallel_size=2) == single


@pytest.mark.slow
def test_tp2_dummy_weights_and_adapters_run(tmp_path):
    # The benchmarks' path: random weights drawn per rank in its local shape, in-memory adapters every rank makes;
    # the profile of size 2 found at its default path (`lorad profile --tensor-parallel-size 2` writes there).
    profile_path = default_profile_path("tiny-llama", torch.device("cpu"), str(tmp_path), 2)
    dataclasses.replace(example_profile("mbgmv"), machine={"tensor_parallel_size": 2}).save(profile_path)
    config = EngineConfig(model_config="tiny-llama", dummy_weights=True, dummy_adapters=3, dummy_adapter_rank=4,
                          dummy_adapter_targets=",".join(PROJECTIONS), device="cpu", tensor_parallel_size=2,
                          cold_start="cached", state_dir=str(tmp_path), all_reduce="fused")
    engine = Engine(config)
    try:
        results = engine.generate([GenerationRequest(prompt_token_ids=[5, 6, 7], adapter=f"dummy-{index % 3}",
                                                     sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                                   for index in range(4)])
        status = engine.status()
        metrics = render(engine.metrics())
    finally:
        engine.close()
    assert [len(result.token_ids) for result in results] == [4] * 4
    assert status["lora_kernel_choice"] == f"profile:{profile_path}" and profile_path.name.endswith("-tp2.json")
    assert status["tensor_parallel"]["size"] == 2 and status["tensor_parallel"]["gpus"] == ["cpu", "cpu"]
    assert status["tensor_parallel"]["adapter_pages_each_rank"] > 0
    # all_reduce fused asked where it cannot run: gloo sums, and says why
    assert status["tensor_parallel"]["all_reduce"] == "gloo (fused peer sum unavailable: it sums two GPUs' partials " \
                                                      "(here 2 ranks over gloo))"
    assert 'lorad_tensor_parallel_rank_up{rank="0",device="cpu"} 1' in metrics
    assert 'lorad_tensor_parallel_rank_up{rank="1",device="cpu"} 1' in metrics


@pytest.mark.slow
def test_a_rank_that_dies_takes_the_engine_down(demo_assets):
    from test_process import Collector, request, start_engine

    deaths = []
    config = EngineConfig(demo=True, device="cpu", pool_bytes=8 << 20, max_model_len=1024, tensor_parallel_size=2)
    engine = start_engine(demo_assets, config, on_death=deaths.append)
    try:
        status = engine.status()["tensor_parallel"]
        assert status["size"] == 2 and len(status["ranks"]) == 2
        worker = status["ranks"][1]["pid"]
        collectors = [Collector() for _ in range(2)]
        for collector in collectors:
            engine.submit(request([1, 2, 3], "demo-r8", collector, max_tokens=1000, ignore_eos=True))
        assert all(collector.first.wait(20) for collector in collectors)
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        for collector in collectors:
            last = collector.wait(15)
            assert last.finish_reason == "error" and "died" in last.error
        assert time.monotonic() - killed < 15
        assert not engine.alive and len(deaths) == 1 and "exit code 1" in deaths[0]
        with pytest.raises(EngineDead):
            engine.submit(request([1, 2]))
    finally:
        engine.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


def test_step_message_rebuilds_the_plan_and_the_block_lists():
    """Over several steps: blocks added a row at a time, a sequence preempted (its list emptied and grown again), one
    leaving a step and coming back, one finished and a new one in its place. Each step's message carries only new
    rows where it can, and the worker's lists equal rank 0's every time."""
    import pickle

    import numpy as np

    from lorad.daemon.engine.step_plan import StepPlan
    from lorad.daemon.engine.tp_worker import BlockSync, StepMessage
    from lorad.gpu_ops.page_pool import BlockList
    from lorad.scheduler.batching import Sequence

    def rows(first, count):
        return np.arange(first * 6, (first + count) * 6, dtype=np.int32).reshape(count, 3, 2)

    a, b, c = (Sequence(name, [1, 2, 3], 3, None, blocks=BlockList()) for name in "abc")
    a.blocks.extend(rows(0, 2))
    b.blocks.extend(rows(10, 1))
    rank0, worker = BlockSync(), BlockSync()

    def step(seqs):
        plan = StepPlan(tokens=[np.array([4, 5, 6])] + [np.array([9])] * (len(seqs) - 1), starts=np.arange(len(seqs)),
                        slots=np.array([-1, 3, 0][: len(seqs)]), blocks=[seq.blocks.array() for seq in seqs],
                        sample=np.ones(len(seqs), dtype=bool), seqs=seqs)
        message = pickle.loads(pickle.dumps(StepMessage.of(plan, [], [], rank0.updates(plan), "eager")))
        assert message.path == "eager"
        rebuilt = message.plan(worker.apply(message.blocks))
        assert [t.tolist() for t in rebuilt.tokens] == [t.tolist() for t in plan.tokens]
        for field in ("starts", "slots", "sample", "counts"):
            assert np.array_equal(getattr(rebuilt, field), getattr(plan, field)), field
        assert rebuilt.decode == plan.decode and rebuilt.row_slots().tolist() == plan.row_slots().tolist()
        for mine, theirs in zip(rebuilt.blocks, plan.blocks):
            assert np.array_equal(mine, theirs)
        return [len(new) for new in message.blocks[2]]

    assert step([a, b]) == [2, 1]
    a.blocks.extend(rows(2, 1))
    assert step([a, b]) == [1, 0]  # only the new row
    b.blocks.clear()  # preempted, then grown again to as many rows
    b.blocks.extend(rows(20, 1))
    assert step([a, b]) == [0, 1]
    assert step([a]) == [0]
    assert step([a, b]) == [0, 1]  # b left a step: sent whole
    c.blocks.extend(rows(30, 3))
    assert step([c, a]) == [3, 0]
    assert dataclasses.is_dataclass(StepMessage)


@pytest.mark.parametrize("name,parameters", [("llama-2-70b", 68.98e9), ("llama-3-70b", 70.55e9)])
def test_70b_shapes_split_over_two_to_eight_gpus(name, parameters):
    spec = ModelSpec.from_hf_config(MODEL_CONFIGS[name])
    for size in (2, 4, 8):
        check_size(spec, size)
    counted = 2 * spec.vocab_size * spec.hidden_size + spec.num_layers * sum(
        fan_in * fan_out for fan_in, fan_out in map(spec.projection_shape, PROJECTIONS))
    assert abs(counted - parameters) / parameters < 0.002
    local = Shard(spec, 1, 2).local
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (32, 4, 14336)


@pytest.mark.slow
def test_an_engine_that_fails_after_its_workers_started_stops_them(hf_checkpoint):
    checkpoint = hf_checkpoint("llama")
    config = dict(model=str(checkpoint.model_dir), device="cpu", tensor_parallel_size=2, max_model_len=512)
    with pytest.raises(Exception, match="cannot hold one sequence"):
        Engine(EngineConfig(pool_bytes=64 * 256, **config))  # refused once the ranks have agreed on the pool
    engine = Engine(EngineConfig(**config))  # the group was left: a new one forms
    engine.close()


class ReportingWorker:
    """Rank 1's end of the pipe at close: it reports its steps as run."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    def poll(self, timeout):
        return True

    def recv(self):
        return "stopped", {"steps": 0, "decode_graph": 0, "prefill_graph": 0, "eager": 0}

    def close(self):
        pass


@pytest.mark.parametrize("drained", [True, False])
def test_close_releases_the_graphs_only_once_the_device_work_ended(monkeypatch, drained):
    # On NCCL a rank's device work can wait for ever (a collective the other rank never launched). Releasing the
    # CUDA graphs waits for the device without a bound: it must come after the bounded drain said the work ended,
    # or close would hang before the drain's timeout could say why; where it did not end, the group is aborted
    # with the graphs held.
    import types

    from lorad.daemon.engine import tp_worker
    from lorad.daemon.model import tensor_parallel

    events = []
    monkeypatch.setattr(tensor_parallel, "device_drained", lambda: events.append("drain") or drained)
    monkeypatch.setattr(tensor_parallel, "leave_group", lambda drain=True: events.append(("leave", drain)))
    tp = tp_worker.TensorParallel(types.SimpleNamespace(tensor_parallel_size=2), spec_of(), torch.device("cpu"))
    tp.connections = [ReportingWorker()]
    tp.runner = types.SimpleNamespace(graph_steps=0, prefill_graph_steps=0,
                                      release_graphs=lambda: events.append("release"))
    tp.close()
    assert tp.connections[0].sent == [("stop",)]
    assert events == (["drain", "release", ("leave", False)] if drained else ["drain", ("leave", False)])


@pytest.mark.slow
def test_an_engine_whose_model_fails_to_build_after_its_workers_started_stops_them(hf_checkpoint, monkeypatch):
    # Rank 0's model failing to build (out of memory on a large shard, a tensor missing) once the workers started:
    # the engine closes them with no runner attached, and the build's error is the one raised.
    import lorad.daemon.engine.engine as engine_module

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory building the model")

    monkeypatch.setattr(engine_module, "ModelRunner", out_of_memory)
    checkpoint = hf_checkpoint("llama")
    with pytest.raises(RuntimeError, match="out of memory building the model"):
        Engine(EngineConfig(model=str(checkpoint.model_dir), device="cpu", tensor_parallel_size=2, max_model_len=512))
    assert not torch.distributed.is_initialized()  # the group was left


@pytest.mark.slow
def test_tp2_overlapped_decode_equals_tp1(hf_checkpoint, caplog):
    # Overlapped decode runs on cuda only; forced on here, each step's input ids go from rank 0's device to the
    # workers by a broadcast (gloo's here, NCCL's on GPUs), in step with the plans.
    checkpoint = hf_checkpoint("llama")
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)[:4]  # all running at once: steps overlap
    config = dict(max_running_requests=4, max_batch_tokens=64)
    single, _ = generate(checkpoint.model_dir, checkpoint.adapters, cases, **config)
    split, status = generate(checkpoint.model_dir, checkpoint.adapters, cases, tensor_parallel_size=2,
                             overlap_on_cpu=True, **config)
    assert status["overlapped_decode_steps"] > 0
    for index, (one, two) in enumerate(zip(single, split)):
        assert two.token_ids == one.token_ids, f"request {index} (adapter {cases[index][1]})"
    # At close every worker reports its steps by path (graph, eager): the same as rank 0's.
    assert not [record for record in caplog.records if "other paths than rank 0" in record.getMessage()
                or "did not report its steps" in record.getMessage()]


def test_tp2_plans_steps_ahead_as_tp1_does(hf_checkpoint):
    # Two running slots for five requests of different lengths: a step that admits the queue's head is planned while
    # the step before it is in flight, at TP=2 as at TP=1 (the workers take the decode rows' input ids from the
    # broadcast tokens in flight), the same steps planned ahead and TP=1's tokens.
    checkpoint = hf_checkpoint("llama")
    cases = make_cases(list(checkpoint.adapters), checkpoint.vocab_size)[:5]
    limits = [3, 7, 5, 9, 4]
    config = dict(max_running_requests=2, max_batch_tokens=64, max_tokens=limits)
    single, status_one = generate(checkpoint.model_dir, checkpoint.adapters, cases, overlap_on_cpu=True, **config)
    split, status = generate(checkpoint.model_dir, checkpoint.adapters, cases, tensor_parallel_size=2,
                             overlap_on_cpu=True, **config)
    assert status_one["plan_ahead"] == status["plan_ahead"] == {"on": True, "why": None}
    assert status["planned_ahead_steps"] == status_one["planned_ahead_steps"] > 0
    assert status["overlapped_decode_steps"] == status_one["overlapped_decode_steps"] > 0
    for index, (one, two) in enumerate(zip(single, split)):
        assert two.token_ids == one.token_ids, f"request {index} (adapter {cases[index][1]})"


def test_a_worker_stages_hinted_adapters_once_on_its_own_thread(hf_checkpoint, monkeypatch):
    # Rank 0 hints each adapter as it reads it; the worker stages its shard on a thread of its own, and the step
    # that places it takes that (or waits for it) instead of staging it again.
    import threading

    from lorad.daemon.engine.tp_worker import RankWorker

    checkpoint = hf_checkpoint("llama")
    config = EngineConfig(model=str(checkpoint.model_dir), device="cpu", dtype="float32", tensor_parallel_size=2,
                          pool_bytes=1600 * 256)
    worker = RankWorker(1, config, load_spec(checkpoint.model_dir), "llama", str(checkpoint.model_dir), 256,
                        torch.device("cpu"))
    worker.bind(worker.pages(), worker.spec.page_elems, 8)
    staged_on, stage = [], worker.table.stage

    def slow_stage(weights, pin=True):
        staged_on.append(threading.current_thread().name)
        time.sleep(0.05)  # the step's thread asks while the staging thread is at it
        return stage(weights, pin=pin)

    monkeypatch.setattr(worker.table, "stage", slow_stage)
    adapters = [(name, str(path)) for name, path in checkpoint.adapters.items()]
    for name, path in adapters:
        worker.hint(name, path)
    # The step asks once the staging thread is at the first one (a step comes after its adapters' hints; asking at
    # once, this thread could claim each adapter first, the staging thread a step behind it on a busy machine).
    deadline = time.monotonic() + 30
    while not staged_on:
        assert time.monotonic() < deadline, "the staging thread never started"
        time.sleep(0.001)
    taken = [worker._staged(name, path) for name, path in adapters]
    assert len(staged_on) == len(adapters) and "lorad-rank-stager" in staged_on
    assert all(worker._staged(name, path) is one for (name, path), one in zip(adapters, taken))
    assert len(staged_on) == len(adapters) and not worker._staging


def test_a_worker_reads_an_adapter_loaded_again_with_new_files_and_refuses_files_rank_0_did_not_read(
        hf_checkpoint, tmp_path):
    # Rank 0 sends each placement with the adapter's files as it read them (LoraAdapter.source). A worker keyed its
    # shards by name and directory alone: an adapter unloaded and loaded again from the same directory with new
    # weights kept its old shard on the other ranks, which then computed with other weights than rank 0's.
    import shutil

    from safetensors.torch import load_file, save_file

    from lorad.daemon.engine.tp_worker import RankWorker
    from lorad.daemon.model.adapters import AdapterError, load_peft_adapter

    checkpoint = hf_checkpoint("llama")
    config = EngineConfig(model=str(checkpoint.model_dir), device="cpu", dtype="float32", tensor_parallel_size=2,
                          pool_bytes=1600 * 256)
    spec = load_spec(checkpoint.model_dir)
    worker = RankWorker(1, config, spec, "llama", str(checkpoint.model_dir), 256, torch.device("cpu"))
    worker.bind(worker.pages(), worker.spec.page_elems, 8)
    directory = tmp_path / "a"
    shutil.copytree(next(iter(checkpoint.adapters.values())), directory)
    first = load_peft_adapter(directory, spec, config.max_lora_rank, name="a")
    assert first.source is not None
    staged = worker._staged("a", str(directory), first.source)
    assert worker._staged("a", str(directory), first.source) is staged  # once per files

    weights_file = directory / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    time.sleep(0.01)  # a new mtime even on coarse clocks (the inode changes anyway: a new file replaces it)
    weights_file.unlink()
    save_file({key: value * 2 for key, value in tensors.items()}, weights_file)
    second = load_peft_adapter(directory, spec, config.max_lora_rank, name="a")  # rank 0 loads it again
    assert second.source != first.source
    restaged = worker._staged("a", str(directory), second.source)
    assert restaged is not staged and not torch.equal(restaged.pages, staged.pages)
    expected = worker.table.stage(worker.shard.adapter(second).weights, pin=False)
    assert torch.equal(restaged.pages, expected.pages)

    worker._adapters.entries.clear()  # the first files' shard left this rank's cache; rank 0 still serves them
    with pytest.raises(AdapterError, match="changed on disk after rank 0 read it"):
        worker._staged("a", str(directory), first.source)
    assert not worker._staging  # a failed staging leaves nothing waiting


def peer_sum_as_one_of_two_nccl_ranks(monkeypatch):
    """A PeerSum made by one process in a gloo group, told it is one of two NCCL ranks -> (it, what it told the other
    rank at each agreement)."""
    import torch.distributed as dist

    from lorad.daemon.model import tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda *args: "nccl")
        monkeypatch.setattr(dist, "get_world_size", lambda *args: 2)
        agreed = []
        real_agreed = tensor_parallel._agreed
        monkeypatch.setattr(tensor_parallel, "_agreed", lambda ok, device: agreed.append(ok) or real_agreed(ok, device))
        return tensor_parallel.PeerSum(64, torch.float32, torch.device("cpu")), agreed
    finally:
        dist.destroy_process_group()


def test_a_fused_sum_that_cannot_allocate_its_buffers_leaves_the_sums_to_nccl_and_says_why(monkeypatch):
    # Its symmetric memory cannot be had on the CPU, and the ranks agree on that (a collective) before either waits
    # for the other's buffers.
    fused, agreed = peer_sum_as_one_of_two_nccl_ranks(monkeypatch)
    assert fused.buffers is None and agreed == [True, False]
    assert fused.path.startswith("nccl (fused peer sum unavailable: ") and len(fused.path) > 40


def test_a_process_that_mapped_symmetric_memory_before_leaves_a_new_engines_sums_to_nccl(monkeypatch):
    # torch numbers a rendezvous's store exchanges per process: rank 0 of a second engine in one process would wait
    # on other keys than its new workers. It says so before it allocates anything, and the ranks agree on it.
    import torch.distributed._symmetric_memory as symm_mem

    from lorad.daemon.model import tensor_parallel

    monkeypatch.setattr(tensor_parallel, "_mapped_in_this_process", True)
    monkeypatch.setattr(symm_mem, "empty", lambda *args, **kwargs: pytest.fail("allocated after an earlier rendezvous"))
    fused, agreed = peer_sum_as_one_of_two_nccl_ranks(monkeypatch)
    assert fused.buffers is None and agreed == [False]
    assert fused.path == ("nccl (fused peer sum unavailable: this process mapped symmetric memory for an earlier engine "
                          "(its exchanges would not match))")
