// prelude.h: the standard headers and the sanitizers' interfaces.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_PRELUDE_H
#define CUFLASH_SIMT_RUNTIME_PRELUDE_H

#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
// g++ says __SANITIZE_ADDRESS__; older clang only answers __has_feature. Every switch of stacks must be
// announced to ASan when it is on, or it reports false stack overflows.
#if defined(__SANITIZE_ADDRESS__)
#define CUFLASH_SIMT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUFLASH_SIMT_ASAN 1
#endif
#endif
#if defined(CUFLASH_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
extern "C" void __asan_report_load_n(void* addr, size_t size);  // ASan's own reporters (not in its public header)
extern "C" void __asan_report_store_n(void* addr, size_t size);
#endif
#if defined(CUFLASH_SIMT_RACE)
// ThreadSanitizer's fiber and annotation interface (declared here: not every compiler ships its header).
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_set_fiber_name(void* fiber, const char* name);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
void __tsan_read_range(void* addr, unsigned long size);
void __tsan_java_alloc(unsigned long addr, unsigned long size);
void __tsan_java_free(unsigned long addr, unsigned long size);
void __tsan_read_range_pc(void* addr, unsigned long size, void* pc);
void __tsan_write_range_pc(void* addr, unsigned long size, void* pc);
}
#endif

#endif  // CUFLASH_SIMT_RUNTIME_PRELUDE_H
