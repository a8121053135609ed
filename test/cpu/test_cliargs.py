"""The shared argparse value types: bad counts and rates stop at parse time with one line."""
import argparse

import pytest

from sglang_h20.cliargs import int_at_least, non_negative_int, positive_float, positive_int


def parse(kind, text):
    ap = argparse.ArgumentParser(prog="t", exit_on_error=False)
    ap.add_argument("--x", type=kind)
    return ap.parse_args(["--x", text]).x


@pytest.mark.parametrize("kind,text,value", [(positive_int, "3", 3), (non_negative_int, "0", 0),
                                             (int_at_least(5), "5", 5), (positive_float, "0.25", 0.25)])
def test_accepts(kind, text, value):
    assert parse(kind, text) == value


@pytest.mark.parametrize("kind,text", [(positive_int, "0"), (positive_int, "-2"), (positive_int, "1.5"),
                                       (positive_int, "x"), (non_negative_int, "-1"), (int_at_least(5), "4"),
                                       (positive_float, "0"), (positive_float, "-1"), (positive_float, "nan"),
                                       (positive_float, "inf"), (positive_float, "fast")])
def test_rejects_with_the_value_named(kind, text):
    with pytest.raises(argparse.ArgumentError, match=f"got '{text}'"):
        parse(kind, text)
