// shim.h: the CUDA device API as host C++, so that g++ builds a cuda/*.cu file for the CPU backend.
//
// Force-included (`g++ -include shim.h`) before the kernel source. It provides what a kernel sees
// on a GPU, emulated on the CPU (DESIGN.md §5):
//
//   - the CUDA headers cuda_fp16.h / cuda_bf16.h / cuda_fp8.h / vector_types.h compiled as host
//     code (fp8 conversions run the header's own host functions, bit for bit the GPU's), plus
//     float-round-trip fallbacks for the half/bfloat16 functions those headers keep device-only;
//   - the CUDA keywords (__global__, __device__, __shared__, ...) as plain C++;
//   - threadIdx / blockIdx / blockDim / gridDim, which the runtime (runtime.h) rewrites on every
//     switch between CUDA threads (fibers);
//   - __syncthreads, the warp collectives (__shfl*_sync, __ballot_sync, __any_sync, __all_sync,
//     __syncwarp), device assert, atomics and the device math functions;
//   - the asynchronous copies of cuda_pipeline_primitives.h (__pipeline_memcpy_async,
//     __pipeline_commit, __pipeline_wait_prior; section 11), deferred so that a missing wait shows:
//     a copy's destination turns to poison (0xFF bytes, NaN) when the copy is issued and receives
//     the data only when the issuing thread's __pipeline_wait_prior completes its batch. A read
//     before the wait, or by another thread before the __syncthreads that follows the wait, sees
//     NaN, and so does a thread still reading a stage that another thread refills. Each thread keeps
//     its own queue (at most 1024 pending copies); a thread that returns with copies still pending
//     fails the launch (end a pipelined loop with __pipeline_wait_prior(0)), as do a size other
//     than 4, 8 or 16, a zfill above the size, a misaligned address (both sides aligned to the
//     size), a destination outside shared memory or a source inside it: KernelError naming the
//     kernel, the call's file and line, the block and the thread;
//   - the WMMA fragments of mma.h (nvcuda::wmma, m16n16k16, __half / __nv_bfloat16 operands,
//     float accumulators; section 12) as whole-warp collectives over fragments whose element
//     layout is deliberately not the GPU's (code must treat it as opaque): a load and an mma run
//     once every lane of the warp has arrived, a store poisons its whole tile when the last lane
//     arrives and each lane then writes its own elements, so that reading another lane's part
//     before a __syncwarp sees NaN;
//   - ldmatrix and mma.sync m16n8k16 (the CPU branch of cuda/mma_sync.cuh; section 13) as
//     whole-warp collectives with the register layouts of the PTX ISA, reading shared memory
//     when the last lane arrives.
//
// Every synchronising call takes its call site through default arguments (__builtin_FILE() and
// __builtin_LINE() are evaluated where the call is written), so that a divergent barrier or a
// deadlock names the line of the kernel source.
#pragma once

#ifndef CUPAGED_CPU
#define CUPAGED_CPU 1
#endif

// ---- 1. Standard and system headers, before any CUDA header or keyword macro ------------------
// The keyword macros below (__noinline__, __shared__, ...) would break these headers if they came
// later, so everything the shim and the runtime need is included here. Kept to C-level headers
// plus <cmath>/<utility>/<type_traits> so that a build stays quick.
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

// ---- 2. CUDA headers as host code -------------------------------------------------------------
// vector_functions.h includes cuda_runtime_api.h, which kernels never need; its include guard is
// set so that the 15,000 lines of it are skipped.
#define __CUDA_RUNTIME_API_H__
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <vector_types.h>
#include <vector_functions.h>

// ---- 3. CUDA keywords ---------------------------------------------------------------------------
#undef __global__
#undef __device__
#undef __host__
#undef __constant__
#undef __managed__
#undef __shared__
#undef __forceinline__
#undef __noinline__
#undef __align__
#undef __launch_bounds__
#undef __grid_constant__
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
// One block runs at a time on each worker OS thread and all its CUDA threads run on that OS thread,
// so thread-local storage is exactly "shared by the block". The runtime fills it with 0xFF bytes
// before every block (runtime.h, poison_static_shared), like dynamic shared memory. A `__shared__`
// variable must not have an initializer or a constructor that does work (as in CUDA).
#define __shared__ static thread_local
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__
// __restrict__ is a GNU C++ keyword already.

// ---- 4. Built-in variables ----------------------------------------------------------------------
// Written by the runtime before it resumes a CUDA thread; read-only for kernels.
static __thread uint3 threadIdx;
static __thread uint3 blockIdx;
static __thread dim3 blockDim;
static __thread dim3 gridDim;
static constexpr int warpSize = 32;

// ---- 5. Runtime entry points (defined in runtime.h) --------------------------------------------
namespace cupaged_cpu {

// What a CUDA thread is blocked in; also the name used in error messages.
enum Op : unsigned char {
  kOpNone,
  kOpSyncthreads,
  kOpSyncwarp,
  kOpShfl,
  kOpShflUp,
  kOpShflDown,
  kOpShflXor,
  kOpBallot,
  kOpAny,
  kOpAll,
  kOpWmmaLoad,  // nvcuda::wmma (section 12): whole-warp collectives whose value is a request
  kOpWmmaStore,
  kOpWmmaMma,
  kOpLdmatrix,  // cuda/mma_sync.cuh (section 13): whole-warp collectives, requests as for wmma
  kOpMmaSync
};

// Barrier flavours: the result a thread gets back from block_barrier().
enum BarrierKind : unsigned char { kBarPlain, kBarCount, kBarAnd, kBarOr };

// Block-wide barrier over the live threads. Returns what the flavour asks for (count, and, or).
int block_barrier(BarrierKind kind, int predicate, const char* file, int line);

// A warp collective: the calling lane contributes `value` (up to 8 bytes) and waits until every
// lane of `mask` has arrived at a collective of the same kind with the same mask. Returns the
// lane's result: the shuffled value, or the ballot.
unsigned long long warp_collective(Op op, unsigned mask, unsigned long long value, int arg,
                                   int width, int size, const char* file, int line);

// Lanes of the calling thread's warp that have not exited.
unsigned active_mask();

// The calling thread's lane in its warp.
unsigned current_lane();

[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const char* function);

// Shuffle any value of up to 8 bytes (int, float, double, __half, __half2, ...), copied bitwise
// like the hardware does (__half2 has a user-written move constructor, so it is not formally
// "trivially copyable", but its bytes are all there is to it).
template <typename T>
inline T shuffle(Op op, unsigned mask, T var, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "the CPU backend shuffles values of at most 8 bytes");
  unsigned long long bits = 0;
  memcpy(&bits, &var, sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width, static_cast<int>(sizeof(T)), file, line);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

// A vote is a collective whose value is the predicate and whose result is the ballot.
inline unsigned long long vote(Op op, unsigned mask, int predicate, const char* file, int line) {
  return warp_collective(op, mask, predicate != 0, 0, 32, 0, file, line);
}

}  // namespace cupaged_cpu

// The per-block dynamic shared memory (the launch's shared_mem bytes, 128-byte aligned), filled
// with 0xFF bytes (NaN as float, half, bfloat16 and double) before each block. Kernels reach it
// through CUPAGED_DYNAMIC_SHARED (cuda/common.cuh).
void* cupaged_cpu_dynamic_shared();

// ---- 6. Synchronisation and warp collectives ---------------------------------------------------
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cupaged_cpu::block_barrier(cupaged_cpu::kBarPlain, 0, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
  return cupaged_cpu::block_barrier(cupaged_cpu::kBarCount, predicate, file, line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  return cupaged_cpu::block_barrier(cupaged_cpu::kBarAnd, predicate, file, line);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  return cupaged_cpu::block_barrier(cupaged_cpu::kBarOr, predicate, file, line);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  cupaged_cpu::warp_collective(cupaged_cpu::kOpSyncwarp, mask, 0, 0, 32, 0, file, line);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cupaged_cpu::shuffle(cupaged_cpu::kOpShfl, mask, var, src_lane, width, file, line);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cupaged_cpu::shuffle(cupaged_cpu::kOpShflUp, mask, var, static_cast<int>(delta), width,
                              file, line);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cupaged_cpu::shuffle(cupaged_cpu::kOpShflDown, mask, var, static_cast<int>(delta), width,
                              file, line);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return cupaged_cpu::shuffle(cupaged_cpu::kOpShflXor, mask, var, lane_mask, width, file, line);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  const auto ballot = cupaged_cpu::vote(cupaged_cpu::kOpBallot, mask, predicate, file, line);
  return static_cast<unsigned>(ballot);
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return static_cast<int>(cupaged_cpu::vote(cupaged_cpu::kOpAny, mask, predicate, file, line));
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return static_cast<int>(cupaged_cpu::vote(cupaged_cpu::kOpAll, mask, predicate, file, line));
}
// The lanes of the warp that have not exited (the CPU backend never runs a warp in lock step, so
// "converged" has no other meaning here).
inline unsigned __activemask() { return cupaged_cpu::active_mask(); }

// ---- 7. Device assert, trap, memory fences ---------------------------------------------------
// A failing assert ends the launch; Python raises KernelError with the expression, file and line.
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) \
  ((e) ? (void)0 : ::cupaged_cpu::assert_fail(#e, __FILE__, __LINE__, __PRETTY_FUNCTION__))
#endif
inline void __trap(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cupaged_cpu::assert_fail("__trap()", file, line, "__trap");
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
// Loads and stores with cache hints: plain memory accesses on the CPU.
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldca(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }
template <typename T>
inline T __ldcs(const T* p) { return *p; }
template <typename T>
inline T __ldlu(const T* p) { return *p; }
template <typename T>
inline T __ldcv(const T* p) { return *p; }
template <typename T>
inline void __stwb(T* p, T v) { *p = v; }
template <typename T>
inline void __stcg(T* p, T v) { *p = v; }
template <typename T>
inline void __stcs(T* p, T v) { *p = v; }
template <typename T>
inline void __stwt(T* p, T v) { *p = v; }
inline void __nanosleep(unsigned) {}

// ---- 8. Atomics ---------------------------------------------------------------------------------
// Blocks run concurrently on several OS threads, so these are real atomics; threads of one block
// never interleave inside one (they switch only at synchronising calls).
#define CUPAGED_CPU_ATOMIC_INT(T)                                                                 \
  inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }           \
  inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }           \
  inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }         \
  inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }           \
  inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }             \
  inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }           \
  inline T atomicCAS(T* p, T expected, T desired) {                                               \
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); \
    return expected;                                                                              \
  }                                                                                               \
  inline T atomicMax(T* p, T v) {                                                                 \
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                                 \
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,            \
                                                   __ATOMIC_RELAXED)) {                           \
    }                                                                                             \
    return old;                                                                                   \
  }                                                                                               \
  inline T atomicMin(T* p, T v) {                                                                 \
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                                 \
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED,            \
                                                   __ATOMIC_RELAXED)) {                           \
    }                                                                                             \
    return old;                                                                                   \
  }
CUPAGED_CPU_ATOMIC_INT(int)
CUPAGED_CPU_ATOMIC_INT(unsigned int)
CUPAGED_CPU_ATOMIC_INT(long long)
CUPAGED_CPU_ATOMIC_INT(unsigned long long)
#undef CUPAGED_CPU_ATOMIC_INT

// Floating-point atomics through a compare-and-swap loop on the bit pattern.
#define CUPAGED_CPU_ATOMIC_FLOAT(T, U)                                                          \
  inline T atomicAdd(T* p, T v) {                                                             \
    U* bits = reinterpret_cast<U*>(p);                                                        \
    U old = __atomic_load_n(bits, __ATOMIC_RELAXED), desired;                                 \
    T now;                                                                                    \
    do {                                                                                      \
      memcpy(&now, &old, sizeof(T));                                                          \
      now += v;                                                                               \
      memcpy(&desired, &now, sizeof(T));                                                      \
    } while (!__atomic_compare_exchange_n(bits, &old, desired, true, __ATOMIC_RELAXED,        \
                                          __ATOMIC_RELAXED));                                 \
    memcpy(&now, &old, sizeof(T));                                                            \
    return now;                                                                               \
  }                                                                                           \
  inline T atomicExch(T* p, T v) {                                                            \
    U in, out;                                                                                \
    memcpy(&in, &v, sizeof(T));                                                               \
    out = __atomic_exchange_n(reinterpret_cast<U*>(p), in, __ATOMIC_RELAXED);                 \
    T old;                                                                                    \
    memcpy(&old, &out, sizeof(T));                                                            \
    return old;                                                                               \
  }
CUPAGED_CPU_ATOMIC_FLOAT(float, unsigned int)
CUPAGED_CPU_ATOMIC_FLOAT(double, unsigned long long)
#undef CUPAGED_CPU_ATOMIC_FLOAT

// ---- 9. Device math -----------------------------------------------------------------------------
// expf, exp2f, logf, log2f, sqrtf, fabsf, fmaxf, fminf, fmaf, floorf, ... come from <math.h>.
// The intrinsics below are exact on the CPU (the GPU's __expf is an approximation), so results
// are close to, not bit-equal with, the GPU's.
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }

inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
// prmt.b32 in its default mode: byte n of the result is byte (s >> 4n) & 7 of {y, x} (x bytes
// 0-3, y bytes 4-7), or, when bit 3 of that nibble is set, the sign of that byte replicated.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long bytes = static_cast<unsigned long long>(y) << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) {
    const unsigned nibble = s >> (4 * n) & 15;
    unsigned byte = static_cast<unsigned>(bytes >> (8 * (nibble & 7))) & 0xff;
    if (nibble & 8) byte = byte & 0x80 ? 0xff : 0;
    r |= byte << (8 * n);
  }
  return r;
}
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}

// CUDA's overloaded min/max (global namespace, like the CUDA math headers).
#define CUPAGED_CPU_MINMAX(T)                     \
  inline T max(T a, T b) { return a < b ? b : a; } \
  inline T min(T a, T b) { return b < a ? b : a; }
CUPAGED_CPU_MINMAX(int)
CUPAGED_CPU_MINMAX(unsigned int)
CUPAGED_CPU_MINMAX(long)
CUPAGED_CPU_MINMAX(unsigned long)
CUPAGED_CPU_MINMAX(long long)
CUPAGED_CPU_MINMAX(unsigned long long)
#undef CUPAGED_CPU_MINMAX
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(double a, double b) { return fmin(a, b); }

// ---- 10. half / bfloat16 functions the CUDA headers keep device-only ---------------------------
// Conversions, comparisons and +-*/ compile as host code from the headers themselves. The
// functions below are device-only there (as of CUDA 12.9 and 13.x); they are computed in float and
// rounded once. Each is a template so that a header that does provide a host version wins
// overload resolution (a non-template beats a template with the same signature) instead of
// clashing with it.
#define CUPAGED_CPU_HALF_UNARY(name, T, to_f, from_f, expr) \
  template <int = 0>                                        \
  inline T name(const T h) {                                \
    const float x = to_f(h);                                \
    return from_f(expr);                                    \
  }
#define CUPAGED_CPU_HALF_MATH(T, to_f, from_f)                            \
  CUPAGED_CPU_HALF_UNARY(hexp, T, to_f, from_f, expf(x))                  \
  CUPAGED_CPU_HALF_UNARY(hexp2, T, to_f, from_f, exp2f(x))                \
  CUPAGED_CPU_HALF_UNARY(hexp10, T, to_f, from_f, exp10f(x))              \
  CUPAGED_CPU_HALF_UNARY(hlog, T, to_f, from_f, logf(x))                  \
  CUPAGED_CPU_HALF_UNARY(hlog2, T, to_f, from_f, log2f(x))                \
  CUPAGED_CPU_HALF_UNARY(hlog10, T, to_f, from_f, log10f(x))              \
  CUPAGED_CPU_HALF_UNARY(hsqrt, T, to_f, from_f, sqrtf(x))                \
  CUPAGED_CPU_HALF_UNARY(hrsqrt, T, to_f, from_f, 1.0f / sqrtf(x))        \
  CUPAGED_CPU_HALF_UNARY(hrcp, T, to_f, from_f, 1.0f / x)                 \
  CUPAGED_CPU_HALF_UNARY(hsin, T, to_f, from_f, sinf(x))                  \
  CUPAGED_CPU_HALF_UNARY(hcos, T, to_f, from_f, cosf(x))                  \
  CUPAGED_CPU_HALF_UNARY(htanh, T, to_f, from_f, tanhf(x))                \
  CUPAGED_CPU_HALF_UNARY(hfloor, T, to_f, from_f, floorf(x))              \
  CUPAGED_CPU_HALF_UNARY(hceil, T, to_f, from_f, ceilf(x))                \
  CUPAGED_CPU_HALF_UNARY(htrunc, T, to_f, from_f, truncf(x))              \
  CUPAGED_CPU_HALF_UNARY(hrint, T, to_f, from_f, nearbyintf(x))           \
  template <int = 0>                                                      \
  inline T __hfma(const T a, const T b, const T c) {                      \
    return from_f(fmaf(to_f(a), to_f(b), to_f(c)));                       \
  }                                                                       \
  template <int = 0>                                                      \
  inline T __hfma_relu(const T a, const T b, const T c) {                 \
    return from_f(fmaxf(fmaf(to_f(a), to_f(b), to_f(c)), 0.0f));          \
  }
CUPAGED_CPU_HALF_MATH(__half, __half2float, __float2half_rn)
CUPAGED_CPU_HALF_MATH(__nv_bfloat16, __bfloat162float, __float2bfloat16_rn)
#undef CUPAGED_CPU_HALF_MATH
#undef CUPAGED_CPU_HALF_UNARY

// Paired versions: each half of the pair on its own.
#define CUPAGED_CPU_PAIR_MATH(T2, T, to_f, make2)                                               \
  template <int = 0>                                                                           \
  inline T2 __hfma2(const T2 a, const T2 b, const T2 c) {                                      \
    return make2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y));                                \
  }                                                                                            \
  template <int = 0>                                                                           \
  inline T2 h2exp(const T2 a) { return make2(hexp(a.x), hexp(a.y)); }                          \
  template <int = 0>                                                                           \
  inline T2 h2sqrt(const T2 a) { return make2(hsqrt(a.x), hsqrt(a.y)); }                       \
  template <int = 0>                                                                           \
  inline T2 h2rsqrt(const T2 a) { return make2(hrsqrt(a.x), hrsqrt(a.y)); }
CUPAGED_CPU_PAIR_MATH(__half2, __half, __half2float, __halves2half2)
CUPAGED_CPU_PAIR_MATH(__nv_bfloat162, __nv_bfloat16, __bfloat162float, __halves2bfloat162)
#undef CUPAGED_CPU_PAIR_MATH

// ---- 11. Asynchronous copies: cuda_pipeline_primitives.h ------------------------------------
// A kernel includes <cuda_pipeline_primitives.h> on both backends (DESIGN.md §4). The CUDA header
// is device code (cp.async), so its include guard is set here and the functions below stand in
// for it, with its signatures and checks. The runtime (runtime.h, "Asynchronous copies") keeps
// each CUDA thread's pending copies and lands them at the wait that completes their batch:
//
//   __pipeline_memcpy_async(dst, src, 16)  dst := poison now; src's 16 bytes are read now and
//                                          queued in the thread's open batch
//   __pipeline_commit()                    closes the open batch (an empty one too, as on the GPU)
//   __pipeline_wait_prior(N)               lands, in issue order, every batch but the N most recent
//                                          committed ones (N above 8 counts as 8, like the header);
//                                          copies not yet committed stay pending
//
// The poison at issue stands for "undefined until the wait" on the GPU, where a copy lands at any
// moment in between: it exposes both a read before the wait and a copy issued into a buffer that
// another thread still reads (a missing __syncthreads before the refill).
#define _CUDA_PIPELINE_PRIMITIVES_H_

namespace cupaged_cpu {
void pipeline_memcpy_async(void* dst_shared, const void* src_global, size_t size_and_align,
                           size_t zfill, const char* file, int line);
void pipeline_commit(const char* file, int line);
void pipeline_wait_prior(size_t prior);
}  // namespace cupaged_cpu

inline void __pipeline_memcpy_async(void* __restrict__ dst_shared,
                                    const void* __restrict__ src_global, size_t size_and_align,
                                    size_t zfill = 0, const char* file = __builtin_FILE(),
                                    int line = __builtin_LINE()) {
  cupaged_cpu::pipeline_memcpy_async(dst_shared, src_global, size_and_align, zfill, file, line);
}
inline void __pipeline_commit(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  cupaged_cpu::pipeline_commit(file, line);
}
inline void __pipeline_wait_prior(size_t prior) { cupaged_cpu::pipeline_wait_prior(prior); }

// ---- 12. Tensor-core fragments: mma.h (nvcuda::wmma) ------------------------------------------
// A kernel includes <mma.h> only when compiled by NVRTC (`#ifndef CUPAGED_CPU`): the CUDA header
// is device code, and the CPU backend provides the part of its API below instead, with its
// signatures: m16n16k16 fragments of __half or __nv_bfloat16 operands (matrix_a, matrix_b; row-
// or column-major) and float accumulators, fill_fragment, load_matrix_sync, mma_sync,
// store_matrix_sync, and the element access x[0 .. num_elements - 1] (num_elements as in mma.h:
// 16 per lane for __half operands, 8 for __nv_bfloat16 and for float accumulators).
//
// Emulated faithfully, so that a kernel's mistakes show:
//   - the fragments' element layout is a fixed scramble, not the GPU's (which is unspecified):
//     element e of lane l holds matrix element kPerm(l * num_elements + e) mod 256, a different
//     permutation per use; elementwise code (x[e] *= s) works, code that assumes a layout does
//     not. A __half operand fragment holds each matrix element twice, as on the GPU;
//   - load_matrix_sync, mma_sync and store_matrix_sync are collectives of the whole warp
//     (mask 0xffffffff): a lane missing from one deadlocks (KernelError), lanes passing different
//     pointers, leading dimensions or layouts, or calling different operations, fail the launch;
//   - a load reads the whole tile when the last lane arrives (so the data must be there: an
//     async copy not yet waited for, or another thread's write before the __syncthreads, is NaN);
//   - an mma computes D = A B + C in float (products exact, sums in k order) for the whole warp
//     when the last lane arrives;
//   - a store poisons the whole tile (0xFF bytes: NaN) when the last lane arrives, then each lane
//     writes its own elements when it runs on: a lane reading elements of the tile that another
//     lane stored, without a __syncwarp (or __syncthreads) between, reads NaN;
//   - the pointer must be 32-byte (256-bit) aligned and ldm a multiple of 16 bytes (8 elements of
//     a 16-bit type, 4 floats), as CUDA requires; otherwise KernelError naming the call site.
namespace cupaged_cpu {

struct WmmaRequest {
  // Runs once per collective, on the last lane in, over all 32 lanes' requests; returns an error
  // message, or null.
  const char* (*complete)(WmmaRequest* const* lanes);
  void* fragment;  // this lane's fragment (the result D of an mma)
  const void* a;   // mma: this lane's A, B and C fragments
  const void* b;
  const void* c;
  void* pointer;  // load/store: the tile's first element
  unsigned ldm;
  int layout;  // 0 row-major, 1 column-major
};

[[noreturn]] void wmma_fail(const char* call, const char* file, int line, const char* what);

inline void wmma_collective(Op op, WmmaRequest* request, const char* file, int line) {
  warp_collective(op, 0xffffffffu, reinterpret_cast<uintptr_t>(request), 0, 32, 0, file, line);
}

// Matrix position (row * 16 + column) of element e of lane l, for a fragment of n elements per
// lane: an odd multiplier is a bijection mod 256, so a 16-element fragment holds each position
// twice (lanes l and l + 16 hold the same elements).
template <int kMultiplier, int kOffset>
struct WmmaPermutation {
  static int position(int lane, int e, int n) { return ((lane * n + e) * kMultiplier + kOffset) & 255; }
};

inline float wmma_to_float(float v) { return v; }
inline float wmma_to_float(__half v) { return __half2float(v); }
inline float wmma_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

}  // namespace cupaged_cpu

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename T, int size>
struct __frag_base {
  typedef T element_type;
  enum { num_elements = size };
  T x[size];
};

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment;  // only the specialisations below exist (others do not compile, as on the GPU)

#define CUPAGED_CPU_WMMA_OPERAND(T, size)                                                     \
  template <>                                                                                \
  class fragment<matrix_a, 16, 16, 16, T, row_major> : public __frag_base<T, size> {};       \
  template <>                                                                                \
  class fragment<matrix_a, 16, 16, 16, T, col_major> : public __frag_base<T, size> {};       \
  template <>                                                                                \
  class fragment<matrix_b, 16, 16, 16, T, row_major> : public __frag_base<T, size> {};       \
  template <>                                                                                \
  class fragment<matrix_b, 16, 16, 16, T, col_major> : public __frag_base<T, size> {};
CUPAGED_CPU_WMMA_OPERAND(__half, 16)
CUPAGED_CPU_WMMA_OPERAND(__nv_bfloat16, 8)
#undef CUPAGED_CPU_WMMA_OPERAND
template <>
class fragment<accumulator, 16, 16, 16, float> : public __frag_base<float, 8> {};

}  // namespace wmma
}  // namespace nvcuda

namespace cupaged_cpu {

// Per use: the permutation of its elements and where (row, column) of the logical matrix lives
// in memory for a layout. A is M x K, B is K x N, the accumulator M x N (all 16 x 16).
template <typename Use>
struct WmmaUse;
template <>
struct WmmaUse<nvcuda::wmma::matrix_a> : WmmaPermutation<37, 11> {
  static constexpr const char* kName = "matrix_a";
};
template <>
struct WmmaUse<nvcuda::wmma::matrix_b> : WmmaPermutation<53, 5> {
  static constexpr const char* kName = "matrix_b";
};
template <>
struct WmmaUse<nvcuda::wmma::accumulator> : WmmaPermutation<29, 3> {
  static constexpr const char* kName = "accumulator";
};

template <typename Layout>
struct WmmaLayout;
template <>
struct WmmaLayout<nvcuda::wmma::row_major> {
  static constexpr int kValue = 0;
};
template <>
struct WmmaLayout<nvcuda::wmma::col_major> {
  static constexpr int kValue = 1;
};

inline size_t wmma_offset(int position, unsigned ldm, int layout) {
  const int row = position / 16, col = position % 16;
  return layout == 0 ? static_cast<size_t>(row) * ldm + col : static_cast<size_t>(col) * ldm + row;
}

// Every lane must name the same tile: the GPU's behaviour is undefined otherwise.
inline const char* wmma_same_tile(WmmaRequest* const* lanes) {
  for (int l = 1; l < 32; ++l) {
    if (lanes[l]->pointer != lanes[0]->pointer || lanes[l]->ldm != lanes[0]->ldm ||
        lanes[l]->layout != lanes[0]->layout) {
      return "the lanes of the warp pass different pointers, leading dimensions or layouts";
    }
  }
  return nullptr;
}

template <typename Frag, typename Use, typename T>
const char* wmma_complete_load(WmmaRequest* const* lanes) {
  if (const char* error = wmma_same_tile(lanes)) return error;
  const T* base = static_cast<const T*>(lanes[0]->pointer);
  for (int l = 0; l < 32; ++l) {
    Frag& f = *static_cast<Frag*>(lanes[l]->fragment);
    for (int e = 0; e < Frag::num_elements; ++e) {
      const int position = WmmaUse<Use>::position(l, e, Frag::num_elements);
      f.x[e] = base[wmma_offset(position, lanes[0]->ldm, lanes[0]->layout)];
    }
  }
  return nullptr;
}

template <typename Frag>
const char* wmma_complete_store(WmmaRequest* const* lanes) {
  if (const char* error = wmma_same_tile(lanes)) return error;
  float* base = static_cast<float*>(lanes[0]->pointer);
  for (int position = 0; position < 256; ++position) {
    memset(base + wmma_offset(position, lanes[0]->ldm, lanes[0]->layout), 0xff, sizeof(float));
  }
  return nullptr;
}

// The whole matrix of a fragment kind, gathered from the 32 lanes; a position held by two lanes
// with different bits means elementwise code treated the copies differently (undefined).
template <typename Frag, typename Use>
const char* wmma_gather(WmmaRequest* const* lanes, const void* WmmaRequest::*which, float* out) {
  bool seen[256] = {};
  typename Frag::element_type first[256];
  for (int l = 0; l < 32; ++l) {
    const Frag& f = *static_cast<const Frag*>(lanes[l]->*which);
    for (int e = 0; e < Frag::num_elements; ++e) {
      const int position = WmmaUse<Use>::position(l, e, Frag::num_elements);
      if (seen[position] && memcmp(&first[position], &f.x[e], sizeof(f.x[e])) != 0) {
        return "two lanes hold different values for one element of a replicated operand "
               "fragment (its element layout is opaque: treat every element alike)";
      }
      seen[position] = true;
      first[position] = f.x[e];
      out[position] = wmma_to_float(f.x[e]);
    }
  }
  return nullptr;
}

template <typename FD, typename FA, typename FB, typename FC>
const char* wmma_complete_mma(WmmaRequest* const* lanes) {
  for (int l = 1; l < 32; ++l) {
    if (lanes[l]->complete != lanes[0]->complete) return "the lanes call different mma_sync";
  }
  float a[256], b[256], c[256];
  const char* error = wmma_gather<FA, nvcuda::wmma::matrix_a>(lanes, &WmmaRequest::a, a);
  if (error == nullptr) error = wmma_gather<FB, nvcuda::wmma::matrix_b>(lanes, &WmmaRequest::b, b);
  if (error == nullptr) {
    error = wmma_gather<FC, nvcuda::wmma::accumulator>(lanes, &WmmaRequest::c, c);
  }
  if (error != nullptr) return error;
  float d[256];
  for (int row = 0; row < 16; ++row) {
    for (int col = 0; col < 16; ++col) {
      float sum = c[row * 16 + col];
      for (int k = 0; k < 16; ++k) sum += a[row * 16 + k] * b[k * 16 + col];
      d[row * 16 + col] = sum;
    }
  }
  for (int l = 0; l < 32; ++l) {  // D may be C itself: written only after every read
    FD& f = *static_cast<FD*>(lanes[l]->fragment);
    for (int e = 0; e < FD::num_elements; ++e) {
      f.x[e] = d[WmmaUse<nvcuda::wmma::accumulator>::position(l, e, FD::num_elements)];
    }
  }
  return nullptr;
}

template <typename T>
inline void wmma_check_tile(const char* call, const void* p, unsigned ldm, const char* file,
                            int line) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) {
    wmma_fail(call, file, line, "the pointer must be 256-bit (32-byte) aligned");
  }
  if (ldm == 0 || (ldm * sizeof(T)) % 16 != 0) {
    wmma_fail(call, file, line, "ldm must be a positive multiple of 16 bytes of elements");
  }
}

}  // namespace cupaged_cpu

namespace nvcuda {
namespace wmma {

template <typename Use, int m, int n, int k, typename T, typename Layout, typename V>
inline void fill_fragment(fragment<Use, m, n, k, T, Layout>& f, const V& value) {
  const T v = static_cast<T>(value);
  for (int e = 0; e < fragment<Use, m, n, k, T, Layout>::num_elements; ++e) f.x[e] = v;
}

// matrix_a / matrix_b: the layout is the fragment's.
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using Frag = fragment<Use, 16, 16, 16, T, Layout>;
  cupaged_cpu::wmma_check_tile<T>("wmma::load_matrix_sync", p, ldm, file, line);
  cupaged_cpu::WmmaRequest request{&cupaged_cpu::wmma_complete_load<Frag, Use, T>, &f, nullptr,
                                   nullptr, nullptr, const_cast<T*>(p), ldm,
                                   cupaged_cpu::WmmaLayout<Layout>::kValue};
  cupaged_cpu::wmma_collective(cupaged_cpu::kOpWmmaLoad, &request, file, line);
}

// The accumulator: the layout is the call's.
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
  using Frag = fragment<accumulator, 16, 16, 16, float>;
  cupaged_cpu::wmma_check_tile<float>("wmma::load_matrix_sync", p, ldm, file, line);
  cupaged_cpu::WmmaRequest request{&cupaged_cpu::wmma_complete_load<Frag, accumulator, float>,
                                   &f, nullptr, nullptr, nullptr, const_cast<float*>(p), ldm,
                                   layout == mem_col_major};
  cupaged_cpu::wmma_collective(cupaged_cpu::kOpWmmaLoad, &request, file, line);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  using Frag = fragment<accumulator, 16, 16, 16, float>;
  cupaged_cpu::wmma_check_tile<float>("wmma::store_matrix_sync", p, ldm, file, line);
  const int column_major = layout == mem_col_major;
  cupaged_cpu::WmmaRequest request{&cupaged_cpu::wmma_complete_store<Frag>,
                                   const_cast<Frag*>(&f), nullptr, nullptr, nullptr, p, ldm,
                                   column_major};
  cupaged_cpu::wmma_collective(cupaged_cpu::kOpWmmaStore, &request, file, line);
  // The tile is poison now; this lane's elements land as it runs on (the others' when they do).
  const int lane = static_cast<int>(cupaged_cpu::current_lane());
  for (int e = 0; e < Frag::num_elements; ++e) {
    const int position = cupaged_cpu::WmmaUse<accumulator>::position(lane, e, Frag::num_elements);
    p[cupaged_cpu::wmma_offset(position, ldm, column_major)] = f.x[e];
  }
}

template <typename TA, typename LA, typename TB, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, TB, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_same<TA, TB>::value, "mma_sync: A and B of one element type");
  using FD = fragment<accumulator, 16, 16, 16, float>;
  using FA = fragment<matrix_a, 16, 16, 16, TA, LA>;
  using FB = fragment<matrix_b, 16, 16, 16, TB, LB>;
  cupaged_cpu::WmmaRequest request{&cupaged_cpu::wmma_complete_mma<FD, FA, FB, FD>, &d, &a, &b,
                                   &c, nullptr, 0, 0};
  cupaged_cpu::wmma_collective(cupaged_cpu::kOpWmmaMma, &request, file, line);
}

}  // namespace wmma
}  // namespace nvcuda

// ---- 13. ldmatrix and mma.sync: cuda/mma_sync.cuh ----------------------------------------------
// The inline PTX of cuda/mma_sync.cuh (ldmatrix.sync.aligned.m8n8.{x2,x4}{,.trans}.shared.b16 and
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.f32) has a CPU branch that calls the two
// functions below. Unlike WMMA's, these registers have the layout the PTX ISA documents (section
// 9.7.14.5, written out in mma_sync.cuh), and kernels rely on it; the emulation follows it exactly,
// so a wrong fragment index is a wrong result here too. Both are whole-warp collectives
// (mask 0xffffffff, a missing lane deadlocks) run by the last lane in, through WmmaRequest:
//   - ldmatrix: reads the 8 x 8 matrices (16-bit elements) from the row addresses of lanes 0-7
//     (matrix 0), 8-15 (1), 16-23 (2) and 24-31 (3) (.x2: lanes 0-15; the other lanes' addresses
//     are ignored, as on the GPU) when the last lane arrives, so that shared memory not yet
//     written, or an async copy not yet waited for, reads as the poison (NaN). Lane l receives in
//     register i row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of matrix i (lower half first);
//     .trans: elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4). A row address that is not
//     16-byte aligned, or whose 16 bytes are not in the block's shared memory (static or
//     dynamic), is a KernelError naming the call site and the lane;
//   - mma_16816<T>: D = A B + C for the 16 x 8 tile in float (products exact, sums in k order,
//     as for wmma::mma_sync) from the 32 lanes' registers; each lane's d[4] is C and then D.
namespace cupaged_cpu {

// True when [p, p + bytes) lies in the block's shared memory (runtime.h).
bool in_shared_memory(const void* p, size_t bytes);

inline unsigned short mma_bits(unsigned r, int half) {
  return static_cast<unsigned short>(r >> (16 * half));
}
inline float mma_element(unsigned short bits, const __half*) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
inline float mma_element(unsigned short bits, const __nv_bfloat16*) {
  return __uint_as_float(static_cast<unsigned>(bits) << 16);
}

// The error of a collective, formatted into a buffer of the OS thread (one collective completes
// at a time on it, and the runtime copies the text before anything else runs).
inline char* mma_message() {
  static thread_local char text[200];
  return text;
}

// request->fragment: the lane's registers; pointer: its row address; ldm: how many matrices
// (2 or 4); layout: 1 for .trans.
inline const char* complete_ldmatrix(WmmaRequest* const* lanes) {
  const unsigned count = lanes[0]->ldm;
  const int trans = lanes[0]->layout;
  for (int l = 1; l < 32; ++l) {
    if (lanes[l]->ldm != count || lanes[l]->layout != trans) {
      return "the lanes of the warp call different ldmatrix shapes (.x2 / .x4, .trans)";
    }
  }
  unsigned short m[4][8][8];  // [matrix][row][column]
  for (unsigned l = 0; l < 8 * count; ++l) {
    const void* row = lanes[l]->pointer;
    const char* problem = reinterpret_cast<uintptr_t>(row) % 16 != 0 ? "is not 16-byte aligned"
                          : !in_shared_memory(row, 16) ? "is not in the block's shared memory"
                                                       : nullptr;
    if (problem != nullptr) {
      snprintf(mma_message(), 200, ".x%u%s: lane %u's row address %p %s", count,
               trans ? ".trans" : "", l, row, problem);
      return mma_message();
    }
    memcpy(m[l / 8][l % 8], row, 16);
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, c = l % 4;
    unsigned* r = static_cast<unsigned*>(lanes[l]->fragment);
    for (unsigned i = 0; i < count; ++i) {
      const unsigned lo = trans ? m[i][2 * c][g] : m[i][g][2 * c];
      const unsigned hi = trans ? m[i][2 * c + 1][g] : m[i][g][2 * c + 1];
      r[i] = lo | hi << 16;
    }
  }
  return nullptr;
}

// request->fragment: the lane's float d[4]; a, b: its unsigned a[4] and b[2].
template <typename T>
const char* complete_mma_16816(WmmaRequest* const* lanes) {
  for (int l = 1; l < 32; ++l) {
    if (lanes[l]->complete != lanes[0]->complete) {
      return "the lanes of the warp call mma.sync with different operand types";
    }
  }
  const T* type = nullptr;
  float a[16][16], b[16][8], d[16][8];  // A: M x K, B: K x N, C then D: M x N
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, c = l % 4;
    const unsigned* ra = static_cast<const unsigned*>(lanes[l]->a);
    const unsigned* rb = static_cast<const unsigned*>(lanes[l]->b);
    const float* rd = static_cast<const float*>(lanes[l]->fragment);
    for (int h = 0; h < 2; ++h) {
      a[g][2 * c + h] = mma_element(mma_bits(ra[0], h), type);
      a[g + 8][2 * c + h] = mma_element(mma_bits(ra[1], h), type);
      a[g][2 * c + 8 + h] = mma_element(mma_bits(ra[2], h), type);
      a[g + 8][2 * c + 8 + h] = mma_element(mma_bits(ra[3], h), type);
      b[2 * c + h][g] = mma_element(mma_bits(rb[0], h), type);
      b[2 * c + 8 + h][g] = mma_element(mma_bits(rb[1], h), type);
      d[g][2 * c + h] = rd[h];
      d[g + 8][2 * c + h] = rd[2 + h];
    }
  }
  for (int row = 0; row < 16; ++row) {
    for (int col = 0; col < 8; ++col) {
      for (int k = 0; k < 16; ++k) d[row][col] += a[row][k] * b[k][col];
    }
  }
  for (int l = 0; l < 32; ++l) {  // every lane's C was read above
    const int g = l / 4, c = l % 4;
    float* rd = static_cast<float*>(lanes[l]->fragment);
    for (int h = 0; h < 2; ++h) {
      rd[h] = d[g][2 * c + h];
      rd[2 + h] = d[g + 8][2 * c + h];
    }
  }
  return nullptr;
}

inline void ldmatrix(unsigned* r, int count, bool trans, const void* row, const char* file,
                     int line) {
  WmmaRequest request{&complete_ldmatrix, r, nullptr, nullptr, nullptr, const_cast<void*>(row),
                      static_cast<unsigned>(count), trans ? 1 : 0};
  wmma_collective(kOpLdmatrix, &request, file, line);
}

template <typename T>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                      const char* file, int line) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                "mma_16816<T>: T is __half or __nv_bfloat16");
  WmmaRequest request{&complete_mma_16816<T>, d, a, b, nullptr, nullptr, 0, 0};
  wmma_collective(kOpMmaSync, &request, file, line);
}

}  // namespace cupaged_cpu
