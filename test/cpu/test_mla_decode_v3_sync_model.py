"""A model of the K-stage protocol of csrc/mla_fp8_decode_sm90_v3.cu under random interleavings (no GPU here).

Three agents: the loader (one thread issuing every tile in order into stage_of(t) once that stage's previous use is
released) and math WG0 / WG1, each owning the tiles t % 2 == wg and waiting only for those (full_k parity
use_of(t) & 1), reading the stage during QK^T and P'V, then releasing it (empty_k, count 128: the owner alone).
Tiles land at random later times. Checked: no deadlock, every read sees its own tile, a stage is never refilled
while read, a parity wait never passes on another phase.

test_the_first_builds_shared_ring_is_caught: the first build (session 29) kept one ring of 5 stages for both WGs;
a WG that ran ahead waited for a parity two uses ahead while the other WG's tile in between had not landed, and
read a stale stage (on the H100 it hung at 256 tiles per CTA). The model finds that schedule.
"""
from __future__ import annotations

import random

import pytest

from test_mla_decode_v2_sync_model import Bar, schedule

NSW = 2  # the kernel's stages per math WG


def stage_of(t):  # mirrors the kernel's stage_of / use_of
    return (t & 1) + 2 * ((t >> 1) % NSW)


def use_of(t):
    return (t >> 1) // NSW


def shared_ring(t, nst=5):  # the first build: one ring for both WGs
    return t % nst, t // nst


def simulate(ntiles, seed, mutation=None):
    rng = random.Random(seed)
    m = mutation or ""
    place = shared_ring if m == "shared_ring" else (lambda t: (stage_of(t), use_of(t)))
    nst = 5 if m == "shared_ring" else 2 * NSW
    full_k = [Bar(1) for _ in range(nst)]
    empty_k = [Bar(128) for _ in range(nst)]
    kstage, readers, inflight = [None] * nst, [set() for _ in range(nst)], []

    def ready(bar, use):
        ok = bar.phase % 2 != (use & 1)  # mbarrier.try_wait.parity(P): the current phase's parity != P
        if ok:
            assert bar.phase == use + 1, f"parity alias: {bar.phase} phases completed, waited for use {use}"
        return ok

    def loader():
        for t in range(ntiles):
            st, use = place(t)
            if use > 0 and m != "no_empty_k_wait":
                while not ready(empty_k[st], use - 1):
                    yield
            assert not readers[st], "K stage refilled while read"
            kstage[st] = ("landing", t)
            inflight.append((st, t))  # TMA boxes + the scales' bulk copy, counted on full_k's transaction bytes
            yield

    def math(w):
        for t in range(w, ntiles, 2):
            st, use = place(t)
            while not ready(full_k[st], use):
                yield
            assert kstage[st] == t, f"WG{w} reads tile {t}, the stage holds {kstage[st]}"
            readers[st].add(w)
            for _ in range(rng.randint(1, 3)):  # QK^T, softmax, P'V: the stage is read throughout
                yield
                assert kstage[st] == t, "K stage overwritten while read"
            readers[st].discard(w)
            empty_k[st].arrive(128)
            yield

    def land():  # copies complete in any order across stages
        st, t = inflight.pop(rng.randrange(len(inflight)))
        kstage[st] = t
        full_k[st].arrive(1)

    schedule(rng, [loader(), math(0), math(1)], lambda: bool(inflight), land,
             f"ntiles {ntiles}, seed {seed}, mutation {mutation}", land_weight=2)


@pytest.mark.parametrize("ntiles", list(range(0, 10)) + [17, 64, 256])
def test_protocol(ntiles):
    for seed in range(100 if ntiles < 256 else 20):
        simulate(ntiles, seed)


def test_the_first_builds_shared_ring_is_caught():
    with pytest.raises(AssertionError):
        for ntiles in (16, 64):
            for seed in range(200):
                simulate(ntiles, seed, "shared_ring")


def test_a_missing_release_wait_is_caught():
    with pytest.raises(AssertionError):
        for ntiles in (9, 17):
            for seed in range(100):
                simulate(ntiles, seed, "no_empty_k_wait")


# ---- design option MLA_V3_CLUSTER: the row blocks of a (sequence, split) as one cluster sharing each K tile ----
def simulate_cluster(ntiles, seed, csize, mutation=None):
    """csize CTAs, each with the loader and two math WGs above; CTA r's loader issues share r of every tile (its
    TMA boxes kb % csize == r, the scales with the last share) multicast into every CTA's stage, after a wait on its
    OWN empty_k, which counts the owner warps of every CTA (4 x csize; here one arrival per CTA and owner WG); each
    CTA's full_k completes on its loader's expect-tx arrival and every share landing in it, in any order. Checked as
    above, plus: a share never lands in a stage another CTA is still reading, and never counts toward another
    phase of the destination's full_k than the one its tile belongs to. Mutation "own_release": consumers release only
    their own CTA's stage (empty_k counting one CTA), which lets a loader overwrite a stage another CTA still reads."""
    rng = random.Random(seed)
    own = mutation == "own_release"
    cl = range(csize)
    full_k = [[Bar(1 + csize) for _ in range(2 * NSW)] for _ in cl]  # the expect-tx arrival + one per share's bytes
    empty_k = [[Bar(1 if own else csize) for _ in range(2 * NSW)] for _ in cl]
    kstage = [[None] * (2 * NSW) for _ in cl]  # (tile, shares landed)
    readers = [[set() for _ in range(2 * NSW)] for _ in cl]
    inflight = []

    def ready(bar, use):
        ok = bar.phase % 2 != (use & 1)
        if ok:
            assert bar.phase == use + 1, f"parity alias: {bar.phase} phases completed, waited for use {use}"
        return ok

    def loader(r):
        for t in range(ntiles):
            st, use = stage_of(t), use_of(t)
            if use > 0:
                while not ready(empty_k[r][st], use - 1):
                    yield
            assert full_k[r][st].phase == use, "expect-tx arrival in another phase than its tile's"
            full_k[r][st].arrive(1)
            inflight.extend((c, st, t, use, r) for c in cl)  # share r of tile t, landing in every CTA
            yield

    def math(c, w):
        for t in range(w, ntiles, 2):
            st, use = stage_of(t), use_of(t)
            while not ready(full_k[c][st], use):
                yield
            assert kstage[c][st] == (t, frozenset(cl)), f"CTA {c} WG{w} reads tile {t}, the stage holds {kstage[c][st]}"
            readers[c][st].add(w)
            for _ in range(rng.randint(1, 3)):
                yield
                assert kstage[c][st] == (t, frozenset(cl)), "K stage overwritten while read"
            readers[c][st].discard(w)
            for d in ([c] if own else cl):  # lane d of each owner warp arrives on CTA d's empty_k
                empty_k[d][st].arrive(1)
                yield

    def land():
        c, st, t, use, r = inflight.pop(rng.randrange(len(inflight)))
        assert not readers[c][st], f"a share of tile {t} lands in CTA {c}'s stage {st} while it is read"
        assert full_k[c][st].phase == use, f"a share of tile {t} counts toward phase {full_k[c][st].phase} in CTA {c}"
        held = kstage[c][st]
        shares = held[1] if held is not None and held[0] == t else frozenset()
        kstage[c][st] = (t, shares | {r})
        full_k[c][st].arrive(1)

    agents = [g for r in cl for g in (loader(r), math(r, 0), math(r, 1))]
    schedule(rng, agents, lambda: bool(inflight), land, f"cluster {csize}, ntiles {ntiles}, seed {seed}, {mutation}",
             land_weight=2)


@pytest.mark.parametrize("csize", [1, 2, 4])
@pytest.mark.parametrize("ntiles", [0, 1, 2, 3, 5, 8, 9, 17, 64])
def test_cluster_protocol(csize, ntiles):
    for seed in range(60 if ntiles < 64 else 15):
        simulate_cluster(ntiles, seed, csize)


def test_a_cluster_releasing_only_its_own_stage_is_caught():
    with pytest.raises(AssertionError):
        for ntiles in (9, 17):
            for seed in range(100):
                simulate_cluster(ntiles, seed, 4, "own_release")
