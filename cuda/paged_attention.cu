// paged_attention.cu: decode attention (one query token per sequence) over the paged KV cache.
//
// For sequence s and query head h, with G = num_q_heads / num_kv_heads query heads per KV head:
//   out[s, h] = softmax(scale * K q[s, h]) V,  K and V: tokens 0 .. len_s - 1 of KV head h / G,
//   token pos in block block_tables[s, pos / BLOCK_SIZE] at offset pos % BLOCK_SIZE.
// A sequence with context length 0 gets a zero row. NaN and Inf propagate as in the reference: a
// NaN score (NaN in q or K, scale NaN) or a +Inf one makes the row NaN, a -Inf score weighs 0, a
// row whose scores are all -Inf is NaN (0 / 0), Inf in V gives Inf (or NaN where it meets 0).
// Reference: cupaged/attention/reference.py, reference_attention (gather, then an explicit softmax).
//
// Attention variants (common.cuh, "Attention variants"; docs/variants.md), bits of the kernels'
// VARIANT template argument (0, the default: none of them, the kernels as they were), their values
// in the four trailing arguments. The query of sequence s sits at position i = len_s - 1, head h:
//   window (kWindow):   keys j < i - window_left are not attended. The work list does it: its
//                       items cover only [max(0, i - window_left), len_s) (decode_plan.cu), so
//                       the kernels never read a table entry before the window; the decode
//                       kernels' VARIANT leaves the bit off (the same instantiation as none);
//   soft-cap (kSoftCap): s = soft_cap * tanh(s / soft_cap), per score, before ALiBi;
//   ALiBi (kAlibi):     s += alibi_slopes[h] * (j - i); the only case that reads context_lens
//                       (for i: an item does not know its sequence's length);
//   sinks (kSinks):     the softmax denominator gains exp(sinks[h] - m), m = max(max_j s_j,
//                       sinks[h]), once: at the final normalisation of a single-item sequence,
//                       else in the merge (never in an item's partial row). A context of
//                       length 0 still gets a zero row.
// NaN and Inf through them as through the formula: tanh takes +-Inf to +-soft_cap, a NaN sink
// makes the row NaN, a sink of -Inf weighs 0 (all scores -Inf too: NaN, 0 / 0), +Inf is NaN.
//
// fp8 caches (common.cuh, "fp8 caches"; docs/fp8.md): both kernels take the cache's element type
// KV as their last template argument (default T, the query's type, which stays float32, float16
// or bfloat16). The ring stages fp8 rows with the same 16-byte copies (16 elements each); the
// scores use scale * k_scale(h) in place of scale (folded into q, or into the float32 score
// scale of paged_decode_mma), and each output row, direct or partial, is multiplied by
// v_scale(h) once, so the merge is the same for every cache. paged_decode reads 8 fp8 bytes per
// lane unit (LDS.64) and converts them in registers, so that a lane owns the elements it owns
// over fp16; paged_decode_mma loads its WMMA fragments straight from the staged fp8 rows, two fp8
// values per 16-bit element, and converts them in registers (exact: every fp8 value is an fp16
// and a bf16 value; its section says how, with the element layout left opaque).
//
// The work list (cuda/decode_plan.cu) cuts the step into items, work[i] = {seq, begin, end,
// count}: tokens [begin, end) of sequence seq, which has count items in all (begin any position,
// not a multiple of a stage: the ring finds each row's block). The item bounds are the whole
// truth of which tokens are attended: the kernel reads the context lengths for ALiBi only.
//
// paged_decode: one thread block per (KV head, head chunk, item), a 3-D block of BDX x BDY x BDZ
// threads. A chunk is CHUNK query heads of the KV head's group (the whole group up to 16 heads; a
// larger group is cut into ceil(G / CHUNK) chunks, each block reading the KV head once for its
// chunk, so that a thread's q rows and accumulators stay in registers for any G):
//
//   tx (BDX lanes)  across the head vector: lane tx owns the 16-byte vectors tx, tx + BDX, ... of
//                   a row (8 or 16 elements: 1 or 2 vectors of a 16-bit type, 2 or 4 of float);
//                   in a padded layout (head_dim 80 at fp16: 10 vectors on 16 lanes) some idle
//   ty (BDY)        over the chunk: thread ty serves query heads ty * HPT .. ty * HPT + HPT - 1
//                   of it (HPT = ceil(CHUNK / BDY)), its scaled q rows and accumulators in
//                   registers
//   tz (BDZ)        over tokens: a stage of TILE = BDZ * TPZ tokens, tz takes tokens
//                   tz * TPZ .. tz * TPZ + TPZ - 1 of it, with its own online softmax
//
//   K and V are staged through a ring of STAGES shared-memory stages with 16-byte cp.async copies
//   (common.cuh, KvRing with SPLIT_KV: every thread copies part of every stage; K and V of a
//   stage are separate batches, so the scores start as soon as K has landed). Each K/V byte is
//   read from global memory once per block and serves the query heads of the chunk. Per stage:
//     1. wait for K of stage i (__pipeline_wait_prior), __syncthreads: every thread's copies have
//        landed and every thread has finished stage i - 1, whose slot is now free;
//     2. refill that slot with stage i + STAGES - 1 (its block ids were loaded one stage ago) and
//        load the block ids of stage i + STAGES, which land while this stage computes;
//     3. scores: per token, each lane dots its 16-byte parts of K (one LDS.128 per vector,
//        converted in pairs) with its q parts for its HPT heads; shuffles over the BDX lanes
//        finish the dot products, so every lane of the group holds the scores;
//     4. online softmax over the TPZ tokens: running max m, sum l, alpha = exp(m_old - m_new);
//        while every score so far is -inf, exponents are taken against 0 (-inf - -inf is NaN);
//        fmaxf skips NaN scores, whose exp is NaN and reaches l and acc;
//     5. wait for V of stage i, __syncthreads; acc = alpha * acc + p V in registers.
//   Tokens past the item's end are zero-filled copies with score -inf (weight 0); soft-cap and
//   ALiBi apply to the scores after step 3, before that mask.
//   At the end the BDZ partial softmaxes of a head are merged exactly through shared memory.
//   A single-item sequence writes out = acc / l directly (with a sink, acc * f / (l * f +
//   exp(sink - M)), M = max(m, sink), f = exp(m - M)); otherwise the item writes its partial
//   row acc / l and its log-sum-exp m + log(l) (-inf when all its scores are -inf; its partial row
//   is 0 then, so that the merge's weight 0 does not meet 0 / 0).
// The pieces of a split sequence are combined by their log-sum-exps:
//   out = sum_i exp(lse_i - M) * partial_i / (sum_i exp(lse_i - M) [+ exp(sink - M)]),
//   M = max(max_i lse_i [, sink]),
// in the decode launch itself when it is given merge_counters (a plan's: one launch per step),
// else by paged_decode_merge, a second launch (the cascade, whose shared level adds pieces that
// no decode block counts), in parallel over query heads, slices of the head's row and the items
// (its threads' partial sums added by a tree in shared memory).
//
// Split sequences: the last block merges (CUDA's threadFenceReduction sample; CUTLASS's serial
// split-K semaphore). merge_counters[seq, blockIdx.x], int32 [num_seqs, gridDim.x], one per
// sequence and (KV head, head chunk), all 0 when the launch starts. Every block of a split
// sequence's item (count > 1, uniform over the block; merge_split):
//   1. writes its partial rows and log-sum-exps (every thread its own elements), __syncthreads;
//   2. thread 0: __threadfence (the block's writes, which the barrier ordered before it, are
//      visible device-wide before the ticket: the fence is cumulative), then
//      ticket = atomicAdd(counter, 1); the block whose ticket is count - 1 arrived last: every
//      other piece of the sequence for these heads is written and fenced. It sets the counter
//      back to 0 (no other block of this launch touches it again: all count arrived; the next
//      launch on the stream starts after this one ends, so it finds 0, and a CUDA graph's
//      replay needs no memset) and fences again (acquire: its reads below come after the
//      others' writes);
//   3. __syncthreads_or(last) tells the block; the others return. The last block merges its
//      chunk's query heads (the rows it computed) over all count pieces, first .. first +
//      count - 1 = seq_items[seq], reading them with __ldcg (L2, the point of coherence: never
//      a stale L1 line), and writes out, with the sink as paged_decode_merge adds it: each
//      head's M by rows of threads over the pieces (fmaxf, order-free) through the shared
//      memory the stages no longer use, then each thread 4 floats of one head's row.
// Each thread adds the pieces one after the other, in index order: the sum does not depend on
// which block came last nor on the launch's timing (the same bits run to run), and a sequence's
// bits depend on its own pieces alone (batch-invariant plans rely on it). It is
// paged_decode_merge's order in a block of one row (rows > 1 add in a tree): NaN, Inf and -inf
// as its header says. With merge_counters == nullptr, steps 2 and 3 are skipped: the partial
// rows wait for paged_decode_merge.
#ifndef CUPAGED_CPU
#include <mma.h>  // WMMA; the CPU backend's shim provides nvcuda::wmma itself
#endif

#include "common.cuh"
#include "mma_sync.cuh"

namespace cupaged {

// A sink folded into a single-item row's softmax (kSinks): the row's sums l and acc are relative
// to the exponents' base m (0 while m = -inf, step 4 of the header); rescaled to M = max(m, sink),
// the sink's exp(sink - M) joins l. Returns the factor f = exp(m - M) of acc, so that
// acc * f / l is the row. m = -inf: f = 0, the sums are 0 and stay 0 (a finite sink gives a zero
// row; a sink of -inf, 0 / 0 = NaN, as the formula).
__device__ __forceinline__ float fold_sink(float m, float& l, float sink) {
  const float top = fmaxf(m, sink);  // a NaN sink: m here, NaN in exp(sink - top)
  const float f = m == neg_inf() ? 0.0f : expf(m - top);
  l = l * f + expf(sink - top);
  return f;
}

// A split sequence's item after it wrote its partial rows (the header's "the last block
// merges", steps 1-3): the block that arrives last on its counter merges the sequence's pieces for
// the chunk's query heads first_head .. first_head + heads - 1 into out. Every thread of the
// block calls it (its barriers), with count > 1 and merge_counters != nullptr. Not inlined:
// inlined (an earlier form, NVRTC 12.9), ptxas spilled 4 bytes in the fp8 tensor-core kernel
// with sinks on sm_80 and gave the fp16 CUDA-core kernel at head_dim 192 168 registers, not 128.
// Its arguments are the kernel's own, which a kernel keeps in constant memory, and the shared
// memory the stages no longer use (scratch: THREADS + 16 floats); the item and the chunk are
// read again here, so that nothing the merge needs stays live in a register through the stage
// loop. THREADS, CHUNK: the block's threads and head chunk.
template <typename T, int HEAD_DIM, int VARIANT, int THREADS, int CHUNK>
__device__ __noinline__ void merge_split(T* __restrict__ out, const float* __restrict__ partial_out,
                                         const float* __restrict__ partial_lse,
                                         const int4* __restrict__ work,
                                         const int2* __restrict__ seq_items,
                                         int* __restrict__ merge_counters, int num_kv_heads,
                                         int group_size, const float* __restrict__ sinks,
                                         float* scratch) {
  static_assert(CHUNK <= 16 && CHUNK < THREADS, "scratch holds THREADS + 16 floats");
  const int tid = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const int4 item = work[blockIdx.y];
  const int seq = item.x, count = item.w;
  const DecodeChunk chunk(blockIdx.x, group_size, CHUNK);
  const int first_head = chunk.first_head, heads = chunk.heads;
  const int num_q_heads = num_kv_heads * group_size;
  __syncthreads();  // 1. every thread's partial rows and log-sum-exps are written
  int last = 0;
  if (tid == 0) {  // 2.
    int* counter = merge_counters + static_cast<long long>(seq) * gridDim.x + blockIdx.x;
    __threadfence();  // release: the block's pieces before its ticket
    last = atomicAdd(counter, 1) == count - 1;
    if (last) {
      *counter = 0;     // every piece has arrived: zero again for the next launch
      __threadfence();  // acquire: the others' pieces before the reads below
    }
  }
  if (!__syncthreads_or(last)) return;  // 3. (uniform over the block)
  constexpr bool kHasSinks = (VARIANT & kSinks) != 0;
  constexpr int kVectors = HEAD_DIM / 4;  // a row's 4-float vectors (HEAD_DIM: a multiple of 16)
  const int first = seq_items[seq].x;
  // Each head's largest log-sum-exp, M (fmaxf: NaN skipped, -inf where every piece is -inf or
  // NaN; order-free): rows of threads over the pieces (one round of loads from L2, not count),
  // then thread h over the rows.
  const int rows = THREADS / heads;  // heads <= 16 < THREADS
  if (tid < rows * heads) {
    float m = neg_inf();
    for (int i = first + tid / heads; i < first + count; i += rows) {
      m = fmaxf(m, __ldcg(partial_lse + static_cast<long long>(i) * num_q_heads + first_head +
                          tid % heads));
    }
    scratch[tid] = m;
  }
  __syncthreads();
  if (tid < heads) {
    float m = neg_inf();
    for (int r = 0; r < rows; ++r) m = fmaxf(m, scratch[r * heads + tid]);
    scratch[THREADS + tid] = m;
  }
  __syncthreads();
  for (int j = tid; j < heads * kVectors; j += THREADS) {
    const int head = first_head + j / kVectors;
    const int v = j % kVectors;
    float lse_max = scratch[THREADS + j / kVectors];
    const float sink = kHasSinks ? sinks[head] : 0.0f;
    if constexpr (kHasSinks) lse_max = fmaxf(lse_max, sink);  // a NaN sink: NaN below
    float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float den = 0.0f;
    // Unrolled: eight pieces' loads from L2 in flight per thread, not one; the sums keep the
    // pieces' order.
#pragma unroll 8
    for (int i = first; i < first + count; ++i) {  // in index order: the header
      const long long part = static_cast<long long>(i) * num_q_heads + head;
      const float w = expf(__ldcg(partial_lse + part) - lse_max);
      const float4 p = __ldcg(reinterpret_cast<const float4*>(partial_out + part * HEAD_DIM) + v);
      den += w;
      num.x += w * p.x;
      num.y += w * p.y;
      num.z += w * p.z;
      num.w += w * p.w;
    }
    if constexpr (kHasSinks) den += expf(sink - lse_max);
    T* dst = out + (static_cast<long long>(seq) * num_q_heads + head) * HEAD_DIM + 4 * v;
    dst[0] = from_float<T>(num.x / den);
    dst[1] = from_float<T>(num.y / den);
    dst[2] = from_float<T>(num.z / den);
    dst[3] = from_float<T>(num.w / den);
  }
}

// A lane's unit of a K/V row in paged_decode: the elements it converts per shared-memory read.
// 16 bytes of a 16/32-bit cache (an LDS.128); 8 bytes of fp8 (an LDS.64), so that over fp8 a lane
// owns the same elements, and keeps the same registers, as over fp16.
template <typename KV>
struct LaneUnit {
  static constexpr int kElems = IsFp8<KV>::value ? 8 : Vec16<KV>::kElems;
};

// The lane unit at p (aligned to its size) as floats.
template <typename KV>
__device__ __forceinline__ void load_unit_as_float(const KV* p, float* out) {
  if constexpr (IsFp8<KV>::value) {
    load8_as_float<KV>(p, out);
  } else {
    load16_as_float(p, out);
  }
}

// The thread-block layout of one instantiation (see the header); the launch table
// (cupaged/kernels/launch_decode.py, decode_launch) picks BDX, BDY, BDZ, TPZ and STAGES and passes them as
// template arguments, so nothing is kept equal by hand between Python and CUDA.
template <typename T, int HEAD_DIM, int CHUNK, int BDX, int BDY, int BDZ, int TPZ, int STAGES,
          typename KV = T>
struct DecodeLayout {
  static constexpr int kVec = LaneUnit<KV>::kElems;           // elements per lane unit
  static constexpr int kQLoads = kVec / Vec16<T>::kElems;     // 16-byte loads of q per unit
  static constexpr int kRowVectors = HEAD_DIM / kVec;         // lane units per K/V row
  static constexpr int kLaneVectors = (kRowVectors + BDX - 1) / BDX;  // per lane
  static constexpr int kLaneElems = kLaneVectors * kVec;
  static constexpr bool kEveryLaneFull = kRowVectors == kLaneVectors * BDX;
  static constexpr int kHeadsPerThread = (CHUNK + BDY - 1) / BDY;
  static constexpr int kThreads = BDX * BDY * BDZ;
  static constexpr int kTile = BDZ * TPZ;                     // tokens per stage
  static_assert(HEAD_DIM % kVec == 0 && HEAD_DIM % Vec16<KV>::kElems == 0,
                "a row is whole lane units and whole 16-byte copies");
  static_assert(kQLoads >= 1 && kVec % Vec16<T>::kElems == 0, "a unit of q is whole 16-byte loads");
  static_assert(BDX >= 1 && BDX <= 32 && (BDX & (BDX - 1)) == 0, "BDX: a power of two <= 32");
  static_assert(kThreads % 32 == 0, "whole warps: the shuffles name all 32 lanes");
  static_assert(BDY * kHeadsPerThread >= CHUNK && BDY * (kHeadsPerThread - 1) < CHUNK,
                "every thread row serves at least one query head");
  static_assert(STAGES >= 2 && 2 * STAGES - 2 <= 8, "the waits below count at most 8 batches");
};

// Grid: (num_kv_heads * head_chunks, capacity), x = kv_head * head_chunks + chunk, head_chunks =
// ceil(group_size / CHUNK) (DecodeChunk, common.cuh). Block: (BDX, BDY, BDZ).
// Dynamic shared memory: k_s [STAGES, TILE, HEAD_DIM] of KV, then v_s [STAGES, TILE, HEAD_DIM] of
// KV; after the loop, when BDZ > 1, the same bytes hold the BDZ partial results of the block's
// heads (float32: m_l [BDZ, BDY * HPT, 2], then acc [BDZ, BDY * HPT, HEAD_DIM]).
// KV: the cache's element type, T's but for an fp8 cache (q and the output stay T); its scales
// (common.cuh, "fp8 caches") are read only then: K's folds into q's scale, V's multiplies each
// output row (direct or partial) once, so that the merge is the same for every cache.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int CHUNK, int BDX, int BDY, int BDZ, int TPZ,
          int STAGES, int VARIANT = 0, typename KV = T>
__global__ void __launch_bounds__(BDX* BDY* BDZ)
    paged_decode(T* __restrict__ out,                  // [num_seqs, num_q_heads, HEAD_DIM]
                 float* __restrict__ partial_out,      // [capacity, num_q_heads, HEAD_DIM]
                 float* __restrict__ partial_lse,      // [capacity, num_q_heads]
                 const T* __restrict__ q,              // [num_seqs, num_q_heads, HEAD_DIM]
                 const KV* __restrict__ k_cache,       // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                 const KV* __restrict__ v_cache,       // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                 const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                 const int4* __restrict__ work,         // [capacity] {seq, begin, end, count}
                 const int2* __restrict__ seq_items,    // [num_seqs] {first, count}
                 int* __restrict__ merge_counters,      // [num_seqs, gridDim.x] or nullptr
                 const int* __restrict__ context_lens,  // [num_seqs], read under kAlibi only
                 int num_kv_heads, int group_size, int max_blocks, float scale,
                 float k_scale, float v_scale,
                 const float* __restrict__ k_scales,    // [1] or [num_kv_heads], read over fp8
                 const float* __restrict__ v_scales,    // [1] or [num_kv_heads], read over fp8
                 int k_scale_stride, int v_scale_stride,
                 int window_left,                       // the work list's (the header)
                 float soft_cap,
                 const float* __restrict__ alibi_slopes,  // [num_q_heads], read under kAlibi
                 const float* __restrict__ sinks) {       // [num_q_heads], read under kSinks
  using L = DecodeLayout<T, HEAD_DIM, CHUNK, BDX, BDY, BDZ, TPZ, STAGES, KV>;
  constexpr int VEC = L::kVec;
  constexpr int NV = L::kLaneVectors;
  constexpr int NE = L::kLaneElems;
  constexpr int HPT = L::kHeadsPerThread;
  constexpr int TILE = L::kTile;
  constexpr int THREADS = L::kThreads;

  const int4 item = work[blockIdx.y];
  if (item.x < 0) return;  // an unused entry of the work list (uniform over the block)
  const int seq = item.x;
  const int begin = item.y;
  const int end = item.z;
  const bool direct = item.w == 1;
  const DecodeChunk chunk(blockIdx.x, group_size, CHUNK);
  const int kv_head = chunk.kv_head;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int tz = threadIdx.z;
  const int tid = (tz * BDY + ty) * BDX + tx;
  const int num_q_heads = num_kv_heads * group_size;
  const long long head_row = static_cast<long long>(seq) * num_q_heads + chunk.first_head;

  // ALiBi: the query's position and each of the thread's heads' slope (0 past the chunk).
  constexpr bool kHasAlibi = (VARIANT & kAlibi) != 0;
  const int query_pos = kHasAlibi ? context_lens[seq] - 1 : 0;
  float slope[HPT];
#pragma unroll
  for (int h = 0; h < HPT; ++h) {
    const int g = ty * HPT + h;
    slope[h] = kHasAlibi && g < chunk.heads ? alibi_slopes[chunk.first_head + g] : 0.0f;
  }

  // Lane tx's vectors: tx + v * BDX; in a padded layout the last ones may lie past the row.
  bool lane_ok[NV];
#pragma unroll
  for (int v = 0; v < NV; ++v) lane_ok[v] = L::kEveryLaneFull || tx + v * BDX < L::kRowVectors;

  // q in registers, scaled (over fp8 by scale * K's scale of the KV head: once, not per score);
  // a head past the chunk (CHUNK not a multiple of BDY, or the group's last chunk short) is zeros.
  constexpr bool kFp8 = IsFp8<KV>::value;
  const float q_scale =
      kFp8 ? scale * head_scale(k_scale, k_scales, k_scale_stride, kv_head) : scale;
  float qf[HPT][NE];
  const bool q_aligned = (reinterpret_cast<unsigned long long>(q) & 15u) == 0;
#pragma unroll
  for (int h = 0; h < HPT; ++h) {
    const int g = ty * HPT + h;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      float* dst = qf[h] + v * VEC;
      const T* src = q + (head_row + g) * HEAD_DIM + (tx + v * BDX) * VEC;
      if (g < chunk.heads && lane_ok[v]) {
        if (q_aligned) {
#pragma unroll
          for (int part = 0; part < L::kQLoads; ++part) {
            load16_as_float(src + part * Vec16<T>::kElems, dst + part * Vec16<T>::kElems);
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dst[e] = to_float(src[e]);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) dst[e] *= q_scale;
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) dst[e] = 0.0f;
      }
    }
  }

  float m[HPT], l[HPT], acc[HPT][NE];
#pragma unroll
  for (int h = 0; h < HPT; ++h) {
    m[h] = neg_inf();
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < NE; ++e) acc[h][e] = 0.0f;
  }

  CUPAGED_DYNAMIC_SHARED(KV, smem);
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, true>;
  static_assert(2 * STAGES * TILE * HEAD_DIM * sizeof(KV) >= (THREADS + 16) * sizeof(float),
                "merge_split's scratch fits in the ring's bytes");

  if (begin < end) {
    // K stages [STAGES, TILE, HEAD_DIM], then V stages the same (common.cuh, KvRing).
    Ring ring(smem, smem + STAGES * TILE * HEAD_DIM, k_cache, v_cache,
              block_tables + static_cast<long long>(seq) * max_blocks, num_kv_heads, kv_head,
              begin, end, tid);
    ring.start();
    for (int stage = 0; stage < ring.num_stages; ++stage) {
      Ring::wait_k();
      __syncthreads();  // all of K of `stage` is in; every thread is done with stage - 1
      ring.refill(stage);  // stage + STAGES - 1 into that slot; block ids of stage + STAGES

      const int first = begin + stage * TILE + tz * TPZ;  // this thread's first token
      const KV* k_rows = ring.k_row(stage, tz * TPZ) + tx * VEC;
      float s[HPT][TPZ];
#pragma unroll
      for (int t = 0; t < TPZ; ++t) {
        float kf[NE];
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          if (lane_ok[v]) {
            load_unit_as_float(k_rows + t * HEAD_DIM + v * BDX * VEC, kf + v * VEC);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) kf[v * VEC + e] = 0.0f;
          }
        }
#pragma unroll
        for (int h = 0; h < HPT; ++h) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < NE; ++e) dot += qf[h][e] * kf[e];
          s[h][t] = dot;
        }
      }
#pragma unroll
      for (int h = 0; h < HPT; ++h) {
#pragma unroll
        for (int t = 0; t < TPZ; ++t) {
#pragma unroll
          for (int width = BDX / 2; width > 0; width /= 2) {
            s[h][t] += __shfl_xor_sync(0xffffffffu, s[h][t], width);
          }
          s[h][t] = variant_score<VARIANT>(s[h][t], soft_cap, slope[h], first + t - query_pos);
          if (first + t >= end) s[h][t] = neg_inf();  // a zero-filled row past the item
        }
      }

      // Online softmax over this thread's TPZ tokens (step 4 of the header).
      float alpha[HPT];
#pragma unroll
      for (int h = 0; h < HPT; ++h) {
        float m_new = m[h];
#pragma unroll
        for (int t = 0; t < TPZ; ++t) m_new = fmaxf(m_new, s[h][t]);
        const float base = m_new == neg_inf() ? 0.0f : m_new;
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < TPZ; ++t) {
          s[h][t] = expf(s[h][t] - base);
          sum += s[h][t];
        }
        alpha[h] = expf(m[h] - base);  // 0 while m = -inf
        l[h] = l[h] * alpha[h] + sum;
        m[h] = m_new;
      }

      Ring::wait_v();
      __syncthreads();  // all of V of `stage` is in
      const KV* v_rows = ring.v_row(stage, tz * TPZ) + tx * VEC;
#pragma unroll
      for (int h = 0; h < HPT; ++h) {
#pragma unroll
        for (int e = 0; e < NE; ++e) acc[h][e] *= alpha[h];
      }
#pragma unroll
      for (int t = 0; t < TPZ; ++t) {
        float vf[NE];
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          if (lane_ok[v]) {
            load_unit_as_float(v_rows + t * HEAD_DIM + v * BDX * VEC, vf + v * VEC);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) vf[v * VEC + e] = 0.0f;
          }
        }
#pragma unroll
        for (int h = 0; h < HPT; ++h) {
#pragma unroll
          for (int e = 0; e < NE; ++e) acc[h][e] += s[h][t] * vf[e];
        }
      }
    }
    __pipeline_wait_prior(0);  // only empty batches are left; nothing lands after the loop
  }

  // Merge the BDZ partial softmaxes of each head (exact: weights exp(m_z - M)).
  if constexpr (BDZ > 1) {
    constexpr int HEADS = BDY * HPT;
    float* ml_s = reinterpret_cast<float*>(smem);  // [BDZ, HEADS, 2]
    float* acc_s = ml_s + BDZ * HEADS * 2;         // [BDZ, HEADS, HEAD_DIM]
    __syncthreads();  // every thread is done with the stages that these bytes overlay
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
      const int row = tz * HEADS + ty * HPT + h;
      if (tx == 0) {
        ml_s[2 * row] = m[h];
        ml_s[2 * row + 1] = l[h];
      }
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        if (lane_ok[v]) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            acc_s[row * HEAD_DIM + (tx + v * BDX) * VEC + e] = acc[h][v * VEC + e];
          }
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < HPT; ++h) {
      const int head = ty * HPT + h;
      float m_all = neg_inf();
#pragma unroll
      for (int z = 0; z < BDZ; ++z) m_all = fmaxf(m_all, ml_s[2 * (z * HEADS + head)]);
      float l_all = 0.0f;
      float w[BDZ];
#pragma unroll
      for (int z = 0; z < BDZ; ++z) {
        const float m_z = ml_s[2 * (z * HEADS + head)];
        // A part that saw only -inf scores (or no token) weighs 0; -inf - -inf would be NaN.
        w[z] = m_z == neg_inf() ? 0.0f : expf(m_z - m_all);
        l_all += w[z] * ml_s[2 * (z * HEADS + head) + 1];
      }
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        if (lane_ok[v]) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            float sum = 0.0f;
#pragma unroll
            for (int z = 0; z < BDZ; ++z) {
              sum += w[z] * acc_s[(z * HEADS + head) * HEAD_DIM + (tx + v * BDX) * VEC + e];
            }
            acc[h][v * VEC + e] = sum;
          }
        }
      }
      m[h] = m_all;
      l[h] = l_all;
    }
  }

  // An empty item (a context of length 0) gives 0; otherwise acc / l (over fp8 times V's scale),
  // NaN when a NaN reached l (or l = 0: every score -inf).
  const bool empty = end <= begin;
  const float out_scale = kFp8 ? head_scale(v_scale, v_scales, v_scale_stride, kv_head) : 1.0f;
#pragma unroll
  for (int h = 0; h < HPT; ++h) {
    const int g = ty * HPT + h;
    // Past the chunk, or tz > 0: every tz merged the lanes above, tz = 0 writes (the threads
    // stay for merge_split's barriers).
    if (g >= chunk.heads || tz != 0) continue;
    if constexpr ((VARIANT & kSinks) != 0) {
      if (direct) {
        const float f = fold_sink(m[h], l[h], sinks[chunk.first_head + g]);
#pragma unroll
        for (int e = 0; e < NE; ++e) acc[h][e] *= f;
      }
    }
    const long long out_row = direct ? head_row + g
                                     : static_cast<long long>(blockIdx.y) * num_q_heads +
                                           chunk.first_head + g;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      if (!lane_ok[v]) continue;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const long long index = out_row * HEAD_DIM + (tx + v * BDX) * VEC + e;
        const float row = kFp8 ? acc[h][v * VEC + e] * out_scale : acc[h][v * VEC + e];
        const float value = empty ? 0.0f : row / l[h];
        if (direct) {
          out[index] = from_float<T>(value);
        } else {
          // All scores -inf: log-sum-exp -inf, weight 0 in the merge; the row is 0, not 0 / 0.
          partial_out[index] = l[h] == 0.0f ? 0.0f : value;
        }
      }
    }
    if (!direct && tx == 0) {
      const float base = m[h] == neg_inf() ? 0.0f : m[h];  // the exponents' reference, step 4
      partial_lse[out_row] = empty ? neg_inf() : base + logf(l[h]);
    }
  }
  if (!direct && merge_counters != nullptr) {
    merge_split<T, HEAD_DIM, VARIANT, THREADS, CHUNK>(
        out, partial_out, partial_lse, work, seq_items, merge_counters, num_kv_heads,
        group_size, sinks, reinterpret_cast<float*>(smem));
  }
}

// ---- The tensor-core path: paged_decode_mma ------------------------------------------------
// For 16-bit queries (over a cache of their type or an fp8 one) and groups from 2 query heads on
// sm_80/sm_90, from 8 elsewhere (the launch table's choice, where the CUDA-core loop above is
// bound by instruction issue): a chunk's query heads (the group up to 16,
// chunks of 16 or fewer above) are the 16 rows of WMMA m16n16k16 products with float32
// accumulators (rows past the chunk are zero queries whose results are never written), so that
// the dot products and P V run on tensor cores, with no conversions and no reduction shuffles.
// The same work items, K/V ring, partial rows and merge as paged_decode; one thread block per
// (KV head, head chunk, item) of WARPS warps, TILE = 16 * WARPS tokens per stage. Per stage:
//   1. wait for K of stage i, __syncthreads; refill the slot of stage i - 1, prefetch block ids;
//   2. scores: warp w computes S[:, 16w .. 16w + 15] = Q K^T over head_dim in steps of 16 (Q as
//      row-major A fragments kept in registers; K as column-major B, straight from the stage) and
//      stores its 16 x 16 float tile to s_s; __syncthreads;
//   3. online softmax in float32: 16 / THREADS of the block per row (THREADS / 16 threads, 8
//      consecutive tokens each, max and sum by shuffles over those lanes): the scores are scaled
//      in float32 (scale * (q . k), not a rounded scale * q), tokens past the item's end are -inf,
//      p = exp(s - m_new) is rounded to T for the second product, and l sums the rounded values
//      (so the weights that multiply V are normalised exactly); alpha per row goes to alpha_s;
//   4. wait for V of stage i, __syncthreads; P V: warp w owns the 16-column slices w, w + WARPS,
//      ... of the output; per slice, O_i = P V (row-major A from p_s, row-major B from the stage)
//      into a fresh accumulator, stored to the warp's o_s tile; __syncwarp; each lane reads the
//      8 elements it owns (row lane / 2, columns 8 * (lane % 2) ..) and updates its registers,
//      acc = alpha[row] * acc + O_i; __syncwarp (the tile is stored again for the next slice).
//   The accumulators' element layout is opaque (WMMA does not specify it), so the per-row
//   rescale by alpha runs on a layout the kernel chose: the round trip through o_s.
// NaN and Inf as in paged_decode: the rows of the products are independent, so a NaN in q reaches
// only its head, a NaN or Inf in K or V the heads that use that token, as in the reference.
// Precision: S and O accumulate in float32 with exact products of T values, as on the CUDA
// cores; P is rounded to T (relative 2^-11 for fp16, 2^-8 for bf16) before P V, which the float32
// path does not do: docs/kernels.md, "Tensor cores".
//
// Over fp8 no conversion pass: a WMMA load of T from the staged fp8 rows gives a fragment whose
// every 16-bit element holds two fp8 values of consecutive head dims 2c, 2c + 1 (the lower
// address first) of the 32 dims of a "pair" (a 16 x 16 tile of T is 16 x 32 of fp8). Converting
// each element to two T values (split_fp8_pairs) gives two fragments of the same layout, of the
// even and of the odd dims: elementwise code, the same for every element, so the layout stays
// opaque (WMMA loads no fp8, and reading which element is where would not be portable).
//   Q K^T = sum over pairs of Q_even K_even^T + Q_odd K_odd^T: q_s holds each pair's 32 dims
//     de-interleaved (its even dims, then its odd ones), so q's fragments 2p and 2p + 1 match;
//   P V: a warp's output slice pair p, half h (h = 0 even, 1 odd dims) is P V_h: both halves from
//     one load of V, the accumulator's column c is dim 32 p + 2 c + h (the output loop's).
// head_dim 80 and 112 end in half a pair: the ring rows' padding past head_dim and q_s's columns
// past it are zeros (written once), so the products there add 0 and those columns are not written.
// The ring rows are padded to an odd number of 16-byte units (no bank conflicts in the loads).
template <typename T, int HEAD_DIM, int CHUNK, int WARPS, int STAGES, typename KV = T>
struct DecodeMmaLayout {
  static constexpr bool kFp8 = IsFp8<KV>::value;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kTile = 16 * WARPS;                   // tokens per stage
  static constexpr int kSteps = HEAD_DIM / 16;               // k-steps of Q K^T, slices of O
  static constexpr int kPairs = (HEAD_DIM + 31) / 32;        // over fp8: 32-dim pairs of a row
  static constexpr int kPairSlots = (kPairs + WARPS - 1) / WARPS;  // over fp8: pairs per warp
  static constexpr int kQSteps = kFp8 ? 2 * kPairs : kSteps;  // q's fragments
  // Output slices (16 accumulator columns) per warp: over fp8 both halves of each pair.
  static constexpr int kSlices = kFp8 ? 2 * kPairSlots : (kSteps + WARPS - 1) / WARPS;
  static constexpr int kRowThreads = kThreads / 16;          // softmax threads per row
  static constexpr int kRowTokens = kTile / kRowThreads;     // tokens per softmax thread: 8
  static constexpr int kLdk = HEAD_DIM + 8;    // K/V/Q row, elements: +16 bytes, no conflicts
  static constexpr int kLdq = kQSteps * 16 + 8;  // q_s row, elements (kLdk but over fp8)
  static constexpr int kLds = kTile + 4;       // scores row, floats
  static constexpr int kLdp = kTile + 8;       // P row, elements
  static constexpr int kLdo = 16 + 4;          // a warp's O tile row, floats
  static constexpr int kRowVectors = HEAD_DIM * 2 / 16;      // 16-byte vectors per T row (q)
  static constexpr int kStageVectors =  // 16-byte copies per K stage
      kTile * HEAD_DIM * static_cast<int>(sizeof(KV)) / 16;
  // The ring's rows, elements of KV: padded T rows that the WMMA loads read; over fp8 fp8 rows
  // padded to an odd number of 16-byte units, at least past the last pair (the loads read them
  // as T rows of kLdr elements).
  static constexpr int kFp8Pad = HEAD_DIM / 16 % 2 == 1 ? 32 : 16;
  static constexpr int kRingLd = kFp8 ? HEAD_DIM + kFp8Pad : kLdk;
  static constexpr int kLdr = kRingLd * static_cast<int>(sizeof(KV)) / 2;  // as T elements
  // Byte offsets of the dynamic shared memory (each a multiple of 32: WMMA tiles are 256-bit
  // aligned): k_s, v_s [STAGES, TILE, kRingLd] KV; q_s [16, kLdq] T; s_s [16, kLds] float, whose
  // bytes o_s [WARPS, 16, kLdo] float shares (the scores are read before the barrier that
  // precedes P V, the O tiles before the next stage's first barrier); p_s [16, kLdp] T;
  // alpha_s, l_s [16] float.
  static constexpr int kStageBytes = STAGES * kTile * kRingLd * static_cast<int>(sizeof(KV));
  static constexpr int kQ = 2 * kStageBytes;
  static constexpr int kS = kQ + 16 * kLdq * 2;
  static constexpr int kO = kS;
  static constexpr int kScoresBytes = 16 * kLds * 4 > WARPS * 16 * kLdo * 4 ? 16 * kLds * 4
                                                                            : WARPS * 16 * kLdo * 4;
  static constexpr int kP = kS + kScoresBytes;
  static constexpr int kAlpha = kP + 16 * kLdp * 2;
  static constexpr int kL = kAlpha + 16 * 4;
  static constexpr int kBytes = kL + 16 * 4;  // the launch table's shared_mem
  static_assert(sizeof(T) == 2, "tensor cores take the 16-bit types (fp32 keeps paged_decode)");
  static_assert(CHUNK >= 1 && CHUNK <= 16, "the chunk's heads are the 16 rows of the MMA");
  static_assert(HEAD_DIM % 16 == 0, "head_dim in k-steps and output slices of 16");
  static_assert(HEAD_DIM <= 128, "above 128, q's fragments and the accumulators outgrow the "
                                 "registers: the launch table keeps paged_decode there");
  static_assert((kFp8 || kStageVectors % kThreads == 0) && kRowTokens == 8,
                "the stage splits evenly (the ring's copies, the softmax threads)");
  static_assert(kStageBytes % 32 == 0 && kS % 32 == 0 && kP % 32 == 0 && kO % 32 == 0 &&
                    kQ % 32 == 0 && kRingLd * sizeof(KV) % 16 == 0,
                "WMMA tiles are 32-byte aligned, their rows whole 16-byte units");
  static_assert(!kFp8 || 32 * kPairs <= kRingLd, "the last pair's loads stay in the row");
  static_assert(STAGES >= 2 && 2 * STAGES - 2 <= 8, "the waits below count at most 8 batches");
};

// Over fp8 (the layout's comment): the two fragments of T that a fragment `raw`, loaded as T from
// fp8 rows, holds: each element's two fp8 values (the lower address first) converted, the first
// to `lo`, the second to `hi`. The same for every element, whatever lane holds which.
// From sm_89 (one cvt per element) element by element. Where the conversion is bit operations
// (sm_80, the CPU backend: common.cuh's fp8x2_to_half2), two elements at a time, bytes b0 b1 and
// b2 b3, as the pairs {b0, b2} (to lo) and {b1, b3} (to hi): under float16 queries at head_dim
// 128 the stage loop is 965 instructions, not 1,098 (e4m3), and 571, not 709 (e5m2); element by
// element (or assembled from 16-bit halves) ptxas (NVRTC 12.9) spills 16 bytes in the e5m2
// kernel of float16 queries with sinks at head_dim 80 and 96.
template <typename KV, typename T, typename Frag>
__device__ __forceinline__ void split_fp8_pairs(const Frag& raw, Frag& lo, Frag& hi) {
  const T* tag = nullptr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
  for (int e = 0; e < Frag::num_elements; ++e) {
    const unsigned short bits = *reinterpret_cast<const unsigned short*>(&raw.x[e]);
    const unsigned pair = fp8x2_as_pair<KV>(bits, tag);
    const unsigned short lo_bits = static_cast<unsigned short>(pair & 0xffffu);
    const unsigned short hi_bits = static_cast<unsigned short>(pair >> 16);
    lo.x[e] = *reinterpret_cast<const T*>(&lo_bits);
    hi.x[e] = *reinterpret_cast<const T*>(&hi_bits);
  }
#else
  static_assert(Frag::num_elements % 2 == 0, "elements two at a time");
#pragma unroll
  for (int e = 0; e < Frag::num_elements; e += 2) {
    unsigned word;  // (a fragment's elements 2i, 2i + 1 share a register)
    memcpy(&word, &raw.x[e], 4);
    const unsigned even = fp8x2_as_pair<KV>(__byte_perm(word, 0u, 0x0020u), tag);
    const unsigned odd = fp8x2_as_pair<KV>(__byte_perm(word, 0u, 0x0031u), tag);
    memcpy(&lo.x[e], &even, 4);
    memcpy(&hi.x[e], &odd, 4);
  }
#endif
}

// Over fp8, the head dim of column `col` of q_s (pair col / 32: its even dims, then its odd).
__device__ __forceinline__ int fp8_q_dim(int col) {
  return col / 32 * 32 + col % 16 * 2 + col % 32 / 16;
}

// Grid: as paged_decode's, chunks of CHUNK <= 16 heads. Block: (32, WARPS, 1).
// Dynamic shared memory: DecodeMmaLayout::kBytes (the layout above), 32-byte aligned.
// Parameters as paged_decode's (one launch interface for both paths).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int CHUNK, int WARPS, int STAGES,
          int VARIANT = 0, typename KV = T>
__global__ void __launch_bounds__(32 * WARPS)
    paged_decode_mma(T* __restrict__ out,                  // [num_seqs, num_q_heads, HEAD_DIM]
                     float* __restrict__ partial_out,      // [capacity, num_q_heads, HEAD_DIM]
                     float* __restrict__ partial_lse,      // [capacity, num_q_heads]
                     const T* __restrict__ q,              // [num_seqs, num_q_heads, HEAD_DIM]
                     const KV* __restrict__ k_cache,       // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                     const KV* __restrict__ v_cache,       // [num_blocks, num_kv_heads, BLOCK_SIZE, HEAD_DIM]
                     const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                     const int4* __restrict__ work,         // [capacity] {seq, begin, end, count}
                     const int2* __restrict__ seq_items,    // [num_seqs] {first, count}
                     int* __restrict__ merge_counters,      // [num_seqs, gridDim.x] or nullptr
                     const int* __restrict__ context_lens,  // [num_seqs], read under kAlibi only
                     int num_kv_heads, int group_size, int max_blocks, float scale,
                     float k_scale, float v_scale,
                     const float* __restrict__ k_scales,    // [1] or [num_kv_heads], read over fp8
                     const float* __restrict__ v_scales,    // [1] or [num_kv_heads], read over fp8
                     int k_scale_stride, int v_scale_stride,
                     int window_left,                       // the work list's (the header)
                     float soft_cap,
                     const float* __restrict__ alibi_slopes,  // [num_q_heads], read under kAlibi
                     const float* __restrict__ sinks) {       // [num_q_heads], read under kSinks
  using namespace nvcuda;
  using L = DecodeMmaLayout<T, HEAD_DIM, CHUNK, WARPS, STAGES, KV>;
  constexpr bool kFp8 = L::kFp8;
  constexpr int TILE = L::kTile;
  constexpr int THREADS = L::kThreads;
  constexpr int LDK = L::kLdk;
  constexpr int RT = L::kRowThreads;
  using Ring = KvRing<KV, HEAD_DIM, BLOCK_SIZE, TILE, STAGES, THREADS, true, true, L::kRingLd>;

  const int4 item = work[blockIdx.y];
  if (item.x < 0) return;  // an unused entry of the work list (uniform over the block)
  const int seq = item.x;
  const int begin = item.y;
  const int end = item.z;
  const bool direct = item.w == 1;
  const DecodeChunk chunk(blockIdx.x, group_size, CHUNK);
  const int kv_head = chunk.kv_head;
  const int lane = threadIdx.x;
  const int warp = threadIdx.y;
  const int tid = warp * 32 + lane;
  const int num_q_heads = num_kv_heads * group_size;
  const long long head_row = static_cast<long long>(seq) * num_q_heads + chunk.first_head;
  constexpr int LDR = L::kLdr;  // the ring's rows as T elements (LDK but over fp8)
  constexpr int LDQ = L::kLdq;

  CUPAGED_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 32);  // WMMA tiles: 256-bit aligned
  KV* k_s = reinterpret_cast<KV*>(smem);                     // [STAGES, TILE, kRingLd]
  KV* v_s = reinterpret_cast<KV*>(smem + L::kStageBytes);    // [STAGES, TILE, kRingLd]
  T* q_s = reinterpret_cast<T*>(smem + L::kQ);               // [16, kLdq]
  float* s_s = reinterpret_cast<float*>(smem + L::kS);       // [16, kLds]
  T* p_s = reinterpret_cast<T*>(smem + L::kP);               // [16, kLdp]
  float* o_s = reinterpret_cast<float*>(smem + L::kO) + warp * 16 * L::kLdo;  // [16, kLdo]
  float* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha);  // [16]
  float* l_s = reinterpret_cast<float*>(smem + L::kL);          // [16]

  // Softmax role: row `row` of the tile, tokens 8 * sub .. 8 * sub + 7. P V role: output row
  // lane / 2, columns 8 * (lane % 2) .. + 7 of each of the warp's slices.
  const int row = tid / RT;
  const int sub = tid % RT;
  const int out_row = lane / 2;
  const int out_col = lane % 2 * 8;
  // ALiBi: the query's position and the slope of the softmax row's head (0 past the chunk).
  constexpr bool kHasAlibi = (VARIANT & kAlibi) != 0;
  const int query_pos = kHasAlibi ? context_lens[seq] - 1 : 0;
  const float slope =
      kHasAlibi && row < chunk.heads ? alibi_slopes[chunk.first_head + row] : 0.0f;
  // Over fp8, K's scale of the KV head joins the score's scale, V's the output rows' (once).
  const float score_scale =
      kFp8 ? scale * head_scale(k_scale, k_scales, k_scale_stride, kv_head) : scale;
  const float out_scale = kFp8 ? head_scale(v_scale, v_scales, v_scale_stride, kv_head) : 1.0f;
  float m = neg_inf(), l = 0.0f;
  float acc[L::kSlices][8];
#pragma unroll
  for (int j = 0; j < L::kSlices; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;
  }

  if (begin < end) {
    if constexpr (kFp8 && HEAD_DIM % 32 != 0) {
      // The ring rows' bytes from head_dim to the last pair's end: zeros, never copied over.
      constexpr int kPadUnits = (32 * L::kPairs - HEAD_DIM) / 16;
#pragma unroll
      for (int k = 0; k < (2 * STAGES * TILE * kPadUnits + THREADS - 1) / THREADS; ++k) {
        const int j = tid + k * THREADS;
        if (j >= 2 * STAGES * TILE * kPadUnits) break;
        *reinterpret_cast<uint4*>(k_s + (j / kPadUnits) * L::kRingLd + HEAD_DIM +
                                  j % kPadUnits * 16) = make_uint4(0u, 0u, 0u, 0u);
      }  // k_s and v_s are adjacent: rows 2 * STAGES * TILE in all
    }
  }
  if (begin < end && kFp8) {
    // q rows of the chunk into q_s, each pair's dims de-interleaved (fp8_q_dim); zeros past
    // head_dim and the chunk. Unrolled: the stage loop stays the only loop that loads from
    // global memory.
#pragma unroll
    for (int k = 0; k < (16 * L::kQSteps * 16 + THREADS - 1) / THREADS; ++k) {
      const int j = tid + k * THREADS;
      if (j >= 16 * L::kQSteps * 16) break;
      const int g = j / (L::kQSteps * 16);
      const int col = j % (L::kQSteps * 16);
      const int dim = fp8_q_dim(col);
      const bool real = g < chunk.heads && dim < HEAD_DIM;
      q_s[g * LDQ + col] = real ? q[(head_row + g) * HEAD_DIM + dim] : from_float<T>(0.0f);
    }
  } else if (begin < end) {
    // q rows of the chunk into q_s as they are (16-bit); rows past the chunk are zeros.
    const bool q_aligned = (reinterpret_cast<unsigned long long>(q) & 15u) == 0;
    // Unrolled: the stage loop stays the only loop that loads from global memory.
#pragma unroll
    for (int k = 0; k < (16 * L::kRowVectors + THREADS - 1) / THREADS; ++k) {
      const int j = tid + k * THREADS;
      if (j >= 16 * L::kRowVectors) break;
      const int g = j / L::kRowVectors;
      const int col = j % L::kRowVectors * 8;
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (g < chunk.heads) {
        const T* src = q + (head_row + g) * HEAD_DIM + col;
        if (q_aligned) {
          value = *reinterpret_cast<const uint4*>(src);
        } else {
          alignas(16) T parts[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) parts[e] = src[e];
          value = *reinterpret_cast<const uint4*>(parts);
        }
      }
      *reinterpret_cast<uint4*>(q_s + g * LDQ + col) = value;
    }
  }
  if (begin < end) {

    // K stages [STAGES, TILE, LDK], then V stages the same (common.cuh, KvRing).
    Ring ring(k_s, v_s, k_cache, v_cache, block_tables + static_cast<long long>(seq) * max_blocks,
              num_kv_heads, kv_head, begin, end, tid);
    ring.start();

    __syncthreads();  // q_s is complete
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa[L::kQSteps];
#pragma unroll
    for (int kk = 0; kk < L::kQSteps; ++kk) mma::wmma_load(qa[kk], q_s + kk * 16, LDQ);

    for (int stage = 0; stage < ring.num_stages; ++stage) {
      Ring::wait_k();
      __syncthreads();  // all of K of `stage` is in; every thread is done with stage - 1
      ring.refill(stage);
      // The warp's 16 K rows and the stage's V rows, read as T rows of LDR elements (over fp8
      // two fp8 values per element: the layout's comment).
      const T* k_tile = reinterpret_cast<const T*>(ring.k_row(stage, warp * 16));
      const T* v_tile = reinterpret_cast<const T*>(ring.v_row(stage, 0));

      {  // 2. scores of the warp's 16 tokens
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
        wmma::fill_fragment(s, 0.0f);
        if constexpr (kFp8) {
#pragma unroll
          for (int pair = 0; pair < L::kPairs; ++pair) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> raw, even, odd;
            mma::wmma_load(raw, k_tile + pair * 16, LDR);
            split_fp8_pairs<KV, T>(raw, even, odd);
            wmma::mma_sync(s, qa[2 * pair], even, s);
            wmma::mma_sync(s, qa[2 * pair + 1], odd, s);
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < L::kSteps; ++kk) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kb;
            mma::wmma_load(kb, k_tile + kk * 16, LDK);
            wmma::mma_sync(s, qa[kk], kb, s);
          }
        }
        wmma::store_matrix_sync(s_s + warp * 16, s, L::kLds, wmma::mem_row_major);
      }
      __syncthreads();  // every warp's scores are in s_s

      {  // 3. online softmax of row `row`, tokens 8 * sub .. 8 * sub + 7
        const int first = begin + stage * TILE + sub * 8;
        float sc[8];
        load16_as_float(s_s + row * L::kLds + sub * 8, sc);
        load16_as_float(s_s + row * L::kLds + sub * 8 + 4, sc + 4);
        float m_new = m;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int distance = first + e - query_pos;  // ALiBi's j - i
          sc[e] = first + e < end
                      ? variant_score<VARIANT>(sc[e] * score_scale, soft_cap, slope, distance)
                      : neg_inf();
          m_new = fmaxf(m_new, sc[e]);
        }
#pragma unroll
        for (int width = RT / 2; width > 0; width /= 2) {
          m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, width));
        }
        const float base = m_new == neg_inf() ? 0.0f : m_new;
        alignas(16) T p[8];
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          p[e] = from_float<T>(expf(sc[e] - base));
          sum += to_float(p[e]);  // the rounded weight, as P V sees it
        }
#pragma unroll
        for (int width = RT / 2; width > 0; width /= 2) {
          sum += __shfl_xor_sync(0xffffffffu, sum, width);
        }
        const float alpha = expf(m - base);  // 0 while m = -inf
        l = l * alpha + sum;
        m = m_new;
        *reinterpret_cast<uint4*>(p_s + row * L::kLdp + sub * 8) =
            *reinterpret_cast<const uint4*>(p);
        if (sub == 0) alpha_s[row] = alpha;
      }

      Ring::wait_v();
      __syncthreads();  // all of V of `stage`, P and alpha are in

      {  // 4. O = alpha O + P V over the warp's output slices
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa[TILE / 16];
#pragma unroll
        for (int kt = 0; kt < TILE / 16; ++kt) {
          mma::wmma_load(pa[kt], p_s + kt * 16, L::kLdp);
        }
        const float alpha = alpha_s[out_row];
        if constexpr (kFp8) {
          // Pairs warp, warp + WARPS, ...: P V_even and P V_odd from one load of V per k-tile,
          // into the warp's slices 2 jp (even dims) and 2 jp + 1 (odd).
#pragma unroll
          for (int jp = 0; jp < L::kPairSlots; ++jp) {
            const int pair = warp + jp * WARPS;
            if (L::kPairs % WARPS != 0 && pair >= L::kPairs) break;  // uniform over the warp
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[2];
            wmma::fill_fragment(o[0], 0.0f);
            wmma::fill_fragment(o[1], 0.0f);
#pragma unroll
            for (int kt = 0; kt < TILE / 16; ++kt) {
              wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> raw, even, odd;
              mma::wmma_load(raw, v_tile + kt * 16 * LDR + pair * 16, LDR);
              split_fp8_pairs<KV, T>(raw, even, odd);
              wmma::mma_sync(o[0], pa[kt], even, o[0]);
              wmma::mma_sync(o[1], pa[kt], odd, o[1]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              wmma::store_matrix_sync(o_s, o[h], L::kLdo, wmma::mem_row_major);
              __syncwarp();  // every lane's part of the tile is in
              float part[8];
              load16_as_float(o_s + out_row * L::kLdo + out_col, part);
              load16_as_float(o_s + out_row * L::kLdo + out_col + 4, part + 4);
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[2 * jp + h][e] = acc[2 * jp + h][e] * alpha + part[e];
              __syncwarp();  // every lane has read the tile before the next store
            }
          }
        }
#pragma unroll
        for (int j = 0; j < (kFp8 ? 0 : L::kSlices); ++j) {
          const int slice = warp + j * WARPS;
          if (L::kSteps % WARPS != 0 && slice >= L::kSteps) break;  // uniform over the warp
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
          wmma::fill_fragment(o, 0.0f);
#pragma unroll
          for (int kt = 0; kt < TILE / 16; ++kt) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
            mma::wmma_load(vb, v_tile + kt * 16 * LDK + slice * 16, LDK);
            wmma::mma_sync(o, pa[kt], vb, o);
          }
          wmma::store_matrix_sync(o_s, o, L::kLdo, wmma::mem_row_major);
          __syncwarp();  // every lane's part of the tile is in
          float part[8];
          load16_as_float(o_s + out_row * L::kLdo + out_col, part);
          load16_as_float(o_s + out_row * L::kLdo + out_col + 4, part + 4);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] = acc[j][e] * alpha + part[e];
          __syncwarp();  // every lane has read the tile before the next slice's store
        }
      }
    }
    __pipeline_wait_prior(0);  // only empty batches are left
  }

  if (sub == 0) l_s[row] = l;
  if constexpr ((VARIANT & kSinks) != 0) {
    __syncthreads();  // every warp is past its last P V: alpha_s is free for the rows' maxima
    if (sub == 0) alpha_s[row] = m;
  }
  __syncthreads();  // l of every row is in

  const bool empty = end <= begin;
  if (out_row < chunk.heads) {
    float l_row = l_s[out_row];
    if constexpr ((VARIANT & kSinks) != 0) {
      if (direct) {
        const float f = fold_sink(alpha_s[out_row], l_row, sinks[chunk.first_head + out_row]);
#pragma unroll
        for (int j = 0; j < L::kSlices; ++j) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] *= f;
        }
      }
    }
    const long long row_index = direct ? head_row + out_row
                                       : static_cast<long long>(blockIdx.y) * num_q_heads +
                                             chunk.first_head + out_row;
#pragma unroll
    for (int j = 0; j < L::kSlices; ++j) {
      // Slice j's first column's dim and the dims between its columns (over fp8 the warp's pair
      // j / 2, its even or odd dims: the layout's comment).
      const int slice = kFp8 ? warp + j / 2 * WARPS : warp + j * WARPS;
      if (slice >= (kFp8 ? L::kPairs : L::kSteps)) break;
      const int first_dim = kFp8 ? 32 * slice + j % 2 : 16 * slice;
      constexpr int kStride = kFp8 ? 2 : 1;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int dim = first_dim + (out_col + e) * kStride;
        if (kFp8 && HEAD_DIM % 32 != 0 && dim >= HEAD_DIM) break;  // half a pair past the row
        const long long index = row_index * HEAD_DIM + dim;
        const float row_value = kFp8 ? acc[j][e] * out_scale : acc[j][e];
        const float value = empty ? 0.0f : row_value / l_row;
        if (direct) {
          out[index] = from_float<T>(value);
        } else {
          partial_out[index] = l_row == 0.0f ? 0.0f : value;  // all -inf: weight 0, not 0 / 0
        }
      }
    }
  }
  if (!direct && sub == 0 && row < chunk.heads) {
    const float base = m == neg_inf() ? 0.0f : m;
    partial_lse[static_cast<long long>(blockIdx.y) * num_q_heads + chunk.first_head + row] =
        empty ? neg_inf() : base + logf(l);
  }
  if (!direct && merge_counters != nullptr) {
    merge_split<T, HEAD_DIM, VARIANT, THREADS, CHUNK>(
        out, partial_out, partial_lse, work, seq_items, merge_counters, num_kv_heads,
        group_size, sinks, reinterpret_cast<float*>(smem));
  }
}

// Grid: (num_q_heads * slices, num_seqs), x = slice * num_q_heads + head. Block: (lanes, rows),
// at most kMergeMaxThreads threads (the launch table's decode_merge_launch picks them from the
// work list's pieces per sequence). Thread (lane, row) of slice c owns the 4-float vectors
// c * lanes + lane, + slices * lanes, ... of the head's row (those past HEAD_DIM idle) and the
// items first + row, + rows, ... of the sequence; any grid and block of this form covers every
// element once ((num_q_heads, num_seqs) and (128,) included):
//
//   head_dim 128, 64 pieces, block (4, 32), 8 slices:   slice c = dims 16c .. 16c + 15
//     row 0:  items 0, 32    lane 0: dims 16c .. 16c + 3, lane 1: + 4 .. + 7, ...
//     row 1:  items 1, 33
//     ...     each row's partial sums; a tree over the rows in shared memory adds them
//
// seq_items[s] = {first, count}: sequence s's items. count <= 1: paged_decode wrote the row.
// 1. M = max(max_i lse_i [, sink]): each row's fmaxf over its items, then over the rows
//    (fmaxf is order-free: NaN skipped, -inf where every item is -inf or NaN);
// 2. each thread sums w_i = exp(lse_i - M) and w_i * partial_i over its items, its 4 elements;
// 3. the rows' sums added by a tree in shared memory; row 0 writes num / (den [+ exp(sink - M)]).
// An item's log-sum-exp is -inf when all its scores are -inf (weight 0); NaN when a NaN reached
// it (fmaxf skips it, its weight exp(NaN) makes the row NaN). Every item -inf is 0 / 0: NaN, as in
// the reference (an empty context has one item and never comes here); with a finite sink, 0.
// The terms are added in another order than one item after the other: only the rounding differs
// (a NaN or an Inf reaches the row in any order).
// VARIANT: only kSinks matters here (the sink's one place in a split sequence's softmax); the
// trailing arguments are the decode kernel's.
constexpr int kMergeMaxThreads = 256;  // the launch table (launch_decode.py) uses at most this

template <typename T, int HEAD_DIM, int VARIANT = 0>
__global__ void __launch_bounds__(kMergeMaxThreads)
    paged_decode_merge(T* __restrict__ out,                    // [num_seqs, num_q_heads, HEAD_DIM]
                       const float* __restrict__ partial_out,  // [capacity, num_q_heads, HEAD_DIM]
                       const float* __restrict__ partial_lse,  // [capacity, num_q_heads]
                       const int2* __restrict__ seq_items,     // [num_seqs] {first, count}
                       int num_q_heads, int window_left, float soft_cap,
                       const float* __restrict__ alibi_slopes,  // unused
                       const float* __restrict__ sinks) {       // [num_q_heads], kSinks
  constexpr bool kHasSinks = (VARIANT & kSinks) != 0;
  constexpr int kVectors = HEAD_DIM / 4;  // a row's 4-float vectors (HEAD_DIM: a multiple of 16)
  __shared__ float4 num_s[kMergeMaxThreads];
  __shared__ float den_s[kMergeMaxThreads];  // per row: [rows]; rows <= threads
  const int2 items = seq_items[blockIdx.y];
  if (items.y <= 1) return;  // uniform over the block
  const int head = blockIdx.x % num_q_heads;
  const int slice = blockIdx.x / num_q_heads;
  const int slices = gridDim.x / num_q_heads;
  const int lane = threadIdx.x, lanes = blockDim.x;
  const int row = threadIdx.y, rows = blockDim.y;
  const int last = items.x + items.y;

  // 1. the largest log-sum-exp: the rows' own, then over the rows (den_s holds them a while).
  float lse_max = neg_inf();
  for (int i = items.x + row; i < last; i += rows) {
    lse_max = fmaxf(lse_max, partial_lse[static_cast<long long>(i) * num_q_heads + head]);
  }
  if (lane == 0) den_s[row] = lse_max;
  __syncthreads();
  for (int r = 0; r < rows; ++r) lse_max = fmaxf(lse_max, den_s[r]);
  const float sink = kHasSinks ? sinks[head] : 0.0f;
  if constexpr (kHasSinks) lse_max = fmaxf(lse_max, sink);  // a NaN sink: skipped here, NaN below

  const long long out_row = static_cast<long long>(blockIdx.y) * num_q_heads + head;
  const int thread = row * lanes + lane;
  // Every thread runs every pass (the barriers), its vector past HEAD_DIM idle.
  for (int base = slice * lanes; base < kVectors; base += slices * lanes) {
    const int v = base + lane;
    float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float den = 0.0f;
    for (int i = items.x + row; i < last; i += rows) {
      const long long part = static_cast<long long>(i) * num_q_heads + head;
      const float w = expf(partial_lse[part] - lse_max);
      den += w;
      if (v < kVectors) {
        const float4 p = *reinterpret_cast<const float4*>(partial_out + part * HEAD_DIM + 4 * v);
        num.x += w * p.x;
        num.y += w * p.y;
        num.z += w * p.z;
        num.w += w * p.w;
      }
    }
    __syncthreads();  // den_s: every thread has read the maxima (or the last pass's sums)
    num_s[thread] = num;
    if (lane == 0) den_s[row] = den;
    __syncthreads();
    // 3. a tree over the rows (rows need not be a power of two: the upper half folds down).
    for (int span = rows; span > 1;) {
      const int half = (span + 1) / 2;
      if (row < span - half) {
        const float4 other = num_s[thread + half * lanes];
        num_s[thread].x += other.x;
        num_s[thread].y += other.y;
        num_s[thread].z += other.z;
        num_s[thread].w += other.w;
        if (lane == 0) den_s[row] += den_s[row + half];
      }
      span = half;
      __syncthreads();
    }
    if (row == 0 && v < kVectors) {
      const float denominator = den_s[0] + (kHasSinks ? expf(sink - lse_max) : 0.0f);
      const float4 total = num_s[lane];
      T* dst = out + out_row * HEAD_DIM + 4 * v;
      dst[0] = from_float<T>(total.x / denominator);
      dst[1] = from_float<T>(total.y / denominator);
      dst[2] = from_float<T>(total.z / denominator);
      dst[3] = from_float<T>(total.w / denominator);
    }
  }
}

}  // namespace cupaged
