// Stand-in for CUDA's <cuda_runtime.h> in the SIMT emulator's builds: the emulator's runtime header provides what
// kernels use from it (g++ finds this file first on the include path).
#include "cuflash_simt.h"
