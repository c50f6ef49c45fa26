"""bench/step_padding.py: its replay of the engine's scheduler against steps worked out by hand, the padding of a
step list against a hand count, and the engine's token buckets on a saturated queue of conversation-like prompts:
every mixed step of up to 1536 rows pads fewer than 128 rows, fewer than with every 256 tokens."""

from __future__ import annotations

import numpy as np

from lorad.daemon.engine.prefill_graphs import TOKEN_BUCKETS, bucket_rows

import bench_scripts


def test_replay_plans_the_steps_the_scheduler_does():
    bench = bench_scripts.load("step_padding")
    # two running at most, 16 tokens a step; prompts of 10, two tokens out each (the first from the prompt's step)
    steps = bench.replay([(10, 2)] * 3, max_running=2, max_batch_tokens=16)
    assert steps == [
        ("prefill", 16),  # the first prompt whole, 6 of the second
        ("mixed", 5),  # the first's decode row beside the second's last 4 (the first ends)
        ("mixed", 11),  # the second's decode row beside the third prompt whole (the second ends)
        ("decode", 1),
    ]
    # cut to a bucket: the third prompt's chunk is cut back to 256 - 1 rows (only past 256 rows: none here)
    assert bench.replay([(10, 2)] * 3, 2, 16, trim_to=(4, 8, 16)) == steps
    cut = bench.replay([(300, 2), (400, 2)], max_running=2, max_batch_tokens=512, trim_to=(256, 384, 512))
    assert cut[:3] == [("prefill", 512), ("mixed", 189), ("decode", 1)]
    assert bench.replay([(100, 3), (400, 2)], 1, 512)[:2] == [("prefill", 100), ("decode", 1)]
    assert bench.replay([(100, 2), (500, 2)], 2, 512, trim_to=(256, 384, 512))[:3] == [
        ("prefill", 512), ("mixed", 89), ("decode", 1)]


def test_steps_ending_on_a_prompt_chunk_are_counted():
    bench = bench_scripts.load("step_padding")
    # the steps above: the first takes 6 of the second prompt's 10 (a chunk), the next two end every prompt in them
    assert bench.chunked_steps([(10, 2)] * 3, max_running=2, max_batch_tokens=16) == {
        "steps_with_prompt_rows": 3, "ending_on_a_chunk": 1}
    assert bench.chunked_steps([(10, 2)] * 3, max_running=2, max_batch_tokens=32)["ending_on_a_chunk"] == 0


def test_padding_counts_the_rows_past_each_step_up_to_its_bucket():
    bench = bench_scripts.load("step_padding")
    steps = [("mixed", 100), ("mixed", 300), ("prefill", 64), ("prefill", 500), ("decode", 2)]
    report = bench.padding(steps, (16, 32, 64, 128, 256, 384, 1024), max_batch_tokens=512)  # 1024: past the budget
    assert report["mixed"] == {"steps": 2, "rows": 400, "graph_rows": 512, "padding_rows": 112,
                               "padding_rows_per_step": 56.0, "padding_share": round(112 / 512, 4),
                               "steps_by_bucket": {128: 1, 384: 1}}
    assert (report["prefill"]["graph_rows"], report["prefill"]["padding_rows"]) == (64 + 512, 12)
    assert report["decode"] == {"steps": 1}


def test_bucket_rows_is_the_smallest_bucket_that_holds_the_step():
    assert [bucket_rows(rows, TOKEN_BUCKETS) for rows in (1, 16, 17, 1087, 1536, 1537, 2048)] == [
        16, 16, 32, 1152, 1536, 1792, 2048]


def test_a_saturated_queues_mixed_steps_pad_fewer_than_128_rows_below_1536():
    bench = bench_scripts.load("step_padding")
    rng = np.random.default_rng(0)
    lengths = list(zip(rng.integers(200, 1450, 300).tolist(), rng.integers(20, 300, 300).tolist()))
    steps = bench.replay(lengths, max_running=64, max_batch_tokens=2048)
    mixed = [rows for kind, rows in steps if kind == "mixed"]
    assert len(mixed) > 100
    pads = [bucket_rows(rows, TOKEN_BUCKETS) - rows for rows in mixed if rows <= 1536]
    assert len(pads) > 0.6 * len(mixed) and max(pads) < 128
    engine = bench.padding(steps, TOKEN_BUCKETS, 2048)["mixed"]
    every_256 = bench.padding(steps, bench.EVERY_256, 2048)["mixed"]
    assert engine["padding_rows_per_step"] < 64 < every_256["padding_rows_per_step"]
