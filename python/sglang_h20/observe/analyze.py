"""Anomaly detection over observe dumps: robust statistics across ranks and over time.

Every statistic is a robust z-score: z = (x - median) / scale, with
scale = max(1.4826 * MAD, scale_floor * |median|). The floor keeps near-constant data from
turning tiny differences into large z. A flag needs all three of: z above the threshold, a
relative excess above `rel` and an absolute excess above `abs_ms`. So clean data stays quiet
however small its spread, and every flag is large enough to matter.

Detectors (defaults in `Thresholds`):
cross-rank  per (layer, stage): each rank's median over passes vs the other ranks, z > 5 and
            > +20% and > 5 us; when fewer than 25% of the layers are flagged, only those > +40%
            count (routine per-layer routing skew stays quiet). The same test runs on per-stage
            totals over layers, to catch a uniform slowdown that is under threshold in every
            single layer. Flags are grouped
            into one anomaly per (rank, stage), listing the layers. Persistent problems.
over-time   per (rank, stage) total over layers, and per rank step_ms: each pass vs the rank's
            own median over passes, z > 6 and > +50%. Transients (one rank, some passes).
load        received tokens per EP rank (expert e lives on rank e // experts_per_rank), per MoE
            layer, median over passes, across ranks: z > 4 and > +15%, in at least 25% of the
            MoE layers (persistent rank skew; a skew in a single layer is the hot-expert detector's).
experts     mean tokens per expert over passes (summed over ranks), per MoE layer, across that
            layer's experts: z > 6 and >= 2x the median expert (hot experts).
latency     rank x rank matrix (each rank's `peer_latency_ms` row, or a `rank_latency_ms`
            matrix), median over records; intra-node and inter-node links compared separately
            (`ranks_per_node`): z > 5 and > +50%. A rank with at least half of its links flagged
            is reported once as that rank.

Classification of each anomaly:
communication  dispatch or combine slow on a rank, or a latency-matrix link or rank;
imbalance      routed_experts slow on a rank that also receives more tokens than the median rank
               (> +load_rel), any load or hot-expert flag, and a compute stage slow on a rank
               whose batch is larger than the median (> +load_rel, DP-attention token imbalance);
compute        any other slow stage (attention, router, routed/shared experts, dense MLP, other).
A slow rank also makes its peers wait inside dispatch/combine. That raises the peers' median,
and the slow rank itself shows *less* wait, so the one-sided test does not misread it as a
communication fault of the slow rank.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np

from sglang_h20.observe.recorder import COMMUNICATION_STAGES, EXPERT_STAGES, OUTSIDE, STAGES, rank_loads


@dataclasses.dataclass(frozen=True)
class Thresholds:
    z: float = 5.0
    rel: float = 0.20
    abs_ms: float = 0.005
    time_z: float = 6.0
    time_rel: float = 0.5
    load_z: float = 4.0
    load_rel: float = 0.15
    load_layer_frac: float = 0.25  # a rank's load flag needs this share of MoE layers (hot experts: per layer)
    expert_z: float = 6.0
    expert_rel: float = 1.0
    link_z: float = 5.0
    link_rel: float = 0.5
    min_ranks: int = 4  # fewer ranks: no cross-rank statistics
    min_steps: int = 8  # fewer passes: no over-time statistics
    scale_floor: float = 0.01


@dataclasses.dataclass
class Anomaly:
    kind: str  # compute / imbalance / communication
    detector: str  # cross-rank / over-time / load / experts / latency
    message: str
    rank: int | None = None
    stage: str | None = None
    layers: list = dataclasses.field(default_factory=list)
    steps: list = dataclasses.field(default_factory=list)
    experts: list = dataclasses.field(default_factory=list)
    link: tuple | None = None
    z: float = 0.0
    value: float = 0.0
    baseline: float = 0.0
    unit: str = "ms"

    @property
    def excess(self) -> float:
        return (self.value / self.baseline - 1.0) if self.baseline > 0 else math.inf

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["excess"] = None if math.isinf(self.excess) else round(self.excess, 4)
        d["link"] = list(self.link) if self.link else None
        for k in ("z", "value", "baseline"):
            d[k] = round(float(d[k]), 6)
        return d


# ----------------------------------------------------------------------------- data set
@dataclasses.dataclass
class Dataset:
    ranks: list
    steps: list
    layers: list
    stages: list
    times: np.ndarray  # [R, S, L, K] ms, NaN where absent
    step_ms: np.ndarray  # [R, S]
    outside: np.ndarray  # [R, S]
    tokens: np.ndarray  # [R, S] batch size or tokens, NaN if unknown
    graph: dict  # rank -> [(step, ms)]
    load_layers: list
    num_experts: int
    experts_per_rank: int
    ep_size: int
    expert_mean: np.ndarray | None  # [Lm, P] mean over passes of tokens per expert (all ranks)
    recv: np.ndarray | None  # [S, Lm, ep] tokens received per EP rank
    latency: np.ndarray | None  # [R, R] median over records
    ranks_per_node: int
    n_records: int

    @property
    def balancedness(self) -> np.ndarray | None:
        """[S, Lm] mean/max of the received load over EP ranks (global routing)."""
        if self.recv is None:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.nanmean(self.recv, axis=2) / np.nanmax(self.recv, axis=2)

    def stage_totals(self) -> np.ndarray:
        """[R, S, K] stage time summed over layers (NaN where a pass is missing)."""
        present = ~np.all(np.isnan(self.times), axis=2)
        return np.where(present, np.nansum(self.times, axis=2), np.nan)


def load(records) -> Dataset:
    """Arrange 'stages' records (and 'graph' references) into arrays."""
    recs = [r for r in records if r.get("kind", "stages") == "stages"]
    ranks = sorted({int(r["rank"]) for r in recs})
    steps = sorted({int(r["step"]) for r in recs})
    layers = sorted({int(e["layer"]) for r in recs for e in r.get("layers", ())})
    names = {k for r in recs for e in r.get("layers", ()) for k in e.get("stages", {})}
    stages = [s for s in STAGES if s in names] + sorted(names - set(STAGES))
    ri = {r: i for i, r in enumerate(ranks)}
    si = {s: i for i, s in enumerate(steps)}
    li = {l: i for i, l in enumerate(layers)}
    ki = {k: i for i, k in enumerate(stages)}
    R, S, L, K = len(ranks), len(steps), len(layers), len(stages)
    times = np.full((R, S, L, K), np.nan)
    step_ms = np.full((R, S), np.nan)
    outside = np.full((R, S), np.nan)
    tokens = np.full((R, S), np.nan)
    graph = defaultdict(list)
    for r in records:
        if r.get("kind") == "graph":
            graph[int(r["rank"])].append((int(r["step"]), float(r["step_ms"])))

    load_layers = sorted({int(l) for r in recs for l in r.get("expert_load_layers", ())})
    num_experts = max((int(r.get("num_experts", 0) or 0) for r in recs), default=0)
    per_rank = max((int(r.get("experts_per_rank", 0) or 0) for r in recs), default=0)
    ep_size = max((int(r.get("ep_size", 1) or 1) for r in recs), default=1)
    rpn = max((int(r.get("ranks_per_node", 8) or 8) for r in recs), default=8)
    lm = {l: i for i, l in enumerate(load_layers)}
    have_load = bool(load_layers) and num_experts > 0
    expert_sum = np.zeros((len(load_layers), num_experts)) if have_load else None
    expert_n = np.zeros((len(load_layers), 1)) if have_load else None
    recv = np.full((S, len(load_layers), ep_size), np.nan) if have_load else None
    lat_rows = defaultdict(list)
    lat_mats = []

    for r in recs:
        a, b = ri[int(r["rank"])], si[int(r["step"])]
        step_ms[a, b] = float(r.get("step_ms", np.nan))
        outside[a, b] = float(r.get("outside", {}).get(OUTSIDE, np.nan))
        n = r.get("num_tokens", r.get("batch_size"))
        if isinstance(n, (int, float)):
            tokens[a, b] = float(n)
        for e in r.get("layers", ()):
            c = li[int(e["layer"])]
            for k, v in e.get("stages", {}).items():
                times[a, b, c, ki[k]] = float(v)
            for k in stages:  # a stage absent from a present layer took no time
                if k not in e.get("stages", {}):
                    times[a, b, c, ki[k]] = 0.0
        if have_load and r.get("expert_load"):
            rows = np.zeros((len(r["expert_load"]), num_experts))
            for i, row in enumerate(r["expert_load"]):
                row = row[:num_experts]
                rows[i, : len(row)] = row
            js = [lm[int(l)] for l in r.get("expert_load_layers", ())][: len(rows)]
            expert_sum[js] += rows[: len(js)]
            expert_n[js] += 1
            got = rank_loads(rows[: len(js)], per_rank, ep_size)  # [n, ep]
            if got.shape[-1] == ep_size:
                cur = recv[b, js]
                recv[b, js] = np.where(np.isnan(cur), got, cur + got)
        if r.get("peer_latency_ms") is not None:
            lat_rows[int(r["rank"])].append(np.asarray(r["peer_latency_ms"], dtype=float))
        if r.get("rank_latency_ms") is not None:
            lat_mats.append(np.asarray(r["rank_latency_ms"], dtype=float))

    expert_mean = None
    if have_load:
        # tokens per expert per pass, summed over ranks = sum / (records per layer / ranks)
        passes = np.maximum(expert_n / max(1, R), 1e-9)
        expert_mean = expert_sum / passes
    latency = None
    if lat_mats:
        latency = np.median(np.stack(lat_mats), axis=0)
    elif lat_rows:
        n = max(max(lat_rows) + 1, max(len(v[0]) for v in lat_rows.values()))
        latency = np.full((n, n), np.nan)
        for r, rows in lat_rows.items():
            row = np.median(np.stack(rows), axis=0)
            latency[r, : len(row)] = row
    return Dataset(ranks, steps, layers, stages, times, step_ms, outside, tokens, dict(graph), load_layers,
                   num_experts, per_rank, ep_size, expert_mean, recv, latency, rpn, len(recs))


# ----------------------------------------------------------------------------- statistics
def robust_z(x: np.ndarray, axis: int, floor: float = 0.01):
    """(z, median, scale) along `axis`, NaN-aware; scale = max(1.4826 MAD, floor |median|)."""
    with np.errstate(invalid="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            med = np.nanmedian(x, axis=axis, keepdims=True)
            mad = np.nanmedian(np.abs(x - med), axis=axis, keepdims=True)
        scale = np.maximum(1.4826 * mad, floor * np.abs(med))
        scale = np.where(scale > 0, scale, 1e-12)
        return (x - med) / scale, med, scale


def nanmedian(x, axis=None):
    """np.nanmedian without the all-NaN-slice warning (missing stages are expected)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(x, axis=axis)


def _flags(x, axis, z_thr, rel, abs_, floor):
    z, med, _ = robust_z(x, axis, floor)
    with np.errstate(invalid="ignore"):
        flag = (z > z_thr) & (x - med > rel * np.abs(med)) & (x - med > abs_)
    return flag, z, np.broadcast_to(med, x.shape)


def _classify_stage(stage: str) -> str:
    if stage in COMMUNICATION_STAGES:
        return "communication"
    return "compute"


def _ranges(values) -> str:
    """[3,4,5,9] -> '3-5,9'."""
    values = sorted(values)
    out, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


# ----------------------------------------------------------------------------- detectors
def _rank_recv_ratio(ds: Dataset) -> np.ndarray | None:
    """[Lm, ep] each EP rank's median received load / the median rank's."""
    if ds.recv is None:
        return None
    med = nanmedian(ds.recv, axis=0)  # [Lm, ep]
    ref = nanmedian(med, axis=1)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        return med / np.where(ref > 0, ref, np.nan)


def cross_rank(ds: Dataset, th: Thresholds) -> list[Anomaly]:
    R = len(ds.ranks)
    if R < th.min_ranks or not ds.steps:
        return []
    med = nanmedian(ds.times, axis=1)  # [R, L, K]
    flag, z, base = _flags(med, 0, th.z, th.rel, th.abs_ms, th.scale_floor)
    tot = np.nansum(med, axis=1)  # [R, K]
    tflag, tz, tbase = _flags(tot, 0, th.z, th.rel, th.abs_ms, th.scale_floor)
    tok = nanmedian(ds.tokens, axis=1)  # [R]
    tok_med = float(nanmedian(tok, axis=0)) if np.isfinite(tok).any() else float("nan")
    tok_ratio = tok / tok_med if tok_med > 0 else np.ones(R)
    recv_ratio = _rank_recv_ratio(ds)
    load_li = {l: j for j, l in enumerate(ds.load_layers)}
    need = max(1, math.ceil(th.load_layer_frac * len(ds.layers)))
    with np.errstate(invalid="ignore", divide="ignore"):
        excess = med / base - 1.0
    out = []
    for a in range(R):
        for k, stage in enumerate(ds.stages):
            cols = np.flatnonzero(flag[a, :, k])
            if len(cols) < need:  # a few isolated layers: only strong deviations count
                cols = cols[excess[a, cols, k] > 2 * th.rel]
            lay = [ds.layers[c] for c in cols]
            if not lay and not tflag[a, k]:
                continue
            kind = _classify_stage(stage)
            why = ""
            rank = ds.ranks[a]
            if stage in EXPERT_STAGES and recv_ratio is not None and rank < recv_ratio.shape[1]:
                rows = [load_li[l] for l in (lay or ds.load_layers) if l in load_li]
                ratio = float(np.nanmean(recv_ratio[rows, rank])) if rows else float("nan")
                if np.isfinite(ratio) and ratio > 1 + th.load_rel:
                    kind, why = "imbalance", f"; it receives {ratio:.2f}x the median rank's tokens"
                elif np.isfinite(ratio):
                    why = f"; its load is {ratio:.2f}x the median rank's, so the experts themselves are slow"
            elif kind == "compute" and np.isfinite(tok_ratio[a]) and tok_ratio[a] > 1 + th.load_rel:
                kind, why = "imbalance", f"; its batch is {tok_ratio[a]:.2f}x the median rank's"
            value, baseline = float(tot[a, k]), float(tbase[a, k])
            zz = float(tz[a, k]) if tflag[a, k] else float(np.max(z[a, cols, k]))
            where = f"layers {_ranges(lay)}" if lay else "summed over layers"
            out.append(Anomaly(
                kind, "cross-rank",
                f"rank {rank}: {stage} {value:.3f} ms per pass vs {baseline:.3f} ms median rank "
                f"({value / baseline - 1:+.0%}; {where}){why}" if baseline > 0 else
                f"rank {rank}: {stage} {value:.3f} ms per pass ({where}){why}",
                rank=rank, stage=stage, layers=lay, z=zz, value=value, baseline=baseline))
    return out


def over_time(ds: Dataset, th: Thresholds) -> list[Anomaly]:
    """Per-pass flags against each rank's own history, grouped per (rank, stage).

    A straggler makes its peers wait in the next collective. So at a pass where some ranks
    flag a compute stage and *other* ranks flag only dispatch/combine, the waits are charged
    to the straggler (named in its message) and not reported as communication faults.
    """
    S = len(ds.steps)
    if S < th.min_steps:
        return []
    totals = ds.stage_totals()
    series = [(stage, totals[:, :, k]) for k, stage in enumerate(ds.stages)]
    series.append(("step", ds.step_ms))
    flags = []  # (rank index, stage, pass index, z, value, baseline)
    for stage, x in series:  # x [R, S]
        flag, z, base = _flags(x, 1, th.time_z, th.time_rel, th.abs_ms, th.scale_floor)
        for a, b in zip(*np.nonzero(flag)):
            flags.append((int(a), stage, int(b), float(z[a, b]), float(x[a, b]), float(base[a, b])))
    waited: dict[int, set] = defaultdict(set)  # pass index -> ranks whose comm flags were waits
    by_pass = defaultdict(list)
    for f in flags:
        by_pass[f[2]].append(f)
    kept = []
    for b, fs in by_pass.items():
        slow = {a for a, st, *_ in fs if st not in COMMUNICATION_STAGES and st != "step"}
        comm = {a for a, st, *_ in fs if st in COMMUNICATION_STAGES}
        if slow and comm and not (slow & comm):
            waited[b] = comm
            fs = [f for f in fs if f[1] not in COMMUNICATION_STAGES and not (f[1] == "step" and f[0] in comm)]
        kept += fs
    groups = defaultdict(list)
    for f in kept:
        groups[(f[0], f[1])].append(f)
    out = []
    for (a, stage), fs in sorted(groups.items()):
        worst = max(fs, key=lambda f: f[3])
        rank = ds.ranks[a]
        kind = "compute" if stage == "step" else _classify_stage(stage)
        steps = sorted(ds.steps[f[2]] for f in fs)
        peers = sorted({ds.ranks[p] for f in fs for p in waited.get(f[2], ())})
        why = f"; peers {_ranges(peers)} waited for it in dispatch/combine" if peers else ""
        out.append(Anomaly(
            kind, "over-time",
            f"rank {rank}: {stage} {worst[4]:.3f} ms at pass {ds.steps[worst[2]]} vs its median "
            f"{worst[5]:.3f} ms ({worst[4] / worst[5] - 1:+.0%}; {len(steps)} of {S} passes){why}",
            rank=rank, stage=stage, steps=steps, z=worst[3], value=worst[4], baseline=worst[5]))
    return out


def load_imbalance(ds: Dataset, th: Thresholds) -> list[Anomaly]:
    if ds.recv is None or ds.recv.shape[2] < th.min_ranks:
        return []
    med = nanmedian(ds.recv, axis=0)  # [Lm, ep]
    flag, z, base = _flags(med, 1, th.load_z, th.load_rel, 0.0, th.scale_floor)
    out = []
    need = max(1, math.ceil(th.load_layer_frac * med.shape[0]))
    for r in range(med.shape[1]):
        rows = np.flatnonzero(flag[:, r])
        if len(rows) < need:
            continue
        lay = [ds.load_layers[j] for j in rows]
        value, baseline = float(np.mean(med[rows, r])), float(np.mean(base[rows, r]))
        hot = ""
        if ds.expert_mean is not None and ds.experts_per_rank > 0:
            lo, hi = r * ds.experts_per_rank, min((r + 1) * ds.experts_per_rank, ds.num_experts)
            share = ds.expert_mean[rows, lo:hi].mean(axis=0)
            hot = f"; busiest hosted expert {lo + int(np.argmax(share))}"
        out.append(Anomaly("imbalance", "load",
                           f"rank {r} receives {value:.0f} tokens per layer vs {baseline:.0f} median rank "
                           f"({value / baseline - 1:+.0%}; layers {_ranges(lay)}){hot}",
                           rank=r, layers=lay, z=float(np.max(z[rows, r])), value=value, baseline=baseline,
                           unit="tokens"))
    return out


def hot_experts(ds: Dataset, th: Thresholds) -> list[Anomaly]:
    if ds.expert_mean is None or ds.expert_mean.shape[1] < 8:
        return []
    x = ds.expert_mean
    flag, z, base = _flags(x, 1, th.expert_z, th.expert_rel, 0.0, th.scale_floor)
    out = []
    for e in np.flatnonzero(flag.any(axis=0)):
        rows = np.flatnonzero(flag[:, e])
        lay = [ds.load_layers[j] for j in rows]
        value, baseline = float(np.mean(x[rows, e])), float(np.mean(base[rows, e]))
        rank = int(e // ds.experts_per_rank) if ds.experts_per_rank > 0 else None
        out.append(Anomaly("imbalance", "experts",
                           f"expert {e} gets {value / baseline:.1f}x the median expert's tokens in "
                           f"{len(lay)} layer(s) ({_ranges(lay)}), hosted on rank {rank}",
                           rank=rank, experts=[int(e)], layers=lay, z=float(np.max(z[rows, e])),
                           value=value, baseline=baseline, unit="tokens"))
    return out


def latency_links(ds: Dataset, th: Thresholds) -> list[Anomaly]:
    m = ds.latency
    if m is None or m.shape[0] < 2:
        return []
    n = m.shape[0]
    node = np.arange(n) // max(1, ds.ranks_per_node)
    off = ~np.eye(n, dtype=bool)
    flag = np.zeros_like(m, dtype=bool)
    z = np.zeros_like(m)
    base = np.full_like(m, np.nan)
    for same in (True, False):
        sel = off & ((node[:, None] == node[None, :]) == same) & np.isfinite(m)
        if sel.sum() < 4:
            continue
        vals = m[sel]
        f, zz, b = _flags(vals, 0, th.link_z, th.link_rel, 0.0, th.scale_floor)
        flag[sel], z[sel], base[sel] = f, zz, b
    out = []
    per_rank = flag.sum(axis=0) + flag.sum(axis=1)
    links_per_rank = 2 * (n - 1)
    bad_ranks = [r for r in range(n) if per_rank[r] >= links_per_rank / 2]
    for r in bad_ranks:
        value = float(np.nanmean(np.concatenate([m[r, flag[r]], m[flag[:, r], r]])))
        baseline = float(np.nanmean(np.concatenate([base[r, flag[r]], base[flag[:, r], r]])))
        out.append(Anomaly("communication", "latency",
                           f"rank {r}: {int(per_rank[r])} of {links_per_rank} links slow, "
                           f"{value * 1e3:.0f} us vs {baseline * 1e3:.0f} us median link",
                           rank=r, z=float(max(z[r].max(), z[:, r].max())), value=value, baseline=baseline))
    for i, j in zip(*np.nonzero(flag)):
        if i in bad_ranks or j in bad_ranks:
            continue
        out.append(Anomaly("communication", "latency",
                           f"link {i}->{j}: {m[i, j] * 1e3:.0f} us vs {base[i, j] * 1e3:.0f} us median link",
                           link=(int(i), int(j)), z=float(z[i, j]), value=float(m[i, j]),
                           baseline=float(base[i, j])))
    return out


DETECTORS = (cross_rank, over_time, load_imbalance, hot_experts, latency_links)


def detect(data, thresholds: Thresholds | None = None) -> list[Anomaly]:
    """Every anomaly in `data` (a Dataset or records), most severe first."""
    ds = data if isinstance(data, Dataset) else load(data)
    th = thresholds or Thresholds()
    found = [a for d in DETECTORS for a in d(ds, th)]
    order = {"communication": 0, "imbalance": 1, "compute": 2}
    found.sort(key=lambda a: (-min(a.z, 1e9), order.get(a.kind, 3)))
    return found


def summary(ds: Dataset) -> dict:
    """Headline numbers for the report and the CLI."""
    tot = ds.stage_totals()  # [R, S, K]
    stage_ms = {s: float(nanmedian(tot[:, :, k].ravel(), axis=0)) for k, s in enumerate(ds.stages)} if tot.size else {}
    graph = [ms for v in ds.graph.values() for _, ms in v]
    bal = ds.balancedness
    eager = float(nanmedian(ds.step_ms.ravel(), axis=0)) if ds.step_ms.size else float("nan")
    stage_sum = float(nanmedian((np.nansum(tot, axis=2) + np.nan_to_num(ds.outside)).ravel(), axis=0)) if tot.size else float("nan")
    return {
        "records": ds.n_records, "ranks": len(ds.ranks), "passes": len(ds.steps), "layers": len(ds.layers),
        "stages": list(ds.stages),
        "step_ms_median": eager,
        "stage_sum_ms_median": stage_sum,
        "graph_step_ms_median": float(np.median(graph)) if graph else None,
        "stage_ms_median": stage_ms,
        "balancedness_median": float(nanmedian(bal.ravel(), axis=0)) if bal is not None and bal.size else None,
        "num_experts": ds.num_experts, "ep_size": ds.ep_size,
        "latency_matrix": ds.latency is not None,
    }
