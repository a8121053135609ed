#!/usr/bin/env python3
"""Where does a prefill's time go with MHA vs MLA? Torch-profiler traces of the same prefills both ways.

Why: on dsv3-4l, single prefills of 512 new on 512 cached tokens took 2-3 ms longer with MHA than with MLA
(prefix_ttft_h200.json), although one attention layer is 3x faster with MHA (mha_mla_layer_h200.json). The
policy now charges a fitted once-per-prefill MHA cost (mha_mla.py); this finds what it is made of.

One server (our hook, prefill graphs off), the policy forced through SGLANG_H20_MHA_MLA_CONTROL: per arm
(mla, mha) a few warm-up prefills, then /start_profile (CPU + GPU), --requests single prefills, each timed
from the client, /stop_profile. The traces are summarised per arm: client wall time per prefill, GPU kernel
time per prefill (sum of kernel durations), the kernels and the CPU ops with the largest totals, and the
kernels whose total differs most between the arms. Traces stay in OUT/<arm>/ (gzip JSON).

--cached-fraction 0 profiles prefills without a cached prefix (upstream's MHA case) the same way.

usage: prefill_profile.py --model DIR --out DIR [--length 1024] [--cached-fraction 0.5] [--requests 5]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.models import random_words
from sglang_h20.nightly.serving import Server

from prefix_ttft import NO_PREFILL_GRAPH, timed  # the same one-server setup and client timing
from trace_summary import compare, load_trace, summarize, wait_for_traces


def profile_arm(srv: Server, ctl: Path, arm: str, out: Path, prefix: str, new: int, requests: int,
                rng: random.Random) -> dict:
    from sglang_h20.controlfile import write_control

    write_control(ctl, arm)
    for _ in range(3):  # warm this arm's kernels at this shape
        srv.generate_batch([(prefix + " " + random_words(rng, new)).strip()], max_new_tokens=1)
    out.mkdir(parents=True, exist_ok=True)
    srv.post("/start_profile", {"output_dir": str(out.resolve()), "activities": ["CPU", "GPU"], "profile_id": arm})
    wall = [timed(lambda: srv.generate_batch([(prefix + " " + random_words(rng, new)).strip()], max_new_tokens=1))
            for _ in range(requests)]
    srv.post("/stop_profile")
    files = wait_for_traces(out)  # the scheduler writes the trace after stop returns
    events = [e for p in files for e in load_trace(p)]
    return {"wall_ms": wall, "median_wall_ms": statistics.median(wall), "trace_files": [str(p) for p in files],
            **summarize(events, requests, unit="prefill")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (e.g. scripts/make_model.py's, dummy weights)")
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder: prefill_profile.json, the server log, the traces under OUT/<arm>/")
    ap.add_argument("--length", type=int, default=1024, help="input tokens")
    ap.add_argument("--cached-fraction", type=float, default=0.5, help="share of the input that is a cached prefix")
    ap.add_argument("--requests", type=int, default=5, help="profiled single prefills per arm (default: %(default)s)")
    ap.add_argument("--server-args", default="--load-format dummy",
                    help="extra flags of the server, one string (default: %(default)s)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ctl = (a.out / "policy").resolve()
    from sglang_h20.controlfile import write_control

    write_control(ctl, "mla")
    env = {"SGLANG_H20_MHA_MLA_POLICY": "se", "SGLANG_H20_MHA_MLA_CONTROL": str(ctl),
           "SGLANG_TORCH_PROFILER_DIR": str((a.out / "profiles").resolve())}
    cached = int(a.length * a.cached_fraction)
    new, arms = a.length - cached, {}
    with Server(a.model, shlex.split(a.server_args) + NO_PREFILL_GRAPH, a.out / "server.log", env=env,
                port=32300) as srv:
        rng = random.Random(3)
        prefix = random_words(rng, cached) if cached else ""
        if prefix:
            srv.generate_batch([prefix], max_new_tokens=1)  # cache the shared prefix
        for arm in ("mla", "mha"):
            arms[arm] = profile_arm(srv, ctl, arm, a.out / arm, prefix, new, a.requests, rng)
            print(f"  {arm}: {arms[arm]['median_wall_ms']:.2f} ms per prefill (client), GPU kernels "
                  f"{arms[arm]['gpu_kernel_ms_per_prefill']:.2f} ms", flush=True)
    diff = compare(arms["mla"], arms["mha"])
    for arm in arms.values():
        arm.pop("_kernel_totals")
    rec = {**provenance.record(), "benchmark": "prefill_profile", "model": a.model, "server_args": a.server_args,
           "length": a.length, "cached": cached, "requests": a.requests, "arms": arms, "kernels_mha_minus_mla": diff,
           "wall_mha_minus_mla_ms": arms["mha"]["median_wall_ms"] - arms["mla"]["median_wall_ms"],
           "gpu_mha_minus_mla_ms": arms["mha"]["gpu_kernel_ms_per_prefill"] - arms["mla"]["gpu_kernel_ms_per_prefill"]}
    (a.out / "prefill_profile.json").write_text(json.dumps(rec, indent=1))
    print(f"MHA - MLA per prefill: wall {rec['wall_mha_minus_mla_ms']:+.2f} ms, GPU kernels "
          f"{rec['gpu_mha_minus_mla_ms']:+.2f} ms; largest kernel differences:", flush=True)
    for r in diff[:8]:
        print(f"  {r['diff_ms']:+8.3f} ms  {r['name'][:100]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
