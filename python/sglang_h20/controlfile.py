"""A file that a benchmark rewrites while one server runs, to flip a feature without a restart.

Why: two servers differ by 12-16% in throughput on the same GPU, so small effects (observation
overhead, the MHA/MLA policy's TTFT) can only be measured as A/B windows inside one server.
"""
from __future__ import annotations

import os


class ControlFile:
    """The file's first word, read only when the file changed (one os.stat per check otherwise)."""

    def __init__(self, path: str):
        self.path = str(path)
        self._key = None  # (mtime_ns, size) of the last read

    def changed(self) -> tuple[object, str] | None:
        """(key, first word) when the file changed since the last call; None when unchanged or missing.
        The key identifies this version of the file (for once-per-version warnings)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if key == self._key:
            return None
        self._key = key
        try:
            with open(self.path, encoding="utf-8") as fh:
                text = fh.read().strip()
        except OSError:
            return None
        return key, (text.split()[0] if text else "")


def write_control(path, value) -> None:
    """Replace the file's content atomically: a server never reads half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(f"{value}\n")
    os.replace(tmp, path)
