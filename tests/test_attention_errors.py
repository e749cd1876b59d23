"""Every error path of the front door: the exception type, and a message that names the problem."""

import numpy as np
import pytest

import cuflash


def qkv(n=4, m=5, d=3, e=2, batch=(), dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal(batch + (n, d)).astype(dtype), rng.standard_normal(batch + (m, d)).astype(dtype),
            rng.standard_normal(batch + (m, e)).astype(dtype))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_wrong_rank(which):
    args = list(qkv())
    args[which] = args[which][0]
    with pytest.raises(ValueError, match=rf"Input operand {which} does not have enough dimensions \(has 1, "
                                         r"gufunc core with signature \(n,d\),\(m,d\),\(m,e\)->\(n,e\) requires 2\)"):
        cuflash.attention(*args)


def test_core_dim_mismatch_in_d():
    q, k, v = qkv(d=3)
    with pytest.raises(ValueError, match=r"Input operand 1 has a mismatch in its core dimension 1, with gufunc "
                                         r"signature \(n,d\),\(m,d\),\(m,e\)->\(n,e\) \(size 4 is different from 3\)"):
        cuflash.attention(q, np.ones((5, 4), np.float32), v)


def test_core_dim_mismatch_in_m():
    q, k, v = qkv(m=5)
    with pytest.raises(ValueError, match=r"Input operand 2 has a mismatch in its core dimension 0.*"
                                         r"\(size 6 is different from 5\)"):
        cuflash.attention(q, k, np.ones((6, 2), np.float32))


def test_batch_does_not_broadcast():
    q, _, _ = qkv(batch=(2, 3))
    _, k, v = qkv(batch=(4, 1))
    with pytest.raises(ValueError, match=r"batch dimensions could not be broadcast together: q \(2, 3\), k \(4, 1\)"):
        cuflash.attention(q, k, v)


def test_mask_of_wrong_shape():
    q, k, v = qkv(n=4, m=5)
    with pytest.raises(ValueError,
                       match=r"mask of shape \(4, 4\) does not broadcast to \(\*batch, n, m\) with n=4, m=5"):
        cuflash.attention(q, k, v, mask=np.ones((4, 4), bool))


def test_bias_batch_does_not_broadcast():
    q, k, v = qkv(batch=(2,))
    with pytest.raises(ValueError, match=r"batch dimensions.*bias \(3,\)"):
        cuflash.attention(q, k, v, bias=np.zeros((3, 4, 5)))


@pytest.mark.parametrize("dtype", [np.complex64, object, "U3"])
def test_bad_dtype(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"unsupported dtype.*must be real"):
        cuflash.attention(q.astype(dtype), k, v)


def test_mask_must_be_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"mask must be a boolean array.*got dtype\('int64'\)"):
        cuflash.attention(q, k, v, mask=np.ones((4, 5), np.int64))


def test_bias_must_be_real():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"bias must be a real array, got dtype\('complex128'\)"):
        cuflash.attention(q, k, v, bias=np.ones((4, 5), complex))


def test_out_of_wrong_shape():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"out has shape \(4, 3\) but the result has shape \(4, 2\)"):
        cuflash.attention(q, k, v, out=np.empty((4, 3), np.float32))


def test_out_of_uncastable_dtype():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"Cannot cast ufunc 'attention' output from dtype\('float32'\) "
                                        r"to dtype\('int32'\) with casting rule 'same_kind'"):
        cuflash.attention(q, k, v, out=np.empty((4, 2), np.int32))


def test_out_read_only():
    q, k, v = qkv()
    out = np.empty((4, 2), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        cuflash.attention(q, k, v, out=out)


def test_out_not_an_array():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"out must be a numpy.ndarray"):
        cuflash.attention(q, k, v, out=[[0.0] * 2] * 4)


class DeviceArray:
    """Stands in for a CuPy array (making a real one needs a device): the check goes by the type's module."""


DeviceArray.__module__ = "cupy._core.core"


def test_mixed_array_types():
    q, k, v = qkv()
    fake = DeviceArray()
    with pytest.raises(TypeError, match=r"operands mix NumPy and CuPy arrays \(q, v NumPy; k CuPy\)"):
        cuflash.attention(q, fake, v)


@pytest.mark.parametrize("window, message", [
    ((1, 2, 3), "window must be a pair"),
    (5, "window must be a pair"),
    ((1.5, None), "window left must be an int or None, got 1.5"),
    ((None, "2"), "window right must be an int or None, got '2'"),
    ((True, None), "window left must be an int or None, got True"),
])
def test_bad_window(window, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cuflash.attention(q, k, v, window=window)


def test_bad_causal():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal must be True or False"):
        cuflash.attention(q, k, v, causal="yes")


@pytest.mark.parametrize("scale, error", [("0.5", TypeError), (np.inf, ValueError), (np.nan, ValueError),
                                          (1j, TypeError)])
def test_bad_scale(scale, error):
    q, k, v = qkv()
    with pytest.raises(error, match="scale must be"):
        cuflash.attention(q, k, v, scale=scale)


def test_unknown_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"unknown backend 'torch'; choose one of 'numpy', 'cupy', 'simt' or None"):
        cuflash.attention(q, k, v, backend="torch")


def test_cupy_backend_on_numpy_arrays():
    q, k, v = qkv()
    with pytest.raises((TypeError, cuflash.BackendUnavailableError), match=r"backend 'cupy'"):
        cuflash.attention(q, k, v, backend="cupy")


@pytest.mark.parametrize("block", [(0, 4), (4,), "big", (2.5, 3), (True, 4)])
def test_bad_block_for_numpy(block):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"block must be a pair \(Br, Bc\) of positive ints"):
        cuflash.attention(q, k, v, block=block)
