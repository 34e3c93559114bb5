// int8 weights (N, K) with one scale per output row x int8 activations on integer dot
// products, as llama.cpp's q8_0 dot: the op int8_mm. docs/KERNELS.md says what it computes.

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

// ---------------------------------------------------------------------------------------
// int8 weights (N, K) as stored, one scale per output row: y[r, n] = scale[n] * sum_b dx[r, b]
// * (q[n, b, :] . qx[r, b, :]), the activations in the row's own order (`qx_pos<true>`).
// The signed x signed products take llama.cpp's q8_0 trick: |w| (unsigned) times x with w's
// sign, so that VNNI's u8 x s8 dpbusd and AVX2's maddubs (127 * 128 * 2 < 2^15: no
// saturation) serve. Per output: acc (lanes) += float(dot lanes) * dx lanes, pair by pair;
// out = horizontal sum of acc (a fixed tree) times the row's scale.
// ---------------------------------------------------------------------------------------

struct Weights8 {
  const int8_t* q;     // (N, K)
  const float* scale;  // (N,)
  int64_t nb;
};

struct Int8Q8 {
  QINFER_MATMUL_KERNEL(Weights8, Act)
};

template <int R, int C>
QINFER_VNNI void Int8Q8::tile_vnni(const Weights8& w, int64_t n0, const Act& a, int64_t r0,
                                   float* out, int64_t ldo) {
  const int64_t K = w.nb * kBlock, np = a.np, full = w.nb / 2;
  // a pair's 64 bytes are block 2p (lanes 0-7) then 2p + 1 (lanes 8-15); dx8 holds their
  // scales four times each
  const __m512i pair_lanes = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  const int8_t* q[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) q[c] = w.q + (n0 + c) * K;
  [[maybe_unused]] const auto [qx, dx8, s] = Q8Rows<R>(a, r0);  // s unread (no offsets)
  __m512 acc[C][R];
  clear(acc);
  for (int64_t p = 0; p < np; ++p) {
    __m512i x[R];
    __m512 dx[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      x[i] = _mm512_loadu_si512(qx[i] + p * 64);
      dx[i] = _mm512_permutexvar_ps(pair_lanes,
                                    _mm512_castps256_ps512(_mm256_loadu_ps(dx8[i] + p * 8)));
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(q[c] + p * 64 + kPrefetch), _MM_HINT_T0);
      // an odd last block: read only its own 32 bytes (the next row may not exist)
      const __m512i wq = p < full ? _mm512_loadu_si512(q[c] + p * 64)
                                  : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, q[c] + p * 64);
      const __m512i magnitude = _mm512_abs_epi8(wq);
      const __mmask64 negative = _mm512_movepi8_mask(wq);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i signed_x = _mm512_mask_sub_epi8(x[i], negative, zero, x[i]);
        const __m512i dot = _mm512_dpbusd_epi32(zero, magnitude, signed_x);
        acc[c][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx[i], acc[c][i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = _mm512_reduce_add_ps(acc[c][i]) * w.scale[n0 + c];
}

template <int R, int C>
QINFER_AVX2 void Int8Q8::tile_avx2(const Weights8& w, int64_t n0, const Act& a, int64_t r0,
                                   float* out, int64_t ldo) {
  const int64_t K = w.nb * kBlock, np = a.np, full = w.nb / 2;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* q[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) q[c] = w.q + (n0 + c) * K;
  [[maybe_unused]] const auto [qx, dx8, s] = Q8Rows<R>(a, r0);  // s unread (no offsets)
  __m256 acc[C][R];
  clear(acc);
  for (int64_t p = 0; p < np; ++p) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(q[c] + p * 64 + kPrefetch), _MM_HINT_T0);
      __m256i wq[2];  // blocks 2p and 2p + 1 (zero past an odd last block)
      wq[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[c] + p * 64));
      wq[1] = p < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[c] + p * 64 + 32))
                       : _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i x =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[i] + p * 64 + 32 * h));
          const __m256i s16 =
              _mm256_maddubs_epi16(_mm256_abs_epi8(wq[h]), _mm256_sign_epi8(x, wq[h]));
          const __m256i dot = _mm256_madd_epi16(s16, ones);
          acc[c][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                      _mm256_broadcast_ss(dx8[i] + p * 8 + 4 * h), acc[c][i]);
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = hsum_avx2(acc[c][i]) * w.scale[n0 + c];
}

void Int8Q8::dot_scalar(const Weights8& w, int64_t n, const Act& a, int64_t r, float* out,
                        int64_t ldo) {
  const int64_t K = w.nb * kBlock;
  const int8_t* q = w.q + n * K;
  const int8_t* qx = a.row_qx(r);
  const float* dx8 = a.row_dx8(r);
  float acc = 0.0f;
  for (int64_t b = 0; b < w.nb; ++b) {
    int32_t dot = 0;
    for (int64_t j = 0; j < kBlock; ++j) dot += q[b * kBlock + j] * qx[qx_pos<true>(b, j)];
    acc += static_cast<float>(dot) * dx8[(b >> 1) * 8 + (b & 1) * 4];
  }
  out[r * ldo + n] = acc * w.scale[n];
}

}  // namespace

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in,
                   const std::string& path_name_in) {
  check_x("int8_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(q_in.dim() == 2, "int8_mm: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0);
  check_tensor("int8_mm", "q", q_in, at::kChar, N, K, "(N, K) for x's K = " + std::to_string(K));
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat, "int8_mm: scales must be torch.float32, got ",
              dtype_name(scales_in.scalar_type()));
  TORCH_CHECK(scales_in.dim() == 1 && scales_in.size(0) == N, "int8_mm: scales must have shape (",
              N, ",) for q's N, got ", shape_str(scales_in));
  const Isa path = resolve_path("int8_mm", path_name_in, kDotPaths);
  const at::Tensor x = x_in.contiguous(), q = q_in.contiguous(), sc = scales_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  static thread_local ActStorage storage;
  Act a = storage.make(M, K);
  quantize<true>(x, a, path);
  const Weights8 w{q.data_ptr<int8_t>(), sc.data_ptr<float>(), K / kBlock};
  matmul<Int8Q8>(path, w, N, M, a, out.data_ptr<float>());
  return out;
}

}  // namespace qinfer_kernels
