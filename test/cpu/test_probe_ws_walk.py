"""probe_ws_walk's parent side: a case that fails, or that outlives its timeout, is recorded with the stage it
reached and its output's tail; the next case still runs."""
from repo_scripts import load_script

probe = load_script("benchmark/kernels/probe_ws_walk.py")


def test_a_failing_case_is_recorded_with_its_tail():
    r = probe.probe(probe.case_of("normal-128x64", 1), timeout_s=120)  # no GPU here: the child fails building its inputs
    assert r["status"].startswith("exit ") and r["status"] != "exit 0", r
    assert r["stage"] is None and r["tail"] and r["name"] == "normal-128x64", r


def test_a_case_past_its_timeout_is_killed_and_recorded():
    r = probe.probe(probe.case_of("normal-128x64", 1), timeout_s=0.05)
    assert r["status"] == "timeout after 0 s" and r["wall_s"] < 30, r


def test_cases_run_in_the_order_asked(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(probe, "probe", lambda c, timeout_s: seen.append(c["name"]) or {**c, "status": "ok",
                                                                                           "stage": "timed"})
    out = tmp_path / "p.json"
    assert probe.main(["--json", str(out), "--cases", "swapab-128x32", "normal-128x64"]) == 0
    assert seen == ["swapab-128x32", "normal-128x64"] and out.exists()
