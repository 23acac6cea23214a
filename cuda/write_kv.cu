// write_kv.cu: scatter new tokens' keys and values into one layer of the paged cache.
//
//   token t -> block slot_mapping[t] / block_size, offset slot_mapping[t] % block_size
//   slot -1 skips the token (padding in a batch).
//
// Reference: cupaged/attention/reference.py, reference_write_kv (array ops), bit-exact.
// Each thread moves VEC elements per access: 16 bytes when head_dim * sizeof(T) allows it (the
// Python side picks VEC and checks the alignment), else one element. An fp8 cache takes its own
// kernel, write_kv_fp8 (below), which quantizes as it writes.
#include "common.cuh"

namespace cupaged {

// Grid: (num_tokens). Block: any number of threads; each thread strides over the token's
// num_kv_heads * head_dim / VEC vectors.
template <typename T, typename Slot, int VEC>
__global__ void write_kv(const T* __restrict__ k,        // [num_tokens, num_kv_heads, head_dim]
                         const T* __restrict__ v,        // [num_tokens, num_kv_heads, head_dim]
                         T* __restrict__ k_cache,        // [num_blocks, num_kv_heads, block_size, head_dim]
                         T* __restrict__ v_cache,        // [num_blocks, num_kv_heads, block_size, head_dim]
                         const Slot* __restrict__ slots, // [num_tokens]
                         int num_kv_heads, int block_size, int head_dim) {
  const int token = blockIdx.x;
  const long long slot = static_cast<long long>(slots[token]);
  if (slot < 0) return;  // the whole thread block leaves together
  const int block = static_cast<int>(slot / block_size);
  const int offset = static_cast<int>(slot % block_size);
  const int vectors_per_head = head_dim / VEC;
  const int vectors = num_kv_heads * vectors_per_head;
  const long long src_token = static_cast<long long>(token) * num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    const int head = i / vectors_per_head;
    const int d = (i % vectors_per_head) * VEC;
    const long long src = src_token + static_cast<long long>(head) * head_dim + d;
    const long long dst = cache_offset(block, head, offset, num_kv_heads, block_size, head_dim) + d;
    if constexpr (VEC * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(k_cache + dst) = *reinterpret_cast<const uint4*>(k + src);
      *reinterpret_cast<uint4*>(v_cache + dst) = *reinterpret_cast<const uint4*>(v + src);
    } else {
      for (int e = 0; e < VEC; ++e) {
        k_cache[dst + e] = k[src + e];
        v_cache[dst + e] = v[src + e];
      }
    }
  }
}

// ---- fp8 caches: quantize in the same pass ---------------------------------------------------
// An fp8 cache (KV = __nv_fp8_e4m3 or __nv_fp8_e5m2) stores fp8(float(x) / scale(head)): a
// division, not a multiplication by the reciprocal, so that the stored byte equals the oracle's
// (reference_write_kv: float_to_fp8_bits(x / scale)) bit for bit; the conversion rounds to
// nearest even and saturates to +-max (infinities too), NaN stays NaN (common.cuh). The sources
// are 16/32-bit (T: float, __half, __nv_bfloat16). VEC elements per access: 16 or 8 when head_dim
// and the pointers allow it (16-byte loads of the source, a 16- or 8-byte store of fp8), else 1.

// Two floats as two fp8 bytes (lo in the low byte), through one float2 -> fp8x2 conversion.
template <typename KV>
__device__ __forceinline__ unsigned fp8x2_from_float2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, IsFp8<KV>::kFormat);
}

// Quantize the VEC elements of T at src (scaled by 1 / scale) into the VEC fp8 bytes at dst.
template <typename T, int VEC, typename KV>
__device__ __forceinline__ void quantize_vector(const T* __restrict__ src, KV* __restrict__ dst,
                                                float scale) {
  if constexpr (VEC == 1) {
    *dst = from_float<KV>(to_float(*src) / scale);
  } else {
    static_assert(VEC == 8 || VEC == 16, "fp8 vectors of 8 or 16 elements");
    static_assert((VEC * sizeof(T)) % 16 == 0, "whole 16-byte loads of the source");
    constexpr int kChunk = Vec16<T>::kElems;
    float x[VEC];
#pragma unroll
    for (int c = 0; c < VEC / kChunk; ++c) load16_as_float(src + c * kChunk, x + c * kChunk);
    unsigned words[VEC / 4];
#pragma unroll
    for (int w = 0; w < VEC / 4; ++w) {
      const unsigned lo = fp8x2_from_float2<KV>(x[4 * w] / scale, x[4 * w + 1] / scale);
      const unsigned hi = fp8x2_from_float2<KV>(x[4 * w + 2] / scale, x[4 * w + 3] / scale);
      words[w] = lo | (hi << 16);
    }
    if constexpr (VEC == 16) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
      *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    }
  }
}

// Grid: (num_tokens). Block: any number of threads; each thread strides over the token's
// num_kv_heads * head_dim / VEC vectors. The six scale arguments: common.cuh, "fp8 caches".
template <typename T, typename Slot, int VEC, typename KV>
__global__ void write_kv_fp8(const T* __restrict__ k,   // [num_tokens, num_kv_heads, head_dim]
                             const T* __restrict__ v,   // [num_tokens, num_kv_heads, head_dim]
                             KV* __restrict__ k_cache,  // [num_blocks, num_kv_heads, block_size, head_dim]
                             KV* __restrict__ v_cache,  // [num_blocks, num_kv_heads, block_size, head_dim]
                             const Slot* __restrict__ slots,  // [num_tokens]
                             int num_kv_heads, int block_size, int head_dim,
                             float k_scale, float v_scale,
                             const float* __restrict__ k_scales,  // [1] or [num_kv_heads]
                             const float* __restrict__ v_scales,  // [1] or [num_kv_heads]
                             int k_scale_stride, int v_scale_stride) {
  static_assert(IsFp8<KV>::value && !IsFp8<T>::value, "16/32-bit sources into an fp8 cache");
  const int token = blockIdx.x;
  const long long slot = static_cast<long long>(slots[token]);
  if (slot < 0) return;  // the whole thread block leaves together
  const int block = static_cast<int>(slot / block_size);
  const int offset = static_cast<int>(slot % block_size);
  const int vectors_per_head = head_dim / VEC;
  const int vectors = num_kv_heads * vectors_per_head;
  const long long src_token = static_cast<long long>(token) * num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
    const int head = i / vectors_per_head;
    const int d = (i % vectors_per_head) * VEC;
    const long long src = src_token + static_cast<long long>(head) * head_dim + d;
    const long long dst = cache_offset(block, head, offset, num_kv_heads, block_size, head_dim) + d;
    quantize_vector<T, VEC, KV>(k + src, k_cache + dst,
                                head_scale(k_scale, k_scales, k_scale_stride, head));
    quantize_vector<T, VEC, KV>(v + src, v_cache + dst,
                                head_scale(v_scale, v_scales, v_scale_stride, head));
  }
}

}  // namespace cupaged
