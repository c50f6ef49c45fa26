"""The large-body parser's child process: the same values and errors as json.loads, and a new child after one dies."""

import json
import os
import signal
import subprocess
import sys

import pytest

from lorad.daemon.server.body_parser import BodyParser
from lorad.errors import BadRequest, ServiceUnavailable


@pytest.fixture
def parser():
    parser = BodyParser()
    yield parser
    parser.close()


BODIES = [
    {"model": "m", "prompt": "lighthouse " * 100_000},
    {"model": "m", "prompt": [[5, 6, 2**40], list(range(50_000))], "seed": 2**64 - 1, "temperature": 0.7},
    {"messages": [{"role": "user", "content": "ça va? 灯台 🚢"}], "logit_bias": {"50256": -100.0}, "stop": None},
    [1.5e308, -0.0, True, False, None, "", {}, []],
    [[[[[[[[[["deep"]]]]]]]]]],
]


@pytest.mark.parametrize("value", BODIES)
def test_values_are_what_json_loads_gives(parser, value):
    raw = json.dumps(value).encode()
    assert parser.parse(raw) == json.loads(raw)


def test_non_finite_numbers_parse_as_json_loads_reads_them(parser):
    parsed = parser.parse(b'[Infinity, -Infinity, NaN]')
    assert parsed[:2] == [float("inf"), float("-inf")] and parsed[2] != parsed[2]


@pytest.mark.parametrize("raw, error, fragment", [
    (b'{"model": ', ValueError, "Expecting value"),
    (b'\xff\xfe{}', ValueError, ""),
    (b'[' + b'1' * 5000 + b']', ValueError, "digits"),  # Python's int string conversion limit
    (b'[' * 200_000 + b']' * 200_000, RecursionError, ""),
])
def test_refusals_are_json_loads_errors(parser, raw, error, fragment):
    with pytest.raises(error):  # what the thread's json.loads raised, and api.py maps
        json.loads(raw)
    with pytest.raises(error) as refused:
        parser.parse(raw)
    assert fragment in str(refused.value)
    assert parser.parse(b'{"after": 1}') == {"after": 1}  # the child lives on


def test_a_child_killed_while_idle_is_replaced_at_the_next_body(parser, caplog):
    assert parser.parse(b'[1]') == [1]
    first = parser._process
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert parser.parse(b'[2]') == [2]
    assert parser._process.pid != first.pid and "had exited" in caplog.text


def test_a_child_that_dies_during_a_body_answers_503_and_the_next_body_starts_a_new_one(parser):
    # a stand-in child that reads the header and exits without answering
    parser._process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read(8)"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with pytest.raises(ServiceUnavailable, match="exited; retry"):
        parser.parse(b'[1]')
    assert parser._process is None
    assert parser.parse(b'[3]') == [3]


def test_close_ends_the_child(parser):
    parser.parse(b'{}')
    process = parser._process
    parser.close()
    assert process.poll() == 0


def test_a_body_of_more_values_than_the_cap_is_refused_in_the_child():
    parser = BodyParser(max_values=1000)
    try:
        # an object, its two other values, and a list of 996 numbers: 1000, kept
        body = {"model": "m", "prompt": list(range(996)), "n": 1}
        assert parser.parse(json.dumps(body).encode()) == body
        for over in ({"model": "m", "prompt": list(range(997)), "n": 1},
                     {"messages": [{"role": "user", "content": "x"}] * 400},  # 1 + 1 + 400 x 3
                     [[[]] * 600] * 2):
            with pytest.raises(BadRequest, match="more than 1000 JSON values"):
                parser.parse(json.dumps(over).encode())
        assert parser.parse(b"[1, 2]") == [1, 2]  # the child lives on
    finally:
        parser.close()


def test_the_count_stops_past_its_limit():
    child = json_child()
    assert child.count_values([1, [2, [3, {"a": 4, "b": [5]}]]], 100) == 10  # 4 lists, 1 object, 5 numbers
    assert child.count_values(list(range(10_000_000)), 10) == 10_000_001  # one list: counted at once
    assert child.count_values([[1]] * 1_000_000, 10) <= 12  # stopped, not walked to the end


def json_child():
    import importlib.util

    from lorad.daemon.server import body_parser

    spec = importlib.util.spec_from_file_location("json_child", body_parser.CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
