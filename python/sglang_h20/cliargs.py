"""argparse value types shared by the package's command lines: a bad count or rate fails at parse time, in one line,
before any work (a zero layer count used to surface as a numpy error after minutes of simulation)."""
from __future__ import annotations

import argparse
import math


def int_at_least(least: int):
    """An argparse `type`: an integer >= least."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return n
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse `type`: a finite number > 0."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return x
