"""The repository's files for the CPU tests: benchmark and script files (not packages) loaded as modules, the
committed GPU records, and the list of tracked files."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmark" / "results"


def stored_record(rel: str) -> dict:
    """A committed GPU record, RESULTS/rel (xz-compressed or not), read as the benchmarks read it."""
    from sglang_h20.cliargs import read_json

    return read_json(RESULTS / rel, "record")


def load_script(rel: str):
    """REPO/rel as a module named after its file: registered in sys.modules (dataclasses and pickling look it up
    there), its folder on sys.path (sibling imports, e.g. benchmark/serving's plugin_parity)."""
    path = REPO / rel
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def tracked_files() -> list[Path]:
    """Every file git tracks in the checkout (what a fresh clone has)."""
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names]
