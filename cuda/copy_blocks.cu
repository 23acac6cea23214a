// copy_blocks.cu: copy whole blocks of the paged cache, in every layer of K and V, in one launch.
//
//   for every pair i, layer l:  k_cache[l, dst[i]] = k_cache[l, src[i]];  same for v_cache
//
// Copy-on-write (a sequence's private copy of a shared block) and defragmentation use it.
// Reference: cupaged/attention/reference.py, reference_copy_blocks (array ops), bit-exact.
// The copy is type-agnostic: W is the word moved per access, uint4 (16 bytes) whenever a block's
// byte size and the base addresses allow it (the Python side checks), else a 4-, 2- or 1-byte
// word (1 byte: an fp8 cache whose blocks or base address are odd).
#include "common.cuh"

namespace cupaged {

// Grid: (num_pairs, num_layers, 2), z = 0 copies keys, z = 1 values. Block: any size.
template <typename W>
__global__ void copy_blocks(W* __restrict__ k_cache,  // [num_layers, num_blocks, words_per_block]
                            W* __restrict__ v_cache,  // [num_layers, num_blocks, words_per_block]
                            const int* __restrict__ src,  // [num_pairs]
                            const int* __restrict__ dst,  // [num_pairs]
                            int num_blocks, long long words_per_block) {
  W* cache = blockIdx.z == 0 ? k_cache : v_cache;
  // 64-bit: a layer of a large cache holds more than 2^31 words.
  const long long layer = static_cast<long long>(blockIdx.y) * num_blocks;
  const W* from = cache + (layer + src[blockIdx.x]) * words_per_block;
  W* to = cache + (layer + dst[blockIdx.x]) * words_per_block;
  for (long long i = threadIdx.x; i < words_per_block; i += blockDim.x) to[i] = from[i];
}

}  // namespace cupaged
