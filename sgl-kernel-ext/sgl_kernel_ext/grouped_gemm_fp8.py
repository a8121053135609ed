"""FP8 block-scaled grouped GEMMs for DeepSeek-V3 MoE, with a swapAB variant for few tokens per expert.

Math (NT layout, DeepGEMM's names): for each group (expert) g and each of its tokens t,

    out[t, n] = sum_k  A[t, k] * a_scale[t, k // 128]  *  B[g, n, k] * b_scale[g, n // 128, k // 128]

A, B are float8_e4m3fn; a_scale is fp32 [rows, K/128] (1×128 per-token groups, any strides, so
DeepGEMM's column-major scales work too); b_scale is fp32 [G, ceil(N/128), K/128] (128×128 blocks);
out is bf16. K must be a multiple of 128. N is arbitrary (tiles are masked).

Layouts
  contiguous  A [M_total, K], rows sorted by expert; m_indptr [G+1] int32: expert g owns rows
              m_indptr[g] .. m_indptr[g+1]-1 (no per-expert padding needed, unlike DeepGEMM's 128-row
              alignment). Output rows outside [m_indptr[0], m_indptr[G]) are not written.
  masked      A [G, max_m, K]; masked_m [G] int32: expert g owns rows 0 .. masked_m[g]-1; the rest
              of out[g] is not written (and those A rows are not read).
  dense       fp8_gemm_nt: one group, A [M, K], B [N, K] (attention / shared-expert linears).
  aligned     m_grouped_fp8_gemm_nt_aligned: SGLang's moe_align_block_size output as is (pair ids
              sorted by expert, padded per expert to the token tile); A rows are read through the
              ids, so SGLang's Triton MoE path needs no gather (`_fp8_moe_aligned_kernel`).

Kernel (`_fp8_grouped_gemm_kernel` for the first three layouts and both variants; the aligned
layout has its own tile walk; both share the tile's K loop, `_mma_tile`)
  * Persistent: NUM_PROGRAMS programs walk a linear tile space group by group (per group:
    ceil(m_g / BLOCK_T) token tiles x ceil(N / BLOCK_N) weight tiles x SPLIT_K k-slices; k-slice
    fastest, then token tile, then weight tile, so programs running together share a weight tile
    through L2 and each weight byte comes from HBM about once). A group with m = 0 has no tiles: only
    its count is read, never its A, B, scales or output. The schedule is computed on the GPU from
    m_indptr / masked_m, so there is no host sync and the launch is CUDA-graph safe.
  * swapAB (small m): the MMA's M side is the weights' N (BLOCK_N = 64/128 rows of B_g, K-major),
    the MMA's N side is the tokens (BLOCK_T = 16/32/64): acc[BLOCK_N, BLOCK_T] += B_g[n_blk, k_blk] @
    A_g[t_blk, k_blk]^T, so 1..32 tokens do not pad the 64-row wgmma M to 64 tokens; the tile is
    transposed once at the store. normal (large m): tokens on M (BLOCK_T = 64/128), weights on N.
  * BLOCK_K = 128 = the scale block: each K step is one fp32 tl.dot of a 128-deep slice, then
      acc += dot * a_scale[t, kb] * b_scale[g, nb, kb]
    in fp32 (b_scale is one scalar per step when BLOCK_N <= 128, a per-column vector for 256).
    Out-of-range tokens / weight rows load as 0 (and scale 0), stores are masked.
  * SPLIT_K > 1 (dense small-M GEMMs with too few tiles to fill the GPU): each k-slice writes fp32
    partials to a workspace, `_splitk_reduce_kernel` sums them into bf16 for valid rows only. Config
    "serial_reduce": no reduce kernel; after its partial store (CTA barrier) each k-slice counts itself on
    the output tile with acq_rel, and the one that completes the count sums the slices in the same order
    (bit-equal), stores bf16 and zeroes the counter (per-stream counters, `_fixup_counters`): one launch
    less per GEMM.
  * signal (masked / contiguous, SPLIT_K = 1; single-batch overlap, `sgl_kernel_ext.sbo`): after a
    tile's store, a CTA barrier, then one atomic +1 with release semantics on signal[g, token tile],
    so a consumer that reads ceil(N / BLOCK_N) there with acquire sees every row of that token tile.
    num_sms caps the persistent grid, to lend SMs to that consumer.
  * combine (masked / contiguous, SPLIT_K = 1; `EpilogueCombine`): the MoE combine in the epilogue, for
    one GPU, where a second kernel on lent SMs costs the bandwidth-bound GEMM more than the combine itself.
    No float atomics; each token's top_k rows are summed in fp32 in slot order (deterministic). Three forms:
    - inline (default): each finished tile stores its rows, then (CTA barrier) counts them per (token,
      N-tile) with acq_rel; the tile that brings a count to top_k gathers that token's top_k rows of this
      N-range (L2 reads of rows just written) and writes the bf16 output.
    - defer=True: the completing tile only notes (token, N-tile) in its program's list, and the program
      gathers its list after its last GEMM tile, so gathers do not interrupt the weight stream.
    - tail=True (group walk only): no per-tile count. Every program stores its rows plainly; after its last
      tile it arrives at ONE grid-wide counter (CTA barrier, one release add), waits until every program
      arrived, and gathers every NUM_PROGRAMS-th block of (token, N-tile) items: the combine fills the
      persistent grid's tail with one launch. The grid is capped at the programs resident at once
      (`_resident_programs`), so nobody waits for a program that cannot start. A wait that runs out
      (TAIL_MAX_SPIN polls) adds a mark (1 << TAIL_GAVE_UP_SHIFT) to the same counter and leaves; the last
      program to arrive sees that in the value its own arrival returns and gathers every item, so out is
      always complete: a give-up costs time, never a wrong answer. (A leaver whose add finds every program
      arrived does its share after all: the last one came before its mark.) Counters: int32 [1].

Walks selected by config keys (masked / contiguous; each bit-identical to the group walk in the CPU tests):
  * "flat": True (plain outputs or EpilogueCombine; no signal, no split-K): `_fp8_grouped_gemm_flat_kernel`,
    the same tiles in one flattened, pipelined loop over the program's tiles (tl.range(..., flatten=True)), so
    the weight stream does not drain at every tile boundary, and with EpilogueCombine the next tiles' loads stay
    in flight while a tile counts. With "tma": True as well, the FP8 operands arrive through host-built tensor
    descriptors (TMA boxes of [BLOCK_T | BLOCK_N, 128]), as DeepGEMM feeds its wgmmas: no address math or
    per-element masks in the loop (rows past a tile's real ones are read and masked on the store).
  * "ws": True (plain outputs, no split-K or signal): two launches. `_token_tile_map_kernel` (one program)
    lists every real token tile as (group, first row, end of the group's rows); `_fp8_grouped_gemm_ws_kernel`
    walks those token tiles x weight tiles persistently through TMA boxes. It has the shape Triton 3.6's
    warp-specialize pass accepts (no reduction, no early return); "ws_split": True asks for that split, which
    hung on the H200 in most cases, so it runs only with SGLANG_H20_WS_SPLIT=1 (for probe_ws_walk.py).

Variant "split" (`_split_launch`): one call as two launches, swapAB on the groups with at most split_at tokens and
the normal variant on the rest, each walk skipping the other's groups by count on the GPU (count_range): for
uneven routing, where a few experts get hundreds of tokens that swapAB tiles would serve BLOCK_T at a time.
With config split_streams 2 the two launches run on two streams, so one fills the SMs the other's tail leaves.
`bench_grouped_gemm.py --tune` times the walks. What each form measured, and the forms tried and dropped:
../NOTES.md ("Grouped GEMM").

Variant choice. The per-GPU table (`gemm_table`: this user's re-tune, else the shipped one; H200 ships,
measured) feeds `choose_variant` / `choose_config` (variant='auto' for direct callers; without a table the
heuristic: swapab for m <= 64 tokens per group, normal above); the SGLang integration asks
`gemm_table.table_choice` (ours only where measured, else upstream). Re-tune on your GPU with one command:
    python benchmark/kernels/bench_grouped_gemm.py --tune
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (triton >= 3.3); config "tma" falls back to pointer loads without them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

from sgl_kernel_ext import gemm_table
from sgl_kernel_ext.gemm_table import GROUPED_VARIANTS, VARIANTS
from sgl_kernel_ext.hostmath import cdiv
from sgl_kernel_ext.quant import _interpreting, dequant_per_block, dequant_per_token_group

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # DeepSeek-V3: 1x128 activation groups, 128x128 weight blocks
LAYOUT_CONTIGUOUS, LAYOUT_MASKED, LAYOUT_DENSE = 0, 1, 2
SPLIT_AT = 32  # variant "split": groups with more tokens than this go to the normal variant
SWAPAB_MAX_M = 64  # heuristic threshold (tokens per group) without a table


class EpilogueCombine(NamedTuple):
    """The MoE combine done in the GEMM's epilogue: out[t] = weight_scale * sum_k weights[t*K + k] * (GEMM
    row of pair t*K + k), summed in slot order. counters (int32 [T, ceil(N / BLOCK_N)]; tail: [TAIL_COUNTERS])
    must be zero before the launch; out is [T, N] bf16 with unit inner stride. The GEMM still writes its own out
    (the rows)."""

    pair_of_row: torch.Tensor  # int32 [rows]: the (token, slot) pair a GEMM row holds (masked: g * max_m + i)
    row_of_pair: torch.Tensor  # int32 [T * top_k]: its inverse (flat row; masked: g * max_m + i)
    weights: torch.Tensor  # [T * top_k] router weights (fp32 or bf16)
    counters: torch.Tensor
    out: torch.Tensor
    top_k: int
    weight_scale: float = 1.0
    counts_only: bool = False  # benchmarks only: count and synchronize per tile, skip the gather (out not written)
    defer: bool = False  # gather after the program's last GEMM tile instead of inside the tile loop (module doc)
    tail: bool = False  # no per-tile count: one grid-wide arrival per program, then all gather (module doc)


# ---------------------------------------------------------------------------------------------
# Kernels (builtins only, no tl.cdiv / tl.zeros: those are @jit helpers, and when triton.language was
# imported before TRITON_INTERPRET=1 was set they cannot be called from an interpreted kernel)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _mma_tile(
    a_g, as_g, b_g, bs_g, rows, t_mask, n_tile, k0, n_lim,
    stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk, stride_bsn, stride_bsk,
    KB: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    a_desc=None, b_desc=None, a_row0=0, b_row0=0, TMA: tl.constexpr = False,
):
    """One output tile in fp32, [BLOCK_T, BLOCK_N]: KB scale blocks of K from k0, for A rows `rows`
    (t_mask: which are real) against weight rows n_tile*BLOCK_N.. of one group (bases a_g, as_g, b_g,
    bs_g already point at that group). Weight rows >= n_lim are not read (n_lim = 0: none are).
    TMA: the FP8 operands come through tensor descriptors instead (a_desc [rows, K] from row a_row0, b_desc
    [G * N, K] from row b_row0): whole boxes, so rows past the tile's real ones are read too (another
    group's, or zeros past the tensor). Each output element depends on its own A row and weight row only,
    and those rows are masked on the store, so the result is the same."""
    BLOCK_K: tl.constexpr = 128
    SCALAR_BS: tl.constexpr = BLOCK_N <= 128  # the tile sits inside one 128-row scale block
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_lim
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = a_g + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_g + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :] * stride_bk
    as_ptrs = as_g + rows * stride_asm + (k0 // BLOCK_K) * stride_ask
    if SCALAR_BS:
        bs_ptrs = bs_g + ((n_tile * BLOCK_N) // 128) * stride_bsn + (k0 // BLOCK_K) * stride_bsk
    else:
        bs_ptrs = bs_g + (offs_n // 128) * stride_bsn + (k0 // BLOCK_K) * stride_bsk
    if SWAP_AB:
        acc = tl.full([BLOCK_N, BLOCK_T], 0.0, tl.float32)
    else:
        acc = tl.full([BLOCK_T, BLOCK_N], 0.0, tl.float32)
    kc = k0
    for _ in range(KB):
        if TMA:
            a = a_desc.load([a_row0, kc])  # [BLOCK_T, 128] fp8
            b = b_desc.load([b_row0, kc])  # [BLOCK_N, 128] fp8
        else:
            a = tl.load(a_ptrs, mask=t_mask[:, None], other=0.0)  # [BLOCK_T, 128] fp8
            b = tl.load(b_ptrs, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, 128] fp8
        sa = tl.load(as_ptrs, mask=t_mask, other=0.0)  # [BLOCK_T]
        if SCALAR_BS:
            sb = tl.load(bs_ptrs, mask=n_lim > n_tile * BLOCK_N, other=0.0)
        else:
            sb = tl.load(bs_ptrs, mask=n_mask, other=0.0)  # [BLOCK_N]
        if SWAP_AB:
            d = tl.dot(b, tl.trans(a))  # [BLOCK_N, BLOCK_T]: weights on the MMA's M side
            if SCALAR_BS:
                acc += d * (sa[None, :] * sb)
            else:
                acc += d * sa[None, :] * sb[:, None]
        else:
            d = tl.dot(a, tl.trans(b))  # [BLOCK_T, BLOCK_N]
            if SCALAR_BS:
                acc += d * (sa[:, None] * sb)
            else:
                acc += d * sa[:, None] * sb[None, :]
        kc += BLOCK_K
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        as_ptrs += stride_ask
        bs_ptrs += stride_bsk
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_T, BLOCK_N]; one return: Triton 3.6 rejects returns of different shapes
    return acc


@triton.jit
def _combine_epilogue(res, out_ptr, g64, rows, offs_t, offs_n, t_mask, n_tile, n_tiles, N, MAX_M, pid, deferred,
                      stride_og, stride_om, stride_on, cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr,
                      cmb_out_ptr, cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP,
                      LAYOUT: tl.constexpr, COMBINE_TOPK: tl.constexpr, COMBINE_GATHER: tl.constexpr,
                      COMBINE_DEFER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """EpilogueCombine for one finished tile (both walks): store its bf16 rows, count them per (token, N-tile),
    and where this tile completed a token's N-range gather it now (or note it, COMBINE_DEFER). Returns the
    program's updated count of noted entries."""
    o_ptrs = out_ptr + g64 * stride_og + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & (offs_n < N)[None, :])
    tl.debug_barrier()  # every thread's rows precede the counts' release below
    pair = tl.load(cmb_pair_ptr + g64 * MAX_M + rows, mask=t_mask, other=0)
    tok = (pair // COMBINE_TOPK).to(tl.int64)
    old = tl.atomic_add(cmb_cnt_ptr + tok * n_tiles + n_tile, 1, mask=t_mask, sem="acq_rel")
    last = t_mask & (old == COMBINE_TOPK - 1)  # this tile completed (token, N-tile): gather it
    if not COMBINE_GATHER:  # EpilogueCombine.counts_only (benchmarks): what the counting alone costs
        last = last & (offs_t < 0)
    tl.debug_barrier()  # the acquiring threads' view covers every thread's loads below
    if COMBINE_DEFER:  # note (token, N-tile) for after the program's last tile; a predicated store, not an if:
        # an if that updates the loop-carried count breaks Triton 3.6's loop flattening (config flat)
        noted = tl.sum(last.to(tl.int32)) > 0
        tl.store(dfr_ptr + pid * DFR_CAP + deferred + tl.arange(0, BLOCK_T),
                 tl.where(last, tok * n_tiles + n_tile, -1).to(tl.int32), mask=(tl.arange(0, BLOCK_T) >= 0) & noted)
        deferred += tl.where(noted, BLOCK_T, 0)
    else:
        gather_sum(out_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr + tok * stride_cmb_om, tok,
                   tok * 0 + n_tile * BLOCK_N, last, N, MAX_M, stride_og, stride_om, stride_on,
                   cmb_w_scale, LAYOUT, COMBINE_TOPK, BLOCK_T, BLOCK_N)
    return deferred


@triton.jit
def _deferred_gathers(out_ptr, pid, deferred, n_tiles, N, MAX_M, stride_og, stride_om, stride_on,
                      cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP,
                      LAYOUT: tl.constexpr, COMBINE_TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """COMBINE_DEFER: this program's gathers, after its GEMM tiles (each noted by the tile that completed it)."""
    tl.debug_barrier()  # the list's stores, and the acquires behind them, precede the loads below
    j = pid * 0
    while j < deferred:
        e = tl.load(dfr_ptr + pid * DFR_CAP + j + tl.arange(0, BLOCK_T))
        last = e >= 0
        e64 = tl.where(last, e, 0).to(tl.int64)
        tok = e64 // n_tiles
        gather_sum(out_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr + tok * stride_cmb_om, tok,
                   (e64 % n_tiles) * BLOCK_N, last, N, MAX_M, stride_og, stride_om, stride_on, cmb_w_scale,
                   LAYOUT, COMBINE_TOPK, BLOCK_T, BLOCK_N)
        j += BLOCK_T


@triton.jit
def _tail_gathers(out_ptr, pid, NUM_PROGRAMS, cnt_ptr, n_tiles, N, MAX_M, stride_og, stride_om, stride_on,
                  cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, NUM_TOKENS, MAX_SPIN,
                  LAYOUT: tl.constexpr, COMBINE_TOPK: tl.constexpr, COMBINE_GATHER: tl.constexpr,
                  INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """COMBINE_TAIL: after its last GEMM tile a program arrives at one grid-wide counter (CTA barrier, one acq_rel
    add); once every program arrived (volatile polls, then one acquire), each gathers every NUM_PROGRAMS-th block of
    BLOCK_T (token, N-tile) items. The launcher caps the grid at the resident capacity, so the wait is short; one
    that runs out after MAX_SPIN polls marks the counter (TAIL_GAVE_UP_SHIFT) and leaves its share to the last arrival,
    which gathers every item when its add returns a mark (module doc). Under the interpreter programs run one after
    another: there the last one to arrive gathers every item."""
    tl.debug_barrier()  # every thread's rows precede the release below
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")  # (the last to arrive acquires every other program's rows here)
    arrived = (old & TAIL_ARRIVALS) + 1
    if INTERPRET:
        go = arrived == NUM_PROGRAMS
        j, stride = pid * 0, BLOCK_T
    else:
        everything = (arrived == NUM_PROGRAMS) & ((old >> TAIL_GAVE_UP_SHIFT) != 0)  # the last, after a leaver
        if arrived < NUM_PROGRAMS:
            spins = pid * 0
            while (arrived < NUM_PROGRAMS) & (spins < MAX_SPIN):  # volatile polls (polling with ld.acquire made
                arrived = tl.load(cnt_ptr, volatile=True) & TAIL_ARRIVALS  # the wait 2-3x longer: tail_acquire_poll)
                spins += 1
            if arrived < NUM_PROGRAMS:  # ran out: mark and leave, unless every program arrived before the mark
                arrived = tl.atomic_add(cnt_ptr, 1 << TAIL_GAVE_UP_SHIFT, sem="acq_rel") & TAIL_ARRIVALS
            else:
                arrived = tl.atomic_add(cnt_ptr, 0, sem="acquire") & TAIL_ARRIVALS  # every program's rows
        go = arrived >= NUM_PROGRAMS
        j = tl.where(everything, 0, pid * BLOCK_T)
        stride = tl.where(everything, BLOCK_T, NUM_PROGRAMS * BLOCK_T)
    tl.debug_barrier()  # the acquiring thread's view covers every thread's loads below
    items = NUM_TOKENS * n_tiles
    while go & (j < items):
        it = j + tl.arange(0, BLOCK_T)
        ok = it < items
        if not COMBINE_GATHER:  # counts_only (benchmarks): the barrier, no gather
            ok = ok & (it < 0)
        tok = (it // n_tiles).to(tl.int64)
        gather_sum(out_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr + tok * stride_cmb_om, tok,
                   (it % n_tiles) * BLOCK_N, ok, N, MAX_M, stride_og, stride_om, stride_on, cmb_w_scale,
                   LAYOUT, COMBINE_TOPK, BLOCK_T, BLOCK_N, 64)  # 2 passes (1 pass of 128: 200 registers, not 120)
        j += stride


@triton.jit
def _in_count_range(m, M_LO, M_HI):
    """A group's (or every group's) token count as its walk sees it: count_range M_LO < M_HI keeps the counts with
    M_LO < m <= M_HI and makes the rest 0 (they belong to the other launch of a split call); M_LO >= M_HI: all."""
    if M_LO < M_HI:
        m = tl.where((m > M_LO) & (m <= M_HI), m, 0)
    return m


@triton.jit
def _fp8_grouped_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, ws_ptr, indptr_ptr, masked_m_ptr,
    M_DENSE, MAX_M, N, NUM_PROGRAMS,
    stride_ag, stride_am, stride_ak,
    stride_asg, stride_asm, stride_ask,
    stride_bg, stride_bn, stride_bk,
    stride_bsg, stride_bsn, stride_bsk,
    stride_og, stride_om, stride_on,
    stride_ws_split, stride_ws_row,
    sig_ptr, SIG_STRIDE,
    cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om,
    dfr_ptr, DFR_CAP, M_LO, M_HI,
    G: tl.constexpr, K: tl.constexpr, LAYOUT: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SIGNAL: tl.constexpr = False,
    COMBINE_TOPK: tl.constexpr = 0, COMBINE_GATHER: tl.constexpr = True, COMBINE_DEFER: tl.constexpr = False,
    COMBINE_TAIL: tl.constexpr = False, NUM_TOKENS=0, MAX_SPIN=0, INTERPRET: tl.constexpr = False,
    fix_ptr=None, SERIAL_REDUCE: tl.constexpr = False,
):
    KB_PER_SPLIT: tl.constexpr = K // 128 // SPLIT_K

    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    tile = pid
    tiles_before = pid * 0
    deferred = pid * 0  # entries in this program's deferred gather list (COMBINE_DEFER)
    for g in range(G):
        if LAYOUT == 0:  # contiguous
            row0 = tl.load(indptr_ptr + g)
            m = tl.load(indptr_ptr + g + 1) - row0
        elif LAYOUT == 1:  # masked
            row0 = 0
            m = tl.minimum(tl.load(masked_m_ptr + g), MAX_M)
        else:  # dense
            row0 = 0
            m = M_DENSE
        m = _in_count_range(tl.maximum(m, 0), M_LO, M_HI)
        t_tiles = (m + BLOCK_T - 1) // BLOCK_T
        group_tiles = t_tiles * n_tiles * SPLIT_K
        g64 = tl.cast(g, tl.int64)
        while tile < tiles_before + group_tiles:
            local = tile - tiles_before
            ks = local % SPLIT_K
            rest = local // SPLIT_K
            t_tile = rest % t_tiles
            n_tile = rest // t_tiles

            offs_t = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
            t_mask = offs_t < m
            rows = (row0 + offs_t).to(tl.int64)  # row within the group's A / out slab
            offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            res = _mma_tile(a_ptr + g64 * stride_ag, as_ptr + g64 * stride_asg, b_ptr + g64 * stride_bg,
                            bs_ptr + g64 * stride_bsg, rows, t_mask, n_tile, ks * (KB_PER_SPLIT * 128), N,
                            stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk,
                            stride_bsn, stride_bsk, KB_PER_SPLIT, SWAP_AB, BLOCK_N, BLOCK_T)
            o_mask = t_mask[:, None] & n_mask[None, :]
            if COMBINE_TOPK > 0 and not COMBINE_TAIL:  # the MoE combine in the epilogue (EpilogueCombine); tail:
                # plain rows below (split-K 1, no signal), combined in the grid's tail
                deferred = _combine_epilogue(
                    res, out_ptr, g64, rows, offs_t, offs_n, t_mask, n_tile, n_tiles, N, MAX_M, pid, deferred,
                    stride_og, stride_om, stride_on, cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr, cmb_out_ptr,
                    cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP,
                    LAYOUT, COMBINE_TOPK, COMBINE_GATHER, COMBINE_DEFER, BLOCK_T, BLOCK_N)
            elif SPLIT_K == 1:
                o_ptrs = out_ptr + g64 * stride_og + rows[:, None] * stride_om + offs_n[None, :] * stride_on
                tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)
                if HAS_SIGNAL:  # SBO: one count per finished N-tile of (group, token tile)
                    tl.debug_barrier()  # the whole CTA's stores precede the release below
                    tl.atomic_add(sig_ptr + g64 * SIG_STRIDE + t_tile, 1, mask=t_tile < SIG_STRIDE,
                                  sem="release")
            else:
                w_rows = g64 * MAX_M + rows  # flat output row (MAX_M = 0 unless masked)
                w_ptrs = ws_ptr + w_rows[:, None] * stride_ws_row + offs_n[None, :]
                tl.store(w_ptrs + ks * stride_ws_split, res, mask=o_mask)
                if SERIAL_REDUCE:  # the k-slice that completes this output tile sums them all (no reduce kernel)
                    tl.debug_barrier()  # the whole CTA's partial stores precede the release below
                    cnt = fix_ptr + tiles_before // SPLIT_K + rest
                    arrived = tl.atomic_add(cnt, 1, sem="acq_rel")
                    if arrived == SPLIT_K - 1:
                        tl.debug_barrier()  # every thread's loads below follow the acquire
                        acc = tl.full([BLOCK_T, BLOCK_N], 0.0, tl.float32)
                        for s in range(SPLIT_K):  # the reduce kernel's order: bit-equal results
                            acc += tl.load(w_ptrs + s * stride_ws_split, mask=o_mask, other=0.0, cache_modifier=".cg")
                        o_ptrs = out_ptr + g64 * stride_og + rows[:, None] * stride_om + offs_n[None, :] * stride_on
                        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
                        tl.atomic_xchg(cnt, 0, sem="relaxed")  # ready for the next launch on this stream
            tile += NUM_PROGRAMS
        tiles_before += group_tiles
    if COMBINE_TAIL:
        _tail_gathers(out_ptr, pid, NUM_PROGRAMS, cmb_cnt_ptr, n_tiles, N, MAX_M, stride_og, stride_om, stride_on,
                      cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, NUM_TOKENS, MAX_SPIN,
                      LAYOUT, COMBINE_TOPK, COMBINE_GATHER, INTERPRET, BLOCK_T, BLOCK_N)
    if COMBINE_DEFER:
        _deferred_gathers(out_ptr, pid, deferred, n_tiles, N, MAX_M, stride_og, stride_om, stride_on,
                          cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP,
                          LAYOUT, COMBINE_TOPK, BLOCK_T, BLOCK_N)


@triton.jit
def _flat_tile_mma(tile, walk, ops, strides, KB: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_T: tl.constexpr, TMA: tl.constexpr):
    """One tile of the flattened walk, up to its fp32 result: the group from the running tile counts (cum,
    inclusive), the token tile fastest within a group, then _mma_tile. TMA: the FP8 operands through descriptors
    over A as [groups * A_ROWS_PER_GROUP (masked) or rows, K] and the weights as [G * N, K]. The walk state,
    operands and strides come in tuples, as the flat kernels (here and ep_combine's) pass them.
    Returns (res, g64, rows, offs_t, offs_n, t_mask, n_tile)."""
    gi, start, m_vec, cum, gt, N = walk
    a_ptr, as_ptr, b_ptr, bs_ptr, a_desc, b_desc, A_ROWS_PER_GROUP = ops
    (stride_ag, stride_am, stride_ak, stride_asg, stride_asm, stride_ask, stride_bg, stride_bn, stride_bk,
     stride_bsg, stride_bsn, stride_bsk) = strides
    g = tl.sum((cum <= tile).to(tl.int32), 0)  # the groups wholly before this tile
    sel = gi == g
    before = tl.sum(tl.where(sel, cum - gt, 0), 0)
    m = tl.sum(tl.where(sel, m_vec, 0), 0)
    row0 = tl.sum(tl.where(sel, start, 0), 0)
    t_tiles = (m + BLOCK_T - 1) // BLOCK_T
    local = tile - before
    t_tile = local % t_tiles
    n_tile = local // t_tiles
    g64 = g.to(tl.int64)
    offs_t = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < m
    rows = (row0 + offs_t).to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    res = _mma_tile(a_ptr + g64 * stride_ag, as_ptr + g64 * stride_asg, b_ptr + g64 * stride_bg,
                    bs_ptr + g64 * stride_bsg, rows, t_mask, n_tile, 0, N,
                    stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk,
                    stride_bsn, stride_bsk, KB, SWAP_AB, BLOCK_N, BLOCK_T,
                    a_desc, b_desc, (g * A_ROWS_PER_GROUP + row0 + t_tile * BLOCK_T).to(tl.int32),
                    (g * N + n_tile * BLOCK_N).to(tl.int32), TMA)
    return res, g64, rows, offs_t, offs_n, t_mask, n_tile


@triton.jit
def _flat_walk_state(indptr_ptr, masked_m_ptr, MAX_M, N, G: tl.constexpr, G_P2: tl.constexpr,
                     LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, M_LO, M_HI):
    """The flattened walk's state from one vector load of the layout: ((gi, start, m_vec, cum, gt, N) for
    _flat_tile_mma, the total tile count). Groups outside the count range (`_in_count_range`) have no tiles."""
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    gi = tl.arange(0, G_P2)
    gmask = gi < G
    if LAYOUT == 0:  # contiguous
        start = tl.load(indptr_ptr + gi, mask=gmask, other=0)
        m_vec = tl.load(indptr_ptr + gi + 1, mask=gmask, other=0) - start
    else:  # masked
        start = gi * 0
        m_vec = tl.minimum(tl.load(masked_m_ptr + gi, mask=gmask, other=0), MAX_M)
    m_vec = _in_count_range(tl.maximum(m_vec, 0), M_LO, M_HI)
    gt = (m_vec + BLOCK_T - 1) // BLOCK_T * n_tiles
    cum = tl.cumsum(gt, 0)
    return (gi, start, m_vec, cum, gt, N), tl.sum(gt, 0)


@triton.jit
def _flat_tile(tile, walk, deferred, ops, strides, out, cmb, pid, n_tiles, MAX_M,
               KB: tl.constexpr, LAYOUT: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_T: tl.constexpr, TMA: tl.constexpr, COMBINE_TOPK: tl.constexpr, COMBINE_GATHER: tl.constexpr,
               COMBINE_DEFER: tl.constexpr):
    """One tile of the plain flat kernel: _flat_tile_mma, then the store or EpilogueCombine (COMBINE_TOPK > 0).
    Returns `deferred`."""
    res, g64, rows, offs_t, offs_n, t_mask, n_tile = _flat_tile_mma(tile, walk, ops, strides, KB, SWAP_AB,
                                                                    BLOCK_N, BLOCK_T, TMA)
    out_ptr, stride_og, stride_om, stride_on = out
    N = walk[5]
    cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP = cmb
    if COMBINE_TOPK > 0:
        deferred = _combine_epilogue(
            res, out_ptr, g64, rows, offs_t, offs_n, t_mask, n_tile, n_tiles, N, MAX_M, pid, deferred,
            stride_og, stride_om, stride_on, cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr, cmb_out_ptr,
            cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP,
            LAYOUT, COMBINE_TOPK, COMBINE_GATHER, COMBINE_DEFER, BLOCK_T, BLOCK_N)
    else:
        o_ptrs = out_ptr + g64 * stride_og + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & (offs_n < N)[None, :])
    return deferred


@triton.jit
def _fp8_grouped_gemm_flat_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, indptr_ptr, masked_m_ptr,
    MAX_M, N, NUM_PROGRAMS,
    stride_ag, stride_am, stride_ak,
    stride_asg, stride_asm, stride_ask,
    stride_bg, stride_bn, stride_bk,
    stride_bsg, stride_bsn, stride_bsk,
    stride_og, stride_om, stride_on,
    a_desc, b_desc, A_ROWS_PER_GROUP,
    cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om,
    dfr_ptr, DFR_CAP, M_LO, M_HI,
    G: tl.constexpr, G_P2: tl.constexpr, K: tl.constexpr, LAYOUT: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr = False,
    COMBINE_TOPK: tl.constexpr = 0, COMBINE_GATHER: tl.constexpr = True, COMBINE_DEFER: tl.constexpr = False,
):
    """config "flat": the plain grouped GEMM (masked / contiguous, SPLIT_K = 1, no signal; EpilogueCombine
    allowed) with the persistent walk as one tl.range over this program's tiles, flatten=True: the compiler
    pipelines the tile and K loops as one, so the next tile's first weight blocks load while this tile's last
    ones multiply (and while its epilogue counts), instead of each tile's K loop filling and draining its own
    pipeline (the down GEMM has 16 K blocks per tile). The groups' tile counts come from one vector load of the
    layout and a cumulative sum."""
    KB: tl.constexpr = K // 128
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    walk, total = _flat_walk_state(indptr_ptr, masked_m_ptr, MAX_M, N, G, G_P2, LAYOUT, BLOCK_N, BLOCK_T,
                                   M_LO, M_HI)
    deferred = pid * 0  # entries in this program's deferred gather list (COMBINE_DEFER)
    ops = (a_ptr, as_ptr, b_ptr, bs_ptr, a_desc, b_desc, A_ROWS_PER_GROUP)
    strides = (stride_ag, stride_am, stride_ak, stride_asg, stride_asm, stride_ask, stride_bg, stride_bn, stride_bk,
               stride_bsg, stride_bsn, stride_bsk)
    out = (out_ptr, stride_og, stride_om, stride_on)
    cmb = (cmb_pair_ptr, cmb_rowp_ptr, cmb_w_ptr, cmb_cnt_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP)
    if INTERPRET:  # the interpreter cannot range() from a program id
        tile = pid
        while tile < total:
            deferred = _flat_tile(tile, walk, deferred, ops, strides, out, cmb, pid, n_tiles, MAX_M, KB, LAYOUT,
                                  SWAP_AB, BLOCK_N, BLOCK_T, TMA, COMBINE_TOPK, COMBINE_GATHER, COMBINE_DEFER)
            tile += NUM_PROGRAMS
    else:
        for tile in tl.range(pid, total, NUM_PROGRAMS, flatten=True):
            deferred = _flat_tile(tile, walk, deferred, ops, strides, out, cmb, pid, n_tiles, MAX_M, KB, LAYOUT,
                                  SWAP_AB, BLOCK_N, BLOCK_T, TMA, COMBINE_TOPK, COMBINE_GATHER, COMBINE_DEFER)
    if COMBINE_DEFER:
        _deferred_gathers(out_ptr, pid, deferred, n_tiles, N, MAX_M, stride_og, stride_om, stride_on,
                          cmb_rowp_ptr, cmb_w_ptr, cmb_out_ptr, cmb_w_scale, stride_cmb_om, dfr_ptr, DFR_CAP,
                          LAYOUT, COMBINE_TOPK, BLOCK_T, BLOCK_N)


@triton.jit
def _token_tile_map_kernel(indptr_ptr, masked_m_ptr, MAX_M, map_ptr, count_ptr, T_MAX, M_LO, M_HI,
                           G: tl.constexpr, G_P2: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_T: tl.constexpr):
    """config "ws", first launch (one program): every real token tile of every group, in group order, as
    (group, first row, end of the group's rows) in map_ptr [tiles, 3], and their count in count_ptr[0]. Rows as the
    group walk counts them (masked: within the group's slab; contiguous: rows of A). T_MAX: token tiles the largest
    group can have."""
    walk, total = _flat_walk_state(indptr_ptr, masked_m_ptr, MAX_M, 1, G, G_P2, LAYOUT, 1, BLOCK_T, M_LO, M_HI)
    gi, start, m_vec, cum, tiles, _ = walk  # one weight tile per group: tiles = token tiles
    gmask = gi < G
    j = 0
    while j < T_MAX:  # the j-th token tile of every group at once (while: the interpreter cannot range() to an arg)
        ok = gmask & (j < tiles)
        entry = map_ptr + (cum - tiles + j) * 3
        tl.store(entry, gi, mask=ok)
        tl.store(entry + 1, start + j * BLOCK_T, mask=ok)
        tl.store(entry + 2, start + m_vec, mask=ok)
        j += 1
    tl.store(count_ptr, total)


@triton.jit
def _ws_tile(tile, m_tiles, map_ptr, N, ops, scale_strides, out, KB: tl.constexpr, SWAP_AB: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """One tile of config ws: its token tile from the map (token tiles fastest, so programs running together
    share a weight tile), _mma_tile over TMA boxes, the store. Operands and strides in tuples, as the flat walk
    passes them."""
    a_ptr, as_ptr, b_ptr, bs_ptr, a_desc, b_desc, A_ROWS_PER_GROUP = ops
    stride_asg, stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk = scale_strides
    out_ptr, stride_og, stride_om, stride_on = out
    entry = map_ptr + (tile % m_tiles) * 3
    n_tile = tile // m_tiles
    g = tl.load(entry)
    g64 = g.to(tl.int64)
    row0 = tl.load(entry + 1)
    offs_t = row0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < tl.load(entry + 2)
    rows = offs_t.to(tl.int64)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    res = _mma_tile(a_ptr, as_ptr + g64 * stride_asg, b_ptr, bs_ptr + g64 * stride_bsg, rows, t_mask, n_tile, 0, N,
                    0, 1, stride_asm, stride_ask, 0, 1, stride_bsn, stride_bsk, KB, SWAP_AB, BLOCK_N, BLOCK_T,
                    a_desc, b_desc, (g * A_ROWS_PER_GROUP + row0).to(tl.int32),
                    (g * N + n_tile * BLOCK_N).to(tl.int32), True)
    o_ptrs = out_ptr + g64 * stride_og + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _fp8_grouped_gemm_ws_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, map_ptr, count_ptr, N, NUM_PROGRAMS,
    stride_asg, stride_asm, stride_ask,
    stride_bsg, stride_bsn, stride_bsk,
    stride_og, stride_om, stride_on,
    a_desc, b_desc, A_ROWS_PER_GROUP,
    K: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr,
    SPECIALIZE: tl.constexpr = False,
):
    """config "ws" (masked / contiguous, plain outputs), second launch: a persistent walk over the mapped token
    tiles x weight tiles, left to the software pipeliner. SPECIALIZE (config ws_split): Triton 3.6 warp-specializes
    the loop on sm_90a (tl.range(warp_specialize=True)): a producer warp group only issues the TMA copies, running
    ahead into the next tile while the MMA warp groups (given the registers by setmaxnreg) multiply, promote the
    scales and store; DeepGEMM's structure, which mostly hung on the H200 (see the module docstring).
    Why a map kernel first: that pass rejects a kernel with any reduction (the flat walk finds its groups with
    sums) or an early return, and leaves a flattened loop unspecialized."""
    KB: tl.constexpr = K // 128
    pid = tl.program_id(0)
    m_tiles = tl.load(count_ptr)
    total = m_tiles * ((N + BLOCK_N - 1) // BLOCK_N)
    ops = (a_ptr, as_ptr, b_ptr, bs_ptr, a_desc, b_desc, A_ROWS_PER_GROUP)
    scale_strides = (stride_asg, stride_asm, stride_ask, stride_bsg, stride_bsn, stride_bsk)
    out = (out_ptr, stride_og, stride_om, stride_on)
    if INTERPRET:  # the interpreter cannot range() from a program id
        tile = pid
        while tile < total:
            _ws_tile(tile, m_tiles, map_ptr, N, ops, scale_strides, out, KB, SWAP_AB, BLOCK_N, BLOCK_T)
            tile += NUM_PROGRAMS
    else:
        for tile in tl.range(pid, total, NUM_PROGRAMS, warp_specialize=SPECIALIZE):
            _ws_tile(tile, m_tiles, map_ptr, N, ops, scale_strides, out, KB, SWAP_AB, BLOCK_N, BLOCK_T)


TAIL_GAVE_UP_SHIFT = tl.constexpr(20)  # EpilogueCombine.tail's counter: arrivals below bit 20, give-ups above
TAIL_ARRIVALS = tl.constexpr((1 << 20) - 1)
GATHER_COLS = tl.constexpr(32)  # columns per gather pass: [BLOCK_T, 32] pointer tiles keep the registers low


@triton.jit
def gather_sum(y_ptr, rowp_ptr, w_ptr, dst, tok, col0, last, N, MAX_M, stride_yg, stride_ym, stride_yn, w_scale,
               LAYOUT: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
               COLS: tl.constexpr = GATHER_COLS):
    """The combine of the rows flagged `last` (the MoE combine in a GEMM epilogue; also ep_combine's):
    dst[row][col0 : col0 + BLOCK_N] = w_scale * sum_k w_k * (GEMM row of pair tok * TOPK + k), fp32 in slot order;
    dst: [BLOCK_T] pointers to the output rows, col0 per row; a slot without a row (row id -1: another EP rank's
    expert) adds nothing. In COLS-column passes (default GATHER_COLS): inside the tile loop a whole [BLOCK_T,
    BLOCK_N] tile of 64-bit row pointers per slot took the swapAB kernel from 116 to 212 registers; after it (the
    tail form) one pass, so the row ids and weights are read once, not once per pass."""
    for c in range(0, BLOCK_N, COLS):  # a loop, not unrolled: passes must not overlap in registers
        cols = col0[:, None] + (c + tl.arange(0, COLS))[None, :]
        col_ok = cols < N
        total = tl.full([BLOCK_T, COLS], 0.0, tl.float32)
        for k in tl.static_range(TOPK):
            pk = tok * TOPK + k
            rk = tl.load(rowp_ptr + pk, mask=last, other=-1).to(tl.int64)
            hit = last & (rk >= 0)
            wk = tl.load(w_ptr + pk, mask=hit, other=0.0).to(tl.float32)
            if LAYOUT == 1:  # masked: flat row g * MAX_M + i
                rbase = (rk // MAX_M) * stride_yg + (rk % MAX_M) * stride_ym
            else:
                rbase = rk * stride_ym
            yk = tl.load(y_ptr + rbase[:, None] + cols * stride_yn, mask=hit[:, None] & col_ok, other=0.0,
                         cache_modifier=".cg")  # L2: rows other SMs just wrote
            total += yk.to(tl.float32) * wk[:, None]
        tl.store(dst[:, None] + cols, (total * w_scale).to(dst.dtype.element_ty), mask=last[:, None] & col_ok)


@triton.jit
def _fp8_moe_aligned_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, sorted_ptr, expert_ptr, ntpp_ptr, w_ptr,
    N, NUM_PROGRAMS, NUM_VALID, w_scale,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bg, stride_bn, stride_bk,
    stride_bsg, stride_bsn, stride_bsk,
    stride_om, stride_on,
    K: tl.constexpr, A_DIV: tl.constexpr, HAS_WEIGHT: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grouped GEMM on moe_align_block_size's layout (block size BLOCK_T): block j holds BLOCK_T
    (token, slot) pair ids sorted_ptr[j*BLOCK_T ..] of expert expert_ptr[j]; ids >= NUM_VALID pad.

    Pair id p reads A row p // A_DIV (A_DIV = top_k: the token's hidden state; 1: a per-pair row) and
    writes out row p, times w_ptr[p] * w_scale with HAS_WEIGHT. Blocks of expert -1 (filtered under
    expert parallelism) write zeros without reading weights. Persistent over blocks x weight tiles;
    the number of blocks is read on the GPU (num_tokens_post_padded), so there is no host sync.
    """
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    n_blocks = tl.load(ntpp_ptr) // BLOCK_T
    tile = pid
    while tile < n_blocks * n_tiles:
        blk = tile % n_blocks
        n_tile = tile // n_blocks  # blocks fastest: one expert's blocks share each weight tile in L2
        e = tl.load(expert_ptr + blk)
        ids = tl.load(sorted_ptr + blk * BLOCK_T + tl.arange(0, BLOCK_T))
        real = ids < NUM_VALID
        rows = ids.to(tl.int64)
        e64 = tl.maximum(e, 0).to(tl.int64)
        res = _mma_tile(a_ptr, as_ptr, b_ptr + e64 * stride_bg, bs_ptr + e64 * stride_bsg,
                        rows // A_DIV, real & (e >= 0), n_tile, 0, tl.where(e >= 0, N, 0),
                        stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk,
                        stride_bsn, stride_bsk, K // 128, SWAP_AB, BLOCK_N, BLOCK_T)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + rows, mask=real, other=0.0).to(tl.float32) * w_scale
            res = res * w[:, None]
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=real[:, None] & (offs_n[None, :] < N))
        tile += NUM_PROGRAMS


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, out_ptr, indptr_ptr, masked_m_ptr,
    N, MAX_M, stride_ws_split, stride_ws_row, stride_orow,
    G: tl.constexpr, LAYOUT: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[r, :] = sum over k-slices of ws[:, r, :], for the valid flat rows r only."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if LAYOUT == 0:
        valid = (r >= tl.load(indptr_ptr)) & (r < tl.load(indptr_ptr + G))
    elif LAYOUT == 1:
        valid = (r % MAX_M) < tl.minimum(tl.load(masked_m_ptr + r // MAX_M), MAX_M)
    else:
        valid = r >= 0
    mask = (offs < N) & valid
    r64 = r.to(tl.int64)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(ws_ptr + s * stride_ws_split + r64 * stride_ws_row + offs, mask=mask, other=0.0)
    tl.store(out_ptr + r64 * stride_orow + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Configuration: the heuristic, and the per-GPU table's choice (gemm_table)
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 4  # CPU / interpreter: a few programs, so the persistent stride is exercised
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(t: torch.Tensor) -> int:
    return _num_sms(t.device.index if t.is_cuda else None)


def heuristic_config(variant: str, m: int, n: int, k: int, groups: int, num_sms: int = 132) -> dict:
    """Tile config without a table. m: (expected) tokens per group.

    swapab: BLOCK_T = 16/32/64 tokens (smallest covering m), BLOCK_N = 128 weight rows, or 64 when
    128-row tiles would leave SMs idle; 4 warps, 4 stages (smem (BLOCK_N+BLOCK_T)*128 B per stage),
    2 programs per SM. normal: up to 128 tokens 64 x 128 tiles on 4 warps, 4 stages, 2 programs per SM
    (H200, 8-32 groups at 64 and 128 tokens: 1.05-1.6x faster than one 3-stage program per SM, session 36's
    tune in benchmark/results/swapab); above, BLOCK_T 128 on 8 warps, 3 stages, 1 per SM. split: its boundary
    and one stream (each half's tiles come from that variant's own config, `split_plan`).
    """
    if variant == "swapab":
        bt = 16 if m <= 16 else 32 if m <= 32 else 64
        tiles128 = groups * cdiv(max(m, 1), bt) * cdiv(n, 128)
        bn = 128 if tiles128 >= num_sms else 64
        return {"BLOCK_N": bn, "BLOCK_T": bt, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2}
    if variant == "normal":
        if m <= 128:
            return {"BLOCK_N": 128, "BLOCK_T": 64, "num_warps": 4, "num_stages": 4, "programs_per_sm": 2}
        return {"BLOCK_N": 128, "BLOCK_T": 128, "num_warps": 8, "num_stages": 3, "programs_per_sm": 1}
    if variant == "split":
        return {"split_at": SPLIT_AT, "split_streams": 1}
    raise ValueError(f"variant must be one of {GROUPED_VARIANTS}, got {variant!r}")


def choose_variant(m: int, n: int, k: int, groups: int, gpu_name: str | None = None,
                   layout: str | None = None) -> str:
    """'swapab' | 'normal' | 'split' | 'upstream' for `groups` experts of about m tokens each, [N, K] weights.

    From the GPU's table (`gemm_table.lookup`; nearest group count in log2, then the smallest tabulated m
    >= m), else the heuristic: 'swapab' for m <= 64 tokens per group, 'normal' above (never
    'upstream' without a measurement). gpu_name None: this process's GPU. layout ('contiguous',
    'masked', 'dense') keeps only entries measured for it (entries without "layout" match any).
    """
    entry = gemm_table.lookup(m, n, k, groups, gpu_name if gpu_name is not None else gemm_table.this_gpu(), layout)
    if entry is not None:
        return entry["best"]
    return "swapab" if m <= SWAPAB_MAX_M else "normal"


def choose_config(variant: str, m: int, n: int, k: int, groups: int, gpu_name: str | None = None,
                  num_sms: int = 132, layout: str | None = None) -> dict:
    """Tile config for one of our variants: the table's tuned one when present, else the heuristic."""
    entry = gemm_table.lookup(m, n, k, groups, gpu_name if gpu_name is not None else gemm_table.this_gpu(), layout)
    cfg = heuristic_config(variant, m, n, k, groups, num_sms)
    if entry is not None and variant in entry.get("config", {}):
        cfg.update(entry["config"][variant])
    return cfg


def resolve_config(variant: str, config: dict | None, m_hint: int, n: int, k: int, groups: int,
                   layout: str, num_sms: int = 132) -> tuple[str, dict]:
    """(variant, full tile config) that the grouped GEMMs use for these arguments: callers that
    need the token tile (SBO signal granularity) resolve first and pass the config back."""
    return _resolve(variant, config, m_hint, n, k, groups, num_sms, layout)


def _auto_variant(m_hint: int, n: int, k: int, groups: int, layout: str, allowed: tuple) -> str:
    """What 'auto' runs: the table's variant if it is in `allowed`, else (upstream: the caller asked us anyway;
    split: one launch wanted) our guess by tokens per group."""
    variant = choose_variant(m_hint, n, k, groups, layout=layout)
    if variant in allowed:
        return variant
    return "swapab" if m_hint <= SWAPAB_MAX_M else "normal"


def _resolve(variant: str, config: dict | None, m_hint: int, n: int, k: int, groups: int,
             num_sms: int, layout: str) -> tuple[str, dict]:
    if variant == "auto":
        variant = _auto_variant(m_hint, n, k, groups, layout, VARIANTS)
    if variant in VARIANTS:
        cfg = choose_config(variant, m_hint, n, k, groups, num_sms=num_sms, layout=layout)
    else:
        raise ValueError(f"variant must be 'auto' or one of {VARIANTS} (grouped layouts: also 'split'), "
                         f"got {variant!r}")
    if config:
        cfg = {**cfg, **config}
    bn, bt = cfg["BLOCK_N"], cfg["BLOCK_T"]
    if bn not in (16, 32, 64, 128, 256) or bt not in (16, 32, 64, 128, 256):
        raise ValueError(f"BLOCK_N {bn} / BLOCK_T {bt} must be powers of two in 16..256")
    return variant, cfg


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------
def _check_operands(a, a_scale, b, b_scale, rows_dims: int):
    if a.dtype != FP8 or b.dtype != FP8:
        raise TypeError(f"a and b must be float8_e4m3fn, got {a.dtype}, {b.dtype}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {a_scale.dtype}, {b_scale.dtype}")
    k = a.shape[-1]
    if k % SCALE_BLOCK or b.shape[-1] != k:
        raise ValueError(f"K must match and be a multiple of {SCALE_BLOCK}: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if tuple(a_scale.shape) != (*a.shape[:rows_dims], k // SCALE_BLOCK):
        raise ValueError(f"a_scale {tuple(a_scale.shape)} does not match a {tuple(a.shape)} (1x128 groups)")
    want = (*b.shape[:-2], cdiv(b.shape[-2], SCALE_BLOCK), k // SCALE_BLOCK)
    if tuple(b_scale.shape) != want:
        raise ValueError(f"b_scale {tuple(b_scale.shape)} should be {want} (128x128 blocks)")


def _pick_split_k(tiles: int, kb: int, num_sms: int) -> int:
    """Smallest divisor of the K-block count that gives >= num_sms work items, keeping >= 4 blocks each."""
    if tiles >= num_sms:
        return 1
    for d in range(2, kb + 1):
        if kb % d == 0 and kb // d >= 4 and tiles * d >= num_sms:
            return d
    best = 1
    for d in range(2, kb + 1):
        if kb % d == 0 and kb // d >= 4:
            best = d
    return best


def _check_combine(c: EpilogueCombine, n: int, block_n: int, split_k: int, signal) -> None:
    if split_k > 1 or signal is not None:
        raise ValueError("combine needs split_k == 1 and no signal (the epilogue replaces the store)")
    if c.tail and c.defer:
        raise ValueError("combine: tail and defer are two forms, pick one")
    t = c.out.shape[0]
    tiles = cdiv(n, block_n)
    if c.top_k < 1 or c.weights.numel() != t * c.top_k:
        raise ValueError(f"combine: weights has {c.weights.numel()} entries, want tokens {t} x top_k {c.top_k}")
    if c.out.shape != (t, n) or c.out.stride(1) != 1:
        raise ValueError(f"combine: out must be [{t}, {n}] with unit inner stride, got {tuple(c.out.shape)}")
    if c.row_of_pair.dtype != torch.int32 or c.row_of_pair.numel() != t * c.top_k:
        raise ValueError(f"combine: row_of_pair must be int32 [{t * c.top_k}], got {c.row_of_pair.dtype} "
                         f"{tuple(c.row_of_pair.shape)}")
    want = (TAIL_COUNTERS,) if c.tail else (t, tiles)
    what = ", tail: arrivals and give-ups" if c.tail else ""
    if c.counters.shape != want or c.counters.dtype != torch.int32 or not c.counters.is_contiguous():
        raise ValueError(f"combine: counters must be contiguous int32 {list(want)} (BLOCK_N {block_n}{what}), "
                         f"got {c.counters.dtype} {tuple(c.counters.shape)}")
    if c.pair_of_row.dtype != torch.int32:
        raise ValueError(f"combine: pair_of_row must be int32, got {c.pair_of_row.dtype}")


TAIL_COUNTERS = 1  # EpilogueCombine.tail's int32 counter: arrivals (low 20 bits) and give-ups (above)
# EpilogueCombine.tail: polls of the grid-wide counter before a waiter leaves its share to the last arrival (~30-60
# ms; the longest wait measured, beside the shared expert, is tens of us). Bounds the cost of a program that cannot
# start (another kernel holding its SM) without deciding the result.
TAIL_MAX_SPIN = 1 << 16


def _compile_options(cfg: dict) -> dict:
    """A tile config's compile options. "maxnreg" caps ptxas' registers per thread: the 128 x 32 swapAB tile takes 176
    at 4 warps, so two programs fit per SM where three fit by shared memory; an uneven draw's extra token tiles then
    wait for a second round (Nsight Compute, gate_up 8 x 32 uneven: swapab/profile_grouped_gemm_*_h200.json)."""
    opts = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


_RESIDENT: dict = {}  # (device, kernel, constexprs and scalars) -> programs resident at once


def _resident_programs(kernel, pos, kw, device) -> int:
    """How many programs of `kernel` (compiled for these arguments; no launch) the GPU holds at once: per SM the
    least of what its registers (allocated per warp in 256s), shared memory and threads allow. Cached per
    compile-relevant arguments: the warmup behind it costs an eager call (prefill) a second launch's host time."""
    key = (str(device), kernel, tuple(sorted(kw.items())), tuple(p for p in pos if isinstance(p, (bool, int, float))))
    if key not in _RESIDENT:
        _RESIDENT[key] = _count_resident(kernel, pos, kw, device)
    return _RESIDENT[key]


def _count_resident(kernel, pos, kw, device) -> int:
    k = kernel.warmup(*pos, grid=(1,), **kw)
    if hasattr(k, "_init_handles"):
        k._init_handles()  # fills n_regs
    props = torch.cuda.get_device_properties(device)
    per_sm = resident_per_sm(k.n_regs, int(getattr(k.metadata, "shared", 0) or 0), kw.get("num_warps", 4),
                             props.regs_per_multiprocessor, props.shared_memory_per_multiprocessor,
                             props.max_threads_per_multi_processor)
    return max(1, per_sm) * props.multi_processor_count


def resident_per_sm(regs: int, shared: int, warps: int, regs_per_sm: int = 65536, shared_per_sm: int = 233472,
                    threads_per_sm: int = 2048) -> int:
    """Programs of one compiled kernel an SM holds at once (defaults: sm_90): the least of what its registers
    (allocated per warp in 256s), shared memory (1 KB reserved per program) and threads allow. Registers are what
    held swapAB's 128 x 32 tile to two per SM where shared memory allowed three (session 43)."""
    regs_per_warp = -(-max(1, regs) * 32 // 256) * 256
    return min(regs_per_sm // (regs_per_warp * warps), shared_per_sm // (shared + 1024),
               threads_per_sm // (32 * warps), 32)


def _tma_descriptors(a3: torch.Tensor, b: torch.Tensor, block_t: int, block_n: int):
    """Host-side tensor descriptors of config "tma": A as [groups * rows, K], the weights as [G * N, K], boxes of
    [BLOCK_T | BLOCK_N, 128]; None where the operands' layout does not allow them (rows not dense and 16-byte
    aligned: the pointer path then runs, the same result)."""
    if TensorDescriptor is None:
        return None
    k = b.shape[2]
    views = []
    for t in (a3, b):
        rows = t.shape[0] * t.shape[1]
        dense = t.stride(2) == 1 and t.stride(1) == k and (t.shape[0] == 1 or t.stride(0) == t.shape[1] * k)
        if not dense or t.data_ptr() % 16 or k % 16:
            return None
        views.append(t.as_strided((rows, k), (k, 1)))
    return (TensorDescriptor.from_tensor(views[0], [block_t, SCALE_BLOCK]),
            TensorDescriptor.from_tensor(views[1], [block_n, SCALE_BLOCK]))


FIXUP_TILES = 1 << 16  # output tiles one serial-reduce launch may have (split-K runs have a few hundred)
_fixup_buffers: dict = {}  # (device, stream) -> int32 counters, all zero between launches; never freed (graphs)


def _fixup_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """This stream's per-output-tile arrival counters for a serial-reduce split-K launch (config "serial_reduce"),
    or None (then the reduce kernel runs): more tiles than FIXUP_TILES, or a first use inside a CUDA-graph capture,
    where a new buffer would come from the graph's pool. One buffer per stream: launches on one stream run in order
    and each leaves its counters at zero; launches on two streams at once never share one."""
    if tiles > FIXUP_TILES:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _fixup_buffers.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _fixup_buffers[key] = torch.zeros(FIXUP_TILES, dtype=torch.int32, device=device)
    return buf


def _launch(layout, a, a_scale, b, b_scale, out, *, indptr=None, masked_m=None, m_dense=0,
            max_m=0, upper_tiles_t, variant, cfg, split_k, signal=None, num_sms=None,
            combine: EpilogueCombine | None = None, count_range: tuple[int, int] = (-1, -1)):
    """count_range (lo, hi), lo < hi: only the groups with lo < m <= hi (one half of a split call)."""
    groups, n, k = b.shape
    swap = variant == "swapab"
    bn, bt = cfg["BLOCK_N"], cfg["BLOCK_T"]
    kb = k // SCALE_BLOCK
    if kb % split_k:
        raise ValueError(f"split_k {split_k} must divide K/128 = {kb}")
    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    s3 = a_scale if a_scale.dim() == 3 else a_scale.unsqueeze(0)
    o3 = out if out.dim() == 3 else out.unsqueeze(0)
    group_strides = layout == LAYOUT_MASKED
    sa_g = (a3.stride(0), s3.stride(0), o3.stride(0)) if group_strides else (0, 0, 0)
    num_sms = _device_sms(a) if num_sms is None else num_sms
    upper = max(1, upper_tiles_t * cdiv(n, bn) * split_k)
    num_programs = min(upper, num_sms * cfg.get("programs_per_sm", 1))
    dummy = indptr if indptr is not None else masked_m if masked_m is not None else b_scale
    fix = None
    if split_k > 1:
        if not out.is_contiguous():
            raise ValueError("split_k > 1 needs a contiguous out")
        rows_flat = out.numel() // n
        ws = torch.empty(split_k, rows_flat, n, dtype=torch.float32, device=a.device)
        ws_strides = (ws.stride(0), ws.stride(1))
        if cfg.get("serial_reduce") and signal is None and combine is None:
            fix = _fixup_counters(a.device, upper // split_k)
    else:
        ws, ws_strides = out, (0, 0)
    if signal is not None:
        if split_k > 1:
            raise ValueError("signal needs split_k == 1 (a k-slice is not a finished tile)")
        if signal.dtype != torch.int32 or signal.dim() != 2 or signal.shape[0] != groups or not signal.is_contiguous():
            raise ValueError(f"signal must be a contiguous int32 [G={groups}, token blocks], got "
                             f"{signal.dtype} {tuple(signal.shape)}")
    if combine is not None:
        _check_combine(combine, n, cfg["BLOCK_N"], split_k, signal)
        cmb = (combine.pair_of_row, combine.row_of_pair, combine.weights, combine.counters, combine.out,
               float(combine.weight_scale), combine.out.stride(0))
    else:
        cmb = (dummy, dummy, dummy, dummy, dummy, 1.0, 0)
    defer = combine is not None and combine.defer
    tail = combine is not None and combine.tail
    dfr_cap = cdiv(upper, num_programs) * bt if defer else 0  # a program's tiles x rows, at most
    dfr = torch.empty(num_programs * dfr_cap, dtype=torch.int32, device=a.device) if defer else dummy
    combine_kw = dict(COMBINE_TOPK=combine.top_k if combine is not None else 0,
                      COMBINE_GATHER=combine is None or not combine.counts_only, COMBINE_DEFER=defer)
    plain = signal is None and split_k == 1 and layout != LAYOUT_DENSE
    descs = _tma_descriptors(a3, b, bt, bn) if plain and (cfg.get("ws") or cfg.get("tma")) else None
    if cfg.get("ws") and plain and combine is None and descs is not None:
        if cfg.get("ws_split") and os.environ.get("SGLANG_H20_WS_SPLIT") != "1":
            raise ValueError("config ws_split: Triton 3.6's warp-specialized loop never completed on the H200 in 5 of "
                             "6 cases (benchmark/results/swapab/probe_ws_walk*_h200.json); set SGLANG_H20_WS_SPLIT=1 "
                             "to run it anyway (probe_ws_walk.py does, each case under a timeout)")
        t_max = cdiv(max_m if layout == LAYOUT_MASKED else a3.shape[1], bt)  # a group's token tiles, at most
        upper_t = max(1, min(upper_tiles_t, groups * t_max))
        buf = torch.empty(3 * upper_t + 1, dtype=torch.int32, device=a.device)
        tile_map, count = buf[:-1], buf[-1:]
        _token_tile_map_kernel[(1,)](indptr if indptr is not None else dummy,
                                     masked_m if masked_m is not None else dummy, max_m, tile_map, count, t_max,
                                     *count_range,
                                     G=groups, G_P2=triton.next_power_of_2(groups), LAYOUT=layout, BLOCK_T=bt,
                                     num_warps=4)
        _fp8_grouped_gemm_ws_kernel[(num_programs,)](  # programs past the mapped tiles find none
            a3, s3, b, b_scale, o3, tile_map, count, n, num_programs,
            sa_g[1], s3.stride(1), s3.stride(2),
            b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
            sa_g[2], o3.stride(1), o3.stride(2),
            *descs, a3.shape[1] if layout == LAYOUT_MASKED else 0,
            K=k, SWAP_AB=swap, BLOCK_N=bn, BLOCK_T=bt, INTERPRET=_interpreting(),
            SPECIALIZE=bool(cfg.get("ws_split", False)),
            **_compile_options(cfg),
        )
        return out
    if cfg.get("flat") and plain and not tail:
        descs = descs if cfg.get("tma") else None
        _fp8_grouped_gemm_flat_kernel[(num_programs,)](
            a3, s3, b, b_scale, o3, indptr if indptr is not None else dummy,
            masked_m if masked_m is not None else dummy, max_m if layout == LAYOUT_MASKED else 0, n, num_programs,
            sa_g[0], a3.stride(1), a3.stride(2),
            sa_g[1], s3.stride(1), s3.stride(2),
            b.stride(0), b.stride(1), b.stride(2),
            b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
            sa_g[2], o3.stride(1), o3.stride(2),
            *(descs or (None, None)), a3.shape[1] if layout == LAYOUT_MASKED else 0,
            *cmb, dfr, dfr_cap, *count_range,
            G=groups, G_P2=triton.next_power_of_2(groups), K=k, LAYOUT=layout, SWAP_AB=swap, BLOCK_N=bn,
            BLOCK_T=bt, INTERPRET=_interpreting(), TMA=descs is not None, **combine_kw,
            **_compile_options(cfg),
        )
        return out
    pos = [
        a3, s3, b, b_scale, o3, ws,
        indptr if indptr is not None else dummy, masked_m if masked_m is not None else dummy,
        m_dense, max_m if layout == LAYOUT_MASKED else 0, n, num_programs,
        sa_g[0], a3.stride(1), a3.stride(2),
        sa_g[1], s3.stride(1), s3.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        sa_g[2], o3.stride(1), o3.stride(2),
        *ws_strides,
        signal if signal is not None else dummy, signal.shape[1] if signal is not None else 0,
        *cmb, dfr, dfr_cap, *count_range,
    ]
    kw = dict(G=groups, K=k, LAYOUT=layout, SWAP_AB=swap, BLOCK_N=bn, BLOCK_T=bt, SPLIT_K=split_k,
              HAS_SIGNAL=signal is not None, **combine_kw, COMBINE_TAIL=tail,
              NUM_TOKENS=combine.out.shape[0] if tail else 0, MAX_SPIN=TAIL_MAX_SPIN, INTERPRET=_interpreting(),
              **({"fix_ptr": fix, "SERIAL_REDUCE": True} if fix is not None else {}),
              **_compile_options(cfg))
    if tail and not _interpreting():  # the tail's wait needs every program resident at once
        num_programs = pos[11] = min(num_programs, _resident_programs(_fp8_grouped_gemm_kernel, pos, kw, a.device))
    _fp8_grouped_gemm_kernel[(num_programs,)](*pos, **kw)
    if split_k > 1 and fix is None:
        block = 256
        _splitk_reduce_kernel[(rows_flat, cdiv(n, block))](
            ws, out, indptr if indptr is not None else dummy, masked_m if masked_m is not None else dummy,
            n, max(max_m, 1), ws.stride(0), ws.stride(1), n,
            G=groups, LAYOUT=layout, SPLIT_K=split_k, BLOCK=block, num_warps=4,
        )
    return out


def _split_config(m_hint: int, n: int, k: int, groups: int, layout: str, config: dict | None = None,
                 num_sms: int = 132) -> dict:
    """variant "split"'s whole config: the caller's keys over the table's (else the heuristic's)."""
    return {**choose_config("split", m_hint, n, k, groups, num_sms=num_sms, layout=layout), **(config or {})}


def split_plan(m_hint: int, n: int, k: int, groups: int, layout: str, config: dict | None = None,
               num_sms: int = 132) -> list[tuple[str, dict, tuple[int, int]]]:
    """variant "split"'s two launches as (variant, full tile config, count_range): swapAB on the groups with at most
    split_at tokens (config, else the table's boundary for this key, else SPLIT_AT), the normal variant on the rest.
    config may carry "swapab" / "normal" sub-configs (else each variant's own config: swapAB at m_hint, normal at
    4 x split_at tokens per group)."""
    return _split_halves(_split_config(m_hint, n, k, groups, layout, config, num_sms), m_hint, n, k, groups, layout,
                         num_sms)


def _split_halves(config: dict, m_hint: int, n: int, k: int, groups: int, layout: str,
                  num_sms: int) -> list[tuple[str, dict, tuple[int, int]]]:
    """`split_plan` from the whole config (`_split_config`), which `_split_launch` also reads for its streams."""
    t = int(config["split_at"])
    if t < 1:
        raise ValueError(f"split_at must be >= 1 token, got {t}")
    halves = (("swapab", min(m_hint, t), (-1, t)), ("normal", max(m_hint, 4 * t), (t, 1 << 30)))
    return [(v, _resolve(v, config.get(v), hint, n, k, groups, num_sms, layout)[1], count_range)
            for v, hint, count_range in halves]


def _split_launch(layout, layout_name, a, a_scale, b, b_scale, out, *, m_hint, upper_tiles_t, config, split_k,
                  signal, combine, num_sms, **walk):
    """variant "split": one grouped GEMM as two launches over the same operands (`split_plan`). An uneven routing
    puts hundreds of tokens on a few experts; as swapAB tiles those re-read each weight tile every BLOCK_T tokens.
    The split is by each group's count on the GPU (count_range in the walks): no host sync, CUDA-graph safe.
    upper_tiles_t(BLOCK_T): the walk's bound on token tiles."""
    if split_k != 1 or signal is not None or combine is not None:
        raise ValueError("variant 'split' runs plain outputs only (split_k 1, no signal, no combine)")
    groups, n, k = b.shape
    sms = _device_sms(a) if num_sms is None else num_sms
    config = _split_config(m_hint, n, k, groups, layout_name, config, sms)
    plan = _split_halves(config, m_hint, n, k, groups, layout_name, sms)

    def run(variant, cfg, count_range):
        _launch(layout, a, a_scale, b, b_scale, out, upper_tiles_t=upper_tiles_t(cfg["BLOCK_T"]), variant=variant,
                cfg=cfg, split_k=1, num_sms=num_sms, count_range=count_range, **walk)

    if int(config["split_streams"]) < 2 or not a.is_cuda:
        for half in plan:
            run(*half)
        return out
    # two streams: the heavy experts' normal launch first on a side stream, swapAB's on this one; the later
    # kernel's programs take the SMs the earlier one's programs leave as they finish, instead of waiting for its
    # last wave. The halves write disjoint groups' rows; this stream waits for the side one before returning.
    main = torch.cuda.current_stream(a.device)
    side = _side_stream(a.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        run(*plan[1])
    run(*plan[0])
    main.wait_stream(side)
    return out


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One extra stream per device for variant split's concurrent half (split_streams 2)."""
    return torch.cuda.Stream(device=device)


def m_grouped_fp8_gemm_nt_contiguous(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                                     b_scale: torch.Tensor, m_indptr: torch.Tensor,
                                     out: torch.Tensor | None = None, variant: str = "auto",
                                     config: dict | None = None, split_k: int = 1,
                                     signal: torch.Tensor | None = None, num_sms: int | None = None,
                                     combine: EpilogueCombine | None = None) -> torch.Tensor:
    """Contiguous grouped GEMM: out[r] = A[r] @ B[g]^T for m_indptr[g] <= r < m_indptr[g+1].

    a [M_total, K] fp8, a_scale [M_total, K/128] fp32, b [G, N, K] fp8, b_scale [G, ceil(N/128), K/128]
    fp32, m_indptr [G+1] int32 (non-decreasing; empty experts allowed). out [M_total, N] bf16 (made if
    None; rows outside [m_indptr[0], m_indptr[G]) are left as they were). variant: 'auto' (table or
    heuristic on M_total/G tokens per group), 'swapab', 'normal' or 'split' (both, by each group's count:
    `_split_launch`); config overrides tile keys.
    signal / num_sms / combine: as for m_grouped_fp8_gemm_nt_masked (signal[g, j]: group g's token tile j).
    """
    _check_operands(a, a_scale, b, b_scale, 1)
    groups, n, k = b.shape
    if m_indptr.shape != (groups + 1,) or m_indptr.dtype != torch.int32:
        raise ValueError(f"m_indptr must be int32 [{groups + 1}], got {m_indptr.dtype} {tuple(m_indptr.shape)}")
    m_total = a.shape[0]
    if out is None:
        out = torch.empty(m_total, n, dtype=torch.bfloat16, device=a.device)
    if m_total == 0 or groups == 0:
        return out
    m_hint = cdiv(m_total, groups)
    if variant == "auto":
        variant = _auto_variant(m_hint, n, k, groups, "contiguous", GROUPED_VARIANTS)
    if variant == "split":
        return _split_launch(LAYOUT_CONTIGUOUS, "contiguous", a, a_scale, b, b_scale, out, m_hint=m_hint,
                             upper_tiles_t=lambda bt: m_total // bt + min(groups, m_total), config=config,
                             split_k=split_k, signal=signal, combine=combine, num_sms=num_sms, indptr=m_indptr)
    variant, cfg = _resolve(variant, config, m_hint, n, k, groups, _device_sms(a), "contiguous")
    # sum_g ceil(m_g / BT) <= M_total / BT + (number of non-empty groups)
    upper_t = m_total // cfg["BLOCK_T"] + min(groups, m_total)
    return _launch(LAYOUT_CONTIGUOUS, a, a_scale, b, b_scale, out, indptr=m_indptr,
                   upper_tiles_t=upper_t, variant=variant, cfg=cfg, split_k=split_k, signal=signal,
                   num_sms=num_sms, combine=combine)


def m_grouped_fp8_gemm_nt_masked(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                                 b_scale: torch.Tensor, masked_m: torch.Tensor,
                                 out: torch.Tensor | None = None, variant: str = "auto",
                                 expected_m: int | None = None, config: dict | None = None,
                                 split_k: int = 1, signal: torch.Tensor | None = None,
                                 num_sms: int | None = None, combine: EpilogueCombine | None = None) -> torch.Tensor:
    """Masked grouped GEMM: out[g, t] = A[g, t] @ B[g]^T for t < masked_m[g].

    a [G, max_m, K] fp8, a_scale [G, max_m, K/128] fp32, b [G, N, K], b_scale [G, ceil(N/128), K/128],
    masked_m [G] int32 (values above max_m are clamped). out [G, max_m, N] bf16; rows t >= masked_m[g]
    are left as they were. expected_m (tokens per group, as in DeepGEMM) picks the variant and tiles
    for 'auto'; default max_m. variant 'split': as for m_grouped_fp8_gemm_nt_contiguous.

    signal (single-batch overlap): int32 [G, ceil(max_m / BLOCK_T)], zeroed by the caller; each
    finished [BLOCK_T, BLOCK_N] output tile adds 1 to signal[g, token tile] with release semantics
    after its store, so a consumer that reads ceil(N / BLOCK_N) there with acquire may read those
    rows while the GEMM still runs (sgl_kernel_ext.sbo). Pass the full config so BLOCK_T is known
    (`resolve_config`). Token tiles beyond signal.shape[1] are not signalled. num_sms: SMs the
    persistent grid may fill (default all), to leave some to a concurrent kernel.
    combine (`EpilogueCombine`): also do the MoE combine in the epilogue (out still receives the rows); pass
    the full config so BLOCK_N is known for the counters.
    """
    _check_operands(a, a_scale, b, b_scale, 2)
    groups, n, k = b.shape
    if a.dim() != 3 or a.shape[0] != groups:
        raise ValueError(f"a must be [G={groups}, max_m, K], got {tuple(a.shape)}")
    if masked_m.shape != (groups,) or masked_m.dtype != torch.int32:
        raise ValueError(f"masked_m must be int32 [{groups}], got {masked_m.dtype} {tuple(masked_m.shape)}")
    max_m = a.shape[1]
    if out is None:
        out = torch.empty(groups, max_m, n, dtype=torch.bfloat16, device=a.device)
    if max_m == 0 or groups == 0:
        return out
    m_hint = expected_m if expected_m is not None else max_m
    if variant == "auto":
        variant = _auto_variant(m_hint, n, k, groups, "masked", GROUPED_VARIANTS)
    if variant == "split":
        return _split_launch(LAYOUT_MASKED, "masked", a, a_scale, b, b_scale, out, m_hint=m_hint,
                             upper_tiles_t=lambda bt: groups * cdiv(max_m, bt), config=config, split_k=split_k,
                             signal=signal, combine=combine, num_sms=num_sms, masked_m=masked_m, max_m=max_m)
    variant, cfg = _resolve(variant, config, m_hint, n, k, groups, _device_sms(a), "masked")
    upper_t = groups * cdiv(max_m, cfg["BLOCK_T"])
    return _launch(LAYOUT_MASKED, a, a_scale, b, b_scale, out, masked_m=masked_m, max_m=max_m,
                   upper_tiles_t=upper_t, variant=variant, cfg=cfg, split_k=split_k, signal=signal,
                   num_sms=num_sms, combine=combine)


def fp8_gemm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                out: torch.Tensor | None = None, variant: str = "auto", config: dict | None = None,
                split_k: int | None = None, num_sms: int | None = None) -> torch.Tensor:
    """Dense out[M, N] = A[M, K] @ B[N, K]^T (bf16), the same kernel with one group.

    a_scale [M, K/128], b_scale [ceil(N/128), K/128]. split_k None: automatic (k-slices when the
    output tiles alone would leave SMs idle, e.g. M = 1..64 with N = 2112). num_sms: the persistent grid
    spans this many SMs' worth of programs instead of all, so that a kernel beside it (the routed experts beside
    the shared expert) keeps the rest; the automatic split_k is picked for that grid.
    """
    _check_operands(a, a_scale, b, b_scale, 1)
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0:
        return out
    sms = _device_sms(a) if num_sms is None else max(1, min(int(num_sms), _device_sms(a)))
    variant, cfg, split_k = plan_fp8_gemm_nt(m, n, k, variant, config, split_k, sms)
    return _launch(LAYOUT_DENSE, a, a_scale, b.unsqueeze(0), b_scale.unsqueeze(0), out, m_dense=m,
                   upper_tiles_t=cdiv(m, cfg["BLOCK_T"]), variant=variant, cfg=cfg, split_k=split_k, num_sms=sms)


def m_grouped_fp8_gemm_nt_aligned(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                                  b_scale: torch.Tensor, sorted_token_ids: torch.Tensor,
                                  expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                                  num_valid: int, out: torch.Tensor, block_t: int, a_div: int = 1,
                                  topk_weights: torch.Tensor | None = None, weight_scale: float = 1.0,
                                  variant: str = "swapab", config: dict | None = None) -> torch.Tensor:
    """MoE grouped GEMM straight on SGLang's `moe_align_block_size(topk_ids, block_t, E)` output.

    Why this layout: SGLang's Triton MoE path already sorts (token, slot) pairs by expert this way,
    padded to block_t per expert; reading A rows through sorted_token_ids (pair p reads row
    p // a_div) saves both a gather pass and a copy of the activations.
    a [rows, K] fp8, a_scale [rows, K/128] fp32 (any strides); b [E, N, K], b_scale
    [E, ceil(N/128), K/128]; out [num_valid, N] bf16 (num_valid = topk_ids.numel()): out[p] =
    A[p // a_div] @ B[expert(p)]^T, times topk_weights.view(-1)[p] * weight_scale when given. Pairs
    of expert -1 get zero rows. block_t is the alignment's block size and becomes the token tile.
    """
    _check_operands(a, a_scale, b, b_scale, 1)
    groups, n, k = b.shape
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if block_t not in (16, 32, 64, 128, 256):
        raise ValueError(f"block_t {block_t} must be a power of two in 16..256")
    if sorted_token_ids.dtype != torch.int32 or expert_ids.dtype != torch.int32:
        raise ValueError("sorted_token_ids and expert_ids must be int32")
    if out.shape != (num_valid, n) or out.dtype != torch.bfloat16:
        raise ValueError(f"out must be bf16 [{num_valid}, {n}], got {out.dtype} {tuple(out.shape)}")
    if topk_weights is not None:
        topk_weights = topk_weights.reshape(-1)
        if topk_weights.numel() != num_valid:
            raise ValueError(f"topk_weights has {topk_weights.numel()} values for {num_valid} pairs")
    if num_valid == 0:
        return out
    cfg = {**heuristic_config(variant, block_t, n, k, groups), **(config or {}), "BLOCK_T": block_t}
    bn = cfg["BLOCK_N"]
    upper = cdiv(sorted_token_ids.numel(), block_t) * cdiv(n, bn)
    num_programs = max(1, min(upper, _device_sms(a) * cfg.get("programs_per_sm", 1)))
    _fp8_moe_aligned_kernel[(num_programs,)](
        a, a_scale, b, b_scale, out, sorted_token_ids, expert_ids, num_tokens_post_padded,
        topk_weights if topk_weights is not None else b_scale,
        n, num_programs, num_valid, float(weight_scale),
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out.stride(0), out.stride(1),
        K=k, A_DIV=a_div, HAS_WEIGHT=topk_weights is not None, SWAP_AB=variant == "swapab",
        BLOCK_N=bn, BLOCK_T=block_t, **_compile_options(cfg),
    )
    return out


OTHER_WALKS = ("flat", "tma", "ws")  # config keys of walks m_grouped_fp8_gemm_nt_aligned does not have


def aligned_runs(config: dict | None) -> bool:
    """Whether the aligned kernel runs the walk a table config was measured with (it has the group walk only, so a
    time measured on flat / tma / ws says nothing about it)."""
    return not any((config or {}).get(key) for key in OTHER_WALKS)


def plan_fp8_gemm_nt(m: int, n: int, k: int, variant: str = "auto", config: dict | None = None,
                     split_k: int | None = None, num_sms: int = 132) -> tuple[str, dict, int]:
    """(variant, tile config, split_k) that fp8_gemm_nt uses for this shape (benchmarks record it)."""
    variant, cfg = _resolve(variant, config, m, n, k, 1, num_sms, "dense")
    if split_k is None:
        split_k = cfg.get("split_k")  # a tuned table entry's k-slices
    if split_k is None:
        tiles = cdiv(m, cfg["BLOCK_T"]) * cdiv(n, cfg["BLOCK_N"])
        split_k = _pick_split_k(tiles, k // SCALE_BLOCK, num_sms * cfg.get("programs_per_sm", 1))
    return variant, cfg, split_k


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def grouped_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                           m_indptr: torch.Tensor | None = None,
                           masked_m: torch.Tensor | None = None) -> torch.Tensor:
    """float32 result on the DEQUANTIZED inputs; rows that belong to no group are 0.

    Dense (b [N, K], neither index given), contiguous (m_indptr) or masked (masked_m, a [G, max_m, K]).
    """
    ad = dequant_per_token_group(a, a_scale)
    bd = dequant_per_block(b, b_scale, SCALE_BLOCK)
    if b.dim() == 2:
        return ad @ bd.T
    groups, n, _ = b.shape
    if m_indptr is not None:
        out = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
        ip = m_indptr.tolist()
        for g in range(groups):
            if ip[g + 1] > ip[g]:
                out[ip[g]:ip[g + 1]] = ad[ip[g]:ip[g + 1]] @ bd[g].T
        return out
    if masked_m is None:
        raise ValueError("grouped reference needs m_indptr or masked_m")
    out = torch.zeros(groups, a.shape[1], n, dtype=torch.float32, device=a.device)
    for g, mm in enumerate(masked_m.tolist()):
        mm = min(mm, a.shape[1])
        if mm > 0:
            out[g, :mm] = ad[g, :mm] @ bd[g].T
    return out
