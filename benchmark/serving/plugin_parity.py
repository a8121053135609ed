#!/usr/bin/env python3
"""Does installing sglang-h20 with every feature off change anything? Same server, with and without it.

Phases alternate between `upstream` (SGLANG_PLUGINS names no plugin, so ours is never loaded) and
`plugin-off` (ours loaded, all features off); `features` turns on the two that keep the model's numerics (the
MHA/MLA policy and observation), `policy` and `observe` each of them alone. Each phase launches the real server,
sends fixed greedy prompts one at a time (batch composition identical), warms up with `--concurrency` requests at
once (Server.warm_up: no bench_serving client), then runs bench_serving `--repeats` times. The record holds the
output ids, their agreement, every throughput and the spread, and each phase against `upstream` (output tok/s
and median ITL ratios).

usage: plugin_parity.py --model DIR --out DIR [--phases upstream plugin-off upstream] [--server-args "..."]
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import time
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.nightly.serving import Server, output_ids, stop_servers_on_sigterm, write_sharegpt

PHASE_ENV = {"upstream": {"SGLANG_PLUGINS": "__none__"}, "plugin-off": {},
             # the features that keep the model's numerics (the policy picks MHA or MLA: bf16 rounding
             # only; observation, whose sampled passes replay instrumented twins of the decode graphs, at
             # --observe-fraction): greedy ids are reported against the first phase
             "features": {"SGLANG_H20_MHA_MLA_POLICY": "se", "SGLANG_H20_OBSERVE": "0.001"},
             # each of the two alone: which one costs what 'features' costs (EP 2 ran at 0.92x upstream, session 14)
             "policy": {"SGLANG_H20_MHA_MLA_POLICY": "se"}, "observe": {"SGLANG_H20_OBSERVE": "0.001"},
             # switches a one-GPU server without --enable-eplb routes around (EPLB) or serves (swapAB, SBO): the
             # record's plugin_log_lines show each feature's startup line live (runner_check, eplb_off_check)
             "switched": {"SGLANG_H20_SWAPAB": "on", "SGLANG_H20_SBO": "on", "SGLANG_H20_EPLB": "affinity",
                          "SGLANG_H20_EPLB_ASYNC": "on"}}
COMPARED = ("plugin-off", "features", "policy", "observe")  # each against upstream in the record's summary
PLUGIN_MARK = "[sglang-h20 pid"
HOOKS_APPLIED = re.compile(r"hooks applied: (\d+)/(\d+)")


def prompts(n: int = 6) -> list[str]:
    return [" ".join(f"w{(977 * i + 131 * j) % 129000 + 100}" for j in range(40 + 23 * i)) for i in range(n)]


def observed_passes(dump: Path) -> dict:
    """Sampled decode passes in an observe dump, by how they ran: 'graph' (the instrumented twin replayed) or
    'eager' (the fallback); empty when the phase observed nothing."""
    from sglang_h20.observe import export

    counts: dict[str, int] = {}
    if dump.exists():
        for r in export.read_dump([dump]):
            if r.get("kind", "stages") == "stages":
                how = "graph" if r.get("graph_sampled") else "eager"
                counts[how] = counts.get(how, 0) + 1
    return counts


def run_phase(phase: str, args, port: int, sharegpt: Path) -> dict:
    out = args.out / phase
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"server-{port}.log"
    t0 = time.time()
    env = dict(PHASE_ENV[phase])
    if "SGLANG_H20_OBSERVE" in env:
        if args.observe_fraction is not None:
            env["SGLANG_H20_OBSERVE"] = str(args.observe_fraction)
        env["SGLANG_H20_OBSERVE_DIR"] = str((out / "observe").resolve())
    with Server(args.model, shlex.split(args.server_args), log, env=env, port=port) as srv:
        ids = [output_ids(srv.generate(text=p, max_new_tokens=args.gen_tokens)) for p in prompts()]
        warm_s = srv.warm_up(args.concurrency, args.input_len, 32, args.concurrency)  # JIT, graphs: not timed
        benches = []
        for r in range(args.repeats):
            rec = srv.bench(out / f"bench{r}.jsonl", num_prompts=args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, concurrency=args.concurrency, dataset_path=str(sharegpt))
            benches.append({k: rec[k] for k in ("output_throughput", "median_itl_ms", "p99_itl_ms",
                                                "median_ttft_ms", "duration", "completed")})
            print(f"  {phase} bench {r}: {rec['output_throughput']:.1f} tok/s, median ITL {rec['median_itl_ms']:.2f} ms",
                  flush=True)
        start_s = srv.start_s
    text = log.read_text(errors="replace")
    return {"phase": phase, "env": env, "observed_passes": observed_passes(out / "observe"),
            "server_start_s": start_s, "warm_up_s": warm_s, "wall_s": time.time() - t0, "output_ids": ids,
            "bench": benches, "plugin_log_lines": [ln for ln in text.splitlines() if PLUGIN_MARK in ln],
            "hooks_applied_lines": [ln for ln in text.splitlines() if PLUGIN_MARK in ln and "hooks applied" in ln]}


def summarize(phases: list[dict]) -> dict:
    by = {}
    for p in phases:
        by.setdefault(p["phase"], []).append(p)
    tput = {k: [b["output_throughput"] for p in v for b in p["bench"]] for k, v in by.items()}
    ref_ids = phases[0]["output_ids"]
    summary = {
        "greedy_ids_identical": all(p["output_ids"] == ref_ids for p in phases),
        "per_phase_ids_identical": {p["phase"] + f"#{i}": p["output_ids"] == ref_ids for i, p in enumerate(phases)},
        "plugin_loaded_only_when_expected": all(bool(p["plugin_log_lines"]) == (p["phase"] != "upstream")
                                                for p in phases),
        "plugin_hooks_all_applied": all(m[1] == m[2] for p in phases for ln in p["hooks_applied_lines"]
                                        for m in [HOOKS_APPLIED.search(ln)]),
        "output_throughput": {k: {"runs": v, "median": statistics.median(v),
                                  "spread_pct": 100 * (max(v) - min(v)) / statistics.median(v)}
                              for k, v in tput.items()},
    }
    for other in COMPARED:  # against upstream, same run: output tok/s and median ITL
        if {"upstream", other} <= tput.keys():
            key = "plugin" if other == "plugin-off" else other
            summary[f"{key}_vs_upstream_median_ratio"] = statistics.median(tput[other]) / statistics.median(
                tput["upstream"])
            itl = {k: [b.get("median_itl_ms") for p in by[k] for b in p["bench"]] for k in ("upstream", other)}
            if all(v and None not in v for v in itl.values()):
                summary[f"{key}_vs_upstream_median_itl_ratio"] = (statistics.median(itl[other])
                                                                  / statistics.median(itl["upstream"]))
    if "upstream" in tput and tput.keys() & set(COMPARED):  # a ratio above: the spread beside it
        summary["run_to_run_spread_pct"] = max(s["spread_pct"] for s in summary["output_throughput"].values())
    return summary


def write_record(args, phases: list[dict], not_run: list[str]) -> dict:
    record = {**provenance.record(), "benchmark": "plugin_parity", "model": args.model,
              "server_args": args.server_args,
              "workload": {k: getattr(args, k) for k in ("num_prompts", "concurrency", "input_len", "output_len",
                                                          "repeats", "gen_tokens")},
              "phases_not_run": not_run, "summary": summarize(phases), "phases": phases}
    (args.result or args.out / "plugin_parity.json").write_text(json.dumps(record, indent=1))
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (e.g. scripts/make_model.py's, dummy weights)")
    ap.add_argument("--out", type=Path, required=True, help="output folder: server logs, benches, results JSON")
    ap.add_argument("--phases", nargs="+", default=["upstream", "plugin-off", "upstream", "plugin-off"],
                    choices=sorted(PHASE_ENV),
                    help="servers to run, in order: upstream (plugin not loaded), plugin-off (loaded, features "
                         "off), features (policy se + observation), policy or observe (one of the two alone) "
                         "(default: %(default)s)")
    ap.add_argument("--server-args", default="--load-format dummy",
                    help="flags of every server, one string (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="bench_serving runs per phase (default: %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=320, help="prompts per bench_serving run (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=64, help="bench_serving concurrency (default: %(default)s)")
    ap.add_argument("--input-len", type=int, default=512, help="bench_serving input tokens (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=256, help="bench_serving output tokens (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=32,
                    help="greedy tokens per fixed prompt, compared across phases (default: %(default)s)")
    ap.add_argument("--observe-fraction", type=float, help="observed share of passes in 'features' and 'observe' "
                    "(default 0.001; "
                    "0.5 makes about half of the greedy decode passes replay the instrumented twin graphs)")
    ap.add_argument("--deadline-s", type=float, default=1e9,
                    help="seconds from the start: a phase starts only if the longest one so far still fits")
    ap.add_argument("--result", type=Path, help="results JSON (default OUT/plugin_parity.json)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stop_servers_on_sigterm()
    sharegpt = write_sharegpt(args.out / "sharegpt.json")
    t0, phases = time.time(), []
    for i, phase in enumerate(args.phases):
        # a phase is a server start plus its benches: start one only if the longest so far still fits
        need = max((p["wall_s"] for p in phases), default=0.0)
        if phases and time.time() - t0 + need > args.deadline_s:
            print(f"deadline: {time.time() - t0:.0f}s gone + ~{need:.0f}s per phase > {args.deadline_s:.0f}s: "
                  f"skipping {' '.join(args.phases[i:])}", flush=True)
            break
        phases.append(run_phase(phase, args, 30000 + i, sharegpt))
        # after every phase: a killed run keeps it; the last one's not-run list is also what a deadline skips
        record = write_record(args, phases, args.phases[i + 1:])
    print(json.dumps(record["summary"], indent=1))
    return 0 if record["summary"]["greedy_ids_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
