// CUDA device code compiled by g++ for the CPU: force-included (-include cuda_shim.h -x c++) in
// front of an unchanged .cu file. Each emulated CUDA thread is a fiber (runtime.cpp) with its own
// stack; the fibers of a block run on one OS thread, so `__shared__` (thread_local at block scope,
// hence static) is one object per block in flight, and __syncthreads / warp collectives are points
// where a fiber waits for the others of its block / warp.
//
// Strict where a GPU is undefined: a warp collective whose mask names an exited lane or that reads
// a lane outside the mask, a misaligned __half2 / vector access and a deadlock end the launch with
// an error instead of returning garbage.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ thread_local  // block scope: static, one per worker thread (= per block in flight)
#define __launch_bounds__(...)

#ifdef LKV_EMU_SCAN  // build.py preprocesses with these to find kernels, launch bounds, dynamic smem
#undef __global__
#undef __shared__
#undef __launch_bounds__
#define __global__ __lkv_global__
#define __shared__ __lkv_shared__
#define __launch_bounds__(...) __lkv_lb__(__VA_ARGS__)
#endif

#define __CUDACC__ 1
#define __CUDA_ARCH__ 800
#define warpSize 32
#define LKV_EMU_DYN_SMEM_BYTES (227 << 10)  // storage per extern __shared__ array: the most any GPU allows

// ---------------------------------------------------------------- vector types

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace lkv_emu {
struct Ctx {  // what one emulated thread sees as threadIdx, blockIdx, blockDim, gridDim
  uint3 tid, bid;
  dim3 bdim, gdim;
};
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] void misaligned(const void* p, unsigned align, const char* type);
inline void check_align(const void* p, unsigned align, const char* type) {
  if (reinterpret_cast<uintptr_t>(p) & (align - 1)) misaligned(p, align, type);
}
void syncthreads();
enum WarpOp { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, VOTE_BALLOT, VOTE_ANY, VOTE_ALL, SYNC_WARP };
uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int b, int width);
unsigned active_mask();
long long clock_ticks();
}  // namespace lkv_emu

// The running emulated thread, found from the stack pointer: each has its stack in a slot of
// STACK_SLOT bytes, aligned to STACK_SLOT, whose first word points at its Ctx (no thread-local
// storage lookup on every threadIdx read; launch.cpp lays the slots out).
namespace lkv_emu {
constexpr uintptr_t STACK_SLOT = 128 << 10;
inline Ctx* current() {
  const uintptr_t sp = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  return *reinterpret_cast<Ctx**>(sp & ~(STACK_SLOT - 1));
}
}  // namespace lkv_emu
#define lkv_emu_cur (::lkv_emu::current())

#define threadIdx (static_cast<const uint3&>(lkv_emu_cur->tid))
#define blockIdx (static_cast<const uint3&>(lkv_emu_cur->bid))
#define blockDim (static_cast<const dim3&>(lkv_emu_cur->bdim))
#define gridDim (static_cast<const dim3&>(lkv_emu_cur->gdim))

// Vector types: aligned like CUDA's; copying one from a misaligned address fails the launch, as a
// misaligned vector load or store faults on a GPU.
#define LKV_VEC2(T, E, A)                                                                    \
  struct __attribute__((aligned(A))) T {                                                     \
    E x, y;                                                                                  \
    T() = default;                                                                           \
    constexpr T(E a, E b) : x(a), y(b) {}                                                    \
    T(const T& o) : x(o.x), y(o.y) { lkv_emu::check_align(&o, A, #T); }                     \
    T& operator=(const T& o) {                                                               \
      lkv_emu::check_align(this, A, #T);                                                     \
      lkv_emu::check_align(&o, A, #T);                                                       \
      x = o.x;                                                                               \
      y = o.y;                                                                               \
      return *this;                                                                          \
    }                                                                                        \
  };                                                                                         \
  inline T make_##T(E a, E b) { return T(a, b); }
#define LKV_VEC4(T, E, A)                                                                    \
  struct __attribute__((aligned(A))) T {                                                     \
    E x, y, z, w;                                                                            \
    T() = default;                                                                           \
    constexpr T(E a, E b, E c, E d) : x(a), y(b), z(c), w(d) {}                              \
    T(const T& o) : x(o.x), y(o.y), z(o.z), w(o.w) { lkv_emu::check_align(&o, A, #T); }     \
    T& operator=(const T& o) {                                                               \
      lkv_emu::check_align(this, A, #T);                                                     \
      lkv_emu::check_align(&o, A, #T);                                                       \
      x = o.x, y = o.y, z = o.z, w = o.w;                                                    \
      return *this;                                                                          \
    }                                                                                        \
  };                                                                                         \
  inline T make_##T(E a, E b, E c, E d) { return T(a, b, c, d); }

LKV_VEC2(float2, float, 8)
LKV_VEC2(int2, int, 8)
LKV_VEC2(uint2, unsigned, 8)
LKV_VEC2(double2, double, 16)
LKV_VEC4(float4, float, 16)
LKV_VEC4(int4, int, 16)
LKV_VEC4(uint4, unsigned, 16)

// ---------------------------------------------------------------- bit casts, integer and float intrinsics

template <typename To, typename From>
inline To lkv_bits(From f) {
  static_assert(sizeof(To) == sizeof(From), "bit cast between sizes");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}
inline float __int_as_float(int x) { return lkv_bits<float>(x); }
inline int __float_as_int(float x) { return lkv_bits<int>(x); }
inline float __uint_as_float(unsigned x) { return lkv_bits<float>(x); }
inline unsigned __float_as_uint(float x) { return lkv_bits<unsigned>(x); }
inline double __longlong_as_double(long long x) { return lkv_bits<double>(x); }
inline long long __double_as_longlong(double x) { return lkv_bits<long long>(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}

// min/max as CUDA's overloads: integers compare exactly, floating point as fminf/fmaxf
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) return fmin((C)a, (C)b);
  else return (C)a < (C)b ? (C)a : (C)b;
}
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) return fmax((C)a, (C)b);
  else return (C)a < (C)b ? (C)b : (C)a;
}

// The fast-math intrinsics as the GPU computes them: __expf is ex2.approx(x * log2 e) with the
// product rounded to float, results below FLT_MIN flushed to zero; __logf is lg2.approx(x) * ln 2.
inline float __expf(float x) {
  const float r = exp2f(x * 1.4426950408889634f);
  return r < 1.17549435e-38f ? 0.f : r;
}
inline float __logf(float x) { return log2f(x) * 0.6931471805599453f; }
inline float __log2f(float x) { return log2f(x); }
inline float __exp10f(float x) { return exp2f(x * 3.3219280948873622f); }
inline float __powf(float a, float b) { return exp2f(b * log2f(a)); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.f / sqrtf(x); }
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// ---------------------------------------------------------------- synchronisation and warp collectives

inline void __syncthreads() { lkv_emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { lkv_emu::warp_op(lkv_emu::SYNC_WARP, mask, 0, 0, 32); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned __activemask() { return lkv_emu::active_mask(); }
inline long long clock64() { return lkv_emu::clock_ticks(); }

template <typename T>
inline T lkv_shfl(lkv_emu::WarpOp op, unsigned mask, const T& var, int b, int width) {
  static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, static_cast<const void*>(&var), sizeof(T));
  bits = lkv_emu::warp_op(op, mask, bits, b, width);
  T out = var;
  memcpy(static_cast<void*>(&out), &bits, sizeof(T));
  return out;
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return lkv_shfl(lkv_emu::SHFL_IDX, mask, var, src_lane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return lkv_shfl(lkv_emu::SHFL_UP, mask, var, (int)delta, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return lkv_shfl(lkv_emu::SHFL_DOWN, mask, var, (int)delta, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return lkv_shfl(lkv_emu::SHFL_XOR, mask, var, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)lkv_emu::warp_op(lkv_emu::VOTE_BALLOT, mask, pred != 0, 0, 32);
}
inline int __any_sync(unsigned mask, int pred) { return (int)lkv_emu::warp_op(lkv_emu::VOTE_ANY, mask, pred != 0, 0, 32); }
inline int __all_sync(unsigned mask, int pred) { return (int)lkv_emu::warp_op(lkv_emu::VOTE_ALL, mask, pred != 0, 0, 32); }

// ---------------------------------------------------------------- atomics (blocks may run on several OS threads)

template <typename T>
inline T* lkv_atomic_ptr(T* p) {
  lkv_emu::check_align(p, sizeof(T), "atomic operand");
  return p;
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(lkv_atomic_ptr(p), v, __ATOMIC_RELAXED);
}
template <typename T, typename F>
inline T lkv_atomic_update(T* p, F f) {  // compare-and-swap loop for the floating-point operations
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  Bits* q = reinterpret_cast<Bits*>(lkv_atomic_ptr(p));
  Bits old = __atomic_load_n(q, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(q, &old, lkv_bits<Bits>(f(lkv_bits<T>(old))), false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return lkv_bits<T>(old);
}
inline float atomicAdd(float* p, float v) {
  return lkv_atomic_update(p, [v](float o) { return o + v; });
}
inline double atomicAdd(double* p, double v) {
  return lkv_atomic_update(p, [v](double o) { return o + v; });
}
template <typename T>
inline T atomicSub(T* p, T v) {
  return __atomic_fetch_sub(lkv_atomic_ptr(p), v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicExch(T* p, T v) {
  return __atomic_exchange_n(lkv_atomic_ptr(p), v, __ATOMIC_RELAXED);
}
inline float atomicExch(float* p, float v) {
  return lkv_atomic_update(p, [v](float) { return v; });
}
template <typename T>
inline T atomicCAS(T* p, T expected, T desired) {
  __atomic_compare_exchange_n(lkv_atomic_ptr(p), &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return expected;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  T old = __atomic_load_n(lkv_atomic_ptr(p), __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
  T old = __atomic_load_n(lkv_atomic_ptr(p), __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
inline T atomicAnd(T* p, T v) {
  return __atomic_fetch_and(lkv_atomic_ptr(p), v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicOr(T* p, T v) {
  return __atomic_fetch_or(lkv_atomic_ptr(p), v, __ATOMIC_RELAXED);
}
template <typename T>
inline T atomicXor(T* p, T v) {
  return __atomic_fetch_xor(lkv_atomic_ptr(p), v, __ATOMIC_RELAXED);
}

#include "include/cuda_fp16.h"  // __half, __half2 and their functions
