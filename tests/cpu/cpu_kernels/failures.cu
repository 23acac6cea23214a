// failures.cu: kernels that fail on purpose, to check that the CPU backend reports each failure
// as a KernelError naming the kernel and the line (tests/cpu/test_cpu_backend.py). They break the
// source rules of DESIGN.md §4 deliberately (a barrier or a shuffle not reached by every thread);
// they still compile with NVRTC. scale is well-formed: it checks argument types.
#include "common.cuh"

namespace cpu_test {

// Even and odd threads wait at two different __syncthreads (strict mode rejects it; hardware,
// and the non-strict mode, let the two meet).
// Grid: (1), block: any.
__global__ void divergent_barrier(float* __restrict__ out) {  // [blockDim.x]
  if (threadIdx.x % 2 == 0) {
    __syncthreads();  // even threads
  } else {
    __syncthreads();  // odd threads
  }
  out[threadIdx.x] = 1.0f;
}

// Lane 0 of each warp skips a full-mask shuffle that lanes 1-31 wait in: a deadlock.
// Grid: (1), block: a multiple of 32.
__global__ void skipped_shuffle(int* __restrict__ out) {  // [blockDim.x]
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 32 != 0) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// Threads of the first warp wait at a barrier while the second warp waits in a shuffle whose
// mask names lanes that have exited: no thread can go on.
// Grid: (1), block: (64).
__global__ void barrier_and_shuffle(int* __restrict__ out) {  // [64]
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x >= 32) {
    if (threadIdx.x % 2 == 0) return;
    v = __shfl_down_sync(0xffffffffu, v, 1);
  }
  __syncthreads();
  out[threadIdx.x] = v;
}

// Writes out[idx[t]] = t after checking the index with a device assert.
// Grid: (1), block: (n).
__global__ void checked_scatter(int* __restrict__ out,        // [size]
                                const int* __restrict__ idx,  // [blockDim.x]
                                int size) {
  const int i = idx[threadIdx.x];
  assert(i >= 0 && i < size);
  out[i] = static_cast<int>(threadIdx.x);
}

// out = alpha * x + offset, with parameters of several C types.
// Grid: (ceil(n / blockDim.x)), block: any.
__global__ void scale(float* __restrict__ out,      // [n]
                      const float* __restrict__ x,  // [n]
                      float alpha, int n, long long offset, unsigned char flag, double beta) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = alpha * x[i] + static_cast<float>(offset) + static_cast<float>(flag) +
           static_cast<float>(beta);
}

}  // namespace cpu_test
