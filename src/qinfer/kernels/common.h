// What the kernel sources share: bf16 <-> fp32 as torch converts them, an AVX2 register's
// sum, exp in fp32 operations, a tensor's shape as the error messages print it, and a
// pool's checked slots.
#pragma once

#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "isa.h"

namespace qinfer_kernels {

// Always inlined: a caller compiled for a wider ISA (a QINFER_AVX2, QINFER_AVX512 or
// QINFER_VNNI function) gets the code compiled in, not a call to the baseline build of it.
#define QINFER_INLINE inline __attribute__((always_inline))

// Every accumulator of a tile (C columns by R rows of vectors V) at zero.
template <int C, int R, typename V>
QINFER_INLINE void clear(V (&acc)[C][R]) {
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = V{};
}

// bf16 -> fp32, exact.
QINFER_INLINE float widen_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 8 / 16 consecutive fp32 values as fp32 lanes, or bf16 ones (their bits as uint16_t)
// widened exactly.
QINFER_AVX2 QINFER_INLINE __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
QINFER_AVX2 QINFER_INLINE __m256 load8_f32(const uint16_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
QINFER_AVX512 QINFER_INLINE __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
QINFER_AVX512 QINFER_INLINE __m512 load16_f32(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// torch's float -> bfloat16 (c10::detail::round_to_nearest_even): NaN to 0x7FC0.
inline uint16_t round_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// 8 lanes -> 4 -> 2 -> 1, a fixed tree
QINFER_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) in plain fp32 operations, so that a loop of it vectorises (libm's exp is a call per
// element) and every path computes the same bits: Cody-Waite reduction (x = k ln2 + r, ln2
// in two parts) and a degree-6 polynomial, 2^k built in the exponent's bits; within 2 ulp
// of exp on [-87.3, 88], x clamped to it (2^-126 at and below its bottom).
QINFER_INLINE float exp_fp32(float x) {
  x = x < -87.33654f ? -87.33654f : x;
  x = x > 88.0f ? 88.0f : x;
  const float k = std::nearbyint(x * 1.44269504f);  // round(x / ln 2)
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-06f;  // x - k ln 2
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k, k in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// "(2, 3)", "(5,)": a shape as Python prints it
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + (t.dim() == 1 ? ",)" : ")");
}

// Each named tensor fp32 on the CPU, checked for `op` (one line naming the first that is not).
inline void check_fp32_cpu(
    const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_cpu(), op, ": ", name,
                " must be fp32 on the CPU, got ", t->scalar_type(), " on ", t->device().str());
}

// slots (S,) int64, contiguous, on the CPU, each a row of a pool of P rows, checked for
// `op` (one line per refusal; `pools` names the pool in it); returns them.
inline std::vector<int64_t> checked_slots(const char* op, const at::Tensor& slots, int64_t S,
                                          int64_t P, const char* pools = "pool's") {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == S && slots.scalar_type() == at::kLong &&
                  slots.is_cpu() && slots.is_contiguous(),
              op, ": slots must be contiguous (", S, ",) int64 on the CPU, got ",
              shape_str(slots), " ", slots.scalar_type());
  std::vector<int64_t> rows(S);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    rows[s] = slot[s];
    TORCH_CHECK(0 <= rows[s] && rows[s] < P, op, ": slot ", rows[s], " of sequence ", s,
                " is outside the ", pools, " ", P, " rows");
  }
  return rows;
}

}  // namespace qinfer_kernels
