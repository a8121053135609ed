"""bench_mla_decode's target check: the best of our providers per point against FlashMLA BF16 (on the issue's
128-head, batch >= 16, context >= 4k points only), the fastest upstream FP8 path and the roofline."""
import pytest
from repo_scripts import load_script

bench = load_script("benchmark/kernels/bench_mla_decode.py")


def row(provider, batch, ctx, heads, us, roof=0.5):
    return {"provider": provider, "batch": batch, "context": ctx, "heads": heads, "q_len": 1, "latency_us": us,
            "roofline_frac": roof}


def test_targets_take_the_best_of_ours_and_the_fastest_upstream_fp8():
    rows = [row("ours-cuda", 64, 4096, 128, 200.0, 0.3), row("ours-cuda-v2", 64, 4096, 128, 100.0, 0.75),
            row("flashmla-bf16", 64, 4096, 128, 170.0), row("flashmla-fp8", 64, 4096, 128, 120.0),
            row("sglang-triton-fp8", 64, 4096, 128, 90.0),
            # batch 1 and 16 heads: outside the 1.6x target's points, inside the other two
            row("ours-cuda", 1, 4096, 128, 30.0, 0.2), row("flashmla-bf16", 1, 4096, 128, 60.0),
            row("flashmla-fp8", 1, 4096, 128, 20.0),
            row("ours-cuda", 64, 4096, 16, 50.0, 0.9), row("flashmla-bf16", 64, 4096, 16, 40.0)]
    t = bench.issue_targets(rows)
    rep = next(p for p in t["per_point"] if (p["batch"], p["heads"]) == (64, 128))
    assert rep["best_ours"] == "ours-cuda-v2" and rep["fastest_upstream_fp8"] == "sglang-triton-fp8"
    assert rep["vs_flashmla_bf16"] == 1.7 and rep["vs_fastest_upstream_fp8"] == 0.9
    c = t["checks"]
    assert (c["vs_flashmla_bf16_h128_b16_ctx4k"]["points"], c["vs_flashmla_bf16_h128_b16_ctx4k"]["met"]) == (1, 1)
    # upstream FP8 at two points (none at 16 heads): 0.9x and 20/30
    assert (c["vs_fastest_upstream_fp8"]["points"], c["vs_fastest_upstream_fp8"]["met"]) == (2, 0)
    assert (c["roofline"]["points"], c["roofline"]["met"]) == (3, 2)
    assert len(t["summary"]) == 3 and "1 of 1" in t["summary"][0]


def test_fp8_triton_provider_is_listed_and_parsed():
    assert "sglang-triton-fp8" in bench.PROVIDER_NAMES and "sglang-triton-fp8" in bench.DEFAULT_PROVIDERS
    assert "ours-cuda-v2" in bench.DEFAULT_PROVIDERS  # the backend's kernel from batch 16
    args = bench.parse_args(["--providers", "ours-cuda", "sglang-triton-fp8", "--deadline-s", "30"])
    assert args.providers == ["ours-cuda", "sglang-triton-fp8"] and args.deadline_s == 30


def test_split_sweep_rows_stay_out_of_the_targets_and_compare_with_the_plan():
    plan = dict(row("ours-cuda-v2", 1, 16384, 128, 40.0), num_splits=64)
    rows = [plan, dict(row("sweep:ours-cuda-v2[s16]", 1, 16384, 128, 30.0), num_splits=16),
            dict(row("sweep:ours-cuda-v2[s64]", 1, 16384, 128, 41.0), num_splits=64),
            row("flashmla-bf16", 1, 16384, 128, 45.0),
            # a point without sweep rows is not in the sweep
            dict(row("ours-cuda-v2", 64, 4096, 128, 150.0), num_splits=1)]
    t = bench.issue_targets(rows)
    p = next(p for p in t["per_point"] if p["batch"] == 1)
    assert p["best_ours"] == "ours-cuda-v2" and p["ours_us"] == 40.0  # the 30 us sweep row is not "ours"
    (sw,) = bench.split_sweep(rows)
    assert (sw["planned_splits"], sw["planned_us"], sw["best_splits"], sw["best_us"]) == (64, 40.0, 16, 30.0)
    assert sw["us_by_splits"]["16"] == 30.0 and sw["provider"] == "ours-cuda-v2"
    assert bench.parse_args(["--cuda-splits", "8", "16"]).cuda_splits == [8, 16]
    for bad in ("0", "65"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--cuda-splits", bad])


def test_fused_combine_providers_build_version_3_with_the_option():
    assert {"ours-cuda-v3-fc", "ours-cuda-v3-fc-graph"} <= set(bench.PROVIDER_NAMES)
    assert bench.parse_args(["--providers", "ours-cuda-v3-fc-graph"]).providers == ["ours-cuda-v3-fc-graph"]
    assert bench.cu_design_options("ours-cuda-v3-fc-graph") == ("MLA_V3_FUSED_COMBINE",)
    assert bench.cuda_version("ours-cuda-v3-fc") == 3 and bench.cu_design_options("ours-cuda-v3-graph") == ()
    from sgl_kernel_ext import mla_decode_cuda as cu
    assert bench.cu_design_options("ours-cuda-v3-fc") == cu.V3_DESIGN_OPTIONS  # the bench names the kernel's option
