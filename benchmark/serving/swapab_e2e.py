#!/usr/bin/env python3
"""swapAB MoE GEMMs end to end: DeepSeek-V3 served with SGLANG_H20_SWAPAB off and on, same GPU, same run.

Model: dsv3-ep16-slice (scripts/make_model.py; 61 layers, 16 routed experts, top-8: one GPU's share
of a 16-GPU expert-parallel decode instance), dummy weights, the Triton MoE runner (the path the
swapab hook serves on one GPU). Decode with B running requests gives each expert about B/2 tokens.

Phases
  layer   (a child process, before any server) one MoE layer of the model: upstream's fused_experts
          against our sequence (forced on), both replayed from CUDA graphs, at several token counts;
          the relative difference of the outputs; and what the table in force would choose there.
  arms    one server per arm, sequential: 'off' (SGLANG_H20_SWAPAB=off), 'on' (=on with the table
          the plugin finds on this GPU, or --table FILE), 'forced' (=on with a table naming ours for
          this model's shapes at every decode size: measures our path itself), 'moe-only' (='on' with the
          table's dense-linear entries dropped: on minus moe-only is what the dense linears gave),
          'sbo' (SGLANG_H20_SBO=on,
          swapab off: single-batch overlap, issue 8, on the same workload), 'sbo+on' (SBO and swapAB on: the
          shared experts beside the routed ones on our dense GEMMs), 'sbo+on+cap' (that with those GEMMs on
          --shared-sms programs of slim tiles, SGLANG_H20_SBO_SHARED_SMS). Per arm: one warm-up
          (Triton JIT of eager batch sizes), then bench_serving at each --concurrency: output tok/s,
          median ITL, TTFT, the decode-only tok/s of the server's log lines at that level (prefill excluded);
          the server's sglang-h20 log lines, incl. the batch sizes swapab served.
The deadline splits what is left after the layer phase between the arms; later arms run only the
concurrency levels the first one finished, so every number has its pair, and an arm starts only if
the time left covers the last arm's time to its first level (a cold server start takes ~260 s).

usage: swapab_e2e.py --out DIR [--model /tmp/models/dsv3-ep16-slice] [--deadline-s 360]
                     [--arms off on forced moe-only sbo sbo+on sbo+on+cap] [--anchor off] [--table FILE]
                     [--concurrency 16 48 128]
                     [--no-layer] [--shared-sms 32]
                     [--fp8-gemm-backend triton|deep_gemm]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from plugin_parity import HOOKS_APPLIED, PLUGIN_MARK  # same directory

from sgl_kernel_ext.gemm_table import TABLE_ENV
from sglang_h20 import provenance
from sglang_h20.gputime import graph_median_us
from sglang_h20.nightly.serving import (
    Server, decode_throughput, graphs_up_to, log_since, with_mem_fraction, write_sharegpt,
)

SERVER_ARGS = ("--load-format dummy --attention-backend flashmla --sampling-backend pytorch "
               "--moe-runner-backend triton --fp8-gemm-backend triton --grammar-backend none "
               "--mem-fraction-static 0.6")  # + decode graphs up to the largest --concurrency
BASE_ENV = {"SGL_KERNEL_FLASHINFER": "0", "SGLANG_OPT_USE_JIT_KERNEL_GROUPED_TOPK": "1",
            "SGLANG_ENABLE_JIT_DEEPGEMM": "0"}
ARMS = ("off", "on", "forced", "moe-only", "sbo", "sbo+on", "sbo+on+cap")  # --arms (module doc)
# what the plugin served with its own kernels, from its "-> ours" log lines: (record key, line marker, summary label)
SERVED = (("swapab_ours_lines", "swapab: MoE", "batch sizes served by ours"),
          ("sbo_ours_lines", "sbo: MoE", "MoE batch sizes served by SBO"),
          ("dense_ours_lines", "dense linear M=", "dense linear shapes served by ours"))


def backend_setup(server_args: str, fp8_gemm_backend: str) -> tuple[str, dict]:
    """(server flags, env) for SGLang's dense block-FP8 linears on `fp8_gemm_backend`: 'triton' (its Triton GEMM,
    DeepGEMM's JIT off) or 'deep_gemm' (DeepGEMM's fp8_gemm_nt, the JIT on: what SGLang picks by default on Hopper
    when DeepGEMM is installed). The flag in `server_args` is replaced, or added."""
    flags = shlex.split(server_args)
    if "--fp8-gemm-backend" in flags:
        i = flags.index("--fp8-gemm-backend")
        del flags[i:i + 2]
    flags += ["--fp8-gemm-backend", fp8_gemm_backend]
    jit = "1" if fp8_gemm_backend == "deep_gemm" else "0"
    return shlex.join(flags), {**BASE_ENV, "SGLANG_ENABLE_JIT_DEEPGEMM": jit}


LAYER_TOKENS = [1, 4, 8, 16, 32, 64]
DECODE_M = [1, 2, 4, 8, 16, 32, 64]  # with the 2x rule: ours up to 128 tokens per expert


def model_shapes(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return {"experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
            "hidden": cfg["hidden_size"], "inter": cfg["moe_intermediate_size"],
            "routed_scaling_factor": cfg.get("routed_scaling_factor")}


def forced_table(path: Path, shapes: dict) -> Path:
    """A table naming ours (swapab) for this model's two MoE GEMMs at every decode size (few tokens
    reach few experts: group counts from 1 up to all experts)."""
    e, h, i = shapes["experts"], shapes["hidden"], shapes["inter"]
    groups = sorted({g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256) if g < e} | {e})
    entries = [{"n": n, "k": k, "groups": g, "m": m, "layout": layout, "best": "swapab"}
               for n, k in ((2 * i, h), (h, i)) for g in groups for m in DECODE_M
               for layout in ("contiguous", "masked")]
    path.write_text(json.dumps({"gpu": "forced (swapab_e2e.py)", "measured": False, "date": None,
                                "entries": entries}, indent=1))
    return path


def without_dense(table: Path | None, out: Path) -> Path:
    """The 'on' arm's table (--table, else the one the plugin finds for GPU 0) without its dense-linear entries."""
    if table is None:
        from sgl_kernel_ext import gemm_table

        table = gemm_table.find_table(gemm_table.this_gpu())
        if table is None:
            raise SystemExit("swapab_e2e: arm moe-only needs a table (--table, or one the plugin finds)")
    data = json.loads(Path(table).read_text())
    data["entries"] = [e for e in data["entries"] if e.get("layout") != "dense"]
    data["derived"] = f"{table} without its dense-linear entries (swapab_e2e.py arm moe-only)"
    path = out / "moe_only_table.json"
    path.write_text(json.dumps(data, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# Layer phase (child process: its CUDA context is gone before the servers start)
# ---------------------------------------------------------------------------------------------
def layer_phase(model: str, table: Path, tokens_list: list[int]) -> dict:
    import torch

    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sgl_kernel_ext.quant import per_block_quant_fp8

    from sglang_h20.moe import swapab

    set_global_server_args_for_scheduler(ServerArgs(model_path=model, load_format="dummy"))
    fm = __import__(swapab.TRITON_MOE_MODULE, fromlist=["x"])
    s = model_shapes(model)
    e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1, w1s = per_block_quant_fp8(torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 0.02)
    w2, w2s = per_block_quant_fp8(torch.randn(e, h, i, device="cuda", generator=gen) * 0.02)
    cfg = MoeRunnerConfig(num_experts=e, num_local_experts=e, top_k=k, inplace=True,
                          routed_scaling_factor=s["routed_scaling_factor"])
    hooked = _wrap_fn(fm.fused_experts, swapab.fused_experts_hook, HookType.AROUND)
    default_env = os.environ.pop(TABLE_ENV, None)
    rows = []
    for t in tokens_list:
        x0 = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.argsort(torch.rand(t, e, device="cuda", generator=gen), dim=1)[:, :k].to(torch.int32)
        w = torch.rand(t, k, device="cuda", generator=gen) + 0.1
        topk = StandardTopKOutput(w, ids, None)
        swapab.reset()
        if default_env is not None:
            os.environ[TABLE_ENV] = default_env
        else:
            os.environ.pop(TABLE_ENV, None)
        would = swapab.plan_moe(t, k, e, h, i)
        os.environ[TABLE_ENV] = str(table)
        swapab.reset()
        plan = swapab.plan_moe(t, k, e, h, i)
        row = {"tokens": t, "tokens_per_expert": t * k / e,
               "table_in_force_picks": would.variant if would else "upstream", "forced_plan": plan and plan.variant}
        for name, fn in (("upstream", fm.fused_experts), ("ours", hooked)):
            x = x0.clone()

            def run(fn=fn, x=x):  # inplace, as the model runs it: reload the input first
                x.copy_(x0)
                return fn(x, w1, w2, topk, moe_runner_config=cfg, use_fp8_w8a8=True, w1_scale=w1s,
                          w2_scale=w2s, block_shape=[128, 128])

            run()
            row[f"out_{name}"] = run().clone()
            row[f"us_{name}"] = graph_median_us(run, 100, allow_eager=False)[0]
        a, b = row.pop("out_ours").float(), row.pop("out_upstream").float()
        row["rel_diff"] = ((a - b).norm() / b.norm()).item()
        row["speedup"] = row["us_upstream"] / row["us_ours"]
        print(f"  layer t={t:4d}: upstream {row['us_upstream']:7.1f} us, ours {row['us_ours']:7.1f} us "
              f"({row['speedup']:.3f}x), rel diff {row['rel_diff']:.1e}, table in force: "
              f"{row['table_in_force_picks']}", flush=True)
        rows.append(row)
    return {"shapes": s, "rows": rows, "timing": "median of triton do_bench over a CUDA-graph replay "
            "(includes one input copy in both arms)"}


# ---------------------------------------------------------------------------------------------
# Serving arms
# ---------------------------------------------------------------------------------------------
def run_arm(name: str, args, env: dict, levels: list[int], budget_s: float, sharegpt: Path, port: int) -> dict:
    t0 = time.time()
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    results, first_level_s = {}, None
    with Server(args.model, shlex.split(args.server_args), log, env={**args.base_env, **env}, port=port) as srv:
        start_s = srv.start_s
        top = max(levels)
        srv.bench(out / "warmup.jsonl", num_prompts=top, input_len=args.input_len, output_len=16,
                  concurrency=top, dataset_path=str(sharegpt))  # Triton JIT of eager batch sizes: not timed
        for c in levels:
            if results and time.time() - t0 > budget_s:
                print(f"  {name}: arm budget spent, skipping concurrency {c} and later", flush=True)
                break
            before = log.stat().st_size
            rec = srv.bench(out / f"c{c}.jsonl", num_prompts=max(args.min_prompts, args.waves * c),
                            input_len=args.input_len, output_len=args.output_len, concurrency=c,
                            dataset_path=str(sharegpt))
            # TTFT's spread too: a hook that slows some prefills shows in its p90 and std before its median (s63)
            results[c] = {k: rec.get(k) for k in ("output_throughput", "median_itl_ms", "p99_itl_ms",
                                                  "median_ttft_ms", "mean_ttft_ms", "p90_ttft_ms", "std_ttft_ms",
                                                  "duration", "completed")}
            # the server's own decode rate at this level, prefill excluded: a short wave's output tok/s moves
            # with how the prompts fell into prefill batches (session 55: one extra round, 0.94x at 128)
            results[c]["decode_only_tok_s"] = decode_throughput(
                log_since(log, before), min_running=max(1, int(0.9 * c)))["median_tok_s"]
            print(f"  {name} c={c}: {rec['output_throughput']:.1f} tok/s, median ITL {rec['median_itl_ms']:.2f} ms, "
                  f"median TTFT {rec['median_ttft_ms']:.0f} ms, decode-only {results[c]['decode_only_tok_s']} tok/s",
                  flush=True)
            first_level_s = first_level_s or time.time() - t0
    text = log.read_text(errors="replace")
    mine = [ln for ln in text.splitlines() if PLUGIN_MARK in ln]
    return {"arm": name, "env": env, "server_start_s": start_s, "wall_s": time.time() - t0,
            "first_level_s": first_level_s,
            "levels": results, "plugin_log_lines": mine,
            "hooks_applied": [m.group(0) for ln in mine for m in [HOOKS_APPLIED.search(ln)] if m],
            **{key: [ln for ln in mine if marker in ln and "-> ours" in ln] for key, marker, _ in SERVED}}


def arm_fits(left_s: float, last: dict) -> bool:
    """Whether the next arm can reach the end of its first level in `left_s`, judged by the last arm's time to
    that point (server start, warm-up, one level; at least 60 s). An arm cut before its first level pairs with
    nothing, and one that overruns the caller's limit takes the call's unsaved results with it (a cold server
    start of 262 s did that in session 42)."""
    return left_s >= max(60.0, last.get("first_level_s") or 0.0)


def arm_labels(names: list[str]) -> list[str]:
    """A repeated arm is run again under 'name#2', 'name#3', ... (alternating off/on repeats show the noise)."""
    return [n if names[:i].count(n) == 0 else f"{n}#{names[:i].count(n) + 1}" for i, n in enumerate(names)]


def compare(arms: list[dict], anchor: str = "off") -> dict:
    """Each arm against the anchor arm of the same repeat ('sbo#2' against 'off#2', else 'off'), per level both
    ran."""
    by = {a["arm"]: a for a in arms}
    out = {}
    for name in sorted(k for k in by if k.split("#")[0] != anchor):
        repeat = name.partition("#")[2]
        base = f"{anchor}#{repeat}" if repeat and f"{anchor}#{repeat}" in by else anchor
        if base not in by:
            continue
        for c, ref in by[base]["levels"].items():
            got = by[name]["levels"].get(c)
            if got:
                pair = out.setdefault(name, {})[str(c)] = {
                    "output_throughput_ratio": got["output_throughput"] / ref["output_throughput"],
                    "median_itl_ratio": got["median_itl_ms"] / ref["median_itl_ms"]}
                for key, ratio in (("decode_only_tok_s", "decode_only_ratio"), ("median_ttft_ms", "median_ttft_ratio")):
                    if got.get(key) and ref.get(key):  # records before session 55 have no decode-only rate
                        pair[ratio] = got[key] / ref[key]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/models/dsv3-ep16-slice",
                    help="model folder (scripts/make_model.py's; default: %(default)s)")
    ap.add_argument("--out", type=Path, required=True,
                    help="output folder: server logs, benches, layer.json, results JSON")
    ap.add_argument("--arms", nargs="+", default=["off", "on"], choices=list(ARMS),
                    help="servers to run, in order; a repeated arm runs again as NAME#2 and pairs with off#2 "
                         "(module doc; default: %(default)s)")
    ap.add_argument("--anchor", choices=list(ARMS), default="off",
                    help="the arm every other one is compared with, e.g. 'on' for what SBO adds to swapAB "
                         "(record key vs_<anchor>; default: %(default)s)")
    ap.add_argument("--table", type=Path, help="table file for the 'on' arm (default: the one the plugin finds)")
    ap.add_argument("--shared-sms", type=int, default=32,
                    help="arm sbo+on+cap: programs of the shared experts' GEMMs (slim tiles, "
                         "SGLANG_H20_SBO_SHARED_SMS; default: %(default)s)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 48, 128],
                    help="bench_serving concurrency levels per arm (default: %(default)s)")
    ap.add_argument("--input-len", type=int, default=256, help="input tokens per request (default: %(default)s)")
    ap.add_argument("--output-len", type=int, default=96, help="output tokens per request (default: %(default)s)")
    ap.add_argument("--waves", type=int, default=1, help="prompts per level = waves x concurrency")
    ap.add_argument("--min-prompts", type=int, default=16, help="prompts per level at least (default: %(default)s)")
    ap.add_argument("--server-args", default=SERVER_ARGS,
                    help="flags of every server, one string; without a CUDA-graph flag in it, "
                         "--cuda-graph-max-bs <the largest --concurrency> is added (default: %(default)s)")
    ap.add_argument("--fp8-gemm-backend", choices=["triton", "deep_gemm"], default="triton",
                    help="SGLang's dense FP8 linears in every server: its Triton GEMM, or DeepGEMM with the JIT on "
                         "(the dense-linear hook then weighs ours against DeepGEMM; default: %(default)s)")
    ap.add_argument("--deadline-s", type=float, default=360,
                    help="seconds for the whole run, split between the layer phase and the arms "
                         "(default: %(default)s)")
    ap.add_argument("--no-layer", action="store_true", help="skip the in-process MoE layer phase")
    ap.add_argument("--layer-only", type=Path, help=argparse.SUPPRESS)  # child mode: write layer JSON here
    ap.add_argument("--result", type=Path, help="results JSON (default OUT/swapab_e2e.json)")
    args = ap.parse_args()
    if args.anchor not in args.arms:
        ap.error(f"--anchor {args.anchor}: not one of --arms {' '.join(args.arms)}")
    args.server_args = with_mem_fraction(graphs_up_to(args.server_args, max(args.concurrency)))  # H100: 0.88
    args.server_args, args.base_env = backend_setup(args.server_args, args.fp8_gemm_backend)
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there (make one with scripts/make_model.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = model_shapes(args.model)
    forced = forced_table(args.out / "forced_table.json", shapes)
    if args.layer_only:
        res = layer_phase(args.model, forced, LAYER_TOKENS)
        res["provenance"] = provenance.record()
        args.layer_only.write_text(json.dumps(res, indent=1))
        return 0

    t0 = time.time()
    layer = None
    if not args.no_layer:
        path = args.out / "layer.json"
        cmd = [sys.executable, __file__, "--model", args.model, "--out", str(args.out), "--layer-only", str(path)]
        try:
            rc = subprocess.run(cmd, env={**os.environ, **args.base_env},
                                timeout=max(60, args.deadline_s / 3)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        layer = json.loads(path.read_text()) if rc == 0 and path.exists() else {"error": f"layer phase rc={rc}"}
    envs = {"off": {"SGLANG_H20_SWAPAB": "off"},
            "on": {"SGLANG_H20_SWAPAB": "on", **({TABLE_ENV: str(args.table.resolve())} if args.table else {})},
            "forced": {"SGLANG_H20_SWAPAB": "on", TABLE_ENV: str(forced)},
            "moe-only": {"SGLANG_H20_SWAPAB": "on", TABLE_ENV: str(without_dense(args.table, args.out))}
            if "moe-only" in args.arms else {},
            "sbo": {"SGLANG_H20_SWAPAB": "off", "SGLANG_H20_SBO": "on"}}
    envs["sbo+on"] = {**envs["on"], "SGLANG_H20_SBO": "on"}
    envs["sbo+on+cap"] = {**envs["sbo+on"], "SGLANG_H20_SBO_SHARED_SMS": str(args.shared_sms)}
    assert set(envs) == set(ARMS)
    sharegpt = write_sharegpt(args.out / "sharegpt.json")
    result = args.result or args.out / "swapab_e2e.json"
    vs = f"vs_{args.anchor}"

    def save(arms) -> dict:
        """The record of the arms run so far, written after each (a run stopped from outside keeps them)."""
        record = {**provenance.record(), "benchmark": "swapab_e2e", "model": args.model, "model_shapes": shapes,
                  "server_args": args.server_args, "env": args.base_env, "fp8_gemm_backend": args.fp8_gemm_backend,
                  "table_on_arm": str(args.table or "plugin default"),
                  "workload": {k: getattr(args, k) for k in ("concurrency", "input_len", "output_len", "waves",
                                                              "min_prompts")},
                  "layer": layer, "arms": arms, "anchor": args.anchor, vs: compare(arms, args.anchor),
                  "partial": len(arms) < len(args.arms)}
        result.write_text(json.dumps(record, indent=1))
        return record

    arms, levels = [], list(args.concurrency)
    for n, (name, label) in enumerate(zip(args.arms, arm_labels(args.arms))):
        left = args.deadline_s - (time.time() - t0)
        if arms and not arm_fits(left, arms[-1]):
            print(f"deadline: skipping arm {label}", flush=True)
            break
        arm = run_arm(label, args, envs[name], levels, left / (len(args.arms) - n), sharegpt, 30000 + n)
        arms.append(arm)
        save(arms)
        levels = [c for c in levels if c in arm["levels"]]  # the next arm pairs with these
    record = save(arms)
    print(json.dumps({vs: record[vs], **{what: {a["arm"]: len(a[key]) for a in arms} for key, _, what in SERVED}},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
