"""Memcheck: the AddressSanitizer build reports out-of-bounds global and shared accesses with the kernel's line.

AddressSanitizer aborts the process at its first report, and it only works when preloaded into Python. So:
* the tests that prove it catches bugs run each faulty kernel in a child Python with ASan preloaded
  (memcheck_child.py) and read the report from its stderr: they run in the normal pytest pass;
* the tests marked `memcheck` run clean kernels in memcheck mode in this process; they skip unless ASan is
  preloaded, which the separate CI pass does (see cuflash/simt/README.md), and there a report aborts pytest
  with the report on stderr: a failure that cannot go unnoticed."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simt_util

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
HERE = Path(__file__).resolve().parent


def marker_line(marker):
    """The line of the assembled source (common.cuh + ptx.cuh + memcheck.cu) that carries the marker comment."""
    for i, line in enumerate(simt_util.source("memcheck.cu", with_ptx=True).splitlines(), 1):
        if marker in line:
            return i
    raise LookupError(marker)


def run_child(which, script="memcheck_child.py"):
    env = simt.memcheck_env(mode=None)
    env["PYTHONPATH"] = os.pathsep.join([str(simt_util.ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(HERE / script), str(which)], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.mark.parametrize("which,kind,marker", [
    (1, "heap-buffer-overflow", "OOB_GLOBAL_READ"),
    (2, "heap-buffer-overflow", "OOB_GLOBAL_WRITE"),
    (3, "global-buffer-overflow", "OOB_SHARED_WRITE"),   # a static __shared__ array (a plain static in memcheck)
    (4, "heap-buffer-overflow", "OOB_DYNAMIC_READ"),     # dynamic shared memory: exactly shared_mem bytes
    (5, "heap-buffer-overflow", "OOB_CP_ASYNC"),         # reported where the cp.async is issued
])
def test_asan_reports_out_of_bounds_with_the_kernel_line(which, kind, marker):
    r = run_child(which)
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"AddressSanitizer: {kind}" in r.stderr, r.stderr
    assert re.search(rf"\bin oob (\./)?kernel\.cu:{marker_line(marker)}\b", r.stderr), r.stderr


def test_clean_kernel_passes_memcheck():
    r = run_child(0)
    assert r.returncode == 0 and "CLEAN" in r.stdout, r.stdout + r.stderr


def test_memcheck_has_no_false_positives_on_reused_stacks():
    """Launches abandoned deep (a failed block leaves its fibers' frames, redzones and all, on the stacks) followed
    by clean ones on the same stacks, in every schedule, several block sizes, from two OS threads: no report, and
    no stale poison below a kernel's frame (an earlier version cleared it only within one launch)."""
    r = run_child(12, "memcheck_reuse_child.py")
    assert r.returncode == 0 and "CLEAN 12" in r.stdout, r.stdout + r.stderr[-6000:]


@pytest.mark.skipif(simt.asan_loaded(), reason="AddressSanitizer is preloaded here")
def test_memcheck_refuses_to_run_without_asan_preloaded():
    with pytest.raises(RuntimeError, match=r"LD_PRELOAD=\$\(g\+\+ -print-file-name=libasan\.so\)"):
        simt.RawModule(code='extern "C" __global__ void k() {}', mode="memcheck")


# ---- the in-process memcheck pass ----------------------------------------------------------------------------
needs_asan = pytest.mark.skipif(not simt.asan_loaded(), reason="needs AddressSanitizer preloaded: " + simt.MEMCHECK_HINT)


@pytest.mark.memcheck
@needs_asan
@pytest.mark.parametrize("schedule", ["forward", "reverse", 5])
def test_memcheck_reductions_are_clean(schedule):
    mod = simt_util.module("basics.cu", ("reduce_shared<128>",), mode="memcheck")
    x = np.random.default_rng(0).standard_normal(7 * 128 - 3).astype(np.float32)
    out = np.zeros(7, np.float32)
    mod.get_function("reduce_shared<128>")((7,), (128,), (x, out, np.int64(x.size), np.int32(2)), seed=schedule)
    np.testing.assert_allclose(out, np.pad(x, (0, 3)).reshape(7, 128).sum(1), rtol=1e-5, atol=1e-4)
    y = np.random.default_rng(1).standard_normal(3 * 96)
    s = np.zeros(3)
    mod.get_function("reduce_shuffle")((3,), (96,), (y, s, np.int32(y.size)), seed=schedule)
    np.testing.assert_allclose(s, y.reshape(3, 96).sum(1))


@pytest.mark.memcheck
@needs_asan
def test_memcheck_ptx_kernels_are_clean():
    from ptx_cases import ALL_NAMES, tile_case
    mod = simt_util.module("ptx_tests.cu", ALL_NAMES, with_ptx=True, mode="memcheck")
    (a, b, c), want = tile_case(np.float16, True, np.random.default_rng(0))
    d = np.zeros((16, 8), np.float32)
    mod.get_function("mma_tile<__half, true>")((1,), (32,), (a, b, c, d))
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)
    src = np.ones((64, 4), np.float32)
    outs = [np.zeros((n, 4), np.float32) for n in (64, 128, 64)]
    mod.get_function("cp_async_order")((1,), (64,), (src, src, *outs, np.int32(8)))
    assert (outs[2][:, :2] == 1).all() and (outs[2][:, 2:] == 0).all()


@pytest.mark.memcheck
@needs_asan
def test_memcheck_launch_errors_still_come_back_as_exceptions():
    mod = simt_util.module("basics.cu", ("reduce_shared<128>",), mode="memcheck")
    with pytest.raises(simt.LaunchError, match="deadlock"):
        mod.get_function("misuse")((2,), (64,), (np.zeros(64, np.float32), np.int32(2)))
    test_memcheck_reductions_are_clean("forward")  # and the next launch, on reused fiber stacks, is clean
