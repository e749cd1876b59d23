// The backward pass on tensor cores on sm_80 and newer: backward.cuh's two kernels (the same arguments, the same
// split of the work, no atomics) with their tile products on tensor cores, as the forward's (forward_mma.cuh):
// __half and __nv_bfloat16 on mma.m16n8k16, float on mma.m16n8k8 with TF32 operands (three passes, 3xTF32, or one),
// double on mma.m8n8k4 (DMMA). mma::Products<T, Passes> holds what differs per type: the two tile products.
//
//   bwd_mma_dkdv: one block per Bc keys; its warps split the keys, MT m16 tiles each. Per query tile:
//                 S^T = K_j Q_i^T and dP^T = V_j dO_i^T (K_j, V_j as A fragments; Q_i, dO_i as the column-major B
//                 operand), P^T and dS^T elementwise on the accumulator fragments, then dV_j += P^T dO_i and
//                 dK_j += dS^T Q_i with P^T, dS^T as the A operand in registers (rounded to T for the 16-bit
//                 types; FlashAttention-2's register reuse) and dO_i, Q_i as the row-major B operand.
//   bwd_mma_dq:   one block per Br queries; its warps split the queries. Per key tile: S = Q_i K_j^T,
//                 dP = dO_i V_j^T, P and dS elementwise (dbias written when asked), dQ_i += dS K_j.
//
// Gradients accumulate in fragments of the accumulator type (float; double for double) and go to the gradient
// arrays straight from them. float's swept tiles are split (3xTF32: their low parts in a copy of their region) or
// rounded to TF32 once per tile in shared memory, for every warp; its own tiles as each warp loads them. Loads are
// cp.async (element loads for strided views); with two stages the next swept tile's copies (and, in bwd_mma_dkdv,
// its row terms) go into the other stage while one is computed, one barrier a tile (float: two, the split between).
// As in the forward, the plain swept tiles (whole, every pair of the block's rows and the tile's visible, no mask or
// bias) come first (SweepOrder), in a loop compiled apart from the other tiles' (window edges, masks, biases, a short
// last tile): P and dS of one FMA and one exp2 each, no visibility, no checks, each thread's copies from its chunk
// loaders.
// A hidden pair's P and dS are 0 by selection; a 0 times an inf or NaN in a row some pair hides
// (a key of K_j; a query row of Q_i or dO_i) would still be NaN on tensor cores, so tiles that hide pairs look
// for non-finite values first and, only then, take the product on CUDA cores with hidden pairs skipped
// (mma::acc_by_selection).
//
// Template: T element type; Br queries and Bc keys per tile (the block's own axis is 16 x MT x Warps, over 2 for
// double's dK dV at D + E > 128: mma_backward::kColumnSplit); D, E head-dim buckets (multiples of 32 up to 128;
// run-time d, e, tails zero-filled); Warps per block; Stages of the swept tiles (1 or 2); Passes: float's TF32
// passes (3 or 1; the other types ignore it).
#pragma once

#include "backward.cuh"
#include "mma_tile.cuh"

namespace cuflash {

// Limits of the layout, held to cuflash/kernels/backward_mma.py's by tests/test_layout.py.
namespace mma_backward {
constexpr int kMaxSwept = 128;    // a swept tile's hidden-pair bits fit one 32-bit word per quad lane
constexpr int kMaxHeadDim = 128;  // D and E: the gradients stay whole in registers
// Whether a block keeps its swept tiles' low parts beside them in shared memory (float in three TF32 passes).
template <typename T, int Passes> constexpr bool kLowParts = sizeof(T) == 4 && Passes == 3;
// Warps that share each 16 own keys of bwd_mma_dkdv, each holding its share of dK's and dV's columns: 2 for double
// at D + E > 128 (whole 16-row gradients would take 2 (D + E) registers a thread), each warp of a pair taking S^T
// and dP^T of the same keys; 1 otherwise.
template <typename T, int D, int E> constexpr int kColumnSplit = sizeof(T) == 8 && D + E > 128 ? 2 : 1;
}  // namespace mma_backward

// Shared memory of one block (cuflash/kernels/backward_mma.py mirrors it): Q_i and dO_i, K_j and V_j (padded rows), the
// query tile's row terms (RowTerm), and each warp's scratch for the rare CUDA-core product (16 rows of the swept
// tile's width + 1 floats, and 16 x 4 words of hidden bits), and last the block's Sweep. KeysOwn: bwd_mma_dkdv's
// layout. Stages: buffers of the swept tiles (bwd_mma_dq's K_j and V_j; bwd_mma_dkdv's Q_i, dO_i and their row
// terms).
template <typename T, int Br, int Bc, int D, int E, int Warps, bool KeysOwn, int Stages = 1, bool Lo = false>
struct MmaBackwardShared {
    using Acc = typename AccOf<T>::type;
    static constexpr int Split = KeysOwn ? mma_backward::kColumnSplit<T, D, E> : 1;  // warps per 16 own rows
    static constexpr int Own = KeysOwn ? Bc : Br, Swept = KeysOwn ? Br : Bc, MT = Own * Split / (16 * Warps);
    static_assert(Warps % Split == 0 && MT >= 1 && Own * Split == 16 * MT * Warps,
                  "the block's own rows are 16 x Warps / Split x (m16 tiles per warp)");
    static_assert(Swept % 16 == 0 && Swept <= mma_backward::kMaxSwept, "the swept tile is a multiple of 16 up to 128");
    static_assert(D % 32 == 0 && E % 32 == 0 && D <= mma_backward::kMaxHeadDim && E <= mma_backward::kMaxHeadDim,
                  "head-dim buckets are multiples of 32");
    static constexpr int LDD = mma::RowPadded<D, T>::ld, LDE = mma::RowPadded<E, T>::ld, LDW = Swept + 1;
    static constexpr int QStages = KeysOwn ? Stages : 1, KStages = KeysOwn ? 1 : Stages;
    static constexpr size_t q_offset = 0;
    static constexpr size_t do_offset = q_offset + QStages * align16(sizeof(T) * Br * LDD);
    static constexpr size_t k_offset = do_offset + QStages * align16(sizeof(T) * Br * LDE);
    static constexpr size_t v_offset = k_offset + KStages * align16(sizeof(T) * Bc * LDD);
    static constexpr size_t rows_offset = v_offset + KStages * align16(sizeof(T) * Bc * LDE);
    static constexpr size_t w_offset = rows_offset + QStages * align16(sizeof(Acc) * 2 * Br);
    static constexpr size_t h_offset = w_offset + align16(sizeof(Acc) * Warps * 16 * LDW);
    // Lo (3xTF32): a copy of the swept tiles' region (bwd_mma_dq's K and V stages; bwd_mma_dkdv's Q and dO), lo_bytes
    // on from it, for their low parts.
    static constexpr size_t swept_offset = KeysOwn ? q_offset : k_offset;
    static constexpr size_t swept_bytes = KeysOwn ? k_offset - q_offset : rows_offset - k_offset;
    static constexpr size_t lo_offset = h_offset + align16(sizeof(unsigned) * Warps * 16 * 4);
    static constexpr int lo_bytes = Lo ? (int)(lo_offset - swept_offset) : 0;
    static constexpr size_t sweep_offset = lo_offset + (Lo ? swept_bytes : 0);
    static constexpr size_t drop_offset = sweep_offset + align16(sizeof(Sweep));
    using Dropout = BlockDropout<Br, Bc, 2>;  // kernels compiled with CUFLASH_DROPOUT: two keep tiles
    static constexpr size_t bytes = drop_offset + (kDropout ? Dropout::bytes : 0);
};

// The shared tiles of one block by name, and this warp's scratch (W: 16 rows of the swept width + 1 floats, H: 16 x 4
// words of hidden bits); with dropout, the keep tiles (dropout(): visit t's in buffer t % 2).
template <typename T, typename Smem> struct MmaBackwardTiles {
    using Acc = typename Smem::Acc;
    T *Q, *dO, *K, *V;
    RowTerm<Acc>* terms;
    Acc* W;
    unsigned* H;
    __device__ __forceinline__ MmaBackwardTiles(unsigned char* smem, int warp)
        : Q(reinterpret_cast<T*>(smem + Smem::q_offset)), dO(reinterpret_cast<T*>(smem + Smem::do_offset)),
          K(reinterpret_cast<T*>(smem + Smem::k_offset)), V(reinterpret_cast<T*>(smem + Smem::v_offset)),
          terms(reinterpret_cast<RowTerm<Acc>*>(smem + Smem::rows_offset)),
          W(reinterpret_cast<Acc*>(smem + Smem::w_offset) + warp * 16 * Smem::LDW),
          H(reinterpret_cast<unsigned*>(smem + Smem::h_offset) + warp * 16 * 4) {}
    __device__ __forceinline__ typename Smem::Dropout dropout() const {
        return {reinterpret_cast<unsigned char*>(Q) - Smem::q_offset + Smem::drop_offset};
    }
};

namespace mma {

// C[MT][N / 8] = A B^T over K columns: A's rows row0 + 16 mt (tile A, padded K wide), B's rows the n8 columns
// (tile B, padded K wide), both through ldmatrix.
template <typename T, int MT, int N, int K>
__device__ __forceinline__ void product_nk(float (&C)[MT][N / 8][4], const T* A, const T* B, int row0, int lane) {
    constexpr int LD = Padded<K>::ld;
    const T tag{};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
            for (int x = 0; x < 4; ++x) C[mt][nt][x] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) load_a<LD>(a[mt], A, row0 + 16 * mt, 16 * kk, lane);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            load_b_nk<LD>(b, B, 16 * np, 16 * kk, lane);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(C[mt][2 * np], a[mt], b0, tag);
                mma16816(C[mt][2 * np + 1], a[mt], b1, tag);
            }
        }
    }
}

// C[MT][N / 8] += W Y over K: W's accumulator fragments (K columns) rounded to T as A operands, Y (K rows of N,
// padded) through ldmatrix.trans.
template <typename T, int MT, int K, int N>
__device__ __forceinline__ void product_kn(float (&C)[MT][N / 8][4], const float (&W)[MT][K / 8][4], const T* Y,
                                           int lane) {
    constexpr int LD = Padded<N>::ld;
    const T tag{};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack2(W[mt][2 * kk][0], W[mt][2 * kk][1], tag);
            a[mt][1] = pack2(W[mt][2 * kk][2], W[mt][2 * kk][3], tag);
            a[mt][2] = pack2(W[mt][2 * kk + 1][0], W[mt][2 * kk + 1][1], tag);
            a[mt][3] = pack2(W[mt][2 * kk + 1][2], W[mt][2 * kk + 1][3], tag);
        }
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            unsigned b[4];
            load_b_kn<LD>(b, Y, 16 * kk, 16 * np, lane);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(C[mt][2 * np], a[mt], b0, tag);
                mma16816(C[mt][2 * np + 1], a[mt], b1, tag);
            }
        }
    }
}

// The two tile products per element type, Products<T, Passes>: nk, C = A B^T (A's rows row0 + 16 mt of a tile of
// pitch LDA, B's rows the n8 columns, pitch LDB), and kn, C += W Y (W's accumulator fragments as the A operand,
// Y's K rows of N, pitch LDY, as the B operand); lo_bytes: from an element of B or Y to its low part (3xTF32). The
// 16-bit types: product_nk and product_kn above.
template <typename T, int Passes> struct Products {
    template <int MT, int N, int K, int LDA, int LDB>
    __device__ __forceinline__ static void nk(float (&C)[MT][N / 8][4], const T* A, const T* B, int row0, int lane,
                                              int) {
        product_nk<T, MT, N, K>(C, A, B, row0, lane);
    }
    template <int MT, int K, int N, int LDY>
    __device__ __forceinline__ static void kn(float (&C)[MT][N / 8][4], const float (&W)[MT][K / 8][4], const T* Y,
                                              int lane, int) {
        product_kn<T, MT, K, N>(C, W, Y, lane);
    }
};

// float: mma.m16n8k8 on TF32 operands, as the forward's FwdMath<float, Passes> (3xTF32: a_lo b_hi + a_hi b_lo +
// a_hi b_hi; one pass: a_hi b_hi). The swept tiles (B of nk, Y of kn) come split (or rounded) to TF32 in shared
// memory, once per tile for every warp (FwdMath::prepare: x_hi in place, x_lo lo_bytes on); the block's own tiles
// (A of nk), read once per sweep step by each warp, are split in registers as they are loaded: a copy of their low
// parts would not fit beside them. A and B of nk through ldmatrix (a float row of an 8x8 b16 matrix is 4 floats: the
// tf32 fragments' (g, t)); kn's W from the accumulators, the k index t of an 8-column step standing for column 2t
// and t + 4 for 2t + 1, and Y's rows 2t and 2t + 1 by plain loads.
template <int Passes> struct Products<float, Passes> {
    using Math = FwdMath<float, Passes>;
    using Frag = TF32Frag<Passes>;
    __device__ __forceinline__ static void to_tf32(float x, Frag& f, int i) {
        if constexpr (Passes == 3)
            split_tf32(x, f.hi[i], f.lo[i]);
        else
            f.hi[i] = ptx::cvt_rna_tf32(x);
    }
    __device__ __forceinline__ static void load(Frag& f, ptx::SharedAddr at) {
        unsigned raw[4];
        ptx::ldmatrix_x4(raw, at);
#pragma unroll
        for (int i = 0; i < 4; ++i) to_tf32(__uint_as_float(raw[i]), f, i);
    }
    template <int MT, int N, int K, int LDA, int LDB>
    __device__ __forceinline__ static void nk(float (&C)[MT][N / 8][4], const float* A, const float* B, int row0,
                                              int lane, int lo_bytes) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
                for (int x = 0; x < 4; ++x) C[mt][nt][x] = 0.0f;
        const ptx::SharedAddr a_at = ptx::shared_addr(A + row0 * LDA + a_lane<LDA, 4>(lane));
        const ptx::SharedAddr b_at = ptx::shared_addr(B + b_nk_lane<LDB, 4>(lane));
#pragma unroll 1
        for (int kk = 0; kk < K / 8; ++kk) {  // a step at a time, as the forward's: fragments of one step live
            Frag a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) load(a[mt], a_at + (16 * mt * LDA + 8 * kk) * 4);
#pragma unroll
            for (int np = 0; np < N / 16; ++np) {
                Frag b;
                ptx::ldmatrix_x4(b.hi, b_at + (16 * np * LDB + 8 * kk) * 4);
                if constexpr (Passes == 3) ptx::ldmatrix_x4(b.lo, b_at + (16 * np * LDB + 8 * kk) * 4 + lo_bytes);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Math::mma(C[mt][2 * np], a[mt], b, 0);
                    Math::mma(C[mt][2 * np + 1], a[mt], b, 1);
                }
            }
        }
    }
    template <int MT, int K, int N, int LDY>
    __device__ __forceinline__ static void kn(float (&C)[MT][N / 8][4], const float (&W)[MT][K / 8][4], const float* Y,
                                              int lane, int lo_bytes) {
        const ptx::SharedAddr y_at = ptx::shared_addr(Y + 2 * (lane % 4) * LDY + lane / 4);
#pragma unroll
        for (int kk = 0; kk < K / 8; ++kk) {
            Frag a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {  // (g, t) <- column 2t, (g + 8, t), (g, t + 4) <- 2t + 1, (g + 8, t + 4)
                const float w[4] = {W[mt][kk][0], W[mt][kk][2], W[mt][kk][1], W[mt][kk][3]};
#pragma unroll
                for (int x = 0; x < 4; ++x) to_tf32(w[x], a[mt], x);
            }
#pragma unroll
            for (int nt = 0; nt < N / 8; ++nt) {
                const ptx::SharedAddr row0 = y_at + (8 * kk * LDY + 8 * nt) * 4, row1 = row0 + LDY * 4;
                Frag b;
                b.hi[0] = ptx::ld_shared_b32(row0);
                b.hi[1] = ptx::ld_shared_b32(row1);
                if constexpr (Passes == 3) {
                    b.lo[0] = ptx::ld_shared_b32(row0 + lo_bytes);
                    b.lo[1] = ptx::ld_shared_b32(row1 + lo_bytes);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) Math::mma(C[mt][nt], a[mt], b, 0);
            }
        }
    }
};

// double: mma.m8n8k4 (DMMA), the forward's FwdMath<double>: fragments by 8-byte loads, lane (g, t) at row g (and
// g + 8), column t; kn is the forward's P V.
template <int Passes> struct Products<double, Passes> {
    using Math = FwdMath<double, Passes>;
    template <int MT, int N, int K, int LDA, int LDB>
    __device__ __forceinline__ static void nk(double (&C)[MT][N / 8][4], const double* A, const double* B, int row0,
                                              int lane, int) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
                for (int x = 0; x < 4; ++x) C[mt][nt][x] = 0.0;
        const ptx::SharedAddr a_at = Math::template q_lane<LDA>(A + row0 * LDA, lane);
        const ptx::SharedAddr b_at = Math::template k_lane<LDB>(B, lane);
#pragma unroll 1
        for (int kk = 0; kk < K / 4; ++kk) {
            typename Math::AFrag a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) Math::template load_a<LDA>(a[mt], a_at, 16 * mt, 4 * kk, 0);
#pragma unroll
            for (int np = 0; np < N / 16; ++np) {
                typename Math::BFrag b;
                Math::template load_b<LDB>(b, b_at, 16 * np, 4 * kk, 0);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Math::mma(C[mt][2 * np], a[mt], b, 0);
                    Math::mma(C[mt][2 * np + 1], a[mt], b, 1);
                }
            }
        }
    }
    template <int MT, int K, int N, int LDY>
    __device__ __forceinline__ static void kn(double (&C)[MT][N / 8][4], const double (&W)[MT][K / 8][4],
                                              const double* Y, int lane, int) {
        Math::template pv<LDY, MT, K / 8, N / 8>(C, W, Math::template v_lane<LDY>(Y, lane), 0);
    }
};

// rows x width of scale * C (a warp's fragments; rows row0 + 16 mt + quad_row + 8 h) to dst (float; double for
// double).
template <int MT, int N, typename Acc>
__device__ __forceinline__ void store_fragments(Acc* dst, const Acc (&C)[MT][N / 8][4], Acc scale,
                                                long long row_stride, long long col_stride, int row0, int rows,
                                                long long width, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + 16 * mt + lane / 4 + 8 * h;
            if (r >= rows) continue;
#pragma unroll
            for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const int col = 8 * nt + 2 * (lane % 4) + x;
                    if (col < width) dst[r * row_stride + col * col_stride] = scale * C[mt][nt][2 * h + x];
                }
        }
}

// Dropout's Z of a pair: 1 / (1 - p) where kept, 0 where dropped (dP times it is the softmax's gradient).
template <typename Acc> __device__ __forceinline__ Acc dropout_z(bool kept, Acc scale) { return kept ? scale : Acc(0); }

// P and dS of one pair of a plain tile (full, fully visible, no mask or bias): P = exp2 of one FMA, the scale
// folded in, on the MUFU unit (flush-to-zero: a P below 2^-126 of the row's maximum is negligible).
__device__ __forceinline__ void plain_gradient(float S, float dP, float shift, float delta_i, float scale_log2,
                                               float& p, float& ds) {
    p = ptx::ex2_approx_ftz(fmaf(S, scale_log2, -shift));
    ds = p * (dP - delta_i);
}
// double: the accurate exp2.
__device__ __forceinline__ void plain_gradient(double S, double dP, double shift, double delta_i, double scale_log2,
                                               double& p, double& ds) {
    p = exp2(fma(S, scale_log2, -shift));
    ds = p * (dP - delta_i);
}

// A thread's place in its block: its warp, its lane, and the lane's row and column in its quad (the fragments').
struct Place {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_row = lane / 4, quad_col = lane % 4;
};

template <int R, int C, typename Acc> __device__ __forceinline__ void zero(Acc (&x)[R][C][4]) {
#pragma unroll
    for (int a = 0; a < R; ++a)
#pragma unroll
        for (int c = 0; c < C; ++c)
#pragma unroll
            for (int y = 0; y < 4; ++y) x[a][c][y] = Acc(0);
}

// A backward block's sweep in SweepOrder: block.visit(tile, stage, steady, whole) for each visit (whole: the block
// mask shows the tile whole), the steady ones in a loop of their own (steady a Steady<true>: compiled apart), the
// others after it. block.load(tile, stage, hop, steady) issues a swept tile's copies into `stage` and commits them
// (hop: the stages from there to the next tile's, StageRing; steady: the tile is a chunk loaders' one, no need to
// ask): with two stages one visit ahead, into the stage the last visit used; with one at the visit, once every warp
// is done with the last. With dropout, block.keep_bits(0) makes the first visit's keep bits, and
// block.keep_ahead(t) after visit t's barrier the next one's.
template <int Stages, typename Block> __device__ __forceinline__ void sweep(const SweepOrder& order, Block& block) {
    static_assert(Stages == 1 || Stages == 2, "the swept tiles in one stage, or two (the next one's in flight)");
    StageRing<Stages> ring;
    const auto step = [&](const int t, auto steady) {
        const int tile = decltype(steady)::value ? order.plain.lo + t : order.at(t);
        if (Stages == 1) {
            __syncthreads();  // every warp is done with the last visit's tile
            block.load(tile, 0, 0, steady);
        }
        ptx::cp_async_wait<0>();
        __syncthreads();  // the tile has landed; with two stages, every warp is done with the last visit's
        // (a steady visit always has a next tile: the one its prefetch is chunked for)
        if (Stages == 2 && (decltype(steady)::value || t + 1 < order.tiles))
            block.load(order.at(t + 1), ring.before(), ring.hop_before(), steady);
        if constexpr (kDropout) block.keep_ahead(t);
        block.visit(tile, ring.stage, steady, order.whole(t));
    };
    if (Stages == 2 && order.tiles > 0) block.load(order.at(0), 0, 1, Steady<false>{});
    if constexpr (kDropout)
        if (order.tiles > 0) block.keep_bits(0);  // while the first copies fly
    int t = 0;
    if constexpr (kPlainTiles)
        for (; t < order.steady; ++t, ring.advance()) step(t, Steady<true>{});
    for (; t < order.tiles; ++t, ring.advance()) step(t, Steady<false>{});
}

}  // namespace mma

// One block of bwd_mma_dkdv, its steps in the order they run (bwd_mma_dkdv below): the block's view and sweep (made
// by one thread, read from shared memory); K_j and V_j in flight; per query tile (mma::sweep) its Q_i, dO_i and row
// terms, S^T = K_j Q_i^T and dP^T = V_j dO_i^T, P^T and dS^T from the row terms, dV_j += P^T dO_i and
// dK_j += dS^T Q_i; the store of dK_j and dV_j. Its own rows are keys, split among the warps, and the swept columns
// queries: S, dP, P and dS are transposed. The chunk loaders and the gradients are the kernel function's own locals,
// which the block refers to (as the CUDA-core DkdvBlock does: held by value they would be one object with the rest,
// and the compiler would make a worse loop of it).
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, int Passes>
struct MmaDkdvBlock {
    // Its static_asserts: the tile shapes.
    using Smem = MmaBackwardShared<T, Br, Bc, D, E, Warps, true, Stages, mma_backward::kLowParts<T, Passes>>;
    using Tiles = MmaBackwardTiles<T, Smem>;
    using Acc = typename Smem::Acc;
    using Products = mma::Products<T, Passes>;
    static constexpr int kLoBytes = Smem::lo_bytes;  // from a swept tile's element to its low part (3xTF32)
    // Split: warps per 16 keys, each with DS of dK's columns and ES of dV's (from d0 and e0).
    static constexpr int Split = Smem::Split, DS = D / Split, ES = E / Split;
    static constexpr int Threads = Warps * 32, MT = Smem::MT, NT = Br / 8, DT = DS / 8, ET = ES / 8;
    using QLoader = mma::ChunkLoader<T, Br, D, Threads, Smem::LDD>;
    using OLoader = mma::ChunkLoader<T, Br, E, Threads, Smem::LDE>;
    using Frags = Acc[MT][NT][4];  // S^T, dP^T, P^T or dS^T of the warp's keys: keys by row, queries by column
    using DGrad = Acc[MT][DT][4];
    using EGrad = Acc[MT][ET][4];

    // The block's view of the launch (its keys, and the queries that see them: the swept tiles) and its sweep. The
    // plain query tiles see every key of the block, with neither mask nor bias (plain_tiles). Whole query tiles of
    // 16-byte rows from the first plain one on come through each thread's chunk loaders, the others (a short last
    // tile, those before the first plain one, strided views) through the general copy.
    __device__ __forceinline__ static Sweep sweep_of(const Params<T>& p) {
        const BlockOperands ops = key_block<Bc, Br>(p);
        const bool chunk_loads = mma::chunk_loads<QLoader, OLoader>(ops.source(p.q, kQ, p.d, p.flags, kVectorQ),
                                                                    ops.source(p.dout, kDout, p.e, p.flags,
                                                                               kVectorDout));
        const TileRange plain = plain_tiles<Br, Bc, true>(ops, p.left, p.right, true);
        return Sweep{ops, SweepOrder::of(ops.queries, Br, plain, chunk_loads, Stages,
                                          visited<Br>(p, ops.keys.begin / Bc, ops.queries))};
    }

    const Params<T>& p;
    const Tiles s;  // Q_i, dO_i and the row terms: stage 0's
    const BlockOperands& ops;
    const SweepOrder& order;
    const long long j0;
    const int keys;
    const RowTerm<Acc>* const terms_b;           // the batch item's row terms
    const int warp_row, lane, quad_row, quad_col;  // warp_row: this warp's first key row within the tile
    const int d0, e0;                              // its first columns of dK and dV
    QLoader& Q_load;
    OLoader& dO_load;
    DGrad& dK;
    EGrad& dV;
    int keeps = 0;  // with dropout: the keep tile of the visit (its buffer)

    __device__ __forceinline__ MmaDkdvBlock(const Params<T>& params, const Sweep& sweep, const Tiles& tiles,
                                            const mma::Place& at, QLoader& q_load, OLoader& do_load, DGrad& dk,
                                            EGrad& dv)
        : p(params), s(tiles), ops(sweep.ops), order(sweep.order), j0(ops.keys.begin), keys(ops.keys.size()),
          terms_b(row_terms_of(p.terms, ops.base)), warp_row(at.warp / Split * 16 * MT), lane(at.lane),
          quad_row(at.quad_row), quad_col(at.quad_col), d0(at.warp % Split * DS), e0(at.warp % Split * ES),
          Q_load(q_load), dO_load(do_load), dK(dk), dV(dv) {}

    // K_j and V_j stay for the whole sweep: their copies go out first (they land by the first visit's wait). Then
    // the chunk loaders start at the first plain query tile, and the gradients at 0.
    __device__ __forceinline__ void start() {
        load_rows_async<T, Bc, D, Smem::LDD, Threads>(s.K, ops.source(p.k, kK, p.d, p.flags, kVectorK), j0, keys);
        load_rows_async<T, Bc, E, Smem::LDE, Threads>(s.V, ops.source(p.v, kV, p.e, p.flags, kVectorV), j0, keys);
        ptx::cp_async_commit();
        const long long chunks_from = ops.queries.begin + (long long)order.plain.lo * Br;
        Q_load = QLoader(ops.row_of(p.q, kQ, chunks_from), ops.strides(kQ).row, (int)p.d, s.Q);
        dO_load = OLoader(ops.row_of(p.dout, kDout, chunks_from), ops.strides(kDout).row, (int)p.e, s.dO);
        mma::zero(dK);
        mma::zero(dV);
        if constexpr (kDropout) s.dropout().start(p);
    }

    // The first query of visit v's tile.
    __device__ __forceinline__ long long query_start(int v) const {
        return ops.queries.begin + (long long)order.at(v) * Br;
    }
    // Dropout: visit t's keep bits into buffer t % 2, the first before any visit's barrier, the others after the
    // barrier of the visit before (every warp is done with the buffer).
    __device__ __forceinline__ void keep_bits(int t) { s.dropout().template fill<Threads>(t & 1, query_start(t), j0); }
    __device__ __forceinline__ void keep_ahead(int t) {
        keeps = t & 1;
        if (t + 1 < order.tiles) keep_bits(t + 1);
    }
    // Dropout: P^T times the keep bit (what dV takes; store scales it by 1 / (1 - p)) and dP^T times Z, before the
    // gradients; a thread's queries are its columns, its keys (rows) bits warp_row + quad_row + 16 mt + 8 h of each
    // query's row of the keep tile.
    __device__ __forceinline__ void drop_dp(Frags& dP) const {
        const auto tile = s.dropout().tile(keeps);
        const Acc scale = Acc(p.dropout.scale);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const auto keep = tile.template bits<16 * MT - 7>(8 * nt + 2 * quad_col + x, warp_row + quad_row);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) dP[mt][nt][2 * h + x] *= mma::dropout_z(keep[16 * mt + 8 * h], scale);
            }
    }
    __device__ __forceinline__ void drop_p(Frags& P) const {
        const auto tile = s.dropout().tile(keeps);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const auto keep = tile.template bits<16 * MT - 7>(8 * nt + 2 * quad_col + x, warp_row + quad_row);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) P[mt][nt][2 * h + x] *= keep[16 * mt + 8 * h] ? Acc(1) : Acc(0);
            }
    }

    // Query tile `tile`'s Q_i, dO_i and row terms into stage `stage`, one cp.async group (hop: for the chunk
    // loaders; a steady tile is theirs without asking).
    template <bool IsSteady>
    __device__ __forceinline__ void load(int tile, int stage, int hop, mma::Steady<IsSteady>) {
        const long long i0 = ops.queries.begin + (long long)tile * Br;
        const int rows = IsSteady ? Br : (int)min_ll(Br, ops.queries.end - i0);
        if (IsSteady || order.chunked(tile)) {
            Q_load.next(hop);
            dO_load.next(hop);
        } else {
            load_rows_async<T, Br, D, Smem::LDD, Threads>(s.Q + stage * Br * Smem::LDD,
                                                         ops.source(p.q, kQ, p.d, p.flags, kVectorQ), i0, rows);
            load_rows_async<T, Br, E, Smem::LDE, Threads>(s.dO + stage * Br * Smem::LDE,
                                                         ops.source(p.dout, kDout, p.e, p.flags, kVectorDout), i0,
                                                         rows);
        }
        load_row_terms<Br, Threads, true>(s.terms + stage * Br, terms_b, i0, rows);
        ptx::cp_async_commit();
    }

    // S^T = K_j Q_i^T into P and dP^T = V_j dO_i^T into dS (K_j, V_j as A fragments; Q_i, dO_i as the column-major
    // B operand): the steps after them turn each into P^T and dS^T in place.
    __device__ __forceinline__ void products(Frags& P, Frags& dS, const T* Q_i, const T* dO_i) const {
        Products::template nk<MT, Br, D, Smem::LDD, Smem::LDD>(P, s.K, Q_i, warp_row, lane, kLoBytes);
        Products::template nk<MT, Br, E, Smem::LDE, Smem::LDE>(dS, s.V, dO_i, warp_row, lane, kLoBytes);
    }

    // P^T and dS^T of a plain tile: every pair visible, one FMA and one exp2 each (plain_gradient).
    __device__ __forceinline__ void plain_gradients(Frags& P, Frags& dS, const RowTerm<Acc>* terms_i) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const RowTerm<Acc> t = terms_i[8 * nt + 2 * quad_col + x];
                        Acc& p_ij = P[mt][nt][2 * h + x];
                        Acc& ds = dS[mt][nt][2 * h + x];
                        mma::plain_gradient(p_ij, ds, t.shift, t.delta, p.scale_log2, p_ij, ds);
                    }
    }

    // P^T and dS^T of the other tiles, pair by pair through the score step (score_gradient); a hidden pair's bit
    // goes to hidden[mt][h] (bit 2 nt + x), for the CUDA-core products.
    __device__ __forceinline__ void gradients(Frags& P, Frags& dS, unsigned (&hidden)[MT][2],
                                              const RowTerm<Acc>* terms_i, const Scores<Acc>& scores, long long i0,
                                              bool partial) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                hidden[mt][h] = 0;
                const int r = warp_row + 16 * mt + quad_row + 8 * h;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int ii = 8 * nt + 2 * quad_col + x;
                        Acc& p_ij = P[mt][nt][2 * h + x];
                        Acc& ds = dS[mt][nt][2 * h + x];
                        if (!score_gradient(false, p_ij, ds, terms_i[ii], scores, i0 + ii, j0 + r, r, keys, partial,
                                            p_ij, ds))
                            hidden[mt][h] |= 1u << (2 * nt + x);
                    }
            }
    }

    // dV_j += P^T dO_i and dK_j += dS^T Q_i on tensor cores: P^T and dS^T rounded to T in registers as the A
    // operand (FlashAttention-2's register reuse), dO_i and Q_i through ldmatrix.trans.
    __device__ __forceinline__ void add_dv_dk(const Frags& P, const Frags& dS, const T* Q_i, const T* dO_i) {
        Products::template kn<MT, Br, ES, Smem::LDE>(dV, P, dO_i + e0, lane, kLoBytes);
        Products::template kn<MT, Br, DS, Smem::LDD>(dK, dS, Q_i + d0, lane, kLoBytes);
    }

    // float: the swept tiles of `stage` (Q_i, dO_i) split (3xTF32) or rounded (one pass) to TF32 once for every warp,
    // as the forward's K_j and V_j (FwdMath::prepare); the 16-bit types and double take them as loaded.
    __device__ __forceinline__ void prepare(int stage) const {
        if constexpr (sizeof(T) == 4) {
            using Math = mma::FwdMath<T, Passes>;
            Math::template prepare<Br, D, Smem::LDD, Threads>(s.Q + stage * Br * Smem::LDD, kLoBytes);
            Math::template prepare<Br, E, Smem::LDE, Threads>(s.dO + stage * Br * Smem::LDE, kLoBytes);
            __syncthreads();
        }
    }

    // A steady visit (a plain tile): S^T and dP^T, P^T and dS^T, dV_j and dK_j.
    __device__ __forceinline__ void visit(int, int stage, mma::Steady<true>, bool) {
        prepare(stage);
        const T* const Q_i = s.Q + stage * Br * Smem::LDD;
        const T* const dO_i = s.dO + stage * Br * Smem::LDE;
        Frags P, dS;
        products(P, dS, Q_i, dO_i);
        if constexpr (kDropout) drop_dp(dS);
        plain_gradients(P, dS, s.terms + stage * Br);
        if constexpr (kDropout) drop_p(P);
        add_dv_dk(P, dS, Q_i, dO_i);
    }

    // Another visit (window edges, masks, biases, a short last tile): S^T and dP^T, P^T and dS^T through the score
    // step, then dV_j and dK_j; where a pair is hidden and its query row of Q_i or dO_i holds inf or NaN (0 times it
    // would be NaN on tensor cores), on CUDA cores with the hidden pairs skipped.
    __device__ __forceinline__ void visit(int tile, int stage, mma::Steady<false>, bool whole) {
        prepare(stage);
        const T* const Q_i = s.Q + stage * Br * Smem::LDD;
        const T* const dO_i = s.dO + stage * Br * Smem::LDE;
        Frags P, dS;
        products(P, dS, Q_i, dO_i);
        const long long i0 = ops.queries.begin + (long long)tile * Br;
        const int rows = (int)min_ll(Br, ops.queries.end - i0);
        // Rows past the swept tile (ii >= rows) count as rows past n: hidden, whatever the tile.
        const Scores<Acc> scores = Scores<Acc>::of(ops, p, i0 + rows, whole);
        const bool partial = scores.partial(i0, rows, j0, keys, Bc);
        unsigned hidden[MT][2];
        if constexpr (kDropout) drop_dp(dS);
        gradients(P, dS, hidden, s.terms + stage * Br, scores, i0, partial);
        if constexpr (kDropout) drop_p(P);
        const bool careful =
            partial && __syncthreads_or(mma::tile_nonfinite<T, Br, D, Threads, Smem::LDD>(Q_i, rows) ||
                                        mma::tile_nonfinite<T, Br, E, Threads, Smem::LDE>(dO_i, rows));
        if (!careful) {
            add_dv_dk(P, dS, Q_i, dO_i);
        } else {
            mma::acc_by_selection<T, Br, ES, MT, Smem::LDE, kLoBytes>(dV, P, hidden, s.W, s.H, dO_i + e0, rows,
                                                                       lane);
            mma::acc_by_selection<T, Br, DS, MT, Smem::LDD, kLoBytes>(dK, dS, hidden, s.W, s.H, Q_i + d0, rows,
                                                                       lane);
        }
    }

    // dk = scale dK_j (the sweep leaves the softmax scale out of dS), dv = dV_j, from the fragments.
    __device__ __forceinline__ void store() const {
        ptx::cp_async_wait<0>();  // no query sees these keys: K_j and V_j were never waited for
        mma::store_fragments<MT, DS>(ops.row_of(p.dk, kDk, j0) + d0 * ops.strides(kDk).col, dK, p.scale,
                                     ops.strides(kDk).row, ops.strides(kDk).col, warp_row, keys, p.d - d0, lane);
        mma::store_fragments<MT, ES>(ops.row_of(p.dv, kDv, j0) + e0 * ops.strides(kDv).col, dV,
                                     kDropout ? Acc(p.dropout.scale) : Acc(1), ops.strides(kDv).row,
                                     ops.strides(kDv).col, warp_row, keys, p.e - e0, lane);
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages = 1, int Passes = 3>
__global__ void __launch_bounds__(Warps * 32, 1) bwd_mma_dkdv(const Params<T> p) {
    using Block = MmaDkdvBlock<T, Br, Bc, D, E, Warps, Stages, Passes>;
    extern __shared__ __align__(16) unsigned char smem[];
    const mma::Place at;
    const typename Block::Tiles s(smem, at.warp);
    if (!in_batch(p)) return;
    const Sweep& sweep = shared_sweep(smem + Block::Smem::sweep_offset, [&] { return Block::sweep_of(p); });
    typename Block::QLoader Q_load;
    typename Block::OLoader dO_load;
    typename Block::DGrad dK;
    typename Block::EGrad dV;
    Block block(p, sweep, s, at, Q_load, dO_load, dK, dV);
    block.start();
    mma::sweep<Stages>(sweep.order, block);
    block.store();
}

// One block of bwd_mma_dq, its steps in the order they run (bwd_mma_dq below): the block's view and sweep; Q_i,
// dO_i and their row terms in flight; per key tile (mma::sweep) its K_j and V_j, S = Q_i K_j^T and dP = dO_i V_j^T,
// P and dS from the row terms (and dbias), dQ_i += dS K_j; the store of dQ_i. Its own rows are queries, split among
// the warps. As in MmaDkdvBlock, the chunk loaders and dQ_i are the kernel function's locals.
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, int Passes>
struct MmaDqBlock {
    // Its static_asserts: the tile shapes.
    using Smem = MmaBackwardShared<T, Br, Bc, D, E, Warps, false, Stages, mma_backward::kLowParts<T, Passes>>;
    using Tiles = MmaBackwardTiles<T, Smem>;
    using Acc = typename Smem::Acc;
    using Products = mma::Products<T, Passes>;
    static constexpr int kLoBytes = Smem::lo_bytes;  // from a swept tile's element to its low part (3xTF32)
    static constexpr int Threads = Warps * 32, MT = Smem::MT, NT = Bc / 8, DT = D / 8;
    using KLoader = mma::ChunkLoader<T, Bc, D, Threads, Smem::LDD>;
    using VLoader = mma::ChunkLoader<T, Bc, E, Threads, Smem::LDE>;
    using Frags = Acc[MT][NT][4];  // S, dP, P or dS of the warp's queries
    using Grad = Acc[MT][DT][4];

    // The block's view of the launch and its sweep. The plain key tiles: plain_tiles (full, seen by every query of
    // the block, no mask or bias). Whole key tiles of 16-byte rows from the first plain one on come through each
    // thread's chunk loaders, the others (a short last tile, those before the first plain one, strided views)
    // through the general copy.
    __device__ __forceinline__ static Sweep sweep_of(const Params<T>& p) {
        const BlockOperands ops = query_block<Br, Bc, false>(p);
        const bool chunk_loads = mma::chunk_loads<KLoader, VLoader>(ops.source(p.k, kK, p.d, p.flags, kVectorK),
                                                                    ops.source(p.v, kV, p.e, p.flags, kVectorV));
        const TileRange plain = plain_tiles<Br, Bc, false>(ops, p.left, p.right, true);
        return Sweep{ops, SweepOrder::of(ops.keys, Bc, plain, chunk_loads, Stages,
                                          visited<Bc>(p, ops.queries.begin / Br, ops.keys))};
    }

    const Params<T>& p;
    const Tiles s;  // K_j and V_j: stage 0's
    const BlockOperands& ops;
    const SweepOrder& order;
    const long long& i0;
    const int rows, warp_row, lane, quad_row, quad_col;  // warp_row: this warp's first query row within the tile
    KLoader& K_load;
    VLoader& V_load;
    Grad& dQ;
    int keeps = 0;  // with dropout: the keep tile of the visit (its buffer)

    __device__ __forceinline__ MmaDqBlock(const Params<T>& params, const Sweep& sweep, const Tiles& tiles,
                                          const mma::Place& at, KLoader& k_load, VLoader& v_load, Grad& dq)
        : p(params), s(tiles), ops(sweep.ops), order(sweep.order), i0(ops.queries.begin), rows(ops.queries.size()),
          warp_row(at.warp * 16 * MT), lane(at.lane), quad_row(at.quad_row), quad_col(at.quad_col), K_load(k_load),
          V_load(v_load), dQ(dq) {}

    // Q_i, dO_i and their row terms stay for the whole sweep: their copies go out first (they land by the first
    // visit's wait). Then the chunk loaders start at the first plain key tile, and dQ_i at 0.
    __device__ __forceinline__ void start() {
        load_rows_async<T, Br, D, Smem::LDD, Threads>(s.Q, ops.source(p.q, kQ, p.d, p.flags, kVectorQ), i0, rows);
        load_rows_async<T, Br, E, Smem::LDE, Threads>(s.dO, ops.source(p.dout, kDout, p.e, p.flags, kVectorDout), i0,
                                                     rows);
        load_row_terms<Br, Threads, true>(s.terms, row_terms_of(p.terms, ops.base), i0, rows);
        ptx::cp_async_commit();
        const long long chunks_from = ops.keys.begin + (long long)order.plain.lo * Bc;
        K_load = KLoader(ops.row_of(p.k, kK, chunks_from), ops.strides(kK).row, (int)p.d, s.K);
        V_load = VLoader(ops.row_of(p.v, kV, chunks_from), ops.strides(kV).row, (int)p.e, s.V);
        mma::zero(dQ);
        if constexpr (kDropout) s.dropout().start(p);
    }

    // The first key of visit v's tile.
    __device__ __forceinline__ long long key_start(int v) const {
        return ops.keys.begin + (long long)order.at(v) * Bc;
    }
    // Dropout: visit t's keep bits into buffer t % 2, the first before any visit's barrier, the others after the
    // barrier of the visit before (every warp is done with the buffer).
    __device__ __forceinline__ void keep_bits(int t) { s.dropout().template fill<Threads>(t & 1, i0, key_start(t)); }
    __device__ __forceinline__ void keep_ahead(int t) {
        keeps = t & 1;
        if (t + 1 < order.tiles) keep_bits(t + 1);
    }
    // Dropout: dP times Z before the gradients (dQ takes only dS); a thread's keys: columns 2 quad_col + {0, 1} of
    // each n8 tile of its rows of the keep tile.
    __device__ __forceinline__ void drop_dp(Frags& dP) const {
        const auto tile = s.dropout().tile(keeps);
        const Acc scale = Acc(p.dropout.scale);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const auto keep = tile.template bits<8 * NT - 6>(warp_row + 16 * mt + quad_row + 8 * h, 2 * quad_col);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) dP[mt][nt][2 * h + x] *= mma::dropout_z(keep[8 * nt + x], scale);
            }
    }

    // Key tile `tile`'s K_j and V_j into stage `stage`, one cp.async group (hop: for the chunk loaders; a steady
    // tile is theirs without asking).
    template <bool IsSteady>
    __device__ __forceinline__ void load(int tile, int stage, int hop, mma::Steady<IsSteady>) {
        if (IsSteady || order.chunked(tile)) {
            K_load.next(hop);
            V_load.next(hop);
        } else {
            const long long j0 = ops.keys.begin + (long long)tile * Bc;
            const int cols = (int)min_ll(Bc, ops.keys.end - j0);
            load_rows_async<T, Bc, D, Smem::LDD, Threads>(s.K + stage * Bc * Smem::LDD,
                                                         ops.source(p.k, kK, p.d, p.flags, kVectorK), j0, cols);
            load_rows_async<T, Bc, E, Smem::LDE, Threads>(s.V + stage * Bc * Smem::LDE,
                                                         ops.source(p.v, kV, p.e, p.flags, kVectorV), j0, cols);
        }
        ptx::cp_async_commit();
    }

    // S = Q_i K_j^T into P and dP = dO_i V_j^T into dS (Q_i, dO_i as A fragments; K_j, V_j as the column-major B
    // operand): the steps after them turn each into P and dS in place.
    __device__ __forceinline__ void products(Frags& P, Frags& dS, const T* K_j, const T* V_j) const {
        Products::template nk<MT, Bc, D, Smem::LDD, Smem::LDD>(P, s.Q, K_j, warp_row, lane, kLoBytes);
        Products::template nk<MT, Bc, E, Smem::LDE, Smem::LDE>(dS, s.dO, V_j, warp_row, lane, kLoBytes);
    }

    // P and dS of a plain tile: every pair visible, no dbias to write, one FMA and one exp2 each (plain_gradient).
    __device__ __forceinline__ void plain_gradients(Frags& P, Frags& dS) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const RowTerm<Acc> t = s.terms[warp_row + 16 * mt + quad_row + 8 * h];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        Acc& p_ij = P[mt][nt][2 * h + x];
                        Acc& ds = dS[mt][nt][2 * h + x];
                        mma::plain_gradient(p_ij, ds, t.shift, t.delta, p.scale_log2, p_ij, ds);
                    }
            }
    }

    // P and dS of the other tiles, pair by pair through the score step (score_gradient), and dbias = dS where asked;
    // a hidden pair's bit goes to hidden[mt][h] (bit 2 nt + x), for the CUDA-core product.
    __device__ __forceinline__ void gradients(Frags& P, Frags& dS, unsigned (&hidden)[MT][2],
                                              const Scores<Acc>& scores, long long j0, int cols,
                                              bool partial) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                hidden[mt][h] = 0;
                const int r = warp_row + 16 * mt + quad_row + 8 * h;
                const long long i = i0 + r;
                const RowTerm<Acc> t = s.terms[r];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int jj = 8 * nt + 2 * quad_col + x;
                        Acc& p_ij = P[mt][nt][2 * h + x];
                        Acc& ds = dS[mt][nt][2 * h + x];
                        if (!score_gradient(false, p_ij, ds, t, scores, i, j0 + jj, jj, cols, partial, p_ij, ds))
                            hidden[mt][h] |= 1u << (2 * nt + x);
                        if ((p.flags & kWantDbias) && r < rows && jj < cols)
                            ops.row_of(p.dbias, kDbias, i)[(j0 + jj) * ops.strides(kDbias).col] = ds;
                    }
            }
    }

    // dQ_i += dS K_j on tensor cores: dS rounded to T in registers as the A operand, K_j through ldmatrix.trans.
    __device__ __forceinline__ void add_dq(const Frags& dS, const T* K_j) {
        Products::template kn<MT, Bc, D, Smem::LDD>(dQ, dS, K_j, lane, kLoBytes);
    }

    // float: the swept tiles of `stage` (K_j, V_j) split (3xTF32) or rounded (one pass) to TF32 once for every warp,
    // as the forward's (FwdMath::prepare); the 16-bit types and double take them as loaded.
    __device__ __forceinline__ void prepare(int stage) const {
        if constexpr (sizeof(T) == 4) {
            using Math = mma::FwdMath<T, Passes>;
            Math::template prepare<Bc, D, Smem::LDD, Threads>(s.K + stage * Bc * Smem::LDD, kLoBytes);
            Math::template prepare<Bc, E, Smem::LDE, Threads>(s.V + stage * Bc * Smem::LDE, kLoBytes);
            __syncthreads();
        }
    }

    // A steady visit (a plain tile): S and dP, P and dS, dQ_i.
    __device__ __forceinline__ void visit(int, int stage, mma::Steady<true>, bool) {
        prepare(stage);
        const T* const K_j = s.K + stage * Bc * Smem::LDD;
        const T* const V_j = s.V + stage * Bc * Smem::LDE;
        Frags P, dS;
        products(P, dS, K_j, V_j);
        if constexpr (kDropout) drop_dp(dS);
        plain_gradients(P, dS);
        add_dq(dS, K_j);
    }

    // Another visit (window edges, masks, biases, a short last tile): S and dP, P and dS through the score step,
    // then dQ_i; where a pair is hidden and its key row of K_j holds inf or NaN (0 times it would be NaN on tensor
    // cores), on CUDA cores with the hidden pairs skipped.
    __device__ __forceinline__ void visit(int tile, int stage, mma::Steady<false>, bool whole) {
        prepare(stage);
        const T* const K_j = s.K + stage * Bc * Smem::LDD;
        const T* const V_j = s.V + stage * Bc * Smem::LDE;
        Frags P, dS;
        products(P, dS, K_j, V_j);
        const long long j0 = ops.keys.begin + (long long)tile * Bc;
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        const Scores<Acc> scores = Scores<Acc>::of(ops, p, ops.queries.end, whole);
        const bool partial = scores.partial(i0, rows, j0, cols, Bc);
        unsigned hidden[MT][2];
        if constexpr (kDropout) drop_dp(dS);
        gradients(P, dS, hidden, scores, j0, cols, partial);
        const bool careful = partial && __syncthreads_or(mma::tile_nonfinite<T, Bc, D, Threads, Smem::LDD>(K_j, cols));
        if (!careful)
            add_dq(dS, K_j);
        else
            mma::acc_by_selection<T, Bc, D, MT, Smem::LDD, kLoBytes>(dQ, dS, hidden, s.W, s.H, K_j, cols, lane);
    }

    // dq = scale dQ_i (the sweep leaves the softmax scale out of dS), from the fragments.
    __device__ __forceinline__ void store() const {
        ptx::cp_async_wait<0>();  // no key is visible: Q_i and dO_i were never waited for
        mma::store_fragments<MT, D>(ops.row_of(p.dq, kDq, i0), dQ, p.scale, ops.strides(kDq).row,
                                    ops.strides(kDq).col, warp_row, rows, p.d, lane);
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages = 1, int Passes = 3>
__global__ void __launch_bounds__(Warps * 32, 1) bwd_mma_dq(const Params<T> p) {
    using Block = MmaDqBlock<T, Br, Bc, D, E, Warps, Stages, Passes>;
    extern __shared__ __align__(16) unsigned char smem[];
    const mma::Place at;
    const typename Block::Tiles s(smem, at.warp);
    if (!in_batch(p)) return;
    const Sweep& sweep = shared_sweep(smem + Block::Smem::sweep_offset, [&] { return Block::sweep_of(p); });
    typename Block::KLoader K_load;
    typename Block::VLoader V_load;
    typename Block::Grad dQ;
    Block block(p, sweep, s, at, K_load, V_load, dQ);
    block.start();
    mma::sweep<Stages>(sweep.order, block);
    block.store();
}

}  // namespace cuflash
