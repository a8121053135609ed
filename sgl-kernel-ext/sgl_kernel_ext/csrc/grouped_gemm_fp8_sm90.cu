// FP8 e4m3 grouped GEMM with DeepSeek's block scaling, warp-specialized for Hopper (sm_90a): the "normal" variant
// (tokens on the wgmma's M side) written by hand because the Triton one stalls where DeepGEMM does not.
//
// Why (benchmark/results/swapab/README.md, session 44): at gate_up 8 experts x 128 tokens Nsight Compute shows ours'
// Triton 128 x 64 tile reading the same DRAM bytes as DeepGEMM but keeping DRAM 62% busy against 76%: one warp group
// both issues its loads and waits at every pipeline stage's barrier. Triton's warp-specialized loop hangs on the
// H200 (config `ws`, session 23), so this kernel splits the roles itself, as the MLA decode versions 2 and 3 do.
//
// out[r, n] = sum_k A[r, k] * B[e, n, k] * sa[r, k / 128] * sb[e, n / 128, k / 128] for every row r of expert e:
//   A  [rows_total, K] e4m3 (K contiguous), the activations: contiguous layout, expert e's rows indptr[e] ..
//      indptr[e + 1]; masked layout, rows e * max_m .. e * max_m + masked_m[e]
//   sa [rows_total, K / 128] fp32 with any strides (row-major as our Triton kernels take it, or MN-major as DeepGEMM
//      takes it; masked: [E, max_m, K / 128], with a group stride)
//   B  [E, N, K] e4m3, sb [E, N / 128, K / 128] fp32, out [rows_total, N] bf16 (rows past an expert's count are not
//      written).
// A CTA of 384 threads, one per SM, walks the tiles (expert, column block, row block; rows fastest, so the CTAs
// working at one time share the expert's weight tile in L2) with a fixed stride:
//   warp group 0 (40 registers): one thread issues the TMA copies of each 128-deep K block into a ring of slots
//     (A: BM token rows x 128 bytes, B: BN weight rows x 128 bytes, 128-byte swizzled); in the staged (s) forms a
//     second warp cp.asyncs the K block's BM row scales and the tile's weight scales into the slot's scale row, so
//     the math warps issue no global load in their K loop;
//   warp groups 1 and 2 (232 registers): a 64-row part of the tile each (64 x 256: half the columns each), four
//     m64nNk32 wgmmas per K block into a scratch accumulator, then acc += scratch * sa[row] * sb in fp32 (the block
//     scales), then release the slot. The epilogue writes bf16 from registers.
// Tile forms (the launch's `form`; grouped_gemm_cuda.FORMS), what sessions 44-45 measured best (swapab/README.md;
// the forms they dropped are in sgl-kernel-ext/NOTES.md):
//   0 "64x256-pd"    64 token rows x 256 weight columns, each K block's scales loaded one block ahead by the math
//                    threads, the scratch double-buffered (d: K block kb + 1's wgmmas issued before kb's
//                    promotion): no dead half of a tile at <= 64 tokens
//   1 "128x128-ds"   128 x 128, double-buffered, scales staged: the fastest of ours at 128-256 tokens
//   2 "128x192-s"    128 x 192 (m64n192k32, 96 + 96 accumulator registers: a single scratch), scales staged:
//                    DeepGEMM's tile at these shapes; N need only be a multiple of 128 (a partial last column block,
//                    its columns past N not stored), a tile straddles two weight scale blocks
//   3 "128x192-sm"   and in clusters of two CTAs on adjacent column blocks of one (expert, row block), which share
//                    the token tile: each CTA's producer loads half its rows by TMA multicast to both (m), so a CTA
//                    reads 64 + 192 rows per K block from L2 instead of 128 + 192
//   4 "128x192-sb"   and in clusters of two CTAs on adjacent row blocks of one (expert, column block), which share
//                    the weight tile (b): each producer loads 96 of its 192 rows and multicasts them, so a CTA reads
//                    128 + 96 rows per K block. DeepGEMM's configuration at gate_up 8 x 256 (its template arguments in
//                    session 45's profile: 128 x 192, 4 stages, 2-CTA multicast with kIsTMAMulticastOnA false, i.e.
//                    on the weights; session 45 misread it as on A). An expert with an odd count of row blocks pairs
//                    its last tile with one past its rows (loaded for the peer, not computed). Session 46, unmeasured
// K and N must be multiples of 128, N of the tile's columns where those are a multiple of 128, and the column blocks
// even in number for the token-tile multicast form (DeepSeek-V3's are). Rows past the tensor's end read as zeros
// (TMA), rows of the next expert inside a tile are computed and not stored; a math warp group whose 64 rows are all
// past the expert's count only hands its slots on.
//
// Ablations (compile-time switches, off by default: grouped_gemm_cuda.ABLATIONS; benchmark/kernels/
// grouped_gemm_cuda_ablation.py times them): each removes one part of the work and keeps every barrier arrival and
// wait, so nothing hangs; the results are wrong by design.
//   -DGG_ABLATE_NO_LOAD  the loaders fill each slot once (the first STAGES K blocks of their walk), then only arrive:
//                        no HBM / L2 traffic after the first ring; what is left is the math side and the hand-offs
//   -DGG_ABLATE_NO_MMA   the math warps issue no wgmma (the promotion reads the scratch accumulator as it is)
#include <cuda_bf16.h>

#include <type_traits>

#ifndef GG_ABLATE_NO_LOAD
#define GG_ABLATE_NO_LOAD 0
#endif
#ifndef GG_ABLATE_NO_MMA
#define GG_ABLATE_NO_MMA 0
#endif

#include "sm90_ptx.cuh"

namespace grouped_gemm_sm90 {
using namespace sm90;

constexpr int BLOCK_K = 128;
constexpr int THREADS = 384;
constexpr int MAX_GROUPS = 1024;
constexpr int RING_BYTES = 200 * 1024;  // the slots' budget (an SM has 227 KB; the rest: barriers, tile table)
constexpr int LOADER_REGS = 40, MATH_REGS = 232;
constexpr int NUM_FORMS = 5;

// which operand a 2-CTA cluster shares by TMA multicast: none, the token tile (CTAs on a pair of column blocks) or
// the weight tile (CTAs on a pair of row blocks)
enum Share { SHARE_NONE = 0, SHARE_A = 1, SHARE_B = 2 };

template <int BM_, int BN_, bool DOUBLE_, bool STAGED_, int SHARE_>
struct Form {
  static_assert((BM_ == 128 && (BN_ == 128 || BN_ == 192)) || (BM_ == 64 && BN_ == 256), "two warp-group tiles");
  static constexpr int BM = BM_, BN = BN_;
  static constexpr int WG_N = BM == 128 ? BN : BN / 2;  // columns of a math warp group's 64-row part
  static constexpr int ACC = WG_N / 2;                  // its accumulator registers per thread
  static constexpr bool SPLIT = BN % 128 != 0;          // a warp group's columns straddle two weight scale blocks
  static constexpr int SB = BN / 128 + (SPLIT ? 1 : 0);  // weight scale blocks a tile touches
  static constexpr bool DOUBLE = DOUBLE_;      // the scratch accumulator double-buffered
  static constexpr int SHARE = SHARE_;
  static constexpr int PAIR = SHARE == SHARE_NONE ? 1 : 2;  // CTAs per cluster
  static constexpr int A_BOX = SHARE == SHARE_A ? BM / 2 : BM;  // rows of each operand one CTA loads per K block
  static constexpr int B_BOX = SHARE == SHARE_B ? BN / 2 : BN;
  static constexpr bool STAGED = STAGED_;  // the scales staged in shared memory by a loader warp
  static constexpr int SCALES = BM + SB;  // floats per slot's scale row: the rows', then the weight's
  static constexpr int A_BYTES = BM * BLOCK_K, B_BYTES = BN * BLOCK_K;  // one K block of each operand
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int STAGES = RING_BYTES / STAGE_BYTES;  // 6 at 128 x 128, 5 at 64 x 256 and 128 x 192
  static constexpr int SMEM_BYTES =
      1024 + STAGES * STAGE_BYTES + 16 * STAGES + (MAX_GROUPS + 1) * 4 + (STAGED ? STAGES * SCALES * 4 : 0);
  // the first row and column of math warp group w's 64 x WG_N part of the tile
  __host__ __device__ static constexpr int wg_row(int w) { return BM == 128 ? 64 * w : 0; }
  __host__ __device__ static constexpr int wg_col(int w) { return BN == 256 ? 128 * w : 0; }
};

struct Params {
  CUtensorMap a_map;  // [rows_total, K] bytes, boxes of 128 bytes x A_BOX rows, 128-byte swizzle
  CUtensorMap b_map;  // [E * N, K] bytes, boxes of 128 bytes x B_BOX rows
  const float* sa;  // element (row, kb): see row_scales, then + kb * sa_k
  long long sa_group, sa_row, sa_k;
  const float* sb;
  __nv_bfloat16* out;
  const int* indptr;    // contiguous layout (or null)
  const int* masked_m;  // masked layout (or null)
  long long rows_total;
  int groups, max_m, n, k;
};

// expert e's first row and row count
__device__ __forceinline__ void expert_rows(const Params& p, int e, int& start, int& count) {
  if (p.indptr != nullptr) {
    start = p.indptr[e];
    count = p.indptr[e + 1] - start;
  } else {
    start = e * p.max_m;
    count = min(p.masked_m[e], p.max_m);
  }
}

// the scale of K block 0 of expert e's row i (i < its count; the rows past it read row count - 1's: any finite scale)
__device__ __forceinline__ const float* row_scales(const Params& p, int e, int start, int i) {
  return p.sa + (p.indptr != nullptr ? static_cast<long long>(start + i) * p.sa_row
                                     : static_cast<long long>(e) * p.sa_group + static_cast<long long>(i) * p.sa_row);
}

// an expert's units of work: tiles, or with multicast pairs of them (the cluster's two CTAs): pairs of column blocks
// (SHARE_A), of row blocks (SHARE_B; an odd last row block pairs with one past the expert's rows)
template <class F>
__device__ __forceinline__ int row_units(int count) {
  const int mtiles = (count + F::BM - 1) / F::BM;
  return F::SHARE == SHARE_B ? (mtiles + 1) / 2 : mtiles;
}
template <class F>
__device__ __forceinline__ int expert_units(int count, int n_blocks) {
  return row_units<F>(count) * (F::SHARE == SHARE_A ? n_blocks / 2 : n_blocks);
}

// unit t -> this CTA's tile (expert, column block, row block) through tiles_before[] (units of the experts before e;
// rank: this CTA's place in its cluster)
template <class F>
__device__ __forceinline__ void tile_coords(const Params& p, const int* tiles_before, int t, int rank, int& e, int& nb,
                                            int& mb) {
  int lo = 0, hi = p.groups - 1;  // the last e with tiles_before[e] <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tiles_before[mid] <= t) lo = mid; else hi = mid - 1;
  }
  e = lo;
  int start, count;
  expert_rows(p, e, start, count);
  const int units = row_units<F>(count);
  const int local = t - tiles_before[e];
  nb = local / units;
  mb = local - nb * units;
  if constexpr (F::SHARE == SHARE_A) nb = nb * 2 + rank;
  if constexpr (F::SHARE == SHARE_B) mb = mb * 2 + rank;
}

__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// the same box written at the same offset (and counted on the same barrier) in every CTA of cta_mask
__device__ __forceinline__ void tma_2d_multicast(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar,
                                                 uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
      : "memory");
}

// 4 bytes global -> shared, asynchronously; cp_async_arrive: one arrival on `bar` once this thread's copies landed
// (noinc: the arrival is one of the barrier's expected count)
__device__ __forceinline__ void cp_async_4(uint32_t dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// one K block of a warp group's 64 x N part: four m64nNk32 wgmmas into `part` (a: its first token row, b: its first
// weight row, both 128-byte swizzled), committed as one group
template <int N>
__device__ __forceinline__ void mma_kblock(float* part, uint32_t a, uint32_t b) {
  if constexpr (GG_ABLATE_NO_MMA) return;  // ablation: `part` keeps the opaque values the kernel gave it
  wgmma_fence();
  const uint64_t da = desc_sw128(a), db = desc_sw128(b);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    if constexpr (N == 192) wgmma_m64n192k32_e4m3(part, desc_add(da, 32 * kk), desc_add(db, 32 * kk), kk);
    else wgmma_m64n128k32_e4m3(part, desc_add(da, 32 * kk), desc_add(db, 32 * kk), kk);
  }
  wgmma_commit();
}

// one K block's scales of a thread's two accumulator rows: row scale x the weight scale of its first block (s0, s1)
// and, in the SPLIT forms, of the next (t0, t1)
struct KScales {
  float s0, s1, t0, t1;
};

// A position in the ring of STAGES slots: the slot and the parity of its barriers' current phase, advanced one K
// block at a time (a division by STAGES per K block, 5 or 6, cost each thread a multiply-high and more: session 45's
// instruction counts)
template <int STAGES>
struct RingPos {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ RingPos next() const {
    RingPos n = *this;
    if (++n.slot == STAGES) n.slot = 0, n.phase ^= 1;
    return n;
  }
};

// The loaders' walk (the TMA thread's and the scale warp's): over this CTA's tiles, tile(e, nb, mb, start, count),
// then for each K block, once its slot is free (released by the math warps of every CTA that reads it),
// kblock(kb, slot)
template <class F, class Tile, class KBlock>
__device__ __forceinline__ void loader_walk(const Params& p, const int* tiles_before, int num_tiles, int walker,
                                            int walkers, int rank, int k_blocks, uint32_t bar_empty, Tile tile,
                                            KBlock kblock) {
  RingPos<F::STAGES> pos;
  bool wrapped = false;  // every slot filled once: from then on each waits for its release
  for (int t = walker; t < num_tiles; t += walkers) {
    int e, nb, mb, start, count;
    tile_coords<F>(p, tiles_before, t, rank, e, nb, mb);
    expert_rows(p, e, start, count);
    tile(e, nb, mb, start, count);
    for (int kb = 0; kb < k_blocks; ++kb, wrapped |= pos.slot == F::STAGES - 1, pos = pos.next()) {
      if (wrapped) mbar_wait(bar_empty + 8 * pos.slot, pos.phase ^ 1);
      kblock(kb, pos.slot);
    }
  }
}

// The block scales of a thread's two accumulator rows loaded by the thread itself, K block by K block (take() in
// order from kb = 0; the forms without staging): the next block's three loads are issued when one is taken, so they
// land during a whole K block's wait and wgmmas instead of the block's own.
struct BlockScales {
  const float *a0, *a1, *b;  // the two rows' K block 0 (K blocks sa_k apart), the weight's (contiguous)
  long long sa_k;
  int kb, k_blocks;
  float next_b, next_0, next_1;
  __device__ __forceinline__ BlockScales(const float* a0_, const float* a1_, long long sa_k_, const float* b_,
                                         int k_blocks_)
      : a0(a0_), a1(a1_), b(b_), sa_k(sa_k_), kb(0), k_blocks(k_blocks_) {
    load(0);
  }
  __device__ __forceinline__ void load(int i) {
    next_b = __ldg(b + i), next_0 = __ldg(a0 + i * sa_k), next_1 = __ldg(a1 + i * sa_k);
  }
  // the next K block's (slot index unused: the loads are the thread's own; one weight block)
  __device__ __forceinline__ void take(KScales& k, int) {
    k.s0 = next_0 * next_b, k.s1 = next_1 * next_b;
    if (++kb < k_blocks) load(kb);
  }
};

// The same from the slot's staged scale row (the STAGED forms): rows ra, rb of the tile, the tile's weight block cb
// (and cb + 1 in the SPLIT forms)
template <class F>
struct StagedScales {
  const float* rows;  // slot 0's scale row
  int ra, rb, cb;
  __device__ __forceinline__ void take(KScales& k, int slot) const {
    const float* sc = rows + slot * F::SCALES;
    const float a0 = sc[ra], a1 = sc[rb], b = sc[F::BM + cb];
    k.s0 = a0 * b, k.s1 = a1 * b;
    if constexpr (F::SPLIT) {
      const float b2 = sc[F::BM + cb + 1];
      k.t0 = a0 * b2, k.t1 = a1 * b2;
    }
  }
};

// acc += part x the block scales (part[4j + {0, 1}]: the first row, part[4j + {2, 3}]: the second; columns 8j + ..:
// the first weight block for j < JB, the next from there; JB = ACC / 4 when the part lies in one block). JB is a
// constant so that each element's scale is one of four registers (a runtime JB cost a select and two multiplies per
// column group: the 128x192 forms executed 2x DeepGEMM's instructions, session 45)
template <class F, int JB>
__device__ __forceinline__ void promote(float* acc, const float* part, const KScales& k) {
#pragma unroll
  for (int i = 0; i < F::ACC; ++i) {
    const bool first = !F::SPLIT || i / 4 < JB;
    acc[i] = fmaf(part[i], (i & 2) ? (first ? k.s1 : k.t1) : (first ? k.s0 : k.t0), acc[i]);
  }
}

template <class F>
__global__ void __launch_bounds__(THREADS, 1) grouped_gemm_fp8_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  uint32_t sbase;
  uint8_t* smem = aligned_smem(smem_raw, sbase);
  const uint32_t bar_full = sbase + F::STAGES * F::STAGE_BYTES, bar_empty = bar_full + 8 * F::STAGES;
  int* tiles_before = reinterpret_cast<int*>(smem + F::STAGES * F::STAGE_BYTES + 16 * F::STAGES);
  float* scale_rows = reinterpret_cast<float*>(tiles_before + MAX_GROUPS + 1);  // STAGED: STAGES x SCALES
  // the warp group through a shuffle, so that ptxas sees a warp-uniform value and keeps the wgmma descriptors in
  // uniform registers (no R2UR move ahead of each wgmma), as DeepGEMM reads its warp group index
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int n_blocks = (p.n + F::BN - 1) / F::BN, k_blocks = p.k / BLOCK_K;

  if (tid == 0) {
    int total = 0;
    for (int e = 0; e < p.groups; ++e) {
      tiles_before[e] = total;
      int start, count;
      expert_rows(p, e, start, count);
      total += expert_units<F>(count, n_blocks);
    }
    tiles_before[p.groups] = total;
    for (int s = 0; s < F::STAGES; ++s) {
      mbar_init(bar_full + 8 * s, F::STAGED ? 33 : 1);  // the producer's arrival (+ the scale warp's 32) and bytes
      mbar_init(bar_empty + 8 * s, 8 * F::PAIR);  // one arrival per math warp (of both CTAs with multicast)
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (F::PAIR > 1) cluster_sync();  // the peer's barriers exist before any multicast or remote arrival
  else __syncthreads();
  const int num_tiles = tiles_before[p.groups];
  const int rank = F::PAIR > 1 ? cluster_rank() : 0;  // this CTA's column (SHARE_A) or row block (SHARE_B) of a pair
  const int walker = blockIdx.x / F::PAIR, walkers = gridDim.x / F::PAIR;

  if (wg == 0) {
    setmaxnreg_dec<LOADER_REGS>();
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.a_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.b_map)) : "memory");
      // this CTA's share of each operand: all of it, or of the shared one (multicast) its half of the rows, sent to
      // both CTAs at the same offset (bytes into the slot's A or B: 128 B per row)
      const int a_first = F::SHARE == SHARE_A ? rank * F::A_BOX : 0;
      const int b_first = F::SHARE == SHARE_B ? rank * F::B_BOX : 0;
      int row = 0, col = 0, filled = 0;  // filled: K blocks loaded (GG_ABLATE_NO_LOAD stops after one ring)
      loader_walk<F>(
          p, tiles_before, num_tiles, walker, walkers, rank, k_blocks, bar_empty,
          [&](int e, int nb, int mb, int start, int) {
            row = start + mb * F::BM + a_first, col = e * p.n + nb * F::BN + b_first;
          },
          [&](int kb, int s) {
            const uint32_t dst = sbase + s * F::STAGE_BYTES, bar = bar_full + 8 * s;
            if (GG_ABLATE_NO_LOAD && filled++ >= F::STAGES) {  // ablation: the slot keeps its first K block
              mbar_arrive(bar);
              return;
            }
            mbar_arrive_expect_tx(bar, F::STAGE_BYTES);  // the whole slot: the peer's share lands here too
            const uint32_t a_dst = dst + a_first * BLOCK_K, b_dst = dst + F::A_BYTES + b_first * BLOCK_K;
            if constexpr (F::SHARE == SHARE_A) tma_2d_multicast(a_dst, &p.a_map, kb * BLOCK_K, row, bar, 0b11);
            else tma_2d(a_dst, &p.a_map, kb * BLOCK_K, row, bar);
            if constexpr (F::SHARE == SHARE_B) tma_2d_multicast(b_dst, &p.b_map, kb * BLOCK_K, col, bar, 0b11);
            else tma_2d(b_dst, &p.b_map, kb * BLOCK_K, col, bar);
          });
    }
    if constexpr (F::STAGED) {
      if (tid / 32 == 1) {  // the scale warp: each slot's scale row, BM rows' and the weight's, by cp.async
        const int lane = tid % 32;
        const float* rows[F::BM / 32];  // this lane's rows' K block 0
        const float* sb = nullptr;      // its weight scale block's (past N, a partial last tile: any finite one)
        int filled = 0;
        loader_walk<F>(
            p, tiles_before, num_tiles, walker, walkers, rank, k_blocks, bar_empty,
            [&](int e, int nb, int mb, int start, int count) {
#pragma unroll
              for (int j = 0; j < F::BM / 32; ++j)
                rows[j] = row_scales(p, e, start, min(mb * F::BM + lane + 32 * j, count - 1));
              sb = p.sb + (static_cast<long long>(e) * (p.n / 128) + min(nb * F::BN / 128 + lane, p.n / 128 - 1)) *
                              k_blocks;
            },
            [&](int kb, int s) {
              const uint32_t dst = smem_u32(scale_rows + s * F::SCALES);
              if (GG_ABLATE_NO_LOAD && filled++ >= F::STAGES) {  // ablation: the scales of the first ring stay
                cp_async_arrive(bar_full + 8 * s);
                return;
              }
#pragma unroll
              for (int j = 0; j < F::BM / 32; ++j) cp_async_4(dst + 4 * (lane + 32 * j), rows[j] + kb * p.sa_k);
              if (lane < F::SB) cp_async_4(dst + 4 * (F::BM + lane), sb + kb);
              cp_async_arrive(bar_full + 8 * s);
            });
        asm volatile("cp.async.wait_all;\n" ::: "memory");
      }
    }
    // with multicast no CTA may leave while its peer can still arrive on its barriers or write its slots
    if constexpr (F::PAIR > 1) cluster_sync();
    return;
  }

  setmaxnreg_inc<MATH_REGS>();
  const int w = wg - 1, warp = (tid / 32) % 4, lane = tid % 32;
  const int r_frag = F::wg_row(w) + warp * 16 + lane / 4;  // this thread's first accumulator row in the tile (+8)
  const int c_wg = F::wg_col(w), c_frag = (lane % 4) * 2;
  const uint32_t a_off = F::wg_row(w) * BLOCK_K, b_off = F::A_BYTES + c_wg * BLOCK_K;  // in a slot
  float acc[F::ACC], part[F::ACC], part2[F::DOUBLE ? F::ACC : 1];
  if constexpr (GG_ABLATE_NO_MMA) {  // values ptxas cannot know, so that it keeps every promotion FFMA
#pragma unroll
    for (int i = 0; i < F::ACC; ++i) {
      asm volatile("mov.b32 %0, %1;\n" : "=f"(part[i]) : "r"(tid * 7 + i));
      if constexpr (F::DOUBLE) asm volatile("mov.b32 %0, %1;\n" : "=f"(part2[i]) : "r"(tid * 5 + i));
    }
  }
  RingPos<F::STAGES> pos;
  for (int t = walker; t < num_tiles; t += walkers) {
    int e, nb, mb, start, count;
    tile_coords<F>(p, tiles_before, t, rank, e, nb, mb);
    expert_rows(p, e, start, count);
    const int r0 = mb * F::BM + r_frag;  // this thread's first row in the expert
    auto scales = [&] {
      if constexpr (F::STAGED) {
        return StagedScales<F>{scale_rows, r_frag, r_frag + 8, c_wg / 128};
      } else {
        return BlockScales(
            row_scales(p, e, start, min(r0, count - 1)), row_scales(p, e, start, min(r0 + 8, count - 1)), p.sa_k,
            p.sb + (static_cast<long long>(e) * (p.n / 128) + (nb * F::BN + c_wg) / 128) * k_blocks, k_blocks);
      }
    }();
    KScales ks;
    const auto slot = [&](RingPos<F::STAGES> q) { return sbase + q.slot * F::STAGE_BYTES; };
    const auto wait_full = [&](RingPos<F::STAGES> q) { mbar_wait(bar_full + 8 * q.slot, q.phase); };
    const auto release = [&](RingPos<F::STAGES> q) {  // its reads are done: free it here (and in the peer, which
      if constexpr (F::PAIR > 1) {                        // writes it too)
        if (lane < F::PAIR) mbar_arrive_cluster(bar_empty + 8 * q.slot, lane);  // lane r: CTA r
      } else {
        if (lane == 0) mbar_arrive(bar_empty + 8 * q.slot);
      }
    };
#pragma unroll
    for (int i = 0; i < F::ACC; ++i) acc[i] = 0.f;
    const auto k_loop = [&](auto jb) {  // jb: std::integral_constant, the promotion's column-group split
      if constexpr (!F::DOUBLE) {
        for (int kb = 0; kb < k_blocks; ++kb, pos = pos.next()) {
          wait_full(pos);
          scales.take(ks, pos.slot);
          mma_kblock<F::WG_N>(part, slot(pos) + a_off, slot(pos) + b_off);
          wgmma_wait<0>();
          release(pos);
          promote<F, jb>(acc, part, ks);
        }
      } else {
        // K block kb's wgmmas run in `cur` while kb - 1's (in the other) are promoted; the two swap each K block
        const auto step = [&](float* cur, float* nxt, int kb) {
          scales.take(ks, pos.slot);  // its slot is full (waited one step earlier); read before its release
          if (kb + 1 < k_blocks) {
            const RingPos<F::STAGES> q = pos.next();
            wait_full(q);
            mma_kblock<F::WG_N>(nxt, slot(q) + a_off, slot(q) + b_off);
            wgmma_wait<1>();  // kb's group done, kb + 1's may run on
          } else {
            wgmma_wait<0>();
          }
          release(pos);
          promote<F, jb>(acc, cur, ks);
          pos = pos.next();
        };
        wait_full(pos);
        mma_kblock<F::WG_N>(part, slot(pos) + a_off, slot(pos) + b_off);
        for (int kb = 0; kb < k_blocks; kb += 2) {
          step(part, part2, kb);
          if (kb + 1 < k_blocks) step(part2, part, kb + 1);
        }
      }
    };
    if (mb * F::BM + F::wg_row(w) >= count) {  // no row of this warp group's part is the expert's (a short last
      for (int kb = 0; kb < k_blocks; ++kb, pos = pos.next()) {  // tile, or a multicast pair's empty one): only
        wait_full(pos);                                           // the hand-offs, as DeepGEMM skips it
        release(pos);
      }
      continue;  // nothing to store
    }
    if constexpr (F::SPLIT) {  // 192 columns from a multiple of 128 (jb 16) or of 64 past one (jb 8)
      static_assert(F::BN == 192 && F::BM == 128, "the split K loops are the 128 x 192 tile's");
      if ((nb * F::BN) % 128 == 0) k_loop(std::integral_constant<int, 16>{});
      else k_loop(std::integral_constant<int, 8>{});
    } else {
      k_loop(std::integral_constant<int, F::ACC / 4>{});
    }
    // epilogue: acc[4j + {0, 1}] are (row r_frag, columns 8j + c_frag + {0, 1}); acc[4j + {2, 3}] row r_frag + 8
    const int local = mb * F::BM + r_frag;
    const int col = nb * F::BN + c_wg + c_frag;
    __nv_bfloat16* o = p.out + (static_cast<long long>(start) + local) * p.n + col;
#pragma unroll
    for (int j = 0; j < F::ACC / 4; ++j) {
      if (F::SPLIT && col + 8 * j >= p.n) break;  // a partial last column block
      if (local < count)
        *reinterpret_cast<__nv_bfloat162*>(o + 8 * j) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
      if (local + 8 < count)
        *reinterpret_cast<__nv_bfloat162*>(o + 8 * p.n + 8 * j) = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
  }
  if constexpr (F::PAIR > 1) cluster_sync();
}

// [rows, K] bytes as a 2-D tensor map with boxes of 128 bytes x box_rows rows and the 128-byte swizzle
inline cudaError_t encode_operand_map(CUtensorMap* map, const void* ptr, long long rows, int k, int box_rows) {
  cudaError_t err;
  const TensorMapEncoder encode = tensor_map_encoder(&err);
  if (encode == nullptr) return err;
  if (rows <= 0 || k % 16 != 0 || reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};
  const cuuint32_t box[2] = {128, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <class F>
int launch(const void* a, const void* sa, const long long* sa_strides, const void* b, const void* sb, void* out,
           const void* indptr, const void* masked_m, long long rows_total, int groups, int max_m, int n, int k,
           int num_ctas, void* stream) {
  if ((!F::SPLIT && n % F::BN != 0) || (F::SHARE == SHARE_A && (n + F::BN - 1) / F::BN % 2 != 0) ||
      num_ctas < F::PAIR)
    return static_cast<int>(cudaErrorInvalidValue);
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (dev < 0 || dev >= 128) return static_cast<int>(cudaErrorInvalidDevice);
  static bool attr_done[128] = {};  // per device (and form: one per instantiation)
  if (!attr_done[dev]) {
    err = cudaFuncSetAttribute(grouped_gemm_fp8_kernel<F>, cudaFuncAttributeMaxDynamicSharedMemorySize, F::SMEM_BYTES);
    if (err != cudaSuccess) return static_cast<int>(err);
    attr_done[dev] = true;
  }
  Params p;
  if ((err = encode_operand_map(&p.a_map, a, rows_total, k, F::A_BOX)) != cudaSuccess) return static_cast<int>(err);
  if ((err = encode_operand_map(&p.b_map, b, static_cast<long long>(groups) * n, k, F::B_BOX)) != cudaSuccess)
    return static_cast<int>(err);
  p.sa = static_cast<const float*>(sa);
  p.sa_group = sa_strides[0], p.sa_row = sa_strides[1], p.sa_k = sa_strides[2];
  p.sb = static_cast<const float*>(sb);
  p.out = static_cast<__nv_bfloat16*>(out);
  p.indptr = static_cast<const int*>(indptr);
  p.masked_m = static_cast<const int*>(masked_m);
  p.rows_total = rows_total;
  p.groups = groups;
  p.max_m = max_m;
  p.n = n;
  p.k = k;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_ctas / F::PAIR * F::PAIR);  // whole clusters
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = F::SMEM_BYTES;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = F::PAIR, cluster[0].val.clusterDim.y = 1, cluster[0].val.clusterDim.z = 1;
  cfg.attrs = cluster;
  cfg.numAttrs = 1;
  if constexpr (F::PAIR > 1) {
    // A persistent grid must be resident at once: a GPC with an odd count of free SMs holds one CTA fewer than its
    // SMs, and a cluster left over would run its whole tile list after the others (session 45: 1.8x the time).
    static int resident[128] = {};  // clusters resident at once, per device
    if (resident[dev] == 0) {
      err = cudaOccupancyMaxActiveClusters(&resident[dev], grouped_gemm_fp8_kernel<F>, &cfg);
      if (err != cudaSuccess) return static_cast<int>(err);
      if (resident[dev] <= 0) return static_cast<int>(cudaErrorInvalidConfiguration);
    }
    cfg.gridDim.x = min(static_cast<int>(cfg.gridDim.x), resident[dev] * F::PAIR);
  }
  return static_cast<int>(cudaLaunchKernelEx(&cfg, grouped_gemm_fp8_kernel<F>, p));
}

}  // namespace grouped_gemm_sm90

// The launch (ctypes: grouped_gemm_cuda.py). Exactly one of indptr (contiguous) and masked_m (masked) is non-null;
// sa's strides in elements: group (masked), row, K block; rows_total: A's rows; num_ctas: the grid (the caller's SM
// count; whole clusters of it); form: 0-4 (the header). Returns a cudaError_t.
extern "C" __attribute__((visibility("default"))) int grouped_gemm_fp8_sm90(
    const void* a, const void* sa, long long sa_group, long long sa_row, long long sa_k, const void* b, const void* sb,
    void* out, const void* indptr, const void* masked_m, long long rows_total, int groups, int max_m, int n, int k,
    int num_ctas, int form, void* stream) {
  using namespace grouped_gemm_sm90;
  if ((indptr == nullptr) == (masked_m == nullptr) || groups <= 0 || groups > MAX_GROUPS || n % 128 != 0 ||
      k % BLOCK_K != 0 || n <= 0 || k <= 0 || num_ctas <= 0 || form < 0 || form >= NUM_FORMS)
    return static_cast<int>(cudaErrorInvalidValue);
  if (rows_total <= 0) return 0;
  constexpr decltype(&launch<Form<64, 256, true, false, SHARE_NONE>>) forms[NUM_FORMS] = {  // grouped_gemm_cuda.FORMS
      launch<Form<64, 256, true, false, SHARE_NONE>>, launch<Form<128, 128, true, true, SHARE_NONE>>,
      launch<Form<128, 192, false, true, SHARE_NONE>>, launch<Form<128, 192, false, true, SHARE_A>>,
      launch<Form<128, 192, false, true, SHARE_B>>};
  const long long sa_strides[3] = {sa_group, sa_row, sa_k};
  return forms[form](a, sa, sa_strides, b, sb, out, indptr, masked_m, rows_total, groups, max_m, n, k, num_ctas,
                     stream);
}

extern "C" __attribute__((visibility("default"))) const char* grouped_gemm_fp8_sm90_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
