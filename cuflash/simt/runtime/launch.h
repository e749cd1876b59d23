// launch.h: launch.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_LAUNCH_H
#define CUFLASH_SIMT_RUNTIME_LAUNCH_H

namespace cuflash_simt {

// ------------------------------------------------------------------------------------------------
// 10. Launch: workers take blocks from a shared counter; the first failure stops them all.
// ------------------------------------------------------------------------------------------------
inline void record_failure(Launch& L, const std::string& msg) {
  std::lock_guard<std::mutex> g(L.mu);
  if (!L.failed.exchange(true)) L.error = msg;
}

inline void run_worker(Launch& L) {
  unsigned n = L.nthreads;
  StackSet* stacks = acquire_stacks(L.stack_size);
  while (stacks->stacks.size() < n) {
    Stack s = map_stack(L.stack_size);
    if (!s.lo) {
      record_failure(L, format("kernel '%s': cannot map %u fiber stacks of %zu bytes", L.kernel, n, L.stack_size));
      release_stacks(stacks);
      return;
    }
    stacks->stacks.push_back(s);
  }
  // The overflow handler needs a stack of its own: the faulting one is full.
  std::vector<char> alt_mem(64 * 1024);
  stack_t alt{}, old_alt{};
  alt.ss_sp = alt_mem.data();
  alt.ss_size = alt_mem.size();
  sigaltstack(&alt, &old_alt);
  tl.stacks = stacks;
  Block b;
  b.launch = &L;
  b.fibers.resize(n);
  b.ready.resize(n);
  b.warps.resize((n + 31) / 32);
  for (size_t w = 0; w < b.warps.size(); w++) {
    unsigned lanes = n - 32 * (unsigned)w < 32 ? n - 32 * (unsigned)w : 32;
    b.warps[w].present = lanes == 32 ? ~0u : (1u << lanes) - 1;
  }
  // Dynamic shared memory: exactly the launch's size, so AddressSanitizer sees any overrun.
  void* dyn = nullptr;
  if (posix_memalign(&dyn, 128, L.dyn_bytes ? L.dyn_bytes : 1)) dyn = nullptr;
  b.dyn = (char*)dyn;
  tl.launch = &L;
  tl.block = &b;
#if defined(CUFLASH_SIMT_RACE)
  tl.tsan_sched = __tsan_get_current_fiber();
#endif
  unsigned saved_mxcsr = get_mxcsr();
#if defined(CUFLASH_SIMT_FTZ)
  set_mxcsr(saved_mxcsr | 0x8040);  // flush denormal results and inputs to zero, like CuPy's -ftz=true
#endif
  while (!L.failed.load(std::memory_order_relaxed)) {
    unsigned long long id = L.next.fetch_add(1);
    if (id >= L.nblocks) break;
    b.linear = id;
    b.idx = uint3{(unsigned)(id % L.grid.x), (unsigned)(id / L.grid.x % L.grid.y),
                  (unsigned)(id / ((unsigned long long)L.grid.x * L.grid.y))};
    run_block(b, *stacks);
    if (b.failed) {
      record_failure(L, b.error);
      break;
    }
  }
  set_mxcsr(saved_mxcsr);
#if defined(CUFLASH_SIMT_PROFILE)
  prof_worker_end(b);
#endif
  tl = Worker{};
  sigaltstack(&old_alt, nullptr);
  std::free(dyn);
  release_stacks(stacks);
}

struct KernelEntry {
  const char* name;
  void (*entry)(void**);
  const char* (*signature)();
};

inline int launch(const KernelEntry& k, void** args, const unsigned* grid, const unsigned* block,
                  unsigned long long dyn_bytes, unsigned long long smem_limit, int order,
                  unsigned long long seed, int workers, unsigned long long stack_size, char* err,
                  unsigned long long errlen) {
#if defined(CUFLASH_SIMT_RACE)
  CUFLASH_SIMT_RUNTIME_SCOPE;  // the caller's thread schedules; its bookkeeping is not the kernel's
#endif
  Launch L;
  L.kernel = k.name;
  L.entry = k.entry;
  L.args = args;
  L.grid = dim3(grid[0], grid[1], grid[2]);
  L.block = dim3(block[0], block[1], block[2]);
  L.nthreads = block[0] * block[1] * block[2];
  L.nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
  L.dyn_bytes = dyn_bytes;
  L.smem_limit = smem_limit;
  L.order = (Order)order;
  L.seed = seed;
  L.stack_size = stack_size;
#if defined(CUFLASH_SIMT_MEMCHECK) || defined(CUFLASH_SIMT_RACE)
  workers = 1;  // static __shared__ arrays are plain statics in this build (and TSan's fibers are per thread)
#endif
#if defined(CUFLASH_SIMT_RACE)
  L.race_end = std::malloc(1);
#endif
#if defined(CUFLASH_SIMT_PROFILE)
  ProfLaunch profile;
  prof_launch_begin(L, profile);
#endif
  install_overflow_handler();
#if defined(CUFLASH_SIMT_ASAN)
  __asan_set_error_report_callback(asan_context);  // one callback per process: the launching module's
#endif
  unsigned long long nw = workers < 1 ? 1 : (unsigned long long)workers;
  if (nw > L.nblocks) nw = L.nblocks;
  std::vector<std::thread> pool;
  for (unsigned long long i = 1; i < nw; i++) pool.emplace_back(run_worker, std::ref(L));
  run_worker(L);  // the calling thread is a worker too
  for (std::thread& t : pool) t.join();
#if defined(CUFLASH_SIMT_RACE)
  __tsan_acquire(L.race_end);  // the host reads the outputs after every block
  race_drop(L.race_end);
  race_retire(L, 0);
#endif
#if defined(CUFLASH_SIMT_PROFILE)
  prof_launch_end(profile);
#endif
  if (!L.failed) return 0;
  std::snprintf(err, (size_t)errlen, "%s", L.error.c_str());
  return 1;
}

// ---- kernel parameters: the generated entries unpack CUDA-style `void** args` ----
template <class... P, size_t... I>
inline void invoke_with(void (*f)(P...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}
template <class... P> inline void invoke(void (*f)(P...), void** args) {
  invoke_with(f, args, std::index_sequence_for<P...>{});
}

// Type codes the Python side checks arguments against: i4 = 4-byte signed integer, f2 = __half,
// bf2 = __nv_bfloat16, s16 = a 16-byte struct by value, p<code> = pointer (p* = any array).
template <class U> inline std::string scalar_code() {
  if constexpr (std::is_same<U, bool>::value) return "b1";
  else if constexpr (std::is_same<U, __half>::value) return "f2";
  else if constexpr (std::is_same<U, __nv_bfloat16>::value) return "bf2";
  else if constexpr (std::is_floating_point<U>::value) return "f" + std::to_string(sizeof(U));
  else if constexpr (std::is_enum<U>::value) return scalar_code<std::underlying_type_t<U>>();
  else if constexpr (std::is_integral<U>::value)
    return std::string(std::is_signed<U>::value ? "i" : "u") + std::to_string(sizeof(U));
  else return "s" + std::to_string(sizeof(U));
}
template <class T> inline std::string type_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer<U>::value) {
    using E = std::remove_cv_t<std::remove_pointer_t<U>>;
    constexpr bool any = std::is_void<E>::value || std::is_pointer<E>::value || sizeof(E) == 1 ||
                         !(std::is_arithmetic<E>::value || std::is_same<E, __half>::value ||
                           std::is_same<E, __nv_bfloat16>::value);
    if constexpr (any) return "p*";
    else return "p" + scalar_code<E>();
  } else {
    return scalar_code<U>();
  }
}
template <class... P> inline const char* signature_of(void (*)(P...)) {
  static const std::string s = [] {
    std::string r;
    for (const std::string& c : {std::string(), type_code<P>()...})
      if (!c.empty()) r += (r.empty() ? "" : ",") + c;
    return r;
  }();
  return s.c_str();
}

}  // namespace cuflash_simt

// Profile mode: Python names the launch's argument arrays (global memory) before it, reads its rows after it.
#if defined(CUFLASH_SIMT_PROFILE)
#define CUFLASH_SIMT_PROFILE_EXPORTS                                                                   \
  extern "C" __attribute__((visibility("default"))) void cuflash_simt_profile_arrays(                  \
      const unsigned long long* lohi, int n) {                                                         \
    auto& v = ::cuflash_simt::prof_pending_arrays();                                                   \
    v.clear();                                                                                         \
    for (int i = 0; i < n; i++) v.emplace_back((uintptr_t)lohi[2 * i], (uintptr_t)lohi[2 * i + 1]);    \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) int cuflash_simt_profile_rows(                     \
      ::cuflash_simt::ProfRow* out, int max) {                                                         \
    const auto& rows = ::cuflash_simt::prof_last();                                                    \
    for (int i = 0; i < max && i < (int)rows.size(); i++) {                                           \
      const auto& s = rows[(size_t)i].first;                                                           \
      const auto& c = rows[(size_t)i].second;                                                          \
      out[i] = {::cuflash_simt::prof_offset(s.pc), s.file, s.line, s.kind, s.space, c.requests,         \
                c.wavefronts, c.ideal, c.sectors, c.bytes, c.barriers, c.warps};                       \
    }                                                                                                  \
    return (int)rows.size();                                                                           \
  }
#else
#define CUFLASH_SIMT_PROFILE_EXPORTS
#endif

// The C interface Python calls through ctypes, over the generated table of kernels.
#define CUFLASH_SIMT_EXPORT_TABLE(table)                                                               \
  extern "C" __attribute__((visibility("default"))) int cuflash_simt_count() {                         \
    return (int)(sizeof(table) / sizeof(table[0]));                                                    \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) const char* cuflash_simt_name(int i) {             \
    return table[i].name;                                                                              \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) const char* cuflash_simt_signature(int i) {        \
    return table[i].signature();                                                                       \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) void cuflash_simt_unmap_idle_stacks() {            \
    ::cuflash_simt::unmap_idle_stacks();                                                               \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) int cuflash_simt_launch(                           \
      int i, void** args, const unsigned* grid, const unsigned* block, unsigned long long dyn,         \
      unsigned long long limit, int order, unsigned long long seed, int workers,                       \
      unsigned long long stack, char* err, unsigned long long errlen) {                                \
    return ::cuflash_simt::launch(table[i], args, grid, block, dyn, limit, order, seed, workers, stack, \
                                  err, errlen);                                                        \
  }                                                                                                    \
  CUFLASH_SIMT_PROFILE_EXPORTS

#endif  // CUFLASH_SIMT_RUNTIME_LAUNCH_H
