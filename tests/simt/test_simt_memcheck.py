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
    """The line of the assembled source (common.cuh + ptx.cuh + ptx_extra.cuh + memcheck.cu) that carries the
    marker comment."""
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
needs_asan = pytest.mark.skipif(not simt.asan_loaded(),
                                reason="needs AddressSanitizer preloaded: " + simt.MEMCHECK_HINT)


@pytest.mark.memcheck
@needs_asan
@pytest.mark.parametrize("schedule", ["forward", "reverse", 5])
def test_memcheck_reductions_are_clean(schedule):
    simt_util.check_reductions("memcheck", schedule)


@pytest.mark.memcheck
@needs_asan
def test_memcheck_ptx_kernels_are_clean():
    simt_util.check_ptx_kernels("memcheck")


@pytest.mark.memcheck
@needs_asan
def test_memcheck_launch_errors_still_come_back_as_exceptions():
    mod = simt_util.module("basics.cu", ("reduce_shared<128>",), mode="memcheck")
    with pytest.raises(simt.LaunchError, match="deadlock"):
        mod.get_function("misuse")((2,), (64,), (np.zeros(64, np.float32), np.int32(2)))
    test_memcheck_reductions_are_clean("forward")  # and the next launch, on reused fiber stacks, is clean
