"""prefill_profile.py's trace summary: per-prefill kernel totals, top lists and the MHA - MLA difference,
on a synthetic Chrome trace (the format torch.profiler writes)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from repo_scripts import load_script

bench = load_script("benchmark/serving/prefill_profile.py")


def _trace(path: Path, kernels: dict[str, float], cpu: dict[str, float]) -> Path:
    ev = [{"ph": "X", "cat": "kernel", "name": n, "ts": 0, "dur": us} for n, us in kernels.items()]
    ev += [{"ph": "X", "cat": "cpu_op", "name": n, "ts": 0, "dur": us} for n, us in cpu.items()]
    ev += [{"ph": "i", "cat": "kernel", "name": "instant, no duration"}, {"ph": "X", "cat": "gpu_memcpy",
                                                                          "name": "Memcpy HtoD", "dur": 9e9}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path


def test_summary_is_per_prefill_and_the_difference_finds_the_extra_kernel(tmp_path):
    mla = bench.summarize(bench.load_trace(_trace(tmp_path / "mla.json.gz", {"mla_paged": 4000.0, "gemm": 2000.0},
                                                  {"aten::bmm": 300.0})), requests=2)
    mha = bench.summarize(bench.load_trace(_trace(tmp_path / "mha.json.gz", {"ragged_prefill": 1000.0, "gemm": 2000.0,
                                                                             "fp8_gemm_kv_b": 6000.0},
                                                  {"plan": 1600.0})), requests=2)
    assert mla["gpu_kernel_ms_per_prefill"] == pytest.approx(3.0)  # (4 + 2) ms over 2 prefills; memcpy not a kernel
    assert mha["gpu_kernel_ms_per_prefill"] == pytest.approx(4.5)
    assert mha["kernels"][0] == {"name": "fp8_gemm_kv_b", "ms_per_prefill": pytest.approx(3.0)}
    assert mha["cpu_ops"] == [{"name": "plan", "ms_per_prefill": pytest.approx(0.8)}]
    diff = bench.compare(mla, mha)
    assert [r["name"] for r in diff[:2]] == ["fp8_gemm_kv_b", "mla_paged"]
    assert diff[0]["diff_ms"] == pytest.approx(3.0) and diff[1]["diff_ms"] == pytest.approx(-2.0)
    assert {r["name"]: r["diff_ms"] for r in diff}["gemm"] == 0.0
