// check_tables.cu: the checked path's verdict on a batch's block tables and lengths, in one launch.
//
// Row i of a batch reads the entries of block_tables[i] that hold keys its queries see. Entry j
// holds keys [j * block_size, (j + 1) * block_size); row i reads it when
//   first_i / block_size <= j < ceil(len_i / block_size),
// where first_i, the first key the row's queries reach, is 0; or, with a window
// (window_left >= 0), len_i - 1 - window_left (the decode query sits at len_i - 1); or
// first_keys[i] when given (a prefill's window, computed on the host); a first key below 0
// counts as 0. The entries outside that range are padding or released (-1) and are not read:
//
//   len = 11, block_size = 4, window_left = 4: first = 11 - 1 - 4 = 6
//     entry   0 (keys 0..3)   1 (keys 4..7)   2 (keys 8..10)   3 (padding)
//     read    no              yes             yes              no
//
// The batch is good when every length is in [0, limit] and every entry read names a block of the
// cache, in [0, num_blocks). Values are compared on their own types widened to 64 bits (an int64
// id 2^32 + 1 is out of range, not block 1; a negative id or length is bad). A row with a bad
// length is not walked: the verdict is bad already.
//
// Each thread block writes one verdict, with no atomics in global memory (nothing to reset first):
//   verdicts[b] = limit + 1 if a row it checked is bad, else the longest length it checked (or 0),
// and the host reads the gridDim.x verdicts back (one copy, one synchronisation) and takes their
// maximum: the longest length of a good batch, limit + 1 (past every good length) of a bad one.
// On a bad verdict the host finds the offending row with array operations, to name it
// (raise_table_error, cupaged/_arrays/checks.py); the launch: cupaged/attention/table_checks.py.
// limit is at most 2^30, so a verdict is an int.
//
// Reference: tests/attention/test_table_checks.py walks every entry of every row on the host.
#include "common.cuh"

namespace cupaged {

// The launch table's CHECK_THREADS (cupaged/kernels/launch_checks.py; a test holds them equal).
constexpr int kCheckMaxThreads = 256;

// Grid: (any,); block: whole warps, at most kCheckMaxThreads, or fewer than 32 threads (the CPU
// backend's one). A team of lanes = min(blockDim.x, 32) threads takes rows t, t + T, t + 2T, ...
// (t: the team's index in the grid, T: the grid's teams), its lanes striding over a row's entries
// (adjacent lanes read adjacent entries); then the block's threads meet in one shared atomicMax.
template <typename Id, typename Len>
__global__ void __launch_bounds__(kCheckMaxThreads)
    check_tables(int* __restrict__ verdicts,                // [gridDim.x]
                 const Id* __restrict__ block_tables,       // [num_seqs, max_blocks]
                 const Len* __restrict__ context_lens,      // [num_seqs]
                 const long long* __restrict__ first_keys,  // [num_seqs], read if has_first_keys
                 int num_seqs, int max_blocks, int block_size, long long num_blocks, int limit,
                 int window_left, int has_first_keys) {
  __shared__ int block_verdict;
  if (threadIdx.x == 0) block_verdict = 0;
  const int bad = limit + 1;
  const int lanes = blockDim.x < 32 ? static_cast<int>(blockDim.x) : 32;
  const int lane = threadIdx.x % lanes;
  const int teams_per_block = static_cast<int>(blockDim.x) / lanes;
  const int teams = static_cast<int>(gridDim.x) * teams_per_block;
  int verdict = 0;
  for (int row = static_cast<int>(blockIdx.x) * teams_per_block + threadIdx.x / lanes;
       row < num_seqs; row += teams) {
    const long long len = static_cast<long long>(context_lens[row]);
    if (len < 0 || len > limit) {
      verdict = bad;
      continue;
    }
    if (len > verdict) verdict = static_cast<int>(len);
    long long first = 0;
    if (has_first_keys) {
      first = first_keys[row];
    } else if (window_left >= 0) {
      first = len - 1 - window_left;
    }
    const long long end = ceil_div(len, static_cast<long long>(block_size));  // <= max_blocks
    const long long begin = first > 0 ? first / block_size : 0;
    // 64-bit: num_seqs x max_blocks may exceed 2^31 entries.
    const Id* entries = block_tables + static_cast<long long>(row) * max_blocks;
    for (long long j = begin + lane; j < end; j += lanes) {
      const long long id = static_cast<long long>(entries[j]);
      if (id < 0 || id >= num_blocks) verdict = bad;
    }
  }
  __syncthreads();  // block_verdict is 0
  atomicMax(&block_verdict, verdict);
  __syncthreads();
  if (threadIdx.x == 0) verdicts[blockIdx.x] = block_verdict;
}

}  // namespace cupaged
