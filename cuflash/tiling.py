"""Block sizes and the device: BlockConfig, DeviceLimits, the shared-memory model, occupancy, the reasons a
configuration cannot run, and the heuristic that chooses one.

The shared-memory model mirrors `ForwardShared` in kernels/forward.cuh byte for byte (tests/test_compile.py holds
the two together through the compiler). Everything here is plain Python: it plans for a device that is not
present as well as for the one that is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import numpy as np

from .dtypes import acc_dtype_of

KiB = 1024

LANES_PER_ROW = 16  # TC in the kernel: lanes that share a row group
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256, 512)  # D and E instantiations; the actual d, e are run-time values
MAX_BUCKET = {"float16": 256, "bfloat16": 256, "float32": 512, "float64": 512}
DECODE_ROWS = 16  # queries per batch item up to which a few short query tiles and split keys serve (decoding)
SPLIT_MIN_KEYS = 512  # keys a split sweeps at least: fewer, and merging the splits costs more than it gains
ACC_REGISTER_LIMIT = 96  # accumulator words per thread (S, O) above which ptxas runs out of registers (255)
ACC_REGISTER_TARGET = 64  # what the heuristic allows itself, leaving room for addresses and staging
MAX_TILE = 256


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of the forward kernel: Br query rows and Bc keys per tile, warps per block, pipeline stages.

    variant: "fma" is the CUDA-core kernel (any dtype; no load pipeline, stages=1); "mma" the tensor-core kernel
    for float16/bfloat16 on compute capability 8.0+ (cuflash.tensorcore; stages 2 or 3: BlockConfig.mma).

    head_tile ("fma" only): the widest head-dimension tile, D and E in the kernel (a bucket: 16, 32, ... 512). A d
    past it is swept in slices and an e past it split into column blocks; None: the dtype's largest bucket (256
    for 16-bit types, 512 otherwise). A narrower tile lets large head dims fit a small shared memory."""

    Br: int
    Bc: int
    warps: int = 4
    stages: int = 1
    variant: str = "fma"
    head_tile: Optional[int] = None

    @classmethod
    def mma(cls, Br: int, Bc: int, warps: int = 4, stages: int = 2) -> "BlockConfig":
        """A tensor-core configuration."""
        return cls(Br, Bc, warps, stages, "mma")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def row_groups(self) -> int:
        return self.threads // LANES_PER_ROW

    def __str__(self):
        if self.variant != "fma":
            return f"({self.Br}, {self.Bc}, warps={self.warps}, stages={self.stages}, {self.variant})"
        extra = "" if (self.warps, self.stages) == (4, 1) else f", warps={self.warps}" + (
            "" if self.stages == 1 else f", stages={self.stages}")
        if self.head_tile is not None:
            extra += f", head_tile={self.head_tile}"
        return f"({self.Br}, {self.Bc}{extra})"


@dataclass(frozen=True)
class DeviceLimits:
    """What a GPU allows a thread block; read from the device, or one of KNOWN for planning without it."""

    name: str
    compute_capability: Tuple[int, int]
    sm_count: int
    smem_per_block: int  # opt-in maximum of dynamic shared memory per block
    smem_per_sm: int
    regs_per_sm: int = 65536
    regs_per_thread: int = 255
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    smem_default: int = 48 * KiB  # what a block gets without opting in
    smem_reserved_per_block: int = 1024  # the system's share of each block's shared memory (sm_80 and later)

    @property
    def arch(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    @classmethod
    def known(cls, name: str) -> "DeviceLimits":
        """A GPU of the table by a part of its name, case-insensitive: "A100", "h100", "RTX 4090"."""
        key = name.lower().replace("nvidia", "").strip()
        for exact in (True, False):  # "A10" is the A10, not the A100
            for limits in KNOWN:
                known = limits.name.lower()
                if key and (known == key or known.endswith(" " + key) if exact else key in known):
                    return limits
        names = ", ".join(limits.name for limits in KNOWN)
        raise ValueError(f"unknown GPU {name!r}; known: {names}")

    @classmethod
    def of(cls, device=None) -> "DeviceLimits":
        """The limits of a CUDA device (a cupy.cuda.Device, an id, or None for the current one), read through CuPy;
        BackendUnavailableError when CuPy is missing (DeviceLimits.known plans for a GPU without one)."""
        try:
            import cupy
        except ImportError as exc:
            from .backends import BackendUnavailableError
            raise BackendUnavailableError(
                f"DeviceLimits.of: reading a GPU's limits needs CuPy ({exc}); pip install cupy-cuda12x, or plan "
                f"for a GPU you do not have with DeviceLimits.known(name)") from None

        if device is None:
            device = cupy.cuda.Device()
        index = device.id if hasattr(device, "id") else int(device)
        return _device_limits(index)


def _device_limits(index: int) -> DeviceLimits:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    cc = (int(props["major"]), int(props["minor"]))
    return DeviceLimits(
        name=name, compute_capability=cc, sm_count=int(props["multiProcessorCount"]),
        smem_per_block=int(props.get("sharedMemPerBlockOptin", props.get("sharedMemPerBlock", 48 * KiB))),
        smem_per_sm=int(props["sharedMemPerMultiprocessor"]),
        regs_per_sm=int(props["regsPerMultiprocessor"]),
        max_threads_per_sm=int(props["maxThreadsPerMultiProcessor"]),
        max_blocks_per_sm=int(props.get("maxBlocksPerMultiProcessor", 16)),
        max_threads_per_block=int(props["maxThreadsPerBlock"]),
        smem_reserved_per_block=int(props.get("reservedSharedMemPerBlock", 1024 if cc >= (8, 0) else 0)),
    )


# Known GPUs (CUDA C Programming Guide, compute capabilities table; SM counts of the common SKUs).
KNOWN = (
    DeviceLimits("Tesla V100", (7, 0), 80, 98304, 98304, max_blocks_per_sm=32, smem_reserved_per_block=0),
    DeviceLimits("Tesla T4", (7, 5), 40, 65536, 65536, max_threads_per_sm=1024, max_blocks_per_sm=16,
                 smem_reserved_per_block=0),
    DeviceLimits("A100", (8, 0), 108, 166912, 167936),
    DeviceLimits("A10", (8, 6), 72, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=16),
    DeviceLimits("GeForce RTX 3090", (8, 6), 82, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=16),
    DeviceLimits("L4", (8, 9), 58, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=24),
    DeviceLimits("GeForce RTX 4090", (8, 9), 128, 101376, 102400, max_threads_per_sm=1536, max_blocks_per_sm=24),
    DeviceLimits("H100", (9, 0), 132, 232448, 233472),
    DeviceLimits("H200", (9, 0), 132, 232448, 233472),
)


# ----------------------------------------------------------------------------------------------------------------
# What one instantiation needs


@dataclass(frozen=True)
class Workload:
    """What the kernel's resources depend on: the element dtype and the head dimensions (a Problem has these too)."""

    dtype: np.dtype
    d: int
    e: int


def bucket(size: int) -> int:
    """The head-dimension instantiation serving `size` (the smallest bucket >= size)."""
    for b in HEAD_DIM_BUCKETS:
        if size <= b:
            return b
    raise ValueError(f"head dimension {size} is above the largest bucket {HEAD_DIM_BUCKETS[-1]}")


def fma_buckets(workload, config: BlockConfig) -> Tuple[int, int]:
    """(D, E) of the CUDA-core instantiation serving workload with config. Head dimensions past the head tile
    (config.head_tile, else the dtype's largest bucket) are served in pieces: the kernel sweeps d in D-wide slices,
    and the launch splits e into E-wide column blocks."""
    limit = config.head_tile or MAX_BUCKET[np.dtype(workload.dtype).name]
    return bucket(min(workload.d, limit)), bucket(min(workload.e, limit))


def _align16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


def shared_memory_bytes(workload, config: BlockConfig) -> int:
    """Dynamic shared memory of one block: the Q, K, V tiles in the element type (rows padded to an odd number of
    32-bit words) and P in the accumulator type; each region 16-byte aligned. Mirrors ForwardShared."""
    if config.variant == "mma":
        return tensorcore.shared_memory_bytes(workload, config)
    item = np.dtype(workload.dtype).itemsize
    acc = acc_dtype_of(workload.dtype).itemsize
    D, E = fma_buckets(workload, config)
    pad = 4 // item if item < 4 else 1
    q = _align16(item * config.Br * (D + pad))
    k = _align16(item * config.Bc * (D + pad))
    v = _align16(item * config.Bc * E)
    p = _align16(acc * config.Br * (config.Bc + 1))
    return q + k + v + p


def accumulator_words(workload, config: BlockConfig) -> int:
    """32-bit registers a thread holds for its scores S and output O_i: rows x (score + output columns)."""
    if config.variant == "mma":
        return tensorcore.accumulator_words(workload, config)
    rows = config.Br // max(1, config.row_groups)
    cols = config.Bc // LANES_PER_ROW + fma_buckets(workload, config)[1] // LANES_PER_ROW
    return rows * cols * (acc_dtype_of(workload.dtype).itemsize // 4)


def registers_estimate(workload, config: BlockConfig) -> int:
    """A rough registers-per-thread figure for occupancy (the compile report has the compiler's)."""
    return min(255, (40 + 2 * accumulator_words(workload, config) + 7) // 8 * 8)


def occupancy(workload, config: BlockConfig, device: DeviceLimits) -> int:
    """Blocks that fit on one SM at once, limited by shared memory, threads, registers and the block count."""
    smem = shared_memory_bytes(workload, config) + device.smem_reserved_per_block
    regs = registers_estimate(workload, config) * config.threads
    return max(0, min(device.max_blocks_per_sm, device.max_threads_per_sm // config.threads,
                      device.regs_per_sm // regs, device.smem_per_sm // smem))


# ----------------------------------------------------------------------------------------------------------------
# Reasons and the heuristic


def fmt_bytes(nbytes: int) -> str:
    return f"{nbytes // KiB} KiB" if nbytes % KiB == 0 else f"{nbytes / KiB:.1f} KiB"


def describe_workload(workload) -> str:
    dtype = np.dtype(workload.dtype).name
    dims = f"d={workload.d}" if workload.d == workload.e else f"d={workload.d}, e={workload.e}"
    return f"{dims} {dtype}"


def _shape_reasons(config: BlockConfig) -> List[str]:
    """Reasons that depend on the configuration alone."""
    reasons = []
    if config.warps not in (1, 2, 4, 8):
        reasons.append(f"warps={config.warps} is not supported: the kernel runs 1, 2, 4 or 8 warps per block")
        return reasons
    groups = config.row_groups
    if not (config.Br % groups == 0 and groups <= config.Br <= MAX_TILE):
        reasons.append(
            f"Br={config.Br} is not supported with {config.warps} warps: Br must be a multiple of {groups} "
            f"(the {groups} row groups of {LANES_PER_ROW} lanes) between {groups} and {MAX_TILE}")
    if not (config.Bc % LANES_PER_ROW == 0 and LANES_PER_ROW <= config.Bc <= MAX_TILE):
        reasons.append(
            f"Bc={config.Bc} is not supported: Bc must be a multiple of {LANES_PER_ROW} "
            f"between {LANES_PER_ROW} and {MAX_TILE}")
    if config.stages != 1:
        reasons.append(f"stages={config.stages} is not supported: the CUDA-core kernel has no load pipeline "
                       f"(stages=1)")
    return reasons


def _dtype_reasons(workload) -> List[str]:
    dtype = np.dtype(workload.dtype)
    if dtype.name not in MAX_BUCKET:
        return [f"dtype {dtype.name} is not supported by the kernel: use float16, bfloat16, float32 or float64"]
    return []


def _head_tile_reasons(workload, config: BlockConfig) -> List[str]:
    largest = MAX_BUCKET[np.dtype(workload.dtype).name]
    if config.head_tile is None or (config.head_tile in HEAD_DIM_BUCKETS and config.head_tile <= largest):
        return []
    allowed = ", ".join(str(b) for b in HEAD_DIM_BUCKETS if b <= largest)
    return [f"head_tile={config.head_tile} is not supported for {np.dtype(workload.dtype).name}: use one of "
            f"{allowed}, or None"]


def not_supported_reasons(workload, config: BlockConfig, device: DeviceLimits, *, suggest: bool = True) -> List[str]:
    """Every reason `config` cannot run `workload` (anything with dtype, d, e: a Problem, a Workload) on `device`,
    each a sentence naming what was asked, the limit and a configuration that fits. Empty: supported."""
    if config.variant == "mma":
        if config.head_tile is not None:
            return [f"head_tile={config.head_tile} is a setting of the CUDA-core kernel (variant 'fma'); the "
                    f"tensor-core kernel takes head dims up to {tensorcore.MAX_HEAD_DIM} whole"]
        return tensorcore.not_supported_reasons(workload, config, device, suggest=suggest)
    if config.variant != "fma":
        return [f"variant {config.variant!r} is not a kernel: 'fma' (CUDA cores) or 'mma' (tensor cores)"]
    reasons = _dtype_reasons(workload)
    if reasons:
        return reasons
    reasons = _shape_reasons(config) + _head_tile_reasons(workload, config)
    if reasons:
        return _with_suggestion(reasons, workload, device, suggest)
    what = f"block {config} for {describe_workload(workload)}"
    if config.threads > device.max_threads_per_block:
        reasons.append(f"{what} runs {config.threads} threads; {device.name} allows {device.max_threads_per_block}")
    smem = shared_memory_bytes(workload, config)
    if smem > device.smem_per_block:
        reasons.append(
            f"{what} needs {fmt_bytes(smem)} of shared memory; {device.name} allows {fmt_bytes(device.smem_per_block)} "
            f"per block")
    words = accumulator_words(workload, config)
    if words > ACC_REGISTER_LIMIT:
        reasons.append(
            f"{what} keeps {words} accumulator registers per thread, more than the {ACC_REGISTER_LIMIT} the kernel "
            f"holds without spilling; use a smaller Br or more warps")
    return _with_suggestion(reasons, workload, device, suggest)


def _with_suggestion(reasons, workload, device, suggest):
    if reasons and suggest:
        fit = _first_fit(workload, device)
        reasons[-1] += f"; {fit} fits" if fit else f"; no configuration fits {describe_workload(workload)} on {device.name}"
    return reasons


# Preference order: large tiles with a few rows per thread first, then smaller tiles for large head dims or small
# shared memories.
CANDIDATES = tuple(BlockConfig(br, bc, w) for br, bc, w in (
    (64, 64, 4), (64, 64, 8), (32, 64, 4), (32, 64, 8), (32, 32, 4), (32, 32, 8), (16, 64, 8), (16, 32, 8),
    (16, 16, 8), (8, 32, 4), (8, 16, 4), (4, 16, 2)))


def _first_fit(workload, device) -> Optional[BlockConfig]:
    """The first candidate within the register target that runs; failing that (the largest head dims), the first
    that runs at all. When none runs with whole head dims (large d on a small shared memory), the same with ever
    narrower head tiles."""
    widest = max(fma_buckets(workload, CANDIDATES[0]))
    for tile in [None] + [b for b in reversed(HEAD_DIM_BUCKETS) if b < widest]:
        candidates = [replace(c, head_tile=tile) for c in CANDIDATES]
        runs = [c for c in candidates if not not_supported_reasons(workload, c, device, suggest=False)]
        roomy = [c for c in runs if accumulator_words(workload, c) <= ACC_REGISTER_TARGET]
        if roomy or runs:
            return (roomy or runs)[0]
    return None


def key_splits(problem, config: BlockConfig, device: DeviceLimits) -> int:
    """How many splits of the key axis either kernel sweeps in parallel (flash-decoding; 1: none): when the
    batch's query tiles leave at least half the GPU's SMs without a block, as many splits as one wave of blocks
    holds, each at least SPLIT_MIN_KEYS keys. Needs the problem's n, m and batch size."""
    blocks = -(-problem.n // config.Br) * problem.batch_size
    if blocks == 0 or 2 * blocks > device.sm_count:
        return 1
    return max(1, min(device.sm_count // blocks, problem.m // SPLIT_MIN_KEYS))


def _decode_fit(problem, device: DeviceLimits) -> Optional[BlockConfig]:
    """For a few queries per batch item over many keys (decoding) on too few blocks to fill the GPU: the
    CUDA-core kernel with 8- or 16-row query tiles and split keys, whatever the dtype. Such a problem is bound by
    reading K and V, which split keys spread over every SM; the tensor-core kernel's tiles of 64 to 128 rows would
    mostly compute rows that do not exist."""
    n = getattr(problem, "n", None)
    if n is None or not 1 <= n <= DECODE_ROWS or _dtype_reasons(problem):
        return None
    rows = 8 if n <= 8 else 16
    for config in CANDIDATES:
        if config.Br == rows and not not_supported_reasons(problem, config, device, suggest=False) and \
                accumulator_words(problem, config) <= ACC_REGISTER_TARGET:
            return config if key_splits(problem, config, device) > 1 else None
    return None


def choose(workload, device: DeviceLimits) -> BlockConfig:
    """The heuristic's configuration for (dtype, d, e) on `device`: the tensor-core kernel where it runs
    (float16/bfloat16 on compute capability 8.0+), else the CUDA-core kernel; ValueError when none fits. Given a
    Problem (n, m and the batch known), decoding-shaped problems take the CUDA-core kernel with split keys."""
    decode = _decode_fit(workload, device)
    if decode is not None:
        return decode
    fast = tensorcore.first_fit(workload, device)
    if fast is not None:
        return fast
    reasons = _dtype_reasons(workload)
    config = None if reasons else _first_fit(workload, device)
    if config is None:
        raise ValueError("attention: " + ("; ".join(reasons) if reasons else
                         f"no block configuration fits {describe_workload(workload)} on {device.name}: "
                         f"it allows {fmt_bytes(device.smem_per_block)} of shared memory per block"))
    return config


def block_pair(block) -> Tuple[int, int]:
    """(Br, Bc) as ints from block=(Br, Bc); ValueError unless both are positive ints."""
    try:
        br, bc = block
    except (TypeError, ValueError):
        br = bc = None
    for value in (br, bc):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"attention: block must be a pair (Br, Bc) of positive ints or a cuflash.BlockConfig, "
                             f"got {block!r}")
    return int(br), int(bc)


def resolve(block, workload, device: DeviceLimits) -> BlockConfig:
    """The configuration to run: the heuristic's for block=None; the heuristic's within one kernel for
    block="mma" or "fma"; else `block` ((Br, Bc), on the tensor-core kernel when it can run them, or a
    BlockConfig) validated. ValueError listing every reason when it cannot run."""
    if block is None:
        return choose(workload, device)
    if isinstance(block, str) and block in ("mma", "fma"):
        config = tensorcore.first_fit(workload, device) if block == "mma" else _first_fit(workload, device)
        if config is None:
            reasons = not_supported_reasons(workload, BlockConfig(64, 64, 4, 2 if block == "mma" else 1, block),
                                            device) or [f"no {block} configuration fits {describe_workload(workload)}"]
            raise ValueError(f"attention: block {block!r} cannot run here: " + "; ".join(reasons))
        return config
    if isinstance(block, BlockConfig):
        config = block
    else:
        br, bc = block_pair(block)
        config = tensorcore.with_warps(br, bc, workload, device) or _warps_for(br, bc, workload, device)
    reasons = not_supported_reasons(workload, config, device)
    if reasons:
        raise ValueError(f"attention: block {config} cannot run here: " + "; ".join(reasons))
    return config


def _warps_for(br: int, bc: int, workload, device) -> BlockConfig:
    """(Br, Bc) with the first warp count that runs it, preferring 4; 4 when none does (its reasons are shown)."""
    for warps in (4, 8, 2, 1):
        config = BlockConfig(br, bc, warps)
        if not not_supported_reasons(workload, config, device, suggest=False):
            return config
    return BlockConfig(br, bc, 4)


from . import tensorcore  # noqa: E402  (the tensor-core plan builds on the names above)
