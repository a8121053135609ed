// FP8 MLA decode for DeepSeek-V3 on Hopper (sm_90a): both matrix products on FP8 wgmma.
//
// Replaces the split kernel of sgl_kernel_ext/mla_decode.py (_mla_fp8_split_kernel); the Q pre-pass
// (_quantize_q), the split plan and the combine kernel (_mla_fp8_combine_kernel) stay Triton.
//
// Inputs (see mla_decode.py's docstring): q8 [B * rows, 576] e4m3 + qs [B * rows, 2] fp32 (rows = q_len x heads,
// q-major), kv [pages, 64, 576] e4m3 + kv_scales [pages, 64, 2] fp32 (latent scale, rope scale per token),
// block_table [B, max_pages] int32, cache_seqlens [B] int32. V = the first 512 channels of the same latent.
//
// Design
// - CTA = (block of 64 query rows, KV split, batch); 256 threads = 2 warpgroups (WG). KV tile = 64 tokens =
//   one page (page size fixed at 64). Split boundaries are multiples of 64 tokens, as the combine kernel
//   computes them with BLOCK_N = 64.
// - Every wgmma operand lives in shared memory in the K-major 64-byte-swizzle canonical layout (SW64): a
//   "K block" of 64 bytes x R rows is stored as R/8 groups of 512 B (SBO = 512), row r of a group at 64 B x (r % 8),
//   its 16-byte chunk c at chunk c ^ ((r % 8) / 2). Q and K tiles are 9 such K blocks (8 latent + 1 rope) of
//   64 rows (4096 B each); V^T is one K block of 512 rows (channels) x 64 tokens; P one K block of 64 x 64.
// - Per tile: S = Q K^T by m64n32k32 FP8 wgmma, WG w takes tokens 32w..32w+31, latent (16 k-steps) and rope
//   (2 k-steps) into two accumulators (different scales). While it runs, each WG transposes the V channels it
//   will use (its 256 of 512) from the K tile into V^T with byte permutes (8x8 byte blocks, lane-dependent
//   permute selectors so that loads and stores are 2 wavefronts per warp, the minimum for 8-byte accesses).
//   Online softmax in base 2; row maxima exchanged between the two WGs through shared memory (named barrier per
//   warp pair). The V scale is folded into P: with c = the largest latent scale seen so far in this CTA,
//   P' = P * s_v[n] / c * 448 (<= 448) is rounded to e4m3 into the P tile; O is kept in units of c / 448 and
//   rescaled by exp2(m_old - m_new) * c_old / c_new once per tile. Then P' V^T for the WG's 256 channels by
//   m64n128k32 FP8 wgmma (two halves of 128 channels, 2 k-steps each) into a fresh accumulator that is added to
//   the fp32 O registers with the rescale (O = O * alpha + PV). Accumulating O in the wgmma accumulator across
//   all tiles was 4.5% off at 4k tokens on the H200 (Hopper's FP8 MMA adds into its accumulator with limited
//   precision; DeepGEMM promotes for the same reason); per-tile promotion brought it to 0.3%.
//   P and V^T are double buffered (the other WG may still be reading the previous tile's).
// - K tiles: cp.async (16 B, all threads), 3 stages. Tokens past the sequence end (possibly NaN in the
//   cache) are masked to -inf in S, their V bytes are zeroed in V^T and their scale is not used.
// - num_splits == 1: bf16 out [B, q_len, H, 512] and lse (natural log) written directly; otherwise fp32
//   partial O [B, rows, S, 512] and lse [B, rows, S] as _mla_fp8_combine_kernel reads them (splits with no
//   token write nothing: the combine kernel does not read them).
//
// Shared memory (bytes): Q 36864 + K 3 x 36864 + V^T 2 x 32768 + P 2 x 4096 + K scales 3 x 512
//   + row max / row sum exchange 1024 = 223744, + 1024 alignment slack = 224768 (one CTA per SM).
// Registers: O 64 x 256 fp32 per WG = 128 per thread, S 2 x 16, PV accumulator 64 (one half at a time).
//
// Work per 64-token tile and 64-row block: QK^T 2*64*64*576 = 4.72 MFLOP, PV 2*64*64*512 = 4.19 MFLOP;
// bytes read: 64 x 584 = 37376 (K tile + scales) per row block (128 heads = 2 row blocks read each page,
// the second mostly from L2). Shared-memory operand traffic per tile: QK 2 x (36864 + 18432), PV 2 x
// (2 x 4096 + 16384): ~159 KB, i.e. ~1180 cycles at 128 B/clk against ~1090 cycles of FP8 tensor math per SM:
// the small-N (32) QK^T wgmmas are bound by shared-memory bandwidth, not by the tensor cores.
//
// Ablation switches (-DMLA_ABLATE_NO_TRANSPOSE, ..._NO_SOFTMAX, _NO_PV, _NO_QK, _NO_LOAD, _NO_MERGE, _EMPTY; off by
// default, results wrong by design): see the "Ablations" paragraph of mla_fp8_decode_sm90_v2.cu. Here NO_LOAD issues
// no cp.async after the first NST tiles (the commit groups stay), NO_SOFTMAX keeps the row-max exchange's store and
// pair barrier, and NO_MERGE drops the per-tile FFMA (the rescale factors belong to the softmax).
// Its loads are cp.async by every thread: version 2's TMA loader belongs to its loader warpgroup, which v1 has not
#ifdef MLA_CP_ASYNC_LOAD
#undef MLA_CP_ASYNC_LOAD
#endif
#define MLA_CP_ASYNC_LOAD 1
#include "mla_fp8_sm90_common.cuh"

namespace mla_fp8_sm90 {

using namespace mla_fp8_common;

constexpr int PAGE = 64;            // tokens per page = per KV tile
constexpr int DQK = 576;
constexpr int DV = 512;
constexpr int ROWS = 64;            // query rows per CTA
constexpr int NST = 3;              // K tile stages
constexpr int THREADS = 256;
constexpr int TILE_BYTES = PAGE * DQK;            // 36864
constexpr int KB_BYTES = 64 * 64;                 // one SW64 K block of 64 rows
constexpr int OFF_Q = 0;
constexpr int OFF_K = OFF_Q + ROWS * DQK;         // 36864
constexpr int VT_BYTES = DV * PAGE;               // 32768
constexpr int OFF_VT = OFF_K + NST * TILE_BYTES;  // 147456
constexpr int P_BYTES = ROWS * PAGE;              // 4096
constexpr int OFF_P = OFF_VT + 2 * VT_BYTES;      // 212992
constexpr int KS_BYTES = PAGE * 2 * 4;            // 512
constexpr int OFF_KS = OFF_P + 2 * P_BYTES;       // 221184
constexpr int OFF_MAX = OFF_KS + NST * KS_BYTES;  // 222720: float [2][64]
constexpr int OFF_SUM = OFF_MAX + 2 * ROWS * 4;   // 223232: float [2][64]
constexpr int SMEM_USED = OFF_SUM + 2 * ROWS * 4; // 223744
constexpr int SMEM_BYTES = SMEM_USED + 1024;      // 224768
static_assert(SMEM_BYTES <= 232448, "over the sm_90 shared memory per block");
static_assert(OFF_K % 1024 == 0 && OFF_VT % 1024 == 0 && OFF_P % 1024 == 0 && OFF_KS % 16 == 0, "alignment");

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void wgmma_m64n32k32_e4m3(float* d, uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(scale_d));
}

__global__ void __launch_bounds__(THREADS, 1) mla_fp8_decode_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint32_t sbase;
  uint8_t* smem = aligned_smem(smem_raw, sbase);

  const int tid = threadIdx.x;
  // warpgroup: tokens 32wg.. of each tile in S, channels 256wg.. of O. (Read through a shuffle, as v2 and v3 do, the
  // wgmma descriptors stay in uniform registers: R2UR 44 -> 9; measured 0.99-1.00x, session 48, so not kept.)
  const int wg = tid >> 7;
  const int warp = (tid >> 5) & 3;   // warp within the warpgroup: rows 16warp..16warp+15
  const int lane = tid & 31;
  const int q4 = lane & 3;
  const int rb = blockIdx.x, sp = blockIdx.y, b = blockIdx.z;

  if constexpr (MLA_ABLATE_EMPTY) return;  // ablation: the launch only (and the caller's Q pre-pass + combine)
  int seqlen, start, end;
  if (!split_range(p, b, sp, PAGE, seqlen, start, end)) return;
  const int ntiles = end > start ? cdiv(end - start, PAGE) : 0;

  // ---- loads: Q (with tile 0's group), K tiles + scales (cp.async, one commit group per tile) ----
  if (ntiles > 0) {
#pragma unroll
    for (int i = 0; i < 9; ++i) load_q_chunk(p, sbase + OFF_Q, b, rb, ROWS, KB_BYTES, i * THREADS + tid);
  }
  const int* bt_row = p.block_table + static_cast<long long>(b) * p.bt_stride;
  auto load_tile = [&](int it) {
    const int st = it % NST;
    const int page = bt_row[(start + it * PAGE) / PAGE];
    const uint8_t* src = p.kv + static_cast<long long>(page) * p.kv_page_stride;
    const uint32_t dst = sbase + OFF_K + st * TILE_BYTES;
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      const int g = i * THREADS + tid;
      const int tok = g / 36, c = g % 36;
      cp_async16(dst + (c >> 2) * KB_BYTES + sw64(tok, (c & 3) * 16), src + g * 16, 16);
    }
    if (tid < 32)
      cp_async16(sbase + OFF_KS + st * KS_BYTES + tid * 16,
                 p.kvs + static_cast<long long>(page) * p.kvs_page_stride + tid * 4, 16);
  };
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) load_tile(s);
    cp_async_commit();
  }

  // ---- this thread's two rows (accumulator layout: rows 16warp + lane/4 and +8) ----
  const int r0 = warp * 16 + (lane >> 2);
  float sq_lat[2], sq_rope[2];
  int lim[2];  // absolute token limit: row sees positions < lim
  row_setup(p, b, rb, ROWS, r0, seqlen, end, sq_lat, sq_rope, lim);

  // transpose roles: warp w of WG g moves latent channels 256g + 64w .. +63 (K block 4g + w), 8x8 byte blocks
  // (8 channels cg8 x 8 tokens tg); lane bits chosen so that a warp's 8-byte loads and stores hit each bank
  // at most twice (2 wavefronts, the minimum for 256 B).
  const int kblk = wg * 4 + warp;

  // O lives in fp32 registers, not in a wgmma accumulator: each tile's P'V goes into a fresh accumulator (64 x 128
  // per half) that is added to O with the softmax rescale (O = O * alpha + PV). Accumulating O across all tiles
  // inside the FP8 wgmma accumulator loses precision (Hopper's FP8 MMA adds into the accumulator with ~14-bit
  // alignment): measured on the H200, 4.5% error at 4k tokens per CTA against 1.2% with per-tile promotion.
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float cmax = 0.f;  // largest latent (V) scale so far: O is in units of cmax / 448
  float* red_max = reinterpret_cast<float*>(smem + OFF_MAX);

  for (int it = 0; it < ntiles; ++it) {
    const int st = it % NST, vb = it & 1;
    const int n0 = start + it * PAGE;
    const int nvalid = min(end - n0, PAGE);

    cp_async_wait<NST - 2>();  // tile `it` (and Q) landed for this thread's copies
    fence_proxy_async();       // cp.async wrote through the generic proxy; wgmma reads through the async one
    __syncthreads();           // (A) ... for everybody's copies; iteration it-1 is done with its K stage
    // (ablation NO_LOAD: no tile after the first NST, the stages keep tiles 0 .. NST-1; the groups still commit)
    if (it + NST - 1 < ntiles && (!MLA_ABLATE_NO_LOAD || it + NST - 1 < NST)) load_tile(it + NST - 1);
    cp_async_commit();

    // ---- S = Q K^T (async) ----
    float s_lat[16], s_rope[16];
    {
      const uint32_t qa = sbase + OFF_Q;
      const uint32_t ka = sbase + OFF_K + st * TILE_BYTES + wg * 2048;  // token rows 32wg..32wg+31
      if constexpr (MLA_ABLATE_NO_QK) {  // ablation: no QK^T wgmmas, the softmax reads O's registers as S
        stand_in<16>(s_lat, o);
        stand_in<16>(s_rope, o + 16);
      } else {
        issue_qk<wgmma_m64n32k32_e4m3>(s_lat, s_rope, qa, ka, KB_BYTES);
      }
    }

    // ---- V^T: this warp's 64 channels x 64 tokens, while the QK^T wgmmas run ----
    if constexpr (!MLA_ABLATE_NO_TRANSPOSE)  // ablation: the P'V wgmmas read stale V^T
      transpose_v<2>(smem + OFF_K + st * TILE_BYTES + kblk * KB_BYTES, smem + OFF_VT + vb * VT_BYTES,
                     wg * 256 + warp * 64, nvalid, lane);

    float alpha[2];  // O's rescale for this tile
    if constexpr (MLA_ABLATE_NO_SOFTMAX) {  // ablation: P' = e4m3(S); the row max exchange's store + barrier stay
      wgmma_wait<0>();
      fence_regs<16>(s_lat);
      fence_regs<16>(s_rope);
      if (q4 == 0) red_max[wg * ROWS + r0] = s_lat[0];
      named_barrier(1 + warp, 64);
      uint8_t* pt = smem + OFF_P + vb * P_BYTES;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int e = j * 4 + h * 2;
          *reinterpret_cast<uint16_t*>(pt + sw64(r0 + 8 * h, wg * 32 + 8 * j + 2 * q4)) =
              to_e4m3x2(s_lat[e] + s_rope[e], s_lat[e + 1] + s_rope[e + 1]);
        }
      alpha[0] = sq_lat[0];  // not a constant: the merge stays an FFMA
      alpha[1] = sq_lat[1];
    } else {
      // ---- largest valid V scale of the tile (every warp computes the same value) ----
      const float* ksc = reinterpret_cast<const float*>(smem + OFF_KS + st * KS_BYTES);
      float ct = fmaxf(lane < nvalid ? ksc[lane * 2] : 0.f, lane + 32 < nvalid ? ksc[(lane + 32) * 2] : 0.f);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ct = fmaxf(ct, __shfl_xor_sync(0xffffffffu, ct, off));
      const float c_new = fmaxf(fmaxf(cmax, ct), 1e-30f);

      wgmma_wait<0>();  // S of this tile
      fence_regs<16>(s_lat);
      fence_regs<16>(s_rope);

      // ---- scores (log2 units), masked ----
      float kl[8];  // latent scale of this thread's 8 tokens (token 8j + 2q4 + c of the WG's 32)
      float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = wg * 32 + 8 * j + 2 * q4;
        const float4 ks4 = *reinterpret_cast<const float4*>(ksc + n * 2);  // (lat n, rope n, lat n+1, rope n+1)
        kl[2 * j] = ks4.x;
        kl[2 * j + 1] = ks4.z;
        score_pair(s_lat, s_rope, j * 4, ks4, sq_lat, sq_rope, n0 + n, lim, mt);
      }
      // row max: the quad, then the other WG's warp holding the same rows
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 1));
        mt[h] = fmaxf(mt[h], __shfl_xor_sync(0xffffffffu, mt[h], 2));
        if (q4 == 0) red_max[wg * ROWS + r0 + 8 * h] = mt[h];
      }
      named_barrier(1 + warp, 64);
      float m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float other = red_max[(wg ^ 1) * ROWS + r0 + 8 * h];
        const float m_new = fmaxf(m[h], fmaxf(mt[h], other));
        m_use[h] = m_new == -INFINITY ? 0.f : m_new;
        alpha[h] = ex2(m[h] - m_use[h]);  // m = -inf -> 0
        m[h] = m_new;
      }

      // ---- P = exp2(S - m); l from fp32 P; P' = P s_v / c * 448 -> e4m3 P tile ----
      {
        const float vs = 448.f / c_new;
        uint8_t* pt = smem + OFF_P + vb * P_BYTES;
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int n = wg * 32 + 8 * (i >> 1) + 2 * q4 + (i & 1);
          f[i] = n < nvalid ? kl[i] * vs : 0.f;  // scales past the end may be NaN
        }
        float ls[2] = {0.f, 0.f};
        if constexpr (MLA_VT_LDSM_PAIRED) {  // tokens 16c + 2q4 + e and + 8 share a b16 at 16c + pv_k_pos(2q4 + e)
#pragma unroll
          for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              uint16_t pk2[2];
              paired_p(s_lat, 2 * c * 4 + h * 2, m_use[h], f + 4 * c, ls[h], pk2);
              const int r = r0 + 8 * h;
              *reinterpret_cast<uint16_t*>(pt + sw64(r, wg * 32 + 16 * c + pv_k_pos(2 * q4))) = pk2[0];
              *reinterpret_cast<uint16_t*>(pt + sw64(r, wg * 32 + 16 * c + pv_k_pos(2 * q4 + 1))) = pk2[1];
            }
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int e = j * 4 + h * 2;
              const float p0 = ex2(s_lat[e] - m_use[h]), p1 = ex2(s_lat[e + 1] - m_use[h]);
              ls[h] += p0 + p1;
              const int r = r0 + 8 * h;
              *reinterpret_cast<uint16_t*>(pt + sw64(r, wg * 32 + 8 * j + 2 * q4)) =
                  to_e4m3x2(p0 * f[2 * j], p1 * f[2 * j + 1]);
            }
        }
        const float cr = cmax / c_new;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          l[h] = l[h] * alpha[h] + ls[h];
          alpha[h] *= cr;
        }
        cmax = c_new;
      }
    }

    fence_proxy_async();  // P and V^T were written by ordinary stores; wgmma reads them through the async proxy
    __syncthreads();      // (B) both halves of P, and V^T, complete

    // ---- O = O * alpha + P' V^T, in two halves of 128 channels (fresh fp32 accumulator per tile) ----
    {
      const uint32_t pa = sbase + OFF_P + vb * P_BYTES;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t va = sbase + OFF_VT + vb * VT_BYTES + wg * 16384 + half * 8192;  // channel rows 256wg+128half..
        if constexpr (MLA_ABLATE_NO_MERGE) {  // ablation: P'V accumulates straight into O, no rescale (or none: NO_PV)
          if constexpr (!MLA_ABLATE_NO_PV) pv_half<true>(o + half * 64, pa, va);
        } else {
          float acc[64];
          if constexpr (MLA_ABLATE_NO_PV)
            stand_in<64>(acc, o + half * 64);  // ablation: no P'V wgmmas, the merge below still runs
          else
            pv_half(acc, pa, va);
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            float* oj = o + half * 64 + j * 4;
            oj[0] = fmaf(oj[0], alpha[0], acc[j * 4 + 0]);
            oj[1] = fmaf(oj[1], alpha[0], acc[j * 4 + 1]);
            oj[2] = fmaf(oj[2], alpha[1], acc[j * 4 + 2]);
            oj[3] = fmaf(oj[3], alpha[1], acc[j * 4 + 3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: l summed over the two WGs, O / l, lse ----
  float* red_sum = reinterpret_cast<float*>(smem + OFF_SUM);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    if (q4 == 0) red_sum[wg * ROWS + r0 + 8 * h] = l[h];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const int gr = rb * ROWS + r;
    if (gr >= p.num_rows) continue;
    const float lt = red_sum[r] + red_sum[ROWS + r];
    const bool has = lt > 0.f;
    const float inv = cmax / (448.f * lt);  // only used when has (O is undefined when no tile ran)
    const float lse = has ? (m[h] + __log2f(lt)) * 0.6931471805599453f : -INFINITY;
    store_row(p, o, h, b, gr, sp, wg, q4, has, inv, lse);
  }
}

}  // namespace mla_fp8_sm90

MLA_FP8_DEFINE_ENTRY_POINTS(mla_fp8_sm90::mla_fp8_decode_kernel, mla_fp8_sm90::THREADS, mla_fp8_sm90::SMEM_BYTES, mla_fp8_sm90::ROWS)
