// cached_helper.cuh: the value cached.cu writes (the cache test edits a copy of this file).
#pragma once

namespace cpu_test {

__device__ __forceinline__ int fill_value() { return 7; }

}  // namespace cpu_test
