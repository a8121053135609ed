#!/usr/bin/env python3
"""Observation overhead and stage-sum check on ONE server: observation flipped on/off in windows.

Two separate servers differ by 12-16% in throughput on the GPU host, so a 1% overhead can only be
seen inside one server. The server starts with SGLANG_H20_OBSERVE=<fraction> (hooks installed) and
SGLANG_H20_OBSERVE_CONTROL=<file>; this script writes the fraction or 0 into that file every
--window-s seconds while bench_serving keeps a steady decode load (fixed concurrency, long outputs
of varied length so requests finish at different times). Windows run in ABBA order (off on, on off,
...) so a linear drift cancels in the mean of the pairs.

Per window: decode tok/s = the harmonic mean (tokens over time) of the 'gen throughput' of the
server's 'Decode batch' log lines written inside the window after --settle-s (the control file is
read every 32 passes and a line covers 40 steps), taking only lines at full batch (#running-req >=
--min-running, default the concurrency). Not the median: at fraction 0.01 most lines hold no
sampled step, and the median would skip the ones that do. Per pair: ratio on/off. Reported: the
mean ratio with a t-based 95% interval over pairs.

The rolling JSON dump (SGLANG_H20_OBSERVE_DIR) gives the stage-sum check: per sampled step,
(sum of every layer stage + outside_layers) / step_ms, its median, worst and share within 5%
(the stages are consecutive CUDA-event segments of one stream, so this checks the bookkeeping on
the real model: no gap, no double count). Also from the dump: sampled steps per window (off
windows must have none) and the eager sampled step against the graph-replay reference steps (the
inflation r behind the expected overhead f * (r - 1)). /metrics is checked for sglang_h20:*.

The overhead is also modelled from the run's own measurements, f * (r - 1) with r the eager/graph step
ratio from the dump ("modelled_overhead_pct"): the windows' quantisation noise (a 40-step log line
either holds a sampled step or not) does not enter it.

usage: observe_overhead.py --out DIR [--model /tmp/models/dsv3-ep16-slice] [--fraction 0.001]
                           [--window-s 40] [--windows 8] [--concurrency 48] [--deadline-s 300]
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.abstats import mean_ci95
from sglang_h20.controlfile import write_control
from sglang_h20.nightly.serving import DECODE_LINE, Server, decode_throughput, with_mem_fraction, write_sharegpt

SERVER_ARGS = ("--load-format dummy --attention-backend flashmla --sampling-backend pytorch "
               "--moe-runner-backend triton --fp8-gemm-backend triton --grammar-backend none "
               "--mem-fraction-static 0.6 --cuda-graph-max-bs 64 --enable-metrics")
BASE_ENV = {"SGL_KERNEL_FLASHINFER": "0", "SGLANG_OPT_USE_JIT_KERNEL_GROUPED_TOPK": "1",
            "SGLANG_ENABLE_JIT_DEEPGEMM": "0"}
SERIES = ("sglang_h20:stage_ms", "sglang_h20:step_stage_ms", "sglang_h20:step_ms",
          "sglang_h20:expert_balancedness", "sglang_h20:observe_samples")

def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Analysis (pure functions, CPU-tested in test/cpu/test_observe_overhead.py)
# ---------------------------------------------------------------------------------------------
def schedule(k: int) -> list[str]:
    """ABBA order over k windows: off on | on off | off on ... (pairs alternate which goes first)."""
    return [(("off", "on") if (i // 2) % 2 == 0 else ("on", "off"))[i % 2] for i in range(k)]


def paired_ratio(windows: list[dict], key: str = "tok_s") -> dict:
    """Windows in run order, consecutive pairs (0,1), (2,3), ... each one 'on' and one 'off'.
    Ratio on/off per pair with a value in both; mean, sd and the t 95% interval of the mean."""
    ratios = []
    for a, b in zip(windows[0::2], windows[1::2]):
        by = {a["state"]: a.get(key), b["state"]: b.get(key)}
        if set(by) == {"on", "off"} and by["on"] and by["off"]:
            ratios.append(by["on"] / by["off"])
    ci = mean_ci95(ratios)
    out = {"pairs": len(ratios), "ratios": ratios, **{k: v for k, v in ci.items() if k not in ("n", "values")}}
    if not ratios:
        return out
    out["overhead_pct"] = (1 - out["mean"]) * 100
    on = [w[key] for w in windows if w["state"] == "on" and w.get(key)]
    off = [w[key] for w in windows if w["state"] == "off" and w.get(key)]
    if on and off:
        out["median_on_over_median_off"] = statistics.median(on) / statistics.median(off)
    return out


def log_slice(data: bytes, start: int, end: int) -> str:
    """Whole lines of a log written between two byte offsets (a line cut at either end is dropped)."""
    chunk = data[start:end]
    if start > 0 and data[start - 1:start] != b"\n":
        cut = chunk.find(b"\n")
        chunk = chunk[cut + 1:] if cut >= 0 else b""
    cut = chunk.rfind(b"\n")
    chunk = chunk[:cut + 1] if cut >= 0 else b""
    return chunk.decode(errors="replace")


def step_rate(text: str, min_running: int) -> float | None:
    """Decode steps per second over 'Decode batch' lines with at least min_running requests:
    harmonic mean of gen throughput / #running (each line spans the same number of steps), so the
    batch-size mix of a window matters less than in tok/s."""
    rates = [float(m["tput"]) / int(m["running"]) for m in DECODE_LINE.finditer(text)
             if int(m["running"]) >= max(1, min_running) and float(m["tput"]) > 0]
    return statistics.harmonic_mean(rates) if rates else None


def stage_sum_check(records: list[dict], tol: float = 0.05) -> dict:
    """Per sampled step: (sum of layer stages + outside) / the step's time; overlap stages excluded (they
    run on another stream, beside the critical path). The step's time is window_ms where the record has
    it (a graph sample: the pass timed from outside the replay, so the check is independent of the stage
    events), else step_ms (an eager sample, whose stages tile the step by construction)."""
    ratios = []
    for r in records:
        if r.get("kind", "stages") != "stages" or not r.get("step_ms"):
            continue
        total = sum(v for e in r.get("layers", ()) for v in e.get("stages", {}).values())
        total += sum(r.get("outside", {}).values())
        ratios.append(total / (r.get("window_ms") or r["step_ms"]))
    if not ratios:
        return {"steps": 0, "ok": False}
    worst = max(ratios, key=lambda x: abs(x - 1))
    within = sum(abs(x - 1) <= tol for x in ratios) / len(ratios)
    return {"steps": len(ratios), "median": statistics.median(ratios), "worst": worst,
            "share_within": within, "tolerance": tol, "ok": within == 1.0}


def eager_vs_graph(records: list[dict]) -> dict:
    """Sampled step time (an instrumented-graph replay, or an eager pass in the fallback) against the
    graph-replay reference steps, overall and matched by batch size: the inflation r of a sampled step
    that sets the overhead (about f * (r - 1)). Keys keep the 'eager' names of the first design."""
    eager = [r for r in records if r.get("kind", "stages") == "stages" and r.get("step_ms")]
    graph = [r for r in records if r.get("kind") == "graph" and r.get("step_ms")]
    out = {"eager_steps": len(eager), "graph_steps": len(graph)}
    if eager and graph:
        out["median_eager_ms"] = statistics.median(r["step_ms"] for r in eager)
        out["median_graph_ms"] = statistics.median(r["step_ms"] for r in graph)
        matched = []
        for bs in {r.get("batch_size") for r in eager} & {r.get("batch_size") for r in graph} - {None}:
            e = statistics.median(r["step_ms"] for r in eager if r.get("batch_size") == bs)
            g = statistics.median(r["step_ms"] for r in graph if r.get("batch_size") == bs)
            matched.append(e / g)
        if matched:
            out["matched_batch_sizes"] = len(matched)
            out["median_eager_over_graph"] = statistics.median(matched)
    return out


def samples_per_window(records: list[dict], windows: list[dict]) -> list[int]:
    """Sampled steps whose start time falls in each window's measured span [t_start, t_end]."""
    ts = [r["ts"] for r in records if r.get("kind", "stages") == "stages" and "ts" in r]
    return [sum(w["t_start"] <= t <= w["t_end"] for t in ts) for w in windows]


def metrics_series(text: str) -> dict:
    """sglang_h20:* samples on a Prometheus text page, by family (histogram/counter suffixes folded)."""
    fams: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("sglang_h20:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for suffix in ("_bucket", "_count", "_sum", "_total", "_created"):
            if name.endswith(suffix) and name[: -len(suffix)] in SERIES:
                name = name[: -len(suffix)]
                break
        fams[name] = fams.get(name, 0) + 1
    return {"families": fams, "missing": [s for s in SERIES if s not in fams]}


# ---------------------------------------------------------------------------------------------
# GPU run
# ---------------------------------------------------------------------------------------------
def wait_full_batch(log: Path, offset: int, min_running: int, timeout_s: float) -> bool:
    """Wait until the server logs a decode batch of at least min_running requests after offset
    (bench_serving takes a while to start: tokenizer, dataset, its own warm-up request)."""
    end = time.time() + max(0.0, timeout_s)
    while time.time() < end:
        text = log_slice(log.read_bytes(), offset, log.stat().st_size + 1)
        if any(int(m["running"]) >= min_running for m in DECODE_LINE.finditer(text)):
            return True
        time.sleep(0.5)
    return False


def fetch_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode(errors="replace")


def run(args) -> dict:
    t0 = time.time()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    control, dump = out / "control", out / "dump"
    write_control(control, args.warmup_fraction)
    sharegpt = write_sharegpt(out / "sharegpt.json", n=args.num_prompts)
    env = {**BASE_ENV, "SGLANG_H20_OBSERVE": str(args.fraction),
           "SGLANG_H20_OBSERVE_CONTROL": str(control.resolve()), "SGLANG_H20_OBSERVE_DIR": str(dump.resolve())}
    log = out / "server.log"
    res: dict = {"windows": [], "errors": [], "server_env": env}
    load_box: dict = {}
    with Server(args.model, shlex.split(args.server_args), log, env=env, port=args.port,
                ready_timeout_s=args.deadline_s) as srv:
        res["server_start_s"] = srv.start_s
        # warm-up at a high fraction: Triton JIT of the eager shapes the sampled passes use; output
        # lengths spread so the batch shrinks through every size on the way out
        srv.bench(out / "warmup.jsonl", num_prompts=args.concurrency, input_len=args.input_len, output_len=64,
                  concurrency=args.concurrency, dataset_path=str(sharegpt), extra=["--random-range-ratio", "0.1"])
        write_control(control, 0.0)
        time.sleep(2)
        try:
            res["metrics"] = metrics_series(fetch_metrics(srv.url))
        except Exception as e:
            res["metrics"] = {"error": f"{type(e).__name__}: {e}"}

        def load():
            try:
                load_box["bench"] = srv.bench(
                    out / "load.jsonl", num_prompts=args.num_prompts, input_len=args.input_len,
                    output_len=args.output_len, concurrency=args.concurrency, dataset_path=str(sharegpt),
                    extra=["--random-range-ratio", str(args.range_ratio)],
                    timeout_s=max(60.0, args.deadline_s - (time.time() - t0)) + 60)
            except Exception as e:  # the server stops under it at the end: expected
                load_box["error"] = f"{type(e).__name__}: {str(e)[:300]}"

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        full = wait_full_batch(log, log.stat().st_size, args.min_running or args.concurrency,
                               args.deadline_s - (time.time() - t0) - args.tail_s)
        res["load_ready_s"] = time.time() - t0
        time.sleep(args.lead_s)
        left = args.deadline_s - (time.time() - t0) - args.tail_s
        k = min(args.windows, int(left // args.window_s)) // 2 * 2
        res["windows_planned"] = k
        if not full or k < 2:
            res["errors"].append(f"no full-batch decode ({left:.0f}s left)" if not full
                                 else f"no time for two windows ({left:.0f}s left)")
            k = 0
        else:
            _say(f"{k} windows of {args.window_s}s, fraction {args.fraction} vs 0, concurrency {args.concurrency}")
        for i, state in enumerate(schedule(k)):
            if not thread.is_alive():
                res["errors"].append(f"load ended before window {i}")
                break
            write_control(control, args.fraction if state == "on" else 0.0)
            flip = time.time()
            time.sleep(args.settle_s)
            w = {"index": i, "state": state, "t_flip": flip, "t_start": time.time(), "off_start": log.stat().st_size}
            time.sleep(max(0.0, flip + args.window_s - time.time()))
            w.update(t_end=time.time(), off_end=log.stat().st_size)
            res["windows"].append(w)
        write_control(control, 0.0)
        time.sleep(2)  # the last samples reach the dump
    thread.join(90)
    bench = load_box.get("bench", {})
    res["load"] = load_box.get("error") or {key: bench.get(key) for key in ("completed", "duration")}
    return res


def analyze(res: dict, out: Path, min_running: int) -> dict:
    from sglang_h20.observe import export

    data = (out / "server.log").read_bytes()
    for w in res["windows"]:
        text = log_slice(data, w["off_start"], w["off_end"])
        d = decode_throughput(text, min_running=min_running)
        w.update(tok_s=d.get("mean_tok_s"), tok_s_median=d["median_tok_s"], decode_lines=d["lines"],
                 full_batch_lines=d["steady_lines"], steps_s=step_rate(text, int(0.9 * min_running)))
    errors: list = []
    records = export.read_dump(out / "dump", errors) if (out / "dump").exists() else []
    stage_records = [r for r in records if r.get("kind", "stages") == "stages"]
    for w, n in zip(res["windows"], samples_per_window(records, res["windows"])):
        w["sampled_steps"] = n
    overhead = paired_ratio(res["windows"])
    overhead["by_median_lines"] = paired_ratio(res["windows"], key="tok_s_median")
    overhead["by_step_rate"] = paired_ratio(res["windows"], key="steps_s")  # lines >= 0.9 x min_running
    stage_sum = stage_sum_check(stage_records)
    ratio_ok = overhead.get("mean") is not None and overhead["mean"] >= 0.99
    off_clean = all(w["sampled_steps"] == 0 for w in res["windows"] if w["state"] == "off")
    on_sampled = sum(w["sampled_steps"] for w in res["windows"] if w["state"] == "on")
    evg = eager_vs_graph(records)
    r = evg.get("median_eager_over_graph")
    frac = float(res.get("server_env", {}).get("SGLANG_H20_OBSERVE", 0) or 0)
    overhead["modelled_overhead_pct"] = 100 * frac * (r - 1) if r else None  # f * (r - 1)
    return {"overhead": overhead, "stage_sum": stage_sum, "eager_vs_graph": evg,
            "dump": {"records": len(records), "stages": len(stage_records), "bad_lines": errors[:5]},
            "verdict": {"overhead_within_1pct": ratio_ok,
                        "modelled_overhead_within_1pct": bool(r) and overhead["modelled_overhead_pct"] <= 1.0,
                        "overhead_conclusive": bool(overhead.get("ci95")) and overhead["ci95"][0] >= 0.99,
                        "stage_sum_within_5pct": stage_sum["ok"],
                        "off_windows_unsampled": off_clean, "on_windows_sampled": on_sampled,
                        "metrics_series_present": not res.get("metrics", {}).get("missing", SERIES)
                        and "error" not in res.get("metrics", {})}}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/models/dsv3-ep16-slice",
                    help="model folder (scripts/make_model.py's; default: %(default)s)")
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder: server log, control file, dumps, results JSON")
    ap.add_argument("--fraction", type=float, default=0.001,
                    help="observe fraction of the 'on' windows (0.01 cost 14%% on the H200: eager steps are 9x)")
    ap.add_argument("--warmup-fraction", type=float, default=0.25,
                    help="observe fraction during the warm-up (JIT of the sampled passes' shapes; "
                         "default: %(default)s)")
    ap.add_argument("--window-s", type=float, default=40, help="long enough for a few sampled steps at the fraction")
    ap.add_argument("--windows", type=int, default=8, help="at most this many (even; fewer if the deadline says so)")
    ap.add_argument("--settle-s", type=float, default=3, help="start of each window left out of its measure")
    ap.add_argument("--lead-s", type=float, default=3, help="after the first full-batch decode line")
    ap.add_argument("--tail-s", type=float, default=25, help="kept for shutdown and analysis")
    ap.add_argument("--concurrency", type=int, default=48,
                    help="bench_serving concurrency of the steady load (default: %(default)s)")
    ap.add_argument("--min-running", type=int, help="decode lines counted (default: the concurrency)")
    ap.add_argument("--input-len", type=int, default=256, help="input tokens per request (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=1024,
                    help="output tokens per request, spread by --range-ratio (default: %(default)s)")
    ap.add_argument("--range-ratio", type=float, default=0.5, help="output lengths spread: staggered finishes")
    ap.add_argument("--num-prompts", type=int, default=2000, help="more than the windows need")
    ap.add_argument("--server-args", default=SERVER_ARGS, help="flags of the server, one string (default: %(default)s)")
    ap.add_argument("--port", type=int, default=30000, help="server port (default: %(default)s)")
    ap.add_argument("--deadline-s", type=float, default=300,
                    help="seconds for the whole run, server start included; the windows are fitted into it "
                         "(default: %(default)s)")
    ap.add_argument("--result", type=Path, help="results JSON (default OUT/observe_overhead.json)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.server_args = with_mem_fraction(args.server_args)  # an 80 GB GPU: 0.88 (the records' 0.6 is the H200's)
    try:
        res = run(args)
    except Exception as e:  # e.g. the server did not start: still a results file saying why
        res = {"windows": [], "errors": [f"{type(e).__name__}: {str(e)[-3000:]}"]}
    res.update(analyze(res, args.out, args.min_running or args.concurrency) if res["windows"] else {})
    record = {**provenance.record(), "benchmark": "observe_overhead", "model": args.model,
              "server_args": args.server_args, "env": BASE_ENV,
              "settings": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()}, **res}
    result = args.result or args.out / "observe_overhead.json"
    result.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record.get(k) for k in ("overhead", "stage_sum", "eager_vs_graph", "verdict", "errors")},
                     indent=1, default=str))
    return 0 if res["windows"] and not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
