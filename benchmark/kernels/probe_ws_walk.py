#!/usr/bin/env python3
"""Does config ws (the grouped GEMM walk built for warp specialization) run on this GPU, split or not, and is it
faster?

Why a probe of its own: the first GPU run of config ws (2026-12-02, Triton 3.6, H200) never returned, the
whole pytest step silent for 565 s. Each case here runs in its own process under a timeout, so that a kernel
that never finishes costs one case, and the stage it reached tells a compile that never ends from a launch
that never completes (the host returns from the launch once the kernel is compiled and queued). Cases without
ws_split run the same map and persistent walk without the warp-specialize pass: if those finish and the split
ones do not, the fault is the pass's. (2026-12-02: the split hung in 5 of 6 cases at 3 and 4 stages, so config ws
refuses it unless SGLANG_H20_WS_SPLIT=1, which this probe's cases set.)

Per case (masked layout, uniform tokens per expert, DeepSeek-V3 shapes): the stage reached, compile seconds,
the relative error of every expert's rows against float32 on the dequantized inputs, and µs of the ws walk
next to the same tiles on the plain and flat+TMA walks (bench_grouped_gemm's timing: CUDA graph, median).

usage: probe_ws_walk.py [--json OUT] [--timeout-s 60] [--deadline-s 300] [--rep-ms 30] [--cases NAME ...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
CASES = [  # (name, variant, tiles, shape, groups, tokens per expert); fault-isolating cases first
    ("normal-128x128-nosplit", "normal", {"BLOCK_N": 128, "BLOCK_T": 128, "num_stages": 4}, "gate_up", 32, 256),
    ("normal-128x128-nosplit-w8", "normal", {"BLOCK_N": 128, "BLOCK_T": 128, "num_stages": 3, "num_warps": 8},
     "gate_up", 32, 256),
    ("normal-128x128", "normal", {"BLOCK_N": 128, "BLOCK_T": 128, "num_stages": 3, "ws_split": True},
     "gate_up", 32, 256),
    ("normal-128x64", "normal", {"BLOCK_N": 128, "BLOCK_T": 64, "num_stages": 3, "ws_split": True}, "gate_up", 32, 128),
    ("swapab-128x32-nosplit", "swapab", {"BLOCK_N": 128, "BLOCK_T": 32, "num_stages": 4}, "gate_up", 32, 32),
    ("swapab-128x32", "swapab", {"BLOCK_N": 128, "BLOCK_T": 32, "num_stages": 3, "ws_split": True}, "gate_up", 32, 32),
    ("normal-128x128-down-nosplit-w8", "normal", {"BLOCK_N": 128, "BLOCK_T": 128, "num_stages": 3, "num_warps": 8},
     "down", 32, 256),
]


def case_of(name: str, rep_ms: int) -> dict:
    """CASES' entry `name` as the record a child process runs."""
    _, variant, tiles, shape, groups, tokens = next(c for c in CASES if c[0] == name)
    return {"name": name, "variant": variant, "tiles": tiles, "shape": shape, "groups": groups, "tokens": tokens,
            "rep_ms": rep_ms}


def child(case: dict) -> None:
    """One case, stages printed as they are reached (the parent keeps the last one on a timeout)."""
    import os

    import torch

    os.environ["SGLANG_H20_WS_SPLIT"] = "1"  # config ws refuses the split without it (it hung here before)

    sys.path.insert(0, str(HERE))
    import bench_grouped_gemm as bench  # noqa: E402  (puts the repo's packages on the path)
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    def stage(name, **kw):
        print(json.dumps({"stage": name, **kw}), flush=True)

    n, k = SHAPES[case["shape"]]
    groups, m = case["groups"], case["tokens"]
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, b_s = bench.make_weights(groups, n, k, gen)
    a, a_s = bench.make_acts((groups, m, k), gen)
    mm = torch.full((groups,), m, dtype=torch.int32, device="cuda")
    base = {"num_warps": 4, "programs_per_sm": 1, **case["tiles"]}

    def run(walk: dict):
        out = torch.empty(groups, m, n, dtype=torch.bfloat16, device="cuda")
        return lambda: gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant=case["variant"],
                                                       expected_m=m, config={**base, **walk})

    stage("built")
    t0 = time.time()
    ws = run({"flat": False, "ws": True})
    out = ws()
    stage("launched", compile_s=round(time.time() - t0, 1))
    torch.cuda.synchronize()
    stage("ran", first_call_s=round(time.time() - t0, 1))
    errs = [bench.rel_err(out[g], a[g], a_s[g], b[g], b_s[g]) for g in range(groups)]
    finite = bool(torch.isfinite(out.float()).all())
    stage("checked", max_rel_err=max(errs), finite=finite)
    us = {"ws": bench.bench_us(ws, case["rep_ms"])}
    for name, walk in (("plain", {"flat": False}), ("tma", {"flat": True, "tma": True})):
        us[name] = bench.bench_us(run(walk), case["rep_ms"])
    stage("timed", us=us)


def probe(case: dict, timeout_s: float) -> dict:
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(case)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        status = f"timeout after {timeout_s:.0f} s"
    record = {**case, "status": status, "wall_s": round(time.time() - t0, 1), "stage": None}
    for line in text.splitlines():
        if line.startswith('{"stage"'):
            info = json.loads(line)
            record.update(info)
    if status != "ok":
        record["tail"] = text.splitlines()[-12:]
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="probe_ws_walk.json", help="where the record goes")
    ap.add_argument("--timeout-s", type=float, default=60, help="per case: compile, run, check and timing")
    ap.add_argument("--deadline-s", type=float, default=300, help="no case starts past this")
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--cases", nargs="+", choices=[c[0] for c in CASES], help="these, in this order (default: all)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    sys.path.insert(0, str(HERE.parents[1] / "python"))
    from sglang_h20 import provenance

    t0, results = time.time(), []
    for name in args.cases or [c[0] for c in CASES]:
        if time.time() - t0 + args.timeout_s > args.deadline_s:
            print(f"[probe] {name}: skipped (deadline)", flush=True)
            continue
        r = probe(case_of(name, args.rep_ms), args.timeout_s)
        print(f"[probe] {name}: {r['status']}, stage {r['stage']}, {r.get('us', '')} "
              f"err {r.get('max_rel_err', '-')}", flush=True)
        results.append(r)
        Path(args.json).write_text(json.dumps({"provenance": provenance.record(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
