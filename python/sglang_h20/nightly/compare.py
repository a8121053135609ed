"""Run record vs baseline record: pure functions, so a verdict can be recomputed from two JSON files anywhere.

A change counts only when it exceeds both a fixed floor (`rel`) and `noise_k` times the run-to-run
noise seen in either record, so noisy points need a bigger shift before they are called.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from sglang_h20.nightly.config import DEFAULT_NOISE_K, DEFAULT_REL

SCHEMA = 1
SKIPPED_PREFIX = "skipped: "  # a point error starting with this was not run on purpose, not a failure
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
VERDICT_ORDER = ("regression", "missing", "improvement", "new", "same")


@dataclasses.dataclass(frozen=True)
class Row:
    """One (point, metric) of a comparison. `change` is signed so that positive means better."""

    point: str
    metric: str
    better: str
    verdict: str
    current: float | None = None  # median over repeats
    baseline: float | None = None
    change: float | None = None
    noise: float | None = None
    tolerance: float | None = None
    error: str | None = None  # the run's error for this point, if it has one


def check_record(record: object, source: str = "record") -> dict:
    """Reject anything that is not a schema-1 record, naming the problem."""
    if not isinstance(record, dict) or not isinstance(record.get("points"), dict):
        raise ValueError(f"{source}: not a nightly run record (no 'points' table)")
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{source}: schema {record.get('schema')!r}, expected {SCHEMA}")
    return record


def spread(values: list[float]) -> float:
    """Relative noise of repeats: 1.4826*MAD/median, robust to one outlier repeat."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    if med == 0:
        return 0.0
    mad = statistics.median(abs(v - med) for v in values)
    return MAD_TO_SIGMA * mad / abs(med)


def relative_change(current: float, baseline: float, better: str) -> float:
    """(current - baseline) / baseline, negated for lower-is-better metrics so positive is always better."""
    if baseline == 0:
        delta = 0.0 if current == 0 else math.copysign(math.inf, current)
    else:
        delta = (current - baseline) / abs(baseline)
    return delta if better == "higher" else -delta


def compare_metric(point: str, metric: str, current: list[float], baseline: list[float], better: str,
                   rel: float = DEFAULT_REL, noise_k: float = DEFAULT_NOISE_K) -> Row:
    cur, base = statistics.median(current), statistics.median(baseline)
    change = relative_change(cur, base, better)
    noise = max(spread(current), spread(baseline))
    tolerance = max(rel, noise_k * noise)
    verdict = "regression" if change < -tolerance else "improvement" if change > tolerance else "same"
    return Row(point, metric, better, verdict, cur, base, change, noise, tolerance)


def _metrics(point: dict) -> dict[str, dict]:
    """The metrics of a point that have at least one value."""
    return {m: v for m, v in (point.get("metrics") or {}).items() if v.get("values")}


def compare(run: dict, baseline: dict, rel: float | None = None, noise_k: float | None = None) -> list[Row]:
    """Every (point, metric) of either record with its verdict; thresholds default to the run's own."""
    threshold = run.get("threshold") or {}
    rel = threshold.get("rel", DEFAULT_REL) if rel is None else rel
    noise_k = threshold.get("noise_k", DEFAULT_NOISE_K) if noise_k is None else noise_k
    rows = []
    run_points, base_points = run["points"], baseline["points"]
    for pid in [*run_points, *(p for p in base_points if p not in run_points)]:
        cur, base = run_points.get(pid, {}), base_points.get(pid, {})
        cur_m, base_m = _metrics(cur), _metrics(base)
        error = cur.get("error")
        for metric in [*cur_m, *(m for m in base_m if m not in cur_m)]:
            if metric not in base_m:
                v = cur_m[metric]["values"]
                rows.append(Row(pid, metric, cur_m[metric]["better"], "new", current=statistics.median(v),
                                noise=spread(v), error=error))
            elif metric not in cur_m:
                v = base_m[metric]["values"]
                rows.append(Row(pid, metric, base_m[metric]["better"], "missing", baseline=statistics.median(v),
                                noise=spread(v), error=error))
            else:
                row = compare_metric(pid, metric, cur_m[metric]["values"], base_m[metric]["values"],
                                     cur_m[metric]["better"], rel, noise_k)
                rows.append(dataclasses.replace(row, error=error))
    return rows


def regressions(comparison: list[Row]) -> list[Row]:
    return [r for r in comparison if r.verdict == "regression"]


def failures(run: dict) -> dict[str, str]:
    """Points of the run that errored (skipped ones excluded): point id -> error."""
    return {pid: p["error"] for pid, p in run["points"].items()
            if p.get("error") and not p["error"].startswith(SKIPPED_PREFIX)}


def point_verdict(rows: list[Row]) -> str:
    """The worst verdict among a point's rows, in VERDICT_ORDER."""
    return min((r.verdict for r in rows), key=VERDICT_ORDER.index, default="same")
