"""python -m sglang_h20.observe {report,analyze,synth}.

report  DUMP... --out DIR    HTML report (report.html + PNGs + anomalies.json + summary.json)
analyze DUMP... [--json]     anomalies on stdout
synth   --ranks 8 --layers 61 --steps 50 --inject slow-rank:3,... --out DUMP
DUMP: JSON-lines files or directories of them (each rank writes observe-rank<r>.jsonl).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from sglang_h20.cliargs import non_negative_int, positive_int
from sglang_h20.observe import analyze, export

THRESHOLD_HELP = {  # what each analyze.Thresholds field gates (sglang_h20.observe.analyze's docstring)
    "z": "cross-rank detector: robust z a stage's median must exceed",
    "rel": "cross-rank detector: relative excess over the other ranks' median",
    "abs_ms": "absolute excess (ms) a cross-rank or over-time flag needs",
    "time_z": "over-time detector: robust z of a pass against the rank's own median",
    "time_rel": "over-time detector: relative excess of a pass",
    "load_z": "load detector: robust z of a rank's received tokens",
    "load_rel": "load detector: relative excess of a rank's received tokens",
    "load_layer_frac": "load detector: share of MoE layers a rank must be flagged in",
    "expert_z": "hot-expert detector: robust z of an expert's tokens within its layer",
    "expert_rel": "hot-expert detector: relative excess over the median expert",
    "link_z": "latency detector: robust z of a link",
    "link_rel": "latency detector: relative excess of a link",
    "min_ranks": "fewer ranks than this: no cross-rank statistics",
    "min_steps": "fewer sampled passes than this: no over-time statistics",
    "scale_floor": "floor of the robust scale, as a share of |median|",
}


def _threshold_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("thresholds (robust z = (x - median) / max(1.4826 MAD, scale_floor |median|))")
    for f in dataclasses.fields(analyze.Thresholds):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"{THRESHOLD_HELP.get(f.name, f.name)} (default {f.default})")


def _thresholds(ns) -> analyze.Thresholds:
    return analyze.Thresholds(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(analyze.Thresholds)})


DUMP_HELP = "a JSON-lines dump file, or a directory of them (each rank writes observe-rank<r>.jsonl)"


def _read(paths) -> tuple[list[dict], list[str]]:
    errors: list[str] = []
    records = export.read_dump(paths, errors)
    for e in errors[:5]:
        print(f"warning: skipped {e}", file=sys.stderr)
    if len(errors) > 5:
        print(f"warning: {len(errors) - 5} more unreadable lines", file=sys.stderr)
    return records, errors


def cmd_report(ns) -> int:
    from sglang_h20.observe import report

    records, errors = _read(ns.dumps)
    if not records:
        print("no records in " + " ".join(ns.dumps), file=sys.stderr)
        return 1
    path = report.build(records, ns.out, _thresholds(ns), title=ns.title, errors=errors)
    n = len(json.loads((path.parent / "anomalies.json").read_text()))
    print(f"{path} ({len(records)} records, {n} anomalies)")
    return 0


def cmd_analyze(ns) -> int:
    records, _ = _read(ns.dumps)
    if not records:
        print("no records in " + " ".join(ns.dumps), file=sys.stderr)
        return 1
    ds = analyze.load(records)
    anomalies = analyze.detect(ds, _thresholds(ns))
    if ns.json:
        from sglang_h20.observe.report import finite

        print(json.dumps({"summary": finite(analyze.summary(ds)), "anomalies": [a.to_json() for a in anomalies]},
                         indent=1))
    else:
        s = analyze.summary(ds)
        print(f"{s['ranks']} rank(s), {s['passes']} sampled pass(es), {s['layers']} layer(s); "
              f"median step {s['step_ms_median']:.3f} ms; {len(anomalies)} anomaly(ies)")
        for a in anomalies:
            print(f"  [{a.kind:<13}] {a.detector:<10} z={a.z:6.1f}  {a.message}")
    return 2 if (ns.fail_on_anomaly and anomalies) else 0


def cmd_synth(ns) -> int:
    from sglang_h20.observe import synth

    records = synth.synthesize(ranks=ns.ranks, layers=ns.layers, steps=ns.steps, inject=ns.inject or "",
                               seed=ns.seed, experts=ns.experts, topk=ns.topk, tokens=ns.tokens,
                               first_dense=ns.first_dense, ranks_per_node=ns.ranks_per_node)
    path = export.write_dump(ns.out, records)
    print(f"{path}: {len(records)} records ({ns.ranks} ranks x {ns.steps} passes, inject: {ns.inject or 'none'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_h20.observe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("report", help="self-contained HTML report of dumps",
                       description="Write a self-contained HTML report of observe dumps: report.html, its PNGs, "
                                   "anomalies.json and summary.json in --out.")
    r.add_argument("dumps", nargs="+", metavar="DUMP", help=DUMP_HELP)
    r.add_argument("--out", required=True, metavar="DIR", help="output directory")
    r.add_argument("--title", default="sglang-h20 observe report", help="report title (default: %(default)s)")
    _threshold_args(r)
    r.set_defaults(fn=cmd_report)

    a = sub.add_parser("analyze", help="print the anomalies of dumps",
                       description="Print a summary and the anomalies found in observe dumps (exit 2 with "
                                   "--fail-on-anomaly when any).")
    a.add_argument("dumps", nargs="+", metavar="DUMP", help=DUMP_HELP)
    a.add_argument("--json", action="store_true", help="print the summary and anomalies as one JSON object")
    a.add_argument("--fail-on-anomaly", action="store_true", help="exit 2 when anything is flagged")
    _threshold_args(a)
    a.set_defaults(fn=cmd_analyze)

    s = sub.add_parser("synth", help="recorded-like dump with injected faults",
                       description="Write a synthetic dump shaped like a DeepSeek-V3 EP server's, with the "
                                   "faults of --inject, to try report/analyze without a GPU.")
    s.add_argument("--ranks", type=positive_int, default=8, help="EP ranks (GPUs) (default: %(default)s)")
    s.add_argument("--layers", type=positive_int, default=61,
                   help="decoder layers per pass (DeepSeek-V3: 61; default: %(default)s)")
    s.add_argument("--steps", type=positive_int, default=50, help="sampled passes (default: %(default)s)")
    s.add_argument("--inject", default="", help="e.g. slow-rank:3,slow-stage:dispatch@rank5,hot-expert:17 "
                   "(also spike:STAGE@rankR:PASS, slow-link:A-B; factor suffix xF)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    s.add_argument("--experts", type=positive_int, default=256, help="routed experts (default: %(default)s)")
    s.add_argument("--topk", type=positive_int, default=8, help="experts per token (default: %(default)s)")
    s.add_argument("--tokens", type=positive_int, default=64, help="tokens per rank per pass (default: %(default)s)")
    s.add_argument("--first-dense", type=non_negative_int, default=3,
                   help="leading dense (non-MoE) layers (DeepSeek-V3: 3; default: %(default)s)")
    s.add_argument("--ranks-per-node", type=positive_int, default=8,
                   help="ranks per node: intra- vs inter-node link latencies (default: %(default)s)")
    s.add_argument("--out", required=True, help="output .jsonl file")
    s.set_defaults(fn=cmd_synth)

    ns = p.parse_args(argv)
    if ns.cmd == "synth" and ns.topk > ns.experts:
        s.error(f"--topk {ns.topk} is more than --experts {ns.experts}")
    try:
        return ns.fn(ns)
    except (ValueError, OSError) as e:  # bad values, a missing dump, an --out that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
