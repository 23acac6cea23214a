// races.cu: a kernel with a missing __syncthreads, for the CPU backend's scheduling orders
// (tests/cpu/test_cpu_backend.py). Under "forward" every thread runs after the thread one warp below
// it, so the race is invisible; under "reverse" and "warp_ahead" a thread reads before the other
// warp has written, and the result is wrong. (It breaks DESIGN.md §4 on purpose.)
#include "common.cuh"

namespace cpu_test {

// Each thread writes its slot, then reads the slot of the thread one warp below.
// Grid: (num_blocks), block: (kBlock).
template <int kBlock>
__global__ void missing_barrier(int* __restrict__ out,        // [num_blocks, kBlock]
                                const int* __restrict__ x) {  // [num_blocks, kBlock]
  __shared__ int slots[kBlock];
  const int i = blockIdx.x * kBlock + threadIdx.x;
  slots[threadIdx.x] = x[i];
  // A __syncthreads() belongs here.
  out[i] = threadIdx.x >= 32 ? slots[threadIdx.x - 32] : -2;
}

// The same with the barrier: right under every order.
// Grid: (num_blocks), block: (kBlock).
template <int kBlock>
__global__ void with_barrier(int* __restrict__ out,        // [num_blocks, kBlock]
                             const int* __restrict__ x) {  // [num_blocks, kBlock]
  __shared__ int slots[kBlock];
  const int i = blockIdx.x * kBlock + threadIdx.x;
  slots[threadIdx.x] = x[i];
  __syncthreads();
  out[i] = threadIdx.x >= 32 ? slots[threadIdx.x - 32] : -2;
}

}  // namespace cpu_test
