// 16 fp32 lanes as GCC's vector extension, for the attention ops (causal_attention.cpp,
// paged_decode.cpp): each operation is the scalar one lane by lane, whatever registers a path
// keeps them in (one AVX-512, two AVX2, four SSE); and each path's broadcast and fused
// multiply-add (a * b + c rounded once), so that loops written once give the same bits on
// every path.
//
// The broadcast and the fused multiply-add are a path's own functions (Fma* below, passed to
// the loops as a template argument): GCC lowers a vector built from a scalar in code of no
// target lane by lane, and has no generic vector fused multiply-add. They are inline with
// their path's target, not always_inline, and the per-path entry points that call the loops
// are `flatten`: inlined there, where the target matches.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "common.h"
#include "isa.h"

namespace qinfer_kernels {

constexpr int kLanes = 16;

typedef float F16 __attribute__((vector_size(64)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));

QINFER_INLINE F16 load16(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
QINFER_INLINE void store16(float* p, F16 v) { std::memcpy(p, &v, sizeof v); }

struct FmaScalar {
  static QINFER_INLINE F16 splat(float x) {
    F16 v;
    for (int i = 0; i < kLanes; ++i) v[i] = x;
    return v;
  }
  static QINFER_INLINE F16 fma(F16 a, F16 b, F16 c) {
    for (int i = 0; i < kLanes; ++i) c[i] = std::fma(a[i], b[i], c[i]);
    return c;
  }
};

struct FmaAvx2 {
  QINFER_AVX2 static inline F16 splat(float x) {
    const F8 h = (F8)_mm256_set1_ps(x);
    F16 v;
    std::memcpy(&v, &h, sizeof h);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof h, &h, sizeof h);
    return v;
  }
  QINFER_AVX2 static inline F16 fma(F16 a, F16 b, F16 c) {
    F8 a2[2], b2[2], c2[2];
    std::memcpy(a2, &a, sizeof a);
    std::memcpy(b2, &b, sizeof b);
    std::memcpy(c2, &c, sizeof c);
    for (int h = 0; h < 2; ++h)
      c2[h] = (F8)_mm256_fmadd_ps((__m256)a2[h], (__m256)b2[h], (__m256)c2[h]);
    std::memcpy(&c, c2, sizeof c);
    return c;
  }
};

struct FmaAvx512 {
  QINFER_AVX512 static inline F16 splat(float x) { return (F16)_mm512_set1_ps(x); }
  QINFER_AVX512 static inline F16 fma(F16 a, F16 b, F16 c) {
    return (F16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
  }
};

}  // namespace qinfer_kernels
