// RoPE, the rotate-half rotation of fp32 heads: the op rope (docs/KERNELS.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "isa.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

struct Heads {
  const float* x;
  int64_t s0, s1;  // x's token and head strides
  const float* cos;
  const float* sin;
  float* out;  // (T, H, D) contiguous
  int64_t H, D, half;
};

// Tokens [t0, t1): per head, for i < half, (x1, x2) = (x[i], x[i + half]) -> (x1 cos - x2 sin,
// x2 cos + x1 sin), each product rounded, then the sum; x[2 half:] copied. Element by element
// (no sum across elements, no contraction): the loop vectorized at any width rounds as the
// scalar one, so every path below gives the same bits.
QINFER_INLINE void rotate(const Heads& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* __restrict c = p.cos + t * p.half;
    const float* __restrict s = p.sin + t * p.half;
    for (int64_t h = 0; h < p.H; ++h) {
      const float* __restrict a = p.x + t * p.s0 + h * p.s1;
      float* __restrict o = p.out + (t * p.H + h) * p.D;
      for (int64_t i = 0; i < p.half; ++i) {
        const float x1 = a[i], x2 = a[i + p.half];
        const float p1 = x1 * c[i], p2 = x2 * s[i], p3 = x2 * c[i], p4 = x1 * s[i];
        o[i] = p1 - p2;
        o[i + p.half] = p3 + p4;
      }
      std::memcpy(o + 2 * p.half, a + 2 * p.half, (p.D - 2 * p.half) * sizeof(float));
    }
  }
}

// `rotate` compiled for each path of isa.h's vector ladder (the compiler vectorizes its loop
// at the path's width).
void rotate_scalar(const Heads& p, int64_t t0, int64_t t1) { rotate(p, t0, t1); }
QINFER_AVX2 void rotate_avx2(const Heads& p, int64_t t0, int64_t t1) { rotate(p, t0, t1); }
QINFER_AVX512 void rotate_avx512(const Heads& p, int64_t t0, int64_t t1) { rotate(p, t0, t1); }

// Elements a thread takes at least: a decode step's few tokens stay on one thread.
constexpr int64_t kGrainElements = 1 << 15;

}  // namespace

// x (T, H, D) fp32 rotated by cos, sin (T, R/2) fp32 (torch's `RoPE.apply` in fp32, bit for
// bit), tokens split between threads.
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
  at::Tensor out = at::empty({T, H, D}, x.options());
  const Heads p{x.data_ptr<float>(),   x.stride(0),          x.stride(1), cos.data_ptr<float>(),
                sin.data_ptr<float>(), out.data_ptr<float>(), H,           D,
                cos.size(1)};
  void (*run)(const Heads&, int64_t, int64_t) = rotate_scalar;
  switch (best(kVectorPaths)) {
    case Isa::Avx512: run = rotate_avx512; break;
    case Isa::Avx2: run = rotate_avx2; break;
    default: break;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, H * D));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { run(p, t0, t1); });
  return out;
}

}  // namespace qinfer_kernels
