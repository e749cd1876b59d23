"""The planner: one heuristic walks the kernel families of a kind (the forward: the tensor-core kernel's, then the
CUDA-core kernel's; each half of the backward, "dq" and "dkdv", the same way) and returns a Plan, everything a
launch needs (kernel, tiles, name expression, block, shared memory, key splits, column blocks), for a problem's
Shape on a device, present or not. Plans are kept per (shape, device, block, kind): a loop of calls plans once.
The launch code executes a plan and never plans.

Everything here is plain Python. Each family is described beside its kernel (cuflash/kernels/*.py); its
shared-memory model mirrors the kernel's struct byte for byte (tests/test_compile.py and tests/test_cubin.py hold
them together through the compiler).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from .devices import KNOWN, DeviceLimits, fmt_bytes
from .family import BlockConfig, Family, Shape
from . import kernels
from .kernels import backward, backward_mma, forward, forward_mma

__all__ = ["BACKWARD_KINDS", "FAMILIES", "FAMILIES_OF", "KNOWN", "BlockConfig", "DeviceLimits", "Family", "Plan",
           "Shape", "accumulator_words", "backward_plans", "block_pair", "choose", "family_of", "key_splits",
           "not_supported_reasons", "occupancy", "plan", "plan_of", "resolve", "shared_memory_bytes", "split_keys"]

FAMILIES = (forward_mma.FORWARD, forward.FORWARD)  # preference order: the first whose candidates run is chosen
# Every kind's families, in preference order. The backward is two kernels, each planned as a kind of its own.
FAMILIES_OF = {"forward": FAMILIES, "dq": (backward_mma.DQ, backward.DQ), "dkdv": (backward_mma.DKDV, backward.DKDV)}
BACKWARD_KINDS = ("dkdv", "dq")
DECODE_ROWS = 16  # queries per batch item up to which a few short query tiles and split keys serve (decoding)
SPLIT_MIN_KEYS = 512  # keys a split sweeps at least: fewer, and merging the splits costs more than it gains


VARIANTS_OF = {kind: {family.variant: family for family in families} for kind, families in FAMILIES_OF.items()}


def unknown_variant(variant: str, kind: str = "forward") -> str:
    kinds = " or ".join(f"{f.variant!r} ({f.title} kernel)" for f in FAMILIES_OF[kind])
    return f"variant {variant!r} is not a kernel: {kinds}"


def family_of(config: BlockConfig, kind: str = "forward") -> Family:
    if config.variant not in VARIANTS_OF[kind]:
        raise ValueError(f"attention: {unknown_variant(config.variant, kind)}")
    return VARIANTS_OF[kind][config.variant]


def not_supported_reasons(shape: Shape, config: BlockConfig, device: DeviceLimits, *,
                          suggest: bool = True, kind: str = "forward") -> List[str]:
    """Every reason `config` cannot run `shape` on `device`, as sentences (empty: supported).

    Each sentence says what was asked, what the limit is and what would work.

    Parameters
    ----------
    shape : Shape
        What the plan depends on.
    config : BlockConfig
        The configuration asked for.
    device : DeviceLimits
        The GPU, present (`DeviceLimits.of`) or not (`DeviceLimits.known`).
    suggest : bool, optional
        Whether a sentence names a configuration that fits.
    kind : {"forward", "dq", "dkdv"}, optional
        The forward, or one half of the backward.

    Returns
    -------
    list of str

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import tiling
    >>> h100 = cuflash.DeviceLimits.known("H100")
    >>> tiling.not_supported_reasons(tiling.Shape(np.float16, 64, 64), cuflash.BlockConfig.mma(128, 128), h100)
    []
    >>> reasons = tiling.not_supported_reasons(tiling.Shape(np.float16, 64, 64), cuflash.BlockConfig(128, 128, warps=3),
    ...                                        h100)
    >>> print(*reasons)
    warps=3 is not supported: the CUDA-core kernel runs 1, 2, 4 or 8 warps per block; (64, 64, stages=2) fits
    """
    if config.variant not in VARIANTS_OF[kind]:
        return [unknown_variant(config.variant, kind)]
    return VARIANTS_OF[kind][config.variant].not_supported_reasons(shape, config, device, suggest=suggest)


def shared_memory_bytes(shape: Shape, config: BlockConfig) -> int:
    return family_of(config).shared_memory_bytes(shape, config)


def accumulator_words(shape: Shape, config: BlockConfig) -> int:
    return family_of(config).accumulator_words(shape, config)


def occupancy(shape: Shape, config: BlockConfig, device: DeviceLimits) -> int:
    return family_of(config).occupancy(shape, config, device)


# ----------------------------------------------------------------------------------------------------------------
# The heuristic


def key_splits(shape: Shape, config: BlockConfig, device: DeviceLimits) -> int:
    """How many splits of the key axis either kernel sweeps in parallel (flash-decoding; 1: none): when the
    batch's query tiles leave at least half the GPU's SMs without a block, as many splits as one wave of blocks
    holds, each at least SPLIT_MIN_KEYS keys; or as many as shape.splits forces. 1 when n or m is unknown, or for
    packed sequences (their splits' partial results would need packed scratch)."""
    if shape.n is None or shape.m is None or shape.packed:
        return 1
    if shape.splits is not None:
        return shape.splits
    blocks = -(-shape.n // config.Br) * shape.batch_size
    if blocks == 0 or 2 * blocks > device.sm_count:
        return 1
    return max(1, min(device.sm_count // blocks, shape.m // SPLIT_MIN_KEYS))


def _decode_fit(shape: Shape, device: DeviceLimits) -> Optional[BlockConfig]:
    """For a few queries per batch item over many keys (decoding) on too few blocks to fill the GPU: the
    CUDA-core kernel with 8- or 16-row query tiles and split keys, whatever the dtype. Such a problem is bound by
    reading K and V, which split keys spread over every SM; the tensor-core kernel's tiles of 64 to 128 rows would
    mostly compute rows that do not exist."""
    family = forward.FORWARD
    if shape.n is None or not 1 <= shape.n <= DECODE_ROWS or family.eligibility(shape, device):
        return None
    rows = 8 if shape.n <= 8 else 16
    for config in forward.CANDIDATES:
        if config.Br == rows and family.runs(shape, config, device) and \
                family.accumulator_words(shape, config) <= family.register_target:
            return config if key_splits(shape, config, device) > 1 else None
    return None


def choose(shape: Shape, device: DeviceLimits, kind: str = "forward") -> BlockConfig:
    """The heuristic's configuration for shape on `device`: the first family of the kind (tensor cores, then CUDA
    cores) with a candidate that runs; ValueError when none fits. With n, m and the batch known, decoding-shaped
    forward problems take the CUDA-core kernel with split keys."""
    config = first_choice(shape, device, kind)
    if config is None:
        reasons = FAMILIES_OF[kind][-1].eligibility(shape, device)
        raise ValueError("attention: " + ("; ".join(reasons) if reasons else
                         f"no block configuration fits {shape} on {device.name}: it allows "
                         f"{fmt_bytes(device.smem_per_block)} of shared memory per block"))
    return config


def first_choice(shape: Shape, device: DeviceLimits, kind: str) -> Optional[BlockConfig]:
    """choose()'s configuration, or None where no family of the kind has one."""
    config = _decode_fit(shape, device) if kind == "forward" else None
    for family in FAMILIES_OF[kind]:
        config = config or family.first_fit(shape, device)
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


def resolve(block, shape: Shape, device: DeviceLimits, kind: str = "forward") -> BlockConfig:
    """The configuration to run: the heuristic's for block=None; the heuristic's within one family for block=its
    variant ("mma", "fma"); else `block` ((Br, Bc), in the first family that runs them, or a BlockConfig)
    validated. ValueError listing every reason when it cannot run."""
    if block is None:
        return choose(shape, device, kind)
    variants = VARIANTS_OF[kind]
    if isinstance(block, str) and block in variants:
        family = variants[block]
        config = family.first_fit(shape, device)
        if config is None:
            probe = BlockConfig(64, 64, 4, min(family.stages), family.variant)
            reasons = family.not_supported_reasons(shape, probe, device) or [
                f"no {family.title} configuration fits {shape}"]
            raise ValueError(f"attention: block {block!r} cannot run here: " + "; ".join(reasons))
        return config
    if isinstance(block, BlockConfig):
        config = block
    else:
        br, bc = block_pair(block)
        fits = (family.with_warps(br, bc, shape, device) for family in FAMILIES_OF[kind])
        # None runs them: the last family's (CUDA cores) with 4 warps, whose reasons are shown.
        config = next((c for c in fits if c is not None), BlockConfig(br, bc, 4))
    reasons = not_supported_reasons(shape, config, device, kind=kind)
    if reasons:
        raise ValueError(f"attention: block {config} cannot run here: " + "; ".join(reasons))
    return config


# ----------------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Plan:
    """Everything a launch needs, decided once by `plan`; the launch code executes it and never plans.

    Attributes
    ----------
    shape : Shape
        What it was planned for (the launch checks its problem against it).
    config : BlockConfig
        The kernel's tiles.
    family : Family
        The kernel's description.
    name : str
        The name expression of the instantiation (the split one when splits > 1), compiled from kernels/`source`.
    block : tuple of int
        Threads per block.
    shared_mem : int
        Bytes of shared memory per block.
    tiles : int
        Blocks along the grid's x axis per key split, one per query tile or, for a family tiled along the keys, per
        key tile (0: n or m unknown).
    splits, split_keys : int
        Key splits (1: none), each of split_keys keys.
    column_blocks : tuple of (int, int)
        The [e0, e1) output columns of each launch.
    mods
        The CUDA of the call's mods (kernels/mods.KernelMods, compiled into the kernel: with_mods), or None.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import tiling
    >>> p = tiling.plan(tiling.Shape(np.float16, 64, 64, n=16, m=65536), cuflash.DeviceLimits.known("H100"))
    >>> print(p.config, p.splits > 1)              # decoding: few queries over many keys split the keys
    (16, 64, warps=8, stages=2) True
    """

    shape: Shape
    config: BlockConfig
    family: Family
    name: str
    source: str
    block: Tuple[int, int, int]
    shared_mem: int
    tiles: int
    splits: int
    split_keys: int
    column_blocks: Tuple[Tuple[int, int], ...]
    mods: Any = None

    @property
    def grid_x(self) -> int:
        return self.tiles * self.splits

    @property
    def kernel(self) -> Tuple[str, str]:
        """What the plan's compiled kernel is known by: its name expression, and its mods' key (after "paged;" for
        a kernel that walks pages, "dropout;" for one that drops)."""
        flags = ("paged;" if self.shape.paged else "") + ("dropout;" if self.shape.dropout else "")
        return self.name, flags + ("" if self.mods is None else self.mods.key)

    @property
    def code(self) -> str:
        """The kernel's source string (kernels.source: its file, its mods' CUDA, whether it walks pages and
        whether it drops)."""
        return kernels.source(self.source, "" if self.mods is None else self.mods.source, self.shape.paged,
                              self.shape.dropout)

    def with_mods(self, mods) -> "Plan":
        """The same plan for a kernel compiled with these mods (None: without)."""
        return self if mods is None else dataclasses.replace(self, mods=mods)


def split_keys(m: int, splits: int, Bc: int) -> Tuple[int, int]:
    """(keys per split, number of splits): about `splits` splits of m keys, each a whole number of key tiles."""
    per_split = -(-m // splits)
    keys = -(-per_split // Bc) * Bc
    return keys, -(-m // keys)


def plan(shape: Shape, device: DeviceLimits, block=None, kind: str = "forward") -> Plan:
    """The plan for shape on device: the configuration the heuristic (or ``block``) gives, and all that follows.

    Kept per arguments: a loop of calls plans once.

    Parameters
    ----------
    shape : Shape
        What the plan depends on.
    device : DeviceLimits
        The GPU, present or not.
    block : tuple of (int, int), str or BlockConfig, optional
        As `cuflash.attention`'s ``block=``; None: the heuristic's choice.
    kind : {"forward", "dq", "dkdv"}, optional
        The forward, or one half of the backward (`backward_plans` plans both).

    Returns
    -------
    Plan

    Raises
    ------
    ValueError
        A forced block that cannot run, with every reason.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import tiling
    >>> p = tiling.plan(tiling.Shape(np.float32, 128, 128), cuflash.DeviceLimits.known("A100"))
    >>> print(p.config, p.shared_mem // 1024, "KiB")  # float32 on tensor cores as 3xTF32
    (64, 16, warps=4, stages=2, mma) 137 KiB
    >>> fma = tiling.Shape(np.float32, 128, 128, precision="fma")
    >>> print(tiling.plan(fma, cuflash.DeviceLimits.known("A100")).config)     # CUDA cores
    (64, 64, warps=8)
    """
    if block is not None and not isinstance(block, (str, BlockConfig)):
        block = block_pair(block)  # (Br, Bc) as ints: a key, whatever sequence held them
    return _plan(shape, device, block, kind)


@functools.lru_cache(maxsize=1024)
def _plan(shape: Shape, device: DeviceLimits, block, kind: str) -> Plan:
    return plan_of(resolve(block, shape, device, kind), shape, device, kind)


def plan_of(config: BlockConfig, shape: Shape, device: DeviceLimits, kind: str) -> Plan:
    """The plan that runs config (resolved: it runs shape on device) for shape."""
    family = family_of(config, kind)
    keys, count = 0, 1
    if shape.m and kind == "forward":
        keys, count = split_keys(shape.m, key_splits(shape, config, device), config.Bc)
        keys = keys if count > 1 else 0
    return Plan(
        shape=shape, config=config, family=family, name=family.name_expression(shape, config, split=count > 1),
        source=family.source, block=(config.threads, 1, 1), shared_mem=family.shared_memory_bytes(shape, config),
        tiles=family.tiles(shape, config), splits=count, split_keys=keys,
        column_blocks=family.column_blocks(shape, config))


@functools.lru_cache(maxsize=1024)
def _backward_plans(shape: Shape, device: DeviceLimits) -> Optional[Tuple[Plan, ...]]:
    plans = []
    for kind in BACKWARD_KINDS:
        config = first_choice(shape, device, kind)
        if config is None:
            return None
        plans.append(plan_of(config, shape, device, kind))
    return tuple(plans)


def backward_plans(shape: Shape, device: DeviceLimits, block=None) -> Optional[Tuple[Plan, ...]]:
    """The backward kernels' plans (dK and dV, then dQ), each kind planned by the heuristic.

    Parameters
    ----------
    shape : Shape
        What the plans depend on.
    device : DeviceLimits
        The GPU, present or not.
    block : tuple of (int, int), str or BlockConfig, optional
        Forced, validated for both kinds.

    Returns
    -------
    tuple of Plan or None
        None when block is None and no backward kernel serves the shape here (head dims past the kernels', or too
        little shared memory): the blocked backward serves it.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> from cuflash import tiling
    >>> h100 = cuflash.DeviceLimits.known("H100")
    >>> for p in tiling.backward_plans(tiling.Shape(np.float16, 64, 64), h100):
    ...     print(p.name)
    cuflash::bwd_mma_dkdv<__half, 32, 64, 64, 64, 4, 2>
    cuflash::bwd_mma_dq<__half, 64, 64, 64, 64, 4, 2>
    >>> print(tiling.backward_plans(tiling.Shape(np.float16, 512, 512), h100))     # past the kernels' head dims
    None
    """
    if block is None:
        return _backward_plans(shape, device)
    return tuple(plan(shape, device, block, kind) for kind in BACKWARD_KINDS)
