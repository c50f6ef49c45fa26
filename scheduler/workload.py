"""Request traces for simulations and benchmarks: who asks for which adapter, when, with how many tokens.

Arrivals are Poisson, Gamma with a coefficient of variation cv per adapter (S-LoRA §7.1), a skewed
serverless-style on/off process (the shape of the Azure Functions trace CaraServe replays), or the real
arrival times of the Azure LLM inference trace 2023 rescaled to a target rate. Lengths come from uniform
ranges or from real (prompt, output) pairs of that trace. Every generator takes a seed and gives the same
`Trace` for it; `Trace.save` / `Trace.load` let a run be replayed exactly.

Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA 2024; Azure Public Dataset), CC BY 4.0:
any trace built from it carries this attribution in `Trace.source["attribution"]`.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from lorad.errors import BadRequest
from lorad.scheduler.json_file import read_json

AZURE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (Azure Public Dataset; Patel et al., Splitwise: Efficient generative "
    "LLM inference using phase splitting, ISCA 2024), licensed CC BY 4.0"
)
DEFAULT_RANKS = (8, 16, 32, 64)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    adapter: str
    prompt_tokens: int
    output_tokens: int


@dataclass
class Trace:
    requests: list[TraceRequest]  # sorted by arrival
    adapter_ranks: dict[str, int]  # every adapter the requests name, and its LoRA rank
    source: dict = field(default_factory=dict)  # the generator and its parameters (and attribution)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "version": 1,
            "source": self.source,
            "adapter_ranks": self.adapter_ranks,
            "columns": ["arrival_s", "adapter", "prompt_tokens", "output_tokens"],
            "requests": [[r.arrival_s, r.adapter, r.prompt_tokens, r.output_tokens] for r in self.requests],
        }

    @classmethod
    def from_json(cls, data: dict) -> "Trace":
        try:
            if data.get("version") != 1:
                raise BadRequest(f"unknown trace version {data.get('version')!r}")
            requests = [TraceRequest(float(a), str(n), int(p), int(o)) for a, n, p, o in data["requests"]]
            ranks = {str(name): int(rank) for name, rank in data["adapter_ranks"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise BadRequest.malformed("trace", error) from None
        missing = {r.adapter for r in requests} - ranks.keys()
        if missing:
            raise BadRequest(f"trace names adapters without a rank: {sorted(missing)[:5]}")
        for index, r in enumerate(requests):
            if not (math.isfinite(r.arrival_s) and r.arrival_s >= 0 and r.prompt_tokens >= 1 and r.output_tokens >= 1):
                row = [r.arrival_s, r.adapter, r.prompt_tokens, r.output_tokens]
                raise BadRequest(f"malformed trace: request {index} {row} needs a finite arrival_s >= 0 and at least "
                                 "one prompt and one output token")
        low = [name for name, rank in ranks.items() if rank < 1]
        if low:
            raise BadRequest(f"malformed trace: adapter ranks must be at least 1, not {low[0]!r}: {ranks[low[0]]}")
        return cls(requests, ranks, dict(data.get("source") or {}))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(read_json(path, "trace"))


# ---------------------------------------------------------------------------------------------------
# Arrival processes and popularity


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` per second on [0, duration_s)."""
    return gamma_arrivals(rate, 1.0, duration_s, rng)


def gamma_arrivals(rate: float, cv: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """A renewal process with Gamma inter-arrival gaps of mean 1/rate and coefficient of variation cv
    (shape 1/cv^2); cv = 1 is Poisson, cv > 1 is bursty."""
    if rate <= 0 or duration_s <= 0:
        return np.empty(0)
    if cv <= 0:
        raise BadRequest(f"cv must be positive, not {cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    expected = rate * duration_s
    # Stationary start: time 0 falls inside a length-biased gap (Gamma(shape + 1)), at a uniform point
    # of it. Starting with an arrival at 0 instead would add (cv^2 - 1) / 2 expected arrivals per
    # process, which over thousands of rarely used adapters is most of the trace.
    now = float(rng.gamma(shape + 1.0, scale) * rng.random())
    times: list[np.ndarray] = [np.array([now])]
    while now < duration_s:
        gaps = rng.gamma(shape, scale, size=int(expected + 4 * np.sqrt(expected) * max(cv, 1.0) + 16))
        chunk = now + np.cumsum(gaps)
        times.append(chunk)
        now = float(chunk[-1])
    arrivals = np.concatenate(times)
    return arrivals[arrivals < duration_s]


def power_law_weights(num_adapters: int, alpha: float) -> np.ndarray:
    """Zipf popularity: the adapter of popularity rank k (1 = most popular) gets weight k^-alpha, so a
    log-log rank-frequency plot is a line of slope -alpha (alpha = 0: uniform). Note S-LoRA's alpha is
    the exponent of numpy's power distribution, where a smaller alpha is more skewed; ours is Zipf's."""
    if num_adapters < 1:
        raise BadRequest("num_adapters must be at least 1")
    weights = np.arange(1, num_adapters + 1, dtype=np.float64) ** -float(alpha)
    return weights / weights.sum()


def serverless_weights(num_adapters: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Heavy-tailed per-adapter popularity: log-normal weights with log-space spread sigma, sorted
    descending. The Azure Functions trace's per-function daily invocation counts span about eight orders
    of magnitude and are close to log-normal (Shahrad et al., Serverless in the Wild, ATC 2020); sigma
    around 2.5-3 gives that span over tens of thousands of functions."""
    weights = np.sort(rng.lognormal(0.0, sigma, size=num_adapters))[::-1]
    return weights / weights.sum()


def adapter_names(num_adapters: int) -> list[str]:
    width = max(4, len(str(num_adapters - 1)))
    return [f"adapter-{i:0{width}d}" for i in range(num_adapters)]


def round_robin_ranks(names: Sequence[str], ranks: Sequence[int]) -> dict[str, int]:
    """S-LoRA's assignment: the i-th adapter gets ranks[i % len(ranks)]."""
    if not ranks:
        raise BadRequest("ranks must not be empty")
    return {name: int(ranks[i % len(ranks)]) for i, name in enumerate(names)}


# ---------------------------------------------------------------------------------------------------
# Lengths


class Lengths(Protocol):
    def sample(self, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]: ...
    def describe(self) -> dict: ...


@dataclass(frozen=True)
class UniformLengths:
    """Prompt and output lengths drawn independently from U[low, high] (inclusive), as in S-LoRA."""

    prompt: tuple[int, int] = (8, 512)
    output: tuple[int, int] = (8, 512)

    def sample(self, count, rng):
        prompts = rng.integers(self.prompt[0], self.prompt[1] + 1, size=count)
        outputs = rng.integers(self.output[0], self.output[1] + 1, size=count)
        return prompts, outputs

    def describe(self):
        return {"kind": "uniform", "prompt": list(self.prompt), "output": list(self.output)}


@dataclass(frozen=True)
class AzureRows:
    """The rows of one Azure LLM inference trace CSV: arrival seconds since its first row, prompt and
    output tokens."""

    path: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray


def read_azure_csv(path: str | Path) -> AzureRows:
    """Reads TIMESTAMP,ContextTokens,GeneratedTokens; rows are sorted by time, zero-length outputs kept
    out (a request that generates nothing says nothing about decoding)."""
    times, prompts, outputs = [], [], []
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                times.append(parse_timestamp(row["TIMESTAMP"]))
                prompts.append(int(row["ContextTokens"]))
                outputs.append(int(row["GeneratedTokens"]))
    except OSError as error:
        raise BadRequest(f"cannot read Azure trace {path}: {error}") from None
    except (KeyError, ValueError) as error:
        raise BadRequest(f"malformed Azure trace {path}: {error!r}") from None
    times_array = np.asarray(times)
    order = np.argsort(times_array, kind="stable")
    keep = order[np.asarray(outputs)[order] > 0]
    arrivals = times_array[keep] - times_array[keep[0]] if len(keep) else times_array[keep]
    return AzureRows(str(path), arrivals, np.asarray(prompts)[keep], np.asarray(outputs)[keep])


def parse_timestamp(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (seven fractional digits, which datetime does not take) -> seconds."""
    whole, _, fraction = text.strip().partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return seconds + (float("0." + fraction) if fraction else 0.0)


@dataclass(frozen=True)
class AzureLengths:
    """Real (prompt, output) pairs drawn with replacement from an Azure trace, kept together."""

    rows: AzureRows

    def sample(self, count, rng):
        picks = rng.integers(0, len(self.rows.prompt_tokens), size=count)
        return self.rows.prompt_tokens[picks], self.rows.output_tokens[picks]

    def describe(self):
        return {"kind": "azure", "path": Path(self.rows.path).name, "attribution": AZURE_ATTRIBUTION}


# ---------------------------------------------------------------------------------------------------
# Generators


def _assemble(
    arrivals: np.ndarray,
    adapter_ids: np.ndarray,
    names: list[str],
    ranks: Sequence[int],
    lengths: Lengths,
    rng: np.random.Generator,
    source: dict,
) -> Trace:
    order = np.argsort(arrivals, kind="stable")
    arrivals, adapter_ids = arrivals[order], adapter_ids[order]
    prompts, outputs = lengths.sample(len(arrivals), rng)
    used = sorted(set(adapter_ids.tolist()))
    all_ranks = round_robin_ranks(names, ranks)
    requests = [
        TraceRequest(float(a), names[i], int(p), int(o))
        for a, i, p, o in zip(arrivals.tolist(), adapter_ids.tolist(), prompts.tolist(), outputs.tolist())
    ]
    lengths_source = lengths.describe()
    source = {**source, "ranks": list(ranks), "lengths": lengths_source}
    if "attribution" in lengths_source:
        source["attribution"] = lengths_source["attribution"]
    return Trace(requests, {names[i]: all_ranks[names[i]] for i in used}, source)


def poisson_workload(
    num_adapters: int,
    rate: float,
    duration_s: float,
    alpha: float = 1.0,
    lengths: Lengths = UniformLengths(),
    ranks: Sequence[int] = DEFAULT_RANKS,
    seed: int = 0,
) -> Trace:
    """One Poisson stream of `rate` requests/s; each request's adapter drawn from Zipf(alpha) popularity."""
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rate, duration_s, rng)
    adapter_ids = rng.choice(num_adapters, size=len(arrivals), p=power_law_weights(num_adapters, alpha))
    source = {"generator": "poisson", "num_adapters": num_adapters, "rate": rate, "duration_s": duration_s,
              "alpha": alpha, "seed": seed}
    return _assemble(arrivals, adapter_ids, adapter_names(num_adapters), ranks, lengths, rng, source)


def gamma_workload(
    num_adapters: int,
    rate: float,
    duration_s: float,
    alpha: float = 1.0,
    cv: float = 1.0,
    lengths: Lengths = UniformLengths(),
    ranks: Sequence[int] = DEFAULT_RANKS,
    seed: int = 0,
) -> Trace:
    """S-LoRA's synthetic workload: adapter i has its own Gamma arrival process of mean rate
    rate * w_i (w: Zipf(alpha) weights) and coefficient of variation cv; ranks round-robin over `ranks`."""
    rng = np.random.default_rng(seed)
    weights = power_law_weights(num_adapters, alpha)
    arrivals, adapter_ids = _per_adapter(weights * rate, duration_s, rng, lambda r: gamma_arrivals(r, cv, duration_s, rng))
    source = {"generator": "gamma", "num_adapters": num_adapters, "rate": rate, "duration_s": duration_s,
              "alpha": alpha, "cv": cv, "seed": seed}
    return _assemble(arrivals, adapter_ids, adapter_names(num_adapters), ranks, lengths, rng, source)


def serverless_workload(
    num_adapters: int,
    rate: float,
    duration_s: float,
    sigma: float = 2.5,
    mean_on_s: float = 10.0,
    mean_off_s: float = 50.0,
    lengths: Lengths = UniformLengths(),
    ranks: Sequence[int] = DEFAULT_RANKS,
    seed: int = 0,
) -> Trace:
    """Skewed, bursty per-adapter traffic in the shape of the Azure Functions (MAF) trace that CaraServe
    replays (one function = one adapter). Not that trace (lorad does not ship it): a model of its shape.

    - Popularity: adapter i's mean rate is rate * w_i, w log-normal with spread sigma (`serverless_weights`):
      a few adapters take most requests, most are invoked a handful of times or never.
    - Burstiness: each adapter alternates ON and OFF periods, exponential with means mean_on_s and
      mean_off_s, starting in a random phase; it sends Poisson requests only while ON, at
      rate * w_i * (mean_on_s + mean_off_s) / mean_on_s, so its long-run mean is still rate * w_i.
    """
    rng = np.random.default_rng(seed)
    weights = serverless_weights(num_adapters, sigma, rng)
    duty = mean_on_s / (mean_on_s + mean_off_s)

    def on_off(mean_rate: float) -> np.ndarray:
        times: list[np.ndarray] = []
        on = rng.random() < duty
        now = 0.0
        while now < duration_s:
            length = rng.exponential(mean_on_s if on else mean_off_s)
            if on:
                count = rng.poisson(mean_rate / duty * length)
                times.append(now + rng.random(count) * length)
            now += length
            on = not on
        arrivals = np.concatenate(times) if times else np.empty(0)
        return arrivals[arrivals < duration_s]

    arrivals, adapter_ids = _per_adapter(weights * rate, duration_s, rng, on_off)
    source = {"generator": "serverless", "num_adapters": num_adapters, "rate": rate, "duration_s": duration_s,
              "sigma": sigma, "mean_on_s": mean_on_s, "mean_off_s": mean_off_s, "seed": seed}
    return _assemble(arrivals, adapter_ids, adapter_names(num_adapters), ranks, lengths, rng, source)


def _per_adapter(rates: np.ndarray, duration_s: float, rng: np.random.Generator, process) -> tuple[np.ndarray, np.ndarray]:
    """Runs `process(rate)` for each adapter. Adapters expected to send less than ~0.05 requests get
    their (at most a few) arrivals as a Poisson count placed uniformly, which is what any renewal process
    looks like at that scale and saves a loop iteration per rarely used adapter."""
    times, ids = [], []
    rare = rates * duration_s < 0.05
    rare_ids = np.flatnonzero(rare)
    counts = rng.poisson(rates[rare_ids] * duration_s)
    rare_ids = np.repeat(rare_ids, counts)
    times.append(rng.random(len(rare_ids)) * duration_s)
    ids.append(rare_ids)
    for adapter in np.flatnonzero(~rare):
        arrivals = process(float(rates[adapter]))
        times.append(arrivals)
        ids.append(np.full(len(arrivals), adapter))
    return np.concatenate(times), np.concatenate(ids).astype(np.int64)


def azure_workload(
    rows: AzureRows,
    num_adapters: int,
    rate: float | None = None,
    num_requests: int | None = None,
    real_arrivals: bool = True,
    popularity: str = "power_law",
    alpha: float = 1.0,
    sigma: float = 2.5,
    ranks: Sequence[int] = DEFAULT_RANKS,
    seed: int = 0,
) -> Trace:
    """Real requests of the Azure LLM inference trace: its (prompt, output) pairs in order and, with
    real_arrivals, its arrival times, uniformly rescaled so the mean rate is `rate` (None: as recorded);
    without, Poisson arrivals at `rate`. num_requests takes the first that many rows (None: all).
    The trace has no adapter ids: each request's adapter is drawn from `popularity`, "power_law"
    (Zipf alpha) or "serverless" (log-normal sigma), as the trace's `source` records."""
    rng = np.random.default_rng(seed)
    count = len(rows.arrival_s) if num_requests is None else min(num_requests, len(rows.arrival_s))
    if count < 2:
        raise BadRequest("the Azure trace needs at least two requests")
    if real_arrivals:
        arrivals = rows.arrival_s[:count].astype(np.float64)
        if rate is not None:
            arrivals = arrivals * ((count - 1) / arrivals[-1] / rate)
    else:
        if rate is None:
            raise BadRequest("Poisson arrivals need a rate")
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
        arrivals -= arrivals[0]
    if popularity == "power_law":
        weights = power_law_weights(num_adapters, alpha)
    elif popularity == "serverless":
        weights = serverless_weights(num_adapters, sigma, rng)
    else:
        raise BadRequest(f"popularity must be 'power_law' or 'serverless', not {popularity!r}")
    adapter_ids = rng.choice(num_adapters, size=count, p=weights)
    names = adapter_names(num_adapters)
    all_ranks = round_robin_ranks(names, ranks)
    requests = [
        TraceRequest(float(a), names[i], int(p), int(o))
        for a, i, p, o in zip(arrivals.tolist(), adapter_ids.tolist(),
                              rows.prompt_tokens[:count].tolist(), rows.output_tokens[:count].tolist())
    ]
    source = {"generator": "azure", "path": Path(rows.path).name, "num_adapters": num_adapters, "rate": rate,
              "num_requests": count, "real_arrivals": real_arrivals, "popularity": popularity,
              "alpha": alpha, "sigma": sigma, "ranks": list(ranks), "seed": seed,
              "attribution": AZURE_ATTRIBUTION}
    used = sorted(set(adapter_ids.tolist()))
    return Trace(requests, {names[i]: all_ranks[names[i]] for i in used}, source)
