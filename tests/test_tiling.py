"""Block configurations against the known GPUs: the shared-memory model, occupancy, the reasons and the heuristic."""

import ml_dtypes
import numpy as np
import pytest

from cuflash import BlockConfig, DeviceLimits, tiling
from cuflash.kernels import forward as fma_forward
from cuflash.family import Shape
from cuflash.tiling import choose, not_supported_reasons, shared_memory_bytes

F16, BF16, F32, F64 = (np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))
GPUS = ("T4", "A10", "RTX 3090", "A100", "L4", "RTX 4090", "H100", "H200")


def test_known_gpu_limits():
    assert DeviceLimits.known("A100").smem_per_block == 166912
    assert DeviceLimits.known("H100").smem_per_block == DeviceLimits.known("H200").smem_per_block == 232448
    assert DeviceLimits.known("T4").smem_per_block == 65536
    assert DeviceLimits.known("L4").smem_per_block == DeviceLimits.known("A10").smem_per_block == 101376
    assert DeviceLimits.known("nvidia h200").arch == "sm_90"
    with pytest.raises(ValueError, match="unknown GPU"):
        DeviceLimits.known("Voodoo 2")


def test_shared_memory_model_by_hand():
    # half, d=e=64, (64, 64): Q and K rows of 64 + 8 halves (16 bytes), V rows of 64, P of 64 rows of 64 floats
    # padded by 16 (a pitch of 320 bytes: 64 past a multiple of 128).
    w = Shape(F16, 64, 64)
    assert shared_memory_bytes(w, BlockConfig(64, 64)) == 64 * 72 * 2 + 64 * 72 * 2 + 64 * 64 * 2 + 64 * 80 * 4
    # float, d=59 (bucket 64), e=3 (bucket 16), (8, 16): Q, K rows padded by four floats; P's 16 floats are 64 bytes
    # already (no pad); every region 16-byte aligned.
    w = Shape(F32, 59, 3)
    assert shared_memory_bytes(w, BlockConfig(8, 16)) == 8 * 68 * 4 + 16 * 68 * 4 + 16 * 16 * 4 + 8 * 16 * 4
    # double, d=e=16, (4, 16): Q, K rows padded by two doubles; P's 16 doubles (128 bytes) padded by 8.
    w = Shape(F64, 16, 16)
    assert shared_memory_bytes(w, BlockConfig(4, 16, 2)) == 4 * 18 * 8 + 16 * 18 * 8 + 16 * 16 * 8 + 4 * 24 * 8


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
@pytest.mark.parametrize("d", [1, 3, 59, 64, 111, 128, 256, 512, 2000])
def test_heuristic_choice_runs(gpu, dtype, d):
    """Every dtype and head dim runs on every known GPU: on a small shared memory, with a narrower head tile."""
    device = DeviceLimits.known(gpu)
    w = Shape(dtype, d, d)
    config = choose(w, device)
    if config.head_tile is not None:  # only where whole head dims fit no candidate
        assert all(not_supported_reasons(w, c, device) for c in fma_forward.CANDIDATES)
    assert not_supported_reasons(w, config, device) == []
    assert shared_memory_bytes(w, config) <= device.smem_per_block
    assert tiling.occupancy(w, config, device) >= 1
    if getattr(config, "variant", "fma") == "fma":  # the CUDA-core kernel's register bound
        assert tiling.accumulator_words(w, config) <= fma_forward.ACC_REGISTER_LIMIT


def test_heuristic_choices_on_known_gpus():
    """CUDA-core choices (float32/float64 with precision="fma", float64 past the tensor cores' head dims; float16
    on a T4, which has no sm_80 tensor-core path)."""
    h100, a100, t4 = (DeviceLimits.known(g) for g in ("H100", "A100", "T4"))
    assert choose(Shape(F32, 64, 64, precision="fma"), h100) == BlockConfig(64, 64, 4, stages=2)
    assert choose(Shape(F32, 128, 128, precision="fma"), a100) == BlockConfig(64, 64, 8)
    assert choose(Shape(F32, 128, 128), t4) == BlockConfig(32, 32, 4)  # (32, 64) needs 88.5 KiB
    assert choose(Shape(F16, 128, 128), t4) == BlockConfig(32, 64, 4)  # (64, 64, warps=8) needs 64.8 KiB
    assert choose(Shape(F64, 512, 512), h100) == BlockConfig(16, 16, 8)
    assert choose(Shape(F64, 512, 512), a100) == BlockConfig(8, 16, 4)


def test_block_for_h100_refused_on_a100_with_the_right_sentence():
    w = Shape(F32, 256, 256, precision="fma")
    config = BlockConfig(64, 64, warps=8)
    assert not_supported_reasons(w, config, DeviceLimits.known("H100")) == []
    (reason,) = not_supported_reasons(w, config, DeviceLimits.known("A100"))
    assert reason == ("block (64, 64, warps=8) for d=256 float32, precision='fma' needs 214 KiB of shared memory; "
                      "A100 allows 163 KiB per block; (32, 32, warps=8) fits")


def test_reasons_name_every_problem():
    device = DeviceLimits.known("T4")
    reasons = not_supported_reasons(Shape(F16, 64, 64), BlockConfig(7, 5, warps=1, stages=3), device)
    assert len(reasons) == 3
    assert "Br=7 is not supported with 1 warps: Br must be a multiple of 2" in reasons[0]
    assert "Bc=5 is not supported" in reasons[1]
    assert reasons[2] == ("stages=3 is not supported: the CUDA-core kernel pipelines K/V in 1 or 2 stages; "
                          "(64, 64) fits")
    (reason,) = not_supported_reasons(Shape(F32, 16, 256), BlockConfig(128, 16, warps=2), DeviceLimits.known("H100"))
    assert "keeps 544 accumulator registers per thread" in reason
    # d past the largest float16 bucket is swept in slices of 256: the tiles are sized for 256 (+ padding)
    (reason,) = not_supported_reasons(Shape(F16, 300, 64), BlockConfig(64, 64), device)
    assert reason.startswith("block (64, 64) for d=300, e=64 float16 needs 94 KiB of shared memory")
    assert not_supported_reasons(Shape(F16, 300, 64), BlockConfig(64, 64), DeviceLimits.known("A100")) == []


def test_two_stages_where_cp_async_and_shared_memory_allow():
    """The CUDA-core kernel double-buffers K and V (stages=2) where the GPU has cp.async (8.0+), the doubled
    tiles fit and d is within the head tile; otherwise one stage, the tiles unchanged."""
    h100, a100, t4 = (DeviceLimits.known(g) for g in ("H100", "A100", "T4"))
    assert choose(Shape(F32, 128, 128, precision="fma"), h100) == BlockConfig(64, 64, 8, stages=2)
    assert choose(Shape(F32, 128, 128, precision="fma"), a100) == BlockConfig(64, 64, 8)  # 2 stages: 184 KiB
    assert choose(Shape(F16, 64, 64), t4) == BlockConfig(64, 64, 4)
    (reason,) = not_supported_reasons(Shape(F16, 64, 64), BlockConfig(64, 64, 4, stages=2), t4)
    assert reason == ("stages=2 pipelines tile loads with cp.async, which needs compute capability 8.0 or newer; "
                      "Tesla T4 has sm_75: use stages=1; (64, 64) fits")
    (reason,) = not_supported_reasons(Shape(F16, 300, 64), BlockConfig(32, 32, 4, stages=2), a100)
    assert reason == ("stages=2 double-buffers whole K tiles: d=300 is swept in slices of the 256-wide head tile, "
                      "which take stages=1; (64, 64) fits")
    assert tiling.shared_memory_bytes(Shape(F32, 64, 64), BlockConfig(64, 64, 4, stages=2)) == \
        tiling.shared_memory_bytes(Shape(F32, 64, 64), BlockConfig(64, 64, 4)) + 64 * (68 + 64) * 4


def test_head_tiles():
    t4 = DeviceLimits.known("T4")
    w = Shape(F64, 256, 256)  # 64 KiB of shared memory: no whole-d tile of float64 fits
    config = choose(w, t4)
    assert config.head_tile == 128 and str(config) == "(16, 16, warps=8, head_tile=128)"
    assert fma_forward.FORWARD.buckets(w, config) == (128, 128)
    assert fma_forward.FORWARD.buckets(Shape(F64, 100, 20), config) == (128, 32)  # narrower dims keep their own bucket
    (reason,) = not_supported_reasons(w, BlockConfig(16, 16, 8), t4)
    assert reason.endswith("allows 64 KiB per block; (16, 16, warps=8, head_tile=128) fits")
    (reason,) = not_supported_reasons(w, BlockConfig(16, 16, 8, head_tile=48), t4)
    assert reason.startswith("head_tile=48 is not supported for float64: use one of 16, 32, 64, 128, 256, 512")
    (reason,) = not_supported_reasons(Shape(F16, 64, 64), BlockConfig(16, 16, 8, head_tile=512), t4)
    assert "use one of 16, 32, 64, 128, 256, or None" in reason
    (reason,) = not_supported_reasons(Shape(F16, 64, 64), BlockConfig(64, 64, 4, 2, "mma", head_tile=64),
                                      DeviceLimits.known("A100"))
    assert reason.startswith("head_tile=64 is a setting of the CUDA-core kernel")


def test_key_splits_and_the_decoding_choice():
    h100 = DeviceLimits.known("H100")  # 132 SMs

    def problem(n, m, batch_size, dtype=F16, d=128):
        return Shape(dtype=dtype, d=d, e=d, n=n, m=m, batch_size=batch_size)

    one_query = problem(1, 32768, 16)
    config = choose(one_query, h100)
    assert config == BlockConfig(8, 32, 4, stages=2)  # the CUDA-core kernel, 8-row tiles, not the tensor cores
    assert tiling.key_splits(one_query, config, h100) == 8  # 16 blocks -> 128: one wave on 132 SMs
    assert tiling.key_splits(problem(1, 1500, 16), config, h100) == 2  # each split at least 512 keys
    assert tiling.key_splits(problem(1, 1000, 16), config, h100) == 1
    assert choose(problem(12, 32768, 4), h100).Br == 16
    # Enough blocks already, more than 16 queries, or too few keys: the usual choice, no split.
    assert choose(problem(1, 32768, 132), h100).variant == "mma"
    assert choose(problem(17, 32768, 4), h100).variant == "mma"
    assert choose(problem(1, 1000, 4), h100).variant == "mma"
    assert tiling.key_splits(problem(64, 32768, 4), BlockConfig.mma(64, 64), h100) == 33  # tensor cores too
    assert tiling.key_splits(problem(1024, 32768, 8), BlockConfig.mma(128, 64), h100) == 2  # 64 blocks
    assert tiling.key_splits(problem(1024, 32768, 9), BlockConfig.mma(128, 64), h100) == 1  # 72: over half
    assert choose(Shape(F16, 128, 128), h100).variant == "mma"  # no n, m or batch: no decoding choice


def test_resolve_tuple_and_config():
    device = DeviceLimits.known("A100")
    w = Shape(F32, 64, 64, precision="fma")
    assert tiling.resolve(None, w, device) == choose(w, device)
    assert tiling.resolve((32, 32), w, device) == BlockConfig(32, 32, 4, stages=2)  # two stages where they run
    assert tiling.resolve((128, 64), w, device) == BlockConfig(128, 64, 8, 2)  # 4 warps would hold 128 registers
    assert tiling.resolve((4, 16), w, device) == BlockConfig(4, 16, 2, 2)  # Br=4 needs fewer row groups
    assert tiling.resolve((32, 32), w, DeviceLimits.known("T4")) == BlockConfig(32, 32, 4)
    for bad in ((0, 16), (16,), "64x64", (16.0, 16)):
        with pytest.raises(ValueError):
            tiling.resolve(bad, w, device)
    with pytest.raises(ValueError, match=r"block \(256, 256, warps=8\) cannot run here"):
        tiling.resolve(BlockConfig(256, 256, warps=8), w, device)


def test_occupancy():
    a100 = DeviceLimits.known("A100")
    w = Shape(F16, 64, 64)
    config = BlockConfig(64, 64)  # 40.75 KiB + 1 KiB reserved: 4 per 164 KiB SM
    registers = fma_forward.FORWARD.registers_estimate(w, config)
    assert tiling.occupancy(w, config, a100) == min(4, 65536 // (registers * 128))


def test_plans_are_kept_per_shape_device_block_and_kind():
    """A loop of calls with the same shapes plans once: the same Plan comes back, for any spelling of a block."""
    h100 = DeviceLimits.known("H100")
    shape = Shape(np.float16, 64, 64, 512, 512, 8)
    first = tiling.plan(shape, h100)
    assert tiling.plan(shape, h100) is first
    assert tiling.plan(Shape(np.float16, 64, 64, 512, 512, 8), h100) is first  # equal, not the same object
    assert tiling.plan(shape, h100, [64, 64]) is tiling.plan(shape, h100, (np.int64(64), 64))
    assert tiling.plan(shape, h100, kind="dq").family.kind == "dq"
    assert tiling.plan(shape, DeviceLimits.known("A100")).shape == shape
    assert tiling.backward_plans(shape, h100) is tiling.backward_plans(shape, h100)
    with pytest.raises(ValueError, match="block must be a pair"):
        tiling.plan(shape, h100, [64])
