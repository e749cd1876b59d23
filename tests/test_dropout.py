"""Attention dropout in the kernels: the Philox generator of tile.cuh against cuflash.dropout's and Random123's
known answers; the keep tiles the kernels share (KeepTile: made by the block, read by any layout) against
Dropout.tile_keeps; the emulated kernels (CUDA cores, tensor cores, split keys, the planner's tiles) against the
numpy backend and a dense float64 formula built from cuflash.dropout_mask, with outputs and gradients that reveal
each kept element; the statistics of the mask; and the shared-memory model of the dropout kernels."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.simt
from cuflash import BlockConfig, api, kernels, launch, tiling
from cuflash.backends import numpy as numpy_backend
from cuflash.backends import simt as simt_backend
from cuflash.dropout import Dropout, dropout_mask, philox, row_major
from cuflash.family import Shape
from cuflash.kernels import forward_mma
from cuflash.reference import visible_pairs
from harness import run_under_memcheck
from strategies import randn

SIMT = pytest.mark.skipif(not cuflash.simt.available(), reason="the SIMT emulator needs g++")
# The emulated kernels' small instantiations (as tests/test_varlen.py's): CUDA cores for float32 and float64
# (precision "fma"), the tensor cores' smallest tiles for float16.
SMALL = BlockConfig(16, 16, 2)
SMALL_MMA = {"forward": BlockConfig.mma(16, 16, 1), "backward": BlockConfig.mma(16, 16, 1, stages=1)}
TOLERANCE = {np.float16: 4e-3, np.float32: 2e-5, np.float64: 1e-11}  # of the largest magnitude compared
GRAD_TOLERANCE = {np.float16: 2e-2, np.float32: 5e-5, np.float64: 1e-10}

# Random123's known-answer vectors of philox4x32-10 (kat_vectors): counter, key, result.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def options_of(dtype, kind="forward"):
    """(block, precision) of the small instantiations for this dtype."""
    if np.dtype(dtype) == np.float16:
        return SMALL_MMA[kind], None
    return SMALL, "fma"


# ----------------------------------------------------------------------------------------------------------------
# Philox and the keep tiles, as the kernels compute them

PROBE = r'''
extern "C" __global__ void philox_words(const unsigned* counters, const unsigned* keys, unsigned* out, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const cuflash::Words w = cuflash::philox(counters[4 * t], counters[4 * t + 1], counters[4 * t + 2],
                                             counters[4 * t + 3], keys[2 * t], keys[2 * t + 1]);
    for (int x = 0; x < 4; ++x) out[4 * t + x] = w.x[x];
}

extern "C" __global__ void row_keeps(const cuflash::DropoutRow d, const long long* ij, unsigned* out, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n) out[t] = d.keeps(ij[2 * t], ij[2 * t + 1]) | d.keep4(ij[2 * t], ij[2 * t + 1]) << 1;
}

// The block fills one keep tile; every (row, key) read back alone, and each row whole from a key on.
template <int Rows, int Cols, int Threads, int From>
__global__ void keep_tile(const cuflash::DropoutRow d, long long i0, long long j0, unsigned* single, unsigned* span) {
    using Tile = cuflash::KeepTile<Rows, Cols>;
    __shared__ __align__(16) unsigned char at[Tile::bytes];
    const Tile tile{at};
    tile.template fill<Threads>(d, i0, j0);
    __syncthreads();
    for (int u = threadIdx.x; u < Rows * Cols; u += Threads) single[u] = tile.template bits<1>(u / Cols, u % Cols)[0];
    for (int r = threadIdx.x; r < Rows; r += Threads) {
        const cuflash::KeepBits<Cols - From> bits = tile.template bits<Cols - From>(r, From);
        for (int c = 0; c < Cols - From; ++c) span[r * (Cols - From) + c] = bits[c];
    }
}
'''
TILES = [(16, 64, 64, 0), (16, 64, 64, 5), (13, 16, 32, 3), (7, 4, 32, 1), (9, 12, 64, 0), (32, 128, 128, 9)]
DROPOUT_ROW = np.dtype([("seed", np.uint64), ("b", np.uint64), ("row0", np.int64), ("key0", np.int64),
                        ("threshold", np.uint32)], align=True)


@pytest.fixture(scope="module")
def probe():
    names = [f"keep_tile<{r}, {c}, {t}, {f}>" for r, c, t, f in TILES]
    return cuflash.simt.RawModule(code=kernels.source("tile.cuh") + PROBE, name_expressions=names,
                                  filename="tile.cuh")


def dropout_row(dropout: Dropout, b: int):
    row = np.zeros((), DROPOUT_ROW)
    row["seed"], row["b"], row["row0"], row["key0"] = dropout.seed, b, dropout.row0, dropout.key0
    row["threshold"] = dropout.threshold
    return row[()]


@pytest.mark.parametrize("counter,key,words", KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter, key, words):
    assert tuple(int(w) for w in philox(counter, key)) == words


@SIMT
def test_the_kernels_philox_is_cuflash_dropouts(probe):
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, (300, 4), dtype=np.uint64).astype(np.uint32)
    keys = rng.integers(0, 2**32, (300, 2), dtype=np.uint64).astype(np.uint32)
    counters[:3] = [c for c, _, _ in KNOWN_ANSWERS]
    keys[:3] = [k for _, k, _ in KNOWN_ANSWERS]
    out = np.zeros((300, 4), np.uint32)
    probe.get_function("philox_words")((3,), (128,), (counters, keys, out, np.int32(300)))
    want = np.stack(philox(tuple(counters.T), tuple(keys.T)), axis=-1)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out[:3], [w for _, _, w in KNOWN_ANSWERS])


@SIMT
@pytest.mark.parametrize("p,seed,b,row0,key0", [(0.5, 7, 3, 0, 0), (0.1, 2**64 - 1, 2**33 + 5, 2**32 - 3, 6),
                                                (0.9, 12345, 0, 17, 2**35 + 1)])
def test_a_row_keeps_what_cuflash_dropout_keeps(probe, p, seed, b, row0, key0):
    dropout = Dropout(p, seed, (), row0=row0, key0=key0)
    rng = np.random.default_rng(1)
    ij = rng.integers(0, 5000, (500, 2)).astype(np.int64)
    out = np.zeros(500, np.uint32)
    probe.get_function("row_keeps")((4,), (128,), (dropout_row(dropout, b), ij, out, np.int32(500)))
    keeps = dropout.keeps(b, ij[:, 0], ij[:, 1])
    np.testing.assert_array_equal(out & 1, keeps)
    groups = (ij[:, 1] + key0) // 4 * 4 - key0  # the first key of each one's Philox group
    four = np.stack([dropout.keeps(b, ij[:, 0], groups + t) for t in range(4)], axis=-1)
    np.testing.assert_array_equal(out >> 1, (four << np.arange(4)).sum(-1))


@SIMT
@pytest.mark.parametrize("rows,cols,threads,start", TILES)
@pytest.mark.parametrize("key0", [0, 1, 2, 3, 2**33 + 7])
def test_a_keep_tile_holds_every_rows_bits_for_any_reader(probe, rows, cols, threads, start, key0):
    """Filled by the block (two Philox groups per thread and step, a group past them where the keys do not start
    on one), each (row, key) read alone and each row from a key on equal Dropout.tile_keeps."""
    dropout = Dropout(0.4, 99, (), row0=5, key0=key0)
    for i0, j0, b in [(0, 0, 0), (37, 13, 2), (2**31, 2**32 + 3, 2**40)]:
        single = np.zeros(rows * cols, np.uint32)
        span = np.zeros(rows * (cols - start), np.uint32)
        probe.get_function(f"keep_tile<{rows}, {cols}, {threads}, {start}>")(
            (1,), (threads,), (dropout_row(dropout, b), np.int64(i0), np.int64(j0), single, span))
        want = dropout.tile_keeps(np.int64(b), i0, i0 + rows, j0, j0 + cols)
        np.testing.assert_array_equal(single.reshape(rows, cols), want)
        np.testing.assert_array_equal(span.reshape(rows, cols - start), want[:, start:])


# ----------------------------------------------------------------------------------------------------------------
# Attention with dropout on the emulated kernels


def dense(q, k, v, dout, *, p, seed, causal=False, window=None, scale=None):
    """The dense float64 formula, by torch: O = (softmax(S) * keep / (1 - p)) V with keep = cuflash.dropout_mask,
    lse of the softmax, and the gradients of sum(O * dout) by autograd. Rows that see no key give 0."""
    import torch
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n, d, m = q.shape[-2], q.shape[-1], k.shape[-2]
    tq, tk, tv = (torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v))
    visible = torch.tensor(visible_pairs(n, m, causal, window, None, None))
    keep = torch.tensor(dropout_mask(batch, n, m, p=p, seed=seed))
    s = torch.matmul(tq, tk.transpose(-1, -2)) * (1 / math.sqrt(d) if scale is None else scale)
    s = s.masked_fill(~visible, -math.inf)
    seen = visible.any(-1, keepdim=True)
    probs = torch.where(seen, torch.softmax(torch.where(seen, s, 0.0), -1), 0.0)
    out = torch.matmul(probs * keep / (1 - p), tv)
    lse = torch.where(seen[..., 0], torch.logsumexp(torch.where(seen, s, 0.0), -1), -math.inf)
    out.backward(torch.tensor(np.asarray(dout, np.float64)))
    return (out.detach().numpy(), lse.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())


def assert_close(got, want, tolerance, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0)))
    with np.errstate(invalid="ignore"):  # -inf - -inf: an lse both give -inf
        err = np.abs(got - want)
    assert np.array_equal(np.isnan(got), np.isnan(want)), what
    assert np.nanmax(err, initial=0.0) <= tolerance * scale, f"{what}: error {np.nanmax(err)} > {tolerance} x {scale}"


@contextlib.contextmanager
def kernels_only():
    """The simt backend must run the kernels: its blocked fallback fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("dropout ran the blocked algorithm on the simt backend")
    with mock.patch.object(simt_backend.blocked, "run", refuse), \
            mock.patch.object(simt_backend.blocked, "run_backward", refuse):
        yield


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    batch = draw(st.sampled_from([(), (3,), (2, 3)]))
    k_batch = draw(st.sampled_from([batch, batch[1:], (1,) * len(batch)]))  # keys broadcast over leading axes
    n, m = draw(st.integers(1, 37)), draw(st.integers(1, 41))
    d, e = draw(st.sampled_from([(16, 16), (8, 13), (5, 16)]))
    causal = draw(st.booleans())
    window = None if causal else draw(st.sampled_from([None, (3, 2), (0, 9)]))
    return dict(dtype=dtype, batch=batch, k_batch=k_batch, n=n, m=m, d=d, e=e, causal=causal, window=window,
                p=draw(st.sampled_from([0.1, 0.5, 0.9])), seed=draw(st.integers(0, 2**64 - 1)),
                data=draw(st.integers(0, 2**32 - 1)))


@SIMT
@settings(max_examples=25)
@given(problems())
@kernels_only()
def test_the_kernels_drop_what_the_numpy_backend_and_the_dense_formula_drop(case):
    """Forward and backward on the emulated kernels against the numpy backend (by dtype) and the dense float64
    formula built from cuflash.dropout_mask: odd lengths, broadcast batches, causal and windowed rows, every p."""
    dtype, p, seed = case["dtype"], case["p"], case["seed"]
    rng = np.random.default_rng(case["data"])
    q = randn(rng, case["batch"] + (case["n"], case["d"]), dtype)
    k = randn(rng, case["k_batch"] + (case["m"], case["d"]), dtype)
    v = randn(rng, case["k_batch"] + (case["m"], case["e"]), dtype)
    options = dict(causal=case["causal"], window=case["window"], dropout_p=p, seed=seed)
    block, precision = options_of(dtype)
    out, lse = cuflash.attention(q, k, v, backend="simt", block=block, precision=precision, return_lse=True,
                                 **options)
    want, want_lse = cuflash.attention(q, k, v, backend="numpy", precision=precision, return_lse=True, **options)
    dout = randn(rng, out.shape, dtype)
    formula = dense(q, k, v, dout, p=p, seed=seed, causal=case["causal"], window=case["window"])
    tol = TOLERANCE[dtype] / (1 - p)  # kept values are scaled by 1 / (1 - p), and so are their errors
    assert_close(out, want, tol, "out vs numpy")
    assert_close(out, formula[0], tol, "out vs dense")
    assert_close(lse, formula[1], TOLERANCE[dtype], "lse vs dense")
    block, precision = options_of(dtype, "backward")
    grads = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="simt", block=block,
                                       precision=precision, **options)
    expected = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="numpy", precision=precision,
                                          **options)
    for name, got, numpy_grad, dense_grad in zip("qkv", grads, expected, formula[2:]):
        assert_close(got, numpy_grad, GRAD_TOLERANCE[dtype] / (1 - p), f"d{name} vs numpy")
        assert_close(got, dense_grad, GRAD_TOLERANCE[dtype] / (1 - p), f"d{name} vs dense")


def revealing(rng, batch, n, m, dtype):
    """q and k of small scores (no probability underflows) and V = the identity: out[..., i, j] is row i's
    probability of key j, scaled where kept and 0 where dropped."""
    q, k = randn(rng, batch + (n, 8), dtype, scale=0.5), randn(rng, batch + (m, 8), dtype, scale=0.5)
    return q, k, np.broadcast_to(np.eye(m, dtype=dtype), batch + (m, m))


@SIMT
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 3))])
@kernels_only()
def test_each_output_and_value_gradient_reveals_exactly_the_kept_elements(dtype, causal, window):
    """With V = I the forward's out[.., i, j] is nonzero exactly where (i, j) is visible and kept, and with
    dout = I the backward's dV[.., j, i] is: both kernels keep cuflash.dropout_mask's elements, bit for bit."""
    rng = np.random.default_rng(3)
    batch, n, m, p = (2, 3), 29, 35, 0.5
    q, k, v = revealing(rng, batch, n, m, dtype)
    keep = dropout_mask(batch, n, m, p=p, seed=11) & visible_pairs(n, m, causal, window, None, None)
    block, precision = options_of(dtype)
    out, lse = cuflash.attention(q, k, v, causal=causal, window=window, dropout_p=p, seed=11, backend="simt",
                                 block=block, precision=precision, return_lse=True)
    np.testing.assert_array_equal(out != 0, keep)
    dout = np.broadcast_to(np.eye(n, dtype=dtype), batch + (n, n))
    v = randn(rng, batch + (m, n), dtype)
    out, lse = cuflash.attention(q, k, v, causal=causal, window=window, dropout_p=p, seed=11, return_lse=True,
                                 precision=precision)
    block, precision = options_of(dtype, "backward")
    _, _, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window=window, dropout_p=p,
                                          seed=11, backend="simt", block=block, precision=precision)
    np.testing.assert_array_equal(np.swapaxes(dv, -1, -2) != 0, keep)


@SIMT
@pytest.mark.parametrize("dtype, precision", [(np.float32, None), (np.float32, "tf32"), (np.float64, None)])
@kernels_only()
def test_the_float32_and_float64_tensor_core_backward_keeps_the_same_elements(dtype, precision):
    """The tensor-core backward of float32 (3xTF32, one TF32 pass) and float64 (DMMA), one warp and two: with
    dout = I, dV[.., j, i] is nonzero exactly where (i, j) is visible and kept; and its gradients are the dense
    formula's (to TF32's rounding in one pass)."""
    rng = np.random.default_rng(12)
    batch, n, m, p = (2,), 29, 35, 0.5
    q, k, _ = revealing(rng, batch, n, m, dtype)
    v = randn(rng, batch + (m, n), dtype)
    options = dict(causal=True, dropout_p=p, seed=11)
    keep = dropout_mask(batch, n, m, p=p, seed=11) & visible_pairs(n, m, True, None, None, None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, precision=precision, **options)
    eye = np.broadcast_to(np.eye(n, dtype=dtype), batch + (n, n))
    dout = randn(rng, out.shape, dtype)
    formula = dense(q, k, v, dout, p=p, seed=11, causal=True)
    tolerance = (GRAD_TOLERANCE[dtype] if precision is None else 5e-3) / (1 - p)
    for block in (SMALL_MMA["backward"], BlockConfig.mma(32, 32, 2, stages=2)):
        _, _, dv = cuflash.attention_backward(eye, q, k, v, out, lse, backend="simt", block=block,
                                              precision=precision, **options)
        np.testing.assert_array_equal(np.swapaxes(dv, -1, -2) != 0, keep)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", block=block,
                                           precision=precision, **options)
        for name, got, want in zip("qkv", grads, formula[2:]):
            assert_close(got, want, tolerance, f"d{name} vs dense, {block}")


@SIMT
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@kernels_only()
def test_a_nan_value_reaches_the_rows_that_see_it_dropped_or_not(dtype):
    """A dropped probability is multiplied by 0, as the numpy backend's matmul (and PyTorch) does: a NaN in a
    visible key's value row reaches every row that sees the key, kept or dropped; a NaN in a hidden key's never
    does. The kernels' NaN pattern is the numpy backend's, forward and backward."""
    rng = np.random.default_rng(8)
    q, k, v = (randn(rng, (2, length, 16), dtype) for length in (30, 40, 40))
    v[0, 25, 3] = np.nan  # key 25: hidden from rows i < 15 by causal=True (bottom-right aligned), seen by the rest
    options = dict(causal=True, dropout_p=0.5, seed=3)
    keep = dropout_mask((2,), 30, 40, p=0.5, seed=3)
    assert keep[0, 15:, 25].any() and not keep[0, 15:, 25].all()  # dropped by some of the rows that see it
    block, precision = options_of(dtype)
    out = cuflash.attention(q, k, v, backend="simt", block=block, precision=precision, **options)
    want, lse = cuflash.attention(q, k, v, backend="numpy", precision=precision, return_lse=True, **options)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out[0, 15:, 3]).all() and not np.isnan(out[0, :15]).any() and not np.isnan(out[1]).any()
    dout = randn(rng, out.shape, dtype)
    block, precision = options_of(dtype, "backward")
    grads = cuflash.attention_backward(dout, q, k, v, want, lse, backend="simt", block=block, precision=precision,
                                       **options)
    expected = cuflash.attention_backward(dout, q, k, v, want, lse, precision=precision, **options)
    for got, ref in zip(grads, expected):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))


@SIMT
@kernels_only()
def test_split_keys_and_other_tiles_drop_the_same_elements():
    """Decoding shapes (few queries, many keys: the keys split over blocks, CUDA cores and tensor cores) and
    several tile sizes give the numpy backend's float64 results to rounding, and V = I shows the same mask."""
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, (2, 3, 16), np.float64), randn(rng, (2, 2000, 16), np.float64), \
        randn(rng, (2, 2000, 16), np.float64)
    options = dict(dropout_p=0.3, seed=2**40 + 3)
    want = cuflash.attention(q, k, v, backend="numpy", **options)
    problem, _ = api.make_problem(np, q, k, v, None, False, None, None, None,
                                  patterns=api.Patterns(dropout=(0.3, 2**40 + 3)))
    for block in [None, BlockConfig(16, 32, 2), BlockConfig(32, 64, 4, stages=2), BlockConfig.mma(16, 32, 1),
                  BlockConfig.mma(64, 64, 4, stages=3)]:
        precision = "fma" if block is None or block.variant == "fma" else None
        plan = tiling.plan(dataclasses.replace(problem.shape, precision=precision), simt_backend.DEVICE, block)
        assert plan.splits > 1 and plan.shape.dropout, plan  # the decoding shape splits its keys
        out = cuflash.attention(q, k, v, backend="simt", block=block, precision=precision, **options)
        assert_close(out, want, 1e-12, f"{block}")
    q, k, v = revealing(rng, (2,), 2, 300, np.float32)
    out = cuflash.attention(q, k, v, backend="simt", precision="fma", dropout_p=0.6, seed=5)
    np.testing.assert_array_equal(out != 0, dropout_mask((2,), 2, 300, p=0.6, seed=5))
    # The tensor-core forward's other tiles in two parts (64 keys, e = 256: each part's keep bits from its first
    # column), with V = I on the 178 keys (and zeros past them) and a mask.
    q, k = randn(rng, (40, 64), np.float16, scale=0.3), randn(rng, (178, 64), np.float16, scale=0.3)
    v = np.zeros((178, 256), np.float16)
    v[:, :178] = np.eye(178, dtype=np.float16)
    mask = rng.random((40, 178)) < 0.8
    block = BlockConfig.mma(16, 64, 1)
    shape = dataclasses.replace(api.make_problem(np, q, k, v, None, False, None, mask, None)[0].shape, dropout=True)
    assert forward_mma.key_parts(shape, block) == 2
    out = cuflash.attention(q, k, v, mask=mask, backend="simt", block=block, dropout_p=0.5, seed=6)
    np.testing.assert_array_equal(out[:, :178] != 0, dropout_mask((), 40, 178, p=0.5, seed=6) & mask)


@SIMT
@kernels_only()
def test_the_planners_tiles_drop_in_the_steady_loop():
    """The planner's own tensor-core tiles (the steady loop over whole key tiles, its hot loop's keep bits made a
    tile ahead) and its backward, against the numpy backend."""
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (2, length, 64), np.float16) for length in (150, 261, 261))
    options = dict(dropout_p=0.25, seed=77)
    out, lse = cuflash.attention(q, k, v, backend="simt", return_lse=True, **options)
    want, want_lse = cuflash.attention(q, k, v, backend="numpy", return_lse=True, **options)
    assert_close(out, want, TOLERANCE[np.float16] / 0.75, "out")
    assert_close(lse, want_lse, 1e-5, "lse")
    dout = randn(rng, out.shape, np.float16)
    grads = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="simt", **options)
    expected = cuflash.attention_backward(dout, q, k, v, want, want_lse, backend="numpy", **options)
    for name, got, ref in zip("qkv", grads, expected):
        assert_close(got, ref, GRAD_TOLERANCE[np.float16] / 0.75, f"d{name}")


@SIMT
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_the_kernels_count_batch_rows_and_keys_from_a_chunks_offsets(dtype):
    """A Dask task's chunk counts its batch items, rows and keys from offsets in the whole call (Dropout's base,
    strides, row0, key0; keys not on a Philox group): the kernels keep what the numpy backend keeps."""
    rng = np.random.default_rng(6)
    q, k, v = (randn(rng, (2, 3, length, 16), dtype) for length in (21, 30, 30))
    problem, _ = api.make_problem(np, q, k, v, None, True, None, None, None,
                                  patterns=api.Patterns(dropout=(0.5, 123)))
    for base, strides, row0, key0 in [(0, (3, 1), 0, 0), (11, (7, 2), 5, 3), (2**33, (1, 2), 2**32 - 2, 2**33 + 1)]:
        chunk = dataclasses.replace(problem, dropout=Dropout(0.5, 123, strides, base, row0, key0))
        results = []
        for run, kind in ((numpy_backend.run, None), (simt_backend.run, "forward")):
            out, lse = np.zeros((2, 3, 21, 16), dtype), np.zeros((2, 3, 21), problem.acc_dtype)
            run(chunk, out, lse, block=None if kind is None else options_of(dtype, kind)[0])
            results.append((out, lse))
        assert_close(results[1][0], results[0][0], TOLERANCE[dtype] * 2, f"out {base, strides, row0, key0}")
        dout = randn(rng, (2, 3, 21, 16), dtype)
        grads = []
        for run, kind in ((numpy_backend.run_backward, None), (simt_backend.run_backward, "backward")):
            g = [np.zeros(x.shape, problem.acc_dtype) for x in (q, k, v)]
            run(chunk, dout, *results[0], g + [None], block=None if kind is None else options_of(dtype, kind)[0])
            grads.append(g)
        for name, got, want in zip("qkv", grads[1], grads[0]):
            assert_close(got, want, GRAD_TOLERANCE[dtype] * 2, f"d{name} {base, strides, row0, key0}")


@SIMT
def test_more_batch_axes_than_a_kernel_counts_take_the_blocked_algorithm():
    """Seven batch axes: dropout_of unravels at most six, so kernel_patterns sends the call to the blocked
    algorithm (the kernels would launch per leading index, each counting its batch items from 0)."""
    rng = np.random.default_rng(7)
    shape = (2, 1, 2, 1, 2, 1, 2)
    q, k, v = (randn(rng, shape + (length, 8), np.float32) for length in (5, 6, 6))
    problem, _ = api.make_problem(np, q, k, v, None, False, None, None, None, patterns=api.Patterns(dropout=(0.5, 1)))
    patterns, why = launch.kernel_patterns(problem, forward=True)
    assert patterns is None and "7 batch axes" in why
    six, _ = api.make_problem(np, q[0], k[0], v[0], None, False, None, None, None,
                              patterns=api.Patterns(dropout=(0.5, 1)))
    assert launch.kernel_patterns(six, forward=True) == (None, None)
    options = dict(dropout_p=0.5, seed=1)
    out = cuflash.attention(q, k, v, backend="simt", block=SMALL, precision="fma", **options)
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v, backend="numpy", **options))


@SIMT
@pytest.mark.parametrize("family", sorted({f for fs in tiling.FAMILIES_OF.values() for f in fs}, key=repr), ids=repr)
def test_the_dropout_kernels_shared_memory_model_is_their_layout(family):
    """shared_memory_bytes of a dropout shape equals the kernel's struct compiled with CUFLASH_DROPOUT (its keep
    tiles and the block's DropoutRow at the end), for several tiles and dtypes."""
    from cuflash import simt
    from cuflash.kernels import backward, backward_mma, forward, forward_mma
    candidates = {forward.FORWARD: forward.CANDIDATES[:6], forward_mma.FORWARD: forward_mma.CANDIDATES[:5],
                  backward.DQ: backward.DQ.candidates(Shape(np.float32, 64, 64))[0][:4],
                  backward.DKDV: backward.DKDV.candidates(Shape(np.float32, 64, 64))[0][:4],
                  backward_mma.DQ: backward_mma.DQ.candidates(Shape(np.float16, 64, 64))[0][:4],
                  backward_mma.DKDV: backward_mma.DKDV.candidates(Shape(np.float16, 64, 64))[0][:4]}[family]
    asserts = []
    for dtype in (np.float16, np.float32):
        if family.variant == "mma" and family.kind != "forward" and dtype != np.float16:
            continue
        shape = Shape(dtype, 64, 64, dropout=True)
        for config in candidates:
            plain = dataclasses.replace(shape, dropout=False)
            nbytes = family.shared_memory_bytes(shape, config)
            assert nbytes > family.shared_memory_bytes(plain, config)
            args = layout_args(family, shape, config)
            asserts.append(f'static_assert(cuflash::{family.shared_struct}<{args}>::bytes == {nbytes}, "{args}");')
    simt.check(kernels.source(family.source, dropout=True) + "\n".join(asserts) + "\n", family.source)


def layout_args(family, shape, config):
    """The shared-memory struct's template arguments (as tests/test_compile.py and test_cubin.py spell them)."""
    from cuflash.family import C_TYPES
    D, E = family.buckets(shape, config)
    ctype = C_TYPES[shape.dtype.name]
    if family.shared_struct == "ForwardShared":
        return f"{ctype}, {config.Br}, {config.Bc}, {D}, {E}, {config.stages}"
    if family.shared_struct == "MmaShared":
        lo = ", true" if shape.dtype == np.float32 else ""
        return f"{ctype}, {config.Br}, {config.Bc}, {D}, {E}, {config.warps}, {config.stages}{lo}"
    keys_own = "true" if family.kind == "dkdv" else "false"
    if family.shared_struct == "BackwardShared":
        return f"{ctype}, {config.Br}, {config.Bc}, {D}, {E}, {keys_own}, {config.stages}"
    return f"{ctype}, {config.Br}, {config.Bc}, {D}, {E}, {config.warps}, {keys_own}, {config.stages}"


@pytest.mark.memcheck
@SIMT
def test_the_dropout_kernels_under_address_sanitizer():
    """Forward and backward, CUDA cores and tensor cores, split keys and the planner's tiles, in the emulator's
    memcheck mode (memcheck_cases.py case_dropout): no read or write outside an array or a block's shared memory."""
    result = run_under_memcheck("dropout")
    assert result.returncode == 0 and "memcheck ok" in result.stdout, result.stderr[-4000:]


# ----------------------------------------------------------------------------------------------------------------
# The mask's statistics (cuflash.dropout_mask, which every backend keeps)


def chi_square(a, b):
    """Pearson's chi-square of the 2 x 2 table of two boolean samples (1 degree of freedom)."""
    a, b = a.ravel(), b.ravel()
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]], np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())


CHI2_LIMIT = 24.0  # 1 degree of freedom: P(chi2 > 24) ~ 1e-6


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_the_keep_rate_is_one_minus_p(p):
    mask = dropout_mask((4, 8), 64, 130, p=p, seed=2024)
    count = mask.size
    sigma = math.sqrt(p * (1 - p) / count)
    assert abs(mask.mean() - (1 - p)) < 5 * sigma, (mask.mean(), 1 - p, sigma)
    for axis in (-1, -2):  # no row or column far off either
        rates = mask.mean(axis=axis)
        per = math.sqrt(p * (1 - p) / mask.shape[axis])
        assert np.abs(rates - (1 - p)).max() < 6 * per


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_rows_keys_batch_items_and_seeds_are_independent(p):
    """2 x 2 tables of neighbours along every counter word (the next key in and across a Philox group, the next row,
    the next batch item) and of two seeds show no dependence; their correlations are near 0."""
    mask = dropout_mask((6, 5), 96, 96, p=p, seed=31337)
    pairs = {"key in a group": (mask[..., 0::4], mask[..., 1::4]), "key across groups": (mask[..., 3::4][..., :-1],
                                                                                         mask[..., 4::4]),
             "row": (mask[..., :-1, :], mask[..., 1:, :]), "batch item": (mask[:, :-1], mask[:, 1:]),
             "batch axis": (mask[:-1], mask[1:]),
             "seed": (mask, dropout_mask((6, 5), 96, 96, p=p, seed=31338)),
             "seed's high word": (mask, dropout_mask((6, 5), 96, 96, p=p, seed=31337 + 2**32))}
    for what, (a, b) in pairs.items():
        assert chi_square(a, b) < CHI2_LIMIT, what
        corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(corr) < 5 / math.sqrt(a.size), (what, corr)


def test_seeds_and_positions_give_other_masks_and_the_same_seed_the_same():
    a = dropout_mask((3,), 40, 50, p=0.5, seed=1)
    np.testing.assert_array_equal(a, dropout_mask((3,), 40, 50, p=0.5, seed=1))
    for other in (dropout_mask((3,), 40, 50, p=0.5, seed=2), dropout_mask((3,), 40, 50, p=0.5, seed=1 + 2**32)):
        assert 0.4 < np.mean(a != other) < 0.6  # independent masks of p = 0.5 differ half the time
    # a chunk's offsets move the counter: its mask is the whole call's at its place
    whole = dropout_mask((4,), 40, 50, p=0.5, seed=1)
    chunk = Dropout(0.5, 1, row_major((4,)), row0=7, key0=9)
    np.testing.assert_array_equal(chunk.tile_keeps(np.int64(2), 0, 10, 0, 20), whole[2, 7:17, 9:29])
    assert not np.array_equal(whole[0], whole[1]) and not np.array_equal(whole[0, :20], whole[0, 20:])
