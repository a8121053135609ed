"""SBO on CPU: the down GEMM's completion signals, the signal-waiting combine, the layout maps, the
error flag, and the plugin's hooks against the installed SGLang.

Under TRITON_INTERPRET programs run one after another, so "overlap" is emulated in order: the GEMM
runs first with signals on, then the consumer waits on them (every wait succeeds at once). What can
still fail here: a missing or miscounted signal (the consumer then flags an error), a unit that reads
a row without waiting for that row's own (expert, token tile) count, a wrong inverse map, a pair
added twice or never (the per-(token, chunk) counts), a wrong weight or row. The combine sums in fp32
in arrival order, so outputs are compared up to that order's rounding (`sbo.order_error` <= 1: one
bf16 ulp) with the non-waiting path, and within 1e-2 of the largest value with a float64 reference.
(The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: still within both bounds.)
Races need the GPU test (test/gpu/test_sbo_gpu.py).
"""
import importlib
import logging
import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    for _name, _kernel in (("sgl_kernel_ext.quant", "_silu_mul_quant_kernel"),
                           ("sgl_kernel_ext.grouped_gemm_fp8", "_fp8_grouped_gemm_kernel"),
                           ("sgl_kernel_ext.sbo", "_combine_kernel"), ("sgl_kernel_ext.sbo", "_layout_kernel")):
        _mod = sys.modules.get(_name)
        if _mod is not None and not isinstance(getattr(_mod, _kernel), InterpretedFunction):
            importlib.reload(_mod)

import pytest  # noqa: E402
import triton  # noqa: E402

from sgl_kernel_ext import grouped_gemm_fp8 as gg  # noqa: E402
from sgl_kernel_ext import sbo  # noqa: E402
from sgl_kernel_ext.quant import per_block_quant_fp8, per_token_group_quant_fp8  # noqa: E402

E, H, I = 4, 256, 128  # experts, hidden (down N; two 128-row N-tiles at BLOCK_N 128), intermediate (down K)


pytestmark = pytest.mark.usefixtures("no_gemm_table")


@pytest.fixture(autouse=True)
def sbo_state_of_no_gpu(monkeypatch):
    """hooks() sets the plugin module's per-GPU state (any test file's fake GPU may have left one): each test here
    starts from the default's and leaves the module as it found it."""
    from sglang_h20.moe import sbo as plugin_sbo

    for state, value in (("_tuned", plugin_sbo.DEFAULT_TUNED), ("_gpu_name", "no GPU"),
                         ("_pairs_cap", plugin_sbo.DEFAULT_TUNED.max_pairs_per_expert), ("_shared_sms", 0)):
        monkeypatch.setattr(plugin_sbo, state, value)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def moe_weights(g, hidden=128, inter=128):
    """FP8 block-quantized gate_up [E, 2*inter, hidden] and down [E, hidden, inter] weights with their scales:
    (w1q, w1s, w2q, w2s)."""
    w1q, w1s = per_block_quant_fp8(torch.randn(E, 2 * inter, hidden, generator=g) * 0.05, 128)
    w2q, w2s = per_block_quant_fp8(torch.randn(E, hidden, inter, generator=g) * 0.05, 128)
    return w1q, w1s, w2q, w2s


def routing(t, k, seed, experts=E, skip=()):
    """topk_ids [t, k]: k distinct experts per token, never one of `skip` (0-token experts)."""
    g = gen(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return ids.to(torch.int32), w.float()


def down_operands(rows_shape, seed, experts=E, n=H, k=I):
    g = gen(seed)
    x = torch.randn(*rows_shape, k, generator=g) * (torch.rand(*rows_shape, 1, generator=g) + 0.5)
    q, qs = per_token_group_quant_fp8(x, 128)
    w = torch.randn(experts, n, k, generator=g) * 0.05
    wq, ws = per_block_quant_fp8(w, 128)
    return q, qs, wq, ws


CFG = {"BLOCK_N": 128, "BLOCK_T": 16}


@pytest.mark.parametrize("masked", [False, True])
def test_layout_maps_are_inverse(masked):
    ids, _ = routing(7, 2, seed=1, skip=(2,))
    lay = sbo.build_layout(ids, E, masked_max_m=9 if masked else None)
    p = ids.numel()
    assert torch.equal(lay.pair_of_row[lay.row_of_pair.long()], torch.arange(p, dtype=torch.int32))
    counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
    rows = lay.row_of_pair.long()
    expert_of_pair = ids.reshape(-1).long()
    if masked:
        assert torch.equal(lay.masked_m, counts.int())
        assert torch.equal(rows // 9, expert_of_pair)
        assert bool(((rows % 9) < counts[expert_of_pair]).all())
    else:
        assert torch.equal(lay.m_indptr[1:].long(), counts.cumsum(0))
        lo, hi = lay.m_indptr[expert_of_pair].long(), lay.m_indptr[expert_of_pair + 1].long()
        assert bool(((rows >= lo) & (rows < hi)).all())
    assert int(lay.m_indptr[3] - lay.m_indptr[2]) == 0 if not masked else int(lay.masked_m[2]) == 0


@pytest.mark.parametrize("masked", [False, True])
def test_dispatch_rows_torch_form_equals_the_kernel(masked, monkeypatch):
    """On a CPU without the interpreter dispatch_rows takes torch ops: every kept pair's row is the kernel's."""
    t, k, e = 7, 3, 5
    g = gen(33)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    ids[2, 1] = ids[5, 0] = -1
    lay = sbo.build_layout(ids, e, masked_max_m=t if masked else None, drops=True)
    x = torch.randn(t, 256, generator=g).to(torch.float8_e4m3fn)
    want = sbo.dispatch_rows(x, lay).reshape(-1, 256).view(torch.uint8)
    monkeypatch.setattr(sbo, "_interpreting", lambda: False)
    got = sbo.dispatch_rows(x, lay)
    assert got.shape == ((e, t, 256) if masked else (t * k, 256))
    kept = lay.row_of_pair.long()[lay.row_of_pair >= 0]
    assert kept.numel() == t * k - 2
    assert torch.equal(got.reshape(-1, 256).view(torch.uint8)[kept], want[kept])


def test_down_and_combine_refuses_a_wrong_out():
    """`out` must be bf16 [tokens, hidden]: a wrong dtype alone, or a wrong shape alone, is refused."""
    t, k = 5, 2
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=12, masked=False)
    for out in (torch.empty(t, H, dtype=torch.float32), torch.empty(t + 1, H, dtype=torch.bfloat16),
                torch.empty(t, H // 2, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out must be bf16"):
            sbo.moe_down_and_combine(q, qs, wq, ws, w, lay, out, overlap=False, config=CFG, variant="swapab")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("drops", [False, True])
def test_layout_kernel_equals_torch_form(masked, drops):
    """The one-program Triton layout (interpreted here) builds exactly the torch form's maps, random routings with
    empty experts, a count of experts that is not a power of two, one pair, and (drops) ids of -1."""
    g = gen(31)
    # (130, 8, 256): 1040 pairs, the 8-warp program (> 1024 pairs) the hook runs at 256 experts above batch 128
    for case, (t, k, e) in enumerate([(1, 1, 3), (7, 2, 5), (16, 8, 256), (33, 4, 6), (3, 3, 37), (130, 8, 256)]):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
        if drops:
            ids[torch.rand(t, k, generator=g) < 0.3] = -1
        max_m = t + case if masked else None
        got = sbo.build_layout(ids, e, masked_max_m=max_m, drops=drops)
        want = sbo._build_layout_torch(ids, e, max_m, drops)
        for name in sbo.MoeLayout._fields:
            a, b = getattr(got, name), getattr(want, name)
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), (case, name, a, b)
            else:
                assert a == b, (case, name)


@pytest.mark.parametrize("masked", [False, True])
def test_dispatch_rows_places_each_pair(masked):
    """Every kept pair's row holds its token's row (fp8 rows through int32 words, fp32 scales, and a row size
    that is not a multiple of 4 bytes through bytes); a dropped pair writes nothing."""
    t, k, e = 6, 3, 5
    g = gen(32)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    ids[1, 2] = -1
    lay = sbo.build_layout(ids, e, masked_max_m=t if masked else None, drops=True)
    for x in (torch.randn(t, 256, generator=g).to(torch.float8_e4m3fn), torch.randn(t, 2, generator=g),
              torch.randint(0, 255, (t, 7), dtype=torch.uint8, generator=g)):
        out = sbo.dispatch_rows(x, lay)
        assert out.shape == ((e, t) if masked else (t * k,)) + x.shape[1:]  # [E, max_m, ...] or [P, ...]
        out = out.reshape(-1, *x.shape[1:])
        rop = lay.row_of_pair.long()
        for pair in range(t * k):
            if rop[pair] >= 0:
                assert torch.equal(out[rop[pair]].view(torch.uint8), x[pair // k].view(torch.uint8)), pair
        assert int((rop < 0).sum()) == 1
    # no tokens at all (an idle rank's batch): the same shapes, with nothing to place
    empty = sbo.build_layout(torch.empty(0, k, dtype=torch.int32), e, masked_max_m=t if masked else None)
    out = sbo.dispatch_rows(torch.randn(0, 2, generator=g), empty)
    assert out.shape == ((e, t, 2) if masked else (0, 2))


@pytest.mark.parametrize("masked", [False, True])
def test_quant_dispatch_equals_quant_then_dispatch(masked, monkeypatch):
    """One kernel gives the bits of per_token_group_quant_fp8 then dispatch_rows, for every kept pair's row (a
    dropped pair's row is never written; an all-zero group gets the EPS scale and zeros). The kernel itself runs
    here (the interpreter): the torch form, for a plain CPU, would call the quant it is compared with."""
    t, k, e, h = 5, 3, 4, 384
    g = gen(33)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    ids[3, 1] = -1
    x = (torch.randn(t, h, generator=g) * torch.logspace(-3, 2, h)).to(torch.bfloat16)
    x[2, 128:256] = 0
    lay = sbo.build_layout(ids, e, masked_max_m=t if masked else None, drops=True)
    with monkeypatch.context() as m:
        m.setattr("sgl_kernel_ext.quant.per_token_group_quant_fp8",
                  lambda *a: pytest.fail("quant_dispatch took the torch form under the interpreter"))
        kernel = sbo.quant_dispatch(x, lay)
    monkeypatch.setattr(sbo, "_interpreting", lambda: False)  # a plain CPU: the torch form, the same bits
    torch_form = sbo.quant_dispatch(x, lay)
    wq, ws = per_token_group_quant_fp8(x, 128)
    wq, ws = sbo.dispatch_rows(wq, lay), sbo.dispatch_rows(ws, lay)
    rop = lay.row_of_pair.long()
    kept = rop[rop >= 0]
    assert len(kept) == t * k - 1
    for q, sc in (kernel, torch_form):
        assert q.shape == wq.shape and sc.shape == ws.shape and q.dtype == wq.dtype and sc.dtype == torch.float32
        q2, wq2 = q.reshape(-1, h)[kept], wq.reshape(-1, h)[kept]
        assert torch.equal(q2.view(torch.uint8), wq2.view(torch.uint8))
        assert torch.equal(sc.reshape(-1, h // 128)[kept], ws.reshape(-1, h // 128)[kept])


def test_masked_gemm_signals_count_finished_tiles():
    masked_m = torch.tensor([5, 0, 19, 16], dtype=torch.int32)
    max_m = 20
    q, qs, wq, ws = down_operands((E, max_m), seed=2)
    plain = gg.m_grouped_fp8_gemm_nt_masked(q, qs, wq, ws, masked_m, config=CFG, variant="swapab")
    sig = torch.zeros(E, triton.cdiv(max_m, 16), dtype=torch.int32)
    out = gg.m_grouped_fp8_gemm_nt_masked(q, qs, wq, ws, masked_m, config=CFG, variant="swapab", signal=sig)
    for g, m in enumerate(masked_m.tolist()):
        assert torch.equal(out[g, :m], plain[g, :m])
        tiles = triton.cdiv(m, 16)
        assert sig[g, :tiles].tolist() == [H // 128] * tiles
        assert sig[g, tiles:].tolist() == [0] * (sig.shape[1] - tiles)


def test_signal_rejects_split_k_and_bad_shape():
    masked_m = torch.tensor([3, 3, 3, 3], dtype=torch.int32)
    q, qs, wq, ws = down_operands((E, 4), seed=3, k=256)
    with pytest.raises(ValueError, match="split_k"):
        gg.m_grouped_fp8_gemm_nt_masked(q, qs, wq, ws, masked_m, config=CFG, split_k=2,
                                        signal=torch.zeros(E, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        gg.m_grouped_fp8_gemm_nt_masked(q, qs, wq, ws, masked_m, config=CFG, signal=torch.zeros(E, 1, dtype=torch.int64))


def run_case(t, k, seed, masked, skip=(), weight_scale=1.0):
    ids, w = routing(t, k, seed, skip=skip)
    lay = sbo.build_layout(ids, E, masked_max_m=t if masked else None)
    rows = (E, t) if masked else (t * k,)
    q, qs, wq, ws = down_operands(rows, seed + 100)
    return ids, w, lay, q, qs, wq, ws


def combine64(y, lay, w, weight_scale):
    """The combine in float64 from the same bf16 rows (no rounding but the inputs')."""
    t, k = w.shape
    rows = y.reshape(-1, y.shape[-1]).double()[lay.row_of_pair.long()].view(t, k, -1)
    return (rows * (w.double() * weight_scale)[..., None]).sum(1)


def rel_err(got, ref64):
    return float((got.double() - ref64).abs().max() / ref64.abs().max())


def down_gemm(q, qs, wq, ws, lay, y, cfg=CFG, **kw):
    """The swapAB down GEMM into y in the layout's form; kw: signal= or combine=."""
    if lay.masked:
        gg.m_grouped_fp8_gemm_nt_masked(q, qs, wq, ws, lay.masked_m, out=y, config=cfg, variant="swapab", **kw)
    else:
        gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, out=y, config=cfg, variant="swapab", **kw)
    return y


def nan_rows(lay, t, k):
    """GEMM rows for the layout, NaN until written."""
    return torch.full((E, t, H) if lay.masked else (t * k, H), float("nan"), dtype=torch.bfloat16)


def test_sorted_maps_follow_expert_order():
    ids, _ = routing(9, 3, seed=5)
    for masked in (False, True):
        lay = sbo.build_layout(ids, E, masked_max_m=9 if masked else None)
        sp, se = lay.sorted_pair.long(), lay.sorted_expert.long()
        assert torch.equal(torch.sort(sp).values, torch.arange(27))  # a permutation of the pairs
        assert torch.equal(se, ids.reshape(-1).long()[sp]) and bool((se[1:] >= se[:-1]).all())
        assert torch.equal(lay.pair_of_row[lay.row_of_pair[sp].long()].long(), sp)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("t,k,skip", [(5, 2, (1,)), (9, 3, ()), (1, 1, (0, 2, 3)), (20, 4, ())])
def test_overlap_emulated_equals_plain_and_references(masked, t, k, skip):
    """(20, 4): every expert has 20 rows, so its second token tile (j = 1) is signalled and awaited."""
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=10 + t, masked=masked, skip=skip)
    ref = sbo.moe_down_and_combine_reference(q, qs, wq, ws, w, lay, weight_scale=2.5)
    plain = sbo.moe_down_and_combine(q, qs, wq, ws, w, lay, torch.full((t, H), float("nan"), dtype=torch.bfloat16),
                                     weight_scale=2.5, overlap=False, config=CFG, variant="swapab")
    torch.testing.assert_close(plain.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())

    # the overlapped order, sequentially: GEMM with signals, then the waiting consumer; 2 H-chunks,
    # row blocks of 4 expert-ordered pairs (so a block spans experts and token tiles)
    y = nan_rows(lay, t, k)
    wsp = sbo.workspace(lay, t, H, 16, "cpu", block_h=128)
    down_gemm(q, qs, wq, ws, lay, y, signal=wsp.signal)
    out = sbo.combine(y, lay, w, torch.full((t, H), float("nan"), dtype=torch.bfloat16), weight_scale=2.5,
                      signal=wsp.signal, expect=H // 128, block_t=16, acc=wsp.acc, counters=wsp.counters,
                      status=wsp.status, num_programs=3, max_spin=10, block_h=128, block_r=4)
    assert int(wsp.status) == 0
    assert torch.equal(wsp.counters, torch.full((t, 2), k, dtype=torch.int32))  # every pair arrived once per chunk
    assert sbo.order_error(out, plain) <= 1  # equal up to the fp32 summation order
    r64 = combine64(y, lay, w, 2.5)
    assert rel_err(out, r64) <= 1e-2 and rel_err(plain, r64) <= 1e-2
    assert sbo.order_error(out, sbo.combine_reference(y, lay, w, 2.5)) <= 1

    # the checks can fail: one wrong weight (a 25% error on one slot of one token) is caught by both
    w_bad = w.clone()
    w_bad[t // 2, k - 1] *= 1.25
    bad = sbo.combine(y, lay, w_bad, torch.empty(t, H, dtype=torch.bfloat16), weight_scale=2.5, block_h=128, block_r=4)
    assert sbo.order_error(bad, plain) > 1 and rel_err(bad, r64) > 1e-2


def test_order_error_worked_values():
    """The unit is 2^-7 |want| + 2^-12 max|want|: a bf16 ulp of 1.0 on a 1.0 beside a 2.0 is 16/17 of it, the
    same difference on an element near 0 is 2^-7 / 2^-11 = 16 of them (the floor), and no elements give 0."""
    want = torch.tensor([1.0, -2.0, 0.0])
    assert sbo.order_error(want + torch.tensor([2.0 ** -7, 0.0, 0.0]), want) == pytest.approx(16 / 17, rel=1e-12)
    assert sbo.order_error(want + torch.tensor([0.0, 0.0, 2.0 ** -7]), want) == pytest.approx(16.0, rel=1e-12)
    assert sbo.order_error(want.bfloat16(), want) == 0.0  # exact in bf16: no error, whatever the dtypes
    assert sbo.order_error(torch.empty(0), torch.empty(0)) == 0.0


@pytest.mark.parametrize("form", ["inline", "defer", "tail"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("variant,cfg", [("swapab", CFG), ("normal", {"BLOCK_N": 128, "BLOCK_T": 16})])
@pytest.mark.parametrize("t,k,skip", [(5, 2, (1,)), (20, 4, ()), (1, 1, (0, 2, 3))])
def test_epilogue_combine_equals_plain(masked, variant, cfg, t, k, skip, form):
    """fused=True: the combine in the GEMM's epilogue (the tile completing a token's N-range gathers its rows;
    defer: after the program's last tile; tail: one grid-wide arrival per program, then (token, N-tile)s gathered
    side by side; here, in the interpreter, by the last program to arrive). Same bf16 rows as GEMM-then-combine,
    summed in slot order: equal up to the summation order, deterministic, every token written, and a wrong weight is caught."""
    kw = dict(weight_scale=2.5, fused=True, defer=form == "defer", tail=form == "tail", config=cfg, variant=variant)
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=40 + t, masked=masked, skip=skip)
    plain = sbo.moe_down_and_combine(q, qs, wq, ws, w, lay, torch.full((t, H), float("nan"), dtype=torch.bfloat16),
                                     weight_scale=2.5, overlap=False, config=cfg, variant=variant)
    y = nan_rows(lay, t, k)
    fused = sbo.moe_down_and_combine(q, qs, wq, ws, w, lay, torch.full((t, H), float("nan"), dtype=torch.bfloat16),
                                     y=y, **kw)
    assert not torch.isnan(fused.float()).any()  # every (token, N-tile) was written by its last contributor
    assert sbo.order_error(fused, plain) <= 1
    assert rel_err(fused, combine64(y, lay, w, 2.5)) <= 1e-2  # the gathered rows are the GEMM's own
    again = sbo.moe_down_and_combine(q, qs, wq, ws, w, lay, torch.empty(t, H, dtype=torch.bfloat16),
                                     **kw)
    assert torch.equal(again, fused)  # slot-order sum: no arrival-order rounding
    w_bad = w.clone()
    w_bad[t // 2, k - 1] *= 1.25
    bad = sbo.moe_down_and_combine(q, qs, wq, ws, w_bad, lay, torch.empty(t, H, dtype=torch.bfloat16),
                                   **kw)
    assert sbo.order_error(bad, plain) > 1


@pytest.mark.parametrize("walk", [{"flat": True}, {"flat": True, "tma": True}], ids=["flat", "tma"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("defer,counts_only", [(False, False), (True, False), (False, True)],
                         ids=["inline", "deferred", "counts_only"])
def test_epilogue_combine_in_the_flat_walk_equals_the_group_walk(walk, masked, defer, counts_only):
    """EpilogueCombine in the flattened walk (configs flat, tma): the same GEMM rows, the same per-(token, N-tile)
    counts and, since the gather sums in slot order whichever tile completes a token, the same output bits as in
    the group walk, inline or deferred; counts_only writes no output in either."""
    t, k = 20, 3  # one expert gets no token (skip), one token tile of 16 plus a partial one per expert
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=77, masked=masked, skip=(1,))

    def run(cfg):
        out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
        cnt = torch.zeros(t, H // cfg["BLOCK_N"], dtype=torch.int32)
        cmb = gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1), cnt, out, k, 2.5,
                                 counts_only=counts_only, defer=defer)
        return down_gemm(q, qs, wq, ws, lay, nan_rows(lay, t, k), cfg, combine=cmb), out, cnt

    (y0, out0, cnt0), (y1, out1, cnt1) = run(CFG), run({**CFG, **walk})
    assert torch.equal(torch.nan_to_num(y1), torch.nan_to_num(y0)) and torch.equal(y1.isnan(), y0.isnan())
    assert torch.equal(cnt1, cnt0) and int(cnt0.sum()) == t * k * (H // CFG["BLOCK_N"])
    assert torch.equal(out1.isnan(), out0.isnan()) and torch.equal(torch.nan_to_num(out1), torch.nan_to_num(out0))
    assert bool(out0.isnan().all()) == counts_only  # written everywhere, or (counts_only) nowhere


@pytest.mark.parametrize("masked", [False, True])
def test_tail_counts_only_synchronizes_without_writing(masked):
    """counts_only with the tail form (benchmarks: the grid-wide barrier's cost alone): programs arrive and none
    gives up, the GEMM's rows are written as without a combine, and out is not touched."""
    t, k = 20, 3
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=78, masked=masked, skip=(1,))

    out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
    cnt = torch.zeros(gg.TAIL_COUNTERS, dtype=torch.int32)
    cmb = gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1), cnt, out, k, 2.5, counts_only=True,
                             tail=True)
    y = down_gemm(q, qs, wq, ws, lay, nan_rows(lay, t, k), combine=cmb)
    plain = down_gemm(q, qs, wq, ws, lay, nan_rows(lay, t, k))
    assert torch.equal(y.isnan(), plain.isnan()) and torch.equal(torch.nan_to_num(y), torch.nan_to_num(plain))
    arrivals, gave_up = int(cnt) & gg.TAIL_ARRIVALS.value, int(cnt) >> gg.TAIL_GAVE_UP_SHIFT.value
    assert arrivals >= 1 and gave_up == 0, int(cnt)
    assert out.isnan().all()  # no item gathered


@pytest.mark.parametrize("masked", [False, True])
def test_combine_skips_dropped_pairs(masked):
    """A drops=True layout (EP: pairs on other ranks' experts are -1): those pairs add nothing, a token with no
    local pair gets 0, and the rest is the float64 sum."""
    t, k = 9, 3
    g = torch.Generator().manual_seed(21)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    ids[torch.rand(t, k, generator=g) < 0.4] = -1
    ids[2] = -1  # no local pair at all
    lay = sbo.build_layout(ids, E, masked_max_m=t if masked else None, drops=True)
    rows = lay.pair_of_row.numel()
    y = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    w = torch.rand(t, k, generator=g) + 0.1
    out = sbo.combine(y.view(E, t, H) if masked else y, lay, w, torch.full((t, H), float("nan"),
                      dtype=torch.bfloat16), weight_scale=2.0)
    want = torch.zeros(t, H, dtype=torch.float64)
    rop = lay.row_of_pair.long().view(t, k)
    for i in range(t):
        for kk in range(k):
            if rop[i, kk] >= 0:
                want[i] += y[rop[i, kk]].double() * float(w[i, kk]) * 2.0
    assert torch.equal(out[2], torch.zeros(H, dtype=torch.bfloat16))
    assert rel_err(out, want) <= 1e-2 and sbo.order_error(out, want.to(torch.bfloat16)) <= 1
    assert sbo.order_error(sbo.combine_reference(y, lay, w, 2.0), want.to(torch.bfloat16)) <= 1


def test_epilogue_combine_counts_only_counts_and_writes_nothing():
    """counts_only (bench_sbo's probe of the counting's cost): every (token, N-tile) count reaches top_k, the GEMM
    rows are the same, and out is never written."""
    t, k = 6, 3
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=8, masked=False)
    plain_rows = gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, config=CFG, variant="swapab")
    y = torch.empty(t * k, H, dtype=torch.bfloat16)
    out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
    cnt = torch.zeros(t, H // CFG["BLOCK_N"], dtype=torch.int32)
    gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, out=y, config=CFG, variant="swapab",
                                        combine=gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1),
                                                                   cnt, out, k, 2.5, counts_only=True))
    assert torch.equal(y, plain_rows) and torch.isnan(out.float()).all()
    assert (cnt == k).all()


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_epilogue_combine_tail_arrives_once_per_program(programs):
    """tail: whatever the grid (one program, several, more programs than tiles), the counter ends at the programs
    launched, with no give-up mark above its arrivals; with counts_only the rows are the plain GEMM's and out is never
    written."""
    t, k = 6, 3
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=8, masked=False)
    plain_rows = gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, config=CFG, variant="swapab")
    y = torch.empty(t * k, H, dtype=torch.bfloat16)
    out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
    cnt = torch.zeros(gg.TAIL_COUNTERS, dtype=torch.int32)
    gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, out=y, config={**CFG, "programs_per_sm": 1},
                                        variant="swapab", num_sms=programs,
                                        combine=gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1),
                                                                   cnt, out, k, 2.5, counts_only=True, tail=True))
    assert torch.equal(y, plain_rows) and torch.isnan(out.float()).all()
    # the grid: one program per SM given, at most the launcher's tile bound (token tiles <= rows/BT + groups)
    upper = (t * k // CFG["BLOCK_T"] + min(E, t * k)) * (H // CFG["BLOCK_N"])
    assert cnt.tolist() == [min(programs, upper)]


def test_epilogue_combine_rejects_bad_workspace():
    ids, w, lay, q, qs, wq, ws = run_case(4, 2, seed=3, masked=False)
    out = torch.empty(4, H, dtype=torch.bfloat16)
    y = torch.empty(8, H, dtype=torch.bfloat16)
    ok_cnt = torch.zeros(4, 2, dtype=torch.int32)
    for bad, match in ((gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1),
                                           torch.zeros(4, 3, dtype=torch.int32), out, 2), "counters"),
                       (gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1)[:5], ok_cnt, out, 2),
                        "weights"),
                       (gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair.long(), w.reshape(-1), ok_cnt, out, 2),
                        "row_of_pair"),
                       # top_k 0 with no weights: the sizes agree (0 == 4 x 0), the top_k bound alone refuses it
                       (gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair[:0], w.reshape(-1)[:0], ok_cnt, out, 0),
                        "top_k 0"),
                       (gg.EpilogueCombine(lay.pair_of_row.long(), lay.row_of_pair, w.reshape(-1), ok_cnt, out, 2),
                        "pair_of_row"),
                       (gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1), ok_cnt,
                                           torch.empty(H, 4, dtype=torch.bfloat16).t(), 2), "unit inner stride"),
                       (gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1), ok_cnt, out, 2,
                                           defer=True, tail=True), "pick one")):
        with pytest.raises(ValueError, match=match):
            gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, out=y, config=CFG, variant="swapab",
                                                combine=bad)
    good = gg.EpilogueCombine(lay.pair_of_row, lay.row_of_pair, w.reshape(-1), ok_cnt, out, 2)
    with pytest.raises(ValueError, match="no signal"):  # the epilogue replaces the store a signal would announce
        gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, out=y, config=CFG, variant="swapab",
                                            signal=torch.zeros(E, 1, dtype=torch.int32), combine=good)


def test_every_tile_signal_is_awaited():
    """Each non-empty (expert, token tile) in turn one N-tile short: the consumer must notice every time."""
    t, k = 20, 4
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=30, masked=False)
    y = gg.m_grouped_fp8_gemm_nt_contiguous(q, qs, wq, ws, lay.m_indptr, config=CFG, variant="swapab")
    counts = (lay.m_indptr[1:] - lay.m_indptr[:-1]).tolist()
    tiles = [(e, j) for e, c in enumerate(counts) for j in range(triton.cdiv(c, 16))]
    assert any(j > 0 for _, j in tiles)
    for e, j in tiles + [(None, None)]:
        wsp = sbo.workspace(lay, t, H, 16, "cpu", block_h=128)
        for e2, c in enumerate(counts):
            wsp.signal[e2, :triton.cdiv(c, 16)] = H // 128
        if e is not None:
            wsp.signal[e, j] -= 1
        sbo.combine(y, lay, w, torch.zeros(t, H, dtype=torch.bfloat16), signal=wsp.signal, expect=H // 128,
                    block_t=16, acc=wsp.acc, counters=wsp.counters, status=wsp.status, num_programs=3, max_spin=3,
                    block_h=128, block_r=8)
        assert int(wsp.status) == (e is not None), (e, j)


def test_missing_signal_sets_error_flag_and_terminates():
    t, k = 6, 2
    ids, w, lay, q, qs, wq, ws = run_case(t, k, seed=40, masked=True)
    y = gg.m_grouped_fp8_gemm_nt_masked(q, qs, wq, ws, lay.masked_m, config=CFG, variant="swapab")
    wsp = sbo.workspace(lay, t, H, 16, "cpu")  # nothing signalled at all
    sbo.combine(y, lay, w, torch.zeros(t, H, dtype=torch.bfloat16), signal=wsp.signal, expect=H // 128,
                block_t=16, acc=wsp.acc, counters=wsp.counters, status=wsp.status, num_programs=1, max_spin=3)
    assert int(wsp.status) == 1
    with pytest.raises(ValueError, match="counters"):  # counts sized for another H-chunk width
        sbo.combine(y, lay, w, torch.zeros(t, H, dtype=torch.bfloat16), acc=wsp.acc, counters=wsp.counters,
                    block_h=128)


def test_workspace_parts_cover_the_buffer():
    """What moe_down_and_combine zeroes on its two streams is the whole workspace, acc 16-byte aligned."""
    ids, _ = routing(9, 3, seed=6)
    lay = sbo.build_layout(ids, E)
    wsp = sbo.workspace(lay, 9, H, 16, "cpu", zero=False)
    wsp.combine_part.fill_(7)
    wsp.gemm_part.fill_(7)
    for part in (wsp.acc.view(torch.int32), wsp.counters, wsp.signal, wsp.status):
        assert bool((part == 7).all())
    assert wsp.combine_part.numel() + wsp.gemm_part.numel() == wsp.acc.numel() + wsp.counters.numel() + \
        wsp.signal.numel() + 1
    assert wsp.acc.data_ptr() % 16 == 0 and wsp.counters.shape == (9, triton.cdiv(H, sbo.BLOCK_H))


@pytest.mark.parametrize("combine", ["serial", "fused", "tail"])
def test_moe_forward_matches_reference(combine):
    """The whole SBO MoE (dispatch, gate_up, SiLU, down + combine) on tiny shapes vs float32 torch; 'tail' is
    what the hook runs on one GPU."""
    from sglang_h20.moe import sbo as plugin_sbo
    from sgl_kernel_ext.quant import dequant_per_block, dequant_per_token_group

    t, k, hidden, inter = 5, 2, 128, 128
    ids, w = routing(t, k, seed=50, skip=(3,))
    g = gen(51)
    x = (torch.randn(t, hidden, generator=g)).to(torch.bfloat16)
    w1q, w1s, w2q, w2s = moe_weights(g, hidden, inter)
    out = plugin_sbo.moe_forward(x, w1q, w2q, w, ids, w1s, w2s, routed_scaling_factor=1.5, combine=combine)
    a, as_ = per_token_group_quant_fp8(x, 128)
    ad = dequant_per_token_group(a, as_)
    w1d, w2d = dequant_per_block(w1q, w1s, 128), dequant_per_block(w2q, w2s, 128)
    ref = torch.zeros(t, hidden)
    for ti in range(t):
        for kk in range(k):
            e = int(ids[ti, kk])
            hh = ad[ti] @ w1d[e].T
            act = torch.nn.functional.silu(hh[:inter]) * hh[inter:]
            ref[ti] += 1.5 * w[ti, kk] * (act @ w2d[e].T)
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    # rows quantized by the caller (a1_q) are what the GEMMs read, not hidden_states (zeros here)
    given = plugin_sbo.moe_forward(torch.zeros_like(x), w1q, w2q, w, ids, w1s, w2s, a1_q=a, a1_scale=as_,
                                   routed_scaling_factor=1.5, combine=combine)
    torch.testing.assert_close(given.float(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    # SGLang's quant and two row passes instead of the fused quant + dispatch kernel: the same rows
    unfused = plugin_sbo.moe_forward(x, w1q, w2q, w, ids, w1s, w2s, routed_scaling_factor=1.5, combine=combine,
                                     fused_quant=False)
    torch.testing.assert_close(unfused.float(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    assert plugin_sbo.ONE_GPU_COMBINE in plugin_sbo.COMBINE_MODES
    with pytest.raises(ValueError, match="combine"):
        plugin_sbo.moe_forward(x, w1q, w2q, w, ids, w1s, w2s, combine="both")
    # the gate_up GEMM on one program per tile (the grid past the tiles exits at once): the same bits
    grid = plugin_sbo.moe_forward(x, w1q, w2q, w, ids, w1s, w2s, routed_scaling_factor=1.5, combine=combine,
                                  gate_up_config={"programs_per_sm": 32})
    assert torch.equal(grid, out)


def test_moe_forward_hands_each_combine_mode_to_the_kernel(monkeypatch):
    """The four combine modes give the same sums (test above), so only the flags tell them apart: each mode reaches
    moe_down_and_combine as its own form (tail: the fused epilogue's grid-tail variant)."""
    from sgl_kernel_ext import sbo
    from sglang_h20.moe import sbo as plugin_sbo

    seen = []
    monkeypatch.setattr(sbo, "moe_down_and_combine", lambda *a, **kw: seen.append(
        {k: kw[k] for k in ("overlap", "fused", "tail")}) or a[6])
    ids, w = routing(3, 2, seed=52)
    x = torch.randn(3, 128, generator=gen(53)).to(torch.bfloat16)
    w1q, w1s, w2q, w2s = moe_weights(gen(54))
    for mode in ("tail", "fused", "overlap", "serial"):
        plugin_sbo.moe_forward(x, w1q, w2q, w, ids, w1s, w2s, combine=mode)
    assert seen == [{"overlap": False, "fused": True, "tail": True}, {"overlap": False, "fused": True, "tail": False},
                    {"overlap": True, "fused": False, "tail": False}, {"overlap": False, "fused": False, "tail": False}]


# ---------------------------------------------------------------------------------------------
# The plugin module
# ---------------------------------------------------------------------------------------------
def test_feature_line_and_hook_targets_resolve():
    from sglang_h20 import compat
    from sglang_h20.features import FEATURES
    from sglang_h20.moe import sbo as plugin_sbo

    f = next(f for f in FEATURES if f.name == "sbo")
    assert f.module == "sglang_h20.moe.sbo" and "sgl_kernel_ext.sbo" in f.kernel_modules
    names = [x.name for x in FEATURES]
    assert names.index("swapab") < names.index("sbo")  # sbo's fused_experts hook wraps swapab's (module doc)
    assert plugin_sbo.TRITON_MOE == __import__("sglang_h20.moe.swapab", fromlist=["x"]).TRITON_MOE
    for target in plugin_sbo.ALL_TARGETS:
        assert compat.check_target(target) == (True, target)


def fake_gpu(monkeypatch, cap, name="Fake"):
    from sglang_h20 import compat

    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu(name, cap, 80.0))


def test_hooks_only_on_sm90(monkeypatch, caplog):
    from sglang_h20.moe import sbo as plugin_sbo
    from sglang_h20.settings import Settings

    from sglang_h20.features import Unsupported

    fake_gpu(monkeypatch, (10, 0))  # not SM90: no hooks; the reason is the feature's one line (test_fallback_matrix)
    with caplog.at_level(logging.INFO, logger="sglang_h20.sbo"):
        with pytest.raises(Unsupported, match=r"Fake \(sm_100, 80 GiB\) is not SM90"):
            plugin_sbo.hooks(Settings.from_env({"SGLANG_H20_SBO": "on"}))
    assert not caplog.records
    fake_gpu(monkeypatch, (9, 0))
    with caplog.at_level(logging.INFO, logger="sglang_h20.sbo"):
        targets = [h.target for h in plugin_sbo.hooks(Settings.from_env({"SGLANG_H20_SBO": "on"}))]
        assert not caplog.records  # the cost warning waits until the feature is on ...
        plugin_sbo.enabled(Settings.from_env({"SGLANG_H20_SBO": "on"}))
    assert targets == [t for t in plugin_sbo.ALL_TARGETS if t != plugin_sbo.SHARED_EXPERTS]  # no cap asked
    warned = [r for r in caplog.records if "hides 12-30% of the combine" in r.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING  # on SM90 the measured cost is said once
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_h20.sbo"):
        targets = [h.target for h in plugin_sbo.hooks(Settings.from_env({"SGLANG_H20_SBO": "on",
                                                                         "SGLANG_H20_SBO_SHARED_SMS": "1"}))]
    assert targets == list(plugin_sbo.ALL_TARGETS)  # the smallest cap, 1 program, is a cap
    assert [r.levelno for r in caplog.records if "caps our dense GEMMs only" in r.message] == [logging.WARNING]
    caplog.clear()
    plugin_sbo.hooks(Settings.from_env({"SGLANG_H20_SBO": "on", "SGLANG_H20_SBO_SHARED_SMS": "16",
                                        "SGLANG_H20_SWAPAB": "on"}))
    assert not caplog.records  # with swapab on the cap has our GEMMs to act on


def test_shared_experts_take_the_sm_budget_only_on_the_alt_stream(monkeypatch):
    """Hook 5: the shared experts' dense GEMMs are capped where they run beside the routed experts (the current
    stream is the layer's alt stream), nowhere else."""
    from sglang_h20 import dense_linear
    from sglang_h20.moe import sbo as plugin_sbo

    monkeypatch.setattr(plugin_sbo, "_shared_sms", 24)
    alt, main = object(), object()
    current = [main]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current[0])
    moe = types.SimpleNamespace(alt_stream=alt)
    x = types.SimpleNamespace(is_cuda=True)

    def original(self, hidden_states, *args, **kwargs):
        return dense_linear._sm_budget.get(), args, kwargs

    assert plugin_sbo.shared_experts_hook(original, moe, x, "alloc", pre_quant_input=None) == \
        (None, ("alloc",), {"pre_quant_input": None})  # main stream: not beside anything
    current[0] = alt
    assert plugin_sbo.shared_experts_hook(original, moe, x)[0] == 24
    assert dense_linear._sm_budget.get() is None  # the cap ends with the call
    assert plugin_sbo.shared_experts_hook(original, types.SimpleNamespace(alt_stream=None), x)[0] is None


def test_init_hook_lifts_the_sm90_refusal(monkeypatch):
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang_h20.moe import sbo as plugin_sbo

    seen = []

    def original(server_args):  # what upstream does on SM90 with the flag
        seen.append(server_args.enable_single_batch_overlap)
        if server_args.enable_single_batch_overlap:
            raise ValueError("SBO (single batch overlap) is not supported on SM90 GPUs")
        moe_utils.get_flags().moe.sbo_enabled = False

    args = types.SimpleNamespace(enable_single_batch_overlap=True)
    fake_gpu(monkeypatch, (9, 0))
    plugin_sbo.init_moe_config_hook(original, args)
    assert seen == [False] and args.enable_single_batch_overlap is True
    assert moe_utils.get_flags().moe.sbo_enabled is True
    assert plugin_sbo.combine_down_flag_hook(lambda cls: True, object) is False
    fake_gpu(monkeypatch, (10, 0))  # elsewhere: upstream as called
    with pytest.raises(ValueError):
        plugin_sbo.init_moe_config_hook(original, args)
    assert plugin_sbo.combine_down_flag_hook(lambda cls: True, object) is True
    moe_utils.get_flags().moe.sbo_enabled = False


@pytest.mark.parametrize("runner, a2a, noted", [("triton", "none", False), (None, None, False),
                                                 ("deep_gemm", "none", True), ("triton", "deepep", True)])
def test_the_moe_path_line_names_a_runner_or_all_to_all_our_combine_never_serves(runner, a2a, noted):
    """Either a runner other than triton (auto counts as triton) or an all-to-all keeps the down-GEMM combine
    upstream: one line, naming both."""
    from sglang_h20.moe import sbo as plugin_sbo

    plugin_sbo._note.clear()
    plugin_sbo._note_moe_path(types.SimpleNamespace(moe_runner_backend=runner, moe_a2a_backend=a2a))
    lines = [r for r in plugin_sbo._note.seen if r.startswith("the MoE runner")]
    assert lines == ([f"the MoE runner {runner} with all-to-all {a2a} (the down-GEMM combine is ours only on the "
                      f"triton runner without all-to-all)"] if noted else [])
    plugin_sbo._note.clear()
    # the resolved runners that reach the down-GEMM combine (runner_check's question): triton only
    assert plugin_sbo.runner_served("triton", "none") and not plugin_sbo.runner_served("deep_gemm", "none")


def test_triton_hook_declines_to_original_off_cuda():
    from sglang_h20.moe import sbo as plugin_sbo

    calls = []
    cfg = types.SimpleNamespace(activation="silu", is_gated=True, gemm1_alpha=None, gemm1_clamp_limit=None,
                                no_combine=False, apply_router_weight_on_input=False, inplace=False,
                                routed_scaling_factor=None)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    w1, w1s, w2, w2s = moe_weights(gen(60))
    ids, w = routing(2, 2, seed=60)
    r = plugin_sbo.fused_experts_hook(lambda *a, **kw: calls.append(kw) or "upstream", x, w1, w2, (w, ids, None), cfg,
                                      use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128])
    assert r == "upstream" and calls[0]["block_shape"] == [128, 128]


def past_the_shape_checks(monkeypatch, fused_sum: bool) -> None:
    """The triton hook's shape and dtype checks answer 'supported', no piecewise graph is capturing, and SGLang's
    fused MoE sum + all-reduce is `fused_sum`: the hook's remaining checks decide (EP size, the fused sum)."""
    from sglang_h20.moe import sbo as plugin_sbo
    from sglang_h20.moe import swapab

    flags = types.SimpleNamespace(get_exec=lambda: types.SimpleNamespace(
        moe=types.SimpleNamespace(enable_fused_moe_sum_all_reduce=fused_sum)))
    monkeypatch.setattr(swapab, "moe_unsupported", lambda *a: None)
    monkeypatch.setattr(swapab, "_modules", lambda: (flags, None))
    monkeypatch.setattr(plugin_sbo, "_in_piecewise_graph", lambda: False)


def test_triton_hook_sends_expert_parallel_and_fused_all_reduce_calls_upstream(monkeypatch):
    """Past the device check (a GPU-looking input here): any EP size above 1 goes upstream (top-k ids may be -1
    there), and at EP 1 so does SGLang's fused sum + all-reduce; inside a piecewise CUDA graph the call goes upstream
    before either check; each reason is noted."""
    from sglang_h20.moe import sbo as plugin_sbo

    assert plugin_sbo._ep_size() == 1  # no process group here (tests, a single process): EP 1, nothing declined
    past_the_shape_checks(monkeypatch, fused_sum=True)
    x = types.SimpleNamespace(is_cuda=True, shape=(16, 7168))
    ids, w = routing(16, 8, seed=61, experts=16)  # 8 (token, expert) pairs per expert: a size ours serves
    w1 = torch.empty(16, 1)
    plugin_sbo._note.clear()
    for ep, reason in ((2, "expert parallelism"), (1, "fused sum + all-reduce")):
        monkeypatch.setattr(plugin_sbo, "_ep_size", lambda ep=ep: ep)
        calls = []
        r = plugin_sbo.fused_experts_hook(lambda *a, **kw: calls.append(a) or "upstream", x, w1, None, (w, ids, None),
                                          types.SimpleNamespace())
        assert r == "upstream" and calls[0][0] is x
        assert any(reason in seen for seen in plugin_sbo._note.seen), plugin_sbo._note.seen
    # inside a piecewise/breakable CUDA graph (not compiling): upstream for that reason, before the EP check
    plugin_sbo._note.clear()
    monkeypatch.setattr(plugin_sbo, "_in_piecewise_graph", lambda: True)
    r = plugin_sbo.fused_experts_hook(lambda *a, **kw: "upstream", x, w1, None, (w, ids, None), types.SimpleNamespace())
    assert r == "upstream" and plugin_sbo._note.seen == {"MoE under torch.compile or a piecewise/breakable CUDA graph"}
    plugin_sbo._note.clear()


def test_size_limits_of_the_triton_hook():
    """Ours serves decode sizes up to the GPU's cap of (token, expert) pairs per expert, where the whole layer
    measured faster than upstream's; above, and above MAX_TOKENS, the call goes upstream with its reason."""
    from sglang_h20.moe import sbo as plugin_sbo

    cap = plugin_sbo.TUNED["h200"].max_pairs_per_expert
    assert plugin_sbo.DEFAULT_TUNED == plugin_sbo.TUNED["h200"]  # the state every test here starts from
    assert plugin_sbo.size_unsupported(16, 16 * 8, 16) is None  # dsv3-ep16-slice at batch 16: 8 per expert
    assert "tokens per expert" in plugin_sbo.size_unsupported(32, 32 * 8, 16)  # 16 per expert
    assert plugin_sbo.size_unsupported(64, 64 * 8, 256) is None  # the whole 256-expert layer at batch 64
    assert "tokens per expert" in plugin_sbo.size_unsupported(56, 56 * 8, 16)  # 28 per expert
    assert plugin_sbo.size_unsupported(2, cap * 4, 4) is None
    assert str(cap) in plugin_sbo.size_unsupported(2, cap * 4 + 1, 4)
    assert "above 256 tokens" in plugin_sbo.size_unsupported(plugin_sbo.MAX_TOKENS + 1, 8, 4096)
    assert plugin_sbo.size_unsupported(plugin_sbo.MAX_TOKENS, 8, 4096) is None  # the edge itself is served
    from sglang_h20.settings import SWITCHES  # the switch's help quotes the cap (a literal there: no torch import)
    caps = {key: t.max_pairs_per_expert for key, t in plugin_sbo.TUNED.items()}
    assert (f"up to {caps['h200']} tokens per expert on the H200, {caps['h100']} on the H100" in
            next(s.help for s in SWITCHES if s.name == "sbo"))
    other = plugin_sbo.DEFAULT_TUNED.max_pairs_per_expert
    assert f"other GPUs: {other})" in next(s.help for s in SWITCHES if s.name == "sbo")


@pytest.mark.parametrize("name, override, cap", [("NVIDIA H200", "0", 8), ("NVIDIA H100 80GB HBM3", "0", 4),
                                                 ("NVIDIA H20", "0", 8), ("NVIDIA H100 80GB HBM3", "6", 6),
                                                 ("NVIDIA H100 PCIe", "0", 8), ("NVIDIA H200 NVL", "0", 8)])
def test_the_pairs_cap_follows_the_gpu(monkeypatch, caplog, name, override, cap):
    """The cap was measured per GPU (H200 8, H100 4: end to end, 8 per expert ran 1.011x SBO off on the H100);
    other GPUs take the H200's, an H100 PCIe or H200 NVL included (other bandwidth and clocks: another table key);
    SGLANG_H20_SBO_MAX_PER_EXPERT > 0 replaces it. The startup line says which."""
    from sglang_h20.moe import sbo as plugin_sbo
    from sglang_h20.settings import Settings

    fake_gpu(monkeypatch, (9, 0), name)
    monkeypatch.setattr(plugin_sbo, "_pairs_cap", -1)  # hooks() must set it
    settings = Settings.from_env({"SGLANG_H20_SBO": "on", "SGLANG_H20_SBO_MAX_PER_EXPERT": override})
    plugin_sbo.hooks(settings)
    assert plugin_sbo.size_unsupported(2 * cap, 2 * cap * 8, 16) is None  # batch 2 cap x top-8 over 16: cap each
    assert f"above {cap} tokens per expert" in plugin_sbo.size_unsupported(2 * cap + 1, (2 * cap + 1) * 8, 16)
    with caplog.at_level(logging.INFO, logger="sglang_h20.sbo"):
        plugin_sbo.enabled(settings)
    assert f"on this GPU ({name}) ours serves up to {cap} per expert" in caplog.text
    # the gate_up GEMM as one program per tile only where it was measured faster: the H100
    assert plugin_sbo._tuned.gate_up_config == ({"programs_per_sm": 32} if name.endswith("HBM3") else None)


def test_the_cap_says_where_it_was_measured():
    """The doctor's line claims a measurement only for the parts it was made on (the SXM H100 and the H200)."""
    from sglang_h20.moe import sbo as plugin_sbo

    assert ("our MoE path up to 4 tokens per expert (measured end to end on the H100)"
            in plugin_sbo.describe_cap("NVIDIA H100 80GB HBM3"))
    assert "up to 8 tokens per expert (measured end to end on the H200)" in plugin_sbo.describe_cap("NVIDIA H200")
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA H20"):
        assert plugin_sbo.measured_on(other) is None
        assert "up to 8 tokens per expert (the H200's, not measured on this GPU)" in plugin_sbo.describe_cap(other)
    assert "up to 3 tokens per expert (SGLANG_H20_SBO_MAX_PER_EXPERT=3)" in plugin_sbo.describe_cap("NVIDIA H200", 3)


def test_shared_overlap_declines_where_unsafe():
    from sglang_h20.moe import sbo as plugin_sbo

    x = torch.zeros(3, 8)
    moe = types.SimpleNamespace(shared_experts=object(), num_fused_shared_experts=0, alt_stream=None, tp_size=1)
    assert "alt stream" in plugin_sbo.shared_unsupported(moe, x, False)
    assert "skip_shared_experts" in plugin_sbo.shared_unsupported(moe, x, True)
    moe.num_fused_shared_experts = 1
    assert "fused" in plugin_sbo.shared_unsupported(moe, x, False)
    calls = []
    r = plugin_sbo.forward_normal_hook(lambda *a, **kw: calls.append(kw) or "upstream", moe, x)
    assert r == "upstream" and calls == [{"input_ids_global": None, "skip_shared_experts": False}]


def test_shared_overlap_reasons_past_the_stream_check(monkeypatch):
    """On a GPU the checks after 'alt stream / off CUDA' decide: each alone sends the call upstream, and a TP-1
    shared expert (or one SGLang keeps at TP 1) with an alt stream and rows is served."""
    from sglang_h20.moe import sbo as plugin_sbo

    monkeypatch.setattr(plugin_sbo, "_in_piecewise_graph", lambda: False)
    gpu_rows = types.SimpleNamespace(is_cuda=True, shape=(3, 8))
    moe = types.SimpleNamespace(shared_experts=object(), num_fused_shared_experts=0, alt_stream=object(), tp_size=1)
    assert plugin_sbo.shared_unsupported(moe, gpu_rows, False) is None
    assert "off CUDA" in plugin_sbo.shared_unsupported(moe, torch.zeros(3, 8), False)
    assert "empty" in plugin_sbo.shared_unsupported(moe, types.SimpleNamespace(is_cuda=True, shape=(0, 8)), False)
    # prefills above MAX_TOKENS keep upstream's in-line shared experts; the decode sizes, the edge included, overlap
    edge = plugin_sbo.MAX_TOKENS
    assert plugin_sbo.shared_unsupported(moe, types.SimpleNamespace(is_cuda=True, shape=(edge, 8)), False) is None
    assert (f"above {edge} tokens" in
            plugin_sbo.shared_unsupported(moe, types.SimpleNamespace(is_cuda=True, shape=(edge + 1, 8)), False))
    moe.tp_size = 2
    assert "TP all-reduce" in plugin_sbo.shared_unsupported(moe, gpu_rows, False)
    moe._shared_expert_tp1 = True
    assert plugin_sbo.shared_unsupported(moe, gpu_rows, False) is None
    monkeypatch.setattr(plugin_sbo, "_in_piecewise_graph", lambda: True)
    assert "piecewise" in plugin_sbo.shared_unsupported(moe, gpu_rows, False)



def test_resident_programs_cached(monkeypatch):
    """The static tail's residency count compiles (warms up) the kernel once per compile-relevant arguments, not on
    every eager call; per SM the least of registers, shared memory and threads (an H200's numbers)."""
    warmups = []

    class Compiled:
        n_regs, metadata = 120, types.SimpleNamespace(shared=55296)

    class Kernel:
        fn = types.SimpleNamespace(__name__="fake_kernel_for_the_cache_test")

        def warmup(self, *pos, grid, **kw):
            warmups.append(kw)
            return Compiled()

    props = types.SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                                  max_threads_per_multi_processor=2048, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    k = Kernel()
    first = gg._resident_programs(k, [1, 2.0], {"BLOCK_T": 16, "num_warps": 4}, "cuda:0")
    assert first == 4 * 132  # registers 65536 // (4 warps x 3840) = 4, shared memory 233472 // 56320 = 4
    assert gg._resident_programs(k, [1, 2.0], {"BLOCK_T": 16, "num_warps": 4}, "cuda:0") == first
    assert len(warmups) == 1
    gg._resident_programs(k, [1, 2.0], {"BLOCK_T": 32, "num_warps": 4}, "cuda:0")
    assert len(warmups) == 2


def test_triton_hook_serves_and_logs_each_call_size_once(monkeypatch, caplog):
    """Past every decline (a GPU-looking input, EP 1, no fused all-reduce): ours runs the call, with the tail combine,
    and says so once per call size, so a server log shows which MoE sizes SBO served (swapab_e2e counts the lines)."""
    from sglang_h20.moe import sbo as plugin_sbo
    from sglang_h20.moe import swapab

    past_the_shape_checks(monkeypatch, fused_sum=False)
    monkeypatch.setattr(swapab, "output_like", lambda x, inplace: "out")
    monkeypatch.setattr(plugin_sbo, "_ep_size", lambda: 1)
    served = []
    monkeypatch.setattr(plugin_sbo, "moe_forward", lambda *a, **kw: served.append(kw) or "ours")
    cfg = types.SimpleNamespace(inplace=False, routed_scaling_factor=2.5)
    w1 = torch.empty(16, 1)
    plugin_sbo._served.clear()
    with caplog.at_level(logging.INFO, logger="sglang_h20.sbo"):
        for tokens in (16, 16, 4):
            ids, w = routing(tokens, 8, seed=tokens, experts=16)
            x = types.SimpleNamespace(is_cuda=True, shape=(tokens, 7168))
            got = plugin_sbo.fused_experts_hook(lambda *a, **kw: "upstream", x, w1, None, (w, ids, None), cfg)
            assert got == "ours"
    assert [kw["combine"] for kw in served] == [plugin_sbo.ONE_GPU_COMBINE] * 3
    assert {kw["routed_scaling_factor"] for kw in served} == {2.5} and served[0]["out"] == "out"
    assert [r.getMessage() for r in caplog.records] == [
        f"sbo: MoE {t} tokens x top-8 over 16 experts -> ours ({plugin_sbo.ONE_GPU_COMBINE} combine in the down GEMM)"
        for t in (16, 4)]
    assert [kw["gate_up_config"] for kw in served] == [None] * 3  # the H200's tiles: the table's
    # the H100's tuning: its gate_up config reaches moe_forward, and the served line names it
    monkeypatch.setattr(plugin_sbo, "_tuned", plugin_sbo.TUNED["h100"])
    plugin_sbo._served.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_h20.sbo"):
        plugin_sbo.fused_experts_hook(lambda *a, **kw: "upstream", x, w1, None, (w, ids, None), cfg)
    assert served[-1]["gate_up_config"] == {"programs_per_sm": 32}
    assert caplog.records[0].getMessage().endswith("in the down GEMM; gate_up config {'programs_per_sm': 32})")
    plugin_sbo._served.clear()
