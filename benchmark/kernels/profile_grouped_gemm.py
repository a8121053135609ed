#!/usr/bin/env python3
"""Nsight Compute counters of the MoE grouped GEMMs at one point: ours (any configs) beside DeepGEMM and SGLang's
Triton fused-MoE, on the same operands.

Why: at gate_up 8 experts x 32 tokens on the uneven draw, SGLang's Triton swap_ab runs the same 32 x 128 tiles as
ours-swapAB in 74-76 us where ours takes 86-99, while on the uniform draw they tie (swapab/README.md). Timing cannot
say whether ours moves more DRAM bytes (weight tiles of a heavy expert read again instead of hit in L2) or stalls
on something else; the counters can (DRAM bytes read, L2 hit rate, stall reasons, achieved occupancy).

The child (`--child`) builds the point exactly as bench_grouped_gemm.py does (uneven_counts(groups, tokens, seed),
its weights and activations), runs every provider twice outside the profiled range (Triton JIT, DeepGEMM build),
then once each inside an NVTX range "profile", in the order given; the parent runs it under ncu (ncu_report) and
writes OUT/profile_grouped_gemm.json (summary per launch, the providers in launch order, the counts) and the report.

usage (GPU host): python3 benchmark/kernels/profile_grouped_gemm.py --out DIR [--shape gate_up --groups 8
                  --tokens 32 --dist uneven --layout contiguous]
                  [--ours swapab:128x32x3x16 swapab:64x32x4x4] [--upstream sglang-triton-swapab deepgemm]
An ours config is VARIANT:BLOCK_NxBLOCK_TxSTAGESxPROGRAMS_PER_SM[xMAXNREG][:flat|:tma] (4 warps), VARIANT:shipped, or
cuda:FORM[:mn] (the hand-written CUDA kernel in one of grouped_gemm_cuda.FORMS, e.g. cuda:128x128-ds; :mn with the
activation scales MN-major).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel-ext"):  # run from a checkout without installing
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

import ncu_report  # noqa: E402  (beside this file)

UPSTREAM = ("sglang-triton-swapab", "sglang-triton", "deepgemm")
# raw metrics on top of the sections: where the bytes come from and what the warps wait on
RAW_METRICS = [
    "dram__bytes_read.sum",
    "lts__t_sector_hit_rate.pct",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio",
    "smsp__average_warp_latency_issue_stalled_wait.ratio",
    "smsp__average_warp_latency_issue_stalled_barrier.ratio",
    "smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio",
    "smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio",
    # which memory unit is busy (session 45: "Mem Busy" 77% for the CUDA kernel against DeepGEMM's 53%)
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
]


def parse_ours(text: str) -> tuple[str, dict | None]:
    """'swapab:128x32x3x16[x160][:flat|:tma]' -> ('swapab', config) (the fifth number: config maxnreg);
    'normal:shipped' -> ('normal', None); 'cuda:128x128-ds[:mn]' -> ('cuda', {'form': '128x128-ds', 'scales':
    'row-major' (or 'mn-major' with :mn)})."""
    parts = text.split(":")
    if len(parts) in (2, 3) and parts[0] == "cuda":
        from sgl_kernel_ext.grouped_gemm_cuda import FORMS
        if parts[1] not in FORMS or parts[2:] not in ([], ["mn"]):
            raise argparse.ArgumentTypeError(f"{text!r}: want cuda:FORM[:mn]; the CUDA kernel's forms are "
                                             f"{', '.join(FORMS)}")
        return "cuda", {"form": parts[1], "scales": "mn-major" if parts[2:] else "row-major"}
    if len(parts) not in (2, 3) or parts[0] not in ("swapab", "normal"):
        raise argparse.ArgumentTypeError(f"{text!r}: want VARIANT:BNxBTxSTAGESxPPS[xMAXNREG][:flat|:tma] or "
                                         "VARIANT:shipped")
    if parts[1] == "shipped":
        return parts[0], None
    try:
        nums = [int(x) for x in parts[1].split("x")]
        if len(nums) not in (4, 5):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: tiles must be BLOCK_NxBLOCK_TxSTAGESxPROGRAMS_PER_SM[xMAXNREG]")
    walk = parts[2] if len(parts) == 3 else "plain"
    if walk not in ("plain", "flat", "tma"):
        raise argparse.ArgumentTypeError(f"{text!r}: walk must be flat or tma")
    return parts[0], {"BLOCK_N": nums[0], "BLOCK_T": nums[1], "num_warps": 4, "num_stages": nums[2],
                      "programs_per_sm": nums[3], **({"maxnreg": nums[4]} if len(nums) == 5 else {}),
                      "flat": walk != "plain", "tma": walk == "tma", "ws": False}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder (report, JSON, ncu console log)")
    ap.add_argument("--shape", choices=("gate_up", "down"), default="gate_up")
    ap.add_argument("--groups", type=int, default=8, help="experts (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=32, help="mean tokens per expert (default: %(default)s)")
    ap.add_argument("--dist", choices=("uniform", "uneven"), default="uneven",
                    help="counts: all equal, or bench_grouped_gemm's uneven draw (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="as bench_grouped_gemm --seed (default: %(default)s)")
    ap.add_argument("--layout", choices=("contiguous", "masked"), default="contiguous",
                    help="ours' and DeepGEMM's layout (SGLang's Triton is contiguous always; default: %(default)s)")
    ap.add_argument("--ours", nargs="*", type=parse_ours, default=[parse_ours("swapab:shipped")],
                    metavar="VARIANT:TILES", help="our configs to profile (default: swapab:shipped)")
    ap.add_argument("--upstream", nargs="*", choices=UPSTREAM, default=["sglang-triton-swapab", "deepgemm"],
                    help="upstream kernels to profile after ours (default: %(default)s)")
    ncu_report.add_ncu_args(ap)
    return ap.parse_args(argv)


def point_counts(args) -> list[int]:
    import bench_grouped_gemm as bench

    return bench.uneven_counts(args.groups, args.tokens, args.seed) if args.dist == "uneven" \
        else [args.tokens] * args.groups


def labels(args) -> list[str]:
    """The providers in launch order, as the JSON names them."""
    ours = [f"ours-{v}:{'shipped' if c is None else json.dumps(c, separators=(',', ':'))}" for v, c in args.ours]
    return ours + list(args.upstream)


# ------------------------------------------------------------------------------------------------ the child
def child(args) -> int:
    import torch

    import bench_grouped_gemm as bench

    counts = point_counts(args)
    n, k = bench.MOE_SHAPES[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    ops = bench.point_operands(args.groups, n, k, counts, gen)
    b, b_s, a_m, a_ms, masked_m, a_c, a_cs, _ = ops
    total = sum(counts)
    mean = max(1, -(-total // args.groups))
    calls = [bench.ours_moe_call(ops, args.layout, variant, cfg, mean)[0] for variant, cfg in args.ours]
    for name in args.upstream:
        if name == "deepgemm":
            fn = bench.deepgemm_masked(a_m, a_ms, b, b_s, masked_m, mean)[0] if args.layout == "masked" \
                else bench.deepgemm_contiguous(counts, k, b, b_s, gen)[0]
        else:
            fn = bench.sglang_triton(a_c[:total], a_cs[:total], b, b_s, counts, name.endswith("swapab"))[0]
        calls.append(fn)
    for fn in calls:  # JIT, builds, first-launch attributes: outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    for fn in calls:  # one range per provider, in launch order
        torch.cuda.nvtx.range_push("profile")
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    print(f"profiled, in order: {' '.join(labels(args))}; counts {counts}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------- the parent
def child_command(args) -> list[str]:
    ours = [f"{v}:shipped" if c is None else
            f"cuda:{c['form']}{':mn' if c['scales'] == 'mn-major' else ''}" if v == "cuda" else
            f"{v}:{c['BLOCK_N']}x{c['BLOCK_T']}x{c['num_stages']}x{c['programs_per_sm']}"
            f"{'x%d' % c['maxnreg'] if c.get('maxnreg') else ''}{':tma' if c['tma'] else ':flat' if c['flat'] else ''}"
            for v, c in args.ours]
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(args.out), "--shape", args.shape,
            "--groups", str(args.groups), "--tokens", str(args.tokens), "--dist", args.dist, "--seed", str(args.seed),
            "--layout", args.layout, "--ours", *ours, "--upstream", *args.upstream]


def parent(args) -> int:
    point = {"shape": args.shape, "groups": args.groups, "tokens_per_group": args.tokens, "distribution": args.dist,
             "seed": args.seed, "layout": args.layout, "counts": point_counts(args)}
    return ncu_report.profile_to_json(args, child_command(args), "grouped_gemm", RAW_METRICS, point, details=False,
                                      providers_in_launch_order=labels(args))


def main(argv=None) -> int:
    args = parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
