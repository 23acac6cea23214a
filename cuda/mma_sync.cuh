// mma_sync.cuh: the warp-level tensor-core instructions of the FlashAttention-2 kind of kernel
// (paged_prefill_flash in paged_prefill.cu), and a WMMA load, as small device functions:
//
//   ldmatrix_x4 / ldmatrix_x4_trans   ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16
//   ldmatrix_x2 / ldmatrix_x2_trans   ldmatrix.sync.aligned.m8n8.x2{.trans}.shared.b16
//   mma_16816<T>                      mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32 (T: __half
//                                     or __nv_bfloat16), D += A B in place
//   wmma_load                         nvcuda::wmma::load_matrix_sync of an A or B fragment from
//                                     shared memory; for __nv_bfloat16 as
//                                     wmma.load.{a,b}.sync.aligned.{row,col}.m16n16k16.shared.bf16
//
// wmma_load exists because CUDA's mma.h loads a bf16 WMMA fragment with the generic form of
// wmma.load, and ptxas lowers that to four generic 32-bit loads (LD.E) per fragment even from a
// __shared__ array, where the same load of __half fragments becomes one LDSM.16.M88.4 (seen in
// the SASS of both, sm_80 and sm_90). The .shared form gives LDSM for bf16 too. It is the same
// WMMA instruction, so the fragment's layout stays the opaque one wmma::mma_sync expects: the
// kernels rely on nothing of it. __half fragments keep mma.h's load; the CPU backend's shim
// runs its own load_matrix_sync for both.
//
// They are the only inline PTX in cuda/ (DESIGN.md's source rules, as docs/cpu_backend.md amends
// them): each is one instruction whose register layout the PTX ISA documents (section 9.7.14.5,
// "Matrix fragments for mma.m16n8k16"), so that a kernel may rely on it (the softmax works on
// the score accumulators in registers and hands them to P V as the A operand), and the CPU
// backend's shim (cupaged/kernels/cpu/csrc/shim.h, section 13) emulates each as a collective of
// the whole warp with exactly that layout: a wrong fragment index is a wrong result there too.
//
// Layouts (lane l, g = l / 4, c = l % 4; a register holds two 16-bit elements, the lower half
// the first):
//   ldmatrix: a matrix is 8 rows of 8 16-bit elements (16 bytes a row, 16-byte aligned, in
//     shared memory). Lane l passes the address of row l % 8 of matrix l / 8 (x4: matrices 0-3;
//     x2: 0-1, and only lanes 0-15's addresses are read, every lane still passes one). Register
//     i receives row g, elements 2c and 2c + 1 of matrix i; with .trans, elements (2c, g) and
//     (2c + 1, g) (row, column): the matrix transposed.
//   mma_16816: A is 16 x 16 (row-major, M x K), B 16 x 8 (K x N), C = D 16 x 8 in float:
//     a[0] = A[g][2c, 2c+1]       a[1] = A[g+8][2c, 2c+1]
//     a[2] = A[g][2c+8, 2c+9]     a[3] = A[g+8][2c+8, 2c+9]
//     b[0] = B[2c, 2c+1][g]       b[1] = B[2c+8, 2c+9][g]
//     d[0], d[1] = D[g][2c, 2c+1]  d[2], d[3] = D[g+8][2c, 2c+1]
//   So ldmatrix_x4 of a 16 x 16 block of a row-major matrix (lane l: row l % 16, columns
//   8 (l / 16) ..) is A's four registers, and of K rows (keys as the N of B = K^T) two B
//   fragments; ldmatrix_x4_trans of V rows (tokens as the K of B = V) two B fragments.
// Every lane of the warp calls each one (mask 0xffffffff), as on the GPU, where anything else
// is undefined.
#pragma once

#ifndef CUPAGED_CPU
#include <mma.h>  // wmma_load's fragments; the CPU backend's shim provides nvcuda::wmma itself
#endif

namespace cupaged {
namespace mma {

#ifdef CUPAGED_CPU

// The shim's collectives (shim.h, section 13); the call site names the kernel's line in errors.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row,
                                            const char* file = __builtin_FILE(),
                                            int line = __builtin_LINE()) {
  cupaged_cpu::ldmatrix(r, 4, false, row, file, line);
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row,
                                                  const char* file = __builtin_FILE(),
                                                  int line = __builtin_LINE()) {
  cupaged_cpu::ldmatrix(r, 4, true, row, file, line);
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row,
                                            const char* file = __builtin_FILE(),
                                            int line = __builtin_LINE()) {
  cupaged_cpu::ldmatrix(r, 2, false, row, file, line);
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row,
                                                  const char* file = __builtin_FILE(),
                                                  int line = __builtin_LINE()) {
  cupaged_cpu::ldmatrix(r, 2, true, row, file, line);
}
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2],
                                          const char* file = __builtin_FILE(),
                                          int line = __builtin_LINE()) {
  cupaged_cpu::mma_16816<T>(d, a, b, file, line);
}

template <typename Use, typename T, typename Layout>
__device__ __forceinline__ void wmma_load(nvcuda::wmma::fragment<Use, 16, 16, 16, T, Layout>& f,
                                          const T* p, unsigned ldm,
                                          const char* file = __builtin_FILE(),
                                          int line = __builtin_LINE()) {
  nvcuda::wmma::load_matrix_sync(f, p, ldm, file, line);
}

#else

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_address(row)));
}

// The instruction per operand type: mma_16816<__half> or mma_16816<__nv_bfloat16> (no other).
__device__ __forceinline__ void mma_16816_of(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16816_of(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const __nv_bfloat16*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]) {
  mma_16816_of(d, a, b, static_cast<const T*>(nullptr));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // mma.h's condition for bf16 fragments
// A bf16 fragment holds 8 elements in 4 registers (A row-major, B column- or row-major); the
// registers go to the fragment's elements in order, as mma.h's own load writes them.
template <typename Use, typename Layout>
__device__ __forceinline__ void wmma_load_bf16(
    nvcuda::wmma::fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, unsigned r0, unsigned r1,
    unsigned r2, unsigned r3) {
  static_assert(sizeof(f.x) == 16, "a bf16 m16n16k16 A or B fragment is 4 registers");
  const unsigned r[4] = {r0, r1, r2, r3};
  memcpy(&f.x[0], r, sizeof(r));
}
__device__ __forceinline__ void wmma_load(
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16,
                           nvcuda::wmma::row_major>& f,
    const __nv_bfloat16* p, unsigned ldm) {
  unsigned r0, r1, r2, r3;
  asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(shared_address(p)), "r"(ldm));
  wmma_load_bf16(f, r0, r1, r2, r3);
}
__device__ __forceinline__ void wmma_load(
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16,
                           nvcuda::wmma::col_major>& f,
    const __nv_bfloat16* p, unsigned ldm) {
  unsigned r0, r1, r2, r3;
  asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(shared_address(p)), "r"(ldm));
  wmma_load_bf16(f, r0, r1, r2, r3);
}
__device__ __forceinline__ void wmma_load(
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16,
                           nvcuda::wmma::row_major>& f,
    const __nv_bfloat16* p, unsigned ldm) {
  unsigned r0, r1, r2, r3;
  asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(shared_address(p)), "r"(ldm));
  wmma_load_bf16(f, r0, r1, r2, r3);
}
#endif
// __half: mma.h's load (one LDSM per fragment already).
template <typename Use, typename Layout>
__device__ __forceinline__ void wmma_load(nvcuda::wmma::fragment<Use, 16, 16, 16, __half, Layout>& f,
                                          const __half* p, unsigned ldm) {
  nvcuda::wmma::load_matrix_sync(f, p, ldm);
}

#endif

// 2^x as the softmax's exponential: ex2.approx.ftz.f32 (one MUFU.EX2; relative error about
// 2^-22, a result below 2^-126 flushed to 0, 2^-inf = 0, NaN stays NaN), where exp2f adds a
// range fix-up of three instructions around it. The CPU backend: exp2f.
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef CUPAGED_CPU
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
}

}  // namespace mma
}  // namespace cupaged
