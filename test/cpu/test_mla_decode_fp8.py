"""FP8 MLA decode (sgl_kernel_ext.mla_decode) at tiny shapes, on the Triton interpreter when there is no GPU.

Error metric: rel = ||out - ref||_F / ||ref||_F over the whole output. The bounds follow from e4m3's 3 mantissa
bits: one rounding carries ~2.7% rms relative error (2^-3/sqrt(12) over a binade). Measured values are from this
file's seeded inputs (generated on the CPU, so the same numbers everywhere).

* kernel vs mla_decode_reference (fp32 math on the dequantized cache and Q): only the FP8 rounding of P (and the
  bf16 output) differs. DeepSeek-like inputs (latent rows sharing a channel profile, five outlier channels
  x10..x30): measured 0.8-1.3%, asserted <= 2e-2. i.i.d. zero-mean tokens, the worst case (no common component:
  the rounding errors are as large as the signal allows): asserted <= 3.5e-2. lse: fp32 summation order only,
  asserted <= 1e-4.
* kernel vs mla_decode_exact (fp32 on the bf16 inputs): adds the FP8 rounding of Q, K and V (one scale per token
  for the 512 latent channels, one for the 64 rope channels). DeepSeek-like asserted <= 3e-2; i.i.d. <= 6.5e-2.
The measured values are printed (pytest -s) by each test.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel module is imported. Without a
# GPU, interpret; if another test module imported the kernels compiled already, re-import them interpreted.
if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "sgl_kernel_ext.mla_decode" in sys.modules:
        importlib.reload(sys.modules["sgl_kernel_ext.mla_decode"])

import pytest  # noqa: E402

import sgl_kernel_ext  # noqa: E402

# the module, not the function of the same name that the package exports (`import a.b as c` would bind that)
mla = importlib.import_module("sgl_kernel_ext.mla_decode")

DEVICE = "cpu" if mla._INTERPRETED else "cuda"
DEEPSEEK_LIKE = dict(shared=1.0, outlier_gains=(10.0, 15.0, 20.0, 25.0, 30.0), q_std=0.5)
IID = dict(shared=0.0, outlier_gains=(), q_std=0.5)


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(mla, "_POISON_WORKSPACE", True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(lens, heads, q_len, page, seed, **kw) -> dict:
    """make_mla_inputs generated on the CPU (the same numbers everywhere), then moved to DEVICE."""
    d = mla.make_mla_inputs(lens, heads, q_len, page, seed=seed, device="cpu", **kw)
    mv = lambda x: x.to(DEVICE) if torch.is_tensor(x) else x  # noqa: E731
    return {k: (tuple(mv(x) for x in v) if isinstance(v, tuple) else mv(v)) for k, v in d.items()}


def run(d: dict, meta, **kw):
    """The kernel into a NaN-poisoned output buffer; every element must be written."""
    B, T, H, _ = d["q"].shape
    out = torch.full((B, T, H, mla.KV_LORA_RANK), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    o, lse = mla.mla_decode_fp8(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"],
                                meta, return_lse=True, out=out, **kw)
    assert o.data_ptr() == out.data_ptr()
    return o, lse


def refs(d: dict, causal: bool = True):
    args = (d["block_table"], d["cache_seqlens"], d["softmax_scale"])
    ref, ref_lse = mla.mla_decode_reference(d["q"], d["kv_cache"], *args, causal=causal)
    exact, _ = mla.mla_decode_exact(d["q"], d["latent_cache"], *args, causal=causal)
    return ref, ref_lse, exact


def check_lse(lse, ref_lse):
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see tokens must have a finite lse, others -inf"
    assert (lse[seen] - ref_lse[seen]).abs().max().item() <= 1e-4


# --- the format ---------------------------------------------------------------------------------------------------

def test_format_constants():
    assert mla.KV_BYTES_PER_TOKEN == 576 + 2 * 4 == 584 and mla.NUM_KV_SCALES == 2
    assert callable(sgl_kernel_ext.mla_decode_fp8)
    for name in ("get_mla_decode_metadata", "quantize_kv_fp8", "dequantize_kv_fp8", "store_kv_fp8",
                 "mla_decode_reference", "mla_decode_exact"):
        assert hasattr(sgl_kernel_ext, name), name


def test_quantize_roundtrip_error_bound():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(257, 576, generator=g)
    x[:, [5, 200, 333]] *= torch.tensor([12.0, 25.0, 30.0])  # outlier channels in the latent
    x[:, 512:] *= 7.0                                          # rope part on its own scale
    x[3] = 0.0                                                 # an all-zero token
    x = x.bfloat16().to(DEVICE)
    q, s = mla.quantize_kv_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (257, 576)
    assert s.dtype == torch.float32 and s.shape == (257, 2)
    xf = x.float()
    amax = torch.cat([xf[:, :512].abs().amax(-1, keepdim=True), xf[:, 512:].abs().amax(-1, keepdim=True)], 1)
    assert torch.allclose(s, torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)), rtol=1e-6, atol=0)
    y = mla.dequantize_kv_fp8(q, s)
    assert torch.equal(y[3], torch.zeros(576, device=DEVICE))
    # e4m3 round-to-nearest: |err| <= 2^-4 |x| for normals, <= 2^-10 * scale (half a subnormal step) below
    s_per_ch = torch.cat([s[:, :1].expand(-1, 512), s[:, 1:].expand(-1, 64)], 1)
    bound = torch.maximum(xf.abs() * 2.0 ** -4, s_per_ch * 2.0 ** -10) * (1 + 1e-6)
    assert ((y - xf).abs() <= bound).all()
    assert rel(y, xf) <= 0.03  # ~2.7% rms for a binade-uniform mantissa
    # the part maxima are exact (448 is representable)
    assert torch.allclose(y.abs().amax(-1), xf.abs().amax(-1), rtol=1e-6)
    # uint8 storage reads back the same
    assert torch.equal(mla.dequantize_kv_fp8(q.view(torch.uint8), s), y)


@pytest.mark.parametrize("rows", [1, 7, 8])
def test_q_prepass_matches_reference_at_any_row_count(rows):
    """The decode's Q pre-pass quantizes several rows per program: a row count that is not a multiple of
    QUANT_ROWS_PER_PROGRAM must neither drop nor spill rows."""
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(rows, 1, 1, 576, generator=g) * torch.linspace(0.1, 30.0, 576)).bfloat16().to(DEVICE)
    q8, qs = mla._quantize_q(q)
    ref8, refs = mla.quantize_kv_fp8(q.reshape(rows, 576))
    assert q8.shape == (rows, 576) and qs.shape == (rows, 2)
    assert torch.equal(qs, refs)
    ours, theirs = q8.float(), ref8.view(torch.float8_e4m3fn).float()
    if mla._INTERPRETED:
        assert torch.equal(ours, theirs)
    else:  # the GPU's fp32 division may differ in the last bit: at most one e4m3 step apart
        assert ((ours - theirs).abs() <= theirs.abs() * 2.0 ** -3 + 2.0 ** -9).all()


@pytest.mark.parametrize("page_size", [16, 64])
def test_store_kv_fp8_writes_only_its_slots(page_size):
    g = torch.Generator().manual_seed(2)
    num_pages = 4
    latent = (torch.randn(9, 576, generator=g) * torch.linspace(0.1, 20.0, 576)).bfloat16().to(DEVICE)
    latent[4] = 0.0
    loc = torch.randperm(num_pages * page_size, generator=g)[:9].to(DEVICE)
    data = torch.full((num_pages, page_size, 576), 0x7F, dtype=torch.uint8, device=DEVICE)  # NaN bytes
    scales = torch.full((num_pages, page_size, 2), float("nan"), device=DEVICE)
    mla.store_kv_fp8(data, scales, loc, latent)
    data_t = data.clone().fill_(0x7F)
    scales_t = scales.clone().fill_(float("nan"))
    mla.store_kv_fp8_torch(data_t, scales_t, loc, latent)
    assert torch.equal(scales.view(-1, 2)[loc], scales_t.view(-1, 2)[loc])
    ours = data.view(-1, 576)[loc].view(torch.float8_e4m3fn).float()
    theirs = data_t.view(-1, 576)[loc].view(torch.float8_e4m3fn).float()
    if mla._INTERPRETED:
        assert torch.equal(ours, theirs)
    else:  # the GPU's fp32 division may differ in the last bit: at most one e4m3 step apart, rarely
        assert ((ours - theirs).abs() <= theirs.abs() * 2.0 ** -3 + 2.0 ** -9).all()
        assert (ours != theirs).float().mean().item() < 1e-3
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert (data.view(-1, 576)[untouched] == 0x7F).all()
    assert torch.isnan(scales.view(-1, 2)[untouched]).all()
    # what was stored decodes to the input within the format's bound
    assert rel(mla.dequantize_kv_fp8(data.view(-1, 576)[loc], scales.view(-1, 2)[loc]), latent.float()) <= 0.03


def test_store_kv_fp8_reads_the_two_parts_where_they_are():
    """SGLang's MLA writes hand the latent and rope parts as two strided views (of kv_a's output and the rope
    buffer); storing them must give the bytes and scales of storing their join, without the join."""
    g = torch.Generator().manual_seed(12)
    n, page_size, pages = 7, 16, 3
    wide = (torch.randn(n, 700, generator=g) * torch.linspace(0.05, 30.0, 700)).bfloat16().to(DEVICE)
    nope = wide[:, 3:515]  # row stride 700: a view, not a copy
    rope = (torch.randn(n, 1, 128, generator=g) * 7).bfloat16().to(DEVICE)[:, 0, 10:74]
    assert nope.stride(0) == 700 and rope.stride(0) == 128
    loc = torch.randperm(pages * page_size, generator=g)[:n].to(DEVICE)
    got = torch.zeros(pages, page_size, 576, dtype=torch.uint8, device=DEVICE), torch.zeros(pages, page_size, 2,
                                                                                          device=DEVICE)
    want = got[0].clone(), got[1].clone()
    mla.store_kv_fp8(*got, loc, nope, rope)
    mla.store_kv_fp8(*want, loc, torch.cat([nope, rope], -1))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].view(-1, 2)[loc].gt(0).all()  # the slots were written, with non-zero scales
    with pytest.raises(AssertionError):
        mla.store_kv_fp8(*got, loc, nope, rope[:, :32])


# --- metadata -----------------------------------------------------------------------------------------------------

def test_metadata_split_counts():
    def meta(lens, h, t=1, **kw):
        return mla.get_mla_decode_metadata(torch.tensor(lens, dtype=torch.int32), h, t, num_sm=132, **kw)

    # B=1, 128 heads: 2 row blocks x 1 value block; 2*132 programs wanted -> 132 splits, capped by 4096/128 = 32
    m = meta([4096], 128)
    assert (m.block_h, m.num_row_blocks, m.num_splits, m.block_n, m.block_v, m.pv_16bit) == (64, 2, 32, 32, 512, True)
    assert meta([4096], 16).num_splits == 32
    assert meta([1024], 16).num_splits == 8     # capped by length (1024 / 128)
    assert meta([100], 16).num_splits == 1      # short: no split
    assert meta([4096], 1).num_splits == 32     # one head (rows past it masked) is planned like 16
    for heads, q_len in ((0, 1), (16, 0)):
        with pytest.raises(ValueError, match=f"num_heads={heads}, q_len={q_len}"):
            meta([4096], heads, q_len)
    assert meta([1], 16).num_splits == 1
    assert meta([4096] * 16, 128).num_splits == 9   # ceil(264 / 32)
    assert meta([4096] * 64, 128).num_splits == 3   # ceil(264 / 128)
    assert meta([4096] * 128, 128).num_splits == 2
    assert meta([4096] * 64, 16).num_splits == 5    # ceil(264 / 64)
    assert meta([4096] * 64, 16, block_v=256).num_splits == 3
    assert meta([4096], 16, max_splits=8).num_splits == 8
    assert meta([50, 4096], 16).num_splits == meta([4096, 4096], 16).num_splits  # the longest decides
    assert meta([5], 16, max_seqlen=4096).num_splits == 32                        # a bucket bound, no sync
    # rows = q_len x heads, packed q-major into blocks of 64 (padded: FP8 wgmma's M), or of block_h when given
    assert (meta([64], 16, 1).block_h, meta([64], 16, 1).num_row_blocks) == (64, 1)
    assert meta([64], 16, 4).num_row_blocks == 1
    assert meta([64], 128, 2).num_row_blocks == 4
    assert meta([64], 16, 2, block_h=16).num_row_blocks == 2
    assert meta([64], 16, 3, block_h=32).num_row_blocks == 2
    for bad in (dict(block_n=16), dict(block_h=48), dict(block_v=192)):
        with pytest.raises(ValueError):
            meta([64], 16, **bad)


# --- the kernel ---------------------------------------------------------------------------------------------------

# (lengths, heads, q_len, page, block_n, block_h, num_sm -> splits): tiles inside a page and across pages, length 1,
# lengths off page and split boundaries, 1..3 splits, q_len 1..4, two row blocks (heads 128; 16 heads x 2 in 16s)
CASES = [
    ([1, 17, 40], 16, 1, 32, 32, 16, 4),
    ([1, 17, 40], 16, 2, 64, 32, 64, 4),   # length 1 with q_len 2: the first query sees nothing
    ([40, 64, 130], 16, 1, 64, 64, 64, 4),
    ([17, 40], 16, 2, 32, 32, 16, 1),      # one split: bf16 output written directly; two row blocks of 16
    ([33, 70], 16, 4, 32, 32, 64, 4),
    ([40], 128, 1, 64, 32, 64, 4),         # two row blocks of 64
]


@pytest.mark.parametrize("lens,heads,q_len,page,block_n,block_h,num_sm", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}_H{c[1]}_T{c[2]}_p{c[3]}_n{c[4]}_h{c[5]}" for c in CASES])
def test_kernel_matches_references(lens, heads, q_len, page, block_n, block_h, num_sm):
    d = inputs(lens, heads, q_len, page, seed=sum(lens) + q_len, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], heads, q_len, num_sm=num_sm, block_n=block_n,
                                       block_h=block_h, min_split_tokens=16)
    assert meta.num_splits == (1 if num_sm == 1 else min(triton_cdiv(2 * num_sm, len(lens) * meta.num_row_blocks),
                                                         triton_cdiv(max(lens), block_n)))
    out, lse = run(d, meta)
    assert torch.isfinite(out.float()).all(), "NaN/Inf or an unwritten element"
    ref, ref_lse, exact = refs(d)
    check_lse(lse, ref_lse)
    blind = ~torch.isfinite(ref_lse)  # rows that see no token (q_len > length) are zero
    assert (out.float()[blind] == 0).all()
    print(f"rel vs reference {rel(out, ref):.4f}, vs exact {rel(out, exact):.4f}")
    assert rel(out, ref) <= 2e-2
    assert rel(out, exact) <= 3e-2


def triton_cdiv(a, b):
    return -(-a // b)


def test_length_one_is_the_value_row():
    """One visible token: softmax is exactly 1, so the output is V's dequantized row up to bf16 rounding."""
    d = inputs([1, 1], 16, 1, 32, seed=5, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 1, num_sm=4)
    out, lse = run(d, meta)
    v = mla.dequantize_kv_fp8(*d["kv_cache"])[d["block_table"][:, 0].long(), 0, :512]
    assert torch.allclose(out.float(), v[:, None, None, :].expand_as(out), rtol=2.0 ** -8, atol=0)
    assert torch.isfinite(lse).all()


def test_splits_agree():
    """The same problem with 1 and 3 splits."""
    d = inputs([150, 90], 16, 2, 32, seed=7, **DEEPSEEK_LIKE)
    one = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, num_sm=1, block_n=32)
    three = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, num_sm=3, block_n=32, block_v=512,
                                        min_split_tokens=32)
    assert (one.num_splits, three.num_splits) == (1, 3)
    o1, l1 = run(d, one)
    o3, l3 = run(d, three)
    ref, ref_lse, _ = refs(d)
    check_lse(l1, ref_lse)
    check_lse(l3, ref_lse)
    # splitting changes P's per-tile FP8 scaling only where a tile's running max differs: both are P-rounding close
    assert rel(o1, ref) <= 2e-2 and rel(o3, ref) <= 2e-2
    assert rel(o3, o1) <= 2.5e-2


def test_value_blocks_are_the_same_math():
    """block_v cuts the 512 value channels across programs; each recomputes the same P: the same output."""
    d = inputs([33, 100], 16, 2, 32, seed=23, **DEEPSEEK_LIKE)
    kw = dict(num_sm=1, block_n=32, min_split_tokens=16, max_splits=1)
    for pv16 in (True, False):
        outs = [run(d, mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, block_v=bv, pv_16bit=pv16, **kw))
                for bv in (512, 256, 128)]
        for o, lse in outs[1:]:
            assert torch.isfinite(o.float()).all()
            assert rel(o, outs[0][0]) <= 1e-6 and torch.allclose(lse, outs[0][1], rtol=0, atol=1e-6)


def test_pv_16bit_variant():
    """PV on fp16 MMA (P and dequantized V in fp16): no P quantization, so at least as close to the reference as FP8 PV."""
    d = inputs([33, 100], 16, 2, 32, seed=29, **DEEPSEEK_LIKE)
    kw = dict(num_sm=2, block_n=32, min_split_tokens=16)
    o8, _ = run(d, mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, pv_16bit=False, block_v=256, **kw))
    ob, lse = run(d, mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, **kw))
    ref, ref_lse, exact = refs(d)
    check_lse(lse, ref_lse)
    print(f"rel vs reference: fp8 PV {rel(o8, ref):.4f}, fp16 PV {rel(ob, ref):.4f}")
    assert torch.isfinite(ob.float()).all()
    assert rel(ob, ref) <= 6e-3 and rel(ob, ref) < rel(o8, ref)
    assert rel(ob, exact) <= 3e-2


def test_not_causal():
    d = inputs([17, 40], 16, 2, 32, seed=13, **DEEPSEEK_LIKE)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, num_sm=2, block_n=32, min_split_tokens=16)
    out = mla.mla_decode_fp8(d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"],
                             meta, causal=False)
    ref, _, exact = refs(d, causal=False)
    causal_ref, _, _ = refs(d, causal=True)
    assert rel(out, ref) <= 2e-2 and rel(out, exact) <= 3e-2
    # query 0 is where the mask would differ: the output must be the unmasked one, and clearly not the masked one
    assert rel(out[:, 0], causal_ref[:, 0]) > 2 * rel(out[:, 0], ref[:, 0])


def test_iid_tokens_worst_case():
    """No common component across tokens: the FP8 errors are as large as the signal allows (see module doc)."""
    d = inputs([40, 130], 16, 1, 64, seed=17, **IID)
    meta = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 1, num_sm=3, min_split_tokens=16)
    out, lse = run(d, meta)
    assert torch.isfinite(out.float()).all()
    ref, ref_lse, exact = refs(d)
    check_lse(lse, ref_lse)
    assert rel(out, ref) <= 3.5e-2
    assert rel(out, exact) <= 6.5e-2


def test_default_metadata_and_input_forms():
    """No metadata given; uint8 storage and FlashMLA's [pages, page, 1, 576] view; int64 tables are accepted."""
    d = inputs([20, 50], 16, 1, 32, seed=19, **DEEPSEEK_LIKE)
    kv, sc = d["kv_cache"]
    out = mla.mla_decode_fp8(d["q"], (kv.view(torch.uint8).unsqueeze(2), sc), d["block_table"].long(),
                             d["cache_seqlens"].long(), d["softmax_scale"])
    assert out.shape == (2, 1, 16, 512) and out.dtype == torch.bfloat16
    ref, _, _ = refs(d)
    assert rel(out, ref) <= 2e-2



def test_decode_refuses_operands_it_cannot_read():
    """Each operand check, with everything else valid: these calls would otherwise read past a table or a page."""
    d = inputs([20, 50], 16, 1, 32, seed=23, **DEEPSEEK_LIKE)
    q, kv, bt, lens, scale = d["q"], d["kv_cache"], d["block_table"], d["cache_seqlens"], d["softmax_scale"]
    meta = mla.get_mla_decode_metadata(lens, 16, 1, num_sm=4)
    bad = [
        (dict(q=q[..., :512]), "q last dim must be 576"),
        (dict(bt=bt[:1]), r"\[>= 2 sequences, pages\], got \(1, 2\)"),
        (dict(lens=torch.cat([lens, lens[:1]])), "must hold 2 lengths, got 3"),
        (dict(kv=(kv[0][:, :16], kv[1][:, :16])), "must be contiguous"),  # half of each page: page 16, strided
        (dict(kv=tuple(x[:, :24].contiguous() for x in kv)), "power of two, got 24"),
        (dict(meta=mla.get_mla_decode_metadata(lens, 128, 1, num_sm=4)), "another heads x q_len"),
        (dict(meta=mla.get_mla_decode_metadata(lens, 16, 1, num_sm=4, block_n=64)), "block_n 64 must divide"),
    ]
    for change, match in bad:
        a = dict(q=q, kv=kv, bt=bt, lens=lens, meta=meta) | change
        with pytest.raises(AssertionError, match=match):
            mla.mla_decode_fp8(a["q"], a["kv"], a["bt"], a["lens"], scale, a["meta"])
    out = mla.mla_decode_fp8(q, kv, torch.cat([bt, bt[:1]]), lens, scale, meta)  # a spare table row is fine
    assert rel(out, refs(d)[0]) <= 2e-2

def test_run_time_split_count_matches_the_same_static_plan():
    """metadata.splits_dev (a CUDA graph replayed at other lengths): the grid keeps the capture's split count, the
    kernels cut into the device value (clamped to 1..grid's). Same cut as a launch planned with that count: the
    same partials and output bits; with 1 split the direct bf16 store and the combined fp32 partial agree to
    rounding. The poisoned workspace shows any partial read that no program wrote."""
    d = inputs([150, 90], 16, 2, 32, seed=7, **DEEPSEEK_LIKE)
    grid = mla.get_mla_decode_metadata(d["cache_seqlens"], 16, 2, num_sm=8, block_n=32, min_split_tokens=32)
    assert grid.num_splits == 5
    for want in (1, 2, 5, 9):
        runtime = dataclasses.replace(grid, splits_dev=torch.tensor([want], dtype=torch.int32, device=DEVICE))
        o_dyn, l_dyn = run(d, runtime)
        o_static, l_static = run(d, dataclasses.replace(grid, num_splits=min(want, grid.num_splits)))
        if want == 1:
            assert rel(o_dyn, o_static) <= 4e-3 and (l_dyn - l_static).abs().max().item() <= 1e-5
        else:
            assert torch.equal(o_dyn, o_static) and torch.equal(l_dyn, l_static), want


def test_combine_of_large_split_lses_is_finite_and_exact():
    """Split LSEs near 200 (a sharply peaked row: exp of them overflows float32): the combine weighs the partials
    by exp(lse_s - max), so out and lse match the float64 merge; without the shift they would be inf / NaN.
    Sequences of 256 and 130 tokens over 4 splits of 64: the second uses 3 of them, its 4th partial is never read."""
    g = torch.Generator().manual_seed(11)
    B, q_len, H, S, block_n = 2, 1, 3, 4, 64
    seqlens = torch.tensor([256, 130], dtype=torch.int32, device=DEVICE)
    op = torch.randn(B, q_len * H, S, mla.KV_LORA_RANK, generator=g).to(DEVICE)
    lp = (200.0 + 3.0 * torch.randn(B, q_len * H, S, generator=g)).to(DEVICE)
    op[1, :, 3], lp[1, :, 3] = float("nan"), float("nan")  # past sequence 1's 3 splits
    out = torch.empty(B, q_len, H, mla.KV_LORA_RANK, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(B, q_len, H, dtype=torch.float32, device=DEVICE)
    meta = mla.get_mla_decode_metadata(seqlens, H, q_len, num_sm=1, block_n=block_n)
    mla.combine_partials(op, lp, seqlens, out, lse, meta, block_n)
    for b, used in ((0, 4), (1, 3)):
        l64, o64 = lp[b, :, :used].double().cpu(), op[b, :, :used].double().cpu()
        ref_lse = torch.logsumexp(l64, dim=-1)
        ref = (torch.exp(l64 - ref_lse[:, None])[..., None] * o64).sum(dim=1)
        assert torch.isfinite(out[b]).all() and torch.isfinite(lse[b]).all()
        assert (out[b].reshape(q_len * H, -1).double().cpu() - ref).abs().max().item() <= 1e-5
        assert (lse[b].reshape(-1).double().cpu() - ref_lse).abs().max().item() <= 1e-4


def test_splits_pointer_checks_the_run_time_split_count():
    """metadata.splits_dev is read by the kernels as int32 on their device: another dtype is refused."""
    seqlens = torch.tensor([64], dtype=torch.int32, device=DEVICE)
    meta = mla.get_mla_decode_metadata(seqlens, 16, 1, num_sm=8)
    assert mla.splits_pointer(meta, seqlens) is seqlens  # unset: the kernels never read it
    good = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    assert mla.splits_pointer(dataclasses.replace(meta, splits_dev=good), seqlens) is good
    with pytest.raises(AssertionError, match="int32"):
        mla.splits_pointer(dataclasses.replace(meta, splits_dev=good.long()), seqlens)


def test_launch_args_pass_out_only_to_an_unsplit_launch():
    """mla_decode_cuda.launch_args: an unsplit launch gets out and lse (the kernel writes bf16 rows itself) and no
    partials; a split launch gets the fp32 partials and the run-time split count, and null out / lse (the combine
    writes them)."""
    from sgl_kernel_ext import mla_decode_cuda as cu

    B, H = 2, 16
    kv, kvs = torch.zeros(3, 64, 576, dtype=torch.uint8), torch.zeros(3, 64, 2)
    bt, sl = torch.zeros(B, 3, dtype=torch.int32), torch.tensor([70, 130], dtype=torch.int32)
    out, lse = torch.zeros(B, 1, H, 512, dtype=torch.bfloat16), torch.zeros(B, 1, H)
    q8, qs = torch.zeros(B * H, 576, dtype=torch.uint8), torch.zeros(B * H, 2)
    op, lp = torch.zeros(B, H, 3, 512), torch.zeros(B, H, 3)
    meta = dataclasses.replace(cu.get_mla_decode_metadata(sl, H, 1, 132, max_seqlen=4096), num_splits=3,
                               splits_dev=torch.ones(1, dtype=torch.int32))
    split = cu.launch_args(q8, qs, kv, kvs, bt, sl, out, lse, op, lp, meta, True, 0.1, 0)
    assert split[6] == split[7] == 0 and (split[8], split[9]) == (op.data_ptr(), lp.data_ptr())
    assert split[28] == meta.splits_dev.data_ptr()
    one = cu.launch_args(q8, qs, kv, kvs, bt, sl, out, lse, None, None, dataclasses.replace(meta, num_splits=1),
                         True, 0.1, 0)
    assert (one[6], one[7]) == (out.data_ptr(), lse.data_ptr()) and one[8] == one[9] == one[28] == 0
    # the C entry's order (LAUNCH_ARGTYPES): 10 pointers, then the cache / table strides, out's 3, lse's 2, the
    # partials' 3 + 2 (zeros when unsplit), the page count, batch, heads, q_len, splits
    assert len(split) == len(one) == len(cu.LAUNCH_ARGTYPES)
    assert split[10:28] == (kv.stride(0), kvs.stride(0), bt.stride(0), *out.stride()[:3], *lse.stride()[:2],
                            *op.stride()[:3], *lp.stride()[:2], 3, B, H, 1, 3)
    assert one[18:23] == (0, 0, 0, 0, 0) and one[27] == 1


def test_splits_lut_is_the_plan_at_every_length_and_set_splits_indexes_it():
    from sgl_kernel_ext import mla_decode_cuda as cu

    for mod, kw in ((mla, {}), (mla, {"block_v": 256, "min_split_tokens": 64}), (cu, {})):
        for batch, heads, q_len in ((1, 16, 1), (1, 128, 1), (16, 128, 1), (48, 128, 1), (64, 128, 2), (128, 128, 1)):
            lut = mod.splits_lut(heads, q_len, batch, 300 * 64, 64, num_sm=132, **kw)
            assert lut.dtype == torch.int32 and lut.numel() == 301
            for t in range(1, 301):
                want = mod.get_mla_decode_metadata(torch.ones(batch, dtype=torch.int32), heads, q_len, num_sm=132,
                                                   max_seqlen=t * 64, **kw).num_splits
                assert lut[t].item() == want, (mod.__name__, kw, batch, heads, q_len, t)
            assert lut[0].item() == lut[1].item()
    lut = cu.splits_lut(128, 1, 16, 40 * 64, num_sm=132)
    assert len(set(lut.tolist())) > 1  # the plan does change with length here
    out = torch.zeros(1, dtype=torch.int32)
    for lens, t in (([1, 64, 65], 2), ([640, 3], 10), ([5000], 40), ([0], 0)):  # past the table: its last entry
        mla.set_splits(out, lut, torch.tensor(lens, dtype=torch.int32), 64)
        assert out.item() == lut[t].item(), lens
