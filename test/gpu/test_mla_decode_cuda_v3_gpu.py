"""Version 3 of the CUDA FP8 MLA split kernel (tokens on wgmma's M side, V^T as a register operand; built for <= 32
query rows, more in blocks of 32) on a Hopper GPU: the same inputs, metrics and bounds as test_mla_decode_cuda_gpu.py, at the row counts it takes
(16 heads x q_len 1 and 2, 8 heads x q_len 1 and 3: padded columns), plus agreement with version 2 on the same
inputs and CUDA-graph replay with the run-time split count."""
from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

mla = importlib.import_module("sgl_kernel_ext.mla_decode")
cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
from gpu_checks import need_cuda_kernel  # noqa: E402

# the same inputs, metrics, bounds, and the autouse fixture that NaN-poisons the split partials
from test_mla_decode_cuda_gpu import _poison_workspace, check, emulate, replay_at, run_case  # noqa: E402
from test_mla_decode_fp8_gpu import DEEPSEEK_LIKE, lengths, rel, row_rel  # noqa: E402

FIXTURES = (_poison_workspace,)  # pytest finds the imported autouse fixture by its name in this module


@pytest.fixture(autouse=True)
def _v3_builds():
    """Every test here needs version 3: on a Hopper GPU a build error fails each of them (not the collection, so the
    other files' tests still run)."""
    need_cuda_kernel(*cu.available(3), "CUDA MLA kernel v3")


GRID = [(16, t, b, s) for t in (1, 2) for b in (1, 3, 64) for s in (1, None)]


@pytest.mark.parametrize("heads,q_len,batch,splits", GRID,
                         ids=[f"H{h}_T{t}_B{b}_S{s or 'auto'}" for h, t, b, s in GRID])
def test_shapes(heads, q_len, batch, splits):
    lens = lengths(batch, 4097 if batch < 64 else 1000, seed=batch + heads)
    if splits is None and batch < 64:
        splits = 5
    o, lse, ref, ref_lse, exact, meta, _ = run_case(lens, heads, q_len, seed=heads + q_len + batch, num_splits=splits,
                                                    version=3)
    check(o, lse, ref, ref_lse, exact, f"v3 H={heads} q_len={q_len} B={batch} splits={meta.num_splits}")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (16, 2), (8, 1), (8, 3)])
def test_odd_lengths_mixed(heads, q_len, splits):
    lens = [1, 63, 64, 65, 1000, 4097, 2, 127, 129]
    o, lse, ref, ref_lse, exact, meta, _ = run_case(lens, heads, q_len, seed=heads * 3 + q_len, num_splits=splits,
                                                    version=3)
    check(o, lse, ref, ref_lse, exact, f"v3 odd lengths H={heads} q_len={q_len} splits={splits}",
          exact_bound=3.5e-2, ref_bound=2.5e-2)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 1000, 4097])
def test_single_lengths(length):
    for splits in (1, 4):
        o, lse, ref, ref_lse, exact, _, _ = run_case([length], 16, 1, seed=length, num_splits=splits, version=3)
        check(o, lse, ref, ref_lse, exact, f"v3 length {length} splits={splits}", exact_bound=3.5e-2,
              ref_bound=2.5e-2)


@pytest.mark.parametrize("lens", [[16384], [16384] * 8, [20000, 16384, 9001, 70]], ids=["1x16k", "8x16k", "ragged"])
def test_long_sequences_one_split(lens):
    """Hundreds of tiles per CTA, where the two math warpgroups drift apart: the first build (one stage ring shared
    by both, each waiting only for its own tiles' phases) hung here (H100, B=128 x 16k), the short tests passed."""
    o, lse, ref, ref_lse, exact, _, _ = run_case(lens, 16, 1, seed=len(lens), num_splits=1, version=3)
    check(o, lse, ref, ref_lse, exact, f"v3 long {lens[:3]} one split")


@pytest.mark.parametrize("q_len", [1, 2])
def test_matches_emulation(q_len):
    """The kernel's own arithmetic in torch (test_mla_decode_cuda_gpu.emulate, one split): the same bound as
    versions 1 and 2. Version 3 sums P'V in another token order and owns tiles like version 2 (two chains)."""
    lens = [1, 63, 64, 65, 1000, 4097, 300]
    d = mla.make_mla_inputs(lens, 16, q_len, 64, device="cuda", seed=7 + q_len, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, q_len)
    meta = dataclasses.replace(meta, num_splits=1)
    o = cu.mla_decode_fp8_cuda(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"], meta,
                               version=3)
    emu = emulate(d)
    e, worst = rel(o, emu), row_rel(o, emu).max().item()
    print(f"\nv3 emulation q_len={q_len}: rel {e:.2e}, worst row {worst:.2e}")
    assert e <= 8e-3 and worst <= 5e-2


@pytest.mark.parametrize("q_len", [1, 2])
def test_agrees_with_version_2(q_len):
    """Same P' bytes in principle (the same tile ownership and running maxima), the sums in other orders: close."""
    need_cuda_kernel(*cu.available(2), "CUDA MLA kernel v2")
    d = mla.make_mla_inputs(lengths(12, 3000, 9), 16, q_len, 64, device="cuda", seed=13, **DEEPSEEK_LIKE)
    args = (d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"])
    for splits in (1, 3):
        meta = dataclasses.replace(cu.get_mla_decode_metadata(d["cache_seqlens"], 16, q_len), num_splits=splits)
        a, la = cu.mla_decode_fp8_cuda(*args, meta, return_lse=True, version=3)
        b, lb = cu.mla_decode_fp8_cuda(*args, meta, return_lse=True, version=2)
        torch.cuda.synchronize()
        print(f"\nv3 vs v2 q_len={q_len} splits={splits}: rel {rel(a, b):.2e}, lse {(la - lb).abs().max().item():.1e}")
        assert rel(a, b) <= 5e-3 and (la - lb).abs().max().item() <= 1e-3


def test_cuda_graph_replay_with_run_time_splits():
    """A graph captured at a long bound (grid of many splits), replayed at other lengths with the split count set on
    the device: equal to eager launches with that count, and to the reference."""
    lens = [3000, 100, 2048, 700]
    d = mla.make_mla_inputs(lens, 16, 1, 64, device="cuda", seed=23, **DEEPSEEK_LIKE)
    q, kv, bt, sl = d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"].clone()
    meta, lut = mla.graph_metadata(cu.get_mla_decode_metadata, cu.splits_lut, len(lens), 16, 1, 163840, 64, "cuda")
    grid = dataclasses.replace(meta, splits_dev=None)
    out = torch.empty(4, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    mla.set_splits(meta.splits_dev, lut, sl, 64)
    cu.mla_decode_fp8_cuda(q, kv, bt, sl, d["softmax_scale"], meta, out=out, version=3)  # build + warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cu.mla_decode_fp8_cuda(q, kv, bt, sl, d["softmax_scale"], meta, out=out, version=3)
    for step in ([3000, 100, 2048, 700], [2999, 1, 1500, 64], [64, 64, 64, 64]):
        want = replay_at(graph, out, sl, meta, lut, step)
        static = cu.mla_decode_fp8_cuda(q, kv, bt, sl, d["softmax_scale"],
                                        dataclasses.replace(grid, num_splits=want), version=3)
        torch.cuda.synchronize()
        if want > 1:
            assert torch.equal(out, static), (step, want)
        else:
            assert rel(out, static) <= 4e-3, (step, rel(out, static))
        ref, _ = mla.mla_decode_reference(q, kv, bt, sl, d["softmax_scale"])
        assert torch.isfinite(out.float()).all() and rel(out, ref) <= 2e-2


@pytest.mark.parametrize("gap_log2", [60, 400])
def test_tiles_far_below_the_row_max(gap_log2):
    """One sink token far above the rest: the lazy reference of O moves once, the other chain's O merges with a
    factor ~2^-gap (or 0) in the epilogue."""
    lens = [4097, 1000]
    d = mla.make_mla_inputs(lens, 16, 1, 64, device="cuda", seed=31, **DEEPSEEK_LIKE)
    latent, bt = d["latent_cache"], d["block_table"]
    q = d["q"].clone()
    q[..., 512:] = 1.0
    c = gap_log2 * math.log(2.0) / d["softmax_scale"] / 64.0
    for b in range(len(lens)):
        latent[bt[b, 0].item(), 5, 512:] = c
    d["kv_cache"] = mla.quantize_kv_fp8(latent.nan_to_num(0.0))
    kv8, kvs = d["kv_cache"]
    dead = ~torch.isfinite(latent.float()).all(-1)
    kv8.view(torch.uint8)[dead] = 0x7F
    kvs[dead] = float("nan")
    for splits in (1, 4):
        meta = dataclasses.replace(mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 1), num_splits=splits)
        o, lse = cu.mla_decode_fp8_cuda(q, d["kv_cache"], bt, d["cache_seqlens"], d["softmax_scale"], meta,
                                        return_lse=True, version=3)
        torch.cuda.synchronize()
        args = (bt, d["cache_seqlens"], d["softmax_scale"])
        ref, ref_lse = mla.mla_decode_reference(q, d["kv_cache"], *args)
        exact, _ = mla.mla_decode_exact(q, latent, *args)
        check(o, lse, ref, ref_lse, exact, f"v3 sink gap 2^{gap_log2} splits={splits}", exact_bound=1e-1)


ROW_BLOCKS = [(128, 1, 3, 1), (128, 1, 3, 4), (128, 2, 2, 3), (16, 3, 3, 2), (40, 1, 2, 1), (64, 1, 64, None)]


@pytest.mark.parametrize("heads,q_len,batch,splits", ROW_BLOCKS,
                         ids=[f"H{h}_T{t}_B{b}_S{s or 'auto'}" for h, t, b, s in ROW_BLOCKS])
def test_more_rows_run_as_blocks_of_32(heads, q_len, batch, splits):
    """Above 32 rows version 3 runs ceil(rows / 32) CTAs per sequence and split (session 34): 128 heads (4 blocks),
    q_len 2 (8), 48 rows (a half block), 40 heads (a block of 8 live rows); the same bounds as version 2, and the
    same output as version 2 within 2e-2."""
    lens = lengths(batch, 4097 if batch < 64 else 1000, seed=batch + heads + q_len)
    o, lse, ref, ref_lse, exact, meta, d = run_case(lens, heads, q_len, seed=heads + q_len, num_splits=splits,
                                                    version=3)
    check(o, lse, ref, ref_lse, exact, f"v3 row blocks H={heads} q_len={q_len} B={batch} splits={meta.num_splits}")
    o2 = cu.mla_decode_fp8_cuda(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"],
                                meta, version=2)
    assert rel(o, o2) <= 2e-2, rel(o, o2)


@pytest.mark.parametrize("q_len", [1, 2])
def test_fused_q_matches_the_prepass_build(q_len):
    """Version 3 quantizes Q in the kernel with the pre-pass's arithmetic: bit-identical to the MLA_PREPASS_Q build
    (Triton pre-pass + the loader's copy), one split and several."""
    ok, why = cu.available(3, ("MLA_PREPASS_Q",))
    assert ok, why
    d = mla.make_mla_inputs([1, 65, 3000, 700, 4097], 16, q_len, 64, device="cuda", seed=17 + q_len, **DEEPSEEK_LIKE)
    args = (d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"])
    for splits in (1, 3):
        meta = dataclasses.replace(cu.get_mla_decode_metadata(d["cache_seqlens"], 16, q_len), num_splits=splits)
        a, la = cu.mla_decode_fp8_cuda(*args, meta, return_lse=True, version=3)
        b, lb = cu.mla_decode_fp8_cuda(*args, meta, return_lse=True, version=3, defines=("MLA_PREPASS_Q",))
        torch.cuda.synchronize()
        assert torch.equal(a, b) and torch.equal(la, lb), splits
