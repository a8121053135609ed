#!/usr/bin/env python3
"""FP8 block-scaled grouped GEMMs for DeepSeek-V3 MoE: ours (swapab, normal) against upstream.

Providers (each timed on the same quantized inputs; one that cannot run is recorded under
"unavailable" with the reason, never silently dropped):
  ours-swapab, ours-normal     sgl_kernel_ext.grouped_gemm_fp8, masked and contiguous layouts,
                               tiles from the heuristic (or the tuned table when one ships)
  deepgemm                     deep_gemm.m_grouped_fp8_gemm_nt_contiguous (rows padded per expert to
                               DeepGEMM's M alignment, padding rows m_indices = -1, as SGLang does) and
                               the masked entry (fp8_m_grouped_gemm_nt_masked / m_grouped_fp8_gemm_nt_masked,
                               expected_m = tokens per expert)
  sglang-triton[-swapab]       SGLang 0.5.17's Triton fused-MoE GEMM,
                               sglang.kernels.ops.moe.fused_moe_triton_kernels.invoke_fused_moe_kernel,
                               top_k = 1 so that it is the same grouped GEMM (one routed copy per row), FP8
                               w8a8 with block_shape [128, 128] and pre-quantized activations; swap_ab is
                               forced off / on by replacing the module's should_enable_swap_ab (upstream
                               turns it on only on sm90 for BLOCK_SIZE_M < 64 <= BLOCK_SIZE_N); the config
                               is upstream's try_get_optimal_moe_config (swapab: BLOCK_SIZE_M cut to the
                               power of two covering the tokens per expert, >= 16). moe_align_block_size
                               runs outside the timed region.
Points: shapes gate_up (N=4096, K=7168) and down (N=7168, K=2048) × experts {8,16,32,256} × tokens per
expert {1,2,4,8,16,24,32,64,128,256}, each uniform, plus an "uneven" draw with the same total (Zipf-like
expert popularity, some experts empty). Dense small-M linears (fp8_gemm_nt vs deep_gemm.fp8_gemm_nt and
SGLang's w8a8_block_fp8_matmul_triton, the GEMM of its --fp8-gemm-backend triton linear, with its shipped
per-GPU configs): N×K = 24576×1536, 7168×16384, 2112×7168, 4096×7168, 7168×2048 (DENSE_SHAPES) at M {1..256};
with --tune ours also sweeps DENSE_TUNE (tiles × k-slices) per point.

Per point: µs (median of triton.testing.do_bench, L2 flushed before each run, the call captured in a
CUDA graph where possible so that launch overhead is excluded), weight bytes read per µs (TB/s; weights
of non-empty experts only, with scales), useful TFLOP/s (2·K·N·Σm), the relative error of one expert's
output against float32 on dequantized inputs, and an H20 time labelled "modelled":
    max(issued FLOPs / 296e12, bytes / 4.0e12)
where issued FLOPs count the provider's tile padding (Σ_g ceil(m_g/T_tok)·T_tok · ceil(N/T_w)·T_w · 2K)
and bytes = active weights + scales + activations + output. Peak read bandwidth of this GPU is measured
first with a read-only Triton sum-reduction over a 4 GiB tensor.

Output: --json OUT holds one object: numeric "latency_us" and "tflops" at the representative point
(gate_up, 32 experts, 8 tokens each, ours-swapab, masked layout), "provenance"
(sglang_h20.provenance.record()), "peak_read_tbs", "points", "unavailable", and "table_entries" in the
format of python/sglang_h20/tables/grouped_gemm_<gpu>.json (see gemm_table.load_table). A roofline
PNG goes next to it (--png to move it). --quick runs a small subset (about a minute on an H200).

--tune keeps a config as a point's best only if its output is within TUNE_ERR_BOUND (1e-2) of float32 on the
first non-empty expert (a rejected one is listed in the point's trials with its error).

Table for the swapAB integration (sglang_h20.moe.swapab, gemm_table.load_table): --tune also
writes the table of this run (gemm_table.table_from_result) to --table-out, by default this
user's cache, ~/.cache/sglang_h20/grouped_gemm_<gpu>.json, which the loader reads before the shipped
one; there the entries of the table in force (same GPU) that this run did not measure are kept, so a
re-tune of some shapes leaves the others as they were. --table-from RESULTS.json [MORE.json] only
converts earlier runs' results (no GPU needed).

usage: bench_grouped_gemm.py [--quick] [--json OUT] [--png OUT] [--shapes gate_up down dense]
                             [--groups 8 32] [--tokens 1 8 32] [--tune] [--table-out FILE]
       bench_grouped_gemm.py --table-from RESULTS.json [MORE.json] --table-out FILE
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel-ext"):  # run from a checkout without installing
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

from issue_targets import check as target_check  # noqa: E402  (this folder: sibling of the script)
from sglang_h20 import provenance  # noqa: E402
from sglang_h20.cliargs import read_json  # noqa: E402
from sglang_h20.gputime import graph_median_us  # noqa: E402

MOE_SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
# the FP8 linears of a DeepSeek-V3 MoE layer at decode, one GPU with all 128 heads (DP attention / dsv3-ep16-slice):
# fused q_a + kv_a (1536 + 576 rows), q_b, o_proj, and the shared expert's gate_up / down
DENSE_SHAPES = {"q_b": (24576, 1536), "o_proj": (7168, 16384), "qkv_a": (2112, 7168),
                "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}
GROUPS = [8, 16, 32, 256]
TOKENS = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256]
PROVIDERS = ("ours-swapab", "ours-normal", "ours-split", "deepgemm", "sglang-triton", "sglang-triton-swapab")
# opt-in: the hand-written CUDA normal variant (sgl_kernel_ext.grouped_gemm_cuda), timed beside the rest, not in the
# table yet (gemm_table.table_entries skips it)
OPT_IN_PROVIDERS = ("ours-cuda",)
SPLIT_AT = [16, 32, 64]  # ours-split: the counts tried as the swapAB / normal boundary
DENSE_M = [1, 2, 4, 8, 16, 32, 64, 128, 256]
QUICK = {"groups": [8, 32], "tokens": [1, 8, 32, 128], "dense_m": [1, 32], "uneven_tokens": [8]}
H20_FP8_FLOPS = 296e12  # dense FP8 tensor throughput
H20_HBM_BPS = 4.0e12
H200_FP8_FLOPS = 1979e12  # dense FP8, for the roofline plot's compute roof
REPRESENTATIVE = {"shape": "gate_up", "groups": 32, "tokens_per_group": 8, "provider": "ours-swapab",
                  "layout": "masked", "distribution": "uniform"}
# tile walks: plain (per-group loop), flat (one flattened, pipelined loop: _fp8_grouped_gemm_flat_kernel), tma (flat
# with the FP8 operands through tensor descriptors), ws (a token-tile map, then a persistent walk warp-specialized
# over tensor descriptors: _fp8_grouped_gemm_ws_kernel)
# Each walk names all three switches: a trial overrides the shipped config key by key, so a walk that left "tma"
# out would inherit a shipped True and time the TMA walk under the name "flat".
WALKS = {"plain": {"flat": False, "tma": False, "ws": False}, "flat": {"flat": True, "tma": False, "ws": False},
         "tma": {"flat": True, "tma": True, "ws": False}, "ws": {"flat": False, "tma": False, "ws": True}}


def walk_of(cfg: dict) -> str:
    """The WALKS name of a tile config (a switch it lacks is off)."""
    keys = {k: bool(cfg.get(k)) for k in ("flat", "tma", "ws")}
    return next(name for name, w in WALKS.items() if w == keys)


MANY_PROGRAMS = 16  # programs per SM in the grid's "more than fit" configs (block-scheduled tails)
TUNE_GRID = {
    "swapab": [{"BLOCK_N": bn, "BLOCK_T": bt, "num_stages": st, "programs_per_sm": p, "num_warps": 4, **WALKS[w]}
               for bn in (64, 128) for bt in (16, 32, 64) for st in (3, 4, 5) for p in (1, 2) for w in WALKS]
    # 256 weight rows per tile on two warpgroups: each token tile's activations are read from L2 once per 256 output
    # rows, not per 128 (at 64 tokens that re-read is half the weight bytes); ptxas: t64 246 / t32 176 registers,
    # no spill, 124-165 KB at 3-4 stages, one program per SM (compile_report, session 35)
    + [{"BLOCK_N": 256, "BLOCK_T": bt, "num_stages": st, "programs_per_sm": 1, "num_warps": 8, **WALKS[w]}
       for bt in (32, 64) for st in (3, 4) for w in WALKS]
    # more programs per SM where they fit at 4 stages (ptxas, plain walk: 64 x 16 72 registers / 40 KB and 64 x 32
    # 108 / 48 KB hold four; 128 x 16 116 / 72 KB and 64 x 64 160 / 64 KB three; the TMA walk takes more registers,
    # so fewer are resident there; session 36)
    + [{"BLOCK_N": bn, "BLOCK_T": bt, "num_stages": 4, "programs_per_sm": p, "num_warps": 4, **WALKS[w]}
       for bn, bt, p in ((64, 16, 4), (64, 32, 4), (128, 16, 3), (64, 64, 3)) for w in WALKS]
    # more programs than fit (16 per SM): past the resident ones the hardware's block scheduler hands out the
    # tiles as programs finish, instead of each program's fixed stride, for uneven draws where one heavy expert
    # adds tiles; at 3 stages three 128 x 32 programs fit per SM, so a 384-tile draw is in flight at once (SGLang's
    # Triton swap_ab, one 3-stage program per tile, leads ours there: session 42; untimed when added)
    + [{"BLOCK_N": bn, "BLOCK_T": bt, "num_stages": st, "programs_per_sm": MANY_PROGRAMS, "num_warps": 4, **WALKS[w]}
       for bn, bt in ((64, 32), (128, 32), (128, 64)) for st in (3, 4) for w in WALKS]
    # registers capped (ptxas maxnreg) so that more programs are resident: Nsight Compute at gate_up 8 x 32 uneven
    # showed ours' 128 x 32 tile at 176 registers, two programs per SM, where SGLang's Triton swap_ab (128 registers)
    # holds all of the draw's 384 tiles at once with the same DRAM bytes (swapab/profile_grouped_gemm_*_h200.json).
    # ptxas (compile_report): 160 holds three 128 x 32 programs without spilling, 128 four (60 bytes spilled at
    # 128 x 32, none at 64 x 32)
    + [{"BLOCK_N": bn, "BLOCK_T": 32, "num_stages": st, "maxnreg": r, "programs_per_sm": MANY_PROGRAMS,
        "num_warps": 4, **WALKS[w]}
       for bn in (64, 128) for st in (3, 4) for r in (128, 160) for w in WALKS],
    # two programs per SM only where two fit: 64 x 128 tiles at 4 warps (ptxas: 243 registers x 128 threads, 74-98 KB
    # of shared memory at 3-4 stages); 8 warps take 236 x 256 registers, an SM's whole file (compile_report, session
    # 35); there also MANY_PROGRAMS, as for swapAB
    "normal": [{"BLOCK_N": bn, "BLOCK_T": bt, "num_stages": st, "programs_per_sm": p, "num_warps": nw, **WALKS[w]}
               for bn in (128, 256) for bt in (64, 128) for st in (3, 4) for nw in (4, 8) for w in WALKS
               for p in ((1, 2, MANY_PROGRAMS) if (bn, bt, nw) == (128, 64, 4) else (1,))]
    # the register cap that made swapAB's 128 x 32 tile resident three per SM (session 43), for the normal variant's
    # 128 x 64 tile: 254 registers uncapped, two per SM, so gate_up 8 x 64's uneven draw (384 tiles) runs a second
    # round; at 3 stages (72 KB) three fit by shared memory, and 160 / 168 registers let three fit by registers
    # (ptxas, built as launched: 176 / 128 bytes spilled; untimed when added)
    + [{"BLOCK_N": 128, "BLOCK_T": 64, "num_stages": 3, "maxnreg": r, "programs_per_sm": MANY_PROGRAMS,
        "num_warps": 4, **WALKS[w]} for r in (160, 168) for w in WALKS],
    # (64 x 64 tiles three per SM fit too, but took 1.12-1.43x the time of 64 x 128 two per SM at 8 and 32 experts
    # x 128 tokens: benchmark/results/swapab/grouped_gemm_normal_64x64_three_per_sm_*, session 36)
}


def tune_grid(variant: str, walks, where: dict | None = None) -> list[dict]:
    """TUNE_GRID[variant] restricted to the named walks (--tune-walks) and to the values `where` allows per key
    (--tune-where; a key the grid lacks is an error)."""
    grid = [c for c in TUNE_GRID[variant] if walk_of(c) in walks]
    for key, allowed in (where or {}).items():
        if not any(key in c for c in TUNE_GRID[variant]):
            raise ValueError(f"--tune-where {key}: not a tile-config key (have {sorted(TUNE_GRID[variant][0])})")
        grid = [c for c in grid if c.get(key) in allowed]  # a config without the key has it unset (None)
    return grid


def sweeps(args, variant: str) -> bool:
    """Whether --tune sweeps `variant`'s grid (--tune-variants); an unswept variant runs its shipped config."""
    return bool(args.tune) and variant in args.tune_variants


def parse_where(text: str) -> tuple[str, set]:
    """'num_stages=4,5' -> ('num_stages', {4, 5}) (integer values)."""
    key, sep, vals = text.partition("=")
    try:
        allowed = {int(v) for v in vals.split(",") if v}
    except ValueError:
        allowed = set()
    if not sep or not key or not allowed:
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=INT[,INT...], e.g. BLOCK_N=128 or num_stages=4,5")
    return key, allowed


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small subset: groups 8,32; tokens 1,8,32,128")
    ap.add_argument("--json", type=Path, help="write the results object here")
    ap.add_argument("--png", type=Path, help="roofline plot (default: next to --json)")
    ap.add_argument("--shapes", nargs="+", default=["gate_up", "down", "dense"],
                    choices=[*MOE_SHAPES, "dense"],
                    help="gate_up / down: the MoE GEMMs; dense: the small-M dense linears (default: all)")
    ap.add_argument("--dense-shapes", nargs="+", choices=sorted(DENSE_SHAPES), default=list(DENSE_SHAPES),
                    help="which dense linears (default: all)")
    ap.add_argument("--dense-m", nargs="+", type=int, help=f"dense rows M (default {DENSE_M})")
    ap.add_argument("--precompile-workers", type=int, default=0, metavar="N",
                    help="compile the dense sweep's kernels in N processes before timing (0: as they come)")
    ap.add_argument("--groups", nargs="+", type=int, help=f"experts per GPU (default {GROUPS})")
    ap.add_argument("--tokens", nargs="+", type=int, help=f"tokens per expert (default {TOKENS})")
    from sgl_kernel_ext.grouped_gemm_cuda import FORMS  # torch only: importable without a GPU
    ap.add_argument("--cuda-forms", nargs="+", choices=FORMS, default=list(FORMS), metavar="FORM",
                    help=f"ours-cuda: the tile forms to time (default: all of {', '.join(FORMS)})")
    ap.add_argument("--cuda-scales", nargs="+", choices=["row-major", "mn-major"], default=["row-major"],
                    help="ours-cuda's activation scale layouts to time (mn-major: made outside the timed call, as "
                         "DeepGEMM's are; default: %(default)s)")
    ap.add_argument("--cuda-min-tokens", type=int, default=1, metavar="TOKENS",
                    help="ours-cuda only at points of at least this many tokens per expert (its forms are the normal "
                         "variant's, for large m; default: %(default)s, every point)")
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS + OPT_IN_PROVIDERS, default=list(PROVIDERS),
                    metavar="PROVIDER", help=f"what to time (default: all of {', '.join(PROVIDERS)}; opt-in: "
                    f"{', '.join(OPT_IN_PROVIDERS)}, the hand-written CUDA normal variant)")
    ap.add_argument("--split-at", nargs="+", type=int, default=SPLIT_AT, metavar="TOKENS",
                    help="ours-split (variant split: swapAB on experts with at most this many tokens, the normal "
                         "variant on the rest, two launches): the boundaries timed per point, fastest kept "
                         "(default: %(default)s)")
    ap.add_argument("--split-streams", nargs="+", type=int, choices=[1, 2], default=[1, 2], metavar="N",
                    help="ours-split's launches on one stream, or on two so one fills the SMs the other's tail "
                         "leaves (default: both timed, the faster kept)")
    ap.add_argument("--layouts", nargs="+", default=["masked", "contiguous"], choices=["masked", "contiguous"],
                    help="grouped-GEMM input layouts (default: both)")
    ap.add_argument("--no-uneven", action="store_true", help="skip the uneven-distribution points")
    ap.add_argument("--tune", action="store_true",
                    help="also sweep each variant's tile grid (TUNE_GRID) and keep the best config per point")
    ap.add_argument("--tune-walks", nargs="+", choices=sorted(WALKS), default=[w for w in WALKS if w != "ws"],
                    help="the tile walks --tune sweeps (default: all but ws, 12-19%% slower than tma where it was "
                         "meant to pay, 32 experts x 256 tokens, and two launches: swapab/probe_ws_walk_w8_h200.json)")
    ap.add_argument("--tune-variants", nargs="+", choices=["swapab", "normal"], default=["swapab", "normal"],
                    help="the variants --tune sweeps; the others run their shipped config (default: both)")
    ap.add_argument("--tune-where", nargs="+", type=parse_where, default=[], metavar="KEY=V[,V...]",
                    help="restrict --tune's grid, e.g. BLOCK_N=128 num_stages=4,5 programs_per_sm=2")
    ap.add_argument("--size-matched-read", action="store_true",
                    help="also time the read-only stream over each MoE point's weight bytes (the ceiling a kernel "
                         "reading that much can reach, launch and ramp included): per point size_matched_read_tbs")
    ap.add_argument("--table-out", type=Path,
                    help="write this run's integration table here (default with --tune: ~/.cache/sglang_h20/"
                         "grouped_gemm_<gpu>.json, this run's entries over the table in force, which the plugin "
                         "then reads)")
    ap.add_argument("--table-from", type=Path, nargs="+",
                    help="build the table from these results JSONs (e.g. a MoE run and a dense run) and exit")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per point (ms)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs and the uneven draw (default: %(default)s)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new (shape, experts, tokens) point after this many seconds; the JSON then holds "
                         "what was measured and says \"partial\": true")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Timing and the streaming-read peak
# ---------------------------------------------------------------------------------------------
def bench_us(fn, rep_ms):
    """Median µs; the call is replayed from a CUDA graph when it can be captured."""
    return graph_median_us(fn, rep_ms)[0]


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, n, NUM_PROGRAMS, BLOCK: tl.constexpr):
    """Read-only stream: each program sums a grid-strided share of x."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, NUM_PROGRAMS * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(acc))


def measure_peak_read(rep_ms, nbytes: int = 4 << 30) -> dict:
    """The read-only stream over nbytes (default 4 GiB: the steady-state peak), best of 2/4/8 programs per SM."""
    n = max(1, nbytes // 4)
    x = torch.rand(n, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = None
    for per_sm in (2, 4, 8):
        progs = sms * per_sm
        out = torch.empty(progs, device="cuda")
        us = bench_us(lambda: _read_sum_kernel[(progs,)](x, out, n, progs, BLOCK=4096, num_warps=8), rep_ms)
        tbs = x.numel() * 4 / us / 1e6
        if best is None or tbs > best["tbs"]:
            best = {"tbs": tbs, "us": us, "programs": progs}
    want = x.sum(dtype=torch.float64).item()
    check = abs(out.double().sum().item() - want) / want
    x = None  # free the 4 GiB (rebinding, not del: the lambda above names it)
    torch.cuda.empty_cache()
    return {"peak_read_tbs": best["tbs"], "bytes": n * 4, "us": best["us"], "programs": best["programs"],
            "method": f"Triton grid-stride fp32 sum-reduction over {n * 4 / 2**30:.3g} GiB (read-only), best of 2/4/8 "
                      "programs per SM",
            "sum_rel_err": check}


def annotate_size_matched(points, peak: dict, rep_ms) -> None:
    """Time the read-only stream once per distinct MoE weight size, and give every point of that size the rate
    (size_matched_read_tbs) and its share of it (frac_of_size_matched); peak["size_matched_tbs"]: bytes -> TB/s."""
    sizes = sorted({p["weight_bytes"] for p in points if p.get("kind") == "moe"})
    rates = {}
    for nbytes in sizes:
        rates[nbytes] = measure_peak_read(rep_ms, nbytes)["peak_read_tbs"]
        print(f"read-only stream over {nbytes / 1e6:.0f} MB: {rates[nbytes]:.2f} TB/s", flush=True)
    peak["size_matched_tbs"] = {str(b): r for b, r in rates.items()}
    for p in points:
        if p.get("weight_bytes") in rates and p.get("weight_tbs") is not None:
            p["size_matched_read_tbs"] = rates[p["weight_bytes"]]
            p["frac_of_size_matched"] = p["weight_tbs"] / rates[p["weight_bytes"]]


# ---------------------------------------------------------------------------------------------
# Inputs and models
# ---------------------------------------------------------------------------------------------
def random_fp8(shape, gen, device="cuda"):
    """Random finite e4m3 bit patterns (|x| <= 240, no NaN codes), made without an fp32 copy and in place: the peak
    is two bytes per element, not three (session 65's H100 ran out of memory making 256 experts x 256 uneven tokens'
    23 GiB of masked activations with the shift and the or out of place)."""
    bits = torch.randint(0, 0x78, shape, dtype=torch.uint8, device=device, generator=gen)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=device, generator=gen)
    bits |= sign.bitwise_left_shift_(7)
    return bits.view(torch.float8_e4m3fn)


def make_weights(groups, n, k, gen):
    b = random_fp8((groups, n, k), gen)
    b_s = torch.rand(groups, math.ceil(n / 128), k // 128, device="cuda", generator=gen) * 1e-3 + 1e-4
    return b, b_s


def make_acts(shape, gen):
    return random_fp8(shape, gen), torch.rand(*shape[:-1], shape[-1] // 128, device="cuda", generator=gen) + 0.5


class MoeOperands(NamedTuple):
    b: torch.Tensor  # [groups, n, k] FP8 weights and their 128 x 128 block scales
    b_s: torch.Tensor
    a_m: torch.Tensor  # masked layout: [groups, max count, k] activations, per-token-group scales, the counts
    a_ms: torch.Tensor
    masked_m: torch.Tensor
    a_c: torch.Tensor  # contiguous layout (no padding): [total, k], scales, per-group row offsets
    a_cs: torch.Tensor
    indptr: torch.Tensor


def point_operands(groups, n, k, counts, gen) -> MoeOperands:
    """One MoE point's operands in both layouts, drawn from `gen` in this order (the bench and
    profile_grouped_gemm.py build the same point from the same seed)."""
    b, b_s = make_weights(groups, n, k, gen)
    a_m, a_ms = make_acts((groups, max(max(counts), 1), k), gen)
    masked_m = torch.tensor(counts, dtype=torch.int32, device="cuda")
    a_c, a_cs = make_acts((max(sum(counts), 1), k), gen)
    indptr = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(groups)], dtype=torch.int32, device="cuda")
    return MoeOperands(b, b_s, a_m, a_ms, masked_m, a_c, a_cs, indptr)


def ours_moe_call(ops: MoeOperands, layout: str, variant: str, cfg: dict | None, expected_m: int):
    """(call, its output buffer) of one of our grouped GEMMs on a point's operands (the bench and
    profile_grouped_gemm.py time the same calls): variant swapab / normal / split (cfg: tile-config overrides) or
    cuda (the hand-written kernel; cfg: {"form": one of grouped_gemm_cuda.FORMS, "scales": "mn-major" for the
    activation scales made MN-major outside the timed call, as DeepGEMM gets them; "defines": ablation switches,
    grouped_gemm_cuda.ABLATIONS})."""
    masked = layout == "masked"
    a, a_s = (ops.a_m, ops.a_ms) if masked else (ops.a_c, ops.a_cs)
    out = torch.empty(*a.shape[:-1], ops.b.shape[1], dtype=torch.bfloat16, device=a.device)
    if variant == "cuda":
        from sgl_kernel_ext import grouped_gemm_cuda as ggc
        index = {"masked_m": ops.masked_m} if masked else {"m_indptr": ops.indptr}
        if cfg.get("scales") == "mn-major":
            a_s = ggc.mn_major(a_s)
        return (lambda: ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, ops.b, ops.b_s, out=out, form=cfg["form"],
                                                       defines=tuple(cfg.get("defines", ())), **index)), out
    from sgl_kernel_ext import grouped_gemm_fp8 as gg
    if masked:
        return (lambda: gg.m_grouped_fp8_gemm_nt_masked(a, a_s, ops.b, ops.b_s, ops.masked_m, out=out,
                                                        variant=variant, expected_m=expected_m, config=cfg)), out
    return (lambda: gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, ops.b, ops.b_s, ops.indptr, out=out,
                                                        variant=variant, config=cfg)), out


def uneven_counts(groups, mean, seed):
    """Same total as uniform, Zipf-like popularity over a random expert order (some experts empty). Drawn from
    (seed, groups, mean) alone, so every run draws the same counts at a point whatever else it sweeps (until
    session 42 one generator ran through the sweep: runs over different lists drew different counts there)."""
    rng = random.Random(f"{seed}:{groups}:{mean}")
    w = [1.0 / (i + 1) ** 1.1 for i in range(groups)]
    rng.shuffle(w)
    counts = [0] * groups
    for g in rng.choices(range(groups), weights=w, k=groups * mean):
        counts[g] += 1
    return counts


def issued_flops(counts, n, k, tok_tile, w_tile):
    return sum(2 * k * math.ceil(m / tok_tile) * tok_tile * math.ceil(n / w_tile) * w_tile for m in counts if m)


def traffic_bytes(counts, n, k):
    active = sum(1 for m in counts if m)
    tokens = sum(counts)
    weights = active * (n * k + math.ceil(n / 128) * (k // 128) * 4)
    return weights, weights + tokens * (k + k // 128 * 4) + tokens * n * 2


def metrics(us, counts, n, k, tiles):
    wbytes, tbytes = traffic_bytes(counts, n, k)
    flops = 2 * k * n * sum(counts)
    issued = issued_flops(counts, n, k, *tiles)
    return {"us": us, "weight_tbs": wbytes / us / 1e6, "tflops": flops / us / 1e6,
            "weight_bytes": wbytes, "total_bytes": tbytes, "useful_flops": flops, "issued_flops": issued,
            "tiles_tok_w": list(tiles),
            "h20_modelled_us": 1e6 * max(issued / H20_FP8_FLOPS, tbytes / H20_HBM_BPS)}


def split_tiles(counts, n, k, groups, mean, t, layout):
    """ours-split's (tiles, extra metrics): the swapAB tiles as its tiles_tok_w, and the tensor-core work issued
    by both launches (each group under the launch its count falls in, `gg.split_plan`) with the H20-modelled time."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    plan = gg.split_plan(mean, n, k, groups, layout, {"split_at": t})
    tiles = {v: (c["BLOCK_T"], c["BLOCK_N"]) for v, c, _ in plan}
    issued = sum(issued_flops([m if lo < m <= hi else 0 for m in counts], n, k, *tiles[v])
                 for v, _, (lo, hi) in plan)
    _, tbytes = traffic_bytes(counts, n, k)
    return tiles["swapab"], {"issued_flops": issued, "tiles_split": {v: list(x) for v, x in tiles.items()},
                             "h20_modelled_us": 1e6 * max(issued / H20_FP8_FLOPS, tbytes / H20_HBM_BPS)}


def rel_err(out_rows, a, a_s, b, b_s):
    """One expert's output rows against float32 on dequantized inputs (only where the output is known)."""
    return rel_err_to(out_rows, reference(a, a_s, b, b_s))


def reference(a, a_s, b, b_s):
    """float32 product of the dequantized inputs."""
    from sgl_kernel_ext.quant import dequant_per_block, dequant_per_token_group

    return dequant_per_token_group(a, a_s) @ dequant_per_block(b, b_s).T


def rel_err_to(out_rows, ref) -> float:
    return ((out_rows.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# --tune keeps a config only if its output is this close to float32 (the issue's bound): a faster but wrong config
# (a walk or tile shape with a bug) must never reach a table
TUNE_ERR_BOUND = 1e-2


def rejects(trials: list, err: float | None) -> bool:
    """True (and the trial just added says why) when a candidate's error is over TUNE_ERR_BOUND."""
    if err is None or err <= TUNE_ERR_BOUND:
        return False
    trials[-1]["rejected_rel_err"] = err
    print(f"  config {trials[-1]['config']}: rel err {err:.1e} > {TUNE_ERR_BOUND:g}, not kept", file=sys.stderr)
    return True


class Candidates:
    """One provider's candidates at a point (tile configs, split points, CUDA tile forms): each timed and checked,
    every trial kept ({config, us, tiles, rel_err}: the table may ship any of them), and the fastest right one."""

    def __init__(self, what: str, check, rep_ms: int):
        self.what, self.check, self.rep_ms = what, check, rep_ms
        self.trials: list = []
        self.best = None  # (us, what the caller records for it, rel err)

    def time(self, config, call, tiles=None, record_as=None) -> None:
        """`call()` -> (fn, its output buffer): fn timed, the output checked. A failed call leaves no trial (stderr
        says why); a wrong one is a trial marked rejected (rejects). record_as: what `best` names (default: config)."""
        try:
            fn, out = call()
            us = bench_us(fn, self.rep_ms)
        except Exception as e:
            print(f"  {self.what} {config}: {type(e).__name__}: {e}", file=sys.stderr)
            return
        err = self.check(out)
        self.trials.append({"config": config, "us": round(us, 3), **({} if tiles is None else {"tiles": tiles}),
                            "rel_err": err})
        if not rejects(self.trials, err) and (self.best is None or us < self.best[0]):
            self.best = (us, config if record_as is None else record_as, err)


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------
class Unavailable(Exception):
    pass


def _deep_gemm():
    try:
        import deep_gemm
    except Exception as e:  # not installed, or its CUDA libraries do not load
        raise Unavailable(f"import deep_gemm failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return deep_gemm


def _dg_scales(dg, s):
    for path in ("utils.layout.get_mn_major_tma_aligned_tensor", "get_mn_major_tma_aligned_tensor",
                 "get_col_major_tma_aligned_tensor"):
        obj = dg
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj(s)
        except AttributeError:
            continue
    return s  # new DeepGEMM transforms fp32 scales itself


def deepgemm_masked(a, a_s, b, b_s, masked_m, expected_m):
    dg = _deep_gemm()
    fn = getattr(dg, "fp8_m_grouped_gemm_nt_masked", None) or getattr(dg, "m_grouped_fp8_gemm_nt_masked", None)
    if fn is None:
        raise Unavailable("deep_gemm has no fp8_m_grouped_gemm_nt_masked / m_grouped_fp8_gemm_nt_masked")
    out = torch.empty(a.shape[0], a.shape[1], b.shape[1], dtype=torch.bfloat16, device="cuda")
    lhs, rhs = (a, _dg_scales(dg, a_s)), (b, b_s)
    return (lambda: fn(lhs, rhs, out, masked_m, expected_m)), out


def deepgemm_contiguous(counts, k, b, b_s, gen):
    """DeepGEMM's layout: each expert's rows padded to its M alignment, padding rows m_indices = -1."""
    dg = _deep_gemm()
    fn = getattr(dg, "m_grouped_fp8_gemm_nt_contiguous", None)
    if fn is None:
        raise Unavailable("deep_gemm has no m_grouped_fp8_gemm_nt_contiguous")
    align_fn = (getattr(dg, "get_mk_alignment_for_contiguous_layout", None)
                or getattr(dg, "get_m_alignment_for_contiguous_layout", None))
    align = align_fn() if align_fn else 128
    idx, starts = [], []
    for g, m in enumerate(counts):
        starts.append(len(idx))
        padded = math.ceil(m / align) * align
        idx += [g] * m + [-1] * (padded - m)
    rows = len(idx)
    if rows == 0:
        raise Unavailable("no rows")
    a, a_s = make_acts((rows, k), gen)
    m_indices = torch.tensor(idx, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, b.shape[1], dtype=torch.bfloat16, device="cuda")
    lhs, rhs = (a, _dg_scales(dg, a_s)), (b, b_s)
    return (lambda: fn(lhs, rhs, out, m_indices)), out, a, a_s, starts, align


def deepgemm_dense(a, a_s, b, b_s):
    dg = _deep_gemm()
    fn = getattr(dg, "fp8_gemm_nt", None) or getattr(dg, "gemm_fp8_fp8_bf16_nt", None)
    if fn is None:
        raise Unavailable("deep_gemm has no fp8_gemm_nt")
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device="cuda")
    lhs, rhs = (a, _dg_scales(dg, a_s)), (b, b_s)
    return (lambda: fn(lhs, rhs, out)), out


def sglang_triton_dense(a, a_s, b, b_s):
    """SGLang's Triton block-FP8 GEMM of its --fp8-gemm-backend triton linear (w8a8_block_fp8_matmul_triton, its
    per-GPU config files): (call, result getter, the config it picked, as far as the module exposes it)."""
    try:
        from sglang.kernels.ops.quantization import fp8_kernel as fk
    except Exception as e:
        raise Unavailable(f"sglang fp8_kernel import failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    m, n = a.shape[0], b.shape[0]
    got = {}

    def call():
        got["out"] = fk.w8a8_block_fp8_matmul_triton(a, b, a_s, b_s, [128, 128], output_dtype=torch.bfloat16)

    cfg = {"shipped_config": False}  # no config file for (N, K, this GPU): upstream's default tiles
    try:
        table = fk.get_w8a8_block_fp8_configs(n, a.shape[1], 128, 128) or {}
        if table:
            cfg = {**table[min(table, key=lambda x: abs(int(x) - m))], "shipped_config": True}
    except Exception:
        pass
    return call, (lambda: got["out"]), cfg


def sglang_triton(a, a_s, b, b_s, counts, swap_ab: bool):
    """SGLang's Triton fused-MoE GEMM on the contiguous rows (top_k = 1: row r goes to its expert)."""
    try:
        from sglang.kernels.ops.moe import fused_moe_triton_kernels as fmk
        from sglang.srt.layers.moe.moe_runner.triton_utils import moe_align_block_size, try_get_optimal_moe_config
    except Exception as e:
        raise Unavailable(f"sglang fused-MoE import failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    groups, n, k = b.shape
    tokens = a.shape[0]
    try:
        cfg = dict(try_get_optimal_moe_config((groups, n, k), (groups, k, n // 2), 1, "fp8_w8a8", tokens,
                                              block_shape=[128, 128]))
    except Exception:
        cfg = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32,
               "num_warps": 4, "num_stages": 3}
    if swap_ab:
        per_expert = max(1, math.ceil(tokens / max(1, sum(1 for m in counts if m))))
        cfg["BLOCK_SIZE_M"] = max(16, min(cfg["BLOCK_SIZE_M"], 1 << (per_expert - 1).bit_length()))
    topk_ids = torch.repeat_interleave(torch.arange(groups, device="cuda", dtype=torch.int32),
                                       torch.tensor(counts, device="cuda")).view(-1, 1)
    topk_w = torch.ones(tokens, 1, device="cuda", dtype=torch.float32)
    sorted_ids, expert_ids, ntp = moe_align_block_size(topk_ids, cfg["BLOCK_SIZE_M"], groups)
    out = torch.empty(tokens, 1, n, dtype=torch.bfloat16, device="cuda")
    original = fmk.should_enable_swap_ab

    def call():
        fmk.should_enable_swap_ab = lambda bm, bn: swap_ab
        try:
            fmk.invoke_fused_moe_kernel(a, b, None, out, a_s, b_s, None, topk_w, topk_ids, sorted_ids, expert_ids,
                                        ntp, False, 1, cfg, tl.bfloat16, True, False, False, False, False,
                                        block_shape=[128, 128])
        finally:
            fmk.should_enable_swap_ab = original

    return call, out.view(tokens, n), cfg


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------
def unless_out_of_memory(label: str, measure, unavailable: dict) -> list:
    """measure() -> its points, or none where the point's operands or outputs do not fit on this GPU: one line
    and an `unavailable` entry instead of a crash that loses the rest of the sweep (on an 80 GB H100 the masked
    layout of 256 experts x 256 uneven tokens pads every expert to the hottest one's 13,366 tokens: 23 GiB of
    activations and 26 GiB of output per provider)."""
    try:
        return measure()  # a point that ran has freed its own operands (moe_points' last lines)
    except torch.OutOfMemoryError as e:
        why = f"out of GPU memory: {str(e).splitlines()[0][:160]}"
    unavailable[label] = why
    print(f"{label}: skipped, {why}", file=sys.stderr, flush=True)
    torch.cuda.empty_cache()  # here, not in the except clause: its traceback holds the point's tensors until it ends
    return []


def moe_points(args, shape, groups, tokens, dist, counts, gen, unavailable, tune, time_up=lambda: False):
    """Every provider at one MoE point; with `tune`, ours over its config grid until `time_up()` (each config is
    a Triton compile of seconds: a deadline must cut the grid, not wait for the point to end)."""
    from sgl_kernel_ext import gemm_table
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    n, k = MOE_SHAPES[shape]
    ops = point_operands(groups, n, k, counts, gen)
    b, b_s, a_m, a_ms, masked_m, a_c, a_cs, indptr = ops
    base = {"kind": "moe", "shape": shape, "n": n, "k": k, "groups": groups, "tokens_per_group": tokens,
            "distribution": dist, "counts": counts}
    first = next((g for g, m in enumerate(counts) if m), None)
    total = sum(counts)
    mean = max(1, math.ceil(total / groups))
    results = []

    def record(provider, layout, us, tiles, err=None, config=None, extra=None):
        p = {**base, "provider": provider, "layout": layout, "config": config, "rel_err": err,
             **metrics(us, counts, n, k, tiles), **(extra or {})}
        results.append(p)
        print(f"{shape:8s} G={groups:3d} t={tokens:3d} {dist:7s} {layout:10s} {provider:22s} "
              f"{us:9.1f} us  {p['weight_tbs']:5.2f} TB/s  {p['tflops']:7.1f} TFLOP/s  "
              f"H20 modelled {p['h20_modelled_us']:8.1f} us  err {err if err is None else f'{err:.1e}'}",
              flush=True)

    def first_group_check(layout):
        """out -> the first non-empty group's relative error against float32 (None without one); the reference is
        computed on the first call."""
        ref = None

        def check(out):
            nonlocal ref
            if first is None:
                return None
            if layout == "masked":
                rows = out[first, :counts[first]]
                inputs = (a_m[first, :counts[first]], a_ms[first, :counts[first]])
            else:
                lo, hi = indptr[first].item(), indptr[first + 1].item()
                rows, inputs = out[lo:hi], (a_c[lo:hi], a_cs[lo:hi])
            if ref is None:
                ref = reference(*inputs, b[first], b_s[first])
            return rel_err_to(rows, ref)
        return check

    checks = {layout: first_group_check(layout) for layout in ("masked", "contiguous")}  # ours and upstream's

    for variant in ("swapab", "normal"):
        if f"ours-{variant}" not in args.providers:
            continue
        for layout in args.layouts:
            grid = tune_grid(variant, args.tune_walks, dict(args.tune_where)) if tune and sweeps(args, variant) else []
            configs = [None] + grid
            shipped = gg.choose_config(variant, mean, n, k, groups, layout=layout)  # what config None runs
            tried = 0
            cands = Candidates(f"ours-{variant} {layout} config", checks[layout], args.rep_ms)
            for cfg in configs:
                if cands.best is not None and time_up():
                    print(f"  ours-{variant} {layout}: deadline, tuned {tried} of {len(configs)} configs",
                          file=sys.stderr)
                    break
                tried += 1
                used = {**shipped, **(cfg or {})}
                # every trial names the tiles it ran: the table may ship any of them (the config best on both
                # draws together, gemm_table.table_entries), not only this draw's fastest
                cands.time(cfg, lambda: ours_moe_call(ops, layout, variant, cfg, mean),
                           {kk: used[kk] for kk in gemm_table.TILE_KEYS if kk in used}, record_as=used)
            if cands.best is None:
                unavailable[f"ours-{variant}-{layout}"] = "every config failed or was wrong (see stderr)"
                continue
            us, used, err = cands.best
            tiles = (used["BLOCK_T"], used["BLOCK_N"])
            record(f"ours-{variant}", layout, us, tiles, err, used,
                   {"configs_tried": tried, "configs_in_grid": len(configs), "trials": cands.trials} if tune else None)

    if "ours-split" in args.providers and total:
        for layout in args.layouts:
            cands = Candidates(f"ours-split {layout}", checks[layout], args.rep_ms)
            for cfg in ({"split_at": t, "split_streams": st} for t in args.split_at for st in args.split_streams):
                cands.time(cfg, lambda: ours_moe_call(ops, layout, "split", cfg, mean), tiles=cfg)
            if cands.best is None:
                unavailable[f"ours-split-{layout}"] = "every split_at failed or was wrong (see stderr)"
                continue
            us, cfg, err = cands.best
            tiles, issued = split_tiles(counts, n, k, groups, mean, cfg["split_at"], layout)
            record("ours-split", layout, us, tiles, err, cfg, {"trials": cands.trials, **issued})

    if "ours-cuda" in args.providers and tokens >= args.cuda_min_tokens:
        from sgl_kernel_ext import grouped_gemm_cuda as ggc
        ok, why = ggc.available()
        if not ok:
            unavailable["ours-cuda"] = why
        for layout in args.layouts if ok else ():
            cands = Candidates(f"ours-cuda {layout}", checks[layout], args.rep_ms)
            for form in args.cuda_forms:
                for scales in args.cuda_scales:
                    cfg = {"form": form, "scales": scales}
                    cands.time(cfg, lambda: ours_moe_call(ops, layout, "cuda", cfg, mean))
            if cands.best is None:
                unavailable[f"ours-cuda-{layout}"] = "every form failed or was wrong (see stderr)"
                continue
            us, cfg, err = cands.best
            record("ours-cuda", layout, us, ggc.tile_shape(cfg["form"]), err, cfg, {"trials": cands.trials})

    if "deepgemm" in args.providers:
        for layout in args.layouts:
            try:
                if layout == "masked":
                    fn, out = deepgemm_masked(a_m, a_ms, b, b_s, masked_m, mean)
                    us = bench_us(fn, args.rep_ms)
                    err = checks["masked"](out)
                    bm = 64 if mean <= 64 else 128  # DeepGEMM's block M for this expected_m (assumed)
                    record("deepgemm", layout, us, (bm, 128), err, {"assumed_block_m": bm})
                else:
                    fn, out, a_d, a_ds, starts, align = deepgemm_contiguous(counts, k, b, b_s, gen)
                    us = bench_us(fn, args.rep_ms)
                    err = None
                    if first is not None:
                        lo = starts[first]
                        hi = lo + counts[first]
                        err = rel_err(out[lo:hi], a_d[lo:hi], a_ds[lo:hi], b[first], b_s[first])
                    record("deepgemm", layout, us, (align, 128), err, {"m_alignment": align},
                           {"padded_rows": a_d.shape[0]})
            except Unavailable as e:
                unavailable[f"deepgemm-{layout}"] = str(e)
            except Exception as e:
                unavailable[f"deepgemm-{layout}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    for swap in (False, True):
        name = "sglang-triton-swapab" if swap else "sglang-triton"
        if name not in args.providers or "contiguous" not in args.layouts or total == 0:
            continue
        try:
            fn, out, cfg = sglang_triton(a_c[:total], a_cs[:total], b, b_s, counts, swap)
            us = bench_us(fn, args.rep_ms)
            err = checks["contiguous"](out)
            record(name, "contiguous", us, (cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]), err, cfg)
        except Unavailable as e:
            unavailable[name] = str(e)
        except Exception as e:
            unavailable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc()
    ops = b = b_s = a_m = a_ms = a_c = a_cs = None  # free the point's operands (the lambdas above name them)
    torch.cuda.empty_cache()
    return results


# session 33's run swept BLOCK_N x programs per SM (stages 4) for swapab and the default normal tiles; DeepGEMM stayed
# ahead from M 64 (grouped_gemm_dense_h200.json), so deeper pipelines and the normal variant's token tile are in too
# (+ the best config's k-slices summed by the last slice instead of a reduce kernel, config serial_reduce)
DENSE_TUNE = {"swapab": [{"BLOCK_N": bn, "programs_per_sm": pp, "num_stages": st}
                         for bn in (64, 128) for pp in (1, 2) for st in (4, 6)],
              "normal": [{"BLOCK_N": 128, "BLOCK_T": bt, "programs_per_sm": 1} for bt in (64, 128)]
              + [{"BLOCK_N": 128, "BLOCK_T": 64, "programs_per_sm": 2}]}  # two fit per SM (TUNE_GRID's note)


def dense_split_ks(kb: int, auto: int) -> list[int]:
    """k-slice counts --tune tries for K/128 = kb blocks: the automatic one, half and twice it (divisors of kb
    that leave >= 4 blocks per slice)."""
    return sorted({d for d in (auto // 2, auto, auto * 2) if d >= 1 and kb % d == 0 and kb // d >= 4} | {auto})


def dense_configs(variant: str, m: int, n: int, k: int, tune: bool, sms: int) -> list[dict | None]:
    """What one dense point times for `variant`: the default (None), and with `tune` DENSE_TUNE × dense_split_ks."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    configs = [None]
    if tune:
        for over in DENSE_TUNE[variant]:
            _, _, sk = gg.plan_fp8_gemm_nt(m, n, k, variant, config=over, num_sms=sms)
            configs += [{**over, "split_k": d} for d in dense_split_ks(k // 128, sk)]
    return configs


def with_serial_reduce_retry(configs: list, best_config):
    """`configs`, then once: the best one's tiles with serial_reduce, when that best (best_config(), read only after
    `configs` ran) splits K without it. Once, not until it wins: a losing retry must not be retried."""
    from sgl_kernel_ext import gemm_table

    yield from configs
    best = best_config()
    if best is not None and best["split_k"] > 1 and not best.get("serial_reduce"):
        yield {**{key: best[key] for key in gemm_table.TILE_KEYS if key in best}, "serial_reduce": True}


def _compile_dense(jobs: list[tuple]) -> list[str]:
    """Worker process: run each (shape, m, variant, config) once on junk operands of the real shapes, so that
    Triton's on-disk cache holds every kernel the timing process will ask for. Returns the failures."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    failed = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (tests)
    for shape, m, variant, cfg in jobs:
        try:
            n, k = DENSE_SHAPES[shape]
            a = torch.zeros(m, k, device=dev).to(torch.float8_e4m3fn)
            b = torch.zeros(n, k, device=dev).to(torch.float8_e4m3fn)
            gg.fp8_gemm_nt(a, torch.ones(m, k // 128, device=dev), b, torch.ones(-(-n // 128), k // 128, device=dev),
                           variant=variant, config=cfg)
            if dev == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # the timing process meets it again and reports it there
            failed.append(f"{shape} m={m} {variant} {cfg}: {type(e).__name__}: {str(e)[:120]}")
    return failed


def precompile_dense(args, points: list[tuple[str, int]], workers: int) -> None:
    """Compile every dense kernel of the sweep in `workers` processes first (the Triton cache is shared on disk):
    a --tune sweep compiles ~100+ kernels of ~1-2 s each, which one process would do one after the other."""
    import concurrent.futures as cf
    import multiprocessing as mp

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = [(shape, m, variant, cfg) for m, shape in points for variant in ("swapab", "normal")
            if f"ours-{variant}" in args.providers
            for cfg in dense_configs(variant, m, *DENSE_SHAPES[shape], sweeps(args, variant), sms)]
    t0 = time.monotonic()
    chunks = [jobs[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        failed = [f for part in ex.map(_compile_dense, chunks) for f in part]
    print(f"precompiled {len(jobs)} dense kernels in {workers} processes: {time.monotonic() - t0:.0f} s"
          f"{f', {len(failed)} failed (first: {failed[0]})' if failed else ''}", flush=True)


def dense_points(args, shape, m, gen, unavailable, time_up=lambda: False):
    """Every provider at one dense linear; with --tune, ours over DENSE_TUNE × dense_split_ks."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    n, k = DENSE_SHAPES[shape]
    b, b_s = make_weights(1, n, k, gen)
    b, b_s = b[0], b_s[0]
    a, a_s = make_acts((m, k), gen)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    base = {"kind": "dense", "shape": shape, "n": n, "k": k, "groups": 1, "tokens_per_group": m,
            "distribution": "dense", "counts": [m]}

    ref = reference(a, a_s, b, b_s)  # every provider's output is checked against it

    def record(provider, us, out, config, tiles, extra=None):
        p = {**base, "provider": provider, "layout": "dense", "config": config,
             "rel_err": rel_err_to(out, ref), **metrics(us, [m], n, k, tiles), **(extra or {})}
        results.append(p)
        print(f"dense {shape:14s} m={m:4d} {provider:14s} {us:8.1f} us {p['weight_tbs']:.2f} TB/s "
              f"err {p['rel_err']:.1e}", flush=True)

    for variant in ("swapab", "normal"):
        if f"ours-{variant}" not in args.providers:
            continue
        configs = dense_configs(variant, m, n, k, sweeps(args, variant), sms)
        best, trials = None, []
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        order = with_serial_reduce_retry(configs, lambda: best and best[1]) if args.tune else configs
        for over in order:
            if best is not None and time_up():
                print(f"  ours-{variant} dense: deadline, tuned {len(trials)} of {len(configs)} configs",
                      file=sys.stderr)
                break
            try:
                us = bench_us(lambda: gg.fp8_gemm_nt(a, a_s, b, b_s, out=out, variant=variant, config=over),
                              args.rep_ms)
            except Exception as e:
                print(f"  ours-{variant} dense config {over}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            _, cfg, sk = gg.plan_fp8_gemm_nt(m, n, k, variant, config=over, num_sms=sms)
            trials.append({"config": over, "us": round(us, 3)})
            if (best is None or us < best[0]) and not rejects(trials, rel_err_to(out, ref)):
                best = (us, {**cfg, "split_k": sk}, out.clone())
        if best is None:
            unavailable[f"ours-{variant}-dense"] = "every config failed or was wrong (see stderr)"
            continue
        us, cfg, res = best
        record(f"ours-{variant}", us, res, cfg, (cfg["BLOCK_T"], cfg["BLOCK_N"]),
               {"configs_tried": len(trials), "trials": trials} if args.tune else None)
    if "deepgemm" in args.providers:
        try:
            fn, out = deepgemm_dense(a, a_s, b, b_s)
            us = bench_us(fn, args.rep_ms)
            bm = 64 if m <= 64 else 128
            record("deepgemm", us, out, {"assumed_block_m": bm}, (bm, 128))
        except Exception as e:
            unavailable["deepgemm-dense"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "sglang-triton" in args.providers:
        try:
            fn, out, cfg = sglang_triton_dense(a, a_s, b, b_s)
            us = bench_us(fn, args.rep_ms)
            record("sglang-triton", us, out(), cfg, (cfg.get("BLOCK_SIZE_M", 64), cfg.get("BLOCK_SIZE_N", 128)))
        except Exception as e:
            unavailable["sglang-triton-dense"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return results


def table_entries(points):
    """Per (shape, groups, tokens, layout): the winner among ours-swapab / ours-normal / upstream."""
    from sgl_kernel_ext import gemm_table

    return gemm_table.table_entries(points)


def entry_key(e: dict) -> tuple:
    """One table entry's key: the GEMM shape, expert count, tokens per expert and layout."""
    return (e["n"], e["k"], e["groups"], e["m"], e.get("layout"))


def keep_unmeasured(table: dict, base: dict | None) -> int:
    """Append to `table` the entries of `base` (the table in force for the same GPU) at keys this run did not
    measure, so a re-tune of a few shapes does not leave every other shape without an entry (upstream) on the
    user's GPU. Returns how many were kept; a base from another GPU (or none) keeps none."""
    if not base or base.get("gpu") != table.get("gpu"):
        return 0
    measured = {entry_key(e) for e in table["entries"]}
    kept = [e for e in base["entries"] if entry_key(e) not in measured]
    table["entries"] += kept
    table["source"]["kept_from"] = {"path": base.get("path"), "date": base.get("date"), "entries": len(kept)}
    return len(kept)


def write_table(result: dict, out: Path, results_file: str | None, base: dict | None = None) -> None:
    """The table of this run to `out`; with `base`, over it (`keep_unmeasured`)."""
    from sgl_kernel_ext import gemm_table

    table = gemm_table.table_from_result(result, results_file, " ".join(["python", *sys.argv]))
    kept = keep_unmeasured(table, base)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    gemm_table.forget_tables()
    wins = sum(e["best"] != "upstream" for e in table["entries"])
    also = f" ({kept} kept from {base.get('path')}, this run did not measure them)" if kept else ""
    print(f"wrote {out}: {len(table['entries'])} entries{also}, ours best at {wins} ({table['gpu']})")


def roofline_png(path, points, peak_tbs):
    try:
        from sglang_h20.plotting import pyplot, save_png

        plt = pyplot()
    except Exception as e:
        return f"matplotlib unavailable: {e}"
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [p["useful_flops"] / p["total_bytes"] for p in points if p["us"] > 0]
    lo, hi = max(min(xs, default=0.5) / 2, 0.1), max(max(xs, default=1000) * 2, 10)
    grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.plot(grid, [min(H200_FP8_FLOPS, peak_tbs * 1e12 * x) / 1e12 for x in grid], "k-",
            label=f"this GPU: measured read {peak_tbs:.2f} TB/s, FP8 {H200_FP8_FLOPS / 1e12:.0f} TFLOP/s (spec)")
    ax.plot(grid, [min(H20_FP8_FLOPS, H20_HBM_BPS * x) / 1e12 for x in grid], "k--",
            label="H20 (modelled roof): 4.0 TB/s, 296 TFLOP/s")
    markers = {"ours-swapab": "o", "ours-normal": "s", "ours-split": "P", "deepgemm": "^", "sglang-triton": "v",
               "sglang-triton-swapab": "D", "ours-cuda": "*"}
    for prov, mk in markers.items():
        sel = [p for p in points if p["provider"] == prov]
        if sel:
            ax.scatter([p["useful_flops"] / p["total_bytes"] for p in sel], [p["tflops"] for p in sel],
                       marker=mk, s=18, alpha=0.7, label=prov)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (useful FLOP / byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title("FP8 block-scaled grouped GEMMs, DeepSeek-V3 shapes")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    return None


def issue_targets(points, peak_tbs: float) -> dict:
    """The swapAB issue's kernel targets, on the best of our providers (the fastest measured) against the best
    upstream one at each MoE point (same run, layout and draw; ratios are time_upstream / time_ours, above 1: ours
    faster): >= 1.0x everywhere, >= 90% of the run's measured read peak at <= 64 tokens per expert, >= 1.25x at
    128-256 tokens, and the H20-MODELLED time against DeepGEMM masked >= 1.5x at <= 32 tokens. A point where every
    one of ours that was asked failed (no finite time) while an upstream kernel ran counts as missed (ratio 0).

    Two readings are recorded beside the main ones, so that no rule choice hides a miss: >= 1.0x across layouts
    (ours' best in any layout against the best upstream kernel in any layout, per shape, experts, tokens and draw:
    SGLang's Triton runs the contiguous layout only, DeepGEMM both), and the H20 ratio with ours = the kernel
    fastest on THIS GPU (the main H20 ratio takes the least-padded of ours, the one the model says an H20 re-tune
    would pick; `h20_ours_provider` names it)."""
    by_point: dict = {}
    for p in points:
        if p.get("kind") == "moe":
            key = (p["shape"], p["groups"], p["tokens_per_group"], p["distribution"], p["layout"])
            by_point.setdefault(key, []).append(p)
    timed = lambda p: isinstance(p.get("us"), (int, float)) and math.isfinite(p["us"]) and p["us"] > 0
    per_point = []
    for (shape, groups, m, dist, layout), pts in sorted(by_point.items()):
        asked = [p for p in pts if p["provider"].startswith("ours")]
        ours = [p for p in asked if timed(p)]
        upstream = [p for p in pts if not p["provider"].startswith("ours") and timed(p)]
        if not upstream or not asked:
            continue  # nothing to compare against, or ours not run here
        row = {"shape": shape, "groups": groups, "tokens_per_group": m, "distribution": dist, "layout": layout}
        rival = min(upstream, key=lambda p: p["us"])
        if not ours:  # ours failed where upstream ran: a miss, not a gap in the count
            per_point.append({**row, "best_ours": None, "ours_us": None, "best_upstream": rival["provider"],
                              "upstream_us": rival["us"], "vs_best_upstream": 0.0, "read_frac": 0.0,
                              "h20_modelled_vs_deepgemm_masked": None, "h20_ours_provider": None,
                              "h20_modelled_fastest_ours_vs_deepgemm_masked": None})
            continue
        best = min(ours, key=lambda p: p["us"])
        dg = next((p for p in upstream if p["provider"] == "deepgemm"), None)
        modelled = layout == "masked" and dg and all(p.get("h20_modelled_us") for p in ours + [dg])
        least = min(ours, key=lambda p: p["h20_modelled_us"]) if modelled else None
        per_point.append({**row, "best_ours": best["provider"], "ours_us": best["us"],
                          "best_upstream": rival["provider"], "upstream_us": rival["us"],
                          "vs_best_upstream": rival["us"] / best["us"],
                          "read_frac": best["weight_tbs"] / peak_tbs if peak_tbs else None,
                          "h20_modelled_vs_deepgemm_masked": (dg["h20_modelled_us"] / least["h20_modelled_us"]
                                                              if modelled else None),
                          "h20_ours_provider": least["provider"] if modelled else None,
                          "h20_modelled_fastest_ours_vs_deepgemm_masked": (
                              dg["h20_modelled_us"] / best["h20_modelled_us"] if modelled else None)})

    ours_us: dict = {}  # (shape, groups, m, draw) -> times of ours and of upstream, both layouts together
    upstream_us: dict = {}
    for p in per_point:
        key = (p["shape"], p["groups"], p["tokens_per_group"], p["distribution"])
        upstream_us.setdefault(key, []).append(p["upstream_us"])
        ours_us.setdefault(key, [])
        if p["ours_us"] is not None:
            ours_us[key].append(p["ours_us"])
    across = [min(upstream_us[k]) / min(ours_us[k]) if ours_us[k] else 0.0 for k in upstream_us]

    def check(name, pts, key, bound):
        return target_check(name, [p[key] for p in pts], bound)

    small = [p for p in per_point if p["tokens_per_group"] <= 32]
    checks = {"vs_best_upstream": check(">= 1.0x the best upstream kernel", per_point, "vs_best_upstream", 1.0),
              "read_frac_m64": check(">= 90% of the measured read peak (<= 64 tokens per expert)",
                                     [p for p in per_point if p["tokens_per_group"] <= 64], "read_frac", 0.9),
              "vs_best_upstream_m128_256": check(">= 1.25x the best upstream (128-256 tokens per expert)",
                                                 [p for p in per_point if 128 <= p["tokens_per_group"] <= 256],
                                                 "vs_best_upstream", 1.25),
              "h20_modelled_m32": check(">= 1.5x DeepGEMM masked on an H20, MODELLED (<= 32 tokens per expert; "
                                        "ours: the least padded)", small, "h20_modelled_vs_deepgemm_masked", 1.5),
              "vs_best_upstream_any_layout": target_check(
                  ">= 1.0x the best upstream kernel, either layout against either layout", across, 1.0),
              "h20_modelled_m32_fastest_ours": check(
                  ">= 1.5x DeepGEMM masked on an H20, MODELLED (<= 32 tokens; ours: the fastest on this GPU)", small,
                  "h20_modelled_fastest_ours_vs_deepgemm_masked", 1.5)}
    return {"per_point": per_point, "checks": checks, "summary": [c["line"] for c in checks.values()]}


def ours_not_timed(points: list[dict]) -> list[str]:
    """The default variants of ours that no MoE point of a run timed: its "best of ours" is the best of the others
    (session 49's grid left out ours-split, the fastest of ours at 30 of session 44's 52 points >= 1.0x). A run
    without MoE points (dense only) has nothing to say."""
    timed = {p["provider"] for p in points if p.get("kind") == "moe"}
    return [v for v in PROVIDERS if v.startswith("ours") and v not in timed] if timed else []


def result_record(args, points, peak, unavailable, skipped, partial: bool) -> dict:
    """The JSON record of the points measured so far (`partial`: the sweep did not finish, or is still running)."""
    rep = next((p for p in points if all(p.get(kk) == v for kk, v in REPRESENTATIVE.items())), None)
    rep = rep or next((p for p in points if p["provider"] == "ours-swapab"), None) or (points[0] if points else None)
    return {
        "benchmark": "grouped_gemm_fp8",
        "latency_us": rep["us"] if rep else float("nan"),
        "tflops": rep["tflops"] if rep else float("nan"),
        "representative": rep,
        "provenance": provenance.record(),
        "peak_read": peak,
        "peak_read_tbs": peak["peak_read_tbs"],
        "h20_model": {"label": "modelled", "fp8_flops": H20_FP8_FLOPS, "hbm_bytes_per_s": H20_HBM_BPS,
                      "formula": "max(issued FLOPs incl. tile padding / 296e12, bytes / 4.0e12)"},
        "unavailable": unavailable,
        "points": points,
        "table_entries": table_entries(points),
        "targets": issue_targets(points, peak["peak_read_tbs"]),
        "ours_not_timed": ours_not_timed(points),
        "quick": args.quick,
        "partial": partial,
        "not_started": skipped,
    }


def read_results(path: Path) -> dict:
    """An earlier run's results JSON (--table-from); SystemExit with one line when it is not one."""
    result = read_json(path, "bench_grouped_gemm: --table-from", SystemExit)
    if not isinstance(result, dict) or not isinstance(result.get("points"), list) or not result["points"]:
        raise SystemExit(f"bench_grouped_gemm: --table-from {path}: no measured points "
                         f"(not a bench_grouped_gemm.py --json results file)")
    return result


def moe_label(shape: str, groups: int, tokens: int, dist: str) -> str:
    """How a run names a MoE point (its "not_started" list; its progress)."""
    return f"{shape} g{groups} m{tokens} {dist}"


def point_key(p: dict) -> tuple:
    """What one run measures side by side: every provider, layout and draw of one GEMM shape and token count."""
    return (p.get("kind"), p.get("n"), p.get("k"), p.get("groups"), p.get("tokens_per_group"))


def measured_what(points: list[dict]) -> set:
    """The provider/layout/draw combinations a run timed at one key."""
    return {f"{p.get('provider')}/{p.get('layout')}/{p.get('distribution')}" for p in points}


def table_merge_gaps(earlier: dict, later: dict) -> dict:
    """At each key `later` replaces, what `earlier` measured there and `later` did not (a variant or the uneven
    draw the table's rule weighs): the replacement loses it, so --table-from says so instead of losing it quietly."""
    gaps = {}
    for key, pts in later.items():
        lost = measured_what(earlier.get(key, [])) - measured_what(pts)
        if lost:
            gaps[key] = sorted(lost)
    return gaps


def merged_results(paths: list[Path]) -> dict:
    """One results object from several runs: the first's record, and each file's provenance under "merged_from"
    (the table's source says where each entry was measured). A later file's points replace every earlier point
    at a key it measured (`point_key`), so a table entry never weighs ours from one run against upstream from
    another: a retune of some shapes supersedes those shapes only. What a replacing run did not measure at such a
    key is listed under its "replaced_without" and printed (`table_merge_gaps`)."""
    return merge_results([read_results(p) for p in paths], paths)


def merge_results(results: list[dict], paths: list) -> dict:
    """merged_results of records already read (`paths`: where each came from, for the sources and the messages)."""
    if len(results) == 1:
        return results[0]
    points: dict = {}
    sources = []
    for path, r in zip(paths, results):
        fresh: dict = {}
        for pt in r["points"]:
            fresh.setdefault(point_key(pt), []).append(pt)
        gaps = table_merge_gaps(points, fresh)
        for key, lost in gaps.items():
            print(f"bench_grouped_gemm: {path} replaces {key} without {', '.join(lost)}", file=sys.stderr)
        points.update(fresh)
        sources.append({"file": str(path), "provenance": r.get("provenance"),
                        "replaced_without": {" ".join(map(str, key)): lost for key, lost in gaps.items()}})
    return {**results[0], "points": [pt for group in points.values() for pt in group], "merged_from": sources}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table_from:
        write_table(merged_results(args.table_from), args.table_out or Path("grouped_gemm_table.json"),
                    " ".join(map(str, args.table_from)))
        return 0

    if not torch.cuda.is_available():
        print("bench_grouped_gemm needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    groups = args.groups or (QUICK["groups"] if args.quick else GROUPS)
    tokens = args.tokens or (QUICK["tokens"] if args.quick else TOKENS)
    uneven_tokens = [] if args.no_uneven else (QUICK["uneven_tokens"] if args.quick else tokens)
    dense_m = args.dense_m or (QUICK["dense_m"] if args.quick else DENSE_M)
    if REPRESENTATIVE["groups"] not in groups or REPRESENTATIVE["tokens_per_group"] not in tokens:
        print("note: the representative point (gate_up, 32 experts x 8 tokens) is outside this sweep; "
              "latency_us / tflops will come from the first ours-swapab point", file=sys.stderr)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    unavailable: dict[str, str] = {}
    peak = measure_peak_read(args.rep_ms)
    print(f"peak read bandwidth: {peak['peak_read_tbs']:.2f} TB/s ({peak['method']})", flush=True)

    t0 = time.monotonic()
    skipped = []

    def time_up() -> bool:
        return args.deadline_s is not None and time.monotonic() - t0 >= args.deadline_s

    def in_time(label: str) -> bool:
        if not time_up():
            return True
        skipped.append(label)
        return False

    def checkpoint() -> None:  # after every point: a run killed from outside still leaves its JSON
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result_record(args, points, peak, unavailable, skipped, partial=True),
                                            indent=1))

    points = []

    def moe_point(shape, g, t, dist, counts) -> None:
        label = moe_label(shape, g, t, dist)
        if in_time(label):
            points.extend(unless_out_of_memory(label, lambda: moe_points(
                args, shape, g, t, dist, counts, gen, unavailable, args.tune, time_up), unavailable))
            checkpoint()

    moe_shapes = [s for s in args.shapes if s in MOE_SHAPES]
    for g in groups:  # shapes innermost: a deadline cuts the largest expert counts of every shape alike
        for t in tokens:
            for shape in moe_shapes:
                moe_point(shape, g, t, "uniform", [t] * g)
        for t in uneven_tokens:
            counts = uneven_counts(g, t, args.seed)
            for shape in moe_shapes:
                moe_point(shape, g, t, "uneven", counts)
    if args.size_matched_read:
        annotate_size_matched(points, peak, args.rep_ms)
        checkpoint()
    if "dense" in args.shapes:
        if args.precompile_workers > 0:
            precompile_dense(args, [(m, shape) for m in dense_m for shape in args.dense_shapes],
                             args.precompile_workers)
        for m in dense_m:  # shapes innermost: a deadline cuts the largest M of every shape alike
            for shape in args.dense_shapes:
                if in_time(f"{shape} m{m}"):
                    points += dense_points(args, shape, m, gen, unavailable, time_up)
                    checkpoint()
    if skipped:
        print(f"deadline {args.deadline_s:.0f}s: {len(skipped)} points not started (first: {skipped[0]})",
              file=sys.stderr)

    result = result_record(args, points, peak, unavailable, skipped, partial=bool(skipped))
    for line in result["targets"]["summary"]:
        print(line)
    if result["ours_not_timed"]:
        print(f"best of ours above: without {', '.join(result['ours_not_timed'])} (not timed in this run)")
    rep = result["representative"]
    if unavailable:
        for kk, v in unavailable.items():
            print(f"unavailable: {kk}: {v}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.table_out:
        write_table(result, args.table_out, str(args.json) if args.json else None)
    elif args.tune:  # this user's table: over the one in force, so shapes this run skipped keep their entries
        from sgl_kernel_ext import gemm_table

        gpu = torch.cuda.get_device_name(0)
        write_table(result, gemm_table.user_table_path(gpu), str(args.json) if args.json else None,
                    gemm_table.load_table(gpu))
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png and points:
        try:  # matplotlib's backend setup can fail on a host with a broken IPython; the JSON is what counts
            why = roofline_png(png, points, peak["peak_read_tbs"])
        except Exception as e:
            why = f"roofline plot failed: {type(e).__name__}: {e}"
        print(why or f"wrote {png}")
    if rep:
        print(f"representative: {rep['shape']} G={rep['groups']} t={rep['tokens_per_group']} {rep['provider']} "
              f"{rep['layout']}: {rep['us']:.1f} us, {rep['tflops']:.1f} TFLOP/s, {rep['weight_tbs']:.2f} TB/s "
              f"(median over points of ours-swapab: "
              f"{statistics.median([p['us'] for p in points if p['provider'] == 'ours-swapab'] or [0]):.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
