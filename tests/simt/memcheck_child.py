"""Run one kernel of tests/simt_kernels/memcheck.cu in memcheck mode, in this process (which must have
AddressSanitizer preloaded). Used by test_simt_memcheck.py as a child process: an ASan report aborts it, and the
parent turns the report into the test's verdict.  Usage: python memcheck_child.py WHICH"""

import sys

import numpy as np
import simt_util

which = int(sys.argv[1])
mod = simt_util.module("memcheck.cu", (), with_ptx=True, mode="memcheck")
n = 128
x = np.arange(n, dtype=np.float32)
out = np.zeros(n, np.float32)
mod.get_function("oob")((2,), (64,), (x, out, np.int32(n), np.int32(which)), shared_mem=64 * 4)
want = (x.reshape(2, 64)[:, ::-1] + x.reshape(2, 64)).ravel()
assert np.array_equal(out, want) or which, (out, want)
print("CLEAN")
