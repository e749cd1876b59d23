// The forward pass on CUDA cores (FMA): FlashAttention's tiled online softmax, one thread block per Br query rows
// of one batch item, sweeping the visible key/value tiles of Bc rows through shared memory.
//
// Thread layout: TC = 16 consecutive lanes share a row group of RPT query rows (rows ty, ty + RG, ...: the two
// groups of a warp hold adjacent rows); lane tx owns score columns tx, tx + 16, ... of the key tile (16 different
// K rows per load) and EPT output columns of e in runs of up to 16 bytes (the 16 lanes read 16 consecutive runs of
// V's row per load). So S (RPT x Bc/16 per thread), the running max m_i, the running sum l_i and the unnormalized
// O_i (RPT x E/16 per thread) live in registers; only the probabilities P pass through shared memory, to be read by
// rows for P.V. No score ever goes to global memory.
//
// Template: T element type (__half, __nv_bfloat16, float, double); Br, Bc tile sizes; D, E buckets (they size
// shared memory and registers; the actual d, e are run-time arguments and tails are zero-filled by predicated
// loads). A d above D is swept in D-wide slices (Sliced true); e is at most E (the launch splits a wider e into
// column blocks, each its own launch). Warps per block. Split: the key axis is split too (flash-decoding), and out
// holds partial results in the accumulator type. Stages: 1, K_j and V_j loaded when needed; or 2 (compute
// capability 8.0 and newer, d within D), double-buffered: tile j + 1's cp.async copies are in flight while tile j
// is computed, and a tile takes two barriers instead of three.
#pragma once

#include "block.cuh"

namespace cuflash {

// Shared memory of one block, all dynamic. cuflash/kernels/forward.py's model mirrors this layout exactly.
// Q, K and P are read in 16-byte chunks along their rows, V along its rows too (each lane's output columns). K and
// V have Stages buffers each (a stage's size is a multiple of 16 bytes: the widths are multiples of 16 elements).
template <typename T, int Br, int Bc, int D, int E, int Stages = 1>
struct ForwardShared {
    using Acc = typename AccOf<T>::type;
    static constexpr int LDQ = D + chunk_pad<T>(), LDK = D + chunk_pad<T>(), LDV = E, LDP = Bc + half_line_pad<Acc>(Bc);
    static constexpr size_t q_offset = 0;
    static constexpr size_t k_offset = q_offset + align16(sizeof(T) * Br * LDQ);
    static constexpr size_t v_offset = k_offset + Stages * align16(sizeof(T) * Bc * LDK);
    static constexpr size_t p_offset = v_offset + Stages * align16(sizeof(T) * Bc * LDV);
    static constexpr size_t drop_offset = p_offset + align16(sizeof(Acc) * Br * LDP);
    using Dropout = BlockDropout<Br, Bc, 1>;  // kernels compiled with CUFLASH_DROPOUT: one keep tile
    static constexpr size_t bytes = drop_offset + (kDropout ? Dropout::bytes : 0);
};

// One block of the CUDA-core forward, its steps in the order they run (fwd below): Q_i and the first key tile in
// flight; per key tile its K_j and V_j, S = Q_i K_j^T, the score step, the online softmax into P, O_i += P V_j; the
// epilogue. (Nothing refers to the block's own members by address: the compiler keeps all of it in registers.)
template <typename T, int Br, int Bc, int D, int E, int Warps, bool Sliced, bool Split, int Stages>
struct FwdBlock {
    using Acc = typename AccOf<T>::type;
    using O = typename OutOf<T, Split>::type;
    using Smem = ForwardShared<T, Br, Bc, D, E, Stages>;
    static constexpr int Threads = Warps * 32, TC = kLanesPerRow, RG = Threads / TC;
    static constexpr int RPT = Br / RG, CPT = Bc / TC, EPT = E / TC;  // rows, score columns, output columns a thread
    static_assert(Br % RG == 0 && Bc % TC == 0 && E % TC == 0 && D % TC == 0, "unsupported tile shape");
    static_assert(CPT <= 32, "hidden-key bits must fit one word");
    static_assert(Stages == 1 || (Stages == 2 && !Sliced), "K_j and V_j double-buffered only whole (d within D)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    static_assert(Stages == 1, "cp.async (two stages) needs compute capability 8.0 or newer");
#endif
    using Softmax = OnlineSoftmax<Acc, RPT, TC, false>;  // a row's 16 lanes
    using ScoreTile = RowTile<Acc, RPT, CPT>;

    const Params<T, O>& p;
    const BlockOperands ops;
    const Visited visits;  // the key tiles it visits
    const TileSource<T> Q, K, V;
    T* const Q_s;
    T* const K_s;
    T* const V_s;
    Acc* const P_s;
    const int tx, ty;
    Softmax softmax;
    RowTile<Acc, RPT, EPT> O_i;  // unnormalized

    __device__ __forceinline__ FwdBlock(const Params<T, O>& params, unsigned char* smem)
        : p(params), ops(query_block<Br, Bc, Split>(p)), visits(visited<Bc>(p, ops.queries.begin / Br, ops.keys)),
          Q(ops.source(p.q, kQ, p.d, p.flags, kVectorQ)),
          K(key_source(p, ops, kK)), V(key_source(p, ops, kV)),
          Q_s(reinterpret_cast<T*>(smem + Smem::q_offset)), K_s(reinterpret_cast<T*>(smem + Smem::k_offset)),
          V_s(reinterpret_cast<T*>(smem + Smem::v_offset)), P_s(reinterpret_cast<Acc*>(smem + Smem::p_offset)),
          tx(threadIdx.x % TC), ty(threadIdx.x / TC) {}

    // With dropout: the block's keep bits of the visit's key tile (past the tiles; Q's are first).
    __device__ __forceinline__ typename Smem::Dropout dropout() const {
        return {reinterpret_cast<unsigned char*>(Q_s) - Smem::q_offset + Smem::drop_offset};
    }

    // With d <= D (Sliced false), Q_i is loaded once, here. A wider d is swept in D-wide slices, and Q_i's slices
    // are reloaded with every key tile (from L2, mostly). A compile-time choice: the slice loop costs registers.
    // With two stages the first key tile's copies go out too.
    __device__ __forceinline__ void start() {
        if constexpr (!Sliced) load_rows<T, Br, D, Smem::LDQ, Threads>(Q_s, Q, ops.queries.begin, ops.queries.size());
        softmax.start(ops, p);
        if constexpr (kDropout) dropout().start(p);
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < EPT; ++c) O_i.x[a][c] = Acc(0);
        if constexpr (Stages == 2)
            if (visits.tiles > 0) load_kv_async(key_start(0), 0);
    }

    // The first key of visit t's tile.
    __device__ __forceinline__ long long key_start(int t) const {
        return ops.keys.begin + (long long)visits.tile(t) * Bc;
    }

    // Two stages: K_j and V_j of tile j + 1 are copied (cp.async) into the other stage while tile j is computed.
    __device__ __forceinline__ void load_kv_async(long long j0, int stage) {
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        load_rows_async<T, Bc, D, Smem::LDK, Threads, true>(K_s + stage * Bc * Smem::LDK, K, j0, cols);
        load_rows_async<T, Bc, E, Smem::LDV, Threads, true>(V_s + stage * Bc * Smem::LDV, V, j0, cols);
        ptx::cp_async_commit();
    }

    // S = Q_i K_j^T for the key tile at j0 (visit t, in `stage`), one D-wide slice of the head dimension at a time;
    // its K_j and V_j have landed when it returns.
    __device__ __forceinline__ void scores(ScoreTile& S, int t, long long j0, int cols, int stage) {
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < CPT; ++c) S.x[a][c] = Acc(0);
        if constexpr (Stages == 2) {
            ptx::cp_async_wait<0>();
            __syncthreads();  // tile j has landed for every thread, and every thread is done with tile j - 1 and P
            if (t + 1 < visits.tiles) load_kv_async(key_start(t + 1), stage ^ 1);
            tile_product<RPT, CPT, RG, Smem::LDQ, Smem::LDK>(S.x, Q_s, K_s + stage * Bc * Smem::LDK, (int)p.d, ty,
                                                             tx);
        } else {
            const int slices = Sliced ? (int)((p.d + D - 1) / D) : 1;
            for (int slice = 0; slice < slices; ++slice) {
                const long long x0 = (long long)slice * D;
                const TileSource<T> Q_x = Q.columns(x0, (int)min_ll(D, p.d - x0)), K_x = K.columns(x0, Q_x.width);
                __syncthreads();  // the previous slice's Q and K (at slice 0: the last tile's K, V and P) are read
                if constexpr (Sliced)
                    load_rows<T, Br, D, Smem::LDQ, Threads>(Q_s, Q_x, ops.queries.begin, ops.queries.size());
                load_rows<T, Bc, D, Smem::LDK, Threads>(K_s, K_x, j0, cols);
                if (slice == 0) load_rows<T, Bc, E, Smem::LDV, Threads>(V_s, V, j0, cols);
                __syncthreads();
                tile_product<RPT, CPT, RG, Smem::LDQ, Smem::LDK>(S.x, Q_s, K_s, Q_x.width, ty, tx);
            }
        }
    }

    // The score step; a hidden key's score becomes -inf by selection and its bit is remembered. A full tile
    // without bias is scaled and nothing else (its rows past n are computed, never stored).
    __device__ __forceinline__ void score_step(ScoreTile& S, unsigned (&hidden)[RPT], long long j0, int cols,
                                               bool partial, bool whole) const {
        if (!partial && !ops.has_bias) {
#pragma unroll
            for (int a = 0; a < RPT; ++a) {
                hidden[a] = 0;
#pragma unroll
                for (int c = 0; c < CPT; ++c) S.x[a][c] *= p.scale_log2;
            }
            return;
        }
        const Scores<Acc> step = Scores<Acc>::of(ops, p, ops.queries.end, whole);
#pragma unroll
        for (int a = 0; a < RPT; ++a) {
            hidden[a] = 0;
            const long long i = ops.queries.begin + ty + RG * a;
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const int jj = tx + TC * c;
                bool visible;
                S.x[a][c] = step(S.x[a][c], i, j0 + jj, jj, cols, partial, visible);
                if (!visible) hidden[a] |= 1u << c;
            }
        }
    }

    // The online softmax: rows whose max grew rescale l_i and O_i, then P = exp2(S - m_i) goes to shared memory (a
    // hidden key's as hidden_p) to be read by rows. With dropout l_i takes every P, P V only the kept ones
    // (scale_kept multiplies O_i by 1 / (1 - p) at the end).
    __device__ __forceinline__ void probabilities(ScoreTile& S, const unsigned (&hidden)[RPT]) {
        Acc m_old[RPT];
        if (softmax.raise_max(S, Acc(1), m_old)) softmax.rescale(m_old, O_i);
        softmax.exponentiate(S, Acc(1));
        if constexpr (kDropout) {
#pragma unroll
            for (int a = 0; a < RPT; ++a) {
                const auto keep = dropout().tile(0).template bits<TC * (CPT - 1) + 1>(ty + RG * a, tx);
#pragma unroll
                for (int c = 0; c < CPT; ++c) S.x[a][c] = keep[TC * c] ? S.x[a][c] : Acc(0);
            }
        }
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < CPT; ++c)
                P_s[(ty + RG * a) * Smem::LDP + tx + TC * c] = (hidden[a] >> c & 1u) ? hidden_p<Acc>() : S.x[a][c];
        __syncthreads();
    }

    // One key tile: S, the score step, P, then O_i += P_ij V_j, a chunk of each P row at a time, V_j's rows in each
    // lane's runs of columns; on partial tiles hidden keys are skipped by selection (keys past cols are hidden
    // there, and their V rows zero).
    __device__ __forceinline__ void key_tile(int t, int stage) {
        const long long j0 = key_start(t);
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        if constexpr (kDropout)  // the visit's keep bits, read after the barriers of scores
            dropout().template fill<Threads>(0, ops.queries.begin, j0);
        ScoreTile S;
        scores(S, t, j0, cols, stage);
        const Range& rows = ops.queries;
        const bool partial = Scores<Acc>::of(ops, p, rows.end).partial(rows.begin, rows.size(), j0, cols, Bc);
        unsigned hidden[RPT];
        score_step(S, hidden, j0, cols, partial, visits.whole(t));
        probabilities(S, hidden);
        weighted_rows<RPT, EPT, RG, Smem::LDP, Smem::LDV>(O_i.x, P_s, P_s, V_s + stage * Bc * Smem::LDV, cols,
                                                          partial, ty, tx);
    }

    // Dropout: the kept probabilities' scale, 1 / (1 - p), once on O_i before the epilogue.
    __device__ __forceinline__ void scale_kept() {
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < EPT; ++c) O_i.x[a][c] *= Acc(p.dropout.scale);
    }

    // O_i / l_i and the lse of each row (a row that saw no key gives 0 and -inf).
    __device__ __forceinline__ void epilogue() const {
        typename Softmax::Row result[RPT];
#pragma unroll
        for (int a = 0; a < RPT; ++a) result[a] = softmax.finish(a);  // every lane: the row's lanes add up l_i
#pragma unroll
        for (int a = 0; a < RPT; ++a) {
            const int r = ty + RG * a;
            if (r >= ops.queries.size()) continue;
            const long long i = ops.queries.begin + r;
#pragma unroll
            for (int c = 0; c < EPT; ++c) {
                const int col = LaneColumns<T, EPT>::column(tx, c);  // the runs weighted_rows reads
                if (col < p.e) {
                    O* const row = ops.row_of(p.out, kOut, i);
                    row[col * ops.strides(kOut).col] = from_acc<O>(O_i.x[a][c] * result[a].inv_l);
                }
            }
            if ((p.flags & kWantLse) && tx == 0) *ops.row_of(p.lse, kLse, i) = result[a].lse;
        }
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, bool Sliced = false, bool Split = false, int Stages = 1>
__global__ void __launch_bounds__(Warps * 32, 1) fwd(const Params<T, typename OutOf<T, Split>::type> p) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (!in_batch(p)) return;
    FwdBlock<T, Br, Bc, D, E, Warps, Sliced, Split, Stages> block(p, smem);
    block.start();
    int stage = 0;  // K_j's and V_j's buffer
    for (int t = 0; t < block.visits.tiles; ++t, stage = Stages == 2 ? stage ^ 1 : 0) block.key_tile(t, stage);
    if constexpr (kDropout) block.scale_kept();
    block.epilogue();
}

}  // namespace cuflash
