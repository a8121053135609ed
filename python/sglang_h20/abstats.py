"""The statistics of paired A/B runs inside one server (observation overhead, MHA/MLA TTFT): the mean
of per-pair ratios with a Student-t 95% interval, since there are only a handful of pairs."""
from __future__ import annotations

import math
import statistics

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
