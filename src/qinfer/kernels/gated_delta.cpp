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
// gated_delta_decode is one decode token of the whole mixer before its norm: the causal
// conv (with SiLU) from each sequence's window, q and k L2-normalised, beta = sigmoid(b),
// g = -exp(A_log) softplus(a + dt_bias), then the rule above: GatedDeltaNet's ~25 torch ops
// a layer and step (each a dispatch of a few µs) as one.
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
#include <utility>
#include <vector>

#include "causal_conv.h"
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

// x (D) / sqrt(sum(x^2) + 1e-6) into out, the sum in order (`deltanet.l2_normalize`).
inline void l2_normalized(const float* x, int64_t D, float* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < D; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < D; ++i) out[i] = x[i] * inv;
}

// torch's softplus (beta 1, threshold 20): x past 20, else log1p(exp(x)).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

template <typename Loops>
void run_decode(Isa path, const at::Tensor& qkv, const at::Tensor& b, const at::Tensor& a,
                const at::Tensor& taps, const at::Tensor& windows,
                const at::Tensor& A_log, const at::Tensor& dt_bias, const at::Tensor& state,
                const std::vector<int64_t>& rows, int64_t Hk, const at::Tensor& mixed,
                const at::Tensor& out) {
  const int64_t S = qkv.size(0), C = qkv.size(1), K = taps.size(0);
  const int64_t H = state.size(1), Dk = state.size(2), Dv = state.size(3), r = H / Hk;
  const float scale = query_scale(Dk);
  float* mp = mixed.data_ptr<float>();
  causal_conv_silu(path, qkv.data_ptr<float>(), qkv.stride(0), C, S, 1, taps.data_ptr<float>(),
                   K, windows.data_ptr<float>(), rows, C, mp);
  // the rule, one (sequence, value head) a task; value head h reads key head h / r
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *A = A_log.data_ptr<float>(), *dt = dt_bias.data_ptr<float>();
  at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * Dv + 2 * Dk);
    float *kS = scratch.data(), *qS = kS + Dv, *qn = qS + Dv, *kn = qn + Dk;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / H, h = task % H;
      const float* row = mp + s * C;
      l2_normalized(row + (h / r) * Dk, Dk, qn);
      l2_normalized(row + Hk * Dk + (h / r) * Dk, Dk, kn);
      const float* v = row + 2 * Hk * Dk + h * Dv;
      const float bh = bp[s * b.stride(0) + h * b.stride(1)];
      const float ah = ap[s * a.stride(0) + h * a.stride(1)];
      const float beta = 1.0f / (1.0f + std::exp(-bh));
      const float g = -std::exp(A[h]) * softplus(ah + dt[h]);
      Loops::token(head_state(sp, rows, task, H, Dk, Dv), Dk, Dv, qn, kn, v, std::exp(g), beta,
                   scale, op + task * Dv, kS, qS);
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

at::Tensor gated_delta_decode(const at::Tensor& qkv, const at::Tensor& b, const at::Tensor& a,
                              const at::Tensor& taps, const at::Tensor& windows,
                              const at::Tensor& A_log, const at::Tensor& dt_bias,
                              const at::Tensor& state, const at::Tensor& slots,
                              int64_t key_heads) {
  const char* op = "gated_delta_decode";
  check_fp32_cpu(op, {{"qkv", &qkv}, {"b", &b}, {"a", &a}, {"taps", &taps},
                     {"windows", &windows}, {"A_log", &A_log}, {"dt_bias", &dt_bias},
                     {"state", &state}});
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous(), op,
              ": state must be a contiguous pool (P, H, Dk, Dv), got ", shape_str(state));
  const int64_t P = state.size(0), H = state.size(1), Dk = state.size(2), Dv = state.size(3);
  TORCH_CHECK(key_heads > 0 && H % key_heads == 0, op, ": key_heads must divide state's ", H,
              " heads, got ", key_heads);
  const int64_t C = 2 * key_heads * Dk + H * Dv;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == C && qkv.stride(1) == 1, op,
              ": qkv must be (S, ", C, ") (q, k of ", key_heads, " heads of ", Dk,
              ", v of state's ", H, " of ", Dv, ") with rows contiguous, got ", shape_str(qkv));
  const int64_t S = qkv.size(0);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"b", &b}, {"a", &a}})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == S && t->size(1) == H, op, ": ", name,
                " must be (", S, ", ", H, "), got ", shape_str(*t));
  check_conv(op, taps, windows, C);
  TORCH_CHECK(windows.size(0) == P, op, ": windows must have the state's ", P, " rows, got ",
              shape_str(windows));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"A_log", &A_log},
                         {"dt_bias", &dt_bias}})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == H && t->is_contiguous(), op, ": ", name,
                " must be contiguous (", H, ",), got ", shape_str(*t));
  const std::vector<int64_t> rows = checked_slots(op, slots, S, P, "pools'");
  at::Tensor mixed = at::empty({S, C}, qkv.options());
  at::Tensor out = at::empty({S, H, Dv}, qkv.options());
  const Isa path = best(kVectorPaths);
  switch (path) {
    case Isa::Avx512:
      run_decode<LoopsAvx512>(path, qkv, b, a, taps, windows, A_log, dt_bias, state, rows,
                              key_heads, mixed, out);
      break;
    case Isa::Avx2:
      run_decode<LoopsAvx2>(path, qkv, b, a, taps, windows, A_log, dt_bias, state, rows,
                            key_heads, mixed, out);
      break;
    default:
      run_decode<LoopsScalar>(path, qkv, b, a, taps, windows, A_log, dt_bias, state, rows,
                              key_heads, mixed, out);
  }
  return out;
}

}  // namespace qinfer_kernels
