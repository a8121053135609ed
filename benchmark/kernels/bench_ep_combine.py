#!/usr/bin/env python3
"""MoE down projection + combine under expert parallelism: the network combine fused into the GEMM (SBO) against
GEMM, local combine, then NCCL's reduce-scatter. One process per GPU (NCCL), 2 or more GPUs of one host.

Why: issue 9's "SBO with the network combine vs without: MoE layer time". Without DeepEP, SGLang's EP path gathers
every rank's tokens, runs each rank's experts on all of them and sums the per-rank partials with a collective
after the whole MoE (the layer communicator's reduce-scatter / all-reduce). The fused form
(sgl_kernel_ext.ep_combine.ep_down_and_combine) writes each token's partial to its owner as soon as the tile that
completes it is done, over peer memory (torch symmetric memory), and the owner sums the ranks' partials.

Arms, per decode batch (tokens per rank), each step starting with the dispatch all-gather of the step's tokens
(bf16 [tokens, 7168], what orders one step's buffer reuse before the next in the server too):
  serial   grouped FP8 down GEMM (sgl_kernel_ext.grouped_gemm_fp8, the table's variant) -> sbo.combine (local
           top-k sum, bf16, every gathered token) -> reduce_scatter_tensor (bf16) -> this rank's tokens
  fused    ep_down_and_combine(..., out, own): the same GEMM with the combine and the cross-GPU send in its
           epilogue, then this rank's finish kernel (sum of the ranks' fp32 partials in rank order)
  gather   the all-gather alone (subtract it to get the MoE-down part)
  gemm, gemm_combine   the serial arm's first one / two stages alone (its breakdown: what the local combine and
           the reduce-scatter add to the GEMM)
  fused_flat   fused on the flattened, TMA-fed tile walk (config flat + tma): the next tiles' loads stay in flight
           while a tile counts, sends and releases
Shapes: DeepSeek-V3's down projection (N = 7168, K = 2048), 256 routed experts split evenly over the ranks, top-8
routing drawn uniformly (the same on every rank). Timing: CUDA events around --iters steps after a barrier, --reps
times; per arm the median over reps of the slowest rank. Each rank's own kernels (GEMM, local combine, the fused
producer + finish) replay as CUDA graphs, as in the server's decode; the NCCL collectives launch eagerly (one call
that captured them in the graphs hung). Session 7's fully eager runs of the same points differed 2x between calls:
likely Python launch overhead of the order of the GPU work (inferred). --eager restores that.
Correctness: the reference is each rank's fp32 partial from the GEMM's own bf16 rows (sbo.combine_reference),
reduce-scattered by NCCL in fp32; fused must match it up to the summation order (sbo.order_error <= 1, as in
test_ep_combine_gpu). The serial arm's error against it is recorded, not bounded: it rounds each rank's partial to
bf16 before NCCL adds them, and where the two ranks' partials cancel that rounding is large next to the sum
(session 7 saw 5-9 units of order_error).

Output: a table on rank 0's stdout and --json OUT with provenance, plus a PNG next to it (stacked serial stages
against fused, per batch); --replot JSON redraws that PNG from a stored record. On fewer than 2 GPUs it says so, writes
{"unavailable": why} to --json and exits 0 (the nightly's kernel step runs every bench on any host).
usage: bench_ep_combine.py [--gpus 2] [--batches 20 32 56] [--quick] [--eager] [--json OUT] | --replot JSON
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

H, I, EXPERTS, TOPK = 7168, 2048, 256, 8
FLAT_TMA = {"flat": True, "tma": True}
BATCHES = [20, 32, 56]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=0, help="ranks, one GPU each (default: every visible GPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="decode tokens per rank")
    ap.add_argument("--experts", type=int, default=EXPERTS, help="routed experts in all (split over the ranks)")
    ap.add_argument("--iters", type=int, default=20, help="steps per timed rep")
    ap.add_argument("--reps", type=int, default=15,
                    help="timed reps per arm; the median is kept (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write the results object here (and a PNG next to it)")
    ap.add_argument("--quick", action="store_true", help="one batch (32 tokens per rank), 5 reps")
    ap.add_argument("--eager", action="store_true", help="launch each rank's kernels plainly, not as CUDA graphs")
    ap.add_argument("--hang-s", type=float, default=300,
                    help="a rank still running after this dumps its stack and exits")
    ap.add_argument("--replot", type=Path, metavar="JSON", help="only redraw JSON's PNG (next to it), no GPU run")
    a = ap.parse_args(argv)
    if a.quick:
        a.batches, a.reps = [32], 5
    if any(b < 1 for b in a.batches) or a.iters < 1 or a.reps < 1:
        ap.error("batches, iters and reps must be positive")
    return a


def rank_problem(rank: int, world: int, tokens: int, experts: int, dev):
    """This rank's share of one MoE layer: the gathered batch's routing (the same on every rank), its experts'
    FP8 weights, the layout of its local pairs and the all-gather maps."""
    import torch

    from sgl_kernel_ext import ep_combine as ep
    from sgl_kernel_ext import sbo
    from sgl_kernel_ext.quant import per_block_quant_fp8, per_token_group_quant_fp8

    if experts % world:
        raise ValueError(f"{experts} experts do not split over {world} ranks")
    g_local, t = experts // world, tokens * world
    gen = torch.Generator().manual_seed(1234 + tokens)
    ids = torch.argsort(torch.rand(t, experts, generator=gen), dim=1)[:, :TOPK].to(torch.int32).to(dev)
    weights = (torch.rand(t, TOPK, generator=gen) + 0.05).to(dev)
    xq, xs = per_token_group_quant_fp8(torch.randn(t, I, generator=gen).to(dev), 128)
    w2 = torch.randn(g_local, H, I, generator=torch.Generator().manual_seed(99 + rank), device="cpu") * 0.02
    wq, ws = per_block_quant_fp8(w2.to(dev), 128)
    local = torch.where((ids >= rank * g_local) & (ids < (rank + 1) * g_local), ids - rank * g_local, -1)
    lay, pairs = ep.build_ep_layout(local.to(torch.int32), g_local)
    owner, index = ep.allgather_maps([tokens] * world, dev)
    return dict(q=sbo.dispatch_rows(xq, lay), qs=sbo.dispatch_rows(xs, lay), wq=wq, ws=ws, w=weights, lay=lay,
                pairs=pairs, owner=owner, index=index)


def graphed(fn):
    """fn's kernels captured in one CUDA graph (fn warmed before); returns its replay."""
    import torch

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _worker(rank, world, init_file, args, results):
    import faulthandler

    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hung rank shows where, instead of a silent timeout
    try:
        results.put((rank, run_rank(rank, world, init_file, args)))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_rank(rank: int, world: int, init_file: str, args) -> dict:
    import torch
    import torch.distributed as dist

    from sgl_kernel_ext import ep_combine as ep
    from sgl_kernel_ext import grouped_gemm_fp8 as gg
    from sgl_kernel_ext import sbo

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=dev)
    cap = max(args.batches)
    own, recv_tab, arr_tab, handles = ep.symmetric_ep_buffers(world, cap, H, dist.group.WORLD, dev)
    out = {"points": []}
    for tokens in args.batches:
        p = rank_problem(rank, world, tokens, args.experts, dev)
        t = tokens * world
        hidden = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
        gathered = torch.empty(t, H, device=dev, dtype=torch.bfloat16)
        y = torch.empty(p["q"].shape[0], H, device=dev, dtype=torch.bfloat16)
        full = torch.empty(t, H, device=dev, dtype=torch.bfloat16)
        mine_serial = torch.empty(tokens, H, device=dev, dtype=torch.bfloat16)
        mine_fused = torch.empty(tokens, H, device=dev, dtype=torch.bfloat16)
        mine_flat = torch.empty(tokens, H, device=dev, dtype=torch.bfloat16)
        variant, cfg = gg.resolve_config("auto", None, max(1, -(-t * TOPK // args.experts)), H, I,
                                         args.experts // world, "contiguous", gg._device_sms(p["q"]))
        cfg = {**cfg, "BLOCK_N": ep.COUNT_BLOCK_N}  # both arms on the fused form's tile grid

        def local_gemm():
            gg.m_grouped_fp8_gemm_nt_contiguous(p["q"], p["qs"], p["wq"], p["ws"], p["lay"].m_indptr, out=y,
                                                variant=variant, config=cfg)

        def local_gemm_combine():
            local_gemm()
            sbo.combine(y, p["lay"], p["w"], full, weight_scale=2.5)

        def local_fused(mine, config):  # producer + this rank's finish (waits on the peer's producer) into mine
            return lambda: ep.ep_down_and_combine(
                p["q"], p["qs"], p["wq"], p["ws"], p["w"], p["lay"], rank=rank, world=world, token_owner=p["owner"],
                owner_index=p["index"], local_pairs=p["pairs"], peer_recv=recv_tab, peer_arrivals=arr_tab,
                recv_capacity=cap, out=mine, own=own, weight_scale=2.5, variant=variant, config=config, y=y)

        local = {"gemm": local_gemm, "gemm_combine": local_gemm_combine, "fused": local_fused(mine_fused, cfg),
                 "fused_flat": local_fused(mine_flat, {**cfg, **FLAT_TMA})}

        def gather():
            dist.all_gather_into_tensor(gathered, hidden)

        def after_gather(name):  # a step: the dispatch all-gather, then this rank's kernels (graphed or not)
            return lambda: (gather(), local[name]())

        def serial():
            arms["gemm_combine"]()
            dist.reduce_scatter_tensor(mine_serial, full)

        arms = {"gather": gather, **{name: after_gather(name) for name in ("gemm", "gemm_combine")}, "serial": serial,
                **{name: after_gather(name) for name in ("fused", "fused_flat")}}
        for fn in arms.values():  # compile, then warm
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        # the reference from the rows both arms computed (same GEMM, same config): fp32 partials, fp32 collective
        ref = torch.empty(tokens, H, device=dev, dtype=torch.float32)
        dist.reduce_scatter_tensor(ref, sbo.combine_reference(y, p["lay"], p["w"], 2.5, out_dtype=torch.float32))
        err = {"fused": sbo.order_error(mine_fused, ref), "serial": sbo.order_error(mine_serial, ref),
               "fused_flat": sbo.order_error(mine_flat, ref)}
        if not args.eager:
            local.update({name: graphed(fn) for name, fn in local.items()})
            torch.cuda.synchronize()
        times = {name: [] for name in arms}
        for _ in range(args.reps):
            for name, fn in arms.items():
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3 / args.iters)
        local.clear()  # the graphs and their private memory go
        out["points"].append({"tokens_per_rank": tokens, "gathered_tokens": t, "variant": variant, "config": cfg,
                              "timing": "eager" if args.eager else "local_cuda_graphs",
                              "order_error_vs_fp32": err, "status": int(own.status.item()),
                              "us": {k: statistics.median(v) for k, v in times.items()}})
    del handles
    dist.barrier()
    dist.destroy_process_group()
    return out


def summarize(per_rank: dict[int, dict]) -> list[dict]:
    """Per batch: each arm's slowest rank (the layer waits for it), the MoE-down part (minus the all-gather) and
    fused / serial."""
    rows = []
    ranks = sorted(per_rank)
    for i, pt in enumerate(per_rank[ranks[0]]["points"]):
        us = {arm: max(per_rank[r]["points"][i]["us"][arm] for r in ranks) for arm in pt["us"]}
        down = {arm: us[arm] - us["gather"] for arm in us if arm != "gather"}
        rows.append({"tokens_per_rank": pt["tokens_per_rank"], "gathered_tokens": pt["gathered_tokens"],
                     "us_slowest_rank": us, "moe_down_us": down,
                     **{f"{arm}_over_serial": us[arm] / us["serial"] for arm in ("fused", "fused_flat") if arm in us},
                     "moe_down_fused_over_serial": down["fused"] / down["serial"] if down["serial"] > 0 else None,
                     "order_error_max": {arm: max(per_rank[r]["points"][i]["order_error_vs_fp32"][arm] for r in ranks)
                                         for arm in pt["order_error_vs_fp32"]},
                     "any_wait_gave_up": any(per_rank[r]["points"][i]["status"] for r in ranks),
                     "variant": pt["variant"], "config": pt["config"]})
    return rows


def plot(rows: list[dict], png: Path, title: str = "") -> None:
    """Per batch: the serial path's stages stacked (GEMM, local combine, reduce-scatter) beside fused, the
    all-gather (both pay it) at the bottom of each bar."""
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = list(range(len(rows)))
    us = [r["us_slowest_rank"] for r in rows]
    stages = (("all-gather", lambda u: u["gather"], "0.75"), ("GEMM", lambda u: u["gemm"] - u["gather"], "C0"),
              ("local combine", lambda u: u["gemm_combine"] - u["gemm"], "C1"),
              ("reduce-scatter", lambda u: u["serial"] - u["gemm_combine"], "C2"))
    bottom = [0.0] * len(rows)
    for label, part, color in stages:
        h = [max(part(u), 0.0) for u in us]
        ax.bar([x - 0.2 for x in xs], h, 0.38, bottom=bottom, color=color, label=f"serial: {label}")
        bottom = [b + v for b, v in zip(bottom, h)]
    fused_arms = [("fused", "C3", "fused: all-gather, then the GEMM with combine + send in its epilogue")]
    if all("fused_flat" in u for u in us):
        fused_arms.append(("fused_flat", "C4", "fused on the flat, TMA-fed walk"))
    width = 0.38 if len(fused_arms) == 1 else 0.25
    for j, (arm, color, label) in enumerate(fused_arms):
        pos = [x + 0.2 + j * width for x in xs]
        ax.bar(pos, [u[arm] for u in us], width, color=color, label=label)
        for x, u in zip(pos, us):
            ax.annotate(f"{u[arm] / u['serial']:.2f}x", (x, u[arm]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [str(r["tokens_per_rank"]) for r in rows])
    ax.set_xlabel("decode tokens per rank")
    ax.set_ylabel("µs per step (slowest rank)")
    ax.set_title(title or "MoE down projection + EP combine")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_png(fig, png, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        from sglang_h20.cliargs import read_json

        try:
            rec = read_json(args.replot, "bench_ep_combine: --replot")
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        if not isinstance(rec, dict) or not rec.get("rows"):
            why = rec.get("unavailable") if isinstance(rec, dict) else None
            print(f"bench_ep_combine: --replot {args.replot}: no measured rows to plot"
                  + (f" (the run was skipped: {why})" if why else ""), file=sys.stderr)
            return 2
        plot(rec["rows"], args.replot.with_suffix(".png"), f"EP {rec.get('world', '?')} on {rec.get('gpu', '?')}")
        return 0
    import torch

    world = args.gpus or torch.cuda.device_count()
    if world < 2 or torch.cuda.device_count() < world:
        why = f"needs 2 or more CUDA GPUs (visible: {torch.cuda.device_count()})"
        print(f"bench_ep_combine: skipped: {why}", file=sys.stderr)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"benchmark": "ep_combine", "unavailable": why}))
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.multiprocessing as mp

    from sglang_h20 import provenance

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_ep_combine_") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "pg"), args, results))
                 for r in range(world)]
        for pr in procs:
            pr.start()
        try:
            per_rank = dict(results.get(timeout=args.hang_s + 60) for _ in procs)
        except queue.Empty:
            print(f"bench_ep_combine: a rank did not finish in {args.hang_s:.0f}s (its stack is above)",
                  file=sys.stderr)
            return 1
        finally:
            for pr in procs:
                pr.join(timeout=60)
                if pr.is_alive():
                    pr.kill()
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors:
        for r, e in sorted(errors.items()):
            print(f"rank {r} failed:\n{e}", file=sys.stderr)
        return 1
    rows = summarize(per_rank)
    print(f"{'tokens/rank':>11s} {'gather':>8s} {'gemm':>8s} {'+combine':>8s} {'serial':>8s} {'fused':>8s} "
          f"{'flat':>8s} {'fused/serial':>12s} {'flat/serial':>11s} {'err fused':>9s} {'err flat':>8s} "
          f"{'err serial':>10s}")
    for r in rows:
        u, e = r["us_slowest_rank"], r["order_error_max"]
        print(f"{r['tokens_per_rank']:11d} {u['gather']:8.1f} {u['gemm']:8.1f} {u['gemm_combine']:8.1f} "
              f"{u['serial']:8.1f} {u['fused']:8.1f} {u['fused_flat']:8.1f} {r['fused_over_serial']:12.3f} "
              f"{r['fused_flat_over_serial']:11.3f} {e['fused']:9.2f} {e['fused_flat']:8.2f} {e['serial']:10.2f}"
              + ("  A WAIT GAVE UP" if r["any_wait_gave_up"] else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**provenance.record(), "benchmark": "ep_combine", "world": world,
                                         "experts": args.experts, "shape": {"N": H, "K": I, "top_k": TOPK},
                                         "iters": args.iters, "reps": args.reps, "rows": rows,
                                         "per_rank": per_rank}, indent=1))
        print(f"wrote {args.json}")
        try:
            plot(rows, args.json.with_suffix(".png"), f"EP {world} on {torch.cuda.get_device_name(0)}")
        except Exception as e:  # the record matters more than its picture
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    return 0 if rows_ok(rows) else 1


def rows_ok(rows: list[dict]) -> bool:
    """The run's verdict: every fused arm within one unit of the serial result's summation order on every rank
    (the serial arm's own error, against the float reference, is not judged), and no wait gave up."""
    return all(all(e <= 1 for arm, e in r["order_error_max"].items() if arm != "serial") and not r["any_wait_gave_up"]
               for r in rows)


if __name__ == "__main__":
    raise SystemExit(main())
