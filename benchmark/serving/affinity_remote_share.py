#!/usr/bin/env python3
"""Expert-affinity placement measured in the server: the share of dispatched tokens that leave their GPU.

Issue 9 asks for it against upstream EPLB on the same workload. One server per arm, EP = DP attention = every
visible GPU, SGLang's EPLB on (`--enable-eplb`, rebalance every --rebalance-iterations passes), observation at
--fraction. The arms differ only in `--eplb-algorithm`: `deepseek` (upstream) or `affinity` (ours, with
SGLANG_H20_EPLB=affinity). Each runs a warm-up (as many requests of the same lengths, as /generate calls) long enough
for rebalances, then a measured bench_serving run.
The quantity is `remote_share` of the sampled passes after the last rebalance of the warm-up (observe.stages):
per rank and MoE layer, the share of the rank's routed (token, expert) pairs whose expert lives on another rank.

The same servers also measure what a rebalance costs decode (issue 9's migration bullet, in the real server):
  - upstream's blocking rebalances log `[EPLBManager] rebalance end time=...s`: the stall, recorded per rank
    and rebalance (`rebalance_stall_s`), and the measured bench's median / P99 ITL;
  - arm `<algorithm>+async` (e.g. `deepseek+async`) turns on our asynchronous migration
    (SGLANG_H20_EPLB_ASYNC=on): its rebalances log how many forward passes they spanned instead of a stall, and
    the wall time between pass boundaries during the rebalance against the 512 passes before it (p50 / p99 / max;
    `async_p99_ratio_max`, the worst rank and rebalance over windows of >= 100 passes), and the same over decode
    passes only (`async_decode_p99_ratio_max`: issue 9's "p99 step <= 1.05x steady"; prefill passes, ~10x
    longer, are the p99 of all passes in a serving bench);
  - arm `none` runs without EPLB: the steady ITL to compare both with.

Caveat: the dummy model's random weights give routing without co-activation structure (every token of a layer
picks nearly the same experts: the dummy correction bias outweighs the dummy logits), the structure affinity
placement exploits. `--router-clusters S` rewrites every MoE gate after the dummy load so that experts co-activate
in seeded random clusters of S (sglang_h20.eplb.dummy_router; the same for every arm): a synthetic router on the
real server path, labelled so in the record (`router_clusters`).

usage: affinity_remote_share.py --model DIR --out DIR [--gpus 2] [--fraction 0.01] [--server-args "..."]
       affinity_remote_share.py --plot-from RECORD.json   (the figure of a stored record, RECORD.png)
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import time
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.abstats import quantile_ratio_ci95
from sglang_h20.cliargs import non_negative_int, positive_float, positive_int, read_json
from sglang_h20.eplb import async_rebalance
from sglang_h20.nightly.serving import Server, write_sharegpt
from sglang_h20.observe import export

REBALANCE_LINE = re.compile(r"\[EPLBManager\] rebalance start|eplb_async: rebalance start")
STALL_LINE = re.compile(r"\[EPLBManager\] rebalance end time=([0-9.]+)s")
ASYNC_END_LINE = re.compile(r"eplb_async: rebalance \S+ end: (\d+) layers switched over (\d+) forward passes")
WORK_LINE = re.compile(r"eplb_async: rebalance \S+ end: .*boundary work on the decode thread: mean ([0-9.]+) us, "
                       r"max ([0-9.]+) ms(?: \(at switches: max ([0-9.]+) ms\))?")
PASS_LINE = re.compile(r"eplb_async: rebalance (\S+) (pass|decode pass) intervals: "
                       r"during p50 ([0-9.]+) p99 ([0-9.]+) max ([0-9.]+) ms \((\d+)\), "
                       r"before p50 ([0-9.]+) p99 ([0-9.]+) max ([0-9.]+) ms \((\d+)\)")


MIN_P99_PASSES = 100  # a p99 over fewer passes is their maximum: such windows are recorded, not judged


def judged(window: dict) -> bool:
    """A rebalance's interval window (during / before) long enough on both sides for its p99 to mean one."""
    return min(window["during"]["n"], window["before"]["n"]) >= MIN_P99_PASSES

# arm suffix -> SGLANG_H20_EPLB_ASYNC_LAUNCH, _VERIFY, _SHUFFLE, _PEER ("verify" reads every expert twice: its own
# arm, so the plain arms' pass intervals stay clean; "shuffle": every rebalance a full re-placement, several per
# server; "peer": NVLink transfers pulled over CUDA IPC instead of NCCL send/recv, posted by the transfer thread since
# session 17 when the plan needs no process group, as on one node). Session 16's runs named the NCCL arm
# "async-shuffle-nccl" and the peer arm "async-shuffle" (peer copies were the default then).
ASYNC_MODES = {"": None, "async": ("boundary", "off", "off", "off"), "async-thread": ("thread", "off", "off", "off"),
               "async-verify": ("boundary", "on", "off", "off"), "async-shuffle": ("boundary", "off", "on", "off"),
               "async-verify-shuffle": ("boundary", "on", "on", "off"),
               "async-shuffle-peer": ("boundary", "off", "on", "on"),
               "async-verify-shuffle-peer": ("boundary", "on", "on", "on")}
VERIFY_LINE = re.compile(r"eplb_async: rebalance (\S+) verify: (\d+) slots of \d+ layers bit-identical|"
                         r"eplb_async: rebalance (\S+) verify: (\d+) of (\d+) slots differ")


def rebalances(log: str, gpus: int) -> int:
    """Rebalances a server log shows started: every rank logs each one (records before 2026-11-30's session 12
    counted the lines, i.e. rebalances x ranks)."""
    return len(REBALANCE_LINE.findall(log)) // max(1, gpus)


def rebalance_costs(log: str) -> dict:
    """From a server log: upstream's blocking stalls (s, one per rank and rebalance), our asynchronous
    rebalances' (layers switched, forward passes spanned) and their pass intervals against the steady ones before."""
    stalls = [float(x) for x in STALL_LINE.findall(log)]
    spans = [[int(a), int(b)] for a, b in ASYNC_END_LINE.findall(log)]
    window = lambda p50, p99, top, n: {"p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(top), "n": int(n)}
    lines = PASS_LINE.findall(log)
    passes, decode = ([{"id": m[0], "during": window(*m[2:6]), "before": window(*m[6:10]),
                        "p99_ratio": float(m[3]) / float(m[7])} for m in lines if m[1] == kind]
                      for kind in ("pass", "decode pass"))
    verify = [{"id": m[0], "slots": int(m[1]), "mismatched": 0} if m[0] else
              {"id": m[2], "slots": int(m[4]), "mismatched": int(m[3])} for m in VERIFY_LINE.findall(log)]
    out = {"rebalance_stall_s": stalls, "async_rebalances": spans, "async_pass_intervals": passes}
    work = [{"mean_us": float(a), "max_ms": float(b), **({"switch_max_ms": float(c)} if c else {})}
            for a, b, c in WORK_LINE.findall(log)]
    if work:  # what our boundary work (posting, switching) took on the decode thread, per rank and rebalance
        out["async_boundary_work"] = work
    if decode:  # the same over decode passes only (prefill passes are the p99 of all passes in a serving bench)
        out["async_decode_intervals"] = decode
    if verify:  # issue 9: after migration every expert's weights bit-identical on its new GPU (per rank)
        out["async_verify"] = verify
    # issue 9: p99 step during a re-placement <= 1.05x steady (per rank and rebalance, the worst), over windows
    # of at least MIN_P99_PASSES passes each: a p99 of fewer is their maximum (one prefill pass decides it)
    for key, windows in (("async_p99_ratio_max", passes), ("async_decode_p99_ratio_max", decode)):
        ratios = [x["p99_ratio"] for x in windows if judged(x)]
        if ratios:
            out[key] = max(ratios)
    if stalls:
        out["rebalance_stall_ms_median"] = 1e3 * statistics.median(stalls)
        out["rebalance_stall_ms_max"] = 1e3 * max(stalls)
    return out


def pooled_decode_p99(dump: Path) -> list[dict]:
    """Per rebalance: decode-pass p99 during the move over the p99 before it, both ranks' raw intervals pooled
    (`eplb_async_<id>_rank<r>.json`, dumped by the server), with a bootstrap 95% interval; one rank's window
    (~400 passes, its p99 the 4th-largest) cannot tell 1.05 from 1.3. The ranks run the same steps, so their
    intervals are not independent: the interval is somewhat narrow."""
    by_id: dict[str, list[dict]] = {}
    for f in sorted(dump.glob("eplb_async_*_rank*.json")):
        r = json.loads(f.read_text())
        by_id.setdefault(r["id"], []).append(r)
    out = []
    for mid, ranks in by_id.items():
        during = [x for r in ranks for x in r["decode_during"]]
        before = [x for r in ranks for x in r["decode_before"]]
        if min(len(during), len(before)) >= MIN_P99_PASSES:  # the raw intervals kept too (0.01 ms), for re-analysis
            entry = {"id": mid, "ranks": len(ranks), **quantile_ratio_ci95(during, before),
                     "decode_during_ms": [round(x, 2) for x in during],
                     "decode_before_ms": [round(x, 2) for x in before],
                     **by_phase([r["passes"] for r in ranks if r.get("passes")]),
                     **placement_timeline(ranks)}
            if all("decode_after_decode_during" in r for r in ranks):  # decode passes right after a decode pass
                after = [[x for r in ranks for x in r[f"decode_after_decode_{w}"]] for w in ("during", "before")]
                entry["after_decode"] = quantile_ratio_ci95(*after)
                entry["after_decode_during_ms"], entry["after_decode_before_ms"] = (
                    [round(x, 2) for x in xs] for xs in after)
            out.append(entry)
    if len(out) > 1:  # several full re-placements (e.g. an async-shuffle arm): one ratio over all of them
        out.append({"id": "all", "rebalances": [p["id"] for p in out], **_pooled(out)})
    return out


def _pooled(moves: list[dict]) -> dict:
    """The decode-pass p99 ratio over several re-placements' stored intervals (`pooled_decode_p99` entries), and
    over those right after a decode pass where every entry has them."""
    pool = lambda key: [x for p in moves for x in p[key]]  # noqa: E731
    out = quantile_ratio_ci95(pool("decode_during_ms"), pool("decode_before_ms"))
    if all("after_decode_during_ms" in p for p in moves):
        out["after_decode"] = quantile_ratio_ci95(pool("after_decode_during_ms"), pool("after_decode_before_ms"))
    return out


def pooled_by_arm(arms: dict) -> dict:
    """Per arm run on several servers (--repeat: keys A, A#2, ...), the decode-pass p99 ratio over every re-placement
    of all its servers, pooled as `pooled_decode_p99` pools one server's: all decode passes, and those right after a
    decode pass; with the servers' count."""
    groups: dict[str, list[dict]] = {}
    for key, r in arms.items():
        groups.setdefault(key.split("#")[0], []).append(r)
    out = {}
    for arm, servers in groups.items():
        moves = [p for r in servers for p in r.get("async_decode_p99_pooled", []) if p.get("id") != "all"]
        if len(servers) >= 2 and moves:
            out[arm] = {"servers": len(servers), "rebalances": len(moves), **_pooled(moves)}
    return out


def placement_timeline(ranks: list[dict]) -> dict:
    """Per rank, the placement thread's steps and the passes that ended while it ran or before the migration
    started ([end ms, interval ms, decode?], the job's creation = 0), to line slow passes up with the steps."""
    out = {}
    for r in ranks:
        p = r.get("passes") or {}
        if "end_ms" not in p:
            continue
        early = [[e, ms, d] for e, ms, d, ph in zip(p["end_ms"], p["ms"], p["decode"], p["phase"])
                 if ph != "migration"]
        out[str(r.get("rank"))] = {"steps": p.get("placement_steps", []), "passes": early}
    return {"placement_timeline": out} if out else {}


def by_phase(passes: list[dict]) -> dict:
    """The decode passes of one rebalance (ranks pooled) per phase (placement, start, migration) and at the
    boundaries that switched layers: count, p50, p99 (nearest rank), max and the 5 slowest, to tell which part
    of a rebalance its slow passes fall in. Passes slower than the idle gap (a server waiting) are left out."""
    groups: dict[str, list[float]] = {}
    for p in passes:
        for ms, decode, phase, switch in zip(p["ms"], p["decode"], p["phase"], p["switch"]):
            if decode and ms <= 1e3 * async_rebalance.TUNING.idle_gap_s:  # the server's own rule (pass_intervals)
                groups.setdefault(phase, []).append(ms)
                if switch:
                    groups.setdefault("switch", []).append(ms)
    if not groups:
        return {}
    return {"decode_by_phase": {k: {**async_rebalance.interval_summary(v), "slowest_ms": sorted(v)[-5:][::-1]}
                                for k, v in groups.items()}}


def pooled_line(arm: dict) -> str:
    """`r1 1.12 [0.98, 1.31]`, one per pooled rebalance: ratio and 95% interval, and where the dump has them the
    same over decode passes right after a decode pass and its phases' decode p99 / max (`{placement 9.1/45.0 ms}`)."""
    def phases(p):
        ph = p.get("decode_by_phase") or {}
        return " {" + ", ".join(f"{k} {v['p99_ms']:.1f}/{v['max_ms']:.1f} ms" for k, v in ph.items()) + "}" \
            if ph else ""

    def after(p):
        a = p.get("after_decode") or {}
        return f" (after a decode pass {a['ratio']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}])" \
            if a.get("ratio") is not None else ""

    return ", ".join(f"{p['id']} {p['ratio']:.3f} [{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}]{after(p)}{phases(p)}"
                     for p in arm.get("async_decode_p99_pooled", [])) or "none"


def arm_setup(arm: str, gpus: int, rebalance_iterations: int) -> tuple[list[str], dict]:
    """Server flags and plugin env of an arm: `none`, an EPLB algorithm, `<algorithm>+async` (our migration,
    transfers posted by the decode loop) or `<algorithm>+async-thread` (posted by a background thread)."""
    algo, _, mode = arm.partition("+")
    if mode not in ASYNC_MODES:
        raise ValueError(f"arm {arm!r}: want ALGORITHM, ALGORITHM+async[{'|'.join(m for m in ASYNC_MODES if m)}] "
                         "or none")
    args = ["--tp", str(gpus), "--ep-size", str(gpus), "--enable-dp-attention", "--dp", str(gpus)]
    env = {}
    if algo != "none":
        args += ["--enable-eplb", "--eplb-algorithm", algo, "--eplb-rebalance-num-iterations",
                 str(rebalance_iterations)]
    if algo == "affinity":
        env["SGLANG_H20_EPLB"] = "affinity"
    if mode:
        env["SGLANG_H20_EPLB_ASYNC"] = "on"
        keys = ("SGLANG_H20_EPLB_ASYNC_LAUNCH", "SGLANG_H20_EPLB_ASYNC_VERIFY", "SGLANG_H20_EPLB_ASYNC_SHUFFLE",
                "SGLANG_H20_EPLB_ASYNC_PEER")
        env.update(zip(keys, ASYNC_MODES[mode]))
    return args, env


def summarize(records: list[dict], after_ts: float) -> dict:
    """Means over the sampled passes after `after_ts`: the remote share of (token, expert) pairs (overall and per
    rank), and, where the records carry them, the share of tokens that leave their GPU and the other GPUs a token
    is sent to (the quantities placement can lower: under DP attention a token's rank does not follow its experts,
    so with balanced load about (EP-1)/EP of the pairs are remote whatever the placement)."""
    per_rank: dict[int, list[float]] = {}
    token: dict[str, list[float]] = {"token_leave_share": [], "remote_copies_per_token": []}
    for r in records:
        if r.get("kind", "stages") != "stages" or r.get("ts", 0.0) < after_ts or not r.get("remote_share"):
            continue
        per_rank.setdefault(int(r.get("rank", 0)), []).append(statistics.fmean(r["remote_share"]))
        for key, xs in token.items():
            if r.get(key):
                xs.append(statistics.fmean(r[key]))
    flat = [x for xs in per_rank.values() for x in xs]
    out = {"samples": len(flat), "remote_share_mean": statistics.fmean(flat) if flat else None,
           "per_rank": {str(k): statistics.fmean(v) for k, v in sorted(per_rank.items())}}
    bad = sum(not 0.0 <= x <= 1.0 for x in token["token_leave_share"])
    if bad:  # a share outside [0, 1] is a broken read-out, not a measurement: no mean is reported
        out["token_records_out_of_range"] = bad
    else:
        out.update({key + "_mean": statistics.fmean(xs) for key, xs in token.items() if xs})
    return out


def eplb_algorithms() -> list[str]:
    """--eplb-algorithm values: SGLang's (auto and its EplbAlgorithm enum) and ours (affinity)."""
    try:
        from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm

        upstream = [a.name for a in EplbAlgorithm]
    except Exception:  # another SGLang: do not second-guess it
        return []
    return ["affinity", "auto", *upstream]


def arm_valid(arm: str) -> bool:
    algo, _, mode = arm.partition("+")
    known = eplb_algorithms()
    return arm == "none" or (mode in ASYNC_MODES and (not known or algo in known))


def run_arm(a, arm: str, data: Path, key: str | None = None, port: int = 32400) -> dict:
    """One server of `arm`; `key` names its folder under --out (default: the arm)."""
    out = a.out / (key or arm)
    dump = out / "observe"
    dump.mkdir(parents=True, exist_ok=True)
    arm_args, arm_env = arm_setup(arm, a.gpus, a.rebalance_iterations)
    args = shlex.split(a.server_args) + arm_args
    env = {"SGLANG_H20_OBSERVE": str(a.fraction), "SGLANG_H20_OBSERVE_DIR": str(dump.resolve()), **arm_env}
    if a.router_clusters:  # every arm: the same workload
        env["SGLANG_H20_DUMMY_ROUTER_CLUSTERS"] = str(a.router_clusters)
    srv = Server(a.model, args, out / "server.log", env=env, port=port, hang_s=a.hang_s)
    try:
        with srv:
            # the warm-up: the same requests' worth of passes (rebalances before the measurement), sent as
            # /generate calls: no bench_serving client to start (~20 s of the device call each)
            srv.warm_up(a.prompts, a.input_len, a.output_len, a.concurrency)
            split = time.time()
            rebalances_before = rebalances((out / "server.log").read_text(errors="replace"), a.gpus)
            bench = srv.bench(out / "measure.jsonl", num_prompts=a.prompts, input_len=a.input_len,
                              output_len=a.output_len, concurrency=a.concurrency, dataset_path=str(data))
            time.sleep(3)  # the last samples' dump lines
            if srv.hung:
                raise RuntimeError(srv.hung)
    except Exception as e:  # a failed or hung arm is a result too: the next arm still runs
        log = (out / "server.log").read_text(errors="replace") if (out / "server.log").exists() else ""
        stacks = stack_dump(log)
        if stacks:  # the whole dump beside the log (scripts/gpu_check.sh brings it back), its head in the record
            (out / "stacks.txt").write_text("\n".join(stacks[:STACKS_FILE_LINES]) + "\n")
        return {"error": f"{type(e).__name__}: {str(e)[:2000]}", "hung": srv.hung, **rebalance_costs(log),
                "stacks": stacks[:STACKS_RECORD_LINES], "server_args": args, "env": env}
    log = (out / "server.log").read_text(errors="replace")
    res = summarize(export.read_dump([dump]), split)
    pooled = pooled_decode_p99(dump)
    if pooled:  # issue 9's p99 bound, both ranks pooled, with its 95% interval
        res["async_decode_p99_pooled"] = pooled
    return {**res, "rebalances_in_warmup": rebalances_before, "rebalances_total": rebalances(log, a.gpus),
            **rebalance_costs(log), "output_throughput": bench.get("output_throughput"),
            "median_itl_ms": bench.get("median_itl_ms"), "p99_itl_ms": bench.get("p99_itl_ms"),
            "server_args": args, "env": env}


STACKS_RECORD_LINES, STACKS_FILE_LINES = 1500, 4000


def stack_dump(log: str) -> list[str]:
    """faulthandler's thread stacks in a server log (after a hang watch dump or a crash): from the first to the end."""
    lines = log.splitlines()
    keep = [i for i, ln in enumerate(lines) if ln.startswith(("Thread 0x", "Current thread 0x", "Fatal Python"))]
    return lines[keep[0]:] if keep else []


def write_record(a, arms: dict) -> None:
    rec = {**provenance.record(), "benchmark": "affinity_remote_share", "model": a.model, "gpus": a.gpus,
           "fraction": a.fraction, "rebalance_iterations": a.rebalance_iterations,
           "router_clusters": a.router_clusters, "arms": arms,
           "arms_requested": a.arms}
    pooled = pooled_by_arm(arms)
    if pooled:
        rec["decode_p99_pooled_by_arm"] = pooled
    up, ours = arms.get("deepseek", {}).get("remote_share_mean"), arms.get("affinity", {}).get("remote_share_mean")
    if up and ours is not None:
        rec["affinity_over_deepseek"] = ours / up
    up, ours = (arms.get(a, {}).get("token_leave_share_mean") for a in ("deepseek", "affinity"))
    if up and ours is not None:  # the "tokens that leave their GPU", ours over upstream's
        rec["token_leave_affinity_over_deepseek"] = ours / up
    (a.out / "affinity_remote_share.json").write_text(json.dumps(rec, indent=1))
    try:
        plot_record(rec, a.out / "affinity_remote_share.png")
    except ImportError as e:
        print(f"  (no plot: {e})")


def plot_record(rec: dict, path: Path) -> None:
    """ITL per arm (median, P99) and upstream's blocking stalls next to them: what a rebalance costs decode; where
    the record has them, the share of tokens that leave their GPU per arm (what placement can lower), and our
    rebalances' decode-pass p99 during the move over the p99 before it (per rank, windows of >= MIN_P99_PASSES
    passes), against the issue's 1.05."""
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    arms = {n: r for n, r in rec["arms"].items() if r.get("median_itl_ms") is not None}
    leave = {n: r["token_leave_share_mean"] for n, r in rec["arms"].items()
             if r.get("token_leave_share_mean") is not None}
    moves = [(f"{n}\n{w['id']} #{k}", w["p99_ratio"]) for n, r in rec["arms"].items()
             for k, w in enumerate(r.get("async_decode_intervals", [])) if judged(w)]
    panels = 2 + bool(leave) + bool(moves)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax1, ax2, *more = axes
    if leave:
        ax = more.pop(0)
        ax.bar(range(len(leave)), list(leave.values()), 0.6)
        for i, v in enumerate(leave.values()):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(range(len(leave))), list(leave))
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("tokens with an expert on another GPU (share)")
        ax.set_title(f"tokens leaving their GPU, sampled decode passes (router clusters "
                     f"{rec.get('router_clusters', 0)})", fontsize=9)
    if moves:
        ax = more.pop(0)
        ax.bar(range(len(moves)), [v for _, v in moves], 0.6)
        ax.axhline(1.05, ls="--", c="k", lw=1, label="1.05 (issue 9)")
        ax.set_xticks(list(range(len(moves))), [m for m, _ in moves], fontsize=7)
        ax.set_ylabel("decode-pass p99: during move / before")
        ax.set_title("our rebalances, per rank (passes that extend on any rank left out)", fontsize=9)
        ax.legend(fontsize=8)
    x = range(len(arms))
    ax1.bar([i - 0.2 for i in x], [r["median_itl_ms"] for r in arms.values()], 0.4, label="median")
    ax1.bar([i + 0.2 for i in x], [r["p99_itl_ms"] for r in arms.values()], 0.4, label="P99")
    ax1.set_xticks(list(x), list(arms), rotation=15)
    ax1.set_ylabel("ITL of the measured bench (ms)")
    ax1.legend()
    stalls = {n: [1e3 * v for v in r.get("rebalance_stall_s", [])] for n, r in rec["arms"].items()}
    stalls = {n: v for n, v in stalls.items() if v}
    for i, (n, v) in enumerate(stalls.items()):
        ax2.scatter([i] * len(v), v, alpha=0.6, label=f"{n}: {len(v)} (rank, rebalance)")
    ax2.set_xticks(list(range(len(stalls))), list(stalls))
    ax2.set_ylabel("blocking rebalance stall (ms)")
    ax2.set_title("upstream's stalls (ours: none, by design)", fontsize=9)
    if stalls:
        ax2.legend(fontsize=8)
    fig.suptitle(f"EP {rec['gpus']}, rebalance every {rec['rebalance_iterations']} passes, {rec.get('gpu')}, "
                 f"{rec.get('git_commit')}, {str(rec.get('date'))[:10]}", fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot-from", type=Path, metavar="JSON",
                    help="only draw a stored record's figure (next to it, .png), no server run")
    ap.add_argument("--model", help="model folder (e.g. scripts/make_model.py's, dummy weights); needed to run")
    ap.add_argument("--out", type=Path,
                    help="output folder: affinity_remote_share.json and one folder per arm (server log, dumps)")
    ap.add_argument("--gpus", type=int, default=2,
                    help="GPUs per server: TP = EP = DP attention size (default: %(default)s)")
    ap.add_argument("--fraction", type=float, default=0.01, help="observed share of decode passes")
    ap.add_argument("--rebalance-iterations", type=int, default=200,
                    help="forward passes between EPLB rebalances (--eplb-rebalance-num-iterations; "
                         "default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=256,
                    help="prompts of the warm-up bench and of the measured one (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=64, help="bench_serving concurrency (default: %(default)s)")
    ap.add_argument("--input-len", type=int, default=256, help="input tokens per request (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--arms", nargs="+", default=["deepseek", "affinity"],
                    help="EPLB algorithms (deepseek: upstream's; affinity: ours), ALGORITHM+async (our migration, "
                         "transfers posted by the decode loop), ALGORITHM+async-thread (posted by a thread), "
                         "ALGORITHM+async-verify (+ every slot's bytes checked after the move), "
                         "ALGORITHM+async-shuffle (every rebalance a full re-placement: several per server), "
                         "ALGORITHM+async-verify-shuffle (both), a -peer suffix to those two (NVLink transfers pulled "
                         "over CUDA IPC by a transfer thread, not NCCL send/recv posted by the decode loop), none (no "
                         "EPLB: steady ITL)")
    ap.add_argument("--repeat", type=positive_int, default=1,
                    help="servers per arm, the arm list run this many times in turn (A B A B: drift over the call "
                         "falls on both); the second server of arm A (here or named twice in --arms) is recorded as "
                         "A#2 (default: %(default)s)")
    ap.add_argument("--router-clusters", type=non_negative_int, default=0, metavar="S",
                    help="dummy weights only: every MoE gate rewritten so that experts co-activate in seeded clusters "
                         "of S (SGLANG_H20_DUMMY_ROUTER_CLUSTERS, every arm); the dummy router alone co-activates "
                         "nothing an affinity placement could use (default: 0, off)")
    ap.add_argument("--hang-s", type=positive_float, default=90,
                    help="a bench during which the server log stays silent this long ends that arm with every "
                         "server thread's Python stack in its log and the record (default: %(default)s)")
    ap.add_argument("--server-args", default="--load-format dummy",
                    help="extra flags of every server, one string (default: %(default)s)")
    a = ap.parse_args()
    if a.plot_from:
        plot_record(read_json(a.plot_from, "affinity_remote_share: --plot-from", SystemExit),
                    a.plot_from.with_suffix(".png"))
        return 0
    if not a.model or not a.out:
        ap.error("--model and --out are needed to run the servers (or --plot-from JSON to draw a record)")
    bad = [arm for arm in a.arms if not arm_valid(arm)]
    if bad:  # before any server starts: a typo would otherwise cost a server start and a traceback
        ap.error(f"--arms: unknown {', '.join(bad)}; an arm is none, ALGORITHM or "
                 f"ALGORITHM+async[-thread|-verify|-shuffle], ALGORITHM one of {', '.join(eplb_algorithms())}")
    a.out.mkdir(parents=True, exist_ok=True)
    data = write_sharegpt(a.out / "sharegpt.json")
    arms = {}
    runs, seen = [], {}  # (arm, its record's key): an arm's second server (repeat, or named twice) is "arm#2"
    for arm in [arm for _ in range(a.repeat) for arm in a.arms]:
        seen[arm] = seen.get(arm, 0) + 1
        runs.append((arm, arm if seen[arm] == 1 else f"{arm}#{seen[arm]}"))
    for i, (arm, key) in enumerate(runs):
        arms[key] = run_arm(a, arm, data, key.replace("#", "_"), 32400 + i)
        r = arms[key]
        if "error" in r:
            print(f"  {key}: FAILED: {r['error'][:300]} ({len(r['stacks'])} stack lines kept)", flush=True)
            write_record(a, arms)
            continue
        print(f"  {key}: remote share {r['remote_share_mean']} over {r['samples']} samples, tokens leaving their "
              f"GPU {r.get('token_leave_share_mean')}, other GPUs per token {r.get('remote_copies_per_token_mean')}, "
              f"{r['rebalances_in_warmup']} rebalances before the measurement, ITL median {r['median_itl_ms']} "
              f"P99 {r['p99_itl_ms']} ms, stalls {r.get('rebalance_stall_ms_median')} ms median, "
              f"{r.get('rebalance_stall_ms_max')} max; async: {len(r['async_rebalances'])} rebalance ends, decode p99 "
              f"ratio max {r.get('async_decode_p99_ratio_max')} (ranks pooled: {pooled_line(r)}), verify mismatches "
              f"{sum(v.get('mismatched', 0) for v in r.get('async_verify', []))}", flush=True)
        write_record(a, arms)  # after every arm: a deadline that cuts the next arm keeps this one
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
