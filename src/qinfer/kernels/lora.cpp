// The adapter rows' part of a projection with LoRA adapters beside it, in one op: lora_add
// (docs/KERNELS.md; the layer is qinfer/linear/lora.py's LoraLinear).
//
//   lora_add(y, x, rows, slots, a, column_slots, b_t, parts, path):
//     y (T, out) fp32 or bf16, contiguous, the base's output, updated in place
//     x (T, in) fp32 or bf16, its last dimension contiguous
//     rows (n,) int64: the rows of y and x that run through an adapter; slots (n,) int64,
//       each one's slot
//     a (C, in) fp32 or bf16: every slot's A, part-major; column_slots (C,) int64, each
//       column's slot, a slot's columns one run within each part
//     b_t: per part its B^T (C_p, out_p) in a's dtype (the scale folded in), or None where
//       C_p = 0; parts: each part's out_p (sum: out)
//   For row i (r = rows[i], s = slots[i]) and part p, J the columns of part p that hold slot
//   s (none: the part adds nothing to the row):
//     h[j] = x[r] . a[j] for j in J                                  (shrink)
//     y[r, part p's outputs] += h[J] @ b_t[p][J - part p's first column]   (expand)
//   Rows not in `rows` are not touched.
//
// Per row, on every path (fp32, x and the weights widened exactly from bf16; no contraction:
// -ffp-contract=off, fused multiply-adds only where written):
//   shrink: L lanes (16 AVX-512, 8 AVX2, 1 scalar), chunk c of the in % L-less body into
//     accumulator c % 4 by fma, the in % L tail in one scalar fma chain; then
//     (a0 + a1) + (a2 + a3), a fixed tree over the lanes, plus the tail
//   expand: per output, acc = fma(h[j], b[j, o], acc) from 0 over j in J ascending (the
//     same bits on every path), then y + acc (bf16 y: widened, added, rounded once, half to even)
// A row's result depends on that row, its slot's weights and the path only: never on the
// other rows, their slots or the thread count (qinfer's batch invariance). A task is a
// slot's rows, up to kChunk of them: their shrink, then their expand, so that a step reads
// each adapter's A and B once (at decode LoRA costs the bytes of its weights) and the op
// takes one parallel region (on a loaded machine each region may wait a time slice for
// its threads). Threads take whole tasks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "isa.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

constexpr int kRowTile = 4;   // rows of one slot sharing each load of A in the shrink
constexpr int64_t kChunk = 64;  // rows of one slot in one task (a prompt's many rows split)
constexpr int64_t kTile = 512;  // output columns of one expand task (2 KiB of fp32 B^T a row)

// Elements of A read ahead of the shrink's loads (past a column's end: the next column's,
// which the next task reads), and the expand's next row of B^T fetched while this one is
// used: DRAM streams each adapter once a step, in short runs the hardware prefetcher
// would only learn late.
constexpr int64_t kAhead = 512;
QINFER_INLINE void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

// One operand element as fp32: fp32 as it is, bf16 (its bits as uint16_t) widened exactly.
QINFER_INLINE float widen_any(float v) { return v; }
QINFER_INLINE float widen_any(uint16_t v) { return widen_bf16(v); }

// The in % L tail of R rows' dot products with one column of A, one scalar fma chain each.
template <int R, typename X, typename W>
QINFER_INLINE void tail_dots(const W* a, const X* const* x, int64_t from, int64_t K,
                             float (&tail)[R]) {
  for (int i = 0; i < R; ++i) tail[i] = 0.0f;
  for (int64_t k = from; k < K; ++k)
    for (int i = 0; i < R; ++i) tail[i] = std::fma(widen_any(x[i][k]), widen_any(a[k]), tail[i]);
}

// h[i] = x[i] . a for R rows (the shrink of one column), L = 1. Chunk c of the body goes
// to accumulator c % 4: the loops step 4 chunks at a time, so that every index is a
// constant and the accumulators stay in registers.
template <int R, typename X, typename W>
void dots_scalar(const W* a, const X* const* x, int64_t K, float* const* h) {
  float acc[R][4] = {};
  for (int64_t k = 0; k < K; k += 4)
    for (int u = 0; u < 4 && k + u < K; ++u)
      for (int i = 0; i < R; ++i)
        acc[i][u] = std::fma(widen_any(x[i][k + u]), widen_any(a[k + u]), acc[i][u]);
  for (int i = 0; i < R; ++i) *h[i] = (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);
}

template <int R, typename X, typename W>
QINFER_AVX2 void dots_avx2(const W* a, const X* const* x, int64_t K, float* const* h) {
  __m256 acc[R][4];
  clear(acc);
  const int64_t body = K - K % 8;
  for (int64_t k = 0; k < body; k += 32) {
    #pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      if (k + 8 * u >= body) break;
      prefetch(a + k + 8 * u + kAhead);
      const __m256 w = load8_f32(a + k + 8 * u);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
        acc[i][u] = _mm256_fmadd_ps(load8_f32(x[i] + k + 8 * u), w, acc[i][u]);
    }
  }
  float tail[R];
  tail_dots<R>(a, x, body, K, tail);
  #pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    const __m256 sum =
        _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
    *h[i] = hsum_avx2(sum) + tail[i];
  }
}

template <int R, typename X, typename W>
QINFER_AVX512 void dots_avx512(const W* a, const X* const* x, int64_t K, float* const* h) {
  __m512 acc[R][4];
  clear(acc);
  const int64_t body = K - K % 16;
  for (int64_t k = 0; k < body; k += 64) {
    #pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      if (k + 16 * u >= body) break;
      prefetch(a + k + 16 * u + kAhead);
      const __m512 w = load16_f32(a + k + 16 * u);
      #pragma GCC unroll 4
      for (int i = 0; i < R; ++i)
        acc[i][u] = _mm512_fmadd_ps(load16_f32(x[i] + k + 16 * u), w, acc[i][u]);
    }
  }
  float tail[R];
  tail_dots<R>(a, x, body, K, tail);
  #pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    const __m512 sum =
        _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3]));
    *h[i] = _mm512_reduce_add_ps(sum) + tail[i];
  }
}

template <int R, typename X, typename W>
void dots(Isa path, const W* a, const X* const* x, int64_t K, float* const* h) {
  switch (path) {
    case Isa::Avx512: dots_avx512<R>(a, x, K, h); break;
    case Isa::Avx2: dots_avx2<R>(a, x, K, h); break;
    default: dots_scalar<R>(a, x, K, h);
  }
}

// acc[o] = fma(h, b[o], acc[o]) for o < width: one term of the expand for `width` outputs
// (the same bits on every path: the lanes are outputs, not terms).
template <typename W>
QINFER_INLINE void axpy_tail(float h, const W* b, int64_t from, int64_t width, float* acc) {
  for (int64_t o = from; o < width; ++o) acc[o] = std::fma(h, widen_any(b[o]), acc[o]);
}

template <typename W>
void axpy_scalar(float h, const W* b, int64_t width, float* acc) {
  axpy_tail(h, b, 0, width, acc);
}

template <typename W>
QINFER_AVX2 void axpy_avx2(float h, const W* b, int64_t width, float* acc) {
  const __m256 hv = _mm256_set1_ps(h);
  const int64_t body = width - width % 8;
  for (int64_t o = 0; o < body; o += 8)
    _mm256_storeu_ps(acc + o, _mm256_fmadd_ps(hv, load8_f32(b + o), _mm256_loadu_ps(acc + o)));
  axpy_tail(h, b, body, width, acc);
}

template <typename W>
QINFER_AVX512 void axpy_avx512(float h, const W* b, int64_t width, float* acc) {
  const __m512 hv = _mm512_set1_ps(h);
  const int64_t body = width - width % 16;
  for (int64_t o = 0; o < body; o += 16)
    _mm512_storeu_ps(acc + o, _mm512_fmadd_ps(hv, load16_f32(b + o), _mm512_loadu_ps(acc + o)));
  axpy_tail(h, b, body, width, acc);
}

template <typename W>
void axpy(Isa path, float h, const W* b, int64_t width, float* acc) {
  switch (path) {
    case Isa::Avx512: axpy_avx512(h, b, width, acc); break;
    case Isa::Avx2: axpy_avx2(h, b, width, acc); break;
    default: axpy_scalar(h, b, width, acc);
  }
}

QINFER_INLINE void add_to(float* y, const float* acc, int64_t width) {
  for (int64_t o = 0; o < width; ++o) y[o] = y[o] + acc[o];
}
QINFER_INLINE void add_to(uint16_t* y, const float* acc, int64_t width) {
  for (int64_t o = 0; o < width; ++o) y[o] = round_bf16(widen_bf16(y[o]) + acc[o]);
}

// The rows of one slot (indices into rows/slots, in their order) and, per part, that
// slot's columns [first, end) of a (first == end: none).
struct Group {
  int64_t slot;
  std::vector<int64_t> members;
  std::vector<std::pair<int64_t, int64_t>> columns;
};

// The groups of the step's rows by slot, in order of first appearance, with each one's
// columns per part; a slot's columns in a part must be one run.
std::vector<Group> group_rows(const int64_t* slots, int64_t n, const int64_t* column_slots,
                              const std::vector<int64_t>& part_starts) {
  std::vector<Group> groups;
  for (int64_t i = 0; i < n; ++i) {
    auto found = std::find_if(groups.begin(), groups.end(),
                              [&](const Group& g) { return g.slot == slots[i]; });
    if (found == groups.end()) {
      groups.push_back({slots[i], {}, {}});
      found = groups.end() - 1;
    }
    found->members.push_back(i);
  }
  const int64_t parts = static_cast<int64_t>(part_starts.size()) - 1;
  for (Group& g : groups) {
    for (int64_t p = 0; p < parts; ++p) {
      int64_t first = part_starts[p + 1], end = first;
      for (int64_t c = part_starts[p]; c < part_starts[p + 1]; ++c) {
        if (column_slots[c] != g.slot) continue;
        TORCH_CHECK(first == part_starts[p + 1] || end == c, "lora_add: slot ", g.slot,
                    "'s columns of part ", p, " are not one run of column_slots");
        if (first == part_starts[p + 1]) first = c;
        end = c + 1;
      }
      g.columns.emplace_back(first, first == part_starts[p + 1] ? first : end);
    }
  }
  return groups;
}

// The op for one combination of element types: X x's, W the adapters', Y y's.
template <typename X, typename W, typename Y>
void lora_add_typed(Isa path, Y* y, int64_t ldy, const X* x, int64_t ldx, int64_t K,
                    const int64_t* rows, const std::vector<Group>& groups, int64_t C,
                    const W* a, const std::vector<const W*>& b_t,
                    const std::vector<int64_t>& parts, const std::vector<int64_t>& part_starts,
                    int64_t n) {
  // one task per slot's rows, kChunk at a time: its shrink, then its expand. Tasks write
  // disjoint rows of h (n, C) and y, and a slot's A and B are read once for its rows
  std::vector<float> h(static_cast<size_t>(n * C));
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (group, its first member)
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t m = 0; m < static_cast<int64_t>(groups[g].members.size()); m += kChunk)
      tasks.emplace_back(g, m);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    float acc[kRowTile][kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const Group& g = groups[tasks[t].first];
      const int64_t m0 = tasks[t].second;
      const int64_t m1 = std::min<int64_t>(m0 + kChunk, static_cast<int64_t>(g.members.size()));
      for (const auto& [first, end] : g.columns)  // shrink: h[i, c] = x[rows[i]] . a[c]
        for (int64_t c = first; c < end; ++c)
          for (int64_t m = m0; m < m1; m += kRowTile) {
            const X* xs[kRowTile];
            float* hs[kRowTile];
            const int64_t R = std::min<int64_t>(kRowTile, m1 - m);
            for (int64_t i = 0; i < R; ++i) {
              xs[i] = x + rows[g.members[m + i]] * ldx;
              hs[i] = h.data() + g.members[m + i] * C + c;
            }
            const W* ac = a + c * K;
            switch (R) {
              case 4: dots<4>(path, ac, xs, K, hs); break;
              case 3: dots<3>(path, ac, xs, K, hs); break;
              case 2: dots<2>(path, ac, xs, K, hs); break;
              default: dots<1>(path, ac, xs, K, hs);
            }
          }
      // expand: per tile of kTile outputs of a part, per row of B^T (contiguous: kTile
      // outputs a read), each of up to kRowTile rows' term added
      int64_t offset = 0;  // part p's first output in y
      for (int64_t p = 0; p < static_cast<int64_t>(parts.size()); offset += parts[p], ++p) {
        const auto [first, end] = g.columns[p];
        for (int64_t o = 0; o < parts[p] && first < end; o += kTile) {
          const int64_t width = std::min(kTile, parts[p] - o);
          for (int64_t m = m0; m < m1; m += kRowTile) {
            const int64_t R = std::min<int64_t>(kRowTile, m1 - m);
            for (int64_t i = 0; i < R; ++i) std::fill_n(acc[i], width, 0.0f);
            for (int64_t j = first; j < end; ++j) {
              const W* b = b_t[p] + (j - part_starts[p]) * parts[p] + o;
              for (int64_t e = 0; e < width; e += 64 / sizeof(W)) prefetch(b + parts[p] + e);
              for (int64_t i = 0; i < R; ++i)
                axpy(path, h[g.members[m + i] * C + j], b, width, acc[i]);
            }
            for (int64_t i = 0; i < R; ++i)
              add_to(y + rows[g.members[m + i]] * ldy + offset + o, acc[i], width);
          }
        }
      }
    }
  });
}

// An fp32 or bf16 tensor's elements: float, or bf16 as its bits.
template <typename F>
void with_elements(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) f(t.data_ptr<float>());
  else f(reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()));
}

bool fp32_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

void lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows_in,
              const at::Tensor& slots_in, const at::Tensor& a, const at::Tensor& column_slots_in,
              const std::vector<c10::optional<at::Tensor>>& b_t_in, at::IntArrayRef parts_in,
              const std::string& path_name) {
  TORCH_CHECK(y.dim() == 2 && fp32_or_bf16(y) && y.is_contiguous() && y.is_cpu(),
              "lora_add: y must be a contiguous (T, out) fp32 or bf16 CPU tensor, got ",
              shape_str(y), " ", y.scalar_type());
  const int64_t T = y.size(0), out = y.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == T && fp32_or_bf16(x) && x.stride(1) == 1,
              "lora_add: x must be (", T, ", in) fp32 or bf16 with its last dimension "
              "contiguous for y's T, got ", shape_str(x), " ", x.scalar_type());
  const int64_t K = x.size(1);
  TORCH_CHECK(a.dim() == 2 && a.size(1) == K && fp32_or_bf16(a) && a.is_contiguous(),
              "lora_add: a must be a contiguous (C, ", K, ") fp32 or bf16 tensor for x's in, "
              "got ", shape_str(a), " ", a.scalar_type());
  const int64_t C = a.size(0);
  const at::Tensor rows = rows_in.contiguous(), slots = slots_in.contiguous();
  const at::Tensor column_slots = column_slots_in.contiguous();
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && slots.sizes() == rows.sizes() &&
                  slots.scalar_type() == at::kLong,
              "lora_add: rows and slots must be int64 of one shape (n,), got ", shape_str(rows),
              " ", rows.scalar_type(), " and ", shape_str(slots), " ", slots.scalar_type());
  TORCH_CHECK(column_slots.dim() == 1 && column_slots.size(0) == C &&
                  column_slots.scalar_type() == at::kLong,
              "lora_add: column_slots must be int64 (", C, ",) for a's C, got ",
              shape_str(column_slots), " ", column_slots.scalar_type());
  const std::vector<int64_t> parts(parts_in.begin(), parts_in.end());
  TORCH_CHECK(b_t_in.size() == parts.size(), "lora_add: ", b_t_in.size(), " b_t for ",
              parts.size(), " parts");
  std::vector<int64_t> part_starts{0};
  int64_t outs = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t columns = b_t_in[p].has_value() ? b_t_in[p]->size(0) : 0;
    if (b_t_in[p].has_value()) {
      const at::Tensor& b = *b_t_in[p];
      TORCH_CHECK(b.dim() == 2 && b.size(1) == parts[p] && b.scalar_type() == a.scalar_type() &&
                      b.is_contiguous(),
                  "lora_add: b_t[", p, "] must be a contiguous (C_p, ", parts[p], ") ",
                  a.scalar_type(), " tensor (a's dtype, part ", p, "'s out), got ",
                  shape_str(b), " ", b.scalar_type());
    }
    part_starts.push_back(part_starts.back() + columns);
    outs += parts[p];
  }
  TORCH_CHECK(outs == out && part_starts.back() == C, "lora_add: parts ", parts_in,
              " must sum to y's out ", out, " and b_t's rows (", part_starts.back(),
              ") to a's C ", C);
  const Isa path = resolve_path("lora_add", path_name, kVectorPaths);
  const int64_t n = rows.size(0);
  if (n == 0 || C == 0) return;
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < T, "lora_add: rows[", i, "] = ", rp[i],
                " is out of y's ", T, " rows");
  const std::vector<Group> groups =
      group_rows(slots.data_ptr<int64_t>(), n, column_slots.data_ptr<int64_t>(), part_starts);
  with_elements(y, [&](auto* yp) {
    with_elements(x, [&](auto* xp) {
      with_elements(a, [&](auto* ap) {
        using W = std::remove_pointer_t<decltype(ap)>;
        std::vector<const W*> b_t;
        for (const auto& b : b_t_in)
          b_t.push_back(b.has_value() ? reinterpret_cast<const W*>(b->data_ptr()) : nullptr);
        lora_add_typed(path, yp, out, static_cast<const std::remove_pointer_t<decltype(xp)>*>(xp),
                       x.stride(0), K, rp, groups, C, static_cast<const W*>(ap), b_t, parts,
                       part_starts, n);
      });
    });
  });
}

}  // namespace qinfer_kernels
