// The int4 weight's column tiles: the layout pack_int4 writes (int4_q8.cpp), which both int4
// ops read (int4_mm there, int4_groups_mm in int4_groups.cpp), and the driver that splits an
// output's tiles between threads. docs/KERNELS.md says why this layout.
//
// Layout: the N output columns in tiles of 16 (the last padded with zero columns), G of them;
// per tile and block b of 32 input columns, 256 bytes: 4 registers of 64 bytes, register r's
// dword lane l holding bytes 4r..4r+3 of column 16g + l's block, where byte j of a block holds
// its element j in the low nibble and j + 16 in the high one (llama.cpp's Q4 layout). So one
// 64-byte load gives 4 elements of 16 columns at once, its low nibbles elements 4r..4r+3 and
// its high ones 16 + 4r..: each lane is a column, and a block's dot product stays in its lane
// (no transposes, no horizontal sums); AVX2 reads a tile as two halves of 8 columns (bytes
// 32h..32h+31 of each register). The scales d (and offsets m, none for a symmetric weight) of
// block b are 16 in a row, one a lane: (G, nb * 16), fp16 or fp32 (matmul.h's S).
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx.h"
#include "matmul.h"

namespace qinfer_kernels {

constexpr int64_t kTileCols = 16;                // columns per tile: a 512-bit register's dwords
constexpr int64_t kTileBytes = kTileCols * 16;  // one block of a tile: 256 bytes

template <typename S>
struct Int4Tiles {
  const uint8_t* qs;  // (G, nb * 256)
  const S* d;         // (G, nb * 16)
  const S* m;         // (G, nb * 16), or null: symmetric (m = 0 - 8 d, `offset`)
  int64_t nb;         // blocks per column (K / 32)
  int64_t N;          // columns (the last tile's lanes past N are padding)
  int64_t G;          // tiles
  const uint8_t* block(int64_t g, int64_t b) const { return qs + (g * nb + b) * kTileBytes; }
  const S* d_of(int64_t g, int64_t b) const { return d + (g * nb + b) * kTileCols; }
  // m of block b from lane `lane` on, or null (symmetric)
  const S* m_of(int64_t g, int64_t b, int64_t lane = 0) const {
    return m ? m + (g * nb + b) * kTileCols + lane : nullptr;
  }
  // byte j (0..15) of column n's block b, for the scalar paths
  uint8_t byte(int64_t n, int64_t b, int64_t j) const {
    return block(n / kTileCols, b)[(j >> 2) * 64 + (n % kTileCols) * 4 + (j & 3)];
  }
  // the output lanes of tile g that are real columns (16, or fewer in the last tile)
  int64_t lanes(int64_t g) const { return std::min(kTileCols, N - g * kTileCols); }
};

// qs, d and m (none: symmetric) of an int4 weight of n columns in the tiles' layout, checked
// against x (M, K) for `op`.
void check_int4_tiles(const char* op, const at::Tensor& x, const at::Tensor& qs,
                      const at::Tensor& d, const c10::optional<at::Tensor>& m, int64_t n);

template <typename S>
Int4Tiles<S> int4_tiles(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        int64_t n) {
  return {qs.data_ptr<uint8_t>(), d.data_ptr<S>(), m.defined() ? m.data_ptr<S>() : nullptr,
          d.size(1) / kTileCols, n, qs.size(0)};
}

// What an int4 kernel's tiles read of tile g (`tile` in `tiles_matmul`): the weight's own
// column tiles, as they are. The int4 kernels derive from it.
template <typename S>
struct OnInt4Tiles {
  static constexpr bool kAmx = false;  // no AMX tiles (int4_q8.cpp's kernel has them)
  static const Int4Tiles<S>& tile(const Int4Tiles<S>& w, int64_t, Isa, int64_t) { return w; }
};

// f(std::integral_constant<int, r>) for r = min(rows, R): a tile of that many rows.
template <int R, typename F>
QINFER_INLINE void with_rows(int64_t rows, F&& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// How far ahead of its reads a tile fetches the weight: 16 blocks (their compute outlasts a
// read from memory even for one row; past the tile's end it fetches the next tile, which
// follows it). At 512 bytes, tiles of 8 rows read their weights from memory at 18-19 GB/s
// (Qwen3-0.6B's shapes, cold, 2 threads, AMD EPYC Zen 4), at 4,096 at 30-37.
constexpr int64_t kTilePrefetch = 4096;

// Fetches the tile's block kTilePrefetch bytes ahead of src (its 4 lines; the tiles' blocks
// follow each other, so it is the one stream a tile reads).
QINFER_INLINE void prefetch_block(const uint8_t* src) {
  #pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(src + 64 * r + kTilePrefetch), _MM_HINT_T0);
}

// A tile's 4 registers of block b unpacked: wk[k] for k < 4 the low nibbles of register k
// (elements 4k..4k+3 of each lane's column), for k >= 4 the high ones of register k - 4
// (elements 16 + 4(k - 4)..): the u8 operand of the activations' dword k of the block.
QINFER_VNNI QINFER_INLINE void unpack_block_vnni(const uint8_t* src, __m512i (&wk)[8]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  #pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const __m512i p = _mm512_loadu_si512(src + 64 * r);
    wk[r] = _mm512_and_si512(p, low4);
    wk[4 + r] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
  }
}
// The same for half h of a tile (8 columns), AVX2.
QINFER_AVX2 QINFER_INLINE void unpack_block_avx2(const uint8_t* src, int64_t h, __m256i (&wk)[8]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  #pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * r + 32 * h));
    wk[r] = _mm256_and_si256(p, low4);
    wk[4 + r] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
  }
}

// Stores a tile's row: its real lanes of out (16 on VNNI, 8 on AVX2).
QINFER_VNNI QINFER_INLINE void store_lanes(float* out, int64_t lanes, __m512 v) {
  _mm512_mask_storeu_ps(out, lanes >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << lanes) - 1), v);
}
QINFER_AVX2 QINFER_INLINE void store_lanes(float* out, int64_t lanes, __m256 v) {
  if (lanes >= 8) _mm256_storeu_ps(out, v);
  else _mm256_maskstore_ps(out, first_dwords(lanes), v);
}

// Block b's product(s) for group `group` of rows into dots: its halves on sets 0 and 1, or the
// whole block on set b % 2.
template <bool Halves, typename Unit, typename T>
QINFER_AMX QINFER_INLINE void amx_products(const T& t, const AmxActs& acts, int64_t group,
                                           int64_t b, int32_t (&dots)[2][kAmxRows * kTileCols]) {
  const int8_t* qa = acts.tile(group, b);
  const uint8_t* qw = t.block(b);
  if constexpr (Halves) {
    Unit::template product<0>(qa, qw, dots[0]);
    Unit::template product<1>(qa + kBlock / 2, qw + 4 * 64, dots[1]);
  } else if (b & 1) {
    Unit::template product<1>(qa, qw, dots[1]);
  } else {
    Unit::template product<0>(qa, qw, dots[0]);
  }
}

// Column tiles g0..g1 by rows m0..m1 on AMX tiles (Unit: amx.h's tile unit or its model), to
// the bits of the kernel's VNNI tile: per column tile, its B tiles (`amx_tile(w, g)`: each
// block 8 rows of 64 bytes, the VNNI tile's 8 registers), then per group of 16 rows each
// block's exact int32 dots from TDPBSUD (one product of the block, or with kAmxHalves one per
// half block on the two sets), stored and taken through the VNNI tile's fp32 steps
// (`amx_steps`) into the rows' accumulators, and the rows' outputs (`amx_out`) stored. Whole
// blocks issue block b + 1's product before block b's steps, on the other set of tiles.
template <typename Kernel, typename Unit, typename W, typename A>
QINFER_AMX void tiles_amx(const W& w, int64_t g0, int64_t g1, const AmxActs& acts, const A& a,
                          int64_t m0, int64_t m1, float* out) {
  constexpr bool halves = Kernel::kAmxHalves;
  alignas(64) int32_t dots[2][kAmxRows * kTileCols];  // each set's C (16 rows x 16 int32)
  for (int64_t g = g0; g < g1; ++g) {
    const auto t = Kernel::amx_tile(w, g);
    // configured after amx_tile's calls and released at the tile's end: the ABI keeps no
    // tile state across a call
    Unit::configure(TileConfig(halves ? 16 : 32));
    for (int64_t group = 0; group * kAmxRows < m1 - m0; ++group) {
      const int64_t r0 = m0 + group * kAmxRows, rows = std::min(kAmxRows, m1 - r0);
      __m512 acc[kAmxRows];
      #pragma GCC unroll 16
      for (int i = 0; i < kAmxRows; ++i) acc[i] = _mm512_setzero_ps();
      if constexpr (!halves) amx_products<halves, Unit>(t, acts, group, 0, dots);
      for (int64_t b = 0; b < w.nb; ++b) {
        if constexpr (halves) amx_products<halves, Unit>(t, acts, group, b, dots);
        else if (b + 1 < w.nb) amx_products<halves, Unit>(t, acts, group, b + 1, dots);
        Kernel::amx_steps(w, t, g, b, dots[halves ? 0 : b & 1], halves ? dots[1] : nullptr,
                          acts.dx_of(group, b), acts.s_of(group, b), a, r0, rows, acc);
      }
      #pragma GCC unroll 16
      for (int i = 0; i < kAmxRows; ++i)
        if (i < rows)
          store_lanes(out + (r0 + i) * w.N + g * kTileCols, w.lanes(g), Kernel::amx_out(t, acc[i]));
    }
    Unit::release();
  }
}

// out (M, N) = the kernel's weight w (N, K) times its activations a (M, K), transposed. A
// Kernel (int4_q8.cpp's, int4_groups.cpp's, int8_q8.cpp's) has the weights its tiles read
// for column tile g (`tile(w, g, path, M)`: the int4 tiles as they are, int8 rows staged into
// tiles), a tile of up to kRowsVnni rows by a whole tile of columns on VNNI (`tile_vnni<R>(t,
// g, a, r0, out)`), of up to kRowsAvx2 rows by half a tile on AVX2 (`tile_avx2<R>(t, g, h, a,
// r0, out)`), one output at a time from w (`dot_scalar(w, n, a, r, out)`), its activations'
// bytes an element (kActivationBytes: 1 for int8, 4 for fp32), and, where kAmx, what
// `tiles_amx` asks of it (above), which the path "amx" takes for passes of kAmxFromRows rows
// or more (their int8 activations: `act_of(a)`; a shorter last pass takes the VNNI tiles).
// Threads take whole column tiles, each tile all the rows of a pass while its weights stay in
// cache. Every output takes the same steps whichever tile, thread or row count computes it.
template <typename Kernel, typename W, typename A>
void tiles_matmul(Isa path, const W& w, int64_t M, const A& a, float* out) {
  const int64_t K = w.nb * kBlock;
  const bool amx = Kernel::kAmx && path == Isa::Amx && M >= kAmxFromRows;
  path = vector_isa(path);
  const int64_t step = amx ? kAmxRows : Kernel::kRowsVnni;
  // Rows a pass: their activations (~256 KB) stay in L2 while every column tile passes over
  // them. One pass over all of a long prompt's rows read them again for each column tile,
  // from memory: 2,048 rows ran at half the rate of 256. (At least the rows AMX's tiles take,
  // on their path: past K = 8,192 a pass of 256 KB is shorter.)
  const int64_t chunk = std::max<int64_t>(
      amx ? kAmxFromRows : step, (int64_t{1} << 18) / (K * Kernel::kActivationBytes) / step * step);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    // enough tiles per task that the pool's wake-up is paid for
    const int64_t work = std::max<int64_t>(1, (m1 - m0) * K * kTileCols);  // a tile's multiply-adds
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / work);
    if constexpr (Kernel::kAmx) {
      if (amx && m1 - m0 >= kAmxFromRows) {
        static thread_local AmxActs storage;
        storage.make(Kernel::act_of(a), m0, m1);
        const AmxActs& acts = storage;  // the caller's (a thread_local's name is each thread's)
        at::parallel_for(0, w.G, grain, [&](int64_t g0, int64_t g1) {
          if (amx_unit() == AmxUnit::Hardware)
            tiles_amx<Kernel, AmxHardware>(w, g0, g1, acts, a, m0, m1, out);
          else tiles_amx<Kernel, AmxModel>(w, g0, g1, acts, a, m0, m1, out);
        });
        continue;
      }
    }
    at::parallel_for(0, w.G, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        if (path == Isa::Scalar) {
          for (int64_t r = m0; r < m1; ++r)
            for (int64_t n = g * kTileCols; n < g * kTileCols + w.lanes(g); ++n)
              Kernel::dot_scalar(w, n, a, r, out);
          continue;
        }
        const auto& t = Kernel::tile(w, g, path, m1 - m0);
        if (path == Isa::Vnni) {
          for (int64_t r0 = m0; r0 < m1; r0 += Kernel::kRowsVnni)
            with_rows<Kernel::kRowsVnni>(m1 - r0, [&](auto rows) {
              Kernel::template tile_vnni<decltype(rows)::value>(t, g, a, r0, out);
            });
        } else {
          for (int64_t h = 0; h < 2 && 8 * h < w.lanes(g); ++h)
            for (int64_t r0 = m0; r0 < m1; r0 += Kernel::kRowsAvx2)
              with_rows<Kernel::kRowsAvx2>(m1 - r0, [&](auto rows) {
                Kernel::template tile_avx2<decltype(rows)::value>(t, g, h, a, r0, out);
              });
        }
      }
    });
  }
}

}  // namespace qinfer_kernels
