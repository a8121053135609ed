"""bench_grouped_gemm's tune grid: every walk is in it, --tune-walks keeps exactly the named ones."""
import sys
from pathlib import Path

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
