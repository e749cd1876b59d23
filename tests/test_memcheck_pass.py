"""The memcheck pass inside the normal one: the tests marked `memcheck` that run kernels in this process need
AddressSanitizer preloaded into Python, so when it is not, this runs them in a child pytest that preloads it.
One `python -m pytest` therefore proves the kernels under ASan too; an ASan report fails this test with it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import simt

ROOT = Path(__file__).resolve().parent.parent


def libasan():
    try:
        path = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(simt.asan_loaded(), reason="this process has ASan preloaded: the memcheck tests run here directly")
@pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
def test_memcheck_pass_in_a_child_with_asan_preloaded():
    asan = libasan()
    assert asan, "g++'s libasan.so was not found: the memcheck pass cannot run (install g++ with its sanitizers)"
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0", CUFLASH_SIMT_MODE="memcheck")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "memcheck", "tests/simt",
         "--ignore=tests/simt/test_hardware.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], tail
