// What the kernel sources share (int_dot.cpp, rms_norm.cpp, paged_decode.cpp): bf16 <-> fp32
// as torch converts them, and a tensor's shape as the error messages print it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace qinfer_kernels {

// bf16 -> fp32, exact. Always inlined: a caller compiled for a wider ISA (a `target` or
// `target_clones` function) gets it compiled in, not a call to the baseline build.
inline __attribute__((always_inline)) float widen_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// torch's float -> bfloat16 (c10::detail::round_to_nearest_even): NaN to 0x7FC0.
inline uint16_t round_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// "(2, 3)", "(5,)": a shape as Python prints it
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + (t.dim() == 1 ? ",)" : ")");
}

}  // namespace qinfer_kernels
