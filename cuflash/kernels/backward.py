"""The CUDA-core backward kernels (backward.cuh, BlockConfig variant "fma") described for the planner: bwd_dq (one
block per Br queries) and bwd_dkdv (one per Bc keys), two families planned apart. Each holds its gradients whole
in registers, so d and e are at most MAX_BUCKET; wider heads take the blocked backward on the array library's
matmul (cuflash/blocked.py).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ..dtypes import acc_dtype_of
from ..family import LANES_PER_ROW, BackwardFamily, BlockConfig, Shape, align16, dropout_bytes
from .forward import (ACC_REGISTER_LIMIT, ACC_REGISTER_TARGET, STAGES, bucket, columns_reasons, cuda_core_limits,
                      eligibility, p_pitch_bytes, row_pitch_bytes, rows_per_thread_reasons)

MAX_BUCKET = 256
# (64, 32) before (32, 64): where 64 x 64 does not fit (float32 at d = 128 on an A100), 64 own rows keep 4 per
# thread and the swept tile's 16-byte loads feed more FMAs (estimates: 1.45 instructions per FMA against 1.56).
CANDIDATES = tuple(BlockConfig(br, bc, w, stages) for br, bc, w in (
    (64, 64, 8), (64, 64, 4), (64, 32, 8), (32, 64, 8), (32, 32, 4), (32, 32, 8), (16, 32, 8), (32, 16, 8),
    (16, 16, 8), (16, 16, 4), (16, 16, 2)) for stages in STAGES)


class CudaCoreBackward(BackwardFamily):
    variant = "fma"
    source, shared_struct = "backward.cuh", "BackwardShared"
    stages = STAGES
    register_target, register_limit = ACC_REGISTER_TARGET, ACC_REGISTER_LIMIT
    register_advice = "use smaller tiles or more warps"

    def __init__(self, kind: str):
        super().__init__(kind)
        self.title = f"CUDA-core backward {kind}"
        self.template = f"cuflash::bwd_{kind}"

    def eligibility(self, shape: Shape, device) -> List[str]:
        reasons = eligibility(shape, device)
        if not reasons and max(shape.d, shape.e) > MAX_BUCKET:
            reasons.append(f"head dims d={shape.d}, e={shape.e}: the backward kernels hold a block's gradients whole "
                           f"and take d, e <= {MAX_BUCKET}")
        return reasons

    def buckets(self, shape: Shape, config: BlockConfig) -> Tuple[int, int]:
        return bucket(min(shape.d, MAX_BUCKET)), bucket(min(shape.e, MAX_BUCKET))

    def shared_memory_bytes(self, shape: Shape, config: BlockConfig) -> int:
        """Q and dO of the query tile, K and V of the key tile (rows padded, as the forward's Q and K), P and dS over
        (own rows) x (swept columns, a P-like pitch) and two row terms per query in the accumulator type (the swept
        tiles, and for dK dV the row terms, once per stage); each region 16-byte aligned; with dropout, one keep tile
        (dropout_bytes). Mirrors BackwardShared."""
        item, acc = shape.dtype.itemsize, acc_dtype_of(shape.dtype).itemsize
        D, E = self.buckets(shape, config)
        own, swept = self.own_and_swept(config)
        q_stages, k_stages = (config.stages, 1) if self.keys_own else (1, config.stages)
        tiles = sum(stages * align16(rows * row_pitch_bytes(item, width))
                    for stages, rows in ((q_stages, config.Br), (k_stages, config.Bc)) for width in (D, E))
        p = align16(own * p_pitch_bytes(acc, swept))
        return tiles + 2 * p + q_stages * align16(acc * 2 * config.Br) + dropout_bytes(shape, config, 1)

    def accumulator_words(self, shape: Shape, config: BlockConfig) -> int:
        """Per thread: S and dP over its rows x swept columns, and the block's gradients (dQ; or dK and dV)."""
        own, swept = self.own_and_swept(config)
        D, E = self.buckets(shape, config)
        grads = D + E if self.keys_own else D
        rows = own // max(1, config.row_groups)
        return rows * (2 * swept // LANES_PER_ROW + grads // LANES_PER_ROW) * (acc_dtype_of(shape.dtype).itemsize // 4)

    def registers_estimate(self, shape: Shape, config: BlockConfig) -> int:
        return min(255, (48 + 2 * self.accumulator_words(shape, config) + 7) // 8 * 8)

    def config_reasons(self, shape: Shape, config: BlockConfig) -> List[str]:
        own, swept = self.own_and_swept(config)
        what = f" by the backward's {self.kind} kernel"
        reasons = rows_per_thread_reasons(self.own_name, own, config, what) + \
            columns_reasons(self.swept_name, swept, what)
        if config.head_tile is not None:
            reasons.append(f"head_tile={config.head_tile} is not supported by the backward kernels: they take "
                           f"whole head dims up to {MAX_BUCKET}; use None")
        return reasons

    def candidates(self, shape: Shape):
        return [CANDIDATES]

    def limits(self) -> Dict[str, int]:
        return cuda_core_limits()


DQ = CudaCoreBackward("dq")
DKDV = CudaCoreBackward("dkdv")
