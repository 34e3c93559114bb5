// int8 weights with one scale per block of 16 or 32 (GGUF's Q8_0, Q5_0 and Q6_K values)
// x fp32 activations in fp32: the op int8_blocks_mm. docs/KERNELS.md says what it computes.

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

#include "int8_scales.h"
#include "matmul.h"
#include "ops.h"
#include "q6.h"

namespace qinfer_kernels {
namespace {

// ---------------------------------------------------------------------------------------
// int8 weights with one scale per block of B = 16 or 32 elements (GGUF's Q8_0, Q5_0 and
// Q6_K values, kept exactly; the scales fp16, fp32 or Q6_K's int8 x fp16: int8_scales.h)
// times fp32 activations (bf16 ones widened exactly): neither operand is rounded, so the
// result is x @ W.T up to fp32 summation. Per output (r, n), on every path (lanes L: 16
// AVX512, 8 AVX2, 1 scalar):
//   acc0, acc1 (lanes) = 0
//   for each block b:  t (lanes) = 0; t = fma(float(q chunk), x chunk, t) for its B / L chunks
//                      acc_(b % 2) = fma(t, d[n, b], acc_(b % 2))
//   out = horizontal sum of acc0 + acc1 (a fixed tree of adds)
// Two chains of blocks, not one: a Q6_K block of 16 is one fused multiply-add a lane, so one
// row (decode, the head) waited on each add's latency; with two it is bound by its reads.
// Q6_K's q are its 6-bit values as packed (q6.h), each chunk of 64 (4 blocks) unpacked in
// registers: the same integers, so the same bits as from int8 q.
// ---------------------------------------------------------------------------------------

template <typename S>
struct WeightsF {
  const int8_t* q;      // (N, K), or with Q6_K's sub-scales its packed bytes (N, 3K/4)
  BlockScales<S> d;     // (N, K/B)
  int64_t nb;           // K / 32 (the grain's measure of K, as the other kinds')
  int64_t B;            // 16 or 32
};

// A tile's row pointers into the weight (its C columns' q and d) and the activations (its R
// rows), copied into locals once (see the note above the int4 tiles).
template <int R, int C, typename S>
struct TileRows {
  int64_t blocks;
  const int8_t* q[C];
  BlockScales<S> d[C];
  const float* x[R];
  TileRows(const WeightsF<S>& w, int64_t n0, const ActF& a, int64_t r0) {
    const int64_t K = w.nb * kBlock, row = kSub<S> ? q6_row_bytes(K) : K;
    blocks = K / w.B;
    for (int c = 0; c < C; ++c) {
      q[c] = w.q + (n0 + c) * row;
      d[c] = w.d.column(n0 + c, blocks);
    }
    for (int i = 0; i < R; ++i) x[i] = a.x + (r0 + i) * K;
  }
};

// One step of a tile's products: t[c][i] += w_c * x_i over the lanes at column k (VNNI: 16).
template <int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_products(const float* const (&x)[R], int64_t k,
                                             const __m512 (&wv)[C], __m512 (&t)[C][R]) {
  __m512 xv[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x[i] + k);
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) t[c][i] = _mm512_fmadd_ps(wv[c], xv[i], t[c][i]);
}

// A block's end: sum[c][i] += t[c][i] * (column c's block scale).
template <int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_scaled(const __m512 (&t)[C][R], const __m512 (&dv)[C],
                                           __m512 (&sum)[C][R]) {
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) sum[c][i] = _mm512_fmadd_ps(t[c][i], dv[c], sum[c][i]);
}

// 16 int8 values as fp32 lanes (exact).
QINFER_VNNI QINFER_INLINE __m512 widen16(__m128i values) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(values));
}

// Block b of a VNNI tile's columns (int8 q, fp16 or fp32 scales): sum += (q . x) * d, q . x
// in fp32 fused multiply-adds.
template <int R, int C, typename S>
QINFER_VNNI QINFER_INLINE void vnni_block(const TileRows<R, C, S>& p, int64_t B, int64_t b,
                                          __m512 (&sum)[C][R]) {
  __m512 t[C][R];
  clear(t);
  for (int64_t k = b * B; k < (b + 1) * B; k += 16) {
    __m512 wv[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + k + kPrefetchFor<R>), _MM_HINT_T0);
      wv[c] = widen16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q[c] + k)));
    }
    vnni_products<R, C>(p.x, k, wv, t);
  }
  __m512 dv[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) dv[c] = splat16(p.d[c].d + b);
  vnni_scaled<R, C>(t, dv, sum);
}

// Q6_K's block b + J (of 16 values: one step), its values byte J of the unpacked chunk w's
// dwords (q6.h), its scale d16's (the super-block's sub-scales, formed at its first block).
template <int J, int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_q6_block(const TileRows<R, C, int8_t>& p, int64_t b,
                                             const __m512i (&w)[C],
                                             const float (&d16)[C][kSubScales],
                                             __m512 (&sum)[C][R]) {
  __m512 t[C][R], wv[C], dv[C];
  clear(t);
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) wv[c] = q6_block_f32<J>(w[c]);
  vnni_products<R, C>(p.x, (b + J) * kSubBlock, wv, t);
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) dv[c] = _mm512_set1_ps(d16[c][(b + J) % kSubScales]);
  vnni_scaled<R, C>(t, dv, sum);
}

// Q6_K's blocks b.. b + 3 (b a multiple of 4): the columns' chunk of 64 unpacked in registers
// (the bytes ahead fetched), its blocks taken in turn by the even and odd chains.
template <int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_q6_chunk(const TileRows<R, C, int8_t>& p, int64_t b,
                                             const float (&d16)[C][kSubScales],
                                             __m512 (&acc)[2][C][R]) {
  const int64_t at = b / 4 * kQ6Bytes;
  __m512i w[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + at + kPrefetchFor<R>), _MM_HINT_T0);
    w[c] = q6_unpack64(reinterpret_cast<const uint8_t*>(p.q[c] + at));
  }
  vnni_q6_block<0, R, C>(p, b, w, d16, acc[0]);
  vnni_q6_block<1, R, C>(p, b, w, d16, acc[1]);
  vnni_q6_block<2, R, C>(p, b, w, d16, acc[0]);
  vnni_q6_block<3, R, C>(p, b, w, d16, acc[1]);
}

// The same on AVX2, 8 lanes.
template <int R, int C>
QINFER_AVX2 QINFER_INLINE void avx2_products(const float* const (&x)[R], int64_t k,
                                             const __m256 (&wv)[C], __m256 (&t)[C][R]) {
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) t[c][i] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x[i] + k), t[c][i]);
}

template <int R, int C, typename S>
QINFER_AVX2 QINFER_INLINE void avx2_scaled(const TileRows<R, C, S>& p, int64_t b,
                                           const __m256 (&t)[C][R], __m256 (&sum)[C][R]) {
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const __m256 dv = splat8(p.d[c], b);
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) sum[c][i] = _mm256_fmadd_ps(t[c][i], dv, sum[c][i]);
  }
}

// 8 int8 values (the low 8 bytes) as fp32 lanes (exact).
QINFER_AVX2 QINFER_INLINE __m256 widen8(__m128i values) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
}

template <int R, int C, typename S>
QINFER_AVX2 QINFER_INLINE void avx2_block(const TileRows<R, C, S>& p, int64_t B, int64_t b,
                                          __m256 (&sum)[C][R]) {
  __m256 t[C][R];
  clear(t);
  for (int64_t k = b * B; k < (b + 1) * B; k += 8) {
    __m256 wv[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + k + kPrefetchFor<R>), _MM_HINT_T0);
      wv[c] = widen8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q[c] + k)));
    }
    avx2_products<R, C>(p.x, k, wv, t);
  }
  avx2_scaled<R, C, S>(p, b, t, sum);
}

// Q6_K's block b + J: its values 16 J + 8 s.. byte J of the unpacked chunk's half s.
template <int J, int R, int C>
QINFER_AVX2 QINFER_INLINE void avx2_q6_block(const TileRows<R, C, int8_t>& p, int64_t b,
                                             const __m256i (&w)[C][2], __m256 (&sum)[C][R]) {
  __m256 t[C][R];
  clear(t);
  #pragma GCC unroll 2
  for (int s = 0; s < 2; ++s) {
    __m256 wv[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = q6_block_f32<J>(w[c][s]);
    avx2_products<R, C>(p.x, (b + J) * kSubBlock + 8 * s, wv, t);
  }
  avx2_scaled<R, C, int8_t>(p, b + J, t, sum);
}

template <int R, int C>
QINFER_AVX2 QINFER_INLINE void avx2_q6_chunk(const TileRows<R, C, int8_t>& p, int64_t b,
                                             __m256 (&acc)[2][C][R]) {
  const int64_t at = b / 4 * kQ6Bytes;
  __m256i w[C][2];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + at + kPrefetchFor<R>), _MM_HINT_T0);
    q6_unpack64(reinterpret_cast<const uint8_t*>(p.q[c] + at), w[c]);
  }
  avx2_q6_block<0, R, C>(p, b, w, acc[0]);
  avx2_q6_block<1, R, C>(p, b, w, acc[1]);
  avx2_q6_block<2, R, C>(p, b, w, acc[0]);
  avx2_q6_block<3, R, C>(p, b, w, acc[1]);
}

template <typename S>
struct Int8BlocksF32 {
  QINFER_MATMUL_KERNEL(WeightsF<S>, ActF)
};

template <typename S>
template <int R, int C>
QINFER_VNNI void Int8BlocksF32<S>::tile_vnni(const WeightsF<S>& w, int64_t n0, const ActF& a,
                                             int64_t r0, float* out, int64_t ldo) {
  const int64_t B = w.B;
  TileRows<R, C, S> p(w, n0, a, r0);
  prefetch_scales<C, S>(p.d, p.blocks);
  __m512 acc[2][C][R];  // even blocks, odd blocks: two chains of fused multiply-adds
  clear(acc[0]);
  clear(acc[1]);
  // int8 sub-scales: a super-block's 16 block scales, formed at its first block (one load and
  // multiply a column per 16 blocks) and stored here for each block's broadcast load, as
  // fp32 scales are read (a scalar product per block ran the head's shape 12-23% slower)
  if constexpr (kSub<S>) {  // B = 16: K / 16 blocks, a multiple of 16
    alignas(64) float d16[C][kSubScales];
    for (int64_t b = 0; b < p.blocks; b += 4) {
      if (b % kSubScales == 0) {
        #pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm512_store_ps(d16[c], sub_scales16(p.d[c], b));
      }
      vnni_q6_chunk<R, C>(p, b, d16, acc);
    }
  } else {
    int64_t b = 0;
    for (; b + 2 <= p.blocks; b += 2) {
      vnni_block<R, C, S>(p, B, b, acc[0]);
      vnni_block<R, C, S>(p, B, b + 1, acc[1]);
    }
    if (b < p.blocks) vnni_block<R, C, S>(p, B, b, acc[0]);
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[0][c][i], acc[1][c][i]));
}

template <typename S>
template <int R, int C>
QINFER_AVX2 void Int8BlocksF32<S>::tile_avx2(const WeightsF<S>& w, int64_t n0, const ActF& a,
                                             int64_t r0, float* out, int64_t ldo) {
  const int64_t B = w.B;
  TileRows<R, C, S> p(w, n0, a, r0);
  prefetch_scales<C, S>(p.d, p.blocks);
  __m256 acc[2][C][R];  // even blocks, odd blocks (as the VNNI tile)
  clear(acc[0]);
  clear(acc[1]);
  if constexpr (kSub<S>) {
    for (int64_t b = 0; b < p.blocks; b += 4) avx2_q6_chunk<R, C>(p, b, acc);
  } else {
    int64_t b = 0;
    for (; b + 2 <= p.blocks; b += 2) {
      avx2_block<R, C, S>(p, B, b, acc[0]);
      avx2_block<R, C, S>(p, B, b + 1, acc[1]);
    }
    if (b < p.blocks) avx2_block<R, C, S>(p, B, b, acc[0]);
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = hsum_avx2(_mm256_add_ps(acc[0][c][i], acc[1][c][i]));
}

template <typename S>
void Int8BlocksF32<S>::dot_scalar(const WeightsF<S>& w, int64_t n, const ActF& a, int64_t r,
                                  float* out, int64_t ldo) {
  const int64_t K = w.nb * kBlock, B = w.B, blocks = K / B;
  const int8_t* q = w.q + n * (kSub<S> ? q6_row_bytes(K) : K);
  const BlockScales<S> d = w.d.column(n, blocks);
  const float* x = a.x + r * K;
  float acc[2] = {0.0f, 0.0f};  // even blocks, odd blocks
  for (int64_t b = 0; b < blocks; ++b) {
    float t = 0.0f;
    for (int64_t k = b * B; k < (b + 1) * B; ++k) {
      const int8_t v = kSub<S> ? q6_value(reinterpret_cast<const uint8_t*>(q), k) : q[k];
      t += static_cast<float>(v) * x[k];
    }
    acc[b & 1] += t * block_scale(d, b);
  }
  out[r * ldo + n] = acc[0] + acc[1];
}

}  // namespace

at::Tensor int8_blocks_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& d_in,
                          const std::string& path_name_in,
                          const c10::optional<at::Tensor>& d_super_in) {
  check_x("int8_blocks_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(q_in.dim() == 2, "int8_blocks_mm: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0);
  const auto k = [K] { return "x's K = " + std::to_string(K); };
  TORCH_CHECK(d_in.dim() == 2 && (d_in.size(1) == K / 32 || d_in.size(1) == K / 16),
              "int8_blocks_mm: d must have shape (N, K/32) or (N, K/16) for ", k(), ", got ",
              shape_str(d_in));
  const int64_t B = K / d_in.size(1);
  if (d_in.scalar_type() == at::kChar) {
    check_tensor("int8_blocks_mm", "d", d_in, at::kChar, N, K / B,
                 [&] { return "(N, K/16) for " + k(); });
  } else {
    check_scales("int8_blocks_mm", "d", d_in, N, K / B,
                 [&] { return "(N, K/" + std::to_string(B) + ") for " + k() + " and q's N"; });
  }
  const at::Tensor d_super = checked_super_scales("int8_blocks_mm", d_in, d_super_in, N, K);
  const at::Tensor q = checked_values("int8_blocks_mm", q_in, d_in, N, K);
  const Isa path = vector_isa(resolve_path("int8_blocks_mm", path_name_in, kDotPaths));
  const at::Tensor d = d_in.contiguous();
  at::Tensor out = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  at::Tensor x32;
  const ActF a = fp32_activations(x_in, x32);
  with_block_scales(d, [&](auto tag) {
    using S = decltype(tag);
    const BlockScales<S> scales{d.data_ptr<S>(), super_data(d_super)};
    const WeightsF<S> w{values_data(q), scales, K / kBlock, B};
    matmul<Int8BlocksF32<S>>(path, w, N, M, a, out.data_ptr<float>());
  });
  return out;
}

}  // namespace qinfer_kernels
