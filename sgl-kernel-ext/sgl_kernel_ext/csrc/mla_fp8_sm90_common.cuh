// Shared by the FP8 MLA decode kernels (mla_fp8_decode_sm90.cu, _v2.cu, _v3.cu): the launch parameters, the
// MLA-specific device pieces (cp.async, named barriers, exp2, e4m3 packing, the byte-permute 4x4 transpose, the V
// transpose, the QK and PV issue helpers) and the host launcher behind each version's extern "C" entry. The
// generic Hopper wrappers (swizzle layout, wgmma, mbarriers, setmaxnreg, the tensor-map encoder): sm90_ptx.cuh.
#pragma once
#include <cuda.h>  // CUtensorMap (MLA_TMA_LOAD); no libcuda link: the encoder comes from the runtime
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "mla_fp8_trace.cuh"
#include "sm90_ptx.cuh"

// Ablation switches (nvcc -DMLA_ABLATE_X; all 0 by default): each removes one part of the split kernel's work while
// keeping every barrier arrival and wait, so that timing the build says what that part costs. Results are wrong by
// design. Both kernels read them with `if constexpr`, so the ablated code is type-checked in the default build too.
// What each removes exactly: the "Ablations" paragraph of mla_fp8_decode_sm90_v2.cu's header.
#ifndef MLA_ABLATE_NO_TRANSPOSE
#define MLA_ABLATE_NO_TRANSPOSE 0
#endif
#ifndef MLA_ABLATE_NO_SOFTMAX
#define MLA_ABLATE_NO_SOFTMAX 0
#endif
#ifndef MLA_ABLATE_NO_PV
#define MLA_ABLATE_NO_PV 0
#endif
#ifndef MLA_ABLATE_NO_QK
#define MLA_ABLATE_NO_QK 0
#endif
#ifndef MLA_ABLATE_NO_LOAD
#define MLA_ABLATE_NO_LOAD 0
#endif
#ifndef MLA_ABLATE_NO_MERGE
#define MLA_ABLATE_NO_MERGE 0
#endif
#ifndef MLA_ABLATE_EMPTY
#define MLA_ABLATE_EMPTY 0
#endif
// How transpose_v builds V^T (and so the k order of P'V). The default since session 27: ldmatrix.x4 + prmt +
// stmatrix.x4.trans (b16), each b16 of V^T (and of P') pairing tokens l and l + 8 of a 16-token chunk, so an
// ldmatrix phase reads 8 consecutive tokens: 80 instructions per lane and 64 x 64 block, no bank conflicts
// (measured 2-4% faster than MLA_VT_PRMT on the H200 at 16 x 4k, 64 x 4k and 128 x 16k, both versions:
// benchmark/results/mla_decode/mla_vt_options_ablation_h200.json). Design options (mla_decode_cuda.DESIGN_OPTIONS),
// the forms it replaced, all bit-identical to each other; their P'V sums run in the other k order (tokens 2l, 2l + 1
// per b16), so they are close to the default's results, not bit-identical (REORDERING_OPTIONS):
//   MLA_VT_PRMT           8-byte loads, prmt, 8-byte stores, the default until session 26 (128 instructions; stores
//                         2-way conflicted: about 2.1 M of the 2.3 M bank conflicts ncu counted for v2 at 64 x 4k)
//   MLA_VT_STORE_SWIZZLE  the same, lanes with bit 1 set storing channel c ^ 2 (first-stage selectors swapped):
//                         conflict-free stores, the same instructions
//   MLA_VT_LDSM           ldmatrix / stmatrix with tokens 2l, 2l + 1 paired: 80 instructions, loads 2-way conflicted
// benchmark/kernels/vt_transpose_model.py checks every form byte for byte and counts its wavefronts.
#ifndef MLA_VT_STORE_SWIZZLE
#define MLA_VT_STORE_SWIZZLE 0
#endif
#ifndef MLA_VT_PRMT
#define MLA_VT_PRMT MLA_VT_STORE_SWIZZLE
#endif
#ifndef MLA_VT_LDSM
#define MLA_VT_LDSM 0
#endif
#define MLA_VT_LDSM_PAIRED (!MLA_VT_PRMT && !MLA_VT_LDSM)  // the default form

// K tile loads, version 2 (v1 has no loader warpgroup and forces MLA_CP_ASYNC_LOAD): by default one loader thread
// fetches each K tile with 9 TMA box copies (64 tokens x 64 bytes, SWIZZLE_64B: the same bytes at the same places
// as sw64) and its scales with one bulk copy, counted by the mbarrier's transaction bytes. Design option
// MLA_CP_ASYNC_LOAD keeps the earlier loader: 2304 + 32 cp.async of 16 bytes over the 128 loader threads. The
// results are bit-identical. Why TMA (H200, 2026-12-02, mla_decode/mla_tma_load_ablation_h200.json): the cp.async
// loader cost 5.7-9.0% of v2's time (64 x 4k: 171.0 us against 156.2 with TMA and 154.8 with no loads at all).
#ifndef MLA_CP_ASYNC_LOAD
#define MLA_CP_ASYNC_LOAD 0
#endif
#define MLA_TMA_LOAD (!MLA_CP_ASYNC_LOAD)

// The per-tile merge of version 2 (v1 has its own and ignores this): lazy rescaling of O, the default since session
// 28. O keeps its reference (M, C) until a tile's row max exceeds it by more than 2^8 or its V-scale max by more
// than 256x, so almost every merge is O = fma(acc, beta, O) (beta up to 2^16: fp32 has the range), and O is
// rescaled, warp by warp, only when the reference moves. Each WG ends with its own reference, which its own epilogue
// uses, so the two WGs need not agree on it. Design option MLA_EAGER_RESCALE keeps the earlier merge, which rescaled
// O to the new running maxima on every tile, O = O * alpha + acc * beta (an FMUL and an FFMA per element of O: 256
// per thread per tile, half the FP32 instructions of a round); the same arithmetic up to fp32 rounding
// (ROUNDING_OPTIONS). Measured as an option on the H200 (2026-12-02, mla_decode/mla_lazy_rescale_ablation_h200.json):
// lazy 3.7-4.9% faster (64 x 4k 155.4 -> 147.8 us, 128 x 16k 1093.7 -> 1044.0, 16 x 4k 57.4 -> 55.2).
#ifndef MLA_EAGER_RESCALE
#define MLA_EAGER_RESCALE 0
#endif
#define MLA_LAZY_RESCALE (!MLA_EAGER_RESCALE)
constexpr float MLA_LAZY_MAX_STEP = 8.f;      // log2 units: a row max may run this far above O's reference
constexpr float MLA_LAZY_SCALE_STEP = 256.f;  // a V-scale max may run this many times above O's reference

// Version 2 quantizes Q inside the split kernel (MLA_FUSED_Q, the default since session 29; v1 ignores it): the caller
// passes the bf16 Q rows ([B * q_len * heads, 576], contiguous) in place of q8, no qs, and the two math warpgroups
// quantize their block's 64 rows into shared memory while the loader's first K tiles are in flight: four threads
// per row, the same arithmetic as the Triton pre-pass (mla_decode._quant_rows_kernel: row maxima of |x| over the
// latent and rope parts, scale = max / 448 by div.full.f32, x / scale by div.full.f32, clamp to +-448,
// cvt.rn.satfinite.e4m3x2), so the results are bit-identical. Each KV split of a row block quantizes its rows again
// (from L2). Design option MLA_PREPASS_Q keeps the pre-pass (a launch of its own that writes FP8 Q and two scales
// per row, which the loader copies). Measured as an option (H100, 2026-12-02, mla_decode/mla_fused_q_ablation_h100.json,
// 128 heads): fused 1.4-4.0% faster at batch 16-128 (64 x 4k 151.4 -> 145.3 us), 2.9% slower at batch 1 x 4k (32
// splits each quantizing the rows again: 26.2 -> 26.9 us), where the backend runs version 1.
#ifndef MLA_PREPASS_Q
#define MLA_PREPASS_Q 0
#endif
#define MLA_FUSED_Q (!MLA_PREPASS_Q)
// Design option MLA_SPLIT_Q (versions 2 and 3, with MLA_FUSED_Q; session 31, the backend's default since 32): with
// p.q_rope set, the kernel reads a query row's 512 latent channels from p.q8 and its 64 rope channels from p.q_rope,
// each at its own (sequence, head) byte strides, instead of one 1152-byte row: SGLang hands backends in its
// FORWARD_ABSORB_CORE_ATTENTION_BACKENDS list the two parts separately, so the torch.cat it does for the others (1.1
// ms of a 33.9 ms dsv3-ep16-slice step at batch 48 x 4k) is not needed. q_len 1 only (row = head).
#ifndef MLA_SPLIT_Q
#define MLA_SPLIT_Q 0
#endif

namespace mla_fp8_common {
using namespace sm90;  // the PTX wrappers (sm90_ptx.cuh)

struct Params {
  const uint8_t* q8;
  const float* qs;
  const uint8_t* kv;
  const float* kvs;
  const int* block_table;
  const int* seqlens;
  const int* splits;  // nullable: the split count to cut sequences into (<= num_splits, the grid's), read at run time
  __nv_bfloat16* out;
  float* lse;
  float* op;
  float* lp;
  long long kv_page_stride;   // bytes between pages (tokens 576 B apart, channels contiguous)
  long long kvs_page_stride;  // floats between pages of the scales (tokens 2 floats apart)
  long long bt_stride;
  long long out_sb, out_st, out_sh;  // elements
  long long lse_sb, lse_st;
  long long op_sb, op_sr, op_ss;
  long long lp_sb, lp_sr;
  int num_heads, num_rows, q_len, num_splits, causal;
  float qk_scale;  // softmax_scale * log2(e)
#if MLA_TMA_LOAD
  CUtensorMap kv_map;  // the cache as [pages][64 tokens][576 bytes], boxes of 64 tokens x 64 bytes, SWIZZLE_64B
#endif
  // MLA_SPLIT_Q: nullable rope part of the bf16 Q rows, and both parts' byte strides by sequence and head
  const uint8_t* q_rope;
  long long q_sb, q_sh, qr_sb, qr_sh;
};

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Ablations: stand-in values for a removed wgmma's accumulator, copied from live registers (O) so that neither nvcc
// nor ptxas can fold the code consuming them (an empty asm fence is gone by the time ptxas sees the PTX)
template <int N>
__device__ __forceinline__ void stand_in(float* r, const float* live) {
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = live[i];
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// two fp32 -> two e4m3 (round to nearest even, saturating): lo -> byte 0, hi -> byte 1
__device__ __forceinline__ uint16_t to_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Byte position, inside the 16-byte chunk of its token, of token l (0..15) in P' and V^T: in the default (paired)
// form tokens l and l + 8 (l < 8) form one b16 pair, at 2l and 2l + 1; l with the MLA_VT_PRMT / _LDSM options.
__device__ __forceinline__ constexpr int pv_k_pos(int l) {
  return MLA_VT_LDSM_PAIRED ? (l < 8 ? 2 * l : 2 * (l - 8) + 1) : l;
}

// The paired form's softmax step for one row and two 8-token groups of S (accumulator indices ea, ea + 1: tokens
// 2q4, 2q4 + 1 of group a; ea + 4, ea + 5: the same of group b, 8 tokens later): P = exp2(S - m) added to ls in
// the default's order, and the two P' b16 for bytes pv_k_pos(2q4) and pv_k_pos(2q4 + 1) of the chunk (a token with
// its + 8 partner). f: the V-scale factors of (a, 2q4), (a, 2q4 + 1), (b, 2q4), (b, 2q4 + 1).
__device__ __forceinline__ void paired_p(const float* s, int ea, float m, const float* f, float& ls, uint16_t* pk2) {
  const float pa0 = ex2(s[ea] - m), pa1 = ex2(s[ea + 1] - m), pb0 = ex2(s[ea + 4] - m), pb1 = ex2(s[ea + 5] - m);
  ls += pa0 + pa1;
  ls += pb0 + pb1;
  pk2[0] = to_e4m3x2(pa0 * f[0], pb0 * f[2]);
  pk2[1] = to_e4m3x2(pa1 * f[1], pb1 * f[3]);
}

// 4 8x8 b16 matrices: lanes 8j..8j+7 give the 16-byte row addresses of matrix j; lane t gets word t % 4 of row t / 4
__device__ __forceinline__ void ldsm_x4(uint32_t saddr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr) : "memory");
}

// the transposes of 4 8x8 b16 matrices held as ldsm_x4 returns them: lane 8m + k gives the address of stored row k
// of matrix m, which receives column k (b16) of the 8 rows
__device__ __forceinline__ void stsm_x4_trans(uint32_t saddr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :: "r"(saddr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// 4x4 byte transpose: x[i] byte j -> y[j] byte i. sa/sb (first stage) swap the rows of each input pair when the
// caller loaded them swapped; ta/tb (second stage) swap the outputs of each pair (y0<->y1, y2<->y3).
__device__ __forceinline__ void transpose4(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3, uint32_t sa,
                                           uint32_t sb, uint32_t ta, uint32_t tb, uint32_t* y) {
  const uint32_t t0 = prmt(x0, x1, sa), t1 = prmt(x0, x1, sb);
  const uint32_t t2 = prmt(x2, x3, sa), t3 = prmt(x2, x3, sb);
  y[0] = prmt(t0, t2, ta);
  y[1] = prmt(t0, t2, tb);
  y[2] = prmt(t1, t3, ta);
  y[3] = prmt(t1, t3, tb);
}

// arrive on `bar` once all of this thread's earlier cp.async copies have landed (count pre-set in the init: .noinc)
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

#if MLA_TMA_LOAD
// one SW64 K block of a tile: bytes 64 kb .. 64 kb + 63 of the 64 tokens of `page`, by TMA (completes on bar)
__device__ __forceinline__ void tma_kv_block(uint32_t dst, const CUtensorMap* map, int kb, int page, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(64 * kb), "r"(0), "r"(page), "r"(bar)
      : "memory");
}
// `bytes` contiguous bytes (multiple of 16, both addresses 16-byte aligned) by the bulk copy engine
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
#endif


// ---- pieces of the kernels' bodies that both versions share ----------------------------------------------------

// Whether this launch writes bf16 out and lse itself (one split in the grid) rather than fp32 partials for the combine.
__device__ __forceinline__ bool writes_out(const Params& p) { return p.num_splits == 1; }

// This CTA's token range [start, end) of sequence b for split sp, cut as _mla_fp8_combine_kernel does with
// BLOCK_N = page (split lengths rounded up to whole pages). False: the split holds no token (the combine kernel
// reads only splits that do). With p.splits (a CUDA graph replayed at lengths its capture did not know) the
// sequences are cut into that many splits, at most the grid's; the CTAs past them hold no token.
__device__ __forceinline__ bool split_range(const Params& p, int b, int sp, int page, int& seqlen, int& start,
                                            int& end) {
  seqlen = p.seqlens[b];
  start = 0;
  end = seqlen;
  if (p.num_splits > 1) {
    const int splits = p.splits ? min(max(*p.splits, 1), p.num_splits) : p.num_splits;
    const int split_len = cdiv(cdiv(seqlen, splits), page) * page;
    start = sp * split_len;
    end = min(start + split_len, seqlen);
  }
  return start < end || p.num_splits == 1;  // an unsplit launch writes an empty sequence's rows too (zeros, -inf)
}

// Row constants of this thread's two accumulator rows (r0, r0 + 8 of row block rb): the Q scales times the
// softmax scale, and the causal token limit (a row sees positions < lim; rows past q_len x heads see none).
// cta_qs: the block's own (latent, rope) scale pairs by row within it (v2's MLA_FUSED_Q: shared memory), else
// nullptr: the Q pre-pass's, p.qs.
__device__ __forceinline__ void row_setup(const Params& p, int b, int rb, int rows_per_cta, int r0, int seqlen,
                                          int end, float* sq_lat, float* sq_rope, int* lim,
                                          const float* cta_qs = nullptr) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = rb * rows_per_cta + r0 + 8 * h;
    if (gr < p.num_rows) {
      const float* qs = cta_qs != nullptr ? cta_qs + (r0 + 8 * h) * 2
                                          : p.qs + (static_cast<long long>(b) * p.num_rows + gr) * 2;
      sq_lat[h] = qs[0] * p.qk_scale;
      sq_rope[h] = qs[1] * p.qk_scale;
      const int t = gr / p.num_heads;
      const int row_end = p.causal ? seqlen - p.q_len + 1 + t : seqlen;
      lim[h] = min(row_end, end);
    } else {
      sq_lat[h] = 0.f;
      sq_rope[h] = 0.f;
      lim[h] = -2147483647;
    }
  }
}

// Scores of one token pair in log2 units, masked: this thread's accumulator entries e0 .. e0 + 3 (rows h = 0, 1 x
// tokens tok, tok + 1) scaled by the rows' Q scales and the tokens' KV scales ks4 = (lat tok, rope tok, lat tok+1,
// rope tok+1), written back into s_lat, and folded into the row maxima mt. A select, not a multiply, masks tokens
// at or past lim, so NaN read past a sequence's end is dropped.
__device__ __forceinline__ void score_pair(float* s_lat, const float* s_rope, int e0, float4 ks4,
                                           const float* sq_lat, const float* sq_rope, int tok, const int* lim,
                                           float* mt) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int e = e0 + h * 2 + c;
      const float v =
          s_lat[e] * (sq_lat[h] * (c ? ks4.z : ks4.x)) + s_rope[e] * (sq_rope[h] * (c ? ks4.w : ks4.y));
      const float sv = (tok + c < lim[h]) ? v : -INFINITY;
      s_lat[e] = sv;
      mt[h] = fmaxf(mt[h], sv);
    }
}

// One 16-byte chunk g of the 64 x 576 Q block into its SW64 K blocks (rows past q_len x heads: zeros).
__device__ __forceinline__ void load_q_chunk(const Params& p, uint32_t q_smem, int b, int rb, int rows_per_cta,
                                             int kb_bytes, int g) {
  const int row = g / 36, c = g % 36;
  const int gr = rb * rows_per_cta + row;
  const bool ok = gr < p.num_rows;
  cp_async16(q_smem + (c >> 2) * kb_bytes + sw64(row, (c & 3) * 16),
             p.q8 + (static_cast<long long>(b) * p.num_rows + (ok ? gr : 0)) * 576 + c * 16, ok ? 16 : 0);
}

__device__ __forceinline__ float div_full(float a, float b) {  // what Triton emits for an fp32 '/' (the pre-pass's)
  float d;
  asm("div.full.f32 %0, %1, %2;\n" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
// the two bf16 of a 32-bit word as fp32: (the one at the lower address, the other)
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
// e4m3 of x / s for the 8 bf16 in w (clamped to +-448, round to nearest even), packed little-endian into 2 words
__device__ __forceinline__ uint2 quantize8(uint4 w, float s) {
  const uint32_t in[4] = {w.x, w.y, w.z, w.w};
  uint32_t h[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = bf16x2_to_float2(in[k]);
    h[k] = to_e4m3x2(fminf(fmaxf(div_full(x.x, s), -448.f), 448.f), fminf(fmaxf(div_full(x.y, s), -448.f), 448.f));
  }
  return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}
__device__ __forceinline__ float amax8(uint4 w, float m) {
  const uint32_t in[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = bf16x2_to_float2(in[k]);
    m = fmaxf(m, fmaxf(fabsf(x.x), fabsf(x.y)));
  }
  return m;
}
// MLA_FUSED_Q: thread i (0 .. 4 rows_per_cta - 1) quantizes part j = i & 3 of row r = i >> 2 of this block (lanes
// 4r .. 4r + 3 of one warp hold one row): latent channels 128 j .. 128 j + 127 and rope channels 512 + 16 j .. 512 +
// 16 j + 15, read as bf16 from p.q8 (the caller's Q rows), written as FP8 into the SW64 Q blocks (kb_bytes apart),
// and the row's scales to qs (by part 0). Rows past the last query row are zeros with scale 1, as the cp.async
// path's zero fill.
__device__ __forceinline__ void quantize_q_rows(const Params& p, uint32_t q_smem, float* qs, int b, int rb,
                                                int rows_per_cta, int kb_bytes, int i) {
  const int r = i >> 2, j = i & 3;
  const int gr = rb * rows_per_cta + r;
  const bool ok = gr < p.num_rows;
#if MLA_SPLIT_Q
  const uint4* src = reinterpret_cast<const uint4*>(
      p.q_rope ? p.q8 + b * p.q_sb + (ok ? gr : 0) * p.q_sh
               : p.q8 + (static_cast<long long>(b) * p.num_rows + gr) * 1152);
  const uint4* rsrc = p.q_rope ? reinterpret_cast<const uint4*>(p.q_rope + b * p.qr_sb + (ok ? gr : 0) * p.qr_sh)
                               : src + 64;
#else
  const uint4* src = reinterpret_cast<const uint4*>(p.q8 + (static_cast<long long>(b) * p.num_rows + gr) * 1152);
  const uint4* rsrc = src + 64;
#endif
  uint4 lat[16], rope[2];
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < 16; ++k) lat[k] = ok ? __ldg(src + 16 * j + k) : zero;  // 8 bf16 = 16 bytes per uint4
#pragma unroll
  for (int k = 0; k < 2; ++k) rope[k] = ok ? __ldg(rsrc + 2 * j + k) : zero;
  float am_l = 0.f, am_r = 0.f;
#pragma unroll
  for (int k = 0; k < 16; ++k) am_l = amax8(lat[k], am_l);
#pragma unroll
  for (int k = 0; k < 2; ++k) am_r = amax8(rope[k], am_r);
  am_l = fmaxf(am_l, __shfl_xor_sync(0xffffffffu, am_l, 1));
  am_l = fmaxf(am_l, __shfl_xor_sync(0xffffffffu, am_l, 2));
  am_r = fmaxf(am_r, __shfl_xor_sync(0xffffffffu, am_r, 1));
  am_r = fmaxf(am_r, __shfl_xor_sync(0xffffffffu, am_r, 2));
  const float s_l = am_l > 0.f ? div_full(am_l, 448.f) : 1.f;
  const float s_r = am_r > 0.f ? div_full(am_r, 448.f) : 1.f;
#pragma unroll
  for (int k = 0; k < 9; ++k) {  // 16-byte FP8 chunk c of the row: channels 16 c .. 16 c + 15
    const int c = k < 8 ? 8 * j + k : 32 + j;
    const uint2 a = k < 8 ? quantize8(lat[2 * k], s_l) : quantize8(rope[0], s_r);
    const uint2 d = k < 8 ? quantize8(lat[2 * k + 1], s_l) : quantize8(rope[1], s_r);
    const uint32_t dst = q_smem + (c >> 2) * kb_bytes + sw64(r, (c & 3) * 16);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a.x), "r"(a.y), "r"(d.x), "r"(d.y)
                 : "memory");
  }
  if (j == 0) {
    qs[2 * r] = s_l;
    qs[2 * r + 1] = s_r;
  }
}

// Write one accumulator row half (h: row r0 + 8h) of this warpgroup's 256 output channels, O * inv, and its lse:
// bf16 out when there is one split, else the fp32 partial and lse in the layout _mla_fp8_combine_kernel reads.
// has = false (the row saw no token) writes zeros and lse = -inf.
__device__ __forceinline__ void store_row(const Params& p, const float* o, int h, int b, int gr, int sp, int wg,
                                          int q4, bool has, float inv, float lse) {
  if (writes_out(p)) {
    const int t = gr / p.num_heads, hd = gr % p.num_heads;
    __nv_bfloat16* orow = p.out + b * p.out_sb + t * p.out_st + hd * p.out_sh + wg * 256 + 2 * q4;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<__nv_bfloat162*>(orow + 8 * j) =
          __floats2bfloat162_rn(has ? o[j * 4 + h * 2] * inv : 0.f, has ? o[j * 4 + h * 2 + 1] * inv : 0.f);
    if (wg == 0 && q4 == 0) p.lse[b * p.lse_sb + t * p.lse_st + hd] = lse;
  } else {
    float* orow = p.op + b * p.op_sb + gr * p.op_sr + sp * p.op_ss + wg * 256 + 2 * q4;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<float2*>(orow + 8 * j) =
          make_float2(has ? o[j * 4 + h * 2] * inv : 0.f, has ? o[j * 4 + h * 2 + 1] * inv : 0.f);
    if (wg == 0 && q4 == 0) p.lp[b * p.lp_sb + gr * p.lp_sr + sp] = lse;
  }
}

// Bits 4-8 of an SW64 offset that depend only on row & 7 = i when the lane's own row group and 16-byte chunk are
// folded into a per-lane offset: (i << 6) | (i >> 1) << 4, XORed into it (transpose_v's unrolled loads and stores).
__device__ __forceinline__ constexpr uint32_t sw64_unrolled_bits(int i) { return (i << 6) | ((i >> 1) << 4); }

// ---------------------------------------------------------------------------------------------------------------
// V^T for one warp: 64 channels (K block kblk of the K tile = channels 64 kblk .. +63) x 64 tokens, written as
// rows dloc0 .. dloc0+63 (dloc0 a multiple of 8) of a V^T buffer (channel rows x 64 token bytes, SW64), in the
// form the macros above select. Loop unrolling is the caller's. Tokens >= nvalid are written as zeros (their cache
// bytes may be NaN and 0 x NaN poisons the MMA). The ldmatrix forms (the default, MLA_VT_LDSM) XOR into the shared
// addresses themselves, so they also need ksrc and vdst 64-byte aligned (the kernels' K blocks and V^T buffers are 4 KB
// multiples from a 1 KB aligned base).
// ---------------------------------------------------------------------------------------------------------------
template <int REP_UNROLL>
__device__ __forceinline__ void transpose_v(const uint8_t* ksrc, uint8_t* vdst, int dloc0, int nvalid, int lane) {
  if constexpr (!MLA_VT_PRMT) {
    // per 16 tokens (tb) x 32 channels (cb): ldmatrix.x4 of the first / second token of each pair (2i, 2i + 1; or
    // i, i + 8 in the paired form) of two 16-byte channel chunks, prmt interleaves each lane's two token bytes
    // into b16 token pairs, stmatrix.trans writes each channel's 16 tokens as one 16-byte V^T row. Lanes with
    // t % 4 >= 2 swap the interleave selectors (their channels 4q+2, +3 go to the even matrices), so that the 8 rows
    // of each stored matrix are 8 distinct channels mod 8: conflict-free. Row addresses: lane base + / ^ the unrolled
    // terms (vt_transpose_model.py: ldsm_lane_base, stsm_lane_base).
    const int i = lane & 7, j = lane >> 3, q = lane & 3, pair = lane >> 2;
    const uint32_t ld_base = smem_u32(ksrc) + (MLA_VT_LDSM_PAIRED
        ? (j & 1) * 512 + i * 64 + ((((j >> 1) ^ (i >> 1)) & 3) << 4)
        : (i >> 2) * 512 + (2 * (i & 3) + (j & 1)) * 64 + (((j >> 1) ^ (i & 3)) << 4));
    const int tok_a = MLA_VT_LDSM_PAIRED ? pair : 2 * pair;  // this lane's pair: tokens tok_a, tok_b of the chunk
    const int tok_b = MLA_VT_LDSM_PAIRED ? pair + 8 : 2 * pair + 1;
    const int qq = i >> 1, half = (j & 1) ^ (qq >> 1), d7 = 4 * (qq & 1) + 2 * half + (i & 1);
    const uint32_t st_base =
        smem_u32(vdst) + ((dloc0 >> 3) + 2 * (j >> 1) + (qq >> 1)) * 512 + d7 * 64 + ((d7 >> 1) << 4);
    const uint32_t s_lo = q >= 2 ? 0x7362u : 0x5140u, s_hi = q >= 2 ? 0x5140u : 0x7362u;
#pragma unroll
    for (int tb = 0; tb < 4; ++tb) {
      const bool ok_a = 16 * tb + tok_a < nvalid, ok_b = 16 * tb + tok_b < nvalid;
#pragma unroll
      for (int cb = 0; cb < 2; ++cb) {
        uint32_t r[4];
        ldsm_x4((ld_base + 1024 * tb) ^ (cb << 5), r);
        const uint32_t a0 = ok_a ? r[0] : 0u, b0 = ok_b ? r[1] : 0u;
        const uint32_t a1 = ok_a ? r[2] : 0u, b1 = ok_b ? r[3] : 0u;
        stsm_x4_trans((st_base + 2048 * cb) ^ (tb << 4), prmt(a0, b0, s_lo), prmt(a0, b0, s_hi), prmt(a1, b1, s_lo),
                      prmt(a1, b1, s_hi));
      }
    }
    return;
  }
  const int cg8 = lane & 7;
  const int xsw = (lane >> 3) & 1;  // this lane loads rows i ^ 1 (row-pair order swapped)
  const int zsw = lane & 1;         // this lane stores channels c ^ 1
  const int flip = MLA_VT_STORE_SWIZZLE ? lane & 2 : 0;  // ... and c ^ 2 (its first-stage selectors swapped)
  const uint32_t sel_lo = xsw ? 0x1504u : 0x5140u, sel_hi = xsw ? 0x3726u : 0x7362u;
  const uint32_t sel_a = flip ? sel_hi : sel_lo, sel_b = flip ? sel_lo : sel_hi;
  const uint32_t sel_c = zsw ? 0x7632u : 0x5410u, sel_d = zsw ? 0x5410u : 0x7632u;
#pragma unroll REP_UNROLL
  for (int rep = 0; rep < 2; ++rep) {
    const int tg = xsw | (((lane >> 4) & 1) << 1) | ((((lane >> 2) & 1) ^ rep) << 2);  // token group
    // token row k = i ^ xsw of group tg, channel bytes 8 cg8 .. +7 (SW64): as for the stores below, bits 4-8 of the
    // offset are sw64_unrolled_bits(i) XOR this lane's, the other bits this lane's
    const uint32_t lane_ld = (tg * 512 + (cg8 & 1) * 8) | (xsw << 6) | (((cg8 >> 1) & 3) << 4);
    uint32_t lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int k = i ^ xsw;  // token row within the group held in slot i
      const uint2 v = *reinterpret_cast<const uint2*>(ksrc + (lane_ld ^ sw64_unrolled_bits(i)));
      const bool ok = tg * 8 + k < nvalid;
      lo[i] = ok ? v.x : 0u;
      hi[i] = ok ? v.y : 0u;
    }
    uint32_t tlo[8], thi[8];  // [channel slot] tokens 0..3 / 4..7
    transpose4(lo[0], lo[1], lo[2], lo[3], sel_a, sel_b, sel_c, sel_d, tlo);
    transpose4(lo[4], lo[5], lo[6], lo[7], sel_a, sel_b, sel_c, sel_d, thi);
    transpose4(hi[0], hi[1], hi[2], hi[3], sel_a, sel_b, sel_c, sel_d, tlo + 4);
    transpose4(hi[4], hi[5], hi[6], hi[7], sel_a, sel_b, sel_c, sel_d, thi + 4);
    // channel slot c goes to V^T row d = dloc0 + 8 cg8 + (c ^ z), token bytes 8 tg .. +7 (SW64). Bits 4-8 of that
    // offset, (c ^ z) << 6 | ((tg >> 1) ^ ((c ^ z) >> 1)) << 4, are a constant of c XOR one of this lane's; the
    // other bits are this lane's: one XOR per store (vt_transpose_model.py checks the identity)
    const int z = zsw | flip;
    const uint32_t lane_off =
        (((dloc0 >> 3) + cg8) * 512 + (tg & 1) * 8) | (z << 6) | ((((tg >> 1) ^ (z >> 1)) & 3) << 4);
#pragma unroll
    for (int c = 0; c < 8; ++c)
      *reinterpret_cast<uint2*>(vdst + (lane_off ^ sw64_unrolled_bits(c))) = make_uint2(tlo[c], thi[c]);
  }
}

// S = Q K^T of one tile on FP8 wgmma (MMA: the m64nNk32 wrapper, N = this warpgroup's tokens): the 512 latent
// channels (8 K blocks x 2 k-steps) into s_lat and the 64 rope channels (the 9th K block) into s_rope, which carry
// different scales. qa, ka: shared addresses of the Q block and of this warpgroup's token rows of the K tile.
template <void (*MMA)(float*, uint64_t, uint64_t, int)>
__device__ __forceinline__ void issue_qk(float* s_lat, float* s_rope, uint32_t qa, uint32_t ka, int kb_bytes) {
  const uint64_t dq = desc_sw64(qa), dk = desc_sw64(ka);
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < 8; ++kb)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
      MMA(s_lat, desc_add(dq, kb * kb_bytes + ks * 32), desc_add(dk, kb * kb_bytes + ks * 32), (kb | ks) != 0);
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
    MMA(s_rope, desc_add(dq, 8 * kb_bytes + ks * 32), desc_add(dk, 8 * kb_bytes + ks * 32), ks != 0);
  wgmma_commit();
}

// acc = P' V^T for 128 of this warpgroup's channels (pa: the 64 x 64 P' tile, va: 128 V^T rows), waited for: a
// fresh accumulator per tile, which the caller adds into fp32 O (Hopper's FP8 MMA accumulates with limited precision,
// so O must not stay in a wgmma accumulator across tiles). ACCUMULATE (the MLA_ABLATE_NO_MERGE builds only):
// acc += P' V^T, O itself as the accumulator, no promotion.
template <bool ACCUMULATE = false>
__device__ __forceinline__ void pv_half(float* acc, uint32_t pa, uint32_t va) {
  const uint64_t dp = desc_sw64(pa), dv = desc_sw64(va);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
    wgmma_m64n128k32_e4m3(acc, desc_add(dp, ks * 32), desc_add(dv, ks * 32), ACCUMULATE ? 1 : ks);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs<64>(acc);
}

#if MLA_TMA_LOAD
// The tensor map of one KV buffer (host; the driver's encoder found through the runtime, so the library needs no
// libcuda link): 3-D [pages][64 tokens][576 bytes], page stride kv_page_stride bytes, box 64 bytes x 64 tokens x 1
// page with the 64-byte swizzle, i.e. one SW64 K block of one tile per copy.
inline cudaError_t encode_kv_map(CUtensorMap* map, const void* kv, long long pages, long long page_stride) {
  cudaError_t err;
  const TensorMapEncoder encode = tensor_map_encoder(&err);
  if (encode == nullptr) return err;
  if (pages <= 0 || page_stride % 16 != 0 || reinterpret_cast<uintptr_t>(kv) % 16 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[3] = {576, 64, static_cast<cuuint64_t>(pages)};
  const cuuint64_t strides[2] = {576, static_cast<cuuint64_t>(page_stride)};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, 64, 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(kv), dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}
#endif

// Host side: fill Params from the ctypes arguments (strides in elements), raise the kernel's dynamic shared
// memory limit once per device, launch on the caller's stream (CUDA-graph capture works). Returns a cudaError_t.
// attr_done is the calling library's own per-device flag (internal linkage, see MLA_FP8_DEFINE_ENTRY_POINTS):
// a static local here would be one STB_GNU_UNIQUE object shared by every library built from this header in the
// process, so after v1 set its attribute, v2 skipped its own and failed to launch ("invalid argument").
template <typename Kernel>
inline int launch(Kernel kernel, bool* attr_done, int threads, int smem_bytes, int rows_per_cta, const void* q8,
                  const void* qs,
                  const void* kv, const void* kvs, const void* block_table, const void* seqlens, void* out, void* lse,
                  void* op, void* lp, long long kv_page_stride, long long kvs_page_stride, long long bt_stride,
                  long long out_sb, long long out_st, long long out_sh, long long lse_sb, long long lse_st,
                  long long op_sb, long long op_sr, long long op_ss, long long lp_sb, long long lp_sr,
                  long long kv_pages, int batch,
                  int num_heads, int q_len, int num_splits, const void* splits, int causal, float qk_scale,
                  const void* q_rope, long long q_sb, long long q_sh, long long qr_sb,
                  long long qr_sh, void* stream) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (dev < 0 || dev >= 128) return static_cast<int>(cudaErrorInvalidDevice);
  if (!attr_done[dev]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
    attr_done[dev] = true;
  }
  if (batch <= 0) return 0;
  if (num_heads <= 0 || q_len <= 0 || num_splits <= 0 || batch > 65535 || num_splits > 65535)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p;
  p.q8 = static_cast<const uint8_t*>(q8);
  p.qs = static_cast<const float*>(qs);
  p.kv = static_cast<const uint8_t*>(kv);
  p.kvs = static_cast<const float*>(kvs);
  p.block_table = static_cast<const int*>(block_table);
  p.seqlens = static_cast<const int*>(seqlens);
  p.splits = static_cast<const int*>(splits);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.lse = static_cast<float*>(lse);
  p.op = static_cast<float*>(op);
  p.lp = static_cast<float*>(lp);
  p.kv_page_stride = kv_page_stride;
  p.kvs_page_stride = kvs_page_stride;
  p.bt_stride = bt_stride;
  p.out_sb = out_sb; p.out_st = out_st; p.out_sh = out_sh;
  p.lse_sb = lse_sb; p.lse_st = lse_st;
  p.op_sb = op_sb; p.op_sr = op_sr; p.op_ss = op_ss;
  p.lp_sb = lp_sb; p.lp_sr = lp_sr;
  p.num_heads = num_heads;
  p.num_rows = num_heads * q_len;
  p.q_len = q_len;
  p.num_splits = num_splits;
  p.causal = causal ? 1 : 0;
  p.qk_scale = qk_scale;
  p.q_rope = static_cast<const uint8_t*>(q_rope);
  p.q_sb = q_sb; p.q_sh = q_sh; p.qr_sb = qr_sb; p.qr_sh = qr_sh;
#if MLA_TMA_LOAD
  err = encode_kv_map(&p.kv_map, kv, kv_pages, kv_page_stride);
  if (err != cudaSuccess) return static_cast<int>(err);
#else
  (void)kv_pages;
#endif
  const dim3 grid((p.num_rows + rows_per_cta - 1) / rows_per_cta, num_splits, batch);
  kernel<<<grid, threads, smem_bytes, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mla_fp8_common

// The entry points each version defines with its kernel (ctypes looks these names up); the only symbols the
// library exports (it is built with -fvisibility=hidden, so two versions loaded in one process share nothing).
#define MLA_FP8_EXPORT extern "C" __attribute__((visibility("default")))
// The launch entry point's parameters (mla_decode_cuda.LAUNCH_ARGTYPES) and the same names as arguments of launch()
#define MLA_FP8_ENTRY_PARAMS                                                                                       \
  const void *q8, const void *qs, const void *kv, const void *kvs, const void *block_table, const void *seqlens,   \
      void *out, void *lse, void *op, void *lp, long long kv_page_stride, long long kvs_page_stride,               \
      long long bt_stride, long long out_sb, long long out_st, long long out_sh, long long lse_sb, long long lse_st, \
      long long op_sb, long long op_sr, long long op_ss, long long lp_sb, long long lp_sr, long long kv_pages,     \
      int batch, int num_heads, int q_len, int num_splits, const void *splits, int causal, float qk_scale,         \
      const void *q_rope, long long q_sb, long long q_sh, long long qr_sb, long long qr_sh,         \
      void *stream
#define MLA_FP8_ENTRY_ARGS                                                                                         \
  q8, qs, kv, kvs, block_table, seqlens, out, lse, op, lp, kv_page_stride, kvs_page_stride, bt_stride, out_sb,     \
      out_st, out_sh, lse_sb, lse_st, op_sb, op_sr, op_ss, lp_sb, lp_sr, kv_pages, batch, num_heads, q_len,        \
      num_splits, splits, causal, qk_scale, q_rope, q_sb, q_sh, qr_sb, qr_sh, stream
#define MLA_FP8_DEFINE_ENTRY_POINTS(KERNEL, THREADS_, SMEM_BYTES_, ROWS_)                                           \
  static bool mla_fp8_attr_done[128] = {};                                                                         \
  MLA_FP8_EXPORT int mla_fp8_decode_sm90(MLA_FP8_ENTRY_PARAMS) {                                                   \
    return mla_fp8_common::launch(KERNEL, mla_fp8_attr_done, THREADS_, SMEM_BYTES_, ROWS_, MLA_FP8_ENTRY_ARGS);   \
  }                                                                                                                \
  MLA_FP8_EXPORT const char* mla_fp8_decode_sm90_error_string(int err) {                                              \
    return cudaGetErrorString(static_cast<cudaError_t>(err));                                                      \
  }                                                                                                                \
  MLA_FP8_EXPORT int mla_fp8_decode_sm90_smem_bytes() { return SMEM_BYTES_; }                                    \
  MLA_FP8_DEFINE_TRACE_ENTRY_POINTS
