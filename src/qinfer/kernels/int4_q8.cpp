// int4 weights (pack_int4's column tiles, int4_tiles.h) x int8 activations on integer dot
// products, the way llama.cpp multiplies Q4_1 weights by Q8_1 activations: the op int4_mm, and
// pack_int4. docs/KERNELS.md says what they compute.
//
// Activations (made per call, never seen by Python, q8.h): per row and block b of 32, qx the
// row's int8 in its own order, dx its scale and s = dx * sum(qx), which carries the weight's
// offset m.
//
// Per output (r, n), on every path, in this order (fp32, no contraction: -ffp-contract=off):
//     acc = 0
//     for each block b:
//         dot = q[n, b] . qx[r, b]                          (exact int32)
//         acc = fma(float(dot), d[n, b] * dx[r, b], acc)
//         acc = fma(m[n, b], s[r, b], acc)                  (m = 0 - 8 d where not held)
//     out = acc
// A lane of a tile is a column, so each output is its lane's own chain of fused multiply-adds:
// the VNNI tile (16 columns, dpbusd), the AVX2 tile (8 columns, maddubs then madd; AVX-VNNI's
// 256-bit dpbusd where the CPU has it) and the scalar path give the same bits, at any row
// count, thread count and split of the columns.
// That is the batch invariance qinfer requires (a row's result must not change with the batch
// it is in), and a model's text is the same on every CPU the kernels run on.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "amx.h"
#include "int4_tiles.h"
#include "matmul.h"
#include "ops.h"
#include "q8.h"

namespace qinfer_kernels {
namespace {

template <typename S>
struct Int4Q8 : OnInt4Tiles<S> {
  static constexpr int kRowsVnni = 8;  // 8 weight registers + 8 accumulators of 32
  static constexpr int kRowsAvx2 = 4;
  static constexpr int64_t kActivationBytes = 1;
  static constexpr bool kAmx = true;

  // One row's fp32 steps for a block on the VNNI tile's 16 columns, its exact dots given:
  // acc = fma(float(dot), d * dx, acc), then fma(m, s, acc) (the AMX tiles' dots take the same).
  QINFER_VNNI QINFER_INLINE static void scaled_vnni(__m512i dot, __m512 d16, __m512 m16, float dx,
                                                    float s, __m512& acc) {
    const __m512 scale = _mm512_mul_ps(d16, _mm512_set1_ps(dx));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    acc = _mm512_fmadd_ps(m16, _mm512_set1_ps(s), acc);
  }

  // R rows by the 16 columns of tile g: per block, its 4 registers unpacked once for the R
  // rows, each row's 8 activation dwords broadcast into 8 dpbusd (lane l: column 16g + l's
  // exact dot product of the block), then scaled into the row's accumulator.
  template <int R>
  QINFER_VNNI static void tile_vnni(const Int4Tiles<S>& w, int64_t g, const Act& a, int64_t r0,
                                    float* out) {
    const int64_t nb = w.nb;
    const auto [qx, dx8, s] = Q8Rows<R>(a, r0);
    __m512 acc[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = w.block(g, b);
      prefetch_block(src);
      __m512i wk[8];
      unpack_block_vnni(src, wk);
      const __m512 d16 = scales16(w.d_of(g, b), kTileCols);
      const __m512 m16 = offsets16(w.m_of(g, b), w.d_of(g, b), 0, kTileCols);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        // two chains of 4 dpbusd, added: a chain of 8 held a one-row tile on their latency
        // (the integer sums are exact, so the split changes no bit)
        __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m512i xk = _mm512_set1_epi32(dword(qx[i], b, k));
          dot[k & 1] = _mm512_dpbusd_epi32(dot[k & 1], wk[k], xk);
        }
        scaled_vnni(_mm512_add_epi32(dot[0], dot[1]), d16, m16, dx8[i][dx8_pos(b)], s[i][b],
                    acc[i]);
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      store_lanes(out + (r0 + i) * w.N + g * kTileCols, w.lanes(g), acc[i]);
  }

  // What int4_tiles.h's `tiles_amx` asks of the kernel: whole blocks; the activations' int8;
  // a column tile's blocks unpacked once for all the rows into B tiles (the VNNI tile's 8
  // registers as they are) in this thread's buffer; and block b's fp32 steps, the VNNI tile's,
  // on each row's stored dots.
  static constexpr bool kAmxHalves = false;
  static const Act& act_of(const Act& a) { return a; }
  struct Unpacked {
    const uint8_t* values;  // (nb, 8, 64)
    const uint8_t* block(int64_t b) const { return values + b * 8 * 64; }
  };
  QINFER_VNNI static Unpacked amx_tile(const Int4Tiles<S>& w, int64_t g) {
    static thread_local std::vector<uint8_t> buffer;
    buffer.resize(static_cast<size_t>(w.nb * 8 * 64));
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t* src = w.block(g, b);
      prefetch_block(src);
      __m512i wk[8];
      unpack_block_vnni(src, wk);
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) _mm512_storeu_si512(buffer.data() + (b * 8 + k) * 64, wk[k]);
    }
    return {buffer.data()};
  }
  QINFER_VNNI QINFER_INLINE static void amx_steps(const Int4Tiles<S>& w, const Unpacked&,
                                                  int64_t g, int64_t b, const int32_t* dot,
                                                  const int32_t*, const float* dx, const float* s,
                                                  const Act&, int64_t, int64_t,
                                                  __m512 (&acc)[kAmxRows]) {
    const __m512 d16 = scales16(w.d_of(g, b), kTileCols);
    const __m512 m16 = offsets16(w.m_of(g, b), w.d_of(g, b), 0, kTileCols);
    #pragma GCC unroll 16
    for (int i = 0; i < kAmxRows; ++i)
      scaled_vnni(_mm512_load_si512(dot + i * kTileCols), d16, m16, dx[i], s[i], acc[i]);
  }
  QINFER_VNNI QINFER_INLINE static __m512 amx_out(const Unpacked&, __m512 acc) { return acc; }

  // A block's exact int32 dot per lane for half a tile (8 columns): the unpacked nibbles wk
  // (u8) by the row's 8 activation dwords, broadcast. vpmaddubsw into int16 pairs, the 8
  // summed in int16 (each at most 2 * 15 * 128, all 8 under 2^15: exact), then vpmaddwd;
  struct DotMaddubs {
    QINFER_AVX2 static QINFER_INLINE __m256i dot(const __m256i (&wk)[8], const int8_t* qx,
                                                 int64_t b) {
      __m256i pairs = _mm256_maddubs_epi16(wk[0], _mm256_set1_epi32(dword(qx, b, 0)));
      #pragma GCC unroll 8
      for (int k = 1; k < 8; ++k)
        pairs = _mm256_add_epi16(pairs,
                                 _mm256_maddubs_epi16(wk[k], _mm256_set1_epi32(dword(qx, b, k))));
      return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    }
  };
  // or, on a CPU with AVX-VNNI, vpdpbusd in two chains of 4, added: the same exact dot.
  struct DotVnni256 {
    QINFER_AVXVNNI static inline __m256i dot(const __m256i (&wk)[8], const int8_t* qx,
                                             int64_t b) {
      __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k)
        dot[k & 1] = _mm256_dpbusd_avx_epi32(dot[k & 1], wk[k], _mm256_set1_epi32(dword(qx, b, k)));
      return _mm256_add_epi32(dot[0], dot[1]);
    }
  };

  // R rows by half h of tile g (8 columns): per block, its 4 registers unpacked once for the
  // R rows, each row's exact dot per lane (Dot), scaled into the row's accumulator.
  template <int R, typename Dot>
  QINFER_AVX2 QINFER_INLINE static void tile_half(const Int4Tiles<S>& w, int64_t g, int64_t h,
                                                  const Act& a, int64_t r0, float* out) {
    const int64_t nb = w.nb;
    const auto [qx, dx8, s] = Q8Rows<R>(a, r0);
    __m256 acc[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = w.block(g, b);
      prefetch_block(src);
      __m256i wk[8];
      unpack_block_avx2(src, h, wk);
      const __m256 d8 = scales8(w.d_of(g, b) + 8 * h, 8);
      const __m256 m8 = offsets8(w.m_of(g, b, 8 * h), w.d_of(g, b) + 8 * h, 0, 8);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const __m256i dot = Dot::dot(wk, qx[i], b);
        const __m256 scale = _mm256_mul_ps(d8, _mm256_set1_ps(dx8[i][dx8_pos(b)]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[i]);
        acc[i] = _mm256_fmadd_ps(m8, _mm256_set1_ps(s[i][b]), acc[i]);
      }
    }
    const int64_t lanes = std::min<int64_t>(8, w.lanes(g) - 8 * h);
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
      store_lanes(out + (r0 + i) * w.N + g * kTileCols + 8 * h, lanes, acc[i]);
  }

  // The AVX2 tile: vpmaddubsw, or AVX-VNNI's 256-bit vpdpbusd where the CPU has it (the same
  // bits; `avx_vnni_usable`).
  template <int R>
  QINFER_AVX2 static void tile_avx2(const Int4Tiles<S>& w, int64_t g, int64_t h, const Act& a,
                                    int64_t r0, float* out) {
    if (avx_vnni_usable()) return tile_avx_vnni<R>(w, g, h, a, r0, out);
    tile_half<R, DotMaddubs>(w, g, h, a, r0, out);
  }
  // (flatten: DotVnni256's dot inlined into the tile, which takes its target)
  template <int R>
  QINFER_AVXVNNI __attribute__((flatten)) static void tile_avx_vnni(
      const Int4Tiles<S>& w, int64_t g, int64_t h, const Act& a, int64_t r0, float* out) {
    tile_half<R, DotVnni256>(w, g, h, a, r0, out);
  }

  // The reference path: one output at a time, block by block.
  static void dot_scalar(const Int4Tiles<S>& w, int64_t n, const Act& a, int64_t r, float* out) {
    const int64_t g = n / kTileCols, l = n % kTileCols;
    const int8_t* qx = a.row_qx(r);
    const float* dx8 = a.row_dx8(r);
    const float* s = a.row_s(r);
    float acc = 0.0f;
    for (int64_t b = 0; b < w.nb; ++b) {
      int32_t dot = 0;
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = w.byte(n, b, j);
        dot += (byte & 15) * qx[qx_pos(b, j)] + (byte >> 4) * qx[qx_pos(b, j + 16)];
      }
      acc = std::fma(static_cast<float>(dot), widen(w.d_of(g, b)[l]) * dx8[dx8_pos(b)], acc);
      acc = std::fma(offset(w.m_of(g, b), w.d_of(g, b), l), s[b], acc);
    }
    out[r * w.N + n] = acc;
  }
};

}  // namespace

void check_int4_tiles(const char* op, const at::Tensor& x, const at::Tensor& qs,
                      const at::Tensor& d, const c10::optional<at::Tensor>& m, int64_t n) {
  TORCH_CHECK(n >= 0, op, ": n (the weight's columns) must be >= 0, got ", n);
  const int64_t K = x.size(1), nb = K / kBlock, G = (n + kTileCols - 1) / kTileCols;
  // "(G, K/32 * 256) for x's K = 96 and n = 16 columns in tiles of 16, G = 1"
  const auto layout = [&](int64_t per_block) {
    return [=] {
      return "(G, K/32 * " + std::to_string(per_block) + ") for x's K = " + std::to_string(K) +
             " and n = " + std::to_string(n) + " columns in tiles of 16, G = " + std::to_string(G);
    };
  };
  check_tensor(op, "qs", qs, at::kByte, G, nb * kTileBytes, layout(kTileBytes));
  check_scales(op, "d", d, G, nb * kTileCols, layout(kTileCols));
  if (m) check_tensor(op, "m", *m, d.scalar_type(), G, nb * kTileCols, layout(kTileCols));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_int4(const at::Tensor& q_in,
                                                         const at::Tensor& scales_in,
                                                         const at::Tensor& zeros_in) {
  TORCH_CHECK(q_in.dim() == 2, "pack_int4: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0), K = q_in.size(1);
  TORCH_CHECK(K > 0 && K % kBlock == 0,
              "pack_int4: q's K must be a positive multiple of 32, got shape ", shape_str(q_in));
  const int64_t nb = K / kBlock, G = (N + kTileCols - 1) / kTileCols;
  const std::string layout = "(N, K/32) for q's shape " + shape_str(q_in);
  check_tensor("pack_int4", "q", q_in, at::kByte, N, K, "(N, K)");
  check_tensor("pack_int4", "scales", scales_in, at::kFloat, N, nb, layout);
  check_tensor("pack_int4", "zeros", zeros_in, at::kFloat, N, nb, layout);
  const at::Tensor q = q_in.contiguous(), sc = scales_in.contiguous(), z = zeros_in.contiguous();
  // the last tile's columns past N: zero nibbles, d and m (0 - 8 * 0: +0, a symmetric m)
  at::Tensor qs = at::zeros({G, nb * kTileBytes}, q.options());
  at::Tensor d = at::zeros({G, nb * kTileCols}, sc.options());
  at::Tensor m = at::zeros({G, nb * kTileCols}, sc.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  uint8_t* qsp = qs.data_ptr<uint8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  uint8_t seen = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kTileCols, l = n % kTileCols;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = qp + n * K + b * kBlock;
      uint8_t* block = qsp + (g * nb + b) * kTileBytes;
      for (int64_t j = 0; j < 16; ++j) {
        seen |= src[j] | src[j + 16];
        const uint8_t byte = static_cast<uint8_t>((src[j] & 15) | (src[j + 16] << 4));
        block[(j >> 2) * 64 + l * 4 + (j & 3)] = byte;  // register j / 4, lane l, byte j % 4
      }
      // (q - 8) * scale + zero = scale * q + (zero - 8 * scale)
      const int64_t at = (g * nb + b) * kTileCols + l;
      dp[at] = sp[n * nb + b];
      mp[at] = zp[n * nb + b] - 8.0f * sp[n * nb + b];
    }
  }
  TORCH_CHECK(seen < 16, "pack_int4: q must hold values 0..15, it has one above 15");
  return {qs, d, m};
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                   const c10::optional<at::Tensor>& m_in, int64_t n,
                   const std::string& path_name_in) {
  check_x("int4_mm", x_in);
  check_int4_tiles("int4_mm", x_in, qs_in, d_in, m_in, n);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const Isa path = resolve_path("int4_mm", path_name_in, kDotPaths);
  const at::Tensor x = x_in.contiguous(), qs = qs_in.contiguous(), d = d_in.contiguous(),
                   m = m_in ? m_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0 || n == 0) return out;
  static thread_local ActStorage storage;
  const Act act = storage.make(M, K);
  quantize(x, act, vector_isa(path));
  with_scales(d, [&](auto tag) {
    using S = decltype(tag);
    tiles_matmul<Int4Q8<S>>(path, int4_tiles<S>(qs, d, m, n), M, act, out.data_ptr<float>());
  });
  return out;
}

}  // namespace qinfer_kernels
