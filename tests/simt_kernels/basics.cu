// Small kernels for the emulator's own tests (tests/simt/test_simt_basics.py). Prepend common.cuh.

// Block reduction through shared memory: out[block] = sum of the block's Nt inputs, repeated `rounds` times
// (each round: 1 + log2(Nt) + 1 barriers). A 1-D or 2-D block; blocks numbered over a 1-, 2- or 3-D grid.
template <int Nt>
__global__ void reduce_shared(const float* __restrict__ in, float* __restrict__ out, long long n, int rounds) {
  __shared__ float s[Nt];
  const unsigned t = threadIdx.x + blockDim.x * threadIdx.y;
  const long long b = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
  const long long i = b * Nt + t;
  float acc = 0.f;
  for (int r = 0; r < rounds; r++) {
    s[t] = i < n ? in[i] : 0.f;
    __syncthreads();
    for (int k = Nt / 2; k > 0; k >>= 1) {
      if (t < k) s[t] += s[t + k];
      __syncthreads();
    }
    acc = s[0];
    __syncthreads();
  }
  if (t == 0) out[b] = acc;
}

// Block reduction through shuffles: each warp reduces with __shfl_xor_sync, warp sums meet in shared memory,
// the first warp reduces them with __shfl_down_sync. Works for any block size that is a multiple of 32.
extern "C" __global__ void reduce_shuffle(const double* in, double* out, int n) {
  __shared__ double warp_sums[32];
  int t = threadIdx.x, lane = t % 32, warp = t / 32;
  int i = blockIdx.x * blockDim.x + t;
  double v = i < n ? in[i] : 0.0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (int)(blockDim.x / 32) ? warp_sums[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) out[blockIdx.x] = v;
  }
}

// Every shuffle variant, one warp per block: out[t] = shfl<mode>(value[t], arg[t], width).
// mode 0 idx, 1 up, 2 down, 3 xor.
template <typename T>
__global__ void shuffle(const T* value, const int* arg, T* out, int mode, int width) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  T v = value[t];
  int a = arg[t];
  T r;
  if (mode == 0) r = __shfl_sync(0xffffffffu, v, a, width);
  else if (mode == 1) r = __shfl_up_sync(0xffffffffu, v, (unsigned)a, width);
  else if (mode == 2) r = __shfl_down_sync(0xffffffffu, v, (unsigned)a, width);
  else r = __shfl_xor_sync(0xffffffffu, v, a, width);
  out[t] = r;
}

// Votes and block-wide predicate barriers: per thread, [ballot, any, all, count, and, or, reduce_add, activemask].
extern "C" __global__ void votes(const int* pred, unsigned* out) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  int p = pred[t];
  unsigned* o = out + 8 * t;
  o[7] = __activemask();  // before any lane can have exited (the emulator has no finer notion of convergence)
  o[0] = __ballot_sync(0xffffffffu, p);
  o[1] = __any_sync(0xffffffffu, p);
  o[2] = __all_sync(0xffffffffu, p);
  o[3] = __syncthreads_count(p);
  o[4] = __syncthreads_and(p);
  o[5] = __syncthreads_or(p);
  o[6] = __reduce_add_sync(0xffffffffu, (unsigned)p);
}

// Coordinates: each thread writes (threadIdx, blockIdx, blockDim, gridDim, warpSize, lane by shuffle).
extern "C" __global__ void coords(int* out) {
  long long b = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
  int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int* o = out + 14 * (b * blockDim.x * blockDim.y * blockDim.z + t);
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
  o[6] = blockDim.x; o[7] = blockDim.y; o[8] = blockDim.z;
  o[9] = gridDim.x; o[10] = gridDim.y; o[11] = gridDim.z;
  o[12] = warpSize;
  o[13] = __shfl_sync(__activemask(), t, 0);  // the linear index of the warp's lane 0
}

// Shared memory read before it is written: static and dynamic arrays start as NaN in every block.
extern "C" __global__ void read_fresh_shared(float* out) {
  __shared__ float s[64];  // FRESH_STATIC
  extern __shared__ float dyn[];
  int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  out[2 * i] = s[t];
  out[2 * i + 1] = dyn[t];
  __syncthreads();
  s[t] = 1.f;  // the next block must not see this
  dyn[t] = 1.f;
}

// A neighbour exchange through shared memory; `sync` = 0 drops the barrier (a bug some schedule must expose).
extern "C" __global__ void neighbour(const float* in, float* out, int sync, int shift) {
  __shared__ float s[128];
  int t = threadIdx.x, n = blockDim.x;
  s[t] = in[blockIdx.x * n + t];
  if (sync) __syncthreads();
  out[blockIdx.x * n + t] = s[(t + shift + n) % n];
}

// Misuse the emulator must report (case picks which).
extern "C" __global__ void misuse(float* out, int which) {
  __shared__ float s[64];
  int t = threadIdx.x, lane = t % 32;
  s[t] = t;
  if (which == 0) {  // barrier divergence: two different __syncthreads
    if (t < 32) __syncthreads();                                  // DIVERGE_A
    else __syncthreads();                                         // DIVERGE_B
  } else if (which == 1) {  // some threads exit before a barrier the others wait at
    if (t >= 48) return;
    __syncthreads();                                              // EXIT_BARRIER
  } else if (which == 2) {  // a full-mask shuffle that half the warp never reaches
    if (lane < 16) out[t] = __shfl_xor_sync(0xffffffffu, s[t], 1);  // HALF_WARP_SHFL
  } else if (which == 3) {  // a mask without the calling lane
    out[t] = __shfl_sync(0x1u, s[t], 0);                          // MASK_WITHOUT_CALLER
  } else if (which == 4) {
    if (t == 5) __trap();
  } else if (which == 5) {
    assert(t != 7);                                               // ASSERT
  } else if (which == 6) {  // warp collective waits while another lane sits at a barrier: deadlock
    if (lane == 0) out[t] = __shfl_sync(0x3u, s[t], 1);           // DEADLOCK_SHFL
    else __syncthreads();                                         // DEADLOCK_BARRIER
  }
  __syncthreads();
  out[t] = s[t];
}

// Dynamic shared memory of the launch's size: thread t writes bytes [t*chunk, (t+1)*chunk) and reads them back.
extern "C" __global__ void dynamic_fill(unsigned char* out, int chunk) {
  extern __shared__ __align__(16) unsigned char smem[];
  int t = threadIdx.x;
  for (int i = 0; i < chunk; i++) smem[t * chunk + i] = (unsigned char)(t + i);
  __syncthreads();
  for (int i = 0; i < chunk; i++) out[blockIdx.x * blockDim.x * chunk + t * chunk + i] = smem[t * chunk + i];
}

// Atomics from many blocks at once (blocks run on several OS threads).
extern "C" __global__ void atomics(float* fsum, double* dsum, int* isum, unsigned long long* usum, int* imax) {
  atomicAdd(fsum, 1.0f);
  atomicAdd(dsum, 0.5);
  atomicAdd(isum, 1);
  atomicAdd(usum, 2ull);
  atomicMax(imax, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}

// Intrinsics and vector types kernels use.
extern "C" __global__ void intrinsics(const float* x, float* out, int* sizes) {
  int t = threadIdx.x;
  float v = __ldg(&x[t]);
  out[8 * t + 0] = __expf(v);
  out[8 * t + 1] = exp2f(v);
  out[8 * t + 2] = __fdividef(v, 3.0f);
  out[8 * t + 3] = fmaxf(v, 0.25f);
  out[8 * t + 4] = rsqrtf(v + 2.0f);
  out[8 * t + 5] = max(v, -v);
  out[8 * t + 6] = (float)min(t, 3);
  float4 f4 = make_float4(v, v, v, v);
  out[8 * t + 7] = f4.w + __int_as_float(__float_as_int(1.0f));
  if (t == 0) {
    int k = 0;
    sizes[k++] = sizeof(float2); sizes[k++] = alignof(float2);
    sizes[k++] = sizeof(float4); sizes[k++] = alignof(float4);
    sizes[k++] = sizeof(uint4); sizes[k++] = alignof(uint4);
    sizes[k++] = sizeof(int4); sizes[k++] = alignof(int4);
    sizes[k++] = sizeof(__half2); sizes[k++] = alignof(__half2);
    sizes[k++] = sizeof(__nv_bfloat162); sizes[k++] = alignof(__nv_bfloat162);
    sizes[k++] = sizeof(double2); sizes[k++] = alignof(double2);
    sizes[k++] = sizeof(float3); sizes[k++] = alignof(float3);
  }
}

// Arguments of every kind, written back so the test sees what arrived.
struct Params { int a; float b; long long c; };
extern "C" __global__ void echo(double* out, int i, unsigned u, long long ll, float f, double d, bool flag,
                                Params p, const float* maybe_null) {
  out[0] = i; out[1] = u; out[2] = (double)ll; out[3] = f; out[4] = d; out[5] = flag;
  out[6] = p.a; out[7] = p.b; out[8] = (double)p.c; out[9] = maybe_null == nullptr;
}

// The issue's speed yardstick: a 128-thread block reduction with exactly 10 barriers per thread.
extern "C" __global__ void reduce10(const float* in, float* out) {
  __shared__ float s[128];
  int t = threadIdx.x;
  s[t] = in[blockIdx.x * 128 + t];
  __syncthreads();                                  // 1
  for (int k = 64; k > 0; k >>= 1) {                // 2..8
    if (t < k) s[t] += s[t + k];
    __syncthreads();
  }
  float total = s[0];
  __syncthreads();                                  // 9
  s[t] = total;
  __syncthreads();                                  // 10
  if (t == 0) out[blockIdx.x] = s[127];
}
