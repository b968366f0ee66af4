// Internal state of the CPU runtime, shared by scheduler.cpp (threads, barriers, warp collectives)
// and launch.cpp (launches, faults, guard pages, the C API launch.py calls).
#pragma once

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_shim.h"
#include "emu_register.h"
#include "fiber.h"

namespace lkv_emu {

constexpr size_t GUARD = 1 << 20;  // guard bytes on each side of launch.py's buffer copies
enum State : uint8_t { RUNNABLE, WAIT_WARP, WAIT_BLOCK, EXITED };

struct Worker;

struct Thread {
  Ctx ctx;  // first: lkv_emu_cur points at it, and so at its Thread
  Worker* w = nullptr;
  Fiber fiber;
  int lin = 0;
  State state = RUNNABLE;
  uint64_t value = 0, result = 0;  // a warp collective's operand and result
  int b = 0, width = 32;
};

struct Group {  // a warp collective some lanes of a warp wait in
  unsigned mask, arrived;
  WarpOp op;
};

struct Warp {
  unsigned exists = 0, exited = 0;
  Group groups[4];
  int ngroups = 0;
};

struct Launch {
  const KernelEntry* kernel;
  void** args;
  dim3 grid, block;
  long long blocks;
  std::vector<int> order;  // the order in which a block's threads get the CPU, warp by warp
  std::vector<int> warp_lo, warp_hi;  // warp w's lanes are order[warp_lo[w] .. warp_hi[w])
  std::atomic<long long> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  int code = 0;
  uintptr_t fault_addr = 0;
  int fault_write = -1;
};

struct Worker {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<int> pos;  // pos[thread] = its place in launch->order
  char* stacks = nullptr;  // STACK_SLOT-aligned slots: [Ctx* | guard page | stack]
  char* stacks_map = nullptr;
  size_t stacks_len = 0, page = 4096;
  Fiber sched;
  Launch* launch = nullptr;
  int n = 0, current = -1, exited = 0, bar_arrived = 0;
  sigjmp_buf jmp;
  volatile sig_atomic_t in_kernel = 0;
  uintptr_t fault_addr = 0;
  int fault_write = -1;
  std::vector<char> altstack = std::vector<char>(256 << 10);
};

extern __thread Worker* tls_worker;  // the worker this OS thread runs blocks for, while it does

inline Thread& me() { return *reinterpret_cast<Thread*>(lkv_emu_cur); }
std::vector<KernelEntry>& registry();
void thread_main(void* thread);
void set_error(Launch& L, int code, const std::string& msg);

}  // namespace lkv_emu
