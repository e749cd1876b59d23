// mods.cuh: what a score_mod or mask_mod compiled into the kernels is made of. cuflash/kernels/mods.py writes a
// mod's expression as a struct of device functions (score, its slope d score / d score, mask) that Scores calls;
// the source names that struct in CUFLASH_MODS ahead of the kernels (without it: NoMods, and no kernel pays for
// mods). The arrays a mod closes over arrive as tables in Params::mods (Args), with the batch's shape (the mods' batch
// indices are the batch item's, unravelled over it) and the sinks.
//
// Each helper computes what NumPy computes for the same operation (the numpy backend evaluates the same expression
// with NumPy, cuflash/mods.py): Python's floor division and remainder, integers that wrap, NaN-propagating minimum
// and maximum, casts as ndarray.astype. A table read outside its array records the table (the launch turns it
// into an IndexError) and reads nothing.
#pragma once

#include "common.cuh"

namespace cuflash {
namespace mods {

constexpr int kMaxTables = 8, kMaxTableAxes = 4, kMaxBatchAxes = 6;

// One captured array: its first element and, per axis, its length and stride in elements.
struct Table {
    const void* data;
    long long shape[kMaxTableAxes], stride[kMaxTableAxes];
};

// A block mask's tiles for one launch's sweep (kBlocks), on the launch's tiles: for each of its batch entries e
// (entry = the batch item's indices times entry_stride: 0 on the block mask's shared axes of size 1) and each tile
// the launch's blocks own (row tiles; key tiles for a key-tile sweep), count[e * owned + tile] shown tiles of the
// swept axis, listed at list[(e * owned + tile) * width] in ascending order as 2 * tile + whole (whole: every
// element shown, the mask unread).
struct Visits {
    const int* count;
    const int* list;
    long long entry_stride[kMaxBatchAxes];
    long long owned, width;
};

// Params::mods. batch: the problem's broadcast batch shape (not the launch's coalesced one). sinks: one logit per
// batch item in the accumulator type, contiguous (null: none). error: where a read outside table t writes t + 1.
struct Args {
    Table table[kMaxTables];
    long long batch[kMaxBatchAxes];
    const void* sinks;
    int* error;
    Visits visits;
};

// The kernels without mods (kSinks: whether the forward's rows start from Args::sinks; kBlocks: whether blocks
// visit only the tiles Args::visits lists): what a generated struct defines, never called (Scores calls each only
// where its flag is set).
struct NoMods {
    static constexpr bool kScore = false, kMask = false, kSinks = false, kBlocks = false;
    static constexpr int kBatchAxes = 0;
    template <typename A>
    __device__ __forceinline__ static A score(A score, const long long*, long long, long long, const Args&) {
        return score;
    }
    template <typename A>
    __device__ __forceinline__ static A slope(A, const long long*, long long, long long, const Args&) {
        return A(1);
    }
    template <typename A>
    __device__ __forceinline__ static bool mask(const long long*, long long, long long, const Args&) { return true; }
};

// A batch item's index along each of the mods' first Axes batch axes (b unravelled, last axis fastest).
template <int Axes> struct BatchIndex {
    long long at[Axes > 0 ? Axes : 1];
    __device__ __forceinline__ static BatchIndex of(const Args& args, long long b) {
        BatchIndex x;
#pragma unroll
        for (int axis = Axes - 1; axis >= 0; --axis) {
            x.at[axis] = b % args.batch[axis];
            b /= args.batch[axis];
        }
        return x;
    }
};

template <typename A> __device__ __forceinline__ A infinity_() { return A(1) / A(0); }
template <typename A> __device__ __forceinline__ A not_a_number() { return A(0) / A(0); }

// Integers as NumPy's int64: they wrap on overflow (in C++ signed overflow is undefined, unsigned wraps).
using u64 = unsigned long long;
__device__ __forceinline__ long long add(long long a, long long b) { return (long long)((u64)a + (u64)b); }
__device__ __forceinline__ long long subtract(long long a, long long b) { return (long long)((u64)a - (u64)b); }
__device__ __forceinline__ long long multiply(long long a, long long b) { return (long long)((u64)a * (u64)b); }
__device__ __forceinline__ long long negative(long long a) { return (long long)(0ull - (u64)a); }
__device__ __forceinline__ long long absolute(long long a) { return a < 0 ? negative(a) : a; }

// Python's a // b and a % b for integers (floor division; the remainder takes b's sign); 0 for b = 0 (NumPy warns
// and gives 0 too). INT64_MIN // -1 wraps, as in NumPy.
__device__ __forceinline__ long long floor_divide(long long a, long long b) {
    if (b == 0) return 0;
    if (b == -1) return negative(a);
    const long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long remainder(long long a, long long b) {
    if (b == 0 || b == -1) return 0;
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
// a ** b for integers (wrapping), 0 for b < 0 (NumPy refuses it; the numpy backend gives 0 too).
__device__ __forceinline__ long long power(long long a, long long b) {
    if (b < 0) return 0;
    long long result = 1;
    for (; b > 0; b >>= 1, a = multiply(a, a))
        if (b & 1) result = multiply(result, a);
    return result;
}
__device__ __forceinline__ long long minimum(long long a, long long b) { return b < a ? b : a; }
__device__ __forceinline__ long long maximum(long long a, long long b) { return b > a ? b : a; }
__device__ __forceinline__ long long sign(long long a) { return (a > 0) - (a < 0); }

// The float functions, for either accumulator type.
#define CUFLASH_MOD_MATH(name, f32, f64)                                  \
    __device__ __forceinline__ float name(float x) { return f32(x); }   \
    __device__ __forceinline__ double name(double x) { return f64(x); }
CUFLASH_MOD_MATH(exp_, expf, exp)
CUFLASH_MOD_MATH(exp2_, exp2f, exp2)
CUFLASH_MOD_MATH(expm1_, expm1f, expm1)
CUFLASH_MOD_MATH(log_, logf, log)
CUFLASH_MOD_MATH(log2_, log2f, log2)
CUFLASH_MOD_MATH(log1p_, log1pf, log1p)
CUFLASH_MOD_MATH(sqrt_, sqrtf, sqrt)
CUFLASH_MOD_MATH(tanh_, tanhf, tanh)
CUFLASH_MOD_MATH(sin_, sinf, sin)
CUFLASH_MOD_MATH(cos_, cosf, cos)
CUFLASH_MOD_MATH(floor_, floorf, floor)
CUFLASH_MOD_MATH(ceil_, ceilf, ceil)
CUFLASH_MOD_MATH(trunc_, truncf, trunc)
CUFLASH_MOD_MATH(fabs_, fabsf, fabs)
#undef CUFLASH_MOD_MATH
__device__ __forceinline__ float pow_(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float fmod_(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ double fmod_(double a, double b) { return fmod(a, b); }

// NumPy's float remainder and floor division (its divmod: through fmod, so a // b * b + a % b stays near a).
template <typename A> __device__ __forceinline__ A float_remainder(A a, A b) {
    A r = fmod_(a, b);
    if (b == A(0)) return r;  // NaN
    if (r != A(0)) return ((r < A(0)) != (b < A(0))) ? r + b : r;
    return b < A(0) ? -A(0) : A(0);
}
template <typename A> __device__ __forceinline__ A float_floor_divide(A a, A b) {
    if (b == A(0)) return a / b;
    const A r = fmod_(a, b);
    A q = (a - r) / b;
    if (r != A(0) && ((b < A(0)) != (r < A(0)))) q -= A(1);
    if (q == A(0)) return a / b < A(0) ? -A(0) : A(0);
    const A f = floor_(q);
    return q - f > A(0.5) ? f + A(1) : f;
}
// NumPy's minimum and maximum: a NaN in either gives NaN. sign: NaN stays NaN.
template <typename A> __device__ __forceinline__ A minimum(A a, A b) {
    return (a != a || b != b) ? a + b : (b < a ? b : a);
}
template <typename A> __device__ __forceinline__ A maximum(A a, A b) {
    return (a != a || b != b) ? a + b : (b > a ? b : a);
}
template <typename A> __device__ __forceinline__ A sign(A x) {
    return x != x ? x : A((x > A(0)) - (x < A(0)));
}
// A float to int64 as ndarray.astype: truncation; NaN and values past int64 give int64's lowest (x86's answer).
template <typename A> __device__ __forceinline__ long long to_int(A x) {
    const bool fits = x > A(-9223372036854775808.0) && x < A(9223372036854775808.0);
    return fits ? (long long)x : (-9223372036854775807LL - 1);
}

// A table's element as the expression's type R: floats in the accumulator type, integers in int64, bools.
template <typename R, typename T> __device__ __forceinline__ R element(T x) { return R(x); }
template <> __device__ __forceinline__ float element<float, __half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ double element<double, __half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float element<float, __nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
template <> __device__ __forceinline__ double element<double, __nv_bfloat16>(__nv_bfloat16 x) {
    return __bfloat162float(x);
}

// Element `index` (one per axis, Axes of them) of table t, of element type T, as R; 0 when an index lies outside
// its axis: then table t is recorded in *error and nothing is read.
template <typename R, typename T, int Axes>
__device__ __forceinline__ R read(const Args& args, int t, const long long (&index)[Axes > 0 ? Axes : 1]) {
    const Table& table = args.table[t];
    long long offset = 0;
    bool inside = true;
#pragma unroll
    for (int axis = 0; axis < Axes; ++axis) {
        inside = inside && index[axis] >= 0 && index[axis] < table.shape[axis];
        offset += index[axis] * table.stride[axis];
    }
    if (!inside) {
        atomicExch(args.error, t + 1);  // an atomic store: many threads may flag at once
        return R(0);
    }
    return element<R>(static_cast<const T*>(table.data)[offset]);
}

}  // namespace mods
}  // namespace cuflash
