"""swapab_e2e.py's arm bookkeeping: repeated arms get their own label and pair with the 'off' of their repeat."""
from __future__ import annotations

import pytest

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


def test_decode_only_and_ttft_ratios_where_both_arms_have_them():
    """The server log's decode rate (prefill excluded) and the TTFT are paired beside the bench's output tok/s;
    a level without them (records before session 55, or no steady log line) keeps the two bench ratios alone."""
    off, on = arm("off", 100.0, 20.0), arm("on", 90.0, 18.0)
    off["levels"]["32"].update(decode_only_tok_s=1000.0, median_ttft_ms=200.0)
    on["levels"]["32"].update(decode_only_tok_s=1100.0, median_ttft_ms=300.0)
    assert e2e.compare([off, on])["on"]["32"] == pytest.approx({
        "output_throughput_ratio": 0.9, "median_itl_ratio": 0.9, "decode_only_ratio": 1.1, "median_ttft_ratio": 1.5})
    on["levels"]["32"]["decode_only_tok_s"] = None
    assert set(e2e.compare([off, on])["on"]["32"]) == {"output_throughput_ratio", "median_itl_ratio",
                                                       "median_ttft_ratio"}


def test_fp8_gemm_backend_replaces_the_flag_and_sets_deepgemms_jit(tmp_path):
    flags, env = e2e.backend_setup(e2e.SERVER_ARGS, "deep_gemm")
    assert flags.count("--fp8-gemm-backend") == 1 and "--fp8-gemm-backend deep_gemm" in flags
    assert env["SGLANG_ENABLE_JIT_DEEPGEMM"] == "1" and env["SGL_KERNEL_FLASHINFER"] == "0"
    flags, env = e2e.backend_setup("--load-format dummy", "triton")
    assert flags == "--load-format dummy --fp8-gemm-backend triton" and env["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"


def test_moe_only_table_drops_the_dense_entries(tmp_path):
    import json

    src = tmp_path / "t.json"
    src.write_text(json.dumps({"gpu": "x", "entries": [{"layout": "dense", "m": 1}, {"layout": "masked", "m": 2},
                                                       {"m": 3}]}))
    out = json.loads(e2e.without_dense(src, tmp_path).read_text())
    assert [e["m"] for e in out["entries"]] == [2, 3] and "without its dense-linear entries" in out["derived"]


def test_an_arm_starts_only_when_the_last_ones_first_level_fits_in_the_time_left():
    cold = {"first_level_s": 370.0}  # a cold server start (262 s), its warm-up and one level
    assert not e2e.arm_fits(112.0, cold)  # session 42: this arm overran the call
    assert e2e.arm_fits(370.0, cold)
    assert not e2e.arm_fits(59.0, {"first_level_s": 10.0}) and e2e.arm_fits(60.0, {"first_level_s": 10.0})
    assert e2e.arm_fits(60.0, {"first_level_s": None})  # the last arm finished no level: the floor only
