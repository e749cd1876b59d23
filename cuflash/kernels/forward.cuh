// The forward pass on CUDA cores (FMA): FlashAttention's tiled online softmax, one thread block per Br query rows
// of one batch item, sweeping the visible key/value tiles of Bc rows through shared memory.
//
// Thread layout: TC = 16 consecutive lanes share a row group of RPT query rows; lane tx owns score columns
// tx, tx + 16, ... of the key tile and output columns tx, tx + 16, ... of e. So S (RPT x Bc/16 per thread), the
// running max m_i, the running sum l_i and the unnormalized O_i (RPT x E/16 per thread) live in registers; only the
// probabilities P pass through shared memory, to be read by rows for P.V. No score ever goes to global memory.
//
// Template: T element type (__half, __nv_bfloat16, float, double); Br, Bc tile sizes; D, E buckets (they size
// shared memory and registers; the actual d, e are run-time arguments and tails are zero-filled by predicated
// loads). A d above D is swept in D-wide slices (Sliced true); e is at most E (the launch splits a wider e into
// column blocks, each its own launch). Warps per block. Split: the key axis is split too (flash-decoding), and out
// holds partial results in the accumulator type.
#pragma once

#include "tile.cuh"

namespace cuflash {

constexpr int kLanesPerRow = 16;  // TC

__host__ __device__ constexpr size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Shared memory of one block, all dynamic. cuflash/tiling.py's shared-memory model mirrors this layout exactly.
template <typename T, int Br, int Bc, int D, int E>
struct ForwardShared {
    using Acc = typename AccOf<T>::type;
    // Row padding makes the row pitch an odd number of 32-bit words, so the 16 lanes reading 16 different K rows
    // at one column hit 16 different banks.
    static constexpr int kPad = sizeof(T) < 4 ? 4 / (int)sizeof(T) : 1;
    static constexpr int LDQ = D + kPad, LDK = D + kPad, LDV = E, LDP = Bc + 1;
    static constexpr size_t q_offset = 0;
    static constexpr size_t k_offset = q_offset + align16(sizeof(T) * Br * LDQ);
    static constexpr size_t v_offset = k_offset + align16(sizeof(T) * Bc * LDK);
    static constexpr size_t p_offset = v_offset + align16(sizeof(T) * Bc * LDV);
    static constexpr size_t bytes = p_offset + align16(sizeof(Acc) * Br * LDP);
};

// Launch flags (one int): which operands take 16-byte loads, and which optional operands exist.
// The bias comes in the accumulator type (the launch casts the un-broadcast original once).
// kBiasHides: the bias may hold -inf, which hides its key as the mask does (by selection, per element).
enum ForwardFlags { kVectorQ = 1, kVectorK = 2, kVectorV = 4, kHasMask = 8, kHasBias = 16, kWantLse = 32,
                    kBiasHides = 64 };

// What a block of either forward kernel reads of the launch: its query tile (rows [i0, i0 + rows)), the keys it
// sweeps, every operand's base offset for its batch item and strides (references into the geometry table, read
// where used), the diagonal offset m - n (bottom-right aligned) and which optional operands exist. Each kernel
// returns for b >= g.batch_count first: such a b has no offsets.
struct KeyRange { long long begin, end; };
struct BlockOperands {
    long long i0;
    int rows;
    KeyRange keys;
    BatchOffsets base;
    const OperandStrides &q, &k, &v, &mask, &bias, &out, &lse;
    long long offset;
    bool has_mask, has_bias, bias_hides;
};

// The launch spreads the batch over gridDim.y x gridDim.z.
__device__ __forceinline__ long long batch_item() { return blockIdx.y + (long long)gridDim.y * blockIdx.z; }

// Keys [begin, end) that any of the query rows [i0, i1) can see. left/right are the window's reach (the launch
// passes n + m + 1 for an unbounded side); offset = m - n aligns the diagonal bottom-right.
__device__ __forceinline__ KeyRange key_range(long long i0, long long i1, long long m, long long offset,
                                              long long left, long long right) {
    const long long begin = max_ll(0, i0 + offset - left);
    const long long end = min_ll(m, i1 - 1 + offset + right + 1);
    return {begin, max_ll(begin, end)};
}

// With Split, gridDim.x holds (key splits) x (query tiles) blocks: this block's tile and split. A split sweeps
// only its share of the keys and writes its partial out and lse at its own place (the launch code combines the
// splits). A compile-time choice, like Sliced: the split arithmetic costs the other kernels registers.
template <int Br, bool Split>
__device__ __forceinline__ BlockOperands block_operands(const Geometry& g, long long b, long long n, long long m,
                                                        long long left, long long right, int flags) {
    const long long tiles = Split ? max_ll(1, (n + Br - 1) / Br) : 1, split = Split ? blockIdx.x / tiles : 0;
    const long long i0 = (Split ? blockIdx.x % tiles : blockIdx.x) * (long long)Br;
    const int rows = (int)min_ll(Br, n - i0);
    KeyRange keys = key_range(i0, i0 + rows, m, m - n, left, right);
    BatchOffsets base = batch_offsets(g, b);
    if constexpr (Split) {
        keys.begin = max_ll(keys.begin, split * g.split_keys);
        keys.end = max_ll(keys.begin, min_ll(keys.end, (split + 1) * g.split_keys));
        base.of[kOut] += split * g.split_out;
        base.of[kLse] += split * g.split_lse;
    }
    return {i0, rows, keys, base, g.op[kQ], g.op[kK], g.op[kV], g.op[kMask], g.op[kBias], g.op[kOut], g.op[kLse],
            m - n, (flags & kHasMask) != 0, (flags & kHasBias) != 0, (flags & kBiasHides) != 0};
}

// In P's shared tile a hidden key has probability -1 (a visible one has p >= 0 or NaN): P.V skips it by selection,
// so a NaN or inf in a hidden value row never reaches the output through 0 * inf.
template <typename A> __device__ __forceinline__ A hidden_p() { return A(-1); }

// Scale, bias and visibility of one score S (q_i . k_j) in the log2 domain, shared by both kernels. A hidden
// key's score becomes -inf by selection, and visible says so: the window and the mask decide where partial
// (a tile that straddles the window, carries a mask or a hiding bias, or ends early), and a bias of -inf hides
// its key as the mask does (where ops.bias_hides), so a NaN in that key never counts.
template <typename A>
__device__ __forceinline__ A visible_score(A S, A scale_log2, const BlockOperands& ops, const A* bias,
                                           const bool* mask, long long i, long long j, int jj, int cols,
                                           long long n, long long left, long long right, bool partial,
                                           bool& visible) {
    constexpr A kLog2e = A(1.4426950408889634);
    visible = i < n;  // rows past n (the last tile's tail) are computed but never stored
    if (partial) {
        visible = visible && jj < cols && j >= i + ops.offset - left && j <= i + ops.offset + right;
        if (visible && ops.has_mask) visible = mask[ops.base.of[kMask] + i * ops.mask.row + j * ops.mask.col];
    }
    A s = S * scale_log2;
    if (visible && ops.has_bias) {
        const A b = bias[ops.base.of[kBias] + i * ops.bias.row + j * ops.bias.col];
        if (ops.bias_hides) visible = b != -infinity<A>();
        s += b * kLog2e;
    }
    return visible ? s : -infinity<A>();
}

// True when the window hides no key of rows [i0, i1) x keys [j0, j1).
__device__ __forceinline__ bool tile_fully_visible(long long i0, long long i1, long long j0, long long j1,
                                                   long long offset, long long left, long long right) {
    return j0 >= (i1 - 1) + offset - left && (j1 - 1) <= i0 + offset + right;
}

// Whether a tile pays for per-element visibility (visible_score's partial): it straddles the window, carries a
// mask or a bias that may hide, or ends early (cols < Bc). Full tiles of neither kind skip all of it.
__device__ __forceinline__ bool tile_is_partial(const BlockOperands& ops, long long j0, int cols, int Bc,
                                                long long left, long long right) {
    return ops.has_mask || ops.bias_hides || cols < Bc ||
           !tile_fully_visible(ops.i0, ops.i0 + ops.rows, j0, j0 + cols, ops.offset, left, right);
}

// The output's type: T, or the accumulator's for the partial results of split keys.
template <typename T, bool Split> struct OutOf { using type = T; };
template <typename T> struct OutOf<T, true> { using type = typename AccOf<T>::type; };

template <typename T, int Br, int Bc, int D, int E, int Warps, bool Sliced = false, bool Split = false>
__global__ void __launch_bounds__(Warps * 32, 1)
fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const bool* __restrict__ mask, const typename AccOf<T>::type* __restrict__ bias,
    typename OutOf<T, Split>::type* __restrict__ out,
    typename AccOf<T>::type* __restrict__ lse, const long long* __restrict__ geometry,
    long long n, long long m, long long d, long long e, typename AccOf<T>::type scale_log2,
    long long left, long long right, int flags) {
    using Acc = typename AccOf<T>::type;
    using O = typename OutOf<T, Split>::type;
    using Smem = ForwardShared<T, Br, Bc, D, E>;
    constexpr int Threads = Warps * 32, TC = kLanesPerRow, RG = Threads / TC;
    constexpr int RPT = Br / RG, CPT = Bc / TC, EPT = E / TC;  // rows, score columns, output columns per thread
    static_assert(Br % RG == 0 && Bc % TC == 0 && E % TC == 0 && D % TC == 0, "unsupported tile shape");
    static_assert(CPT <= 32, "hidden-key bits must fit one word");
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

    for (long long j0 = ops.keys.begin; j0 < ops.keys.end; j0 += Bc) {
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);

        // S_ij = q_i . k_j (scaled into the log2 domain below), one D-wide slice of the head dimension at a time.
        Acc S[RPT][CPT];
#pragma unroll
        for (int a = 0; a < RPT; ++a)
#pragma unroll
            for (int c = 0; c < CPT; ++c) S[a][c] = Acc(0);
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
#pragma unroll 2
            for (int x = 0; x < width; ++x) {
                Acc q_x[RPT], k_x[CPT];
#pragma unroll
                for (int a = 0; a < RPT; ++a) q_x[a] = to_acc(Q_s[(ty * RPT + a) * Smem::LDQ + x]);
#pragma unroll
                for (int c = 0; c < CPT; ++c) k_x[c] = to_acc(K_s[(tx + TC * c) * Smem::LDK + x]);
#pragma unroll
                for (int a = 0; a < RPT; ++a)
#pragma unroll
                    for (int c = 0; c < CPT; ++c) S[a][c] += q_x[a] * k_x[c];
            }
        }

        const bool partial = tile_is_partial(ops, j0, cols, Bc, left, right);

        // Scale, bias and visibility; a hidden key's score becomes -inf by selection and its bit is remembered.
        unsigned hidden[RPT];
#pragma unroll
        for (int a = 0; a < RPT; ++a) {
            hidden[a] = 0;
            const long long i = i0 + ty * RPT + a;
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const int jj = tx + TC * c;
                bool visible;
                S[a][c] = visible_score(S[a][c], scale_log2, ops, bias, mask, i, j0 + jj, jj, cols, n, left, right,
                                        partial, visible);
                if (!visible) hidden[a] |= 1u << c;
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
                P_s[(ty * RPT + a) * Smem::LDP + tx + TC * c] = (hidden[a] >> c & 1u) ? hidden_p<Acc>() : p;
            }
            l_i[a] = alpha * l_i[a] + lanes_sum<TC>(tile_sum);
            m_i[a] = m_new;
#pragma unroll
            for (int c = 0; c < EPT; ++c) O_i[a][c] *= alpha;
        }
        __syncthreads();

        // O_i += P_ij V_j; on partial tiles hidden keys are skipped by selection.
#pragma unroll 2
        for (int j = 0; j < cols; ++j) {
            Acc p_j[RPT], v_j[EPT];
#pragma unroll
            for (int a = 0; a < RPT; ++a) p_j[a] = P_s[(ty * RPT + a) * Smem::LDP + j];
#pragma unroll
            for (int c = 0; c < EPT; ++c) v_j[c] = to_acc(V_s[j * Smem::LDV + tx + TC * c]);
#pragma unroll
            for (int a = 0; a < RPT; ++a)
#pragma unroll
                for (int c = 0; c < EPT; ++c) {
                    const Acc o = O_i[a][c] + p_j[a] * v_j[c];
                    O_i[a][c] = (partial && p_j[a] < Acc(0)) ? O_i[a][c] : o;
                }
        }
    }

    // O_i / l_i and lse = ln(sum of exp) = (m_i + log2 l_i) * ln 2; a row that saw no key gives 0 and -inf.
#pragma unroll
    for (int a = 0; a < RPT; ++a) {
        const int r = ty * RPT + a;
        if (r >= rows) continue;
        const long long i = i0 + r;
        const bool nothing_visible = l_i[a] == Acc(0);
#pragma unroll
        for (int c = 0; c < EPT; ++c) {
            const int col = tx + TC * c;
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
