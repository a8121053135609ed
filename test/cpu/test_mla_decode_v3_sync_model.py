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
