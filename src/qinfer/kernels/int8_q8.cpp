// int8 weights (N, K) with one scale per output row or per block of 32 or 16 x int8
// activations on integer dot products, as llama.cpp's q8_0 dot: the op int8_mm.
// docs/KERNELS.md says what it computes.
//
// The weight stays as the layer holds it: rows of int8 values (or Q6_K's packed 6-bit ones,
// q6.h). A thread takes 16 columns at a time and first stages them in a small buffer of its
// own, in the column tiles of the int4 weights (int4_tiles.h): per block of 32, 8 registers
// of 64 bytes, register k's dword lane l holding elements 4k..4k+3 of column l's block. Each
// row of activations then multiplies all 16 columns with one dpbusd per dword (a lane is a
// column: no horizontal sums), and every row tile of the call reuses the staged columns. The
// staging is a transpose of 8 x 8 dwords per half tile and block, paid once a call for every
// row (at 32 rows a few percent of the products; at one row under the weights' read).
//
// Per output (r, n), on every path, in this order (fp32, no contraction):
//     acc = 0
//     for each block b of 32:
//         lo = q[n, b, 0:16] . qx[r, b, 0:16],  hi = q[n, b, 16:32] . qx[r, b, 16:32]   (exact)
//         blocks of 32: acc = fma(float(lo + hi), d[n, b] * dx[r, b], acc)
//         blocks of 16: acc = fma(float(lo), d[n, 2b] * dx[r, b], acc)
//                       acc = fma(float(hi), d[n, 2b + 1] * dx[r, b], acc)
//         rows:         acc = fma(float(lo + hi), dx[r, b], acc)
//     out = acc, times scale[n] for rows
// So the VNNI tile (16 columns), the AVX2 tile (8) and the scalar path give the same bits at
// any row count, thread count and split of the columns.
//
// The signed x signed products go through unsigned x signed instructions. VNNI's dpbusd: the
// staged weights made unsigned (q + 128: the top bit flipped as they are staged), each row's
// half-block dot started from -128 sum(qx) over its 16 elements (`ActQ8::corr`, once a call
// per row), so (q + 128) . qx - 128 sum(qx) is q . qx exactly. AVX2's maddubs: llama.cpp's
// q8_0 trick, |q| (unsigned; -128's is 128) times qx with q's sign (128 * 127 * 2 < 2^15: no
// saturation), then madd's pairs into dwords.

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

#include "int4_tiles.h"
#include "int8_scales.h"
#include "matmul.h"
#include "ops.h"
#include "q8.h"

namespace qinfer_kernels {
namespace {

constexpr int64_t kStagedBlock = 8 * 64;  // a staged tile's bytes per block: 8 registers

// The weight as the layer holds it. B = 0: one scale per row (scale.d (N,)); B = 32 or 16:
// per block of B (d (N, K/B)); S = int8_t: Q6_K's sub-scales (B = 16) with q its packed
// 6-bit values (q6.h).
template <int B, typename S>
struct Int8Weight {
  static_assert(B == 0 || B == 16 || B == 32, "int8 rows (B = 0) or blocks of 16 or 32");
  static_assert(!kSub<S> || B == 16, "int8 sub-scales are per block of 16");
  static constexpr int kB = B;
  static constexpr int64_t kScales = B == 0 ? 0 : kBlock / B;  // scales per block of 32
  const int8_t* q;       // (N, K), or Q6_K's packed bytes (N, 3K/4)
  BlockScales<S> scale;  // (N,) rows, or (N, K/B) blocks
  int64_t nb;            // blocks of 32 per column
  int64_t N;
  int64_t G;             // column tiles of 16
  int64_t lanes(int64_t g) const { return std::min(kTileCols, N - g * kTileCols); }
  // value k of column n (the scalar path)
  int8_t value(int64_t n, int64_t k) const {
    const int64_t K = nb * kBlock;
    if constexpr (kSub<S>)
      return q6_value(reinterpret_cast<const uint8_t*>(q) + n * q6_row_bytes(K), k);
    else return q[n * K + k];
  }
  // scale i of column n (block scale i, or the row's for B = 0), exactly in fp32
  float scale_of(int64_t n, int64_t i) const {
    if constexpr (B == 0) return block_scale(scale, n);
    else return block_scale(scale.column(n, nb * kScales), i);
  }
};

// Column tile g as its tiles read it (`Int8Q8::tile`): the values staged in this thread's
// buffer (per block 512 bytes, register k's lane l = dword k of column l's block), or null
// where the VNNI tile transposes them from w as it goes (calls of one row tile, up to 8 rows:
// a store and a reload of each block would cost more than their products); d the lanes'
// scales as fp32 (nb, kScales, 16) or, for rows, (16,).
template <int B, typename S>
struct Staged {
  const Int8Weight<B, S>& w;
  const uint8_t* values;
  const float* d;
  const uint8_t* block(int64_t b) const { return values + b * kStagedBlock; }
};

// A row's activations with the corrections the VNNI tile starts from: corr[r, 2b + h] = -128
// times the sum of qx over half h of block b.
struct ActQ8 {
  Act a;
  const int32_t* corr;  // (M, 2 nb)
  const int32_t* row_corr(int64_t r) const { return corr + r * 2 * a.nb; }
};

// Rows 0..7 of 8 dwords each -> rows[k] = dword k of every row (an 8 x 8 transpose).
QINFER_AVX2 QINFER_INLINE void transpose8x8(__m256i (&rows)[8]) {
  __m256i t[8], u[8];
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  #pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  #pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    rows[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
    rows[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
  }
}

// Rows 0..15 of 16 dwords each -> rows[j] = dword j of every row (a 16 x 16 transpose: the
// dwords in pairs, then quads, then 128-bit lanes twice).
QINFER_VNNI QINFER_INLINE void transpose16x16(__m512i (&rows)[16]) {
  __m512i t[16], u[16];
  #pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  // u[4i + e], lane q: rows 4i..4i + 3's dword 4q + e
  #pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // lane q of the four groups' u[. + e] -> dword 4q + e
  #pragma GCC unroll 4
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    rows[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    rows[8 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    rows[4 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    rows[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Column n's blocks 2p and 2p + 1 in order (int8 values; zero past the column's blocks).
template <int B, typename S>
QINFER_VNNI QINFER_INLINE __m512i column_pair_vnni(const Int8Weight<B, S>& w, int64_t n,
                                                   int64_t p) {
  if constexpr (kSub<S>) {
    return q6_in_order(q6_unpack64(reinterpret_cast<const uint8_t*>(w.q) +
                                   n * q6_row_bytes(w.nb * kBlock) + p * kQ6Bytes));
  } else {
    const int8_t* src = w.q + n * w.nb * kBlock + p * 64;
    return 2 * p + 1 < w.nb ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src);
  }
}
template <int B, typename S>
QINFER_AVX2 QINFER_INLINE void column_pair_avx2(const Int8Weight<B, S>& w, int64_t n, int64_t p,
                                                __m256i (&pair)[2]) {
  if constexpr (kSub<S>) {
    q6_unpack64(reinterpret_cast<const uint8_t*>(w.q) + n * q6_row_bytes(w.nb * kBlock) +
                    p * kQ6Bytes,
                pair);
    q6_in_order(pair);
  } else {
    const int8_t* src = w.q + n * w.nb * kBlock + p * 64;
    pair[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    pair[1] = 2 * p + 1 < w.nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32))
                               : _mm256_setzero_si256();
  }
}

// Fetches the next column tile's share of pair p: a tile's columns are one contiguous run of
// rows, 16 pairs of bytes a pair of blocks, so while tile g's pairs are staged the next
// tile's arrive line by line (short rows left the first pairs of every column cold where
// each column fetched only its own bytes ahead). Into L2, not L1: a tile of 16 rows of K
// bytes (16 KB at K = 1,024) fetched into L1 beside the tile being read evicts the lines
// it has still to read (docs/BENCHMARKS.md: the one-row Q8_0 head ran ~1.4x faster from
// memory). Addresses as integers: past the last tile they lie outside the weight, where a
// prefetch never faults.
template <int B, typename S>
QINFER_INLINE void prefetch_next_tile(const Int8Weight<B, S>& w, int64_t g, int64_t p) {
  const int64_t pair = kSub<S> ? kQ6Bytes : 64;
  const int64_t row = kSub<S> ? q6_row_bytes(w.nb * kBlock) : w.nb * kBlock;
  prefetch_span<_MM_HINT_T1>(
      reinterpret_cast<uintptr_t>(w.q) +
          static_cast<uintptr_t>((g + 1) * kTileCols * row + p * kTileCols * pair),
      kTileCols * pair);
}

// Pair p of column tile g as the VNNI tile reads it: rows[k] for k < 8 register k of block 2p
// (lane l = dword k of column l's block), rows[8 + k] block 2p + 1's, a 16 x 16 transpose of
// the columns' 64 bytes, the top bit flipped (dpbusd's unsigned operand); the last tile's
// missing columns are zero. stage_values_vnni stores them for every pair at q.
template <int B, typename S>
QINFER_VNNI QINFER_INLINE void pair_vnni(const Int8Weight<B, S>& w, int64_t g, int64_t p,
                                         __m512i (&rows)[16]) {
  const int64_t lanes = w.lanes(g), n0 = g * kTileCols;
  prefetch_next_tile(w, g, p);
  #pragma GCC unroll 16
  for (int c = 0; c < 16; ++c)
    rows[c] = c < lanes ? column_pair_vnni(w, n0 + c, p) : _mm512_setzero_si512();
  transpose16x16(rows);
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  #pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) rows[k] = _mm512_xor_si512(rows[k], top);
}

template <int B, typename S>
QINFER_VNNI void stage_values_vnni(const Int8Weight<B, S>& w, int64_t g, uint8_t* q) {
  for (int64_t p = 0; p < (w.nb + 1) / 2; ++p) {
    __m512i rows[16];
    pair_vnni(w, g, p, rows);
    uint8_t* dst = q + 2 * p * kStagedBlock;  // blocks 2p (dwords 0..7), 2p + 1 (8..15)
    #pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) _mm512_storeu_si512(dst + 64 * k, rows[k]);
  }
}

// The same for AVX2, the values as they are (signed): an 8 x 8 transpose per half tile and
// block.
template <int B, typename S>
QINFER_AVX2 void stage_values_avx2(const Int8Weight<B, S>& w, int64_t g, uint8_t* q) {
  const int64_t np = (w.nb + 1) / 2, lanes = w.lanes(g), n0 = g * kTileCols;
  for (int64_t p = 0; p < np; ++p) {
    prefetch_next_tile(w, g, p);
    #pragma GCC unroll 2
    for (int64_t h = 0; h < 2; ++h) {
      __m256i pair[8][2];  // columns 8h..8h + 7's blocks 2p, 2p + 1
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        if (8 * h + c < lanes) {
          column_pair_avx2(w, n0 + 8 * h + c, p, pair[c]);
        } else {
          pair[c][0] = pair[c][1] = _mm256_setzero_si256();
        }
      }
      #pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        __m256i rows[8];
        #pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) rows[c] = pair[c][j];
        transpose8x8(rows);
        uint8_t* dst = q + (2 * p + j) * kStagedBlock + 32 * h;
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * k), rows[k]);
      }
    }
  }
}

// The lanes' scales of column tile g as fp32 at d: (nb, kScales, 16), or the rows' (16,); zero
// for the last tile's missing columns. 8 scales of 8 columns at a time, transposed as the
// values are.
template <int B, typename S>
QINFER_AVX2 void stage_scales(const Int8Weight<B, S>& w, int64_t g, float* d) {
  const int64_t lanes = w.lanes(g), n0 = g * kTileCols, count = w.nb * Int8Weight<B, S>::kScales;
  if constexpr (B == 0) {
    for (int64_t l = 0; l < kTileCols; ++l) d[l] = l < lanes ? w.scale_of(n0 + l, 0) : 0.0f;
    return;
  }
  // the next tile's scales (its columns' rows of d follow these), fetched while this tile
  // runs: read at a tile's start, they stalled every tile on memory (the one-row Q8_0 head
  // of Qwen3-0.6B: 4.4-4.8 -> 3.3-4.3 ms)
  const uintptr_t next = static_cast<uintptr_t>((n0 + kTileCols) * count);
  prefetch_span(reinterpret_cast<uintptr_t>(w.scale.d) + next * sizeof(S),
                kTileCols * count * static_cast<int64_t>(sizeof(S)));
  if constexpr (kSub<S>) {
    prefetch_span(reinterpret_cast<uintptr_t>(w.scale.super) +
                      next / kSubScales * sizeof(at::Half),
                  kTileCols * count / kSubScales * static_cast<int64_t>(sizeof(at::Half)));
  }
  for (int64_t i = 0; i < count; i += 8) {
    #pragma GCC unroll 2
    for (int64_t h = 0; h < 2; ++h) {
      __m256i rows[8];
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const int64_t l = 8 * h + c;
        rows[c] = l < lanes
            ? _mm256_castps_si256(scales8(w.scale.column(n0 + l, count), i, count - i))
            : _mm256_setzero_si256();
      }
      transpose8x8(rows);
      #pragma GCC unroll 8
      for (int j = 0; j < 8 && i + j < count; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (i + j) * kTileCols + 8 * h), rows[j]);
    }
  }
}

template <int B, typename S>
struct Int8Q8 {
  static constexpr int64_t L = Int8Weight<B, S>::kScales;
  static constexpr int kRowsVnni = 8;  // 8 weight registers, 8 accumulators, the dots
  static constexpr bool kAmx = true;
  static constexpr int kRowsAvx2 = 2;  // AVX2's 16 registers: the 8 weights and their |q|
  static constexpr int64_t kActivationBytes = 1;

  // Column tile g for the path's tiles of M rows in all, staged in this thread's buffers.
  static Staged<B, S> tile(const Int8Weight<B, S>& w, int64_t g, Isa path, int64_t M) {
    static thread_local std::vector<uint8_t> values;
    static thread_local std::vector<float> scales;
    scales.resize(static_cast<size_t>(L == 0 ? kTileCols : w.nb * L * kTileCols));
    stage_scales(w, g, scales.data());
    if (path == Isa::Vnni && M <= kRowsVnni) return {w, nullptr, scales.data()};
    values.resize(static_cast<size_t>((w.nb + 1) / 2 * 2 * kStagedBlock));
    if (path == Isa::Vnni) stage_values_vnni(w, g, values.data());
    else stage_values_avx2(w, g, values.data());
    return {w, values.data(), scales.data()};
  }

  // acc += block b's exact half-block dots (16 columns a lane) times their scales: d16's
  // lanes (the tile's staged scales) times the row's dx.
  QINFER_VNNI QINFER_INLINE static void scaled_vnni(const __m512i (&dot)[2], const float* d16,
                                                    int64_t b, float dx, __m512& acc) {
    const __m512 x = _mm512_set1_ps(dx);
    if constexpr (L == 2) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(d16 + 2 * b * kTileCols), x);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(d16 + (2 * b + 1) * kTileCols), x);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0]), lo, acc);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[1]), hi, acc);
    } else {
      const __m512 scale = L == 1 ? _mm512_mul_ps(_mm512_loadu_ps(d16 + b * kTileCols), x) : x;
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[0], dot[1])), scale, acc);
    }
  }

  // Block b of R rows: wk its 8 registers (as staged); each row's 8 activation dwords
  // broadcast into two chains of 4 dpbusd (the block's halves) started from the row's
  // corrections.
  template <int R>
  QINFER_VNNI QINFER_INLINE static void block_vnni(const __m512i* wk, const float* d16, int64_t b,
                                                   const Q8Rows<R>& x,
                                                   const int32_t* const (&corr)[R],
                                                   __m512 (&acc)[R]) {
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      __m512i dot[2] = {_mm512_set1_epi32(corr[i][2 * b]), _mm512_set1_epi32(corr[i][2 * b + 1])};
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const __m512i xk = _mm512_set1_epi32(dword(x.qx[i], b, k));
        dot[k / 4] = _mm512_dpbusd_epi32(dot[k / 4], wk[k], xk);
      }
      scaled_vnni(dot, d16, b, x.dx8[i][dx8_pos(b)], acc[i]);
    }
  }

  // One row by tile g's 16 columns as the weight holds them, pair p of blocks: each column's
  // 64 bytes (top bit flipped: dpbusd's unsigned operand) against the row's in one dpbusd,
  // then the 16 columns' dword sums added within each half block in a transposing tree (a
  // quarter of the shuffles of transposing the weights, which one row does not repay); the
  // corrections make each sum the exact q . qx of its half block.
  QINFER_VNNI QINFER_INLINE static void row_pair_vnni(const Int8Weight<B, S>& w, int64_t g,
                                                      int64_t p, const int8_t* qx,
                                                      const int32_t* corr, __m512i (&half)[4]) {
    const int64_t lanes = w.lanes(g), n0 = g * kTileCols;
    const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
    const __m512i xp = _mm512_loadu_si512(qx + p * 64);
    prefetch_next_tile(w, g, p);
    __m512i v[16];
    #pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      v[c] = _mm512_setzero_si512();  // a column past the weight's last: no read
      if (c < lanes)
        v[c] = _mm512_dpbusd_epi32(v[c], _mm512_xor_si512(column_pair_vnni(w, n0 + c, p), top), xp);
    }
    // a[i], per 128-bit lane: columns 2i, 2i + 1's dwords added in pairs
    __m512i a[8];
    #pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    // q[j], lane t: dword c = the sum of column 4j + c's lane t (half block t: block 2p + t / 2)
    __m512i q[4];
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      q[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * j], a[2 * j + 1]),
                              _mm512_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
    const __m512i e0 = _mm512_shuffle_i32x4(q[0], q[1], 0x88);
    const __m512i e1 = _mm512_shuffle_i32x4(q[0], q[1], 0xDD);
    const __m512i e2 = _mm512_shuffle_i32x4(q[2], q[3], 0x88);
    const __m512i e3 = _mm512_shuffle_i32x4(q[2], q[3], 0xDD);
    // half[t]: half block t's sums of the 16 columns, in column order
    half[0] = _mm512_shuffle_i32x4(e0, e2, 0x88);
    half[2] = _mm512_shuffle_i32x4(e0, e2, 0xDD);
    half[1] = _mm512_shuffle_i32x4(e1, e3, 0x88);
    half[3] = _mm512_shuffle_i32x4(e1, e3, 0xDD);
    #pragma GCC unroll 4
    for (int t = 0; t < 4; ++t)
      half[t] = _mm512_add_epi32(half[t], _mm512_set1_epi32(corr[4 * p + t]));
  }

  // R rows by the 16 columns of tile g, block by block: from the staged values, or each pair
  // of blocks transposed from the weight as it is read.
  template <int R>
  QINFER_VNNI static void tile_vnni(const Staged<B, S>& t, int64_t g, const ActQ8& a, int64_t r0,
                                    float* out) {
    const int64_t nb = t.w.nb;
    const Q8Rows<R> x(a.a, r0);
    const int32_t* corr[R];
    __m512 acc[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      corr[i] = a.row_corr(r0 + i);
      acc[i] = _mm512_setzero_ps();
    }
    if (t.values != nullptr) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* src = t.block(b);
        __m512i wk[8];
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) wk[k] = _mm512_loadu_si512(src + 64 * k);
        block_vnni<R>(wk, t.d, b, x, corr, acc);
      }
    } else if constexpr (R == 1) {
      for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
        __m512i half[4];
        row_pair_vnni(t.w, g, p, x.qx[0], corr[0], half);
        const __m512i first[2] = {half[0], half[1]}, second[2] = {half[2], half[3]};
        scaled_vnni(first, t.d, 2 * p, x.dx8[0][dx8_pos(2 * p)], acc[0]);
        if (2 * p + 1 < nb)
          scaled_vnni(second, t.d, 2 * p + 1, x.dx8[0][dx8_pos(2 * p + 1)], acc[0]);
      }
    } else {
      for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
        __m512i rows[16];
        pair_vnni(t.w, g, p, rows);
        block_vnni<R>(rows, t.d, 2 * p, x, corr, acc);
        if (2 * p + 1 < nb) block_vnni<R>(rows + 8, t.d, 2 * p + 1, x, corr, acc);
      }
    }
    const __m512 rows = L == 0 ? _mm512_loadu_ps(t.d) : _mm512_setzero_ps();
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      store_lanes(out + (r0 + i) * t.w.N + g * kTileCols, t.w.lanes(g),
                  L == 0 ? _mm512_mul_ps(acc[i], rows) : acc[i]);
  }

  // What int4_tiles.h's `tiles_amx` asks of the kernel: half blocks where a block has two
  // scales (L = 2); the activations' int8; the VNNI tile's staged values (top bit flipped, so
  // TDPBSUD's unsigned B) as B tiles; and block b's fp32 steps, the VNNI tile's, on each row's
  // stored dots plus its corrections (rows past the call's: none). For whole blocks the two
  // corrections are added to the one product: the same exact int32 as the VNNI tile's halves.
  static constexpr bool kAmxHalves = L == 2;
  static const Act& act_of(const ActQ8& a) { return a.a; }
  static Staged<B, S> amx_tile(const Int8Weight<B, S>& w, int64_t g) {
    return tile(w, g, Isa::Vnni, kAmxFromRows);
  }
  QINFER_VNNI QINFER_INLINE static void amx_steps(const Int8Weight<B, S>&, const Staged<B, S>& t,
                                                  int64_t, int64_t b, const int32_t* lo,
                                                  const int32_t* hi, const float* dx,
                                                  const float*, const ActQ8& a, int64_t r0,
                                                  int64_t rows, __m512 (&acc)[kAmxRows]) {
    #pragma GCC unroll 16
    for (int i = 0; i < kAmxRows; ++i) {
      const int32_t* corr = i < rows ? a.row_corr(r0 + i) + 2 * b : nullptr;
      const __m512i first = _mm512_set1_epi32(corr ? corr[0] : 0);
      const __m512i second = _mm512_set1_epi32(corr ? corr[1] : 0);
      const __m512i dot[2] = {
          _mm512_add_epi32(_mm512_load_si512(lo + i * kTileCols), first),
          L == 2 ? _mm512_add_epi32(_mm512_load_si512(hi + i * kTileCols), second) : second};
      scaled_vnni(dot, t.d, b, dx[i], acc[i]);
    }
  }
  QINFER_VNNI QINFER_INLINE static __m512 amx_out(const Staged<B, S>& t, __m512 acc) {
    return L == 0 ? _mm512_mul_ps(acc, _mm512_loadu_ps(t.d)) : acc;
  }

  // R rows by half h of tile g (8 columns): per dword k, maddubs of |q| and the row's
  // broadcast qx with q's sign, madd'ed into the dword's exact int32 sum of 4 products.
  template <int R>
  QINFER_AVX2 static void tile_avx2(const Staged<B, S>& t, int64_t g, int64_t h, const ActQ8& a,
                                    int64_t r0, float* out) {
    const int64_t nb = t.w.nb;
    const __m256i ones = _mm256_set1_epi16(1);
    const auto [qx, dx8, s] = Q8Rows<R>(a.a, r0);
    __m256 acc[R];
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* src = t.block(b) + 32 * h;
      __m256i wk[8], magnitude[8];
      #pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        wk[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * k));
        magnitude[k] = _mm256_abs_epi8(wk[k]);
      }
      __m256 d[2];
      #pragma GCC unroll 2
      for (int j = 0; j < L; ++j) d[j] = _mm256_loadu_ps(t.d + (b * L + j) * kTileCols + 8 * h);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m256i xk = _mm256_sign_epi8(_mm256_set1_epi32(dword(qx[i], b, k)), wk[k]);
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[k], xk);
          dot[k / 4] = _mm256_add_epi32(dot[k / 4], _mm256_madd_epi16(pairs, ones));
        }
        const __m256 dx = _mm256_set1_ps(dx8[i][dx8_pos(b)]);
        if constexpr (L == 2) {
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0]), _mm256_mul_ps(d[0], dx), acc[i]);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1]), _mm256_mul_ps(d[1], dx), acc[i]);
        } else {
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(dot[0], dot[1]));
          acc[i] = _mm256_fmadd_ps(sum, L == 1 ? _mm256_mul_ps(d[0], dx) : dx, acc[i]);
        }
      }
    }
    const int64_t lanes = std::min<int64_t>(8, t.w.lanes(g) - 8 * h);
    const __m256 rows = L == 0 ? _mm256_loadu_ps(t.d + 8 * h) : _mm256_setzero_ps();
    #pragma GCC unroll 4
    for (int i = 0; i < R; ++i)
      store_lanes(out + (r0 + i) * t.w.N + g * kTileCols + 8 * h, lanes,
                  L == 0 ? _mm256_mul_ps(acc[i], rows) : acc[i]);
  }

  // The reference path: one output at a time, block by block, from the weight as held.
  static void dot_scalar(const Int8Weight<B, S>& w, int64_t n, const ActQ8& a, int64_t r,
                         float* out) {
    const int8_t* qx = a.a.row_qx(r);
    const float* dx8 = a.a.row_dx8(r);
    float acc = 0.0f;
    for (int64_t b = 0; b < w.nb; ++b) {
      int32_t dot[2] = {0, 0};
      for (int64_t j = 0; j < kBlock; ++j)
        dot[j / 16] += w.value(n, b * kBlock + j) * qx[qx_pos(b, j)];
      const float dx = dx8[dx8_pos(b)];
      if constexpr (L == 2) {
        acc = std::fma(static_cast<float>(dot[0]), w.scale_of(n, 2 * b) * dx, acc);
        acc = std::fma(static_cast<float>(dot[1]), w.scale_of(n, 2 * b + 1) * dx, acc);
      } else {
        const float sum = static_cast<float>(dot[0] + dot[1]);
        acc = std::fma(sum, L == 1 ? w.scale_of(n, b) * dx : dx, acc);
      }
    }
    out[r * w.N + n] = L == 0 ? acc * w.scale_of(n, 0) : acc;
  }
};

// corr (M, 2 nb) for the activations a (see ActQ8), and two zeros after it: a one-row tile
// reads a pair's four at once, past an odd last block too.
void corrections(const Act& a, int64_t M, std::vector<int32_t>& corr) {
  corr.assign(static_cast<size_t>(M * 2 * a.nb + 2), 0);
  int32_t* out = corr.data();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t h = 0; h < 2 * a.nb; ++h) {
        int32_t sum = 0;
        for (int64_t j = 0; j < 16; ++j) sum += a.row_qx(r)[qx_pos(h / 2, 16 * (h % 2) + j)];
        out[r * 2 * a.nb + h] = -128 * sum;
      }
  });
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
  static thread_local std::vector<int32_t> corr;
  const Act a = storage.make(M, K);
  quantize(x, a, vector_isa(path));
  corrections(a, M, corr);
  const ActQ8 act{a, corr.data()};
  with_block_scales(sc, [&](auto tag) {
    using S = decltype(tag);
    const BlockScales<S> scales{sc.data_ptr<S>(), super_data(d_super)};
    const int64_t G = (N + kTileCols - 1) / kTileCols;
    const auto run = [&](auto rows) {
      using W = decltype(rows);
      tiles_matmul<Int8Q8<W::kB, S>>(path, W{values_data(q), scales, K / kBlock, N, G}, M, act,
                                     out.data_ptr<float>());
    };
    if constexpr (kSub<S>) {  // blocks of 16: checked_super_scales
      run(Int8Weight<16, S>{});
    } else if (B == 32) {
      run(Int8Weight<32, S>{});
    } else if (B == 16) {
      run(Int8Weight<16, S>{});
    } else {
      run(Int8Weight<0, S>{});
    }
  });
  return out;
}

}  // namespace qinfer_kernels
