// cuflash_simt.h: the SIMT emulator's runtime. With it, g++ compiles the CUDA C++ device code that
// NVRTC compiles, and runs each CUDA thread as a fiber on the CPU.
//
// One block runs its fibers cooperatively on one OS thread; blocks run in parallel on several OS threads
// (one in the memcheck and race builds). A fiber runs until it blocks: at __syncthreads(), at a warp
// collective (shuffles, votes, mma, ldmatrix ...) or when it exits. The scheduler then picks the next
// ready fiber in the launch's order (forward, reverse or drawn from a seed). Everything a GPU leaves
// undefined and that a test should hear about (barrier divergence, a warp collective some lane never
// reaches, a deadlock, __trap, a failed assert) ends the launch with a message, never a hang or a crash.
//
// Build macros (set by the Python side): CUFLASH_SIMT_MEMCHECK (AddressSanitizer build), CUFLASH_SIMT_RACE
// (ThreadSanitizer build), CUFLASH_SIMT_PROFILE (the profile build: ThreadSanitizer's instrumentation, the hooks
// of runtime/profile.h), CUFLASH_SIMT_FTZ (flush float32 denormals, like CuPy's -ftz=true).
//
// The runtime itself lives in runtime/, one file per section, included below in the order they rely on.
#ifndef CUFLASH_SIMT_H
#define CUFLASH_SIMT_H

#ifndef CUFLASH_SIMT
#define CUFLASH_SIMT 1
#endif

#include "runtime/prelude.h"
#include "runtime/keywords.h"
#include "runtime/vectors.h"
#include "runtime/half.h"
#include "runtime/intrinsics.h"
#include "runtime/atomics.h"
#include "runtime/fibers.h"
#include "runtime/state.h"
#include "runtime/profile.h"
#include "runtime/collectives.h"
#include "runtime/shared_memory.h"
#include "runtime/cp_async.h"
#include "runtime/scheduler.h"
#include "runtime/launch.h"
#include "runtime/device_api.h"

#endif  // CUFLASH_SIMT_H
