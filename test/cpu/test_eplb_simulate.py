"""EPLB simulator: metrics on hand-built placements with hand-computed answers, migration bytes,
synthetic traces (distinctness, determinism, clusters, drift), SGLang dump reading, driver and CLI."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sglang_h20.eplb import placement as placement_mod
from sglang_h20.eplb import simulate as sim
from sglang_h20.eplb.placement import Placement, Topology
from sglang_h20.eplb.stats import CoactivationStats
from sglang_h20.eplb.trace import read_sglang_dump, synthetic_trace, zipf_weights

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOPO = Topology(num_nodes=2, gpus_per_node=2, slots_per_gpu=2)  # GPUs 0,1 on node 0; 2,3 on node 1
COPY = sim.DISPATCH_BYTES + sim.COMBINE_BYTES
HAVE_PLACE = hasattr(placement_mod, "place")


def P(*rows, experts=8) -> Placement:
    return Placement(np.array(rows, dtype=np.int64), TOPO, experts)


# --- constants ---------------------------------------------------------------------------------------------------

def test_byte_constants():
    assert sim.DISPATCH_BYTES == 7168 + 56 * 4 == 7392
    assert sim.COMBINE_BYTES == 14336
    assert sim.EXPERT_BYTES == 3 * 2048 * 7168 + 3 * 16 * 56 * 4 == 44_050_944


# --- evaluate on a hand-built case -------------------------------------------------------------------------------

def test_token_origins_default_and_given():
    node, gpu = sim.token_origins(6, TOPO)
    assert node.tolist() == [0, 1, 0, 1, 0, 1]
    assert gpu.tolist() == [0, 2, 1, 3, 0, 2]
    node, gpu = sim.token_origins(4, TOPO, np.array([1, 1, 1, 0]))
    assert gpu.tolist() == [2, 3, 2, 0]


def test_evaluate_hand_computed():
    # contiguous: slots 0,1 -> GPU0; 2,3 -> GPU1; 4,5 -> GPU2; 6,7 -> GPU3
    pl = P([0, 1, 2, 3, 4, 5, 6, 7])
    # tokens: t0 node0/GPU0, t1 node1/GPU2, t2 node0/GPU1, t3 node1/GPU3
    ids = np.array([[[0, 4], [1, 2], [6, 7], [6, 5]]])
    m = sim.evaluate(pl, ids)
    # loads: GPU0 {t0:e0, t1:e1}=2, GPU1 {t1:e2}=1, GPU2 {t0:e4, t3:e5}=2, GPU3 {t2:e6,e7, t3:e6}=3
    assert m["gpu_load"].tolist() == [[2, 1, 2, 3]]
    assert m["balancedness"] == pytest.approx(2 / 3)
    # remote nodes: t0 -> node1, t1 -> node0, t2 -> node1, t3 -> none
    assert m["cross_node_total"] == 3
    assert m["cross_node_mean"] == pytest.approx(0.75)
    # NVLink: t1's copy lands (RDMA) on GPU0 (same local rank as GPU2) and is forwarded to GPU1;
    # t3 sends to GPU2 on its own node. t0 lands directly on GPU2, t2 on GPU3 (both experts, one copy).
    assert m["nvlink_copies"] == 2 and m["network_copies"] == 3
    assert m["nvlink_bytes"] == 2 * COPY and m["network_bytes"] == 3 * COPY
    assert m["dispatch_network_bytes"] == 3 * 7392 and m["combine_network_bytes"] == 3 * 14336
    assert m["dispatch_nvlink_bytes"] == 2 * 7392 and m["combine_nvlink_bytes"] == 2 * 14336


def test_evaluate_node_dedup_and_forwarding():
    # one token on GPU0 with 4 experts on node 1: GPU2 x2 (slots 4,5), GPU3 x2 (slots 6,7)
    pl = P([0, 1, 2, 3, 4, 5, 6, 7])
    m = sim.evaluate(pl, np.array([[[4, 5, 6, 7]]]), token_node=np.array([0]))
    assert m["network_copies"] == 1  # one copy per destination node
    assert m["nvlink_copies"] == 1  # lands on GPU2 (local rank 0), forwarded to GPU3 only
    assert m["cross_node_total"] == 1
    # the same experts seen from GPU1 (local rank 1): lands on GPU3, forwarded to GPU2
    m = sim.evaluate(pl, np.array([[[0], [4]]]), token_node=np.array([0, 0]))
    # t0 on GPU0 -> GPU0 itself: no bytes; t1 on GPU1 -> GPU2: network + forward from GPU3
    assert m["network_copies"] == 1 and m["nvlink_copies"] == 1
    assert m["gpu_load"].tolist() == [[1, 0, 1, 0]]


def test_evaluate_two_layers_and_padding():
    pl = P([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0])
    ids = np.array([[[0, -1]], [[0, -1]]])  # token 0 (GPU0) -> expert 0, second id is padding
    m = sim.evaluate(pl, ids)
    assert m["gpu_load"].tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]  # layer 1: expert 0 in slot 7 = GPU3
    assert m["cross_node_per_layer"] == [0.0, 1.0]
    assert m["balancedness_per_layer"] == pytest.approx([0.25, 0.25])
    assert m["network_copies"] == 1 and m["nvlink_copies"] == 1  # lands GPU2, forwarded to GPU3


def test_replica_choice_prefers_own_node_then_hashed():
    # expert 0 in slots 0 (GPU0), 3 (GPU1), 7 (GPU3); expert 1 only in slots 1 and 2 (node 0)
    pl = P([0, 1, 1, 0, 2, 3, 4, 0], experts=5)
    ids = np.array([[[0], [0], [0], [0], [1], [1], [1]]])
    node = np.array([0, 0, 0, 1, 1, 1, 0])
    slots = sim.choose_slots(pl, ids, node)[0, :, 0]
    pick = lambda t, e: (t * 2654435761 + e * 40503) % 2147483647  # noqa: E731  (the documented rule)
    # node-0 tokens choose among node-0 replicas [0, 3]; the node-1 token -> slot 7 (its only local one);
    # expert 1 has no node-1 replica: every token chooses among all replicas [1, 2]
    want = [[0, 3][pick(0, 0) % 2], [0, 3][pick(1, 0) % 2], [0, 3][pick(2, 0) % 2], 7,
            [1, 2][pick(4, 1) % 2], [1, 2][pick(5, 1) % 2], [1, 2][pick(6, 1) % 2]]
    assert slots.tolist() == want
    m = sim.evaluate(pl, ids, token_node=node)
    load = np.bincount(np.array(want) // 2, minlength=4)
    assert m["gpu_load"].tolist() == [load.tolist()]
    assert m["balancedness"] == pytest.approx((7 / 4) / load.max())
    assert m["cross_node_total"] == 2  # tokens 4 and 5 (node 1) -> node 0


def test_remote_replica_choice_does_not_follow_token_origin():
    """Each node's tokens spread evenly over remote replicas (no aliasing with t % num_nodes)."""
    # 4 nodes x 1 GPU x 2 slots; expert 0 on nodes 1 and 2 only: node-0 tokens (t = 0, 4, 8, ...) would
    # all take the same replica under a plain t % replicas rule
    pl = sim.Placement(np.array([[1, 2, 0, 3, 0, 4, 5, 6]]), sim.Topology(4, 1, 2), 7)
    T = 4000
    ids = np.zeros((1, T, 1), dtype=np.int64)
    node = np.arange(T) % 4
    slots = sim.choose_slots(pl, ids, node)[0, :, 0]
    from_node0 = np.bincount(slots[node == 0], minlength=8)[[2, 4]]
    assert from_node0.min() > 0.85 * from_node0.max(), from_node0


def test_evaluate_rejects_bad_inputs():
    pl = P([0, 1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(ValueError):
        sim.evaluate(pl, np.zeros((2, 1, 1), dtype=np.int64))  # 2 layers vs 1
    with pytest.raises(ValueError):
        sim.evaluate(pl, np.array([[[8]]]))  # expert out of range
    with pytest.raises(ValueError):
        sim.evaluate(P([0, 1, 2, 3, 4, 5, 6, 6]), np.array([[[7]]]))  # expert 7 has no replica


# --- migration ---------------------------------------------------------------------------------------------------

def test_migration_zero_for_identical():
    a = P([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0])
    m = sim.migration_bytes(a, P(*a.phy2log.tolist()))
    assert m["total"] == 0 and m["local"] == m["nvlink"] == m["network"] == 0


def test_migration_hand_built():
    old = P([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7])
    # layer 0: s0<-1, s1<-0 (same GPU: local); s2<-4, s4<-2 (other node: network);
    #          s5<-6, s6<-5 (other GPU, same node: NVLink); s3, s7 unchanged
    # layer 1: s7<-0 (node 0 -> node 1: network)
    new = P([1, 0, 4, 3, 2, 6, 5, 7], [0, 1, 2, 3, 4, 5, 6, 0])
    m = sim.migration_bytes(old, new)
    assert (m["copies_local"], m["copies_nvlink"], m["copies_network"]) == (2, 2, 3)
    assert m["local"] == 2 * sim.EXPERT_BYTES
    assert m["nvlink"] == 2 * sim.EXPERT_BYTES
    assert m["network"] == 3 * sim.EXPERT_BYTES
    assert m["total"] == 7 * sim.EXPERT_BYTES
    # the replaced expert being already elsewhere on the GPU counts as local, not as a move
    m = sim.migration_bytes(P([0, 1, 2, 3, 4, 5, 6, 7]), P([0, 0, 2, 3, 4, 5, 6, 7]))
    assert (m["copies_local"], m["copies_nvlink"], m["copies_network"]) == (1, 0, 0)


def test_migration_rejects_mismatch():
    other = Placement(np.arange(8)[None], Topology(1, 4, 2), 8)
    with pytest.raises(ValueError):
        sim.migration_bytes(P([0, 1, 2, 3, 4, 5, 6, 7]), other)


# --- synthetic traces --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("clusters", [None, 16, 5])
def test_trace_distinct_shape_range(clusters):
    steps = list(synthetic_trace(3, 64 if clusters == 5 else 256, 8, 512, steps=3, clusters=clusters,
                                 cluster_strength=0.9, seed=1))
    assert len(steps) == 3
    for a in steps:
        E = 64 if clusters == 5 else 256
        assert a.shape == (3, 512, 8) and a.dtype == np.int64
        assert a.min() >= 0 and a.max() < E
        s = np.sort(a, axis=-1)
        assert (np.diff(s, axis=-1) > 0).all(), "experts of a token must be distinct"


def test_trace_deterministic_for_seed():
    a = list(synthetic_trace(2, tokens_per_step=256, steps=3, seed=7))
    b = list(synthetic_trace(2, tokens_per_step=256, steps=3, seed=7))
    c = list(synthetic_trace(2, tokens_per_step=256, steps=3, seed=8))
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))
    tr = synthetic_trace(2, tokens_per_step=256, steps=3, seed=7)
    assert all((x == y).all() for x, y in zip(tr, tr))  # iterating again replays


def test_trace_skew_differs_per_layer():
    a = np.concatenate(list(synthetic_trace(2, tokens_per_step=4096, steps=2, clusters=None, skew=0.8,
                                            drift=0.0)), axis=1)
    loads = [np.bincount(a[l].ravel(), minlength=256) for l in range(2)]
    assert loads[0].max() > 3 * loads[0].mean()  # skewed
    assert np.corrcoef(loads[0], loads[1])[0, 1] < 0.5  # different hot experts per layer
    flat = np.concatenate(list(synthetic_trace(1, tokens_per_step=4096, steps=2, clusters=None, skew=0.0)),
                          axis=1)
    load = np.bincount(flat.ravel(), minlength=256)
    assert load.max() < 1.5 * load.mean()  # skew 0 = uniform


def _within_across(ids: np.ndarray, members: list[np.ndarray], E: int) -> tuple[float, float]:
    co = CoactivationStats.from_topk_ids(ids[None], E).coact[0].astype(float)
    np.fill_diagonal(co, 0)
    label = np.empty(E, dtype=int)
    for c, m in enumerate(members):
        label[m] = c
    same = label[:, None] == label[None, :]
    np.fill_diagonal(same, False)
    off = ~same
    np.fill_diagonal(off, False)
    return co[same].mean(), co[off].mean()


def test_trace_clusters_coactivate():
    tr = synthetic_trace(1, tokens_per_step=4096, steps=1, clusters=16, cluster_strength=0.8, seed=3)
    ids = next(iter(tr))[0]
    members = tr.cluster_members(0)
    assert len(members) == 16 and sorted(np.concatenate(members).tolist()) == list(range(256))
    within, across = _within_across(ids, members, 256)
    assert within > 10 * across
    # no structure: the same partition shows no preference
    flat = next(iter(synthetic_trace(1, tokens_per_step=4096, steps=1, clusters=None, seed=3)))[0]
    w0, a0 = _within_across(flat, members, 256)
    assert 0.7 < w0 / a0 < 1.4
    assert synthetic_trace(1, clusters=None).cluster_members(0) == []


@pytest.mark.parametrize("E, clusters", [(8, 2), (12, 3), (10, 3)])
def test_trace_full_strength_tokens_take_their_whole_cluster(E, clusters):
    """cluster_strength 1 and top_k = the largest cluster's size: a token of a full cluster is exactly that cluster
    (expert 0 included, wherever it sits), a token of a smaller one takes all of it plus global draws."""
    size = -(-E // clusters)
    tr = synthetic_trace(2, E, size, 300, steps=2, clusters=clusters, cluster_strength=1.0, seed=E)
    for l in range(2):
        members = [set(m.tolist()) for m in tr.cluster_members(l)]
        for step in tr:
            for token in step[l]:
                got = set(token.tolist())
                assert any(m <= got and (len(m) < size or m == got) for m in members), (got, members)


def test_zipf_weights_sum_to_one_and_fall_by_rank():
    w = zipf_weights(8, 1.5)
    assert w.sum() == pytest.approx(1.0, abs=1e-12) and w[0] / w[3] == pytest.approx(4 ** 1.5)
    assert np.allclose(zipf_weights(5, 0.0), 0.2)


def test_trace_cluster_draws_follow_popularity():
    """cluster_strength 1, one expert per token: a token picks a cluster by its summed popularity, then an expert in
    it by popularity, so experts are drawn as often as the layer's popularity says (within sampling noise)."""
    tr = synthetic_trace(1, 32, 1, 100_000, steps=1, skew=1.0, drift=0.0, clusters=4, cluster_strength=1.0, seed=5)
    drawn = np.bincount(next(iter(tr))[0][:, 0], minlength=32) / 100_000
    assert 0.5 * np.abs(drawn - tr.popularity(0)[0]).sum() < 0.015  # total variation (seen: 0.006)


def test_trace_argument_edges():
    """top_k may equal the expert count (every token then routes to all of them); cluster_strength spans [0, 1]
    inclusive (0: tokens ignore their cluster), clusters span [1, num_experts]; outside them, and top_k above the
    expert count, are refused."""
    step = next(iter(synthetic_trace(1, 8, 8, 50, steps=1, clusters=None)))
    assert (np.sort(step[0], axis=1) == np.arange(8)).all()
    for strength in (0.0, 1.0):
        step = next(iter(synthetic_trace(1, 16, 4, 50, steps=1, clusters=4, cluster_strength=strength)))
        assert step.shape == (1, 50, 4)
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match="cluster_strength"):
            synthetic_trace(1, 16, 4, 50, clusters=4, cluster_strength=bad)
    with pytest.raises(ValueError, match="top_k=9 > num_experts=8"):
        synthetic_trace(1, 8, 9, 50)
    for clusters in (1, 16):  # one cluster of all experts, or one expert per cluster
        step = next(iter(synthetic_trace(1, 16, 4, 50, steps=1, clusters=clusters, cluster_strength=1.0)))
        assert step.shape == (1, 50, 4) and (np.diff(np.sort(step[0], axis=1), axis=1) > 0).all()  # distinct
    for bad in (0, 17):
        with pytest.raises(ValueError, match=f"clusters={bad}: need 1 <= clusters <= num_experts=16"):
            synthetic_trace(1, 16, 4, 50, clusters=bad)


def test_trace_drift_changes_popularity():
    def corr(drift):
        tr = synthetic_trace(4, tokens_per_step=8192, steps=40, clusters=None, drift=drift, seed=5)
        steps = list(tr)
        first = np.stack([np.bincount(steps[0][l].ravel(), minlength=256) for l in range(4)])
        last = np.stack([np.bincount(steps[-1][l].ravel(), minlength=256) for l in range(4)])
        pop_change = np.abs(tr.popularity(39) - tr.popularity(0)).sum()
        return np.mean([np.corrcoef(first[l], last[l])[0, 1] for l in range(4)]), pop_change

    static, change0 = corr(0.0)
    drifting, change = corr(0.3)
    assert change0 == 0.0 and change > 0.1
    assert static > 0.9
    assert drifting < static - 0.2


# --- coactivation helper ----------------------------------------------------------------------------------------

def test_coactivation_matches_stats():
    steps = list(synthetic_trace(2, 64, 6, 300, steps=2, clusters=4, seed=2))
    steps[1][0, :5, -1] = -1  # padding
    steps[1][1, 3, :2] = 7  # a repeated id counts once, as in CoactivationStats
    ref = CoactivationStats.empty(2, 64)
    for s in steps:
        ref.add_topk_ids(s)
    got = sim.coactivation(steps, 64)
    assert (got.coact == ref.coact).all() and got.tokens == ref.tokens == 600


# --- SGLang dumps ------------------------------------------------------------------------------------------------

def _write_per_token_dump(tmp: Path) -> tuple[np.ndarray, dict]:
    """A dump written by SGLang's own per_token gatherer + accumulator (CPU), 2 ranks x 2 passes."""
    code = r'''
import os, sys, types, torch, pickle
os.environ["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = sys.argv[1]
from sglang.srt.eplb import expert_distribution as ed
L, S, E = 3, 10, 8
p2l = torch.tensor([[i % E for i in range(S)]] * L)
p2l[2] = torch.tensor([3, 1, 2, 0, 4, 5, 6, 7, 3, 1])
sa = types.SimpleNamespace(expert_distribution_recorder_mode="per_token", chunked_prefill_size=16,
    device="cpu", enable_two_batch_overlap=False, enable_expert_distribution_metrics=False,
    moe_a2a_backend="none")
meta = types.SimpleNamespace(num_layers=L, num_physical_experts=S, physical_to_logical_map=p2l,
    num_logical_experts=E)
g = torch.Generator().manual_seed(0)
phys = {}
for rank in (0, 1):
    gat = ed._SinglePassGatherer.init_new(sa, meta, rank)
    acc = ed._Accumulator.init_new(sa, meta, rank)
    for fid in (5, 6):
        gat.reset()
        T = 3 + rank
        fb = types.SimpleNamespace(input_ids=torch.arange(T), positions=torch.arange(T),
            extend_seq_lens_cpu=[T], forward_mode=types.SimpleNamespace(value=1))
        gat.on_forward_pass_start(fb)
        for l in (1, 2):  # layer 0 is dense: never routed
            ids = torch.stack([torch.randperm(S, generator=g)[:8] for _ in range(T)]).int()
            phys[(rank, fid, l)] = ids.tolist()
            gat.on_select_experts(l, ids)
        acc.append(fid, "primary", gat.collect(), {})
    acc.dump("file")
pickle.dump((p2l.tolist(), phys), open(os.path.join(sys.argv[1], "truth.pkl"), "wb"))
'''
    r = subprocess.run([sys.executable, "-c", code, str(tmp)], capture_output=True, text=True, timeout=300)
    # sglang 0.5.17 is pinned and its recorder runs on a CPU: a failure here is the drift this test is for
    assert r.returncode == 0, f"SGLang's recorder failed: {r.stderr[-2000:]}"
    import pickle

    p2l, phys = pickle.load(open(tmp / "truth.pkl", "rb"))
    (tmp / "truth.pkl").unlink()
    return np.array(p2l), phys


def test_read_sglang_per_token_dump(tmp_path):
    p2l, phys = _write_per_token_dump(tmp_path)
    assert len(list(tmp_path.glob("expert_distribution_recorder_*_*.pt"))) == 2
    d = read_sglang_dump(tmp_path)
    assert d.forward_pass_ids == [5, 6]
    assert d.layers.tolist() == [1, 2]  # dense layer 0 dropped
    assert d.num_experts == 8 and len(d) == 2
    for i, fid in enumerate((5, 6)):
        assert d.steps[i].shape == (2, 3 + 4, 8)
        assert d.token_ranks[i].tolist() == [0, 0, 0, 1, 1, 1, 1]
        for j, layer in enumerate((1, 2)):
            want = np.concatenate([p2l[layer][np.array(phys[(r, fid, layer)])] for r in (0, 1)])
            assert (d.steps[i][j] == want).all()  # physical ids mapped back to logical
    # a single rank file works too
    one = read_sglang_dump(sorted(tmp_path.glob("*_0.pt"))[0])
    assert one.steps[0].shape == (2, 3, 8)


def test_read_sglang_dump_takes_records_without_a_rank_as_rank_0_and_names_a_layer_mismatch(tmp_path):
    """A hand-made per_token dump: records without 'rank' count as rank 0 and sort before rank 1's; the physical
    ids map back through the dump's map, and padding (-1) stays padding; a record with more layers than the map is
    refused with both counts."""
    import torch

    p2l = torch.tensor([[3, 2, 1, 0]])  # one layer, 4 slots, reversed
    recs = [dict(forward_pass_id=7, rank=1, topk_ids_of_layer=torch.tensor([[[0, 1]]], dtype=torch.int32)),
            dict(forward_pass_id=7, topk_ids_of_layer=torch.tensor([[[2, -1], [3, 0]]], dtype=torch.int32))]
    torch.save(dict(records=recs, last_physical_to_logical_map=p2l), tmp_path / "dump.pt")
    d = read_sglang_dump(tmp_path / "dump.pt")
    assert d.token_ranks[0].tolist() == [0, 0, 1] and d.forward_pass_ids == [7] and d.num_experts == 4
    assert d.steps[0].tolist() == [[[1, -1], [0, 3], [3, 2]]]
    recs.append(dict(forward_pass_id=8, topk_ids_of_layer=torch.zeros(2, 1, 2, dtype=torch.int32)))
    torch.save(dict(records=recs, last_physical_to_logical_map=p2l), tmp_path / "dump.pt")
    with pytest.raises(ValueError, match="2 layers in topk_ids_of_layer, 1 in the map"):
        read_sglang_dump(tmp_path / "dump.pt")


def test_read_sglang_dump_refuses_aggregated_modes(tmp_path):
    import torch

    torch.save(dict(rank=0, logical_count=torch.zeros(4, 3, 8, dtype=torch.int32),
                    average_utilization_rate_over_window=None), tmp_path / "stat.pt")
    with pytest.raises(ValueError, match="aggregated counts only.*stat"):
        read_sglang_dump(tmp_path / "stat.pt")
    torch.save(dict(records=[dict(forward_pass_id=1, rank=0, gatherer_key="primary",
                                  global_physical_count=torch.zeros(3, 8, dtype=torch.int32))],
                    last_physical_to_logical_map=torch.arange(8).repeat(3, 1)), tmp_path / "pass.pt")
    with pytest.raises(ValueError, match="aggregated counts only.*per_pass"):
        read_sglang_dump(tmp_path / "pass.pt")
    with pytest.raises(FileNotFoundError):
        read_sglang_dump(tmp_path / "missing.pt")
    torch.save(dict(records=[]), tmp_path / "nomap.pt")  # records without the map they are read through
    with pytest.raises(ValueError, match="not an SGLang expert-distribution dump"):
        read_sglang_dump(tmp_path / "nomap.pt")


def test_read_sglang_dump_directory_prefers_recorder_files_and_keeps_a_layer_routed_to_expert_0(tmp_path):
    """A directory's expert_distribution_recorder_*.pt files are the dump (another .pt beside them is not read);
    without any, its .pt files are; a layer whose tokens all went to logical expert 0 is a routed layer."""
    import torch

    p2l = torch.tensor([[0, 1], [1, 0]])  # two layers, two slots
    ids = torch.tensor([[[0]], [[1]]], dtype=torch.int32)  # layer 0 -> slot 0, layer 1 -> slot 1: expert 0 both
    torch.save(dict(records=[dict(forward_pass_id=1, topk_ids_of_layer=ids)], last_physical_to_logical_map=p2l),
               tmp_path / "expert_distribution_recorder_1_0.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    d = read_sglang_dump(tmp_path)
    assert d.layers.tolist() == [0, 1] and d.steps[0].tolist() == [[[0]], [[0]]] and d.num_experts == 2
    (tmp_path / "other.pt").unlink()
    (tmp_path / "expert_distribution_recorder_1_0.pt").rename(tmp_path / "renamed.pt")
    assert read_sglang_dump(tmp_path).forward_pass_ids == [1]


# --- driver ------------------------------------------------------------------------------------------------------

def _shift_placer(stats, topo, algorithm, *, affinity=0.5, seed=0):
    """Test stand-in for `place`: 'shift' rotates the trivial layout by one slot per call."""
    L, E = stats.num_layers, stats.num_experts
    _shift_placer.calls += 1
    row = (np.arange(topo.num_slots) + _shift_placer.calls) % E
    return Placement(np.tile(row, (L, 1)), topo, E, algorithm)


def test_simulate_driver_with_stand_in_placer():
    _shift_placer.calls = 0
    cfg = sim.SimConfig(topologies=("ep16",), structures=("clusters",), algorithms=("trivial", "shift"),
                        layers=2, tokens_per_step=128, steps=7, warmup=2, rebalance_every=2)
    rec = sim.simulate(cfg, placer=_shift_placer, progress=False, command="test")
    r = rec["results"]["clusters"]["ep16"]["algorithms"]
    assert _shift_placer.calls == 3  # plans at steps 2, 4, 6
    assert [m["step"] for m in r["shift"]["migrations"]] == [2, 4, 6]
    assert [m["from"] for m in r["shift"]["migrations"]] == ["initial", "previous", "previous"]
    assert r["shift"]["evaluated_steps"] == r["trivial"]["evaluated_steps"] == 5
    # every slot changes expert at each rotation: 256 slots x 2 layers
    assert all(m["total"] == 2 * 256 * sim.EXPERT_BYTES for m in r["shift"]["migrations"])
    assert all(m["total"] == 0 for m in r["trivial"]["migrations"])
    assert 0 < r["trivial"]["balancedness"] <= 1 and r["trivial"]["cross_node_mean"] > 0
    # the window's load summed before mean / max is at least as even as its most uneven step
    for v in (r["trivial"], r["shift"]):
        assert v["balancedness_min"] <= v["balancedness_window"] <= 1
    assert rec["provenance"]["command"] == "test"
    json.dumps(rec)


def test_simulate_counts_rebalances_after_the_first_placement_and_reports_per_layer():
    """The first plan moves weights from the initial layout (a deployment's start, not a rebalance), so the mean
    bytes per rebalance are the later plans' only; the per-layer figures have one value per layer."""
    calls = []

    def staged(stats, topo, algorithm, **kw):  # call 1: layer 0 rotated; 2: layer 0 again; 3: both layers
        calls.append(1)
        n = len(calls)
        rows = [(np.arange(topo.num_slots) + (n if l == 0 or n == 3 else 0)) % stats.num_experts
                for l in range(stats.num_layers)]
        return Placement(np.stack(rows), topo, stats.num_experts, algorithm)

    cfg = sim.SimConfig(topologies=("ep16",), structures=("clusters",), algorithms=("staged",),
                        layers=2, tokens_per_step=128, steps=7, warmup=2, rebalance_every=2)
    r = sim.simulate(cfg, placer=staged, progress=False, command="test")["results"]["clusters"]["ep16"]
    staged_r = r["algorithms"]["staged"]
    assert [m["total"] for m in staged_r["migrations"]] == [256 * sim.EXPERT_BYTES, 256 * sim.EXPERT_BYTES,
                                                           512 * sim.EXPERT_BYTES]
    assert staged_r["migration_bytes_per_rebalance"] == 384 * sim.EXPERT_BYTES
    for key in ("balancedness_per_layer", "cross_node_per_layer"):
        assert len(staged_r[key]) == 2, key  # 5 evaluated steps, 2 layers


def test_each_structure_draws_its_own_trace(monkeypatch):
    """'clusters' draws the trace with the config's co-activation clusters, 'none' without any."""
    from sglang_h20.eplb import trace

    seen, real = [], trace.synthetic_trace
    monkeypatch.setattr(trace, "synthetic_trace", lambda *a, **kw: seen.append(kw["clusters"]) or real(*a, **kw))
    cfg = sim.SimConfig(topologies=("ep16",), structures=("clusters", "none"), algorithms=("trivial",),
                        layers=1, tokens_per_step=64, steps=3, warmup=1, rebalance_every=1)
    sim.simulate(cfg, progress=False)
    assert seen == [cfg.clusters, None] and cfg.clusters


@pytest.mark.parametrize("bad", [dict(warmup=0), dict(rebalance_every=0)])
def test_simulate_refuses_an_empty_warmup_or_window_alone(bad):
    cfg = sim.SimConfig(topologies=("ep16",), structures=("none",), algorithms=("trivial",),
                        layers=1, tokens_per_step=64, steps=3, **{"warmup": 1, "rebalance_every": 1, **bad})
    with pytest.raises(ValueError, match="must be >= 1"):
        sim.simulate(cfg, progress=False)


@pytest.mark.parametrize("wrong", ["topology", "layers"])
def test_simulate_refuses_a_placement_for_another_topology_or_layer_count_alone(wrong):
    """A placer's answer must fit the simulated cluster: 4 nodes x 4 GPUs has ep16's 256 slots but not its NVLink
    domains; one layer too many has the right topology but the wrong shape."""
    def placer(stats, topo, algorithm, **kw):
        t = Topology(4, 4, topo.slots_per_gpu) if wrong == "topology" else topo
        return sim.trivial_placement(t, stats.num_layers + (wrong == "layers"), stats.num_experts)

    cfg = sim.SimConfig(topologies=("ep16",), structures=("none",), algorithms=("odd",),
                        layers=1, tokens_per_step=64, steps=3, warmup=1, rebalance_every=1)
    with pytest.raises(ValueError, match="odd: placement of shape"):
        sim.simulate(cfg, placer=placer, progress=False)


def test_summary_reduction():
    def alg(c, b):
        return {"cross_node_mean": c, "balancedness": b, "balancedness_window": b + 0.05}
    res = {"clusters": {"ep16": {"algorithms": {"deepseek": alg(2.0, 0.9), "deepseek_hierarchical": alg(1.6, 0.8),
                                                "affinity": alg(1.2, 0.85), "contiguous": alg(0.5, 0.3)}}}}
    s = sim.summarize(res)["clusters"]["ep16"]
    assert s["best_sglang"] == "deepseek_hierarchical"
    assert s["affinity_reduction_pct"] == pytest.approx(25.0)
    assert s["best_sglang_balancedness"] == 0.8 and s["affinity_balancedness"] == 0.85
    assert s["affinity_balancedness_window"] == pytest.approx(0.9)


# --- CLI ---------------------------------------------------------------------------------------------------------

CLI_ALGORITHMS = list(sim.ALGORITHMS) + ["trivial"] if HAVE_PLACE else ["trivial"]


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "sglang_h20.eplb", "simulate", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for opt in ("--topologies", "--structure", "--steps", "--tokens-per-step", "--layers",
                "--redundant-slots", "--affinity", "--seed", "--dump", "--out"):
        assert opt in r.stdout


def test_cli_smoke_writes_json_and_pngs(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "sglang_h20.eplb", "simulate", "--topologies", "ep16", "ep32",
           "--structure", "both", "--algorithms", *CLI_ALGORITHMS, "--layers", "2", "--tokens-per-step", "256",
           "--steps", "6", "--warmup", "2", "--rebalance-every", "2", "--redundant-slots", "1",
           "--no-progress", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MPLBACKEND": "Agg"})
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((out / "eplb_simulate.json").read_text())
    assert rec["provenance"]["command"].startswith("python -m sglang_h20.eplb simulate")
    assert set(rec["results"]) == {"clusters", "none"}
    for s in ("clusters", "none"):
        assert set(rec["results"][s]) == {"ep16", "ep32"}
        for t, slots in (("ep16", 17), ("ep32", 9)):
            row = rec["results"][s][t]
            assert row["topology"]["slots_per_gpu"] == slots
            assert set(row["algorithms"]) == set(CLI_ALGORITHMS)
            for a, v in row["algorithms"].items():
                if a == "balanced":  # one replica per expert: refuses redundant slots, recorded not fatal
                    assert "without replication" in v["error"]
                    continue
                assert 0 < v["balancedness"] <= 1 and v["evaluated_steps"] == 4
                assert len(v["migrations"]) == 2
    for name in ("cross_node_traffic", "balancedness", "bytes", "migration"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    if HAVE_PLACE:
        assert "affinity_reduction_pct" in rec["summary"]["clusters"]["ep16"]


def test_cli_refuses_bad_input_with_exit_2_before_simulating(tmp_path, capsys, monkeypatch):
    """A usage error (unknown algorithm, missing dump, an --out that cannot be a folder) exits 2 with one line naming
    it, before the simulation runs; an error inside the simulation also exits 2, its message on stderr."""
    from sglang_h20.eplb.__main__ import main

    calls = []
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: calls.append(k))
    (tmp_path / "a_file").write_text("x")
    for bad, says in ((["--algorithms", "nope"], "--algorithms: unknown 'nope'"),
                      (["--dump", str(tmp_path / "missing")], "--dump: no such file or directory"),
                      (["--out", str(tmp_path / "a_file" / "o")], "--out: cannot create the directory")):
        assert main(["simulate", "--out", str(tmp_path / "o"), *bad]) == 2, bad  # a second --out replaces the first
        err = capsys.readouterr().err
        assert err.startswith("python -m sglang_h20.eplb simulate: error: ") and says in err, err
    assert calls == []

    def fails(*a, **k):
        raise ValueError("layers do not match")

    monkeypatch.setattr(sim, "simulate", fails)
    assert main(["simulate", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert capsys.readouterr().err == "error: layers do not match\n"


def test_cli_passes_progress_and_reports_what_it_wrote(tmp_path, capsys, monkeypatch):
    """The progress bar is on unless --no-progress; the last line names the JSON, the PNGs and the seconds taken."""
    from sglang_h20.eplb.__main__ import main

    seen = []
    monkeypatch.setattr(sim, "simulate", lambda cfg, progress, command: seen.append((progress, command)) or {})
    monkeypatch.setattr(sim, "write", lambda rec, out: (Path(out) / "eplb_simulate.json",
                                                         [Path(out) / "bytes.png", Path(out) / "migration.png"]))
    monkeypatch.setattr(sim, "format_summary", lambda rec: "summary")
    for extra, progress in (([], True), (["--no-progress"], False)):
        assert main(["simulate", "--out", str(tmp_path), *extra]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "summary"
        m = re.fullmatch(rf"wrote {re.escape(str(tmp_path))}/eplb_simulate.json and bytes.png, migration.png "
                         r"in (\d+\.\d) s", out[1])
        assert m and float(m.group(1)) < 60, out  # seconds taken, not a clock reading
        assert seen[-1] == (progress, " ".join(["python -m sglang_h20.eplb", "simulate", "--out", str(tmp_path),
                                                *extra]))


def test_cli_dump_trace(tmp_path):
    _write_per_token_dump(tmp_path)  # 8 logical experts, ids < 8 of the 256 simulated
    r = subprocess.run([sys.executable, "-m", "sglang_h20.eplb", "simulate", "--dump", str(tmp_path),
                        "--algorithms", "trivial", "--topologies", "ep16", "--warmup", "1",
                        "--rebalance-every", "1", "--no-progress", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "o" / "eplb_simulate.json").read_text())
    assert rec["results"]["dump"]["ep16"]["algorithms"]["trivial"]["evaluated_steps"] == 1


def test_simulate_replays_a_dump_with_up_to_the_configs_experts(tmp_path):
    """`dump=`: the simulator replays SGLang's recorded routing (structure 'dump') instead of synthetic traces. A
    dump with the config's expert count, or fewer, replays; one with more experts than the config is refused."""
    import torch

    rng = np.random.default_rng(5)
    p2l = torch.arange(32)[None]  # one layer, 32 slots, expert s on slot s
    recs = [dict(forward_pass_id=i, rank=0,
                 topk_ids_of_layer=torch.from_numpy(np.stack([rng.permutation(32)[:2] for _ in range(24)])[None]
                                                     .astype(np.int32)))
            for i in range(6)]
    torch.save(dict(records=recs, last_physical_to_logical_map=p2l), tmp_path / "dump.pt")
    assert read_sglang_dump(tmp_path / "dump.pt").num_experts == 32
    for experts in (32, 64):
        cfg = sim.SimConfig(topologies=("ep16",), algorithms=("trivial",), num_experts=experts, warmup=2,
                            rebalance_every=2, dump=str(tmp_path / "dump.pt"))
        rec = sim.simulate(cfg, progress=False)
        assert list(rec["results"]) == ["dump"]
        assert rec["results"]["dump"]["ep16"]["algorithms"]["trivial"]["evaluated_steps"] == 4
    with pytest.raises(ValueError, match="dump has 32 experts, config 16"):
        sim.simulate(dataclasses.replace(cfg, num_experts=16), progress=False)
