// ptx_extra.cuh: the PTX wrappers only the tests use (cuflash's kernels call none of them), written the way
// cuflash/kernels/ptx.cuh writes its own: the asm under __CUDA_ARCH__, otherwise the emulator's twin from the PTX
// ISA, in namespace cuflash::ptx on ptx.cuh's twin machinery and wrapper macros. The source strings of the test
// kernels put it right after ptx.cuh (tests/simt/simt_util.py), so the emulator, NVRTC and the GPU check
// (tests/simt/test_hardware.py) all take it. A wrapper moves into ptx.cuh once a kernel calls it (so did mma.m16n8k8
// with tf32 inputs, and its shape M16N8K8_TF32).
#ifndef CUFLASH_PTX_EXTRA_CUH
#define CUFLASH_PTX_EXTRA_CUH

namespace cuflash {
namespace ptx {

#if !defined(__CUDA_ARCH__)
namespace twin {

// The m16n8k8 shape with f16 inputs, as ptx.cuh's M16N8K16 and M16N8K8_TF32 (which see).
// m16n8k8, f16 inputs: two elements per register, element e in register e/2; B is m16n8k16's first register.
struct M16N8K8_F16 {
  static constexpr int K = 8, NA = 4, NB = 2;
  static void a_pos(int lane, int e, int& row, int& k) {
    int g = lane >> 2, t = lane & 3;
    int r = e >> 1, h = e & 1;                                                      // element e in register e/2
    row = g + 8 * r; k = 2 * t + h;                                                 // a0,a1 | a2,a3
  }
  static void b_pos(int lane, int e, int& k, int& col) { M16N8K16<false>::b_pos(lane, e, k, col); }  // b0,b1
  static double elem(const unsigned* regs, int e) { return (double)elem16(regs[e >> 1], e & 1, false); }
};

}  // namespace twin
#endif  // !__CUDA_ARCH__

// ---- mma.sync m16n8k8 with f16 inputs (the notation, m16n8k16 and m16n8k8 with tf32 inputs are in ptx.cuh) -----
// m16n8k8, f16 inputs. A: a[r] holds (row g + 8r, cols 2t + {0,1}); B: b[0] holds (rows 2t + {0,1}, col g).
__device__ __forceinline__ void mma_m16n8k8_f16(float (&d)[4], const unsigned (&a)[2], const unsigned (&b)[1],
                                                const float (&c)[4] CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  twin::mma<twin::M16N8K8_F16>(d, a, b, c, "mma.m16n8k8.f16", file, line);
#endif
}

// ---- ldmatrix .x1 and .x2, plain and .trans, through ptx.cuh's CUFLASH_LDMATRIX --------------------------------
#define CUFLASH_OUT1 "=r"(r[0])
#define CUFLASH_OUT2 "=r"(r[0]), "=r"(r[1])
CUFLASH_LDMATRIX(ldmatrix_x1, 1, false, "ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n", CUFLASH_OUT1)
CUFLASH_LDMATRIX(ldmatrix_x2, 2, false, "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n", CUFLASH_OUT2)
CUFLASH_LDMATRIX(ldmatrix_x1_trans, 1, true, "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n",
                 CUFLASH_OUT1)
CUFLASH_LDMATRIX(ldmatrix_x2_trans, 2, true, "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n",
                 CUFLASH_OUT2)
#undef CUFLASH_LDMATRIX
#undef CUFLASH_OUT1
#undef CUFLASH_OUT2

// ---- cp.async.ca of 16 bytes through ptx.cuh's CUFLASH_CP_ASYNC, and cp.async.wait_all -------------------------
CUFLASH_CP_ASYNC(cp_async_ca16, "ca", 16)
#undef CUFLASH_CP_ASYNC

// Wait for every copy this thread issued (committed or not), like cp.async.wait_all.
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#else
  ::cuflash_simt::cp_async_commit();
  ::cuflash_simt::cp_async_wait(0);
#endif
}

}  // namespace ptx
}  // namespace cuflash

#endif  // CUFLASH_PTX_EXTRA_CUH
