// Mechanics of the CUDA-core (FMA) kernels: accumulator types, conversions, math overloads, batch geometry and
// predicated tile loads. Compiles under NVRTC and, for the emulator, as host C++.
#pragma once

#include "common.cuh"
#include "mods.cuh"
#include "ptx.cuh"

namespace cuflash {

// ---------------------------------------------------------------------------------------------------------------
// Types: float accumulation for 16- and 32-bit inputs, double for double.

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(typename AccOf<T>::type x);
template <> __device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_acc<double>(double x) { return x; }

// ---------------------------------------------------------------------------------------------------------------
// Math, overloaded on the accumulator type.

__device__ __forceinline__ float exp2_(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_(double x) { return exp2(x); }
__device__ __forceinline__ float log2_(float x) { return log2f(x); }
__device__ __forceinline__ double log2_(double x) { return log2(x); }
// fmax ignores a NaN operand: a NaN score still reaches the output through exp2(NaN - m).
__device__ __forceinline__ float max_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float fma_(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_(double a, double b, double c) { return fma(a, b, c); }
// exp2 on the MUFU unit for float (ex2.approx, flush-to-zero: a P below 2^-126 of its row's maximum is
// negligible), the accurate one for double: the tensor-core kernels' P.
__device__ __forceinline__ float exp2_fast(float x) { return ptx::ex2_approx_ftz(x); }
__device__ __forceinline__ double exp2_fast(double x) { return exp2(x); }

constexpr double kLn2 = 0.6931471805599453;    // lse = (m_i + log2 l_i) ln 2
constexpr double kLog2e = 1.4426950408889634;  // scores and sinks move to the log2 domain: s log2 e

template <typename A> __device__ __forceinline__ A infinity();
#if defined(__CUDACC__)
template <> __device__ __forceinline__ float infinity<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double infinity<double>() { return __longlong_as_double(0x7ff0000000000000LL); }
#else
template <> __device__ __forceinline__ float infinity<float>() { return __builtin_huge_valf(); }
template <> __device__ __forceinline__ double infinity<double>() { return __builtin_huge_val(); }
#endif

// The most negative finite value: max_(m, lowest) is m, or this where m is -inf (nothing visible yet), so that
// exp2(s - it) is 0 for s = -inf and never exp2(-inf + inf).
template <typename A> __device__ __forceinline__ A lowest();
template <> __device__ __forceinline__ float lowest<float>() { return -3.402823466e38f; }
template <> __device__ __forceinline__ double lowest<double>() { return -1.7976931348623157e308; }

__device__ __forceinline__ long long min_ll(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long max_ll(long long a, long long b) { return a > b ? a : b; }

// Sum and max over the TC lanes that share a query row (TC consecutive lanes of one warp).
template <int TC, typename A> __device__ __forceinline__ A lanes_max(A x) {
#pragma unroll
    for (int offset = TC / 2; offset > 0; offset /= 2) x = max_(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
template <int TC, typename A> __device__ __forceinline__ A lanes_sum(A x) {
#pragma unroll
    for (int offset = TC / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// ---------------------------------------------------------------------------------------------------------------
// Batch geometry: the batch shape and every operand's strides (in elements), an int64 table written by the launch
// code, whose layout is declared once in cuflash/launch.py (GEOMETRY) and checked against these structs by the
// compiler. Broadcast dimensions have stride 0; nothing is flattened by copying.

constexpr int kMaxBatchDims = 6;
// The forward's operands, then the backward's (dout, the row terms: the lse in the log2 domain and D_i =
// rowsum(dO * O) per query row; the gradients): one table serves both.
enum Operand { kQ = 0, kK, kV, kMask, kBias, kOut, kLse, kDout, kTerms, kDq, kDk, kDv, kDbias, kOperands };

struct OperandStrides {
    long long row, col;               // along n (or m) and along d (or e, or m for mask and bias)
    long long batch[kMaxBatchDims];
};

struct Geometry {
    long long batch_count, rank;
    long long shape[kMaxBatchDims];
    OperandStrides op[kOperands];
    // Split keys (flash-decoding; 0: none): split s of the key axis sweeps keys [s * split_keys, (s + 1) *
    // split_keys) and writes its partial out and lse split_out and split_lse elements past split 0's.
    long long split_keys, split_out, split_lse;
};

// Select<C, A, B>::type: A where C holds, else B.
template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// Paged keys and values (attention_paged: kernels compiled with CUFLASH_PAGED): key j of batch item b's sequence
// s = b / Params::sequence_items is row j % size of page table[s * table_stride + j / size] of the K and V caches,
// whose pages lie stride_k and stride_v elements apart (the operands' geometry: a page's rows and the heads);
// seqlens[s] is the sequence's key count. The launch checked every page id the keys use against the caches.
struct Pages {
    const long long* table;
    const long long* seqlens;
    long long table_stride, size, stride_k, stride_v;
};
#ifndef CUFLASH_PAGED
#define CUFLASH_PAGED 0
#endif
constexpr bool kPaged = CUFLASH_PAGED != 0;

// Attention dropout (kernels compiled with CUFLASH_DROPOUT; cuflash/dropout.py is the Python twin and says why):
// element (b, i, j) is kept when word j & 3 of Philox-4x32-10 of the counter (j >> 2, i, b mod 2^32, b >> 32)
// under the 64-bit seed is at least `threshold`, and a kept probability is scaled by `scale` = 1 / (1 - p). b is
// base + sum over the problem's batch axes of the batch item's index times strides[axis] (shape: the problem's
// batch shape, rank axes, last fastest); i and j are offset by row0 and key0 (a Dask task's chunk).
struct Dropping {
    unsigned long long seed;
    long long base, row0, key0;
    long long shape[kMaxBatchDims], strides[kMaxBatchDims];
    long long rank;
    double scale;
    unsigned threshold;
};
#ifndef CUFLASH_DROPOUT
#define CUFLASH_DROPOUT 0
#endif
constexpr bool kDropout = CUFLASH_DROPOUT != 0;

// Philox-4x32-10 (Salmon et al., SC 2011): four 32-bit words of the counter c under the key (k0, k1).
struct Words { unsigned x[4]; };
__device__ __forceinline__ Words philox(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0,
                                        unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        // The 64-bit products' halves as __umulhi and a 32-bit product: one IMAD.WIDE each (a 64-bit product of
        // the widened words adds its high half to a zero, a quarter more instructions per call).
        const unsigned h0 = __umulhi(0xD2511F53u, c0), l0 = 0xD2511F53u * c0;
        const unsigned h1 = __umulhi(0xCD9E8D57u, c2), l1 = 0xCD9E8D57u * c2;
        c0 = h1 ^ c1 ^ k0;
        c1 = l1;
        c2 = h0 ^ c3 ^ k1;
        c3 = l0;
    }
    return {{c0, c1, c2, c3}};
}

// The dropout of one batch item: whether (i, j) is kept, four keys at a time (the Philox words of keys
// 4 (j >> 2) ... + 3 come together: keep4 gives their bits, bit t for key 4 (j >> 2) + t).
struct DropoutRow {
    unsigned long long seed;
    unsigned long long b;
    long long row0, key0;
    unsigned threshold;
    // The keep bits of Philox group `group` ((j + key0) >> 2) of row `row` (i + row0), both mod 2^32: bit t for
    // key 4 group + t - key0.
    __device__ __forceinline__ unsigned group_keeps(unsigned group, unsigned row) const {
        const Words w = philox(group, row, (unsigned)b, (unsigned)(b >> 32), (unsigned)seed, (unsigned)(seed >> 32));
        return (w.x[0] >= threshold) | (w.x[1] >= threshold) << 1 | (w.x[2] >= threshold) << 2 |
               (w.x[3] >= threshold) << 3;
    }
    __device__ __forceinline__ unsigned keep4(long long i, long long j) const {
        return group_keeps((unsigned)((unsigned long long)(j + key0) >> 2), (unsigned)(i + row0));
    }
    __device__ __forceinline__ bool keeps(long long i, long long j) const {
        return (keep4(i, j) >> ((unsigned long long)(j + key0) & 3)) & 1;
    }
};
__device__ __forceinline__ DropoutRow dropout_of(const Dropping& d, long long item) {
    unsigned long long b = (unsigned long long)d.base;
    for (int axis = (int)d.rank - 1; axis >= 0; --axis) {
        b += (unsigned long long)(item % d.shape[axis] * d.strides[axis]);
        item /= d.shape[axis];
    }
    return {d.seed, b, d.row0, d.key0, d.threshold};
}

// Span keep bits of a row from one of its keys on, bit x for that key + x (KeepTile::bits).
template <int Span> struct KeepBits {
    unsigned w[(Span + 31) / 32];
    __device__ __forceinline__ bool operator[](int x) const { return (w[x >> 5] >> (x & 31)) & 1u; }
};

// The keep bits of one tile in shared memory, Rows query rows from i0 by Cols keys from j0, made by the whole block
// (fill: each Philox call, a group of four keys of a row, made once, by one thread, for every thread that needs
// one of its keys, whatever its layout) and read by any thread (bits). A row's bits start at the Philox group of
// key j0, so key j0 + c is bit c + shift, shift = (j0 + key0) & 3; rows are kWords words apart, one more than the
// bits take, so that a 32-bit window from any of their bits reads two words in the row. At `at`: the shift (an
// int, 16 bytes), then the rows.
template <int Rows, int Cols> struct KeepTile {
    static constexpr int kPairs = Cols / 8;  // bytes of two groups that every tile fills, whatever the shift
    static constexpr int kWords = (Cols + 2) / 32 + 2, kPitch = 4 * kWords;
    static constexpr size_t bytes = 16 + (size_t)Rows * kPitch;
    unsigned char* at;

    // Every thread of the block (Threads) calls it; the bits are there for all after the next barrier.
    template <int Threads>
    __device__ __forceinline__ void fill(const DropoutRow& d, long long i0, long long j0) const {
        const unsigned long long first = (unsigned long long)(j0 + d.key0);
        const unsigned group = (unsigned)(first >> 2), row = (unsigned)(i0 + d.row0);
        const int groups = (int)(((first + Cols - 1) >> 2) - (first >> 2)) + 1;  // Cols / 4, or one more
        unsigned char* const rows = at + 16;
        if (threadIdx.x == 0) *reinterpret_cast<int*>(at) = (int)(first & 3);
        if constexpr (kPairs > 0) {
#pragma unroll 1  // two Philox calls at a time: the registers the caller's accumulators leave
            for (int u = threadIdx.x; u < Rows * kPairs; u += Threads) {
                const int r = u / kPairs, x = u % kPairs;
                rows[r * kPitch + x] = (unsigned char)(d.group_keeps(group + 2 * x, row + r) |
                                                       d.group_keeps(group + 2 * x + 1, row + r) << 4);
            }
        }
#pragma unroll 1
        for (int x = 2 * kPairs; x < groups; x += 2)  // a group past them (a key tile not on a group), or two
#pragma unroll 1
            for (int r = threadIdx.x; r < Rows; r += Threads)
                rows[r * kPitch + x / 2] = (unsigned char)(d.group_keeps(group + x, row + r) |
                                                           (x + 1 < groups ? d.group_keeps(group + x + 1, row + r) << 4
                                                                           : 0u));
    }
    // Row r's bits of keys j0 + c ... j0 + c + Span - 1 (c + Span <= Cols).
    template <int Span> __device__ __forceinline__ KeepBits<Span> bits(int r, int c) const {
        const unsigned* const row = reinterpret_cast<const unsigned*>(at + 16 + r * kPitch);
        const int k = c + *reinterpret_cast<const int*>(at);
        KeepBits<Span> out;
#pragma unroll
        for (int w = 0; w < (Span + 31) / 32; ++w) {
            const int bit = k + 32 * w;
            const unsigned long long two = (unsigned long long)row[(bit >> 5) + 1] << 32 | row[bit >> 5];
            out.w[w] = (unsigned)(two >> (bit & 31));
        }
        return out;
    }
};

// Everything a kernel takes, one struct passed by value (its layout declared once in cuflash/launch.py, PARAMS,
// and checked against this by the compiler): every operand (null where absent; the forward's first, then the
// backward's, in Operand's order), the geometry table, the packed sequences' offsets, the problem's sizes, the
// window's reach (left, right: n + m + 1 for an unbounded side), scale log2(e) and scale, the launch flags
// (LaunchFlags) and what the mods and sinks read (mods.cuh). O: the output's element type (the accumulator's for
// split keys' partial results).
template <typename T, typename O = T> struct Params {
    using Acc = typename AccOf<T>::type;
    const T* q;
    const T* k;
    const T* v;
    const bool* mask;
    const Acc* bias;  // in the accumulator type (the front door casts the un-broadcast original once)
    O* out;
    Acc* lse;
    const T* dout;
    const Acc* terms;  // the backward's row terms, two per query row
    Acc* dq;
    Acc* dk;
    Acc* dv;
    Acc* dbias;
    const Geometry* geometry;
    // Packed sequences (null: none): batch item b belongs to sequence b / sequence_items, whose query rows are
    // [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of the packed operands and its keys likewise; n and m are then the
    // longest sequence's, which only size the launch.
    const long long* cu_seqlens_q;
    const long long* cu_seqlens_k;
    long long sequence_items;
    Pages pages;  // paged keys and values (kernels compiled with CUFLASH_PAGED); zero in the others
    Dropping dropout;  // attention dropout (kernels compiled with CUFLASH_DROPOUT); zero in the others
    long long n, m, d, e, left, right;
    Acc scale_log2, scale;
    int flags;
    mods::Args mods;
};

struct BatchOffsets { long long of[kOperands]; };

// Element offsets of batch item b for every operand: b unravelled over the batch shape, last dimension fastest.
__device__ __forceinline__ BatchOffsets batch_offsets(const Geometry& g, long long b) {
    BatchOffsets o;
    for (int x = 0; x < kOperands; ++x) o.of[x] = 0;
    for (int dim = (int)g.rank - 1; dim >= 0; --dim) {
        const long long index = b % g.shape[dim];
        b /= g.shape[dim];
        for (int x = 0; x < kOperands; ++x) o.of[x] += index * g.op[x].batch[dim];
    }
    return o;
}

// ---------------------------------------------------------------------------------------------------------------
// Shared tiles read in 16-byte chunks, by the CUDA-core kernels' row groups of kLanesPerRow lanes.

constexpr int kLanesPerRow = 16;  // TC: the lanes that share a row group

__host__ __device__ constexpr size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Row paddings. 16 bytes makes a pitch an odd number of 16-byte chunks, so 16 lanes reading 16 rows at one column
// with 16-byte loads hit every bank once (tile widths are a multiple of 16 elements: an even number of chunks).
template <typename T> __host__ __device__ constexpr int chunk_pad() { return 16 / (int)sizeof(T); }
// A P-like tile's pitch: 64 bytes past a multiple of 128, so the two row groups of a warp, storing adjacent rows,
// fill the 32 banks once (a multiple of 16 bytes, for the 16-byte reads).
template <typename A> __host__ __device__ constexpr int half_line_pad(int cols) {
    return ((64 - cols * (int)sizeof(A) % 128) + 128) % 128 / (int)sizeof(A);
}

// Count consecutive elements of shared memory at p (aligned to their total size when that is 4, 8 or a multiple
// of 16 bytes) as accumulator values, in the widest loads that allow: 16-byte loads where the row is read in
// chunks, one 8- or 4-byte load for a narrower run.
template <int Bytes> struct Run;  // the vector type of one load of Bytes bytes
template <> struct Run<16> { using type = uint4; };
template <> struct Run<8> { using type = uint2; };
template <> struct Run<4> { using type = unsigned int; };
template <> struct Run<2> { using type = unsigned short; };

template <int Count, typename T, typename Acc>
__device__ __forceinline__ void load_run(const T* p, Acc (&out)[Count]) {
    constexpr int Bytes = Count * (int)sizeof(T);
    constexpr int Step = Bytes % 16 == 0 ? 16 : (Bytes == 8 || Bytes == 4) ? Bytes : (int)sizeof(T);
    constexpr int PerStep = Step / (int)sizeof(T);
#pragma unroll
    for (int s = 0; s < Count / PerStep; ++s) {
        const typename Run<Step>::type run = *reinterpret_cast<const typename Run<Step>::type*>(p + s * PerStep);
        const T* parts = reinterpret_cast<const T*>(&run);
#pragma unroll
        for (int t = 0; t < PerStep; ++t) out[s * PerStep + t] = to_acc(parts[t]);
    }
}

// A lane's PerLane of the 16 * PerLane columns that its row group shares out of a tile of T: runs of R adjacent
// columns (at most 16 bytes), run s at position lane + 16 s, so the 16 lanes read 16 consecutive runs of a row
// with each load (column(lane, c) is the lane's c-th column).
template <typename T, int PerLane> struct LaneColumns {
    static constexpr int R = PerLane * (int)sizeof(T) > 16 ? 16 / (int)sizeof(T) : PerLane;
    static_assert(PerLane % R == 0, "a lane's columns come in whole runs");
    static __device__ __forceinline__ int column(int lane, int c) {
        return (lane + kLanesPerRow * (c / R)) * R + c % R;
    }
};

// The CUDA-core kernels' two tile products.

// out[R][C] += X_rows . Y_rows over `width` columns of two shared tiles, as S = Q K^T: a 16-byte
// chunk of each of the thread's X rows (ty + RG a, pitch LDX) and Y rows (tx + 16 c, pitch LDY) feeds
// V * R * C FMAs (columns past width are zero in both tiles, up to their whole chunks).
template <int R, int C, int RG, int LDX, int LDY, typename T, typename Acc>
__device__ __forceinline__ void tile_product(Acc (&out)[R][C], const T* X, const T* Y, int width, int ty, int tx) {
    constexpr int V = 16 / (int)sizeof(T);
#pragma unroll 2  // two chunks an iteration: the loop's counter and addresses cost half as much per FMA
    for (int x = 0; x < width; x += V) {
        Acc x_x[R][V], y_x[C][V];
#pragma unroll
        for (int a = 0; a < R; ++a) load_run<V>(&X[(ty + RG * a) * LDX + x], x_x[a]);
#pragma unroll
        for (int c = 0; c < C; ++c) load_run<V>(&Y[(tx + kLanesPerRow * c) * LDY + x], y_x[c]);
#pragma unroll
        for (int t = 0; t < V; ++t)
#pragma unroll
            for (int a = 0; a < R; ++a)
#pragma unroll
                for (int c = 0; c < C; ++c) out[a][c] += x_x[a][t] * y_x[c][t];
    }
}

// out[R][C] += W_rows . Y over the `count` swept columns, as O += P V: W (pitch LDW) one of the
// shared P, dS tiles, a 16-byte chunk of each of the thread's rows (ty + RG a) at a time; Y's rows (pitch LDY) the
// swept tile's, each read in the lane's runs of columns (LaneColumns<T, C>). count is rounded up to whole chunks:
// past it W is 0 or hidden and Y's rows are zero. Careful (partial tiles): the pairs hidden in P (P < 0) are
// skipped by selection, so a non-finite Y row never meets a hidden pair's weight.
template <bool Careful, int R, int C, int RG, int LDW, int LDY, typename T, typename Acc>
__device__ __forceinline__ void weighted_rows(Acc (&out)[R][C], const Acc* W, const Acc* P, const T* Y, int count,
                                              int ty, int tx) {
    using Columns = LaneColumns<T, C>;
    constexpr int VW = 16 / (int)sizeof(Acc), RY = Columns::R;
#pragma unroll 1
    for (int j = 0; j < count; j += VW) {
        Acc w_j[R][VW], p_j[R][VW];
#pragma unroll
        for (int a = 0; a < R; ++a) {
            load_run<VW>(&W[(ty + RG * a) * LDW + j], w_j[a]);
            if constexpr (Careful) load_run<VW>(&P[(ty + RG * a) * LDW + j], p_j[a]);
        }
#pragma unroll
        for (int t = 0; t < VW; ++t) {
            Acc y_j[C / RY][RY];
#pragma unroll
            for (int s = 0; s < C / RY; ++s) load_run<RY>(&Y[(j + t) * LDY + Columns::column(tx, s * RY)], y_j[s]);
#pragma unroll
            for (int a = 0; a < R; ++a)
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const Acc o = out[a][c] + w_j[a][t] * y_j[c / RY][c % RY];
                    out[a][c] = (Careful && p_j[a][t] < Acc(0)) ? out[a][c] : o;
                }
        }
    }
}

// The same, Careful where the tile is partial.
template <int R, int C, int RG, int LDW, int LDY, typename T, typename Acc>
__device__ __forceinline__ void weighted_rows(Acc (&out)[R][C], const Acc* W, const Acc* P, const T* Y, int count,
                                              bool partial, int ty, int tx) {
    if (partial)
        weighted_rows<true, R, C, RG, LDW, LDY>(out, W, P, Y, count, ty, tx);
    else
        weighted_rows<false, R, C, RG, LDW, LDY>(out, W, P, Y, count, ty, tx);
}

// ---------------------------------------------------------------------------------------------------------------
// Predicated tile loads: Rows x Cols elements into shared memory (row pitch LD), zero outside rows x cols.

struct alignas(16) Chunk16 { unsigned int word[4]; };

// The row of chunk `idx` of a tile (its chunks numbered row by row, ChunksPerRow to a row) as every kernel copies
// and scans its tiles 16 bytes a lane. The 8 lanes of one shared-memory wavefront take two rows when a row is four
// chunks (16-bit tiles 32 wide); with rows an odd number of chunks apart (PitchChunks: padded rows), rows r and
// r + 1 share a bank group and conflict, rows r and r + 4 never do: within each group of 8 rows the lanes of a
// wavefront take those instead. Other widths keep the rows in order.
template <int ChunksPerRow, int Rows, int PitchChunks>
__device__ __forceinline__ int chunk_row(int idx) {
    const int r = idx / ChunksPerRow;
    if constexpr (ChunksPerRow == 4 && Rows % 8 == 0 && PitchChunks % 2 == 1)
        return (r & ~7) | (r & 1) << 2 | (r >> 1 & 3);
    else
        return r;
}

// Where a tile copy finds row r of its source: r rows past src (row_stride apart), or, for a paged operand (a
// PageWalk with a table), in its page: src is then the operand's row 0 of page 0, and the tile's rows begin at r0.
struct Unpaged {};
struct PageWalk {
    const long long* table;  // the sequence's page ids (null: the operand is not paged)
    long long stride;        // elements from one page to the next
    unsigned size, r0;       // rows per page, the tile's first row (a sequence's keys stay below 2^31: the front
                             // door checks; 32-bit division costs a fraction of 64-bit's, once per row copied)
};
template <typename T>
__device__ __forceinline__ const T* row_at(const T* src, int r, long long row_stride, Unpaged) {
    return src + r * row_stride;
}
template <typename T>
__device__ __forceinline__ const T* row_at(const T* src, int r, long long row_stride, const PageWalk& walk) {
    if (walk.table == nullptr) return src + r * row_stride;
    const unsigned x = walk.r0 + (unsigned)r, page = x / walk.size;
    return src + walk.table[page] * walk.stride + (long long)(x - page * walk.size) * row_stride;
}

// src (global memory) and dst (shared memory) never alias: __restrict__ lets the loads take the read-only path.
template <typename T, int Rows, int Cols, int LD, int Threads, typename Walk = Unpaged>
__device__ __forceinline__ void load_tile(T* __restrict__ dst, const T* __restrict__ src, long long row_stride,
                                          long long col_stride, int rows, int cols, bool vector, Walk walk = {}) {
    const T zero = from_acc<T>(0);
    if (vector) {  // the launch checked: col_stride == 1 and every row start is 16-byte aligned
        constexpr int V = 16 / sizeof(T);
        static_assert(Cols % V == 0, "tile width must be a whole number of 16-byte chunks");
        constexpr int Chunks = Rows * (Cols / V);
#pragma unroll
        for (int k = 0; k < (Chunks + Threads - 1) / Threads; ++k) {  // a trip count known here: unrolled
            const int idx = threadIdx.x + k * Threads;
            if (Chunks % Threads != 0 && idx >= Chunks) break;
            const int r = chunk_row<Cols / V, Rows, LD * sizeof(T) / 16>(idx), c = (idx % (Cols / V)) * V;
            if (r < rows && c + V <= cols) {
                const Chunk16 chunk = *reinterpret_cast<const Chunk16*>(row_at(src, r, row_stride, walk) + c);
                if constexpr (LD * sizeof(T) % 16 == 0) {  // 16-byte aligned rows take the chunk in one store
                    *reinterpret_cast<uint4*>(dst + r * LD + c) = *reinterpret_cast<const uint4*>(&chunk);
                } else {
                    const T* parts = reinterpret_cast<const T*>(&chunk);
#pragma unroll
                    for (int t = 0; t < V; ++t) dst[r * LD + c + t] = parts[t];
                }
            } else if ((r >= rows || c >= cols) && LD * sizeof(T) % 16 == 0) {  // a chunk of zeros, one store
                *reinterpret_cast<uint4*>(dst + r * LD + c) = uint4{};
            } else {
#pragma unroll
                for (int t = 0; t < V; ++t)
                    dst[r * LD + c + t] = (r < rows && c + t < cols) ? row_at(src, r, row_stride, walk)[c + t] : zero;
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < Rows * Cols; idx += Threads) {
            const int r = idx / Cols, c = idx % Cols;
            dst[r * LD + c] = (r < rows && c < cols) ? row_at(src, r, row_stride, walk)[c * col_stride] : zero;
        }
    }
}

// The same as cp.async copies (compute capability 8.0 and newer) where `vector`: 16-byte chunks, zero-filled past
// the tails, that land at the cp_async_wait covering the caller's commit; otherwise (strided or misaligned views)
// plain element loads, in shared memory at once. Rows of LD elements start 16-byte aligned. Unrolled: a whole
// tile's copies (every row and column there) unrolled, their trip count known here, and without predicates (for
// a hot loop's loads); other tiles' stay a loop.
template <typename T, int Rows, int Cols, int LD, int Threads, bool Unrolled = false, typename Walk = Unpaged>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, long long row_stride, long long col_stride,
                                                int rows, int cols, bool vector, Walk walk = {}) {
    constexpr int kChunk = chunk_pad<T>(), ChunksPerRow = Cols / kChunk, Chunks = Rows * ChunksPerRow;
    static_assert(Cols % kChunk == 0 && LD * sizeof(T) % 16 == 0, "16-byte chunks into 16-byte aligned rows");
    if (Unrolled && vector && rows == Rows && cols == Cols) {  // a whole tile: every chunk whole, no predicate
#pragma unroll
        for (int k = 0; k < (Chunks + Threads - 1) / Threads; ++k) {
            const int idx = threadIdx.x + k * Threads, c = idx % ChunksPerRow * kChunk;
            const int r = chunk_row<ChunksPerRow, Rows, LD * sizeof(T) / 16>(idx);
            if (Chunks % Threads == 0 || idx < Chunks)
                ptx::cp_async_cg16_whole(ptx::shared_addr(dst + r * LD + c), row_at(src, r, row_stride, walk) + c);
        }
        return;
    }
    for (int idx = threadIdx.x; idx < Chunks; idx += Threads) {
        const int r = chunk_row<ChunksPerRow, Rows, LD * sizeof(T) / 16>(idx), c = idx % ChunksPerRow * kChunk;
        if (vector) {
            const int valid = r < rows ? (cols - c < 0 ? 0 : (cols - c > kChunk ? kChunk : cols - c)) : 0;
            const T* from = valid ? row_at(src, r, row_stride, walk) + c : src;  // nothing is read when valid == 0
            ptx::cp_async_cg16(dst + r * LD + c, from, valid * (int)sizeof(T));
        } else {
            const T zero = from_acc<T>(0.0f);
#pragma unroll
            for (int x = 0; x < kChunk; ++x)
                dst[r * LD + c + x] =
                    (r < rows && c + x < cols) ? row_at(src, r, row_stride, walk)[(c + x) * col_stride] : zero;
        }
    }
}

}  // namespace cuflash
