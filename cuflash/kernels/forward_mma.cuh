// The forward pass on tensor cores (FlashAttention-2 style) on sm_80 and newer: __half and __nv_bfloat16 on
// mma.m16n8k16, float on mma.m16n8k8 with TF32 operands (three passes, 3xTF32, or one), double on mma.m8n8k4
// (DMMA). mma_tile.cuh's FwdMath<T, Passes> holds what differs per type: the products and their fragments.
//
// One thread block per Br query rows of one batch item; its warps split the rows, MT m16 tiles (16 * MT rows)
// each. Per key tile of Bc keys:
//   S = Q_i K_j^T     tensor-core products, accumulated in Acc (float; double for double); Q_i as A fragments
//                     (in registers for the whole sweep when they fit, else from shared memory), K_j as the
//                     column-major B operand;
//   online softmax    directly on the accumulator fragments: a row lives in the four lanes of a quad, so the
//                     row max and sum need two shuffles; scale * log2(e) is folded into one multiplier (exp2);
//   O_i += P V_j      P in registers is the A operand (rounded to T for the 16-bit types), V_j the B operand.
// K_j and V_j stream through Stages shared-memory buffers with cp.async: tile j + Stages - 1 is in flight while
// tile j is computed. The epilogue stages O_i / l_i through shared memory so global stores are coalesced.
// The steady state (full tiles that every row sees whole, without mask or bias) runs first, in a hot loop compiled
// apart from the other tiles' (window edges, masks, biases, a short last tile): no run-time flags, no visibility,
// addresses carried from tile to tile, and the rescale of O_i (when a row's max grows: rarely, after the first
// tiles) out of it. Where S and O_i take most of the registers, the other tiles take their keys in two parts
// (MmaShared::kParts), and the block's view of the launch waits in shared memory (Sweep).
//
// Semantics are the CUDA-core kernel's (forward.cuh): same arguments, visibility by selection, fully masked
// rows give 0 and lse -inf. A hidden key whose value row holds inf or NaN must not reach a row through 0 * inf:
// on tiles with hidden keys, a block vote looks for non-finite values in V_j, and only then P V_j runs on CUDA
// cores with hidden keys skipped per (row, key), exactly like forward.cuh.
//
// Template: T element type; Br, Bc tile sizes; D, E head-dim buckets (multiples of 32 up to 256; the actual
// d, e are run-time values, tails zero-filled); Warps per block; Stages of the K/V pipeline (2 or 3); Split: the
// key axis is split too (see block_operands), and out holds partial results in Acc; Passes: float's TF32 passes
// (3 or 1; the other types ignore it).
#pragma once

#include "forward_common.cuh"
#include "mma_tile.cuh"

namespace cuflash {

// Shared memory of one block (cuflash/tensorcore.py mirrors it): Stages K and V tiles, then the Q tile, whose
// space the epilogue reuses for O; P's scratch (the rare CUDA-core P V) shares it too when Q sits in registers.
// Lo (3xTF32): a copy of the K, V and Q regions after it all, lo_offset bytes on, for their operands' low parts.
// Last, the block's Sweep.
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, bool Lo = false>
struct MmaShared {
    static constexpr int MT = Br / (16 * Warps);  // m16 tiles per warp
    // Q_i's fragments of the 16-bit types stay in registers (MT * D / 4 of them) when they and S's take at most
    // 48; float's and double's are read from shared memory step by step (their products need the registers).
    static constexpr bool kQInRegisters = sizeof(T) == 2 && MT * (D + Bc) <= 192;
    // The tiles other than the steady ones take their keys in two parts when S and O_i would hold 160
    // accumulators or more: their visibility, mask and bias loads need the registers the other half of S takes.
    static constexpr int kParts = MT * (Bc + E) / 2 >= 160 && Bc % 32 == 0 ? 2 : 1;
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
    static constexpr size_t bytes = sweep_offset + align16(sizeof(Sweep));
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages, bool Split = false, int Passes = 3>
__global__ void __launch_bounds__(Warps * 32, 1)
fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
        const bool* __restrict__ mask, const typename AccOf<T>::type* __restrict__ bias,
        typename OutOf<T, Split>::type* __restrict__ out,
        typename AccOf<T>::type* __restrict__ lse, const long long* __restrict__ geometry,
        long long n, long long m, long long d, long long e, typename AccOf<T>::type scale_log2,
        long long left, long long right, int flags) {
    using Smem = MmaShared<T, Br, Bc, D, E, Warps, Stages, sizeof(T) == 4 && Passes == 3>;
    using Math = mma::FwdMath<T, Passes>;
    constexpr int kLoBytes = (int)Smem::lo_offset;  // from an operand's element to its low part (3xTF32)
    using Acc = typename Math::Acc;
    constexpr int Threads = Warps * 32, MT = Smem::MT;
    constexpr int NT = Bc / 8, ET = E / 8, KD = D / Math::kStep;  // n8 tiles of S and of O; steps of Q K^T
    constexpr bool kQRegs = Smem::kQInRegisters;
    static_assert(MT >= 1 && Br == 16 * MT * Warps, "Br must be 16 x Warps x (m16 tiles per warp)");
    static_assert(Bc % 16 == 0 && Bc <= 128, "Bc must be a multiple of 16 up to 128 (hidden bits in one word)");
    static_assert(D % 32 == 0 && E % 32 == 0 && D <= 256 && E <= 256, "head-dim buckets are multiples of 32");
    static_assert(Stages >= 2, "the K/V pipeline needs two stages or more");
    constexpr Acc kLn2 = Acc(0.6931471805599453);

    extern __shared__ __align__(16) unsigned char smem[];
    T* K_s = reinterpret_cast<T*>(smem + Smem::k_offset);
    T* V_s = reinterpret_cast<T*>(smem + Smem::v_offset);
    T* Q_s = reinterpret_cast<T*>(smem + Smem::q_offset);
    T* O_s = Q_s;  // the epilogue's staging tile, once Q_i is no longer read
    T* P_s = reinterpret_cast<T*>(smem + Smem::p_offset);

    const Geometry& g = *reinterpret_cast<const Geometry*>(geometry);
    const long long b = batch_item();
    if (b >= g.batch_count) return;
    // The block's view of the launch and of its sweep, worked out by one thread and read from shared memory where
    // used: kept in registers through the steady loop, they would take those the largest tiles need.
    using KLoader = mma::ChunkLoader<T, Bc, D, Threads, Smem::LDK>;
    using VLoader = mma::ChunkLoader<T, Bc, E, Threads, Smem::LDV>;
    if (threadIdx.x == 0) {
        const BlockOperands o = block_operands<Br, Split>(g, b, n, m, left, right, flags);
        // The plain tiles (full, fully visible, no mask or bias) keep raw scores: with a positive scale the row max
        // of raw scores, times scale * log2(e), is the max of the scaled ones, and P = exp2 of one FMA.
        const bool positive_scale = scale_log2 > Acc(0) && scale_log2 < infinity<Acc>();
        const bool chunk_loads = mma::chunk_loads<KLoader, VLoader>(o.k.row, o.v.row, flags & kVectorK,
                                                                    flags & kVectorV, d, e);
        const TileRange plain = plain_tiles(o, Bc, left, right, positive_scale);
        new (smem + Smem::sweep_offset) Sweep{o, SweepOrder::of(o.keys, Bc, plain, chunk_loads, Stages)};
    }
    __syncthreads();
    const Sweep& sweep = *reinterpret_cast<const Sweep*>(smem + Smem::sweep_offset);
    const BlockOperands& ops = sweep.ops;
    const long long& i0 = ops.i0;
    const KeyRange& keys = ops.keys;
    const SweepOrder& order = sweep.order;
    const int &rows = ops.rows, &tiles = order.tiles;
    const TileRange& plain = order.plain;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad_row = lane / 4, quad_col = lane % 4;
    const int warp_row = warp * 16 * MT;  // first row of this warp's m16 tiles within Q_i

    // K_j and V_j of key tile `tile` into pipeline stage `stage`: full tiles of 16-byte rows from the first plain
    // one on by each thread's chunk loaders (tiles in order), the others (a short last tile, the tiles before the
    // first plain one, strided views) by the general copy.
    const long long chunks_from = keys.begin + (long long)plain.lo * Bc;
    KLoader K_load(k + ops.base.of[kK] + chunks_from * ops.k.row, ops.k.row, (int)d, K_s);
    VLoader V_load(v + ops.base.of[kV] + chunks_from * ops.v.row, ops.v.row, (int)e, V_s);
    auto load_kv = [&](int tile, int stage, int hop) {
        if (order.chunked(tile)) {
            K_load.next(hop);
            V_load.next(hop);
            return;
        }
        const long long j0 = keys.begin + (long long)tile * Bc;
        const int cols = (int)min_ll(Bc, keys.end - j0);
        load_tile_async<T, Bc, D, Smem::LDK, Threads>(K_s + stage * Bc * Smem::LDK,
                                                           k + ops.base.of[kK] + j0 * ops.k.row, ops.k.row,
                                                           ops.k.col, cols, (int)d, flags & kVectorK);
        load_tile_async<T, Bc, E, Smem::LDV, Threads>(V_s + stage * Bc * Smem::LDV,
                                                           v + ops.base.of[kV] + j0 * ops.v.row, ops.v.row,
                                                           ops.v.col, cols, (int)e, flags & kVectorV);
    };

    // Q_i is the first cp.async group, the first Stages - 1 key tiles the next ones.
    load_tile_async<T, Br, D, Smem::LDQ, Threads>(Q_s, q + ops.base.of[kQ] + i0 * ops.q.row, ops.q.row,
                                                       ops.q.col, rows, (int)d, flags & kVectorQ);
    ptx::cp_async_commit();
#pragma unroll
    for (int s = 0; s < Stages - 1; ++s) {
        if (s < tiles) load_kv(order.at(s), s, 1);
        ptx::cp_async_commit();
    }
    ptx::cp_async_wait<Stages - 1>();
    __syncthreads();
    if (Math::kPrepare) {  // float: Q_i split (or rounded) to TF32 once
        Math::template prepare<Br, D, Smem::LDQ, Threads>(Q_s, kLoBytes);
        __syncthreads();
    }
    // This lane's ldmatrix addresses: Q_i's A fragments, and K_j's and V_j's B fragments in stage 0.
    const typename Math::QAddr Q_lane = Math::template q_lane<Smem::LDQ>(Q_s + warp_row * Smem::LDQ, lane);
    typename Math::KAddr K_j = Math::template k_lane<Smem::LDK>(K_s, lane);  // carried from stage to stage
    typename Math::VAddr V_j = Math::template v_lane<Smem::LDV>(V_s, lane);
    typename Math::AFrag Q_f[kQRegs ? MT : 1][kQRegs ? KD : 1];
    if (kQRegs) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < KD; ++kk)
                Math::template load_a<Smem::LDQ>(Q_f[kQRegs ? mt : 0][kQRegs ? kk : 0], Q_lane, 16 * mt,
                                                 Math::kStep * kk, kLoBytes);
    }

    // Running max m_i (log2 domain) and (per-lane partial) sum l_i of rows quad_row and quad_row + 8 of each m16
    // tile, and the unnormalized O_i in accumulator fragments. m_i starts at the lowest finite value, not -inf: P
    // of a -inf score is then exp2(-inf) = 0, never exp2(-inf + inf), and a row that saw nothing keeps l_i = 0.
    Acc m_i[MT][2], l_i[MT][2], O_i[MT][ET][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m_i[mt][h] = lowest<Acc>();
            l_i[mt][h] = Acc(0);
        }
#pragma unroll
        for (int et = 0; et < ET; ++et)
#pragma unroll
            for (int x = 0; x < 4; ++x) O_i[mt][et][x] = Acc(0);
    }

    // A key tile's start (visit t, its stage in `ring`): the tile has landed for every thread, every warp is done
    // with the stage the prefetch reuses, and the tile Stages - 1 visits on is on its way. Steady visits (plain
    // tiles whose prefetch is a full tile for the chunk loaders) take the chunk loaders without asking.
    auto begin_tile = [&](const int t, const mma::StageRing<Stages>& ring, auto steady) {
        ptx::cp_async_wait<Stages - 2>();
        __syncthreads();
        if (decltype(steady)::value) {
            K_load.next(ring.hop_before());
            V_load.next(ring.hop_before());
        } else if (t + Stages - 1 < tiles) {
            load_kv(order.at(t + Stages - 1), ring.before(), ring.hop_before());
        }
        ptx::cp_async_commit();  // possibly empty: keeps the group count the wait above relies on
        if (Math::kPrepare) {    // float: K_j and V_j split (or rounded) to TF32 once, for every warp
            Math::template prepare<Bc, D, Smem::LDK, Threads>(K_s + ring.stage * Bc * Smem::LDK, kLoBytes);
            Math::template prepare<Bc, E, Smem::LDV, Threads>(V_s + ring.stage * Bc * Smem::LDV, kLoBytes);
            __syncthreads();
        }
    };

    // S = Q_i K_j^T over the NP n8 tiles of keys from column c0 of the tile.
    auto scores = [&](auto& S, const int c0) {
        constexpr int NP = mma::N8Tiles<decltype(S)>::value;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NP; ++nt)
#pragma unroll
                for (int x = 0; x < 4; ++x) S[mt][nt][x] = Acc(0);
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
                    Math::mma(S[mt][2 * np], a[mt], bk, 0);
                    Math::mma(S[mt][2 * np + 1], a[mt], bk, 1);
                }
            }
        }
    };

    // The online softmax's row max: a row whose max grew (S times S_scale, in the log2 domain) moves m_i there, its
    // old max kept in m_old; whether any row of the warp moved.
    auto move_max = [&](const auto& S, const Acc S_scale, auto& m_old) {  // m_old: Acc[MT][2]
        constexpr int NP = mma::N8Tiles<decltype(S)>::value;
        bool any_moved = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                Acc tile_max = max_(S[mt][0][2 * h], S[mt][0][2 * h + 1]);
#pragma unroll
                for (int nt = 1; nt < NP; ++nt)
                    tile_max = max_(tile_max, max_(S[mt][nt][2 * h], S[mt][nt][2 * h + 1]));
                const Acc m_new = mma::quad_max(tile_max) * S_scale;
                const bool moved = m_new > m_i[mt][h];  // never for -inf (hidden) scores
                any_moved |= moved;
                m_old[mt][h] = m_i[mt][h];
                m_i[mt][h] = moved ? m_new : m_i[mt][h];
            }
        return __any_sync(0xffffffffu, any_moved);
    };
    // l_i and O_i follow m_i: rescaled by alpha = exp2(m_old - m_i), exactly 1 for the rows whose max stayed.
    auto rescale = [&](const Acc (&m_old)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const Acc alpha = mma::exp2_fast(m_old[mt][h] - m_i[mt][h]);
                l_i[mt][h] *= alpha;
#pragma unroll
                for (int et = 0; et < ET; ++et)
#pragma unroll
                    for (int x = 0; x < 2; ++x) O_i[mt][et][2 * h + x] *= alpha;
            }
    };
    // P = exp2(S S_scale - m_i) in place, and its row sums into l_i (this lane's share: the quad's lanes add up at
    // the end).
    auto probabilities = [&](auto& S, const Acc S_scale) {
        constexpr int NP = mma::N8Tiles<decltype(S)>::value;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nt = 0; nt < NP; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const Acc p = mma::exp2_fast(mma::fma_(S[mt][nt][2 * h + x], S_scale, -m_i[mt][h]));
                        S[mt][nt][2 * h + x] = p;
                        l_i[mt][h] += p;
                    }
    };

    // The other tiles (visit t): window edges, masks, biases, a short last tile. Their keys come in Parts parts of
    // Bp (Smem::kParts), each a step of the online softmax. Scale, bias and visibility apply in the log2 domain;
    // hidden keys become -inf by selection, and their bits are kept for the rare CUDA-core P V. Only partial tiles
    // and a bias pay per element.
    auto other_tile = [&](const int t, const mma::StageRing<Stages>& ring) {
        const int tile = order.at(t);
        begin_tile(t, ring, mma::Steady<false>{});
        T* const V_stage = V_s + ring.stage * Bc * Smem::LDV;
        // Tile-wide: whether the tile is plain, its keys, and whether a hidden key's value row holds inf or NaN
        // (a hidden key's P is 0, and 0 * inf would be NaN: tiles with hidden keys look, and then P V runs on CUDA
        // cores with hidden keys skipped).
        const bool plain_tile = tile >= plain.lo && tile < plain.hi;
        const Acc S_scale = plain_tile ? scale_log2 : Acc(1);  // what takes S to the log2 domain
        const long long j0 = keys.begin + (long long)tile * Bc;
        const int cols = plain_tile ? Bc : (int)min_ll(Bc, keys.end - j0);
        const bool partial = !plain_tile && tile_is_partial(ops, j0, cols, Bc, left, right);
        const bool careful =
            partial && __syncthreads_or(mma::tile_nonfinite<T, Bc, E, Threads, Smem::LDV>(V_stage, cols));
        constexpr int Parts = Smem::kParts, Bp = Bc / Parts, NP = Bp / 8;
#pragma unroll 1
        for (int part = 0; part < Parts; ++part) {
            const int c0 = part * Bp;  // the part's first column in the tile
            if (c0 >= cols) break;
            Acc S[MT][NP][4];
            scores(S, c0);
            unsigned hidden[MT][2] = {};
            const int part_cols = min(cols - c0, Bp);
            if (!plain_tile) {
                // Column by column, each row's span worked out once: a key's mask and bias offsets live for one
                // column.
                RowSpan span[MT][2];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        span[mt][h] = row_span(ops, i0 + warp_row + 16 * mt + quad_row + 8 * h, j0 + c0, part_cols,
                                               n, left, right);
#pragma unroll
                for (int nt = 0; nt < NP; ++nt)
#pragma unroll
                    for (int x = 0; x < 2; ++x) {
                        const int jj = 8 * nt + 2 * quad_col + x;
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const long long i = i0 + warp_row + 16 * mt + quad_row + 8 * h;
                                bool visible;
                                S[mt][nt][2 * h + x] = visible_score(S[mt][nt][2 * h + x], scale_log2, ops, bias,
                                                                     mask, i, j0 + c0 + jj, jj, span[mt][h], visible);
                                if (!visible) hidden[mt][h] |= 1u << (2 * nt + x);
                            }
                    }
            }
            Acc m_old[MT][2];
            if (move_max(S, S_scale, m_old)) rescale(m_old);
            probabilities(S, S_scale);
            if (!careful)  // O_i += P_ij V_j, P in registers
                Math::template pv<Smem::LDV, MT, NP, ET>(O_i, S, V_j + c0 * Smem::LDV * (int)sizeof(T), kLoBytes);
            else
                mma::pv_by_selection<T, Bp, E, MT, Smem::LDV>(O_i, S, hidden, P_s + warp * 16 * Smem::LDP,
                                                              V_stage + c0 * Smem::LDV, kLoBytes, part_cols, lane);
        }
        K_j = K_j + ring.hop * (int)Smem::k_stage;
        V_j = V_j + ring.hop * (int)Smem::v_stage;
    };

    // The steady tiles come first, in the hot loop: P and P V of a tile, then the next tile's scores and row max.
    // Only when a row's max grows, which after the first tiles is rare, does the loop leave to rescale l_i and O_i
    // (rescale), and come back: the rescale stays out of the hot loop.
    int t = 0;
    mma::StageRing<Stages> ring;
    if (order.steady > 0) {
        Acc S[MT][NT][4], m_old[MT][2];
        begin_tile(t, ring, mma::Steady<true>{});
        scores(S, 0);
        K_j = K_j + ring.hop * (int)Smem::k_stage;
        ++t;
        move_max(S, scale_log2, m_old);
        for (;;) {
            rescale(m_old);  // the first time, O_i and l_i are still 0
            for (;;) {       // the hot loop
                probabilities(S, scale_log2);
                Math::template pv<Smem::LDV, MT, NT, ET>(O_i, S, V_j, kLoBytes);
                V_j = V_j + ring.hop * (int)Smem::v_stage;
                ring.advance();
                if (t == order.steady) goto steady_done;
                begin_tile(t, ring, mma::Steady<true>{});
                scores(S, 0);
                K_j = K_j + ring.hop * (int)Smem::k_stage;
                ++t;
                if (move_max(S, scale_log2, m_old)) break;
            }
        }
    }
steady_done:
    for (; t < tiles; ++t, ring.advance()) other_tile(t, ring);
    ptx::cp_async_wait<0>();
    __syncthreads();  // every warp is done with Q_s (and P_s): O_s takes their place

    // O_i / l_i into the staging tile, and lse = (m_i + log2 l_i) ln 2; a row that saw no key gives 0 and -inf.
    // A split's partial O stays float and goes straight from the fragments to global memory (a small scratch).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp_row + 16 * mt + quad_row + 8 * h;
            const Acc l = mma::quad_sum(l_i[mt][h]);
            const bool nothing_visible = l == Acc(0);
            const Acc inv_l = nothing_visible ? Acc(0) : Acc(1) / l;
#pragma unroll
            for (int et = 0; et < ET; ++et) {
                if constexpr (Split) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int col = 8 * et + 2 * quad_col + c;
                        if (r < rows && col < e)
                            out[ops.base.of[kOut] + (i0 + r) * ops.out.row + col * ops.out.col] =
                                O_i[mt][et][2 * h + c] * inv_l;
                    }
                } else {
                    Math::store_pair(O_s + r * Smem::LDO + 8 * et + 2 * quad_col, O_i[mt][et][2 * h] * inv_l,
                                     O_i[mt][et][2 * h + 1] * inv_l);
                }
            }
            if ((flags & kWantLse) && quad_col == 0 && r < rows)
                lse[ops.base.of[kLse] + (i0 + r) * ops.lse.row] =
                    nothing_visible ? -infinity<Acc>() : (m_i[mt][h] + log2_(l)) * kLn2;
        }
    if constexpr (!Split) {
        __syncthreads();
        mma::store_tile<T, Br, E, Threads, Smem::LDO>(out + ops.base.of[kOut] + i0 * ops.out.row, ops.out.row,
                                                      ops.out.col, O_s, rows, (int)e);
    }
}

}  // namespace cuflash
