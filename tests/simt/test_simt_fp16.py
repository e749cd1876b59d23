"""__half and __nv_bfloat16 in the emulator, bit-exact against NumPy float16 and ml_dtypes bfloat16 (round to
nearest even); NaN inputs must give NaN (the GPU's canonical NaN pattern differs from NumPy's payloads)."""

import ml_dtypes
import numpy as np
import pytest
import simt_util

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def mod():
    return simt_util.module("fp16.cu", ("arithmetic<0>", "arithmetic<1>"))


def launch(fn, n, *args):
    fn(((n + 255) // 256,), (256,), (*args, np.int32(n)))


def same_bits_or_both_nan(got_bits, want, dtype):
    got = got_bits.view(dtype).astype(np.float32)
    want32 = want.astype(np.float32)
    nan = np.isnan(want32)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got_bits[~nan], want.view(np.uint16)[~nan])


def test_all_16_bit_patterns_to_float(mod):
    bits = np.arange(65536, dtype=np.uint16)
    f, fb = np.zeros(65536, np.float32), np.zeros(65536, np.float32)
    launch(mod.get_function("half_to_float"), 65536, bits, f, bits, fb)
    for got, want in [(f, bits.view(np.float16).astype(np.float32)), (fb, bits.view(BF16).astype(np.float32))]:
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def float_cases():
    """Every float16 and bfloat16 value, the midpoints between neighbours (ties) and a nudge either side, the
    overflow thresholds, and random float32 bit patterns (denormals, NaNs, infinities included)."""
    h = np.arange(65536, dtype=np.uint16)
    cases = [h.view(np.float16).astype(np.float32), h.view(BF16).astype(np.float32)]
    for v in cases[:2]:
        v = np.sort(v[np.isfinite(v)])
        mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
        cases += [mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))]
    cases.append(np.array([65504, 65519.99, 65520, 65536, 3.4e38, np.inf, -np.inf, np.nan, 1e-8, 2.9e-8, 3e-8,
                           5.96e-8, -0.0, 0.0], np.float32))
    cases.append(np.random.default_rng(0).integers(0, 2**32, 1 << 18, dtype=np.uint32).view(np.float32))
    return np.concatenate(cases)


def test_float_to_half_and_bfloat16_round_to_nearest_even(mod):
    f = float_cases()
    n = f.size
    h, b = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    h2, b2 = np.zeros(2 * n, np.uint16), np.zeros(2 * n, np.uint16)
    # Without -ftz, float32 denormal inputs reach the conversion as they are (NumPy does not flush them).
    m = simt.RawModule(code=simt_util.source("fp16.cu"), options=("-ftz=false",))
    launch(m.get_function("float_to_half"), n, f, h, b, h2, b2)
    with np.errstate(over="ignore", invalid="ignore"):
        same_bits_or_both_nan(h, f.astype(np.float16), np.float16)
        same_bits_or_both_nan(b, f.astype(BF16), BF16)
        pair = np.stack([f, -f], 1).ravel()
        same_bits_or_both_nan(h2, pair.astype(np.float16), np.float16)
        same_bits_or_both_nan(b2, pair.astype(BF16), BF16)


def test_double_to_half_rounds_once(mod):
    rng = np.random.default_rng(1)
    d = np.concatenate([rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-9, 6, 1 << 16),
                        # just above a float16/bfloat16 tie, but a tie once rounded to float32
                        np.array([1 + 2**-11 + 2**-40, 1 + 2**-8 + 2**-40, -(1 + 2**-8 + 2**-40)])])
    h, b = np.zeros(d.size, np.uint16), np.zeros(d.size, np.uint16)
    launch(mod.get_function("double_to_half"), d.size, d, h, b)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(h, d.astype(np.float16).view(np.uint16))  # NumPy rounds float64 once
        np.testing.assert_array_equal(b, bfloat16_rounded_once(d).view(np.uint16))


def bfloat16_rounded_once(d):
    """float64 -> bfloat16 rounded once (as CUDA's __double2bfloat16 does; ml_dtypes goes through float32 and
    can round twice): truncate to float32, make it odd when inexact (round-to-odd keeps the sticky bit), then
    round to bfloat16."""
    f = d.astype(np.float32)
    u = f.view(np.uint32).copy()
    back = f.astype(np.float64)
    u[np.abs(back) > np.abs(d)] -= 1
    u[back != d] |= 1
    return u.view(np.float32).astype(BF16)


@pytest.mark.parametrize("kind,dtype", [(0, np.float16), (1, BF16)])
def test_arithmetic_rounds_like_numpy(mod, kind, dtype):
    rng = np.random.default_rng(kind)
    n = 1 << 16
    x, y = rng.integers(0, 65536, n, dtype=np.uint16), rng.integers(0, 65536, n, dtype=np.uint16)
    out = np.zeros(4 * n, np.uint16)
    launch(mod.get_function(f"arithmetic<{kind}>"), n, x, y, out)
    a, b = x.view(dtype), y.view(dtype)
    with np.errstate(all="ignore"):
        want = np.stack([a + b, a - b, a * b, a / b], 1).ravel()
    same_bits_or_both_nan(out, want, dtype)
