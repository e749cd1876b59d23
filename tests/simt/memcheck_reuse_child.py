"""Memcheck on reused fiber stacks: many launches in one process (clean and failing, every schedule, several block
sizes, from the main thread and from others) must give no AddressSanitizer report, and the stack below a kernel's
frame must carry no poison left by an earlier launch's abandoned frames. Run by test_simt_memcheck.py as a child
with ASan preloaded; prints CLEAN at the end.  Usage: python memcheck_reuse_child.py [ROUNDS]"""

import sys
import threading

import numpy as np
import simt_util

from cuflash import simt

SRC = r"""
#include <sanitizer/asan_interface.h>
// Each level leaves an instrumented frame (redzones in the shadow) on the fiber's stack.
__device__ __noinline__ float dive(volatile float* up, int d, int fail) {
  volatile float b[200];
  for (int i = 0; i < 200; i++) b[i] = up[i % 7] + d;
  if (d == 0) {
    if (fail && threadIdx.x == blockDim.x - 1) __trap();  // the others wait below: abandoned deep
    __syncthreads();
    return b[3];
  }
  return dive(b, d - 1, fail) + b[d % 200];
}
extern "C" __global__ void deep(float* out, int depth, int fail) {
  volatile float a[7] = {1, 2, 3, 4, 5, 6, 7};
  out[blockIdx.x * blockDim.x + threadIdx.x] = dive(a, depth, fail);
}
// The stack below this frame is where the kernel's callees will live: none of it may be poisoned.
extern "C" __global__ void below(int* bad) {
  char* frame = (char*)__builtin_frame_address(0);
  bad[threadIdx.x] = __asan_region_is_poisoned(frame - 96 * 1024, 95 * 1024) != nullptr;
}
extern "C" __global__ void probe(float* x) {
  float y[64];
  for (int i = 0; i < 64; ++i) y[i] = i * x[i];
  x[threadIdx.x] = y[threadIdx.x % 64];
}
"""

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
m = simt.RawModule(code=SRC, mode="memcheck")
red = simt_util.module("basics.cu", ("reduce_shared<128>",), mode="memcheck")


def expect_failure(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except simt.LaunchError:
        return
    raise AssertionError("the launch should have failed")


def check_below(nthreads):
    bad = np.zeros(nthreads, np.int32)
    m.get_function("below")((1,), (nthreads,), (bad,))
    assert not bad.any(), f"stale poison below the kernel's frame in threads {np.flatnonzero(bad)}"


def one(r):
    rng = np.random.default_rng(r)
    seed = [int(rng.integers(1 << 40)), "forward", "reverse"][r % 3]
    nt = int(rng.choice([32, 64, 96, 128]))
    out = np.zeros(4 * 128, np.float32)
    # Abandoned ~90 KiB deep in one launch; the next launch reuses those stacks.
    expect_failure(m.get_function("deep"), (2,), (nt,), (out, np.int32(60), np.int32(1)), seed=seed)
    check_below(nt)
    m.get_function("deep")((3,), (nt,), (out, np.int32(int(rng.integers(0, 40))), np.int32(0)), seed=seed)
    expect_failure(red.get_function("misuse"), (2,), (64,), (np.zeros(64, np.float32), np.int32(r % 7)), seed=seed)
    buf = np.ones(128, np.float32)
    for _ in range(2):
        m.get_function("probe")((int(rng.integers(1, 6)),), (nt,), (buf,), seed=seed)
    x = rng.standard_normal(7 * 128 - 3).astype(np.float32)
    s = np.zeros(7, np.float32)
    red.get_function("reduce_shared<128>")((7,), (128,), (x, s, np.int64(x.size), np.int32(2)), seed=seed)
    np.testing.assert_allclose(s, np.pad(x, (0, 3)).reshape(7, 128).sum(1), rtol=1e-5, atol=1e-4)


for r in range(rounds):
    if r % 4 == 3:  # another OS thread: its own fiber stacks, and the main thread's come back afterwards
        t = threading.Thread(target=one, args=(r,))
        t.start()
        t.join()
    else:
        one(r)
print("CLEAN", rounds)
