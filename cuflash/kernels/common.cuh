// common.cuh: the portability layer every cuflash kernel source starts with. The same text compiles under
// NVRTC (CuPy) and under g++ in the SIMT emulator (cuflash/simt), which defines CUFLASH_SIMT.
#ifndef CUFLASH_COMMON_CUH
#define CUFLASH_COMMON_CUH

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
// NVRTC/nvcc: CUDA's half and bfloat16 types (give NVRTC -I<dir with cuda_fp16.h>).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#elif defined(CUFLASH_SIMT)
// The emulator: its runtime header (already included ahead of the source) provides __half, __nv_bfloat16,
// the vector types, intrinsics, warp collectives and the built-in variables.
#include "cuflash_simt.h"
#else
#error "cuflash kernels compile under NVRTC/nvcc or the cuflash.simt emulator"
#endif

#endif  // CUFLASH_COMMON_CUH
