// int8 weights (N, K) with one scale per output row or per block of 32 or 16 x int8
// activations on integer dot products, as llama.cpp's q8_0 dot: the op int8_mm.
// docs/KERNELS.md says what it computes.

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
#include "q8.h"

namespace qinfer_kernels {
namespace {

// ---------------------------------------------------------------------------------------
// int8 weights (N, K) as stored (Q6_K's packed: q6.h), with one scale per output row (B = 0:
// `Int8Linear`) or one per block of B = 32 or 16 input columns (`Int8BlockLinear`: GGUF's
// Q8_0, Q5_0, Q6_K), times the activations in the row's own order (`qx_pos`):
//   rows:   y[r, n] = scale[n] * sum_b dx[r, b] * (q[n, b, :] . qx[r, b, :])
//   blocks: y[r, n] = sum_b (dx[r, b32] * d[n, b]) * (q[n, b, :] . qx[r, b, :])
// The signed x signed products go through unsigned x signed instructions. VNNI's dpbusd:
// (x + 128) . w, the activations made unsigned once for all the tile's columns (x ^ 0x80),
// from -128 sum(w) (a dpbusd per weight pair, once for all its rows) as the accumulator, so a
// row and column take one dpbusd a pair; (x + 128) w sums at most 255 * 128 * 4 a lane. AVX2's
// maddubs: llama.cpp's q8_0 trick, |w| (unsigned; -128's is 128) times x with w's sign
// (128 * 127 * 2 < 2^15: no saturation). Either is the exact integer dot. Per output: acc (lanes) += float(dot lanes) * scale lanes,
// pair by pair, where a lane's scale is dx (rows) or dx * d of the weight block its 4 bytes
// lie in (blocks); out = horizontal sum of acc (a fixed tree), times the row's scale (rows).
// The integer dots are exact and every output takes the same steps at any row count. Q6_K's
// q are its 6-bit values as packed (q6.h): up to a tile's rows each pair's 64 are unpacked in
// registers as read, past them a slice of columns into int8 first (`unpacked_q6_mm`).
// ---------------------------------------------------------------------------------------

// scales S: fp16 or fp32, or for blocks Q6_K's int8 sub-scales (int8_scales.h)
template <typename S>
struct Weights8 {
  const int8_t* q;        // (N, K), or with Q6_K's sub-scales its packed bytes (N, 3K/4)
  BlockScales<S> scale;   // (N,) rows, or (N, K/B) blocks
  int64_t nb;
};

// Packed: q holds Q6_K's packed values (with its sub-scales), else int8 values (any scales).
template <int B, typename S, bool Packed = kSub<S>>
struct Int8Q8 {
  static_assert(B == 0 || B == 16 || B == 32, "int8 rows (B = 0) or blocks of 16 or 32");
  static_assert(!kSub<S> || B == kSubBlock, "int8 sub-scales are per block of 16");
  static_assert(!Packed || kSub<S>, "packed values go with Q6_K's sub-scales");
  static constexpr int64_t kScales = B == 0 ? 0 : kBlock / B;  // weight scales per block of 32
  // a pair's weight bytes: Q6_K's 64 values packed, else 64 int8
  static constexpr int64_t kPairBytes = Packed ? kQ6Bytes : 64;
  QINFER_MATMUL_KERNEL(Weights8<S>, Act)
};

template <int B, typename S, bool Packed>
template <int R, int C>
QINFER_VNNI void Int8Q8<B, S, Packed>::tile_vnni(const Weights8<S>& w, int64_t n0, const Act& a,
                                         int64_t r0, float* out, int64_t ldo) {
  constexpr int64_t L = kScales;
  const int64_t K = w.nb * kBlock, np = a.np, full = w.nb / 2;
  // a pair's 64 bytes are block 2p (lanes 0-7) then 2p + 1 (lanes 8-15); dx8 holds their
  // scales four times each
  const __m512i pair_lanes = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
  // the pair's 2 L weight scales to the lanes of their 32 / L bytes
  const __m512i scale_lanes = L == 2
      ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
      : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));  // +128 as u8; x ^ it
  const int8_t* q[C];
  BlockScales<S> d[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    q[c] = w.q + (n0 + c) * (Packed ? q6_row_bytes(K) : K);
    d[c] = w.scale.column(n0 + c, w.nb * L);
  }
  if constexpr (L > 0) prefetch_scales<C, S>(d, w.nb * L);
  [[maybe_unused]] const auto [qx, dx8, s] = Q8Rows<R>(a, r0);  // s unread (no offsets)
  __m512 acc[C][R];
  clear(acc);
  for (int64_t p = 0; p < np; ++p) {
    __m512i x[R];  // x + 128, unsigned
    __m512 dx[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      x[i] = _mm512_xor_si512(_mm512_loadu_si512(qx[i] + p * 64), bias);
      dx[i] = _mm512_permutexvar_ps(pair_lanes,
                                    _mm512_castps256_ps512(_mm256_loadu_ps(dx8[i] + p * 8)));
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int8_t* pair = q[c] + p * kPairBytes;
      _mm_prefetch(reinterpret_cast<const char*>(pair + kPrefetchFor<R>), _MM_HINT_T0);
      // an odd last block: read only its own 32 bytes (the next row may not exist); Q6_K's
      // K is a multiple of 256
      __m512i wq;
      if constexpr (Packed) wq = q6_in_order(q6_unpack64(reinterpret_cast<const uint8_t*>(pair)));
      else wq = p < full ? _mm512_loadu_si512(pair) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, pair);
      // -128 sum(w) per dword: (x + 128) . w plus it is x . w
      const __m512i offset =
          _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wq));
      [[maybe_unused]] __m512 ws;  // the weight scale of each lane's bytes (blocks)
      if constexpr (L > 0) {
        ws = _mm512_permutexvar_ps(
            scale_lanes, _mm512_castps128_ps512(scales4(d[c], p * 2 * L, p < full ? 2 * L : L)));
      }
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(offset, x[i], wq);
        const __m512 scale = L > 0 ? _mm512_mul_ps(dx[i], ws) : dx[i];
        acc[c][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[c][i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float sum = _mm512_reduce_add_ps(acc[c][i]);
      out[(r0 + i) * ldo + n0 + c] = L > 0 ? sum : sum * block_scale_f16c(w.scale, n0 + c);
    }
}

template <int B, typename S, bool Packed>
template <int R, int C>
QINFER_AVX2 void Int8Q8<B, S, Packed>::tile_avx2(const Weights8<S>& w, int64_t n0, const Act& a,
                                         int64_t r0, float* out, int64_t ldo) {
  constexpr int64_t L = kScales;
  const int64_t K = w.nb * kBlock, np = a.np, full = w.nb / 2;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* q[C];
  BlockScales<S> d[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    q[c] = w.q + (n0 + c) * (Packed ? q6_row_bytes(K) : K);
    d[c] = w.scale.column(n0 + c, w.nb * L);
  }
  if constexpr (L > 0) prefetch_scales<C, S>(d, w.nb * L);
  [[maybe_unused]] const auto [qx, dx8, s] = Q8Rows<R>(a, r0);  // s unread (no offsets)
  __m256 acc[C][R];
  clear(acc);
  for (int64_t p = 0; p < np; ++p) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const int8_t* pair = q[c] + p * kPairBytes;
      _mm_prefetch(reinterpret_cast<const char*>(pair + kPrefetchFor<R>), _MM_HINT_T0);
      __m256i wq[2];  // blocks 2p and 2p + 1 (zero past an odd last block)
      [[maybe_unused]] __m256 ws[2];  // their weight scales by lane (blocks; zero past it)
      if constexpr (Packed) {
        q6_unpack64(reinterpret_cast<const uint8_t*>(pair), wq);
        q6_in_order(wq);
      } else {
        wq[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
        wq[1] = p < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32))
                         : _mm256_setzero_si256();
      }
      if constexpr (L > 0) {
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const int64_t b = (2 * p + h) * L;  // the first of the block's L scales
          const bool mine = h == 0 || p < full;
          const float lo = mine ? block_scale_f16c(d[c], b) : 0.0f,
                      hi = mine ? block_scale_f16c(d[c], b + L - 1) : 0.0f;
          ws[h] = _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo));
        }
      }
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i x =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[i] + p * 64 + 32 * h));
          const __m256i s16 =
              _mm256_maddubs_epi16(_mm256_abs_epi8(wq[h]), _mm256_sign_epi8(x, wq[h]));
          const __m256i dot = _mm256_madd_epi16(s16, ones);
          const __m256 dxh = _mm256_broadcast_ss(dx8[i] + p * 8 + 4 * h);
          const __m256 scale = L > 0 ? _mm256_mul_ps(dxh, ws[h]) : dxh;
          acc[c][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[c][i]);
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float sum = hsum_avx2(acc[c][i]);
      out[(r0 + i) * ldo + n0 + c] = L > 0 ? sum : sum * block_scale_f16c(w.scale, n0 + c);
    }
}

template <int B, typename S, bool Packed>
void Int8Q8<B, S, Packed>::dot_scalar(const Weights8<S>& w, int64_t n, const Act& a, int64_t r,
                              float* out, int64_t ldo) {
  constexpr int64_t L = kScales, E = B == 0 ? kBlock : B;  // elements per weight scale
  const int64_t K = w.nb * kBlock;
  const int8_t* q = w.q + n * (Packed ? q6_row_bytes(K) : K);
  const BlockScales<S> d = w.scale.column(n, w.nb * L);
  const int8_t* qx = a.row_qx(r);
  const float* dx8 = a.row_dx8(r);
  float acc = 0.0f;
  for (int64_t b = 0; b < w.nb; ++b) {
    const float dx = dx8[dx8_pos(b)];
    for (int64_t part = 0; part < kBlock / E; ++part) {
      int32_t dot = 0;
      for (int64_t j = part * E; j < (part + 1) * E; ++j) {
        const int64_t k = b * kBlock + j;
        const int8_t v = Packed ? q6_value(reinterpret_cast<const uint8_t*>(q), k) : q[k];
        dot += v * qx[qx_pos(b, j)];
      }
      acc += static_cast<float>(dot) * (L > 0 ? dx * block_scale(d, b * L + part) : dx);
    }
  }
  out[r * ldo + n] = L > 0 ? acc : acc * block_scale(w.scale, n);
}

// Rows of a packed Q6_K weight (q6.h; rows follow one another, so their chunks do) as int8
// values in order, (rows, K) at dst.
QINFER_VNNI void q6_rows_vnni(const uint8_t* src, int64_t rows, int64_t K, int8_t* dst) {
  for (int64_t c = 0; c < rows * K / kQ6Chunk; ++c)
    _mm512_storeu_si512(dst + c * kQ6Chunk, q6_in_order(q6_unpack64(src + c * kQ6Bytes)));
}

QINFER_AVX2 void q6_rows_avx2(const uint8_t* src, int64_t rows, int64_t K, int8_t* dst) {
  for (int64_t c = 0; c < rows * K / kQ6Chunk; ++c) {
    __m256i half[2];
    q6_unpack64(src + c * kQ6Bytes, half);
    q6_in_order(half);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * kQ6Chunk), half[0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * kQ6Chunk + 32), half[1]);
  }
}

void q6_rows(Isa path, const uint8_t* src, int64_t rows, int64_t K, int8_t* dst) {
  if (path == Isa::Vnni) {
    q6_rows_vnni(src, rows, K, dst);
  } else if (path == Isa::Avx2) {
    q6_rows_avx2(src, rows, K, dst);
  } else {
    for (int64_t c = 0; c < rows * K / kQ6Chunk; ++c)
      for (int64_t i = 0; i < kQ6Chunk; ++i) dst[c * kQ6Chunk + i] = q6_value(src + c * kQ6Bytes, i);
  }
}

// Q6_K times more rows than a tile holds: a slice of the weight's columns (~1 MB of values)
// unpacked to int8 at a time, then the int8 tiles over it for every row tile, so that a
// column's chunk is unpacked once a call, not once a row tile (which cost 8 or more rows a
// third of their time). The same integers in the same order: the packed tiles' bits.
template <typename S>
void unpacked_q6_mm(Isa path, const Weights8<S>& w, int64_t N, int64_t M, const Act& a,
                    float* out) {
  const int64_t K = w.nb * kBlock, row_bytes = q6_row_bytes(K);
  // ~1 MB of values, and at least 4 column tasks a thread (a long K would leave threads idle)
  const int64_t wide = std::max<int64_t>(4 * kCols * at::get_num_threads(), (int64_t{1} << 20) / K);
  const int64_t slice = std::min(N, wide);
  static thread_local std::vector<int8_t> values;
  values.resize(static_cast<size_t>(slice * K));
  int8_t* buffer = values.data();  // this thread's: the workers below write into it
  for (int64_t c0 = 0; c0 < N; c0 += slice) {
    const int64_t n = std::min(slice, N - c0);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(w.q) + c0 * row_bytes;
    at::parallel_for(0, n, kCols, [&](int64_t r0, int64_t r1) {
      q6_rows(path, src + r0 * row_bytes, r1 - r0, K, buffer + r0 * K);
    });
    const Weights8<S> part{buffer, w.scale.column(c0, w.nb * Int8Q8<16, S>::kScales), w.nb};
    matmul<Int8Q8<16, S, false>>(path, part, n, M, a, out + c0, N);
  }
}

}  // namespace

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in,
                   const std::string& path_name_in, const c10::optional<at::Tensor>& d_super_in) {
  check_x("int8_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(q_in.dim() == 2, "int8_mm: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0);
  const at::ScalarType kind = scales_in.scalar_type();
  TORCH_CHECK(kind == at::kHalf || kind == at::kFloat || kind == at::kChar,
              "int8_mm: scales must be torch.float16, torch.float32 or (with d_super) torch.int8, "
              "got ", dtype_name(kind));
  // (N,): one scale per row; (N, K/B): one per block of B = 32 or 16 input columns
  const int64_t B = scales_in.dim() == 2 && scales_in.size(0) == N && scales_in.size(1) > 0 &&
                            K % scales_in.size(1) == 0
                        ? K / scales_in.size(1)
                        : 0;
  TORCH_CHECK((scales_in.dim() == 1 && scales_in.size(0) == N) || B == 32 || B == 16,
              "int8_mm: scales must have shape (", N, ",) per row, or (", N, ", ", K / 32,
              ") or (", N, ", ", K / 16, ") per block of 32 or 16, for q's N and x's K = ", K,
              ", got ", shape_str(scales_in));
  const at::Tensor d_super = checked_super_scales("int8_mm", scales_in, d_super_in, N, K);
  const at::Tensor q = checked_values("int8_mm", q_in, scales_in, N, K);
  const Isa path = resolve_path("int8_mm", path_name_in, kDotPaths);
  const at::Tensor x = x_in.contiguous(), sc = scales_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  static thread_local ActStorage storage;
  Act a = storage.make(M, K);
  quantize(x, a, path);
  with_block_scales(sc, [&](auto tag) {
    using S = decltype(tag);
    const BlockScales<S> scales{sc.data_ptr<S>(), super_data(d_super)};
    const Weights8<S> w{values_data(q), scales, K / kBlock};
    if constexpr (kSub<S>) {  // B = 16: checked_super_scales
      if (M <= kRows) {
        matmul<Int8Q8<16, S>>(path, w, N, M, a, out.data_ptr<float>());
      } else {
        unpacked_q6_mm(path, w, N, M, a, out.data_ptr<float>());
      }
    } else if (B == 32) {
      matmul<Int8Q8<32, S>>(path, w, N, M, a, out.data_ptr<float>());
    } else if (B == 16) {
      matmul<Int8Q8<16, S>>(path, w, N, M, a, out.data_ptr<float>());
    } else {
      matmul<Int8Q8<0, S>>(path, w, N, M, a, out.data_ptr<float>());
    }
  });
  return out;
}

}  // namespace qinfer_kernels
