"""EP combine in the down GEMM's epilogue (sgl_kernel_ext.ep_combine), `world` ranks emulated in one process.

Under TRITON_INTERPRET every rank's producer (GEMM + epilogue) runs in turn, each writing its partials and
arrivals into the other ranks' buffers (plain CPU tensors reached through the same int64 pointer tables the
GPU uses), then every owner's finish runs; its waits succeed at once, or, for a rank that never ran, give up
and set the error flag. What can fail here: a wrong owner / owner index / rank slot, a token completed with
the wrong count (dropped pairs, zero-pair tokens never published), a wrong row or weight, a missing reset
between calls. Races and the system-scope ordering need the GPU test (test/gpu/test_ep_combine_gpu.py). On a host with a
GPU the same cases run compiled on that one GPU (every rank's buffers in its memory, no peer access): the
check that separates a kernel bug from a peer-memory one when the two-GPU test fails.
Bounds as test_sbo.py: against the same sums done in float64 on the GEMM's own bf16 rows, rel err <= 1e-2 of
the largest value and sbo.order_error <= 1 (one bf16 ulp: the interpreter truncates fp32 -> bf16 where the GPU
rounds); against the float32 reference on the dequantized operands (ep_down_and_combine_reference, which
also does not round the GEMM's rows to bf16) assert_close with rtol = atol/max = 2e-2.
"""
import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    for _name, _kernel in (("sgl_kernel_ext.quant", "_silu_mul_quant_kernel"),
                           ("sgl_kernel_ext.grouped_gemm_fp8", "_fp8_grouped_gemm_kernel"),
                           ("sgl_kernel_ext.sbo", "_combine_kernel"),
                           ("sgl_kernel_ext.ep_combine", "_ep_finish_kernel")):
        _mod = sys.modules.get(_name)
        if _mod is not None and not isinstance(getattr(_mod, _kernel), InterpretedFunction):
            importlib.reload(_mod)

import pytest  # noqa: E402

from sgl_kernel_ext import ep_combine as ep  # noqa: E402
from sgl_kernel_ext import sbo  # noqa: E402
from sgl_kernel_ext.quant import per_block_quant_fp8, per_token_group_quant_fp8  # noqa: E402

# `pytest -m gpu` picks it on a GPU host
pytestmark = [pytest.mark.usefixtures("no_gemm_table")] + ([pytest.mark.gpu] if torch.cuda.is_available() else [])
G, H, I = 2, 256, 128  # local experts per rank, hidden (two 128-column tiles), intermediate
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def close_to_reference(got, ref):
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def rel_err(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


class Problem:
    """Gathered tokens of `sizes` owners, global routing over world * G experts, every rank's local inputs."""

    def __init__(self, sizes, k, seed, skip=(), masked=False, only_rank0=()):
        world, t = len(sizes), sum(sizes)
        g = torch.Generator().manual_seed(seed)
        e_total = world * G
        allowed = [e for e in range(e_total) if e not in skip]
        ids = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)])
        for i in only_rank0:  # every pair on rank 0's experts: no local pair on any other rank
            ids[i] = torch.arange(k)
        self.ids = ids.to(torch.int32).to(DEV)
        self.weights = (torch.rand(t, k, generator=g) + 0.1).to(DEV)
        x = torch.randn(t, I, generator=g) * (torch.rand(t, 1, generator=g) + 0.5)
        self.xq, self.xs = per_token_group_quant_fp8(x.to(DEV), 128)
        w = (torch.randn(e_total, H, I, generator=g) * 0.05).to(DEV)
        self.wq, self.ws = per_block_quant_fp8(w, 128)
        self.sizes, self.world, self.k = sizes, world, k
        self.owner, self.index = ep.allgather_maps(sizes, DEV)
        self.ranks = []
        for r in range(world):
            local = torch.where((self.ids >= r * G) & (self.ids < (r + 1) * G), self.ids - r * G, -1).to(torch.int32)
            lay, lp = ep.build_ep_layout(local, G, masked_max_m=t + 1 if masked else None)
            q, qs = sbo.dispatch_rows(self.xq, lay), sbo.dispatch_rows(self.xs, lay)
            self.ranks.append((q, qs, self.wq[r * G:(r + 1) * G], self.ws[r * G:(r + 1) * G], lay, lp))

    def run(self, *, partial_dtype=torch.float32, weights=None, cfg=None, variant="swapab", skip_rank=None,
            bufs=None, max_spin=64, scale=1.5):  # waits succeed at once here
        cap = max(max(self.sizes), 1)
        bufs = bufs or [ep.ep_buffers(self.world, cap, H, DEV, partial_dtype) for _ in range(self.world)]
        recv, arr = [b.recv for b in bufs], [b.arrivals for b in bufs]
        ys = []
        for r, (q, qs, w2, w2s, lay, lp) in enumerate(self.ranks):
            y = torch.full((G, lay.max_m, H) if lay.masked else (q.shape[0], H), float("nan"), dtype=torch.bfloat16,
                           device=DEV)
            ys.append(y)
            if r == skip_rank:
                continue
            ret = ep.ep_down_and_combine(q, qs, w2, w2s, self.weights if weights is None else weights, lay, rank=r,
                                         world=self.world, token_owner=self.owner, owner_index=self.index,
                                         local_pairs=lp, peer_recv=recv, peer_arrivals=arr, recv_capacity=cap,
                                         partial_dtype=partial_dtype, weight_scale=scale, variant=variant,
                                         config=cfg or {"BLOCK_T": 16}, y=y)
            assert ret is None
        outs = [ep.ep_finish(bufs[o], torch.full((s, H), float("nan"), dtype=torch.bfloat16, device=DEV),
                             world=self.world, max_spin=max_spin) for o, s in enumerate(self.sizes)]
        return outs, bufs, ys

    def reference(self, scale=1.5):
        per_rank = [(q, qs, w2, w2s, self.weights, lay) for q, qs, w2, w2s, lay, _ in self.ranks]
        return ep.ep_down_and_combine_reference(per_rank, self.owner, self.index, self.sizes, scale)

    def from_rows(self, ys, scale=1.5):
        """The same sums in float64 on the GEMM's own bf16 rows, per owner."""
        t = sum(self.sizes)
        total = torch.zeros(t, H, dtype=torch.float64, device=DEV)
        for (q, _, _, _, lay, _), y in zip(self.ranks, ys):
            rows = y.reshape(-1, H).double()
            part = torch.zeros(t, H, dtype=torch.float64, device=DEV)
            r = lay.row_of_pair.long().view(t, self.k)
            for kk in range(self.k):
                hit = r[:, kk] >= 0
                part[hit] += rows[r[hit, kk]] * (self.weights[hit, kk:kk + 1].double() * scale)
            total += part
        return [total[self.owner == o] for o in range(self.world)]


def test_allgather_maps_and_ep_layout():
    owner, index = ep.allgather_maps([2, 0, 3])
    assert owner.tolist() == [0, 0, 2, 2, 2] and index.tolist() == [0, 1, 0, 1, 2]
    ids = torch.tensor([[0, -1, 1], [-1, -1, -1], [1, 0, -1], [1, -1, -1]], dtype=torch.int32)
    for masked in (None, 5):
        lay, lp = ep.build_ep_layout(ids, 2, masked_max_m=masked)
        assert lp.tolist() == [2, 0, 2, 1]
        r = lay.row_of_pair.long()
        assert torch.equal(r < 0, ids.reshape(-1) < 0)
        kept = (r >= 0).nonzero().flatten()
        assert torch.equal(lay.pair_of_row[r[kept]].long(), kept)  # the inverse on the local pairs
        if masked:
            assert lay.masked_m.tolist() == [2, 3] and lay.pair_of_row.numel() == 2 * masked
        else:
            assert lay.m_indptr.tolist() == [0, 2, 5]


CASES = [  # sizes (tokens per owner), top_k, experts with no token, masked (k <= G: token 0 only on rank 0)
    ([3, 5], 2, (), False),
    ([4, 1, 0, 6], 2, (3, 6), False),  # an owner with no tokens, uneven split, empty experts
    ([2, 7], 2, (3,), True),
    ([5, 2, 3, 1], 3, (5,), True),
    ([9, 8], 2, (1,), False),  # 17 tokens: one past a BLOCK_T of 16, so the zero-partial items take two tiles
    ([10, 6], 2, (1,), True),  # 16 tokens: exactly one zero-partial tile, the GEMM's tiles numbered right after it
]


@pytest.mark.parametrize("sizes,k,skip,masked", CASES)
def test_every_owner_gets_the_reduce_scattered_sum(sizes, k, skip, masked):
    pb = Problem(sizes, k, seed=len(sizes) * 10 + k, skip=skip, masked=masked, only_rank0=(0,) if k <= G else ())
    lps = torch.stack([r[5] for r in pb.ranks])
    assert (lps == 0).any()  # some token has no local pair on some rank (the zero-partial path)
    outs, bufs, ys = pb.run()
    ref, tight = pb.reference(), pb.from_rows(ys)
    for o in range(pb.world):
        assert bufs[o].status.item() == 0
        assert not torch.isnan(outs[o].float()).any()  # every (token, N-tile) was finished
        if sizes[o]:
            close_to_reference(outs[o], ref[o])
            assert rel_err(outs[o], tight[o]) <= 1e-2 and sbo.order_error(outs[o], tight[o]) <= 1, o
        assert int(bufs[o].arrivals.abs().sum()) == 0  # the finish reset what it consumed


@pytest.mark.parametrize("walk", [{"flat": True}, {"flat": True, "tma": True}], ids=["flat", "tma"])
@pytest.mark.parametrize("sizes,k,skip,masked", CASES[:3])
def test_flat_walk_sends_the_same_partials(sizes, k, skip, masked, walk):
    """The producer on the flattened walk (configs flat, tma): the same GEMM rows, the same partials in every
    owner's receive buffer and the same finished outputs, bit for bit, as the group walk; zero-partial tokens
    included (the work items before the GEMM tiles)."""
    pb = Problem(sizes, k, seed=len(sizes) * 10 + k, skip=skip, masked=masked, only_rank0=(0,) if k <= G else ())
    outs0, bufs0, ys0 = pb.run()
    outs1, bufs1, ys1 = pb.run(cfg={"BLOCK_T": 16, **walk})
    for y0, y1 in zip(ys0, ys1):
        assert torch.equal(y0.isnan(), y1.isnan()) and torch.equal(torch.nan_to_num(y0), torch.nan_to_num(y1))
    for o in range(pb.world):
        assert bufs1[o].status.item() == 0 and int(bufs1[o].arrivals.abs().sum()) == 0
        assert torch.equal(bufs0[o].recv, bufs1[o].recv)
        assert torch.equal(outs0[o], outs1[o])


def test_normal_variant_bf16_partials_and_reuse():
    """BLOCK_T 64 (normal variant), bf16 partials, and a second call on the same buffers (arrivals were reset)."""
    pb = Problem([3, 4], 2, seed=7, skip=(2,))
    outs, bufs, ys = pb.run(partial_dtype=torch.bfloat16, variant="normal", cfg={"BLOCK_T": 64})
    ref, tight = pb.reference(), pb.from_rows(ys)
    for o in range(2):  # bf16 partials: one more rounding per rank, still within the bounds at world 2
        close_to_reference(outs[o], ref[o])
        assert rel_err(outs[o], tight[o]) <= 1e-2
    pb.weights = pb.weights.flip(0).contiguous()
    outs2, bufs2, ys2 = pb.run(partial_dtype=torch.bfloat16, bufs=bufs)
    ref2, tight2 = pb.reference(), pb.from_rows(ys2)
    for o in range(2):
        assert bufs2[o].status.item() == 0 and rel_err(outs2[o], tight2[o]) <= 1e-2
        close_to_reference(outs2[o], ref2[o])


def test_deterministic():
    """Sequential here, so this only pins the sums' order (rank, then slot); the GPU test repeats it under races."""
    pb = Problem([4, 3, 2, 5], 3, seed=3)
    a, _, _ = pb.run()
    b, _, _ = pb.run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # rank-order, slot-order sums: no arrival-order rounding


def test_wrong_weight_is_caught():
    pb = Problem([3, 5], 3, seed=11)
    bad = pb.weights.clone()
    bad[2, 1] += 3.0  # one pair of one token, on whichever rank owns its expert
    outs, _, ys = pb.run(weights=bad)
    ref, tight = pb.reference(), pb.from_rows(ys)
    o, i = int(pb.owner[2]), int(pb.index[2])
    assert rel_err(outs[o], tight[o]) > 1e-2 and sbo.order_error(outs[o], tight[o]) > 1
    with pytest.raises(AssertionError):
        close_to_reference(outs[o], ref[o])
    others = torch.arange(pb.sizes[o], device=DEV) != i
    assert others.any() and sbo.order_error(outs[o][others], tight[o][others]) <= 1  # the other tokens are right


def test_missing_arrival_sets_error_flag_and_terminates():
    pb = Problem([3, 2], 2, seed=5)
    outs, bufs, _ = pb.run(skip_rank=1, max_spin=8)  # rank 1 never runs its producer
    assert all(b.status.item() == 1 for b in bufs)  # both owners miss rank 1's arrivals and say so
    ok, bufs, _ = pb.run(max_spin=8)  # the same bound with every rank: no false alarm
    assert all(b.status.item() == 0 for b in bufs) and not torch.isnan(ok[0].float()).any()


def test_rejects_bad_buffers():
    pb = Problem([2, 2], 2, seed=1)
    q, qs, w2, w2s, lay, lp = pb.ranks[0]
    bufs = [ep.ep_buffers(2, 2, H, DEV) for _ in range(2)]
    with pytest.raises(ValueError, match="recv buffers"):
        ep.ep_down_and_combine(q, qs, w2, w2s, pb.weights, lay, rank=0, world=2, token_owner=pb.owner,
                               owner_index=pb.index, local_pairs=lp, peer_recv=[b.recv for b in bufs],
                               peer_arrivals=[b.arrivals for b in bufs], recv_capacity=3)
    with pytest.raises(ValueError, match="local_pairs"):
        ep.ep_down_and_combine(q, qs, w2, w2s, pb.weights, lay, rank=0, world=2, token_owner=pb.owner,
                               owner_index=pb.index, local_pairs=lp[:-1], peer_recv=[b.recv for b in bufs],
                               peer_arrivals=[b.arrivals for b in bufs], recv_capacity=2)
    # one peer table short, either one alone: refused before the launch, with both counts
    for recv, arr, counts in (([b.recv for b in bufs], [bufs[0].arrivals], "2 / 1"),
                              ([bufs[0].recv], [b.arrivals for b in bufs], "1 / 2")):
        with pytest.raises(ValueError, match=f"need 2 peer buffers, got {counts}"):
            ep.ep_down_and_combine(q, qs, w2, w2s, pb.weights, lay, rank=0, world=2, token_owner=pb.owner,
                                   owner_index=pb.index, local_pairs=lp, peer_recv=recv, peer_arrivals=arr,
                                   recv_capacity=2)
