// cp_async.h: cp.async.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_CP_ASYNC_H
#define CUFLASH_SIMT_RUNTIME_CP_ASYNC_H

namespace cuflash_simt {

// ---- cp.async: a per-thread queue of copies in flight ----
// On hardware the bytes land at any moment between the issue and the cp.async.wait_group that covers them, so
// the destination is undefined in that window: any access to it there is a bug the emulator must report.
// * memcheck: the destination is poisoned from issue to wait (its accesses are ASan use-after-poison reports).
// * race: the copy writes from a ThreadSanitizer fiber of its own, ordered after the issue and before the
//   waiting thread, so anything any thread does to the destination in the window races with it.
// * a seeded schedule lands each copy at issue, at the issuing thread's next barrier or at the wait (drawn from
//   the seed), so a kernel that relies on late landing gives wrong results; otherwise copies land at the wait.
inline void cp_poison(const CpAsync& c, bool poisoned) {
#if defined(CUFLASH_SIMT_ASAN)
  if (poisoned) __asan_poison_memory_region(c.dst, (size_t)c.size);
  else __asan_unpoison_memory_region(c.dst, (size_t)c.size);
#else
  (void)c; (void)poisoned;
#endif
}
// The bytes arrive (the window stays poisoned if it is still open).
inline void cp_bytes(CpAsync& c, bool window_open) {
  cp_poison(c, false);
  if (c.src_size) std::memcpy(c.dst, c.src, (size_t)c.src_size);
  if (c.size > c.src_size) std::memset((char*)c.dst + c.src_size, 0, (size_t)(c.size - c.src_size));
  c.landed = true;
  if (window_open) cp_poison(c, true);
}
// A copy no wait will cover (its thread exited, or its block failed): dropped, its window closed.
inline void cp_drop_all(Fiber& f) {
  for (CpAsync& c : f.cp_queue) {
    cp_poison(c, false);
#if defined(CUFLASH_SIMT_RACE)
    std::free(c.issued);
#endif
  }
  f.cp_queue.clear();
}

#if defined(CUFLASH_SIMT_RACE)
// The accesses of the copies q[0, n) that a wait lands, as the copy fiber's: each after its issue (it acquires
// what the issuing thread released there), not after anything done since, and all before the waiting thread
// goes on (which acquires tsan_landed). Reported at the issuing line. In issue order: the copy fiber's clock
// only grows, so a copy landed after a later one would be ordered after more than its own issue.
inline void race_copy_writes(Fiber* f, CpAsync* q, size_t n) {
  if (!f->tsan_copy) {  // created from the scheduler's fiber: creation orders it after its creator only
    race_switch(tl.tsan_sched);
    f->tsan_copy = __tsan_create_fiber(0);
    race_switch(f->tsan);
    f->tsan_landed = std::malloc(1);
  }
  if (f->copy_named != f->block->linear) {
    f->copy_named = f->block->linear;
    const Block& b = *f->block;
    __tsan_set_fiber_name(f->tsan_copy, format("cp.async of CUDA thread (%u,%u,%u) of block (%u,%u,%u)", f->tid.x,
                                               f->tid.y, f->tid.z, b.idx.x, b.idx.y, b.idx.z).c_str());
  }
  void* landed = f->tsan_landed;
  // A fresh fiber ignores nothing: these are checked (its reads of q too, ordered before the thread's next
  // accesses through tsan_landed).
  race_switch(f->tsan_copy);
  for (size_t i = 0; i < n; i++) {
    __tsan_acquire(q[i].issued);
    if (q[i].src_size) __tsan_read_range_pc(const_cast<void*>(q[i].src), (unsigned long)q[i].src_size, q[i].pc);
    __tsan_write_range_pc(q[i].dst, (unsigned long)q[i].size, q[i].pc);
  }
  __tsan_release(landed);
  race_switch(f->tsan);
  __tsan_acquire(landed);
  for (size_t i = 0; i < n; i++) {
    std::free(q[i].issued);
    q[i].issued = nullptr;
  }
}
#endif

// noinline: its return address is the issuing call, for race mode's report.
__attribute__((noinline)) inline void cp_async(void* dst, const void* src, int size, int src_size, const char* file,
                                               int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  if (!in_shared(b, dst, (size_t)size))
    fail_here("cp.async (%s:%d): destination %p is not %d bytes of this block's shared memory", file, line, dst,
              size);
  if (((uintptr_t)dst | (uintptr_t)src) % (uintptr_t)size)
    fail_here("cp.async (%s:%d): addresses %p and %p must be aligned to the copy size %d", file, line, dst, src,
              size);
  if (src_size < 0 || src_size > size)
    fail_here("cp.async (%s:%d): src-size %d outside [0, %d]", file, line, src_size, size);
#if defined(CUFLASH_SIMT_ASAN)
  // Check both ranges now, so that an out-of-bounds copy (or one into another copy's window) is reported at the
  // line that issues it.
  if (void* bad = __asan_region_is_poisoned(const_cast<void*>(src), (size_t)src_size)) __asan_report_load_n(bad, 1);
  if (void* bad = __asan_region_is_poisoned(dst, (size_t)size)) __asan_report_store_n(bad, 1);
#endif
#if defined(CUFLASH_SIMT_PROFILE)
  prof_cp_async(dst, src, size, src_size, file, line);
#endif
  CpLand land = LAND_AT_WAIT;
  if (b.launch->order == Order::random) land = (CpLand)(splitmix64(b.cp_rng) % 3);
  CpAsync c{dst, src, size, src_size, f->cp_committed, file, line, __builtin_return_address(0), nullptr, land,
            false};
#if defined(CUFLASH_SIMT_RACE)
  c.issued = std::malloc(1);  // fresh per copy: it carries this thread's clock at this issue, nothing later
  __tsan_release(c.issued);
#endif
  if (land == LAND_AT_ISSUE) cp_bytes(c, true);
  else cp_poison(c, true);
  f->cp_queue.push_back(c);
}
inline void cp_async_commit() {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  tl.fiber->cp_committed++;
}
// Seeded schedules: the copies drawn to land at the issuing thread's next barrier land as it arrives there.
inline void cp_async_at_barrier(Fiber* f) {
  for (CpAsync& c : f->cp_queue)
    if (c.land == LAND_AT_BARRIER && !c.landed) cp_bytes(c, true);
}
// Land every copy committed in a group older than the `pending` most recent ones.
inline void cp_async_wait(int pending) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  std::vector<CpAsync>& q = f->cp_queue;
  // Groups complete in order: the covered copies are a prefix of the queue (it is in issue order).
  size_t n = 0;
  while (n < q.size() && (long long)q[n].group < (long long)f->cp_committed - pending) n++;
  if (!n) return;
  for (size_t i = 0; i < n; i++) {
    if (!q[i].landed) cp_bytes(q[i], false);
    else cp_poison(q[i], false);
  }
#if defined(CUFLASH_SIMT_RACE)
  race_copy_writes(f, q.data(), n);
#endif
  q.erase(q.begin(), q.begin() + (long)n);
}

// memcheck: ASan's report names the access and its line; this adds the CUDA thread, and for an address in a
// copy's window, the cp.async that opened it.
#if defined(CUFLASH_SIMT_ASAN)
inline void asan_context(const char* report) {
  Fiber* f = tl.fiber;
  if (!f || !f->block || !tl.launch) return;
  const Block& b = *f->block;
  char msg[1024];
  int n = snprintf(msg, sizeof msg, "cuflash.simt: in kernel '%s', block (%u,%u,%u), thread (%u,%u,%u) [linear %u, "
                   "warp %u, lane %u]\n", b.launch->kernel, b.idx.x, b.idx.y, b.idx.z, f->tid.x, f->tid.y, f->tid.z,
                   f->linear, f->linear / 32, f->lane);
  const char* at = report ? std::strstr(report, " on address ") : nullptr;
  uintptr_t a = 0;
  if (at && sscanf(at, " on address %lx", &a) == 1)
    for (const Fiber& o : b.fibers)
      for (const CpAsync& c : o.cp_queue)
        if (a >= (uintptr_t)c.dst && a < (uintptr_t)c.dst + (uintptr_t)c.size && n > 0 && n < (int)sizeof msg)
          n += snprintf(msg + n, sizeof msg - (size_t)n, "cuflash.simt: the address is in the destination of a "
                        "cp.async that thread (%u,%u,%u) issued at %s:%d and no cp_async_wait has covered yet: "
                        "its bytes may land at any moment until then\n", o.tid.x, o.tid.y, o.tid.z, c.file, c.line);
  if (n > (int)sizeof msg - 1) n = (int)sizeof msg - 1;
  if (n > 0 && write(2, msg, (size_t)n) < 0) {}
}
#endif

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_CP_ASYNC_H
