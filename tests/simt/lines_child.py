"""A deliberate out-of-bounds read inside a project kernel helper, run in memcheck mode in this process (which
must have AddressSanitizer preloaded): the report must name the helper's true file and line. Used by
tests/test_source_lines.py as a child process. Usage: python lines_child.py"""

import numpy as np

from cuflash import kernels, simt

PROBE = '''
#line 1 "lines_probe.cu"
extern "C" __global__ void tile_overrun(float* out, const float* src, int rows) {
  extern __shared__ float tile[];
  cuflash::load_tile<float, 8, 16, 16, 64>(tile, src, 16, 1, rows, 16, false);
  __syncthreads();
  out[threadIdx.x] = tile[threadIdx.x];
}
'''

module = simt.RawModule(code=kernels.source("forward.cuh") + PROBE, mode="memcheck", filename="forward.cuh")
src = np.zeros((4, 16), np.float32)  # 4 rows; the call claims 8
module.get_function("tile_overrun")((1,), (64,), (np.zeros(64, np.float32), src, np.int32(8)), shared_mem=8 * 16 * 4)
print("NO REPORT")
