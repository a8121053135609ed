#!/usr/bin/env python3
"""Where the CUDA grouped GEMM's time goes: its ablation builds timed against the normal build, form by form.

Why: at 128-256 tokens per expert the hand-written kernel (sgl_kernel_ext/grouped_gemm_cuda.py) runs at 0.73-0.97x
DeepGEMM, and its per-instruction profile (swapab/README.md, session 45) shows its math warps stalled on "wait" and
"long scoreboard" where DeepGEMM's wait on the tensor cores. Two switches say which side sets the time:
  NO_LOAD  the loaders fill the ring once and then only arrive (no HBM / L2 traffic after the first STAGES blocks)
  NO_MMA   the math warps issue no wgmma (promotion, scale reads and hand-offs stay)
If NO_LOAD is much faster, the kernel waits on its loads (the loading schedule is the lever); if not, the math
side and its hand-offs are. Results are wrong by design (not checked). Every variant of a point runs on the same
operands (bench_grouped_gemm.point_operands, uniform counts), timed as the bench times ours-cuda (bench_us: the
median of CUDA-graph replays); the normal build runs first and last, their spread is the noise. DeepGEMM masked on
the same operands is timed once per point as the anchor (masked layout only).

usage (GPU host): python3 benchmark/kernels/grouped_gemm_cuda_ablation.py [--points gate_up:8:256 down:32:128]
                  [--forms 128x128-ds 128x192-s] [--variants NO_LOAD NO_MMA NO_LOAD+NO_MMA] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel-ext"):  # run from a checkout without installing
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

from mla_cuda_ablation import parse_variant  # noqa: E402  (beside this file; the same A+B[-C] grammar)

PREFIX = "GG_ABLATE_"
DEFAULT_POINTS = ["gate_up:8:256", "down:32:256", "gate_up:8:128"]
DEFAULT_VARIANTS = ["NO_LOAD", "NO_MMA", "NO_LOAD+NO_MMA"]


def parse_point(text: str) -> tuple[str, int, int]:
    """'gate_up:8:256' -> (shape, groups, tokens per group)."""
    try:
        shape, groups, tokens = text.split(":")
        point = (shape, int(groups), int(tokens))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want SHAPE:GROUPS:TOKENS, e.g. gate_up:8:256") from None
    if shape not in ("gate_up", "down") or point[1] <= 0 or point[2] <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: shape gate_up or down, positive counts")
    return point


def parse_args(argv=None):
    from sgl_kernel_ext import grouped_gemm_cuda as ggc

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=parse_point, nargs="+", default=[parse_point(p) for p in DEFAULT_POINTS],
                    metavar="SHAPE:GROUPS:TOKENS",
                    help=f"MoE points, uniform counts (default: {' '.join(DEFAULT_POINTS)})")
    ap.add_argument("--forms", nargs="+", choices=ggc.FORMS, default=[ggc.DEFAULT_FORM, "128x192-s"],
                    help="tile forms (default: %(default)s)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, metavar="SPEC",
                    help="switches without the GG_ABLATE_ prefix, + to combine, ALL (default: %(default)s)")
    ap.add_argument("--layout", choices=("masked", "contiguous"), default="masked")
    ap.add_argument("--rep-ms", type=int, default=50, help="timing per variant (ms of CUDA-graph replays)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    switches = [a[len(PREFIX):] for a in ggc.ABLATIONS]
    try:
        args.variant_defines = {v: parse_variant(v, switches, prefix=PREFIX) for v in args.variants}
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import bench_grouped_gemm as bench  # beside this file
    from sglang_h20 import provenance

    rows = []
    for shape, groups, tokens in args.points:
        n, k = bench.MOE_SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(0)
        ops = bench.point_operands(groups, n, k, [tokens] * groups, gen)
        anchor = None
        if args.layout == "masked":
            try:
                dg = bench.deepgemm_masked(ops.a_m, ops.a_ms, ops.b, ops.b_s, ops.masked_m, tokens)[0]
                anchor = bench.bench_us(dg, args.rep_ms)
                print(f"{shape} {groups} x {tokens}: DeepGEMM masked {anchor:.1f} us", flush=True)
            except bench.Unavailable as e:
                print(f"DeepGEMM unavailable: {e}", flush=True)
        for form in args.forms:
            def timed(defines):
                call = bench.ours_moe_call(ops, args.layout, "cuda", {"form": form, "defines": defines}, tokens)[0]
                call()
                torch.cuda.synchronize()
                return bench.bench_us(call, args.rep_ms)
            first = timed(())
            variants = {name: timed(d) for name, d in args.variant_defines.items()}
            last = timed(())
            base = (first + last) / 2
            print(f"{shape} {groups} x {tokens} {form}: default {first:.1f} / {last:.1f} us", flush=True)
            for name, us in variants.items():
                print(f"    {name:24s} {us:8.1f} us  {base / us:5.2f}x", flush=True)
                rows.append({"shape": shape, "groups": groups, "tokens": tokens, "form": form, "layout": args.layout,
                             "variant": name, "defines": list(args.variant_defines[name]), "us": us,
                             "default_us": base, "default_runs_us": [first, last], "speedup": base / us,
                             "deepgemm_masked_us": anchor})
    if args.json:
        record = {**provenance.record(), "benchmark": "grouped_gemm_cuda_ablation", "rows": rows,
                  "date_finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
