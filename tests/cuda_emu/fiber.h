// User-level contexts for the emulated CUDA threads: each has its own stack and gives the CPU back
// only where it must wait (__syncthreads, a warp collective, its end). On x86-64 a switch saves the
// callee-saved registers and swaps stack pointers (a few ns); elsewhere, or with -DLKV_EMU_UCONTEXT,
// it is swapcontext (a signal-mask system call per switch: correct, slower).
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && !defined(LKV_EMU_UCONTEXT)

extern "C" void lkv_ctx_switch(void** save_sp, void* new_sp);
extern "C" void lkv_fiber_start();

// lkv_ctx_switch: push rbp rbx r12-r15, save rsp in *save_sp, load new_sp, pop them, return into
// the other context. A new context's first "return" lands in lkv_fiber_start with r12 = argument,
// r13 = entry function. Emitted by the one file that defines LKV_EMU_FIBER_ASM (scheduler.cpp).
#ifdef LKV_EMU_FIBER_ASM
asm(R"(
  .text
  .p2align 4
  .globl lkv_ctx_switch
  .hidden lkv_ctx_switch
  .type lkv_ctx_switch, @function
lkv_ctx_switch:
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
  .size lkv_ctx_switch, .-lkv_ctx_switch

  .p2align 4
  .globl lkv_fiber_start
  .hidden lkv_fiber_start
  .type lkv_fiber_start, @function
lkv_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size lkv_fiber_start, .-lkv_fiber_start
)");
#endif

namespace lkv_emu {
struct Fiber {
  void* sp = nullptr;
};

inline void fiber_init(Fiber& f, char* stack_lo, size_t size, void (*entry)(void*), void* arg) {
  const uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo + size) & ~uintptr_t(15)) - 64;
  void** sp = reinterpret_cast<void**>(top - 56);  // rsp is 16-byte aligned at lkv_fiber_start's call
  sp[0] = sp[1] = sp[4] = sp[5] = nullptr;          // r15 r14 rbx rbp
  sp[2] = reinterpret_cast<void*>(entry);           // r13
  sp[3] = arg;                                      // r12
  sp[6] = reinterpret_cast<void*>(&lkv_fiber_start);
  f.sp = sp;
}

inline void fiber_switch(Fiber& from, Fiber& to) { lkv_ctx_switch(&from.sp, to.sp); }
}  // namespace lkv_emu

#else

#include <ucontext.h>

namespace lkv_emu {
struct Fiber {
  ucontext_t uc;
};

inline void fiber_entry_uc(unsigned hi, unsigned lo, unsigned ehi, unsigned elo) {
  auto arg = reinterpret_cast<void*>((uintptr_t(hi) << 32) | lo);
  auto entry = reinterpret_cast<void (*)(void*)>((uintptr_t(ehi) << 32) | elo);
  entry(arg);
}

inline void fiber_init(Fiber& f, char* stack_lo, size_t size, void (*entry)(void*), void* arg) {
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = stack_lo;
  f.uc.uc_stack.ss_size = size;
  f.uc.uc_link = nullptr;
  const uintptr_t a = reinterpret_cast<uintptr_t>(arg), e = reinterpret_cast<uintptr_t>(entry);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_entry_uc), 4, unsigned(a >> 32), unsigned(a),
              unsigned(e >> 32), unsigned(e));
}

inline void fiber_switch(Fiber& from, Fiber& to) { swapcontext(&from.uc, &to.uc); }
}  // namespace lkv_emu

#endif
