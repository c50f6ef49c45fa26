"""The argparse types every `lorad` command shares: numbers in range, seeds, octal modes, log levels, --out paths."""

from __future__ import annotations

import argparse

import pytest

from lorad.daemon.server.cli_args import SEED, check_out, log_level, number, octal_mode
from lorad.errors import BadRequest


@pytest.mark.parametrize("convert, text, value", [
    (number(int, positive=True), "3", 3),
    (number(float, positive=True), "0.5", 0.5),
    (number(float, least=0), "0", 0.0),
    (number(int, 1, 10), "10", 10),
    (SEED, "0", 0),
    (SEED, str(2**63 - 1), 2**63 - 1),
    (octal_mode, "660", 0o660),
    (octal_mode, "0", 0),
    (log_level, "WARNING", "warning"),
])
def test_accepted(convert, text, value):
    assert convert(text) == value


@pytest.mark.parametrize("convert, text, message", [
    (number(int, positive=True), "0", "expected a positive integer, not '0'"),
    (number(int, positive=True), "x", "expected a positive integer, not 'x'"),
    (number(float, positive=True), "nan", "expected a positive number, not 'nan'"),
    (number(float, positive=True), "inf", "expected a positive number, not 'inf'"),
    (number(float, least=0), "-inf", "expected a number, not '-inf'"),
    (number(float, least=0), "-0.5", "expected a number of at least 0, not '-0.5'"),
    (number(int, most=5), "6", "expected an integer of at most 5, not '6'"),
    (number(int, 1, 10), "11", "expected an integer from 1 to 10, not '11'"),
    (SEED, "-1", f"expected an integer from 0 to {2**63 - 1}, not '-1'"),
    (octal_mode, "rw", "not an octal mode: 'rw'"),
    (octal_mode, "7777", "not a mode of permission bits from 0 to 777: '7777'"),
    (octal_mode, "-1", "not a mode of permission bits from 0 to 777: '-1'"),
    (log_level, "loud", "expected one of debug, info, warning, error, not 'loud'"),
])
def test_refused_with_what_it_takes(convert, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        convert(text)
    assert str(refused.value) == message


def test_check_out(tmp_path):
    check_out(None)
    check_out(tmp_path / "report.json")
    check_out(tmp_path / "new" / "deeper" / "report.json", make_parents=True)
    (tmp_path / "file").write_text("")
    for path, make_parents, message in [
        (tmp_path, False, f"--out {tmp_path} is a directory: give a file's path"),
        (tmp_path / "new" / "report.json", False, f"--out {tmp_path / 'new' / 'report.json'}: the directory "
                                                  f"{tmp_path / 'new'} does not exist"),
        (tmp_path / "file" / "report.json", True, f"--out {tmp_path / 'file' / 'report.json'}: {tmp_path / 'file'} "
                                                  "is not a directory"),
    ]:
        with pytest.raises(BadRequest) as refused:
            check_out(path, make_parents=make_parents)
        assert refused.value.message == message
