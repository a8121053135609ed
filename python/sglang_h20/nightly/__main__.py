"""python -m sglang_h20.nightly {run,compare}: exit 0 clean, 1 regressions or failed points, 2 bad usage/config."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from sglang_h20.cliargs import make_dir, positive_int, read_json
from sglang_h20.nightly import compare as cmp
from sglang_h20.nightly import config as cfg
from sglang_h20.nightly import report, runner

EXIT_OK, EXIT_REGRESSION, EXIT_USAGE = 0, 1, 2

EPILOG = """exit status: 0 no regression, 1 a regression or a failed point (skipped ones do not count),
2 bad usage, config or record. Outputs in --out: run.json (run only), report.md, throughput.png, itl.png."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_h20.nightly", epilog=EPILOG,
                                description="Nightly regression runner: run a benchmark matrix several times "
                                            "and compare it with a baseline run record.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,compare}")
    r = sub.add_parser("run", epilog=EPILOG, help="run a config's benchmarks (needs the GPU), then report",
                       description="Run every kernel and serving point of a config `repeats` times, write "
                                   "run.json and a report (compared with --baseline if given). "
                                   "Run from the repository root: kernel commands run in the current directory.")
    r.add_argument("--config", required=True, metavar="FILE|NAME",
                   help=f"a TOML config file, or a shipped one: {', '.join(cfg.shipped())}")
    r.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="output directory (run.json, report, server and bench logs)")
    r.add_argument("--models", metavar="DIR", help="models root substituted for {models} in model paths")
    r.add_argument("--baseline", type=Path, metavar="FILE", help="a previous run.json to compare against")
    r.add_argument("--repeats", type=positive_int, metavar="N", help="repeats per point (default: the config's)")
    r.add_argument("--only", metavar="SUBSTRING",
                   help="run only the points whose id contains SUBSTRING, e.g. 'dsv3-4l/features-on' or 'kernel/'")
    c = sub.add_parser("compare", epilog=EPILOG, help="compare two run records and write the report (no GPU)",
                       description="Compare a run record with a baseline record; write report.md and plots.")
    c.add_argument("run", type=Path, metavar="RUN.json", help="the run record to judge")
    c.add_argument("baseline", type=Path, metavar="BASELINE.json", help="the reference run record")
    c.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for report.md and the plots")
    return p


def read_record(path: Path) -> dict:
    return cmp.check_record(read_json(path, "record"), str(path))


def judge(out_dir: Path, run: dict, baseline: dict | None) -> int:
    """Compare, write the report, print the verdict; the exit status."""
    comparison = cmp.compare(run, baseline or {"points": {}})
    paths = report.write_report(out_dir, run, baseline, comparison)
    regressions, failures = cmp.regressions(comparison), cmp.failures(run)
    for r in regressions:
        print(f"REGRESSION {r.point} {r.metric}: {r.change * 100:+.1f}% (tolerance {r.tolerance * 100:.1f}%)")
    for pid, err in failures.items():
        print(f"FAILED {pid}: {err.splitlines()[0] if err else ''}")
    print(f"{len(regressions)} regressions, {len(failures)} failed points; report: {paths[0]}")
    return EXIT_REGRESSION if regressions or failures else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "compare":
            run, baseline = read_record(args.run), read_record(args.baseline)
            make_dir(args.out)
            return judge(args.out, run, baseline)
        config = cfg.load(args.config)
        baseline = read_record(args.baseline) if args.baseline else None
        make_dir(args.out)
        if baseline and args.only:  # points left out on purpose are not "missing"
            baseline["points"] = {k: v for k, v in baseline["points"].items() if runner.selected(k, args.only)}
        command = shlex.join(["python", "-m", "sglang_h20.nightly", *(sys.argv[1:] if argv is None else argv)])
        record = runner.run(config, args.out, models=args.models, repeats=args.repeats, only=args.only,
                            command=command)
        return judge(args.out, record, baseline)
    except ValueError as e:  # ConfigError and bad records are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
