"""bench_grouped_gemm's tune grid: every walk is in it, --tune-walks keeps exactly the named ones."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import bench_grouped_gemm as bench  # noqa: E402


def test_tune_walks_filter_the_grid():
    for variant, grid in bench.TUNE_GRID.items():
        tma = bench.tune_grid(variant, ["tma"])
        plain_flat = bench.tune_grid(variant, ["plain", "flat"])
        assert tma and all(c["flat"] and c["tma"] for c in tma)
        assert plain_flat and not any(c.get("tma") for c in plain_flat)
        assert len(tma) + len(plain_flat) == len(grid) == 3 * len(tma)
    assert bench.parse_args(["--tune", "--tune-walks", "tma"]).tune_walks == ["tma"]


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


def test_table_from_an_unreadable_file_exits_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit, match=f"^bench_grouped_gemm: --table-from {bad}: cannot read JSON"):
        bench.main(["--table-from", str(bad), "--table-out", str(tmp_path / "t.json")])
    (tmp_path / "empty.json").write_text('{"points": []}')
    with pytest.raises(SystemExit, match="no measured points"):
        bench.main(["--table-from", str(tmp_path / "empty.json"), "--table-out", str(tmp_path / "t.json")])
