"""daemon/engine/sampler.py and the checks of SamplingParams: greedy rows, temperature / top-k / top-p against
the distributions they should draw from, and per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from lorad.daemon.engine.request import SamplingParams
from lorad.daemon.engine.sampler import Draws, History, make_generator, sample
from lorad.errors import BadRequest

VOCAB = 50


def random_logits(rows: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * spread


def draw(logits_row: torch.Tensor, params: SamplingParams, count: int) -> list[int]:
    """`count` draws from one row, through sample() in batches of 500 identical rows."""
    generator = make_generator(params)
    tokens = []
    while len(tokens) < count:
        n = min(500, count - len(tokens))
        tokens += sample(logits_row.expand(n, -1).clone(), [params] * n, [generator] * n)
    return tokens


def chi_square(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """Pearson's statistic over the cells with expected count >= 5 (the rest pooled), and its dof."""
    expected = probs * draws
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return statistic, int(keep.sum()) - 1


def assert_matches(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    statistic, dof = chi_square(counts, probs.double(), len(tokens))
    # mean dof, sd sqrt(2 dof): 6 sd above the mean is far beyond chance and well below a wrong distribution
    assert statistic < dof + 6 * math.sqrt(2 * dof), (statistic, dof)


def test_greedy_is_argmax():
    logits = random_logits(16, 0)
    params = [SamplingParams(temperature=0)] * 16
    assert sample(logits, params, [None] * 16) == logits.argmax(-1).tolist()


def test_greedy_rows_beside_sampled_rows():
    logits = random_logits(6, 1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)] * 3
    generators = [make_generator(p) for p in params]
    tokens = sample(logits, params, generators)
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()
    assert all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_and_tiny_top_p_are_greedy(seed):
    logits = random_logits(8, seed, spread=1.0)
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1, seed=seed), SamplingParams(temperature=1.5, top_p=1e-6, seed=seed)):
        generators = [make_generator(params) for _ in range(8)]
        for _ in range(20):
            assert sample(logits.clone(), [params] * 8, generators) == greedy


def test_same_seed_same_tokens_different_seeds_differ():
    logits = random_logits(1, 2, spread=1.0)[0]
    first = draw(logits, SamplingParams(temperature=1.0, seed=42), 200)
    again = draw(logits, SamplingParams(temperature=1.0, seed=42), 200)
    other = draw(logits, SamplingParams(temperature=1.0, seed=43), 200)
    assert first == again
    assert first != other
    assert sum(a != b for a, b in zip(first, other)) > 100


def test_generator_only_for_seeded_sampling():
    assert make_generator(SamplingParams(temperature=0, seed=1)) is None
    assert make_generator(SamplingParams(temperature=1.0)) is None
    assert isinstance(make_generator(SamplingParams(temperature=1.0, seed=1)), Draws)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits = random_logits(1, 3, spread=1.5)[0]
    tokens = draw(logits, SamplingParams(temperature=temperature, seed=7), 4000)
    assert_matches(tokens, torch.softmax(logits.double() / temperature, -1))


def test_top_k_frequencies():
    logits = random_logits(1, 4, spread=1.0)[0]
    k = 5
    tokens = draw(logits, SamplingParams(temperature=1.0, top_k=k, seed=8), 4000)
    top = set(torch.topk(logits, k).indices.tolist())
    assert set(tokens) <= top
    probs = torch.zeros(VOCAB, dtype=torch.float64)
    index = torch.tensor(sorted(top))
    probs[index] = torch.softmax(logits.double()[index], -1)
    assert_matches(tokens, probs)


def test_top_p_frequencies():
    logits = random_logits(1, 5, spread=1.5)[0]
    top_p = 0.6
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=9), 4000)
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True)
    kept, mass = [], 0.0
    for token in order.tolist():  # the smallest prefix of the sorted tokens whose mass reaches top_p
        kept.append(token)
        mass += float(probs[token])
        if mass >= top_p:
            break
    assert 1 < len(kept) < VOCAB
    assert set(tokens) <= set(kept)
    nucleus = torch.zeros(VOCAB, dtype=torch.float64)
    nucleus[kept] = probs[kept] / probs[kept].sum()
    assert_matches(tokens, nucleus)


def test_top_k_and_top_p_together():
    logits = random_logits(1, 6, spread=0.5)[0]
    tokens = draw(logits, SamplingParams(temperature=0.7, top_k=10, top_p=0.5, seed=10), 1000)
    assert set(tokens) <= set(torch.topk(logits, 10).indices.tolist())


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(max_tokens="5"),
        dict(max_tokens=True),
        dict(max_tokens=2.0),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(temperature="1"),
        dict(temperature=True),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_p=-0.1),
        dict(top_p=float("nan")),
        dict(top_k=-2),
        dict(top_k=2.5),
        dict(top_k=True),
        dict(seed="1"),
        dict(seed=1.0),
        dict(seed=False),
        dict(stop=("",)),
        dict(stop=(5,)),
        dict(stop=("ok", None)),
        dict(stop=tuple(f"s{i}" for i in range(17))),
        dict(stop_token_ids=(-1,)),
        dict(stop_token_ids=(True,)),
        dict(stop_token_ids=("3",)),
    ],
)
def test_sampling_params_refusals(fields):
    with pytest.raises(BadRequest):
        SamplingParams(**fields)


def test_sampling_params_accepts_the_edges():
    SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=-1, seed=0)
    SamplingParams(temperature=0.01, top_p=1e-6, top_k=0, stop=tuple(f"s{i}" for i in range(16)), stop_token_ids=(0, 5))
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy


# --- logits processing: penalties, logit bias, min_tokens against a row-by-row reference -------------------


def reference_processed(row: torch.Tensor, p: SamplingParams, history: History) -> torch.Tensor:
    """The definitions, one token at a time."""
    out = row.clone()
    if len(history.output) < p.min_tokens:
        for token in history.banned:
            out[token] = float("-inf")
    for token, bias in p.logit_bias:
        out[token] += bias
    if p.repetition_penalty != 1:
        for token in set(history.prompt) | set(history.output):
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(history.output):
        out[token] -= p.frequency_penalty * history.output.count(token) + p.presence_penalty
    return out


def test_processed_logits_equal_the_reference_row_by_row():
    logits = random_logits(6, seed=3)
    params = [
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0),  # untouched beside the others
        SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={"7": 100, "3": -4.5}),
        SamplingParams(temperature=0.8, frequency_penalty=-1.0, repetition_penalty=0.7, min_tokens=4),
        SamplingParams(temperature=0, min_tokens=2, logit_bias={"1": 50}),
        SamplingParams(temperature=0, presence_penalty=-2, logit_bias={"0": 1, "49": -100}),
    ]
    histories = [
        History([1, 2, 3], [5, 5, 9, 5, 2]),
        None,
        History([7, 7, 8], [3, 10]),
        History([4], [4, 4, 6], banned=(1, 2)),
        History([11, 12], [13, 14], banned=(1,)),  # at min_tokens: nothing banned
        History([0], []),
    ]
    processed = logits.clone()
    sample(processed, params, [None] * 6, histories)  # processes in place, then samples
    for row, (p, history) in enumerate(zip(params, histories)):
        want = logits[row] if history is None else reference_processed(logits[row], p, history)
        torch.testing.assert_close(processed[row], want, rtol=0, atol=1e-5)
    assert processed[3, 1] == float("-inf") and processed[3, 2] == float("-inf")
    assert sample(logits[2:3].clone(), params[2:3], [None], histories[2:3]) == [7]  # +100 wins the argmax


def test_processing_reaches_the_sampled_rows():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1, logit_bias={str(t): -100 for t in range(VOCAB) if t != 17})
    assert set(draw_processed(logits, params, 50)) == {17}


def draw_processed(logits: torch.Tensor, params: SamplingParams, count: int) -> list[int]:
    generator = make_generator(params)
    return [sample(logits.clone(), [params], [generator], [History([0], [])])[0] for _ in range(count)]


@pytest.mark.parametrize("fields, fragment", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={"x": 1}), "logit_bias: 'x'"),
    (dict(logit_bias={"5": 101}), "logit_bias: the bias of token 5"),
    (dict(logit_bias=[1, 2]), "logit_bias must be an object"),
    (dict(logit_bias={"7": 1, "07": 2}), "logit_bias: a token id is given more than once"),
    (dict(logit_bias={str(t): 1 for t in range(301)}), "at most 300"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "must not exceed max_tokens"),
])
def test_processing_refusals(fields, fragment):
    with pytest.raises(BadRequest, match=fragment):
        SamplingParams(**fields)


def test_logprobs_are_those_of_the_distribution_drawn_from():
    from lorad.daemon.engine.sampler import logprobs_of

    logits = random_logits(4, seed=5)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0.5, logprobs=0, logit_bias={"4": 2.0}), SamplingParams(temperature=2.0, logprobs=5, seed=1)]
    histories = [None, None, History([1], []), None]
    raw = logits.clone()
    tokens = sample(logits, params, [make_generator(p) for p in params], histories)
    got = logprobs_of(logits, params, tokens)
    assert got[1] is None
    for row in (0, 2, 3):
        p = params[row]
        processed = raw[row] if histories[row] is None else reference_processed(raw[row], p, histories[row])
        want = torch.log_softmax(processed / (p.temperature or 1.0), dim=-1)
        assert math.isclose(got[row].logprob, float(want[tokens[row]]), abs_tol=1e-5)
        order = want.argsort(descending=True)[: p.logprobs].tolist()
        assert [token for token, _ in got[row].top] == order
        assert all(math.isclose(value, float(want[token]), abs_tol=1e-5) for token, value in got[row].top)
    assert got[0].top[0][0] == tokens[0] and got[2].top == ()  # greedy: its token is the most likely


def test_a_row_with_no_finite_logit_fails_alone():
    logits = random_logits(3, 11)
    logits[1] = float("-inf")
    logits[2, 5] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=1)] * 3
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert tokens[0] is not None and tokens[1:] == [None, None]


def test_uniforms_are_integer_arithmetic_of_seed_draw_and_token():
    """The draws' uniforms against the same hash in Python integers (what makes them equal on every device), for
    seeds that use all 64 bits, and a seeded stream's draws in order."""
    from lorad.daemon.engine.sampler import _uniforms

    def mix(x):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
        return (x >> 16) ^ x

    def expected(seed, index, token):
        seed %= 2**64
        row = mix(mix(mix(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ (index & 0xFFFFFFFF))
        row = mix(row ^ (index >> 32))
        return ((mix((row + token * 0x9E3779B1) & 0xFFFFFFFF) >> 9) + 0.5) / (1 << 23)

    draws = Draws(2**64 - 5)
    keys = [draws.take(), draws.take(), Draws(7).take(), Draws(2**63 + 1).take()]
    assert [key[1] for key in keys] == [0, 1, 0, 0] and keys[0][0] == -5
    got = _uniforms(torch.tensor(keys), 300)
    for row, (seed, index) in enumerate(keys):
        for token in (0, 1, 157, 299):
            assert float(got[row, token]) == expected(seed, index, token)
    assert 0 < float(got.min()) and float(got.max()) < 1


def test_rows_drawn_in_parts_draw_what_one_draw_does(monkeypatch):
    """choose() draws a few rows at a time (DRAW_ELEMENTS bounds the logits a draw takes): every row's token is the
    one a single draw of all rows gives, each seeded stream's draws in row order."""
    from lorad.daemon.engine import sampler

    logits = random_logits(10, 14)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=row % 3) for row in range(10)]
    params[4] = SamplingParams(temperature=0)
    whole = sample(logits.clone(), params, [make_generator(p) for p in params])
    monkeypatch.setattr(sampler, "DRAW_ELEMENTS", 3 * VOCAB)  # three rows a draw
    calls = []
    original = sampler.draw
    monkeypatch.setattr(sampler, "draw", lambda logits, params, keys: calls.append(len(keys)) or original(logits, params, keys))
    assert sample(logits.clone(), params, [make_generator(p) for p in params]) == whole
    assert calls == [3, 3, 3]
