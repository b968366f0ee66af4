// Kernels that pin down the emulator itself (tests/test_cuda_emu.py): warp shuffles and votes
// lane by lane, __syncthreads, static and dynamic shared memory, fp16 conversions and arithmetic,
// atomics across blocks, and the things a GPU leaves undefined or faults on.

#include <cuda_fp16.h>

// out[c, thread] for case c: each thread's value is 1000 * warp + lane; (op, arg, width) per case.
// op 0 __shfl_sync, 1 __shfl_up_sync, 2 __shfl_down_sync, 3 __shfl_xor_sync.
extern "C" __global__ void shuffles(int* out, const int* ops, const int* arg, const int* width, int cases) {
  const int v = 1000 * (threadIdx.x >> 5) + (threadIdx.x & 31);
  for (int c = 0; c < cases; ++c) {
    int r = 0;
    switch (ops[c]) {
      case 0: r = __shfl_sync(0xffffffffu, v, arg[c], width[c]); break;
      case 1: r = __shfl_up_sync(0xffffffffu, v, (unsigned)arg[c], width[c]); break;
      case 2: r = __shfl_down_sync(0xffffffffu, v, (unsigned)arg[c], width[c]); break;
      default: r = __shfl_xor_sync(0xffffffffu, v, arg[c], width[c]); break;
    }
    out[c * blockDim.x + threadIdx.x] = r;
  }
}

// Shuffles of other types, and votes: per lane, out[lane * 6 + k].
extern "C" __global__ void shuffle_types_and_votes(double* out, const int* pred) {
  const int lane = threadIdx.x & 31;
  const float f = 0.5f + lane;
  const double d = 1e10 + lane;
  const long long q = (1LL << 40) + lane;
  const __half h = __float2half(lane * 0.25f);
  const __half2 h2 = __floats2half2_rn(lane, -lane);
  out[lane * 6 + 0] = __shfl_xor_sync(0xffffffffu, f, 1);
  out[lane * 6 + 1] = __shfl_down_sync(0xffffffffu, d, 3);
  out[lane * 6 + 2] = (double)(__shfl_sync(0xffffffffu, q, 7) - (1LL << 40));
  out[lane * 6 + 3] = __half2float(__shfl_xor_sync(0xffffffffu, h, 16)) + __high2float(__shfl_sync(0xffffffffu, h2, 5));
  out[lane * 6 + 4] = (double)__ballot_sync(0xffffffffu, pred[lane]);
  out[lane * 6 + 5] = __any_sync(0xffffffffu, pred[lane]) * 2 + __all_sync(0xffffffffu, pred[lane]);
}

// A partial-warp shuffle: lanes 0-15 and 16-31 shuffle separately, with their own masks.
extern "C" __global__ void half_warps(int* out) {
  const int lane = threadIdx.x & 31;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  int v = lane;
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  out[lane] = v;
}

// Block sum through shared memory, a tree of __syncthreads (blockDim.x a power of two <= 1024),
// then a warp reduction of the per-block partials in dynamic shared memory.
extern "C" __global__ void block_sum(float* out, const float* x, int n) {
  __shared__ float s[1024];
  extern __shared__ float dyn[];
  const int t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  s[t] = i < n ? x[i] : 0.f;
  __syncthreads();
  for (int h = blockDim.x / 2; h > 0; h >>= 1) {
    if (t < h) s[t] += s[t + h];
    __syncthreads();
  }
  dyn[t] = s[0] + t;  // every thread writes, then thread 0 reads the others' after the barrier
  __syncthreads();
  if (t == 0) {
    float check = 0.f;
    for (int k = 0; k < (int)blockDim.x; ++k) check += dyn[k] - k;
    out[blockIdx.x] = check / blockDim.x;
  }
}

// Threads exit early: the rest still meet at __syncthreads (exited threads count as arrived).
extern "C" __global__ void early_exit(int* out) {
  __shared__ int s[256];
  if (threadIdx.x >= 100) return;
  s[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = s[99 - threadIdx.x];
}

extern "C" __global__ void half_convert(unsigned short* to_half, float* to_float, const float* f,
                                        const unsigned short* h, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    to_half[i] = __half_as_ushort(__float2half(f[i]));
    to_float[i] = __half2float(__ushort_as_half(h[i]));
  }
}

// out[4 * i + k]: __hadd2, __hmul2 (both halves), __hfma2 (low half), __hsub (scalar).
extern "C" __global__ void half_math(__half* out, const __half2* a, const __half2* b, const __half2* c, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const __half2 s = __hadd2(a[i], b[i]), p = __hmul2(a[i], b[i]), f = __hfma2(a[i], b[i], c[i]);
  out[8 * i + 0] = __low2half(s);
  out[8 * i + 1] = __high2half(s);
  out[8 * i + 2] = __low2half(p);
  out[8 * i + 3] = __high2half(p);
  out[8 * i + 4] = __low2half(f);
  out[8 * i + 5] = __high2half(f);
  out[8 * i + 6] = __hsub(__low2half(a[i]), __high2half(b[i]));
  out[8 * i + 7] = __float2half(__expf(__low2float(a[i])));
}

extern "C" __global__ void atomics(float* fsum, int* isum, unsigned long long* usum, int* imax) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(fsum, 1.0f);
  atomicAdd(isum, i);
  atomicAdd(usum, 1ull);
  atomicMax(imax, i);
}

// 3-D grid and block indices: out[linear thread] = packed (block, thread) coordinates.
extern "C" __global__ void __launch_bounds__(64) indices(int* out) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int n = blockDim.x * blockDim.y * blockDim.z;
  out[b * n + t] = (blockIdx.z << 24) | (blockIdx.y << 18) | (blockIdx.x << 12) | (threadIdx.z << 8) |
                   (threadIdx.y << 4) | threadIdx.x;
}

// Scalar argument types, echoed back.
extern "C" __global__ void scalars(double* out, int i, long long q, float f, double d, unsigned u, __half h) {
  out[0] = i, out[1] = (double)q, out[2] = f, out[3] = d, out[4] = u, out[5] = __half2float(h);
}

// ---------------------------------------------------------------- undefined or faulting on a GPU

extern "C" __global__ void read_past_end(float* out, const float* x, int n) {
  out[threadIdx.x] = x[n + threadIdx.x];  // thread 0 reads x[n]: one past the end
}

extern "C" __global__ void write_at(float* x, int i) { x[i] = 1.f; }

extern "C" __global__ void write_readonly(const float* x) { const_cast<float*>(x)[threadIdx.x] = 1.f; }

extern "C" __global__ void misaligned_half2(float* out, const __half* x) {
  const __half2 v = *reinterpret_cast<const __half2*>(x + 1);  // 2-byte aligned: a 4-byte load faults
  out[threadIdx.x] = __low2float(v);
}

extern "C" __global__ void shuffle_after_exit(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);  // names lanes 16-31, which have exited
}

extern "C" __global__ void barrier_deadlock(float* out) {
  float v = 1.f;
  if (threadIdx.x < 16)
    __syncthreads();  // waits for lanes 16-31 ...
  else
    v = __shfl_xor_sync(0xffffffffu, v, 1);  // ... which wait for lanes 0-15 here
  out[threadIdx.x] = v;
}

extern "C" __global__ void shuffle_outside_mask(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, (int)threadIdx.x, 20);  // lane 20 is not in the mask
}

extern "C" __global__ void deep_recursion(int* out, int depth);

__device__ int recurse(int d) {
  volatile char pad[1024];
  pad[0] = (char)d;
  return d <= 0 ? pad[0] : recurse(d - 1) + pad[0];
}

extern "C" __global__ void deep_recursion(int* out, int depth) { out[threadIdx.x] = recurse(depth); }

// A shuffle-bound loop, to measure the emulator's cost per lane per collective.
extern "C" __global__ void shuffle_loop(float* out, int iters) {
  float v = threadIdx.x;
  for (int i = 0; i < iters; ++i) v += __shfl_xor_sync(0xffffffffu, v, 1 + (i & 15)) * 1e-3f;
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
