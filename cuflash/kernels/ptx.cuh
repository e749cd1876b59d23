// ptx.cuh: every inline PTX cuflash's kernels use, each in one small device function. Under __CUDA_ARCH__ the asm;
// in the SIMT emulator (CUFLASH_SIMT) a twin with exactly the instruction's per-lane semantics, written from the
// PTX ISA's fragment layouts, run as a warp collective (every lane of the warp must reach it, as .sync.aligned
// demands on the GPU). Registers are `unsigned` (32 bits; NVRTC has no <cstdint>). Wrappers only the tests use
// (mma.m16n8k8 with f16 inputs, ldmatrix .x1/.x2, cp.async.ca, wait_all) are written the same way beside those
// tests, in tests/simt_kernels/ptx_extra.cuh.
//
// Notation of the layouts below: g = lane / 4 (groupID), t = lane % 4 (thread in group); a 32-bit register of
// .f16x2/.bf16x2 holds its lower-numbered element in the low half.
#ifndef CUFLASH_PTX_CUH
#define CUFLASH_PTX_CUH

#if defined(__CUDA_ARCH__)
#define CUFLASH_PTX_CALLER
#else
// The emulator's twins take the caller's file and line (for messages) as defaulted trailing arguments.
#define CUFLASH_PTX_CALLER , const char* file = __builtin_FILE(), int line = __builtin_LINE()
#endif

namespace cuflash {
namespace ptx {

#if !defined(__CUDA_ARCH__)
// ---- the emulator's side: gather the warp's fragments into matrices, compute, scatter ----------------------
namespace twin {

struct MmaLane { float* d; const unsigned* a; const unsigned* b; const float* c; };

inline float elem16(unsigned reg, int half, bool bf16) {
  unsigned short bits = (unsigned short)(half ? reg >> 16 : reg & 0xffffu);
  return bf16 ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
}

// A shape's fragments: K (the depth), NA and NB (A's and B's elements per lane), where element e of lane `lane`'s
// fragment sits (A as (row, k), B as (k, col)) and its value (elem). The shapes the tests alone use are beside
// them, in tests/simt_kernels/ptx_extra.cuh.
// m16n8k16 with f16 inputs, bf16 when BF16: two elements per register, element e in register e/2.
template <bool BF16> struct M16N8K16 {
  static constexpr int K = 16, NA = 8, NB = 4;
  static void a_pos(int lane, int e, int& row, int& k) {
    int g = lane >> 2, t = lane & 3;
    int r = e >> 1, h = e & 1;                                                      // element e in register e/2
    row = g + 8 * (r & 1); k = 2 * t + h + 8 * (r >> 1);                            // a0,a1 | a2,a3 | a4,a5 | a6,a7
  }
  static void b_pos(int lane, int e, int& k, int& col) {
    int g = lane >> 2, t = lane & 3;
    col = g;
    k = 2 * t + (e & 1) + 8 * (e >> 1);                                             // b0,b1 | b2,b3
  }
  static double elem(const unsigned* regs, int e) { return (double)elem16(regs[e >> 1], e & 1, BF16); }
};
// m16n8k8, tf32 inputs: one element per register.
struct M16N8K8_TF32 {
  static constexpr int K = 8, NA = 4, NB = 2;
  static void a_pos(int lane, int e, int& row, int& k) {
    int g = lane >> 2, t = lane & 3;
    row = g + 8 * (e & 1); k = t + 4 * (e >> 1);                                    // a0..a3: one per register
  }
  static void b_pos(int lane, int e, int& k, int& col) {
    int g = lane >> 2, t = lane & 3;
    col = g;
    k = t + 4 * e;                                                                  // b0, b1
  }
  static double elem(const unsigned* regs, int e) {
    return (double)__uint_as_float(regs[e] & 0xffffe000u);  // tf32: the low 13 bits are ignored
  }
};
// C/D, the same for every shape: (row, col).
inline void cd_pos(int lane, int e, int& row, int& col) {
  row = (lane >> 2) + 8 * (e >> 1);
  col = 2 * (lane & 3) + (e & 1);
}

template <class S> inline void run_mma(void* const* lanes, unsigned) {
  double A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; lane++) {
    const MmaLane& L = *(const MmaLane*)lanes[lane];
    int r, c;
    for (int e = 0; e < S::NA; e++) {
      S::a_pos(lane, e, r, c);
      A[r][c] = S::elem(L.a, e);
    }
    for (int e = 0; e < S::NB; e++) {
      S::b_pos(lane, e, r, c);
      B[r][c] = S::elem(L.b, e);
    }
    for (int e = 0; e < 4; e++) {
      cd_pos(lane, e, r, c);
      C[r][c] = (double)L.c[e];
    }
  }
  // Every C read before any D written: d and c may be the same registers.
  for (int lane = 0; lane < 32; lane++) {
    const MmaLane& L = *(const MmaLane*)lanes[lane];
    for (int e = 0; e < 4; e++) {
      int r, c;
      cd_pos(lane, e, r, c);
      double acc = 0;
      for (int k = 0; k < S::K; k++) acc += A[r][k] * B[k][c];
      L.d[e] = (float)(acc + C[r][c]);
    }
  }
}

template <class S> inline void mma(float* d, const unsigned* a, const unsigned* b, const float* c, const char* name,
                                   const char* file, int line) {
  static const ::cuflash_simt::Collective op{name, run_mma<S>};
  MmaLane me{d, a, b, c};
  ::cuflash_simt::warp_collective(&op, 0xffffffffu, &me, file, line);
}

// mma.m8n8k4 with f64 everywhere: one element of A, one of B and two of C/D per lane (g = lane / 4, t = lane % 4):
// a is A's (row g, col t), b is B's (row t, col g), c[e] and d[e] are (row g, col 2t + e). Each D element is a
// chain of IEEE float64 fused multiply-adds in k order, d = fma(a3, b3, fma(a2, b2, fma(a1, b1, fma(a0, b0, c)))):
// the ISA does not fix the order of the four products (or how they are rounded); the hardware test
// (tests/simt/test_hardware.py) compares this choice with the GPU bit for bit.
struct MmaF64Lane { double* d; double a, b; const double* c; };
inline void run_mma_f64(void* const* lanes, unsigned) {
  double A[8][4], B[4][8], C[8][8];
  for (int lane = 0; lane < 32; lane++) {
    const MmaF64Lane& L = *(const MmaF64Lane*)lanes[lane];
    int g = lane >> 2, t = lane & 3;
    A[g][t] = L.a;
    B[t][g] = L.b;
    for (int e = 0; e < 2; e++) C[g][2 * t + e] = L.c[e];
  }
  // Every C read before any D written: d and c may be the same registers. -ftz flushes float32 alone: float64
  // subnormals stay, so the emulator's flush-to-zero mode (MXCSR's FTZ and DAZ) is off while this computes.
  const unsigned mxcsr = ::cuflash_simt::get_mxcsr();
  ::cuflash_simt::set_mxcsr(mxcsr & ~0x8040u);
  for (int lane = 0; lane < 32; lane++) {
    const MmaF64Lane& L = *(const MmaF64Lane*)lanes[lane];
    int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 2; e++) {
      int col = 2 * t + e;
      double acc = C[g][col];
      for (int k = 0; k < 4; k++) acc = std::fma(A[g][k], B[k][col], acc);
      L.d[e] = acc;
    }
  }
  ::cuflash_simt::set_mxcsr(mxcsr);
}
inline void mma_f64(double* d, double a, double b, const double* c, const char* file, int line) {
  static const ::cuflash_simt::Collective op{"mma.m8n8k4.f64", run_mma_f64};
  MmaF64Lane me{d, a, b, c};
  ::cuflash_simt::warp_collective(&op, 0xffffffffu, &me, file, line);
}

// ldmatrix: lane 8j + r gives the address of row r of matrix j; register j of lane L receives row L/4, 32-bit
// word L%4 (columns 2(L%4), 2(L%4)+1) of matrix j, or with .trans that place of the transposed matrix.
struct LdmLane { const void* row; unsigned* r; const char* file; int line; };  // row first: race mode reads it
template <int N, bool Trans> inline void run_ldmatrix(void* const* lanes, unsigned) {
  const ::cuflash_simt::Block& blk = *::cuflash_simt::tl.block;
  unsigned short M[4][8][8];
  for (int j = 0; j < N; j++)
    for (int r = 0; r < 8; r++) {
      const LdmLane& L = *(const LdmLane*)lanes[8 * j + r];
      const void* p = L.row;
      if ((unsigned long long)p % 16)
        ::cuflash_simt::fail_here("ldmatrix (%s:%d): lane %d's row address %p is not 16-byte aligned", L.file,
                                  L.line, 8 * j + r, p);
      if (!::cuflash_simt::in_shared(blk, p, 16))
        ::cuflash_simt::fail_here("ldmatrix (%s:%d): lane %d's row address %p is not in this block's shared memory",
                                  L.file, L.line, 8 * j + r, p);
      std::memcpy(M[j][r], p, 16);
    }
  for (int lane = 0; lane < 32; lane++) {
    const LdmLane& L = *(const LdmLane*)lanes[lane];
    int row = lane >> 2, col = 2 * (lane & 3);
    for (int j = 0; j < N; j++) {
      unsigned lo = Trans ? M[j][col][row] : M[j][row][col];
      unsigned hi = Trans ? M[j][col + 1][row] : M[j][row][col + 1];
      L.r[j] = lo | (hi << 16);
    }
  }
}
template <int N, bool Trans> inline void ldmatrix(unsigned* r, const void* row, const char* file, int line) {
  static const char* names[2][5] = {
      {"", "ldmatrix.x1", "ldmatrix.x2", "", "ldmatrix.x4"},
      {"", "ldmatrix.x1.trans", "ldmatrix.x2.trans", "", "ldmatrix.x4.trans"}};
  static const ::cuflash_simt::Collective op{names[Trans][N], run_ldmatrix<N, Trans>};
  LdmLane me{row, r, file, line};
  ::cuflash_simt::warp_collective(&op, 0xffffffffu, &me, file, line);
}

}  // namespace twin
#endif  // !__CUDA_ARCH__

// ---- shared-memory addresses ----------------------------------------------------------------------------------
// A shared-memory address as ldmatrix and cp.async take it: 32 bits in the shared window on the GPU (computed
// once, it takes a fragment's constant offset into the instruction), the pointer itself in the emulator.
struct SharedAddr {
#if defined(__CUDA_ARCH__)
  unsigned a;
#else
  unsigned char* a;
#endif
  __device__ __forceinline__ SharedAddr operator+(int bytes) const { return {a + bytes}; }
};
__device__ __forceinline__ SharedAddr shared_addr(const void* p) {
#if defined(__CUDA_ARCH__)
  return {static_cast<unsigned>(__cvta_generic_to_shared(p))};
#else
  return {static_cast<unsigned char*>(const_cast<void*>(p))};
#endif
}

// ---- ld.shared.b32 / ld.shared.b64: a 4- or 8-byte load from a shared-memory address ----------------------------
// For fragments read by plain loads (float's V, double's operands) from addresses carried as SharedAddr: the
// compiler then cannot lose the shared state space and fall back to generic loads. volatile keeps them in order
// with the barriers and cp.async waits (volatile asm) without fencing other memory accesses.
__device__ __forceinline__ unsigned ld_shared_b32(SharedAddr at) {
#if defined(__CUDA_ARCH__)
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(at.a));
  return v;
#else
  unsigned v;
  std::memcpy(&v, at.a, 4);
  return v;
#endif
}
__device__ __forceinline__ double ld_shared_f64(SharedAddr at) {
#if defined(__CUDA_ARCH__)
  double v;
  asm volatile("ld.shared.f64 %0, [%1];\n" : "=d"(v) : "r"(at.a));
  return v;
#else
  double v;
  std::memcpy(&v, at.a, 8);
  return v;
#endif
}

// ---- ex2.approx.ftz.f32: 2^x on the MUFU unit, subnormal inputs and results flushed to sign-preserving zero ---
// (CuPy compiles with -ftz=true, where exp2f is this instruction too; the wrapper makes it independent of flags.)
__device__ __forceinline__ float ex2_approx_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  const float min_normal = 1.17549435e-38f;  // 2^-126
  if (x != 0.0f && std::fabs(x) < min_normal) x = std::copysign(0.0f, x);
  const float y = std::exp2(x);
  return std::fabs(y) < min_normal && y != 0.0f ? std::copysign(0.0f, y) : y;
#endif
}

// ---- mma.sync: D = A * B + C with f32 accumulators; A row-major 16 x K, B column-major K x 8 ---------------
// m16n8k16, f16 or bf16 inputs. A: a[r] holds (row g + 8(r&1), cols 2t + 8(r>>1) + {0,1}); B: b[r] holds
// (rows 2t + 8r + {0,1}, col g); C/D: c[e] is (row g + 8(e>>1), col 2t + (e&1)).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                 const float (&c)[4] CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  twin::mma<twin::M16N8K16<false>>(d, a, b, c, "mma.m16n8k16.f16", file, line);
#endif
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                  const float (&c)[4] CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  twin::mma<twin::M16N8K16<true>>(d, a, b, c, "mma.m16n8k16.bf16", file, line);
#endif
}

// m16n8k8, tf32 inputs (f32 bit patterns; the low 13 mantissa bits are ignored). A: a[r] is (row g + 8(r&1),
// col t + 4(r>>1)); B: b[r] is (row t + 4r, col g).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                                 const float (&c)[4] CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  twin::mma<twin::M16N8K8_TF32>(d, a, b, c, "mma.m16n8k8.tf32", file, line);
#endif
}

// ---- mma.sync m8n8k4 with f64 A, B, C and D: D (8 x 8) = A (8 x 4, row-major) * B (4 x 8, column-major) + C -----
// a is A's (row g, col t), b is B's (row t, col g), c[e] and d[e] are (row g, col 2t + e); the emulator's twin
// computes each element as a chain of fused multiply-adds in k order (twin::run_mma_f64, which see).
__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], double a, double b,
                                               const double (&c)[2] CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%4,%5};\n"
               : "=d"(d[0]), "=d"(d[1])
               : "d"(a), "d"(b), "d"(c[0]), "d"(c[1]));
#else
  twin::mma_f64(d, a, b, c, file, line);
#endif
}

// ---- cvt.rna.tf32.f32: a float rounded to tf32 (10 explicit mantissa bits), ties away from zero ----------------
// The result is a .b32 holding the tf32 value as the tf32 mma takes it: a float's bit pattern with the low 13 bits
// zero (NaN aside). Not volatile: it is pure, and the compiler may merge or hoist it. The twin is written from the
// ISA: a finite x rounds its magnitude's bits, (bits + 0x1000) & 0xffffe000 (a carry into the exponent gives the
// next binade, or inf past the largest float); inf stays inf with its sign; NaN gives the canonical NaN
// 0x7fffffff. The hardware test (tests/simt/test_hardware.py) compares it with the GPU bit for bit.
__device__ __forceinline__ unsigned cvt_rna_tf32(float x CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  unsigned y;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(y) : "f"(x));
  return y;
#else
  (void)file;
  (void)line;
  const unsigned bits = __float_as_uint(x), sign = bits & 0x80000000u, mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7fffffffu;                                      // NaN: the canonical NaN
  if (mag == 0x7f800000u) return bits;                                            // +-inf
  return sign | ((mag + 0x1000u) & 0xffffe000u);
#endif
}

// ---- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}[.trans].shared.b16 (the kernels use .x4) ----------------------
// smem_row: this lane's row address (16 bytes, 16-byte aligned, in shared memory); lanes 8j..8j+7 give matrix j's
// rows (lanes past 8N give addresses the instruction ignores).
// Each width takes the row address as a SharedAddr or as a pointer.
#if defined(__CUDA_ARCH__)
#define CUFLASH_LDMATRIX(NAME, N, TRANS, PTX, OUTS)                                                       \
  __device__ __forceinline__ void NAME(unsigned (&r)[N], SharedAddr smem_row) {                          \
    unsigned addr = smem_row.a;                                                                           \
    asm volatile(PTX : OUTS : "r"(addr) : "memory");                                                     \
  }                                                                                                       \
  __device__ __forceinline__ void NAME(unsigned (&r)[N], const void* smem_row) { NAME(r, shared_addr(smem_row)); }
#else
#define CUFLASH_LDMATRIX(NAME, N, TRANS, PTX, OUTS)                                                       \
  __device__ __forceinline__ void NAME(unsigned (&r)[N], SharedAddr smem_row CUFLASH_PTX_CALLER) {      \
    twin::ldmatrix<N, TRANS>(r, smem_row.a, file, line);                                                  \
  }                                                                                                       \
  __device__ __forceinline__ void NAME(unsigned (&r)[N], const void* smem_row CUFLASH_PTX_CALLER) {     \
    twin::ldmatrix<N, TRANS>(r, smem_row, file, line);                                                    \
  }
#endif
#define CUFLASH_OUT4 "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
CUFLASH_LDMATRIX(ldmatrix_x4, 4, false, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n",
                 CUFLASH_OUT4)
CUFLASH_LDMATRIX(ldmatrix_x4_trans, 4, true,
                 "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n", CUFLASH_OUT4)
#undef CUFLASH_OUT4
// CUFLASH_LDMATRIX stays defined: tests/simt_kernels/ptx_extra.cuh stamps out the widths only the tests use.

// ---- cp.async: global -> shared without passing through registers -----------------------------------------
// Copies `bytes` (4, 8 or 16) from gmem to smem; when src_bytes < bytes, only src_bytes are read and the rest is
// zero-filled (src_bytes = 0 reads nothing: a masked tail). The bytes may land at any moment until the
// cp_async_wait that covers the copy's group: the destination is undefined in between, and the emulator reports
// any access to it there (memcheck and race modes) and lands copies early in seeded schedules.
// The destination as a SharedAddr or as a pointer.
#if defined(__CUDA_ARCH__)
#define CUFLASH_CP_ASYNC(NAME, CACHE, BYTES)                                                               \
  __device__ __forceinline__ void NAME(SharedAddr smem, const void* gmem, int src_bytes = BYTES) {       \
    asm volatile("cp.async." CACHE ".shared.global [%0], [%1], " #BYTES ", %2;\n"                       \
                 :: "r"(smem.a), "l"(__cvta_generic_to_global(gmem)), "r"(src_bytes) : "memory");         \
  }                                                                                                        \
  __device__ __forceinline__ void NAME(void* smem, const void* gmem, int src_bytes = BYTES) {            \
    NAME(shared_addr(smem), gmem, src_bytes);                                                              \
  }
#else
#define CUFLASH_CP_ASYNC(NAME, CACHE, BYTES)                                                               \
  __device__ __forceinline__ void NAME(SharedAddr smem, const void* gmem,                                  \
                                       int src_bytes = BYTES CUFLASH_PTX_CALLER) {                         \
    ::cuflash_simt::cp_async(smem.a, gmem, BYTES, src_bytes, file, line);                                  \
  }                                                                                                        \
  __device__ __forceinline__ void NAME(void* smem, const void* gmem, int src_bytes = BYTES CUFLASH_PTX_CALLER) { \
    ::cuflash_simt::cp_async(smem, gmem, BYTES, src_bytes, file, line);                                    \
  }
#endif
CUFLASH_CP_ASYNC(cp_async_cg16, "cg", 16)  // .cg (L2 only) exists for 16 bytes alone
CUFLASH_CP_ASYNC(cp_async_ca8, "ca", 8)

// The same copy of 16 whole bytes, without the source size (nothing to zero-fill, nothing to compute).
__device__ __forceinline__ void cp_async_cg16_whole(SharedAddr smem, const void* gmem CUFLASH_PTX_CALLER) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem.a), "l"(__cvta_generic_to_global(gmem))
               : "memory");
#else
  ::cuflash_simt::cp_async(smem.a, gmem, 16, 16, file, line);
#endif
}
// CUFLASH_CP_ASYNC stays defined: tests/simt_kernels/ptx_extra.cuh stamps out cp_async_ca16 with it.

// Close the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
  ::cuflash_simt::cp_async_commit();
#endif
}

// Wait until at most N of this thread's most recent committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#else
  ::cuflash_simt::cp_async_wait(N);
#endif
}

}  // namespace ptx
}  // namespace cuflash

#endif  // CUFLASH_PTX_CUH
