"""How many CPU LoRA workers a prompt gets, and which tokens each: CaraServe's profiling-guided
parallelisation.

A worker's time for a job is about `overhead_ms + per_token_ms * tokens` on one core (the overhead:
waking on the flag, looking the adapter up, BLAS set-up), and the engine spends `dispatch_ms` per job
it posts and waits for. Splitting T tokens over k workers costs about
`k * dispatch_ms + overhead_ms + per_token_ms * ceil(T / k)`: more workers pay only when the tokens
saved outweigh the dispatch added. `profile_cpu_lora()` measures the line at start-up; `split()`
picks k and cuts [0, T) into k contiguous, balanced ranges (one per worker: `WorkerPool.run`).

The overhead is mostly the read of the adapter's A and B, which a token split makes every worker
pay. A split group (cpu_lora/worker.py) has k workers share the columns instead, so the adapter is
read once in all: about `group_dispatch_ms + (overhead_ms + per_token_ms * T) / k`, where
`group_dispatch_ms` (the group's round trip and its barrier, measured through the pool by
`profile_group_dispatch()`) replaces the per-job dispatch. `plan()` takes whichever is predicted
faster.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CostModel:
    """One core's time for `x[tokens, in] @ A^T @ B^T` at the profiled rank and shape."""

    overhead_ms: float  # per job on a worker
    per_token_ms: float
    dispatch_ms: float = 0.02  # per job on the engine's side, serial (post + wait)
    rank: int = 0  # what was profiled
    in_features: int = 0
    out_features: int = 0
    samples: tuple[tuple[int, float], ...] = field(default=(), compare=False)  # (tokens, median ms)
    group_dispatch_ms: float | None = None  # a split group's round trip over all workers (None: not measured)

    @property
    def tokens_per_ms(self) -> float:
        """Throughput of one core, the paper's per-core capacity."""
        return 1.0 / self.per_token_ms

    @property
    def min_chunk_tokens(self) -> int:
        """The smallest profitable range: below it a job's fixed costs (the worker's overhead and the
        engine's dispatch) outweigh its tokens' compute, so splitting finer only adds fixed costs."""
        return max(1, math.ceil((self.overhead_ms + self.dispatch_ms) / self.per_token_ms - 1e-9))

    def job_ms(self, tokens: int) -> float:
        return self.overhead_ms + self.per_token_ms * tokens

    def makespan_ms(self, tokens: int, workers: int) -> float:
        """Predicted time from posting to the last done flag with `tokens` over `workers` workers."""
        return workers * self.dispatch_ms + self.job_ms(math.ceil(tokens / workers))

    def scaled_to(self, rank: int, in_features: int, out_features: int) -> CostModel:
        """The same core at another shape, assuming the per-token cost follows the flops,
        rank * (in + out). A first approximation (small ranks use BLAS less well): profile each rank
        bucket that matters rather than stretching one profile far."""
        if not self.rank:
            raise ValueError("this cost model carries no profiled shape to scale from")
        factor = rank * (in_features + out_features) / (self.rank * (self.in_features + self.out_features))
        return dataclasses.replace(self, per_token_ms=self.per_token_ms * factor, rank=rank, in_features=in_features,
                                   out_features=out_features, samples=())

    def with_dispatch(self, dispatch_ms: float, group_dispatch_ms: float | None = None) -> CostModel:
        return dataclasses.replace(self, dispatch_ms=dispatch_ms, group_dispatch_ms=group_dispatch_ms)

    def group_makespan_ms(self, tokens: int, parts: int) -> float:
        """Predicted time of `tokens` as one split group over `parts` workers (needs group_dispatch_ms)."""
        if self.group_dispatch_ms is None:
            raise ValueError("no split group round trip measured (group_dispatch_ms)")
        return self.group_dispatch_ms + self.job_ms(tokens) / parts


def fit_cost(samples: list[tuple[int, float]], dispatch_ms: float = 0.02, **shape) -> CostModel:
    """Least-squares line through (tokens, ms); the overhead is clamped at >= 0 and the slope kept
    positive, so that a noisy profile still splits sensibly."""
    if len({tokens for tokens, _ in samples}) < 2:
        raise ValueError("a cost line needs samples at two token counts at least")
    mean_tokens = statistics.fmean(tokens for tokens, _ in samples)
    mean_ms = statistics.fmean(ms for _, ms in samples)
    covariance = sum((tokens - mean_tokens) * (ms - mean_ms) for tokens, ms in samples)
    variance = sum((tokens - mean_tokens) ** 2 for tokens, _ in samples)
    per_token = max(covariance / variance, 1e-9)
    overhead = max(mean_ms - per_token * mean_tokens, 0.0)
    return CostModel(overhead, per_token, dispatch_ms, samples=tuple(samples), **shape)


def profile_cpu_lora(
    rank: int,
    in_features: int,
    out_features: int,
    token_counts: tuple[int, ...] = (1, 16, 64, 256),
    repeats: int = 7,
    core: int | None = None,
    dispatch_ms: float = 0.02,
) -> CostModel:
    """Time `(x @ A^T) @ B^T` in float32 on one thread (pinned to `core` if given) for each token
    count; the median of `repeats` runs after a warm-up, on random inputs rotated so that no run
    reuses the last one's cache. Restores the caller's thread count and affinity."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rank, in_features, generator=generator)
    b_t = torch.randn(rank, out_features, generator=generator)
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        samples = []
        for tokens in token_counts:
            inputs = [torch.randn(tokens, in_features, generator=generator) for _ in range(4)]
            middle = torch.empty(tokens, rank)
            out = torch.empty(tokens, out_features)
            for x in inputs:  # warm-up
                torch.mm(torch.mm(x, a.t(), out=middle), b_t, out=out)
            times = []
            for run in range(repeats):
                x = inputs[run % len(inputs)]
                start = time.perf_counter()
                torch.mm(torch.mm(x, a.t(), out=middle), b_t, out=out)
                times.append((time.perf_counter() - start) * 1e3)
            samples.append((tokens, statistics.median(times)))
    finally:
        torch.set_num_threads(threads)
        if core is not None:
            os.sched_setaffinity(0, affinity)
    return fit_cost(samples, dispatch_ms, rank=rank, in_features=in_features, out_features=out_features)


def profile_dispatch(pool, adapter_id: int, layer: int, proj: int, in_features: int, out_features: int,
                     repeats: int = 50) -> float:
    """The engine-side cost of one job through `pool` (post, the hot worker's poll, done flag), in ms:
    the median round trip of a one-token job on worker 0. Use it as `CostModel.dispatch_ms`; it
    includes one token's compute, which is noise next to the wake-up at the ranks that matter."""
    times = []
    for _ in range(repeats):
        pool.poll_hot_for(0.05)  # as the engine runs it: the worker polls, the round trip pays no wake-up
        start = time.perf_counter()
        failed = pool.run(adapter_id, layer, proj, [(0, 1)], in_features, out_features)
        times.append((time.perf_counter() - start) * 1e3)
        if failed:
            raise RuntimeError(f"profiling job failed on adapter {adapter_id} ({layer}, {proj})")
    return statistics.median(times)


def profile_group_dispatch(pool, adapter_id: int, layer: int, proj: int, in_features: int, out_features: int,
                           repeats: int = 50) -> float:
    """The engine-side cost of one split group over all of `pool`'s workers, in ms: the median round
    trip of a one-token group (post, the parts' shrink, barrier and expand, the done flags). Use it
    as `CostModel.group_dispatch_ms`. Needs a pool of 2 workers or more with `max_rank`."""
    times = []
    for _ in range(repeats):
        pool.poll_hot_for(0.05)
        start = time.perf_counter()
        ok = pool.run_split(adapter_id, layer, proj, (0, 1), pool.workers, in_features, out_features)
        times.append((time.perf_counter() - start) * 1e3)
        if not ok:
            raise RuntimeError(f"profiling split group failed on adapter {adapter_id} ({layer}, {proj})")
    return statistics.median(times)


@dataclass(frozen=True)
class Plan:
    """How a prompt's rows go to the workers: `ranges`, one per worker (a token split), or, with
    parts > 1, one split group over workers 0..parts-1 on all the rows (`ranges` is then that one
    range)."""

    ranges: list[tuple[int, int]]
    parts: int = 1


def plan(tokens: int, workers: int, cost: CostModel, rank: int | None = None, max_rank: int = 0,
         min_gain: float = 0.1, target_ms: float | None = None, choice: str = "auto") -> Plan:
    """A token split (`split`), or a split group over all `workers` where one is possible (2
    workers or more, `rank` within the pool's `max_rank`) and chosen: by `choice` "groups", or under
    "auto" when a measured `group_dispatch_ms` predicts it faster than the token split by `min_gain`
    ("tokens": never)."""
    if choice not in ("auto", "tokens", "groups"):
        raise ValueError(f"choice must be auto, tokens or groups, not {choice!r}")
    ranges = split(tokens, workers, cost, min_gain, target_ms)
    possible = workers >= 2 and tokens > 0 and rank is not None and 0 < rank <= max_rank
    if possible and choice == "groups":
        return Plan([(0, tokens)], workers)
    if possible and choice == "auto" and cost.group_dispatch_ms is not None:
        if cost.group_makespan_ms(tokens, workers) < cost.makespan_ms(tokens, len(ranges)) * (1.0 - min_gain):
            return Plan([(0, tokens)], workers)
    return Plan(ranges)


def workers_for(tokens: int, workers: int, cost: CostModel, min_gain: float = 0.1, target_ms: float | None = None) -> int:
    """How many workers (1..workers, at most one per token) `tokens` should use. Ranges are never
    cut below `cost.min_chunk_tokens` (unless the prompt itself is shorter).

    With `target_ms`: the fewest whose predicted makespan meets it (the paper's "a core handles c
    tokens, use ceil(L / c) cores"), all of them if none does. Without: a larger count is taken
    only when it beats the best smaller count's makespan by at least `min_gain` (a fraction): cores
    that would save little stay free for other requests.
    """
    if workers < 1:
        raise ValueError(f"need at least one worker, not {workers}")
    limit = max(1, min(workers, tokens, tokens // cost.min_chunk_tokens))
    if target_ms is not None:
        for count in range(1, limit + 1):
            if cost.makespan_ms(tokens, count) <= target_ms:
                return count
        return limit
    best, best_ms = 1, cost.makespan_ms(tokens, 1)
    for count in range(2, limit + 1):
        ms = cost.makespan_ms(tokens, count)
        if ms < best_ms * (1.0 - min_gain):
            best, best_ms = count, ms
    return best


def split(
    tokens: int, workers: int, cost: CostModel, min_gain: float = 0.1, target_ms: float | None = None
) -> list[tuple[int, int]]:
    """Contiguous (start, end) token ranges covering [0, tokens), one per worker used, sizes
    differing by at most one. No ranges for no tokens."""
    if tokens <= 0:
        return []
    count = workers_for(tokens, workers, cost, min_gain, target_ms)
    base, extra = divmod(tokens, count)
    ranges, start = [], 0
    for index in range(count):
        end = start + base + (1 if index < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
