"""Hypothesis strategies for attention problems: shapes, dtypes, options and the views that hold the data.

Arrays are filled from a NumPy generator seeded by a drawn integer (drawing every element through hypothesis
would be slow); the shapes, dtypes, options and view kinds are what hypothesis explores and shrinks.

Empty sizes (n, m, d or a batch dimension of 0) are named tests of their own, not draws: drawn, they took a
quarter of every property's examples and proved nothing new each time. What the draws reach is recorded with
hypothesis's events (`python -m pytest --hypothesis-show-statistics` shows them; harness.record_events).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))
LENGTHS = (1, 2, 7, 16, 31, 64, 113, 128, 203, 256, 300)
HEAD_DIMS = (1, 3, 8, 16, 59, 64, 111, 128, 256, 300)
# How far q and k reach: 1 is the usual, 12 makes scores of several hundred, so lse passes 88 (exp overflows
# float32) and every exponent must be taken after subtracting a maximum: in the online softmax and in the merge
# of split keys.
MAGNITUDES = (1.0, 1.0, 1.0, 12.0)
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


def randn(seed, shape, dtype=np.float32, scale=1.0):
    """Values ~ N(0, scale) of `shape` in `dtype`: the one helper for named tests' data. seed: an int, or a
    NumPy Generator whose stream it continues."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


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
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=max_dims)))

    def operand():
        shape = [1 if draw(st.integers(0, 3)) == 0 else b for b in batch]
        return tuple(shape[draw(st.integers(0, len(shape))):]) if shape and draw(st.booleans()) else tuple(shape)

    return batch, operand, operand, operand


@st.composite
def cases(draw, dtypes=FLOAT_DTYPES, lengths=LENGTHS, head_dims=HEAD_DIMS, mixed_dtypes=True,
          masks=True, biases=True, windows=True, views=VIEWS, max_batch_dims=2, key_lengths=None,
          magnitudes=MAGNITUDES, poison=True):
    """key_lengths: where m is drawn from (default: lengths, like n). magnitudes: the spread of q and k.
    poison: put NaN and inf into keys and values that the window, mask or a -inf bias hide (poison_hidden):
    sometimes, and always where the bias hides keys."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n, m = draw(st.sampled_from(lengths)), draw(st.sampled_from(key_lengths or lengths))
    d, e = draw(st.sampled_from(head_dims)), draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(dtypes))
    q_dtype = k_dtype = v_dtype = dtype
    if mixed_dtypes and draw(st.integers(0, 5)) == 0:
        k_dtype = draw(st.sampled_from(dtypes))
    batch, qb, kb, vb = draw(batch_shapes(max_batch_dims))
    view = lambda: draw(st.sampled_from(views))  # noqa: E731
    reach = draw(st.sampled_from(magnitudes))
    q = make_view(rng, qb() + (n, d), q_dtype, view(), scale=reach)
    k = make_view(rng, kb() + (m, d), k_dtype, view(), scale=reach)
    v = make_view(rng, vb() + (m, e), v_dtype, view())
    options = {}
    hidden_by_bias = False
    if draw(st.booleans()):
        options["scale"] = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, -0.5]))
    if windows:
        options["causal"] = draw(st.booleans())
        if draw(st.integers(0, 2)) == 0:
            side = st.sampled_from((None, -1, 0, 2, 9, 40, -8, 1, 17))
            options["window"] = (draw(side), draw(side))
    if masks and draw(st.integers(0, 2)) == 0:
        mshape = draw(st.sampled_from([(n, m), (1, m), (n, 1), (m,)]))
        mshape = (qb() + mshape) if len(mshape) == 2 else mshape
        options["mask"] = rng.random(mshape) < draw(st.sampled_from([0.1, 0.5, 0.9]))
    if biases and draw(st.integers(0, 2)) == 0:
        bshape = draw(st.sampled_from([(n, m), (1, m), (n, 1)]))
        bias_dtype = draw(st.sampled_from([np.float32, dtype, np.float64]))
        options["bias"] = make_view(rng, kb() + bshape, bias_dtype, view(), scale=2.0)
        if bshape[-1] == m and options["bias"].flags.writeable and draw(st.integers(0, 3)) > 0:
            options["bias"][..., rng.random(m) < 0.3] = -np.inf  # keys hidden by bias alone, as a mask would
            hidden_by_bias = True  # poisoned below: NaN there must not count
    case = Case(q, k, v, options)
    if poison and (hidden_by_bias or draw(st.integers(0, 2)) == 0):
        poison_hidden(rng, case)
    case.out_kind = draw(st.sampled_from(OUT_KINDS))
    return case


def hidden_keys(case):
    """Keys that the window, mask and -inf bias hide from every query row of every batch item."""
    from reference import visible_pairs  # the reference's own rule, not a backend's
    n, m = case.q.shape[-2], case.k.shape[-2]
    if n == 0:
        return np.ones(m, dtype=bool)
    o = case.options
    vis = visible_pairs(n, m, o.get("causal", False), o.get("window"), o.get("mask"), o.get("bias"))
    return ~vis.reshape(-1, n, m).any(axis=(0, 1))


def poison_hidden(rng, case):
    """NaN and inf where they must never reach the output: whole keys and values that every row has hidden (an
    unfilled KV cache, padding), and NaN in single values of other keys, which reaches exactly the rows that see
    them (as in the reference). Held views stay what they were; stride-0 key axes are left alone."""
    def writable(x):
        return x.flags.writeable and x.shape[-2] and x.strides[-2] != 0 and x.size
    hidden = np.flatnonzero(hidden_keys(case))
    picked = rng.choice(hidden, size=min(hidden.size, 3), replace=False)
    if picked.size and writable(case.k):
        case.k[..., picked, :] = np.nan
    if picked.size and writable(case.v) and case.v.shape[-1]:
        case.v[..., picked, :] = np.inf
        case.v[..., picked[:1], -1] = -np.inf
        case.v[..., picked[-1:], 0] = np.nan
    m, e = case.v.shape[-2:]
    if writable(case.v) and e and rng.random() < 0.5:
        case.v[..., rng.integers(m), rng.integers(e)] = np.nan
