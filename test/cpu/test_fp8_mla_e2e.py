"""fp8_mla_e2e.py --merge: records that each ran some phases (e.g. two GPUs side by side) become one record whose
summary compares them, with every source's provenance kept; conflicting inputs are refused."""
from __future__ import annotations

import json

import pytest

from repo_scripts import load_script

e2e = load_script("benchmark/serving/fp8_mla_e2e.py")


def phase(ids, tok_s, itl):
    bench = {"output_throughput": tok_s, "median_itl_ms": itl, "decode_log": {"median_tok_s": tok_s * 1.1}}
    return {"ids": ids, "ids_repeat": ids, "benches": {"4096x512@16": bench}, "plugin_log_lines": []}


def record(phases, model="/tmp/models/dsv3-ep16-slice", commit="abc1234"):
    return {"model": model, "git_commit": commit, "gpu": "NVIDIA H200", "command": "fp8_mla_e2e.py ...",
            "phases": phases, "skipped": [], "errors": {}}


def test_merge_compares_phases_from_separate_runs(tmp_path):
    a = tmp_path / "gpu0.json"
    b = tmp_path / "gpu1.json"
    a.write_text(json.dumps(record({"ours": phase([[1, 2, 3, 4]], 1500.0, 10.0),
                                    "triton": phase([[1, 2, 9, 4]], 0, 0)}, commit="aaa")))
    b.write_text(json.dumps(record({"flashmla": phase([[1, 2, 3, 4]], 1200.0, 12.0)}, commit="bbb")))
    assert e2e.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    rec = json.loads((tmp_path / "m" / "fp8_mla_e2e.json").read_text())
    s = rec["summary"]
    assert s["ours_over"]["4096x512@16"]["flashmla"] == pytest.approx(1500 / 1200)
    assert s["ours_decode_over"]["4096x512@16"]["flashmla"] == pytest.approx(1650 / 1320)  # decode-only rates
    assert s["server_deaths"] == {}
    assert s["greedy_agreement_vs_triton"]["ours"]["mean_matching_prefix"] == 2  # [1, 2] before 3 != 9
    assert [m["git_commit"] for m in rec["merged_from"]] == ["aaa", "bbb"]
    assert set(rec["phases"]) == {"ours", "triton", "flashmla"} and rec["reference"] == "triton phase"
    assert rec["gpu"] == "NVIDIA H200"  # both sources ran there, though the merge itself ran on a CPU
    png = tmp_path / "m" / "fp8_mla_e2e.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_merge_names_no_gpu_when_the_sources_disagree():
    other = {**record({"flashmla": phase([[1]], 1.0, 1.0)}), "gpu": "NVIDIA H20"}
    rec = e2e.merge_records([record({"ours": phase([[1]], 1.0, 1.0)}), other], ["x", "y"])
    assert rec["gpu"] != "NVIDIA H200" and [m["gpu"] for m in rec["merged_from"]] == ["NVIDIA H200", "NVIDIA H20"]


def test_merge_refuses_a_phase_twice_and_mixed_models():
    one = record({"ours": phase([[1]], 1.0, 1.0)})
    with pytest.raises(ValueError, match="more than one"):
        e2e.merge_records([one, one], ["x", "y"])
    with pytest.raises(ValueError, match="different models"):
        e2e.merge_records([one, record({"flashmla": phase([[1]], 1.0, 1.0)}, model="/other")], ["x", "y"])


def test_model_is_required_without_merge_and_server_env_takes_key_value_words(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        e2e.main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "--model is required (unless --merge)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        e2e.main(["--out", str(tmp_path), "--model", "/m", "--server-env", "A=1", "SGLANG_X"])
    assert e.value.code == 2 and "--server-env takes KEY=VALUE words" in capsys.readouterr().err
    ran = fake_phases(monkeypatch)
    assert e2e.main(["--out", str(tmp_path), "--model", "/m", "--prompts", "0", "--workloads", "1024x256@32",
                     "--phases", "ours", "--server-env", "A=1", "B=x=y"]) == 0
    assert ran[0][1].server_env == {"A": "1", "B": "x=y"}  # split at the first '='


def test_summary_lists_a_dead_server_and_ratios_only_what_ran():
    ours = phase([[1]], 400.0, 26.0)
    ours["server_died"] = {"during": "4096x512@128", "error": "RuntimeError: CUDA error: an illegal memory access"}
    s = e2e.summarize({"ours": ours, "ours-se": phase([[1]], 440.0, 20.0), "flashmla-fp8": phase([[1]], 440.0, 22.0)},
                      None)
    assert s["server_deaths"] == {"ours": ours["server_died"]}
    assert set(s["ours_decode_over"]["4096x512@16"]) == {"flashmla-fp8"}
    assert s["ours-se_decode_over"]["4096x512@16"]["flashmla-fp8"] == pytest.approx(1.0)  # variants get their own


def test_merge_of_an_unreadable_record_exits_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(SystemExit, match=f"^fp8_mla_e2e: --merge {bad}: cannot read JSON"):
        e2e.main(["--merge", str(bad), str(bad), "--out", str(tmp_path / "m")])
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not an fp8_mla_e2e.json record"):
        e2e.main(["--merge", str(tmp_path / "list.json"), str(bad), "--out", str(tmp_path / "m")])


def test_merge_keeps_agreement_against_a_reference_and_drops_skips_another_run_filled():
    """Runs made with --reference carry their greedy agreement into the merge (no triton phase to recompute it
    from); a phase one run skipped for time but another ran is not reported as skipped."""
    agree = {"mean_matching_prefix": 64.0, "mean_match_rate": 1.0, "identical": True}
    a = {**record({"ours": phase([[1, 2]], 1.0, 1.0)}), "reference": "old.json",
         "skipped": ["phase flashmla: 114s left < ~154s for startup + greedy", "ours: 4096x512@128: 120s left"],
         "summary": {"greedy_agreement_vs_triton": {"ours": agree}}}
    b = {**record({"flashmla": phase([[1, 2]], 1.0, 1.0)}), "reference": "old.json",
         "summary": {"greedy_agreement_vs_triton": {"flashmla": {**agree, "mean_matching_prefix": 3.0}}}}
    rec = e2e.merge_records([a, b], ["x", "y"])
    got = rec["summary"]["greedy_agreement_vs_triton"]
    assert got["ours"]["mean_matching_prefix"] == 64.0 and got["flashmla"]["mean_matching_prefix"] == 3.0
    assert rec["reference"] == "old.json"
    assert rec["skipped"] == ["ours: 4096x512@128: 120s left"]


def test_phases_without_greedy_ids_still_compare_throughput():
    """--prompts 0: no greedy ids; the summary leaves the phases out of the agreement, keeps their ratios."""
    s = e2e.summarize({"ours": phase([], 400.0, 26.0), "flashmla-fp8": phase([], 500.0, 22.0)}, [[1, 2]])
    assert s["greedy_agreement_vs_triton"] == {} and s["repeat_agreement (cached prefix vs fresh prefill)"] == {}
    assert s["ours_over"]["4096x512@16"]["flashmla-fp8"] == pytest.approx(0.8)  # output tok/s, ours / anchor
    assert e2e.prompts(0) == []


def test_summary_separates_the_plugin_from_the_backend():
    """flashmla-fp8-plugin (the plugin loaded, FP8 MLA off) against flashmla-fp8 (no plugin): what loading it costs;
    ours-triton compares like ours."""
    s = e2e.summarize({"ours-triton": phase([], 300.0, 30.0), "flashmla-fp8": phase([], 500.0, 20.0),
                       "flashmla-fp8-plugin": phase([], 450.0, 25.0)}, None)
    ratios = s["plugin_loaded_over"]["4096x512@16"]
    assert ratios["output_tok_s"] == pytest.approx(0.9) and ratios["median_itl_ms"] == pytest.approx(1.25)
    assert s["ours-triton_over"]["4096x512@16"]["flashmla-fp8"] == pytest.approx(0.6)
    assert e2e.summarize({"ours": phase([], 1.0, 1.0)}, None)["plugin_loaded_over"] == {}
    assert {"ours-triton", "flashmla-fp8-plugin"} <= set(e2e.OPT_IN)  # one more server start each: asked for


def test_summary_flags_a_phase_whose_kv_pool_held_fewer_requests_than_the_concurrency():
    """FlashMLA BF16 at 4096x512 @128 (2026-12-02): 87 decoding, 41 queued; FP8 pools held all 128."""
    bf16, fp8 = phase([], 379.0, 148.9), phase([], 437.0, 151.7)
    for p, (running, queued) in ((bf16, (87, 44)), (fp8, (128, 0))):
        p["benches"] = {"4096x512@128": {**p["benches"]["4096x512@16"],
                                         "decode_log": {"median_tok_s": None, "max_running": running,
                                                        "max_queued": queued}}}
    s = e2e.summarize({"ours": fp8, "flashmla": bf16}, None)
    assert s["kv_pool_full"] == {"4096x512@128": {"flashmla": "at most 87 of 128 decoding at once, up to 44 queued"}}
    assert e2e.summarize({"ours": phase([], 1.0, 1.0)}, None)["kv_pool_full"] == {}  # records without the fields
    # fewer running than the concurrency with nothing queued: the requests ran out (the wave's tail), not the pool
    fp8["benches"]["4096x512@128"]["decode_log"].update(max_running=100, max_queued=0)
    assert e2e.summarize({"ours": fp8}, None)["kv_pool_full"] == {}


def fake_phases(monkeypatch, measures: dict | None = None) -> list:
    """e2e.main's phases replaced by a stand-in that records (name, args, keyword arguments) of each and adds
    `measures` to what the run has measured; the list it fills is returned."""
    ran = []

    def fake_phase(name, args, port, sharegpt, clock, measured, **kw):
        ran.append((name, args, kw))
        measured.update(measures or {})
        return {**phase([], 1.0, 1.0), "skipped": []}

    monkeypatch.setattr(e2e, "run_phase", fake_phase)
    monkeypatch.setattr(e2e, "stop_servers_on_sigterm", lambda: None)
    for k in e2e.HOST_ENV:
        monkeypatch.setenv(k, "0")
    return ran


def test_servers_capture_decode_graphs_up_to_the_largest_concurrency(tmp_path, monkeypatch):
    """Every @128 row before 2026-12-02 decoded eagerly under a shared --cuda-graph-max-bs 64 (mostly host time)."""
    ran = fake_phases(monkeypatch)
    common = ["--model", "/m", "--phases", "ours", "--prompts", "0"]
    e2e.main(common + ["--out", str(tmp_path / "a"), "--workloads", "4096x512@16", "1024x256@128"])
    e2e.main(common + ["--out", str(tmp_path / "b"), "--workloads", "4096x512@48",
                       "--server-args", "--load-format dummy --cuda-graph-max-bs 8"])
    e2e.main(common + ["--out", str(tmp_path / "c"), "--workloads", "1024x256@128", "--mem-fraction-static", "0.88"])
    assert [args.server_args for _, args, _ in ran] == [
        e2e.SERVER_ARGS + " --cuda-graph-max-bs 128", "--load-format dummy --cuda-graph-max-bs 8",
        e2e.SERVER_ARGS.replace("0.6", "0.88").replace(" --mem-fraction-static 0.88", "")
        + " --cuda-graph-max-bs 128 --mem-fraction-static 0.88"]
    rec = json.loads((tmp_path / "a" / "fp8_mla_e2e.json").read_text())
    assert rec["server_args"].endswith("--cuda-graph-max-bs 128")  # the record says what the servers ran with


def test_a_later_phase_starts_only_if_a_workload_fits_after_its_server_start(tmp_path, monkeypatch):
    """Session 26: with --prompts 0 the check was startup alone, so a FlashMLA server started (65 s of device time)
    and then skipped its only workload. Now the cheapest workload's expected time counts too."""
    ran = fake_phases(monkeypatch, {"startup": 60.0, "greedy": 0.0, "4096x512@128": 110.0})
    # after the first phase 150 s are left: its measured startup (60 s) fits, startup + the workload (110 s) not
    monkeypatch.setattr(e2e.Clock, "left", lambda self: 150.0 if ran else 500.0)
    e2e.main(["--model", "/m", "--phases", "ours", "flashmla", "--prompts", "0", "--workloads", "4096x512@128",
              "--out", str(tmp_path)])
    assert [name for name, _, _ in ran] == ["ours"]
    rec = json.loads((tmp_path / "fp8_mla_e2e.json").read_text())
    assert rec["skipped"] == ["phase flashmla: 150s left < ~170s for startup, greedy and a workload"]


def test_summary_keeps_the_itl_tail_where_the_record_has_it():
    """P90/P99 ITL per phase in the summary (None for records made before they were kept)."""
    ours, flash = phase([], 1403.1, 35.2), phase([], 1457.1, 32.3)
    ours["benches"]["4096x512@16"].update(p90_itl_ms=40.8, p99_itl_ms=64.6)
    t = e2e.summarize({"ours": ours, "flashmla": flash}, None)["throughput"]["4096x512@16"]
    assert (t["ours"]["p90_itl_ms"], t["ours"]["p99_itl_ms"]) == (40.8, 64.6)
    assert t["flashmla"]["p90_itl_ms"] is None and t["flashmla"]["median_itl_ms"] == 32.3


def test_slow_steps_finds_whole_batch_stalls():
    """Four requests decode in lockstep (10 ms steps after the last first token, at 0.60 s); the first step is
    slow for the early requests (their gap holds the later ones' prefill), and one later step stalls all four
    for 40 ms: two slow steps of four requests, at their times after the decode start."""
    rng = __import__("random").Random(7)
    ttfts = [0.50, 0.52, 0.55, 0.60]

    def gaps(t0, stall_at=None):  # every request's tokens arrive at the same server steps
        ends = [0.60 + 0.010 * (k + 1) + (0.030 if stall_at is not None and k >= stall_at else 0) for k in range(20)]
        ends = [e + rng.uniform(0, 0.0005) for e in ends]
        return [b - a for a, b in zip([t0] + ends, ends)]

    steady = e2e.slow_steps({"ttfts": ttfts, "itls": [gaps(t) for t in ttfts]})
    assert steady["steps"] == 20 and steady["median_gap_ms"] == pytest.approx(10, abs=0.6)
    assert steady["slow_steps"] == 1 and steady["slowest"][0]["at_s"] == pytest.approx(0.010, abs=0.002)
    stalled = e2e.slow_steps({"ttfts": ttfts, "itls": [gaps(t, stall_at=12) for t in ttfts]})
    assert stalled["slow_steps"] == 2 and [r["requests"] for r in stalled["slowest"]] == [4, 4]
    late = stalled["slowest"][1]
    assert late["gap_ms"] == pytest.approx(40, abs=1) and late["at_s"] == pytest.approx(0.160, abs=0.002)
    assert stalled["slow_gaps_share"] == pytest.approx(8 / 80)
    assert e2e.slow_steps({"output_throughput": 1.0}) == {}  # a record without --output-details


def recording_server(calls: list):
    """A stand-in for nightly.serving.Server that appends (what, num_prompts, input_len, concurrency) to `calls` for
    each warm-up, rehearsal and measured bench."""
    class RecordingServer:
        def __init__(self, model, args, log, env=None, port=0, ready_timeout_s=0):
            self.log, self.start_s = log, 1.0

        def __enter__(self):
            self.log.write_text("")
            return self

        def __exit__(self, *exc):
            pass

        def warm_up(self, num_prompts, input_len, output_len, concurrency):
            calls.append(("warm", num_prompts, input_len, concurrency))
            return 2.5

        def bench(self, out_jsonl, **kw):
            what = "rehearsal" if out_jsonl.name.startswith("rehearsal") else "bench"
            calls.append((what, kw["num_prompts"], kw["input_len"], kw["concurrency"]))
            return {"output_throughput": 1.0, "median_itl_ms": 1.0, "command": "bench_serving ..."}
    return RecordingServer


def test_each_workload_is_warmed_at_its_shapes_before_the_timed_wave(tmp_path, monkeypatch):
    """Session 30: the first backend of a call paid ~1 s of first-use cost inside its measured wave (TTFT 1473 vs
    164 ms on dsv3-tp8-4l). Each workload now runs once untimed at its concurrency and input length first."""
    calls = []
    monkeypatch.setattr(e2e, "Server", recording_server(calls))
    args = e2e.argparse.Namespace(out=tmp_path, server_env={}, model="/m", server_args="--load-format dummy",
                                  prompts=0, gen_tokens=4, workloads=["4096x512@48", "1024x256@128"], num_prompts=0)
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(1e6), {})
    assert calls == [("warm", 48, 4096, 48), ("bench", 48, 4096, 48), ("warm", 128, 1024, 128),
                     ("bench", 128, 1024, 128)]
    assert rec["benches"]["4096x512@48"]["warm_up_s"] == 2.5


def test_the_first_phase_rehearses_its_first_workload_untimed(tmp_path, monkeypatch):
    """Session 31: after the warm-up the call's first phase still stalled 0.6-1.3 s in its timed waves (ours on
    dsv3-tp8-4l: first-wave TTFT median 801 ms against 154 ms later; FlashMLA FP8 first in another call: 962 vs
    713 ms). The first phase now runs one whole bench_serving wave untimed before its first measured workload."""
    calls = []
    monkeypatch.setattr(e2e, "Server", recording_server(calls))
    args = e2e.argparse.Namespace(out=tmp_path, server_env={}, model="/m", server_args="--load-format dummy",
                                  prompts=0, gen_tokens=4, workloads=["1024x256@32", "4096x512@16"], num_prompts=96)
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(1e6), {}, rehearse=True)
    assert [c[:2] for c in calls] == [("warm", 32), ("rehearsal", 32), ("bench", 96), ("warm", 16),
                                      ("bench", 96)]  # one rehearsal only
    assert rec["rehearsal"]["workload"] == "1024x256@32" and set(rec["benches"]) == {"1024x256@32", "4096x512@16"}
    calls.clear()
    assert "rehearsal" not in e2e.run_phase("flashmla", args, 2, tmp_path / "sharegpt.json", e2e.Clock(1e6), {})
    assert not [c for c in calls if c[0] == "rehearsal"]


def test_only_the_first_phase_of_a_call_rehearses_by_default(tmp_path, monkeypatch):
    ran = fake_phases(monkeypatch)
    base = ["--model", "/m", "--prompts", "0", "--workloads", "1024x256@32", "--out", str(tmp_path), "--phases",
            "flashmla-fp8", "ours"]
    for extra, want in (([], [True, False]), (["--rehearse", "every"], [True, True]),
                        (["--rehearse", "none"], [False, False])):
        ran.clear()
        e2e.main(base + extra)
        assert [(name, kw["rehearse"]) for name, _, kw in ran] == list(zip(["flashmla-fp8", "ours"], want))


def test_each_benchmarking_phase_stops_starting_workloads_past_its_share(tmp_path, monkeypatch):
    """Session 35: ours ran all four workloads (480 s) and both FlashMLA phases were skipped by the deadline, so
    the call had no anchor. A phase now gets an equal share of the time left; past its first workload it starts
    another only within that share."""
    calls, now = [], [0.0]
    server = recording_server(calls)
    bench = server.bench

    def slow_bench(self, out_jsonl, **kw):  # each measured wave takes 100 s of the fake clock
        now[0] += 100.0
        return bench(self, out_jsonl, **kw)

    monkeypatch.setattr(server, "bench", slow_bench)
    monkeypatch.setattr(e2e, "Server", server)
    monkeypatch.setattr(e2e.time, "time", lambda: now[0])
    args = e2e.argparse.Namespace(out=tmp_path, server_env={}, model="/m", server_args="--load-format dummy",
                                  prompts=0, gen_tokens=4, workloads=["4096x512@16", "4096x512@48", "1024x256@128"],
                                  num_prompts=0)
    measured = {"4096x512@16": 100.0, "4096x512@48": 100.0, "1024x256@128": 100.0}
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(1e6), dict(measured), share_s=250.0)
    assert list(rec["benches"]) == ["4096x512@16", "4096x512@48"]  # 200 s used + 100 expected > 250
    assert rec["skipped"] == ["1024x256@128: the phase's share of the time (250s) would be exceeded (200s used + "
                              "~100s expected)"]
    calls.clear()
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(1e6), dict(measured), share_s=10.0)
    assert list(rec["benches"]) == ["4096x512@16"]  # the first workload runs regardless: one pair at least
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(1e6), dict(measured))
    assert len(rec["benches"]) == 3  # no share: the deadline alone


def test_the_time_left_is_shared_among_the_benchmarking_phases(tmp_path, monkeypatch):
    ran = fake_phases(monkeypatch)
    monkeypatch.setattr(e2e.Clock, "left", lambda self: 600.0)
    e2e.main(["--model", "/m", "--prompts", "0", "--workloads", "1024x256@32", "--out", str(tmp_path), "--phases",
              "triton", "ours", "flashmla", "flashmla-fp8"])
    assert [(name, kw["share_s"]) for name, _, kw in ran] == [("triton", None), ("ours", 200.0), ("flashmla", 300.0),
                                                             ("flashmla-fp8", 600.0)]


def test_later_phases_run_only_what_the_first_benchmarking_phase_measured(tmp_path, monkeypatch):
    """With equal shares a later phase may have time for a workload the first one skipped: a number without a
    pair. Later phases get the first benchmarking phase's measured workloads only (an errored one is not measured;
    a phase that measured none leaves the choice to the next)."""
    ran = fake_phases(monkeypatch)
    measured = {"output_throughput": 1.0, "median_itl_ms": 1.0, "decode_log": {}}
    recs = iter([{"benches": {}}, {"benches": {"1024x256@32": {"error": "its server died"}}},
                 {"benches": {"4096x512@48": measured, "1024x256@32": {"error": "boom"}}}, {}, {}, {}])
    fake = e2e.run_phase

    def with_benches(name, *a, **kw):
        return {**fake(name, *a, **kw), **next(recs)}

    monkeypatch.setattr(e2e, "run_phase", with_benches)
    e2e.main(["--model", "/m", "--prompts", "4", "--workloads", "4096x512@48", "1024x256@32", "--out", str(tmp_path),
              "--phases", "triton", "ours-v2", "ours", "flashmla", "flashmla-fp8"])
    assert [(name, kw["only"]) for name, _, kw in ran] == [("triton", None), ("ours-v2", None), ("ours", None),
                                                          ("flashmla", {"4096x512@48"}),
                                                          ("flashmla-fp8", {"4096x512@48"})]


def test_a_phase_skips_the_workloads_it_may_not_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(e2e, "Server", recording_server(calls))
    args = e2e.argparse.Namespace(out=tmp_path, server_env={}, model="/m", server_args="--load-format dummy",
                                  prompts=0, gen_tokens=4, workloads=["4096x512@48", "1024x256@128"], num_prompts=0)
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(1e6), {}, only={"1024x256@128"})
    assert list(rec["benches"]) == ["1024x256@128"] and [c[0] for c in calls] == ["warm", "bench"]
    assert rec["skipped"] == ["4096x512@48: the first benchmarking phase did not measure it (nothing to pair with)"]


def test_the_plan_warns_when_the_phases_cannot_all_run_one_workload(tmp_path, monkeypatch, capsys):
    """Session 36: three phases in 499 s; the third was skipped. The plan line says so before any server starts."""
    fake_phases(monkeypatch)
    three = ["--model", "/m", "--workloads", "4096x512@48", "--phases", "ours", "flashmla", "flashmla-fp8"]
    # 3 x (75 s start + 40 s greedy + 70 s wave) + the first phase's 70 s rehearsal
    assert e2e.plan_s(e2e_args(three)) == (3 * (75 + 40 + 70) + 70, 3)
    assert e2e.plan_s(e2e_args(three[:-1] + ["--rehearse", "none"]))[0] == 2 * (75 + 40 + 70)
    e2e.main(three + ["--deadline-s", "499", "--out", str(tmp_path / "a")])
    assert "need ~625s" in capsys.readouterr().out.split("plan:")[1].split("\n")[0]
    e2e.main(three[:-1] + ["--deadline-s", "499", "--out", str(tmp_path / "b")])
    line = capsys.readouterr().out.split("plan:")[1].split("\n")[0]
    assert "need ~440s" in line and "skipped" not in line



def e2e_args(argv):
    return e2e.build_parser().parse_args(argv + ["--out", "/nonexistent"])


def test_agreement_counts_the_prefix_and_the_share_of_equal_positions():
    """Per prompt: equal tokens before the first difference, and equal positions over the reference's length (a
    shorter output counts its missing tokens as different)."""
    a = e2e.agreement([[1, 2, 3, 4], [5, 6], [7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8], [7, 8]])
    assert [r["matching_prefix"] for r in a["per_prompt"]] == [2, 2, 2]
    assert [r["match_rate"] for r in a["per_prompt"]] == [0.75, 0.5, 1.0]
    assert a["mean_matching_prefix"] == 2.0 and a["mean_match_rate"] == pytest.approx(0.75)
    assert a["identical"] is False
    same = e2e.agreement([[1, 2]], [[1, 2]])
    assert same["identical"] is True and same["per_prompt"] == [{"matching_prefix": 2, "match_rate": 1.0}]
    assert same["mean_match_rate"] == 1.0 and same["mean_matching_prefix"] == 2.0


def test_a_phase_is_worth_starting_for_its_start_greedy_step_and_cheapest_workload():
    args = e2e.argparse.Namespace(prompts=4, workloads=["4096x512@48", "1024x256@128"])
    measured = {"startup": 60.0, "greedy": 10.0, "1024x256@128": 30.0}
    assert e2e.phase_need_s("ours", args, measured) == 60.0 + 10.0 + 30.0  # the cheaper of 70 (guess) and 30
    assert e2e.phase_need_s("triton", args, measured) == 70.0  # the greedy reference benchmarks nothing
    args.prompts = 0
    assert e2e.phase_need_s("ours", args, {}) == e2e.GUESS_S["startup"] + e2e.GUESS_S["1024x256@128"]


def test_a_workload_the_time_left_cannot_hold_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(e2e, "Server", recording_server(calls))
    monkeypatch.setattr(e2e.Clock, "left", lambda self: 60.0)
    args = e2e.argparse.Namespace(out=tmp_path, server_env={}, model="/m", server_args="--load-format dummy",
                                  prompts=0, gen_tokens=4, workloads=["4096x512@48", "1024x256@128"], num_prompts=0)
    rec = e2e.run_phase("ours", args, 1, tmp_path / "sharegpt.json", e2e.Clock(60.0),
                        {"4096x512@48": 61.0, "1024x256@128": 60.0})
    assert list(rec["benches"]) == ["1024x256@128"]  # 60 s left: 60 expected fits, 61 does not
    assert rec["skipped"] == ["4096x512@48: 60s left < ~61s expected"]
    assert "deadline: ours 4096x512@48: 60s left" in capsys.readouterr().out


def test_the_plugins_own_cost_is_a_ratio_only_where_both_servers_have_the_number():
    plugin = phase([], 450.0, 25.0)
    plugin["benches"]["4096x512@16"]["decode_log"] = {"median_tok_s": None}  # no steady decode line
    ratios = e2e.summarize({"flashmla-fp8": phase([], 500.0, 20.0), "flashmla-fp8-plugin": plugin},
                           None)["plugin_loaded_over"]["4096x512@16"]
    assert set(ratios) == {"output_tok_s", "median_itl_ms"}


def test_the_summary_lists_only_ours_fallback_lines_and_whether_our_backend_ran():
    ours = phase([], 1.0, 1.0)
    ours["plugin_log_lines"] = ["[sglang-h20 pid 1] fp8_mla: attention backend h20_fp8_mla (--attention-backend ...)",
                                "[sglang-h20 pid 1] mha_mla_policy: switched off (SGLANG_H20_MHA_MLA_POLICY=upstream)",
                                "[sglang-h20 pid 1] fp8_mla: falls back to upstream: no sm_90",
                                "[sglang-h20 pid 1] hooks applied: 6/6"]
    s = e2e.summarize({"ours": ours}, None)
    assert s["ours_backend_selected"] is True
    assert s["ours_fallback_lines"] == ours["plugin_log_lines"][1:3]
    ours["plugin_log_lines"] = ours["plugin_log_lines"][1:]  # the backend line missing: the server ran another one
    assert e2e.summarize({"ours": ours}, None)["ours_backend_selected"] is False


def test_the_run_fails_when_a_phase_errs_or_ours_was_skipped(tmp_path, monkeypatch):
    """Exit status 1 when a phase raised, or when ours was asked for and never ran (the deadline skipped it): a
    record without the phase the call is about must not read as a success."""
    fake_phases(monkeypatch)
    base = ["--model", "/m", "--prompts", "0", "--workloads", "1024x256@32", "--out", str(tmp_path)]
    assert e2e.main(base + ["--phases", "flashmla-fp8", "ours"]) == 0
    monkeypatch.setattr(e2e.Clock, "left", lambda self: 1.0)  # nothing after the first phase fits
    assert e2e.main(base + ["--phases", "flashmla-fp8", "ours"]) == 1
    assert e2e.main(base + ["--phases", "flashmla-fp8", "flashmla"]) == 0  # ours not asked for
    real = e2e.run_phase

    def failing(name, *a, **kw):
        if name == "flashmla":
            raise RuntimeError("server died")
        return real(name, *a, **kw)
    monkeypatch.setattr(e2e, "run_phase", failing)
    monkeypatch.setattr(e2e.Clock, "left", lambda self: 1e6)
    assert e2e.main(base + ["--phases", "ours", "flashmla"]) == 1
