// AMX-INT8's tiles for the int4 and int8 products of enough rows (int4_tiles.h's `tiles_amx`
// drives them), and a software model of the tile unit that the tests run them on where the
// CPU has none.
//
// A tile product here is one block of 32 (or half of one) for 16 rows by one column tile of
// 16 (int4_tiles.h): C (16 rows x 16 int32) = A (16 rows x 32 signed bytes: the rows'
// activations of the block) times B (8 rows x 64 bytes, VNNI-4: row k, dword n = elements
// 4k..4k+3 of column n's block, unsigned: the VNNI tile's 8 registers as they are, int4's
// nibbles or int8's staged values). TDPBSUD leaves in C row i, lane n the same exact int32
// dot product that the VNNI tile's 8 vpdpbusd leave in its lane n for row i, so the fp32 steps
// after it (the same in the same order) give the same bits.
//
// The model (QINFER_AMX=emulate) computes the same four instructions on arrays, per the
// instructions' definitions: TILELOADD / TILESTORED copy the configured rows x bytes from or to
// memory rows `stride` apart, TILEZERO clears, TDPBSUD adds per (m, n) the 4 x K/4 products of
// A's signed bytes by B's unsigned ones. Integer sums are exact, so it gives the hardware's
// bits; it lets a CPU without AMX check the tiles' layout, strides, padding and order.
#pragma once

#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "matmul.h"
#include "q8.h"

namespace qinfer_kernels {

constexpr int64_t kAmxRows = 16;  // rows of a tile product (A's rows)
// Rows from which the "amx" path multiplies on tiles; fewer take the VNNI tiles (the
// same bits). The tiles pay a store and a reload of each product before its fp32 steps, which
// the VNNI tile's registers do not. On an AMX Xeon (bench/int4_paths.py, 1 thread, the old
// layout's tiles of 32 rows) AMX / VNNI time was 1.9x at 16 rows, 1.0x at 32, 0.65-0.83x at
// 64 and 512.
constexpr int64_t kAmxFromRows = 32;

// The tile configuration (LDTILECFG's 64 bytes, palette 1) for products of k bytes of the
// rows (32: a whole block; 16: half a block, for weights with a scale per 16): two sets of C
// (tmm 0 / 3: 16 rows x 64 bytes), A (tmm 1 / 4: 16 rows x k bytes) and B (tmm 2 / 5: k / 4
// rows x 64 bytes), so that one product runs on a set while the fp32 steps read the other's.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int k = 32) {
    for (int set = 0; set < 2; ++set) {
      colsb[3 * set] = 64, rows[3 * set] = 16;
      colsb[3 * set + 1] = static_cast<uint16_t>(k), rows[3 * set + 1] = 16;
      colsb[3 * set + 2] = 64, rows[3 * set + 2] = static_cast<uint8_t>(k / 4);
    }
  }
};

// What a tile kernel asks of the unit: the configuration, and one product on set `Set` of the
// tiles (tmm 3 Set + 0, 1, 2: C, A, B): C = 0, A from a (16 rows 32 bytes apart: `AmxActs`),
// B from b (rows 64 bytes apart), C += A . B (TDPBSUD), C stored to c (16 rows 64 bytes apart).

// The tile unit of the CPU. (GCC's tile intrinsics take the register's number as a literal.
// GCC 12's declare no read of the memory a tile load reads, and only 8 of LDTILECFG's 64
// bytes: the empty asm with a "memory" clobber keeps every store before them, the B tiles' and
// the configuration's, from moving past them.)
struct AmxHardware {
  QINFER_AMX static void configure(const TileConfig& config) {
    asm volatile("" ::: "memory");
    _tile_loadconfig(&config);
  }
  QINFER_AMX static void release() { _tile_release(); }
  template <int Set>
  QINFER_AMX QINFER_INLINE static void product(const int8_t* a, const uint8_t* b, int32_t* c) {
    asm volatile("" ::: "memory");
    if constexpr (Set == 0) {
      _tile_zero(0);
      _tile_loadd(1, a, 32);
      _tile_loadd(2, b, 64);
      _tile_dpbsud(0, 1, 2);
      _tile_stored(0, c, 64);
    } else {
      _tile_zero(3);
      _tile_loadd(4, a, 32);
      _tile_loadd(5, b, 64);
      _tile_dpbsud(3, 4, 5);
      _tile_stored(3, c, 64);
    }
    asm volatile("" ::: "memory");
  }
};

// The software model (see above): this thread's 8 tiles of at most 16 rows x 64 bytes, each
// instruction on the configured rows and bytes of its tiles. What the hardware refuses (a
// fault there) is refused here too, in one line: a configuration other than palette 1 with
// reserved bytes zero and tiles of at most 16 rows x 64 bytes, a tile used unconfigured, and a
// TDPBSUD whose shapes disagree.
struct AmxModel {
  struct State {
    TileConfig config;
    alignas(64) uint8_t tiles[8][16][64];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure(const TileConfig& config) {
    bool reserved_zero = config.start_row == 0;
    for (uint8_t byte : config.reserved) reserved_zero = reserved_zero && byte == 0;
    TORCH_CHECK(config.palette == 1 && reserved_zero, "AMX model: LDTILECFG of a palette ",
                int(config.palette), " or with reserved bytes set");
    for (int t = 0; t < 16; ++t)
      TORCH_CHECK(config.rows[t] <= 16 && config.colsb[t] <= 64 && (t < 8 || config.rows[t] == 0),
                  "AMX model: tile ", t, " configured ", int(config.rows[t]), " rows x ",
                  config.colsb[t], " bytes");
    state().config = config;
  }
  static void release() { std::memset(&state().config, 0, sizeof(TileConfig)); }
  static void configured(int t) {
    const TileConfig& c = state().config;
    TORCH_CHECK(c.palette == 1 && c.rows[t] > 0 && c.colsb[t] > 0, "AMX model: tile ", t,
                " used unconfigured");
  }
  static void zero(int t) {
    configured(t);
    std::memset(state().tiles[t], 0, sizeof state().tiles[t]);
  }
  static void load(int t, const void* src, int64_t stride) {
    configured(t);
    State& s = state();
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(s.tiles[t][r], static_cast<const uint8_t*>(src) + r * stride, s.config.colsb[t]);
  }
  static void store(int t, void* dst, int64_t stride) {
    configured(t);
    State& s = state();
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(static_cast<uint8_t*>(dst) + r * stride, s.tiles[t][r], s.config.colsb[t]);
  }
  // TDPBSUD: C[m][n] += sum over k < A's bytes / 4, i < 4 of A[m][4k + i] (signed) times
  // B[k][4n + i] (unsigned), for C's configured rows and dwords
  static void dpbsud(int c, int a, int b) {
    configured(c), configured(a), configured(b);
    State& s = state();
    const TileConfig& f = s.config;
    TORCH_CHECK(f.rows[c] == f.rows[a] && f.colsb[c] == f.colsb[b] &&
                    f.colsb[a] == 4 * f.rows[b] && f.colsb[a] % 4 == 0 && f.colsb[c] % 4 == 0,
                "AMX model: TDPBSUD of C ", int(f.rows[c]), " x ", f.colsb[c], ", A ",
                int(f.rows[a]), " x ", f.colsb[a], ", B ", int(f.rows[b]), " x ", f.colsb[b]);
    for (int m = 0; m < f.rows[c]; ++m)
      for (int n = 0; n < f.colsb[c] / 4; ++n) {
        int32_t sum;
        std::memcpy(&sum, s.tiles[c][m] + 4 * n, sizeof sum);
        for (int k = 0; k < f.colsb[a] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<int8_t>(s.tiles[a][m][4 * k + i]) *
                   static_cast<int32_t>(s.tiles[b][k][4 * n + i]);
        std::memcpy(s.tiles[c][m] + 4 * n, &sum, sizeof sum);
      }
  }
  template <int Set>
  static void product(const int8_t* a, const uint8_t* b, int32_t* c) {
    zero(3 * Set);
    load(3 * Set + 1, a, 32);
    load(3 * Set + 2, b, 64);
    dpbsud(3 * Set, 3 * Set + 1, 3 * Set + 2);
    store(3 * Set, c, 64);
  }
};

// Rows m0..m1 of the activations laid out for A tiles: per group of 16 rows and block, the
// 16 rows' 32 bytes side by side (one 512-byte tile: rows K bytes apart load a line each, and
// an AMX Xeon's tile loads stalled on them), with their dx and s; rows past m1 zero (their
// products are computed, never stored).
struct AmxActs {
  std::vector<int8_t> qa;    // (groups, nb, 16, 32)
  std::vector<float> dx, s;  // (groups, nb, 16)
  int64_t nb = 0;
  const int8_t* tile(int64_t group, int64_t b) const {
    return qa.data() + (group * nb + b) * kAmxRows * kBlock;
  }
  const float* dx_of(int64_t group, int64_t b) const {
    return dx.data() + (group * nb + b) * kAmxRows;
  }
  const float* s_of(int64_t group, int64_t b) const {
    return s.data() + (group * nb + b) * kAmxRows;
  }

  void make(const Act& a, int64_t m0, int64_t m1) {
    nb = a.nb;
    const int64_t groups = (m1 - m0 + kAmxRows - 1) / kAmxRows, rows = groups * kAmxRows;
    qa.assign(static_cast<size_t>(rows * nb * kBlock), 0);
    dx.assign(static_cast<size_t>(rows * nb), 0.0f);
    s.assign(static_cast<size_t>(rows * nb), 0.0f);
    for (int64_t r = 0; r < m1 - m0; ++r) {
      const int64_t group = r / kAmxRows, i = r % kAmxRows;
      for (int64_t b = 0; b < nb; ++b) {
        std::memcpy(qa.data() + ((group * nb + b) * kAmxRows + i) * kBlock,
                    a.row_qx(m0 + r) + qx_pos(b, 0), kBlock);
        dx[(group * nb + b) * kAmxRows + i] = a.row_dx8(m0 + r)[dx8_pos(b)];
        s[(group * nb + b) * kAmxRows + i] = a.row_s(m0 + r)[b];
      }
    }
  }
};

}  // namespace qinfer_kernels
