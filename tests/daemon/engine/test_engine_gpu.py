"""The engine on an NVIDIA GPU: the same requests on cuda as on the CPU reference, mixed adapters in one
batch; float32 must give the same greedy tokens, bfloat16 logits close to float32's."""

import gc

import pytest
import torch

from lorad.config import EngineConfig
from lorad.daemon.engine.engine import Engine
from lorad.daemon.engine.prefill_graphs import TOKEN_BUCKETS, bucket_rows
from lorad.daemon.engine.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu


def _requests(adapters):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 60)), [9] * 11, list(range(100, 103))]
    names = [None, *sorted(adapters)]
    return [
        GenerationRequest(prompt_token_ids=prompts[i % len(prompts)], adapter=names[i % len(names)], sampling=greedy, keep_logits=True)
        for i in range(2 * len(names))
    ]


def _run(demo_assets, device, dtype):
    config = EngineConfig(
        model=str(demo_assets.model_dir), adapters=tuple((n, str(p)) for n, p in demo_assets.adapters.items()),
        device=device, dtype=dtype, max_batch_tokens=64,
    )
    return Engine(config).generate(_requests(demo_assets.adapters))


def test_cuda_float32_equals_cpu(demo_assets):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = _run(demo_assets, "cpu", "float32")
    gpu = _run(demo_assets, "cuda", "float32")
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-4)


def test_cuda_bfloat16_close_to_float32(demo_assets):
    full = _run(demo_assets, "cuda", "float32")
    half = _run(demo_assets, "cuda", "bfloat16")
    for a, b in zip(full, half):
        first_a, first_b = a.logits[0], b.logits[0]  # same context: the prompt
        rel = (first_a - first_b).norm() / first_a.norm()
        assert rel < 3e-2, rel


def test_cuda_engine_says_it_runs_the_triton_lora_kernels(demo_assets):
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), device="cuda", dtype="bfloat16"))
    assert engine.status()["ops"].startswith("triton[")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_eager(demo_assets, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())

    requests = _requests(demo_assets.adapters)

    def run(eager):
        # every request admitted at once, so their prompts are one step (the account's padding is that step's)
        engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype=dtype,
                                     eager=eager, max_running_requests=len(requests), max_lora_rank=64))
        results = engine.generate(_requests(demo_assets.adapters))
        status = engine.status()
        del engine
        gc.collect()  # the engine's page pool (most of the free memory) goes back before the next one is built
        return results, status

    eager, eager_status = run(True)
    graphed, graphed_status = run(False)
    assert eager_status["cuda_graph_steps"] == 0 and graphed_status["cuda_graph_steps"] > 0
    assert eager_status["prefill_cuda_graph_steps"] == 0 and graphed_status["prefill_cuda_graph_steps"] > 0
    # the account's padding rows: none eager; the one prompt step's bucket rows past its own in the graphs
    assert all(kind["padding_rows"] == 0 for kind in eager_status["step_time"]["by_kind"].values())
    prefill = graphed_status["step_time"]["by_kind"]["prefill"]
    assert prefill["steps"] == 1 and prefill["padding_rows"] == bucket_rows(prefill["rows"], TOKEN_BUCKETS) - prefill["rows"]
    for status in (eager_status, graphed_status):  # every step's span on the device clock: one stream, so the
        times = status["step_time"]  # spans follow each other, all within the engine's busy time
        for kind in times["by_kind"].values():
            assert (kind["device_s"] is None) == (kind["steps"] == 0) and (kind["device_s"] or 1) > 0
        assert 0 < times["device_s"] <= times["busy_s"]
        # every step's tokens are queued after its forward, and the waits follow the first step: the three parts
        # of the device's clock lie end to end within the busy time
        assert times["tokens_device_s"] > 0 and times["before_forward_s"] >= 0
        assert times["device_s"] + times["tokens_device_s"] + times["before_forward_s"] <= times["busy_s"]
    for a, b in zip(eager, graphed):
        if dtype == "float32":
            assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits[0], b.logits[0], atol=1e-3 if dtype == "float32" else 5e-2, rtol=1e-2)


def test_cuda_graphs_without_the_mlp_lora_equal_the_cpu(demo_assets):
    """Decode batches whose adapters target only attention projections (q, v; q, k, v, o; q, k, v) replay the graphs
    that launch no MLP LoRA, and give the CPU reference's tokens in float32; one MLP adapter joining takes the full
    graphs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for names in ((None, "demo-r1", "demo-r2", "demo-r8"), ("demo-r1", "demo-r16-mlp", "demo-r2")):
        requests = [GenerationRequest([5 + i, 6, 7], name, greedy, keep_logits=True) for i, name in enumerate(names)]
        cpu = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu", dtype="float32"))
        expected = cpu.generate(requests)
        engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                                     max_running_requests=4, max_lora_rank=64))
        graphs, keys = engine.runner.graphs, []
        choose = graphs._key
        graphs._key = lambda size, slots: keys.append(choose(size, slots)) or keys[-1]
        results = engine.generate([GenerationRequest([5 + i, 6, 7], name, greedy, keep_logits=True)
                                   for i, name in enumerate(names)])
        del engine
        gc.collect()
        for a, b in zip(expected, results):
            assert a.token_ids == b.token_ids, names
            torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-3, rtol=1e-3)
        lora_keys = {key[3] for key in keys if key[1] == "mbgmv"}
        if "demo-r16-mlp" in names:  # its steps (its adapter may come in a step after the others')
            assert "all" in lora_keys, keys
        else:
            assert lora_keys == {"attention"}, keys


def _one_request_per_adapter(demo_assets, **config):
    """(results, status) of one greedy float32 request per demo adapter and one for the base model, on a fresh
    cuda engine with `config`: MBGMV decode steps."""
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                                 max_running_requests=12, max_lora_rank=64, **config))
    names = [*sorted(demo_assets.adapters), None]
    for name in names[:-1]:  # placed first: no request's prefill waits for its copy or runs on the CPU workers
        assert engine.residency.preload(name)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = engine.generate([GenerationRequest([5 + i, 6, 7], name, greedy, keep_logits=True) for i, name in enumerate(names)])
    status = engine.status()
    del engine
    gc.collect()  # the engine's page pool (most of the free memory) goes back before the next one is built
    return results, status


def test_cuda_fused_lora_groups_equal_per_projection(demo_assets):
    """fuse_lora_groups: decode steps launch gate|up's LoRA at once (the demo's q, k, v tile differently and
    stay per projection); the same tokens and logits as one launch pair per projection, graphs and eager."""
    torch.backends.cuda.matmul.allow_tf32 = False

    def run(fuse, eager):
        return _one_request_per_adapter(demo_assets, eager=eager, fuse_lora_groups=fuse)

    per_projection, status = run(False, eager=False)
    assert status["decode_lora_groups"] == {"qkv": "per projection", "gate_up": "per projection"}
    for eager in (False, True):
        fused, status = run(True, eager)
        assert status["decode_lora_groups"]["gate_up"] == "one launch"
        for a, b in zip(per_projection, fused):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-3, rtol=1e-3)


def test_cuda_mixed_steps_group_their_decode_rows_lora(demo_assets, monkeypatch):
    """fuse_lora_groups in steps with prompt rows (replayed from prefill graphs): the prompt rows' q|k|v (steps of prompts
    alone: the demo's q, k, v share their input but their MBGMV tiles differ, so a mixed step takes them per projection)
    and gate|up LoRA shrinks are one MBGMM launch each, then a mixed step's decode rows' gate|up LoRA is one MBGMV launch
    pair; the tokens and logits of one launch pair per projection. Four running slots and staggered lengths, so
    requests join while others decode."""
    from lorad.daemon.model.ops import TritonOps
    from lorad.gpu_ops import mbgmm, mbgmv

    torch.backends.cuda.matmul.allow_tf32 = False
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    names = [*sorted(demo_assets.adapters), None]
    inside_mixed, mixed_groups, prompt_groups = [False], [], []
    lora_group, mbgmv_group, mbgmm_group = TritonOps.lora_group, mbgmv.mbgmv_group, mbgmm.mbgmm_group

    def spy_lora_group(self, x, fused, outs, layer, first, batch, table):
        inside_mixed[0] = not batch.decode and batch.one_row_slot is not None
        try:
            return lora_group(self, x, fused, outs, layer, first, batch, table)
        finally:
            inside_mixed[0] = False

    def spy_mbgmv_group(*args, **kwargs):
        if inside_mixed[0]:
            mixed_groups.append(args[4])  # the members
        return mbgmv_group(*args, **kwargs)

    def spy_mbgmm_group(*args, **kwargs):
        prompt_groups.append((args[4], inside_mixed[0]))  # the members, and whether decode rows share the step
        return mbgmm_group(*args, **kwargs)

    monkeypatch.setattr(TritonOps, "lora_group", spy_lora_group)
    monkeypatch.setattr(mbgmv, "mbgmv_group", spy_mbgmv_group)
    monkeypatch.setattr(mbgmm, "mbgmm_group", spy_mbgmm_group)

    def run(fuse):
        engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                                     max_running_requests=4, max_lora_rank=64, fuse_lora_groups=fuse))
        results = engine.generate([
            GenerationRequest([5 + i, 6, 7] * (1 + i % 3), name, keep_logits=True,
                              sampling=SamplingParams(max_tokens=3 + i % 5, temperature=0, ignore_eos=True))
            for i, name in enumerate(names)])
        status = engine.status()
        del engine
        gc.collect()
        return results, status

    per_projection, _ = run(False)
    assert not mixed_groups and not prompt_groups
    fused, status = run(True)
    assert status["step_time"]["by_kind"]["mixed"]["steps"] > 0 and status["prefill_cuda_graph_steps"] > 0
    assert status["prompt_lora_groups"] == {"qkv": "one shrink launch", "gate_up": "one shrink launch"}
    assert mixed_groups and set(mixed_groups) == {2}, "the mixed steps' decode rows launch gate|up as one group"
    assert set(prompt_groups) == {(3, False), (2, False), (2, True)}, "prompt rows launch q|k|v and gate|up as groups"
    for a, b in zip(per_projection, fused):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("eager,max_running,budget", [(False, 12, None), (True, 12, None), (False, 3, None), (False, 3, 16),
                                                      (True, 3, 16)])
def test_cuda_overlapped_decode_equals_the_cpu(demo_assets, eager, max_running, budget):
    """Overlapped decode (on by default on cuda) through the decode graphs and eager: the CPU's tokens, with
    requests ending on length at different steps and one on a stop token while its next row is in flight;
    with 3 running slots for 12 requests, the steps overlap while the others wait for a slot; with a 16-token
    budget the 40-token prompts go in chunks beside decode rows, steps planned ahead with the chunks from the host."""
    torch.backends.cuda.matmul.allow_tf32 = False
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    names = [None, *sorted(demo_assets.adapters)]

    def requests(stop_token=None):
        prompts = [[5, 6, 7], list(range(20, 60)), [9] * 11, list(range(100, 103))]
        return [GenerationRequest(prompts[i % 4], names[i % len(names)], SamplingParams(
                    max_tokens=6 + 2 * i, temperature=0, ignore_eos=True,
                    stop_token_ids=(stop_token,) if stop_token is not None and i == 1 else ()))
                for i in range(2 * len(names))]

    cpu_engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu", dtype="float32"))
    full = cpu_engine.generate(requests())
    stop_token = full[1].token_ids[len(full[1].token_ids) // 2]
    cpu = cpu_engine.generate(requests(stop_token))
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                                 eager=eager, max_running_requests=max_running, max_lora_rank=64,
                                 **({"max_batch_tokens": budget} if budget else {})))
    assert engine.overlap_decode and engine.status()["overlap_decode"] is True
    gpu = engine.generate(requests(stop_token))
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
    assert [r.finish_reason for r in gpu] == [r.finish_reason for r in cpu]
    assert cpu[1].finish_reason == "stop"
    assert engine.overlapped_steps > 0 and engine._in_flight is None
    if budget:
        assert engine.planned_ahead_steps > 0
    assert engine.pool.occupancy()["kv"] == 0
    del engine
    gc.collect()


def test_cuda_tiny_pool_takes_fenced_kv_pages_and_equals_the_cpu(demo_assets, monkeypatch):
    """A pool so small that the running batch outgrows it (no admission headroom): sequences end and are preempted
    while steps are in flight, their pages fenced, and the next step's KV takes them without waiting for the step in
    flight (PagePool.alloc, ordered): the tokens are the CPU's. The demo model's steps end before the host looks, so
    the fences' events say they never passed (query): every fenced page goes out to KV by the ordered path, while the
    step that may write it can still be on the device, and an adapter's copy waits for the event as ever."""
    torch.backends.cuda.matmul.allow_tf32 = False
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    names = [None, "demo-r1", "demo-r2"]  # adapters small enough for the pool
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 13, (12,), generator=generator)]

    def requests():  # rows end at different steps, while the next is in flight
        return [GenerationRequest(prompt, names[i % len(names)], SamplingParams(max_tokens=6 + i % 9, temperature=0,
                                                                                ignore_eos=True))
                for i, prompt in enumerate(prompts)]

    def engine_on(device):
        return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device=device, dtype="float32",
                                   pool_bytes=200 * 64 * 4, max_model_len=32, kv_admission_headroom=0))

    cpu = engine_on("cpu").generate(requests())
    engine = engine_on("cuda")

    class NeverPassed(torch.cuda.Event):
        def query(self):
            return False

    engine.pool.new_event = NeverPassed
    taken = []
    take_fenced = engine.pool._take_fenced
    monkeypatch.setattr(engine.pool, "_take_fenced", lambda count: taken.append(count) or take_fenced(count))
    gpu = engine.generate(requests())
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
    assert engine.status()["preemptions"] > 0 and engine.overlapped_steps > 0
    assert taken, "no step's KV took fenced pages"
    assert engine.pool.occupancy()["kv"] == 0
    del engine
    gc.collect()


@pytest.mark.parametrize("eager", [False, True])
def test_cuda_forced_bgmv_equals_the_cpu(demo_assets, eager):
    """lora_kernel=bgmv: every decode step pads to its largest rank (BGMV graphs at each rank bucket, or
    eager), and the float32 tokens and logits are the CPU reference's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu = _run(demo_assets, "cpu", "float32")
    adapters = tuple((n, str(p)) for n, p in demo_assets.adapters.items())
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cuda", dtype="float32",
                                 eager=eager, lora_kernel="bgmv", max_batch_tokens=64, max_running_requests=12,
                                 max_lora_rank=64))
    gpu = engine.generate(_requests(demo_assets.adapters))
    status = engine.status()
    del engine
    gc.collect()
    assert status["lora_kernel_choice"].startswith("forced:bgmv")
    assert status["lora_kernel_steps"]["bgmv"] > 0 and status["lora_kernel_steps"]["mbgmv"] == 0
    assert (status["cuda_graph_steps"] > 0) != eager
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=2e-4, rtol=2e-4)


def test_cuda_decode_pdl_gives_the_same_tokens(demo_assets):
    """decode_pdl: every kernel of a decode step that can be launched early, each waiting for the one before it on
    the device, gives the tokens and the decode steps' logits of stream order to the bit, through the decode graphs
    and eagerly, with several rows and with one; /v1/status says so. The prefill (the first token) runs in stream
    order in both engines, and two engines' prefill logits differed in the last bits (by 9.5e-7 on an H200): those
    are compared within float32 rounding."""
    from lorad.gpu_ops.launch import pdl_unavailable

    reason = pdl_unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    torch.backends.cuda.matmul.allow_tf32 = False

    def run(setting, eager):
        many = _one_request_per_adapter(demo_assets, eager=eager, decode_pdl=setting)
        one = _one_request(demo_assets, eager=eager, decode_pdl=setting)
        return many, one

    (plain, status), plain_one = run("off", eager=False)
    assert status["decode_pdl"] == {"on": False, "why": "decode_pdl off", "max_rows": None} and "decode-pdl" not in status["ops"]
    for eager in (False, True):
        (early, status), early_one = run("auto", eager)
        assert status["decode_pdl"] == {"on": True, "why": None, "max_rows": None} and "decode-pdl" in status["ops"]
        assert (status["cuda_graph_steps"] > 0) != eager
        for a, b in zip([*plain, plain_one], [*early, early_one]):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logits[0], b.logits[0], atol=1e-5, rtol=1e-5)
            x, y = torch.stack(a.logits[1:]), torch.stack(b.logits[1:])
            assert torch.equal(x, y), f"logits differ by up to {float((x - y).abs().max()):.3g} (decode steps {(x != y).any(-1).nonzero().flatten().tolist()})"


def _one_request(demo_assets, **config):
    """One greedy float32 request with the first demo adapter on a fresh cuda engine: one-row decode steps."""
    name = sorted(demo_assets.adapters)[0]
    engine = Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=((name, str(demo_assets.adapters[name])),),
                                 device="cuda", dtype="float32", max_running_requests=4, max_lora_rank=64, **config))
    assert engine.residency.preload(name)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    result = engine.generate([GenerationRequest([9, 6, 7], name, greedy, keep_logits=True)])[0]
    del engine
    gc.collect()
    return result


def test_cuda_lora_pdl_gives_the_same_tokens(demo_assets):
    """lora_pdl: the decode MBGMV's expand launched early gives the tokens and logits of plain stream order,
    through the decode graphs and eagerly; /v1/status says which launch runs."""
    from lorad.gpu_ops.launch import pdl_unavailable

    reason = pdl_unavailable(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    torch.backends.cuda.matmul.allow_tf32 = False

    def run(pdl, eager):  # the expand alone launched early: the step's other kernels in stream order
        return _one_request_per_adapter(demo_assets, eager=eager, lora_pdl=pdl, decode_pdl="off")

    plain, status = run("off", eager=False)
    assert status["decode_lora_pdl"] == {"on": False, "why": "lora_pdl off"} and "mbgmv-pdl" not in status["ops"]
    for eager in (False, True):
        early, status = run("auto", eager)
        assert status["decode_lora_pdl"] == {"on": True, "why": None} and "mbgmv-pdl" in status["ops"]
        for a, b in zip(plain, early):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=1e-5)
