"""swapab_e2e.py's arm bookkeeping: repeated arms get their own label and pair with the 'off' of their repeat."""
from __future__ import annotations

import json
import sys
from pathlib import Path

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


def test_another_anchor_pairs_every_arm_with_its_own_repeat():
    """--anchor on: what SBO adds on top of swapAB ('sbo+on' against 'on', 'sbo+on#2' against 'on#2')."""
    ratios = e2e.compare([arm("on", 100.0, 20.0), arm("sbo+on", 105.0, 19.0), arm("off", 80.0, 25.0),
                          arm("on#2", 50.0, 40.0), arm("sbo+on#2", 40.0, 44.0)], anchor="on")
    assert ratios["sbo+on"]["32"] == pytest.approx({"output_throughput_ratio": 1.05, "median_itl_ratio": 0.95})
    assert ratios["off"]["32"] == pytest.approx({"output_throughput_ratio": 0.8, "median_itl_ratio": 1.25})
    assert ratios["sbo+on#2"]["32"] == pytest.approx({"output_throughput_ratio": 0.8, "median_itl_ratio": 1.1})
    assert set(ratios) == {"sbo+on", "off", "sbo+on#2"}


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


class FakeServer:
    """sglang_h20.nightly.serving.Server as run_arm uses it: each bench writes the server's decode lines (running =
    the concurrency, gen throughput = 10 x concurrency) and returns bench_serving's numbers; the plugin's lines
    are in the log from the start."""
    benches: list = []
    envs: list = []

    def __init__(self, model, args, log, env=None, port=0):
        self.log, self.start_s = Path(log), 5.0
        FakeServer.envs.append(dict(env or {}))

    def __enter__(self):
        self.log.write_text("[sglang-h20 pid 1] hooks applied: 9/9 (x)\n"
                            "[sglang-h20 pid 1] swapab: MoE M=4 -> ours (swapab)\n"
                            "[sglang-h20 pid 1] sbo: MoE 8 tokens x top-8 over 16 experts -> ours (tail combine in the "
                            "down GEMM)\n"
                            "[sglang-h20 pid 1] swapab: dense linear M=4 N=2112 K=7168 -> ours (swapab)\n"
                            "unrelated line -> ours\n")
        return self

    def __exit__(self, *exc):
        pass

    def bench(self, path, num_prompts, input_len, output_len, concurrency, dataset_path):
        FakeServer.benches.append((Path(path).name, num_prompts, output_len, concurrency))
        with open(self.log, "a") as f:
            for running in (1, concurrency, concurrency):  # a ramp line below 0.9 x concurrency, then steady
                f.write(f"Decode batch, #running-req: {running}, cuda graph: True, "
                        f"gen throughput (token/s): {10.0 * running}\n")
        return {"output_throughput": 5.0 * concurrency, "median_itl_ms": 20.0, "p99_itl_ms": 30.0,
                "median_ttft_ms": 100.0, "mean_ttft_ms": 110.0, "p90_ttft_ms": 150.0, "std_ttft_ms": 25.0,
                "duration": 1.0, "completed": num_prompts, "p99_e2e_latency_ms": 9.0}


def e2e_args(tmp_path, **kw):
    ns = dict(out=tmp_path, model="m", server_args="--load-format dummy", base_env={"B": "1"}, input_len=256,
              output_len=64, waves=2, min_prompts=16)
    ns.update(kw)
    return e2e.argparse.Namespace(**ns)


def test_run_arm_warms_up_then_benches_each_level_and_reads_its_decode_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e, "Server", FakeServer)
    FakeServer.benches, FakeServer.envs = [], []
    rec = e2e.run_arm("on", e2e_args(tmp_path), {"SGLANG_H20_SWAPAB": "on"}, [4, 48], 1e9, tmp_path / "s.json", 1)
    # warm-up at the top level with 16 output tokens; then max(min_prompts, waves x c) prompts per level
    assert FakeServer.benches == [("warmup.jsonl", 48, 16, 48), ("c4.jsonl", 16, 64, 4), ("c48.jsonl", 96, 64, 48)]
    assert FakeServer.envs == [{"B": "1", "SGLANG_H20_SWAPAB": "on"}]
    assert list(rec["levels"]) == [4, 48] and rec["levels"][48]["output_throughput"] == 240.0
    # TTFT's spread beside its median (a hook that slows some prefills shows there first); not every key of the run
    assert {k: rec["levels"][4][k] for k in ("median_ttft_ms", "mean_ttft_ms", "p90_ttft_ms", "std_ttft_ms")} == {
        "median_ttft_ms": 100.0, "mean_ttft_ms": 110.0, "p90_ttft_ms": 150.0, "std_ttft_ms": 25.0}
    assert "p99_e2e_latency_ms" not in rec["levels"][4]
    # each level's own lines, the ramp line (1 running) left out: not the warm-up's, not the other level's
    assert rec["levels"][4]["decode_only_tok_s"] == 40.0 and rec["levels"][48]["decode_only_tok_s"] == 480.0
    assert rec["server_start_s"] == 5.0 and 0 <= rec["first_level_s"] <= rec["wall_s"]
    assert rec["hooks_applied"] == ["hooks applied: 9/9"] and len(rec["plugin_log_lines"]) == 4
    assert rec["swapab_ours_lines"] == ["[sglang-h20 pid 1] swapab: MoE M=4 -> ours (swapab)"]
    assert len(rec["sbo_ours_lines"]) == 1 and "sbo: MoE 8 tokens" in rec["sbo_ours_lines"][0]
    assert len(rec["dense_ours_lines"]) == 1 and "dense linear M=4" in rec["dense_ours_lines"][0]


def test_run_arm_stops_after_its_first_level_once_its_budget_is_spent(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "Server", FakeServer)
    FakeServer.benches = []
    rec = e2e.run_arm("off", e2e_args(tmp_path), {}, [4, 48, 128], 0.0, tmp_path / "s.json", 1)
    assert list(rec["levels"]) == [4] and [b[0] for b in FakeServer.benches] == ["warmup.jsonl", "c4.jsonl"]
    assert "skipping concurrency 48 and later" in capsys.readouterr().out
    first = rec["first_level_s"]
    assert first is not None and first <= rec["wall_s"]


def write_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"n_routed_experts": 16, "num_experts_per_tok": 8,
                                                   "hidden_size": 7168, "moe_intermediate_size": 2048}))
    return model


def test_main_pairs_the_arms_level_by_level_and_keeps_what_finished(tmp_path, monkeypatch):
    """The second arm runs only the levels the first finished; 'on' with --table carries it; the forced table
    names ours at every group count up to the model's experts; the record is written after each arm."""
    monkeypatch.setattr(e2e, "Server", FakeServer)
    FakeServer.benches, FakeServer.envs = [], []
    model, table = write_model(tmp_path), tmp_path / "t.json"
    table.write_text(json.dumps({"gpu": "x", "entries": [{"layout": "dense", "m": 1}]}))
    out = tmp_path / "out"
    runs = []
    real = e2e.run_arm

    def arm(name, args, env, levels, budget_s, sharegpt, port):
        runs.append((name, list(levels), budget_s))
        return real(name, args, env, levels, 0.0 if name == "off" else budget_s, sharegpt, port)  # off: one level
    monkeypatch.setattr(e2e, "run_arm", arm)
    monkeypatch.setattr(sys, "argv", ["swapab_e2e.py", "--model", str(model), "--out", str(out), "--no-layer",
                                      "--arms", "off", "on", "--concurrency", "4", "48", "--table", str(table),
                                      "--deadline-s", "1000"])
    assert e2e.main() == 0
    assert [(n, lv) for n, lv, _ in runs] == [("off", [4, 48]), ("on", [4])]
    assert 400 < runs[0][2] <= 500 and runs[1][2] > 900  # what is left, split over the arms still to run
    assert FakeServer.envs[1][e2e.TABLE_ENV] == str(table.resolve()) and e2e.TABLE_ENV not in FakeServer.envs[0]
    rec = json.loads((out / "swapab_e2e.json").read_text())
    assert [a["arm"] for a in rec["arms"]] == ["off", "on"] and rec["partial"] is False
    assert rec["table_on_arm"] == str(table) and rec["workload"]["concurrency"] == [4, 48]
    assert rec["vs_off"]["on"]["4"]["output_throughput_ratio"] == 1.0 and set(rec["vs_off"]["on"]) == {"4"}
    forced = json.loads((out / "forced_table.json").read_text())["entries"]
    assert {e["groups"] for e in forced} == {1, 2, 4, 8, 16} and {e["best"] for e in forced} == {"swapab"}
    assert {(e["n"], e["k"]) for e in forced} == {(4096, 7168), (7168, 2048)}


def test_main_records_the_anchor_and_refuses_one_it_does_not_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "Server", FakeServer)
    model, out = write_model(tmp_path), tmp_path / "out"
    argv = ["swapab_e2e.py", "--model", str(model), "--out", str(out), "--no-layer", "--concurrency", "4"]
    monkeypatch.setattr(sys, "argv", argv + ["--arms", "on", "sbo+on", "--anchor", "on"])
    assert e2e.main() == 0
    rec = json.loads((out / "swapab_e2e.json").read_text())
    assert rec["anchor"] == "on" and "vs_off" not in rec and set(rec["vs_on"]) == {"sbo+on"}
    assert FakeServer.envs[-1]["SGLANG_H20_SBO"] == "on" and FakeServer.envs[-1]["SGLANG_H20_SWAPAB"] == "on"
    monkeypatch.setattr(sys, "argv", argv + ["--arms", "on", "sbo+on", "--anchor", "off"])
    with pytest.raises(SystemExit):
        e2e.main()
    assert "--anchor off: not one of --arms on sbo+on" in capsys.readouterr().err


def test_main_skips_an_arm_that_cannot_reach_its_first_level(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(e2e, "Server", FakeServer)
    monkeypatch.setattr(e2e, "arm_fits", lambda left, last: False)
    model, out = write_model(tmp_path), tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["swapab_e2e.py", "--model", str(model), "--out", str(out), "--no-layer",
                                      "--arms", "off", "on", "--concurrency", "4"])
    assert e2e.main() == 0
    assert "deadline: skipping arm on" in capsys.readouterr().out
    rec = json.loads((out / "swapab_e2e.json").read_text())
    assert [a["arm"] for a in rec["arms"]] == ["off"] and rec["partial"] is True and rec["vs_off"] == {}
    assert rec["table_on_arm"] == "plugin default"


def test_moe_only_without_a_table_anywhere_stops_with_the_reason(tmp_path, monkeypatch):
    from sgl_kernel_ext import gemm_table

    monkeypatch.setattr(gemm_table, "find_table", lambda gpu: None)
    with pytest.raises(SystemExit, match="moe-only needs a table"):
        e2e.without_dense(None, tmp_path)
