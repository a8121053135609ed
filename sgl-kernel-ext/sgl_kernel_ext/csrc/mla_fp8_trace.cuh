// Per-warp timeline of one CTA of the FP8 MLA decode kernels (nvcc -DMLA_TRACE; compiled out otherwise).
//
// Why: the ablations (benchmark/kernels/mla_cuda_ablation.py) say the kernel's parts barely overlap, not which
// wait serializes them. With MLA_TRACE, lane 0 of every warp of the traced CTA stamps clock64() with an event
// code at the kernel's phase boundaries; benchmark/kernels/trace_mla_decode.py reads the stamps back and draws
// each warp's phases against time. A stamp is one CS2R and one 8-byte global store (fire and forget), so the
// traced schedule stays close to the real one; the event counter lives in a register.
//
// Use from a kernel: MLA_TRACE_DECL once (after blockIdx is known), MLA_TRACE(code) at each boundary,
// MLA_TRACE_END before every return. The codes are the kernel's own (the reader maps them to names).
// Entry points (exported only with MLA_TRACE): mla_fp8_trace_reset(rb, sp, b) picks the CTA to trace and zeroes
// the counts; mla_fp8_trace_read(events, counts) copies MLA_TRACE_WARPS x MLA_TRACE_EVENTS uint64 stamps
// ((code << 56) | clock & 2^56-1, per warp in order) and MLA_TRACE_WARPS int counts to host memory.
#pragma once

#ifdef MLA_TRACE
#define MLA_TRACE_WARPS 16
#define MLA_TRACE_EVENTS 4096

namespace mla_fp8_trace {
static __device__ unsigned long long g_events[MLA_TRACE_WARPS * MLA_TRACE_EVENTS];
static __device__ int g_counts[MLA_TRACE_WARPS];
static __device__ int g_target[3];  // rb, sp, b of the traced CTA

__device__ __forceinline__ bool traced_lane() {
  return (threadIdx.x & 31) == 0 && blockIdx.x == g_target[0] && blockIdx.y == g_target[1] &&
         blockIdx.z == g_target[2];
}
__device__ __forceinline__ void stamp(bool on, int& n, int code) {
  if (on && n < MLA_TRACE_EVENTS) {
    const unsigned long long t = static_cast<unsigned long long>(clock64()) & ((1ull << 56) - 1);
    g_events[(threadIdx.x >> 5) * MLA_TRACE_EVENTS + n] = (static_cast<unsigned long long>(code) << 56) | t;
    ++n;
  }
}
__device__ __forceinline__ void finish(bool on, int n) {
  if (on) g_counts[threadIdx.x >> 5] = n;
}
}  // namespace mla_fp8_trace

#define MLA_TRACE_DECL                                     \
  const bool mla_trace_on = mla_fp8_trace::traced_lane(); \
  int mla_trace_n = 0
#define MLA_TRACE(code) mla_fp8_trace::stamp(mla_trace_on, mla_trace_n, (code))
#define MLA_TRACE_END mla_fp8_trace::finish(mla_trace_on, mla_trace_n)

#define MLA_FP8_DEFINE_TRACE_ENTRY_POINTS                                                                  \
  MLA_FP8_EXPORT int mla_fp8_trace_reset(int rb, int sp, int b) {                                        \
    const int target[3] = {rb, sp, b};                                                                   \
    const int zeros[MLA_TRACE_WARPS] = {};                                                               \
    cudaError_t err = cudaMemcpyToSymbol(mla_fp8_trace::g_target, target, sizeof(target));              \
    if (err == cudaSuccess) err = cudaMemcpyToSymbol(mla_fp8_trace::g_counts, zeros, sizeof(zeros));    \
    return static_cast<int>(err);                                                                        \
  }                                                                                                      \
  MLA_FP8_EXPORT int mla_fp8_trace_read(void* events, void* counts) {                                    \
    cudaError_t err = cudaMemcpyFromSymbol(events, mla_fp8_trace::g_events,                             \
                                           sizeof(unsigned long long) * MLA_TRACE_WARPS * MLA_TRACE_EVENTS); \
    if (err == cudaSuccess)                                                                              \
      err = cudaMemcpyFromSymbol(counts, mla_fp8_trace::g_counts, sizeof(int) * MLA_TRACE_WARPS);        \
    return static_cast<int>(err);                                                                        \
  }                                                                                                      \
  MLA_FP8_EXPORT int mla_fp8_trace_shape(int* warps, int* events) {                                     \
    *warps = MLA_TRACE_WARPS;                                                                            \
    *events = MLA_TRACE_EVENTS;                                                                          \
    return 0;                                                                                            \
  }
#else
#define MLA_TRACE_DECL
#define MLA_TRACE(code) ((void)0)
#define MLA_TRACE_END ((void)0)
#define MLA_FP8_DEFINE_TRACE_ENTRY_POINTS
#endif
