// The ops' CPU kernels, one source each, registered together in library.cpp (their schemas
// there; what they compute in docs/KERNELS.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

namespace qinfer_kernels {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// quantize_q8.cpp
Tensors3 quantize_q8_1(const at::Tensor& x, const std::string& path);
// int4_q8.cpp
Tensors3 pack_int4(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros);
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                   const c10::optional<at::Tensor>& m, int64_t n, const std::string& path);
// int8_q8.cpp
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   const std::string& path, const c10::optional<at::Tensor>& d_super);
// int8_blocks.cpp
at::Tensor int8_blocks_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                          const std::string& path, const c10::optional<at::Tensor>& d_super,
                          const c10::optional<at::Tensor>& ids);
// top_k.cpp
at::Tensor top_k_ids(const at::Tensor& logits, int64_t k);
// int4_groups.cpp
at::Tensor int4_groups_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                          const c10::optional<at::Tensor>& m, int64_t n, const std::string& path);
// rms_norm.cpp
at::Tensor add_rms_norm(const at::Tensor& h, const c10::optional<at::Tensor>& x,
                        const at::Tensor& w, double eps, at::ScalarType dtype,
                        const std::string& path);
at::Tensor heads_rms_norm(const at::Tensor& h, const at::Tensor& w_first,
                          const at::Tensor& w_rest, int64_t first, double eps,
                          at::ScalarType dtype, const std::string& path);
// paged_decode.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const c10::optional<at::Tensor>& k,
                                  const c10::optional<at::Tensor>& v, const at::Tensor& keys,
                                  const at::Tensor& values,
                                  const c10::optional<at::Tensor>& slots,
                                  const at::Tensor& positions, const at::Tensor& tables,
                                  const at::Tensor& totals,
                                  const c10::optional<at::Tensor>& key_starts,
                                  int64_t block_size, int64_t window, double scale,
                                  const c10::optional<at::Tensor>& key_scales,
                                  const c10::optional<at::Tensor>& value_scales);
// causal_attention.cpp
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale);
// causal_conv.cpp
at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& taps, const at::Tensor& windows,
                         const at::Tensor& slots);
// gated_delta.cpp
at::Tensor gated_delta_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta,
                                 const at::Tensor& state,
                                 const c10::optional<at::Tensor>& slots);
at::Tensor gated_delta_decode(const at::Tensor& qkv, const at::Tensor& b, const at::Tensor& a,
                              const at::Tensor& taps, const at::Tensor& windows,
                              const at::Tensor& A_log, const at::Tensor& dt_bias,
                              const at::Tensor& state, const at::Tensor& slots,
                              int64_t key_heads);
// gated_delta_chunked.cpp
at::Tensor gated_delta_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& state, int64_t chunk_size,
                               const c10::optional<at::Tensor>& slots);
// lora.cpp
void lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
              const at::Tensor& slots, const at::Tensor& a, const at::Tensor& column_slots,
              const std::vector<c10::optional<at::Tensor>>& b_t, at::IntArrayRef parts,
              const std::string& path);
// silu_mul.cpp
at::Tensor silu_mul(const at::Tensor& x);
// rope.cpp
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace qinfer_kernels
