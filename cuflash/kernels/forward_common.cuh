// What both forward kernels share: the launch flags, the block's view of the launch (its query tile, keys and
// operand offsets), and the one visibility rule (visible_score, tile_is_partial). Python's side of the rule is
// problem.Window; the launch code (cuflash/launch.py) writes the flags and the geometry table this reads.
#pragma once

#include "tile.cuh"

namespace cuflash {

// Launch flags (one int, forward and backward): which operands take 16-byte loads, and which optional operands
// exist. The bias comes in the accumulator type (the launch casts the un-broadcast original once).
// kBiasHides: the bias may hold -inf, which hides its key as the mask does (by selection, per element).
enum LaunchFlags { kVectorQ = 1, kVectorK = 2, kVectorV = 4, kHasMask = 8, kHasBias = 16, kWantLse = 32,
                   kBiasHides = 64, kVectorDout = 128, kWantDbias = 256 };

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
// Query tiles go last first: under a causal mask the last rows see the most keys, and the heaviest blocks should
// start first, not leave the GPU waiting on them at the end.
template <int Br, bool Split>
__device__ __forceinline__ BlockOperands block_operands(const Geometry& g, long long b, long long n, long long m,
                                                        long long left, long long right, int flags) {
    const long long tiles = max_ll(1, (n + Br - 1) / Br), split = Split ? blockIdx.x / tiles : 0;
    const long long i0 = (tiles - 1 - (Split ? blockIdx.x % tiles : blockIdx.x)) * (long long)Br;
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

// Row i's visible keys in a tile of keys [j0, j0 + cols), as the tile's columns [lo, hi): the window's reach
// (offset = m - n aligns the diagonal bottom-right), the tile's end, and none for a row past n (computed, never
// stored). Worked out once per row, so each element's window test is two 32-bit compares.
struct RowSpan { int lo, hi; };
__device__ __forceinline__ RowSpan row_span(const BlockOperands& ops, long long i, long long j0, int cols,
                                            long long n, long long left, long long right) {
    if (i >= n) return {0, 0};
    const long long lo = i + ops.offset - left - j0, hi = i + ops.offset + right + 1 - j0;
    return {(int)min_ll(max_ll(lo, 0), cols), (int)max_ll(min_ll(hi, cols), 0)};
}

// Scale, bias and visibility of one score S (q_i . k_j, column jj of its tile) in the log2 domain, shared by
// both kernels. A hidden key's score becomes -inf by selection, and visible says so: the row's span and the mask
// decide, and a bias of -inf hides its key as the mask does (where ops.bias_hides), so a NaN in that key never
// counts.
template <typename A>
__device__ __forceinline__ A visible_score(A S, A scale_log2, const BlockOperands& ops, const A* bias,
                                           const bool* mask, long long i, long long j, int jj, RowSpan span,
                                           bool& visible) {
    constexpr A kLog2e = A(1.4426950408889634);
    visible = jj >= span.lo && jj < span.hi;
    if (visible && ops.has_mask) visible = mask[ops.base.of[kMask] + i * ops.mask.row + j * ops.mask.col];
    A s = S * scale_log2;
    if (visible && ops.has_bias) {
        const A b = bias[ops.base.of[kBias] + i * ops.bias.row + j * ops.bias.col];
        if (ops.bias_hides) visible = b != -infinity<A>();
        s += b * kLog2e;
    }
    return visible ? s : -infinity<A>();
}

// The same for one element of a tile (cols keys from j - jj on): partial says whether the window, the mask or the
// tile's end may hide any key of it (tile_is_partial); a tile that is not needs only the row's i < n.
template <typename A>
__device__ __forceinline__ A visible_score(A S, A scale_log2, const BlockOperands& ops, const A* bias,
                                           const bool* mask, long long i, long long j, int jj, int cols,
                                           long long n, long long left, long long right, bool partial,
                                           bool& visible) {
    const RowSpan span = partial ? row_span(ops, i, j - jj, cols, n, left, right) : RowSpan{0, i < n ? cols : 0};
    return visible_score(S, scale_log2, ops, bias, mask, i, j, jj, span, visible);
}

// True when the window hides no key of rows [i0, i1) x keys [j0, j1).
__device__ __forceinline__ bool tile_fully_visible(long long i0, long long i1, long long j0, long long j1,
                                                   long long offset, long long left, long long right) {
    return j0 >= (i1 - 1) + offset - left && (j1 - 1) <= i0 + offset + right;
}

// Whether a tile of query rows [i0, i0 + rows) x keys [j0, j0 + cols) pays for per-element visibility
// (visible_score's partial): it straddles the window, carries a mask or a bias that may hide, or ends early
// (cols < Bc). Full tiles of neither kind skip all of it.
__device__ __forceinline__ bool tile_is_partial(const BlockOperands& ops, long long i0, int rows, long long j0,
                                                int cols, int Bc, long long left, long long right) {
    return ops.has_mask || ops.bias_hides || cols < Bc ||
           !tile_fully_visible(i0, i0 + rows, j0, j0 + cols, ops.offset, left, right);
}
// The same for a key tile of the block's query tile.
__device__ __forceinline__ bool tile_is_partial(const BlockOperands& ops, long long j0, int cols, int Bc,
                                                long long left, long long right) {
    return tile_is_partial(ops, ops.i0, ops.rows, j0, cols, Bc, left, right);
}

__device__ __forceinline__ long long floor_div(long long a, long long b) {  // b > 0
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The tiles of B of the swept range [swept.begin, swept.end) that hold B elements each, all of them seen by every
// row of [i0, i0 + rows) by the window, as [lo, hi) (tile t from swept.begin + t B). Rows and tiles are along
// either axis: query rows against key tiles (offset = m - n), or key rows against query tiles (the transposed
// window: offset n - m, left and right swapped).
struct TileRange { int lo, hi; };
__device__ __forceinline__ TileRange seen_whole(KeyRange swept, int B, long long i0, int rows, long long offset,
                                                long long left, long long right) {
    const long long begin = swept.begin, full = (swept.end - begin) / B;
    // tile_fully_visible: j0 >= i1 - 1 + offset - left (from lo on) and j0 + B - 1 <= i0 + offset + right (up to hi)
    const long long lo = max_ll(0, -floor_div(begin - (i0 + rows - 1 + offset - left), B));
    const long long hi = min_ll(full, floor_div(i0 + offset + right - (B - 1) - begin, B) + 1);
    return hi > lo ? TileRange{(int)lo, (int)hi} : TileRange{0, 0};
}

// The plain key tiles of a sweep over keys (the forward's, bwd_mma_dq's), [lo, hi): all Bc keys, each visible to
// every row of the block's query tile by the window, with neither mask nor bias. They run the steady state, which
// skips per-element visibility (tile_is_partial is false for each of them, and they carry no bias); the range is
// worked out once per block, so no tile computes its own. Empty when `allowed` is false.
__device__ __forceinline__ TileRange plain_tiles(const BlockOperands& ops, int Bc, long long left, long long right,
                                                 bool allowed) {
    if (!allowed || ops.has_mask || ops.has_bias) return {0, 0};
    return seen_whole(ops.keys, Bc, ops.i0, ops.rows, ops.offset, left, right);
}

// The order of a block's sweep over the tiles of B along its swept axis (the forward's and bwd_mma_dq's key tiles,
// bwd_mma_dkdv's query tiles): from the first plain tile on, then those before it (a window's edge); visit t is
// tile at(t). The sums over the swept tiles may take them in any order, and this one, fixed for a block, puts the
// steady visits first: plain tiles whose copies, and those of the tile Stages - 1 visits on, are whole tiles for
// each thread's chunk loaders (tiles in order from the first plain one on; `chunked`), so a loop compiled apart
// runs them without visibility, masks, biases, checks or choices of copy.
struct SweepOrder {
    int tiles, full;   // tiles, and those holding all B elements (the first ones)
    TileRange plain;
    int steady;        // visits of the steady loop
    bool chunk_loads;  // whether whole tiles take the chunk loaders (16-byte rows the loaders can address)

    __device__ __forceinline__ static SweepOrder of(KeyRange swept, int B, TileRange plain, bool chunk_loads,
                                                    int Stages) {
        const int full = (int)((swept.end - swept.begin) / B);
        const int steady = chunk_loads ? max(0, min(plain.hi, full - (Stages - 1)) - plain.lo) : 0;
        return {(int)((swept.end - swept.begin + B - 1) / B), full, plain, steady, chunk_loads};
    }
    __device__ __forceinline__ int at(int t) const {
        return t < tiles - plain.lo ? plain.lo + t : t - (tiles - plain.lo);
    }
    __device__ __forceinline__ bool chunked(int tile) const {
        return chunk_loads && tile >= plain.lo && tile < full;
    }
};

// What a tensor-core block's sweep needs to know of the launch, worked out by one thread and read from shared
// memory where used (cuflash/tensorcore.py's SWEEP_BYTES): its view (BlockOperands) and the order of its swept
// tiles. Kept in registers through the steady loop, they would take those the largest tiles need.
struct Sweep {
    BlockOperands ops;
    SweepOrder order;
};

// The output's type: T, or the accumulator's for the partial results of split keys.
template <typename T, bool Split> struct OutOf { using type = T; };
template <typename T> struct OutOf<T, true> { using type = typename AccOf<T>::type; };

}  // namespace cuflash
