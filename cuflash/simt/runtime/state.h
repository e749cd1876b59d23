// state.h: launch, block and fiber state; messages; the ready queue.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_STATE_H
#define CUFLASH_SIMT_RUNTIME_STATE_H

namespace cuflash_simt {

// ------------------------------------------------------------------------------------------------
// 7. Launch, block and fiber state.
// ------------------------------------------------------------------------------------------------
enum class Order : int { forward = 0, reverse = 1, random = 2 };
enum FiberState : uint8_t { READY, RUNNING, AT_BARRIER, AT_WARP, DONE };

struct Block;
struct Launch;

// A warp collective: each lane deposits a pointer to its own operands; the last lane to arrive runs
// `run` over all of them (entries for lanes outside the mask are null).
struct Collective {
  const char* name;
  void (*run)(void* const* lanes, unsigned mask);
};
struct Arrival {
  const Collective* op = nullptr;
  unsigned mask = 0;
  const char* file = "";  // the call site, for messages
  int line = 0;
  void* data = nullptr;
  void* sync = nullptr;  // race mode: this collective's happens-before object, shared by its lanes
};
struct Warp {
  Arrival lane[32];
  unsigned arrived = 0;  // lanes waiting at a collective
  unsigned exited = 0;   // lanes that have returned
  unsigned present = 0;  // lanes that exist (a block's last warp may be partial)
};

// Where a copy's bytes land in a seeded schedule (any moment from issue to the covering wait is legal).
enum CpLand : uint8_t { LAND_AT_ISSUE, LAND_AT_BARRIER, LAND_AT_WAIT };
struct CpAsync {
  void* dst;
  const void* src;
  int size, src_size;
  unsigned group;
  const char* file;  // the issuing call, for messages
  int line;
  void* pc;          // race mode: where it was issued, for the report's stack
  void* issued;      // race mode: released at issue, acquired by the copy
  CpLand land;
  bool landed;
};

struct Fiber {
  Context ctx;
  Block* block = nullptr;
  uint3 tid{0, 0, 0};
  unsigned linear = 0, lane = 0;
  FiberState state = READY;
  const char* file = "";  // where it waits
  int line = 0;
  const char* what = "";
  std::vector<CpAsync> cp_queue;
  unsigned cp_committed = 0;  // cp.async groups committed so far
  char* stack_lo = nullptr;
  size_t stack_size = 0;
  void* fake_stack = nullptr;
  void* tsan = nullptr;  // race mode: ThreadSanitizer's fiber for this CUDA thread (one per block)
  void* tsan_copy = nullptr;    // race mode: the fiber its cp.async copies write from (one per launch)
  void* tsan_landed = nullptr;  // race mode: the copy fiber releases it, the thread acquires it at the wait
  unsigned long long copy_named = ~0ull;  // the block the copy fiber's name was last set for
  int tsan_ignores = 0;  // its ignore count (TSan refuses to destroy a fiber whose count is not 0)
#if defined(CUFLASH_SIMT_PROFILE)
  int prof_ignores = 1;  // profile mode: 0 only while it runs kernel code (whose accesses are recorded)
#endif
};

struct Launch {
  const char* kernel = "";
  void (*entry)(void**) = nullptr;
  void** args = nullptr;
  dim3 grid, block;
  unsigned nthreads = 0;
  unsigned long long nblocks = 0;
  size_t dyn_bytes = 0, smem_limit = 0, stack_size = 0;
  Order order = Order::forward;
  uint64_t seed = 0;
  std::atomic<unsigned long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  void* race_end = nullptr;  // race mode: every fiber releases it at block end; the launch acquires it last
  std::deque<void*> race_retired;  // race mode: finished blocks' TSan fibers, oldest first (see race_retire)
  void* prof = nullptr;  // profile mode: the launch's counts (ProfLaunch)
};

struct Block {
  Launch* launch = nullptr;
  uint3 idx{0, 0, 0};
  unsigned long long linear = 0;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned> ready;  // ring buffer of fiber indices
  size_t head = 0, count = 0;
  unsigned at_barrier = 0, done = 0;
  const char* barrier_file = "";  // the open barrier's call site
  int barrier_line = 0;
  int bar_votes = 0, bar_result = 0;  // __syncthreads_count/and/or
  uint64_t rng = 0;
  uint64_t cp_rng = 0;  // seeded schedules: where cp.async copies land (apart from rng: the order stays as it was)
  char* dyn = nullptr;
  std::vector<std::pair<const void*, size_t>> statics;  // static __shared__ arrays seen this block
  size_t static_bytes = 0;
  bool failed = false;
  std::string error;
  void* bar_sync = nullptr;  // race mode: the open barrier's happens-before object
  void* prof = nullptr;  // profile mode: the block's open requests (ProfBlock)
};

struct StackSet;

// What the OS thread running a block knows; fibers read it through threadIdx & co.
struct Worker {
  Launch* launch = nullptr;
  StackSet* stacks = nullptr;
  Block* block = nullptr;
  Fiber* fiber = nullptr;
  Context sched;
  const void* sched_stack_bottom = nullptr;  // the OS thread's stack, for AddressSanitizer
  size_t sched_stack_size = 0;
  bool sched_stack_known = false;
  void* tsan_sched = nullptr;  // race mode: ThreadSanitizer's thread of the scheduler (the caller's)
};
inline thread_local Worker tl;

// ---- race mode: ThreadSanitizer checks the kernel's own accesses, nothing else ----
// The runtime's bookkeeping (queues, barrier counters, fiber state), which every fiber touches, runs with the
// fiber's accesses ignored; a fiber is always inside the runtime when it is switched out, so its ignore count
// is 1 except while it runs kernel code. Happens-before comes only from what CUDA orders: barriers, warp
// collectives, atomics (TSan's own), a fiber's creation (after the host wrote the inputs, never after another
// block of the launch) and the launch's end (after every block).
#if defined(CUFLASH_SIMT_RACE)
inline void race_ignore_begin() {  // count after ignoring, uncount before ending: the counter is bookkeeping too
  __tsan_ignore_thread_begin();
  if (tl.fiber) tl.fiber->tsan_ignores++;
}
inline void race_ignore_end() {
  if (tl.fiber) tl.fiber->tsan_ignores--;
  __tsan_ignore_thread_end();
}
struct RaceRuntimeScope {
  RaceRuntimeScope() { race_ignore_begin(); }
  ~RaceRuntimeScope() { race_ignore_end(); }
};
#define CUFLASH_SIMT_RUNTIME_SCOPE ::cuflash_simt::RaceRuntimeScope cuflash_simt_runtime_scope_
// TSan's notion of the running thread follows every stack switch, with no happens-before of its own
// (flag 1 = __tsan_switch_to_fiber_no_sync): the emulator's switch order is not an ordering CUDA promises.
inline void race_switch(void* fiber) { __tsan_switch_to_fiber(fiber, 1); }
// One fresh heap object per barrier or collective episode: free() drops its clock, so no episode inherits
// another's (acquiring a reused object would order threads that CUDA leaves unordered).
inline void race_arrive(void*& sync) {
  if (!sync) sync = std::malloc(1);
  __tsan_release(sync);
}
inline void race_drop(void*& sync) {
  std::free(sync);
  sync = nullptr;
}
// Memory that each block has to itself on a GPU but the emulator reuses from block to block (shared memory,
// fiber stacks): forget its past accesses, so that the next block's use does not race with the last one's.
// Blocks of a launch are not ordered (that is what finds races between blocks), so only this reset can tell
// TSan the memory is fresh. AnnotateNewMemory does nothing; __tsan_java_alloc is TSan's one call that clears
// the shadow of any range (it needs no Java context in this runtime), and __tsan_java_free drops the heap
// block it records, so reports still describe the memory as a global or a stack.
inline void race_fresh(const void* p, size_t n) {
  if (!n) return;
  unsigned long lo = (unsigned long)p & ~7ul, hi = ((unsigned long)p + n + 7) & ~7ul;  // whole shadow cells
  __tsan_java_alloc(lo, hi - lo);
  __tsan_java_free(lo, hi - lo);
}
// A memory access the kernel makes through the runtime (ldmatrix's rows, cp.async's copies): checked.
struct RaceKernelAccess {
  RaceKernelAccess() { race_ignore_end(); }
  ~RaceKernelAccess() { race_ignore_begin(); }
};
#elif defined(CUFLASH_SIMT_PROFILE)
// Profile mode: the runtime's accesses are not the kernel's memory traffic (the hooks skip them while the
// running fiber's count is not 0; a fiber is always inside the runtime when it is switched out).
struct ProfRuntimeScope {
  Fiber* f;
  ProfRuntimeScope() : f(tl.fiber) { if (f) f->prof_ignores++; }
  ~ProfRuntimeScope() { if (f) f->prof_ignores--; }
};
#define CUFLASH_SIMT_RUNTIME_SCOPE ::cuflash_simt::ProfRuntimeScope cuflash_simt_runtime_scope_
#else
#define CUFLASH_SIMT_RUNTIME_SCOPE (void)0
#endif

// ---- messages ----
inline std::string vformat(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}
inline std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}
// "0-31,64,70-71" from a sorted list of thread indices.
inline std::string ranges(const std::vector<unsigned>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) j++;
    if (!s.empty()) s += ",";
    s += j == i ? format("%u", v[i]) : format("%u-%u", v[i], v[j]);
    i = j + 1;
  }
  return s;
}
inline std::string where(const Block& b) {
  return format("kernel '%s', block (%u,%u,%u)", b.launch->kernel, b.idx.x, b.idx.y, b.idx.z);
}
inline std::string thread_name(const Fiber& f) {
  return format("thread (%u,%u,%u) [linear %u, warp %u, lane %u]", f.tid.x, f.tid.y, f.tid.z, f.linear,
                f.linear / 32, f.lane);
}

// ---- sanitizer bookkeeping around stack switches ----
inline void asan_enter(void** fake_save, const void* bottom, size_t size) {
#if defined(CUFLASH_SIMT_ASAN)
  __sanitizer_start_switch_fiber(fake_save, bottom, size);
#else
  (void)fake_save; (void)bottom; (void)size;
#endif
}
inline void asan_landed(void* fake_save, const void** bottom_old, size_t* size_old) {
#if defined(CUFLASH_SIMT_ASAN)
  __sanitizer_finish_switch_fiber(fake_save, bottom_old, size_old);
#else
  (void)fake_save; (void)bottom_old; (void)size_old;
#endif
}

// Switch from the running fiber back to the scheduler; returns if the scheduler ever resumes this fiber.
inline void to_scheduler(Fiber* f, bool exiting = false) {
#if defined(CUFLASH_SIMT_RACE)
  race_switch(tl.tsan_sched);
#endif
  asan_enter(exiting ? nullptr : &f->fake_stack, tl.sched_stack_bottom, tl.sched_stack_size);
  switch_context(f->ctx, tl.sched);
  asan_landed(f->fake_stack, nullptr, nullptr);
}

// End the launch from inside a fiber: record the message and never run this block again.
[[noreturn]] inline void fail_fiber(const std::string& msg) {
  Fiber* f = tl.fiber;
  Block* b = f->block;
  if (!b->failed) {
    b->failed = true;
    b->error = msg;
  }
  to_scheduler(f, true);  // never resumed: let ASan drop its fake stack
  std::abort();  // unreachable: the scheduler never resumes a failed block
}
[[noreturn]] inline void fail_here(const char* fmt, ...) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  va_list ap;
  va_start(ap, fmt);
  std::string what = vformat(fmt, ap);
  va_end(ap);
  Fiber* f = tl.fiber;
  fail_fiber(where(*f->block) + ", " + thread_name(*f) + ": " + what);
}

// ---- the ready queue: a ring of fiber indices; its order is the schedule ----
inline void make_ready(Block& b, unsigned i) {
  b.fibers[i].state = READY;
  size_t at = b.head + b.count;
  if (at >= b.ready.size()) at -= b.ready.size();
  b.ready[at] = i;
  b.count++;
}
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline uint64_t next_random(Block& b) { return splitmix64(b.rng); }
inline unsigned pick_ready(Block& b) {
  size_t n = b.ready.size();
  if (b.launch->order == Order::random && b.count > 1) {
    size_t k = (size_t)(next_random(b) % b.count);
    std::swap(b.ready[b.head], b.ready[(b.head + k) % n]);
  }
  unsigned i = b.ready[b.head];
  if (++b.head == n) b.head = 0;
  b.count--;
  return i;
}
inline void release_all(Block& b) {
  unsigned n = (unsigned)b.fibers.size();
  if (b.launch->order == Order::reverse)
    for (unsigned i = n; i-- > 0;) make_ready(b, i);
  else
    for (unsigned i = 0; i < n; i++) make_ready(b, i);
}

// The running fiber f (its state already set) gives way: straight to the next ready fiber, or back to
// the scheduler when none is ready (all done, a deadlock) or the block failed. Returns when f runs again.
inline void switch_away(Fiber* f, bool exiting = false) {
  Block& b = *f->block;
  if (b.count == 0 || b.failed) return to_scheduler(f, exiting);
  Fiber* next = &b.fibers[pick_ready(b)];
  next->state = RUNNING;
  if (next == f) return;
  tl.fiber = next;
#if defined(CUFLASH_SIMT_RACE)
  race_switch(next->tsan);
#endif
  asan_enter(exiting ? nullptr : &f->fake_stack, next->stack_lo, next->stack_size);
  switch_context(f->ctx, next->ctx);
  asan_landed(f->fake_stack, nullptr, nullptr);
}

// Put the running fiber back in the queue and let the scheduler pick (a scheduling point).
inline void yield() {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  make_ready(*f->block, f->linear);
  switch_away(f);
}

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_STATE_H
