// atomics.h: atomics.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_ATOMICS_H
#define CUFLASH_SIMT_RUNTIME_ATOMICS_H

// ------------------------------------------------------------------------------------------------
// 5. Atomics: real atomics, since blocks run in parallel on several OS threads.
// ------------------------------------------------------------------------------------------------
namespace cuflash_simt {
template <class T, class F> inline T atomic_update(T* p, F f) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4- and 8-byte types");
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* q = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(q, __ATOMIC_RELAXED);
  for (;;) {
    T o; std::memcpy(&o, &old, sizeof(T));
    T n = f(o);
    U nb; std::memcpy(&nb, &n, sizeof(T));
    if (__atomic_compare_exchange_n(q, &old, nb, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return o;
  }
}
}  // namespace cuflash_simt
template <class T> inline T atomicAdd(T* p, T v) {
  if constexpr (std::is_integral<T>::value) return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  else return cuflash_simt::atomic_update(p, [v](T o) { return o + v; });
}
template <class T> inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicExch(T* p, T v) { return cuflash_simt::atomic_update(p, [v](T) { return v; }); }
template <class T> inline T atomicMin(T* p, T v) {
  return cuflash_simt::atomic_update(p, [v](T o) { return v < o ? v : o; });
}
template <class T> inline T atomicMax(T* p, T v) {
  return cuflash_simt::atomic_update(p, [v](T o) { return v > o ? v : o; });
}
template <class T> inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicCAS(T* p, T cmp, T v) {
  __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;
}
inline unsigned atomicInc(unsigned* p, unsigned v) {
  return cuflash_simt::atomic_update(p, [v](unsigned o) { return o >= v ? 0u : o + 1; });
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

#endif  // CUFLASH_SIMT_RUNTIME_ATOMICS_H
