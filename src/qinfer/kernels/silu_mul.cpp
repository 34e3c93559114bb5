// The gated FFN's SwiGLU, silu(gate) * up, in one pass: the op silu_mul (docs/KERNELS.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

#include "common.h"
#include "isa.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

struct Rows {
  const float* x;  // (T, 2W): gate then up, rows `stride` floats apart
  int64_t stride;
  float* out;  // (T, W) contiguous
  int64_t W;
};

// Rows [t0, t1): out = (g / (1 + exp(-g))) * u, element by element (exp_fp32, no contraction):
// the loop vectorized at any width rounds as the scalar one, so every path gives the same bits.
QINFER_INLINE void gate(const Rows& p, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* __restrict g = p.x + t * p.stride;
    const float* __restrict u = g + p.W;
    float* __restrict o = p.out + t * p.W;
    for (int64_t i = 0; i < p.W; ++i) o[i] = (g[i] / (1.0f + exp_fp32(-g[i]))) * u[i];
  }
}

void gate_scalar(const Rows& p, int64_t t0, int64_t t1) { gate(p, t0, t1); }
QINFER_AVX2 void gate_avx2(const Rows& p, int64_t t0, int64_t t1) { gate(p, t0, t1); }
QINFER_AVX512 void gate_avx512(const Rows& p, int64_t t0, int64_t t1) { gate(p, t0, t1); }

// Elements a thread takes at least: a decode step's few rows stay on one thread.
constexpr int64_t kGrainElements = 1 << 14;

}  // namespace

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) % 2 == 0 && x.is_cpu(),
              "silu_mul: x must be (T, 2W) fp32 on the CPU, gate then up, with its last "
              "dimension contiguous, got ", shape_str(x), " ", x.scalar_type());
  const int64_t T = x.size(0), W = x.size(1) / 2;
  at::Tensor out = at::empty({T, W}, x.options());
  const Rows p{x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), W};
  void (*run)(const Rows&, int64_t, int64_t) = gate_scalar;
  switch (best(kVectorPaths)) {
    case Isa::Avx512: run = gate_avx512; break;
    case Isa::Avx2: run = gate_avx2; break;
    default: break;
  }
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, W));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { run(p, t0, t1); });
  return out;
}

}  // namespace qinfer_kernels
