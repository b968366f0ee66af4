// Fused element-wise ops of localkv's GPU backend: RMSNorm, RoPE (rotate halves, "NEOX"
// order, in place), SiLU(gate) * up. fp32 arithmetic whatever the storage type.
//
// NVRTC-compatible: device code only, cuda_fp16.h only, extern "C" kernels; each op comes
// as _f16 (activations __half) and _f32 (activations float). Norm weights and RoPE tables
// are always float.

#include <cuda_fp16.h>

__device__ __forceinline__ float lkv_f(float x) { return x; }
__device__ __forceinline__ float lkv_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T lkv_from_f(float x);
template <> __device__ __forceinline__ float lkv_from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half lkv_from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float lkv_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w. grid (rows), block a multiple of 32 (<= 1024).
// x and out are [rows, D] contiguous (out may alias x).
template <typename T>
__device__ __forceinline__ void lkv_rmsnorm(T* out, const T* x, const float* __restrict__ w, int D, float eps) {
  __shared__ float red[32];
  const long long r = blockIdx.x;
  const T* xr = x + r * D;
  T* orow = out + r * D;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = lkv_f(xr[i]);
    ss += v * v;
  }
  ss = lkv_warp_sum(ss);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  if (lane == 0) red[warp] = ss;
  __syncthreads();
  if (warp == 0) {
    float v = lane < nw ? red[lane] : 0.f;
    v = lkv_warp_sum(v);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(red[0] / (float)D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) orow[i] = lkv_from_f<T>(lkv_f(xr[i]) * inv * w[i]);
}

extern "C" __global__ void rmsnorm_f16(__half* out, const __half* x, const float* __restrict__ w, int D, float eps) {
  lkv_rmsnorm<__half>(out, x, w, D, eps);
}
extern "C" __global__ void rmsnorm_f32(float* out, const float* x, const float* __restrict__ w, int D, float eps) {
  lkv_rmsnorm<float>(out, x, w, D, eps);
}

// In place on x [n_tok, heads, hd] with element strides (tok_stride, head_stride, 1):
// x1, x2 = halves (rope_*: "neox" order, values i and i + hd/2) or adjacent pairs (rope_pairs_*:
// llama.cpp's "normal" order, values 2i and 2i + 1); x1' = x1 c - x2 s; x2' = x2 c + x1 s with
// c, s of frequency i. cos/sin [n_tok, hd/2] contiguous. Grid-stride over n_tok * heads * hd/2.
template <typename T, bool PAIRS>
__device__ __forceinline__ void lkv_rope(T* x, const float* __restrict__ cosv, const float* __restrict__ sinv,
                                         int n_tok, int heads, int half, long long tok_stride,
                                         long long head_stride) {
  const long long total = (long long)n_tok * heads * half;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const long long i = idx % half;
    const long long rh = idx / half;
    const long long h = rh % heads;
    const long long t = rh / heads;
    T* p = x + t * tok_stride + h * head_stride;
    const float c = cosv[t * half + i], s = sinv[t * half + i];
    const long long a = PAIRS ? 2 * i : i, b = PAIRS ? 2 * i + 1 : i + half;
    const float x1 = lkv_f(p[a]), x2 = lkv_f(p[b]);
    p[a] = lkv_from_f<T>(x1 * c - x2 * s);
    p[b] = lkv_from_f<T>(x2 * c + x1 * s);
  }
}

extern "C" __global__ void rope_f16(__half* x, const float* __restrict__ cosv, const float* __restrict__ sinv,
                                    int n_tok, int heads, int half, long long tok_stride, long long head_stride) {
  lkv_rope<__half, false>(x, cosv, sinv, n_tok, heads, half, tok_stride, head_stride);
}
extern "C" __global__ void rope_f32(float* x, const float* __restrict__ cosv, const float* __restrict__ sinv,
                                    int n_tok, int heads, int half, long long tok_stride, long long head_stride) {
  lkv_rope<float, false>(x, cosv, sinv, n_tok, heads, half, tok_stride, head_stride);
}
extern "C" __global__ void rope_pairs_f16(__half* x, const float* __restrict__ cosv, const float* __restrict__ sinv,
                                          int n_tok, int heads, int half, long long tok_stride,
                                          long long head_stride) {
  lkv_rope<__half, true>(x, cosv, sinv, n_tok, heads, half, tok_stride, head_stride);
}
extern "C" __global__ void rope_pairs_f32(float* x, const float* __restrict__ cosv, const float* __restrict__ sinv,
                                          int n_tok, int heads, int half, long long tok_stride,
                                          long long head_stride) {
  lkv_rope<float, true>(x, cosv, sinv, n_tok, heads, half, tok_stride, head_stride);
}

// out [n_tok, F] = silu(gu[:, :F]) * gu[:, F:], gu [n_tok, 2F] contiguous. Grid-stride.
template <typename T>
__device__ __forceinline__ void lkv_silu_mul(T* __restrict__ out, const T* __restrict__ gu, int n_tok, int F) {
  const long long total = (long long)n_tok * F;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const long long t = idx / F;
    const long long i = idx - t * F;
    const float g = lkv_f(gu[t * 2 * F + i]);
    const float u = lkv_f(gu[t * 2 * F + F + i]);
    out[idx] = lkv_from_f<T>(g / (1.f + __expf(-g)) * u);
  }
}

extern "C" __global__ void silu_mul_f16(__half* __restrict__ out, const __half* __restrict__ gu, int n_tok, int F) {
  lkv_silu_mul<__half>(out, gu, n_tok, F);
}
extern "C" __global__ void silu_mul_f32(float* __restrict__ out, const float* __restrict__ gu, int n_tok, int F) {
  lkv_silu_mul<float>(out, gu, n_tok, F);
}
