"""The serving profilers' trace summary (trace_summary.py, used by prefill_profile.py and decode_profile.py):
per-unit kernel totals, launches, top lists and the difference between arms, on a synthetic Chrome trace (the
format torch.profiler writes); decode_profile.py's control flow against a fake server."""
from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import pytest

from repo_scripts import load_script

ts = load_script("benchmark/serving/trace_summary.py")
decode = load_script("benchmark/serving/decode_profile.py")


def _trace(path: Path, kernels: dict[str, float], cpu: dict[str, float]) -> Path:
    ev = [{"ph": "X", "cat": "kernel", "name": n, "ts": 10.0 * i, "dur": us} for i, (n, us) in enumerate(kernels.items())]
    ev += [{"ph": "X", "cat": "cpu_op", "name": n, "ts": 0, "dur": us} for n, us in cpu.items()]
    ev += [{"ph": "i", "cat": "kernel", "name": "instant, no duration"}, {"ph": "X", "cat": "gpu_memcpy",
                                                                          "name": "Memcpy HtoD", "dur": 9e9}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path


def test_summary_is_per_unit_and_the_difference_finds_the_extra_kernel(tmp_path):
    mla = ts.summarize(ts.load_trace(_trace(tmp_path / "mla.json.gz", {"mla_paged": 4000.0, "gemm": 2000.0},
                                            {"aten::bmm": 300.0})), 2)
    mha = ts.summarize(ts.load_trace(_trace(tmp_path / "mha.json.gz", {"ragged_prefill": 1000.0, "gemm": 2000.0,
                                                                       "fp8_gemm_kv_b": 6000.0},
                                            {"plan": 1600.0})), 2)
    assert mla["gpu_kernel_ms_per_prefill"] == pytest.approx(3.0)  # (4 + 2) ms over 2 prefills; memcpy not a kernel
    assert mha["gpu_kernel_ms_per_prefill"] == pytest.approx(4.5)
    assert mha["kernel_launches_per_prefill"] == pytest.approx(1.5)
    assert mha["kernels"][0] == {"name": "fp8_gemm_kv_b", "ms_per_prefill": pytest.approx(3.0),
                                 "launches_per_prefill": 0.5}
    assert mha["cpu_ops"] == [{"name": "plan", "ms_per_prefill": pytest.approx(0.8)}]
    diff = ts.compare(mla, mha)
    assert [r["name"] for r in diff[:2]] == ["fp8_gemm_kv_b", "mla_paged"]
    assert diff[0]["diff_ms"] == pytest.approx(3.0) and diff[1]["diff_ms"] == pytest.approx(-2.0)
    assert {r["name"]: r["diff_ms"] for r in diff}["gemm"] == 0.0


def test_step_unit_and_kernel_span(tmp_path):
    ev = ts.load_trace(_trace(tmp_path / "d.json.gz", {"a": 5.0, "b": 5.0, "c": 5.0}, {}))  # at 0, 10, 20 us
    s = ts.summarize(ev, 4, unit="step")
    assert s["gpu_kernel_ms_per_step"] == pytest.approx(15e-3 / 4)
    assert s["kernels"][0]["launches_per_step"] == 0.25
    assert decode.kernel_span_ms(ev) == pytest.approx(25e-3)  # first start 0 to last end 25 us: 10 us of gaps
    late = [{**e, "ts": e["ts"] + 1000.0} if "ts" in e else e for e in ev]  # a trace that does not start at 0
    assert decode.kernel_span_ms(late) == pytest.approx(25e-3)
    assert decode.kernel_span_ms([]) == 0.0


def test_wait_for_traces_matches_the_stage(tmp_path):
    (tmp_path / "x-TP-0-EXTEND.trace.json.gz").write_bytes(b"1")
    assert ts.wait_for_traces(tmp_path, timeout_s=0.5, match="DECODE") == []
    (tmp_path / "x-TP-0-DECODE.trace.json.gz").write_bytes(b"1")
    assert [p.name for p in ts.wait_for_traces(tmp_path, timeout_s=5, match="DECODE")] == ["x-TP-0-DECODE.trace.json.gz"]


def test_all_decoding_reads_the_decode_lines():
    line = ("[2026-12-02 23:02:26] Decode batch, #running-req: {n}, #token: 34816, token usage: 0.00, cuda graph: True, "
            "gen throughput (token/s): 387.06, #queue-req: 0\n")
    assert not decode.all_decoding("Prefill batch, #new-seq: 8\n" + line.format(n=31), 32)
    assert decode.all_decoding(line.format(n=31) + line.format(n=32), 32)


class FakeServer:
    """Writes decode lines while a batch generates and a DECODE trace when profiling starts, as SGLang does."""
    posts: list = []

    def __init__(self, model, args, log, env=None, port=0, ready_timeout_s=0):
        self.log, self.start_s = Path(log), 1.0
        FakeServer.started = (list(args), dict(env or {}))

    def __enter__(self):
        self.log.write_text("")
        return self

    def __exit__(self, *exc):
        pass

    def generate_batch(self, texts, max_new_tokens=1):
        if len(texts) > 1:
            with open(self.log, "a") as f:
                f.write(f"Decode batch, #running-req: {len(texts)}, cuda graph: True, gen throughput (token/s): 9.0\n")
            self.done.wait(10)
        return [{}] * len(texts)

    def post(self, path, body=None):
        FakeServer.posts.append((path, body))
        out = Path(body["output_dir"])
        _trace(out / f"{body['profile_id']}-TP-0-DECODE.trace.json.gz", {"mla": 40.0, "store": 20.0}, {})
        self.done.set()
        return "ok"


def profile_args(out):
    """decode_profile's parsed arguments for profile_arm against the fake server."""
    return decode.argparse.Namespace(model="m", out=out, batch=4, input_len=8, output_len=100, steps=2,
                                     server_args="--load-format dummy", wait_s=20, ready_timeout_s=5, table=None)


def test_profile_arm_profiles_decode_steps_once_all_requests_decode(tmp_path, monkeypatch):
    FakeServer.done = threading.Event()
    monkeypatch.setattr(decode, "Server", FakeServer)
    args = profile_args(tmp_path)
    rec = decode.profile_arm("ours", args, port=1)
    path, body = FakeServer.posts[-1]
    assert path == "/start_profile" and body["num_steps"] == 2 and body["profile_by_stage"]
    assert body["profile_stages"] == ["decode"]
    assert rec["gpu_kernel_ms_per_step"] == pytest.approx(0.03)  # 60 us over 2 steps
    assert rec["gpu_span_ms_per_step"] == pytest.approx(0.02)  # 0 to 40 us (the second kernel inside the first)
    assert rec["kernels"][0]["name"] == "mla"


def test_an_arm_adds_plugin_features_to_a_phase_that_loads_the_plugin(tmp_path, monkeypatch, capsys):
    """'ours+swapab' is the ours phase with swapAB on (the GEMMs are most of a small batch's step); a feature on
    a phase that runs without the plugin, or one not known, stops at parse time with the reason."""
    ours_flags, ours_env, _ = decode.PHASES["ours"]
    assert decode.arm_setup("ours") == (ours_flags, ours_env)
    assert decode.arm_setup("ours+swapab+sbo") == (ours_flags, {**ours_env, "SGLANG_H20_SWAPAB": "on",
                                                                 "SGLANG_H20_SBO": "on"})
    for bad, why in (("flashmla-fp8+swapab", "runs without the plugin"), ("ours+fast", "unknown feature 'fast'"),
                     ("nope", "unknown arm 'nope'")):
        with pytest.raises(ValueError, match=why):
            decode.arm_setup(bad)
        with pytest.raises(SystemExit):
            decode.main(["--model", "m", "--out", str(tmp_path), "--arms", "ours", bad])
        assert why in capsys.readouterr().err
    FakeServer.done = threading.Event()
    monkeypatch.setattr(decode, "Server", FakeServer)
    args = profile_args(tmp_path)
    rec = decode.profile_arm("ours+swapab", args, port=1)
    assert FakeServer.started == (["--load-format", "dummy", *ours_flags], {**ours_env, "SGLANG_H20_SWAPAB": "on"})
    assert rec["env"] == {**ours_env, "SGLANG_H20_SWAPAB": "on"} and (tmp_path / "ours+swapab" / "server.log").exists()


def test_a_named_table_reaches_only_the_swapab_arms(tmp_path, capsys):
    """--table profiles swapAB on a GPU whose shipped table is another's: the '+swapab' arms get it as
    SGLANG_H20_GEMM_TABLE, the others do not; a missing file, or no '+swapab' arm to read it, stops at parse time."""
    table = tmp_path / "t.json"
    table.write_text("{}")
    ours_flags, ours_env, _ = decode.PHASES["ours"]
    assert decode.arm_setup("ours", table) == (ours_flags, ours_env)
    assert decode.arm_setup("ours+swapab", table)[1] == {**ours_env, "SGLANG_H20_SWAPAB": "on",
                                                         decode.TABLE_ENV: str(table.resolve())}
    assert decode.TABLE_ENV == "SGLANG_H20_GEMM_TABLE"
    for arms, table_arg, why in ((["ours", "ours+swapab"], tmp_path / "none.json", "no such file"),
                                 (["ours", "ours+sbo"], table, "none is asked for")):
        with pytest.raises(SystemExit):
            decode.main(["--model", "m", "--out", str(tmp_path), "--arms", *arms, "--table", str(table_arg)])
        assert why in capsys.readouterr().err


def test_record_is_written_after_every_arm(tmp_path, monkeypatch):
    """A deadline that kills the script during the second arm keeps the first arm's record."""
    FakeServer.done = threading.Event()
    monkeypatch.setattr(decode, "Server", FakeServer)
    real = decode.profile_arm

    def arm(name, args, port):
        if name != "ours":
            raise KeyboardInterrupt  # what the step's timeout amounts to
        return real(name, args, port)
    monkeypatch.setattr(decode, "profile_arm", arm)
    monkeypatch.setattr(decode, "stop_servers_on_sigterm", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        decode.main(["--model", "m", "--out", str(tmp_path), "--arms", "ours", "flashmla", "--batch", "2",
                     "--steps", "2", "--output-len", "16", "--server-args", "--load-format dummy"])
    rec = json.loads((tmp_path / "decode_profile.json").read_text())
    assert list(rec["arms"]) == ["ours"] and rec["arms_planned"] == ["ours", "flashmla"]
    assert rec["arms"]["ours"]["gpu_kernel_ms_per_step"] == pytest.approx(0.03)
    assert rec["kernel_differences"] == {}


def test_every_later_arm_is_compared_with_the_first_and_an_arm_error_fails_the_run(tmp_path, monkeypatch, capsys):
    FakeServer.done = threading.Event()
    monkeypatch.setattr(decode, "Server", FakeServer)
    monkeypatch.setattr(decode, "stop_servers_on_sigterm", lambda: None)
    argv = ["--model", "m", "--out", str(tmp_path), "--arms", "ours", "flashmla", "ours+swapab", "--batch", "2",
            "--steps", "2", "--output-len", "16", "--server-args", "--load-format dummy"]
    assert decode.main(argv) == 0
    rec = json.loads((tmp_path / "decode_profile.json").read_text())
    assert set(rec["kernel_differences"]) == {"flashmla_minus_ours", "ours+swapab_minus_ours"}
    real = decode.profile_arm
    monkeypatch.setattr(decode, "profile_arm", lambda name, args, port: {"arm": name, "error": "no trace"}
                        if name == "flashmla" else real(name, args, port))
    assert decode.main(argv) == 1
    assert "flashmla: no trace" in capsys.readouterr().out
    rec = json.loads((tmp_path / "decode_profile.json").read_text())
    assert set(rec["kernel_differences"]) == {"ours+swapab_minus_ours"}  # the failed arm is not compared
    monkeypatch.setattr(decode, "profile_arm", lambda name, args, port: {"arm": name, "error": "no trace"}
                        if name == "ours" else real(name, args, port))
    assert decode.main(argv) == 1
    assert json.loads((tmp_path / "decode_profile.json").read_text())["kernel_differences"] == {}  # no base


def test_cli_refuses_empty_runs_at_the_boundary(tmp_path, capsys, monkeypatch):
    """--steps / --batch below 1, and an output just short of 4 tokens per profiled step, stop at parse time; the
    boundary itself (one step, 4 tokens) runs."""
    for flags, why in ((["--steps", "0"], "at least 1"), (["--batch", "0"], "at least 1"),
                       (["--steps", "5", "--batch", "3", "--output-len", "19"],
                        "too short to decode through 5 profiled steps after all 3 requests are in (use at least 20)")):
        with pytest.raises(SystemExit):
            decode.main(["--model", "m", "--out", str(tmp_path), *flags])
        assert why in capsys.readouterr().err
    FakeServer.done = threading.Event()
    monkeypatch.setattr(decode, "Server", FakeServer)
    monkeypatch.setattr(decode, "stop_servers_on_sigterm", lambda: None)
    assert decode.main(["--model", "m", "--out", str(tmp_path), "--arms", "ours", "--batch", "2", "--steps", "1",
                        "--output-len", "4", "--server-args", "--load-format dummy"]) == 0
