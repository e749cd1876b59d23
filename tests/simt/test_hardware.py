"""On a real GPU: the PTX-wrapper kernels run through CuPy must give the same per-lane registers as the emulator.
This is what proves the emulator's fragment layouts match hardware; it skips only where CuPy sees no device."""

import os

import ml_dtypes
import numpy as np
import pytest
import simt_util
from ptx_cases import (ALL_NAMES, CVT_NAME, F64_NAME, LDM_NAMES, MMA_NAMES, cvt_case, ldmatrix_case, mma_case,
                       mma_f64_case, tile_case)

pytestmark = pytest.mark.gpu


def _cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


cp = _cupy()
if cp is None:
    pytest.skip("no CUDA device visible to CuPy", allow_module_level=True)


def _include_dir():
    candidates = [os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "include")]
    for mod in ("nvidia.cuda_runtime", "nvidia.cu13", "nvidia.cuda_nvrtc"):
        try:
            m = __import__(mod, fromlist=["x"])
            candidates += [os.path.join(p, "include") for p in m.__path__]
        except ImportError:
            pass
    for d in candidates:
        if os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return d
    pytest.skip("no cuda_fp16.h found for NVRTC")


@pytest.fixture(scope="module")
def gpu():
    return cp.RawModule(code=simt_util.source("ptx_tests.cu", with_ptx=True),
                        options=("--std=c++17", f"-I{_include_dir()}"), name_expressions=ALL_NAMES)


@pytest.fixture(scope="module")
def emu():
    return simt_util.module("ptx_tests.cu", ALL_NAMES, with_ptx=True)


def both(gpu, emu, name, block, inputs, outputs):
    """Run one kernel on the device and in the emulator with the same inputs; return both outputs."""
    dev_in = [cp.asarray(x) if isinstance(x, np.ndarray) else x for x in inputs]
    dev_out = [cp.asarray(o) for o in outputs]
    gpu.get_function(name)((1,), (block,), tuple(dev_in + dev_out))
    host_out = [o.copy() for o in outputs]
    emu.get_function(name)((1,), (block,), tuple(list(inputs) + host_out))
    return [cp.asnumpy(o) for o in dev_out], host_out


def both_scalar_last(gpu, emu, name, block, inputs, outputs, scalar):
    """Like both(), for a kernel whose last parameter is a scalar after its outputs."""
    dev_out = [cp.asarray(o) for o in outputs]
    gpu.get_function(name)((1,), (block,), tuple([cp.asarray(x) for x in inputs] + dev_out + [scalar]))
    host_out = [o.copy() for o in outputs]
    emu.get_function(name)((1,), (block,), tuple(list(inputs) + host_out + [scalar]))
    return [cp.asnumpy(o) for o in dev_out], host_out


@pytest.mark.parametrize("kind", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_mma_registers_match_hardware(gpu, emu, kind, seed):
    inputs, want = mma_case(kind, np.random.default_rng(seed))  # integer values: exact on both
    (dev,), (host,) = both(gpu, emu, MMA_NAMES[kind], 32, inputs, [np.zeros((32, 4), np.float32)])
    np.testing.assert_array_equal(dev, host)
    np.testing.assert_array_equal(dev, want)


def assert_same_bits(dev, host, inputs):
    """Per lane (or element), bit for bit; else the first differing ones: index, that lane's inputs, GPU, emulator."""
    dtype = np.uint64 if dev.dtype == np.float64 else np.uint32
    d, h = dev.view(dtype), host.view(dtype)
    bad = np.argwhere(d != h)
    assert bad.size == 0, [(i.tolist(), [x[i[0]].tolist() for x in inputs], hex(d[tuple(i)]), hex(h[tuple(i)]))
                           for i in bad[:8]]


@pytest.mark.parametrize("integers,scale", [(True, 0), (False, 0), (False, -520)])  # -520: float64 subnormals
@pytest.mark.parametrize("in_place", [0, 1])
def test_mma_f64_registers_match_hardware(gpu, emu, integers, scale, in_place):
    # Bit for bit: this decides the order of the four products the emulator's fma chain assumes (ptx.cuh).
    inputs, want = mma_f64_case(np.random.default_rng(4), integers, scale)
    (dev,), (host,) = both_scalar_last(gpu, emu, F64_NAME, 32, inputs, [np.zeros((32, 2))], np.int32(in_place))
    assert_same_bits(dev, host, inputs)
    np.testing.assert_array_equal(dev.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("seed", range(3))
def test_cvt_rna_tf32_matches_hardware(gpu, emu, seed):
    bits, want = cvt_case(np.random.default_rng(seed))
    (dev,), (host,) = both_scalar_last(gpu, emu, CVT_NAME, 128, (bits,), [np.zeros_like(bits)], np.int32(bits.size))
    assert_same_bits(dev, host, (bits,))
    np.testing.assert_array_equal(dev, want)


@pytest.mark.parametrize("name", LDM_NAMES)
def test_ldmatrix_registers_match_hardware(gpu, emu, name):
    n, trans = int(name.split("<")[1][0]), "true" in name
    (tile, perm), want = ldmatrix_case(n, trans, np.random.default_rng(7))
    (dev,), (host,) = both(gpu, emu, name, 32, (tile, perm), [np.zeros((32, n), np.uint32)])
    np.testing.assert_array_equal(dev, host)
    np.testing.assert_array_equal(dev, want)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_mma_tile_matches_hardware(gpu, emu, bf16, trans_b):
    dtype = ml_dtypes.bfloat16 if bf16 else np.float16
    (a, b, c), want = tile_case(dtype, trans_b, np.random.default_rng(3))
    if bf16:  # CuPy has no bfloat16 dtype: move the bits as uint16 (the kernel's parameter is __nv_bfloat16*)
        a, b = a.view(np.uint16), b.view(np.uint16)
    name = f"mma_tile<{'__nv_bfloat16' if bf16 else '__half'}, {'true' if trans_b else 'false'}>"
    (dev,), (host,) = both(gpu, emu, name, 32, (a, b, c), [np.zeros((16, 8), np.float32)])
    np.testing.assert_allclose(dev, host, rtol=1e-5, atol=1e-5)  # the hardware's summation order differs
    np.testing.assert_allclose(dev, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("src_bytes", [16, 8, 0])
def test_cp_async_matches_hardware(gpu, emu, src_bytes):
    rng = np.random.default_rng(src_bytes)
    src, src2 = rng.standard_normal((64, 4)).astype(np.float32), rng.standard_normal((64, 4)).astype(np.float32)
    outs = [np.zeros((64, 4), np.float32), np.zeros((128, 4), np.float32), np.zeros((64, 4), np.float32)]
    dev, host = both_scalar_last(gpu, emu, "cp_async_order", 64, (src, src2), outs, np.int32(src_bytes))
    # What the hardware guarantees: data after the covering wait (before/mid[:64] may or may not have landed).
    np.testing.assert_array_equal(dev[2], host[2])
    np.testing.assert_array_equal(dev[1][64:], host[1][64:])
