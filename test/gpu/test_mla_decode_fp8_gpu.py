"""FP8 MLA decode on a Hopper GPU at DeepSeek-V3's real shapes (page 64, 576/512 dims, outlier channels).

Error metric as in test/cpu/test_mla_decode_fp8.py: rel = ||out - ref||_F / ||ref||_F. Inputs are DeepSeek-like
(latent rows sharing a channel profile, RMS-normalised, five outlier channels x10..x30, rope part on its own scale).
Bounds:
  vs mla_decode_exact (bf16 inputs, fp32 math):     <= 2.5e-2   (the issue's example target is 2e-2)
  vs mla_decode_reference (dequantized FP8 inputs):  <= 1e-2    (P rounding only)
  worst (batch, query, head) row vs the reference:   <= 5e-2
  lse vs the reference (natural log):                <= 2e-2    (the reference keeps Q's FP8 rounding but the kernel's
                                                                  fp32 partial sums differ; measured up to 1.3e-2 on the
                                                                  H200 with FP8 PV; 2e-2 is a 2% change of a row's mass)
  odd lengths (1, 2, 63, 65, ...):                   vs exact <= 3e-2 (short rows average less)
Each case prints its errors (pytest -s) so that a run records them.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

mla = importlib.import_module("sgl_kernel_ext.mla_decode")

DEEPSEEK_LIKE = dict(shared=1.0, outlier_gains=(10.0, 15.0, 20.0, 25.0, 30.0), q_std=0.5)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def row_rel(a, b) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def lengths(batch: int, context: int, seed: int) -> list[int]:
    """Around `context`, not all multiples of the page: the first is exactly `context`, the rest within 10% below."""
    g = torch.Generator().manual_seed(seed)
    jitter = torch.randint(0, max(context // 10, 1), (batch,), generator=g)
    jitter[0] = 0
    return [int(context - j) for j in jitter]


def run_case(lens, heads, q_len, *, page=64, seed=0, **kw):
    d = mla.make_mla_inputs(lens, heads, q_len, page, device="cuda", seed=seed, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], heads, q_len)
    B = len(lens)
    out = torch.full((B, q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    o, lse = mla.mla_decode_fp8(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"],
                                meta, return_lse=True, out=out, **kw)
    torch.cuda.synchronize()
    args = (d["block_table"], d["cache_seqlens"], d["softmax_scale"])
    ref, ref_lse = mla.mla_decode_reference(d["q"], d["kv_cache"], *args)
    exact, _ = mla.mla_decode_exact(d["q"], d["latent_cache"], *args)
    return o, lse, ref, ref_lse, exact, meta


GRID = [(h, t, b, c) for h in (16, 128) for t in (1, 2) for b in (1, 16, 64) for c in (1024, 4096)]


@pytest.mark.parametrize("heads,q_len,batch,context", GRID, ids=[f"H{h}_T{t}_B{b}_ctx{c}" for h, t, b, c in GRID])
def test_real_shapes(heads, q_len, batch, context):
    lens = lengths(batch, context, seed=batch * 7 + context)
    o, lse, ref, ref_lse, exact, meta = run_case(lens, heads, q_len, seed=heads + q_len + batch + context)
    assert torch.isfinite(o.float()).all(), "NaN/Inf or an element left unwritten"
    assert torch.isfinite(lse).all()
    e_exact, e_ref, e_row = rel(o, exact), rel(o, ref), row_rel(o, ref).max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    print(f"\nH={heads} q_len={q_len} B={batch} ctx={context} splits={meta.num_splits}: rel vs exact {e_exact:.4f}, "
          f"vs reference {e_ref:.4f}, worst row {e_row:.4f}, lse {lse_err:.1e}")
    assert e_exact <= 2.5e-2
    assert e_ref <= 1e-2
    assert e_row <= 5e-2
    assert lse_err <= 2e-2


@pytest.mark.parametrize("heads", [16, 128])
def test_odd_lengths(heads):
    lens = [1, 2, 63, 64, 65, 127, 129, 1000, 1023, 4095, 4097, 5000]
    o, lse, ref, ref_lse, exact, meta = run_case(lens, heads, 2, seed=heads)
    assert torch.isfinite(o.float()).all()
    blind = ~torch.isfinite(ref_lse)  # length 1 with q_len 2: the first query sees nothing
    assert (o.float()[blind] == 0).all() and torch.equal(~torch.isfinite(lse), blind)
    print(f"\nodd lengths H={heads}: rel vs exact {rel(o, exact):.4f}, vs reference {rel(o, ref):.4f}")
    assert rel(o, exact) <= 3e-2
    assert rel(o, ref) <= 2e-2


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_mtp_lengths(q_len):
    o, _, ref, _, exact, _ = run_case(lengths(8, 2048, q_len), 128, q_len, seed=q_len)
    assert torch.isfinite(o.float()).all()
    print(f"\nq_len={q_len}: rel vs exact {rel(o, exact):.4f}, vs reference {rel(o, ref):.4f}")
    assert rel(o, exact) <= 2.5e-2 and rel(o, ref) <= 1e-2


@pytest.mark.parametrize("page", [32, 64, 128])
def test_page_sizes(page):
    o, _, ref, _, exact, _ = run_case([1, 300, 1111], 16, 1, page=page, seed=page)
    assert torch.isfinite(o.float()).all()
    assert rel(o, ref) <= 2e-2 and rel(o, exact) <= 3e-2


def test_page_smaller_than_tile_is_refused():
    with pytest.raises(AssertionError, match="must divide the page size"):
        run_case([100], 16, 1, page=16, seed=1)


@pytest.mark.parametrize("block_h,block_n,block_v,num_warps,num_stages,pv_16bit", [
    (64, 32, 512, 8, 2, True), (64, 64, 256, 8, 2, True), (64, 32, 128, 4, 2, True), (64, 32, 256, 8, 2, False),
    (64, 32, 128, 4, 2, False), (32, 32, 256, 4, 2, True)])
def test_tile_configs(block_h, block_n, block_v, num_warps, num_stages, pv_16bit):
    d = mla.make_mla_inputs(lengths(4, 1500, 1), 128, 2, 64, device="cuda", seed=9, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], 128, 2, block_h=block_h, block_n=block_n,
                                       block_v=block_v, num_warps=num_warps, num_stages=num_stages, pv_16bit=pv_16bit)
    o = mla.mla_decode_fp8(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"], meta)
    ref, _ = mla.mla_decode_reference(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"])
    assert torch.isfinite(o.float()).all() and rel(o, ref) <= 1e-2


def test_store_path_matches_quantize():
    g = torch.Generator(device="cuda").manual_seed(4)
    latent = (torch.randn(333, 576, generator=g, device="cuda") * 3).bfloat16()
    data = torch.zeros(16, 64, 576, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(16, 64, 2, device="cuda")
    loc = torch.randperm(16 * 64, generator=g, device="cuda")[:333]
    mla.store_kv_fp8(data, scales, loc, latent)
    q, s = mla.quantize_kv_fp8(latent)
    assert torch.allclose(scales.view(-1, 2)[loc], s, rtol=1e-6, atol=0)
    got = mla.dequantize_kv_fp8(data.view(-1, 576)[loc], scales.view(-1, 2)[loc])
    want = mla.dequantize_kv_fp8(q, s)
    assert rel(got, want) <= 1e-3  # identical up to an occasional last-bit tie in the fp32 division


def test_cuda_graph_replay():
    """With metadata fixed for a bucket (max_seqlen given: no host sync), the kernels capture and replay."""
    d = mla.make_mla_inputs([3000, 100, 2048, 700], 128, 1, 64, device="cuda", seed=21, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], 128, 1, max_seqlen=4096)
    q, kv, bt, sl = d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"].clone()
    out = torch.empty(4, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
    mla.mla_decode_fp8(q, kv, bt, sl, d["softmax_scale"], meta, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla.mla_decode_fp8(q, kv, bt, sl, d["softmax_scale"], meta, out=out)
    for lens in ([3000, 100, 2048, 700], [2999, 1, 1500, 64]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = mla.mla_decode_reference(q, kv, bt, sl, d["softmax_scale"])
        assert torch.isfinite(out.float()).all() and rel(out, ref) <= 2e-2


def test_bytes_per_token():
    assert mla.KV_BYTES_PER_TOKEN == 584 and math.isclose(584 / 1152, 0.507, abs_tol=1e-3)
