"""Torch-profiler (Chrome trace) summaries shared by the serving profilers (prefill_profile.py, decode_profile.py):
kernel and CPU-op totals per unit of work (a prefill, a decode step), their top names, and the kernels whose totals
differ most between two arms."""
from __future__ import annotations

import gzip
import json
import time
from collections import defaultdict
from pathlib import Path

TOP = 15


def load_trace(path: Path) -> list[dict]:
    """The traceEvents of one Chrome trace file (.json or .json.gz)."""
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    return json.loads(raw).get("traceEvents", [])


def wait_for_traces(folder: Path, timeout_s: float = 120, match: str = "") -> list[Path]:
    """The trace files (.json / .json.gz, names containing match) under folder once they exist and are non-empty
    (the scheduler writes them after the profile stops); [] after timeout_s."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        files = sorted(p for p in folder.rglob("*") if p.name.endswith((".json", ".json.gz")) and match in p.name)
        if files and all(p.stat().st_size > 0 for p in files):
            time.sleep(2)  # a file seen non-empty may still be growing
            return files
        time.sleep(1)
    return []


def summarize(events: list[dict], count: int, unit: str = "prefill") -> dict:
    """Kernel and CPU-op totals (ms) of a trace per unit (count of them in the trace); the top names of each."""
    kernels, cpu_ops = defaultdict(float), defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", "")).lower()
        if cat == "kernel":
            kernels[e.get("name", "?")] += e["dur"] / 1e3
            launches[e.get("name", "?")] += 1
        elif cat in ("cpu_op", "user_annotation"):
            cpu_ops[e.get("name", "?")] += e["dur"] / 1e3
    per = max(1, count)

    def top(d, with_launches=False):
        rows = []
        for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:TOP]:
            row = {"name": k[:160], f"ms_per_{unit}": v / per}
            if with_launches:
                row[f"launches_per_{unit}"] = launches[k] / per
            rows.append(row)
        return rows

    return {f"gpu_kernel_ms_per_{unit}": sum(kernels.values()) / per,
            f"kernel_launches_per_{unit}": sum(launches.values()) / per,
            "kernels": top(kernels, with_launches=True), "cpu_ops": top(cpu_ops),
            "_kernel_totals": {k: v / per for k, v in kernels.items()}}


def compare(a: dict, b: dict) -> list[dict]:
    """Kernels by |b - a| per unit, largest first (names present in either arm)."""
    ka, kb = a["_kernel_totals"], b["_kernel_totals"]
    rows = [{"name": n[:160], "a_ms": ka.get(n, 0.0), "b_ms": kb.get(n, 0.0), "diff_ms": kb.get(n, 0.0) - ka.get(n, 0.0)}
            for n in set(ka) | set(kb)]
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))[:TOP]
