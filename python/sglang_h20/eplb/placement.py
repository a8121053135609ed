"""Where each logical expert lives: physical slots (GPU-major) per layer, for N nodes x G GPUs.

Layout as in SGLang: physical slot s sits on GPU s // slots_per_gpu, and GPU g on node
g // gpus_per_node. `phy2log[l, s]` is the logical expert held by slot s in layer l.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Topology:
    num_nodes: int
    gpus_per_node: int
    slots_per_gpu: int

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def num_slots(self) -> int:
        return self.num_gpus * self.slots_per_gpu

    def slot_gpu(self) -> np.ndarray:
        return np.arange(self.num_slots) // self.slots_per_gpu

    def slot_node(self) -> np.ndarray:
        return self.slot_gpu() // self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Placement:
    phy2log: np.ndarray  # [L, S] int64
    topology: Topology
    num_experts: int
    algorithm: str = ""

    def log2phy(self, layer: int) -> list[np.ndarray]:
        """Per logical expert, the physical slots holding it in `layer`."""
        row = self.phy2log[layer]
        order = np.argsort(row, kind="stable")
        bounds = np.searchsorted(row[order], np.arange(self.num_experts + 1))
        return [order[bounds[e]:bounds[e + 1]] for e in range(self.num_experts)]

    def replica_counts(self) -> np.ndarray:
        """[L, E] number of replicas of each logical expert."""
        L = self.phy2log.shape[0]
        counts = np.zeros((L, self.num_experts), dtype=np.int64)
        np.add.at(counts, (np.repeat(np.arange(L), self.phy2log.shape[1]), self.phy2log.ravel()), 1)
        return counts

    def validate(self) -> None:
        """Every logical expert has >= 1 replica, slot counts are exact, both maps agree."""
        L, S = self.phy2log.shape
        if S != self.topology.num_slots:
            raise ValueError(f"{S} slots per layer, topology has {self.topology.num_slots}")
        if self.phy2log.min() < 0 or self.phy2log.max() >= self.num_experts:
            raise ValueError("slot holds an expert id out of range")
        counts = self.replica_counts()
        if (counts < 1).any():
            l, e = np.argwhere(counts < 1)[0]
            raise ValueError(f"layer {l}: logical expert {e} has no replica")
        for layer in range(L):
            for e, slots in enumerate(self.log2phy(layer)):
                if len(slots) != counts[layer, e] or (self.phy2log[layer, slots] != e).any():
                    raise ValueError(f"layer {layer}: maps disagree for expert {e}")


# --------------------------------------------------------------------------------------------
# Placement algorithms
# --------------------------------------------------------------------------------------------

ALGORITHMS = ("contiguous", "balanced", "deepseek", "deepseek_hierarchical", "affinity")
DEEPSEEK_V3_NUM_GROUPS = 8  # n_group of DeepSeek-V3: 256 routed experts in 8 groups of 32


# locality vs balance of the affinity planner; 0.25 kept balancedness equal or better than SGLang's
# deepseek EPLB with >= 20% less cross-node traffic at EP16 and EP32 on two trace seeds
# (benchmark/results/eplb/, 2 redundant slots per GPU)
DEFAULT_AFFINITY = 0.25


def place(stats, topo: Topology, algorithm: str, *, affinity: float = DEFAULT_AFFINITY, seed: int = 0,
          num_groups: int | None = None) -> Placement:
    """Place the experts of every layer of `stats` (a CoactivationStats) onto `topo`.

    algorithm: "contiguous" (naive split), "balanced" (LPT, no replication), "deepseek" /
    "deepseek_hierarchical" (SGLang's EPLB), "affinity" (ours: co-activated experts share nodes; on a
    single node, GPUs).
    `affinity` (0..1, "affinity" only) trades GPU-load balance (0: pure balance) for
    co-activation locality (1: locality within a ~0.93 balancedness floor); `seed` breaks ties
    ("affinity" is deterministic for a seed); `num_groups`: expert groups for
    "deepseek_hierarchical" (default DeepSeek-V3's 8; must divide E and be divisible by nodes).
    """
    load = np.asarray(stats.load, dtype=np.float64)
    L, E = load.shape
    S = topo.num_slots
    if S < E:
        raise ValueError(f"{S} physical slots cannot hold {E} logical experts")
    if algorithm == "contiguous":
        phy2log = _contiguous(load, topo)
    elif algorithm == "balanced":
        if S != E:
            raise ValueError(f"'balanced' places without replication: needs {E} slots, topology has {S}")
        phy2log = _balanced(load, topo)
    elif algorithm in ("deepseek", "deepseek_hierarchical"):
        phy2log = _deepseek(load, topo, algorithm == "deepseek_hierarchical", num_groups)
    elif algorithm == "affinity":
        if not 0.0 <= affinity <= 1.0:
            raise ValueError(f"affinity must lie in [0, 1], got {affinity}")
        # on one node its GPUs are the locality domains (a token copy per GPU over NVLink, as per node over the
        # network across nodes): the same slot order, each GPU a node of one GPU
        domains = Topology(topo.gpus_per_node, 1, topo.slots_per_gpu) if topo.num_nodes == 1 else topo
        phy2log = _affinity(np.asarray(stats.coact), domains, float(affinity), seed)
    else:
        raise ValueError(f"unknown placement algorithm {algorithm!r}; choose from {ALGORITHMS}")
    return Placement(np.ascontiguousarray(phy2log, dtype=np.int64), topo, E, algorithm)


def _contiguous(load: np.ndarray, topo: Topology) -> np.ndarray:
    """Naive split: GPU g holds a contiguous run of experts (slot e = expert e when S == E).

    Extra slots (S > E) are the tail of each GPU's slots and hold replicas of the heaviest
    experts, heaviest first, so every GPU keeps exactly slots_per_gpu slots.
    """
    L, E = load.shape
    G, k = topo.num_gpus, topo.slots_per_gpu
    base = np.diff((np.arange(G + 1) * E) // G)  # experts per GPU, contiguous runs
    free = np.concatenate([np.arange(g * k + base[g], (g + 1) * k) for g in range(G)]).astype(int)
    used = np.setdiff1d(np.arange(topo.num_slots), free)
    phy2log = np.empty((L, topo.num_slots), dtype=np.int64)
    phy2log[:, used] = np.arange(E)
    heaviest = np.argsort(-load, axis=1, kind="stable")
    phy2log[:, free] = heaviest[:, np.arange(len(free)) % E]
    return phy2log


def _lpt(weight: np.ndarray, num_bins: int, cap: int) -> np.ndarray:
    """Longest-processing-time packing of weight [B, n] into num_bins bins of exactly cap items.

    Returns the bin of each item. Vectorized over the batch axis; n loop steps.
    """
    B, n = weight.shape
    assert n == num_bins * cap
    rows = np.arange(B)
    order = np.argsort(-weight, axis=1, kind="stable")
    loads = np.zeros((B, num_bins))
    fill = np.zeros((B, num_bins), dtype=np.int64)
    out = np.empty((B, n), dtype=np.int64)
    for t in range(n):
        item = order[:, t]
        b = np.argmin(np.where(fill < cap, loads, np.inf), axis=1)
        out[rows, item] = b
        loads[rows, b] += weight[rows, item]
        fill[rows, b] += 1
    return out


def _bins_to_slots(values: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """values/bins [B, n] with exactly n / num_bins items per bin -> values laid out bin-major."""
    order = np.argsort(bins, axis=1, kind="stable")
    return np.take_along_axis(values, order, axis=1)


def _balanced(load: np.ndarray, topo: Topology) -> np.ndarray:
    """One replica per expert; LPT of expert loads onto GPUs with slots_per_gpu each."""
    L, E = load.shape
    gpu = _lpt(load, topo.num_gpus, topo.slots_per_gpu)
    return _bins_to_slots(np.broadcast_to(np.arange(E), (L, E)), gpu)


def _deepseek(load: np.ndarray, topo: Topology, hierarchical: bool, num_groups: int | None) -> np.ndarray:
    """SGLang's installed DeepSeek EPLB (replicate by load/replica, pack with balanced LPT)."""
    import torch
    from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm, rebalance_experts

    L, E = load.shape
    N = topo.num_nodes
    if hierarchical:
        groups = DEEPSEEK_V3_NUM_GROUPS if num_groups is None else num_groups
        if E % groups or groups % N:
            raise ValueError(
                f"deepseek_hierarchical needs num_groups dividing {E} experts and divisible by "
                f"{N} nodes; got num_groups={groups} (pass num_groups=, or use 'deepseek')")
    else:
        groups = 1
    phy2log, _, _ = rebalance_experts(
        tokens_per_expert=torch.from_numpy(load)[None],  # [ranks=1, L, E]; summed over dim 0
        num_physical_experts=topo.num_slots,
        num_local_physical_experts=topo.slots_per_gpu,
        num_groups=groups,
        num_nodes=N,
        algorithm=EplbAlgorithm.deepseek_hierarchical if hierarchical else EplbAlgorithm.deepseek,
    )
    return phy2log.numpy().astype(np.int64)


# --- affinity -------------------------------------------------------------------------------
# Units, per layer: loads are scaled so the mean GPU load is 1; co-activation so that the total
# pair weight (sum over i < j, diagonal excluded) is 1. "cut" is the pair weight between experts
# whose primary copies sit on different nodes: the pairwise proxy (all the stats hold) for the
# remote nodes a token reaches.
#
# The local search minimizes  J = affinity * cut + sum over bins of f(bin load / mean),
#   f(p) = (1 - affinity) * (p - 1)^2 + _HINGE * max(0, p - 1 - slack * affinity)^2,
# bins being nodes in the node phase (slack _NODE_SLACK) and GPUs in the GPU phase (_SLACK):
# a pull to balance that fades as affinity grows, plus a load ceiling that loosens with it.
# At affinity 0 any bin above the mean is penalized (pure balance, like EPLB); at 1 GPUs may run
# _SLACK above the mean (a GPU balancedness floor of about 1 / (1 + _SLACK)) and the cut rules.

_SLACK = 0.08    # GPU-load slack at affinity 1
_NODE_SLACK = 0.04  # node-load slack at affinity 1 (the node phase; GPU packing adds some)
_HINGE = 100.0   # weight of a GPU-load ceiling violation
_COLD = 2        # within-node GPU moves: partner copies come from this many coldest GPUs
_MAX_ROUNDS = 60  # per phase: a time guard (later rounds gain little)
_TOL = 1e-12


def _replica_counts(load: np.ndarray, num_slots: int, max_copies: int) -> np.ndarray:
    """EPLB rule: each extra slot goes to the expert with the highest load per replica."""
    L, E = load.shape
    if num_slots > E * max_copies:
        raise ValueError(f"{num_slots} slots would need more than {max_copies} copies of an expert "
                         f"(affinity keeps at most one copy per node; on one node, per GPU)")
    cnt = np.ones((L, E), dtype=np.int64)
    rows = np.arange(L)
    for _ in range(num_slots - E):
        e = np.argmax(np.where(cnt < max_copies, load / cnt, -np.inf), axis=1)
        cnt[rows, e] += 1
    return cnt


def _penalty(p: np.ndarray, alpha: float, slack: float = _SLACK) -> np.ndarray:
    """f(p) of the objective for a GPU (or node) at p times the mean load."""
    over = np.maximum(0.0, p - 1.0 - slack * alpha)
    return (1.0 - alpha) * (p - 1.0) ** 2 + _HINGE * over * over


class _State:
    """The copies of every layer ([L, S] arrays) and where they sit, with the derived tables
    the local search reads; swap() keeps all of them consistent."""

    def __init__(self, W, e, w, prim, gpu, topo: Topology):
        L, N = e.shape[0], topo.num_nodes
        self.W, self.e, self.w, self.prim, self.topo = W, e, w, prim, topo
        self.repack(gpu)
        rows = np.arange(L)[:, None]
        self.has = np.zeros((L, W.shape[1], N), dtype=bool)  # expert has a copy on node
        self.has[rows, e, self.node] = True
        onehot = np.zeros((L, N, W.shape[1]), dtype=W.dtype)
        onehot[rows, self.node, e] = prim
        self.A = np.matmul(onehot, W).astype(np.float64)  # [L, N, E] weight to node's primaries

    def repack(self, gpu: np.ndarray) -> None:
        """Move copies to other GPUs of the same node (the node tables stay valid)."""
        L, S = gpu.shape
        N, G, k = self.topo.num_nodes, self.topo.gpus_per_node, self.topo.slots_per_gpu
        self.gpu, self.node = gpu, gpu // G
        self.slots = np.argsort(gpu, axis=1, kind="stable").reshape(L, N * G, k)  # copies per GPU
        self.members = self.slots.reshape(L, N, G * k)  # copies per node: a view of slots
        self.pos = np.empty((L, S), dtype=np.int64)  # index of each copy in its node's members
        np.put_along_axis(self.pos, self.members.reshape(L, S), np.tile(np.arange(G * k), N)[None],
                          axis=1)
        self.load = np.zeros((L, N * G))
        np.add.at(self.load, (np.broadcast_to(np.arange(L)[:, None], (L, S)), gpu), self.w)

    def swap(self, l, x, y) -> None:
        """Exchange copies x and y in layers l; within one call a (layer, node) pair is touched
        by at most one swap, so the fancy-indexed updates below never collide."""
        a, b, gx, gy = self.node[l, x], self.node[l, y], self.gpu[l, x], self.gpu[l, y]
        ex, ey = self.e[l, x], self.e[l, y]
        px, py = self.pos[l, x], self.pos[l, y]
        # members is a view of slots: one write moves a copy in both
        self.members[l, a, px], self.members[l, b, py] = y, x
        self.pos[l, x], self.pos[l, y] = py, px
        self.node[l, x], self.node[l, y] = b, a
        self.gpu[l, x], self.gpu[l, y] = gy, gx
        dw = self.w[l, x] - self.w[l, y]
        self.load[l, gx] -= dw
        self.load[l, gy] += dw
        cross = a != b
        if cross.any():
            l, a, b, ex, ey, x, y = (v[cross] for v in (l, a, b, ex, ey, x, y))
            self.has[l, ex, a] = self.has[l, ey, b] = False
            self.has[l, ex, b] = self.has[l, ey, a] = True
            delta = (self.W[l, ex] * self.prim[l, x][:, None]
                     - self.W[l, ey] * self.prim[l, y][:, None])  # rows: W is symmetric
            self.A[l, a] -= delta
            self.A[l, b] += delta


def _affinity(coact: np.ndarray, topo: Topology, alpha: float, seed: int) -> np.ndarray:
    """Co-activation-aware placement.

    (a) replica counts by the EPLB rule, at most one copy of an expert per node;
    (b) node partition of the copies: greedy seeded growth, then swaps on cut + node balance;
    (c) LPT of each node's copies onto its GPUs, then swaps on cut + GPU balance.
    Extra copies of hot experts land on other nodes than the primary by construction, so more
    nodes serve them locally; the cut counts primaries only (a token reaching a replica's node
    anyway costs nothing extra).
    """
    L, E, _ = coact.shape
    N, G, k, S = topo.num_nodes, topo.gpus_per_node, topo.slots_per_gpu, topo.num_slots
    load = np.einsum("lii->li", coact).astype(np.float64)
    load += load.sum(axis=1, keepdims=True) == 0  # a layer without tokens: treat loads as equal
    W = coact.astype(np.float32)  # float32 halves the memory the searches gather from
    W[:, np.arange(E), np.arange(E)] = 0.0
    W /= np.maximum(W.sum(axis=(1, 2), keepdims=True, dtype=np.float64) / 2.0, 1e-12).astype(np.float32)
    load = load / np.maximum(load.sum(axis=1, keepdims=True) / topo.num_gpus, 1e-12)

    # (a) EPLB replica counts, at most one copy per node: a second one would add no locality.
    cnt = _replica_counts(load, S, N)
    e = np.repeat(np.tile(np.arange(E), L), cnt.ravel()).reshape(L, S)  # copies of e adjacent
    rank = np.arange(S)[None, :] - np.take_along_axis(np.cumsum(cnt, axis=1) - cnt, e, axis=1)
    w = np.take_along_axis(load / cnt, e, axis=1)
    prim = rank == 0  # the copy the cut counts

    # (b) node partition: greedy growth, then swaps on cut and node balance
    node = _grow(W, e, w, prim, np.take_along_axis(cnt, e, axis=1), rank, N, G * k, alpha,
                 np.random.default_rng(seed))
    st = _State(W, e, w, prim, _pack(node, w, G, k, lpt=False), topo)
    _refine(st, alpha, gpu_level=False)
    # (c) LPT of each node's copies onto its GPUs, then swaps on cut and GPU balance
    st.repack(_pack(st.node, w, G, k, lpt=True))
    _refine(st, alpha, gpu_level=True)
    return np.take_along_axis(e, st.slots.reshape(L, S), axis=1)


def _pack(node: np.ndarray, w: np.ndarray, G: int, k: int, lpt: bool) -> np.ndarray:
    """GPU of each copy given its node: LPT inside the node, or any order."""
    L, S = node.shape
    N = S // (G * k)
    members = np.argsort(node, axis=1, kind="stable").reshape(L * N, G * k)
    layer = np.arange(L).repeat(N)[:, None]
    local = _lpt(w[layer, members], G, k) if lpt else np.arange(G * k)[None] // k
    gpu = np.empty((L, S), dtype=np.int64)
    gpu[layer, members] = np.tile(np.arange(N) * G, L)[:, None] + local
    return gpu


def _grow(W, e, w, prim, copies, rank, N: int, C: int, alpha: float,
          rng: np.random.Generator) -> np.ndarray:
    """Greedy seeded growth: fill node 0, then 1, ...; each takes the copy that best combines
    co-activation with the node's primaries and fit to the node's remaining load budget.
    Copies of an expert are placed in rank order and on distinct nodes; an expert with as many
    copies left as nodes left is forced onto the current node so that the rest stays feasible."""
    L, S = e.shape
    rows = np.arange(L)
    tot = np.maximum(W.sum(axis=2), 1e-12)  # each expert's total pair weight
    scale = alpha * prim / np.take_along_axis(tot, e, axis=1)  # affinity counts for primaries
    node = np.full((L, S), -1, dtype=np.int64)
    closed = np.where(rank == 0, 0.0, -np.inf)  # -inf: placed, or not its expert's next copy
    has_next = rank + 1 < copies
    noise = rng.random((L, S)) * 1e-9  # seeded tie-breaking
    node_load = w.sum(axis=1) / N
    # misfit in mean copy loads; kept at affinity 1 too, so growth stays roughly balanced
    fit_weight = (1 - 0.75 * alpha) / (node_load / C)[:, None]
    for n in range(N):
        aff = np.zeros((L, S))  # pair weight to the node's primaries, fraction of the copy's total
        # copies opened while filling node n stay closed here: their expert is already on n
        base = closed + np.where(copies - rank >= N - n, 1e6, 0.0) + noise
        budget = node_load.copy()
        for c in range(C):
            score = aff - fit_weight * np.abs(w - (budget / (C - c))[:, None]) + base
            pick = np.argmax(score, axis=1)
            node[rows, pick] = n
            base[rows, pick] = closed[rows, pick] = -np.inf
            more = has_next[rows, pick]
            closed[rows[more], pick[more] + 1] = 0.0
            budget -= w[rows, pick]
            r = rows[prim[rows, pick]]
            aff[r] += W[r[:, None], e[r, pick[r]][:, None], e[r]] * scale[r]
    return node


def _refine(st: _State, alpha: float, gpu_level: bool) -> None:
    """Best-improvement swap search, vectorized over layers.

    Node level: cross-node swaps on cut + node balance (GPUs are repacked afterwards).
    GPU level: cross-node swaps on cut + GPU balance, then per node a swap between its hottest
    GPU and another of its GPUs, then per layer a swap between its hottest GPU and any copy.
    Cross-node rounds visit the node pairs one perfect matching at a time (round robin); a layer
    stops after a full cycle of rounds without an improving swap."""
    N = st.members.shape[1]
    matchings = _matchings(N)
    patience = max(len(matchings), 1)
    idle = np.zeros(st.e.shape[0], dtype=np.int64)
    active = np.arange(st.e.shape[0])
    for r in range(_MAX_ROUNDS):
        active = active[idle[active] < patience]
        if active.size == 0:
            break
        moved = np.zeros(len(active), dtype=bool)
        if matchings:
            moved |= _cross_node_round(st, active, *matchings[r % len(matchings)], alpha, gpu_level)
        if gpu_level:
            moved |= _within_node_round(st, active, alpha)
            moved |= _hottest_gpu_round(st, active, alpha)
        idle[active] = np.where(moved, 0, idle[active] + 1)


def _matchings(N: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Circle-method round robin: perfect matchings of the nodes covering every pair once."""
    n = N + N % 2  # a dummy node for odd N
    out = []
    for r in range(n - 1):
        order = [0] + [1 + (i + r) % (n - 1) for i in range(n - 1)]
        pairs = [(order[i], order[n - 1 - i]) for i in range(n // 2)]
        pairs = [(min(p), max(p)) for p in pairs if max(p) < N]
        if pairs:
            out.append(tuple(np.array(side, dtype=np.int64) for side in zip(*pairs)))
    return out


def _flags(n: int, idx: np.ndarray) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[idx] = True
    return out


def _top(key: np.ndarray, valid: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest valid keys along the last axis (repeated argmax: k is 1 or 2)."""
    key = np.where(valid, key, -np.inf)
    out = []
    for _ in range(k):
        i = np.argmax(key, axis=-1)[..., None]
        out.append(i)
        if len(out) < k:
            np.put_along_axis(key, i, -np.inf, axis=-1)
    return np.concatenate(out, axis=-1)


def _cross_node_round(st: _State, active, ia, ib, alpha, gpu_level: bool) -> np.ndarray:
    """For each node pair (a, b) of a matching, cross a few candidate copies of each side (best
    cut gain, best relief of a hot GPU or node, best receiver) and apply the best improving swap
    (at node level, then a second one). The pairs are disjoint, so their gains are exact and
    independent."""
    n_act, N = len(active), st.members.shape[1]
    G = st.load.shape[1] // N
    la = active[:, None, None]
    m_all = st.members[active]
    if not gpu_level:
        node_load = st.load[active].reshape(n_act, N, G).sum(axis=2) / G  # multiples of the mean
    slack = _SLACK if gpu_level else _NODE_SLACK
    P = len(ia)
    src, dst = np.concatenate([ia, ib]), np.concatenate([ib, ia])  # both sides at once
    m = m_all[:, src]  # [La, 2P, C]
    e, w, p = st.e[la, m], st.w[la, m], st.prim[la, m]
    if gpu_level:
        bl = st.load[la, st.gpu[la, m]]  # load of each copy's GPU
    else:
        bl, w = np.broadcast_to(node_load[:, src, None], m.shape), w / G
    g = (st.A[la, dst[None, :, None], e] - st.A[la, src[None, :, None], e]) * p  # cut gain
    v = ~st.has[la, e, dst[None, :, None]]
    f0 = _penalty(bl, alpha, slack)
    relief = f0 - _penalty(bl - w, alpha, slack)
    cand = np.concatenate([_top(g, v, 2), _top(relief, v, 1), _top(-(bl + w), v, 1)], axis=2)
    side = [np.take_along_axis(a, cand, axis=2) for a in (m, g, v, w, e, p, bl, f0)]
    m1, g1, v1, w1, e1, p1, l1, f1 = (a[:, :P] for a in side)
    m2, g2, v2, w2, e2, p2, l2, f2 = (a[:, P:] for a in side)
    X, Y = (..., slice(None), None), (..., None, slice(None))
    cut = g1[X] + g2[Y] - 2 * st.W[la[..., None], e1[X], e2[Y]] * (p1[X] & p2[Y])
    d = w1[X] - w2[Y]
    bal = f1[X] + f2[Y] - _penalty(l1[X] - d, alpha, slack) - _penalty(l2[Y] + d, alpha, slack)
    ok = v1[X] & v2[Y]
    gain = np.where(ok, alpha * cut + bal, -np.inf).reshape(n_act, P, -1)
    best = np.argmax(gain, axis=2)
    good = np.take_along_axis(gain, best[..., None], axis=2)[..., 0] > _TOL  # [La, P]
    r, q = np.nonzero(good)
    i, j = np.divmod(best, m1.shape[2])
    if r.size:
        st.swap(active[r], m1[r, q, i[r, q]], m2[r, q, j[r, q]])
    if not gpu_level and r.size:
        # a second swap on the same node pairs, its gain corrected exactly for the first: node
        # loads moved by d1, and the pair weights to the first swap's two copies
        at = lambda a, idx: np.take_along_axis(a, idx[..., None], axis=2)  # [La, P, 1]
        x1, y1, ex1, ey1, px1, py1 = at(m1, i), at(m2, j), at(e1, i), at(e2, j), at(p1, i), at(p2, j)
        d1 = at(w1, i) - at(w2, j)
        cx = 2 * p1 * (px1 * st.W[la, e1, ex1] - py1 * st.W[la, e1, ey1])  # x's cut gain change
        cy = 2 * p2 * (py1 * st.W[la, e2, ey1] - px1 * st.W[la, e2, ex1])  # y's
        la1, lb1 = l1 - d1, l2 + d1
        bal2 = (_penalty(la1, alpha, slack)[X] + _penalty(lb1, alpha, slack)[Y]
                - _penalty(la1[X] - d, alpha, slack) - _penalty(lb1[Y] + d, alpha, slack))
        ok2 = ok & (m1 != x1)[X] & (m2 != y1)[Y]
        gain2 = np.where(ok2, alpha * (cut + cx[X] + cy[Y]) + bal2, -np.inf).reshape(n_act, P, -1)
        best2 = np.argmax(gain2, axis=2)
        r, q = np.nonzero(good & (np.take_along_axis(gain2, best2[..., None], axis=2)[..., 0] > _TOL))
        if r.size:
            i2, j2 = np.divmod(best2[r, q], m1.shape[2])
            st.swap(active[r], m1[r, q, i2], m2[r, q, j2])
    return good.any(axis=1)


def _within_node_round(st: _State, active, alpha) -> np.ndarray:
    """In every node, the best balance-improving swap between its hottest GPU and one of its
    _COLD coldest GPUs (no cut change)."""
    n_act, N, C = len(active), *st.members.shape[1:]
    k = st.slots.shape[2]
    G = C // k
    if G == 1:
        return np.zeros(n_act, dtype=bool)
    la = active[:, None, None]
    m = st.members[active]  # [La, N, C]; member c sits on the node's GPU c // k
    loads = st.load[active].reshape(n_act, N, G)
    order = np.argsort(loads, axis=2)
    hot, cold = order[..., -1:], order[..., :min(_COLD, G - 1)]
    x = np.take_along_axis(m, hot * k + np.arange(k), axis=2)  # [La, N, k]
    y = np.take_along_axis(m, (cold[..., None] * k + np.arange(k)).reshape(n_act, N, -1), axis=2)
    hl = np.take_along_axis(loads, hot, axis=2)[..., None]  # [La, N, 1, 1]
    yl = np.repeat(np.take_along_axis(loads, cold, axis=2), k, axis=2)[..., None, :]
    d = st.w[la, x][..., None] - st.w[la, y][..., None, :]  # [La, N, k, M]
    gain = (_penalty(hl, alpha) + _penalty(yl, alpha)
            - _penalty(hl - d, alpha) - _penalty(yl + d, alpha)).reshape(n_act, N, -1)
    best = np.argmax(gain, axis=2)
    r, n = np.nonzero(np.take_along_axis(gain, best[..., None], axis=2)[..., 0] > _TOL)
    if r.size:
        i, j = np.divmod(best[r, n], y.shape[2])
        st.swap(active[r], x[r, n, i], y[r, n, j])
    return _flags(n_act, r)


def _hottest_gpu_round(st: _State, active, alpha) -> np.ndarray:
    """In every layer, the best swap between a copy on its hottest GPU and any copy on another
    GPU, on any node (a cross-node swap also pays its cut change)."""
    n_act = len(active)
    la, l3 = active[:, None], active[:, None, None]
    order = np.argsort(st.load[active], axis=1)
    hot, others = order[:, -1], order[:, :-1]
    x = st.slots[active, hot]  # [La, k]
    y = st.slots[la, others].reshape(n_act, -1)  # [La, S - k]
    a, b = st.node[active, x[:, 0]][:, None, None], st.node[la, y][:, None]
    ex, ey = st.e[la, x][..., None], st.e[la, y][:, None]
    px, py = st.prim[la, x][..., None], st.prim[la, y][:, None]
    cut = (px * (st.A[l3, b, ex] - st.A[l3, a, ex]) + py * (st.A[l3, a, ey] - st.A[l3, b, ey])
           - 2 * st.W[l3, ex, ey] * (px & py))  # [La, k, M]
    cross = a != b
    clash = cross & (st.has[l3, ex, b] | st.has[l3, ey, a])
    d = st.w[la, x][..., None] - st.w[la, y][:, None]
    hl, yl = st.load[active, hot][:, None, None], st.load[la, st.gpu[la, y]][:, None]
    gain = (np.where(cross, alpha * cut, 0.0) + _penalty(hl, alpha) + _penalty(yl, alpha)
            - _penalty(hl - d, alpha) - _penalty(yl + d, alpha))
    gain = np.where(clash, -np.inf, gain).reshape(n_act, -1)
    best = np.argmax(gain, axis=1)
    r = np.flatnonzero(gain[np.arange(n_act), best] > _TOL)
    if r.size:
        i, j = np.divmod(best[r], y.shape[1])
        st.swap(active[r], x[r, i], y[r, j])
    return _flags(n_act, r)
