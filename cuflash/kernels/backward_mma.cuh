// The backward pass on tensor cores for __half and __nv_bfloat16 on sm_80 and newer: backward.cuh's two kernels
// (the same arguments, the same split of the work, no atomics) with their tile products on mma.m16n8k16.
//
//   bwd_mma_dkdv: one block per Bc keys; its warps split the keys, MT m16 tiles each. Per query tile:
//                 S^T = K_j Q_i^T and dP^T = V_j dO_i^T (K_j, V_j as A fragments; Q_i, dO_i as the column-major B
//                 operand), P^T and dS^T elementwise on the accumulator fragments, then dV_j += P^T dO_i and
//                 dK_j += dS^T Q_i with P^T, dS^T rounded to T in registers as the A operand (FlashAttention-2's
//                 register reuse) and dO_i, Q_i through ldmatrix.trans.
//   bwd_mma_dq:   one block per Br queries; its warps split the queries. Per key tile: S = Q_i K_j^T,
//                 dP = dO_i V_j^T, P and dS elementwise (dbias written when asked), dQ_i += dS K_j.
//
// Gradients accumulate in float fragments and go to the float gradient arrays straight from them. Loads are
// cp.async (element loads for strided views); with two stages the next swept tile's copies (and, in bwd_mma_dkdv,
// its row terms) go into the other stage while one is computed, one barrier a tile. As in the forward, the plain
// swept tiles (whole, every pair of the block's rows and the tile's visible, no mask or bias) come first
// (SweepOrder), in a loop compiled apart from the other tiles' (window edges, masks, biases, a short last tile):
// P and dS of one FMA and one exp2 each, no visibility, no checks, each thread's copies from its chunk loaders.
// A hidden pair's P and dS are 0 by selection; a 0 times an inf or NaN in a row some pair hides
// (a key of K_j; a query row of Q_i or dO_i) would still be NaN on tensor cores, so tiles that hide pairs look
// for non-finite values first and, only then, take the product on CUDA cores with hidden pairs skipped
// (mma::acc_by_selection).
//
// Template: T element type; Br queries and Bc keys per tile (the block's own axis is 16 x MT x Warps); D, E
// head-dim buckets (multiples of 32 up to 128; run-time d, e, tails zero-filled); Warps per block; Stages of the
// swept tiles (1 or 2).
#pragma once

#include "backward.cuh"
#include "mma_tile.cuh"

namespace cuflash {

// Limits of the layout, held to cuflash/kernels/backward_mma.py's by tests/test_layout.py.
namespace mma_backward {
constexpr int kMaxSwept = 128;    // a swept tile's hidden-pair bits fit one 32-bit word per quad lane
constexpr int kMaxHeadDim = 128;  // D and E: the gradients stay whole in registers
}  // namespace mma_backward

// Shared memory of one block (cuflash/kernels/backward_mma.py mirrors it): Q_i and dO_i, K_j and V_j (padded rows), the
// query tile's row terms (RowTerm), and each warp's scratch for the rare CUDA-core product (16 rows of the swept
// tile's width + 1 floats, and 16 x 4 words of hidden bits), and last the block's Sweep. KeysOwn: bwd_mma_dkdv's
// layout. Stages: buffers of the swept tiles (bwd_mma_dq's K_j and V_j; bwd_mma_dkdv's Q_i, dO_i and their row
// terms).
template <typename T, int Br, int Bc, int D, int E, int Warps, bool KeysOwn, int Stages = 1>
struct MmaBackwardShared {
    static constexpr int Own = KeysOwn ? Bc : Br, Swept = KeysOwn ? Br : Bc, MT = Own / (16 * Warps);
    static_assert(MT >= 1 && Own == 16 * MT * Warps, "the block's own rows are 16 x Warps x (m16 tiles per warp)");
    static_assert(Swept % 16 == 0 && Swept <= mma_backward::kMaxSwept, "the swept tile is a multiple of 16 up to 128");
    static_assert(D % 32 == 0 && E % 32 == 0 && D <= mma_backward::kMaxHeadDim && E <= mma_backward::kMaxHeadDim,
                  "head-dim buckets are multiples of 32");
    static constexpr int LDD = mma::Padded<D>::ld, LDE = mma::Padded<E>::ld, LDW = Swept + 1;
    static constexpr int QStages = KeysOwn ? Stages : 1, KStages = KeysOwn ? 1 : Stages;
    static constexpr size_t q_offset = 0;
    static constexpr size_t do_offset = q_offset + QStages * align16(sizeof(T) * Br * LDD);
    static constexpr size_t k_offset = do_offset + QStages * align16(sizeof(T) * Br * LDE);
    static constexpr size_t v_offset = k_offset + KStages * align16(sizeof(T) * Bc * LDD);
    static constexpr size_t rows_offset = v_offset + KStages * align16(sizeof(T) * Bc * LDE);
    static constexpr size_t w_offset = rows_offset + QStages * align16(sizeof(float) * 2 * Br);
    static constexpr size_t h_offset = w_offset + align16(sizeof(float) * Warps * 16 * LDW);
    static constexpr size_t sweep_offset = h_offset + align16(sizeof(unsigned) * Warps * 16 * 4);
    static constexpr size_t drop_offset = sweep_offset + align16(sizeof(Sweep));
    using Dropout = BlockDropout<Br, Bc, 2>;  // kernels compiled with CUFLASH_DROPOUT: two keep tiles
    static constexpr size_t bytes = drop_offset + (kDropout ? Dropout::bytes : 0);
};

// The shared tiles of one block by name, and this warp's scratch (W: 16 rows of the swept width + 1 floats, H: 16 x 4
// words of hidden bits); with dropout, the keep tiles (dropout(): visit t's in buffer t % 2).
template <typename T, typename Smem> struct MmaBackwardTiles {
    T *Q, *dO, *K, *V;
    RowTerm<float>* terms;
    float* W;
    unsigned* H;
    __device__ __forceinline__ MmaBackwardTiles(unsigned char* smem, int warp)
        : Q(reinterpret_cast<T*>(smem + Smem::q_offset)), dO(reinterpret_cast<T*>(smem + Smem::do_offset)),
          K(reinterpret_cast<T*>(smem + Smem::k_offset)), V(reinterpret_cast<T*>(smem + Smem::v_offset)),
          terms(reinterpret_cast<RowTerm<float>*>(smem + Smem::rows_offset)),
          W(reinterpret_cast<float*>(smem + Smem::w_offset) + warp * 16 * Smem::LDW),
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

// rows x width of scale * C (a warp's fragments; rows row0 + 16 mt + quad_row + 8 h) to float dst.
template <int MT, int N>
__device__ __forceinline__ void store_fragments(float* dst, const float (&C)[MT][N / 8][4], float scale,
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
__device__ __forceinline__ float dropout_z(bool kept, float scale) { return kept ? scale : 0.0f; }

// P and dS of one pair of a plain tile (full, fully visible, no mask or bias): P = exp2 of one FMA, the scale
// folded in, on the MUFU unit (flush-to-zero: a P below 2^-126 of the row's maximum is negligible).
__device__ __forceinline__ void plain_gradient(float S, float dP, float shift, float delta_i, float scale_log2,
                                               float& p, float& ds) {
    p = ptx::ex2_approx_ftz(fmaf(S, scale_log2, -shift));
    ds = p * (dP - delta_i);
}

// A thread's place in its block: its warp, its lane, and the lane's row and column in its quad (the fragments').
struct Place {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_row = lane / 4, quad_col = lane % 4;
};

template <int R, int C> __device__ __forceinline__ void zero(float (&x)[R][C][4]) {
#pragma unroll
    for (int a = 0; a < R; ++a)
#pragma unroll
        for (int c = 0; c < C; ++c)
#pragma unroll
            for (int y = 0; y < 4; ++y) x[a][c][y] = 0.0f;
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
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages>
struct MmaDkdvBlock {
    using Smem = MmaBackwardShared<T, Br, Bc, D, E, Warps, true, Stages>;  // its static_asserts: the tile shapes
    using Tiles = MmaBackwardTiles<T, Smem>;
    static constexpr int Threads = Warps * 32, MT = Smem::MT, NT = Br / 8, DT = D / 8, ET = E / 8;
    using QLoader = mma::ChunkLoader<T, Br, D, Threads>;
    using OLoader = mma::ChunkLoader<T, Br, E, Threads>;
    using Frags = float[MT][NT][4];  // S^T, dP^T, P^T or dS^T of the warp's keys: keys by row, queries by column
    using DGrad = float[MT][DT][4];
    using EGrad = float[MT][ET][4];

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
    const RowTerm<float>* const terms_b;           // the batch item's row terms
    const int warp_row, lane, quad_row, quad_col;  // warp_row: this warp's first key row within the tile
    QLoader& Q_load;
    OLoader& dO_load;
    DGrad& dK;
    EGrad& dV;
    int keeps = 0;  // with dropout: the keep tile of the visit (its buffer)

    __device__ __forceinline__ MmaDkdvBlock(const Params<T>& params, const Sweep& sweep, const Tiles& tiles,
                                            const mma::Place& at, QLoader& q_load, OLoader& do_load, DGrad& dk,
                                            EGrad& dv)
        : p(params), s(tiles), ops(sweep.ops), order(sweep.order), j0(ops.keys.begin), keys(ops.keys.size()),
          terms_b(row_terms_of(p.terms, ops.base)), warp_row(at.warp * 16 * MT), lane(at.lane),
          quad_row(at.quad_row), quad_col(at.quad_col), Q_load(q_load), dO_load(do_load), dK(dk), dV(dv) {}

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
        const float scale = (float)p.dropout.scale;
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
                    for (int h = 0; h < 2; ++h) P[mt][nt][2 * h + x] *= keep[16 * mt + 8 * h] ? 1.0f : 0.0f;
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
        mma::product_nk<T, MT, Br, D>(P, s.K, Q_i, warp_row, lane);
        mma::product_nk<T, MT, Br, E>(dS, s.V, dO_i, warp_row, lane);
    }

    // P^T and dS^T of a plain tile: every pair visible, one FMA and one exp2 each (plain_gradient).
    __device__ __forceinline__ void plain_gradients(Frags& P, Frags& dS, const RowTerm<float>* terms_i) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const RowTerm<float> t = terms_i[8 * nt + 2 * quad_col + x];
                        float& p_ij = P[mt][nt][2 * h + x];
                        float& ds = dS[mt][nt][2 * h + x];
                        mma::plain_gradient(p_ij, ds, t.shift, t.delta, p.scale_log2, p_ij, ds);
                    }
    }

    // P^T and dS^T of the other tiles, pair by pair through the score step (score_gradient); a hidden pair's bit
    // goes to hidden[mt][h] (bit 2 nt + x), for the CUDA-core products.
    __device__ __forceinline__ void gradients(Frags& P, Frags& dS, unsigned (&hidden)[MT][2],
                                              const RowTerm<float>* terms_i, const Scores<float>& scores, long long i0,
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
                        float& p_ij = P[mt][nt][2 * h + x];
                        float& ds = dS[mt][nt][2 * h + x];
                        if (!score_gradient(false, p_ij, ds, terms_i[ii], scores, i0 + ii, j0 + r, r, keys, partial,
                                            p_ij, ds))
                            hidden[mt][h] |= 1u << (2 * nt + x);
                    }
            }
    }

    // dV_j += P^T dO_i and dK_j += dS^T Q_i on tensor cores: P^T and dS^T rounded to T in registers as the A
    // operand (FlashAttention-2's register reuse), dO_i and Q_i through ldmatrix.trans.
    __device__ __forceinline__ void add_dv_dk(const Frags& P, const Frags& dS, const T* Q_i, const T* dO_i) {
        mma::product_kn<T, MT, Br, E>(dV, P, dO_i, lane);
        mma::product_kn<T, MT, Br, D>(dK, dS, Q_i, lane);
    }

    // A steady visit (a plain tile): S^T and dP^T, P^T and dS^T, dV_j and dK_j.
    __device__ __forceinline__ void visit(int, int stage, mma::Steady<true>, bool) {
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
        const T* const Q_i = s.Q + stage * Br * Smem::LDD;
        const T* const dO_i = s.dO + stage * Br * Smem::LDE;
        Frags P, dS;
        products(P, dS, Q_i, dO_i);
        const long long i0 = ops.queries.begin + (long long)tile * Br;
        const int rows = (int)min_ll(Br, ops.queries.end - i0);
        // Rows past the swept tile (ii >= rows) count as rows past n: hidden, whatever the tile.
        const Scores<float> scores = Scores<float>::of(ops, p, i0 + rows, whole);
        const bool partial = scores.partial(i0, rows, j0, keys, Bc);
        unsigned hidden[MT][2];
        if constexpr (kDropout) drop_dp(dS);
        gradients(P, dS, hidden, s.terms + stage * Br, scores, i0, partial);
        if constexpr (kDropout) drop_p(P);
        const bool careful = partial && __syncthreads_or(mma::tile_nonfinite<T, Br, D, Threads>(Q_i, rows) ||
                                                         mma::tile_nonfinite<T, Br, E, Threads>(dO_i, rows));
        if (!careful) {
            add_dv_dk(P, dS, Q_i, dO_i);
        } else {
            mma::acc_by_selection<T, Br, E, MT>(dV, P, hidden, s.W, s.H, dO_i, rows, lane);
            mma::acc_by_selection<T, Br, D, MT>(dK, dS, hidden, s.W, s.H, Q_i, rows, lane);
        }
    }

    // dk = scale dK_j (the sweep leaves the softmax scale out of dS), dv = dV_j, from the fragments.
    __device__ __forceinline__ void store() const {
        ptx::cp_async_wait<0>();  // no query sees these keys: K_j and V_j were never waited for
        mma::store_fragments<MT, D>(ops.row_of(p.dk, kDk, j0), dK, p.scale, ops.strides(kDk).row,
                                    ops.strides(kDk).col, warp_row, keys, p.d, lane);
        mma::store_fragments<MT, E>(ops.row_of(p.dv, kDv, j0), dV, kDropout ? (float)p.dropout.scale : 1.0f,
                                    ops.strides(kDv).row, ops.strides(kDv).col, warp_row, keys, p.e, lane);
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages = 1>
__global__ void __launch_bounds__(Warps * 32, 1) bwd_mma_dkdv(const Params<T> p) {
    using Block = MmaDkdvBlock<T, Br, Bc, D, E, Warps, Stages>;
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
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages>
struct MmaDqBlock {
    using Smem = MmaBackwardShared<T, Br, Bc, D, E, Warps, false, Stages>;  // its static_asserts: the tile shapes
    using Tiles = MmaBackwardTiles<T, Smem>;
    static constexpr int Threads = Warps * 32, MT = Smem::MT, NT = Bc / 8, DT = D / 8;
    using KLoader = mma::ChunkLoader<T, Bc, D, Threads>;
    using VLoader = mma::ChunkLoader<T, Bc, E, Threads>;
    using Frags = float[MT][NT][4];  // S, dP, P or dS of the warp's queries
    using Grad = float[MT][DT][4];

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
        const float scale = (float)p.dropout.scale;
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
        mma::product_nk<T, MT, Bc, D>(P, s.Q, K_j, warp_row, lane);
        mma::product_nk<T, MT, Bc, E>(dS, s.dO, V_j, warp_row, lane);
    }

    // P and dS of a plain tile: every pair visible, no dbias to write, one FMA and one exp2 each (plain_gradient).
    __device__ __forceinline__ void plain_gradients(Frags& P, Frags& dS) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const RowTerm<float> t = s.terms[warp_row + 16 * mt + quad_row + 8 * h];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        float& p_ij = P[mt][nt][2 * h + x];
                        float& ds = dS[mt][nt][2 * h + x];
                        mma::plain_gradient(p_ij, ds, t.shift, t.delta, p.scale_log2, p_ij, ds);
                    }
            }
    }

    // P and dS of the other tiles, pair by pair through the score step (score_gradient), and dbias = dS where asked;
    // a hidden pair's bit goes to hidden[mt][h] (bit 2 nt + x), for the CUDA-core product.
    __device__ __forceinline__ void gradients(Frags& P, Frags& dS, unsigned (&hidden)[MT][2],
                                              const Scores<float>& scores, long long j0, int cols,
                                              bool partial) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                hidden[mt][h] = 0;
                const int r = warp_row + 16 * mt + quad_row + 8 * h;
                const long long i = i0 + r;
                const RowTerm<float> t = s.terms[r];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int jj = 8 * nt + 2 * quad_col + x;
                        float& p_ij = P[mt][nt][2 * h + x];
                        float& ds = dS[mt][nt][2 * h + x];
                        if (!score_gradient(false, p_ij, ds, t, scores, i, j0 + jj, jj, cols, partial, p_ij, ds))
                            hidden[mt][h] |= 1u << (2 * nt + x);
                        if ((p.flags & kWantDbias) && r < rows && jj < cols)
                            ops.row_of(p.dbias, kDbias, i)[(j0 + jj) * ops.strides(kDbias).col] = ds;
                    }
            }
    }

    // dQ_i += dS K_j on tensor cores: dS rounded to T in registers as the A operand, K_j through ldmatrix.trans.
    __device__ __forceinline__ void add_dq(const Frags& dS, const T* K_j) {
        mma::product_kn<T, MT, Bc, D>(dQ, dS, K_j, lane);
    }

    // A steady visit (a plain tile): S and dP, P and dS, dQ_i.
    __device__ __forceinline__ void visit(int, int stage, mma::Steady<true>, bool) {
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
        const T* const K_j = s.K + stage * Bc * Smem::LDD;
        const T* const V_j = s.V + stage * Bc * Smem::LDE;
        Frags P, dS;
        products(P, dS, K_j, V_j);
        const long long j0 = ops.keys.begin + (long long)tile * Bc;
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        const Scores<float> scores = Scores<float>::of(ops, p, ops.queries.end, whole);
        const bool partial = scores.partial(i0, rows, j0, cols, Bc);
        unsigned hidden[MT][2];
        if constexpr (kDropout) drop_dp(dS);
        gradients(P, dS, hidden, scores, j0, cols, partial);
        const bool careful = partial && __syncthreads_or(mma::tile_nonfinite<T, Bc, D, Threads>(K_j, cols));
        if (!careful)
            add_dq(dS, K_j);
        else
            mma::acc_by_selection<T, Bc, D, MT>(dQ, dS, hidden, s.W, s.H, K_j, cols, lane);
    }

    // dq = scale dQ_i (the sweep leaves the softmax scale out of dS), from the fragments.
    __device__ __forceinline__ void store() const {
        ptx::cp_async_wait<0>();  // no key is visible: Q_i and dO_i were never waited for
        mma::store_fragments<MT, D>(ops.row_of(p.dq, kDq, i0), dQ, p.scale, ops.strides(kDq).row,
                                    ops.strides(kDq).col, warp_row, rows, p.d, lane);
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages = 1>
__global__ void __launch_bounds__(Warps * 32, 1) bwd_mma_dq(const Params<T> p) {
    using Block = MmaDqBlock<T, Br, Bc, D, E, Warps, Stages>;
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
