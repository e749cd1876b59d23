"""Run one kernel of tests/simt_kernels/cp_async_window.cu in a sanitizer mode in this process (which must have
that sanitizer preloaded). Used by test_simt_cp_async.py as a child process: a report ends it, and the parent
reads the report from its stderr. The twin of window_read first runs after launches that leave copies in
flight, to prove that no window outlives them.  Usage: python cp_async_child.py MODE KERNEL FIXED [SEED]"""

import sys

import simt_util

from cuflash import simt

mode, kernel, fixed = sys.argv[1], sys.argv[2], int(sys.argv[3])
seed = int(sys.argv[4]) if len(sys.argv) > 4 else None
if kernel == "window_read" and fixed == 1:  # first leave copies in flight, by exiting and by failing the launch
    simt_util.check_cp_async_window(mode, kernel, 2, seed)
    try:
        simt_util.check_cp_async_window(mode, kernel, 3, seed)
        raise AssertionError("__trap() did not fail the launch")
    except simt.LaunchError:
        pass
right = simt_util.check_cp_async_window(mode, kernel, fixed, seed)
print("CLEAN" if right else "WRONG", kernel)
