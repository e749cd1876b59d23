// Misuse of the PTX wrappers the emulator must report (undefined behaviour on a GPU). Prepend common.cuh, ptx.cuh,
// ptx_extra.cuh.
extern "C" __global__ void ptx_misuse(const unsigned short* g, float* out, int which) {
  __shared__ __align__(16) unsigned short s[32 * 8 + 8];
  int lane = threadIdx.x;
  for (int i = 0; i < 8; i++) s[lane * 8 + i] = 0;
  __syncwarp(__activemask());  // the lanes that exist: with 16 threads, the mma below is what must fail
  unsigned r[4];
  if (which == 0) cuflash::ptx::ldmatrix_x4(r, g + 8 * lane);          // MISUSE_0: a global address
  if (which == 1) cuflash::ptx::ldmatrix_x4(r, s + 8 * lane + 1);      // MISUSE_1: not 16-byte aligned
  if (which == 2) cuflash::ptx::cp_async_cg16(s + 1, g);               // MISUSE_2: misaligned destination
  if (which == 3) cuflash::ptx::cp_async_cg16(out, g);                 // MISUSE_3: destination not in shared memory
  if (which == 4 && lane < 16)                                         // half a warp
    cuflash::ptx::ldmatrix_x2(*reinterpret_cast<unsigned(*)[2]>(r), s);  // MISUSE_4
  if (which == 5) {                                                    // mma in a block of fewer than 32 threads
    unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0, 0, 0, 0};
    cuflash::ptx::mma_m16n8k16_f16(c, a, b, c);                        // MISUSE_5
  }
  out[lane] = 0;
}
