"""FP8 MLA decode for DeepSeek-V2/V3 over a paged FP8 latent cache (Triton, Hopper first).

Interface in FlashMLA's manner::

    meta = get_mla_decode_metadata(cache_seqlens, num_heads, q_len)
    out = mla_decode_fp8(q, (kv_fp8, kv_scales), block_table, cache_seqlens, softmax_scale, meta)

with ``q [B, q_len, H, 576]`` bf16 (absorbed query: 512 latent + 64 rope), the paged cache
``kv_fp8 [num_pages, page_size, 576]`` and ``out [B, q_len, H, 512]`` bf16. V is the first 512 channels
of the same latent cache, as in FlashMLA and SGLang's MLA backends.

KV cache format (chosen here; 584 bytes/token against 1152 for BF16, 0.507x)
------------------------------------------------------------------------------
Per token: the 576 channels as FP8 e4m3 (576 B), plus 2 float32 scales (8 B): one for the 512 latent
channels and one for the 64 rope channels. ``value = fp8 * scale``, ``scale = amax(|part|) / 448`` (1.0 for
an all-zero part). Two tensors:

    kv_fp8    [num_pages, page_size, 576]  float8_e4m3fn (uint8 storage accepted)
    kv_scales [num_pages, page_size, 2]    float32

Why one latent scale per token and a separate rope scale:

* The rope part is not RMS-normalised (DeepSeek normalises only the 512-d latent before caching), so its
  magnitude is unrelated to the latent's: sharing one scale would let the larger part coarsen the other.
* The latent is RMS-normalised per token, so one scale per token keeps every channel within e4m3's range
  (2^-9..448 around the token's amax): a channel 30x below the outliers still keeps its 3 mantissa bits, and
  channels far below amax/448 contribute nothing measurable to a dot product anyway.
* One latent scale keeps the kernel's MMAs whole: QK^T is one FP8 dot over the 512 latent channels plus one
  over the 64 rope channels, each scaled by an outer product of Q and K scales; PV is one FP8 dot with the
  V scale (the latent scale) folded into P. Finer groups cost 4 separate dots and 4 P quantizations per tile.
* It is quantizable on the fly, token by token, when SGLang writes K/V: no calibration, no history.
  :func:`store_kv_fp8` quantizes and scatters a batch of new tokens into the paged cache.

FP8 math in the kernel
----------------------
* Q is quantized once per call by a small kernel (per (token, head): latent and rope scales, as for K),
  into a [rows, 576] FP8 buffer the decode kernel reads with TMA; the QK scale is ``s_q * s_k`` per part
  (softmax scale and log2(e) are applied with it). FP8 x FP8 products are exact; accumulation is fp32.
* Online softmax in fp32, base 2. P = exp2(s - m) lies in [0, 1].
* PV, default (``pv_16bit``): V's FP8 tile is dequantized in registers (times its token's scale) to fp16 and
  multiplied with P in fp16 on 16-bit tensor cores. Why not FP8: FP8 wgmma takes both operands K-major only,
  and V's reduction dimension is the token, so an FP8 PV has to transpose every V tile through registers and
  shared memory; measured on the H200 that costs ~2.9x the whole kernel (../NOTES.md). 16-bit wgmma reads the
  token-major tile as it lies. So QK^T (576 of the 1088 MACs per (row, token)) runs in FP8, PV in fp16.
* PV in FP8 (``pv_16bit=False``): ``O[h, c] = sum_n P[h, n] * V8[n, c] * s_v[n]``. The V scale varies along
  the reduction dimension n, so it is folded into P: ``P' = P * s_v[n] / c * 448`` with c the largest s_v of
  the tile (so P' <= 448), P' quantized to FP8, and the dot scaled back by ``c / 448``.
  The softmax denominator uses the unquantized fp32 P in both forms.
* Error: every e4m3 rounding carries about 2.7% rms relative error; the roundings of K, V and P are independent
  across tokens and partly average out in the output; Q's is shared by every token. See the GPU tests for the
  bounds asserted against float32 attention on the bf16 inputs.

Kernels
-------
1. ``_quant_rows_kernel`` (``_quantize_q``; the same kernel quantizes K/V rows on store): q [B, q_len, H, 576]
   -> q8 [B * q_len * H, 576] FP8 + [.., 2] fp32 scales.
2. ``_mla_fp8_split_kernel``: grid (row_blocks x value_blocks, num_splits, B). Query rows are (q position,
   head) pairs packed q-major, BLOCK_H = 64 rows per program (FP8 wgmma's M; an MTP step reads each KV tile
   once for all its query positions). The 512 value channels are cut into value blocks of BLOCK_V: each
   program recomputes the (cheap) QK^T for its rows and keeps a [64, BLOCK_V] fp32 accumulator, which is
   what keeps the kernel in registers (a [64, 512] accumulator spills under Triton). Q, K and V tiles arrive
   by TMA (tensor descriptors over the flat [slots, 576] cache; a BLOCK_N-token tile lies inside one page).
   With one split it writes bf16 output and lse directly; otherwise a normalised fp32 partial and its lse.
3. ``_mla_fp8_combine_kernel``: grid (rows, B); merges the non-empty splits of a row through their lse.

Split count at run time (CUDA graphs): a captured launch keeps its grid, so its split count was chosen from the
capture's length bound (the model's context length), far more splits than the lengths of a later replay need
(fp32 partials written and combined for nothing). With ``metadata.splits_dev`` (a device int32 [1]) both
kernels cut the sequences into that many splits instead, at most the grid's ``num_splits``; the programs past it
return at once. :func:`splits_lut` and :func:`set_splits` fill it from the lengths on the GPU, without a sync.

References: :func:`mla_decode_exact` (fp32 math on the bf16 inputs) and :func:`mla_decode_reference`
(fp32 math on the dequantized FP8 cache and the quantize-dequantized Q, i.e. everything but P rounding).

Tuning: ``bench_mla_decode.py --configs 64x32x512x8x2b 64x32x256x8x2`` times variants (b: fp16 PV). What each
version measured, and why the CUDA kernels (`mla_decode_cuda`) replaced this one on Hopper: ../NOTES.md
("FP8 MLA decode").
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.hostmath import cdiv

__all__ = [
    "FP8_MAX", "KV_LORA_RANK", "ROPE_DIM", "HEAD_DIM_QK", "NUM_KV_SCALES", "KV_BYTES_PER_TOKEN",
    "MLADecodeMetadata", "get_mla_decode_metadata", "mla_decode_fp8",
    "quantize_kv_fp8", "dequantize_kv_fp8", "quantize_q_fp8", "store_kv_fp8", "store_kv_fp8_torch",
    "mla_decode_reference", "mla_decode_exact", "make_mla_inputs",
]

FP8_MAX = 448.0                      # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
KV_LORA_RANK = 512                   # latent channels, also V's width
ROPE_DIM = 64
HEAD_DIM_QK = KV_LORA_RANK + ROPE_DIM  # 576
NUM_KV_SCALES = 2                    # latent, rope
KV_BYTES_PER_TOKEN = HEAD_DIM_QK + 4 * NUM_KV_SCALES  # 584
LOG2E = 1.4426950408889634


@triton.jit
def _probe():
    pass


# Triton decides at decoration time whether a kernel is compiled or interpreted (TRITON_INTERPRET=1).
_INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------------------------
# Quantization (torch): the format's definition
# ----------------------------------------------------------------------------------------------------------------

def _quant_part(x: torch.Tensor):
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_kv_fp8(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [..., 576] (bf16/fp16/fp32) -> (kv_fp8 [..., 576] float8_e4m3fn, scales [..., 2] float32).

    scales[..., 0] = amax(|latent[..., :512]|) / 448, scales[..., 1] the same over the rope channels 512..575;
    1.0 where a part is all zero. Dequantize with :func:`dequantize_kv_fp8`.
    """
    assert latent.shape[-1] == HEAD_DIM_QK, f"last dim must be {HEAD_DIM_QK}, got {tuple(latent.shape)}"
    xf = latent.float()
    ql, sl = _quant_part(xf[..., :KV_LORA_RANK])
    qr, sr = _quant_part(xf[..., KV_LORA_RANK:])
    return torch.cat([ql, qr], dim=-1), torch.cat([sl, sr], dim=-1).contiguous()


def dequantize_kv_fp8(kv_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_fp8`: float32 [..., 576]."""
    if kv_fp8.dtype == torch.uint8:
        kv_fp8 = kv_fp8.view(FP8_DTYPE)
    f = kv_fp8.float()
    return torch.cat([f[..., :KV_LORA_RANK] * scales[..., :1], f[..., KV_LORA_RANK:] * scales[..., 1:2]], dim=-1)


def quantize_q_fp8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel's Q pre-pass computes, in torch: per (token, head), latent and rope scales."""
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
def _quant_rows_kernel(X, XR, LOC, OUT, OUTS, N, stride_xn, stride_xrn, stride_on, stride_sn, PAGE_SIZE: tl.constexpr,
                       stride_op, stride_ot, stride_sp, stride_st, PAGED: tl.constexpr, BLOCK_N: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """Rows BLOCK_N i .. of (latent X [N, 512], rope XR [N, 64]) -> FP8 + (latent, rope) scales; written at row i,
    or at paged slot LOC[i] (PAGED). The two parts may be one [N, 576] row (XR = X + 512) or SGLang's two tensors,
    which then need no join. Several rows per program: one row per program left the decode's Q pre-pass
    launch-bound (8 us for the 8192 rows of batch 64 x 128 heads on the H200, 1.7 TB/s)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    if PAGED:
        loc = tl.load(LOC + rows, mask=ok, other=0).to(tl.int64)
        o_base = OUT + (loc // PAGE_SIZE) * stride_op + (loc % PAGE_SIZE) * stride_ot
        s_base = OUTS + (loc // PAGE_SIZE) * stride_sp + (loc % PAGE_SIZE) * stride_st
    else:
        o_base = OUT + rows.to(tl.int64) * stride_on
        s_base = OUTS + rows.to(tl.int64) * stride_sn
    offs_l = tl.arange(0, 512)[None, :]
    offs_r = tl.arange(0, 64)[None, :]
    xl = tl.load((X + rows.to(tl.int64) * stride_xn)[:, None] + offs_l, mask=ok[:, None], other=0.0).to(tl.float32)
    xr = tl.load((XR + rows.to(tl.int64) * stride_xrn)[:, None] + offs_r, mask=ok[:, None], other=0.0).to(tl.float32)
    am_l = tl.max(tl.abs(xl), axis=1)
    am_r = tl.max(tl.abs(xr), axis=1)
    s_l = tl.where(am_l > 0, am_l / 448.0, 1.0)
    s_r = tl.where(am_r > 0, am_r / 448.0, 1.0)
    tl.store(o_base[:, None] + offs_l, _to_fp8(tl.clamp(xl / s_l[:, None], -448.0, 448.0), INTERPRET),
             mask=ok[:, None])
    tl.store(o_base[:, None] + 512 + offs_r, _to_fp8(tl.clamp(xr / s_r[:, None], -448.0, 448.0), INTERPRET),
             mask=ok[:, None])
    tl.store(s_base, s_l, mask=ok)
    tl.store(s_base + 1, s_r, mask=ok)


QUANT_ROWS_PER_PROGRAM = 4  # rows of 576 per program of _quant_rows_kernel (4 warps)


def store_kv_fp8(kv_fp8: torch.Tensor, kv_scales: torch.Tensor, loc: torch.Tensor, latent: torch.Tensor,
                 rope: torch.Tensor | None = None) -> None:
    """The store path (one Triton launch): quantize latent [N, 576] per :func:`quantize_kv_fp8` and write it
    into the paged cache at flat slots loc [N] (slot = page * page_size + offset within the page). With rope
    [N, 64], latent is the [N, 512] part and the two are read where they are (SGLang's MLA writes: no torch.cat)."""
    data, scales = _cache_views(kv_fp8, kv_scales)
    n = latent.shape[0]
    if n == 0:
        return
    if rope is None:
        assert latent.shape[-1] == HEAD_DIM_QK and latent.stride(-1) == 1
        rope = latent[:, KV_LORA_RANK:]
    assert latent.shape[-1] in (KV_LORA_RANK, HEAD_DIM_QK) and rope.shape == (n, ROPE_DIM), (latent.shape, rope.shape)
    assert latent.stride(-1) == 1 and rope.stride(-1) == 1 and rope.dtype == latent.dtype
    assert data.stride(-1) == 1 and scales.stride(-1) == 1
    _quant_rows_kernel[(cdiv(n, QUANT_ROWS_PER_PROGRAM),)](
        latent, rope, loc, data, scales, n, latent.stride(0), rope.stride(0), 0, 0, data.shape[1],
        data.stride(0), data.stride(1), scales.stride(0), scales.stride(1),
        PAGED=True, BLOCK_N=QUANT_ROWS_PER_PROGRAM, INTERPRET=_INTERPRETED, num_warps=4)


def _quantize_q(q: torch.Tensor):
    """q [B, T, H, 576] -> (q8 [B*T*H, 576] float8_e4m3fn, scales [B*T*H, 2] fp32), one launch."""
    x = q.reshape(-1, HEAD_DIM_QK)
    n = x.shape[0]
    q8 = torch.empty((n, HEAD_DIM_QK), dtype=FP8_DTYPE, device=q.device)
    qs = torch.empty((n, NUM_KV_SCALES), dtype=torch.float32, device=q.device)
    if n:
        _quant_rows_kernel[(cdiv(n, QUANT_ROWS_PER_PROGRAM),)](
            x, x[:, KV_LORA_RANK:], x, q8, qs, n, x.stride(0), x.stride(0), q8.stride(0), qs.stride(0), 1, 0, 0, 0, 0,
            PAGED=False, BLOCK_N=QUANT_ROWS_PER_PROGRAM, INTERPRET=_INTERPRETED, num_warps=4)
    return q8, qs


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
    block_n: int         # KV tokens per inner iteration (a divisor of the page size)
    block_v: int         # value channels per program (512 / block_v programs share a row block)
    num_warps: int
    num_stages: int
    num_row_blocks: int
    num_sm: int
    pv_16bit: bool = True  # PV on fp16 MMA (V dequantized in registers, no transpose); QK^T stays FP8
    splits_dev: torch.Tensor | None = None  # device int32 [1]: the split count used at run time (<= num_splits,
    #                                         the grid's); set for a CUDA graph whose replays vary in length


def _default_num_sm() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132  # H200/H100 SXM; H20 has 78


def get_mla_decode_metadata(cache_seqlens: torch.Tensor, num_heads: int, q_len: int = 1,
                            num_sm: int | None = None, *, max_seqlen: int | None = None,
                            block_h: int = 64, block_n: int = 32, block_v: int = 512, num_warps: int = 8,
                            num_stages: int = 2, waves: float = 2.0, min_split_tokens: int = 128,
                            max_splits: int = 64, pv_16bit: bool = True) -> MLADecodeMetadata:
    """Choose the split-KV factor: enough programs for ``waves`` x num_sm (B x row_blocks x value blocks x
    splits), but no split shorter than ``min_split_tokens`` of the longest sequence, and at most ``max_splits``.

    ``max_seqlen`` avoids reading cache_seqlens (a device sync when it lives on the GPU; pass it, e.g. the
    CUDA-graph bucket's bound, on a hot path).

    block_h is 64 query rows even for 16 heads x q_len 1 (rows past q_len x heads are masked), as FlashMLA does:
    Triton 3.6 lowers an FP8 tl.dot with M < 64 on sm_90 to f16 mma.sync, not to FP8 wgmma (M = 64 per
    warpgroup). Smaller block_h stays available for tests.
    """
    if num_heads < 1 or q_len < 1:
        raise ValueError(f"num_heads={num_heads}, q_len={q_len}")
    if block_n < 32 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 32 (FP8 MMA k-step), got {block_n}")
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    if block_v not in (64, 128, 256, 512):
        raise ValueError(f"block_v must be 64, 128, 256 or 512, got {block_v}")
    rows = num_heads * q_len
    num_sm = num_sm or _default_num_sm()
    batch = cache_seqlens.numel()
    row_blocks = cdiv(rows, block_h)
    if max_seqlen is None:
        max_seqlen = int(cache_seqlens.max().item()) if batch else 1
    max_seqlen = max(int(max_seqlen), 1)
    useful = cdiv(max_seqlen, max(min_split_tokens, block_n))
    programs = max(batch * row_blocks * (KV_LORA_RANK // block_v), 1)
    want = cdiv(int(math.ceil(waves * num_sm)), programs)
    num_splits = max(1, min(want, useful, max_splits))
    return MLADecodeMetadata(num_splits=num_splits, block_h=block_h, block_n=block_n, block_v=block_v,
                             num_warps=num_warps, num_stages=num_stages, num_row_blocks=row_blocks, num_sm=num_sm,
                             pv_16bit=pv_16bit)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _run_splits(SPLITS, num_splits, DYN_SPLITS: tl.constexpr):
    """The split count this launch cuts sequences into: the grid's, or the device value (clamped to 1..grid's)."""
    if DYN_SPLITS:
        num_splits = tl.minimum(tl.maximum(tl.load(SPLITS), 1), num_splits)
    return num_splits


@triton.jit
def _mla_fp8_split_kernel(
    Q8_LAT, Q8_ROPE, QS, K_LAT, K_ROPE, V, KVS, BT, SEQ, OP, LP, OUT, LSE,
    qk_scale,
    stride_sp, stride_st, stride_btb,
    stride_opb, stride_opr, stride_ops, stride_lpb, stride_lpr,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    num_heads, num_rows, q_len, num_splits, SPLITS,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    PV_16BIT: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr, INTERPRET: tl.constexpr, ROUND_BF16: tl.constexpr,
    DYN_SPLITS: tl.constexpr,
):
    L: tl.constexpr = 512
    NUM_VB: tl.constexpr = L // BLOCK_V
    rb = tl.program_id(0) // NUM_VB
    vb = tl.program_id(0) % NUM_VB
    sp = tl.program_id(1)
    b = tl.program_id(2)

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

    num_splits = _run_splits(SPLITS, num_splits, DYN_SPLITS)
    split_len = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = sp * split_len
    end = tl.minimum(start + split_len, seqlen)  # empty for splits past a short sequence: nothing stored

    # Q: this row block of the pre-quantized [B * rows, 576] buffer (rows past num_rows belong to the next
    # sequence or lie past the end, where TMA fills zeros; they see no token and are not stored)
    q_row0 = b * num_rows + rb * BLOCK_H
    q_lat = Q8_LAT.load([q_row0, 0])
    q_rope = Q8_ROPE.load([q_row0, L])
    qs_off = (b * num_rows + rows).to(tl.int64) * 2
    sq_lat = tl.load(QS + qs_off, mask=row_ok, other=1.0) * qk_scale
    sq_rope = tl.load(QS + qs_off + 1, mask=row_ok, other=1.0) * qk_scale

    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb

    # A `for` over runtime bounds is what Triton software-pipelines (num_stages) on the GPU. The interpreter
    # (TRITON_INTERPRET=1) cannot run one under numpy >= 2.4 (its scalars are 1-element arrays, and int() of
    # those now raises), so there the same body runs in a `while`.
    if INTERPRET:
        n0 = start
        while n0 < end:
            m_i, l_i, acc = _kv_tile(n0, end, row_end, m_i, l_i, acc, q_lat, q_rope, sq_lat, sq_rope,
                                     K_LAT, K_ROPE, V, KVS, bt_row, stride_sp, stride_st, vb,
                                     PAGE_SIZE, BLOCK_N, BLOCK_V, PV_16BIT, INTERPRET)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _kv_tile(n0, end, row_end, m_i, l_i, acc, q_lat, q_rope, sq_lat, sq_rope,
                                     K_LAT, K_ROPE, V, KVS, bt_row, stride_sp, stride_st, vb,
                                     PAGE_SIZE, BLOCK_N, BLOCK_V, PV_16BIT, INTERPRET)

    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    if DIRECT:
        o_ptr = OUT + b.to(tl.int64) * stride_ob + t.to(tl.int64)[:, None] * stride_ot \
            + h.to(tl.int64)[:, None] * stride_oh + offs_v[None, :]
        o = _round_bf16(acc * inv_l[:, None], ROUND_BF16).to(OUT.dtype.element_ty)
        tl.store(o_ptr, o, mask=row_ok[:, None])
        if vb == 0:
            tl.store(LSE + b.to(tl.int64) * stride_lb + t * stride_lt + h, lse, mask=row_ok)
    else:  # the combine kernel reads only the splits that hold tokens (start < end)
        w_ok = row_ok & (start < end)
        o_ptr = OP + b.to(tl.int64) * stride_opb + rows.to(tl.int64)[:, None] * stride_opr + sp * stride_ops
        tl.store(o_ptr + offs_v[None, :], acc * inv_l[:, None], mask=w_ok[:, None])
        if vb == 0:
            tl.store(LP + b.to(tl.int64) * stride_lpb + rows * stride_lpr + sp, lse, mask=w_ok)


@triton.jit
def _kv_tile(n0, end, row_end, m_i, l_i, acc, q_lat, q_rope, sq_lat, sq_rope,
             K_LAT, K_ROPE, V, KVS, bt_row, stride_sp, stride_st, vb,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PV_16BIT: tl.constexpr,
             INTERPRET: tl.constexpr):
    """One BLOCK_N-token step (inside one page): FP8 QK^T, online softmax, FP8 PV into this value block."""
    L: tl.constexpr = 512
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < end
    page = tl.load(bt_row + n0 // PAGE_SIZE)
    slot = page * PAGE_SIZE + n0 % PAGE_SIZE
    k_lat = K_LAT.load([slot, 0])          # [BLOCK_N, 512]
    k_rope = K_ROPE.load([slot, L])        # [BLOCK_N, 64]
    s_tok = page.to(tl.int64) * stride_sp + (offs_n % PAGE_SIZE) * stride_st
    s_lat = tl.load(KVS + s_tok, mask=n_ok, other=0.0)
    s_rope = tl.load(KVS + s_tok + 1, mask=n_ok, other=0.0)

    # S = Q K^T in log2 units: two FP8 dots, each with its outer-product scale
    qk = tl.dot(q_lat, tl.trans(k_lat)) * (sq_lat[:, None] * s_lat[None, :])
    qk += tl.dot(q_rope, tl.trans(k_rope)) * (sq_rope[:, None] * s_rope[None, :])
    visible = n_ok[None, :] & (offs_n[None, :] < row_end[:, None])
    qk = tl.where(visible, qk, float("-inf"))  # also drops whatever lies in the page past `end` (NaN included)

    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # O += P diag(s_v) V8, the V scale folded into P; V rows past `end` zeroed (0 x NaN would poison the MMA)
    if BLOCK_V == L:
        v = k_lat
    else:
        v = V.load([slot, vb * BLOCK_V])   # [BLOCK_N, BLOCK_V]
    if PV_16BIT:  # 16-bit MMA takes V as it lies (token-major); FP8 MMA needs it transposed through registers
        v = tl.where(n_ok[:, None], v.to(tl.float32) * s_lat[:, None], 0.0).to(tl.float16)  # |v| <= amax
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
    else:
        v = tl.where(n_ok[:, None], v.to(tl.uint8, bitcast=True), 0).to(tl.float8e4nv, bitcast=True)
        c = tl.maximum(tl.max(s_lat, axis=0), 1e-30)
        p8 = _to_fp8(tl.minimum(p * (s_lat * (448.0 / c))[None, :], 448.0), INTERPRET)
        acc = acc * alpha[:, None] + tl.dot(p8, v) * (c / 448.0)
    return m_new, l_i, acc


@triton.jit
def _mla_fp8_combine_kernel(
    OP, LP, SEQ, OUT, LSE,
    stride_opb, stride_opr, stride_ops, stride_lpb, stride_lpr,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    num_heads, num_splits, SPLITS,
    BLOCK_N: tl.constexpr, SPLITS_P2: tl.constexpr, DV: tl.constexpr, INTERPRET: tl.constexpr,
    ROUND_BF16: tl.constexpr, DYN_SPLITS: tl.constexpr,
):
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    t = r // num_heads
    h = r % num_heads
    seqlen = tl.load(SEQ + b)
    num_splits = _run_splits(SPLITS, num_splits, DYN_SPLITS)
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
            acc += w * tl.load(o_row + s * stride_ops + offs_d).to(tl.float32)
            s += 1
    else:
        for s in range(0, n_used):
            w = tl.exp(tl.load(LP + b * stride_lpb + r * stride_lpr + s) - m_use)
            acc += w * tl.load(o_row + s * stride_ops + offs_d).to(tl.float32)
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


def decode_args(q: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                metadata: MLADecodeMetadata | None, out: torch.Tensor | None):
    """The decode entries' common argument handling: a table row and a length per sequence (checked), int32 block
    table and lengths, the default launch plan, out [B, q_len, H, 512] (made in q's dtype if None) and a fresh
    lse [B, q_len, H] fp32."""
    B, q_len, H, _ = q.shape
    assert block_table.dim() == 2 and block_table.shape[0] >= B, \
        f"block_table must be [>= {B} sequences, pages], got {tuple(block_table.shape)}"
    assert cache_seqlens.numel() == B, f"cache_seqlens must hold {B} lengths, got {cache_seqlens.numel()}"
    if block_table.dtype != torch.int32:
        block_table = block_table.to(torch.int32)
    if cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)
    if metadata is None:
        metadata = get_mla_decode_metadata(cache_seqlens, H, q_len)
    if out is None:
        out = torch.empty((B, q_len, H, KV_LORA_RANK), dtype=q.dtype, device=q.device)
    assert out.shape == (B, q_len, H, KV_LORA_RANK) and out.stride(-1) == 1
    return block_table, cache_seqlens, metadata, out, torch.empty((B, q_len, H), dtype=torch.float32, device=q.device)


def splits_pointer(metadata: MLADecodeMetadata, like: torch.Tensor) -> torch.Tensor:
    """The kernels' SPLITS argument: metadata.splits_dev (checked: int32 on like's device), or `like` itself when
    it is unset (DYN_SPLITS is then False and no kernel reads it)."""
    s = metadata.splits_dev
    if s is None:
        return like
    assert s.dtype == torch.int32 and s.numel() >= 1 and s.device == like.device, \
        "splits_dev must be int32 [1] on the kernel's device"
    return s


def combine_partials(op, lp, cache_seqlens, out, lse, metadata: MLADecodeMetadata, block_n: int,
                     round_bf16: bool = False) -> None:
    """Merge the split kernels' partials op [B, rows, S, 512] / lse lp [B, rows, S] (fp32) into out and lse (the
    Triton and the CUDA split kernels write the same partial format)."""
    B, rows, S = lp.shape
    H = out.shape[2]
    _mla_fp8_combine_kernel[(rows, B)](
        op, lp, cache_seqlens, out, lse, op.stride(0), op.stride(1), op.stride(2), lp.stride(0), lp.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        H, S, splits_pointer(metadata, cache_seqlens), BLOCK_N=block_n, SPLITS_P2=max(triton.next_power_of_2(S), 2),
        DV=KV_LORA_RANK, INTERPRET=_INTERPRETED, ROUND_BF16=round_bf16, DYN_SPLITS=metadata.splits_dev is not None,
        num_warps=4,
    )


def splits_lut(num_heads: int, q_len: int, batch: int, max_seqlen: int, page: int = 64, num_sm: int | None = None,
               device=None, **plan_kw) -> torch.Tensor:
    """get_mla_decode_metadata's split count for every longest length up to max_seqlen, in steps of `page`:
    int32 [cdiv(max_seqlen, page) + 1], entry t for a longest sequence of t pages (entry 0 = entry 1), from the
    planner itself at each length (~15 us each on the host). Built once per captured batch size; set_splits
    indexes it at each replay."""
    lens = torch.ones(max(batch, 1), dtype=torch.int32)
    lut = [get_mla_decode_metadata(lens, num_heads, q_len, num_sm, max_seqlen=max(t, 1) * page, **plan_kw).num_splits
           for t in range(cdiv(max(int(max_seqlen), 1), page) + 1)]
    return torch.tensor(lut, dtype=torch.int32, device=device or "cpu")


# A CUDA graph's grid holds at most this many waves of programs (one program per SM). The grid is planned for the
# longest context a replay may see, and at shorter lengths the programs past the run-time split count exit at once,
# but not for free: on the H200 the old uncapped grid cost 7.5 us at batch 16 and 48 us at batch 128 (x 128 heads,
# 4k tokens; 928 and 4096 idle programs, ~1 us of SM time each) over planning per call (mla_decode_graph_plan_h200
# .json). 4 waves keep the tail of a full-length replay under ~3% (512 programs at batch 16: 3.9 waves).
GRAPH_MAX_WAVES = 4


def graph_metadata(plan, splits_table, batch: int, num_heads: int, q_len: int, max_seqlen: int, page: int,
                   device) -> tuple[MLADecodeMetadata, torch.Tensor | None]:
    """One CUDA-graph batch size's plan, from a kernel's planner and its split table (get_mla_decode_metadata and
    splits_lut of this module or of mla_decode_cuda): the grid planned for max_seqlen (the longest a replay may
    see), capped at GRAPH_MAX_WAVES waves, and the table; when the grid splits, metadata.splits_dev holds the
    count set_splits picks per replay (the kernels clamp it to the grid's). A grid of one split has nothing to
    choose at run time: no splits_dev, and the table (None) is not built."""
    meta = plan(torch.ones(max(batch, 1), dtype=torch.int32), num_heads, q_len, max_seqlen=max_seqlen)
    per_split = max(batch, 1) * meta.num_row_blocks * max(KV_LORA_RANK // meta.block_v, 1)  # programs per split
    cap = max(1, GRAPH_MAX_WAVES * meta.num_sm // per_split)
    if meta.num_splits > cap:
        meta = dataclasses.replace(meta, num_splits=cap)
    if meta.num_splits == 1:
        return meta, None
    table = splits_table(num_heads, q_len, batch, max_seqlen, page, device=device)
    return dataclasses.replace(meta, splits_dev=torch.ones(1, dtype=torch.int32, device=device)), table


def set_splits(splits_dev: torch.Tensor, lut: torch.Tensor, cache_seqlens: torch.Tensor, page: int) -> None:
    """splits_dev <- lut[cdiv(max(cache_seqlens), page)], on the device (no sync): the plan for this step's
    lengths. Lengths past the table's bound use its last entry."""
    t = (cache_seqlens.max().to(torch.int64) + page - 1).div_(page, rounding_mode="floor")
    torch.index_select(lut, 0, t.clamp_(0, lut.numel() - 1).view(1), out=splits_dev.view(1))


def mla_decode_fp8(q: torch.Tensor, kv_cache, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   softmax_scale: float, metadata: MLADecodeMetadata | None = None, causal: bool = True,
                   return_lse: bool = False, out: torch.Tensor | None = None):
    """MLA decode over the FP8 paged cache.

    q [B, q_len, H, 576] (bf16; fp16/fp32 accepted), kv_cache = (kv_fp8 [P, page, 576] (or [P, page, 1, 576]),
    kv_scales [P, page, 2] float32), block_table [B, max_pages] int32, cache_seqlens [B] int32 (>= q_len;
    includes the q_len new tokens). With causal (only matters for q_len > 1) query i sees positions
    < seqlen - q_len + i + 1. Returns out [B, q_len, H, 512] in q's dtype, and with return_lse also
    lse [B, q_len, H] float32 (natural log; -inf for a row that sees no token).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    kv_data, kv_scales = _cache_views(*kv_cache)
    B, q_len, H, D = q.shape
    assert D == HEAD_DIM_QK, f"q last dim must be {HEAD_DIM_QK}, got {D}"
    page_size = kv_data.shape[1]
    assert page_size >= 1 and page_size & (page_size - 1) == 0, f"page_size must be a power of two, got {page_size}"
    assert kv_data.is_contiguous(), "the FP8 cache must be contiguous (read as a flat [slots, 576] TMA tensor)"
    block_table, cache_seqlens, metadata, out, lse = decode_args(q, block_table, cache_seqlens, metadata, out)
    rows = q_len * H
    assert metadata.num_row_blocks == cdiv(rows, metadata.block_h), "metadata is for another heads x q_len"
    assert page_size % metadata.block_n == 0, f"block_n {metadata.block_n} must divide the page size {page_size}"
    S = metadata.num_splits
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

    q8, qs = _quantize_q(q)
    bh, bn, bv = metadata.block_h, metadata.block_n, metadata.block_v
    flat = kv_data.view(-1, HEAD_DIM_QK)
    descs = (TensorDescriptor.from_tensor(q8, [bh, KV_LORA_RANK]), TensorDescriptor.from_tensor(q8, [bh, ROPE_DIM]),
             qs, TensorDescriptor.from_tensor(flat, [bn, KV_LORA_RANK]),
             TensorDescriptor.from_tensor(flat, [bn, ROPE_DIM]), TensorDescriptor.from_tensor(flat, [bn, bv]))
    grid = (metadata.num_row_blocks * (KV_LORA_RANK // bv), S, B)
    round_bf16 = _INTERPRETED and out.dtype == torch.bfloat16
    _mla_fp8_split_kernel[grid](
        *descs, kv_scales, block_table, cache_seqlens, op, lp, out, lse,
        float(softmax_scale) * LOG2E,
        kv_scales.stride(0), kv_scales.stride(1), block_table.stride(0),
        *sop, *slp,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        H, rows, q_len, S, splits_pointer(metadata, cache_seqlens),
        PAGE_SIZE=page_size, BLOCK_H=bh, BLOCK_N=bn, BLOCK_V=bv, PV_16BIT=metadata.pv_16bit,
        CAUSAL=bool(causal), DIRECT=direct, INTERPRET=_INTERPRETED, ROUND_BF16=round_bf16,
        DYN_SPLITS=metadata.splits_dev is not None, num_warps=metadata.num_warps, num_stages=metadata.num_stages,
    )
    if not direct:
        combine_partials(op, lp, cache_seqlens, out, lse, metadata, bn, round_bf16)
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
    pages_per = [cdiv(max(n, 1), page_size) for n in seqlens]
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
