// KV pool maintenance for localkv's GPU backend: write new K/V rows by slot mapping and
// copy whole blocks (copy-on-write of a shared partial block, recall of a swapped block).
//
// NVRTC-compatible: device code only, cuda_fp16.h only, extern "C" kernels.
//
// Layouts: one layer's K or V pool is [num_blocks, block_size, kv_heads, head_dim] __half;
// a slot is block_id * block_size + offset, so slot s's row starts at s * row
// (row = kv_heads * head_dim). The whole pool is [layers, num_blocks, block_size, row].

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
