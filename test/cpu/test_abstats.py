"""sglang_h20.abstats, the statistics behind every A/B claim in one server: worked values and identities."""
import math

import numpy as np
import pytest

from sglang_h20 import abstats


def test_t_quantiles_by_degrees_of_freedom():
    assert [abstats.t975(df) for df in (1, 2, 10, 30)] == [12.706, 4.303, 2.228, 2.042]
    assert abstats.t975(31) == abstats.t975(1000) == 1.96  # normal beyond the table
    assert abstats.t975(0) == 1.96  # no lookup wraps around to the table's end


def test_mean_interval_of_a_worked_sample():
    r = abstats.mean_ci95([1.0, 2.0, 3.0])
    half = 4.303 / math.sqrt(3)  # sd 1, df 2
    assert r["n"] == 3 and r["mean"] == 2.0 and r["sd"] == 1.0
    assert r["ci95"] == pytest.approx([2.0 - half, 2.0 + half], rel=1e-12)
    two = abstats.mean_ci95([1.0, 3.0])  # the first size with an interval: df 1
    assert two["ci95"] == pytest.approx([2.0 - 12.706, 2.0 + 12.706], rel=1e-12)  # sd sqrt(2), n 2
    one = abstats.mean_ci95([5.0])
    assert one["mean"] == 5.0 and "ci95" not in one and "sd" not in one
    assert abstats.mean_ci95([])["mean"] is None


def test_nearest_rank_is_the_inverted_cdf_quantile():
    """The p99 the server logs: the smallest value with at least q of the sample at or below it (numpy's
    'inverted_cdf'); 400 values: index 395 of the sorted sample, the 5th largest."""
    assert abstats.rank_index(400, 0.99) == 395 and abstats.rank_index(200, 0.99) == 197
    assert abstats.rank_index(1, 0.99) == 0 and abstats.rank_index(10, 0.0) == 0 and abstats.rank_index(10, 1.0) == 9
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100, 401):
        x = rng.random(n)
        for q in (0.01, 0.5, 0.9, 0.99, 0.999):
            assert abstats.nearest_rank(list(x), q) == np.percentile(x, 100 * q, method="inverted_cdf"), (n, q)


def test_quantile_ratio_and_its_bootstrap_interval():
    rng = np.random.default_rng(1)
    b = rng.gamma(4.0, 2.5, 3000)
    a = 1.1 * rng.gamma(4.0, 2.5, 3000)  # 10% slower
    r = abstats.quantile_ratio_ci95(a, b, 0.99)
    assert r["n"] == [3000, 3000]
    assert r["ratio"] == abstats.nearest_rank(a, 0.99) / abstats.nearest_rank(b, 0.99)
    lo, hi = r["ci95"]
    assert lo < r["ratio"] < hi and lo < 1.1 < hi and hi - lo < 0.2
    assert abstats.quantile_ratio_ci95(a, b, 0.99) == r  # seeded
    # a constant ratio: every resample has it, so the interval shrinks to it
    c = abstats.quantile_ratio_ci95(np.full(50, 3.0), np.full(80, 1.5), 0.5)
    assert c["ratio"] == 2.0 and c["ci95"] == [2.0, 2.0]
    # the interval follows the quantile asked for: a sample whose tail alone is slower
    tail = b.copy()
    tail[np.argsort(tail)[-60:]] *= 2.0
    assert abstats.quantile_ratio_ci95(tail, b, 0.99)["ci95"][0] > 1.5
    assert abstats.quantile_ratio_ci95(tail, b, 0.5)["ci95"] == pytest.approx([1.0, 1.0], abs=0.05)
    assert abstats.quantile_ratio_ci95([], b) == {"n": [0, 3000], "ratio": None}
    assert abstats.quantile_ratio_ci95(a, [])["ratio"] is None
