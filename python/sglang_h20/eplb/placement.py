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


def place(stats, topo: Topology, algorithm: str, *, affinity: float = 0.5, seed: int = 0,
          num_groups: int | None = None) -> Placement:
    """Place the experts of every layer of `stats` (a CoactivationStats) onto `topo`.

    `affinity` (0..1, "affinity" only) trades node-load balance (0) for co-activation locality
    (1); `seed` breaks ties; `num_groups` is the expert-group count for "deepseek_hierarchical"
    (default: DeepSeek-V3's 8).
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
        phy2log = _affinity(np.asarray(stats.coact), topo, float(affinity), seed)
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
# Units, per layer: loads are scaled so the mean node load is 1; co-activation so that the total
# pair weight (sum over i < j, diagonal excluded) is 1. "cut" is the pair weight between experts
# whose primary copies sit on different nodes: a pairwise proxy for the remote nodes a token
# reaches, the best the stats (pairs only) can give.
#
# The node partition minimizes  J = affinity * cut + sum_n f(node_load_n),
#   f(p) = (1 - affinity) * (p - 1)^2 + _HINGE * max(0, p - 1 - _SLACK * affinity)^2,
# a pull to balance that fades as affinity grows plus a node-load ceiling that loosens with it.
# The GPU repair then lowers the hottest GPU whatever the cut cost until GPU balancedness reaches
# floor = 1 - (1 - _MIN_FLOOR) * affinity, and beyond that only while
#   gain in balance (fraction of the mean GPU load) + _KAPPA * affinity * cut gain > 0.

_SLACK = 0.04      # node-load slack at affinity 1
_HINGE = 100.0     # weight of a node-load ceiling violation
_MIN_FLOOR = 0.95  # GPU balancedness the repair insists on at affinity 1
_KAPPA = 4.0       # balance worth one unit of cut, at affinity 1
_K = 2             # swap candidates per node pair, side and criterion
_MAX_ROUNDS = 400
_TOL = 1e-12


def _replica_counts(load: np.ndarray, num_slots: int, max_copies: int) -> np.ndarray:
    """EPLB rule: each extra slot goes to the expert with the highest load per replica."""
    L, E = load.shape
    if num_slots > E * max_copies:
        raise ValueError(f"{num_slots} slots need more than {max_copies} copies of some expert")
    cnt = np.ones((L, E), dtype=np.int64)
    rows = np.arange(L)
    for _ in range(num_slots - E):
        e = np.argmax(np.where(cnt < max_copies, load / cnt, -np.inf), axis=1)
        cnt[rows, e] += 1
    return cnt


def _node_penalty(p: np.ndarray, alpha: float) -> np.ndarray:
    over = np.maximum(0.0, p - 1.0 - _SLACK * alpha)
    return (1.0 - alpha) * (p - 1.0) ** 2 + _HINGE * over * over


@dataclasses.dataclass
class _Items:
    """Physical copies of one layer batch ([L, S] arrays) and their node partition state."""
    W: np.ndarray        # [L, E, E] normalized co-activation, zero diagonal
    e: np.ndarray        # expert of each copy
    w: np.ndarray        # load of each copy (expert load / copies), mean node load 1
    prim: np.ndarray     # copy 0 of its expert: the copy the cut counts
    node: np.ndarray     # node of each copy
    has: np.ndarray = None  # [L, E, N] expert has a copy on node
    A: np.ndarray = None    # [L, N, E] pair weight of expert to the primaries on node
    P: np.ndarray = None    # [L, N] node loads

    def index(self, N: int) -> None:
        L, S = self.e.shape
        rows = np.arange(L)[:, None]
        self.has = np.zeros((L, self.W.shape[1], N), dtype=bool)
        self.has[rows, self.e, self.node] = True
        onehot = np.zeros((L, N, self.W.shape[1]))
        onehot[rows, self.node, self.e] = self.prim
        self.A = np.matmul(onehot, self.W)  # W is symmetric
        self.P = np.zeros((L, N))
        np.add.at(self.P, (np.broadcast_to(rows, (L, S)), self.node), self.w)

    def swap(self, l, x, y) -> None:
        """Exchange the nodes of copies x and y in layers l (each (layer, node) at most once)."""
        a, b = self.node[l, x], self.node[l, y]
        ex, ey = self.e[l, x], self.e[l, y]
        self.node[l, x], self.node[l, y] = b, a
        self.has[l, ex, a] = self.has[l, ey, b] = False
        self.has[l, ex, b] = self.has[l, ey, a] = True
        dw = self.w[l, x] - self.w[l, y]
        self.P[l, a] -= dw
        self.P[l, b] += dw
        delta = (self.W[l, ex] * self.prim[l, x][:, None]
                 - self.W[l, ey] * self.prim[l, y][:, None])  # [n, E] (W symmetric: rows)
        self.A[l, a] -= delta
        self.A[l, b] += delta


def _affinity(coact: np.ndarray, topo: Topology, alpha: float, seed: int) -> np.ndarray:
    """Co-activation-aware placement: (a) replica counts, (b) node partition, (c) GPUs."""
    L, E, _ = coact.shape
    N, G, k, S = topo.num_nodes, topo.gpus_per_node, topo.slots_per_gpu, topo.num_slots
    C = S // N
    load = np.einsum("lii->li", coact).astype(np.float64)
    W = coact.astype(np.float64)
    W[:, np.arange(E), np.arange(E)] = 0.0
    W /= np.maximum(W.sum(axis=(1, 2), keepdims=True) / 2.0, 1e-12)
    load = load / np.maximum(load.sum(axis=1, keepdims=True) / N, 1e-12)

    # (a) EPLB replica counts, at most one copy per node: a second one would add no locality.
    cnt = _replica_counts(load, S, N)
    item_e = np.repeat(np.tile(np.arange(E), L), cnt.ravel()).reshape(L, S)  # copies of e adjacent
    first = np.cumsum(cnt, axis=1) - cnt
    rank = np.arange(S)[None, :] - np.take_along_axis(first, item_e, axis=1)
    items = _Items(W, item_e, np.take_along_axis(load / cnt, item_e, axis=1), rank == 0, None)

    # (b) node partition: greedy growth, then swap refinement
    items.node = _grow(items, np.take_along_axis(cnt, item_e, axis=1), rank, N, C, alpha,
                       np.random.default_rng(seed))
    items.index(N)
    _refine(items, N, C, alpha)

    # (c) GPUs: LPT inside each node, then repair the hottest GPUs (swaps may cross nodes)
    members = np.argsort(items.node, axis=1, kind="stable").reshape(L * N, C)  # per (layer, node)
    layer = np.arange(L).repeat(N)[:, None]
    gpu = np.empty((L, S), dtype=np.int64)
    gpu[layer, members] = np.tile(np.arange(N) * G, L)[:, None] + _lpt(items.w[layer, members], G, k)
    _repair(items, gpu, G, k, alpha)
    order = np.argsort(gpu, axis=1, kind="stable")
    return np.take_along_axis(items.e, order, axis=1)


def _grow(items: _Items, copies: np.ndarray, rank: np.ndarray, N: int, C: int, alpha: float,
          rng: np.random.Generator) -> np.ndarray:
    """Greedy seeded growth: fill node 0, then 1, ...; each takes the copy that best combines
    co-activation with the node's primaries and fit to the node's remaining load budget.
    Copies of an expert are placed in rank order and on distinct nodes; an expert with as many
    copies left as nodes left is forced onto the current node so that the rest stays feasible."""
    L, S = items.e.shape
    rows = np.arange(L)
    tot = np.maximum(items.W.sum(axis=2), 1e-12)  # each expert's total pair weight
    # to_copy[l, e, s]: pair weight of expert e with primary copy s, as a fraction of s's total
    to_copy = np.take_along_axis(items.W, items.e[:, None, :], axis=2)
    to_copy *= (items.prim / np.take_along_axis(tot, items.e, axis=1))[:, None, :]
    to_copy *= alpha
    node = np.full((L, S), -1, dtype=np.int64)
    closed = np.where(rank == 0, 0.0, -np.inf)  # -inf: placed, or not its expert's next copy
    has_next = rank + 1 < copies
    noise = rng.random((L, S)) * 1e-9  # seeded tie-breaking
    fit_weight = (1 - alpha) * S / N  # fit measured in mean copy loads
    for n in range(N):
        aff = np.zeros((L, S))
        # copies opened while filling node n stay closed here: their expert is already on n
        base = closed + np.where(copies - rank >= N - n, 1e6, 0.0) + noise
        budget = np.ones(L)
        for c in range(C):
            score = aff - fit_weight * np.abs(items.w - (budget / (C - c))[:, None]) + base
            pick = np.argmax(score, axis=1)
            node[rows, pick] = n
            base[rows, pick] = closed[rows, pick] = -np.inf
            more = has_next[rows, pick]
            closed[rows[more], pick[more] + 1] = 0.0
            budget -= items.w[rows, pick]
            p = items.prim[rows, pick]
            aff[p] += to_copy[rows[p], items.e[rows[p], pick[p]]]
    return node


def _refine(it: _Items, N: int, C: int, alpha: float) -> None:
    """Kernighan-Lin style swap refinement of the node partition, vectorized over layers.

    Each round, for every node pair, a few candidate copies per side (best cut gain, heaviest,
    lightest) are crossed; the best improving swaps on disjoint node pairs are applied together
    (they touch disjoint nodes, so their gains stay exact). A layer stops when nothing improves.
    """
    L, S = it.e.shape
    if N == 1:
        return
    members = np.argsort(it.node, axis=1, kind="stable").reshape(L, N, C)
    pos = np.empty((L, S), dtype=np.int64)  # index of each copy within its node
    np.put_along_axis(pos, members.reshape(L, S), np.tile(np.arange(C), N)[None], axis=1)
    ia, ib = np.triu_indices(N, 1)
    active = np.arange(L)
    for _ in range(_MAX_ROUNDS):
        if active.size == 0:
            break
        la = active[:, None, None]
        m = members[active]
        e_m, w_m, p_m = it.e[la, m], it.w[la, m], it.prim[la, m]
        own = it.A[la, np.arange(N)[None, :, None], e_m]  # [La, N, C]
        by_w = np.argsort(w_m, axis=2)
        sides = []
        for src, dst in ((ia, ib), (ib, ia)):
            e_s, to = e_m[:, src], dst[None, :, None]  # [La, P, C], [1, P, 1]
            g = (it.A[la, to, e_s] - own[:, src]) * p_m[:, src]  # cut gain of moving src -> dst
            v = ~it.has[la, e_s, to]
            cand = np.concatenate([np.argpartition(np.where(v, -g, np.inf), _K - 1, axis=2)[..., :_K],
                                   by_w[:, src, -_K:], by_w[:, src, :_K]], axis=2)
            take = lambda x: np.take_along_axis(x, cand, axis=2)
            sides.append((cand, take(g), take(v), take(w_m[:, src]), take(e_m[:, src]),
                          take(p_m[:, src])))
        (c1, g1, v1, w1, e1, p1), (c2, g2, v2, w2, e2, p2) = sides
        X, Y = (..., slice(None), None), (..., None, slice(None))
        cut = g1[X] + g2[Y] - 2 * it.W[la[..., None], e1[X], e2[Y]] * (p1[X] & p2[Y])
        d = w1[X] - w2[Y]
        Pa, Pb = it.P[active][:, ia, None, None], it.P[active][:, ib, None, None]
        bal = (_node_penalty(Pa, alpha) + _node_penalty(Pb, alpha)
               - _node_penalty(Pa - d, alpha) - _node_penalty(Pb + d, alpha))
        gain = np.where(v1[X] & v2[Y], alpha * cut + bal, -np.inf).reshape(len(active), len(ia), -1)
        best = np.argmax(gain, axis=2)
        bg = np.take_along_axis(gain, best[..., None], axis=2)[..., 0]  # [La, P]
        improving = (bg > _TOL).any(axis=1)
        busy = np.zeros((len(active), N), dtype=bool)
        for _ in range(N // 2):  # best swaps on disjoint node pairs
            bg = np.where(busy[:, ia] | busy[:, ib], -np.inf, bg)
            p = np.argmax(bg, axis=1)
            sel = np.flatnonzero(bg[np.arange(len(active)), p] > _TOL)
            if sel.size == 0:
                break
            p = p[sel]
            i, j = np.divmod(best[sel, p], c1.shape[2])
            l = active[sel]
            a, b = ia[p], ib[p]
            x, y = members[l, a, c1[sel, p, i]], members[l, b, c2[sel, p, j]]
            members[l, a, pos[l, x]], members[l, b, pos[l, y]] = y, x
            pos[l, x], pos[l, y] = pos[l, y], pos[l, x].copy()
            it.swap(l, x, y)
            busy[sel, a] = busy[sel, b] = True
        active = active[improving]


def _repair(it: _Items, gpu: np.ndarray, G: int, k: int, alpha: float) -> None:
    """Lower the hottest GPU of each layer by swapping one of its copies with any other copy.

    Below the balancedness floor the best balance-vs-cut trade is always taken; above it only
    trades that pay for themselves (same-node swaps cost no cut)."""
    L, S = gpu.shape
    NG = S // k
    N = it.A.shape[1]
    floor = 1.0 - (1.0 - _MIN_FLOOR) * alpha
    slots = np.argsort(gpu, axis=1, kind="stable").reshape(L, NG, k)  # copies of each GPU
    load = np.zeros((L, NG))
    np.add.at(load, (np.broadcast_to(np.arange(L)[:, None], (L, S)), gpu), it.w)
    mean = load.mean(axis=1)
    active = np.arange(L)
    for _ in range(_MAX_ROUNDS):
        if active.size == 0:
            break
        n_act = len(active)
        la = active[:, None]
        hot = np.argmax(load[active], axis=1)
        hl = load[active, hot]
        x = slots[active, hot]  # [La, k]
        d = it.w[la, x][:, :, None] - it.w[active][:, None, :]  # [La, k, S]
        gy = gpu[active]
        new_max = np.maximum(hl[:, None, None] - d, load[la, gy][:, None, :] + d)
        dbal = (hl[:, None, None] - new_max) / mean[active, None, None]
        a = it.node[active, x[:, 0]]  # node of the hot GPU
        b = it.node[active]  # [La, S]
        ex, ey = it.e[la, x], it.e[active]
        px, py = it.prim[la, x], it.prim[active]
        # cut gain of x moving to each node, of y moving to a, and their pair term
        gx = (it.A[la[..., None], np.arange(N)[None, None], ex[..., None]]
              - it.A[la, a[:, None], ex][..., None]) * px[..., None]  # [La, k, N]
        gy_a = (it.A[la, a[:, None], ey] - it.A[la, b, ey]) * py  # [La, S]
        cut = (np.take_along_axis(gx, np.broadcast_to(b[:, None], d.shape), axis=2) + gy_a[:, None]
               - 2 * it.W[la[..., None], ex[..., None], ey[:, None]] * (px[..., None] & py[:, None]))
        cross = (a[:, None] != b)[:, None]
        x_on = it.has[la[..., None], ex[..., None], np.arange(N)[None, None]]  # [La, k, N]
        clash = (np.take_along_axis(x_on, np.broadcast_to(b[:, None], d.shape), axis=2)
                 | it.has[la, ey, a[:, None]][:, None])
        cut = np.where(cross, cut, 0.0)
        ok = (gy != hot[:, None])[:, None, :] & (dbal > _TOL) & ~(cross & clash)
        score = dbal + _KAPPA * alpha * cut
        below = (mean[active] / hl < floor)[:, None, None]
        score = np.where(ok & (below | (score > _TOL)), score, -np.inf).reshape(n_act, -1)
        best = np.argmax(score, axis=1)
        sel = np.flatnonzero(score[np.arange(n_act), best] > -np.inf)
        if sel.size == 0:
            break
        i, y = np.divmod(best[sel], S)
        l, h = active[sel], hot[sel]
        xs = x[sel, i]
        gy_sel = gpu[l, y]
        # swap GPU slots
        py = np.argmax(slots[l, gy_sel] == y[:, None], axis=1)
        slots[l, h, i], slots[l, gy_sel, py] = y, xs
        gpu[l, xs], gpu[l, y] = gy_sel, h
        dw = it.w[l, xs] - it.w[l, y]
        load[l, h] -= dw
        load[l, gy_sel] += dw
        c = it.node[l, xs] != it.node[l, y]
        if c.any():
            it.swap(l[c], xs[c], y[c])
        active = active[sel]
