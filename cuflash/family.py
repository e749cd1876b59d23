"""A kernel family described once: Shape (what planning depends on), BlockConfig (one configuration of a family)
and Family (which problems a kernel takes, its tile candidates, its shared-memory and register model, its name
expression and the reasons a configuration cannot run).

Each kernel's description is a small subclass of Family beside its CUDA (cuflash/kernels/forward.py beside
forward.cuh, ...); the heuristic in tiling.py walks them. The sentences every family shares (threads, shared
memory, registers, warps, the suggestion of a configuration that fits) are written here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .devices import DeviceLimits, fmt_bytes

LANES_PER_ROW = 16  # TC in the CUDA-core kernel: lanes that share a row group
WARPS = (1, 2, 4, 8)  # warps per block every kernel runs
WARP_PREFERENCE = (4, 8, 2, 1)  # the order in which (Br, Bc) given without warps tries them
C_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
# precision= (Shape.precision): how float32 may use tensor cores. "highest": float32-exact (3xTF32 on tensor cores,
# or CUDA cores); "tf32": one TF32 pass; "fma": CUDA cores only, for any dtype.
PRECISIONS = ("highest", "tf32", "fma")


def align16(nbytes: int) -> int:
    """nbytes rounded up to a 16-byte boundary, as the kernels' shared-memory structs align each region."""
    return (nbytes + 15) // 16 * 16


DROPOUT_ROW_BYTES = 48  # the block's DropoutRow (kernels/tile.cuh), aligned


def dropout_bytes(shape: "Shape", config: "BlockConfig", buffers: int) -> int:
    """Shared memory a kernel compiled for dropout adds at the end of its layout (kernels/block.cuh BlockDropout):
    the block's DropoutRow, then `buffers` keep tiles of Br query rows by Bc keys (KeepTile: a shift word, 16 bytes,
    then each row's bits in (Bc + 2) // 32 + 2 words). 0 for a shape without dropout."""
    if not shape.dropout:
        return 0
    words = (config.Bc + 2) // 32 + 2
    return DROPOUT_ROW_BYTES + buffers * align16(16 + config.Br * 4 * words)


def check_precision(precision, dtype, name: str) -> str:
    """precision= checked and normalized for dtype (the one rule, wherever it is given): None is "highest", and
    "tf32", a float32 choice, is "highest" for the other dtypes (dtype None: not known yet, "tf32" stays).
    name: the caller, as its errors begin."""
    choices = ", ".join(map(repr, PRECISIONS))
    if precision is None:
        return "highest"
    if not isinstance(precision, str):
        raise TypeError(f"{name}: precision must be one of {choices} or None, got {precision!r} "
                        f"({type(precision).__name__})")
    if precision not in PRECISIONS:
        raise ValueError(f"{name}: unknown precision {precision!r}; choose one of {choices} or None")
    if precision == "tf32" and dtype is not None and np.dtype(dtype) != np.float32:
        return "highest"
    return str(precision)


@dataclass(frozen=True)
class Shape:
    """What a plan depends on: the element dtype and the head dims d and e, and, when known, n, m and the batch size.

    A Problem gives its own as Problem.shape; `cuflash.tiling.plan` takes one to plan for any shape on any GPU.

    Parameters
    ----------
    dtype : dtype
        The element type.
    d, e : int
        The head dims of q and k, and of v.
    n, m : int, optional
        The query and key counts; None: planned for any sequence lengths (no key splits, no decoding choice).
    batch_size : int, optional
        Batch items.
    precision : str, optional
        ``precision=`` normalized for the dtype ("highest", "tf32" for float32 only, or "fma").
    packed, paged, dropout : bool, optional
        Packed sequences (n and m the longest's: no key splits), paged keys and values (the kernels compiled to walk
        pages), attention dropout (the kernels compiled to regenerate the keep mask).
    splits : int, optional
        Key splits forced (attention_paged's num_splits); None: the heuristic's.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import tiling
    >>> print(tiling.Shape(np.float32, 64, 32, precision="tf32"))
    d=64, e=32 float32, precision='tf32'
    """

    dtype: np.dtype
    d: int
    e: int
    n: Optional[int] = None
    m: Optional[int] = None
    batch_size: int = 1
    precision: str = "highest"
    packed: bool = False  # packed sequences (n and m the longest's): no key splits
    paged: bool = False  # paged keys and values (m the longest sequence's): the kernels compiled to walk pages
    splits: Optional[int] = None  # key splits forced (attention_paged's num_splits); None: the heuristic's
    dropout: bool = False  # attention dropout: the kernels compiled to regenerate the keep mask

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "precision", check_precision(self.precision, self.dtype, "Shape"))

    def __str__(self):
        dims = f"d={self.d}" if self.d == self.e else f"d={self.d}, e={self.e}"
        shown = "" if self.precision == "highest" else f", precision={self.precision!r}"
        return f"{dims} {self.dtype.name}{shown}"


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes of a kernel: Br query rows and Bc keys per tile, warps per block, pipeline stages.

    Passed as ``block=`` it forces a kernel and its tiles; one that cannot run raises ``ValueError`` listing every
    reason, each a sentence with the limit and a configuration that fits.

    Parameters
    ----------
    Br, Bc : int
        Query rows and keys per tile.
    warps : int, optional
        Warps per block: 1, 2, 4 or 8.
    stages : int, optional
        Pipeline stages of the swept tiles.
    variant : {"fma", "mma"}, optional
        Names the family: "fma" the CUDA-core kernels (any dtype; stages=1, or 2 to double-buffer the swept tiles
        through cp.async on compute capability 8.0+); "mma" the tensor-core kernels on compute capability 8.0+ (the
        forward's stages 2 or 3: `BlockConfig.mma`; the backward's 1 or 2).
    head_tile : int, optional
        ("fma" only) The widest head-dimension tile, D and E in the kernel (a bucket: 16, 32, ... 512). A d past it is
        swept in slices and an e past it split into column blocks; None: the dtype's largest bucket (256 for 16-bit
        types, 512 otherwise). A narrower tile lets large head dims fit a small shared memory.

    Examples
    --------
    What the planner chooses for float16 at d = 64 on an H100, and why a forced block cannot run on an A100:

    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import tiling
    >>> from cuflash.family import Shape
    >>> plan = tiling.plan(Shape(np.float16, 64, 64), cuflash.DeviceLimits.known("H100"))
    >>> print(plan.config, plan.name)
    (128, 128, warps=4, stages=2, mma) cuflash::fwd_mma<__half, 128, 128, 64, 64, 4, 2>
    >>> reasons = tiling.not_supported_reasons(Shape(np.float32, 256, 256), cuflash.BlockConfig(64, 64, warps=8),
    ...                                        cuflash.DeviceLimits.known("A100"))
    >>> for part in reasons[0].split("; "):
    ...     print(part)
    block (64, 64, warps=8) for d=256 float32 needs 214 KiB of shared memory
    A100 allows 163 KiB per block
    (32, 32, warps=8) fits
    """

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
        extra = ("" if self.warps == 4 else f", warps={self.warps}") + (
            "" if self.stages == 1 else f", stages={self.stages}")
        if self.head_tile is not None:
            extra += f", head_tile={self.head_tile}"
        return f"({self.Br}, {self.Bc}{extra})"


Reasons = List[str]


class Family:
    """One kernel, described once: a subclass per kernel, beside its CUDA in cuflash/kernels (forward.py for
    forward.cuh, and so on), overrides what is its own; the heuristic within a family and the sentences every
    family shares (threads, shared memory, registers, warps, the suggestion of a configuration that fits) are here.

    variant: BlockConfig.variant of its configurations. title: how sentences name it. template: the kernel's C++
    name; source: its file in cuflash/kernels; shared_struct: the C struct its shared_memory_bytes mirrors. kind:
    what it computes ("forward"; "dq" or "dkdv", the two halves of the backward). tiles_along: the axis its blocks
    tile ("queries": one block per Br queries; "keys": one per Bc keys). stages: the pipeline stages it takes, in
    order of preference. register_target: accumulator words a chosen configuration keeps at most; register_limit:
    past it, refused (register_bounds: where they depend on the dtype or precision); register_advice: what to
    change when over the limit. min_resident_warps: the heuristic takes only configurations that keep at least this
    many warps on an SM (forced ones run whatever it is): fewer leave a tensor core waiting on memory, and the next
    family runs such shapes instead."""

    variant: str = ""
    title: str = ""
    template: str = ""
    source: str = ""
    shared_struct: str = ""
    kind: str = "forward"
    tiles_along: str = "queries"
    stages: Tuple[int, ...] = (1,)
    register_target: int = 0
    register_limit: int = 0
    register_advice: str = ""
    min_resident_warps: int = 0

    def __repr__(self):
        return f"<the {self.title} kernel family {self.variant!r}{'' if self.kind == 'forward' else ' ' + self.kind}>"

    # ---- what each kernel describes ---------------------------------------------------------------------------

    def eligibility(self, shape: Shape, device: DeviceLimits) -> Reasons:
        """Why it cannot serve this dtype, these head dims or this device at all (empty: it can)."""
        raise NotImplementedError

    def config_reasons(self, shape: Shape, config: BlockConfig) -> Reasons:
        """Why a configuration is malformed for it, whatever the device."""
        raise NotImplementedError

    def buckets(self, shape: Shape, config: BlockConfig) -> Tuple[int, int]:
        """(D, E) of the instantiation serving shape with config."""
        raise NotImplementedError

    def shared_memory_bytes(self, shape: Shape, config: BlockConfig) -> int:
        """Dynamic shared memory of one block: the kernel's shared_struct, byte for byte."""
        raise NotImplementedError

    def accumulator_words(self, shape: Shape, config: BlockConfig) -> int:
        """32-bit registers a thread keeps for its accumulators (what its register bounds limit)."""
        raise NotImplementedError

    def registers_estimate(self, shape: Shape, config: BlockConfig) -> int:
        """A rough registers-per-thread figure for occupancy (the compile report has the compiler's)."""
        raise NotImplementedError

    def template_args(self, shape: Shape, config: BlockConfig, split: bool) -> Sequence[object]:
        """The name expression's template arguments (split: the instantiation writing split keys' partials)."""
        raise NotImplementedError

    def candidates(self, shape: Shape) -> Sequence[Sequence[BlockConfig]]:
        """Lists of configurations in preference order, tried list by list."""
        raise NotImplementedError

    def column_width(self, shape: Shape, config: BlockConfig) -> int:
        """The widest e one launch covers (a wider e is split into column blocks)."""
        return max(1, shape.e)

    def register_bounds(self, shape: Shape) -> Tuple[int, int]:
        """(target, limit) of the accumulator words a configuration for shape keeps."""
        return self.register_target, self.register_limit

    def limits(self) -> Dict[str, int]:
        """Limits this description shares with its kernel: a C++ constant expression (compiled after the kernel's
        source) and its value here. tests/test_layout.py holds each pair together by a static_assert."""
        return {}

    # ---- what follows from the description ----------------------------------------------------------------

    def tiles(self, shape: Shape, config: BlockConfig) -> int:
        """Blocks along the grid's x axis (per key split): one per query tile, or per key tile (0: unknown)."""
        rows, tile = (shape.n, config.Br) if self.tiles_along == "queries" else (shape.m, config.Bc)
        return -(-rows // tile) if rows is not None else 0

    def name_expression(self, shape: Shape, config: BlockConfig, split: bool = False) -> str:
        """The C++ name expression of the instantiation serving shape with config (split: the one writing
        partial results in the accumulator type, for split keys)."""
        return f"{self.template}<{', '.join(map(str, self.template_args(shape, config, split)))}>"

    def column_blocks(self, shape: Shape, config: BlockConfig) -> Tuple[Tuple[int, int], ...]:
        """The [e0, e1) column blocks of the output, one launch each (each recomputes the scores)."""
        width = self.column_width(shape, config)
        return tuple((e0, min(shape.e, e0 + width)) for e0 in range(0, shape.e, width)) or ((0, 0),)

    def occupancy(self, shape: Shape, config: BlockConfig, device: DeviceLimits) -> int:
        """Blocks that fit on one SM at once, limited by shared memory, threads, registers and the block count."""
        smem = self.shared_memory_bytes(shape, config) + device.smem_reserved_per_block
        regs = self.registers_estimate(shape, config) * config.threads
        return max(0, min(device.max_blocks_per_sm, device.max_threads_per_sm // config.threads,
                          device.regs_per_sm // regs, device.smem_per_sm // smem))

    # ---- reasons ----------------------------------------------------------------------------------------------

    def not_supported_reasons(self, shape: Shape, config: BlockConfig, device: DeviceLimits, *,
                              suggest: bool = True) -> Reasons:
        """Every reason `config` cannot run `shape` on `device`, each a sentence naming what was asked, the limit
        and (suggest) a configuration of this family that fits. Empty: supported."""
        reasons = self.eligibility(shape, device)
        if reasons:
            return reasons
        reasons = self._config_reasons(shape, config) or self._resource_reasons(shape, config, device)
        if reasons and suggest:
            fit = self.first_fit(shape, device)
            reasons[-1] += f"; {fit} fits" if fit else f"; no {self.title} configuration fits {shape} on {device.name}"
        return reasons

    def _config_reasons(self, shape: Shape, config: BlockConfig) -> Reasons:
        if config.warps not in WARPS:
            return [f"warps={config.warps} is not supported: the {self.title} kernel runs 1, 2, 4 or 8 warps per "
                    f"block"]
        reasons = self.config_reasons(shape, config)
        if config.stages not in self.stages:
            pipeline = ("has no load pipeline (stages=1)" if self.stages == (1,) else
                        f"pipelines K/V in {' or '.join(map(str, sorted(self.stages)))} stages")
            reasons.append(f"stages={config.stages} is not supported: the {self.title} kernel {pipeline}")
        return reasons

    def _resource_reasons(self, shape: Shape, config: BlockConfig, device: DeviceLimits) -> Reasons:
        what = f"block {config} for {shape}"
        reasons = []
        if config.threads > device.max_threads_per_block:
            reasons.append(f"{what} runs {config.threads} threads; {device.name} allows {device.max_threads_per_block}")
        smem = self.shared_memory_bytes(shape, config)
        if smem > device.smem_per_block:
            reasons.append(f"{what} needs {fmt_bytes(smem)} of shared memory; {device.name} allows "
                           f"{fmt_bytes(device.smem_per_block)} per block")
        if config.stages > 1 and tuple(device.compute_capability) < (8, 0):
            reasons.append(f"stages={config.stages} pipelines tile loads with cp.async, which needs compute "
                           f"capability 8.0 or newer; {device.name} has {device.arch}: use stages=1")
        words, limit = self.accumulator_words(shape, config), self.register_bounds(shape)[1]
        if words > limit:
            reasons.append(f"{what} keeps {words} accumulator registers per thread, more than the "
                           f"{limit} the kernel holds without spilling; {self.register_advice}")
        return reasons

    # ---- the heuristic within the family ----------------------------------------------------------------------

    def runs(self, shape: Shape, config: BlockConfig, device: DeviceLimits) -> bool:
        return not self.not_supported_reasons(shape, config, device, suggest=False)

    def first_fit(self, shape: Shape, device: DeviceLimits) -> Optional[BlockConfig]:
        """The first candidate within the register target that runs and keeps min_resident_warps on an SM; failing
        that, the first that runs so at all; trying the candidate lists in order (None: none runs)."""
        if self.eligibility(shape, device):
            return None
        for candidates in self.candidates(shape):
            runs = [c for c in candidates if self.runs(shape, c, device) and
                    self.occupancy(shape, c, device) * c.warps >= self.min_resident_warps]
            roomy = [c for c in runs if self.accumulator_words(shape, c) <= self.register_bounds(shape)[0]]
            if roomy or runs:
                return (roomy or runs)[0]
        return None

    def with_warps(self, br: int, bc: int, shape: Shape, device: DeviceLimits) -> Optional[BlockConfig]:
        """(Br, Bc) in this family with the first warp count that runs it (4, 8, 2, 1), each with the family's
        stages in order of preference, or None."""
        for warps in WARP_PREFERENCE:
            for stages in self.stages:
                config = BlockConfig(br, bc, warps, stages, self.variant)
                if self.runs(shape, config, device):
                    return config
        return None


class BackwardFamily(Family):
    """What the backward's families share: two kernels each (kind "dq": the block's own rows are Br queries and it
    sweeps key tiles of Bc; kind "dkdv": its own rows are Bc keys and it sweeps query tiles of Br), their template
    arguments <T, Br, Bc, D, E, Warps[, Stages]>."""

    def __init__(self, kind: str):
        assert kind in ("dq", "dkdv"), kind
        self.kind = kind
        self.keys_own = kind == "dkdv"
        self.tiles_along = "keys" if self.keys_own else "queries"
        self.own_name, self.swept_name = ("Bc", "Br") if self.keys_own else ("Br", "Bc")

    def own_and_swept(self, config: BlockConfig) -> Tuple[int, int]:
        """(the block's own rows, the swept tile's) of config."""
        return (config.Bc, config.Br) if self.keys_own else (config.Br, config.Bc)

    def template_args(self, shape: Shape, config: BlockConfig, split: bool) -> list:
        D, E = self.buckets(shape, config)
        args = [C_TYPES[shape.dtype.name], config.Br, config.Bc, D, E, config.warps]
        return args + ([config.stages] if config.stages != 1 else [])
