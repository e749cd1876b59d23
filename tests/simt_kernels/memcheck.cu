// Out-of-bounds accesses AddressSanitizer must catch in the emulator's memcheck build, and a clean kernel it must
// pass. Prepend common.cuh, ptx.cuh, ptx_extra.cuh. `which`: 0 clean, 1 global read past the end, 2 global write
// past the end, 3 static shared write past the end, 4 dynamic shared read past the launch's size, 5 cp.async
// reading past the end.
extern "C" __global__ void oob(const float* in, float* out, int n, int which) {
  __shared__ float s[64];
  extern __shared__ float dyn[];
  int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  float v = in[i];
  if (which == 1 && i == n - 1) v += in[i + 1];                                    // OOB_GLOBAL_READ
  s[t] = v;
  if (which == 3 && t == 63) s[t + 1] = v;                                         // OOB_SHARED_WRITE
  dyn[t] = v;
  __syncthreads();
  float w = s[63 - t] + dyn[t];
  if (which == 4 && t == 63) w += dyn[t + 1];                                      // OOB_DYNAMIC_READ
  if (which == 5) {
    __shared__ __align__(16) float4 staging[16];
    if (t < 16) cuflash::ptx::cp_async_ca16(&staging[t], in + n - 4 + 4 * t);      // OOB_CP_ASYNC
    cuflash::ptx::cp_async_wait_all();
  }
  out[i] = w;
  if (which == 2 && i == n - 1) out[i + 1] = w;                                    // OOB_GLOBAL_WRITE
}
