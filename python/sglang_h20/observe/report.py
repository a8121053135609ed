"""Self-contained HTML report of observe dumps: summary, anomalies, heatmaps, per-stage time over passes.

One file, report.html: inline CSS, every plot a PNG embedded as a base64 data URI (the same PNGs
are also written next to it), no external resources. A small inline script runs on load. It
counts the images that decoded and any script or resource errors into #render-check
(data-ok / data-total / data-errors), so a headless browser can verify the page.
"""
from __future__ import annotations

import base64
import dataclasses
import html
import json
import math
from pathlib import Path

import numpy as np

from sglang_h20.observe import analyze

SECTIONS = ("summary", "anomalies", "heatmaps", "timeseries")
FIGURES = ("heatmap-layer-stage", "heatmap-rank-stage", "heatmap-rank-latency", "heatmap-expert-load",
           "plot-balancedness", "plot-stage-over-steps", "plot-step-over-steps")
KIND_COLOUR = {"communication": "#b54708", "imbalance": "#6941c6", "compute": "#c01048"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#1d2939;background:#f9fafb}
header{background:#101828;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#d0d5dd;font-size:13px}
nav{padding:8px 24px;background:#fff;border-bottom:1px solid #eaecf0;font-size:14px}nav a{margin-right:16px;color:#175cd3}
main{padding:8px 24px 40px;max-width:1400px}section{background:#fff;border:1px solid #eaecf0;border-radius:8px;
padding:12px 18px;margin:16px 0}h2{font-size:17px;margin:4px 0 12px}h3{font-size:14px;margin:16px 0 6px}
table{border-collapse:collapse;font-size:13px;width:100%}th,td{border-bottom:1px solid #eaecf0;padding:5px 8px;
text-align:left;vertical-align:top}th{background:#f2f4f7}td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-size:12px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #eaecf0;border-radius:6px;padding:8px 12px;min-width:140px}
.card b{display:block;font-size:18px}.card span{font-size:12px;color:#667085}
figure{margin:10px 0 18px}figcaption{font-size:12px;color:#475467;margin-top:4px;max-width:1000px}
img.plot{max-width:100%;border:1px solid #eaecf0}.note{color:#667085;font-size:13px}
#render-check{font-size:11px;color:#98a2b3;margin-top:24px}#render-check.warn{color:#b42318;font-weight:bold}
"""

CHECK_JS = """
(function(){
  var errors=[];
  window.addEventListener('error',function(e){
    var t=e.target; errors.push(t&&t.tagName?('resource '+t.tagName+' '+(t.alt||t.src||'').slice(0,60)):String(e.message));
  },true);
  window.addEventListener('load',function(){
    var imgs=document.images, ok=0, bad=[];
    for(var i=0;i<imgs.length;i++){ if(imgs[i].complete&&imgs[i].naturalWidth>0){ok++;} else {bad.push(imgs[i].alt);} }
    var el=document.getElementById('render-check');
    el.setAttribute('data-ok',ok); el.setAttribute('data-total',imgs.length);
    el.setAttribute('data-errors',errors.length); el.setAttribute('data-bad',bad.join('|'));
    el.textContent='render check: '+ok+'/'+imgs.length+' images decoded, '+errors.length+' errors'+(errors.length?': '+errors.join('; '):'');
    if(bad.length||errors.length){el.className='warn';}
  });
})();
"""


# ----------------------------------------------------------------------------- plots
def _plt():
    from sglang_h20.plotting import pyplot

    return pyplot()


def _png(fig) -> bytes:
    from sglang_h20.plotting import png_bytes

    return png_bytes(fig, dpi=110, bbox_inches="tight")


def plot_layer_stage(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    m = analyze.nanmedian(analyze.nanmedian(ds.times, axis=1), axis=0)  # [L, K]
    fig, ax = plt.subplots(figsize=(1.2 + 0.75 * len(ds.stages), 1.5 + 0.12 * len(ds.layers)))
    im = ax.imshow(np.ma.masked_invalid(m * 1e3), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(ds.stages)), ds.stages, rotation=40, ha="right")
    step = max(1, len(ds.layers) // 20)
    ax.set_yticks(range(0, len(ds.layers), step), [str(l) for l in ds.layers[::step]])
    ax.set_ylabel("layer")
    ax.set_title("median stage time per layer (us; median over passes and ranks)")
    fig.colorbar(im, ax=ax, label="us")
    return _png(fig)


def plot_rank_stage(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    tot = np.nansum(analyze.nanmedian(ds.times, axis=1), axis=1)  # [R, K]
    ref = analyze.nanmedian(tot, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(ref > 0, tot / ref, np.nan)
    dev = np.nanmax(np.abs(ratio - 1)) if np.isfinite(ratio).any() else 0.5
    lim = max(0.25, min(1.0, float(dev)))
    fig, ax = plt.subplots(figsize=(1.5 + 0.8 * len(ds.stages), 1.4 + 0.32 * len(ds.ranks)))
    im = ax.imshow(np.ma.masked_invalid(ratio), aspect="auto", cmap="RdBu_r", vmin=1 - lim, vmax=1 + lim,
                   interpolation="nearest")
    ax.set_xticks(range(len(ds.stages)), ds.stages, rotation=40, ha="right")
    ax.set_yticks(range(len(ds.ranks)), [str(r) for r in ds.ranks])
    ax.set_ylabel("rank")
    if len(ds.ranks) * len(ds.stages) <= 400:
        for i in range(len(ds.ranks)):
            for j in range(len(ds.stages)):
                if np.isfinite(ratio[i, j]):
                    ax.text(j, i, f"{ratio[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title("stage time per rank / median rank (summed over layers)")
    fig.colorbar(im, ax=ax, label="ratio")
    return _png(fig)


def plot_latency(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    m = ds.latency * 1e3
    n = m.shape[0]
    fig, ax = plt.subplots(figsize=(2 + 0.4 * n, 1.5 + 0.36 * n))
    im = ax.imshow(np.ma.masked_invalid(np.where(np.eye(n, dtype=bool), np.nan, m)), cmap="magma_r",
                   interpolation="nearest")
    ax.set_xticks(range(n), [str(i) for i in range(n)])
    ax.set_yticks(range(n), [str(i) for i in range(n)])
    ax.set_xlabel("destination rank")
    ax.set_ylabel("source rank")
    if n <= 16:
        for i in range(n):
            for j in range(n):
                if i != j and np.isfinite(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.0f}", ha="center", va="center", fontsize=7, color="#444")
    ax.set_title("rank x rank latency (us, median over records)")
    fig.colorbar(im, ax=ax, label="us")
    return _png(fig)


def plot_expert_load(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    x = ds.expert_mean
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = x / np.where(x.mean(axis=1, keepdims=True) > 0, x.mean(axis=1, keepdims=True), np.nan)
    top = float(np.nanmax(ratio)) if np.isfinite(ratio).any() else 2.0
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.1 * len(ds.load_layers)))
    im = ax.imshow(np.ma.masked_invalid(ratio), aspect="auto", cmap="inferno", vmin=0,
                   vmax=max(2.0, min(top, 8.0)), interpolation="nearest")
    if ds.experts_per_rank and ds.ep_size > 1:
        for r in range(1, ds.ep_size):
            ax.axvline(r * ds.experts_per_rank - 0.5, color="#7fdbff", lw=0.5, alpha=0.6)
    step = max(1, len(ds.load_layers) // 15)
    ax.set_yticks(range(0, len(ds.load_layers), step), [str(l) for l in ds.load_layers[::step]])
    ax.set_xlabel("physical expert (lines: EP rank boundaries)")
    ax.set_ylabel("MoE layer")
    ax.set_title("tokens per expert / layer mean (mean over passes, summed over ranks)")
    fig.colorbar(im, ax=ax, label="x mean")
    return _png(fig)


def plot_balancedness(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    bal = ds.balancedness  # [S, Lm]
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot(ds.load_layers, analyze.nanmedian(bal, axis=0), marker=".", label="median over passes")
    ax.fill_between(ds.load_layers, np.nanmin(bal, axis=0), np.nanmax(bal, axis=0), alpha=0.2, label="min-max")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("mean / max rank load")
    ax.set_title("EP balancedness per layer (1 = balanced)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_stage_over_steps(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    tot = ds.stage_totals()  # [R, S, K]
    med = analyze.nanmedian(tot, axis=0)  # [S, K]
    mx = np.nanmax(np.where(np.isnan(tot), -np.inf, tot), axis=0)
    fig, ax = plt.subplots(figsize=(10, 4))
    for k, stage in enumerate(ds.stages):
        line, = ax.plot(ds.steps, med[:, k], label=stage, lw=1.4)
        ax.plot(ds.steps, np.where(np.isfinite(mx[:, k]), mx[:, k], np.nan), lw=0.6, ls="--",
                color=line.get_color(), alpha=0.7)
    ax.set_xlabel("pass (forward_pass_id)")
    ax.set_ylabel("ms per pass (sum over layers)")
    ax.set_title("per-stage time over passes (solid: median rank, dashed: slowest rank)")
    ax.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3)
    return _png(fig)


def plot_step_over_steps(ds: analyze.Dataset) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for a, r in enumerate(ds.ranks):
        ax.plot(ds.steps, ds.step_ms[a], lw=0.9, label=f"rank {r}" if len(ds.ranks) <= 16 else None)
    if ds.graph:
        g = sorted(p for v in ds.graph.values() for p in v)
        ax.scatter([s for s, _ in g], [m for _, m in g], s=6, color="k", label="graph replay (reference)")
    ax.set_xlabel("pass")
    ax.set_ylabel("ms")
    ax.set_title("step time: sampled eager passes per rank, and graph-replay references")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3)
    return _png(fig)


# ----------------------------------------------------------------------------- HTML
def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _figure(fig_id: str, png: bytes | None, caption: str, alt: str, missing: str = "") -> str:
    if png is None:
        return f'<figure id="{fig_id}"><p class="note">{_e(missing)}</p></figure>'
    b64 = base64.b64encode(png).decode("ascii")
    return (f'<figure id="{fig_id}"><img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _summary_html(s: dict, anomalies, errors) -> str:
    kinds = {k: sum(a.kind == k for a in anomalies) for k in KIND_COLOUR}
    cards = [("ranks", s["ranks"]), ("sampled passes", s["passes"]), ("layers", s["layers"]),
             ("median step (eager, ms)", _fmt(s["step_ms_median"])),
             ("median graph step (ms)", _fmt(s["graph_step_ms_median"])),
             ("median balancedness", _fmt(s["balancedness_median"])),
             ("anomalies", len(anomalies))] + [(k, v) for k, v in kinds.items()]
    out = ['<div class="cards">'] + [f'<div class="card"><b>{_e(v)}</b><span>{_e(k)}</span></div>' for k, v in cards]
    out.append("</div>")
    if s["stage_ms_median"]:
        out.append("<h3>Median stage time per pass (summed over layers)</h3><table><tr><th>stage</th>"
                   "<th>ms</th><th>share of step</th></tr>")
        step = s["stage_sum_ms_median"] or float("nan")
        for k, v in sorted(s["stage_ms_median"].items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else 0):
            share = v / step if step and math.isfinite(step) and step > 0 else float("nan")
            out.append(f'<tr><td>{_e(k)}</td><td class="num">{_fmt(v)}</td><td class="num">'
                       f'{"-" if not math.isfinite(share) else f"{share:.1%}"}</td></tr>')
        out.append("</table>")
    if s["graph_step_ms_median"] and s["step_ms_median"]:
        out.append(f'<p class="note">Sampled passes run eagerly: their median step is '
                   f'{s["step_ms_median"] / s["graph_step_ms_median"]:.2f}x the graph-replay reference.</p>')
    if errors:
        out.append(f'<p class="note">{len(errors)} unreadable dump line(s) skipped, first: {_e(errors[0])}</p>')
    return "\n".join(out)


def _anomalies_html(anomalies) -> str:
    if not anomalies:
        return '<p class="note">No anomalies: every rank, stage, expert and link is within the thresholds.</p>'
    rows = ["<table><tr><th>kind</th><th>detector</th><th>rank</th><th>stage / expert / link</th><th>layers</th>"
            "<th>passes</th><th>z</th><th>excess</th><th>finding</th></tr>"]
    for a in anomalies:
        what = a.stage or (f"expert {','.join(map(str, a.experts))}" if a.experts else "") or \
            (f"{a.link[0]}->{a.link[1]}" if a.link else "")
        excess = "-" if not math.isfinite(a.excess) else f"{a.excess:+.0%}"
        rows.append(
            f'<tr><td><span class="badge" style="background:{KIND_COLOUR.get(a.kind, "#475467")}">{_e(a.kind)}</span></td>'
            f"<td>{_e(a.detector)}</td><td>{_e('' if a.rank is None else a.rank)}</td><td>{_e(what)}</td>"
            f"<td>{_e(analyze._ranges(a.layers))}</td><td>{_e(len(a.steps) if a.steps else '')}</td>"
            f'<td class="num">{a.z:.1f}</td><td class="num">{excess}</td><td>{_e(a.message)}</td></tr>')
    rows.append("</table>")
    return "\n".join(rows)


def build(records, out_dir, thresholds: analyze.Thresholds | None = None, title: str = "observe report",
          errors: list | None = None) -> Path:
    """Analyse `records`, write report.html + PNGs + anomalies.json + summary.json into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds = analyze.load(records)
    if not ds.steps:
        raise ValueError("no 'stages' records in the dump(s)")
    th = thresholds or analyze.Thresholds()
    anomalies = analyze.detect(ds, th)
    summ = analyze.summary(ds)

    pngs: dict[str, bytes | None] = {
        "heatmap-layer-stage": plot_layer_stage(ds),
        "heatmap-rank-stage": plot_rank_stage(ds),
        "heatmap-rank-latency": plot_latency(ds) if ds.latency is not None else None,
        "heatmap-expert-load": plot_expert_load(ds) if ds.expert_mean is not None else None,
        "plot-balancedness": plot_balancedness(ds) if ds.recv is not None else None,
        "plot-stage-over-steps": plot_stage_over_steps(ds),
        "plot-step-over-steps": plot_step_over_steps(ds),
    }
    for name, png in pngs.items():
        if png is not None:
            (out_dir / f"{name}.png").write_bytes(png)

    figs = {
        "heatmap-layer-stage": ("Exclusive stage time per layer; dense layers have dense_mlp, MoE layers the rest.",
                                "layer x stage heatmap", ""),
        "heatmap-rank-stage": ("Each rank's stage time over the median rank. A slow rank shows red compute "
                               "stages and blue dispatch/combine (its peers wait for it, it waits for nobody).",
                               "rank x stage heatmap", ""),
        "heatmap-rank-latency": ("Per-link latency, source row to destination column.", "rank x rank latency",
                                 "No rank x rank latency matrix in these dumps (needs a latency probe)."),
        "heatmap-expert-load": ("Tokens per physical expert relative to the layer mean; vertical lines are EP "
                                "rank boundaries.", "expert load heatmap", "No expert load in these dumps."),
        "plot-balancedness": ("SGLang's balancedness, mean/max of the per-rank received load, from the "
                              "routing summed over ranks.", "balancedness per layer", "No expert load."),
        "plot-stage-over-steps": ("Per-stage time per sampled pass.", "stage time over passes", ""),
        "plot-step-over-steps": ("Step time per rank; dots are graph-replay reference passes.", "step time over passes", ""),
    }

    def fig(name):
        cap, alt, missing = figs[name]
        return _figure(name, pngs[name], cap, alt, missing)

    th_text = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(th).items())
    body = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body>
<header><h1>{_e(title)}</h1><p>{summ['records']} sampled pass records from {summ['ranks']} rank(s);
thresholds: {_e(th_text)}</p></header>
<nav><a href="#summary">Summary</a><a href="#anomalies">Anomalies ({len(anomalies)})</a>
<a href="#heatmaps">Heatmaps</a><a href="#timeseries">Over passes</a></nav>
<main>
<section id="summary"><h2>Summary</h2>
{_summary_html(summ, anomalies, errors or [])}
</section>
<section id="anomalies"><h2>Anomalies</h2>
{_anomalies_html(anomalies)}
</section>
<section id="heatmaps"><h2>Heatmaps</h2>
<h3>Layer x stage time</h3>{fig("heatmap-layer-stage")}
<h3>Rank x stage (relative to the median rank)</h3>{fig("heatmap-rank-stage")}
<h3>Rank x rank latency</h3>{fig("heatmap-rank-latency")}
<h3>Expert load per layer x expert</h3>{fig("heatmap-expert-load")}
{fig("plot-balancedness")}
</section>
<section id="timeseries"><h2>Per-stage time over passes</h2>
{fig("plot-stage-over-steps")}
{fig("plot-step-over-steps")}
</section>
<div id="render-check">render check: not run (scripts disabled)</div>
</main>
<script>{CHECK_JS}</script>
</body></html>
"""
    path = out_dir / "report.html"
    path.write_text(body, encoding="utf-8")
    (out_dir / "anomalies.json").write_text(json.dumps([a.to_json() for a in anomalies], indent=1) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(finite(summ), indent=1, default=_json_default) + "\n")
    return path


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(type(x).__name__)


def finite(x):
    """NaN/inf -> None, so summary.json is strict JSON."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
