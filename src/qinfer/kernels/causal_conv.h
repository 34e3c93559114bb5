// The Gated DeltaNet's causal depthwise conv with SiLU, compiled (causal_conv.cpp): the op
// causal_conv1d, and the same for one decode token inside gated_delta_decode
// (gated_delta.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "isa.h"

namespace qinfer_kernels {

// taps (K, C) and the windows pool (P, K - 1, C), fp32 checked by the caller, checked for
// `op` (one line per refusal: contiguous, K >= 2, the shapes agree); returns K.
int64_t check_conv(const char* op, const at::Tensor& taps, const at::Tensor& windows, int64_t C);

// S sequences of L tokens: sequence s's token t reads its C channels at x + s * x_seq +
// t * x_row; taps (K, C); the windows pool (P, K - 1, C), sequence s's at row rows[s],
// updated in place; out (S, L, C) contiguous. `path`: isa.h's vector ladder.
void causal_conv_silu(Isa path, const float* x, int64_t x_seq, int64_t x_row, int64_t S,
                      int64_t L, const float* taps, int64_t K, float* windows,
                      const std::vector<int64_t>& rows, int64_t C, float* out);

}  // namespace qinfer_kernels
