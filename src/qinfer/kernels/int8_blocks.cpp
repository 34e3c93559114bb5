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
// times fp32 activations (bf16 ones widened exactly): each weight q * d is formed in fp32,
// exact for GGUF's scales (an 8-bit integer times an fp16, or Q6_K's fp16 times an int8: 18
// significant bits at most) and for an fp32 scale rounded as `Int8Blocks.dequantize` rounds
// it, so the result is x @ W.T up to fp32 summation, each product rounded once. Per output
// (r, n), on every path (lanes L: 16 AVX512, 8 AVX2, 1 scalar):
//   acc0, acc1 (lanes) = 0
//   for each chunk j of L columns (k = j L, in block b = k / B):
//       w (lanes) = float(q chunk) * d[n, b]
//       acc_(j % 2) = fma(w, x chunk, acc_(j % 2))
//   out = horizontal sum of acc0 + acc1 (a fixed tree of adds)
// The weight chunk is formed once for all R rows of a tile, so a tile of R rows costs R + 1
// multiplies a chunk (a product then a per-block scaling cost 2 R: b8 heads were bound by
// them); two chains, so that one row (decode, the head) does not wait on each fused
// multiply-add's latency. Q6_K's q are its 6-bit values as packed (q6.h), each chunk of 64
// (4 blocks) unpacked in registers: the same integers, so the same bits as from int8 q.
// ---------------------------------------------------------------------------------------

template <typename S>
struct WeightsF {
  const int8_t* q;      // (N, K), or with Q6_K's sub-scales its packed bytes (N, 3K/4)
  BlockScales<S> d;     // (N, K/B)
  int64_t nb;           // K / 32 (the grain's measure of K, as the other kinds')
  int64_t B;            // 16 or 32
  // output column n is the weight's row ids[n] (the head's gathered top rows), or null: row n
  const int64_t* ids = nullptr;
  QINFER_INLINE int64_t row_of(int64_t n) const { return ids ? ids[n] : n; }
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
      q[c] = w.q + w.row_of(n0 + c) * row;
      d[c] = w.d.column(w.row_of(n0 + c), blocks);
    }
    for (int i = 0; i < R; ++i) x[i] = a.x + (r0 + i) * K;
  }
};

// One chunk of a tile: acc[c][i] = fma(w_c, x_i at column k, acc[c][i]) (VNNI: 16 lanes).
template <int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_chunk(const float* const (&x)[R], int64_t k,
                                          const __m512 (&w)[C], __m512 (&acc)[C][R]) {
  __m512 xv[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(x[i] + k);
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm512_fmadd_ps(w[c], xv[i], acc[c][i]);
}

// The chunk at column k of a VNNI tile's columns (int8 q, fp16 or fp32 scales, blocks of
// 2^shift columns: a shift, not a division, in a one-row tile's inner loop) into the chain
// acc.
template <int R, int C, typename S>
QINFER_VNNI QINFER_INLINE void vnni_int8_chunk(const TileRows<R, C, S>& p, int shift, int64_t k,
                                               __m512 (&acc)[C][R]) {
  __m512 w[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + k + kPrefetchFor<R>), _MM_HINT_T0);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q[c] + k));
    w[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                         splat16(p.d[c].d + (k >> shift)));
  }
  vnni_chunk<R, C>(p.x, k, w, acc);
}

// Q6_K's block b + J of the unpacked chunk u: byte J of its dwords (q6.h), scaled by d16's.
template <int J, int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_q6_block(const TileRows<R, C, int8_t>& p, int64_t b,
                                             const __m512i (&u)[C],
                                             const float (&d16)[C][kSubScales],
                                             __m512 (&acc)[C][R]) {
  __m512 w[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    w[c] = _mm512_mul_ps(q6_block_f32<J>(u[c]), _mm512_set1_ps(d16[c][(b + J) % kSubScales]));
  vnni_chunk<R, C>(p.x, (b + J) * kSubBlock, w, acc);
}

// Q6_K's blocks b.. b + 3 (b a multiple of 4): the columns' chunk of 64 unpacked in registers
// (the bytes ahead fetched); block b + J is byte J of its dwords (q6.h), scaled by d16's
// (the super-block's sub-scales, formed at its first block).
template <int R, int C>
QINFER_VNNI QINFER_INLINE void vnni_q6_chunk(const TileRows<R, C, int8_t>& p, int64_t b,
                                             const float (&d16)[C][kSubScales],
                                             __m512 (&acc)[2][C][R]) {
  const int64_t at = b / 4 * kQ6Bytes;
  __m512i u[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + at + kPrefetchFor<R>), _MM_HINT_T0);
    u[c] = q6_unpack64(reinterpret_cast<const uint8_t*>(p.q[c] + at));
  }
  vnni_q6_block<0, R, C>(p, b, u, d16, acc[0]);
  vnni_q6_block<1, R, C>(p, b, u, d16, acc[1]);
  vnni_q6_block<2, R, C>(p, b, u, d16, acc[0]);
  vnni_q6_block<3, R, C>(p, b, u, d16, acc[1]);
}

// The same on AVX2, 8 lanes.
template <int R, int C>
QINFER_AVX2 QINFER_INLINE void avx2_chunk(const float* const (&x)[R], int64_t k,
                                          const __m256 (&w)[C], __m256 (&acc)[C][R]) {
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      acc[c][i] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(x[i] + k), acc[c][i]);
}

template <int R, int C, typename S>
QINFER_AVX2 QINFER_INLINE void avx2_int8_chunk(const TileRows<R, C, S>& p, int shift, int64_t k,
                                               __m256 (&acc)[C][R]) {
  __m256 w[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + k + kPrefetchFor<R>), _MM_HINT_T0);
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q[c] + k));
    w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), splat8(p.d[c], k >> shift));
  }
  avx2_chunk<R, C>(p.x, k, w, acc);
}

// Q6_K's block b + J: byte J of the dwords of half 0, then of half 1 (chunks 2 J + h).
template <int J, int R, int C>
QINFER_AVX2 QINFER_INLINE void avx2_q6_block(const TileRows<R, C, int8_t>& p, int64_t b,
                                             const __m256i (&u)[C][2], __m256 (&acc)[2][C][R]) {
  #pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256 w[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      w[c] = _mm256_mul_ps(q6_block_f32<J>(u[c][h]), splat8(p.d[c], b + J));
    avx2_chunk<R, C>(p.x, (b + J) * kSubBlock + 8 * h, w, acc[h]);
  }
}

template <int R, int C>
QINFER_AVX2 QINFER_INLINE void avx2_q6_chunk(const TileRows<R, C, int8_t>& p, int64_t b,
                                             __m256 (&acc)[2][C][R]) {
  const int64_t at = b / 4 * kQ6Bytes;
  __m256i u[C][2];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + at + kPrefetchFor<R>), _MM_HINT_T0);
    q6_unpack64(reinterpret_cast<const uint8_t*>(p.q[c] + at), u[c]);
  }
  avx2_q6_block<0, R, C>(p, b, u, acc);
  avx2_q6_block<1, R, C>(p, b, u, acc);
  avx2_q6_block<2, R, C>(p, b, u, acc);
  avx2_q6_block<3, R, C>(p, b, u, acc);
}

template <typename S>
struct Int8BlocksF32 {
  QINFER_MATMUL_KERNEL(WeightsF<S>, ActF)
};

template <typename S>
template <int R, int C>
QINFER_VNNI void Int8BlocksF32<S>::tile_vnni(const WeightsF<S>& w, int64_t n0, const ActF& a,
                                             int64_t r0, float* out, int64_t ldo) {
  TileRows<R, C, S> p(w, n0, a, r0);
  prefetch_scales<C, S>(p.d, p.blocks);
  __m512 acc[2][C][R];  // even chunks, odd chunks: two chains of fused multiply-adds
  clear(acc[0]);
  clear(acc[1]);
  if constexpr (kSub<S>) {  // B = 16: K / 16 blocks, a multiple of 16
    // a super-block's 16 block scales, formed at its first block (one load and multiply a
    // column per 16 blocks) and stored here for each block's broadcast load, as fp32 scales
    // are read (a scalar product per block ran the head's shape 12-23% slower)
    alignas(64) float d16[C][kSubScales];
    for (int64_t b = 0; b < p.blocks; b += 4) {
      if (b % kSubScales == 0) {
        #pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm512_store_ps(d16[c], sub_scales16(p.d[c], b));
      }
      vnni_q6_chunk<R, C>(p, b, d16, acc);
    }
  } else {
    const int shift = w.B == 16 ? 4 : 5;
    for (int64_t k = 0; k < w.nb * kBlock; k += 32) {  // chunks 2 j, 2 j + 1
      vnni_int8_chunk<R, C, S>(p, shift, k, acc[0]);
      vnni_int8_chunk<R, C, S>(p, shift, k + 16, acc[1]);
    }
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
  TileRows<R, C, S> p(w, n0, a, r0);
  prefetch_scales<C, S>(p.d, p.blocks);
  __m256 acc[2][C][R];  // even chunks, odd chunks (as the VNNI tile)
  clear(acc[0]);
  clear(acc[1]);
  if constexpr (kSub<S>) {
    for (int64_t b = 0; b < p.blocks; b += 4) avx2_q6_chunk<R, C>(p, b, acc);
  } else {
    const int shift = w.B == 16 ? 4 : 5;
    for (int64_t k = 0; k < w.nb * kBlock; k += 16) {  // chunks 2 j, 2 j + 1
      avx2_int8_chunk<R, C, S>(p, shift, k, acc[0]);
      avx2_int8_chunk<R, C, S>(p, shift, k + 8, acc[1]);
    }
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
  const int8_t* q = w.q + w.row_of(n) * (kSub<S> ? q6_row_bytes(K) : K);
  const BlockScales<S> d = w.d.column(w.row_of(n), blocks);
  const float* x = a.x + r * K;
  float acc[2] = {0.0f, 0.0f};  // even columns, odd columns (chunks of one)
  for (int64_t k = 0; k < K; ++k) {
    const int8_t v = kSub<S> ? q6_value(reinterpret_cast<const uint8_t*>(q), k) : q[k];
    acc[k % 2] = std::fma(static_cast<float>(v) * block_scale(d, k / B), x[k], acc[k % 2]);
  }
  out[r * ldo + n] = acc[0] + acc[1];
}

// ids (M, k) int64, each in 0..N-1: the weight's rows each row of x takes (contiguous).
at::Tensor checked_ids(const at::Tensor& ids, int64_t M, int64_t N) {
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 2 &&
                  ids.size(0) == M,
              "int8_blocks_mm: ids must be torch.int64 (M, k) on the CPU for x's M = ", M,
              ", got ", dtype_name(ids.scalar_type()), " ", shape_str(ids));
  const at::Tensor c = ids.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < N, "int8_blocks_mm: ids must lie in 0..", N - 1,
                " (q's rows), got ", p[i]);
  return c;
}

}  // namespace

at::Tensor int8_blocks_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& d_in,
                          const std::string& path_name_in,
                          const c10::optional<at::Tensor>& d_super_in,
                          const c10::optional<at::Tensor>& ids_in) {
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
  const at::Tensor ids = ids_in ? checked_ids(*ids_in, M, N) : at::Tensor();
  const int64_t columns = ids.defined() ? ids.size(1) : N;
  at::Tensor out = at::empty({M, columns}, x_in.options().dtype(at::kFloat));
  if (M == 0 || columns == 0) return out;
  at::Tensor x32;
  const ActF a = fp32_activations(x_in, x32);
  with_block_scales(d, [&](auto tag) {
    using S = decltype(tag);
    const BlockScales<S> scales{d.data_ptr<S>(), super_data(d_super)};
    WeightsF<S> w{values_data(q), scales, K / kBlock, B};
    if (!ids.defined()) {
      matmul<Int8BlocksF32<S>>(path, w, N, M, a, out.data_ptr<float>());
      return;
    }
    // row r against its own rows of the weight: one row's matmul over its gathered columns
    // (each output takes the steps it takes in the whole product, so the same bits)
    for (int64_t r = 0; r < M; ++r) {
      w.ids = ids.data_ptr<int64_t>() + r * columns;
      matmul<Int8BlocksF32<S>>(path, w, columns, 1, ActF{a.x + r * K},
                               out.data_ptr<float>() + r * columns);
    }
  });
  return out;
}

}  // namespace qinfer_kernels
