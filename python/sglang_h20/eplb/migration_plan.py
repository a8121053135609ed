"""Which expert copies a migration makes, from where, in which order: the plan that
`sglang_h20.eplb.migration.MigrationExecutor` runs without stalling decode.

`plan_migration(old, new, expert_bytes, staging_budget_bytes)` gives every
(layer, slot) whose expert changes exactly one transfer, and picks its source hierarchically:

``local``    the destination GPU already holds the expert (another slot, old placement):
             a device-local copy, no link used;
``nvlink``   another GPU of the same node holds it: a copy over NVLink from the least-loaded
             such GPU (send bytes per chunk, ties to the lowest GPU id);
``network``  only other nodes hold it: fetched ONCE per (layer, destination node, expert),
             into the "gateway" GPU of that node with the least network bytes received so far,
             from the least-loaded holder (ties: same local rank as the gateway, i.e. the same
             rail, then the lowest GPU id);
``forward``  every other slot of the node that needs that expert copies it from the gateway's
             staging buffer, over NVLink (or as a plain copy on the gateway GPU itself). Two
             slots of one GPU that need the same expert over NVLink also fetch it once; the
             second one is a forward from the first one's staging buffer.

Changed layers are packed, in layer order, into CHUNKS such that every rank's staging memory
(one expert per incoming transfer) for the chunk is <= `staging_budget_bytes`; a layer never
straddles chunks, since it switches all at once. Inside a chunk the transfers run in STAGES
``local -> nvlink -> network -> forward`` (a forward reads a buffer filled in an earlier
stage). `plan.completion[layer][rank]` is the set of transfers that must have arrived on `rank`
before `layer` is ready there, and `plan.totals` reports copies and bytes per kind and per link
("gpu", "nvlink", "network").

Boundary mode's fixed schedule (`boundary_schedule`) is part of the plan too: which transfers every rank posts at
each step boundary, the same walk on every rank, so that the migration's NCCL kernels launch at the same point
among the model's own (the module docstring of `migration` says why).
"""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Mapping, Sequence

import numpy as np

from sglang_h20.eplb import throttle
from sglang_h20.eplb.placement import Placement

KINDS = ("local", "nvlink", "network", "forward")  # also the stage order inside a chunk
LINKS = ("gpu", "nvlink", "network")
FLUSH_EVERY = 8  # boundary mode: the waiter is told at least every this many batches (its progress, the watchdog)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One expert copy into the staging buffer of (dst_rank, dst_slot).

    The source is the live slot `src_slot` of `src_rank` (old placement), except for ``forward``
    transfers, whose source is the staging buffer filled by transfer `src_tid` (held by
    `src_rank`, for slot `src_slot`). Slots are global physical slot ids.
    """

    tid: int
    layer: int
    expert: int
    kind: str
    link: str
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int
    nbytes: int
    chunk: int
    src_tid: int = -1

    @property
    def from_staging(self) -> bool:
        return self.kind == "forward"

    def describe(self) -> str:
        src = f"staging of transfer {self.src_tid} on rank {self.src_rank}" if self.from_staging \
            else f"rank {self.src_rank} slot {self.src_slot}"
        return (f"transfer {self.tid} ({self.kind}, layer {self.layer}, expert {self.expert}: "
                f"{src} -> rank {self.dst_rank} slot {self.dst_slot})")


@dataclasses.dataclass(frozen=True)
class Stage:
    kind: str
    tids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Chunk:
    index: int
    layers: tuple[int, ...]
    stages: tuple[Stage, ...]          # non-empty stages, in KINDS order
    staging_bytes: tuple[int, ...]     # per rank: staging this chunk needs (incoming transfers)


@dataclasses.dataclass(frozen=True)
class MigrationPlan:
    old: Placement
    new: Placement
    expert_bytes: int
    staging_budget_bytes: int
    transfers: tuple[Transfer, ...]                       # indexed by tid
    chunks: tuple[Chunk, ...]
    completion: Mapping[int, tuple[frozenset, ...]]       # layer -> per rank: incoming tids
    totals: Mapping

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers that change, in execution order."""
        return tuple(l for c in self.chunks for l in c.layers)

    def incoming(self, rank: int, layer: int) -> frozenset:
        return self.completion[layer][rank]

    def summary(self) -> str:
        t = self.totals
        parts = ", ".join(f"{k} {t['copies'][k]} ({t['bytes'][k] / 2**20:.1f} MiB)" for k in KINDS)
        return (f"{t['changed_slots']} slot changes in {len(self.layers)} layers, "
                f"{len(self.chunks)} chunks: {parts}; max staging/rank "
                f"{t['max_staging_bytes'] / 2**20:.1f} MiB <= budget "
                f"{self.staging_budget_bytes / 2**20:.1f} MiB")


def plan_migration(old: Placement, new: Placement, expert_bytes: int,
                   staging_budget_bytes: int) -> MigrationPlan:
    """Plan the weight moves from placement `old` to `new` (see the module docstring)."""
    if old.topology != new.topology or old.phy2log.shape != new.phy2log.shape:
        raise ValueError("placements differ in topology or shape")
    if old.num_experts != new.num_experts:
        raise ValueError("placements differ in num_experts")
    if expert_bytes <= 0:
        raise ValueError("expert_bytes must be positive")
    topo = old.topology
    L, S = old.phy2log.shape
    if S != topo.num_slots:
        raise ValueError(f"{S} slots per layer, topology has {topo.num_slots}")
    G, gpn = topo.num_gpus, topo.gpus_per_node
    slot_gpu = topo.slot_gpu()
    node_of = lambda g: int(g) // gpn
    changed = old.phy2log != new.phy2log

    # chunks: whole layers, greedily, while every rank's staging fits the budget
    need = np.zeros((L, G), dtype=np.int64)
    ll, ss = np.nonzero(changed)
    np.add.at(need, (ll, slot_gpu[ss]), expert_bytes)
    chunk_layers: list[list[int]] = []
    cur: list[int] = []
    cur_need = np.zeros(G, dtype=np.int64)
    for l in (int(x) for x in np.flatnonzero(changed.any(axis=1))):
        if need[l].max() > staging_budget_bytes:
            r = int(np.argmax(need[l]))
            raise ValueError(
                f"staging budget {staging_budget_bytes} B is below the {int(need[l, r])} B that rank "
                f"{r} needs for layer {l} (a layer switches at once, so its staging must fit)")
        if cur and (cur_need + need[l] > staging_budget_bytes).any():
            chunk_layers.append(cur)
            cur, cur_need = [], np.zeros(G, dtype=np.int64)
        cur.append(l)
        cur_need += need[l]
    if cur:
        chunk_layers.append(cur)

    transfers: list[Transfer] = []
    chunks: list[Chunk] = []
    for ci, layers in enumerate(chunk_layers):
        raw: list[dict] = []  # transfers of this chunk before numbering
        send_load = {k: np.zeros(G, dtype=np.int64) for k in ("nvlink", "network")}  # bytes sent per GPU, by link
        net_recv = np.zeros(G, dtype=np.int64)

        def add(kind, layer, e, src_gpu, src_slot, dst_slot, src_ref=None):
            dst_gpu = int(slot_gpu[dst_slot])
            link = "gpu" if src_gpu == dst_gpu else ("nvlink" if node_of(src_gpu) == node_of(dst_gpu)
                                                     else "network")
            raw.append(dict(layer=layer, expert=int(e), kind=kind, link=link, src_rank=int(src_gpu),
                            src_slot=int(src_slot), dst_rank=dst_gpu, dst_slot=int(dst_slot),
                            src_ref=src_ref))
            if kind in send_load and link != "gpu":
                send_load[kind][src_gpu] += expert_bytes
            return len(raw) - 1

        for l in layers:
            old_row, new_row = old.phy2log[l], new.phy2log[l]
            first_slot: dict[tuple[int, int], int] = {}  # (gpu, expert) -> a slot holding it (old)
            for s in range(S):
                throttle.point()
                first_slot.setdefault((int(slot_gpu[s]), int(old_row[s])), s)
            holders: dict[int, list[int]] = defaultdict(list)  # expert -> GPUs holding it (old)
            for g, e in sorted(first_slot):
                holders[e].append(g)
            by_gpu: dict[tuple[int, int], list[int]] = defaultdict(list)   # NVLink candidates
            by_node: dict[tuple[int, int], list[int]] = defaultdict(list)  # network candidates
            for s in (int(x) for x in np.flatnonzero(changed[l])):
                throttle.point()
                e, g = int(new_row[s]), int(slot_gpu[s])
                if (g, e) in first_slot:
                    add("local", l, e, g, first_slot[(g, e)], s)
                elif any(node_of(h) == node_of(g) for h in holders[e]):
                    by_gpu[(g, e)].append(s)
                else:
                    by_node[(node_of(g), e)].append(s)
            for (g, e), slots in sorted(by_gpu.items()):
                throttle.point()
                cands = [h for h in holders[e] if node_of(h) == node_of(g)]
                src = min(cands, key=lambda h: (send_load["nvlink"][h], h))
                head = add("nvlink", l, e, src, first_slot[(src, e)], slots[0])
                for s in slots[1:]:
                    add("forward", l, e, g, slots[0], s, src_ref=head)
            for (n, e), slots in sorted(by_node.items()):
                per_gpu: dict[int, list[int]] = defaultdict(list)
                for s in slots:
                    per_gpu[int(slot_gpu[s])].append(s)
                gw = min(per_gpu, key=lambda g: (net_recv[g], -len(per_gpu[g]), g))
                gw_slot = per_gpu[gw][0]
                src = min(holders[e], key=lambda h: (send_load["network"][h], h % gpn != gw % gpn, h))
                head = add("network", l, e, src, first_slot[(src, e)], gw_slot)
                net_recv[gw] += expert_bytes
                for s in sorted(slots):
                    if s != gw_slot:
                        add("forward", l, e, gw, gw_slot, s, src_ref=head)

        # number the chunk's transfers stage by stage, then by (layer, destination slot)
        order = sorted(range(len(raw)), key=lambda i: (KINDS.index(raw[i]["kind"]), raw[i]["layer"],
                                                      raw[i]["dst_slot"]))
        tid_of = {i: len(transfers) + j for j, i in enumerate(order)}
        stage_tids: dict[str, list[int]] = defaultdict(list)
        for i in order:
            throttle.point()
            d = dict(raw[i])
            ref = d.pop("src_ref")
            t = Transfer(tid=tid_of[i], nbytes=expert_bytes, chunk=ci,
                         src_tid=-1 if ref is None else tid_of[ref], **d)
            transfers.append(t)
            stage_tids[t.kind].append(t.tid)
        stages = tuple(Stage(k, tuple(stage_tids[k])) for k in KINDS if stage_tids[k])
        staging = tuple(int(x) for x in need[layers].sum(axis=0))
        chunks.append(Chunk(ci, tuple(layers), stages, staging))

    completion: dict[int, tuple[frozenset, ...]] = {}
    per: dict[tuple[int, int], set] = defaultdict(set)
    for t in transfers:
        throttle.point()
        per[(t.layer, t.dst_rank)].add(t.tid)
    for c in chunks:
        for l in c.layers:
            completion[l] = tuple(frozenset(per[(l, r)]) for r in range(G))

    copies = Counter(t.kind for t in transfers)
    links = Counter(t.link for t in transfers)
    totals = {
        "copies": {k: copies.get(k, 0) for k in KINDS},
        "bytes": {k: copies.get(k, 0) * expert_bytes for k in KINDS},
        "link_bytes": {k: links.get(k, 0) * expert_bytes for k in LINKS},
        "total_bytes": len(transfers) * expert_bytes,
        "changed_slots": int(changed.sum()),
        "num_chunks": len(chunks),
        "max_staging_bytes": max((max(c.staging_bytes) for c in chunks), default=0),
    }
    return MigrationPlan(old, new, int(expert_bytes), int(staging_budget_bytes), tuple(transfers),
                         tuple(chunks), completion, totals)


def group_free(plan: MigrationPlan) -> bool:
    """With peer copies, no transfer of `plan` uses the process group (one node: local copies and NVLink pulls
    only). Such a plan's transfers can be posted by a background thread: nothing of it is launched on a
    communicator, so no launch order across ranks can deadlock against the model's collectives."""
    return all(t.src_rank == t.dst_rank or t.kind == "nvlink" for t in plan.transfers)


def boundary_schedule(plan: MigrationPlan, per_boundary: int) -> tuple[list[list[list[int]]], list[list[bool]]]:
    """Boundary mode's fixed schedule, the same on every rank: per chunk, the transfer ids posted at each of its
    boundaries (its stages in order, each stage's transfers link by link in turn; a boundary takes transfers in
    that order while every rank sends at most `per_boundary` experts and receives at most as many, links being
    full duplex), and per batch whether the waiter is told after it: when it holds a layer's last transfer of the
    chunk (the chunk's last batch always does: it holds the chunk's last transfer), or is every FLUSH_EVERY-th."""
    batches, flush = [], []
    for chunk in plan.chunks:
        order = [tid for stage in chunk.stages for tid in _by_link_round_robin(plan, stage.tids)]
        last = {plan.transfers[tid].layer: tid for tid in order}
        out, load = [], Counter()
        for tid in order:
            throttle.point()
            t = plan.transfers[tid]
            ends = ((t.src_rank, "send"), (t.dst_rank, "recv"))
            if not out or any(load[e] >= per_boundary for e in ends):
                out.append([])
                load = Counter()
            out[-1].append(tid)
            load.update(ends)
        ends_layer = set(last.values())
        batches.append(out)
        flush.append([k % FLUSH_EVERY == FLUSH_EVERY - 1 or any(t in ends_layer for t in b) for k, b in enumerate(out)])
    return batches, flush


def _by_link_round_robin(plan: MigrationPlan, tids: Sequence[int]) -> list[int]:
    """A stage's transfers, one per (source, destination) link in turn: walked in this order, a boundary that lets
    each rank send one expert and receive one fills both directions of a link (the plan lists them by source)."""
    links: dict[tuple[int, int], list[int]] = {}
    for tid in tids:
        t = plan.transfers[tid]
        links.setdefault((t.src_rank, t.dst_rank), []).append(tid)
    queues = list(links.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
