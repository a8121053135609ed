"""The migration planner (sglang_h20.eplb.migration_plan): hand-built placements with hand-checked sources (local
preference, NVLink spreading, one network fetch per node and expert + forwards), budget per chunk, totals, and boundary
mode's fixed schedule. The executor's tests (test_eplb_migration.py) build on the helpers here."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from sglang_h20.eplb.migration_plan import FLUSH_EVERY, KINDS, boundary_schedule, plan_migration
from sglang_h20.eplb.placement import Placement, Topology

T222 = Topology(num_nodes=2, gpus_per_node=2, slots_per_gpu=3)  # GPU g: slots 3g..3g+2; node g//2
EB = 1000  # expert bytes for planner tests


def P(rows, topo=T222, experts=8) -> Placement:
    p = Placement(np.array(rows, dtype=np.int64), topo, experts)
    p.validate()
    return p


def by_kind(plan):
    out = defaultdict(list)
    for t in plan.transfers:
        out[t.kind].append(t)
    return out


def test_local_copy_preferred_over_links():
    # GPU0 holds 0,1,0; new GPU0 = 1,0,1: every change can be served from GPU0 itself, although
    # GPU1 (same node) and node 1 hold copies too.
    old = P([[0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    new = P([[1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    plan = plan_migration(old, new, EB, 10 * EB)
    assert [(t.kind, t.link, t.src_rank, t.src_slot, t.dst_slot) for t in plan.transfers] == [
        ("local", "gpu", 0, 1, 0), ("local", "gpu", 0, 0, 1), ("local", "gpu", 0, 1, 2)]
    assert plan.totals["link_bytes"] == {"gpu": 3 * EB, "nvlink": 0, "network": 0}
    assert plan.totals["copies"] == {"local": 3, "nvlink": 0, "network": 0, "forward": 0}
    assert plan.totals["bytes"] == {"local": 3 * EB, "nvlink": 0, "network": 0, "forward": 0}


def test_nvlink_sources_spread_over_holders():
    # one node, 4 GPUs x 2 slots; experts 0,1 on GPU0 and GPU1, experts 2,3 on GPU2 and GPU3.
    topo = Topology(1, 4, 2)
    old = P([[0, 1, 0, 1, 2, 3, 2, 3]], topo, 4)
    new = P([[0, 1, 2, 3, 0, 1, 2, 3]], topo, 4)  # GPU1 needs 2,3; GPU2 needs 0,1
    plan = plan_migration(old, new, EB, 10 * EB)
    ts = plan.transfers
    assert {t.kind for t in ts} == {"nvlink"}
    to1 = [t.src_rank for t in ts if t.dst_rank == 1]
    to2 = [t.src_rank for t in ts if t.dst_rank == 2]
    assert sorted(to1) == [2, 3] and sorted(to2) == [0, 1]  # two holders each: one copy from each
    for t in ts:  # the source slot really holds the expert in the old placement
        assert old.phy2log[0, t.src_slot] == t.expert == new.phy2log[0, t.dst_slot]


def test_network_fetched_once_per_node_then_forwarded():
    old = P([[0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6]])
    # node 0 (GPUs 0,1) newly needs 4 in slots 2 and 5; node 1 (GPUs 2,3) needs 0 in slots 8, 11.
    new = P([[0, 1, 4, 2, 3, 4, 4, 5, 0, 6, 7, 0]])
    plan = plan_migration(old, new, EB, 10 * EB)
    k = by_kind(plan)
    assert len(k["network"]) == 2 and len(k["forward"]) == 2 and not k["local"] and not k["nvlink"]
    net = {t.expert: t for t in k["network"]}
    assert net[4].src_rank == 2 and net[4].dst_rank in (0, 1)   # only GPU2 held expert 4
    assert net[0].src_rank == 0 and net[0].dst_rank in (2, 3)
    for f in k["forward"]:
        head = plan.transfers[f.src_tid]
        assert head.kind == "network" and head.expert == f.expert and head.layer == f.layer
        assert (f.src_rank, f.src_slot) == (head.dst_rank, head.dst_slot)
        assert f.link == "nvlink" and f.dst_rank // 2 == head.dst_rank // 2
    assert {f.dst_slot for f in k["forward"]} | {t.dst_slot for t in k["network"]} == {2, 5, 8, 11}
    stages = [s.kind for s in plan.chunks[0].stages]
    assert stages == ["network", "forward"]
    assert plan.totals["link_bytes"] == {"gpu": 0, "nvlink": 2 * EB, "network": 2 * EB}


@pytest.mark.parametrize("needing_gpu,rail_src", [(1, 3), (0, 2)])
def test_network_source_ties_go_to_the_gateways_rail(needing_gpu, rail_src):
    """Two holders on the other node, equally loaded: the one with the gateway's local rank sends (same rail),
    not the lowest GPU id."""
    old = P([[0, 1, 0, 2, 3, 2, 4, 5, 6, 4, 7, 6]])  # expert 4 on GPU2 (slot 6) and GPU3 (slot 9)
    row = [0, 1, 0, 2, 3, 2, 4, 5, 6, 4, 7, 6]
    row[2 if needing_gpu == 0 else 5] = 4  # one slot of node 0 newly needs 4 (its old expert is held elsewhere)
    plan = plan_migration(old, P([row]), EB, 10 * EB)
    (net,) = plan.transfers
    assert (net.kind, net.dst_rank, net.src_rank) == ("network", needing_gpu, rail_src)


def test_same_gpu_duplicate_fetched_once():
    old = P([[0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6]])
    new = P([[0, 4, 4, 2, 3, 2, 1, 5, 4, 6, 7, 6]])  # GPU0 needs 4 twice; node 1 needs 1 (GPU2)
    plan = plan_migration(old, new, EB, 10 * EB)
    k = by_kind(plan)
    (n4,) = [t for t in k["network"] if t.expert == 4]
    (f4,) = [t for t in k["forward"] if t.expert == 4]
    assert n4.dst_rank == 0 and (f4.src_rank, f4.dst_rank, f4.link) == (0, 0, "gpu")
    assert {n4.dst_slot, f4.dst_slot} == {1, 2}


def random_placements(L, seed, topo=T222, experts=8):
    rng = np.random.default_rng(seed)
    rows = lambda: [rng.permutation(np.concatenate([np.arange(experts),
                                                    rng.integers(0, experts, topo.num_slots - experts)]))
                    for _ in range(L)]
    return P(rows(), topo, experts), P(rows(), topo, experts)


def test_one_node_plan_with_peer_copies_is_posted_by_the_transfer_thread():
    """group_free: with peer copies a one-node plan uses no process group (local copies, NVLink pulls); a two-node
    plan's network transfers and forwards keep it, so its posting stays with the decode loop (`mover`)."""
    from sglang_h20.eplb.async_rebalance import mover
    from sglang_h20.eplb.migration_plan import group_free

    one = Topology(1, 4, 4)
    old, new = random_placements(3, 0, one, 12)
    plan = plan_migration(old, new, EB, 10**9)
    assert {t.kind for t in plan.transfers} >= {"local", "nvlink"} and group_free(plan)
    assert mover("boundary", True, plan) == "thread" and mover("boundary", False, plan) == "boundary"
    old, new = random_placements(3, 0, Topology(2, 2, 4), 12)
    plan = plan_migration(old, new, EB, 10**9)
    assert "network" in {t.kind for t in plan.transfers} and not group_free(plan)
    assert mover("boundary", True, plan) == "boundary" and mover("thread", True, plan) == "thread"


@pytest.mark.parametrize("seed", range(5))
def test_plan_invariants_budget_dedup_totals(seed):
    topo = Topology(2, 4, 4)  # 32 slots, 20 experts
    old, new = random_placements(6, seed, topo, 20)
    budget = 5 * EB
    plan = plan_migration(old, new, EB, budget)
    changed = old.phy2log != new.phy2log
    # one transfer per changed (layer, slot), landing the right expert
    assert sorted((t.layer, t.dst_slot) for t in plan.transfers) == sorted(map(tuple, np.argwhere(changed)))
    slot_gpu, slot_node = topo.slot_gpu(), topo.slot_node()
    for t in plan.transfers:
        assert t.expert == new.phy2log[t.layer, t.dst_slot] and t.dst_rank == slot_gpu[t.dst_slot]
        if not t.from_staging:
            assert old.phy2log[t.layer, t.src_slot] == t.expert and slot_gpu[t.src_slot] == t.src_rank
        held_gpu = t.expert in old.phy2log[t.layer][slot_gpu == t.dst_rank]
        held_node = t.expert in old.phy2log[t.layer][slot_node == slot_node[t.dst_slot]]
        expect = "local" if held_gpu else "nvlink" if held_node else None
        if expect:
            assert t.kind == expect or (t.kind == "forward" and expect == "nvlink")
        else:
            assert t.kind in ("network", "forward")
    # dedup: at most one network fetch per (layer, destination node, expert)
    net = Counter((t.layer, t.dst_rank // 4, t.expert) for t in plan.transfers if t.kind == "network")
    assert net and max(net.values()) == 1
    needing = {(l, slot_node[s], new.phy2log[l, s]) for l, s in np.argwhere(changed)
               if new.phy2log[l, s] not in old.phy2log[l][slot_node == slot_node[s]]}
    assert set(net) == needing
    # forwards read a buffer filled in an earlier stage of the same chunk
    stage_of = {tid: (c.index, i) for c in plan.chunks for i, s in enumerate(c.stages) for tid in s.tids}
    for t in plan.transfers:
        if t.from_staging:
            h = plan.transfers[t.src_tid]
            assert h.kind in ("network", "nvlink") and (h.dst_rank, h.dst_slot) == (t.src_rank, t.src_slot)
            assert stage_of[h.tid][0] == stage_of[t.tid][0] and stage_of[h.tid][1] < stage_of[t.tid][1]
        else:  # a copy from a slot names no staging buffer (the executor reads src_tid only for forwards)
            assert t.src_tid == -1
    # chunks: whole layers, stage order, staging per rank within the budget
    assert sorted(plan.layers) == sorted(set(np.flatnonzero(changed.any(axis=1))))
    assert len(plan.chunks) >= 2
    for c in plan.chunks:
        assert [s.kind for s in c.stages] == [k for k in KINDS if k in {s.kind for s in c.stages}]
        per_rank = Counter(plan.transfers[tid].dst_rank for s in c.stages for tid in s.tids)
        assert all(per_rank[r] * EB == c.staging_bytes[r] <= budget for r in range(topo.num_gpus))
        assert {plan.transfers[tid].layer for s in c.stages for tid in s.tids} <= set(c.layers)
    for l in plan.layers:  # completion sets partition the layer's transfers by destination
        sets = plan.completion[l]
        assert set().union(*sets) == {t.tid for t in plan.transfers if t.layer == l}
        assert all(plan.transfers[i].dst_rank == r for r, s in enumerate(sets) for i in s)
    # totals add up
    tot = plan.totals
    assert sum(tot["copies"].values()) == tot["changed_slots"] == changed.sum() == len(plan.transfers)
    assert sum(tot["bytes"].values()) == sum(tot["link_bytes"].values()) == tot["total_bytes"] \
        == len(plan.transfers) * EB
    assert tot["copies"]["network"] == len(needing)
    assert tot["max_staging_bytes"] <= budget and tot["num_chunks"] == len(plan.chunks)
    try:  # same local / off-GPU split as the simulator's pricing (which does not dedup)
        from sglang_h20.eplb.simulate import migration_bytes
    except ImportError:
        return
    sim = migration_bytes(old, new, EB)
    assert sim["copies_local"] == tot["copies"]["local"]
    assert sim["copies_nvlink"] + sim["copies_network"] == sum(tot["copies"][k] for k in KINDS[1:])


def test_budget_too_small_and_single_chunk():
    old, new = random_placements(3, 0)
    with pytest.raises(ValueError, match="staging budget"):
        plan_migration(old, new, EB, EB)  # a GPU needs >1 expert for some layer
    plan = plan_migration(old, new, EB, 10**9)
    assert len(plan.chunks) == 1 and plan.chunks[0].layers == (0, 1, 2)
    same = plan_migration(old, old, EB, EB)
    assert same.transfers == () and same.chunks == () and same.totals["total_bytes"] == 0


def test_mismatched_placements_are_refused():
    old = P([[0, 1, 0, 2, 3, 2, 4, 5, 6, 4, 7, 6]])
    same_slots = Topology(num_nodes=1, gpus_per_node=4, slots_per_gpu=3)  # 12 slots too, other topology
    with pytest.raises(ValueError, match="topology or shape"):
        plan_migration(old, P(old.phy2log, same_slots), EB, 10 * EB)
    with pytest.raises(ValueError, match="topology or shape"):
        plan_migration(old, P(np.tile(old.phy2log, (2, 1))), EB, 10 * EB)  # two layers against one
    with pytest.raises(ValueError, match="num_experts"):
        plan_migration(old, P([[0, 1, 0, 2, 3, 2, 4, 5, 6, 8, 7, 6]], experts=9), EB, 10 * EB)
    with pytest.raises(ValueError, match="expert_bytes"):
        plan_migration(old, old, 0, 10 * EB)
    assert plan_migration(old, old, 1, 10).transfers == ()  # the smallest expert is still one


def test_chunk_filled_exactly_to_the_budget_stays_one_chunk():
    """Two layers of two local copies each on one GPU: a budget of exactly four experts holds both."""
    one = Topology(num_nodes=1, gpus_per_node=1, slots_per_gpu=4)
    old = P([[0, 1, 2, 3], [0, 1, 2, 3]], one, 4)
    new = P([[1, 0, 2, 3], [0, 1, 3, 2]], one, 4)
    assert [c.layers for c in plan_migration(old, new, EB, 4 * EB).chunks] == [(0, 1)]
    assert [c.layers for c in plan_migration(old, new, EB, 4 * EB - 1).chunks] == [(0,), (1,)]


@pytest.mark.parametrize("seed", range(3))
def test_boundary_schedule_posts_every_transfer_once_within_the_per_rank_limit(seed):
    """Two nodes (every kind of transfer, links of unequal counts): each transfer is posted once, stages in order,
    and a boundary has every rank send at most `per_boundary` experts and receive at most as many."""
    old, new = random_placements(4, seed, Topology(2, 4, 4), 20)
    plan = plan_migration(old, new, EB, 10**9)
    assert {t.kind for t in plan.transfers} == set(KINDS)
    for per_boundary in (1, 2):
        batches, flush = boundary_schedule(plan, per_boundary)
        for chunk, posted, told in zip(plan.chunks, batches, flush):
            flat = [tid for b in posted for tid in b]
            assert sorted(flat) == sorted(tid for s in chunk.stages for tid in s.tids)
            kinds = [KINDS.index(plan.transfers[tid].kind) for tid in flat]
            assert kinds == sorted(kinds)  # stage by stage
            for b in posted:
                sends = Counter(plan.transfers[tid].src_rank for tid in b)
                recvs = Counter(plan.transfers[tid].dst_rank for tid in b)
                assert max(sends.values()) <= per_boundary and max(recvs.values()) <= per_boundary
            assert len(told) == len(posted) and told[-1]


def test_boundary_schedule_tells_the_waiter_at_layer_ends_and_every_flush_every_batches():
    """Local copies only (one GPU): one per boundary; the waiter is told after each layer's last copy, at the
    chunk's end and every FLUSH_EVERY-th batch, the same batches on every rank."""
    topo = Topology(num_nodes=1, gpus_per_node=1, slots_per_gpu=20)
    rng = np.random.default_rng(3)
    old = Placement(np.tile(np.arange(20), (2, 1)), topo, 20)
    new = Placement(np.stack([rng.permutation(20), rng.permutation(20)]), topo, 20)
    plan = plan_migration(old, new, 8, 20 * 8)  # one layer per chunk
    batches, flush = boundary_schedule(plan, 1)
    assert len(batches) == 2 and all(len(b) == 1 for c in batches for b in c)
    for c, chunk in enumerate(batches):
        n = len(chunk)
        assert n == sum(plan.transfers[t].layer == plan.chunks[c].layers[0] for t in range(len(plan.transfers)))
        assert [k for k in range(n) if flush[c][k]] == sorted({*range(FLUSH_EVERY - 1, n, FLUSH_EVERY), n - 1})
    batches3, _ = boundary_schedule(plan, 3)
    assert [len(b) for b in batches3[0]][:-1] == [3] * (len(batches3[0]) - 1)


def test_summary_line_in_mib_and_an_unchanged_placement_stages_nothing():
    """The log line a rebalance prints: copies and bytes per kind, the staging peak against the budget, in MiB; a
    plan between equal placements has no chunk, so its staging peak is 0, not a default of one byte."""
    old = P([[0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    new = P([[1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    mib = 2**20
    plan = plan_migration(old, new, 3 * mib, 12 * mib)
    assert plan.totals["max_staging_bytes"] == 3 * 3 * mib  # one chunk: all three local copies staged at once
    assert plan.summary() == ("3 slot changes in 1 layers, 1 chunks: local 3 (9.0 MiB), nvlink 0 (0.0 MiB), "
                              "network 0 (0.0 MiB), forward 0 (0.0 MiB); max staging/rank 9.0 MiB <= budget 12.0 MiB")
    same = plan_migration(old, old, 3 * mib, 12 * mib)
    assert same.chunks == () and same.totals["max_staging_bytes"] == 0 and same.totals["total_bytes"] == 0
    assert same.summary().startswith("0 slot changes in 0 layers, 0 chunks: local 0 (0.0 MiB)")
    assert same.summary().endswith("max staging/rank 0.0 MiB <= budget 12.0 MiB")
