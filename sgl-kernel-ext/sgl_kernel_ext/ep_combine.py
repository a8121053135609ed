"""The expert-parallel (EP) MoE combine fused into the down GEMM's epilogue (a measured prototype, not wired in).

Why. Under EP without DeepEP, SGLang's StandardDispatcher all-gathers every rank's tokens to every rank,
maps non-local experts to -1 (dropped pairs), each rank runs its local experts for ALL gathered tokens,
combines them locally into a per-token partial sum, and a collective sums those partials back on the
ranks that own the tokens (for FP8: the MoE block's all-reduce or the layer communicator's reduce-scatter
after the MoE; `StandardDispatcher.combine` reduce-scatters only on the FP4 all-gather path). That
collective starts only after the whole down GEMM and the local combine have finished. Here the partial of
a (token, N-tile) leaves the GPU as soon as the tile that completes it is done: the collective's traffic
overlaps the rest of the GEMM, and neither the local combine kernel nor the collective's launch remains.

Measured (benchmark/kernels/bench_ep_combine.py, 2 H200s, 2026-11-30): correct (test_ep_combine_gpu), but
1.20-1.29x SLOWER than GEMM + local combine + NCCL reduce-scatter at 20-56 tokens per rank: the producer's
per-tile counts, remote stores and system-scope releases add 102-183 us to a 365-449 us GEMM, where the
combine and the collective add 25-41 us. Not wired into SGLang for that reason. Built since, not measured:
config {"flat": True, "tma": True} runs the producer on grouped_gemm_fp8's flattened, TMA-fed tile walk
(`_ep_down_combine_kernel` with FLAT: the same zero partials and the same epilogue, `_ep_epilogue`), so the
next tiles' weight loads stay in flight while a tile counts, sends and releases; the same partials, bit for
bit.

Data flow (rank r of `world`, G local experts, gathered tokens T = sum of every rank's tokens)
  producer  `_ep_down_combine_kernel` (one persistent kernel, the grouped GEMM's tile walk):
    1. each GEMM tile stores its bf16 rows y (as the plain GEMM does), then, after a CTA barrier, adds 1 per
       row to a local count[token, N-tile] (acq_rel, GPU scope);
    2. the tile that brings a count to local_pairs[token] (this rank's pairs of that token: top_k minus the
       dropped ones) gathers the token's local rows of this N-range in slot order (fp32, deterministic)
       and writes weight_scale * sum_k w_k y_k as an fp32 partial straight into the OWNER's receive
       buffer, recv_owner[r, owner_index[token], N-range], through a per-rank pointer table (on the GPU
       the peers' buffers are torch symmetric-memory mappings (symmetric_ep_buffers); in the CPU tests plain
       tensors);
    3. after a CTA barrier it adds 1 to the owner's arrivals[owner_index[token], N-tile] with release
       semantics at system scope (the partial and the count live in another GPU's memory);
    4. tokens with no local pair (no tile ever reaches them) are handled by the first ceil(T / BLOCK_T)
       work items, ahead of the GEMM tiles: they write a zero partial and arrive the same way, so every
       owner expects exactly `world` arrivals per (token, N-tile) and never waits forever.
  owner     `_ep_finish_kernel`: per (own token block, N-tile) it polls the arrivals (volatile loads, bounded
    by max_spin; on give-up it sets status = 1 instead of hanging), then one acquire atomic at system
    scope, sums recv[0..world-1] in rank order in fp32 (deterministic, unlike NCCL's ring order) and
    writes bf16 out; then it resets the arrivals to 0 for the next call.

Memory ordering. Producer: partial stores -> bar.sync (the CTA's stores precede the releasing threads'
atomic, which is cumulative) -> atom.add.release.sys on the owner's count. Owner: ld.volatile polls ->
atom.add(0).acquire.sys on the same count -> loads of recv (.cg). Release/acquire on the same location at
system scope makes every partial of that (token, N-tile) visible to the owner's loads.

Why fp32 partials: the owner's sum then rounds once to bf16, as a one-GPU combine does; bf16 partials
would add one rounding per rank (world ulps) and make the result depend on how the owner adds them. Cost:
twice the bytes of bf16 on NVLink (T_own x H x 4 B per source rank; 28 KB per token at H 7168), small at
decode sizes where the reduce-scatter is latency-bound. partial_dtype=torch.bfloat16 is accepted for
prefill-sized batches (the kernel casts on store).

Buffers (`EpBuffers`, one set per rank, the same capacity on every rank as symmetric memory needs):
  recv     [world, capacity, H] fp32 (or bf16): recv[src, i] = rank src's partial of this rank's token i
  arrivals [capacity, ceil(H / 128)] int32, zero at start; the finish resets what it consumed
  status   [1] int32: 1 = a wait gave up (out invalid)
Reuse: the owner's reset and its reads of recv must precede any producer of the next call. Under
SGLang the next layer's dispatch all-gather orders them (a rank's next producer needs every rank's next
tokens, which each rank computes only after its finish). The count grid is fixed at BLOCK_N = 128
columns (`COUNT_BLOCK_N`): every rank's GEMM is pinned to it, whatever tile the table picks, so a rank's
arrivals match the owner's grid.

All-gather index map (`allgather_maps`): gathered token i (rank-major, as all_gatherv lays them out)
belongs to rank token_owner[i] at index owner_index[i] within that rank's tokens.

Why a separate kernel rather than a third epilogue mode of grouped_gemm_fp8._fp8_grouped_gemm_kernel: it
shares the tile math (`_mma_tile`) and the gather (`gather_sum`) and copies only the ~30-line tile walk,
while the shipped GEMM modes keep their compiled code, argument list and compile-report entries unchanged;
the EP epilogue needs a dozen arguments of its own (pointer tables, owner maps, local counts) and a work
prelude (zero partials) that the other modes would carry as dead parameters. Compiles for sm_90a
(benchmark/kernels/compile_report.py ep): swapAB and normal tiles without spills (the gather runs in 32-column
passes, gather_sum).

Tests: test/cpu/test_ep_combine.py (world 2/4 emulated in one process under TRITON_INTERPRET),
test/gpu/test_ep_combine_gpu.py (2 GPUs, symmetric memory, against NCCL reduce_scatter),
test/cpu/test_compile_report.py (system-scope release / acquire in the PTX).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from sgl_kernel_ext import grouped_gemm_fp8 as gg
from sgl_kernel_ext import sbo
from sgl_kernel_ext.hostmath import cdiv
from sgl_kernel_ext.quant import _interpreting
from sgl_kernel_ext.sbo import MoeLayout

COUNT_BLOCK_N = 128  # columns per arrival count (the GEMM's BLOCK_N, pinned on every rank)
DEFAULT_MAX_SPIN = 1 << 22  # volatile polls per (token block, N-tile) before giving up (~1-2 s with the pause)
DEFAULT_SPIN_SLEEP_NS = 200  # pause between polls (0 under the interpreter)
FINISH_BLOCK_T = 16


class EpBuffers(NamedTuple):
    """One rank's receive side (see the module doc); peers write into recv / arrivals through mappings."""

    recv: torch.Tensor  # [world, capacity, H] partial dtype
    arrivals: torch.Tensor  # int32 [capacity, ceil(H / COUNT_BLOCK_N)]
    status: torch.Tensor  # int32 [1]


def ep_buffers(world: int, capacity: int, hidden: int, device, partial_dtype=torch.float32) -> EpBuffers:
    """Zeroed buffers for one rank (capacity: the most tokens any rank owns, e.g. SGLang's DP buffer length)."""
    if partial_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"partial_dtype must be float32 or bfloat16, got {partial_dtype}")
    return EpBuffers(torch.zeros(world, capacity, hidden, dtype=partial_dtype, device=device),
                     torch.zeros(capacity, cdiv(hidden, COUNT_BLOCK_N), dtype=torch.int32, device=device),
                     torch.zeros(1, dtype=torch.int32, device=device))


def allgather_maps(sizes: Sequence[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_owner, owner_index) int32 [sum(sizes)] for all_gatherv's rank-major layout (sizes: tokens per rank,
    SGLang's get_dp_global_num_tokens())."""
    owner = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(sizes, dtype=torch.int64))
    index = torch.cat([torch.arange(s, dtype=torch.int32) for s in sizes]) if sizes else owner
    return owner.to(device), index.to(device)


def build_ep_layout(topk_ids: torch.Tensor, num_local_experts: int,
                    masked_max_m: int | None = None) -> tuple[MoeLayout, torch.Tensor]:
    """(layout, local_pairs) for StandardDispatcher's local ids (topk_ids [T, K]: local expert ids, -1 = dropped):
    sbo.build_layout with drops (a dropped pair gets no row), and local_pairs int32 [T], each token's number
    of local pairs: the count the epilogue waits for."""
    layout = sbo.build_layout(topk_ids, num_local_experts, masked_max_m, drops=True)
    return layout, (topk_ids >= 0).sum(1).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Kernels (builtins only, as in grouped_gemm_fp8: they must also run under the interpreter)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _peer_ptr(tab_ptr, rank, BF16: tl.constexpr):
    """Rank(s) `rank`'s buffer base from an int64 pointer table, typed as the partials are."""
    raw = tl.load(tab_ptr + rank)
    if BF16:
        p = raw.to(tl.pointer_type(tl.bfloat16))
    else:
        p = raw.to(tl.pointer_type(tl.float32))
    return p


@triton.jit
def _ep_zero_partials(tile, T, N, NUM_PROGRAMS, RANK, RECV_CAP, npairs_ptr, owner_ptr, oidx_ptr, recv_tab_ptr,
                      arr_tab_ptr, PARTIAL_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Work items tile, tile + NUM_PROGRAMS, ... below ceil(T / BLOCK_T): tokens no local tile will complete
    publish "nothing from me" (a zero partial and its arrivals). Returns the program's first GEMM work item."""
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    empty_items = (T + BLOCK_T - 1) // BLOCK_T
    offs_b = tl.arange(0, BLOCK_N)
    while tile < empty_items:
        tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        none = (tok < T) & (tl.load(npairs_ptr + tok, mask=tok < T, other=1) == 0)
        own = tl.load(owner_ptr + tok, mask=none, other=0)
        oi = tl.load(oidx_ptr + tok, mask=none, other=0).to(tl.int64)
        dst = _peer_ptr(recv_tab_ptr, own, PARTIAL_BF16) + (RANK * RECV_CAP + oi) * N
        arr = tl.load(arr_tab_ptr + own, mask=none, other=0).to(tl.pointer_type(tl.int32)) + oi * n_tiles
        nt = tile * 0
        while nt < n_tiles:  # (a while loop: the interpreter cannot range() over a runtime scalar)
            offs_n = nt * BLOCK_N + offs_b
            zero = tl.full([BLOCK_T, BLOCK_N], 0.0, tl.float32)
            tl.store(dst[:, None] + offs_n[None, :], zero.to(dst.dtype.element_ty),
                     mask=none[:, None] & (offs_n[None, :] < N))
            tl.debug_barrier()
            tl.atomic_add(arr + nt, 1, mask=none, sem="release", scope="sys")
            nt += 1
        tile += NUM_PROGRAMS
    return tile


@triton.jit
def _ep_epilogue(res, g64, rows, offs_n, t_mask, n_tile, y, ep, N, MAX_M,
                 LAYOUT: tl.constexpr, TOPK: tl.constexpr, PARTIAL_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """A finished tile (both walks): store its bf16 rows, count them per (token, N-tile), and where this tile
    completed a token's local N-range gather the token's partial into its owner's receive buffer and release
    the owner's arrival at system scope (module doc)."""
    y_ptr, stride_yg, stride_ym = y
    pair_ptr, rowp_ptr, w_ptr, lcnt_ptr, npairs_ptr, owner_ptr, oidx_ptr, recv_tab_ptr, arr_tab_ptr, RANK, \
        RECV_CAP, w_scale = ep
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    y_ptrs = y_ptr + g64 * stride_yg + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, res.to(y_ptr.dtype.element_ty), mask=t_mask[:, None] & (offs_n < N)[None, :])
    tl.debug_barrier()  # every thread's rows precede the local counts' release
    pair = tl.load(pair_ptr + g64 * MAX_M + rows, mask=t_mask, other=0)
    tok = (pair // TOPK).to(tl.int64)
    need = tl.load(npairs_ptr + tok, mask=t_mask, other=0)
    old = tl.atomic_add(lcnt_ptr + tok * n_tiles + n_tile, 1, mask=t_mask, sem="acq_rel")
    last = t_mask & (old == need - 1)  # this tile completed the token's local N-range
    tl.debug_barrier()  # the acquiring threads' view covers every thread's loads below
    own = tl.load(owner_ptr + tok, mask=last, other=0)
    oi = tl.load(oidx_ptr + tok, mask=last, other=0).to(tl.int64)
    dst = _peer_ptr(recv_tab_ptr, own, PARTIAL_BF16) + (RANK * RECV_CAP + oi) * N
    gg.gather_sum(y_ptr, rowp_ptr, w_ptr, dst, tok, tok * 0 + n_tile * BLOCK_N, last, N, MAX_M,
                  stride_yg, stride_ym, 1, w_scale, LAYOUT, TOPK, BLOCK_T, BLOCK_N)
    tl.debug_barrier()  # the CTA's partial stores precede the release (cumulative) below
    arr = tl.load(arr_tab_ptr + own, mask=last, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_add(arr + oi * n_tiles + n_tile, 1, mask=last, sem="release", scope="sys")


@triton.jit
def _ep_down_combine_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, y_ptr, indptr_ptr, masked_m_ptr,
    pair_ptr, rowp_ptr, w_ptr, lcnt_ptr, npairs_ptr, owner_ptr, oidx_ptr, recv_tab_ptr, arr_tab_ptr,
    T, MAX_M, N, NUM_PROGRAMS, RANK, RECV_CAP, w_scale,
    stride_ag, stride_am, stride_ak,
    stride_asg, stride_asm, stride_ask,
    stride_bg, stride_bn, stride_bk,
    stride_bsg, stride_bsn, stride_bsk,
    stride_yg, stride_ym, a_desc, b_desc, A_ROWS_PER_GROUP,
    G: tl.constexpr, K: tl.constexpr, LAYOUT: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, TOPK: tl.constexpr, PARTIAL_BF16: tl.constexpr,
    FLAT: tl.constexpr = False, G_P2: tl.constexpr = 1, TMA: tl.constexpr = False, INTERPRET: tl.constexpr = False,
):
    """Producer: items 0..ceil(T/BLOCK_T)-1 publish zero partials of tokens without local pairs, then the
    grouped GEMM's tiles with the local count -> gather -> remote store -> remote release epilogue (module doc).
    The tiles: the group walk of grouped_gemm_fp8._fp8_grouped_gemm_kernel (SPLIT_K = 1), or with FLAT its
    flattened, pipelined walk (grouped_gemm_fp8._flat_tile_mma; TMA: operands through descriptors), so the next
    tiles' loads stay in flight while a tile counts, sends and releases. The same tiles, the same partials."""
    KB: tl.constexpr = K // 128
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    tile = _ep_zero_partials(pid, T, N, NUM_PROGRAMS, RANK, RECV_CAP, npairs_ptr, owner_ptr, oidx_ptr,
                             recv_tab_ptr, arr_tab_ptr, PARTIAL_BF16, BLOCK_N, BLOCK_T)
    y = (y_ptr, stride_yg, stride_ym)
    ep = (pair_ptr, rowp_ptr, w_ptr, lcnt_ptr, npairs_ptr, owner_ptr, oidx_ptr, recv_tab_ptr, arr_tab_ptr, RANK,
          RECV_CAP, w_scale)
    tiles_before = (T + BLOCK_T - 1) // BLOCK_T
    if FLAT:
        walk, total = gg._flat_walk_state(indptr_ptr, masked_m_ptr, MAX_M, N, G, G_P2, LAYOUT, BLOCK_N,
                                           BLOCK_T, -1, -1)  # every group
        ops = (a_ptr, as_ptr, b_ptr, bs_ptr, a_desc, b_desc, A_ROWS_PER_GROUP)
        strides = (stride_ag, stride_am, stride_ak, stride_asg, stride_asm, stride_ask, stride_bg, stride_bn,
                   stride_bk, stride_bsg, stride_bsn, stride_bsk)
        if INTERPRET:  # the interpreter cannot range() from a program id
            while tile - tiles_before < total:
                res, g64, rows, _, offs_n, t_mask, n_tile = gg._flat_tile_mma(
                    tile - tiles_before, walk, ops, strides, KB, SWAP_AB, BLOCK_N, BLOCK_T, TMA)
                _ep_epilogue(res, g64, rows, offs_n, t_mask, n_tile, y, ep, N, MAX_M, LAYOUT, TOPK, PARTIAL_BF16,
                             BLOCK_N, BLOCK_T)
                tile += NUM_PROGRAMS
        else:
            for gt in tl.range(tile - tiles_before, total, NUM_PROGRAMS, flatten=True):
                res, g64, rows, _, offs_n, t_mask, n_tile = gg._flat_tile_mma(
                    gt, walk, ops, strides, KB, SWAP_AB, BLOCK_N, BLOCK_T, TMA)
                _ep_epilogue(res, g64, rows, offs_n, t_mask, n_tile, y, ep, N, MAX_M, LAYOUT, TOPK, PARTIAL_BF16,
                             BLOCK_N, BLOCK_T)
    else:
        for g in range(G):
            if LAYOUT == 0:  # contiguous
                row0 = tl.load(indptr_ptr + g)
                m = tl.load(indptr_ptr + g + 1) - row0
            else:  # masked
                row0 = 0
                m = tl.minimum(tl.load(masked_m_ptr + g), MAX_M)
            m = tl.maximum(m, 0)
            t_tiles = (m + BLOCK_T - 1) // BLOCK_T
            group_tiles = t_tiles * n_tiles
            g64 = tl.cast(g, tl.int64)
            while tile < tiles_before + group_tiles:
                local = tile - tiles_before
                t_tile = local % t_tiles
                n_tile = local // t_tiles
                offs_t = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
                t_mask = offs_t < m
                rows = (row0 + offs_t).to(tl.int64)
                offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
                res = gg._mma_tile(a_ptr + g64 * stride_ag, as_ptr + g64 * stride_asg, b_ptr + g64 * stride_bg,
                                   bs_ptr + g64 * stride_bsg, rows, t_mask, n_tile, 0, N,
                                   stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk,
                                   stride_bsn, stride_bsk, KB, SWAP_AB, BLOCK_N, BLOCK_T)
                _ep_epilogue(res, g64, rows, offs_n, t_mask, n_tile, y, ep, N, MAX_M, LAYOUT, TOPK, PARTIAL_BF16,
                             BLOCK_N, BLOCK_T)
                tile += NUM_PROGRAMS
            tiles_before += group_tiles


@triton.jit
def _ep_finish_kernel(recv_ptr, arr_ptr, out_ptr, err_ptr, T, RECV_CAP, N, MAX_SPIN, stride_om,
                      WORLD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SLEEP_NS: tl.constexpr):
    """Owner: program (token block, N-tile) waits for WORLD arrivals per token, sums recv in rank order, writes
    bf16 out, resets the arrivals."""
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    nt = tl.program_id(1)
    tm = tok < T
    cp = arr_ptr + tok.to(tl.int64) * n_tiles + nt
    seen = tl.load(cp, mask=tm, other=WORLD, volatile=True)
    pending = tm & (seen < WORLD)
    short = tl.sum(pending.to(tl.int32))
    spins = 0
    while (short > 0) & (spins < MAX_SPIN):
        if SLEEP_NS > 0:
            spins += sbo._nanosleep(SLEEP_NS)
        seen = tl.load(cp, mask=pending, other=WORLD, volatile=True)
        pending = pending & (seen < WORLD)
        short = tl.sum(pending.to(tl.int32))
        spins += 1
    if short > 0:
        tl.atomic_xchg(err_ptr, 1)  # a rank never arrived: flag it, do not hang
    tl.atomic_add(cp, 0, mask=tm, sem="acquire", scope="sys")  # pairs with the producers' release
    tl.debug_barrier()  # the acquiring threads' view covers every thread's loads below
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    m2 = tm[:, None] & (offs_n[None, :] < N)
    acc = tl.full([BLOCK_T, BLOCK_N], 0.0, tl.float32)
    for s in tl.static_range(WORLD):  # rank order: deterministic
        src = recv_ptr + (s * RECV_CAP + tok.to(tl.int64))[:, None] * N + offs_n[None, :]
        acc += tl.load(src, mask=m2, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m2)
    tl.debug_barrier()  # every thread's recv reads precede the reset
    tl.atomic_xchg(cp, 0, mask=tm)  # ready for the next call (ordering: module doc, "Reuse")


# ---------------------------------------------------------------------------------------------
# Host API
# ---------------------------------------------------------------------------------------------
def pointer_table(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """int64 [world] base addresses of every rank's buffer as mapped in THIS process (on GPUs,
    symmetric_ep_buffers builds the tables from its mappings instead). Build once per buffer set and pass it
    back: it is a host-to-device copy."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def symmetric_ep_buffers(world: int, capacity: int, hidden: int, group, device,
                         partial_dtype=torch.float32) -> tuple[EpBuffers, torch.Tensor, torch.Tensor, tuple]:
    """This rank's EpBuffers with recv and arrivals in torch symmetric memory, plus the int64 pointer tables of
    every rank's recv / arrivals as mapped for THIS device, and the rendezvous handles (keep them alive while
    the buffers are used). Collective over `group` (a torch.distributed process group of `world` ranks).

    Why symmetric memory: its peer mappings are made for the local device (cuMemMap + access for it), so a
    kernel here may store and atomically add into them. Session 6's two-GPU test shared the buffers through
    CUDA IPC instead (torch.multiprocessing queues, the mapping opened on the sender's device index) and hit an
    illegal address in its first call on two H200s, while the same kernels pass with all ranks on one GPU."""
    if partial_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"partial_dtype must be float32 or bfloat16, got {partial_dtype}")
    import torch.distributed._symmetric_memory as symm_mem

    recv = symm_mem.empty(world, capacity, hidden, dtype=partial_dtype, device=device).zero_()
    arrivals = symm_mem.empty(capacity, cdiv(hidden, COUNT_BLOCK_N), dtype=torch.int32, device=device).zero_()
    handles = tuple(symm_mem.rendezvous(t, group) for t in (recv, arrivals))
    if handles[0].world_size != world:
        raise ValueError(f"group has {handles[0].world_size} ranks, world is {world}")
    # buffer_ptrs: every rank's allocation as mapped here; offset: the tensor's byte offset in it (same on all)
    tables = [torch.tensor([p + getattr(h, "offset", 0) for p in h.buffer_ptrs], dtype=torch.int64, device=device)
              for h in handles]
    own = EpBuffers(recv, arrivals, torch.zeros(1, dtype=torch.int32, device=device))
    return own, tables[0], tables[1], handles


def _as_table(x, device) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else pointer_table(x, device)


def ep_down_and_combine(q: torch.Tensor, q_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                        topk_weights: torch.Tensor, layout: MoeLayout, *, rank: int, world: int,
                        token_owner: torch.Tensor, owner_index: torch.Tensor, local_pairs: torch.Tensor,
                        peer_recv, peer_arrivals, recv_capacity: int, partial_dtype=torch.float32,
                        out: torch.Tensor | None = None, own: EpBuffers | None = None,
                        weight_scale: float = 1.0, variant: str = "auto", config: dict | None = None,
                        expected_m: int | None = None, y: torch.Tensor | None = None,
                        max_spin: int = DEFAULT_MAX_SPIN,
                        spin_sleep_ns: int = DEFAULT_SPIN_SLEEP_NS) -> torch.Tensor | None:
    """Rank `rank`'s down GEMM over ALL gathered tokens with the EP combine in its epilogue.

    q [rows, I] (contiguous) / [G, max_m, I] (masked) fp8 in `layout` (build_ep_layout), q_scale, w2 [G, H, I] fp8
    (this rank's experts), w2_scale; topk_weights [T, K] (gathered; dropped slots ignored). token_owner /
    owner_index int32 [T]: the gathered token's owner rank and index among its tokens (allgather_maps);
    local_pairs int32 [T]. peer_recv / peer_arrivals: every rank's EpBuffers.recv / .arrivals as seen here
    (list of tensors, or a prebuilt pointer_table; on GPUs symmetric_ep_buffers' tables), all with capacity
    recv_capacity and dtype partial_dtype.
    With out (bf16 [own tokens, H]) and own (this rank's EpBuffers) the owner's finish follows on the same
    stream and out is returned (it waits for the other ranks: they must run their producers concurrently);
    else None (call ep_finish later). y: optional bf16 GEMM output buffer."""
    t, k = topk_weights.shape
    g_experts, hdim, inter = w2.shape
    if k != layout.top_k or layout.num_experts != g_experts:
        raise ValueError(f"layout (top_k {layout.top_k}, {layout.num_experts} experts) does not match "
                         f"topk_weights {tuple(topk_weights.shape)} / w2 {tuple(w2.shape)}")
    for name, v in (("token_owner", token_owner), ("owner_index", owner_index), ("local_pairs", local_pairs)):
        if v.shape != (t,) or v.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [{t}], got {v.dtype} {tuple(v.shape)}")
    gg._check_operands(q, q_scale, w2, w2_scale, 2 if layout.masked else 1)
    dev = q.device
    recv_tab, arr_tab = _as_table(peer_recv, dev), _as_table(peer_arrivals, dev)
    if recv_tab.numel() != world or arr_tab.numel() != world:
        raise ValueError(f"need {world} peer buffers, got {recv_tab.numel()} / {arr_tab.numel()}")
    if not isinstance(peer_recv, torch.Tensor):
        for b in peer_recv:
            if b.shape != (world, recv_capacity, hdim) or b.dtype != partial_dtype or not b.is_contiguous():
                raise ValueError(f"recv buffers must be contiguous {partial_dtype} [{world}, {recv_capacity}, {hdim}]")
    if t > 0:
        p = t * k
        lay = "masked" if layout.masked else "contiguous"
        sms = gg._device_sms(q)
        m_hint = expected_m if expected_m is not None else max(1, cdiv(p, max(1, g_experts)))
        variant, cfg = gg.resolve_config(variant, config, m_hint, hdim, inter, g_experts, lay, sms)
        cfg = {**cfg, "BLOCK_N": COUNT_BLOCK_N}  # the owners' count grid
        bt, bn = cfg["BLOCK_T"], cfg["BLOCK_N"]
        if y is None:
            shape = (g_experts, layout.max_m, hdim) if layout.masked else (q.shape[0], hdim)
            y = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        n_tiles = cdiv(hdim, bn)
        lcnt = torch.zeros(t, n_tiles, dtype=torch.int32, device=dev)
        if layout.masked:
            q3, s3, y3 = q, q_scale, y
            upper_t = g_experts * cdiv(layout.max_m, bt)
            gstr = (q3.stride(0), s3.stride(0), y3.stride(0))
        else:
            q3, s3, y3 = q.unsqueeze(0), q_scale.unsqueeze(0), y.unsqueeze(0)
            upper_t = q.shape[0] // bt + min(g_experts, q.shape[0])
            gstr = (0, 0, 0)
        empty_items = cdiv(t, bt)
        num_programs = max(1, min(upper_t * n_tiles + empty_items, sms * cfg.get("programs_per_sm", 1)))
        ip = layout.m_indptr if layout.m_indptr is not None else layout.masked_m
        flat = bool(cfg.get("flat"))  # the flattened, pipelined walk (grouped_gemm_fp8 config "flat"; "tma")
        descs = gg._tma_descriptors(q3, w2, bt, bn) if flat and cfg.get("tma") else None
        _ep_down_combine_kernel[(num_programs,)](
            q3, s3, w2, w2_scale, y3, ip, layout.masked_m if layout.masked else ip,
            layout.pair_of_row, layout.row_of_pair, topk_weights.reshape(-1), lcnt, local_pairs, token_owner,
            owner_index, recv_tab, arr_tab,
            t, layout.max_m if layout.masked else 0, hdim, num_programs, rank, recv_capacity, float(weight_scale),
            gstr[0], q3.stride(1), q3.stride(2),
            gstr[1], s3.stride(1), s3.stride(2),
            w2.stride(0), w2.stride(1), w2.stride(2),
            w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
            gstr[2], y3.stride(1), *(descs or (None, None)), q3.shape[1] if layout.masked else 0,
            G=g_experts, K=inter, LAYOUT=1 if layout.masked else 0, SWAP_AB=variant == "swapab",
            BLOCK_N=bn, BLOCK_T=bt, TOPK=k, PARTIAL_BF16=partial_dtype == torch.bfloat16, FLAT=flat,
            G_P2=triton.next_power_of_2(g_experts), TMA=descs is not None, INTERPRET=_interpreting(),
            num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
        )
    if out is None:
        return None
    if own is None:
        raise ValueError("out needs own (this rank's EpBuffers) for the finish")
    return ep_finish(own, out, world=world, max_spin=max_spin, spin_sleep_ns=spin_sleep_ns)


def ep_finish(own: EpBuffers, out: torch.Tensor, *, world: int, max_spin: int = DEFAULT_MAX_SPIN,
              spin_sleep_ns: int = DEFAULT_SPIN_SLEEP_NS) -> torch.Tensor:
    """Owner side: out [own tokens, H] bf16 = sum over src ranks (in rank order) of own.recv[src, :T], once all
    world ranks arrived per (token, 128-column tile); own.status set to 1 if a wait gave up (never cleared here)."""
    t, hdim = out.shape
    cap = own.recv.shape[1]
    if own.recv.shape != (world, cap, hdim) or t > cap or out.stride(1) != 1 or out.dtype != torch.bfloat16:
        raise ValueError(f"out bf16 [{t}, {hdim}] does not fit recv {tuple(own.recv.shape)} (world {world})")
    if own.arrivals.shape != (cap, cdiv(hdim, COUNT_BLOCK_N)):
        raise ValueError(f"arrivals {tuple(own.arrivals.shape)} should be [{cap}, {cdiv(hdim, COUNT_BLOCK_N)}]")
    if t == 0:
        return out
    grid = (cdiv(t, FINISH_BLOCK_T), cdiv(hdim, COUNT_BLOCK_N))
    _ep_finish_kernel[grid](own.recv, own.arrivals, out, own.status, t, cap, hdim, max_spin, out.stride(0),
                            WORLD=world, BLOCK_T=FINISH_BLOCK_T, BLOCK_N=COUNT_BLOCK_N,
                            SLEEP_NS=0 if _interpreting() else int(spin_sleep_ns), num_warps=4)
    return out


def ep_partials_reference(q, q_scale, w2, w2_scale, topk_weights, layout: MoeLayout,
                          weight_scale: float = 1.0) -> torch.Tensor:
    """float32 [T, H]: one rank's local combine (its pairs only) on the dequantized operands: what it sends."""
    from sgl_kernel_ext.quant import dequant_per_block, dequant_per_token_group

    t, k = topk_weights.shape
    qd = dequant_per_token_group(q.reshape(-1, q.shape[-1]), q_scale.reshape(-1, q_scale.shape[-1]))
    row = layout.row_of_pair.long()
    if layout.masked:
        expert = torch.div(row, layout.max_m, rounding_mode="floor")
    else:
        expert = torch.searchsorted(layout.m_indptr.long()[1:], row, right=True)
    part = torch.zeros(t, w2.shape[1], dtype=torch.float32, device=q.device)
    w = topk_weights.float().reshape(-1) * weight_scale
    tok = torch.arange(t * k, device=q.device) // k
    for e in range(layout.num_experts):
        sel = ((row >= 0) & (expert == e)).nonzero().flatten()
        if sel.numel():
            ye = qd[row[sel]] @ dequant_per_block(w2[e], w2_scale[e], gg.SCALE_BLOCK).T
            part.index_add_(0, tok[sel], ye * w[sel, None])
    return part


def ep_down_and_combine_reference(per_rank: Sequence[tuple], token_owner: torch.Tensor, owner_index: torch.Tensor,
                                  sizes: Sequence[int], weight_scale: float = 1.0) -> list[torch.Tensor]:
    """float32 out of every owner: per_rank[r] = (q, q_scale, w2, w2_scale, topk_weights, layout) of rank r; each
    rank's local partial (ep_partials_reference) reduce-scattered to the owners, as StandardDispatcher.combine."""
    outs = [None] * len(sizes)
    for args in per_rank:
        part = ep_partials_reference(*args, weight_scale=weight_scale)
        for o, s in enumerate(sizes):
            sel = token_owner == o
            contrib = torch.zeros(s, part.shape[1], dtype=torch.float32, device=part.device)
            contrib[owner_index[sel].long()] = part[sel]
            outs[o] = contrib if outs[o] is None else outs[o] + contrib
    return outs
