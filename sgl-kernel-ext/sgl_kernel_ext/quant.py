"""FP8 (e4m3) quantization in DeepSeek-V3's block-scaled format, plus the fused SiLU·mul + quant.

Formats (the ones DeepGEMM and SGLang's block-FP8 path use):
  activations  1×`group` per-token-group scales: x[..., K] -> q[..., K] fp8, s[..., K/group] fp32,
               x ≈ q * s[..., k // group]
  weights      `block`×`block` block scales: w[..., N, K] -> q[..., N, K] fp8,
               s[..., ceil(N/block), ceil(K/block)] fp32, w ≈ q * s[..., n // block, k // block]

A scale is amax / 448 (the e4m3 maximum), floored at `eps` so that an all-zero group gives q = 0
and a finite scale. With `scale_ue8m0=True` a scale is rounded up to a power of two (the UE8M0
recipe of DeepSeek-V3.1 / Blackwell DeepGEMM); the default is the plain fp32 scale of V3 on Hopper.

`per_token_group_quant_fp8` and `per_block_quant_fp8` are plain torch (weights are quantized
once at load time; tests and benchmarks make their inputs with them). `silu_mul_quant_fp8` is the
Triton kernel that sits between the MoE up (gate_up) and down GEMMs: out = SiLU(gate) · up in fp32,
then per-token-group FP8 quantization, in one pass over x (SGLang's unfused path writes the bf16
product and reads it back to quantize). `silu_mul_quant_fp8_reference` is the same math in torch.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.hostmath import cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
EPS = 1e-10


def _scale(amax: torch.Tensor, eps: float, scale_ue8m0: bool) -> torch.Tensor:
    s = amax.clamp_min(eps) / FP8_MAX
    if scale_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    return s


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, eps: float = EPS,
                              scale_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % group == 0) -> (q fp8 [..., K], scales fp32 [..., K/group]), row-major scales."""
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"last dim {k} is not a multiple of the group size {group}")
    xg = x.float().reshape(*x.shape[:-1], k // group, group)
    s = _scale(xg.abs().amax(dim=-1), eps, scale_ue8m0)
    q = (xg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(x.shape)
    return q, s.contiguous()


def per_block_quant_fp8(w: torch.Tensor, block: int = 128, eps: float = EPS,
                        scale_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q fp8 [..., N, K], scales fp32 [..., ceil(N/block), ceil(K/block)]).

    Edge blocks (N or K not a multiple of `block`) take the amax of their real elements only.
    """
    *lead, n, k = w.shape
    nb, kb = cdiv(n, block), cdiv(k, block)
    wp = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=w.device)
    wp[..., :n, :k] = w.float()
    wb = wp.reshape(*lead, nb, block, kb, block)
    s = _scale(wb.abs().amax(dim=(-3, -1)), eps, scale_ue8m0)  # [..., nb, kb]
    q = (wb / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return q, s.contiguous()


def dequant_per_token_group(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Inverse of per_token_group_quant_fp8, in float32 (any scale strides)."""
    group = q.shape[-1] // s.shape[-1]
    return q.float() * s.float().repeat_interleave(group, dim=-1)


def dequant_per_block(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of per_block_quant_fp8, in float32."""
    n, k = q.shape[-2:]
    full = s.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * full[..., :n, :k]


# ---------------------------------------------------------------------------------------------
# Fused SiLU(gate) * up -> per-token-group FP8
# ---------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic.

    Only compiled in under TRITON_INTERPRET=1: triton 3.6's interpreter converts fp32 -> fp8 with a
    mantissa carry that is dropped (7.83 becomes 4.0, not 8.0), so the kernel hands it values that
    are already on the fp8 grid and the conversion is exact. On a GPU the native cvt.rn is used.
    """
    a = tl.abs(v)
    e = tl.floor(tl.log2(tl.maximum(a, 0.015625)))  # 2^-6: smallest normal e4m3 binade
    spacing = tl.exp2(e - 3.0)  # 3 mantissa bits
    r = ((a / spacing + 12582912.0) - 12582912.0) * spacing  # 1.5 * 2^23: round to nearest even
    return tl.where(v < 0, -r, r)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, masked_m_ptr,
    stride_xg, stride_xm, stride_xk,
    stride_qg, stride_qm, stride_qk,
    stride_sg, stride_sm, stride_sk,
    I, eps,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, MASKED: tl.constexpr, UE8M0: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    """One program: one row, GROUPS_PER_PROG consecutive quantization groups of the output.

    Builtins only (no tl.sigmoid / tl.max, which are @jit helpers that an interpreted kernel cannot
    call when triton.language was imported before TRITON_INTERPRET=1 was set).
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    n_groups = I // GROUP
    offs_grp = chunk * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_c = tl.arange(0, GROUP)
    col = offs_grp[:, None] * GROUP + offs_c[None, :]  # [GPP, GROUP] output columns
    grp_ok = offs_grp < n_groups
    if MASKED:
        grp_ok = grp_ok & (row < tl.load(masked_m_ptr + g))  # rows past masked_m: no access at all
    ok = grp_ok[:, None] & (offs_c[None, :] < GROUP)
    x_row = x_ptr + g * stride_xg + row.to(tl.int64) * stride_xm
    gate = tl.load(x_row + col * stride_xk, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + (col + I) * stride_xk, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up  # SiLU(gate) * up
    amax = tl.reduce(tl.abs(y), 1, _max_combine)
    scale = tl.maximum(amax, eps) / 448.0
    if UE8M0:
        scale = tl.exp2(tl.ceil(tl.log2(scale)))
    q = tl.clamp(y / scale[:, None], -448.0, 448.0)
    if EXACT_ROUND:
        q = _round_to_e4m3_grid(q)
    q_row = q_ptr + g * stride_qg + row.to(tl.int64) * stride_qm
    tl.store(q_row + col * stride_qk, q.to(q_ptr.dtype.element_ty), mask=ok)
    s_row = s_ptr + g * stride_sg + row.to(tl.int64) * stride_sm
    tl.store(s_row + offs_grp * stride_sk, scale, mask=grp_ok)


def silu_mul_quant_fp8(x: torch.Tensor, group: int = 128, masked_m: torch.Tensor | None = None,
                       eps: float = EPS, scale_ue8m0: bool = False,
                       groups_per_program: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(x[..., :I]) * x[..., I:] quantized per 1×`group` token group.

    x: [M, 2I] (contiguous MoE layout) or [G, max_m, 2I] (masked layout, with `masked_m` [G] int32:
    rows t >= masked_m[g] are neither read nor written, their outputs stay uninitialized).
    Returns (q fp8 [..., I], scales fp32 [..., I/group]) in the layout the grouped GEMMs take.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [M, 2I] or [G, max_m, 2I], got {tuple(x.shape)}")
    if masked_m is not None and x.dim() != 3:
        raise ValueError("masked_m needs x of shape [G, max_m, 2I]")
    two_i = x.shape[-1]
    if two_i % (2 * group):
        raise ValueError(f"last dim {two_i} must be 2*I with I a multiple of {group}")
    inter = two_i // 2
    q = torch.empty(*x.shape[:-1], inter, dtype=FP8, device=x.device)
    s = torch.empty(*x.shape[:-1], inter // group, dtype=torch.float32, device=x.device)
    x3, q3, s3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (x, q, s))
    ngroups, rows = x3.shape[0], x3.shape[1]
    if rows == 0 or ngroups == 0:
        return q, s
    gpp = min(triton.next_power_of_2(groups_per_program), triton.next_power_of_2(inter // group))
    grid = (rows, cdiv(inter // group, gpp), ngroups)
    _silu_mul_quant_kernel[grid](
        x3, q3, s3, masked_m if masked_m is not None else x3,
        *x3.stride(), *q3.stride(), *s3.stride(),
        inter, eps,
        GROUP=group, GROUPS_PER_PROG=gpp, MASKED=masked_m is not None, UE8M0=scale_ue8m0,
        EXACT_ROUND=_interpreting(), num_warps=4,
    )
    return q, s


def silu_mul_quant_fp8_reference(x: torch.Tensor, group: int = 128, eps: float = EPS,
                                 scale_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math in torch (fp32 product, no bf16 round-trip), for every row."""
    inter = x.shape[-1] // 2
    xf = x.float()
    y = torch.nn.functional.silu(xf[..., :inter]) * xf[..., inter:]
    return per_token_group_quant_fp8(y, group, eps, scale_ue8m0)
