// Activations rounded to int8 per block of 32 (q8.h's `Act`), each path with its own ISA,
// every path to the same bits; the op quantize_q8_1 returns them as the tests' reference
// reads them. docs/KERNELS.md says how they are rounded.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "matmul.h"
#include "ops.h"
#include "q8.h"

namespace qinfer_kernels {
namespace {

// The scale of one block: dx = amax / 127 and its reciprocal, computed in scalar code by
// every quantizer so that the paths quantize bit for bit alike. x * (1 / dx) rather than
// x / dx, as llama.cpp's quantize_row_q8_1 does.
inline void block_scale(float amax, float* dx, float* id) {
  *dx = amax / 127.0f;
  *id = *dx != 0.0f ? 1.0f / *dx : 0.0f;
}

// Round to nearest even by the MXCSR rounding (as the vector conversions round), NaN and
// out-of-range values to INT_MIN as they do, so scalar and vector quantizers agree.
inline int32_t round_ss(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }


// Writes a block's scale into dx8 and s, and the optional natural-order outputs.
inline void store_block(const Act& a, int64_t r, int64_t b, float dx, int32_t sum, float* dx_out,
                        int32_t* sum_out) {
  float* dx8 = a.row_dx8(r) + dx8_pos(b);
  for (int i = 0; i < 4; ++i) dx8[i] = dx;
  a.row_s(r)[b] = dx * static_cast<float>(sum);
  if (dx_out) dx_out[b] = dx;
  if (sum_out) sum_out[b] = sum;
}

// Zeros what a row holds beyond its nb blocks: the second block of an odd last pair (a
// kernel reads the whole pair) and s up to nbs. The buffers are reused between calls.
inline void pad_row(const Act& a, int64_t r) {
  if (a.nb & 1) {
    std::memset(a.row_qx(r) + (a.np - 1) * 64 + 32, 0, 32);
    float* dx8 = a.row_dx8(r) + (a.np - 1) * 8 + 4;
    for (int i = 0; i < 4; ++i) dx8[i] = 0.0f;
  }
  for (int64_t b = a.nb; b < a.nbs; ++b) a.row_s(r)[b] = 0.0f;
}

template <typename T>
inline float load_scalar(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return x[i];
  } else {
    return widen_bf16(x[i]);
  }
}

template <typename T>
void quantize_row_scalar(const T* x, const Act& a, int64_t r, float* dx_out, int32_t* sum_out) {
  int8_t* qx = a.row_qx(r);
  for (int64_t b = 0; b < a.nb; ++b) {
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) {
      float v = std::fabs(load_scalar(x, b * kBlock + j));
      amax = v > amax ? v : amax;
    }
    float dx, id;
    block_scale(amax, &dx, &id);
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      int32_t q = round_ss(load_scalar(x, b * kBlock + j) * id);
      qx[qx_pos(b, j)] = static_cast<int8_t>(q);
      sum += static_cast<int8_t>(q);
    }
    store_block(a, r, b, dx, sum, dx_out, sum_out);
  }
  pad_row(a, r);
}

template <typename T>
QINFER_AVX2 void quantize_row_avx2(const T* x, const Act& a, int64_t r, float* dx_out,
                                   int32_t* sum_out) {
  int8_t* qx = a.row_qx(r);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8_f32(x + b * kBlock + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float dx, id;
    block_scale(_mm_cvtss_f32(m4), &dx, &id);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    // int32 -> int8 in order (|q| <= 127, so the saturating packs are exact), as in
    // llama.cpp's quantize_row_q8_0: the packs interleave 128-bit lanes, the permute undoes it
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
    __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos(b, 0)),
                     _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos(b, 16)),
                     _mm256_extracti128_si256(bytes, 1));
    store_block(a, r, b, dx, _mm_cvtsi128_si32(t), dx_out, sum_out);
  }
  pad_row(a, r);
}

template <typename T>
QINFER_VNNI void quantize_row_avx512(const T* x, const Act& a, int64_t r, float* dx_out,
                                     int32_t* sum_out) {
  int8_t* qx = a.row_qx(r);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512 lo = load16_f32(x + b * kBlock);
    __m512 hi = load16_f32(x + b * kBlock + 16);
    float dx, id;
    block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))), &dx,
                &id);
    const __m512 vid = _mm512_set1_ps(id);
    __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid));
    __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos(b, 0)),
                     _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos(b, 16)),
                     _mm512_cvtepi32_epi8(qhi));
    int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    store_block(a, r, b, dx, sum, dx_out, sum_out);
  }
  pad_row(a, r);
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, const Act& a, Isa path, float* dx_out,
                   int32_t* sum_out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / K);
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      float* dxr = dx_out ? dx_out + r * a.nb : nullptr;
      int32_t* sr = sum_out ? sum_out + r * a.nb : nullptr;
      if (path == Isa::Vnni) {
        quantize_row_avx512(xr, a, r, dxr, sr);
      } else if (path == Isa::Avx2) {
        quantize_row_avx2(xr, a, r, dxr, sr);
      } else {
        quantize_row_scalar(xr, a, r, dxr, sr);
      }
    }
  });
}

}  // namespace

void quantize(const at::Tensor& x, const Act& a, Isa path, float* dx_out,
              int32_t* sum_out) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), M, K, a, path, dx_out, sum_out);
  } else {
    quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, a,
                           path, dx_out, sum_out);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8_1(const at::Tensor& x_in,
                                                             const std::string& path_name_in) {
  check_x("quantize_q8_1", x_in);
  const Isa path = vector_isa(resolve_path("quantize_q8_1", path_name_in, kDotPaths));
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  ActStorage storage;
  Act a = storage.make(M, K);
  at::Tensor dx = at::empty({M, nb}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({M, nb}, x.options().dtype(at::kInt));
  quantize(x, a, path, dx.data_ptr<float>(), sums.data_ptr<int32_t>());
  at::Tensor qx = at::empty({M, K}, x.options().dtype(at::kChar));
  int8_t* qp = qx.data_ptr<int8_t>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t j = 0; j < kBlock; ++j) qp[r * K + b * kBlock + j] = a.row_qx(r)[qx_pos(b, j)];
  return {qx, dx, sums};
}


}  // namespace qinfer_kernels
