"""DecodeGraphs' host side on the CPU: what a replay reads from its static buffers after `run()` fills
them (the capture and the replay itself need a GPU: tests/daemon/engine/test_engine_gpu.py)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lorad.daemon.engine.decode_graphs import LOW_RANK, BlockStaging, DecodeGraphs
from lorad.daemon.engine.step_plan import StepPlan
from lorad.gpu_ops.page_pool import SCRATCH_PAGE, AdapterTable, BlockList, KVCache, PagePool

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 4


class Replay:
    """Stands in for a captured graph: records what the buffers held at replay time."""

    def __init__(self, graphs: DecodeGraphs, key):
        self.graphs, self.key, self.seen = graphs, key, None

    def replay(self):
        g = self.graphs
        self.seen = {name: getattr(g, name).clone() for name in
                     ("input_ids", "positions", "dest_offsets", "row_slot", "seq_info", "dest_pages", "block_table")}


def make(max_batch=8, max_rank=64):
    pool = PagePool(4096, KV_HEADS * HEAD_DIM * 2, torch.float32, torch.device("cpu"))  # 2 tokens a page
    kv = KVCache(pool, LAYERS, KV_HEADS, HEAD_DIM)
    table = AdapterTable(pool, 4, LAYERS, [(8, 8)] * 7)
    graphs = DecodeGraphs(None, kv, table, max_batch, max_model_len=64, max_lora_rank=max_rank)
    for key in graphs.plan():
        graphs.graphs[key] = (Replay(graphs, key), torch.zeros(key[0], 5))
    return graphs, kv, table


def decode_plan(tokens, positions, slots, blocks) -> StepPlan:
    """A decode step: one new token per sequence, sampled."""
    return StepPlan([np.array([token]) for token in tokens], np.asarray(positions), np.asarray(slots), list(blocks),
                    np.ones(len(tokens), dtype=bool))


def test_run_fills_every_buffer_a_replay_reads():
    graphs, kv, table = make()
    rng = np.random.default_rng(0)
    lengths = [5, 1, 9]  # blocks per sequence
    blocks = [rng.integers(1, 4096, size=(n, LAYERS, 2), dtype=np.int32) for n in lengths]
    positions = np.array([2 * n - 1 for n in lengths])  # the last position of each sequence's last block
    tokens, slots = np.array([7, 8, 9]), np.array([-1, -1, -1])
    graphs.run(decode_plan(tokens, positions, slots, blocks))
    size = 4  # the bucket holding 3 rows
    replay = graphs.graphs[(size, "none", 0, "all")][0]
    seen = replay.seen
    assert seen is not None, "the base-only graph replays when no row has an adapter"
    assert seen["input_ids"][:3].tolist() == [7, 8, 9] and seen["input_ids"][3] == 0
    assert seen["positions"][:3].tolist() == positions.tolist()
    assert seen["dest_offsets"][:3].tolist() == (positions % kv.tokens_per_page).tolist()
    assert seen["row_slot"][:size].tolist() == [-1] * size
    assert seen["seq_info"][:, :size].tolist() == [[0, 1, 2, 3], [1, 1, 1, 1], [*(positions + 1).tolist(), 1]]
    for row, rows in enumerate(blocks):
        table_rows = seen["block_table"][:, :, row, : len(rows)]  # [L, 2, blocks]
        assert torch.equal(table_rows, torch.from_numpy(rows).permute(1, 2, 0))
        assert torch.equal(seen["dest_pages"][:, :, row], torch.from_numpy(rows[-1]).long())
    assert (seen["dest_pages"][:, :, 3] == SCRATCH_PAGE).all(), "a padding row writes only the scratch page"


def test_a_smaller_batch_after_a_larger_one_pads_its_rows_again():
    graphs, _, table = make()
    table.rank_host[1, :, :] = 8
    table.rank_host[2, :, :] = 32
    blocks = [np.full((2, LAYERS, 2), 10 + i, dtype=np.int32) for i in range(4)]
    graphs.run(decode_plan(np.arange(4), np.full(4, 3), np.array([1, 2, 1, 2]), blocks))
    assert graphs.graphs[(4, "mbgmv", 64, "all")][0].seen is not None, "a rank-32 row needs the full-rank graph"
    graphs.run(decode_plan(np.arange(3), np.full(3, 3), np.array([1, -1, 1]), blocks[:3]))
    seen = graphs.graphs[(4, "mbgmv", LOW_RANK, "all")][0].seen
    assert seen is not None, "ranks <= 16 replay the low-rank MBGMV graph"
    assert seen["row_slot"][:4].tolist() == [1, -1, 1, -1]
    assert seen["seq_info"][2, 3] == 1 and seen["input_ids"][3] == 0 and seen["positions"][3] == 0
    assert (seen["dest_pages"][:, :, 3] == SCRATCH_PAGE).all()


def test_each_batch_replays_the_lowest_rank_tier_that_holds_its_ranks():
    graphs, _, table = make(max_rank=256)
    assert sorted(rank for size, kernel, rank, targets in graphs.plan()
                  if kernel == "mbgmv" and size == 4 and targets == "all") == [16, 64, 256]
    table.rank_host[0], table.rank_host[1], table.rank_host[2], table.rank_host[3] = 8, 32, 64, 128
    blocks = [np.full((2, LAYERS, 2), 10 + i, dtype=np.int32) for i in range(4)]
    for slots, tier in (([0, 0, -1], 16), ([0, 1, -1], 64), ([2, 0, 1], 64), ([0, 3, -1], 256)):
        graphs.run(decode_plan(np.arange(3), np.full(3, 3), np.array(slots), blocks[:3]))
        assert graphs.last_key == (4, "mbgmv", tier, "all"), slots


def test_no_low_rank_graph_when_the_maximum_is_low():
    graphs, _, _ = make(max_rank=16)
    assert all(rank == 16 for _, kernel, rank, _ in graphs.plan() if kernel == "mbgmv")
    assert len([key for key in graphs.plan() if key[1] == "mbgmv"]) == 2 * len(graphs.buckets)  # all; attention


def test_a_batch_whose_adapters_leave_the_mlp_alone_replays_a_graph_without_its_lora():
    """A batch replays the "attention" graph (no MLP LoRA launched) only while none of its adapters targets gate,
    up or down in any layer; one such adapter, or a BGMV or base-only step, takes the graph of every projection."""
    from lorad.daemon.engine.decode_graphs import TARGETS
    from lorad.daemon.model.llama import DOWN, GATE, O, Q, UP, V

    graphs, _, table = make()
    assert TARGETS["attention"] == {GATE, UP, DOWN}
    assert {key[3] for key in graphs.plan() if key[1] == "mbgmv"} == {"all", "attention"}
    table.rank_host[0, :, [Q, V]] = 8  # q, v: the PEFT default
    table.rank_host[1, :, [Q, O]] = 32
    table.rank_host[2, 1, DOWN] = 8  # down in one layer only
    blocks = [np.full((2, LAYERS, 2), 10 + i, dtype=np.int32) for i in range(4)]
    for slots, key in (([0, -1, 0], (4, "mbgmv", LOW_RANK, "attention")), ([0, 1, -1], (4, "mbgmv", 64, "attention")),
                       ([0, 2, -1], (4, "mbgmv", LOW_RANK, "all")), ([-1, -1, -1], (4, "none", 0, "all"))):
        graphs.run(decode_plan(np.arange(3), np.full(3, 3), np.array(slots), blocks[:3]))
        assert graphs.last_key == key, slots
    step = graphs._static_step(4, 64, "mbgmv", "attention")
    assert step.lora.untargeted == {GATE, UP, DOWN} and graphs._static_step(4, 64, "mbgmv").lora.untargeted == set()


def test_graphs_of_a_set_write_their_logits_into_one_buffer():
    from lorad.daemon.engine.decode_graphs import SharedLogits

    shared = SharedLogits(4)
    first = shared.take(torch.arange(12.0).view(4, 3))  # the largest graph's: it sizes the buffer
    second = shared.take(torch.full((2, 3), -1.0))
    assert first.data_ptr() == second.data_ptr() == shared.buffer.data_ptr() and second.shape == (2, 3)
    assert first[:2].eq(-1).all() and first[2:].equal(torch.arange(6.0, 12.0).view(2, 3))  # the next replay's rows
    with pytest.raises(ValueError, match="exceed the shared buffer's 4"):
        shared.take(torch.zeros(5, 3))


def test_block_tables_receive_only_the_blocks_they_lack():
    """BlockStaging over 300 random steps (lists growing, sequences joining, leaving, changing rows, emptied by a
    preemption and grown again, a plan without lists): after each send every row holds its sequence's blocks, and
    a step where the same sequences each add one block sends one entry each."""
    layers, width = 3, 40
    rng = np.random.default_rng(0)
    staging = BlockStaging(layers, torch.device("cpu"))
    table = torch.full((layers, 2, 8, width), SCRATCH_PAGE, dtype=torch.int32)
    lists = [BlockList() for _ in range(12)]
    for step in range(300):
        live = [blocks for blocks in lists if len(blocks) < width]
        chosen = [live[i] for i in rng.permutation(len(live))[: rng.integers(1, 9)]]
        for blocks in chosen:
            if rng.random() < 0.05:  # preempted: its pages went back; it starts over, past where it was
                before = len(blocks)
                blocks.clear()
                blocks.extend(rng.integers(1, 10_000, size=(min(before + 1, width - 3), layers, 2), dtype=np.int32))
            grow = min(int(rng.integers(0, 4)), width - len(blocks))
            blocks.extend(rng.integers(1, 10_000, size=(grow, layers, 2), dtype=np.int32))
            if not len(blocks):
                blocks.extend(rng.integers(1, 10_000, size=(1, layers, 2), dtype=np.int32))
        arrays = [blocks.array() for blocks in chosen]
        plan = SimpleNamespace(blocks=arrays, lists=chosen if step % 50 else [])
        staging.send(plan, table)
        for row, rows in enumerate(arrays):
            assert torch.equal(table[:, :, row, : len(rows)], torch.from_numpy(rows).permute(1, 2, 0)), (step, row)
    assert staging.rows_moved > 0
    steady = [BlockList() for _ in range(4)]
    for blocks in steady:
        blocks.extend(rng.integers(1, 10_000, size=(1, layers, 2), dtype=np.int32))
    staging.send(SimpleNamespace(blocks=[b.array() for b in steady], lists=steady), table)
    before = staging.entries_sent
    for blocks in steady:
        blocks.extend(rng.integers(1, 10_000, size=(1, layers, 2), dtype=np.int32))
    staging.send(SimpleNamespace(blocks=[b.array() for b in steady], lists=steady), table)
    assert staging.entries_sent - before == len(steady)
    for row, blocks in enumerate(steady):
        assert torch.equal(table[:, :, row, : len(blocks)], torch.from_numpy(blocks.array()).permute(1, 2, 0))
