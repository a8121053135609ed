"""Nsight Compute around a profiling child: run it under ncu, read the report back as rows and a per-launch summary.

Why one module: each profiler (profile_mla_decode.py, profile_grouped_gemm.py) only knows how to build and launch
its kernels inside NVTX ranges named "profile"; finding ncu, the ncu command (clocks left alone: METHOD.md), and
reading the details page are the same for all of them.
"""
from __future__ import annotations

import csv
import glob
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

# (section, metric) pairs every summary shows, when the report has them
HEADLINE = [
    ("GPU Speed Of Light Throughput", "Duration"),
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("GPU Speed Of Light Throughput", "Memory Throughput"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("Compute Workload Analysis", "Executed Ipc Active"),
    ("Memory Workload Analysis", "Mem Busy"),
    ("Memory Workload Analysis", "Max Bandwidth"),
    ("Occupancy", "Achieved Occupancy"),
    ("Launch Statistics", "Registers Per Thread"),
    ("Launch Statistics", "Grid Size"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("Scheduler Statistics", "Issued Warp Per Scheduler"),
]
NCU_GLOBS = ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu")


def find_ncu(name: str) -> str | None:
    """ncu on PATH, else the newest of the usual install places (the GPU host's image installs Nsight Compute
    under /opt/nvidia; its PATH may not name it)."""
    found = shutil.which(name)
    if found or name != "ncu":
        return found
    hits = sorted(h for g in NCU_GLOBS for h in glob.glob(g))
    return hits[-1] if hits else None


def require_ncu(name: str) -> str | None:
    """find_ncu, or None after saying on stderr that Nsight Compute is needed."""
    found = find_ncu(name)
    if found is None:
        print(f"{name} not found (PATH, {', '.join(NCU_GLOBS)}): Nsight Compute is needed", file=sys.stderr)
    return found


def parse_details(csv_text: str) -> list[dict]:
    """ncu --page details --csv rows -> [{kernel, id, section, metric, unit, value}] (value a float when it is one)."""
    rows = []
    for r in csv.DictReader(io.StringIO(csv_text)):
        value = (r.get("Metric Value") or "").replace(",", "")
        try:
            value = float(value)
        except ValueError:
            pass
        rows.append({"kernel": r.get("Kernel Name", ""), "id": r.get("ID", ""), "section": r.get("Section Name", ""),
                     "metric": r.get("Metric Name", ""), "unit": r.get("Metric Unit", ""), "value": value})
    return rows


def summarize(rows: list[dict], raw_metrics=()) -> dict:
    """Per profiled kernel launch (`ID: kernel`): the HEADLINE metrics and those of `raw_metrics` present."""
    out: dict = {}
    wanted = set(HEADLINE)
    raw = set(raw_metrics)
    for r in rows:
        key = f"{r['id']}: {r['kernel'][:80]}"
        if (r["section"], r["metric"]) in wanted or r["metric"] in raw:
            out.setdefault(key, {})[r["metric"]] = [r["value"], r["unit"]]
    return out


def table(summary: dict) -> str:
    lines = []
    for key, metrics in summary.items():
        lines.append(key)
        for name, (value, unit) in metrics.items():
            lines.append(f"    {name:72s} {value} {unit}")
    return "\n".join(lines)


def add_ncu_args(ap) -> None:
    """The options every profiler here shares (profile_to_json reads them): the section set, the per-instruction
    stall samples, the executable, the time limit, and the hidden --child flag."""
    import argparse

    ap.add_argument("--set", default="full", help="ncu --set (full: every section; detailed/basic are quicker)")
    ap.add_argument("--source-hotspots", action="store_true",
                    help="also the per-SASS-instruction stall samples: each kernel's top instructions in the JSON, "
                         "the whole source page as OUT/source_sass.csv.xz")
    ap.add_argument("--ncu", default="ncu", help="the ncu executable")
    ap.add_argument("--timeout-s", type=float, default=420.0,
                    help="limit of each ncu call, seconds (default: %(default)s)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def profile(ncu: str, child_cmd: list[str], report: Path, raw_metrics: list[str], section_set: str,
            timeout_s: float, console: Path) -> dict | None:
    """Run `child_cmd` under ncu (only its "profile/" NVTX ranges, clocks left alone), write `report`.ncu-rep and the
    console log; returns {command, rows, summary, raw_csv}, or None when ncu failed (the log says why)."""
    rep = report.with_suffix(".ncu-rep")
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--nvtx", "--nvtx-include", "profile/",
           "--set", section_set, "--import-source", "no", "--metrics", ",".join(raw_metrics), "-f", "-o",
           str(rep.with_suffix("")), *child_cmd]
    print(" ".join(cmd), flush=True)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    console.write_text(run.stdout + run.stderr)
    print(run.stdout[-4000:] + run.stderr[-2000:], flush=True)
    if run.returncode != 0 or not rep.exists():
        print(f"ncu exited {run.returncode}; report {'missing' if not rep.exists() else 'written'}", flush=True)
        return None
    details = subprocess.run([ncu, "--import", str(rep), "--page", "details", "--csv", "--print-units", "base"],
                             capture_output=True, text=True, timeout=timeout_s)
    raw = subprocess.run([ncu, "--import", str(rep), "--page", "raw", "--csv", "--metrics", ",".join(raw_metrics)],
                         capture_output=True, text=True, timeout=timeout_s)
    rows = parse_details(details.stdout)
    return {"command": " ".join(cmd), "set": section_set, "rows": rows, "summary": summarize(rows, raw_metrics),
            "raw_csv": raw.stdout[-200000:]}


def source_hotspots(ncu: str, rep: Path, out: Path, timeout_s: float, top: int = 40) -> list[dict]:
    """Per-SASS-instruction stall samples of every kernel in `rep` (the full set's source counters): the whole CSV
    xz-compressed to `out`, and per kernel the `top` instructions by warp-stall samples (their columns as ncu names
    them). Why: the section summaries say a kernel's warps wait, not on which instruction (session 45: the CUDA
    grouped GEMM's math warps stalled on "wait" and "long scoreboard" where DeepGEMM's did not)."""
    import csv
    import io
    import lzma

    run = subprocess.run([ncu, "--import", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                         capture_output=True, text=True, timeout=timeout_s)
    out.write_bytes(lzma.compress((run.stdout + run.stderr).encode()))
    kernels, header, rows, label = [], None, [], ""

    def close():  # a kernel's block: its top instructions, with the columns that say where and why
        key = next((h for h in header or () if h.startswith("Warp Stall Sampling (All")), None)
        if not (key and rows) or any(k["kernel"] == label[:300] for k in kernels):  # ncu may print a kernel twice
            return

        def num(r):
            return float((r.get(key) or "0").replace(",", "") or 0)

        def keep(h, v):
            return (h in ("Address", "Source", "Instructions Executed") or h.startswith("Warp Stall")
                    or (h.startswith("stall_") and v not in ("", "0", "-")))

        kernels.append({"kernel": label[:300], "samples": sum(num(r) for r in rows),
                        "top": [{h: v for h, v in r.items() if keep(h, v)}
                                for r in sorted(rows, key=num, reverse=True)[:top]]})

    for line in run.stdout.splitlines():
        cells = next(csv.reader(io.StringIO(line)), [])
        if "Source" in cells and any(c.startswith("Warp Stall Sampling") for c in cells):
            close()
            header, rows = cells, []
        elif header and len(cells) == len(header):
            rows.append(dict(zip(header, cells)))
        elif line.strip():  # a kernel's name line ("Kernel Name","void ...")
            close()
            header, rows, label = None, [], cells[1] if cells[:1] == ["Kernel Name"] and len(cells) > 1 else line
    close()
    return kernels


def profile_to_json(args, child_cmd: list[str], name: str, raw_metrics: list[str], point: dict,
                    details: bool = True, **extra) -> int:
    """A profiler's parent: run `child_cmd` under ncu (args.ncu, args.set, args.timeout_s), write
    args.out/<name>.ncu-rep and args.out/profile_<name>.json (provenance, `point`, `extra`, the ncu command, summary,
    raw metrics and, with `details`, every details row), print the summary. Exit code: 0, 1 (ncu failed), 2 (no ncu)."""
    from sglang_h20 import provenance

    args.out.mkdir(parents=True, exist_ok=True)
    ncu = require_ncu(args.ncu)
    if ncu is None:
        return 2
    got = profile(ncu, child_cmd, args.out / f"{name}.ncu-rep", raw_metrics, args.set, args.timeout_s,
                  args.out / "ncu_console.log")
    if got is None:
        return 1
    record = {**provenance.record(), "benchmark": f"profile_{name}", "point": point, **extra,
              "ncu": {"command": got["command"], "set": got["set"], "clock_control": "none"},
              "summary": got["summary"], **({"details": got["rows"]} if details else {}), "raw_csv": got["raw_csv"]}
    if args.source_hotspots:
        record["source_hotspots"] = source_hotspots(ncu, args.out / f"{name}.ncu-rep", args.out / "source_sass.csv.xz",
                                                    args.timeout_s)
    path = args.out / f"profile_{name}.json"
    path.write_text(json.dumps(record, separators=(",", ":")))
    print(table(got["summary"]))
    print(f"wrote {path} and {args.out / f'{name}.ncu-rep'}")
    return 0
