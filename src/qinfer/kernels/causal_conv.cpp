// The Gated DeltaNet's causal depthwise conv with SiLU over a prompt's tokens, continuing
// from each sequence's window: the op causal_conv1d (docs/KERNELS.md; the torch form is
// qinfer/attention/deltanet.py's `causal_conv1d`, whose tap-by-tap order it keeps).
//
//   causal_conv1d(x, taps, windows, slots) -> out
//     x (S, L, C) fp32, the channels of each token contiguous; taps (K, C) fp32 contiguous
//     (the conv's weight transposed); windows (P, K - 1, C) fp32 contiguous, the pool of
//     the last K - 1 inputs before each sequence's tokens, row slots[s] sequence s's,
//     replaced by the last K - 1 of its window and x together; out (S, L, C) fp32
//
// Per (sequence, token t, channel c), with the inputs x_{t-K+1}..x_t (those before the
// prompt from the window):
//   sum = x_{t-K+1}[c] taps[0][c]; sum = sum + x_{t-K+1+j}[c] taps[j][c] for j = 1.. K - 1
//   out[t][c] = sum / (1 + exp_fp32(-sum))   (SiLU; common.h's exp, within 2 ulp of exp)
// Each channel is its own lane, so the loops compiled for AVX-512, AVX2 and scalar round
// alike; a (sequence, chunk of channels) is one task, so each sequence's bits do not depend
// on the batch or the thread count.
//
// Why: torch runs it as a concatenation, K multiply-adds over the whole (S, L, C) and a
// SiLU, each a pass over memory (a 512-token prompt of Qwen3.5's 6,144 channels: 12 MiB a
// pass); here each output is made in one pass from the rows it reads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "causal_conv.h"
#include "common.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

// One sequence's channels [c0, c1): its L tokens (x, row stride x_row), then its window.
QINFER_INLINE void conv_channels(const float* __restrict__ x, int64_t x_row, int64_t L,
                                 const float* __restrict__ taps, int64_t K,
                                 float* __restrict__ window, int64_t C, int64_t c0, int64_t c1,
                                 float* __restrict__ out) {
  for (int64_t t = 0; t < L; ++t) {
    float* __restrict__ o = out + t * C;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t i = t - (K - 1) + j;  // the input's token; before 0: the window's
      const float* __restrict__ src = i < 0 ? window + (K - 1 + i) * C : x + i * x_row;
      const float* __restrict__ tap = taps + j * C;
      if (j == 0) {
        for (int64_t c = c0; c < c1; ++c) o[c] = src[c] * tap[c];
      } else {
        for (int64_t c = c0; c < c1; ++c) o[c] = o[c] + src[c] * tap[c];
      }
    }
    for (int64_t c = c0; c < c1; ++c) o[c] = o[c] / (1.0f + exp_fp32(-o[c]));
  }
  // the window: the last K - 1 rows of [window; x]
  const size_t bytes = static_cast<size_t>(c1 - c0) * sizeof(float);
  for (int64_t j = 0; j < K - 1; ++j) {
    const int64_t i = L + j;  // row j of the new window: row i of [window; x]
    if (i < K - 1) std::memmove(window + j * C + c0, window + i * C + c0, bytes);
    else std::memcpy(window + j * C + c0, x + (i - (K - 1)) * x_row + c0, bytes);
  }
}

#define QINFER_CONV_LOOPS(NAME, TARGET)                                                     \
  struct NAME {                                                                             \
    TARGET static void run(const float* x, int64_t x_row, int64_t L, const float* taps,     \
                           int64_t K, float* window, int64_t C, int64_t c0, int64_t c1,     \
                           float* out) {                                                    \
      conv_channels(x, x_row, L, taps, K, window, C, c0, c1, out);                          \
    }                                                                                       \
  };
QINFER_CONV_LOOPS(ConvScalar, )
QINFER_CONV_LOOPS(ConvAvx2, QINFER_AVX2)
QINFER_CONV_LOOPS(ConvAvx512, QINFER_AVX512)

template <typename Loops>
void run(const float* x, int64_t x_seq, int64_t x_row, int64_t S, int64_t L, const float* taps,
         int64_t K, float* windows, const std::vector<int64_t>& rows, int64_t C, float* out) {
  // tasks of 256 channels of a sequence: each channel's window read and written by its own
  constexpr int64_t kChannels = 256;
  const int64_t chunks = (C + kChannels - 1) / kChannels;
  at::parallel_for(0, S * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / chunks, c0 = task % chunks * kChannels;
      Loops::run(x + s * x_seq, x_row, L, taps, K, windows + rows[s] * (K - 1) * C, C, c0,
                 std::min(C, c0 + kChannels), out + s * L * C);
    }
  });
}

}  // namespace

int64_t check_conv(const char* op, const at::Tensor& taps, const at::Tensor& windows, int64_t C) {
  TORCH_CHECK(taps.dim() == 2 && taps.size(0) >= 2 && taps.size(1) == C && taps.is_contiguous(),
              op, ": taps must be contiguous (K, ", C, ") with K >= 2, got ", shape_str(taps));
  const int64_t K = taps.size(0);
  TORCH_CHECK(windows.dim() == 3 && windows.size(1) == K - 1 && windows.size(2) == C &&
                  windows.is_contiguous(),
              op, ": windows must be a contiguous pool (P, ", K - 1, ", ", C, "), got ",
              shape_str(windows));
  return K;
}

void causal_conv_silu(Isa path, const float* x, int64_t x_seq, int64_t x_row, int64_t S,
                      int64_t L, const float* taps, int64_t K, float* windows,
                      const std::vector<int64_t>& rows, int64_t C, float* out) {
  switch (path) {
    case Isa::Avx512: run<ConvAvx512>(x, x_seq, x_row, S, L, taps, K, windows, rows, C, out); break;
    case Isa::Avx2: run<ConvAvx2>(x, x_seq, x_row, S, L, taps, K, windows, rows, C, out); break;
    default: run<ConvScalar>(x, x_seq, x_row, S, L, taps, K, windows, rows, C, out);
  }
}

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& taps, const at::Tensor& windows,
                         const at::Tensor& slots) {
  const char* op = "causal_conv1d";
  check_fp32_cpu(op, {{"x", &x}, {"taps", &taps}, {"windows", &windows}});
  TORCH_CHECK(taps.dim() == 2, op, ": taps must be (K, C), got ", shape_str(taps));
  const int64_t C = taps.size(1);
  TORCH_CHECK(x.dim() == 3 && x.size(2) == C && x.stride(2) == 1, op, ": x must be (S, L, ", C,
              ") for taps' ", C, " channels, each token's contiguous, got ", shape_str(x));
  const int64_t S = x.size(0), L = x.size(1);
  const int64_t K = check_conv(op, taps, windows, C);
  const std::vector<int64_t> rows = checked_slots(op, slots, S, windows.size(0));
  at::Tensor out = at::empty({S, L, C}, x.options());
  if (S * L * C == 0) return out;
  causal_conv_silu(best(kVectorPaths), x.data_ptr<float>(), x.stride(0), x.stride(1), S, L,
                   taps.data_ptr<float>(), K, windows.data_ptr<float>(), rows, C,
                   out.data_ptr<float>());
  return out;
}

}  // namespace qinfer_kernels
