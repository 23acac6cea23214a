// decode_plan.cu: the work list of a decode step, planned on the device once and read by every
// layer's paged_decode (cuda/paged_attention.cu).
//
// A decode step's work is split into items, each a range of one sequence's tokens that one thread
// block per KV head attends over:
//   work[i] = {seq, begin, end, count}: tokens [begin, end) of sequence seq, which has count items
//             in all (count == 1: the item writes the output row itself; otherwise a partial row
//             and its log-sum-exp, merged by the sequence's last block or paged_decode_merge).
//             seq = -1: nothing to do.
//   seq_items[s] = {first, count}: sequence s's items are first .. first + count - 1.
// Every sequence gets at least one item (a context of length 0 gets {s, 0, 0, 1}: a zero row).
//
// The items cover the tokens a sequence's query attends, [first_s, len_s): first_s = 0, or with a
// sliding window (window_left >= 0; the query sits at len_s - 1 and sees window_left keys before
// itself) first_s = max(0, len_s - 1 - window_left). The kernels read no table entry before
// first_s (a sliding-window cache releases them: -1), and a 32k context with a 4k window costs
// 4k tokens of K/V, split as a 4k context is: every count below is of attended tokens,
// att_s = len_s - first_s.
//
//   len_s = 12, window_left = 4, chunk = 4:  first_s = 12 - 1 - 4 = 7, two items
//     position   0 1 2 3 4 5 6 | 7 8 9 10     | 11
//     item       (never read)  | {s, 7, 11, 2} | {s, 11, 12, 2}
// An item's begin is then any position, not a multiple of a stage or a block: the K/V ring
// (common.cuh) finds each row's block from its own position.
//
// Items hold `chunk` tokens, except each sequence's last:
//   chunk = round_up(max(min_chunk, ceil(total / (capacity - num_seqs))), tile),
// where total is the batch's attended token count. Then the items never outnumber the work list:
//   sum_s ceil(att_s / chunk) <= sum_s (att_s / chunk + 1) <= (capacity - num_seqs) + num_seqs.
// The caller sizes capacity = target + num_seqs, target being the items that fill the GPU (thread
// blocks per multiprocessor x multiprocessors / KV heads), so a long sequence among short ones is
// cut into as many pieces as it needs, whatever the others' lengths: the split is balanced by
// tokens, not by sequences, and capacity does not depend on the lengths' values. With
// capacity == num_seqs no sequence is split.
//
// Whole waves (wave_items > 0, the default split's; 0 for a fixed chunk: batch-invariant plans,
// num_splits): a wave is the items the GPU runs at once, wave_items = ctas x SMs / blocks per
// item (grid_x), from the occupancy CUDA reports for the loaded kernel (an H100's on the CPU
// backend). The chunk above leaves up to num_seqs items past the balance, one short last piece
// per sequence, and those can start a wave that is nearly empty: the step then costs one more
// round of chunk-long items for a few blocks. With N(c) = sum_s ceil(att_s / c) items and
// k = floor(N(chunk) / wave_items) >= 1 whole waves, c1 is the smallest multiple of the tile
// with N(c1) <= k x wave_items (a binary search, each probe one pass over the sequences); a wave
// costs its longest item, so c1 is taken when k x c1 < (k + 1) x chunk:
//   8 x 32768 tokens, wave_items 66 (H100/H200, 4 blocks per SM, 8 KV heads):
//     chunk = round_up(262144 / 66, 16) = 3984: 8 x 9 = 72 items, 2 waves, cost 2 x 3984 = 7968;
//     k = 1: c1 = 4096 (8 x 8 = 64 items), cost 4096: taken (one wave, 64 of 66 slots).
//   64 x 4096: chunk 3984 gives 128 items (3984 + 112 per sequence), 2 waves; c1 = 4096: 64
//     items, one wave, no piece to merge.
//   1 x 32768: chunk 512, 64 items <= 66: one wave already, kept.
//   5000 + 12 x 40, wave_items 20: 32 items at 256; one wave needs pieces of 640 (8 + 12 items),
//     1 x 640 > 2 x 256: kept.
// c1 >= chunk, so the items never outnumber the list. The model is a wave's longest piece: the
// short last pieces of a part wave may finish early, but where they run before long ones (the
// list's order is by sequence) a late long piece opens a round of its own.
//
// A length below 0 counts as 0 (the checked path of the Python API refuses them first). Item
// counts and bounds are computed in 64 bits: an unchecked length near 2^31 plus chunk - 1 would
// wrap in int and cut the attention short.
//
// One thread block; thread t owns the sequences [t * per, (t + 1) * per), per = ceil(num_seqs /
// blockDim.x): it sums their lengths and item counts, thread 0 adds the per-thread sums up (an
// exclusive scan in shared memory), then each thread writes its sequences' items. Any blockDim up
// to kPlanMaxThreads works.
#include "common.cuh"

namespace cupaged {

constexpr int kPlanMaxThreads = 256;  // the launch table (cupaged/kernels/launch_decode.py) uses at most this
constexpr long long kWholeSequence = 2147483647;  // a chunk no int length exceeds: 2^31 - 1

// Items of a sequence of `len` attended tokens (at least 1), at most 2^31 / chunk + 1.
__device__ __forceinline__ int item_count(int len, int chunk) {
  const long long n = ceil_div(static_cast<long long>(len), static_cast<long long>(chunk));
  return n > 1 ? static_cast<int>(n) : 1;
}

// The first position that the query of a sequence of `len` tokens (at least 0) attends: 0, or
// len - 1 - window_left with a window (window_left >= 0), and never below 0.
__device__ __forceinline__ int first_attended(int len, int window_left) {
  if (window_left < 0) return 0;
  const long long first = static_cast<long long>(len) - 1 - window_left;
  return first > 0 ? static_cast<int>(first) : 0;
}

// The items of this thread's sequences at a chunk of c tokens, summed over the block (every
// thread gets the sum; sums[] is free on entry and on return).
__device__ long long block_items(long long* sums, const int* __restrict__ context_lens,
                                 int first_seq, int last_seq, int window_left, int c) {
  long long items = 0;
  for (int s = first_seq; s < last_seq; ++s) {
    const int len = max(context_lens[s], 0);
    items += item_count(len - first_attended(len, window_left), c);
  }
  sums[threadIdx.x] = items;
  __syncthreads();
  long long total = 0;
  for (int t = 0; t < static_cast<int>(blockDim.x); ++t) total += sums[t];
  __syncthreads();  // every thread has read sums[] before the next use
  return total;
}

// Whole waves (the header): *chunk_s grows to c1 when k x c1 < (k + 1) x chunk. Every thread
// runs every probe (the barriers) and reads the same sums, so all take the same branches.
__device__ void round_to_waves(long long* sums, const int* longest_s, int* chunk_s,
                               const int* __restrict__ context_lens, int num_seqs, int first_seq,
                               int last_seq, int window_left, int tile, int wave_items) {
  const int chunk = *chunk_s;
  int longest = 0;
  for (int t = 0; t < static_cast<int>(blockDim.x); ++t) longest = max(longest, longest_s[t]);
  const long long items = block_items(sums, context_lens, first_seq, last_seq, window_left, chunk);
  const long long waves = items / wave_items;  // k: the whole waves
  const long long allowed = waves * wave_items;
  // At a chunk of the longest length every sequence is one item: N = num_seqs, the fewest.
  if (waves < 1 || items == allowed || longest <= chunk || num_seqs > allowed) return;
  long long lo = chunk / tile;  // N(lo x tile) > allowed >= N(hi x tile)
  long long hi = ceil_div(static_cast<long long>(longest), static_cast<long long>(tile));
  while (lo + 1 < hi) {
    const long long mid = (lo + hi) / 2;
    const int c = static_cast<int>(min(mid * tile, kWholeSequence));
    if (block_items(sums, context_lens, first_seq, last_seq, window_left, c) <= allowed) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  const long long c1 = min(hi * tile, kWholeSequence);
  if (threadIdx.x == 0 && waves * c1 < (waves + 1) * chunk) *chunk_s = static_cast<int>(c1);
  __syncthreads();
}

__global__ void __launch_bounds__(kPlanMaxThreads)
    plan_decode(int4* __restrict__ work,               // [capacity]
                int2* __restrict__ seq_items,          // [num_seqs]
                const int* __restrict__ context_lens,  // [num_seqs]
                int num_seqs, int capacity, int min_chunk, int tile, int window_left,
                int wave_items) {  // 0: the chunk as computed; else whole waves of these items
  __shared__ long long sums[kPlanMaxThreads];  // tokens, then items, of each thread's sequences
  __shared__ int longest_s[kPlanMaxThreads];   // each thread's longest attended length
  __shared__ int chunk_s;
  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  const int per = ceil_div(num_seqs, threads);
  const int first_seq = min(num_seqs, tid * per);
  const int last_seq = min(num_seqs, first_seq + per);

  long long tokens = 0;
  int longest = 0;
  for (int s = first_seq; s < last_seq; ++s) {
    const int len = max(context_lens[s], 0);
    const int att = len - first_attended(len, window_left);
    tokens += att;
    longest = max(longest, att);
  }
  sums[tid] = tokens;
  longest_s[tid] = longest;
  __syncthreads();
  if (tid == 0) {
    long long total = 0;
    for (int t = 0; t < threads; ++t) total += sums[t];
    const long long spare = static_cast<long long>(capacity) - num_seqs;
    // No spare items, or a chunk past any int length: one item per sequence, whatever its
    // length (kWholeSequence bounds every length; never capped lower, which would cut some
    // sequence into more items than the list holds).
    long long chunk = spare > 0 ? (total + spare - 1) / spare : kWholeSequence;
    chunk = max(chunk, static_cast<long long>(min_chunk));
    chunk = (chunk + tile - 1) / tile * tile;
    chunk_s = static_cast<int>(min(chunk, kWholeSequence));
  }
  __syncthreads();
  if (wave_items > 0) {
    round_to_waves(sums, longest_s, &chunk_s, context_lens, num_seqs, first_seq, last_seq,
                   window_left, tile, wave_items);
  }
  const int chunk = chunk_s;

  long long items = 0;
  for (int s = first_seq; s < last_seq; ++s) {
    const int len = max(context_lens[s], 0);
    items += item_count(len - first_attended(len, window_left), chunk);
  }
  __syncthreads();  // everyone has read sums[] above (thread 0's loop) before it is reused
  sums[tid] = items;
  __syncthreads();
  if (tid == 0) {
    long long running = 0;
    for (int t = 0; t < threads; ++t) {
      const long long mine = sums[t];
      sums[t] = running;  // exclusive scan
      running += mine;
    }
  }
  __syncthreads();

  int item = static_cast<int>(sums[tid]);
  for (int s = first_seq; s < last_seq; ++s) {
    const int len = max(context_lens[s], 0);
    const int first = first_attended(len, window_left);
    const int count = item_count(len - first, chunk);
    seq_items[s] = make_int2(item, count);
    for (int j = 0; j < count && item + j < capacity; ++j) {  // the bound above: never cut short
      const long long begin = first + static_cast<long long>(j) * chunk;
      const long long end = begin + chunk < len ? begin + chunk : len;
      work[item + j] = make_int4(s, static_cast<int>(begin), static_cast<int>(end), count);
    }
    item += count;
  }
  // The last thread's end is the batch's item count: the rest of the list is idle.
  __syncthreads();
  if (tid == threads - 1) sums[0] = item;
  __syncthreads();
  for (int i = static_cast<int>(sums[0]) + tid; i < capacity; i += threads) {
    work[i] = make_int4(-1, 0, 0, 0);
  }
}

}  // namespace cupaged
