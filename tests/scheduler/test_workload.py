"""scheduler/workload.py: the generators' statistics (Poisson rate, Gamma cv, Zipf rank-frequency
slope, the serverless generator's skew and burstiness), determinism by seed, the JSON round trip, and
reading the Azure LLM inference trace 2023 (CC BY 4.0; Patel et al., Splitwise, ISCA 2024)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lorad.errors import BadRequest
from lorad.scheduler.workload import (
    AZURE_ATTRIBUTION,
    AzureLengths,
    Trace,
    UniformLengths,
    azure_workload,
    gamma_arrivals,
    gamma_workload,
    parse_timestamp,
    poisson_arrivals,
    poisson_workload,
    power_law_weights,
    read_azure_csv,
    serverless_workload,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
CONV = DATA / "azure_llm_inference_2023_conv.csv"
CODE = DATA / "azure_llm_inference_2023_code.csv"
needs_azure = pytest.mark.skipif(
    not (CONV.exists() and CODE.exists()), reason=f"the Azure LLM inference trace CSVs are not in {DATA}"
)


def test_poisson_rate_and_exponential_gaps():
    rng = np.random.default_rng(0)
    arrivals = poisson_arrivals(20.0, 1000.0, rng)
    assert len(arrivals) == pytest.approx(20_000, rel=0.03)
    assert np.all(np.diff(arrivals) >= 0) and arrivals.min() >= 0 and arrivals.max() < 1000.0
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv_and_rate(cv):
    rng = np.random.default_rng(1)
    arrivals = gamma_arrivals(10.0, cv, 5000.0, rng)
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert len(arrivals) == pytest.approx(50_000, rel=0.1)


def test_gamma_rate_is_unbiased_for_rare_adapters():
    """Thousands of processes that each expect far less than one arrival still add up to the rate."""
    rng = np.random.default_rng(2)
    total = sum(len(gamma_arrivals(0.01, 3.0, 20.0, rng)) for _ in range(5000))
    assert total == pytest.approx(5000 * 0.2, rel=0.15)


def test_power_law_rank_frequency_slope():
    alpha = 1.2
    weights = power_law_weights(1000, alpha)
    assert weights.sum() == pytest.approx(1.0)
    trace = poisson_workload(num_adapters=1000, rate=200.0, duration_s=500.0, alpha=alpha, seed=3)
    counts = np.sort(np.bincount([int(r.adapter.split("-")[1]) for r in trace.requests]))[::-1]
    top = counts[:50]  # the head, where every adapter has plenty of samples
    slope = np.polyfit(np.log(np.arange(1, 51)), np.log(top), 1)[0]
    assert slope == pytest.approx(-alpha, abs=0.1)
    assert power_law_weights(10, 0.0) == pytest.approx(np.full(10, 0.1))


def test_gamma_workload_per_adapter_rates_and_ranks():
    trace = gamma_workload(num_adapters=8, rate=40.0, duration_s=300.0, alpha=1.0, cv=2.0, ranks=(8, 64), seed=4)
    counts = {}
    for request in trace.requests:
        counts[request.adapter] = counts.get(request.adapter, 0) + 1
    weights = power_law_weights(8, 1.0)
    assert len(trace.requests) == pytest.approx(40 * 300, rel=0.1)
    assert counts["adapter-0000"] / len(trace.requests) == pytest.approx(weights[0], rel=0.15)
    assert trace.adapter_ranks["adapter-0000"] == 8 and trace.adapter_ranks["adapter-0001"] == 64
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert all(8 <= r.prompt_tokens <= 512 and 8 <= r.output_tokens <= 512 for r in trace.requests)


def test_serverless_workload_is_skewed_and_bursty():
    trace = serverless_workload(num_adapters=5000, rate=100.0, duration_s=600.0, seed=5)
    assert len(trace.requests) == pytest.approx(60_000, rel=0.25)  # log-normal: a few adapters dominate
    counts = np.sort(np.bincount([int(r.adapter.split("-")[1]) for r in trace.requests], minlength=5000))[::-1]
    assert counts[:50].sum() > 0.4 * counts.sum()  # the top 1% of adapters send ~half the requests
    assert (counts == 0).sum() > 1000  # and many adapters are never invoked
    top = [r.arrival_s for r in trace.requests if r.adapter == "adapter-0000"]
    per_second = np.bincount(np.asarray(top, dtype=int), minlength=600)
    assert per_second.var() / per_second.mean() > 3  # on/off: far burstier than Poisson (ratio 1)


def test_same_seed_same_trace_and_json_round_trip(tmp_path):
    def make(seed):
        return gamma_workload(50, 10.0, 60.0, alpha=0.8, cv=3.0, lengths=UniformLengths((1, 100), (1, 50)), seed=seed)

    first, again, other = make(7), make(7), make(8)
    assert first.requests == again.requests and first.adapter_ranks == again.adapter_ranks
    assert first.requests != other.requests
    path = tmp_path / "trace.json"
    first.save(path)
    loaded = Trace.load(path)
    assert loaded.requests == first.requests
    assert loaded.adapter_ranks == first.adapter_ranks
    assert loaded.source == first.source
    path.write_text('{"version": 1, "adapter_ranks": {}, "requests": [[0.0, "x", 1, 1]]}')
    with pytest.raises(BadRequest, match="without a rank"):
        Trace.load(path)


def test_parse_timestamp_seven_digits():
    assert parse_timestamp("2023-11-16 18:15:50.9951690") - parse_timestamp("2023-11-16 18:15:46.6805900") == (
        pytest.approx(4.314579, abs=1e-6)
    )


@needs_azure
def test_read_azure_csv():
    rows = read_azure_csv(CONV)
    assert len(rows.arrival_s) > 19_000  # 19,366 lines less the header and any zero-output rows
    assert rows.arrival_s[0] == 0.0 and np.all(np.diff(rows.arrival_s) >= 0)
    assert rows.arrival_s[-1] == pytest.approx(3500, rel=0.05)  # about an hour
    assert (rows.output_tokens > 0).all() and (rows.prompt_tokens > 0).all()
    code = read_azure_csv(CODE)
    assert np.median(code.prompt_tokens) > np.median(rows.prompt_tokens)  # code prompts are longer
    assert np.median(code.output_tokens) < np.median(rows.output_tokens)  # and answers shorter


@needs_azure
def test_azure_workload_rescaled_and_attributed():
    rows = read_azure_csv(CONV)
    trace = azure_workload(rows, num_adapters=100, rate=50.0, num_requests=5000, seed=9)
    assert len(trace.requests) == 5000
    assert (len(trace.requests) - 1) / trace.duration_s == pytest.approx(50.0)
    assert [r.prompt_tokens for r in trace.requests[:10]] == rows.prompt_tokens[:10].tolist()  # real pairs, in order
    assert [r.output_tokens for r in trace.requests[:10]] == rows.output_tokens[:10].tolist()
    gaps_real = np.diff(rows.arrival_s[:5000])
    gaps = np.diff([r.arrival_s for r in trace.requests])
    assert gaps.std() / gaps.mean() == pytest.approx(gaps_real.std() / gaps_real.mean(), rel=1e-6)  # shape kept
    assert trace.source["attribution"] == AZURE_ATTRIBUTION
    poisson = azure_workload(rows, 100, rate=20.0, real_arrivals=False, popularity="serverless", seed=9)
    assert len(poisson.requests) == len(rows.arrival_s)
    lengths = gamma_workload(10, 5.0, 20.0, lengths=AzureLengths(rows), seed=1)
    assert "CC BY 4.0" in lengths.source["attribution"]
    with pytest.raises(BadRequest):
        azure_workload(rows, 10, popularity="zipf")
