"""Single-batch overlap (SBO) on one GPU: the MoE combine runs while the down GEMM still runs.

Why: at decode sizes the down GEMM's tail (its last tiles on a few SMs) and the combine's launch and
pass over the expert outputs are serial work on the critical path. Here the down GEMM
(`grouped_gemm_fp8`, masked or contiguous layout) publishes one int32 count per (expert, token
tile), +1 per finished N-tile with release semantics, and a combine kernel on a second stream, with
a bounded number of programs (the SM budget), adds each row into its token as soon as the row exists.

Layout (`MoeLayout`, built on the GPU from topk_ids, no host sync): the P = tokens * top_k
(token, slot) pairs, pair id p = token * top_k + k, are placed in expert order either
  contiguous  row r = m_indptr[e] + i          (no padding: the single-GPU Triton MoE path), or
  masked      row r = e * max_m + i            ([E, max_m, ...] as DeepEP low-latency uses).
pair_of_row[r] is the inverse of row_of_pair[p] (the dispatch map and its inverse); sorted_pair[s]
and sorted_expert[s] name the s-th pair in expert order (the order the GEMM finishes rows in).

Combine consumer (`_combine_kernel`): the work is split into units (block of BLOCK_R consecutive
expert-ordered pairs, H-chunk of BLOCK_H columns), numbered in the GEMM's finishing order, chunk
fastest, so the consumer's programs work side by side on the rows that landed last and every unit
costs the same. A unit waits (acquire, bounded: after max_spin polls it sets an error flag and goes
on, so a missing signal never hangs the GPU) until its rows' (expert, token tile) counts are full,
then adds weight * y[row, chunk] into an fp32 accumulator acc[token, chunk] with atomics and counts
the contribution per (token, chunk) (acq_rel, after a CTA barrier). The unit that brings a count to
top_k writes that chunk of out[token] in bf16, so no cast kernel follows. Why not reduce a token
when its last row lands (the first design): a token's last expert is near the end of the GEMM for
almost every token, so that work came after the GEMM, on the few lent SMs.

Numerics: the top_k products are summed in fp32 in arrival order, so results may differ from run
to run (and overlap=True from overlap=False, which runs the same kernel without waiting) by the
rounding of that order: one bf16 ulp of out, plus fp32 noise where the terms cancel (`order_error`
measures it; tests: test/cpu/test_sbo.py, test/gpu/test_sbo_gpu.py).

Workspace (`workspace`, one int32 buffer): acc + per-(token, chunk) counts (zeroed on the combine's
stream, beside the GEMM's start) and the signals + status (zeroed on the GEMM's stream before it
starts). Every call zeroes them again, so CUDA-graph replays (which replay the memsets) start clean.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_kernel_ext import grouped_gemm_fp8 as gg
from sgl_kernel_ext.hostmath import cdiv
from sgl_kernel_ext.quant import EPS, FP8, _interpreting, _max_combine, _round_to_e4m3_grid

DEFAULT_MAX_SPIN = 1 << 20  # polls of one unit's counts before giving up (~0.5-1 s; a real down GEMM takes < 1 ms)
# Back-off between polls (PTX nanosleep). The first overlap run of this combine (H200, 2026-11-29) made the GEMM
# ~45% slower while lending it the same SMs without a consumer cost 3.5%: tight polling with atomics on the
# counts the GEMM adds to. Polls are now plain volatile loads with this pause between them (one acquire atomic
# per row once complete). 0: poll without pause (also under the interpreter).
DEFAULT_SPIN_SLEEP_NS = 500
DEFAULT_COMBINE_SMS = 16  # a row block's 14 H-chunks side by side; the GEMM measured 3-4% slower with 16 lent
BLOCK_R = 16  # expert-ordered pairs per combine unit
BLOCK_H = 512  # hidden columns per combine unit (DeepSeek-V3: 14 chunks of 7168)


class MoeLayout(NamedTuple):
    """Where each (token, slot) pair's row lives; see the module docstring."""

    top_k: int
    num_experts: int
    max_m: int  # token capacity per expert (masked) or the bound used to size signals (contiguous)
    pair_of_row: torch.Tensor  # int32 [rows]; unused masked rows hold 0
    row_of_pair: torch.Tensor  # int32 [P]
    m_indptr: torch.Tensor | None  # int32 [E + 1] (contiguous)
    masked_m: torch.Tensor | None  # int32 [E] (masked)
    sorted_pair: torch.Tensor  # int32 [P]: pair ids in expert order (contiguous: the same tensor as pair_of_row)
    sorted_expert: torch.Tensor  # int32 [P]: the expert of sorted_pair[s]

    @property
    def masked(self) -> bool:
        return self.masked_m is not None


LAYOUT_MAX_PAIRS = 8192  # one program sorts the pairs (bitonic, in registers) up to this; above, torch ops


def build_layout(topk_ids: torch.Tensor, num_experts: int, masked_max_m: int | None = None,
                 drops: bool = False) -> MoeLayout:
    """The dispatch map of topk_ids [T, K] (expert ids in [0, E)), CUDA-graph safe.

    masked_max_m None: contiguous layout; else masked with that capacity per expert (>= T, since a
    token routes to an expert at most once; pairs beyond it would be dropped). drops: ids may be -1 (a pair
    routed to another EP rank, as SGLang's StandardDispatcher marks them): such a pair gets no row
    (row_of_pair -1) and sorts after every expert (sorted_expert E; contiguous: past m_indptr[E]).

    On the GPU (and under the interpreter) one Triton program builds every map (`_layout_kernel`): the torch
    form (`_build_layout_torch`, also used above LAYOUT_MAX_PAIRS pairs and on a CPU without the interpreter)
    takes ~15 small kernels: with the row dispatch's torch form they cost 63-70 us per MoE layer under CUDA graphs
    at 16 experts on the H200 (benchmark/results/sbo/bench_sbo_e16_h200.json against sbo_layer_e16_h200.json)."""
    t, k = topk_ids.shape
    if masked_max_m is not None and masked_max_m < t:
        raise ValueError(f"masked_max_m {masked_max_m} < tokens {t}: pairs would be dropped")
    p = t * k
    if p == 0 or p > LAYOUT_MAX_PAIRS or not (topk_ids.is_cuda or _interpreting()):
        return _build_layout_torch(topk_ids, num_experts, masked_max_m, drops)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    e = num_experts
    masked = masked_max_m is not None
    slots = e * masked_max_m if masked else 0
    buf = torch.empty(3 * p + (e + 1) + e + slots, dtype=torch.int32, device=dev)  # one allocation
    sorted_pair, sorted_expert, row_of_pair = buf[:p], buf[p:2 * p], buf[2 * p:3 * p]
    indptr = buf[3 * p:3 * p + e + 1]
    counts = buf[3 * p + e + 1:3 * p + 2 * e + 1]
    pair_of_row = buf[3 * p + 2 * e + 1:] if masked else sorted_pair
    _layout_kernel[(1,)](
        ids, p, e, masked_max_m or 0, slots, sorted_pair, sorted_expert, row_of_pair, pair_of_row, indptr, counts,
        TOPK=k, BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_E=triton.next_power_of_2(e + 2), MASKED=masked,
        DROPS=drops, BLOCK_S=1024, num_warps=8 if p > 1024 else 4,
    )
    if masked:
        return MoeLayout(k, e, masked_max_m, pair_of_row, row_of_pair, None, counts, sorted_pair, sorted_expert)
    return MoeLayout(k, e, t, sorted_pair, row_of_pair, indptr, None, sorted_pair, sorted_expert)


@triton.jit
def _layout_kernel(ids_ptr, P, E, MAX_M, SLOTS, sorted_pair_ptr, sorted_expert_ptr, row_of_pair_ptr,
                   pair_of_row_ptr, indptr_ptr, counts_ptr, TOPK: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_E: tl.constexpr, MASKED: tl.constexpr, DROPS: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: the pairs sorted by (expert, pair id) as unique int32 keys (a stable counting order), the
    per-expert counts as a histogram (bin E: dropped pairs, E + 1: padding), their exclusive prefix sum, and
    the row of every pair; stores every map of build_layout."""
    pos = tl.arange(0, BLOCK_P)
    valid = pos < P
    ex = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int32)
    if DROPS:
        ex = tl.where(ex >= 0, ex, E)
    ex = tl.where(valid, ex, E + 1)
    skey = tl.sort(ex * BLOCK_P + pos)
    pair = skey % BLOCK_P  # the pair at sorted position pos
    es = skey // BLOCK_P  # its expert (E: dropped)
    cnt = tl.histogram(ex, BLOCK_E)
    start = tl.cumsum(cnt, 0) - cnt  # first sorted position of each expert
    bins = tl.arange(0, BLOCK_E)
    tl.store(indptr_ptr + bins, start, mask=bins <= E)
    tl.store(counts_ptr + bins, cnt, mask=bins < E)
    tl.store(sorted_pair_ptr + pos, pair, mask=valid)
    tl.store(sorted_expert_ptr + pos, es, mask=valid)
    kept = valid & (es < E)
    if MASKED:
        s0 = 0
        while s0 < SLOTS:  # unused masked rows name pair 0, as the torch form leaves them (while: the interpreter)
            so = s0 + tl.arange(0, BLOCK_S)
            tl.store(pair_of_row_ptr + so, tl.zeros([BLOCK_S], dtype=tl.int32), mask=so < SLOTS)
            s0 += BLOCK_S
        tl.debug_barrier()  # indptr stored above is read back below; the zeros precede the scatter
        first = tl.load(indptr_ptr + es, mask=kept, other=0)
        row = es * MAX_M + (pos - first)
        tl.store(pair_of_row_ptr + row, pair, mask=kept)
    else:
        row = pos
    tl.store(row_of_pair_ptr + pair, tl.where(kept, row, -1), mask=valid)


def _build_layout_torch(topk_ids: torch.Tensor, num_experts: int, masked_max_m: int | None,
                        drops: bool) -> MoeLayout:
    """build_layout in torch ops: beyond one program's sort, and on a CPU without the Triton interpreter."""
    t, k = topk_ids.shape
    p = t * k
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    if drops:
        flat = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    e_sorted, order = torch.sort(flat, stable=True)  # experts ascending; pair ids in expert order
    counts = torch.zeros(num_experts + drops, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))[:num_experts]
    indptr = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=indptr[1:])
    sorted_pos = torch.arange(p, dtype=torch.int64, device=dev)
    sorted_pair, sorted_expert = order.to(torch.int32), e_sorted.to(torch.int32)
    kept = e_sorted < num_experts if drops else None
    if masked_max_m is None:
        rows = torch.where(kept, sorted_pos, -1) if drops else sorted_pos
        return MoeLayout(k, num_experts, t, sorted_pair, _inverse(order, rows, p), indptr.to(torch.int32), None,
                         sorted_pair, sorted_expert)
    rows = e_sorted * masked_max_m + (sorted_pos - indptr[e_sorted])
    slots = num_experts * masked_max_m
    pair_of_row = torch.zeros(slots + drops, dtype=torch.int32, device=dev)
    if drops:  # dropped pairs land in one scratch slot past the end, cut off below
        rows = torch.where(kept, rows, -1)
        pair_of_row[torch.where(kept, rows, slots)] = sorted_pair
        pair_of_row = pair_of_row[:slots]
    else:
        pair_of_row[rows] = sorted_pair
    return MoeLayout(k, num_experts, masked_max_m, pair_of_row, _inverse(order, rows, p), None,
                     counts.to(torch.int32), sorted_pair, sorted_expert)


def _inverse(order: torch.Tensor, rows: torch.Tensor, p: int) -> torch.Tensor:
    row_of_pair = torch.empty(p, dtype=torch.int32, device=order.device)
    row_of_pair[order] = rows.to(torch.int32)
    return row_of_pair


def dispatch_rows(x: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """Token rows x [T, ...] placed in the layout: [P, ...] (contiguous; rows of dropped pairs, past
    m_indptr[E], are never read) or [E, max_m, ...] (masked; rows past masked_m are left uninitialized, the
    GEMMs never read them). One Triton program per pair copies x[pair // top_k] to its row (torch ops on a
    CPU without the interpreter)."""
    t, k = x.shape[0], layout.top_k
    p = layout.row_of_pair.numel()
    rows = layout.num_experts * layout.max_m if layout.masked else p
    out = torch.empty(rows, *x.shape[1:], dtype=x.dtype, device=x.device)
    if p == 0:
        return out.view(layout.num_experts, layout.max_m, *x.shape[1:]) if layout.masked else out
    if x.is_cuda or _interpreting():
        xs = x.reshape(t, -1)
        row_bytes = xs.shape[1] * xs.element_size()
        word = torch.int32 if row_bytes % 4 == 0 else torch.uint8  # copied in 4-byte words where rows allow
        src = xs.contiguous().view(torch.uint8).view(word)
        dst = out.view(rows, -1).view(torch.uint8).view(word)
        n = src.shape[1]
        _dispatch_rows_kernel[(p,)](src, dst, layout.row_of_pair, n, TOPK=k,
                                    BLOCK=min(4096, triton.next_power_of_2(n)), num_warps=4)
    elif not layout.masked:
        out.copy_(x.index_select(0, (layout.pair_of_row // k).to(torch.int64)))
    else:
        r = layout.row_of_pair.to(torch.int64)
        kept = r >= 0
        out[r[kept]] = x.index_select(0, torch.arange(p, device=x.device)[kept] // k)
    return out.view(layout.num_experts, layout.max_m, *x.shape[1:]) if layout.masked else out


def quant_dispatch(x: torch.Tensor, layout: MoeLayout, group: int = 128,
                   groups_per_program: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (bf16) quantized per 1 x `group` token group as `quant.per_token_group_quant_fp8` (scale = amax /
    448, floored at EPS) and written straight to the layout's rows: (q fp8, scales fp32) as
    dispatch_rows(per_token_group_quant_fp8(x)) gives them, in one kernel instead of a quant and two row passes.
    Triton on the GPU and under the interpreter; those torch ops on a plain CPU."""
    t, h = x.shape
    if h % group:
        raise ValueError(f"hidden {h} is not a multiple of the group size {group}")
    if not (x.is_cuda or _interpreting()):
        from sgl_kernel_ext.quant import per_token_group_quant_fp8

        q, sc = per_token_group_quant_fp8(x, group)
        return dispatch_rows(q, layout), dispatch_rows(sc, layout)
    p = layout.row_of_pair.numel()
    rows = layout.num_experts * layout.max_m if layout.masked else p
    q = torch.empty(rows, h, dtype=FP8, device=x.device)
    sc = torch.empty(rows, h // group, dtype=torch.float32, device=x.device)
    if t and p:
        xs = x.contiguous()
        gpp = min(triton.next_power_of_2(groups_per_program), triton.next_power_of_2(h // group))
        _quant_dispatch_kernel[(t, cdiv(h // group, gpp))](
            xs, q, sc, layout.row_of_pair, h, EPS, TOPK=layout.top_k, GROUP=group, GROUPS_PER_PROG=gpp,
            EXACT_ROUND=_interpreting(), num_warps=4)
    if layout.masked:
        return q.view(layout.num_experts, layout.max_m, h), sc.view(layout.num_experts, layout.max_m, h // group)
    return q, sc


@triton.jit
def _quant_dispatch_kernel(x_ptr, q_ptr, s_ptr, row_of_pair_ptr, H, eps, TOPK: tl.constexpr, GROUP: tl.constexpr,
                           GROUPS_PER_PROG: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Program (t, c): GROUPS_PER_PROG groups of token t quantized once, stored to the row of each of its TOPK
    pairs (a dropped pair, row -1, stores nothing)."""
    tok = tl.program_id(0)
    n_groups = H // GROUP
    offs_grp = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    col = offs_grp[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    grp_ok = offs_grp < n_groups
    ok = grp_ok[:, None] & (col < H)
    x = tl.load(x_ptr + tok.to(tl.int64) * H + col, mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.reduce(tl.abs(x), 1, _max_combine), eps), 448.0)
    # div.rn (the / operator gives div.full, 2 ulp): the quotients, so the FP8 bits, are the torch quant's
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
    if EXACT_ROUND:
        q = _round_to_e4m3_grid(q)
    q = q.to(q_ptr.dtype.element_ty)
    for k in tl.static_range(TOPK):
        row = tl.load(row_of_pair_ptr + tok * TOPK + k)
        kept = row >= 0
        r = tl.maximum(row, 0).to(tl.int64)
        tl.store(q_ptr + r * H + col, q, mask=ok & kept)
        tl.store(s_ptr + r * n_groups + offs_grp, scale, mask=grp_ok & kept)


@triton.jit
def _dispatch_rows_kernel(src_ptr, dst_ptr, row_of_pair_ptr, N, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p: row row_of_pair[p] of dst = row p // TOPK of src (N words each); a dropped pair (-1) copies
    nothing."""
    pid = tl.program_id(0)
    row = tl.load(row_of_pair_ptr + pid)
    if row >= 0:
        c0 = 0
        while c0 < N:
            c = c0 + tl.arange(0, BLOCK)
            v = tl.load(src_ptr + (pid // TOPK).to(tl.int64) * N + c, mask=c < N)
            tl.store(dst_ptr + row.to(tl.int64) * N + c, v, mask=c < N)
            c0 += BLOCK


@triton.jit
def _nanosleep(ns: tl.constexpr):
    """Pause this thread about ns nanoseconds (PTX nanosleep, sm_70+); returns 0."""
    return tl.inline_asm_elementwise(f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _combine_kernel(
    y_ptr, sig_ptr, acc_ptr, cnt_ptr, out_ptr, spair_ptr, sexp_ptr, rowp_ptr, w_ptr, indptr_ptr, err_ptr,
    P, MAX_M, SIG_STRIDE, EXPECT, NUM_PROGRAMS, MAX_SPIN, w_scale, stride_ym, stride_om,
    H: tl.constexpr, TOPK: tl.constexpr, MASKED: tl.constexpr, WAIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SLEEP_NS: tl.constexpr,
):
    """Persistent combine over units (row block b, H-chunk c) = b * NC + c; see the module doc."""
    NC: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    units = (P + BLOCK_R - 1) // BLOCK_R * NC
    u = pid
    while u < units:  # (a while loop: the interpreter cannot range() from a program id)
        b = u // NC
        c = u - b * NC
        s = b * BLOCK_R + tl.arange(0, BLOCK_R)  # expert-ordered pair positions
        valid = s < P
        pair = tl.load(spair_ptr + s, mask=valid, other=0)
        row = tl.load(rowp_ptr + pair, mask=valid, other=0)
        hit = valid & (row >= 0)  # a dropped pair (EP: another rank's expert) adds nothing but still counts
        tok = pair // TOPK
        w = tl.load(w_ptr + pair, mask=hit, other=0.0).to(tl.float32) * w_scale
        if WAIT:
            g = tl.load(sexp_ptr + s, mask=hit, other=0)
            if MASKED:
                i = row - g * MAX_M
            else:
                i = row - tl.load(indptr_ptr + g, mask=hit, other=0)
            sp = sig_ptr + g * SIG_STRIDE + i // BLOCK_T  # the (expert, token tile) count of each row
            pending = hit
            seen = tl.atomic_add(sp, 0, mask=pending, sem="acquire")
            pending = pending & (seen < EXPECT)
            short = tl.sum(pending.to(tl.int32))
            spins = 0
            # Re-poll only the rows not seen complete yet, with plain volatile loads (served by L2) instead of
            # atomics: an atomic on the count the GEMM is adding to queues behind it in L2's atomic unit.
            while (short > 0) & (spins < MAX_SPIN):
                if SLEEP_NS > 0:
                    spins += _nanosleep(SLEEP_NS)
                seen = tl.load(sp, mask=pending, other=EXPECT, volatile=True)
                pending = pending & (seen < EXPECT)
                short = tl.sum(pending.to(tl.int32))
                spins += 1
            if short > 0:
                tl.atomic_xchg(err_ptr, 1)  # never signalled: flag it, do not hang
            elif spins > 0:  # completion seen by plain loads: one acquire per row orders the reads below
                tl.atomic_add(sp, 0, mask=hit, sem="acquire")
            tl.debug_barrier()  # the acquiring threads' view covers every thread's loads below
        offs_h = c * BLOCK_H + tl.arange(0, BLOCK_H)
        m2 = hit[:, None] & (offs_h[None, :] < H)
        y = tl.load(y_ptr + row.to(tl.int64)[:, None] * stride_ym + offs_h[None, :], mask=m2, other=0.0,
                    cache_modifier=".cg")  # L2: rows another SM just wrote
        a_ptrs = acc_ptr + tok.to(tl.int64)[:, None] * H + offs_h[None, :]
        tl.atomic_add(a_ptrs, y.to(tl.float32) * w[:, None], mask=m2, sem="relaxed")
        tl.debug_barrier()  # every thread's adds precede the release below
        old = tl.atomic_add(cnt_ptr + tok * NC + c, 1, mask=valid, sem="acq_rel")
        last = valid & (old == TOPK - 1)  # this unit brought (token, chunk) to top_k: write it out
        tl.debug_barrier()
        lm = last[:, None] & (offs_h[None, :] < H)
        acc = tl.load(a_ptrs, mask=lm, other=0.0, cache_modifier=".cg")
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


def _chunks(h: int, block_h: int) -> tuple[int, int]:
    """(BLOCK_H, number of H-chunks) the kernel uses for hidden size h."""
    bh = min(block_h, triton.next_power_of_2(h))
    return bh, cdiv(h, bh)


class Workspace(NamedTuple):
    """Views of one int32 buffer; `combine_part` and `gemm_part` are what must be zero before each call."""

    acc: torch.Tensor  # fp32 [T, H]: the atomically added top-k sum
    counters: torch.Tensor  # int32 [T, H chunks]: contributions added per (token, chunk)
    signal: torch.Tensor  # int32 [E, token tiles]: finished N-tiles per (expert, token tile)
    status: torch.Tensor  # int32 [1]: 1 = some unit was never signalled
    combine_part: torch.Tensor  # acc + counters: zeroed on the combine's stream
    gemm_part: torch.Tensor  # signal + status: zeroed before the GEMM starts


def workspace(layout: MoeLayout, num_tokens: int, hidden: int, block_t: int, device, *, block_h: int = BLOCK_H,
              zero: bool = True) -> Workspace:
    """The combine's accumulator, counts, signals and status in one int32 buffer (acc first: 16-byte aligned
    for vector atomics). zero=False leaves zeroing to the caller (`moe_down_and_combine` splits it over
    its two streams)."""
    tiles = cdiv(layout.max_m, block_t)
    n_acc, n_cnt, n_sig = num_tokens * hidden, num_tokens * _chunks(hidden, block_h)[1], layout.num_experts * tiles
    buf = (torch.zeros if zero else torch.empty)(n_acc + n_cnt + n_sig + 1, dtype=torch.int32, device=device)
    return Workspace(buf[:n_acc].view(torch.float32).view(num_tokens, hidden),
                     buf[n_acc:n_acc + n_cnt].view(num_tokens, -1),
                     buf[n_acc + n_cnt:n_acc + n_cnt + n_sig].view(layout.num_experts, tiles), buf[-1:],
                     buf[:n_acc + n_cnt], buf[n_acc + n_cnt:])


def combine(y: torch.Tensor, layout: MoeLayout, topk_weights: torch.Tensor, out: torch.Tensor, *,
            weight_scale: float = 1.0, signal: torch.Tensor | None = None, expect: int = 0,
            block_t: int = 16, acc: torch.Tensor | None = None, counters: torch.Tensor | None = None,
            status: torch.Tensor | None = None, num_programs: int | None = None, max_spin: int = DEFAULT_MAX_SPIN,
            block_h: int = BLOCK_H, block_r: int = BLOCK_R, spin_sleep_ns: int = DEFAULT_SPIN_SLEEP_NS) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * weight_scale * y[row_of_pair[t*K + k]] (bf16 out, fp32 sum in
    arrival order: see the module doc for the rounding this allows). A pair without a row (row_of_pair -1: a
    build_layout(drops=True) layout, another EP rank's expert) adds nothing; a token with no row gets 0.

    With signal: wait for the count of a row's (expert, token tile) to reach expect before reading the
    row (the overlapped consumer; signal [E, ceil(max_m / block_t)]). acc fp32 [T, H] and counters
    int32 [T, ceil(H / block_h)] must be zero (made, zeroed, if None). status: int32 [1], set to 1 if a
    wait gave up. spin_sleep_ns: pause between polls (0: none; always 0 under the interpreter). Launched on
    the current stream.
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
    bh, nc = _chunks(h, block_h)
    acc = torch.zeros(t, h, dtype=torch.float32, device=dev) if acc is None else acc
    counters = torch.zeros(t, nc, dtype=torch.int32, device=dev) if counters is None else counters
    status = torch.zeros(1, dtype=torch.int32, device=dev) if status is None else status
    if acc.shape != (t, h) or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"acc must be contiguous fp32 [{t}, {h}], got {acc.dtype} {tuple(acc.shape)}")
    if counters.shape != (t, nc) or counters.dtype != torch.int32 or not counters.is_contiguous():
        raise ValueError(f"counters must be contiguous int32 [{t}, {nc}], got {counters.dtype} {tuple(counters.shape)}")
    sig_stride = cdiv(layout.max_m, block_t)
    if signal is not None and tuple(signal.shape) != (layout.num_experts, sig_stride):
        raise ValueError(f"signal {tuple(signal.shape)} should be [{layout.num_experts}, {sig_stride}]")
    p = t * k
    units = cdiv(p, block_r) * nc
    if num_programs is None:
        num_programs = _num_sms(dev) * 2
    num_programs = max(1, min(num_programs, units))
    ip = layout.m_indptr if layout.m_indptr is not None else layout.masked_m  # indptr read only if contiguous
    _combine_kernel[(num_programs,)](
        y2, signal if signal is not None else counters, acc, counters, out, layout.sorted_pair, layout.sorted_expert,
        layout.row_of_pair, topk_weights.reshape(-1), ip, status,
        p, layout.max_m, sig_stride, expect, num_programs, max_spin, float(weight_scale), y2.stride(0), out.stride(0),
        H=h, TOPK=k, MASKED=layout.masked, WAIT=signal is not None, BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_H=bh,
        SLEEP_NS=0 if _interpreting() else int(spin_sleep_ns), num_warps=4,
    )
    return out


def moe_down_and_combine(q: torch.Tensor, q_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                         topk_weights: torch.Tensor, layout: MoeLayout, out: torch.Tensor, *,
                         weight_scale: float = 1.0, overlap: bool = True, combine_sms: int | None = None,
                         variant: str = "auto", config: dict | None = None, expected_m: int | None = None,
                         max_spin: int = DEFAULT_MAX_SPIN, status: torch.Tensor | None = None,
                         y: torch.Tensor | None = None, spin_sleep_ns: int = DEFAULT_SPIN_SLEEP_NS,
                         fused: bool = False, counts_only: bool = False, defer: bool = False,
                         tail: bool = False, colocate: bool = False) -> torch.Tensor:
    """Down GEMM (FP8 1x128 x 128x128 blocks, bf16 out) + local combine into out [T, H] bf16.

    q [rows, I] (contiguous layout) or [E, max_m, I] (masked) fp8 with q_scale; w2 [E, H, I] fp8,
    w2_scale [E, H/128, I/128]. overlap=True: the combine runs on a second stream with combine_sms
    programs (default 16) while the GEMM fills the other SMs and signals finished tiles; the current
    stream waits for both before returning (no host sync; CUDA-graph capturable: the workspace memsets
    are captured too, so every replay starts from zero). overlap=False (or a CPU tensor): GEMM then
    the same combine without waiting, on the current stream. The two agree up to the fp32 summation
    order (module doc). status: int32 [1] the caller may read later (1: a wait gave up, out is
    invalid; never cleared here). y: optional GEMM output buffer. spin_sleep_ns: the consumer's pause
    between polls (see DEFAULT_SPIN_SLEEP_NS). fused=True: the combine runs in the GEMM's epilogue
    (grouped_gemm_fp8.EpilogueCombine: the tile that completes a token's N-range gathers its top_k rows;
    one kernel on every SM, overlap ignored, a deterministic slot-order sum), the one-GPU form: there,
    lending SMs to a second kernel costs the bandwidth-bound GEMM as much as the combine takes (H200,
    2026-11-29: 3-5% of the GEMM against a 12-21 us combine). counts_only (benchmarks, with fused): the epilogue
    counts and synchronizes but skips the gather, so out is not written: what the per-tile counting costs.
    defer (with fused): each program gathers the (token, N-tile)s its tiles completed after its last GEMM tile
    (grouped_gemm_fp8 module doc); the same sums. tail (with fused): no per-tile count; every program arrives at one
    grid-wide counter after its last tile, then all gather (token, N-tile)s side by side (grouped_gemm_fp8 module
    doc); the same sums.
    colocate (with overlap): the GEMM keeps every SM and the combine_sms consumer programs
    run beside its programs on the same SMs instead of on lent ones (the swapAB down GEMM's two programs per SM
    leave room for one consumer program: 2 x 55 KB + 4 KB shared memory, 2 x 128 x 102 + 128 x 166 registers).
    """
    num_tokens = topk_weights.shape[0]
    e, hdim, inter = w2.shape
    if out.dtype != torch.bfloat16 or out.shape != (num_tokens, hdim):
        raise ValueError(f"out must be bf16 [{num_tokens}, {hdim}], got {out.dtype} {tuple(out.shape)}")
    if num_tokens == 0:
        return out
    p = num_tokens * layout.top_k
    m_hint = expected_m if expected_m is not None else max(1, cdiv(p, min(e, p)))
    lay = "masked" if layout.masked else "contiguous"
    sms = _num_sms(q.device)
    variant, cfg = gg.resolve_config(variant, config, m_hint, hdim, inter, e, lay, sms)
    bt, bn = cfg["BLOCK_T"], cfg["BLOCK_N"]
    if y is None:
        shape = (e, layout.max_m, hdim) if layout.masked else (p, hdim)
        y = torch.empty(shape, dtype=torch.bfloat16, device=q.device)
    if fused:
        shape = (gg.TAIL_COUNTERS,) if tail else (num_tokens, cdiv(hdim, bn))
        counters = torch.zeros(shape, dtype=torch.int32, device=q.device)
        cmb = gg.EpilogueCombine(layout.pair_of_row, layout.row_of_pair, topk_weights.reshape(-1), counters, out,
                                 layout.top_k, weight_scale, counts_only, defer, tail)
        if layout.masked:
            gg.m_grouped_fp8_gemm_nt_masked(q, q_scale, w2, w2_scale, layout.masked_m, out=y, variant=variant,
                                            config=cfg, combine=cmb)
        else:
            gg.m_grouped_fp8_gemm_nt_contiguous(q, q_scale, w2, w2_scale, layout.m_indptr, out=y, variant=variant,
                                                config=cfg, combine=cmb)
        return out
    overlap = overlap and q.is_cuda
    ws = workspace(layout, num_tokens, hdim, bt, q.device, zero=not overlap)  # overlap: zeroed per stream below
    common = dict(weight_scale=weight_scale, block_t=bt, acc=ws.acc, counters=ws.counters,
                  status=ws.status if status is None else status, max_spin=max_spin)

    def gemm(signal, gemm_sms):
        if layout.masked:
            gg.m_grouped_fp8_gemm_nt_masked(q, q_scale, w2, w2_scale, layout.masked_m, out=y, variant=variant,
                                            config=cfg, signal=signal, num_sms=gemm_sms)
        else:
            gg.m_grouped_fp8_gemm_nt_contiguous(q, q_scale, w2, w2_scale, layout.m_indptr, out=y,
                                                variant=variant, config=cfg, signal=signal, num_sms=gemm_sms)

    if not overlap:
        gemm(None, None)
        return combine(y, layout, topk_weights, out, **common)
    budget = max(1, min(combine_sms or DEFAULT_COMBINE_SMS, sms - 1))
    main, side = torch.cuda.current_stream(q.device), side_stream(q.device)
    ws.gemm_part.zero_()  # signals (and the internal status) before the GEMM counts into them
    side.wait_stream(main)  # inputs and zeroed signals are ready; the GEMM below is not waited for
    gemm(ws.signal, None if colocate else sms - budget)  # first, so it never waits behind a spinning consumer
    with torch.cuda.stream(side):
        ws.combine_part.zero_()  # acc + counts, beside the GEMM's first tiles
        combine(y, layout, topk_weights, out, signal=ws.signal, expect=cdiv(hdim, bn),
                num_programs=budget, spin_sleep_ns=spin_sleep_ns, **common)
    main.wait_stream(side)
    return out


def order_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far got is from want in units of what the fp32 summation order may change: max over elements of
    |got - want| / (2^-7 |want| + 2^-12 max|want|). <= 1: equal up to that rounding (one bf16 ulp, 2^-8
    to 2^-7 of the value, plus a small floor for sums that cancel); a wrong row or weight gives >> 1."""
    if not want.numel():  # nothing to compare (e.g. an owner with no tokens)
        return 0.0
    g, w = got.double(), want.double()
    bound = 2.0 ** -7 * w.abs() + 2.0 ** -12 * float(w.abs().max())
    return float(((g - w).abs() / bound.clamp_min(1e-30)).max())


def combine_reference(y: torch.Tensor, layout: MoeLayout, topk_weights: torch.Tensor,
                      weight_scale: float = 1.0, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain torch combine (fp32 sum in k order; out_dtype float32 keeps the unrounded sum, e.g. an EP rank's
    partial before a reduce-scatter)."""
    t, k = topk_weights.shape
    rop = layout.row_of_pair.long()
    rows = y.reshape(-1, y.shape[-1]).float()[rop.clamp(min=0)].view(t, k, -1)
    rows[(rop < 0).view(t, k)] = 0.0  # dropped pairs (drops=True layouts) add nothing
    w = topk_weights.float() * weight_scale
    acc = torch.zeros(t, y.shape[-1], dtype=torch.float32, device=y.device)
    for kk in range(k):
        acc += rows[:, kk] * w[:, kk:kk + 1]
    return acc.to(out_dtype)


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
