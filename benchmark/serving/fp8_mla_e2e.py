#!/usr/bin/env python3
"""The h20_fp8_mla attention backend end to end, against upstream FlashMLA with BF16 and FP8 KV caches.

Phases (each a fresh `python -m sglang.launch_server` with the same --server-args plus its own flags):
  triton         --attention-backend triton (BF16 KV): the greedy reference only, no benchmark
  ours           --attention-backend h20_fp8_mla (this plugin; FP8 latent + per-token scales)
  ours-v2        the same with version 2 of the CUDA split kernel (SGLANG_H20_FP8_MLA_KERNEL=cuda-v2)
  ours-joinq     ours with Q joined by SGLang's per-layer torch.cat as before session 32 (SGLANG_H20_FP8_MLA_SPLIT_Q=
                 off; ours reads SGLang's (latent, rope) parts in place by default)
  ours-triton    the same with the Triton decode kernel (SGLANG_H20_FP8_MLA_KERNEL=triton): the backend's own
                 cost apart from the CUDA kernels
  ours-se        ours with the MHA/MLA policy on (SGLANG_H20_MHA_MLA_POLICY=se): prefill chunks that continue a
                 request (a cached prefix under upstream's 8192-token threshold) then take MHA where the GPU's cost
                 table says so, instead of absorbed MLA on SGLang's Triton extend kernel
  flashmla       --attention-backend flashmla (BF16 KV)
  flashmla-fp8   --attention-backend flashmla --kv-cache-dtype fp8_e4m3
  flashmla-fp8-plugin  the same with this plugin loaded (every feature at its default, so FP8 MLA off): what
                 loading the plugin alone costs a server
Upstream phases run with SGLANG_PLUGINS=__none__ (plain SGLang).

Per phase: greedy ids of a few prompts (each sent twice: the second time its prefix is in the radix cache, so
prefill reads the cached KV; for ours that is the gather-and-dequantize path), their agreement with the triton
reference (matching prefix length and position-wise match rate; dummy weights make logits nearly flat, so
even two BF16 backends drift apart: the flashmla BF16 row is the noise floor to read the FP8 rows against),
then sglang.bench_serving workloads (random dataset, one wave: num-prompts = concurrency unless given), each
with the decode-only throughput read from the server log lines of that workload and its slow steps (bench_serving's
per-request gaps grouped into server steps: when the ITL tail happens, see slow_steps). A server that dies ends its
phase: the error that ended it (from its log) is recorded as server_died and the remaining workloads as skipped.

Before each measured workload the server runs it once untimed at its shapes (Server.warm_up); the call's first
phase also runs its first workload once through bench_serving untimed (--rehearse), because after the warm-up
alone the first phase of a call still stalled 0.6-1.3 s in its timed waves, whichever backend it was.

--deadline-s: after the first phase, a phase starts only if its expected startup plus its greedy step fits; a
workload runs only if its expected duration (measured in an earlier phase, or a default guess) fits. Each phase that
benchmarks gets an equal share of the time left when it starts (divided among it and the benchmarking phases after
it): past its first workload it starts another only within that share, so that the anchors measure the same
workloads in the same call (session 35: ours ran all four workloads in 480 s and both FlashMLA phases were
skipped, leaving no ratio); and a later phase runs only the workloads the first benchmarking phase measured (a
workload no earlier phase has is a number without a pair). Whatever is skipped is recorded. --reference reuses
the triton ids of an earlier run, so a budget can go to one more phase.

--merge A.json B.json ... --out DIR: one record (and summary) from runs that each did some phases, e.g. two phases
side by side on two GPUs of one host in one device call (scripts/gpu_parallel.sh); every source's provenance is
kept under "merged_from", and a phase name may come from one source only.

usage (on the GPU host, SGLang and this package on PYTHONPATH):
  python3 benchmark/serving/fp8_mla_e2e.py --model /tmp/models/dsv3-ep16-slice --out /tmp/fp8_mla_e2e --deadline-s 480
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import time
from itertools import accumulate
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.cliargs import read_json
from sglang_h20.models import random_words
from sglang_h20.nightly.serving import (
    Server, decode_throughput, graphs_up_to, log_since, output_ids, prefill_tokens, stop_servers_on_sigterm, tail,
    with_mem_fraction, write_sharegpt,
)

SERVER_ARGS = ("--load-format dummy --sampling-backend pytorch --moe-runner-backend triton --fp8-gemm-backend triton "
               "--grammar-backend none --mem-fraction-static 0.6")  # + decode graphs up to the largest concurrency
HOST_ENV = {"SGL_KERNEL_FLASHINFER": "0", "SGLANG_OPT_USE_JIT_KERNEL_GROUPED_TOPK": "1",
            "SGLANG_ENABLE_JIT_DEEPGEMM": "0"}
UPSTREAM = {"SGLANG_PLUGINS": "__none__"}
PHASES = {  # name: (extra server flags, extra env, run benchmarks)
    "triton": (["--attention-backend", "triton"], UPSTREAM, False),
    "ours": (["--attention-backend", "h20_fp8_mla"], {}, True),
    "ours-v2": (["--attention-backend", "h20_fp8_mla"], {"SGLANG_H20_FP8_MLA_KERNEL": "cuda-v2"}, True),
    "ours-se": (["--attention-backend", "h20_fp8_mla"], {"SGLANG_H20_MHA_MLA_POLICY": "se"}, True),
    "flashmla": (["--attention-backend", "flashmla"], UPSTREAM, True),
    "flashmla-fp8": (["--attention-backend", "flashmla", "--kv-cache-dtype", "fp8_e4m3"], UPSTREAM, True),
    "ours-triton": (["--attention-backend", "h20_fp8_mla"], {"SGLANG_H20_FP8_MLA_KERNEL": "triton"}, True),
    "ours-joinq": (["--attention-backend", "h20_fp8_mla"], {"SGLANG_H20_FP8_MLA_SPLIT_Q": "off"}, True),
    "flashmla-fp8-plugin": (["--attention-backend", "flashmla", "--kv-cache-dtype", "fp8_e4m3"], {}, True),
}
OPT_IN = ("ours-v2", "ours-se", "ours-triton", "ours-joinq", "flashmla-fp8-plugin")
WORKLOADS = ["4096x512@16", "4096x512@48", "1024x256@128", "4096x512@128"]  # in x out @ concurrency, by priority:
# the decode-heavy 1024x256@128 before the long 4096x512@128 (prefill-bound at 128; it also killed both FP8 servers
# on the H200, 2026-11-30, so it goes last)
# expected seconds until a phase has measured them (guesses for a 61-layer dummy DeepSeek-V3 slice on one H200)
GUESS_S = {"startup": 240.0, "greedy": 40.0, "4096x512@16": 45.0, "4096x512@48": 70.0, "4096x512@128": 120.0,
           "1024x256@128": 50.0}
TYPICAL_STARTUP_S = 75.0  # a server start with the devkit's JIT cache unpacked (sessions 35-36: 63-73 s); plan only

PROMPT_LENGTHS = (64, 320, 1600, 900, 32, 2500)
PLUGIN_MARK = "[sglang-h20 pid"
KV_MARKS = ("KV Cache is allocated", "max_total_num_tokens")  # capacity: FP8 holds about twice BF16's tokens


def parse_workload(w: str) -> tuple[int, int, int]:
    io, conc = w.split("@")
    i, o = io.split("x")
    return int(i), int(o), int(conc)


def prompts(n: int) -> list[str]:
    """n prompts of PROMPT_LENGTHS tokens: short and long contexts for the decode steps."""
    rng = random.Random(11)
    return [random_words(rng, PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]) for i in range(n)]


def agreement(ids: list[list[int]], ref: list[list[int]]) -> dict:
    """Per prompt: tokens equal to the reference before the first difference, and the share of equal positions."""
    rows = []
    for a, b in zip(ids, ref):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"matching_prefix": same, "match_rate": sum(x == y for x, y in zip(a, b)) / max(len(b), 1)})
    return {"per_prompt": rows, "mean_matching_prefix": sum(r["matching_prefix"] for r in rows) / max(len(rows), 1),
            "mean_match_rate": sum(r["match_rate"] for r in rows) / max(len(rows), 1),
            "identical": all(a == b for a, b in zip(ids, ref))}


def expected_s(workload: str, measured: dict) -> float:
    """Seconds a workload is expected to take: as an earlier phase measured it, else the guess."""
    return measured.get(workload, GUESS_S.get(workload, 120.0))


def phase_need_s(name: str, args, measured: dict) -> float:
    """Seconds a phase needs to be worth starting: its server start, its greedy step and, if it benchmarks, its
    cheapest workload. A server that can run none of them would only cost device time (session 26 started one,
    65 s, and skipped its only workload)."""
    need = measured.get("startup", GUESS_S["startup"])
    if args.prompts:
        need += measured.get("greedy", GUESS_S["greedy"])
    if PHASES[name][2] and args.workloads:
        need += min(expected_s(w, measured) for w in args.workloads)
    return need


def plan_s(args) -> tuple[float, int]:
    """(expected seconds, benchmarking phases) for every phase to run its first workload: a typical start, the greedy
    step and that workload each, plus the first phase's rehearsal. Printed up front, so that a call that cannot pair
    its phases says so before it spends the device time (session 36: three phases, 499 s; the third was skipped)."""
    benching = [p for p in args.phases if PHASES[p][2]]
    first = expected_s(args.workloads[0], {}) if args.workloads else 0.0
    total = len(args.phases) * (TYPICAL_STARTUP_S + (GUESS_S["greedy"] if args.prompts else 0.0))
    total += len(benching) * first + (first if benching and args.rehearse != "none" else 0.0)
    return total, len(benching)


class Clock:
    def __init__(self, deadline_s: float):
        self.t0, self.deadline_s = time.time(), deadline_s

    def left(self) -> float:
        return self.deadline_s - (time.time() - self.t0)


def run_phase(name: str, args, port: int, sharegpt: Path, clock: Clock, measured: dict,
              rehearse: bool = False, share_s: float | None = None, only: set | None = None) -> dict:
    """One server: greedy ids, then each workload warmed and measured. rehearse: one untimed bench_serving wave
    before the first measured workload (see --rehearse). share_s: seconds this phase may take in all (its server
    start included) before it stops starting workloads; its first workload runs regardless (see --deadline-s).
    only: the workloads it may run (None: all), those an earlier phase measured."""
    flags, env, bench = PHASES[name]
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    env = {**env, **args.server_env}
    rec: dict = {"phase": name, "flags": flags, "env": env, "skipped": []}
    t0 = time.time()
    with Server(args.model, shlex.split(args.server_args) + flags, log, env=env, port=port,
                ready_timeout_s=max(60.0, clock.left())) as srv:
        rec["server_start_s"] = srv.start_s
        measured["startup"] = max(measured.get("startup", 0.0), srv.start_s)
        t1 = time.time()
        texts = prompts(args.prompts)
        rec["ids"] = [output_ids(srv.generate(text=t, max_new_tokens=args.gen_tokens)) for t in texts]
        rec["ids_repeat"] = [output_ids(srv.generate(text=t, max_new_tokens=args.gen_tokens)) for t in texts]
        measured["greedy"] = time.time() - t1
        rec["benches"] = {}
        for i, w in enumerate(args.workloads if bench else []):
            if only is not None and w not in only:
                rec["skipped"].append(f"{w}: the first benchmarking phase did not measure it (nothing to pair with)")
                continue
            guess = expected_s(w, measured)
            if clock.left() < guess:
                rec["skipped"].append(f"{w}: {clock.left():.0f}s left < ~{guess:.0f}s expected")
                print(f"deadline: {name} {rec['skipped'][-1]}", flush=True)
                continue
            used = time.time() - t0
            if share_s is not None and rec["benches"] and used + guess > share_s:
                rec["skipped"].append(f"{w}: the phase's share of the time ({share_s:.0f}s) would be exceeded "
                                      f"({used:.0f}s used + ~{guess:.0f}s expected)")
                print(f"deadline: {name} {rec['skipped'][-1]}", flush=True)
                continue
            inp, outp, conc = parse_workload(w)
            tb = time.time()
            try:
                # the wave's prefill and decode shapes once, untimed: a kernel JIT-compiled on its first use would
                # otherwise land in the measured wave of whichever backend ran first (session 30: ~1 s of TTFT)
                warm_s = srv.warm_up(conc, inp, 8, conc)
                if rehearse:  # the first phase's first workload once more, whole and untimed (see --rehearse)
                    tr = time.time()
                    srv.bench(out / f"rehearsal-{w.replace('@', '-c')}.jsonl", num_prompts=conc, input_len=inp,
                              output_len=outp, concurrency=conc, dataset_path=str(sharegpt), seed=2,
                              timeout_s=max(60.0, clock.left()))
                    rec["rehearsal"] = {"workload": w, "wall_s": time.time() - tr}
                    rehearse = False
                before = log.stat().st_size
                r = srv.bench(out / f"bench-{w.replace('@', '-c')}.jsonl", num_prompts=args.num_prompts or conc,
                              input_len=inp, output_len=outp, concurrency=conc, dataset_path=str(sharegpt),
                              timeout_s=max(60.0, clock.left()), extra=["--output-details"])
            except Exception as e:  # a failed workload is a result too; the next one may still run
                rec["benches"][w] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
                died = srv.death()
                if died:  # the rest would only find the port closed
                    rec["server_died"] = {"during": w, "error": died}
                    rec["skipped"] += [f"{rest}: the server died during {w}" for rest in args.workloads[i + 1:]]
                    print(f"  {name}: server died during {w}: {died}", flush=True)
                    break
                continue
            measured[w] = max(measured.get(w, 0.0), time.time() - tb)
            new_log = log_since(log, before)
            rec["benches"][w] = {**{k: r.get(k) for k in ("output_throughput", "input_throughput",
                                                           "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
                                                           "median_ttft_ms", "p99_ttft_ms", "duration",
                                                           "completed")},
                                 "decode_log": decode_throughput(new_log, min_running=max(1, int(0.9 * conc))),
                                 "prefill_log": prefill_tokens(new_log), "slow_steps": slow_steps(r),
                                 "warm_up_s": warm_s, "command": r.get("command")}
            b = rec["benches"][w]
            print(f"  {name} {w}: {b['output_throughput']:.1f} tok/s out, median ITL {b['median_itl_ms']:.2f} ms, "
                  f"decode-only {b['decode_log'].get('median_tok_s')} tok/s, at most {b['decode_log']['max_running']}"
                  f" of {conc} decoding at once, {b['prefill_log']['cached_tokens']} of the prompt tokens from the "
                  f"prefix cache", flush=True)
            if b["decode_log"]["eager_lines"]:  # host time, not the kernels: see graphs_up_to
                print(f"  {name} {w}: WARNING: {b['decode_log']['eager_lines']} decode log lines without CUDA "
                      f"graphs: their steps are mostly host time", flush=True)
    text = log.read_text(errors="replace")
    rec["plugin_log_lines"] = [ln for ln in text.splitlines() if PLUGIN_MARK in ln]
    rec["kv_cache_log_lines"] = [ln for ln in text.splitlines() if any(m in ln for m in KV_MARKS)][:8]
    rec["wall_s"] = time.time() - t0
    return rec


def slow_steps(record: dict, factor: float = 1.5, top: int = 8) -> dict:
    """Where a workload's slow inter-token gaps happen, from bench_serving's --output-details (ttfts, itls).

    Every request of a one-wave run is sent at about t = 0, so a token's arrival is its request's TTFT plus the
    gaps before it; gaps that end together (within 2 ms) are one server step. Reports the steps whose median
    gap is above `factor` x the run's median gap: how many, how many requests each held up, and when, against
    the decode start (the last first token). A few whole-batch stalls and a spread of per-request gaps call for
    different fixes (session 26: ours' P99 ITL at 1024x256 @128 was 1.8x FlashMLA's, against 1.09x at the median).
    """
    ttfts, itls = record.get("ttfts") or [], record.get("itls") or []
    gaps = [(t0 + done, x) for t0, g in zip(ttfts, itls) if t0 for done, x in zip(accumulate(g), g)]
    if not gaps:
        return {}
    gaps.sort()
    median = sorted(x for _, x in gaps)[len(gaps) // 2]
    steps, cur = [], [gaps[0]]
    for end, x in gaps[1:]:
        if end - cur[-1][0] <= 0.002:
            cur.append((end, x))
        else:
            steps.append(cur)
            cur = [(end, x)]
    steps.append(cur)
    start = max(t for t in ttfts if t)
    rows = []
    for st in steps:
        mid = sorted(x for _, x in st)[len(st) // 2]
        if mid > factor * median:
            rows.append({"at_s": round(st[-1][0] - start, 3), "gap_ms": round(1e3 * mid, 2), "requests": len(st)})
    rows.sort(key=lambda r: -r["gap_ms"])
    return {"median_gap_ms": round(1e3 * median, 3), "steps": len(steps), "factor": factor, "slow_steps": len(rows),
            "slow_gaps_share": round(sum(r["requests"] for r in rows) / len(gaps), 4),
            "slowest": sorted(rows[:top], key=lambda r: r["at_s"])}


def kv_pool_full(phases: dict) -> dict:
    """Per workload, the phases whose KV pool could not hold all its requests at once (the rest queued).

    Such a phase decodes fewer requests at a time: its throughput then says as much about the pool's capacity
    (FP8 holds twice BF16's tokens in the same memory) as about its attention kernel.
    """
    full: dict = {}
    for name, p in phases.items():
        for w, b in (p.get("benches") or {}).items():
            d, conc = b.get("decode_log") or {}, parse_workload(w)[2]
            if d.get("max_queued") and d.get("max_running", conc) < conc:
                full.setdefault(w, {})[name] = (f"at most {d['max_running']} of {conc} decoding at once, "
                                                f"up to {d['max_queued']} queued")
    return full


def summarize(phases: dict, ref: list | None) -> dict:
    s: dict = {}
    if ref:
        s["greedy_agreement_vs_triton"] = {n: agreement(p["ids"], ref) for n, p in phases.items()
                                           if n != "triton" and p.get("ids")}
    s["repeat_agreement (cached prefix vs fresh prefill)"] = {
        n: agreement(p["ids_repeat"], p["ids"]) for n, p in phases.items() if p.get("ids_repeat")}
    table = {}
    for n, p in phases.items():
        for w, b in (p.get("benches") or {}).items():
            if "error" not in b:
                table.setdefault(w, {})[n] = {"output_tok_s": b["output_throughput"],
                                              "median_itl_ms": b["median_itl_ms"],
                                              # the tail: session 26's 1024x256 @128 had ours' P90/P99 ITL at
                                              # 1.2x/1.8x FlashMLA's against 1.09x at the median
                                              "p90_itl_ms": b.get("p90_itl_ms"), "p99_itl_ms": b.get("p99_itl_ms"),
                                              "slow_steps": (b.get("slow_steps") or {}).get("slow_steps"),
                                              "decode_only_tok_s": b["decode_log"].get("median_tok_s")}
    s["throughput"] = table
    def over(mine: str, key: str) -> dict:
        return {w: {other: v[mine][key] / v[other][key] for other in ("flashmla", "flashmla-fp8")
                    if other in v and v[mine][key] and v[other][key]}
                for w, v in table.items() if mine in v}

    s["server_deaths"] = {n: p["server_died"] for n, p in phases.items() if p.get("server_died")}
    s["kv_pool_full"] = kv_pool_full(phases)
    for mine in [n for n in phases if n.startswith("ours")]:  # ours, and opt-in variants as <name>_...
        s[f"{mine}_over"] = over(mine, "output_tok_s")
        # output tok/s carries each workload's prefill too; the server's decode-only rate is the attention kernel's
        s[f"{mine}_decode_over"] = over(mine, "decode_only_tok_s")
        lines = phases[mine].get("plugin_log_lines", [])  # did that server really run our backend?
        s[f"{mine}_backend_selected"] = any("fp8_mla: attention backend h20_fp8_mla" in ln for ln in lines)
        s[f"{mine}_fallback_lines"] = [ln for ln in lines if "fall" in ln or "upstream" in ln]
    # the same FlashMLA FP8 server with and without the plugin loaded: what loading it alone costs
    s["plugin_loaded_over"] = {w: {k: v["flashmla-fp8-plugin"][k] / v["flashmla-fp8"][k]
                                   for k in ("output_tok_s", "decode_only_tok_s", "median_itl_ms")
                                   if v["flashmla-fp8-plugin"][k] and v["flashmla-fp8"][k]}
                               for w, v in table.items() if "flashmla-fp8-plugin" in v and "flashmla-fp8" in v}
    return s


def plot(record: dict, path: Path) -> str | None:
    """Median ITL and decode-only tok/s per workload, one bar per phase (the summary's throughput table).
    Returns why no plot was written, or None."""
    table = record["summary"].get("throughput") or {}
    if not table:
        return "no workload finished: nothing to plot"
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    names = [n for n in PHASES if any(n in v for v in table.values())]
    workloads = list(table)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(names), 1)
    for ax, key, label in ((axes[0], "median_itl_ms", "median ITL (ms), lower is better"),
                           (axes[1], "decode_only_tok_s", "decode-only tok/s (server log), higher is better")):
        for i, n in enumerate(names):
            xs = [j + i * width for j in range(len(workloads))]
            vals = [(table[w].get(n) or {}).get(key) for w in workloads]
            bars = ax.bar(xs, [v or 0.0 for v in vals], width, label=n)
            ax.bar_label(bars, labels=["n/a" if v is None else (f"{v:.0f}" if key.endswith("tok_s") else f"{v:.1f}")
                                       for v in vals], fontsize=7)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(workloads))], workloads)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    gpu = record.get("gpu") or "?"
    commits = sorted({str(m.get("git_commit"))[:7] for m in record.get("merged_from", [])}
                     or {str(record.get("git_commit"))[:7]})  # a merge: the runs' commits, not the merge's
    fig.suptitle(f"h20_fp8_mla vs upstream FlashMLA, {Path(str(record.get('model'))).name}, {gpu}, "
                 f"commit {', '.join(commits)}\n(n/a: not run, the server died, or it never decoded 90% of the "
                 f"concurrency at once)", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    return None


def write_record(record: dict, out: Path) -> Path:
    """fp8_mla_e2e.json and its PNG in out."""
    path = out / "fp8_mla_e2e.json"
    path.write_text(json.dumps(record, indent=1))
    try:  # the JSON is what counts; a plotting failure is reported, not raised
        why = plot(record, out / "fp8_mla_e2e.png")
    except Exception as e:
        why = f"plot failed: {type(e).__name__}: {e}"
    print(why or f"wrote {out / 'fp8_mla_e2e.png'}")
    return path


def merge_records(records: list[dict], sources: list[str]) -> dict:
    """One fp8_mla_e2e record from several (see --merge): their phases side by side, the summary recomputed (greedy
    agreement against whichever source ran the triton phase), each source's provenance under merged_from."""
    models = {r["model"] for r in records}
    if len(models) != 1:
        raise ValueError(f"records from different models: {sorted(models)}")
    phases: dict = {}
    for r, src in zip(records, sources):
        for name, ph in r["phases"].items():
            if name in phases:
                raise ValueError(f"phase {name!r} is in more than one record ({src})")
            phases[name] = ph
    ref = phases["triton"]["ids"] if "triton" in phases else None
    prompts = min((len(p.get("ids") or []) for p in phases.values()), default=0)
    summary = summarize(phases, ref[:prompts] if ref else None)
    if ref is None:  # sources that ran with --reference keep the agreement they computed against it
        carried = {n: a for r in records
                   for n, a in (r.get("summary", {}).get("greedy_agreement_vs_triton") or {}).items()}
        if carried:
            summary = {"greedy_agreement_vs_triton": carried, **summary}
    references = sorted({r["reference"] for r in records if r.get("reference")})
    keep = ("command", "git_commit", "gpu", "date", "versions", "server_args", "workloads", "wall_s")
    # the merge runs anywhere (a CPU box): where every source ran on the same GPU and versions, say so at the top
    measured_on = {k: records[0].get(k) for k in ("gpu", "gpu_capability", "versions")
                   if all(r.get(k) == records[0].get(k) for r in records)}
    return {**provenance.record(), **measured_on, "benchmark": "fp8_mla_e2e", "model": models.pop(),
            "merged_from": [{"source": src, **{k: r.get(k) for k in keep}} for r, src in zip(records, sources)],
            "skipped": [s for r in records for s in r.get("skipped", [])  # a phase skipped in one run, run in another
                        if not any(s.startswith(f"phase {n}:") for n in phases)],
            "errors": {k: v for r in records for k, v in r.get("errors", {}).items()},
            "reference": "triton phase" if ref else (", ".join(references) or None),
            "summary": summary, "phases": phases}


def read_record(path: Path, flag: str) -> dict:
    """An earlier fp8_mla_e2e.json; SystemExit with one line when it is not one."""
    rec = read_json(path, f"fp8_mla_e2e: {flag}", SystemExit)
    if not isinstance(rec, dict) or "model" not in rec or not isinstance(rec.get("phases"), dict):
        raise SystemExit(f"fp8_mla_e2e: {flag} {path}: not an fp8_mla_e2e.json record")
    return rec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=False, help="model dir (required unless --merge)")
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder: fp8_mla_e2e.json and one folder per phase (server log, benches)")
    ap.add_argument("--phases", nargs="+", default=[p for p in PHASES if p not in OPT_IN], choices=list(PHASES),
                    help=f"{', '.join(OPT_IN)} are opt-in: one more server start each")
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, help="INxOUT@CONCURRENCY, in order of priority")
    ap.add_argument("--num-prompts", type=int, default=0, help="per workload (default: its concurrency, one wave)")
    ap.add_argument("--server-args", default=SERVER_ARGS,
                    help="flags of every phase's server, one string; without a CUDA-graph flag in it, "
                         "--cuda-graph-max-bs <the largest workload concurrency> is added (default: %(default)s)")
    ap.add_argument("--mem-fraction-static", type=float, default=None, metavar="F",
                    help="replace the server flags' --mem-fraction-static (default: theirs on a GPU of >= 100 GiB, "
                         "else 0.88: the dsv3-ep16-slice weights need more than 0.74 of an 80 GB H100)")
    ap.add_argument("--prompts", type=int, default=4,
                    help="greedy prompts per phase, each sent twice; 0 skips the greedy step, e.g. when a call has "
                         "room for two phases of a long workload only (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="greedy tokens per prompt (default: %(default)s)")
    ap.add_argument("--rehearse", choices=["first", "every", "none"], default="first",
                    help="one whole untimed bench_serving wave before the first measured workload of the call's "
                         "first phase (every: of each phase). The warm-up alone left the first phase of a call a "
                         "0.6-1.3 s TTFT stall in its timed waves, whichever backend it was (2026-12-02/03) "
                         "(default: %(default)s)")
    ap.add_argument("--deadline-s", type=float, default=480.0,
                    help="seconds for the whole run: later phases and workloads start only if they fit "
                         "(default: %(default)s)")
    ap.add_argument("--server-env", nargs="+", default=[], metavar="KEY=VALUE",
                    help="extra environment for every phase's server, e.g. CUDA_LAUNCH_BLOCKING=1 to name the "
                         "kernel behind a CUDA fault (slow: for a crash repro, not for timing)")
    ap.add_argument("--reference", type=Path, help="an earlier fp8_mla_e2e.json: reuse its triton greedy ids "
                                                     "(same model and prompts) instead of running the triton phase")
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="combine these fp8_mla_e2e.json records into --out/fp8_mla_e2e.json (no server runs)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.merge:
        try:
            record = merge_records([read_record(p, "--merge") for p in args.merge], [str(p) for p in args.merge])
        except ValueError as e:  # mixed models, a phase in two records
            raise SystemExit(f"fp8_mla_e2e: --merge: {e}") from None
        args.out.mkdir(parents=True, exist_ok=True)
        write_record(record, args.out)
        print(json.dumps(record["summary"], indent=1))
        return 0
    if not args.model:
        ap.error("--model is required (unless --merge)")
    if any("=" not in kv for kv in args.server_env):
        ap.error("--server-env takes KEY=VALUE words")
    args.server_env = dict(kv.split("=", 1) for kv in args.server_env)
    args.server_args = graphs_up_to(args.server_args, max(parse_workload(w)[2] for w in args.workloads))
    args.server_args = with_mem_fraction(args.server_args, args.mem_fraction_static)
    for k, v in HOST_ENV.items():
        os.environ.setdefault(k, v)
    stop_servers_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    sharegpt = write_sharegpt(args.out / "sharegpt.json")
    clock, measured, phases, skipped, errors = Clock(args.deadline_s), {}, {}, [], {}
    plan, plan_benching = plan_s(args)
    print(f"plan: {len(args.phases)} phases ({plan_benching} benchmarking) need ~{plan:.0f}s to each run "
          f"{args.workloads[0] if args.workloads else 'no workload'}"
          + (f"; over --deadline-s {args.deadline_s:.0f}: expect the last phases to be skipped (fewer phases per call, "
             f"or --merge two calls' records)" if plan > args.deadline_s else ""), flush=True)
    paired = None  # the workloads of the first phase that benchmarked: what later phases may run
    ref = None
    if args.reference:
        old = read_record(args.reference, "--reference")
        ref = (old.get("phases", {}).get("triton") or {}).get("ids")
        if not ref:
            raise SystemExit(f"fp8_mla_e2e: --reference {args.reference}: no triton phase ids in it")
        if old.get("model") != args.model or len(ref) < args.prompts:
            raise SystemExit(f"fp8_mla_e2e: --reference {args.reference}: from another model "
                             f"({old.get('model')}) or fewer prompts ({len(ref)}) than this run's")
        args.phases = [p for p in args.phases if p != "triton"]
    for i, name in enumerate(args.phases):
        need = phase_need_s(name, args, measured)
        if (phases or errors) and clock.left() < need:  # the first phase always runs
            skipped.append(f"phase {name}: {clock.left():.0f}s left < ~{need:.0f}s for startup, greedy and a workload")
            print(f"deadline: {skipped[-1]}", flush=True)
            continue
        benching = [p for p in args.phases[i:] if PHASES[p][2]]
        share_s = clock.left() / len(benching) if PHASES[name][2] else None
        try:
            first = not phases and not errors
            phases[name] = run_phase(name, args, 30100 + i, sharegpt, clock, measured,
                                     rehearse=args.rehearse == "every" or (args.rehearse == "first" and first),
                                     share_s=share_s, only=paired)
            if PHASES[name][2] and paired is None:
                # none measured (e.g. its server died at once): the next benchmarking phase is the first
                paired = {w for w, b in phases[name].get("benches", {}).items() if "error" not in b} or None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {str(e)[-3000:]}"
            print(f"phase {name} failed: {errors[name]}\n{tail(args.out / name / 'server.log', 40)}", flush=True)
    if ref is None and "triton" in phases:
        ref = phases["triton"]["ids"]
    record = {**provenance.record(), "benchmark": "fp8_mla_e2e", "model": args.model, "server_args": args.server_args,
              "host_env": {k: os.environ.get(k) for k in HOST_ENV}, "workloads": args.workloads,
              "num_prompts": args.num_prompts or "= concurrency", "deadline_s": args.deadline_s,
              "wall_s": time.time() - clock.t0, "skipped": skipped + [f"{n}: {s}" for n, p in phases.items()
                                                                      for s in p["skipped"]],
              "reference": str(args.reference) if args.reference else "triton phase",
              "errors": errors, "summary": summarize(phases, ref[:args.prompts] if ref else None), "phases": phases}
    path = write_record(record, args.out)
    print(json.dumps(record["summary"], indent=1))
    print(f"wrote {path}")
    return 1 if errors or ("ours" in args.phases and "ours" not in phases) else 0


if __name__ == "__main__":
    raise SystemExit(main())
