// The residual add and RMSNorm of a decoder block in one pass over each row, and QK-norm: the
// ops add_rms_norm and heads_rms_norm (docs/KERNELS.md).
//
//   add_rms_norm(h, x, w, eps, dtype, path):
//     h (T, H) fp32, updated in place: h += x (x (T, H) fp32 or bf16, or None: h as it is)
//     out (T, H) in `dtype` (fp32 or bf16) = h * (1 / sqrt(mean(h^2) + eps)) * w, w (H,) fp32
//
//   heads_rms_norm(h, w_first, w_rest, first, eps, dtype): QK-norm, h (T, R, D) fp32 heads
//     with the last dimension contiguous (other strides free: q's and k's heads inside the
//     fused projection's output), read only; out (T, R, D) contiguous in `dtype`, head r
//     of a token normed as add_rms_norm's row with x None, by w_first (D,) for r < first
//     and w_rest (D,) after
//
// Per row, on every path, in this order (fp32, no contraction: -ffp-contract=off, fused
// multiply-adds only where written):
//   pass 1: v = h + x (exactly as torch adds a widened bf16 x), stored back to h;
//           squares summed in L lanes x 4 accumulators, chunk c into accumulator c % 4,
//           the H % L tail in a scalar sum; then (a0 + a1) + (a2 + a3), a fixed tree over
//           the lanes, plus the tail
//   r = 1 / sqrtf(sum / H + eps)
//   pass 2: out = (h * r) * w, rounded once to `dtype` (round half to even, as torch)
// L is 16 on the AVX-512 path, 8 on AVX2, 1 on the scalar one: the paths round the sum
// differently, but a row's result depends only on that row, H and the path, never on T,
// on the rows beside it or on the thread count (qinfer's batch invariance): rows are split
// between threads whole.

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
#include <utility>

#include "common.h"
#include "isa.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

// One row's operands: x is fp32 (xf), bf16 (xb) or absent (both null: h is only read); out
// is fp32 (of) or bf16 (ob).
struct Row {
  float* h;
  const float* xf;
  const uint16_t* xb;
  const float* w;
  float* of;
  uint16_t* ob;
  bool adds() const { return xf != nullptr || xb != nullptr; }
};

inline float sum_x_at(const Row& row, int64_t i) {
  float v = row.h[i];
  if (row.xf != nullptr) v += row.xf[i];
  if (row.xb != nullptr) v += widen_bf16(row.xb[i]);
  return v;
}

inline void store_at(const Row& row, int64_t i, float r) {
  const float y = (row.h[i] * r) * row.w[i];
  if (row.of != nullptr) {
    row.of[i] = y;
  } else {
    row.ob[i] = round_bf16(y);
  }
}

// The scalar tail of both vector paths (and the whole of the scalar one, with from = 0):
// h[i] += x[i] for i in [from, H), returning the sum of their squares in index order.
inline float add_tail(const Row& row, int64_t from, int64_t H) {
  float tail = 0.0f;
  for (int64_t i = from; i < H; ++i) {
    const float v = sum_x_at(row, i);
    if (row.adds()) row.h[i] = v;
    tail += v * v;
  }
  return tail;
}

inline float inverse_rms(float sum, int64_t H, float eps) {
  return 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
}

void row_scalar(const Row& row, int64_t H, float eps) {
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t body = H - H % 4;
  for (int64_t i = 0; i < body; ++i) {
    const float v = sum_x_at(row, i);
    if (row.adds()) row.h[i] = v;
    acc[i % 4] += v * v;
  }
  const float tail = add_tail(row, body, H);
  const float r = inverse_rms((acc[0] + acc[1]) + (acc[2] + acc[3]) + tail, H, eps);
  for (int64_t i = 0; i < H; ++i) store_at(row, i, r);
}

QINFER_AVX2 inline __m256 load_sum8(const Row& row, int64_t i) {
  __m256 v = _mm256_loadu_ps(row.h + i);
  if (row.xf != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(row.xf + i));
  if (row.xb != nullptr) v = _mm256_add_ps(v, load8_f32(row.xb + i));
  return v;
}

QINFER_AVX2 void row_avx2(const Row& row, int64_t H, float eps) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  const int64_t body = H - H % 8;
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 v = load_sum8(row, i);
    if (row.adds()) _mm256_storeu_ps(row.h + i, v);
    acc[(i / 8) % 4] = _mm256_fmadd_ps(v, v, acc[(i / 8) % 4]);
  }
  const float tail = add_tail(row, body, H);
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  const float r = inverse_rms(hsum_avx2(sum) + tail, H, eps);
  const __m256 rv = _mm256_set1_ps(r);
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row.h + i), rv),
                                   _mm256_loadu_ps(row.w + i));
    if (row.of != nullptr) {
      _mm256_storeu_ps(row.of + i, y);
      continue;
    }
    const __m256i u = _mm256_castps_si256(y);
    __m256i b = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    b = _mm256_srli_epi32(b, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row.ob + i), _mm256_castsi256_si128(packed));
  }
  for (int64_t i = body; i < H; ++i) store_at(row, i, r);
}

QINFER_AVX512 inline __m512 load_sum16(const Row& row, int64_t i) {
  __m512 v = _mm512_loadu_ps(row.h + i);
  if (row.xf != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(row.xf + i));
  if (row.xb != nullptr) v = _mm512_add_ps(v, load16_f32(row.xb + i));
  return v;
}

QINFER_AVX512 void row_avx512(const Row& row, int64_t H, float eps) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  const int64_t body = H - H % 16;
  for (int64_t i = 0; i < body; i += 16) {
    const __m512 v = load_sum16(row, i);
    if (row.adds()) _mm512_storeu_ps(row.h + i, v);
    acc[(i / 16) % 4] = _mm512_fmadd_ps(v, v, acc[(i / 16) % 4]);
  }
  const float tail = add_tail(row, body, H);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  // 16 lanes -> 8 -> 4 -> 1, a fixed tree
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(sum),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  const float total = _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  const float r = inverse_rms(total + tail, H, eps);
  const __m512 rv = _mm512_set1_ps(r);
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (int64_t i = 0; i < body; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row.h + i), rv),
                                   _mm512_loadu_ps(row.w + i));
    if (row.of != nullptr) {
      _mm512_storeu_ps(row.of + i, y);
      continue;
    }
    const __m512i u = _mm512_castps_si512(y);
    __m512i b = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    b = _mm512_srli_epi32(b, 16);
    b = _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row.ob + i), _mm512_cvtepi32_epi16(b));
  }
  for (int64_t i = body; i < H; ++i) store_at(row, i, r);
}

// An fp32 or bf16 output's elements as a Row writes them: (fp32, null) or (null, bf16).
std::pair<float*, uint16_t*> out_elements(at::Tensor& out) {
  if (out.scalar_type() == at::kFloat) return {out.data_ptr<float>(), nullptr};
  return {nullptr, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>())};
}

void norm_row(Isa path, const Row& row, int64_t H, float eps) {
  switch (path) {
    case Isa::Avx512: row_avx512(row, H, eps); break;
    case Isa::Avx2: row_avx2(row, H, eps); break;
    default: row_scalar(row, H, eps);
  }
}

}  // namespace

at::Tensor add_rms_norm(const at::Tensor& h, const c10::optional<at::Tensor>& x_in,
                        const at::Tensor& w_in, double eps, at::ScalarType dtype,
                        const std::string& path_name) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous() && h.is_cpu(),
              "add_rms_norm: h must be a contiguous (T, H) fp32 CPU tensor, got ",
              shape_str(h), " ", h.scalar_type());
  const int64_t T = h.size(0), H = h.size(1);
  TORCH_CHECK(w_in.dim() == 1 && w_in.size(0) == H && w_in.scalar_type() == at::kFloat &&
                  w_in.is_cpu(),
              "add_rms_norm: w must be (", H, ",) fp32 on the CPU for h's H, got ",
              shape_str(w_in), " ", w_in.scalar_type(), " on ", w_in.device().str());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "add_rms_norm: dtype must be float32 or bfloat16, got ", dtype);
  at::Tensor x;
  if (x_in.has_value()) {
    TORCH_CHECK(x_in->dim() == 2 && x_in->size(0) == T && x_in->size(1) == H &&
                    (x_in->scalar_type() == at::kFloat || x_in->scalar_type() == at::kBFloat16),
                "add_rms_norm: x must be fp32 or bf16 of h's shape ", shape_str(h), ", got ",
                shape_str(*x_in), " ", x_in->scalar_type());
    x = x_in->contiguous();
  }
  const Isa path = resolve_path("add_rms_norm", path_name, kVectorPaths);
  const at::Tensor w = w_in.contiguous();
  at::Tensor out = at::empty({T, H}, h.options().dtype(dtype));
  if (T == 0 || H == 0) return out;
  float* hp = h.data_ptr<float>();
  const float* xf = x.defined() && x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
  const uint16_t* xb = x.defined() && x.scalar_type() == at::kBFloat16
                           ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>())
                           : nullptr;
  float* of;
  uint16_t* ob;
  std::tie(of, ob) = out_elements(out);
  const float* wp = w.data_ptr<float>();
  const float e = static_cast<float>(eps);
  // about 16K elements a task: a decode step's few rows run on the calling thread
  const int64_t grain = std::max<int64_t>(1, 16384 / H);
  at::parallel_for(0, T, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const Row row{hp + r * H,
                    xf ? xf + r * H : nullptr,
                    xb ? xb + r * H : nullptr,
                    wp,
                    of ? of + r * H : nullptr,
                    ob ? ob + r * H : nullptr};
      norm_row(path, row, H, e);
    }
  });
  return out;
}

at::Tensor heads_rms_norm(const at::Tensor& h, const at::Tensor& w_first_in,
                          const at::Tensor& w_rest_in, int64_t first, double eps,
                          at::ScalarType dtype, const std::string& path_name) {
  TORCH_CHECK(h.dim() == 3 && h.scalar_type() == at::kFloat && h.stride(2) == 1 && h.is_cpu(),
              "heads_rms_norm: h must be (T, R, D) fp32 on the CPU with its last dimension "
              "contiguous, got ", shape_str(h), " ", h.scalar_type());
  const int64_t T = h.size(0), R = h.size(1), D = h.size(2);
  for (const at::Tensor* w : {&w_first_in, &w_rest_in})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == D && w->scalar_type() == at::kFloat && w->is_cpu(),
                "heads_rms_norm: w_first and w_rest must be (", D, ",) fp32 CPU tensors for h's D, "
                "got ", shape_str(*w), " ", w->scalar_type(), " on ", w->device().str());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "heads_rms_norm: dtype must be float32 or bfloat16, got ", dtype);
  const Isa path = resolve_path("heads_rms_norm", path_name, kVectorPaths);
  const at::Tensor w_first = w_first_in.contiguous(), w_rest = w_rest_in.contiguous();
  at::Tensor out = at::empty({T, R, D}, h.options().dtype(dtype));
  if (T == 0 || R == 0 || D == 0) return out;
  float* hp = h.data_ptr<float>();
  float* of;
  uint16_t* ob;
  std::tie(of, ob) = out_elements(out);
  const float* wf = w_first.data_ptr<float>();
  const float* wr = w_rest.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t s0 = h.stride(0), s1 = h.stride(1);
  const int64_t grain = std::max<int64_t>(1, 16384 / D);
  at::parallel_for(0, T * R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t t = i / R, r = i % R;
      const Row row{hp + t * s0 + r * s1, nullptr, nullptr, r < first ? wf : wr,
                    of ? of + i * D : nullptr, ob ? ob + i * D : nullptr};
      norm_row(path, row, D, e);
    }
  });
  return out;
}

}  // namespace qinfer_kernels
