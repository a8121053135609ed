"""The statistics of A/B runs inside one server: for paired runs (observation overhead, MHA/MLA TTFT) the mean of
per-pair ratios with a Student-t 95% interval, since there are only a handful of pairs; for two samples of step
times (EPLB: during a move, before it) a bootstrap 95% interval of the ratio of their quantiles."""
from __future__ import annotations

import math
import statistics

import numpy as np

# two-sided 95% Student t quantiles, df 1..30 (normal beyond)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else 1.96


def mean_ci95(values: list[float]) -> dict:
    """n, mean, and (from 2 values on) sd and the t 95% interval of the mean; mean None when empty."""
    out: dict = {"n": len(values), "values": list(values)}
    if not values:
        return {**out, "mean": None}
    mean = statistics.fmean(values)
    out["mean"] = mean
    if len(values) >= 2:
        sd = statistics.stdev(values)
        half = t975(len(values) - 1) * sd / math.sqrt(len(values))
        out.update(sd=sd, ci95=[mean - half, mean + half])
    return out


def rank_index(n: int, q: float) -> int:
    """Index of the q-quantile by nearest rank among n sorted values (a p99 of 400 values is the 5th largest: 396
    of them are at or below it)."""
    return min(n - 1, max(0, int(math.ceil(q * n)) - 1))


def nearest_rank(xs, q: float) -> float:
    """The q-quantile of xs by nearest rank, as the server logs it."""
    return float(np.sort(np.asarray(xs, dtype=float))[rank_index(len(xs), q)])


def quantile_ratio_ci95(a, b, q: float = 0.99, reps: int = 2000, seed: int = 0) -> dict:
    """quantile_q(a) / quantile_q(b) and its percentile-bootstrap 95% interval (a and b resampled apart)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not len(a) or not len(b):
        return {"n": [len(a), len(b)], "ratio": None}
    rng = np.random.default_rng(seed)
    boot = [np.sort(rng.choice(x, size=(reps, len(x))), axis=1)[:, rank_index(len(x), q)] for x in (a, b)]
    lo, hi = np.percentile(boot[0] / boot[1], [2.5, 97.5])
    return {"n": [len(a), len(b)], "ratio": nearest_rank(a, q) / nearest_rank(b, q), "ci95": [float(lo), float(hi)]}
