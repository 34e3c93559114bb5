// int4 groups x int8 activations on AMX-INT8 tiles, to the bits of the VNNI tiles of
// int4_q8.cpp (docs/KERNELS.md): the same exact int32 dot product of each block, then the same
// fp32 operations in the same order for each output.
//
// The VNNI tile keeps, per output, 16 fp32 lanes; lane l takes the blocks b = l, l + 16, ...
// in that order: acc_l = fma(float(dot_b), d_b * dx_b, acc_l), then acc_l = fma(m_b, s_b,
// acc_l) for the same blocks, and the output is _mm512_reduce_add_ps's tree over the lanes.
// Here a step of 32 rows x 32 columns (2 x 2 tiles of 16 x 16) computes one block's dot
// products at a time (TDPBSUD: the activations' signed bytes times the nibbles as unsigned
// bytes, K = the block's 32), so the loops run lane by lane, each lane's blocks in order, the
// accumulators being vectors over 16 columns; then the lanes are summed in the same tree.
//
// Layouts, made per call: A (16 rows x 32 bytes), one block of 16 rows, contiguous
// (`TileActs`); B (8 rows x 64 bytes, VNNI-4): row k, dword n: elements 4k..4k+3 of column
// n's block, unpacked from the nibbles once per 32 columns for all blocks into a buffer of the
// thread's, with the columns' d and m widened to fp32 side by side (`Columns`; a symmetric
// weight's m made there, `offset`).

#include "int4_amx.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace qinfer_kernels {
namespace {

constexpr int kTile = 16;  // rows and columns of a tile
constexpr int kSpan = 32;  // rows and columns of a step: 2 x 2 tiles

// The tile configuration (ldtilecfg's 64 bytes, palette 1): tmm0-3 C (16 rows x 16 int32:
// rows 0-15 and 16-31 of the step by columns 0-15 and 16-31, tmm 2r + c), tmm4-5 A (16 rows x
// 32 bytes: the two row tiles), tmm6-7 B (8 rows x 64 bytes: the two column tiles). Each A
// and B serves two products: one block's four products run while the loads wait on none.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
};

// The thread's B tiles and transposed scales for 32 columns from n0 (nc of them real).
struct Columns {
  std::vector<uint8_t> b;   // (nb, 2, 8, 64): per block, the two column tiles' B
  std::vector<float> d, m;  // (nb, 32)
};

template <typename S>
QINFER_AMX void unpack_columns(const Int4Packed<S>& w, int64_t n0, int64_t nc, Columns& cols) {
  const int64_t nb = w.nb;
  cols.b.resize(static_cast<size_t>(nb * 1024));
  cols.d.resize(static_cast<size_t>(nb * kSpan));
  cols.m.resize(static_cast<size_t>(nb * kSpan));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // dword q of each column's block 0 (a column is nb * 4 dwords)
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(nb * 4)));
  for (int half = 0; half < 2; ++half) {
    const int64_t real = std::clamp<int64_t>(nc - half * kTile, 0, kTile);
    const __mmask16 mask = static_cast<__mmask16>((1u << real) - 1);
    // the first column's address only where it exists (a pointer past the end is undefined)
    const int* base = reinterpret_cast<const int*>(w.qs + (real ? (n0 + half * kTile) * nb * 16 : 0));
    for (int64_t blk = 0; blk < nb; ++blk) {
      uint8_t* tile = cols.b.data() + (blk * 2 + half) * 512;
      for (int q = 0; q < 4; ++q) {
        const __m512i index =
            _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(blk * 4 + q)));
        const __m512i packed =
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index, base, 4);
        _mm512_storeu_si512(tile + q * 64, _mm512_and_si512(packed, low4));
        _mm512_storeu_si512(tile + (q + 4) * 64,
                            _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
      }
    }
  }
  for (int64_t blk = 0; blk < nb; ++blk)
    for (int j = 0; j < kSpan; ++j) {
      const bool in = j < nc;
      cols.d[blk * kSpan + j] = in ? widen(w.d[(n0 + j) * nb + blk]) : 0.0f;
      cols.m[blk * kSpan + j] = in ? offset(w.m_of(n0 + j), w.d + (n0 + j) * nb, blk) : 0.0f;
    }
}

// The activations laid out for the tiles (from `Act`'s row order, per call): each row tile's
// block as one 512-byte A tile (16 rows x 32 bytes, contiguous: the row order's 16 rows lie
// K bytes apart, one cache line each, and the tile loads stalled on them), and each step's dx
// and dx * sum(qx) per block for its 32 rows side by side.
struct TileActs {
  std::vector<int8_t> qa;  // (Mpad / 16, nb, 16, 32)
  std::vector<float> dx, s;  // (Mpad / 32, nb, 32)
  int64_t nb = 0;
  const int8_t* tile(int64_t m0, int64_t b) const { return qa.data() + ((m0 / kTile) * nb + b) * 512; }
  const float* dx_of(int64_t m0, int64_t b) const { return dx.data() + ((m0 / kSpan) * nb + b) * kSpan; }
  const float* s_of(int64_t m0, int64_t b) const { return s.data() + ((m0 / kSpan) * nb + b) * kSpan; }

  void make(const Act& a, int64_t M) {
    nb = a.nb;
    const int64_t rows = (M + kSpan - 1) / kSpan * kSpan;
    qa.resize(static_cast<size_t>(rows * nb * kBlock));
    dx.resize(static_cast<size_t>(rows * nb));
    s.resize(static_cast<size_t>(rows * nb));
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / (nb * kBlock)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const bool in = r < M;  // rows past M: zeros (their outputs are not stored)
        for (int64_t b = 0; b < nb; ++b) {
          int8_t* dst = qa.data() + ((r / kTile) * nb + b) * 512 + (r % kTile) * kBlock;
          if (in) std::memcpy(dst, a.row_qx(r) + b * kBlock, kBlock);
          else std::memset(dst, 0, kBlock);
          const int64_t at = ((r / kSpan) * nb + b) * kSpan + r % kSpan;
          dx[at] = in ? a.row_dx8(r)[(b >> 1) * 8 + (b & 1) * 4] : 0.0f;
          s[at] = in ? a.row_s(r)[b] : 0.0f;
        }
      }
    });
  }
};

using Vectors = __m512[kSpan][2];  // a step's 32 rows x 2 vectors of 16 columns

// Lane l of the VNNI tile for the step's 32 x 32 outputs: its blocks' products, then their
// offsets, into acc.
QINFER_AMX void lane(const Columns& cols, int64_t nb, const TileActs& a, int64_t m0, int64_t l,
                     Vectors& acc) {
  alignas(64) int32_t dots[4][kTile * kTile];
  for (int i = 0; i < kSpan; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = l; b < nb; b += kTile) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a.tile(m0, b), kBlock);
    _tile_loadd(5, a.tile(m0 + kTile, b), kBlock);
    _tile_loadd(6, cols.b.data() + b * 1024, 64);
    _tile_loadd(7, cols.b.data() + b * 1024 + 512, 64);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    _tile_stored(2, dots[2], 64);
    _tile_stored(3, dots[3], 64);
    const float* dx = a.dx_of(m0, b);
    for (int c = 0; c < 2; ++c) {
      const __m512 d = _mm512_loadu_ps(cols.d.data() + b * kSpan + c * kTile);
      #pragma GCC unroll 16
      for (int i = 0; i < kSpan; ++i) {
        const __m512 dot =
            _mm512_cvtepi32_ps(_mm512_load_si512(dots[(i / kTile) * 2 + c] + (i % kTile) * kTile));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[i]));
        acc[i][c] = _mm512_fmadd_ps(dot, scale, acc[i][c]);
      }
    }
  }
  for (int64_t b = l; b < nb; b += kTile) {
    const float* s = a.s_of(m0, b);
    for (int c = 0; c < 2; ++c) {
      const __m512 m = _mm512_loadu_ps(cols.m.data() + b * kSpan + c * kTile);
      #pragma GCC unroll 16
      for (int i = 0; i < kSpan; ++i) acc[i][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[i]), acc[i][c]);
    }
  }
}

// out's rows m0..m0 + rows - 1, columns n0..n0 + nc - 1, from the unpacked columns. The lanes
// are summed in _mm512_reduce_add_ps's tree (lanes l + 8 and l, then + 4, + 2, + 1): taken in
// bit-reversed order (0, 8, 4, 12, ...), the i-th lane closes the tree's levels that i's low
// set bits say, on a stack of one partial sum per level.
QINFER_AMX void step(const Columns& cols, int64_t nb, const TileActs& a, int64_t m0, int64_t rows,
                     int64_t n0, int64_t nc, float* out, int64_t ldo) {
  Vectors acc, partial[4];
  for (int i = 0; i < kTile; ++i) {
    const int l = ((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3);
    lane(cols, nb, a, m0, l, acc);
    int level = 0;
    for (; i & (1 << level); ++level)
      for (int r = 0; r < kSpan; ++r)
        for (int c = 0; c < 2; ++c) acc[r][c] = _mm512_add_ps(acc[r][c], partial[level][r][c]);
    if (level < 4) std::memcpy(partial[level], acc, sizeof acc);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 2; ++c) {
      const int64_t real = std::clamp<int64_t>(nc - c * kTile, 0, kTile);
      if (real > 0)
        _mm512_mask_storeu_ps(out + (m0 + r) * ldo + n0 + c * kTile,
                              static_cast<__mmask16>((1u << real) - 1), acc[r][c]);
    }
}

// One thread's column steps t0..t1 - 1, all rows: its own tile configuration, released after.
template <typename S>
QINFER_AMX void column_steps(const Int4Packed<S>& w, int64_t N, int64_t M, const TileActs& a,
                             float* out, int64_t t0, int64_t t1) {
  static thread_local Columns cols;
  const TileConfig config;
  _tile_loadconfig(&config);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kSpan, nc = std::min<int64_t>(kSpan, N - n0);
    unpack_columns(w, n0, nc, cols);
    for (int64_t m0 = 0; m0 < M; m0 += kSpan)
      step(cols, w.nb, a, m0, std::min<int64_t>(kSpan, M - m0), n0, nc, out, N);
  }
  _tile_release();
}

}  // namespace

template <typename S>
void int4_mm_amx(const Int4Packed<S>& w, int64_t N, int64_t M, const Act& a, float* out) {
  static thread_local TileActs storage;
  storage.make(a, M);
  const TileActs& acts = storage;  // the caller's (a thread_local's name is each thread's own)
  const int64_t steps = (N + kSpan - 1) / kSpan;
  at::parallel_for(0, steps, 1, [&](int64_t t0, int64_t t1) {
    column_steps(w, N, M, acts, out, t0, t1);
  });
}

template void int4_mm_amx(const Int4Packed<at::Half>&, int64_t, int64_t, const Act&, float*);
template void int4_mm_amx(const Int4Packed<float>&, int64_t, int64_t, const Act&, float*);

}  // namespace qinfer_kernels
