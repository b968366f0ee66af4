// KV pool maintenance for localkv's GPU backend: write new K/V rows by slot mapping and
// copy whole blocks (copy-on-write of a shared partial block, recall of a swapped block).
//
// NVRTC-compatible: device code only, cuda_fp16.h only, extern "C" kernels.
//
// Layouts: one layer's K or V pool is [num_blocks, block_size, kv_heads, head_dim] __half;
// a slot is block_id * block_size + offset, so slot s's row starts at s * row
// (row = kv_heads * head_dim). The whole pool is [layers, num_blocks, block_size, row].
// A q8_0 / q4_0 pool holds each (token, kv head) row as head_dim / 32 GGUF blocks (kv_format.py):
// [num_blocks, block_size, kv_heads, head_dim / 32 * block bytes] bytes, written by write_rows_*.

#include <cuda_fp16.h>

__device__ __forceinline__ __half lkv_to_half(float x) { return __float2half(x); }
__device__ __forceinline__ __half lkv_to_half(__half x) { return x; }

// k/v: token t's row starts at k + t * k_tok_stride (elements) and is `row` contiguous
// elements (all kv heads). Slots < 0 are skipped (padding rows of a fixed-size batch).
// Grid-stride over n_tok * row elements; any grid/block shape.
template <typename T>
__device__ __forceinline__ void lkv_write_kv(__half* __restrict__ kc, __half* __restrict__ vc,
                                             const long long* __restrict__ slots, const T* __restrict__ k,
                                             const T* __restrict__ v, int n_tok, int row, long long k_tok_stride,
                                             long long v_tok_stride) {
  const long long total = (long long)n_tok * row;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const long long t = idx / row;
    const long long c = idx - t * row;
    const long long s = slots[t];
    if (s < 0) continue;
    kc[s * row + c] = lkv_to_half(k[t * k_tok_stride + c]);
    vc[s * row + c] = lkv_to_half(v[t * v_tok_stride + c]);
  }
}

extern "C" __global__ void write_kv_f16(__half* __restrict__ kc, __half* __restrict__ vc,
                                        const long long* __restrict__ slots, const __half* __restrict__ k,
                                        const __half* __restrict__ v, int n_tok, int row, long long k_tok_stride,
                                        long long v_tok_stride) {
  lkv_write_kv<__half>(kc, vc, slots, k, v, n_tok, row, k_tok_stride, v_tok_stride);
}

extern "C" __global__ void write_kv_f32(__half* __restrict__ kc, __half* __restrict__ vc,
                                        const long long* __restrict__ slots, const float* __restrict__ k,
                                        const float* __restrict__ v, int n_tok, int row, long long k_tok_stride,
                                        long long v_tok_stride) {
  lkv_write_kv<float>(kc, vc, slots, k, v, n_tok, row, k_tok_stride, v_tok_stride);
}

// Copy the first n_elems elements (n_tokens * row) of block src[p] onto block dst[p] in every
// layer, K and V. grid (n_pairs, n_layers), any block size. layer_stride = num_blocks *
// block_elems; block_elems = block_size * row. src and dst must not overlap (the caller
// checks src[p] != dst[p] and that no destination is also a source).
extern "C" __global__ void copy_blocks_f16(__half* __restrict__ kc, __half* __restrict__ vc,
                                           const int* __restrict__ src, const int* __restrict__ dst,
                                           long long layer_stride, long long block_elems, long long n_elems) {
  const int p = blockIdx.x;
  const long long layer = blockIdx.y;
  const long long so = layer * layer_stride + (long long)src[p] * block_elems;
  const long long dO = layer * layer_stride + (long long)dst[p] * block_elems;
  for (long long e = threadIdx.x; e < n_elems; e += blockDim.x) {
    kc[dO + e] = kc[so + e];
    vc[dO + e] = vc[so + e];
  }
}

// ---------------------------------------------------------------------------------------------
// Quantized rows, quantized once as they are written: one thread a 32-value block, with the
// scale kv_format.fit chooses (the same bytes): for each divisor of its table in order, the
// codes by llama.cpp's reference rounding over the scale as stored (f16) and their squared
// error against the block summed in
// kv_format._tree's order; the first least error wins. Every product, sum and difference is
// rounded on its own (__fmul_rn, __fadd_rn, __fsub_rn), never fused into an FMA.

__device__ __forceinline__ float lkv_to_float(float x) { return x; }
__device__ __forceinline__ float lkv_to_float(__half x) { return __half2float(x); }

// kv_format.DIVISORS (binary fractions: exact as written)
__constant__ float lkv_q8_0_divisors[17] = {127.f,   126.5f, 126.f,   125.5f, 125.f,   124.5f,
                                            124.f,   123.5f, 123.f,   122.5f, 122.f,   121.5f,
                                            121.f,   120.5f, 120.f,   119.5f, 119.f};
__constant__ float lkv_q4_0_divisors[17] = {-8.f,    -9.f,    -8.875f, -8.75f,  -8.625f, -8.5f,
                                            -8.375f, -8.25f,  -8.125f, -7.875f, -7.75f,  -7.625f,
                                            -7.5f,   -7.375f, -7.25f,  -7.125f, -7.f};

struct LkvQuantQ8_0 {  // q = roundf(x / d) in [-127, 127]: halves away from zero
  static constexpr int bytes = 34;
  static __device__ __forceinline__ float ref(const float* v) {  // the largest magnitude
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
    return amax;
  }
  static __device__ __forceinline__ const float* divisors() { return lkv_q8_0_divisors; }
  static __device__ __forceinline__ float code(float y) { return fminf(fmaxf(roundf(y), -127.f), 127.f); }
  static __device__ __forceinline__ float value(float c) { return c; }
  static __device__ __forceinline__ void store(unsigned char* out, const float* v, float id) {
    signed char* q = reinterpret_cast<signed char*>(out + 2);
    for (int j = 0; j < 32; ++j) q[j] = (signed char)code(__fmul_rn(v[j], id));
  }
};

struct LkvQuantQ4_0 {  // n = trunc(x / d + 8.5) in [0, 15], the value n - 8
  static constexpr int bytes = 18;
  static __device__ __forceinline__ float ref(const float* v) {  // the value of largest magnitude, the first
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < 32; ++j) {
      if (amax < fabsf(v[j])) {
        amax = fabsf(v[j]);
        mx = v[j];
      }
    }
    return mx;
  }
  static __device__ __forceinline__ const float* divisors() { return lkv_q4_0_divisors; }
  static __device__ __forceinline__ float code(float y) { return fminf(fmaxf(truncf(__fadd_rn(y, 8.5f)), 0.f), 15.f); }
  static __device__ __forceinline__ float value(float c) { return __fsub_rn(c, 8.f); }
  static __device__ __forceinline__ void store(unsigned char* out, const float* v, float id) {
    for (int j = 0; j < 16; ++j) {
      const int lo = (int)code(__fmul_rn(v[j], id)), hi = (int)code(__fmul_rn(v[j + 16], id));
      out[2 + j] = (unsigned char)(lo | (hi << 4));
    }
  }
};

// kv_format.fit for one block: the scale d whose stored values err least, the first such
template <typename Q>
__device__ __forceinline__ float lkv_fit(const float* v) {
  const float r = Q::ref(v);
  const float* div = Q::divisors();
  float best_d = 0.f, best_err = 0.f;
  for (int k = 0; k < 17; ++k) {
    const float d = r / div[k];
    const float stored = __half2float(__float2half(d)), id = stored != 0.f ? 1.f / stored : 0.f;
    float e[32];
    for (int j = 0; j < 32; ++j) {
      const float diff = __fsub_rn(v[j], __fmul_rn(Q::value(Q::code(__fmul_rn(v[j], id))), stored));
      e[j] = __fmul_rn(diff, diff);
    }
    for (int h = 16; h >= 1; h /= 2)
      for (int j = 0; j < h; ++j) e[j] = __fadd_rn(e[j], e[j + h]);
    if (k == 0 || e[0] < best_err) {
      best_d = d;
      best_err = e[0];
    }
  }
  return best_d;
}

template <typename Q, typename T>
__device__ __forceinline__ void lkv_quant_block(unsigned char* __restrict__ out, const T* __restrict__ x) {
  float v[32];
  for (int j = 0; j < 32; ++j) v[j] = lkv_to_float(x[j]);
  const float d = lkv_fit<Q>(v);
  const __half stored = __float2half(d);
  *reinterpret_cast<__half*>(out) = stored;
  Q::store(out, v, __half2float(stored) != 0.f ? 1.f / __half2float(stored) : 0.f);
}

// x: token t's row for kv head h starts at x + t * tok_stride + h * hd. Slots < 0 are skipped.
// Grid-stride over n_tok * kvh * (hd / 32) blocks; any grid/block shape.
template <typename Q, typename T>
__device__ __forceinline__ void lkv_write_rows(void* __restrict__ pool, const long long* __restrict__ slots,
                                               const T* __restrict__ x, int n_tok, int kvh, int hd,
                                               long long tok_stride) {
  const int nb = hd / 32;
  const long long per_tok = (long long)kvh * nb;
  const long long total = n_tok * per_tok;
  const long long step = (long long)gridDim.x * blockDim.x;
  unsigned char* out = static_cast<unsigned char*>(pool);
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += step) {
    const long long t = idx / per_tok;
    const int r = (int)(idx - t * per_tok);
    const int h = r / nb, b = r - h * nb;
    const long long s = slots[t];
    if (s < 0) continue;
    lkv_quant_block<Q, T>(out + ((s * kvh + h) * nb + b) * Q::bytes, x + t * tok_stride + (long long)h * hd + b * 32);
  }
}

#define LKV_WRITE_ROWS_KERNEL(NAME, Q, T)                                                                       \
  extern "C" __global__ void NAME(void* __restrict__ pool, const long long* __restrict__ slots,                \
                                  const T* __restrict__ x, int n_tok, int kvh, int hd, long long tok_stride) { \
    lkv_write_rows<Q, T>(pool, slots, x, n_tok, kvh, hd, tok_stride);                                          \
  }

LKV_WRITE_ROWS_KERNEL(write_rows_q8_0_f16, LkvQuantQ8_0, __half)
LKV_WRITE_ROWS_KERNEL(write_rows_q8_0_f32, LkvQuantQ8_0, float)
LKV_WRITE_ROWS_KERNEL(write_rows_q4_0_f16, LkvQuantQ4_0, __half)
LKV_WRITE_ROWS_KERNEL(write_rows_q4_0_f32, LkvQuantQ4_0, float)
