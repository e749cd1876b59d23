"""cp.async windows: a copy's destination is undefined from its issue to the cp_async_wait that covers it. The
emulator reports any access to it there (memcheck: ASan use-after-poison at the access's line, with the CUDA thread
and the issuing line; race: a data race between the copy, at its issuing line, and the access), and a seeded
schedule lands copies early, so a kernel that relies on late landing gives wrong results. Each bug of
tests/simt_kernels/cp_async_window.cu runs beside its fixed twin, which passes in every mode and schedule.

The sanitizer cases run in child Pythons (cp_async_child.py): a report ends the process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import simt_util

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
HERE = Path(__file__).resolve().parent
SRC = "cp_async_window.cu"
CASES = [("window_read", "WINDOW_ISSUE", "WINDOW_READ"), ("stage_reuse", "REUSE_ISSUE", "REUSE_READ")]


def line(marker):
    return int(re.search(r":(\d+)", simt_util.site(SRC, marker, with_ptx=True).pattern).group(1))


def run_child(mode, kernel, fixed, seed=None):
    env = simt.sanitizer_env(mode, mode=None)
    env["PYTHONPATH"] = os.pathsep.join([str(simt_util.ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])
    args = [mode, kernel, str(fixed)] + ([] if seed is None else [str(seed)])
    return subprocess.run([sys.executable, str(HERE / "cp_async_child.py"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


needs_tsan = pytest.mark.skipif(simt.libtsan_path() is None, reason="the compiler has no libtsan.so")


@pytest.mark.parametrize("kernel,issue,access", CASES)
def test_memcheck_reports_an_access_inside_the_window(kernel, issue, access):
    r = run_child("memcheck", kernel, 0)
    assert r.returncode != 0, r.stdout + r.stderr[-6000:]
    assert "AddressSanitizer: use-after-poison" in r.stderr, r.stderr[-6000:]
    assert re.search(rf"\bin {kernel} (\./)?kernel\.cu:{line(access)}\b", r.stderr), r.stderr[-6000:]
    assert re.search(rf"cuflash\.simt: in kernel '{kernel}', block \(0,0,0\), thread \(\d+,0,0\)", r.stderr), \
        r.stderr[-3000:]
    assert re.search(rf"destination of a cp\.async that thread \(\d+,0,0\) issued at kernel\.cu:{line(issue)}\b",
                     r.stderr), r.stderr[-3000:]


@needs_tsan
@pytest.mark.parametrize("kernel,issue,access", CASES)
def test_race_mode_reports_an_access_inside_the_window(kernel, issue, access):
    r = run_child("race", kernel, 0)
    assert r.returncode == 66, r.stdout + r.stderr[-6000:]
    assert "WARNING: ThreadSanitizer: data race" in r.stderr, r.stderr[-6000:]
    # the copy's write at its issuing line, by the copy's own fiber; the access at its line, by a CUDA thread
    assert re.search(rf"Write of size \d+ .* by thread T\d+:\n(\s+#\d .*\n)*?\s+#\d+ {kernel} kernel\.cu:"
                     rf"{line(issue)}\b", r.stderr), r.stderr[-6000:]
    assert re.search(rf"Previous (read|write) .*\n\s+#0 {kernel} kernel\.cu:{line(access)}\b", r.stderr), \
        r.stderr[-6000:]
    assert "'cp.async of CUDA thread (" in r.stderr and "of block (0,0,0)'" in r.stderr, r.stderr[-6000:]


@pytest.mark.parametrize("mode", ["memcheck", pytest.param("race", marks=needs_tsan)])
@pytest.mark.parametrize("kernel", ["window_read", "stage_reuse"])
def test_fixed_twins_are_clean(mode, kernel):
    for seed in (None, 3):
        r = run_child(mode, kernel, 1, seed)
        assert r.returncode == 0 and f"CLEAN {kernel}" in r.stdout, r.stdout + r.stderr[-6000:]


def test_seeded_schedules_land_copies_early():
    """The stage reused one tile too early passes while copies land at the wait (the default), fails in some seeded
    schedules; its twin passes in all of them."""
    schedules = ["forward", "reverse", *range(1, 9)]
    buggy = [simt_util.check_cp_async_window("fast", "stage_reuse", 0, s) for s in schedules]
    assert buggy[:2] == [True, True] and not all(buggy[2:]), buggy
    for kernel in ("stage_reuse", "window_read"):
        assert all(simt_util.check_cp_async_window("fast", kernel, 1, s) for s in schedules), kernel
    # a seed is a schedule: the same seed, the same result
    assert [simt_util.check_cp_async_window("fast", "stage_reuse", 0, s) for s in schedules] == buggy
