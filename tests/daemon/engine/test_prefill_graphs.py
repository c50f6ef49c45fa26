"""PrefillGraphs (daemon/engine/prefill_graphs.py) on the CPU: what a replay reads from the static buffers after
`fill()`, and the padded static step run eagerly through the Triton kernels (Triton's interpreter)
inside the engine, which must give the reference engine's greedy tokens, token for token, and the
same logits; and that a step's streamed adapter pages are queued before its forward. The capture and the replay
themselves need a GPU: tests/daemon/engine/test_engine_gpu.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from triton_interpreter import CUDA, HAS_TRITON, interpreted  # before the kernel modules: sets TRITON_INTERPRET without a GPU

from lorad.daemon.engine.engine import Engine
from lorad.daemon.model.ops import TritonOps
from lorad.daemon.engine.prefill_graphs import PrefillGraphs
from lorad.daemon.engine.step_plan import StepPlan
from lorad.daemon.engine.request import GenerationRequest, SamplingParams
from lorad.gpu_ops.page_pool import SCRATCH_PAGE, AdapterTable, BlockList, KVCache, PagePool

from lorad.config import EngineConfig

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 4
Q_PROJ = 0  # daemon/model/llama.py's Q
GATE_PROJ = 4  # daemon/model/llama.py's GATE
PAGE_BYTES = 64 * 4  # the demo's hidden size, float32


def make(max_tokens=64, max_seqs=8, max_rank=64, max_model_len=64):
    pool = PagePool(4096, KV_HEADS * HEAD_DIM * 2, torch.float32, torch.device("cpu"))  # 2 tokens a page
    kv = KVCache(pool, LAYERS, KV_HEADS, HEAD_DIM)
    table = AdapterTable(pool, 4, LAYERS, [(8, 8)] * 7)
    model = SimpleNamespace(rope_rows=lambda positions, counts, lengths: positions)  # RoPE rows are positions
    return PrefillGraphs(model, kv, table, max_tokens, max_seqs, max_model_len=max_model_len, max_lora_rank=max_rank), kv


def plan_of(*seqs) -> StepPlan:
    """A step of (new token ids, first position, adapter slot, block list, sampled) per sequence."""
    tokens, starts, slots, blocks, sample = zip(*seqs)
    return StepPlan(list(tokens), np.array(starts), np.array(slots), list(blocks), np.array(sample))


def test_fill_lays_out_a_mixed_step_for_the_fixed_grids():
    graphs, kv = make()
    rng = np.random.default_rng(0)
    blocks = [rng.integers(1, 4096, size=(n, LAYERS, 2), dtype=np.int32) for n in (5, 2, 9)]
    # a prompt chunk of 7 tokens at position 0, a decode at position 3, a chunk of 10 at position 6
    seqs = [(np.arange(100, 107), 0, 2, blocks[0], False),
            (np.array([55]), 3, -1, blocks[1], True),
            (np.arange(200, 210), 6, 2, blocks[2], True)]
    key, sampled = graphs.fill(plan_of(*seqs))
    assert key == (32, "lora", 16) and sampled == 2  # 18 tokens: the 32 bucket
    bucket = graphs.buckets[32]
    ids, positions, offsets, sample_rows, _ = graphs.packed64[:, :32]
    assert ids[:18].tolist() == [*range(100, 107), 55, *range(200, 210)] and not ids[18:].any()
    assert positions[:18].tolist() == [*range(7), 3, *range(6, 16)] and not positions[18:].any()
    assert offsets[:18].tolist() == [p % kv.tokens_per_page for p in positions[:18].tolist()]
    assert sample_rows[:2].tolist() == [7, 17], "the last row of each sampled sequence, in order"
    assert bucket.seq_info[:, :4].tolist() == [[0, 7, 8, 0], [7, 1, 10, 0], [7, 4, 16, 0]]
    assert not bucket.seq_info[:, 3:].any(), "padding sequences have no rows and no context"
    tiles = [(s, r) for s, r in zip(bucket.tile_seq.tolist(), bucket.tile_row.tolist())]
    assert tiles[:2] == [(0, 0), (2, 0)] and all(t == (bucket.seqs, 0) for t in tiles[2:]), "the decode row in no tile"
    assert bucket.decode_seqs.tolist() == [1] + [bucket.seqs] * (bucket.seqs - 1), "the decode kernel's: the one-token sequence, then padding"
    assert bucket.row_slot[:18].tolist() == [2] * 7 + [-1] + [2] * 10 and (bucket.row_slot[18:] == -1).all()
    meta = bucket.seg_meta
    assert meta.shape == (3, bucket.seqs + 1)
    assert meta[:, 0].tolist() == [2, 0, 17] and not meta[2, 1:].any(), "one segment of slot 2, the rest empty"
    assert bucket.seg_rows[:17].tolist() == [*range(7), *range(8, 18)]
    assert bucket.seg_tile[:, 0].tolist() == [0, 0], "17 rows: one tile of 64"
    assert (bucket.seg_tile[0, 1:] == bucket.seqs).all() and not bucket.seg_tile[1, 1:].any()
    for index, ((tokens, start, _, seq_blocks, _), first) in enumerate(zip(seqs, (0, 7, 8))):
        table_rows = graphs.block_table[:, :, index, : len(seq_blocks)]
        assert torch.equal(table_rows, torch.from_numpy(seq_blocks).permute(1, 2, 0))
        for row in range(len(tokens)):
            page = seq_blocks[(start + row) // kv.tokens_per_page]
            assert torch.equal(graphs.dest_pages[:, :, first + row], torch.from_numpy(page).long())
    assert (graphs.dest_pages[:, :, 18:32] == SCRATCH_PAGE).all(), "padding rows write only the scratch page"
    assert (graphs.block_table[:, :, bucket.seqs] == SCRATCH_PAGE).all(), "the padding sequence reads the scratch page"


def test_consecutive_fills_send_each_row_only_the_blocks_it_lacks():
    """A mixed step, then the next one with its decode rows one block longer and in another order beside a new
    prompt: the block table holds every list, and the second fill sent one block a decode row plus the prompt's."""
    graphs, kv = make()
    rng = np.random.default_rng(1)
    lists = [BlockList() for _ in range(3)]
    for blocks, count in zip(lists, (4, 6, 3)):
        blocks.extend(rng.integers(1, 4096, size=(count, LAYERS, 2), dtype=np.int32))

    def fill(order, prompt):
        chosen = [lists[i] for i in order] + [prompt]
        seqs = [(np.array([7]), 2 * len(blocks) - 1, -1, blocks.array(), True) for blocks in chosen[:-1]]
        seqs.append((np.arange(10, 16), 0, -1, prompt.array(), True))
        plan = plan_of(*seqs)
        plan.lists = chosen
        graphs.fill(plan)
        for row, blocks in enumerate(chosen):
            rows = blocks.array()
            assert torch.equal(graphs.block_table[:, :, row, : len(rows)], torch.from_numpy(rows).permute(1, 2, 0))

    first_prompt, second_prompt = BlockList(), BlockList()
    for prompt in (first_prompt, second_prompt):
        prompt.extend(rng.integers(1, 4096, size=(3, LAYERS, 2), dtype=np.int32))
    fill([0, 1, 2], first_prompt)
    sent = graphs.blocks.entries_sent
    assert sent == 4 + 6 + 3 + 3
    for blocks in lists:
        blocks.extend(rng.integers(1, 4096, size=(1, LAYERS, 2), dtype=np.int32))
    fill([2, 0, 1], second_prompt)
    assert graphs.blocks.entries_sent - sent == 3 + 3 and graphs.blocks.rows_moved == 3


def test_fill_takes_decode_rows_input_ids_from_the_device():
    """A step planned while the one before it is in flight: its decode rows' input ids are that step's tokens on the
    device (StepPlan.device_tokens for device_rows), written over the placeholders after the packed copy."""
    graphs, _ = make()
    rng = np.random.default_rng(1)
    blocks = [rng.integers(1, 4096, size=(n, LAYERS, 2), dtype=np.int32) for n in (3, 5, 4)]
    plan = plan_of((np.zeros(1, dtype=np.int64), 4, 1, blocks[0], True),
                   (np.arange(300, 309), 0, 2, blocks[1], True),
                   (np.zeros(1, dtype=np.int64), 6, -1, blocks[2], True))
    plan.device_tokens, plan.device_rows = torch.tensor([41, 42]), np.array([0, 2])
    key, sampled = graphs.fill(plan)
    assert key == (16, "lora+rows", 16) and sampled == 3
    assert graphs.packed64[0, :11].tolist() == [41, *range(300, 309), 42] and not graphs.packed64[0, 11:16].any()


def test_a_mixed_steps_decode_rows_go_to_mbgmv_and_its_prompt_rows_to_mbgmm():
    graphs, _ = make()
    blocks = np.ones((9, LAYERS, 2), dtype=np.int32)
    # decodes of slots 1 and 2 around a 6-token prompt of slot 1, a base decode, a 1-token last prompt chunk of slot 3
    key, _ = graphs.fill(plan_of((np.array([5]), 4, 1, blocks, True), (np.arange(6), 0, 1, blocks, True),
                                 (np.array([6]), 7, 2, blocks, True), (np.array([7]), 2, -1, blocks, True),
                                 (np.array([8]), 3, 3, blocks, True)))
    bucket = graphs.buckets[16]
    assert key == (16, "lora+rows", 16) and bucket.seqs == 8
    assert bucket.one_row_slot.tolist() == [1, -1, -1, -1, -1, -1, -1, 2], "rows 0 and 7 of the first 8; row 9 is past them"
    assert bucket.seg_meta[:, :3].tolist() == [[1, 3, 0], [0, 6, 0], [6, 1, 0]], "slot 1's prompt rows, then row 9"
    assert bucket.seg_rows[:7].tolist() == [1, 2, 3, 4, 5, 6, 9]
    assert bucket.row_slot[:10].tolist() == [1, 1, 1, 1, 1, 1, 1, 2, -1, 3], "every row's slot, for the reference ops"
    key, _ = graphs.fill(plan_of((np.array([5]), 4, 1, blocks, True), (np.arange(6), 0, -1, blocks, True)))
    assert key == (16, "lora+rows", 16) and not bucket.seg_meta[2].any(), "decode rows alone take MBGMV's graph"
    assert bucket.one_row_slot.tolist() == [1] + [-1] * 7


def test_a_step_takes_the_lowest_rank_tier_that_holds_its_adapters():
    """Graphs per rank tier (16, 64 and the maximum, 256 here) for steps with adapter rows: a step replays the lowest
    that holds the ranks of its rows' adapters, decode rows' (MBGMV) and prompt rows' (MBGMM) alike."""
    graphs, _ = make(max_rank=256)
    assert graphs.rank_tiers == [16, 64, 256]
    assert [key for key in graphs.plan() if key[0] == 16] == [(16, "none", 0), (16, "lora", 16), (16, "lora", 64),
                                                              (16, "lora", 256), (16, "lora+rows", 16),
                                                              (16, "lora+rows", 64), (16, "lora+rows", 256)]
    ranks = {1: 8, 2: 64, 3: 100}
    for slot, rank in ranks.items():
        graphs.table.rank_host[slot, 1, 2] = rank  # the adapter's largest (layer, projection)
    blocks = np.ones((9, LAYERS, 2), dtype=np.int32)
    for slots, kind, tier in [((1,), "lora", 16), ((1, 2), "lora", 64), ((2, 3), "lora", 256), ((-1, 1), "lora", 16)]:
        key, _ = graphs.fill(plan_of(*[(np.arange(5), 0, slot, blocks, True) for slot in slots]))
        assert key == (16, kind, tier), slots
    key, _ = graphs.fill(plan_of((np.array([5]), 4, 3, blocks, True), (np.arange(6), 0, 1, blocks, True)))
    assert key == (16, "lora+rows", 256), "the decode row's adapter, rank 100, sets the tier"


def test_a_base_only_step_takes_the_graph_without_lora_and_long_prompts_take_several_tiles():
    graphs, _ = make(max_tokens=200, max_model_len=160)
    assert graphs.tokens_buckets == [16, 32, 64, 128, 200]
    blocks = np.ones((75, LAYERS, 2), dtype=np.int32)
    key, sampled = graphs.fill(plan_of((np.arange(150), 0, -1, blocks, True)))
    bucket = graphs.buckets[200]
    assert key == (200, "none", 0) and sampled == 1
    assert bucket.tile_row[:3].tolist() == [0, 64, 128] and bucket.tile_seq[:3].tolist() == [0, 0, 0]
    assert bucket.tile_seq[3] == bucket.seqs
    blocks2 = np.ones((40, LAYERS, 2), dtype=np.int32)
    graphs.fill(plan_of((np.arange(70), 0, 1, blocks2, True), (np.arange(5), 0, 3, blocks2, True),
                        (np.arange(66), 0, 1, blocks2, True)))
    bucket = graphs.buckets[200]
    assert bucket.seg_meta[:, :3].tolist() == [[1, 3, 0], [0, 136, 0], [136, 5, 0]]
    assert bucket.seg_tile[:, :4].tolist() == [[0, 0, 0, 1], [0, 64, 128, 0]], "136 rows of slot 1 in 3 tiles, then slot 3"
    assert (bucket.seg_tile[0, 4:] == bucket.seqs).all()
    assert graphs.fits(200, 8, 80) and not graphs.fits(201, 1, 1) and not graphs.fits(10, 9, 1) and not graphs.fits(10, 1, 81)


# ---------------------------------------------------------------------------------------------------
# The padded static steps through the kernels, inside the engine


class EagerReplay:
    """Stands in for a captured graph: runs the bucket's static step through `model` (Triton ops)."""

    def __init__(self, model, graphs: PrefillGraphs, key, logits: torch.Tensor, keys: list):
        self.model, self.graphs, self.key, self.logits, self.keys = model, graphs, key, logits, keys

    def replay(self):
        step = self.graphs.static_step(*self.key)
        self.logits.copy_(self.model.forward(step, self.graphs.kv.view, self.graphs.table))
        self.keys.append(self.key)


def make_engine(demo_assets, **config) -> Engine:
    adapters = tuple((name, str(path)) for name, path in demo_assets.adapters.items())
    return Engine(EngineConfig(model=str(demo_assets.model_dir), adapters=adapters, device="cpu", pool_bytes=32768 * PAGE_BYTES,
                               max_model_len=64, max_batch_tokens=64, max_lora_rank=64, **config))


def batch(names, count=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        length = int(torch.randint(3, 21, (1,), generator=generator))
        prompt = torch.randint(3, 500, (length,), generator=generator).tolist()
        adapter = names[index % len(names)]
        out.append(GenerationRequest(prompt, adapter, SamplingParams(max_tokens=4, temperature=0), keep_logits=True))
    return out


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="Triton's interpreter on the CPU (a GPU runs the compiled graphs: -m gpu)")
@pytest.mark.parametrize("fuse_groups", [False, True], ids=["per-projection", "groups"])
def test_the_padded_static_steps_give_the_reference_engines_tokens(demo_assets, fuse_groups):
    """The prefill graphs' padded inputs and tile lists, replayed eagerly through the Triton ops (with fuse_groups: the
    prompt rows' q|k|v and gate|up LoRA shrinks in one MBGMM launch each), against the reference engine."""
    from lorad.gpu_ops import bgmv, fused, gemv, mbgmm, mbgmv, paged_attention

    interpreted(mbgmm._mbgmm_shrink_kernel, bgmv, mbgmv, mbgmm, paged_attention, fused, gemv)
    names = [name for name in demo_assets.adapters if name in ("demo-r1", "demo-r8", "demo-r16")] + [None]
    reference = make_engine(demo_assets)
    expected = reference.generate(batch(names)) + reference.generate(batch([None], count=2, seed=1))
    reference.close()

    engine = make_engine(demo_assets)
    graphs = PrefillGraphs(engine.runner.model, engine.kv, engine.table, 64, engine.config.max_running_requests, engine.max_model_len, 64)
    kernels = copy.copy(engine.runner.model)
    kernels.ops = TritonOps(engine.device, 64, 64, fuse_groups=fuse_groups)
    groups = []
    original = mbgmm.mbgmm_group
    mbgmm.mbgmm_group = lambda *args, **kwargs: (groups.append(args[3]), original(*args, **kwargs))
    replayed = []
    graphs.logits.buffer = torch.empty(graphs.max_seqs, engine.vocab_size)  # every graph's logits in one buffer, as captured
    for key in graphs.plan():
        logits = graphs.logits.buffer[: graphs.buckets[key[0]].seqs]
        graphs.graphs[key] = (EagerReplay(kernels, graphs, key, logits, replayed), logits)
    engine.runner.prefill_graphs = graphs
    try:
        results = engine.generate(batch(names)) + engine.generate(batch([None], count=2, seed=1))
    finally:
        mbgmm.mbgmm_group = original
        engine.close()
    assert set(groups) == ({Q_PROJ, GATE_PROJ} if fuse_groups else set())

    assert engine.runner.prefill_graph_steps > 0 and {kind for _, kind, _ in replayed} == {"none", "lora", "lora+rows"}
    assert {tier for _, kind, tier in replayed if kind != "none"} == {16}  # the demo's ranks: 1 to 16
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not HAS_TRITON or CUDA, reason="Triton's interpreter on the CPU (a GPU runs the compiled kernels: -m gpu)")
def test_the_engine_on_the_triton_ops_gives_the_reference_tokens(demo_assets):
    """Every step eager through the Triton ops (decode steps: MBGMV, gate|up as one group launch; q|k|v
    per projection, their tiles differ at the demo's GQA widths), against the reference engine."""
    from lorad.gpu_ops import bgmv, fused, gemv, mbgmm, mbgmv, paged_attention

    interpreted(mbgmv._mbgmv_shrink_kernel, bgmv, mbgmv, mbgmm, paged_attention, fused, gemv)
    names = [name for name in demo_assets.adapters if name in ("demo-r4", "demo-r16")] + [None]
    reference = make_engine(demo_assets)
    expected = reference.generate(batch(names, count=3, seed=2))  # one row per adapter: MBGMV decode steps
    reference.close()

    engine = make_engine(demo_assets)
    engine.runner.ops = engine.runner.model.ops = TritonOps(engine.device, 64, 64, fuse_groups=True)
    groups = []
    original = mbgmv.mbgmv_group
    mbgmv.mbgmv_group = lambda *args, **kwargs: (groups.append(args[3]), original(*args, **kwargs))
    try:
        results = engine.generate(batch(names, count=3, seed=2))
    finally:
        mbgmv.mbgmv_group = original
        engine.close()
    assert groups and set(groups) == {GATE_PROJ}, "decode steps launch gate|up as one group"
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)


INTERPRETER_ONLY = pytest.mark.skipif(not HAS_TRITON or CUDA,
                                      reason="Triton's interpreter on the CPU (a GPU runs the compiled kernels: -m gpu)")


def assert_triton_ops_give_the_reference_tokens(make_engine, requests, max_batch_tokens: int) -> None:
    """The same requests on an engine of `make_engine()` with the reference ops, then with the Triton ops (run by
    the interpreter): equal tokens, logits within 1e-4."""
    from lorad.gpu_ops import bgmv, fused, gemv, mbgmm, mbgmv, paged_attention

    interpreted(mbgmv._mbgmv_shrink_kernel, bgmv, mbgmv, mbgmm, paged_attention, fused, gemv)
    reference = make_engine()
    expected = reference.generate(requests())
    reference.close()
    engine = make_engine()
    engine.runner.ops = engine.runner.model.ops = TritonOps(engine.device, max_batch_tokens, 64)
    results = engine.generate(requests())
    engine.close()
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)


@INTERPRETER_ONLY
def test_qwen3_on_the_triton_ops_gives_the_reference_tokens():
    """Qwen3's per-head q and k norms through the fused RMSNorm kernel (on the heads of a slice of the fused
    q|k|v output), with LoRA rows, against the reference ops."""

    def qwen3() -> Engine:
        return Engine(EngineConfig(model_config="tiny-qwen3", dummy_weights=True, dummy_adapters=2, dummy_adapter_rank=4,
                                   dummy_adapter_targets="q_proj,k_proj,v_proj,o_proj", device="cpu", max_model_len=64))

    def requests():
        return [GenerationRequest([3, 4, 5, 6, 7], adapter, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                  keep_logits=True) for adapter in ("dummy-0", "dummy-1", None)]

    assert_triton_ops_give_the_reference_tokens(qwen3, requests, 64)


@INTERPRETER_ONLY
def test_phi3_on_the_triton_ops_gives_the_reference_tokens(hf_checkpoint):
    """Phi-3 with longrope and partial rotary (the RoPE kernel on 12 of 16 dimensions, the long factors' rows for a
    prompt past the original 16 tokens and for a sequence whose cache is computed again once it crosses them), and
    adapters on the fused qkv_proj and gate_up_proj (one A in the pool for q, k and v; MBGMV and MBGMM read it for
    each), against the reference ops."""
    checkpoint = hf_checkpoint("phi3_longrope")

    def phi3() -> Engine:
        adapters = tuple((name, str(checkpoint.adapters[name])) for name in ("all-r8", "qkv-r1", "pattern-r16"))
        return Engine(EngineConfig(model=str(checkpoint.model_dir), adapters=adapters, device="cpu", dtype="float32",
                                   max_model_len=64, max_batch_tokens=64, max_lora_rank=64))

    def requests():
        greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        prompts = [list(range(3, 23)), [5, 6, 7, 8], list(range(30, 45)), [9, 10, 11]]  # 20 > 16; 15 + 3 crosses
        return [GenerationRequest(prompt, adapter, greedy, keep_logits=True)
                for prompt, adapter in zip(prompts, ("all-r8", "qkv-r1", "pattern-r16", None))]

    assert_triton_ops_give_the_reference_tokens(phi3, requests, 64)


@INTERPRETER_ONLY
@pytest.mark.parametrize("shape", ["tiny-gemma2", "tiny-gemma3"])
def test_gemma_on_the_triton_ops_gives_the_reference_tokens(shape):
    """Gemma through the Triton ops: sliding-window layers (prompts past the window of 16, chunked prefill
    over a cached prefix, decodes), Gemma 2's capped scores, the tanh GeGLU kernel, Gemma 3's local RoPE table
    and (1 + w) q/k norms, with LoRA rows, against the reference ops."""

    def gemma() -> Engine:
        return Engine(EngineConfig(model_config=shape, dummy_weights=True, dummy_adapters=2, dummy_adapter_rank=4,
                                   device="cpu", max_model_len=64, max_batch_tokens=32))

    def requests():
        prompts = [list(range(3, 43)), [5, 6, 7], list(range(100, 120))]
        return [GenerationRequest(prompt, adapter, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                  keep_logits=True) for prompt, adapter in zip(prompts, ("dummy-0", "dummy-1", None))]

    assert_triton_ops_give_the_reference_tokens(gemma, requests, 32)


@pytest.mark.parametrize("path", ["prefill_graph", "eager"])
def test_streamed_pages_are_queued_before_the_forward_that_waits_for_them(path):
    """The LoRA kernels of a step whose adapters stream in spin on the device until each layer's pages are in: the
    copies must be queued before the forward is launched, or a hardware queue shared by the two streams holds them
    behind the spinning kernel (DESIGN.md, "Streamed placement")."""
    from lorad.daemon.engine.runner import ModelRunner

    calls = []
    runner = SimpleNamespace(
        residency=SimpleNamespace(issue_streams=lambda: calls.append("queue the pages")),
        prefill_graphs=SimpleNamespace(run=lambda plan: calls.append("launch") or "logits", last_key=(64, "lora", 16)),
        model=SimpleNamespace(forward=lambda step, kv, table: calls.append("launch") or "logits"),
        build_step=lambda plan: None, kv=SimpleNamespace(view=None), table=None, prefill_graph_steps=0)
    assert ModelRunner.forward(runner, plan=None, path=path) == "logits"
    assert calls == ["queue the pages", "launch"]
