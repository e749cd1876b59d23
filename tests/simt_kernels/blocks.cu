// Blocks of one launch run in any order, or at once: race mode reports two blocks that touch the same global
// bytes (not through atomics). Each buggy kernel has a fixed twin that must run clean.

// Bug: every block writes out[0, blockDim.x), so blocks 0 and 1 write the same elements.
extern "C" __global__ void blocks_same_output(const float* x, float* out) {
  int t = threadIdx.x;
  out[t] = x[blockIdx.x * blockDim.x + t];  // SAME_WRITE
}

// Bug: block b reads what block b-1 wrote, with nothing between blocks to order the two.
extern "C" __global__ void blocks_read_other(const float* x, float* out, float* prev) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = 2 * x[i];  // OTHER_WRITE
  if (blockIdx.x > 0) prev[i] = out[i - blockDim.x];  // OTHER_READ
}

// The twin: each block writes only its own elements and recomputes its neighbour's value from the inputs,
// staged through a static __shared__ array that every block reuses.
extern "C" __global__ void blocks_disjoint(const float* x, float* out, float* prev) {
  __shared__ float s[64];
  int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  s[t] = blockIdx.x > 0 ? 2 * x[i - blockDim.x] : 0.0f;
  __syncthreads();
  out[i] = 2 * x[i];
  prev[i] = s[(t + 1) % blockDim.x];
}

// The reduction done right across blocks: each block sums its part in dynamic shared memory, and the blocks
// meet only through atomicAdd.
extern "C" __global__ void blocks_atomic_sum(const float* x, float* sum, int* count) {
  extern __shared__ float part[];
  int t = threadIdx.x;
  part[t] = x[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) part[t] += part[t + s];
    __syncthreads();
  }
  if (t == 0) atomicAdd(sum, part[0]);
  atomicAdd(count, 1);
}

// Bug: blocks_read_other with a cp.async between the write and the read. A thread's copies are ordered after
// its own issue only: carried from one block to the next (one copy fiber per thread slot), they would order
// block b's write before block b+1's read, and the race would go unreported.
extern "C" __global__ void blocks_read_other_after_copy(const float4* x4, const float* x, float* out, float* prev) {
  __shared__ __align__(16) float4 stage[64];
  int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  out[i] = 2 * x[i];  // COPY_WRITE
  cuflash::ptx::cp_async_cg16(&stage[t], &x4[t]);
  cuflash::ptx::cp_async_commit();
  cuflash::ptx::cp_async_wait<0>();
  if (blockIdx.x > 0) prev[i] = out[i - blockDim.x] + stage[t].x;  // COPY_READ
}
