// common.cuh: helpers shared by every cupaged kernel family.
//
// Included by the kernel files (write_kv, copy_blocks, paged attention). Self-contained: only the
// CUDA half/bfloat16 headers, no standard-library headers (NVRTC and the CPU backend both build it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline_primitives.h>  // cp.async; the CPU backend emulates it (docs/cpu_backend.md)

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

// ---- 16-byte vectors: asynchronous staging and conversion in pairs --------------------------
// Shared by the attention kernels: K/V rows are staged into shared memory 16 bytes per copy, then
// read back 16 bytes per lane (LDS.128) and widened to float32. 16-bit types convert two elements
// per instruction (__half22float2 / __bfloat1622float2), never one 16-bit load at a time.

// Elements of T in one 16-byte vector: 8 for __half and __nv_bfloat16, 4 for float.
template <typename T>
struct Vec16 {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

// One 16-byte asynchronous copy global -> shared (cp.async.cg), or 16 zero bytes when !valid: then
// nothing is read, but src must still be a 16-byte-aligned global address (pass the array's base).
// Completes at the __pipeline_wait_prior that covers the batch it is committed in; until then the
// destination is undefined (poison on the CPU backend).
__device__ __forceinline__ void copy16_async(void* dst_shared, const void* src_global, bool valid) {
  __pipeline_memcpy_async(dst_shared, src_global, 16, valid ? 0 : 16);
}

// The 16 bytes at p (16-byte aligned, any memory space) as Vec16<T>::kElems floats.
__device__ __forceinline__ void load16_as_float(const float* p, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
__device__ __forceinline__ void load16_as_float(const __half* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load16_as_float(const __nv_bfloat16* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

}  // namespace cupaged
