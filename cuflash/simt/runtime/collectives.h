// collectives.h: __syncthreads and warp collectives.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_COLLECTIVES_H
#define CUFLASH_SIMT_RUNTIME_COLLECTIVES_H

namespace cuflash_simt {

// ------------------------------------------------------------------------------------------------
// 8. __syncthreads and warp collectives.
// ------------------------------------------------------------------------------------------------
inline std::vector<unsigned> fibers_where(const Block& b, FiberState s) {
  std::vector<unsigned> v;
  for (const Fiber& f : b.fibers)
    if (f.state == s) v.push_back(f.linear);
  return v;
}

[[noreturn]] __attribute__((noinline, cold)) inline void barrier_misuse(Fiber* f, const char* file, int line) {
  Block& b = *f->block;
  if (b.done)
    fail_fiber(where(b) + format(": thread %u reaches __syncthreads() (%s:%d) after threads %s exited; "
                                 "every thread of the block must reach each barrier",
                                 f->linear, file, line, ranges(fibers_where(b, DONE)).c_str()));
  fail_fiber(where(b) + format(": barrier divergence: threads %s wait at __syncthreads() (%s:%d) while "
                               "thread %u reaches __syncthreads() at %s:%d",
                               ranges(fibers_where(b, AT_BARRIER)).c_str(), b.barrier_file, b.barrier_line,
                               f->linear, file, line));
}

// One barrier is one call site: the same line of another file is another barrier.
inline bool same_site(const char* file, int line, const char* file2, int line2) {
  return line == line2 && (file == file2 || !std::strcmp(file, file2));
}

inline void cp_async_at_barrier(Fiber* f);
inline void barrier_arrive(const char* file, int line, int vote) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  if (!f->cp_queue.empty()) cp_async_at_barrier(f);
  if (b.done || (b.at_barrier && !same_site(file, line, b.barrier_file, b.barrier_line)))
    barrier_misuse(f, file, line);
  if (b.at_barrier == 0) { b.barrier_file = file; b.barrier_line = line; b.bar_votes = 0; }
  b.bar_votes += vote != 0;
  f->state = AT_BARRIER;
  f->file = file;
  f->line = line;
  f->what = "__syncthreads()";
#if defined(CUFLASH_SIMT_RACE)
  race_arrive(b.bar_sync);  // every arriving thread releases ...
#endif
  if (++b.at_barrier == b.fibers.size()) {  // the last one opens the barrier for all
    b.at_barrier = 0;
    b.bar_result = b.bar_votes;
#if defined(CUFLASH_SIMT_RACE)
    for (Fiber& o : b.fibers) {  // ... and every leaving one acquires, all before any of them runs on
      race_switch(o.tsan);
      __tsan_acquire(b.bar_sync);
    }
    race_switch(f->tsan);
    race_drop(b.bar_sync);
#endif
#if defined(CUFLASH_SIMT_PROFILE)
    prof_barrier(b, file, line);  // every thread is here: the interval's requests are complete
#endif
    release_all(b);
  }
  switch_away(f);
}

inline Warp& my_warp(Fiber* f) { return f->block->warps[f->linear / 32]; }

[[noreturn]] __attribute__((noinline, cold)) inline void collective_misuse(const Collective* op, unsigned mask,
                                                                          const char* file, int line) {
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  Warp& w = my_warp(f);
  unsigned bit = 1u << f->lane;
  if (!(mask & bit))
    fail_here("%s (%s:%d) with mask 0x%08x, which does not include the calling lane", op->name, file, line, mask);
  if (mask & ~w.present)
    fail_here("%s (%s:%d) with mask 0x%08x names lanes that do not exist (the block has %zu threads)",
              op->name, file, line, mask, b.fibers.size());
  if (mask & w.exited) {
    std::vector<unsigned> gone;
    for (unsigned l = 0; l < 32; l++)
      if (mask & w.exited & (1u << l)) gone.push_back(l);
    fail_here("%s (%s:%d) with mask 0x%08x: lanes %s named in the mask have exited", op->name, file, line, mask,
              ranges(gone).c_str());
  }
  std::abort();
}

inline bool in_shared(const Block& b, const void* p, size_t n);
inline void warp_collective(const Collective* op, unsigned mask, void* data, const char* file, int line) {
  CUFLASH_SIMT_RUNTIME_SCOPE;
  Fiber* f = tl.fiber;
  Block& b = *f->block;
  Warp& w = my_warp(f);
  unsigned bit = 1u << f->lane;
  if (!(mask & bit) || (mask & ~w.present) || (mask & w.exited)) collective_misuse(op, mask, file, line);
  void* sync = nullptr;
#if defined(CUFLASH_SIMT_PROFILE)
  // ldmatrix's row address is the first member of ptx.cuh's per-lane record, as race mode reads it below.
  if (!std::strncmp(op->name, "ldmatrix", 8)) prof_ldmatrix(op->name, *(void* const*)data, file, line);
#endif
#if defined(CUFLASH_SIMT_RACE)
  // ldmatrix reads 16 bytes of shared memory at each lane's row address (the first member of ptx.cuh's
  // per-lane record): check it as that lane's read. Bad addresses are left to run_ldmatrix's messages.
  if (!std::strncmp(op->name, "ldmatrix", 8)) {
    void* row = *(void* const*)data;
    if ((uintptr_t)row % 16 == 0 && in_shared(b, row, 16)) {
      RaceKernelAccess kernel;
      __tsan_read_range(row, 16);
    }
  }
  for (unsigned l = 0; l < 32 && !sync; l++)  // join the episode lanes already wait in, or open one
    if (((w.arrived & mask) >> l) & 1 && w.lane[l].op == op && w.lane[l].mask == mask) sync = w.lane[l].sync;
  race_arrive(sync);
#endif
  w.lane[f->lane] = Arrival{op, mask, file, line, data, sync};
  w.arrived |= bit;
  bool complete = (w.arrived & mask) == mask;
  for (unsigned l = 0; complete && l < 32; l++)
    if ((mask >> l) & 1) complete = w.lane[l].op == op && w.lane[l].mask == mask;
  if (complete) {
    void* lanes[32] = {};
    for (unsigned l = 0; l < 32; l++)
      if ((mask >> l) & 1) lanes[l] = w.lane[l].data;
    op->run(lanes, mask);
    w.arrived &= ~mask;
    unsigned base = f->linear & ~31u, others = mask & ~bit;
#if defined(CUFLASH_SIMT_RACE)
    for (unsigned l = 0; l < 32; l++)
      if ((mask >> l) & 1) {
        race_switch(b.fibers[base + l].tsan);
        __tsan_acquire(sync);
        w.lane[l].sync = nullptr;
      }
    race_switch(f->tsan);
    race_drop(sync);
#endif
    if (b.launch->order == Order::reverse)
      for (unsigned l = 32; l-- > 0;) { if ((others >> l) & 1) make_ready(b, base + l); }
    else
      for (unsigned l = 0; l < 32; l++) { if ((others >> l) & 1) make_ready(b, base + l); }
    if (b.launch->order == Order::random) yield();  // let the seed decide who goes next
  } else {
    f->state = AT_WARP;
    f->file = file;
    f->line = line;
    f->what = op->name;
    switch_away(f);
  }
}

// ---- shuffles (PTX shfl.sync semantics: a lane outside its segment reads its own value;
//      a source lane that is not in the mask gives garbage, as "undefined" does on the GPU) ----
struct ShflLane {
  uint64_t value, result;
  int arg, width;
};
enum ShflMode { IDX, UP, DOWN, BFLY };
template <ShflMode M> inline void run_shfl(void* const* lanes, unsigned mask) {
  for (int lane = 0; lane < 32; lane++) {
    ShflLane* me = (ShflLane*)lanes[lane];
    if (!me) continue;
    int w = me->width, seg = 32 - w;  // PTX: c = ((32 - width) << 8) | clamp
    int min_lane = lane & seg;
    int max_lane = M == UP ? min_lane : (min_lane | (31 & ~seg));
    int b = me->arg, j;
    bool ok;
    switch (M) {
      case IDX: j = min_lane | (b & 31 & ~seg); ok = j <= max_lane; break;
      case UP: j = lane - (b & 31); ok = j >= max_lane; break;  // PTX reads only b[4:0]
      case DOWN: j = lane + (b & 31); ok = j <= max_lane; break;
      default: j = lane ^ (b & 31); ok = j <= max_lane; break;
    }
    if (!ok) j = lane;
    me->result = ((mask >> j) & 1) ? ((ShflLane*)lanes[j])->value : ~0ull;
  }
}
inline const Collective* shfl_op(ShflMode m) {
  static const Collective ops[4] = {{"__shfl_sync", run_shfl<IDX>},
                                    {"__shfl_up_sync", run_shfl<UP>},
                                    {"__shfl_down_sync", run_shfl<DOWN>},
                                    {"__shfl_xor_sync", run_shfl<BFLY>}};
  return &ops[m];
}
template <class T> inline T shfl(ShflMode m, unsigned mask, T v, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle a value of at most 8 bytes");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail_here("%s (%s:%d) with width %d: the width must be a power of two up to 32", shfl_op(m)->name, file, line,
              width);
  ShflLane me{0, 0, arg, width};
  std::memcpy(&me.value, &v, sizeof(T));
  warp_collective(shfl_op(m), mask, &me, file, line);
  T r;
  std::memcpy(&r, &me.result, sizeof(T));
  return r;
}

// ---- votes, warp reductions, __syncwarp ----
struct VoteLane { unsigned pred, result; };
inline void run_ballot(void* const* lanes, unsigned mask) {
  unsigned ballot = 0;
  for (int l = 0; l < 32; l++)
    if (lanes[l] && ((VoteLane*)lanes[l])->pred) ballot |= 1u << l;
  for (int l = 0; l < 32; l++)
    if (lanes[l]) ((VoteLane*)lanes[l])->result = ballot;
  (void)mask;
}
inline const Collective* ballot_op(int kind) {
  static const Collective ops[4] = {{"__ballot_sync", run_ballot}, {"__any_sync", run_ballot},
                                    {"__all_sync", run_ballot}, {"__syncwarp", run_ballot}};
  return &ops[kind];
}
inline unsigned vote(int kind, unsigned mask, int pred, const char* file, int line) {
  VoteLane me{pred != 0, 0};
  warp_collective(ballot_op(kind), mask, &me, file, line);
  return me.result;
}
struct ReduceLane { uint32_t value, result; };
template <int K, bool S> inline void run_reduce(void* const* lanes, unsigned) {
  int64_t acc = 0;
  bool first = true;
  for (int l = 0; l < 32; l++) {
    if (!lanes[l]) continue;
    uint32_t u = ((ReduceLane*)lanes[l])->value;
    int64_t v = S ? (int64_t)(int32_t)u : (int64_t)u;
    if (first) acc = v;
    else if (K == 0) acc = (int64_t)(uint32_t)(acc + v);
    else if (K == 1) acc = v < acc ? v : acc;
    else if (K == 2) acc = v > acc ? v : acc;
    else if (K == 3) acc &= v;
    else if (K == 4) acc |= v;
    else acc ^= v;
    first = false;
  }
  for (int l = 0; l < 32; l++)
    if (lanes[l]) ((ReduceLane*)lanes[l])->result = (uint32_t)acc;
}
template <int K, bool S> inline uint32_t reduce(const char* name, unsigned mask, uint32_t v, const char* file,
                                                int line) {
  static const Collective op{name, run_reduce<K, S>};
  ReduceLane me{v, 0};
  warp_collective(&op, mask, &me, file, line);
  return me.result;
}

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_COLLECTIVES_H
