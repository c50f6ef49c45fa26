"""Profiling-guided split of a prompt's tokens across CPU LoRA workers."""

from __future__ import annotations

import os

import pytest
import torch

from lorad.cpu_lora.partition import CostModel, Plan, fit_cost, plan, profile_cpu_lora, split, workers_for


def assert_covers(ranges, tokens):
    assert ranges[0][0] == 0 and ranges[-1][1] == tokens
    assert all(end == next_start for (_, end), (next_start, _) in zip(ranges, ranges[1:]))
    sizes = [end - start for start, end in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_fit_recovers_an_exact_line():
    cost = fit_cost([(tokens, 0.3 + 0.01 * tokens) for tokens in (1, 16, 64, 256)], dispatch_ms=0.05)
    assert cost.overhead_ms == pytest.approx(0.3) and cost.per_token_ms == pytest.approx(0.01)
    assert cost.tokens_per_ms == pytest.approx(100)
    assert cost.makespan_ms(100, 2) == pytest.approx(2 * 0.05 + 0.3 + 0.01 * 50)
    with pytest.raises(ValueError):
        fit_cost([(8, 1.0), (8, 1.1)])


def test_a_noisy_fit_stays_usable():
    cost = fit_cost([(1, 0.5), (2, 0.1), (3, 0.05)])  # falling times: noise, not physics
    assert cost.per_token_ms > 0 and cost.overhead_ms >= 0


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 100, 1001])
@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_ranges_are_contiguous_balanced_and_complete(tokens, workers):
    cost = CostModel(overhead_ms=0.0, per_token_ms=1.0, dispatch_ms=0.0)  # free dispatch: use all
    ranges = split(tokens, workers, cost)
    assert len(ranges) == min(tokens, workers)
    assert_covers(ranges, tokens)


def test_more_workers_only_when_it_pays():
    cost = CostModel(overhead_ms=0.2, per_token_ms=0.01, dispatch_ms=0.1)
    assert split(4, 2, cost) == [(0, 4)]  # 0.34 ms alone, 0.42 ms split: one worker
    assert split(200, 2, cost) == [(0, 100), (100, 200)]  # 2.3 ms alone, 1.4 ms split
    # Where the saving is under min_gain, the second core stays free.
    assert workers_for(60, 2, cost, min_gain=0.1) == 2  # 0.9 vs 0.7 ms: 22% better
    assert workers_for(30, 2, cost, min_gain=0.1) == 1  # 0.6 vs 0.55 ms: 8% better
    assert workers_for(60, 2, cost, min_gain=0.25) == 1
    assert workers_for(60, 2, cost, min_gain=0.2) == 2
    # Many workers: the count grows with the prompt, and stops where dispatch outweighs the tokens.
    counts = [workers_for(tokens, 16, cost) for tokens in (10, 100, 1000, 10_000)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] <= 16
    assert cost.makespan_ms(10_000, counts[-1]) <= min(cost.makespan_ms(10_000, k) for k in range(1, 17)) * 1.1 + 1e-9


def test_target_uses_the_fewest_workers_that_meet_it():
    cost = CostModel(overhead_ms=0.0, per_token_ms=0.01, dispatch_ms=0.0)  # 100 tokens per ms per core
    assert workers_for(250, 8, cost, target_ms=1.0) == 3  # the paper's ceil(L / c)
    assert workers_for(100, 8, cost, target_ms=1.0) == 1
    assert workers_for(10_000, 8, cost, target_ms=1.0) == 8  # unreachable: everything
    assert_covers(split(250, 8, cost, target_ms=1.0), 250)


def test_no_tokens_no_ranges_and_no_workers_refused():
    cost = CostModel(overhead_ms=0.1, per_token_ms=0.01)
    assert split(0, 2, cost) == []
    with pytest.raises(ValueError):
        split(10, 0, cost)


def test_scaling_follows_the_flops():
    cost = CostModel(0.1, 0.01, rank=16, in_features=1024, out_features=1024)
    wider = cost.scaled_to(64, 1024, 3072)
    assert wider.per_token_ms == pytest.approx(0.01 * 4 * 2)
    assert wider.overhead_ms == cost.overhead_ms
    with pytest.raises(ValueError):
        CostModel(0.1, 0.01).scaled_to(8, 64, 64)


def test_profile_measures_one_core_and_restores_the_caller():
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    core = sorted(affinity)[-1]
    cost = profile_cpu_lora(rank=16, in_features=512, out_features=512, token_counts=(1, 32, 256), repeats=3, core=core)
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == affinity
    assert [tokens for tokens, _ in cost.samples] == [1, 32, 256]
    assert all(ms > 0 for _, ms in cost.samples)
    assert cost.per_token_ms > 0 and cost.overhead_ms >= 0
    assert (cost.rank, cost.in_features, cost.out_features) == (16, 512, 512)
    # A long prompt is worth both cores; a one-token prompt is not worth the second dispatch.
    big = cost.scaled_to(64, 4096, 4096)
    assert len(split(2048, 2, big)) == 2
    assert len(split(1, 2, big)) == 1


def test_plan_takes_a_split_group_where_the_adapter_read_dominates():
    # overhead 1 ms (mostly reading A and B), 0.005 ms a token, 8 workers
    cost = CostModel(overhead_ms=1.0, per_token_ms=0.005, dispatch_ms=0.02, group_dispatch_ms=0.08)
    grouped = plan(128, 8, cost, rank=64, max_rank=64)
    assert grouped.parts == 8 and grouped.ranges == [(0, 128)]
    # predicted: tokens 8 * 0.02 + 1 + 0.005 * 16 = 1.24 ms; group 0.08 + (1 + 0.64) / 8 = 0.285 ms
    assert cost.group_makespan_ms(128, 8) == pytest.approx(0.285)
    # no group without a measured round trip, a partial buffer wide enough, or a second worker
    unmeasured = CostModel(overhead_ms=1.0, per_token_ms=0.005, dispatch_ms=0.02)
    assert plan(128, 8, unmeasured, rank=64, max_rank=64).parts == 1
    assert plan(128, 8, cost, rank=128, max_rank=64).parts == 1
    assert plan(128, 8, cost, rank=64, max_rank=0).parts == 1
    assert plan(128, 1, cost, rank=64, max_rank=64) == Plan([(0, 128)])
    with pytest.raises(ValueError):
        unmeasured.group_makespan_ms(128, 8)


def test_plan_keeps_the_token_split_where_the_group_costs_more():
    # a cheap adapter read and a slow barrier: the token split wins
    cost = CostModel(overhead_ms=0.01, per_token_ms=0.01, dispatch_ms=0.01, group_dispatch_ms=5.0)
    chosen = plan(100, 4, cost, rank=8, max_rank=64)
    assert chosen.parts == 1 and chosen.ranges == split(100, 4, cost)
    assert plan(0, 4, cost, rank=8, max_rank=64) == Plan([])


def test_with_dispatch_and_scaling_keep_the_group_round_trip():
    cost = CostModel(0.1, 0.01, rank=16, in_features=1024, out_features=1024).with_dispatch(0.03, 0.2)
    assert (cost.dispatch_ms, cost.group_dispatch_ms) == (0.03, 0.2)
    assert cost.scaled_to(32, 1024, 1024).group_dispatch_ms == 0.2


def test_plan_obeys_a_forced_choice_where_a_group_is_possible():
    cost = CostModel(overhead_ms=0.01, per_token_ms=0.01, dispatch_ms=0.01)  # no group round trip measured
    assert plan(100, 4, cost, rank=8, max_rank=64, choice="groups") == Plan([(0, 100)], 4)
    assert plan(100, 4, cost, rank=128, max_rank=64, choice="groups").parts == 1  # not possible: tokens
    measured = cost.with_dispatch(0.01, 0.0)
    assert plan(100, 4, measured, rank=8, max_rank=64, choice="tokens").parts == 1
    with pytest.raises(ValueError):
        plan(100, 4, cost, choice="columns")
