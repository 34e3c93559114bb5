// 16 fp32 lanes as GCC's vector extension, for the attention ops (paged_decode.cpp,
// causal_attention.cpp): each operation is the scalar one lane by lane, whatever registers a
// path keeps them in (one AVX-512, two AVX2, four SSE).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace qinfer_kernels {

constexpr int64_t kLanes = 16;

typedef float F16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));

QINFER_INLINE F16 load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
QINFER_INLINE void store16(float* p, F16 v) { std::memcpy(p, &v, sizeof v); }

}  // namespace qinfer_kernels
