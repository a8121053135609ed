"""What a nightly run leaves behind: the JSON run record, report.md and the PNG plots."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from sglang_h20.nightly import compare as cmp

THROUGHPUT_PNG = "throughput.png"
ITL_PNG = "itl.png"
VERSION_KEYS = ("python", "torch", "sglang", "sglang_h20", "triton")
PLURAL = {"regression": "regressions", "improvement": "improvements"}


def write_record(path: Path, record: dict) -> Path:
    """Write through a temporary file, so a run killed mid-write never leaves a truncated record."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def write_report(out_dir: Path, run: dict, baseline: dict | None, comparison: list[cmp.Row]) -> list[Path]:
    """report.md plus the plots; returns the paths written. `baseline` None means a run without one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(out_dir, run, baseline)
    md = out_dir / "report.md"
    md.write_text(markdown(run, baseline, comparison, [p.name for p in plots]))
    return [md, *plots]


def markdown(run: dict, baseline: dict | None, comparison: list[cmp.Row], plots: list[str]) -> str:
    base = baseline or {}
    regressions, failures = cmp.regressions(comparison), cmp.failures(run)
    lines = [f"# Nightly {run.get('config', '?')}: {_summary(comparison, failures)}", ""]
    lines += ["| | current | baseline |", "|---|---|---|"]
    lines += [f"| {label} | {run.get(key) or '-'} | {base.get(key) or '-'} |"
              for label, key in (("git commit", "git_commit"), ("GPU", "gpu"), ("date (UTC)", "date"))]
    lines += [f"| {k} | {(run.get('versions') or {}).get(k) or '-'} | {(base.get('versions') or {}).get(k) or '-'} |"
              for k in VERSION_KEYS]
    lines += ["", f"Command: `{run.get('command', '-')}`", ""]
    th = run.get("threshold") or {}
    lines += [f"A change is a regression or an improvement when it exceeds max({_pct(th.get('rel'))}, "
              f"{th.get('noise_k', '?')} x noise), noise = 1.4826 x MAD / median of the repeats "
              f"(the larger of current and baseline).", ""]
    if baseline is None:
        lines += ["No baseline given: every metric is `new`.", ""]
    elif run.get("gpu") != base.get("gpu"):
        lines += [f"**Warning: GPUs differ** (current {run.get('gpu')}, baseline {base.get('gpu')}).", ""]
    if regressions:
        lines += ["## Regressions", ""]
        lines += [f"- `{r.point}` {r.metric}: {_pct(r.change, signed=True)} (tolerance {_pct(r.tolerance)})"
                  for r in regressions]
        lines.append("")
    if failures:
        lines += ["## Failed points", ""]
        lines += [f"- `{pid}`: {_one_line(err)}" for pid, err in failures.items()]
        lines.append("")
    skipped = {pid: p["error"] for pid, p in run["points"].items()
               if (p.get("error") or "").startswith(cmp.SKIPPED_PREFIX)}
    if skipped:
        lines += ["## Skipped points", ""] + [f"- `{pid}`: {err}" for pid, err in skipped.items()] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    lines += ["## Points", ""]
    for pid, rows in _by_point(comparison):
        lines += [f"### `{pid}` ({cmp.point_verdict(rows)})", ""]
        lines += ["| metric | baseline median | current median | change % (+ = better) | tolerance % | verdict |",
                  "|---|---:|---:|---:|---:|---|"]
        for r in sorted(rows, key=lambda r: cmp.VERDICT_ORDER.index(r.verdict)):
            verdict = f"**{r.verdict}**" if r.verdict == "regression" else r.verdict
            lines.append(f"| {r.metric} ({r.better} is better) | {_num(r.baseline)} | {_num(r.current)} | "
                         f"{_pct(r.change, signed=True)} | {_pct(r.tolerance)} | {verdict} |")
        lines.append("")
    return "\n".join(lines)


def _summary(comparison: list[cmp.Row], failures: dict) -> str:
    counts = {v: sum(r.verdict == v for r in comparison) for v in cmp.VERDICT_ORDER}
    parts = [f"{n} {PLURAL.get(v, v) if n > 1 else v}" for v, n in counts.items() if n and v != "same"]
    if failures:
        parts.append(f"{len(failures)} failed points")
    return ", ".join(parts) or "no changes"


def _by_point(comparison: list[cmp.Row]) -> list[tuple[str, list[cmp.Row]]]:
    """Points grouped, those with the worst verdict first, otherwise in record order."""
    groups: dict[str, list[cmp.Row]] = {}
    for r in comparison:
        groups.setdefault(r.point, []).append(r)
    return sorted(groups.items(), key=lambda kv: cmp.VERDICT_ORDER.index(cmp.point_verdict(kv[1])))


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}"


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x * 100:+.1f}%" if signed else f"{x * 100:.1f}%"


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + " ..."


def serving_curves(record: dict, metric: str) -> dict[str, list[tuple[int, float, float, float]]]:
    """serving config -> [(concurrency, median, min, max)] of `metric`, sorted by concurrency."""
    curves: dict[str, list] = {}
    for pid, p in record["points"].items():
        values = ((p.get("metrics") or {}).get(metric) or {}).get("values")
        if p.get("kind") != "serving" or not values:
            continue
        conc = (p.get("params") or {}).get("concurrency")
        if conc is None:
            continue
        curves.setdefault(pid.rsplit("/", 1)[0], []).append((conc, statistics.median(values), min(values), max(values)))
    return {k: sorted(v) for k, v in curves.items()}


def write_plots(out_dir: Path, run: dict, baseline: dict | None) -> list[Path]:
    """(a) output throughput and (b) median/p99 ITL vs concurrency per serving config; none without serving points."""
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    base = baseline or {"points": {}}
    # file, y label, log y (median and p99 ITL differ ~10x), [(metric, label, marker, colour)]
    specs = [(THROUGHPUT_PNG, "output throughput (tok/s)", False, [("output_throughput", "", "o", "C0")]),
             (ITL_PNG, "inter-token latency (ms)", True,
              [("median_itl_ms", "median ", "o", "C0"), ("p99_itl_ms", "p99 ", "^", "C3")])]
    written = []
    for filename, ylabel, log_y, series in specs:
        cur = {m: serving_curves(run, m) for m, *_ in series}
        old = {m: serving_curves(base, m) for m, *_ in series}
        configs = sorted({c for curves in [*cur.values(), *old.values()] for c in curves})
        if not configs:
            continue
        ncols = min(2, len(configs))
        nrows = math.ceil(len(configs) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
        for ax, name in zip(axes.flat, configs):
            for metric, label, marker, colour in series:
                for curves, who, style, face in ((old[metric], "baseline", "--", "none"),
                                                 (cur[metric], "current", "-", colour)):
                    pts = curves.get(name)
                    if not pts:
                        continue
                    x, med, lo, hi = zip(*pts)
                    yerr = [[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]]
                    ax.errorbar(x, med, yerr=yerr, fmt=marker + style, color=colour, markerfacecolor=face,
                                capsize=3, label=f"{label}{who}")
            ax.set_title(name.removeprefix("serving/"), fontsize=10)
            ax.set_xscale("log", base=2)
            if log_y:
                ax.set_yscale("log")
                plain = FuncFormatter(lambda v, _: f"{v:g}")  # 40, not 4x10^1
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(plain)
            xs = sorted({p[0] for curves in [*cur.values(), *old.values()] for p in curves.get(name, [])})
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(configs):]:
            ax.set_visible(False)
        fig.suptitle(f"{run.get('config', '')} {run.get('gpu') or ''} {(run.get('git_commit') or '')[:12]}  "
                     f"(error bars: min/max over repeats)", fontsize=10)
        fig.tight_layout()
        path = out_dir / filename
        save_png(fig, path, dpi=110)
        written.append(path)
    return written
