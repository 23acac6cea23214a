// common.cuh: helpers shared by every cupaged kernel family.
//
// Included by the kernel files (write_kv, copy_blocks, paged attention). Self-contained: only the
// CUDA half/bfloat16 headers, no standard-library headers (NVRTC and the CPU backend both build it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Dynamic shared memory, declared inside a kernel body: `CUPAGED_DYNAMIC_SHARED(float, smem);`.
// On the GPU it is the launch's `extern __shared__` buffer; the CPU backend hands out a per-worker
// buffer, poisoned with NaNs before each thread block, so reading what nothing wrote shows up.
#ifdef CUPAGED_CPU
#define CUPAGED_DYNAMIC_SHARED(type, name) \
  type* name = reinterpret_cast<type*>(cupaged_cpu_dynamic_shared())
#else
#define CUPAGED_DYNAMIC_SHARED(type, name)                    \
  extern __shared__ __align__(16) unsigned char name##_bytes[]; \
  type* name = reinterpret_cast<type*>(name##_bytes)
#endif

namespace cupaged {

// Integer division rounding up: blocks for n tokens, thread blocks for n items.
__host__ __device__ __forceinline__ int ceil_div(int n, int d) { return (n + d - 1) / d; }

// Element offset of (block, head, slot, 0) in one layer of the cache,
//   [num_blocks, num_kv_heads, block_size, head_dim]  (HND: a head's tokens of a block are contiguous).
// 64-bit because a single layer can exceed 2^31 elements (e.g. 65,536 blocks * 8 heads * 16 * 256).
__host__ __device__ __forceinline__ long long cache_offset(int block, int head, int slot,
                                                           int num_kv_heads, int block_size,
                                                           int head_dim) {
  return ((static_cast<long long>(block) * num_kv_heads + head) * block_size + slot) *
         static_cast<long long>(head_dim);
}

// -infinity without <cmath> (NVRTC and the CPU backend take no standard headers).
__device__ __forceinline__ float neg_inf() {
  return __int_as_float(static_cast<int>(0xff800000u));
}

// Conversions between the storage types and float32, the accumulation type of every kernel.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace cupaged
