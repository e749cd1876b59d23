// cuflash_simt.h: the SIMT emulator's runtime. With it, g++ compiles the CUDA C++ device code that
// NVRTC compiles, and runs each CUDA thread as a fiber on the CPU.
//
// One block runs its fibers cooperatively on one OS thread; blocks run in parallel on several OS threads
// (one in the memcheck and race builds). A fiber runs until it blocks: at __syncthreads(), at a warp
// collective (shuffles, votes, mma, ldmatrix ...) or when it exits. The scheduler then picks the next
// ready fiber in the launch's order (forward, reverse or drawn from a seed). Everything a GPU leaves
// undefined and that a test should hear about (barrier divergence, a warp collective some lane never
// reaches, a deadlock, __trap, a failed assert) ends the launch with a message, never a hang or a crash.
//
// Build macros (set by the Python side): CUFLASH_SIMT_MEMCHECK (AddressSanitizer build), CUFLASH_SIMT_RACE
// (ThreadSanitizer build), CUFLASH_SIMT_FTZ (flush float32 denormals, like CuPy's -ftz=true).
#ifndef CUFLASH_SIMT_H
#define CUFLASH_SIMT_H

#ifndef CUFLASH_SIMT
#define CUFLASH_SIMT 1
#endif

#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
// g++ says __SANITIZE_ADDRESS__; older clang only answers __has_feature. Every switch of stacks must be
// announced to ASan when it is on, or it reports false stack overflows.
#if defined(__SANITIZE_ADDRESS__)
#define CUFLASH_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUFLASH_SIMT_ASAN 1
#endif
#endif
#if defined(CUFLASH_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
extern "C" void __asan_report_load_n(void* addr, size_t size);  // ASan's own reporters (not in its public header)
extern "C" void __asan_report_store_n(void* addr, size_t size);
#endif
#if defined(CUFLASH_SIMT_RACE)
// ThreadSanitizer's fiber and annotation interface (declared here: not every compiler ships its header).
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_set_fiber_name(void* fiber, const char* name);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
void __tsan_read_range(void* addr, unsigned long size);
}
#endif

// ------------------------------------------------------------------------------------------------
// 1. CUDA keywords. __shared__ declarations are rewritten by the Python side (cuflash/simt/_source.py) so
//    that each block gets fresh, poisoned shared memory; this macro only serves declarations it did not see.
// ------------------------------------------------------------------------------------------------
#if defined(CUFLASH_SIMT_MEMCHECK) || defined(CUFLASH_SIMT_RACE)
#define CUFLASH_SIMT_SHARED static  // one OS thread runs every block; ASan instruments plain statics only
#else
#define CUFLASH_SIMT_SHARED static thread_local  // one block per OS thread at a time
#endif
#define __shared__ CUFLASH_SIMT_SHARED
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
// __restrict__ is a g++ keyword already.

// ------------------------------------------------------------------------------------------------
// 2. Vector types, with CUDA's sizes and alignments.
// ------------------------------------------------------------------------------------------------
#define CUFLASH_SIMT_VEC1(N, T, A) \
  struct __attribute__((aligned(A))) N { T x; }; \
  static inline N make_##N(T x) { N v; v.x = x; return v; }
#define CUFLASH_SIMT_VEC2(N, T, A) \
  struct __attribute__((aligned(A))) N { T x, y; }; \
  static inline N make_##N(T x, T y) { N v; v.x = x; v.y = y; return v; }
#define CUFLASH_SIMT_VEC3(N, T, A) \
  struct __attribute__((aligned(A))) N { T x, y, z; }; \
  static inline N make_##N(T x, T y, T z) { N v; v.x = x; v.y = y; v.z = z; return v; }
#define CUFLASH_SIMT_VEC4(N, T, A) \
  struct __attribute__((aligned(A))) N { T x, y, z, w; }; \
  static inline N make_##N(T x, T y, T z, T w) { N v; v.x = x; v.y = y; v.z = z; v.w = w; return v; }
#define CUFLASH_SIMT_VECS(P, T, A1, A2, A3, A4) \
  CUFLASH_SIMT_VEC1(P##1, T, A1) CUFLASH_SIMT_VEC2(P##2, T, A2) \
  CUFLASH_SIMT_VEC3(P##3, T, A3) CUFLASH_SIMT_VEC4(P##4, T, A4)
CUFLASH_SIMT_VECS(char, signed char, 1, 2, 1, 4)
CUFLASH_SIMT_VECS(uchar, unsigned char, 1, 2, 1, 4)
CUFLASH_SIMT_VECS(short, short, 2, 4, 2, 8)
CUFLASH_SIMT_VECS(ushort, unsigned short, 2, 4, 2, 8)
CUFLASH_SIMT_VECS(int, int, 4, 8, 4, 16)
CUFLASH_SIMT_VECS(uint, unsigned int, 4, 8, 4, 16)
CUFLASH_SIMT_VECS(long, long, 8, 16, 8, 16)
CUFLASH_SIMT_VECS(ulong, unsigned long, 8, 16, 8, 16)
CUFLASH_SIMT_VECS(longlong, long long, 8, 16, 8, 16)
CUFLASH_SIMT_VECS(ulonglong, unsigned long long, 8, 16, 8, 16)
CUFLASH_SIMT_VECS(float, float, 4, 8, 4, 16)
CUFLASH_SIMT_VECS(double, double, 8, 16, 8, 16)

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ------------------------------------------------------------------------------------------------
// 3. __half and __nv_bfloat16: 16 bits each, conversions round to nearest even bit-exactly like NumPy's
//    float16 and ml_dtypes' bfloat16 (NaN becomes the canonical 0x7fff, as on the GPU), arithmetic through
//    double so every operation rounds once (double has more than 2p+2 bits, so double rounding is harmless).
// ------------------------------------------------------------------------------------------------
namespace cuflash_simt {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint64_t f64_bits(double f) { uint64_t u; std::memcpy(&u, &f, 8); return u; }

// A 16-bit float (P significand bits counting the implicit one, exponent bias B) from a double, rounded to
// nearest even once. Integer arithmetic only: MXCSR's flush-to-zero (the emulation of -ftz) must not touch
// 16-bit values, whose denormals the GPU keeps. (float -> double is exact, so this also serves floats.)
template <int P, int B> inline unsigned short f64_to_small(double v) {
  constexpr unsigned short inf = (unsigned short)(((1u << (15 - (P - 1))) - 1) << (P - 1));
  uint64_t x = f64_bits(v);
  unsigned short sign = (unsigned short)((x >> 48) & 0x8000);
  uint64_t ax = x & 0x7fffffffffffffffull;
  if (ax > 0x7ff0000000000000ull) return 0x7fff;                     // NaN: the canonical pattern
  int e = (int)(ax >> 52);                                           // biased double exponent
  uint64_t m = (ax & 0xfffffffffffffull) | (e ? (1ull << 52) : 0);   // 53-bit significand: value = m 2^(e-1075)
  if (e == 0) e = 1;
  int exp2 = e - 1023;                                               // floor(log2(value)) for normal doubles
  if (exp2 > B) return sign | inf;                                   // beyond the largest binade
  int ulp = (exp2 < 1 - B ? 1 - B : exp2) - (P - 1);                 // log2 of the result's unit in the last place
  int shift = ulp - (e - 1075);                                      // bits of m below that unit (>= 53 - P)
  if (shift > 60) return sign;                                       // far below half the smallest subnormal
  uint64_t q = m >> shift, rem = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) q++;
  if (exp2 < 1 - B) return sign | (unsigned short)q;                 // subnormal; q == 2^(P-1) is the smallest normal
  // q carries the implicit bit; a carry out of the significand bumps the exponent (up to inf, exactly).
  return sign | (unsigned short)(((unsigned)(exp2 + B) << (P - 1)) + (unsigned)(q - (1ull << (P - 1))));
}
inline unsigned short f64_to_f16(double v) { return f64_to_small<11, 15>(v); }

inline float f16_to_f32(unsigned short h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    float mag = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact and a normal float
    return sign ? -mag : mag;
  }
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

// bfloat16 from float: round the top 16 bits to nearest even.
inline unsigned short f32_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline unsigned short f64_to_bf16(double v) { return f64_to_small<8, 127>(v); }
inline float bf16_to_f32(unsigned short b) { return bits_f32((uint32_t)b << 16); }
// bfloat16 denormals are float denormals, which MXCSR's denormals-are-zero would flush in a float -> double
// conversion: scale them in double instead.
inline double bf16_to_f64(unsigned short b) {
  if ((b & 0x7f80) == 0) {
    double mag = std::ldexp((double)(b & 0x7f), -133);
    return (b & 0x8000) ? -mag : mag;
  }
  return (double)bf16_to_f32(b);
}

}  // namespace cuflash_simt

struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

struct __align__(2) __half {
  unsigned short __x;
  __half() = default;
  constexpr __half(const __half_raw& r) : __x(r.x) {}
  __half(float f) : __x(cuflash_simt::f64_to_f16(f)) {}
  __half(double d) : __x(cuflash_simt::f64_to_f16(d)) {}
  __half(int i) : __x(cuflash_simt::f64_to_f16((double)i)) {}
  __half(unsigned i) : __x(cuflash_simt::f64_to_f16((double)i)) {}
  __half(long long i) : __x(cuflash_simt::f64_to_f16((double)i)) {}
  __half(unsigned long long i) : __x(cuflash_simt::f64_to_f16((double)i)) {}
  __half(short i) : __x(cuflash_simt::f64_to_f16((double)i)) {}
  __half(unsigned short i) : __x(cuflash_simt::f64_to_f16((double)i)) {}
  operator float() const { return cuflash_simt::f16_to_f32(__x); }
  operator __half_raw() const { return __half_raw{__x}; }
};

struct __align__(2) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
  __nv_bfloat16(float f) : __x(cuflash_simt::f32_to_bf16(f)) {}
  __nv_bfloat16(double d) : __x(cuflash_simt::f64_to_bf16(d)) {}
  __nv_bfloat16(int i) : __x(cuflash_simt::f64_to_bf16((double)i)) {}
  __nv_bfloat16(unsigned i) : __x(cuflash_simt::f64_to_bf16((double)i)) {}
  __nv_bfloat16(long long i) : __x(cuflash_simt::f64_to_bf16((double)i)) {}
  __nv_bfloat16(short i) : __x(cuflash_simt::f64_to_bf16((double)i)) {}
  __nv_bfloat16(unsigned short i) : __x(cuflash_simt::f64_to_bf16((double)i)) {}
  operator float() const { return cuflash_simt::bf16_to_f32(__x); }
  operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};

struct __align__(4) __half2 {
  __half x, y;
  __half2() = default;
  constexpr __half2(const __half& a, const __half& b) : x(a), y(b) {}
};
struct __align__(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  constexpr __nv_bfloat162(const __nv_bfloat16& a, const __nv_bfloat16& b) : x(a), y(b) {}
};
typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

namespace cuflash_simt {
inline __half mk_half(unsigned short b) { return __half(__half_raw{b}); }
inline __nv_bfloat16 mk_bf16(unsigned short b) { return __nv_bfloat16(__nv_bfloat16_raw{b}); }
inline double as_double(__half h) { return (double)f16_to_f32(h.__x); }
inline double as_double(__nv_bfloat16 h) { return bf16_to_f64(h.__x); }
inline __half round_to(double v, __half*) { return mk_half(f64_to_f16(v)); }
inline __nv_bfloat16 round_to(double v, __nv_bfloat16*) { return mk_bf16(f64_to_bf16(v)); }
template <class H> H rnd(double v) { return round_to(v, (H*)nullptr); }
}  // namespace cuflash_simt

// Conversions (CUDA's names).
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline __half __int2half_rn(int i) { return __half(i); }
inline float __half2float(__half h) { return cuflash_simt::f16_to_f32(h.__x); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__half(a), __half(b)); }
inline __half2 __float22half2_rn(float2 v) { return __half2(__half(v.x), __half(v.y)); }
inline __half2 __float2half2_rn(float a) { return __half2(__half(a), __half(a)); }
inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline __half2 __lowhigh2highlow(__half2 h) { return __half2(h.y, h.x); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __ushort_as_half(unsigned short b) { return cuflash_simt::mk_half(b); }
inline __half __short_as_half(short b) { return cuflash_simt::mk_half((unsigned short)b); }

inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  return cuflash_simt::mk_bf16(std::isnan(f) ? 0x7fff : (unsigned short)(cuflash_simt::f32_bits(f) >> 16));
}
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline float __bfloat162float(__nv_bfloat16 h) { return cuflash_simt::bf16_to_f32(h.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(b)); }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __nv_bfloat162(__nv_bfloat16(v.x), __nv_bfloat16(v.y)); }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(a)); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return make_float2(__bfloat162float(h.x), __bfloat162float(h.y)); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return __nv_bfloat162(a, a); }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat162 __lows2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.x, b.x); }
inline __nv_bfloat162 __highs2bfloat162(__nv_bfloat162 a, __nv_bfloat162 b) { return __nv_bfloat162(a.y, b.y); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) { return cuflash_simt::mk_bf16(b); }
inline __nv_bfloat16 __short_as_bfloat16(short b) { return cuflash_simt::mk_bf16((unsigned short)b); }

// Arithmetic and comparisons, for __half and __nv_bfloat16 alike (as CUDA overloads them).
#define CUFLASH_SIMT_H16_OPS(H, H2)                                                                    \
  inline H __hadd(H a, H b) { return cuflash_simt::rnd<H>(cuflash_simt::as_double(a) + cuflash_simt::as_double(b)); } \
  inline H __hsub(H a, H b) { return cuflash_simt::rnd<H>(cuflash_simt::as_double(a) - cuflash_simt::as_double(b)); } \
  inline H __hmul(H a, H b) { return cuflash_simt::rnd<H>(cuflash_simt::as_double(a) * cuflash_simt::as_double(b)); } \
  inline H __hdiv(H a, H b) { return cuflash_simt::rnd<H>(cuflash_simt::as_double(a) / cuflash_simt::as_double(b)); } \
  inline H __hfma(H a, H b, H c) {                                                                     \
    return cuflash_simt::rnd<H>(std::fma(cuflash_simt::as_double(a), cuflash_simt::as_double(b), cuflash_simt::as_double(c))); } \
  inline H __hneg(H a) { H r = a; r.__x ^= 0x8000; return r; }                                         \
  inline H __habs(H a) { H r = a; r.__x &= 0x7fff; return r; }                                         \
  inline bool __hisnan(H a) { return (a.__x & 0x7fffu) > cuflash_simt_inf_bits(a); }                \
  /* max/min: a NaN operand gives the other one; two NaNs give the canonical NaN */                   \
  inline H __hmax(H a, H b) {                                                                          \
    if (__hisnan(a)) return __hisnan(b) ? cuflash_simt::rnd<H>(NAN) : b;                               \
    return __hisnan(b) || cuflash_simt::as_double(a) >= cuflash_simt::as_double(b) ? a : b; }          \
  inline H __hmin(H a, H b) {                                                                          \
    if (__hisnan(a)) return __hisnan(b) ? cuflash_simt::rnd<H>(NAN) : b;                               \
    return __hisnan(b) || cuflash_simt::as_double(a) <= cuflash_simt::as_double(b) ? a : b; }          \
  inline bool __heq(H a, H b) { return cuflash_simt::as_double(a) == cuflash_simt::as_double(b); }    \
  inline bool __hne(H a, H b) { return cuflash_simt::as_double(a) != cuflash_simt::as_double(b) && !__hisnan(a) && !__hisnan(b); } \
  inline bool __hlt(H a, H b) { return cuflash_simt::as_double(a) < cuflash_simt::as_double(b); }     \
  inline bool __hle(H a, H b) { return cuflash_simt::as_double(a) <= cuflash_simt::as_double(b); }    \
  inline bool __hgt(H a, H b) { return cuflash_simt::as_double(a) > cuflash_simt::as_double(b); }     \
  inline bool __hge(H a, H b) { return cuflash_simt::as_double(a) >= cuflash_simt::as_double(b); }    \
  inline H operator+(const H& a, const H& b) { return __hadd(a, b); }                                  \
  inline H operator-(const H& a, const H& b) { return __hsub(a, b); }                                  \
  inline H operator*(const H& a, const H& b) { return __hmul(a, b); }                                  \
  inline H operator/(const H& a, const H& b) { return __hdiv(a, b); }                                  \
  inline H operator-(const H& a) { return __hneg(a); }                                                 \
  inline H operator+(const H& a) { return a; }                                                         \
  inline H& operator+=(H& a, const H& b) { return a = __hadd(a, b); }                                  \
  inline H& operator-=(H& a, const H& b) { return a = __hsub(a, b); }                                  \
  inline H& operator*=(H& a, const H& b) { return a = __hmul(a, b); }                                  \
  inline H& operator/=(H& a, const H& b) { return a = __hdiv(a, b); }                                  \
  inline bool operator==(const H& a, const H& b) { return __heq(a, b); }                               \
  inline bool operator!=(const H& a, const H& b) { return !__heq(a, b); }                              \
  inline bool operator<(const H& a, const H& b) { return __hlt(a, b); }                                \
  inline bool operator<=(const H& a, const H& b) { return __hle(a, b); }                               \
  inline bool operator>(const H& a, const H& b) { return __hgt(a, b); }                                \
  inline bool operator>=(const H& a, const H& b) { return __hge(a, b); }                               \
  inline H2 __hadd2(H2 a, H2 b) { return H2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }                     \
  inline H2 __hsub2(H2 a, H2 b) { return H2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }                     \
  inline H2 __hmul2(H2 a, H2 b) { return H2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }                     \
  inline H2 __h2div(H2 a, H2 b) { return H2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }                     \
  inline H2 __hfma2(H2 a, H2 b, H2 c) { return H2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }     \
  inline H2 __hmax2(H2 a, H2 b) { return H2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }                     \
  inline H2 __hmin2(H2 a, H2 b) { return H2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }                     \
  inline H2 __hneg2(H2 a) { return H2(__hneg(a.x), __hneg(a.y)); }                                     \
  inline H2 __habs2(H2 a) { return H2(__habs(a.x), __habs(a.y)); }                                     \
  inline H2 operator+(const H2& a, const H2& b) { return __hadd2(a, b); }                              \
  inline H2 operator-(const H2& a, const H2& b) { return __hsub2(a, b); }                              \
  inline H2 operator*(const H2& a, const H2& b) { return __hmul2(a, b); }                              \
  inline H2 operator/(const H2& a, const H2& b) { return __h2div(a, b); }                              \
  inline H2& operator+=(H2& a, const H2& b) { return a = __hadd2(a, b); }                              \
  inline H2& operator*=(H2& a, const H2& b) { return a = __hmul2(a, b); }

inline unsigned cuflash_simt_inf_bits(__half) { return 0x7c00; }
inline unsigned cuflash_simt_inf_bits(__nv_bfloat16) { return 0x7f80; }
CUFLASH_SIMT_H16_OPS(__half, __half2)
CUFLASH_SIMT_H16_OPS(__nv_bfloat16, __nv_bfloat162)
#undef CUFLASH_SIMT_H16_OPS
inline bool __hisinf(__half a) { return (a.__x & 0x7fff) == 0x7c00; }
inline bool __hisinf(__nv_bfloat16 a) { return (a.__x & 0x7fff) == 0x7f80; }

// ------------------------------------------------------------------------------------------------
// 4. Math and bit intrinsics: the emulator computes them accurately (the GPU's fast versions are close).
// ------------------------------------------------------------------------------------------------
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline int __float2int_rn(float f) { return (int)nearbyintf(f); }
inline int __float2int_rz(float f) { return (int)f; }
inline int __float2int_rd(float f) { return (int)floorf(f); }
inline int __float2int_ru(float f) { return (int)ceilf(f); }
inline unsigned __float2uint_rn(float f) { return (unsigned)nearbyintf(f); }
inline float __int2float_rn(int i) { return (float)i; }
inline float __uint2float_rn(unsigned i) { return (float)i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
// CUDA's min/max: float ones ignore NaN like fminf/fmaxf; a template covers mixed integer types.
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
template <class A, class B, class = std::enable_if_t<std::is_integral<A>::value && std::is_integral<B>::value>>
inline std::common_type_t<A, B> min(A a, B b) { using C = std::common_type_t<A, B>; return (C)a < (C)b ? (C)a : (C)b; }
template <class A, class B, class = std::enable_if_t<std::is_integral<A>::value && std::is_integral<B>::value>>
inline std::common_type_t<A, B> max(A a, B b) { using C = std::common_type_t<A, B>; return (C)a > (C)b ? (C)a : (C)b; }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }

// Cache-hinted loads and stores are plain accesses here.
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// Address-space conversions (the emulator has one address space).
inline size_t __cvta_generic_to_shared(const void* p) { return (size_t)p; }
inline size_t __cvta_generic_to_global(const void* p) { return (size_t)p; }
inline bool __isShared(const void*) { return true; }
inline bool __isGlobal(const void*) { return true; }

// ------------------------------------------------------------------------------------------------
// 5. Atomics: real atomics, since blocks run in parallel on several OS threads.
// ------------------------------------------------------------------------------------------------
namespace cuflash_simt {
template <class T, class F> inline T atomic_update(T* p, F f) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4- and 8-byte types");
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* q = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    T o; std::memcpy(&o, &old, sizeof(T));
    T n = f(o);
    U nb; std::memcpy(&nb, &n, sizeof(T));
    if (__atomic_compare_exchange_n(q, &old, nb, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return o;
  }
}
}  // namespace cuflash_simt
template <class T> inline T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  else return cuflash_simt::atomic_update(p, [v](T o) { return o + v; });
}
template <class T> inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicExch(T* p, T v) { return cuflash_simt::atomic_update(p, [v](T) { return v; }); }
template <class T> inline T atomicMin(T* p, T v) { return cuflash_simt::atomic_update(p, [v](T o) { return v < o ? v : o; }); }
template <class T> inline T atomicMax(T* p, T v) { return cuflash_simt::atomic_update(p, [v](T o) { return v > o ? v : o; }); }
template <class T> inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicCAS(T* p, T cmp, T v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned atomicInc(unsigned* p, unsigned v) {
  return cuflash_simt::atomic_update(p, [v](unsigned o) { return o >= v ? 0u : o + 1; });
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ------------------------------------------------------------------------------------------------
// 6. Fibers: a hand-written x86-64 context switch (callee-saved registers and the stack pointer: a few ns,
//    where swapcontext's signal-mask system call costs ~0.35 us), ucontext elsewhere. MXCSR and the x87
//    control word are not switched: kernels never change them, and each worker sets them once per launch.
// ------------------------------------------------------------------------------------------------
namespace cuflash_simt {

#if defined(__x86_64__)
extern "C" void cuflash_simt_switch(void** save_sp, void* load_sp);
extern "C" void cuflash_simt_trampoline();
asm(R"(
  .text
  .globl cuflash_simt_switch
  .hidden cuflash_simt_switch
  .type cuflash_simt_switch,@function
  .p2align 4
cuflash_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuflash_simt_switch, .-cuflash_simt_switch

  .globl cuflash_simt_trampoline
  .hidden cuflash_simt_trampoline
  .type cuflash_simt_trampoline,@function
  .p2align 4
cuflash_simt_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size cuflash_simt_trampoline, .-cuflash_simt_trampoline
)");

struct Context {
  void* sp = nullptr;
  // Lay out a frame that cuflash_simt_switch "returns" into: the trampoline then calls fn(arg).
  void init(char* lo, size_t size, void (*fn)(void*), void* arg) {
    uintptr_t top = (uintptr_t)(lo + size) & ~(uintptr_t)15;
    uint64_t* s = (uint64_t*)(top - 16);
    *--s = (uint64_t)(uintptr_t)&cuflash_simt_trampoline;  // return address (rsp % 16 == 0 after ret)
    *--s = 0;                                              // rbp: ends frame-pointer backtraces
    *--s = 0;                                              // rbx
    *--s = (uint64_t)(uintptr_t)arg;                       // r12
    *--s = (uint64_t)(uintptr_t)fn;                        // r13
    *--s = 0;                                              // r14
    *--s = 0;                                              // r15
    sp = s;
  }
};
inline void switch_context(Context& from, Context& to) { cuflash_simt_switch(&from.sp, to.sp); }
// Where the fiber's stack pointer stood when it last switched away (null: unknown).
inline char* saved_sp(const Context& c) { return (char*)c.sp; }
inline unsigned get_mxcsr() { unsigned m; asm volatile("stmxcsr %0" : "=m"(m)); return m; }
inline void set_mxcsr(unsigned m) { asm volatile("ldmxcsr %0" : : "m"(m)); }
#else
struct Context {
  ucontext_t uc;
  void init(char* lo, size_t size, void (*fn)(void*), void* arg) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = lo;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, (void (*)())fn, 1, arg);  // one pointer argument: fine on LP64 ABIs that pass it whole
  }
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline char* saved_sp(const Context&) { return nullptr; }
inline unsigned get_mxcsr() { return 0; }
inline void set_mxcsr(unsigned) {}
#endif

// Fiber stacks: mmap'd lazily (only touched pages cost memory), reused across blocks and launches, each with
// a PROT_NONE guard below it. Kernels are built with -fstack-clash-protection, which touches every page of a
// large frame in order, so an overflow faults in the guard (and the SIGSEGV handler can say so) instead of
// writing into whatever lies below; the guard is larger than a page only as a margin for code built without it.
constexpr size_t kStackGuard = 64 * 1024;
struct Stack {
  char* lo = nullptr;    // lowest usable byte (above the guard)
  size_t size = 0;
  // AddressSanitizer: the lowest byte whose shadow may hold poison left by frames that never returned (a
  // fiber's last switch leaves its whole call chain on the stack). Kept with the stack, not the fiber, so
  // that it survives into the next launch that reuses the stack.
  char* poison_lo = nullptr;
};
inline Stack map_stack(size_t size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size = (size + page - 1) / page * page;
  size_t guard = (kStackGuard + page - 1) / page * page;
  void* p = mmap(nullptr, size + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return Stack{};
  mprotect(p, guard, PROT_NONE);
  char* lo = (char*)p + guard;
  // A fresh mapping may reuse addresses whose shadow a dead mapping poisoned (not every libasan clears
  // shadow on mmap): treat the whole stack as suspect.
  return Stack{lo, size, lo};
}

// ------------------------------------------------------------------------------------------------
// 7. Launch, block and fiber state.
// ------------------------------------------------------------------------------------------------
enum class Order : int { forward = 0, reverse = 1, random = 2 };
enum FiberState : uint8_t { READY, RUNNING, AT_BARRIER, AT_WARP, DONE };

struct Block;
struct Launch;

// A warp collective: each lane deposits a pointer to its own operands; the last lane to arrive runs
// `run` over all of them (entries for lanes outside the mask are null).
struct Collective {
  const char* name;
  void (*run)(void* const* lanes, unsigned mask);
};
struct Arrival {
  const Collective* op = nullptr;
  unsigned mask = 0;
  int line = 0;
  void* data = nullptr;
  void* sync = nullptr;  // race mode: this collective's happens-before object, shared by its lanes
};
struct Warp {
  Arrival lane[32];
  unsigned arrived = 0;  // lanes waiting at a collective
  unsigned exited = 0;   // lanes that have returned
  unsigned present = 0;  // lanes that exist (a block's last warp may be partial)
};

struct CpAsync {
  void* dst;
  const void* src;
  int size, src_size;
  unsigned group;
};

struct Fiber {
  Context ctx;
  Block* block = nullptr;
  uint3 tid{0, 0, 0};
  unsigned linear = 0, lane = 0;
  FiberState state = READY;
  int line = 0;
  const char* what = "";
  std::vector<CpAsync> cp_queue;
  unsigned cp_committed = 0;  // cp.async groups committed so far
  char* stack_lo = nullptr;
  size_t stack_size = 0;
  void* fake_stack = nullptr;
  void* tsan = nullptr;  // race mode: ThreadSanitizer's fiber for this CUDA thread (one per block)
  int tsan_ignores = 0;  // its ignore count (TSan refuses to destroy a fiber whose count is not 0)
};

struct Launch {
  const char* kernel = "";
  void (*entry)(void**) = nullptr;
  void** args = nullptr;
  dim3 grid, block;
  unsigned nthreads = 0;
  unsigned long long nblocks = 0;
  size_t dyn_bytes = 0, smem_limit = 0, stack_size = 0;
  Order order = Order::forward;
  uint64_t seed = 0;
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  void* race_end = nullptr;  // race mode: every fiber releases it at block end; the scheduler acquires it
};

struct Block {
  Launch* launch = nullptr;
  uint3 idx{0, 0, 0};
  unsigned long long linear = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned> ready;  // ring buffer of fiber indices
  size_t head = 0, count = 0;
  unsigned at_barrier = 0, done = 0;
  int barrier_line = 0;
  int bar_votes = 0, bar_result = 0;  // __syncthreads_count/and/or
  uint64_t rng = 0;
  char* dyn = nullptr;
  std::vector<std::pair<const void*, size_t>> statics;  // static __shared__ arrays seen this block
  size_t static_bytes = 0;
  bool failed = false;
  std::string error;
  void* bar_sync = nullptr;  // race mode: the open barrier's happens-before object
};

struct StackSet;

// What the OS thread running a block knows; fibers read it through threadIdx & co.
struct Worker {
  Launch* launch = nullptr;
  StackSet* stacks = nullptr;
  Block* block = nullptr;
  Fiber* fiber = nullptr;
  Context sched;
  const void* sched_stack_bottom = nullptr;  // the OS thread's stack, for AddressSanitizer
  size_t sched_stack_size = 0;
  bool sched_stack_known = false;
  void* tsan_sched = nullptr;  // race mode: ThreadSanitizer's thread of the scheduler (the caller's)
};
inline thread_local Worker tl;

// ---- race mode: ThreadSanitizer checks the kernel's own accesses, nothing else ----
// The runtime's bookkeeping (queues, barrier counters, fiber state), which every fiber touches, runs with the
// fiber's accesses ignored; a fiber is always inside the runtime when it is switched out, so its ignore count
// is 1 except while it runs kernel code. Happens-before comes only from what CUDA orders: barriers, warp
// collectives, atomics (TSan's own), a fiber's creation (after the host wrote the inputs) and the launch's end.
#if defined(CUFLASH_SIMT_RACE)
inline void race_ignore_begin() {  // count after ignoring, uncount before ending: the counter is bookkeeping too
  __tsan_ignore_thread_begin();
  if (tl.fiber) tl.fiber->tsan_ignores++;
}
inline void race_ignore_end() {
  if (tl.fiber) tl.fiber->tsan_ignores--;
  __tsan_ignore_thread_end();
}
struct RaceRuntimeScope {
  RaceRuntimeScope() { race_ignore_begin(); }
  ~RaceRuntimeScope() { race_ignore_end(); }
};
#define CUFLASH_SIMT_RUNTIME_SCOPE ::cuflash_simt::RaceRuntimeScope cuflash_simt_runtime_scope_
// TSan's notion of the running thread follows every stack switch, with no happens-before of its own
// (flag 1 = __tsan_switch_to_fiber_no_sync): the emulator's switch order is not an ordering CUDA promises.
inline void race_switch(void* fiber) { __tsan_switch_to_fiber(fiber, 1); }
// One fresh heap object per barrier or collective episode: free() drops its clock, so no episode inherits
// another's (acquiring a reused object would order threads that CUDA leaves unordered).
inline void race_arrive(void*& sync) {
  if (!sync) sync = std::malloc(1);
  __tsan_release(sync);
}
inline void race_drop(void*& sync) {
  std::free(sync);
  sync = nullptr;
}
// A memory access the kernel makes through the runtime (ldmatrix's rows, cp.async's copies): checked.
struct RaceKernelAccess {
  RaceKernelAccess() { race_ignore_end(); }
  ~RaceKernelAccess() { race_ignore_begin(); }
};
#else
#define CUFLASH_SIMT_RUNTIME_SCOPE (void)0
#endif

// ---- messages ----
inline std::string vformat(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}
inline std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}
// "0-31,64,70-71" from a sorted list of thread indices.
inline std::string ranges(const std::vector<unsigned>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) j++;
    if (!s.empty()) s += ",";
    s += j == i ? format("%u", v[i]) : format("%u-%u", v[i], v[j]);
    i = j + 1;
  }
  return s;
}
inline std::string where(const Block& b) {
  return format("kernel '%s', block (%u,%u,%u)", b.launch->kernel, b.idx.x, b.idx.y, b.idx.z);
}
inline std::string thread_name(const Fiber& f) {
  return format("thread (%u,%u,%u) [linear %u, warp %u, lane %u]", f.tid.x, f.tid.y, f.tid.z, f.linear,
                f.linear / 32, f.lane);
}

// ---- sanitizer bookkeeping around stack switches ----
inline void asan_enter(void** fake_save, const void* bottom, size_t size) {
#if defined(CUFLASH_SIMT_ASAN)
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save; (void)bottom; (void)size;
#endif
}
inline void asan_landed(void* fake_save, const void** bottom_old, size_t* size_old) {
#if defined(CUFLASH_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
  (void)fake_save; (void)bottom_old; (void)size_old;
#endif
}

// Switch from the running fiber back to the scheduler; returns if the scheduler ever resumes this fiber.
inline void to_scheduler(Fiber* f, bool exiting = false) {
#if defined(CUFLASH_SIMT_RACE)
  race_switch(tl.tsan_sched);
#endif
  asan_enter(exiting ? nullptr : &f->fake_stack, tl.sched_stack_bottom, tl.sched_stack_size);
  switch_context(f->ctx, tl.sched);
  asan_landed(f->fake_stack, nullptr, nullptr);
}

// End the launch from inside a fiber: record the message and never run this block again.
[[noreturn]] inline void fail_fiber(const std::string& msg) {
  Fiber* f = tl.fiber;
  Block* b = f->block;
  if (!b->failed) {
    b->failed = true;
    b->error = msg;
  }
  to_scheduler(f, true);  // never resumed: let ASan drop its fake stack
  std::abort();  // unreachable: the scheduler never resumes a failed block
}
[[noreturn]] inline void fail_here(const char* fmt, ...) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  va_list ap;
  va_start(ap, fmt);
  std::string what = vformat(fmt, ap);
  va_end(ap);
  Fiber* f = tl.fiber;
  fail_fiber(where(*f->block) + ", " + thread_name(*f) + ": " + what);
}

// ---- the ready queue: a ring of fiber indices; its order is the schedule ----
inline void make_ready(Block& b, unsigned i) {
  b.fibers[i].state = READY;
  size_t at = b.head + b.count;
  if (at >= b.ready.size()) at -= b.ready.size();
  b.ready[at] = i;
  b.count++;
}
inline uint64_t next_random(Block& b) {  // splitmix64
  uint64_t z = (b.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline unsigned pick_ready(Block& b) {
  size_t n = b.ready.size();
  if (b.launch->order == Order::random && b.count > 1) {
    size_t k = (size_t)(next_random(b) % b.count);
    std::swap(b.ready[b.head], b.ready[(b.head + k) % n]);
  }
  unsigned i = b.ready[b.head];
  if (++b.head == n) b.head = 0;
  b.count--;
  return i;
}
inline void release_all(Block& b) {
  unsigned n = (unsigned)b.fibers.size();
  if (b.launch->order == Order::reverse)
    for (unsigned i = n; i-- > 0;) make_ready(b, i);
  else
    for (unsigned i = 0; i < n; i++) make_ready(b, i);
}

// The running fiber f (its state already set) gives way: straight to the next ready fiber, or back to
// the scheduler when none is ready (all done, a deadlock) or the block failed. Returns when f runs again.
inline void switch_away(Fiber* f, bool exiting = false) {
  Block& b = *f->block;
  if (b.count == 0 || b.failed) return to_scheduler(f, exiting);
  Fiber* next = &b.fibers[pick_ready(b)];
  next->state = RUNNING;
  if (next == f) return;
  tl.fiber = next;
#if defined(CUFLASH_SIMT_RACE)
  race_switch(next->tsan);
#endif
  asan_enter(exiting ? nullptr : &f->fake_stack, next->stack_lo, next->stack_size);
  switch_context(f->ctx, next->ctx);
  asan_landed(f->fake_stack, nullptr, nullptr);
}

// Put the running fiber back in the queue and let the scheduler pick (a scheduling point).
inline void yield() {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  make_ready(*f->block, f->linear);
  switch_away(f);
}

// ------------------------------------------------------------------------------------------------
// 8. __syncthreads and warp collectives.
// ------------------------------------------------------------------------------------------------
inline std::vector<unsigned> fibers_where(const Block& b, FiberState s) {
  std::vector<unsigned> v;
  for (const Fiber& f : b.fibers)
    if (f.state == s) v.push_back(f.linear);
  return v;
}

[[noreturn]] __attribute__((noinline, cold)) inline void barrier_misuse(Fiber* f, int line) {
  Block& b = *f->block;
  if (b.done)
    fail_fiber(where(b) + format(": thread %u reaches __syncthreads() (line %d) after threads %s exited; "
                                 "every thread of the block must reach each barrier",
                                 f->linear, line, ranges(fibers_where(b, DONE)).c_str()));
  fail_fiber(where(b) + format(": barrier divergence: threads %s wait at __syncthreads() (line %d) while "
                               "thread %u reaches __syncthreads() at line %d",
                               ranges(fibers_where(b, AT_BARRIER)).c_str(), b.barrier_line, f->linear, line));
}

inline void barrier_arrive(int line, int vote) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  if (b.done || (b.at_barrier && line != b.barrier_line)) barrier_misuse(f, line);
  if (b.at_barrier == 0) { b.barrier_line = line; b.bar_votes = 0; }
  b.bar_votes += vote != 0;
  f->state = AT_BARRIER;
  f->line = line;
  f->what = "__syncthreads()";
#if defined(CUFLASH_SIMT_RACE)
  race_arrive(b.bar_sync);  // every arriving thread releases ...
#endif
  if (++b.at_barrier == b.fibers.size()) {  // the last one opens the barrier for all
    b.at_barrier = 0;
    b.bar_result = b.bar_votes;
#if defined(CUFLASH_SIMT_RACE)
    for (Fiber& o : b.fibers) {  // ... and every leaving one acquires, all before any of them runs on
      race_switch(o.tsan);
      __tsan_acquire(b.bar_sync);
    }
    race_switch(f->tsan);
    race_drop(b.bar_sync);
#endif
    release_all(b);
  }
  switch_away(f);
}

inline Warp& my_warp(Fiber* f) { return f->block->warps[f->linear / 32]; }

[[noreturn]] __attribute__((noinline, cold)) inline void collective_misuse(const Collective* op, unsigned mask,
                                                                          int line) {
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  Warp& w = my_warp(f);
  unsigned bit = 1u << f->lane;
  if (!(mask & bit))
    fail_here("%s (line %d) with mask 0x%08x, which does not include the calling lane", op->name, line, mask);
  if (mask & ~w.present)
    fail_here("%s (line %d) with mask 0x%08x names lanes that do not exist (the block has %zu threads)",
              op->name, line, mask, b.fibers.size());
  if (mask & w.exited) {
    std::vector<unsigned> gone;
    for (unsigned l = 0; l < 32; l++)
      if (mask & w.exited & (1u << l)) gone.push_back(l);
    fail_here("%s (line %d) with mask 0x%08x: lanes %s named in the mask have exited", op->name, line, mask,
              ranges(gone).c_str());
  }
  std::abort();
}

inline bool in_shared(const Block& b, const void* p, size_t n);
inline void warp_collective(const Collective* op, unsigned mask, void* data, int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  Warp& w = my_warp(f);
  unsigned bit = 1u << f->lane;
  if (!(mask & bit) || (mask & ~w.present) || (mask & w.exited)) collective_misuse(op, mask, line);
  void* sync = nullptr;
#if defined(CUFLASH_SIMT_RACE)
  // ldmatrix reads 16 bytes of shared memory at each lane's row address (the first member of ptx.cuh's
  // per-lane record): check it as that lane's read. Bad addresses are left to run_ldmatrix's messages.
  if (!std::strncmp(op->name, "ldmatrix", 8)) {
    void* row = *(void* const*)data;
    if ((uintptr_t)row % 16 == 0 && in_shared(b, row, 16)) {
      RaceKernelAccess kernel;
      __tsan_read_range(row, 16);
    }
  }
  for (unsigned l = 0; l < 32 && !sync; l++)  // join the episode lanes already wait in, or open one
    if (((w.arrived & mask) >> l) & 1 && w.lane[l].op == op && w.lane[l].mask == mask) sync = w.lane[l].sync;
  race_arrive(sync);
#endif
  w.lane[f->lane] = Arrival{op, mask, line, data, sync};
  w.arrived |= bit;
  bool complete = (w.arrived & mask) == mask;
  for (unsigned l = 0; complete && l < 32; l++)
    if ((mask >> l) & 1) complete = w.lane[l].op == op && w.lane[l].mask == mask;
  if (complete) {
    void* lanes[32] = {};
    for (unsigned l = 0; l < 32; l++)
      if ((mask >> l) & 1) lanes[l] = w.lane[l].data;
    op->run(lanes, mask);
    w.arrived &= ~mask;
    unsigned base = f->linear & ~31u, others = mask & ~bit;
#if defined(CUFLASH_SIMT_RACE)
    for (unsigned l = 0; l < 32; l++)
      if ((mask >> l) & 1) {
        race_switch(b.fibers[base + l].tsan);
        __tsan_acquire(sync);
        w.lane[l].sync = nullptr;
      }
    race_switch(f->tsan);
    race_drop(sync);
#endif
    if (b.launch->order == Order::reverse)
      for (unsigned l = 32; l-- > 0;) { if ((others >> l) & 1) make_ready(b, base + l); }
    else
      for (unsigned l = 0; l < 32; l++) { if ((others >> l) & 1) make_ready(b, base + l); }
    if (b.launch->order == Order::random) yield();  // let the seed decide who goes next
  } else {
    f->state = AT_WARP;
    f->line = line;
    f->what = op->name;
    switch_away(f);
  }
}

// ---- shuffles (PTX shfl.sync semantics: a lane outside its segment reads its own value;
//      a source lane that is not in the mask gives garbage, as "undefined" does on the GPU) ----
struct ShflLane {
  uint64_t value, result;
  int arg, width;
};
enum ShflMode { IDX, UP, DOWN, BFLY };
template <ShflMode M> inline void run_shfl(void* const* lanes, unsigned mask) {
  for (int lane = 0; lane < 32; lane++) {
    ShflLane* me = (ShflLane*)lanes[lane];
    if (!me) continue;
    int w = me->width, seg = 32 - w;  // PTX: c = ((32 - width) << 8) | clamp
    int min_lane = lane & seg;
    int max_lane = M == UP ? min_lane : (min_lane | (31 & ~seg));
    int b = me->arg, j;
    bool ok;
    switch (M) {
      case IDX: j = min_lane | (b & 31 & ~seg); ok = j <= max_lane; break;
      case UP: j = lane - b; ok = j >= max_lane; break;
      case DOWN: j = lane + b; ok = j <= max_lane; break;
      default: j = lane ^ (b & 31); ok = j <= max_lane; break;
    }
    if (!ok) j = lane;
    me->result = ((mask >> j) & 1) ? ((ShflLane*)lanes[j])->value : ~0ull;
  }
}
inline const Collective* shfl_op(ShflMode m) {
  static const Collective ops[4] = {{"__shfl_sync", run_shfl<IDX>},
                                    {"__shfl_up_sync", run_shfl<UP>},
                                    {"__shfl_down_sync", run_shfl<DOWN>},
                                    {"__shfl_xor_sync", run_shfl<BFLY>}};
  return &ops[m];
}
template <class T> inline T shfl(ShflMode m, unsigned mask, T v, int arg, int width, int line) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle a value of at most 8 bytes");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail_here("%s (line %d) with width %d: the width must be a power of two up to 32", shfl_op(m)->name, line,
              width);
  ShflLane me{0, 0, arg, width};
  std::memcpy(&me.value, &v, sizeof(T));
  warp_collective(shfl_op(m), mask, &me, line);
  T r;
  std::memcpy(&r, &me.result, sizeof(T));
  return r;
}

// ---- votes, warp reductions, __syncwarp ----
struct VoteLane { unsigned pred, result; };
inline void run_ballot(void* const* lanes, unsigned mask) {
  unsigned ballot = 0;
  for (int l = 0; l < 32; l++)
    if (lanes[l] && ((VoteLane*)lanes[l])->pred) ballot |= 1u << l;
  for (int l = 0; l < 32; l++)
    if (lanes[l]) ((VoteLane*)lanes[l])->result = ballot;
  (void)mask;
}
inline const Collective* ballot_op(int kind) {
  static const Collective ops[4] = {{"__ballot_sync", run_ballot}, {"__any_sync", run_ballot},
                                    {"__all_sync", run_ballot}, {"__syncwarp", run_ballot}};
  return &ops[kind];
}
inline unsigned vote(int kind, unsigned mask, int pred, int line) {
  VoteLane me{pred != 0, 0};
  warp_collective(ballot_op(kind), mask, &me, line);
  return me.result;
}
struct ReduceLane { uint32_t value, result; };
template <int K, bool S> inline void run_reduce(void* const* lanes, unsigned) {
  int64_t acc = 0;
  bool first = true;
  for (int l = 0; l < 32; l++) {
    if (!lanes[l]) continue;
    uint32_t u = ((ReduceLane*)lanes[l])->value;
    int64_t v = S ? (int64_t)(int32_t)u : (int64_t)u;
    if (first) acc = v;
    else if (K == 0) acc = (int64_t)(uint32_t)(acc + v);
    else if (K == 1) acc = v < acc ? v : acc;
    else if (K == 2) acc = v > acc ? v : acc;
    else if (K == 3) acc &= v;
    else if (K == 4) acc |= v;
    else acc ^= v;
    first = false;
  }
  for (int l = 0; l < 32; l++)
    if (lanes[l]) ((ReduceLane*)lanes[l])->result = (uint32_t)acc;
}
template <int K, bool S> inline uint32_t reduce(const char* name, unsigned mask, uint32_t v, int line) {
  static const Collective op{name, run_reduce<K, S>};
  ReduceLane me{v, 0};
  warp_collective(&op, mask, &me, line);
  return me.result;
}

// ---- shared memory ----
inline bool in_shared(const Block& b, const void* p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  if (b.dyn && a >= (uintptr_t)b.dyn && a + n <= (uintptr_t)b.dyn + b.launch->dyn_bytes) return true;
  for (const auto& s : b.statics)
    if (a >= (uintptr_t)s.first && a + n <= (uintptr_t)s.first + s.second) return true;
  return false;
}
// Called right after each rewritten static __shared__ declaration: the first thread of a block to get
// there fills the array with 0xff bytes (NaN for floating types), so reading it before writing shows.
inline void shared_fresh(const void* p, size_t n, int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Block& b = *tl.block;
  for (const auto& s : b.statics)
    if (s.first == p) return;
  b.statics.emplace_back(p, n);
  b.static_bytes += n;
  if (b.static_bytes + b.launch->dyn_bytes > b.launch->smem_limit)
    fail_here("__shared__ array at line %d brings the block to %zu bytes of static and %zu of dynamic shared "
              "memory, more than the %zu the emulated device allows per block",
              line, b.static_bytes, b.launch->dyn_bytes, b.launch->smem_limit);
  std::memset(const_cast<void*>(p), 0xff, n);
}
inline void* dynamic_shared() { return tl.block->dyn; }

// ---- cp.async: a per-thread queue; copies land at the wait that covers their group, not at issue ----
inline void cp_async(void* dst, const void* src, int size, int src_size, int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  if (!in_shared(*f->block, dst, (size_t)size))
    fail_here("cp.async (line %d): destination %p is not %d bytes of this block's shared memory", line, dst, size);
  if (((uintptr_t)dst | (uintptr_t)src) % (uintptr_t)size)
    fail_here("cp.async (line %d): addresses %p and %p must be aligned to the copy size %d", line, dst, src,
              size);
  if (src_size < 0 || src_size > size)
    fail_here("cp.async (line %d): src-size %d outside [0, %d]", line, src_size, size);
#if defined(CUFLASH_SIMT_ASAN)
  // Check both ranges now, so that an out-of-bounds copy is reported at the line that issues it.
  if (void* bad = __asan_region_is_poisoned(const_cast<void*>(src), (size_t)src_size)) __asan_report_load_n(bad, 1);
  if (void* bad = __asan_region_is_poisoned(dst, (size_t)size)) __asan_report_store_n(bad, 1);
#endif
  f->cp_queue.push_back(CpAsync{dst, src, size, src_size, f->cp_committed});
}
inline void cp_async_commit() {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  tl.fiber->cp_committed++;
}
// Land every copy committed in a group older than the `pending` most recent ones.
inline void cp_async_wait(int pending) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  std::vector<CpAsync>& q = f->cp_queue;
  size_t keep = 0;
  for (size_t i = 0; i < q.size(); i++) {
    CpAsync& c = q[i];
    if ((long long)c.group < (long long)f->cp_committed - pending) {
#if defined(CUFLASH_SIMT_RACE)
      RaceKernelAccess kernel;  // the copy is the waiting thread's access
#endif
      if (c.src_size) std::memcpy(c.dst, c.src, (size_t)c.src_size);
      if (c.size > c.src_size) std::memset((char*)c.dst + c.src_size, 0, (size_t)(c.size - c.src_size));
    } else {
      q[keep++] = c;
    }
  }
  q.resize(keep);
}

// ------------------------------------------------------------------------------------------------
// 9. The scheduler: runs one block's fibers until all exit, one fails, or none can move (deadlock).
// ------------------------------------------------------------------------------------------------
[[noreturn]] __attribute__((noinline, cold)) void exit_misuse(Fiber* f);
inline void thread_exit(Fiber* f) {
  Block& b = *f->block;
  f->state = DONE;
  f->cp_queue.clear();
  b.done++;
  Warp& w = my_warp(f);
  w.exited |= 1u << f->lane;
  if (b.at_barrier || w.arrived) exit_misuse(f);
  switch_away(f, true);
  std::abort();  // an exited fiber is never resumed
}

// A thread exits while others wait for it at a barrier or at a warp collective whose mask names it.
[[noreturn]] __attribute__((noinline, cold)) void exit_misuse(Fiber* f) {
  Block& b = *f->block;
  Warp& w = my_warp(f);
  if (b.at_barrier)
    fail_fiber(where(b) + format(": thread %u exits while threads %s wait at __syncthreads() (line %d); every "
                                 "thread of the block must reach each barrier",
                                 f->linear, ranges(fibers_where(b, AT_BARRIER)).c_str(), b.barrier_line));
  for (unsigned l = 0; l < 32; l++) {
    if (!((w.arrived >> l) & 1) || !((w.lane[l].mask >> f->lane) & 1)) continue;
    std::vector<unsigned> waiting;
    for (unsigned k = 0; k < 32; k++)
      if (((w.arrived >> k) & 1) && w.lane[k].op == w.lane[l].op) waiting.push_back(k);
    fail_fiber(where(b) + format(": warp %u: lanes %s wait at %s (line %d, mask 0x%08x) but lane %u, named in the "
                                 "mask, exits without reaching it",
                                 f->linear / 32, ranges(waiting).c_str(), w.lane[l].op->name, w.lane[l].line,
                                 w.lane[l].mask, f->lane));
  }
  switch_away(f, true);  // the waiting lanes' masks do not name this one
  std::abort();
}

inline void fiber_main(void* arg) {
  Fiber* f = (Fiber*)arg;
  const void* from_bottom = nullptr;
  size_t from_size = 0;
  asan_landed(nullptr, &from_bottom, &from_size);
  if (!tl.sched_stack_known) {  // the first fiber of a worker starts from the scheduler's stack
    tl.sched_stack_bottom = from_bottom;
    tl.sched_stack_size = from_size;
    tl.sched_stack_known = true;
  }
  Launch& L = *f->block->launch;
#if defined(CUFLASH_SIMT_RACE)
  race_ignore_end();  // created with its count at 1: from here on, the kernel's accesses are checked
#endif
  try {
    L.entry(L.args);
#if defined(CUFLASH_SIMT_RACE)
    race_ignore_begin();
#endif
  } catch (const std::exception& e) {
    fail_here("a C++ exception escaped the kernel: %s", e.what());
  } catch (...) {
    fail_here("a C++ exception escaped the kernel");
  }
  thread_exit(f);
}

inline std::string deadlock_report(const Block& b) {
  std::string s = where(b) + ": no thread can move (deadlock).";
  std::vector<unsigned> bar = fibers_where(b, AT_BARRIER), gone = fibers_where(b, DONE);
  if (!bar.empty())
    s += format(" Threads %s wait at __syncthreads() (line %d).", ranges(bar).c_str(), b.barrier_line);
  for (size_t wi = 0; wi < b.warps.size(); wi++) {
    const Warp& w = b.warps[wi];
    for (unsigned l = 0; l < 32; l++) {
      if (!((w.arrived >> l) & 1)) continue;
      const Arrival& a = w.lane[l];
      bool first = true;  // report each (op, line, mask) group once, at its lowest lane
      for (unsigned k = 0; k < l; k++)
        if (((w.arrived >> k) & 1) && w.lane[k].op == a.op && w.lane[k].line == a.line && w.lane[k].mask == a.mask)
          first = false;
      if (!first) continue;
      std::vector<unsigned> here, missing;
      for (unsigned k = 0; k < 32; k++) {
        bool same = ((w.arrived >> k) & 1) && w.lane[k].op == a.op && w.lane[k].line == a.line &&
                    w.lane[k].mask == a.mask;
        if (same) here.push_back(k);
        else if ((a.mask >> k) & 1) missing.push_back(k);
      }
      s += format(" Warp %zu: lanes %s wait at %s (line %d, mask 0x%08x) for lanes %s, which never reach it.",
                  wi, ranges(here).c_str(), a.op->name, a.line, a.mask, ranges(missing).c_str());
    }
  }
  if (!gone.empty()) s += format(" Threads %s have exited.", ranges(gone).c_str());
  return s;
}

struct StackSet {
  size_t stack_size = 0;
  std::vector<Stack> stacks;
};
inline std::mutex& pool_mutex() { static std::mutex m; return m; }
inline std::vector<StackSet*>& pool() { static std::vector<StackSet*> p; return p; }
inline StackSet* acquire_stacks(size_t stack_size) {
  std::lock_guard<std::mutex> g(pool_mutex());
  auto& p = pool();
  for (size_t i = 0; i < p.size(); i++)
    if (p[i]->stack_size == stack_size) {
      StackSet* s = p[i];
      p.erase(p.begin() + (long)i);
      return s;
    }
  StackSet* s = new StackSet;
  s->stack_size = stack_size;
  return s;
}
inline void release_stacks(StackSet* s) {
  std::lock_guard<std::mutex> g(pool_mutex());
  pool().push_back(s);
}
// Unmaps the stacks no launch of this module is using. Every module (one .so) keeps its own pool, two memory
// mappings per stack (guard and stack): a process that loads hundreds of modules would run out of mappings
// (vm.max_map_count), so the Python side calls this for the modules it has not launched lately.
inline void unmap_idle_stacks() {
  std::lock_guard<std::mutex> g(pool_mutex());
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t guard = (kStackGuard + page - 1) / page * page;
  for (StackSet* set : pool()) {
    for (Stack& st : set->stacks) munmap(st.lo - guard, st.size + guard);
    delete set;
  }
  pool().clear();
}

// A fiber that runs into its stack's guard page gets a message saying so before the process dies (there is
// no safe way back into Python from there). Other faults go on to whoever handled SIGSEGV before us (Python's
// faulthandler under pytest). AddressSanitizer reports stack overflows itself.
inline struct sigaction& previous_segv() { static struct sigaction a; return a; }
inline void on_segv(int sig, siginfo_t* info, void* ctx) {
  Worker& w = tl;
  uintptr_t a = (uintptr_t)info->si_addr;
  if (w.launch && w.stacks)
    for (const Stack& st : w.stacks->stacks)
      if (a >= (uintptr_t)st.lo - kStackGuard && a < (uintptr_t)st.lo) {
        char msg[512];
        int n = snprintf(msg, sizeof msg, "cuflash.simt: kernel '%s' overflowed its %zu-byte stack per CUDA thread "
                         "(large local arrays?); pass a bigger stack_size= to RawModule\n", w.launch->kernel,
                         st.size);
        if (write(2, msg, (size_t)n) < 0) {}
        break;
      }
  sigaction(SIGSEGV, &previous_segv(), nullptr);  // the faulting access repeats under the previous handler
  (void)sig; (void)ctx;
}
inline void install_overflow_handler() {
#if !defined(CUFLASH_SIMT_ASAN)
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction a;
    std::memset(&a, 0, sizeof a);
    a.sa_sigaction = on_segv;
    a.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&a.sa_mask);
    sigaction(SIGSEGV, &a, &previous_segv());
  });
#endif
}

inline void run_block(Block& b, StackSet& stacks) {
  Launch& L = *b.launch;
  unsigned n = L.nthreads;
  b.failed = false;
  b.error.clear();
  b.at_barrier = b.done = 0;
  b.head = b.count = 0;
  b.statics.clear();
  b.static_bytes = 0;
  b.rng = L.seed ^ (0x9e3779b97f4a7c15ull * (b.linear + 1));
  for (Warp& w : b.warps) {
    w.arrived = w.exited = 0;
  }
  if (b.dyn && L.dyn_bytes) std::memset(b.dyn, 0xff, L.dyn_bytes);  // poison: NaN for floating types
  for (unsigned i = 0; i < n; i++) {
    Fiber& f = b.fibers[i];
    Stack& st = stacks.stacks[i];
#if defined(CUFLASH_SIMT_ASAN)
    // Frames that never returned (the previous fiber's fiber_main and exit path, or all of an abandoned
    // fiber's frames) leave poison in the stack's shadow, and the next fiber's frames do not all rewrite
    // it (Context::init's stores and compiler temporaries would trip over it): clear it first.
    char* top = st.lo + st.size;
    char* from = st.poison_lo && st.poison_lo >= st.lo && st.poison_lo < top ? st.poison_lo : st.lo;
    __asan_unpoison_memory_region(from, (size_t)(top - from));
    st.poison_lo = top;
#endif
    f.block = &b;
    f.linear = i;
    f.lane = i % 32;
    f.tid = uint3{i % L.block.x, (i / L.block.x) % L.block.y, i / (L.block.x * L.block.y)};
    f.cp_queue.clear();
    f.cp_committed = 0;
    f.fake_stack = nullptr;
    f.stack_lo = st.lo;
    f.stack_size = st.size;
    // Stagger the stack tops so that the fibers' hot frames do not all map to the same cache sets.
    size_t stagger = (size_t)i * 448 % 4096;
    f.ctx.init(st.lo, st.size - stagger, &fiber_main, &f);
#if defined(CUFLASH_SIMT_RACE)
    // A fresh TSan fiber per CUDA thread and block, ordered after everything the caller and the blocks before
    // did (creation synchronizes), entered with its accesses ignored (see fiber_main).
    f.tsan = __tsan_create_fiber(0);
    __tsan_set_fiber_name(f.tsan, format("CUDA thread (%u,%u,%u) of block (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z,
                                         b.idx.x, b.idx.y, b.idx.z).c_str());
    race_switch(f.tsan);
    __tsan_ignore_thread_begin();
    f.tsan_ignores = 1;
    race_switch(tl.tsan_sched);
#endif
  }
  release_all(b);
  // Fibers switch among themselves; control comes back here when none is ready or the block failed.
  while (!b.failed) {
    if (b.count == 0) {
      if (b.done != n) {
        b.failed = true;
        b.error = deadlock_report(b);
      }
      break;
    }
    Fiber& f = b.fibers[pick_ready(b)];
    f.state = RUNNING;
    tl.fiber = &f;
    void* fake = nullptr;
#if defined(CUFLASH_SIMT_RACE)
    race_switch(f.tsan);
#endif
    asan_enter(&fake, f.stack_lo, f.stack_size);
    switch_context(tl.sched, f.ctx);
    asan_landed(fake, nullptr, nullptr);
  }
#if defined(CUFLASH_SIMT_ASAN)
  // Every fiber's call chain at its last switch (exited or abandoned) lies above its saved stack pointer;
  // frames below it returned and cleared their own shadow. 256 bytes cover the x86-64 red zone.
  for (unsigned i = 0; i < n; i++) {
    Stack& st = stacks.stacks[i];
    char* sp = saved_sp(b.fibers[i].ctx);
    char* lo = sp && sp - 256 > st.lo ? sp - 256 : st.lo;
    if (lo < st.poison_lo) st.poison_lo = lo;
  }
#endif
#if defined(CUFLASH_SIMT_RACE)
  // Whatever the block's threads did (exited or abandoned by a failure) is ordered before the next block and
  // the launch's return. Blocks that follow one another on the same shared memory, stacks and queues must be
  // ordered: this TSan offers no way to forget an address's past accesses (its AnnotateNewMemory does not
  // reset them). The price: races between blocks of one launch go unreported.
  void* sched = tl.tsan_sched;
  for (Fiber& f : b.fibers) {
    int ignores = f.tsan_ignores;  // 1, more if it failed inside the runtime; TSan destroys no fiber that ignores
    f.tsan_ignores = 0;
    race_switch(f.tsan);
    while (ignores-- > 0) __tsan_ignore_thread_end();
    __tsan_release(L.race_end);  // after the ignores end, so that it also covers this fiber's reads just above
    race_switch(sched);
    __tsan_destroy_fiber(f.tsan);
    f.tsan = nullptr;
  }
  race_drop(b.bar_sync);  // episodes a failure left open
  for (Warp& w : b.warps)
    for (unsigned l = 0; l < 32; l++) {
      void* s = w.lane[l].sync;
      if (!s) continue;
      for (Warp& v : b.warps)
        for (Arrival& a : v.lane)
          if (a.sync == s) a.sync = nullptr;
      std::free(s);
    }
  __tsan_acquire(L.race_end);
#endif
  tl.fiber = nullptr;
}


// ------------------------------------------------------------------------------------------------
// 10. Launch: workers take blocks from a shared counter; the first failure stops them all.
// ------------------------------------------------------------------------------------------------
inline void record_failure(Launch& L, const std::string& msg) {
  std::lock_guard<std::mutex> g(L.mu);
  if (!L.failed.exchange(true)) L.error = msg;
}

inline void run_worker(Launch& L) {
  unsigned n = L.nthreads;
  StackSet* stacks = acquire_stacks(L.stack_size);
  while (stacks->stacks.size() < n) {
    Stack s = map_stack(L.stack_size);
    if (!s.lo) {
      record_failure(L, format("kernel '%s': cannot map %u fiber stacks of %zu bytes", L.kernel, n, L.stack_size));
      release_stacks(stacks);
      return;
    }
    stacks->stacks.push_back(s);
  }
  // The overflow handler needs a stack of its own: the faulting one is full.
  std::vector<char> alt_mem(64 * 1024);
  stack_t alt{}, old_alt{};
  alt.ss_sp = alt_mem.data();
  alt.ss_size = alt_mem.size();
  sigaltstack(&alt, &old_alt);
  tl.stacks = stacks;
  Block b;
  b.launch = &L;
  b.fibers.resize(n);
  b.ready.resize(n);
  b.warps.resize((n + 31) / 32);
  for (size_t w = 0; w < b.warps.size(); w++) {
    unsigned lanes = n - 32 * (unsigned)w < 32 ? n - 32 * (unsigned)w : 32;
    b.warps[w].present = lanes == 32 ? ~0u : (1u << lanes) - 1;
  }
  // Dynamic shared memory: exactly the launch's size, so AddressSanitizer sees any overrun.
  void* dyn = nullptr;
  if (posix_memalign(&dyn, 128, L.dyn_bytes ? L.dyn_bytes : 1)) dyn = nullptr;
  b.dyn = (char*)dyn;
  tl.launch = &L;
  tl.block = &b;
#if defined(CUFLASH_SIMT_RACE)
  tl.tsan_sched = __tsan_get_current_fiber();
#endif
  unsigned saved_mxcsr = get_mxcsr();
#if defined(CUFLASH_SIMT_FTZ)
  set_mxcsr(saved_mxcsr | 0x8040);  // flush denormal results and inputs to zero, like CuPy's -ftz=true
#endif
  while (!L.failed.load(std::memory_order_relaxed)) {
    unsigned long long id = L.next.fetch_add(1);
    if (id >= L.nblocks) break;
    b.linear = id;
    b.idx = uint3{(unsigned)(id % L.grid.x), (unsigned)(id / L.grid.x % L.grid.y),
                  (unsigned)(id / ((unsigned long long)L.grid.x * L.grid.y))};
    run_block(b, *stacks);
    if (b.failed) {
      record_failure(L, b.error);
      break;
    }
  }
  set_mxcsr(saved_mxcsr);
  tl = Worker{};
  sigaltstack(&old_alt, nullptr);
  std::free(dyn);
  release_stacks(stacks);
}

struct KernelEntry {
  const char* name;
  void (*entry)(void**);
  const char* (*signature)();
};

inline int launch(const KernelEntry& k, void** args, const unsigned* grid, const unsigned* block,
                  unsigned long long dyn_bytes, unsigned long long smem_limit, int order,
                  unsigned long long seed, int workers, unsigned long long stack_size, char* err,
                  unsigned long long errlen) {
#if defined(CUFLASH_SIMT_RACE)
  CUFLASH_SIMT_RUNTIME_SCOPE;  // the caller's thread schedules; its bookkeeping is not the kernel's
#endif
  Launch L;
  L.kernel = k.name;
  L.entry = k.entry;
  L.args = args;
  L.grid = dim3(grid[0], grid[1], grid[2]);
  L.block = dim3(block[0], block[1], block[2]);
  L.nthreads = block[0] * block[1] * block[2];
  L.nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
  L.dyn_bytes = dyn_bytes;
  L.smem_limit = smem_limit;
  L.order = (Order)order;
  L.seed = seed;
  L.stack_size = stack_size;
#if defined(CUFLASH_SIMT_MEMCHECK) || defined(CUFLASH_SIMT_RACE)
  workers = 1;  // static __shared__ arrays are plain statics in this build (and TSan's fibers are per thread)
#endif
#if defined(CUFLASH_SIMT_RACE)
  L.race_end = std::malloc(1);
#endif
  install_overflow_handler();
  unsigned long long nw = workers < 1 ? 1 : (unsigned long long)workers;
  if (nw > L.nblocks) nw = L.nblocks;
  std::vector<std::thread> pool;
  for (unsigned long long i = 1; i < nw; i++) pool.emplace_back(run_worker, std::ref(L));
  run_worker(L);  // the calling thread is a worker too
  for (std::thread& t : pool) t.join();
#if defined(CUFLASH_SIMT_RACE)
  __tsan_acquire(L.race_end);  // the host reads the outputs after every block
  race_drop(L.race_end);
#endif
  if (!L.failed) return 0;
  std::snprintf(err, (size_t)errlen, "%s", L.error.c_str());
  return 1;
}

// ---- kernel parameters: the generated entries unpack CUDA-style `void** args` ----
template <class... P, size_t... I>
inline void invoke_with(void (*f)(P...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}
template <class... P> inline void invoke(void (*f)(P...), void** args) {
  invoke_with(f, args, std::index_sequence_for<P...>{});
}

// Type codes the Python side checks arguments against: i4 = 4-byte signed integer, f2 = __half,
// bf2 = __nv_bfloat16, s16 = a 16-byte struct by value, p<code> = pointer (p* = any array).
template <class U> inline std::string scalar_code() {
  if constexpr (std::is_same<U, bool>::value) return "b1";
  else if constexpr (std::is_same<U, __half>::value) return "f2";
  else if constexpr (std::is_same<U, __nv_bfloat16>::value) return "bf2";
  else if constexpr (std::is_floating_point<U>::value) return "f" + std::to_string(sizeof(U));
  else if constexpr (std::is_enum<U>::value) return scalar_code<std::underlying_type_t<U>>();
  else if constexpr (std::is_integral<U>::value)
    return std::string(std::is_signed<U>::value ? "i" : "u") + std::to_string(sizeof(U));
  else return "s" + std::to_string(sizeof(U));
}
template <class T> inline std::string type_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer<U>::value) {
    using E = std::remove_cv_t<std::remove_pointer_t<U>>;
    constexpr bool any = std::is_void<E>::value || std::is_pointer<E>::value || sizeof(E) == 1 ||
                         !(std::is_arithmetic<E>::value || std::is_same<E, __half>::value ||
                           std::is_same<E, __nv_bfloat16>::value);
    if constexpr (any) return "p*";
    else return "p" + scalar_code<E>();
  } else {
    return scalar_code<U>();
  }
}
template <class... P> inline const char* signature_of(void (*)(P...)) {
  static const std::string s = [] {
    std::string r;
    for (const std::string& c : {std::string(), type_code<P>()...})
      if (!c.empty()) r += (r.empty() ? "" : ",") + c;
    return r;
  }();
  return s.c_str();
}

}  // namespace cuflash_simt

// The C interface Python calls through ctypes, over the generated table of kernels.
#define CUFLASH_SIMT_EXPORT_TABLE(table)                                                               \
  extern "C" __attribute__((visibility("default"))) int cuflash_simt_count() {                         \
    return (int)(sizeof(table) / sizeof(table[0]));                                                    \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) const char* cuflash_simt_name(int i) {             \
    return table[i].name;                                                                              \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) const char* cuflash_simt_signature(int i) {        \
    return table[i].signature();                                                                       \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) void cuflash_simt_unmap_idle_stacks() {            \
    ::cuflash_simt::unmap_idle_stacks();                                                               \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) int cuflash_simt_launch(                           \
      int i, void** args, const unsigned* grid, const unsigned* block, unsigned long long dyn,         \
      unsigned long long limit, int order, unsigned long long seed, int workers,                       \
      unsigned long long stack, char* err, unsigned long long errlen) {                                \
    return ::cuflash_simt::launch(table[i], args, grid, block, dyn, limit, order, seed, workers, stack, \
                                  err, errlen);                                                        \
  }

// ------------------------------------------------------------------------------------------------
// 11. The device-side API kernels call (CUDA's names). A defaulted __builtin_LINE() records the caller's
//     line for messages.
// ------------------------------------------------------------------------------------------------
inline void __syncthreads(int line = __builtin_LINE()) { cuflash_simt::barrier_arrive(line, 0); }
inline int __syncthreads_count(int pred, int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(line, pred);
  return cuflash_simt::tl.block->bar_result;
}
inline int __syncthreads_and(int pred, int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(line, pred);
  return cuflash_simt::tl.block->bar_result == (int)cuflash_simt::tl.block->fibers.size();
}
inline int __syncthreads_or(int pred, int line = __builtin_LINE()) {
  cuflash_simt::barrier_arrive(line, pred);
  return cuflash_simt::tl.block->bar_result != 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, int line = __builtin_LINE()) {
  cuflash_simt::vote(3, mask, 0, line);
}
template <class T> inline T __shfl_sync(unsigned mask, T var, int src, int width = 32, int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::IDX, mask, var, src, width, line);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                                           int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::UP, mask, var, (int)delta, width, line);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                                             int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::DOWN, mask, var, (int)delta, width, line);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                                            int line = __builtin_LINE()) {
  return cuflash_simt::shfl(cuflash_simt::BFLY, mask, var, lane_mask, width, line);
}
inline unsigned __ballot_sync(unsigned mask, int pred, int line = __builtin_LINE()) {
  return cuflash_simt::vote(0, mask, pred, line);
}
inline int __any_sync(unsigned mask, int pred, int line = __builtin_LINE()) {
  return cuflash_simt::vote(1, mask, pred, line) != 0;
}
inline int __all_sync(unsigned mask, int pred, int line = __builtin_LINE()) {
  return cuflash_simt::vote(2, mask, pred, line) == mask;
}
// Lanes of the caller's warp that have not exited (the emulator has no finer notion of convergence).
inline unsigned __activemask() {
  cuflash_simt::Warp& w = cuflash_simt::my_warp(cuflash_simt::tl.fiber);
  return w.present & ~w.exited;
}
#define CUFLASH_SIMT_REDUCE(NAME, K, T, S)                                                             \
  inline T NAME(unsigned mask, T v, int line = __builtin_LINE()) {                                     \
    return (T)cuflash_simt::reduce<K, S>(#NAME, mask, (uint32_t)v, line);                              \
  }
CUFLASH_SIMT_REDUCE(__reduce_add_sync, 0, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_add_sync, 0, int, true)
CUFLASH_SIMT_REDUCE(__reduce_min_sync, 1, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_min_sync, 1, int, true)
CUFLASH_SIMT_REDUCE(__reduce_max_sync, 2, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_max_sync, 2, int, true)
CUFLASH_SIMT_REDUCE(__reduce_and_sync, 3, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_or_sync, 4, unsigned, false)
CUFLASH_SIMT_REDUCE(__reduce_xor_sync, 5, unsigned, false)
#undef CUFLASH_SIMT_REDUCE

[[noreturn]] inline void __trap() { cuflash_simt::fail_here("__trap() called"); }
[[noreturn]] inline void __brkpt() { cuflash_simt::fail_here("__brkpt() called"); }
inline void __nanosleep(unsigned) { cuflash_simt::yield(); }  // a scheduling point, so spin-waits progress
inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }
[[noreturn]] inline void cuflash_simt_assert_fail(const char* expr, const char* file, int line) {
  cuflash_simt::fail_here("assertion `%s' failed at %s:%d", expr, file, line);
}
#undef assert
#define assert(e) ((e) ? (void)0 : cuflash_simt_assert_fail(#e, __FILE__, __LINE__))

// Built-in variables: read-only views of the running fiber's coordinates.
static constexpr int warpSize = 32;
#define threadIdx (static_cast<const uint3&>(::cuflash_simt::tl.fiber->tid))
#define blockIdx (static_cast<const uint3&>(::cuflash_simt::tl.block->idx))
#define blockDim (static_cast<const dim3&>(::cuflash_simt::tl.launch->block))
#define gridDim (static_cast<const dim3&>(::cuflash_simt::tl.launch->grid))

#endif  // CUFLASH_SIMT_H
