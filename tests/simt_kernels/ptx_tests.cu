// Kernels that exercise each PTX wrapper of cuflash/kernels/ptx.cuh and ptx_extra.cuh one warp at a time. They run
// unchanged on a GPU (through CuPy) and in the emulator; tests compare per-lane registers between the two and with
// NumPy. Prepend common.cuh, ptx.cuh and ptx_extra.cuh to this file to get the source string.

// One mma per warp with registers taken straight from memory: a_regs[lane][4], b_regs[lane][2],
// c_regs[lane][4] in, d_regs[lane][4] out. Kind: 0 m16n8k16.f16, 1 m16n8k16.bf16, 2 m16n8k8.f16, 3 m16n8k8.tf32.
template <int Kind>
__global__ void mma_regs(const unsigned* a_regs, const unsigned* b_regs, const float* c_regs, float* d_regs) {
  int lane = threadIdx.x;
  unsigned a[4], b[2];
  float c[4], d[4];
  for (int i = 0; i < 4; i++) a[i] = a_regs[4 * lane + i];
  for (int i = 0; i < 2; i++) b[i] = b_regs[2 * lane + i];
  for (int i = 0; i < 4; i++) c[i] = c_regs[4 * lane + i];
  if (Kind == 0) cuflash::ptx::mma_m16n8k16_f16(d, a, b, c);
  if (Kind == 1) cuflash::ptx::mma_m16n8k16_bf16(d, a, b, c);
  if (Kind == 2) {
    unsigned a2[2] = {a[0], a[1]}, b1[1] = {b[0]};
    cuflash::ptx::mma_m16n8k8_f16(d, a2, b1, c);
  }
  if (Kind == 3) cuflash::ptx::mma_m16n8k8_tf32(d, a, b, c);
  for (int i = 0; i < 4; i++) d_regs[4 * lane + i] = d[i];
}

// One mma.m8n8k4.f64 per warp: a[lane], b[lane] and c[lane][2] in, d[lane][2] out; in_place: the mma writes D
// over its C registers (d and c the same array), as an accumulating kernel does.
__global__ void mma_f64_regs(const double* a, const double* b, const double* c, double* d, int in_place) {
  int lane = threadIdx.x;
  double acc[2] = {c[2 * lane], c[2 * lane + 1]}, out[2];
  if (in_place) {
    cuflash::ptx::mma_m8n8k4_f64(acc, a[lane], b[lane], acc);
    for (int i = 0; i < 2; i++) out[i] = acc[i];
  } else {
    cuflash::ptx::mma_m8n8k4_f64(out, a[lane], b[lane], acc);
  }
  for (int i = 0; i < 2; i++) d[2 * lane + i] = out[i];
}

// cvt.rna.tf32.f32 of n float bit patterns, a grid-stride loop (any launch shape): out[i] is bits[i]'s result.
__global__ void cvt_tf32_regs(const unsigned* bits, unsigned* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = cuflash::ptx::cvt_rna_tf32(__uint_as_float(bits[i]));
}

// ldmatrix of N 8x8 b16 matrices from a 32-row x 8-column shared tile (row j*8+r of the tile is row r of
// matrix j); lane L points at tile row perm[L] (a permutation tests that addresses, not lane order, decide).
// Out: regs[lane][N].
template <int N, bool Trans>
__global__ void ldmatrix_regs(const unsigned short* tile, const int* perm, unsigned* regs) {
  __shared__ __align__(16) unsigned short s[32 * 8];
  int lane = threadIdx.x;
  for (int i = 0; i < 8; i++) s[lane * 8 + i] = tile[lane * 8 + i];
  __syncwarp();
  unsigned r[N];
  const unsigned short* row = s + 8 * perm[lane];
  if (N == 1 && !Trans) cuflash::ptx::ldmatrix_x1(*reinterpret_cast<unsigned(*)[1]>(r), row);
  if (N == 2 && !Trans) cuflash::ptx::ldmatrix_x2(*reinterpret_cast<unsigned(*)[2]>(r), row);
  if (N == 4 && !Trans) cuflash::ptx::ldmatrix_x4(*reinterpret_cast<unsigned(*)[4]>(r), row);
  if (N == 1 && Trans) cuflash::ptx::ldmatrix_x1_trans(*reinterpret_cast<unsigned(*)[1]>(r), row);
  if (N == 2 && Trans) cuflash::ptx::ldmatrix_x2_trans(*reinterpret_cast<unsigned(*)[2]>(r), row);
  if (N == 4 && Trans) cuflash::ptx::ldmatrix_x4_trans(*reinterpret_cast<unsigned(*)[4]>(r), row);
  for (int j = 0; j < N; j++) regs[lane * N + j] = r[j];
}

__device__ __forceinline__ void mma_by_type(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                            const float (&c)[4], const __half*) {
  cuflash::ptx::mma_m16n8k16_f16(d, a, b, c);
}
__device__ __forceinline__ void mma_by_type(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                            const float (&c)[4], const __nv_bfloat16*) {
  cuflash::ptx::mma_m16n8k16_bf16(d, a, b, c);
}

// A 16x16 (row-major) times B 16x8 (given as B^T, 8x16 row-major, as the .col operand wants), plus C, the way a
// tensor-core kernel does it: tiles staged in shared memory with cp.async, fragments loaded with ldmatrix
// (A: x4; B: x2, or x2.trans from a row-major 16x8 B when TransB), one mma. T: __half or __nv_bfloat16.
// a: 16x16, b: TransB ? 16x8 (row-major K x N) : 8x16 (B^T), c and d: 16x8 float.
template <typename T, bool TransB>
__global__ void mma_tile(const T* a, const T* b, const float* c, float* d) {
  __shared__ __align__(16) T sA[16 * 16];
  __shared__ __align__(16) T sB[16 * 8];
  int lane = threadIdx.x;
  // 16x16 halves = 512 bytes = 32 chunks of 16 bytes; 16x8 = 16 chunks.
  cuflash::ptx::cp_async_cg16(sA + 8 * lane, a + 8 * lane);
  if (lane < 16) cuflash::ptx::cp_async_ca16(sB + 8 * lane, b + 8 * lane);
  cuflash::ptx::cp_async_commit();
  cuflash::ptx::cp_async_wait<0>();
  __syncwarp();
  unsigned fa[4], fb[2];
  // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3's layout.
  int r = lane % 16, kc = (lane / 16) * 8;
  cuflash::ptx::ldmatrix_x4(fa, sA + r * 16 + kc);
  if (TransB) {
    // Row-major B (k rows of 8): matrices k 0-7 and k 8-15, transposed so each lane holds two consecutive k.
    cuflash::ptx::ldmatrix_x2_trans(fb, sB + (lane % 16) * 8);
  } else {
    // B^T rows are n, columns k: matrices (n 0-7, k 0-7) and (n 0-7, k 8-15).
    cuflash::ptx::ldmatrix_x2(fb, sB + (lane % 8) * 16 + ((lane / 8) % 2) * 8);
  }
  float acc[4], out[4];
  for (int i = 0; i < 4; i++) acc[i] = c[(lane / 4 + 8 * (i / 2)) * 8 + 2 * (lane % 4) + i % 2];
  mma_by_type(out, fa, fb, acc, (const T*)nullptr);
  for (int i = 0; i < 4; i++) d[(lane / 4 + 8 * (i / 2)) * 8 + 2 * (lane % 4) + i % 2] = out[i];
}

// cp.async lands at the wait, not at issue: each thread copies 16 bytes of src into a poisoned buffer, reads
// it before the wait (before[]), waits, reads again (after[]). Then a two-group pipeline: wait_group 1 must
// land the first group only (mid[]). src_bytes: how many of the 16 bytes are read (the rest zero-filled).
__global__ void cp_async_order(const float4* src, const float4* src2, float4* before, float4* mid, float4* after,
                               int src_bytes) {
  __shared__ __align__(16) float4 s[64];
  __shared__ __align__(16) float4 s2[64];
  int t = threadIdx.x;
  s[t] = make_float4(-1.f, -1.f, -1.f, -1.f);
  s2[t] = make_float4(-2.f, -2.f, -2.f, -2.f);
  cuflash::ptx::cp_async_cg16(&s[t], &src[t], src_bytes);
  cuflash::ptx::cp_async_commit();
  cuflash::ptx::cp_async_ca16(&s2[t], &src2[t]);
  cuflash::ptx::cp_async_commit();
  before[t] = s[t];
  cuflash::ptx::cp_async_wait<1>();
  mid[t] = s2[t];
  after[t] = s[t];
  cuflash::ptx::cp_async_wait_all();
  mid[64 + t] = s2[t];
}
