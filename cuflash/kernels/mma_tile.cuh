// Mechanics of the tensor-core (mma.sync) forward kernel: padded shared-memory tiles, cp.async tile loads,
// ldmatrix fragment loads for the three operand shapes, the m16n8k16 product per element type and fragment
// packing. Fragment layouts are the PTX ISA's (see ptx.cuh): with g = lane / 4 and t = lane % 4, an m16n8
// accumulator holds rows g and g + 8, columns 2t and 2t + 1.
#pragma once

#include "block.cuh"

namespace cuflash {
namespace mma {

constexpr int kChunk = 8;  // 16-bit elements in one 16-byte chunk: the unit of cp.async and of an ldmatrix row

// Shared-memory tiles are row-major with one chunk of padding per row: a row of Cols + 8 elements is an odd
// number of 16-byte chunks (Cols is a multiple of 16), so the 8 row addresses of any ldmatrix phase, and the
// 8 rows an accumulator store touches, fall in 8 different bank groups: no bank conflicts for any head dim.
// For float and double the same 16 bytes of padding serve ldmatrix, the V loads of the float products and the
// epilogue; only Q and K tiles of doubles, read by 8-byte loads at (row g, column t), take 32 (RowPadded): a pitch
// of 4 doubles past a multiple of 16 puts a half-warp's 16 loads in 16 different bank pairs.
template <int Cols, typename T = __half> struct Padded {
    static_assert(Cols % 16 == 0, "tile width must be a multiple of 16");
    static constexpr int ld = Cols + chunk_pad<T>();
};
template <int Cols, typename T> struct RowPadded {
    static constexpr int ld = sizeof(T) == 8 ? Cols + 4 : Padded<Cols, T>::ld;
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

// Whether a 16-byte chunk of T holds an inf or NaN (all exponent bits set in some element).
__device__ __forceinline__ bool chunk_nonfinite(const Chunk16& c, __half) {
    bool found = false;
#pragma unroll
    for (int w = 0; w < 4; ++w) found |= (c.word[w] & 0x7c00u) == 0x7c00u || (c.word[w] & 0x7c000000u) == 0x7c000000u;
    return found;
}
__device__ __forceinline__ bool chunk_nonfinite(const Chunk16& c, __nv_bfloat16) {
    bool found = false;
#pragma unroll
    for (int w = 0; w < 4; ++w) found |= (c.word[w] & 0x7f80u) == 0x7f80u || (c.word[w] & 0x7f800000u) == 0x7f800000u;
    return found;
}
__device__ __forceinline__ bool chunk_nonfinite(const Chunk16& c, float) {
    bool found = false;
#pragma unroll
    for (int w = 0; w < 4; ++w) found |= (c.word[w] & 0x7f800000u) == 0x7f800000u;
    return found;
}
__device__ __forceinline__ bool chunk_nonfinite(const Chunk16& c, double) {  // the high words hold the exponents
    return (c.word[1] & 0x7ff00000u) == 0x7ff00000u || (c.word[3] & 0x7ff00000u) == 0x7ff00000u;
}

// A ring of Stages shared-memory stages, walked tile by tile: `stage` is the computed tile's, `hop` the stages from
// it to the next one (1, or 1 - Stages from the last), and the prefetch goes to the stage before it. An address
// moves to the same place in the next stage by hop * its stage's bytes: carried from tile to tile, the ldmatrix and
// cp.async addresses are never recomputed from the thread's index. With two stages a hop only flips its sign.
template <int Stages> struct StageRing {
    int stage = 0, hop = Stages > 1 ? 1 : 0;
    __device__ __forceinline__ int before() const { return stage == 0 ? Stages - 1 : stage - 1; }
    __device__ __forceinline__ int hop_before() const {
        return Stages == 2 ? -hop : stage == 0 ? 1 - Stages : 1;
    }
    __device__ __forceinline__ void advance() {
        stage = stage == Stages - 1 ? 0 : stage + 1;
        hop = Stages == 2 ? -hop : stage == Stages - 1 ? 1 - Stages : 1;
    }
};

// A compile-time flag passed to a backward block's steps (its swept tile: steady or not).
template <bool V> struct Steady { static constexpr bool value = V; };

// One thread's share of full tiles (all Rows rows) of 16-byte chunks streamed through shared stages,
// worked out once for a whole sweep: the thread copies the chunks of one column c in rows r0, r0 + Step, ... (the
// very chunks load_tile_async gives it: Threads is a multiple of the chunks per row), so its global pointer
// advances by a tile's rows per call and its shared addresses by a stage. Only whole chunks: the operand's width
// `cols` is a multiple of 8 (and the copies 16-byte ones: unit column stride, aligned rows, as the launch checked);
// a thread whose column lies past it reads nothing and fills its chunks with zeros (the copy's zero-fill: no
// branch around the copies). A chunk's offset from the thread's first one is a 32-bit number (one multiply-add
// per address), so the loaders take only operands whose tile spans fewer than 2^31 elements (usable); the
// general copy takes the others.
template <typename T, int Rows, int Cols, int Threads, int LD = Padded<Cols, T>::ld>
struct ChunkLoader {
    static constexpr int kChunk = chunk_pad<T>(), ChunksPerRow = Cols / kChunk;
    static constexpr bool kFits = Threads % ChunksPerRow == 0 && Rows % (Threads / ChunksPerRow) == 0;
    static constexpr int Step = Threads / ChunksPerRow, PerThread = kFits ? Rows / Step : 0;
    static constexpr int kStepBytes = Step * LD * (int)sizeof(T), kStageBytes = Rows * LD * (int)sizeof(T);
    const T* src;         // this thread's first chunk of the next tile (its row's first where its column is a tail's)
    int step;             // elements between its chunks (PerThread steps between tiles)
    ptx::SharedAddr dst;  // where that chunk goes: in the stage of the next tile
    int bytes;            // bytes read per chunk: 16, or 0 where its column lies past the operand's width
    int offset;           // elements from a tile's first row to this thread's first chunk (next_from)

    __device__ __forceinline__ static bool usable(long long row_stride) {
        constexpr long long kMost = 0x7fffffffLL / Rows;
        return kFits && row_stride <= kMost && row_stride >= -kMost;
    }

    ChunkLoader() = default;  // a block's own: set once its first copies are out
    __device__ __forceinline__ ChunkLoader(const T* first_row, long long row_stride, int cols, const T* tile) {
        const int r = chunk_row<ChunksPerRow, Rows, LD * sizeof(T) / 16>(threadIdx.x);
        const int c = threadIdx.x % ChunksPerRow * kChunk;
        bytes = c < cols ? 16 : 0;
        src = first_row + r * row_stride + (bytes ? c : 0);
        offset = (int)(src - first_row);
        step = (int)(Step * row_stride);
        dst = ptx::shared_addr(tile + r * LD + c);
    }
    // The next tile's chunks into their stage as cp.async copies (they land at the covering wait); `hop`: the
    // stages from there to the following tile's (StageRing).
    __device__ __forceinline__ void next(int hop = 0) {
#pragma unroll
        for (int s = 0; s < PerThread; ++s) ptx::cp_async_cg16(dst + s * kStepBytes, src + (long long)step * s, bytes);
        src += (long long)step * PerThread;
        dst = dst + hop * kStageBytes;
    }
    // The same for the tile whose first row is at `first_row` (a paged operand's: the whole tile in one page).
    __device__ __forceinline__ void next_from(const T* first_row, int hop) {
        src = first_row + offset;
        next(hop);
    }
};

// Whether the whole tiles of two operands swept together (K and V, Q and dO) go through chunk loaders A and B: rows
// the loaders can address, 16-byte copies (the launch's vector flags) and widths of whole chunks, for both.
template <typename A, typename B, typename T>
__device__ __forceinline__ bool chunk_loads(const TileSource<T>& a, const TileSource<T>& b) {
    return A::usable(a.row) && B::usable(b.row) && a.vector && b.vector && a.width % A::kChunk == 0 &&
           b.width % B::kChunk == 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Fragment loads with ldmatrix.x4: lanes 8j..8j+7 address the rows of 8x8 matrix j. Each operand shape has a
// lane offset (elements from a fragment's corner to the row this lane addresses); with a tile's shared address
// plus the lane's offset taken once, every fragment's address is that plus a constant.
// C: elements in a 16-byte row of an 8x8 b16 matrix (8 halves; 4 floats, whose matrices ldmatrix loads as well:
// lane L then holds row L / 4, float L % 4, which is the tf32 fragments' (g, t)).
template <int LD, int C = kChunk> __device__ __forceinline__ int a_lane(int lane) {
    return ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + C * (lane >> 4);
}
template <int LD, int C = kChunk> __device__ __forceinline__ int b_nk_lane(int lane) {
    return ((lane & 7) + 8 * (lane >> 4)) * LD + C * ((lane >> 3) & 1);
}
template <int LD> __device__ __forceinline__ int b_kn_lane(int lane) {
    return ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4);
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
// The forward's two products per element type, FwdMath<T, Passes>: S += Q_i K_j^T one step at a time, and
// O_i += P V_j for a whole key tile. A step covers 32 bytes of a Q and K row (16 halves, 8 floats, 4 doubles); an
// m16 x n8 accumulator is c[4] in Acc: (row g, columns 2t, 2t + 1) and (row g + 8, the same), as for m16n8k16.
// A fragment of an m16 tile x one step (AFrag) and B fragments of two n8 tiles x one step (BFrag) are loaded from
// each lane's address into a tile (QAddr, KAddr: from q_lane, k_lane) plus a fragment's offset.

struct Frag4 { unsigned r[4]; };  // four 32-bit registers, as ldmatrix.x4 fills them


// __half and __nv_bfloat16: mma.m16n8k16, fragments through ldmatrix, P rounded to T as the A operand of P V,
// V_j through ldmatrix.trans. Passes is unused.
template <typename T, int Passes> struct FwdMath {
    using Acc = float;
    using AFrag = Frag4;
    using BFrag = Frag4;
    using QAddr = ptx::SharedAddr;
    using KAddr = ptx::SharedAddr;
    using VAddr = ptx::SharedAddr;
    static constexpr int kStep = 16;
    static constexpr int kUnrollSteps = 64;  // Q K^T's steps unrolled whole: Q_i's fragments index them
    static constexpr bool kPrepare = false;  // operands used as loaded
    template <int Rows, int Cols, int LD, int Threads> __device__ static void prepare(T*, int) {}
    template <int LD> __device__ static QAddr q_lane(const T* Q_w, int lane) {
        return ptx::shared_addr(Q_w + a_lane<LD>(lane));
    }
    template <int LD> __device__ static KAddr k_lane(const T* K_s, int lane) {
        return ptx::shared_addr(K_s + b_nk_lane<LD>(lane));
    }
    template <int LD> __device__ static VAddr v_lane(const T* V_s, int lane) {
        return ptx::shared_addr(V_s + b_kn_lane<LD>(lane));
    }
    template <int LD> __device__ static void load_a(AFrag& a, QAddr at, int row0, int col0, int) {
        ptx::ldmatrix_x4(a.r, at + (row0 * LD + col0) * (int)sizeof(T));
    }
    template <int LD> __device__ static void load_b(BFrag& b, KAddr at, int n0, int k0, int) {
        ptx::ldmatrix_x4(b.r, at + (n0 * LD + k0) * (int)sizeof(T));
    }
    // c += a b for n8 tile `n` (0 or 1) of b.
    __device__ static void mma(Acc (&c)[4], const AFrag& a, const BFrag& b, int n) {
        const unsigned bn[2] = {b.r[2 * n], b.r[2 * n + 1]};
        mma16816(c, a.r, bn, T{});
    }
    template <int LD, int MT, int NT, int ET>
    __device__ static void pv(Acc (&O)[MT][ET][4], const Acc (&P)[MT][NT][4], VAddr V_j, int) {
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            AFrag a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt].r[0] = pack2(P[mt][2 * kk][0], P[mt][2 * kk][1], T{});
                a[mt].r[1] = pack2(P[mt][2 * kk][2], P[mt][2 * kk][3], T{});
                a[mt].r[2] = pack2(P[mt][2 * kk + 1][0], P[mt][2 * kk + 1][1], T{});
                a[mt].r[3] = pack2(P[mt][2 * kk + 1][2], P[mt][2 * kk + 1][3], T{});
            }
#pragma unroll
            for (int ep = 0; ep < ET / 2; ++ep) {
                BFrag bv;
                ptx::ldmatrix_x4_trans(bv.r, V_j + (16 * kk * LD + 16 * ep) * (int)sizeof(T));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma(O[mt][2 * ep], a[mt], bv, 0);
                    mma(O[mt][2 * ep + 1], a[mt], bv, 1);
                }
            }
        }
    }
    __device__ static void store_pair(T* at, Acc x, Acc y) { *reinterpret_cast<unsigned*>(at) = pack2(x, y, T{}); }
};

// float: mma.m16n8k8 on TF32 operands. Passes 3 (exact): each operand x is split into x_hi = tf32(x) and
// x_lo = tf32(x - x_hi), and a b = a_lo b_hi + a_hi b_lo + a_hi b_hi (the small terms first; a_lo b_lo, below
// 2^-22 of a b, is dropped), accumulated in float. Passes 1: one product of the operands rounded to TF32.
// Q, K and V are split (or rounded) once per tile in shared memory by prepare (each warp would otherwise split
// every fragment it loads): x_hi in place, x_lo kLoBytes further on, where the kernel keeps a copy of each of
// their regions (MmaShared). Q and K fragments come through ldmatrix (a float row of an 8x8 b16 matrix is 4
// floats: lane L gets row L / 4, float L % 4, the tf32 layout). P V takes P straight from S's accumulators,
// split in registers: S holds columns 2t, 2t + 1 where the A operand wants t, t + 4, so the k index t of an 8-key
// step stands for key 2t and t + 4 for key 2t + 1, and each lane reads V_j's rows 2t and 2t + 1 in that order
// (plain loads: ldmatrix.trans moves 16-bit elements).
__device__ __forceinline__ void split_tf32(float v, unsigned& hi, unsigned& lo) {
    hi = ptx::cvt_rna_tf32(v);
    const float h = __uint_as_float(hi);
    lo = h - h == 0.0f ? ptx::cvt_rna_tf32(v - h) : 0u;  // an inf or NaN stays in hi alone
}

template <int Passes> struct TF32Frag { unsigned hi[4], lo[4]; };  // 3xTF32: both parts
template <> struct TF32Frag<1> { unsigned hi[4]; };

template <int Passes> struct FwdMath<float, Passes> {
    static_assert(Passes == 1 || Passes == 3, "float runs one TF32 pass or three (3xTF32)");
    using T = float;
    using Acc = float;
    using AFrag = TF32Frag<Passes>;
    using BFrag = TF32Frag<Passes>;
    using QAddr = ptx::SharedAddr;
    using KAddr = ptx::SharedAddr;
    using VAddr = ptx::SharedAddr;
    static constexpr int kStep = 8;
    static constexpr int kUnrollSteps = 1;  // a step at a time: ptxas would otherwise load every step's fragments
    static constexpr bool kPrepare = true;  // operands split in shared memory, once per tile
    template <int LD> __device__ static QAddr q_lane(const T* Q_w, int lane) {
        return ptx::shared_addr(Q_w + a_lane<LD, 4>(lane));
    }
    template <int LD> __device__ static KAddr k_lane(const T* K_s, int lane) {
        return ptx::shared_addr(K_s + b_nk_lane<LD, 4>(lane));
    }
    template <int LD> __device__ static VAddr v_lane(const T* V_s, int lane) {
        return ptx::shared_addr(V_s + 2 * (lane % 4) * LD + lane / 4);
    }
    // Rows x Cols of a tile (pitch LD) into TF32 in place, and (Passes 3) the low parts lo_bytes further on.
    template <int Rows, int Cols, int LD, int Threads>
    __device__ static void prepare(T* tile, int lo_bytes) {
        for (int idx = threadIdx.x; idx < Rows * (Cols / 4); idx += Threads) {
            float* at = tile + idx / (Cols / 4) * LD + idx % (Cols / 4) * 4;
            const Chunk16 raw = *reinterpret_cast<const Chunk16*>(at);  // 16-byte accesses, as Chunk16 copies
            Chunk16 hi, lo;
#pragma unroll
            for (int w = 0; w < 4; ++w) split_tf32(__uint_as_float(raw.word[w]), hi.word[w], lo.word[w]);
            *reinterpret_cast<Chunk16*>(at) = hi;
            if (Passes == 3) *reinterpret_cast<Chunk16*>(reinterpret_cast<unsigned char*>(at) + lo_bytes) = lo;
        }
    }
    template <int LD> __device__ static void load_a(AFrag& a, QAddr at, int row0, int col0, int lo_bytes) {
        ptx::ldmatrix_x4(a.hi, at + (row0 * LD + col0) * (int)sizeof(T));
        if constexpr (Passes == 3) ptx::ldmatrix_x4(a.lo, at + (row0 * LD + col0) * (int)sizeof(T) + lo_bytes);
    }
    template <int LD> __device__ static void load_b(BFrag& b, KAddr at, int n0, int k0, int lo_bytes) {
        ptx::ldmatrix_x4(b.hi, at + (n0 * LD + k0) * (int)sizeof(T));
        if constexpr (Passes == 3) ptx::ldmatrix_x4(b.lo, at + (n0 * LD + k0) * (int)sizeof(T) + lo_bytes);
    }
    // c += a b for n8 tile `n` (0 or 1) of b.
    __device__ static void mma(Acc (&c)[4], const AFrag& a, const BFrag& b, int n) {
        const unsigned b_hi[2] = {b.hi[2 * n], b.hi[2 * n + 1]};
        if constexpr (Passes == 3) {
            const unsigned b_lo[2] = {b.lo[2 * n], b.lo[2 * n + 1]};
            ptx::mma_m16n8k8_tf32(c, a.lo, b_hi, c);
            ptx::mma_m16n8k8_tf32(c, a.hi, b_lo, c);
        }
        ptx::mma_m16n8k8_tf32(c, a.hi, b_hi, c);
    }
    template <int LD, int MT, int NT, int ET>
    __device__ static void pv(Acc (&O)[MT][ET][4], const Acc (&P)[MT][NT][4], VAddr V_j, int lo_bytes) {
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) {
            AFrag a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {  // (g, t) <- key 2t, (g + 8, t), (g, t + 4) <- key 2t + 1, (g + 8, t + 4)
                const float p[4] = {P[mt][kk][0], P[mt][kk][2], P[mt][kk][1], P[mt][kk][3]};
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    if constexpr (Passes == 3)
                        split_tf32(p[x], a[mt].hi[x], a[mt].lo[x]);
                    else
                        a[mt].hi[x] = ptx::cvt_rna_tf32(p[x]);
                }
            }
#pragma unroll
            for (int et = 0; et < ET; ++et) {
                const ptx::SharedAddr row0 = V_j + (8 * kk * LD + 8 * et) * (int)sizeof(T), row1 = row0 + LD * 4;
                BFrag b;
                b.hi[0] = ptx::ld_shared_b32(row0);
                b.hi[1] = ptx::ld_shared_b32(row1);
                if constexpr (Passes == 3) {
                    b.lo[0] = ptx::ld_shared_b32(row0 + lo_bytes);
                    b.lo[1] = ptx::ld_shared_b32(row1 + lo_bytes);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma(O[mt][et], a[mt], b, 0);
            }
        }
    }
    __device__ static void store_pair(T* at, Acc x, Acc y) { *reinterpret_cast<float2*>(at) = make_float2(x, y); }
};

// double: mma.m8n8k4 (DMMA), two per m16 x n8 x k4 step (rows g and g + 8), each product an IEEE fused
// multiply-add. Fragments by 8-byte loads: lane (g, t) reads row g (and g + 8), column t. As for float, the k
// index t of P's two 4-key steps per n8 tile stands for key 2t (step 0) and 2t + 1 (step 1).
template <int Passes> struct FwdMath<double, Passes> {
    using T = double;
    using Acc = double;
    struct AFrag { double x[2]; };  // rows g and g + 8, column t
    struct BFrag { double x[2]; };  // n8 tiles 0 and 1: row g of each (a key), column t
    using QAddr = ptx::SharedAddr;
    using KAddr = ptx::SharedAddr;
    using VAddr = ptx::SharedAddr;
    static constexpr int kStep = 4;
    static constexpr int kUnrollSteps = 1;
    static constexpr bool kPrepare = false;
    template <int Rows, int Cols, int LD, int Threads> __device__ static void prepare(T*, int) {}
    template <int LD> __device__ static QAddr q_lane(const T* Q_w, int lane) {
        return ptx::shared_addr(Q_w + lane / 4 * LD + lane % 4);
    }
    template <int LD> __device__ static KAddr k_lane(const T* K_s, int lane) {
        return ptx::shared_addr(K_s + lane / 4 * LD + lane % 4);
    }
    template <int LD> __device__ static VAddr v_lane(const T* V_s, int lane) {
        return ptx::shared_addr(V_s + 2 * (lane % 4) * LD + lane / 4);
    }
    template <int LD> __device__ static void load_a(AFrag& a, QAddr at, int row0, int col0, int) {
        a.x[0] = ptx::ld_shared_f64(at + (row0 * LD + col0) * 8);
        a.x[1] = ptx::ld_shared_f64(at + ((row0 + 8) * LD + col0) * 8);
    }
    template <int LD> __device__ static void load_b(BFrag& b, KAddr at, int n0, int k0, int) {
        b.x[0] = ptx::ld_shared_f64(at + (n0 * LD + k0) * 8);
        b.x[1] = ptx::ld_shared_f64(at + ((n0 + 8) * LD + k0) * 8);
    }
    // c += (rows g, g + 8 of A: a_top, a_bottom) b.
    __device__ static void mma2(Acc (&c)[4], double a_top, double a_bottom, double b) {
        double top[2] = {c[0], c[1]}, bottom[2] = {c[2], c[3]};
        ptx::mma_m8n8k4_f64(top, a_top, b, top);
        ptx::mma_m8n8k4_f64(bottom, a_bottom, b, bottom);
        c[0] = top[0], c[1] = top[1], c[2] = bottom[0], c[3] = bottom[1];
    }
    __device__ static void mma(Acc (&c)[4], const AFrag& a, const BFrag& b, int n) { mma2(c, a.x[0], a.x[1], b.x[n]); }
    template <int LD, int MT, int NT, int ET>
    __device__ static void pv(Acc (&O)[MT][ET][4], const Acc (&P)[MT][NT][4], VAddr V_j, int) {
#pragma unroll
        for (int kk = 0; kk < NT; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int et = 0; et < ET; ++et) {
                    const double b = ptx::ld_shared_f64(V_j + ((8 * kk + h) * LD + 8 * et) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma2(O[mt][et], P[mt][kk][h], P[mt][kk][2 + h], b);
                }
            }
    }
    __device__ static void store_pair(T* at, Acc x, Acc y) {
        const double2 pair = make_double2(x, y);
        *reinterpret_cast<uint4*>(at) = *reinterpret_cast<const uint4*>(&pair);
    }
};

// ---------------------------------------------------------------------------------------------------------------
// The rare path: hidden keys whose value rows hold inf or NaN.

// Whether the first `rows` rows of a padded Rows-row tile (V_j in the forward) hold an inf or NaN (rows past `rows`
// and columns past the operand's width are zeros).
template <typename T, int Rows, int Cols, int Threads, int LD = Padded<Cols, T>::ld>
__device__ __forceinline__ bool tile_nonfinite(const T* tile, int rows) {
    constexpr int kChunk = chunk_pad<T>(), ChunksPerRow = Cols / kChunk;
    bool found = false;
    for (int idx = threadIdx.x; idx < (rows + 7) / 8 * 8 * ChunksPerRow; idx += Threads) {  // whole groups of 8 rows
        const int r = chunk_row<ChunksPerRow, Rows, LD * sizeof(T) / 16>(idx);
        if (r >= rows) continue;
        const Chunk16 chunk = *reinterpret_cast<const Chunk16*>(tile + r * LD + (idx % ChunksPerRow) * kChunk);
        found = found || chunk_nonfinite(chunk, T{});
    }
    return found;
}

// O_i += P_ij V_j on CUDA cores with hidden keys skipped by selection (forward.cuh's rule), for one warp's
// m16 tiles: P goes through the warp's scratch rows P_w in T (as the tensor-core path rounds it), hidden as -1.
// V_j's rows are LDV elements apart; lo_bytes > 0: V's low parts lie that far on (3xTF32), added to it.
template <typename T, int Bc, int E, int MT, int LDV, typename Acc>
__device__ __forceinline__ void pv_by_selection(Acc (&O_i)[MT][E / 8][4], const Acc (&P)[MT][Bc / 8][4],
                                                const unsigned (&hidden)[MT][2], T* P_w, const T* V_j,
                                                int lo_bytes, int cols, int lane) {
    const T* V_lo = reinterpret_cast<const T*>(reinterpret_cast<const unsigned char*>(V_j) + lo_bytes);
    constexpr int LDP = Padded<Bc, T>::ld;
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
                        from_acc<T>((hidden[mt][h] >> (2 * nt + x) & 1u) ? Acc(-1) : P[mt][nt][2 * h + x]);
        __syncwarp();
        for (int j = 0; j < cols; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Acc p = to_acc(P_w[(quad_row + 8 * h) * LDP + j]);
                if (p < Acc(0)) continue;  // hidden (a visible p is >= 0 or NaN)
#pragma unroll
                for (int et = 0; et < E / 8; ++et)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int at = j * LDV + 8 * et + 2 * quad_col + x;
                        const Acc v = lo_bytes ? to_acc(V_j[at]) + to_acc(V_lo[at]) : to_acc(V_j[at]);
                        O_i[mt][et][2 * h + x] += p * v;
                    }
            }
        }
        __syncwarp();  // the next m16 tile reuses P_w
    }
}

// out += W Y on CUDA cores with hidden pairs skipped by selection, for one warp's m16 tiles (the backward's rare
// path: dQ += dS K_j, dK += dS^T Q_i, dV += P^T dO_i where a row of Y that some pair hides holds inf or NaN).
// W's fragments (K columns, in Acc) and each lane's hidden bits (bit 2 nt + x of its element [nt][2 h + x]) go
// through the warp's scratch: W_w holds 16 rows of K + 1 values, H_w 16 rows of 4 words (one per quad lane).
// Y: K rows of N (pitch LDY) in shared memory, `count` of them valid; LoBytes > 0: Y's low parts lie that far on
// (3xTF32), added to it. Acc: the accumulators' type (double for double).
template <typename T, int K, int N, int MT, int LDY = Padded<N>::ld, int LoBytes = 0, typename Acc>
__device__ __forceinline__ void acc_by_selection(Acc (&out)[MT][N / 8][4], const Acc (&W)[MT][K / 8][4],
                                                 const unsigned (&hidden)[MT][2], Acc* W_w, unsigned* H_w,
                                                 const T* Y, int count, int lane) {
    static_assert(K <= 128, "hidden bits of a row fit one word per quad lane");
    constexpr int LDW = K + 1;
    const auto y_at = [](const T* Y, int at) {
        if constexpr (LoBytes != 0)
            return to_acc(Y[at]) + to_acc(*reinterpret_cast<const T*>(reinterpret_cast<const unsigned char*>(Y + at) +
                                                                      LoBytes));
        else
            return to_acc(Y[at]);
    };
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
                const Acc w = W_w[row * LDW + j];
#pragma unroll
                for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x)
                        out[mt][nt][2 * h + x] += w * y_at(Y, j * LDY + 8 * nt + 2 * quad_col + x);
            }
        }
        __syncwarp();  // the next m16 tile reuses the scratch
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The epilogue's store: a Rows x Cols staging tile to global rows (rows x cols of it), 16 bytes per thread and
// step when the destination allows (unit column stride, 16-byte aligned rows), else element by element.
template <typename T, int Rows, int Cols, int Threads, int LD = Padded<Cols, T>::ld>
__device__ __forceinline__ void store_tile(T* dst, long long row_stride, long long col_stride, const T* tile,
                                           int rows, int cols) {
    constexpr int kChunk = chunk_pad<T>(), ChunksPerRow = Cols / kChunk;
    const bool vector = col_stride == 1 && row_stride % kChunk == 0 &&
                        reinterpret_cast<unsigned long long>(dst) % 16 == 0;
    for (int idx = threadIdx.x; idx < Rows * ChunksPerRow; idx += Threads) {
        const int r = chunk_row<ChunksPerRow, Rows, LD * sizeof(T) / 16>(idx), c = (idx % ChunksPerRow) * kChunk;
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
