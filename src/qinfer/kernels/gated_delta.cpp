// The gated delta rule token by token over an fp32 state: the op gated_delta_recurrent
// (docs/KERNELS.md; the torch form is qinfer/attention/deltanet.py's
// `recurrent_gated_delta_rule`).
//
//   gated_delta_recurrent(q, k, v, g, beta, state) -> out
//     q, k (B, L, H, Dk) fp32, L2-normalised (q not yet scaled); v (B, L, H, Dv) fp32;
//     g, beta (B, L, H) fp32: each token's log decay and write strength;
//     state (B, H, Dk, Dv) fp32 contiguous: the state before the L tokens, overwritten with
//     the state after them; out (B, L, H, Dv) fp32
//
// Per (sequence, head), per token in order, with a = exp(g), q' = q * Dk^-0.5 and S the
// state before the token:
//   kS[j] = sum_i k[i] S[i, j],  qS[j] = sum_i q'[i] S[i, j]   (i = 0, 1, ... in order)
//   qk = sum_i q'[i] k[i]                                       (i in order, one scalar sum)
//   delta[j] = (v[j] - a kS[j]) beta
//   out[j] = a qS[j] + qk delta[j]
//   S[i, j] <- a S[i, j] + k[i] delta[j]
// Each j is a lane of its own (no sum across j), so the loops compiled for AVX-512 and AVX2
// round exactly as the scalar ones (-ffp-contract=off: no fused multiply-adds). Each
// (sequence, head) is one task of at::parallel_for, alone with its state: a sequence's
// output and state are the same bits whatever the batch it is in, whatever the thread count.
//
// Why: torch runs a token as ~10 ops on (B H, ...) tensors (the stacked k, q, a bmm, the
// delta, the output, the state's decay and rank-1 update), each a dispatch of a few µs and
// each a pass over its operands; here a token is two passes over its head's state (64 KiB at
// Dk = Dv = 128, in L2), one to read kS and qS, one to update it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"
#include "gated_delta.h"
#include "isa.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

// One token of one (sequence, head): S (Dk, Dv) row-major, updated in place; q, k (Dk),
// v, out (Dv); kS, qS (Dv) the task's scratch.
QINFER_INLINE void delta_token(float* __restrict__ S, int64_t Dk, int64_t Dv,
                               const float* __restrict__ q, const float* __restrict__ k,
                               const float* __restrict__ v, float a, float beta, float scale,
                               float* __restrict__ out, float* __restrict__ kS,
                               float* __restrict__ qS) {
  for (int64_t j = 0; j < Dv; ++j) kS[j] = qS[j] = 0.0f;
  float qk = 0.0f;
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = k[i], qi = q[i] * scale;
    qk += qi * ki;
    const float* row = S + i * Dv;
    for (int64_t j = 0; j < Dv; ++j) {
      kS[j] += ki * row[j];
      qS[j] += qi * row[j];
    }
  }
  for (int64_t j = 0; j < Dv; ++j) {
    const float delta = (v[j] - a * kS[j]) * beta;
    out[j] = a * qS[j] + qk * delta;
    kS[j] = delta;  // the delta, for the update below
  }
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = k[i];
    float* row = S + i * Dv;
    for (int64_t j = 0; j < Dv; ++j) row[j] = a * row[j] + ki * kS[j];
  }
}

// The token loop, compiled once for each path of isa.h's vector ladder from the one source
// above (the same bits on each); picked once per call.
#define QINFER_DELTA_LOOPS(NAME, TARGET)                                                    \
  struct NAME {                                                                             \
    TARGET static void token(float* S, int64_t Dk, int64_t Dv, const float* q,              \
                             const float* k, const float* v, float a, float beta,           \
                             float scale, float* out, float* kS, float* qS) {               \
      delta_token(S, Dk, Dv, q, k, v, a, beta, scale, out, kS, qS);                         \
    }                                                                                       \
  };
QINFER_DELTA_LOOPS(LoopsScalar, )
QINFER_DELTA_LOOPS(LoopsAvx2, QINFER_AVX2)
QINFER_DELTA_LOOPS(LoopsAvx512, QINFER_AVX512)

template <typename Loops>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
         const at::Tensor& beta, const at::Tensor& state, const std::vector<int64_t>& rows,
         const at::Tensor& out) {
  const int64_t L = k.size(1), H = k.size(2), Dk = k.size(3), Dv = v.size(3);
  const float scale = query_scale(Dk);
  float* sp = state.data_ptr<float>();
  at::parallel_for(0, k.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * Dv);
    for (int64_t task = begin; task < end; ++task) {
      const DeltaHead x = delta_head(q, k, v, g, beta, out, task / H, task % H);
      float* S = head_state(sp, rows, task, H, Dk, Dv);
      for (int64_t t = 0; t < L; ++t)
        Loops::token(S, Dk, Dv, x.q + t * x.q_step, x.k + t * x.k_step, x.v + t * x.v_step,
                     std::exp(x.g[t * x.g_step]), x.beta[t * x.beta_step], scale,
                     x.out + t * x.out_step, scratch.data(), scratch.data() + Dv);
    }
  });
}

}  // namespace

at::Tensor gated_delta_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta,
                                 const at::Tensor& state,
                                 const c10::optional<at::Tensor>& slots) {
  const auto rows = check_delta_rule("gated_delta_recurrent", q, k, v, g, beta, state, slots);
  at::Tensor out = at::empty({k.size(0), k.size(1), k.size(2), v.size(3)}, v.options());
  switch (best(kVectorPaths)) {
    case Isa::Avx512: run<LoopsAvx512>(q, k, v, g, beta, state, rows, out); break;
    case Isa::Avx2: run<LoopsAvx2>(q, k, v, g, beta, state, rows, out); break;
    default: run<LoopsScalar>(q, k, v, g, beta, state, rows, out);
  }
  return out;
}

}  // namespace qinfer_kernels
