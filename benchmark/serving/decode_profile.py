#!/usr/bin/env python3
"""Where does a decode step's time go with each attention backend? Torch-profiler traces of steady decode steps.

Why: end to end our h20_fp8_mla backend decodes 4-9% slower than FlashMLA FP8 (fp8_mla_e2e, session 30) although at
16 heads its kernel (version 3) is faster than FlashMLA FP8's in the kernel grid: on dsv3-tp8-4l a step took
~0.15 ms more (~39 us per layer), so something besides the attention kernel costs more. This times every kernel of
the same decode steps under each backend and lists the kernels whose per-step totals differ most.

One server per arm (fp8_mla_e2e.py's phases: ours, flashmla, flashmla-fp8, triton), the same flags otherwise. Per
arm: a warm-up request, then --batch requests of --input-len tokens that generate --output-len tokens each; once the
server's log shows all of them decoding, /start_profile profiles --steps decode steps (SGLang's per-stage profiler:
it stops by itself), and the trace is summarised per step: the GPU kernel time, the kernels' wall span (first start
to last end; a span well above the kernel time is host or launch gaps), the launches, the top kernels and CPU ops.
The kernels are then compared with the first arm's. Traces stay in OUT/<arm>/.

usage: decode_profile.py --model DIR --out DIR [--arms ours flashmla-fp8 | ours ours+swapab] [--table FILE]
                         [--batch 32] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import threading
import time
from pathlib import Path

from sgl_kernel_ext.gemm_table import TABLE_ENV
from sglang_h20 import provenance
from sglang_h20.models import random_words
from sglang_h20.nightly.serving import (
    DECODE_LINE, Server, graphs_up_to, log_since, stop_servers_on_sigterm, with_mem_fraction,
)

from fp8_mla_e2e import HOST_ENV, PHASES, SERVER_ARGS
from trace_summary import compare, load_trace, summarize, wait_for_traces

STAGE = "DECODE"  # SGLang's per-stage profiler names the decode trace <profile_id>-TP-0-DECODE.trace.json.gz
FEATURE_ENV = {"swapab": {"SGLANG_H20_SWAPAB": "on"}, "sbo": {"SGLANG_H20_SBO": "on"}}  # "+name" on an arm


def arm_setup(name: str, table: Path | None = None) -> tuple[list[str], dict]:
    """(server flags, env) of an arm: one of fp8_mla_e2e.py's phases, optionally with plugin features on, e.g.
    'ours+swapab' (the step's dense and MoE GEMMs are most of it at small batches: session 55). table: the
    grouped-GEMM table a '+swapab' arm uses instead of the one the plugin finds for this GPU."""
    phase, *features = name.split("+")
    if phase not in PHASES:
        raise ValueError(f"unknown arm {name!r}: the phase before '+' is one of {', '.join(PHASES)}")
    flags, env, _ = PHASES[phase]
    unknown = [f for f in features if f not in FEATURE_ENV]
    if unknown:
        raise ValueError(f"unknown feature {unknown[0]!r} in arm {name!r} (known: {', '.join(FEATURE_ENV)})")
    if features and env.get("SGLANG_PLUGINS") == "__none__":
        raise ValueError(f"arm {name!r}: phase {phase!r} runs without the plugin, so '+{features[0]}' would do nothing")
    env = {**env, **{k: v for f in features for k, v in FEATURE_ENV[f].items()}}
    if table is not None and "swapab" in features:
        env[TABLE_ENV] = str(Path(table).resolve())
    return flags, env


def arm_name(text: str) -> str:
    """argparse type for --arms: the name as given, once arm_setup accepts it."""
    try:
        arm_setup(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def all_decoding(log_text: str, batch: int) -> bool:
    """Whether a 'Decode batch' line of log_text shows at least batch requests running."""
    return any(int(m["running"]) >= batch for m in DECODE_LINE.finditer(log_text))


def kernel_span_ms(events: list[dict]) -> float:
    """First kernel start to last kernel end (ms): the GPU's wall time over the profiled steps."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel" and "dur" in e and "ts" in e]
    return (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3 if spans else 0.0


def profile_arm(name: str, args, port: int) -> dict:
    flags, env = arm_setup(name, args.table)
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    texts = [random_words(random.Random(i), args.input_len) for i in range(args.batch)]
    rec: dict = {"arm": name, "flags": flags, "env": env}
    with Server(args.model, shlex.split(args.server_args) + flags, log, env=env, port=port,
                ready_timeout_s=args.ready_timeout_s) as srv:
        rec["server_start_s"] = srv.start_s
        srv.generate_batch(texts[:1], max_new_tokens=8)  # first-call compiles out of the way
        mark = log.stat().st_size
        done: dict = {}
        worker = threading.Thread(target=lambda: done.setdefault(
            "r", srv.generate_batch(texts, max_new_tokens=args.output_len)), daemon=True)
        worker.start()
        deadline = time.time() + args.wait_s
        while time.time() < deadline:
            if all_decoding(log_since(log, mark), args.batch):
                break
            time.sleep(0.2)
        else:
            rec["error"] = f"never saw {args.batch} requests decoding within {args.wait_s:.0f}s"
            worker.join()
            return rec
        srv.post("/start_profile", {"output_dir": str(out.resolve()), "num_steps": args.steps,
                                    "profile_by_stage": True, "profile_stages": ["decode"],
                                    "activities": ["CPU", "GPU"], "profile_id": name})
        files = wait_for_traces(out, timeout_s=args.wait_s, match=STAGE)
        worker.join()
    if not files:
        rec["error"] = f"no {STAGE} trace under {out} (see {log})"
        return rec
    events = [e for p in files for e in load_trace(p)]
    span = kernel_span_ms(events)
    rec.update({"trace_files": [str(p) for p in files], "steps": args.steps,
                "gpu_span_ms_per_step": span / args.steps, **summarize(events, args.steps, unit="step")})
    return rec


def write_record(args, arms: dict) -> dict:
    """Write OUT/decode_profile.json for the arms profiled so far (kernel differences against the first arm) and
    return those differences."""
    base = args.arms[0]
    diffs = {}
    if base in arms and "error" not in arms[base]:
        for name in args.arms[1:]:
            if name in arms and "error" not in arms[name]:
                diffs[f"{name}_minus_{base}"] = compare(arms[base], arms[name])
    kept = {n: {k: v for k, v in a.items() if k != "_kernel_totals"} for n, a in arms.items()}
    rec = {**provenance.record(), "benchmark": "decode_profile", "model": args.model, "server_args": args.server_args,
           "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len, "steps": args.steps,
           "arms": kept, "kernel_differences": diffs, "arms_planned": list(args.arms)}
    (args.out / "decode_profile.json").write_text(json.dumps(rec, indent=1))
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (scripts/make_model.py's, dummy weights)")
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder: decode_profile.json, each arm's server log and trace under OUT/<arm>/")
    ap.add_argument("--arms", nargs="+", default=["ours", "flashmla-fp8"], type=arm_name,
                    help="attention backends (fp8_mla_e2e.py's phases: " + ", ".join(PHASES) + "), each optionally "
                         "with plugin features on: 'ours+swapab', 'ours+swapab+sbo'; the first arm is the one "
                         "compared (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="requests decoding together (default: %(default)s)")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens each (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=512,
                    help="tokens each generates; enough to outlast the profiled steps (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps profiled (default: %(default)s)")
    ap.add_argument("--table", type=Path, default=None,
                    help="grouped-GEMM table the '+swapab' arms use (default: the one the plugin finds for this GPU; "
                         "elsewhere than the table's GPU swapAB falls back to upstream, so name one to profile it)")
    ap.add_argument("--server-args", default=None,
                    help="server flags, one string (default: fp8_mla_e2e.py's, decode graphs up to --batch)")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="override the flags' --mem-fraction-static (default: 0.88 on GPUs below 100 GiB)")
    ap.add_argument("--wait-s", type=float, default=180, help="longest wait for the decode state and for a trace")
    ap.add_argument("--ready-timeout-s", type=float, default=600, help="longest server start")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        ap.error("--steps and --batch must be at least 1")
    if args.output_len < 4 * args.steps:
        ap.error(f"--output-len {args.output_len} is too short to decode through {args.steps} profiled steps "
                 f"after all {args.batch} requests are in (use at least {4 * args.steps})")
    if args.table is not None:
        if not args.table.is_file():
            ap.error(f"--table {args.table}: no such file")
        if not any(TABLE_ENV in arm_setup(a, args.table)[1] for a in args.arms):  # arm_setup decides who reads it
            ap.error("--table is read only by '+swapab' arms, and none is asked for")
    if args.server_args is None:
        args.server_args = with_mem_fraction(graphs_up_to(SERVER_ARGS, args.batch), args.mem_fraction_static)
    for k, v in HOST_ENV.items():  # as fp8_mla_e2e.py: the host's own settings win
        os.environ.setdefault(k, v)
    stop_servers_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    arms: dict = {}
    for i, name in enumerate(args.arms):
        arms[name] = profile_arm(name, args, port=32400 + 10 * i)
        a = arms[name]
        if "error" in a:
            print(f"  {name}: {a['error']}", flush=True)
        else:
            print(f"  {name}: {a['gpu_kernel_ms_per_step']:.3f} ms of kernels per step over a "
                  f"{a['gpu_span_ms_per_step']:.3f} ms span, {a['kernel_launches_per_step']:.0f} launches", flush=True)
        diffs = write_record(args, arms)  # after every arm: a deadline that stops the script keeps the arms done
    for key, rows in diffs.items():
        print(f"{key}, per decode step (largest kernel differences):", flush=True)
        for r in rows[:10]:
            print(f"  {r['diff_ms']:+8.4f} ms  {r['name'][:100]}", flush=True)
    return 0 if all("error" not in a for a in arms.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
