"""The tensor-core forward kernel (forward_mma.cuh, BlockConfig variant "mma") described for the planner: who may
run it, its head-dimension buckets, the shared-memory model (MmaShared, byte for byte), a register estimate, the
configurations it takes and the candidates the heuristic tries.

It runs float16 and bfloat16 (mma.m16n8k16), float32 on TF32 tensor cores (precision "highest": three passes,
3xTF32; "tf32": one pass) and float64 on DMMA (mma.m8n8k4) where the GPU has float64 tensor cores. precision
"fma" keeps every dtype on CUDA cores.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from ..family import C_TYPES, BlockConfig, Family, Shape, dropout_bytes

DTYPES = ("float16", "bfloat16", "float32", "float64")
MIN_COMPUTE_CAPABILITY = (8, 0)  # mma.sync m16n8k16 with bf16, m16n8k8 with tf32, m8n8k4 f64; cp.async
PASSES = {"highest": 3, "tf32": 1}  # float32's TF32 products per multiply: 3xTF32, or one
MAX_HEAD_DIM = 256
HEAD_DIM_STEP = 32  # D and E instantiations are multiples of 32; the actual d, e are run-time values
ROWS_PER_TILE = 16  # the m of mma.m16n8k16: rows per warp per m16 tile
TILES_PER_WARP = (1, 2)
MAX_BC = 128  # a row's hidden-key bits fit one 32-bit word per lane
STAGES = (2, 3)
ROW_PAD_BYTES = 16  # padding per shared-memory row (one 16-byte chunk)
SWEEP_BYTES = 208  # the block's Sweep in shared memory (its view of the launch and of its swept tiles), aligned
# Q_i's A fragments of the 16-bit types stay in registers for the whole sweep when MT (D + Bc) is at most this
# (they and S's then take at most a quarter of it); float32's and float64's are read step by step.
Q_REGISTER_WORDS = 192
# The tiles other than the steady ones take their keys in two parts where S and O_i would hold this many
# accumulators or more: their visibility, mask and bias loads need the registers the other half of S takes.
PARTS_WORDS = 160
# 32-bit registers a thread keeps for S, O_i and Q_i's fragments. ptxas needs about 95 more for addresses,
# strides and prefetched fragments (tests/test_cubin.py prints its counts, and fails on any spill): the
# heuristic stays within the target, which compiles without spills at 230-255 registers; past the limit spills
# are likely. Two m16 tiles per warp at d = 128 (S 64, O_i 128) fit because the steady loop needs none of the
# other tiles' registers, which take their keys in two parts (key_parts), and the block's view of the launch
# waits in shared memory.
REGISTER_TARGET = 160
REGISTER_LIMIT = 160
# The heuristic's tensor-core forward keeps at least 4 warps on each SM: a block of one warp whose shared memory
# fills the SM (3xTF32 at large head dims on GPUs with 99 KiB) leaves the tensor cores waiting on every load, and
# the CUDA-core kernel's 8 warps run such shapes faster.
MIN_RESIDENT_WARPS = 4
STEADY_REGISTER_LIMIT = 192  # S and O_i in the steady loop (128 x 64 at d = 128, 128 x 128 at d = 64)
# With dropout, a warp of two m16 tiles also holds its four rows' keep bits in the steady loop, and the next tile's
# Philox calls beside O_i: ptxas spills past S + O_i + this many words over the target (sm_80 and sm_90: 128 x 128
# tiles at d = 32 and 64, 128 x 64 at d = 128 with 4 warps), and compiles the rest without.
DROPOUT_WORDS = 32
# float32 and float64 take the rest of the registers for their products: 3xTF32 holds each fragment's high and
# low parts, float64 two registers per value. ptxas's counts for every candidate (sm_80 and sm_90) put their
# spill thresholds here, so 3xTF32 runs head dims up to 192, one TF32 pass up to 256 and float64 up to 160, with
# the smaller tiles past the target (where they keep MIN_RESIDENT_WARPS on an SM); past the limit the CUDA-core
# kernel runs (tests/test_cubin.py compiles every choice).
REGISTER_BOUNDS = {("float32", "highest"): (96, 104), ("float32", "tf32"): (136, 136),
                   ("float64", "highest"): (96, 176)}

# Preference order: 128 query rows with 4 warps of two m16 tiles (each K and V fragment feeds four mma, not
# two) where the registers allow it, with 128 keys per tile (d <= 64: each tile's fixed costs, O_i's rescale
# among them, spread over twice the mma), 64 (d <= 128) or 32 (float32, float64); else
# 8 warps of one m16 tile; 16-key tiles where float32's and float64's products need the registers; smaller tiles
# for large head dims on smaller shared memories.
CANDIDATES = tuple(BlockConfig(br, bc, w, 2, "mma") for br, bc, w in (
    (128, 128, 4), (128, 64, 4), (128, 32, 4), (128, 64, 8), (64, 64, 4), (64, 32, 4), (64, 16, 4), (32, 32, 2),
    (16, 32, 1), (16, 16, 1)))


def bucket(size: int) -> int:
    """The head-dimension instantiation serving `size`: the next multiple of 32 (at least 32)."""
    return max(HEAD_DIM_STEP, -(-size // HEAD_DIM_STEP) * HEAD_DIM_STEP)


def tiles_per_warp(config: BlockConfig) -> int:
    return config.Br // (ROWS_PER_TILE * config.warps)


def q_in_registers(shape: Shape, config: BlockConfig) -> bool:
    """Whether Q_i's A fragments stay in registers for the whole sweep (16-bit types, MT (D + Bc) at most
    Q_REGISTER_WORDS). Mirrors MmaShared::kQInRegisters."""
    return shape.dtype.itemsize == 2 and tiles_per_warp(config) * (bucket(shape.d) + config.Bc) <= Q_REGISTER_WORDS


def three_passes(shape: Shape) -> bool:
    """Whether float32 runs in three TF32 passes (3xTF32), its tiles' low parts in shared memory beside them."""
    return shape.dtype.name == "float32" and shape.precision == "highest"


def row_pads(shape: Shape) -> Tuple[int, int]:
    """Elements of padding per row of the Q and K tiles, and of the others (V, O, P): one 16-byte chunk, and 32
    bytes for Q and K of float64, whose 8-byte fragment loads then fall in different banks (mma::RowPadded)."""
    item = shape.dtype.itemsize
    pad = ROW_PAD_BYTES // item
    return (32 // item if item == 8 else pad), pad


def key_parts(shape: Shape, config: BlockConfig) -> int:
    """The parts the tiles other than the steady ones take their keys in (PARTS_WORDS). Mirrors
    MmaShared::kParts."""
    mt = tiles_per_warp(config)
    return 2 if mt * (config.Bc + bucket(shape.e)) // 2 >= PARTS_WORDS and config.Bc % 32 == 0 else 1


def dtype_and_device_reasons(shape: Shape, device, kernel: str, dtypes) -> List[str]:
    """Why `kernel` (a tensor-core kernel running `dtypes`) cannot serve this dtype or device at all."""
    reasons = []
    dtype = shape.dtype.name
    if shape.precision == "fma":
        reasons.append(f"precision='fma' asks for CUDA cores: the {kernel} (variant 'mma') does not run; the "
                       f"CUDA-core kernel (variant 'fma') does")
    if dtype not in dtypes:
        names = ", ".join(dtypes[:-1]) + " and " + dtypes[-1]
        reasons.append(f"the {kernel} (variant 'mma') runs {names}, not {dtype}; "
                       f"the CUDA-core kernel (variant 'fma') runs {dtype}")
    if tuple(device.compute_capability) < MIN_COMPUTE_CAPABILITY:
        major, minor = device.compute_capability
        reasons.append(f"the {kernel} needs compute capability 8.0 or newer (mma.sync m16n8k16, "
                       f"ldmatrix, cp.async); {device.name} has {major}.{minor}, where the CUDA-core kernel "
                       f"(variant 'fma') runs")
    return reasons


def own_rows_reasons(name: str, rows: int, config: BlockConfig, kernel: str) -> List[str]:
    """Why a block's own rows (the forward's Br) are not its warps' m16 tiles, one or two each."""
    allowed = [ROWS_PER_TILE * t * config.warps for t in TILES_PER_WARP]
    if rows in allowed:
        return []
    return [f"{name}={rows} is not supported by the {kernel} with {config.warps} warps: each warp takes 1 or 2 "
            f"tiles of 16 rows, so {name} is {' or '.join(map(str, allowed))}"]


def swept_reasons(name: str, cols: int, kernel: str, most: int) -> List[str]:
    if cols % 16 == 0 and 16 <= cols <= most:
        return []
    return [f"{name}={cols} is not supported by the {kernel}: {name} must be a multiple of 16 between 16 and {most}"]


class TensorCoreForward(Family):
    variant, title, template = "mma", "tensor-core", "cuflash::fwd_mma"
    source, shared_struct = "forward_mma.cuh", "MmaShared"
    stages = STAGES
    register_target, register_limit = REGISTER_TARGET, REGISTER_LIMIT
    register_advice = "use a smaller Br or Bc, or more warps"
    min_resident_warps = MIN_RESIDENT_WARPS

    def register_bounds(self, shape: Shape) -> Tuple[int, int]:
        """(target, limit) of accumulator words for shape's dtype and precision."""
        return REGISTER_BOUNDS.get((shape.dtype.name, shape.precision), (REGISTER_TARGET, REGISTER_LIMIT))

    def eligibility(self, shape: Shape, device) -> List[str]:
        """Why the kernel cannot serve this dtype, precision, head dims or device at all (empty: it can)."""
        reasons = dtype_and_device_reasons(shape, device, "tensor-core kernel", DTYPES)
        if shape.dtype.name == "float64" and not device.fp64_tensor_cores and not reasons:
            reasons.append(f"float64 runs on tensor cores (DMMA) only where they are fast, on the A100, H100 and "
                           f"H200 class; {device.name} has none, so the CUDA-core kernel (variant 'fma') runs float64")
        for name, size in (("d", shape.d), ("e", shape.e)):
            if size > MAX_HEAD_DIM:
                reasons.append(f"head dimension {name}={size} is above {MAX_HEAD_DIM}, the largest the tensor-core "
                               f"kernel supports; the CUDA-core kernel (variant 'fma') takes float32 up to 512")
        return reasons

    def buckets(self, shape: Shape, config: BlockConfig) -> Tuple[int, int]:
        return bucket(shape.d), bucket(shape.e)

    def shared_memory_bytes(self, shape: Shape, config: BlockConfig) -> int:
        """Stages K and V tiles, the Q tile (reused for O by the epilogue), and P's scratch rows (in the Q tile's
        space when Q_i sits in registers); rows padded (row_pads); for 3xTF32, a copy of the K, V and Q regions
        for their low parts; the block's Sweep; with dropout, two keep tiles last (dropout_bytes). Mirrors
        MmaShared."""
        D, E, item = bucket(shape.d), bucket(shape.e), shape.dtype.itemsize
        qk_pad, pad = row_pads(shape)
        k = item * config.Bc * (D + qk_pad)
        v = item * config.Bc * (E + pad)
        q = item * config.Br * max(D + qk_pad, E + pad)
        p = item * config.warps * ROWS_PER_TILE * (config.Bc + pad)
        rest = max(q, p) if q_in_registers(shape, config) else q + p
        lo = config.stages * (k + v) + q if three_passes(shape) else 0
        return config.stages * (k + v) + rest + lo + SWEEP_BYTES + dropout_bytes(shape, config, 2)

    def accumulator_words(self, shape: Shape, config: BlockConfig) -> int:
        """32-bit registers per thread for S (Bc/2 accumulators per m16 tile), O_i (E/2) and, when kept, Q_i's
        fragments (D/4 of 16-bit types); float64 accumulators take two registers each. Where the other tiles take
        their keys in parts, their share of S: the steady loop holds S whole, without their visibility and
        copies, and has room for STEADY_REGISTER_LIMIT words (past it, its own count, which the limit refuses). With
        dropout, two m16 tiles per warp count S + O_i + DROPOUT_WORDS at least."""
        mt, acc = tiles_per_warp(config), max(1, shape.dtype.itemsize // 4)
        s, o = mt * config.Bc // 2 * acc, mt * bucket(shape.e) // 2 * acc
        if s + o > STEADY_REGISTER_LIMIT:
            return s + o
        if shape.dropout and mt > 1:
            return max(s + o + DROPOUT_WORDS, self.accumulator_words(dataclasses.replace(shape, dropout=False), config))
        words = s // key_parts(shape, config) + o
        if q_in_registers(shape, config):
            words += mt * bucket(shape.d) * shape.dtype.itemsize // 8
        return words

    def registers_estimate(self, shape: Shape, config: BlockConfig) -> int:
        return min(255, (64 + self.accumulator_words(shape, config) + 7) // 8 * 8)

    def config_reasons(self, shape: Shape, config: BlockConfig) -> List[str]:
        reasons = []
        if config.head_tile is not None:
            reasons.append(f"head_tile={config.head_tile} is a setting of the CUDA-core kernel (variant 'fma'); the "
                           f"tensor-core kernel takes head dims up to {MAX_HEAD_DIM} whole")
        return reasons + own_rows_reasons("Br", config.Br, config, "tensor-core kernel") + \
            swept_reasons("Bc", config.Bc, "tensor-core kernel", MAX_BC)

    def template_args(self, shape: Shape, config: BlockConfig, split: bool) -> list:
        """fwd_mma<T, Br, Bc, D, E, Warps, Stages[, Split[, Passes]]>: float32 always names its TF32 passes."""
        args = [C_TYPES[shape.dtype.name], config.Br, config.Bc, bucket(shape.d), bucket(shape.e), config.warps,
                config.stages]
        if shape.dtype.name == "float32":
            return args + ["true" if split else "false", PASSES[shape.precision]]
        return args + ["true"] if split else args

    def candidates(self, shape: Shape) -> List[tuple]:
        """CANDIDATES, two m16 tiles per warp only where Q_i's fragments stay in registers, or, for the 16-bit
        types, where a key tile of 64 or more pays for reading them from shared memory every tile: each Q fragment
        then feeds eight mma, each K and V fragment four (0.31 ldmatrix per mma, against 0.5 with one m16 tile per
        warp); with 32 keys re-reading Q_i would cost the ldmatrix the second tile saves."""
        def takes(c):
            return tiles_per_warp(c) == 1 or q_in_registers(shape, c) or (shape.dtype.itemsize == 2 and c.Bc >= 64)
        return [tuple(c for c in CANDIDATES if takes(c))]

    def limits(self) -> Dict[str, int]:
        return {"cuflash::mma_forward::kQRegisterWords": Q_REGISTER_WORDS,
                "cuflash::mma_forward::kPartsWords": PARTS_WORDS, "cuflash::mma_forward::kMaxBc": MAX_BC,
                "cuflash::mma_forward::kMaxHeadDim": MAX_HEAD_DIM, "(int)cuflash::align16(sizeof(cuflash::Sweep))":
                SWEEP_BYTES, "cuflash::mma::kChunk * 2": ROW_PAD_BYTES}


FORWARD = TensorCoreForward()
