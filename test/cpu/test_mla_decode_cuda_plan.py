"""The CUDA MLA kernels' split plan (mla_decode_cuda.get_mla_decode_metadata): whole waves of one CTA per SM.

The Triton kernel's plan asks for 2 waves' worth of programs, which for a kernel with one CTA per SM leaves a
short last wave (batch 16 x 128 heads: 9 splits = 288 CTAs = 3 waves on 132 SMs, the last a sixth full) and
writes fp32 partials where no split is needed (batch 64: 128 CTAs fill the GPU unsplit). No GPU needed."""
import importlib

import pytest
import torch

cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
mla = importlib.import_module("sgl_kernel_ext.mla_decode")


def splits(batch, ctx, heads, q_len=1, sms=132):
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return cu.get_mla_decode_metadata(lens, heads, q_len, sms, max_seqlen=ctx).num_splits


@pytest.mark.parametrize("batch,ctx,heads,want", [
    (64, 4096, 128, 1), (128, 16384, 128, 1), (16, 4096, 128, 4), (16, 16384, 128, 4),  # 128 CTAs: one wave
    (64, 4096, 16, 2), (1, 4096, 128, 32), (1, 16384, 128, 64),  # batch 1: splits of 2 tiles, at most 64
])
def test_whole_waves(batch, ctx, heads, want):
    assert splits(batch, ctx, heads) == want


def test_never_worse_than_the_triton_plan_in_the_model():
    for batch in (1, 2, 8, 16, 33, 64, 100, 128, 256):
        for ctx in (64, 200, 1024, 4096, 16384, 65536):
            for heads, q_len in ((16, 1), (128, 1), (128, 2)):
                lens = torch.full((batch,), ctx, dtype=torch.int32)
                ours = cu.get_mla_decode_metadata(lens, heads, q_len, 132, max_seqlen=ctx)
                theirs = mla.get_mla_decode_metadata(lens, heads, q_len, 132, max_seqlen=ctx)
                programs, tiles = batch * ours.num_row_blocks, -(-ctx // cu.PAGE_SIZE)
                assert 1 <= ours.num_splits <= max(1, tiles // cu.MIN_SPLIT_TILES)
                assert (cu.split_cost(programs, tiles, ours.num_splits, 132)
                        <= cu.split_cost(programs, tiles, min(theirs.num_splits, tiles), 132))


def test_split_cost_counts_waves_and_the_split_overhead():
    assert cu.split_cost(128, 64, 1, 132) == 64  # one wave, no partials
    assert cu.split_cost(128, 64, 3, 132) == 3 * (22 + cu.SPLIT_COST_TILES)  # 384 CTAs: 3 waves
    assert cu.split_cost(32, 64, 9, 132) == 3 * (8 + cu.SPLIT_COST_TILES)  # 288 CTAs: 3 waves, the last short
    assert cu.split_cost(133, 64, 1, 132) == 2 * 64 and cu.split_cost(264, 64, 1, 132) == 2 * 64  # 1 CTA over: 2


@pytest.mark.parametrize("heads,q_len,batch,rows_per_cta", [(128, 1, 1, 64), (128, 2, 4, 64), (16, 1, 2, 16),
                                                            (128, 1, 16, 32), (16, 2, 64, 32)])
def test_split_table_is_the_planner_at_every_length(heads, q_len, batch, rows_per_cta):
    """splits_lut's entry t (a CUDA graph replay's longest sequence of t pages) is get_mla_decode_metadata's split
    count for that length, every t up to the captured context; entry 0 is entry 1."""
    max_seqlen = 300 * cu.PAGE_SIZE + 5
    lut = cu.splits_lut(heads, q_len, batch, max_seqlen, num_sm=132, rows_per_cta=rows_per_cta)
    assert lut.shape == (302,) and lut.dtype == torch.int32 and int(lut[0]) == int(lut[1])
    lens = torch.ones(batch, dtype=torch.int32)
    for t in range(1, 302):
        want = cu.get_mla_decode_metadata(lens, heads, q_len, 132, max_seqlen=t * cu.PAGE_SIZE,
                                          rows_per_cta=rows_per_cta).num_splits
        assert int(lut[t]) == want, t
    assert int(lut.max()) > 1  # the lengths reach split plans


def test_plan_fields_match_the_kernel():
    lens = torch.tensor([5, 4000, 64], dtype=torch.int32)
    m = cu.get_mla_decode_metadata(lens, 128, 2, 132)  # max_seqlen read from the lengths
    assert (m.block_h, m.block_n, m.num_row_blocks, m.num_sm) == (64, 64, 4, 132)


def test_launch_args_follow_the_c_signature_and_pass_the_split_count_pointer():
    """The ctypes call against the C entry point (csrc/mla_fp8_sm90_common.cuh): as many arguments as its
    parameters, each of the declared kind, and the run-time split count pointer null unless metadata carries one
    and the launch splits (a wrong pointer there cuts sequences into the wrong number of splits)."""
    import ctypes
    import dataclasses
    import re

    src = (cu.source_path(1).parent / "mla_fp8_sm90_common.cuh").read_text()
    sig = re.search(r"#define MLA_FP8_ENTRY_PARAMS(.*?)\n#define", src, re.S).group(1)
    params = [p.replace("\\", " ").replace("*", " ").split()[-1] for p in sig.split(",")]
    args = re.search(r"#define MLA_FP8_ENTRY_ARGS(.*?)\n#define", src, re.S).group(1)
    assert [a.replace("\\", " ").strip() for a in args.split(",")] == params  # launch() gets them in this order
    assert len(params) == len(cu.LAUNCH_ARGTYPES) and params[28] == "splits" and params[27] == "num_splits"
    assert params[23] == "kv_pages"  # v2's TMA tensor map needs the cache's extent

    B, T, H = 2, 1, 16
    kv = torch.zeros(3, 64, 576, dtype=torch.uint8)
    kvs = torch.zeros(3, 64, 2)
    bt, sl = torch.zeros(B, 3, dtype=torch.int32), torch.tensor([70, 130], dtype=torch.int32)
    out, lse = torch.zeros(B, T, H, 512, dtype=torch.bfloat16), torch.zeros(B, T, H)
    q8, qs = torch.zeros(B * T * H, 576, dtype=torch.uint8), torch.zeros(B * T * H, 2)
    op, lp = torch.zeros(B, T * H, 3, 512), torch.zeros(B, T * H, 3)
    meta = cu.get_mla_decode_metadata(sl, H, T, 132, max_seqlen=4096)
    meta = dataclasses.replace(meta, num_splits=3)
    dyn = dataclasses.replace(meta, splits_dev=torch.ones(1, dtype=torch.int32))
    kinds = {ctypes.c_void_p: int, ctypes.c_longlong: int, ctypes.c_int: int, ctypes.c_float: float}
    for m, split_ops, want in ((meta, (op, lp), 0), (dyn, (op, lp), dyn.splits_dev.data_ptr()), (dyn, (None, None), 0)):
        args = cu.launch_args(q8, qs, kv, kvs, bt, sl, out, lse, *split_ops, m, True, 0.1, 0)
        assert len(args) == len(cu.LAUNCH_ARGTYPES)
        assert all(isinstance(a, kinds[t]) for a, t in zip(args, cu.LAUNCH_ARGTYPES))
        assert args[28] == want and args[5] == sl.data_ptr() and args[23:28] == (3, B, H, T, 3)
        assert (args[6] == 0) == (split_ops[0] is not None)  # bf16 out only on the direct path
    assert params[31:36] == ["q_rope", "q_sb", "q_sh", "qr_sb", "qr_sh"] and params[-1] == "stream"
    rope = torch.zeros(B, 1, H, 64, dtype=torch.bfloat16)
    args = cu.launch_args(q8, qs, kv, kvs, bt, sl, out, lse, None, None, meta, True, 0.1, 7,
                          (rope, 1024, 64, 2048, 128))
    assert args[31:36] == (rope.data_ptr(), 1024, 64, 2048, 128) and args[-1] == 7
    assert cu.launch_args(q8, qs, kv, kvs, bt, sl, out, lse, None, None, meta, True, 0.1, 7)[31:36] == (0,) * 5


@pytest.mark.parametrize("planner", ["cuda", "triton"])
@pytest.mark.parametrize("batch", [1, 4, 16, 48, 64, 128])
def test_graph_grid_holds_at_most_max_waves(planner, batch):
    """A CUDA graph's grid is planned for the model's context, then capped at GRAPH_MAX_WAVES waves of programs
    (idle programs cost SM time at short lengths); below the cap it is the planner's grid, unchanged."""
    plan, lut = ((cu.get_mla_decode_metadata, cu.splits_lut) if planner == "cuda"
                 else (mla.get_mla_decode_metadata, mla.splits_lut))
    page = 64 if planner == "cuda" else 16
    meta, table = mla.graph_metadata(plan, lut, batch, 128, 1, 163840, page, "cpu")
    full = plan(torch.ones(batch, dtype=torch.int32), 128, 1, max_seqlen=163840)
    programs = batch * meta.num_row_blocks * (512 // meta.block_v)
    waves = programs * meta.num_splits / meta.num_sm
    assert meta.num_splits == min(full.num_splits, max(1, mla.GRAPH_MAX_WAVES * meta.num_sm // programs))
    assert waves <= mla.GRAPH_MAX_WAVES or meta.num_splits == 1
    assert (meta.splits_dev is not None) == (meta.num_splits > 1) == (table is not None)
    if planner == "cuda" and batch in (16, 128):  # the grids the H200 run measured as costly: 33 and 17 splits
        assert full.num_splits > meta.num_splits


def test_version_3_row_blocks_are_planned_as_such():
    """Version 3 runs 32-row CTAs (cta_rows): 128 heads are 4 CTAs per sequence and split, so its plan equals the
    64-row plan of twice the rows, in the lookup table as in the planner; up to 32 rows one CTA either way."""
    assert [cu.cta_rows(3, r) for r in (1, 16, 17, 32, 128)] == [16, 16, 32, 32, 32]
    assert cu.cta_rows(1, 128) == cu.cta_rows(2, 16) == cu.ROWS_PER_CTA
    lens = torch.full((16,), 4096, dtype=torch.int32)
    v3 = cu.get_mla_decode_metadata(lens, 128, 1, 132, max_seqlen=4096, rows_per_cta=32).num_splits
    assert v3 == cu.get_mla_decode_metadata(lens, 256, 1, 132, max_seqlen=4096).num_splits == 2  # 64 CTAs x 2
    assert v3 < splits(16, 4096, 128)  # 32 CTAs of 64 rows: 4 splits
    lut = cu.splits_lut(128, 1, 16, 4096, rows_per_cta=32)
    assert int(lut[-1]) == v3 and torch.equal(lut, cu.splits_lut(256, 1, 16, 4096))
    assert splits(16, 4096, 16) == cu.get_mla_decode_metadata(lens, 16, 2, 132, max_seqlen=4096,
                                                              rows_per_cta=32).num_splits
    # a CUDA graph's plan caps its waves by the kernel's own CTAs per split (64 here, not the 32 of 64-row blocks)
    plan, lut = cu.planners(3)
    meta = plan(lens, 128, 1, 132, max_seqlen=4096)
    assert (meta.block_h, meta.num_row_blocks) == (32, 4)
    meta, _ = mla.graph_metadata(plan, lut, 16, 128, 1, 163840, 64, "cpu")
    assert meta.num_splits == mla.GRAPH_MAX_WAVES * 132 // (16 * 4)


def test_planners_plan_for_the_ctas_of_the_version_that_runs():
    """planners(version): a fixed version plans every call for its own CTAs (v1 / v2: 64 rows; v3: 16 up to 16 rows,
    else 32); with version(batch, rows) each call for the version its shape picks, planner and split table alike."""
    lens = torch.full((4,), 16384, dtype=torch.int32)
    for version, heads, block_h in ((1, 128, 64), (2, 16, 64), (3, 16, 16), (3, 128, 32)):
        plan, lut = cu.planners(version)
        meta = plan(lens, heads, 1, 132, max_seqlen=16384)
        assert meta == cu.get_mla_decode_metadata(lens, heads, 1, 132, max_seqlen=16384, rows_per_cta=block_h)
        assert torch.equal(lut(heads, 1, 4, 16384, num_sm=132),
                           cu.splits_lut(heads, 1, 4, 16384, num_sm=132, rows_per_cta=block_h))
    by_batch = lambda batch, rows: 3 if batch < 8 else 2  # noqa: E731  (the backend's 'auto' at 128 heads)
    plan, lut = cu.planners(by_batch)
    small, big = torch.full((4,), 16384, dtype=torch.int32), torch.full((8,), 16384, dtype=torch.int32)
    assert plan(small, 128, 1, 132, max_seqlen=16384) == cu.planners(3)[0](small, 128, 1, 132, max_seqlen=16384)
    assert plan(big, 128, 1, 132, max_seqlen=16384) == cu.planners(2)[0](big, 128, 1, 132, max_seqlen=16384)
    # batch 4 at 128 heads: four 32-row CTAs per sequence plan other splits than two of 64 would
    assert plan(small, 128, 1, 132, max_seqlen=16384).num_splits != \
        cu.get_mla_decode_metadata(small, 128, 1, 132, max_seqlen=16384).num_splits
    assert torch.equal(lut(128, 1, 4, 16384, num_sm=132), cu.planners(3)[1](128, 1, 4, 16384, num_sm=132))
    assert torch.equal(lut(128, 1, 8, 16384, num_sm=132), cu.planners(2)[1](128, 1, 8, 16384, num_sm=132))
    # MTP: the query rows per sequence are heads x q_len (16 heads x 2 = 32 rows: version 3's 32-row CTAs);
    # the planner's q_len defaults to 1, as get_mla_decode_metadata's does
    seen = []
    plan, lut = cu.planners(lambda batch, rows: seen.append(rows) or 3)
    assert plan(small, 16, 2, 132, max_seqlen=16384).block_h == 32
    assert torch.equal(lut(16, 2, 4, 16384, num_sm=132), cu.splits_lut(16, 2, 4, 16384, num_sm=132, rows_per_cta=32))
    assert plan(small, 16, num_sm=132, max_seqlen=16384).block_h == 16 and seen == [32, 32, 16]
