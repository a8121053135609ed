"""Cooperative throttling of a background thread's Python: pace points in its own loops, no profile hook.

Why: a busy Python thread beside the decode thread costs that thread a GIL hand-off at each of its torch ops (each
releases the GIL), so the placement thread works in short bursts with sleeps between. A profile hook
(`sys.setprofile`) could cut any code into bursts, but a profile function set on ANY thread slows the Python of
EVERY thread in the process on CPython 3.12+ (profiling instruments the shared code objects): a loop of small calls
beside a profiled thread that only sleeps ran 1.98x slower on 3.12 and 2.47x on 3.13, 1.01x on 3.11
(benchmark/results/exploratory/profile_hook_cost_cpu.json). The GPU host runs 3.12: the scheduler's whole decode
loop paid that for as long as the placement ran (its passes ~1-1.5 ms slower at the median in EP-2 servers).
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
