// Mechanics of the tensor-core (mma.sync) forward kernel: padded shared-memory tiles, cp.async tile loads,
// ldmatrix fragment loads for the three operand shapes, the m16n8k16 product per element type and fragment
// packing. Fragment layouts are the PTX ISA's (see ptx.cuh): with g = lane / 4 and t = lane % 4, an m16n8
// accumulator holds rows g and g + 8, columns 2t and 2t + 1.
#pragma once

#include "ptx.cuh"
#include "tile.cuh"

namespace cuflash {
namespace mma {

constexpr int kChunk = 8;  // 16-bit elements in one 16-byte chunk: the unit of cp.async and of an ldmatrix row

// Shared-memory tiles are row-major with one chunk of padding per row: a row of Cols + 8 elements is an odd
// number of 16-byte chunks (Cols is a multiple of 16), so the 8 row addresses of any ldmatrix phase, and the
// 8 rows an accumulator store touches, fall in 8 different bank groups: no bank conflicts for any head dim.
template <int Cols> struct Padded {
    static_assert(Cols % 16 == 0, "tile width must be a multiple of 16");
    static constexpr int ld = Cols + kChunk;
};

// ---------------------------------------------------------------------------------------------------------------
// Element types: the tensor-core product and float pairs packed into one 32-bit register.

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], __half) {
    ptx::mma_m16n8k16_f16(c, a, b, c);
}
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                         __nv_bfloat16) {
    ptx::mma_m16n8k16_bf16(c, a, b, c);
}

// (lo, hi) rounded to T, lo in the low half: the register layout of an .f16x2 / .bf16x2 operand.
__device__ __forceinline__ unsigned pack2(float lo, float hi, __half) {
    return (unsigned)__half_as_ushort(__float2half_rn(lo)) | ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, __nv_bfloat16) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// Whether either 16-bit value of a register is inf or NaN (all exponent bits set).
__device__ __forceinline__ bool any_nonfinite2(unsigned w, __half) {
    return (w & 0x7c00u) == 0x7c00u || (w & 0x7c000000u) == 0x7c000000u;
}
__device__ __forceinline__ bool any_nonfinite2(unsigned w, __nv_bfloat16) {
    return (w & 0x7f80u) == 0x7f80u || (w & 0x7f800000u) == 0x7f800000u;
}

// ---------------------------------------------------------------------------------------------------------------
// Tile loads: Rows x Cols elements of a global matrix into a padded shared tile, zero outside rows x cols.
// vector: 16-byte cp.async copies, zero-filled past the tails (the launch checked unit column stride and
// 16-byte alignment); they land at the cp_async_wait covering the caller's commit. Otherwise (strided or
// misaligned views) plain element loads, in shared memory at once.

template <typename T, int Rows, int Cols, int Threads>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, long long row_stride, long long col_stride,
                                                int rows, int cols, bool vector) {
    constexpr int LD = Padded<Cols>::ld, ChunksPerRow = Cols / kChunk;
    for (int idx = threadIdx.x; idx < Rows * ChunksPerRow; idx += Threads) {
        const int r = idx / ChunksPerRow, c = (idx % ChunksPerRow) * kChunk;
        T* to = dst + r * LD + c;
        if (vector) {
            const int valid = r < rows ? (cols - c < 0 ? 0 : (cols - c > kChunk ? kChunk : cols - c)) : 0;
            const T* from = valid ? src + r * row_stride + c : src;  // nothing is read when valid == 0
            ptx::cp_async_cg16(to, from, valid * (int)sizeof(T));
        } else {
            const T zero = from_acc<T>(0.0f);
#pragma unroll
            for (int x = 0; x < kChunk; ++x)
                to[x] = (r < rows && c + x < cols) ? src[r * row_stride + (c + x) * col_stride] : zero;
        }
    }
}

// A ring of Stages shared-memory stages Bytes apart: from the address in stage `stage`, the same in the next one.
// Carried from tile to tile, such an address is never recomputed from the thread's index.
template <int Stages, int Bytes>
__device__ __forceinline__ ptx::SharedAddr next_stage(ptx::SharedAddr at, int stage) {
    return at + (stage == Stages - 1 ? -(Stages - 1) * Bytes : Bytes);
}
template <int Stages> __device__ __forceinline__ int next_stage(int stage) {
    return stage == Stages - 1 ? 0 : stage + 1;
}

// One thread's share of full tiles (all Rows rows) of 16-byte chunks streamed through Stages shared stages,
// worked out once for a whole sweep: the thread copies the chunks of one column c in rows r0, r0 + Step, ... (the
// very chunks load_tile_async gives it: Threads is a multiple of the chunks per row), so its global pointer
// advances by a tile's rows per call and its shared addresses by a stage. Only whole chunks: the operand's width
// `cols` is a multiple of 8 (and the copies 16-byte ones: unit column stride, aligned rows, as the launch checked);
// a thread whose column lies past it copies nothing, its chunks zeroed once in every stage (zero_tail).
template <typename T, int Rows, int Cols, int Threads, int Stages>
struct ChunkLoader {
    static constexpr int LD = Padded<Cols>::ld, ChunksPerRow = Cols / kChunk;
    static constexpr bool kFits = Threads % ChunksPerRow == 0 && Rows % (Threads / ChunksPerRow) == 0;
    static constexpr int Step = Threads / ChunksPerRow, PerThread = kFits ? Rows / Step : 0;
    static constexpr int kStepBytes = Step * LD * (int)sizeof(T), kStageBytes = Rows * LD * (int)sizeof(T);
    const T* src;               // this thread's first chunk of the next tile
    long long step, tile_step;  // elements between its chunks, and between tiles
    ptx::SharedAddr dst;        // where that chunk goes: in stage `stage`
    int stage;
    bool active;                // its column lies within the operand's width

    __device__ __forceinline__ ChunkLoader(const T* first_row, long long row_stride, int cols, const T* tile) {
        const int r = threadIdx.x / ChunksPerRow, c = threadIdx.x % ChunksPerRow * kChunk;
        active = c < cols;
        src = first_row + r * row_stride + (active ? c : 0);
        step = Step * row_stride;
        tile_step = Rows * row_stride;
        dst = ptx::shared_addr(tile + r * LD + c);
        stage = 0;
    }
    // Zeros in this thread's chunks of every stage of `tile` when its column is a tail's.
    __device__ __forceinline__ void zero_tail(T* tile) const {
        if (active) return;
        const int r = threadIdx.x / ChunksPerRow, c = threadIdx.x % ChunksPerRow * kChunk;
        for (int st = 0; st < Stages; ++st)
            for (int s = 0; s < PerThread; ++s)
                *reinterpret_cast<Chunk16*>(tile + st * Rows * LD + (r + s * Step) * LD + c) = Chunk16{};
    }
    // The next tile's chunks into the next stage, as cp.async copies (they land at the covering wait).
    __device__ __forceinline__ void next() {
        if (active) {
#pragma unroll
            for (int s = 0; s < PerThread; ++s) ptx::cp_async_cg16_whole(dst + s * kStepBytes, src + s * step);
        }
        src += tile_step;
        dst = next_stage<Stages, kStageBytes>(dst, stage);
        stage = next_stage<Stages>(stage);
    }
};

// ---------------------------------------------------------------------------------------------------------------
// Fragment loads with ldmatrix.x4: lanes 8j..8j+7 address the rows of 8x8 matrix j. Each operand shape has a
// lane offset (elements from a fragment's corner to the row this lane addresses); with a tile's shared address
// plus the lane's offset taken once, every fragment's address is that plus a constant.
template <int LD> __device__ __forceinline__ int a_lane(int lane) {
    return ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4);
}
template <int LD> __device__ __forceinline__ int b_nk_lane(int lane) {
    return ((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1);
}
template <int LD> __device__ __forceinline__ int b_kn_lane(int lane) {
    return ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4);
}
// The fragments at (row0, col0) of a tile whose lane address (tile + the shape's lane offset) is `at`.
template <int LD, typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], ptx::SharedAddr at, int row0, int col0) {
    ptx::ldmatrix_x4(a, at + (row0 * LD + col0) * (int)sizeof(T));
}
template <int LD, typename T>
__device__ __forceinline__ void load_b_nk(unsigned (&b)[4], ptx::SharedAddr at, int n0, int k0) {
    ptx::ldmatrix_x4(b, at + (n0 * LD + k0) * (int)sizeof(T));
}
template <int LD, typename T>
__device__ __forceinline__ void load_b_kn(unsigned (&b)[4], ptx::SharedAddr at, int k0, int n0) {
    ptx::ldmatrix_x4_trans(b, at + (k0 * LD + n0) * (int)sizeof(T));
}

// A operand (16 x 16, row-major) at (row0, col0) of a tile: matrices (rows 0-7 | 8-15) x (cols 0-7 | 8-15),
// in the order a0..a3 of mma.m16n8k16.
template <int LD, typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const T* tile, int row0, int col0, int lane) {
    const int r = row0 + (lane & 7) + 8 * ((lane >> 3) & 1), c = col0 + 8 * (lane >> 4);
    ptx::ldmatrix_x4(a, tile + r * LD + c);
}

// B operands of two n8 tiles from a tile stored [n][k] (K: keys x head dim), n0..n0+15 x k0..k0+15:
// b[0], b[1] for columns n0..n0+7 and b[2], b[3] for n0+8..n0+15. Rows of the tile are columns of B.
template <int LD, typename T>
__device__ __forceinline__ void load_b_nk(unsigned (&b)[4], const T* tile, int n0, int k0, int lane) {
    const int r = n0 + (lane & 7) + 8 * (lane >> 4), c = k0 + 8 * ((lane >> 3) & 1);
    ptx::ldmatrix_x4(b, tile + r * LD + c);
}

// B operands of two n8 tiles from a tile stored [k][n] (V: keys x value dim), k0..k0+15 x n0..n0+15, through
// ldmatrix.trans: b[0], b[1] for columns n0..n0+7 and b[2], b[3] for n0+8..n0+15.
template <int LD, typename T>
__device__ __forceinline__ void load_b_kn(unsigned (&b)[4], const T* tile, int k0, int n0, int lane) {
    const int r = k0 + (lane & 7) + 8 * ((lane >> 3) & 1), c = n0 + 8 * (lane >> 4);
    ptx::ldmatrix_x4_trans(b, tile + r * LD + c);
}

// ---------------------------------------------------------------------------------------------------------------
// Row reductions over the four lanes (a quad) that hold one accumulator row.

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------------------------------
// The rare path: hidden keys whose value rows hold inf or NaN.

// Whether the first `rows` rows of a padded tile (V_j in the forward) hold an inf or NaN (rows past `rows` and
// columns past the operand's width are zeros).
template <typename T, int Cols, int Threads>
__device__ __forceinline__ bool tile_nonfinite(const T* tile, int rows) {
    constexpr int LD = Padded<Cols>::ld, ChunksPerRow = Cols / kChunk;
    bool found = false;
    for (int idx = threadIdx.x; idx < rows * ChunksPerRow; idx += Threads) {
        const T* chunk = tile + (idx / ChunksPerRow) * LD + (idx % ChunksPerRow) * kChunk;
        const Chunk16 c = *reinterpret_cast<const Chunk16*>(chunk);
#pragma unroll
        for (int w = 0; w < 4; ++w) found = found || any_nonfinite2(c.word[w], T{});
    }
    return found;
}

// O_i += P_ij V_j on CUDA cores with hidden keys skipped by selection (forward.cuh's rule), for one warp's
// m16 tiles: P goes through the warp's scratch rows P_w in T (as the tensor-core path rounds it), hidden as -1.
template <typename T, int Bc, int E, int MT>
__device__ __forceinline__ void pv_by_selection(float (&O_i)[MT][E / 8][4], const float (&P)[MT][Bc / 8][4],
                                                const unsigned (&hidden)[MT][2], T* P_w, const T* V_j, int cols,
                                                int lane) {
    constexpr int LDP = Padded<Bc>::ld, LDV = Padded<E>::ld;
    const int quad_row = lane / 4, quad_col = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int nt = 0; nt < Bc / 8; ++nt)
#pragma unroll
                for (int x = 0; x < 2; ++x)
                    P_w[(quad_row + 8 * h) * LDP + 8 * nt + 2 * quad_col + x] =
                        from_acc<T>((hidden[mt][h] >> (2 * nt + x) & 1u) ? -1.0f : P[mt][nt][2 * h + x]);
        __syncwarp();
        for (int j = 0; j < cols; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float p = to_acc(P_w[(quad_row + 8 * h) * LDP + j]);
                if (p < 0.0f) continue;  // hidden (a visible p is >= 0 or NaN)
#pragma unroll
                for (int et = 0; et < E / 8; ++et)
#pragma unroll
                    for (int x = 0; x < 2; ++x)
                        O_i[mt][et][2 * h + x] += p * to_acc(V_j[j * LDV + 8 * et + 2 * quad_col + x]);
            }
        }
        __syncwarp();  // the next m16 tile reuses P_w
    }
}

// out += W Y on CUDA cores with hidden pairs skipped by selection, for one warp's m16 tiles (the backward's rare
// path: dQ += dS K_j, dK += dS^T Q_i, dV += P^T dO_i where a row of Y that some pair hides holds inf or NaN).
// W's fragments (K columns, float) and each lane's hidden bits (bit 2 nt + x of its element [nt][2 h + x]) go
// through the warp's scratch: W_w holds 16 rows of K + 1 floats, H_w 16 rows of 4 words (one per quad lane).
// Y: K rows of N (padded) in shared memory, `count` of them valid.
template <typename T, int K, int N, int MT>
__device__ __forceinline__ void acc_by_selection(float (&out)[MT][N / 8][4], const float (&W)[MT][K / 8][4],
                                                 const unsigned (&hidden)[MT][2], float* W_w, unsigned* H_w,
                                                 const T* Y, int count, int lane) {
    static_assert(K <= 128, "hidden bits of a row fit one word per quad lane");
    constexpr int LDW = K + 1, LDY = Padded<N>::ld;
    const int quad_row = lane / 4, quad_col = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            H_w[(quad_row + 8 * h) * 4 + quad_col] = hidden[mt][h];
#pragma unroll
            for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
                for (int x = 0; x < 2; ++x)
                    W_w[(quad_row + 8 * h) * LDW + 8 * nt + 2 * quad_col + x] = W[mt][nt][2 * h + x];
        }
        __syncwarp();
        for (int j = 0; j < count; ++j) {
            const int owner = (j % 8) / 2, bit = 2 * (j / 8) + j % 2;  // the quad lane that computed column j
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = quad_row + 8 * h;
                if (H_w[row * 4 + owner] >> bit & 1u) continue;
                const float w = W_w[row * LDW + j];
#pragma unroll
                for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x)
                        out[mt][nt][2 * h + x] += w * to_acc(Y[j * LDY + 8 * nt + 2 * quad_col + x]);
            }
        }
        __syncwarp();  // the next m16 tile reuses the scratch
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The epilogue's store: a Rows x Cols staging tile to global rows (rows x cols of it), 16 bytes per thread and
// step when the destination allows (unit column stride, 16-byte aligned rows), else element by element.
template <typename T, int Rows, int Cols, int Threads>
__device__ __forceinline__ void store_tile(T* dst, long long row_stride, long long col_stride, const T* tile,
                                           int rows, int cols) {
    constexpr int LD = Padded<Cols>::ld, ChunksPerRow = Cols / kChunk;
    const bool vector = col_stride == 1 && row_stride % kChunk == 0 &&
                        reinterpret_cast<unsigned long long>(dst) % 16 == 0;
    for (int idx = threadIdx.x; idx < Rows * ChunksPerRow; idx += Threads) {
        const int r = idx / ChunksPerRow, c = (idx % ChunksPerRow) * kChunk;
        if (r >= rows || c >= cols) continue;
        const T* from = tile + r * LD + c;
        if (vector && c + kChunk <= cols) {
            *reinterpret_cast<Chunk16*>(dst + r * row_stride + c) = *reinterpret_cast<const Chunk16*>(from);
        } else {
            for (int x = 0; x < kChunk && c + x < cols; ++x) dst[r * row_stride + (c + x) * col_stride] = from[x];
        }
    }
}

}  // namespace mma
}  // namespace cuflash
