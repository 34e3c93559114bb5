// RoPE, the rotate-half rotation of fp32 heads: the op rope (docs/KERNELS.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>

#include "common.h"
#include "ops.h"

namespace qinfer_kernels {

// x (T, H, D) fp32 rotated by cos, sin (T, R/2) fp32: per head, for i < R/2,
// (x1, x2) = (x[i], x[i + R/2]) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded,
// then the sum (torch's `RoPE.apply` in fp32, bit for bit); x[R:] copied.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.is_cpu(),
              "rope: x must be (T, H, D) fp32 on the CPU with its last dimension contiguous, "
              "got ", shape_str(x), " ", x.scalar_type());
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && 2 * cos.size(1) <= D &&
                  cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat &&
                  sin.is_contiguous(),
              "rope: cos and sin must be contiguous (", T, ", R/2) fp32 with R <= ", D,
              ", got ", shape_str(cos), " ", cos.scalar_type(), " and ", shape_str(sin), " ",
              sin.scalar_type());
  const int64_t half = cos.size(1);
  at::Tensor out = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cp + t * half;
    const float* s = sp + t * half;
    for (int64_t h = 0; h < H; ++h) {
      const float* a = xp + t * s0 + h * s1;
      float* o = op + (t * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = a[i + half];
        const float p1 = x1 * c[i], p2 = x2 * s[i], p3 = x2 * c[i], p4 = x1 * s[i];
        o[i] = p1 - p2;
        o[i + half] = p3 + p4;
      }
      std::memcpy(o + 2 * half, a + 2 * half, (D - 2 * half) * sizeof(float));
    }
  }
  return out;
}

}  // namespace qinfer_kernels
