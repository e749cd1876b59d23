// fibers.h: fibers and their stacks.
// Part of the SIMT emulator's runtime: include cuflash_simt.h, which includes the parts in order (each
// relies on the ones before it), never a part alone.
#ifndef CUFLASH_SIMT_RUNTIME_FIBERS_H
#define CUFLASH_SIMT_RUNTIME_FIBERS_H

// ------------------------------------------------------------------------------------------------
// 6. Fibers: a hand-written x86-64 context switch (callee-saved registers and the stack pointer: a few ns,
//    where swapcontext's signal-mask system call costs ~0.35 us), ucontext elsewhere. MXCSR and the x87
//    control word are not switched: kernels never change them, and each worker sets them once per launch.
// ------------------------------------------------------------------------------------------------
namespace cuflash_simt {

#if defined(__x86_64__)
extern "C" void cuflash_simt_switch(void** save_sp, void* load_sp);
extern "C" void cuflash_simt_trampoline();
asm(R"(
  .text
  .globl cuflash_simt_switch
  .hidden cuflash_simt_switch
  .type cuflash_simt_switch,@function
  .p2align 4
cuflash_simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuflash_simt_switch, .-cuflash_simt_switch

  .globl cuflash_simt_trampoline
  .hidden cuflash_simt_trampoline
  .type cuflash_simt_trampoline,@function
  .p2align 4
cuflash_simt_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size cuflash_simt_trampoline, .-cuflash_simt_trampoline
)");

struct Context {
  void* sp = nullptr;
  // Lay out a frame that cuflash_simt_switch "returns" into: the trampoline then calls fn(arg).
  void init(char* lo, size_t size, void (*fn)(void*), void* arg) {
    uintptr_t top = (uintptr_t)(lo + size) & ~(uintptr_t)15;
    uint64_t* s = (uint64_t*)(top - 16);
    *--s = (uint64_t)(uintptr_t)&cuflash_simt_trampoline;  // return address (rsp % 16 == 0 after ret)
    *--s = 0;                                              // rbp: ends frame-pointer backtraces
    *--s = 0;                                              // rbx
    *--s = (uint64_t)(uintptr_t)arg;                       // r12
    *--s = (uint64_t)(uintptr_t)fn;                        // r13
    *--s = 0;                                              // r14
    *--s = 0;                                              // r15
    sp = s;
  }
};
inline void switch_context(Context& from, Context& to) { cuflash_simt_switch(&from.sp, to.sp); }
// Where the fiber's stack pointer stood when it last switched away (null: unknown).
inline char* saved_sp(const Context& c) { return (char*)c.sp; }
inline unsigned get_mxcsr() { unsigned m; asm volatile("stmxcsr %0" : "=m"(m)); return m; }
inline void set_mxcsr(unsigned m) { asm volatile("ldmxcsr %0" : : "m"(m)); }
#else
struct Context {
  ucontext_t uc;
  void init(char* lo, size_t size, void (*fn)(void*), void* arg) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = lo;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, (void (*)())fn, 1, arg);  // one pointer argument: fine on LP64 ABIs that pass it whole
  }
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline char* saved_sp(const Context&) { return nullptr; }
inline unsigned get_mxcsr() { return 0; }
inline void set_mxcsr(unsigned) {}
#endif

// Fiber stacks: mmap'd lazily (only touched pages cost memory), reused across blocks and launches, each with
// a PROT_NONE guard below it. Kernels are built with -fstack-clash-protection, which touches every page of a
// large frame in order, so an overflow faults in the guard (and the SIGSEGV handler can say so) instead of
// writing into whatever lies below; the guard is larger than a page only as a margin for code built without it.
constexpr size_t kStackGuard = 64 * 1024;
struct Stack {
  char* lo = nullptr;    // lowest usable byte (above the guard)
  size_t size = 0;
  // AddressSanitizer: the lowest byte whose shadow may hold poison left by frames that never returned (a
  // fiber's last switch leaves its whole call chain on the stack). Kept with the stack, not the fiber, so
  // that it survives into the next launch that reuses the stack.
  char* poison_lo = nullptr;
};
inline Stack map_stack(size_t size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size = (size + page - 1) / page * page;
  size_t guard = (kStackGuard + page - 1) / page * page;
  void* p = mmap(nullptr, size + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return Stack{};
  mprotect(p, guard, PROT_NONE);
  char* lo = (char*)p + guard;
  // A fresh mapping may reuse addresses whose shadow a dead mapping poisoned (not every libasan clears
  // shadow on mmap): treat the whole stack as suspect.
  return Stack{lo, size, lo};
}

}  // namespace cuflash_simt

#endif  // CUFLASH_SIMT_RUNTIME_FIBERS_H
