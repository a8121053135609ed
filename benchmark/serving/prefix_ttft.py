#!/usr/bin/env python3
"""TTFT with prefix-cache hits: the MHA/MLA policy against upstream's default, same run, same GPU.

For each input length L, every request is a cached shared prefix of L/2 tokens plus L/2 new
tokens, so each prefill has extend = prefix = L/2 (upstream: prefix < 8192 -> MLA; ours decides
from se and the table). Requests go one at a time (TTFT = one prefill + one token) and then in
bursts of `--burst` (one batched prefill). Phases (each a fresh server, env + extra flags):
  upstream          plugin switch at 'upstream' (the plugin is a pass-through), SGLang defaults
  se-no-prefill-graph      our policy; prefill CUDA graphs off (they pin MLA for captured sizes)
  upstream-no-prefill-graph  upstream's rule without prefill graphs: isolates the policy's effect

--one-server: instead of one server per phase, ONE server (our hook installed, prefill graphs off)
whose policy is flipped between two arms (--arms, default 'upstream' then 'se') through
SGLANG_H20_MHA_MLA_CONTROL, in ABBA blocks per length (each block: --requests single requests and 2
bursts). Server-to-server spread (12-16% here) and host load drift then cancel in the paired block
ratios; reported per length: the ratio of medians (second arm / first) and the mean paired ratio with a
t-based 95% interval.

--arms mla mha --fit-overhead: the server-level calibration of the MHA/MLA table. Both paths are forced
on the same prefills, and the once-per-prefill cost of MHA with a cached prefix is fitted from the single
requests (mha_mla.fit_mha_prefix_overhead, with the model's layer count). The table this machine uses
is written back with it, to ~/.cache/sglang_h20/ (or --table-out); start servers after this run.

usage: prefix_ttft.py --model DIR --out DIR [--lengths 1024 2048 4096] [--phases ...]
       prefix_ttft.py --model DIR --out DIR --one-server [--blocks 8] [--requests 12] [--arms upstream se]
       prefix_ttft.py --model DIR --out DIR --one-server --arms mla mha --fit-overhead [--table-out F]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.models import random_words
from sglang_h20.nightly.serving import Server

NO_PREFILL_GRAPH = ["--cuda-graph-backend-prefill", "disabled"]
PHASES = {
    "upstream": ({"SGLANG_H20_MHA_MLA_POLICY": "upstream"}, []),
    "se-no-prefill-graph": ({"SGLANG_H20_MHA_MLA_POLICY": "se"}, NO_PREFILL_GRAPH),
    "upstream-no-prefill-graph": ({"SGLANG_H20_MHA_MLA_POLICY": "upstream"}, NO_PREFILL_GRAPH),
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def measure(srv: Server, length: int, requests: int, burst: int, rng: random.Random) -> dict:
    half = length // 2
    prefix = random_words(rng, half)
    srv.generate_batch([prefix], max_new_tokens=1)  # cache the shared prefix
    srv.generate_batch([prefix + " " + random_words(rng, half)], max_new_tokens=1)  # warm this shape
    single = [timed(lambda: srv.generate_batch([prefix + " " + random_words(rng, half)], max_new_tokens=1))
              for _ in range(requests)]
    bursts = [timed(lambda: srv.generate_batch([prefix + " " + random_words(rng, half) for _ in range(burst)],
                                               max_new_tokens=1)) for _ in range(max(2, requests // 4))]
    return {"ttft_ms_single": single, "median_ttft_ms_single": statistics.median(single),
            "burst": burst, "burst_ms": bursts, "median_burst_ms": statistics.median(bursts)}


def gpu_and_layers(model: str) -> tuple[str, int]:
    """This host's GPU name (whose table the server loads) and the model's layer count (what the policy
    charges MHA's per-prefill cost against)."""
    from sglang_h20 import compat

    g = compat.gpu()
    return (g.name if g else ""), int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


def planned_choices(arms, length: int, burst: int, gpu: str, layers: int) -> dict:
    """What each arm's policy picks for this length's prefills (one request; a whole burst as one batch),
    from the same policy objects and table the server loads on this GPU: the reading key for a ratio near
    1 (both arms on the same path: the difference is noise). A burst may be scheduled as smaller batches."""
    from sglang_h20.attention import mha_mla

    half = length // 2
    out = {}
    for arm in arms:
        policy = mha_mla.named_policy(arm, gpu)
        out[arm] = {"single": policy.choose(mha_mla.BatchShape([half], [half]), layers),
                    "burst": policy.choose(mha_mla.BatchShape([half] * burst, [half] * burst), layers)}
    return out


def one_server(args) -> dict:
    """The A/B inside one server (see the module docstring)."""
    from sglang_h20.controlfile import write_control

    ctl = (args.out / "policy").resolve()
    arms = a, b = tuple(args.arms)
    write_control(ctl, a)
    env = {"SGLANG_H20_MHA_MLA_POLICY": "se", "SGLANG_H20_MHA_MLA_CONTROL": str(ctl)}
    order = [(a, b, b, a)[i % 4] for i in range(args.blocks)]  # ABBA
    res: dict = {"arms": list(arms), "order": order, "lengths": {}}
    gpu, layers = gpu_and_layers(args.model)
    with Server(args.model, shlex.split(args.server_args) + NO_PREFILL_GRAPH, args.out / "server-one.log",
                env=env, port=32100) as srv:
        rng = random.Random(5)
        for n in args.lengths:
            half = n // 2
            prefix = random_words(rng, half)
            srv.generate_batch([prefix], max_new_tokens=1)  # cache the shared prefix
            for arm in arms:  # compile / warm both paths at this shape, untimed
                write_control(ctl, arm)
                srv.generate_batch([prefix + " " + random_words(rng, half)], max_new_tokens=1)
            blocks = []
            for arm in order:
                write_control(ctl, arm)
                single = [timed(lambda: srv.generate_batch([prefix + " " + random_words(rng, half)],
                                                           max_new_tokens=1)) for _ in range(args.requests)]
                bursts = [timed(lambda: srv.generate_batch([prefix + " " + random_words(rng, half)
                                                            for _ in range(args.burst)], max_new_tokens=1))
                          for _ in range(2)]
                blocks.append({"arm": arm, "single_ms": single, "burst_ms": bursts})
            per = block_summary(blocks, arms)
            res["lengths"][str(n)] = {"blocks": blocks, **per,
                                      "planned": planned_choices(arms, n, args.burst, gpu, layers)}
            print(f"  L={n}: {b}/{a} TTFT {per['single']['ratio_of_medians']:.3f} single "
                  f"(paired {per['single']['paired']['mean']:.3f}), {per['burst']['ratio_of_medians']:.3f} burst",
                  flush=True)
    return res


def block_summary(blocks: list[dict], arms) -> dict:
    """One length's ABBA blocks, for single requests and for bursts: each arm's median over all its blocks, the
    second arm's over the first's, and the paired ratios (blocks (0,1), (2,3), ... hold one block of each arm, so
    slow drift cancels) with their mean and 95% interval."""
    from sglang_h20.abstats import mean_ci95

    a, b = arms
    per = {}
    for mode, key in (("single", "single_ms"), ("burst", "burst_ms")):
        med = {arm: statistics.median(x for blk in blocks if blk["arm"] == arm for x in blk[key]) for arm in arms}
        pairs = [statistics.median(b2[key]) / statistics.median(b1[key]) if b1["arm"] == a
                 else statistics.median(b1[key]) / statistics.median(b2[key])
                 for b1, b2 in zip(blocks[::2], blocks[1::2])]
        per[mode] = {"median_ms": med, "ratio_of_medians": med[b] / med[a], "paired": mean_ci95(pairs)}
    return per


def overhead_samples(res: dict) -> list:
    """A --arms mla mha run's single-request medians as fit_mha_prefix_overhead's samples (shape, mha_ms, mla_ms):
    at length L the prefill extends L/2 tokens on a cached prefix of L/2."""
    from sglang_h20.attention import mha_mla

    return [(mha_mla.BatchShape([int(n) // 2], [int(n) // 2]), r["single"]["median_ms"]["mha"],
             r["single"]["median_ms"]["mla"]) for n, r in res["lengths"].items()]


def fit_overhead(res: dict, model: str, table_out: Path | None) -> dict:
    """Fit the table's once-per-prefill MHA cost from a --arms mla mha run and write the table back."""
    from sglang_h20.attention import mha_mla

    gpu, layers = gpu_and_layers(model)
    table = mha_mla.load_table(gpu)
    fit = mha_mla.fit_mha_prefix_overhead(table, overhead_samples(res), layers)
    out = table_out or mha_mla.user_table_path(gpu)
    d = table.to_json()
    d["mha_prefix_overhead_us"] = fit["mha_prefix_overhead_us"]
    d["mha_prefix_overhead"] = {**fit, "gpu": gpu, "model": model, "date": provenance.record()["date"],
                                "how": "prefix_ttft.py --one-server --arms mla mha --fit-overhead"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, indent=1))
    print(f"MHA prefix overhead {fit['mha_prefix_overhead_us']:.0f} us per prefill ({layers} layers; "
          f"per length {[round(v) for v in fit['values_us']]}) -> {out}", flush=True)
    return {**fit, "table": str(out)}


def phase_ratios(phases: dict) -> dict:
    """Our policy's phase over each upstream phase that ran, per prefix length: median TTFT of single requests and of
    bursts. The keys name both phases: only the pair without prefill graphs on either side isolates the policy."""
    ours = phases.get("se-no-prefill-graph")
    return {f"se-no-prefill-graph_vs_{other}": {
                n: {"single": ours[n]["median_ttft_ms_single"] / phases[other][n]["median_ttft_ms_single"],
                    "burst": ours[n]["median_burst_ms"] / phases[other][n]["median_burst_ms"]} for n in phases[other]}
            for other in ("upstream", "upstream-no-prefill-graph") if other in phases and ours}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (e.g. scripts/make_model.py's, dummy weights)")
    ap.add_argument("--out", type=Path, required=True, help="output folder: prefix_ttft.json and the server logs")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                    help="input lengths L: L/2 cached prefix + L/2 new tokens (default: %(default)s)")
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES),
                    help="one server each, in order (module doc; default: all)")
    ap.add_argument("--requests", type=int, default=12,
                    help="single requests per length (per block with --one-server) (default: %(default)s)")
    ap.add_argument("--burst", type=int, default=8,
                    help="requests sent together as one batched prefill (default: %(default)s)")
    ap.add_argument("--server-args", default="--load-format dummy",
                    help="extra flags of every server, one string (default: %(default)s)")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip phases that would start after this")
    ap.add_argument("--one-server", action="store_true", help="A/B in one server through the control file")
    ap.add_argument("--blocks", type=int, default=8, help="--one-server: ABBA blocks per length (even)")
    ap.add_argument("--arms", nargs=2, default=["upstream", "se"], choices=["upstream", "se", "mha", "mla"],
                    help="--one-server: the two policies compared (ratios are second / first)")
    ap.add_argument("--fit-overhead", action="store_true",
                    help="with --arms mla mha: fit the MHA prefix overhead and write the table (module doc)")
    ap.add_argument("--table-out", type=Path, help="--fit-overhead: where to write (default: the user table)")
    args = ap.parse_args()
    if args.fit_overhead and (not args.one_server or set(args.arms) != {"mla", "mha"}):
        ap.error("--fit-overhead needs --one-server --arms mla mha")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one_server:
        record = {**provenance.record(), "benchmark": "prefix_ttft_one_server", "model": args.model,
                  "server_args": args.server_args,
                  "workload": {"lengths": args.lengths, "prefix_fraction": 0.5, "requests": args.requests,
                               "burst": args.burst, "blocks": args.blocks},
                  "one_server": one_server(args)}
        if args.fit_overhead:
            record["fit_overhead"] = fit_overhead(record["one_server"], args.model, args.table_out)
        (args.out / "prefix_ttft.json").write_text(json.dumps(record, indent=1))
        return 0
    t0, phases = time.time(), {}
    for i, name in enumerate(args.phases):
        if phases and time.time() - t0 > args.deadline_s:
            print(f"deadline: skipping phase {name} and later", flush=True)
            break
        env, extra = PHASES[name]
        with Server(args.model, shlex.split(args.server_args) + extra, args.out / f"server-{name}.log",
                    env=env, port=32000 + i) as srv:
            rng = random.Random(5)
            phases[name] = {str(n): measure(srv, n, args.requests, args.burst, rng) for n in args.lengths}
        for n, r in phases[name].items():
            print(f"  {name} L={n}: TTFT {r['median_ttft_ms_single']:.1f} ms single, "
                  f"{r['median_burst_ms']:.1f} ms for a burst of {r['burst']}", flush=True)
    ratios = phase_ratios(phases)
    record = {**provenance.record(), "benchmark": "prefix_ttft", "model": args.model, "server_args": args.server_args,
              "workload": {"lengths": args.lengths, "prefix_fraction": 0.5, "requests": args.requests,
                           "burst": args.burst},
              "ttft_ratio_ours_over_upstream (lower is better)": ratios, "phases": phases}
    (args.out / "prefix_ttft.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(ratios, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
