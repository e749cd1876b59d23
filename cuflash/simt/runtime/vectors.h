// vectors.h: vector types.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_VECTORS_H
#define CUFLASH_SIMT_RUNTIME_VECTORS_H

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

#endif  // CUFLASH_SIMT_RUNTIME_VECTORS_H
