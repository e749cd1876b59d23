"""Run kernels in race mode (ThreadSanitizer) in this process, which must have TSan preloaded. Used by
test_simt_race.py as a child process: a race report ends it with exit status 66 and the report on stderr.
Usage: python race_child.py CASE  (CASE: a name in CASES; the clean ones print "CLEAN <case>")."""

import sys

import numpy as np
import simt_util

from cuflash import simt

# Markers name the lines the parent expects in a report.
RACY = r'''
extern "C" __global__ void missing_barrier(const float* x, float* out) {
  __shared__ float s[64];
  int t = threadIdx.x;
  s[t] = x[blockIdx.x * 64 + t];                       // RACE_WRITE
  // a __syncthreads() belongs here
  out[blockIdx.x * 64 + t] = s[(t + 63) % 64];         // RACE_READ
}

extern "C" __global__ void write_after_read(const float* x, float* out) {
  __shared__ float s[64];
  int t = threadIdx.x;
  s[t] = x[blockIdx.x * 64 + t];
  __syncthreads();
  float v = s[(t + 1) % 64];                           // WAR_READ
  // a __syncthreads() belongs here: others may still read s[t]
  s[t] = 2 * v;                                        // WAR_WRITE
  __syncthreads();
  out[blockIdx.x * 64 + t] = s[t];
}

extern "C" __global__ void atomics_only(int* counter) {
  atomicAdd(counter, 1);
  __shared__ int hits;
  if (threadIdx.x == 0) hits = 0;
  __syncthreads();
  atomicAdd(&hits, 1);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(counter + 1, hits);
}
'''


def racy():
    return simt.RawModule(code=RACY, filename="racy.cu", mode="race")


def case_missing_barrier():
    x = np.arange(128, dtype=np.float32)
    racy().get_function("missing_barrier")((2,), (64,), (x, np.zeros(128, np.float32)))


def case_write_after_read():
    x = np.arange(128, dtype=np.float32)
    racy().get_function("write_after_read")((2,), (64,), (x, np.zeros(128, np.float32)))


def case_clean_reductions():
    mod = simt_util.module("basics.cu", ("reduce_shared<128>",), mode="race")
    for schedule in ("forward", "reverse", 5):
        x = np.random.default_rng(0).standard_normal(7 * 128 - 3).astype(np.float32)
        out = np.zeros(7, np.float32)
        mod.get_function("reduce_shared<128>")((7,), (128,), (x, out, np.int64(x.size), np.int32(2)), seed=schedule)
        np.testing.assert_allclose(out, np.pad(x, (0, 3)).reshape(7, 128).sum(1), rtol=1e-5, atol=1e-4)
        y = np.random.default_rng(1).standard_normal(3 * 96)
        s = np.zeros(3)
        mod.get_function("reduce_shuffle")((3,), (96,), (y, s, np.int32(y.size)), seed=schedule)
        np.testing.assert_allclose(s, y.reshape(3, 96).sum(1))
        z = np.random.default_rng(3).standard_normal(4 * 128).astype(np.float32)
        o = np.zeros(4, np.float32)
        mod.get_function("reduce10")((4,), (128,), (z, o), seed=schedule)
        np.testing.assert_allclose(o, z.reshape(4, 128).sum(1), rtol=1e-4, atol=1e-4)
    counter = np.zeros(2, np.int32)
    racy().get_function("atomics_only")((3,), (64,), (counter,))
    assert counter.tolist() == [192, 192], counter


def case_clean_ptx():
    from ptx_cases import ALL_NAMES, tile_case
    mod = simt_util.module("ptx_tests.cu", ALL_NAMES, with_ptx=True, mode="race")
    (a, b, c), want = tile_case(np.float16, True, np.random.default_rng(0))
    d = np.zeros((16, 8), np.float32)
    mod.get_function("mma_tile<__half, true>")((1,), (32,), (a, b, c, d))
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)
    src = np.ones((64, 4), np.float32)
    outs = [np.zeros((n, 4), np.float32) for n in (64, 128, 64)]
    mod.get_function("cp_async_order")((1,), (64,), (src, src, *outs, np.int32(8)))
    assert (outs[2][:, :2] == 1).all() and (outs[2][:, 2:] == 0).all()


def case_clean_attention():
    """The project's forward kernels (fp32: the FMA kernel; fp16: the tensor-core one) on small problems with
    ragged tiles, every block running under TSan."""
    import cuflash
    from reference import attention_reference  # tests/ is on the path
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16):
        q, k, v = (rng.standard_normal((1, 2, n, 64)).astype(dtype) for n in (40, 72, 72))
        for causal in (False, True):
            o = cuflash.attention(q, k, v, causal=causal, backend="simt")
            want, _ = attention_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                          causal=causal)
            np.testing.assert_allclose(o.astype(np.float64), want, rtol=2e-2, atol=2e-2)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    which = sys.argv[1]
    CASES[which]()
    print("CLEAN", which)
