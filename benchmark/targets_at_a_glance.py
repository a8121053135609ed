#!/usr/bin/env python3
"""The open issues' numeric targets at a glance: one PNG (+ the JSON of every number on it) drawn from the
committed GPU records, for people who would rather look than read the write-ups. No GPU, no new measurement.

Each panel shows one issue's target beside what the named records measured, every ratio against the upstream anchor
of the same run (the benches' own `issue_targets`, so the counts are theirs): the FP8 MLA kernel grid (ratios and
roofline fraction), the grouped GEMMs per run (vs the best upstream kernel, read bandwidth, the H20-modelled ratio),
and the end-to-end median ITL ratios of the three features that serve decode.

    python benchmark/targets_at_a_glance.py [--out benchmark/results/targets_at_a_glance.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmark" / "results"
for _p in (REPO / "benchmark" / "kernels", REPO / "python", REPO / "sgl-kernel-ext"):
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

import bench_grouped_gemm  # noqa: E402
import bench_mla_decode  # noqa: E402
from sglang_h20 import provenance  # noqa: E402
from sglang_h20.cliargs import read_json  # noqa: E402

MLA_GRID = "mla_decode/mla_decode_full_grid_s49_h200.json.xz"  # the issue's whole grid, one run (session 49)
# oldest first: a later run of the same points is drawn over an earlier one; a tuple is one sweep and the runs that
# measured what its deadline left (bench_grouped_gemm.merged_results: the later file's points at the keys it measured)
GEMM_RUNS = {
    "s38 swapAB 8-32 tok": "swapab/grouped_gemm_tune_swapab_ppsm34_uneven_t8_t32_h200.json",
    "s39 swapAB 1-24 tok": "swapab/grouped_gemm_tune_swapab_ppsm34_uneven_t1_t24_h200.json",
    "s39 swapAB 256 experts": "swapab/grouped_gemm_tune_swapab_ppsm34_uneven_t1_t24_g256_h200.json",
    "s43 register cap": "swapab/grouped_gemm_tune_maxnreg_s43_h200.json",
    "s44 16-256 experts": "swapab/grouped_gemm_tune_swapab_maxnreg_t16_t32_s44_h200.json",
    "s45 CUDA normal variant": "swapab/grouped_gemm_cuda_diet_s45_h200.json",
    "s49 full grid": ("swapab/grouped_gemm_full_s49_h200.json.xz",
                      "swapab/grouped_gemm_full_s49_g256_m64_m256_h200.json.xz",
                      "swapab/grouped_gemm_full_s49_g256_m1_m32_h200.json.xz"),
    "s52 split 16-64 tok": "swapab/grouped_gemm_split_t16_t64_s52_h200.json.xz",
    "s72 grid, 8-32 experts": ("swapab/grouped_gemm_g8_g16_s72_h200.json.xz",
                               "swapab/grouped_gemm_g32_s72_h200.json.xz")}
# (feature, record, arm, concurrency): bench_serving median ITL, ours / the anchor (below 1: ours faster)
# swapAB: the table shipped in session 59 at 4/16/48/128 (its pre-ship runs); 56 and 64 ran only with the table before
E2E_SWITCHED = [("swapAB", "swapab/swapab_e2e_candidate_c16_c4_s59_h200.json", "on", "4"),
                ("swapAB", "swapab/swapab_e2e_candidate_c16_c4_s59_h200.json", "on", "16"),
                ("swapAB", "swapab/swapab_e2e_candidate_c48_c128_s59_h200.json", "on", "48"),
                ("swapAB", "swapab/swapab_e2e_s42_c56_c64_h200.json", "on", "56"),
                ("swapAB", "swapab/swapab_e2e_s42_c56_c64_h200.json", "on", "64"),
                ("swapAB", "swapab/swapab_e2e_candidate_c48_c128_s59_h200.json", "on", "128"),
                ("SBO", "sbo/sbo_e2e_s35_c16_c32_h200.json", "sbo", "16"),
                ("SBO", "sbo/sbo_e2e_s35_c16_c32_h200.json", "sbo", "32"),
                ("SBO", "sbo/sbo_e2e_s35_c56_c32_h200.json", "sbo", "32"),  # the second call's @32: both shown
                ("SBO", "sbo/sbo_e2e_s35_c56_c32_h200.json", "sbo", "56")]
# (record, workload, anchor): fp8_mla_e2e's ours against FlashMLA in one call
E2E_FP8_MLA = [("mla_decode/fp8_mla_e2e_s50_c4_flashmla_fp8_h200.json", "4096x512@4", "flashmla-fp8"),
               ("mla_decode/fp8_mla_e2e_s50_c8_flashmla_fp8_h200.json", "4096x512@8", "flashmla-fp8"),
               ("mla_decode/fp8_mla_e2e_s38_c16_flashmla_fp8_h200.json", "4096x512@16", "flashmla-fp8"),
               ("mla_decode/fp8_mla_e2e_s37_c48_flashmla_fp8_h200.json", "4096x512@48", "flashmla-fp8"),
               ("mla_decode/fp8_mla_e2e_s41_c64_same_call_h200.json", "2048x512@64", "flashmla-fp8"),
               ("mla_decode/fp8_mla_e2e_s38_c128_flashmla_fp8_h200.json", "1024x256@128", "flashmla-fp8"),
               ("mla_decode/fp8_mla_e2e_s36_c48_flashmla_h200.json", "4096x512@48", "flashmla")]


def load(rel: str) -> dict:
    return read_json(RESULTS / rel, "targets_at_a_glance", SystemExit)


def source(rel: str, rec: dict) -> dict:
    """Where a number came from: the record and its run's commit, GPU and date."""
    prov = rec.get("provenance") or rec
    out = {"file": rel, "git_commit": prov.get("git_commit"), "gpu": prov.get("gpu"), "date": prov.get("date")}
    if rec.get("partial"):  # the sweep did not finish: its counts cover the points it measured
        out["partial"] = {"not_started": len(rec.get("not_started") or [])}
    return out


def mla_targets() -> dict:
    rec = load(MLA_GRID)
    return {"source": source(MLA_GRID, rec), **bench_mla_decode.issue_targets(rec["points"], rec.get("ceilings"))}


def gemm_targets() -> dict:
    runs = {}
    for label, rels in GEMM_RUNS.items():
        rels = (rels,) if isinstance(rels, str) else rels
        recs = [load(rel) for rel in rels]
        rec = bench_grouped_gemm.merge_results(recs, [RESULTS / rel for rel in rels])
        if len(rels) == 1:
            src = source(rels[0], rec)
        else:  # a merged sweep: its points read against the first run's peak (the later runs' peaks listed beside)
            src = {"runs": [source(rel, r) for rel, r in zip(rels, recs)],
                   "peak_read_tbs": [r["peak_read_tbs"] for r in recs],
                   "not_started_after_merge": not_started_after(recs)}
        src["ours_not_timed"] = bench_grouped_gemm.ours_not_timed(rec["points"])
        runs[label] = {"source": src, **bench_grouped_gemm.issue_targets(rec["points"], rec["peak_read_tbs"])}
    return runs


def not_started_after(recs: list[dict]) -> list[str]:
    """The first run's points that its deadline left and no later run measured (bench_grouped_gemm's labels)."""
    done = {bench_grouped_gemm.moe_label(p["shape"], p["groups"], p["tokens_per_group"], p["distribution"])
            for r in recs[1:] for p in r["points"] if p.get("kind") == "moe"}
    return [label for label in recs[0].get("not_started") or [] if label not in done]


def e2e_rows() -> list[dict]:
    rows = []
    for feature, rel, arm, conc in E2E_SWITCHED:
        rec = load(rel)
        rows.append({"feature": feature, "point": f"@{conc}", "anchor": "switch off, same call",
                     "median_itl_ratio": rec["vs_off"][arm][conc]["median_itl_ratio"],
                     "output_throughput_ratio": rec["vs_off"][arm][conc]["output_throughput_ratio"],
                     "source": source(rel, rec)})
    for rel, workload, anchor in E2E_FP8_MLA:
        rec = load(rel)
        tp = rec["summary"]["throughput"][workload]
        rows.append({"feature": "FP8 MLA", "point": workload, "anchor": anchor,
                     "median_itl_ratio": tp["ours"]["median_itl_ms"] / tp[anchor]["median_itl_ms"],
                     "output_throughput_ratio": tp["ours"]["output_tok_s"] / tp[anchor]["output_tok_s"],
                     "source": source(rel, rec)})
    return rows


def plot(summary: dict, path: Path) -> Path:
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    mla = sorted(summary["mla_decode"]["per_point"], key=lambda p: (p["heads"], p["q_len"], p["context"], p["batch"]))
    big = [p["heads"] == 128 and p["batch"] >= 16 and p["context"] >= 4096 for p in mla]
    xs = range(len(mla))
    labels = [f"{p['heads']}h b{p['batch']} {p['context'] // 1024}k q{p['q_len']}" for p in mla]

    ax = axes[0][0]
    ax.scatter([x for x, b in zip(xs, big) if b], [p["vs_flashmla_bf16"] for p, b in zip(mla, big) if b],
               marker="o", color="tab:red", label="vs FlashMLA BF16 at the 1.6x target's points")
    ax.scatter([x for x, b in zip(xs, big) if not b], [p["vs_flashmla_bf16"] for p, b in zip(mla, big) if not b],
               marker="o", facecolors="none", edgecolors="tab:red", label="vs FlashMLA BF16, other points")
    ax.scatter(xs, [p["vs_fastest_upstream_fp8"] for p in mla], marker="^", color="tab:blue",
               label="vs the fastest upstream FP8 path (target 1.0x)")
    ax.axhline(1.6, color="tab:red", ls="--", lw=1)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=5)
    ax.set_ylabel("ours / upstream speed (above 1: ours faster)")
    ax.set_title(f"FP8 MLA decode kernel, best of ours per point ({Path(MLA_GRID).name})", fontsize=8)
    ax.legend(fontsize=7)

    ax = axes[1][0]
    ax.bar(list(xs), [p["roofline_frac"] for p in mla], color=["tab:green" if p["heads"] == 16 else "tab:gray"
                                                              for p in mla])
    ax.axhline(0.7, color="tab:red", ls="--", lw=1, label="target 0.7")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=5)
    ax.set_ylabel("fraction of the binding roofline")
    ax.set_title("FP8 MLA decode: roofline fraction (green: 16 heads, grey: 128)", fontsize=10)
    ax.legend(fontsize=7)

    panels = [(axes[0][1], "vs_best_upstream", "best of ours / best upstream kernel (same run, layout, draw)",
               [(1.0, None), (1.25, (128, 256))], lambda p: True),
              (axes[1][1], "read_frac", "read bandwidth / the run's measured read peak (<= 64 tokens)",
               [(0.9, None)], lambda p: p["tokens_per_group"] <= 64),
              (axes[0][2], "h20_modelled_vs_deepgemm_masked",
               "H20 MODELLED, DeepGEMM masked / ours", [(1.5, None)],
               lambda p: p["tokens_per_group"] <= 32)]
    for ax, key, title, lines, keep in panels:
        for i, (label, run) in enumerate(summary["grouped_gemm"].items()):
            pts = [p for p in run["per_point"] if keep(p) and p[key] is not None]
            jitter = 1 + 0.025 * (i - len(summary["grouped_gemm"]) / 2)
            ax.scatter([p["tokens_per_group"] * jitter for p in pts], [p[key] for p in pts], s=10, alpha=0.7,
                       label=label)
        for bound, span in lines:
            if span:
                ax.plot(span, [bound, bound], color="tab:red", ls="--", lw=1.5)
            else:
                ax.axhline(bound, color="tab:red", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per expert")
        ax.set_title(f"grouped GEMMs: {title}", fontsize=10)
        ax.legend(fontsize=6)

    ax = axes[1][2]
    rows = summary["e2e"]
    colors = {"swapAB": "tab:orange", "SBO": "tab:purple", "FP8 MLA": "tab:blue"}
    ax.barh(range(len(rows)), [r["median_itl_ratio"] for r in rows], color=[colors[r["feature"]] for r in rows])
    ax.set_yticks(range(len(rows)), [f"{r['feature']} {r['point']} vs {r['anchor']}" for r in rows], fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("median ITL, ours / anchor (below 1: ours faster)")
    ax.set_title("end to end, dsv3-ep16-slice (one H200)", fontsize=10)

    fig.suptitle("sglang-h20: the open issues' targets (red dashed) against the committed H200 records; "
                 "H20 figures are modelled", fontsize=12)
    fig.tight_layout()
    return save_png(fig, path, dpi=90)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "targets_at_a_glance.png",
                    help="the PNG; the JSON of its numbers goes next to it (default: %(default)s)")
    args = ap.parse_args(argv)
    summary = {"provenance": provenance.record(), "label": "H200 records; H20 figures modelled",
               "mla_decode": mla_targets(), "grouped_gemm": gemm_targets(), "e2e": e2e_rows()}
    for line in summary["mla_decode"]["summary"]:
        print(f"FP8 MLA ({MLA_GRID}): {line}")
    for label, run in summary["grouped_gemm"].items():
        for line in run["summary"]:
            if not line.endswith(": 0 of 0 points"):
                print(f"grouped GEMM, {label}: {line}")
        if run["source"]["ours_not_timed"]:
            print(f"grouped GEMM, {label}: best of ours without {', '.join(run['source']['ours_not_timed'])} "
                  "(not timed in this run)")
    slower = [f"{r['feature']} {r['point']} {r['median_itl_ratio']:.3f}" for r in summary["e2e"]
              if r["median_itl_ratio"] > 1.0]
    print(f"end to end: median ITL ratio <= 1.0 at {len(summary['e2e']) - len(slower)} of {len(summary['e2e'])} "
          f"points (above: {', '.join(slower) or 'none'})")
    out = plot(summary, args.out)
    for part in [summary["mla_decode"], *summary["grouped_gemm"].values()]:
        del part["per_point"]  # the records hold them; the checks and sources say what the figure shows
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
