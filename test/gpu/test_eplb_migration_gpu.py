"""The migration executor's CUDA path on one GPU: local re-placement while the decode loop's stream is busy.

In an EP-2 server a rebalance left 4 of 384 slots with the wrong bytes (the verify switch caught it): the staging of
the next chunk was allocated on the decode loop's stream, so it reused the block the switch had just freed while
that stream's copy out of it was still queued, and the side stream's next copy overwrote it first. Here every
boundary comes with a forward "in flight" (a 2 ms sleep queued on the decode loop's stream before maybe_switch),
which puts the switch copy behind it every time; every slot must still end bit-identical to its new expert. Since
then the chunks share one staging pool made up front, the side stream waiting on an event after the switch copies
before it writes rows again: the same test checks that wait.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_h20.eplb.migration import MigrationExecutor  # noqa: E402
from sglang_h20.eplb.migration_plan import plan_migration  # noqa: E402
from sglang_h20.eplb.placement import Placement, Topology  # noqa: E402

K, L, ROW = 32, 3, 1 << 18  # slots, MoE layers, bytes per expert (as FP8 weights + fp32 scales below)


@pytest.mark.parametrize("launch", [{"bytes_per_boundary": 4 * (ROW + 64)}, {"max_bytes_per_s": None}],
                         ids=["boundary", "thread"])
def test_local_replacement_with_busy_decode_stream_lands_bit_identical(launch):
    g = torch.Generator(device="cuda").manual_seed(7)
    w = {l: [torch.randint(-100, 100, (K, ROW), generator=g, device="cuda", dtype=torch.int8).view(torch.float8_e4m3fn),
             torch.rand(K, 16, generator=g, device="cuda")] for l in range(L)}
    before = {l: [t.clone() for t in ws] for l, ws in w.items()}
    topo = Topology(num_nodes=1, gpus_per_node=1, slots_per_gpu=K)
    rng = np.random.default_rng(3)
    old = Placement(np.tile(np.arange(K), (L, 1)), topo, K)
    new = Placement(np.stack([rng.permutation(K) for _ in range(L)]), topo, K)
    plan = plan_migration(old, new, ROW + 64, K * (ROW + 64))  # one layer per chunk, as in the server
    assert len(plan.chunks) == L
    ex = MigrationExecutor(0, 1, topo, w, plan, store=torch.distributed.HashStore(), switch_every=4,
                           decide_ahead=3, **launch)
    ex.start()
    t0 = time.monotonic()
    while ex.status.state == "running" and time.monotonic() - t0 < 60:
        torch.cuda.synchronize()            # the loop waits for the previous pass's tokens
        torch.cuda._sleep(4_000_000)        # this pass, in flight while the boundary work is queued behind it
        ex.maybe_switch()
    torch.cuda.synchronize()
    ex.close(timeout=5)
    assert ex.status.state == "done", ex.status
    for l in range(L):
        perm = torch.as_tensor(new.phy2log[l], device="cuda")
        for t, b in zip(w[l], before[l]):
            want = b.view(torch.uint8)[perm] if b.element_size() == 1 else b[perm]
            got = t.view(torch.uint8) if t.element_size() == 1 else t
            bad = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
            assert not bad, f"layer {l}: slots {bad} differ from their new expert"
