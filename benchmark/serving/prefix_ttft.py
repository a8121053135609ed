#!/usr/bin/env python3
"""TTFT with prefix-cache hits: the MHA/MLA policy against upstream's default, same run, same GPU.

For each input length L, every request is a cached shared prefix of L/2 tokens plus L/2 new
tokens, so each prefill has extend = prefix = L/2 (upstream: prefix < 8192 -> MLA; ours decides
from se and the table). Requests go one at a time (TTFT = one prefill + one token) and then in
bursts of `--burst` (one batched prefill). Phases (each a fresh server, env + extra flags):
  upstream          plugin switch at 'upstream' (the plugin is a pass-through), SGLang defaults
  se-no-prefill-graph      our policy; prefill CUDA graphs off (they pin MLA for captured sizes)
  upstream-no-prefill-graph  upstream's rule without prefill graphs: isolates the policy's effect

usage: prefix_ttft.py --model DIR --out DIR [--lengths 1024 2048 4096] [--phases ...]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.models import random_words
from sglang_h20.nightly.serving import Server

NO_PREFILL_GRAPH = ["--cuda-graph-backend-prefill", "disabled"]
PHASES = {
    "upstream": ({"SGLANG_H20_MHA_MLA_POLICY": "upstream"}, []),
    "se-no-prefill-graph": ({"SGLANG_H20_MHA_MLA_POLICY": "se"}, NO_PREFILL_GRAPH),
    "upstream-no-prefill-graph": ({"SGLANG_H20_MHA_MLA_POLICY": "upstream"}, NO_PREFILL_GRAPH),
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def measure(srv: Server, length: int, requests: int, burst: int, rng: random.Random) -> dict:
    half = length // 2
    prefix = random_words(rng, half)
    srv.generate_batch([prefix], max_new_tokens=1)  # cache the shared prefix
    srv.generate_batch([prefix + " " + random_words(rng, half)], max_new_tokens=1)  # warm this shape
    single = [timed(lambda: srv.generate_batch([prefix + " " + random_words(rng, half)], max_new_tokens=1))
              for _ in range(requests)]
    bursts = [timed(lambda: srv.generate_batch([prefix + " " + random_words(rng, half) for _ in range(burst)],
                                               max_new_tokens=1)) for _ in range(max(2, requests // 4))]
    return {"ttft_ms_single": single, "median_ttft_ms_single": statistics.median(single),
            "burst": burst, "burst_ms": bursts, "median_burst_ms": statistics.median(bursts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--server-args", default="--load-format dummy")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip phases that would start after this")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0, phases = time.time(), {}
    for i, name in enumerate(args.phases):
        if phases and time.time() - t0 > args.deadline_s:
            print(f"deadline: skipping phase {name} and later", flush=True)
            break
        env, extra = PHASES[name]
        with Server(args.model, shlex.split(args.server_args) + extra, args.out / f"server-{name}.log",
                    env=env, port=32000 + i) as srv:
            rng = random.Random(5)
            phases[name] = {str(n): measure(srv, n, args.requests, args.burst, rng) for n in args.lengths}
        for n, r in phases[name].items():
            print(f"  {name} L={n}: TTFT {r['median_ttft_ms_single']:.1f} ms single, "
                  f"{r['median_burst_ms']:.1f} ms for a burst of {r['burst']}", flush=True)
    ratios = {}  # keys name both phases: only the no-prefill-graph pair isolates the policy
    for other in ("upstream", "upstream-no-prefill-graph"):
        if other in phases and "se-no-prefill-graph" in phases:
            ratios[f"se-no-prefill-graph_vs_{other}"] = {
                n: {"single": phases["se-no-prefill-graph"][n]["median_ttft_ms_single"] / phases[other][n]["median_ttft_ms_single"],
                    "burst": phases["se-no-prefill-graph"][n]["median_burst_ms"] / phases[other][n]["median_burst_ms"]}
                for n in phases[other]}
    record = {**provenance.record(), "benchmark": "prefix_ttft", "model": args.model, "server_args": args.server_args,
              "workload": {"lengths": args.lengths, "prefix_fraction": 0.5, "requests": args.requests,
                           "burst": args.burst},
              "ttft_ratio_ours_over_upstream (lower is better)": ratios, "phases": phases}
    (args.out / "prefix_ttft.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(ratios, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
