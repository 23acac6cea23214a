// cascade.cu: the shared level of cascade decode attention: many decode queries over one range of
// K/V that their block tables share, each K/V tile read once for all of them, on tensor cores
// (cascade_shared: fp16/bf16 queries over fp16, bf16 or fp8 caches) or, for float32 queries over
// a float32 cache, on CUDA cores (cascade_shared_cores, at the end of this file; one interface).
//
// A decode batch whose sequences share leading blocks (forks, beams, a common prompt) is planned
// in levels (issue 40): this kernel for the shared ranges, paged_decode for each sequence's own
// suffix, and paged_decode_merge to combine the pieces of a row by their log-sum-exp. Here, a
// tile's query rows r (flattened: member r / G, query head kv_head * G + r % G, G the GQA group)
// attend to the keys j in [begin, end) of KV head kv_head, which every member's table maps to the
// same blocks:
//   s_rj = scale * q_r . k_j  (over fp8: times k_scale of the KV head), then the variants
//          (common.cuh, variant_score: soft-cap, then ALiBi slope[h] * (j - i_r)), then the
//          window: s_rj = -inf for j < i_r - window_left (window_left >= 0), i_r = len - 1 the
//          row's query position, so that rows of one tile mask differently;
//   partial_out[slot_r, h] = sum_j exp(s_rj - m) v_j / sum_j exp(s_rj - m)  (over fp8: times
//          v_scale of the KV head; 0 when every s_rj is -inf),
//   partial_lse[slot_r, h] = m + log(sum_j exp(s_rj - m))  (-inf when every s_rj is -inf),
// exactly what a split item of paged_decode writes (cuda/paged_attention.cu), so that the merge
// takes both alike. No sinks: the merge adds a sink once per row. NaN and Inf as there.
// Reference: tests/kernels/test_cascade_kernel.py, a float64 NumPy softmax per row over its keys.
//
// cascade_shared: one thread block per (KV head, tile) of WARPS warps; a tile is up to ROWS query
// rows (ROWS a multiple of 16: the rows of the WMMA m16n16k16 products, rows past the tile's
// num_rows are zero queries whose results are never written) and the stage TILE = 16 * WARPS
// tokens, as in paged_decode_mma, whose scheme this follows with ROWS / 16 row blocks in place of
// one. Each K/V byte of [begin, end) is read from global memory once per thread block and serves
// all ROWS rows: the reason for the kernel.
//   0. q rows of the tile into q_s (16-bit, as they are; zeros past num_rows): every warp uses
//      all of them, whose fragments would take ROWS * HEAD_DIM / 32 registers per lane (256 at
//      64 rows of 128), so they are loaded from shared memory where used. K and V go through the
//      ring (common.cuh, KvRing with SPLIT_KV), begin at any position.
//   Per stage:
//   1. wait for K of stage i (over fp8: K and V, converted to T in shared memory), __syncthreads;
//      refill the slot of stage i - 1, prefetch the block ids of stage i + STAGES;
//   2. scores: warp w computes S[:, 16w .. 16w + 15] = Q K^T for every row block, head_dim in
//      k-steps of 16 (K of the step as a column-major B fragment, loaded once for all row blocks;
//      Q's A fragments from q_s), and stores its ROWS x 16 float tiles to s_s; __syncthreads;
//   3. online softmax in float32, THREADS / ROWS threads per row (consecutive lanes of a warp,
//      TILE * ROWS / THREADS consecutive tokens each; max and sum by shuffles over those lanes):
//      score scale, variants and masks (past end, before the window) as above; p = exp(s - m_new)
//      rounded to T, l sums the rounded values; P is written over the row's own scores in s_s
//      (every lane of the warp has read them first: __syncwarp), alpha per row to alpha_s;
//   4. wait for V of stage i, __syncthreads; P V: warp w owns the 16-column slices w, w + WARPS,
//      ... of the output, every row block of each, as float32 accumulator fragments; per slice it
//      loads the stage's V fragments once (B, from the stage), and per row block scales the
//      fragment by alpha of each element's row and adds P V (A from P): acc = alpha acc + P V.
//      WMMA does not specify which elements a lane holds, but all accumulators of a kernel hold
//      them alike: a load of a tile of row numbers, once at the start, tells each lane its rows.
//   5. after the last stage, every row's l to l_s; each output tile goes through the warp's o_s
//      tile, and each lane writes 8 elements (row lane / 2, columns 8 * (lane % 2) ..) as
//      acc / l (times v_scale over fp8); one thread per row writes its log-sum-exp.
// Precision as paged_decode_mma (docs/kernels.md, "Tensor cores"): S and O accumulate in float32,
// P is rounded to T before P V.
#ifndef CUPAGED_CPU
#include <mma.h>  // WMMA; the CPU backend's shim provides nvcuda::wmma itself
#endif

#include "common.cuh"
#include "mma_sync.cuh"

namespace cupaged {

// The thread-block layout and shared memory of one instantiation; the launch table
// (cupaged/kernels/launch_cascade.py, cascade_launch) picks ROWS, WARPS and STAGES and passes them
// as template arguments, and computes kBytes by the same arithmetic (its shared_mem).
template <typename T, int HEAD_DIM, int ROWS, int WARPS, int STAGES, typename KV = T>
struct CascadeLayout {
  static constexpr bool kFp8 = IsFp8<KV>::value;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kTile = 16 * WARPS;                   // tokens per stage
  static constexpr int kSteps = HEAD_DIM / 16;               // k-steps of Q K^T, column slices of O
  static constexpr int kRowBlocks = ROWS / 16;               // row blocks of 16 (the MMA's rows)
  static constexpr int kSlices = (kSteps + WARPS - 1) / WARPS;  // output column slices per warp
  static constexpr int kWarpTiles = kSlices * kRowBlocks;    // 16 x 16 output tiles per warp
  // The k-steps of Q K^T and of P V unrolled by two: unrolled whole, ptxas hoists every step's
  // fragment loads and spills (bf16 at head_dim 128 on sm_80, 255 registers).
  static constexpr int kUnroll = 2;
  static constexpr int kRowThreads = kThreads / ROWS;        // softmax threads per row
  static constexpr int kRowTokens = kTile / kRowThreads;     // tokens per softmax thread
  static constexpr int kLdk = HEAD_DIM + 8;  // K/V/Q row, elements: +16 bytes, no conflicts
  static constexpr int kLds = kTile + 4;     // scores row, floats
  static constexpr int kLdp = 2 * kLds;      // P row, elements of T: P overwrites its scores
  static constexpr int kLdo = 16 + 4;        // a warp's O tile row, floats
  static constexpr int kRowVectors = HEAD_DIM * 2 / 16;      // 16-byte vectors per T row (q)
  static constexpr int kStageVectors =  // 16-byte copies per K stage
      kTile * HEAD_DIM * static_cast<int>(sizeof(KV)) / 16;
  // The ring's rows: padded T rows that the WMMA loads read; over fp8 unpadded fp8 rows (the
  // conversion pass, common.cuh's convert_stage, reads them 8 bytes per thread).
  static constexpr int kRingLd = kFp8 ? HEAD_DIM : kLdk;
  // Byte offsets of the dynamic shared memory (each a multiple of 32: WMMA tiles are 256-bit
  // aligned): k_s, v_s [STAGES, TILE, kRingLd] KV; over fp8 kc_s, vc_s [TILE, kLdk] T (the
  // converted stage); q_s [ROWS, kLdk] T; s_s [ROWS, kLds] float, P [ROWS, kLdp] T in its
  // bytes; o_s [WARPS, 16, kLdo] float; alpha_s, l_s [ROWS] float.
  static constexpr int kStageBytes = STAGES * kTile * kRingLd * static_cast<int>(sizeof(KV));
  static constexpr int kTileBytes = kFp8 ? kTile * kLdk * 2 : 0;  // one converted K (V) stage
  static constexpr int kKc = 2 * kStageBytes;
  static constexpr int kVc = kKc + kTileBytes;
  static constexpr int kQ = kVc + kTileBytes;
  static constexpr int kS = kQ + ROWS * kLdk * 2;
  static constexpr int kO = kS + ROWS * kLds * 4;
  static constexpr int kAlpha = kO + WARPS * 16 * kLdo * 4;
  static constexpr int kL = kAlpha + ROWS * 4;
  static constexpr int kBytes = kL + ROWS * 4;  // the launch table's shared_mem
  static_assert(sizeof(T) == 2, "tensor cores take the 16-bit types");
  static_assert(ROWS >= 16 && ROWS % 16 == 0, "rows in blocks of 16, the rows of the MMA");
  static_assert(HEAD_DIM % 16 == 0, "head_dim in k-steps and output slices of 16");
  static_assert(kThreads % ROWS == 0 && kRowThreads <= 32 && (kRowThreads & (kRowThreads - 1)) == 0,
                "a row's softmax threads: a power of two of consecutive lanes of one warp");
  static_assert(kRowTokens % 8 == 0, "a softmax thread's tokens: whole 16-byte P vectors");
  static_assert(kFp8 || kStageVectors % kThreads == 0, "the stage's copies split evenly");
  static_assert(kStageBytes % 32 == 0 && kKc % 32 == 0 && kVc % 32 == 0 && kQ % 32 == 0 &&
                    kS % 32 == 0 && kO % 32 == 0 && (16 * kLds * 4) % 32 == 0,
                "WMMA tiles are 32-byte aligned");
  static_assert(STAGES >= 2 && 2 * STAGES - 2 <= 8, "the waits count at most 8 batches");
};

// Grid: (num_kv_heads, num_tiles). Block: (32, WARPS, 1).
// Dynamic shared memory: CascadeLayout::kBytes (the layout above), 32-byte aligned.
// tiles[t] = {first_row, num_rows, begin, end}: flattened rows first_row .. first_row + num_rows
// - 1 (num_rows <= ROWS, all of one group: members whose tables hold the same block ids over
// [begin, end)), keys [begin, end). members[m] = {seq, slot}: row r's query is q[seq, h], its
// results go to partial_out[slot, h] and partial_lse[slot, h]. The tables are read from the row
// of the tile's first member. Every slot a tile names is written (all rows, every element).
// Launch bounds of one block per SM at least: with none, ptxas caps some instantiations at 128
// or 168 registers and spills (shared memory allows 2 to 4 blocks per SM whatever they take).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS, int WARPS, int STAGES,
          int VARIANT, typename KV>
__global__ void __launch_bounds__(32 * WARPS, 1)
    cascade_shared(float* __restrict__ partial_out,       // [capacity, num_q_heads, HEAD_DIM]
                   float* __restrict__ partial_lse,       // [capacity, num_q_heads]
                   const T* __restrict__ q,               // [num_seqs, num_q_heads, HEAD_DIM]
                   const KV* __restrict__ k_cache,        // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                   const KV* __restrict__ v_cache,        // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                   const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                   const int4* __restrict__ tiles,        // [num_tiles] {first_row, num_rows, begin, end}
                   const int2* __restrict__ members,      // [num_members] {seq, slot}
                   const int* __restrict__ context_lens,  // [num_seqs], under kAlibi or kWindow
                   int num_kv_heads, int group_size, int max_blocks, float scale,
                   float k_scale, float v_scale,
                   const float* __restrict__ k_scales,    // [1] or [num_kv_heads], read over fp8
                   const float* __restrict__ v_scales,    // [1] or [num_kv_heads], read over fp8
                   int k_scale_stride, int v_scale_stride,
                   int window_left,                       // under kWindow, < 0: none
                   float soft_cap,
                   const float* __restrict__ alibi_slopes,  // [num_q_heads], read under kAlibi
                   const float* __restrict__ sinks) {       // never read: the merge's
  using namespace nvcuda;
  using L = CascadeLayout<T, HEAD_DIM, ROWS, WARPS, STAGES, KV>;
  constexpr bool kFp8 = L::kFp8;
  constexpr int TILE = L::kTile;
  constexpr int THREADS = L::kThreads;
  constexpr int LDK = L::kLdk;
  constexpr int RT = L::kRowThreads;
  constexpr int RTOK = L::kRowTokens;
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, true, true, L::kRingLd>;

  const int4 tile = tiles[blockIdx.y];
  const int first_row = tile.x;
  const int num_rows = tile.y;
  const int begin = tile.z;
  const int end = tile.w;
  const int kv_head = blockIdx.x;
  const int lane = threadIdx.x;
  const int warp = threadIdx.y;
  const int tid = warp * 32 + lane;
  const int num_q_heads = num_kv_heads * group_size;

  CUPAGED_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 32);  // WMMA tiles: 256-bit aligned
  KV* k_s = reinterpret_cast<KV*>(smem);                     // [STAGES, TILE, kRingLd]
  KV* v_s = reinterpret_cast<KV*>(smem + L::kStageBytes);    // [STAGES, TILE, kRingLd]
  T* kc_s = reinterpret_cast<T*>(smem + L::kKc);             // [TILE, LDK], over fp8
  T* vc_s = reinterpret_cast<T*>(smem + L::kVc);             // [TILE, LDK], over fp8
  T* q_s = reinterpret_cast<T*>(smem + L::kQ);               // [ROWS, LDK]
  float* s_s = reinterpret_cast<float*>(smem + L::kS);       // [ROWS, kLds]
  T* p_s = reinterpret_cast<T*>(smem + L::kS);               // [ROWS, kLdp], over the scores
  float* o_s = reinterpret_cast<float*>(smem + L::kO) + warp * 16 * L::kLdo;  // [16, kLdo]
  float* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha);  // [ROWS]
  float* l_s = reinterpret_cast<float*>(smem + L::kL);          // [ROWS]

  // Softmax role: row `row` of the tile, tokens RTOK * sub .. RTOK * sub + RTOK - 1. P V role:
  // row lane / 2 of a row block, columns 8 * (lane % 2) .. + 7 of a column slice.
  const int row = tid / RT;
  const int sub = tid % RT;
  const int out_row = lane / 2;
  const int out_col = lane % 2 * 8;
  // The softmax row's query position (ALiBi's i, the window's origin) and slope.
  constexpr bool kHasAlibi = (VARIANT & kAlibi) != 0;
  constexpr bool kHasWindow = (VARIANT & kWindow) != 0;
  int query_pos = 0;
  float slope = 0.0f;
  if ((kHasAlibi || kHasWindow) && row < num_rows) {
    const int r = first_row + row;
    query_pos = context_lens[members[r / group_size].x] - 1;
    if (kHasAlibi) slope = alibi_slopes[kv_head * group_size + r % group_size];
  }
  // The row's first key: keys before i - window_left are masked (no overflow: i >= -1).
  const int first_key = kHasWindow && window_left >= 0 ? query_pos - window_left : begin;
  // Over fp8, K's scale of the KV head joins the score's scale, V's the output rows' (once).
  const float score_scale =
      kFp8 ? scale * head_scale(k_scale, k_scales, k_scale_stride, kv_head) : scale;
  const float out_scale = kFp8 ? head_scale(v_scale, v_scales, v_scale_stride, kv_head) : 1.0f;
  float m = neg_inf(), l = 0.0f;
  // The output's tiles of this warp, as float32 accumulators: tile j is column slice
  // warp + (j / kRowBlocks) * WARPS, row block j % kRowBlocks.
  using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  Acc acc[L::kWarpTiles];
#pragma unroll
  for (int j = 0; j < L::kWarpTiles; ++j) wmma::fill_fragment(acc[j], 0.0f);
  // The row of each accumulator element this lane holds. WMMA does not specify the layout,
  // but every float accumulator of the kernel has the same one, which a load of a tile of
  // row numbers shows: so the per-row rescale by alpha runs on the fragments themselves.
  int acc_row[Acc::num_elements];
  {
    for (int k = lane; k < 256; k += 32) o_s[k / 16 * L::kLdo + k % 16] = static_cast<float>(k / 16);
    __syncwarp();  // the tile is complete
    Acc rows;
    wmma::load_matrix_sync(rows, o_s, L::kLdo, wmma::mem_row_major);
#pragma unroll
    for (int e = 0; e < Acc::num_elements; ++e) acc_row[e] = static_cast<int>(rows.x[e]);
    __syncwarp();  // every lane has loaded it before o_s is written again
  }

  if (begin < end) {  // uniform over the block
    // 0. q rows of the tile into q_s; rows past num_rows are zeros.
    const bool q_aligned = (reinterpret_cast<unsigned long long>(q) & 15u) == 0;
#pragma unroll
    for (int k = 0; k < (ROWS * L::kRowVectors + THREADS - 1) / THREADS; ++k) {
      const int j = tid + k * THREADS;
      if (j >= ROWS * L::kRowVectors) break;
      const int g = j / L::kRowVectors;
      const int col = j % L::kRowVectors * 8;
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (g < num_rows) {
        const int r = first_row + g;
        const long long q_row = static_cast<long long>(members[r / group_size].x) * num_q_heads +
                                kv_head * group_size + r % group_size;
        const T* src = q + q_row * HEAD_DIM + col;
        if (q_aligned) {
          value = *reinterpret_cast<const uint4*>(src);
        } else {
          alignas(16) T parts[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) parts[e] = src[e];
          value = *reinterpret_cast<const uint4*>(parts);
        }
      }
      *reinterpret_cast<uint4*>(q_s + g * LDK + col) = value;
    }

    // The shared blocks, read from the table of the tile's first member.
    const int table_seq = members[first_row / group_size].x;
    Ring ring(k_s, v_s, k_cache, v_cache,
              block_tables + static_cast<long long>(table_seq) * max_blocks, num_kv_heads,
              kv_head, begin, end, tid);
    ring.start();
    __syncthreads();  // q_s is complete

    for (int stage = 0; stage < ring.num_stages; ++stage) {
      const T* k_tile;  // the warp's 16 K rows, T, rows of LDK elements
      const T* v_tile;  // the stage's V rows, the same
      if constexpr (kFp8) {
        Ring::wait_kv();
        __syncthreads();  // K and V of `stage` are in; every thread is done with stage - 1
        ring.refill(stage);
        convert_stage<T, HEAD_DIM, TILE, LDK, THREADS>(ring.k_row(stage, 0), ring.v_row(stage, 0),
                                                        kc_s, vc_s, tid);
        __syncthreads();  // the converted tiles are complete
        k_tile = kc_s + warp * 16 * LDK;
        v_tile = vc_s;
      } else {
        Ring::wait_k();
        __syncthreads();  // all of K of `stage` is in; every thread is done with stage - 1
        ring.refill(stage);
        k_tile = ring.k_row(stage, warp * 16);
        v_tile = ring.v_row(stage, 0);
      }

      {  // 2. scores of the warp's 16 tokens, every row block
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s[L::kRowBlocks];
#pragma unroll
        for (int rb = 0; rb < L::kRowBlocks; ++rb) wmma::fill_fragment(s[rb], 0.0f);
#pragma unroll L::kUnroll
        for (int kk = 0; kk < L::kSteps; ++kk) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kb;
          mma::wmma_load(kb, k_tile + kk * 16, LDK);
#pragma unroll
          for (int rb = 0; rb < L::kRowBlocks; ++rb) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa;
            mma::wmma_load(qa, q_s + rb * 16 * LDK + kk * 16, LDK);
            wmma::mma_sync(s[rb], qa, kb, s[rb]);
          }
        }
#pragma unroll
        for (int rb = 0; rb < L::kRowBlocks; ++rb) {
          wmma::store_matrix_sync(s_s + rb * 16 * L::kLds + warp * 16, s[rb], L::kLds,
                                  wmma::mem_row_major);
        }
      }
      __syncthreads();  // every warp's scores are in s_s

      {  // 3. online softmax of row `row`, tokens RTOK * sub .. RTOK * sub + RTOK - 1
        const int first = begin + stage * TILE + sub * RTOK;
        float sc[RTOK];
#pragma unroll
        for (int e = 0; e < RTOK; e += 4) load16_as_float(s_s + row * L::kLds + sub * RTOK + e, sc + e);
        __syncwarp();  // every lane of the warp has read its scores: P may overwrite them
        float m_new = m;
#pragma unroll
        for (int e = 0; e < RTOK; ++e) {
          const int key = first + e;
          sc[e] = key < end && key >= first_key
                      ? variant_score<VARIANT>(sc[e] * score_scale, soft_cap, slope, key - query_pos)
                      : neg_inf();
          m_new = fmaxf(m_new, sc[e]);
        }
#pragma unroll
        for (int width = RT / 2; width > 0; width /= 2) {
          m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, width));
        }
        const float base = m_new == neg_inf() ? 0.0f : m_new;
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < RTOK; e += 8) {
          alignas(16) T p[8];
#pragma unroll
          for (int x = 0; x < 8; ++x) {
            p[x] = from_float<T>(expf(sc[e + x] - base));
            sum += to_float(p[x]);  // the rounded weight, as P V sees it
          }
          *reinterpret_cast<uint4*>(p_s + row * L::kLdp + sub * RTOK + e) =
              *reinterpret_cast<const uint4*>(p);
        }
#pragma unroll
        for (int width = RT / 2; width > 0; width /= 2) {
          sum += __shfl_xor_sync(0xffffffffu, sum, width);
        }
        const float alpha = expf(m - base);  // 0 while m = -inf
        l = l * alpha + sum;
        m = m_new;
        if (sub == 0) alpha_s[row] = alpha;
      }

      if constexpr (!kFp8) Ring::wait_v();  // over fp8 V landed with K
      __syncthreads();  // all of V of `stage`, P and alpha are in

      // 4. O = alpha O + P V over the warp's column slices, every row block of each
#pragma unroll
      for (int i = 0; i < L::kSlices; ++i) {
        const int slice = warp + i * WARPS;
        if (L::kSteps % WARPS != 0 && slice >= L::kSteps) break;  // uniform over the warp
        // The slice's V fragments, loaded once for all row blocks.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb[TILE / 16];
#pragma unroll
        for (int kt = 0; kt < TILE / 16; ++kt) {
          mma::wmma_load(vb[kt], v_tile + kt * 16 * LDK + slice * 16, LDK);
        }
#pragma unroll
        for (int rb = 0; rb < L::kRowBlocks; ++rb) {
          Acc& o = acc[i * L::kRowBlocks + rb];
#pragma unroll
          for (int e = 0; e < Acc::num_elements; ++e) o.x[e] *= alpha_s[rb * 16 + acc_row[e]];
#pragma unroll L::kUnroll
          for (int kt = 0; kt < TILE / 16; ++kt) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa;
            mma::wmma_load(pa, p_s + rb * 16 * L::kLdp + kt * 16, L::kLdp);
            wmma::mma_sync(o, pa, vb[kt], o);
          }
        }
      }
    }
    __pipeline_wait_prior(0);  // only empty batches are left
  }

  // 5. the rows' results, to the slots of their members
  if (sub == 0) l_s[row] = l;
  __syncthreads();  // l of every row is in
  // Each tile through the warp's o_s: lane takes row lane / 2, columns 8 * (lane % 2) ..
#pragma unroll
  for (int j = 0; j < L::kWarpTiles; ++j) {
    const int slice = warp + j / L::kRowBlocks * WARPS;
    if (slice >= L::kSteps) break;  // uniform over the warp
    wmma::store_matrix_sync(o_s, acc[j], L::kLdo, wmma::mem_row_major);
    __syncwarp();  // every lane's part of the tile is in
    const int r = j % L::kRowBlocks * 16 + out_row;
    if (r < num_rows) {
      const int flat = first_row + r;
      const long long out_row_index =
          static_cast<long long>(members[flat / group_size].y) * num_q_heads +
          kv_head * group_size + flat % group_size;
      const float l_row = l_s[r];
      const int col = slice * 16 + out_col;
      float part[8];
      load16_as_float(o_s + out_row * L::kLdo + out_col, part);
      load16_as_float(o_s + out_row * L::kLdo + out_col + 4, part + 4);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float value = kFp8 ? part[e] * out_scale : part[e];
        // All -inf: weight 0 in the merge, and a zero row, not 0 / 0.
        partial_out[out_row_index * HEAD_DIM + col + e] = l_row == 0.0f ? 0.0f : value / l_row;
      }
    }
    __syncwarp();  // every lane has read the tile before the next tile's store
  }
  if (sub == 0 && row < num_rows) {
    const int flat = first_row + row;
    const long long lse_index = static_cast<long long>(members[flat / group_size].y) *
                                    num_q_heads + kv_head * group_size + flat % group_size;
    const float base = m == neg_inf() ? 0.0f : m;
    partial_lse[lse_index] = base + logf(l);  // l = 0 (no key, or all -inf): -inf
  }
}

// ---- cascade_shared_cores: float32 queries over a float32 cache, on CUDA cores --------------
// The same contract, arguments and grid as cascade_shared (one argument record serves both);
// a second kernel, not a float case of the template, because nothing of the tensor-core scheme
// carries over: no 16-bit operand type, so no WMMA, no P rounded to T, no fragment layouts.
// Products and sums are float32 throughout (the oracle's tolerance for float32, 1e-5).
//
// One thread block per (KV head, tile) of WARPS warps; a tile is up to ROWS query rows, a stage
// TILE = 32 tokens (one per lane). Warp w owns rows w, w + WARPS, ... (RPW = ROWS / WARPS of
// them) in every phase, so the softmax's running max, sums and alpha never leave its registers;
// only the K/V ring is shared by the block. Each K/V byte of [begin, end) is read from global
// memory once per thread block and serves all ROWS rows (q rows from q_s, K and V from the ring,
// common.cuh's KvRing with SPLIT_KV, rows padded by 4 floats):
//   0. q rows of the tile into q_s (float, zeros past num_rows).
//   Per stage:
//   1. wait for K of stage i, __syncthreads; refill the slot of stage i - 1;
//   2. scores: lane t computes s = q_r . k_t for its warp's RPW rows over its own token t (one
//      LDS.128 of K per 4 elements, conflict-free: rows HEAD_DIM + 4 floats apart; the q rows'
//      LDS.128 a broadcast over the warp);
//   3. online softmax per row over the stage's 32 tokens: score scale, variants, masks (past end,
//      before the row's window) as the header says; m_new by a max over the warp's lanes (fmaxf:
//      a NaN score does not become the max, its exp makes the row NaN); p = exp(s - m_new) to
//      the warp's row of p_s; each lane keeps its own part of l (l = alpha l + p), summed over
//      the lanes once at the end;
//   4. wait for V of stage i, __syncthreads; acc = alpha acc + P V: lane owns the 16-byte
//      column vectors lane, lane + 32, ... of its warp's rows (idle where the row ends: head_dim
//      80 leaves 12 lanes idle), reads P four tokens at a time (an LDS.128 broadcast) and V rows
//      by LDS.128 (consecutive lanes, consecutive vectors).
//   5. l summed over the lanes; each lane writes its vectors as acc / l (0 when l is 0: every
//      key masked), lane 0 each row's log-sum-exp m + log l (-inf when l is 0).
template <int HEAD_DIM, int ROWS, int WARPS, int STAGES>
struct CascadeCoresLayout {
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kTile = 32;                  // tokens per stage: one per lane
  static constexpr int kRowsPerWarp = ROWS / WARPS;
  static constexpr int kRowVectors = HEAD_DIM / 4;  // 16-byte vectors per row
  static constexpr int kLaneVectors = (kRowVectors + 31) / 32;  // output vectors per lane
  static constexpr int kLdk = HEAD_DIM + 4;  // K/V/q row, floats: +16 bytes, no conflicts
  // Byte offsets of the dynamic shared memory: k_s, v_s [STAGES, TILE, kLdk] float, q_s [ROWS,
  // kLdk] float, p_s [ROWS, TILE] float.
  static constexpr int kStageBytes = STAGES * kTile * kLdk * 4;
  static constexpr int kQ = 2 * kStageBytes;
  static constexpr int kP = kQ + ROWS * kLdk * 4;
  static constexpr int kBytes = kP + ROWS * kTile * 4;  // the launch table's shared_mem
  static_assert(ROWS % WARPS == 0, "every warp owns the same number of rows");
  static_assert(HEAD_DIM % 16 == 0, "rows of whole 16-byte vectors, as the ring copies them");
  static_assert(STAGES >= 2 && 2 * STAGES - 2 <= 8, "the waits count at most 8 batches");
};

// Grid: (num_kv_heads, num_tiles). Block: (32, WARPS, 1).
// Dynamic shared memory: CascadeCoresLayout::kBytes (above), 16-byte aligned.
// The parameters, tiles and members as cascade_shared's (above); KV is float (T's type).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int ROWS, int WARPS, int STAGES,
          int VARIANT, typename KV>
__global__ void __launch_bounds__(32 * WARPS, 1)
    cascade_shared_cores(float* __restrict__ partial_out,       // [capacity, num_q_heads, HEAD_DIM]
                         float* __restrict__ partial_lse,       // [capacity, num_q_heads]
                         const T* __restrict__ q,               // [num_seqs, num_q_heads, HEAD_DIM]
                         const KV* __restrict__ k_cache,        // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                         const KV* __restrict__ v_cache,        // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                         const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                         const int4* __restrict__ tiles,        // [num_tiles] {first_row, num_rows, begin, end}
                         const int2* __restrict__ members,      // [num_members] {seq, slot}
                         const int* __restrict__ context_lens,  // [num_seqs], under kAlibi or kWindow
                         int num_kv_heads, int group_size, int max_blocks, float scale,
                         float k_scale, float v_scale,
                         const float* __restrict__ k_scales,    // never read: no fp8 here
                         const float* __restrict__ v_scales,    // never read: no fp8 here
                         int k_scale_stride, int v_scale_stride,
                         int window_left,                       // under kWindow, < 0: none
                         float soft_cap,
                         const float* __restrict__ alibi_slopes,  // [num_q_heads], read under kAlibi
                         const float* __restrict__ sinks) {       // never read: the merge's
  using L = CascadeCoresLayout<HEAD_DIM, ROWS, WARPS, STAGES>;
  static_assert(sizeof(T) == 4 && sizeof(KV) == 4, "float32 queries over a float32 cache");
  constexpr int TILE = L::kTile;
  constexpr int THREADS = L::kThreads;
  constexpr int LDK = L::kLdk;
  constexpr int RPW = L::kRowsPerWarp;
  constexpr int NV = L::kLaneVectors;
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, true, true, LDK>;

  const int4 tile = tiles[blockIdx.y];
  const int first_row = tile.x;
  const int num_rows = tile.y;
  const int begin = tile.z;
  const int end = tile.w;
  const int kv_head = blockIdx.x;
  const int lane = threadIdx.x;
  const int warp = threadIdx.y;
  const int tid = warp * 32 + lane;
  const int num_q_heads = num_kv_heads * group_size;

  CUPAGED_DYNAMIC_SHARED(unsigned char, smem);
  KV* k_s = reinterpret_cast<KV*>(smem);                     // [STAGES, TILE, LDK]
  KV* v_s = reinterpret_cast<KV*>(smem + L::kStageBytes);    // [STAGES, TILE, LDK]
  float* q_s = reinterpret_cast<float*>(smem + L::kQ);       // [ROWS, LDK]
  float* p_s = reinterpret_cast<float*>(smem + L::kP);       // [ROWS, TILE]

  // The warp's rows warp + i * WARPS: their query positions (ALiBi's i, the window's origin),
  // slopes and first keys (keys before i - window_left are masked; no overflow: i >= -1).
  constexpr bool kHasAlibi = (VARIANT & kAlibi) != 0;
  constexpr bool kHasWindow = (VARIANT & kWindow) != 0;
  int query_pos[RPW];
  float slope[RPW];
  int first_key[RPW];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const int row = warp + i * WARPS;
    query_pos[i] = 0;
    slope[i] = 0.0f;
    if ((kHasAlibi || kHasWindow) && row < num_rows) {
      const int r = first_row + row;
      query_pos[i] = context_lens[members[r / group_size].x] - 1;
      if (kHasAlibi) slope[i] = alibi_slopes[kv_head * group_size + r % group_size];
    }
    first_key[i] = kHasWindow && window_left >= 0 ? query_pos[i] - window_left : begin;
  }
  float m[RPW], l[RPW];  // l: this lane's part of the row's sum
  float acc[RPW][NV][4];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    m[i] = neg_inf();
    l[i] = 0.0f;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][v][e] = 0.0f;
    }
  }

  if (begin < end) {  // uniform over the block
    // 0. q rows of the tile into q_s; rows past num_rows are zeros.
    const bool q_aligned = (reinterpret_cast<unsigned long long>(q) & 15u) == 0;
    for (int j = tid; j < ROWS * L::kRowVectors; j += THREADS) {
      const int g = j / L::kRowVectors;
      const int col = j % L::kRowVectors * 4;
      float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (g < num_rows) {
        const int r = first_row + g;
        const long long q_row = static_cast<long long>(members[r / group_size].x) * num_q_heads +
                                kv_head * group_size + r % group_size;
        const T* src = q + q_row * HEAD_DIM + col;
        if (q_aligned) {
          value = *reinterpret_cast<const float4*>(src);
        } else {
          value = make_float4(src[0], src[1], src[2], src[3]);
        }
      }
      *reinterpret_cast<float4*>(q_s + g * LDK + col) = value;
    }

    // The shared blocks, read from the table of the tile's first member.
    const int table_seq = members[first_row / group_size].x;
    Ring ring(k_s, v_s, k_cache, v_cache,
              block_tables + static_cast<long long>(table_seq) * max_blocks, num_kv_heads,
              kv_head, begin, end, tid);
    ring.start();

    for (int stage = 0; stage < ring.num_stages; ++stage) {
      Ring::wait_k();
      __syncthreads();  // K of `stage` is in (and, the first time, q_s); stage - 1 is done
      ring.refill(stage);

      // 2. scores of the warp's rows against token `lane` of the stage
      float s[RPW];
#pragma unroll
      for (int i = 0; i < RPW; ++i) s[i] = 0.0f;
      const float* k_row = ring.k_row(stage, lane);
#pragma unroll 4
      for (int d = 0; d < HEAD_DIM; d += 4) {
        const float4 k = *reinterpret_cast<const float4*>(k_row + d);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
          const float4 qv = *reinterpret_cast<const float4*>(q_s + (warp + i * WARPS) * LDK + d);
          s[i] += qv.x * k.x;
          s[i] += qv.y * k.y;
          s[i] += qv.z * k.z;
          s[i] += qv.w * k.w;
        }
      }

      // 3. online softmax of each row over the stage's tokens
      const int key = begin + stage * TILE + lane;
      float alpha[RPW];
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const float sc = key < end && key >= first_key[i]
                             ? variant_score<VARIANT>(s[i] * scale, soft_cap, slope[i],
                                                      key - query_pos[i])
                             : neg_inf();
        float m_new = fmaxf(m[i], sc);
#pragma unroll
        for (int width = 16; width > 0; width /= 2) {
          m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, width));
        }
        const float base = m_new == neg_inf() ? 0.0f : m_new;
        const float p = expf(sc - base);
        alpha[i] = expf(m[i] - base);  // 0 while m = -inf
        l[i] = l[i] * alpha[i] + p;
        m[i] = m_new;
        p_s[(warp + i * WARPS) * TILE + lane] = p;
      }

      Ring::wait_v();
      __syncthreads();  // V of `stage` is in; so is P (the warp's own rows)

      // 4. acc = alpha acc + P V over the lane's column vectors
      const float* v_rows = ring.v_row(stage, 0);
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
#pragma unroll
        for (int v = 0; v < NV; ++v) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][v][e] *= alpha[i];
        }
      }
#pragma unroll 2
      for (int t = 0; t < TILE; t += 4) {
        float4 vv[4][NV];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
#pragma unroll
          for (int v = 0; v < NV; ++v) {
            const int col = (lane + 32 * v) * 4;
            const float* src = v_rows + (t + x) * LDK + col;
            vv[x][v] = col < HEAD_DIM ? *reinterpret_cast<const float4*>(src)
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
          const float4 p = *reinterpret_cast<const float4*>(p_s + (warp + i * WARPS) * TILE + t);
          const float pw[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
          for (int x = 0; x < 4; ++x) {
#pragma unroll
            for (int v = 0; v < NV; ++v) {
              acc[i][v][0] += pw[x] * vv[x][v].x;
              acc[i][v][1] += pw[x] * vv[x][v].y;
              acc[i][v][2] += pw[x] * vv[x][v].z;
              acc[i][v][3] += pw[x] * vv[x][v].w;
            }
          }
        }
      }
    }
    __pipeline_wait_prior(0);  // only empty batches are left
  }

  // 5. the rows' results, to the slots of their members
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    float sum = l[i];
#pragma unroll
    for (int width = 16; width > 0; width /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, width);
    const int row = warp + i * WARPS;
    if (row >= num_rows) continue;
    const int flat = first_row + row;
    const long long index = static_cast<long long>(members[flat / group_size].y) * num_q_heads +
                            kv_head * group_size + flat % group_size;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const int col = (lane + 32 * v) * 4;
      if (col >= HEAD_DIM) continue;
      // All -inf: weight 0 in the merge, and a zero row, not 0 / 0.
      float4 out = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (sum != 0.0f) {
        out = make_float4(acc[i][v][0] / sum, acc[i][v][1] / sum, acc[i][v][2] / sum,
                          acc[i][v][3] / sum);
      }
      *reinterpret_cast<float4*>(partial_out + index * HEAD_DIM + col) = out;
    }
    if (lane == 0) {
      const float base = m[i] == neg_inf() ? 0.0f : m[i];
      partial_lse[index] = base + logf(sum);  // sum = 0 (no key, or all -inf): -inf
    }
  }
}

}  // namespace cupaged
