"""FP8 MLA decode for DeepSeek-V2/V3 over a paged FP8 latent cache (Triton, Hopper first).

Interface in FlashMLA's manner::

    meta = get_mla_decode_metadata(cache_seqlens, num_heads, q_len)
    out = mla_decode_fp8(q, (kv_fp8, kv_scales), block_table, cache_seqlens, softmax_scale, meta)

with ``q [B, q_len, H, 576]`` bf16 (absorbed query: 512 latent + 64 rope), the paged cache
``kv_fp8 [num_pages, page_size, 576]`` and ``out [B, q_len, H, 512]`` bf16. V is the first 512 channels
of the same latent cache, as in FlashMLA and SGLang's MLA backends.

KV cache format (chosen here; 596 bytes/token against 1152 for BF16, 0.517x)
------------------------------------------------------------------------------
Per token: the 576 channels as FP8 e4m3 (576 B), plus 5 float32 scales (20 B), one per channel group:
groups 0..3 are latent channels [128 g, 128 g + 128) and group 4 is the 64 rope channels.
``value = fp8 * scale``, ``scale = amax(|group|) / 448`` (1.0 for an all-zero group). Two tensors:

    kv_fp8    [num_pages, page_size, 576]  float8_e4m3fn (uint8 storage accepted)
    kv_scales [num_pages, page_size, 5]    float32

Why per (token, 128-channel group) plus a separate rope scale rather than one scale per token:

* The rope part is not RMS-normalised (DeepSeek normalises only the 512-d latent before caching), so its
  magnitude is unrelated to the latent's: sharing one scale lets whichever part is larger set the
  scale for the other. Its own scale costs 4 bytes.
* Outlier channels (a few channels 10-30x the rest) only coarsen their own 128-channel group, and the
  group's FP8 exponent range (e4m3 spans 2^-9..448) keeps the other channels in it normal.
* The scales come for free in the kernel: QK^T is computed as 5 FP8 dots (K = 128, 128, 128, 128, 64,
  each a whole number of wgmma k-steps), each scaled by an outer product of Q and K scales before it is
  summed. V uses the 4 latent scales, folded into P (below).
* It is quantizable on the fly, token by token, when SGLang writes K/V: no calibration, no history.
  :func:`store_kv_fp8` quantizes and scatters a batch of new tokens into the paged cache.

FP8 math in the kernel
----------------------
* Q is quantized inside the kernel, once per program, per (token, head, group) with the same 5 groups
  (amax / 448), so the QK scale of group g is ``s_q[h, g] * s_k[n, g]`` (softmax scale and log2(e) are
  folded into s_q). The fp8 x fp8 products are exact in fp32; accumulation is fp32.
* Online softmax in fp32, base 2. P = exp2(s - m) lies in [0, 1].
* PV: ``O[h, c] = sum_n P[h, n] * V8[n, c] * s_v[n, g(c)]``. The V scale varies along the reduction
  dimension n, so it cannot be applied after the dot, and it cannot be applied to V without
  dequantizing it. It is folded into P instead, per group g: ``P'_g = P * s_v[:, g]``, then P'_g is
  quantized to FP8 and ``tl.dot(P'_g, V8_g)`` gives the exact contribution of group g (up to P'
  rounding). To use the FP8 range, P'_g is stored as ``P * (s_v[n, g] / c_g) * 448`` with c_g the largest
  s_v of the group in this KV tile (a 64-element reduction, not a [rows, 64] one), so every element is
  <= 448, and the dot is scaled back by ``c_g / 448``. The 4 group dots have the MMA work of one
  [rows, N] x [N, 512] dot. The softmax denominator uses the unquantized fp32 P.
* Error: e4m3 keeps 3 mantissa bits, so every rounding carries about 2.7% rms relative error. The roundings
  of P, K and V are independent across tokens and partly average out in the output; Q's is shared by every
  token, moves the whole score row coherently and, with outlier channels in K, is the largest term.
  Measured (Frobenius norm, CPU interpreter, DeepSeek-like inputs, 1k-4k tokens): 0.3-0.65% against the
  dequantized reference (P rounding only), 1.4-1.9% against fp32 on the bf16 inputs; with i.i.d. zero-mean
  tokens, the worst case, about 2.7% and 5%. ``precise_q`` / ``precise_pv`` carry Q / P as two FP8 terms
  (hi + lo/16) and remove those parts for +53% / +47% tensor-core work.
  Token scales within a tile that differ by more than ~100x push small P' into e4m3 subnormals; the
  latent is RMS-normalised per token, which keeps its group scales within a small factor of each other.

Kernels
-------
1. ``_mla_fp8_split_kernel``: grid (row_blocks, num_splits, B). Query rows are (q position, head)
   pairs packed q-major, BLOCK_H rows per program (so an MTP step reads each KV tile once for all its
   query positions). A program walks its split of the sequence BLOCK_N tokens at a time (pages resolved
   through the block table, tiles may span pages when BLOCK_N > page_size), computing the 5 scaled FP8
   QK dots, a causal/length mask per row, the online softmax, and 4 FP8 PV dots into [BLOCK_H, 512] fp32
   accumulators. With one split it writes bf16 output and lse directly; otherwise a normalised fp32
   partial and its lse.
2. ``_mla_fp8_combine_kernel``: grid (rows, B); merges the non-empty splits of a row through their lse.

References: :func:`mla_decode_exact` (fp32 math on the bf16 inputs) and :func:`mla_decode_reference`
(fp32 math on the dequantized FP8 cache and the quantize-dequantized Q, i.e. everything but P rounding).

Tuning notes (from compiling for sm_90a with Triton 3.6 and ptxas; not yet timed on a GPU)
-----------------------------------------------------------------------------------------------
* An FP8 ``tl.dot`` with M < 64 becomes f16 ``mma.sync`` (operands upcast), not FP8 wgmma, so block_h is
  64 rows by default even for 16 heads x q_len 1 (the rest masked), as in FlashMLA.
* Default (block_h 64, block_n 64, 8 warps, 2 stages): 255 registers and ~2 KB of spills, 113 KB shared
  memory, so one program per SM. Triton puts all warps of a chained-dot kernel on M, so with M = 64 both
  warpgroups compute the whole QK^T (36 x m64n32k32 each); PV is split between them (m64n64k32).
* A latent K tile that feeds both dots is loaded synchronously (it is stored to shared memory in two layouts;
  FP8 wgmma takes K-major operands only, so V has to be transposed). ``v_reload=True`` loads V separately:
  the K tiles then become cp.async-pipelined; (64, 32, 8 warps, 3 stages, v_reload) spills only ~370 B.
  ``bench_mla_decode.py --configs 64x64x8x2 64x32x8x3v 64x64x8x2v 16x64x4x2`` times them.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

__all__ = [
    "FP8_MAX", "KV_LORA_RANK", "ROPE_DIM", "HEAD_DIM_QK", "SCALE_GROUP", "NUM_KV_SCALES", "KV_BYTES_PER_TOKEN",
    "MLADecodeMetadata", "get_mla_decode_metadata", "mla_decode_fp8",
    "quantize_kv_fp8", "dequantize_kv_fp8", "quantize_q_fp8", "store_kv_fp8", "store_kv_fp8_torch",
    "mla_decode_reference", "mla_decode_exact", "make_mla_inputs",
]

FP8_MAX = 448.0                      # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
KV_LORA_RANK = 512                   # latent channels, also V's width
ROPE_DIM = 64
HEAD_DIM_QK = KV_LORA_RANK + ROPE_DIM  # 576
SCALE_GROUP = 128                    # latent channels per scale
NUM_LATENT_GROUPS = KV_LORA_RANK // SCALE_GROUP  # 4
NUM_KV_SCALES = NUM_LATENT_GROUPS + 1           # + one for the rope part
KV_BYTES_PER_TOKEN = HEAD_DIM_QK + 4 * NUM_KV_SCALES  # 596
LOG2E = 1.4426950408889634


@triton.jit
def _probe():
    pass


# Triton decides at decoration time whether a kernel is compiled or interpreted (TRITON_INTERPRET=1).
_INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------------------------
# Quantization (torch): the format's definition
# ----------------------------------------------------------------------------------------------------------------

def _group_view(x: torch.Tensor):
    """(latent [..., 4, 128], rope [..., 1, 64]) float32 views of x [..., 576]."""
    assert x.shape[-1] == HEAD_DIM_QK, f"last dim must be {HEAD_DIM_QK}, got {tuple(x.shape)}"
    xf = x.float()
    lat = xf[..., :KV_LORA_RANK].reshape(*x.shape[:-1], NUM_LATENT_GROUPS, SCALE_GROUP)
    rope = xf[..., KV_LORA_RANK:].reshape(*x.shape[:-1], 1, ROPE_DIM)
    return lat, rope


def _quant_groups(g: torch.Tensor):
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_kv_fp8(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [..., 576] (bf16/fp16/fp32) -> (kv_fp8 [..., 576] float8_e4m3fn, scales [..., 5] float32).

    scales[..., g] = amax(|latent[..., 128 g : 128 g + 128]|) / 448 for g < 4, scales[..., 4] for the rope
    channels 512..575; 1.0 where a group is all zero. Dequantize with :func:`dequantize_kv_fp8`.
    """
    lat, rope = _group_view(latent)
    ql, sl = _quant_groups(lat)
    qr, sr = _quant_groups(rope)
    lead = latent.shape[:-1]
    kv = torch.cat([ql.reshape(*lead, KV_LORA_RANK), qr.reshape(*lead, ROPE_DIM)], dim=-1)
    return kv, torch.cat([sl, sr], dim=-1).contiguous()


def dequantize_kv_fp8(kv_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`: float32 [..., 576]."""
    if kv_fp8.dtype == torch.uint8:
        kv_fp8 = kv_fp8.view(FP8_DTYPE)
    lead = kv_fp8.shape[:-1]
    f = kv_fp8.float()
    lat = f[..., :KV_LORA_RANK].reshape(*lead, NUM_LATENT_GROUPS, SCALE_GROUP) * scales[..., :NUM_LATENT_GROUPS, None]
    rope = f[..., KV_LORA_RANK:] * scales[..., NUM_LATENT_GROUPS:]
    return torch.cat([lat.reshape(*lead, KV_LORA_RANK), rope], dim=-1)


def quantize_q_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's in-register Q quantization, in torch: per (token, head) and the same 5 channel groups."""
    return quantize_kv_fp8(q)


def store_kv_fp8_torch(kv_fp8: torch.Tensor, kv_scales: torch.Tensor, loc: torch.Tensor,
                       latent: torch.Tensor) -> None:
    """Quantize latent [N, 576] and write it at flat slots loc [N] (slot = page * page_size + offset)."""
    data, scales = _cache_views(kv_fp8, kv_scales)
    q, s = quantize_kv_fp8(latent)
    data.view(-1, HEAD_DIM_QK)[loc.long()] = q
    scales.view(-1, NUM_KV_SCALES)[loc.long()] = s


@triton.jit
def _to_fp8(x, INTERPRET: tl.constexpr):
    """fp32 (already within +-448) -> float8e4nv, round to nearest even.

    On the GPU this is one cvt.rn.satfinite. Triton 3.6's interpreter rounds fp32 -> fp8 itself and drops the
    carry when rounding up crosses a power of two (126.97 -> 64, not 128), so under INTERPRET the value is first
    rounded onto the e4m3 grid in fp32 arithmetic, which its conversion then keeps exactly: a Veltkamp split to
    4 significant bits for normals, and a magic-number add for subnormals (multiples of 2^-9 below 2^-6).
    """
    if INTERPRET:
        c = x * 1048577.0  # 2^20 + 1
        hi = c - (c - x)
        x = tl.where(tl.abs(x) < 0.015625, (x + 24576.0) - 24576.0, hi)
    return x.to(tl.float8e4nv)


@triton.jit
def _round_bf16(x, ROUND_BF16: tl.constexpr):
    """Under the interpreter, Triton 3.6 converts fp32 -> bf16 by truncation; round to nearest first (Veltkamp
    split to 8 significant bits) so that the stored bf16 is what the GPU's cvt.rn gives."""
    if ROUND_BF16:
        c = x * 65537.0  # 2^16 + 1
        x = c - (c - x)
    return x


@triton.jit
def _store_kv_fp8_kernel(X, LOC, KV, KVS, stride_xn, stride_kvp, stride_kvt, stride_sp, stride_st,
                         PAGE_SIZE: tl.constexpr, NUM_G: tl.constexpr, GROUP: tl.constexpr,
                         ROPE: tl.constexpr, INTERPRET: tl.constexpr):
    i = tl.program_id(0)
    loc = tl.load(LOC + i).to(tl.int64)
    page = loc // PAGE_SIZE
    tok = loc % PAGE_SIZE
    kv_base = KV + page * stride_kvp + tok * stride_kvt
    s_base = KVS + page * stride_sp + tok * stride_st
    offs_g = tl.arange(0, NUM_G)
    offs_c = tl.arange(0, GROUP)
    cols = offs_g[:, None] * GROUP + offs_c[None, :]
    x = tl.load(X + i * stride_xn + cols).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    xq = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(kv_base + cols, _to_fp8(xq, INTERPRET))
    tl.store(s_base + offs_g, scale)
    offs_r = tl.arange(0, ROPE)
    xr = tl.load(X + i * stride_xn + NUM_G * GROUP + offs_r).to(tl.float32)
    amax_r = tl.max(tl.abs(xr), axis=0)
    scale_r = tl.where(amax_r > 0, amax_r / 448.0, 1.0)
    xrq = tl.clamp(xr / scale_r, -448.0, 448.0)
    tl.store(kv_base + NUM_G * GROUP + offs_r, _to_fp8(xrq, INTERPRET))
    tl.store(s_base + NUM_G, scale_r)


def store_kv_fp8(kv_fp8: torch.Tensor, kv_scales: torch.Tensor, loc: torch.Tensor, latent: torch.Tensor) -> None:
    """The store path (one Triton launch): quantize latent [N, 576] per :func:`quantize_kv_fp8` and write it
    into the paged cache at flat slots loc [N] (slot = page * page_size + offset within the page)."""
    data, scales = _cache_views(kv_fp8, kv_scales)
    n = latent.shape[0]
    if n == 0:
        return
    assert latent.shape[-1] == HEAD_DIM_QK and latent.stride(-1) == 1
    assert data.stride(-1) == 1 and scales.stride(-1) == 1
    _store_kv_fp8_kernel[(n,)](
        latent, loc, data, scales, latent.stride(0), data.stride(0), data.stride(1), scales.stride(0),
        scales.stride(1), PAGE_SIZE=data.shape[1], NUM_G=NUM_LATENT_GROUPS, GROUP=SCALE_GROUP, ROPE=ROPE_DIM,
        INTERPRET=_INTERPRETED, num_warps=4)


def _cache_views(kv_fp8: torch.Tensor, kv_scales: torch.Tensor):
    """Accept [P, S, 576] or FlashMLA's [P, S, 1, 576], uint8 or float8 storage."""
    if kv_fp8.dim() == 4:
        assert kv_fp8.shape[2] == 1, "MLA has one KV head"
        kv_fp8 = kv_fp8.squeeze(2)
    if kv_scales.dim() == 4:
        kv_scales = kv_scales.squeeze(2)
    if kv_fp8.dtype == torch.uint8:
        kv_fp8 = kv_fp8.view(FP8_DTYPE)
    assert kv_fp8.dtype == FP8_DTYPE, f"kv cache must be float8_e4m3fn or uint8, got {kv_fp8.dtype}"
    assert kv_fp8.dim() == 3 and kv_fp8.shape[-1] == HEAD_DIM_QK, tuple(kv_fp8.shape)
    assert kv_scales.shape == (*kv_fp8.shape[:2], NUM_KV_SCALES) and kv_scales.dtype == torch.float32, (
        f"scales must be float32 {(*kv_fp8.shape[:2], NUM_KV_SCALES)}, got {kv_scales.dtype} {tuple(kv_scales.shape)}")
    return kv_fp8, kv_scales


# ----------------------------------------------------------------------------------------------------------------
# Metadata: how many KV splits
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MLADecodeMetadata:
    """Launch plan; depends on batch, heads, q_len and (through max_seqlen) lengths, not on their values
    per request, so one plan can be captured in a CUDA graph for a bucket of lengths."""
    num_splits: int      # KV splits per (batch, row block); every sequence is cut into this many parts
    block_h: int         # query rows (q position x head) per program
    block_n: int         # KV tokens per inner iteration
    num_warps: int
    num_stages: int
    num_row_blocks: int
    num_sm: int
    v_reload: bool = False  # load V separately from K (see _kv_tile); a tuning knob


def _default_num_sm() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132  # H200/H100 SXM; H20 has 78


def get_mla_decode_metadata(cache_seqlens: torch.Tensor, num_heads: int, q_len: int = 1,
                            num_sm: int | None = None, *, max_seqlen: int | None = None,
                            block_h: int = 64, block_n: int = 64, num_warps: int = 8,
                            num_stages: int = 2, waves: float = 2.0, min_split_tokens: int = 128,
                            max_splits: int = 64, v_reload: bool = False) -> MLADecodeMetadata:
    """Choose the split-KV factor: enough programs for ``waves`` x num_sm (B x row_blocks x splits), but
    no split shorter than ``min_split_tokens`` of the longest sequence, and at most ``max_splits``.

    ``max_seqlen`` avoids reading cache_seqlens (a device sync when it lives on the GPU; pass it, e.g. the
    CUDA-graph bucket's bound, on a hot path).

    block_h is 64 query rows even for 16 heads x q_len 1 (rows past q_len x heads are masked), as FlashMLA does:
    Triton 3.6 lowers an FP8 tl.dot with M < 64 on sm_90 to f16 mma.sync (the operands upcast), not to FP8
    wgmma, whose M is 64 per warpgroup. Smaller block_h stays available for tuning and tests.
    """
    if num_heads < 1 or q_len < 1:
        raise ValueError(f"num_heads={num_heads}, q_len={q_len}")
    if block_n < 32 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 32 (FP8 MMA k-step), got {block_n}")
    rows = num_heads * q_len
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    num_sm = num_sm or _default_num_sm()
    batch = cache_seqlens.numel()
    row_blocks = triton.cdiv(rows, block_h)
    if max_seqlen is None:
        max_seqlen = int(cache_seqlens.max().item()) if batch else 1
    max_seqlen = max(int(max_seqlen), 1)
    useful = triton.cdiv(max_seqlen, max(min_split_tokens, block_n))
    want = triton.cdiv(int(math.ceil(waves * num_sm)), max(batch * row_blocks, 1))
    num_splits = max(1, min(want, useful, max_splits))
    return MLADecodeMetadata(num_splits=num_splits, block_h=block_h, block_n=block_n, num_warps=num_warps,
                             num_stages=num_stages, num_row_blocks=row_blocks, num_sm=num_sm, v_reload=v_reload)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _load_quant_q(Q, q_off, row_ok, col0, qk_scale, W: tl.constexpr, Q_SPLIT: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Rows of Q[:, col0:col0+W] -> (fp8 tile [BLOCK_H, W], fp8 residual x16 (Q_SPLIT, else the tile again),
    dequant scale [BLOCK_H] * qk_scale)."""
    cols = col0 + tl.arange(0, W)
    q = tl.load(Q + q_off[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(q), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    qs = tl.clamp(q / scale[:, None], -448.0, 448.0)
    q8 = _to_fp8(qs, INTERPRET)
    if Q_SPLIT:
        ql8 = _to_fp8((qs - q8.to(tl.float32)) * 16.0, INTERPRET)
    else:
        ql8 = q8
    return q8, ql8, scale * qk_scale


@triton.jit
def _qk_group(q8, ql8, k8, Q_SPLIT: tl.constexpr):
    """Q8 K8^T in fp32; with Q_SPLIT (precise_q) plus the Q residual's dot: Q ~ Q_hi + Q_lo/16."""
    d = tl.dot(q8, k8)
    if Q_SPLIT:
        d += tl.dot(ql8, k8) * 0.0625
    return d


@triton.jit
def _pv_group(acc, p, sv, v_t, P_SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """acc [BLOCK_H, W] += P [BLOCK_H, N] (fp32 in [0,1]) x diag(sv) x V8 [N, W], with P x sv quantized to FP8.

    P_SPLIT (precise_pv): also quantize the rounding residual (x16) and add a second FP8 dot, P ~ P_hi + P_lo/16,
    which cuts the P rounding error ~16x for twice the PV tensor-core work (+47% MMA overall).
    """
    c = tl.maximum(tl.max(sv, axis=0), 1e-30)
    pv = tl.minimum(p * (sv * (448.0 / c))[None, :], 448.0)
    p8 = _to_fp8(pv, INTERPRET)
    o = tl.dot(p8, v_t)
    if P_SPLIT:
        lo8 = _to_fp8((pv - p8.to(tl.float32)) * 16.0, INTERPRET)
        o += tl.dot(lo8, v_t) * 0.0625
    return acc + o * (c / 448.0)


@triton.jit
def _kv_tile(n0, end, row_end, m_i, l_i, acc0, acc1, acc2, acc3,
             q0, q1, q2, q3, qr, ql0, ql1, ql2, ql3, qlr, sq0, sq1, sq2, sq3, sqr,
             KV, KVS, bt_row, stride_kvp, stride_kvt, stride_sp, stride_st,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, Q_SPLIT: tl.constexpr, P_SPLIT: tl.constexpr,
             V_RELOAD: tl.constexpr, INTERPRET: tl.constexpr):
    """One BLOCK_N-token step of the split kernel: FP8 QK^T, online softmax, FP8 PV."""
    G: tl.constexpr = 128
    R: tl.constexpr = 64
    offs_g = tl.arange(0, G)
    offs_r = tl.arange(0, R)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    if BLOCK_N <= PAGE_SIZE:  # the tile lies inside one page
        page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
        in_page = (offs_n % PAGE_SIZE).to(tl.int64)
        kv_tok = page * stride_kvp + in_page * stride_kvt
        s_tok = page * stride_sp + in_page * stride_st
    else:  # the tile spans BLOCK_N // PAGE_SIZE pages
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_page = (offs_n % PAGE_SIZE).to(tl.int64)
        kv_tok = page * stride_kvp + in_page * stride_kvt
        s_tok = page * stride_sp + in_page * stride_st

    # K^T tiles [channels, BLOCK_N] in FP8, and their per-token scales
    k0 = tl.load(KV + kv_tok[None, :] + (0 * G + offs_g)[:, None], mask=n_ok[None, :], other=0.0)
    k1 = tl.load(KV + kv_tok[None, :] + (1 * G + offs_g)[:, None], mask=n_ok[None, :], other=0.0)
    k2 = tl.load(KV + kv_tok[None, :] + (2 * G + offs_g)[:, None], mask=n_ok[None, :], other=0.0)
    k3 = tl.load(KV + kv_tok[None, :] + (3 * G + offs_g)[:, None], mask=n_ok[None, :], other=0.0)
    kr = tl.load(KV + kv_tok[None, :] + (4 * G + offs_r)[:, None], mask=n_ok[None, :], other=0.0)
    s0 = tl.load(KVS + s_tok + 0, mask=n_ok, other=0.0)
    s1 = tl.load(KVS + s_tok + 1, mask=n_ok, other=0.0)
    s2 = tl.load(KVS + s_tok + 2, mask=n_ok, other=0.0)
    s3 = tl.load(KVS + s_tok + 3, mask=n_ok, other=0.0)
    sr = tl.load(KVS + s_tok + 4, mask=n_ok, other=0.0)

    # S = Q K^T in log2 units: 5 FP8 dots, each with its outer-product scale
    qk = _qk_group(q0, ql0, k0, Q_SPLIT) * (sq0[:, None] * s0[None, :])
    qk += _qk_group(q1, ql1, k1, Q_SPLIT) * (sq1[:, None] * s1[None, :])
    qk += _qk_group(q2, ql2, k2, Q_SPLIT) * (sq2[:, None] * s2[None, :])
    qk += _qk_group(q3, ql3, k3, Q_SPLIT) * (sq3[:, None] * s3[None, :])
    qk += _qk_group(qr, qlr, kr, Q_SPLIT) * (sqr[:, None] * sr[None, :])
    visible = n_ok[None, :] & (offs_n[None, :] < row_end[:, None])
    qk = tl.where(visible, qk, float("-inf"))

    # online softmax (fp32)
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    m_i = m_new

    # O += P V: V group g = latent channels of K group g, its scale folded into P
    # V_RELOAD: load V [BLOCK_N, 128] again (an L1/L2 hit). A K tile that feeds both dots is loaded synchronously
    # into registers and stored to shared memory in two layouts (FP8 wgmma wants K-major operands); loaded once
    # per dot, the K tiles become cp.async-pipelined and only V goes through registers (to be transposed).
    if V_RELOAD:
        v0 = tl.load(KV + kv_tok[:, None] + (0 * G + offs_g)[None, :], mask=n_ok[:, None], other=0.0)
        v1 = tl.load(KV + kv_tok[:, None] + (1 * G + offs_g)[None, :], mask=n_ok[:, None], other=0.0)
        v2 = tl.load(KV + kv_tok[:, None] + (2 * G + offs_g)[None, :], mask=n_ok[:, None], other=0.0)
        v3 = tl.load(KV + kv_tok[:, None] + (3 * G + offs_g)[None, :], mask=n_ok[:, None], other=0.0)
    else:
        v0 = tl.trans(k0)
        v1 = tl.trans(k1)
        v2 = tl.trans(k2)
        v3 = tl.trans(k3)
    acc0 = _pv_group(acc0 * alpha[:, None], p, s0, v0, P_SPLIT, INTERPRET)
    acc1 = _pv_group(acc1 * alpha[:, None], p, s1, v1, P_SPLIT, INTERPRET)
    acc2 = _pv_group(acc2 * alpha[:, None], p, s2, v2, P_SPLIT, INTERPRET)
    acc3 = _pv_group(acc3 * alpha[:, None], p, s3, v3, P_SPLIT, INTERPRET)
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _mla_fp8_split_kernel(
    Q, KV, KVS, BT, SEQ, OP, LP, OUT, LSE,
    qk_scale,
    stride_qb, stride_qt, stride_qh,
    stride_kvp, stride_kvt, stride_sp, stride_st, stride_btb,
    stride_opb, stride_opr, stride_ops, stride_lpb, stride_lpr,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    num_heads, num_rows, q_len, num_splits,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DIRECT: tl.constexpr, Q_SPLIT: tl.constexpr, P_SPLIT: tl.constexpr,
    V_RELOAD: tl.constexpr, INTERPRET: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    G: tl.constexpr = 128
    R: tl.constexpr = 64
    rb = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    rows = rb * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    t = rows // num_heads
    h = rows % num_heads

    seqlen = tl.load(SEQ + b)
    if CAUSAL:
        row_end = seqlen - q_len + 1 + t  # query t of q_len sees positions < seqlen - q_len + t + 1
    else:
        row_end = tl.zeros([BLOCK_H], dtype=tl.int32) + seqlen
    row_end = tl.where(row_ok, row_end, 0)

    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = sp * split_len
    end = tl.minimum(start + split_len, seqlen)  # empty for splits past a short sequence: nothing stored

    q_off = b * stride_qb + t.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
    q0, ql0, sq0 = _load_quant_q(Q, q_off, row_ok, 0 * G, qk_scale, G, Q_SPLIT, INTERPRET)
    q1, ql1, sq1 = _load_quant_q(Q, q_off, row_ok, 1 * G, qk_scale, G, Q_SPLIT, INTERPRET)
    q2, ql2, sq2 = _load_quant_q(Q, q_off, row_ok, 2 * G, qk_scale, G, Q_SPLIT, INTERPRET)
    q3, ql3, sq3 = _load_quant_q(Q, q_off, row_ok, 3 * G, qk_scale, G, Q_SPLIT, INTERPRET)
    qr, qlr, sqr = _load_quant_q(Q, q_off, row_ok, 4 * G, qk_scale, R, Q_SPLIT, INTERPRET)

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, G], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, G], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, G], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, G], dtype=tl.float32)
    offs_g = tl.arange(0, G)
    bt_row = BT + b * stride_btb

    # A `for` over runtime bounds is what Triton software-pipelines (num_stages) on the GPU. The interpreter
    # (TRITON_INTERPRET=1) cannot run one under numpy >= 2.4 (its scalars are 1-element arrays, and int() of
    # those now raises), so there the same body runs in a `while`.
    if INTERPRET:
        n0 = start
        while n0 < end:
            m_i, l_i, acc0, acc1, acc2, acc3 = _kv_tile(
                n0, end, row_end, m_i, l_i, acc0, acc1, acc2, acc3, q0, q1, q2, q3, qr, ql0, ql1, ql2, ql3, qlr,
                sq0, sq1, sq2, sq3, sqr, KV, KVS, bt_row, stride_kvp, stride_kvt, stride_sp, stride_st,
                PAGE_SIZE, BLOCK_N, Q_SPLIT, P_SPLIT, V_RELOAD, INTERPRET)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc0, acc1, acc2, acc3 = _kv_tile(
                n0, end, row_end, m_i, l_i, acc0, acc1, acc2, acc3, q0, q1, q2, q3, qr, ql0, ql1, ql2, ql3, qlr,
                sq0, sq1, sq2, sq3, sqr, KV, KVS, bt_row, stride_kvp, stride_kvt, stride_sp, stride_st,
                PAGE_SIZE, BLOCK_N, Q_SPLIT, P_SPLIT, V_RELOAD, INTERPRET)

    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        o_ptr = OUT + b * stride_ob + t.to(tl.int64)[:, None] * stride_ot + h.to(tl.int64)[:, None] * stride_oh
        dt = OUT.dtype.element_ty
        o0 = _round_bf16(acc0 * inv_l[:, None], ROUND_BF16).to(dt)
        o1 = _round_bf16(acc1 * inv_l[:, None], ROUND_BF16).to(dt)
        o2 = _round_bf16(acc2 * inv_l[:, None], ROUND_BF16).to(dt)
        o3 = _round_bf16(acc3 * inv_l[:, None], ROUND_BF16).to(dt)
        tl.store(o_ptr + (0 * G + offs_g)[None, :], o0, mask=row_ok[:, None])
        tl.store(o_ptr + (1 * G + offs_g)[None, :], o1, mask=row_ok[:, None])
        tl.store(o_ptr + (2 * G + offs_g)[None, :], o2, mask=row_ok[:, None])
        tl.store(o_ptr + (3 * G + offs_g)[None, :], o3, mask=row_ok[:, None])
        tl.store(LSE + b * stride_lb + t * stride_lt + h, lse, mask=row_ok)
    else:  # the combine kernel reads only the splits that hold tokens (start < end)
        w_ok = row_ok & (start < end)
        o_ptr = OP + b * stride_opb + rows.to(tl.int64)[:, None] * stride_opr + sp * stride_ops
        tl.store(o_ptr + (0 * G + offs_g)[None, :], acc0 * inv_l[:, None], mask=w_ok[:, None])
        tl.store(o_ptr + (1 * G + offs_g)[None, :], acc1 * inv_l[:, None], mask=w_ok[:, None])
        tl.store(o_ptr + (2 * G + offs_g)[None, :], acc2 * inv_l[:, None], mask=w_ok[:, None])
        tl.store(o_ptr + (3 * G + offs_g)[None, :], acc3 * inv_l[:, None], mask=w_ok[:, None])
        tl.store(LP + b * stride_lpb + rows * stride_lpr + sp, lse, mask=w_ok)


@triton.jit
def _mla_fp8_combine_kernel(
    OP, LP, SEQ, OUT, LSE,
    stride_opb, stride_opr, stride_ops, stride_lpb, stride_lpr,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    num_heads, num_splits,
    BLOCK_N: tl.constexpr, SPLITS_P2: tl.constexpr, DV: tl.constexpr, INTERPRET: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = r // num_heads
    h = r % num_heads
    seqlen = tl.load(SEQ + b)
    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    n_used = tl.minimum(tl.cdiv(seqlen, tl.maximum(split_len, 1)), num_splits)  # splits the partial kernel wrote

    offs_s = tl.arange(0, SPLITS_P2)
    lse_s = tl.load(LP + b * stride_lpb + r * stride_lpr + offs_s, mask=offs_s < n_used, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp(lse_s - m_use), axis=0)

    offs_d = tl.arange(0, DV)
    acc = tl.zeros([DV], dtype=tl.float32)
    o_row = OP + b * stride_opb + r * stride_opr
    if INTERPRET:  # see _mla_fp8_split_kernel
        s = 0
        while s < n_used:
            w = tl.exp(tl.load(LP + b * stride_lpb + r * stride_lpr + s) - m_use)
            acc += w * tl.load(o_row + s * stride_ops + offs_d)
            s += 1
    else:
        for s in range(0, n_used):
            w = tl.exp(tl.load(LP + b * stride_lpb + r * stride_lpr + s) - m_use)
            acc += w * tl.load(o_row + s * stride_ops + offs_d)
    has = w_sum > 0
    out = acc * tl.where(has, 1.0 / tl.where(has, w_sum, 1.0), 0.0)
    out = _round_bf16(out, ROUND_BF16)
    tl.store(OUT + b * stride_ob + t * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))
    tl.store(LSE + b * stride_lb + t * stride_lt + h, tl.where(has, m_use + tl.log(tl.where(has, w_sum, 1.0)),
                                                                   float("-inf")))


# ----------------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------------

_POISON_WORKSPACE = False  # tests set this: split-KV partial buffers start as NaN instead of uninitialised


def mla_decode_fp8(q: torch.Tensor, kv_cache, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   softmax_scale: float, metadata: MLADecodeMetadata | None = None, causal: bool = True,
                   return_lse: bool = False, out: torch.Tensor | None = None, precise_q: bool = False,
                   precise_pv: bool = False):
    """MLA decode over the FP8 paged cache.

    q [B, q_len, H, 576] (bf16; fp16/fp32 accepted), kv_cache = (kv_fp8 [P, page, 576] (or [P, page, 1, 576]),
    kv_scales [P, page, 5] float32), block_table [B, max_pages] int32, cache_seqlens [B] int32 (>= q_len;
    includes the q_len new tokens). With causal (only matters for q_len > 1) query i sees positions
    < seqlen - q_len + i + 1. Returns out [B, q_len, H, 512] in q's dtype, and with return_lse also
    lse [B, q_len, H] float32 (natural log; -inf for a row that sees no token).

    precise_q / precise_pv (off by default; for accuracy A/B runs): carry Q / P as two FP8 terms, hi + lo/16,
    each costing a second set of FP8 dots (+53% / +47% tensor-core work). Q's rounding error is the same for
    every token, so it moves the whole attention distribution coherently and, with outlier channels, is the
    largest FP8 error term; P's is independent per token and averages out in part. See the module docstring.
    """
    kv_data, kv_scales = _cache_views(*kv_cache)
    B, q_len, H, D = q.shape
    assert D == HEAD_DIM_QK, f"q last dim must be {HEAD_DIM_QK}, got {D}"
    assert q.stride(-1) == 1, "q must be contiguous in its last dim"
    page_size = kv_data.shape[1]
    assert page_size >= 1 and page_size & (page_size - 1) == 0, f"page_size must be a power of two, got {page_size}"
    assert block_table.dim() == 2 and block_table.shape[0] >= B, tuple(block_table.shape)
    assert cache_seqlens.numel() == B
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)
    if metadata is None:
        metadata = get_mla_decode_metadata(cache_seqlens, H, q_len)
    rows = q_len * H
    assert metadata.num_row_blocks == triton.cdiv(rows, metadata.block_h), "metadata is for another heads x q_len"
    S = metadata.num_splits
    if out is None:
        out = torch.empty((B, q_len, H, KV_LORA_RANK), dtype=q.dtype, device=q.device)
    assert out.shape == (B, q_len, H, KV_LORA_RANK) and out.stride(-1) == 1
    lse = torch.empty((B, q_len, H), dtype=torch.float32, device=q.device)
    if B == 0:
        return (out, lse) if return_lse else out
    direct = S == 1
    if direct:
        op = lp = lse  # unused
        sop = (0, 0, 0)
        slp = (0, 0)
    else:
        op = torch.empty((B, rows, S, KV_LORA_RANK), dtype=torch.float32, device=q.device)
        lp = torch.empty((B, rows, S), dtype=torch.float32, device=q.device)
        if _POISON_WORKSPACE:  # tests: a split read but never written shows up as NaN
            op.fill_(float("nan"))
            lp.fill_(float("nan"))
        sop = (op.stride(0), op.stride(1), op.stride(2))
        slp = (lp.stride(0), lp.stride(1))
    grid = (metadata.num_row_blocks, S, B)
    round_bf16 = _INTERPRETED and out.dtype == torch.bfloat16
    _mla_fp8_split_kernel[grid](
        q, kv_data, kv_scales, block_table, cache_seqlens, op, lp, out, lse,
        float(softmax_scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        kv_data.stride(0), kv_data.stride(1), kv_scales.stride(0), kv_scales.stride(1), block_table.stride(0),
        *sop, *slp,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        H, rows, q_len, S,
        PAGE_SIZE=page_size, BLOCK_H=metadata.block_h, BLOCK_N=metadata.block_n,
        CAUSAL=bool(causal), DIRECT=direct, Q_SPLIT=bool(precise_q), P_SPLIT=bool(precise_pv),
        V_RELOAD=metadata.v_reload,
        INTERPRET=_INTERPRETED, ROUND_BF16=round_bf16,
        num_warps=metadata.num_warps, num_stages=metadata.num_stages,
    )
    if not direct:
        _mla_fp8_combine_kernel[(rows, B)](
            op, lp, cache_seqlens, out, lse, *sop, *slp,
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            H, S, BLOCK_N=metadata.block_n, SPLITS_P2=max(triton.next_power_of_2(S), 2), DV=KV_LORA_RANK,
            INTERPRET=_INTERPRETED, ROUND_BF16=round_bf16,
            num_warps=4,
        )
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------------------------
# References (plain torch, float32)
# ----------------------------------------------------------------------------------------------------------------

def _gather_tokens(cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    page_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    pages = block_table[b, pos // page_size].long()
    return cache[pages, pos % page_size]


def _attend(q: torch.Tensor, cache: torch.Tensor, block_table, cache_seqlens, softmax_scale: float, causal: bool):
    """q [B, T, H, 576] fp32, cache [P, page, 576] fp32 -> (out [B, T, H, 512] fp32, lse [B, T, H] fp32)."""
    B, T, H, _ = q.shape
    out = torch.zeros((B, T, H, KV_LORA_RANK), dtype=torch.float32, device=q.device)
    lse = torch.full((B, T, H), float("-inf"), dtype=torch.float32, device=q.device)
    seqlens = [int(x) for x in cache_seqlens.tolist()]
    for b in range(B):
        n = seqlens[b]
        if n <= 0:
            continue
        kv = _gather_tokens(cache, block_table, b, n).float()
        s = torch.einsum("thd,nd->thn", q[b].float(), kv) * softmax_scale
        if causal:
            lim = n - T + 1 + torch.arange(T, device=q.device)
            s = s.masked_fill(torch.arange(n, device=q.device)[None, None, :] >= lim[:, None, None], float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        ok = torch.isfinite(l)
        p = torch.where(ok[..., None], torch.exp(s - torch.where(ok, l, 0.0)[..., None]), 0.0)
        out[b] = torch.einsum("thn,nc->thc", p, kv[:, :KV_LORA_RANK])
        lse[b] = l
    return out, lse


def mla_decode_exact(q: torch.Tensor, latent_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool = True):
    """Float32 attention on the original inputs: q [B, T, H, 576], latent_cache [P, page, 576] (bf16 cache).
    Returns (out [B, T, H, 512] fp32, lse [B, T, H] fp32)."""
    if latent_cache.dim() == 4:
        latent_cache = latent_cache.squeeze(2)
    return _attend(q.float(), latent_cache.float(), block_table, cache_seqlens, softmax_scale, causal)


def mla_decode_reference(q: torch.Tensor, kv_cache, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                         softmax_scale: float, causal: bool = True, quantize_q: bool = True):
    """The kernel's math in float32 on the dequantized FP8 inputs: dequantized cache and (quantize_q)
    Q quantized and dequantized exactly as the kernel does; no P rounding. Returns (out, lse) fp32."""
    kv_data, kv_scales = _cache_views(*kv_cache)
    cache = dequantize_kv_fp8(kv_data, kv_scales)
    qf = dequantize_kv_fp8(*quantize_q_fp8(q)) if quantize_q else q.float()
    return _attend(qf, cache, block_table, cache_seqlens, softmax_scale, causal)


# ----------------------------------------------------------------------------------------------------------------
# Synthetic DeepSeek-like inputs (tests, benchmarks)
# ----------------------------------------------------------------------------------------------------------------

def make_mla_inputs(cache_seqlens, num_heads: int, q_len: int = 1, page_size: int = 64, *, shared: float = 1.0,
                    outlier_gains=(10.0, 15.0, 20.0, 25.0, 30.0), q_std: float = 0.5, rope_std: float = 2.0,
                    extra_pages: int = 2, poison: bool = True, device="cpu", seed: int = 0) -> dict:
    """Random MLA decode inputs shaped like DeepSeek-V3's, FP8 cache included.

    Latent rows: ``rmsnorm(shared * mu + z) * gamma`` with mu [512] common to all tokens (real latent caches
    are strongly channel-biased; shared=0 gives i.i.d. tokens, the worst case for FP8 P/V rounding) and gamma 1
    except for len(outlier_gains) channels (x10..x30); rope part N(0, rope_std^2), not normalised. q: N(0, q_std^2).
    Pages are shuffled; with poison, every cache slot at or past a sequence's length and a spare page that the
    block table's unused entries point to hold NaN (bf16 and FP8 data, FP8 scales), so any read the kernel
    should not make shows up in its output. Returns a dict: q, latent_cache [P, page, 576] bf16,
    kv_cache (fp8, scales), block_table, cache_seqlens, softmax_scale (1/sqrt(192), DeepSeek's qk head dim).
    """
    seqlens = [int(x) for x in (cache_seqlens.tolist() if torch.is_tensor(cache_seqlens) else cache_seqlens)]
    B = len(seqlens)
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = [triton.cdiv(max(n, 1), page_size) for n in seqlens]
    max_pages = max(pages_per) if B else 1
    num_pages = sum(pages_per) + extra_pages + 1  # + the poison page
    dev = torch.device(device)

    mu = torch.randn(KV_LORA_RANK, generator=g, device=dev)
    gamma = torch.ones(KV_LORA_RANK, device=dev)
    if outlier_gains:
        idx = torch.randperm(KV_LORA_RANK, generator=g, device=dev)[:len(outlier_gains)]
        gamma[idx] = torch.tensor(outlier_gains, dtype=torch.float32, device=dev)
    latent = torch.empty(num_pages, page_size, HEAD_DIM_QK, dtype=torch.bfloat16, device=dev)
    for p0 in range(0, num_pages, 1024):  # chunked, to bound the fp32 temporaries
        p1 = min(p0 + 1024, num_pages)
        z = torch.randn(p1 - p0, page_size, KV_LORA_RANK, generator=g, device=dev) + shared * mu
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
        latent[p0:p1, :, :KV_LORA_RANK] = z.to(torch.bfloat16)
        latent[p0:p1, :, KV_LORA_RANK:] = (torch.randn(p1 - p0, page_size, ROPE_DIM, generator=g, device=dev)
                                           * rope_std).to(torch.bfloat16)
    kv_fp8, kv_scales = quantize_kv_fp8(latent)

    poison_page = num_pages - 1
    perm = torch.randperm(num_pages - 1, generator=g, device=dev)
    block_table = torch.full((B, max_pages), poison_page if poison else 0, dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(seqlens):
        block_table[b, :pages_per[b]] = perm[used:used + pages_per[b]].int()
        used += pages_per[b]
    if poison:
        nan_byte = 0x7F  # float8_e4m3fn NaN
        live = torch.zeros(num_pages * page_size, dtype=torch.bool, device=dev)
        for b, n in enumerate(seqlens):
            pos = torch.arange(n, device=dev)
            live[block_table[b, pos // page_size].long() * page_size + pos % page_size] = True
        dead = ~live
        kv_fp8.view(torch.uint8).view(-1, HEAD_DIM_QK)[dead] = nan_byte
        kv_scales.view(-1, NUM_KV_SCALES)[dead] = float("nan")
        latent.view(-1, HEAD_DIM_QK)[dead] = float("nan")
    q = (torch.randn(B, q_len, num_heads, HEAD_DIM_QK, generator=g, device=dev) * q_std).to(torch.bfloat16)
    return {"q": q, "latent_cache": latent, "kv_cache": (kv_fp8, kv_scales), "block_table": block_table,
            "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32, device=dev),
            "softmax_scale": 1.0 / math.sqrt(192.0)}
