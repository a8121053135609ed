#!/usr/bin/env python3
"""Time the affinity planner at DeepSeek-V3 scale: 58 MoE layers x 256 experts on 8 nodes x 8 GPUs.

Target (issue "Expert-affinity EPLB"): under 1 s on one CPU core. Run with OMP_NUM_THREADS=1.
usage: planner_time.py [--out FILE]
"""
import argparse
import json
import os
import time
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.eplb.placement import Topology, place
from sglang_h20.eplb.stats import CoactivationStats
from sglang_h20.eplb.trace import synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the timings as JSON here (default: print only)")
    a = ap.parse_args()
    if a.out and not a.out.parent.is_dir():  # checked first: the timing takes a while
        ap.error(f"--out {a.out}: no such directory: {a.out.parent}")
    ids = next(iter(synthetic_trace(58, 256, 8, 4096, steps=1, seed=0)))
    stats = CoactivationStats.from_topk_ids(ids, 256)
    rows = []
    for slots in (4, 5):  # no redundancy; 64 redundant slots
        topo = Topology(8, 8, slots)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            p = place(stats, topo, "affinity")
            times.append(time.perf_counter() - t0)
        p.validate()
        rows.append({"nodes": 8, "gpus_per_node": 8, "slots_per_gpu": slots, "layers": 58, "experts": 256,
                     "seconds": times, "best_s": min(times)})
        print(f"8x8 GPUs, {slots} slots/GPU: {', '.join(f'{t:.3f}' for t in times)} s")
    record = {**provenance.record(), "benchmark": "eplb_planner_time", "cpu_threads": os.environ.get("OMP_NUM_THREADS"),
              "cpu": os.uname().machine, "cpu_count": os.cpu_count(), "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
