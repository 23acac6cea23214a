// mma_sync.cu: ldmatrix and mma.sync m16n8k16 (cuda/mma_sync.cuh) for the CPU backend's emulation
// (tests/cpu/test_mma_sync.py), also compiled by NVRTC for sm_80 and sm_90.
//
// Each kernel is one warp (Grid: (1), block: (32)) and writes the registers it receives in the
// layout the PTX ISA documents, so that the test can check them against NumPy:
//   ldmatrix_rows   ldmatrix .x2/.x4 (.trans) of rows 48 bytes apart in dynamic shared memory
//                   (or of shared memory that nothing wrote: the poison)
//   mma_gemm        D = A B + C: A by ldmatrix_x4, B from its transpose by ldmatrix_x2
//   attention_pair  O = (Q K^T * scale) V with P kept in registers: the accumulators of two
//                   score mmas, rounded to T in pairs, are the A operand of P V
//   mma_misuse      one malformed call per `what` (the test names the KernelError)
//   byte_perm       out = __byte_perm(x, y, s), elementwise
#include "common.cuh"
#include "mma_sync.cuh"

namespace cpu_test {

using cupaged::mma::ldmatrix_x2;
using cupaged::mma::ldmatrix_x2_trans;
using cupaged::mma::ldmatrix_x4;
using cupaged::mma::ldmatrix_x4_trans;
using cupaged::mma::mma_16816;

constexpr int kLd = 24;  // 16-bit elements per row of a shared tile: 48 bytes, 16-byte aligned

__device__ __forceinline__ void load(unsigned (&r)[4], const void* row, bool trans) {
  if (trans) {
    ldmatrix_x4_trans(r, row);
  } else {
    ldmatrix_x4(r, row);
  }
}
__device__ __forceinline__ void load(unsigned (&r)[2], const void* row, bool trans) {
  if (trans) {
    ldmatrix_x2_trans(r, row);
  } else {
    ldmatrix_x2(r, row);
  }
}

// out[lane][i] = register i of `lane` after ldmatrix of kCount 8 x 8 matrices, matrix m row r
// being in[m][r][0 .. 7]; stored to shared memory row m * 8 + r (kLd apart) unless `written` is 0.
// .x2: lanes 16-31 pass a misaligned address, which the instruction ignores. Dynamic shared
// memory: 32 * kLd * 2 bytes. Grid: (1), block: (32).
template <int kCount, bool kTrans>
__global__ void ldmatrix_rows(unsigned* __restrict__ out,              // [32, kCount]
                              const unsigned short* __restrict__ in,  // [kCount, 8, 8]
                              int written) {
  CUPAGED_DYNAMIC_SHARED(unsigned short, tile);
  const int lane = threadIdx.x;
  if (written) {
    for (int e = lane; e < kCount * 64; e += 32) tile[e / 8 * kLd + e % 8] = in[e];
  }
  __syncwarp();
  unsigned r[kCount];
  load(r, lane < 8 * kCount ? tile + lane * kLd : tile + 1, kTrans);
  for (int i = 0; i < kCount; ++i) out[lane * kCount + i] = r[i];
}

// d = a b + c, b given as its transpose bt (N x K, row-major). Grid: (1), block: (32).
template <typename T>
__global__ void mma_gemm(float* __restrict__ d,        // [16, 8]
                         const T* __restrict__ a,      // [16, 16]
                         const T* __restrict__ bt,     // [8, 16]
                         const float* __restrict__ c) {  // [16, 8]
  __shared__ __align__(16) T sa[16 * kLd];
  __shared__ __align__(16) T sb[8 * kLd];
  const int lane = threadIdx.x, g = lane / 4, q = lane % 4;
  for (int e = lane; e < 256; e += 32) sa[e / 16 * kLd + e % 16] = a[e];
  for (int e = lane; e < 128; e += 32) sb[e / 16 * kLd + e % 16] = bt[e];
  __syncwarp();
  unsigned ra[4], rb[2];
  ldmatrix_x4(ra, sa + lane % 16 * kLd + 8 * (lane / 16));
  ldmatrix_x2(rb, sb + lane % 8 * kLd + 8 * (lane / 8 % 2));
  float acc[4] = {c[g * 8 + 2 * q], c[g * 8 + 2 * q + 1], c[(g + 8) * 8 + 2 * q],
                  c[(g + 8) * 8 + 2 * q + 1]};
  mma_16816<T>(acc, ra, rb);
  d[g * 8 + 2 * q] = acc[0];
  d[g * 8 + 2 * q + 1] = acc[1];
  d[(g + 8) * 8 + 2 * q] = acc[2];
  d[(g + 8) * 8 + 2 * q + 1] = acc[3];
}

__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}

// Two floats rounded to T, packed into one register (lo the lower half), as an A operand wants.
template <typename T>
__device__ __forceinline__ unsigned pack(float lo, float hi) {
  return __byte_perm(bits_of(T(lo)), bits_of(T(hi)), 0x5410);
}

// o = T(scale * q k^T) v: 16 queries, 16 keys, head_dim 16. Grid: (1), block: (32).
template <typename T>
__global__ void attention_pair(float* __restrict__ o,      // [16, 16]
                               const T* __restrict__ q,    // [16, 16]
                               const T* __restrict__ k,    // [16, 16]
                               const T* __restrict__ v,    // [16, 16]
                               float scale) {
  __shared__ __align__(16) T sq[16 * kLd];
  __shared__ __align__(16) T sk[16 * kLd];
  __shared__ __align__(16) T sv[16 * kLd];
  const int lane = threadIdx.x, g = lane / 4, c = lane % 4;
  for (int e = lane; e < 256; e += 32) {
    sq[e / 16 * kLd + e % 16] = q[e];
    sk[e / 16 * kLd + e % 16] = k[e];
    sv[e / 16 * kLd + e % 16] = v[e];
  }
  __syncwarp();
  unsigned rq[4], rk[4], rv[4];
  ldmatrix_x4(rq, sq + lane % 16 * kLd + 8 * (lane / 16));
  // Matrix i: keys 8 (i / 2) .., dims 8 (i % 2) ..: registers 0-1 the B of keys 0-7, 2-3 8-15.
  ldmatrix_x4(rk, sk + (lane % 8 + 8 * (lane / 16)) * kLd + 8 * (lane / 8 % 2));
  // Matrix i: keys 8 (i % 2) .., dims 8 (i / 2) .., transposed: 0-1 the B of dims 0-7, 2-3 8-15.
  ldmatrix_x4_trans(rv, sv + lane % 16 * kLd + 8 * (lane / 16));
  float s[2][4] = {};
  for (int n = 0; n < 2; ++n) {
    const unsigned b[2] = {rk[2 * n], rk[2 * n + 1]};
    mma_16816<T>(s[n], rq, b);
  }
  // P's A registers: rows g / g + 8, keys 2c (+8): the score accumulators, in place.
  const unsigned p[4] = {pack<T>(scale * s[0][0], scale * s[0][1]),
                         pack<T>(scale * s[0][2], scale * s[0][3]),
                         pack<T>(scale * s[1][0], scale * s[1][1]),
                         pack<T>(scale * s[1][2], scale * s[1][3])};
  for (int n = 0; n < 2; ++n) {
    float acc[4] = {};
    const unsigned b[2] = {rv[2 * n], rv[2 * n + 1]};
    mma_16816<T>(acc, p, b);
    o[g * 16 + 8 * n + 2 * c] = acc[0];
    o[g * 16 + 8 * n + 2 * c + 1] = acc[1];
    o[(g + 8) * 16 + 8 * n + 2 * c] = acc[2];
    o[(g + 8) * 16 + 8 * n + 2 * c + 1] = acc[3];
  }
}

// One malformed call, `what`: 0 a row address 8 bytes off a 16-byte boundary, 1 a row address
// in global memory, 2 lane 31 returning before an ldmatrix, 3 lane 31 returning before an mma,
// 4 odd lanes calling .trans. a: [64] 16-byte aligned. Grid: (1), block: (32).
__global__ void mma_misuse(float* __restrict__ out,               // [32]
                           const unsigned short* __restrict__ a,  // [64]
                           int what) {
  __shared__ __align__(16) unsigned short tile[8 * kLd + 8];
  const int lane = threadIdx.x;
  for (int e = lane; e < 8 * kLd + 8; e += 32) tile[e] = a[e % 64];
  __syncwarp();
  const unsigned short* row = what == 0 && lane == 5 ? tile + lane % 8 * kLd + 4
                              : what == 1           ? a + lane % 8 * 8
                                                    : tile + lane % 8 * kLd;
  if (what == 2 && lane == 31) return;
  unsigned r[2];
  if (what == 4 && lane % 2 == 1) {
    ldmatrix_x2_trans(r, row);
  } else {
    ldmatrix_x2(r, row);  // mma_misuse ldmatrix
  }
  if (what == 3 && lane == 31) return;
  const unsigned ra[4] = {r[0], r[1], r[0], r[1]};
  float acc[4] = {};
  mma_16816<__half>(acc, ra, r);  // mma_misuse mma
  out[lane] = acc[0];
}

// out[i] = __byte_perm(x[i], y[i], s[i]). Grid: (1), block: (n).
__global__ void byte_perm(unsigned* __restrict__ out,      // [n]
                          const unsigned* __restrict__ x,  // [n]
                          const unsigned* __restrict__ y,  // [n]
                          const unsigned* __restrict__ s) {  // [n]
  const int i = threadIdx.x;
  out[i] = __byte_perm(x[i], y[i], s[i]);
}

}  // namespace cpu_test
