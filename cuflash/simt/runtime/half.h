// half.h: __half and __nv_bfloat16.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_HALF_H
#define CUFLASH_SIMT_RUNTIME_HALF_H

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
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162(__nv_bfloat16(a), __nv_bfloat16(b));
}
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
    return cuflash_simt::rnd<H>(                                                                       \
        std::fma(cuflash_simt::as_double(a), cuflash_simt::as_double(b), cuflash_simt::as_double(c)));  \
  }                                                                                                    \
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
  inline bool __hne(H a, H b) {                                                                        \
    return cuflash_simt::as_double(a) != cuflash_simt::as_double(b) && !__hisnan(a) && !__hisnan(b);   \
  }                                                                                                    \
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

#endif  // CUFLASH_SIMT_RUNTIME_HALF_H
