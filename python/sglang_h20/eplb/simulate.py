"""Trace-driven EPLB simulator: balancedness, cross-node traffic, dispatch/combine bytes, migration.

Model of one MoE layer of one step (see `evaluate`):
  * token t originates on node token_node[t] (default t % num_nodes) and, inside it, on GPU
    node * gpus_per_node + (t's ordinal among its node's tokens) % gpus_per_node;
  * for each of its experts the token picks one replica: one on its own node if any, else any replica;
    among the candidates by a hash of (token, expert), so the choice is spread evenly and does not
    correlate with the token's origin node (which is also derived from the token index);
  * GPU load = (token, expert) pairs a GPU's slots receive, its own tokens included;
    balancedness = mean / max GPU load (SGLang's definition), 1.0 = perfect;
  * cross-node traffic = distinct remote nodes among the token's chosen replicas;
  * bytes, DeepEP-style: a copy of the token goes once to every distinct destination GPU on its
    own node other than its own GPU (NVLink); once over the network to every distinct remote
    destination node, landing on the GPU with the sender's local rank, then NVLink-forwarded once
    to every other distinct destination GPU of that node. Dispatch sends FP8 activations
    (hidden + hidden/128 float32 scales), combine returns bf16 (2 * hidden) along the same edges.

`migration_bytes` prices a rebalance in DeepSeek-V3 expert weights (FP8 gate/up/down + 128x128
block scales). `simulate` runs algorithms side by side on the same trace and topology, re-planning
every `rebalance_every` steps from the previous window's co-activation statistics.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from sglang_h20.eplb.placement import ALGORITHMS, DEFAULT_AFFINITY, Placement, Topology, place
from sglang_h20.eplb.stats import CoactivationStats

HIDDEN = 7168
MOE_INTERMEDIATE = 2048
DISPATCH_BYTES = HIDDEN + HIDDEN // 128 * 4  # FP8 activations + one float32 scale per 128
COMBINE_BYTES = HIDDEN * 2  # bf16
EXPERT_WEIGHT_BYTES = 3 * MOE_INTERMEDIATE * HIDDEN  # gate, up, down in FP8
EXPERT_SCALE_BYTES = 3 * (MOE_INTERMEDIATE // 128) * (HIDDEN // 128) * 4  # 128x128 blocks, float32
EXPERT_BYTES = EXPERT_WEIGHT_BYTES + EXPERT_SCALE_BYTES

SGLANG_ALGORITHMS = ("deepseek", "deepseek_hierarchical")  # SGLang's own EPLB
TRIVIAL = "trivial"  # SGLang without EPLB: slot s holds expert s % E (built in, needs no `place`)
TOPOLOGIES = {"ep16": (2, 8), "ep32": (4, 8), "ep64": (8, 8)}  # name -> (nodes, GPUs per node)


# --- topology helpers -------------------------------------------------------------------------------------------

def make_topology(name: str, num_experts: int = 256, redundant_slots: int = 0) -> Topology:
    """EP16/EP32/EP64 of 8-GPU nodes; slots_per_gpu = num_experts / GPUs + redundant_slots (per GPU)."""
    try:
        nodes, gpn = TOPOLOGIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown topology {name!r}; known: {', '.join(TOPOLOGIES)}") from None
    gpus = nodes * gpn
    if num_experts % gpus:
        raise ValueError(f"{num_experts} experts do not divide over {gpus} GPUs ({name})")
    return Topology(nodes, gpn, num_experts // gpus + redundant_slots)


def trivial_placement(topo: Topology, num_layers: int, num_experts: int) -> Placement:
    """SGLang's initial layout (ExpertLocationMetadata.init_trivial): slot s holds s % num_experts."""
    row = np.arange(topo.num_slots, dtype=np.int64) % num_experts
    return Placement(np.tile(row, (num_layers, 1)), topo, num_experts, TRIVIAL)


def token_origins(num_tokens: int, topo: Topology, token_node: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(node [T], gpu [T]) of each token: node t % num_nodes unless given; GPUs dealt round-robin
    over a node's GPUs in token order."""
    if token_node is None:
        node = np.arange(num_tokens, dtype=np.int64) % topo.num_nodes
    else:
        node = np.asarray(token_node, dtype=np.int64)
        if node.shape != (num_tokens,):
            raise ValueError(f"token_node has shape {node.shape}, expected ({num_tokens},)")
        if len(node) and (node.min() < 0 or node.max() >= topo.num_nodes):
            raise ValueError("token_node out of range")
    ordinal = np.empty(num_tokens, dtype=np.int64)
    for n in range(topo.num_nodes):
        idx = np.nonzero(node == n)[0]
        ordinal[idx] = np.arange(len(idx))
    return node, node * topo.gpus_per_node + ordinal % topo.gpus_per_node


# --- evaluation --------------------------------------------------------------------------------------------------

def choose_slots(placement: Placement, topk_ids: np.ndarray, token_node: np.ndarray) -> np.ndarray:
    """Physical slot [L, T, K] each (token, expert) is sent to (-1 where the id is padding)."""
    topo = placement.topology
    L, T, K = topk_ids.shape
    N, E = topo.num_nodes, placement.num_experts
    slot_node = topo.slot_node()
    valid = topk_ids >= 0
    ids = np.where(valid, topk_ids, 0)
    t = np.arange(T, dtype=np.int64)[:, None]
    key_node = token_node[:, None]
    out = np.empty((L, T, K), dtype=np.int64)
    for layer in range(L):
        row = placement.phy2log[layer]
        order = np.argsort(row, kind="stable")  # slots grouped by expert, ascending
        counts = np.bincount(row, minlength=E)
        starts = np.cumsum(counts) - counts
        nkey = row * N + slot_node
        norder = np.argsort(nkey, kind="stable")  # slots grouped by (expert, node)
        ncounts = np.bincount(nkey, minlength=E * N)
        nstarts = np.cumsum(ncounts) - ncounts
        e = ids[layer]
        pick = (t * 2654435761 + e * 40503) % 2147483647  # decorrelated from t % N (token origin)
        en = e * N + key_node
        lc = ncounts[en]
        local = norder[np.minimum(nstarts[en] + pick % np.maximum(lc, 1), len(row) - 1)]
        c = counts[e]
        if (c[valid[layer]] == 0).any():
            raise ValueError(f"layer {layer}: a routed expert has no replica in the placement")
        anywhere = order[np.minimum(starts[e] + pick % np.maximum(c, 1), len(row) - 1)]
        out[layer] = np.where(lc > 0, local, anywhere)
    out[~valid] = -1
    return out


def _distinct_sorted(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort along the last axis; mask of first occurrences of values >= 0."""
    s = np.sort(a, axis=-1)
    first = np.ones(s.shape, dtype=bool)
    first[..., 1:] = s[..., 1:] != s[..., :-1]
    return s, first & (s >= 0)


def evaluate(placement: Placement, topk_ids: np.ndarray, token_node: np.ndarray | None = None) -> dict:
    """Metrics of `placement` on one step of routing topk_ids [L, T, K] (logical ids, -1 = padding).

    token_node [T]: node each token originates on (default t % num_nodes).
    Returns (sums are over all layers and tokens of this topk_ids, i.e. per step):
      balancedness: mean over layers of mean/max GPU load; balancedness_per_layer [L];
      gpu_load [L, GPUs] (int array);
      cross_node_mean: distinct remote nodes per token per layer, averaged;
      cross_node_per_layer [L]; cross_node_total: summed over tokens and layers;
      nvlink_copies / network_copies: token copies sent over NVLink / network (per direction);
      dispatch_nvlink_bytes, dispatch_network_bytes, combine_nvlink_bytes, combine_network_bytes,
      nvlink_bytes, network_bytes (dispatch + combine); tokens; layers.
    """
    topo = placement.topology
    topk_ids = np.asarray(topk_ids, dtype=np.int64)
    if topk_ids.ndim != 3:
        raise ValueError(f"topk_ids must be [L, T, K], got shape {topk_ids.shape}")
    L, T, K = topk_ids.shape
    if placement.phy2log.shape[0] != L:
        raise ValueError(f"placement has {placement.phy2log.shape[0]} layers, trace has {L}")
    if topk_ids.max(initial=-1) >= placement.num_experts:
        raise ValueError("trace routes to an expert id >= num_experts of the placement")
    G = topo.gpus_per_node
    node, gpu = token_origins(T, topo, token_node)
    slot = choose_slots(placement, topk_ids, node)
    valid = slot >= 0
    slot_gpu = topo.slot_gpu()
    dst_gpu = np.where(valid, slot_gpu[np.maximum(slot, 0)], -1)
    dst_node = np.where(valid, dst_gpu // G, -1)

    ng = topo.num_gpus
    lidx = np.broadcast_to(np.arange(L)[:, None, None], slot.shape)
    load = np.bincount((lidx * ng + dst_gpu)[valid], minlength=L * ng).reshape(L, ng)
    mx = load.max(axis=1)
    bal = np.where(mx > 0, load.mean(axis=1) / np.maximum(mx, 1), 1.0)

    src_gpu = gpu[None, :, None]
    src_node = node[None, :, None]
    g, gfirst = _distinct_sorted(dst_gpu)
    gnode = g // G
    same_node = gfirst & (gnode == src_node) & (g != src_gpu)
    forward = gfirst & (gnode != src_node) & (g % G != src_gpu % G)
    nvlink = same_node.sum() + forward.sum()
    n, nfirst = _distinct_sorted(dst_node)
    remote = nfirst & (n != src_node)
    remote_per_token = remote.sum(axis=-1)  # [L, T]
    network = remote_per_token.sum()
    return {
        "balancedness": float(bal.mean()),
        "balancedness_per_layer": bal.tolist(),
        "gpu_load": load,
        "cross_node_mean": float(remote_per_token.mean()) if T else 0.0,
        "cross_node_per_layer": (remote_per_token.mean(axis=1) if T else np.zeros(L)).tolist(),
        "cross_node_total": int(network),
        "nvlink_copies": int(nvlink),
        "network_copies": int(network),
        "dispatch_nvlink_bytes": int(nvlink) * DISPATCH_BYTES,
        "dispatch_network_bytes": int(network) * DISPATCH_BYTES,
        "combine_nvlink_bytes": int(nvlink) * COMBINE_BYTES,
        "combine_network_bytes": int(network) * COMBINE_BYTES,
        "nvlink_bytes": int(nvlink) * (DISPATCH_BYTES + COMBINE_BYTES),
        "network_bytes": int(network) * (DISPATCH_BYTES + COMBINE_BYTES),
        "tokens": T,
        "layers": L,
    }


def migration_bytes(old: Placement, new: Placement, expert_bytes: int = EXPERT_BYTES) -> dict:
    """Expert-weight bytes a rebalance old -> new moves.

    Every (layer, slot) whose expert changes must receive the new expert's weights: a `local` copy
    when the same GPU already held that expert (in another slot) in `old`, over `nvlink` when another
    GPU of the same node held it, else over the `network`. Returns bytes per kind, `total`, and the
    number of expert copies per kind (`copies_local`, ...).
    """
    if old.topology != new.topology or old.phy2log.shape != new.phy2log.shape:
        raise ValueError("placements differ in topology or shape")
    if old.num_experts != new.num_experts:
        raise ValueError("placements differ in num_experts")
    topo = old.topology
    L, S = old.phy2log.shape
    E = old.num_experts
    slot_gpu = topo.slot_gpu()
    slot_node = topo.slot_node()
    lidx = np.repeat(np.arange(L), S)
    on_gpu = np.zeros((L, topo.num_gpus, E), dtype=bool)
    on_gpu[lidx, np.tile(slot_gpu, L), old.phy2log.ravel()] = True
    on_node = on_gpu.reshape(L, topo.num_nodes, topo.gpus_per_node, E).any(axis=2)
    changed = new.phy2log != old.phy2log
    ll, ss = np.nonzero(changed)
    e = new.phy2log[ll, ss]
    local = on_gpu[ll, slot_gpu[ss], e]
    nvl = ~local & on_node[ll, slot_node[ss], e]
    net = ~local & ~nvl
    c = {"local": int(local.sum()), "nvlink": int(nvl.sum()), "network": int(net.sum())}
    out = {k: v * expert_bytes for k, v in c.items()}
    out["total"] = sum(out.values())
    out.update({f"copies_{k}": v for k, v in c.items()})
    return out


def coactivation(steps: Iterable[np.ndarray], num_experts: int) -> CoactivationStats:
    """CoactivationStats of several steps: the same counts as CoactivationStats.add_topk_ids (a token
    counts an expert once; ids < 0 are padding), from K x K pair counts instead of dense one-hots."""
    stats = None
    E = num_experts
    for ids in steps:
        ids = np.sort(np.asarray(ids, dtype=np.int64), axis=-1)
        L, T, K = ids.shape
        if stats is None:
            stats = CoactivationStats.empty(L, E)
        dup = np.zeros(ids.shape, dtype=bool)
        dup[..., 1:] = ids[..., 1:] == ids[..., :-1]
        ids = np.where(dup, -1, ids)
        pair = ids[..., :, None] * E + ids[..., None, :]  # [L, T, K, K]
        ok = (ids[..., :, None] >= 0) & (ids[..., None, :] >= 0)
        flat = (np.arange(L)[:, None, None, None] * (E * E) + pair)[ok]
        stats.coact += np.bincount(flat, minlength=L * E * E).reshape(L, E, E)
        stats.tokens += T
    if stats is None:
        raise ValueError("no steps")
    return stats


# --- driver ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SimConfig:
    topologies: tuple[str, ...] = ("ep16", "ep32", "ep64")
    structures: tuple[str, ...] = ("clusters", "none")  # synthetic traces with / without co-activation
    algorithms: tuple[str, ...] = ALGORITHMS
    layers: int = 8
    num_experts: int = 256
    top_k: int = 8
    tokens_per_step: int = 4096
    steps: int = 40
    warmup: int = 8  # steps of statistics before the first plan
    rebalance_every: int = 8  # re-plan every N steps from the previous N steps' statistics
    redundant_slots: int = 0  # extra slots per GPU (SGLang --ep-num-redundant-experts = this x GPUs)
    affinity: float = DEFAULT_AFFINITY
    seed: int = 0
    skew: float = 0.4
    drift: float = 0.05
    clusters: int = 16  # number of co-activation clusters of the "clusters" structure
    cluster_strength: float = 0.75
    dump: str | None = None  # SGLang per_token dump (file or directory) instead of synthetic traces


Placer = Callable[..., Placement]


def _traces(cfg: SimConfig, progress: bool = False) -> dict[str, list[np.ndarray]]:
    if cfg.dump:
        from sglang_h20.eplb.trace import read_sglang_dump

        d = read_sglang_dump(cfg.dump)
        if d.num_experts > cfg.num_experts:
            raise ValueError(f"dump has {d.num_experts} experts, config {cfg.num_experts}")
        return {"dump": d.steps}
    from sglang_h20.eplb.trace import synthetic_trace

    out = {}
    for structure in cfg.structures:
        if structure not in ("clusters", "none"):
            raise ValueError(f"unknown structure {structure!r} (clusters, none)")
        trace = synthetic_trace(
            cfg.layers, cfg.num_experts, cfg.top_k, cfg.tokens_per_step, cfg.steps, skew=cfg.skew,
            drift=cfg.drift, clusters=cfg.clusters if structure == "clusters" else None,
            cluster_strength=cfg.cluster_strength, seed=cfg.seed)
        bar = _progress(cfg.steps, progress)
        bar.set_description(f"trace {structure}")
        out[structure] = []
        for step in trace:
            out[structure].append(step)
            bar.update(1)
        bar.close()
    return out


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, disable=not enabled, unit="step", dynamic_ncols=True)
    except ImportError:
        return _Progress(total, enabled)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.desc = total, 0, enabled, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.enabled:
            print(f"\r{self.desc} {self.n}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)

    @staticmethod
    def write(msg: str, file=None) -> None:
        print(msg, file=file or sys.stderr)


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def simulate(cfg: SimConfig, *, placer: Placer | None = None, progress: bool = True,
             command: str | None = None) -> dict:
    """Run every algorithm of cfg on every topology and trace; return the JSON-able record.

    Timeline per trace: statistics of steps [0, warmup) -> first plan (migration from SGLang's trivial
    layout) -> evaluate steps [warmup, warmup + rebalance_every) -> re-plan from those steps' statistics
    (migration old -> new) -> ... until the trace ends. Algorithm "trivial" (no EPLB) needs no placer;
    the others call placer(stats, topology, algorithm, affinity=, seed=), by default
    sglang_h20.eplb.placement.place.
    """
    from sglang_h20 import provenance

    if cfg.warmup < 1 or cfg.rebalance_every < 1:
        raise ValueError("warmup and rebalance_every must be >= 1")
    placer = placer or place
    topos = {name: make_topology(name, cfg.num_experts, cfg.redundant_slots) for name in cfg.topologies}
    traces = _traces(cfg, progress)
    plans = {}
    for structure, steps in traces.items():
        if len(steps) <= cfg.warmup:
            raise ValueError(f"{structure}: {len(steps)} steps, need more than warmup={cfg.warmup}")
        points = list(range(cfg.warmup, len(steps), cfg.rebalance_every))
        windows = [(0, cfg.warmup)] + [(p - cfg.rebalance_every, p) for p in points[1:]]
        plans[structure] = [(p, coactivation(steps[a:b], cfg.num_experts), (p, min(p + cfg.rebalance_every,
                             len(steps)))) for p, (a, b) in zip(points, windows)]
    total = sum(len(topos) * len(cfg.algorithms) * (len(steps) - cfg.warmup) for steps in traces.values())
    bar = _progress(total, progress)
    results: dict = {}
    t0 = time.time()
    try:
        for structure, steps in traces.items():
            L = steps[0].shape[0]
            results[structure] = {}
            for tname, topo in topos.items():
                algs = {}
                for alg in cfg.algorithms:
                    bar.set_description(f"{structure} {tname} {alg}")
                    current = trivial_placement(topo, L, cfg.num_experts)
                    per_step, migrations, plan_s, window_load = [], [], 0.0, None
                    error = None
                    for i, (point, stats, (lo, hi)) in enumerate(plans[structure]):
                        if alg == TRIVIAL:
                            new = current
                        else:
                            tp = time.perf_counter()
                            try:
                                new = placer(stats, topo, alg, affinity=cfg.affinity, seed=cfg.seed)
                            except ValueError as e:  # e.g. an algorithm without replication + redundant slots
                                error = f"{type(e).__name__}: {e}"
                                break
                            plan_s += time.perf_counter() - tp
                            if new.topology != topo or new.phy2log.shape != (L, topo.num_slots):
                                raise ValueError(f"{alg}: placement of shape {new.phy2log.shape} on "
                                                 f"{new.topology}, expected {(L, topo.num_slots)} on {topo}")
                            new.validate()
                        mig = migration_bytes(current, new)
                        migrations.append({"step": point, "from": "initial" if i == 0 else "previous", **mig})
                        current = new
                        for s in range(lo, hi):
                            m = evaluate(current, steps[s])
                            load = m.pop("gpu_load")
                            window_load = load if window_load is None else window_load + load
                            per_step.append(m)
                            bar.update(1)
                    if error is not None:
                        bar.update(len(steps) - cfg.warmup - len(per_step))
                        algs[alg] = {"error": error}
                        bar.write(f"{structure} {tname} {alg}: skipped ({error})", file=sys.stderr)
                        continue
                    rebal = [m["total"] for m in migrations[1:]]
                    algs[alg] = {
                        "balancedness": _mean([m["balancedness"] for m in per_step]),
                        "balancedness_min": float(min(m["balancedness"] for m in per_step)),
                        # over the whole evaluation window, as SGLang's EPLB accounts load (per layer, averaged)
                        "balancedness_window": float((window_load.mean(axis=1) / window_load.max(axis=1)).mean()),
                        "balancedness_per_layer": np.mean([m["balancedness_per_layer"] for m in per_step],
                                                          axis=0).tolist(),
                        "cross_node_mean": _mean([m["cross_node_mean"] for m in per_step]),
                        "cross_node_per_layer": np.mean([m["cross_node_per_layer"] for m in per_step],
                                                        axis=0).tolist(),
                        "cross_node_total_per_step": _mean([m["cross_node_total"] for m in per_step]),
                        "nvlink_bytes_per_step": _mean([m["nvlink_bytes"] for m in per_step]),
                        "network_bytes_per_step": _mean([m["network_bytes"] for m in per_step]),
                        "tokens_per_step": _mean([m["tokens"] for m in per_step]),
                        "evaluated_steps": len(per_step),
                        "migrations": migrations,
                        "migration_bytes_per_rebalance": _mean(rebal),
                        "plan_seconds": plan_s,
                    }
                results[structure][tname] = {"topology": dataclasses.asdict(topo), "algorithms": algs}
    finally:
        bar.close()
    return {
        "kind": "eplb_simulate",
        "provenance": provenance.record(command),
        "config": dataclasses.asdict(cfg),
        "constants": {"hidden": HIDDEN, "dispatch_bytes_per_copy": DISPATCH_BYTES,
                      "combine_bytes_per_copy": COMBINE_BYTES, "expert_bytes": EXPERT_BYTES},
        "model": __doc__.split("\n\n")[1],
        "results": results,
        "summary": summarize(results),
        "seconds": round(time.time() - t0, 2),
    }


def summarize(results: dict) -> dict:
    """Per trace and topology: affinity's cross-node traffic vs the best SGLang EPLB algorithm."""
    out: dict = {}
    for structure, by_topo in results.items():
        for tname, r in by_topo.items():
            algs = {a: v for a, v in r["algorithms"].items() if "error" not in v}
            row = {"cross_node_mean": {a: v["cross_node_mean"] for a, v in algs.items()},
                   "balancedness": {a: v["balancedness"] for a, v in algs.items()},
                   "balancedness_window": {a: v["balancedness_window"] for a, v in algs.items()}}
            sg = [a for a in SGLANG_ALGORITHMS if a in algs]
            if sg and "affinity" in algs:
                best = min(sg, key=lambda a: algs[a]["cross_node_mean"])
                b, a = algs[best]["cross_node_mean"], algs["affinity"]["cross_node_mean"]
                row.update({
                    "best_sglang": best, "best_sglang_cross_node_mean": b, "affinity_cross_node_mean": a,
                    "affinity_reduction_pct": (b - a) / b * 100.0 if b > 0 else 0.0,
                    "best_sglang_balancedness": algs[best]["balancedness"],
                    "affinity_balancedness": algs["affinity"]["balancedness"],
                    "best_sglang_balancedness_window": algs[best]["balancedness_window"],
                    "affinity_balancedness_window": algs["affinity"]["balancedness_window"],
                })
            out.setdefault(structure, {})[tname] = row
    return out


# --- output ------------------------------------------------------------------------------------------------------

def _grouped_bars(ax, topos, algs, value, ylabel, title, fmt=None):
    w = 0.8 / max(len(algs), 1)
    x = np.arange(len(topos))
    for i, a in enumerate(algs):
        vals = [value(t, a) for t in topos]
        bars = ax.bar(x + (i - (len(algs) - 1) / 2) * w, vals, w, label=a)
        if fmt:
            ax.bar_label(bars, labels=[fmt(v) if np.isfinite(v) else "n/a" for v in vals], fontsize=6, rotation=90,
                         padding=2)
    ax.set_xticks(x, [t.upper() for t in topos])
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def plot(record: dict, out: Path) -> list[Path]:
    """PNGs: cross_node_traffic, balancedness, bytes (network vs NVLink), migration (over time)."""
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()

    out = Path(out)
    res = record["results"]
    structures = list(res)
    topos = list(next(iter(res.values())))
    algs = list(next(iter(next(iter(res.values())).values()))["algorithms"])
    files = []
    ncol = len(structures)

    def save(fig, name):
        fig.tight_layout()
        path = out / name
        save_png(fig, path, dpi=120)
        files.append(path)

    def value(s, t, a, key):
        v = res[s][t]["algorithms"].get(a, {})
        return v.get(key, np.nan)  # nan: the algorithm did not run there (see its "error")
    for name, key, ylabel, fmt in (
            ("cross_node_traffic.png", "cross_node_mean", "remote nodes per token per layer", "{:.2f}"),
            ("balancedness.png", "balancedness", "balancedness (mean / max GPU load)", "{:.2f}")):
        fig, axes = plt.subplots(1, ncol, figsize=(5.5 * ncol, 4), squeeze=False)
        for ax, s in zip(axes[0], structures):
            _grouped_bars(ax, topos, algs, lambda t, a: value(s, t, a, key), ylabel, f"trace: {s}",
                          fmt=fmt.format)
            if key == "balancedness":
                ax.set_ylim(0, 1.1)
        axes[0][0].legend(fontsize=7)
        save(fig, name)

    fig, axes = plt.subplots(2, ncol, figsize=(5.5 * ncol, 7), squeeze=False)
    for j, s in enumerate(structures):
        for i, (key, label) in enumerate((("network_bytes_per_step", "network"),
                                          ("nvlink_bytes_per_step", "NVLink"))):
            _grouped_bars(axes[i][j], topos, algs, lambda t, a: value(s, t, a, key) / 1e9,
                          f"{label} GB per step (dispatch+combine)", f"trace: {s}: {label}")
    axes[0][0].legend(fontsize=7)
    save(fig, "bytes.png")

    fig, axes = plt.subplots(ncol, len(topos), figsize=(4.5 * len(topos), 3.5 * ncol), squeeze=False)
    for i, s in enumerate(structures):
        for j, t in enumerate(topos):
            ax = axes[i][j]
            for a in algs:
                m = value(s, t, a, "migrations")
                if not isinstance(m, list):
                    continue
                ax.plot([x["step"] for x in m], [x["total"] / 1e9 for x in m], marker="o", label=a)
            ax.set_title(f"{s} {t.upper()}")
            ax.set_xlabel("rebalance at step (first: from trivial layout)")
            ax.set_ylabel("expert weights moved, GB")
    axes[0][0].legend(fontsize=7)
    save(fig, "migration.png")
    return files


def write(record: dict, out: Path) -> tuple[Path, list[Path]]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "eplb_simulate.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path, plot(record, out)


def format_summary(record: dict) -> str:
    lines = []
    for s, by_topo in record["results"].items():
        for t, r in by_topo.items():
            lines.append(f"[{s}] {t.upper()}  (cross-node = remote nodes/token/layer; bal = balancedness; "
                         f"net/nvl = GB per step; mig = GB per rebalance)")
            for a, v in r["algorithms"].items():
                if "error" in v:
                    lines.append(f"  {a:<22} skipped: {v['error']}")
                    continue
                lines.append(f"  {a:<22} cross-node {v['cross_node_mean']:.3f}  bal {v['balancedness']:.3f} "
                             f"(window {v['balancedness_window']:.3f})  "
                             f"net {v['network_bytes_per_step'] / 1e9:.2f}  nvl {v['nvlink_bytes_per_step'] / 1e9:.2f}"
                             f"  mig {v['migration_bytes_per_rebalance'] / 1e9:.2f}")
            sm = record["summary"][s][t]
            if "affinity_reduction_pct" in sm:
                lines.append(f"  affinity vs best SGLang EPLB ({sm['best_sglang']}): cross-node "
                             f"{sm['affinity_reduction_pct']:+.1f}% reduction; balancedness "
                             f"{sm['affinity_balancedness']:.3f} vs {sm['best_sglang_balancedness']:.3f}")
    return "\n".join(lines)
