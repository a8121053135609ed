"""EP combine in the down GEMM's epilogue on 2 GPUs (sgl_kernel_ext.ep_combine), against NCCL reduce_scatter.

Two processes (torch.multiprocessing, one GPU each) hold their receive buffers in torch symmetric memory
(ep.symmetric_ep_buffers; session 6's version shared them through CUDA IPC and hit an illegal address on two
H200s); NCCL (torch.distributed) provides barriers and the reference reduce_scatter. NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

Each rank runs ep_down_and_combine (producer + its own finish on one stream) on the same gathered tokens, then
the same partials are recomputed in torch from the GEMM's own bf16 rows (fp32, per rank) and reduce-scattered
with NCCL: the fused result must match up to the summation order (sbo.order_error <= 1) and the float32 reference
on the dequantized operands within 2e-2 (ep.ep_partials_reference, reduce-scattered alike), never flag an error,
and repeat bit for bit across many calls on the same buffers (the arrivals' reset under real concurrency); the
producer on the flattened, TMA-fed walk (config flat + tma) must give the same bits.
Also: a rank that skips its producer makes both owners flag status instead of hanging.
"""
import os
import traceback

import pytest
import torch

pytestmark = pytest.mark.gpu

WORLD, G, TOPK, H, I = 2, 16, 8, 7168, 2048  # 16 local experts per rank (32 in all), top-8
SIZES = (37, 91)  # uneven tokens per owner
ITERS = 50


def _problem(rank, dev):
    from sgl_kernel_ext import ep_combine as ep
    from sgl_kernel_ext import sbo
    from sgl_kernel_ext.quant import per_block_quant_fp8, per_token_group_quant_fp8

    g = torch.Generator(device="cpu").manual_seed(0)  # the same gathered batch on every rank
    t, e_total = sum(SIZES), WORLD * G
    ids = torch.stack([torch.randperm(e_total - 1, generator=g)[:TOPK] for _ in range(t)]).to(torch.int32)
    ids[0] = torch.arange(TOPK)  # token 0: only rank 0's experts (rank 1 sends a zero partial)
    ids[1] = torch.arange(G, G + TOPK)  # token 1: only rank 1's experts; expert e_total - 1 gets 0 tokens
    weights = torch.rand(t, TOPK, generator=g) + 0.05
    x = torch.randn(t, I, generator=g)
    w2 = torch.randn(G, H, I, generator=torch.Generator().manual_seed(10 + rank)) * 0.02
    xq, xs = per_token_group_quant_fp8(x.to(dev), 128)
    wq, ws = per_block_quant_fp8(w2.to(dev), 128)
    local = torch.where((ids >= rank * G) & (ids < (rank + 1) * G), ids - rank * G, -1).to(torch.int32).to(dev)
    lay, lp = ep.build_ep_layout(local, G)
    owner, index = ep.allgather_maps(SIZES, dev)
    return (sbo.dispatch_rows(xq, lay), sbo.dispatch_rows(xs, lay), wq, ws, weights.to(dev), lay, lp,
            owner, index)


def _worker(rank, init_file, errors):
    try:
        _run(rank, init_file)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


def _run(rank, init_file):
    import torch.distributed as dist

    from sgl_kernel_ext import ep_combine as ep
    from sgl_kernel_ext import sbo

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, device_id=dev)
    cap = max(SIZES)
    own, recv_tab, arr_tab, handles = ep.symmetric_ep_buffers(WORLD, cap, H, dist.group.WORLD, dev)
    q, qs, wq, ws, w, lay, lp, owner, index = _problem(rank, dev)
    y = torch.empty(q.shape[0], H, dtype=torch.bfloat16, device=dev)
    kw = dict(rank=rank, world=WORLD, token_owner=owner, owner_index=index, local_pairs=lp, peer_recv=recv_tab,
              peer_arrivals=arr_tab, recv_capacity=cap, weight_scale=2.5, y=y, own=own)
    dist.barrier()
    first = None
    for it in range(ITERS):
        out = torch.full((SIZES[rank], H), float("nan"), dtype=torch.bfloat16, device=dev)
        ep.ep_down_and_combine(q, qs, wq, ws, w, lay, out=out, **kw)
        dist.barrier()  # stands in for the next layer's dispatch all-gather (orders the reset before reuse)
        if first is None:
            first = out.clone()
        else:
            assert torch.equal(out, first), f"rank {rank} iteration {it}: not bit-identical"
    torch.cuda.synchronize()
    assert int(own.status) == 0, "a finish gave up waiting"
    assert int(own.arrivals.abs().sum()) == 0

    # the reference: the same partials (fp32, from this rank's bf16 rows) reduce-scattered by NCCL
    part = sbo.combine_reference(y, lay, w, 2.5, out_dtype=torch.float32)
    send = torch.zeros(WORLD, cap, H, dtype=torch.float32, device=dev)
    send[owner.long(), index.long()] = part
    got = torch.empty(cap, H, dtype=torch.float32, device=dev)
    dist.reduce_scatter_tensor(got, send.view(WORLD * cap, H))
    want = got[:SIZES[rank]]
    err = sbo.order_error(first, want)
    assert err <= 1, f"rank {rank}: order_error {err}"
    assert not torch.isnan(first.float()).any()

    # and against float32 on the dequantized operands (the partials not from y: a wrong scale or K loop in the
    # producer's GEMM shows here), reduce-scattered the same way; bounds as test/cpu/test_ep_combine.py
    send.zero_()
    send[owner.long(), index.long()] = ep.ep_partials_reference(q, qs, wq, ws, w, lay, weight_scale=2.5)
    dist.reduce_scatter_tensor(got, send.view(WORLD * cap, H))
    exact = got[:SIZES[rank]]
    torch.testing.assert_close(first.float(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())

    # the producer on the flattened, TMA-fed walk: the same tiles as the group walk with the same tile config,
    # so the same partials and the same bits, over repeated calls (alternating the two walks on one set of buffers)
    walks = {"group": {"BLOCK_T": 16}, "flat": {"BLOCK_T": 16, "flat": True, "tma": True}}
    want_bits = None
    for it in range(12):
        name = "flat" if it % 2 else "group"
        out = torch.full((SIZES[rank], H), float("nan"), dtype=torch.bfloat16, device=dev)
        ep.ep_down_and_combine(q, qs, wq, ws, w, lay, out=out, config=walks[name], **kw)
        dist.barrier()
        want_bits = out.clone() if want_bits is None else want_bits
        assert torch.equal(out, want_bits), f"rank {rank} {name} walk, iteration {it}: differs"
    assert sbo.order_error(want_bits, want) <= 1
    torch.cuda.synchronize()
    assert int(own.status) == 0 and int(own.arrivals.abs().sum()) == 0

    # a rank that never produces: both owners flag it and return
    dist.barrier()
    torch.cuda.synchronize()
    out = torch.empty(SIZES[rank], H, dtype=torch.bfloat16, device=dev)
    if rank == 0:
        ep.ep_down_and_combine(q, qs, wq, ws, w, lay, out=out, max_spin=1000, **kw)
    else:
        ep.ep_finish(own, out, world=WORLD, max_spin=1000)
    torch.cuda.synchronize()
    assert int(own.status) == 1, f"rank {rank}: a missing arrival was not flagged"
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_ep_combine_matches_nccl_reduce_scatter(tmp_path):
    import torch.multiprocessing as mp

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ.setdefault("SGLANG_H20_GEMM_TABLE", str(tmp_path / "absent.json"))
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "pg_init"), errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    msgs = []
    while not errors.empty():
        msgs.append("rank %d:\n%s" % errors.get())
    for p in procs:
        if p.is_alive():
            p.kill()
            msgs.append(f"pid {p.pid} did not finish")
    assert not msgs and all(p.exitcode == 0 for p in procs), "\n".join(msgs) or [p.exitcode for p in procs]
