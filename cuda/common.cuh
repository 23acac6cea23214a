// common.cuh: helpers shared by every cupaged kernel family.
//
// Included by the kernel files (write_kv, copy_blocks, paged attention). Self-contained: only the
// CUDA half/bfloat16/fp8 headers, no standard-library headers (NVRTC and the CPU backend both
// build it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline_primitives.h>  // cp.async; the CPU backend emulates it (docs/cpu_backend.md)

// Dynamic shared memory, declared inside a kernel body: `CUPAGED_DYNAMIC_SHARED(float, smem);`,
// 16-byte aligned (cp.async, 16-byte vectors); `CUPAGED_DYNAMIC_SHARED_ALIGNED(T, smem, 32)` for
// WMMA, whose fragment loads and stores take 256-bit aligned tiles. On the GPU it is the launch's
// `extern __shared__` buffer; the CPU backend hands out a per-worker buffer (128-byte aligned),
// poisoned with NaNs before each thread block, so reading what nothing wrote shows up.
#ifdef CUPAGED_CPU
#define CUPAGED_DYNAMIC_SHARED_ALIGNED(type, name, alignment) \
  type* name = reinterpret_cast<type*>(cupaged_cpu_dynamic_shared())
#else
#define CUPAGED_DYNAMIC_SHARED_ALIGNED(type, name, alignment)            \
  extern __shared__ __align__(alignment) unsigned char name##_bytes[]; \
  type* name = reinterpret_cast<type*>(name##_bytes)
#endif
#define CUPAGED_DYNAMIC_SHARED(type, name) CUPAGED_DYNAMIC_SHARED_ALIGNED(type, name, 16)

namespace cupaged {

// Integer division rounding up: blocks for n tokens, thread blocks for n items. The int form
// needs n + d - 1 < 2^31; lengths that may come near it (a decode plan's unchecked lengths) take
// the 64-bit one.
__host__ __device__ __forceinline__ int ceil_div(int n, int d) { return (n + d - 1) / d; }
__host__ __device__ __forceinline__ long long ceil_div(long long n, long long d) {
  return (n + d - 1) / d;
}

// ---- Attention variants (docs/variants.md; cupaged/variants.py names the same bits) ---------
// A kernel's VARIANT template argument is a set of these bits; what is off compiles away. For a
// query at position i, a key at position j and query head h:
//   s = scale * q.k;  kSoftCap: s = cap * tanh(s / cap);  kAlibi: s += slopes[h] * (j - i);
//   kWindow: keys j < i - window_left are not attended;
//   kSinks: the softmax denominator gains exp(sinks[h] - m), m = max(max_j s_j, sinks[h]).
// A query that sees no key gets a zero row, with or without a sink.
constexpr int kWindow = 1;
constexpr int kSoftCap = 2;
constexpr int kAlibi = 4;
constexpr int kSinks = 8;

// A kernel with variants takes their values as four trailing arguments, in this order:
//   int window_left, float soft_cap, const float* alibi_slopes, const float* sinks
// ([num_q_heads] each); a pointer is read only when its bit is set, and the host passes some
// valid array otherwise, never null.

// A score after soft-cap and ALiBi (the window is the caller's bound, the sink its merge's).
// `distance` is j - i (<= 0 for a causal key).
template <int VARIANT>
__device__ __forceinline__ float variant_score(float s, float soft_cap, float slope,
                                               int distance) {
  if (VARIANT & kSoftCap) s = soft_cap * tanhf(s / soft_cap);
  if (VARIANT & kAlibi) s += slope * static_cast<float>(distance);
  return s;
}

// The query heads of one decode thread block. A GQA group of G heads is cut into head_chunks =
// ceil(G / CHUNK) chunks of CHUNK heads (the last may be short), one thread block each, so that a
// block's q rows and accumulators fit its registers whatever G is; gridDim.x enumerates
// (KV head, chunk) pairs, x = kv_head * head_chunks + chunk. With G <= CHUNK: one chunk, x = kv_head.
struct DecodeChunk {
  int kv_head;     // the KV head the block reads
  int first_head;  // its first query head, kv_head * G + chunk * CHUNK
  int heads;       // the chunk's query heads, min(CHUNK, G - chunk * CHUNK)
  __device__ __forceinline__ DecodeChunk(int block_x, int group, int chunk_heads) {
    const int chunks = ceil_div(group, chunk_heads);
    kv_head = block_x / chunks;
    const int first = block_x % chunks * chunk_heads;
    first_head = kv_head * group + first;
    heads = min(chunk_heads, group - first);
  }
};

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

// ---- fp8 caches (docs/fp8.md; cupaged/dtypes.py names the same types) -----------------------
// A cache of element type __nv_fp8_e4m3 (OCP E4M3, max 448) or __nv_fp8_e5m2 (max 57344) holds
// each K (V) element of KV head h as fp8(x / k_scale(h)); a kernel reads x back as
// float(stored) * k_scale(h), applying the scale once per score (K) or per output row (V), never
// per element. The query and the output are never fp8. A kernel that reads or writes an fp8
// cache takes the scales as six arguments, after its own and before the variants' four:
//   float k_scale, float v_scale, const float* k_scales, const float* v_scales,
//   int k_scale_stride, int v_scale_stride
// and the scale of KV head h is k_scale * k_scales[h * k_scale_stride] (head_scale below): a
// host float comes as the value over an array of 1.0, a device array as 1.0 over itself, with
// stride 0 for one scale ([] or [1]) and 1 for one per KV head ([num_kv_heads]). The arrays are
// real float32 arrays, never null; a kernel of a 16/32-bit cache never reads them.
template <typename T>
struct IsFp8 {
  static constexpr bool value = false;
};
template <>
struct IsFp8<__nv_fp8_e4m3> {
  static constexpr bool value = true;
  static constexpr __nv_fp8_interpretation_t kFormat = __NV_E4M3;
};
template <>
struct IsFp8<__nv_fp8_e5m2> {
  static constexpr bool value = true;
  static constexpr __nv_fp8_interpretation_t kFormat = __NV_E5M2;
};

// The scale of KV head `head` (see above).
__device__ __forceinline__ float head_scale(float value, const float* __restrict__ scales,
                                            int stride, int head) {
  return value * __ldg(scales + head * stride);
}

// Two fp8 bytes of KV (the low one first) as two halves, exactly: every fp8 value is an fp16
// value (e4m3's subnormals are fp16 normals; e5m2's infinities stay infinities); NaN stays NaN,
// its bits aside. From sm_89 one cvt.f16x2 does it (cuda_fp8.h). Below sm_89 cuda_fp8.h's
// conversion normalizes each subnormal in a loop (on sm_80, e4m3: 12 bytes of spills in
// paged_decode_mma at head_dim 112 and 128, 5-6x the instructions in its stage loop), so sm_80
// and the CPU backend (which compiles without __CUDA_ARCH__; tests/attention/
// test_fp8_conversion.py checks this path on every code) take bit operations and one exact
// multiply instead:
//   e5m2 is an fp16's high byte: byte << 8.
//   e4m3: sign | (byte & 0x7f) << 7 reads the exponent (bias 7) as fp16's (bias 15) and the
//   mantissa as fp16's top 3 bits: the value times 2^-8, subnormals too (the same bits, 8
//   binades down), so one HMUL2 by 2^8 restores it. The NaN code 0x7f (0x3f80 after the shift,
//   480 after the multiply) first gets the exponent's top bit: 0x7f80, an fp16 NaN.
template <typename KV>
__device__ __forceinline__ __half2 fp8x2_to_half2(unsigned short pair) {
  static_assert(IsFp8<KV>::value, "fp8 bytes only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __half2(__nv_cvt_fp8x2_to_halfraw2(pair, IsFp8<KV>::kFormat));
#else
  const unsigned high_bytes = __byte_perm(pair, 0u, 0x1404u);  // byte 0 << 8 | byte 1 << 24
  if (IsFp8<KV>::kFormat == __NV_E5M2) return *reinterpret_cast<const __half2*>(&high_bytes);
  const unsigned magnitude = high_bytes >> 1 & 0x3f803f80u;
  const unsigned nan = (magnitude + 0x00800080u) & 0x40004000u;  // 0x4000 only from 0x3f80
  const unsigned scaled = (high_bytes & 0x80008000u) | magnitude | nan;
  const unsigned two_to_8 = 0x5c005c00u;  // 256.0 in both halves
  return __hmul2(*reinterpret_cast<const __half2*>(&scaled),
                 *reinterpret_cast<const __half2*>(&two_to_8));
#endif
}

__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) {
  return __low2float(fp8x2_to_half2<__nv_fp8_e4m3>(x.__x));
}
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) {
  return __low2float(fp8x2_to_half2<__nv_fp8_e5m2>(x.__x));
}
// float -> fp8: nearest, ties to even, saturated to +-max (infinities too); NaN stays NaN (the
// byte 0x7F). The CPU backend runs the header's host conversion, the same function bit for bit;
// cupaged.dtypes.float_to_fp8_bits is its array-op oracle.
template <>
__device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return r;
}
template <>
__device__ __forceinline__ __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) {
  __nv_fp8_e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
  return r;
}

// Two fp8 bytes (the low one first) as two floats, through one fp8x2 -> half2 conversion.
template <typename T>
__device__ __forceinline__ float2 fp8x2_to_float2(unsigned short pair) {
  return __half22float2(fp8x2_to_half2<T>(pair));
}

// The 4N fp8 bytes of `words` as 4N floats, two per conversion.
template <typename T, int N>
__device__ __forceinline__ void fp8_words_as_float(const unsigned (&words)[N], float* out) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float2 lo = fp8x2_to_float2<T>(static_cast<unsigned short>(words[i] & 0xffffu));
    const float2 hi = fp8x2_to_float2<T>(static_cast<unsigned short>(words[i] >> 16));
    out[4 * i] = lo.x;
    out[4 * i + 1] = lo.y;
    out[4 * i + 2] = hi.x;
    out[4 * i + 3] = hi.y;
  }
}

// Two fp8 bytes (the low one first) as two elements of the 16-bit type of a tensor-core tile,
// packed as they lie in memory. Exact: every value of both fp8 formats is an fp16 and a bf16 value.
template <typename KV>
__device__ __forceinline__ unsigned fp8x2_as_pair(unsigned pair, const __half*) {
  const __half2 h = fp8x2_to_half2<KV>(static_cast<unsigned short>(pair));
  return *reinterpret_cast<const unsigned*>(&h);
}
template <typename KV>
__device__ __forceinline__ unsigned fp8x2_as_pair(unsigned pair, const __nv_bfloat16*) {
  const float2 f = fp8x2_to_float2<KV>(static_cast<unsigned short>(pair));
  const __nv_bfloat16 lo = __float2bfloat16_rn(f.x);
  const __nv_bfloat16 hi = __float2bfloat16_rn(f.y);
  return static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&lo)) |
         static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(&hi)) << 16;
}

// Over fp8, the conversion pass of one stage of the tensor-core kernels (paged_decode_mma,
// cascade_shared): the ring's K and V rows ([TILE, HEAD_DIM] of KV each) into the T tiles
// ([TILE, LDK]) that the WMMA loads read, 8 elements per step (an LDS.64 and an STS.128), steps
// spread over the block's threads.
template <typename T, int HEAD_DIM, int TILE, int LDK, int THREADS, typename KV>
__device__ __forceinline__ void convert_stage(const KV* k_src, const KV* v_src, T* k_dst,
                                              T* v_dst, int tid) {
  constexpr int kRowUnits = HEAD_DIM / 8;
#pragma unroll 1  // a rolled loop: unrolled, the bf16 tiles spill on sm_80 at head_dim 128
  for (int k = 0; k < TILE * kRowUnits / THREADS; ++k) {
    const int j = tid + k * THREADS;
    const int src = j / kRowUnits * HEAD_DIM + j % kRowUnits * 8;
    const int dst = j / kRowUnits * LDK + j % kRowUnits * 8;
    const uint2 k_raw = *reinterpret_cast<const uint2*>(k_src + src);
    const uint2 v_raw = *reinterpret_cast<const uint2*>(v_src + src);
    *reinterpret_cast<uint4*>(k_dst + dst) =
        make_uint4(fp8x2_as_pair<KV>(k_raw.x & 0xffffu, k_dst), fp8x2_as_pair<KV>(k_raw.x >> 16, k_dst),
                   fp8x2_as_pair<KV>(k_raw.y & 0xffffu, k_dst), fp8x2_as_pair<KV>(k_raw.y >> 16, k_dst));
    *reinterpret_cast<uint4*>(v_dst + dst) =
        make_uint4(fp8x2_as_pair<KV>(v_raw.x & 0xffffu, v_dst), fp8x2_as_pair<KV>(v_raw.x >> 16, v_dst),
                   fp8x2_as_pair<KV>(v_raw.y & 0xffffu, v_dst), fp8x2_as_pair<KV>(v_raw.y >> 16, v_dst));
  }
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

// fp8: the 16 bytes at p as 16 floats, and the 8 bytes at p (8-byte aligned) as 8 floats, for a
// kernel whose lanes own 8 elements of a row (an LDS.64 of a 16-byte staged copy).
__device__ __forceinline__ void load16_as_float(const __nv_fp8_e4m3* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  fp8_words_as_float<__nv_fp8_e4m3>(words, out);
}
__device__ __forceinline__ void load16_as_float(const __nv_fp8_e5m2* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  fp8_words_as_float<__nv_fp8_e5m2>(words, out);
}
template <typename T>
__device__ __forceinline__ void load8_as_float(const T* p, float* out) {
  static_assert(IsFp8<T>::value, "8-byte loads of fp8 only");
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const unsigned words[2] = {raw.x, raw.y};
  fp8_words_as_float<T>(words, out);
}

// Choose<c, A, B>::type: A if c, else B (no <type_traits> here).
template <bool C, typename A, typename B>
struct Choose {
  using type = A;
};
template <typename A, typename B>
struct Choose<false, A, B> {
  using type = B;
};

// ---- The K/V staging ring -------------------------------------------------------------------
// How every attention kernel (paged_decode, paged_decode_mma, paged_prefill, paged_prefill_mma)
// moves K and V to shared memory: the rows of TILE consecutive tokens of a range [begin, end)
// (a stage; the last one may be short) pass through a ring of STAGES shared-memory slots, stage i
// in slot i % STAGES, so that the copies of the next stages are in flight while one computes:
//
//   k_s + s * SLOT   K rows of slot s: [TILE, LD] of T, LD >= HEAD_DIM (a kernel pads its rows)
//   v_s + s * SLOT   V rows of slot s, the same shape (where v_s lies is the kernel's choice)
//
// Every thread copies the same 16-byte vectors of every stage: copy k (k < kLoads) is vector
// j = tid + k * THREADS of the stage's TILE * kRowVectors, row j / kRowVectors, vector
// j % kRowVectors of the row. Per stage:
//   fetch(i)   the block ids of this thread's rows of stage i, from the block table, one stage
//              before the stage is issued (they land while the stage before computes, so no copy
//              waits on a table read); -1 for a row past `end` (the table is not read there);
//   issue(i)   the 16-byte cp.async copies of stage i, committed as batches. SPLIT_KV: all of
//              K's as one batch, then all of V's as another (the scores can start as soon as K
//              has landed); a row past `end` is a zero-filled copy that reads nothing. Otherwise
//              K's and V's copy by copy, one batch; a row past `end` is zeroed by plain 16-byte
//              stores (seen after the same wait and barrier as the copies). A stage past the last
//              commits its batches empty, so that the wait counts below hold to the end;
//   start()    the prologue: issue stages 0 .. STAGES - 2, fetch stage STAGES - 1;
//   refill(i)  issue(i + STAGES - 1) into the slot that stage i - 1 has freed, fetch(i + STAGES).
// A kernel's loop over the stages:
//
//   ring.start();
//   for (int i = 0; i < ring.num_stages; ++i) {
//     Ring::wait_k();    // before refill(i): this thread's copies of K of stage i have landed
//     __syncthreads();   // every thread's have; every thread is done with slot (i - 1) % STAGES
//     ring.refill(i);
//     ... K of stage i from ring.k_row(i, 0) on ...
//     Ring::wait_v();    // after refill(i): V of stage i; then __syncthreads() before reading it
//     ... V of stage i from ring.v_row(i, 0) on ...
//   }
//   __pipeline_wait_prior(0);  // only empty batches are left; nothing lands after the loop
//
// (Ring::wait_kv() before refill(i) lands K and V of stage i at once; without SPLIT_KV it is the
// only wait.) HOIST keeps each copy's row and vector in registers for the whole loop; without it
// they are recomputed from tid where used, for a kernel at its register limit.
//
// The two forms (SPLIT_KV or not, HOIST or not) also differ in details that change no result:
// each is the form in which NVRTC compiles its kernels as it compiled their own copies of the
// ring (registers, spills, loop loads; scripts/kernel-report), and a rewrite that "unifies" them
// moves ptxas's register counts by up to 10 either way. Cache offsets: SPLIT_KV, an unsigned
// 32 x 32 -> 64-bit multiply per row (a block holds num_kv_heads * BLOCK_SIZE * HEAD_DIM < 2^32
// elements, which the launch table checks); otherwise 64-bit arithmetic.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int TILE, int STAGES, int THREADS,
          bool SPLIT_KV, bool HOIST = true, int LD = HEAD_DIM, int SLOT = TILE * LD>
struct KvRing {
  using Stride = typename Choose<SPLIT_KV, unsigned, long long>::type;  // of the cache offsets
  static constexpr int kVec = Vec16<T>::kElems;
  static constexpr int kRowVectors = HEAD_DIM / kVec;       // 16-byte copies per K/V row
  static constexpr int kStageVectors = TILE * kRowVectors;  // 16-byte copies per K stage
  static constexpr int kLoads = (kStageVectors + THREADS - 1) / THREADS;  // per thread
  static constexpr bool kExact = kStageVectors % THREADS == 0;  // every thread copies kLoads
  static_assert(HEAD_DIM % kVec == 0 && LD % kVec == 0, "rows of whole 16-byte vectors");
  static_assert(LD >= HEAD_DIM && SLOT >= TILE * LD && SLOT % LD == 0, "slots of whole rows");
  static_assert(STAGES >= 2 && 2 * STAGES - 2 <= 8, "the waits count at most 8 batches");

  // Batches committed at the top of stage i: those of stages 0 .. i + STAGES - 2.
  __device__ static __forceinline__ void wait_kv() {
    __pipeline_wait_prior(SPLIT_KV ? 2 * STAGES - 4 : STAGES - 2);
  }
  __device__ static __forceinline__ void wait_k() {
    static_assert(SPLIT_KV, "K lands apart from V only in batches of its own");
    __pipeline_wait_prior(2 * STAGES - 3);
  }
  // After refill(i): two batches more.
  __device__ static __forceinline__ void wait_v() {
    static_assert(SPLIT_KV, "V lands apart from K only in batches of its own");
    __pipeline_wait_prior(2 * STAGES - 2);
  }

  // table: the sequence's row of the block table; [begin, end): the tokens to stage (begin < end).
  __device__ __forceinline__ KvRing(T* k_s, T* v_s, const T* k_cache, const T* v_cache,
                                    const int* table, int num_kv_heads, int kv_head, int begin,
                                    int end, int tid)
      : k_s(k_s),
        v_s(v_s),
        k_cache(k_cache),
        v_cache(v_cache),
        table(table),
        block_stride(static_cast<Stride>(num_kv_heads) * BLOCK_SIZE * HEAD_DIM),
        head_offset(static_cast<Stride>(kv_head) * BLOCK_SIZE * HEAD_DIM),
        begin(begin),
        end(end),
        num_stages(ceil_div(end - begin, TILE)),
        tid(tid) {
    if constexpr (HOIST) {
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int j = tid + k * THREADS;
        rows[k] = SPLIT_KV || j < kStageVectors ? j / kRowVectors : -1;  // multiply and shift
        vecs[k] = SPLIT_KV ? j % kRowVectors * kVec : j % kRowVectors;
      }
    }
  }

  // Row `row` of the K (V) rows of stage `stage`, in shared memory.
  __device__ __forceinline__ T* k_row(int stage, int row) const {
    return k_s + (stage % STAGES * (SLOT / LD) + row) * LD;
  }
  __device__ __forceinline__ T* v_row(int stage, int row) const {
    return v_s + (stage % STAGES * (SLOT / LD) + row) * LD;
  }

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int stage = 0; stage < STAGES - 1; ++stage) {
      if (SPLIT_KV || stage < num_stages) {  // uniform over the block
        fetch(stage);
        issue(stage);
      } else {
        __pipeline_commit();
      }
    }
    if (SPLIT_KV || STAGES - 1 < num_stages) fetch(STAGES - 1);
  }

  __device__ __forceinline__ void refill(int stage) {
    if constexpr (SPLIT_KV) {  // a stage past the last goes through issue, its copies off
      issue(stage + STAGES - 1);
      fetch(stage + STAGES);
    } else if (stage + STAGES - 1 < num_stages) {  // uniform over the block
      issue(stage + STAGES - 1);
      if (stage + STAGES < num_stages) fetch(stage + STAGES);
    } else {
      __pipeline_commit();
    }
  }

  T* k_s;
  T* v_s;
  const T* k_cache;
  const T* v_cache;
  const int* table;
  Stride block_stride;  // elements of one block of the cache
  Stride head_offset;   // elements from a block to its KV head
  int begin;
  int end;
  int num_stages;
  int tid;
  // With HOIST, copy k's row (-1 past the stage, without SPLIT_KV) and vector (with SPLIT_KV,
  // its first element in the row), fixed for the whole loop: only the block ids change.
  int rows[HOIST ? kLoads : 1];
  int vecs[HOIST ? kLoads : 1];
  int block[kLoads];  // ids of the next stage to issue, loaded one stage ahead; -1: none

 private:
  __device__ __forceinline__ int row(int k) const {
    if constexpr (HOIST) {
      return rows[k];
    } else {
      return (tid + k * THREADS) / kRowVectors;
    }
  }
  // The first element of copy k in its row.
  __device__ __forceinline__ int col(int k) const {
    if constexpr (!HOIST) {
      return (tid + k * THREADS) % kRowVectors * kVec;
    } else if constexpr (SPLIT_KV) {
      return vecs[k];
    } else {
      return vecs[k] * kVec;
    }
  }
  // Copy k is one of the stage's (the last one may lie past the stage when !kExact).
  __device__ __forceinline__ bool mine(int k) const {
    if constexpr (SPLIT_KV) {
      return kExact || k < kLoads - 1 || tid + k * THREADS < kStageVectors;
    } else if constexpr (HOIST) {
      return rows[k] >= 0;
    } else {
      return tid + k * THREADS < kStageVectors;
    }
  }

  __device__ __forceinline__ void fetch(int stage) {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int pos = begin + stage * TILE + row(k);
      const unsigned entry = static_cast<unsigned>(pos) / BLOCK_SIZE;
      block[k] = mine(k) && pos < end ? __ldg(table + entry) : -1;
    }
  }

  __device__ __forceinline__ void issue(int stage) {
    if constexpr (SPLIT_KV) {
      issue_apart(stage);
    } else {
      issue_together(stage);
    }
  }

  // All of K, one batch, then all of V, another, from the same offsets.
  __device__ __forceinline__ void issue_apart(int stage) {
    unsigned long long src[kLoads];
    T* dst[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const unsigned pos = static_cast<unsigned>(begin + stage * TILE + row(k));
      src[k] = static_cast<unsigned long long>(block[k] < 0 ? 0 : block[k]) * block_stride +
               head_offset + (pos % BLOCK_SIZE) * HEAD_DIM + col(k);  // block 0: never read
      dst[k] = k_row(stage, row(k)) + col(k);
    }
    const bool live = stage < num_stages;  // uniform over the block
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      if (live && mine(k)) copy16_async(dst[k], k_cache + src[k], block[k] >= 0);
    }
    __pipeline_commit();
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      if (live && mine(k)) copy16_async(dst[k] + (v_s - k_s), v_cache + src[k], block[k] >= 0);
    }
    __pipeline_commit();
  }

  // K and V copy by copy, one batch (stage < num_stages).
  __device__ __forceinline__ void issue_together(int stage) {
    T* k_dst = k_row(stage, 0);
    T* v_dst = v_row(stage, 0);
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      if (!mine(k)) continue;
      const int pos = begin + stage * TILE + row(k);
      const int dst = row(k) * LD + col(k);
      if (block[k] >= 0) {
        const long long src = block[k] * block_stride + head_offset +
                              static_cast<long long>(pos % BLOCK_SIZE) * HEAD_DIM + col(k);
        __pipeline_memcpy_async(k_dst + dst, k_cache + src, 16);
        __pipeline_memcpy_async(v_dst + dst, v_cache + src, 16);
      } else {
        *reinterpret_cast<uint4*>(k_dst + dst) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(v_dst + dst) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __pipeline_commit();
  }
};

}  // namespace cupaged
