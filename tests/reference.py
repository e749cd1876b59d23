"""The accuracy rule the tests hold every backend to, on top of the truth (cuflash.reference: naive, materialized
attention in float64, written apart from every backend): the error of naive attention computed in the input dtype,
row by row, and the gradients' reference and rule.
"""

from __future__ import annotations

import math

import numpy as np

from cuflash.reference import attention_reference, visibility, visible_pairs

__all__ = ["assert_accurate", "assert_grads_accurate", "attention_grads_reference", "attention_reference",
           "naive_grads_in_dtype", "naive_in_dtype", "visibility", "visible_pairs"]


def round_to(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float64 if dtype == np.float64 else np.float32)


def round_tf32(x):
    """float32 values rounded to TF32 (10 explicit mantissa bits, to nearest, ties away from zero), as
    cvt.rna.tf32.f32 rounds them; infinities and NaN kept."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x)


def naive_in_dtype(q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None, tf32=False):
    """Naive materialized attention with every intermediate (S, P, O) rounded to the input dtype, matmuls
    accumulating in float32 (float64 for float64): the error budget a backend is measured against. Returns
    (out, lse), lse = max + log(sum of exp) of the rounded scores in the accumulation type. tf32 (float32): the
    operands of both products, q, k, v and P, rounded to TF32 too, as one TF32 tensor-core pass rounds them."""
    dtype = np.dtype(result_dtype_name(q, k, v))
    acc = np.float64 if dtype == np.float64 else np.float32
    q, k, v = (np.asarray(x).astype(dtype).astype(acc) for x in (q, k, v))
    if tf32:
        q, k, v = round_tf32(q), round_tf32(k), round_tf32(v)
    n, d = q.shape[-2:]
    m = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    s = round_to(np.matmul(q, np.swapaxes(k, -1, -2)), dtype) * acc(scale)
    if bias is not None:
        s = s + np.asarray(bias).astype(acc)
    s = round_to(s, dtype)
    vis = visible_pairs(n, m, causal, window, mask, bias)
    s = np.where(vis, s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = s.max(axis=-1, keepdims=True, initial=-np.inf)
        w = np.exp(s - np.where(top == -np.inf, 0, top))
        total = w.sum(axis=-1, keepdims=True)
        p = round_to(w / total, dtype)
        p = np.where(vis, round_tf32(p) if tf32 else p, 0)
        v_clean = np.where(np.isfinite(v), v, 0)
        out = round_to(np.matmul(np.nan_to_num(p), v_clean), dtype)
        lse = (top + np.log(total))[..., 0]
    return out, lse


def score_condition(q, k, *, scale=None, causal=False, window=None, mask=None, bias=None):
    """Per query row, the largest |scale| * sum_x |q_ix k_jx| + |bias_ij| over its visible keys: what one
    rounding of a score in the accumulation type is relative to (0 for a row that sees nothing)."""
    q, k = (np.abs(np.nan_to_num(np.asarray(x).astype(np.float64), posinf=0, neginf=0)) for x in (q, k))
    n, d = q.shape[-2:]
    m = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    cond = np.matmul(q, np.swapaxes(k, -1, -2)) * abs(scale)
    if bias is not None:
        cond = cond + np.abs(np.nan_to_num(np.asarray(bias).astype(np.float64), posinf=0, neginf=0))
    vis = visible_pairs(n, m, causal, window, mask, bias)
    return np.where(vis, cond, 0).max(axis=-1, initial=0)


ABS_TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-4, "bfloat16": 2e-3}
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "tf32": 2.0**-11}  # of the scores' arithmetic
EPSILON = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def assert_accurate(result, q, k, v, *, lse=None, precision=None, **options):
    """The accuracy rule, row by row: for each output row, |result - reference| <= 2 * (the largest error of naive
    attention in the input dtype on that row) + a small absolute term, with NaN exactly where the reference has
    NaN. Per row, so one ill-conditioned row never loosens the bound of another.

    The absolute term is ABS_TOL of the row's largest output, plus two roundings of the row's largest score in
    the accumulation type (score_condition, times the largest |v|): with logits in the hundreds, one rounding of
    a score moves P by more than naive's own error happens to reach on some rows, and no exact algorithm in that
    type avoids it. lse is held to the same rule: 2 * naive's lse error on the row + the same two roundings +
    1e-5 of |lse| (1e-12 in float64).

    precision="tf32" (float32 in one TF32 pass) is held to the same rule with TF32 in place of float32 where the
    products round: naive attention with TF32-rounded operands (naive_in_dtype's tf32), and two TF32 roundings of
    the row's largest score. Any other precision: float32's own rule."""
    ref_out, ref_lse = attention_reference(q, k, v, **options)
    result = np.asarray(result).astype(np.float64)
    assert result.shape == ref_out.shape, (result.shape, ref_out.shape)
    nan_ref = np.isnan(ref_out)
    np.testing.assert_array_equal(np.isnan(result), nan_ref,
                                  err_msg="NaN where the reference has none, or not where it has")
    infinite = np.isinf(ref_out)
    np.testing.assert_array_equal(result[infinite], ref_out[infinite], err_msg="infinities differ from the reference")
    finite = ~nan_ref & ~infinite
    dtype = np.dtype(result_dtype_name(q, k, v))
    tf32 = precision == "tf32" and dtype == np.float32
    acc_name = "float64" if dtype == np.float64 else "tf32" if tf32 else "float32"
    naive, naive_lse = naive_in_dtype(q, k, v, tf32=tf32, **options)
    naive = naive.astype(np.float64)
    naive_err = np.where(finite & np.isfinite(naive), np.abs(naive - ref_out), 0).max(axis=-1, initial=0)
    rounding = 2 * UNIT_ROUNDOFF[acc_name] * np.broadcast_to(score_condition(q, k, **options), ref_lse.shape)
    v_abs = np.abs(np.asarray(v).astype(np.float64))
    v_max = float(v_abs[np.isfinite(v_abs)].max(initial=0))
    row_scale = np.maximum(1.0, np.where(finite, np.abs(ref_out), 0).max(axis=-1, initial=0))
    atol = ABS_TOL[dtype.name] * row_scale + rounding * v_max
    bound = 2 * naive_err + atol  # one per row
    err = np.where(finite, np.abs(result - ref_out), 0).max(axis=-1, initial=0)
    bad = err > bound
    if bad.any():
        row = tuple(int(i) for i in np.argwhere(bad)[np.argmax((err - bound)[bad])])
        raise AssertionError(
            f"{int(bad.sum())} of {bad.size} rows exceed the rule's bound; worst row {row}: max error {err[row]:.3g} > "
            f"bound {bound[row]:.3g} (2 x naive {naive_err[row]:.3g} + atol {atol[row]:.3g})")
    if lse is not None:
        lse = np.asarray(lse).astype(np.float64)
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="lse -inf rows differ")
        ok = np.isfinite(ref_lse)
        naive_lse = np.broadcast_to(naive_lse, ref_lse.shape)
        with np.errstate(invalid="ignore"):  # -inf - -inf on rows that see nothing: not compared
            naive_lse_err = np.where(ok & np.isfinite(naive_lse), np.abs(naive_lse - ref_lse), 0)[ok]
        rel = 1e-12 if dtype == np.float64 else 1e-5
        lse_tol = 2 * naive_lse_err + rounding[ok] + rel * np.maximum(1.0, np.abs(ref_lse[ok]))
        err = np.abs(lse[ok] - ref_lse[ok])
        assert (err <= lse_tol).all(), f"lse error {err.max():.3g} exceeds its bound on {(err > lse_tol).sum()} rows"


def result_dtype_name(q, k, v):
    """The front door's promotion rule, stated here on its own: NumPy's, bfloat16 promoting like float16,
    float16 with bfloat16 giving float32, integers and bools computing in float64."""
    names = {np.dtype(x.dtype).name for x in (q, k, v)}
    if {"float16", "bfloat16"} <= names:
        wide = [x.dtype for x in (q, k, v) if x.dtype.name not in ("float16", "bfloat16")]
        return np.result_type(np.float32, *wide).name
    as_numpy = [np.float16 if x.dtype.name == "bfloat16" else x.dtype for x in (q, k, v)]
    result = np.result_type(*as_numpy)
    if result.kind in "biu":
        return "float64"
    if result == np.float16 and "bfloat16" in names:
        return "bfloat16"
    return result.name


# ----------------------------------------------------------------------------------------------------------------
# Gradients


def reduce_to_shape(x, shape):
    """x (a full-batch gradient) summed back to an operand of `shape` that NumPy broadcast to x.shape."""
    padded = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(i for i, (a, b) in enumerate(zip(padded, x.shape)) if a == 1 and b != 1)
    return np.add.reduce(x, axis=axes, keepdims=True).reshape(shape) if axes else x.reshape(shape)


def attention_grads_reference(dout, q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None):
    """(dq, dk, dv, dbias or None) in float64, row by row over the visible keys only (the textbook softmax
    Jacobian: dS = P * (dP - sum(P * dP))), each summed back to its operand's shape."""
    q, k, v, dout = (np.asarray(x).astype(np.float64) for x in (q, k, v, dout))
    n, d = q.shape[-2:]
    m, e = v.shape[-2:]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    vis = visible_pairs(n, m, causal, window, mask, bias)
    b64 = None if bias is None else np.asarray(bias).astype(np.float64)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], vis.shape[:-2],
                                () if b64 is None else b64.reshape((1,) * max(0, 2 - b64.ndim) + b64.shape).shape[:-2])
    full = [np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v, dout)]
    vis = np.broadcast_to(vis, batch + (n, m))
    b_full = None if b64 is None else np.broadcast_to(b64, batch + (n, m))
    dq, dk, dv = np.zeros(batch + (n, d)), np.zeros(batch + (m, d)), np.zeros(batch + (m, e))
    dbias = np.zeros(batch + (n, m))
    for b in np.ndindex(*batch):
        qb, kb, vb, dob = (x[b] for x in full)
        for i in range(n):
            keys = np.flatnonzero(vis[b][i])
            if keys.size == 0:
                continue
            s = scale * (kb[keys] @ qb[i]) + (0 if b_full is None else b_full[b][i][keys])
            with np.errstate(invalid="ignore", over="ignore"):
                p = np.exp(s - s.max())
                p /= p.sum()
                dp = vb[keys] @ dob[i]
                ds = p * (dp - (p * dp).sum())
            dq[b][i] = scale * (ds @ kb[keys])
            dk[b][keys] += scale * ds[:, None] * qb[i][None, :]
            dv[b][keys] += p[:, None] * dob[i][None, :]
            dbias[b][i][keys] = ds
    grads = [reduce_to_shape(g, x.shape) for g, x in ((dq, q), (dk, k), (dv, v))]
    return grads + [None if bias is None else reduce_to_shape(dbias, np.shape(bias))]


def naive_grads_in_dtype(dout, q, k, v, *, scale=None, causal=False, window=None, mask=None, bias=None,
                         tf32=False):
    """Naive materialized backward with every intermediate (S, P, dP, dS, the gradients) rounded to the input
    dtype, matmuls accumulating in float32 (float64 for float64): the error budget of the backward. tf32
    (float32): the operands of every product (q, k, dout, v, P and dS) rounded to TF32 too, as one TF32
    tensor-core pass rounds them."""
    t = round_tf32 if tf32 else (lambda x: x)
    dtype = np.dtype(result_dtype_name(q, k, v))
    acc = np.float64 if dtype == np.float64 else np.float32
    shapes = [np.shape(x) for x in (q, k, v)]
    q, k, v, dout = (np.asarray(x).astype(dtype).astype(acc) for x in (q, k, v, dout))
    n, d = q.shape[-2:]
    m = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    vis = visible_pairs(n, m, causal, window, mask, bias)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s = round_to(np.matmul(t(q), np.swapaxes(t(k), -1, -2)) * acc(scale), dtype)
        if bias is not None:
            s = round_to(s + np.asarray(bias).astype(acc), dtype)
        s = np.where(vis, s, -np.inf)
        top = s.max(axis=-1, keepdims=True, initial=-np.inf)
        w = np.exp(s - np.where(top == -np.inf, 0, top))
        p = np.where(vis, round_to(w / w.sum(axis=-1, keepdims=True), dtype), 0)
        dp = np.where(vis, round_to(np.matmul(t(dout), np.swapaxes(t(v), -1, -2)), dtype), 0)  # by selection
        ds = np.where(vis, round_to(p * (dp - (p * dp).sum(axis=-1, keepdims=True)), dtype), 0)
        # Hidden pairs have dS = 0 exactly; a NaN in a hidden key must not turn that 0 into NaN (the forward's
        # naive does the same with v).
        dq = round_to(acc(scale) * np.matmul(t(ds), t(np.where(np.isfinite(k), k, 0))), dtype)
        dk = round_to(acc(scale) * np.matmul(np.swapaxes(t(ds), -1, -2), t(np.where(np.isfinite(q), q, 0))), dtype)
        dv = round_to(np.matmul(np.swapaxes(t(p), -1, -2), t(dout)), dtype)
    grads = [reduce_to_shape(g.astype(np.float64), shape) for g, shape in zip((dq, dk, dv), shapes)]
    return grads + [None if bias is None else reduce_to_shape(ds.astype(np.float64), np.shape(bias))]


def gradient_condition(dout, q, k, v, unit, o_unit, *, scale=None, causal=False, window=None, mask=None,
                       bias=None):
    """Per gradient, per element, the error that roundings no FlashAttention backward avoids can reach: dS_ij =
    P_ij (dO_i.V_j - dO_i.O_i) is a difference of two dot products (FlashAttention-2's D_i = dO_i.O_i, with O
    as the forward returned it, rounded to the dtype), so its error is about C_ij = P_ij (unit |dO_i|.|V_j| +
    (unit + o_unit) |dO_i|.|O_i|); dQ, dK and dbias carry C through |K|, |Q| and as is, and dV = P^T dO carries
    unit P^T |dO|. P itself is recomputed from the saved lse, exp(s_ij - lse_i) with s and lse each rounded, so
    it is off by about E_ij = P_ij unit (|s_ij| + |lse_i|), which dV carries as E^T |dO| and C as E_ij
    (|dO_i|.|V_j| + |dO_i|.|O_i|): large scores make it the largest term. Finite parts only (non-finite rows are
    compared exactly)."""
    def finite_abs(x):
        return np.abs(np.nan_to_num(np.asarray(x).astype(np.float64), nan=0, posinf=0, neginf=0))
    shapes = [np.shape(x) for x in (q, k, v)]
    out, lse = attention_reference(q, k, v, scale=scale, causal=causal, window=window, mask=mask, bias=bias)
    qa, ka, va, da, oa = (finite_abs(x) for x in (q, k, v, dout, out))
    n, d = qa.shape[-2:]
    m = ka.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d else 1.0
    vis = visible_pairs(n, m, causal, window, mask, bias)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.matmul(np.asarray(q).astype(np.float64), np.swapaxes(np.asarray(k).astype(np.float64), -1, -2)) * scale
        if bias is not None:
            s = s + np.asarray(bias).astype(np.float64)
        lse_safe = np.where(np.isfinite(lse), lse, np.inf)[..., None]
        p = np.nan_to_num(np.where(vis, np.exp(s - lse_safe), 0), nan=0, posinf=0)
        e = np.nan_to_num(p * unit * (np.abs(s) + np.abs(lse_safe)), nan=0, posinf=0)
    dov, doo = np.matmul(da, np.swapaxes(va, -1, -2)), (da * oa).sum(axis=-1, keepdims=True)
    c = p * (unit * dov + (unit + o_unit) * doo) + e * (dov + doo)
    dq = abs(scale) * np.matmul(c, ka)
    dk = abs(scale) * np.matmul(np.swapaxes(c, -1, -2), qa)
    dv = np.matmul(np.swapaxes(unit * p + e, -1, -2), da)
    conds = [reduce_to_shape(g, shape) for g, shape in zip((dq, dk, dv), shapes)]
    return conds + [None if bias is None else reduce_to_shape(np.broadcast_to(c, np.broadcast_shapes(
        c.shape, np.shape(bias))), np.shape(bias))]


def assert_grads_accurate(grads, dout, q, k, v, *, precision=None, **options):
    """The accuracy rule for gradients, per gradient array: NaN exactly where the float64 reference has NaN, and
    elsewhere |grad - reference| <= 2 * (naive backward's largest error in the input dtype) + an absolute term:
    ABS_TOL plus one rounding to the dtype (its epsilon), of the gradient's largest magnitude (at least 1), and
    per element gradient_condition with four roundings in the accumulation type and one of O. The rounding of the
    result is the one error every gradient in that dtype has (naive's may miss it on the element where a backend's is
    largest); the cancellation in dS is the one every FlashAttention backward has (naive's P.dP form may cancel
    exactly where dO.O does not, as with a single visible key).

    precision="tf32" (float32 in one TF32 pass) is held to the same rule with TF32 in place of float32 where the
    products round: naive's products of TF32-rounded operands (naive_grads_in_dtype's tf32), and the condition's
    roundings TF32's. Any other precision: float32's own rule."""
    refs = attention_grads_reference(dout, q, k, v, **options)
    dtype = np.dtype(result_dtype_name(q, k, v))
    tf32 = precision == "tf32" and dtype == np.float32
    naives = naive_grads_in_dtype(dout, q, k, v, tf32=tf32, **options)
    unit = UNIT_ROUNDOFF["float64" if dtype == np.float64 else "tf32" if tf32 else "float32"]
    conds = gradient_condition(dout, q, k, v, 4 * unit, EPSILON[dtype.name] / 2, **options)
    for name, grad, ref, naive, cond in zip(("dq", "dk", "dv", "dbias"), grads, refs, naives, conds):
        if ref is None:
            continue
        grad = np.asarray(grad).astype(np.float64)
        assert grad.shape == ref.shape, (name, grad.shape, ref.shape)
        np.testing.assert_array_equal(np.isnan(grad), np.isnan(ref), err_msg=f"{name}: NaN differs from the reference")
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(grad[~finite], ref[~finite], err_msg=f"{name}: non-finite entries differ")
        naive_err = np.where(finite & np.isfinite(naive), np.abs(naive - ref), 0).max(initial=0)
        magnitude = max(1.0, np.abs(np.where(finite, ref, 0)).max(initial=0))
        atol = (ABS_TOL[dtype.name] + EPSILON[dtype.name]) * magnitude + cond
        excess = np.where(finite, np.abs(grad - ref) - (2 * naive_err + atol), -np.inf)
        if excess.size and excess.max() > 0:
            at = np.unravel_index(np.argmax(excess), excess.shape)
            raise AssertionError(f"{name}: error {abs(grad[at] - ref[at]):.3g} at {at} > 2 x naive {naive_err:.3g} + "
                                 f"atol {atol[at]:.3g}")
