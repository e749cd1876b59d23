// The forward pass on tensor cores (FlashAttention-2 style) on sm_80 and newer: __half and __nv_bfloat16 on
// mma.m16n8k16, float on mma.m16n8k8 with TF32 operands (three passes, 3xTF32, or one), double on mma.m8n8k4
// (DMMA). mma_tile.cuh's FwdMath<T, Passes> holds what differs per type: the products and their fragments.
//
// One thread block per Br query rows of one batch item; its warps split the rows, MT m16 tiles (16 * MT rows)
// each. Per key tile of Bc keys:
//   S = Q_i K_j^T     tensor-core products, accumulated in Acc (float; double for double); Q_i as A fragments
//                     (in registers for the whole sweep when they fit, else from shared memory), K_j as the
//                     column-major B operand;
//   online softmax    directly on the accumulator fragments (OnlineSoftmax over FragTiles): a row lives in the four
//                     lanes of a quad, so the row max and sum need two shuffles; scale * log2(e) is folded into one
//                     multiplier (exp2);
//   O_i += P V_j      P in registers is the A operand (rounded to T for the 16-bit types), V_j the B operand.
// K_j and V_j stream through Stages shared-memory buffers with cp.async: tile j + Stages - 1 is in flight while
// tile j is computed. The epilogue stages O_i / l_i through shared memory so global stores are coalesced.
// The steady state (full tiles that every row sees whole, without mask or bias) runs first, in a hot loop compiled
// apart from the other tiles' (window edges, masks, biases, a short last tile): no run-time flags, no visibility,
// addresses carried from tile to tile, and the rescale of O_i (when a row's max grows: rarely, after the first
// tiles) out of it. Where S and O_i take most of the registers, the other tiles take their keys in two parts
// (MmaShared::kParts), and the block's view of the launch waits in shared memory (Sweep).
//
// Semantics are the CUDA-core kernel's (forward.cuh): the same Params, visibility by selection (Scores), the same
// online softmax and its rule for rows that see nothing. A hidden key whose value row holds inf or NaN must not reach
// a row through 0 * inf: on tiles with hidden keys, a block vote looks for non-finite values in V_j, and only then
// P V_j runs on CUDA cores with hidden keys skipped per (row, key), exactly like forward.cuh.
//
// Template: T element type; Br, Bc tile sizes; D, E head-dim buckets (multiples of 32 up to 256; the actual
// d, e are run-time values, tails zero-filled); Warps per block; Stages of the K/V pipeline (2 or 3); Split: the
// key axis is split too (see query_block), and out holds partial results in Acc; Passes: float's TF32 passes
// (3 or 1; the other types ignore it).
#pragma once

#include "block.cuh"
#include "mma_tile.cuh"

namespace cuflash {

// Limits of the layout, held to cuflash/kernels/forward_mma.py's by tests/test_layout.py.
namespace mma_forward {
// Q_i's fragments of the 16-bit types stay in registers (MT * D / 4 of them) when they and S's take at most
// kQRegisterWords / 4 (MT (D + Bc) <= kQRegisterWords); float's and double's are read from shared memory step by
// step (their products need the registers).
constexpr int kQRegisterWords = 192;
// The tiles other than the steady ones take their keys in two parts when S and O_i would hold kPartsWords
// accumulators or more: their visibility, mask and bias loads need the registers the other half of S takes.
constexpr int kPartsWords = 160;
constexpr int kMaxBc = 128;       // a row's hidden-key bits fit one 32-bit word per lane (two per n8 tile)
constexpr int kMaxHeadDim = 256;  // D and E: multiples of 32 up to this
}  // namespace mma_forward

// Shared memory of one block (cuflash/kernels/forward_mma.py mirrors it): Stages K and V tiles, then the Q tile,
// whose space the epilogue reuses for O; P's scratch (the rare CUDA-core P V) shares it too when Q sits in
// registers. Lo (3xTF32): a copy of the K, V and Q regions after it all, lo_offset bytes on, for their operands'
// low parts. Last, the block's Sweep.
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, bool Lo = false>
struct MmaShared {
    static constexpr int MT = Br / (16 * Warps);  // m16 tiles per warp
    static constexpr bool kQInRegisters = sizeof(T) == 2 && MT * (D + Bc) <= mma_forward::kQRegisterWords;
    static constexpr int kParts = MT * (Bc + E) / 2 >= mma_forward::kPartsWords && Bc % 32 == 0 ? 2 : 1;
    static constexpr int LDQ = mma::RowPadded<D, T>::ld, LDK = mma::RowPadded<D, T>::ld;
    static constexpr int LDV = mma::Padded<E, T>::ld, LDO = mma::Padded<E, T>::ld, LDP = mma::Padded<Bc, T>::ld;
    static constexpr size_t k_stage = sizeof(T) * Bc * LDK, v_stage = sizeof(T) * Bc * LDV;
    static constexpr size_t q_bytes = sizeof(T) * Br * (LDQ > LDO ? LDQ : LDO);
    static constexpr size_t p_bytes = sizeof(T) * Warps * 16 * LDP;
    static constexpr size_t k_offset = 0;
    static constexpr size_t v_offset = k_offset + Stages * k_stage;
    static constexpr size_t q_offset = v_offset + Stages * v_stage;
    static constexpr size_t p_offset = kQInRegisters ? q_offset : q_offset + q_bytes;
    static constexpr size_t base_bytes = kQInRegisters ? q_offset + (q_bytes > p_bytes ? q_bytes : p_bytes)
                                                       : p_offset + p_bytes;
    static constexpr size_t lo_offset = Lo ? base_bytes : 0;
    static constexpr size_t sweep_offset = base_bytes + (Lo ? q_offset + q_bytes : 0);
    static constexpr size_t drop_offset = sweep_offset + align16(sizeof(Sweep));
    using Dropout = BlockDropout<Br, Bc, 2>;  // kernels compiled with CUFLASH_DROPOUT: two keep tiles
    static constexpr size_t bytes = drop_offset + (kDropout ? Dropout::bytes : 0);
};

// One block of the tensor-core forward, its steps in the order they run (fwd_mma below): the block's view and
// sweep (made by one thread, read from shared memory), Q_i and the first key tiles in flight, the steady tiles'
// hot loop, the other tiles, the epilogue.
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, bool Split, int Passes>
struct FwdMmaBlock {
    using Smem = MmaShared<T, Br, Bc, D, E, Warps, Stages, sizeof(T) == 4 && Passes == 3>;
    using Math = mma::FwdMath<T, Passes>;
    using Acc = typename Math::Acc;
    using O = typename OutOf<T, Split>::type;
    static constexpr int kLoBytes = (int)Smem::lo_offset;  // from an operand's element to its low part (3xTF32)
    static constexpr int Threads = Warps * 32, MT = Smem::MT;
    static constexpr int NT = Bc / 8, ET = E / 8, KD = D / Math::kStep;  // n8 tiles of S and of O; steps of Q K^T
    static constexpr bool kQRegs = Smem::kQInRegisters;
    static_assert(MT >= 1 && Br == 16 * MT * Warps, "Br must be 16 x Warps x (m16 tiles per warp)");
    static_assert(Bc % 16 == 0 && Bc <= mma_forward::kMaxBc, "Bc must be a multiple of 16 up to 128");
    static_assert(D % 32 == 0 && E % 32 == 0 && D <= mma_forward::kMaxHeadDim && E <= mma_forward::kMaxHeadDim,
                  "head-dim buckets are multiples of 32");
    static_assert(Stages >= 2, "the K/V pipeline needs two stages or more");
    using KLoader = mma::ChunkLoader<T, Bc, D, Threads, Smem::LDK>;
    using VLoader = mma::ChunkLoader<T, Bc, E, Threads, Smem::LDV>;
    using Softmax = OnlineSoftmax<Acc, 2 * MT, 4, true>;  // a row's quad
    template <int NP> using ScoreTile = FragTile<Acc, MT, NP>;

    // The block's view of the launch and the order of its sweep (shared_sweep: by one thread, into shared memory).
    // The plain tiles (full, fully visible, no mask or bias) keep raw scores: with a positive scale the row max of
    // raw scores, times scale * log2(e), is the max of the scaled ones, and P = exp2 of one FMA.
    __device__ __forceinline__ static Sweep sweep_of(const Params<T, O>& p) {
        const BlockOperands ops = query_block<Br, Bc, Split>(p);
        const bool positive_scale = p.scale_log2 > Acc(0) && p.scale_log2 < infinity<Acc>();
        const bool chunk_loads = mma::chunk_loads<KLoader, VLoader>(key_source(p, ops, kK), key_source(p, ops, kV)) &&
                                 tiles_in_pages<Bc>(p, ops.keys.begin);
        const TileRange plain = plain_tiles<Br, Bc, false>(ops, p.left, p.right, positive_scale);
        return {ops, SweepOrder::of(ops.keys, Bc, plain, chunk_loads, Stages,
                                     visited<Bc>(p, ops.queries.begin / Br, ops.keys))};
    }

    const Params<T, O>& p;
    const Sweep& sweep;
    const BlockOperands& ops;
    const SweepOrder& order;
    T* const K_s;
    T* const V_s;
    T* const Q_s;
    T* const P_s;
    const int warp, lane, warp_row;  // warp_row: the first row of this warp's m16 tiles within Q_i
    // Full tiles of 16-byte rows from the first plain one on come through each thread's chunk loaders (tiles in
    // order), the others (a short last tile, the tiles before the first plain one, strided views) by the general
    // copy.
    KLoader K_load;
    VLoader V_load;
    // This lane's ldmatrix addresses: Q_i's A fragments, and K_j's and V_j's B fragments, carried from stage to stage.
    typename Math::QAddr Q_lane;
    typename Math::KAddr K_j;
    typename Math::VAddr V_j;
    typename Math::AFrag Q_f[kQRegs ? MT : 1][kQRegs ? KD : 1];
    Softmax softmax;
    FragTile<Acc, MT, ET> O_i;  // unnormalized
    mma::StageRing<Stages> ring;
    int t = 0;  // the visit

    __device__ __forceinline__ FwdMmaBlock(const Params<T, O>& params, const Sweep& shared, unsigned char* smem)
        : p(params), sweep(shared), ops(sweep.ops),
          order(sweep.order), K_s(reinterpret_cast<T*>(smem + Smem::k_offset)),
          V_s(reinterpret_cast<T*>(smem + Smem::v_offset)), Q_s(reinterpret_cast<T*>(smem + Smem::q_offset)),
          P_s(reinterpret_cast<T*>(smem + Smem::p_offset)), warp(threadIdx.x / 32), lane(threadIdx.x % 32),
          warp_row(warp * 16 * MT),
          K_load(ops.row_of(p.k, kK, first_chunked()), ops.strides(kK).row, (int)p.d, K_s),
          V_load(ops.row_of(p.v, kV, first_chunked()), ops.strides(kV).row, (int)p.e, V_s) {}

    __device__ __forceinline__ long long first_chunked() const {
        return ops.keys.begin + (long long)order.plain.lo * Bc;
    }
    // The first key of visit v's tile.
    __device__ __forceinline__ long long key_start(int v) const {
        return ops.keys.begin + (long long)order.at(v) * Bc;
    }
    // With dropout: the block's keep bits, visit t's in buffer t % 2 (past the Sweep; K's stages are first).
    __device__ __forceinline__ typename Smem::Dropout dropout() const {
        return {reinterpret_cast<unsigned char*>(K_s) - Smem::k_offset + Smem::drop_offset};
    }

    // K_j and V_j of key tile `tile` into pipeline stage `stage` (hop: StageRing's, for the chunk loaders). The
    // general copy finds each row's page where the keys are paged.
    __device__ __forceinline__ void load_kv(int tile, int stage, int hop) {
        if (order.chunked(tile)) {
            next_chunks(tile, hop);
            return;
        }
        const long long j0 = ops.keys.begin + (long long)tile * Bc;
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        load_rows_async<T, Bc, D, Smem::LDK, Threads>(K_s + stage * Bc * Smem::LDK, key_source(p, ops, kK), j0, cols);
        load_rows_async<T, Bc, E, Smem::LDV, Threads>(V_s + stage * Bc * Smem::LDV, key_source(p, ops, kV), j0, cols);
    }

    // A chunked tile through the chunk loaders: paged, each from its page's first row of the tile (every chunked
    // tile lies in one page: tiles_in_pages), else from where the last one ended.
    __device__ __forceinline__ void next_chunks(int tile, int hop) {
        if constexpr (kPaged) {
            const long long j0 = ops.keys.begin + (long long)tile * Bc;
            K_load.next_from(key_source(p, ops, kK).row_pointer(j0), hop);
            V_load.next_from(key_source(p, ops, kV).row_pointer(j0), hop);
        } else {
            K_load.next(hop);
            V_load.next(hop);
        }
    }

    // Q_i is the first cp.async group, the first Stages - 1 key tiles the next ones; then Q_i's fragments (float:
    // Q_i split, or rounded, to TF32 once first), and the softmax and O_i start.
    __device__ __forceinline__ void start() {
        load_rows_async<T, Br, D, Smem::LDQ, Threads>(Q_s, ops.source(p.q, kQ, p.d, p.flags, kVectorQ),
                                                     ops.queries.begin, ops.queries.size());
        ptx::cp_async_commit();
#pragma unroll
        for (int s = 0; s < Stages - 1; ++s) {
            if (s < order.tiles) load_kv(order.at(s), s, 1);
            ptx::cp_async_commit();
        }
        if constexpr (kDropout) {  // the first visit's keep bits while the copies fly, read after its first barrier
            dropout().start(p);
            if (order.tiles > 0) dropout().template fill<Threads>(0, ops.queries.begin, key_start(0));
        }
        ptx::cp_async_wait<Stages - 1>();
        __syncthreads();
        if (Math::kPrepare) {
            Math::template prepare<Br, D, Smem::LDQ, Threads>(Q_s, kLoBytes);
            __syncthreads();
        }
        Q_lane = Math::template q_lane<Smem::LDQ>(Q_s + warp_row * Smem::LDQ, lane);
        K_j = Math::template k_lane<Smem::LDK>(K_s, lane);
        V_j = Math::template v_lane<Smem::LDV>(V_s, lane);
        if (kQRegs) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < KD; ++kk)
                    Math::template load_a<Smem::LDQ>(Q_f[kQRegs ? mt : 0][kQRegs ? kk : 0], Q_lane, 16 * mt,
                                                     Math::kStep * kk, kLoBytes);
        }
        softmax.start(ops, p);
        O_i.zero();
    }

    // A key tile's start (visit t, its stage in `ring`): the tile has landed for every thread, every warp is done
    // with the stage the prefetch reuses, and the tile Stages - 1 visits on is on its way. Steady visits (plain
    // tiles whose prefetch is a full tile for the chunk loaders) take the chunk loaders without asking. With
    // dropout the next visit's keep bits are made once the prefetch is out (every warp is done with their buffer).
    template <bool Steady> __device__ __forceinline__ void begin_tile() {
        ptx::cp_async_wait<Stages - 2>();
        __syncthreads();
        if (Steady) {
            next_chunks(order.at(t + Stages - 1), ring.hop_before());
        } else if (t + Stages - 1 < order.tiles) {
            load_kv(order.at(t + Stages - 1), ring.before(), ring.hop_before());
        }
        ptx::cp_async_commit();  // possibly empty: keeps the group count the wait above relies on
        if (Math::kPrepare) {    // float: K_j and V_j split (or rounded) to TF32 once, for every warp
            Math::template prepare<Bc, D, Smem::LDK, Threads>(K_s + ring.stage * Bc * Smem::LDK, kLoBytes);
            Math::template prepare<Bc, E, Smem::LDV, Threads>(V_s + ring.stage * Bc * Smem::LDV, kLoBytes);
            __syncthreads();
        }
        if constexpr (kDropout)
            if (t + 1 < order.tiles) dropout().template fill<Threads>((t + 1) & 1, ops.queries.begin, key_start(t + 1));
    }

    // S = Q_i K_j^T over the NP n8 tiles of keys from column c0 of the tile.
    template <int NP> __device__ __forceinline__ void scores(ScoreTile<NP>& S, const int c0) {
        S.zero();
#pragma unroll(Math::kUnrollSteps)
        for (int kk = 0; kk < KD; ++kk) {
            typename Math::AFrag a[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (kQRegs)
                    a[mt] = Q_f[kQRegs ? mt : 0][kQRegs ? kk : 0];
                else
                    Math::template load_a<Smem::LDQ>(a[mt], Q_lane, 16 * mt, Math::kStep * kk, kLoBytes);
            }
#pragma unroll
            for (int np = 0; np < NP / 2; ++np) {
                typename Math::BFrag bk;
                Math::template load_b<Smem::LDK>(bk, K_j, c0 + 16 * np, Math::kStep * kk, kLoBytes);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Math::mma(S.x[mt][2 * np], a[mt], bk, 0);
                    Math::mma(S.x[mt][2 * np + 1], a[mt], bk, 1);
                }
            }
        }
    }

    // The steady tiles, in the hot loop: P and P V of a tile, then the next tile's scores and row max. Only when a
    // row's max grows, which after the first tiles is rare, does the loop leave to rescale l_i and O_i, and come
    // back: the rescale stays out of the hot loop.
    __device__ __forceinline__ void steady_tiles() {
        if (order.steady == 0) return;
        ScoreTile<NT> S;
        Acc m_old[2 * MT];
        begin_tile<true>();
        scores(S, 0);
        next_k();
        softmax.raise_max(S, p.scale_log2, m_old);
        do softmax.rescale(m_old, O_i);  // the first time, O_i and l_i are still 0
        while (hot_loop(S, m_old));
    }
    // The hot loop itself, from P of a tile whose scores and max are in: true when it stops for a rescale (a row's
    // max grew in the tile now in S), false after the last steady tile.
    __device__ __forceinline__ bool hot_loop(ScoreTile<NT>& S, Acc (&m_old)[2 * MT]) {
        for (;;) {
            softmax.exponentiate(S, p.scale_log2);
            if constexpr (kDropout) drop_probabilities(S, (t - 1) & 1, 0);  // t: the next visit's already
            Math::template pv<Smem::LDV, MT, NT, ET>(O_i.x, S.x, V_j, kLoBytes);
            next_v();
            ring.advance();
            if (t == order.steady) return false;
            begin_tile<true>();
            scores(S, 0);
            next_k();
            if (softmax.raise_max(S, p.scale_log2, m_old)) return true;
        }
    }
    // The visit's K_j and V_j addresses move to the next stage's (K_j once the scores are in: a new visit).
    __device__ __forceinline__ void next_k() {
        K_j = K_j + ring.hop * (int)Smem::k_stage;
        ++t;
    }
    __device__ __forceinline__ void next_v() { V_j = V_j + ring.hop * (int)Smem::v_stage; }

    // The other tiles (visit t): window edges, masks, biases, a short last tile. Their keys come in Parts parts of
    // Bp (Smem::kParts), each a step of the online softmax. Scale, bias and visibility apply in the log2 domain
    // (Scores); hidden keys become -inf by selection, and their bits are kept for the rare CUDA-core P V. Only
    // partial tiles and a bias pay per element.
    __device__ __forceinline__ void other_tile() {
        const int tile = order.at(t);
        begin_tile<false>();
        T* const V_stage = V_s + ring.stage * Bc * Smem::LDV;
        // Tile-wide: whether the tile is plain, its keys, and whether a hidden key's value row holds inf or NaN
        // (a hidden key's P is 0, and 0 * inf would be NaN: tiles with hidden keys look, and then P V runs on CUDA
        // cores with hidden keys skipped).
        const Scores<Acc> step = Scores<Acc>::of(ops, p, ops.queries.end, order.whole(t));
        const bool plain_tile = tile >= order.plain.lo && tile < order.plain.hi;
        const Acc S_scale = plain_tile ? p.scale_log2 : Acc(1);  // what takes S to the log2 domain
        const long long j0 = ops.keys.begin + (long long)tile * Bc;
        const int cols = plain_tile ? Bc : (int)min_ll(Bc, ops.keys.end - j0);
        const bool partial = !plain_tile && step.partial(ops.queries.begin, ops.queries.size(), j0, cols, Bc);
        const bool careful =
            partial && __syncthreads_or(mma::tile_nonfinite<T, Bc, E, Threads, Smem::LDV>(V_stage, cols));
        constexpr int Parts = Smem::kParts, Bp = Bc / Parts, NP = Bp / 8;
#pragma unroll 1
        for (int part = 0; part < Parts; ++part) {
            const int c0 = part * Bp;  // the part's first column in the tile
            if (c0 >= cols) break;
            ScoreTile<NP> S;
            scores(S, c0);
            unsigned hidden[MT][2] = {};
            const int part_cols = min(cols - c0, Bp);
            if (!plain_tile) score_step(S, hidden, step, j0 + c0, part_cols);
            Acc m_old[2 * MT];
            if (softmax.raise_max(S, S_scale, m_old)) softmax.rescale(m_old, O_i);
            softmax.exponentiate(S, S_scale);
            if constexpr (kDropout) drop_probabilities(S, t & 1, c0);
            if (!careful)  // O_i += P_ij V_j, P in registers
                Math::template pv<Smem::LDV, MT, NP, ET>(O_i.x, S.x, V_j + c0 * Smem::LDV * (int)sizeof(T), kLoBytes);
            else
                mma::pv_by_selection<T, Bp, E, MT, Smem::LDV>(O_i.x, S.x, hidden, P_s + warp * 16 * Smem::LDP,
                                                              V_stage + c0 * Smem::LDV, kLoBytes, part_cols, lane);
        }
        K_j = K_j + ring.hop * (int)Smem::k_stage;
        next_v();
        ++t;
        ring.advance();
    }
    // The score step over a part of a tile (keys [j0, j0 + cols)), column by column, each row's span worked out
    // once: a key's mask and bias offsets live for one column. Hidden keys' bits: [mt][h], bit 2 nt + x.
    template <int NP>
    __device__ __forceinline__ void score_step(ScoreTile<NP>& S, unsigned (&hidden)[MT][2], const Scores<Acc>& step,
                                               long long j0, int cols) {
        const int quad_row = lane / 4, quad_col = lane % 4;
        RowSpan span[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                span[mt][h] = step.span(ops.queries.begin + warp_row + 16 * mt + quad_row + 8 * h, j0, cols);
#pragma unroll
        for (int nt = 0; nt < NP; ++nt)
#pragma unroll
            for (int x = 0; x < 2; ++x) {
                const int jj = 8 * nt + 2 * quad_col + x;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const long long i = ops.queries.begin + warp_row + 16 * mt + quad_row + 8 * h;
                        bool visible;
                        S.x[mt][nt][2 * h + x] = step(S.x[mt][nt][2 * h + x], i, j0 + jj, jj, span[mt][h], visible);
                        if (!visible) hidden[mt][h] |= 1u << (2 * nt + x);
                    }
            }
    }

    // Dropout: P V takes only the kept probabilities (l_i took them all; scale_kept multiplies O_i by 1 / (1 - p)
    // at the end), the keep bits of the tile's columns c0 ... in `buffer`. A thread's columns 2 quad_col + {0, 1}
    // of each n8 tile.
    template <int NP> __device__ __forceinline__ void drop_probabilities(ScoreTile<NP>& S, int buffer, int c0) const {
        const auto tile = dropout().tile(buffer);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const auto keep = tile.template bits<8 * NP - 6>(warp_row + 16 * mt + lane / 4 + 8 * h,
                                                                 c0 + 2 * (lane % 4));
#pragma unroll
                for (int nt = 0; nt < NP; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x)
                        S.x[mt][nt][2 * h + x] = keep[8 * nt + x] ? S.x[mt][nt][2 * h + x] : Acc(0);
            }
    }

    // Dropout: the kept probabilities' scale, 1 / (1 - p), once on O_i before the epilogue.
    __device__ __forceinline__ void scale_kept() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int et = 0; et < ET; ++et)
#pragma unroll
                for (int y = 0; y < 4; ++y) O_i.x[mt][et][y] *= Acc(p.dropout.scale);
    }

    // O_i / l_i into the staging tile (in Q_i's place), and lse; a row that saw no key gives 0 and -inf. A split's
    // partial O stays float and goes straight from the fragments to global memory (a small scratch).
    __device__ __forceinline__ void epilogue() {
        ptx::cp_async_wait<0>();
        __syncthreads();  // every warp is done with Q_s (and P_s): O_s takes their place
        T* const O_s = Q_s;
        const int quad_row = lane / 4, quad_col = lane % 4, rows = ops.queries.size();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp_row + 16 * mt + quad_row + 8 * h;
                const typename Softmax::Row result = softmax.finish(2 * mt + h);
#pragma unroll
                for (int et = 0; et < ET; ++et) {
                    if constexpr (Split) {
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int col = 8 * et + 2 * quad_col + c;
                            if (r < rows && col < p.e)
                                ops.row_of(p.out, kOut, ops.queries.begin + r)[col * ops.strides(kOut).col] =
                                    O_i.x[mt][et][2 * h + c] * result.inv_l;
                        }
                    } else {
                        Math::store_pair(O_s + r * Smem::LDO + 8 * et + 2 * quad_col,
                                         O_i.x[mt][et][2 * h] * result.inv_l, O_i.x[mt][et][2 * h + 1] * result.inv_l);
                    }
                }
                if ((p.flags & kWantLse) && quad_col == 0 && r < rows)
                    *ops.row_of(p.lse, kLse, ops.queries.begin + r) = result.lse;
            }
        if constexpr (!Split) {
            __syncthreads();
            mma::store_tile<T, Br, E, Threads, Smem::LDO>(ops.row_of(p.out, kOut, ops.queries.begin),
                                                          ops.strides(kOut).row, ops.strides(kOut).col, O_s, rows,
                                                          (int)p.e);
        }
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, bool Split = false, int Passes = 3>
__global__ void __launch_bounds__(Warps * 32, 1) fwd_mma(const Params<T, typename OutOf<T, Split>::type> p) {
    using Block = FwdMmaBlock<T, Br, Bc, D, E, Warps, Stages, Split, Passes>;
    extern __shared__ __align__(16) unsigned char smem[];
    if (!in_batch(p)) return;
    Block block(p, shared_sweep(smem + Block::Smem::sweep_offset, [&] { return Block::sweep_of(p); }), smem);
    block.start();
    if constexpr (kPlainTiles) block.steady_tiles();
    while (block.t < block.order.tiles) block.other_tile();
    if constexpr (kDropout) block.scale_kept();
    block.epilogue();
}

}  // namespace cuflash
