"""The grid-tail combine's wait (grouped_gemm_fp8._tail_gathers) as a model under random interleavings.

The kernel's wait only runs on a GPU (the interpreter runs programs one after another), so its protocol is mirrored
here by hand: each program stores its rows, arrives at one counter (arrivals below bit TAIL_GAVE_UP_SHIFT), polls
it at most `max_spin` times, and on running out adds a mark above the arrivals and leaves, unless its add shows that
every program had arrived. The last to arrive gathers every item when its own add returned a mark. Programs beyond
`slots` wait for a slot, as programs that are not resident wait for an SM; only a leaver frees one before the end.
Steps are sequentially consistent here; the kernel gets that order from its acq_rel adds. Checked: every item is
gathered, only after every program's rows are stored, and every program ends; two broken variants are caught.
"""
import random

import pytest

SHIFT = 20
MASK = (1 << SHIFT) - 1


class Grid:
    def __init__(self, programs: int, items: int):
        self.n, self.items = programs, items
        self.counter = 0
        self.rows = [False] * programs
        self.gathered: set[int] = set()


def program(g: Grid, pid: int, max_spin: int, honor_marks=True, recheck=True):
    """One program of the kernel, a step per yield: rows, arrive, wait or leave, gather."""
    g.rows[pid] = True
    yield
    old = g.counter
    g.counter += 1
    arrived = (old & MASK) + 1
    everything = arrived == g.n and (old >> SHIFT) != 0 and honor_marks
    yield
    spins = 0
    while arrived < g.n and spins < max_spin:
        arrived = g.counter & MASK
        spins += 1
        yield
    if arrived < g.n:  # ran out: mark, and do the share only if every program had arrived before the mark
        old = g.counter
        g.counter += 1 << SHIFT
        arrived = (old & MASK) if recheck else 0
        yield
    if arrived >= g.n:
        share = range(g.items) if everything else range(pid, g.items, g.n)
        for item in share:
            assert all(g.rows), "gathered before every program's rows were stored"
            g.gathered.add(item)
            yield


def run(programs: int, slots: int, items: int, max_spin: int, seed: int, **variant) -> Grid:
    rng = random.Random(seed)
    g = Grid(programs, items)
    waiting = list(range(programs))
    rng.shuffle(waiting)  # the order in which programs get a slot
    running = [program(g, waiting.pop(), max_spin, **variant) for _ in range(min(slots, programs))]
    for _ in range(100_000):
        if not running:
            return g
        p = rng.choice(running)
        try:
            next(p)
        except StopIteration:
            running.remove(p)
            if waiting:
                running.append(program(g, waiting.pop(), max_spin, **variant))
    raise AssertionError("a program never ended")


@pytest.mark.parametrize("programs,slots,items", [(1, 1, 5), (4, 4, 9), (6, 3, 13), (8, 2, 8), (5, 5, 40)])
@pytest.mark.parametrize("max_spin", [0, 1, 3, 50])
def test_every_item_gathered_once_all_rows_are_stored(programs, slots, items, max_spin):
    for seed in range(60):
        g = run(programs, slots, items, max_spin, seed)
        assert g.gathered == set(range(items)), (seed, sorted(g.gathered))
        assert g.counter & MASK == programs


def test_gives_up_only_when_it_must():
    """With every program resident and a long enough wait, nobody leaves: the counter carries no mark."""
    for seed in range(30):
        assert run(6, 6, 20, 10_000, seed).counter == 6


@pytest.mark.parametrize("variant", [{"honor_marks": False}, {"recheck": False}])
def test_broken_variants_are_caught(variant):
    """The last arrival ignoring the marks, or a leaver not doing its share when everyone had arrived before its
    mark, loses items under some interleaving."""
    lost = 0
    for seed in range(200):
        g = run(4, 4, 9, 2, seed, **variant)
        lost += g.gathered != set(range(9))
    assert lost > 0
