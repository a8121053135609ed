"""benchmark/serving/observe_overhead.py without a GPU: window order, paired ratio and its interval,
log slicing, the stage-sum check and the /metrics parser, on synthetic data."""
import json
import math
import random
import time
import statistics
from pathlib import Path

import pytest

from sglang_h20 import abstats
from sglang_h20.observe import export, synth
from sglang_h20.observe.recorder import CpuClock, StageRecorder

from repo_scripts import load_script

bench = load_script("benchmark/serving/observe_overhead.py")


def test_schedule_is_abba_and_every_pair_has_both_states():
    s = bench.schedule(8)
    assert s == ["off", "on", "on", "off", "off", "on", "on", "off"]
    assert all({a, b} == {"on", "off"} for a, b in zip(s[0::2], s[1::2]))


def _windows(ratio, pairs, noise, drift=0.0, seed=0):
    """Synthetic windows: off at ~1000 tok/s drifting linearly, on = off * ratio, both noisy."""
    rng = random.Random(seed)
    out = []
    for i, state in enumerate(bench.schedule(2 * pairs)):
        base = 1000 * (1 + drift * i)
        tok = base * (ratio if state == "on" else 1.0) * (1 + rng.gauss(0, noise))
        out.append({"state": state, "tok_s": tok})
    return out


def test_paired_ratio_recovers_the_overhead_with_an_interval():
    r = bench.paired_ratio(_windows(0.99, pairs=40, noise=0.005))
    assert r["pairs"] == 40 and len(r["ratios"]) == 40
    assert r["ci95"][0] < 0.99 < r["ci95"][1]
    assert r["mean"] == pytest.approx(0.99, abs=0.003)
    assert r["overhead_pct"] == pytest.approx(1.0, abs=0.3)
    # the interval is the t interval of the pair ratios
    sd = statistics.stdev(r["ratios"])
    assert r["ci95"][1] - r["mean"] == pytest.approx(abstats.t975(39) * sd / math.sqrt(40))


def test_paired_ratio_cancels_a_linear_drift():
    """ABBA: a 1%-per-window drift biases each pair by +-1% with alternating sign; the mean keeps 1.0."""
    r = bench.paired_ratio(_windows(1.0, pairs=8, noise=0.0, drift=0.01))
    assert r["mean"] == pytest.approx(1.0, abs=1e-3)
    assert max(abs(x - 1) for x in r["ratios"]) > 0.005


def test_paired_ratio_skips_incomplete_pairs():
    w = [{"state": "off", "tok_s": 100.0}, {"state": "on", "tok_s": 99.0},
         {"state": "on", "tok_s": None}, {"state": "off", "tok_s": 100.0},
         {"state": "off", "tok_s": 100.0}]  # odd window out
    r = bench.paired_ratio(w)
    assert r["pairs"] == 1 and r["mean"] == pytest.approx(0.99) and "ci95" not in r
    assert bench.paired_ratio([])["mean"] is None
    assert abstats.t975(1) == 12.706 and abstats.t975(100) == 1.96


def _decode_line(running, tput):
    return (f"[2026-11-29 18:00:00] Decode batch, #running-req: {running}, #token: 9000, token usage: 0.10, "
            f"cuda graph: True, gen throughput (token/s): {tput:.2f}, #queue-req: 0\n")


def test_log_slice_keeps_whole_lines_and_feeds_decode_throughput():
    lines = [_decode_line(48, 1500), _decode_line(48, 1520), _decode_line(40, 1300), _decode_line(48, 1510)]
    data = "".join(lines).encode()
    n0 = len(lines[0])
    # cut in the middle of line 0 and in the middle of the last line: only lines 1 and 2 are whole
    text = bench.log_slice(data, 5, len(data) - 10)
    assert text == lines[1] + lines[2]
    assert bench.log_slice(data, n0, len(data)) == "".join(lines[1:])
    assert bench.log_slice(data, 0, 3) == ""
    from sglang_h20.nightly.serving import decode_throughput

    d = decode_throughput(bench.log_slice(data, 0, len(data)), min_running=48)
    assert d["steady_lines"] == 3 and d["median_tok_s"] == 1510


class TickClock(CpuClock):
    """A clock that advances one unit per mark: the recorder's arithmetic without the host's timing noise (with
    perf_counter a loaded CI host once made one of three layers 56% of a step, and the test's bound failed)."""

    def __init__(self):
        self.now = 0.0

    def mark(self) -> float:
        self.now += 1e-3
        return self.now


def _recorded(steps=6, layers=3):
    """Records from the real StageRecorder (a ticking clock) over a fake model: exact by construction."""
    rec = StageRecorder(clock=TickClock())
    for step in range(steps):
        rec.begin_step(step, {"mode": "decode", "batch_size": 8})
        for layer in range(layers):
            f = rec.push("layer", "layer_other", layer=layer)
            with rec.stage("attention", "attention"):
                sum(range(2000))
            rec.pop(f)
        rec.end_step()
    return rec.poll()


def test_stage_sum_check_on_recorded_and_corrupted_steps():
    records = _recorded()
    c = bench.stage_sum_check(records)
    assert c["steps"] == 6 and c["ok"] and c["share_within"] == 1.0
    assert c["median"] == pytest.approx(1.0, abs=1e-9)
    bad = json.loads(json.dumps(records))
    bad[0]["step_ms"] *= 0.9  # stages now sum to 1.11x the step
    bad[1]["layers"] = bad[1]["layers"][1:]  # a layer lost: stages sum below the step
    bad.append({"kind": "graph", "step": 99, "rank": 0, "step_ms": 1.0})  # ignored
    c = bench.stage_sum_check(bad)
    assert c["steps"] == 6 and not c["ok"] and c["share_within"] == pytest.approx(4 / 6)
    assert c["worst"] == pytest.approx(10 / 13)  # a layer (3 of the step's 13 ticks) lost: farther than 1.11x
    assert bench.stage_sum_check([]) == {"steps": 0, "ok": False}
    # a graph sample is checked against the pass timed from outside the replay (window_ms)
    g = json.loads(json.dumps(records[:2]))
    g[0]["window_ms"] = g[0]["step_ms"] * 1.02  # input copies before the replay: within 5%
    g[1]["window_ms"] = g[1]["step_ms"] * 1.2  # stages cover only 83% of the pass
    c = bench.stage_sum_check(g)
    assert c["steps"] == 2 and not c["ok"] and c["share_within"] == 0.5


def test_stage_sum_check_on_a_synthetic_dump(tmp_path):
    records = synth.synthesize(ranks=2, layers=4, steps=5, seed=1, experts=8, first_dense=1)
    path = export.write_dump(tmp_path / "d.jsonl", records)
    c = bench.stage_sum_check(export.read_dump(path))
    assert c["steps"] == 10 and c["ok"], c


def test_eager_vs_graph_and_samples_per_window():
    recs = [{"kind": "stages", "step_ms": 60.0, "batch_size": 48, "ts": 10.5},
            {"kind": "stages", "step_ms": 64.0, "batch_size": 48, "ts": 11.0},
            {"kind": "stages", "step_ms": 20.0, "batch_size": 8, "ts": 30.0},
            {"kind": "graph", "step_ms": 30.0, "batch_size": 48, "ts": 10.7},
            {"kind": "graph", "step_ms": 32.0, "batch_size": 48, "ts": 20.0}]
    e = bench.eager_vs_graph(recs)
    assert e["eager_steps"] == 3 and e["graph_steps"] == 2 and e["matched_batch_sizes"] == 1
    assert e["median_eager_over_graph"] == pytest.approx(62 / 31)
    wins = [{"t_start": 10, "t_end": 12}, {"t_start": 19, "t_end": 25}, {"t_start": 29, "t_end": 31}]
    assert bench.samples_per_window(recs, wins) == [2, 0, 1]  # graph records are not samples


def test_metrics_series_parses_prometheus_text():
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_h20.observe.export import PrometheusExporter

    reg = CollectorRegistry()
    prom = PrometheusExporter(registry=reg)
    for r in synth.synthesize(ranks=2, layers=3, steps=2, seed=0, experts=8, first_dense=1):
        prom.observe(r)
    text = generate_latest(reg).decode()
    m = bench.metrics_series(text)
    assert m["missing"] == [], m
    assert m["families"]["sglang_h20:stage_ms"] >= 2
    assert bench.metrics_series("sglang:num_running_reqs 3\n") == {"families": {}, "missing": list(bench.SERIES)}


class _FakeServer:
    """Stands in for nightly.serving.Server: a thread that reads the control file like the plugin
    does and writes 'Decode batch' lines (1% slower while observing) and sampled-step records."""

    def __init__(self, model, args, log_path, env=None, port=0, ready_timeout_s=0):
        self.log_path, self.env, self.url = Path(log_path), env, "http://fake"
        self.stop = None

    def __enter__(self):
        import threading

        from sglang_h20.observe.stages import Control

        self.start_s = 0.0
        self.stop = threading.Event()
        control = Control(self.env["SGLANG_H20_OBSERVE_CONTROL"], every=1)
        writer = export.JsonlWriter(self.env["SGLANG_H20_OBSERVE_DIR"], 0)
        records = _recorded(steps=1, layers=2)

        def serve():
            fraction, step = float(self.env["SGLANG_H20_OBSERVE"]), 0
            with open(self.log_path, "a") as log:
                while not self.stop.is_set():
                    v = control.read()
                    fraction = fraction if v is None else v
                    step += 1
                    log.write(_decode_line(48, 1000.0 * (0.99 if fraction > 0 else 1.0)))
                    log.flush()
                    if fraction > 0 and step % 3 == 0:
                        writer.write({**records[0], "step": step, "ts": time.time()})
                    time.sleep(0.005)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def bench(self, out_jsonl, timeout_s=600, **kw):
        if Path(out_jsonl).name == "load.jsonl":  # the load run: lasts until the server stops
            self.stop.wait(timeout_s)
            raise RuntimeError("server gone")
        return {"completed": 1}


def test_driver_end_to_end_with_a_fake_server(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "Server", _FakeServer)
    monkeypatch.setattr(bench, "fetch_metrics", lambda url: "sglang_h20:step_ms{rank=\"0\"} 1.0\n")
    out = tmp_path / "run"
    rc = bench.main(["--out", str(out), "--window-s", "0.4", "--settle-s", "0.1", "--windows", "8",
                     "--lead-s", "0.1", "--tail-s", "0", "--deadline-s", "60", "--num-prompts", "10"])
    rec = json.loads((out / "observe_overhead.json").read_text())
    assert rc == 0 and rec["errors"] == [] and len(rec["windows"]) == 8
    assert rec["overhead"]["pairs"] == 4 and rec["overhead"]["mean"] == pytest.approx(0.99, abs=1e-6)
    assert rec["overhead"]["by_step_rate"]["mean"] == pytest.approx(0.99, abs=1e-6)
    v = rec["verdict"]
    assert v["overhead_within_1pct"] and v["stage_sum_within_5pct"] and v["off_windows_unsampled"]
    assert v["on_windows_sampled"] > 0 and not v["metrics_series_present"]
    assert rec["metrics"]["missing"] == [s for s in bench.SERIES if s != "sglang_h20:step_ms"]
    assert rec["load"].startswith("RuntimeError") and "git_commit" in rec
    assert rec["server_env"]["SGLANG_H20_OBSERVE"] == "0.001"
    assert rec["overhead"]["modelled_overhead_pct"] is None  # the fake dump has no graph reference steps
    assert not v["modelled_overhead_within_1pct"]


def test_window_rate_counts_rare_slow_steps_that_the_median_skips():
    """At a low fraction only some decode lines hold a sampled (eager) step: the median of the
    lines ignores them, the harmonic mean (tokens over time) does not."""
    from sglang_h20.nightly.serving import decode_throughput

    off = "".join(_decode_line(48, 1000) for _ in range(6))
    on = "".join(_decode_line(48, 950 if i % 3 == 0 else 1000) for i in range(6))
    d_off, d_on = decode_throughput(off, 48), decode_throughput(on, 48)
    assert d_on["median_tok_s"] == d_off["median_tok_s"] == 1000
    assert d_on["mean_tok_s"] / d_off["mean_tok_s"] == pytest.approx(6 / (4 + 2 / 0.95))


def test_step_rate_normalizes_the_batch_size():
    text = _decode_line(48, 960) + _decode_line(44, 880) + _decode_line(20, 100)
    assert bench.step_rate(text, 40) == pytest.approx(20.0)  # 960/48 = 880/44 = 20 steps/s
    assert bench.step_rate(text, 64) is None


def _analyzed(tmp_path, on_tok_s, observe_fraction, eager_ms=12.0):
    """analyze() over a written server log (8 ABBA windows of decode lines: off at 1000 tok/s, on at on_tok_s
    alternating with +1) and a dump: graph reference steps of 10 ms, sampled steps of eager_ms inside the 'on'
    windows only, each step's stages tiling its time."""
    out = tmp_path / f"run-{on_tok_s}-{observe_fraction}"
    (out / "dump").mkdir(parents=True)
    log, windows, records = b"", [], []
    for i, state in enumerate(bench.schedule(8)):
        tok = 1000.0 if state == "off" else on_tok_s + (i % 2)
        start = len(log)
        log += "".join(_decode_line(8, tok) for _ in range(5)).encode()
        windows.append({"state": state, "off_start": start, "off_end": len(log), "t_start": 10.0 * i,
                        "t_end": 10.0 * i + 9})
        records += [{"kind": "graph", "step": 2 * i, "rank": 0, "ts": 10.0 * i + 1, "step_ms": 10.0, "batch_size": 8}]
        if state == "on":
            records += [{"kind": "stages", "step": 2 * i + 1, "rank": 0, "ts": 10.0 * i + 2, "step_ms": eager_ms,
                         "batch_size": 8,
                         "layers": [{"stages": {"attn": eager_ms / 2}}], "outside": {"other": eager_ms / 2}}]
    (out / "server.log").write_bytes(log)
    (out / "dump" / "observe-rank000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    res = {"windows": windows, "server_env": {"SGLANG_H20_OBSERVE": str(observe_fraction)},
           "metrics": {"missing": []}}
    return bench.analyze(res, out, min_running=8)


def test_analyze_verdicts_from_a_log_and_a_dump(tmp_path):
    """The verdicts the observability overhead claim reads: within 1% (paired mean >= 0.99), conclusive (the
    interval's lower end >= 0.99 too), the modelled overhead f * (r - 1) with r the sampled step over the graph
    step, off windows unsampled and on windows sampled."""
    a = _analyzed(tmp_path, 995.0, 0.02)
    o, v = a["overhead"], a["verdict"]
    assert o["pairs"] == 4 and o["ratios"] == pytest.approx([0.996, 0.995, 0.996, 0.995])
    assert o["median_on_over_median_off"] == pytest.approx(0.9955)
    assert o["modelled_overhead_pct"] == pytest.approx(100 * 0.02 * (12 / 10 - 1))
    assert a["eager_vs_graph"]["median_eager_over_graph"] == pytest.approx(1.2)
    assert v == {"overhead_within_1pct": True, "modelled_overhead_within_1pct": True, "overhead_conclusive": True,
                 "stage_sum_within_5pct": True, "off_windows_unsampled": True, "on_windows_sampled": 4,
                 "metrics_series_present": True}
    v = _analyzed(tmp_path, 980.0, 0.1)["verdict"]  # 2% slower, and a sampled step costs 10 x 20% = 2% modelled
    assert not v["overhead_within_1pct"] and not v["overhead_conclusive"] and not v["modelled_overhead_within_1pct"]
    near = _analyzed(tmp_path, 989.6, 0.02)  # the mean at 0.99 but its interval reaching below: not conclusive
    assert near["verdict"]["overhead_within_1pct"] and not near["verdict"]["overhead_conclusive"]
    assert near["overhead"]["ci95"][0] < 0.99 <= near["overhead"]["mean"]
