"""prefix_ttft.py --one-server: the ABBA A/B inside one server, through the MHA/MLA control file.

A fake server stands in for SGLang: it answers with a delay set by the policy the control file names
(through the plugin's real Switchable policy), so the script's blocks, pairing and ratios are checked
against a known effect, and the control file's round trip into the policy is exercised end to end.

The script times each request with time.perf_counter; here its `time` is a virtual clock that only the fake
server advances, by exactly its delay. With real sleeps timed, a loaded 2-core host added scheduler delays of
several ms to 4-8 ms requests, and the measured ratio came out 0.35 or 0.67 instead of 0.5 (the test failed
in 3 of 3 runs with 12 busy loops beside it). The fake still sleeps for real, so that the control file's
rewrites stay as far apart in real time as a real server would keep them (the policy sees a rewrite by
its mtime and size)."""
from __future__ import annotations

import json
import sys
import time

import pytest

from sglang_h20.attention.mha_mla import BatchShape, Switchable

from repo_scripts import load_script

bench = load_script("benchmark/serving/prefix_ttft.py")

DELAY_S = {"mha": 0.004, "mla": 0.008}  # the fake prefill: MHA twice as fast, as the H200 grid says here


class _VirtualTime:
    """Stands in for the script's `time` module: perf_counter reads a clock that only the fake server moves."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):  # time.time() for deadlines, and anything else: the real module
        return getattr(time, name)


class _FakeServer:
    clock: _VirtualTime  # set by the `model` fixture
    def __init__(self, model, args, log_path, env=None, port=0, **kw):
        self.env = env
        assert "--cuda-graph-backend-prefill" in args  # prefill graphs would pin MLA

    def __enter__(self):
        self.policy = Switchable(self.env["SGLANG_H20_MHA_MLA_POLICY"], self.env["SGLANG_H20_MHA_MLA_CONTROL"],
                                 "NVIDIA H200")
        return self

    def __exit__(self, *exc):
        return False

    def generate_batch(self, texts, max_new_tokens=1):
        n = len(texts[0].split())
        shape = BatchShape([n // 2] * len(texts), [n // 2] * len(texts))
        delay = DELAY_S[self.policy.choose(shape)]
        time.sleep(delay)  # real time passes too (control-file rewrites stay apart); the script measures:
        self.clock.now += delay


@pytest.fixture
def model(tmp_path, monkeypatch):
    """The fake server and words, an H200, and a 4-layer model dir (the planned choices and the fit read it)."""
    from sglang_h20 import compat

    monkeypatch.setattr(bench, "Server", _FakeServer)
    monkeypatch.setattr(_FakeServer, "clock", _VirtualTime(), raising=False)
    monkeypatch.setattr(bench, "time", _FakeServer.clock)
    monkeypatch.setattr(bench, "random_words", lambda rng, n: " ".join(["w"] * n))
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 141.0))
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    return m


def test_one_server_abba_measures_the_policy_effect(tmp_path, monkeypatch, model):
    monkeypatch.setattr(sys, "argv", ["prefix_ttft.py", "--model", str(model), "--out", str(tmp_path), "--one-server",
                                      "--lengths", "2048", "--blocks", "4", "--requests", "3", "--burst", "2"])
    assert bench.main() == 0
    rec = json.loads((tmp_path / "prefix_ttft.json").read_text())
    one = rec["one_server"]
    assert one["order"] == ["upstream", "se", "se", "upstream"]
    r = one["lengths"]["2048"]
    assert [b["arm"] for b in r["blocks"]] == one["order"]
    # upstream picks MLA at prefix 1024 (< 8192), the H200 table MHA: the fake makes MLA 2x slower
    for mode in ("single", "burst"):
        assert r[mode]["ratio_of_medians"] == pytest.approx(0.5, rel=1e-9)
        assert r[mode]["paired"]["n"] == 2 and r[mode]["paired"]["mean"] == pytest.approx(0.5, rel=1e-9)
        assert r[mode]["median_ms"] == {"upstream": pytest.approx(8.0), "se": pytest.approx(4.0)}
    assert rec["git_commit"] and rec["workload"]["blocks"] == 4
    # what each arm plans with the model's 4 layers: upstream MLA below 8192 total prefix; ours keeps one
    # 1024+1024 prefill on MLA (MHA's per-prefill cost outweighs 4 layers' gain) and a batch of 2 on MHA
    assert r["planned"] == {"upstream": {"single": "mla", "burst": "mla"}, "se": {"single": "mla", "burst": "mha"}}


def test_forced_arms_fit_the_prefix_overhead_into_the_users_table(tmp_path, monkeypatch, model):
    """--arms mla mha --fit-overhead: both paths forced on the same prefills; the fake server's MHA costs 4 ms
    more per prefill, so F = 4 ms + layers x the table's per-layer gain, written where the plugin reads first."""
    from sglang_h20.attention import mha_mla

    out = tmp_path / "table.json"
    monkeypatch.setattr(sys, "argv", ["prefix_ttft.py", "--model", str(model), "--out", str(tmp_path / "o"),
                                      "--one-server", "--lengths", "2048", "--blocks", "2", "--requests", "3",
                                      "--burst", "2", "--arms", "mla", "mha", "--fit-overhead",
                                      "--table-out", str(out)])
    monkeypatch.setitem(DELAY_S, "mha", 0.012)  # MHA 4 ms slower than MLA here
    assert bench.main() == 0
    shipped = mha_mla.load_table("NVIDIA H200", mha_mla.table_path("NVIDIA H200"))
    s = BatchShape([1024], [1024])
    want = 4000 + 4 * (shipped.cost("mla", s) - shipped.cost("mha", s))
    fitted = mha_mla.load_table("NVIDIA H200", out)
    assert fitted.mha_prefix_overhead_us == pytest.approx(want, abs=1)  # exact: the measured delays are virtual
    assert fitted.choose(s, 4) == "mla" and fitted.choose(s) == "mha"
    rec = json.loads((tmp_path / "o" / "prefix_ttft.json").read_text())
    assert rec["one_server"]["arms"] == ["mla", "mha"] and rec["fit_overhead"]["layers"] == 4


def test_fit_overhead_needs_the_forced_arms(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prefix_ttft.py", "--model", "m", "--out", str(tmp_path), "--one-server",
                                      "--fit-overhead"])
    with pytest.raises(SystemExit):
        bench.main()


def test_phase_ratios_reproduce_the_stored_phase_runs_and_need_our_phase():
    """The phase mode's ratios (our policy over each upstream phase, single and burst TTFT per length), recomputed
    from the stored phase runs' medians, equal what they wrote (session 1's record named its keys 'se_vs_...' then);
    without our phase, or with only our phase, there is no ratio."""
    from repo_scripts import stored_record

    key = "ttft_ratio_ours_over_upstream (lower is better)"
    for name in ("prefix_ttft_session3_h200.json", "prefix_ttft_old_table_h200.json"):
        rec = stored_record(f"mha_mla/{name}")
        got = bench.phase_ratios(rec["phases"])
        assert set(got) == {"se-no-prefill-graph_vs_upstream", "se-no-prefill-graph_vs_upstream-no-prefill-graph"}
        assert got == rec[key], name
    one = {"4096": {"median_ttft_ms_single": 100.0, "median_burst_ms": 400.0}}
    ours = {"4096": {"median_ttft_ms_single": 80.0, "median_burst_ms": 500.0}}
    assert bench.phase_ratios({"upstream": one, "se-no-prefill-graph": ours}) == {
        "se-no-prefill-graph_vs_upstream": {"4096": {"single": 0.8, "burst": 1.25}}}
    assert bench.phase_ratios({"upstream": one}) == {} == bench.phase_ratios({"se-no-prefill-graph": ours})


def test_block_summary_reproduces_every_stored_one_server_run():
    """The one-server A/B's figures (each arm's median TTFT, the ratio of medians, the paired ratios' mean and
    interval), recomputed from every stored run's raw block timings, equal what the run wrote: H200 and H100, in and
    out of sample. Runs before 'arms' was recorded name them by the ABBA order (A first)."""
    from repo_scripts import RESULTS

    runs = sorted((RESULTS / "mha_mla").glob("prefix_ttft*.json"))
    lengths = 0
    for path in runs:
        rec = json.loads(path.read_text())
        if "one_server" not in rec:
            continue
        one = rec["one_server"]
        arms = one.get("arms") or one["order"][:2]
        for n, got in one["lengths"].items():
            assert bench.block_summary(got["blocks"], arms) == {m: got[m] for m in ("single", "burst")}, (path, n)
            lengths += 1
    assert lengths == 6 * 3
    blocks = [{"arm": "a", "single_ms": [10.0, 12.0], "burst_ms": [40.0]},
              {"arm": "b", "single_ms": [9.0, 9.0], "burst_ms": [44.0]},
              {"arm": "b", "single_ms": [10.0], "burst_ms": [40.0]},
              {"arm": "a", "single_ms": [10.0], "burst_ms": [40.0]}]
    got = bench.block_summary(blocks, ("a", "b"))
    assert got["single"]["median_ms"] == {"a": 10.0, "b": 9.0} and got["single"]["ratio_of_medians"] == 0.9
    assert got["single"]["paired"]["mean"] == pytest.approx((9 / 11 + 1.0) / 2)  # b over a within each pair
    assert got["burst"]["paired"]["mean"] == pytest.approx((1.1 + 1.0) / 2)
