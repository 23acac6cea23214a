// write_kv.cu: scatter new tokens' keys and values into one layer of the paged cache.
//
//   token t -> block slot_mapping[t] / block_size, offset slot_mapping[t] % block_size
//   slot -1 skips the token (padding in a batch).
//
// Reference: cupaged/reference.py, reference_write_kv (array ops), bit-exact.
// Each thread moves VEC elements per access: 16 bytes when head_dim * sizeof(T) allows it (the
// Python side picks VEC and checks the alignment), else one element.
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

}  // namespace cupaged
