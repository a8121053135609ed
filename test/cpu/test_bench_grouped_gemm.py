"""bench_grouped_gemm's tune grid: every walk is in it, --tune-walks and --tune-where keep exactly what they name;
the size-matched read ceiling annotates the MoE points of each weight size."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import bench_grouped_gemm as bench  # noqa: E402
from repo_scripts import stored_record  # noqa: E402


def test_tune_walks_filter_the_grid():
    for variant, grid in bench.TUNE_GRID.items():
        tma = bench.tune_grid(variant, ["tma"])
        ws = bench.tune_grid(variant, ["ws"])
        plain_flat = bench.tune_grid(variant, ["plain", "flat"])
        assert tma and all(c["flat"] and c["tma"] and not c.get("ws") for c in tma)
        assert ws and all(c["ws"] and not c["flat"] and not c.get("tma") for c in ws)
        assert plain_flat and not any(c.get("tma") or c.get("ws") for c in plain_flat)
        assert len(tma) + len(ws) + len(plain_flat) == len(grid) == 4 * len(tma)
        assert {bench.walk_of(c) for c in grid} == set(bench.WALKS)
        # a trial overrides the shipped config key by key: every walk sets all three switches, so a shipped
        # "tma": True cannot leak into a "flat" or "plain" trial
        assert all({"flat", "tma", "ws"} <= set(c) for c in grid)
    assert bench.parse_args(["--tune", "--tune-walks", "tma"]).tune_walks == ["tma"]
    assert bench.parse_args(["--tune"]).tune_walks == ["plain", "flat", "tma"]  # ws only when named


def test_tune_variants_names_the_variants_a_tune_sweeps():
    both = bench.parse_args(["--tune"])
    assert bench.sweeps(both, "swapab") and bench.sweeps(both, "normal")
    normal = bench.parse_args(["--tune", "--tune-variants", "normal"])
    assert bench.sweeps(normal, "normal") and not bench.sweeps(normal, "swapab")
    assert not bench.sweeps(bench.parse_args(["--tune-variants", "normal"]), "normal")  # no --tune, no sweep
    with pytest.raises(SystemExit):
        bench.parse_args(["--tune-variants", "split"])


def test_tune_where_restricts_the_grid():
    args = bench.parse_args(["--tune", "--tune-where", "BLOCK_N=128", "num_stages=4,5", "programs_per_sm=2"])
    where = dict(args.tune_where)
    assert where == {"BLOCK_N": {128}, "num_stages": {4, 5}, "programs_per_sm": {2}}
    grid = bench.tune_grid("swapab", ["plain", "flat", "tma", "ws"], where)
    full = bench.tune_grid("swapab", ["plain", "flat", "tma", "ws"])
    assert grid and len(grid) < len(full)
    assert all(c["BLOCK_N"] == 128 and c["num_stages"] in (4, 5) and c["programs_per_sm"] == 2 for c in grid)
    assert len(grid) == sum(c["BLOCK_N"] == 128 and c["num_stages"] in (4, 5) and c["programs_per_sm"] == 2
                            for c in full)
    with pytest.raises(ValueError, match="not a tile-config key"):
        bench.tune_grid("swapab", ["plain"], {"BLOCK_K": {128}})
    for bad in ("BLOCK_N", "BLOCK_N=", "=4", "num_stages=four"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tune-where", bad])


def test_size_matched_read_annotates_each_weight_size(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "measure_peak_read", lambda rep_ms, nbytes: calls.append(nbytes) or
                        {"peak_read_tbs": 2.0 if nbytes < 200 else 4.0})
    pts = [{"kind": "moe", "weight_bytes": 100, "weight_tbs": 1.0}, {"kind": "moe", "weight_bytes": 300,
                                                                       "weight_tbs": 3.0},
           {"kind": "moe", "weight_bytes": 100, "weight_tbs": 1.5}, {"kind": "dense", "weight_bytes": 7,
                                                                       "weight_tbs": 1.0}]
    peak = {"peak_read_tbs": 4.5}
    bench.annotate_size_matched(pts, peak, 10)
    assert calls == [100, 300] and peak["size_matched_tbs"] == {"100": 2.0, "300": 4.0}
    assert [p.get("frac_of_size_matched") for p in pts] == [0.5, 0.75, 0.75, None]


def test_partial_record_keeps_what_was_measured_and_names_the_representative():
    """The checkpoint written after every point (a run killed by its caller still leaves its JSON)."""
    args = bench.parse_args(["--quick"])
    pts = [{"provider": "deepgemm", "us": 9.0, "tflops": 1.0, "shape": "down"},
           {"provider": "ours-swapab", "us": 5.0, "tflops": 2.0, "shape": "gate_up", "groups": 32,
            "tokens_per_group": 8, "distribution": "uniform", "layout": "masked"}]
    rec = bench.result_record(args, pts, {"peak_read_tbs": 4.5}, {}, ["down g256 m8 uniform"], partial=True)
    assert rec["partial"] and rec["not_started"] == ["down g256 m8 uniform"] and rec["points"] == pts
    assert rec["representative"]["provider"] == "ours-swapab" and rec["latency_us"] == 5.0
    assert rec["provenance"]["git_commit"]
    assert rec["ours_not_timed"] == []  # no MoE point (no "kind"): nothing to say


def test_a_record_names_the_variants_of_ours_it_did_not_time(capsys):
    """Session 49's grid passed --providers without ours-split, so its "best of ours" was without the variant that
    won 30 of session 44's 52 points; the record and the printed targets now say so. A dense point does not stand for
    the MoE variant of the same name."""
    pts = [{"kind": "moe", "provider": "ours-swapab"}, {"kind": "moe", "provider": "deepgemm"},
           {"kind": "dense", "provider": "ours-normal"}]
    assert bench.ours_not_timed(pts) == ["ours-normal", "ours-split"]
    assert bench.ours_not_timed(pts + [{"kind": "moe", "provider": v} for v in ("ours-normal", "ours-split")]) == []
    args = bench.parse_args(["--quick"])
    moe = [{"kind": "moe", "provider": "ours-swapab", "us": 5.0, "tflops": 2.0, "shape": "gate_up", "n": 4096,
            "k": 7168, "groups": 32, "tokens_per_group": 8, "distribution": "uniform", "layout": "masked"}]
    rec = bench.result_record(args, moe, {"peak_read_tbs": 4.5}, {}, [], partial=False)
    assert rec["ours_not_timed"] == ["ours-normal", "ours-split"]


def test_table_from_an_unreadable_file_exits_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit, match=f"^bench_grouped_gemm: --table-from {bad}: cannot read JSON"):
        bench.main(["--table-from", str(bad), "--table-out", str(tmp_path / "t.json")])
    (tmp_path / "empty.json").write_text('{"points": []}')
    with pytest.raises(SystemExit, match="no measured points"):
        bench.main(["--table-from", str(tmp_path / "empty.json"), "--table-out", str(tmp_path / "t.json")])


def test_dense_split_k_candidates_divide_k_and_keep_four_blocks():
    assert bench.dense_split_ks(56, 8) == [4, 8]  # qkv_a K=7168: auto 8, 16 does not divide 56
    assert bench.dense_split_ks(12, 3) == [1, 3]  # q_b K=1536: 6 would leave 2 blocks per slice
    assert bench.dense_split_ks(128, 1) == [1, 2]
    for kb, auto in ((16, 2), (128, 16), (56, 7)):
        assert all(kb % d == 0 and kb // d >= 4 for d in bench.dense_split_ks(kb, auto))


def test_dense_configs_and_the_precompile_worker(monkeypatch):
    """The configs one dense point times (default first; --tune adds the grid x k-slices, each valid), and the
    precompile worker: runs each job once, reports a failing config instead of raising."""
    assert bench.dense_configs("swapab", 8, 2112, 7168, False, 132) == [None]
    tuned = bench.dense_configs("swapab", 8, 2112, 7168, True, 132)
    assert tuned[0] is None and len(tuned) > len(bench.DENSE_TUNE["swapab"])
    assert all(56 % c["split_k"] == 0 for c in tuned[1:])
    monkeypatch.setitem(bench.DENSE_SHAPES, "tiny", (128, 256))
    failed = bench._compile_dense([("tiny", 2, "swapab", None), ("tiny", 2, "swapab", {"BLOCK_N": 96})])
    assert len(failed) == 1 and "BLOCK_N" in failed[0] and "tiny m=2 swapab" in failed[0]


def test_the_serial_reduce_retry_comes_once_and_only_after_a_split_k_best():
    """The retry is read lazily after the grid, and a losing retry ends the sweep (it once looped to the deadline)."""
    grid = [None, {"BLOCK_N": 64, "split_k": 4}]
    best = {"BLOCK_N": 64, "BLOCK_T": 32, "split_k": 4, "serial_reduce": False, "num_stages": 4}
    state = {"best": None}
    order = bench.with_serial_reduce_retry(grid, lambda: state["best"])
    assert [next(order), next(order)] == grid
    state["best"] = best  # what the timing loop found meanwhile
    retry = list(order)
    assert retry == [{**best, "serial_reduce": True}]
    assert list(bench.with_serial_reduce_retry(grid, lambda: {**best, "split_k": 1})) == grid
    assert list(bench.with_serial_reduce_retry(grid, lambda: {**best, "serial_reduce": True})) == grid
    assert list(bench.with_serial_reduce_retry(grid, lambda: None)) == grid


def test_tune_keeps_no_config_whose_output_is_wrong(capsys):
    """A faster but wrong config (a walk or tile shape with a bug) must never reach a table: --tune takes a new best
    only within TUNE_ERR_BOUND of float32, and the trial records why it was not kept."""
    import torch

    from sgl_kernel_ext.quant import per_block_quant_fp8, per_token_group_quant_fp8

    g = torch.Generator().manual_seed(5)
    a, a_s = per_token_group_quant_fp8(torch.randn(4, 256, generator=g))
    b, b_s = per_block_quant_fp8(torch.randn(128, 256, generator=g))
    ref = bench.reference(a, a_s, b, b_s)
    assert bench.rel_err_to(ref.to(torch.bfloat16), ref) < 1e-2  # bf16 rounding only
    trials = [{"config": {"BLOCK_N": 64}, "us": 1.0}]
    assert not bench.rejects(trials, bench.rel_err_to(ref.to(torch.bfloat16), ref)) and not bench.rejects(trials, None)
    assert "rejected_rel_err" not in trials[-1]
    wrong = ref.clone()
    wrong[:, :64] = 0  # half a tile never written
    assert bench.rejects(trials, bench.rel_err_to(wrong, ref))
    assert trials[-1]["rejected_rel_err"] > bench.TUNE_ERR_BOUND
    assert "not kept" in capsys.readouterr().err


def test_a_later_run_replaces_the_shapes_it_measured_and_keeps_the_rest(tmp_path, capsys):
    """--table-from A B: at a key B measured, A's points are gone (no entry weighs ours from one run against
    upstream from another); A's other keys stay; what B did not measure there is printed and recorded."""
    import json

    def pt(provider, m, us, layout="masked", dist="uniform"):
        return {"kind": "moe", "n": 4096, "k": 7168, "groups": 8, "tokens_per_group": m, "provider": provider,
                "layout": layout, "distribution": dist, "us": us}
    old = [pt("deepgemm", 64, 10.0), pt("ours-swapab", 64, 12.0), pt("ours-normal", 64, 11.0),
           pt("deepgemm", 64, 10.0, dist="uneven"), pt("ours-normal", 64, 11.0, dist="uneven"),
           pt("deepgemm", 8, 10.0), pt("ours-swapab", 8, 7.0)]
    new = [pt("deepgemm", 64, 10.5), pt("ours-normal", 64, 9.5)]  # a retune at m=64, uniform draw only
    for name, pts in (("a.json", old), ("b.json", new)):
        (tmp_path / name).write_text(json.dumps({"points": pts, "provenance": {"gpu": "NVIDIA H200"}}))
    merged = bench.merged_results([tmp_path / "a.json", tmp_path / "b.json"])
    assert sorted((p["tokens_per_group"], p["provider"], p["us"]) for p in merged["points"]) == [
        (8, "deepgemm", 10.0), (8, "ours-swapab", 7.0), (64, "deepgemm", 10.5), (64, "ours-normal", 9.5)]
    assert [m["file"] for m in merged["merged_from"]] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    lost = ["deepgemm/masked/uneven", "ours-normal/masked/uneven", "ours-swapab/masked/uniform"]
    assert merged["merged_from"][0]["replaced_without"] == {}
    assert merged["merged_from"][1]["replaced_without"] == {"moe 4096 7168 8 64": lost}
    err = capsys.readouterr().err
    assert "b.json replaces ('moe', 4096, 7168, 8, 64) without " + ", ".join(lost) in err and "8, 8)" not in err
    entries = {e["m"]: e for e in bench.table_entries(merged["points"])}
    assert entries[64]["best"] == "normal" and entries[64]["us"] == {"upstream": 10.5, "normal": 9.5}
    assert entries[8]["best"] == "swapab" and "us_uneven" not in entries[64]


def test_split_counts_each_group_under_the_variant_its_count_picks():
    """ours-split's issued tensor-core work (the H20 model's input): groups at or below split_at as swapAB tiles,
    the rest as normal tiles; the modelled time is at least the byte-bound time."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    counts, n, k, t = [0, 2, 16, 40], 4096, 7168, 16
    tiles, extra = bench.split_tiles(counts, n, k, len(counts), 15, t, "masked")
    sw = gg.resolve_config("swapab", None, 15, n, k, 4, "masked")[1]
    nm = gg.resolve_config("normal", None, 4 * t, n, k, 4, "masked")[1]
    assert tiles == (sw["BLOCK_T"], sw["BLOCK_N"]) and extra["tiles_split"]["normal"] == [nm["BLOCK_T"], nm["BLOCK_N"]]
    want = (bench.issued_flops([0, 2, 16, 0], n, k, sw["BLOCK_T"], sw["BLOCK_N"])
            + bench.issued_flops([0, 0, 0, 40], n, k, nm["BLOCK_T"], nm["BLOCK_N"]))
    assert extra["issued_flops"] == want > 2 * k * n * sum(counts)  # padding included
    assert extra["h20_modelled_us"] >= bench.traffic_bytes(counts, n, k)[1] / bench.H20_HBM_BPS * 1e6


def test_a_tune_into_the_user_table_keeps_the_shapes_it_did_not_measure(tmp_path, capsys):
    """--tune without --table-out writes this user's table, which the plugin reads instead of the shipped one: the
    entries of the table in force at keys the run did not measure stay (a re-tune of one shape must not send every
    other shape upstream); the run's own keys replace; a base from another GPU keeps nothing."""
    import json

    def pt(provider, m, us):
        return {"kind": "moe", "n": 4096, "k": 7168, "groups": 8, "tokens_per_group": m, "provider": provider,
                "layout": "masked", "distribution": "uniform", "us": us}
    result = {"points": [pt("deepgemm", 8, 10.0), pt("ours-swapab", 8, 7.0)],
              "provenance": {"gpu": "NVIDIA H200", "date": "2026-12-04"}}
    base_entry = lambda m, best: {"n": 4096, "k": 7168, "groups": 8, "m": m, "layout": "masked",  # noqa: E731
                                  "best": best, "us": {}}
    base = {"gpu": "NVIDIA H200", "date": "2026-11-29", "path": "/shipped.json",
            "entries": [base_entry(8, "upstream"), base_entry(64, "normal")]}
    out = tmp_path / "user.json"
    bench.write_table(result, out, None, base)
    table = json.loads(out.read_text())
    assert sorted((e["m"], e["best"]) for e in table["entries"]) == [(8, "swapab"), (64, "normal")]
    assert table["source"]["kept_from"] == {"path": "/shipped.json", "date": "2026-11-29", "entries": 1}
    assert table["rule"] == ("best = fastest of ours-swapab / ours-normal / ours-split / upstream (fastest of "
                             "deepgemm, sglang-triton, sglang-triton-swapab in that layout) on the uniform draw; ours "
                             "must also win the uneven draw where one was measured")
    assert "2 entries (1 kept from /shipped.json" in capsys.readouterr().out
    bench.write_table(result, out, None, {**base, "gpu": "NVIDIA H20"})
    table = json.loads(out.read_text())
    assert [(e["m"], e["best"]) for e in table["entries"]] == [(8, "swapab")] and "kept_from" not in table["source"]
    bench.write_table(result, out, None)  # --table-out FILE: this run's entries only
    assert [e["m"] for e in json.loads(out.read_text())["entries"]] == [8]


def test_the_uneven_draw_at_a_point_does_not_depend_on_the_rest_of_the_sweep():
    first = bench.uneven_counts(8, 32, 0)
    bench.uneven_counts(16, 24, 0)  # a run that swept another point first
    assert bench.uneven_counts(8, 32, 0) == first
    assert sum(first) == 8 * 32 and len(first) == 8 and max(first) > 32  # same total as uniform, uneven
    assert bench.uneven_counts(8, 32, 1) != first and bench.uneven_counts(8, 24, 0) != first


def test_a_point_that_does_not_fit_is_skipped_with_a_line_and_the_sweep_goes_on(monkeypatch, capsys):
    """Session 65's H100 run died at 256 experts x 256 uneven tokens (the masked layout pads to the hottest expert:
    13,366 tokens): the point is now an `unavailable` entry and a line, the points measured stay, the cache is freed
    once the failed point's tensors are released (its traceback holds them until the except clause ends), and any
    other error still propagates. A point that ran frees its own operands: no second free."""
    import weakref

    class Operands:
        pass
    held = []  # a weak reference to what the failed point held
    freed = []  # at each cache free: was the failed point's operand object still alive
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: freed.append(held[0]() is not None))
    unavailable = {"ours-cuda-masked": "every form failed"}
    assert bench.unless_out_of_memory("gate_up g8 m1 uniform", lambda: [{"us": 1.0}], unavailable) == [{"us": 1.0}]
    assert freed == []

    def too_big():
        ops = Operands()
        held.append(weakref.ref(ops))
        raise bench.torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 22.84 GiB.\nmore detail")
    assert bench.unless_out_of_memory("gate_up g256 m256 uneven", too_big, unavailable) == []
    assert freed == [False]
    assert unavailable == {"ours-cuda-masked": "every form failed", "gate_up g256 m256 uneven":
                           "out of GPU memory: CUDA out of memory. Tried to allocate 22.84 GiB."}
    assert "gate_up g256 m256 uneven: skipped, out of GPU memory" in capsys.readouterr().err
    assert max(bench.uneven_counts(256, 256, 0)) == 13366  # the count the docstring names

    def broken():
        raise RuntimeError("a bug, not memory")
    with pytest.raises(RuntimeError):
        bench.unless_out_of_memory("down g8 m1 uniform", broken, unavailable)
    assert freed == [False] and len(unavailable) == 2


def test_random_fp8_is_finite_signed_and_draws_as_before():
    """The in-place build draws the same values from the same seed as the out-of-place one it replaced (the bench and
    profile_grouped_gemm.py rebuild a point from its seed), every code finite and |x| <= 240, both signs present."""
    x = bench.random_fp8((64, 256), bench.torch.Generator().manual_seed(7), device="cpu")
    gen = bench.torch.Generator().manual_seed(7)
    bits = bench.torch.randint(0, 0x78, (64, 256), dtype=bench.torch.uint8, generator=gen)
    sign = bench.torch.randint(0, 2, (64, 256), dtype=bench.torch.uint8, generator=gen) << 7
    assert bench.torch.equal(x.view(bench.torch.uint8), bits | sign)
    f = x.float()
    assert x.dtype == bench.torch.float8_e4m3fn and bool(f.isfinite().all()) and float(f.abs().max()) == 240.0
    assert bool((f < 0).any()) and bool((f > 0).any())


def test_candidates_keep_every_checked_trial_and_the_fastest_right_one(monkeypatch, capsys):
    """Every provider's candidate loop goes through Candidates: a timed, checked trial is kept with its time and
    error; one whose call fails leaves no trial and a stderr line; one over the error bound is a trial marked
    rejected and never the best, even when fastest."""
    monkeypatch.setattr(bench, "bench_us", lambda fn, rep_ms: fn())
    errs = iter([1e-3, 2e-3, bench.TUNE_ERR_BOUND * 10])
    cands = bench.Candidates("ours-x", lambda out: next(errs), 10)
    cands.time({"a": 1}, lambda: ((lambda: 12.5), "out"), {"BLOCK_N": 64}, record_as="tiles a1")
    cands.time({"a": 2}, lambda: ((lambda: 10.0), "out"))

    def broken():
        raise RuntimeError("no launch")
    cands.time({"a": 3}, broken)
    cands.time({"a": 4}, lambda: ((lambda: 1.0), None))
    assert cands.best == (10.0, {"a": 2}, 2e-3)
    assert cands.trials[:2] == [{"config": {"a": 1}, "us": 12.5, "tiles": {"BLOCK_N": 64}, "rel_err": 1e-3},
                                {"config": {"a": 2}, "us": 10.0, "rel_err": 2e-3}]
    assert cands.trials[2]["config"] == {"a": 4} and cands.trials[2]["rejected_rel_err"] > bench.TUNE_ERR_BOUND
    assert len(cands.trials) == 3 and "ours-x {'a': 3}: RuntimeError: no launch" in capsys.readouterr().err


def test_ours_moe_call_runs_each_variant_on_its_layouts_operands(monkeypatch):
    """The bench and profile_grouped_gemm.py time the calls ours_moe_call builds: each layout's operands, an output
    of that layout's rows, the variant, config and expected m passed through; the CUDA kernel with its form."""
    import torch

    from sgl_kernel_ext import grouped_gemm_cuda as ggc
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    seen = []
    monkeypatch.setattr(gg, "m_grouped_fp8_gemm_nt_masked", lambda *a, **kw: seen.append(("masked", a, kw)))
    monkeypatch.setattr(gg, "m_grouped_fp8_gemm_nt_contiguous", lambda *a, **kw: seen.append(("contiguous", a, kw)))
    monkeypatch.setattr(ggc, "m_grouped_fp8_gemm_nt_cuda", lambda *a, **kw: seen.append(("cuda", a, kw)))
    t = lambda *shape: torch.zeros(*shape)  # noqa: E731
    ops = bench.MoeOperands(t(2, 256, 128), t(2, 2, 1), t(2, 5, 128), t(2, 5, 1), t(2), t(7, 128), t(7, 1), t(3))
    fn, out = bench.ours_moe_call(ops, "masked", "swapab", {"BLOCK_N": 64}, 4)
    fn()
    assert out.shape == (2, 5, 256) and out.dtype == torch.bfloat16
    kind, args, kw = seen[-1]
    assert kind == "masked" and args[0] is ops.a_m and args[1] is ops.a_ms and args[4] is ops.masked_m
    assert kw == {"out": out, "variant": "swapab", "expected_m": 4, "config": {"BLOCK_N": 64}}
    fn, out = bench.ours_moe_call(ops, "contiguous", "split", {"split_at": 16}, 4)
    fn()
    kind, args, kw = seen[-1]
    assert out.shape == (7, 256) and kind == "contiguous" and args[0] is ops.a_c and args[4] is ops.indptr
    assert kw == {"out": out, "variant": "split", "config": {"split_at": 16}}
    for layout, a, index in (("masked", ops.a_m, "masked_m"), ("contiguous", ops.a_c, "m_indptr")):
        fn, out = bench.ours_moe_call(ops, layout, "cuda", {"form": "64x256-pd"}, 4)
        fn()
        kind, args, kw = seen[-1]
        assert kind == "cuda" and args[0] is a and kw["form"] == "64x256-pd" and kw["out"] is out
        assert kw[index] is (ops.masked_m if index == "masked_m" else ops.indptr)


def moe_point(provider, us, layout="masked", m=32, dist="uniform", tbs=4.0, h20=100.0):
    return {"kind": "moe", "shape": "gate_up", "groups": 8, "tokens_per_group": m, "distribution": dist,
            "layout": layout, "provider": provider, "us": us, "weight_tbs": tbs, "h20_modelled_us": h20}


def test_issue_targets_compare_within_one_layout_and_draw():
    pts = [moe_point("ours-swapab", 50.0, tbs=4.2, h20=60.0), moe_point("ours-normal", 80.0, h20=90.0),
           moe_point("deepgemm", 55.0, h20=100.0),
           # contiguous: SGLang's triton is the rival there, and faster than ours
           moe_point("ours-swapab", 60.0, layout="contiguous"), moe_point("sglang-triton", 54.0, layout="contiguous"),
           # a failed provider (NaN) is no rival; a point of no upstream is no point
           moe_point("sglang-triton-swapab", float("nan"), layout="contiguous"),
           moe_point("ours-swapab", 40.0, m=128), moe_point("deepgemm", 60.0, m=128, layout="contiguous")]
    t = bench.issue_targets(pts, peak_tbs=4.5)
    rows = {(p["layout"], p["tokens_per_group"]): p for p in t["per_point"]}
    assert set(rows) == {("masked", 32), ("contiguous", 32)}
    masked, contiguous = rows[("masked", 32)], rows[("contiguous", 32)]
    assert masked["best_ours"] == "ours-swapab" and masked["vs_best_upstream"] == pytest.approx(55 / 50)
    assert masked["read_frac"] == pytest.approx(4.2 / 4.5)
    assert masked["h20_modelled_vs_deepgemm_masked"] == pytest.approx(100 / 60)  # the best modelled of ours
    assert contiguous["best_upstream"] == "sglang-triton" and contiguous["vs_best_upstream"] == pytest.approx(0.9)
    assert contiguous["h20_modelled_vs_deepgemm_masked"] is None  # masked only, as the issue asks
    checks = t["checks"]
    assert (checks["vs_best_upstream"]["met"], checks["vs_best_upstream"]["points"]) == (1, 2)
    assert (checks["read_frac_m64"]["met"], checks["read_frac_m64"]["points"]) == (1, 2)
    assert checks["vs_best_upstream_m128_256"]["points"] == 0
    assert checks["h20_modelled_m32"]["met"] == 1
    assert t["summary"][0].startswith("target >= 1.0x the best upstream kernel: 1 of 2 points")


def test_issue_targets_record_the_other_readings_and_count_a_failed_ours_as_missed():
    """The two readings beside the main ones (across layouts; the H20 ratio with the fastest of ours on this GPU),
    a point whose ours all failed counted as a miss, and an exact bound met in spite of float rounding."""
    pts = [moe_point("ours-swapab", 70.0, h20=60.0), moe_point("ours-normal", 50.0, h20=90.0),
           moe_point("deepgemm", 55.0, h20=90.0),
           # contiguous, same (shape, experts, tokens, draw): SGLang's triton beats ours' best in either layout
           moe_point("ours-swapab", 60.0, layout="contiguous"), moe_point("sglang-triton", 45.0, layout="contiguous"),
           # m = 16: ours asked and failed (NaN) where DeepGEMM ran
           moe_point("ours-swapab", float("nan"), m=16), moe_point("deepgemm", 30.0, m=16),
           # m = 8: the H20 model's exact 1.5 as the floats give it
           moe_point("ours-swapab", 10.0, m=8, h20=22548578304 / 296e6), moe_point("deepgemm", 11.0, m=8,
                                                                                   h20=33822867456 / 296e6)]
    t = bench.issue_targets(pts, peak_tbs=4.5)
    rows = {(p["layout"], p["tokens_per_group"]): p for p in t["per_point"]}
    masked = rows[("masked", 32)]
    assert masked["best_ours"] == "ours-normal" and masked["h20_ours_provider"] == "ours-swapab"
    assert masked["h20_modelled_vs_deepgemm_masked"] == pytest.approx(1.5)
    assert masked["h20_modelled_fastest_ours_vs_deepgemm_masked"] == pytest.approx(1.0)
    failed = rows[("masked", 16)]
    assert failed["best_ours"] is None and failed["vs_best_upstream"] == 0.0
    assert rows[("masked", 8)]["h20_modelled_vs_deepgemm_masked"] < 1.5  # 1.4999999999999998 ...
    checks = t["checks"]
    assert (checks["h20_modelled_m32"]["met"], checks["h20_modelled_m32"]["points"]) == (2, 2)  # ... met
    assert (checks["h20_modelled_m32_fastest_ours"]["met"], checks["h20_modelled_m32_fastest_ours"]["points"]) == (1, 2)
    assert (checks["vs_best_upstream"]["met"], checks["vs_best_upstream"]["points"]) == (2, 4)
    # across layouts: m 32 is ours 50 (masked) vs triton 45 (contiguous): missed; m 16 missed; m 8 met
    assert (checks["vs_best_upstream_any_layout"]["met"], checks["vs_best_upstream_any_layout"]["points"]) == (1, 3)


def test_point_metrics_worked_values_and_the_committed_grid():
    """The figures the targets read: weight and total bytes, useful and issued (tile-padded) FLOPs, the H20-modelled
    time. A worked point first, then every timed point of session 49's grid (not ours-split, whose issued work
    `split_tiles` adds) recomputed from its time, counts and tiles, equal to what the run wrote."""
    n, k = 256, 512  # 2 x 4 weight-scale blocks per expert
    got = bench.metrics(10.0, [3, 0, 40], n, k, (32, 128))
    weights = 2 * (n * k + 2 * 4 * 4)  # the two experts with tokens, FP8 weights + fp32 128x128 scales
    total = weights + 43 * (k + 4 * 4) + 43 * n * 2  # FP8 activations + their 1x128 scales, bf16 output
    issued = 2 * k * n * (32 + 64)  # 3 tokens pad to one 32-token tile, 40 to two
    assert got == pytest.approx({
        "us": 10.0, "weight_tbs": weights / 10.0 / 1e6, "tflops": 2 * k * n * 43 / 10.0 / 1e6, "weight_bytes": weights,
        "total_bytes": total, "useful_flops": 2 * k * n * 43, "issued_flops": issued, "tiles_tok_w": [32, 128],
        "h20_modelled_us": 1e6 * max(issued / 296e12, total / 4.0e12)}, rel=1e-12)
    assert bench.issued_flops([1], 300, 128, 16, 128) == 2 * 128 * 16 * 384  # N pads to whole weight tiles too
    points = 0
    for name in ("grouped_gemm_full_s49_h200.json.xz", "grouped_gemm_full_s49_g256_m1_m32_h200.json.xz",
                 "grouped_gemm_full_s49_g256_m64_m256_h200.json.xz"):
        rec = stored_record(f"swapab/{name}")
        for p in rec["points"]:
            if p.get("kind") != "moe" or p["provider"] == "ours-split" or not isinstance(p.get("us"), float):
                continue
            got = bench.metrics(p["us"], p["counts"], p["n"], p["k"], p["tiles_tok_w"])
            assert got == pytest.approx({key: p[key] for key in got}, rel=1e-12), (name, p["provider"], p["groups"])
            points += 1
    assert points == 1154 + 224 + 120
