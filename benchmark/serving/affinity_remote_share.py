#!/usr/bin/env python3
"""Expert-affinity placement measured in the server: the share of dispatched tokens that leave their GPU.

Issue 9 asks for it against upstream EPLB on the same workload. One server per arm, EP = DP attention = every
visible GPU, SGLang's EPLB on (`--enable-eplb`, rebalance every --rebalance-iterations passes), observation at
--fraction. The arms differ only in `--eplb-algorithm`: `deepseek` (upstream) or `affinity` (ours, with
SGLANG_H20_EPLB=affinity). Each runs a warm-up bench_serving long enough for rebalances, then a measured one.
The quantity is `remote_share` of the sampled passes after the last rebalance of the warm-up (observe.stages):
per rank and MoE layer, the share of the rank's routed (token, expert) pairs whose expert lives on another rank.

Caveat: the dummy model's random weights give routing without co-activation structure, the structure
affinity placement exploits; the EPLB simulator (python -m sglang_h20.eplb simulate) shows how much it buys
with it. This run measures the real server path, whatever the routing.

usage: affinity_remote_share.py --model DIR --out DIR [--gpus 2] [--fraction 0.01] [--server-args "..."]
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
from sglang_h20.nightly.serving import Server, write_sharegpt
from sglang_h20.observe import export

REBALANCE_LINE = re.compile(r"\[EPLBManager\] rebalance start")


def summarize(records: list[dict], after_ts: float) -> dict:
    """Mean remote share of the sampled passes after `after_ts`, overall and per rank."""
    per_rank: dict[int, list[float]] = {}
    for r in records:
        if r.get("kind", "stages") != "stages" or r.get("ts", 0.0) < after_ts or not r.get("remote_share"):
            continue
        per_rank.setdefault(int(r.get("rank", 0)), []).append(statistics.fmean(r["remote_share"]))
    flat = [x for xs in per_rank.values() for x in xs]
    return {"samples": len(flat), "remote_share_mean": statistics.fmean(flat) if flat else None,
            "per_rank": {str(k): statistics.fmean(v) for k, v in sorted(per_rank.items())}}


def run_arm(a, arm: str, data: Path) -> dict:
    out = a.out / arm
    dump = out / "observe"
    dump.mkdir(parents=True, exist_ok=True)
    n = a.gpus
    args = shlex.split(a.server_args) + ["--tp", str(n), "--ep-size", str(n), "--enable-dp-attention", "--dp", str(n),
                                         "--enable-eplb", "--eplb-algorithm", arm,
                                         "--eplb-rebalance-num-iterations", str(a.rebalance_iterations)]
    env = {"SGLANG_H20_OBSERVE": str(a.fraction), "SGLANG_H20_OBSERVE_DIR": str(dump.resolve())}
    if arm == "affinity":
        env["SGLANG_H20_EPLB"] = "affinity"
    with Server(a.model, args, out / "server.log", env=env, port=32400 + (arm == "affinity")) as srv:
        srv.bench(out / "warmup.jsonl", num_prompts=a.prompts, input_len=a.input_len, output_len=a.output_len,
                  concurrency=a.concurrency, dataset_path=str(data))
        split = time.time()
        rebalances_before = len(REBALANCE_LINE.findall((out / "server.log").read_text(errors="replace")))
        bench = srv.bench(out / "measure.jsonl", num_prompts=a.prompts, input_len=a.input_len,
                          output_len=a.output_len, concurrency=a.concurrency, dataset_path=str(data))
        time.sleep(3)  # the last samples' dump lines
    log = (out / "server.log").read_text(errors="replace")
    res = summarize(export.read_dump([dump]), split)
    return {**res, "rebalances_in_warmup": rebalances_before, "rebalances_total": len(REBALANCE_LINE.findall(log)),
            "output_throughput": bench.get("output_throughput"), "server_args": args, "env": env}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.01, help="observed share of decode passes")
    ap.add_argument("--rebalance-iterations", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--arms", nargs="+", default=["deepseek", "affinity"])
    ap.add_argument("--server-args", default="--load-format dummy")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    data = write_sharegpt(a.out / "sharegpt.json")
    arms = {}
    for arm in a.arms:
        arms[arm] = run_arm(a, arm, data)
        print(f"  {arm}: remote share {arms[arm]['remote_share_mean']} over {arms[arm]['samples']} samples, "
              f"{arms[arm]['rebalances_in_warmup']} rebalances before the measurement", flush=True)
    rec = {**provenance.record(), "benchmark": "affinity_remote_share", "model": a.model, "gpus": a.gpus,
           "fraction": a.fraction, "rebalance_iterations": a.rebalance_iterations, "arms": arms}
    up, ours = arms.get("deepseek", {}).get("remote_share_mean"), arms.get("affinity", {}).get("remote_share_mean")
    if up and ours is not None:
        rec["affinity_over_deepseek"] = ours / up
    (a.out / "affinity_remote_share.json").write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
