// int4 groups of 32 (pack_int4's column tiles, int4_tiles.h: GGUF's Q4_0, Q4_1 and Q4_K
// values) x fp32 activations in fp32: the op int4_groups_mm. docs/KERNELS.md says what it
// computes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "int4_tiles.h"
#include "matmul.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

// ---------------------------------------------------------------------------------------
// int4 groups of 32 (GGUF's Q4_0, Q4_1 and Q4_K values, kept exactly) times fp32 activations
// (bf16 ones widened exactly). The weight is d q + m per block, so
//   sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j:
// the nibbles q (0..15, exact in fp32) multiply x in fp32 fused multiply-adds, each block's
// sum is scaled by its d, and the m terms come from each block's sum of x (`ActF4::sx`, once
// per row for every column). Nothing is rounded but fp32 products and sums: the result is x
// @ W.T of the exact weight to fp32 accuracy (a few ulps of sum |d q x| + |m x|).
//
// A block's 32 elements are taken in 8 dwords k of 4 bytes t: dword k < 4 holds elements
// 4k + t in its low nibbles, k >= 4 elements 16 + 4(k - 4) + t in its high ones (the tiles'
// registers). Per output (r, n), on every path, in this order:
//   tot = 0
//   for each block b:
//       p_t = 0; p_t = fma(q[4k' + t], x[4k' + t], p_t) for k = 0..7 (k' the element's dword)
//       tot = fma((p_0 + p_1) + (p_2 + p_3), d[n, b], tot)
//       tot = fma(m[n, b], sx[r, b], tot)
//   out = tot
// Lanes are columns, so the VNNI tile (16), the AVX2 tile (8) and the scalar path give the
// same bits at any row count. On AVX-512 a nibble becomes its fp32 value by vpermps of the
// constant 0..15 (it reads only an index's low 4 bits: a shift, no mask), so 16 weights cost
// a shift, a permute and a multiply-add per row.
// ---------------------------------------------------------------------------------------

struct ActF4 {
  const float* x;   // (M, K) as given
  const float* sx;  // (M, nb): each block's sum of x
  int64_t K, nb;
  const float* row_x(int64_t r) const { return x + r * K; }
  const float* row_sx(int64_t r) const { return sx + r * nb; }
};

// This thread's block sums, kept between calls (a decode step makes hundreds of them).
struct ActF4Storage {
  std::vector<float> sx;
  ActF4 make(const float* x, int64_t M, int64_t K) {
    const int64_t nb = K / kBlock;
    sx.resize(static_cast<size_t>(M * nb));
    float* out = sx.data();
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          float s = 0.0f;
          for (int64_t j = 0; j < kBlock; ++j) s += x[r * K + b * kBlock + j];
          out[r * nb + b] = s;
        }
    });
    return ActF4{x, out, K, nb};
  }
};

// The element of byte t of dword k of a block (the tiles' registers, int4_tiles.h).
constexpr int element(int k, int t) { return (k < 4 ? 4 * k : 16 + 4 * (k - 4)) + t; }

template <typename S>
struct Int4GroupsF32 : OnInt4Tiles<S> {
  static constexpr int kRowsVnni = 4;  // 4 x 4 partial sums, the rows' totals, 4 registers
  static constexpr int kRowsAvx2 = 1;  // AVX2's 16 registers: 4 partial sums and 8 nibble rows
  static constexpr int64_t kActivationBytes = 4;

  template <int R>
  QINFER_VNNI static void tile_vnni(const Int4Tiles<S>& w, int64_t g, const ActF4& a, int64_t r0,
                                    float* out) {
    const int64_t nb = w.nb;
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const float* x[R];
    const float* sx[R];
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      x[i] = a.row_x(r0 + i);
      sx[i] = a.row_sx(r0 + i);
    }
    __m512 tot[R];
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i) tot[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = w.block(g, b);
      prefetch_block(src);
      __m512i reg[4];
      #pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) reg[r] = _mm512_loadu_si512(src + 64 * r);
      __m512 p[R][4];
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
        #pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) p[i][t] = _mm512_setzero_ps();
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        #pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const int shift = 8 * t + (k < 4 ? 0 : 4);
          const __m512i index = shift ? _mm512_srli_epi32(reg[k & 3], shift) : reg[k & 3];
          const __m512 q = _mm512_permutexvar_ps(index, levels);
          #pragma GCC unroll 4
          for (int i = 0; i < R; ++i)
            p[i][t] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[i][b * kBlock + element(k, t)]), p[i][t]);
        }
      }
      const __m512 d16 = scales16(w.d_of(g, b), kTileCols);
      const __m512 m16 = offsets16(w.m_of(g, b), w.d_of(g, b), 0, kTileCols);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m512 sum =
            _mm512_add_ps(_mm512_add_ps(p[i][0], p[i][1]), _mm512_add_ps(p[i][2], p[i][3]));
        tot[i] = _mm512_fmadd_ps(sum, d16, tot[i]);
        tot[i] = _mm512_fmadd_ps(m16, _mm512_set1_ps(sx[i][b]), tot[i]);
      }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
      store_lanes(out + (r0 + i) * w.N + g * kTileCols, w.lanes(g), tot[i]);
  }

  template <int R>
  QINFER_AVX2 static void tile_avx2(const Int4Tiles<S>& w, int64_t g, int64_t h, const ActF4& a,
                                    int64_t r0, float* out) {
    static_assert(R == 1, "the AVX2 tile takes one row");
    const int64_t nb = w.nb;
    const __m256i low8 = _mm256_set1_epi32(0xFF);
    const float* x = a.row_x(r0);
    const float* sx = a.row_sx(r0);
    __m256 tot = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = w.block(g, b);
      prefetch_block(src);
      __m256i wk[8];
      unpack_block_avx2(src, h, wk);
      __m256 p[4];
      #pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) p[t] = _mm256_setzero_ps();
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        #pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m256i byte = t ? _mm256_srli_epi32(wk[k], 8 * t) : wk[k];
          const __m256 q = _mm256_cvtepi32_ps(t == 3 ? byte : _mm256_and_si256(byte, low8));
          p[t] = _mm256_fmadd_ps(q, _mm256_set1_ps(x[b * kBlock + element(k, t)]), p[t]);
        }
      }
      const __m256 d8 = scales8(w.d_of(g, b) + 8 * h, 8);
      const __m256 m8 = offsets8(w.m_of(g, b, 8 * h), w.d_of(g, b) + 8 * h, 0, 8);
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(p[0], p[1]), _mm256_add_ps(p[2], p[3]));
      tot = _mm256_fmadd_ps(sum, d8, tot);
      tot = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx[b]), tot);
    }
    const int64_t lanes = std::min<int64_t>(8, w.lanes(g) - 8 * h);
    store_lanes(out + r0 * w.N + g * kTileCols + 8 * h, lanes, tot);
  }

  static void dot_scalar(const Int4Tiles<S>& w, int64_t n, const ActF4& a, int64_t r, float* out) {
    const int64_t g = n / kTileCols, l = n % kTileCols;
    const float* x = a.row_x(r);
    const float* sx = a.row_sx(r);
    float tot = 0.0f;
    for (int64_t b = 0; b < w.nb; ++b) {
      float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int k = 0; k < 8; ++k)
        for (int t = 0; t < 4; ++t) {
          const int j = element(k, t);
          const uint8_t byte = w.byte(n, b, j & 15);
          const int q = j < 16 ? byte & 15 : byte >> 4;
          p[t] = std::fma(static_cast<float>(q), x[b * kBlock + j], p[t]);
        }
      tot = std::fma((p[0] + p[1]) + (p[2] + p[3]), widen(w.d_of(g, b)[l]), tot);
      tot = std::fma(offset(w.m_of(g, b), w.d_of(g, b), l), sx[b], tot);
    }
    out[r * w.N + n] = tot;
  }
};

}  // namespace

at::Tensor int4_groups_mm(const at::Tensor& x_in, const at::Tensor& qs_in,
                          const at::Tensor& d_in, const c10::optional<at::Tensor>& m_in,
                          int64_t n, const std::string& path_name_in) {
  check_x("int4_groups_mm", x_in);
  check_int4_tiles("int4_groups_mm", x_in, qs_in, d_in, m_in, n);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const Isa path = vector_isa(resolve_path("int4_groups_mm", path_name_in, kDotPaths));
  const at::Tensor qs = qs_in.contiguous(), d = d_in.contiguous(),
                   m = m_in ? m_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, n}, x_in.options().dtype(at::kFloat));
  if (M == 0 || n == 0) return out;
  at::Tensor x32;
  static thread_local ActF4Storage storage;
  const ActF4 a = storage.make(fp32_activations(x_in, x32).x, M, K);
  with_scales(d, [&](auto tag) {
    using S = decltype(tag);
    tiles_matmul<Int4GroupsF32<S>>(path, int4_tiles<S>(qs, d, m, n), M, a, out.data_ptr<float>());
  });
  return out;
}

}  // namespace qinfer_kernels
