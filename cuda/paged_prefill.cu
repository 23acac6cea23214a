// paged_prefill.cu: attention of many query tokens per sequence over the paged KV cache (prefill,
// chunked prefill after a cached prefix, speculative verification, mixed prefill/decode batches).
//
// Sequence s has n_s = query_start_loc[s + 1] - query_start_loc[s] query tokens, packed as rows
// query_start_loc[s] .. of q, and context_lens[s] tokens in the cache *including* them (their K/V
// were written first). Query token j (0-based among the n_s) sits at position
//   pos_j = context_lens[s] - n_s + j,
// and, for query head h of KV head h / G (G = num_q_heads / num_kv_heads):
//   out[row_j, h] = softmax(scale * K q[row_j, h]) V over tokens 0 .. pos_j      (causal)
//                                                      or 0 .. context_lens[s] - 1  (not causal),
// token pos in block block_tables[s, pos / BLOCK_SIZE] at offset pos % BLOCK_SIZE. NaN and Inf
// propagate as in paged_attention.cu (the same online-softmax rules).
// Reference: cupaged/reference.py, reference_prefill (gather, mask, explicit softmax).
//
// paged_prefill: one thread block per (tile of query_rows query tokens, KV head, sequence). Its
//   rows are the tile's query tokens times the G query heads of the KV head (row r: token r / G,
//   head r % G), so each K/V element a tile reaches is read from global memory once for the
//   whole group and the whole query tile. The KV tokens are walked in tiles of TILE tokens:
//     1. the tile's K vectors go to shared memory with 16-byte loads (THREADS * kUnroll in flight);
//     2. scores: 8 lanes per (row, token) pair, shuffles reduce the partial dot products; a token
//        past the row's position (causal) scores -inf;
//     3. online softmax per row (one warp per row): running max m, sum l, and the factor
//        alpha = exp(m_old - m_new); meanwhile V replaces K in the tile buffer. While every score
//        of a row is -inf, exponents are taken against 0 (as in paged_attention.cu);
//     4. acc = alpha * acc + p V, one thread per output element, over the row's visible tokens.
//   Causal: KV tiles past the tile's last query position are masked for every row and are never
//   loaded. Block-table entries of CHUNK tokens at a time are staged in shared memory. All sums
//   are float32. A query tile past its sequence's n_s returns at once (uniformly).
//
// Simple and correct first: no tensor cores, no cp.async pipelining, no split of long KV ranges
// across thread blocks. A follow-up can add WMMA for Q K^T and P V (the CPU backend would have
// to emulate the fragments, DESIGN.md §4), cp.async double buffering of the K/V tiles, and
// split-K with a log-sum-exp merge for small batches of long contexts.
#include "common.cuh"

namespace cupaged {

namespace prefill {

constexpr int kLanesPerDot = 8;  // lanes that share one (row, token) dot product
constexpr int kUnroll = 4;       // independent 16-byte loads in flight per thread

// Loads `count` tokens' vectors of one KV head, starting at token `first`, into `tile`
// ([TILE, HEAD_DIM], row-major). `table` holds the block ids of the current chunk, whose first
// entry is logical block `first_block`.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int THREADS>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ cache, const int* table,
                                          int first_block, int first, int count, int kv_head,
                                          int num_kv_heads) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VECS_PER_TOKEN = HEAD_DIM / VEC;
  const int total = count * VECS_PER_TOKEN;
  for (int base = threadIdx.x; base < total; base += THREADS * kUnroll) {
    uint4 staged[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * THREADS;
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
      const int i = base + u * THREADS;
      if (i < total) {
        *reinterpret_cast<uint4*>(tile + (i / VECS_PER_TOKEN) * HEAD_DIM +
                                  (i % VECS_PER_TOKEN) * VEC) = staged[u];
      }
    }
  }
}

}  // namespace prefill

// Grid: (ceil(max_query_len / query_rows), num_kv_heads, num_seqs). Block: THREADS.
// Dynamic shared memory, in this order (float32 unless said), with R = query_rows * G rows:
//   q_s [R, HEAD_DIM] (scaled queries), acc_s [R, HEAD_DIM], p_s [R, TILE] (scores, then
//   weights), stats [round_up(3 R, 4)] (m, l, alpha per row), tile_s [TILE, HEAD_DIM] of T.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int TILE, int THREADS>
__global__ void __launch_bounds__(THREADS)
    paged_prefill(T* __restrict__ out,                     // [total_query_tokens, num_q_heads, HEAD_DIM]
                  const T* __restrict__ q,                 // [total_query_tokens, num_q_heads, HEAD_DIM]
                  const T* __restrict__ k_cache,           // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                  const T* __restrict__ v_cache,           // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                  const int* __restrict__ block_tables,    // [num_seqs, max_blocks]
                  const int* __restrict__ context_lens,    // [num_seqs]
                  const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                  int num_kv_heads, int group_size, int max_blocks, int query_rows, int causal,
                  float scale) {
  static_assert(HEAD_DIM % (16 / sizeof(T)) == 0, "a token's head vector is whole 16-byte loads");
  static_assert(TILE % 4 == 0, "p_s keeps the tile buffer 16-byte aligned");
  static_assert(THREADS % 32 == 0, "whole warps");
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VECS_PER_TOKEN = HEAD_DIM / VEC;
  constexpr int WARPS = THREADS / 32;
  constexpr int CHUNK = 4 * TILE;  // tokens whose block ids are staged at once
  constexpr int CHUNK_ENTRIES = CHUNK / BLOCK_SIZE + 2;
  __shared__ int table_s[CHUNK_ENTRIES];

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int q_begin = query_start_loc[seq];
  const int num_queries = query_start_loc[seq + 1] - q_begin;
  const int first_query = blockIdx.x * query_rows;
  if (first_query >= num_queries) return;  // the same for every thread of the block
  const int rows_here = min(query_rows, num_queries - first_query);  // query tokens in this tile

  const int G = group_size;
  const int R = query_rows * G;
  const int num_q_heads = num_kv_heads * G;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  CUPAGED_DYNAMIC_SHARED(float, smem);
  float* q_s = smem;
  float* acc_s = q_s + R * HEAD_DIM;
  float* p_s = acc_s + R * HEAD_DIM;
  float* m_s = p_s + R * TILE;
  float* l_s = m_s + R;
  float* alpha_s = l_s + R;
  T* tile_s = reinterpret_cast<T*>(m_s + (3 * R + 3) / 4 * 4);

  const int context = context_lens[seq];
  const int past = context - num_queries;  // tokens before the sequence's first query token
  // Causal: no row of this tile reaches past its last query's position.
  const int end = causal ? past + first_query + rows_here : context;

  // Row r of the tile is query token first_query + r / G, query head kv_head * G + r % G.
  const long long first_row = static_cast<long long>(q_begin) + first_query;
  for (int i = tid; i < R * HEAD_DIM; i += THREADS) {
    const int r = i / HEAD_DIM;
    const int token = r / G;
    float value = 0.0f;
    if (token < rows_here) {
      const long long element =
          ((first_row + token) * num_q_heads + kv_head * G + r % G) * HEAD_DIM + i % HEAD_DIM;
      value = to_float(q[element]) * scale;
    }
    q_s[i] = value;
    acc_s[i] = 0.0f;
  }
  for (int r = tid; r < R; r += THREADS) {
    m_s[r] = neg_inf();
    l_s[r] = 0.0f;
  }
  __syncthreads();

  for (int chunk = 0; chunk < end; chunk += CHUNK) {
    const int chunk_end = min(end, chunk + CHUNK);
    const int first_block = chunk / BLOCK_SIZE;
    const int entries = (chunk_end - 1) / BLOCK_SIZE - first_block + 1;
    for (int i = tid; i < entries; i += THREADS) {
      table_s[i] = block_tables[static_cast<long long>(seq) * max_blocks + first_block + i];
    }
    __syncthreads();

    for (int first = chunk; first < chunk_end; first += TILE) {
      const int count = min(TILE, chunk_end - first);
      prefill::load_tile<T, HEAD_DIM, BLOCK_SIZE, THREADS>(tile_s, k_cache, table_s, first_block,
                                                           first, count, kv_head, num_kv_heads);
      __syncthreads();

      // Scores: each warp takes 32 / kLanesPerDot (row, token) pairs at a time.
      constexpr int kPairsPerWarp = 32 / prefill::kLanesPerDot;
      const int sub = lane % prefill::kLanesPerDot;
      for (int base = warp * kPairsPerWarp; base < R * TILE; base += WARPS * kPairsPerWarp) {
        const int pair = base + lane / prefill::kLanesPerDot;
        const int r = pair / TILE;
        const int t = pair % TILE;
        const int token = r / G;
        const int position = past + first_query + token;  // the row's position in the sequence
        const bool valid = pair < R * TILE && t < count && token < rows_here &&
                           (!causal || first + t <= position);
        float dot = 0.0f;
        if (valid) {
          for (int part = sub; part < VECS_PER_TOKEN; part += prefill::kLanesPerDot) {
            const T* k_vec = tile_s + t * HEAD_DIM + part * VEC;
            const float* q_vec = q_s + r * HEAD_DIM + part * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot += q_vec[e] * to_float(k_vec[e]);
          }
        }
#pragma unroll
        for (int width = prefill::kLanesPerDot / 2; width > 0; width /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, width);
        }
        if (sub == 0 && pair < R * TILE) p_s[pair] = valid ? dot : neg_inf();
      }
      __syncthreads();

      // V replaces K in the tile buffer while the warps update the softmax statistics.
      prefill::load_tile<T, HEAD_DIM, BLOCK_SIZE, THREADS>(tile_s, v_cache, table_s, first_block,
                                                           first, count, kv_head, num_kv_heads);
      for (int r = warp; r < R; r += WARPS) {
        float tile_max = neg_inf();
        for (int t = lane; t < count; t += 32) tile_max = fmaxf(tile_max, p_s[r * TILE + t]);
        for (int width = 16; width > 0; width /= 2) {
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, width));
        }
        const float m_old = m_s[r];
        const float m_new = fmaxf(m_old, tile_max);
        const float base = m_new == neg_inf() ? 0.0f : m_new;  // see step 3
        float sum = 0.0f;
        for (int t = lane; t < count; t += 32) {
          const float p = expf(p_s[r * TILE + t] - base);
          p_s[r * TILE + t] = p;
          sum += p;
        }
        for (int width = 16; width > 0; width /= 2) {
          sum += __shfl_xor_sync(0xffffffffu, sum, width);
        }
        if (lane == 0) {
          const float alpha = expf(m_old - base);  // 0 while m_old = -inf
          alpha_s[r] = alpha;
          l_s[r] = l_s[r] * alpha + sum;
          m_s[r] = m_new;
        }
      }
      __syncthreads();

      for (int i = tid; i < R * HEAD_DIM; i += THREADS) {
        const int r = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        float acc = acc_s[i] * alpha_s[r];
        const float* p = p_s + r * TILE;
        // A masked token's weight is 0, but 0 * Inf (or NaN) in its V is NaN: a row stops at
        // its own position, so nothing after it reaches the row.
        const int position = past + first_query + r / G;
        const int visible = causal ? max(0, min(count, position - first + 1)) : count;
        for (int t = 0; t < visible; ++t) acc += p[t] * to_float(tile_s[t * HEAD_DIM + d]);
        acc_s[i] = acc;
      }
      __syncthreads();
    }
  }

  // acc / l; NaN when a NaN reached l, or l = 0 (every score -inf), as in the reference.
  for (int i = tid; i < R * HEAD_DIM; i += THREADS) {
    const int r = i / HEAD_DIM;
    const int token = r / G;
    if (token < rows_here) {
      const long long element =
          ((first_row + token) * num_q_heads + kv_head * G + r % G) * HEAD_DIM + i % HEAD_DIM;
      out[element] = from_float<T>(acc_s[i] / l_s[r]);
    }
  }
}

}  // namespace cupaged
