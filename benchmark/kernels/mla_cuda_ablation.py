#!/usr/bin/env python3
"""Where the time of the CUDA MLA decode split kernels goes: ablation builds timed against the default build.

Each variant is a split kernel (version 1 or 2, sgl_kernel_ext/csrc/mla_fp8_decode_sm90*.cu) compiled with -D
switches that each remove one part of its work, keeping every barrier, so nothing hangs. The results are wrong by
design. The "Ablations" paragraph of the v2 .cu's header says exactly what each switch removes:
  NO_TRANSPOSE  the V^T transposes              NO_SOFTMAX  the softmax math (P' = e4m3(S))
  NO_PV         the P'V wgmmas                  NO_QK       the QK^T wgmmas
  NO_LOAD       the K tile loads after the first 3 stages (no HBM / L2 traffic)
  NO_MERGE      the per-tile O rescale + add (P'V accumulates straight into O)
  EMPTY         the whole split kernel (what is left: the launch, the Q pre-pass, the combine kernel)
  A+B           several at once; ALL = every NO_* switch (the synchronization skeleton); ALL-X = all but X (X alone)
  MLA_...       a design option (sgl_kernel_ext.mla_decode_cuda.DESIGN_OPTIONS, by its full -D name): the same
                results (or sums reordered), timed against the default like a variant; combines with the switches

How to read the deltas. "saved" = default us - variant us: what that part costs when it is removed. A part that
runs overlapped with other work saves ~0 when removed alone, although it is not free: remove its partner too (A+B),
or compare ALL-X (only X left) with ALL: us(ALL-X) - us(ALL) is what X costs on its own. The deltas need not add up
to the total: parts overlap, and removing one can move the critical path to another. A saving within the noise
(the spread of the default, timed first and last for each point and version) is no saving; a negative one is noise
or a schedule made worse by the removal.
EMPTY is the fixed cost outside the split kernel; us(ALL) - us(EMPTY) is the synchronization skeleton's own cost.
ns/tile = us x SMs / (batch x row blocks x context / 64): the average SM time per 64-token tile of a 64-row block
(the unit of the cycle model in the v2 header; times the SM clock in GHz: cycles), fixed costs included.

Timing: as bench_mla_decode.py times "ours-cuda" (its build_sets, _decode_calls and time_calls): the median of
triton's do_bench over CUDA-graph replays, input sets rotated past the L2, the Q pre-pass and the combine kernel
inside. Every variant is built first (nvcc, in parallel), then timed in a child process, so a variant that faults
(a device trap poisons the CUDA context) costs only itself: its error is recorded and a new child runs the rest.

Output: a table per point on stdout; --json OUT: {"provenance", "variants" (name -> defines), "rows": one per point,
version and variant (us, saved_us, saved_frac, default_us, noise_us, ns_per_tile, or the error)}.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))
import bench_mla_decode as bench  # noqa: E402  (also puts python/ and sgl-kernel-ext/ of the checkout on sys.path)

DEFAULT_POINTS = ["64x4096", "64x16384", "128x4096", "128x16384"]
_PARTS = ["NO_TRANSPOSE", "NO_SOFTMAX", "NO_PV", "NO_QK", "NO_LOAD", "NO_MERGE"]
# each part removed; the tensor-core and the CUDA-core parts together; only the skeleton; each part alone; nothing
DEFAULT_VARIANTS = [*_PARTS, "NO_QK+NO_PV", "NO_TRANSPOSE+NO_SOFTMAX+NO_MERGE", "ALL",
                    *(f"ALL-{p}" for p in _PARTS), "EMPTY"]
PREFIX = "MLA_ABLATE_"
ROWS_PER_CTA = 64


def parse_point(text: str) -> tuple[int, int, int, int]:
    """BATCHxCONTEXT[xHEADS[xQ_LEN]] -> (batch, context, heads, q_len); heads 128 and q_len 1 by default."""
    parts = text.lower().split("x")
    if not 2 <= len(parts) <= 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"point {text!r}: want BATCHxCONTEXT[xHEADS[xQ_LEN]], e.g. 64x4096x128x1")
    b, ctx, h, t = [int(p) for p in parts] + [128, 1][len(parts) - 2:]
    return b, ctx, h, t


def _switches() -> list[str]:
    import importlib
    return [a[len(PREFIX):] for a in importlib.import_module("sgl_kernel_ext.mla_decode_cuda").ABLATIONS]


def _options() -> tuple[str, ...]:
    import importlib
    return importlib.import_module("sgl_kernel_ext.mla_decode_cuda").DESIGN_OPTIONS


def parse_variant(spec: str, switches: list[str], options=(), prefix: str = PREFIX) -> tuple[str, ...]:
    """'NO_QK+NO_PV' -> the sorted -D names (`prefix` + switch); ALL = every NO_* switch; '-X' takes X out again; a
    name in `options` (a design option's full -D name) is taken as it is. grouped_gemm_cuda_ablation.py parses its
    GG_ABLATE_ switches with it too."""
    terms = re.findall(r"([+-]?)([A-Za-z_][A-Za-z0-9_]*)", spec)
    if not terms or "".join(s + n for s, n in terms) != spec.replace(" ", ""):
        raise ValueError(f"variant {spec!r}: want names joined by + or -, e.g. NO_QK+NO_PV or ALL-NO_LOAD")
    names: set[str] = set()
    for sign, name in terms:
        name = name.upper()
        if name == "ALL":
            group = {prefix + s for s in switches if s.startswith("NO_")}
        elif name in switches:
            group = {prefix + name}
        elif name in options:
            group = {name}
        else:
            raise ValueError(f"variant {spec!r}: unknown switch {name} (have {', '.join(switches)}, ALL"
                             f"{', ' + ', '.join(options) if options else ''})")
        names = names - group if sign == "-" else names | group
    if not names:
        raise ValueError(f"variant {spec!r} removes nothing (the default is always timed)")
    return tuple(sorted(names))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--points", type=parse_point, nargs="+", default=[parse_point(p) for p in DEFAULT_POINTS],
                    metavar="BxCTX[xH[xT]]", help=f"default: {' '.join(DEFAULT_POINTS)} (128 heads, q_len 1)")
    ap.add_argument("--versions", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                    help="split-kernel versions to ablate (default: both)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, metavar="SPEC",
                    help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    ap.add_argument("--json", type=Path, help="write the results object here (also after each child process)")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench rep per variant (ms)")
    ap.add_argument("--max-sets", type=int, default=8, help="rotating input sets at most")
    ap.add_argument("--deadline-s", type=float, default=0, help="start no timing after this many seconds (0: none)")
    ap.add_argument("--in-process", action="store_true", help="no child processes (a fault then ends the run)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # jobs file of a child process
    args = ap.parse_args(argv)
    switches = _switches()
    try:
        args.variant_defines = {"default": ()}
        for spec in args.variants:
            args.variant_defines[spec] = parse_variant(spec, switches, _options())
    except ValueError as e:
        ap.error(str(e))
    return args


def jobs_for(args) -> list[dict]:
    """Timing order: point by point (the inputs are made once per point), per version the default first and last."""
    jobs = []
    for point in args.points:
        for v in args.versions:
            for name in ["default", *args.variants, "default"]:
                jobs.append({"id": len(jobs), "point": list(point), "version": v, "variant": name,
                             "defines": list(args.variant_defines[name])})
    return jobs


def build_all(jobs) -> dict[tuple, str]:
    """Every (version, defines) library, nvcc in parallel; the build errors by key."""
    import importlib
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    keys = sorted({(j["version"], tuple(j["defines"])) for j in jobs})
    errors = {}

    def one(key):
        try:
            cu.build(verbose=False, version=key[0], defines=key[1])
        except Exception as e:
            errors[key] = f"{type(e).__name__}: {str(e)[:2000]}"
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=max(1, min(len(keys), os.cpu_count() or 1))) as ex:
        list(ex.map(one, keys))
    print(f"built {len(keys) - len(errors)}/{len(keys)} libraries in {time.time() - t0:.0f} s", flush=True)
    for key, why in errors.items():
        print(f"build failed: v{key[0]} {' '.join(key[1])}: {why.splitlines()[0][:300]}", flush=True)
    return errors


# --- the timing (child process, or this one with --in-process) ----------------------------------------------------

def run_jobs(jobs, rep_ms, max_sets, deadline, emit) -> bool:
    """Time the jobs in order, emit(result) each; False when the CUDA context is no longer usable (stop here)."""
    import importlib

    import torch
    import triton
    import triton.testing  # noqa: F401

    mla = importlib.import_module("sgl_kernel_ext.mla_decode")
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0) or bench.L2_BYTES_FALLBACK
    cur, sets, metas = None, None, None
    for job in jobs:
        if deadline and time.time() > deadline:
            emit({**job, "error": "not run: deadline"})
            continue
        batch, ctx, heads, q_len = job["point"]
        try:
            if tuple(job["point"]) != cur:
                sets = metas = None
                torch.cuda.empty_cache()
                sets = bench.build_sets(torch, mla, batch, ctx, heads, q_len, max_sets, l2_bytes)
                metas = [cu.get_mla_decode_metadata(s["cache_seqlens"], heads, q_len, max_seqlen=ctx) for s in sets]
                cur = tuple(job["point"])
            ok, why = cu.available(job["version"], job["defines"])
            if not ok:
                raise RuntimeError(why)
            decode = functools.partial(cu.mla_decode_fp8_cuda, version=job["version"], defines=job["defines"])
            calls, _ = bench._decode_calls(torch, sets, metas, decode)
            us, mode = bench.time_calls(torch, triton, calls, rep_ms)
            res = {**job, "us": us, "timing": mode, "num_splits": metas[0].num_splits, "input_sets": len(sets),
                   "sms": props.multi_processor_count}
            print(f"B={batch} ctx={ctx} H={heads} T={q_len} v{job['version']} {job['variant']:36s} {us:9.1f} us",
                  flush=True)
        except Exception as e:
            traceback.print_exc()
            res = {**job, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        emit(res)
        if "error" in res:
            try:
                torch.cuda.synchronize()
            except Exception:  # a device fault: every later CUDA call of this process fails too
                return False
    return True


def child_main(path: Path, args) -> int:
    spec = json.loads(path.read_text())
    out = open(spec["out"], "a")

    def emit(res):
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0 if run_jobs(spec["jobs"], args.rep_ms, args.max_sets, spec["deadline"], emit) else 3


def run_children(jobs, args, deadline, save) -> dict[int, dict]:
    """Children time the jobs in order; after a child that stops early, the job it was on is recorded as failed
    (unless it said why itself) and a new child takes the rest. Three failed children in a row end the run."""
    results: dict[int, dict] = {}
    fails = 0
    with tempfile.TemporaryDirectory(prefix="mla_ablation_") as tmp:
        out = Path(tmp) / "results.jsonl"
        out.touch()
        while len(results) < len(jobs):
            todo = [j for j in jobs if j["id"] not in results]
            if fails >= 3:
                for j in todo:
                    results[j["id"]] = {**j, "error": "not run: three child processes in a row failed"}
                break
            spec = Path(tmp) / "jobs.json"
            spec.write_text(json.dumps({"jobs": todo, "out": str(out), "deadline": deadline}))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec), "--rep-ms", str(args.rep_ms),
                   "--max-sets", str(args.max_sets)]
            timeout = max(deadline - time.time(), 0) + 300 if deadline else None
            try:
                rc = subprocess.run(cmd, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            before = len(results)
            for line in out.read_text().splitlines():
                res = json.loads(line)
                results.setdefault(res["id"], res)
            left = [j for j in jobs if j["id"] not in results]
            if left and rc == 3 and len(results) > before:  # the child recorded the fault itself
                fails = 0
            elif left:
                results[left[0]["id"]] = {**left[0], "error": f"the child process ended (rc {rc}) during this job"}
                fails = fails + 1 if len(results) == before + 1 else 0
            save(results)
    return results


# --- the report -----------------------------------------------------------------------------------------------------

def summarize(jobs, results) -> list[dict]:
    """One row per (point, version, variant): us, and against the default's mean: saved_us, saved_frac."""
    rows = []
    groups: dict[tuple, list[dict]] = {}
    for j in jobs:
        groups.setdefault((tuple(j["point"]), j["version"]), []).append(results.get(j["id"], {**j, "error": "lost"}))
    for (point, version), res in groups.items():
        batch, ctx, heads, q_len = point
        base = [r["us"] for r in res if r["variant"] == "default" and "us" in r]
        default_us = sum(base) / len(base) if base else None
        noise = max(base) - min(base) if len(base) > 1 else None
        tiles = batch * math.ceil(heads * q_len / ROWS_PER_CTA) * math.ceil(ctx / bench.PAGE)
        for name in dict.fromkeys(r["variant"] for r in res):  # the default once: the mean of its runs
            r = next((x for x in res if x["variant"] == name and "us" in x), None) or \
                next(x for x in res if x["variant"] == name)
            row = {"batch": batch, "context": ctx, "heads": heads, "q_len": q_len, "version": version,
                   "variant": name, "defines": r["defines"], "default_us": default_us, "noise_us": noise}
            if name == "default":
                row["default_runs_us"] = base
            if "us" in r:
                us = default_us if name == "default" else r["us"]
                row.update(us=us, timing=r["timing"], num_splits=r["num_splits"], input_sets=r["input_sets"],
                           ctas=math.ceil(heads * q_len / ROWS_PER_CTA) * r["num_splits"] * batch,
                           ns_per_tile=us * 1e3 * r["sms"] / tiles)
                if default_us:
                    row.update(saved_us=default_us - us, saved_frac=(default_us - us) / default_us)
            else:
                row["error"] = r["error"]
            rows.append(row)
    return rows


def print_table(rows, versions, variants) -> None:
    def cell(r):
        if r is None:
            return f"{'-':>9s} {'':>8s} {'':>6s}"
        if "error" in r:
            return f"{'ERROR':>9s} {'':>8s} {'':>6s}"
        if r["variant"] == "default":
            noise = f"±{r['noise_us']:.1f}" if r.get("noise_us") is not None else ""
            return f"{r['us']:9.1f} {noise:>8s} {'':>6s}"
        if r.get("saved_us") is None:
            return f"{r['us']:9.1f} {'':>8s} {'':>6s}"
        return f"{r['us']:9.1f} {r['saved_us']:8.1f} {100 * r['saved_frac']:5.1f}%"

    for point in dict.fromkeys((r["batch"], r["context"], r["heads"], r["q_len"]) for r in rows):
        mine = {(r["version"], r["variant"]): r for r in rows if (r["batch"], r["context"], r["heads"],
                                                                   r["q_len"]) == point}
        info = []
        for v in versions:
            d = mine.get((v, "default"))
            if d and "us" in d:
                info.append(f"v{v}: {d['num_splits']} splits, {d['ctas']} CTAs, {d['ns_per_tile']:.0f} ns/tile")
        print(f"\nB={point[0]} ctx={point[1]} H={point[2]} T={point[3]}  " + "; ".join(info))
        print(f"{'variant':36s}" + "".join(f" {'v%d us' % v:>9s} {'saved':>8s} {'%':>6s}" for v in versions))
        for name in ["default", *variants]:
            print(f"{name:36s}" + "".join(" " + cell(mine.get((v, name))) for v in versions))
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"error: B={r['batch']} ctx={r['context']} v{r['version']} {r['variant']}: {r['error']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, args)
    import torch

    if not torch.cuda.is_available():
        print("mla_cuda_ablation: needs a CUDA GPU (Hopper, sm_90) and nvcc; nothing timed", file=sys.stderr)
        return 2
    from sglang_h20.provenance import record

    t0 = time.time()
    deadline = t0 + args.deadline_s if args.deadline_s else 0
    jobs = jobs_for(args)
    build_errors = build_all(jobs)
    results = {j["id"]: {**j, "error": f"build failed: {build_errors[(j['version'], tuple(j['defines']))]}"}
               for j in jobs if (j["version"], tuple(j["defines"])) in build_errors}
    prov = record()

    def save(res):
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "provenance": prov, "variants": args.variant_defines, "rows": summarize(jobs, res),
                "complete": len(res) == len(jobs) and all("error" not in r for r in res.values()),
                "how": "bench_mla_decode.time_calls (median of do_bench over CUDA-graph replays, input sets rotated "
                       "past the L2; Q pre-pass + combine inside); saved_us = default mean - variant; noise_us = "
                       "spread of the default timed first and last"}, indent=1))

    todo = [j for j in jobs if j["id"] not in results]
    if args.in_process:
        run_jobs(todo, args.rep_ms, args.max_sets, deadline, lambda r: results.setdefault(r["id"], r))
    else:
        results.update(run_children(todo, args, deadline, lambda r: save({**results, **r})))
    save(results)
    rows = summarize(jobs, results)
    print_table(rows, args.versions, args.variants)
    print(f"\n{len(jobs)} timings in {time.time() - t0:.0f} s" + (f"; JSON: {args.json}" if args.json else ""))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
