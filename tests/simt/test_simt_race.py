"""Race mode: the ThreadSanitizer build reports shared-memory races between a block's threads and global-memory
races between the blocks of a launch with the kernel's lines, and stays silent on correct kernels (reductions,
disjoint outputs, atomics across blocks, shuffles, mma/ldmatrix/cp.async, the forward kernels).

TSan must be preloaded into Python and ends the process at its first report (exit status 66), so every case runs
in a child Python (race_child.py) and the parent reads the verdict from its exit status and stderr."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import simt_util

from cuflash import simt

pytestmark = pytest.mark.skipif(not simt.available() or simt.libtsan_path() is None,
                                reason=str(simt.unavailable_reason() or "the compiler has no libtsan.so"))
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import race_child  # noqa: E402  (its kernel source, for the marker lines)


def marker_line(marker):
    for i, line in enumerate(race_child.RACY.splitlines(), 1):
        if marker in line:
            return i
    raise LookupError(marker)


def run_child(case):
    env = simt.sanitizer_env("race")  # CUFLASH_SIMT_MODE=race: the project's kernels are built for TSan too
    env["OPENBLAS_NUM_THREADS"] = "1"  # TSan cannot see OpenBLAS's own pool synchronize (the reference's matmuls)
    env["PYTHONPATH"] = os.pathsep.join([str(simt_util.ROOT), str(HERE), str(simt_util.ROOT / "tests"),
                                         os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(HERE / "race_child.py"), case], capture_output=True, text=True,
                          env=env, timeout=900)


@pytest.mark.parametrize("case,kernel,current,previous", [
    # thread 1 reads s[0], which thread 0 wrote with no barrier between
    ("missing_barrier", "missing_barrier", "RACE_READ", "RACE_WRITE"),
    # thread 1 overwrites s[1], which thread 0 read after the last barrier
    ("write_after_read", "write_after_read", "WAR_WRITE", "WAR_READ"),
])
def test_race_mode_reports_shared_memory_races_with_the_kernel_lines(case, kernel, current, previous):
    r = run_child(case)
    assert r.returncode == 66, r.stdout + r.stderr[-6000:]
    assert "WARNING: ThreadSanitizer: data race" in r.stderr, r.stderr[-6000:]
    assert f"SUMMARY: ThreadSanitizer: data race racy.cu:{marker_line(current)} in {kernel}" in r.stderr, r.stderr
    assert re.search(rf"Previous (write|read) .*\n\s+#0 {kernel} racy\.cu:{marker_line(previous)}\b", r.stderr), \
        r.stderr
    assert f"'block (0,0,0) thread (0,0,0) of {kernel}'" in r.stderr and \
        f"'block (0,0,0) thread (1,0,0) of {kernel}'" in r.stderr, r.stderr


@pytest.mark.parametrize("case,current,previous", [
    # blocks 0 and 1 both write out[0, 64): the same thread of each, on the same line
    ("blocks_same_output", "SAME_WRITE", "SAME_WRITE"),
    # block 1 reads out[0, 64), which block 0 wrote
    ("blocks_read_other", "OTHER_READ", "OTHER_WRITE"),
    # the same across a cp.async wait: a thread's copies carry nothing from one block into the next
    ("blocks_read_other_after_copy", "COPY_READ", "COPY_WRITE"),
])
def test_race_mode_reports_global_memory_races_between_blocks(case, current, previous):
    r = run_child(case)
    assert r.returncode == 66, r.stdout + r.stderr[-6000:]
    line = {m: simt_util.site("blocks.cu", m, with_ptx=True).pattern for m in (current, previous)}
    assert re.search(rf"SUMMARY: ThreadSanitizer: data race {line[current]} in {case}", r.stderr), r.stderr
    assert re.search(rf"Previous (write|read) .*\n\s+#0 {case} {line[previous]}", r.stderr), r.stderr
    # the report names both blocks (blocks run in order: block 1 finds block 0's access)
    for block in ("(1,0,0)", "(0,0,0)"):
        assert f"'block {block} thread (0,0,0) of {case}'" in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["clean_reductions", "clean_blocks", "clean_ptx", "clean_attention",
                                  "clean_backward", "clean_patterns", "clean_sequences", "clean_dropout"])
def test_race_mode_is_silent_on_correct_kernels(case):
    r = run_child(case)
    assert r.returncode == 0 and f"CLEAN {case}" in r.stdout, r.stdout + r.stderr[-6000:]


@pytest.mark.skipif(simt.tsan_loaded(), reason="ThreadSanitizer is preloaded here")
def test_race_mode_refuses_to_run_without_tsan_preloaded():
    with pytest.raises(RuntimeError, match=r"LD_PRELOAD=\$\(g\+\+ -print-file-name=libtsan\.so\)"):
        simt.RawModule(code='extern "C" __global__ void k() {}', mode="race")


def test_sanitizer_env_keeps_memcheck_env():
    env = simt.sanitizer_env("race", base={"A": "1"})
    assert env["LD_PRELOAD"].endswith("libtsan.so") and env["CUFLASH_SIMT_MODE"] == "race"
    assert "halt_on_error=1" in env["TSAN_OPTIONS"] and "exitcode=66" in env["TSAN_OPTIONS"] and env["A"] == "1"
    m = simt.memcheck_env(base={}, mode=None)
    assert m["LD_PRELOAD"].endswith("libasan.so") and "CUFLASH_SIMT_MODE" not in m
