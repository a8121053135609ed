"""bench_sbo's measure of one GPU's overlap (the share of combine + shared-expert time hidden), from a layer row."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import bench_sbo as bench  # noqa: E402


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
