// cp.async windows: a copy's destination is undefined from its issue to the cp_async_wait that covers it. Each
// kernel has its bug (fixed = 0) and its fixed twin (fixed = 1); the markers name the lines the reports must give.

// Each thread copies 16 bytes of x into s, then reads its right neighbour's chunk. The bug: the barrier comes
// before the wait, so a thread reads a chunk whose copy may not have landed. fixed = 2 or 3 leaves the copies in
// flight, by exiting or by failing the launch: no window may outlive them (the next launch reuses s).
extern "C" __global__ void window_read(const float4* x, float4* out, int fixed) {
  __shared__ __align__(16) float4 s[64];
  int t = threadIdx.x;
  cuflash::ptx::cp_async_cg16(&s[t], &x[blockIdx.x * 64 + t]);  // WINDOW_ISSUE
  cuflash::ptx::cp_async_commit();
  if (fixed == 3 && t == 5) __trap();
  if (fixed >= 2) return;
  if (fixed) cuflash::ptx::cp_async_wait<0>();
  __syncthreads();
  float4 v = s[(t + 1) % 64];  // WINDOW_READ
  cuflash::ptx::cp_async_wait<0>();
  out[blockIdx.x * 64 + t] = v;
}

// A two-stage pipeline over `tiles` tiles of 64 float4: tile j + 1 is copied into stage (j + 1) % 2 while stage
// j % 2 is read; each thread sums its right neighbour's chunk of every tile. The bug: no barrier at the end of
// an iteration, so a thread refills the stage that others may still be reading. It passes while copies land at
// the wait (after the next barrier) and fails when one lands earlier.
extern "C" __global__ void stage_reuse(const float4* x, float4* out, int tiles, int fixed) {
  __shared__ __align__(16) float4 s[2][64];
  int t = threadIdx.x;
  const float4* in = x + (size_t)blockIdx.x * tiles * 64;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  cuflash::ptx::cp_async_cg16(&s[0][t], &in[t]);
  cuflash::ptx::cp_async_commit();
  for (int j = 0; j < tiles; j++) {
    if (j + 1 < tiles) cuflash::ptx::cp_async_cg16(&s[(j + 1) % 2][t], &in[(j + 1) * 64 + t]);  // REUSE_ISSUE
    cuflash::ptx::cp_async_commit();
    cuflash::ptx::cp_async_wait<1>();
    __syncthreads();
    float4 v = s[j % 2][(t + 1) % 64];  // REUSE_READ
    acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
    if (fixed) __syncthreads();  // every thread is done with stage j % 2 before the next iteration refills it
  }
  out[blockIdx.x * 64 + t] = acc;
}
