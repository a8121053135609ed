"""swapab_e2e.py's arm bookkeeping: repeated arms get their own label and pair with the 'off' of their repeat."""
from __future__ import annotations

from repo_scripts import load_script

e2e = load_script("benchmark/serving/swapab_e2e.py")


def arm(label, tok_s, itl):
    return {"arm": label, "levels": {"32": {"output_throughput": tok_s, "median_itl_ms": itl}}}


def test_repeated_arms_are_labelled_and_paired():
    assert e2e.arm_labels(["off", "sbo", "off", "sbo", "off"]) == ["off", "sbo", "off#2", "sbo#2", "off#3"]
    ratios = e2e.compare([arm("off", 100.0, 20.0), arm("sbo", 110.0, 19.0), arm("off#2", 50.0, 40.0),
                          arm("sbo#2", 60.0, 30.0), arm("forced#3", 200.0, 10.0)])
    assert ratios["sbo"]["32"] == {"output_throughput_ratio": 1.1, "median_itl_ratio": 0.95}
    assert ratios["sbo#2"]["32"] == {"output_throughput_ratio": 1.2, "median_itl_ratio": 0.75}  # off#2, not off
    assert ratios["forced#3"]["32"]["output_throughput_ratio"] == 2.0  # no off#3: the first off
    assert set(ratios) == {"sbo", "sbo#2", "forced#3"}
