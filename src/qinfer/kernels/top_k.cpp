// The k highest logits of each row: the op top_k_ids, which picks the logits a head on int8
// activations recomputes exactly (qinfer/linear/logits.py). docs/KERNELS.md says what it
// computes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "matmul.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

// A logit and its column; NaN ranks as -inf (a strict order for nth_element).
struct Ranked {
  float key;
  int64_t id;
};

// Higher first, then the lower column: one total order, so a row's k are the same whatever
// the pass below keeps on the way.
QINFER_INLINE bool before(const Ranked& a, const Ranked& b) {
  return a.key > b.key || (a.key == b.key && a.id < b.id);
}

QINFER_INLINE float key_of(float v) {
  return std::isnan(v) ? -std::numeric_limits<float>::infinity() : v;
}

// Row x (N) -> its k first columns by `before`, ascending, at out. One pass in column order:
// the first k are kept, then a logit only if it is above the k-th kept (a later equal one
// ranks after it), the kept ones cut back to the best k whenever `cap` of them gather.
void row_top_k(const float* x, int64_t N, int64_t k, int64_t cap, std::vector<Ranked>& kept,
               int64_t* out) {
  kept.clear();
  for (int64_t n = 0; n < k; ++n) kept.push_back({key_of(x[n]), n});
  float floor = kept[0].key;  // the k-th's key: the lowest kept
  for (const Ranked& r : kept) floor = std::min(floor, r.key);
  for (int64_t n = k; n < N; ++n) {
    if (!(x[n] > floor)) continue;  // NaN too
    kept.push_back({x[n], n});
    if (static_cast<int64_t>(kept.size()) == cap) {
      std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
      kept.resize(k);
      floor = kept[k - 1].key;
    }
  }
  std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), before);
  kept.resize(k);
  for (int64_t i = 0; i < k; ++i) out[i] = kept[i].id;
  std::sort(out, out + k);
}

}  // namespace

at::Tensor top_k_ids(const at::Tensor& logits_in, int64_t k) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.scalar_type() == at::kFloat &&
                  logits_in.dim() == 2,
              "top_k_ids: logits must be torch.float32 (R, N) on the CPU, got ",
              dtype_name(logits_in.scalar_type()), " ", shape_str(logits_in));
  const int64_t R = logits_in.size(0), N = logits_in.size(1);
  TORCH_CHECK(k >= 1 && k <= N, "top_k_ids: k must lie in 1..", N, " (logits' columns), got ", k);
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor out = at::empty({R, k}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* ids = out.data_ptr<int64_t>();
  // the kept logits cut back at 8 k: a cut (nth_element over 8 k) a few times a row at most
  // once the k-th kept nears the row's k-th
  const int64_t cap = std::max<int64_t>(8 * k, 64);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Ranked> kept;
    kept.reserve(cap);
    for (int64_t r = r0; r < r1; ++r) row_top_k(x + r * N, N, k, cap, kept, ids + r * k);
  });
  return out;
}

}  // namespace qinfer_kernels
