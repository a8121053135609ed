"""What a profile function set on one thread costs the Python of another thread, per interpreter (CPU only).

Session 15 throttled the EPLB placement thread with `sys.setprofile` (a hook that slept between bursts). In the
EP-2 servers every decode pass of the placement phase then ran ~1-1.5 ms slower at the median, also while that
thread only slept (benchmark/results/eplb/async_shuffle_1_ep2_h200.json). Cause measured here: CPython 3.12+
implements profiling by instrumenting the (shared) code objects, so one thread's profile function slows every
thread's calls. This bench times a fixed loop of small calls alone, then beside a thread that sets a no-op profile
function and sleeps, then alone again, in a fresh child process per interpreter and repeat.

  python benchmark/eplb/profile_hook_cost.py --pythons python3.11 python3.12 --out x.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, platform, statistics, sys, threading, time

def f(x):
    return x + 1

class A:
    def m(self, x):
        return f(x) * 2

def work():
    a, s = A(), 0
    for i in range(20000):
        s += a.m(i)
    return s

def timed(n=30):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        work()
        ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ts)

base = timed()
stop, hooked = threading.Event(), threading.Event()

def sleeper():
    sys.setprofile(lambda *_: None)
    hooked.set()
    while not stop.is_set():
        time.sleep(0.001)
    sys.setprofile(None)

th = threading.Thread(target=sleeper)
th.start()
hooked.wait()
during = timed()
stop.set()
th.join()
after = timed()
print(json.dumps({"python": platform.python_version(), "base_ms": base, "during_ms": during, "after_ms": after}))
"""


def measure(python: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([python, "-c", CHILD], capture_output=True, text=True, timeout=300, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ratios = [r["during_ms"] / r["base_ms"] for r in runs]
    return {"interpreter": python, "python": runs[0]["python"], "runs": runs,
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pythons", nargs="+", default=[sys.executable], help="interpreters to measure (default: this)")
    ap.add_argument("--repeats", type=int, default=5, help="child processes per interpreter (default %(default)s)")
    ap.add_argument("--out", type=Path, help="JSON record (default: print only)")
    a = ap.parse_args(argv)
    rows = []
    for py in a.pythons:
        row = measure(py, a.repeats)
        rows.append(row)
        print(f"python {row['python']:8s} calls beside a profiled sleeping thread: {row['ratio_median']:.2f}x "
              f"(range {row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}, {a.repeats} runs)", flush=True)
    if a.out:
        from sglang_h20.provenance import record

        rec = {**record(), "benchmark": "profile_hook_cost", "gpu": None, "rows": rows,
               "note": "CPU measurement on the development VM (2 cores); no GPU involved"}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
