// basics.cu: kernels that exercise the CPU backend's CUDA emulation (tests/cpu/test_cpu_backend.py).
//
// Element-wise work over a 3-D grid, block and warp reductions, shuffles with a width, warp votes,
// dynamic shared memory and threads that return before a barrier. Written to the source rules of
// DESIGN.md §4 (the tests also compile this file with NVRTC), except read_unwritten_shared and
// stale_static_shared, which read shared memory that nothing wrote on purpose: they check the
// NaN poison.
#include "common.cuh"

// CUPAGED_DYNAMIC_SHARED comes from cuda/common.cuh.

namespace cpu_test {

constexpr unsigned kFullMask = 0xffffffffu;

// out = a + b, computed in float.
// Grid: (ceil(nx / bx), ceil(ny / by), ceil(nz / bz)), any 3-D block.
template <typename T>
__global__ void add3d(T* __restrict__ out,      // [nz, ny, nx]
                      const T* __restrict__ a,  // [nz, ny, nx]
                      const T* __restrict__ b,  // [nz, ny, nx]
                      int nx, int ny, int nz) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x;
  const int y = blockIdx.y * blockDim.y + threadIdx.y;
  const int z = blockIdx.z * blockDim.z + threadIdx.z;
  if (x >= nx || y >= ny || z >= nz) return;
  const long long i = (static_cast<long long>(z) * ny + y) * nx + x;
  out[i] = cupaged::from_float<T>(cupaged::to_float(a[i]) + cupaged::to_float(b[i]));
}

// Sum of each row: strided partial sums, then a tree in static shared memory.
// Grid: (num_rows), block: (kBlock).
template <int kBlock>
__global__ void block_sum(float* __restrict__ out,      // [num_rows]
                          const float* __restrict__ x,  // [num_rows, n]
                          int n) {
  __shared__ float partial[kBlock];
  const float* row = x + static_cast<long long>(blockIdx.x) * n;
  float acc = 0.0f;
  for (int i = threadIdx.x; i < n; i += kBlock) acc += row[i];
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int stride = kBlock / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}

// Sum of each row: butterflies within each warp, then warp 0 combines the warps' sums; every
// thread writes the row's sum (two barriers and ten shuffles per thread: the timing test's load).
// Grid: (num_rows), block: (kBlock), kBlock a multiple of 32.
template <int kBlock>
__global__ void two_level_sum(float* __restrict__ out,        // [num_rows, kBlock]
                              const float* __restrict__ x) {  // [num_rows, kBlock]
  __shared__ float warp_sums[kBlock / 32];
  __shared__ float row_sum;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const long long i = static_cast<long long>(blockIdx.x) * kBlock + threadIdx.x;
  float v = x[i];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < kBlock / 32 ? warp_sums[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(kFullMask, s, offset);
    if (lane == 0) row_sum = s;
  }
  __syncthreads();
  out[i] = row_sum;
}

// Sum of each group of 32 consecutive values, twice: a butterfly (every lane ends with the sum)
// and a shift-down tree (lane 0 ends with it).
// Grid: (n / blockDim.x), block: a multiple of 32.
__global__ void warp_sums(float* __restrict__ xor_out,   // [n / 32, 32] every lane's butterfly sum
                          float* __restrict__ down_out,  // [n / 32]
                          const float* __restrict__ x) {  // [n]
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = x[i];
  float butterfly = v;
  for (int offset = 16; offset > 0; offset /= 2)
    butterfly += __shfl_xor_sync(kFullMask, butterfly, offset);
  float down = v;
  for (int offset = 16; offset > 0; offset /= 2) down += __shfl_down_sync(kFullMask, down, offset);
  xor_out[i] = butterfly;
  if (threadIdx.x % 32 == 0) down_out[i / 32] = down;
}

// Shuffles of int and double, with and without a segment width.
// Grid: (n / blockDim.x), block: a multiple of 32.
__global__ void shuffles(int* __restrict__ idx8,       // [n] __shfl_sync(v, lane + 3, width 8)
                         int* __restrict__ up16,       // [n] __shfl_up_sync(v, 2, width 16)
                         int* __restrict__ down32,     // [n] __shfl_down_sync(v, 5)
                         int* __restrict__ xor16,      // [n] __shfl_xor_sync(v, 20, width 16)
                         double* __restrict__ dbl,     // [n] __shfl_sync((double)v, 31 - lane)
                         long long* __restrict__ ll,   // [n] __shfl_xor_sync(v << 33, 1)
                         const int* __restrict__ x) {  // [n]
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  const int v = x[i];
  idx8[i] = __shfl_sync(kFullMask, v, lane + 3, 8);
  up16[i] = __shfl_up_sync(kFullMask, v, 2, 16);
  down32[i] = __shfl_down_sync(kFullMask, v, 5);
  xor16[i] = __shfl_xor_sync(kFullMask, v, 20, 16);
  dbl[i] = __shfl_sync(kFullMask, static_cast<double>(v) + 0.5, 31 - lane);
  ll[i] = __shfl_xor_sync(kFullMask, static_cast<long long>(v) << 33, 1);
}

// Each lane takes the value of the next lane (lane 31 takes lane 0's): shuffles of 2- and 4-byte
// types, including __half, __nv_bfloat16 and the pair types.
// Grid: (n / blockDim.x), block: a multiple of 32.
template <typename T>
__global__ void rotate_lanes(T* __restrict__ out,        // [n]
                             const T* __restrict__ x) {  // [n]
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = __shfl_sync(kFullMask, x[i], (threadIdx.x + 1) % 32);
}

// Splits pairs (__half2, __nv_bfloat162) into floats, and builds a pair back from two floats.
// Grid: (ceil(n / blockDim.x)), block: any.
template <typename T2>
__global__ void pair_round_trip(float* __restrict__ lo,     // [n]
                                float* __restrict__ hi,     // [n]
                                T2* __restrict__ swapped,   // [n] (high, low) of each pair
                                const T2* __restrict__ x,   // [n]
                                int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const T2 pair = x[i];
  lo[i] = __low2float(pair);
  hi[i] = __high2float(pair);
  swapped[i] = T2(pair.y, pair.x);
}

// Half-precision math intrinsics (device-only in the CUDA headers: the CPU shim computes them in
// float and rounds once).
// Grid: (ceil(n / blockDim.x)), block: any.
// out rows: hexp(x), __hfma(x, x, x), hsqrt(|x|), hrcp(x).
template <typename T>
__global__ void half_math(float* __restrict__ out,  // [4, n]
                          const T* __restrict__ x,  // [n]
                          int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const T v = x[i];
  out[i] = cupaged::to_float(hexp(v));
  out[n + i] = cupaged::to_float(__hfma(v, v, v));
  out[2 * n + i] = cupaged::to_float(hsqrt(__habs(v)));
  out[3 * n + i] = cupaged::to_float(hrcp(v));
}

// Warp votes over x > 0, then a vote restricted to the even lanes.
// Grid: (n / blockDim.x), block: a multiple of 32.
__global__ void votes(unsigned* __restrict__ ballot,  // [n / 32]
                      int* __restrict__ any,          // [n / 32]
                      int* __restrict__ all,          // [n / 32]
                      unsigned* __restrict__ even,    // [n / 32] ballot among even lanes only
                      const float* __restrict__ x) {  // [n]
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  const bool positive = x[i] > 0.0f;
  const unsigned b = __ballot_sync(kFullMask, positive);
  const int a = __any_sync(kFullMask, positive);
  const int l = __all_sync(kFullMask, positive);
  unsigned e = 0;
  if (lane % 2 == 0) e = __ballot_sync(0x55555555u, positive);
  __syncwarp();
  if (lane == 0) {
    ballot[i / 32] = b;
    any[i / 32] = a;
    all[i / 32] = l;
    even[i / 32] = e;
  }
}

// Histogram of x over num_bins bins with global atomics (blocks run concurrently on several OS
// threads), plus the sum of x with a float atomicAdd and the largest value with atomicMax.
// Grid: (ceil(n / blockDim.x)), block: any.
__global__ void histogram(int* __restrict__ counts,   // [num_bins]
                          float* __restrict__ total,  // [1]
                          int* __restrict__ largest,  // [1]
                          const int* __restrict__ x,  // [n], values in [0, num_bins)
                          int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  atomicAdd(&counts[x[i]], 1);
  atomicAdd(total, static_cast<float>(x[i]));
  atomicMax(largest, x[i]);
}

// Reverses each block's slice of x through dynamic shared memory (blockDim.x elements of T).
// Grid: (n / blockDim.x), block: any.
template <typename T>
__global__ void reverse_dynamic(T* __restrict__ out,        // [n]
                                const T* __restrict__ x) {  // [n]
  CUPAGED_DYNAMIC_SHARED(T, buffer);
  const long long base = static_cast<long long>(blockIdx.x) * blockDim.x;
  buffer[threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();
  out[base + threadIdx.x] = buffer[blockDim.x - 1 - threadIdx.x];
}

// Copies dynamic shared memory that nothing wrote (deliberately against the source rules).
// Grid: (num_blocks), block: any.
__global__ void read_unwritten_shared(float* __restrict__ out) {  // [num_blocks, blockDim.x]
  CUPAGED_DYNAMIC_SHARED(float, buffer);
  out[blockIdx.x * blockDim.x + threadIdx.x] = buffer[threadIdx.x];
}

// Even blocks fill static shared memory, odd blocks only read it (deliberately against the
// source rules): an odd block must see the poison, not the previous block's values.
// Grid: (num_blocks), block: (64).
__global__ void stale_static_shared(float* __restrict__ out) {  // [num_blocks, 64]
  __shared__ float buffer[64];
  if (blockIdx.x % 2 == 0) buffer[threadIdx.x] = 1.0f;
  __syncthreads();
  out[blockIdx.x * 64 + threadIdx.x] = buffer[threadIdx.x];
}

// Threads at or past n return at once; the others meet at a barrier (Volta semantics: exited
// threads do not count) and thread 0 sums what they wrote.
// Grid: (1), block: (256).
__global__ void early_exit_sum(float* __restrict__ out,      // [2]: sum, __syncthreads_count
                               const float* __restrict__ x,  // [n], n <= 256
                               int n) {
  __shared__ float values[256];
  if (static_cast<int>(threadIdx.x) >= n) return;
  values[threadIdx.x] = x[threadIdx.x];
  __syncthreads();
  const int positive = __syncthreads_count(values[threadIdx.x] > 0.0f);
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += values[i];
    out[0] = sum;
    out[1] = static_cast<float>(positive);
  }
}

}  // namespace cpu_test
