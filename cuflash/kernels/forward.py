"""The CUDA-core forward kernel (forward.cuh, BlockConfig variant "fma") described for the planner: any float dtype
on any GPU, head-dimension buckets 16 ... 512 (narrower head tiles for large head dims on small shared memories),
the shared-memory model (ForwardShared, byte for byte), the register model and its candidates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Tuple

from ..dtypes import acc_dtype_of
from ..family import C_TYPES, LANES_PER_ROW, BlockConfig, Family, Shape, align16, dropout_bytes

HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256, 512)  # D and E instantiations; the actual d, e are run-time values
MAX_BUCKET = {"float16": 256, "bfloat16": 256, "float32": 512, "float64": 512}
ACC_REGISTER_LIMIT = 96  # accumulator words per thread (S, O) above which ptxas runs out of registers (255)
ACC_REGISTER_TARGET = 64  # what the heuristic allows itself, leaving room for addresses and staging
MAX_TILE = 256
HIDDEN_BITS = 32  # a thread's hidden-key bits of a row: one word, so Bc / LANES_PER_ROW <= 32

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


def row_pitch_bytes(item: int, width: int) -> int:
    """Bytes of a Q- or K-like shared row: `width` elements and 16 bytes of padding (an odd number of 16-byte
    chunks, for conflict-free chunked reads: tile.cuh's chunk_pad)."""
    return item * width + 16


def p_pitch_bytes(acc: int, cols: int) -> int:
    """Bytes of a P-like shared row of accumulators: 64 bytes past a multiple of 128 (tile.cuh's half_line_pad)."""
    return acc * cols + (64 - acc * cols % 128) % 128


def eligibility(shape: Shape, device) -> List[str]:
    """The dtypes every CUDA-core kernel runs."""
    if shape.dtype.name not in MAX_BUCKET:
        return [f"dtype {shape.dtype.name} is not supported by the kernel: use float16, bfloat16, float32 or float64"]
    return []


def rows_per_thread_reasons(name: str, rows: int, config: BlockConfig, what: str) -> List[str]:
    """Why a block's own rows (Br here, Bc in dK dV) do not split over its row groups of LANES_PER_ROW lanes."""
    groups = config.row_groups
    if rows % groups == 0 and groups <= rows <= MAX_TILE:
        return []
    return [f"{name}={rows} is not supported with {config.warps} warps{what}: {name} must be a multiple of {groups} "
            f"(the {groups} row groups of {LANES_PER_ROW} lanes) between {groups} and {MAX_TILE}"]


def columns_reasons(name: str, cols: int, what: str) -> List[str]:
    """Why a tile's swept columns (Bc here, Br in dK dV) do not split over a row group's lanes."""
    if cols % LANES_PER_ROW == 0 and LANES_PER_ROW <= cols <= MAX_TILE:
        return []
    return [f"{name}={cols} is not supported{what}: {name} must be a multiple of {LANES_PER_ROW} between "
            f"{LANES_PER_ROW} and {MAX_TILE}"]


class CudaCoreForward(Family):
    variant, title, template = "fma", "CUDA-core", "cuflash::fwd"
    source, shared_struct = "forward.cuh", "ForwardShared"
    stages = STAGES
    register_target, register_limit = ACC_REGISTER_TARGET, ACC_REGISTER_LIMIT
    register_advice = "use a smaller Br or more warps"

    def eligibility(self, shape: Shape, device) -> List[str]:
        return eligibility(shape, device)

    def buckets(self, shape: Shape, config: BlockConfig) -> Tuple[int, int]:
        """(D, E) of the instantiation serving shape with config. Head dimensions past the head tile
        (config.head_tile, else the dtype's largest bucket) are served in pieces: the kernel sweeps d in D-wide
        slices, and the launch splits e into E-wide column blocks."""
        limit = config.head_tile or MAX_BUCKET[shape.dtype.name]
        return bucket(min(shape.d, limit)), bucket(min(shape.e, limit))

    def column_width(self, shape: Shape, config: BlockConfig) -> int:
        return self.buckets(shape, config)[1]

    def shared_memory_bytes(self, shape: Shape, config: BlockConfig) -> int:
        """The Q, K, V tiles in the element type (Q and K rows padded; K and V once per stage) and P in the
        accumulator type (a P-like pitch); each region 16-byte aligned; with dropout, one keep tile
        (dropout_bytes). Mirrors ForwardShared."""
        item, acc = shape.dtype.itemsize, acc_dtype_of(shape.dtype).itemsize
        D, E = self.buckets(shape, config)
        q = align16(config.Br * row_pitch_bytes(item, D))
        k = align16(config.Bc * row_pitch_bytes(item, D))
        v = align16(item * config.Bc * E)
        p = align16(config.Br * p_pitch_bytes(acc, config.Bc))
        return q + config.stages * (k + v) + p + dropout_bytes(shape, config, 1)

    def accumulator_words(self, shape: Shape, config: BlockConfig) -> int:
        """32-bit registers a thread holds for its scores S and output O_i: rows x (score + output columns)."""
        rows = config.Br // max(1, config.row_groups)
        cols = config.Bc // LANES_PER_ROW + self.buckets(shape, config)[1] // LANES_PER_ROW
        return rows * cols * (acc_dtype_of(shape.dtype).itemsize // 4)

    def registers_estimate(self, shape: Shape, config: BlockConfig) -> int:
        return min(255, (40 + 2 * self.accumulator_words(shape, config) + 7) // 8 * 8)

    def config_reasons(self, shape: Shape, config: BlockConfig) -> List[str]:
        reasons = rows_per_thread_reasons("Br", config.Br, config, "") + columns_reasons("Bc", config.Bc, "")
        largest = MAX_BUCKET[shape.dtype.name]
        if config.head_tile is not None and not (config.head_tile in HEAD_DIM_BUCKETS and config.head_tile <= largest):
            allowed = ", ".join(str(b) for b in HEAD_DIM_BUCKETS if b <= largest)
            reasons.append(f"head_tile={config.head_tile} is not supported for {shape.dtype.name}: use one of "
                           f"{allowed}, or None")
        D = self.buckets(shape, config)[0]
        if config.stages == 2 and shape.d > D:
            reasons.append(f"stages=2 double-buffers whole K tiles: d={shape.d} is swept in slices of the {D}-wide "
                           f"head tile, which take stages=1")
        return reasons

    def template_args(self, shape: Shape, config: BlockConfig, split: bool) -> list:
        """fwd<T, Br, Bc, D, E, Warps[, Sliced[, Split[, Stages]]]>: Sliced (d swept in D-wide slices) and Split
        default to false, Stages to 1, and are spelled out only as far as needed."""
        D, E = self.buckets(shape, config)
        sliced = shape.d > D
        args = [C_TYPES[shape.dtype.name], config.Br, config.Bc, D, E, config.warps]
        optional = ["true" if sliced else "false", "true" if split else "false", config.stages]
        needed = 3 if config.stages != 1 else 2 if split else 1 if sliced else 0
        return args + optional[:needed]

    def candidates(self, shape: Shape) -> List[Tuple[BlockConfig, ...]]:
        """CANDIDATES with whole head dims; then, for when none of them runs (large d on a small shared memory),
        the same with ever narrower head tiles."""
        widest = max(self.buckets(shape, CANDIDATES[0]))
        tiles = [None] + [b for b in reversed(HEAD_DIM_BUCKETS) if b < widest]
        return [tuple(replace(c, head_tile=tile) for c in CANDIDATES) for tile in tiles]

    def limits(self) -> Dict[str, int]:
        return cuda_core_limits()


def cuda_core_limits() -> Dict[str, int]:
    """What every CUDA-core kernel's layout shares with tile.cuh."""
    return {"cuflash::kLanesPerRow": LANES_PER_ROW, "cuflash::chunk_pad<float>() * 4": 16,
            "cuflash::half_line_pad<float>(8) * 4 + 8 * 4": p_pitch_bytes(4, 8),
            "cuflash::half_line_pad<double>(20) * 8 + 20 * 8": p_pitch_bytes(8, 20),
            "(int)(8 * sizeof(unsigned))": HIDDEN_BITS}


FORWARD = CudaCoreForward()
