// cp_async.h: cp.async.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_CP_ASYNC_H
#define CUFLASH_SIMT_RUNTIME_CP_ASYNC_H

namespace cuflash_simt {

// ---- cp.async: a per-thread queue; copies land at the wait that covers their group, not at issue ----
inline void cp_async(void* dst, const void* src, int size, int src_size, const char* file, int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  if (!in_shared(*f->block, dst, (size_t)size))
    fail_here("cp.async (%s:%d): destination %p is not %d bytes of this block's shared memory", file, line, dst,
              size);
  if (((uintptr_t)dst | (uintptr_t)src) % (uintptr_t)size)
    fail_here("cp.async (%s:%d): addresses %p and %p must be aligned to the copy size %d", file, line, dst, src,
              size);
  if (src_size < 0 || src_size > size)
    fail_here("cp.async (%s:%d): src-size %d outside [0, %d]", file, line, src_size, size);
#if defined(CUFLASH_SIMT_ASAN)
  // Check both ranges now, so that an out-of-bounds copy is reported at the line that issues it.
  if (void* bad = __asan_region_is_poisoned(const_cast<void*>(src), (size_t)src_size)) __asan_report_load_n(bad, 1);
  if (void* bad = __asan_region_is_poisoned(dst, (size_t)size)) __asan_report_store_n(bad, 1);
#endif
  f->cp_queue.push_back(CpAsync{dst, src, size, src_size, f->cp_committed});
}
inline void cp_async_commit() {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  tl.fiber->cp_committed++;
}
// Land every copy committed in a group older than the `pending` most recent ones.
inline void cp_async_wait(int pending) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  std::vector<CpAsync>& q = f->cp_queue;
  size_t keep = 0;
  for (size_t i = 0; i < q.size(); i++) {
    CpAsync& c = q[i];
    if ((long long)c.group < (long long)f->cp_committed - pending) {
#if defined(CUFLASH_SIMT_RACE)
      RaceKernelAccess kernel;  // the copy is the waiting thread's access
#endif
      if (c.src_size) std::memcpy(c.dst, c.src, (size_t)c.src_size);
      if (c.size > c.src_size) std::memset((char*)c.dst + c.src_size, 0, (size_t)(c.size - c.src_size));
    } else {
      q[keep++] = c;
    }
  }
  q.resize(keep);
}

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_CP_ASYNC_H
