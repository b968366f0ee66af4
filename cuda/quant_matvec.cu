// Quantized weights on the GPU: GGUF blocks kept as the file stores them, decoded in the kernel.
//
// NVRTC-compatible: device code only, cuda_fp16.h only, extern "C" kernels. Loaded by
// localkv/backends/cuda_quant.py.
//
// A weight W [N rows (outputs), K cols (inputs)] is N rows of row_bytes bytes, each row K / VALUES
// blocks of BYTES bytes (VALUES 32, or 256 for the K-quants). Every format is decoded 32 values
// (one "group") at a time: group g of a row is group g % (VALUES / 32) of block g / (VALUES / 32).
// Scales are fp16, little-endian, at even offsets (every block size is even), so they are read as
// __half; wider fields at odd or 2-aligned offsets are read byte by byte.
//
// Kernels, one of each per type (names end in the GGUF type in lower case):
//   quant_matvec_<t>  out [R, N] = x [R, K] @ W.T for 1 <= R <= 8 activation rows (decode steps):
//                     LKV_QMV_LANES lanes per weight row (32 / LKV_QMV_LANES rows per warp), lane
//                     j of a row takes its groups j, j + LKV_QMV_LANES, ...: the lanes of a row
//                     read adjacent blocks, and the sums need log2(LKV_QMV_LANES) shuffles per
//                     warp, not five per row. fp32 sums, written as fp16 or fp32 (out_f32). x
//                     fp16, rows ld_x apart (ld_x even, x 4-byte aligned: read as __half2); out
//                     rows ld_out apart. grid (ceil(N / (LKV_QMV_WARPS * 32 / LKV_QMV_LANES))),
//                     block (LKV_QMV_WARPS * 32).
//   dequant_f16_<t>   out [n_ids, K] fp16 = rows ids[i] of W (prefill tiles for cuBLAS, embedding
//                     lookups): one thread per group, grid-stride; out rows ld_out apart (ld_out
//                     even, out 4-byte aligned).
//
// Layouts (offsets in bytes within a block; d, dmin, m fp16):
//   Q4_0  18: d@0 qs[16]@2             value l<16: (qs[l] & 15) - 8, l>=16: (qs[l-16] >> 4) - 8; * d
//   Q4_1  20: d@0 m@2 qs[16]@4         nibble as Q4_0, * d + m
//   Q5_0  22: d@0 qh(u32)@2 qs[16]@6   nibble | bit l of qh << 4, - 16; * d
//   Q5_1  24: d@0 m@2 qh@4 qs[16]@8    as Q5_0 without the - 16, * d + m
//   Q8_0  34: d@0 qs[32]@2 (int8)      qs[l] * d
//   Q2_K  84: scales[16]@0 qs[64]@16 d@80 dmin@82
//             value i = 32j + l (l < 32): 2 bits at 2(j & 3) of qs[32(j >> 2) + l]; 16 values per
//             scale byte s = scales[i / 16]: d * (s & 15) * q - dmin * (s >> 4)
//   Q3_K 110: hmask[32]@0 qs[64]@32 scales[12]@96 d@108
//             q = 2 bits as Q2_K | bit j of hmask[l] << 2, value d * sc * (q - 4), sc the 6-bit
//             scale i / 16 (low 4 bits in scales[0..7], high 2 bits in scales[8..11]) minus 32
//   Q4_K 144: d@0 dmin@2 scales[12]@4 qs[128]@16
//             group j: nibble (j odd: high) of qs[32(j >> 1) + l]; scale/min pair j (6 bits each,
//             packed in 12 bytes): d * sc * q - dmin * mn
//   Q5_K 176: d@0 dmin@2 scales[12]@4 qh[32]@16 qs[128]@48   as Q4_K, q |= bit j of qh[l] << 4
//   Q6_K 210: ql[128]@0 qh[64]@128 scales[16]@192 (int8) d@208
//             value i = 128h + 32r + l: low 4 bits of ql[64h + 32(r & 1) + l] (r >= 2: high
//             nibble), high 2 bits at 2r of qh[32h + l]; d * scales[i / 16] * (q - 32)

#include <cuda_fp16.h>

#ifndef LKV_QMV_WARPS
#define LKV_QMV_WARPS 4
#endif
#ifndef LKV_QMV_LANES
#define LKV_QMV_LANES 4
#endif
#define LKV_QMV_MAX_ROWS 8
#define LKV_FULL_MASK 0xffffffffu

typedef unsigned char lkv_u8;

__device__ __forceinline__ float lkv_half_at(const lkv_u8* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

__device__ __forceinline__ unsigned lkv_u32_at(const lkv_u8* p) {
  return (unsigned)p[0] | ((unsigned)p[1] << 8) | ((unsigned)p[2] << 16) | ((unsigned)p[3] << 24);
}

// ---------------------------------------------------------------- one group of 32 values per type

struct LkvQ4_0 {
  static constexpr int VALUES = 32, BYTES = 18;
  static __device__ __forceinline__ void group(const lkv_u8* b, int, float (&v)[32]) {
    const float d = lkv_half_at(b);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int q = b[2 + l];
      v[l] = (float)((q & 15) - 8) * d;
      v[l + 16] = (float)((q >> 4) - 8) * d;
    }
  }
};

struct LkvQ4_1 {
  static constexpr int VALUES = 32, BYTES = 20;
  static __device__ __forceinline__ void group(const lkv_u8* b, int, float (&v)[32]) {
    const float d = lkv_half_at(b), m = lkv_half_at(b + 2);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int q = b[4 + l];
      v[l] = (float)(q & 15) * d + m;
      v[l + 16] = (float)(q >> 4) * d + m;
    }
  }
};

struct LkvQ5_0 {
  static constexpr int VALUES = 32, BYTES = 22;
  static __device__ __forceinline__ void group(const lkv_u8* b, int, float (&v)[32]) {
    const float d = lkv_half_at(b);
    const unsigned qh = lkv_u32_at(b + 2);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int q = b[6 + l];
      v[l] = (float)(((q & 15) | (int)(((qh >> l) & 1u) << 4)) - 16) * d;
      v[l + 16] = (float)(((q >> 4) | (int)(((qh >> (l + 16)) & 1u) << 4)) - 16) * d;
    }
  }
};

struct LkvQ5_1 {
  static constexpr int VALUES = 32, BYTES = 24;
  static __device__ __forceinline__ void group(const lkv_u8* b, int, float (&v)[32]) {
    const float d = lkv_half_at(b), m = lkv_half_at(b + 2);
    const unsigned qh = lkv_u32_at(b + 4);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
      const int q = b[8 + l];
      v[l] = (float)((q & 15) | (int)(((qh >> l) & 1u) << 4)) * d + m;
      v[l + 16] = (float)((q >> 4) | (int)(((qh >> (l + 16)) & 1u) << 4)) * d + m;
    }
  }
};

struct LkvQ8_0 {
  static constexpr int VALUES = 32, BYTES = 34;
  static __device__ __forceinline__ void group(const lkv_u8* b, int, float (&v)[32]) {
    const float d = lkv_half_at(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = (float)(signed char)b[2 + l] * d;
  }
};

struct LkvQ2_K {
  static constexpr int VALUES = 256, BYTES = 84;
  static __device__ __forceinline__ void group(const lkv_u8* b, int j, float (&v)[32]) {
    const float d = lkv_half_at(b + 80), dmin = lkv_half_at(b + 82);
    const lkv_u8* qs = b + 16 + 32 * (j >> 2);
    const int shift = 2 * (j & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int s = b[2 * j + h];
      const float sc = d * (float)(s & 15), mn = dmin * (float)(s >> 4);
#pragma unroll
      for (int l = 16 * h; l < 16 * h + 16; ++l) v[l] = sc * (float)((qs[l] >> shift) & 3) - mn;
    }
  }
};

struct LkvQ3_K {
  static constexpr int VALUES = 256, BYTES = 110;
  static __device__ __forceinline__ int scale(const lkv_u8* b, int t) {
    const int lo = (b[96 + (t & 7)] >> (4 * (t >> 3))) & 15;
    const int hi = (b[104 + (t & 3)] >> (2 * (t >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
  }
  static __device__ __forceinline__ void group(const lkv_u8* b, int j, float (&v)[32]) {
    const float d = lkv_half_at(b + 108);
    const lkv_u8* qs = b + 32 + 32 * (j >> 2);
    const int shift = 2 * (j & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sc = d * (float)scale(b, 2 * j + h);
#pragma unroll
      for (int l = 16 * h; l < 16 * h + 16; ++l) {
        const int q = ((qs[l] >> shift) & 3) | (((b[l] >> j) & 1) << 2);
        v[l] = sc * (float)(q - 4);
      }
    }
  }
};

// scale and min of group j from the 12 packed bytes at p (Q4_K, Q5_K)
__device__ __forceinline__ void lkv_k_scale_min(const lkv_u8* p, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = p[j] & 63;
    mn = p[j + 4] & 63;
  } else {
    sc = (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
    mn = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
  }
}

struct LkvQ4_K {
  static constexpr int VALUES = 256, BYTES = 144;
  static __device__ __forceinline__ void group(const lkv_u8* b, int j, float (&v)[32]) {
    int sc, mn;
    lkv_k_scale_min(b + 4, j, sc, mn);
    const float s = lkv_half_at(b) * (float)sc, m = lkv_half_at(b + 2) * (float)mn;
    const lkv_u8* qs = b + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = s * (float)((qs[l] >> shift) & 15) - m;
  }
};

struct LkvQ5_K {
  static constexpr int VALUES = 256, BYTES = 176;
  static __device__ __forceinline__ void group(const lkv_u8* b, int j, float (&v)[32]) {
    int sc, mn;
    lkv_k_scale_min(b + 4, j, sc, mn);
    const float s = lkv_half_at(b) * (float)sc, m = lkv_half_at(b + 2) * (float)mn;
    const lkv_u8* qh = b + 16;
    const lkv_u8* qs = b + 48 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) v[l] = s * (float)(((qs[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4)) - m;
  }
};

struct LkvQ6_K {
  static constexpr int VALUES = 256, BYTES = 210;
  static __device__ __forceinline__ void group(const lkv_u8* b, int j, float (&v)[32]) {
    const int h = j >> 2, r = j & 3;
    const float d = lkv_half_at(b + 208);
    const lkv_u8* ql = b + 64 * h + 32 * (r & 1);
    const lkv_u8* qh = b + 128 + 32 * h;
    const int lo_shift = 4 * (r >> 1), hi_shift = 2 * r;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sc = d * (float)(signed char)b[192 + 2 * j + half];
#pragma unroll
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int q = ((ql[l] >> lo_shift) & 15) | (((qh[l] >> hi_shift) & 3) << 4);
        v[l] = sc * (float)(q - 32);
      }
    }
  }
};

// ---------------------------------------------------------------- the kernels, for any format F

template <typename F>
__device__ __forceinline__ void lkv_decode_group(const lkv_u8* row, int g, float (&v)[32]) {
  constexpr int GPB = F::VALUES / 32;
  F::group(row + (long long)(g / GPB) * F::BYTES, g % GPB, v);
}

template <typename F>
__device__ __forceinline__ void lkv_quant_matvec(void* out, int out_f32, long long ld_out, const __half* __restrict__ x,
                                                 long long ld_x, int R, const lkv_u8* __restrict__ w, int N, int K,
                                                 long long row_bytes) {
  constexpr int ROWS_PER_WARP = 32 / LKV_QMV_LANES;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LKV_QMV_LANES;
  const int n = (blockIdx.x * LKV_QMV_WARPS + warp) * ROWS_PER_WARP + lane / LKV_QMV_LANES;
  // lanes past the last row still take part in the shuffles (every lane of the warp must), with no groups
  const int groups = n < N ? K / 32 : 0;
  const lkv_u8* row = w + (long long)(n < N ? n : 0) * row_bytes;
  float acc[LKV_QMV_MAX_ROWS];
#pragma unroll
  for (int r = 0; r < LKV_QMV_MAX_ROWS; ++r) acc[r] = 0.f;
  for (int g = sub; g < groups; g += LKV_QMV_LANES) {
    float v[32];
    lkv_decode_group<F>(row, g, v);
#pragma unroll
    for (int r = 0; r < LKV_QMV_MAX_ROWS; ++r) {
      if (r < R) {
        const __half2* xr = reinterpret_cast<const __half2*>(x + r * ld_x + (long long)g * 32);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float2 xf = __half22float2(xr[i]);
          s += v[2 * i] * xf.x + v[2 * i + 1] * xf.y;
        }
        acc[r] += s;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < LKV_QMV_MAX_ROWS; ++r) {
    if (r < R) {
      float s = acc[r];
#pragma unroll
      for (int o = LKV_QMV_LANES / 2; o > 0; o >>= 1) s += __shfl_xor_sync(LKV_FULL_MASK, s, o);  // within the row's lanes
      if (sub == 0 && n < N) {
        if (out_f32)
          static_cast<float*>(out)[r * ld_out + n] = s;
        else
          static_cast<__half*>(out)[r * ld_out + n] = __float2half(s);
      }
    }
  }
}

template <typename F>
__device__ __forceinline__ void lkv_dequant_f16(__half* out, long long ld_out, const lkv_u8* __restrict__ w,
                                                const int* __restrict__ ids, int n_ids, int K, long long row_bytes) {
  const int groups = K / 32;
  const long long total = (long long)n_ids * groups;
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (long long)gridDim.x * blockDim.x) {
    const int i = (int)(t / groups), g = (int)(t % groups);
    float v[32];
    lkv_decode_group<F>(w + (long long)ids[i] * row_bytes, g, v);
    __half2* o = reinterpret_cast<__half2*>(out + i * ld_out + (long long)g * 32);
#pragma unroll
    for (int k = 0; k < 16; ++k) o[k] = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
  }
}

#define LKV_QUANT_KERNELS(F, t)                                                                              \
  extern "C" __global__ void __launch_bounds__(LKV_QMV_WARPS * 32)                                         \
      quant_matvec_##t(void* out, int out_f32, long long ld_out, const __half* __restrict__ x, long long ld_x, \
                       int R, const lkv_u8* __restrict__ w, int N, int K, long long row_bytes) {             \
    lkv_quant_matvec<F>(out, out_f32, ld_out, x, ld_x, R, w, N, K, row_bytes);                             \
  }                                                                                                          \
  extern "C" __global__ void dequant_f16_##t(__half* out, long long ld_out, const lkv_u8* __restrict__ w,    \
                                             const int* __restrict__ ids, int n_ids, int K,                 \
                                             long long row_bytes) {                                          \
    lkv_dequant_f16<F>(out, ld_out, w, ids, n_ids, K, row_bytes);                                          \
  }

LKV_QUANT_KERNELS(LkvQ4_0, q4_0)
LKV_QUANT_KERNELS(LkvQ4_1, q4_1)
LKV_QUANT_KERNELS(LkvQ5_0, q5_0)
LKV_QUANT_KERNELS(LkvQ5_1, q5_1)
LKV_QUANT_KERNELS(LkvQ8_0, q8_0)
LKV_QUANT_KERNELS(LkvQ2_K, q2_k)
LKV_QUANT_KERNELS(LkvQ3_K, q3_k)
LKV_QUANT_KERNELS(LkvQ4_K, q4_k)
LKV_QUANT_KERNELS(LkvQ5_K, q5_k)
LKV_QUANT_KERNELS(LkvQ6_K, q6_k)
