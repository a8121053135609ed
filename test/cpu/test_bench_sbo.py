"""bench_sbo's measure of one GPU's overlap (the share of combine + shared-expert time hidden), from a layer row."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import bench_sbo as bench  # noqa: E402
from repo_scripts import stored_record  # noqa: E402


def test_hidden_shares_weigh_each_beside_arm_against_nothing_overlapped():
    row = {"batch": 16, "layer_combine_alone_us": 10.0,
           "shared_alone_us": 60.0, "ours_shared_alone_us": 30.0,
           "layer_ours_serial+shared_serial_us": 270.0, "layer_ours_serial+ours_shared_serial_us": 240.0,
           "layer_ours_tail+shared_beside_us": 214.0,  # (270 - 214) / (10 + 60) = 80%
           "layer_ours_tail+ours_shared_beside_us": 220.0,  # (240 - 220) / (10 + 30) = 50%
           "layer_ours_tail+ours_shared[16]_beside_us": 208.0,  # capped: weighed against the uncapped alone, 80%
           "layer_upstream+shared_beside_us": 250.0,  # upstream's arms are not ours to score
           "layer_ours_tail+shared_serial_us": 262.0}
    shares = bench.hidden_shares(row)
    assert shares == pytest.approx({"layer_ours_tail+shared_beside": 80.0, "layer_ours_tail+ours_shared_beside": 50.0,
                                    "layer_ours_tail+ours_shared[16]_beside": 80.0})
    del row["layer_combine_alone_us"]
    assert bench.hidden_shares(row) == {}  # no combine time, no claim
    row["layer_combine_alone_us"] = 10.0
    del row["ours_shared_alone_us"]
    assert set(bench.hidden_shares(row)) == {"layer_ours_tail+shared_beside"}


def test_shared_sms_default_and_parse():
    assert bench.parse_args(["--shared"]).shared_sms == []  # measured no faster (session 35): opt-in
    assert bench.parse_args(["--shared", "--shared-sms", "8"]).shared_sms == [8]


def test_layer_plot_has_the_hidden_share_panel(tmp_path):
    rows = [{"batch": t, "experts": 16, "layer_upstream_us": 220.0 + t, "layer_ours_tail+ours_shared_beside_us": 210.0,
             "hidden_pct": {"layer_ours_tail+ours_shared_beside": 60.0 + t}} for t in (8, 16)]
    bench.plot_layer(rows, tmp_path / "a.png")
    bench.plot_layer([{k: v for k, v in r.items() if k != "hidden_pct"} for r in rows], tmp_path / "b.png")
    assert (tmp_path / "a.png").stat().st_size > (tmp_path / "b.png").stat().st_size > 0  # two panels, one


def test_a_batchs_routing_does_not_depend_on_the_batches_swept_before_it():
    import torch

    first = torch.randperm(16, generator=bench.batch_generator(32, "cpu"))
    torch.rand(100, generator=bench.batch_generator(8, "cpu"))  # a run that swept batch 8 first
    assert torch.equal(torch.randperm(16, generator=bench.batch_generator(32, "cpu")), first)
    assert not torch.equal(torch.randperm(16, generator=bench.batch_generator(56, "cpu")), first)


def test_kernel_shares_worked_values_and_the_committed_runs():
    """The kernel phase's derived figures (the combine's hidden shares, the best budget and the GEMM's slowdown on
    the SMs it leaves): a worked batch, then every batch of the two stored runs that timed every form, recomputed
    from their times and equal to what the runs wrote."""
    s = {"gemm_alone": 100.0, "combine_alone": 20.0, "serial": 125.0, "fused": 110.0, "fused_tail": 105.0,
         "flat_serial": 124.0, "flat_fused": 114.0, "serial+shared": 150.0,
         "overlap[8]": 112.0, "overlap[16]": 108.0, "gemm_lent[8]": 104.0, "gemm_lent[16]": 110.0,
         "overlap+shared[8]": 130.0, "overlap+shared[16]": 133.0, "colocated[8]": 115.0, "colocated[16]": 120.0}
    assert bench.kernel_shares(s, [8, 16]) == pytest.approx({
        "fused_gain_us": 15.0, "combine_hidden_pct": 75.0, "tail_hidden_pct": 80.0,  # 20 of the serial form's 25
        "flat_combine_hidden_pct": 50.0, "colocated_hidden_pct[8]": 40.0, "colocated_hidden_pct[16]": 20.0,
        "best_budget": 16, "overlap_gain_us": 17.0, "gemm_slowdown_pct_at_best": 10.0,
        "with_shared_gain_us": 20.0})  # the best budget with the shared expert beside is 8, not the overlap's 16
    for name in ("bench_sbo_colocated_h200.json", "bench_sbo_e16_h200.json"):
        rec = stored_record(f"sbo/{name}")
        for batch, s in rec["summary"].items():
            budgets = sorted(int(k[len("overlap["):-1]) for k in s if k.startswith("overlap["))
            got = bench.kernel_shares(s, budgets)
            assert got == pytest.approx({k: s[k] for k in got}, rel=1e-12), (name, batch)


def test_the_layer_rows_shares_and_ratios_reproduce_the_stored_runs():
    """The layer's headline figures (the share of combine + shared expert hidden, upstream / ours with the shared
    expert beside) recomputed from each stored row's times equal what the runs wrote: the H100 runs of sessions 61
    and 62 and the H200's slim-shared runs."""
    rows = 0
    for name in ("sbo_layer_shared_e16_s61_h100.json", "sbo_layer_shared_e16_b8_b64_s62_h100.json",
                 "sbo_layer_slim_shared_e16_h200.json", "sbo_layer_slim_shared_e16_b64_h200.json"):
        for row in stored_record(f"sbo/{name}")["layer"]:
            times = {k: v for k, v in row.items() if k.endswith("_us")}
            assert bench.hidden_shares(times) == pytest.approx(row["hidden_pct"], rel=1e-12), (name, row["batch"])
            stored = {k: v for k, v in row.items() if k.endswith("_beside_vs_upstream")}
            assert len(stored) == 2 and bench.beside_vs_upstream(times) == pytest.approx(stored, rel=1e-12)
            rows += 1
    assert rows == 4 + 5 + 4 + 1
    one_ran = {"layer_upstream+shared_beside_us": 30.0, "layer_ours_tail+shared_beside_us": 25.0,
               "layer_ours_tail_grid+shared_beside_us": None}  # an arm that failed: no ratio for it
    assert bench.beside_vs_upstream(one_ran) == {"ours_tail_beside_vs_upstream": 1.2}
