"""One way for a kernel bench to check an issue's numeric target over its points (bench_mla_decode,
bench_grouped_gemm): how many points meet the bound, their range, and the one line the run prints and records."""
from __future__ import annotations


def check(name: str, values, bound: float) -> dict:
    """`values`: one ratio or fraction per point (None: not measured there, left out); met means >= bound."""
    vals = [v for v in values if v is not None]
    met = sum(v >= bound for v in vals)
    line = (f"target {name}: {met} of {len(vals)} points"
            + (f" (range {min(vals):.2f}-{max(vals):.2f}, need >= {bound})" if vals else ""))
    return {"points": len(vals), "met": met, "min": min(vals, default=None), "max": max(vals, default=None),
            "bound": bound, "line": line}
