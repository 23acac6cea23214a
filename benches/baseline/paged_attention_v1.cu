// BASELINE ONLY: the decode kernel as it was before issue 11 (commit 1043dd1), kept so that
// scripts/gpu_bench.py can time the old kernel against the new one in the same run. Not part of
// the package; nothing in cupaged/ loads it. Its launch is rebuilt in scripts/gpu_bench.py
// (old_launch).

// paged_attention.cu: decode attention (one query token per sequence) over the paged KV cache.
//
// For sequence s and query head h, with G = num_q_heads / num_kv_heads query heads per KV head:
//   out[s, h] = softmax(scale * K q[s, h]) V,  K and V: tokens 0 .. context_lens[s] - 1 of KV head
//   h / G, token pos in block block_tables[s, pos / BLOCK_SIZE] at offset pos % BLOCK_SIZE.
// A sequence with context length 0 gets a zero row. NaN and Inf propagate as in the reference: a
// NaN score (NaN in q or K, scale NaN) or a +Inf one makes the row NaN, a -Inf score weighs 0, a
// row whose scores are all -Inf is NaN (0 / 0), Inf in V gives Inf (or NaN where it meets 0).
// Reference: cupaged/attention/reference.py, reference_attention (gather, then an explicit softmax).
//
// paged_decode: one thread block per (KV head, sequence, split). It serves all G query heads of
//   the KV head's group, so each K/V element is read from global memory once per group. The
//   split's tokens are walked in tiles of TILE tokens:
//     1. the tile's K vectors are loaded into shared memory with 16-byte loads: a group of
//        HEAD_DIM / VEC consecutive lanes covers one token, so a warp covers several tokens; each
//        thread issues UNROLL independent loads before storing any of them;
//     2. scores: 8 lanes per (query head, token) pair, shuffles reduce the partial dot products;
//     3. online softmax per query head (one warp each): running max m, running sum l, and the
//        factor alpha = exp(m_old - m_new) by which earlier accumulators shrink; meanwhile the
//        tile's V vectors are loaded into the same buffer (K is no longer needed). While every
//        score so far is -inf, exponents are taken against 0 instead of m (-inf - -inf is NaN);
//        fmaxf skips NaN scores, whose exp is NaN and reaches l and acc;
//     4. acc = alpha * acc + p V, one thread per output element.
//   The block-table entries of CHUNK tokens at a time are staged in shared memory first. Nothing
//   in shared memory grows with the context length. All sums are float32.
//   With one split the result is written directly; with several, each split writes its partial
//   output acc / l and its log-sum-exp m + log(l) (-inf for an empty split). Splits cover
//   partition_tokens tokens each, except the last, which runs to the end of the context:
//   partition_tokens comes from the caller's max_context_len, which the kernel does not trust.
// paged_decode_merge: one thread block per (query head, sequence) combines the splits:
//   out = sum_i exp(lse_i - max) * partial_i / sum_i exp(lse_i - max).
#include "common.cuh"

namespace cupaged {

constexpr int kDecodeThreads = 128;  // the launch table (cupaged/kernels/launch_decode.py) uses the same value
constexpr int kWarps = kDecodeThreads / 32;
constexpr int kLanesPerDot = 8;  // lanes that share one (query head, token) dot product
constexpr int kUnroll = 4;       // independent 16-byte loads in flight per thread

// Loads `count` tokens' vectors of one KV head, starting at token `first`, into `tile`
// ([TILE, HEAD_DIM], row-major). `table` holds the block ids of the current chunk, whose first
// entry is logical block `first_block`.
template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ cache, const int* table,
                                          int first_block, int first, int count, int kv_head,
                                          int num_kv_heads) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VECS_PER_TOKEN = HEAD_DIM / VEC;
  const int total = count * VECS_PER_TOKEN;
  for (int base = threadIdx.x; base < total; base += kDecodeThreads * kUnroll) {
    uint4 staged[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kDecodeThreads;
      if (i < total) {
        const int pos = first + i / VECS_PER_TOKEN;
        const int block = table[pos / BLOCK_SIZE - first_block];
        const long long offset =
            cache_offset(block, kv_head, pos % BLOCK_SIZE, num_kv_heads, BLOCK_SIZE, HEAD_DIM) +
            (i % VECS_PER_TOKEN) * VEC;
        staged[u] = *reinterpret_cast<const uint4*>(cache + offset);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kDecodeThreads;
      if (i < total) {
        *reinterpret_cast<uint4*>(tile + (i / VECS_PER_TOKEN) * HEAD_DIM +
                                  (i % VECS_PER_TOKEN) * VEC) = staged[u];
      }
    }
  }
}

// Grid: (num_kv_heads, num_seqs, num_splits). Block: kDecodeThreads.
// Dynamic shared memory, in this order (float32 unless said):
//   q_s [G, HEAD_DIM] (scaled query), acc_s [G, HEAD_DIM], p_s [G, TILE] (scores, then weights),
//   stats [round_up(3 G, 4)] (m, l, alpha per query head), tile_s [TILE, HEAD_DIM] of T.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int TILE>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode(T* __restrict__ out,                  // [num_seqs, num_q_heads, HEAD_DIM]
                 float* __restrict__ partial_out,      // [num_seqs, num_q_heads, num_splits, HEAD_DIM]
                 float* __restrict__ partial_lse,      // [num_seqs, num_q_heads, num_splits]
                 const T* __restrict__ q,              // [num_seqs, num_q_heads, HEAD_DIM]
                 const T* __restrict__ k_cache,        // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                 const T* __restrict__ v_cache,        // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                 const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                 const int* __restrict__ context_lens,  // [num_seqs]
                 int num_kv_heads, int group_size, int max_blocks, int partition_tokens,
                 float scale) {
  static_assert(HEAD_DIM % (16 / sizeof(T)) == 0, "a token's head vector is whole 16-byte loads");
  static_assert(TILE % 4 == 0, "p_s keeps the tile buffer 16-byte aligned");
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VECS_PER_TOKEN = HEAD_DIM / VEC;
  constexpr int CHUNK = 4 * TILE;  // tokens whose block ids are staged at once
  constexpr int CHUNK_ENTRIES = CHUNK / BLOCK_SIZE + 2;
  __shared__ int table_s[CHUNK_ENTRIES];

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int G = group_size;
  const int num_q_heads = num_kv_heads * G;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  CUPAGED_DYNAMIC_SHARED(float, smem);
  float* q_s = smem;
  float* acc_s = q_s + G * HEAD_DIM;
  float* p_s = acc_s + G * HEAD_DIM;
  float* m_s = p_s + G * TILE;
  float* l_s = m_s + G;
  float* alpha_s = l_s + G;
  T* tile_s = reinterpret_cast<T*>(m_s + (3 * G + 3) / 4 * 4);

  const int context = context_lens[seq];
  const int begin = split * partition_tokens;
  const int end = split == num_splits - 1 ? context : min(context, begin + partition_tokens);
  const long long q_row = static_cast<long long>(seq) * num_q_heads + kv_head * G;

  for (int i = tid; i < G * HEAD_DIM; i += kDecodeThreads) {
    q_s[i] = to_float(q[q_row * HEAD_DIM + i]) * scale;
    acc_s[i] = 0.0f;
  }
  for (int g = tid; g < G; g += kDecodeThreads) {
    m_s[g] = neg_inf();
    l_s[g] = 0.0f;
  }
  __syncthreads();

  for (int chunk = begin; chunk < end; chunk += CHUNK) {
    const int chunk_end = min(end, chunk + CHUNK);
    const int first_block = chunk / BLOCK_SIZE;
    const int entries = (chunk_end - 1) / BLOCK_SIZE - first_block + 1;
    for (int i = tid; i < entries; i += kDecodeThreads) {
      table_s[i] = block_tables[static_cast<long long>(seq) * max_blocks + first_block + i];
    }
    __syncthreads();

    for (int first = chunk; first < chunk_end; first += TILE) {
      const int count = min(TILE, chunk_end - first);
      load_tile<T, HEAD_DIM, BLOCK_SIZE>(tile_s, k_cache, table_s, first_block, first, count,
                                         kv_head, num_kv_heads);
      __syncthreads();

      // Scores: each warp takes 32 / kLanesPerDot (query head, token) pairs at a time.
      constexpr int kPairsPerWarp = 32 / kLanesPerDot;
      const int sub = lane % kLanesPerDot;
      for (int base = warp * kPairsPerWarp; base < G * TILE; base += kWarps * kPairsPerWarp) {
        const int pair = base + lane / kLanesPerDot;
        const int g = pair / TILE;
        const int t = pair % TILE;
        const bool valid = pair < G * TILE && t < count;
        float dot = 0.0f;
        if (valid) {
          for (int part = sub; part < VECS_PER_TOKEN; part += kLanesPerDot) {
            const T* k_vec = tile_s + t * HEAD_DIM + part * VEC;
            const float* q_vec = q_s + g * HEAD_DIM + part * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot += q_vec[e] * to_float(k_vec[e]);
          }
        }
#pragma unroll
        for (int width = kLanesPerDot / 2; width > 0; width /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, width);
        }
        if (sub == 0 && pair < G * TILE) p_s[pair] = valid ? dot : neg_inf();
      }
      __syncthreads();

      // V replaces K in the tile buffer while the warps update the softmax statistics.
      load_tile<T, HEAD_DIM, BLOCK_SIZE>(tile_s, v_cache, table_s, first_block, first, count,
                                         kv_head, num_kv_heads);
      for (int g = warp; g < G; g += kWarps) {
        float tile_max = neg_inf();
        for (int t = lane; t < count; t += 32) tile_max = fmaxf(tile_max, p_s[g * TILE + t]);
        for (int width = 16; width > 0; width /= 2) {
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, width));
        }
        const float m_old = m_s[g];
        const float m_new = fmaxf(m_old, tile_max);
        const float base = m_new == neg_inf() ? 0.0f : m_new;  // see step 3
        float sum = 0.0f;
        for (int t = lane; t < count; t += 32) {
          const float p = expf(p_s[g * TILE + t] - base);
          p_s[g * TILE + t] = p;
          sum += p;
        }
        for (int width = 16; width > 0; width /= 2) {
          sum += __shfl_xor_sync(0xffffffffu, sum, width);
        }
        if (lane == 0) {
          const float alpha = expf(m_old - base);  // 0 while m_old = -inf
          alpha_s[g] = alpha;
          l_s[g] = l_s[g] * alpha + sum;
          m_s[g] = m_new;
        }
      }
      __syncthreads();

      for (int i = tid; i < G * HEAD_DIM; i += kDecodeThreads) {
        const int g = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        float acc = acc_s[i] * alpha_s[g];
        const float* p = p_s + g * TILE;
        for (int t = 0; t < count; ++t) acc += p[t] * to_float(tile_s[t * HEAD_DIM + d]);
        acc_s[i] = acc;
      }
      __syncthreads();
    }
  }

  // An empty context or split gives 0; otherwise acc / l, NaN when a NaN reached l (or l = 0).
  const bool empty = end <= begin;
  for (int i = tid; i < G * HEAD_DIM; i += kDecodeThreads) {
    const int g = i / HEAD_DIM;
    const float l = l_s[g];
    const float value = empty ? 0.0f : acc_s[i] / l;
    if (num_splits == 1) {
      out[q_row * HEAD_DIM + i] = from_float<T>(value);
    } else {
      // A split whose scores are all -inf has log-sum-exp -inf: the merge weighs it 0, and
      // 0 * (0 / 0) would be NaN, so its partial row is 0.
      const long long row = (q_row + g) * num_splits + split;
      partial_out[row * HEAD_DIM + i % HEAD_DIM] = l == 0.0f ? 0.0f : value;
    }
  }
  if (num_splits > 1) {
    for (int g = tid; g < G; g += kDecodeThreads) {
      const float m = m_s[g];
      const float base = m == neg_inf() ? 0.0f : m;  // the exponents' reference in step 3
      partial_lse[(q_row + g) * num_splits + split] = empty ? neg_inf() : base + logf(l_s[g]);
    }
  }
}

// Grid: (num_q_heads, num_seqs). Block: kDecodeThreads.
// A split's log-sum-exp is -inf when it is empty (weight 0), or when all its scores are -inf;
// NaN when a NaN reached it (fmaxf skips it, its weight exp(NaN) makes the row NaN). Only an
// empty context gives a zero row: every split -inf in a non-empty one is 0 / 0, NaN, as in the
// reference.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_merge(T* __restrict__ out,                // [num_seqs, num_q_heads, HEAD_DIM]
                       const float* __restrict__ partial_out,  // [num_seqs, num_q_heads, num_splits, HEAD_DIM]
                       const float* __restrict__ partial_lse,  // [num_seqs, num_q_heads, num_splits]
                       const int* __restrict__ context_lens,   // [num_seqs]
                       int num_splits) {
  const long long row = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  const float* lse = partial_lse + row * num_splits;
  float lse_max = neg_inf();
  for (int s = 0; s < num_splits; ++s) lse_max = fmaxf(lse_max, lse[s]);
  const bool empty = context_lens[blockIdx.y] <= 0;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kDecodeThreads) {
    float value = 0.0f;  // an empty context: a zero row
    if (!empty) {
      float numerator = 0.0f;
      float denominator = 0.0f;
      for (int s = 0; s < num_splits; ++s) {
        const float w = expf(lse[s] - lse_max);
        numerator += w * partial_out[(row * num_splits + s) * HEAD_DIM + d];
        denominator += w;
      }
      value = numerator / denominator;
    }
    out[row * HEAD_DIM + d] = from_float<T>(value);
  }
}

}  // namespace cupaged
