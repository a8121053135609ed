"""What the package's command lines share: argparse value types, so a bad count or rate fails at parse time, in one
line, before any work (a zero layer count used to surface as a numpy error after minutes of simulation); and the
reading of input records and creation of output folders, which fail the same way before any work."""
from __future__ import annotations

import argparse
import json
import lzma
import math
from pathlib import Path


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


def read_json(path, what: str, error: type[Exception] = ValueError):
    """The JSON in `path` (xz-compressed when it ends in .xz: large records are stored so, to keep the working tree
    that travels to the GPU host under its limit), or `error` with one line: "WHAT PATH: cannot read JSON (reason)"."""
    try:
        data = Path(path).read_bytes()
        return json.loads(lzma.decompress(data) if str(path).endswith(".xz") else data)
    except (OSError, ValueError, lzma.LZMAError) as e:
        raise error(f"{what} {path}: cannot read JSON ({e})") from None


def make_dir(path, what: str = "--out", error: type[Exception] = ValueError) -> Path:
    """Create an output folder before any work: a bad one is a usage error, not a traceback after the run."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"{what}: cannot create the directory {path} ({e})") from None
    return Path(path)
