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

from sglang_h20.observe import analyze, export


def _threshold_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("thresholds (robust z = (x - median) / (1.4826 MAD))")
    for f in dataclasses.fields(analyze.Thresholds):
        g.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"default {f.default}")


def _thresholds(ns) -> analyze.Thresholds:
    return analyze.Thresholds(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(analyze.Thresholds)})


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

    r = sub.add_parser("report", help="self-contained HTML report of dumps")
    r.add_argument("dumps", nargs="+")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--title", default="sglang-h20 observe report")
    _threshold_args(r)
    r.set_defaults(fn=cmd_report)

    a = sub.add_parser("analyze", help="print the anomalies of dumps")
    a.add_argument("dumps", nargs="+")
    a.add_argument("--json", action="store_true")
    a.add_argument("--fail-on-anomaly", action="store_true", help="exit 2 when anything is flagged")
    _threshold_args(a)
    a.set_defaults(fn=cmd_analyze)

    s = sub.add_parser("synth", help="recorded-like dump with injected faults")
    s.add_argument("--ranks", type=int, default=8)
    s.add_argument("--layers", type=int, default=61)
    s.add_argument("--steps", type=int, default=50, help="sampled passes")
    s.add_argument("--inject", default="", help="e.g. slow-rank:3,slow-stage:dispatch@rank5,hot-expert:17 "
                   "(also spike:STAGE@rankR:PASS, slow-link:A-B; factor suffix xF)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--experts", type=int, default=256)
    s.add_argument("--topk", type=int, default=8)
    s.add_argument("--tokens", type=int, default=64, help="tokens per rank per pass")
    s.add_argument("--first-dense", type=int, default=3)
    s.add_argument("--ranks-per-node", type=int, default=8)
    s.add_argument("--out", required=True, help="output .jsonl file")
    s.set_defaults(fn=cmd_synth)

    ns = p.parse_args(argv)
    try:
        return ns.fn(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
