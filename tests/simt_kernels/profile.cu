// Kernels whose shared-memory bank conflicts, global sectors and barriers are known by construction, for the
// emulator's profile mode (tests/simt/test_simt_profile.py). One warp each unless said otherwise. Prepend
// common.cuh, ptx.cuh and ptx_extra.cuh to this file to get the source string.

// Each lane reads the float at word (lane * stride) % 1024 of a shared array: stride 1 is one wavefront, stride 32
// puts every lane on bank 0 (32 wavefronts), stride 0 is one word for all (a broadcast: one wavefront).
extern "C" __global__ void shared_stride(const float* in, float* out, int stride) {
  __shared__ float s[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) s[i] = in[i];  // PROFILE_FILL
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x * stride) % 1024];  // PROFILE_STRIDE
}

// 16-byte loads: lane L reads float4 number (L * stride) % 64. Stride 1: four phases of 8 lanes, each 128
// contiguous bytes: 4 wavefronts, no conflict. Stride 8: the 8 lanes of a phase all start on bank 0: 8 each.
extern "C" __global__ void shared_vector(const float4* in, float4* out, int stride) {
  __shared__ float4 s[64];
  for (int i = threadIdx.x; i < 64; i += blockDim.x) s[i] = in[i];
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x * stride) % 64];  // PROFILE_VECTOR
}

// ldmatrix.x4 of four 8x8 matrices of halves stacked in 32 rows of `pitch` halves: lane L names row L. A pitch of
// 64 halves (128 bytes) puts the 8 rows of a matrix on the same four banks (8 wavefronts each); 72 (144 bytes)
// spreads them over all 32 (one each).
extern "C" __global__ void ldmatrix_pitch(const unsigned short* in, unsigned* out, int pitch) {
  __shared__ __align__(16) unsigned short s[32 * 72];
  for (int i = threadIdx.x; i < 32 * 72; i += blockDim.x) s[i] = in[i];
  __syncwarp();
  unsigned r[4];
  cuflash::ptx::ldmatrix_x4(r, s + threadIdx.x * pitch);  // PROFILE_LDMATRIX
  for (int j = 0; j < 4; j++) out[4 * threadIdx.x + j] = r[j];
}

// Global loads of floats: lane L reads in[L * stride]. Stride 1: 128 bytes, 4 sectors; stride 8: 32 sectors.
extern "C" __global__ void global_stride(const float* in, float* out, int stride) {
  out[threadIdx.x] = in[threadIdx.x * stride];  // PROFILE_GLOBAL
}

// `times` barriers in a loop, in a block of `blockDim.x` threads.
extern "C" __global__ void barriers(float* out, int times) {
  for (int i = 0; i < times; i++) __syncthreads();  // PROFILE_BARRIER
  out[threadIdx.x] = 1.0f;
}
