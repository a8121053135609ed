// FP8 MLA decode for DeepSeek-V3 on Hopper (sm_90a), version 3: tokens on the MMA's M side, for few query rows.
//
// Same inputs, outputs, KV format (576 FP8 bytes + (latent, rope) fp32 scales per token), launcher signature, split
// plan and combine as versions 1 and 2, and Q quantized in the kernel as version 2 does (bf16 rows in; design option
// MLA_PREPASS_Q: the Triton pre-pass); built for few query rows per sequence (16 heads x q_len 1 or 2: TP8 layouts
// of DeepSeek-V3): one CTA per 16 rows (at most 16) or per 32, so 128 heads run as 4 row blocks of 32 (session 34;
// measured in session 35: 1.16-1.49x version 2's time at 128 heads, so the backend's auto keeps this version to
// <= 32 rows). Status (H100, session 29): 39/39 GPU tests; 0.98-1.16x FlashMLA FP8 at batch >= 64 (0.85-1.16x over
// the 16-head grid), up to 1.14x version 2 (sgl-kernel-ext/NOTES.md). N = 64 rows per CTA cannot fit: each math WG
// holds all 512 channels of O^T, 4N fp32 registers per thread.
//
// Why. Versions 1 and 2 put query rows on wgmma's M side, which is 64 wide: at 16 heads, 16 of a CTA's 64 rows are
// live and every tile costs the work of 64 (measured: 0.76-0.95x FlashMLA FP8 at 16 heads, batch >= 64, while the
// bytes alone would allow ~1.5x). Here the 64 tokens of a KV tile are M and the query rows are N (16 or 32):
//   S^T = K Q^T     m64nNk32, A = the K tile from shared memory (already K-major: a token's 576 bytes are contiguous),
//                   B = the Q block (K-major): the tensor work of N rows, not 64;
//   O^T = V^T P'^T  m64nNk32 per 64 channels, A = V^T from REGISTERS, B = P' (N x 64 tokens, K-major) in shared memory.
// FP8 wgmma takes only K-major operands from shared memory, which is why versions 1 and 2 transpose V through shared
// memory (32 KB written and read per tile). A register A operand has no such rule: each lane builds its fragment
// from one ldmatrix.x4.trans of the K tile (4 matrices of 8 tokens x 16 channels, b16 elements = channel pairs) and
// 4 byte permutes; no V^T buffer, no barrier for it. The fragment's layout fixes two permutations, both applied
// consistently so that nothing else changes:
//   - channels: lane (g = lane / 4) of warp w holds A rows 16w + g and 16w + g + 8, which are channels 16w + 2g and
//     16w + 2g + 1 of the 64-channel block (a b16 column of ldmatrix is a channel pair); the output store uses the
//     same map (a bf16x2 of adjacent channels);
//   - tokens: A columns k = 4 q + i (q = lane % 4) of a 16-token group are tokens 2q, 2q + 1, 2q + 8, 2q + 9 (the
//     .trans b16 of matrix j holds tokens 2q, 2q + 1; the second matrix of the pair the + 8 ones), so P' stores token
//     t at byte kpos(t) of its row (kpos_of below); P'V sums the same products in another order.
//
// Schedule: 384 threads, WG0 and WG1 math (setmaxnreg 232), WG2 a loader (40): Q by cp.async, then one thread
// issues each K tile as 9 TMA boxes + its scales by one bulk copy (as version 2), 2 stages per math WG. The two math WGs
// own alternate tiles t % 2 == wg and process each one completely (QK^T, softmax, P', P'V, merge) with their own
// softmax chain and O; they never wait for each other until the epilogue, which merges WG1's (O, M, C, l) into
// WG0's through shared memory (the K stages, free by then). Per tile and WG: full_k wait -> 18 QK^T wgmmas ->
// column maxima (shuffles over a warp's 16 tokens, then the 4 warps through shared memory: a 128-thread named
// barrier) -> P (fp32 row sums l) and P' = e4m3(P s_v 448 / c) as single bytes into the WG's P' buffer ->
// fence.proxy.async + the named barrier -> per batch of 64-channel blocks: ldmatrix + prmt into A fragments, the
// P'V wgmmas into a fresh accumulator (promotion, as versions 1 and 2), the lazy merge into fp32 O (O keeps its
// reference until a tile's maxima run more than 2^8 / 256x above it) -> empty_k arrive after the last ldmatrix.
// Tokens past the sequence end: selects mask the scores; their V bytes (may be NaN) are zeroed in the A fragments
// of a partial tile (0 x NaN would poison the sum).
//
// Cycle model at 16 heads, per tile and SM (dense FP8 8192 FLOP/clk; shared memory 128 B/clk): tensor QK^T
// 2*64*16*576/8192 = 144 + PV 128 = 272 clk; shared memory: K tile read by QK^T 36 KB + Q 9 KB + V by ldmatrix
// 32 KB + P' 8 x 1 KB + TMA landing 37 KB = 122 KB = ~950 clk; HBM at 4.8 TB/s (H200) / 132 SMs: 36.9 KB in ~1000
// clk at 1.8 GHz. So the tile should be bound by the bytes, not by the math as in versions 1 and 2, if the two
// WGs and a stage landing per WG hide the latencies. Expected: the KV stream rate, ~1.3-1.5x FlashMLA FP8 at batch
// >= 64. Measured on the H100: 0.93-0.94 of the copy roofline at batch 128 x 16k, but FlashMLA FP8 is at 0.84-0.87
// there, so 1.07-1.09x it (0.98-1.16x at batch >= 64 overall), not 1.3-1.5x.
//
// Registers (ptxas, sm_90a): see NOTES.md; math O 8 x N/2 + accumulator batch + A fragments.
// Shared memory: K 4 x 36864 + Q N x 576 + P' 2 x N x 64 + scales 4 x 512 + column exchange + 8 mbarriers.
#include "mla_fp8_sm90_common.cuh"

#if !MLA_TMA_LOAD
#error "version 3 loads K tiles by TMA only (MLA_CP_ASYNC_LOAD is a version 2 option)"
#endif

// 64-channel blocks per P'V batch (one wgmma wait each): all 8 at N = 16; 2 at N = 32 (4 spilled 736 bytes)
#ifndef MLA_V3_PV_BATCH16
#define MLA_V3_PV_BATCH16 8
#endif
#ifndef MLA_V3_PV_BATCH32
#define MLA_V3_PV_BATCH32 2
#endif

namespace mla_fp8_sm90_v3 {

using namespace mla_fp8_common;

constexpr int PAGE = 64;         // tokens per page = per KV tile = wgmma M
constexpr int DQK = 576;
constexpr int NSW = 2;           // K tile stages per math WG (one in use, one landing)
constexpr int NST = 2 * NSW;     // K tile stages
constexpr int THREADS = 384;     // WG0, WG1: math; WG2: loader
constexpr int MATH_REGS = 232;
constexpr int LOADER_REGS = 40;
constexpr int TILE_BYTES = PAGE * DQK;  // 36864
constexpr int KB_BYTES = 64 * 64;       // one SW64 K block of the K tile (64 token rows)
constexpr int KS_BYTES = PAGE * 2 * 4;  // 512
static_assert(2 * MATH_REGS + LOADER_REGS <= 3 * 168, "setmaxnreg budget");

template <int N>
struct Layout {
  static constexpr int Q_KB = N * 64;                        // one SW64 K block of the Q rows
  static constexpr int OFF_K = 0;                            // [NST] K tiles; the epilogue's O exchange after
  static constexpr int OFF_Q = OFF_K + NST * TILE_BYTES;     // 147456
  static constexpr int OFF_P = OFF_Q + N * DQK;              // [WG] N x 64 P' (SW64)
  static constexpr int OFF_KS = OFF_P + 2 * N * PAGE;        // [NST] scales
  static constexpr int OFF_XMAX = OFF_KS + NST * KS_BYTES;   // float [WG][N][4 warps] column maxima
  static constexpr int OFF_XCOL = OFF_XMAX + 2 * N * 4 * 4;  // float4 [WG][N] query-row constants
  static constexpr int OFF_XL = OFF_XCOL + 2 * N * 16;       // float [WG][4 warps][N] row sums (epilogue)
  static constexpr int OFF_XW = OFF_XL + 2 * 4 * N * 4;      // float [N] M, [N] l of WG1, [4] C (epilogue)
  static constexpr int OFF_QS = OFF_XW + (2 * N + 4) * 4;    // MLA_FUSED_Q: float [N][2] the block's Q scales
  static constexpr int OFF_BAR = OFF_QS + N * 2 * 4;         // mbarriers full_k[NST], empty_k[NST]
  static constexpr int SMEM_USED = OFF_BAR + 8 * 2 * NST;
  static constexpr int SMEM_BYTES = SMEM_USED + 1024;        // 1 KB alignment slack
  static_assert(SMEM_BYTES <= 232448, "over the sm_90 shared memory per block");
  static_assert(OFF_Q % 1024 == 0 && OFF_P % 1024 == 0 && (N * PAGE) % 512 == 0 && OFF_KS % 16 == 0 &&
                    OFF_XMAX % 16 == 0 && OFF_BAR % 8 == 0, "alignment");
  static_assert(128 * 8 * (N / 2) * 4 <= NST * TILE_BYTES, "the epilogue's O exchange fits the K stages");
};

// ---- wgmma m64nNk32 e4m3 (N = 16, 32), A and B from shared memory (QK^T; P'V's register-A form is wgmma_rs) -------
template <int N>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t da, uint64_t db, int scale_d) {
  if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(scale_d));
  } else {
    static_assert(N == 32);
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(scale_d));
  }
}

// wgmma m64nNk32 e4m3 (N = 16, 32) with A from registers: a[0..3], this lane's fragment (rows g, g + 8 of its
// warp's 16 x k 4q .. 4q + 3, then the same for k + 16), B from shared memory (K-major)
template <int N>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db, int scale_d) {
  if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  } else {
    static_assert(N == 32);
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  }
}

// 4 8x8 b16 matrices, transposed: lane 8j + i gives the address of row i of matrix j; lane t receives, of matrix j,
// b16 column t / 4 of rows 2 (t % 4) and 2 (t % 4) + 1
__device__ __forceinline__ void ldsm_x4_trans(uint32_t saddr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr) : "memory");
}

// Register-A P'V: the per-lane masks of a partial tile, keep[ks][j] = the bytes of tokens 32 ks + 8 j + 2q
// and + 1 (q = lane % 4) that lie before nvalid (past it the cache bytes may be NaN)
__device__ __forceinline__ void vt_keep_masks(int q, int nvalid, uint32_t (*keep)[4]) {
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = 32 * ks + 8 * j + 2 * q;
      keep[ks][j] = (t < nvalid ? 0x0000ffffu : 0u) | (t + 1 < nvalid ? 0xffff0000u : 0u);
    }
}

// ... and one k-step of this lane's V^T A fragment (channels 16 w + 2g, + 1 of a 64-channel block x 32 tokens):
// one ldmatrix.x4.trans at its row address saddr (matrices of tokens +0, +8, +16, +24), masked with keep (MASK: a
// partial tile), and 4 prmt that put tokens 2q, 2q + 1 (first matrix of a pair) and 2q + 8, 2q + 9 (second) of each
// 16 at A's k positions 4q .. 4q + 3 in the order SEL_LO / SEL_HI give (test_mla_register_a_fragments.py)
template <uint32_t SEL_LO, uint32_t SEL_HI, bool MASK>
__device__ __forceinline__ void vt_fragment(uint32_t saddr, const uint32_t* keep, uint32_t* a) {
  uint32_t r[4];
  ldsm_x4_trans(saddr, r);
  if constexpr (MASK) {
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] &= keep[j];
  }
  a[0] = prmt(r[0], r[1], SEL_LO);  // channel 2g
  a[1] = prmt(r[0], r[1], SEL_HI);  // channel 2g + 1
  a[2] = prmt(r[2], r[3], SEL_LO);  // the same for tokens + 16
  a[3] = prmt(r[2], r[3], SEL_HI);
}

// K stage of tile t and which use of it this is: each math WG has its own NSW stages, so that a stage's phases are
// waited for by one WG in order. (One ring shared by both WGs, each waiting only for its own tiles' phases, let a
// WG that ran ahead wait for the parity of a phase two uses ahead while the other WG's tile in between had not landed
// yet: the parity matched the stale phase. On the H100 that hung at 256 tiles per CTA: session 29's first run.)
__device__ __forceinline__ int stage_of(int t) { return (t & 1) + 2 * ((t >> 1) % NSW); }
__device__ __forceinline__ int use_of(int t) { return (t >> 1) / NSW; }

// P' byte of tile token t (0..63): the k position the A fragments give it (tokens 2q, 2q + 1, 2q + 8, 2q + 9 of a
// 16-token group at k = 4q .. 4q + 3)
__device__ __forceinline__ constexpr int kpos_of(int t) {
  return (t & ~15) + 4 * ((t & 7) >> 1) + (t & 1) + 2 * ((t >> 3) & 1);
}

// This lane's query-row columns: c = 2j + e -> column 8j + 2q + e (the accumulator's n), j < N / 8
__device__ __forceinline__ constexpr int col_of(int c, int q) { return 8 * (c >> 1) + 2 * q + (c & 1); }

// P'V of one tile for this WG: for each batch of MB 64-channel blocks, the A fragments from the K tile (V = its
// first 512 channels) by ldmatrix.trans + prmt, the wgmmas against P' into a fresh accumulator, then the lazy merge
// O += acc * beta. MASK: a partial tile (tokens >= nvalid zeroed in the fragments).
template <int N, int MB, bool MASK>
__device__ __forceinline__ void pv_tile(float* o, const float* beta, uint32_t v_lane, uint64_t dp, int q,
                                        int nvalid) {
  constexpr int OREG = N / 2;
  uint32_t keep[2][4];  // [ks][matrix j]
  if constexpr (MASK) vt_keep_masks(q, nvalid, keep);
#pragma unroll
  for (int mb0 = 0; mb0 < 8; mb0 += MB) {
    uint32_t a[MB][2][4];
#pragma unroll
    for (int i = 0; i < MB; ++i)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)  // k order: tokens 2q, 2q + 1, 2q + 8, 2q + 9 (kpos_of)
        vt_fragment<0x6420u, 0x7531u, MASK>(v_lane + (mb0 + i) * KB_BYTES + ks * 2048, keep[ks], a[i][ks]);
    float acc[MB * OREG];
    wgmma_fence();  // the A registers were just written by ordinary instructions
#pragma unroll
    for (int i = 0; i < MB; ++i)
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) wgmma_rs<N>(acc + i * OREG, a[i][ks], desc_add(dp, ks * 32), ks);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<MB * OREG>(acc);
#pragma unroll
    for (int i = 0; i < MB * OREG; ++i) {
      const int idx = i % OREG;  // j * 4 + h * 2 + e: column c = 2j + e
      float& oi = o[mb0 * OREG + i];
      oi = fmaf(acc[i], beta[2 * (idx >> 2) + (idx & 1)], oi);
    }
  }
}

template <int N>
__global__ void __launch_bounds__(THREADS, 1) mla_fp8_decode_kernel_v3(const __grid_constant__ Params p) {
  using L = Layout<N>;
  constexpr int NC = N / 4;    // query-row columns per lane
  constexpr int OREG = N / 2;  // accumulator registers of one m64nN
  constexpr int MB = N == 16 ? MLA_V3_PV_BATCH16 : MLA_V3_PV_BATCH32;  // 64-channel blocks per P'V batch
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t sbase;
  uint8_t* smem = aligned_smem(smem_raw, sbase);

  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform for ptxas (wgmma under a branch)
  const int lane = tid & 31;
  const int rb = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;

  int seqlen, start, end;
  if (!split_range(p, b, sp, PAGE, seqlen, start, end)) return;  // uniform over the CTA
  const int ntiles = end > start ? cdiv(end - start, PAGE) : 0;

  const uint32_t bar_full_k = sbase + L::OFF_BAR;        // [NST] count 1 + the tile's bytes (TMA)
  const uint32_t bar_empty_k = bar_full_k + 8 * NST;     // [NST] count 128: the owner WG
  if (tid == 0) {
    for (int s = 0; s < NST; ++s) {
      mbar_init(bar_full_k + 8 * s, 1);
      mbar_init(bar_empty_k + 8 * s, 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // the only CTA-wide barrier

  if (wg == 2) {
    // ============================================== loader ==============================================
    setmaxnreg_dec<LOADER_REGS>();
    const int ptid = tid - 256;
    if (!MLA_FUSED_Q && ntiles > 0) {  // Q by cp.async over the warpgroup, landed before thread 0's first arrival
      for (int i = ptid; i < N * 36; i += 128) load_q_chunk(p, sbase + L::OFF_Q, b, rb, N, L::Q_KB, i);
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      named_barrier(4, 128);
    }
    if (ptid == 0) {
      const int* bt_row = p.block_table + static_cast<long long>(b) * p.bt_stride;
#pragma unroll 1
      for (int t = 0; t < ntiles; ++t) {
        const int st = stage_of(t), use = use_of(t);
        const uint32_t full = bar_full_k + 8 * st;
        if (use > 0) mbar_wait(bar_empty_k + 8 * st, (use - 1) & 1);  // its previous tile released by the owner
        const int page = bt_row[(start + t * PAGE) / PAGE];
        const uint32_t dst = sbase + L::OFF_K + st * TILE_BYTES;
        mbar_arrive_expect_tx(full, TILE_BYTES + KS_BYTES);
#pragma unroll
        for (int kb = 0; kb < DQK / 64; ++kb) tma_kv_block(dst + kb * KB_BYTES, &p.kv_map, kb, page, full);
        bulk_copy(sbase + L::OFF_KS + st * KS_BYTES, p.kvs + static_cast<long long>(page) * p.kvs_page_stride,
                  KS_BYTES, full);
      }
    }
    return;
  }

  // ============================================ math warpgroups ============================================
  setmaxnreg_inc<MATH_REGS>();
  const int w = (tid >> 5) & 3;  // warp in the WG: tokens 16w .. 16w + 15 of S^T, channels 16w .. of each block
  const int g = lane >> 2, q = lane & 3;
  const int wt = tid & 127;

  float* cta_qs = reinterpret_cast<float*>(smem + L::OFF_QS);  // MLA_FUSED_Q: the block's Q scales
  if constexpr (MLA_FUSED_Q) {
    // Q quantized here (the pre-pass's arithmetic: bit-identical), 4 threads per row, while the first tiles land
    if (tid < 4 * N) quantize_q_rows(p, sbase + L::OFF_Q, cta_qs, b, rb, N, L::Q_KB, tid);
    fence_proxy_async();    // Q written by ordinary stores, read by both WGs' wgmmas through the async proxy
    named_barrier(1, 256);  // both math WGs: every row of Q and its scales written
  }
  // per query row n of the block (row rb N + n), in shared memory (read per tile: registers are short at N = 32):
  // its Q scales x the softmax scale and its causal token limit (a row sees positions < lim; none past num_rows)
  float4* xcol = reinterpret_cast<float4*>(smem + L::OFF_XCOL) + wg * N;
  if (wt < N) {
    const int gr = rb * N + wt;
    float4 v = make_float4(0.f, 0.f, __int_as_float(-2147483647), 0.f);
    if (gr < p.num_rows) {
      const float* qs = MLA_FUSED_Q ? cta_qs + wt * 2 : p.qs + (static_cast<long long>(b) * p.num_rows + gr) * 2;
      const int t = gr / p.num_heads;
      v = make_float4(qs[0] * p.qk_scale, qs[1] * p.qk_scale,
                      __int_as_float(min(p.causal ? seqlen - p.q_len + 1 + t : seqlen, end)), 0.f);
    }
    xcol[wt] = v;
  }
  named_barrier(2 + wg, 128);

  // O^T: channels 64 mb + 16 w + 2 g + h x columns, o[mb * OREG + j * 4 + h * 2 + e], fp32, in units of C / 448
  // relative to exp2(. - M[c]) (the lazy reference); m_own / l_own: the exact running column max and this lane's
  // partial row sum relative to it; c_own: the running max V scale (P' = P s_v 448 / c_own).
  float o[8 * OREG];
#pragma unroll
  for (int i = 0; i < 8 * OREG; ++i) o[i] = 0.f;
  float M[NC], m_own[NC], l_own[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    M[c] = m_own[c] = -INFINITY;
    l_own[c] = 0.f;
  }
  float C = 0.f, c_own = 0.f;

  float* xmax = reinterpret_cast<float*>(smem + L::OFF_XMAX) + wg * N * 4;  // [n][warp]
  uint8_t* pbuf = smem + L::OFF_P + wg * N * PAGE;
  const uint64_t dq = desc_sw64(sbase + L::OFF_Q);
  const uint64_t dp = desc_sw64(sbase + L::OFF_P + wg * N * PAGE);
  // ldmatrix row address of this lane inside a K tile: row 8j + i of a 32-token step (j = lane / 8, i = lane % 8),
  // the 16-byte chunk of channels 16w .. 16w + 15 of K block 0 (sw64 of row 8j + i, byte 16w)
  const int li = lane & 7, lj = lane >> 3;
  const uint32_t v_off = lj * 512 + li * 64 + (((w ^ (li >> 1)) & 3) << 4);
  const int tok0 = 16 * w + g;  // this lane's tokens tok0, tok0 + 8 (S^T rows)
  const int kp0 = kpos_of(tok0);  // their P' bytes: kp0, kp0 + 2

#pragma unroll 1
  for (int t = wg; t < ntiles; t += 2) {
    const int st = stage_of(t);
    mbar_wait(bar_full_k + 8 * st, use_of(t) & 1);
    const uint32_t kt = sbase + L::OFF_K + st * TILE_BYTES;

    // ---- S^T = K Q^T: 512 latent channels into s_lat, 64 rope channels into s_rope ----
    float s_lat[OREG], s_rope[OREG];
    {
      const uint64_t dk = desc_sw64(kt);
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < 8; ++kb)
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
          wgmma_ss<N>(s_lat, desc_add(dk, kb * KB_BYTES + ks * 32), desc_add(dq, kb * L::Q_KB + ks * 32),
                      (kb | ks) != 0);
#pragma unroll
      for (int ks = 0; ks < 2; ++ks)
        wgmma_ss<N>(s_rope, desc_add(dk, 8 * KB_BYTES + ks * 32), desc_add(dq, 8 * L::Q_KB + ks * 32), ks != 0);
      wgmma_commit();
    }
    const int n0 = start + t * PAGE;
    const int nvalid = min(end - n0, PAGE);
    const float* ksc = reinterpret_cast<const float*>(smem + L::OFF_KS + st * KS_BYTES);
    float ct = fmaxf(lane < nvalid ? ksc[lane * 2] : 0.f, lane + 32 < nvalid ? ksc[(lane + 32) * 2] : 0.f);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ct = fmaxf(ct, __shfl_xor_sync(0xffffffffu, ct, off));
    const float c_new = fmaxf(fmaxf(c_own, ct), 1e-30f);
    const float2 ks0 = *reinterpret_cast<const float2*>(ksc + tok0 * 2);  // (latent, rope) scales of tok0
    const float2 ks1 = *reinterpret_cast<const float2*>(ksc + (tok0 + 8) * 2);
    wgmma_wait<0>();
    fence_regs<OREG>(s_lat);
    fence_regs<OREG>(s_rope);

    // ---- scores in log2 units, masked by selects; column maxima over the 64 tokens ----
    float mt[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float4 cp = xcol[col_of(c, q)];  // (latent, rope) Q scales x softmax scale, token limit
      mt[c] = -INFINITY;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int idx = (c >> 1) * 4 + h * 2 + (c & 1);
        const float2 kk = h ? ks1 : ks0;
        const float v = s_lat[idx] * (cp.x * kk.x) + s_rope[idx] * (cp.y * kk.y);
        const float sv = (n0 + tok0 + 8 * h < __float_as_int(cp.z)) ? v : -INFINITY;
        s_lat[idx] = sv;
        mt[c] = fmaxf(mt[c], sv);
      }
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) mt[c] = fmaxf(mt[c], __shfl_xor_sync(0xffffffffu, mt[c], off));
      if (g == 0) xmax[col_of(c, q) * 4 + w] = mt[c];
    }
    named_barrier(2 + wg, 128);  // every warp's maxima written (read below, before the next barrier)
    float alpha_own[NC], m_use[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float4 x = *reinterpret_cast<const float4*>(xmax + col_of(c, q) * 4);
      const float m_new = fmaxf(m_own[c], fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
      m_use[c] = m_new == -INFINITY ? 0.f : m_new;
      alpha_own[c] = ex2(m_own[c] - m_use[c]);  // m_own = -inf -> 0
      m_own[c] = m_new;
    }

    // ---- P = exp2(S - m), row sums from fp32 P, P' = e4m3(P s_v 448 / c) as single bytes at kpos ----
    const float vs = 448.f / c_new;
    const float f0 = tok0 < nvalid ? ks0.x * vs : 0.f;  // scales past the end may be NaN
    const float f1 = tok0 + 8 < nvalid ? ks1.x * vs : 0.f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int i0 = (c >> 1) * 4 + (c & 1), i1 = i0 + 2;
      const float p0 = ex2(s_lat[i0] - m_use[c]), p1 = ex2(s_lat[i1] - m_use[c]);
      l_own[c] = l_own[c] * alpha_own[c] + (p0 + p1);
      const uint16_t pk = to_e4m3x2(p0 * f0, p1 * f1);
      const int n = col_of(c, q);
      pbuf[sw64(n, kp0)] = static_cast<uint8_t>(pk & 0xff);
      pbuf[sw64(n, kp0 + 2)] = static_cast<uint8_t>(pk >> 8);
    }
    c_own = c_new;

    // ---- O's merge factors (lazy: the reference moves only when the tile's maxima run far above it) ----
    float beta[NC];
    {
      const float c_ref = c_own > C * MLA_LAZY_SCALE_STEP ? c_own : C;  // C = 0 before the first tile
      const float rc = 1.f / c_ref;
      bool moved = c_ref != C;
      float alpha[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float mi = m_own[c];
        const float m_ref = mi > M[c] + MLA_LAZY_MAX_STEP ? mi : M[c];
        const float mr = m_ref == -INFINITY ? 0.f : m_ref;
        moved |= m_ref != M[c];
        alpha[c] = ex2(M[c] - mr) * (C * rc);
        beta[c] = ex2(mi - mr) * (c_own * rc);
        M[c] = m_ref;
      }
      C = c_ref;
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int i = 0; i < 8 * OREG; ++i) {
          const int idx = i % OREG;
          o[i] *= alpha[2 * (idx >> 2) + (idx & 1)];
        }
      }
    }
    fence_proxy_async();         // P' written by ordinary stores, read by the wgmmas through the async proxy
    named_barrier(2 + wg, 128);  // ... by every warp of the WG

    // ---- O^T += V^T P'^T (A fragments from the K tile), then the K stage goes back to the loader ----
    if (nvalid == PAGE)
      pv_tile<N, MB, false>(o, beta, kt + v_off, dp, q, nvalid);
    else
      pv_tile<N, MB, true>(o, beta, kt + v_off, dp, q, nvalid);
    mbar_arrive(bar_empty_k + 8 * st);
  }

  // ============ epilogue: row sums over lanes and warps, WG1's (O, M, C, l) merged into WG0's, stored ============
  float* xl = reinterpret_cast<float*>(smem + L::OFF_XL);  // [WG][warp][N]
  float* xw = reinterpret_cast<float*>(smem + L::OFF_XW);  // WG1's M [N], l [N], C
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    float l = l_own[c];
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (g == 0) xl[(wg * 4 + w) * N + col_of(c, q)] = l;
  }
  named_barrier(1, 256);  // both WGs: loops done (the K stages are free), partial sums written
  float l_ref[NC];  // this WG's row sum relative to its O reference M
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int n = col_of(c, q);
    const float l = xl[(wg * 4) * N + n] + xl[(wg * 4 + 1) * N + n] + xl[(wg * 4 + 2) * N + n] +
                    xl[(wg * 4 + 3) * N + n];
    l_ref[c] = M[c] == -INFINITY ? 0.f : l * ex2(m_own[c] - M[c]);
  }
  float* xo = reinterpret_cast<float*>(smem + L::OFF_K);  // WG1's O, [element][thread of the WG]
  if (wg == 1) {
#pragma unroll
    for (int i = 0; i < 8 * OREG; ++i) xo[i * 128 + wt] = o[i];
    if (w == 0 && g == 0) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        xw[col_of(c, q)] = M[c];
        xw[N + col_of(c, q)] = l_ref[c];
      }
      if (q == 0) xw[2 * N] = C;
    }
  }
  named_barrier(1, 256);
  if (wg == 1) return;

  float f0[NC], f1[NC], lse[NC];
  const float C1 = xw[2 * N];
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int n = col_of(c, q);
    const float M1 = xw[n], l1 = xw[N + n];
    const float Mf = fmaxf(M[c], M1);
    const float e0 = M[c] == -INFINITY ? 0.f : ex2(M[c] - Mf);
    const float e1 = M1 == -INFINITY ? 0.f : ex2(M1 - Mf);
    const float lf = l_ref[c] * e0 + l1 * e1;
    const bool has = lf > 0.f;
    const float inv = has ? 1.f / (448.f * lf) : 0.f;
    f0[c] = e0 * C * inv;
    f1[c] = e1 * C1 * inv;
    lse[c] = has ? (Mf + __log2f(lf)) * 0.6931471805599453f : -INFINITY;
  }
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int n = col_of(c, q);
    const int gr = rb * N + n;
    if (gr >= p.num_rows) continue;
    const int j = c >> 1, e = c & 1;
    const int t = gr / p.num_heads, hd = gr % p.num_heads;
    if (writes_out(p)) {
      __nv_bfloat16* orow = p.out + b * p.out_sb + t * p.out_st + hd * p.out_sh + 16 * w + 2 * g;
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        const int i0 = mb * OREG + j * 4 + e, i1 = i0 + 2;  // channels 2g, 2g + 1
        const float v0 = o[i0] * f0[c] + xo[i0 * 128 + wt] * f1[c];
        const float v1 = o[i1] * f0[c] + xo[i1 * 128 + wt] * f1[c];
        *reinterpret_cast<__nv_bfloat162*>(orow + 64 * mb) = __floats2bfloat162_rn(v0, v1);
      }
      if (w == 0 && g == 0) p.lse[b * p.lse_sb + t * p.lse_st + hd] = lse[c];
    } else {
      float* orow = p.op + b * p.op_sb + gr * p.op_sr + sp * p.op_ss + 16 * w + 2 * g;
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        const int i0 = mb * OREG + j * 4 + e, i1 = i0 + 2;
        *reinterpret_cast<float2*>(orow + 64 * mb) = make_float2(o[i0] * f0[c] + xo[i0 * 128 + wt] * f1[c],
                                                                 o[i1] * f0[c] + xo[i1 * 128 + wt] * f1[c]);
      }
      if (w == 0 && g == 0) p.lp[b * p.lp_sb + gr * p.lp_sr + sp] = lse[c];
    }
  }
}

}  // namespace mla_fp8_sm90_v3

// Entry points: the kernel for 16 rows (16 heads x q_len 1), else blocks of 32 rows (grid.x = the row blocks).
static bool mla_fp8_attr_done_16[128] = {};
static bool mla_fp8_attr_done_32[128] = {};
MLA_FP8_EXPORT int mla_fp8_decode_sm90(MLA_FP8_ENTRY_PARAMS) {
  const int rows = num_heads * q_len;
  if (rows <= 16)
    return mla_fp8_common::launch(mla_fp8_sm90_v3::mla_fp8_decode_kernel_v3<16>, mla_fp8_attr_done_16,
                                  mla_fp8_sm90_v3::THREADS, mla_fp8_sm90_v3::Layout<16>::SMEM_BYTES, 16,
                                  MLA_FP8_ENTRY_ARGS);
  return mla_fp8_common::launch(mla_fp8_sm90_v3::mla_fp8_decode_kernel_v3<32>, mla_fp8_attr_done_32,
                                mla_fp8_sm90_v3::THREADS, mla_fp8_sm90_v3::Layout<32>::SMEM_BYTES, 32,
                                MLA_FP8_ENTRY_ARGS);
}
MLA_FP8_EXPORT const char* mla_fp8_decode_sm90_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
MLA_FP8_EXPORT int mla_fp8_decode_sm90_smem_bytes() { return mla_fp8_sm90_v3::Layout<32>::SMEM_BYTES; }
