// crt/host_defines.h, host-only stand-in for the CPU backend.
//
// The CUDA wheels (nvidia-cuda-runtime-cu12, nvidia-cuda-runtime for CUDA 13) ship vector_types.h
// and cuda_fp16.h but not the compiler-internal crt/ folder, which NVRTC supplies built in. This
// file is on the include path *after* the CUDA headers (-idirafter), so a full toolkit's own copy
// wins; it defines only what cuda_fp16.h, cuda_bf16.h, vector_types.h and vector_functions.h need
// when g++ compiles them as host code (__CUDACC__ undefined): the CUDA keywords expand to nothing.
#ifndef __HOST_DEFINES_H__
#define __HOST_DEFINES_H__

#define __no_return__ __attribute__((noreturn))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __inline_hint__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __maxnreg__(a)
#define __local_maxnreg__(a)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a)
#define __location__(a)
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __specialization_static
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __block_size__(...)
#define __grid_constant__
#define __host__
#define __device__
#define __global__
#define __shared__
#define __constant__
#define __managed__
#define __nv_pure__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __CUDA_ARCH_HAS_FEATURE__(_FEAT) 0

#endif  // __HOST_DEFINES_H__
