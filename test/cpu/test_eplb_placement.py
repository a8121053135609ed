"""Placement algorithms (sglang_h20.eplb.placement.place) on synthetic co-activation stats.

Metrics are computed here from the stats alone, independently of the planner's internals:
GPU balancedness (mean / max GPU load, a replicated expert's load split evenly over its copies)
and the co-activation cut (pair weight between experts that share no node).
"""
import time

import numpy as np
import pytest

from sglang_h20.eplb.placement import ALGORITHMS, Placement, Topology, place
from sglang_h20.eplb.stats import CoactivationStats

E, K = 256, 8  # DeepSeek-V3: 256 routed experts, top-8


# --- synthetic routing and metrics ----------------------------------------------------------

def routing(L, T, rng, skew=0.3, cluster=0, noise=0.0, num_experts=E):
    """topk ids [L, T, K]. Without clusters: experts drawn by a lognormal popularity (sigma
    `skew`). With clusters: per layer the experts are split into random groups of `cluster`
    that always fire together (a token fires one whole group, groups drawn by popularity), and a
    `noise` fraction of the slots goes to random experts. Returns (topk, groups or None)."""
    pop = rng.normal(0.0, skew, (L, num_experts))
    if not cluster:
        score = pop[:, None, :] + rng.gumbel(size=(L, T, num_experts))
        return np.argpartition(-score, K, axis=2)[..., :K], None
    groups = np.stack([rng.permutation(num_experts) for _ in range(L)]).reshape(L, -1, cluster)
    topk = np.empty((L, T, K), dtype=np.int64)
    for l in range(L):
        p = np.exp(pop[l, : groups.shape[1]])
        topk[l] = groups[l, rng.choice(groups.shape[1], T, p=p / p.sum())][:, :K]
        r = rng.random((T, K)) < noise
        topk[l][r] = rng.integers(0, num_experts, r.sum())
    return topk, groups


def stats_from(topk, num_experts=E) -> CoactivationStats:
    """Same counts as CoactivationStats.from_topk_ids, through a float32 matmul (fast, exact)."""
    L, T, _ = topk.shape
    coact = np.empty((L, num_experts, num_experts), dtype=np.int64)
    for l in range(L):
        onehot = np.zeros((T, num_experts), dtype=np.float32)
        np.put_along_axis(onehot, topk[l], 1.0, axis=1)
        coact[l] = (onehot.T @ onehot).astype(np.int64)
    return CoactivationStats(coact, T)


def gpu_balancedness(p: Placement, load: np.ndarray) -> np.ndarray:
    """[L] mean / max GPU load, each copy carrying load / replicas."""
    w = np.take_along_axis(load / p.replica_counts(), p.phy2log, axis=1)
    gpu = w.reshape(w.shape[0], p.topology.num_gpus, -1).sum(axis=2)
    return gpu.mean(axis=1) / gpu.max(axis=1)


def expert_nodes(p: Placement, layer: int) -> np.ndarray:
    """[E, N] bool: expert has a copy on node."""
    has = np.zeros((p.num_experts, p.topology.num_nodes), dtype=bool)
    has[p.phy2log[layer], p.topology.slot_node()] = True
    return has


def cut_fraction(p: Placement, coact: np.ndarray) -> np.ndarray:
    """[L] share of the co-activation pair weight between experts that share no node."""
    out = []
    for l in range(coact.shape[0]):
        has = expert_nodes(p, l).astype(float)
        w = coact[l].astype(float)
        np.fill_diagonal(w, 0.0)
        out.append((w * ((has @ has.T) == 0)).sum() / max(w.sum(), 1.0))
    return np.array(out)


def clusters_on_one_node(p: Placement, groups: np.ndarray) -> float:
    """Share of planted clusters whose members all have a copy on one common node."""
    return float(np.mean([expert_nodes(p, l)[groups[l]].all(axis=1).any(axis=1).mean()
                          for l in range(groups.shape[0])]))


# --- invariants -----------------------------------------------------------------------------

TOPOLOGIES = {  # name: (topology without redundancy, with 64 redundant slots)
    "2x8": (Topology(2, 8, 16), Topology(2, 8, 20)),
    "4x8": (Topology(4, 8, 8), Topology(4, 8, 10)),
    "8x8": (Topology(8, 8, 4), Topology(8, 8, 5)),
}


@pytest.fixture(scope="module")
def random_stats():
    return stats_from(routing(3, 2048, np.random.default_rng(1), skew=0.5)[0])


def check_invariants(p: Placement, topo: Topology, num_layers: int, num_experts: int = E):
    assert p.phy2log.shape == (num_layers, topo.num_slots) and p.phy2log.dtype == np.int64
    p.validate()  # ids in range, every expert >= 1 replica, log2phy/phy2log agree
    counts = p.replica_counts()
    assert (counts >= 1).all()
    assert (counts.sum(axis=1) == topo.num_slots).all()
    for l in range(num_layers):
        slots = p.log2phy(l)
        assert sorted(np.concatenate(slots).tolist()) == list(range(topo.num_slots))
        for e in range(num_experts):
            assert (p.phy2log[l, slots[e]] == e).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("redundant", [False, True], ids=["no-redundancy", "64-redundant"])
@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_invariants(random_stats, algorithm, redundant, name):
    topo = TOPOLOGIES[name][redundant]
    if algorithm == "balanced" and redundant:
        with pytest.raises(ValueError, match="without replication"):
            place(random_stats, topo, algorithm)
        return
    p = place(random_stats, topo, algorithm)
    assert p.algorithm == algorithm and p.topology == topo and p.num_experts == E
    check_invariants(p, topo, random_stats.num_layers)
    if algorithm in ("balanced", "contiguous") and not redundant:
        assert (p.replica_counts() == 1).all()
    if algorithm == "contiguous" and not redundant:
        assert (p.phy2log == np.arange(E)).all()
    if algorithm == "affinity":  # never two copies of an expert on one node
        sn = topo.slot_node()
        for l in range(random_stats.num_layers):
            for slots in p.log2phy(l):
                assert len(set(sn[slots].tolist())) == len(slots)


@pytest.mark.parametrize("topo,num_experts", [(Topology(3, 2, 4), 20), (Topology(2, 8, 4), 60),
                                              (Topology(1, 4, 4), 16)])
def test_affinity_odd_shapes(topo, num_experts):
    """Odd node counts, experts not divisible by nodes or GPUs, a single node."""
    rng = np.random.default_rng(2)
    st = stats_from(routing(2, 512, rng, skew=0.5, num_experts=num_experts)[0], num_experts)
    for algorithm in ("contiguous", "deepseek", "affinity"):
        check_invariants(place(st, topo, algorithm), topo, 2, num_experts)


def test_empty_stats_give_valid_placements():
    st = CoactivationStats.empty(2, E)
    for topo in TOPOLOGIES["8x8"]:
        for algorithm in ("contiguous", "deepseek", "deepseek_hierarchical", "affinity"):
            check_invariants(place(st, topo, algorithm), topo, 2)


def test_contiguous_replicates_the_heaviest_experts(random_stats):
    topo = TOPOLOGIES["8x8"][1]  # 4 experts + 1 replica per GPU
    p = place(random_stats, topo, "contiguous")
    base = p.phy2log.reshape(3, topo.num_gpus, topo.slots_per_gpu)
    assert (base[:, :, :4].reshape(3, -1) == np.arange(E)).all()
    for l in range(3):
        heaviest = np.argsort(-random_stats.load[l], kind="stable")[:topo.num_gpus]
        assert base[l, :, 4].tolist() == heaviest.tolist()


def test_balanced_is_lpt_without_replication(random_stats):
    topo = TOPOLOGIES["8x8"][0]
    p = place(random_stats, topo, "balanced")
    bal = gpu_balancedness(p, random_stats.load)
    naive = gpu_balancedness(place(random_stats, topo, "contiguous"), random_stats.load)
    eplb = gpu_balancedness(place(random_stats, topo, "deepseek"), random_stats.load)
    assert (bal > naive + 0.1).all() and (bal >= eplb - 1e-9).all()  # EPLB packs by LPT too


def test_deepseek_matches_sglang_directly(random_stats):
    import torch
    from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm, rebalance_experts

    topo = TOPOLOGIES["4x8"][1]
    for algorithm, groups in (("deepseek", 1), ("deepseek_hierarchical", 8)):
        ref, _, _ = rebalance_experts(
            tokens_per_expert=torch.tensor(random_stats.load)[None], num_physical_experts=topo.num_slots,
            num_local_physical_experts=topo.slots_per_gpu, num_groups=groups, num_nodes=topo.num_nodes,
            algorithm=EplbAlgorithm[algorithm])
        assert (place(random_stats, topo, algorithm).phy2log == ref.numpy()).all()


def test_argument_errors(random_stats):
    topo = TOPOLOGIES["8x8"][0]
    with pytest.raises(ValueError, match="unknown placement algorithm"):
        place(random_stats, topo, "nope")
    with pytest.raises(ValueError, match="affinity must lie"):
        place(random_stats, topo, "affinity", affinity=1.5)
    with pytest.raises(ValueError, match="cannot hold"):
        place(random_stats, Topology(8, 8, 3), "affinity")
    with pytest.raises(ValueError, match="num_groups"):
        place(random_stats, topo, "deepseek_hierarchical", num_groups=6)
    with pytest.raises(ValueError, match="num_groups"):
        place(random_stats, Topology(16, 4, 4), "deepseek_hierarchical")  # 8 groups, 16 nodes
    with pytest.raises(ValueError, match="copies"):
        place(random_stats, Topology(1, 2, E + 1), "affinity")  # 1 node: one copy per GPU at most


def test_affinity_on_one_node_takes_its_gpus_as_the_locality_domains(random_stats):
    """On one node (EP inside one host) the GPUs are where locality pays (a token copy per GPU over NVLink): a
    replica per GPU at most, so redundant slots work there too, and co-activated experts share GPUs."""
    topo = Topology(1, 8, E // 8 + 8)  # 8 redundant slots per GPU
    p = place(random_stats, topo, "affinity")
    check_invariants(p, topo, 3)
    gpu = topo.slot_gpu()
    for l in range(3):  # no expert twice on one GPU
        pairs = set(zip(gpu.tolist(), p.phy2log[l].tolist()))
        assert len(pairs) == topo.num_slots


# --- the affinity algorithm -----------------------------------------------------------------

def test_affinity_is_deterministic_for_a_seed(random_stats):
    topo = TOPOLOGIES["8x8"][1]
    a = place(random_stats, topo, "affinity", seed=3)
    b = place(random_stats, topo, "affinity", seed=3)
    assert (a.phy2log == b.phy2log).all()
    check_invariants(place(random_stats, topo, "affinity", seed=4), topo, 3)


@pytest.fixture(scope="module")
def planted():
    """32 clusters of 8 experts that fire together; 10% of the routed slots are noise."""
    topk, groups = routing(4, 4096, np.random.default_rng(0), skew=0.3, cluster=8, noise=0.1)
    return stats_from(topk), groups


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("redundant", [False, True], ids=["no-redundancy", "64-redundant"])
def test_affinity_keeps_planted_clusters_on_one_node(planted, name, redundant):
    st, groups = planted
    topo = TOPOLOGIES[name][redundant]
    aff = place(st, topo, "affinity", affinity=0.5)  # locality-leaning; the default is checked below
    ds = place(st, topo, "deepseek")
    kept_aff, kept_ds = clusters_on_one_node(aff, groups), clusters_on_one_node(ds, groups)
    cut_aff, cut_ds = cut_fraction(aff, st.coact).mean(), cut_fraction(ds, st.coact).mean()
    print(f"{name} redundant={redundant}: clusters on one node {kept_aff:.2f} vs deepseek "
          f"{kept_ds:.2f}; cut {cut_aff:.3f} vs {cut_ds:.3f}; balancedness "
          f"{gpu_balancedness(aff, st.load).mean():.3f} vs {gpu_balancedness(ds, st.load).mean():.3f}")
    assert kept_aff >= 0.7 and kept_aff >= kept_ds + 0.6
    assert cut_aff <= 0.4 * cut_ds
    assert gpu_balancedness(aff, st.load).min() >= 0.95
    # the default (balance-leaning) setting still keeps most clusters together
    dflt = place(st, topo, "affinity")
    assert clusters_on_one_node(dflt, groups) >= kept_ds + 0.5
    assert cut_fraction(dflt, st.coact).mean() <= 0.4 * cut_ds
    assert gpu_balancedness(dflt, st.load).min() >= 0.95


@pytest.fixture(scope="module")
def skewed():
    """Moderately skewed load (lognormal popularity, sigma 0.3: hottest expert ~2x the mean)."""
    return stats_from(routing(6, 4096, np.random.default_rng(5), skew=0.3)[0])


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("redundant", [False, True], ids=["no-redundancy", "64-redundant"])
def test_affinity_balancedness_on_skewed_load(skewed, name, redundant):
    topo = TOPOLOGIES[name][redundant]
    aff = place(skewed, topo, "affinity")
    ds = place(skewed, topo, "deepseek")
    bal, bal_ds = gpu_balancedness(aff, skewed.load), gpu_balancedness(ds, skewed.load)
    cut, cut_ds = cut_fraction(aff, skewed.coact).mean(), cut_fraction(ds, skewed.coact).mean()
    print(f"{name} redundant={redundant}: balancedness min {bal.min():.3f} (deepseek "
          f"{bal_ds.min():.3f}); cut {cut:.3f} (deepseek {cut_ds:.3f})")
    assert bal.min() >= 0.95
    assert cut < cut_ds  # some locality even without planted structure


def test_affinity_knob_trades_balance_for_locality(planted):
    st, _ = planted
    topo = TOPOLOGIES["8x8"][1]
    res = {a: place(st, topo, "affinity", affinity=a) for a in (0.0, 0.5, 1.0)}
    bal = {a: gpu_balancedness(p, st.load).mean() for a, p in res.items()}
    cut = {a: cut_fraction(p, st.coact).mean() for a, p in res.items()}
    print("balancedness", bal, "cut", cut)
    ds_bal = gpu_balancedness(place(st, topo, "deepseek"), st.load).mean()
    assert bal[0.0] >= ds_bal - 0.005  # affinity 0: pure balance, at least EPLB's
    assert bal[0.0] >= bal[0.5] >= bal[1.0] - 0.005 and bal[1.0] >= 0.9
    assert cut[1.0] <= cut[0.5] + 0.01 and cut[0.5] < 0.5 * cut[0.0]


@pytest.mark.parametrize("spg", [4, 5], ids=["no-redundancy", "64-redundant"])
def test_affinity_planner_time_58_layers_64_gpus(spg):
    """DeepSeek-V3 size: 58 MoE layers x 256 experts on 8 nodes x 8 GPUs, under 1 s of CPU. The planner
    is single-threaded numpy (the one matmul is small); best of 3.

    Timed in CPU seconds of this process (all its threads), not wall seconds: on a loaded 2-core CI host
    the wall time of the same work was 2.3-2.6 s (12 busy loops beside it; ~0.35 s idle), so a wall-clock
    bound failed without any change to the planner. CPU time is what the planner costs; a planner that
    became ~3x slower still fails here."""
    st = stats_from(routing(58, 1024, np.random.default_rng(7), skew=0.5)[0])
    topo = Topology(8, 8, spg)
    times, walls = [], []
    for _ in range(3):
        c0, t0 = time.process_time(), time.perf_counter()
        p = place(st, topo, "affinity")
        times.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
    print(f"planner time 58x256 on 8x8x{spg}: best {min(times):.3f} CPU s, all {times}, wall {walls}")
    p.validate()
    assert min(times) < 1.0


def test_switch_default_matches_the_planner_default():
    """SGLANG_H20_EPLB_AFFINITY defaults to the planner's own default (one tuned value)."""
    from sglang_h20.eplb.placement import DEFAULT_AFFINITY
    from sglang_h20.settings import Settings

    assert Settings.from_env({})["eplb_affinity"] == DEFAULT_AFFINITY


def test_affinity_replicas_go_to_the_highest_load_per_replica():
    """SGLang's EPLB rule, which affinity placement keeps: each extra slot to the expert with the most load per copy
    (not the most load), at most `max_copies` copies; exactly E * max_copies slots is allowed, one more is not."""
    from sglang_h20.eplb.placement import _replica_counts

    load = np.array([[10.0, 8.0, 1.0], [1.0, 1.0, 9.0]])
    assert _replica_counts(load, 5, 3).tolist() == [[2, 2, 1], [1, 1, 3]]
    assert _replica_counts(load, 9, 3).tolist() == [[3, 3, 3], [3, 3, 3]]
    with pytest.raises(ValueError, match="copies"):
        _replica_counts(load, 10, 3)


@pytest.mark.parametrize("num_nodes", range(1, 10))
def test_cross_node_rounds_pair_every_two_nodes_once(num_nodes):
    """The swap search's round robin: each round a set of disjoint node pairs, every pair in exactly one round."""
    from sglang_h20.eplb.placement import _matchings

    seen = []
    for ia, ib in _matchings(num_nodes):
        nodes = np.concatenate([ia, ib]).tolist()
        assert len(nodes) == len(set(nodes)) and (ia < ib).all()
        seen += list(zip(ia.tolist(), ib.tolist()))
    assert sorted(seen) == [(a, b) for a in range(num_nodes) for b in range(a + 1, num_nodes)]


# --- the GPU-level swap rounds against a brute force over every candidate swap -------------------

def _round_state(seed, topo, replicated=3, layers=4, alpha=0.4):
    """A random _State: every expert one copy, `replicated` of them a second copy on another node; copy loads
    random, normalized so the mean GPU load is 1 (as _affinity does); a random symmetric co-activation W."""
    from sglang_h20.eplb.placement import _State

    rng = np.random.default_rng(seed)
    S, N, C = topo.num_slots, topo.num_nodes, topo.gpus_per_node * topo.slots_per_gpu
    E = S - replicated
    e, prim, gpu = np.empty((layers, S), np.int64), np.zeros((layers, S), bool), np.empty((layers, S), np.int64)
    for l in range(layers):
        # a replica sits on another node than its primary: primaries of the replicated experts on node 0's slots,
        # their replicas on the last node's
        experts = np.concatenate([np.arange(E), np.arange(replicated)])
        prim[l, :E] = True
        slots = np.empty(S, np.int64)
        slots[:replicated] = rng.permutation(C)[:replicated]  # node 0
        slots[E:] = (N - 1) * C + rng.permutation(C)[:replicated]  # the last node
        rest = np.setdiff1d(np.arange(S), slots[list(range(replicated)) + list(range(E, S))])
        slots[replicated:E] = rng.permutation(rest)
        e[l], gpu[l] = experts, slots // topo.slots_per_gpu
    w = rng.random((layers, S)) + 0.05
    w *= topo.num_gpus / w.sum(axis=1, keepdims=True)
    W = rng.random((layers, E, E)).astype(np.float32)
    W = (W + W.transpose(0, 2, 1)) / 2
    W[:, np.arange(E), np.arange(E)] = 0.0
    return _State(W, e, w, prim, gpu, topo), alpha


def _cut(st, l, node):
    """Pair weight between layer l's primaries on different nodes, given each copy's node."""
    p = np.flatnonzero(st.prim[l])
    cross = node[p][:, None] != node[p][None, :]
    return float((st.W[l][np.ix_(st.e[l, p], st.e[l, p])] * cross).sum()) / 2


def _objective(st, l, gpu, alpha):
    """GPU-balance penalty plus alpha times the cut (pair weight between primaries on different nodes), from the
    copies' GPUs alone."""
    from sglang_h20.eplb.placement import _penalty

    load = np.bincount(gpu, weights=st.w[l], minlength=st.topo.num_gpus)
    return float(_penalty(load, alpha).sum()) + alpha * _cut(st, l, gpu // st.topo.gpus_per_node)


def _best_gain(st, l, candidates, alpha):
    """How much the best of the candidate exchanges (x, y) lowers the objective (0 if none does); swaps that would
    put two copies of an expert on one node are not allowed."""
    gpu, G = st.gpu[l], st.topo.gpus_per_node
    before, best = _objective(st, l, gpu, alpha), 0.0
    for x, y in candidates:
        g = gpu.copy()
        g[x], g[y] = gpu[y], gpu[x]
        node = g // G
        if any(len(set(node[st.e[l] == ex])) < (st.e[l] == ex).sum() for ex in (st.e[l, x], st.e[l, y])):
            continue
        best = max(best, before - _objective(st, l, g, alpha))
    return best


def _check_round(st, before_gpu, candidates, gains, moved, alpha):
    """Per layer: the round made one swap per group that has an improving candidate (a node's, or the layer's),
    each between one of that group's candidate pairs, lowering the objective by the best candidate's gain (ties are
    common: with two copies per GPU, swapping either pair can leave the same two loads); the loads kept."""
    for l in range(before_gpu.shape[0]):
        changed = np.flatnonzero(st.gpu[l] != before_gpu[l])
        want = [g for g in gains[l] if g > 1e-9]
        assert len(changed) == 2 * len(want) and moved[l] == bool(want), (l, changed, gains[l])
        pairs = {frozenset(map(int, c)) for group in candidates[l] for c in group}
        made = {frozenset((int(x), int(y))) for x in changed for y in changed
                if x < y and st.gpu[l, x] == before_gpu[l, y] and st.gpu[l, y] == before_gpu[l, x]}
        assert len(made) == len(want) and made <= pairs, (l, made)
        after = _objective(st, l, st.gpu[l], alpha)
        assert _objective(st, l, before_gpu[l], alpha) - after == pytest.approx(sum(want), rel=1e-9, abs=1e-12)
        np.testing.assert_allclose(st.load[l], np.bincount(st.gpu[l], weights=st.w[l], minlength=st.topo.num_gpus))


@pytest.mark.parametrize("gpus_per_node", [2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_within_node_round_makes_each_nodes_best_swap(seed, gpus_per_node):
    """Per node: the best swap between its hottest GPU and a copy on one of its two coldest GPUs (no cut change)."""
    from sglang_h20.eplb.placement import _within_node_round

    topo = Topology(num_nodes=2, gpus_per_node=gpus_per_node, slots_per_gpu=2)
    st, alpha = _round_state(seed, topo)
    before, candidates, gains = st.gpu.copy(), [], []
    for l in range(st.gpu.shape[0]):
        candidates.append([]), gains.append([])
        for n in range(topo.num_nodes):
            gpus = n * topo.gpus_per_node + np.arange(topo.gpus_per_node)
            order = gpus[np.argsort(st.load[l, gpus])]
            hot, cold = order[-1], order[:2]
            cands = [(x, y) for x in np.flatnonzero(before[l] == hot) for y in np.flatnonzero(np.isin(before[l], cold))]
            candidates[l].append(cands)
            gains[l].append(_best_gain(st, l, cands, alpha))
    assert any(g > 1e-9 for gl in gains for g in gl), "the random states should leave some node a swap to make"
    moved = _within_node_round(st, np.arange(st.gpu.shape[0]), alpha)
    _check_round(st, before, candidates, gains, moved, alpha)


@pytest.mark.parametrize("seed", range(6))
def test_hottest_gpu_round_makes_each_layers_best_swap(seed):
    """Per layer: the best swap between a copy on the hottest GPU and a copy on any other GPU, a cross-node one
    paying its cut change, none putting two copies of an expert on one node."""
    from sglang_h20.eplb.placement import _hottest_gpu_round

    topo = Topology(num_nodes=3, gpus_per_node=2, slots_per_gpu=2)
    st, alpha = _round_state(seed, topo)
    before, candidates, gains = st.gpu.copy(), [], []
    for l in range(st.gpu.shape[0]):
        hot = int(np.argmax(st.load[l]))
        cands = [(x, y) for x in np.flatnonzero(before[l] == hot) for y in np.flatnonzero(before[l] != hot)]
        candidates.append([cands])
        gains.append([_best_gain(st, l, cands, alpha)])
    assert any(g > 1e-9 for gl in gains for g in gl), "the random states should leave some layer a swap to make"
    moved = _hottest_gpu_round(st, np.arange(st.gpu.shape[0]), alpha)
    _check_round(st, before, candidates, gains, moved, alpha)


def _node_objective(st, l, alpha):
    """The node phase's objective for layer l: node-balance penalty plus alpha times the cut, from the copies'
    current nodes alone."""
    from sglang_h20.eplb.placement import _NODE_SLACK, _penalty

    G = st.topo.gpus_per_node
    node = st.gpu[l] // G
    load = np.bincount(node, weights=st.w[l], minlength=st.topo.num_nodes) / G
    return float(_penalty(load, alpha, _NODE_SLACK).sum()) + alpha * _cut(st, l, node)


@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.9])
def test_node_round_swaps_each_lower_the_objective(alpha):
    """The node phase's cross-node round makes up to two swaps per node pair; the second one's gain is corrected
    for the first (node loads and the pair weights to the first swap's two copies). Checked from outside: every
    swap, the second included, lowers its layer's node objective by more than the tolerance; afterwards the
    incrementally kept loads and A equal a recount."""
    from sglang_h20.eplb import placement as pl

    topo = Topology(num_nodes=2, gpus_per_node=2, slots_per_gpu=3)
    seconds = 0
    for seed in range(12):
        st, _ = _round_state(seed, topo, replicated=2, layers=16, alpha=alpha)
        calls, real_swap = [], st.swap

        def swap(l, x, y):
            before = [_node_objective(st, int(i), alpha) for i in l]
            real_swap(l, x, y)
            calls.append([(int(i), b - _node_objective(st, int(i), alpha)) for i, b in zip(l, before)])

        st.swap = swap
        ia, ib = pl._matchings(2)[0]
        pl._cross_node_round(st, np.arange(16), ia, ib, alpha, gpu_level=False)
        for call in calls:
            for layer, drop in call:
                assert drop > pl._TOL, (seed, layer, drop, len(calls))
        seconds += len(calls[1]) if len(calls) > 1 else 0
        # the incremental tables agree with a recount after both swaps
        G = topo.gpus_per_node
        for l in range(16):
            np.testing.assert_allclose(st.load[l], np.bincount(st.gpu[l], weights=st.w[l], minlength=topo.num_gpus))
            onehot = np.zeros((topo.num_nodes, st.W.shape[1]))
            np.add.at(onehot, (st.gpu[l] // G, st.e[l]), st.prim[l].astype(float))
            np.testing.assert_allclose(st.A[l], onehot @ st.W[l].astype(np.float64), rtol=1e-5, atol=1e-6)
    assert seconds > 10, "the random states should leave many layers a second swap to make"


def test_validate_refuses_each_kind_of_broken_placement():
    """Placement.validate, which every planner's result goes through: a right placement passes; an expert id below 0
    or past the last expert, an expert left without a replica, or a slot count off the topology's is refused with
    its reason."""
    topo = Topology(1, 2, 3)  # 6 slots for 4 experts: 2 redundant
    ok = np.array([[0, 1, 2, 3, 0, 1]])
    Placement(ok, topo, 4).validate()
    for bad, reason in ((np.array([[0, 1, 2, 3, 0, -1]]), "out of range"),
                        (np.array([[0, 1, 2, 3, 4, 1]]), "out of range"),
                        (np.array([[0, 1, 2, 0, 0, 1]]), "layer 0: logical expert 3 has no replica"),
                        (np.array([[0, 1, 2, 3, 0]]), "5 slots per layer, topology has 6")):
        with pytest.raises(ValueError, match=reason):
            Placement(bad, topo, 4).validate()


def test_a_layer_without_tokens_is_placed_as_if_every_expert_were_equally_loaded():
    """A layer that saw no token in the window (all counts 0) must still get a valid placement; ours spreads it as
    if loads were equal (no expert twice on a GPU, one extra copy at most per expert), beside a layer with real
    routing."""
    rng = np.random.default_rng(5)
    topk, _ = routing(1, 512, rng, num_experts=64)
    coact = stats_from(topk, 64).coact
    empty = CoactivationStats(np.concatenate([coact, np.zeros_like(coact)]), 512)
    topo = Topology(2, 2, 18)  # 72 slots for 64 experts
    place(empty, topo, "deepseek").validate()  # upstream's planner: valid; how it spreads copies is its own
    p = place(empty, topo, "affinity")
    p.validate()
    per_gpu = p.phy2log[1].reshape(topo.num_gpus, -1)
    assert all(len(set(row)) == topo.slots_per_gpu for row in per_gpu)  # no expert twice on a GPU
    counts = p.replica_counts()[1]
    assert counts.min() >= 1 and counts.max() - counts.min() <= 1, counts  # the 8 extra copies spread evenly
