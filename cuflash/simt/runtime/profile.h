// profile.h: profile mode (CUFLASH_SIMT_PROFILE): shared-memory wavefronts, global sectors and barriers per
// instruction, as Nsight Compute counts them per warp-wide request.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
//
// The profile build is compiled with g++'s ThreadSanitizer instrumentation but linked without its runtime: every
// plain load and store of the kernel calls a __tsan_* hook, which this file defines. A hook records the access
// when the running fiber is in kernel code (not in the runtime, see CUFLASH_SIMT_RUNTIME_SCOPE) and the address is
// this block's shared memory or one of the launch's argument arrays (global memory); anything else (the fiber's
// stack, which a GPU keeps in registers, the runtime's own state) is not the kernel's memory traffic. ldmatrix and
// cp.async are recorded by their emulated twins. The k-th execution of one instruction by the lanes of a warp is
// one warp-wide request; requests are closed at every __syncthreads() and at the block's end.
#ifndef CUFLASH_SIMT_RUNTIME_PROFILE_H
#define CUFLASH_SIMT_RUNTIME_PROFILE_H

#if defined(CUFLASH_SIMT_PROFILE)
#include <algorithm>
#include <dlfcn.h>
#include <unordered_map>

namespace cuflash_simt {

enum ProfKind : int { PROF_LOAD, PROF_STORE, PROF_ATOMIC, PROF_LDSM, PROF_CP_ASYNC, PROF_BARRIER };
enum ProfSpace : int { PROF_SHARED, PROF_GLOBAL, PROF_NONE };

// One instruction: its return address in the library (plain accesses, resolved to file:line by the Python side
// from the debug info) or the file:line the runtime was given (ldmatrix, cp.async, barriers).
struct ProfSite {
  uintptr_t pc;
  const char* file;
  int line, kind, space;
  bool operator==(const ProfSite& o) const {
    return pc == o.pc && file == o.file && line == o.line && kind == o.kind && space == o.space;
  }
};
struct ProfSiteHash {
  size_t operator()(const ProfSite& s) const {
    return std::hash<uintptr_t>()(s.pc ^ ((uintptr_t)s.file << 7) ^ ((uintptr_t)s.line << 33) ^
                                  ((uintptr_t)(s.kind * 3 + s.space) << 58));
  }
};
struct ProfStats {
  unsigned long long requests = 0, wavefronts = 0, ideal = 0, sectors = 0, bytes = 0, barriers = 0, warps = 0;
};
// One warp-wide request: the address and size of each lane that took part.
struct ProfRequest {
  unsigned mask = 0;
  uintptr_t addr[32];
  unsigned size[32];
};
// One instruction of one warp in the current barrier interval: how often each lane has run it, its requests.
struct ProfPc {
  unsigned count[32] = {};
  std::vector<ProfRequest> open;
};
struct ProfWarp {
  std::unordered_map<ProfSite, ProfPc, ProfSiteHash> pcs;
};
struct ProfBlock {
  std::vector<ProfWarp> warps;
};
struct ProfLaunch {
  std::vector<std::pair<uintptr_t, uintptr_t>> arrays;  // [lo, hi) of each argument array: global memory
  std::mutex mu;
  std::unordered_map<ProfSite, ProfStats, ProfSiteHash> sites;
};

// The argument arrays the Python side names before a launch, and the last launch's sites, per module.
inline std::vector<std::pair<uintptr_t, uintptr_t>>& prof_pending_arrays() {
  static std::vector<std::pair<uintptr_t, uintptr_t>> v;
  return v;
}
inline std::vector<std::pair<ProfSite, ProfStats>>& prof_last() {
  static std::vector<std::pair<ProfSite, ProfStats>> v;
  return v;
}

// ---- wavefronts and sectors of one request ----
// Shared memory: 32 banks of 4-byte words; the lanes of a request are served in phases of 128 bytes (32 lanes
// of up to 4 bytes, 16 lanes of 8, 8 lanes of 16: Nsight's model for 64- and 128-bit accesses, and for ldmatrix,
// whose 8 row addresses of 16 bytes make one matrix). A phase takes as many wavefronts as the most distinct words
// any one bank holds among its lanes' words (lanes reading the same word share it: a broadcast); ideally one.
inline unsigned prof_phase_lanes(unsigned size) { return size >= 16 ? 8 : size >= 8 ? 16 : 32; }
inline void prof_shared(const ProfRequest& r, ProfStats& s) {
  unsigned widest = 0;
  for (unsigned l = 0; l < 32; l++)
    if ((r.mask >> l) & 1 && r.size[l] > widest) widest = r.size[l];
  unsigned per = prof_phase_lanes(widest);
  std::vector<uintptr_t> words;
  for (unsigned p = 0; p < 32; p += per) {
    words.clear();
    for (unsigned l = p; l < p + per; l++)
      if ((r.mask >> l) & 1)
        for (uintptr_t w = r.addr[l] / 4; w <= (r.addr[l] + r.size[l] - 1) / 4; w++) words.push_back(w);
    if (words.empty()) continue;
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());  // the same word once: a broadcast
    unsigned per_bank[32] = {}, most = 0;
    for (uintptr_t w : words) most = std::max(most, ++per_bank[w % 32]);
    s.wavefronts += most;
    s.ideal += 1;
  }
}
// Global memory: the distinct 32-byte sectors the lanes touch.
inline void prof_global(const ProfRequest& r, ProfStats& s) {
  std::vector<uintptr_t> sectors;
  for (unsigned l = 0; l < 32; l++) {
    if (!((r.mask >> l) & 1)) continue;
    s.bytes += r.size[l];
    for (uintptr_t x = r.addr[l] / 32; x <= (r.addr[l] + r.size[l] - 1) / 32; x++) sectors.push_back(x);
  }
  std::sort(sectors.begin(), sectors.end());
  s.sectors += (unsigned long long)(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
}

// ---- recording ----
inline ProfSite prof_site(uintptr_t pc, const char* file, int line, int kind, int space) {
  return ProfSite{pc, file, line, kind, space};
}
// Lane `lane` of warp `warp` runs the instruction `site` once more: its access joins that execution's request.
inline void prof_record(Block& b, unsigned warp, unsigned lane, const ProfSite& site, uintptr_t addr,
                        unsigned size) {
  ProfPc& pc = ((ProfBlock*)b.prof)->warps[warp].pcs[site];
  unsigned k = pc.count[lane]++;
  if (k >= pc.open.size()) pc.open.resize(k + 1);
  ProfRequest& r = pc.open[k];
  r.mask |= 1u << lane;
  r.addr[lane] = addr;
  r.size[lane] = size;
}
// Close every open request of the block (at a barrier, where all its threads are, and at its end).
inline void prof_flush(Block& b) {
  ProfBlock& pb = *(ProfBlock*)b.prof;
  ProfLaunch& pl = *(ProfLaunch*)b.launch->prof;
  std::lock_guard<std::mutex> g(pl.mu);
  for (ProfWarp& w : pb.warps) {
    for (auto& e : w.pcs) {
      ProfStats& s = pl.sites[e.first];
      for (const ProfRequest& r : e.second.open) {
        if (!r.mask) continue;
        s.requests++;
        if (e.first.space == PROF_SHARED) prof_shared(r, s);
        else prof_global(r, s);
      }
    }
    w.pcs.clear();
  }
}
inline bool prof_in_arrays(const Launch& L, uintptr_t a, size_t n) {
  for (const auto& r : ((ProfLaunch*)L.prof)->arrays)
    if (a >= r.first && a + n <= r.second) return true;
  return false;
}
inline bool in_shared(const Block& b, const void* p, size_t n);
// A plain access of the kernel's (a __tsan_* hook): recorded when it is shared or global memory. Not
// instrumented itself (its own loads would call the hooks again before the count is up).
__attribute__((no_sanitize_thread)) inline void prof_access(const void* p, unsigned size, int kind, uintptr_t pc) {
  Fiber* f = tl.fiber;
  if (!f || f->prof_ignores) return;
  f->prof_ignores++;  // what follows is the runtime's: its own accesses call the hooks too
  Block& b = *f->block;
  uintptr_t a = (uintptr_t)p;
  int space = in_shared(b, p, size) ? PROF_SHARED : prof_in_arrays(*b.launch, a, size) ? PROF_GLOBAL : PROF_NONE;
  if (space != PROF_NONE) prof_record(b, f->linear / 32, f->lane, prof_site(pc, nullptr, 0, kind, space), a, size);
  f->prof_ignores--;
}
// ldmatrix: lane 8j + r names row r of matrix j, 16 bytes; only the lanes of the N matrices count.
inline void prof_ldmatrix(const char* name, const void* row, const char* file, int line) {
  Fiber* f = tl.fiber;
  unsigned matrices = (unsigned)(name[10] - '0');
  if (f->lane < 8 * matrices)
    prof_record(*f->block, f->linear / 32, f->lane, prof_site(0, file, line, PROF_LDSM, PROF_SHARED),
                (uintptr_t)row, 16);
}
// cp.async: a shared-memory store of `size` bytes and a global load of `src_size` (none when it zero-fills).
inline void prof_cp_async(void* dst, const void* src, int size, int src_size, const char* file, int line) {
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  prof_record(b, f->linear / 32, f->lane, prof_site(0, file, line, PROF_CP_ASYNC, PROF_SHARED), (uintptr_t)dst,
              (unsigned)size);
  if (src_size > 0)
    prof_record(b, f->linear / 32, f->lane, prof_site(0, file, line, PROF_CP_ASYNC, PROF_GLOBAL),
                (uintptr_t)src, (unsigned)src_size);
}
// A barrier opens (all threads arrived): one more for the block, one warp instruction per warp.
inline void prof_barrier(Block& b, const char* file, int line) {
  prof_flush(b);
  ProfLaunch& pl = *(ProfLaunch*)b.launch->prof;
  std::lock_guard<std::mutex> g(pl.mu);
  ProfStats& s = pl.sites[prof_site(0, file, line, PROF_BARRIER, PROF_NONE)];
  s.barriers++;
  s.warps += b.warps.size();
}
inline void prof_block_begin(Block& b) {
  if (!b.prof) b.prof = new ProfBlock;
  ((ProfBlock*)b.prof)->warps.assign(b.warps.size(), ProfWarp{});
}
inline void prof_block_end(Block& b) { prof_flush(b); }
inline void prof_worker_end(Block& b) {
  delete (ProfBlock*)b.prof;
  b.prof = nullptr;
}
inline void prof_launch_begin(Launch& L, ProfLaunch& pl) {
  pl.arrays = prof_pending_arrays();
  L.prof = &pl;
}
inline void prof_launch_end(ProfLaunch& pl) {
  prof_last().assign(pl.sites.begin(), pl.sites.end());
}

// What Python reads back: one row per instruction. pc is the return address's offset in the library.
struct ProfRow {
  unsigned long long pc;
  const char* file;
  int line, kind, space;
  unsigned long long requests, wavefronts, ideal, sectors, bytes, barriers, warps;
};
inline unsigned long long prof_offset(uintptr_t pc) {
  Dl_info info;
  if (!pc || !dladdr((void*)pc, &info)) return pc;
  return pc - (uintptr_t)info.dli_fbase;
}

}  // namespace cuflash_simt

// ---- the ThreadSanitizer hooks the instrumented code calls (their runtime is not linked) ----
// Never instrumented themselves; what they call is, and is kept out by prof_ignores.
#define CUFLASH_PROF_HOOK extern "C" __attribute__((no_sanitize_thread, noinline))
#define CUFLASH_PROF_ACCESS(N)                                                                                   \
  CUFLASH_PROF_HOOK void __tsan_read##N(void* p) {                                                              \
    ::cuflash_simt::prof_access(p, N, ::cuflash_simt::PROF_LOAD, (uintptr_t)__builtin_return_address(0));       \
  }                                                                                                             \
  CUFLASH_PROF_HOOK void __tsan_write##N(void* p) {                                                             \
    ::cuflash_simt::prof_access(p, N, ::cuflash_simt::PROF_STORE, (uintptr_t)__builtin_return_address(0));      \
  }                                                                                                             \
  CUFLASH_PROF_HOOK void __tsan_unaligned_read##N(void* p) {                                                    \
    ::cuflash_simt::prof_access(p, N, ::cuflash_simt::PROF_LOAD, (uintptr_t)__builtin_return_address(0));       \
  }                                                                                                             \
  CUFLASH_PROF_HOOK void __tsan_unaligned_write##N(void* p) {                                                   \
    ::cuflash_simt::prof_access(p, N, ::cuflash_simt::PROF_STORE, (uintptr_t)__builtin_return_address(0));      \
  }
CUFLASH_PROF_ACCESS(1)
CUFLASH_PROF_ACCESS(2)
CUFLASH_PROF_ACCESS(4)
CUFLASH_PROF_ACCESS(8)
CUFLASH_PROF_ACCESS(16)
CUFLASH_PROF_HOOK void __tsan_read_range(void* p, unsigned long n) {
  ::cuflash_simt::prof_access(p, (unsigned)n, ::cuflash_simt::PROF_LOAD, (uintptr_t)__builtin_return_address(0));
}
CUFLASH_PROF_HOOK void __tsan_write_range(void* p, unsigned long n) {
  ::cuflash_simt::prof_access(p, (unsigned)n, ::cuflash_simt::PROF_STORE, (uintptr_t)__builtin_return_address(0));
}
CUFLASH_PROF_HOOK void __tsan_init() {}
CUFLASH_PROF_HOOK void __tsan_func_entry(void*) {}
CUFLASH_PROF_HOOK void __tsan_func_exit() {}
CUFLASH_PROF_HOOK void __tsan_vptr_update(void*, void*) {}
CUFLASH_PROF_HOOK void __tsan_vptr_read(void*) {}

// Atomics: performed (sequentially consistent, whatever order was asked), and recorded as one access each.
#define CUFLASH_PROF_ATOMIC_OP(BITS, T, NAME, EXPR)                                                             \
  CUFLASH_PROF_HOOK T __tsan_atomic##BITS##_##NAME(volatile void* p, T v, int) {                                 \
    ::cuflash_simt::prof_access((const void*)p, BITS / 8, ::cuflash_simt::PROF_ATOMIC,                           \
                                (uintptr_t)__builtin_return_address(0));                                         \
    return EXPR;                                                                                                 \
  }
#define CUFLASH_PROF_ATOMICS(BITS, T)                                                                           \
  CUFLASH_PROF_HOOK T __tsan_atomic##BITS##_load(const volatile void* p, int) {                                  \
    ::cuflash_simt::prof_access((const void*)p, BITS / 8, ::cuflash_simt::PROF_ATOMIC,                           \
                                (uintptr_t)__builtin_return_address(0));                                         \
    return __atomic_load_n((const volatile T*)p, __ATOMIC_SEQ_CST);                                              \
  }                                                                                                              \
  CUFLASH_PROF_HOOK void __tsan_atomic##BITS##_store(volatile void* p, T v, int) {                               \
    ::cuflash_simt::prof_access((const void*)p, BITS / 8, ::cuflash_simt::PROF_ATOMIC,                           \
                                (uintptr_t)__builtin_return_address(0));                                         \
    __atomic_store_n((volatile T*)p, v, __ATOMIC_SEQ_CST);                                                       \
  }                                                                                                              \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, exchange, __atomic_exchange_n((volatile T*)p, v, __ATOMIC_SEQ_CST))           \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, fetch_add, __atomic_fetch_add((volatile T*)p, v, __ATOMIC_SEQ_CST))           \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, fetch_sub, __atomic_fetch_sub((volatile T*)p, v, __ATOMIC_SEQ_CST))           \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, fetch_and, __atomic_fetch_and((volatile T*)p, v, __ATOMIC_SEQ_CST))           \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, fetch_or, __atomic_fetch_or((volatile T*)p, v, __ATOMIC_SEQ_CST))             \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, fetch_xor, __atomic_fetch_xor((volatile T*)p, v, __ATOMIC_SEQ_CST))           \
  CUFLASH_PROF_ATOMIC_OP(BITS, T, fetch_nand, __atomic_fetch_nand((volatile T*)p, v, __ATOMIC_SEQ_CST))         \
  CUFLASH_PROF_HOOK bool __tsan_atomic##BITS##_compare_exchange_strong(volatile void* p, void* expected, T v,    \
                                                                        int, int) {                              \
    ::cuflash_simt::prof_access((const void*)p, BITS / 8, ::cuflash_simt::PROF_ATOMIC,                           \
                                (uintptr_t)__builtin_return_address(0));                                         \
    return __atomic_compare_exchange_n((volatile T*)p, (T*)expected, v, false, __ATOMIC_SEQ_CST,                 \
                                       __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                              \
  CUFLASH_PROF_HOOK bool __tsan_atomic##BITS##_compare_exchange_weak(volatile void* p, void* expected, T v,      \
                                                                      int, int) {                                \
    ::cuflash_simt::prof_access((const void*)p, BITS / 8, ::cuflash_simt::PROF_ATOMIC,                           \
                                (uintptr_t)__builtin_return_address(0));                                         \
    return __atomic_compare_exchange_n((volatile T*)p, (T*)expected, v, false, __ATOMIC_SEQ_CST,                 \
                                       __ATOMIC_SEQ_CST);                                                        \
  }                                                                                                              \
  CUFLASH_PROF_HOOK T __tsan_atomic##BITS##_compare_exchange_val(volatile void* p, T expected, T v, int, int) {  \
    ::cuflash_simt::prof_access((const void*)p, BITS / 8, ::cuflash_simt::PROF_ATOMIC,                           \
                                (uintptr_t)__builtin_return_address(0));                                         \
    __atomic_compare_exchange_n((volatile T*)p, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);        \
    return expected;                                                                                             \
  }
CUFLASH_PROF_ATOMICS(8, unsigned char)
CUFLASH_PROF_ATOMICS(16, unsigned short)
CUFLASH_PROF_ATOMICS(32, unsigned int)
CUFLASH_PROF_ATOMICS(64, unsigned long)
CUFLASH_PROF_HOOK void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
CUFLASH_PROF_HOOK void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

#endif  // CUFLASH_SIMT_PROFILE

#endif  // CUFLASH_SIMT_RUNTIME_PROFILE_H
