// The int8 block kernels' scales (int8_q8.cpp, int8_blocks.cpp): one per block of B input
// columns, held as S = at::Half or float (each block's scale as it is; matmul.h's `kHalf`
// says why either), or S = int8_t: GGUF's Q6_K as the file holds it, an int8
// sub-scale sc per block of 16 and an fp16 super-scale d per 16 of them (256 columns), with
// its 6-bit values packed as q6.h says (`checked_values`). The
// kernels form d * sc in fp32 as they read a block: exact (an 11-bit significand times a
// 7-bit integer fits fp32's 24), so every output is the bits of an fp32 copy of the products,
// from the file's 6.56 bits a weight, not 10 (docs/KERNELS.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "matmul.h"
#include "q6.h"

namespace qinfer_kernels {

// Sub-scales per super-scale (Q6_K: 16 blocks of 16 columns), and the block size they take.
constexpr int64_t kSubScales = 16;
constexpr int64_t kSubBlock = 16;

template <typename S>
constexpr bool kSub = std::is_same_v<S, int8_t>;

// A weight's block scales: d (N, blocks), and for S = int8_t its super-scales (N, blocks / 16).
template <typename S>
struct BlockScales {
  const S* d;
  const at::Half* super;  // null unless kSub<S>
  // output column n's, of `blocks` blocks (for a tile to copy into its locals)
  QINFER_INLINE BlockScales column(int64_t n, int64_t blocks) const {
    if constexpr (kSub<S>) return {d + n * blocks, super + n * (blocks / kSubScales)};
    else return {d + n * blocks, nullptr};
  }
};

// Block b's scale as fp32, exactly (c10's half -> float: the scalar path needs no F16C).
template <typename S>
QINFER_INLINE float block_scale(const BlockScales<S>& s, int64_t b) {
  if constexpr (kSub<S>) return static_cast<float>(s.super[b / kSubScales]) * s.d[b];
  else return widen(s.d[b]);
}

// The same by F16C's one instruction, in the vector paths' functions.
template <typename S>
QINFER_AVX2 QINFER_INLINE float block_scale_f16c(const BlockScales<S>& s, int64_t b) {
  if constexpr (kSub<S>) return _cvtsh_ss(s.super[b / kSubScales].x) * s.d[b];
  else return widen_f16c(s.d[b]);
}

// Block b's scale in every lane.
template <typename S>
QINFER_AVX2 QINFER_INLINE __m256 splat8(const BlockScales<S>& s, int64_t b) {
  if constexpr (kSub<S>) return _mm256_set1_ps(block_scale_f16c(s, b));
  else return splat8(s.d + b);
}

// Blocks b.. b + n - 1's scales (n <= 8, reading exactly n) into 8 lanes, the rest zero. For
// int8 sub-scales b is a multiple of 8, so the n share one super-scale.
template <typename S>
QINFER_AVX2 QINFER_INLINE __m256 scales8(const BlockScales<S>& s, int64_t b, int64_t n) {
  if constexpr (kSub<S>) {
    int64_t bytes = 0;
    std::memcpy(&bytes, s.d + b, static_cast<size_t>(std::clamp<int64_t>(n, 0, 8)));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
    return _mm256_mul_ps(sc, _mm256_set1_ps(_cvtsh_ss(s.super[b / kSubScales].x)));
  } else {
    return scales8(s.d + b, n);
  }
}

// The 16 block scales of the super-block that starts at block b (a multiple of 16; K is a
// multiple of 256, so all 16 exist).
QINFER_VNNI QINFER_INLINE __m512 sub_scales16(const BlockScales<int8_t>& s, int64_t b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.d + b));
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  return _mm512_mul_ps(sc, _mm512_set1_ps(_cvtsh_ss(s.super[b / kSubScales].x)));
}

// prefetch_scales (matmul.h) for a tile's C columns of `blocks` scales each, and their
// super-scales.
template <int C, typename S>
inline void prefetch_scales(const BlockScales<S> (&s)[C], int64_t blocks) {
  const S* d[C];
  for (int c = 0; c < C; ++c) d[c] = s[c].d;
  prefetch_scales<C, S>(d, blocks);
  if constexpr (kSub<S>) {
    const at::Half* super[C];
    for (int c = 0; c < C; ++c) super[c] = s[c].super;
    prefetch_scales<C, at::Half>(super, blocks / kSubScales);
  }
}

// The scales d of a weight (N, K) in blocks of B = K / d's columns (shape checked by the op),
// and d_super, checked for `op`: d fp16 or fp32 with no d_super, or (Q6_K's) d int8 (N, K/16)
// with d_super fp16 (N, K/256). Returns d_super contiguous (undefined without it).
inline at::Tensor checked_super_scales(const char* op, const at::Tensor& d,
                                       const c10::optional<at::Tensor>& d_super, int64_t N,
                                       int64_t K) {
  if (d.scalar_type() != at::kChar) {
    TORCH_CHECK(!d_super.has_value(), op, ": d_super goes with int8 sub-scales, got scales of ",
                dtype_name(d.scalar_type()));
    return at::Tensor();
  }
  TORCH_CHECK(d.dim() == 2 && d.size(1) * kSubBlock == K && K % (kSubBlock * kSubScales) == 0,
              op, ": int8 sub-scales are (N, K/16) for a K that is a multiple of 256, got ",
              shape_str(d), " for K = ", K);
  TORCH_CHECK(d_super.has_value(), op, ": int8 sub-scales need d_super, (N, K/256) fp16");
  check_tensor(op, "d_super", *d_super, at::kHalf, N, K / (kSubBlock * kSubScales),
               [K] { return "(N, K/256) for x's K = " + std::to_string(K); });
  return d_super->contiguous();
}

// q of an int8 block weight (N rows) for x's K, checked for `op` beside its scales d: int8
// (N, K), or beside int8 sub-scales (Q6_K's, checked first: K a multiple of 256) the 6-bit
// values packed (q6.h) as uint8 (N, 3K/4). Returns q contiguous.
inline at::Tensor checked_values(const char* op, const at::Tensor& q, const at::Tensor& d,
                                 int64_t N, int64_t K) {
  const auto k = [K] { return "x's K = " + std::to_string(K); };
  if (d.scalar_type() == at::kChar) {
    check_tensor(op, "q", q, at::kByte, N, q6_row_bytes(K), [&] {
      return "(N, 3K/4), Q6_K's 6-bit values as kernels.pack_q6 packs them, for " + k();
    });
  } else {
    check_tensor(op, "q", q, at::kChar, N, K, [&] { return "(N, K) for " + k(); });
  }
  return q.contiguous();
}

// q's bytes as the kernels' weights hold them (int8 values, or Q6_K's packed bytes).
inline const int8_t* values_data(const at::Tensor& q) {
  return static_cast<const int8_t*>(q.data_ptr());
}

// d_super's data, or null (fp16 or fp32 scales: none)
inline const at::Half* super_data(const at::Tensor& d_super) {
  return d_super.defined() ? d_super.data_ptr<at::Half>() : nullptr;
}

// f(S{}) with S the scales' element type (at::Half, float or int8_t), as `with_scales`.
template <typename F>
void with_block_scales(const at::Tensor& d, F&& f) {
  if (d.scalar_type() == at::kChar) {
    f(int8_t{});
  } else {
    with_scales(d, f);
  }
}

}  // namespace qinfer_kernels
