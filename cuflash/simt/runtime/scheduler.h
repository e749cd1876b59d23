// scheduler.h: the scheduler.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_SCHEDULER_H
#define CUFLASH_SIMT_RUNTIME_SCHEDULER_H

namespace cuflash_simt {

// ------------------------------------------------------------------------------------------------
// 9. The scheduler: runs one block's fibers until all exit, one fails, or none can move (deadlock).
// ------------------------------------------------------------------------------------------------
[[noreturn]] __attribute__((noinline, cold)) void exit_misuse(Fiber* f);
inline void thread_exit(Fiber* f) {
  Block& b = *f->block;
  f->state = DONE;
  cp_drop_all(*f);
  b.done++;
  Warp& w = my_warp(f);
  w.exited |= 1u << f->lane;
  if (b.at_barrier || w.arrived) exit_misuse(f);
  switch_away(f, true);
  std::abort();  // an exited fiber is never resumed
}

// A thread exits while others wait for it at a barrier or at a warp collective whose mask names it.
[[noreturn]] __attribute__((noinline, cold)) void exit_misuse(Fiber* f) {
  Block& b = *f->block;
  Warp& w = my_warp(f);
  if (b.at_barrier)
    fail_fiber(where(b) + format(": thread %u exits while threads %s wait at __syncthreads() (%s:%d); every "
                                 "thread of the block must reach each barrier",
                                 f->linear, ranges(fibers_where(b, AT_BARRIER)).c_str(), b.barrier_file,
                                 b.barrier_line));
  for (unsigned l = 0; l < 32; l++) {
    if (!((w.arrived >> l) & 1) || !((w.lane[l].mask >> f->lane) & 1)) continue;
    std::vector<unsigned> waiting;
    for (unsigned k = 0; k < 32; k++)
      if (((w.arrived >> k) & 1) && w.lane[k].op == w.lane[l].op) waiting.push_back(k);
    fail_fiber(where(b) + format(": warp %u: lanes %s wait at %s (%s:%d, mask 0x%08x) but lane %u, named in the "
                                 "mask, exits without reaching it",
                                 f->linear / 32, ranges(waiting).c_str(), w.lane[l].op->name, w.lane[l].file,
                                 w.lane[l].line, w.lane[l].mask, f->lane));
  }
  switch_away(f, true);  // the waiting lanes' masks do not name this one
  std::abort();
}

inline void fiber_main(void* arg) {
  Fiber* f = (Fiber*)arg;
  const void* from_bottom = nullptr;
  size_t from_size = 0;
  asan_landed(nullptr, &from_bottom, &from_size);
  if (!tl.sched_stack_known) {  // the first fiber of a worker starts from the scheduler's stack
    tl.sched_stack_bottom = from_bottom;
    tl.sched_stack_size = from_size;
    tl.sched_stack_known = true;
  }
  Launch& L = *f->block->launch;
#if defined(CUFLASH_SIMT_RACE)
  race_ignore_end();  // created with its count at 1: from here on, the kernel's accesses are checked
#elif defined(CUFLASH_SIMT_PROFILE)
  f->prof_ignores = 0;  // from here on, the kernel's accesses are recorded
#endif
  try {
    L.entry(L.args);
#if defined(CUFLASH_SIMT_RACE)
    race_ignore_begin();
#elif defined(CUFLASH_SIMT_PROFILE)
    f->prof_ignores = 1;
#endif
  } catch (const std::exception& e) {
    fail_here("a C++ exception escaped the kernel: %s", e.what());
  } catch (...) {
    fail_here("a C++ exception escaped the kernel");
  }
  thread_exit(f);
}

inline std::string deadlock_report(const Block& b) {
  std::string s = where(b) + ": no thread can move (deadlock).";
  std::vector<unsigned> bar = fibers_where(b, AT_BARRIER), gone = fibers_where(b, DONE);
  if (!bar.empty())
    s += format(" Threads %s wait at __syncthreads() (%s:%d).", ranges(bar).c_str(), b.barrier_file,
                b.barrier_line);
  for (size_t wi = 0; wi < b.warps.size(); wi++) {
    const Warp& w = b.warps[wi];
    for (unsigned l = 0; l < 32; l++) {
      if (!((w.arrived >> l) & 1)) continue;
      const Arrival& a = w.lane[l];
      bool first = true;  // report each (op, call site, mask) group once, at its lowest lane
      for (unsigned k = 0; k < l; k++)
        if (((w.arrived >> k) & 1) && w.lane[k].op == a.op &&
            same_site(w.lane[k].file, w.lane[k].line, a.file, a.line) && w.lane[k].mask == a.mask)
          first = false;
      if (!first) continue;
      std::vector<unsigned> here, missing;
      for (unsigned k = 0; k < 32; k++) {
        bool same = ((w.arrived >> k) & 1) && w.lane[k].op == a.op &&
                    same_site(w.lane[k].file, w.lane[k].line, a.file, a.line) && w.lane[k].mask == a.mask;
        if (same) here.push_back(k);
        else if ((a.mask >> k) & 1) missing.push_back(k);
      }
      s += format(" Warp %zu: lanes %s wait at %s (%s:%d, mask 0x%08x) for lanes %s, which never reach it.",
                  wi, ranges(here).c_str(), a.op->name, a.file, a.line, a.mask, ranges(missing).c_str());
    }
  }
  if (!gone.empty()) s += format(" Threads %s have exited.", ranges(gone).c_str());
  return s;
}

struct StackSet {
  size_t stack_size = 0;
  std::vector<Stack> stacks;
};
inline std::mutex& pool_mutex() { static std::mutex m; return m; }
inline std::vector<StackSet*>& pool() { static std::vector<StackSet*> p; return p; }
inline StackSet* acquire_stacks(size_t stack_size) {
  std::lock_guard<std::mutex> g(pool_mutex());
  auto& p = pool();
  for (size_t i = 0; i < p.size(); i++)
    if (p[i]->stack_size == stack_size) {
      StackSet* s = p[i];
      p.erase(p.begin() + (long)i);
      return s;
    }
  StackSet* s = new StackSet;
  s->stack_size = stack_size;
  return s;
}
inline void release_stacks(StackSet* s) {
  std::lock_guard<std::mutex> g(pool_mutex());
  pool().push_back(s);
}
// Unmaps the stacks no launch of this module is using. Every module (one .so) keeps its own pool, two memory
// mappings per stack (guard and stack): a process that loads hundreds of modules would run out of mappings
// (vm.max_map_count), so the Python side calls this for the modules it has not launched lately.
inline void unmap_idle_stacks() {
  std::lock_guard<std::mutex> g(pool_mutex());
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t guard = (kStackGuard + page - 1) / page * page;
  for (StackSet* set : pool()) {
    for (Stack& st : set->stacks) munmap(st.lo - guard, st.size + guard);
    delete set;
  }
  pool().clear();
}

// A fiber that runs into its stack's guard page gets a message saying so before the process dies (there is
// no safe way back into Python from there). Other faults go on to whoever handled SIGSEGV before us (Python's
// faulthandler under pytest). AddressSanitizer reports stack overflows itself.
inline struct sigaction& previous_segv() { static struct sigaction a; return a; }
inline void on_segv(int sig, siginfo_t* info, void* ctx) {
  Worker& w = tl;
  uintptr_t a = (uintptr_t)info->si_addr;
  if (w.launch && w.stacks)
    for (const Stack& st : w.stacks->stacks)
      if (a >= (uintptr_t)st.lo - kStackGuard && a < (uintptr_t)st.lo) {
        char msg[512];
        int n = snprintf(msg, sizeof msg, "cuflash.simt: kernel '%s' overflowed its %zu-byte stack per CUDA thread "
                         "(large local arrays?); pass a bigger stack_size= to RawModule\n", w.launch->kernel,
                         st.size);
        if (write(2, msg, (size_t)n) < 0) {}
        break;
      }
  sigaction(SIGSEGV, &previous_segv(), nullptr);  // the faulting access repeats under the previous handler
  (void)sig; (void)ctx;
}
inline void install_overflow_handler() {
#if !defined(CUFLASH_SIMT_ASAN)
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction a;
    std::memset(&a, 0, sizeof a);
    a.sa_sigaction = on_segv;
    a.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&a.sa_mask);
    sigaction(SIGSEGV, &a, &previous_segv());
  });
#endif
}

#if defined(CUFLASH_SIMT_RACE)
// A later block's report names the earlier access's thread and stack only while that thread's TSan fiber
// lives (TSan reuses a dead one's record), so finished blocks' fibers live on, up to this many, until the
// launch ends; older ones go first.
constexpr size_t kRaceKeptFibers = 4096;
inline void race_retire(Launch& L, size_t keep) {
  while (L.race_retired.size() > keep) {
    __tsan_destroy_fiber(L.race_retired.front());
    L.race_retired.pop_front();
  }
}
#endif

inline void run_block(Block& b, StackSet& stacks) {
  Launch& L = *b.launch;
  unsigned n = L.nthreads;
  b.failed = false;
  b.error.clear();
  b.at_barrier = b.done = 0;
  b.head = b.count = 0;
  b.statics.clear();
  b.static_bytes = 0;
  b.rng = L.seed ^ (0x9e3779b97f4a7c15ull * (b.linear + 1));
  b.cp_rng = ~L.seed ^ (0xc2b2ae3d27d4eb4full * (b.linear + 1));
  for (Warp& w : b.warps) {
    w.arrived = w.exited = 0;
  }
  if (b.dyn && L.dyn_bytes) std::memset(b.dyn, 0xff, L.dyn_bytes);  // poison: NaN for floating types
#if defined(CUFLASH_SIMT_RACE)
  if (b.dyn) race_fresh(b.dyn, L.dyn_bytes);  // each block's own on a GPU (static __shared__: shared_fresh)
#endif
  for (unsigned i = 0; i < n; i++) {
    Fiber& f = b.fibers[i];
    Stack& st = stacks.stacks[i];
#if defined(CUFLASH_SIMT_ASAN)
    // Frames that never returned (the previous fiber's fiber_main and exit path, or all of an abandoned
    // fiber's frames) leave poison in the stack's shadow, and the next fiber's frames do not all rewrite
    // it (Context::init's stores and compiler temporaries would trip over it): clear it first.
    char* top = st.lo + st.size;
    char* from = st.poison_lo && st.poison_lo >= st.lo && st.poison_lo < top ? st.poison_lo : st.lo;
    __asan_unpoison_memory_region(from, (size_t)(top - from));
    st.poison_lo = top;
#endif
    f.block = &b;
#if defined(CUFLASH_SIMT_PROFILE)
    f.prof_ignores = 1;
#endif
    f.linear = i;
    f.lane = i % 32;
    f.tid = uint3{i % L.block.x, (i / L.block.x) % L.block.y, i / (L.block.x * L.block.y)};
    cp_drop_all(f);
    f.cp_committed = 0;
    f.fake_stack = nullptr;
    f.stack_lo = st.lo;
    f.stack_size = st.size;
    // Stagger the stack tops so that the fibers' hot frames do not all map to the same cache sets.
    size_t stagger = (size_t)i * 448 % 4096;
    f.ctx.init(st.lo, st.size - stagger, &fiber_main, &f);
#if defined(CUFLASH_SIMT_RACE)
    // A fresh TSan fiber per CUDA thread and block, ordered after what the caller did before the launch
    // (creation synchronizes; the caller acquires no block's end before the launch's), entered with its
    // accesses ignored (see fiber_main). Its stack held another block's frames: fresh for this one.
    race_fresh(st.lo, st.size);
    f.tsan = __tsan_create_fiber(0);
    // Block first, kernel last: TSan keeps 63 characters of a name, and the report's frames name the kernel.
    __tsan_set_fiber_name(f.tsan, format("block (%u,%u,%u) thread (%u,%u,%u) of %s", b.idx.x, b.idx.y,
                                         b.idx.z, f.tid.x, f.tid.y, f.tid.z, L.kernel).c_str());
    race_switch(f.tsan);
    __tsan_ignore_thread_begin();
    f.tsan_ignores = 1;
    race_switch(tl.tsan_sched);
#endif
  }
#if defined(CUFLASH_SIMT_PROFILE)
  prof_block_begin(b);
#endif
  release_all(b);
  // Fibers switch among themselves; control comes back here when none is ready or the block failed.
  while (!b.failed) {
    if (b.count == 0) {
      if (b.done != n) {
        b.failed = true;
        b.error = deadlock_report(b);
      }
      break;
    }
    Fiber& f = b.fibers[pick_ready(b)];
    f.state = RUNNING;
    tl.fiber = &f;
    void* fake = nullptr;
#if defined(CUFLASH_SIMT_RACE)
    race_switch(f.tsan);
#endif
    asan_enter(&fake, f.stack_lo, f.stack_size);
    switch_context(tl.sched, f.ctx);
    asan_landed(fake, nullptr, nullptr);
  }
  // Copies that no wait covered (a failed block's): their windows close, so that no poison outlives the block
  // on shared memory the next block or launch reuses.
  for (Fiber& f : b.fibers) cp_drop_all(f);
#if defined(CUFLASH_SIMT_PROFILE)
  tl.fiber = nullptr;  // the counting below is the runtime's
  prof_block_end(b);
#endif
#if defined(CUFLASH_SIMT_ASAN)
  // Every fiber's call chain at its last switch (exited or abandoned) lies above its saved stack pointer;
  // frames below it returned and cleared their own shadow. 256 bytes cover the x86-64 red zone.
  for (unsigned i = 0; i < n; i++) {
    Stack& st = stacks.stacks[i];
    char* sp = saved_sp(b.fibers[i].ctx);
    char* lo = sp && sp - 256 > st.lo ? sp - 256 : st.lo;
    if (lo < st.poison_lo) st.poison_lo = lo;
  }
#endif
#if defined(CUFLASH_SIMT_RACE)
  // Whatever the block's threads did (exited or abandoned by a failure) is ordered before the launch's return
  // (launch() acquires race_end), but not before the next block: blocks of a launch may run in any order or
  // at once on a GPU, so two of them touching the same global bytes (not through atomics) is a race.
  void* sched = tl.tsan_sched;
  for (Fiber& f : b.fibers) {
    int ignores = f.tsan_ignores;  // 1, more if it failed inside the runtime; TSan destroys no fiber that ignores
    f.tsan_ignores = 0;
    race_switch(f.tsan);
    while (ignores-- > 0) __tsan_ignore_thread_end();
    __tsan_release(L.race_end);  // after the ignores end, so that it also covers this fiber's reads just above
    race_switch(sched);
    L.race_retired.push_back(f.tsan);
    f.tsan = nullptr;
    // The copy fiber and its landing object are the block's too: kept across blocks, their clocks would carry
    // this block's issues into the next block's threads at their first wait (an order no GPU gives).
    if (f.tsan_copy) L.race_retired.push_back(f.tsan_copy);
    f.tsan_copy = nullptr;
    std::free(f.tsan_landed);
    f.tsan_landed = nullptr;
    f.copy_named = ~0ull;
  }
  race_retire(L, kRaceKeptFibers);
  race_drop(b.bar_sync);  // episodes a failure left open
  for (Warp& w : b.warps)
    for (unsigned l = 0; l < 32; l++) {
      void* s = w.lane[l].sync;
      if (!s) continue;
      for (Warp& v : b.warps)
        for (Arrival& a : v.lane)
          if (a.sync == s) a.sync = nullptr;
      std::free(s);
    }
#endif
  tl.fiber = nullptr;
}

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_SCHEDULER_H
