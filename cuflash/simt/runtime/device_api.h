// device_api.h: the device-side API.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_DEVICE_API_H
#define CUFLASH_SIMT_RUNTIME_DEVICE_API_H

// ------------------------------------------------------------------------------------------------
// 11. The device-side API kernels call (CUDA's names). Defaulted __builtin_FILE() and __builtin_LINE() record
//     the caller's file and line (the kernel source's #line directives name the true ones) for messages.
// ------------------------------------------------------------------------------------------------
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(file, line, 0);
}
inline int __syncthreads_count(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(file, line, pred);
  return cuflash_simt::tl.block->bar_result;
}
inline int __syncthreads_and(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(file, line, pred);
  return cuflash_simt::tl.block->bar_result == (int)cuflash_simt::tl.block->fibers.size();
}
inline int __syncthreads_or(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(file, line, pred);
  return cuflash_simt::tl.block->bar_result != 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cuflash_simt::vote(3, mask, 0, file, line);
}
template <class T> inline T __shfl_sync(unsigned mask, T var, int src, int width = 32,
                                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::IDX, mask, var, src, width, file, line);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::UP, mask, var, (int)delta, width, file, line);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::DOWN, mask, var, (int)delta, width, file, line);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                                            const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::BFLY, mask, var, lane_mask, width, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return cuflash_simt::vote(0, mask, pred, file, line);
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cuflash_simt::vote(1, mask, pred, file, line) != 0;
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cuflash_simt::vote(2, mask, pred, file, line) == mask;
}
// Lanes of the caller's warp that have not exited (the emulator has no finer notion of convergence).
inline unsigned __activemask() {
  cuflash_simt::Warp& w = cuflash_simt::my_warp(cuflash_simt::tl.fiber);
  return w.present & ~w.exited;
}
#define CUFLASH_SIMT_REDUCE(NAME, K, T, S)                                                              \
  inline T NAME(unsigned mask, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    return (T)cuflash_simt::reduce<K, S>(#NAME, mask, (uint32_t)v, file, line);                         \
  }
CUFLASH_SIMT_REDUCE(__reduce_add_sync, 0, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_add_sync, 0, int, true)
CUFLASH_SIMT_REDUCE(__reduce_min_sync, 1, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_min_sync, 1, int, true)
CUFLASH_SIMT_REDUCE(__reduce_max_sync, 2, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_max_sync, 2, int, true)
CUFLASH_SIMT_REDUCE(__reduce_and_sync, 3, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_or_sync, 4, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_xor_sync, 5, unsigned, false)
#undef CUFLASH_SIMT_REDUCE

[[noreturn]] inline void __trap() { cuflash_simt::fail_here("__trap() called"); }
[[noreturn]] inline void __brkpt() { cuflash_simt::fail_here("__brkpt() called"); }
inline void __nanosleep(unsigned) { cuflash_simt::yield(); }  // a scheduling point, so spin-waits progress
inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }
[[noreturn]] inline void cuflash_simt_assert_fail(const char* expr, const char* file, int line) {
  cuflash_simt::fail_here("assertion `%s' failed at %s:%d", expr, file, line);
}
#undef assert
#define assert(e) ((e) ? (void)0 : cuflash_simt_assert_fail(#e, __FILE__, __LINE__))

// Built-in variables: read-only views of the running fiber's coordinates.
static constexpr int warpSize = 32;
#define threadIdx (static_cast<const uint3&>(::cuflash_simt::tl.fiber->tid))
#define blockIdx (static_cast<const uint3&>(::cuflash_simt::tl.block->idx))
#define blockDim (static_cast<const dim3&>(::cuflash_simt::tl.launch->block))
#define gridDim (static_cast<const dim3&>(::cuflash_simt::tl.launch->grid))

#endif  // CUFLASH_SIMT_RUNTIME_DEVICE_API_H
