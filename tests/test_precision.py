"""precision=: accepted by every door (attention, attention_backward, cuflash.dask, cuflash.torch), refused with the
allowed values named, carried normalized on the Problem and the planner's Shape; the numpy backend gives the same
bits whatever it is."""

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
import cuflash.backends as registry
from cuflash.backends import numpy as numpy_backend
from cuflash.family import PRECISIONS, Shape
from harness import problem_and_outputs
from reference import assert_accurate
from strategies import cases, randn

OPTIONS = ("scale", "causal", "window", "mask", "bias")
ACCEPTED = (None,) + PRECISIONS
ALLOWED = r"'highest', 'tf32', 'fma' or None"
BAD_STRINGS = ("TF32", "high", "", "fp32", "bf16")
BAD_TYPES = (1, 0.5, True, b"tf32", ["tf32"])
# (dtype, precision=, what the Problem carries): "tf32" is a float32 choice, "highest" for every other dtype.
NORMALIZED = [(np.float32, None, "highest"), (np.float32, "highest", "highest"), (np.float32, "tf32", "tf32"),
              (np.float32, "fma", "fma"), (np.float64, None, "highest"), (np.float64, "tf32", "highest"),
              (np.float64, "fma", "fma"), (np.float16, "tf32", "highest"), (np.float16, "fma", "fma"),
              (ml_dtypes.bfloat16, "tf32", "highest"), (ml_dtypes.bfloat16, "highest", "highest")]


def qkv(dtype=np.float32, n=6, m=9, d=8, e=5, seed=0):
    rng = np.random.default_rng(seed)
    return randn(rng, (2, n, d), dtype), randn(rng, (2, m, d), dtype), randn(rng, (2, m, e), dtype)


class Recorder:
    """A stand-in backend that records each Problem it gets and runs the numpy backend on it."""

    ARRAYS = "numpy"

    def __init__(self):
        self.problems = []

    def unavailable(self):
        return None

    def run(self, problem, out, lse, block=None):
        self.problems.append(("forward", problem))
        numpy_backend.run(problem, out, lse, block)

    def run_backward(self, problem, dout, out, lse, grads, block=None):
        self.problems.append(("backward", problem))
        numpy_backend.run_backward(problem, dout, out, lse, grads, block)

    def precisions(self):
        return [(kind, problem.precision) for kind, problem in self.problems]


@pytest.fixture
def recorder(monkeypatch):
    spy = Recorder()
    monkeypatch.setattr(registry, "get", lambda name, xp: spy)
    return spy


# ----------------------------------------------------------------------------------------------------------------
# The numpy backend computes the same whatever precision= is


@given(cases(dtypes=(np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)), lengths=(1, 5, 33),
             head_dims=(1, 8, 33), max_batch_dims=1), st.sampled_from(ACCEPTED[1:]))
@settings(max_examples=30)
def test_every_precision_gives_the_default_bits(case, precision):
    options = {key: case.options[key] for key in OPTIONS if key in case.options}
    out, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **options)
    got, got_lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, precision=precision, **options)
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(got_lse, lse)
    dout = randn(1, out.shape, np.float64).astype(out.dtype)
    bias_grad = options.get("bias") is not None
    grads = cuflash.attention_backward(dout, case.q, case.k, case.v, out, lse, bias_grad=bias_grad, **options)
    got = cuflash.attention_backward(dout, case.q, case.k, case.v, out, lse, bias_grad=bias_grad,
                                     precision=precision, **options)
    assert len(got) == len(grads)
    for g, want in zip(got, grads):
        assert g.dtype == want.dtype
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize("precision", ACCEPTED)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_every_dtype_accepts_every_precision(dtype, precision):
    q, k, v = qkv(dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, precision=precision)
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v, causal=True))
    grads = cuflash.attention_backward(out, q, k, v, out, lse, causal=True, precision=precision)
    for g, want in zip(grads, cuflash.attention_backward(out, q, k, v, out, lse, causal=True)):
        np.testing.assert_array_equal(g, want)


# ----------------------------------------------------------------------------------------------------------------
# Refused, naming what was given and the allowed values


@pytest.mark.parametrize("precision", BAD_STRINGS)
def test_unknown_precision_is_a_value_error(precision):
    q, k, v = qkv()
    message = rf"attention: unknown precision {precision!r}; choose one of {ALLOWED}"
    with pytest.raises(ValueError, match=message):
        cuflash.attention(q, k, v, precision=precision)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=message):
        cuflash.attention_backward(out, q, k, v, out, lse, precision=precision)


@pytest.mark.parametrize("precision", BAD_TYPES)
def test_precision_of_another_type_is_a_type_error(precision):
    q, k, v = qkv()
    message = rf"attention: precision must be one of {ALLOWED}, got {re.escape(repr(precision))} " \
              rf"\({type(precision).__name__}\)"
    with pytest.raises(TypeError, match=message):
        cuflash.attention(q, k, v, precision=precision)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match=message):
        cuflash.attention_backward(out, q, k, v, out, lse, precision=precision)


def test_a_bad_precision_is_refused_on_every_dtype_before_any_work(recorder):
    for dtype in (np.float16, np.float64):
        q, k, v = qkv(dtype)
        with pytest.raises(ValueError, match="unknown precision 'tf16'"):
            cuflash.attention(q, k, v, precision="tf16")
    assert recorder.problems == []


# ----------------------------------------------------------------------------------------------------------------
# Carried normalized: Problem.precision and Problem.shape.precision


@pytest.mark.parametrize("dtype, precision, expected", NORMALIZED)
def test_problem_and_shape_carry_the_normalized_precision(dtype, precision, expected):
    q, k, v = qkv(dtype)
    problem = problem_and_outputs(q, k, v, precision=precision)[0]
    assert problem.precision == expected and type(problem.precision) is str
    assert problem.shape.precision == expected
    assert problem.shape == Shape(dtype, 8, 5, 6, 9, 2, expected)


@pytest.mark.parametrize("dtype, precision, expected", NORMALIZED)
def test_forward_and_backward_problems_carry_it(recorder, dtype, precision, expected):
    q, k, v = qkv(dtype)
    out, lse = cuflash.attention(q, k, v, return_lse=True, precision=precision)
    cuflash.attention_backward(out, q, k, v, out, lse, precision=precision)
    assert recorder.precisions() == [("forward", expected), ("backward", expected)]


def test_the_common_dtype_decides_what_tf32_means():
    """float16 queries with float32 keys compute in float32, where "tf32" stands."""
    q, k, v = qkv(np.float16)
    problem = problem_and_outputs(q, k.astype(np.float32), v, precision="tf32")[0]
    assert problem.dtype == np.float32 and problem.precision == "tf32"
    problem = problem_and_outputs(q, k.astype(np.float64), v, precision="tf32")[0]
    assert problem.dtype == np.float64 and problem.precision == "highest"


def test_a_numpy_string_is_taken_as_its_str():
    q, k, v = qkv()
    problem = problem_and_outputs(q, k, v, precision=np.str_("tf32"))[0]
    assert problem.precision == "tf32" and type(problem.precision) is str


def test_the_simt_backend_plans_with_the_problems_precision(monkeypatch):
    """The GPU backends hand Problem.shape to the planner: its precision is the Problem's (no kernel runs)."""
    from cuflash.backends import simt

    class Planned(Exception):
        pass

    def plan(shape, device, block=None, kind="forward"):
        raise Planned(shape)
    monkeypatch.setattr(simt.tiling, "plan", plan)
    q, k, v = qkv()
    problem, out, lse = problem_and_outputs(q, k, v, precision="tf32")
    with pytest.raises(Planned) as planned:
        simt.run(problem, out, lse)
    assert planned.value.args[0].precision == "tf32"


# ----------------------------------------------------------------------------------------------------------------
# The planner's key


def test_shape_takes_precision_after_batch_size_and_defaults_to_highest():
    assert Shape(np.float32, 64, 64, 128, 256, 4).precision == "highest"
    assert Shape(np.float32, 64, 64, 128, 256, 4, "tf32").precision == "tf32"
    assert Shape(np.float32, 64, 64, precision=None) == Shape(np.float32, 64, 64)


@pytest.mark.parametrize("dtype, precision, expected", NORMALIZED)
def test_shape_normalizes_as_the_problem_does(dtype, precision, expected):
    shape = Shape(dtype, 64, 64, precision=precision)
    assert shape.precision == expected
    assert shape == Shape(dtype, 64, 64, precision=expected) and hash(shape) == hash(Shape(dtype, 64, 64, None,
                                                                                         None, 1, expected))


def test_shape_names_a_precision_other_than_highest():
    assert str(Shape(np.float32, 64, 64)) == "d=64 float32"
    assert str(Shape(np.float32, 64, 64, precision="highest")) == "d=64 float32"
    assert str(Shape(np.float32, 64, 64, precision="tf32")) == "d=64 float32, precision='tf32'"
    assert str(Shape(np.float16, 64, 32, precision="fma")) == "d=64, e=32 float16, precision='fma'"
    assert str(Shape(np.float16, 64, 64, precision="tf32")) == "d=64 float16"


def test_shape_refuses_an_unknown_precision():
    with pytest.raises(ValueError, match=rf"Shape: unknown precision 'fast'; choose one of {ALLOWED}"):
        Shape(np.float32, 64, 64, precision="fast")
    with pytest.raises(TypeError, match="Shape: precision must be one of"):
        Shape(np.float32, 64, 64, precision=32)


# ----------------------------------------------------------------------------------------------------------------
# cuflash.dask


def test_dask_accepts_it_and_each_task_gets_it_normalized(monkeypatch):
    da = pytest.importorskip("dask.array")
    import cuflash.dask as cd
    seen = []
    real = cuflash.api._attention

    def recorded(*args):
        seen.append(args[-1])  # each task's precision, the last argument
        return real(*args)
    monkeypatch.setattr(cuflash.api, "_attention", recorded)
    for dtype, expected in ((np.float32, "tf32"), (np.float16, "highest")):
        seen.clear()
        q, k, v = qkv(dtype, n=40, m=50)
        chunked = [da.from_array(x, chunks=(1, 20, x.shape[-1])) for x in (q, k, v)]
        out = cd.attention(*chunked, causal=True, precision="tf32").compute(scheduler="sync")
        assert_accurate(out, q, k, v, causal=True)
        assert seen and set(seen) == {expected}


def test_dask_graphs_of_different_precisions_have_different_names():
    da = pytest.importorskip("dask.array")
    import cuflash.dask as cd
    q = da.ones((2, 8, 4), chunks=(1, 4, 4), dtype=np.float32)
    names = {cd.attention(q, q, q, precision=p).name for p in ACCEPTED}
    assert len(names) == 3  # None and "highest" are one precision


def test_dask_refuses_a_bad_precision_before_computing():
    da = pytest.importorskip("dask.array")
    import cuflash.dask as cd
    q = da.ones((8, 4), chunks=4, dtype=np.float32)
    with pytest.raises(ValueError, match=rf"cuflash\.dask\.attention: unknown precision 'TF32'; choose one of "
                                         rf"{ALLOWED}"):
        cd.attention(q, q, q, precision="TF32")
    with pytest.raises(TypeError, match=rf"cuflash\.dask\.attention: precision must be one of {ALLOWED}, got 1"):
        cd.attention(q, q, q, precision=1)


# ----------------------------------------------------------------------------------------------------------------
# cuflash.torch: forward and backward


@pytest.mark.parametrize("dtype, precision, expected", [(np.float32, "tf32", "tf32"), (np.float32, None, "highest"),
                                                        (np.float64, "tf32", "highest"), (np.float32, "fma", "fma")])
def test_torch_forward_and_backward_carry_it(recorder, dtype, precision, expected):
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(dtype))
    out = ct.attention(q, k, v, causal=True, precision=precision)
    out.square().sum().backward()
    assert recorder.precisions() == [("forward", expected), ("backward", expected)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_results_and_gradients_are_the_defaults(precision):
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    results = []
    for value in (None, precision):
        q, k, v = (torch.from_numpy(x).requires_grad_() for x in qkv(np.float32))
        out, lse = ct.attention(q, k, v, causal=True, return_lse=True, precision=value)
        out.square().sum().backward()
        results.append([out, lse, q.grad, k.grad, v.grad])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_torch_refuses_a_bad_precision_with_the_allowed_values():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    q = torch.ones(4, 8)
    with pytest.raises(ValueError, match=rf"cuflash\.torch\.attention: unknown precision 'TF32'; choose one of "
                                         rf"{ALLOWED}"):
        ct.attention(q, q, q, precision="TF32")
    with pytest.raises(TypeError, match=rf"cuflash\.torch\.attention: precision must be one of {ALLOWED}, got 3"):
        ct.attention(q, q, q, precision=3)


def test_torch_fake_tensors_take_it():
    torch = pytest.importorskip("torch")
    import cuflash.torch  # noqa: F401  (registers the operators)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, dtype=torch.float32)
        out, lse = torch.ops.cuflash.attention_forward(q, q, q, None, None, None, False, None, None, "tf32")
        assert out.shape == (2, 5, 8) and lse.shape == (2, 5)
        grads = torch.ops.cuflash.attention_backward(out, q, q, q, out, lse, None, None, None, False, None, None,
                                                     False, "fma")
        assert [g.shape for g in grads] == [q.shape] * 3
