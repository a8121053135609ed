"""A model of the synchronization protocol of csrc/mla_fp8_decode_sm90_v2.cu, run under random interleavings.

No GPU here, and a synchronization bug in the kernel hangs or silently corrupts. So the protocol is written down
once more as three agents (the loader warpgroup, math WG0, math WG1; one agent per warpgroup, whose 128 arrivals
happen together) with the kernel's mbarrier counts, parities and wait/arrive order, the K-tile copies landing at
random later times, and every buffer tagged with the tile it holds. Checked over many schedules and tile counts:
no deadlock, every read sees the tile it expects and is never overwritten while in flight (K stages, V^T halves,
P'), the parity waits never alias (a barrier 2 phases ahead or still 1 behind), and each WG merges every tile
once. test_mutations_are_caught: removing any one wait or miscounting an arrival is detected.
Keep it in step with the kernel (the round structure in its math loop, the loader loop).
"""
from __future__ import annotations

import random

import pytest

class Bar:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0  # phase = number of completed phases

    def arrive(self, n):
        self.pending -= n
        assert self.pending >= 0, "more arrivals than the count"
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count


def simulate(ntiles, seed, mutation=None):
    rng = random.Random(seed)
    m = mutation or ""
    NST = 3
    full_k = [Bar(128) for _ in range(NST)]
    empty_k = [Bar(128 if m == "empty_k_count" else 256) for _ in range(NST)]
    full_p = [Bar(128) for _ in range(2)]
    empty_p = [Bar(256) for _ in range(2)]
    kstage, pbuf = [None] * NST, [None] * 2
    vt = {(w, b): None for w in range(2) for b in range(2)}
    readers: dict = {}
    inflight = []

    def ready(bar, parity, phase):
        # mbarrier.try_wait.parity(P) succeeds iff the current (incomplete) phase's parity != P
        ok = bar.phase % 2 != parity
        if ok:
            assert bar.phase == phase + 1, f"parity alias: {bar.phase} phases completed, waited for phase {phase}"
        return ok

    def loader():
        for t in range(ntiles):
            st = t % NST
            if t >= NST and m != "no_empty_k_wait":
                while not ready(empty_k[st], (t // NST - 1) & 1, t // NST - 1):
                    yield
            assert not readers.get(("k", st)), "K stage refilled while read"
            kstage[st] = ("landing", t)
            inflight.append((st, t))  # cp.async ... + cp.async.mbarrier.arrive.noinc full_k[st]
            yield

    def math(w):
        merged = []
        if w == 1 and ntiles > 0 and m != "no_skew":
            while not ready(full_p[0], 0, 0):
                yield
        for j in range(ntiles // 2 + 1):
            t_own, t_oth = 2 * j + w, (2 * j - 1 if w == 0 else 2 * j)
            has_own, has_oth = t_own < ntiles, 0 <= t_oth < ntiles
            if has_oth and m == "early_oth_release":
                empty_k[t_oth % NST].arrive(128)
            for t in ([t_oth] if has_oth else []) + ([t_own] if has_own else []):  # V^T of both tiles
                st = t % NST
                while m != "no_full_k_wait" and not ready(full_k[st], (t // NST) & 1, t // NST):
                    yield
                assert kstage[st] == t, f"WG{w} transposes tile {t}, the stage holds {kstage[st]}"
                assert not readers.get(("v", w, t & 1)), "V^T rewritten while read"
                yield
                assert kstage[st] == t, "K stage overwritten during the transpose"
                vt[(w, t & 1)] = t
            if has_oth and m != "early_oth_release":
                empty_k[t_oth % NST].arrive(128)
                yield
            if has_own:
                st = t_own % NST
                readers.setdefault(("k", st), set()).add(w)
                yield  # QK^T wgmmas in flight
                assert kstage[st] == t_own, "K stage overwritten during QK^T"
                readers[("k", st)].discard(w)
                empty_k[st].arrive(128)
                yield
                pb = t_own & 1
                if t_own >= 2 and m != "no_empty_p_wait":
                    while not ready(empty_p[pb], ((t_own - 2) >> 1) & 1, (t_own - 2) >> 1):
                        yield
                assert not readers.get(("p", pb)), "P' rewritten while read"
                pbuf[pb] = t_own
                full_p[pb].arrive(128)
                yield
            for t in ([t_own] if has_own else []) + ([t_oth] if has_oth else []):  # P'V merges
                pb = t & 1
                if m != "no_full_p_wait":
                    while not ready(full_p[pb], (t >> 1) & 1, t >> 1):
                        yield
                readers.setdefault(("p", pb), set()).add(w)
                readers.setdefault(("v", w, t & 1), set()).add(w)
                assert pbuf[pb] == t and vt[(w, t & 1)] == t, f"WG{w} P'V of tile {t}: stale P' or V^T"
                yield  # PV wgmmas in flight
                assert pbuf[pb] == t and vt[(w, t & 1)] == t, "P' or V^T overwritten during P'V"
                readers[("p", pb)].discard(w)
                readers[("v", w, t & 1)].discard(w)
                merged.append(t)
                empty_p[pb].arrive(128)
                yield
        assert sorted(merged) == list(range(ntiles)), f"WG{w} merged {merged}"

    def land():  # a thread's copies complete in order; the .noinc arrive follows them
        st, t = inflight.pop(0)
        kstage[st] = t
        full_k[st].arrive(128)

    schedule(rng, [loader(), math(0), math(1)], lambda: bool(inflight), land,
             f"ntiles {ntiles}, seed {seed}, mutation {mutation}")


def schedule(rng, agents, landing, land, what, land_weight=1):
    """Run the agents (generators; each next() is one step) and the copies' landings (land() while landing()) in a
    random order until all are done; a schedule that cannot finish is a deadlock."""
    alive = [True] * len(agents)
    for _ in range(200000):
        if not (any(alive) or landing()):
            return
        c = rng.choice([i for i in range(len(agents)) if alive[i]] + (["land"] * land_weight if landing() else []))
        if c == "land":
            land()
            continue
        try:
            next(agents[c])
        except StopIteration:
            alive[c] = False
    raise AssertionError(f"deadlock ({what})")


@pytest.mark.parametrize("ntiles", list(range(0, 10)) + [17, 64])
def test_protocol(ntiles):
    for seed in range(150):
        simulate(ntiles, seed)


@pytest.mark.parametrize("mutation", ["empty_k_count", "no_empty_k_wait", "no_full_k_wait", "no_empty_p_wait",
                                      "no_full_p_wait", "early_oth_release"])
def test_mutations_are_caught(mutation):
    with pytest.raises(AssertionError):
        for ntiles in (5, 8, 17):
            for seed in range(100):
                simulate(ntiles, seed, mutation)


def test_skew_is_only_performance():
    """WG1's initial wait on P'(0) only staggers the WGs: the protocol is correct without it."""
    for seed in range(100):
        simulate(9, seed, "no_skew")
