"""Where a measurement came from: command, git commit, GPU, versions, date.

Every results JSON under benchmark/results/ carries this record, so a number can be traced
to the code and the card that produced it.
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

from sglang_h20 import __version__, compat

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """HEAD of this checkout, '+dirty' when tracked files differ from it.

    GIT_COMMIT wins: the GPU host receives the working tree without .git.
    """
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def record(command: str | None = None) -> dict:
    g = compat.gpu()
    return {
        "command": command if command is not None else " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": git_commit(),
        "gpu": g.name if g else None,
        "gpu_capability": f"sm_{g.capability[0]}{g.capability[1]}" if g else None,
        "versions": {"python": platform.python_version(), "torch": compat.version("torch"),
                     "triton": compat.version("triton"), "sglang": compat.version("sglang"),
                     "sglang-kernel": compat.version("sglang-kernel"), "sglang_h20": __version__},
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
