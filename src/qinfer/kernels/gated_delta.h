// What the gated delta rule's two ops share (gated_delta.cpp token by token,
// gated_delta_chunked.cpp a chunk at a time): the argument checks and where a (sequence,
// head)'s rows are.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace qinfer_kernels {

// One (sequence, head)'s inputs: token t's q row at q + t * q_step (k's, v's alike), its g
// at g[t * g_step] (beta's alike); its output row at out + t * out_step.
struct DeltaHead {
  const float *q, *k, *v, *g, *beta;
  int64_t q_step, k_step, v_step, g_step, beta_step;
  float* out;
  int64_t out_step;
};

// q's scale, Dk^-0.5 rounded once to fp32 (as torch's q * Dk**-0.5).
inline float query_scale(int64_t Dk) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)));
}

// The rule's arguments, checked (one line per refusal): q, k (B, L, H, Dk), v (B, L, H, Dv)
// fp32 with the last dimension contiguous; g, beta (B, L, H) fp32; state (B, H, Dk, Dv) fp32
// contiguous, or with slots (B,) int64 a pool (P, H, Dk, Dv) of which sequence b's is row
// slots[b] (read and written there in place: no gather or scatter of the pool's rows); all
// on the CPU. Returns each sequence's row of state.
inline std::vector<int64_t> check_delta_rule(const char* op, const at::Tensor& q,
                                             const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& g, const at::Tensor& beta,
                                             const at::Tensor& state,
                                             const c10::optional<at::Tensor>& slots) {
  TORCH_CHECK(k.dim() == 4, op, ": k must be (B, L, H, Dk), got ", shape_str(k));
  const int64_t B = k.size(0), L = k.size(1), H = k.size(2), Dk = k.size(3);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k},
                         {"v", &v}})
    TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == L && t->size(2) == H &&
                    t->scalar_type() == at::kFloat && t->is_cpu() && t->stride(3) == 1,
                op, ": ", name, " must be (", B, ", ", L, ", ", H,
                ", D) fp32 on the CPU with its last dimension contiguous, got ", shape_str(*t),
                " ", t->scalar_type());
  TORCH_CHECK(q.size(3) == Dk, op, ": q's last dimension must be k's ", Dk, ", got ",
              shape_str(q));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"g", &g}, {"beta", &beta}})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == L && t->size(2) == H &&
                    t->scalar_type() == at::kFloat && t->is_cpu(),
                op, ": ", name, " must be (", B, ", ", L, ", ", H, ") fp32 on the CPU, got ",
                shape_str(*t), " ", t->scalar_type());
  const int64_t Dv = v.size(3);
  const int64_t P = slots.has_value() ? state.size(0) : B;
  TORCH_CHECK(state.dim() == 4 && state.size(0) == P && state.size(1) == H &&
                  state.size(2) == Dk && state.size(3) == Dv &&
                  state.scalar_type() == at::kFloat && state.is_contiguous() && state.is_cpu(),
              op, ": state must be contiguous (", slots.has_value() ? "P" : std::to_string(B),
              ", ", H, ", ", Dk, ", ", Dv, ") fp32 on the CPU, got ", shape_str(state), " ",
              state.scalar_type());
  if (slots.has_value()) return checked_slots(op, *slots, B, P, "state's");
  std::vector<int64_t> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  return rows;
}

// Sequence b, head h's rows of the checked arguments and of out (B, L, H, Dv) contiguous.
inline DeltaHead delta_head(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, const at::Tensor& out,
                            int64_t b, int64_t h) {
  auto at = [&](const at::Tensor& t) {
    return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(2);
  };
  return {at(q),       at(k),       at(v),       at(g),          at(beta),
          q.stride(1), k.stride(1), v.stride(1), g.stride(1),    beta.stride(1),
          at(out),     out.stride(1)};
}

// Task's (sequence task / H, head task % H) state (Dk, Dv) in `state`'s data, its sequence's
// row being rows[task / H] (check_delta_rule's).
inline float* head_state(float* state, const std::vector<int64_t>& rows, int64_t task,
                         int64_t H, int64_t Dk, int64_t Dv) {
  return state + (rows[task / H] * H + task % H) * Dk * Dv;
}

}  // namespace qinfer_kernels
