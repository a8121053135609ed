#!/usr/bin/env python3
"""Nsight Compute counters of one FP8 MLA decode step: where the CUDA split kernels' time goes, beside FlashMLA.

Why: the CUDA kernels run at 19-34% of their roofline and a cycle model of them was off by 2x (sgl-kernel-ext/
NOTES.md); timing variants (mla_cuda_ablation.py) says how much each part costs, the counters say what the SMs were
doing meanwhile (tensor pipe active, shared-memory wavefronts, stall reasons, achieved occupancy).

One child process (`--child`) builds DeepSeek-V3-shaped inputs (make_mla_inputs: 576-d latent+rope, page 64),
warms every kernel up (nvcc build, Triton JIT) outside the profiled range, then runs each provider once inside an
NVTX range "profile"; the parent runs that child under `ncu --nvtx --nvtx-include profile/` with --clock-control
none (METHOD.md: leave the clocks alone), imports the report and writes:
  OUT/mla_decode.ncu-rep            the report (open it in Nsight Compute)
  OUT/profile_mla_decode.json       every metric of every profiled kernel (name, section, unit, value), the
                                    headline metrics per kernel under "summary", and provenance
  a table of the headline metrics on stdout.

usage (GPU host): python3 benchmark/kernels/profile_mla_decode.py --out DIR [--batch 64 --context 4096 --heads 128]
                  [--providers ours-cuda ours-cuda-v2 flashmla-bf16] [--plan cuda|ctx|graph] [--set full]
                  [--defines MLA_VT_PRMT]   (ours built with a design option: its bank conflicts, say)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel-ext"):  # run from a checkout without installing
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

import ncu_report  # noqa: E402  (beside this file)
from bench_mla_decode import cuda_version  # noqa: E402  (beside this file)

PROVIDERS = ("ours-cuda", "ours-cuda-v2", "flashmla-bf16", "flashmla-fp8", "ours-cuda-v3")
# raw metrics asked for on top of the sections: the tensor pipe and shared memory, which the sections summarize only
RAW_METRICS = [
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "smsp__average_warp_latency_issue_stalled_barrier.ratio",
    "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio",
    "smsp__average_warp_latency_issue_stalled_wait.ratio",
    "smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio",
    "smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio",
    "smsp__average_warp_latency_issue_stalled_mio_throttle.ratio",
    "smsp__average_warp_latency_issue_stalled_membar.ratio",
    "smsp__average_warp_latency_issue_stalled_sleeping.ratio",
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder (the .ncu-rep report, profile_mla_decode.json, the ncu console log)")
    ap.add_argument("--batch", type=int, default=64, help="sequences in the decode batch (default: %(default)s)")
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=128, help="query heads (default: %(default)s)")
    ap.add_argument("--q-len", type=int, default=1, help="query tokens per sequence (default: %(default)s)")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS[:3]), choices=PROVIDERS,
                    help="kernels to profile, in this order (default: %(default)s)")
    ap.add_argument("--plan", choices=("cuda", "ctx", "graph"), default="cuda",
                    help="ours' split plan: for these lengths (cuda), for a 163840-token context as the backend's "
                         "graphs had it (ctx), or that grid with the run-time split count (graph)")
    ap.add_argument("--defines", nargs="+", default=[], metavar="NAME",
                    help="build ours with these -D macros: design options (mla_decode_cuda.DESIGN_OPTIONS) or "
                         "ablation switches (ABLATIONS)")
    ncu_report.add_ncu_args(ap)
    args = ap.parse_args(argv)
    if args.defines:
        import importlib
        cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
        known = set(cu.DESIGN_OPTIONS) | set(cu.ABLATIONS)
        bad = sorted(set(args.defines) - known)
        if bad:
            ap.error(f"--defines {' '.join(bad)}: not a design option or ablation switch ({', '.join(sorted(known))})")
    return args


# ------------------------------------------------------------------------------------------------ the child
def child(args) -> int:
    import importlib

    import torch

    mla = importlib.import_module("sgl_kernel_ext.mla_decode")
    lens = [args.context] * args.batch
    d = mla.make_mla_inputs(lens, args.heads, args.q_len, 64, device="cuda", seed=1, poison=False)
    q, kv, bt, sl, scale = d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"]
    calls = {}
    for p in args.providers:
        if p.startswith("ours-cuda"):
            cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
            version = cuda_version(p)
            ok, why = cu.available(version, tuple(args.defines))
            if not ok:
                print(f"{p}: unavailable: {why}", flush=True)
                continue
            bound = 163840 if args.plan in ("ctx", "graph") else args.context
            plan, lut = cu.planners(version)  # version 3: CTAs of 16 or 32 rows, planned as such
            if args.plan == "graph":  # as the backend captures it
                meta, table = mla.graph_metadata(plan, lut, args.batch, args.heads, args.q_len, bound, 64, "cuda")
                if meta.splits_dev is not None:
                    mla.set_splits(meta.splits_dev, table, sl, 64)
            else:
                meta = plan(sl, args.heads, args.q_len, max_seqlen=bound)
            print(f"{p}: plan {args.plan}, grid splits {meta.num_splits}, run-time "
                  f"{meta.splits_dev.item() if meta.splits_dev is not None else meta.num_splits}", flush=True)
            calls[p] = lambda cu=cu, meta=meta, version=version: cu.mla_decode_fp8_cuda(
                q, kv, bt, sl, scale, meta, version=version, defines=tuple(args.defines))
        else:
            try:
                from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata
            except Exception as e:
                print(f"{p}: unavailable: {type(e).__name__}: {e}", flush=True)
                continue
            fp8 = p.endswith("fp8")
            rows = args.q_len * args.heads
            fm_meta, fm_splits = get_mla_metadata(sl, rows, 1, **({"is_fp8_kvcache": True} if fp8 else {}))
            cache = d["latent_cache"].view(-1, 64, 1, 576)
            extra = {}
            fq = q
            if fp8:
                cache = cache.to(torch.float8_e4m3fn)
                fq = q.to(torch.float8_e4m3fn)
                extra = dict(descale_q=torch.ones(1, device="cuda"), descale_k=torch.ones(1, device="cuda"))
            calls[p] = lambda fq=fq, cache=cache, fm_meta=fm_meta, fm_splits=fm_splits, extra=extra: \
                flash_mla_with_kvcache(fq, cache, bt, sl, 512, fm_meta, fm_splits, softmax_scale=scale, causal=True,
                                       **extra)
    for fn in calls.values():  # builds, JIT, first-launch attributes: outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    for fn in calls.values():  # one range per provider, in this order (the kernel names tell them apart)
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"profiled, in order: {' '.join(calls)}", flush=True)
    return 0 if calls else 1


# ----------------------------------------------------------------------------------------------- the parent
def parent(args) -> int:
    child_cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(args.out),
                 "--batch", str(args.batch), "--context", str(args.context), "--heads", str(args.heads),
                 "--q-len", str(args.q_len), "--plan", args.plan, "--providers", *args.providers,
                 *(["--defines", *args.defines] if args.defines else [])]
    point = {"batch": args.batch, "context": args.context, "heads": args.heads, "q_len": args.q_len,
             "plan": args.plan, "providers": args.providers, "defines": args.defines}
    return ncu_report.profile_to_json(args, child_cmd, "mla_decode", RAW_METRICS, point)


def main(argv=None) -> int:
    args = parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
