"""One way for a kernel bench to check an issue's numeric target over its points (bench_mla_decode,
bench_grouped_gemm): how many points meet the bound, their range, and the one line the run prints and records."""
from __future__ import annotations

# A ratio divided out of rounded floats can land a hair under a bound it meets exactly (the H20 model's 1.5 at 8
# experts x 32 tokens is 33822867456 / 22548578304 issued FLOPs, computed as 1.4999999999999998): within this
# relative distance a value counts as on the bound.
REL_TOL = 1e-9


def check(name: str, values, bound: float) -> dict:
    """`values`: one ratio or fraction per point (None: not measured there, left out); met means >= bound, within
    REL_TOL."""
    vals = [v for v in values if v is not None]
    met = sum(v >= bound * (1 - REL_TOL) for v in vals)
    line = (f"target {name}: {met} of {len(vals)} points"
            + (f" (range {min(vals):.2f}-{max(vals):.2f}, need >= {bound})" if vals else ""))
    return {"points": len(vals), "met": met, "min": min(vals, default=None), "max": max(vals, default=None),
            "bound": bound, "line": line}
