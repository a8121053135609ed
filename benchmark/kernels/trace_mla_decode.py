"""Per-warp timeline of one CTA of the CUDA FP8 MLA decode kernel (version 2), from clock64() stamps.

Why: the ablations (mla_cuda_ablation.py) say v2's parts barely overlap, and Nsight Compute that it issues 3.5x
FlashMLA's instructions; neither says which wait keeps one warpgroup's softmax from running under the other's
wgmmas. This builds v2 with -DMLA_TRACE (csrc/mla_fp8_trace.cuh: lane 0 of each warp of one CTA stamps clock64()
with an event code at every phase boundary; the default build's SASS is unchanged), runs one decode step, and
turns the stamps into phases per warp:

  warps 0-3 WG0, 4-7 WG1 (math: V^T transposes, QK^T, softmax, P' publish, PV + merge, and the waits between),
  warps 8-11 the loader WG (wait for a free K stage, issue the tile's cp.async copies).

Output: a table of cycles per phase and per warpgroup (mean over its warps; share of the CTA's span; per
64-token tile); how long one math WG was on the tensor cores while the other did CUDA-core work (the overlap the
seesaw is built for) against both on CUDA cores or both on the tensor cores; --json (provenance, point, the CTA traced, raw stamps per warp, the table), --png (one bar per
warp, phases coloured over time). The traced CTA runs among all the others, so its timeline is the real
schedule plus one store per stamp.

usage (GPU host): python3 benchmark/kernels/trace_mla_decode.py [--point 64x4096x128x1] [--cta 0 0 0]
                  [--splits N] --json OUT.json [--png OUT.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
import bench_mla_decode as bench  # noqa: E402,F401  (puts python/ and sgl-kernel-ext/ of the checkout on sys.path)
from mla_cuda_ablation import parse_point  # noqa: E402

# event code -> the phase that runs from this stamp to the warp's next one (codes: mla_fp8_decode_sm90_v2.cu)
PHASE_AFTER = {
    1: "start",
    2: "loader: wait free K stage",
    3: "loader: issue copies",
    4: "loader: next tile",
    10: "WG barrier (V^T reuse)",
    11: "wait K tile",
    20: "V^T transpose",
    12: "QK^T issue",
    13: "QK^T wgmma wait",
    14: "softmax",
    15: "publish P' (wait buffer, store)",
    16: "to PV",
    17: "wait P' of the tile",
    18: "PV wgmma + merge",
    19: "round bookkeeping",
    30: "epilogue",
}
END_CODES = (5, 31)
WAIT_PHASES = ("loader: wait free K stage", "WG barrier (V^T reuse)", "wait K tile", "QK^T wgmma wait",
               "publish P' (wait buffer, store)", "wait P' of the tile")
WARPGROUPS = {"WG0 (math)": range(0, 4), "WG1 (math)": range(4, 8), "loader": range(8, 12)}
# what a math warp's phase keeps busy: the design wants one WG on "tensor" while the other is on "cuda"
TENSOR_PHASES = ("QK^T wgmma wait", "PV wgmma + merge")
SYNC_PHASES = tuple(p for p in WAIT_PHASES if p not in TENSOR_PHASES)
TRACE_DEFINE = "MLA_TRACE"


def decode_stamps(events, counts) -> list[list[tuple[int, int]]]:
    """Raw stamps ((code << 56) | clock) per warp -> [(code, clock)] per warp, in order, the first `counts[w]`."""
    mask = (1 << 56) - 1
    return [[(int(e) >> 56, int(e) & mask) for e in events[w][:int(counts[w])]] for w in range(len(counts))]


def segments(stamps: list[list[tuple[int, int]]]) -> list[list[tuple[str, int, int]]]:
    """(phase, start, end) per warp, clocks relative to the CTA's first stamp; a phase runs from a stamp to the
    warp's next one and is named by the first (PHASE_AFTER); nothing follows an end stamp."""
    firsts = [s[0][1] for s in stamps if s]
    t0 = min(firsts) if firsts else 0
    out = []
    for s in stamps:
        segs = []
        for (code, t), (_, t_next) in zip(s, s[1:]):
            if code in END_CODES:
                break
            segs.append((PHASE_AFTER.get(code, f"code {code}"), t - t0, t_next - t0))
        out.append(segs)
    return out


def summarize(segs: list[list[tuple[str, int, int]]], tiles: int) -> dict:
    """Cycles per phase for each warpgroup (mean over its traced warps), the CTA's span, shares and per-tile."""
    span = max((e for w in segs for _, _, e in w), default=0)
    table = {}
    for name, warps in WARPGROUPS.items():
        live = [segs[w] for w in warps if w < len(segs) and segs[w]]
        if not live:
            continue
        acc: dict[str, float] = {}
        for w in live:
            for phase, a, b in w:
                acc[phase] = acc.get(phase, 0.0) + (b - a) / len(live)
        waits = sum(v for k, v in acc.items() if k in WAIT_PHASES)
        table[name] = {"cycles": {k: round(v) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])},
                       "share": {k: round(v / span, 4) if span else 0.0 for k, v in acc.items()},
                       "per_tile": {k: round(v / tiles, 1) if tiles else 0.0 for k, v in acc.items()},
                       "waiting_share": round(waits / span, 4) if span else 0.0}
    return {"span_cycles": span, "tiles": tiles, "cycles_per_tile": round(span / tiles, 1) if tiles else None,
            "warpgroups": table}


def category(phase: str) -> str:
    return "tensor" if phase in TENSOR_PHASES else "sync" if phase in SYNC_PHASES else "cuda"


def concurrency(segs: list[list[tuple[str, int, int]]], warps: tuple[int, int] = (0, 4)) -> dict:
    """Cycles during which the two math WGs (one warp of each) are in each pair of categories (tensor / cuda /
    sync), and the overlap the seesaw is built for: one WG's wgmmas while the other does CUDA-core work."""
    a, b = (segs[w] if w < len(segs) else [] for w in warps)
    cuts = sorted({t for w in (a, b) for _, s, e in w for t in (s, e)})

    def at(w, t):  # category of warp w's phase covering [t, next cut)
        return next((category(p) for p, s, e in w if s <= t < e), "idle")

    cells: dict[str, int] = {}
    for t, t_next in zip(cuts, cuts[1:]):
        key = f"{at(a, t)}|{at(b, t)}"
        cells[key] = cells.get(key, 0) + (t_next - t)
    span = (cuts[-1] - cuts[0]) if cuts else 0
    seesaw = cells.get("tensor|cuda", 0) + cells.get("cuda|tensor", 0)
    return {"cycles": dict(sorted(cells.items(), key=lambda kv: -kv[1])), "span_cycles": span,
            "seesaw_share": round(seesaw / span, 4) if span else 0.0,
            "both_cuda_share": round(cells.get("cuda|cuda", 0) / span, 4) if span else 0.0,
            "both_tensor_share": round(cells.get("tensor|tensor", 0) / span, 4) if span else 0.0}


def plot(segs, path: Path, title: str) -> None:
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    phases = sorted({p for w in segs for p, _, _ in w})
    cmap = plt.get_cmap("tab20")
    colour = {p: cmap(i % 20) for i, p in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(14, 5))
    for w, ws in enumerate(segs):
        for p, a, b in ws:
            ax.broken_barh([(a, b - a)], (w - 0.4, 0.8), facecolors=colour[p],
                           hatch="//" if p in WAIT_PHASES else None, edgecolor="none")
    ax.set_yticks(range(len(segs)))
    ax.set_yticklabels([f"warp {w} ({'WG0' if w < 4 else 'WG1' if w < 8 else 'loader'})" for w in range(len(segs))])
    ax.invert_yaxis()
    ax.set_xlabel("SM clock cycles since the CTA's first stamp")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, facecolor=colour[p], hatch="//" if p in WAIT_PHASES else None)
                       for p in phases], labels=phases, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--point", type=parse_point, default=parse_point("64x4096"), metavar="BxCTX[xH[xT]]",
                    help="batch x context [x heads [x q_len]] (default: 64x4096, 128 heads, q_len 1)")
    ap.add_argument("--cta", type=int, nargs=3, default=[0, 0, 0], metavar=("ROW_BLOCK", "SPLIT", "BATCH"),
                    help="the CTA to trace (grid x, y, z)")
    ap.add_argument("--splits", type=int, default=0, help="KV splits (default: the CUDA kernels' plan)")
    ap.add_argument("--json", type=Path, required=True, help="write the trace and its table here")
    ap.add_argument("--png", type=Path, help="timeline plot (default: next to --json)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import ctypes
    import dataclasses
    import importlib

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        print("trace_mla_decode: needs a CUDA GPU (Hopper, sm_90) and nvcc; nothing traced", file=sys.stderr)
        return 2
    from sglang_h20.provenance import record

    mla = importlib.import_module("sgl_kernel_ext.mla_decode")
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    batch, ctx, heads, q_len = args.point
    d = mla.make_mla_inputs([ctx] * batch, heads, q_len, 64, device="cuda", seed=5)
    meta = cu.get_mla_decode_metadata(d["cache_seqlens"], heads, q_len, max_seqlen=ctx)
    if args.splits:
        meta = dataclasses.replace(meta, num_splits=args.splits)
    call = (d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"], meta)
    ok, why = cu.available(2, (TRACE_DEFINE,))
    if not ok:
        print(f"trace_mla_decode: the traced v2 build is unavailable: {why}", file=sys.stderr)
        return 2
    lib = cu.library(2, (TRACE_DEFINE,))
    warps, nev = ctypes.c_int(), ctypes.c_int()
    lib.mla_fp8_trace_shape(ctypes.byref(warps), ctypes.byref(nev))
    cu.mla_decode_fp8_cuda(*call, version=2, defines=(TRACE_DEFINE,))  # warm up (first launch sets attributes)
    torch.cuda.synchronize()
    rb, sp, b = args.cta
    err = lib.mla_fp8_trace_reset(rb, sp, b)
    assert err == 0, f"mla_fp8_trace_reset: CUDA error {err}"
    cu.mla_decode_fp8_cuda(*call, version=2, defines=(TRACE_DEFINE,))
    torch.cuda.synchronize()
    events = np.zeros((warps.value, nev.value), dtype=np.uint64)
    counts = np.zeros(warps.value, dtype=np.int32)
    err = lib.mla_fp8_trace_read(events.ctypes.data_as(ctypes.c_void_p), counts.ctypes.data_as(ctypes.c_void_p))
    assert err == 0, f"mla_fp8_trace_read: CUDA error {err}"
    stamps = decode_stamps(events, counts)
    while stamps and not stamps[-1]:  # the trace has room for more warps than the kernel has
        stamps.pop()
    if not any(stamps):
        print(f"trace_mla_decode: CTA {args.cta} left no stamps (outside the grid of {meta.num_splits} splits?)",
              file=sys.stderr)
        return 1
    tiles = -(-ctx // (64 * meta.num_splits))
    segs = segments(stamps)
    summary = summarize(segs, tiles)
    title = (f"v2, batch {batch} x {ctx} tokens x {heads} heads, q_len {q_len}, {meta.num_splits} split(s); "
             f"CTA {tuple(args.cta)}: {summary['cycles_per_tile']} cycles per 64-token tile")
    print(title)
    summary["concurrency"] = concurrency(segs)
    c = summary["concurrency"]
    print(f"  WG0 vs WG1 (warps 0, 4): one on the tensor cores while the other does CUDA-core work "
          f"{c['seesaw_share']:.0%} of the time, both on CUDA cores {c['both_cuda_share']:.0%}, "
          f"both on the tensor cores {c['both_tensor_share']:.0%}")
    for wg, row in summary["warpgroups"].items():
        print(f"  {wg}: waiting {row['waiting_share']:.0%} of the span")
        for phase, cyc in row["cycles"].items():
            print(f"    {phase:34s} {cyc:>10d} cycles  {row['share'][phase]:6.1%}  {row['per_tile'][phase]:8.1f}/tile")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "provenance": record(), "point": {"batch": batch, "context": ctx, "heads": heads, "q_len": q_len,
                                          "num_splits": meta.num_splits}, "cta": args.cta,
        "phase_after_code": {str(k): v for k, v in PHASE_AFTER.items()}, "summary": summary,
        "stamps": [[list(e) for e in s] for s in stamps]}, indent=1))
    png = args.png or args.json.with_suffix(".png")
    plot(segs, png, title)
    print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
