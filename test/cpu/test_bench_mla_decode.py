"""bench_mla_decode's target check: the best of our providers per point against FlashMLA BF16 (on the issue's
128-head, batch >= 16, context >= 4k points only), the fastest upstream FP8 path and the roofline."""
import pytest
from repo_scripts import load_script, stored_record

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


CEIL = {"fp8_flops": 1.2e15, "bf16_flops": 0.6e15, "copy_bytes_per_s": 4.3e12}


def test_h20_model_stretches_only_the_tensor_time():
    """FLOPs 60e9: 50 us at the FP8 rate, 100 us at BF16. Ours at 150 us (FP8): 100 us of CUDA-core work kept
    serial (pessimistic) or hidden; FlashMLA BF16 at 120 us: 100 us of tensor time, its rest hidden."""
    k = bench.H20_TENSOR_SLOWDOWN
    assert 3.9 < k < 4.0  # per-SM spec ratio, H200 FP8 1979 TF on 132 SMs against H20 296 TF on 78
    ours = dict(row("ours-cuda-v2", 64, 4096, 128, 150.0), flops=60e9, bytes=1e6, precision="fp8")
    fl16 = dict(row("flashmla-bf16", 64, 4096, 128, 120.0), flops=60e9, bytes=1e6, precision="bf16")
    fl8 = dict(fl16, provider="flashmla-fp8", precision="fp8")  # FP8 KV, BF16 arithmetic
    assert bench.h20_scaled_us(ours, CEIL, hidden=False) == pytest.approx(100 + 50 * k)
    assert bench.h20_scaled_us(ours, CEIL, hidden=True) == pytest.approx(50 * k)
    assert bench.h20_scaled_us(fl16, CEIL, hidden=True) == pytest.approx(100 * k)
    assert bench.h20_scaled_us(fl8, CEIL, hidden=True) == bench.h20_scaled_us(fl16, CEIL, hidden=True)
    triton_ours = dict(ours, provider="ours", pv_16bit=True)  # QK^T 60e9 * 576/1088 at FP8, PV at BF16
    t_tc = 60e9 * (576 / 1.2e15 + 512 / 0.6e15) / 1088 * 1e6
    assert bench.h20_scaled_us(triton_ours, CEIL, hidden=True) == pytest.approx(t_tc * k)
    slow_hbm = dict(ours, bytes=4e9)  # 1000 us at 4.0 TB/s: the H20's bandwidth floors the model
    assert bench.h20_scaled_us(slow_hbm, CEIL, hidden=True) == pytest.approx(1000.0)
    t = bench.issue_targets([ours, fl16], CEIL)
    p = t["per_point"][0]
    assert p["h20_modelled_vs_flashmla_bf16"] == pytest.approx(100 * k / (100 + 50 * k))
    assert "h20_modelled_vs_flashmla_bf16_if_hidden" not in p  # with both compute-bound it was the peak ratio
    c = t["checks"]["h20_modelled_vs_flashmla_bf16_h128_b16_ctx4k"]
    assert (c["points"], c["met"]) == (1, 0) and "MODELLED" in c["line"]
    assert "h20_modelled_vs_flashmla_bf16_h128_b16_ctx4k" not in bench.issue_targets([ours, fl16])["checks"]


def test_retarget_recomputes_a_record_without_a_gpu(tmp_path, capsys):
    import json
    ours = dict(row("ours-cuda-v2", 64, 4096, 128, 150.0), flops=60e9, bytes=1e6, precision="fp8")
    fl16 = dict(row("flashmla-bf16", 64, 4096, 128, 120.0), flops=60e9, bytes=1e6, precision="bf16")
    src = tmp_path / "old.json"
    src.write_text(json.dumps({"points": [ours, fl16], "ceilings": CEIL, "targets": {"stale": True}}))
    out = tmp_path / "new.json"
    assert bench.main(["--retarget", str(src), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert "stale" not in rec["targets"] and "points" not in rec and rec["retargeted"]["from"] == str(src)
    assert rec["ceilings"] == CEIL and rec["targets"]["per_point"][0]["best_ours"] == "ours-cuda-v2"
    assert "MODELLED" in capsys.readouterr().out


def test_cuda_options_are_checked_against_the_kernels_design_options():
    args = bench.parse_args(["--providers", "ours-cuda-v2-graph", "--cuda-options", "MLA_EAGER_RESCALE"])
    assert args.cuda_options == ["MLA_EAGER_RESCALE"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--cuda-options", "MLA_NOT_AN_OPTION"])


def test_roofline_counts_kv_bytes_only_and_a_failed_ours_is_a_miss():
    """The issue's roofline: FLOPs at the measured rate against KV bytes at the copy bandwidth (not Q and O too),
    recomputed from older rows' bytes per token; a point where upstream ran and ours did not counts as missed."""
    mem = dict(row("ours-cuda-v2", 1, 16384, 16, 10.0, roof=0.99), flops=1e6, bytes=20_000_000,
               bytes_per_token=584, precision="fp8")  # memory-bound: 9.57 MB of KV at 4.3 TB/s = 2.23 us
    fl = row("flashmla-bf16", 1, 16384, 16, 8.0)
    gone = row("flashmla-fp8", 16, 4096, 128, 50.0)  # ours failed at this point
    t = bench.issue_targets([mem, fl, gone], CEIL)
    p = {(q["batch"], q["heads"]): q for q in t["per_point"]}
    assert p[(1, 16)]["roofline_frac"] == pytest.approx(16384 * 584 / 4.3e12 / 10e-6)  # not 0.99, not 20 MB
    assert bench.kv_roofline_frac(mem, None) == 0.99  # no ceilings: the row's own
    miss = p[(16, 128)]
    assert miss["best_ours"] is None and miss["vs_fastest_upstream_fp8"] == 0.0 and miss["roofline_frac"] == 0.0
    c = t["checks"]
    assert (c["vs_fastest_upstream_fp8"]["points"], c["vs_fastest_upstream_fp8"]["met"]) == (1, 0)
    assert (c["roofline"]["points"], c["roofline"]["met"]) == (2, 0)
    assert bench.issue_targets([fl, gone])["per_point"] == []  # no ours in the run at all: nothing to count


def test_point_metrics_worked_values_and_the_committed_grids():
    """The per-point figures every target reads (rates, roofline fraction, H20-modelled time): a worked point, then
    every row of the stored H200 runs recomputed from its time and format, equal to what the run wrote."""
    assert bench.decode_flops(1, 1024, 16, 1) == 2 * 16 * 1024 * 1088
    assert bench.decode_flops(2, 1024, 16, 2) == 2 * 16 * (1023 + 1024) * 2 * 1088  # MTP: causal within the call
    assert bench.decode_flops(1, 1, 16, 2) == 2 * 16 * 1 * 1088  # the first query of two sees no key yet
    ceilings = {"copy_bytes_per_s": 1e12, "fp8_flops": 1e15, "bf16_flops": 5e14}
    fp8 = bench.point_metrics("flashmla-fp8", (2, 1024, 128, 1), 100.0, {"bytes_per_token": 656, "precision": "fp8"},
                              ceilings)
    flops, kv = 2 * 128 * 2048 * 1088, 2 * 1024 * 656
    assert fp8 == pytest.approx({
        "latency_us": 100.0, "tflops": flops / 1e-4 / 1e12, "gbps": (kv + 2 * 128 * (576 + 1024)) / 1e-4 / 1e9,
        "roofline_frac": kv / 1e12 / 1e-4, "bound": "memory", "flops": flops, "bytes": kv + 2 * 128 * (576 + 1024),
        "kv_bytes": kv, "h20_modelled_us": flops / 296e12 * 1e6}, rel=1e-12)
    bf16 = bench.point_metrics("flashmla-bf16", (2, 1024, 128, 1), 10.0, {"bytes_per_token": 1152,
                                                                         "precision": "bf16"},
                              {**ceilings, "copy_bytes_per_s": 1e13})  # KV 0.24 us at this copy rate, FLOPs 1.14
    assert bf16["bytes"] == 2 * 1024 * 1152 + 2 * 128 * (1152 + 1024)  # a bf16 Q: two bytes per element
    assert bf16["bound"] == "compute" and bf16["roofline_frac"] == pytest.approx(flops / 5e14 / 1e-5, rel=1e-12)
    assert bf16["h20_modelled_us"] == pytest.approx(flops / 148e12 * 1e6, rel=1e-12)
    runs = {"mla_decode_full_grid_s49_h200.json.xz": 384, "mla_decode_h128_b2_b8_s49_h200.json.xz": 90,
            "mla_split_sweep_h128_b1_b8_s50_h200.json": 208}
    for name, rows in runs.items():
        rec = stored_record(f"mla_decode/{name}")
        assert len(rec["points"]) == rows
        for r in rec["points"]:
            got = bench.point_metrics(r["provider"], (r["batch"], r["context"], r["heads"], r["q_len"]),
                                      r["latency_us"], r, rec["ceilings"])
            assert got == pytest.approx({k: r[k] for k in got}, rel=1e-12), (name, r["provider"], r["batch"])
