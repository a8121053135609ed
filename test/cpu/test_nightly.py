"""Nightly regression runner: verdicts, config checks, log parsing, the runner loop and the CLI, all without a GPU."""
from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_h20.nightly import compare as cmp
from sglang_h20.nightly import config as cfg
from sglang_h20.nightly import report, runner, serving

DATA = Path(__file__).resolve().parents[1] / "data" / "nightly"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def record(points: dict) -> dict:
    """A minimal record: {point_id: {metric: (values, better)}}."""
    return {"schema": 1, "threshold": {"rel": 0.03, "noise_k": 3.0},
            "points": {pid: {"kind": "serving", "error": None,
                             "metrics": {m: {"values": v, "better": b} for m, (v, b) in ms.items()}}
                       for pid, ms in points.items()}}


def verdicts(rows) -> dict:
    return {(r.point, r.metric): r.verdict for r in rows}


# --- verdicts ---------------------------------------------------------------------------------------------------

def test_real_regression_detected():
    row = cmp.compare_metric("p", "output_throughput", [89.0, 90.0, 91.0], [99.0, 100.0, 101.0], "higher")
    assert row.verdict == "regression"
    assert row.change == pytest.approx(-0.10)
    assert row.noise == pytest.approx(1.4826 * 1 / 90)  # the larger of the two spreads: 1/90 > 1/100
    assert row.tolerance == pytest.approx(3 * 1.4826 / 90)


def test_noise_is_tolerated():
    base, cur = [95.0, 100.0, 105.0], [91.0, 96.0, 101.0]  # -4% while repeats spread +-5%
    row = cmp.compare_metric("p", "output_throughput", cur, base, "higher")
    assert row.change == pytest.approx(-0.04)
    assert row.noise == pytest.approx(1.4826 * 5 / 96)
    assert row.verdict == "same"
    # the same -4% with quiet repeats is past the 3% floor: it was the noise that excused it
    assert cmp.compare_metric("p", "m", [95.9, 96.0, 96.1], [99.9, 100.0, 100.1], "higher").verdict == "regression"


def test_two_repeats_have_a_spread_and_a_zero_baseline_an_infinite_change():
    # two repeats (a quick nightly): the MAD of [1.0, 1.2] about their median 1.1 is 0.1
    assert cmp.spread([1.0, 1.2]) == pytest.approx(1.4826 * 0.1 / 1.1) and cmp.spread([7.0]) == 0.0
    # a metric whose median repeat is 0 (e.g. no failed requests) has no relative spread; one at 1 has one
    assert cmp.spread([0.0, 0.0, 3.0]) == 0.0 and cmp.spread([0.9, 1.0, 1.2]) == pytest.approx(1.4826 * 0.1)
    assert cmp.relative_change(5.0, 0.0, "higher") == float("inf") and cmp.relative_change(0.0, 0.0, "higher") == 0.0
    assert cmp.relative_change(5.0, 0.0, "lower") == float("-inf")  # lower is better: worse without bound


def test_a_change_of_exactly_the_tolerance_is_not_a_verdict():
    # quiet repeats: the tolerance is the 3% floor; -3% exactly stays "same", past it is a regression
    at = cmp.compare_metric("p", "m", [97.0] * 3, [100.0] * 3, "higher", rel=0.03)
    assert at.change == -0.03 and at.tolerance == 0.03 and at.verdict == "same"
    assert cmp.compare_metric("p", "m", [96.9] * 3, [100.0] * 3, "higher", rel=0.03).verdict == "regression"
    assert cmp.compare_metric("p", "m", [103.0] * 3, [100.0] * 3, "higher", rel=0.03).verdict == "same"


def test_noise_of_either_side_counts():
    quiet, noisy = [99.9, 100.0, 100.1], [90.0, 100.0, 110.0]
    assert cmp.compare_metric("p", "m", [92.0, 93.0, 94.0], noisy, "higher").verdict == "same"
    assert cmp.compare_metric("p", "m", [83.0, 93.0, 103.0], quiet, "higher").verdict == "same"
    assert cmp.compare_metric("p", "m", [92.9, 93.0, 93.1], quiet, "higher").verdict == "regression"


def test_improvement_detected():
    row = cmp.compare_metric("p", "output_throughput", [111.0, 112.0, 113.0], [99.0, 100.0, 101.0], "higher")
    assert row.verdict == "improvement" and row.change == pytest.approx(0.12)


def test_floor_applies_to_quiet_points():
    # no noise at all: 2% is under the 3% floor, 4% is over it
    assert cmp.compare_metric("p", "m", [98.0] * 3, [100.0] * 3, "higher").verdict == "same"
    assert cmp.compare_metric("p", "m", [96.0] * 3, [100.0] * 3, "higher").verdict == "regression"
    assert cmp.compare_metric("p", "m", [96.0] * 3, [100.0] * 3, "higher", rel=0.05).verdict == "same"


def test_lower_is_better_direction():
    slower = cmp.compare_metric("p", "median_itl_ms", [5.49, 5.5, 5.51], [4.99, 5.0, 5.01], "lower")
    assert slower.verdict == "regression" and slower.change == pytest.approx(-0.10)
    faster = cmp.compare_metric("p", "median_itl_ms", [4.49, 4.5, 4.51], [4.99, 5.0, 5.01], "lower")
    assert faster.verdict == "improvement" and faster.change == pytest.approx(0.10)
    # the same numbers read as higher-is-better flip the verdicts
    assert cmp.compare_metric("p", "m", [5.49, 5.5, 5.51], [4.99, 5.0, 5.01], "higher").verdict == "improvement"


def test_new_and_missing_points_and_metrics():
    base = record({"a": {"tput": ([100.0] * 3, "higher"), "gone": ([1.0] * 3, "lower")},
                   "old": {"tput": ([50.0] * 3, "higher")}})
    run = record({"a": {"tput": ([100.0] * 3, "higher"), "added": ([7.0] * 3, "higher")},
                  "fresh": {"tput": ([10.0] * 3, "higher")}})
    rows = cmp.compare(run, base)
    assert verdicts(rows) == {("a", "tput"): "same", ("a", "added"): "new", ("a", "gone"): "missing",
                              ("fresh", "tput"): "new", ("old", "tput"): "missing"}
    assert cmp.regressions(rows) == []
    missing = next(r for r in rows if r.point == "old")
    assert missing.baseline == 50.0 and missing.current is None


def test_regressions_lists_only_regressions():
    base = record({"a": {"x": ([100.0] * 3, "higher")}, "b": {"x": ([100.0] * 3, "higher")},
                   "c": {"x": ([100.0] * 3, "higher")}})
    run = record({"a": {"x": ([80.0] * 3, "higher")}, "b": {"x": ([120.0] * 3, "higher")}})
    assert [(r.point, r.verdict) for r in cmp.regressions(cmp.compare(run, base))] == [("a", "regression")]


def test_thresholds_come_from_the_run_record():
    base = record({"a": {"x": ([100.0] * 3, "higher")}})
    run = record({"a": {"x": ([95.0] * 3, "higher")}})
    assert verdicts(cmp.compare(run, base))[("a", "x")] == "regression"
    run["threshold"]["rel"] = 0.06
    assert verdicts(cmp.compare(run, base))[("a", "x")] == "same"


def test_failures_exclude_skipped_points():
    run = record({"ok": {"x": ([1.0], "higher")}})
    run["points"]["broken"] = {"kind": "serving", "metrics": {}, "error": "repeat 1: RuntimeError: boom"}
    run["points"]["absent"] = {"kind": "kernel", "metrics": {}, "error": "skipped: not found: b.py"}
    assert cmp.failures(run) == {"broken": "repeat 1: RuntimeError: boom"}


def test_fixtures_regression_run():
    rows = cmp.compare(load("run_regression"), load("baseline"))
    got = verdicts(rows)
    c48 = "serving/dsv3-4l/features-on/c48"
    assert {(r.point, r.metric) for r in cmp.regressions(rows)} == {
        (c48, "output_throughput"), (c48, "decode_tok_s"), (c48, "median_itl_ms"), (c48, "p99_itl_ms"),
        ("kernel/mla_decode", "latency_us"), ("kernel/mla_decode", "tflops")}
    assert got[("serving/dsv3-ep16-slice/features-off/c16", "output_throughput")] == "same"  # -4% in +-5% noise
    assert got[("serving/dsv3-ep16-slice/features-on/c128", "output_throughput")] == "improvement"
    assert got[("serving/dsv3-ep16-slice/features-on/c128", "p99_itl_ms")] == "improvement"
    assert got[("kernel/grouped_gemm", "tflops")] == "missing"  # skipped in the run, measured in the baseline
    assert cmp.failures(load("run_regression")) == {}


def test_fixtures_clean_run():
    rows = cmp.compare(load("run_clean"), load("baseline"))
    assert cmp.regressions(rows) == []
    assert {r.verdict for r in rows} == {"same"}
    assert len(rows) == 12 * 5 + 2 * 2  # every serving and kernel metric compared


def test_check_record_rejects_other_schemas():
    with pytest.raises(ValueError, match="schema"):
        cmp.check_record({"schema": 2, "points": {}}, "x.json")
    with pytest.raises(ValueError, match="not a nightly run record"):
        cmp.check_record([1, 2], "x.json")


# --- config -----------------------------------------------------------------------------------------------------

def minimal(**overrides) -> dict:
    doc = {"name": "t", "gpu": "H200",
           "kernel": [{"name": "k", "command": "python k.py --json {out}", "metrics": {"tflops": "higher"}}],
           "serving": [{"name": "m/off", "model": "{models}/m", "server_args": ["--x"], "env": {},
                        "points": [{"concurrency": 16, "input_len": 8, "output_len": 4, "num_prompts": 32}]}]}
    doc.update(overrides)
    return doc


def test_config_graph_cap_at_or_above_every_concurrency_passes():
    for args in (["--cuda-graph-max-bs", "16"], ["--cuda-graph-max-bs-decode=32"], ["--disable-cuda-graph"], []):
        doc = minimal()
        doc["serving"][0]["server_args"] = args
        assert cfg.parse(doc).serving[0].server_args == args


def test_config_defaults():
    c = cfg.parse(minimal())
    assert (c.repeats, c.threshold.rel, c.threshold.noise_k) == (3, 0.03, 3.0)
    assert c.kernels[0].point_id == "kernel/k"
    assert c.serving[0].point_id(c.serving[0].points[0]) == "serving/m/off/c16"
    # zero is a valid threshold (every change counts), not an error
    doc = minimal()
    doc["threshold"] = {"rel": 0, "noise_k": 0.0}
    zero = cfg.parse(doc).threshold
    assert (zero.rel, zero.noise_k) == (0.0, 0.0)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(repeat=3), "top level: unknown key(s) 'repeat'"),
    (lambda d: d.pop("gpu"), "top level: missing required key(s) 'gpu'"),
    (lambda d: d["kernel"][0]["metrics"].update(tflops="up"),
     "kernel[0] 'k': metric 'tflops': direction must be \"higher\" or \"lower\""),
    (lambda d: d["kernel"][0].pop("command"), "kernel[0] 'k': missing required key(s) 'command'"),
    (lambda d: d["kernel"][0].update(command="python k.py"), "command must contain {out}"),
    (lambda d: d["serving"][0]["points"][0].pop("num_prompts"),
     "serving[0] 'm/off': points[0]: missing required key(s) 'num_prompts'"),
    (lambda d: d["serving"][0]["points"][0].update(concurrency=0), "points[0]: concurrency: expected a positive"),
    (lambda d: d["serving"][0].update(serverargs=[]), "serving[0] 'm/off': unknown key(s) 'serverargs'"),
    (lambda d: d["serving"][0]["env"].update(SGLANG_H20_FP8MLA="1"), "SGLANG_H20_FP8MLA is not a plugin switch"),
    (lambda d: d["serving"][0]["env"].update(SGLANG_H20_MHA_MLA_POLICY="fast"), "expected one of upstream/se"),
    (lambda d: d["serving"][0]["env"].update(SGLANG_H20_FP8_MLA=1), "env: SGLANG_H20_FP8_MLA: expected a non-empty string"),
    (lambda d: d["serving"][0]["points"].append(dict(d["serving"][0]["points"][0])), "duplicate point ids"),
    (lambda d: d.update(threshold={"rel": -1}), "threshold.rel: expected a number >= 0"),
    (lambda d: d.update(kernel=[], serving=[]), "nothing to run"),
    (lambda d: d["serving"][0].update(server_args=["--cuda-graph-max-bs", "8"]),
     "serving[0] 'm/off': points at concurrency 16 exceed --cuda-graph-max-bs 8: they would decode without CUDA"),
    (lambda d: d["serving"][0].update(server_args=["--cuda-graph-max-bs-decode=x"]),
     "--cuda-graph-max-bs-decode needs an integer, got 'x'"),
    (lambda d: d["serving"][0].update(server_args=["--tp", "1", "--cuda-graph-max-bs"]),  # the value forgotten
     "--cuda-graph-max-bs needs an integer, got ''"),
])
def test_config_errors_are_clear(mutate, message):
    doc = minimal()
    mutate(doc)
    with pytest.raises(cfg.ConfigError) as e:
        cfg.parse(doc, source="my.toml")
    assert str(e.value).startswith("my.toml: ")
    assert message in str(e.value)


def test_config_load_reports_toml_errors_and_missing_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(cfg.ConfigError, match="invalid TOML"):
        cfg.load(bad)
    with pytest.raises(cfg.ConfigError, match="no such config file.*shipped configs: h20, h200"):
        cfg.load(tmp_path / "nope.toml")


def test_models_placeholder():
    s = cfg.parse(minimal()).serving[0]
    assert s.model_path("/data/models/") == "/data/models/m"
    with pytest.raises(cfg.ConfigError, match="needs --models"):
        s.model_path(None)


@pytest.mark.parametrize("name, gpu", [("h200", "H200"), ("h20", "H20")])
def test_shipped_configs(name, gpu):
    c = cfg.load(name)
    assert c.gpu == gpu and c.repeats == 3
    assert [k.name for k in c.kernels] == ["mla_decode", "grouped_gemm", "sbo_layer"]
    assert all("benchmark/kernels/bench_" in k.command and "--json {out}" in k.command for k in c.kernels)
    assert all("--quick" in k.command for k in c.kernels[:2])
    sbo = c.kernels[2]
    assert "--layer-only" in sbo.command and sbo.metrics == {"layer_tail_us": "lower", "layer_vs_upstream": "higher"}
    assert sbo.command_for("/o/x.json", "/m/") == sbo.command.replace("{out}", "/o/x.json").replace("{models}", "/m")
    with pytest.raises(cfg.ConfigError, match="needs --models DIR"):
        sbo.command_for("/o/x.json", None)
    assert [s.name for s in c.serving] == ["dsv3-4l/features-off", "dsv3-4l/features-on",
                                           "dsv3-ep16-slice/features-off", "dsv3-ep16-slice/features-on"]
    on = {"SGLANG_H20_MHA_MLA_POLICY": "se", "SGLANG_H20_FP8_MLA": "1", "SGLANG_H20_SWAPAB": "1"}
    for s in c.serving:
        assert s.model == "{models}/" + s.name.split("/")[0]
        assert s.env == (on if s.name.endswith("features-on") else {})
        assert " ".join(s.server_args) == ("--load-format dummy --attention-backend flashmla --mem-fraction-static "
                                           "0.8 --cuda-graph-max-bs 128 --grammar-backend none --trust-remote-code")
        assert [(p.concurrency, p.input_len, p.output_len, p.num_prompts) for p in s.points] == [
            (cc, 1024, 256, 2 * cc) for cc in (16, 48, 128)]


def test_h20_config_says_it_is_untried():
    text = (cfg.SHIPPED_DIR / "h20.toml").read_text()
    assert "H20 host" in text and "not yet run" in text


# --- server log parsing -----------------------------------------------------------------------------------------

LOG = """\
[2026-11-29 10:00:00] Prefill batch, #new-seq: 48, #new-token: 49152, #cached-token: 0, token usage: 0.02, #running-req: 0, #queue-req: 0
[2026-11-29 10:00:01] Decode batch, #running-req: 12, #token: 15360, token usage: 0.01, cuda graph: True, gen throughput (token/s): 900.12, #queue-req: 0
[2026-11-29 10:00:01] Decode batch, #running-req: 48, #token: 61440, token usage: 0.02, cuda graph: True, gen throughput (token/s): 2345.67, #queue-req: 0
[2026-11-29 10:00:02] Decode batch, #running-req: 48, #token: 63360, token usage: 0.02, cuda graph: True, gen throughput (token/s): 2401.50, #queue-req: 0
[2026-11-29 10:00:03] Decode batch, #running-req: 48, #token: 65280, token usage: 0.02, cuda graph: True, gen throughput (token/s): 2380.00, #queue-req: 0
[2026-11-29 10:00:04] INFO:     127.0.0.1:51234 - "POST /generate HTTP/1.1" 200 OK
"""


def test_decode_throughput_parses_real_log_lines():
    d = serving.decode_throughput(LOG, min_running=48)
    assert d.pop("mean_tok_s") == pytest.approx(3 / (1 / 2345.67 + 1 / 2380.0 + 1 / 2401.5))
    assert d == {"lines": 4, "steady_lines": 3, "median_tok_s": 2380.0, "min_tok_s": 2345.67, "max_tok_s": 2401.5,
                 "max_running": 48, "max_queued": 0, "eager_lines": 0}
    assert serving.decode_throughput(LOG, min_running=1)["steady_lines"] == 4
    assert serving.decode_throughput(LOG, min_running=64)["median_tok_s"] is None
    assert serving.decode_throughput("no decode here") == {"lines": 0, "steady_lines": 0, "median_tok_s": None,
                                                          "max_running": 0, "max_queued": 0, "eager_lines": 0}
    # a line that decoded nothing in its interval (0.00 tok/s, e.g. a stalled step) is no steady rate
    stalled = LOG.splitlines()[2].replace("2345.67", "0.00")
    assert serving.decode_throughput(LOG + stalled + "\n", min_running=48)["steady_lines"] == 3


# a full KV pool (FlashMLA BF16 at 4096x512 @128 on dsv3-ep16-slice, 2026-12-02): 87 decode, 41 wait; batches
# above --cuda-graph-max-bs 64 run eagerly
FULL_POOL_LOG = """\
[2026-12-02 07:27:21] Decode batch, #running-req: 1, #token: 0, token usage: 0.00, cuda graph: True, gen throughput (token/s): 1.89, #queue-req: 0
[2026-12-02 07:28:15] Decode batch, #running-req: 87, #token: 361920, token usage: 0.93, cuda graph: False, gen throughput (token/s): 64.24, #queue-req: 41
[2026-12-02 07:29:34] Decode batch, #running-req: 84, #token: 387072, token usage: 0.99, cuda graph: False, gen throughput (token/s): 474.37, #queue-req: 44
[2026-12-02 07:30:03] Decode batch, #running-req: 44, #token: 184256, token usage: 0.47, cuda graph: True, gen throughput (token/s): 1685.02, #queue-req: 0
"""


def test_log_since_is_one_bench_s_lines_even_mid_character(tmp_path):
    """A bench's lines are what the server log gained after its size before the bench; a byte offset that splits a
    UTF-8 character (a log line with a prompt's text) gives a replacement character, not an error."""
    log = tmp_path / "server.log"
    log.write_text("warm-up \u00e9\n", encoding="utf-8")
    before = log.stat().st_size
    with open(log, "a", encoding="utf-8") as f:
        f.write(LOG)
    assert serving.log_since(log, before) == LOG
    whole = serving.log_since(log, 0)  # the warm-up line is no decode line: the same rate as the bench's alone
    assert whole.startswith("warm-up") and serving.decode_throughput(whole, 48) == serving.decode_throughput(LOG, 48)
    assert serving.log_since(log, before - 2).startswith("\ufffd\n")  # inside the two bytes of the e-acute


def test_decode_throughput_says_why_a_run_had_no_steady_lines():
    d = serving.decode_throughput(FULL_POOL_LOG, min_running=115)
    assert d == {"lines": 4, "steady_lines": 0, "median_tok_s": None,
                 "max_running": 87, "max_queued": 44, "eager_lines": 2}
    assert runner._why_no_decode_rate(d, 128) == (
        " (no decode lines with >= 128 running: at most 87, up to 44 queued: the KV pool is full)")
    assert runner._why_no_decode_rate(serving.decode_throughput(LOG, 64), 64) == (
        " (no decode lines with >= 64 running: at most 48)")
    # lines without the optional fields (older SGLang formats) still count, and report nothing they lack
    short = "Decode batch, #running-req: 5, gen throughput (token/s): 10.0\n"
    assert serving.decode_throughput(short) == {
        "lines": 1, "steady_lines": 1, "median_tok_s": 10.0, "mean_tok_s": 10.0, "min_tok_s": 10.0,
        "max_tok_s": 10.0, "max_running": 5, "max_queued": 0, "eager_lines": 0}


def test_prefill_tokens_counts_new_and_cached():
    # the second line as SGLang 0.5.17 logged it before session 8's crash (a prompt served again from the cache)
    cached = ("[2026-11-30 05:57:02] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 4032, token usage: "
              "0.13, #running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 22.61")
    d = serving.prefill_tokens(LOG + cached + "\n")
    assert d == {"batches": 2, "new_tokens": 49152 + 64, "cached_tokens": 4032,
                 "cached_share": pytest.approx(4032 / (49152 + 64 + 4032))}
    assert serving.prefill_tokens(LOG)["cached_share"] == 0.0
    assert serving.prefill_tokens("no prefill here") == {"batches": 0, "new_tokens": 0, "cached_tokens": 0,
                                                          "cached_share": None}


# --- runner -----------------------------------------------------------------------------------------------------

def test_gpu_label_matching():
    assert runner.gpu_matches("H20", "NVIDIA H20")
    assert not runner.gpu_matches("H20", "NVIDIA H200")
    assert runner.gpu_matches("H200", "NVIDIA H200 NVL")
    assert not runner.gpu_matches("H200", None)


def test_runner_fills_models_into_kernel_commands(tmp_path, monkeypatch):
    """A kernel command may name {models} (the SBO layer bench reads a model's config); without --models the run
    stops with a ConfigError before anything runs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_m.py").write_text(
        "import json, sys\njson.dump({'t': float(len(sys.argv[2]))}, open(sys.argv[1], 'w'))\n")
    conf = cfg.parse({"name": "t", "gpu": "H200", "repeats": 1, "kernel": [
        {"name": "m", "command": f"{sys.executable} bench_m.py {{out}} {{models}}/x", "metrics": {"t": "higher"}}]})
    with pytest.raises(cfg.ConfigError, match="needs --models DIR"):
        runner.run(conf, tmp_path / "none")
    assert not (tmp_path / "none" / "run.json").exists()
    rec = runner.run(conf, tmp_path / "out", models=str(tmp_path / "models") + "/")
    assert rec["points"]["kernel/m"]["metrics"]["t"]["values"] == [float(len(str(tmp_path / "models") + "/x"))]


def test_runner_kernels_record_values_skips_and_failures(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench_ok.py").write_text(
        "import json, sys\njson.dump({'tflops': 500.0, 'latency_us': 41.5, 'extra': 'ignored'}, open(sys.argv[1], 'w'))\n")
    (tmp_path / "bench_bad.py").write_text("import sys\nprint('CUDA error: out of memory')\nsys.exit(3)\n")
    py = sys.executable
    conf = cfg.parse({"name": "t", "gpu": "H200", "repeats": 2, "kernel": [
        {"name": "ok", "command": f"{py} bench_ok.py {{out}}", "metrics": {"tflops": "higher", "latency_us": "lower"}},
        {"name": "absent", "command": "python benchmark/kernels/bench_nope.py --json {out}", "metrics": {"t": "higher"}},
        {"name": "bad", "command": f"{py} bench_bad.py {{out}}", "metrics": {"t": "higher"}},
        {"name": "after", "command": f"{py} bench_ok.py {{out}}", "metrics": {"tflops": "higher"}},
    ]})
    rec = runner.run(conf, tmp_path / "out", command="python -m sglang_h20.nightly run ...")
    assert json.loads((tmp_path / "out" / "run.json").read_text()) == rec
    assert rec["schema"] == 1 and rec["config"] == "t" and rec["command"].startswith("python -m")
    assert {"python", "torch", "sglang", "sglang_h20", "triton"} <= set(rec["versions"])
    assert rec["date"].endswith("+00:00")
    pts = rec["points"]
    assert pts["kernel/ok"]["metrics"] == {"tflops": {"values": [500.0, 500.0], "better": "higher"},
                                           "latency_us": {"values": [41.5, 41.5], "better": "lower"}}
    assert pts["kernel/ok"]["error"] is None
    assert pts["kernel/absent"]["error"] == "skipped: not found: benchmark/kernels/bench_nope.py"
    assert "exit status 3" in pts["kernel/bad"]["error"] and "out of memory" in pts["kernel/bad"]["error"]
    assert pts["kernel/bad"]["error"].startswith("repeat 1: ")  # the first repeat failed, the second was not run
    assert pts["kernel/after"]["metrics"]["tflops"]["values"] == [500.0, 500.0]  # the run went on
    assert cmp.failures(rec) == {"kernel/bad": pts["kernel/bad"]["error"]}
    # progress: each repeat's command as it starts, then its values
    said = [re.sub(r"^.*\] ", "", l) for l in capsys.readouterr().out.splitlines() if "kernel/ok" in l]
    run_ok = f"{py} bench_ok.py {tmp_path / 'out' / 'kernels'}"
    assert said == [f"kernel/ok repeat 1/2: {run_ok}/ok.r0.json", "kernel/ok repeat 1/2: tflops=500, latency_us=41.5",
                    f"kernel/ok repeat 2/2: {run_ok}/ok.r1.json", "kernel/ok repeat 2/2: tflops=500, latency_us=41.5"]


def test_runner_only_filter_and_missing_metric(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "b.py").write_text("import json, sys\njson.dump({'tflops': 1.0}, open(sys.argv[1], 'w'))\n")
    conf = cfg.parse({"name": "t", "gpu": "H200", "repeats": 1, "kernel": [
        {"name": "one", "command": f"{sys.executable} b.py {{out}}", "metrics": {"gbps": "higher"}},
        {"name": "two", "command": f"{sys.executable} b.py {{out}}", "metrics": {"tflops": "higher"}}]})
    rec = runner.run(conf, tmp_path / "out", only="kernel/one")
    assert "WARNING: config 't' is for H200; this host's GPU: None" in capsys.readouterr().out  # a CPU host
    here = runner.provenance.record
    monkeypatch.setattr(runner.provenance, "record", lambda command=None: {**here(command), "gpu": "NVIDIA H200"})
    runner.run(conf, tmp_path / "out", only="kernel/one")
    assert "WARNING" not in capsys.readouterr().out
    assert list(rec["points"]) == ["kernel/one"]
    assert "lacks metric(s) ['gbps']" in rec["points"]["kernel/one"]["error"]
    with pytest.raises(ValueError, match="selects no point"):
        runner.run(conf, tmp_path / "out", only="serving/")


@pytest.mark.parametrize("value", ["true", '"fast"', "null", "[1.0]"])
def test_runner_refuses_a_non_numeric_metric(tmp_path, monkeypatch, value):
    """A flag or a string where a number belongs is an error on the point, not a 1.0 or a crash."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "b.py").write_text(f"import json, sys\nopen(sys.argv[1], 'w').write('{{\"t\": {value}, \"u\": 2}}')\n")
    conf = cfg.parse({"name": "t", "gpu": "H200", "repeats": 1, "kernel": [
        {"name": "one", "command": f"{sys.executable} b.py {{out}}", "metrics": {"t": "higher", "u": "lower"}}]})
    err = runner.run(conf, tmp_path / "out")["points"]["kernel/one"]["error"]
    assert "non-numeric metric(s) {'t': " in err and "'u'" not in err


def test_progress_lines_carry_the_minutes_since_start(capsys):
    runner._progress(time.time() - 90, "serving/x repeat 1/2")
    runner._progress(time.time() - 600, "ten minutes in")
    runner._progress(0, "no start yet")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("] [+  1.5 min] serving/x repeat 1/2") and out[1].endswith("] [+ 10.0 min] ten minutes in")
    assert out[2].endswith("] [+  0.0 min] no start yet")


class FakeServer:
    """Stands in for serving.Server: appends 'Decode batch' lines to its log during each bench."""

    instances: list["FakeServer"] = []

    def __init__(self, model, args, log_path, env=None, port=30000, ready_timeout_s=600):
        self.model, self.args, self.log_path, self.env, self.port = model, args, Path(log_path), env, port
        self.proc, self.calls = None, []
        FakeServer.instances.append(self)

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log("Decode batch, #running-req: 64, #token: 1, token usage: 0.01, cuda graph: True, "
                  "gen throughput (token/s): 99999.00, #queue-req: 0")  # startup noise, before any bench
        return self

    def __exit__(self, *exc):
        pass

    def _log(self, line):
        with open(self.log_path, "a") as f:
            f.write(f"[2026-11-29 10:00:00] {line}\n")

    def bench(self, out_jsonl, *, num_prompts, input_len, output_len, concurrency=None, dataset_path=None, **kw):
        self.calls.append((Path(out_jsonl).name, concurrency, num_prompts, dataset_path))
        n = len(self.calls)
        if concurrency == 48 and n == 4:  # first repeat at c48 breaks
            raise RuntimeError("bench_serving failed (rc=1)")
        for running, tput in ((concurrency // 2, 1.0), (concurrency, 1000.0 * n), (concurrency, 1000.0 * n + 10)):
            self._log(f"Decode batch, #running-req: {running}, #token: 4096, token usage: 0.02, cuda graph: True, "
                      f"gen throughput (token/s): {tput:.2f}, #queue-req: 0")
        return {"output_throughput": 100.0 * n, "median_itl_ms": 5.0, "p99_itl_ms": 30.0, "median_ttft_ms": 80.0,
                "completed": num_prompts}


def test_runner_serving_with_fake_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serving, "Server", FakeServer)
    monkeypatch.setenv("SGLANG_H20_FP8_MLA", "1")  # must not leak into a features-off server
    FakeServer.instances = []
    conf = cfg.parse({"name": "t", "gpu": "H200", "repeats": 2, "serving": [
        {"name": "m/off", "model": "{models}/m", "server_args": ["--a"], "points": [
            {"concurrency": 16, "input_len": 64, "output_len": 16, "num_prompts": 32},
            {"concurrency": 48, "input_len": 64, "output_len": 16, "num_prompts": 96},
            {"concurrency": 128, "input_len": 64, "output_len": 16, "num_prompts": 256}]},
        {"name": "m/on", "model": "{models}/m", "env": {"SGLANG_H20_FP8_MLA": "1"}, "points": [
            {"concurrency": 16, "input_len": 64, "output_len": 16, "num_prompts": 32}]}]})
    rec = runner.run(conf, tmp_path, models="/models")
    off, on = FakeServer.instances
    assert (off.model, off.port, on.port) == ("/models/m", 30000, 30001)
    assert off.env["SGLANG_H20_FP8_MLA"] == "off" and on.env["SGLANG_H20_FP8_MLA"] == "1"
    assert off.calls[0][0] == "m_off.warmup.jsonl"  # one warm-up before the points
    assert all(c[3] == str(tmp_path / "sharegpt.json") for c in off.calls)
    assert len(json.loads((tmp_path / "sharegpt.json").read_text())) == 400  # at least 400, or the largest point's
    pts = rec["points"]
    assert list(pts) == ["serving/m/off/c16", "serving/m/off/c48", "serving/m/off/c128", "serving/m/on/c16"]
    c16 = pts["serving/m/off/c16"]
    # calls 2 and 3: decode median of each bench's own steady lines, not the startup line or earlier benches
    assert c16["metrics"]["decode_tok_s"]["values"] == [2005.0, 3005.0]
    assert c16["metrics"]["output_throughput"] == {"values": [200.0, 300.0], "better": "higher"}
    assert c16["metrics"]["median_itl_ms"]["better"] == "lower"
    assert c16["params"]["concurrency"] == 16 and c16["error"] is None
    assert pts["serving/m/off/c48"]["error"] == "repeat 1: RuntimeError: bench_serving failed (rc=1)"
    assert pts["serving/m/off/c128"]["metrics"]["decode_tok_s"]["values"] == [5005.0, 6005.0]  # run went on
    # each repeat's progress line; why a decode rate is missing only where it is
    out = capsys.readouterr().out.splitlines()
    lines = [l for l in out if re.search(r"serving/m/off/c16 repeat ./2: ", l)]
    assert [re.search(r"repeat (./2)", l)[1] for l in lines] == ["1/2", "2/2"], lines
    assert [l[-10:] for l in out if re.search(r"serving/m/off/c16 repeat ./2$", l)] == ["repeat 1/2", "repeat 2/2"]
    assert all("decode_tok_s=" in l and "no decode lines" not in l for l in lines), lines


def test_runner_records_a_server_that_fails_to_start(tmp_path, monkeypatch, capsys):
    class Broken(FakeServer):
        def __enter__(self):
            raise RuntimeError("server exited with 1 before ready")

    monkeypatch.setattr(serving, "Server", Broken)
    conf = cfg.parse(minimal(kernel=[]))
    rec = runner.run(conf, tmp_path, models="/m")
    assert rec["points"]["serving/m/off/c16"]["error"] == "server: RuntimeError: server exited with 1 before ready"
    assert "] serving/m/off FAILED: RuntimeError: server exited with 1 before ready\n" in capsys.readouterr().out


def test_runner_records_a_server_that_dies_between_repeats(tmp_path, monkeypatch):
    """A live server process benches; once it has exited, the next repeat records its exit code and ends the point
    instead of benching a dead port."""
    class Dies(FakeServer):
        def bench(self, *a, **k):
            out = super().bench(*a, **k)
            if len(self.calls) == 2:  # the warm-up and c16's repeat 1 ran; then the process is gone
                self.proc = SimpleNamespace(poll=lambda: 3, returncode=3)
            return out

        def __enter__(self):
            self.proc = SimpleNamespace(poll=lambda: None, returncode=None)
            return super().__enter__()

    monkeypatch.setattr(serving, "Server", Dies)
    FakeServer.instances = []
    conf = cfg.parse({"name": "t", "gpu": "H200", "repeats": 2, "serving": [
        {"name": "m/off", "model": "{models}/m", "points": [
            {"concurrency": 16, "input_len": 64, "output_len": 16, "num_prompts": 32}]}]})
    point = runner.run(conf, tmp_path, models="/m")["points"]["serving/m/off/c16"]
    assert point["metrics"]["output_throughput"]["values"] == [200.0]  # repeat 1, on the live server
    assert point["error"].startswith("repeat 2: RuntimeError: server exited with 3; log tail:"), point["error"]
    assert len(FakeServer.instances[0].calls) == 2


# --- report.md ------------------------------------------------------------------------------------------------

def test_report_numbers_and_one_line_errors():
    assert [report._num(x) for x in (None, 8436.2, 1000.0, -1234.4, 999.94, 12.34, 10.0, 9.87654, -0.5)] == [
        "-", "8,436", "1,000", "-1,234", "999.9", "12.3", "10.0", "9.877", "-0.500"]
    assert report._one_line("a\n   b\tc") == "a b c"
    assert report._one_line("x" * 300) == "x" * 300 and report._one_line("x" * 301) == "x" * 300 + " ..."
    assert report._one_line("ab cd", limit=3) == "ab  ..."


def test_report_summary_counts_each_verdict():
    def rows(*verdicts):
        return [cmp.Row(f"p{i}", "m", "higher", v) for i, v in enumerate(verdicts)]
    assert report._summary(rows("regression", "regression", "improvement", "new", "same"), {"x": "boom"}) == \
        "2 regressions, 1 improvement, 1 new, 1 failed points"
    assert report._summary(rows("regression", "improvement", "improvement", "missing"), {}) == \
        "1 regression, 1 missing, 2 improvements"  # in the verdicts' order of severity
    assert report._summary(rows("same", "same"), {}) == "no changes"


def test_report_without_a_baseline_names_it_and_folds_long_errors():
    run = load("run_clean")
    run["points"]["serving/x/c1"] = {"kind": "serving", "metrics": {}, "error": "server: boom\n" + "y" * 400}
    md = report.markdown(run, None, cmp.compare(run, {"points": {}}), [])
    assert "No baseline given: every metric is `new`." in md and "Warning: GPUs differ" not in md
    assert f"| sglang | {run['versions']['sglang']} | - |" in md and "| git commit | " in md
    (failed,) = [ln for ln in md.splitlines() if ln.startswith("- `serving/x/c1`")]
    assert failed == "- `serving/x/c1`: server: boom " + "y" * 287 + " ..."  # 300 characters
    other = {**load("baseline"), "gpu": "NVIDIA H20"}
    assert "**Warning: GPUs differ** (current NVIDIA H200, baseline NVIDIA H20)." in report.markdown(
        run, other, cmp.compare(run, other), [])


def test_report_rows_name_both_runs_and_percentages_are_exact():
    """The header table has each run's own commit and date; changes and tolerances are percent of 1."""
    run, base = load("run_clean"), load("baseline")
    md = report.markdown(run, base, cmp.compare(run, base), [])
    assert f"| git commit | {run['git_commit']} | {base['git_commit']} |" in md
    assert f"| date (UTC) | {run['date']} | {base['date']} |" in md
    assert [report._pct(x) for x in (0.25, 0.03, None)] == ["25.0%", "3.0%", "-"]
    assert [report._pct(x, signed=True) for x in (-0.104, 0.5, math.inf, -math.inf)] == [
        "-10.4%", "+50.0%", "+inf", "-inf"]


def test_serving_curves_are_one_per_config_sorted_by_concurrency():
    """One curve per model/arm (the point id less its concurrency), (concurrency, median, min, max) in concurrency
    order; a kernel point carrying the same metric, or a serving point without its values, draws nothing."""
    run = load("run_clean")
    run["points"]["kernel/mla_decode"]["metrics"]["output_throughput"] = {"values": [1.0, 2.0]}
    run["points"]["serving/dsv3-4l/features-on/c48"]["metrics"]["output_throughput"] = {"values": []}
    curves = report.serving_curves(run, "output_throughput")
    assert sorted(curves) == [f"serving/{m}/features-{arm}" for m in ("dsv3-4l", "dsv3-ep16-slice")
                              for arm in ("off", "on")]
    assert curves["serving/dsv3-4l/features-off"] == [(16, 3169.787, 3161.956, 3193.007),
                                                      (48, 7690.7, 7676.249, 7794.665),
                                                      (128, 14411.806, 14374.334, 14485.714)]
    assert [c for c, *_ in curves["serving/dsv3-4l/features-on"]] == [16, 128]


def test_report_without_a_baseline_still_plots_the_run(tmp_path):
    run = load("run_clean")
    written = report.write_report(tmp_path, run, None, cmp.compare(run, {"points": {}}))
    assert [p.name for p in written] == ["report.md", report.THROUGHPUT_PNG, report.ITL_PNG]
    for png in written[1:]:
        assert_png(png)


# --- CLI --------------------------------------------------------------------------------------------------------

def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "sglang_h20.nightly", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def assert_png(path: Path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC), path


def test_cli_compare_regression_fixture(tmp_path):
    p = cli("compare", DATA / "run_regression.json", DATA / "baseline.json", "--out", tmp_path)
    assert p.returncode == 1, p.stderr
    assert "REGRESSION serving/dsv3-4l/features-on/c48 output_throughput: -10.4% (tolerance 3.0%)\n" in p.stdout
    assert p.stdout.endswith(f"6 regressions, 0 failed points; report: {tmp_path / 'report.md'}\n")
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Nightly h200: 6 regressions")
    assert "9d3f2a1b8c7e46d5a4b3c2d1e0f9a8b7c6d5e4f3" in md and "NVIDIA H200" in md and "0.5.17" in md
    assert "--config h200" in md and "2026-11-30T02:15:31" in md
    # the regressed point's table comes before every point that only has 'same' rows
    assert md.index("### `serving/dsv3-4l/features-on/c48` (regression)") < md.index("(same)")
    assert "| output_throughput (higher is better) | 8,436 | 7,556 | -10.4% | 3.0% | **regression** |" in md
    assert "skipped: not found: benchmark/kernels/bench_grouped_gemm.py" in md
    for png in ("throughput.png", "itl.png"):
        assert_png(tmp_path / png)


def test_cli_compare_clean_fixture(tmp_path):
    p = cli("compare", DATA / "run_clean.json", DATA / "baseline.json", "--out", tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 regressions, 0 failed points" in p.stdout
    assert (tmp_path / "report.md").read_text().startswith("# Nightly h200: no changes")
    for png in ("throughput.png", "itl.png"):
        assert_png(tmp_path / png)


def test_cli_compare_fails_on_failed_points(tmp_path):
    run = load("run_clean")
    run["points"]["serving/dsv3-4l/features-off/c128"] = {"kind": "serving", "metrics": {},
                                                          "error": "server: RuntimeError: boom"}
    (tmp_path / "run.json").write_text(json.dumps(run))
    p = cli("compare", tmp_path / "run.json", DATA / "baseline.json", "--out", tmp_path / "r")
    assert p.returncode == 1 and "FAILED serving/dsv3-4l/features-off/c128" in p.stdout


def test_cli_usage_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ngpu = "H200"\nrepeats = 3\ncolour = "blue"\n')
    p = cli("run", "--config", bad, "--out", tmp_path / "o")
    assert p.returncode == 2 and "unknown key(s) 'colour'" in p.stderr
    p = cli("run", "--config", "h200", "--out", tmp_path / "o", "--only", "serving/")
    assert p.returncode == 2 and "needs --models" in p.stderr
    p = cli("compare", tmp_path / "missing.json", DATA / "baseline.json", "--out", tmp_path)
    assert p.returncode == 2 and "cannot read" in p.stderr
    assert cli("run", "--out", tmp_path).returncode == 2  # argparse: --config is required
    assert cli("run", "--config", "h200", "--out", tmp_path, "--repeats", "0").returncode == 2


def test_cli_help():
    p = cli("run", "--help")
    assert p.returncode == 0 and "--baseline" in p.stdout and "h20, h200" in p.stdout


@pytest.mark.parametrize("tflops, status", [(511.0, 0), (440.0, 1)])
def test_cli_run_kernel_only_against_baseline(tmp_path, tflops, status):
    (tmp_path / "bench.py").write_text(
        f"import json, sys\njson.dump({{'latency_us': 41.7, 'tflops': {tflops}}}, open(sys.argv[1], 'w'))\n")
    (tmp_path / "k.toml").write_text(
        'name = "k"\ngpu = "H200"\n[[kernel]]\nname = "mla_decode"\n'
        f'command = "{sys.executable} bench.py {{out}}"\nmetrics = {{ latency_us = "lower", tflops = "higher" }}\n')
    p = cli("run", "--config", "k.toml", "--out", "out", "--baseline", DATA / "baseline.json", "--only", "kernel/mla",
            cwd=tmp_path)
    assert p.returncode == status, p.stdout + p.stderr
    assert "kernel/mla_decode repeat 3/3" in p.stdout  # progress per repeat
    rec = json.loads((tmp_path / "out" / "run.json").read_text())
    assert rec["points"]["kernel/mla_decode"]["metrics"]["tflops"]["values"] == [tflops] * 3
    assert rec["command"] == shlex.join(["python", "-m", "sglang_h20.nightly", "run", "--config", "k.toml", "--out",
                                         "out", "--baseline", str(DATA / "baseline.json"), "--only", "kernel/mla"])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "serving/" not in md and "missing" not in md  # --only also narrows the baseline
    assert ("**regression**" in md) == (status == 1)


FAKE_SERVER = r'''
import http.server, pathlib, sys
marker = pathlib.Path(sys.argv[1])
if not marker.exists():  # first launch: dies as SGLang does when torch.distributed's port is taken
    marker.write_text("1")
    print("torch.distributed.DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use")
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
'''


class _FakeServer(serving.Server):
    """serving.Server around a stand-in process (no SGLang): the launch/retry/stop logic alone."""

    def __init__(self, tmp_path, port, die_with=None):
        super().__init__("unused", [], tmp_path / "server.log", port=port, ready_timeout_s=30)
        self.script, self.marker = tmp_path / "fake.py", tmp_path / "launched"
        self.script.write_text(FAKE_SERVER if die_with is None else
                               f"print({die_with!r}); raise SystemExit(1)")

    @property
    def command(self):
        return [sys.executable, str(self.script), str(self.marker), str(self.port)]


def test_server_relaunches_once_when_its_port_was_taken(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _FakeServer(tmp_path, port) as srv:
        assert srv.start_s is not None and srv.proc.poll() is None
    assert srv.proc.poll() is not None  # stopped on exit
    assert tmp_path.joinpath("launched").exists()


def test_server_other_deaths_are_not_retried(tmp_path):
    with pytest.raises(RuntimeError, match="exited with 1 before ready") as e:
        with _FakeServer(tmp_path, 1, die_with="CUDA out of memory"):
            pass
    assert "CUDA out of memory" in str(e.value) and "EADDRINUSE" not in str(e.value)


# --- bench_serving command --------------------------------------------------------------------------------------

def _bench_command(monkeypatch, tmp_path, **kw) -> list[str]:
    """The bench_serving command run_bench_serving builds (the subprocess is replaced; its record is faked)."""
    seen = {}

    def fake_run(cmd, **_):
        seen["cmd"] = cmd
        Path(cmd[cmd.index("--output-file") + 1]).write_text(json.dumps({"output_throughput": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(serving.subprocess, "run", fake_run)
    rec = serving.run_bench_serving("http://127.0.0.1:30000", "/m", tmp_path / "b.jsonl", num_prompts=8,
                                    input_len=4096, output_len=512, concurrency=8, **kw)
    assert rec["output_throughput"] == 1.0 and rec["command"] == " ".join(seen["cmd"])
    return seen["cmd"]


def test_bench_serving_measures_from_an_empty_prefix_cache(monkeypatch, tmp_path):
    """Same seed, same prompts: without the flush a run after a warm-up would prefill from the radix cache."""
    cmd = _bench_command(monkeypatch, tmp_path)
    assert cmd[1:3] == ["-m", "sglang.bench_serving"] and "--flush-cache" in cmd
    assert "--flush-cache" not in _bench_command(monkeypatch, tmp_path, flush_cache=False)

    # The flags parse with the installed SGLang's own bench_serving parser, and the flush is on there.
    # Its module imports HF `datasets` for the MMMU loader; the CI set has no `datasets`, and parsing needs none.
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        monkeypatch.setitem(sys.modules, "datasets", SimpleNamespace(load_dataset=None))
    import sglang.benchmark.serving as bs

    parsed = {}
    monkeypatch.setattr(bs, "run_benchmark", lambda args: parsed.setdefault("args", args))
    monkeypatch.setattr(sys, "argv", ["bench_serving"] + cmd[3:])
    bs.cli_main()
    args = parsed["args"]
    assert args.flush_cache is True and args.max_concurrency == 8 and args.random_input_len == 4096


def test_hang_watch_dumps_every_thread_stack_of_a_silent_server(tmp_path):
    """A server whose log stays silent during a bench is ended by SIGABRT, and faulthandler
    (PYTHONFAULTHANDLER, set for every server) leaves each thread's stack, the waiting one included."""
    import threading

    log = tmp_path / "server.log"
    srv = serving.Server("m", [], log, hang_s=1.0)
    code = ("import subprocess, sys, threading, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time\\ndef scheduler_waits():\\n"
            "    time.sleep(120)\\nscheduler_waits()'])\n"
            "threading.Thread(target=lambda: time.sleep(120), name='migration', daemon=True).start()\n"
            "print('up', flush=True)\n"
            "def decode_loop_waits():\n"
            "    time.sleep(120)\n"
            "decode_loop_waits()\n")
    with open(log, "a") as f:  # as Server._launch opens it
        srv.proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT,
                                    env=srv.env, start_new_session=True)
    done = threading.Event()
    watcher = threading.Thread(target=srv._watch, args=(done,))
    watcher.start()
    watcher.join(30)
    assert not watcher.is_alive()
    srv.proc.wait(30)
    assert srv.hung and "silent" in srv.hung
    text = log.read_text()
    assert "[sglang-h20 hang watch]" in text and "nvidia-smi:" in text
    assert "decode_loop_waits" in text and text.count("Thread 0x") + text.count("Current thread 0x") >= 3
    # the child's dump comes whole and first, then the parent's: no interleaving
    assert text.index("scheduler_waits") < text.index("stacks of pid " + str(srv.proc.pid)) < \
        text.index("decode_loop_waits")
    assert srv.proc.returncode != 0


def test_hang_watch_stays_quiet_while_the_log_grows(tmp_path):
    import threading

    log = tmp_path / "server.log"
    srv = serving.Server("m", [], log, hang_s=3.0)
    code = "import time\nfor i in range(6):\n    print(i, flush=True); time.sleep(1)\n"
    with open(log, "w") as f:
        srv.proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT,
                                    env=srv.env, start_new_session=True)
    done = threading.Event()
    watcher = threading.Thread(target=srv._watch, args=(done,))
    watcher.start()
    srv.proc.wait(30)
    done.set()
    watcher.join(10)
    assert srv.hung is None and srv.proc.returncode == 0


def test_hang_watch_waits_for_hang_s_of_silence(tmp_path, monkeypatch):
    """Silence shorter than hang_s is not a hang; a live server silent for longer gets one stack dump. The watch's
    2 s waits run on a fake clock."""
    log = tmp_path / "server.log"
    log.write_text("up\n")
    clock = [1000.0]
    monkeypatch.setattr(serving.time, "monotonic", lambda: clock[0])

    class Waits:  # done.wait(s): s seconds pass; set after n waits
        def __init__(self, n):
            self.n = n

        def wait(self, s):
            clock[0] += s
            self.n -= 1
            return self.n < 0

    for hang_s, dumps in ((5.0, ["log silent for 5 s during a bench"]), (30.0, [])):  # 20 s of silence each
        srv = serving.Server("m", [], log, hang_s=hang_s)
        said = []
        monkeypatch.setattr(srv, "dump_stacks", said.append)
        srv._watch(Waits(10))
        assert said == dumps, hang_s


def test_a_server_never_started_exits_quietly(tmp_path):
    """__exit__ after a failed start (no process yet) stops nothing and raises nothing."""
    srv = serving.Server("m", [], tmp_path / "server.log")
    assert srv.proc is None
    srv.__exit__(None, None, None)


def test_graphs_up_to_the_concurrency_unless_the_args_set_graphs():
    base = "--load-format dummy --mem-fraction-static 0.6"
    assert serving.graphs_up_to(base, 128) == base + " --cuda-graph-max-bs 128"
    for own in ("--cuda-graph-max-bs 64", "--cuda-graph-max-bs-decode=32", "--disable-cuda-graph",
                "--cuda-graph-bs 1 2 4"):
        assert serving.graphs_up_to(f"{base} {own}", 128) == f"{base} {own}"  # the caller's choice stands


def test_output_ids_read_either_place_sglang_puts_them():
    """Greedy-agreement checks compare these ids: top level first (SGLang 0.5.17), else meta_info; neither is an error
    that names the keys the response had, not an empty list that would agree with anything."""
    assert serving.output_ids({"output_ids": (5, 6), "meta_info": {"output_ids": [7]}}) == [5, 6]
    assert serving.output_ids({"text": "x", "meta_info": {"output_ids": [7, 8]}}) == [7, 8]
    with pytest.raises(KeyError, match=r"no output_ids in /generate response keys \['meta_info', 'text'\]"):
        serving.output_ids({"text": "x", "meta_info": {}})


@pytest.mark.parametrize("rc,writes", [(1, True), (0, False)])
def test_bench_serving_that_fails_or_writes_nothing_is_an_error_with_its_log(monkeypatch, tmp_path, rc, writes):
    """A non-zero exit is a failure even when a record was written (it may be a partial run's), and so is a clean
    exit without one; either way the error carries the log's tail."""
    def fake_run(cmd, stdout=None, **_):
        stdout.write("Traceback: the bench's own error\n")
        if writes:
            Path(cmd[cmd.index("--output-file") + 1]).write_text(json.dumps({"output_throughput": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, rc)

    monkeypatch.setattr(serving.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match=rf"bench_serving failed \(rc={rc}\); log tail:\n.*the bench's own error"):
        serving.run_bench_serving("http://127.0.0.1:30000", "/m", tmp_path / "b.jsonl", num_prompts=8,
                                  input_len=16, output_len=8)


def test_server_post_sends_its_json_body_to_the_named_endpoint(monkeypatch, tmp_path):
    """The profilers' /start_profile and /stop_profile calls: the body as JSON ({} when none), the reply's text."""
    sent = []

    class Reply:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            return b'{"ok": true}'

    def fake_urlopen(req, timeout):
        sent.append((req.full_url, req.data, req.get_header("Content-type"), timeout))
        return Reply()

    monkeypatch.setattr(serving.urllib.request, "urlopen", fake_urlopen)
    monkeypatch.delenv("SGLANG_H20_PORT_OFFSET", raising=False)
    srv = serving.Server("/m", [], tmp_path / "s.log", port=30100)
    assert srv.post("/start_profile", {"num_steps": 3}, timeout=5) == '{"ok": true}'
    assert srv.post("/stop_profile") == '{"ok": true}'
    assert sent == [("http://127.0.0.1:30100/start_profile", b'{"num_steps": 3}', "application/json", 5),
                    ("http://127.0.0.1:30100/stop_profile", b"{}", "application/json", 600)]
