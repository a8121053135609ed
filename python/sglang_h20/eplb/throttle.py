"""Cooperative throttling of a background thread's Python: pace points in its own loops, no profile hook.

Why: a busy Python thread beside the decode thread costs that thread a GIL hand-off at each of its torch ops (each
releases the GIL), so the placement thread works in short bursts with sleeps between. A profile hook
(`sys.setprofile`) could cut any code into bursts, but a profile function set on ANY thread slows the Python of
EVERY thread in the process (CPython instruments the shared code objects): on a loop of small calls beside a
profiled thread that only sleeps, 1.9x slower on CPython 3.11 and 3.1x on 3.12 (`placement_interference.py
--cpu --actions profiled_sleeper`), i.e. the scheduler's whole decode loop for as long as the placement ran.
So the thread calls `point()` in its loops instead; outside `bursts()` a point costs one thread-local lookup.
"""
from __future__ import annotations

import contextlib
import threading
import time

_local = threading.local()


@contextlib.contextmanager
def bursts(burst_s: float, pause_s: float):
    """Within this block, this thread's `point()` calls sleep `pause_s` once `burst_s` passed since the last sleep.
    Other threads' points are not affected; nesting keeps the outer setting."""
    if getattr(_local, "state", None) is not None:
        yield
        return
    _local.state = [float(burst_s), float(pause_s), time.perf_counter()]
    try:
        yield
    finally:
        _local.state = None


def point() -> None:
    """A place where this thread may pause (see `bursts`); a no-op outside a `bursts` block."""
    st = getattr(_local, "state", None)
    if st is not None and time.perf_counter() - st[2] > st[0]:
        time.sleep(st[1])
        st[2] = time.perf_counter()
