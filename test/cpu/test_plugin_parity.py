"""The parity benchmark's verdicts (benchmark/serving/plugin_parity.py summarize): a wrong verdict would
report a plugin leak or a missed load as fine, or flag a correct run."""
from __future__ import annotations

from repo_scripts import load_script

bench = load_script("benchmark/serving/plugin_parity.py")

LOADED = ["[sglang-h20 pid 7] hooks applied: 3/3 (a, b, c)"]


def phase(name, ids, lines, tput=100.0):
    return {"phase": name, "output_ids": ids, "plugin_log_lines": lines,
            "hooks_applied_lines": [ln for ln in lines if "hooks applied" in ln],
            "bench": [{"output_throughput": tput}]}


def test_loaded_in_every_phase_but_upstream():
    ok = bench.summarize([phase("upstream", [[1, 2]], []), phase("plugin-off", [[1, 2]], LOADED),
                          phase("features", [[1, 2]], LOADED)])
    assert ok["plugin_loaded_only_when_expected"] and ok["greedy_ids_identical"] and ok["plugin_hooks_all_applied"]
    leak = bench.summarize([phase("upstream", [[1, 2]], LOADED), phase("features", [[1, 2]], LOADED)])
    assert not leak["plugin_loaded_only_when_expected"]
    missing = bench.summarize([phase("upstream", [[1, 2]], []), phase("features", [[1, 3]], [])])
    assert not missing["plugin_loaded_only_when_expected"] and not missing["greedy_ids_identical"]


def test_partly_applied_hooks_are_flagged():
    s = bench.summarize([phase("upstream", [[1]], []),
                         phase("plugin-off", [[1]], ["[sglang-h20 pid 7] hooks applied: 2/3 (a, b)"])])
    assert not s["plugin_hooks_all_applied"]


def test_observed_passes_counts_twin_replays_and_eager_samples(tmp_path):
    """The 'features' phase reports how its sampled passes ran, so a parity run with observation on shows the
    instrumented twins were replayed (not silently skipped) while the greedy ids stayed equal."""
    import json

    assert bench.observed_passes(tmp_path / "missing") == {}
    dump = tmp_path / "observe"
    dump.mkdir()
    recs = [{"kind": "stages", "step": 1, "rank": 0, "graph_sampled": True},
            {"kind": "stages", "step": 2, "rank": 0, "graph_sampled": True},
            {"kind": "stages", "step": 3, "rank": 0, "graph_sampled": False},
            {"kind": "graph", "step": 4, "rank": 0}]
    (dump / "observe-rank000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert bench.observed_passes(dump) == {"graph": 2, "eager": 1}


def test_features_against_upstream_same_run():
    """The issue's comparison, upstream vs the plugin's features in one run: output tok/s and median ITL ratios."""
    def timed(name, lines, tput, itl):
        p = phase(name, [[1]], lines, tput)
        p["bench"] = [{"output_throughput": tput, "median_itl_ms": itl}]
        return p

    s = bench.summarize([timed("upstream", [], 100.0, 4.0), timed("features", LOADED, 90.0, 5.0)])
    assert abs(s["features_vs_upstream_median_ratio"] - 0.9) < 1e-9
    assert abs(s["features_vs_upstream_median_itl_ratio"] - 1.25) < 1e-9
    assert "plugin_vs_upstream_median_ratio" not in s
    # each feature alone against the same upstream phase: which of the two costs what 'features' costs
    s = bench.summarize([timed("upstream", [], 100.0, 4.0), timed("policy", LOADED, 99.0, 4.0),
                         timed("observe", LOADED, 92.0, 4.4)])
    assert abs(s["policy_vs_upstream_median_ratio"] - 0.99) < 1e-9
    assert abs(s["observe_vs_upstream_median_itl_ratio"] - 1.1) < 1e-9 and "run_to_run_spread_pct" in s
    # benches without ITL (older records): the throughput ratio alone
    s = bench.summarize([phase("upstream", [[1]], [], 100.0), phase("plugin-off", [[1]], LOADED, 101.0)])
    assert abs(s["plugin_vs_upstream_median_ratio"] - 1.01) < 1e-9 and "plugin_vs_upstream_median_itl_ratio" not in s


def test_server_warm_up_sends_every_prompt_at_the_concurrency_asked(tmp_path):
    """Server.warm_up replaces a bench_serving warm-up: every prompt sent once, with the input length asked, at
    most `concurrency` in flight at a time, and a failed request fails the warm-up."""
    import threading
    import time

    from sglang_h20.nightly.serving import Server

    srv = Server("/nonexistent-model", [], tmp_path / "server.log")
    lock, live, seen = threading.Lock(), [0, 0], []

    def fake(input_ids=None, max_new_tokens=0, text=None):
        with lock:
            live[0] += 1
            live[1] = max(live[1], live[0])
            seen.append((len(input_ids), max_new_tokens))
        time.sleep(0.02)
        with lock:
            live[0] -= 1
        return {"output_ids": [1] * max_new_tokens}

    srv.generate = fake
    assert srv.warm_up(12, 7, 3, 4) > 0
    assert seen == [(7, 3)] * 12 and 2 <= live[1] <= 4

    def failing(**kw):
        raise RuntimeError("HTTP 500")

    srv.generate = failing
    try:
        srv.warm_up(3, 7, 3, 2)
    except RuntimeError as e:
        assert "HTTP 500" in str(e)
    else:
        raise AssertionError("a failed warm-up request must fail the warm-up")
