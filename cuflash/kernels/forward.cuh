// The forward pass on CUDA cores (FMA): FlashAttention's tiled online softmax, one thread block per Br query rows
// of one batch item, sweeping the visible key/value tiles of Bc rows through shared memory.
//
// Thread layout: TC = 16 consecutive lanes share a row group of RPT query rows (rows ty, ty + RG, ...: the two
// groups of a warp hold adjacent rows); lane tx owns score columns tx, tx + 16, ... of the key tile (16 different
// K rows per load) and EPT output columns of e in runs of up to 16 bytes (the 16 lanes read 16 consecutive runs of
// V's row per load). So S (RPT x Bc/16 per thread), the
// running max m_i, the running sum l_i and the unnormalized O_i (RPT x E/16 per thread) live in registers; only the
// probabilities P pass through shared memory, to be read by rows for P.V. No score ever goes to global memory.
//
// Template: T element type (__half, __nv_bfloat16, float, double); Br, Bc tile sizes; D, E buckets (they size
// shared memory and registers; the actual d, e are run-time arguments and tails are zero-filled by predicated
// loads). A d above D is swept in D-wide slices (Sliced true); e is at most E (the launch splits a wider e into
// column blocks, each its own launch). Warps per block. Split: the key axis is split too (flash-decoding), and out
// holds partial results in the accumulator type. Stages: 1, K_j and V_j loaded when needed; or 2 (compute
// capability 8.0 and newer, d within D), double-buffered: tile j + 1's cp.async copies are in flight while tile j
// is computed, and a tile takes two barriers instead of three.
#pragma once

#include "forward_common.cuh"

namespace cuflash {

// Shared memory of one block, all dynamic. cuflash/cudacore.py's shared-memory model mirrors this layout exactly.
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
__global__ void __launch_bounds__(Warps * 32, 1)
fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const bool* __restrict__ mask, const typename AccOf<T>::type* __restrict__ bias,
    typename OutOf<T, Split>::type* __restrict__ out,
    typename AccOf<T>::type* __restrict__ lse, const long long* __restrict__ geometry,
    long long n, long long m, long long d, long long e, typename AccOf<T>::type scale_log2,
    long long left, long long right, int flags) {
    using Acc = typename AccOf<T>::type;
    using O = typename OutOf<T, Split>::type;
    using Smem = ForwardShared<T, Br, Bc, D, E, Stages>;
    constexpr int Threads = Warps * 32, TC = kLanesPerRow, RG = Threads / TC;
    constexpr int RPT = Br / RG, CPT = Bc / TC, EPT = E / TC;  // rows, score columns, output columns per thread
    static_assert(Br % RG == 0 && Bc % TC == 0 && E % TC == 0 && D % TC == 0, "unsupported tile shape");
    static_assert(CPT <= 32, "hidden-key bits must fit one word");
    static_assert(Stages == 1 || (Stages == 2 && !Sliced), "K_j and V_j double-buffered only whole (d within D)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    static_assert(Stages == 1, "cp.async (two stages) needs compute capability 8.0 or newer");
#endif
    constexpr Acc kLn2 = Acc(0.6931471805599453);

    extern __shared__ __align__(16) unsigned char smem[];
    T* Q_s = reinterpret_cast<T*>(smem + Smem::q_offset);
    T* K_s = reinterpret_cast<T*>(smem + Smem::k_offset);
    T* V_s = reinterpret_cast<T*>(smem + Smem::v_offset);
    Acc* P_s = reinterpret_cast<Acc*>(smem + Smem::p_offset);

    const Geometry& g = *reinterpret_cast<const Geometry*>(geometry);
    const long long b = batch_item();
    if (b >= g.batch_count) return;
    const BlockOperands ops = block_operands<Br, Split>(g, b, n, m, left, right, flags);
    const long long i0 = ops.i0;
    const int rows = ops.rows;
    const int tx = threadIdx.x % TC, ty = threadIdx.x / TC;

    // With d <= D (Sliced false), Q_i is loaded once, here. A wider d is swept in D-wide slices, and Q_i's slices
    // are reloaded with every key tile (from L2, mostly). A compile-time choice: the slice loop costs registers.
    const T* q_i = q + ops.base.of[kQ] + i0 * ops.q.row;
    constexpr bool q_resident = !Sliced;
    const int slices = q_resident ? 1 : (int)((d + D - 1) / D);
    if constexpr (q_resident)
        load_tile<T, Br, D, Smem::LDQ, Threads>(Q_s, q_i, ops.q.row, ops.q.col, rows, (int)d, flags & kVectorQ);

    Acc m_i[RPT], l_i[RPT], O_i[RPT][EPT];
#pragma unroll
    for (int a = 0; a < RPT; ++a) {
        m_i[a] = -infinity<Acc>();
        l_i[a] = Acc(0);
#pragma unroll
        for (int c = 0; c < EPT; ++c) O_i[a][c] = Acc(0);
    }

    // Two stages: K_j and V_j of tile j + 1 are copied (cp.async) into the other stage while tile j is computed.
    const auto load_kv_async = [&](long long j0, int stage) {
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        load_tile_async<T, Bc, D, Smem::LDK, Threads, true>(K_s + stage * Bc * Smem::LDK,
                                                            k + ops.base.of[kK] + j0 * ops.k.row, ops.k.row,
                                                            ops.k.col, cols, (int)d, flags & kVectorK);
        load_tile_async<T, Bc, E, Smem::LDV, Threads, true>(V_s + stage * Bc * Smem::LDV,
                                                            v + ops.base.of[kV] + j0 * ops.v.row, ops.v.row,
                                                            ops.v.col, cols, (int)e, flags & kVectorV);
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
        Acc S[RPT][CPT];
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < CPT; ++c) S[a][c] = Acc(0);
        if constexpr (Stages == 2) {
            ptx::cp_async_wait<0>();
            __syncthreads();  // tile j has landed for every thread, and every thread is done with tile j - 1 and P
            if (j0 + Bc < ops.keys.end) load_kv_async(j0 + Bc, stage ^ 1);
            tile_product<RPT, CPT, RG, Smem::LDQ, Smem::LDK>(S, Q_s, K_j, (int)d, ty, tx);
        } else {
            for (int slice = 0; slice < slices; ++slice) {
                const long long x0 = (long long)slice * D;
                const int width = (int)min_ll(D, d - x0);
                __syncthreads();  // the previous slice's Q and K (at slice 0: the previous tile's K, V and P) are read
                if constexpr (!q_resident)
                    load_tile<T, Br, D, Smem::LDQ, Threads>(Q_s, q_i + x0 * ops.q.col, ops.q.row, ops.q.col, rows,
                                                            width, flags & kVectorQ);
                load_tile<T, Bc, D, Smem::LDK, Threads>(K_s, k + ops.base.of[kK] + j0 * ops.k.row + x0 * ops.k.col,
                                                        ops.k.row, ops.k.col, cols, width, flags & kVectorK);
                if (slice == 0)
                    load_tile<T, Bc, E, Smem::LDV, Threads>(V_s, v + ops.base.of[kV] + j0 * ops.v.row, ops.v.row,
                                                            ops.v.col, cols, (int)e, flags & kVectorV);
                __syncthreads();
                tile_product<RPT, CPT, RG, Smem::LDQ, Smem::LDK>(S, Q_s, K_s, width, ty, tx);
            }
        }

        const bool partial = tile_is_partial(ops, j0, cols, Bc, left, right);

        // Scale, bias and visibility; a hidden key's score becomes -inf by selection and its bit is remembered.
        // A full tile without bias is scaled and nothing else (its rows past n are computed, never stored).
        unsigned hidden[RPT];
        if (!partial && !ops.has_bias) {
#pragma unroll
            for (int a = 0; a < RPT; ++a) {
                hidden[a] = 0;
#pragma unroll
                for (int c = 0; c < CPT; ++c) S[a][c] *= scale_log2;
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
                    S[a][c] = visible_score(S[a][c], scale_log2, ops, bias, mask, i, j0 + jj, jj, cols, n, left,
                                            right, partial, visible);
                    if (!visible) hidden[a] |= 1u << c;
                }
            }
        }

        // Online softmax: new running max, rescale l_i and O_i by exp2(m_old - m_new), add this tile's share.
#pragma unroll
        for (int a = 0; a < RPT; ++a) {
            Acc tile_max = -infinity<Acc>();
#pragma unroll
            for (int c = 0; c < CPT; ++c) tile_max = max_(tile_max, S[a][c]);
            const Acc m_new = max_(m_i[a], lanes_max<TC>(tile_max));
            const Acc m_use = m_new == -infinity<Acc>() ? Acc(0) : m_new;  // nothing visible yet: exp2(-inf) = 0
            const Acc alpha = exp2_(m_i[a] - m_use);
            Acc tile_sum = Acc(0);
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const Acc p = exp2_(S[a][c] - m_use);
                tile_sum += p;
                P_s[(ty + RG * a) * Smem::LDP + tx + TC * c] = (hidden[a] >> c & 1u) ? hidden_p<Acc>() : p;
            }
            l_i[a] = alpha * l_i[a] + lanes_sum<TC>(tile_sum);
            m_i[a] = m_new;
#pragma unroll
            for (int c = 0; c < EPT; ++c) O_i[a][c] *= alpha;
        }
        __syncthreads();

        // O_i += P_ij V_j, a chunk of each P row at a time, V_j's rows in each lane's runs of columns; on partial
        // tiles hidden keys are skipped by selection (keys past cols are hidden there, and their V rows zero).
        weighted_rows<RPT, EPT, RG, Smem::LDP, Smem::LDV>(O_i, P_s, P_s, V_j, cols, partial, ty, tx);
    }

    // O_i / l_i and lse = ln(sum of exp) = (m_i + log2 l_i) * ln 2; a row that saw no key gives 0 and -inf.
#pragma unroll
    for (int a = 0; a < RPT; ++a) {
        const int r = ty + RG * a;
        if (r >= rows) continue;
        const long long i = i0 + r;
        const bool nothing_visible = l_i[a] == Acc(0);
#pragma unroll
        for (int c = 0; c < EPT; ++c) {
            const int col = LaneColumns<T, EPT>::column(tx, c);  // the runs weighted_rows reads
            if (col < e)
                out[ops.base.of[kOut] + i * ops.out.row + col * ops.out.col] =
                    from_acc<O>(nothing_visible ? Acc(0) : O_i[a][c] / l_i[a]);
        }
        if ((flags & kWantLse) && tx == 0)
            lse[ops.base.of[kLse] + i * ops.lse.row] =
                nothing_visible ? -infinity<Acc>() : (m_i[a] + log2_(l_i[a])) * kLn2;
    }
}

}  // namespace cuflash
