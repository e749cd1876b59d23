"""Hypothesis strategies for attention problems: shapes, dtypes, options and the views that hold the data.

Arrays are filled from a NumPy generator seeded by a drawn integer (drawing every element through hypothesis
would be slow); the shapes, dtypes, options and view kinds are what hypothesis explores and shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))
LENGTHS = (0, 1, 2, 7, 16, 31, 64, 113, 128, 203, 256, 300)
HEAD_DIMS = (0, 1, 3, 8, 16, 59, 64, 111, 128, 256, 300)
VIEWS = ("contiguous", "strided", "reversed", "offset", "transposed", "stride0")


OUT_KINDS = ("contiguous", "strided", "reversed")


@dataclass
class Case:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict = field(default_factory=dict)
    out_kind: str = "contiguous"  # how the NaN-poisoned out= is held

    def __repr__(self):  # what a failure prints to replay it
        def desc(x):
            return f"{x.dtype.name}{tuple(x.shape)} strides={x.strides}"
        opts = {key: (desc(val) if isinstance(val, np.ndarray) else val) for key, val in self.options.items()}
        return f"Case(q={desc(self.q)}, k={desc(self.k)}, v={desc(self.v)}, options={opts}, out_kind={self.out_kind!r})"


def make_view(rng, shape, dtype, kind, scale=1.0):
    """An array of `shape` with values ~ N(0, scale), held in the requested kind of view."""
    shape = tuple(shape)
    if kind == "strided" and shape:
        base = rng.standard_normal(shape[:-1] + (2 * shape[-1] + 1,)) * scale
        return base.astype(dtype)[..., 1::2]
    if kind == "reversed" and shape:
        return (rng.standard_normal(shape) * scale).astype(dtype)[..., ::-1, :] if len(shape) >= 2 else \
            (rng.standard_normal(shape) * scale).astype(dtype)[::-1]
    if kind == "offset":
        flat = (rng.standard_normal(int(np.prod(shape)) + 3) * scale).astype(dtype)
        return flat[3:].reshape(shape)
    if kind == "stride0" and len(shape) >= 2:  # every row the same: stride 0 along n or m
        row = (rng.standard_normal(shape[:-2] + (1, shape[-1])) * scale).astype(dtype)
        return np.broadcast_to(row, shape)
    if kind == "transposed" and len(shape) >= 2:
        swapped = shape[:-2] + (shape[-1], shape[-2])
        return np.swapaxes((rng.standard_normal(swapped) * scale).astype(dtype), -1, -2)
    return (rng.standard_normal(shape) * scale).astype(dtype)


@st.composite
def batch_shapes(draw, max_dims=2):
    """A result batch shape and, per operand, a shape broadcastable to it (size-1 or missing dims)."""
    dims = draw(st.lists(st.integers(1, 3), max_size=max_dims))
    if dims and draw(st.booleans()) and draw(st.integers(0, 9)) == 0:
        dims[draw(st.integers(0, len(dims) - 1))] = 0  # empty batch
    batch = tuple(dims)

    def operand():
        shape = [1 if draw(st.integers(0, 3)) == 0 else b for b in batch]
        return tuple(shape[draw(st.integers(0, len(shape))):]) if shape and draw(st.booleans()) else tuple(shape)

    return batch, operand, operand, operand


@st.composite
def cases(draw, dtypes=FLOAT_DTYPES, lengths=LENGTHS, head_dims=HEAD_DIMS, mixed_dtypes=True,
          masks=True, biases=True, windows=True, views=VIEWS, max_batch_dims=2, key_lengths=None):
    """key_lengths: where m is drawn from (default: lengths, like n)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, m = draw(st.sampled_from(lengths)), draw(st.sampled_from(key_lengths or lengths))
    d, e = draw(st.sampled_from(head_dims)), draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(dtypes))
    q_dtype = k_dtype = v_dtype = dtype
    if mixed_dtypes and draw(st.integers(0, 5)) == 0:
        k_dtype = draw(st.sampled_from(dtypes))
    batch, qb, kb, vb = draw(batch_shapes(max_batch_dims))
    view = lambda: draw(st.sampled_from(views))  # noqa: E731
    q = make_view(rng, qb() + (n, d), q_dtype, view())
    k = make_view(rng, kb() + (m, d), k_dtype, view())
    v = make_view(rng, vb() + (m, e), v_dtype, view())
    options = {}
    if draw(st.booleans()):
        options["scale"] = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, -0.5]))
    if windows:
        options["causal"] = draw(st.booleans())
        if draw(st.integers(0, 2)) == 0:
            side = st.one_of(st.none(), st.integers(-8, 40))
            options["window"] = (draw(side), draw(side))
    if masks and draw(st.integers(0, 2)) == 0:
        mshape = draw(st.sampled_from([(n, m), (1, m), (n, 1), (m,)]))
        mshape = (qb() + mshape) if len(mshape) == 2 else mshape
        options["mask"] = rng.random(mshape) < draw(st.sampled_from([0.1, 0.5, 0.9]))
    if biases and draw(st.integers(0, 2)) == 0:
        bshape = draw(st.sampled_from([(n, m), (1, m), (n, 1)]))
        bias_dtype = draw(st.sampled_from([np.float32, dtype, np.float64]))
        options["bias"] = make_view(rng, kb() + bshape, bias_dtype, view(), scale=2.0)
    case = Case(q, k, v, options)
    case.out_kind = draw(st.sampled_from(OUT_KINDS))
    return case
