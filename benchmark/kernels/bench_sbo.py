#!/usr/bin/env python3
"""Single-batch overlap (SBO) on one Hopper GPU: down GEMM + combine, with and without overlap.

DeepSeek-V3 MoE layer at decode batch {8, 16, 32, 56, 64}: 256 experts (--experts to change), top-8,
uniform random routing, down GEMM N = H = 7168, K = I = 2048 (FP8, 128x128 weight blocks), bf16 out.
Per batch (µs, sglang_h20.gputime.graph_median_us: the median of do_bench over a CUDA-graph replay of the call,
so launch overhead is out; a point whose capture fails is timed eagerly and says so):
  gemm_alone          down GEMM on every SM, no signals
  gemm_lent[b]        down GEMM on SMs - b with signals on (what the overlapped GEMM costs by itself:
                      the slowdown from lending b SMs to the combine)
  combine_alone       the combine on a finished GEMM output (no waiting; includes zeroing its accumulator)
  serial              moe_down_and_combine(overlap=False): GEMM, then combine, one stream
  overlap[b]          moe_down_and_combine(overlap=True, combine_sms=b)
  overlap_nosleep[b]  the same with spin_sleep_ns=0 (the consumer polls without pausing: what the back-off buys)
  colocated[b]        overlap with colocate=True: the GEMM keeps every SM, the b consumer programs run beside its
                      programs on the same SMs (no SM lent); colocated_hidden_pct[b] = the share of
                      (serial - gemm_alone) it removes
  fused               moe_down_and_combine(fused=True): the combine in the down GEMM's epilogue, one kernel on
                      every SM: the tile completing a token's N-range sums its top_k rows (order_error vs serial)
  fused+shared        the shared expert on a second stream beside fused
  fused_deferred      fused with each program's gathers after its last GEMM tile (EpilogueCombine.defer), so they
                      stop interrupting the weight stream
  fused_counts_only   fused with the gather skipped (EpilogueCombine.counts_only; out not written): fused minus this
                      is the gather's cost, this minus gemm_alone the per-tile counting and barriers'
  fused_tail          fused with no per-tile count (EpilogueCombine.tail: every program arrives at one grid-wide
                      counter after its last tile, then all programs gather (token, N-tile)s side by side);
                      tail_hidden_pct = the share of (serial - gemm_alone) it removes
  fused_tail_counts_only  the same without the gathers: what the grid-wide wait costs
  flat_*              gemm_alone, serial, fused and fused_counts_only again on the flat walk with TMA operands
                      (config flat + tma: one flattened, pipelined tile loop, so the next tiles' loads are in flight
                      while a tile counts): does the per-tile counting still cost more than the combine there?
  shared_alone        the shared expert (FP8 gate_up 7168 -> 4096, SiLU*up, down 2048 -> 7168) on the swapAB
                      switch's linears (our dense GEMM where the table has it faster than SGLang's Triton GEMM)
  serial+shared       shared expert, then serial down+combine, then the add (one stream)
  overlap+shared[b]   shared expert on a third stream beside overlap[b], joined before the add
Every overlapped output is compared with the serial one and its error flag checked. The combine sums
in fp32 in arrival order, so the two agree up to that order's rounding: sbo.order_error <= 1 (one bf16
ulp, plus 2^-12 of the largest value where sums cancel); each point records the measured order_error.
Whole MoE layer (the plugin's hook path vs upstream, same inputs, top-8, routed_scaling_factor 2.5):
  layer_upstream      SGLang's fused_experts (triton runner), inplace as the model runs it
  layer_ours_serial   sglang_h20.moe.sbo.moe_forward(overlap=False) (every ours arm: input quantized and placed
                      in one kernel, quant_dispatch, moe_forward's default)
  layer_ours_overlap  moe_forward(overlap=True): the combine on a second stream
  layer_ours_fused    moe_forward(combine="fused"): the per-tile epilogue form
  layer_ours_tail     moe_forward(combine="tail"), what --h20-sbo runs for these calls on one GPU
  layer_ours_tail_grid  that with the gate_up GEMM on one program per tile (programs_per_sm 32: the hardware
                      places its tiles, as upstream's grid does, instead of a static stride over 2 per SM)
  layer_ours_tail_sq  layer_ours_tail with fused_quant=False: SGLang's quant, then the rows placed (before 2026-12-01)
  X+F_beside          (--shared; X = layer_upstream, layer_ours_tail, layer_ours_tail_grid) the shared
                      expert in form F on a side stream beside X, as upstream's forward_normal_dual_stream runs in
                      the decode CUDA graphs: a persistent grid whose programs must all be resident meets SMs taken
                      by it. F = shared (SGLang's block-FP8 Triton linears: the switch off), ours_shared (the swapAB
                      switch's hook around them: our dense GEMM where its table says), ours_shared[C] (those GEMMs as C
                      programs of <= 3 stages, small enough to share SMs with X's persistent grid, --shared-sms:
                      SGLANG_H20_SBO_SHARED_SMS)
  X+F_serial          the shared expert, then X, on one stream (X = layer_upstream, layer_ours_serial,
                      layer_ours_tail; uncapped F)
  F_alone, layer_combine_alone  the shared expert alone; the combine alone (top-k weighted sum of finished rows)
  hidden_pct          per ours X+F_beside: the share of (combine + shared expert) time hidden,
                      100 * (layer_ours_serial+F_serial - X+F_beside) / (layer_combine_alone + F_alone)
                      (the issue's target: >= 80%)
(upstream needs SGLang's global server args: --model PATH gives a config dir, else a dummy attempt;
a failure is recorded under "unavailable", never dropped silently).

Output: --json OUT (provenance = sglang_h20.provenance.record(), points, per-batch summary, numeric
"latency_us" = overlap at the best budget for batch 32; from the layer rows at batch 32 (else the first)
"layer_tail_us" and "layer_vs_upstream" = upstream µs / ours: the nightly's metrics; with --shared each row also has
"<arm>_beside_vs_upstream" = upstream+shared_beside µs / <arm>+shared_beside µs) and a PNG next to it (--png to
move it).
Takes about 3 minutes on an H200 (--quick: batches 8 and 64, one budget).

usage: bench_sbo.py [--json OUT] [--png OUT] [--batches 8 16 ...] [--budgets 4 8 16] [--experts 256] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO / "python", REPO / "sgl-kernel-ext"):  # run from a checkout without installing
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

BATCHES = [8, 16, 32, 56, 64]
BUDGETS = [4, 8, 16]
H, I, TOPK, SHARED_I = 7168, 2048, 8, 2048


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results object here")
    ap.add_argument("--png", type=Path, help="plot (default: next to --json)")
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                    help="decode batches, tokens (default: %(default)s)")
    ap.add_argument("--budgets", type=int, nargs="+", default=BUDGETS,
                    help="SMs lent to the combine in the overlap arms (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts (default: %(default)s)")
    ap.add_argument("--rep-ms", type=int, default=60,
                    help="do_bench measuring time per point, ms (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="batches 8 and 64, budget 8")
    ap.add_argument("--model", help="model dir for SGLang's server args (upstream layer arm)")
    ap.add_argument("--no-layer", action="store_true", help="skip the whole-layer comparison")
    ap.add_argument("--layer-only", action="store_true", help="only the whole-layer comparison (no kernel arms)")
    ap.add_argument("--shared", action="store_true",
                    help="layer arms with the shared expert beside (side stream, as upstream's decode graphs run it) "
                         "and before the routed experts, on SGLang's linears and on ours; the combine alone; the share "
                         "of (combine + shared expert) hidden")
    ap.add_argument("--shared-sms", type=int, nargs="+", default=[], metavar="C",
                    help="with --shared: also our shared expert as C programs of at most 3 stages, the way "
                         "SGLANG_H20_SBO_SHARED_SMS=C runs it beside the routed experts (default: none; on the H200 "
                         "16, 32 and 132 were no faster than uncapped, benchmark/results/sbo/README.md, session 35)")
    return ap.parse_args(argv)


def quant_weights(torch, e, n, k, gen, chunk=32):
    """[e, n, k] random FP8 weights with 128x128 scales, quantized 32 experts at a time (memory)."""
    from sgl_kernel_ext.quant import per_block_quant_fp8

    parts = [per_block_quant_fp8(torch.randn(min(chunk, e - i), n, k, device="cuda", generator=gen,
                                             dtype=torch.bfloat16) * 0.02, 128) for i in range(0, e, chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton
    import triton.testing  # noqa: F401

    if not torch.cuda.is_available():
        print("bench_sbo: needs a CUDA GPU", file=sys.stderr)
        return 2
    from sgl_kernel_ext import grouped_gemm_fp8 as gg
    from sgl_kernel_ext import quant, sbo

    from sglang_h20.gputime import graph_median_us
    from sglang_h20.provenance import record

    if args.quick:
        args.batches, args.budgets = [8, 64], [8]
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    e = args.experts
    g = torch.Generator(device=dev).manual_seed(0)
    w2q, w2s = quant_weights(torch, e, H, I, g)
    ours_shared = shared_expert(shared_weights(torch, g), ours=True)
    shared_stream = torch.cuda.Stream()

    points, summary = [], {}
    for t in ([] if args.layer_only else args.batches):
        gb = batch_generator(t, dev)  # this batch's routing and inputs, whatever else the run sweeps
        ids = torch.stack([torch.randperm(e, device=dev, generator=gb)[:TOPK] for _ in range(t)]).to(torch.int32)
        w = torch.rand(t, TOPK, device=dev, generator=gb) + 0.05
        lay = sbo.build_layout(ids, e)
        q, qs = quant.per_token_group_quant_fp8(torch.randn(t * TOPK, I, device=dev, generator=gb), 128)
        x = torch.randn(t, H, device=dev, generator=gb).to(torch.bfloat16)
        out = torch.empty(t, H, device=dev, dtype=torch.bfloat16)
        status = torch.zeros(1, dtype=torch.int32, device=dev)
        m_hint = max(1, -(-t * TOPK // min(e, t * TOPK)))
        variant, cfg = gg.resolve_config("auto", None, m_hint, H, I, e, "contiguous", sms)
        y = torch.empty(t * TOPK, H, device=dev, dtype=torch.bfloat16)
        sig = torch.zeros(e, triton.cdiv(lay.max_m, cfg["BLOCK_T"]), dtype=torch.int32, device=dev)

        def add(name, fn, budget=None, **extra):
            us, how = graph_median_us(fn, args.rep_ms)
            p = {"batch": t, "experts": e, "name": name, "budget_sms": budget, "us": us, "timing": how,
                 "variant": variant, "config": cfg, **extra}
            points.append(p)
            print(f"batch {t:3d} {name:18s} {'' if budget is None else f'b={budget:<3d}'} {us:8.1f} us  {how}",
                  flush=True)
            return us

        def down(config=cfg, dst=out, **kw):
            """One moe_down_and_combine call of this point (down GEMM + combine into dst), as a callable."""
            return lambda: sbo.moe_down_and_combine(q, qs, w2q, w2s, w, lay, dst, variant=variant, config=config,
                                                    **kw)

        def gemm(config=cfg, **kw):
            """The down GEMM alone into y, as a callable."""
            return lambda: gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, w2q, w2s, lay.m_indptr, out=y, variant=variant,
                                                               config=config, **kw)

        serial = down(overlap=False)
        ref = torch.empty_like(out)
        down(dst=ref, overlap=False)()
        s = {"gemm_alone": add("gemm_alone", gemm())}
        s["combine_alone"] = add("combine_alone", lambda: sbo.combine(y, lay, w, out, block_t=cfg["BLOCK_T"]))
        s["serial"] = add("serial", serial)
        s["shared_alone"] = add("shared_alone", lambda: ours_shared(x))

        def serial_shared():
            sh = ours_shared(x)
            serial()
            out.add_(sh)

        s["serial+shared"] = add("serial+shared", serial_shared)

        def signalled_check(fn):
            """One run of an arm into a NaN-filled out, status cleared first: (order_error vs serial, equal to serial
            and no wait gave up)."""
            status.zero_()
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = sbo.order_error(out, ref)
            return err, err <= 1 and int(status) == 0

        def add_checked(name, fn):
            """Time an arm that writes out after checking it against serial (every token written, order only)."""
            err, _ = signalled_check(fn)
            return add(name, fn, order_error_vs_serial=err, all_written=not bool(torch.isnan(out.float()).any()),
                       equal_to_serial=err <= 1)

        fused = down(fused=True)
        s["fused"] = add_checked("fused", fused)

        def beside_shared(step):
            """step with the shared expert on a side stream beside it, joined before the add into out."""
            def run():
                main = torch.cuda.current_stream()
                shared_stream.wait_stream(main)
                with torch.cuda.stream(shared_stream):
                    sh = ours_shared(x)
                step()
                main.wait_stream(shared_stream)
                out.add_(sh)
            return run

        s["fused+shared"] = add("fused+shared", beside_shared(fused))
        s["fused_deferred"] = add_checked("fused_deferred", down(fused=True, defer=True))
        s["fused_counts_only"] = add("fused_counts_only", down(fused=True, counts_only=True))
        s["fused_tail"] = add_checked("fused_tail", down(fused=True, tail=True))
        s["fused_tail_counts_only"] = add("fused_tail_counts_only", down(fused=True, tail=True, counts_only=True))
        flat = {**cfg, "flat": True, "tma": True}  # the same tiles on the flattened, TMA-fed walk
        s["flat_gemm_alone"] = add("flat_gemm_alone", gemm(flat))
        s["flat_serial"] = add("flat_serial", down(flat, overlap=False))
        s["flat_fused"] = add_checked("flat_fused", down(flat, fused=True))
        s["flat_fused_counts_only"] = add("flat_fused_counts_only", down(flat, fused=True, counts_only=True))
        for b in args.budgets:
            lent = gemm(signal=sig, num_sms=sms - b)
            s[f"gemm_lent[{b}]"] = add("gemm_lent", lambda lent=lent: (sig.zero_(), lent()), b)
            overlapped = down(overlap=True, combine_sms=b, status=status)
            err, same = signalled_check(overlapped)
            s[f"overlap[{b}]"] = add("overlap", overlapped, b, equal_to_serial=same, order_error=err)
            s[f"overlap_nosleep[{b}]"] = add("overlap_nosleep",
                                             down(overlap=True, combine_sms=b, status=status, spin_sleep_ns=0), b)
            s[f"overlap+shared[{b}]"] = add("overlap+shared", beside_shared(overlapped), b)
            colocated = down(overlap=True, combine_sms=b, status=status, colocate=True)
            cerr, csame = signalled_check(colocated)
            s[f"colocated[{b}]"] = add("colocated", colocated, b, equal_to_serial=csame, order_error=cerr)
            same = same and csame
            if not same:
                print(f"batch {t}: overlapped output differs from serial at budget {b}!", file=sys.stderr)
        s.update(kernel_shares(s, args.budgets))
        summary[t] = s

    unavailable, layer_rows = {}, []
    if not args.no_layer:
        torch.cuda.empty_cache()
        try:
            layer_rows = layer_compare(torch, triton, args, e, unavailable)
        except Exception as ex:
            unavailable["layer"] = f"{type(ex).__name__}: {ex}"
            print(f"layer comparison unavailable: {unavailable['layer']}", file=sys.stderr)
    all_equal = all(p.get("equal_to_serial", True) for p in points) and \
        all(r.get("overlap_equal_serial", True) and r.get("fused_equal_serial", True)
            and r.get("tail_equal_serial", True) for r in layer_rows)
    result = {"provenance": record(), "shape": {"experts": e, "top_k": TOPK, "hidden": H, "inter": I,
                                                 "shared_inter": SHARED_I, "sms": sms},
              "points": points, "summary": summary, "layer": layer_rows, "unavailable": unavailable,
              "all_overlapped_equal_to_serial": all_equal}
    if 32 in summary:
        result["latency_us"] = summary[32][f"overlap[{summary[32]['best_budget']}]"]
    row = next((r for r in layer_rows if r["batch"] == 32), layer_rows[0] if layer_rows else None)
    if row and row.get("layer_ours_tail_us"):  # the nightly's metrics: what --h20-sbo runs, and vs upstream
        result["layer_tail_us"] = row["layer_ours_tail_us"]
        if row.get("layer_upstream_us"):
            result["layer_vs_upstream"] = row["layer_upstream_us"] / row["layer_ours_tail_us"]
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png:
        try:
            if summary:
                plot(summary, args.budgets, png)
            else:  # --layer-only
                plot_layer(layer_rows, png)
            result["png"] = str(png)
        except Exception as ex:
            print(f"plot failed: {type(ex).__name__}: {ex}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    for t, s in summary.items():
        best_us = s[f"overlap[{s['best_budget']}]"]
        print(f"batch {t}: GEMM alone {s['gemm_alone']:.1f}, serial {s['serial']:.1f}, fused_tail "
              f"{s['fused_tail']:.1f} us ({s['tail_hidden_pct']:.0f}% of serial - GEMM hidden), wait only "
              f"{s['fused_tail_counts_only']:.1f} us")
        print(f"batch {t}: fused {s['fused']:.1f} us (combine {s['combine_alone']:.1f} us, "
              f"{s['combine_hidden_pct']:.0f}% hidden), fused+shared {s['fused+shared']:.1f} us")
        print(f"batch {t}: flat+tma walk: GEMM {s['flat_gemm_alone']:.1f}, serial {s['flat_serial']:.1f}, fused "
              f"{s['flat_fused']:.1f} us ({s['flat_combine_hidden_pct']:.0f}% of the combine hidden), counting only "
              f"{s['flat_fused_counts_only']:.1f} us")
        print(f"batch {t}: serial {s['serial']:.1f} us, overlap {best_us:.1f} us "
              f"(b={s['best_budget']}, gain {s['overlap_gain_us']:.1f} us, GEMM +{s['gemm_slowdown_pct_at_best']:.1f}%), "
              f"with shared: gain {s['with_shared_gain_us']:.1f} us")
        print(f"batch {t}: colocated " + ", ".join(f"b={b} {s[f'colocated[{b}]']:.1f} us "
                                                   f"({s[f'colocated_hidden_pct[{b}]']:.0f}% hidden)"
                                                   for b in args.budgets))
    return 0 if all_equal else 1


def layer_compare(torch, triton, args, e, unavailable) -> list[dict]:
    """Whole MoE layer: upstream fused_experts vs the plugin's SBO path (see the module doc)."""
    from sgl_kernel_ext import sbo

    from sglang_h20.gputime import graph_median_us
    from sglang_h20.moe import sbo as plugin_sbo

    upstream = None
    try:
        from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
        from sglang.srt.layers.moe.topk import StandardTopKOutput
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        model = args.model or next((m for m in ("/tmp/models/dsv3-4l",) if Path(m).exists()), "dummy")  # gpu_check's
        set_global_server_args_for_scheduler(ServerArgs(model_path=model, load_format="dummy"))
        fm = __import__("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe", fromlist=["x"])
        cfg = MoeRunnerConfig(num_experts=e, num_local_experts=e, top_k=TOPK, inplace=True, routed_scaling_factor=2.5)
        upstream = (fm, cfg, StandardTopKOutput)
    except Exception as ex:
        unavailable["layer_upstream"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
    g = torch.Generator(device="cuda").manual_seed(1)
    w1, w1s = quant_weights(torch, e, 2 * I, H, g)
    w2, w2s = quant_weights(torch, e, H, I, g)
    shared = None
    if args.shared:
        weights = shared_weights(torch, g)
        shared = {"shared": shared_expert(weights, ours=False), "ours_shared": shared_expert(weights, ours=True),
                  **{f"ours_shared[{c}]": shared_expert(weights, True, c) for c in args.shared_sms}}
    rows = []
    for t in args.batches:
        gb = batch_generator(t, "cuda")  # this batch's routing and inputs, whatever else the run sweeps
        x0 = torch.randn(t, H, device="cuda", generator=gb).to(torch.bfloat16)
        ids = torch.argsort(torch.rand(t, e, device="cuda", generator=gb), dim=1)[:, :TOPK].to(torch.int32)
        w = torch.rand(t, TOPK, device="cuda", generator=gb) + 0.1
        x = x0.clone()
        arms = {"layer_ours_serial": lambda: plugin_sbo.moe_forward(x0, w1, w2, w, ids, w1s, w2s,
                                                                    routed_scaling_factor=2.5, overlap=False),
                "layer_ours_overlap": lambda: plugin_sbo.moe_forward(x0, w1, w2, w, ids, w1s, w2s,
                                                                     routed_scaling_factor=2.5, overlap=True),
                "layer_ours_fused": lambda: plugin_sbo.moe_forward(x0, w1, w2, w, ids, w1s, w2s,
                                                                   routed_scaling_factor=2.5, combine="fused"),
                "layer_ours_tail": lambda: plugin_sbo.moe_forward(x0, w1, w2, w, ids, w1s, w2s,
                                                                  routed_scaling_factor=2.5, combine="tail"),
                "layer_ours_tail_grid": lambda: plugin_sbo.moe_forward(
                    x0, w1, w2, w, ids, w1s, w2s, routed_scaling_factor=2.5, combine="tail",
                    gate_up_config={"programs_per_sm": 32}),
                "layer_ours_tail_sq": lambda: plugin_sbo.moe_forward(x0, w1, w2, w, ids, w1s, w2s,
                                                                     routed_scaling_factor=2.5, combine="tail",
                                                                     fused_quant=False)}
        if upstream is not None:
            fm, cfg, topk_cls = upstream

            def up():
                x.copy_(x0)  # inplace, as the model runs it
                return fm.fused_experts(x, w1, w2, topk_cls(w, ids, None), moe_runner_config=cfg, use_fp8_w8a8=True,
                                        w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128])

            arms["layer_upstream"] = up
        if args.shared:
            arms.update(shared_arms(torch, arms, x0, shared))
            layout = sbo.build_layout(ids, e)
            y = torch.randn(t * TOPK, H, device="cuda", generator=gb).to(torch.bfloat16)
            combined = torch.empty_like(x0)
            arms["layer_combine_alone"] = lambda: sbo.combine(y, layout, w, combined, weight_scale=2.5)
        row = {"batch": t, "experts": e}
        outs = {}
        for name, fn in arms.items():
            try:
                outs[name] = fn().clone()
                row[name + "_us"], row[name + "_timing"] = graph_median_us(fn, args.rep_ms)
            except Exception as ex:
                unavailable[f"{name}@{t}"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
        if "layer_ours_serial" in outs and "layer_ours_overlap" in outs:
            row["overlap_order_error"] = sbo.order_error(outs["layer_ours_overlap"], outs["layer_ours_serial"])
            row["overlap_equal_serial"] = row["overlap_order_error"] <= 1  # up to the fp32 summation order
        if "layer_ours_fused" in outs and "layer_ours_serial" in outs:  # the same bf16 rows, another summation order
            row["fused_order_error_vs_serial"] = sbo.order_error(outs["layer_ours_fused"], outs["layer_ours_serial"])
            row["fused_equal_serial"] = row["fused_order_error_vs_serial"] <= 1
        if "layer_ours_tail" in outs and "layer_ours_serial" in outs:
            row["tail_order_error_vs_serial"] = sbo.order_error(outs["layer_ours_tail"], outs["layer_ours_serial"])
            row["tail_equal_serial"] = row["tail_order_error_vs_serial"] <= 1
        if "layer_ours_tail_sq" in outs and "layer_ours_tail" in outs:  # our quant kernel against SGLang's: ~1.5%,
            a, b = outs["layer_ours_tail"].float(), outs["layer_ours_tail_sq"].float()  # test_sbo_gpu says why
            row["tail_rel_diff_vs_tail_sq"] = float((a - b).norm() / b.norm())
        if "layer_upstream" in outs and "layer_ours_overlap" in outs:
            a, b = outs["layer_ours_overlap"].float(), outs["layer_upstream"].float()
            row["rel_diff_vs_upstream"] = float((a - b).norm() / b.norm())
        row.update(beside_vs_upstream(row))
        if args.shared:
            row["hidden_pct"] = hidden_shares(row)
            print(f"layer batch {t}: share of (combine + shared expert) hidden, %: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in row["hidden_pct"].items()), flush=True)
        print("layer", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        rows.append(row)
    return rows


def beside_vs_upstream(row: dict) -> dict:
    """Upstream's layer time over ours', each with the shared expert beside the routed experts (what the decode
    graphs run), per arm of ours that ran (BESIDE_ARMS)."""
    up = row.get("layer_upstream+shared_beside_us")
    return {f"{name[len('layer_'):]}_beside_vs_upstream": up / row[f"{name}+shared_beside_us"]
            for name in BESIDE_ARMS[1:] if up and row.get(f"{name}+shared_beside_us")}


def kernel_shares(s: dict, budgets) -> dict:
    """The kernel phase's derived figures from one batch's timed forms (us): what fusing or overlapping the combine
    saves, in us and as a share of the combine (alone, or its cost in the serial form: serial - GEMM alone), and
    the GEMM's slowdown on the SMs the fastest budget leaves it."""
    best = min(budgets, key=lambda b: s[f"overlap[{b}]"])
    combine_cost = s["serial"] - s["gemm_alone"]
    return {"fused_gain_us": s["serial"] - s["fused"],
            "combine_hidden_pct": 100 * (s["serial"] - s["fused"]) / s["combine_alone"],
            "tail_hidden_pct": 100 * (s["serial"] - s["fused_tail"]) / combine_cost,
            "flat_combine_hidden_pct": 100 * (s["flat_serial"] - s["flat_fused"]) / s["combine_alone"],
            **{f"colocated_hidden_pct[{b}]": 100 * (s["serial"] - s[f"colocated[{b}]"]) / combine_cost
               for b in budgets},
            "best_budget": best, "overlap_gain_us": s["serial"] - s[f"overlap[{best}]"],
            "gemm_slowdown_pct_at_best": 100 * (s[f"gemm_lent[{best}]"] / s["gemm_alone"] - 1),
            "with_shared_gain_us": s["serial+shared"] - min(s[f"overlap+shared[{b}]"] for b in budgets)}


def batch_generator(t: int, device):
    """The generator of one batch's routing and inputs: seeded by the batch alone, so runs over different --batches
    lists time the same routing at a batch (one generator through the sweep drew it from the batches before)."""
    import torch

    return torch.Generator(device=device).manual_seed(1000 + t)


def shared_weights(torch, g):
    """DeepSeek-V3's shared expert, FP8 with 128x128 block scales: (gate_up [4096, 7168], down [7168, 2048])."""
    from sgl_kernel_ext import quant

    return (quant.per_block_quant_fp8(torch.randn(2 * SHARED_I, H, device="cuda", generator=g) * 0.02, 128),
            quant.per_block_quant_fp8(torch.randn(H, SHARED_I, device="cuda", generator=g) * 0.02, 128))


def shared_expert(weights, ours: bool, num_sms: int | None = None):
    """DeepSeek-V3's shared expert as the server runs it under --fp8-gemm-backend triton: gate_up, SGLang's
    SiLU * up kernel, down; each linear SGLang's block-FP8 Triton linear (its quant + w8a8 Triton GEMM: the swapAB
    switch off) or, with `ours`, the swapAB switch's hook around it (sglang_h20.dense_linear: upstream's quant and our
    dense GEMM where the table has it faster), inside dense_linear.sm_budget(num_sms) (SGLANG_H20_SBO_SHARED_SMS)."""
    import functools

    from sglang.srt.layers.activation import silu_and_mul
    from sglang.srt.layers.quantization.fp8_utils import triton_w8a8_block_fp8_linear

    from sglang_h20 import dense_linear

    (w13, s13), (w2, s2) = weights
    linear = functools.partial(dense_linear.triton_linear_hook, triton_w8a8_block_fp8_linear) if ours \
        else triton_w8a8_block_fp8_linear

    def forward(x):
        with dense_linear.sm_budget(num_sms):
            return linear(silu_and_mul(linear(x, w13, [128, 128], s13)), w2, [128, 128], s2)
    return forward


BESIDE_ARMS = ("layer_upstream", "layer_ours_tail", "layer_ours_tail_grid")  # routed arms the shared expert runs beside
SERIAL_ARMS = ("layer_upstream", "layer_ours_serial", "layer_ours_tail")  # ... and before, on one stream


def shared_arms(torch, arms, x0, shared: dict) -> dict:
    """The routed arms with each form of the shared expert (shared: SGLang's linears; ours_shared: our dense GEMMs;
    ours_shared[c]: c programs of slim tiles): '<arm>+<form>_beside' on a side stream forked before the routed
    experts and joined before the add (what upstream's forward_normal_dual_stream captures in the decode CUDA
    graphs), '<arm>+<form>_serial' (uncapped forms only) before them on one stream, '<form>_alone' by itself."""
    side = torch.cuda.Stream()
    out = {}
    for form, expert in shared.items():
        out[form + "_alone"] = lambda expert=expert: expert(x0)
        for name in BESIDE_ARMS:
            if name not in arms:
                continue

            def beside(routed=arms[name], expert=expert):
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                y = routed()
                with torch.cuda.stream(side):
                    sh = expert(x0)
                main.wait_stream(side)
                return y + sh

            out[f"{name}+{form}_beside"] = beside
        for name in SERIAL_ARMS if "[" not in form else ():
            if name in arms:
                out[f"{name}+{form}_serial"] = lambda routed=arms[name], expert=expert: expert(x0) + routed()
    return out


def hidden_shares(row: dict) -> dict:
    """The issue's measure of one GPU's overlap, per '<arm>+<form>_beside' of ours: the share of (combine + shared
    expert) time hidden, 100 * (nothing overlapped - arm) / (combine alone + shared alone), where nothing overlapped
    = layer_ours_serial+<form>_serial (shared expert, GEMMs, combine after the down GEMM, one stream) and a capped
    form is weighed against its uncapped one's time alone."""
    combine = row.get("layer_combine_alone_us")
    if combine is None:
        return {}
    shares = {}
    for key, us in row.items():
        if not (key.startswith("layer_ours_") and key.endswith("_beside_us")):
            continue
        form = key[:-len("_beside_us")].split("+", 1)[1]
        base = form.split("[")[0]
        serial, alone = row.get(f"layer_ours_serial+{base}_serial_us"), row.get(f"{base}_alone_us")
        if serial and alone:
            shares[key[:-len("_us")]] = 100 * (serial - us) / (combine + alone)
    return shares


def plot(summary, budgets, png: Path):
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    batches = sorted(summary)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, suffix, base in ((axes[0], "", "serial"), (axes[1], "+shared", "serial+shared")):
        ax.plot(batches, [summary[t][base] for t in batches], "k-o", label=base)
        for b in budgets:
            ax.plot(batches, [summary[t][f"overlap{suffix}[{b}]"] for t in batches], "--s",
                    label=f"overlap{suffix}, {b} SMs to combine")
        ax.plot(batches, [summary[t][f"fused{suffix}"] for t in batches], "g-^", label=f"fused{suffix} (epilogue combine)")
        if not suffix:
            for b in budgets:
                ax.plot(batches, [summary[t][f"colocated[{b}]"] for t in batches], "-.d",
                        label=f"colocated, {b} consumer programs beside the GEMM")
            ax.plot(batches, [summary[t]["fused_tail"] for t in batches], "m-v", label="fused_tail (grid-tail combine)")
            ax.plot(batches, [summary[t]["gemm_alone"] for t in batches], ":", label="down GEMM alone")
            ax.plot(batches, [summary[t]["combine_alone"] for t in batches], ":", label="combine alone")
        ax.set_xlabel("batch (tokens)")
        ax.set_ylabel("µs")
        ax.set_title("down GEMM + combine" + (" + shared expert" if suffix else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, png, dpi=120)


def plot_layer(rows: list[dict], png: Path):
    """The whole-layer arms (--layer-only): µs per arm against the batch, upstream in black; with --shared a second
    panel: the share of (combine + shared expert) hidden per ours-beside arm, against the issue's 80%."""
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    batches = [r["batch"] for r in rows]
    arms = [k[:-3] for k in rows[0] if k.endswith("_us")] if rows else []
    shares = sorted({k for r in rows for k in r.get("hidden_pct", {})})
    fig, axes = plt.subplots(1, 2 if shares else 1, figsize=(16 if shares else 10, 4.5), squeeze=False)
    ax = axes[0][0]
    if shares:
        right = axes[0][1]
        for arm in shares:
            right.plot(batches, [r.get("hidden_pct", {}).get(arm) for r in rows], "-o",
                       label=arm.removeprefix("layer_").removesuffix("_beside"))
        right.axhline(80, color="k", ls="--", lw=1, label="issue target 80%")
        right.set_xlabel("batch (tokens)")
        right.set_ylabel("% of (combine + shared expert) hidden")
        right.set_title("overlap: (nothing overlapped - arm) / (combine alone + shared alone)")
        right.grid(alpha=0.3)
        right.legend(fontsize=7)
    for arm in arms:
        style = {"layer_upstream": "k-o", "layer_upstream+shared_beside": "k--o",
                 "layer_upstream+shared_serial": "k:o"}.get(arm, "-s")
        ax.plot(batches, [r.get(arm + "_us") for r in rows], style, label=arm.removeprefix("layer_"))
    ax.set_xlabel("batch (tokens)")
    ax.set_ylabel("µs per MoE layer")
    experts = rows[0]["experts"] if rows else "?"
    ax.set_title(f"whole MoE layer, {experts} experts, top-8: ours vs SGLang's fused_experts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    save_png(fig, png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
