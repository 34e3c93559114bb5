// Activations rounded to int8 per block of 32, as llama.cpp's Q8_1 (what int4_q8.cpp and
// int8_q8.cpp multiply by; quantize_q8.cpp makes them). See docs/KERNELS.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "matmul.h"

namespace qinfer_kernels {

struct Act {
  int64_t nb;   // blocks per row (K / 32)
  int64_t np;   // pairs per row (nb rounded up, halved)
  int64_t nbs;  // s entries per row (nb rounded up to 16)
  int8_t* qx;   // (M, np * 64)
  float* dx8;   // (M, np * 8)
  float* s;     // (M, nbs)
  int8_t* row_qx(int64_t r) const { return qx + r * np * 64; }
  float* row_dx8(int64_t r) const { return dx8 + r * np * 8; }
  float* row_s(int64_t r) const { return s + r * nbs; }
};

// Where element j (0..31) of block b lands in a row's qx: the row's own order.
inline int64_t qx_pos(int64_t b, int64_t j) { return b * kBlock + j; }

// Dword k of a row's block b, its elements 4k..4k+3 (a copy: the int8 buffer read as int32).
QINFER_INLINE int32_t dword(const int8_t* qx, int64_t b, int k) {
  int32_t v;
  std::memcpy(&v, qx + qx_pos(b, 4 * k), sizeof v);
  return v;
}

// Where block b's scale dx lies in a row's dx8 (the first of its 4 copies: a pair's 8 lanes
// hold block 2p's dx four times, then 2p + 1's).
inline int64_t dx8_pos(int64_t b) { return (b >> 1) * 8 + (b & 1) * 4; }

// A tile's R rows of the activations (from row r0), for the tile to copy into locals
// (`const auto [qx, dx8, s] = Q8Rows<R>(a, r0)`; matmul.h says why).
template <int R>
struct Q8Rows {
  const int8_t* qx[R];
  const float* dx8[R];
  const float* s[R];
  QINFER_INLINE Q8Rows(const Act& a, int64_t r0) {
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      qx[i] = a.row_qx(r0 + i);
      dx8[i] = a.row_dx8(r0 + i);
      s[i] = a.row_s(r0 + i);
    }
  }
};

// The activation buffers of this calling thread, grown as needed and kept between calls (a
// decode step makes hundreds of calls; an allocation each costs more than a small one's work).
struct ActStorage {
  std::vector<int8_t> qx;
  std::vector<float> dx8, s;
  Act make(int64_t M, int64_t K) {
    Act a;
    a.nb = K / kBlock;
    a.np = (a.nb + 1) / 2;
    a.nbs = (a.nb + 15) / 16 * 16;
    qx.resize(static_cast<size_t>(M * a.np * 64));
    dx8.resize(static_cast<size_t>(M * a.np * 8));
    s.resize(static_cast<size_t>(M * a.nbs));
    a.qx = qx.data();
    a.dx8 = dx8.data();
    a.s = s.data();
    return a;
  }
};

// x (M, K) contiguous fp32 or bf16 into `a` with the path's own ISA, in parallel over rows.
// dx_out / sum_out (M, K/32) are optional (quantize_q8_1, the tests' reference, reads them).
void quantize(const at::Tensor& x, const Act& a, Isa path, float* dx_out = nullptr,
              int32_t* sum_out = nullptr);

}  // namespace qinfer_kernels
