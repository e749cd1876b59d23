// intrinsics.h: math and bit intrinsics.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_INTRINSICS_H
#define CUFLASH_SIMT_RUNTIME_INTRINSICS_H

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

#endif  // CUFLASH_SIMT_RUNTIME_INTRINSICS_H
