// pipeline.cu: asynchronous copies (cuda_pipeline_primitives.h) for the CPU backend's emulation
// (tests/cpu/test_cpu_pipeline.py), also compiled by NVRTC for sm_80 and sm_90.
//
// double_buffer is the staging loop a decode kernel uses: tile t + 1 is copied into one stage
// while tile t is read from the other. Its template argument plants one bug at a time (a missing
// wait, a wait off by one, a missing __syncthreads on either side of the read), each of which the
// CPU backend must turn into NaN in the output or a KernelError. The other kernels check the
// semantics of one call each: sizes and zfill, batches and __pipeline_wait_prior(N), and the
// errors (bad size, misaligned or non-shared addresses, a queue that never drains). Only
// double_buffer<kNoBug, ...> and copy_chunks with valid arguments follow DESIGN.md §4; batches
// reads copies before they land on purpose.
#include <cuda_pipeline_primitives.h>

#include "common.cuh"

namespace cpu_test {

constexpr int kStageThreads = 128;

enum PipelineBug : int {
  kNoBug = 0,
  kNoWait = 1,                  // the __pipeline_wait_prior(1) left out
  kWaitOffByOne = 2,            // __pipeline_wait_prior(2): waits for the tile before
  kNoBarrierAfterWait = 3,      // reads other threads' copies without the __syncthreads
  kNoBarrierBeforeRefill = 4,   // refills a stage that other threads still read
};

// out[b, t, i] = in[b, t, kStageThreads - 1 - i]: each tile (one float4 per thread) is staged
// through shared memory in two stages, and each thread reads the element another thread copied.
// out and in: [num_blocks, num_tiles, kStageThreads] float4, 16-byte aligned.
// Grid: (num_blocks), block: (kStageThreads).
template <int kBug, bool kDrain>
__global__ void double_buffer(float4* __restrict__ out,       // [num_blocks, num_tiles, 128]
                              const float4* __restrict__ in,  // [num_blocks, num_tiles, 128]
                              int num_tiles) {
  __shared__ float4 stage[2][kStageThreads];
  const int i = threadIdx.x;
  const long long base = static_cast<long long>(blockIdx.x) * num_tiles * kStageThreads;
  __pipeline_memcpy_async(&stage[0][i], &in[base + i], sizeof(float4));  // first copy
  __pipeline_commit();
  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) {
      const long long next = base + static_cast<long long>(t + 1) * kStageThreads + i;
      __pipeline_memcpy_async(&stage[(t + 1) % 2][i], &in[next], sizeof(float4));
    }
    __pipeline_commit();  // one batch per tile, empty after the last one
    if (kBug == kWaitOffByOne) {
      __pipeline_wait_prior(2);
    } else if (kBug != kNoWait) {
      __pipeline_wait_prior(1);  // tile t has landed; tile t + 1 may still be in flight
    }
    if (kBug != kNoBarrierAfterWait) __syncthreads();  // every thread's part of tile t
    out[base + static_cast<long long>(t) * kStageThreads + i] = stage[t % 2][kStageThreads - 1 - i];
    if (kBug != kNoBarrierBeforeRefill) __syncthreads();  // stage t % 2 is refilled next
  }
  // Nothing is pending here unless a wait is missing; kDrain = true hides that from the CPU
  // backend's check at thread exit, so that the poison alone must show the bug.
  if (kDrain) __pipeline_wait_prior(0);
}

// Each thread copies one chunk of `size` bytes, the last `zfill` of them zero-filled, into shared
// memory; after the wait and a barrier, thread i writes out the chunk of thread n - 1 - i.
// where: 0 static shared memory, 1 dynamic shared memory, 2 a global destination (an error),
// 3 a shared source (an error). dst_offset / src_offset (bytes) misalign the addresses.
// Grid: (1), block: (n <= 64); dynamic shared memory: 64 * 16 + 16 bytes for where == 1.
__global__ void copy_chunks(unsigned char* __restrict__ out,       // [n * size]
                            const unsigned char* __restrict__ in,  // [n * size + 16]
                            int size, int zfill, int where, int dst_offset, int src_offset) {
  __shared__ __align__(16) unsigned char fixed[64 * 16 + 16];
  CUPAGED_DYNAMIC_SHARED(unsigned char, dynamic);
  unsigned char* buffer = where == 1 ? dynamic : fixed;
  const int i = threadIdx.x, n = blockDim.x;
  unsigned char* dst = where == 2 ? out + i * size : buffer + i * size + dst_offset;
  const unsigned char* src = where == 3 ? fixed + i * size : in + i * size + src_offset;
  __pipeline_memcpy_async(dst, src, size, zfill);  // copy_chunks
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  for (int j = 0; j < size; ++j) out[i * size + j] = buffer[(n - 1 - i) * size + j];
}

// Thread i issues num_batches committed batches (batch b: in[b, i] -> slot b), then one copy it
// never commits (in[num_batches, i] -> slot num_batches), then waits with `prior` and writes out
// every slot as it is at that moment: out[b, i] = in[b, i] for the completed batches, poison for
// the rest. A final commit and wait(0) drain the queue before the thread returns.
// Grid: (1), block: (n <= 32), num_batches <= 15.
__global__ void batches(float* __restrict__ out,       // [num_batches + 1, n]
                        const float* __restrict__ in,  // [num_batches + 1, n]
                        int num_batches, int prior) {
  __shared__ float slots[16][32];
  const int i = threadIdx.x, n = blockDim.x;
  for (int b = 0; b < num_batches; ++b) {
    __pipeline_memcpy_async(&slots[b][i], &in[b * n + i], sizeof(float));
    __pipeline_commit();
  }
  __pipeline_memcpy_async(&slots[num_batches][i], &in[num_batches * n + i], sizeof(float));
  __pipeline_wait_prior(prior);
  for (int b = 0; b <= num_batches; ++b) out[b * n + i] = slots[b][i];
  __pipeline_commit();
  __pipeline_wait_prior(0);
}

// Thread i copies in[i] into its slot `count` times, committing each, and never waits: the queue
// overflows above its bound (a KernelError), or the thread returns with copies pending (one too).
// Grid: (1), block: (n <= 32).
__global__ void never_waits(const float* __restrict__ in,  // [n]
                            int count) {
  __shared__ float slots[32];
  for (int k = 0; k < count; ++k) {
    __pipeline_memcpy_async(&slots[threadIdx.x], &in[threadIdx.x], sizeof(float));  // never_waits
    __pipeline_commit();
  }
}

}  // namespace cpu_test
