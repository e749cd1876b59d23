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
    static constexpr size_t bytes = p_offset + align16(sizeof(Acc) * Br * LDP);
};

template <typename T, int Br, int Bc, int D, int E, int Warps, bool Sliced = false, bool Split = false, int Stages = 1>
__global__ void __launch_bounds__(Warps * 32, 1) fwd(const Params<T, typename OutOf<T, Split>::type> p) {
    using Acc = typename AccOf<T>::type;
    using Smem = ForwardShared<T, Br, Bc, D, E, Stages>;
    constexpr int Threads = Warps * 32, TC = kLanesPerRow, RG = Threads / TC;
    constexpr int RPT = Br / RG, CPT = Bc / TC, EPT = E / TC;  // rows, score columns, output columns per thread
    static_assert(Br % RG == 0 && Bc % TC == 0 && E % TC == 0 && D % TC == 0, "unsupported tile shape");
    static_assert(CPT <= 32, "hidden-key bits must fit one word");
    static_assert(Stages == 1 || (Stages == 2 && !Sliced), "K_j and V_j double-buffered only whole (d within D)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    static_assert(Stages == 1, "cp.async (two stages) needs compute capability 8.0 or newer");
#endif

    extern __shared__ __align__(16) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem + Smem::q_offset);
    T* K_s = reinterpret_cast<T*>(smem + Smem::k_offset);
    T* V_s = reinterpret_cast<T*>(smem + Smem::v_offset);
    Acc* P_s = reinterpret_cast<Acc*>(smem + Smem::p_offset);

    if (!in_batch(p)) return;
    const BlockOperands ops = query_block<Br, Split>(p);
    const Scores<Acc> scores = Scores<Acc>::of(ops, p, p.n);
    const TileSource<T> Q = ops.source(p.q, kQ, p.d, p.flags, kVectorQ),
                        K = ops.source(p.k, kK, p.d, p.flags, kVectorK),
                        V = ops.source(p.v, kV, p.e, p.flags, kVectorV);
    const long long i0 = ops.queries.begin;
    const int rows = ops.queries.size();
    const int tx = threadIdx.x % TC, ty = threadIdx.x / TC;

    // With d <= D (Sliced false), Q_i is loaded once, here. A wider d is swept in D-wide slices, and Q_i's slices
    // are reloaded with every key tile (from L2, mostly). A compile-time choice: the slice loop costs registers.
    const int slices = Sliced ? (int)((p.d + D - 1) / D) : 1;
    if constexpr (!Sliced) load_rows<T, Br, D, Smem::LDQ, Threads>(Q_s, Q, i0, rows);

    OnlineSoftmax<Acc, RPT, TC, false> softmax;
    softmax.start();
    RowTile<Acc, RPT, EPT> O_i;
#pragma unroll
    for (int a = 0; a < RPT; ++a)
#pragma unroll
        for (int c = 0; c < EPT; ++c) O_i.x[a][c] = Acc(0);

    // Two stages: K_j and V_j of tile j + 1 are copied (cp.async) into the other stage while tile j is computed.
    const auto load_kv_async = [&](long long j0, int stage) {
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        load_rows_async<T, Bc, D, Smem::LDK, Threads, true>(K_s + stage * Bc * Smem::LDK, K, j0, cols);
        load_rows_async<T, Bc, E, Smem::LDV, Threads, true>(V_s + stage * Bc * Smem::LDV, V, j0, cols);
        ptx::cp_async_commit();
    };
    if constexpr (Stages == 2)
        if (ops.keys.begin < ops.keys.end) load_kv_async(ops.keys.begin, 0);

    int stage = 0;  // K_j's and V_j's buffer
    for (long long j0 = ops.keys.begin; j0 < ops.keys.end; j0 += Bc, stage = Stages == 2 ? stage ^ 1 : 0) {
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        const T* const K_j = K_s + stage * Bc * Smem::LDK;
        const T* const V_j = V_s + stage * Bc * Smem::LDV;

        // S_ij = q_i . k_j (scaled into the log2 domain below), one D-wide slice of the head dimension at a time.
        RowTile<Acc, RPT, CPT> S;
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < CPT; ++c) S.x[a][c] = Acc(0);
        if constexpr (Stages == 2) {
            ptx::cp_async_wait<0>();
            __syncthreads();  // tile j has landed for every thread, and every thread is done with tile j - 1 and P
            if (j0 + Bc < ops.keys.end) load_kv_async(j0 + Bc, stage ^ 1);
            tile_product<RPT, CPT, RG, Smem::LDQ, Smem::LDK>(S.x, Q_s, K_j, (int)p.d, ty, tx);
        } else {
            for (int slice = 0; slice < slices; ++slice) {
                const long long x0 = (long long)slice * D;
                const TileSource<T> Q_x{Q.at + x0 * Q.col, Q.row, Q.col, (int)min_ll(D, p.d - x0), Q.vector};
                const TileSource<T> K_x{K.at + x0 * K.col, K.row, K.col, Q_x.width, K.vector};
                __syncthreads();  // the previous slice's Q and K (at slice 0: the previous tile's K, V and P) are read
                if constexpr (Sliced) load_rows<T, Br, D, Smem::LDQ, Threads>(Q_s, Q_x, i0, rows);
                load_rows<T, Bc, D, Smem::LDK, Threads>(K_s, K_x, j0, cols);
                if (slice == 0) load_rows<T, Bc, E, Smem::LDV, Threads>(V_s, V, j0, cols);
                __syncthreads();
                tile_product<RPT, CPT, RG, Smem::LDQ, Smem::LDK>(S.x, Q_s, K_s, Q_x.width, ty, tx);
            }
        }

        // The score step; a hidden key's score becomes -inf by selection and its bit is remembered. A full tile
        // without bias is scaled and nothing else (its rows past n are computed, never stored).
        const bool partial = scores.partial(i0, rows, j0, cols, Bc);
        unsigned hidden[RPT];
        if (!partial && !ops.has_bias) {
#pragma unroll
            for (int a = 0; a < RPT; ++a) {
                hidden[a] = 0;
#pragma unroll
                for (int c = 0; c < CPT; ++c) S.x[a][c] *= p.scale_log2;
            }
        } else {
#pragma unroll
            for (int a = 0; a < RPT; ++a) {
                hidden[a] = 0;
                const long long i = i0 + ty + RG * a;
#pragma unroll
                for (int c = 0; c < CPT; ++c) {
                    const int jj = tx + TC * c;
                    bool visible;
                    S.x[a][c] = scores(S.x[a][c], i, j0 + jj, jj, cols, partial, visible);
                    if (!visible) hidden[a] |= 1u << c;
                }
            }
        }

        // The online softmax: rows whose max grew rescale l_i and O_i, then P = exp2(S - m_i) goes to shared memory
        // (a hidden key's as hidden_p) to be read by rows.
        Acc m_old[RPT];
        if (softmax.raise_max(S, Acc(1), m_old)) softmax.rescale(m_old, O_i);
        softmax.exponentiate(S, Acc(1));
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < CPT; ++c)
                P_s[(ty + RG * a) * Smem::LDP + tx + TC * c] = (hidden[a] >> c & 1u) ? hidden_p<Acc>() : S.x[a][c];
        __syncthreads();

        // O_i += P_ij V_j, a chunk of each P row at a time, V_j's rows in each lane's runs of columns; on partial
        // tiles hidden keys are skipped by selection (keys past cols are hidden there, and their V rows zero).
        weighted_rows<RPT, EPT, RG, Smem::LDP, Smem::LDV>(O_i.x, P_s, P_s, V_j, cols, partial, ty, tx);
    }

    // O_i / l_i and the lse of each row (a row that saw no key gives 0 and -inf).
    typename OnlineSoftmax<Acc, RPT, TC, false>::Row result[RPT];
#pragma unroll
    for (int a = 0; a < RPT; ++a) result[a] = softmax.finish(a);  // every lane: the row's lanes add up l_i
    using O = typename OutOf<T, Split>::type;
#pragma unroll
    for (int a = 0; a < RPT; ++a) {
        const int r = ty + RG * a;
        if (r >= rows) continue;
#pragma unroll
        for (int c = 0; c < EPT; ++c) {
            const int col = LaneColumns<T, EPT>::column(tx, c);  // the runs weighted_rows reads
            if (col < p.e) ops.row_of(p.out, kOut, i0 + r)[col * ops.strides(kOut).col] =
                               from_acc<O>(O_i.x[a][c] * result[a].inv_l);
        }
        if ((p.flags & kWantLse) && tx == 0) *ops.row_of(p.lse, kLse, i0 + r) = result[a].lse;
    }
}

}  // namespace cuflash
