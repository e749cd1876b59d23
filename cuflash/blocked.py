"""The blocked algorithm on an array library's matmul: the seed's tiled online softmax, vectorized over batch
items and query rows (the numpy backend), and FlashAttention-2's blocked backward (the numpy backend's, and the
GPU backends' where their kernels do not serve a problem: written in the arrays' module, problem.xp).

Each step holds a row tile of R query rows (from one or more batch items) and a key tile of Bc keys; the scores
of that tile are the largest thing it allocates, so the working set is bounded by WORKING_SET_BYTES whatever
n * m is. Broadcast operands stay stride-0 views: tiles are sliced from them, never copied whole.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import blockmask, mods, workers
from .problem import Packed
from .tiling import block_pair

WORKING_SET_BYTES = 64 * 2**20  # bound on the temporaries of one tile step
DEFAULT_BC = 512  # keys per tile: large enough that matmul, not Python, dominates
TEMPS_PER_SCORE = 4  # score-sized temporaries alive at once: S, P, the visibility and a where() result
BACKWARD_TEMPS_PER_SCORE = 6  # the backward's: S, P, dO V^T, dS, the visibility and a where() result
# The backward's tiles (without block= or a block mask): Br query rows (of one or more batch items) by Bc keys,
# small enough that a tile's few temporaries stay in a core's cache, large enough that matmul, not Python, dominates.
BACKWARD_BR, BACKWARD_BC = 256, 512


class Patterns:
    """What one run evaluates of the problem's mods: each bound to its tables (mods.Bound), or None."""

    def __init__(self, problem):
        acc, xp = problem.acc_dtype, problem.xp
        self.score_mod = None if problem.score_mod is None else mods.Bound(problem.score_mod, xp, acc)
        self.mask_mod = None if problem.mask_mod is None else mods.Bound(problem.mask_mod, xp, acc)

    @property
    def any(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None


def run(problem, out, lse, block=None):
    if packed_sequences(problem):
        for sub, (out_s, lse_s) in sequences(problem, ((out, "q"), (lse, "q"))):
            run(sub, out_s, lse_s, block)
        return
    if problem.paged is not None:
        for b, sub in paged_sequences(problem):
            run(sub, out[b:b + 1], None if lse is None else lse[b:b + 1], block)
        return
    patterns = Patterns(problem)
    for index, i0, i1, key_tiles in steps(problem, block):
        o, row_lse = attend_rows(problem, patterns, index, i0, i1, key_tiles)
        out[index + (slice(i0, i1),)] = o.astype(problem.dtype, copy=False)
        if lse is not None:
            lse[index + (slice(i0, i1),)] = row_lse


def packed_sequences(problem) -> bool:
    return problem.packed is not None and problem.packed.cu_seqlens_q is not None


def sequences(problem, arrays):
    """Packed sequences one at a time: (the problem of sequence s alone, its rows of `arrays`, (batched view,
    "q" or "k") pairs) for every sequence with queries."""
    packed = problem.packed
    offsets_q, offsets_k = packed.offsets()
    for s in range(len(offsets_q) - 1):
        rows = {"q": offsets_q[s:s + 2], "k": offsets_k[s:s + 2]}
        if rows["q"][0] == rows["q"][1]:
            continue

        def view(x, side):
            return packed.sequence(x, side, *rows[side])
        sub = dataclasses.replace(
            problem, q=view(problem.q, "q"), k=view(problem.k, "k"), v=view(problem.v, "k"),
            batch=(1,) + problem.batch[1:], n=rows["q"][1] - rows["q"][0], m=rows["k"][1] - rows["k"][0],
            sinks=None if problem.sinks is None else problem.sinks[s:s + 1], packed=packed.one(s))
        yield sub, [view(x, side) for x, side in arrays]


def paged_sequences(problem):
    """Paged keys and values one sequence at a time: (b, the problem of sequence b alone, its keys and values
    gathered from their pages; memory: one sequence's keys, never n x m)."""
    paged, xp = problem.paged, problem.xp
    for b, m in enumerate(paged.key_counts()):
        shape = (1,) + problem.batch[1:]

        def gathered(cache):
            rows = paged.keys(cache, paged.block_table[b], m, xp)
            return xp.broadcast_to(rows, shape + tuple(rows.shape[3:]))
        yield b, dataclasses.replace(
            problem, q=problem.q[b:b + 1], k=gathered(paged.k_cache), v=gathered(paged.v_cache), batch=shape, m=m,
            sinks=None if problem.sinks is None else problem.sinks[b:b + 1], packed=Packed(None, None, 0, 0, b),
            paged=None)


def steps(problem, block, temps=TEMPS_PER_SCORE, sizes=None):
    """Yield (batch index, i0, i1, key tiles) for every step: rows [i0, i1) of the batch items the index selects,
    against key tiles (j0, j1, whole), whole meaning the block mask shows every element (no mask_mod to
    evaluate). Without a block mask: the row tiles of row_tiles against every key tile of their window. With one:
    its row tiles (of all the batch items that share its entry, in groups that keep the working set) against the
    tiles it shows within the window. sizes: (rows per step, keys per tile) instead of tile_sizes'."""
    rows_per_step, bc = tile_sizes(problem, block, temps) if sizes is None else sizes
    if problem.block_mask is None:
        # A causal or windowed problem's row tiles are no taller than a key tile: the key tiles its window hides
        # are skipped, and few tiles straddle its edge.
        item_rows = min(rows_per_step, bc) if problem.window.bounded else rows_per_step
        for index, i0, i1 in row_tiles(problem.batch, problem.n, rows_per_step, item_rows):
            j_start, j_stop = problem.key_range(i0, i1)
            yield index, i0, i1, [(j0, min(j_stop, j0 + bc), False) for j0 in range(j_start, j_stop, bc)]
        return
    mask = problem.block_mask if block is None else problem.block_mask.retile(*check_block(block))
    br, bc = mask.block
    for entry, shared in blockmask.entries(mask, problem.batch):
        for index in split_index(shared, problem.batch, max(1, rows_per_step // br)):
            for t in range(-(-problem.n // br)):
                i0, i1 = t * br, min(problem.n, (t + 1) * br)
                j_start, j_stop = problem.key_range(i0, i1)
                tiles = [(max(j_start, c * bc), min(j_stop, (c + 1) * bc), whole)
                         for c, whole in mask.key_tiles(entry, t)]
                yield index, i0, i1, runs([tile for tile in tiles if tile[0] < tile[1]], max(bc, DEFAULT_BC))


def runs(tiles, width):
    """Adjacent key tiles of one kind (whole or partial) joined into steps of up to `width` keys: fewer, larger
    matmuls, and still no mask evaluated on a whole tile."""
    joined: list = []
    for j0, j1, whole in tiles:
        if joined and joined[-1][1] == j0 and joined[-1][2] == whole and j1 - joined[-1][0] <= width:
            joined[-1] = (joined[-1][0], j1, whole)
        else:
            joined.append((j0, j1, whole))
    return joined


def split_index(index, batch, items):
    """index with its slices (whole shared axes) turned into ints from the left until it selects at most `items`
    batch items (at least one axis at a time)."""
    sliced = [axis for axis, x in enumerate(index) if isinstance(x, slice)]
    while sliced and math.prod(batch[a] for a in sliced) > items:
        sliced.pop(0)
    fixed = [axis for axis, x in enumerate(index) if isinstance(x, slice) and axis not in sliced]
    for values in np.ndindex(*(batch[a] for a in fixed)):
        chosen = list(index)
        for axis, value in zip(fixed, values):
            chosen[axis] = value
        yield tuple(chosen)


def tile_sizes(problem, block, temps=TEMPS_PER_SCORE):
    """(query rows per step, counting all batch items of the step; keys per tile), for `temps` score-sized
    temporaries alive at once (with a block mask: its key tile)."""
    if block is not None:
        br, bc = check_block(block)
        return br, bc
    bc = max(1, min(DEFAULT_BC, problem.m)) if problem.block_mask is None else problem.block_mask.block[1]
    score_bytes = temps * problem.acc_dtype.itemsize * bc
    row_bytes = score_bytes + 3 * problem.acc_dtype.itemsize * (problem.d + problem.e)
    return max(1, WORKING_SET_BYTES // row_bytes), bc


def check_block(block):
    """(Br, Bc) from a pair or a BlockConfig (whose warps, stages and variant mean nothing here)."""
    if hasattr(block, "Br") and hasattr(block, "Bc"):
        return block.Br, block.Bc
    return block_pair(block)


def row_tiles(batch, n, rows_per_step, item_rows=None):
    """Yield (batch index, i0, i1), the index a tuple of one int or slice per batch dim: whole trailing batch
    dims and a slice of one more, so that (items selected) * (i1 - i0) <= rows_per_step whenever a single row
    of one item allows it. Items of more than item_rows rows (default rows_per_step) are tiled one by one."""
    item_rows = rows_per_step if item_rows is None else item_rows
    if n > item_rows or n >= rows_per_step or not batch:
        step = min(n, item_rows)
        for index in np.ndindex(*batch):
            for i0 in range(0, n, step):
                yield index, i0, min(n, i0 + step)
        return
    items = max(1, rows_per_step // n)
    split = len(batch)  # batch dims from `split` on are taken whole
    while split > 0 and math.prod(batch[split - 1:]) <= items:
        split -= 1
    whole = (slice(None),) * (len(batch) - split)
    if split == 0:
        yield whole, 0, n
        return
    chunk = max(1, items // math.prod(batch[split:]))
    for outer in np.ndindex(*batch[:split - 1]):
        for b0 in range(0, batch[split - 1], chunk):
            yield outer + (slice(b0, min(batch[split - 1], b0 + chunk)),) + whole, 0, n


def attend_rows(problem, patterns, index, i0, i1, key_tiles):
    """Online softmax over the key tiles (steps) for query rows [i0, i1) of the batch items selected by index.

    Returns O_i / l_i in acc dtype and the rows' lse."""
    xp, acc = problem.xp, problem.acc_dtype
    rows = index + (slice(i0, i1),)
    q_i = problem.q[rows].astype(acc)  # a copy: scaled in place, so the scores need no pass of their own
    q_i *= acc.type(problem.scale)
    shape = q_i.shape[:-1]
    m_i, l_i = softmax_start(problem, index, shape)
    o_i = xp.zeros(shape + (problem.e,), dtype=acc)  # unnormalized output
    for j0, j1, whole in key_tiles:
        s_ij, visible, _ = tile_scores(problem, patterns, index, q_i, i0, i1, j0, j1, whole, keep_raw=False)
        m_i, l_i, o_i = online_softmax_update(problem, index, m_i, l_i, o_i, s_ij, visible, (i0, i1, j0, j1))
    nothing_visible = l_i == 0  # fully masked rows give 0 and lse -inf; NaN rows stay NaN
    with np.errstate(divide="ignore", invalid="ignore"):
        o = xp.where(nothing_visible[..., None], 0, o_i / l_i[..., None])
        row_lse = xp.where(nothing_visible, -np.inf, m_i + xp.log(l_i))
    return o, row_lse.astype(acc, copy=False)


def softmax_start(problem, index, shape):
    """The running max m_i and sum l_i of rows of `shape` before any key: -inf and 0, or with sinks= the sink's
    logit and 1 (its own exp(sink - m_i)), so it joins every row's denominator."""
    xp, acc = problem.xp, problem.acc_dtype
    if problem.sinks is None:
        return xp.full(shape, -np.inf, dtype=acc), xp.zeros(shape, dtype=acc)
    m_i = xp.broadcast_to(problem.sinks[index][..., None], shape).astype(acc)
    return m_i, xp.where(m_i == -np.inf, 0, 1).astype(acc)


def index_grids(problem, index, i0, i1, j0, j1):
    """The mods' arguments on one tile: one int64 array per batch axis (its int, or its slice's indices on the axis
    the slice keeps), the query rows and the keys, all broadcastable to the tile's scores."""
    xp = problem.xp
    kept = sum(isinstance(x, slice) for x in index)
    grids, axis = [], 0
    first = 0 if problem.packed is None else problem.packed.first  # a packed sequence's number
    for x, size in zip(index, problem.batch):
        if isinstance(x, slice):
            shape = [1] * (kept + 2)
            shape[axis] = -1
            grids.append(xp.arange(size, dtype=np.int64)[x].reshape(shape) + (first if not grids else 0))
            axis += 1
        else:
            grids.append(xp.asarray(x + (first if not grids else 0), dtype=np.int64))
    return grids + [xp.arange(i0, i1, dtype=np.int64)[:, None], xp.arange(j0, j1, dtype=np.int64)[None, :]]


def tile_scores(problem, patterns, index, q_i, i0, i1, j0, j1, whole=False, keep_raw=True, k_j=None):
    """S_ij = (scale * q_i) @ k_j.T + bias, then score_mod, with hidden keys set to -inf by selection; the
    visibility (None when every key of the tile is visible); and the scores before score_mod (None without one:
    the backward's derivative reads them). A -inf bias hides its key as the mask does, so a NaN in that key's
    scores or values never counts. whole: the block mask shows the whole tile, so its pattern (mask_mod, or the
    mask it was made from) is not evaluated. keep_raw=False (the forward): score_mod may overwrite the scores, and
    no raw scores come back. k_j: the tile's keys in the accumulation type, when the caller has them (default:
    sliced from problem.k). In the arrays' own module (the cupy backend's
    backward uses it too)."""
    xp, acc = problem.xp, problem.acc_dtype
    if k_j is None:
        k_j = problem.k[index + (slice(j0, j1),)].astype(acc, copy=False)
    s_ij = xp.matmul(q_i, xp.swapaxes(k_j, -1, -2))
    tile = index + (slice(i0, i1), slice(j0, j1))
    visible = None
    if not problem.tile_fully_visible(i0, i1, j0, j1):
        visible = problem.window_tile(i0, i1, j0, j1)
    if problem.mask is not None and not (whole and problem.mask_is_block_masks):
        visible = problem.mask[tile] if visible is None else problem.mask[tile] & visible
    if problem.bias is not None:
        bias = problem.bias[tile]  # in the accumulation type already
        s_ij += bias
        if problem.bias_hides:
            shown = bias != -np.inf
            visible = shown if visible is None else visible & shown
    raw = None
    if patterns.any:
        grids = index_grids(problem, index, i0, i1, j0, j1)
        if patterns.mask_mod is not None and not whole:
            shown = xp.broadcast_to(patterns.mask_mod(grids), s_ij.shape)
            visible = shown if visible is None else visible & shown
        if patterns.score_mod is not None:
            modded = patterns.score_mod(grids, s_ij, consume_score=not keep_raw)
            if keep_raw:
                raw = s_ij
            if modded is raw or np.shape(modded) != s_ij.shape or modded.dtype != acc:
                modded = xp.broadcast_to(modded, s_ij.shape).astype(acc)  # a copy the softmax may overwrite
            s_ij = modded
    if visible is not None:
        s_ij = xp.where(visible, s_ij, -np.inf)
    return s_ij, visible, raw


def online_softmax_update(problem, index, m_i, l_i, o_i, s_ij, visible, tile):
    """The seed's update: new running max, rescale the old sum and output, add this tile's share (tile: rows and
    keys, (i0, i1, j0, j1)). With dropout, the sum takes every probability and the output only the kept ones,
    scaled."""
    xp = problem.xp
    m_new = xp.maximum(m_i, s_ij.max(axis=-1))
    m_safe = xp.where(m_new == -np.inf, 0, m_new)  # rows with nothing visible yet: exp(-inf - 0) = 0
    p_ij = exp_shifted(s_ij, m_safe[..., None], xp)  # S_ij is not needed again: P_ij takes its memory
    alpha = xp.exp(m_i - m_safe)
    l_new = alpha * l_i + p_ij.sum(axis=-1)
    if problem.dropout is not None:
        p_ij *= dropout_factor(problem, index, *tile)
    j0, j1 = tile[2:]
    v_j = problem.v[index + (slice(j0, j1),)].astype(problem.acc_dtype, copy=False)
    o_new = alpha[..., None] * o_i + weighted_values(p_ij, v_j, visible, xp)
    return m_new, l_new, o_new


def dropout_factor(problem, index, i0, i1, j0, j1):
    """What dropout multiplies a tile's probabilities by: 1 / (1 - p) where the element is kept, 0 where dropped
    (cuflash.dropout: the same elements every backend keeps)."""
    xp, dropout = problem.xp, problem.dropout
    b = dropout.batch_index(index_grids(problem, index, i0, i1, j0, j1)[:len(problem.batch)], xp)
    keeps = dropout.tile_keeps(b[..., None, None] if b.ndim == 0 else b, i0, i1, j0, j1, xp)
    return xp.where(keeps, problem.acc_dtype.type(dropout.scale), problem.acc_dtype.type(0))


def exp_shifted(s, shift, xp=np):
    """exp(s - shift) in place of s (shift broadcast along the last axis): the softmax's numerator, with no
    score-sized temporary."""
    s -= shift
    return xp.exp(s, out=s)


def score_gradient_in_place(dp, p, delta):
    """dS = P * (dP - D) in place of dP (D broadcast along the last axis)."""
    with np.errstate(invalid="ignore"):
        dp -= delta
        dp *= p
    return dp


def weighted_values(p_ij, v_j, visible, xp=np, all_finite=None):
    """P_ij @ V_j where hidden keys are removed by selection: a NaN or inf in a hidden value row must not
    reach the output through 0 * inf. Finite tiles (the common case) take the plain matmul. The backward uses it
    for every product over a tile's keys or rows (visible then pairs the contraction index with the rows);
    all_finite: whether v_j is known to be all finite (None: look)."""
    if visible is None or all_finite:
        return xp.matmul(p_ij, v_j)
    finite = xp.isfinite(v_j)
    if bool(finite.all()):
        return xp.matmul(p_ij, v_j)
    result = xp.matmul(p_ij, xp.where(finite, v_j, 0))
    # Add back the non-finite entries, only for the rows that see them.
    bad_keys = xp.nonzero(~finite.all(axis=tuple(range(v_j.ndim - 2)) + (-1,)))[0].tolist()
    for j in bad_keys:
        v_bad = xp.where(finite[..., j, :], 0, v_j[..., j, :])  # (..., e): only the non-finite entries
        with np.errstate(invalid="ignore"):  # 0 * inf in hidden rows: selected away just below
            contribution = p_ij[..., :, j, None] * v_bad[..., None, :]  # (..., rows, e)
        result += xp.where(visible[..., :, j, None], contribution, 0)
    return result


# ----------------------------------------------------------------------------------------------------------------
# The backward pass


def run_backward(problem, dout, out, lse, grads, block=None, threads=None):
    """FlashAttention-2's backward over the forward's tiles: per tile, P_ij = exp(S_ij - lse_i) is recomputed from
    q, k and the saved lse (never stored), and

        dV_j += P_ij^T dO_i,   dS_ij = P_ij * (dO_i V_j^T - D_i),   dQ_i += scale dS_ij K_j,   dK_j += scale dS_ij^T Q_i

    with D_i = rowsum(dO_i * O_i) (FlashAttention-2's preprocessing). grads = (dq, dk, dv, dbias or None): arrays
    over the whole batch in the accumulator type, zeroed, accumulated here in a fixed order (deterministic);
    dbias_ij = dS_ij. Hidden pairs contribute nothing, by selection. Written in the arrays' module (problem.xp),
    so the cupy backend runs the same blocked code on CuPy's matmul. Any further grads are those of score_mod's
    tables problem.score_mod_grads names (table_gradients).

    The steps of one selection of batch items (all their row tiles) are one piece of work, split further into
    ranges of keys where the pieces are few (key_ranges); pieces write disjoint gradients (a range's dQ is summed
    apart and added in a fixed order), so on NumPy arrays they run on worker threads (cuflash.workers; threads:
    how many, default its count()), with the same bits as on one thread. Gradients of score_mod's tables, which
    every piece adds to, keep everything on the calling thread."""
    if packed_sequences(problem):
        views = ((dout, "q"), (out, "q"), (lse, "q"), (grads[0], "q"), (grads[1], "k"), (grads[2], "k"))
        for sub, (dout_s, out_s, lse_s, *grads_s) in sequences(problem, views):
            run_backward(sub, dout_s, out_s, lse_s, tuple(grads_s) + (None,), block, threads)
        return
    dq = grads[0]
    dtables = dict(zip(problem.score_mod_grads, grads[4:]))
    patterns = Patterns(problem)
    pieces = workers.consecutive_groups(list(backward_steps(problem, block)), key=lambda step: step[0])
    if problem.xp is not np or dtables:
        threads = 1
    ranges = key_ranges(problem, block, len(pieces), dtables)
    # dQ of a piece's key range after the first: summed apart, added to dq in the ranges' order once all are done.
    dq_parts = [[None] + [problem.xp.zeros_like(dq[piece[0][0]]) for _ in ranges[1:]] for piece in pieces]

    def work(unit):
        p, r = unit
        k0, k1 = ranges[r]
        for index, i0, i1, key_tiles in pieces[p]:
            tiles = [(max(j0, k0), min(j1, k1), whole) for j0, j1, whole in key_tiles if j0 < k1 and j1 > k0]
            if not tiles:
                continue
            dq_i = backward_rows(problem, patterns, dout, out, lse, grads[:4], dtables, index, i0, i1, tiles)
            if r == 0:
                dq[index + (slice(i0, i1),)] += dq_i
            else:
                dq_parts[p][r][..., i0:i1, :] += dq_i  # the part is dq[index]: its rows, then the head dim
    workers.run_all(work, [(p, r) for p in range(len(pieces)) for r in range(len(ranges))], threads)
    for piece, parts in zip(pieces, dq_parts):
        for part in parts[1:]:
            dq[piece[0][0]] += part


KEY_SPLIT_PIECES = 4  # fewer pieces of batch items than this: each also split into ranges of its keys


def key_ranges(problem, block, pieces, dtables):
    """The ranges of keys [k0, k1) each piece of batch items is split into: one (every key) unless the problem has
    fewer than KEY_SPLIT_PIECES pieces (one head, say) and keys for more than one tile; then enough ranges, on
    BACKWARD_BC boundaries, that pieces times ranges reach KEY_SPLIT_PIECES. Each (piece, range) owns its keys' dk
    and dv, and sums its dQ apart (a piece's dq once more in memory per further range): a rule of the problem
    alone, not of the threads, so the bits are the same on any number of them."""
    every = [(0, problem.m)]
    if (problem.xp is not np or dtables or block is not None or problem.block_mask is not None or pieces == 0
            or pieces >= KEY_SPLIT_PIECES):
        return every
    tiles = -(-problem.m // BACKWARD_BC)
    count = min(tiles, -(-KEY_SPLIT_PIECES // pieces))
    if count <= 1:
        return every
    width = -(-tiles // count) * BACKWARD_BC
    return [(k0, min(problem.m, k0 + width)) for k0 in range(0, problem.m, width)]


def backward_steps(problem, block):
    """The backward's steps (as steps()): without block= or a block mask, tiles of BACKWARD_BR x BACKWARD_BC
    scores (rows of several batch items where n is smaller; square where a window bounds the rows, so the tiles it
    hides are skipped), each step's temporaries small enough to stay in a core's cache."""
    if block is not None or problem.block_mask is not None:
        return steps(problem, block, BACKWARD_TEMPS_PER_SCORE)
    bc = max(1, min(BACKWARD_BC, problem.m))
    return steps(problem, None, sizes=(max(1, BACKWARD_BR * BACKWARD_BC // bc), bc))


def augmented(x, column, xp):
    """[x, column]: x with one more element on its last axis (column broadcast to x's other axes), contiguous. A
    product of two augmented operands adds the product of their last columns: a per-row term joins the matmul
    instead of taking a pass over the scores."""
    result = xp.empty(x.shape[:-1] + (x.shape[-1] + 1,), dtype=x.dtype)
    result[..., :-1] = x
    result[..., -1] = column
    return result


def backward_rows(problem, patterns, dout, out, lse, grads, dtables, index, i0, i1, key_tiles):
    """One step of the backward: rows [i0, i1) of the batch items `index` selects against their key tiles,
    adding to dk, dv (and writing dbias) of those keys; returns those rows' dQ over those tiles (grads[0] is not
    touched).

    Without dropout (which scales dO V^T before D is taken off), D_i rides in dP's matmul as
    [dO_i, -D_i] [V_j, 1]^T: one pass over the scores fewer. (The shift by lse_i does not ride in the scores' matmul
    the same way: P_ij must be recomputed with the forward's own rounding of S_ij, or rows of large scores lose
    their sum of 1.)"""
    _, dk, dv, dbias = grads
    xp, acc = problem.xp, problem.acc_dtype
    scale = acc.type(problem.scale)
    rows = index + (slice(i0, i1),)
    q_i = problem.q[rows].astype(acc)
    do_i = dout[rows].astype(acc)
    lse_i = lse[rows].astype(acc)
    shift = xp.where(lse_i == -np.inf, 0, lse_i)  # a row that sees nothing: P = exp(-inf) = 0
    with np.errstate(invalid="ignore"):
        delta = problem.delta(do_i, out[rows])
    scaled_q_i = q_i * scale
    fold_delta = problem.dropout is None
    do_op = augmented(do_i, -delta, xp) if fold_delta else do_i
    # Whether dO_i and Q_i are finite, asked once for all their key tiles (the products skip the test).
    do_finite, q_finite = (bool(xp.isfinite(x).all()) for x in (do_i, scaled_q_i))
    dq_i = xp.zeros(q_i.shape, dtype=acc)  # sum over the key tiles of dS_ij K_j; scaled once at the end
    for j0, j1, whole in key_tiles:
        keys = index + (slice(j0, j1),)
        k_j = problem.k[keys].astype(acc, copy=False)
        s_ij, visible, raw = tile_scores(problem, patterns, index, scaled_q_i, i0, i1, j0, j1, whole, k_j=k_j)
        p_ij = exp_shifted(s_ij, shift[..., None], xp)  # S_ij is not needed again
        kept = None if problem.dropout is None else dropout_factor(problem, index, i0, i1, j0, j1)
        v_j = problem.v[keys].astype(acc, copy=False)
        v_op = augmented(v_j, acc.type(1), xp) if fold_delta else v_j
        ds_ij = tile_score_gradient(problem, p_ij, do_op, v_op, None if fold_delta else delta[..., None],
                                    visible, kept)
        if raw is not None:
            grids = index_grids(problem, index, i0, i1, j0, j1)
            table_gradients(patterns, dtables, grids, raw, ds_ij)
            with np.errstate(invalid="ignore", over="ignore"):
                ds_ij *= patterns.score_mod.derivative(grids, raw)
            if visible is not None:
                ds_ij = xp.where(visible, ds_ij, 0)  # a derivative may be NaN or inf where a pair is hidden
        visible_t = None if visible is None else xp.swapaxes(visible, -1, -2)  # (keys, rows), as P^T
        dropped = p_ij if kept is None else p_ij * kept  # the probabilities the output took
        dv[keys] += weighted_values(xp.swapaxes(dropped, -1, -2), do_i, visible_t, xp, do_finite)
        dq_i += weighted_values(ds_ij, k_j, visible, xp)
        dk[keys] += weighted_values(xp.swapaxes(ds_ij, -1, -2), scaled_q_i, visible_t, xp, q_finite)
        if dbias is not None:
            dbias[index + (slice(i0, i1), slice(j0, j1))] = ds_ij
    dq_i *= scale
    return dq_i


def tile_score_gradient(problem, p_ij, do_i, v_j, delta, visible, kept=None):
    """dS_ij = P_ij * (dO_i V_j^T - D_i) (the gradient of the score the softmax sees), zero for
    hidden pairs by selection (a NaN in a hidden value row makes dO_i V_j^T NaN there). delta None: D_i rides in
    the operands' last columns (backward_rows). With dropout, dO_i V_j^T is the gradient of the dropped
    probabilities: times kept (dropout_factor) it is the softmax's."""
    xp = problem.xp
    dp_ij = xp.matmul(do_i, xp.swapaxes(v_j, -1, -2))
    if kept is not None:
        dp_ij *= kept
    if delta is None:
        with np.errstate(invalid="ignore"):
            dp_ij *= p_ij
        ds_ij = dp_ij
    else:
        ds_ij = score_gradient_in_place(dp_ij, p_ij, delta)
    return ds_ij if visible is None else xp.where(visible, ds_ij, 0)


def table_gradients(patterns, dtables, grids, raw, ds_ij) -> None:
    """Add one tile's share to the gradients of score_mod's tables (dtables: table number -> its gradient, in the
    accumulation type): each read of a table adds dS_ij * d score_mod / d the value read to the element it read.
    Deterministic: the tile's contributions are sorted by element (stably) and summed per element in that order."""
    score_mod = patterns.score_mod
    xp = score_mod.xp
    for number, grad in dtables.items():
        for index, slope in score_mod.reads(number):
            with np.errstate(invalid="ignore", over="ignore"):
                share = ds_ij * score_mod.evaluate(slope, grids, raw)
            share = xp.where(ds_ij != 0, share, 0)  # a hidden pair's slope may be NaN or inf; its dS_ij is 0
            scatter_add(grad, [score_mod.evaluate(x, grids, raw) for x in index], share, xp)


def scatter_add(target, index, values, xp) -> None:
    """target[index] += values, repeated elements summed (index: one integer array per axis of target, all
    broadcastable with values): by a stable sort on the flat element, then one sum per element, so the order of
    the additions is fixed."""
    values = xp.asarray(values)
    arrays = xp.broadcast_arrays(*index, values) if index else [values]
    flat = xp.zeros(arrays[-1].shape, dtype=np.int64)
    for axis, at in enumerate(arrays[:-1]):
        flat = flat * target.shape[axis] + at
    flat, values = flat.reshape(-1), arrays[-1].reshape(-1)
    if flat.size == 0:
        return
    order = xp.argsort(flat, kind="stable")
    flat, values = flat[order], values[order]
    starts = xp.flatnonzero(xp.concatenate([xp.ones(1, dtype=bool), flat[1:] != flat[:-1]]))
    target.reshape(-1)[flat[starts]] += xp.add.reduceat(values, starts)
