"""Single-batch overlap (SBO) on one GPU: the MoE combine runs while the down GEMM still runs.

Why: at decode sizes the down GEMM's tail (its last tiles on a few SMs) and the combine's launch and
pass over the expert outputs are serial work on the critical path. Here the down GEMM
(`grouped_gemm_fp8`, masked or contiguous layout) publishes one int32 count per (expert, token
tile), +1 per finished N-tile with release semantics, and a combine kernel on a second stream, with
a bounded number of programs (the SM budget), reduces each token as soon as its rows exist.

Layout (`MoeLayout`, built on the GPU from topk_ids, no host sync): the P = tokens * top_k
(token, slot) pairs, pair id p = token * top_k + k, are placed in expert order either
  contiguous  row r = m_indptr[e] + i          (no padding: the single-GPU Triton MoE path), or
  masked      row r = e * max_m + i            ([E, max_m, ...] as DeepEP low-latency uses).
pair_of_row[r] is the inverse of row_of_pair[p] (the dispatch map and its inverse).

Combine consumer (`_combine_kernel`): programs walk the units (expert, token tile) in the order the
GEMM finishes them. For a unit it spins on the unit's count with acquire loads (bounded: after
max_spin polls it sets an error flag and goes on, so a missing signal never hangs the GPU), then adds
1 to each of the unit's tokens' arrival counters (acq_rel). The program that brings a token's counter
to top_k is the last to see that token's rows complete: it reads the token's top_k rows
(L2, .cg) and writes out[token] = sum_k weight[token, k] * scale * y[row_of_pair[token, k]], in k
order and fp32. The sum order never depends on timing, so overlap=True and overlap=False give
bit-identical outputs. The same kernel without waiting is the non-overlapped path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_kernel_ext import grouped_gemm_fp8 as gg

DEFAULT_MAX_SPIN = 1 << 20  # polls of one count before giving up (~0.5-1 s; a real down GEMM takes < 1 ms)
DEFAULT_COMBINE_SMS = 8


class MoeLayout(NamedTuple):
    """Where each (token, slot) pair's row lives; see the module docstring."""

    top_k: int
    num_experts: int
    max_m: int  # token capacity per expert (masked) or the bound used to size signals (contiguous)
    pair_of_row: torch.Tensor  # int32 [rows]; unused masked rows hold 0
    row_of_pair: torch.Tensor  # int32 [P]
    m_indptr: torch.Tensor | None  # int32 [E + 1] (contiguous)
    masked_m: torch.Tensor | None  # int32 [E] (masked)

    @property
    def masked(self) -> bool:
        return self.masked_m is not None


def build_layout(topk_ids: torch.Tensor, num_experts: int, masked_max_m: int | None = None) -> MoeLayout:
    """The dispatch map of topk_ids [T, K] (expert ids in [0, E)), all GPU ops, CUDA-graph safe.

    masked_max_m None: contiguous layout; else masked with that capacity per expert (>= T, since a
    token routes to an expert at most once; pairs beyond it would be dropped)."""
    t, k = topk_ids.shape
    p = t * k
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices  # pair ids in expert order
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    indptr = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=indptr[1:])
    sorted_pos = torch.arange(p, dtype=torch.int64, device=dev)
    if masked_max_m is None:
        rows = sorted_pos
        pair_of_row = order.to(torch.int32)
        return MoeLayout(k, num_experts, t, pair_of_row, _inverse(order, rows, p), indptr.to(torch.int32), None)
    if masked_max_m < t:
        raise ValueError(f"masked_max_m {masked_max_m} < tokens {t}: pairs would be dropped")
    e_sorted = flat[order]
    rows = e_sorted * masked_max_m + (sorted_pos - indptr[e_sorted])
    pair_of_row = torch.zeros(num_experts * masked_max_m, dtype=torch.int32, device=dev)
    pair_of_row[rows] = order.to(torch.int32)
    return MoeLayout(k, num_experts, masked_max_m, pair_of_row, _inverse(order, rows, p), None,
                     counts.to(torch.int32))


def _inverse(order: torch.Tensor, rows: torch.Tensor, p: int) -> torch.Tensor:
    row_of_pair = torch.empty(p, dtype=torch.int32, device=order.device)
    row_of_pair[order] = rows.to(torch.int32)
    return row_of_pair


def dispatch_rows(x: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """Token rows x [T, ...] placed in the layout: [P, ...] (contiguous) or [E, max_m, ...] (masked;
    rows past masked_m are left uninitialized, the GEMMs never read them)."""
    if not layout.masked:
        return x.index_select(0, (layout.pair_of_row // layout.top_k).to(torch.int64))
    out = torch.empty(layout.num_experts * layout.max_m, *x.shape[1:], dtype=x.dtype, device=x.device)
    src = torch.arange(x.shape[0] * layout.top_k, device=x.device) // layout.top_k
    out[layout.row_of_pair.to(torch.int64)] = x.index_select(0, src)
    return out.view(layout.num_experts, layout.max_m, *x.shape[1:])


@triton.jit
def _combine_kernel(
    y_ptr, sig_ptr, cnt_ptr, out_ptr, pair_ptr, rowp_ptr, w_ptr, indptr_ptr, masked_m_ptr, err_ptr,
    MAX_M, SIG_STRIDE, EXPECT, NUM_PROGRAMS, MAX_SPIN, w_scale, stride_ym, stride_om,
    G: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, MASKED: tl.constexpr, WAIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Persistent combine over units (expert g, token tile j) = g * SIG_STRIDE + j; see module doc."""
    pid = tl.program_id(0)
    u = pid
    while u < G * SIG_STRIDE:
        g = u // SIG_STRIDE
        j = u % SIG_STRIDE
        if MASKED:
            row0 = g * MAX_M
            m = tl.minimum(tl.load(masked_m_ptr + g), MAX_M)
        else:
            row0 = tl.load(indptr_ptr + g)
            m = tl.load(indptr_ptr + g + 1) - row0
        if j * BLOCK_T < m:
            if WAIT:
                seen = tl.atomic_add(sig_ptr + u, 0, sem="acquire")
                spins = 0
                while (seen < EXPECT) & (spins < MAX_SPIN):
                    seen = tl.atomic_add(sig_ptr + u, 0, sem="acquire")
                    spins += 1
                if seen < EXPECT:
                    tl.atomic_xchg(err_ptr, 1)  # never signalled: flag it, do not hang
                tl.debug_barrier()
            slots = j * BLOCK_T + tl.arange(0, BLOCK_T)
            valid = slots < m
            pair = tl.load(pair_ptr + row0 + slots, mask=valid, other=0)
            tok = pair // TOPK
            old = tl.atomic_add(cnt_ptr + tok, 1, mask=valid, sem="acq_rel")
            tl.debug_barrier()
            last = valid & (old == TOPK - 1)  # this unit completed these tokens: reduce them
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                lm = last[:, None] & (offs_h[None, :] < H)
                acc = tl.full([BLOCK_T, BLOCK_H], 0.0, tl.float32)
                for kk in tl.static_range(TOPK):
                    p = tok * TOPK + kk
                    r = tl.load(rowp_ptr + p, mask=last, other=0).to(tl.int64)
                    w = tl.load(w_ptr + p, mask=last, other=0.0).to(tl.float32) * w_scale
                    y = tl.load(y_ptr + r[:, None] * stride_ym + offs_h[None, :], mask=lm, other=0.0,
                                cache_modifier=".cg")
                    acc += y.to(tl.float32) * w[:, None]
                o_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_om + offs_h[None, :]
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=lm)
        u += NUM_PROGRAMS


def _num_sms(device: torch.device) -> int:
    return gg._num_sms(device.index if device.type == "cuda" else None)


_side_streams: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One cached second stream per device (a fresh stream per call would defeat CUDA graphs' reuse)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _side_streams:
        _side_streams[idx] = torch.cuda.Stream(device=idx)
    return _side_streams[idx]


class Workspace(NamedTuple):
    signal: torch.Tensor  # int32 [E, token tiles]
    counters: torch.Tensor  # int32 [T]
    status: torch.Tensor  # int32 [1]: 1 = some unit was never signalled


def combine(y: torch.Tensor, layout: MoeLayout, topk_weights: torch.Tensor, out: torch.Tensor, *,
            weight_scale: float = 1.0, signal: torch.Tensor | None = None, expect: int = 0,
            block_t: int = 16, counters: torch.Tensor | None = None, status: torch.Tensor | None = None,
            num_programs: int | None = None, max_spin: int = DEFAULT_MAX_SPIN, block_h: int = 256) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * weight_scale * y[row_of_pair[t*K + k]] (bf16 out, fp32 sum).

    With signal: wait for signal[unit] >= expect before reading a unit's rows (the overlapped
    consumer; signal [E, ceil(max_m / block_t)]). counters: int32 [T] zeros (made if None).
    status: int32 [1], set to 1 if a wait gave up. Launched on the current stream.
    """
    t, k = topk_weights.shape
    h = y.shape[-1]
    y2 = y.reshape(-1, h)
    if y2.stride(1) != 1 or out.stride(1) != 1 or out.shape != (t, h):
        raise ValueError(f"y rows and out [{t}, {h}] must have unit inner stride")
    if k != layout.top_k:
        raise ValueError(f"topk_weights has top_k {k}, layout {layout.top_k}")
    if t == 0:
        return out
    dev = y.device
    counters = torch.zeros(t, dtype=torch.int32, device=dev) if counters is None else counters
    status = torch.zeros(1, dtype=torch.int32, device=dev) if status is None else status
    sig_stride = triton.cdiv(layout.max_m, block_t)
    if signal is not None and tuple(signal.shape) != (layout.num_experts, sig_stride):
        raise ValueError(f"signal {tuple(signal.shape)} should be [{layout.num_experts}, {sig_stride}]")
    units = layout.num_experts * sig_stride
    if num_programs is None:
        num_programs = _num_sms(dev) * 2
    num_programs = max(1, min(num_programs, units))
    w = topk_weights.reshape(-1)
    ip = layout.m_indptr if layout.m_indptr is not None else layout.masked_m
    _combine_kernel[(num_programs,)](
        y2, signal if signal is not None else counters, counters, out, layout.pair_of_row, layout.row_of_pair,
        w, ip, ip, status,
        layout.max_m, sig_stride, expect, num_programs, max_spin, float(weight_scale), y2.stride(0), out.stride(0),
        G=layout.num_experts, H=h, TOPK=k, MASKED=layout.masked, WAIT=signal is not None,
        BLOCK_T=block_t, BLOCK_H=min(block_h, triton.next_power_of_2(h)), num_warps=4,
    )
    return out


def workspace(layout: MoeLayout, num_tokens: int, block_t: int, device) -> Workspace:
    """Signals + token counters + status in one zeroed int32 buffer (one memset per call)."""
    tiles = triton.cdiv(layout.max_m, block_t)
    n_sig = layout.num_experts * tiles
    buf = torch.zeros(n_sig + num_tokens + 1, dtype=torch.int32, device=device)
    return Workspace(buf[:n_sig].view(layout.num_experts, tiles), buf[n_sig:n_sig + num_tokens], buf[-1:])


def moe_down_and_combine(q: torch.Tensor, q_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                         topk_weights: torch.Tensor, layout: MoeLayout, out: torch.Tensor, *,
                         weight_scale: float = 1.0, overlap: bool = True, combine_sms: int | None = None,
                         variant: str = "auto", config: dict | None = None, expected_m: int | None = None,
                         max_spin: int = DEFAULT_MAX_SPIN, status: torch.Tensor | None = None,
                         y: torch.Tensor | None = None) -> torch.Tensor:
    """Down GEMM (FP8 1x128 x 128x128 blocks, bf16 out) + local combine into out [T, H] bf16.

    q [rows, I] (contiguous layout) or [E, max_m, I] (masked) fp8 with q_scale; w2 [E, H, I] fp8,
    w2_scale [E, H/128, I/128]. overlap=True: the combine runs on a second stream with combine_sms
    programs (default 8) while the GEMM fills the other SMs and signals finished tiles; the current
    stream waits for both before returning (no host sync; CUDA-graph capturable). overlap=False (or
    a CPU tensor): GEMM then combine on the current stream, same result bit for bit. status: int32 [1]
    the caller may read later (1: a wait gave up, out is invalid). y: optional GEMM output buffer.
    """
    num_tokens = topk_weights.shape[0]
    e, hdim, inter = w2.shape
    if out.dtype != torch.bfloat16 or out.shape != (num_tokens, hdim):
        raise ValueError(f"out must be bf16 [{num_tokens}, {hdim}], got {out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    p = num_tokens * layout.top_k
    m_hint = expected_m if expected_m is not None else max(1, triton.cdiv(p, min(e, p)))
    lay = "masked" if layout.masked else "contiguous"
    sms = _num_sms(q.device)
    variant, cfg = gg.resolve_config(variant, config, m_hint, hdim, inter, e, lay, sms)
    bt, bn = cfg["BLOCK_T"], cfg["BLOCK_N"]
    if y is None:
        shape = (e, layout.max_m, hdim) if layout.masked else (p, hdim)
        y = torch.empty(shape, dtype=torch.bfloat16, device=q.device)
    overlap = overlap and q.is_cuda
    ws = workspace(layout, num_tokens, bt, q.device)
    if status is not None:
        ws = ws._replace(status=status)

    def gemm(signal, gemm_sms):
        if layout.masked:
            gg.m_grouped_fp8_gemm_nt_masked(q, q_scale, w2, w2_scale, layout.masked_m, out=y, variant=variant,
                                            config=cfg, signal=signal, num_sms=gemm_sms)
        else:
            gg.m_grouped_fp8_gemm_nt_contiguous(q, q_scale, w2, w2_scale, layout.m_indptr, out=y,
                                                variant=variant, config=cfg, signal=signal, num_sms=gemm_sms)

    common = dict(weight_scale=weight_scale, block_t=bt, counters=ws.counters, status=ws.status, max_spin=max_spin)
    if not overlap:
        gemm(None, None)
        return combine(y, layout, topk_weights, out, **common)
    budget = max(1, min(combine_sms or DEFAULT_COMBINE_SMS, sms - 1))
    main, side = torch.cuda.current_stream(q.device), side_stream(q.device)
    side.wait_stream(main)  # zeroed workspace and inputs are ready; the GEMM below is not waited for
    gemm(ws.signal, sms - budget)  # first, so it never waits behind a spinning consumer
    with torch.cuda.stream(side):
        combine(y, layout, topk_weights, out, signal=ws.signal, expect=triton.cdiv(hdim, bn),
                num_programs=budget, **common)
    main.wait_stream(side)
    return out


def combine_reference(y: torch.Tensor, layout: MoeLayout, topk_weights: torch.Tensor,
                      weight_scale: float = 1.0) -> torch.Tensor:
    """Plain torch combine (fp32 sum in k order, bf16 out)."""
    t, k = topk_weights.shape
    rows = y.reshape(-1, y.shape[-1]).float()[layout.row_of_pair.long()].view(t, k, -1)
    w = topk_weights.float() * weight_scale
    acc = torch.zeros(t, y.shape[-1], dtype=torch.float32, device=y.device)
    for kk in range(k):
        acc += rows[:, kk] * w[:, kk:kk + 1]
    return acc.to(torch.bfloat16)


def moe_down_and_combine_reference(q, q_scale, w2, w2_scale, topk_weights, layout: MoeLayout,
                                   weight_scale: float = 1.0) -> torch.Tensor:
    """float32 down GEMM on the dequantized operands, then `combine_reference` (bf16 out)."""
    from sgl_kernel_ext.quant import dequant_per_block, dequant_per_token_group

    qd = dequant_per_token_group(q.reshape(-1, q.shape[-1]), q_scale.reshape(-1, q_scale.shape[-1]))
    if layout.masked:
        expert = torch.arange(layout.num_experts * layout.max_m, device=q.device) // layout.max_m
    else:
        ip = layout.m_indptr.long()
        expert = torch.searchsorted(ip[1:], torch.arange(qd.shape[0], device=q.device), right=True)
    y = torch.zeros(qd.shape[0], w2.shape[1], dtype=torch.float32, device=q.device)
    used = layout.row_of_pair.long()
    for e in expert[used].unique().tolist():
        r = used[expert[used] == e]
        y[r] = qd[r] @ dequant_per_block(w2[e], w2_scale[e], gg.SCALE_BLOCK).T  # one expert at a time (memory)
    t, k = topk_weights.shape
    w = topk_weights.float() * weight_scale
    return (y[used].view(t, k, -1) * w[..., None]).sum(1).to(torch.bfloat16)
