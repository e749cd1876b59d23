"""cuflash.dask: attention over Dask arrays equals cuflash.attention (to the accuracy rule) under any chunking of
any axis, on Dask's synchronous and threaded schedulers and on a real two-process cluster; the graph holds one
task per visible (query chunk, key chunk) pair and no n x m chunk; errors say what was wrong."""

import math
import subprocess
import sys

import dask
import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.dask as cd
from reference import assert_accurate, visibility
from strategies import cases, randn

OPTIONS = ("scale", "causal", "window", "mask", "bias")


@st.composite
def chunks_of(draw, shape):
    """Random chunks for each axis of `shape`: sizes that add up to it, uneven ones included."""
    chunks = []
    for size in shape:
        cuts = sorted(draw(st.sets(st.integers(1, size - 1), max_size=3))) if size > 1 else []
        chunks.append(tuple(b - a for a, b in zip([0] + cuts, cuts + [size])) or (size,))
    return tuple(chunks)


def chunked(draw, x):
    """x as a Dask array of drawn chunks, or (sometimes) left a NumPy array."""
    if x is None or draw(st.integers(0, 4)) == 0:
        return x
    return da.from_array(np.ascontiguousarray(x), chunks=draw(chunks_of(x.shape)))


def pair_tasks(x):
    return [key for key in x.__dask_graph__() if isinstance(key, tuple) and "pair" in key]


@given(cases(lengths=(1, 7, 40, 113), head_dims=(1, 8, 16), views=("contiguous", "strided", "stride0")),
       st.data(), st.sampled_from(["sync", "threads"]), st.integers(2, 5))
@settings(max_examples=40)
def test_equals_attention_under_any_chunking(case, data, scheduler, split_every):
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    draw = data.draw
    q, k, v = (chunked(draw, x) for x in (case.q, case.k, case.v))
    for name in ("mask", "bias"):
        if name in options:
            options[name] = chunked(draw, options[name])
    out, lse = cd.attention(q, k, v, return_lse=True, split_every=split_every, **options)
    expected = cuflash.attention(case.q, case.k, case.v, return_lse=True,
                                 **{key: case.options[key] for key in OPTIONS if key in case.options})
    assert out.shape == expected[0].shape and out.dtype == expected[0].dtype
    assert lse.shape == expected[1].shape and lse.dtype == expected[1].dtype
    out, lse = dask.compute(out, lse, scheduler=scheduler)
    assert out.dtype == expected[0].dtype and lse.dtype == expected[1].dtype
    assert_accurate(out, case.q, case.k, case.v, lse=lse,
                    **{key: case.options[key] for key in OPTIONS if key in case.options})


def visible_chunk_pairs(n, m, rows, cols, **options):
    """(query chunk, key chunk) pairs of which the reference's visibility leaves any pair of positions."""
    vis = visibility(n, m, **options)
    row_edges, col_edges = np.cumsum((0,) + rows), np.cumsum((0,) + cols)
    return sum(bool(vis[r0:r1, c0:c1].any()) for r0, r1 in zip(row_edges, row_edges[1:])
               for c0, c1 in zip(col_edges, col_edges[1:]))


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (30, 0)},
                                     {"causal": True, "window": (None, -50)}])
@pytest.mark.parametrize("n, m", [(200, 200), (120, 260), (260, 90)])
def test_hidden_chunk_pairs_make_no_task(options, n, m):
    rng = np.random.default_rng(0)
    q = da.from_array(randn(rng, (2, n, 8)), chunks=(1, 50, 8))
    k = da.from_array(randn(rng, (2, m, 8)), chunks=(2, 40, 8))
    v = da.from_array(randn(rng, (2, m, 4)), chunks=(2, 40, 4))
    out, lse = cd.attention(q, k, v, return_lse=True, **options)
    expected = 2 * visible_chunk_pairs(n, m, q.chunks[1], k.chunks[1], **options)  # two batch blocks
    assert len(pair_tasks(out)) == expected
    assert_accurate(out.compute(), q.compute(), k.compute(), v.compute(), lse=lse.compute(), **options)


def test_merges_form_a_tree_of_split_every():
    rng = np.random.default_rng(1)
    q = da.from_array(randn(rng, (16, 4)), chunks=(16, 4))
    k = da.from_array(randn(rng, (64, 4)), chunks=(1, 4))  # 64 key chunks
    v = da.from_array(randn(rng, (64, 2)), chunks=(1, 2))
    for split_every, levels in ((4, 3), (8, 2), (64, 1)):
        out = cd.attention(q, k, v, split_every=split_every)
        merges = {key[1] for key in out.__dask_graph__() if isinstance(key, tuple) and str(key[1]).startswith("merge")}
        assert len(merges) == levels == math.ceil(math.log(64, split_every))
        assert_accurate(out.compute(), q.compute(), k.compute(), v.compute())
    with dask.config.set(split_every=8):  # Dask's own setting is the default
        out = cd.attention(q, k, v)
    assert {key[1] for key in out.__dask_graph__() if isinstance(key, tuple) and "merge-1" in key}


def test_broadcast_head_axis_is_never_copied():
    """k and v with one head serve every query head's tasks from the same chunk."""
    rng = np.random.default_rng(2)
    q = da.from_array(randn(rng, (2, 6, 40, 8)), chunks=(1, 2, 20, 8))
    k = da.from_array(randn(rng, (2, 1, 40, 8)), chunks=(1, 1, 40, 8))
    v = da.from_array(randn(rng, (2, 1, 40, 8)), chunks=(1, 1, 40, 8))
    out = cd.attention(q, k, v)
    graph = dict(out.__dask_graph__())
    for key in pair_tasks(out):
        k_key = graph[key][2]
        assert k_key[0] == k.name and k_key[2] == 0, k_key  # head block 0 of k itself: no broadcast copy
    assert_accurate(out.compute(), q.compute(), k.compute(), v.compute())


def test_mask_and_bias_chunks_follow_q_and_k():
    rng = np.random.default_rng(3)
    n, m = 70, 90
    q, k, v = randn(rng, (3, n, 8)), randn(rng, (m, 8)), randn(rng, (m, 5))
    mask = rng.random((3, n, m)) < 0.6
    bias = randn(rng, (1, m), scale=3.0)
    out, lse = cd.attention(da.from_array(q, chunks=(2, 30, 8)), da.from_array(k, chunks=(25, 8)), v,
                            mask=da.from_array(mask, chunks=(1, 7, 11)), bias=bias, return_lse=True)
    assert out.chunks == ((1, 1, 1), (30, 30, 10), (5,))  # batch: the chunkings' common refinement
    assert_accurate(out.compute(), q, k, v, mask=mask, bias=bias, lse=lse.compute())


def test_empty_and_fully_hidden():
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, (2, 20, 4)), randn(rng, (2, 0, 4)), randn(rng, (2, 0, 3))
    out, lse = cd.attention(da.from_array(q, chunks=(1, 7, 4)), k, v, return_lse=True)
    out, lse = out.compute(), lse.compute()
    assert (out == 0).all() and np.isneginf(lse).all() and out.shape == (2, 20, 3)
    k, v = randn(rng, (2, 30, 4)), randn(rng, (2, 30, 3))
    out, lse = cd.attention(da.from_array(q, chunks=(1, 7, 4)), da.from_array(k, chunks=(1, 10, 4)), v,
                            window=(-100, None), return_lse=True)  # every key hidden from every query
    assert not pair_tasks(out)
    assert (out.compute() == 0).all() and np.isneginf(lse.compute()).all()
    out = cd.attention(da.from_array(np.zeros((0, 4)), chunks=(1, 4)), k[0], v[0])
    assert out.compute().shape == (0, 3)


def test_forced_backend_runs_in_each_task():
    rng = np.random.default_rng(5)
    q, k, v = randn(rng, (40, 16)), randn(rng, (50, 16)), randn(rng, (50, 16))
    out = cd.attention(da.from_array(q, chunks=(20, 16)), da.from_array(k, chunks=(25, 16)), v, causal=True,
                       backend="simt").compute(scheduler="sync")
    assert_accurate(out, q, k, v, causal=True)


def test_errors_say_what_was_wrong():
    q = da.ones((4, 8), chunks=2)
    with pytest.raises(ValueError, match="mismatch in its core dimension 1"):
        cd.attention(q, da.ones((5, 7)), da.ones((5, 2)))
    with pytest.raises(ValueError, match="split_every must be an int of at least 2"):
        cd.attention(q, q, q, split_every=1)
    unknown = q[q[:, 0] > 0]
    with pytest.raises(ValueError, match="unknown chunk sizes.*compute_chunk_sizes"):
        cd.attention(unknown, q, q)
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        cd.attention(q, q, q, mask=da.ones((4, 4)))
    with pytest.raises(TypeError, match="out"):
        cd.attention(q, q, q, out=np.empty((4, 8)))
    with pytest.raises(TypeError, match="must be a boolean array"):
        cd.attention(q, q, q, mask=np.ones((4, 4), dtype=np.int8))
    with pytest.raises(TypeError, match="masked array"):
        cd.attention(np.ma.masked_array(np.ones((4, 8))), q, q)


def test_on_a_two_process_cluster():
    """A causal problem chunked along both sequence axes on dask.distributed with two worker processes: the
    graph has one task per visible chunk pair, every chunk of the inputs is at most (chunk, d), and the result
    equals the plain call's."""
    distributed = pytest.importorskip("distributed")
    rng = np.random.default_rng(6)
    n = m = 256
    q, k, v = randn(rng, (2, n, 32)), randn(rng, (2, m, 32)), randn(rng, (2, m, 32))
    dq, dk, dv = (da.from_array(x, chunks=(1, 64, 32)) for x in (q, k, v))
    out, lse = cd.attention(dq, dk, dv, causal=True, return_lse=True)
    assert len(pair_tasks(out)) == 2 * 10  # 4 query chunks x their 1..4 visible key chunks, per batch block
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        assert len(client.run(lambda: 1)) == 2  # two worker processes
        result, result_lse = client.gather(client.compute([out, lse]))
    graph = out.__dask_graph__()
    ours = {name for name in graph.layers if name.startswith("cuflash-attention")}
    assert set(graph.layers) - ours == {dq.name, dk.name, dv.name}  # no rechunk, no broadcast: the inputs as given
    for x in (dq, dk, dv):
        assert max(x.chunks[1]) == 64
    assert_accurate(result, q, k, v, causal=True, lse=result_lse)


def _device_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy missing, no driver
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_device_count() == 0, reason="no CUDA device")
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_cupy_chunks_run_the_kernels(dtype):
    """CuPy chunks pick the cupy backend in every task; the result stays CuPy."""
    import cupy
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, (2, 300, 64), dtype), randn(rng, (2, 500, 64), dtype), randn(rng, (2, 500, 64), dtype)
    dq, dk, dv = (da.from_array(cupy.asarray(x), chunks=(1, 128, 64), asarray=False) for x in (q, k, v))
    out, lse = cd.attention(dq, dk, dv, causal=True, return_lse=True)
    assert isinstance(out._meta, cupy.ndarray)
    out, lse = dask.compute(out, lse, scheduler="threads")
    assert isinstance(out, cupy.ndarray)
    assert_accurate(cupy.asnumpy(out), q, k, v, causal=True, lse=cupy.asnumpy(lse))


def test_the_core_never_imports_dask():
    """dask is an optional extra: importing cuflash (and running attention) loads none of it."""
    code = ("import sys, numpy as np, cuflash; cuflash.attention(np.ones((2, 3)), np.ones((4, 3)), np.ones((4, 1))); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


@settings(max_examples=15)
@given(st.data())
def test_mods_see_global_indices_and_sinks_join_once(data):
    """score_mod, mask_mod and sinks over any chunking equal the one in-memory call; a block mask prunes the chunk
    pairs whose tiles it hides (never one it shows: the results stay equal)."""
    from cuflash import mods

    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    b, h, n = 2, 3, data.draw(st.integers(1, 70))
    q, k, v = (rng.standard_normal((b, h, n, 4)) for _ in range(3))
    ids = np.sort(rng.integers(0, 3, (b, n)), axis=1)
    slopes, sinks = rng.random(h), rng.standard_normal(h)

    def capped_alibi(score, bi, hi, i, j):
        return 2 * np.tanh((score - slopes[hi] * np.abs(i - j)) / 2)
    pattern = mods.documents(ids)
    expected, expected_lse = cuflash.attention(q, k, v, score_mod=capped_alibi, mask_mod=pattern, sinks=sinks,
                                               causal=True, return_lse=True)
    dq, dk, dv = (da.from_array(x, chunks=data.draw(chunks_of(x.shape))) for x in (q, k, v))
    made = cuflash.block_mask(pattern, (b, h), n, n, block=(8, 8))
    for options in (dict(mask_mod=pattern), dict(block_mask=made)):
        out, lse = cd.attention(dq, dk, dv, score_mod=capped_alibi, sinks=sinks, causal=True, return_lse=True,
                                **options)
        np.testing.assert_allclose(out.compute(), expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse.compute(), expected_lse, rtol=1e-12, atol=1e-12)
    pruned = pair_tasks(cd.attention(dq, dk, dv, block_mask=made, causal=True))
    assert len(pruned) <= len(pair_tasks(cd.attention(dq, dk, dv, mask_mod=pattern, causal=True)))


def test_chunk_offsets_compile_no_kernel_per_chunk_pair():
    """The offsets each chunk pair's mods add are an array they read, not numbers in their expression: the
    kernels compile once for the graph's mods, not once per chunk pair, and the result is the one call's."""
    from cuflash import mods
    from cuflash.backends import simt

    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((2, 3, 64, 16)).astype(np.float32) for _ in range(3))
    ids = np.sort(rng.integers(0, 3, (2, 64)), axis=1)
    slopes = rng.random(3)
    options = dict(mask_mod=mods.documents(ids), score_mod=mods.alibi(slopes), causal=True)
    dq, dk, dv = (da.from_array(x, chunks=(1, 3, 32, 16)) for x in (q, k, v))
    before = set(simt._functions)
    out = cd.attention(dq, dk, dv, backend="simt", **options)
    assert len(pair_tasks(out)) == 2 * 3  # per batch block, the causal chunk pairs (0, 0), (1, 0), (1, 1)
    result = out.compute(scheduler="sync")
    assert len(set(simt._functions) - before) <= 1  # one forward kernel, whichever this problem's plan is
    np.testing.assert_allclose(result, cuflash.attention(q, k, v, **options), rtol=1e-5, atol=1e-5)
