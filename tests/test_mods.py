"""score_mod, mask_mod and sinks: every backend against the same function evaluated densely on the whole grid.

The reference here never touches cuflash.mods: it calls the user's function itself on NumPy (or torch) index
grids of the full (*batch, n, m) problem, in float64, and runs naive softmax attention on the result. Hypothesis
draws the mods from a grammar (random expression trees over the score, the indices, constants and captured
tables; masks combined with & | ~), and each tree is rendered twice from one description: as the function cuflash
traces, and as the dense formula the reference evaluates (with torch for the gradients).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import mods
from cuflash.family import Shape
from test_cupy_shim import stand_in

BACKENDS = ["numpy", "simt"]  # simt: the same problems through the GPU backends' path on NumPy arrays


# ----------------------------------------------------------------------------------------------------------------
# The dense reference


def grids(batch, n, m, lib=np):
    """One index grid per batch axis, then i and j, each broadcastable to (*batch, n, m)."""
    rank = len(batch) + 2
    arange = (lambda size: torch.arange(size)) if lib is torch else (lambda size: np.arange(size))
    out = []
    for axis, size in enumerate(tuple(batch) + (n, m)):
        shape = [1] * rank
        shape[axis] = size
        out.append(arange(size).reshape(shape))
    return out


def dense_reference(q, k, v, *, score_mod=None, mask_mod=None, sinks=None, causal=False, bias=None, lib=np):
    """(out, lse) of softmax(score_mod(scale q k^T + bias)) v over keys seen by mask_mod and causal=, with the sinks
    in each row's denominator: the documented semantics written out on the whole grid, in float64 (lib: np, or
    torch for autograd; q, k, v, sinks are then float64 tensors)."""
    batch, n, m, d = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1]
    scores = lib.matmul(q, k.transpose(-1, -2) if lib is torch else np.swapaxes(k, -1, -2)) / math.sqrt(d)
    if bias is not None:
        scores = scores + bias
    if score_mod is not None:
        scores = score_mod(scores, *grids(batch, n, m, lib))
        scores = scores.expand(batch + (n, m)) if lib is torch and isinstance(scores, torch.Tensor) else \
            torch.full(batch + (n, m), float(scores), dtype=torch.float64) if lib is torch else \
            np.broadcast_to(scores, batch + (n, m))
    seen = np.ones(batch + (n, m), dtype=bool)
    if mask_mod is not None:
        seen = seen & np.asarray(mask_mod(*grids(batch, n, m)))
    if causal:
        i, j = grids(batch, n, m)[-2:]
        seen = seen & (j <= i + (m - n))
    if lib is torch:
        seen_t = torch.as_tensor(np.broadcast_to(seen, batch + (n, m)).copy())
        scores = scores.masked_fill(~seen_t, -math.inf)
        columns = [scores] if sinks is None else [scores, sinks.reshape(sinks.shape + (1, 1)).expand(batch + (n, 1))]
        full = torch.cat(columns, -1)
        top = full.amax(-1, keepdim=True).detach()
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        w = torch.exp(full - top)
        total = w.sum(-1, keepdim=True)
        p = torch.where(total > 0, w / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(w))
        return p[..., :m] @ v, (top + torch.log(total))[..., 0]
    scores = np.where(seen, scores, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(np.asarray(sinks, np.float64)[..., None, None], batch + (n, 1))
        scores = np.concatenate([scores, column], -1)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = scores.max(-1, keepdims=True)
        top = np.where(np.isinf(top), 0, top)
        w = np.exp(scores - top)
        total = w.sum(-1, keepdims=True)
        p = np.where(total > 0, w / total, 0)
        lse = np.where(total[..., 0] > 0, top[..., 0] + np.log(total[..., 0]), -np.inf)
    return p[..., :m] @ v, lse


def run(backend, q, k, v, **options):
    """cuflash.attention with a NaN-poisoned out=, returning (out, lse)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    out = np.full(batch + (q.shape[-2], v.shape[-1]), np.nan, dtype=q.dtype)
    result, lse = cuflash.attention(q, k, v, out=out, return_lse=True, backend=backend, **options)
    assert result is out
    return result, lse


def on_cupy(cupy, forward=True):
    """cuflash.attention (forward) or attention_backward with NumPy arrays in and out, run on the stand-in cupy's
    arrays (tests/test_cupy_shim.py): the cupy backend's path, its kernels on the emulator (the builds the simt
    backend made for the same problem)."""
    def call(*arrays, **options):
        device = [cupy.asarray(x) for x in arrays]
        if options.get("sinks") is not None:
            options = dict(options, sinks=cupy.asarray(options["sinks"]))
        if not forward:
            return tuple(g.get() for g in cuflash.attention_backward(*device, **options))
        q, k, v = device
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        out = cupy.asarray(np.full(batch + (q.shape[-2], v.shape[-1]), np.nan, dtype=q.dtype))
        result, lse = cuflash.attention(q, k, v, out=out, return_lse=True, **options)
        assert result is out
        return result.get(), lse.get()
    return call


def assert_close(actual, expected, dtype, scale=1.0):
    tol = {np.float64: 1e-10, np.float32: 2e-4}[dtype] * scale
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    same_inf = (actual == expected) & np.isinf(expected)
    np.testing.assert_allclose(np.where(same_inf, 0, actual), np.where(same_inf, 0, expected), rtol=tol, atol=tol)


def operands(rng, batch, n, m, d, dtype=np.float64):
    return tuple(rng.standard_normal(batch + (rows, d)).astype(dtype) for rows in (n, m, m))


# ----------------------------------------------------------------------------------------------------------------
# A grammar of mods: each tree renders with a library namespace (np, or torch for the reference's autograd)


class Lib:
    """np, or torch with Python numbers made tensors (int64, float64 or bool) so its functions take them."""

    def __init__(self, module):
        self.m = module

    def t(self, x):
        if self.m is not torch or isinstance(x, torch.Tensor):
            return x
        dtype = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float64
        return torch.tensor(x, dtype=dtype)

    def where(self, c, a, b):
        if self.m is torch:
            a, b = (self.t(float(x)) if isinstance(x, (int, float)) else x.double() for x in (a, b))
        return self.m.where(self.t(c), a, b)

    def __getattr__(self, name):
        fn = getattr(self.m, name)
        return lambda *args: fn(*(self.t(a) for a in args))


def render(tree, env, lib):
    """The value of a tree: env holds score, the index arguments and the captured tables."""
    op, *args = tree
    if op == "leaf":
        return env[args[0]]
    if op == "const":
        return args[0]
    if op == "table":
        table, axis = args
        return env[table][env[axis]]
    parts = [render(a, env, lib) for a in args]
    binary = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
              "//": lambda a, b: a // b, "%": lambda a, b: a % b, "<": lambda a, b: a < b,
              "<=": lambda a, b: a <= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
              "&": lambda a, b: a & b, "|": lambda a, b: a | b, "max": lib.maximum, "min": lib.minimum}
    if op in binary:
        return binary[op](*parts)
    if op == "~":
        return (not parts[0]) if isinstance(parts[0], bool) else ~parts[0]
    if op == "where":
        return lib.where(*parts)
    if op == "float":
        x = parts[0]
        if isinstance(x, (int, float)):
            return float(x) * 0.25
        return x.astype(float) * 0.25 if hasattr(x, "astype") else x.double() * 0.25
    if op == "tanh":
        return lib.tanh(parts[0] / 3.0) * 3.0
    if op == "abs":
        return lib.abs(parts[0])
    if op == "exp":
        return lib.exp(-lib.abs(parts[0]))
    raise AssertionError(op)


def int_trees(depth):
    leaf = st.one_of(st.sampled_from([("leaf", "i"), ("leaf", "j"), ("leaf", "h")]),
                     st.integers(-3, 5).map(lambda c: ("const", c)),
                     st.sampled_from([("table", "ids", "i"), ("table", "ids", "j")]))
    if depth == 0:
        return leaf
    sub = int_trees(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(["+", "-", "*", "max", "min"]), sub, sub),
        st.tuples(st.sampled_from(["//", "%"]), sub, st.integers(1, 4).map(lambda c: ("const", c))),
        st.tuples(st.just("abs"), sub))


def bool_trees(depth):
    compare = st.tuples(st.sampled_from(["<", "<=", "==", "!="]), int_trees(1), int_trees(1))
    if depth == 0:
        return compare
    sub = bool_trees(depth - 1)
    return st.one_of(compare, st.tuples(st.sampled_from(["&", "|"]), sub, sub), st.tuples(st.just("~"), sub))


def float_trees(depth):
    leaf = st.one_of(st.just(("leaf", "score")), st.floats(-2, 2).map(lambda c: ("const", c)),
                     st.just(("table", "slopes", "h")), int_trees(1).map(lambda t: ("float", t)))
    if depth == 0:
        return leaf
    sub = float_trees(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(["+", "-", "*", "max", "min"]), sub, sub),
        st.tuples(st.sampled_from(["tanh", "abs", "exp"]), sub),
        st.tuples(st.just("where"), bool_trees(0), sub, sub))


SCORE = ("leaf", "score")


def score_trees():
    """Float trees that read the score, at the top or under a unary, a product or a where: the backward's
    derivative is taken through each operation."""
    with_score = st.tuples(st.sampled_from(["+", "-", "*", "max", "min"]), st.just(SCORE), float_trees(1))
    return st.one_of(
        st.tuples(st.sampled_from(["+", "-", "*", "max", "min"]), st.just(SCORE), float_trees(2)),
        st.tuples(st.sampled_from(["tanh", "abs", "exp"]), with_score),
        st.tuples(st.sampled_from(["*", "+"]), with_score, with_score),
        st.tuples(st.just("where"), bool_trees(0), with_score, float_trees(1)))


def mod_functions(tree, kind, tables, slopes_tensor=None):
    """(the function cuflash traces, the same function on torch tensors) for a (b, h, i, j) mod; slopes_tensor:
    the torch function's slopes (a tensor that requires grad, for their gradient)."""
    ids, slopes = tables["ids"], tables["slopes"]

    def traced(*args):
        env = dict(zip(("score", "b", "h", "i", "j") if kind == "score" else ("b", "h", "i", "j"), args))
        return render(tree, dict(env, ids=ids, slopes=slopes), Lib(np))

    def dense(*args):
        env = dict(zip(("score", "b", "h", "i", "j") if kind == "score" else ("b", "h", "i", "j"), args))
        lib = Lib(torch) if kind == "score" else Lib(np)
        if kind == "score":
            env = {key: value if key == "score" else value for key, value in env.items()}
            slopes_t = torch.as_tensor(slopes) if slopes_tensor is None else slopes_tensor
            return render(tree, dict(env, ids=torch.as_tensor(ids), slopes=slopes_t), lib)
        return render(tree, dict(env, ids=ids, slopes=slopes), lib)
    return traced, dense


@st.composite
def mod_cases(draw):
    batch = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    n, m = draw(st.integers(1, 33)), draw(st.integers(1, 41))
    d = draw(st.sampled_from([1, 4, 8]))
    return dict(batch=batch, n=n, m=m, d=d, seed=draw(st.integers(0, 2**16)),
                score=draw(st.none() | score_trees() | float_trees(2)), mask=draw(st.none() | bool_trees(2)),
                causal=draw(st.booleans()), sinks=draw(st.booleans()),
                dtype=draw(st.sampled_from([np.float64, np.float32])))


def tables_for(rng, case):
    size = max(case["n"], case["m"])
    return {"ids": np.sort(rng.integers(0, 3, size)), "slopes": rng.random(case["batch"][1])}


@settings(max_examples=25)
@given(mod_cases(), st.sampled_from(BACKENDS))
def test_drawn_mods_match_the_dense_function(case, backend):
    rng = np.random.default_rng(case["seed"])
    batch, n, m, dtype = case["batch"], case["n"], case["m"], case["dtype"]
    q, k, v = operands(rng, batch, n, m, case["d"], dtype)
    tables = tables_for(rng, case)
    score_mod = None if case["score"] is None else mod_functions(case["score"], "score", tables)
    mask_mod = None if case["mask"] is None else mod_functions(case["mask"], "mask", tables)
    sinks = rng.standard_normal(batch[1:]) if case["sinks"] else None
    options = dict(score_mod=score_mod and score_mod[0], mask_mod=mask_mod and mask_mod[0], sinks=sinks,
                   causal=case["causal"])
    out, lse = run(backend, q, k, v, **options)
    if backend == "simt":  # and the cupy backend on the stand-in: the same kernels, the same bits
        with stand_in() as cupy:
            for got, want in zip(on_cupy(cupy)(q, k, v, **options), (out, lse)):
                assert got.tobytes() == want.tobytes()
    to_t = (lambda x: torch.as_tensor(np.asarray(x, np.float64)))
    expected, expected_lse = dense_reference(
        *(to_t(x) for x in (q, k, v)), score_mod=score_mod and score_mod[1], mask_mod=mask_mod and mask_mod[1],
        sinks=None if sinks is None else to_t(sinks), causal=case["causal"], lib=torch)
    assert_close(out, expected.numpy(), dtype)
    assert_close(lse, expected_lse.numpy(), dtype)


@settings(max_examples=25)
@given(mod_cases())
def test_drawn_mods_gradients_match_autograd(case):
    rng = np.random.default_rng(case["seed"])
    batch, n, m = case["batch"], case["n"], case["m"]
    q, k, v = operands(rng, batch, n, m, case["d"])
    tables = tables_for(rng, case)
    slopes = torch.tensor(tables["slopes"], requires_grad=True)
    score_mod = None if case["score"] is None else mod_functions(case["score"], "score", tables, slopes)
    mask_mod = None if case["mask"] is None else mod_functions(case["mask"], "mask", tables)
    sinks = rng.standard_normal(batch[1:]) if case["sinks"] else None
    options = dict(score_mod=score_mod and score_mod[0], mask_mod=mask_mod and mask_mod[0], sinks=sinks,
                   causal=case["causal"])
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape)
    wanted = (tables["slopes"],) if score_mod is not None else ()  # the per-head slopes a drawn score may read
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod_grads=wanted, **options)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v) + (() if sinks is None else (sinks,))]
    tensors += [slopes] if wanted else []
    expected, _ = dense_reference(*tensors[:3], score_mod=score_mod and score_mod[1],
                                  mask_mod=mask_mod and mask_mod[1], sinks=None if sinks is None else tensors[3],
                                  causal=case["causal"], lib=torch)
    expected.backward(torch.as_tensor(dout))
    assert len(grads) == len(tensors)
    for grad, tensor in zip(grads, tensors):
        assert grad.shape == tuple(tensor.shape)
        expected_grad = torch.zeros_like(tensor) if tensor.grad is None else tensor.grad  # a score of no q or k
        assert_close(grad, expected_grad.numpy(), np.float64, scale=100)


# ----------------------------------------------------------------------------------------------------------------
# The built-ins, forward and backward, against their dense formulas


def builtin_cases():
    rng = np.random.default_rng(7)
    heads, n = 4, 29
    slopes = mods.alibi_slopes(heads)
    ids = np.sort(rng.integers(0, 4, (2, n)), axis=1)
    table = rng.standard_normal((heads, 7))
    buckets = np.array([0, 1, 2, 3, 4, 5, 6])
    prefix = np.array([3, 11])
    return {
        "alibi": (dict(score_mod=mods.alibi(slopes)),
                  lambda s, b, h, i, j: s - torch.as_tensor(slopes)[h] * (i - j).abs(), None),
        "softcap": (dict(score_mod=mods.softcap(1.5)), lambda s, b, h, i, j: 1.5 * torch.tanh(s / 1.5), None),
        "documents": (dict(mask_mod=mods.documents(ids)), None, lambda b, h, i, j: ids[b, i] == ids[b, j]),
        "prefix_lm": (dict(mask_mod=mods.prefix_lm(prefix)), None, lambda b, h, i, j: (j < prefix[b]) | (j <= i)),
        "prefix_lm_int": (dict(mask_mod=mods.prefix_lm(5)), None, lambda b, h, i, j: (j < 5) | (j <= i)),
        "relative_bias": (dict(score_mod=mods.relative_bias(table, buckets)),
                          lambda s, b, h, i, j: s + torch.as_tensor(table)[h, (j - i).clamp(-3, 3) + 3], None),
        "relative_bias_fn": (dict(score_mod=mods.relative_bias(table, lambda i, j: np.minimum(np.abs(i - j), 6))),
                             lambda s, b, h, i, j: s + torch.as_tensor(table)[h, (i - j).abs().clamp(max=6)], None),
        "and_or": (dict(mask_mod=mods.or_masks(mods.and_masks(mods.documents(ids), mods.causal),
                                               mods.sliding_window(2, 1))), None,
                   lambda b, h, i, j: ((ids[b, i] == ids[b, j]) & (j <= i)) | ((j >= i - 2) & (j <= i + 1))),
    }


@pytest.mark.parametrize("name", list(builtin_cases()))
@pytest.mark.parametrize("backend", BACKENDS + ["cupy"])  # cupy: the stand-in's arrays, the simt runs' builds
def test_builtins_forward_and_backward_match_their_formulas(name, backend):
    options, score_formula, mask_formula = builtin_cases()[name]
    rng = np.random.default_rng(3)
    q, k, v = operands(rng, (2, 4), 29, 29, 8)
    with stand_in() if backend == "cupy" else contextlib.nullcontext() as cupy:
        out, lse = on_cupy(cupy)(q, k, v, **options) if cupy else run(backend, q, k, v, **options)
        dout = rng.standard_normal(out.shape)
        grads = on_cupy(cupy, forward=False)(dout, q, k, v, out, lse, **options) if cupy else \
            cuflash.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    expected, expected_lse = dense_reference(*tensors, score_mod=score_formula, mask_mod=mask_formula, lib=torch)
    expected.backward(torch.as_tensor(dout))
    assert_close(out, expected.detach().numpy(), np.float64)
    assert_close(lse, expected_lse.detach().numpy(), np.float64)
    for grad, tensor in zip(grads, tensors):
        assert_close(grad, tensor.grad.numpy(), np.float64, scale=100)


@pytest.mark.parametrize("name", ["softcap", "and_or"])
@pytest.mark.parametrize("precision", [None, "tf32"])
def test_builtins_on_the_float32_tensor_core_backward(name, precision):
    """float32's backward on tensor cores (3xTF32, one TF32 pass) with a score_mod (its slope in dS) and a
    mask_mod; the float64 cases above take float64's (DMMA)."""
    from cuflash import tiling
    from cuflash.backends import simt
    options, score_formula, mask_formula = builtin_cases()[name]
    rng = np.random.default_rng(5)
    q, k, v = operands(rng, (2, 4), 29, 29, 8, np.float32)
    out, lse = run("numpy", q, k, v, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    shape = Shape(np.float32, 8, 8, precision=precision)
    assert {plan.config.variant for plan in tiling.backward_plans(shape, simt.DEVICE)} == {"mma"}
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", precision=precision, **options)
    tensors = [torch.tensor(x.astype(np.float64), requires_grad=True) for x in (q, k, v)]
    expected, _ = dense_reference(*tensors, score_mod=score_formula, mask_mod=mask_formula, lib=torch)
    expected.backward(torch.as_tensor(dout.astype(np.float64)))
    for grad, tensor in zip(grads, tensors):
        assert_close(grad, tensor.grad.numpy(), np.float32, scale=1 if precision is None else 20)


def test_new_lengths_batch_shapes_and_contents_compile_no_kernel():
    """A kernel is compiled once per expression, dtype and tiles: after the first call, new lengths, batch
    shapes and captured arrays of new sizes and contents reach the same kernels (forward and backward)."""
    from cuflash.backends import simt
    rng = np.random.default_rng(12)
    compiled = []
    for batch, n, m in [((2, 4), 29, 29), ((3, 2), 40, 50), ((1, 4), 17, 61)]:
        q, k, v = operands(rng, batch, n, m, 8)
        ids = np.sort(rng.integers(0, 4, (batch[0], max(n, m))), axis=1)
        slopes = rng.random(batch[1])
        options = dict(mask_mod=mods.documents(ids), score_mod=mods.alibi(slopes), causal=True)
        before = set(simt._functions)
        out, lse = run("simt", q, k, v, **options)
        dout = rng.standard_normal(out.shape)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, backend="simt", **options)
        compiled.append(set(simt._functions) - before)
        tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        expected, expected_lse = dense_reference(
            *tensors, causal=True, lib=torch, mask_mod=lambda b, h, i, j: ids[b, i] == ids[b, j],
            score_mod=lambda s, b, h, i, j: s - torch.as_tensor(slopes)[h] * (i - j).abs())
        expected.backward(torch.as_tensor(dout))
        assert_close(out, expected.detach().numpy(), np.float64)
        for grad, tensor in zip(grads, tensors):
            assert_close(grad, tensor.grad.numpy(), np.float64, scale=100)
    assert compiled[1:] == [set(), set()]


def test_alibi_equals_its_bias_and_slopes_follow_the_paper():
    np.testing.assert_allclose(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    assert mods.alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    rng = np.random.default_rng(0)
    q, k, v = operands(rng, (3,), 17, 23, 4)
    slopes = np.array([0.5, 0.25, 0.125])
    i, j = np.arange(17)[:, None], np.arange(23)[None, :]
    bias = -slopes[:, None, None] * np.abs(i + 6 - j)
    np.testing.assert_allclose(cuflash.attention(q, k, v, score_mod=mods.alibi(slopes, offset=6), causal=True),
                               cuflash.attention(q, k, v, bias=bias, causal=True), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# Sinks


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_join_the_denominator_and_a_row_that_sees_nothing_gets_zero_and_the_sink(backend):
    rng = np.random.default_rng(1)
    q, k, v = operands(rng, (2, 3), 9, 12, 4)
    sinks = np.array([0.5, -1.0, 2.0])
    nothing = np.zeros((9, 12), bool)
    nothing[4:] = True  # rows 0-3 see no key
    out, lse = run(backend, q, k, v, sinks=sinks, mask=nothing)
    expected, expected_lse = dense_reference(q, k, v, sinks=sinks, mask_mod=lambda b, h, i, j: nothing[i, j])
    assert_close(out, expected, np.float64)
    assert_close(lse, expected_lse, np.float64)
    assert (out[:, :, :4] == 0).all()
    np.testing.assert_array_equal(lse[:, :, :4], np.broadcast_to(sinks[None, :, None], (2, 3, 4)))


def test_a_sink_of_minus_infinity_is_no_sink():
    rng = np.random.default_rng(2)
    q, k, v = operands(rng, (2,), 8, 8, 4)
    plain = cuflash.attention(q, k, v, return_lse=True, causal=True)
    sunk = cuflash.attention(q, k, v, return_lse=True, causal=True, sinks=np.array([-np.inf, -np.inf]))
    for a, b in zip(plain, sunk):
        np.testing.assert_array_equal(a, b)


def relative_case(seed, batch=(2, 3), n=23, m=31):
    """Inputs and a score_mod with learnable arrays: ALiBi slopes scaling a relative-position table read at two
    places, and its dense formula on torch tensors."""
    rng = np.random.default_rng(seed)
    q, k, v = operands(rng, batch, n, m, 8)
    slopes, table = rng.random(batch[-1]), rng.standard_normal((batch[-1], 9))

    def score_mod(score, b, h, i, j):
        return score - slopes[h] * np.abs(i - j) + slopes[h] * table[h, np.clip(j - i, -4, 4) + 4] + table[h, 0]

    def formula(s, b, h, i, j, slopes, table):
        return s - slopes[h] * (i - j).abs() + slopes[h] * table[h, (j - i).clamp(-4, 4) + 4] + table[h, 0]
    return rng, (q, k, v), (slopes, table), score_mod, formula


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_reach_the_arrays_score_mod_closes_over(backend):
    rng, (q, k, v), (slopes, table), score_mod, formula = relative_case(11)
    out, lse = run(backend, q, k, v, score_mod=score_mod, causal=True)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, causal=True, backend=backend,
                                       score_mod_grads=(table, slopes))
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, table, slopes)]
    expected, _ = dense_reference(*tensors[:3], score_mod=lambda s, *idx: formula(s, *idx, tensors[4], tensors[3]),
                                  causal=True, lib=torch)
    expected.backward(torch.as_tensor(dout))
    assert [g.shape for g in grads] == [tuple(t.shape) for t in tensors]
    for grad, tensor in zip(grads, tensors):
        assert_close(grad, tensor.grad.numpy(), np.float64, scale=100)
    again = cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=score_mod, causal=True, backend=backend,
                                       score_mod_grads=(table, slopes))
    assert all(np.array_equal(a, b) for a, b in zip(grads, again))  # deterministic: the same bits


def test_score_mod_grads_that_cannot_be_given_are_clear_errors():
    rng, (q, k, v), (slopes, table), score_mod, _ = relative_case(12)
    out, lse = cuflash.attention(q, k, v, score_mod=score_mod, return_lse=True)
    ids = np.arange(31)

    def by_document(score, b, h, i, j):
        return score + (ids[i] == ids[j])
    cases = [(dict(score_mod=score_mod, score_mod_grads=(slopes.copy(),)), ValueError, "does not close over"),
             (dict(score_mod=score_mod, score_mod_grads=slopes), TypeError, "must be a tuple"),
             (dict(score_mod_grads=(slopes,)), ValueError, "no score_mod= was given"),
             (dict(score_mod=by_document, score_mod_grads=(ids,)), TypeError, "has no gradient")]
    for options, error, text in cases:
        with pytest.raises(error, match=text):
            cuflash.attention_backward(out, q, k, v, out, lse, **options)


def test_sinks_broadcast_and_their_gradient_keeps_their_shape():
    rng = np.random.default_rng(4)
    q, k, v = operands(rng, (2, 3), 6, 7, 4)
    out, lse = cuflash.attention(q, k, v, sinks=0.25, return_lse=True)
    dq, dk, dv, dsinks = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, sinks=0.25)
    assert np.shape(dsinks) == ()
    per_item = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, sinks=np.full((2, 3), 0.25))[3]
    np.testing.assert_allclose(dsinks, per_item.sum(), rtol=1e-12)


@pytest.mark.parametrize("sinks, error, text", [
    (np.zeros(4), ValueError, "does not broadcast to the batch shape (2, 3)"),
    (np.zeros(3, complex), TypeError, "sinks must be a real array"),
])
def test_bad_sinks_are_clear_errors(sinks, error, text):
    q, k, v = operands(np.random.default_rng(0), (2, 3), 4, 4, 2)
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        cuflash.attention(q, k, v, sinks=sinks)


# ----------------------------------------------------------------------------------------------------------------
# What tracing refuses, and what it reads afresh at each call


def _if(b, h, i, j):
    return True if i > j else False


def _and(b, h, i, j):
    return (i > j) and (j > 0)


def _unsupported(b, h, i, j):
    return np.sort(i) > 0


IDS = np.arange(8)


def _float_index(b, h, i, j):
    return IDS[i / 2] > 0


def _made_inside(b, h, i, j):
    return np.arange(8)[i] > 0


def _returns_int(b, h, i, j):
    return i + j


@pytest.mark.parametrize("fn, text", [
    (_if, "use np.where"), (_and, r"& \| ~"), (_unsupported, "np.sort is not supported"),
    (_float_index, "an index must be an integer"), (_made_inside, "an array made inside the function is not"),
    (_returns_int, "it must return a bool"),
])
def test_what_cannot_be_traced_is_a_clear_error(fn, text):
    q, k, v = operands(np.random.default_rng(0), (1, 2), 8, 8, 2)
    with pytest.raises(TypeError, match=text):
        cuflash.attention(q, k, v, mask_mod=fn)


def test_a_mod_of_the_wrong_arity_names_the_arguments():
    q, k, v = operands(np.random.default_rng(0), (2, 3), 4, 4, 2)
    with pytest.raises(TypeError, match=r"must take 4 arguments \(b0, b1, i, j\)"):
        cuflash.attention(q, k, v, mask_mod=lambda b, i, j: i >= j)
    with pytest.raises(TypeError, match=r"must take 5 arguments \(score, b0, b1, i, j\)"):
        cuflash.attention(q, k, v, score_mod=lambda s, i, j: s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_index_outside_a_captured_array_is_an_index_error(backend):
    q, k, v = operands(np.random.default_rng(0), (1, 2), 8, 8, 2)
    ids = np.arange(6)  # shorter than n = 8
    with pytest.raises(IndexError, match=r"index 6 is out of bounds for axis 0 of table0 \(shape \(6,\)\)"):
        cuflash.attention(q, k, v, mask_mod=lambda b, h, i, j: ids[i] >= ids[j], backend=backend)
    with pytest.raises(IndexError, match="do not wrap negative indices"):
        cuflash.attention(q, k, v, mask_mod=lambda b, h, i, j: ids[i - 1] >= 0, backend=backend)


def test_new_contents_of_a_captured_array_are_read_at_the_next_call():
    rng = np.random.default_rng(5)
    q, k, v = operands(rng, (2,), 10, 10, 4)
    ids = np.zeros(10, np.int64)

    def same_document(b, i, j):
        return ids[i] == ids[j]
    first = cuflash.attention(q, k, v, mask_mod=same_document)
    ids[5:] = 1
    second = cuflash.attention(q, k, v, mask_mod=same_document)
    assert_close(first, cuflash.attention(q, k, v), np.float64)
    assert_close(second, cuflash.attention(q, k, v, mask=ids[:, None] == ids[None, :]), np.float64)
    assert mods.trace(same_document, "mask", 1).key == "mask_mod(equal(table0[idx1], table0[idx2]); table0: int[1])"


def test_the_expression_reads_every_kind_of_captured_array():
    rng = np.random.default_rng(6)
    q, k, v = operands(rng, (2,), 6, 6, 4)
    scale = np.array(0.5, np.float16)  # a 0-d array takes part as its value
    flags = np.array([True, False, True, True, False, True])
    weights = np.arange(6, dtype=np.uint8)
    out = cuflash.attention(q, k, v, score_mod=lambda s, b, i, j: s * scale + weights[j] * 0.1,
                            mask_mod=lambda b, i, j: flags[j] | (i == j))
    i, j = np.arange(6)[:, None], np.arange(6)[None, :]
    expected = cuflash.attention(q, k, v, scale=0.5 / 2, bias=np.broadcast_to(weights * 0.1, (6, 6)),
                                 mask=flags[None, :] | (i == j))
    assert_close(out, expected, np.float64)


def test_derivatives_of_every_differentiable_operation():
    """d/dscore of each operation against a central difference of its own NumPy evaluation."""
    cases = [lambda s: s * s, lambda s: s / 3, lambda s: 1 / (s + 4), lambda s: np.exp(s), lambda s: np.exp2(s),
             lambda s: np.log(s + 4), lambda s: np.log2(s + 4), lambda s: np.log1p(s + 2), lambda s: np.expm1(s),
             lambda s: np.sqrt(s + 4), lambda s: np.tanh(s), lambda s: np.sin(s), lambda s: np.cos(s),
             lambda s: np.abs(s), lambda s: np.square(s), lambda s: s ** 3, lambda s: 2.0 ** s,
             lambda s: np.maximum(s, 0.1), lambda s: np.minimum(s, 0.1), lambda s: np.clip(s, -0.5, 0.5),
             lambda s: np.where(s > 0, s, 0.1 * s), lambda s: np.reciprocal(s + 4), lambda s: np.floor(s) + s,
             lambda s: s % 0.7, lambda s: -s, lambda s: np.sign(s) * s]
    score = np.array([-1.3, -0.2, 0.35, 1.7])
    for fn in cases:
        traced = mods.trace(lambda s, i, j: fn(s), "score", 0)
        slope = mods.evaluate(mods.derivative(traced.expr), [0, 0], (), np.float64, score=score)
        h = 1e-6
        numeric = (fn(score + h) - fn(score - h)) / (2 * h)
        np.testing.assert_allclose(np.broadcast_to(slope, score.shape), numeric, rtol=1e-5, atol=1e-6)
