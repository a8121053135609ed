"""python -m sglang_h20.eplb simulate ...: the trace-driven EPLB simulator (CPU only)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sglang_h20.cliargs import make_dir, non_negative_int, positive_int
from sglang_h20.eplb import simulate as sim

EPILOG = """\
examples:
  python -m sglang_h20.eplb simulate --out /tmp/eplb
  python -m sglang_h20.eplb simulate --topologies ep16 ep32 --structure clusters --layers 58 --out /tmp/eplb58
  python -m sglang_h20.eplb simulate --dump /path/to/expert_distribution_dir --topologies ep32 --out /tmp/eplb_real

Writes DIR/eplb_simulate.json (provenance, config, per-algorithm metrics, migrations, summary) and
DIR/{cross_node_traffic,balancedness,bytes,migration}.png; prints a summary table.
Metrics: cross-node = distinct remote nodes per token per MoE layer (tokens prefer a replica on their
own node); balancedness = mean/max GPU load; bytes = DeepEP-style dispatch (FP8) + combine (bf16)
copies, per step; migration = DeepSeek-V3 FP8 expert weights moved per rebalance.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_h20.eplb",
                                description="Expert-affinity EPLB tools.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sim.SimConfig()
    s = sub.add_parser(
        "simulate", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        help="compare placement algorithms on a routing trace",
        description="Run placement algorithms side by side on the same routing trace (synthetic or an "
                    "SGLang per_token dump) for EP16/EP32/EP64 topologies of 8-GPU nodes: plan from "
                    "a warm-up window's co-activation statistics, evaluate on the next window, "
                    "re-plan every --rebalance-every steps.")
    s.add_argument("--topologies", nargs="+", default=list(d.topologies), choices=list(sim.TOPOLOGIES),
                   help="EP sizes to simulate (nodes x 8 GPUs; default: %(default)s)")
    s.add_argument("--structure", choices=["clusters", "none", "both"], default="both",
                   help="synthetic trace with co-activation clusters, without structure, or both "
                        "(default: %(default)s)")
    s.add_argument("--algorithms", nargs="+", default=list(d.algorithms),
                   help=f"placement algorithms (default: %(default)s); '{sim.TRIVIAL}' = SGLang without EPLB "
                        f"(slot s holds expert s %% E), built in")
    s.add_argument("--steps", type=positive_int, default=d.steps, help="trace length in steps (default: %(default)s)")
    s.add_argument("--warmup", type=positive_int, default=d.warmup,
                   help="steps of statistics before the first plan (default: %(default)s)")
    s.add_argument("--rebalance-every", type=positive_int, default=d.rebalance_every,
                   help="re-plan every N steps from the previous N steps (default: %(default)s)")
    s.add_argument("--tokens-per-step", type=positive_int, default=d.tokens_per_step,
                   help="tokens per step (default: %(default)s)")
    s.add_argument("--layers", type=positive_int, default=d.layers,
                   help="MoE layers (DeepSeek-V3 has 58; default: %(default)s)")
    s.add_argument("--redundant-slots", type=non_negative_int, default=d.redundant_slots,
                   help="extra expert slots per GPU, i.e. SGLang --ep-num-redundant-experts = N x GPUs "
                        "(default: %(default)s)")
    s.add_argument("--affinity", type=float, default=d.affinity,
                   help="affinity weight passed to the placement (default: %(default)s)")
    s.add_argument("--seed", type=int, default=d.seed, help="trace and placement seed (default: %(default)s)")
    s.add_argument("--skew", type=float, default=d.skew,
                   help="Zipf exponent of per-layer expert popularity (default: %(default)s)")
    s.add_argument("--drift", type=float, default=d.drift,
                   help="per-step random-walk std of expert popularity scores (default: %(default)s)")
    s.add_argument("--clusters", type=positive_int, default=d.clusters,
                   help="number of co-activation clusters in the 'clusters' trace (default: %(default)s)")
    s.add_argument("--cluster-strength", type=float, default=d.cluster_strength,
                   help="probability a token's expert comes from its cluster (default: %(default)s)")
    s.add_argument("--dump", metavar="SGLANG_DUMP",
                   help="use an SGLang per_token expert-distribution dump (file or directory) as the trace "
                        "instead of synthetic ones (--structure and trace-shape options are then ignored)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    s.add_argument("--out", required=True, metavar="DIR", help="output directory for JSON and PNGs")
    return p


def _usage_error(message: str) -> int:
    print(f"python -m sglang_h20.eplb simulate: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    known = (sim.TRIVIAL, *sim.ALGORITHMS)
    unknown = [a for a in args.algorithms if a not in known]
    if unknown:
        return _usage_error(f"--algorithms: unknown {', '.join(map(repr, unknown))} (choose from {', '.join(known)})")
    if args.dump and not Path(args.dump).exists():
        return _usage_error(f"--dump: no such file or directory: {args.dump}")
    try:  # before the simulation: a bad --out must not cost its results
        make_dir(args.out)
    except ValueError as e:
        return _usage_error(str(e))
    structures = ("clusters", "none") if args.structure == "both" else (args.structure,)
    cfg = sim.SimConfig(
        topologies=tuple(args.topologies), structures=structures, algorithms=tuple(args.algorithms),
        layers=args.layers, tokens_per_step=args.tokens_per_step, steps=args.steps, warmup=args.warmup,
        rebalance_every=args.rebalance_every, redundant_slots=args.redundant_slots, affinity=args.affinity,
        seed=args.seed, skew=args.skew, drift=args.drift, clusters=args.clusters,
        cluster_strength=args.cluster_strength, dump=args.dump)
    t0 = time.time()
    command = " ".join(["python -m sglang_h20.eplb", *argv])
    try:
        record = sim.simulate(cfg, progress=not args.no_progress, command=command)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path, pngs = sim.write(record, args.out)
    print(sim.format_summary(record))
    print(f"wrote {path} and {', '.join(p.name for p in pngs)} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
