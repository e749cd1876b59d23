// The block layer every kernel is written in: the launch flags, the block's view of the launch (BlockOperands, made
// one way for a block of queries and one way for a block of keys), where its operands' tiles come from
// (TileSource), the score step (Scores: scale, bias and visibility, the one rule), FlashAttention's online softmax
// (OnlineSoftmax, over tiles of either register layout), and the order of a block's sweep (SweepOrder). Python's
// side of the visibility rule is problem.Window; cuflash/launch.py writes the flags and the tables read here.
#pragma once

#include "tile.cuh"

// The kernel's mods (mods.cuh): a struct the source defines ahead of the kernels, or none.
#ifndef CUFLASH_MODS
#define CUFLASH_MODS NoMods
#endif

namespace cuflash {

using Mods = mods::CUFLASH_MODS;
constexpr bool kHasMods = Mods::kScore || Mods::kMask;
// Whether a block may have plain tiles (plain_tiles): not with mods, nor with a block mask's visits, so those
// kernels compile no steady loop.
constexpr bool kPlainTiles = !kHasMods && !Mods::kBlocks;

// Launch flags (Params::flags, forward and backward): which operands take 16-byte loads, and which optional operands
// exist. kBiasHides: the bias may hold -inf, which hides its key as the mask does (by selection, per element).
enum LaunchFlags { kVectorQ = 1, kVectorK = 2, kVectorV = 4, kHasMask = 8, kHasBias = 16, kWantLse = 32,
                   kBiasHides = 64, kVectorDout = 128, kWantDbias = 256 };

struct Range {
    long long begin, end;
    __device__ __forceinline__ int size() const { return (int)(end - begin); }
};

// Keys [begin, end) that any of the query rows [i0, i1) can see. left/right are the window's reach (the launch
// passes n + m + 1 for an unbounded side); offset = m - n aligns the diagonal bottom-right.
__device__ __forceinline__ Range key_range(long long i0, long long i1, long long m, long long offset, long long left,
                                           long long right) {
    const long long begin = max_ll(0, i0 + offset - left);
    const long long end = min_ll(m, i1 - 1 + offset + right + 1);
    return {begin, max_ll(begin, end)};
}

// Queries [begin, end) that see any of the keys [j0, j1): key_range's inverse (j is visible to i when
// i + offset - left <= j <= i + offset + right).
__device__ __forceinline__ Range query_range(long long j0, long long j1, long long n, long long offset, long long left,
                                             long long right) {
    const long long begin = max_ll(0, j0 - offset - right);
    const long long end = min_ll(n, j1 - 1 - offset + left + 1);
    return {begin, max_ll(begin, end)};
}

// The launch spreads the batch over gridDim.y x gridDim.z: this block's batch item, and whether there is one (each
// kernel returns first where there is not: such a block has no operands).
__device__ __forceinline__ long long batch_item() { return blockIdx.y + (long long)gridDim.y * blockIdx.z; }
template <typename P> __device__ __forceinline__ bool in_batch(const P& p) {
    return batch_item() < p.geometry->batch_count;
}

// In paged kernels a tile's source also says where its pages are (PageWalk: none where its table is null); in the
// others it has nothing more (Unpaged), and its copies compile as they always have.
using PagesOf = typename Select<kPaged, PageWalk, Unpaged>::type;
__device__ __forceinline__ bool walks(const PageWalk& pages) { return pages.table != nullptr; }
__device__ __forceinline__ bool walks(Unpaged) { return false; }
__device__ __forceinline__ PageWalk starting(const PageWalk& pages, long long r0) {
    return {pages.table, pages.stride, pages.size, (unsigned)r0};
}
__device__ __forceinline__ Unpaged starting(Unpaged, long long) { return {}; }

// Rows of one operand of the block's batch item, as a tile copy reads them: row 0's first element, the strides,
// the operand's width (d or e: columns past it are zero in the tile), whether 16-byte copies serve it (the
// launch's vector flag: unit column stride and aligned rows) and, paged, its pages.
template <typename T> struct TileSource {
    const T* at;
    long long row, col;
    int width;
    bool vector;
    PagesOf pages;
    __device__ __forceinline__ const T* rows(long long r0) const { return at + r0 * row; }
    // Columns [x0, x0 + width) of the same rows (the CUDA-core forward's slices of the head dimension).
    __device__ __forceinline__ TileSource columns(long long x0, int cols) const {
        return {at + x0 * col, row, col, cols, vector, pages};
    }
    // What a tile copy of rows [r0, ...) reads: where its row 0 is (a paged source's: page 0's), and how it walks
    // the pages, if any.
    __device__ __forceinline__ const T* copy_from(long long r0) const { return walks(pages) ? at : rows(r0); }
    __device__ __forceinline__ PagesOf walk_from(long long r0) const { return starting(pages, r0); }
    // Row r's first element, in its page where the source is paged.
    __device__ __forceinline__ const T* row_pointer(long long r) const {
        return row_at(copy_from(r), 0, row, walk_from(r));
    }
};

// Rows [r0, r0 + rows) of src into a shared tile of Rows x Cols (pitch LD), zero past them: synchronous loads, or
// cp.async copies that land at the wait covering the caller's commit (Unrolled: load_tile_async's whole tiles).
template <typename T, int Rows, int Cols, int LD, int Threads>
__device__ __forceinline__ void load_rows(T* tile, const TileSource<T>& src, long long r0, int rows) {
    load_tile<T, Rows, Cols, LD, Threads>(tile, src.copy_from(r0), src.row, src.col, rows, src.width, src.vector,
                                          src.walk_from(r0));
}
template <typename T, int Rows, int Cols, int LD, int Threads, bool Unrolled = false>
__device__ __forceinline__ void load_rows_async(T* tile, const TileSource<T>& src, long long r0, int rows) {
    load_tile_async<T, Rows, Cols, LD, Threads, Unrolled>(tile, src.copy_from(r0), src.row, src.col, rows,
                                                          src.width, src.vector, src.walk_from(r0));
}

// The sequence of the block's batch item: its query and key counts, and the rows of the operands where its queries
// and keys start (0 but for packed sequences, Params::cu_seqlens_*).
struct Sequence {
    long long n, m, row_q, row_k;
};
template <typename P> __device__ __forceinline__ Sequence sequence_of(const P& p) {
    if constexpr (kPaged) return {p.n, p.pages.seqlens[batch_item() / p.sequence_items], 0, 0};
    if (p.cu_seqlens_q == nullptr) return {p.n, p.m, 0, 0};
    const long long s = batch_item() / p.sequence_items;
    const long long q0 = p.cu_seqlens_q[s], k0 = p.cu_seqlens_k[s];
    return {p.cu_seqlens_q[s + 1] - q0, p.cu_seqlens_k[s + 1] - k0, q0, k0};
}

// What a block reads of the launch: the queries and keys it works on (a block of queries: its own rows, and the keys
// they see; a block of keys: its own keys, and the queries that see them), every operand's base offset for its
// batch item (its sequence's first row included), the geometry table (strides, read where used), its sequence's
// diagonal offset m - n (bottom-right aligned) and which optional operands exist; with sinks
// (Mods::kSinks), whether its rows' softmax starts from the sink (split keys: split 0's only, so that the splits'
// merge counts it once). Made by query_block or key_block, nothing else.
struct BlockOperands {
    Range queries, keys;
    BatchOffsets base;
    const Geometry* g;
    long long offset;
    bool has_mask, has_bias, bias_hides, sink;

    __device__ __forceinline__ const OperandStrides& strides(Operand x) const { return g->op[x]; }
    // Operand x (its array `at`, `width` columns wide) from its batch item's row 0, 16-byte copies by `flag`.
    template <typename T>
    __device__ __forceinline__ TileSource<T> source(const T* at, Operand x, long long width, int flags,
                                                    int flag) const {
        return {at + base.of[x], g->op[x].row, g->op[x].col, (int)width, (flags & flag) != 0};
    }
    template <typename A> __device__ __forceinline__ A* row_of(A* at, Operand x, long long i) const {
        return at + base.of[x] + i * g->op[x].row;
    }
};

// The keys (x = kK) or values (kV) of the block's batch item as its tile copies read them: in paged kernels, in
// the pages of its sequence.
template <typename P>
__device__ __forceinline__ auto key_source(const P& p, const BlockOperands& ops, Operand x) {
    auto src = x == kK ? ops.source(p.k, kK, p.d, p.flags, kVectorK) : ops.source(p.v, kV, p.e, p.flags, kVectorV);
    if constexpr (kPaged) {
        const unsigned s = (unsigned)batch_item() / (unsigned)p.sequence_items;  // the grid holds < 2^32 items
        src.pages = {p.pages.table + s * p.pages.table_stride, x == kK ? p.pages.stride_k : p.pages.stride_v,
                     (unsigned)p.pages.size, 0u};
    }
    return src;
}

// Whether every whole tile of B keys from `begin` on lies in one page (always where nothing is paged): the chunk
// loaders then take paged tiles too, each from its page.
template <int B, typename P> __device__ __forceinline__ bool tiles_in_pages(const P& p, long long begin) {
    if constexpr (kPaged) return p.pages.size % B == 0 && begin % B == 0;
    else return true;
}

// The operands indexed by query row, and those indexed by key (a packed sequence's rows start at its offsets).
constexpr Operand kQueryRows[] = {kQ, kOut, kLse, kDout, kTerms, kDq};
constexpr Operand kKeyRows[] = {kK, kV, kDk, kDv};

template <typename P>
__device__ __forceinline__ BlockOperands block_operands(const P& p, const Sequence& seq, Range queries, Range keys) {
    BlockOperands ops{queries, keys, batch_offsets(*p.geometry, batch_item()), p.geometry, seq.m - seq.n,
                      (p.flags & kHasMask) != 0, (p.flags & kHasBias) != 0, (p.flags & kBiasHides) != 0, true};
    if (p.cu_seqlens_q != nullptr) {
        for (const Operand x : kQueryRows) ops.base.of[x] += seq.row_q * p.geometry->op[x].row;
        for (const Operand x : kKeyRows) ops.base.of[x] += seq.row_k * p.geometry->op[x].row;
    }
    return ops;
}

// With a block mask (Mods::kBlocks) a block's swept range starts on a tile of the block mask's (the launch's tiles,
// B along the swept axis): the keys or queries before its first visible one are hidden by the window there.
template <int B> __device__ __forceinline__ Range on_tiles(Range swept) {
    if constexpr (Mods::kBlocks)
        if (swept.begin < swept.end) swept.begin -= swept.begin % B;
    return swept;
}

// A block of Br queries (the forward's, bwd_*dq's) sweeping tiles of Bc keys. With Split, gridDim.x holds (key
// splits) x (query tiles) blocks: this block's tile and split. A split sweeps only its share of the keys and writes
// its partial out and lse at its own place (the launch code combines the splits). A compile-time choice, like
// Sliced: the split arithmetic costs the other kernels registers. Query tiles go last first: under a causal mask the
// last rows see the most keys, and the heaviest blocks should start first, not leave the GPU waiting on them. The
// launch's tiles are the longest sequence's: a block past its own sequence's rows has no queries and no keys.
template <int Br, int Bc, bool Split, typename P> __device__ __forceinline__ BlockOperands query_block(const P& p) {
    const Geometry& g = *p.geometry;
    const Sequence seq = sequence_of(p);
    const long long tiles = max_ll(1, (p.n + Br - 1) / Br), split = Split ? blockIdx.x / tiles : 0;
    const long long i0 = min_ll(seq.n, (tiles - 1 - (Split ? blockIdx.x % tiles : blockIdx.x)) * (long long)Br);
    const long long i1 = min_ll(seq.n, i0 + Br);
    const Range keys = i0 < i1 ? key_range(i0, i1, seq.m, seq.m - seq.n, p.left, p.right) : Range{0, 0};
    BlockOperands ops = block_operands(p, seq, {i0, i1}, on_tiles<Bc>(keys));
    if constexpr (Split) {
        ops.keys.begin = max_ll(ops.keys.begin, split * g.split_keys);
        ops.keys.end = max_ll(ops.keys.begin, min_ll(ops.keys.end, (split + 1) * g.split_keys));
        ops.base.of[kOut] += split * g.split_out;
        ops.base.of[kLse] += split * g.split_lse;
        ops.sink = split == 0;
    }
    return ops;
}

// A block of Bc keys (bwd_*dkdv's): its keys, and the queries that see them (the tiles of Br it sweeps); none past
// its sequence's keys.
template <int Bc, int Br, typename P> __device__ __forceinline__ BlockOperands key_block(const P& p) {
    const Sequence seq = sequence_of(p);
    const long long j0 = min_ll(seq.m, blockIdx.x * (long long)Bc), j1 = min_ll(seq.m, j0 + Bc);
    const Range queries = j0 < j1 ? query_range(j0, j1, seq.n, seq.m - seq.n, p.left, p.right) : Range{0, 0};
    return block_operands(p, seq, on_tiles<Br>(queries), {j0, j1});
}

// In P's shared tile a hidden key has probability -1 (a visible one has p >= 0 or NaN): P.V skips it by selection,
// so a NaN or inf in a hidden value row never reaches the output through 0 * inf.
template <typename A> __device__ __forceinline__ A hidden_p() { return A(-1); }

// ---------------------------------------------------------------------------------------------------------------
// The score step: the one place where a raw score S = q_i . k_j becomes what the softmax sees.

// Row i's visible keys in a tile of keys [j0, j0 + cols), as the tile's columns [lo, hi): the window's reach, the
// tile's end, and none for a row past n (computed, never stored). Worked out once per row, so each element's window
// test is two 32-bit compares.
struct RowSpan { int lo, hi; };

// True when the window hides no key of rows [i0, i1) x keys [j0, j1).
__device__ __forceinline__ bool tile_fully_visible(long long i0, long long i1, long long j0, long long j1,
                                                   long long offset, long long left, long long right) {
    return j0 >= (i1 - 1) + offset - left && (j1 - 1) <= i0 + offset + right;
}

// Scale, bias, visibility and the mods in the log2 domain, for one block: a hidden pair's score becomes -inf by
// selection and `visible` says so (the row's span and the mask decide, a bias of -inf hides its key as the mask
// does, where ops.bias_hides, so a NaN in that key never counts, and mask_mod joins them). Every kernel's scores
// that are not plain (a tile whose pairs are all visible, without mask, bias or mods: scaled and nothing else) go
// through it. n: the rows that exist (the backward's key blocks pass their swept tile's end, so rows past it are
// hidden whatever the tile). whole: the block mask shows the tile whole, so mask_mod is not evaluated on it.
template <typename A> struct Scores {
    const BlockOperands& ops;
    const A* bias;
    const bool* mask;
    A scale_log2, scale;
    long long n, left, right;
    bool whole;
    const mods::Args* args;
    mods::BatchIndex<Mods::kBatchAxes> batch;  // the mods' batch indices (kHasMods)

    template <typename P>
    __device__ __forceinline__ static Scores of(const BlockOperands& ops, const P& p, long long n,
                                                bool whole = false) {
        Scores s{ops, p.bias, p.mask, p.scale_log2, p.scale, n, p.left, p.right, whole, &p.mods, {}};
        if constexpr (kHasMods) s.batch = mods::BatchIndex<Mods::kBatchAxes>::of(p.mods, batch_item());
        return s;
    }

    __device__ __forceinline__ RowSpan span(long long i, long long j0, int cols) const {
        if (i >= n) return {0, 0};
        const long long lo = i + ops.offset - left - j0, hi = i + ops.offset + right + 1 - j0;
        return {(int)min_ll(max_ll(lo, 0), cols), (int)max_ll(min_ll(hi, cols), 0)};
    }
    // Whether a tile of query rows [i0, i0 + rows) x keys [j0, j0 + cols) pays for per-element visibility: it
    // straddles the window, carries a mask, mods or a bias that may hide, or ends early (cols < Bc). Full tiles of
    // neither kind skip all of it.
    __device__ __forceinline__ bool partial(long long i0, int rows, long long j0, int cols, int Bc) const {
        return kHasMods || ops.has_mask || ops.bias_hides || cols < Bc ||
               !tile_fully_visible(i0, i0 + rows, j0, j0 + cols, ops.offset, left, right);
    }
    // Score S of query i and key j (column jj of its tile, whose row span is `span`). slope: where the backward
    // wants d score_mod / d score (kernels with a score_mod).
    __device__ __forceinline__ A operator()(A S, long long i, long long j, int jj, RowSpan span, bool& visible,
                                            A* slope = nullptr) const {
        visible = jj >= span.lo && jj < span.hi;
        if (visible && ops.has_mask) visible = mask[ops.base.of[kMask] + i * ops.strides(kMask).row +
                                                    j * ops.strides(kMask).col];
        A s = S * scale_log2, b = A(0);
        if (visible && ops.has_bias) {
            b = bias[ops.base.of[kBias] + i * ops.strides(kBias).row + j * ops.strides(kBias).col];
            if (ops.bias_hides) visible = b != -infinity<A>();
            s += b * A(kLog2e);
        }
        if constexpr (kHasMods) s = with_mods(S * scale + b, s, i, j, visible, slope);
        return visible ? s : -infinity<A>();
    }
    // The same for a tile element, its row's span worked out here (partial: whether the tile needs one at all; a
    // tile that is not needs only the row's i < n).
    __device__ __forceinline__ A operator()(A S, long long i, long long j, int jj, int cols, bool partial,
                                            bool& visible, A* slope = nullptr) const {
        const RowSpan row = partial ? span(i, j - jj, cols) : RowSpan{0, i < n ? cols : 0};
        return (*this)(S, i, j, jj, row, visible, slope);
    }
    // The mods of a pair that exists (i < n, j among the block's keys), hidden or not (an index past a table is an
    // error wherever a mod is evaluated, as on the numpy backend's tiles): mask_mod joins `visible`, score_mod maps
    // the scaled score after bias to the one the softmax sees (s, in the log2 domain), its slope to *slope.
    __device__ __forceinline__ A with_mods(A score, A s, long long i, long long j, bool& visible, A* slope) const {
        if (i >= n || j >= ops.keys.end) return s;
        if constexpr (Mods::kMask)
            if (!whole) visible = Mods::template mask<A>(batch.at, i, j, *args) && visible;
        if constexpr (Mods::kScore) {
            s = Mods::template score<A>(score, batch.at, i, j, *args) * A(kLog2e);
            if (slope) *slope = Mods::template slope<A>(score, batch.at, i, j, *args);
        }
        return s;
    }
};

// ---------------------------------------------------------------------------------------------------------------
// FlashAttention's online softmax, for the rows a thread holds of a block's query tile, whatever the register
// layout of its tiles: a tile type gives its rows x columns (kRows, kCols), element (r, c), and its rows' maxima
// in the order that suits its layout; the lanes sharing a row (Lanes of a warp, consecutive, or the four of a
// quad) reduce over their columns.

// A thread's tile of R rows x C columns in rows of registers (the CUDA-core kernels': S, P, O_i).
template <typename Acc, int R, int C> struct RowTile {
    static constexpr int kRows = R, kCols = C;
    Acc x[R][C];
    __device__ __forceinline__ Acc& at(int r, int c) { return x[r][c]; }
    __device__ __forceinline__ Acc at(int r, int c) const { return x[r][c]; }
    __device__ __forceinline__ Acc row_max(int r) const {
        Acc top = x[r][0];
#pragma unroll
        for (int c = 1; c < C; ++c) top = max_(top, x[r][c]);
        return top;
    }
};

// A warp's m16 x n8 accumulator fragments of MT x NT tiles (the tensor-core kernels'): element (r, c) is row
// (mt, h) = (r / 2, r % 2), column (nt, x) = (c / 2, c % 2) of the PTX layout, register [mt][nt][2 h + x].
template <typename Acc, int MT, int NT> struct FragTile {
    static constexpr int kRows = 2 * MT, kCols = 2 * NT;
    Acc x[MT][NT][4];
    __device__ __forceinline__ Acc& at(int r, int c) { return x[r / 2][c / 2][2 * (r % 2) + c % 2]; }
    __device__ __forceinline__ Acc at(int r, int c) const { return x[r / 2][c / 2][2 * (r % 2) + c % 2]; }
    __device__ __forceinline__ Acc row_max(int r) const {  // pairs first: half the dependent steps
        Acc top = max_(at(r, 0), at(r, 1));
#pragma unroll
        for (int c = 2; c < kCols; c += 2) top = max_(top, max_(at(r, c), at(r, c + 1)));
        return top;
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int y = 0; y < 4; ++y) x[mt][nt][y] = Acc(0);
    }
};

// The running max m_i (in the log2 domain) and this thread's share of the running sum l_i (its lanes' columns; the
// Lanes lanes of a row add theirs up in finish) of R rows. Fast: P by ex2.approx (the tensor-core kernels), else
// the accurate exp2. The one rule for a row that has seen nothing: m_i starts at the lowest finite value, not -inf,
// so P of a hidden score (-inf) is exp2(-inf - m_i) = 0, never exp2(-inf + inf), and such a row keeps l_i = 0,
// which finish turns into an output of 0 and lse -inf.
template <typename Acc, int R, int Lanes, bool Fast> struct OnlineSoftmax {
    Acc m[R], l[R];

    __device__ __forceinline__ static Acc exp2(Acc x) {
        if constexpr (Fast) return exp2_fast(x);
        else return exp2_(x);
    }
    __device__ __forceinline__ void start() {
#pragma unroll
        for (int r = 0; r < R; ++r) m[r] = lowest<Acc>(), l[r] = Acc(0);
    }
    // With sinks (Mods::kSinks), a block of queries' rows start from its batch item's sink instead: a logit that
    // joins each row's sum once (its first lane's share) and carries no value. m_i starts at the sink where that
    // is above the lowest finite value, and l_i at its exp2(sink - m_i): 1, or 0 for a sink of -inf, NaN for NaN.
    template <typename P> __device__ __forceinline__ void start(const BlockOperands& ops, const P& p) {
        if constexpr (!Mods::kSinks) {
            start();
        } else {
            const Acc sink = ops.sink ? static_cast<const Acc*>(p.mods.sinks)[batch_item()] * Acc(kLog2e)
                                      : -infinity<Acc>();
            const bool first = threadIdx.x % Lanes == 0;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                m[r] = max_(lowest<Acc>(), sink);
                l[r] = !first ? Acc(0) : sink >= m[r] ? Acc(1) : exp2_(sink - m[r]);
            }
        }
    }
    // The tile's row maxima times S_scale (what takes S to the log2 domain) over each row's lanes: a row whose max
    // grew moves m_i there, its old max kept in m_old. Whether any row of the warp moved (a warp-uniform answer).
    template <typename Tile> __device__ __forceinline__ bool raise_max(const Tile& S, Acc S_scale, Acc (&m_old)[R]) {
        static_assert(Tile::kRows == R, "the tile holds the softmax's rows");
        bool any_moved = false;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const Acc m_new = lanes_max<Lanes>(S.row_max(r)) * S_scale;
            const bool moved = m_new > m[r];  // never for -inf (hidden) scores
            any_moved |= moved;
            m_old[r] = m[r];
            m[r] = moved ? m_new : m[r];
        }
        return __any_sync(0xffffffffu, any_moved);
    }
    // l_i and O_i follow m_i: rescaled by alpha = exp2(m_old - m_i), exactly 1 for the rows whose max stayed.
    template <typename Tile> __device__ __forceinline__ void rescale(const Acc (&m_old)[R], Tile& O) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const Acc alpha = exp2(m_old[r] - m[r]);
            l[r] *= alpha;
#pragma unroll
            for (int c = 0; c < Tile::kCols; ++c) O.at(r, c) *= alpha;
        }
    }
    // P = exp2(S S_scale - m_i) in place, and its row sums into l_i.
    template <typename Tile> __device__ __forceinline__ void exponentiate(Tile& S, Acc S_scale) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int c = 0; c < Tile::kCols; ++c) {
                const Acc p = exp2(fma_(S.at(r, c), S_scale, -m[r]));
                S.at(r, c) = p;
                l[r] += p;
            }
    }
    // Row r's result: 1 / l_i to normalize O_i by (0 for a row that saw no key) and its lse = ln(sum of exp) =
    // (m_i + log2 l_i) ln 2 (-inf for a row that saw no key).
    struct Row { Acc inv_l, lse; };
    __device__ __forceinline__ Row finish(int r) const {
        const Acc total = lanes_sum<Lanes>(l[r]);
        if (total == Acc(0)) return {Acc(0), -infinity<Acc>()};
        return {Acc(1) / total, (m[r] + log2_(total)) * Acc(kLn2)};
    }
};

// ---------------------------------------------------------------------------------------------------------------
// The order of a block's sweep

__device__ __forceinline__ long long floor_div(long long a, long long b) {  // b > 0
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The tiles of B of the swept range [swept.begin, swept.end) that hold B elements each, all of them seen by every
// row of [i0, i0 + rows) by the window, as [lo, hi) (tile t from swept.begin + t B). Rows and tiles are along
// either axis: query rows against key tiles (offset = m - n), or key rows against query tiles (the transposed
// window: offset n - m, left and right swapped).
struct TileRange { int lo, hi; };
__device__ __forceinline__ TileRange seen_whole(Range swept, int B, long long i0, int rows, long long offset,
                                                long long left, long long right) {
    const long long begin = swept.begin, full = (swept.end - begin) / B;
    // tile_fully_visible: j0 >= i1 - 1 + offset - left (from lo on) and j0 + B - 1 <= i0 + offset + right (up to hi)
    const long long lo = max_ll(0, -floor_div(begin - (i0 + rows - 1 + offset - left), B));
    const long long hi = min_ll(full, floor_div(i0 + offset + right - (B - 1) - begin, B) + 1);
    return hi > lo ? TileRange{(int)lo, (int)hi} : TileRange{0, 0};
}

// The plain tiles of a block's sweep, [lo, hi): all of their elements seen by every row of the block (by the
// window), with neither mask nor bias. They run the steady state, which skips per-element visibility
// (Scores::partial is false for each of them, and they carry no bias); the range is worked out once per block, so
// no tile computes its own. A block of Br queries sweeps tiles of Bc keys; a block of Bc keys (KeysOwn) sweeps tiles
// of Br queries, through the window transposed, and has plain tiles only when all Bc of its keys exist. Empty when
// `allowed` is false.
template <int Br, int Bc, bool KeysOwn>
__device__ __forceinline__ TileRange plain_tiles(const BlockOperands& ops, long long left, long long right,
                                                 bool allowed) {
    if (!kPlainTiles || !allowed || ops.has_mask || ops.has_bias) return {0, 0};
    if constexpr (!KeysOwn) return seen_whole(ops.keys, Bc, ops.queries.begin, ops.queries.size(), ops.offset, left,
                                              right);
    if (ops.keys.size() < Bc) return {0, 0};
    return seen_whole(ops.queries, Br, ops.keys.begin, Bc, -ops.offset, right, left);
}

// The tiles a block visits along its swept axis, of B from the swept range's begin: every one, visit t tile t;
// or, with a block mask (Mods::kBlocks), those it shows, in order, and whether the mask shows each whole. Worked
// out once per block (visited).
struct Visited {
    int tiles;         // visits
    const int* shown;  // kBlocks: the shown tiles' entries (mods::Visits::list) from the first in the swept range
    int base;          // kBlocks: the block mask's number of the swept range's first tile

    __device__ __forceinline__ int tile(int t) const {
        if constexpr (Mods::kBlocks) return (shown[t] >> 1) - base;
        return t;
    }
    __device__ __forceinline__ bool whole(int t) const {
        if constexpr (Mods::kBlocks) return (shown[t] & 1) != 0;
        return false;
    }
};

// The first of the n ascending entries (2 * tile + whole) at `list` whose tile is `tile` or more.
__device__ __forceinline__ int first_from(const int* list, int n, long long tile) {
    int lo = 0;
    while (n > 0) {
        const int half = n / 2;
        if ((list[lo + half] >> 1) < tile) lo += half + 1, n -= half + 1;
        else n = half;
    }
    return lo;
}

// The visits of a block that owns tile `owned` (of its own axis) and sweeps `swept` in tiles of B (swept.begin on
// a tile: on_tiles).
template <int B, typename P> __device__ __forceinline__ Visited visited(const P& p, long long owned, Range swept) {
    const int tiles = (int)((swept.end - swept.begin + B - 1) / B);
    if constexpr (!Mods::kBlocks) {
        return {tiles, nullptr, 0};
    } else {
        const mods::Visits& v = p.mods.visits;
        const auto batch = mods::BatchIndex<Mods::kBatchAxes>::of(p.mods, batch_item());
        long long entry = 0;
#pragma unroll
        for (int axis = 0; axis < Mods::kBatchAxes; ++axis) entry += batch.at[axis] * v.entry_stride[axis];
        const long long row = entry * v.owned + owned;
        const int* const list = v.list + row * v.width;
        const int count = v.count[row];
        const long long base = swept.begin / B;
        const int first = first_from(list, count, base), last = first_from(list, count, base + tiles);
        return {last - first, list + first, (int)base};
    }
}

// The order of a block's sweep over the tiles of B along its swept axis (the forward's and bwd_mma_dq's key tiles,
// bwd_mma_dkdv's query tiles): from the first plain tile on, then those before it (a window's edge); visit t is
// tile at(t). The sums over the swept tiles may take them in any order, and this one, fixed for a block, puts the
// steady visits first: plain tiles whose copies, and those of the tile Stages - 1 visits on, are whole tiles for
// each thread's chunk loaders (tiles in order from the first plain one on; `chunked`), so a loop compiled apart
// runs them without visibility, masks, biases, checks or choices of copy.
struct SweepOrder {
    int tiles, full;   // visits, and the tiles holding all B elements (the first ones)
    TileRange plain;
    int steady;        // visits of the steady loop
    bool chunk_loads;  // whether whole tiles take the chunk loaders (16-byte rows the loaders can address)
    Visited shown;     // with a block mask: the tiles it shows (the visits; no plain tiles, no chunk loaders)

    __device__ __forceinline__ static SweepOrder of(Range swept, int B, TileRange plain, bool chunk_loads,
                                                    int Stages, Visited shown) {
        const int full = (int)((swept.end - swept.begin) / B);
        if constexpr (Mods::kBlocks) return {shown.tiles, full, {0, 0}, 0, false, shown};
        const int steady = chunk_loads ? max(0, min(plain.hi, full - (Stages - 1)) - plain.lo) : 0;
        return {shown.tiles, full, plain, steady, chunk_loads, shown};
    }
    __device__ __forceinline__ bool whole(int t) const { return shown.whole(t); }
    __device__ __forceinline__ int at(int t) const {
        if constexpr (Mods::kBlocks) return shown.tile(t);
        return t < tiles - plain.lo ? plain.lo + t : t - (tiles - plain.lo);
    }
    __device__ __forceinline__ bool chunked(int tile) const {
        return chunk_loads && tile >= plain.lo && tile < full;
    }
};

// What a tensor-core block's sweep needs to know of the launch, worked out by one thread and read from shared
// memory where used (its size: SWEEP_BYTES in the tensor-core families' models): its view (BlockOperands) and the
// order of its swept tiles. Kept in registers through the steady loop, they would take those the largest tiles
// need.
struct Sweep {
    BlockOperands ops;
    SweepOrder order;
};

// The block's Sweep at `at` in shared memory: made by one thread (make() returns it) and read by every thread.
template <typename Make> __device__ __forceinline__ const Sweep& shared_sweep(unsigned char* at, Make&& make) {
    if (threadIdx.x == 0) new (at) Sweep(make());
    __syncthreads();
    return *reinterpret_cast<const Sweep*>(at);
}

// A block's dropout (kernels compiled with CUFLASH_DROPOUT) in shared memory at `at`: its DropoutRow (dropout_of,
// once per block: start), then Buffers keep tiles of Br query rows by Bc keys (KeepTile), each filled by the whole
// block for one visit and read after a barrier. With one buffer a visit fills its own before its first barrier
// (the last visit's reads are behind a barrier of that visit); with two a visit fills the next one's after its
// first barrier, while the warps read its own. bytes: cuflash/family.py's dropout_bytes.
template <int Br, int Bc, int Buffers> struct BlockDropout {
    using Tile = KeepTile<Br, Bc>;
    static constexpr size_t kHeader = align16(sizeof(DropoutRow)), kTile = align16(Tile::bytes);
    static constexpr size_t bytes = kHeader + Buffers * kTile;
    unsigned char* at;

    template <typename P> __device__ __forceinline__ void start(const P& p) const {
        if (threadIdx.x == 0) *reinterpret_cast<DropoutRow*>(at) = dropout_of(p.dropout, batch_item());
        __syncthreads();
    }
    __device__ __forceinline__ Tile tile(int buffer) const { return {at + kHeader + buffer * kTile}; }
    // Buffer `buffer` with the bits of query rows [i0, i0 + Br) x keys [j0, j0 + Bc).
    template <int Threads> __device__ __forceinline__ void fill(int buffer, long long i0, long long j0) const {
        tile(buffer).template fill<Threads>(*reinterpret_cast<const DropoutRow*>(at), i0, j0);
    }
};

// The output's type: T, or the accumulator's for the partial results of split keys.
template <typename T, bool Split> struct OutOf { using type = T; };
template <typename T> struct OutOf<T, true> { using type = typename AccOf<T>::type; };

}  // namespace cuflash
