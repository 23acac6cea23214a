// fp8_pairs.cu: the fp8 -> fp16/bf16/float conversions of cuda/common.cuh, byte by byte
// (tests/attention/test_fp8_conversion.py), also compiled by NVRTC for sm_80 and sm_90.
//
// The CPU backend compiles without __CUDA_ARCH__ and so runs the bit-trick conversion that sm_80
// runs (sm_89 and later convert with cvt.f16x2); the test checks it on every code of both
// formats, in every byte position of a word.
#include "common.cuh"

namespace cpu_test {

// For word i of `words` (4 fp8 bytes of KV, the lowest address first):
//   pairs[2i], pairs[2i + 1]  fp8x2_as_pair of its low and high 16 bits, as T elements
//   floats[4i .. 4i + 3]      fp8_words_as_float of the word
//   singles[4i .. 4i + 3]     to_float of each byte
// Grid: (ceil(n / 64)), block: (64).
template <typename KV, typename T>
__global__ void fp8_pairs(unsigned* __restrict__ pairs,        // [n, 2] two T each
                          float* __restrict__ floats,          // [n, 4]
                          float* __restrict__ singles,         // [n, 4]
                          const unsigned* __restrict__ words,  // [n] four fp8 bytes each
                          int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const unsigned word = words[i];
  const T* tag = nullptr;
  pairs[2 * i] = cupaged::fp8x2_as_pair<KV>(word & 0xffffu, tag);
  pairs[2 * i + 1] = cupaged::fp8x2_as_pair<KV>(word >> 16, tag);
  const unsigned one[1] = {word};
  cupaged::fp8_words_as_float<KV>(one, floats + 4 * i);
  for (int b = 0; b < 4; ++b) {
    KV x;
    x.__x = static_cast<__nv_fp8_storage_t>(word >> (8 * b) & 0xffu);
    singles[4 * i + b] = cupaged::to_float(x);
  }
}

}  // namespace cpu_test
