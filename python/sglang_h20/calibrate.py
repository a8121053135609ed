"""`python -m sglang_h20 calibrate mha-mla`: measure SGLang's real MHA and MLA prefill paths, write the table.

Default method (layer): sglang_h20.attention.mha_mla_measure times one DeepSeek-V3 attention layer's two
prefill paths with SGLang's own kernels over extend x prefix x batch and writes a table carrying the
measured grid (on the H200 its choice lost 0.0% against the per-point best; upstream's rule up to 365%).

Method server (the first one; coarser: whole prefills, fixed per-request costs dominate): two real servers on an attention-heavy DeepSeek-V3 model (8 MLA layers of the real shape, dense
MLPs shrunk to 256; dummy weights), one forcing MHA and one MLA
through this plugin's policy switch, prefill CUDA graphs off (they pin MLA). For every grid point
(batch, extend, prefix) each request's prefix is first cached (radix cache), then the batch's new
tokens are sent as one batched /generate with one output token; the server's prefill time is the
wall time of that call. Per method, a non-negative least-squares fit of time against the features
(se, total prefix, total extend, 1) gives the cost table, divided by the layer count so that the
se/prefix/extend terms are per attention layer. Costs common to both paths (MLP, lm_head, HTTP) fall
into the extend and constant terms of both and cancel in the comparison.

`modelled` builds a table from published or measured rates instead (used for the H20 until an H20
run calibrates it); the file says which it is.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from sglang_h20 import provenance
from sglang_h20.attention.mha_mla import (
    TERMS,
    BatchShape,
    CostTable,
    table_path,
    user_table_path,
)
from sglang_h20.cliargs import positive_float, positive_int
from sglang_h20.models import random_words

HEADS = 128  # DeepSeek-V3 query heads per GPU with DP attention
QUICK_GRID = {"batch": [1, 4], "extend": [256, 1024, 4096], "prefix": [0, 1024, 4096, 16384]}
FULL_GRID = {"batch": [1, 4, 16], "extend": [128, 512, 2048, 8192, 16384],
             "prefix": [0, 1024, 4096, 16384, 65536]}
MAX_POINT_TOKENS = 400_000  # skip points whose batch*(extend+prefix) would not fit a quick run


def modelled_table(gpu: str, bf16_tflops: float, hbm_tbs: float, attn_eff: float = 0.5,
                   gemm_eff: float = 0.7, source: str | None = None) -> CostTable:
    """Per-layer time from FLOPs over rate plus bytes over bandwidth (microseconds)."""
    attn = 1e6 / (attn_eff * bf16_tflops * 1e12)
    gemm = 1e6 / (gemm_eff * bf16_tflops * 1e12)
    byte = 1e6 / (hbm_tbs * 1e12)
    mha = {"se": 2 * HEADS * (192 + 128) * attn,
           # expand the cached prefix: latent (576 B*2) -> per-head K (192) and V (128), written in bf16
           "prefix": 2 * 512 * HEADS * 256 * gemm + (576 * 2 + HEADS * 320 * 2) * byte,
           "extend": 2 * 512 * HEADS * 256 * gemm, "const": 20.0}
    mla = {"se": 2 * HEADS * (576 + 512) * attn,
           # absorb W_UK into q and W_UV into the output, per new token
           "prefix": 0.0, "extend": 2 * 2 * HEADS * 128 * 512 * gemm, "const": 20.0}
    src = source or (f"modelled: {bf16_tflops:g} TFLOP/s bf16 at {attn_eff:g}/{gemm_eff:g} efficiency "
                     f"(attention/GEMM), {hbm_tbs:g} TB/s; not measured on this GPU")
    return CostTable(gpu, src, mha, mla, {"measured": False})


def nnls_fit(rows: list[dict[str, float]], times: list[float]) -> dict[str, float]:
    """Least squares with non-negative coefficients (active-set; four terms, so brute force is cheap)."""
    import itertools

    import numpy as np

    X = np.array([[r[t] for t in TERMS] for r in rows], dtype=np.float64)
    y = np.array(times, dtype=np.float64)
    scale = np.maximum(np.abs(X).max(axis=0), 1e-30)
    Xs = X / scale
    best, best_err = np.zeros(len(TERMS)), float("inf")
    for k in range(1, len(TERMS) + 1):
        for cols in itertools.combinations(range(len(TERMS)), k):
            c, *_ = np.linalg.lstsq(Xs[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            err = float(((Xs[:, cols] @ c - y) ** 2).sum())
            if err < best_err:
                best_err, best = err, np.zeros(len(TERMS))
                best[list(cols)] = c
    return {t: float(v) for t, v in zip(TERMS, best / scale)}


def grid_points(grid: dict) -> list[tuple[int, int, int]]:
    return [(b, e, p) for b in grid["batch"] for e in grid["extend"] for p in grid["prefix"]
            if b * (e + p) <= MAX_POINT_TOKENS]


def measure_point(srv, batch: int, extend: int, prefix: int, repeats: int, rng: random.Random) -> float:
    """Median seconds of a batched prefill of `extend` new tokens on top of cached `prefix` tokens."""
    prefixes = [random_words(rng, prefix) for _ in range(batch)]
    if prefix:
        srv.generate_batch(prefixes, max_new_tokens=1)  # fills the radix cache
    times = []
    for _ in range(repeats):
        texts = [(p + " " if p else "") + random_words(rng, extend) for p in prefixes]
        t0 = time.perf_counter()
        srv.generate_batch(texts, max_new_tokens=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CALIBRATION_MODEL, CALIBRATION_LAYERS = "dsv3-attn8", 8


def fit_table(gpu: str, points: list[dict], meta: dict, layers: int = 1) -> CostTable:
    """Fit both methods' linear models to measured points ({batch, extend, prefix, mha_us, mla_us}).

    Times are whole prefills of a `layers`-layer model; coefficients are divided by `layers`.
    """
    rows = [BatchShape([p["extend"]] * p["batch"], [p["prefix"]] * p["batch"]).features() for p in points]
    coef = {m: {t: v / layers for t, v in nnls_fit(rows, [p[f"{m}_us"] for p in points]).items()}
            for m in ("mha", "mla")}
    table = CostTable(gpu, f"measured on {gpu}", coef["mha"], coef["mla"], {"measured": True, **meta})
    for p, r in zip(points, rows):  # how good is the fit where it was measured
        shape = BatchShape([p["extend"]] * p["batch"], [p["prefix"]] * p["batch"])
        p["chosen"] = table.choose(shape)
        best = min(p["mha_us"], p["mla_us"])
        p["loss_vs_best_pct"] = 100 * (p[f"{p['chosen']}_us"] / best - 1)
    return table


def probe_outputs(srv, rng: random.Random) -> list[list]:
    """Greedy tokens and logprobs of prompts on cached prefixes: the same inputs for both paths."""
    prefixes = [random_words(rng, n) for n in (1024, 4096)]
    srv.generate_batch(prefixes, max_new_tokens=1)
    texts = [p + " " + random_words(rng, n) for p, n in zip(prefixes, (512, 2048))] + [random_words(rng, 3000)]
    out = srv.generate_batch(texts, max_new_tokens=4, return_logprob=True)
    return [[[lp, tok] for lp, tok, *_ in o["meta_info"]["output_token_logprobs"]] for o in out]


def compare_probes(a: list[list], b: list[list]) -> dict:
    """Same greedy tokens? Largest logprob difference of the first token (same context for both)."""
    first = [abs(x[0][0] - y[0][0]) for x, y in zip(a, b)]
    return {"greedy_tokens_identical": [[t for _, t in x] for x in a] == [[t for _, t in y] for y in b],
            "max_abs_first_logprob_diff": max(first), "first_logprobs": [[x[0][0], y[0][0]] for x, y in zip(a, b)]}


def run_calibration(a, g) -> int:
    """Launch the two forcing servers, measure the grid, fit, write the table and the raw points."""
    from sglang_h20.models import make
    from sglang_h20.nightly.serving import Server

    model = make(a.work_dir / "models", CALIBRATION_MODEL)
    grid = QUICK_GRID if a.grid == "quick" else FULL_GRID
    points = [{"batch": b, "extend": e, "prefix": p} for b, e, p in grid_points(grid)]
    args = ["--load-format", "dummy", "--attention-backend", a.backend, "--mem-fraction-static", "0.3",
            "--cuda-graph-backend-prefill", "disabled", "--cuda-graph-backend-decode", "disabled", "--chunked-prefill-size", "-1",
            "--max-prefill-tokens", str(MAX_POINT_TOKENS + 1024), "--grammar-backend", "none",
            "--sampling-backend", "pytorch", "--context-length", "131072"]
    t0, probes = time.time(), {}
    for i, method in enumerate(("mha", "mla")):
        env = {"SGLANG_H20_MHA_MLA_POLICY": method}
        with Server(str(model), args, a.work_dir / f"server-{method}.log", env=env, port=31000 + i) as srv:
            rng = random.Random(1234)
            srv.generate_batch([random_words(rng, 512)] * 2, max_new_tokens=1)  # JIT builds, first-call costs
            probes[method] = probe_outputs(srv, random.Random(99))
            for k, pt in enumerate(points):
                pt[f"{method}_us"] = 1e6 * measure_point(srv, pt["batch"], pt["extend"], pt["prefix"], a.repeats, rng)
                print(f"[{time.time() - t0:6.0f}s] {method} {k + 1}/{len(points)}: batch {pt['batch']} "
                      f"extend {pt['extend']} prefix {pt['prefix']}: {pt[f'{method}_us'] / 1e3:.2f} ms", flush=True)
    table = fit_table(g.name, points, {"backend": a.backend, "grid": a.grid, "repeats": a.repeats,
                                       "model": CALIBRATION_MODEL}, layers=CALIBRATION_LAYERS)
    out = a.out or user_table_path(g.name)
    consistency = compare_probes(probes["mha"], probes["mla"])
    print("MHA vs MLA on the same inputs:", json.dumps(consistency))
    record = {**table.to_json(), "provenance": provenance.record(), "mha_vs_mla": consistency, "points": points}
    out.write_text(json.dumps(record, indent=1) + "\n")
    worst = max(p["loss_vs_best_pct"] for p in points)
    print(f"wrote {out}: {len(points)} points, worst loss of the fitted choice vs the per-point best {worst:.1f}%")
    return 0


def run_layer_calibration(a, g) -> int:
    """The layer-level measurement (the method behind the shipped H200 table), written where the plugin
    looks first; its results JSON and plot go to the work dir."""
    from sglang_h20.attention import mha_mla_measure

    out = a.out or user_table_path(g.name)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    argv = ["--json", str(a.work_dir / "mha_mla_layer.json"), "--write-table", str(out)]
    rc = mha_mla_measure.main(argv + (["--quick"] if a.grid == "quick" else []))
    if rc == 0:
        print(f"the plugin now reads {out} on this machine (delete it to return to the shipped table)")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_h20 calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mha-mla", help="measure MHA and MLA prefill on this GPU and write the cost table",
                       description="Default (--method layer): one DeepSeek-V3 attention layer, both paths with "
                       "SGLang's own kernels over the grid (sglang_h20.attention.mha_mla_measure, what "
                       "benchmark/attention/mha_mla_layer.py runs; about 2 minutes on an H200). The table goes "
                       "to this machine's cache, which the plugin reads before the shipped table. "
                       "--method server: whole prefills through two servers (the first, coarser method).")
    m.add_argument("--method", choices=["layer", "server"], default="layer",
                   help="layer: one attention layer in-process (default); server: whole prefills through two "
                        "servers")
    m.add_argument("--grid", choices=["quick", "full"], default="full",
                   help="layer: the quick subset or the full grid; server: its quick or full grid "
                        "(default: %(default)s)")
    m.add_argument("--repeats", type=positive_int, default=5,
                   help="server method: timed repeats per point (default: %(default)s)")
    m.add_argument("--backend", default="flashmla",
                   help="server method: attention backend of the servers (default: %(default)s)")
    m.add_argument("--work-dir", type=Path, default=Path("/tmp/sglang_h20_calibrate"),
                   help="scratch folder: the layer method's results JSON and plot, the server method's model "
                        "and server logs (default: %(default)s)")
    m.add_argument("--out", type=Path, help="table file (default: ~/.cache/sglang_h20/mha_mla_<gpu>.json)")
    mod = sub.add_parser("mha-mla-model", help="write a modelled table from rates (no GPU needed)",
                         description="Write an MHA/MLA cost table modelled from a GPU's dense BF16 rate and HBM "
                                     "bandwidth instead of measured (FLOPs over rate plus bytes over bandwidth); "
                                     "the table says it is modelled. No GPU needed.")
    mod.add_argument("--gpu", required=True, help="GPU name as torch reports it, e.g. 'NVIDIA H20'")
    mod.add_argument("--bf16-tflops", type=positive_float, required=True, metavar="TFLOPS",
                     help="dense BF16 tensor-core rate of the GPU, TFLOP/s (e.g. 148 for the H20)")
    mod.add_argument("--hbm-tbs", type=positive_float, required=True, metavar="TBS",
                     help="HBM bandwidth of the GPU, TB/s (e.g. 4.0 for the H20)")
    mod.add_argument("--out", type=Path,
                     help="table file (default: the shipped table of that GPU in the package, "
                          "sglang_h20/tables/mha_mla_<gpu>.json)")
    a = ap.parse_args(argv)
    if a.what == "mha-mla-model":
        table = modelled_table(a.gpu, a.bf16_tflops, a.hbm_tbs)
        out = a.out or table_path(a.gpu)
        try:
            out.write_text(json.dumps({**table.to_json(), "provenance": provenance.record()}, indent=1) + "\n")
        except OSError as e:
            print(f"calibrate mha-mla-model: cannot write {out}: {e}", file=sys.stderr)
            return 2
        print("wrote", out)
        return 0
    from sglang_h20 import compat

    g = compat.gpu()
    if g is None:
        print("calibrate mha-mla needs a CUDA GPU; none is visible")
        return 2
    return (run_layer_calibration if a.method == "layer" else run_calibration)(a, g)
