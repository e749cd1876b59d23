"""The CUDA-core forward kernel (kernels/forward.cuh, BlockConfig variant "fma") as a Family: any float dtype on
any GPU, head-dimension buckets 16 ... 512 (narrower head tiles for large head dims on small shared memories),
the shared-memory model (mirrors ForwardShared byte for byte), the register model and its candidates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Tuple

from .dtypes import acc_dtype_of
from .family import (BACKWARD_OPERANDS, BACKWARD_SCALARS, C_TYPES, LANES_PER_ROW, BlockConfig, Family, Shape,
                     align16)

HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256, 512)  # D and E instantiations; the actual d, e are run-time values
MAX_BUCKET = {"float16": 256, "bfloat16": 256, "float32": 512, "float64": 512}
ACC_REGISTER_LIMIT = 96  # accumulator words per thread (S, O) above which ptxas runs out of registers (255)
ACC_REGISTER_TARGET = 64  # what the heuristic allows itself, leaving room for addresses and staging
MAX_TILE = 256

STAGES = (2, 1)  # K/V double-buffered through cp.async (compute capability 8.0+, d within the head tile), or not
# Preference order: large tiles with a few rows per thread first, then smaller tiles for large head dims or small
# shared memories; each with two stages first, where they fit.
CANDIDATES = tuple(BlockConfig(br, bc, w, stages) for br, bc, w in (
    (64, 64, 4), (64, 64, 8), (32, 64, 4), (32, 64, 8), (32, 32, 4), (32, 32, 8), (16, 64, 8), (16, 32, 8),
    (16, 16, 8), (8, 32, 4), (8, 16, 4), (4, 16, 2)) for stages in STAGES)


def bucket(size: int) -> int:
    """The head-dimension instantiation serving `size` (the smallest bucket >= size)."""
    for b in HEAD_DIM_BUCKETS:
        if size <= b:
            return b
    raise ValueError(f"head dimension {size} is above the largest bucket {HEAD_DIM_BUCKETS[-1]}")


def buckets(shape: Shape, config: BlockConfig) -> Tuple[int, int]:
    """(D, E) of the instantiation serving shape with config. Head dimensions past the head tile (config.head_tile,
    else the dtype's largest bucket) are served in pieces: the kernel sweeps d in D-wide slices, and the launch
    splits e into E-wide column blocks."""
    limit = config.head_tile or MAX_BUCKET[shape.dtype.name]
    return bucket(min(shape.d, limit)), bucket(min(shape.e, limit))



def shared_memory_bytes(shape: Shape, config: BlockConfig) -> int:
    """Dynamic shared memory of one block: the Q, K, V tiles in the element type (Q and K rows padded by 16 bytes,
    to an odd number of 16-byte chunks; K and V once per stage) and P in the accumulator type (rows padded to 64
    bytes past a multiple of 128); each region 16-byte aligned. Mirrors ForwardShared."""
    item = shape.dtype.itemsize
    acc = acc_dtype_of(shape.dtype).itemsize
    D, E = buckets(shape, config)
    q = align16(item * config.Br * D + 16 * config.Br)
    k = align16(item * config.Bc * D + 16 * config.Bc)
    v = align16(item * config.Bc * E)
    p = align16(acc * config.Br * config.Bc + config.Br * ((64 - acc * config.Bc % 128) % 128))
    return q + config.stages * (k + v) + p


def accumulator_words(shape: Shape, config: BlockConfig) -> int:
    """32-bit registers a thread holds for its scores S and output O_i: rows x (score + output columns)."""
    rows = config.Br // max(1, config.row_groups)
    cols = config.Bc // LANES_PER_ROW + buckets(shape, config)[1] // LANES_PER_ROW
    return rows * cols * (acc_dtype_of(shape.dtype).itemsize // 4)


def registers_estimate(shape: Shape, config: BlockConfig) -> int:
    """A rough registers-per-thread figure for occupancy (the compile report has the compiler's)."""
    return min(255, (40 + 2 * accumulator_words(shape, config) + 7) // 8 * 8)


def eligibility(shape: Shape, device) -> List[str]:
    if shape.dtype.name not in MAX_BUCKET:
        return [f"dtype {shape.dtype.name} is not supported by the kernel: use float16, bfloat16, float32 or float64"]
    return []


def config_reasons(shape: Shape, config: BlockConfig) -> List[str]:
    reasons = []
    groups = config.row_groups
    if not (config.Br % groups == 0 and groups <= config.Br <= MAX_TILE):
        reasons.append(
            f"Br={config.Br} is not supported with {config.warps} warps: Br must be a multiple of {groups} "
            f"(the {groups} row groups of {LANES_PER_ROW} lanes) between {groups} and {MAX_TILE}")
    if not (config.Bc % LANES_PER_ROW == 0 and LANES_PER_ROW <= config.Bc <= MAX_TILE):
        reasons.append(
            f"Bc={config.Bc} is not supported: Bc must be a multiple of {LANES_PER_ROW} "
            f"between {LANES_PER_ROW} and {MAX_TILE}")
    largest = MAX_BUCKET[shape.dtype.name]
    if config.head_tile is not None and not (config.head_tile in HEAD_DIM_BUCKETS and config.head_tile <= largest):
        allowed = ", ".join(str(b) for b in HEAD_DIM_BUCKETS if b <= largest)
        reasons.append(f"head_tile={config.head_tile} is not supported for {shape.dtype.name}: use one of "
                       f"{allowed}, or None")
    D = buckets(shape, config)[0]
    if config.stages == 2 and shape.d > D:
        reasons.append(f"stages=2 double-buffers whole K tiles: d={shape.d} is swept in slices of the {D}-wide head "
                       f"tile, which take stages=1")
    return reasons


def template_args(shape: Shape, config: BlockConfig, split: bool) -> list:
    """fwd<T, Br, Bc, D, E, Warps[, Sliced[, Split[, Stages]]]>: Sliced (d swept in D-wide slices) and Split
    default to false, Stages to 1, and are spelled out only as far as needed."""
    D, E = buckets(shape, config)
    sliced = shape.d > D
    args = [C_TYPES[shape.dtype.name], config.Br, config.Bc, D, E, config.warps]
    optional = ["true" if sliced else "false", "true" if split else "false", config.stages]
    needed = 3 if config.stages != 1 else 2 if split else 1 if sliced else 0
    return args + optional[:needed]


def candidates(shape: Shape) -> List[Tuple[BlockConfig, ...]]:
    """CANDIDATES with whole head dims; then, for when none of them runs (large d on a small shared memory), the
    same with ever narrower head tiles."""
    widest = max(buckets(shape, CANDIDATES[0]))
    tiles = [None] + [b for b in reversed(HEAD_DIM_BUCKETS) if b < widest]
    return [tuple(replace(c, head_tile=tile) for c in CANDIDATES) for tile in tiles]


FORWARD = Family(
    variant="fma", title="CUDA-core", template="cuflash::fwd", source="forward.cuh", shared_struct="ForwardShared",
    eligibility=eligibility, config_reasons=config_reasons, buckets=buckets,
    shared_memory_bytes=shared_memory_bytes, accumulator_words=accumulator_words,
    registers_estimate=registers_estimate, template_args=template_args,
    column_width=lambda shape, config: buckets(shape, config)[1], candidates=candidates,
    register_target=ACC_REGISTER_TARGET, register_limit=ACC_REGISTER_LIMIT,
    register_advice="use a smaller Br or more warps", stages=STAGES)


# ----------------------------------------------------------------------------------------------------------------
# The backward kernels (kernels/backward.cuh): bwd_dq (one block per Br queries) and bwd_dkdv (one per Bc keys),
# two families planned apart. Each holds its gradients whole in registers, so d and e are at most
# BACKWARD_MAX_BUCKET; wider heads take the blocked backward on the array library's matmul (backends/numpy.py).

BACKWARD_MAX_BUCKET = 256
# (64, 32) before (32, 64): where 64 x 64 does not fit (float32 at d = 128 on an A100), 64 own rows keep 4 per
# thread and the swept tile's 16-byte loads feed more FMAs (estimates: 1.45 instructions per FMA against 1.56).
BACKWARD_CANDIDATES = tuple(BlockConfig(br, bc, w, stages) for br, bc, w in (
    (64, 64, 8), (64, 64, 4), (64, 32, 8), (32, 64, 8), (32, 32, 4), (32, 32, 8), (16, 32, 8), (32, 16, 8),
    (16, 16, 8), (16, 16, 4), (16, 16, 2)) for stages in STAGES)


def backward_buckets(shape: Shape, config: BlockConfig) -> Tuple[int, int]:
    return bucket(min(shape.d, BACKWARD_MAX_BUCKET)), bucket(min(shape.e, BACKWARD_MAX_BUCKET))


def backward_eligibility(shape: Shape, device) -> List[str]:
    reasons = eligibility(shape, device)
    if not reasons and max(shape.d, shape.e) > BACKWARD_MAX_BUCKET:
        reasons.append(f"head dims d={shape.d}, e={shape.e}: the backward kernels hold a block's gradients whole "
                       f"and take d, e <= {BACKWARD_MAX_BUCKET}")
    return reasons


def _backward_family(kind: str) -> Family:
    """bwd_dq (kind "dq": own rows are Br queries, swept columns Bc keys) or bwd_dkdv (kind "dkdv": own rows are
    Bc keys, swept columns Br queries)."""
    keys_own = kind == "dkdv"

    def own_and_swept(config: BlockConfig) -> Tuple[int, int]:
        return (config.Bc, config.Br) if keys_own else (config.Br, config.Bc)

    def shared_memory_bytes(shape: Shape, config: BlockConfig) -> int:
        """Q and dO of the query tile, K and V of the key tile (rows padded by 16 bytes, as the forward's Q and K),
        P and dS over (own rows) x (swept columns, rows padded to 64 bytes past a multiple of 128) and two row terms
        per query in the accumulator type (the swept tiles, and for dK dV the row terms, once per stage); each
        region 16-byte aligned. Mirrors BackwardShared."""
        item, acc = shape.dtype.itemsize, acc_dtype_of(shape.dtype).itemsize
        D, E = backward_buckets(shape, config)
        own, swept = own_and_swept(config)
        q_stages, k_stages = (config.stages, 1) if keys_own else (1, config.stages)
        tiles = sum(stages * align16(item * rows * width + 16 * rows)
                    for stages, rows in ((q_stages, config.Br), (k_stages, config.Bc)) for width in (D, E))
        p = align16(acc * own * swept + own * ((64 - acc * swept % 128) % 128))
        return tiles + 2 * p + q_stages * align16(acc * 2 * config.Br)

    def accumulator_words(shape: Shape, config: BlockConfig) -> int:
        """Per thread: S and dP over its rows x swept columns, and the block's gradients (dQ; or dK and dV)."""
        own, swept = own_and_swept(config)
        D, E = backward_buckets(shape, config)
        grads = D + E if keys_own else D
        rows = own // max(1, config.row_groups)
        return rows * (2 * swept // LANES_PER_ROW + grads // LANES_PER_ROW) * (acc_dtype_of(shape.dtype).itemsize // 4)

    def config_reasons(shape: Shape, config: BlockConfig) -> List[str]:
        own, swept = own_and_swept(config)
        (own_name, swept_name) = ("Bc", "Br") if keys_own else ("Br", "Bc")
        groups = config.row_groups
        reasons = []
        if not (own % groups == 0 and groups <= own <= MAX_TILE):
            reasons.append(f"{own_name}={own} is not supported with {config.warps} warps by the backward's {kind} "
                           f"kernel: it must be a multiple of {groups} (the row groups of {LANES_PER_ROW} lanes) "
                           f"between {groups} and {MAX_TILE}")
        if not (swept % LANES_PER_ROW == 0 and LANES_PER_ROW <= swept <= MAX_TILE):
            reasons.append(f"{swept_name}={swept} is not supported by the backward's {kind} kernel: it must be a "
                           f"multiple of {LANES_PER_ROW} between {LANES_PER_ROW} and {MAX_TILE}")
        if config.head_tile is not None:
            reasons.append(f"head_tile={config.head_tile} is not supported by the backward kernels: they take "
                           f"whole head dims up to {BACKWARD_MAX_BUCKET}; use None")
        return reasons

    def template_args(shape: Shape, config: BlockConfig, split: bool) -> list:
        D, E = backward_buckets(shape, config)
        args = [C_TYPES[shape.dtype.name], config.Br, config.Bc, D, E, config.warps]
        return args + ([config.stages] if config.stages != 1 else [])

    return Family(
        variant="fma", title=f"CUDA-core backward {kind}", template=f"cuflash::bwd_{kind}", source="backward.cuh",
        shared_struct="BackwardShared", eligibility=backward_eligibility, config_reasons=config_reasons,
        buckets=backward_buckets, shared_memory_bytes=shared_memory_bytes, accumulator_words=accumulator_words,
        registers_estimate=lambda shape, config: min(255, (48 + 2 * accumulator_words(shape, config) + 7) // 8 * 8),
        template_args=template_args, column_width=lambda shape, config: max(1, shape.e),
        candidates=lambda shape: [BACKWARD_CANDIDATES], register_target=ACC_REGISTER_TARGET,
        register_limit=ACC_REGISTER_LIMIT, register_advice="use smaller tiles or more warps", stages=STAGES, kind=kind,
        tiles_along="keys" if keys_own else "queries", operands=BACKWARD_OPERANDS, scalars=BACKWARD_SCALARS)


BACKWARD_DQ = _backward_family("dq")
BACKWARD_DKDV = _backward_family("dkdv")
