// The scheduler behind cuda_shim.h: a block's threads are fibers that take turns on one OS thread,
// warp by warp, each giving the CPU up only where it must wait: __syncthreads (for all non-exited
// threads of the block), a warp collective (for every lane its mask names), or its end. Strict where a GPU is
// undefined: a deadlock, a collective that names an exited lane or reads a lane outside its mask,
// or lanes of one warp in different collectives with overlapping masks end the launch with an error.
#include <stdarg.h>
#include <stdlib.h>

#include <chrono>

#define LKV_EMU_FIBER_ASM
#include "runtime.h"

namespace lkv_emu {

__thread Worker* tls_worker = nullptr;

const char* op_name(WarpOp op) {
  static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                "__ballot_sync", "__any_sync",     "__all_sync",       "__syncwarp"};
  return names[op];
}

void set_error(Launch& L, int code, const std::string& msg) {
  std::lock_guard<std::mutex> g(L.mu);
  if (!L.failed.exchange(true)) {
    L.error = msg;
    L.code = code;
  }
}

void vfail(const char* fmt, va_list ap) {
  char buf[768];
  vsnprintf(buf, sizeof buf, fmt, ap);
  Worker* w = tls_worker;
  if (!w || w->current < 0) {
    fprintf(stderr, "cuda_emu: %s (outside an emulated thread)\n", buf);
    abort();
  }
  Thread& t = w->threads[w->current];
  char where[160];
  snprintf(where, sizeof where, "block (%u,%u,%u) thread (%u,%u,%u): ", t.ctx.bid.x, t.ctx.bid.y, t.ctx.bid.z,
           t.ctx.tid.x, t.ctx.tid.y, t.ctx.tid.z);
  set_error(*w->launch, 1, std::string(where) + buf);
  fiber_switch(t.fiber, w->sched);  // the launch ends here: this fiber never resumes
  abort();
}

void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail(fmt, ap);
  va_end(ap);
  abort();
}

void misaligned(const void* p, unsigned align, const char* type) {
  fail("misaligned address: a %s access at %p needs %u-byte alignment", type, p, align);
}

namespace {

static_assert(offsetof(Thread, ctx) == 0, "lkv_emu_cur must point at its Thread");

bool run_if_runnable(Worker& w, Thread& t, int k) {
  Thread& u = w.threads[w.launch->order[k]];
  if (u.state != RUNNABLE) return false;
  w.current = u.lin;
  fiber_switch(t.fiber, u.fiber);
  return true;  // resumed: whoever switched here set current
}

// Gives the CPU to the next runnable thread of the block: first the lanes of t's own warp after
// it, then the other warps, in launch order (order[] holds each warp's lanes together). Staying
// with one warp keeps 32 stacks, not the whole block's, in the cache. Back to the scheduler when
// every thread has exited; a deadlock when some wait and none can run.
void switch_away(Worker& w, Thread& t) {
  const int p = w.pos[t.lin], lo = w.launch->warp_lo[t.lin >> 5], hi = w.launch->warp_hi[t.lin >> 5];
  for (int k = p + 1; k < hi; ++k)
    if (run_if_runnable(w, t, k)) return;
  for (int k = lo; k < p; ++k)
    if (run_if_runnable(w, t, k)) return;
  for (int k = hi; k < w.n; ++k)
    if (run_if_runnable(w, t, k)) return;
  for (int k = 0; k < lo; ++k)
    if (run_if_runnable(w, t, k)) return;
  if (w.exited == w.n) {
    fiber_switch(t.fiber, w.sched);
    abort();
  }
  int at_bar = 0, at_warp = 0;
  for (int i = 0; i < w.n; ++i) at_bar += w.threads[i].state == WAIT_BLOCK, at_warp += w.threads[i].state == WAIT_WARP;
  fail("deadlock: %d threads wait in __syncthreads, %d in warp collectives, %d have exited, none can run", at_bar,
       at_warp, w.exited);
}

void release_barrier(Worker& w) {
  if (w.bar_arrived == 0 || w.bar_arrived + w.exited < w.n) return;
  for (int i = 0; i < w.n; ++i)
    if (w.threads[i].state == WAIT_BLOCK) w.threads[i].state = RUNNABLE;
  w.bar_arrived = 0;
}

[[noreturn]] void thread_exit(Worker& w, Thread& t) {
  t.state = EXITED;
  ++w.exited;
  Warp& W = w.warps[t.lin >> 5];
  const unsigned bit = 1u << (t.lin & 31);
  W.exited |= bit;
  for (int g = 0; g < W.ngroups; ++g)
    if (W.groups[g].mask & bit)
      fail("lane %d exits while lanes 0x%08x of its warp wait for it in %s(mask 0x%08x)", t.lin & 31,
           W.groups[g].arrived, op_name(W.groups[g].op), W.groups[g].mask);
  release_barrier(w);
  switch_away(w, t);
  abort();
}

}  // namespace

void thread_main(void* arg) {
  Thread& t = *static_cast<Thread*>(arg);
  Worker& w = *t.w;
  w.launch->kernel->thunk(w.launch->kernel->fn, w.launch->args);
  thread_exit(w, t);
}

namespace {

// The source lane of a shuffle, by the PTX rule for shfl.sync with CUDA's packing of `width`
// (clamp 31, or 0 for up; segment mask 32 - width); -1: out of range, the lane keeps its own value.
int shfl_source(WarpOp op, int lane, int b, int width) {
  const int seg = (32 - width) & 31, bval = b & 31;
  const int cval = op == SHFL_UP ? 0 : 31;
  const int max_lane = (lane & seg) | (cval & ~seg & 31), min_lane = lane & seg;
  int j = 0;
  bool ok = false;
  switch (op) {
    case SHFL_UP: j = lane - bval, ok = j >= max_lane; break;
    case SHFL_DOWN: j = lane + bval, ok = j <= max_lane; break;
    case SHFL_XOR: j = lane ^ bval, ok = j <= max_lane; break;
    default: j = min_lane | (bval & ~seg & 31), ok = j <= max_lane; break;
  }
  return ok ? j : -1;
}

void complete(Worker& w, int warp, const Group& g) {
  Thread* lanes = &w.threads[warp * 32];
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l)
    if ((g.mask >> l & 1u) && lanes[l].value) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    if (!(g.mask >> l & 1u)) continue;
    Thread& u = lanes[l];
    if (g.op <= SHFL_XOR) {
      const int j = shfl_source(g.op, l, u.b, u.width);
      if (j >= 0 && !(g.mask >> j & 1u))
        fail("%s(mask 0x%08x): lane %d reads lane %d, which is not in the mask (undefined)", op_name(g.op), g.mask, l,
             j);
      u.result = lanes[j < 0 ? l : j].value;
    } else {
      u.result = g.op == VOTE_BALLOT ? ballot : g.op == VOTE_ANY ? ballot != 0 : g.op == VOTE_ALL ? ballot == g.mask : 0;
    }
    u.state = RUNNABLE;
  }
}

Group& join_group(Warp& W, WarpOp op, unsigned mask) {
  for (int g = 0; g < W.ngroups; ++g) {
    Group& G = W.groups[g];
    if (G.mask == mask) {
      if (G.op != op)
        fail("divergent warp: lanes 0x%08x wait in %s, this lane calls %s with the same mask", G.arrived,
             op_name(G.op), op_name(op));
      return G;
    }
    if (G.mask & mask)
      fail("%s with mask 0x%08x overlaps lanes waiting in %s(mask 0x%08x)", op_name(op), mask, op_name(G.op), G.mask);
  }
  if (W.ngroups == 4) fail("more than 4 warp collectives of one warp in flight");
  W.groups[W.ngroups] = Group{mask, 0, op};
  return W.groups[W.ngroups++];
}

}  // namespace

void syncthreads() {
  Thread& t = me();
  Worker& w = *t.w;
  t.state = WAIT_BLOCK;
  ++w.bar_arrived;
  release_barrier(w);
  if (t.state != RUNNABLE) switch_away(w, t);
}

uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int b, int width) {
  Thread& t = me();
  Worker& w = *t.w;
  const int lane = t.lin & 31, wi = t.lin >> 5;
  const unsigned bit = 1u << lane;
  Warp& W = w.warps[wi];
  if (!(mask & bit)) fail("%s(mask 0x%08x) called by lane %d, which is not in the mask", op_name(op), mask, lane);
  if (mask & ~W.exists)
    fail("%s(mask 0x%08x) names lanes that do not exist (warp %d has lanes 0x%08x)", op_name(op), mask, wi, W.exists);
  if (mask & W.exited) fail("%s(mask 0x%08x) names lanes that have exited (0x%08x)", op_name(op), mask, W.exited);
  if (op <= SHFL_XOR && (width < 1 || width > 32 || (width & (width - 1))))
    fail("%s: width %d is not a power of two in 1..32", op_name(op), width);
  Group& G = join_group(W, op, mask);
  t.value = value, t.b = b, t.width = width;
  G.arrived |= bit;
  if (G.arrived == mask) {
    const Group done = G;
    G = W.groups[--W.ngroups];
    complete(w, wi, done);
  } else {
    t.state = WAIT_WARP;
    switch_away(w, t);
  }
  return t.result;
}

unsigned active_mask() {
  const Warp& W = me().w->warps[me().lin >> 5];
  return W.exists & ~W.exited;
}

long long clock_ticks() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::vector<KernelEntry>& registry() {
  static std::vector<KernelEntry> r;
  return r;
}

int add_kernel(KernelEntry entry) {
  registry().push_back(std::move(entry));
  return (int)registry().size();
}

}  // namespace lkv_emu
