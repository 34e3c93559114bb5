// int4 groups x int8 activations on AMX-INT8 tiles (int4_amx.cpp): the int4_mm path "amx"
// takes for calls of kAmxRows rows or more, to the bits of its VNNI tiles (int4_q8.cpp).
#pragma once

#include <cstdint>

#include "matmul.h"
#include "q8.h"

namespace qinfer_kernels {

// Rows from which int4_mm's "amx" path multiplies on tiles (fewer take VNNI's tiles, the same
// bits). A tile holds 16 rows: below that it multiplies padding, and the tiles' per-block
// epilogue outweighs what they save (bench/int4_dot_kernel.py, docs/BENCHMARKS.md).
constexpr int64_t kAmxRows = 16;
// Rows of activations the tiles read at a time (2 tiles of 16).
constexpr int64_t kAmxSpan = 32;

// out (M, N) = w (N, K) x a (M, K)^T, a in the row's own order (q8.h's Natural) with rows up
// to M rounded up to kAmxSpan allocated (read, their outputs unused). Needs supports(Isa::Amx).
template <typename S>
void int4_mm_amx(const Int4Packed<S>& w, int64_t N, int64_t M, const Act& a, float* out);

}  // namespace qinfer_kernels
