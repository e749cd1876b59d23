// The backward pass on CUDA cores (FMA): FlashAttention-2's Algorithm 2 as two kernels, each the only writer of
// what it writes, so the gradients are the same bits run after run (no floating-point atomics, whose order varies).
//
//   bwd_dkdv: one block per Bc keys of a batch item. It sweeps the query tiles that see those keys, recomputes
//             P_ij = exp(S_ij - lse_i) from q, k and the forward's lse, and accumulates in registers
//             dV_j += P_ij^T dO_i and dK_j += scale dS_ij^T Q_i, where dS_ij = P_ij * (dO_i V_j^T - D_i).
//   bwd_dq:   one block per Br queries. It sweeps the key tiles they see, recomputes P_ij and dS_ij the same way,
//             accumulates dQ_i += scale dS_ij K_j, and writes dbias_ij = dS_ij when asked.
//
// D_i = rowsum(dO_i * O_i) is FlashAttention-2's preprocessing; the launch code computes it. Recomputing S and dP
// in both kernels costs two more tile products than one kernel with atomic dQ; it buys determinism.
//
// Thread layout as the forward's (forward.cuh): kLanesPerRow = 16 consecutive lanes share a row group of the
// block's own rows (queries in bwd_dq, keys in bwd_dkdv; rows ty, ty + RG, ...: the two groups of a warp hold
// adjacent rows); lane tx owns columns tx, tx + 16, ... of the swept tile and the head-dim columns of its runs
// (LaneColumns: up to 16 bytes each). Scores, dP and the block's gradients live in registers; P and dS pass
// through shared memory to be read by rows, a 16-byte chunk at a time. Hidden pairs are skipped by selection (P's
// shared tile holds hidden_p for them), so a NaN or inf in a hidden key, value or query row never reaches a
// gradient through 0 * inf.
//
// Template: T element type; Br queries and Bc keys per tile; D, E head-dimension buckets (d <= D and e <= E: the
// planner sends wider heads to the blocked path); Warps per block; Stages: 1, the swept tiles loaded when needed,
// or 2 (compute capability 8.0 and newer) with the next one's cp.async copies in flight while one is computed.
#pragma once

#include "block.cuh"

namespace cuflash {

// What the backward needs of a query row, as the launch writes it (cuflash/launch.py's row_terms): the forward's
// lse in the log2 domain (lse log2 e, and 0 for a row that saw no key, so its P = exp2(-inf - 0) = 0, never NaN)
// and D_i = rowsum(dO_i * O_i).
template <typename Acc> struct alignas(2 * sizeof(Acc)) RowTerm { Acc shift, delta; };

// Shared memory of one backward block, all dynamic: the query tile's Q and dO, the key tile's K and V (rows padded
// by 16 bytes to an odd number of 16-byte chunks, as the forward's Q and K: each is read in chunks of 16 rows by a
// tile product), P and dS over (own rows) x (swept columns) in the accumulator type (pitch 64 bytes past a multiple
// of 128, as the forward's P), and the query tile's row terms (RowTerm). KeysOwn: bwd_dkdv's layout (own rows are
// keys). Stages: buffers of the swept tiles (bwd_dq's K and V; bwd_dkdv's Q, dO and row terms), each stage's size
// a multiple of 16 bytes. cuflash/kernels/backward.py's shared-memory model mirrors this layout exactly.
template <typename T, int Br, int Bc, int D, int E, bool KeysOwn, int Stages = 1>
struct BackwardShared {
    using Acc = typename AccOf<T>::type;
    static constexpr int LDD = D + chunk_pad<T>(), LDE = E + chunk_pad<T>();
    static constexpr int Queries = Br, Keys = Bc, Rows = KeysOwn ? Bc : Br, Swept = KeysOwn ? Br : Bc;
    static constexpr int LDP = Swept + half_line_pad<Acc>(Swept);
    static constexpr int QStages = KeysOwn ? Stages : 1, KStages = KeysOwn ? 1 : Stages;
    static constexpr size_t q_offset = 0;
    static constexpr size_t do_offset = q_offset + QStages * align16(sizeof(T) * Br * LDD);
    static constexpr size_t k_offset = do_offset + QStages * align16(sizeof(T) * Br * LDE);
    static constexpr size_t v_offset = k_offset + KStages * align16(sizeof(T) * Bc * LDD);
    static constexpr size_t p_offset = v_offset + KStages * align16(sizeof(T) * Bc * LDE);
    static constexpr size_t ds_offset = p_offset + align16(sizeof(Acc) * Rows * LDP);
    static constexpr size_t rows_offset = ds_offset + align16(sizeof(Acc) * Rows * LDP);
    static constexpr size_t drop_offset = rows_offset + QStages * align16(sizeof(Acc) * 2 * Br);
    using Dropout = BlockDropout<Br, Bc, 1>;  // kernels compiled with CUFLASH_DROPOUT: one keep tile
    static constexpr size_t bytes = drop_offset + (kDropout ? Dropout::bytes : 0);
};

// The shared tiles of one backward block, by name, the swept ones (Q, dO and the row terms of bwd_dkdv; K and V of
// bwd_dq) those of pipeline stage `stage`.
template <typename T, typename Smem> struct BackwardTiles {
    using Acc = typename AccOf<T>::type;
    T *Q, *dO, *K, *V;
    Acc *P, *dS;
    RowTerm<Acc>* terms;  // the query tile's, a pair per row
    __device__ __forceinline__ BackwardTiles(unsigned char* smem, int stage = 0)
        : Q(reinterpret_cast<T*>(smem + Smem::q_offset) + q_stage(stage) * Smem::Queries * Smem::LDD),
          dO(reinterpret_cast<T*>(smem + Smem::do_offset) + q_stage(stage) * Smem::Queries * Smem::LDE),
          K(reinterpret_cast<T*>(smem + Smem::k_offset) + k_stage(stage) * Smem::Keys * Smem::LDD),
          V(reinterpret_cast<T*>(smem + Smem::v_offset) + k_stage(stage) * Smem::Keys * Smem::LDE),
          P(reinterpret_cast<Acc*>(smem + Smem::p_offset)), dS(reinterpret_cast<Acc*>(smem + Smem::ds_offset)),
          terms(reinterpret_cast<RowTerm<Acc>*>(smem + Smem::rows_offset) + q_stage(stage) * Smem::Queries) {}
    static __device__ __forceinline__ int q_stage(int stage) { return Smem::QStages > 1 ? stage : 0; }
    static __device__ __forceinline__ int k_stage(int stage) { return Smem::KStages > 1 ? stage : 0; }
};

// The row terms of query rows [i0, i0 + rows) into `dst` (Br pairs in shared memory; rows past `rows` get 0), as
// cp.async copies (Async: they land at the covering wait) or plain loads and stores. `terms`: the batch item's
// pairs, one after the other along n (the launch writes them so: launch.row_terms).
template <int Br, int Threads, bool Async, typename Acc>
__device__ __forceinline__ void load_row_terms(RowTerm<Acc>* dst, const RowTerm<Acc>* terms, long long i0, int rows) {
    for (int r = threadIdx.x; r < Br; r += Threads) {
        const bool valid = r < rows;
        const RowTerm<Acc>* from = terms + (valid ? i0 + r : 0);  // nothing is read where !valid
        if constexpr (!Async)
            dst[r] = valid ? *from : RowTerm<Acc>{};
        else if constexpr (sizeof(RowTerm<Acc>) == 8)
            ptx::cp_async_ca8(dst + r, from, valid ? 8 : 0);
        else
            ptx::cp_async_cg16(dst + r, from, valid ? 16 : 0);
    }
}

// The batch item's row terms (a kernel's `terms` operand: pairs along n, their batch offset in the geometry table).
template <typename Acc>
__device__ __forceinline__ const RowTerm<Acc>* row_terms_of(const Acc* terms, const BatchOffsets& base) {
    return reinterpret_cast<const RowTerm<Acc>*>(terms + base.of[kTerms]);
}

// P_ij and dS_ij of one (query, key) pair from its raw score S = q_i . k_j and dP = dO_i . v_j and its row's terms:
// the score step as the forward's (Scores), P = exp2(s - lse_i log2 e), and dS through score_mod by its slope.
// Returns whether the pair is visible; a hidden pair gets P = 0 and dS = 0 by selection (a NaN in its key or value
// row never enters them). plain: a full tile without bias (every pair of the block's rows visible), scaled and
// nothing else. The CUDA-core blocks call their element loop (gradients) with plain a constant at each call, so it
// is compiled once per kind of tile.
template <typename A>
__device__ __forceinline__ bool score_gradient(bool plain, A S, A dP, RowTerm<A> t, const Scores<A>& scores,
                                               long long i, long long j, int jj, int cols, bool partial, A& p,
                                               A& ds) {
    bool visible = true;
    A s = S * scores.scale_log2, slope = A(1);
    if (!plain) s = scores(S, i, j, jj, cols, partial, visible, Mods::kScore ? &slope : nullptr);
    p = visible ? exp2_(s - t.shift) : A(0);
    if constexpr (Mods::kScore) ds = visible ? p * (dP - t.delta) * slope : A(0);
    else ds = visible ? p * (dP - t.delta) : A(0);
    return visible;
}

template <int R, int C, typename Acc> __device__ __forceinline__ void zero(Acc (&x)[R][C]) {
#pragma unroll
    for (int a = 0; a < R; ++a)
#pragma unroll
        for (int c = 0; c < C; ++c) x[a][c] = Acc(0);
}

// rows x width of scale * G to dst (row and column strides): G's rows ty + RG a, its columns the lane's runs as
// weighted_rows read them from a tile of T (LaneColumns<T, C>).
template <typename T, int R, int C, int RG, typename Acc>
__device__ __forceinline__ void store_rows(Acc* dst, const Acc (&G)[R][C], Acc scale, long long row_stride,
                                           long long col_stride, int rows, long long width, int ty, int tx) {
#pragma unroll
    for (int a = 0; a < R; ++a) {
        const int r = ty + RG * a;
        if (r >= rows) continue;
#pragma unroll
        for (int c = 0; c < C; ++c) {
            const int col = LaneColumns<T, C>::column(tx, c);
            if (col < width) dst[r * row_stride + col * col_stride] = scale * G[a][c];
        }
    }
}

// One block of bwd_dq, its steps in the order they run (bwd_dq below): Q_i, dO_i and their row terms, loaded once
// (with two stages the first key tile goes out too); per key tile its K_j and V_j, S = Q_i K_j^T and
// dP = dO_i V_j^T, P and dS from the row terms (and dbias), dQ_i += dS K_j; the store of dQ_i.
// The block's view of the launch, its visits, the key and value sources and dQ_i are the kernel function's own
// locals, which the block refers to: held in the struct by value they are one object to the compiler, and the
// key-tile loop it makes keeps more address arithmetic (the SASS report's instr and span grow).
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages>
struct DqBlock {
    using Acc = typename AccOf<T>::type;
    using Smem = BackwardShared<T, Br, Bc, D, E, false, Stages>;
    using Tiles = BackwardTiles<T, Smem>;
    static constexpr int Threads = Warps * 32, TC = kLanesPerRow, RG = Threads / TC;
    static constexpr int RPT = Br / RG, CPT = Bc / TC, DPT = D / TC;  // rows, key columns, d columns per thread
    static_assert(Br % RG == 0 && Bc % TC == 0 && D % TC == 0 && E % TC == 0, "unsupported tile shape");
    static_assert(Stages == 1 || Stages == 2, "K and V in one stage, or two (the next tile's in flight)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    static_assert(Stages == 1, "cp.async (two stages) needs compute capability 8.0 or newer");
#endif
    using Grad = Acc[RPT][DPT];

    const Params<T>& p;
    unsigned char* const smem;
    const Tiles s;  // K and V: stage 0's
    const BlockOperands& ops;
    const Visited& visits;  // the key tiles it visits
    const TileSource<T>& K;
    const TileSource<T>& V;
    const long long i0;
    const int rows, tx, ty;
    Grad& dQ;

    __device__ __forceinline__ DqBlock(const Params<T>& params, unsigned char* shared, const BlockOperands& view,
                                       const Visited& tiles, const TileSource<T>& k_source,
                                       const TileSource<T>& v_source, Grad& dq)
        : p(params), smem(shared), s(smem), ops(view), visits(tiles), K(k_source), V(v_source), i0(ops.queries.begin),
          rows(ops.queries.size()), tx(threadIdx.x % TC), ty(threadIdx.x / TC), dQ(dq) {}

    // With dropout: the block's keep bits of the visit's key tile.
    __device__ __forceinline__ typename Smem::Dropout dropout() const { return {smem + Smem::drop_offset}; }

    // Q_i, dO_i and their row terms stay for the whole sweep: loaded once, here (they land by the first tile's
    // barrier). With two stages the first key tile's copies go out too.
    __device__ __forceinline__ void start() {
        load_rows<T, Br, D, Smem::LDD, Threads>(s.Q, ops.source(p.q, kQ, p.d, p.flags, kVectorQ), i0, rows);
        load_rows<T, Br, E, Smem::LDE, Threads>(s.dO, ops.source(p.dout, kDout, p.e, p.flags, kVectorDout), i0, rows);
        load_row_terms<Br, Threads, false>(s.terms, row_terms_of(p.terms, ops.base), i0, rows);
        if constexpr (Stages == 2)
            if (visits.tiles > 0) load_kv_async(key_start(0), 0);
        if constexpr (kDropout) dropout().start(p);
        zero(dQ);
    }

    // The first key of visit t's tile.
    __device__ __forceinline__ long long key_start(int t) const {
        return ops.keys.begin + (long long)visits.tile(t) * Bc;
    }

    // Two stages: the next key tile's K and V are copied (cp.async) into the other stage while this one is computed.
    __device__ __forceinline__ void load_kv_async(long long j0, int stage) const {
        const Tiles swept(smem, stage);
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        load_rows_async<T, Bc, D, Smem::LDD, Threads, true>(swept.K, K, j0, cols);
        load_rows_async<T, Bc, E, Smem::LDE, Threads, true>(swept.V, V, j0, cols);
        ptx::cp_async_commit();
    }

    // K_j and V_j of visit t (keys [j0, j0 + cols)) in shared memory for every thread: with two stages they were in
    // flight, and the next tile's go out once every thread is done with the stage they take; with one, loaded here.
    __device__ __forceinline__ void load_kv(int t, long long j0, int cols, int stage) const {
        if constexpr (Stages == 2) {
            ptx::cp_async_wait<0>();
            __syncthreads();  // K and V landed (at the first: Q, dO, the row terms too); the last tile's K, P, dS read
            if (t + 1 < visits.tiles) load_kv_async(key_start(t + 1), stage ^ 1);
        } else {
            __syncthreads();  // the previous tile's K, P and dS are read (at the first: Q, dO and the row terms landed)
            load_rows<T, Bc, D, Smem::LDD, Threads>(s.K, K, j0, cols);
            load_rows<T, Bc, E, Smem::LDE, Threads>(s.V, V, j0, cols);
            __syncthreads();
        }
    }

    // S = Q_i K_j^T and dP = dO_i V_j^T, the lane's columns of its rows, from the tiles in shared memory.
    __device__ __forceinline__ void products(Acc (&S)[RPT][CPT], Acc (&dP)[RPT][CPT], const Tiles& swept) const {
        zero(S);
        zero(dP);
        tile_product<RPT, CPT, RG, Smem::LDD, Smem::LDD>(S, s.Q, swept.K, (int)p.d, ty, tx);
        tile_product<RPT, CPT, RG, Smem::LDE, Smem::LDE>(dP, s.dO, swept.V, (int)p.e, ty, tx);
    }

    // P and dS of each pair from its row's terms (score_gradient), into shared memory to be read by rows (a hidden
    // pair's P as hidden_p), and dbias = dS where asked. plain: a full tile without bias (so without a dbias to
    // write); key_tile passes a constant, so each kind of tile is compiled apart. With dropout dP = dO_i V_j^T is
    // the gradient of the kept probabilities: times Z (1 / (1 - p) where kept, 0 where dropped) the softmax's.
    __device__ __forceinline__ void gradients(const bool plain, const Acc (&S)[RPT][CPT], const Acc (&dP)[RPT][CPT],
                                              const Scores<Acc>& scores, long long j0, int cols, bool partial) const {
#pragma unroll
        for (int a = 0; a < RPT; ++a) {
            const int r = ty + RG * a;
            const long long i = i0 + r;
            const RowTerm<Acc> t = s.terms[r];
            [[maybe_unused]] KeepBits<TC * (CPT - 1) + 1> keep;
            if constexpr (kDropout) keep = dropout().tile(0).template bits<TC * (CPT - 1) + 1>(r, tx);
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const int jj = tx + TC * c;
                Acc p_ij, ds, dp = dP[a][c];
                if constexpr (kDropout) dp *= keep[TC * c] ? Acc(p.dropout.scale) : Acc(0);
                const bool visible = score_gradient(plain, S[a][c], dp, t, scores, i, j0 + jj, jj, cols, partial,
                                                    p_ij, ds);
                s.P[r * Smem::LDP + jj] = visible ? p_ij : hidden_p<Acc>();
                s.dS[r * Smem::LDP + jj] = ds;
                if (!plain && (p.flags & kWantDbias) && r < rows && jj < cols)
                    ops.row_of(p.dbias, kDbias, i)[(j0 + jj) * ops.strides(kDbias).col] = ds;
            }
        }
    }

    // dQ_i += dS K_j, once every lane has written its P and dS: dS by rows from shared memory, hidden keys skipped
    // on partial tiles (P's hidden_p marks them).
    __device__ __forceinline__ void add_dq(const Tiles& swept, int cols, bool partial) {
        __syncthreads();
        weighted_rows<RPT, DPT, RG, Smem::LDP, Smem::LDD>(dQ, s.dS, s.P, swept.K, cols, partial, ty, tx);
    }

    // One key tile (visit t, its K_j and V_j in `stage`): S and dP, P and dS, dQ_i.
    __device__ __forceinline__ void key_tile(int t, int stage) {
        const Scores<Acc> scores = Scores<Acc>::of(ops, p, ops.queries.end, visits.whole(t));
        const long long j0 = key_start(t);
        const int cols = (int)min_ll(Bc, ops.keys.end - j0);
        const Tiles swept(smem, stage);  // this key tile's K and V
        if constexpr (kDropout) dropout().template fill<Threads>(0, i0, j0);  // read after load_kv's barrier
        load_kv(t, j0, cols, stage);
        Acc S[RPT][CPT], dP[RPT][CPT];
        products(S, dP, swept);
        const bool partial = scores.partial(i0, rows, j0, cols, Bc);
        if (!partial && !ops.has_bias)
            gradients(true, S, dP, scores, j0, cols, partial);
        else
            gradients(false, S, dP, scores, j0, cols, partial);
        add_dq(swept, cols, partial);
    }

    // dq = scale dQ_i (the sweep leaves the softmax scale out of dS).
    __device__ __forceinline__ void store() const {
        store_rows<T, RPT, DPT, RG>(ops.row_of(p.dq, kDq, i0), dQ, p.scale, ops.strides(kDq).row,
                                    ops.strides(kDq).col, rows, p.d, ty, tx);
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages = 1>
__global__ void __launch_bounds__(Warps * 32, 1) bwd_dq(const Params<T> p) {
    using Block = DqBlock<T, Br, Bc, D, E, Warps, Stages>;
    extern __shared__ __align__(16) unsigned char smem[];
    if (!in_batch(p)) return;
    const BlockOperands ops = query_block<Br, Bc, false>(p);
    const Visited visits = visited<Bc>(p, ops.queries.begin / Br, ops.keys);
    const TileSource<T> K = ops.source(p.k, kK, p.d, p.flags, kVectorK),
                        V = ops.source(p.v, kV, p.e, p.flags, kVectorV);
    typename Block::Grad dQ;
    Block block(p, smem, ops, visits, K, V, dQ);
    block.start();
    int stage = 0;  // K_j's and V_j's buffer
    for (int t = 0; t < visits.tiles; ++t, stage = Stages == 2 ? stage ^ 1 : 0) block.key_tile(t, stage);
    block.store();
}

// One block of bwd_dkdv, its steps in the order they run (bwd_dkdv below): K_j and V_j, loaded once (with two
// stages the first query tile goes out too); per query tile its Q_i, dO_i and row terms, S^T = K_j Q_i^T and
// dP^T = V_j dO_i^T, P^T and dS^T from the row terms, dV_j += P^T dO_i and dK_j += dS^T Q_i; the store of dK_j and
// dV_j. Its own rows are keys and the swept columns queries: S, dP, P and dS are transposed. As in DqBlock, the
// view, visits, swept sources and gradients are the kernel function's locals, which the block refers to.
template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages>
struct DkdvBlock {
    using Acc = typename AccOf<T>::type;
    using Smem = BackwardShared<T, Br, Bc, D, E, true, Stages>;
    using Tiles = BackwardTiles<T, Smem>;
    static constexpr int Threads = Warps * 32, TC = kLanesPerRow, RG = Threads / TC;
    static constexpr int RPT = Bc / RG, CPT = Br / TC, DPT = D / TC, EPT = E / TC;  // keys, query columns, d, e
    static_assert(Bc % RG == 0 && Br % TC == 0 && D % TC == 0 && E % TC == 0, "unsupported tile shape");
    static_assert(Stages == 1 || Stages == 2, "Q and dO in one stage, or two (the next tile's in flight)");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    static_assert(Stages == 1, "cp.async (two stages) needs compute capability 8.0 or newer");
#endif
    using DGrad = Acc[RPT][DPT];
    using EGrad = Acc[RPT][EPT];

    const Params<T>& p;
    unsigned char* const smem;
    const Tiles s;             // Q, dO and the row terms: stage 0's
    const BlockOperands& ops;  // the queries that see its keys: the swept tiles
    const Visited& visits;     // the query tiles it visits
    const TileSource<T>& Q;
    const TileSource<T>& dO;
    const RowTerm<Acc>* const terms_b;  // the batch item's row terms
    const long long j0;
    const int keys, tx, ty;
    DGrad& dK;
    EGrad& dV;

    __device__ __forceinline__ DkdvBlock(const Params<T>& params, unsigned char* shared, const BlockOperands& view,
                                         const Visited& tiles, const TileSource<T>& q_source,
                                         const TileSource<T>& do_source, DGrad& dk, EGrad& dv)
        : p(params), smem(shared), s(smem), ops(view), visits(tiles), Q(q_source), dO(do_source),
          terms_b(row_terms_of(p.terms, ops.base)), j0(ops.keys.begin), keys(ops.keys.size()), tx(threadIdx.x % TC),
          ty(threadIdx.x / TC), dK(dk), dV(dv) {}

    // With dropout: the block's keep bits of the visit's query tile by its keys.
    __device__ __forceinline__ typename Smem::Dropout dropout() const { return {smem + Smem::drop_offset}; }

    // K_j and V_j stay for the whole sweep: loaded once, here (they land by the first tile's barrier). With two
    // stages the first query tile's copies go out too.
    __device__ __forceinline__ void start() {
        load_rows<T, Bc, D, Smem::LDD, Threads>(s.K, ops.source(p.k, kK, p.d, p.flags, kVectorK), j0, keys);
        load_rows<T, Bc, E, Smem::LDE, Threads>(s.V, ops.source(p.v, kV, p.e, p.flags, kVectorV), j0, keys);
        if constexpr (Stages == 2)
            if (visits.tiles > 0) load_queries_async(query_start(0), 0);
        if constexpr (kDropout) dropout().start(p);
        zero(dK);
        zero(dV);
    }

    // The first query of visit t's tile.
    __device__ __forceinline__ long long query_start(int t) const {
        return ops.queries.begin + (long long)visits.tile(t) * Br;
    }

    // Two stages: the next query tile's Q, dO and row terms are copied (cp.async) into the other stage while this
    // one is computed.
    __device__ __forceinline__ void load_queries_async(long long i0, int stage) const {
        const Tiles swept(smem, stage);
        const int rows = (int)min_ll(Br, ops.queries.end - i0);
        load_rows_async<T, Br, D, Smem::LDD, Threads, true>(swept.Q, Q, i0, rows);
        load_rows_async<T, Br, E, Smem::LDE, Threads, true>(swept.dO, dO, i0, rows);
        load_row_terms<Br, Threads, true>(swept.terms, terms_b, i0, rows);
        ptx::cp_async_commit();
    }

    // Q_i, dO_i and the row terms of visit t (queries [i0, i0 + rows)) in shared memory for every thread: with two
    // stages they were in flight, and the next tile's go out once every thread is done with the stage they take;
    // with one, loaded here.
    __device__ __forceinline__ void load_queries(int t, long long i0, int rows, int stage) const {
        if constexpr (Stages == 2) {
            ptx::cp_async_wait<0>();
            __syncthreads();  // Q, dO landed (at the first: K and V too); the last tile's Q, dO, P, dS, row terms read
            if (t + 1 < visits.tiles) load_queries_async(query_start(t + 1), stage ^ 1);
        } else {
            __syncthreads();  // the previous tile's Q, dO, P and dS are read (at the first: K and V landed)
            load_rows<T, Br, D, Smem::LDD, Threads>(s.Q, Q, i0, rows);
            load_rows<T, Br, E, Smem::LDE, Threads>(s.dO, dO, i0, rows);
            load_row_terms<Br, Threads, false>(s.terms, terms_b, i0, rows);
            __syncthreads();
        }
    }

    // S^T = K_j Q_i^T and dP^T = V_j dO_i^T (keys by row, queries by column), the lane's columns of its rows.
    __device__ __forceinline__ void products(Acc (&S)[RPT][CPT], Acc (&dP)[RPT][CPT], const Tiles& swept) const {
        zero(S);
        zero(dP);
        tile_product<RPT, CPT, RG, Smem::LDD, Smem::LDD>(S, s.K, swept.Q, (int)p.d, ty, tx);
        tile_product<RPT, CPT, RG, Smem::LDE, Smem::LDE>(dP, s.V, swept.dO, (int)p.e, ty, tx);
    }

    // P^T and dS^T of each pair from its query's terms (score_gradient), into shared memory to be read by rows (a
    // hidden pair's P as hidden_p). plain: a full tile (every query of it too) without bias; query_tile passes a
    // constant, so each kind of tile is compiled apart. With dropout, dV takes P Z and dS dP Z (Z: 1 / (1 - p)
    // where kept, 0 where dropped; a key's bits are its column in its query's row of the keep tile).
    __device__ __forceinline__ void gradients(const bool plain, const Acc (&S)[RPT][CPT], const Acc (&dP)[RPT][CPT],
                                              const Tiles& swept, const Scores<Acc>& scores, long long i0,
                                              bool partial) const {
        [[maybe_unused]] KeepBits<RG * (RPT - 1) + 1> keep[CPT];
        if constexpr (kDropout)
#pragma unroll
            for (int c = 0; c < CPT; ++c)
                keep[c] = dropout().tile(0).template bits<RG * (RPT - 1) + 1>(tx + TC * c, ty);
#pragma unroll
        for (int a = 0; a < RPT; ++a) {
            const int r = ty + RG * a;
#pragma unroll
            for (int c = 0; c < CPT; ++c) {
                const int ii = tx + TC * c;
                Acc p_ij, ds, dp = dP[a][c], z = Acc(1);
                if constexpr (kDropout) {
                    z = keep[c][RG * a] ? Acc(p.dropout.scale) : Acc(0);
                    dp *= z;
                }
                const bool visible = score_gradient(plain, S[a][c], dp, swept.terms[ii], scores, i0 + ii, j0 + r, r,
                                                    keys, partial, p_ij, ds);
                if constexpr (kDropout) p_ij *= z;
                s.P[r * Smem::LDP + ii] = visible ? p_ij : hidden_p<Acc>();
                s.dS[r * Smem::LDP + ii] = ds;
            }
        }
    }

    // dV_j += P^T dO_i and dK_j += dS^T Q_i, once every lane has written its P and dS: both by rows from shared
    // memory, hidden queries skipped on partial tiles (P's hidden_p marks them).
    __device__ __forceinline__ void add_dv_dk(const Tiles& swept, int rows, bool partial) {
        __syncthreads();
        weighted_rows<RPT, EPT, RG, Smem::LDP, Smem::LDE>(dV, s.P, s.P, swept.dO, rows, partial, ty, tx);
        weighted_rows<RPT, DPT, RG, Smem::LDP, Smem::LDD>(dK, s.dS, s.P, swept.Q, rows, partial, ty, tx);
    }

    // One query tile (visit t, its Q_i, dO_i and row terms in `stage`): S^T and dP^T, P^T and dS^T, dV_j and dK_j.
    __device__ __forceinline__ void query_tile(int t, int stage) {
        // Rows past the last swept tile (i >= ops.queries.end) count as rows past n: hidden, whatever the tile.
        const Scores<Acc> scores = Scores<Acc>::of(ops, p, ops.queries.end, visits.whole(t));
        const long long i0 = query_start(t);
        const int rows = (int)min_ll(Br, ops.queries.end - i0);
        const Tiles swept(smem, stage);  // this query tile's Q, dO and row terms
        if constexpr (kDropout) dropout().template fill<Threads>(0, i0, j0);  // read after load_queries' barrier
        load_queries(t, i0, rows, stage);
        Acc S[RPT][CPT], dP[RPT][CPT];
        products(S, dP, swept);
        const bool partial = scores.partial(i0, rows, j0, keys, Bc);
        if (!partial && !ops.has_bias && rows == Br)
            gradients(true, S, dP, swept, scores, i0, partial);
        else
            gradients(false, S, dP, swept, scores, i0, partial);
        add_dv_dk(swept, rows, partial);
    }

    // dk = scale dK_j (the sweep leaves the softmax scale out of dS), dv = dV_j.
    __device__ __forceinline__ void store() const {
        store_rows<T, RPT, DPT, RG>(ops.row_of(p.dk, kDk, j0), dK, p.scale, ops.strides(kDk).row,
                                    ops.strides(kDk).col, keys, p.d, ty, tx);
        store_rows<T, RPT, EPT, RG>(ops.row_of(p.dv, kDv, j0), dV, Acc(1), ops.strides(kDv).row,
                                    ops.strides(kDv).col, keys, p.e, ty, tx);
    }
};

template <typename T, int Br, int Bc, int D, int E, int Warps, int Stages = 1>
__global__ void __launch_bounds__(Warps * 32, 1) bwd_dkdv(const Params<T> p) {
    using Block = DkdvBlock<T, Br, Bc, D, E, Warps, Stages>;
    extern __shared__ __align__(16) unsigned char smem[];
    if (!in_batch(p)) return;
    const BlockOperands ops = key_block<Bc, Br>(p);
    const Visited visits = visited<Br>(p, ops.keys.begin / Bc, ops.queries);
    const TileSource<T> Q = ops.source(p.q, kQ, p.d, p.flags, kVectorQ),
                        dO = ops.source(p.dout, kDout, p.e, p.flags, kVectorDout);
    typename Block::DGrad dK;
    typename Block::EGrad dV;
    Block block(p, smem, ops, visits, Q, dO, dK, dV);
    block.start();
    int stage = 0;  // Q_i's, dO_i's and the row terms' buffer
    for (int t = 0; t < visits.tiles; ++t, stage = Stages == 2 ? stage ^ 1 : 0) block.query_tile(t, stage);
    block.store();
}

}  // namespace cuflash
