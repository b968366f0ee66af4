// Paged attention over localkv's block pool (K/V rows in f16, q8_0 or q4_0; fp32 accumulation).
//
// NVRTC-compatible: device code only, no system headers beyond cuda_fp16.h, every
// kernel extern "C" so CuPy's RawModule finds it by name. Loaded by
// localkv/backends/cuda_kernels.py, launched by cuda_attention.py.
//
// Layouts (element strides, all row-major):
//   K/V pool of one layer  [num_blocks, block_size, kv_heads, row]: a row is one token's HD
//                          values of one kv head in its format (kv_format.py's bytes): f16
//                          (2 * HD bytes), q8_0 (HD / 32 blocks of f16 d + 32 int8: 34 bytes),
//                          q4_0 (HD / 32 blocks of f16 d + 16 bytes of nibbles: 18 bytes);
//                          kf / vf name K's and V's formats (LKV_KV_F16, _Q8_0, _Q4_0)
//   block table            [B, bt_stride] int32, row b = sequence b's physical block ids
//   q                      token t, head h at q + t * q_tok_stride + h * HD (__half)
//   out                    [T, H, HD] contiguous (__half)
//   lse                    [T, H] float: log-sum-exp of each query row's scaled scores
//
// Head dim is a template parameter instantiated for HD in {32, 64, 96, 128, 256}
// (kernel names end in _hd<HD>); block size is a runtime argument (any value >= 1).
// Grouped-query attention: a thread block handles up to GMAX query heads that share
// one KV head, so each K/V row is read once for the whole group.
//
// Kernels:
//   paged_decode_hd*       one query token per sequence (batched over sequences);
//                          split-K over the context ("flash decoding"): grid.z walks
//                          partitions of part_size tokens, each writes an unnormalised
//                          partial (acc, max, sum) unless num_parts == 1, in which case
//                          it writes the final output directly.
//   paged_decode_reduce    merges the partials of paged_decode into out and lse.
//   paged_prefill_hd*      a chunk of T query tokens of one sequence (the last T of an
//                          n_ctx context): causal within the chunk, attends to every
//                          cached token before it; K/V tiles staged in shared memory.
//   attention_mass_hd*     adds, for each key of an n_ctx context, the attention weight
//                          it received summed over all T queries and H heads (H2O),
//                          using the lse written by the attention kernels.
//
// Quantized rows are read as they are stored, each value q * d exactly in fp32 (what the CPU's
// kv_format.decode gives); the format is a template parameter of the device code, chosen once per
// thread at the kernel's entry (lkv_kv_formats), so the f16 path runs the same loop as before.
// A quantized K multiplies a query rounded per 32 values as the CPU's integer scores round it
// (lkv_round_q): the same products, summed in fp32 (dp4a would be the integer form's next step).
//
// The -inf handling: a warp that saw no key keeps m = -inf, l = 0, acc = 0 and is given
// weight 0 when partials are merged; every (query, partition) that is written saw >= 1 key.

#include <cuda_fp16.h>

#ifndef LKV_DECODE_WARPS
#define LKV_DECODE_WARPS 4
#endif
#ifndef LKV_PREFILL_WARPS
#define LKV_PREFILL_WARPS 8
#endif
#ifndef LKV_PREFILL_TILE
#define LKV_PREFILL_TILE 32
#endif
#ifndef LKV_MASS_WARPS
#define LKV_MASS_WARPS 4
#endif

#define LKV_FULL_MASK 0xffffffffu

__device__ __forceinline__ float lkv_neg_inf() { return __int_as_float((int)0xff800000u); }

__device__ __forceinline__ float lkv_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(LKV_FULL_MASK, v, o);
  return v;
}

// Byte offset of token t's row for kv head kh (rows of row_bytes), read through a block table.
__device__ __forceinline__ long long lkv_row_offset(const int* __restrict__ bt, int t, int bs, int kvh, int kh,
                                                    int row_bytes) {
  const int bi = t / bs;
  const long long blk = (long long)bt[bi];
  const int off = t - bi * bs;
  return ((blk * bs + off) * kvh + kh) * (long long)row_bytes;
}

// ---------------------------------------------------------------------------------------------
// Row formats. pair(row, p): values 2p and 2p + 1 of a row (lane-owned pairs, as the f16 path
// reads half2); unit: what a tile copy moves at a time (rows of q8_0 / q4_0 are 2-byte aligned).

#define LKV_KV_F16 0
#define LKV_KV_Q8_0 1
#define LKV_KV_Q4_0 2

__device__ __forceinline__ float lkv_block_scale(const unsigned char* b) {
  return __half2float(*reinterpret_cast<const __half*>(b));
}

struct LkvKvF16 {
  typedef __half2 unit;
  static constexpr bool integer = false;
  static constexpr __host__ __device__ int row_bytes(int hd) { return 2 * hd; }
  static __device__ __forceinline__ float2 pair(const unsigned char* row, int p) {
    return __half22float2(reinterpret_cast<const __half2*>(row)[p]);
  }
};

struct LkvKvQ8_0 {  // block: d, then q[32] int8; value q * d
  typedef unsigned short unit;
  static constexpr bool integer = true;
  static constexpr __host__ __device__ int row_bytes(int hd) { return hd / 32 * 34; }
  static __device__ __forceinline__ float2 pair(const unsigned char* row, int p) {
    const unsigned char* b = row + (p >> 4) * 34;
    const float d = lkv_block_scale(b);
    const signed char* q = reinterpret_cast<const signed char*>(b + 2 + 2 * (p & 15));
    return make_float2((float)q[0] * d, (float)q[1] * d);
  }
};

struct LkvKvQ4_0 {  // block: d, then 16 bytes: value c < 16 the low nibble of byte c, else the high of c - 16
  typedef unsigned short unit;
  static constexpr bool integer = true;
  static constexpr __host__ __device__ int row_bytes(int hd) { return hd / 32 * 18; }
  static __device__ __forceinline__ float2 pair(const unsigned char* row, int p) {
    const unsigned char* b = row + (p >> 4) * 18;
    const float d = lkv_block_scale(b);
    const int c = 2 * (p & 15);
    const unsigned char* n = b + 2 + (c & 15);
    const int sh = c & 16 ? 4 : 0;
    return make_float2((float)(((n[0] >> sh) & 15) - 8) * d, (float)(((n[1] >> sh) & 15) - 8) * d);
  }
};

// body(K format, V format) for the pairs cuda_kernels.KV_PAIRS lists (each instantiation is
// compiled at start: all nine pairs took ten times the f16 kernels' compile time); nothing for
// another pair, which the backend sends to its CuPy path instead.
template <typename Body>
__device__ __forceinline__ void lkv_kv_formats(int kf, int vf, const Body& body) {
  switch (kf * 3 + vf) {
    case 0: body(LkvKvF16(), LkvKvF16()); break;
    case 4: body(LkvKvQ8_0(), LkvKvQ8_0()); break;
    case 5: body(LkvKvQ8_0(), LkvKvQ4_0()); break;
    case 8: body(LkvKvQ4_0(), LkvKvQ4_0()); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// One online-softmax step for GMAX heads of one warp: score s_j = q_j . k, then
// m, l, acc updated with v. Lane `lane` owns half2 pairs lane + 32 * i of the head dim.

template <int HD, int GMAX>
__device__ __forceinline__ void lkv_online_step(const float (&qr)[GMAX][(HD / 2 + 31) / 32][2],
                                                const float (&kf)[(HD / 2 + 31) / 32][2],
                                                const float (&vf)[(HD / 2 + 31) / 32][2], int ng,
                                                float (&m)[GMAX], float (&l)[GMAX],
                                                float (&acc)[GMAX][(HD / 2 + 31) / 32][2]) {
  constexpr int PPL = (HD / 2 + 31) / 32;
#pragma unroll
  for (int j = 0; j < GMAX; ++j) {
    if (j < ng) {  // ng is uniform across the block: no divergence around the shuffles
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < PPL; ++i) s += qr[j][i][0] * kf[i][0] + qr[j][i][1] * kf[i][1];
      s = lkv_warp_sum(s);
      const float mn = fmaxf(m[j], s);
      const float alpha = __expf(m[j] - mn);  // m = -inf -> 0
      const float p = __expf(s - mn);
      l[j] = l[j] * alpha + p;
#pragma unroll
      for (int i = 0; i < PPL; ++i) {
        acc[j][i][0] = acc[j][i][0] * alpha + p * vf[i][0];
        acc[j][i][1] = acc[j][i][1] * alpha + p * vf[i][1];
      }
      m[j] = mn;
    }
  }
}

// A query row (scaled, lane-owned pairs lane + 32 * i) rounded as a quantized K multiplies it
// (quant/fallback.quantize_activations; the CPU's integer scores): per 32 values, which are 16 lanes' pairs,
// d = amax / 127 and each value rint(x * (1 / d)) * d; 0 for a block of zeros, nan for one
// holding inf or nan. The products stay fp32 here: the CPU's scores up to rounding. Every lane
// of the warp calls it (the shuffles).
template <int PPL>
__device__ __forceinline__ void lkv_round_q(float (&x)[PPL][2]) {
#pragma unroll
  for (int i = 0; i < PPL; ++i) {
    float a = fmaxf(fabsf(x[i][0]), fabsf(x[i][1]));
    int bad = !(isfinite(x[i][0]) && isfinite(x[i][1]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      a = fmaxf(a, __shfl_xor_sync(LKV_FULL_MASK, a, o));
      bad |= __shfl_xor_sync(LKV_FULL_MASK, bad, o);
    }
    const float d = a / 127.f;
    const float inv = a > 0.f ? 1.f / d : 0.f;
#pragma unroll
    for (int c = 0; c < 2; ++c) x[i][c] = bad ? __int_as_float(0x7fc00000) : rintf(x[i][c] * inv) * d;
  }
}

template <int HD, int GMAX, typename KF>
__device__ __forceinline__ void lkv_load_q(const __half* __restrict__ qtok, int h0, int ng, float scale,
                                           float (&qr)[GMAX][(HD / 2 + 31) / 32][2]) {
  constexpr int NP = HD / 2;
  constexpr int PPL = (NP + 31) / 32;
  const int lane = threadIdx.x & 31;
  const __half2* q2 = reinterpret_cast<const __half2*>(qtok);
#pragma unroll
  for (int j = 0; j < GMAX; ++j) {
#pragma unroll
    for (int i = 0; i < PPL; ++i) {
      const int p = lane + 32 * i;
      float2 f = make_float2(0.f, 0.f);
      if (j < ng && p < NP) f = __half22float2(q2[(h0 + j) * NP + p]);
      qr[j][i][0] = f.x * scale;
      qr[j][i][1] = f.y * scale;
    }
    if constexpr (KF::integer) lkv_round_q<PPL>(qr[j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Decode: grid (kv_heads * head_chunks, B, num_parts), block LKV_DECODE_WARPS * 32 threads.

// The warps' partial results, merged at the end. Declared once in the kernel, not in the
// template: a __shared__ array in each format pair's instantiation would take room of its own.
template <int HD, int GMAX>
struct LkvDecodeShared {
  float m[LKV_DECODE_WARPS][GMAX];
  float l[LKV_DECODE_WARPS][GMAX];
  float acc[LKV_DECODE_WARPS][GMAX][HD];
};

template <int HD, int GMAX, typename KF, typename VF>
__device__ __forceinline__ void lkv_paged_decode(
    LkvDecodeShared<HD, GMAX>& sm, __half* __restrict__ out, float* __restrict__ lse,
    float* __restrict__ part_acc, float* __restrict__ part_ml, const __half* __restrict__ q,
    long long q_tok_stride, const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
    const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ ctx_lens, int ctx_fixed, int H,
    int kvh, int bs, int part_size, int num_parts, float scale) {
  constexpr int NP = HD / 2;
  constexpr int PPL = (NP + 31) / 32;
  constexpr int NW = LKV_DECODE_WARPS;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = H / kvh;
  const int hchunks = (g + GMAX - 1) / GMAX;
  const int kh = blockIdx.x / hchunks;
  const int hc = blockIdx.x - kh * hchunks;
  const int h0 = kh * g + hc * GMAX;
  const int ng = min(GMAX, g - hc * GMAX);
  const int b = blockIdx.y, part = blockIdx.z;
  const int ctx = ctx_fixed > 0 ? ctx_fixed : ctx_lens[b];
  const int start = part * part_size;
  const int end = min(start + part_size, ctx);
  if (start >= end) return;  // partition past this sequence's context: the reduce skips it
  const int* bt = block_tables + (long long)b * bt_stride;

  float qr[GMAX][PPL][2];
  lkv_load_q<HD, GMAX, KF>(q + (long long)b * q_tok_stride, h0, ng, scale, qr);

  float m[GMAX], l[GMAX], acc[GMAX][PPL][2];
#pragma unroll
  for (int j = 0; j < GMAX; ++j) {
    m[j] = lkv_neg_inf();
    l[j] = 0.f;
#pragma unroll
    for (int i = 0; i < PPL; ++i) acc[j][i][0] = acc[j][i][1] = 0.f;
  }

  for (int t = start + warp; t < end; t += NW) {
    const unsigned char* krow = kc + lkv_row_offset(bt, t, bs, kvh, kh, KF::row_bytes(HD));
    const unsigned char* vrow = vc + lkv_row_offset(bt, t, bs, kvh, kh, VF::row_bytes(HD));
    float kf[PPL][2], vf[PPL][2];
#pragma unroll
    for (int i = 0; i < PPL; ++i) {
      const int p = lane + 32 * i;
      float2 a = make_float2(0.f, 0.f), c = make_float2(0.f, 0.f);
      if (p < NP) {
        a = KF::pair(krow, p);
        c = VF::pair(vrow, p);
      }
      kf[i][0] = a.x; kf[i][1] = a.y;
      vf[i][0] = c.x; vf[i][1] = c.y;
    }
    lkv_online_step<HD, GMAX>(qr, kf, vf, ng, m, l, acc);
  }

  // merge the warps of this block
#pragma unroll
  for (int j = 0; j < GMAX; ++j) {
    if (j < ng) {
      if (lane == 0) {
        sm.m[warp][j] = m[j];
        sm.l[warp][j] = l[j];
      }
#pragma unroll
      for (int i = 0; i < PPL; ++i) {
        const int p = lane + 32 * i;
        if (p < NP) {
          sm.acc[warp][j][2 * p] = acc[j][i][0];
          sm.acc[warp][j][2 * p + 1] = acc[j][i][1];
        }
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < ng * HD; idx += blockDim.x) {
    const int j = idx / HD, d = idx - j * HD;
    float M = lkv_neg_inf();
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm.m[w][j]);
    float L = 0.f, A = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = sm.m[w][j];
      const float e = (mw == lkv_neg_inf()) ? 0.f : __expf(mw - M);
      L += sm.l[w][j] * e;
      A += sm.acc[w][j][d] * e;
    }
    const long long bh = (long long)b * H + h0 + j;
    if (num_parts == 1) {
      out[bh * HD + d] = __float2half(A / L);
      if (d == 0) lse[bh] = M + __logf(L);
    } else {
      const long long pi = bh * num_parts + part;
      part_acc[pi * HD + d] = A;
      if (d == 0) {
        part_ml[2 * pi] = M;
        part_ml[2 * pi + 1] = L;
      }
    }
  }
}

#define LKV_DECODE_KERNEL(HDV, GMAXV)                                                                            \
  extern "C" __global__ void __launch_bounds__(LKV_DECODE_WARPS * 32) paged_decode_hd##HDV(                      \
      __half* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_acc,                          \
      float* __restrict__ part_ml, const __half* __restrict__ q, long long q_tok_stride,                        \
      const void* __restrict__ kc, const void* __restrict__ vc, int kf, int vf,                                 \
      const int* __restrict__ block_tables, int bt_stride, const int* __restrict__ ctx_lens, int ctx_fixed,     \
      int H, int kvh, int bs, int part_size, int num_parts, float scale) {                                      \
    __shared__ LkvDecodeShared<HDV, GMAXV> sm;                                                                  \
    const unsigned char* k8 = static_cast<const unsigned char*>(kc);                                            \
    const unsigned char* v8 = static_cast<const unsigned char*>(vc);                                            \
    lkv_kv_formats(kf, vf, [&](auto K, auto V) {                                                                \
      lkv_paged_decode<HDV, GMAXV, decltype(K), decltype(V)>(sm, out, lse, part_acc, part_ml, q, q_tok_stride,  \
                                                             k8, v8, block_tables, bt_stride, ctx_lens,         \
                                                             ctx_fixed, H, kvh, bs, part_size, num_parts, scale); \
    });                                                                                                          \
  }

LKV_DECODE_KERNEL(32, 8)
LKV_DECODE_KERNEL(64, 8)
LKV_DECODE_KERNEL(96, 8)
LKV_DECODE_KERNEL(128, 8)
LKV_DECODE_KERNEL(256, 4)

// Merge split-K partials: grid (H, B), any block size. part_acc [B, H, num_parts, HD],
// part_ml [B, H, num_parts, 2] (max, sum) as written by paged_decode_hd*.
extern "C" __global__ void paged_decode_reduce(__half* __restrict__ out, float* __restrict__ lse,
                                               const float* __restrict__ part_acc,
                                               const float* __restrict__ part_ml, const int* __restrict__ ctx_lens,
                                               int ctx_fixed, int H, int HD, int part_size, int num_parts) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int ctx = ctx_fixed > 0 ? ctx_fixed : ctx_lens[b];
  const int np = min(num_parts, (ctx + part_size - 1) / part_size);
  const long long bh = (long long)b * H + h;
  const long long base = bh * num_parts;
  float M = lkv_neg_inf();
  for (int p = 0; p < np; ++p) M = fmaxf(M, part_ml[2 * (base + p)]);
  float L = 0.f;
  for (int p = 0; p < np; ++p) L += part_ml[2 * (base + p) + 1] * __expf(part_ml[2 * (base + p)] - M);
  const float inv = 1.f / L;
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float A = 0.f;
    for (int p = 0; p < np; ++p) A += part_acc[(base + p) * HD + d] * __expf(part_ml[2 * (base + p)] - M);
    out[bh * HD + d] = __float2half(A * inv);
  }
  if (threadIdx.x == 0) lse[bh] = M + __logf(L);
}

// ---------------------------------------------------------------------------------------------
// Prefill: grid (ceil(T / LKV_PREFILL_WARPS), kv_heads * head_chunks), block LKV_PREFILL_WARPS * 32.
// Warp w of block x owns query i = x * LKV_PREFILL_WARPS + w, which sits at context index
// n_ctx - T + i and sees keys [0, n_ctx - T + i]. The block stages LKV_PREFILL_TILE keys at a
// time in shared memory as they are stored (rows of a quantized format take fewer bytes), up to
// the last visible key of its last query.

template <int HD>
struct LkvPrefillShared {  // a tile of K and V rows, room for f16's (the widest format)
  __align__(16) unsigned char k[LKV_PREFILL_TILE][2 * HD];
  __align__(16) unsigned char v[LKV_PREFILL_TILE][2 * HD];
};

// Rows t0 .. t0 + TILE - 1 (those below lim; zeros past it) of one kv head into a tile.
template <int HD, typename F>
__device__ __forceinline__ void lkv_stage_rows(unsigned char (&tile)[LKV_PREFILL_TILE][2 * HD],
                                               const unsigned char* __restrict__ pool, const int* __restrict__ bt,
                                               int t0, int lim, int bs, int kvh, int kh) {
  typedef typename F::unit U;
  constexpr int NU = F::row_bytes(HD) / (int)sizeof(U);
  for (int idx = threadIdx.x; idx < LKV_PREFILL_TILE * NU; idx += blockDim.x) {
    const int r = idx / NU, c = idx - r * NU;
    const int t = t0 + r;
    U u = U();
    if (t < lim) u = reinterpret_cast<const U*>(pool + lkv_row_offset(bt, t, bs, kvh, kh, F::row_bytes(HD)))[c];
    reinterpret_cast<U*>(tile[r])[c] = u;
  }
}

template <int HD, int GMAX, typename KF, typename VF>
__device__ __forceinline__ void lkv_paged_prefill(LkvPrefillShared<HD>& sm, __half* __restrict__ out,
                                                  float* __restrict__ lse, const __half* __restrict__ q,
                                                  long long q_tok_stride, const unsigned char* __restrict__ kc,
                                                  const unsigned char* __restrict__ vc, const int* __restrict__ bt,
                                                  int n_ctx, int T, int H, int kvh, int bs, float scale) {
  constexpr int NP = HD / 2;
  constexpr int PPL = (NP + 31) / 32;
  constexpr int TK = LKV_PREFILL_TILE;
  constexpr int NW = LKV_PREFILL_WARPS;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = H / kvh;
  const int hchunks = (g + GMAX - 1) / GMAX;
  const int kh = blockIdx.y / hchunks;
  const int hc = blockIdx.y - kh * hchunks;
  const int h0 = kh * g + hc * GMAX;
  const int ng = min(GMAX, g - hc * GMAX);

  const int past = n_ctx - T;
  const int first_q = blockIdx.x * NW;
  const int last_q = min(T - 1, first_q + NW - 1);
  const int i = first_q + warp;
  const bool valid = i < T;
  const int my_lim = valid ? past + i + 1 : 0;  // keys [0, my_lim)
  const int blk_lim = past + last_q + 1;

  float qr[GMAX][PPL][2];
  lkv_load_q<HD, GMAX, KF>(q + (long long)(valid ? i : 0) * q_tok_stride, h0, valid ? ng : 0, scale, qr);
  float m[GMAX], l[GMAX], acc[GMAX][PPL][2];
#pragma unroll
  for (int j = 0; j < GMAX; ++j) {
    m[j] = lkv_neg_inf();
    l[j] = 0.f;
#pragma unroll
    for (int x = 0; x < PPL; ++x) acc[j][x][0] = acc[j][x][1] = 0.f;
  }

  for (int t0 = 0; t0 < blk_lim; t0 += TK) {
    lkv_stage_rows<HD, KF>(sm.k, kc, bt, t0, blk_lim, bs, kvh, kh);
    lkv_stage_rows<HD, VF>(sm.v, vc, bt, t0, blk_lim, bs, kvh, kh);
    __syncthreads();
    const int rmax = min(TK, my_lim - t0);  // <= 0 for an invalid warp or a fully masked tile
    for (int r = 0; r < rmax; ++r) {
      float kf[PPL][2], vf[PPL][2];
#pragma unroll
      for (int x = 0; x < PPL; ++x) {
        const int p = lane + 32 * x;
        float2 a = make_float2(0.f, 0.f), c = make_float2(0.f, 0.f);
        if (p < NP) {
          a = KF::pair(sm.k[r], p);
          c = VF::pair(sm.v[r], p);
        }
        kf[x][0] = a.x; kf[x][1] = a.y;
        vf[x][0] = c.x; vf[x][1] = c.y;
      }
      lkv_online_step<HD, GMAX>(qr, kf, vf, ng, m, l, acc);
    }
    __syncthreads();
  }

  if (!valid) return;
#pragma unroll
  for (int j = 0; j < GMAX; ++j) {
    if (j < ng) {
      const long long row = (long long)i * H + h0 + j;
      const float inv = 1.f / l[j];
      __half2* o2 = reinterpret_cast<__half2*>(out + row * HD);
#pragma unroll
      for (int x = 0; x < PPL; ++x) {
        const int p = lane + 32 * x;
        if (p < NP) o2[p] = __floats2half2_rn(acc[j][x][0] * inv, acc[j][x][1] * inv);
      }
      if (lane == 0) lse[row] = m[j] + __logf(l[j]);
    }
  }
}

#define LKV_PREFILL_KERNEL(HDV, GMAXV)                                                                            \
  extern "C" __global__ void __launch_bounds__(LKV_PREFILL_WARPS * 32) paged_prefill_hd##HDV(                     \
      __half* __restrict__ out, float* __restrict__ lse, const __half* __restrict__ q, long long q_tok_stride,   \
      const void* __restrict__ kc, const void* __restrict__ vc, int kf, int vf, const int* __restrict__ bt,     \
      int n_ctx, int T, int H, int kvh, int bs, float scale) {                                                   \
    __shared__ LkvPrefillShared<HDV> sm;                                                                        \
    const unsigned char* k8 = static_cast<const unsigned char*>(kc);                                            \
    const unsigned char* v8 = static_cast<const unsigned char*>(vc);                                            \
    lkv_kv_formats(kf, vf, [&](auto K, auto V) {                                                                \
      lkv_paged_prefill<HDV, GMAXV, decltype(K), decltype(V)>(sm, out, lse, q, q_tok_stride, k8, v8, bt, n_ctx, \
                                                              T, H, kvh, bs, scale);                            \
    });                                                                                                          \
  }

LKV_PREFILL_KERNEL(32, 8)
LKV_PREFILL_KERNEL(64, 8)
LKV_PREFILL_KERNEL(96, 8)
LKV_PREFILL_KERNEL(128, 8)
LKV_PREFILL_KERNEL(256, 4)

// ---------------------------------------------------------------------------------------------
// Attention mass (H2O): grid ceil(n_ctx / LKV_MASS_WARPS), block LKV_MASS_WARPS * 32. Warp w
// owns key t and adds sum over visible queries i and heads h of exp(q_ih . k_t * scale - lse_ih)
// to mass[t]. One warp per key: no atomics, deterministic.

template <int HD, typename KF>
__device__ __forceinline__ void lkv_attention_mass(float* __restrict__ mass, const float* __restrict__ lse,
                                                   const __half* __restrict__ q, long long q_tok_stride,
                                                   const unsigned char* __restrict__ kc, const int* __restrict__ bt,
                                                   int n_ctx, int T, int H, int kvh, int bs, float scale) {
  constexpr int NP = HD / 2;
  constexpr int PPL = (NP + 31) / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * LKV_MASS_WARPS + warp;
  if (t >= n_ctx) return;  // whole warp leaves together
  const int g = H / kvh;
  const int past = n_ctx - T;
  const int i0 = max(0, t - past);  // first query that sees key t
  float total = 0.f;
  for (int kh = 0; kh < kvh; ++kh) {
    const unsigned char* krow = kc + lkv_row_offset(bt, t, bs, kvh, kh, KF::row_bytes(HD));
    float kf[PPL][2];
#pragma unroll
    for (int x = 0; x < PPL; ++x) {
      const int p = lane + 32 * x;
      float2 a = make_float2(0.f, 0.f);
      if (p < NP) a = KF::pair(krow, p);
      kf[x][0] = KF::integer ? a.x : a.x * scale;  // an integer K's query is scaled, then rounded
      kf[x][1] = KF::integer ? a.y : a.y * scale;
    }
    for (int i = i0; i < T; ++i) {
      for (int h = kh * g; h < (kh + 1) * g; ++h) {
        const __half2* q2 = reinterpret_cast<const __half2*>(q + (long long)i * q_tok_stride + (long long)h * HD);
        float qv[PPL][2];
#pragma unroll
        for (int x = 0; x < PPL; ++x) {
          const int p = lane + 32 * x;
          const float2 a = p < NP ? __half22float2(q2[p]) : make_float2(0.f, 0.f);
          qv[x][0] = KF::integer ? a.x * scale : a.x;
          qv[x][1] = KF::integer ? a.y * scale : a.y;
        }
        if constexpr (KF::integer) lkv_round_q<PPL>(qv);
        float s = 0.f;
#pragma unroll
        for (int x = 0; x < PPL; ++x) s += qv[x][0] * kf[x][0] + qv[x][1] * kf[x][1];
        s = lkv_warp_sum(s);
        total += __expf(s - lse[(long long)i * H + h]);
      }
    }
  }
  if (lane == 0) mass[t] += total;
}

#define LKV_MASS_KERNEL(HDV)                                                                                     \
  extern "C" __global__ void __launch_bounds__(LKV_MASS_WARPS * 32) attention_mass_hd##HDV(                      \
      float* __restrict__ mass, const float* __restrict__ lse, const __half* __restrict__ q,                    \
      long long q_tok_stride, const void* __restrict__ kc, int kf, const int* __restrict__ bt, int n_ctx, int T, \
      int H, int kvh, int bs, float scale) {                                                                     \
    const unsigned char* k8 = static_cast<const unsigned char*>(kc);                                            \
    lkv_kv_formats(kf, kf, [&](auto K, auto) {                                                          \
      lkv_attention_mass<HDV, decltype(K)>(mass, lse, q, q_tok_stride, k8, bt, n_ctx, T, H, kvh, bs, scale);    \
    });                                                                                                          \
  }

LKV_MASS_KERNEL(32)
LKV_MASS_KERNEL(64)
LKV_MASS_KERNEL(96)
LKV_MASS_KERNEL(128)
LKV_MASS_KERNEL(256)
