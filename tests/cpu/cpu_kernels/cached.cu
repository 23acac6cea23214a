// cached.cu: a minimal kernel for the CPU backend's build-cache test (tests/cpu/test_cpu_backend.py).
// The value it writes comes from cached_helper.cuh, so that editing the header must rebuild.
#include "cached_helper.cuh"

namespace cpu_test {

// out[i] = fill_value() for i < n.
// Grid: (ceil(n / blockDim.x)), block: any.
__global__ void fill(int* __restrict__ out,  // [n]
                     int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fill_value();
}

}  // namespace cpu_test
