// int4 groups x int8 activations on AMX-INT8 tiles (int4_amx.cpp): the int4_mm path "amx"
// takes for calls of kAmxRows rows or more, to the bits of its VNNI tiles (int4_q8.cpp).
#pragma once

#include <cstdint>

#include "matmul.h"
#include "q8.h"

namespace qinfer_kernels {

// Rows from which int4_mm's "amx" path multiplies on tiles (fewer take VNNI's tiles, the same
// bits). Measured (bench/int4_paths.py, Qwen3-0.6B's qkv 4096 x 1024 and down 1024 x 3072, 1
// thread, an AMX Xeon, shared): AMX / VNNI time 1.9x at 16 rows and 1.3x at 24 (a step
// multiplies 32 rows, padding included), 1.0x at 32, 0.96x and 0.83x at 64, 0.65x and 0.78x at
// 512. Ties go to VNNI (no tile state to save at each switch of threads).
constexpr int64_t kAmxRows = 64;
// Rows of activations the tiles read at a time (2 tiles of 16).
constexpr int64_t kAmxSpan = 32;

// out (M, N) = w (N, K) x a (M, K)^T, a in the row's own order (q8.h's Natural) with rows up
// to M rounded up to kAmxSpan allocated (read, their outputs unused). Needs supports(Isa::Amx).
template <typename S>
void int4_mm_amx(const Int4Packed<S>& w, int64_t N, int64_t M, const Act& a, float* out);

}  // namespace qinfer_kernels
