// wmma.cu: tensor-core fragments (mma.h, nvcuda::wmma) for the CPU backend's emulation
// (tests/cpu/test_cpu_wmma.py), also compiled by NVRTC for sm_80 and sm_90.
//
// wmma_gemm is the pattern of the decode kernel's MMA path: load A and B (16-bit, either layout,
// a padded leading dimension), load C, D = A B + C, store D to shared memory, then every lane
// reads elements that other lanes stored. Its template argument plants one bug at a time: the
// __syncwarp between the store and the reads left out (the CPU backend must give NaN), or a
// wrong leading dimension (a wrong result). wmma_misuse makes one malformed call (misaligned
// tile, bad ldm, lanes passing different pointers, a lane missing), each a KernelError on the CPU
// backend; wmma_layout shows where the elements of an accumulator land (an opaque layout).
#ifndef CUPAGED_CPU
#include <mma.h>  // the CPU backend's shim provides nvcuda::wmma itself
#endif

#include "common.cuh"

namespace cpu_test {

using namespace nvcuda;

enum WmmaBug : int {
  kWmmaNoBug = 0,
  kNoSyncwarpAfterStore = 1,  // reads other lanes' stored elements without the __syncwarp
  kWrongLdm = 2,              // loads B with ldm 16 where the rows are ldb apart
};

constexpr int kTileLd = 20;  // floats per row of the shared tile: a multiple of 4 (16 bytes)

// d = scale * (a b + c), 16 x 16. a: [16, lda] row-major (LA = row_major) or its transpose
// (col_major: a[k * lda + m]); b likewise with ldb; c and d [16, 16] float, row-major; a and b
// 32-byte aligned. Grid: (1), block: (32).
template <typename T, typename LA, typename LB, int kBug>
__global__ void wmma_gemm(float* __restrict__ d,        // [16, 16]
                          const T* __restrict__ a,      // [16, lda]
                          const T* __restrict__ b,      // [16, ldb]
                          const float* __restrict__ c,  // [16, 16]
                          int lda, int ldb, float scale) {
  __shared__ __align__(32) float tile[16 * kTileLd];
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LA> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LB> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(fa, a, lda);
  wmma::load_matrix_sync(fb, b, kBug == kWrongLdm ? 16 : ldb);
  wmma::load_matrix_sync(acc, c, 16, wmma::mem_row_major);
  wmma::mma_sync(acc, fa, fb, acc);
  for (int e = 0; e < acc.num_elements; ++e) acc.x[e] *= scale;  // elementwise: any layout
  wmma::store_matrix_sync(tile, acc, kTileLd, wmma::mem_row_major);
  if (kBug != kNoSyncwarpAfterStore) __syncwarp();
  const int lane = threadIdx.x;
  for (int j = 0; j < 8; ++j) {
    const int e = 255 - (lane * 8 + j);  // mostly elements that other lanes stored
    d[e] = tile[e / 16 * kTileLd + e % 16];
  }
}

// One malformed call, `what`: 0 a tile 16 bytes off a 32-byte boundary, 1 an ldm of 12 halves
// (24 bytes), 2 lanes passing different pointers, 3 lane 31 returning before the load.
// a: [16, 16] 32-byte aligned. Grid: (1), block: (32).
__global__ void wmma_misuse(float* __restrict__ out,      // [32]
                            const __half* __restrict__ a,  // [32, 16]
                            int what) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  const int lane = threadIdx.x;
  if (what == 3 && lane == 31) return;
  const __half* p = what == 0 ? a + 8 : what == 2 ? a + 16 * (lane & 1) : a;
  wmma::load_matrix_sync(fa, p, what == 1 ? 12 : 16);  // wmma_misuse
  out[lane] = __half2float(fa.x[0]);
}

// out[i] = the lane * 8 + element index whose accumulator element lands at position i of the
// stored 16 x 16 tile (row-major, ldm 16). Grid: (1), block: (32).
__global__ void wmma_layout(float* __restrict__ out) {  // [16, 16], 32-byte aligned
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int e = 0; e < acc.num_elements; ++e) acc.x[e] += threadIdx.x * 8 + e;
  wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}

}  // namespace cpu_test
