"""What a rebalance's placement thread does to the decode loop beside it, one suspect at a time (one GPU).

In EP-2 servers the 3-4 decode passes while the placement thread ran took 10-37 ms against a 3 ms steady pass
(benchmark/results/eplb/async_attribution_1_ep2_h200.json); that thread does pure-Python work (SGLang's
`init_by_eplb`, our plan), allocates the staging pool (GBs), pins host memory and makes CUDA streams. This
bench runs a decode-loop stand-in (Python work, one CUDA-graph replay, a host sync: the shape of a scheduler
step; `--torch-ops` small CPU torch ops per step, each of which releases and re-takes the GIL as SGLang's
scheduler code does) and, in a second thread started mid-run, one of those actions; it reports each action's
slowest loop step against the same loop with no action. Exploratory: it says which action to take off the
rebalance path. Its first run (benchmark/results/exploratory/placement_interference_h200.json) had no torch ops in
the loop and so missed the GIL hand-offs that decided the server's slow passes; `python_20ms_throttled` is the fix
(`sglang_h20.eplb.throttle`: pace points in the thread's own loops). Its first form was a profile hook on the
placement thread; `profile_hook_idle_200ms` shows why it went: a thread that only sleeps with a profile function set
slows the loop's fixed Python work (`--python-calls`) for as long as the function stays set.

Without a GPU (or with --cpu) the step's GPU part is a sleep of --gpu-ms (the GIL released, as in a host sync) and
only the CPU actions run: the GIL hand-offs need no GPU.

  python benchmark/eplb/placement_interference.py --out benchmark/results/eplb/exploratory/x.json
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from sglang_h20.eplb import throttle
from sglang_h20.eplb.async_rebalance import TUNING
from sglang_h20.provenance import record


def busy_python(ms: float) -> None:
    """`ms` of this thread's CPU time in pure Python, holding the GIL (as SGLang's dispatch-map loops do); CPU time,
    so that a throttled run does the same work and takes longer."""
    end = time.thread_time() + ms / 1e3
    x = 0
    while time.thread_time() < end:
        throttle.point()
        for i in range(200):
            x += i * i


def small_torch_ops(ms: float) -> None:
    """Many small CPU tensor ops (as the EPLB algorithm's per-layer loops do), `ms` of this thread's CPU time."""
    end = time.thread_time() + ms / 1e3
    t = torch.arange(256)
    while time.thread_time() < end:
        t = (t * 3 + 1) % 257
        t.argsort()


def throttled_python(ms: float) -> None:
    """busy_python as the placement thread now runs it: short bursts, sleeps between."""
    with throttle.bursts(TUNING.placement_burst_s, TUNING.placement_pause_s):
        busy_python(ms)


def profiled_sleep(ms: float) -> None:
    """The first throttle's side effect alone: this thread sets a (no-op) profile function and only sleeps."""
    sys.setprofile(lambda *_: None)
    try:
        time.sleep(ms / 1e3)
    finally:
        sys.setprofile(None)


def _noop(x):
    return x


def call_python(n: int) -> None:
    """A fixed amount of Python: `n` small function calls (the scheduler's per-step bookkeeping)."""
    for i in range(n):
        _noop(i)


CPU_ACTIONS = ("none", "python_20ms", "python_20ms_throttled", "torch_cpu_ops_20ms", "profile_hook_idle_200ms")
ACTIONS = {
    "none": lambda a: None,
    "python_20ms": lambda a: busy_python(20),
    "python_20ms_throttled": lambda a: throttled_python(20),
    "torch_cpu_ops_20ms": lambda a: small_torch_ops(20),
    "profile_hook_idle_200ms": lambda a: profiled_sleep(200),
    "gpu_alloc": lambda a: a.keep.append(torch.empty(int(a.alloc_gb * 2**30), dtype=torch.uint8, device="cuda")),
    "gpu_alloc_side_stream": lambda a: a.keep.append(_on_side(
        lambda: torch.empty(int(a.alloc_gb * 2**30), dtype=torch.uint8, device="cuda"))),
    "pinned_alloc": lambda a: a.keep.extend(torch.empty(2**k, dtype=torch.uint8, pin_memory=True)
                                            for k in range(12, 24)),
    "pinned_h2d_side_stream": lambda a: a.keep.append(_on_side(
        lambda: torch.randint(0, 256, (61, 256), dtype=torch.int32).pin_memory().to("cuda", non_blocking=True))),
    "streams_events": lambda a: a.keep.extend([torch.cuda.Stream() for _ in range(4)]
                                              + [torch.cuda.Event() for _ in range(16)]),
}


def _on_side(fn):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out = fn()
    s.synchronize()
    return out


def step_graph(gpu_ms: float) -> torch.cuda.CUDAGraph:
    """A CUDA graph of bf16 GEMMs taking about gpu_ms (the decode pass's GPU part)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):  # warm: a cold first GEMM sized the first run's graph at ~0.2 ms instead of 2.5
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    n = max(1, round(gpu_ms / (1e3 * (time.perf_counter() - t) / 20)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            a @ b
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = a
        for _ in range(n):
            c = c @ b
    step_graph.keep = (a, b, c)
    return g


def run_action(name: str, a, g) -> dict:
    a.keep = []
    steps, spans, act = [], [], {}

    def side():
        act["t0"] = t = time.perf_counter()
        ACTIONS[name](a)
        act["t1"] = time.perf_counter()
        act["ms"] = 1e3 * (act["t1"] - t)

    th = threading.Thread(target=side, daemon=True)
    for i in range(a.steps):
        if i == a.steps // 3:
            th.start()
        t = time.perf_counter()
        busy_python(a.python_ms)
        call_python(a.python_calls)
        for _ in range(a.torch_ops):
            a.host_tensor.add_(1)
        if g is None:  # --cpu: the GPU part as a sleep (the GIL released, as in a host sync)
            time.sleep(a.gpu_ms / 1e3)
        else:
            g.replay()
            torch.cuda.current_stream().synchronize()
        steps.append(1e3 * (time.perf_counter() - t))
        spans.append((t, time.perf_counter()))
    th.join()
    del a.keep
    if g is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    after = sorted(steps[a.steps // 3:])
    # the steps that overlapped the action (an action that slows every step shows here, not in the p50 after start)
    during = sorted(ms for ms, (t0, t1) in zip(steps, spans) if t1 > act.get("t0", 0) and t0 < act.get("t1", 0))
    return {"action": name, "action_ms": round(act.get("ms", 0.0), 3), "p50_ms": round(after[len(after) // 2], 3),
            "max_ms": round(after[-1], 3), "slowest_ms": [round(x, 3) for x in after[-4:][::-1]],
            "during_n": len(during), "during_p50_ms": round(during[len(during) // 2], 3) if during else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON record (default: print only)")
    ap.add_argument("--gpu-ms", type=float, default=2.5, help="GPU time of one loop step (default %(default)s)")
    ap.add_argument("--python-ms", type=float, default=0.5, help="Python work per step (default %(default)s)")
    ap.add_argument("--python-calls", type=int, default=2000,
                    help="small Python function calls per step: fixed work, unlike --python-ms (default %(default)s)")
    ap.add_argument("--torch-ops", type=int, default=200,
                    help="small CPU torch ops per step (each releases the GIL; default %(default)s)")
    ap.add_argument("--steps", type=int, default=90, help="loop steps per action (default %(default)s)")
    ap.add_argument("--alloc-gb", type=float, default=5.25, help="staging pool size (default: dsv3-4l EP2's)")
    ap.add_argument("--switch-intervals", type=float, nargs="+", default=[5e-3, 5e-4],
                    help="sys.setswitchinterval values to run every action under")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each action (default %(default)s)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: the step's GPU part is a sleep, CPU actions only "
                    "(the default without a CUDA GPU)")
    ap.add_argument("--actions", nargs="+", choices=list(ACTIONS), help="run only these (default: all that apply)")
    a = ap.parse_args(argv)
    a.cpu = a.cpu or not torch.cuda.is_available()
    a.host_tensor = torch.zeros(64)
    g = None if a.cpu else step_graph(a.gpu_ms)
    for _ in range(0 if g is None else 20):
        g.replay()
    names = [n for n in (a.actions or ACTIONS) if not a.cpu or n in CPU_ACTIONS]
    rows = []
    for si in a.switch_intervals:
        sys.setswitchinterval(si)
        for name in names:
            for r in range(a.repeats):
                row = {"switch_interval_s": si, "repeat": r, **run_action(name, a, g)}
                rows.append(row)
                print(f"switch {si:g} s  {name:24s} action {row['action_ms']:8.2f} ms  step p50 {row['p50_ms']:6.2f}"
                      f" (during it {row['during_p50_ms']})  max {row['max_ms']:7.2f}  slowest {row['slowest_ms']}",
                      flush=True)
    sys.setswitchinterval(5e-3)
    rec = {**record(), "benchmark": "placement_interference", "args": {
        k: v for k, v in vars(a).items() if k not in ("out", "host_tensor")}, "rows": rows}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
