"""The tensor-core backward kernels (backward_mma.cuh, BlockConfig variant "mma") described for the planner:
bwd_mma_dq and bwd_mma_dkdv, the tensor-core twins of the CUDA-core backward (backward.py), planned apart. Their
gradients stay whole in accumulator fragments, so head dims are at most MAX_HEAD_DIM (the CUDA-core backward takes
larger ones). Each double-buffers the tiles it sweeps (dQ's K_j and V_j, dK dV's Q_i, dO_i and row terms) where
they fit: stages=2, else 1.

As the forward (forward_mma.py), they run float16 and bfloat16 (mma.m16n8k16), float32 on TF32 tensor cores
(precision "highest": three passes, 3xTF32, the swept tiles' low parts in a copy of their region; "tf32": one
pass) and float64 on DMMA (mma.m8n8k4) where the GPU has fast float64 tensor cores; precision "fma" keeps CUDA cores.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from ..family import BackwardFamily, BlockConfig, Shape, align16, dropout_bytes
from .forward_mma import (PASSES, ROWS_PER_TILE, SWEEP_BYTES, bucket, dtype_and_device_reasons, own_rows_reasons,
                          row_pads, swept_reasons, three_passes)

DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_HEAD_DIM = 128
MAX_SWEPT = 128  # a swept tile's hidden-pair bits fit one 32-bit word per quad lane
REGISTER_TARGET = {"dq": 144, "dkdv": 120}  # dK/dV's kernel keeps two gradients: it spills past 120
# The same for float32 and float64: float64's accumulators count two words each (accumulator_words), and 3xTF32
# splits only its own tiles in registers (the swept ones come split); ptxas compiles every choice at d, e <= 128 on
# sm_80 and sm_90 without spills (tests/test_cubin.py).
REGISTER_LIMIT = 160
STAGES = (2, 1)  # the swept tiles double-buffered where they fit, else one stage
OWN_FIRST = ((64, 4), (128, 8), (64, 8), (32, 2), (16, 1))  # (own rows, warps): one m16 tile per warp
SWEPT_SIZES = (64, 32, 16)


class TensorCoreBackward(BackwardFamily):
    variant = "mma"
    source, shared_struct = "backward_mma.cuh", "MmaBackwardShared"
    stages = STAGES
    register_limit = REGISTER_LIMIT
    register_advice = "use a smaller swept tile or more warps"

    def __init__(self, kind: str):
        super().__init__(kind)
        self.title = f"tensor-core backward {kind}"
        self.template = f"cuflash::bwd_mma_{kind}"
        self.register_target = REGISTER_TARGET[kind]

    def eligibility(self, shape: Shape, device) -> List[str]:
        reasons = dtype_and_device_reasons(shape, device, "tensor-core backward", DTYPES)
        if shape.dtype.name == "float64" and not device.fp64_tensor_cores and not reasons:
            reasons.append(f"float64 runs on tensor cores (DMMA) only where they are fast, on the A100, H100 and "
                           f"H200 class; {device.name} has none, so the CUDA-core backward (variant 'fma') runs "
                           f"float64")
        if max(shape.d, shape.e) > MAX_HEAD_DIM:
            reasons.append(f"head dims d={shape.d}, e={shape.e}: the tensor-core backward holds a block's "
                           f"gradients whole and takes d, e <= {MAX_HEAD_DIM}; the CUDA-core backward "
                           f"(variant 'fma') takes larger ones")
        elif not reasons:
            split = self.column_split(shape)  # one m16 tile per warp (a pair's), the narrowest swept tile
            smallest = BlockConfig(16, 16, split, 1, "mma")
            words, limit = self.accumulator_words(shape, smallest), self.register_bounds(shape)[1]
            if words > limit:
                grads = "dK and dV" if self.keys_own else "dQ"
                reasons.append(f"head dims d={shape.d}, e={shape.e} in {shape.dtype.name}: the tensor-core "
                               f"backward's {self.kind} kernel holds {grads} of 16 rows per {split} warps, {words} "
                               f"accumulator registers per thread with the smallest tiles, past the {limit} it "
                               f"holds without spilling; the CUDA-core backward (variant 'fma') runs them")
        return reasons

    def buckets(self, shape: Shape, config: BlockConfig) -> Tuple[int, int]:
        return bucket(shape.d), bucket(shape.e)

    def shared_memory_bytes(self, shape: Shape, config: BlockConfig) -> int:
        """Q_i, dO_i, K_j, V_j (rows padded by one 16-byte chunk, two for float64: mma::RowPadded), two row terms per
        query in the accumulator type (the swept tiles and those terms once per stage), each warp's scratch: 16 rows
        of the swept width + 1 accumulators and 16 x 4 words; for 3xTF32 a copy of the swept tiles' region for their
        low parts; the block's Sweep, and with dropout two keep tiles last (dropout_bytes). Mirrors
        MmaBackwardShared."""
        D, E = self.buckets(shape, config)
        swept = self.own_and_swept(config)[1]
        item = shape.dtype.itemsize
        acc = max(4, item)
        pad = row_pads(shape)[0]  # every tile padded as the forward pads Q and K
        q_stages, k_stages = (config.stages, 1) if self.keys_own else (1, config.stages)
        q_tiles = sum(align16(item * config.Br * (width + pad)) for width in (D, E)) * q_stages
        k_tiles = sum(align16(item * config.Bc * (width + pad)) for width in (D, E)) * k_stages
        low_parts = (k_tiles if not self.keys_own else q_tiles) if self.low_parts(shape) else 0
        scratch = align16(acc * config.warps * 16 * (swept + 1)) + align16(4 * config.warps * 16 * 4)
        return (q_tiles + k_tiles + q_stages * align16(acc * 2 * config.Br) + scratch + low_parts + SWEEP_BYTES +
                dropout_bytes(shape, config, 2))

    @staticmethod
    def low_parts(shape: Shape) -> bool:
        """Whether the swept tiles' low parts sit beside them (float32 in three TF32 passes)."""
        return three_passes(shape)

    def column_split(self, shape: Shape) -> int:
        """Warps per 16 own rows, each holding its share of the gradients' columns (mma_backward::kColumnSplit): 2
        for float64's dK dV at D + E > 128, each warp of a pair taking S and dP of the same keys; else 1."""
        D, E = bucket(shape.d), bucket(shape.e)
        return 2 if self.keys_own and shape.dtype.name == "float64" and D + E > 128 else 1

    def accumulator_words(self, shape: Shape, config: BlockConfig) -> int:
        """Per thread: S (then P) and dP (then dS) over its m16 tiles x the swept width, and its share of the
        gradients; float64's take two registers each."""
        own, swept = self.own_and_swept(config)
        split = self.column_split(shape)
        mt = max(1, own * split // (ROWS_PER_TILE * config.warps))
        D, E = self.buckets(shape, config)
        grads = (D + (E if self.keys_own else 0)) // split
        return mt * (swept + grads // 2) * max(1, shape.dtype.itemsize // 4)

    def registers_estimate(self, shape: Shape, config: BlockConfig) -> int:
        return min(255, (64 + self.accumulator_words(shape, config) + 7) // 8 * 8)

    def config_reasons(self, shape: Shape, config: BlockConfig) -> List[str]:
        own, swept = self.own_and_swept(config)
        kernel = f"tensor-core backward's {self.kind} kernel"
        reasons = []
        if config.head_tile is not None:
            reasons.append(f"head_tile={config.head_tile} is a setting of the CUDA-core forward; the tensor-core "
                           f"backward takes head dims up to {MAX_HEAD_DIM} whole")
        split = self.column_split(shape)
        if config.warps % split:
            return reasons + [f"warps={config.warps} is not supported by the {kernel} in {shape.dtype.name} at d="
                              f"{shape.d}, e={shape.e}: {split} warps share each 16 keys"]
        if split > 1:  # the pairs of warps take the m16 tiles
            config, kernel = dataclasses.replace(config, warps=config.warps // split), f"{kernel} (pairs of warps)"
        return reasons + own_rows_reasons(self.own_name, own, config, kernel) + \
            swept_reasons(self.swept_name, swept, kernel, MAX_SWEPT)

    def template_args(self, shape: Shape, config: BlockConfig, split: bool) -> list:
        """bwd_mma_<kind><T, Br, Bc, D, E, Warps[, Stages[, Passes]]>: float32 always names its stages and TF32
        passes."""
        args = super().template_args(shape, config, split)
        if shape.dtype.name == "float32":
            return args + ([config.stages] if config.stages == 1 else []) + [PASSES[shape.precision]]
        return args

    def candidates(self, shape: Shape):
        """The 16-bit types: each swept size with every block of own rows, largest swept tiles first. float32 and
        float64, whose tiles take two or four times the shared memory: the blocks of 4 warps or more with each swept
        size first, the smaller ones after (a block of one warp whose shared memory fills the SM leaves the tensor
        cores waiting on every load)."""
        # float64's dK dV at D + E > 128: half the own rows, in pairs of warps, and swept tiles of 16 (ptxas spills
        # 32 at d = 128, e = 64, whose words the register bounds would take)
        split = self.column_split(shape)
        sizes = SWEPT_SIZES[-1:] if split > 1 else SWEPT_SIZES
        pairs = [(swept, own // split, warps) for swept in sizes for own, warps in OWN_FIRST if warps % split == 0]
        if shape.dtype.itemsize > 2:
            pairs.sort(key=lambda pair: pair[2] < 4)  # stable: the order within each group kept
        configs = []
        for swept, own, warps in pairs:
            br, bc = (swept, own) if self.keys_own else (own, swept)
            configs += [BlockConfig(br, bc, warps, stages, "mma") for stages in STAGES]
        return [configs]

    def limits(self) -> Dict[str, int]:
        return {"cuflash::mma_backward::kMaxSwept": MAX_SWEPT, "cuflash::mma_backward::kMaxHeadDim": MAX_HEAD_DIM,
                "(int)cuflash::align16(sizeof(cuflash::Sweep))": SWEEP_BYTES}


DQ = TensorCoreBackward("dq")
DKDV = TensorCoreBackward("dkdv")
