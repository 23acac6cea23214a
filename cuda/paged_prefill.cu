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
// propagate as in paged_attention.cu (the same online-softmax rules): a NaN score makes its row
// NaN, a -inf score weighs 0, a row whose scores are all -inf is NaN (0 / 0), and a token after a
// row's position never reaches the row (not even as 0 * Inf).
// Reference: cupaged/attention/reference.py, reference_prefill (gather, mask, explicit softmax).
//
// Attention variants (common.cuh, "Attention variants"; docs/variants.md): the last template
// argument VARIANT of each kernel is a set of bits (what is off compiles away; 0, the default,
// is the plain attention above), their values the four trailing arguments window_left,
// soft_cap, alibi_slopes, sinks. For query j at pos_j and token t:
//   kSoftCap, kAlibi  s = soft_cap * tanh(s / soft_cap), then s += alibi_slopes[h] * (t - pos_j);
//   kWindow           tokens t < pos_j - window_left are masked too (causal or not). A query
//                     tile's KV range starts at its first query's first key,
//                     max(0, pos_first - window_left): the tiles before it are never loaded and
//                     their block-table entries never read (a sliding-window cache sets them to
//                     -1), so a long prompt with a small window reads about window + query_rows
//                     tokens per query tile. A token before some row's window in a tile that
//                     another row sees is kept from that row as a causally masked one is (step
//                     3 below; the special path of paged_prefill_mma);
//   kSinks            the row's softmax denominator gains the sink once: in the epilogue
//                     without split-K (sink_denominator below), in paged_prefill_merge with it
//                     (never in a split's partial row, whose log-sum-exp stays the tokens').
//                     Both take the exponents against M = max(m, sink), as the definition does,
//                     so NaN and Inf go through it as in the reference: a NaN or +Inf sink, or
//                     a -Inf one over scores that are all -Inf, makes the row NaN.
// A row whose scores are all -inf (l = 0, m = -inf) is a zero row with a finite sink; without one
// 0 / 0 as before. Every row of a prefill sees at least its own token, so only -inf scores get
// there.
//
// paged_prefill: one thread block per (query tile, head chunk, split; KV head); query tiles are
//   runs of query_rows packed rows of one sequence (see "Query tiles" below). Its
//   ROWS rows are the tile's query_rows query tokens times the heads_per_block query heads of a
//   chunk of the KV head's group (row r: token r / heads_per_block, head r % heads_per_block;
//   rows past either are padding), so each K/V element a tile reaches is read from global memory
//   once for the whole chunk and the whole query tile. The block walks its KV range (all of it,
//   or one split's partition_tokens tokens of it) in tiles of TILE tokens through a ring of
//   STAGES shared-memory stages, each holding one tile's K and V (common.cuh, KvRing without
//   SPLIT_KV):
//     0. before the loop, tiles 0 .. STAGES - 2 are issued as cp.async copies (16 bytes each,
//        one batch per tile); the block ids they need were loaded into registers the tile before
//        (per thread, the tokens its own copies cover), so no table read waits on a barrier;
//     1. top of tile t: __pipeline_wait_prior(STAGES - 2) lands this thread's copies of tile t,
//        __syncthreads makes everyone's visible and frees the stage that tile t - 1 used, into
//        which tile t + STAGES - 1 is issued at once: its loads run under tiles t .. t+STAGES-2;
//     2. scores and online softmax, in registers: lane t % TILE of a warp takes KV token t and
//        the warp's rows (several rows per thread), reading K once per 16-byte part (128-bit,
//        16-bit types converted to float in pairs, __half22float2) against q parts that every
//        lane of the row group reads at one address (a broadcast). The row's TILE lanes reduce
//        max and sum with shuffles and keep the running max m and sum l in registers; the
//        weights p and the rescale factor alpha = exp(m_old - m_new) go to shared memory. A
//        token past the row's position (causal) or past the range scores -inf; while every score
//        of a row is -inf, exponents are taken against 0 instead of m (-inf - -inf is NaN), as in
//        paged_attention.cu;
//     3. acc = alpha * acc + p V, in registers: thread i owns (row, 16-byte part) items i,
//        i + THREADS, ...; per token it reads its part of V (128-bit) and the weights of four
//        tokens at a time (128-bit). In a tile that crosses some row's position (causal), a row
//        stops at its own position, so a masked token's Inf or NaN in V never meets its weight 0.
//   K/V rows of a stage are padded by 16 bytes, so the 8 lanes of each phase of a 128-bit read
//   of 8 consecutive tokens hit 8 distinct 4-bank groups (conflict-free); the weights' rows are
//   padded likewise. Causal: KV tiles past the query tile's last position are masked for every
//   row and never loaded. Tokens past the range in the last tile are zeros (K and V), never
//   unwritten shared memory. All sums are float32. Tiles are cut from the packed rows, so a
//   mixed batch of long chunks and decode rows runs in one launch with a block per decode row; rows
//   past the last live one (a decode row fills G of ROWS) skip the softmax (per warp) and P V
//   (per thread), though not the score loop (a copy per live count costs registers).
//   With one split the block writes acc / l; with several, each split writes acc / l and its
//   log-sum-exp m + log(l) per row (0 and -inf where the row saw no token of the split).
// paged_prefill_merge: one thread block per (query token, query head) combines the splits that
//   hold a token the row sees: out = sum_i exp(lse_i - max) partial_i / sum_i exp(lse_i - max)
//   (+ exp(sink - max) in the denominator with kSinks).
//
// Split-K: the launch table splits every query tile's KV range into partition_tokens-token
// pieces (a multiple of TILE) when the batch is too small to fill the GPU, so that one thread
// block holds at most that many tokens whatever its sequence's length; the last split runs to the
// end of each range, so a plan made from wrong lengths changes the work split, never the result.
// The pieces start at the range's start (0, or the window's first key of the tile).
// Tensor cores: fp16/bf16 up to head_dim 128 run paged_prefill_mma (below): 64-row query tiles,
// Q K^T and P V on WMMA m16n16k16 with float32 accumulators, the softmax in float32 between them
// (the static model: scripts/kernel-report, docs/prefill.md). float32 stays on paged_prefill's
// FMAs (TF32 would miss its tolerance), and so does head_dim 256 (see paged_prefill_mma).
#include <cuda_pipeline_primitives.h>
#ifndef CUPAGED_CPU
#include <mma.h>  // WMMA; the CPU backend's shim provides nvcuda::wmma itself
#endif

#include "common.cuh"
#include "mma_sync.cuh"

namespace cupaged {

// The denominator that the row's acc (summed against its running max m) is divided by once the
// sink joins: (l * f + exp(sink - M)) / f with M = max(m, sink), f = exp(m - M), so that
// acc / it = acc f / (l f + exp(sink - M)). m = -inf (every score -inf, acc = 0) gives f = 0: a
// finite sink makes it +inf (a zero row), a NaN or infinite one NaN, as the definition does.
__device__ __forceinline__ float sink_denominator(float m, float l, float sink) {
  const float top = fmaxf(m, sink);  // a NaN sink: m, and NaN in exp(sink - top)
  const float f = m == neg_inf() ? 0.0f : expf(m - top);
  return l + expf(sink - top) / f;
}

namespace prefill {

// A 16-byte part of a K/V row (VEC elements of T) in shared memory, as floats: one 128-bit read,
// 16-bit types converted in pairs.
__device__ __forceinline__ void unpack(const float* p, float (&f)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x;
  f[1] = v.y;
  f[2] = v.z;
  f[3] = v.w;
}
__device__ __forceinline__ void unpack(const __half* p, float (&f)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = __half22float2(h[i]);
    f[2 * i] = pair.x;
    f[2 * i + 1] = pair.y;
  }
}
__device__ __forceinline__ void unpack(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = __bfloat1622float2(h[i]);
    f[2 * i] = pair.x;
    f[2 * i + 1] = pair.y;
  }
}

// fp8: 8 elements (an LDS.64 of half a staged 16-byte copy), converted in pairs.
__device__ __forceinline__ void unpack(const __nv_fp8_e4m3* p, float (&f)[8]) {
  load8_as_float(p, f);
}
__device__ __forceinline__ void unpack(const __nv_fp8_e5m2* p, float (&f)[8]) {
  load8_as_float(p, f);
}

// Whether any of the 8 values of a 16-byte part is an Inf or NaN (exponent bits all ones).
__device__ __forceinline__ int nonfinite_pair(unsigned w, unsigned exponent) {
  return (w & exponent) == exponent || (w & (exponent << 16)) == (exponent << 16);
}
__device__ __forceinline__ int any_nonfinite(uint4 v, unsigned exponent) {
  return nonfinite_pair(v.x, exponent) | nonfinite_pair(v.y, exponent) |
         nonfinite_pair(v.z, exponent) | nonfinite_pair(v.w, exponent);
}
__device__ __forceinline__ int any_nonfinite(uint4 v, const __half*) {
  return any_nonfinite(v, 0x7c00u);
}
__device__ __forceinline__ int any_nonfinite(uint4 v, const __nv_bfloat16*) {
  return any_nonfinite(v, 0x7f80u);
}

// Eight floats rounded to T, as one 16-byte part (the tensor-core path's weights).
__device__ __forceinline__ uint4 pack(const float (&f)[8], __half*) {
  uint4 v;
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const unsigned*>(&h);
  }
  return v;
}
__device__ __forceinline__ uint4 pack(const float (&f)[8], __nv_bfloat16*) {
  uint4 v;
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const unsigned*>(&h);
  }
  return v;
}

// Eight fp8 elements of KV (8 bytes, 8-byte aligned) as eight T (half or bfloat16: exact, every
// fp8 value is one of both), one 16-byte part: the tensor-core path's conversion of a stage.
template <typename KV>
__device__ __forceinline__ unsigned fp8x2_as(unsigned short pair, __half*) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, IsFp8<KV>::kFormat);
  return static_cast<unsigned>(h.x) | static_cast<unsigned>(h.y) << 16;
}
template <typename KV>
__device__ __forceinline__ unsigned fp8x2_as(unsigned short pair, __nv_bfloat16*) {
  const float2 f = fp8x2_to_float2<KV>(pair);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const unsigned*>(&b);
}
template <typename T, typename KV>
__device__ __forceinline__ uint4 fp8x8_as(const KV* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  T* tag = nullptr;
  return make_uint4(fp8x2_as<KV>(static_cast<unsigned short>(raw.x & 0xffffu), tag),
                    fp8x2_as<KV>(static_cast<unsigned short>(raw.x >> 16), tag),
                    fp8x2_as<KV>(static_cast<unsigned short>(raw.y & 0xffffu), tag),
                    fp8x2_as<KV>(static_cast<unsigned short>(raw.y >> 16), tag));
}

// dot[k] += q row (k * ROW_STEP) . k_row for k < NUM_ROWS: each 16-byte part of K is read once
// for all rows, each q part is a 128-bit read of one address per row group (a broadcast).
// (Skipping the rows past the live ones here too, with one copy of the loop per count, cost
// more registers than the 128 the launch bounds allow; P V skips them.)
template <int NUM_ROWS, int ROW_STEP, int HEAD_DIM, int VEC>
__device__ __forceinline__ void dot_part(float (&dot)[NUM_ROWS], const float (&kf)[VEC],
                                         const float* q_part) {
#pragma unroll
  for (int k = 0; k < NUM_ROWS; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; e += 4) {
      const float4 qv = *reinterpret_cast<const float4*>(q_part + k * ROW_STEP * HEAD_DIM + e);
      dot[k] += qv.x * kf[e];  // one statement each: four FMAs, no separate add
      dot[k] += qv.y * kf[e + 1];
      dot[k] += qv.z * kf[e + 2];
      dot[k] += qv.w * kf[e + 3];
    }
  }
}
// fp8: a 16-byte part (16 elements) is one 128-bit read, as for the other types (rows padded by
// 16 bytes: conflict-free), converted and consumed 8 elements at a time.
template <int NUM_ROWS, int ROW_STEP, int HEAD_DIM, typename T>
__device__ __forceinline__ void dot_rows(float (&dot)[NUM_ROWS], const T* k_row,
                                         const float* q_rows) {
  constexpr int VEC = 16 / sizeof(T);
#pragma unroll 2
  for (int part = 0; part < HEAD_DIM / VEC; ++part) {
    if constexpr (IsFp8<T>::value) {
      const uint4 raw = *reinterpret_cast<const uint4*>(k_row + part * VEC);
      const unsigned low[2] = {raw.x, raw.y};
      const unsigned high[2] = {raw.z, raw.w};
      float kf[8];
      fp8_words_as_float<T>(low, kf);
      dot_part<NUM_ROWS, ROW_STEP, HEAD_DIM>(dot, kf, q_rows + part * VEC);
      fp8_words_as_float<T>(high, kf);
      dot_part<NUM_ROWS, ROW_STEP, HEAD_DIM>(dot, kf, q_rows + part * VEC + 8);
    } else {
      float kf[VEC];
      unpack(k_row + part * VEC, kf);
      dot_part<NUM_ROWS, ROW_STEP, HEAD_DIM>(dot, kf, q_rows + part * VEC);
    }
  }
}

// The sequence s that holds packed query row `row`: query_start_loc[s] <= row <
// query_start_loc[s + 1] (sequences without queries share a start; this skips them).
__device__ __forceinline__ int sequence_of(const int* __restrict__ query_start_loc, int num_seqs,
                                           int row) {
  int lo = 0;
  int hi = num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (query_start_loc[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// A query tile (see "Query tiles" below): packed rows [begin, end) of q, of sequence seq; empty
// (begin >= end) for a unit without one.
struct QueryTile {
  int seq;
  int begin;
  int end;
};

// The query tile of grid unit `unit`, for units < ceil(total / query_rows) + num_seqs.
__device__ __forceinline__ QueryTile query_tile(const int* __restrict__ query_start_loc,
                                                int num_seqs, int query_rows, int unit) {
  const int runs = ceil_div(query_start_loc[num_seqs], query_rows);
  QueryTile tile;
  if (unit < runs) {  // the later tile that starts in rows [unit * query_rows, + query_rows)
    const int row = unit * query_rows;
    tile.seq = sequence_of(query_start_loc, num_seqs, row);
    const int first = query_start_loc[tile.seq];
    tile.begin = first + ceil_div(row - first, query_rows) * query_rows;
    const int end = min(tile.begin + query_rows, query_start_loc[tile.seq + 1]);
    tile.end = tile.begin == first ? first : end;  // at `first`: the sequence's first tile
  } else {  // the first tile of sequence unit - runs
    tile.seq = unit - runs;
    tile.begin = query_start_loc[tile.seq];
    tile.end = min(tile.begin + query_rows, query_start_loc[tile.seq + 1]);
  }
  return tile;
}

}  // namespace prefill

// Query tiles: a sequence's packed rows of q, query_rows at a time from its first row, so that
// a tile's rows, its KV range and so every row's result depend on its own sequence alone, never
// on where the sequence sits in the batch (batch_invariant; docs/batch-invariance.md):
//
//   rows      0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14   query_rows = 4, runs = 4 (15 rows)
//   sequence  a a a a | a b b c | c c c  c  | c  c  c    a = rows 0..4, b = 5..6, c = 7..14
//   unit      4 4 4 4 | 1 5 5 6 | 6 6 6  2  | 2  2  2
//   units 0 .. runs - 1: the later tile that starts in run u (rows 4u .. 4u + 3) past its
//   sequence's first row (a's [4], c's [11 .. 14]; none in runs 0 and 3); units runs + s: the
//   first tile of sequence s (a's [0 .. 3], b's [5 6], c's [7 .. 10]).
//
// units = runs + num_seqs, runs = ceil(total_query_tokens / query_rows). At most one later tile
// starts in a run of query_rows rows: a sequence's tiles start query_rows apart, and the later
// tiles of a sequence that starts inside the run start past its end; the sequence of the run's
// first row is the only one that can have one there. So a mixed batch of long chunks and decode
// rows has a block per decode row, not max_query_len / query_rows each, and no more blocks than
// tiles cut from multiples of query_rows would take.
//
// Grid: (units * head_chunks * num_splits, num_kv_heads), x = (unit * head_chunks + head chunk) *
// num_splits + split, head_chunks = ceil(G / heads_per_block).
// Block: THREADS. Dynamic shared memory, in this order (float32 unless said):
//   q_s [ROWS, HEAD_DIM] (scaled queries), p_s [ROWS, TILE + 4] (weights), alpha_s [ROWS],
//   l_s [ROWS], kv_s [STAGES, 2 (K, V), TILE, HEAD_DIM + 16 / sizeof(T)] of T.
// partial_out and partial_lse are read only with num_splits > 1 (then the merge writes out).
// __launch_bounds__(THREADS, kPrefillBlocks): 4 blocks per SM up to head_dim 192, at most 128
// registers. Without the second argument ptxas settles near 96 registers and spills a few bytes
// in the tile loop; with 1 it takes up to 135 and 3 blocks fit. Above head_dim 192 a thread's
// share of the output rows outgrows 128 registers (NVRTC 12.9 spilled 20-220 bytes at head_dim
// 208-256), so 3 blocks (168 registers) there, and 2 for float32 from head_dim 240 (24 bytes
// still spilled at 168). scripts/kernel-report (NVRTC 12.9) then shows no spill on sm_80 and
// sm_90 for every dtype and head_dim; on sm_75, which runs this kernel where the tensor-core one
// does not fit or has no bf16, 8-16 bytes at head_dim 80-128 of the 16-bit types. Shared memory
// (about 45 KiB at fp16, head_dim 128) would allow 5 blocks.
template <typename T, int HEAD_DIM>
constexpr int kPrefillBlocks = HEAD_DIM <= 192 ? 4 : (sizeof(T) == 4 && HEAD_DIM >= 240 ? 2 : 3);

template <typename T, int HEAD_DIM, int BLOCK_SIZE, int TILE, int ROWS, int STAGES, int THREADS,
          int VARIANT = 0, typename KV = T>
__global__ void __launch_bounds__(THREADS, kPrefillBlocks<KV, HEAD_DIM>)
    paged_prefill(T* __restrict__ out,                     // [total_query_tokens, num_q_heads, HEAD_DIM]
                  float* __restrict__ partial_out,         // [total_query_tokens, num_q_heads, num_splits, HEAD_DIM]
                  float* __restrict__ partial_lse,         // [total_query_tokens, num_q_heads, num_splits]
                  const T* __restrict__ q,                 // [total_query_tokens, num_q_heads, HEAD_DIM]
                  const KV* __restrict__ k_cache,          // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                  const KV* __restrict__ v_cache,          // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                  const int* __restrict__ block_tables,    // [num_seqs, max_blocks]
                  const int* __restrict__ context_lens,    // [num_seqs]
                  const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                  int num_kv_heads, int group_size, int heads_per_block, int max_blocks,
                  int num_seqs, int query_rows, int causal, int partition_tokens, int num_splits,
                  float scale, float k_scale, float v_scale,
                  const float* __restrict__ k_scales,      // [num_kv_heads] or [1], read for fp8
                  const float* __restrict__ v_scales,      // [num_kv_heads] or [1], read for fp8
                  int k_scale_stride, int v_scale_stride, int window_left, float soft_cap,
                  const float* __restrict__ alibi_slopes,  // [num_q_heads], read with kAlibi
                  const float* __restrict__ sinks) {       // [num_q_heads], read with kSinks
  constexpr bool WINDOW = (VARIANT & kWindow) != 0;
  constexpr bool ALIBI = (VARIANT & kAlibi) != 0;
  constexpr bool SINKS = (VARIANT & kSinks) != 0;  // only without split-K (the merge's otherwise)
  constexpr bool FP8 = IsFp8<KV>::value;
  constexpr int VEC = 16 / sizeof(KV);         // cache elements of a 16-byte part (a copy)
  constexpr int STRIDE = HEAD_DIM + VEC;       // a stage row, padded by 16 bytes (see above)
  // Elements of an output item (P V): a 16-byte part of V; 8 bytes (LDS.64) of fp8, so that its
  // items are those of the 16-bit types.
  constexpr int AVEC = FP8 ? 8 : VEC;
  constexpr int PARTS = HEAD_DIM / AVEC;       // items of a row
  constexpr int P_STRIDE = TILE + 4;           // a weights row, padded by 16 bytes
  constexpr int WARPS = THREADS / 32;
  constexpr int ROW_LANES = 32 / TILE;         // rows a warp scores at once
  constexpr int ROW_STEP = WARPS * ROW_LANES;  // rows the block scores at once
  constexpr int SCORE_ROWS = ROWS / ROW_STEP;  // rows each thread scores
  constexpr int ITEMS = (ROWS * PARTS + THREADS - 1) / THREADS;   // (row, part) outputs per thread
  constexpr bool ONE_PART = THREADS % PARTS == 0;  // every item of a thread has the same part
  static_assert(HEAD_DIM % VEC == 0, "a token's head vector is whole 16-byte parts");
  static_assert(TILE % 4 == 0 && TILE <= 32 && 32 % TILE == 0, "a tile is one row group of lanes");
  static_assert(ROWS % ROW_STEP == 0, "every thread scores the same number of rows");
  static_assert(THREADS % 32 == 0 && STAGES >= 2, "whole warps; a ring of at least two stages");
  static_assert(!IsFp8<T>::value, "queries and outputs are never fp8");
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, false, true, STRIDE,
                     2 * TILE * STRIDE>;

  const int split = blockIdx.x % num_splits;
  const int head_chunks = ceil_div(group_size, heads_per_block);
  const int chunk = blockIdx.x / num_splits % head_chunks;
  const int unit = blockIdx.x / num_splits / head_chunks;
  const int kv_head = blockIdx.y;
  // a grid planned for more rows than q has
  if (unit >= ceil_div(query_start_loc[num_seqs], query_rows) + num_seqs) return;
  const prefill::QueryTile tile = prefill::query_tile(query_start_loc, num_seqs, query_rows, unit);
  const int seq = tile.seq;
  const int tile_begin = tile.begin;  // packed rows [tile_begin, tile_end) of q
  const int tile_end = tile.end;
  if (tile_begin >= tile_end) return;  // the same for every thread of the block
  const int q_begin = query_start_loc[seq];
  const int num_queries = query_start_loc[seq + 1] - q_begin;
  const int first_query = tile_begin - q_begin;
  const int rows_here = tile_end - tile_begin;  // query tokens in this tile
  const int heads = heads_per_block;
  const int heads_here = min(heads, group_size - chunk * heads);
  const int first_head = kv_head * group_size + chunk * heads;
  const int num_q_heads = num_kv_heads * group_size;

  const int context = context_lens[seq];
  const int past = context - num_queries;  // tokens before the sequence's first query token
  const int first_position = past + first_query;  // the tile's first query token's position
  // Causal: no row of this tile reaches past its last query's position; with a window, none
  // before its first query's first key (tiles before it are never loaded, their table entries
  // never read: they may be released, -1).
  const int end = causal ? first_position + rows_here : context;
  const int range_begin = WINDOW ? max(0, first_position - window_left) : 0;
  const int kv_begin = range_begin + split * partition_tokens;
  const int kv_end = split == num_splits - 1 ? end : min(end, kv_begin + partition_tokens);
  // A split past the tile's range holds no token any of its rows sees; the merge skips it.
  if (kv_begin >= kv_end) return;  // uniform too

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  CUPAGED_DYNAMIC_SHARED(float, smem);
  float* q_s = smem;
  float* p_s = q_s + ROWS * HEAD_DIM;
  float* alpha_s = p_s + ROWS * P_STRIDE;
  float* l_s = alpha_s + ROWS;
  KV* kv_s = reinterpret_cast<KV*>(l_s + ROWS);

  // ---- step 0: the ring (common.cuh, KvRing), K and V of a stage side by side in kv_s ----
  Ring ring(kv_s, kv_s + TILE * STRIDE, k_cache, v_cache,
            block_tables + static_cast<long long>(seq) * max_blocks, num_kv_heads, kv_head,
            kv_begin, kv_end, tid);
  ring.start();
  // ring.num_stages; computed here again, as NVRTC compiles the loop best (registers)
  const int num_tiles = ceil_div(kv_end - kv_begin, TILE);
  // fp8: K's scale joins the softmax scale, so each score gets it once (through q_s).
  if constexpr (FP8) scale *= head_scale(k_scale, k_scales, k_scale_stride, kv_head);

  // Row r of the tile is query token first_query + r / heads, query head first_head + r % heads.
  const long long first_row = static_cast<long long>(q_begin) + first_query;
  for (int i = tid; i < ROWS * HEAD_DIM; i += THREADS) {
    const int r = i / HEAD_DIM;
    const int token = r / heads;
    const int h = r % heads;
    float value = 0.0f;
    if (token < rows_here && h < heads_here) {
      const long long element =
          ((first_row + token) * num_q_heads + first_head + h) * HEAD_DIM + i % HEAD_DIM;
      value = to_float(q[element]) * scale;
    }
    q_s[i] = value;
  }

  // Rows past the last live one (a decode row's block: heads_here of ROWS; a short last tile)
  // hold no query: no softmax in a warp whose rows are all past it, no P V, and nothing reads
  // their weights or sums.
  const int live_rows = (rows_here - 1) * heads + heads_here;
  // Scoring: lane `key` of its row group takes token `key` of each tile, rows
  // row_base + k * ROW_STEP; the warp's first row group has the most live ones.
  const int key = lane % TILE;
  const int row_base = warp * ROW_LANES + lane / TILE;
  const int warp_live =
      max(0, min(SCORE_ROWS, ceil_div(live_rows - warp * ROW_LANES, ROW_STEP)));
  float m[SCORE_ROWS];
  float l[SCORE_ROWS];
  int position[SCORE_ROWS];  // the row's query position; -1 for a padding row (sees nothing)
  float slope[ALIBI ? SCORE_ROWS : 1];  // the row's ALiBi slope
#pragma unroll
  for (int k = 0; k < SCORE_ROWS; ++k) {
    const int r = row_base + k * ROW_STEP;
    const bool real = r / heads < rows_here && r % heads < heads_here;
    position[k] = real ? first_position + r / heads : -1;
    m[k] = neg_inf();
    l[k] = 0.0f;
    if (ALIBI) slope[ALIBI ? k : 0] = real ? alibi_slopes[first_head + r % heads] : 0.0f;
  }
  // Accumulating: items tid + u * THREADS, (row, part) = (item / PARTS, item % PARTS).
  float acc[ITEMS][AVEC];
  int item_row[ITEMS];  // -1: no item, or a row past the live ones
  const int item_part = tid % PARTS;  // every item's part when ONE_PART
  bool any_item = false;
#pragma unroll
  for (int u = 0; u < ITEMS; ++u) {
    const int item = tid + u * THREADS;
    item_row[u] = item < ROWS * PARTS && item / PARTS < live_rows ? item / PARTS : -1;
    any_item = any_item || item_row[u] >= 0;
#pragma unroll
    for (int e = 0; e < AVEC; ++e) acc[u][e] = 0.0f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int first = kv_begin + tile * TILE;
    const int count = min(TILE, kv_end - first);
    Ring::wait_kv();    // step 1: this thread's copies of this tile (K and V) have landed
    __syncthreads();    // everyone's; and the stage of tile - 1 is free
    ring.refill(tile);  // tile + STAGES - 1 into it; block ids of tile + STAGES

    const KV* k_tile = ring.k_row(tile, 0);
    const KV* v_tile = ring.v_row(tile, 0);

    // Step 2: scores of token `key` against this thread's rows, then the online softmax.
    float dot[SCORE_ROWS];
#pragma unroll
    for (int k = 0; k < SCORE_ROWS; ++k) dot[k] = 0.0f;
    const KV* k_row = k_tile + key * STRIDE;
    const float* q_rows = q_s + row_base * HEAD_DIM;
    prefill::dot_rows<SCORE_ROWS, ROW_STEP, HEAD_DIM>(dot, k_row, q_rows);
#pragma unroll
    for (int k = 0; k < SCORE_ROWS; ++k) {
      if (k >= warp_live) break;  // the same for the whole warp: its shuffles stay whole
      const int r = row_base + k * ROW_STEP;
      const bool valid = position[k] >= 0 && key < count &&
                         (!causal || first + key <= position[k]) &&
                         (!WINDOW || first + key >= position[k] - window_left);
      const float score =
          valid ? variant_score<VARIANT>(dot[k], soft_cap, ALIBI ? slope[ALIBI ? k : 0] : 0.0f,
                                         first + key - position[k])
                : neg_inf();
      float tile_max = score;
#pragma unroll
      for (int width = TILE / 2; width > 0; width /= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, width));
      }
      const float m_new = fmaxf(m[k], tile_max);
      const float base = m_new == neg_inf() ? 0.0f : m_new;  // see step 2
      const float p = expf(score - base);
      float sum = p;
#pragma unroll
      for (int width = TILE / 2; width > 0; width /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, width);
      }
      const float alpha = expf(m[k] - base);  // 0 while m = -inf
      l[k] = l[k] * alpha + sum;
      m[k] = m_new;
      p_s[r * P_STRIDE + key] = p;
      if (key == 0) alpha_s[r] = alpha;
    }
    __syncthreads();

    // Step 3: acc = alpha acc + p V over the tile's tokens.
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      if (item_row[u] < 0) continue;
      const float alpha = alpha_s[item_row[u]];
#pragma unroll
      for (int e = 0; e < AVEC; ++e) acc[u][e] *= alpha;
    }
    // Rows stop inside this tile only when it crosses the first row's position (causal), and
    // start inside it only when it begins before the last row's first key (window).
    const bool crosses = causal && first + count - 1 > first_position;
    const bool opens = WINDOW && first < first_position + rows_here - 1 - window_left;
    int visible[ITEMS];  // tokens [hidden, visible) of this tile are the item's row's
    int hidden[WINDOW ? ITEMS : 1];
#pragma unroll
    for (int u = 0; u < ITEMS; ++u) {
      const int token = item_row[u] / heads;
      visible[u] = crosses ? max(0, min(TILE, first_position + token - first + 1)) : TILE;
      if (WINDOW) {
        const int first_key = max(0, first_position + token - window_left);
        hidden[WINDOW ? u : 0] = opens ? max(0, min(TILE, first_key - first)) : 0;
      }
    }
    // A thread (a warp, mostly) whose items are all past the live rows skips the loop; a dead
    // item of a live thread is predicated off (its instructions still issue).
#pragma unroll 2
    for (int t = 0; t < (any_item ? TILE : 0); t += 4) {
      float p[ITEMS][4];
#pragma unroll
      for (int u = 0; u < ITEMS; ++u) {
        const int r = item_row[u] < 0 ? 0 : item_row[u];
        const float4 p4 = *reinterpret_cast<const float4*>(p_s + r * P_STRIDE + t);
        p[u][0] = p4.x;
        p[u][1] = p4.y;
        p[u][2] = p4.z;
        p[u][3] = p4.w;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float vf[AVEC];
        if (ONE_PART) prefill::unpack(v_tile + (t + j) * STRIDE + item_part * AVEC, vf);
#pragma unroll
        for (int u = 0; u < ITEMS; ++u) {
          if (!ONE_PART) {
            prefill::unpack(v_tile + (t + j) * STRIDE + (tid + u * THREADS) % PARTS * AVEC, vf);
          }
          if (item_row[u] < 0 || t + j >= visible[u]) continue;  // a row stops at its position
          if (WINDOW && t + j < hidden[WINDOW ? u : 0]) continue;  // and starts at its window
#pragma unroll
          for (int e = 0; e < AVEC; ++e) acc[u][e] += p[u][j] * vf[e];
        }
      }
    }
  }
  __pipeline_wait_prior(0);  // only empty batches are left; nothing may be pending at exit

  // Each row's sum, and with splits its log-sum-exp, from the lanes that kept them. fp8: V's
  // scale joins each row's denominator (acc / (l / v_scale)), once per row, before any merge.
  const float v_head = FP8 ? head_scale(v_scale, v_scales, v_scale_stride, kv_head) : 1.0f;
#pragma unroll
  for (int k = 0; k < SCORE_ROWS; ++k) {
    const int r = row_base + k * ROW_STEP;
    if (key != 0) continue;
    float l_row = l[k];
    if (SINKS && num_splits == 1 && position[k] >= 0) {
      // The sink joins the denominator once (sink_denominator; the header).
      l_row = sink_denominator(m[k], l[k], sinks[first_head + r % heads]);
    }
    l_s[r] = FP8 ? l_row / v_head : l_row;
    if (num_splits > 1 && position[k] >= 0) {
      const long long row = (first_row + r / heads) * num_q_heads + first_head + r % heads;
      const float base = m[k] == neg_inf() ? 0.0f : m[k];  // the exponents' reference
      partial_lse[row * num_splits + split] = base + logf(l[k]);  // -inf when l = 0
    }
  }
  __syncthreads();

  // acc / l; NaN when a NaN reached l, or l = 0 (every score -inf), as in the reference.
#pragma unroll
  for (int u = 0; u < ITEMS; ++u) {
    const int r = item_row[u];
    if (r < 0 || r / heads >= rows_here || r % heads >= heads_here) continue;
    const int part = ONE_PART ? item_part : (tid + u * THREADS) % PARTS;
    const long long row = (first_row + r / heads) * num_q_heads + first_head + r % heads;
    const float l_row = l_s[r];
    if (num_splits == 1) {
#pragma unroll
      for (int e = 0; e < AVEC; ++e) {
        out[row * HEAD_DIM + part * AVEC + e] = from_float<T>(acc[u][e] / l_row);
      }
    } else {
      // A row that saw no token of this split (l = 0) has log-sum-exp -inf: the merge weighs it
      // 0, and 0 * (0 / 0) would be NaN, so its partial row is 0.
      float* dst = partial_out + (row * num_splits + split) * HEAD_DIM + part * AVEC;
#pragma unroll
      for (int e = 0; e < AVEC; ++e) dst[e] = l_row == 0.0f ? 0.0f : acc[u][e] / l_row;
    }
  }
}

// ---- Tensor cores: paged_prefill_mma (fp16 / bf16) ---------------------------------------------
// The same attention, query tiles, ring, split-K outputs and NaN/Inf rules as paged_prefill, with
// Q K^T and P V on WMMA m16n16k16 (T operands, float32 accumulators). ROWS = 16 x WARPS rows:
// warp w owns rows 16 w .. 16 w + 15 of the tile (the same token-major rows as paged_prefill) and
// computes them alone, so only the ring needs block barriers; a warp whose rows are all padding
// (a decode row's block has G live rows) skips the math. Per KV tile of TILE tokens:
//   1. top of the tile: the ring as in paged_prefill (wait_prior, __syncthreads, issue ahead);
//   2. S = Q K^T: the warp's 16 x TILE scores, from q_s (the queries as T, unscaled: the scale
//      is applied to the float32 scores, so no rounding of q * scale) and the K stage read as a
//      column-major B operand; stored to the warp's rows of s_s (float);
//   3. online softmax in float32: two lanes per row, TILE / 2 scores each (two passes over s_s:
//      the max, then the weights), max and sum over the pair by one shuffle each; m, l and alpha
//      stay in registers; p goes to p_s rounded to T (the A operand of P V; l sums the unrounded
//      p);
//   4. O = alpha O + P V: O is HEAD_DIM / 16 accumulator fragments per warp, in registers for the
//      whole KV range. Their element layout is opaque, so alpha reaches them as a fragment too:
//      the softmax lanes write alpha across their row of a 16 x 16 tile (in s_s, whose scores
//      have been read), loaded as an accumulator whose element e is then alpha of element e's
//      row, whatever the layout.
// At the end each O fragment goes through the warp's s_s rows to the softmax lanes, which own
// their row's l (and log-sum-exp) and write 8 columns each.
// A masked token (causal: past some row's position) has weight 0, and 0 x Inf would be NaN in an
// MMA that multiplies every row by every token of the tile: in a tile that crosses a position,
// the block first checks the V rows of the tokens that some row does not see; if one holds an Inf
// or NaN (rare; a block-uniform branch), each such element's contribution p x v to every row that
// sees it is kept aside (special_s: +Inf, -Inf, NaN bits per (row, column)), the element is zeroed
// in the stage, and the output adds it back, so a token still never reaches a row that does not
// see it and reaches those that do as in paged_prefill.
//
// Grid and arguments: as paged_prefill. Block: THREADS (ROWS / 16 warps). Dynamic shared memory,
// in this order, every part 32-byte aligned (WMMA tiles):
//   q_s [ROWS, HEAD_DIM + 8] T, kv_s [STAGES, 2 (K, V), TILE, HEAD_DIM + 8] T,
//   s_s [ROWS, TILE + 4] float (scores; weights in float in a special tile; O at the end),
//   p_s [ROWS, TILE + 8] T, special_s [ROWS, HEAD_DIM] bytes (written only once a special tile
//   occurs).
// Stage rows are padded by 16 bytes as in paged_prefill: the 8 rows of each 8 x 16-byte phase of
// a fragment load start 4 banks apart (conflict-free).
// __launch_bounds__: as many blocks per SM as shared memory holds at head_dim 128 (sm_90: 3;
// sm_80: 2), so at most 168 registers on sm_90, where head_dim 112 spills 4 (fp16) and 12 (bf16)
// bytes (NVRTC 12.9; none at the other head_dims). O alone takes HEAD_DIM / 4 registers: head_dim
// 256 (128 of them) would leave too few for the rest, and stays on paged_prefill.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int kPrefillMmaBlocks = 3;  // per SM: what 228 KiB of shared memory hold at head_dim 128
#else
constexpr int kPrefillMmaBlocks = 2;  // sm_80's 164 KiB
#endif
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int TILE, int ROWS, int STAGES, int THREADS,
          int VARIANT = 0, typename KV = T>
__global__ void __launch_bounds__(THREADS, kPrefillMmaBlocks)
    paged_prefill_mma(T* __restrict__ out,                     // [total_query_tokens, num_q_heads, HEAD_DIM]
                      float* __restrict__ partial_out,         // [total_query_tokens, num_q_heads, num_splits, HEAD_DIM]
                      float* __restrict__ partial_lse,         // [total_query_tokens, num_q_heads, num_splits]
                      const T* __restrict__ q,                 // [total_query_tokens, num_q_heads, HEAD_DIM]
                      const KV* __restrict__ k_cache,          // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                      const KV* __restrict__ v_cache,          // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                      const int* __restrict__ block_tables,    // [num_seqs, max_blocks]
                      const int* __restrict__ context_lens,    // [num_seqs]
                      const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                      int num_kv_heads, int group_size, int heads_per_block, int max_blocks,
                      int num_seqs, int query_rows, int causal, int partition_tokens,
                      int num_splits, float scale, float k_scale, float v_scale,
                      const float* __restrict__ k_scales,      // [num_kv_heads] or [1], for fp8
                      const float* __restrict__ v_scales,      // [num_kv_heads] or [1], for fp8
                      int k_scale_stride, int v_scale_stride, int window_left, float soft_cap,
                      const float* __restrict__ alibi_slopes,  // [num_q_heads], with kAlibi
                      const float* __restrict__ sinks) {       // [num_q_heads], with kSinks
  namespace wmma = nvcuda::wmma;
  constexpr bool WINDOW = (VARIANT & kWindow) != 0;
  constexpr bool ALIBI = (VARIANT & kAlibi) != 0;
  constexpr bool SINKS = (VARIANT & kSinks) != 0;  // only without split-K (the merge's otherwise)
  // Soft-cap and ALiBi change the scores: the first softmax pass writes them back, scaled.
  constexpr bool RESCORE = (VARIANT & (kSoftCap | kAlibi)) != 0;
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  using OperandA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using KeyB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;  // K^T
  using ValueB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int PARTS = HEAD_DIM / VEC;
  constexpr int STRIDE = HEAD_DIM + VEC;  // q_s and stage rows (T)
  constexpr int S_STRIDE = TILE + 4;      // s_s rows (float)
  constexpr int P_STRIDE = TILE + 8;      // p_s rows (T)
  constexpr int WARPS = THREADS / 32;
  constexpr int FRAGS = HEAD_DIM / 16;  // output fragments of a warp (16 columns each)
  constexpr int KEYS = TILE / 16;       // 16-token column blocks of S
  constexpr int HALF = TILE / 2;        // scores per lane in the softmax (two lanes per row)
  constexpr bool FP8 = IsFp8<KV>::value;
  constexpr int KV_STRIDE = HEAD_DIM + 16 / sizeof(KV);  // stage rows (KV), padded by 16 bytes
  // The ring's copies are recomputed from tid where used (no HOIST): this kernel is at its
  // register limit, and no registers are held across the loop for them.
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, false, false, KV_STRIDE,
                     2 * TILE * KV_STRIDE>;
  static_assert(sizeof(T) == 2, "tensor cores serve the 16-bit types; float32 has paged_prefill");
  static_assert(FP8 || sizeof(KV) == sizeof(T), "a 16-bit cache is the queries' type");
  static_assert(ROWS == 16 * WARPS && THREADS % 32 == 0, "one 16-row MMA tile per warp");
  static_assert(TILE % 16 == 0 && TILE <= 64 && HEAD_DIM % 16 == 0, "whole 16 x 16 tiles");
  static_assert(HEAD_DIM <= 128, "O in registers: HEAD_DIM / 4 per thread (see above)");
  static_assert(STAGES >= 2, "a ring of at least two stages");

  const int split = blockIdx.x % num_splits;
  const int head_chunks = ceil_div(group_size, heads_per_block);
  const int chunk = blockIdx.x / num_splits % head_chunks;
  const int unit = blockIdx.x / num_splits / head_chunks;
  const int kv_head = blockIdx.y;
  if (unit >= ceil_div(query_start_loc[num_seqs], query_rows) + num_seqs) return;
  // packed rows [tile_begin, tile_end) of q (query tiles as in paged_prefill)
  const prefill::QueryTile tile = prefill::query_tile(query_start_loc, num_seqs, query_rows, unit);
  const int seq = tile.seq;
  const int tile_begin = tile.begin;
  const int tile_end = tile.end;
  if (tile_begin >= tile_end) return;  // uniform
  const int q_begin = query_start_loc[seq];
  const int num_queries = query_start_loc[seq + 1] - q_begin;
  const int first_query = tile_begin - q_begin;
  const int rows_here = tile_end - tile_begin;
  const int heads = heads_per_block;
  const int heads_here = min(heads, group_size - chunk * heads);
  const int first_head = kv_head * group_size + chunk * heads;
  const int num_q_heads = num_kv_heads * group_size;
  const int context = context_lens[seq];
  const int past = context - num_queries;
  const int first_position = past + first_query;
  const int end = causal ? first_position + rows_here : context;
  const int range_begin = WINDOW ? max(0, first_position - window_left) : 0;  // as paged_prefill
  const int kv_begin = range_begin + split * partition_tokens;
  const int kv_end = split == num_splits - 1 ? end : min(end, kv_begin + partition_tokens);
  if (kv_begin >= kv_end) return;  // uniform

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

#ifdef CUPAGED_CPU
  CUPAGED_DYNAMIC_SHARED(unsigned char, smem);  // the CPU backend's buffer is 128-byte aligned
#else
  extern __shared__ __align__(128) unsigned char smem[];  // WMMA tiles: 32-byte aligned
#endif
  T* q_s = reinterpret_cast<T*>(smem);
  KV* kv_s = reinterpret_cast<KV*>(q_s + ROWS * STRIDE);
  T* kt_s = reinterpret_cast<T*>(kv_s + STAGES * 2 * TILE * KV_STRIDE);  // fp8: K, V of a stage
  float* s_s = reinterpret_cast<float*>(kt_s + (FP8 ? 2 * TILE * STRIDE : 0));
  T* p_s = reinterpret_cast<T*>(s_s + ROWS * S_STRIDE);
  unsigned char* special_s = reinterpret_cast<unsigned char*>(p_s + ROWS * P_STRIDE);

  // ---- the ring (common.cuh, KvRing), as in paged_prefill ----
  Ring ring(kv_s, kv_s + TILE * KV_STRIDE, k_cache, v_cache,
            block_tables + static_cast<long long>(seq) * max_blocks, num_kv_heads, kv_head,
            kv_begin, kv_end, tid);
  ring.start();
  // ring.num_stages, computed again as in paged_prefill
  const int num_tiles = ceil_div(kv_end - kv_begin, TILE);
  // fp8: K's scale joins the softmax scale (applied to each float32 score once).
  if constexpr (FP8) scale *= head_scale(k_scale, k_scales, k_scale_stride, kv_head);

  // Queries as T, unscaled; padding rows zero (their scores are masked anyway).
  const long long first_row = static_cast<long long>(q_begin) + first_query;
  for (int i = tid; i < ROWS * HEAD_DIM; i += THREADS) {
    const int r = i / HEAD_DIM;
    const int token = r / heads;
    const int h = r % heads;
    T value = from_float<T>(0.0f);
    if (token < rows_here && h < heads_here) {
      value = q[((first_row + token) * num_q_heads + first_head + h) * HEAD_DIM + i % HEAD_DIM];
    }
    q_s[r * STRIDE + i % HEAD_DIM] = value;
  }

  // Rows of the tile: row r is query token r / heads, head r % heads; its position, or -1.
  auto row_position = [&](int r) {
    return r / heads < rows_here && r % heads < heads_here ? first_position + r / heads : -1;
  };
  const int live_rows = (rows_here - 1) * heads + heads_here;
  const bool warp_live = 16 * warp < live_rows;  // the same for the whole warp
  float* s_w = s_s + 16 * warp * S_STRIDE;
  T* p_w = p_s + 16 * warp * P_STRIDE;
  const T* q_w = q_s + 16 * warp * STRIDE;

  // Softmax lanes: row 16 warp + lane / 2, tokens (lane % 2) * HALF .. + HALF of each tile.
  const int soft_row = 16 * warp + lane / 2;
  const int soft_half = lane % 2;
  const int soft_position = row_position(soft_row);
  const float slope =
      ALIBI && soft_position >= 0 ? alibi_slopes[first_head + soft_row % heads] : 0.0f;
  float m = neg_inf();
  float l = 0.0f;
  Acc o[FRAGS];
#pragma unroll
  for (int f = 0; f < FRAGS; ++f) wmma::fill_fragment(o[f], 0.0f);
  bool any_special = false;  // block-uniform: special_s has been initialised
  float alpha = 0.0f;        // this lane's row's rescale factor of the tile

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int first = kv_begin + tile * TILE;
    const int count = min(TILE, kv_end - first);
    Ring::wait_kv();
    __syncthreads();
    ring.refill(tile);

    T* k_tile;
    T* v_tile;
    if constexpr (FP8) {  // the stage converted to T in kt_s, below
      k_tile = kt_s;
      v_tile = kt_s + TILE * STRIDE;
    } else {
      k_tile = ring.k_row(tile, 0);
      v_tile = ring.v_row(tile, 0);
    }

    // A tile that crosses the first row's position (causal): tokens from `hidden` on are masked
    // for some row; one that begins before the last row's first key (window): tokens before
    // `opened`. Does any of their V elements hold an Inf or NaN?
    const bool crosses = causal && first + count - 1 > first_position;
    const int hidden = crosses ? max(0, first_position + 1 - first) : count;
    const int opened =
        WINDOW ? max(0, min(count, first_position + rows_here - 1 - window_left - first)) : 0;
    const int after = max(opened, hidden);  // masked for some row: [0, opened) and [after, count)
    const int masked = opened + count - after;
    bool special = false;
    if constexpr (FP8) {
      // The stage's K and V rows as T into kt_s (8 elements per thread and step: LDS.64 in,
      // STS.128 out, both conflict-free), the masked V rows checked on the way; the barrier
      // makes kt_s whole for every warp.
      constexpr int EIGHTS = HEAD_DIM / 8;
      int found = 0;
      for (int i = tid; i < 2 * TILE * EIGHTS; i += THREADS) {
        const int row = i / EIGHTS;  // K rows, then V rows
        const int col = i % EIGHTS * 8;
        const int j = row - TILE;    // the V row's token (negative for K)
        const KV* src = (j < 0 ? ring.k_row(tile, row) : ring.v_row(tile, j)) + col;
        const uint4 v = prefill::fp8x8_as<T>(src);
        *reinterpret_cast<uint4*>(kt_s + row * STRIDE + col) = v;
        if (j >= 0 && (j < opened || (j >= after && j < count))) {
          found |= prefill::any_nonfinite(v, static_cast<const T*>(nullptr));
        }
      }
      special = __syncthreads_or(found) != 0;
    } else if (masked > 0) {  // uniform
      int found = 0;
      for (int i = tid; i < masked * PARTS; i += THREADS) {
        const int j = i / PARTS < opened ? i / PARTS : after + i / PARTS - opened;
        const uint4 v =
            *reinterpret_cast<const uint4*>(v_tile + j * STRIDE + i % PARTS * VEC);
        found |= prefill::any_nonfinite(v, static_cast<const T*>(nullptr));
      }
      special = __syncthreads_or(found) != 0;
    }

    if (warp_live) {
      // Step 2: S = Q K^T, 16 rows x TILE tokens.
      Acc s[KEYS];
#pragma unroll
      for (int n = 0; n < KEYS; ++n) wmma::fill_fragment(s[n], 0.0f);
#pragma unroll 2  // unrolled whole, ptxas keeps more fragments in flight and bf16 spills
      for (int k = 0; k < FRAGS; ++k) {
        OperandA a;
        wmma::load_matrix_sync(a, q_w + 16 * k, STRIDE);
#pragma unroll
        for (int n = 0; n < KEYS; ++n) {
          KeyB b;
          wmma::load_matrix_sync(b, k_tile + 16 * n * STRIDE + 16 * k, STRIDE);
          wmma::mma_sync(s[n], a, b, s[n]);
        }
      }
#pragma unroll
      for (int n = 0; n < KEYS; ++n) {
        wmma::store_matrix_sync(s_w + 16 * n, s[n], S_STRIDE, wmma::mem_row_major);
      }
      __syncwarp();

      // Step 3: the online softmax of this lane's half row, in two passes over its scores (the
      // max, then the weights), which keeps HALF floats out of the registers.
      float* s_row = s_w + lane / 2 * S_STRIDE + soft_half * HALF;
      const int first_key = soft_half * HALF;
      // Keys [first_key, seen) of the tile are valid for this row: the range, and causally the
      // row's position (a padding row sees none).
      const int seen = soft_position < 0 ? 0
                       : min(count, causal ? soft_position - first + 1 : count);
      // and, with a window, from the row's first key on (negative: from the tile's start)
      const int unseen = WINDOW ? max(0, soft_position - window_left) - first : 0;
      float tile_max = neg_inf();
#pragma unroll
      for (int t = 0; t < HALF; t += 4) {
        float4 v = *reinterpret_cast<const float4*>(s_row + t);
        float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = first_key + t + j;
          x[j] *= scale;
          if (RESCORE) {
            x[j] = variant_score<VARIANT>(x[j], soft_cap, slope, first + key - soft_position);
          }
          if (key < seen && (!WINDOW || key >= unseen)) tile_max = fmaxf(tile_max, x[j]);
        }
        if (RESCORE) *reinterpret_cast<float4*>(s_row + t) = make_float4(x[0], x[1], x[2], x[3]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      const float m_new = fmaxf(m, tile_max);
      const float base = m_new == neg_inf() ? 0.0f : m_new;  // as in paged_prefill
      float sum = 0.0f;
      T* p_row = p_w + lane / 2 * P_STRIDE + soft_half * HALF;
#pragma unroll
      for (int t = 0; t < HALF; t += VEC) {
        float p[VEC];
#pragma unroll
        for (int c = 0; c < VEC; c += 4) {
          const float4 v = *reinterpret_cast<const float4*>(s_row + t + c);
          const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int key = first_key + t + c + j;
            const float score = RESCORE ? x[j] : x[j] * scale;  // scaled already when RESCORE
            const bool valid = key < seen && (!WINDOW || key >= unseen);
            p[c + j] = valid ? expf(score - base) : 0.0f;
            sum += p[c + j];
          }
          if (special) {  // the weights in float, for the special elements below
            *reinterpret_cast<float4*>(s_row + t + c) =
                make_float4(p[c], p[c + 1], p[c + 2], p[c + 3]);
          }
        }
        *reinterpret_cast<uint4*>(p_row + t) = prefill::pack(p, static_cast<T*>(nullptr));
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      alpha = expf(m - base);  // 0 while m = -inf
      l = l * alpha + sum;
      m = m_new;
      __syncwarp();
    }

    if (special) {  // block-uniform: the rare path (see the header)
      __syncthreads();  // every warp's weights are in s_s
      if (!any_special) {
        for (int i = tid; i < ROWS * HEAD_DIM; i += THREADS) special_s[i] = 0;
        any_special = true;
        __syncthreads();
      }
      for (int d = tid; d < HEAD_DIM; d += THREADS) {  // a column per thread: no races
        for (int i = 0; i < masked; ++i) {
          const int j = i < opened ? i : after + i - opened;
          const float v = to_float(v_tile[j * STRIDE + d]);
          if (v - v == 0.0f) continue;  // finite
          for (int r = 0; r < ROWS; ++r) {
            const int position = row_position(r);
            if (position < 0 || (causal && position < first + j)) continue;  // masked (or padding)
            if (WINDOW && first + j < position - window_left) continue;  // before its window
            const float x = s_s[r * S_STRIDE + j] * v;
            special_s[r * HEAD_DIM + d] |= x != x ? 4 : x > 0.0f ? 1 : 2;
          }
          v_tile[j * STRIDE + d] = from_float<T>(0.0f);
        }
      }
      __syncthreads();
    }

    if (warp_live) {
      // Step 4: O = alpha O + P V.
      // alpha across the row's 16 columns of s_w (free now: the scores and, in a special tile,
      // the weights have been read), loaded as an accumulator: element e gets its row's alpha.
      float* alpha_row = s_w + lane / 2 * S_STRIDE + 8 * soft_half;
      *reinterpret_cast<float4*>(alpha_row) = make_float4(alpha, alpha, alpha, alpha);
      *reinterpret_cast<float4*>(alpha_row + 4) = make_float4(alpha, alpha, alpha, alpha);
      __syncwarp();
      Acc scale_rows;
      wmma::load_matrix_sync(scale_rows, s_w, S_STRIDE, wmma::mem_row_major);
#pragma unroll
      for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
        for (int e = 0; e < Acc::num_elements; ++e) o[f].x[e] *= scale_rows.x[e];
      }
      OperandA p[KEYS];
#pragma unroll
      for (int k = 0; k < KEYS; ++k) wmma::load_matrix_sync(p[k], p_w + 16 * k, P_STRIDE);
#pragma unroll
      for (int f = 0; f < FRAGS; ++f) {
#pragma unroll
        for (int k = 0; k < KEYS; ++k) {
          ValueB b;
          wmma::load_matrix_sync(b, v_tile + 16 * k * STRIDE + 16 * f, STRIDE);
          wmma::mma_sync(o[f], p[k], b, o[f]);
        }
      }
    }
  }
  __pipeline_wait_prior(0);
  if (!warp_live) return;  // no barrier follows

  // This lane's row (soft_row) and columns 8 soft_half .. + 7 of each 16-column fragment.
  const long long row =
      (first_row + soft_row / heads) * num_q_heads + first_head + soft_row % heads;
  if (num_splits > 1 && soft_half == 0 && soft_position >= 0) {
    const float base = m == neg_inf() ? 0.0f : m;
    partial_lse[row * num_splits + split] = base + logf(l);  // -inf when l = 0
  }
  // The sink joins the denominator once, as in paged_prefill (sink_denominator).
  if (SINKS && num_splits == 1 && soft_position >= 0) {
    l = sink_denominator(m, l, sinks[first_head + soft_row % heads]);
  }
  // fp8: V's scale joins the row's denominator, once per row, before any merge.
  if constexpr (FP8) l /= head_scale(v_scale, v_scales, v_scale_stride, kv_head);
  const bool vector_out = (reinterpret_cast<unsigned long long>(out) & 15u) == 0;
  const float inf = __int_as_float(0x7f800000);
#pragma unroll
  for (int f = 0; f < FRAGS; ++f) {
    wmma::store_matrix_sync(s_w, o[f], S_STRIDE, wmma::mem_row_major);
    __syncwarp();
    float value[8];
    const float* o_row = s_w + lane / 2 * S_STRIDE + 8 * soft_half;
#pragma unroll
    for (int c = 0; c < 8; c += 4) {
      const float4 v = *reinterpret_cast<const float4*>(o_row + c);
      value[c] = v.x;
      value[c + 1] = v.y;
      value[c + 2] = v.z;
      value[c + 3] = v.w;
    }
    __syncwarp();  // every lane has read the fragment before the next one is stored
    if (soft_position < 0) continue;
    const int d = 16 * f + 8 * soft_half;
    if (any_special) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const unsigned bits = special_s[soft_row * HEAD_DIM + d + c];
        if (bits == 0) continue;
        const bool nan = (bits & 4) != 0 || bits == 3;  // a NaN, or +Inf and -Inf
        value[c] += nan ? inf - inf : bits == 1 ? inf : -inf;
      }
    }
    // acc / l; NaN when a NaN reached l, or l = 0 (every score -inf), as in paged_prefill.
    if (num_splits == 1) {
      alignas(16) T result[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) result[c] = from_float<T>(value[c] / l);
      if (vector_out) {
        *reinterpret_cast<uint4*>(out + row * HEAD_DIM + d) =
            *reinterpret_cast<const uint4*>(result);
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c) out[row * HEAD_DIM + d + c] = result[c];
      }
    } else {
      // l = 0: the row saw no token of this split; its merge weight is 0 (see paged_prefill).
      float* dst = partial_out + (row * num_splits + split) * HEAD_DIM + d;
#pragma unroll
      for (int c = 0; c < 8; c += 4) {
        *reinterpret_cast<float4*>(dst + c) =
            l == 0.0f ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                      : make_float4(value[c] / l, value[c + 1] / l, value[c + 2] / l,
                                    value[c + 3] / l);
      }
    }
  }
}

// ---- FlashAttention-2 kind: paged_prefill_flash (fp16 / bf16 queries) --------------------------
// The same attention, query tiles, ring, split-K outputs and NaN/Inf rules as paged_prefill, on
// mma.sync m16n8k16 with every intermediate in registers (cuda/mma_sync.cuh: the fragment
// layouts this code relies on). ROWS = 16 x MT x WARPS rows (token-major, as paged_prefill):
// warp w owns MT (1 or 2) row tiles of 16, rows 16 MT w .. 16 MT w + 16 MT - 1; lane l (g = l / 4,
// c = l % 4) owns rows g and g + 8 of each. Per KV tile of TILE tokens (ring with SPLIT_KV: K
// lands before V):
//   1. wait for K, __syncthreads, issue the tile STAGES - 1 ahead (common.cuh, KvRing);
//   2. S = Q K^T: per 16 dims, each row tile's Q block by ldmatrix_x4 (q_s, unscaled T) and two
//      key blocks of 8 by one ldmatrix_x4 of K rows, which serves every row tile of the warp; S
//      is TILE / 8 accumulators of 4 floats per lane and row tile: row g (and g + 8), keys
//      8 n + 2 c, + 1;
//   3. the online softmax in those registers, in base 2 (the scale folded into log2 e: one FFMA
//      and one EX2 per score): the row max and, at the end, the row sum over the 4 lanes of a
//      row by two shuffles each; only a tile that some row does not wholly see (the causal
//      diagonal, a window's edge, the range's last partial tile) tests keys against rows;
//   4. O = alpha O + P V: alpha scales O in registers (its layout is known: row g, g + 8), P's
//      accumulators become the A operand of P V as they lie (16 keys = two S accumulators,
//      packed to T pairs: no shared-memory round trip), V's B fragments come from
//      ldmatrix_x4_trans of V rows; O is HEAD_DIM / 8 accumulators of 4 floats per lane and row
//      tile for the whole KV range.
// A masked weight is 0, and 0 x Inf would be NaN in an MMA that multiplies every row by every key
// of the tile. In a tile that hides keys from some rows (the causal diagonal, a window's edge),
// the block checks those keys' V rows for an Inf or NaN first (a block-uniform branch, rare): if
// one holds any, each lane adds p x v for its own O elements of the non-finite elements of the
// keys its rows see (p, as rounded to T for the MMA, from the lane of the row that holds it, by
// a shuffle), the elements are zeroed in the stage, and the MMA adds the rest: a key still never
// reaches a row that does not see it, and reaches those that do as in paged_prefill.
// At the end each warp writes its O rows, divided by l and rounded to T, to its own rows of q_s,
// and copies them out 16 bytes a lane (a split writes float pairs straight from registers).
//
// Grid and arguments: as paged_prefill. Block: THREADS (4 warps). Dynamic shared memory, in this
// order: q_s [ROWS, HEAD_DIM + 8] T, kv_s [STAGES, 2 (K, V), TILE, HEAD_DIM + 16 / sizeof(KV)]
// KV. Rows are padded by 16 bytes, so the 8 rows of each ldmatrix phase start 4 banks apart
// (conflict-free), and q_s rows as well.
// __launch_bounds__(THREADS, 2): two blocks of 4 warps per SM at up to 255 registers (the launch
// table, cupaged/kernels/launch_prefill.py: flash_rows and flash_tiles, picks the largest tile
// with no spill whose shared memory lets two blocks fit; scripts/kernel-report).
namespace prefill {

// Two floats rounded to T, as one register (first in the low half): an MMA operand pair.
__device__ __forceinline__ unsigned pack2(float a, float b, const __half*) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack2(float a, float b, const __nv_bfloat16*) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}

// The low (high = 0) or high half of a pair that pack2 made, as a float.
__device__ __forceinline__ float unpack_half(unsigned pair, int high, const __half*) {
  const unsigned short bits = static_cast<unsigned short>(high ? pair >> 16 : pair & 0xffffu);
  return __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ float unpack_half(unsigned pair, int high, const __nv_bfloat16*) {
  return __uint_as_float(high ? pair & 0xffff0000u : pair << 16);
}

// S += Q K^T over one 16-dim block of a 16-bit cache (k_block: its dims in the stage's first
// key row), for the warp's MT row tiles: each ldmatrix_x4 of K rows (keys 8n .. 8n + 15, dims
// 16k .. 16k + 15) is the B operand of two 8-key accumulators, for every row tile.
template <typename T, int MT, int KEYS, int KV_STRIDE>
__device__ __forceinline__ void half_scores(float (&s)[MT][KEYS][4], const unsigned (&a)[MT][4],
                                            const T* k_block, int lane) {
#pragma unroll
  for (int n = 0; n < KEYS; n += 2) {
    unsigned b[4];
    mma::ldmatrix_x4(b, k_block + (8 * n + lane / 16 * 8 + lane % 8) * KV_STRIDE + lane / 8 % 2 * 8);
    const unsigned b0[2] = {b[0], b[1]};
    const unsigned b1[2] = {b[2], b[3]};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma::mma_16816<T>(s[mt][n], a[mt], b0);
      mma::mma_16816<T>(s[mt][n + 1], a[mt], b1);
    }
  }
}

// O += P V for the 16 keys of `keys` (a stage row of a 16-bit cache) and A = P's operand of
// each row tile: an ldmatrix_x4_trans of V rows (dims 8f .. 8f + 15) is the B operand of two
// 8-dim accumulators.
template <typename T, int MT, int DIMS, int KV_STRIDE>
__device__ __forceinline__ void half_values(float (&o)[MT][DIMS][4], const unsigned (&a)[MT][4],
                                            const T* keys, int lane) {
#pragma unroll
  for (int f = 0; f < DIMS; f += 2) {
    unsigned b[4];
    mma::ldmatrix_x4_trans(b, keys + (lane / 8 % 2 * 8 + lane % 8) * KV_STRIDE + 8 * f +
                                  lane / 16 * 8);
    const unsigned b0[2] = {b[0], b[1]};
    const unsigned b1[2] = {b[2], b[3]};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mma::mma_16816<T>(o[mt][f], a[mt], b0);
      mma::mma_16816<T>(o[mt][f + 1], a[mt], b1);
    }
  }
}

// fp8 caches, converted in registers on the way into the MMA (no shared-memory pass). An
// ldmatrix matrix of fp8 rows is 8 rows of 16 bytes: 16 elements, not 8, so the lanes receive
// the elements in another order than a 16-bit stage gives them, and the kernel permutes what it
// may:
//   K (S = Q K^T): lane (g, c) gets key g's dims 4c .. 4c + 3 of a 16-dim block, as the two T
//     pairs B's b[0] and b[1] take for the k slots 2c, 2c + 1 and 2c + 8, 2c + 9. A sum over
//     the dims may run in any order, so Q is staged with the same permutation (q_s holds Q's
//     dims 4c, 4c + 1 at slots 2c, 2c + 1 and 4c + 2, 4c + 3 at 2c + 8, 2c + 9): one
//     ldmatrix_x4 of q_s is then A in that order.
//   V (O += P V): ldmatrix_x4_trans of 16-bit pairs gives lane (g, c) keys 2c and 2c + 1 of
//     dims 2g and 2g + 1; two byte permutes make them b[0] of two accumulators, one of the
//     block's even dims and one of its odd dims. So O's accumulators 2m and 2m + 1 hold block
//     m's even and odd dims: lane (g, c) holds dims 16m + 4c .. 16m + 4c + 3 of rows g, g + 8
//     (flash_dim below).
template <typename T, typename KV, int MT, int KEYS, int KV_STRIDE>
__device__ __forceinline__ void fp8_scores(float (&s)[MT][KEYS][4], const unsigned (&a)[MT][4],
                                           const KV* k_block, int lane) {
  const T* tag = nullptr;
#pragma unroll
  for (int n = 0; n < KEYS; n += 4) {
    unsigned r[4];
    if (n + 4 <= KEYS) {  // keys 8n .. 8n + 31, a lane each
      mma::ldmatrix_x4(r, k_block + (8 * n + lane) * KV_STRIDE);
    } else {  // KEYS % 4 == 2: keys 8n .. 8n + 15
      unsigned two[2];
      mma::ldmatrix_x2(two, k_block + (8 * n + lane % 16) * KV_STRIDE);
      r[0] = two[0];
      r[1] = two[1];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (n + i >= KEYS) break;
      const unsigned b[2] = {fp8x2_as_pair<KV>(r[i] & 0xffffu, tag),
                             fp8x2_as_pair<KV>(r[i] >> 16, tag)};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma::mma_16816<T>(s[mt][n + i], a[mt], b);
    }
  }
}

// O += P V for the 16 keys of `keys` (a stage row) and A = P's operand of each 16-row tile: each
// 16-dim block of fp8 V rows as its even and odd dims (see above).
template <typename T, typename KV, int MT, int DIMS, int KV_STRIDE>
__device__ __forceinline__ void fp8_values(float (&o)[MT][DIMS][4], const unsigned (&a)[MT][4],
                                           const KV* keys, int lane) {
  constexpr int BLOCKS = DIMS / 2;
  const T* tag = nullptr;
  const KV* row = keys + (lane / 8 % 2 * 8 + lane % 8) * KV_STRIDE;
#pragma unroll
  for (int m = 0; m < BLOCKS; m += 2) {
    unsigned r[4];
    if (m + 2 <= BLOCKS) {  // blocks m and m + 1
      mma::ldmatrix_x4_trans(r, row + 16 * (m + lane / 16));
    } else {  // an odd block count: the last one alone
      unsigned two[2];
      mma::ldmatrix_x2_trans(two, row + 16 * m);
      r[0] = two[0];
      r[1] = two[1];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (m + h >= BLOCKS) break;
      const unsigned low = r[2 * h];  // keys 0 .. 7 (2c, 2c + 1) of dims 2g, 2g + 1
      const unsigned high = r[2 * h + 1];  // keys 8 .. 15
      const unsigned even[2] = {fp8x2_as_pair<KV>(__byte_perm(low, 0u, 0x0020u), tag),
                                fp8x2_as_pair<KV>(__byte_perm(high, 0u, 0x0020u), tag)};
      const unsigned odd[2] = {fp8x2_as_pair<KV>(__byte_perm(low, 0u, 0x0031u), tag),
                               fp8x2_as_pair<KV>(__byte_perm(high, 0u, 0x0031u), tag)};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma::mma_16816<T>(o[mt][2 * (m + h)], a[mt], even);
        mma::mma_16816<T>(o[mt][2 * (m + h) + 1], a[mt], odd);
      }
    }
  }
}

// The dim of lane c's O element (accumulator f, column 2c + e of its 8).
template <bool FP8>
__device__ __forceinline__ int flash_dim(int f, int c, int e) {
  return FP8 ? 16 * (f / 2) + 4 * c + 2 * e + f % 2 : 8 * f + 2 * c + e;
}

// Step 3 of paged_prefill_flash: the online softmax of rows g and g + 8 of lane (g, c) over
// the tile's scores s (KEYS accumulators: keys 8 n + 2 c, + 1), in base 2: the scores become
// the weights, the running max m (base-2 logits) and this lane's part of the sums l move on, and
// alpha is each row's rescale factor. Without soft-cap or ALiBi (unit = scale x log2 e) the max
// is taken over the raw scores and the scale joins in the exponent's one FFMA; with them
// (unit = 1) each score is transformed first. MASK: test each key against the row (its range,
// its causal position and window); a tile that hides no key from any row skips it.
template <bool MASK, int VARIANT, int KEYS>
__device__ __forceinline__ void flash_softmax(float (&s)[KEYS][4], float (&m)[2], float (&l)[2],
                                              float (&alpha)[2], const int (&position)[2],
                                              const float (&slope)[2], int first, int count,
                                              int causal, int window_left, float soft_cap,
                                              float scale, float unit, int c) {
  constexpr bool WINDOW = (VARIANT & kWindow) != 0;
  constexpr bool RESCORE = (VARIANT & (kSoftCap | kAlibi)) != 0;
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    // Keys [unseen, seen) of the tile are the row's (a padding row has none).
    const int seen = position[i] < 0 ? 0 : min(count, causal ? position[i] - first + 1 : count);
    const int unseen = WINDOW ? max(0, position[i] - window_left) - first : 0;
    float tile_max = neg_inf();
#pragma unroll
    for (int n = 0; n < KEYS; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = 8 * n + 2 * c + e;
        float x = s[n][2 * i + e];
        if (RESCORE) {
          x = variant_score<VARIANT>(x * scale, soft_cap, slope[i], first + key - position[i]) *
              kLog2e;
        }
        if (MASK && !(key < seen && (!WINDOW || key >= unseen))) x = neg_inf();
        tile_max = fmaxf(tile_max, x);
        s[n][2 * i + e] = x;
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m[i], tile_max * unit);
    const float base = m_new == neg_inf() ? 0.0f : m_new;  // as in paged_prefill
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < KEYS; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = s[n][2 * i + e];
        float p = mma::exp2_approx(fmaf(x, unit, -base));  // a NaN score stays NaN
        if (MASK && x == neg_inf()) p = 0.0f;  // masked (-inf x a zero scale is NaN)
        s[n][2 * i + e] = p;
        sum += p;
      }
    }
    alpha[i] = mma::exp2_approx(m[i] - base);  // 0 while m = -inf
    l[i] = l[i] * alpha[i] + sum;
    m[i] = m_new;
  }
}

// Whether any of the 16 fp8 elements of a 16-byte part is a NaN (e4m3: S.1111.111) or an Inf
// or NaN (e5m2: exponent bits all ones).
template <typename KV>
__device__ __forceinline__ int any_nonfinite_fp8(uint4 v) {
  const unsigned mask = IsFp8<KV>::kFormat == __NV_E4M3 ? 0x7f7f7f7fu : 0x7c7c7c7cu;
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
  int found = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned x = words[i] & mask;
#pragma unroll
    for (int b = 0; b < 4; ++b) found |= (x >> (8 * b) & 0xffu) == (mask & 0xffu);
  }
  return found;
}

}  // namespace prefill

template <typename T, int HEAD_DIM, int BLOCK_SIZE, int TILE, int ROWS, int STAGES, int THREADS,
          int VARIANT = 0, typename KV = T>
__global__ void __launch_bounds__(THREADS, 2)
    paged_prefill_flash(T* __restrict__ out,                     // [total_query_tokens, num_q_heads, HEAD_DIM]
                        float* __restrict__ partial_out,         // [total_query_tokens, num_q_heads, num_splits, HEAD_DIM]
                        float* __restrict__ partial_lse,         // [total_query_tokens, num_q_heads, num_splits]
                        const T* __restrict__ q,                 // [total_query_tokens, num_q_heads, HEAD_DIM]
                        const KV* __restrict__ k_cache,          // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                        const KV* __restrict__ v_cache,          // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                        const int* __restrict__ block_tables,    // [num_seqs, max_blocks]
                        const int* __restrict__ context_lens,    // [num_seqs]
                        const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                        int num_kv_heads, int group_size, int heads_per_block, int max_blocks,
                        int num_seqs, int query_rows, int causal, int partition_tokens,
                        int num_splits, float scale, float k_scale, float v_scale,
                        const float* __restrict__ k_scales,      // [num_kv_heads] or [1], for fp8
                        const float* __restrict__ v_scales,      // [num_kv_heads] or [1], for fp8
                        int k_scale_stride, int v_scale_stride, int window_left, float soft_cap,
                        const float* __restrict__ alibi_slopes,  // [num_q_heads], with kAlibi
                        const float* __restrict__ sinks) {       // [num_q_heads], with kSinks
  constexpr bool WINDOW = (VARIANT & kWindow) != 0;
  constexpr bool ALIBI = (VARIANT & kAlibi) != 0;
  constexpr bool SINKS = (VARIANT & kSinks) != 0;  // only without split-K (the merge's otherwise)
  constexpr bool RESCORE = (VARIANT & (kSoftCap | kAlibi)) != 0;
  constexpr int STRIDE = HEAD_DIM + 8;  // q_s and stage rows (T), padded by 16 bytes
  constexpr int WARPS = THREADS / 32;
  constexpr int KEYS = TILE / 8;    // S accumulators per lane (8 keys each)
  constexpr int DIMS = HEAD_DIM / 8;  // O accumulators per lane (8 dims each)
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr bool FP8 = IsFp8<KV>::value;
  constexpr int KV_STRIDE = HEAD_DIM + 16 / sizeof(KV);  // stage rows (KV), padded by 16 bytes
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, true, false, KV_STRIDE,
                      2 * TILE * KV_STRIDE>;
  static_assert(sizeof(T) == 2 && (FP8 || sizeof(KV) == sizeof(T)),
                "16-bit queries over their own cache or fp8");
  constexpr int MT = ROWS / (16 * WARPS);  // 16-row MMA tiles per warp
  static_assert(ROWS == 16 * WARPS * MT && (MT == 1 || MT == 2) && THREADS % 32 == 0,
                "one or two 16-row MMA tiles per warp");
  static_assert(TILE % 16 == 0 && HEAD_DIM % 16 == 0, "whole 16 x 16 operand blocks");
  static_assert(STAGES >= 2, "a ring of at least two stages");

  const int split = blockIdx.x % num_splits;
  const int head_chunks = ceil_div(group_size, heads_per_block);
  const int chunk = blockIdx.x / num_splits % head_chunks;
  const int unit = blockIdx.x / num_splits / head_chunks;
  const int kv_head = blockIdx.y;
  if (unit >= ceil_div(query_start_loc[num_seqs], query_rows) + num_seqs) return;
  const prefill::QueryTile tile = prefill::query_tile(query_start_loc, num_seqs, query_rows, unit);
  const int seq = tile.seq;
  const int tile_begin = tile.begin;
  const int tile_end = tile.end;
  if (tile_begin >= tile_end) return;  // uniform
  const int q_begin = query_start_loc[seq];
  const int num_queries = query_start_loc[seq + 1] - q_begin;
  const int first_query = tile_begin - q_begin;
  const int rows_here = tile_end - tile_begin;
  const int heads = heads_per_block;
  const int heads_here = min(heads, group_size - chunk * heads);
  const int first_head = kv_head * group_size + chunk * heads;
  const int num_q_heads = num_kv_heads * group_size;
  const int context = context_lens[seq];
  const int past = context - num_queries;
  const int first_position = past + first_query;
  const int last_position = first_position + rows_here - 1;
  const int end = causal ? last_position + 1 : context;
  const int range_begin = WINDOW ? max(0, first_position - window_left) : 0;  // as paged_prefill
  const int kv_begin = range_begin + split * partition_tokens;
  const int kv_end = split == num_splits - 1 ? end : min(end, kv_begin + partition_tokens);
  if (kv_begin >= kv_end) return;  // uniform

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int c = lane % 4;

#ifdef CUPAGED_CPU
  CUPAGED_DYNAMIC_SHARED(unsigned char, smem);  // the CPU backend's buffer is 128-byte aligned
#else
  extern __shared__ __align__(128) unsigned char smem[];
#endif
  T* q_s = reinterpret_cast<T*>(smem);
  KV* kv_s = reinterpret_cast<KV*>(q_s + ROWS * STRIDE);

  Ring ring(kv_s, kv_s + TILE * KV_STRIDE, k_cache, v_cache,
            block_tables + static_cast<long long>(seq) * max_blocks, num_kv_heads, kv_head,
            kv_begin, kv_end, tid);
  ring.start();
  const int num_tiles = ceil_div(kv_end - kv_begin, TILE);
  // fp8: K's scale joins the softmax scale (applied to each float32 score once).
  if constexpr (FP8) scale *= head_scale(k_scale, k_scales, k_scale_stride, kv_head);

  // Queries as T, unscaled (negated for a negative scale, which is exact: the scores' max is
  // then the scaled scores' max), 16 bytes a thread; padding rows zero (never used).
  const unsigned sign = scale < 0.0f ? 0x80008000u : 0u;
  scale = fabsf(scale);
  constexpr int PARTS = HEAD_DIM / 8;
  const long long first_row = static_cast<long long>(q_begin) + first_query;
  const bool vector_q = (reinterpret_cast<unsigned long long>(q) & 15u) == 0;
  for (int i = tid; i < ROWS * PARTS; i += THREADS) {
    const int r = i / PARTS;
    const int token = r / heads;
    const int h = r % heads;
    T* dst = q_s + r * STRIDE + i % PARTS * 8;
    if (token >= rows_here || h >= heads_here) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const T* src = q + ((first_row + token) * num_q_heads + first_head + h) * HEAD_DIM + i % PARTS * 8;
    unsigned pairs[4];  // the part's 8 elements, two a word
    if (vector_q) {
      const uint4 v = *reinterpret_cast<const uint4*>(src);
      pairs[0] = v.x;
      pairs[1] = v.y;
      pairs[2] = v.z;
      pairs[3] = v.w;
    } else {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        pairs[p] = static_cast<unsigned>(reinterpret_cast<const unsigned short*>(src)[2 * p]) |
                   static_cast<unsigned>(reinterpret_cast<const unsigned short*>(src)[2 * p + 1])
                       << 16;
      }
    }
    if (FP8) {  // pair p of a 16-dim block to pair slot p / 2 (p even) or 4 + p / 2 (see below)
      const int pair0 = i % PARTS % 2 * 4;  // this part's first pair in its block
      unsigned* block = reinterpret_cast<unsigned*>(q_s + r * STRIDE + i % PARTS / 2 * 16);
#pragma unroll
      for (int p = 0; p < 4; ++p) block[(pair0 + p) % 2 * 4 + (pair0 + p) / 2] = pairs[p] ^ sign;
    } else {
      *reinterpret_cast<uint4*>(dst) =
          make_uint4(pairs[0] ^ sign, pairs[1] ^ sign, pairs[2] ^ sign, pairs[3] ^ sign);
    }
  }

  // Rows of the tile: row r is query token r / heads, head r % heads; its position, or -1.
  auto row_position = [&](int r) {
    return r / heads < rows_here && r % heads < heads_here ? first_position + r / heads : -1;
  };
  const int live_rows = (rows_here - 1) * heads + heads_here;
  const int warp_row = 16 * MT * warp;  // the warp's first row; row tile mt from + 16 mt
  const bool warp_live = warp_row < live_rows;  // the same for the whole warp
  const T* q_w = q_s + warp_row * STRIDE;
  // Per row tile mt, rows g and g + 8 of it (i = 0, 1): position (or -1), ALiBi slope, running
  // max (base 2, scaled) and this lane's part of the row sum, and O.
  int position[MT][2];
  float slope[MT][2];
  float m[MT][2];
  float l[MT][2];
  float o[MT][DIMS][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp_row + 16 * mt + g + 8 * i;
      position[mt][i] = row_position(r);
      slope[mt][i] =
          ALIBI && position[mt][i] >= 0 ? alibi_slopes[first_head + r % heads] : 0.0f;
      m[mt][i] = neg_inf();
      l[mt][i] = 0.0f;
    }
#pragma unroll
    for (int f = 0; f < DIMS; ++f) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][f][e] = 0.0f;
    }
  }
  const float scale_log2 = scale * kLog2e;

  for (int t = 0; t < num_tiles; ++t) {
    const int first = kv_begin + t * TILE;
    const int count = min(TILE, kv_end - first);
    Ring::wait_k();
    __syncthreads();
    ring.refill(t);
    const KV* k_tile = ring.k_row(t, 0);
    KV* v_tile = ring.v_row(t, 0);

    // Keys [0, opened) and [after, count) of the tile are hidden from some row: before the last
    // row's window, past the first row's position (causal). A tile without such keys, and whole,
    // is seen by every row alike: no key is tested against a row.
    const int hidden = causal ? max(0, min(count, first_position + 1 - first)) : count;
    const int opened = WINDOW ? max(0, min(count, last_position - window_left - first)) : 0;
    const int after = max(opened, hidden);
    const int masked = opened + count - after;
    const bool plain = masked == 0 && count == TILE;

    // P as the A operands of P V, rounded to T (S's accumulators 2 kk, 2 kk + 1 as they lie),
    // packed once the softmax is done: S's floats die there.
    unsigned pa[MT][TILE / 16][4];
    if (warp_live) {
      float s[MT][KEYS][4];
      // Step 2: S = Q K^T; each K fragment serves the warp's MT row tiles.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < KEYS; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
        }
      }
#pragma unroll
      for (int k = 0; k < HEAD_DIM / 16; ++k) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::ldmatrix_x4(a[mt], q_w + (16 * mt + lane % 16) * STRIDE + 16 * k + lane / 16 * 8);
        }
        if constexpr (FP8) {
          prefill::fp8_scores<T, KV, MT, KEYS, KV_STRIDE>(s, a, k_tile + 16 * k, lane);
        } else {
          prefill::half_scores<T, MT, KEYS, KV_STRIDE>(s, a, k_tile + 16 * k, lane);
        }
      }

      // Step 3: the online softmax of rows g and g + 8, in base 2 (prefill::flash_softmax; the
      // scale is positive: a negative one negated q), keys tested against the rows only in a
      // tile that hides some key from some row.
      const float unit = RESCORE ? 1.0f : scale_log2;  // base-2 logits per stored score
      float alpha[MT][2];
      bool moved = false;  // some row's max moved: alpha is not 1 (a NaN alpha is not 1)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (plain) {
          prefill::flash_softmax<false, VARIANT>(s[mt], m[mt], l[mt], alpha[mt], position[mt],
                                                 slope[mt], first, count, causal, window_left,
                                                 soft_cap, scale, unit, c);
        } else {
          prefill::flash_softmax<true, VARIANT>(s[mt], m[mt], l[mt], alpha[mt], position[mt],
                                                slope[mt], first, count, causal, window_left,
                                                soft_cap, scale, unit, c);
        }
        moved |= alpha[mt][0] != 1.0f || alpha[mt][1] != 1.0f;
      }
      // O's rows rescaled, unless no row of the warp has a new max (most tiles of a long range).
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int f = 0; f < DIMS; ++f) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][f][e] *= alpha[mt][e / 2];
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
          const float(&x)[KEYS][4] = s[mt];
          pa[mt][kk][0] = prefill::pack2(x[2 * kk][0], x[2 * kk][1], q_w);
          pa[mt][kk][1] = prefill::pack2(x[2 * kk][2], x[2 * kk][3], q_w);
          pa[mt][kk][2] = prefill::pack2(x[2 * kk + 1][0], x[2 * kk + 1][1], q_w);
          pa[mt][kk][3] = prefill::pack2(x[2 * kk + 1][2], x[2 * kk + 1][3], q_w);
        }
      }
    }

    Ring::wait_v();
    __syncthreads();  // V of the tile is whole

    // The rare path (see the header): non-finite V elements of keys hidden from some row.
    bool special = false;
    if (masked > 0) {  // uniform
      constexpr int VPARTS = HEAD_DIM * sizeof(KV) / 16;  // 16-byte parts of a V row
      int found = 0;
      for (int i = tid; i < masked * VPARTS; i += THREADS) {
        const int j = i / VPARTS < opened ? i / VPARTS : after + i / VPARTS - opened;
        const uint4 v = *reinterpret_cast<const uint4*>(v_tile + j * KV_STRIDE +
                                                        i % VPARTS * (16 / sizeof(KV)));
        if constexpr (FP8) {
          found |= prefill::any_nonfinite_fp8<KV>(v);
        } else {
          found |= prefill::any_nonfinite(v, static_cast<const T*>(nullptr));
        }
      }
      special = __syncthreads_or(found) != 0;
    }
    if (special) {  // block-uniform
      // p x v for this lane's O elements (row tile mt) of key j's non-finite V elements, for
      // the rows (g, g + 8) that see the key; p[r] is the row's weight of the key.
      auto add_key = [&](int j, int mt, const float (&p)[2]) {
        const int key = first + j;
        bool sees[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int at = position[mt][r];
          sees[r] = at >= 0 && (!causal || key <= at) && (!WINDOW || key >= at - window_left);
        }
#pragma unroll
        for (int f = 0; f < DIMS; ++f) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float v = to_float(v_tile[j * KV_STRIDE + prefill::flash_dim<FP8>(f, c, e)]);
            if (v - v == 0.0f) continue;  // finite: the MMA's
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              if (sees[r]) o[mt][f][2 * r + e] += p[r] * v;
            }
          }
        }
      };
      // Key j = 8 n + jj is held, in S accumulator n, by the lane of column jj / 2 of each row's
      // quad. Up to head_dim 128, n is static (an unrolled loop): a run-time index would move S
      // to local memory. Above it, where O takes 128 registers and that loop's code spills, S
      // is indexed at run time in this rare path alone (a 64-byte stack frame, no spill).
      if (warp_live) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (HEAD_DIM <= 128) {
#pragma unroll
            for (int n = 0; n < KEYS; ++n) {
              if (8 * n >= opened && 8 * n + 8 <= after) continue;  // no key hidden from any row
#pragma unroll 1
              for (int jj = 0; jj < 8; ++jj) {
                const int j = 8 * n + jj;
                if ((j >= opened && j < after) || j >= count) continue;
                float p[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                  const unsigned pair = __shfl_sync(0xffffffffu, pa[mt][n / 2][n % 2 * 2 + r],
                                                    (lane & ~3) | jj / 2);
                  p[r] = prefill::unpack_half(pair, jj % 2, q_w);
                }
                add_key(j, mt, p);
              }
            }
          } else {
#pragma unroll 1
            for (int i = 0; i < masked; ++i) {
              const int j = i < opened ? i : after + i - opened;
              unsigned mine[2] = {0u, 0u};  // this lane's weights of key j, if it holds them
#pragma unroll
              for (int n = 0; n < KEYS; ++n) {
                if (n == j / 8) {
                  mine[0] = pa[mt][n / 2][n % 2 * 2];
                  mine[1] = pa[mt][n / 2][n % 2 * 2 + 1];
                }
              }
              float p[2];
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const unsigned pair = __shfl_sync(0xffffffffu, mine[r], (lane & ~3) | (j % 8 / 2));
                p[r] = prefill::unpack_half(pair, j % 2, q_w);
              }
              add_key(j, mt, p);
            }
          }
        }
      }
      __syncthreads();  // every lane has read the stage's V
      for (int i = tid; i < masked * HEAD_DIM; i += THREADS) {
        const int j = i / HEAD_DIM < opened ? i / HEAD_DIM : after + i / HEAD_DIM - opened;
        KV* x = v_tile + j * KV_STRIDE + i % HEAD_DIM;
        const float v = to_float(*x);
        if (v - v != 0.0f) *x = from_float<KV>(0.0f);
      }
      __syncthreads();
    }

    if (warp_live) {
      // Step 4: O += P V (O was rescaled in step 3), 16 keys at a time.
#pragma unroll
      for (int kk = 0; kk < TILE / 16; ++kk) {
        unsigned a[MT][4];  // keys 16 kk .. + 15 of P
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int x = 0; x < 4; ++x) a[mt][x] = pa[mt][kk][x];
        }
        const KV* keys = v_tile + 16 * kk * KV_STRIDE;
        if constexpr (FP8) {
          prefill::fp8_values<T, KV, MT, DIMS, KV_STRIDE>(o, a, keys, lane);
        } else {
          prefill::half_values<T, MT, DIMS, KV_STRIDE>(o, a, keys, lane);
        }
      }
    }
  }
  __pipeline_wait_prior(0);
  if (!warp_live) return;  // no barrier follows

  // The rows' sums over their 4 lanes; the log-sum-exp and the sink in natural units.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float& sum = l[mt][i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float m_nat = m[mt][i] == neg_inf() ? neg_inf() : m[mt][i] * kLn2;
      const int r = warp_row + 16 * mt + g + 8 * i;
      if (num_splits > 1 && c == 0 && position[mt][i] >= 0) {
        const long long row = (first_row + r / heads) * num_q_heads + first_head + r % heads;
        const float base = m_nat == neg_inf() ? 0.0f : m_nat;
        partial_lse[row * num_splits + split] = base + logf(sum);  // -inf when l = 0
      }
      if (SINKS && num_splits == 1 && position[mt][i] >= 0) {
        sum = sink_denominator(m_nat, sum, sinks[first_head + r % heads]);
      }
      // fp8: V's scale joins the row's denominator, once per row, before any merge.
      if constexpr (FP8) sum /= head_scale(v_scale, v_scales, v_scale_stride, kv_head);
    }
  }

  if (num_splits > 1) {
    // l = 0: the row saw no token of this split; its merge weight is 0 (see paged_prefill).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (position[mt][i] < 0) continue;
        const int r = warp_row + 16 * mt + g + 8 * i;
        const long long row = (first_row + r / heads) * num_q_heads + first_head + r % heads;
        float* dst = partial_out + (row * num_splits + split) * HEAD_DIM;
        const float inverse = l[mt][i] == 0.0f ? 0.0f : 1.0f / l[mt][i];
#pragma unroll
        for (int f = 0; f < DIMS; f += 2) {
          const float* x = o[mt][f] + 2 * i;
          const float* y = o[mt][f + 1] + 2 * i;
          if (FP8) {  // dims 16 (f / 2) + 4c .. + 3: even, odd, even, odd
            *reinterpret_cast<float4*>(dst + 8 * f + 4 * c) =
                make_float4(x[0] * inverse, y[0] * inverse, x[1] * inverse, y[1] * inverse);
          } else {
            *reinterpret_cast<float2*>(dst + 8 * f + 2 * c) =
                make_float2(x[0] * inverse, x[1] * inverse);
            *reinterpret_cast<float2*>(dst + 8 * f + 8 + 2 * c) =
                make_float2(y[0] * inverse, y[1] * inverse);
          }
        }
      }
    }
    return;
  }
  // acc / l (NaN when a NaN reached l, or l = 0: every score -inf), as T, through the warp's own
  // rows of q_s (only this warp reads them), then 16 bytes a lane.
  // (x / l as x * (1 / l): l = 0 makes 0 * Inf = NaN and a nonzero x Inf, as the division.)
  T* o_w = q_s + warp_row * STRIDE;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float inverse = 1.0f / l[mt][i];
      T* o_row = o_w + (16 * mt + g + 8 * i) * STRIDE;
#pragma unroll
      for (int f = 0; f < DIMS; f += 2) {
        const float* x = o[mt][f] + 2 * i;
        const float* y = o[mt][f + 1] + 2 * i;
        if (FP8) {  // dims 16 (f / 2) + 4c .. + 3: even, odd, even, odd
          *reinterpret_cast<uint2*>(o_row + 8 * f + 4 * c) =
              make_uint2(prefill::pack2(x[0] * inverse, y[0] * inverse, o_w),
                         prefill::pack2(x[1] * inverse, y[1] * inverse, o_w));
        } else {
          *reinterpret_cast<unsigned*>(o_row + 8 * f + 2 * c) =
              prefill::pack2(x[0] * inverse, x[1] * inverse, o_w);
          *reinterpret_cast<unsigned*>(o_row + 8 * f + 8 + 2 * c) =
              prefill::pack2(y[0] * inverse, y[1] * inverse, o_w);
        }
      }
    }
  }
  __syncwarp();
  const bool vector_out = (reinterpret_cast<unsigned long long>(out) & 15u) == 0;
  for (int i = lane; i < 16 * MT * PARTS; i += 32) {
    const int r = warp_row + i / PARTS;
    if (row_position(r) < 0) continue;
    const long long row = (first_row + r / heads) * num_q_heads + first_head + r % heads;
    const T* src = o_w + i / PARTS * STRIDE + i % PARTS * 8;
    T* dst = out + row * HEAD_DIM + i % PARTS * 8;
    if (vector_out) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = src[e];
    }
  }
}

// Grid: (total_query_tokens, num_q_heads). Block: THREADS. VARIANT: kWindow and kSinks only.
// Row (query token) `row` of sequence s at query index j reads the splits that hold a token it
// sees: the first ceil(visible / partition_tokens) of them (at most num_splits), visible =
// pos_j + 1 (causal) or context_lens[s]; every one of those was computed by its tile (whose range
// reaches at least as far). With a window the splits count from the range start of the row's
// query tile (query_rows rows at a time from the sequence's first row), and the row skips
// those before the one that holds its first key. A split's log-sum-exp is -inf when all its
// scores the row sees are -inf (weight 0), NaN when a NaN reached it (fmaxf skips it, its weight
// exp(NaN) makes the row NaN); every split -inf is 0 / 0, NaN, as in the reference (with a sink:
// a zero row).
template <typename T, int HEAD_DIM, int THREADS, int VARIANT = 0>
__global__ void __launch_bounds__(THREADS)
    paged_prefill_merge(T* __restrict__ out,                     // [total_query_tokens, num_q_heads, HEAD_DIM]
                        const float* __restrict__ partial_out,   // [total_query_tokens, num_q_heads, num_splits, HEAD_DIM]
                        const float* __restrict__ partial_lse,   // [total_query_tokens, num_q_heads, num_splits]
                        const int* __restrict__ context_lens,    // [num_seqs]
                        const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                        int num_seqs, int causal, int partition_tokens, int num_splits,
                        int query_rows, int window_left, float soft_cap,
                        const float* __restrict__ alibi_slopes,  // unused (the scores' variant)
                        const float* __restrict__ sinks) {       // [num_q_heads], with kSinks
  constexpr bool WINDOW = (VARIANT & kWindow) != 0;
  constexpr bool SINKS = (VARIANT & kSinks) != 0;
  const int token = blockIdx.x;
  const int lo = prefill::sequence_of(query_start_loc, num_seqs, token);
  const int q_begin = query_start_loc[lo];
  const int past = context_lens[lo] - (query_start_loc[lo + 1] - q_begin);
  const int position = past + token - q_begin;
  const int visible = causal ? position + 1 : context_lens[lo];
  // With a window, the splits cut the range of the row's query tile, from its first row's first
  // key (the tile: query_rows rows at a time from the sequence's first row), and the row reads
  // those from the one that holds its own first key.
  int begin = 0;
  int skipped = 0;
  if (WINDOW) {
    const int tile_begin = q_begin + (token - q_begin) / query_rows * query_rows;
    begin = max(0, past + tile_begin - q_begin - window_left);
    skipped = min(num_splits - 1, (max(0, position - window_left) - begin) / partition_tokens);
  }
  const int used = min(num_splits, max(skipped + 1, ceil_div(visible - begin, partition_tokens)));

  const long long row = static_cast<long long>(token) * gridDim.y + blockIdx.y;
  const float* lse = partial_lse + row * num_splits;
  float lse_max = neg_inf();
  for (int s = skipped; s < used; ++s) lse_max = fmaxf(lse_max, lse[s]);
  // The sink joins once, here (the splits' partial rows hold none), the weights taken against
  // M = max(lse_max, sink) as the definition does (NaN and Inf as in sink_denominator).
  const float sink = SINKS ? sinks[blockIdx.y] : 0.0f;
  const float base = SINKS ? fmaxf(lse_max, sink) : lse_max;
  const float sink_weight = SINKS ? expf(sink - base) : 0.0f;
  for (int d = threadIdx.x; d < HEAD_DIM; d += THREADS) {
    float numerator = 0.0f;
    float denominator = sink_weight;
    for (int s = skipped; s < used; ++s) {
      const float w = expf(lse[s] - base);
      numerator += w * partial_out[(row * num_splits + s) * HEAD_DIM + d];
      denominator += w;
    }
    out[row * HEAD_DIM + d] = from_float<T>(numerator / denominator);
  }
}

}  // namespace cupaged
