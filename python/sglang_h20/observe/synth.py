"""Recorded-like observe dumps with injected faults, for demos and detector tests.

The model of one sampled decode pass of an EP MoE model (DeepSeek-V3 shapes by default):

* every (rank, layer, stage) has a base time x a fixed per-layer factor x lognormal noise
  (sigma 4%), plus a per-pass factor shared by all ranks (sigma 2%);
* layers < first_dense are dense (dense_mlp); the others are MoE with E experts, top-k routing
  of `tokens` tokens per rank, drawn from per-layer expert popularities (Gamma(50), cv ~14%);
  expert e is hosted on rank e // (E / ranks);
* routed-expert time on a rank grows with the tokens it receives: base x (0.3 + 0.7 x load/mean);
* EP collectives wait for the slowest peer: dispatch_r = own + (max_r' pre_r' - pre_r), where
  pre = attention + router + layer_other, and combine_r = own + (max_r' experts_r' - experts_r).
  A slow rank therefore makes its *peers'* dispatch/combine longer, not its own. This is the
  pattern the detector must not misread as a communication fault;
* each rank's record carries its row of a rank x rank latency matrix (base 20 us inside a node
  of `ranks_per_node`, 50 us across nodes, noise 5%).

Injections (comma-separated, factor after `x`, defaults in brackets):
    slow-rank:R[x1.5]            compute stages of rank R slower
    slow-stage:STAGE@rankR[x2]   one stage of rank R slower (e.g. dispatch@rank5)
    hot-expert:E[x16]            expert E's popularity x factor in every MoE layer
    spike:STAGE@rankR:S[x3]      one pass (index S of the sampled passes) of one stage
    slow-link:A-B[x4]            latency A->B and B->A
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from sglang_h20.observe.recorder import OUTSIDE, STAGES, balancedness, rank_loads

BASE_MS = {"attention": 0.060, "router": 0.012, "dispatch": 0.045, "routed_experts": 0.070,
           "combine": 0.050, "shared_expert": 0.022, "dense_mlp": 0.080, "moe_other": 0.006,
           "layer_other": 0.014}
PRE_DISPATCH = ("attention", "router", "layer_other")
SLOW_RANK_STAGES = ("attention", "router", "routed_experts", "shared_expert", "dense_mlp",
                    "moe_other", "layer_other")
DEFAULT_FACTOR = {"slow-rank": 1.5, "slow-stage": 2.0, "hot-expert": 16.0, "spike": 3.0, "slow-link": 4.0}


@dataclasses.dataclass(frozen=True)
class Injection:
    kind: str
    factor: float
    rank: int | None = None
    stage: str | None = None
    expert: int | None = None
    step: int | None = None
    peer: int | None = None


_PATTERNS = {
    "slow-rank": re.compile(r"^(?P<rank>\d+)$"),
    "slow-stage": re.compile(r"^(?P<stage>[a-z_]+)@rank(?P<rank>\d+)$"),
    "hot-expert": re.compile(r"^(?P<expert>\d+)$"),
    "spike": re.compile(r"^(?P<stage>[a-z_]+)@rank(?P<rank>\d+):(?P<step>\d+)$"),
    "slow-link": re.compile(r"^(?P<rank>\d+)-(?P<peer>\d+)$"),
}


def parse_injections(text: str | None) -> list[Injection]:
    """'slow-rank:3,slow-stage:dispatch@rank5x2.5,hot-expert:17' -> [Injection, ...]."""
    out = []
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        kind, _, arg = item.partition(":")
        if kind not in _PATTERNS:
            raise ValueError(f"unknown injection {kind!r} in {item!r} (known: {', '.join(_PATTERNS)})")
        factor = DEFAULT_FACTOR[kind]
        m = re.match(r"^(?P<arg>.*?)x(?P<f>\d+(?:\.\d+)?)$", arg)
        if m and _PATTERNS[kind].match(m["arg"]):
            arg, factor = m["arg"], float(m["f"])
        m = _PATTERNS[kind].match(arg)
        if not m:
            raise ValueError(f"cannot parse {item!r}: expected {kind}:{_PATTERNS[kind].pattern}")
        g = {k: (v if k == "stage" else int(v)) for k, v in m.groupdict().items()}
        if g.get("stage") is not None and g["stage"] not in STAGES:
            raise ValueError(f"{item!r}: unknown stage {g['stage']!r} (stages: {', '.join(STAGES)})")
        out.append(Injection(kind, factor, **g))
    return out


def synthesize(ranks: int = 8, layers: int = 61, steps: int = 50, inject=(), seed: int = 0,
               experts: int = 256, topk: int = 8, tokens: int = 64, first_dense: int = 3,
               ranks_per_node: int = 8, step_stride: int = 100, graph_refs: bool = True) -> list[dict]:
    """Records (export schema) of `steps` sampled passes on every rank, sorted by (step, rank)."""
    if isinstance(inject, str):
        inject = parse_injections(inject)
    for inj in inject:
        for r in (inj.rank, inj.peer):
            if r is not None and not 0 <= r < ranks:
                raise ValueError(f"injection {inj} names rank {r}, outside 0..{ranks - 1}")
        if inj.step is not None and not 0 <= inj.step < steps:
            raise ValueError(f"injection {inj} names pass index {inj.step}, outside 0..{steps - 1}")
        if inj.expert is not None and not 0 <= inj.expert < experts:
            raise ValueError(f"injection {inj} names expert {inj.expert}, outside 0..{experts - 1}")
    rng = np.random.default_rng(seed)
    R, L, K = ranks, layers, len(STAGES)
    per_rank = -(-experts // R)
    moe_layers = [l for l in range(L) if l >= first_dense]
    layer_factor = 1.0 + 0.15 * np.sin(np.arange(L) / 5.0) + rng.normal(0, 0.03, L)
    popularity = rng.gamma(50.0, 1.0, size=(L, experts))
    for inj in inject:
        if inj.kind == "hot-expert":
            popularity[:, inj.expert] *= inj.factor
    popularity /= popularity.sum(axis=1, keepdims=True)
    stage_ix = {s: i for i, s in enumerate(STAGES)}
    base = np.array([BASE_MS[s] for s in STAGES])

    # latency matrix (fixed per run, noisy per record)
    node = np.arange(R) // max(1, ranks_per_node)
    lat_base = np.where(node[:, None] == node[None, :], 0.020, 0.050)
    np.fill_diagonal(lat_base, 0.0)
    for inj in inject:
        if inj.kind == "slow-link":
            lat_base[inj.rank, inj.peer] *= inj.factor
            lat_base[inj.peer, inj.rank] *= inj.factor

    records = []
    for si in range(steps):
        step = (si + 1) * step_stride
        ts = 1.7e9 + si * 3.0
        t = np.empty((R, L, K))
        step_factor = float(np.exp(rng.normal(0, 0.02)))
        noise = np.exp(rng.normal(0, 0.04, size=(R, L, K)))
        t[:] = base[None, None, :] * layer_factor[None, :, None] * noise * step_factor
        dense = np.array([l < first_dense for l in range(L)])
        moe_only = [stage_ix[s] for s in ("router", "dispatch", "routed_experts", "combine",
                                          "shared_expert", "moe_other")]
        for k in moe_only:
            t[:, dense, k] = 0.0
        t[:, ~dense, stage_ix["dense_mlp"]] = 0.0
        # routing and received load
        counts = np.zeros((R, L, experts), dtype=np.int64)
        for l in moe_layers:
            counts[:, l] = rng.multinomial(tokens * topk, popularity[l], size=R)
        recv = rank_loads(counts.sum(axis=0), per_rank, R)  # [L, R]
        mean_recv = np.where(recv.mean(axis=1, keepdims=True) > 0, recv.mean(axis=1, keepdims=True), 1.0)
        ratio = recv / mean_recv  # [L, R]
        ke = stage_ix["routed_experts"]
        t[:, ~dense, ke] *= (0.3 + 0.7 * ratio[~dense].T)
        # compute faults before the waits they cause
        for inj in inject:
            if inj.kind == "slow-rank":
                for s in SLOW_RANK_STAGES:
                    t[inj.rank, :, stage_ix[s]] *= inj.factor
            elif inj.kind == "slow-stage" and inj.stage not in ("dispatch", "combine"):
                t[inj.rank, :, stage_ix[inj.stage]] *= inj.factor
            elif inj.kind == "spike" and inj.step == si and inj.stage not in ("dispatch", "combine"):
                t[inj.rank, :, stage_ix[inj.stage]] *= inj.factor
        # collective waits (MoE layers only)
        pre = t[:, :, [stage_ix[s] for s in PRE_DISPATCH]].sum(axis=2)  # [R, L]
        wait_d = pre.max(axis=0, keepdims=True) - pre
        wait_c = t[:, :, ke].max(axis=0, keepdims=True) - t[:, :, ke]
        t[:, ~dense, stage_ix["dispatch"]] += wait_d[:, ~dense]
        t[:, ~dense, stage_ix["combine"]] += wait_c[:, ~dense]
        for inj in inject:  # local communication faults
            if inj.kind == "slow-stage" and inj.stage in ("dispatch", "combine"):
                t[inj.rank, ~dense, stage_ix[inj.stage]] *= inj.factor
            elif inj.kind == "spike" and inj.step == si and inj.stage in ("dispatch", "combine"):
                t[inj.rank, ~dense, stage_ix[inj.stage]] *= inj.factor
        outside = 0.35 * step_factor * np.exp(rng.normal(0, 0.03, R))
        lat = lat_base * np.exp(rng.normal(0, 0.05, size=(R, R)))
        for r in range(R):
            layers_out = [{"layer": l, "stages": {s: round(float(t[r, l, k]), 6) for k, s in enumerate(STAGES)
                                                   if t[r, l, k] > 0}} for l in range(L)]
            step_ms = float(t[r].sum() + outside[r])
            loads = counts[r, moe_layers].tolist()
            records.append({
                "kind": "stages", "schema": 1, "ts": ts, "rank": r, "step": step, "clock": "synth",
                "mode": "decode", "eager": True, "graph_would_run": True, "batch_size": tokens,
                "num_tokens": tokens, "step_ms": round(step_ms, 6), "cpu_ms": round(step_ms * 1.1, 6),
                "layers": layers_out, "outside": {OUTSIDE: round(float(outside[r]), 6)},
                "coverage": float(t[r].sum() / step_ms),
                "expert_load_layers": moe_layers, "expert_load": loads, "num_experts": experts,
                "experts_per_rank": per_rank, "ep_size": R, "ranks_per_node": ranks_per_node,
                "balancedness": balancedness(counts[r, moe_layers], per_rank, R),
                "peer_latency_ms": [round(float(x), 6) for x in lat[r]],
            })
            if graph_refs:
                records.append({"kind": "graph", "schema": 1, "ts": ts + 1.5, "rank": r,
                                "step": step + step_stride // 2, "mode": "decode", "eager": False,
                                "batch_size": tokens,
                                "step_ms": round(step_ms * 0.62 * float(np.exp(rng.normal(0, 0.02))), 6)})
    records.sort(key=lambda r: (r["step"], r["rank"], r["kind"]))
    return records
