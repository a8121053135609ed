"""bench_ep_combine.py without GPUs: it skips with the reason, builds each rank's share of a layer consistently,
and summarizes by the slowest rank."""
from __future__ import annotations

import os

import pytest
import torch

from repo_scripts import REPO, load_script

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

bench = load_script("benchmark/kernels/bench_ep_combine.py")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has 2 GPUs: the bench would run")
def test_skips_without_two_gpus(capsys, tmp_path):
    assert bench.main(["--quick", "--json", str(tmp_path / "r.json")]) == 0
    assert "skipped: needs 2 or more CUDA GPUs" in capsys.readouterr().err
    assert "unavailable" in (tmp_path / "r.json").read_text()


def test_rank_problems_cover_every_pair_once():
    world, tokens, experts = 2, 5, 16
    probs = [bench.rank_problem(r, world, tokens, experts, "cpu") for r in range(world)]
    pairs = sum(p["pairs"] for p in probs)
    assert torch.equal(pairs, torch.full((world * tokens,), bench.TOPK, dtype=torch.int32))  # each pair on one rank
    local_rows = [int(p["lay"].m_indptr[-1]) for p in probs]  # rows each rank's GEMM computes
    assert sum(local_rows) == world * tokens * bench.TOPK and min(local_rows) > 0
    assert probs[0]["owner"].tolist() == [0] * tokens + [1] * tokens
    assert torch.equal(probs[0]["w"], probs[1]["w"])  # the same gathered batch on every rank
    with pytest.raises(ValueError):
        bench.rank_problem(0, 3, tokens, experts, "cpu")


def test_summary_takes_the_slowest_rank():
    def pt(g, s, f, err):
        return {"tokens_per_rank": 20, "gathered_tokens": 40, "variant": "swapab", "config": {},
                "order_error_vs_fp32": {"fused": err, "serial": 3 * err, "fused_flat": err / 2}, "status": 0,
                "us": {"gather": g, "serial": s, "fused": f, "fused_flat": f - 5}}
    rows = bench.summarize({0: {"points": [pt(10, 100, 90, 0.5)]}, 1: {"points": [pt(12, 110, 80, 0.25)]}})
    r = rows[0]
    assert r["us_slowest_rank"] == {"gather": 12, "serial": 110, "fused": 90, "fused_flat": 85}
    assert r["moe_down_us"] == {"serial": 98, "fused": 78, "fused_flat": 73}
    assert r["order_error_max"] == {"fused": 0.5, "serial": 1.5, "fused_flat": 0.25}
    assert r["fused_flat_over_serial"] == pytest.approx(85 / 110)
    assert r["fused_over_serial"] == pytest.approx(90 / 110) and not r["any_wait_gave_up"]



def test_replot_draws_the_stored_record(tmp_path):
    src = REPO / "benchmark/results/ep_combine/bench_ep_combine_ep2_h200.json"
    rec = tmp_path / "rec.json"
    rec.write_text(src.read_text())
    assert bench.main(["--replot", str(rec)]) == 0
    assert rec.with_suffix(".png").stat().st_size > 10_000


def test_replot_of_an_unreadable_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert bench.main(["--replot", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bench_ep_combine: --replot {bad}: cannot read JSON") and "\n" not in err


def test_the_verdict_judges_the_fused_arms_and_the_waits():
    """Exit status 1 (rows_ok false) when a fused arm's rows differ from the serial result by more than its
    summation order, or a consumer's wait gave up; the serial arm's own error does not count."""
    row = {"order_error_max": {"serial": 7.0, "fused": 1.0, "fused_flat": 0.5}, "any_wait_gave_up": False}
    assert bench.rows_ok([row, row]) and bench.rows_ok([])
    assert not bench.rows_ok([row, {**row, "order_error_max": {"serial": 0.0, "fused": 1.5, "fused_flat": 0.0}}])
    assert not bench.rows_ok([{**row, "any_wait_gave_up": True}])


def test_arguments_are_checked_and_quick_is_one_batch(capsys):
    a = bench.parse_args(["--quick"])
    assert (a.batches, a.reps, a.iters) == ([32], 5, 20)
    for bad in (["--batches", "8", "0"], ["--iters", "0"], ["--reps", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(bad)
        assert e.value.code == 2 and "batches, iters and reps must be positive" in capsys.readouterr().err


def test_replot_of_a_skipped_run_says_why_it_has_nothing_to_draw(tmp_path, capsys):
    rec = tmp_path / "skipped.json"
    rec.write_text('{"benchmark": "ep_combine", "unavailable": "needs 2 or more CUDA GPUs (visible: 1)"}')
    assert bench.main(["--replot", str(rec)]) == 2
    assert capsys.readouterr().err == (f"bench_ep_combine: --replot {rec}: no measured rows to plot (the run was "
                                       "skipped: needs 2 or more CUDA GPUs (visible: 1))\n")
    rec.write_text("[1, 2]")
    assert bench.main(["--replot", str(rec)]) == 2 and "no measured rows" in capsys.readouterr().err
    assert not rec.with_suffix(".png").exists()
