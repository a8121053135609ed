// FP8 MLA decode for DeepSeek-V3 on Hopper (sm_90a), version 2: warp-specialized "seesaw" split kernel.
//
// Same inputs, outputs, KV format, launcher signature and arithmetic as version 1 (mla_fp8_decode_sm90.cu: read its
// header for the SW64 layout, the V transpose, the V-scale folding and the per-tile promotion); only the schedule
// differs. Status (H200, 2026-12-02, with the paired V^T transpose and the TMA loader): 109/109 GPU tests of both
// versions pass; 1.03-1.23x v1, 0.75-0.88x FlashMLA BF16 at 128 heads, batch >= 16, context >= 4k: still far from the
// cycle model below (benchmark/kernels/mla_cuda_ablation.py says where the time goes).
//
// Why v2. v1 (235 us at batch 64 x 4k x 128 heads, FlashMLA BF16 127 us) runs its two warpgroups (WG) in lockstep:
// per tile both WGs do QK^T (each 32 tokens, m64n32k32: smem-bound), exchange row maxima, softmax, two CTA-wide
// barriers, then PV. Softmax, the barriers and the PV wait leave the tensor cores idle for most of the tile.
//
// Design
// - CTA = (64 query rows, KV split, batch) as v1; 384 threads: WG0, WG1 math (setmaxnreg 232), WG2 loader (40).
// - Tile ownership alternates: WG w computes S = Q K^T for tiles t with t % 2 == w, on the full 64 tokens with
//   m64n64k32 (half the shared-memory bytes per FLOP of v1's n32: A 2 KB + B 2 KB per 32 tensor cycles), then its
//   softmax, and publishes P' (e4m3, 64 x 64, SW64) with its row max m and V-scale max c. Both WGs then add P'V of
//   every tile to their own 256 channels of O (m64n128k32 x 2 halves, fresh accumulator, promoted into fp32 O).
// - Improvement over a strict seesaw: the two owners keep INDEPENDENT softmax chains (WG w's running max m_w and
//   V-scale max c_w over its own tiles only), so the owner of tile t never waits for tile t-1's max (no serial
//   softmax chain across WGs). A consumer merges any tile into O with the owner's (m_t, c_t):
//       M' = max(M, m_t), C' = max(C, c_t),  O = O * 2^(M - M') C / C' + (P'V) * 2^(m_t - M') c_t / C'
//   (O in units of C/448 relative to 2^(. - M)). Lazily (the default since session 28, mla_fp8_sm90_common.cuh): M'
//   and C' stay M and C unless m_t > M + 8 or c_t > 256 C, so the merge is mostly one FFMA per element of O,
//   O += (P'V) 2^(m_t - M) c_t / C. The row sum l stays per owner chain and is merged once at the end, by each WG
//   against its own reference M: l = l_0 2^(m_0 - M) + l_1 2^(m_1 - M) (eagerly, both WGs end with M = max(m_0, m_1);
//   lazily their references may differ, and each WG's O and l share its own).
// - Per round j, WG0: V^T(2j-1, 2j) -> QK^T(2j) -> softmax -> publish -> P'V(2j) -> P'V(2j-1);
//                 WG1: V^T(2j, 2j+1) -> QK^T(2j+1) -> softmax -> publish -> P'V(2j+1) -> P'V(2j).
//   WG1 starts after WG0 published P'(0) (a one-time skew of QK + softmax, about half a round), so one WG's
//   softmax / transposes run while the other WG's wgmmas use the tensor cores.
// - Each WG transposes only the 256 V channels it multiplies (V^T private per WG, double buffered by tile & 1), so
//   V^T needs no cross-WG synchronization (a 128-thread named barrier per WG). The transposes run before the
//   QK^T wgmmas: with the 64 S registers in flight on top of O's 128, ptxas spilled the transpose's registers.
// - Loader WG: Q by cp.async over its 128 threads (landed before tile 0 is released), then one thread issues each K
//   tile as 9 TMA boxes (64 tokens x 64 bytes, SWIZZLE_64B = the SW64 layout) and one bulk copy of its scales
//   against full_k's transaction count, 3 stages (the host encodes the cache's tensor map per launch). Design
//   option MLA_CP_ASYNC_LOAD keeps the first loader: 2304 16-byte cp.async per tile over the 128 threads into the
//   same layout, signalled with cp.async.mbarrier.arrive.noinc (full_k count 128); 5.7-9% slower (2026-12-02).
// - Synchronization (no CTA-wide barrier after the mbarrier init; parity of use u of a buffer = u & 1):
//     full_k[s]  (count 1 + the tile's bytes: TMA; cp.async: 128 .noinc arrives) -> waited by both math WGs
//     empty_k[s] (count 256, each math thread once per tile after its last read of the stage) -> waited by loader
//     full_p[b]  (count 128, owner threads after P', m, c stores + fence.proxy.async) -> waited by both WGs
//     empty_p[b] (count 256, both WGs after their P'V wgmmas of the tile completed) -> waited by the owner of t+2
//     named barrier 2+w (WG w, 128): V^T written (+ fence.proxy.async) before its wgmmas; last round's P'V done
//     before V^T is rewritten.  Named barrier 1 (256): the final l/m exchange only.
//   Proxy fences: writers of V^T and P' fence before releasing; consumers also fence after acquiring (cp.async data
//   released by the .noinc arrive cannot be fenced by its writer).
//
// Cycle model (per 64-token tile, one CTA per SM; tensor cycles at the dense FP8 rate 8192 FLOP/clk/SM):
//   tensor:  QK^T 2*64*64*576/8192 = 576, PV 2*64*64*512/8192 = 512             -> 1088 clk
//   shared-memory bytes (128 B/clk):  QK^T operands 36864 (Q) + 36864 (K) = 73.7 KB; PV operands 2 WGs x 2 halves
//     x (4 KB P + 8 KB V^T) = 48 KB; V^T transpose 32 KB read + 32 KB written; K tile landing 37 KB; P' stores
//     4 KB                                                                         -> ~227 KB = 1770 clk
//   CUDA cores per owner softmax: 32 elements/thread (scale, mask, max, ex2, sum, cvt) ~ 350 clk latency; O merge
//     2 x 64 FFMA + 64 FMUL per thread per tile per WG ~ 200 issue clk per SMSP; transposes ~ 120 instr/warp/tile.
//   v1 per tile: QK^T on n32 (~1180 smem-bound) + serial softmax/barriers/PV (~2000) -> measured ~4700 clk at the
//   ~1.3 GHz these runs clock at.  v2: the serial part overlaps the other WG, so the tile is bounded by shared
//   memory (~1770 clk) plus imperfect overlap (the WGs alternate; P'/V^T hand-offs) ~ 20-40%: 2100-2500 clk.
//   Representative point (64 tiles per CTA, 128 CTAs on 132 SMs, ~1.3-1.5 GHz): 64 x 2100-2500 / 1.4e9 ~ 95-115 us
//   (+ Q pre-pass ~3 us): predicted ~100-120 us vs v1 235 and FlashMLA BF16 127: 1.05-1.25x FlashMLA, not 1.6x.
//   The remaining bound is shared memory, not the tensor cores: the next steps (not done) are Q in registers as the
//   QK^T A operand (-36 KB/tile, needs O in 2 passes or 2 CTAs' registers), 128 query rows per CTA sharing each V^T
//   (-32 KB/tile of transpose per row block), and the transposes off the math WGs.
//
// Registers: launch 384 x 168; setmaxnreg: math 232 (O 128 + S 64 or PV accumulator 64), loader 40.
// Shared memory (bytes): Q 36864 + K 3 x 36864 + V^T 2 WGs x 2 x 16384 + P' 2 x 4096 + scales 3 x 512 + m/c
//   exchange 528 + epilogue l/m 1024 + 10 mbarriers = 224352, + 1024 alignment slack = 225376 (1 CTA/SM).
//
// Ablations (where the time goes; benchmark/kernels/mla_cuda_ablation.py times them, mla_decode_cuda.build(defines=)
// builds them). Compile-time switches, all off by default (the default build's SASS is unchanged by them); each keeps
// every mbarrier arrival and wait, named barrier and fence, so nothing hangs, and reads/writes no new address; the
// results are wrong by design. Any combination is valid. v1 has the same switches at the same places (its softmax
// also keeps the row-max exchange's store and pair barrier).
//   -DMLA_ABLATE_NO_TRANSPOSE  no V^T transposes (the P'V wgmmas read whatever the V^T buffers hold)
//   -DMLA_ABLATE_NO_SOFTMAX    P' = e4m3(S_lat + S_rope): no V-scale max, scaling, masking, row max, exp2, row sum;
//                              m = 0 and c = 1 are published with P' (the consumers' merges stay finite)
//   -DMLA_ABLATE_NO_PV         no P'V wgmmas (the merge adds O's own registers as a stand-in accumulator)
//   -DMLA_ABLATE_NO_QK         no QK^T wgmmas (the softmax reads O's registers as S)
//   -DMLA_ABLATE_NO_LOAD       the loader copies K tiles and scales (and reads the block table) for the first NST
//                              tiles only; later tiles reuse the stale stages, the cp.async arrive still signals
//   -DMLA_ABLATE_NO_MERGE      no per-tile merge: no m/c reads, no alpha/beta, no FMUL/FFMA; P'V accumulates straight
//                              into O (wgmma scale-d 1, no promotion). With NO_PV: O is not touched at all
//   -DMLA_ABLATE_EMPTY         the kernel returns at once: what is left is the launch, Q pre-pass and combine
// Stand-ins come from live registers, not constants: ptxas would fold those (and drop wgmmas whose results are
// unused). test_mla_decode_cuda_build.py pins each build's QGMMA count.
#include "mla_fp8_sm90_common.cuh"

namespace mla_fp8_sm90_v2 {

using namespace mla_fp8_common;

constexpr int PAGE = 64;            // tokens per page = per KV tile
constexpr int DQK = 576;
constexpr int ROWS = 64;            // query rows per CTA
constexpr int NST = 3;                     // K tile stages
constexpr int THREADS = 384;        // WG0, WG1: math; WG2: loader
constexpr int MATH_REGS = 232;      // setmaxnreg: 2 x 232 + 40 = 504 = 3 x 168 (the launch allocation)
constexpr int LOADER_REGS = 40;
constexpr int TILE_BYTES = PAGE * DQK;            // 36864
constexpr int KB_BYTES = 64 * 64;                 // one SW64 K block of 64 rows
constexpr int VTH_BYTES = 256 * PAGE;             // 16384: V^T of one WG's 256 channels x 64 tokens
constexpr int P_BYTES = ROWS * PAGE;              // 4096
constexpr int KS_BYTES = PAGE * 2 * 4;            // 512
constexpr int OFF_Q = 0;
constexpr int OFF_K = OFF_Q + ROWS * DQK;         // 36864
constexpr int OFF_VT = OFF_K + NST * TILE_BYTES;  // 147456: [WG][tile & 1] 4 x 16384
constexpr int OFF_P = OFF_VT + 4 * VTH_BYTES;  // 212992: [tile & 1] 2 x 4096
constexpr int OFF_KS = OFF_P + 2 * P_BYTES;       // 221184: [NST] 512
constexpr int OFF_XM = OFF_KS + NST * KS_BYTES;   // 222720: float [2][64] owner's m with each P'
constexpr int OFF_XC = OFF_XM + 2 * ROWS * 4;     // 223232: float [2] owner's c with each P' (16 B)
constexpr int OFF_XL = OFF_XC + 16;               // 223248: float [2][64] l, [2][64] m (epilogue)
constexpr int OFF_QS = OFF_XL + 4 * ROWS * 4;     // 224272: MLA_FUSED_Q: float [64][2] the block's Q scales
constexpr int OFF_BAR = OFF_QS + (MLA_FUSED_Q ? 2 * ROWS * 4 : 0);  // 224272 (+512): mbarriers full_k[3] empty_k[3]
                                                                   // full_p[2] empty_p[2]
constexpr int SMEM_USED = OFF_BAR + 8 * (2 * NST + 4);  // 224352 (+512)
constexpr int SMEM_BYTES = SMEM_USED + 1024;            // 225376 (+512) (1 KB alignment slack)
static_assert(SMEM_BYTES <= 232448, "over the sm_90 shared memory per block");
static_assert(OFF_K % 1024 == 0 && OFF_VT % 1024 == 0 && OFF_P % 1024 == 0 && OFF_KS % 16 == 0 &&
                  OFF_BAR % 8 == 0, "alignment");
static_assert(2 * MATH_REGS + LOADER_REGS <= 3 * 168, "setmaxnreg budget");

__device__ __forceinline__ void wgmma_m64n64k32_e4m3(float* d, uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}




__global__ void __launch_bounds__(THREADS, 1) mla_fp8_decode_kernel_v2(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t sbase;
  uint8_t* smem = aligned_smem(smem_raw, sbase);

  const int tid = threadIdx.x;
  // 0, 1: math warpgroups (O channels 256 wg ..; own tiles t with t % 2 == wg); 2: loader. Read through a shuffle
  // so that ptxas sees a warp-uniform value: wgmma under a branch it cannot prove uniform gets serialized (C7518).
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int lane = tid & 31;
  const int rb = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;

  if constexpr (MLA_ABLATE_EMPTY) return;  // ablation: the launch only (and the caller's Q pre-pass + combine)
  int seqlen, start, end;
  if (!split_range(p, b, sp, PAGE, seqlen, start, end)) return;  // uniform over the CTA
  const int ntiles = end > start ? cdiv(end - start, PAGE) : 0;

  const uint32_t bar_full_k = sbase + OFF_BAR;            // [NST] count 1 + bytes (TMA) or 128 (cp.async .noinc)
  const uint32_t bar_empty_k = bar_full_k + 8 * NST;      // [NST] count 256: both math WGs (QK^T, V^T, scales read)
  const uint32_t bar_full_p = bar_empty_k + 8 * NST;      // [2]   count 128: the owner WG (P', m, c written)
  const uint32_t bar_empty_p = bar_full_p + 16;           // [2]   count 256: both math WGs (PV done, m/c read)
  if (tid == 0) {
    for (int s = 0; s < NST; ++s) {
      mbar_init(bar_full_k + 8 * s, MLA_TMA_LOAD ? 1 : 128);  // TMA: one arrival plus the copies' bytes
      mbar_init(bar_empty_k + 8 * s, 256);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(bar_full_p + 8 * s, 128);
      mbar_init(bar_empty_p + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // inits visible (cp.async arrives too)
  }
  __syncthreads();  // the only CTA-wide barrier: mbarriers initialised before anybody uses them
  MLA_TRACE_DECL;   // -DMLA_TRACE: per-warp timeline of one CTA (codes: TRACE_EVENTS in trace_mla_decode.py)
  MLA_TRACE(1);

  if (wg == 2) {
    // =========================================== loader warpgroup ===========================================
    setmaxnreg_dec<LOADER_REGS>();
    const int ptid = tid - 256;
    const int* bt_row = p.block_table + static_cast<long long>(b) * p.bt_stride;
#if MLA_TMA_LOAD
    if (!MLA_FUSED_Q && ntiles > 0) {  // Q by cp.async over the warpgroup, landed before thread 0's tile-0 arrival
#pragma unroll 2
      for (int i = 0; i < 18; ++i) load_q_chunk(p, sbase + OFF_Q, b, rb, ROWS, KB_BYTES, i * 128 + ptid);
      cp_async_wait_all();
      named_barrier(4, 128);
    }
    if (ptid == 0) {
#pragma unroll 1
      for (int t = 0; t < ntiles; ++t) {
        const int st = t % NST;
        const uint32_t full = bar_full_k + 8 * st;
        MLA_TRACE(2);
        if (t >= NST) mbar_wait(bar_empty_k + 8 * st, ((t / NST) - 1) & 1);  // tile t - NST released by both WGs
        MLA_TRACE(3);
        if (MLA_ABLATE_NO_LOAD && t >= NST) {  // ablation: the stages keep tiles 0 .. NST-1
          mbar_arrive(full);
          continue;
        }
        const int page = bt_row[(start + t * PAGE) / PAGE];
        const uint32_t dst = sbase + OFF_K + st * TILE_BYTES;
        mbar_arrive_expect_tx(full, TILE_BYTES + KS_BYTES);
#pragma unroll
        for (int kb = 0; kb < DQK / 64; ++kb) tma_kv_block(dst + kb * KB_BYTES, &p.kv_map, kb, page, full);
        bulk_copy(sbase + OFF_KS + st * KS_BYTES, p.kvs + static_cast<long long>(page) * p.kvs_page_stride, KS_BYTES,
                  full);
        MLA_TRACE(4);
      }
    }
#else
#pragma unroll 1
    for (int t = 0; t < ntiles; ++t) {
      const int st = t % NST;
      MLA_TRACE(2);
      if (t >= NST) mbar_wait(bar_empty_k + 8 * st, ((t / NST) - 1) & 1);  // tile t - NST released by both WGs
      MLA_TRACE(3);
      if (!MLA_FUSED_Q && t == 0) {  // Q rides with tile 0 (every later full_k phase also covers it)
#pragma unroll 2
        for (int i = 0; i < 18; ++i) load_q_chunk(p, sbase + OFF_Q, b, rb, ROWS, KB_BYTES, i * 128 + ptid);
      }
      if (MLA_ABLATE_NO_LOAD && t >= NST) {  // ablation: the stages keep tiles 0 .. NST-1; the protocol stays
        cp_async_mbar_arrive(bar_full_k + 8 * st);
        continue;
      }
      const int page = bt_row[(start + t * PAGE) / PAGE];
      const uint8_t* src = p.kv + static_cast<long long>(page) * p.kv_page_stride;
      const uint32_t dst = sbase + OFF_K + st * TILE_BYTES;
#pragma unroll 2
      for (int i = 0; i < 18; ++i) {
        const int g = i * 128 + ptid;
        const int tok = g / 36, c = g % 36;
        cp_async16(dst + (c >> 2) * KB_BYTES + sw64(tok, (c & 3) * 16), src + g * 16, 16);
      }
      if (ptid < 32)
        cp_async16(sbase + OFF_KS + st * KS_BYTES + ptid * 16,
                   p.kvs + static_cast<long long>(page) * p.kvs_page_stride + ptid * 4, 16);
      cp_async_mbar_arrive(bar_full_k + 8 * st);
      MLA_TRACE(4);
    }
#endif
    cp_async_wait_all();
    MLA_TRACE(5);
    MLA_TRACE_END;
    return;
  }

  // ============================================= math warpgroups =============================================
  setmaxnreg_inc<MATH_REGS>();
  const int wq = (tid >> 5) & 3;  // warp within the WG: rows 16 wq .. 16 wq + 15
  const int q4 = lane & 3;
  const int r0 = wq * 16 + (lane >> 2);  // this thread's rows r0, r0 + 8 (accumulator layout)

  float sq_lat[2], sq_rope[2];
  int lim[2];  // absolute token limit: row sees positions < lim
#if MLA_FUSED_Q
  float* cta_qs = reinterpret_cast<float*>(smem + OFF_QS);
  quantize_q_rows(p, sbase + OFF_Q, cta_qs, b, rb, ROWS, KB_BYTES, tid);  // while the loader's first K tiles land
  fence_proxy_async();    // Q written by ordinary stores, read by both WGs' wgmmas through the async proxy
  named_barrier(1, 256);  // both math WGs: every row of Q and its scales written
  row_setup(p, b, rb, ROWS, r0, seqlen, end, sq_lat, sq_rope, lim, cta_qs);
#else
  row_setup(p, b, rb, ROWS, r0, seqlen, end, sq_lat, sq_rope, lim);
#endif

  // O: this WG's 256 channels of the 64 rows, fp32, in units of C / 448 relative to exp2(. - M) (M, C: maxima over
  // all tiles added so far, in this WG's order). Each tile's P'V goes through a fresh wgmma accumulator (promotion).
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float M[2] = {-INFINITY, -INFINITY};
  float C = 0.f;
  // the owner chain (this WG's own tiles only): running row max m_own (P of an own tile is exp2(S - m_own)),
  // partial row sum l_own relative to m_own (this thread's columns), running max V scale c_own (P' = P s_v / c_own 448)
  float m_own[2] = {-INFINITY, -INFINITY}, l_own[2] = {0.f, 0.f};
  float c_own = 0.f;

  float* xm = reinterpret_cast<float*>(smem + OFF_XM);  // [2][64] m_own published with P' (buffer = tile & 1)
  float* xc = reinterpret_cast<float*>(smem + OFF_XC);  // [2]     c_own published with P'
  const int vt_dloc = wq * 64;                          // this warp's V^T rows (channels 256 wg + 64 wq ..)
  const int kblk = wg * 4 + wq;                         // ... = K block kblk of the K tile
  const int wg_bar = 2 + wg;                            // named barrier of this WG (128 threads)

  // P'V of tile t for this WG's 256 channels, merged into O with the owner's (m, c) of that tile
  auto pv_tile = [&](int t) {
    const int pb = t & 1;
    MLA_TRACE(17);
    mbar_wait(bar_full_p + 8 * pb, (t >> 1) & 1);
    MLA_TRACE(18);
    fence_proxy_async();
    float alpha[2], beta[2];
    if constexpr (!MLA_ABLATE_NO_MERGE) {
      // O's new reference: the running maxima (eager), or the old one unless the tile's maxima run far past it (lazy)
      const float ci = xc[pb];  // >= 1e-30; C = 0 before the first tile, so that one always moves it
      const float c_new = MLA_LAZY_RESCALE ? (ci > C * MLA_LAZY_SCALE_STEP ? ci : C) : fmaxf(C, ci);
      const float rc = 1.f / c_new;
      bool moved = c_new != C;  // uniform: every thread reads the same ci and holds the same C
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mi = xm[pb * ROWS + r0 + 8 * h];
        const float m_new = MLA_LAZY_RESCALE ? (mi > M[h] + MLA_LAZY_MAX_STEP ? mi : M[h])  // M = -inf: mi moves it
                                             : fmaxf(M[h], mi);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        moved |= m_new != M[h];
        alpha[h] = ex2(M[h] - m_use) * (C * rc);  // M = -inf -> 0 (O is 0 then); lazily used only on a move
        beta[h] = ex2(mi - m_use) * (ci * rc);    // mi = -inf -> 0; lazily up to 2^8 * 256
        M[h] = m_new;
      }
      C = c_new;
      if (MLA_LAZY_RESCALE && __any_sync(0xffffffffu, moved)) {  // rare after the first tiles: O to the new reference
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
      }
    }
    const uint32_t pa = sbase + OFF_P + pb * P_BYTES;
    const uint32_t vt = sbase + OFF_VT + (wg * 2 + (t & 1)) * VTH_BYTES;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if constexpr (MLA_ABLATE_NO_MERGE) {  // ablation: P'V accumulates straight into O, no rescale (or none: NO_PV)
        if constexpr (!MLA_ABLATE_NO_PV) pv_half<true>(o + half * 64, pa, vt + half * 8192);
      } else {
        float acc[64];
        if constexpr (MLA_ABLATE_NO_PV)
          stand_in<64>(acc, o + half * 64);  // ablation: no P'V wgmmas, the merge below still runs
        else
          pv_half(acc, pa, vt + half * 8192);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          float* oj = o + half * 64 + j * 4;
          if constexpr (MLA_LAZY_RESCALE) {  // O already at the tile's reference: one FFMA per element
            oj[0] = fmaf(acc[j * 4 + 0], beta[0], oj[0]);
            oj[1] = fmaf(acc[j * 4 + 1], beta[0], oj[1]);
            oj[2] = fmaf(acc[j * 4 + 2], beta[1], oj[2]);
            oj[3] = fmaf(acc[j * 4 + 3], beta[1], oj[3]);
          } else {
            oj[0] = fmaf(oj[0], alpha[0], acc[j * 4 + 0] * beta[0]);
            oj[1] = fmaf(oj[1], alpha[0], acc[j * 4 + 1] * beta[0]);
            oj[2] = fmaf(oj[2], alpha[1], acc[j * 4 + 2] * beta[1]);
            oj[3] = fmaf(oj[3], alpha[1], acc[j * 4 + 3] * beta[1]);
          }
        }
      }
    }
    mbar_arrive(bar_empty_p + 8 * pb);  // this thread's wgmmas completed and its m/c reads are done
    MLA_TRACE(19);
  };

  // V^T of tile t's K stage (once landed), this WG's 256 channels, into its buffer t & 1
  const auto transpose_tile = [&](int t) {
    const int st = t % NST;
    mbar_wait(bar_full_k + 8 * st, (t / NST) & 1);
    MLA_TRACE(20);
    if constexpr (!MLA_ABLATE_NO_TRANSPOSE) {  // ablation: the P'V wgmmas read stale V^T
      const uint8_t* src = smem + OFF_K + st * TILE_BYTES + kblk * KB_BYTES;
      uint8_t* dst = smem + OFF_VT + (wg * 2 + (t & 1)) * VTH_BYTES;
      transpose_v<1>(src, dst, vt_dloc, min(end - (start + t * PAGE), PAGE), lane);
    }
  };

  if (wg == 1 && ntiles > 0) mbar_wait(bar_full_p, 0);  // start half a period behind WG0 (seesaw skew; no data)

  const int nrounds = ntiles / 2 + 1;
#pragma unroll 1
  for (int j = 0; j < nrounds; ++j) {
    const int t_own = 2 * j + wg;                   // QK^T + softmax here
    const int t_oth = wg == 0 ? 2 * j - 1 : 2 * j;  // the other WG's tile whose P'V this WG adds this round
    const bool has_own = t_own < ntiles, has_oth = t_oth >= 0 && t_oth < ntiles;

    // every warp of this WG is past last round's P'V wgmmas (they read the V^T buffers rewritten below)
    MLA_TRACE(10);
    named_barrier(wg_bar, 128);
    MLA_TRACE(11);

    // ---- V^T of this WG's 256 channels for both tiles of the round (before the QK^T wgmmas: their 64 accumulator
    //      registers on top of O leave no room for the transpose's, ptxas spilled) ----
    if (has_oth) transpose_tile(t_oth);
    if (has_own) transpose_tile(t_own);
    fence_proxy_async();         // V^T written by ordinary stores; wgmma reads it through the async proxy
    named_barrier(wg_bar, 128);  // ... complete for the whole WG
    MLA_TRACE(12);
    if (has_oth) mbar_arrive(bar_empty_k + 8 * (t_oth % NST));  // done with the other tile's stage

    float s_lat[32], s_rope[32];
    if (has_own) {
      const int st = t_own % NST;
      fence_proxy_async();  // (full_k waited above) cp.async wrote through the generic proxy
      const uint32_t qa = sbase + OFF_Q;
      const uint32_t ka = sbase + OFF_K + st * TILE_BYTES;
      if constexpr (MLA_ABLATE_NO_QK) {  // ablation: no QK^T wgmmas, the softmax reads O's registers as S
        stand_in<32>(s_lat, o);
        stand_in<32>(s_rope, o + 32);
      } else {
        issue_qk<wgmma_m64n64k32_e4m3>(s_lat, s_rope, qa, ka, KB_BYTES);
      }
      MLA_TRACE(13);
    }

    if (has_own) {
      const int st = t_own % NST;
      uint32_t pk[16];  // [jj][h]: e4m3 of columns 8jj + 2q4, +1 of row r0 + 8h (paired form: [c][h][e])
      if constexpr (MLA_ABLATE_NO_SOFTMAX) {  // ablation: P' = e4m3(S), no scale, mask, max, exp2, sum, V scale
        wgmma_wait<0>();
        MLA_TRACE(14);
        fence_regs<32>(s_lat);
        fence_regs<32>(s_rope);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int e = jj * 4 + h * 2;
            pk[jj * 2 + h] = to_e4m3x2(s_lat[e] + s_rope[e], s_lat[e + 1] + s_rope[e + 1]);
          }
        m_own[0] = m_own[1] = 0.f;  // published with P': the consumers' merge factors stay finite
        c_own = 1.f;
      } else {
        const int n0 = start + t_own * PAGE;
        const int nvalid = min(end - n0, PAGE);
        const float* ksc = reinterpret_cast<const float*>(smem + OFF_KS + st * KS_BYTES);
        // largest valid V scale of the tile (every warp computes the same value)
        float ct = fmaxf(lane < nvalid ? ksc[lane * 2] : 0.f, lane + 32 < nvalid ? ksc[(lane + 32) * 2] : 0.f);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) ct = fmaxf(ct, __shfl_xor_sync(0xffffffffu, ct, off));
        const float c_new = fmaxf(fmaxf(c_own, ct), 1e-30f);

        wgmma_wait<0>();
        MLA_TRACE(14);
        fence_regs<32>(s_lat);
        fence_regs<32>(s_rope);

        // scores (log2 units), masked by selects (NaN past the end is dropped)
        float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int n = 8 * jj + 2 * q4;
          const float4 ks4 = *reinterpret_cast<const float4*>(ksc + n * 2);  // (lat n, rope n, lat n+1, rope n+1)
          score_pair(s_lat, s_rope, jj * 4, ks4, sq_lat, sq_rope, n0 + n, lim, mt);
        }
        float m_use[2], alpha_own[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
          mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
          const float m_new = fmaxf(m_own[h], mt[h]);
          m_use[h] = m_new == -INFINITY ? 0.f : m_new;
          alpha_own[h] = ex2(m_own[h] - m_use[h]);  // m_own = -inf -> 0
          m_own[h] = m_new;
        }
        // P = exp2(S - m_own); l from fp32 P; P' = P s_v / c_own * 448 (<= 448) packed as e4m3
        const float vs = 448.f / c_new;
        float ls[2] = {0.f, 0.f};
        if constexpr (MLA_VT_LDSM_PAIRED) {  // pk[(c * 2 + h) * 2 + e]: tokens 16c + 2q4 + e and + 8 of row r0 + 8h
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float f[4];  // [half of the chunk][e]
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              const int n = 16 * c + 8 * (x >> 1) + 2 * q4 + (x & 1);
              f[x] = n < nvalid ? ksc[n * 2] * vs : 0.f;  // scales may be NaN
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              uint16_t pk2[2];
              paired_p(s_lat, 2 * c * 4 + h * 2, m_use[h], f, ls[h], pk2);
              pk[(c * 2 + h) * 2] = pk2[0];
              pk[(c * 2 + h) * 2 + 1] = pk2[1];
            }
          }
        } else {
#pragma unroll
          for (int jj = 0; jj < 8; ++jj) {
            const int n = 8 * jj + 2 * q4;
            const float2 kl = make_float2(ksc[n * 2], ksc[n * 2 + 2]);
            const float f0 = n < nvalid ? kl.x * vs : 0.f, f1 = n + 1 < nvalid ? kl.y * vs : 0.f;  // may be NaN
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int e = jj * 4 + h * 2;
              const float p0 = ex2(s_lat[e] - m_use[h]), p1 = ex2(s_lat[e + 1] - m_use[h]);
              ls[h] += p0 + p1;
              pk[jj * 2 + h] = to_e4m3x2(p0 * f0, p1 * f1);
            }
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l_own[h] = l_own[h] * alpha_own[h] + ls[h];
        c_own = c_new;
      }
      mbar_arrive(bar_empty_k + 8 * st);  // QK^T wgmmas completed, scales read: the K stage may be refilled
      MLA_TRACE(15);

      // publish P', m_own, c_own in buffer t & 1 once both WGs are done with tile t - 2 there
      const int pb = t_own & 1;  // == wg
      if (t_own >= 2) mbar_wait(bar_empty_p + 8 * pb, ((t_own - 2) >> 1) & 1);
      uint8_t* pt = smem + OFF_P + pb * P_BYTES;
      if constexpr (MLA_VT_LDSM_PAIRED) {
#pragma unroll
        for (int x = 0; x < 16; ++x)  // x = (c * 2 + h) * 2 + e: tokens 16c + 2q4 + e, + 8 at 16c + pv_k_pos(2q4 + e)
          *reinterpret_cast<uint16_t*>(pt + sw64(r0 + 8 * ((x >> 1) & 1), 16 * (x >> 2) + pv_k_pos(2 * q4 + (x & 1)))) =
              static_cast<uint16_t>(pk[x]);
      } else {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<uint16_t*>(pt + sw64(r0 + 8 * h, 8 * jj + 2 * q4)) =
                static_cast<uint16_t>(pk[jj * 2 + h]);
      }
      if (q4 == 0) {
        xm[pb * ROWS + r0] = m_own[0];
        xm[pb * ROWS + r0 + 8] = m_own[1];
      }
      if (tid == wg * 128) xc[pb] = c_own;
      fence_proxy_async();  // P' written by ordinary stores; both WGs' wgmmas read it through the async proxy
      mbar_arrive(bar_full_p + 8 * pb);
      MLA_TRACE(16);

      pv_tile(t_own);
    }
    if (has_oth) pv_tile(t_oth);
  }

  // ---- epilogue: l = l_0 2^(m_0 - M) + l_1 2^(m_1 - M) (the two owner chains), O / l, lse ----
  MLA_TRACE(30);
  float* xl = reinterpret_cast<float*>(smem + OFF_XL);  // [2][64]
  float* xmf = xl + 2 * ROWS;                           // [2][64]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_own[h] += __shfl_xor_sync(0xffffffffu, l_own[h], 1);
    l_own[h] += __shfl_xor_sync(0xffffffffu, l_own[h], 2);
    if (q4 == 0) {
      xl[wg * ROWS + r0 + 8 * h] = l_own[h];
      xmf[wg * ROWS + r0 + 8 * h] = m_own[h];
    }
  }
  named_barrier(1, 256);  // both math WGs (the loader does not take part)
  // the row block index through an opaque move: ptxas otherwise hoists the 64-bit output row offsets above the tile
  // loop, where the NO_MERGE ablation build (TMA loader) had to spill them
  int rb_late = rb;
  asm volatile("mov.b32 %0, %0;\n" : "+r"(rb_late));
  // a row's merged sum against this WG's O reference m_ref: whether it saw a token, O's output factor, its lse
  auto row_result = [&](int r, float m_ref, bool& has, float& inv, float& lse) {
    const float m_use = m_ref == -INFINITY ? 0.f : m_ref;
    const float lt = xl[r] * ex2(xmf[r] - m_use) + xl[ROWS + r] * ex2(xmf[ROWS + r] - m_use);
    has = lt > 0.f;
    inv = has ? C / (448.f * lt) : 0.f;
    lse = has ? (m_ref + __log2f(lt)) * 0.6931471805599453f : -INFINITY;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const int gr = rb_late * ROWS + r;
    if (gr >= p.num_rows) continue;
    bool has;
    float inv, lse;
    row_result(r, M[h], has, inv, lse);
    store_row(p, o, h, b, gr, sp, wg, q4, has, inv, lse);
  }
  MLA_TRACE(31);
  MLA_TRACE_END;
}

}  // namespace mla_fp8_sm90_v2
MLA_FP8_DEFINE_ENTRY_POINTS(mla_fp8_sm90_v2::mla_fp8_decode_kernel_v2, mla_fp8_sm90_v2::THREADS, mla_fp8_sm90_v2::SMEM_BYTES, mla_fp8_sm90_v2::ROWS)
