// shared_memory.h: shared memory.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_SHARED_MEMORY_H
#define CUFLASH_SIMT_RUNTIME_SHARED_MEMORY_H

namespace cuflash_simt {

// ---- shared memory ----
inline bool in_shared(const Block& b, const void* p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  if (b.dyn && a >= (uintptr_t)b.dyn && a + n <= (uintptr_t)b.dyn + b.launch->dyn_bytes) return true;
  for (const auto& s : b.statics)
    if (a >= (uintptr_t)s.first && a + n <= (uintptr_t)s.first + s.second) return true;
  return false;
}
// Called right after each rewritten static __shared__ declaration: the first thread of a block to get
// there fills the array with 0xff bytes (NaN for floating types), so reading it before writing shows.
inline void shared_fresh(const void* p, size_t n, const char* file, int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Block& b = *tl.block;
  for (const auto& s : b.statics)
    if (s.first == p) return;
  b.statics.emplace_back(p, n);
  b.static_bytes += n;
  if (b.static_bytes + b.launch->dyn_bytes > b.launch->smem_limit)
    fail_here("__shared__ array at %s:%d brings the block to %zu bytes of static and %zu of dynamic shared "
              "memory, more than the %zu the emulated device allows per block",
              file, line, b.static_bytes, b.launch->dyn_bytes, b.launch->smem_limit);
  std::memset(const_cast<void*>(p), 0xff, n);
#if defined(CUFLASH_SIMT_RACE)
  race_fresh(p, n);  // a process static here, each block's own on a GPU: the last block's accesses do not count
#endif
}
inline void* dynamic_shared() { return tl.block->dyn; }

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_SHARED_MEMORY_H
