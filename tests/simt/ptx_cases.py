"""Inputs and expected per-lane registers for the PTX-wrapper kernels of tests/simt_kernels/ptx_tests.cu, written
from the PTX ISA's fragment tables (g = lane // 4, t = lane % 4), shared by the emulator and the GPU tests."""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np

MMA_NAMES = ("mma_regs<0>", "mma_regs<1>", "mma_regs<2>", "mma_regs<3>")
LDM_NAMES = tuple(f"ldmatrix_regs<{n}, {t}>" for t in ("false", "true") for n in (1, 2, 4))
TILE_NAMES = tuple(f"mma_tile<{t}, {tr}>" for t in ("__half", "__nv_bfloat16") for tr in ("false", "true"))
F64_NAME, CVT_NAME = "mma_f64_regs", "cvt_tf32_regs"
ALL_NAMES = MMA_NAMES + LDM_NAMES + TILE_NAMES + ("cp_async_order", F64_NAME, CVT_NAME)
KIND_K = {0: 16, 1: 16, 2: 8, 3: 8}
KIND_DTYPE = {0: np.float16, 1: ml_dtypes.bfloat16, 2: np.float16, 3: np.float32}


def a_position(kind, lane, e):
    """(row, k) of element e of lane's A fragment."""
    g, t = lane // 4, lane % 4
    if kind == 3:  # tf32 m16n8k8: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
        return g + 8 * (e % 2), t + 4 * (e // 2)
    if kind == 2:  # f16 m16n8k8: a0,a1 (g, 2t..), a2,a3 (g+8, 2t..)
        return g + 8 * (e // 2), 2 * t + e % 2
    # m16n8k16: a0,a1 (g, 2t..), a2,a3 (g+8, 2t..), a4,a5 (g, 2t+8..), a6,a7 (g+8, 2t+8..)
    return g + 8 * ((e // 2) % 2), 2 * t + e % 2 + 8 * (e // 4)


def b_position(kind, lane, e):
    """(k, col) of element e of lane's B fragment."""
    g, t = lane // 4, lane % 4
    if kind == 3:  # b0 (t, g), b1 (t+4, g)
        return t + 4 * e, g
    return 2 * t + e % 2 + 8 * (e // 2), g  # b0,b1 (2t.., g), b2,b3 (2t+8.., g)


def cd_position(lane, e):
    return lane // 4 + 8 * (e // 2), 2 * (lane % 4) + e % 2


def pack(values, dtype, per_reg):
    """32-bit registers from per-lane element lists: two 16-bit elements per register (low first) or one f32."""
    bits = np.asarray(values, dtype=dtype).view(np.uint16 if per_reg == 2 else np.uint32).astype(np.uint32)
    if per_reg == 1:
        return bits
    return bits[..., 0::2] | (bits[..., 1::2] << 16)


def mma_case(kind, rng, integers=True):
    """Random A (16xK), B (Kx8), C (16x8) and the registers each lane holds; integer values make every product
    and sum exact, so the expected D is exact too."""
    k, dt = KIND_K[kind], KIND_DTYPE[kind]
    draw = (lambda shape: rng.integers(-8, 9, shape)) if integers else (lambda shape: rng.standard_normal(shape))
    A, B, C = draw((16, k)).astype(dt), draw((k, 8)).astype(dt), draw((16, 8)).astype(np.float32)
    na, nb = 16 * k // 32, 8 * k // 32
    a = np.array([[A[a_position(kind, l, e)] for e in range(na)] for l in range(32)], dt)
    b = np.array([[B[b_position(kind, l, e)] for e in range(nb)] for l in range(32)], dt)
    c = np.array([[C[cd_position(l, e)] for e in range(4)] for l in range(32)], np.float32)
    per = 1 if kind == 3 else 2
    a_regs, b_regs = np.zeros((32, 4), np.uint32), np.zeros((32, 2), np.uint32)
    a_regs[:, :na // per] = pack(a, dt, per)
    b_regs[:, :nb // per] = pack(b, dt, per)
    if kind == 3:  # tf32 keeps 10 mantissa bits: the low 13 of each float32 input are ignored (truncated)
        A, B = ((M.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32) for M in (A, B))
    D = A.astype(np.float64) @ B.astype(np.float64) + C
    d = np.array([[D[cd_position(l, e)] for e in range(4)] for l in range(32)], np.float32)
    return (a_regs, b_regs, c), d


def ldmatrix_case(n, trans, rng):
    tile = rng.integers(0, 65536, (32, 8)).astype(np.uint16)
    perm = rng.permutation(32).astype(np.int32)
    want = np.zeros((32, n), np.uint32)
    for lane in range(32):
        row, col = lane // 4, 2 * (lane % 4)
        for j in range(n):
            m = tile[perm[8 * j:8 * j + 8]]  # matrix j: rows addressed by lanes 8j..8j+7
            lo, hi = (m[col, row], m[col + 1, row]) if trans else (m[row, col], m[row, col + 1])
            want[lane, j] = int(lo) | (int(hi) << 16)
    return (tile, perm), want


def tile_case(dtype, trans_b, rng):
    A = rng.standard_normal((16, 16)).astype(dtype)
    B = rng.standard_normal((16, 8)).astype(dtype)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    b_in = np.ascontiguousarray(B if trans_b else B.T)
    D = A.astype(np.float64) @ B.astype(np.float64) + C
    return (A, b_in, C), D


def fma_exact(x, y, z):
    """IEEE float64 fma(x, y, z) under round to nearest even: x*y + z exact in Fractions, rounded once by float()
    (int / int, correctly rounded). An exact zero is -0 only when a zero product and z are both negative."""
    product = Fraction(x) * Fraction(y)
    exact = product + Fraction(z)
    if exact == 0:
        product_negative = math.copysign(1, x) * math.copysign(1, y) < 0
        return -0.0 if product == 0 and z == 0 and product_negative and math.copysign(1, z) < 0 else 0.0
    return float(exact)


def fma_chain(a, b, c, order=(0, 1, 2, 3)):
    """D = A (8x4) B (4x8) + C (8x8), each element a chain of fmas over k in the given order; the default,
    fma(a3, b3, fma(a2, b2, fma(a1, b1, fma(a0, b0, c)))), is the emulator's twin of mma.m8n8k4.f64 (the hardware
    test checks that the GPU agrees)."""
    d = np.array(c, np.float64)
    for r in range(8):
        for col in range(8):
            for k in order:
                d[r, col] = fma_exact(float(a[r, k]), float(b[k, col]), float(d[r, col]))
    return d


def f64_matrices(a, b, c):
    """A (8x4), B (4x8) and C (8x8) back from the lanes' registers of mma.m8n8k4.f64."""
    A, B, C = np.zeros((8, 4)), np.zeros((4, 8)), np.zeros((8, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, t], B[t, g], C[g, 2 * t:2 * t + 2] = a[lane], b[lane], c[lane]
    return A, B, C


def mma_f64_case(rng, integers=True, scale=0):
    """Random A (8x4), B (4x8), C (8x8) in float64 and each lane's registers: a (row g, col t), b (row t, col g),
    c[e] and d[e] (row g, col 2t + e). Integers make every step exact; otherwise random magnitudes over a few
    binades, times 2**scale (A and B; C times 2**(2 scale))."""
    if integers:
        A, B, C = (rng.integers(-8, 9, shape).astype(np.float64) for shape in ((8, 4), (4, 8), (8, 8)))
    else:
        shapes = ((8, 4), (4, 8), (8, 8))
        A, B, C = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, shape)) for shape in shapes)
        A, B, C = np.ldexp(A, scale), np.ldexp(B, scale), np.ldexp(C, 2 * scale)
    lanes = range(32)
    a = np.array([A[l // 4, l % 4] for l in lanes])
    b = np.array([B[l % 4, l // 4] for l in lanes])
    c = np.array([[C[l // 4, 2 * (l % 4) + e] for e in range(2)] for l in lanes])
    D = fma_chain(A, B, C)
    d = np.array([[D[l // 4, 2 * (l % 4) + e] for e in range(2)] for l in lanes])
    return (a, b, c), d


def cvt_rna_tf32(bits):
    """cvt.rna.tf32.f32 of float32 bit patterns, from the value: a finite x rounds to a multiple of its binade's
    tf32 quantum (2^(e - 10), e = max(floor(log2 |x|), -126), so subnormals keep the same quantum as the smallest
    binade), ties away from zero, in float64 (exact); past the largest float it is inf. inf stays; NaN gives the
    canonical NaN 0x7fffffff. Returns the uint32 results (the low 13 bits zero, but for NaN's)."""
    bits = np.asarray(bits, np.uint32)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        x = bits.view(np.float32).astype(np.float64)
    finite = np.isfinite(x)
    mag = np.where(finite, np.abs(x), 0.0)
    _, e = np.frexp(mag)  # mag = m 2^e with m in [0.5, 1): floor(log2 mag) = e - 1
    quantum = np.exp2(np.maximum(e - 1, -126) - 10.0)
    rounded = np.floor(mag / quantum + 0.5) * quantum  # exact: mag / quantum < 2^11, a power-of-two scale
    with np.errstate(over="ignore"):
        value = np.copysign(rounded, x).astype(np.float32)  # 2^128 (a carry past the largest float) becomes inf
    out = value.view(np.uint32).copy()
    out[~finite] = bits[~finite]                            # +-inf
    out[np.isnan(x)] = 0x7FFFFFFF
    return out


def cvt_case(rng, n=4096):
    """Float32 bit patterns for cvt.rna.tf32.f32 and their results: uniform random patterns (every class, NaNs
    included), exact ties (low 13 bits 0x1000) and their neighbours, subnormals, carries into the exponent, values
    that round up to inf and those just below, infs, NaNs of both signs with payloads, zeros."""
    sign = rng.integers(0, 2, n // 8).astype(np.uint32) << 31
    upper = rng.integers(0, 1 << 19, n // 8).astype(np.uint32) << 13  # sign-less exponent and 10 mantissa bits
    upper = np.where(upper >= 0x7F800000, upper - 0x7F800000, upper).astype(np.uint32)
    ties = [sign | upper | low for low in (0x1000, 0x0FFF, 0x1001)]
    subnormal = sign | rng.integers(0, 1 << 23, n // 8).astype(np.uint32)
    fixed = np.array([0x00000000, 0x80000000, 0x00000001, 0x00000FFF, 0x00001000, 0x00001001, 0x00002FFF,
                      0x00003000, 0x007FF000, 0x007FFFFF, 0x3F800FFF, 0x3F801000, 0x3F803000, 0x3FFFF000,
                      0xBFFFF000, 0x7F7FE000, 0x7F7FEFFF, 0x7F7FF000, 0x7F7FFFFF, 0xFF7FF000, 0xFF7FEFFF,
                      0x7F800000, 0xFF800000, 0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0xFF800001,
                      0xFFC00000, 0xFFFFFFFF, 0x7F801000], np.uint32)
    uniform = rng.integers(0, 1 << 32, n - 4 * (n // 8) - fixed.size, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([fixed, *ties, subnormal, uniform]).astype(np.uint32)
    return bits, cvt_rna_tf32(bits)
