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
    live[1] = 0
    assert srv.warm_up(4, 7, 3, 1) > 0 and live[1] == 1  # one at a time when asked

    def failing(**kw):
        raise RuntimeError("HTTP 500")

    srv.generate = failing
    try:
        srv.warm_up(3, 7, 3, 2)
    except RuntimeError as e:
        assert "HTTP 500" in str(e)
    else:
        raise AssertionError("a failed warm-up request must fail the warm-up")


def test_server_requests_reach_sglangs_endpoints_as_greedy_json(tmp_path):
    """generate / generate_batch / post against a local HTTP stand-in: the path, and the JSON body SGLang's
    /generate reads (greedy, ignore_eos, the new-token count asked)."""
    import http.server
    import json
    import threading

    from sglang_h20.nightly.serving import Server

    got = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body))
            reply = json.dumps({"path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        srv = Server("/nonexistent-model", [], tmp_path / "server.log")
        srv.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        greedy = lambda n: {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
        assert srv.generate(text="hi") == {"path": "/generate"}
        assert got[-1] == ("/generate", {"text": "hi", "sampling_params": greedy(32)})
        srv.generate(input_ids=[5, 6], max_new_tokens=3)
        assert got[-1] == ("/generate", {"input_ids": [5, 6], "sampling_params": greedy(3)})
        srv.generate_batch(["a", "b"], return_logprob=True)
        assert got[-1] == ("/generate", {"text": ["a", "b"], "return_logprob": True, "sampling_params": greedy(1)})
        assert json.loads(srv.post("/start_profile", {"num_steps": 2})) == {"path": "/start_profile"}
        assert got[-1] == ("/start_profile", {"num_steps": 2})
        srv.post("/stop_profile")
        assert got[-1] == ("/stop_profile", {})
    finally:
        httpd.shutdown()


def test_which_phase_differs_and_the_spread_beside_the_ratios():
    """A phase whose greedy ids differ is named (the others stay identical to the first phase); each phase's spread
    is (max - min) / median of its runs, and the run-to-run spread beside the ratios is the largest of them."""
    def runs(name, ids, *tputs):
        p = phase(name, ids, [] if name == "upstream" else LOADED)
        p["bench"] = [{"output_throughput": t} for t in tputs]
        return p

    s = bench.summarize([runs("upstream", [[1, 2]], 100.0, 110.0, 90.0), runs("features", [[1, 3]], 100.0, 104.0),
                         runs("upstream", [[1, 2]], 95.0)])
    assert s["per_phase_ids_identical"] == {"upstream#0": True, "features#1": False, "upstream#2": True}
    assert not s["greedy_ids_identical"]
    up = s["output_throughput"]["upstream"]
    assert up["runs"] == [100.0, 110.0, 90.0, 95.0] and up["median"] == 97.5
    assert abs(up["spread_pct"] - 100 * 20 / 97.5) < 1e-9 and abs(s["run_to_run_spread_pct"] - up["spread_pct"]) < 1e-9
    assert abs(s["output_throughput"]["features"]["spread_pct"] - 100 * 4 / 102) < 1e-9
    assert "run_to_run_spread_pct" not in bench.summarize([runs("upstream", [[1]], 1.0, 2.0)])  # no ratio, no spread


def test_the_stored_runs_verdicts_and_ratios_are_what_summarize_gives_their_phases():
    """The parity records the results README quotes (every feature off; the two one-GPU runs of session 48; the EP-2
    flashmla pair), recomputed from their phases with today's code: every stored figure again (older records lack the
    ITL ratio added later)."""
    from repo_scripts import stored_record

    for name in ("plugin_parity_h200.json", "plugin_parity_policy_observe_s48_run1_h200.json.xz",
                 "plugin_parity_policy_observe_s48_run2_h200.json.xz", "plugin_parity_ep2_flashmla_h200.json"):
        rec = stored_record(name)
        got = bench.summarize(rec["phases"])
        assert {k: got[k] for k in rec["summary"]} == rec["summary"], name
        assert got["greedy_ids_identical"], name


def test_the_run_exits_1_when_a_phases_greedy_ids_differ(tmp_path, monkeypatch):
    """main's exit status is the greedy verdict: 0 when every phase gave the first one's ids, else 1; each phase
    on its own port, the record written with what ran."""
    import json
    import sys

    ids = {"upstream": [[1, 2]], "plugin-off": [[1, 2]]}
    ports = []

    def fake_phase(name, args, port, sharegpt):
        ports.append(port)
        return {**phase(name, ids[name], [] if name == "upstream" else LOADED), "wall_s": 1.0}
    monkeypatch.setattr(bench, "run_phase", fake_phase)
    monkeypatch.setattr(bench, "stop_servers_on_sigterm", lambda: None)
    monkeypatch.setattr(sys, "argv", ["plugin_parity.py", "--model", "/m", "--out", str(tmp_path)])
    assert bench.main() == 0 and ports == [30000, 30001, 30002, 30003]
    ids["plugin-off"] = [[1, 3]]
    assert bench.main() == 1
    rec = json.loads((tmp_path / "plugin_parity.json").read_text())
    assert rec["summary"]["per_phase_ids_identical"] == {"upstream#0": True, "plugin-off#1": False,
                                                         "upstream#2": True, "plugin-off#3": False}
