// Kernel launches and the C API launch.py calls: configuration checks as a GPU makes them, blocks
// handed to worker OS threads, each running a block's threads as fibers (scheduler.cpp); a fault
// inside a kernel (the guard pages around launch.py's buffer copies, a fiber's stack guard) ends
// the launch with an error instead of the process.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>

#include "runtime.h"

#define LKV_API extern "C" __attribute__((visibility("default")))

namespace lkv_emu {
namespace {

std::mutex launch_mu;  // one launch at a time: the signal handlers and the worker pool are shared
std::vector<std::unique_ptr<Worker>> pool;
struct sigaction old_segv, old_bus;

bool ensure_capacity(Worker& w, int n) {
  if ((int)w.threads.size() < n) w.threads.resize(n), w.pos.resize(n);
  w.warps.resize((n + 31) / 32);
  w.page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t need = (size_t)n * STACK_SLOT + STACK_SLOT;  // + room to align the first slot
  if (w.stacks_len >= need) return true;
  if (w.stacks_map) munmap(w.stacks_map, w.stacks_len);
  void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    w.stacks_map = w.stacks = nullptr, w.stacks_len = 0;
    return false;
  }
  w.stacks_map = static_cast<char*>(p);
  w.stacks_len = need;
  w.stacks = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + STACK_SLOT - 1) & ~(STACK_SLOT - 1));
  for (int i = 0; i < n; ++i) mprotect(w.stacks + i * STACK_SLOT + w.page, w.page, PROT_NONE);
  return true;
}

void run_block(Worker& w, long long b) {
  const Launch& L = *w.launch;
  const dim3 g = L.grid, bd = L.block;
  const uint3 bid{unsigned(b % g.x), unsigned(b / g.x % g.y), unsigned(b / ((long long)g.x * g.y))};
  w.exited = w.bar_arrived = 0;
  for (int i = 0; i < w.n; ++i) {
    Thread& t = w.threads[i];
    const unsigned u = i;
    t.ctx = Ctx{uint3{u % bd.x, u / bd.x % bd.y, u / (bd.x * bd.y)}, bid, bd, g};
    t.lin = i;
    t.w = &w;
    t.state = RUNNABLE;
    char* slot = w.stacks + i * STACK_SLOT;
    *reinterpret_cast<Ctx**>(slot) = &t.ctx;
    // stack tops staggered: slots are STACK_SLOT apart, so equal offsets would share cache sets
    const size_t color = (size_t)i * 576 % (16 << 10);
    fiber_init(t.fiber, slot + 2 * w.page, STACK_SLOT - 2 * w.page - color, &thread_main, &t);
  }
  for (size_t k = 0; k < w.warps.size(); ++k) {
    const int lanes = std::min(32, w.n - (int)k * 32);
    w.warps[k].exists = lanes == 32 ? ~0u : (1u << lanes) - 1u;
    w.warps[k].exited = 0;
    w.warps[k].ngroups = 0;
  }
  w.current = L.order[0];
  fiber_switch(w.sched, w.threads[w.current].fiber);  // back when all threads exited or one failed
  w.current = -1;
}

void report_fault(Worker& w, Launch& L) {
  char msg[512];
  const uintptr_t a = w.fault_addr;
  int n = 0;
  if (w.current >= 0) {
    const Ctx& c = w.threads[w.current].ctx;
    n = snprintf(msg, sizeof msg, "block (%u,%u,%u) thread (%u,%u,%u): ", c.bid.x, c.bid.y, c.bid.z, c.tid.x, c.tid.y,
                 c.tid.z);
  }
  if (a >= (uintptr_t)w.stacks_map && a < (uintptr_t)w.stacks_map + w.stacks_len)
    snprintf(msg + n, sizeof msg - n, "stack overflow of an emulated thread (%zu KiB stacks)",
             (size_t)(STACK_SLOT - 2 * w.page) >> 10);
  else
    snprintf(msg + n, sizeof msg - n, "invalid memory access: %s at 0x%lx",
             w.fault_write < 0 ? "access" : w.fault_write ? "write" : "read", (unsigned long)a);
  std::lock_guard<std::mutex> g(L.mu);
  if (!L.failed.exchange(true)) L.error = msg, L.code = 3, L.fault_addr = a, L.fault_write = w.fault_write;
}

void worker_run(Worker* wp, Launch* lp) {
  Worker& w = *wp;
  Launch& L = *lp;
  tls_worker = &w;
  w.launch = &L;
  w.current = -1;
  w.n = (int)(L.block.x * L.block.y * L.block.z);
  for (int k = 0; k < w.n; ++k) w.pos[L.order[k]] = k;
  stack_t ss{}, old{};
  ss.ss_sp = w.altstack.data();
  ss.ss_size = w.altstack.size();
  sigaltstack(&ss, &old);
  if (sigsetjmp(w.jmp, 1) == 0) {
    w.in_kernel = 1;
    while (!L.failed.load(std::memory_order_relaxed)) {
      const long long b = L.next.fetch_add(1);
      if (b >= L.blocks) break;
      run_block(w, b);
    }
    w.in_kernel = 0;
  } else {
    w.in_kernel = 0;
    report_fault(w, L);
  }
  sigaltstack(&old, nullptr);
  tls_worker = nullptr;
}

void on_fault(int sig, siginfo_t* si, void* ucv) {
  Worker* w = tls_worker;
  if (w && w->in_kernel) {
    w->fault_addr = reinterpret_cast<uintptr_t>(si->si_addr);
#if defined(__x86_64__) && defined(REG_ERR)
    w->fault_write = (static_cast<ucontext_t*>(ucv)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
    (void)ucv;
    w->fault_write = -1;
#endif
    siglongjmp(w->jmp, 1);
  }
  sigaction(sig, sig == SIGSEGV ? &old_segv : &old_bus, nullptr);  // not ours: the old handler sees it next
}

std::string check_config(const KernelEntry& k, dim3 g, dim3 b, unsigned long long shmem) {
  char m[256];
  const unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
  if (!g.x || !g.y || !g.z || !b.x || !b.y || !b.z || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535 ||
      b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024)
    snprintf(m, sizeof m, "invalid configuration argument: grid (%u,%u,%u), block (%u,%u,%u)", g.x, g.y, g.z, b.x,
             b.y, b.z);
  else if ((long long)threads > k.max_threads)
    snprintf(m, sizeof m, "too many resources requested for launch: %llu threads per block, %s's __launch_bounds__ %d",
             threads, k.name, k.max_threads);
  else if (shmem > (unsigned long long)LKV_EMU_DYN_SMEM_BYTES)
    snprintf(m, sizeof m, "invalid argument: %llu bytes of dynamic shared memory", shmem);
  else
    return "";
  return m;
}

const KernelEntry* find_kernel(const char* name) {
  for (const KernelEntry& k : registry())
    if (std::string(k.name) == name) return &k;
  return nullptr;
}

// Warps in index order (or reversed, or shuffled), each warp's lanes together, in the same kind of order.
void make_order(Launch& L, int mode, unsigned long long seed) {
  const int n = (int)(L.block.x * L.block.y * L.block.z), nw = (n + 31) / 32;
  std::mt19937_64 rng(seed);
  auto arrange = [&](std::vector<int>& v) {
    if (mode == 1) std::reverse(v.begin(), v.end());
    if (mode == 2) std::shuffle(v.begin(), v.end(), rng);
  };
  std::vector<int> warps(nw);
  std::iota(warps.begin(), warps.end(), 0);
  arrange(warps);
  L.order.clear();
  L.warp_lo.assign(nw, 0);
  L.warp_hi.assign(nw, 0);
  for (int wi : warps) {
    std::vector<int> lanes(std::min(32, n - wi * 32));
    std::iota(lanes.begin(), lanes.end(), wi * 32);
    arrange(lanes);
    L.warp_lo[wi] = (int)L.order.size();
    L.order.insert(L.order.end(), lanes.begin(), lanes.end());
    L.warp_hi[wi] = (int)L.order.size();
  }
}

int run_launch(Launch& L, int workers) {
  const int n = (int)(L.block.x * L.block.y * L.block.z);
  workers = (int)std::max(1LL, std::min(std::min((long long)workers, L.blocks), 64LL));
  while ((int)pool.size() < workers) pool.push_back(std::make_unique<Worker>());
  for (int i = 0; i < workers; ++i)
    if (!ensure_capacity(*pool[i], n)) {
      set_error(L, 2, "out of memory for the emulated threads' stacks");
      return L.code;
    }
  struct sigaction sa {};
  sa.sa_sigaction = &on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  std::vector<std::thread> ts;
  for (int i = 1; i < workers; ++i) ts.emplace_back(worker_run, pool[i].get(), &L);
  worker_run(pool[0].get(), &L);
  for (std::thread& t : ts) t.join();
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  return L.failed ? L.code : 0;
}

}  // namespace
}  // namespace lkv_emu

using namespace lkv_emu;

// Runs kernel `name` on grid x block threads; args[i] points at argument i's value (as for
// cuLaunchKernel). order: the threads of a block take turns warp by warp, lanes and warps in index
// order (0), in reverse (1), or shuffled from `seed` (2). Returns 0, or 1 (the kernel failed: err says where and why), 2 (the
// launch was refused, as a GPU would), 3 (a memory fault: fault = address, 1 write / 0 read / -1).
LKV_API int lkv_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned long long shmem,
                           void** args, int workers, int order, unsigned long long seed, char* err,
                           unsigned long long errlen, long long* fault) {
  std::lock_guard<std::mutex> lock(launch_mu);
  const KernelEntry* k = find_kernel(name);
  const dim3 g(grid[0], grid[1], grid[2]), b(block[0], block[1], block[2]);
  std::string msg = k ? check_config(*k, g, b, shmem) : std::string("no kernel named ") + name;
  if (!msg.empty()) {
    snprintf(err, errlen, "%s", msg.c_str());
    return 2;
  }
  Launch L;
  L.kernel = k, L.args = args, L.grid = g, L.block = b;
  L.blocks = (long long)g.x * g.y * g.z;
  make_order(L, order, seed);
  const int rc = run_launch(L, workers);
  if (rc) {
    snprintf(err, errlen, "%s", L.error.c_str());
    fault[0] = (long long)L.fault_addr;
    fault[1] = L.fault_write;
  }
  return rc;
}

LKV_API int lkv_emu_kernel_count() { return (int)registry().size(); }
LKV_API const char* lkv_emu_kernel_name(int i) { return registry()[i].name; }
LKV_API const char* lkv_emu_kernel_signature(int i) { return registry()[i].signature.c_str(); }
LKV_API int lkv_emu_kernel_max_threads(int i) { return registry()[i].max_threads; }
LKV_API unsigned long long lkv_emu_dyn_smem_bytes() { return LKV_EMU_DYN_SMEM_BYTES; }
LKV_API unsigned long long lkv_emu_guard_bytes() { return GUARD; }

// Guarded buffers: [guard][slack | data | slack][guard], the data ending at the last page but for
// rounding its start down to `align`; accesses within GUARD bytes before or after the pages fault,
// writes into the slack (less than a page before, less than `align` after) are found by
// lkv_emu_guard_check from the canary bytes it was filled with.
constexpr unsigned char CANARY = 0xa5;

LKV_API void* lkv_emu_guard_alloc(unsigned long long nbytes, unsigned long long align, void** base,
                                  unsigned long long* len) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t body = (nbytes + page - 1) / page * page;
  void* p = mmap(nullptr, GUARD + body + GUARD, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  char* lo = static_cast<char*>(p) + GUARD;
  if (body && mprotect(lo, body, PROT_READ | PROT_WRITE)) {
    munmap(p, GUARD + body + GUARD);
    return nullptr;
  }
  *base = p;
  *len = GUARD + body + GUARD;
  char* data = lo + ((body - nbytes) & ~(size_t)(align - 1));
  memset(lo, CANARY, data - lo);
  memset(data + nbytes, CANARY, lo + body - (data + nbytes));
  return data;
}

// 0 when the slack around data is untouched; else -k for a write k bytes before data's start, or
// k + 1 for one k bytes past its end.
LKV_API long long lkv_emu_guard_check(void* base, unsigned long long len, void* data, unsigned long long nbytes) {
  const unsigned char* lo = static_cast<unsigned char*>(base) + GUARD;
  const unsigned char* hi = static_cast<unsigned char*>(base) + len - GUARD;
  const unsigned char* d = static_cast<unsigned char*>(data);
  for (const unsigned char* q = lo; q < d; ++q)
    if (*q != CANARY) return -(long long)(d - q);
  for (const unsigned char* q = d + nbytes; q < hi; ++q)
    if (*q != CANARY) return (long long)(q - (d + nbytes)) + 1;
  return 0;
}

LKV_API int lkv_emu_guard_readonly(void* base, unsigned long long len) {
  return mprotect(static_cast<char*>(base) + GUARD, len - 2 * GUARD, PROT_READ);
}

LKV_API void lkv_emu_guard_free(void* base, unsigned long long len) { munmap(base, len); }
