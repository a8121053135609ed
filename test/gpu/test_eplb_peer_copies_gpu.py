"""Peer copies on two GPUs: NVLink transfers pulled over CUDA IPC by their destination (`share_weights`).

Two processes, one GPU each (skipped with fewer): each maps the other's expert tensors (IPC handles opened on its own
device), and a full random re-placement runs while the decode stream is kept busy, its pulls posted by the decode
loop (boundary mode) or by the transfer thread (the plugin's choice for a one-node plan: `async_rebalance.mover`).
Every slot must end bit-identical to its new expert, every NVLink transfer into a rank must have been a pull (no NCCL
op is posted: the migration group is gloo, which would reject a CUDA send). Printed, not asserted: whether mapping the peer's memory
(lazy peer access) made a CUDA context on the peer's GPU, which holds memory there for every peer process.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

K, L, ROW = 16, 3, 1 << 18  # slots per GPU, MoE layers, bytes per expert's FP8 weight


def _weights(rank: int, dev) -> dict[int, list[torch.Tensor]]:
    """Expert e of layer l has the same bytes on every rank (seeded by (l, e)); the old placement puts expert
    rank * K + j in slot j."""
    out = {}
    for l in range(L):
        rows, scales = [], []
        for j in range(K):
            g = torch.Generator().manual_seed(1000 * l + rank * K + j)
            rows.append(torch.randint(-100, 100, (ROW,), generator=g, dtype=torch.int8))
            scales.append(torch.rand(16, generator=g))
        out[l] = [torch.stack(rows).to(dev).view(torch.float8_e4m3fn), torch.stack(scales).to(dev)]
    return out


def _expected(l: int, e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * l + e)
    return [torch.randint(-100, 100, (ROW,), generator=g, dtype=torch.int8), torch.rand(16, generator=g)]


def _worker(rank: int, port: int, outdir: str, launch: str) -> None:
    import torch.distributed as dist

    from sglang_h20.eplb.migration import MigrationExecutor, pacing
    from sglang_h20.eplb.migration_plan import group_free, plan_migration
    from sglang_h20.eplb.peer_copies import share_weights
    from sglang_h20.eplb.placement import Placement, Topology

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    topo = Topology(num_nodes=1, gpus_per_node=2, slots_per_gpu=K)
    rng = np.random.default_rng(5)
    old = Placement(np.tile(np.arange(2 * K), (L, 1)), topo, 2 * K)
    new = Placement(np.stack([rng.permutation(2 * K) for _ in range(L)]), topo, 2 * K)
    w = _weights(rank, dev)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in w[0])
    plan = plan_migration(old, new, expert_bytes, K * expert_bytes)
    store = dist.PrefixStore("peers", dist.distributed_c10d._get_default_store())
    peers = share_weights(store, rank, topo, w)
    if peers is None:  # the parent reports it; without peer copies the CUDA transfers would go to gloo
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump({"peers": False}, f)
        os._exit(0)
    assert group_free(plan)
    ex = MigrationExecutor(rank, 2, topo, w, plan, timeout_s=60.0, peer_weights=peers, migration_id=f"peer-{launch}",
                           **pacing(launch, expert_bytes, 1, 10.0))
    busy = torch.randn(2048, 2048, device=dev)
    dist.barrier()
    ex.start()
    deadline = time.monotonic() + 120
    while ex.status.state == "running" and time.monotonic() < deadline:
        for _ in range(4):  # a "forward" queued on the decode stream at every boundary
            busy = busy @ busy * 1e-3
        ex.maybe_switch()
    torch.cuda.synchronize()
    st = ex.status
    ok = all(torch.equal(w[l][i][j].cpu().view(torch.int8) if i == 0 else w[l][i][j].cpu(),
                         _expected(l, int(new.phy2log[l, rank * K + j]))[i])
             for l in range(L) for i in range(2) for j in range(K))
    pulled = sum(t.nbytes for t in plan.transfers if t.kind == "nvlink" and t.dst_rank == rank)
    other = 1 - rank
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"state": st.state, "error": st.error, "bit_ok": ok, "pulled": st.pulled_bytes,
                     "want_pulled": pulled, "peers": peers is not None,
                     "peer_context": torch.cuda.is_initialized() and _has_context(other)}, f)
    dist.barrier()
    ex.close(timeout=10)
    os._exit(0)


def _has_context(device: int) -> bool:
    """Whether this process holds a CUDA context on `device` (the driver's primary context is active)."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    flags, active = ctypes.c_uint(), ctypes.c_int()
    if lib.cuDevicePrimaryCtxGetState(ctypes.c_int(device), ctypes.byref(flags), ctypes.byref(active)) != 0:
        return False
    return bool(active.value)


@pytest.mark.parametrize("launch", ["boundary", "thread"])
def test_peer_copies_pull_every_nvlink_transfer_bit_identical(tmp_path, launch):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), launch)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        res = pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes())
        assert res["peers"], f"rank {r}: no peer copies (see the WARNING line above)"
        assert res["state"] == "done" and res["error"] is None, res
        assert res["bit_ok"], f"rank {r}: a slot differs from its new expert"
        assert res["pulled"] == res["want_pulled"] > 0
        print(f"rank {r}: CUDA context on the other GPU: {res['peer_context']}")
