"""Inputs and expected per-lane registers for the PTX-wrapper kernels of tests/simt_kernels/ptx_tests.cu, written
from the PTX ISA's fragment tables (g = lane // 4, t = lane % 4), shared by the emulator and the GPU tests."""

import ml_dtypes
import numpy as np

MMA_NAMES = ("mma_regs<0>", "mma_regs<1>", "mma_regs<2>", "mma_regs<3>")
LDM_NAMES = tuple(f"ldmatrix_regs<{n}, {t}>" for t in ("false", "true") for n in (1, 2, 4))
TILE_NAMES = tuple(f"mma_tile<{t}, {tr}>" for t in ("__half", "__nv_bfloat16") for tr in ("false", "true"))
ALL_NAMES = MMA_NAMES + LDM_NAMES + TILE_NAMES + ("cp_async_order",)
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
