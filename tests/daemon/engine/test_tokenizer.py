"""daemon/engine/tokenizer.py: incremental detokenization with a real byte-level BPE (the demo's tokenizer.json),
multi-byte characters split over tokens, and stop strings cut before they are ever streamed."""

from __future__ import annotations

import random

import pytest

from lorad.daemon.engine.tokenizer import Detokenizer, Tokenizer

PIECES = [
    "the", " lighthouse", " keeper", " bread", " river", ",", ".", " ", " ", "\n", "42", "3.14",
    "中文", "字符", "日本語", "한국어", "é", "ß", "naïve", "😀", "🎉", "👩\u200d👩\u200d👧", "€", "∑",
]


@pytest.fixture(scope="module")
def tokenizer(demo_assets) -> Tokenizer:
    return Tokenizer(demo_assets.model_dir / "tokenizer.json")


def random_text(rng: random.Random, pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(pieces))


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()):
    """Feeds ids one by one as the engine does: -> (deltas, index of the token that stopped, or None)."""
    detokenizer = Detokenizer(tokenizer, stop)
    deltas = []
    for index, token in enumerate(ids):
        if detokenizer.add(token):
            deltas.append(detokenizer.take(final=True))
            return deltas, index, detokenizer
        deltas.append(detokenizer.take(final=False))
    deltas.append(detokenizer.take(final=True))
    return deltas, None, detokenizer


def test_multibyte_characters_are_split_over_tokens(tokenizer):
    ids = tokenizer.encode("😀中")
    assert len(ids) > 2  # byte-level: the 7 bytes take several tokens
    assert "\ufffd" in tokenizer.decode(ids[:1])


@pytest.mark.parametrize("seed", range(4))
def test_deltas_concatenate_to_the_decoded_text(tokenizer, seed):
    rng = random.Random(seed)
    for _ in range(40):
        text = random_text(rng, rng.randint(1, 25))
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        deltas, stopped, detokenizer = stream(tokenizer, ids)
        assert stopped is None
        assert "".join(deltas) == text == detokenizer.text
        assert all("\ufffd" not in delta for delta in deltas)  # only whole characters go out
        # without stop strings nothing is held back: after each token the stream is the decoded prefix
        # up to the last whole character
        detokenizer = Detokenizer(tokenizer, ())
        so_far = ""
        for k, token in enumerate(ids):
            detokenizer.add(token)
            so_far += detokenizer.take(final=False)
            prefix = tokenizer.decode(ids[: k + 1])
            complete = prefix.rstrip("\ufffd")
            assert so_far == complete


def test_random_ids_match_decode(tokenizer):
    """Arbitrary ids, invalid UTF-8 included: the stream equals decode(ids) (lossy, U+FFFD and all) as long
    as the ids do not end inside a character."""
    rng = random.Random(11)
    checked = 0
    for _ in range(400):
        ids = [rng.randrange(3, 512) for _ in range(rng.randint(1, 15))]
        full = tokenizer.decode(ids)
        if full.endswith("\ufffd"):
            continue
        deltas, _, _ = stream(tokenizer, ids)
        assert "".join(deltas) == full
        checked += 1
    assert checked > 200


def test_final_take_flushes_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # the last byte of the emoji is missing
    full = tokenizer.decode(ids)
    assert full.endswith("\ufffd")
    deltas, _, _ = stream(tokenizer, ids)
    assert "".join(deltas) == full


@pytest.mark.parametrize("seed", range(4))
def test_stop_string_cuts_before_it_and_is_never_streamed(tokenizer, seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        text = random_text(rng, rng.randint(3, 25))
        length = rng.randint(1, min(6, len(text)))
        begin = rng.randrange(len(text) - length + 1)
        stop = text[begin : begin + length]
        expected = text[: text.find(stop)]
        ids = tokenizer.encode(text)
        deltas, stopped, detokenizer = stream(tokenizer, ids, (stop,))
        assert stopped is not None
        # it stops at the first token after which the decoded text holds the whole stop string
        first = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]).rstrip("\ufffd"))
        assert stopped == first, (text, stop)
        assert detokenizer.text == expected
        assert "".join(deltas) == expected
        streamed = ""
        for delta in deltas[:-1]:  # before the final take, everything streamed is a prefix of the result
            streamed += delta
            assert expected.startswith(streamed)


def test_several_stop_strings_spanning_tokens(tokenizer):
    text = "the lighthouse keeper woke before the sun"
    ids = tokenizer.encode(text)
    assert len(ids) > 8
    for stops, expected in [
        (("keeper", "sun"), "the lighthouse "),
        (("sun", "keeper"), "the lighthouse "),
        (("zzz", "ghth", "woke"), "the li"),
        (("e s",), "the lighthouse keeper woke before th"),
        (("nothing", "absent"), text),
    ]:
        deltas, stopped, _ = stream(tokenizer, ids, stops)
        assert "".join(deltas) == expected, stops
        assert (stopped is None) == (expected == text)


def test_holdback_keeps_a_possible_stop_prefix_until_finish(tokenizer):
    text = "hello world EN"
    ids = tokenizer.encode(text)
    detokenizer = Detokenizer(tokenizer, ("END", "x"))
    streamed = ""
    for token in ids:
        assert not detokenizer.add(token)
        streamed += detokenizer.take(final=False)
    # "EN" could still become "END": held back while the request runs
    assert streamed == "hello world " and detokenizer.text == text
    assert detokenizer.take(final=True) == "EN"
    assert detokenizer.take(final=True) == ""


class PieceTokenizer:
    """Token i decodes to pieces[i]: lets a test choose exactly where token boundaries fall."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_earliest_of_several_stops_wins_in_one_token():
    tokenizer = PieceTokenizer(["ab", "cd"])
    deltas, stopped, detokenizer = stream(tokenizer, [0, 1], ("cd", "bc"))
    assert stopped == 1
    assert detokenizer.text == "a" and "".join(deltas) == "a"


def test_stop_found_in_one_token():
    tokenizer = PieceTokenizer(["ab", "cd"])
    deltas, stopped, _ = stream(tokenizer, [0, 1], ("bc", "cd"))
    assert stopped == 1 and "".join(deltas) == "a"
    deltas, stopped, _ = stream(tokenizer, [0, 1, 0], ("dab",))
    assert stopped == 2 and "".join(deltas) == "abc"


def test_encode_gives_the_tokenizers_ids(tokenizer, demo_assets):
    from tokenizers import Tokenizer as HFTokenizer

    reference = HFTokenizer.from_file(str(demo_assets.model_dir / "tokenizer.json"))
    rng = random.Random(5)
    for text in ["", "The lighthouse", *(random_text(rng, 40) for _ in range(20))]:
        for special in (True, False):
            assert tokenizer.encode(text, special) == reference.encode(text, add_special_tokens=special).ids


def test_a_long_encode_lets_other_threads_run(tokenizer):
    # another thread keeps its turns while a long prompt is tokenized: the API process's event loop, beside the
    # thread that tokenizes (encode itself holds the interpreter lock for the whole text)
    import threading
    import time

    text = "The lighthouse keeper watched the ships. " * 24000  # ~0.2-1 s of encoding: long beside a 1 ms tick
    gaps, done = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    tokenizer.encode(text)
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    assert took > 0.05 and max(gaps) < took / 2, (took, max(gaps))
