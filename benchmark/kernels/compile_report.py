#!/usr/bin/env python3
"""Compile our Triton kernels for sm_90a on any machine (no GPU) and report what ptxas made of them.

Why: the compiler's resource report answers most performance questions before any device time is spent
(registers, spills, shared memory, which MMA instructions and which loads): see sgl-kernel-ext/NOTES.md.

    python benchmark/kernels/compile_report.py                 # every kernel, default configs
    python benchmark/kernels/compile_report.py mla --mla-configs 64x32x512x8x2b 64x64x512x8x2b
    python benchmark/kernels/compile_report.py table           # the grouped-GEMM table's configs: held by registers?

Per variant: registers, spill bytes, shared memory, the wgmma shapes (m64nNkK) and operand types, mma.sync
count (a slower path), TMA copies, the release/acquire instructions of the SBO signals, the combine's fp32
atomics, and the programs one SM holds (`per SM`; a closing line lists the variants whose registers hold fewer
than their shared memory would allow).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "sgl-kernel-ext"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sgl_kernel_ext.gemm_table import table_path  # noqa: E402
from sgl_kernel_ext.grouped_gemm_fp8 import resident_per_sm  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _signature(fn, const: dict, types: dict) -> dict:
    """Every parameter: constexpr if given in const, else types[name], else a 32-bit int."""
    return {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}


def compile_report(fn, const: dict, types: dict, num_warps: int, num_stages: int = 2, ones=(), divisible=None,
                   maxnreg: int | None = None) -> dict:
    """As the runtime JIT specializes: `ones` (e.g. unit strides) become constants 1, and pointers and the
    integer arguments named in `divisible` (default: every stride; true for these shapes) get Triton's
    divisible-by-16 hint. maxnreg: a tile config's register cap."""
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const,
             **{n: 1 for n in ones}}
    sig = _signature(fn, const, types)
    hinted = set(divisible) if divisible is not None else {n for n in fn.arg_names if n.startswith("stride_")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (n in hinted and sig[n] == "i32")}
    c = triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages,
                                    **({"maxnreg": maxnreg} if maxnreg else {})))
    ptx = c.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        Path(src).write_text(ptx)
        r = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas failed: {r.stderr[-500:]}")
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spill.group(1)) if spill else 0,
        "shared_bytes": c.metadata.shared,
        "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+\.\w+)", ptx))),
        "mma_sync": len(re.findall(r"\bmma\.sync\.aligned", ptx)),
        "tma_copies": ptx.count("cp.async.bulk.tensor"),
        "release_atomics": len(re.findall(r"atom\.[\w.]*release", ptx)),
        "acquire_loads": len(re.findall(r"ld\.[\w.]*acquire", ptx)),
        "acquire_atomics": len(re.findall(r"atom\.[\w.]*acquire", ptx)),
        "acq_rel_atomics": len(re.findall(r"atom\.[\w.]*acq_rel", ptx)),
        "f32_atomics": len(re.findall(r"(?:atom|red)\.[\w.]*f32", ptx)),
        "nanosleeps": ptx.count("nanosleep"),
        "sys_atomics": len(re.findall(r"atom\.[\w.]*\bsys\b", ptx)),  # system scope (peer GPUs' memory)
        "setmaxnreg": ptx.count("setmaxnreg"),  # warp specialization: register budgets moved between warp groups
        "num_warps": c.metadata.num_warps,  # as launched (warp specialization adds warps)
        # programs one SM holds (by registers, shared memory, threads): the tiles in flight at once; and what
        # shared memory alone would allow (more than resident_per_sm: registers are the limit)
        "resident_per_sm": resident_per_sm(int(regs.group(1)) if regs else 0, c.metadata.shared,
                                           c.metadata.num_warps),
        "resident_per_sm_by_shared": resident_per_sm(1, c.metadata.shared, c.metadata.num_warps),
    }


# ------------------------------------------------------------------------------------------ the kernels
def mla_variants(configs: list[str]):
    from sgl_kernel_ext import mla_decode as m

    for cfg in configs:
        bh, bn, bv, w, s = (int(x) for x in cfg.rstrip("b").split("x"))
        types = {"Q8_LAT": f"tensordesc<fp8e4nv[{bh}, 512]>", "Q8_ROPE": f"tensordesc<fp8e4nv[{bh}, 64]>",
                 "K_LAT": f"tensordesc<fp8e4nv[{bn}, 512]>", "K_ROPE": f"tensordesc<fp8e4nv[{bn}, 64]>",
                 "V": f"tensordesc<fp8e4nv[{bn}, {bv}]>", "QS": "*fp32", "KVS": "*fp32", "BT": "*i32",
                 "SEQ": "*i32", "OP": "*fp32", "LP": "*fp32", "OUT": "*bf16", "LSE": "*fp32", "qk_scale": "fp32",
                 "SPLITS": "*i32"}
        const = dict(PAGE_SIZE=64, BLOCK_H=bh, BLOCK_N=bn, BLOCK_V=bv, PV_16BIT=cfg.endswith("b"), CAUSAL=True,
                     DIRECT=False, INTERPRET=False, ROUND_BF16=False, DYN_SPLITS=True)  # the CUDA-graph form
        yield f"mla_decode[{cfg}]", m._mla_fp8_split_kernel, const, types, w, s, ()


# the grouped-GEMM kernels' pointer arguments (the others default to 32-bit ints)
GEMM_TYPES = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "indptr_ptr": "*i32",
              "masked_m_ptr": "*i32", "sig_ptr": "*i32", "as_ptr": "*fp32", "bs_ptr": "*fp32", "ws_ptr": "*fp32",
              "cmb_pair_ptr": "*i32", "cmb_rowp_ptr": "*i32", "cmb_w_ptr": "*fp32", "cmb_cnt_ptr": "*i32",
              "cmb_out_ptr": "*bf16", "dfr_ptr": "*i32"}
GEMM_LAUNCH_TYPES = {**GEMM_TYPES, "cmb_w_scale": "fp32"}  # as launched: a float


def gemm_variants():
    from sgl_kernel_ext import grouped_gemm_fp8 as g

    types = GEMM_TYPES
    # defer: False, True, or "tail" (one grid-wide arrival per program, EpilogueCombine.tail)
    for swap, bt, sig, topk, defer in ((True, 16, False, 0, False), (False, 64, False, 0, False),
                                       (True, 16, True, 0, False), (True, 16, False, 8, False),
                                       (True, 16, False, 8, True), (True, 16, False, 8, "tail")):
        const = dict(G=8, K=2048, LAYOUT=1, SWAP_AB=swap, BLOCK_N=128, BLOCK_T=bt, SPLIT_K=1, HAS_SIGNAL=sig,
                     COMBINE_TOPK=topk, COMBINE_DEFER=defer is True, COMBINE_TAIL=defer == "tail")
        const = {k: v for k, v in const.items() if k in g._fp8_grouped_gemm_kernel.arg_names}
        ones = [n for n in ("stride_ak", "stride_bk", "stride_on", "stride_asm", "stride_bsk")
                if n in g._fp8_grouped_gemm_kernel.arg_names]
        yield (f"grouped_gemm[masked {'swapab' if swap else 'normal'} t{bt}{' signal' if sig else ''}"
               f"{' combine' if topk else ''}{' deferred' if defer is True else ' tail' if defer else ''}]",
               g._fp8_grouped_gemm_kernel, const, types, 4, 3, ones)
    # the tile of session 43 as the bench launched it: 128 x 32 at 3 stages, uncapped (176 registers, as Nsight
    # Compute saw: two per SM) and with config maxnreg 160 (three, as shared memory allows)
    fn = g._fp8_grouped_gemm_kernel
    for cap in (None, 160):
        const = dict(G=8, K=7168, LAYOUT=0, SWAP_AB=True, BLOCK_N=128, BLOCK_T=32, SPLIT_K=1)
        yield (f"grouped_gemm[contiguous swapab t32 K7168{f' maxnreg {cap}' if cap else ''}]", fn, const,
               GEMM_LAUNCH_TYPES, 4, 3, *bench_specialization(fn), cap)
    # config "flat": the same tiles in one flattened, pipelined loop (tl.range(..., flatten=True)); "tma": its
    # FP8 operands through tensor descriptors (cp.async.bulk.tensor) instead of pointer loads
    ones = ("stride_ak", "stride_bk", "stride_on", "stride_asm", "stride_bsk")
    # (+ the SBO combine epilogue in that loop, inline or deferred)
    for swap, bt, tma, topk, defer in ((True, 16, False, 0, False), (True, 16, True, 0, False),
                                       (False, 64, True, 0, False), (True, 16, True, 8, False),
                                       (True, 16, True, 8, True)):
        const = dict(G=8, G_P2=8, K=2048, LAYOUT=1, SWAP_AB=swap, BLOCK_N=128, BLOCK_T=bt, INTERPRET=False, TMA=tma,
                     COMBINE_TOPK=topk, COMBINE_DEFER=defer)
        descs = {"a_desc": f"tensordesc<fp8e4nv[{bt}, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>"}
        if not tma:
            const.update(a_desc=None, b_desc=None)
        yield (f"grouped_gemm[masked {'swapab' if swap else 'normal'} t{bt} flat{' tma' if tma else ''}"
               f"{' combine' if topk else ''}{' deferred' if defer else ''}]",
               g._fp8_grouped_gemm_flat_kernel, const, {**types, **descs}, 4, 4, ones)
    yield from ws_variants()


def bench_specialization(fn) -> tuple[tuple, list]:
    """(ones, divisible) of the group-walk kernel as bench_grouped_gemm and the plugin launch it: row-major
    activation scales (unit stride_ask; 56 or 16 scale blocks per row carry no divisibility hint, nor the weights'
    stride_bsn), and the integer arguments that are multiples of 16 there. Session 43's CPU report, built with
    column-major scales, gave the 128 x 32 tile 168 registers where the GPU build had 176."""
    divisible = [n for n in fn.arg_names if n.startswith("stride_") and n not in ("stride_asm", "stride_bsn")] + [
        "M_DENSE", "MAX_M", "N", "NUM_PROGRAMS", "SIG_STRIDE", "stride_cmb_om", "NUM_TOKENS", "MAX_SPIN"]
    return ("stride_ak", "stride_bk", "stride_on", "stride_ask", "stride_bsk"), divisible


def table_variants(path: Path):
    """Every distinct group-walk tile config the grouped-GEMM table at `path` ships for the MoE layouts (swapAB and
    normal, whichever is best at the key), specialized as launched: where its registers, not its shared memory,
    bound the programs per SM, a register cap (config maxnreg) might put more tiles in flight."""
    from sgl_kernel_ext import grouped_gemm_fp8 as g

    fn = g._fp8_grouped_gemm_kernel
    programs: dict = {}  # compile-relevant key -> the programs per SM the table launches it with
    for e in json.loads(path.read_text())["entries"]:
        if e["layout"] == "dense":
            continue
        for variant in ("swapab", "normal"):
            given = (e.get("config") or {}).get(variant)
            if given is None or any(given.get(w) for w in ("flat", "tma", "ws")):
                continue  # not timed at this key, or another walk's kernel
            cfg = {**g.heuristic_config(variant, e["m"], e["n"], e["k"], e["groups"]), **given}
            key = (e["layout"], variant, e["groups"], e["k"], cfg["BLOCK_N"], cfg["BLOCK_T"], cfg["num_warps"],
                   cfg["num_stages"], cfg.get("maxnreg"), cfg.get("split_k", 1))
            programs.setdefault(key, set()).add(cfg.get("programs_per_sm", 1))
    for key, pps in programs.items():
        layout, variant, groups, k, bn, bt, warps, stages, cap, split_k = key
        const = dict(G=groups, K=k, LAYOUT=0 if layout == "contiguous" else 1, SWAP_AB=variant == "swapab",
                     BLOCK_N=bn, BLOCK_T=bt, SPLIT_K=split_k)
        yield (f"table[{layout} {variant} G{groups} K{k} {bn}x{bt} w{warps} s{stages}"
               f"{f' maxnreg {cap}' if cap else ''}{f' split_k {split_k}' if split_k > 1 else ''}"
               f" launched {'/'.join(map(str, sorted(pps)))} per SM]",
               fn, const, GEMM_LAUNCH_TYPES, warps, stages, *bench_specialization(fn), cap)


def ws_variants():
    """config "ws": the persistent tile walk over TMA boxes, fed by the token-tile map, left to the software
    pipeliner (" ws]") and warp-specialized (ws_split: " ws split]")."""
    from sgl_kernel_ext import grouped_gemm_fp8 as g

    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "map_ptr": "*i32", "count_ptr": "*i32",
             "as_ptr": "*fp32", "bs_ptr": "*fp32"}
    for swap, bt, bn in ((False, 128, 128), (False, 64, 128), (True, 32, 128)):
        for split in (False, True):
            const = dict(K=2048, SWAP_AB=swap, BLOCK_N=bn, BLOCK_T=bt, INTERPRET=False, SPECIALIZE=split)
            descs = {"a_desc": f"tensordesc<fp8e4nv[{bt}, 128]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128]>"}
            yield (f"grouped_gemm[{'swapab' if swap else 'normal'} t{bt} n{bn} ws{' split' if split else ''}]",
                   g._fp8_grouped_gemm_ws_kernel, const, {**types, **descs},
                   8 if bt * bn >= 128 * 128 and not split else 4, 3 if split else 4,  # 128x128 at 4 warps spills
                   ("stride_on", "stride_asm", "stride_bsk"))
    for layout in (0, 1):
        yield (f"token_tile_map[{('contiguous', 'masked')[layout]}]", g._token_tile_map_kernel,
               dict(G=256, G_P2=256, LAYOUT=layout, BLOCK_T=128), {"indptr_ptr": "*i32", "masked_m_ptr": "*i32",
                                                                  "map_ptr": "*i32", "count_ptr": "*i32"}, 4, 1, ())


def sbo_variants():
    from sgl_kernel_ext import sbo

    types = {"y_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*fp32", "acc_ptr": "*fp32", "w_scale": "fp32"}
    types.update({n: "*i32" for n in sbo._combine_kernel.arg_names if n.endswith("_ptr") and n not in types})
    for masked, wait in ((True, True), (False, True), (False, False)):  # the wrapper's defaults otherwise
        const = dict(H=7168, TOPK=8, MASKED=masked, WAIT=wait, BLOCK_T=16, BLOCK_R=sbo.BLOCK_R, BLOCK_H=sbo.BLOCK_H,
                     SLEEP_NS=sbo.DEFAULT_SPIN_SLEEP_NS)
        yield (f"sbo_combine[{'masked' if masked else 'contiguous'}{' wait' if wait else ''}]", sbo._combine_kernel,
               const, types, 4, 2, ())
    # the dispatch map (one program sorts up to LAYOUT_MAX_PAIRS pairs) and the row gather
    ltypes = {n: "*i32" for n in sbo._layout_kernel.arg_names if n.endswith("_ptr")}
    for masked, drops, block_p in ((False, False, 2048), (True, True, 2048), (False, False, sbo.LAYOUT_MAX_PAIRS)):
        const = dict(TOPK=8, BLOCK_P=block_p, BLOCK_E=512, MASKED=masked, DROPS=drops, BLOCK_S=1024)
        yield (f"sbo_layout[{'masked' if masked else 'contiguous'}{' drops' if drops else ''} p{block_p}]",
               sbo._layout_kernel, const, ltypes, 8, 1, ())
    dtypes = {"src_ptr": "*i32", "dst_ptr": "*i32", "row_of_pair_ptr": "*i32"}
    yield ("sbo_dispatch_rows[int32 words]", sbo._dispatch_rows_kernel, dict(TOPK=8, BLOCK=2048), dtypes, 4, 1, ())
    qtypes = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "row_of_pair_ptr": "*i32", "eps": "fp32"}
    yield ("sbo_quant_dispatch[gpp 4]", sbo._quant_dispatch_kernel,
           dict(TOPK=8, GROUP=128, GROUPS_PER_PROG=4, EXACT_ROUND=False), qtypes, 4, 1, ())


def ep_variants():
    from sgl_kernel_ext import ep_combine as ep

    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "y_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32",
             "w_ptr": "*fp32", "recv_tab_ptr": "*i64", "arr_tab_ptr": "*i64", "w_scale": "fp32"}
    types.update({n: "*i32" for n in ep._ep_down_combine_kernel.arg_names if n.endswith("_ptr") and n not in types})
    # swapAB (the decode sizes the EP combine is for) and normal t64 (spilled 1488 B before the 32-column gather)
    for layout, swap, bt, bf16 in ((1, True, 16, False), (0, True, 16, False), (0, True, 16, True),
                                   (0, False, 64, False)):
        const = dict(G=16, K=2048, LAYOUT=layout, SWAP_AB=swap, BLOCK_N=ep.COUNT_BLOCK_N, BLOCK_T=bt, TOPK=8,
                     PARTIAL_BF16=bf16, a_desc=None, b_desc=None)
        yield (f"ep_down_combine[{'masked' if layout else 'contiguous'} {'swapab' if swap else 'normal'} t{bt}"
               f"{' bf16' if bf16 else ''}]", ep._ep_down_combine_kernel, const, types, 4, 3,
               ("stride_ak", "stride_bk", "stride_asm", "stride_bsk"))
    # the flattened, TMA-fed walk (config flat + tma): the next tiles' loads in flight while a tile sends
    const = dict(G=16, G_P2=16, K=2048, LAYOUT=1, SWAP_AB=True, BLOCK_N=ep.COUNT_BLOCK_N, BLOCK_T=16, TOPK=8,
                 PARTIAL_BF16=False, FLAT=True, TMA=True)
    yield ("ep_down_combine[masked swapab t16 flat tma]", ep._ep_down_combine_kernel, const,
           {**types, "a_desc": "tensordesc<fp8e4nv[16, 128]>", "b_desc": "tensordesc<fp8e4nv[128, 128]>"}, 4, 4,
           ("stride_ak", "stride_bk", "stride_asm", "stride_bsk"))
    ftypes = {"recv_ptr": "*fp32", "arr_ptr": "*i32", "out_ptr": "*bf16", "err_ptr": "*i32"}
    yield ("ep_finish", ep._ep_finish_kernel, dict(WORLD=8, BLOCK_T=ep.FINISH_BLOCK_T, BLOCK_N=ep.COUNT_BLOCK_N,
           SLEEP_NS=ep.DEFAULT_SPIN_SLEEP_NS), ftypes, 4, 2, ())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", nargs="*",
                    help="mla, gemm, sbo, ep (default: all of these), table (the grouped-GEMM table's tile configs)")
    ap.add_argument("--table", type=Path, default=table_path("NVIDIA H200"),
                    help="the table `table` reads (default: the shipped H200 one, or $SGLANG_H20_GEMM_TABLE)")
    ap.add_argument("--mla-configs", nargs="+", default=["64x32x512x8x2b", "64x32x256x8x2"],
                    help="BHxBNxBVxWxS[b] as in bench_mla_decode.py --configs")
    ap.add_argument("--json", type=Path, help="write the report of every variant here")
    args = ap.parse_args(argv)
    gens = {"mla": lambda: mla_variants(args.mla_configs), "gemm": gemm_variants, "sbo": sbo_variants,
            "ep": ep_variants, "table": lambda: table_variants(args.table)}
    if set(args.kernels) - gens.keys():
        ap.error(f"unknown kernels {sorted(set(args.kernels) - gens.keys())}; choose from {sorted(gens)}")
    out = {}
    for k in args.kernels or ["mla", "gemm", "sbo", "ep"]:
        for name, fn, const, types, w, s, ones, *rest in gens[k]():  # rest: divisible, maxnreg
            try:
                rep = compile_report(fn, const, types, w, s, ones, *rest)
            except Exception as e:  # report and go on: one variant failing to compile is itself a finding
                rep = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
            out[name] = rep
            print(f"{name:45s} " + (rep["error"] if "error" in rep else
                  f"regs {rep['registers']} spill {rep['spill_bytes']} B smem {rep['shared_bytes']} B "
                  f"wgmma {rep['wgmma']} mma.sync {rep['mma_sync']} tma {rep['tma_copies']} "
                  f"release {rep['release_atomics']} acquire {rep['acquire_loads']}+{rep['acquire_atomics']} atom "
                  f"f32-atomics {rep['f32_atomics']} setmaxnreg {rep['setmaxnreg']} warps {rep['num_warps']} "
                  f"per SM {rep['resident_per_sm']}"),
                  flush=True)
    held = {n: r for n, r in out.items() if "error" not in r and r["resident_per_sm"] < r["resident_per_sm_by_shared"]}
    if held:
        print(f"held back by registers ({len(held)} of {len(out)}): "
              + ", ".join(f"{n} {r['resident_per_sm']} of {r['resident_per_sm_by_shared']}" for n, r in held.items()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 1 if any("error" in r for r in out.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
