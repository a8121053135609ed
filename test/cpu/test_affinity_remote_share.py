"""affinity_remote_share.py's summary: only sampled passes after the split count, per rank and overall."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from repo_scripts import REPO, load_script, stored_record

bench = load_script("benchmark/serving/affinity_remote_share.py")


def test_summary_counts_sampled_passes_after_the_split_only():
    recs = [{"kind": "stages", "ts": 5.0, "rank": 0, "remote_share": [0.9, 0.9]},   # before the split
            {"kind": "stages", "ts": 11.0, "rank": 0, "remote_share": [0.2, 0.4]},
            {"kind": "stages", "ts": 12.0, "rank": 1, "remote_share": [0.6, 0.6]},
            {"kind": "stages", "ts": 13.0, "rank": 1, "remote_share": [0.5, 0.7]},
            {"kind": "graph", "ts": 14.0, "rank": 1, "step_ms": 3.0},                  # no routing
            {"kind": "stages", "ts": 15.0, "rank": 0}]                                 # EP 1: no share
    s = bench.summarize(recs, after_ts=10.0)
    assert s["samples"] == 3
    assert s["per_rank"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.6)}
    assert s["remote_share_mean"] == pytest.approx((0.3 + 0.6 + 0.6) / 3)
    assert bench.summarize(recs, after_ts=100.0) == {"samples": 0, "remote_share_mean": None, "per_rank": {}}
    assert "token_leave_share_mean" not in s  # records from before the per-token counts
    recs[1].update(token_leave_share=[0.5, 0.7], remote_copies_per_token=[0.5, 0.7])
    recs[2].update(token_leave_share=[1.0, 0.8], remote_copies_per_token=[1.0, 1.2])
    s = bench.summarize(recs, after_ts=10.0)
    assert s["token_leave_share_mean"] == pytest.approx(0.75)
    assert s["remote_copies_per_token_mean"] == pytest.approx(0.85)
    recs[3].update(token_leave_share=[-3.5, 0.5], remote_copies_per_token=[0.5, 0.5])  # a broken read-out
    s = bench.summarize(recs, after_ts=10.0)
    assert s["token_records_out_of_range"] == 1 and "token_leave_share_mean" not in s


def test_rebalance_costs_from_the_server_log():
    log = "\n".join([
        "[2026-11-30 02:02:10 DP0 TP0] [EPLBManager] rebalance start",
        "[2026-11-30 02:02:10 DP0 TP0] [EPLBManager] rebalance end time=0.118s",
        "[2026-11-30 02:02:10 DP1 TP1] [EPLBManager] rebalance end time=0.260s",
        "[sglang-h20 pid 7] eplb_async: rebalance 3 end: 3 layers switched over 41 forward passes (placement 2, "
        "migration 39); boundary work on the decode thread: mean 85 us, max 5.12 ms",
        "[sglang-h20 pid 8] eplb_async: rebalance 3 end: 3 layers switched over 41 forward passes (placement 2, "
        "migration 39); boundary work on the decode thread: mean 90 us, max 0.52 ms (at switches: max 0.31 ms)"])
    c = bench.rebalance_costs(log)
    assert c["rebalance_stall_s"] == [0.118, 0.260] and c["async_rebalances"] == [[3, 41], [3, 41]]
    assert c["async_boundary_work"] == [{"mean_us": 85.0, "max_ms": 5.12},  # a log from before the split
                                        {"mean_us": 90.0, "max_ms": 0.52, "switch_max_ms": 0.31}]
    assert bench.rebalances(log + "\n[2026-11-30 02:02:10 DP1 TP1] [EPLBManager] rebalance start", 2) == 1  # a line a rank
    assert c["rebalance_stall_ms_median"] == pytest.approx(189.0) and c["rebalance_stall_ms_max"] == pytest.approx(260)
    assert bench.rebalance_costs("no eplb here") == {"rebalance_stall_s": [], "async_rebalances": [],
                                                     "async_pass_intervals": []}


def test_pass_interval_lines_as_the_plugin_writes_them(caplog):
    """The line comes from async_rebalance's own format string (its logger), so a change there breaks this."""
    import logging

    import torch

    from sglang_h20.eplb import async_rebalance as ar
    from sglang_h20.eplb import migration

    during = {"n": 348, "p50_ms": 4.1, "p99_ms": 9.8, "max_ms": 12.0}
    before = {"n": 511, "p50_ms": 4.0, "p99_ms": 9.5, "max_ms": 11.0}
    with caplog.at_level(logging.INFO, logger=ar.log.name):
        ar.log_pass_intervals("r1", during, before)
        ar.log_pass_intervals("r1", {**during, "p99_ms": 9.9}, before)
        ar.log_pass_intervals("r2", {**during, "p99_ms": 50.0, "n": 7}, before)  # 7 passes: their max, not judged
        ar.log_pass_intervals("r1", {**during, "p99_ms": 4.8}, {**before, "p99_ms": 4.0}, "decode pass")
        job = ar._Job.__new__(ar._Job)  # its verify lines, one intact, one with a changed slot
        job.weights, job.moe, job.rank, job.mid = {1: [torch.ones(2, 4)]}, [1], 0, "r1"
        job.expected = migration.slot_digests(job.weights, job.moe)
        job.check_moved({}, None)
        job.weights[1][0][1, 0] = 2.0
        job.check_moved({}, None)
    c = bench.rebalance_costs("\n".join(r.getMessage() for r in caplog.records))
    assert c["async_verify"] == [{"id": "r1", "slots": 2, "mismatched": 0}, {"id": "r1", "slots": 2, "mismatched": 1}]
    assert [x["during"] for x in c["async_pass_intervals"]] == [during, {**during, "p99_ms": 9.9},
                                                                 {**during, "p99_ms": 50.0, "n": 7}]
    assert c["async_pass_intervals"][0]["before"] == before
    assert c["async_p99_ratio_max"] == pytest.approx(9.9 / 9.5)
    assert [x["during"]["p99_ms"] for x in c["async_decode_intervals"]] == [4.8]
    assert c["async_decode_p99_ratio_max"] == pytest.approx(4.8 / 4.0)


def test_arm_setup():
    args, env = bench.arm_setup("none", 2, 200)
    assert "--enable-eplb" not in args and env == {} and args[:2] == ["--tp", "2"]
    args, env = bench.arm_setup("deepseek+async", 4, 100)
    assert args[-4:] == ["--eplb-algorithm", "deepseek", "--eplb-rebalance-num-iterations", "100"]
    assert env == {"SGLANG_H20_EPLB_ASYNC": "on", "SGLANG_H20_EPLB_ASYNC_LAUNCH": "boundary",
                   "SGLANG_H20_EPLB_ASYNC_VERIFY": "off", "SGLANG_H20_EPLB_ASYNC_SHUFFLE": "off",
                   "SGLANG_H20_EPLB_ASYNC_PEER": "off"}
    assert bench.arm_setup("deepseek+async-shuffle", 2, 600)[1]["SGLANG_H20_EPLB_ASYNC_SHUFFLE"] == "on"
    env = bench.arm_setup("deepseek+async-verify-shuffle", 2, 600)[1]
    assert env["SGLANG_H20_EPLB_ASYNC_VERIFY"] == env["SGLANG_H20_EPLB_ASYNC_SHUFFLE"] == "on"
    assert env["SGLANG_H20_EPLB_ASYNC_PEER"] == "off"
    env = bench.arm_setup("deepseek+async-verify-shuffle-peer", 2, 600)[1]
    assert env["SGLANG_H20_EPLB_ASYNC_VERIFY"] == env["SGLANG_H20_EPLB_ASYNC_SHUFFLE"] == "on"
    assert env["SGLANG_H20_EPLB_ASYNC_PEER"] == bench.arm_setup("deepseek+async-shuffle-peer", 2, 600)[1][
        "SGLANG_H20_EPLB_ASYNC_PEER"] == "on"
    assert bench.arm_setup("deepseek+async-thread", 2, 100)[1]["SGLANG_H20_EPLB_ASYNC_LAUNCH"] == "thread"
    assert bench.arm_setup("deepseek+async-verify", 2, 100)[1]["SGLANG_H20_EPLB_ASYNC_VERIFY"] == "on"
    assert bench.arm_setup("affinity", 2, 200)[1] == {"SGLANG_H20_EPLB": "affinity"}
    with pytest.raises(ValueError):
        bench.arm_setup("deepseek+sync", 2, 200)


def test_stack_dump_starts_at_the_first_faulthandler_line():
    log = "\n".join(["server up", "[sglang-h20 hang watch] log silent", "Fatal Python error: Aborted", "",
                     "Thread 0x7f (most recent call first):", '  File "m.py", line 3 in wait'])
    assert bench.stack_dump(log) == log.splitlines()[2:]
    assert bench.stack_dump("server up\nno dump here") == []


def test_plot_from_a_stored_record(tmp_path, monkeypatch, capsys):
    """The session-12 record (ours, upstream, no EPLB in one call) re-plots from the command line, next to itself;
    an unreadable record or a run without --model / --out is refused with one line."""
    import shutil

    rec = shutil.copy(REPO / "benchmark/results/eplb/async_boundary_2_ep2_h200.json", tmp_path / "r.json")
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--plot-from", str(rec)])
    assert bench.main() == 0
    out = tmp_path / "r.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    width = lambda png: int.from_bytes(png.read_bytes()[16:20], "big")  # IHDR
    assert width(out) == 1210  # no decode-pass windows in that record: two panels
    # a session-13 record, with our rebalances' decode-pass windows: a third panel (their p99 ratios against 1.05)
    rec2 = shutil.copy(REPO / "benchmark/results/eplb/async_decode_p99_2_ep2_h200.json", tmp_path / "r2.json")
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--plot-from", str(rec2)])
    assert bench.main() == 0 and width(tmp_path / "r2.png") == 1815
    # a session-14 record with tokens-leaving shares per arm: their panel instead; both: four panels
    rec3 = shutil.copy(REPO / "benchmark/results/eplb/affinity_token_leave_ep2_h200.json", tmp_path / "r3.json")
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--plot-from", str(rec3)])
    assert bench.main() == 0 and width(tmp_path / "r3.png") == 1815
    both = json.loads(Path(rec2).read_text())
    both["arms"]["deepseek+async"]["token_leave_share_mean"] = 0.8
    (tmp_path / "r4.json").write_text(json.dumps(both))
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--plot-from", str(tmp_path / "r4.json")])
    assert bench.main() == 0 and width(tmp_path / "r4.png") == 2420
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--plot-from", str(tmp_path / "absent.json")])
    with pytest.raises(SystemExit, match="--plot-from"):
        bench.main()
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--gpus", "2"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--model and --out are needed" in capsys.readouterr().err


def test_pooled_decode_p99_with_its_interval(tmp_path):
    """The raw intervals each rank dumps, pooled per rebalance: the p99 ratio with a bootstrap interval around it;
    windows under MIN_P99_PASSES are left out, as in the per-rank verdict."""
    import json

    import numpy as np

    rng = np.random.default_rng(1)
    steady = lambda n: list(4 + rng.exponential(0.5, n))
    for rank in (0, 1):
        (tmp_path / f"eplb_async_r1_rank{rank}.json").write_text(json.dumps(
            {"id": "r1", "rank": rank, "decode_during": [1.2 * x for x in steady(400)],
             "decode_before": steady(450), "all_during": [], "all_before": []}))
        (tmp_path / f"eplb_async_r2_rank{rank}.json").write_text(json.dumps(
            {"id": "r2", "rank": rank, "decode_during": steady(3), "decode_before": steady(450)}))
    (p,) = bench.pooled_decode_p99(tmp_path)
    assert p["id"] == "r1" and p["ranks"] == 2 and p["n"] == [800, 900]
    assert len(p["decode_during_ms"]) == 800 and len(p["decode_before_ms"]) == 900
    assert p["ci95"][0] < p["ratio"] < p["ci95"][1] and 1.0 < p["ratio"] < 1.45 and p["ci95"][1] - p["ci95"][0] < 0.5
    assert bench.pooled_line({"async_decode_p99_pooled": [p]}).startswith("r1 1.")
    assert bench.pooled_line({}) == "none" and bench.pooled_decode_p99(tmp_path / "absent") == []
    assert "decode_by_phase" not in p  # dumps from before the per-pass labels
    for rank in (0, 1):  # a second full re-placement: also one ratio over both
        (tmp_path / f"eplb_async_r3_rank{rank}.json").write_text(json.dumps(
            {"id": "r3", "rank": rank, "decode_during": steady(400), "decode_before": steady(450)}))
    r1, r3, both = bench.pooled_decode_p99(tmp_path)
    assert (r1["id"], r3["id"], both["id"], both["rebalances"]) == ("r1", "r3", "all", ["r1", "r3"])
    assert both["n"] == [1600, 1800] and r3["ratio"] < both["ratio"] < r1["ratio"]
    assert bench.pooled_line({"async_decode_p99_pooled": [both]}).startswith("all 1.")
    assert "after_decode" not in both  # dumps from before that split
    for mid in ("r1", "r3"):  # dumps that also split off decode passes right after a prefill pass
        for rank in (0, 1):
            f = tmp_path / f"eplb_async_{mid}_rank{rank}.json"
            rec = json.loads(f.read_text())
            rec.update(decode_after_decode_during=rec["decode_during"][:380], decode_after_decode_before=steady(430))
            f.write_text(json.dumps(rec))
    r1, r3, both = bench.pooled_decode_p99(tmp_path)
    assert r1["after_decode"]["n"] == [760, 860] and both["after_decode"]["n"] == [1520, 1720]
    assert 1.0 < r1["after_decode"]["ratio"] < 1.45
    assert "(after a decode pass 1." in bench.pooled_line({"async_decode_p99_pooled": [r1]})
    # --repeat: an arm's servers (A, A#2) pooled over all their re-placements; single-server arms are not
    pooled = bench.pooled_by_arm({"x": {"async_decode_p99_pooled": [r1, r3, both]},
                                  "x#2": {"async_decode_p99_pooled": [r1]}, "y": {"async_decode_p99_pooled": [r1]}})
    assert list(pooled) == ["x"] and pooled["x"]["servers"] == 2 and pooled["x"]["rebalances"] == 3
    assert pooled["x"]["n"] == [2400, 2700] and pooled["x"]["after_decode"]["n"] == [2280, 2580]


def test_pooled_p99_tells_the_phases_of_a_rebalance_apart(tmp_path):
    """With the per-pass labels the servers dump, the decode passes of a rebalance are summarised per phase and at
    the switching boundaries (ranks pooled): where its slow passes are. Prefill passes and idle gaps are left out."""
    import json

    n = 300
    for rank in (0, 1):
        ms = [30.0, 45.0] + [4.0] * (n - 2)            # two slow placement passes
        ms[150] = 12.0                                  # a switch
        ms[200], ms[201] = 40.0, 5000.0                 # a prefill pass, an idle gap
        passes = {"ms": ms, "decode": [k != 200 for k in range(n)],
                  "phase": ["placement"] * 9 + ["start"] + ["migration"] * (n - 10),
                  "work_us": [100.0] * n, "switch": [k == 150 for k in range(n)]}
        (tmp_path / f"eplb_async_r1_rank{rank}.json").write_text(json.dumps(
            {"id": "r1", "rank": rank, "decode_during": [x for x, d in zip(ms, passes["decode"]) if d and x < 1e3],
             "decode_before": [4.0] * 400, "passes": passes}))
    (p,) = bench.pooled_decode_p99(tmp_path)
    ph = p["decode_by_phase"]
    assert ph["placement"]["n"] == 18 and ph["placement"]["slowest_ms"][:4] == [45.0, 45.0, 30.0, 30.0]
    assert ph["start"]["n"] == 2 and ph["start"]["max_ms"] == 4.0
    assert ph["migration"]["n"] == 2 * (n - 10 - 2) and ph["migration"]["max_ms"] == 12.0
    assert ph["switch"] == {"n": 2, "p50_ms": 12.0, "p99_ms": 12.0, "max_ms": 12.0, "slowest_ms": [12.0, 12.0]}
    assert "{placement 45.0/45.0 ms, start 4.0/4.0 ms, migration 4.0/12.0 ms, switch 12.0/12.0 ms}" in \
        bench.pooled_line({"async_decode_p99_pooled": [p]})


def test_the_record_states_affinity_over_upstream_only_where_both_arms_measured(tmp_path):
    """The issue's two readings, ours over upstream's EPLB (remote copies per pass, tokens that leave their GPU),
    go into the record only when both arms measured them and upstream's is not 0; the arms are kept as given."""
    from types import SimpleNamespace

    a = SimpleNamespace(model="/m", gpus=2, fraction=0.05, rebalance_iterations=200, router_clusters=8,
                        arms=["deepseek", "affinity"], out=tmp_path)
    arms = {"deepseek": {"remote_share_mean": 0.5, "token_leave_share_mean": 0.8},
            "affinity": {"remote_share_mean": 0.4, "token_leave_share_mean": 0.6}}
    bench.write_record(a, arms)
    rec = json.loads((tmp_path / "affinity_remote_share.json").read_text())
    assert rec["affinity_over_deepseek"] == pytest.approx(0.8)
    assert rec["token_leave_affinity_over_deepseek"] == pytest.approx(0.75)
    assert rec["arms"] == arms and rec["gpus"] == 2 and rec["git_commit"]
    for deepseek in ({"remote_share_mean": 0.0, "token_leave_share_mean": None}, {}):  # nothing to divide by
        bench.write_record(a, {**arms, "deepseek": deepseek})
        rec = json.loads((tmp_path / "affinity_remote_share.json").read_text())
        assert "affinity_over_deepseek" not in rec and "token_leave_affinity_over_deepseek" not in rec
    bench.write_record(a, {**arms, "affinity": {"remote_share_mean": 0.0}})  # ours kept nothing remote: a ratio of 0
    rec = json.loads((tmp_path / "affinity_remote_share.json").read_text())
    assert rec["affinity_over_deepseek"] == 0.0 and "token_leave_affinity_over_deepseek" not in rec
    for name, n in (("affinity_remote_share_ep2_h200.json", 1), ("affinity_token_leave_ep2_h200.json", 2)):
        stored = stored_record(f"eplb/{name}")  # the EP-2 runs' ratios
        bench.write_record(a, stored["arms"])
        rec = json.loads((tmp_path / "affinity_remote_share.json").read_text())
        keys = [k for k in ("affinity_over_deepseek", "token_leave_affinity_over_deepseek") if k in stored]
        assert len(keys) == n and {k: rec[k] for k in keys} == {k: stored[k] for k in keys}, name


def test_arms_are_checked_before_any_server_and_a_repeated_arm_is_recorded_as_its_second(tmp_path, monkeypatch,
                                                                                          capsys):
    """A typo in --arms, or no --model / --out, ends the call with argparse's message before a server starts; a valid
    list runs each arm on its own port, a repeat keyed NAME#2, and the record is written after every arm."""
    assert all(bench.arm_valid(arm) for arm in ("none", "deepseek", "affinity+async-verify-shuffle-peer", "auto"))
    assert not any(bench.arm_valid(arm) for arm in ("deepsek", "deepseek+sync", "none+async"))
    ran = []

    def fake_arm(a, arm, data, key=None, port=0):
        ran.append((arm, key, port))
        return {"error": "stand-in", "stacks": []}
    monkeypatch.setattr(bench, "run_arm", fake_arm)
    for argv, message in ((["--out", str(tmp_path)], "--model and --out are needed"),
                          (["--model", "/m", "--out", str(tmp_path), "--arms", "deepseek", "deepsek"],
                           "--arms: unknown deepsek; an arm is none, ALGORITHM or")):
        monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", *argv])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert ran == []
    monkeypatch.setattr(sys, "argv", ["affinity_remote_share.py", "--model", "/m", "--out", str(tmp_path / "o"),
                                      "--arms", "deepseek", "affinity", "--repeat", "2"])
    assert bench.main() == 0
    assert ran == [("deepseek", "deepseek", 32400), ("affinity", "affinity", 32401),
                   ("deepseek", "deepseek_2", 32402), ("affinity", "affinity_2", 32403)]
    rec = json.loads((tmp_path / "o" / "affinity_remote_share.json").read_text())
    assert list(rec["arms"]) == ["deepseek", "affinity", "deepseek#2", "affinity#2"]
