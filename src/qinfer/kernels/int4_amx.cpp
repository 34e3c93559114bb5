// int4 groups x int8 activations on AMX-INT8 tiles, to the bits of the VNNI tiles of
// int4_q8.cpp (docs/KERNELS.md): the same exact int32 dot product of each block, then the same
// fp32 operations in the same order for each output.
//
// The VNNI tile keeps, per output, 16 fp32 lanes; lane l takes the blocks b = l, l + 16, ...
// in that order: acc_l = fma(float(dot_b), d_b * dx_b, acc_l), then acc_l = fma(m_b, s_b,
// acc_l) for the same blocks, and the output is _mm512_reduce_add_ps's tree over the lanes.
// Here a tile of 16 rows x 16 columns computes one block's dot products at a time (TDPBSUD:
// the activations' signed bytes times the nibbles as unsigned bytes), so the loops run lane by
// lane, each lane's blocks in order, with the 16 rows' accumulators in registers as vectors
// over the 16 columns; then the lanes are summed in the reduction's tree.
//
// Layouts: A (a tile of 16 rows x 32 bytes): one block of 16 rows of qx, read in place.
// B (8 rows x 64 bytes, VNNI-4): row k, dword n: elements 4k..4k+3 of column n's block,
// unpacked from the nibbles once per 16 columns for all blocks into a buffer of the thread's
// (nb * 512 bytes), with the columns' d and m widened to fp32 and transposed (nb x 16).

#include "int4_amx.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace qinfer_kernels {
namespace {

constexpr int kTile = 16;  // rows and columns of a tile

// The tile configuration (ldtilecfg's 64 bytes, palette 1): tmm0 C (16 rows x 16 int32),
// tmm1 A (16 rows x 32 bytes), tmm2 B (8 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 32, 64};
  uint8_t rows[16] = {16, 16, 8};
};

// The thread's B tiles and transposed scales for 16 columns from n0 (nc of them real).
struct Columns {
  std::vector<uint8_t> b;  // (nb, 8, 64)
  std::vector<float> d, m;  // (nb, 16)
};

template <typename S>
QINFER_AMX void unpack_columns(const Int4Packed<S>& w, int64_t n0, int64_t nc, Columns& cols) {
  const int64_t nb = w.nb;
  cols.b.resize(static_cast<size_t>(nb * 512));
  cols.d.resize(static_cast<size_t>(nb * kTile));
  cols.m.resize(static_cast<size_t>(nb * kTile));
  const __mmask16 real = static_cast<__mmask16>((1u << nc) - 1);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // dword q of each column's block 0 (a column is nb * 4 dwords)
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(nb * 4)));
  const int* base = reinterpret_cast<const int*>(w.qs + n0 * nb * 16);
  for (int64_t blk = 0; blk < nb; ++blk) {
    uint8_t* tile = cols.b.data() + blk * 512;
    for (int q = 0; q < 4; ++q) {
      const __m512i index = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(blk * 4 + q)));
      const __m512i packed =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, index, base, 4);
      _mm512_storeu_si512(tile + q * 64, _mm512_and_si512(packed, low4));
      _mm512_storeu_si512(tile + (q + 4) * 64,
                          _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
    }
    for (int j = 0; j < kTile; ++j) {
      const bool in = j < nc;
      cols.d[blk * kTile + j] = in ? widen(w.d[(n0 + j) * nb + blk]) : 0.0f;
      cols.m[blk * kTile + j] = in ? widen(w.m[(n0 + j) * nb + blk]) : 0.0f;
    }
  }
}

// out's rows m0..m0 + rows - 1, columns n0..n0 + nc - 1, from the unpacked columns.
QINFER_AMX void tile_rows(const Columns& cols, int64_t nb, const Act& a, int64_t m0, int64_t rows,
                          int64_t n0, int64_t nc, float* out, int64_t ldo) {
  alignas(64) int32_t dots[kTile * kTile];
  alignas(64) float lanes[kTile][kTile][kTile];  // (lane, row, column)
  const int64_t stride = a.np * 64;  // bytes between rows of qx
  const int8_t* qx = a.row_qx(m0);
  const float* dx8[kTile];
  const float* s[kTile];
  for (int i = 0; i < kTile; ++i) {
    dx8[i] = a.row_dx8(m0 + i);
    s[i] = a.row_s(m0 + i);
  }
  for (int64_t l = 0; l < kTile; ++l) {
    __m512 acc[kTile];
    #pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = l; b < nb; b += kTile) {
      _tile_zero(0);
      _tile_loadd(1, qx + b * kBlock, stride);
      _tile_loadd(2, cols.b.data() + b * 512, 64);
      _tile_dpbsud(0, 1, 2);
      _tile_stored(0, dots, 64);
      const __m512 d = _mm512_loadu_ps(cols.d.data() + b * kTile);
      const int64_t at = (b >> 1) * 8 + (b & 1) * 4;  // dx of block b in a row's dx8
      #pragma GCC unroll 16
      for (int i = 0; i < kTile; ++i) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots + i * kTile));
        acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx8[i][at])), acc[i]);
      }
    }
    for (int64_t b = l; b < nb; b += kTile) {
      const __m512 m = _mm512_loadu_ps(cols.m.data() + b * kTile);
      #pragma GCC unroll 16
      for (int i = 0; i < kTile; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[i][b]), acc[i]);
    }
    #pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i) _mm512_store_ps(lanes[l][i], acc[i]);
  }
  // _mm512_reduce_add_ps's tree: lanes l + 8 and l, then + 4, then + 2, then + 1
  const __mmask16 real = static_cast<__mmask16>((1u << nc) - 1);
  for (int64_t i = 0; i < rows; ++i) {
    __m512 t[8];
    for (int l = 0; l < 8; ++l)
      t[l] = _mm512_add_ps(_mm512_load_ps(lanes[l + 8][i]), _mm512_load_ps(lanes[l][i]));
    for (int l = 0; l < 4; ++l) t[l] = _mm512_add_ps(t[l + 4], t[l]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]));
    _mm512_mask_storeu_ps(out + (m0 + i) * ldo + n0, real, sum);
  }
}

// One thread's column tiles t0..t1 - 1, all rows: its own tile configuration, released after.
template <typename S>
QINFER_AMX void column_tiles(const Int4Packed<S>& w, int64_t N, int64_t M, const Act& a,
                             float* out, int64_t t0, int64_t t1) {
  static thread_local Columns cols;
  const TileConfig config;
  _tile_loadconfig(&config);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTile, nc = std::min<int64_t>(kTile, N - n0);
    unpack_columns(w, n0, nc, cols);
    for (int64_t m0 = 0; m0 < M; m0 += kTile)
      tile_rows(cols, w.nb, a, m0, std::min<int64_t>(kTile, M - m0), n0, nc, out, N);
  }
  _tile_release();
}

}  // namespace

template <typename S>
void int4_mm_amx(const Int4Packed<S>& w, int64_t N, int64_t M, const Act& a, float* out) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    column_tiles(w, N, M, a, out, t0, t1);
  });
}

template void int4_mm_amx(const Int4Packed<at::Half>&, int64_t, int64_t, const Act&, float*);
template void int4_mm_amx(const Int4Packed<float>&, int64_t, int64_t, const Act&, float*);

}  // namespace qinfer_kernels
