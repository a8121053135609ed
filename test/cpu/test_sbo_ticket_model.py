"""A model of the dynamic tail's ticket protocol (grouped_gemm_fp8: EpilogueCombine.dynamic) under random interleavings.

The interpreter runs programs one after another, so it never interleaves them; this model does. Programs are
generators that yield at every access to shared state (each atomic or load one step), a random scheduler runs them
with at most `resident` alive at once (in bursts: one program may run many steps ahead), and some start late (as beside another stream's kernels). Checked: every
tile taken exactly once, no program passes the wait before every tile is finished, every gather block gathered once,
no deadlock. Reading the counters in the wrong order (registered before arrived), or registering after the first
ticket, must be caught. Steps are sequentially consistent here; the kernel gets that order from its acq_rel tickets
and acquire reads (grouped_gemm_fp8 module doc).
"""
from __future__ import annotations

import random

import pytest


class Shared:
    def __init__(self, tiles: int, blocks: int):
        self.registered = self.arrived = self.ticket = self.gather_ticket = 0
        self.tiles, self.blocks = tiles, blocks
        self.tile_done = [0] * tiles
        self.gathered = [0] * blocks
        self.violations: list[str] = []


def program(s: Shared, pid: int, rng: random.Random, order: tuple, register_first: bool):
    """One program, as the kernel: register, tickets, tiles, arrive, wait, gathers."""
    if register_first:
        s.registered += 1
        yield
    t = s.ticket
    s.ticket += 1
    yield
    if not register_first:
        s.registered += 1
        yield
    while t < s.tiles:
        for _ in range(rng.randint(1, 4)):  # the tile's work
            yield
        s.tile_done[t] += 1
        yield
        t = s.ticket
        s.ticket += 1
        yield
    s.arrived += 1
    yield
    while True:  # the wait: tickets past the tiles, then the two counts in `order`, each read a step apart
        tickets = s.ticket
        yield
        if tickets < s.tiles:
            continue
        first = getattr(s, order[0])
        yield
        second = getattr(s, order[1])
        yield
        if first == second:
            break
    if not all(s.tile_done):
        s.violations.append(f"program {pid} passed the wait with tiles {s.tile_done.count(0)} unfinished")
    while True:
        b = s.gather_ticket
        s.gather_ticket += 1
        yield
        if b >= s.blocks:
            return
        s.gathered[b] += 1
        yield


def run(seed: int, programs: int, resident: int, tiles: int, blocks: int, order=("arrived", "registered"),
        register_first: bool = True, max_steps: int = 200_000) -> Shared:
    rng = random.Random(seed)
    s = Shared(tiles, blocks)
    start = {p: rng.choice([0, 0, rng.randint(0, 60)]) for p in range(programs)}  # a third start late
    waiting = sorted(range(programs), key=lambda p: start[p])
    alive: dict[int, object] = {}
    step = 0
    while waiting or alive:
        while waiting and len(alive) < resident and start[waiting[0]] <= step:
            p = waiting.pop(0)
            alive[p] = program(s, p, rng, order, register_first)
        if not alive:
            step += 1
            continue
        p = rng.choice(list(alive))
        for _ in range(rng.choice([1, 1, rng.randint(2, 12)])):  # bursts: one program runs ahead of the others
            try:
                next(alive[p])
            except StopIteration:
                del alive[p]
                break
            step += 1
        if step > max_steps:
            s.violations.append("deadlock: no progress")
            break
    return s


@pytest.mark.parametrize("programs,resident,tiles,blocks", [(8, 8, 20, 7), (16, 5, 9, 3), (6, 2, 40, 11),
                                                             (12, 12, 3, 1), (4, 1, 5, 5)])
def test_ticket_protocol_is_safe_and_live(programs, resident, tiles, blocks):
    for seed in range(150):
        s = run(seed, programs, resident, tiles, blocks)
        assert not s.violations, (seed, s.violations[:3])
        assert s.tile_done == [1] * tiles, seed  # each tile taken once
        assert s.gathered == [1] * blocks, seed  # each gather block once
        assert s.registered == s.arrived == programs


def test_reading_registered_before_arrived_is_caught():
    """A late program can register and arrive between the two reads: registered first, then arrived, can then
    match while a tile-taker is still working. The model must find it (the kernel reads arrived first)."""
    bad = [seed for seed in range(400)
           if run(seed, 12, 12, 4, 2, order=("registered", "arrived")).violations]
    assert bad, "the wrong read order went unnoticed"


def test_registering_after_the_first_ticket_is_caught():
    """A tile-taker not yet registered is invisible to the wait: the kernel registers before its first ticket."""
    bad = [seed for seed in range(400) if run(seed, 12, 12, 4, 2, register_first=False).violations]
    assert bad, "registering late went unnoticed"
