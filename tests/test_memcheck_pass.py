"""The memcheck pass inside the normal one: the tests marked `memcheck` that run kernels in this process need
AddressSanitizer preloaded into Python, so when it is not, this runs them in a child pytest that preloads it.
One `python -m pytest` therefore proves the kernels under ASan too; an ASan report fails this test with it."""

import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import simt

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(simt.asan_loaded(), reason="this process has ASan preloaded: the memcheck tests run here directly")
@pytest.mark.skipif(not simt.available(), reason=str(simt.unavailable_reason()))
def test_memcheck_pass_in_a_child_with_asan_preloaded():
    env = simt.memcheck_env()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "memcheck", "tests/simt",
         "--ignore=tests/simt/test_hardware.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], tail
