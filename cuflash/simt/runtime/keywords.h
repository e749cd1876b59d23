// keywords.h: CUDA keywords.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_KEYWORDS_H
#define CUFLASH_SIMT_RUNTIME_KEYWORDS_H

// ------------------------------------------------------------------------------------------------
// 1. CUDA keywords. __shared__ declarations are rewritten by the Python side (cuflash/simt/_source.py) so
//    that each block gets fresh, poisoned shared memory; this macro only serves declarations it did not see.
// ------------------------------------------------------------------------------------------------
#if defined(CUFLASH_SIMT_MEMCHECK) || defined(CUFLASH_SIMT_RACE)
#define CUFLASH_SIMT_SHARED static  // one OS thread runs every block; ASan instruments plain statics only
#else
#define CUFLASH_SIMT_SHARED static thread_local  // one block per OS thread at a time
#endif
#define __shared__ CUFLASH_SIMT_SHARED
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
// __restrict__ is a g++ keyword already.

#endif  // CUFLASH_SIMT_RUNTIME_KEYWORDS_H
