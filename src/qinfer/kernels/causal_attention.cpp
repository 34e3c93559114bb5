// Causal attention of a prompt's queries over their histories: the op causal_attention
// (docs/KERNELS.md).
//
//   causal_attention(q, k, v, scale) -> out
//     q (B, Hq, L, D) fp32; k, v (B, Hkv, S, D) fp32 or bf16 (both alike), S >= L; each with
//     its last dimension contiguous (the others' strides free); Hq a multiple of Hkv
//     out (B, Hq, L, D) fp32, laid out as (B, L, Hq, D) (out.transpose(1, 2) is contiguous):
//     softmax(q k^T * scale + causal) v, bottom-right causal: the L queries are the last L of
//     the S keys, query i sees keys 0 .. S - L + i (query head h reads KV head h / (Hq / Hkv))
//
// Per query, flash attention over its visible keys in blocks of kKeys from key 0, in fp32:
//   q' = q * scale
//   per block: s_j = q' . k_j (one fused multiply-add chain over d = 0 .. D - 1);
//     m' = max(m, max_j s_j); f = exp(m - m') (0 at the first block); p_j = exp(s_j - m');
//     l = l f + (p_0 + p_1 + ...); acc = acc f, then acc += p_j v_j for j in order (fused
//     multiply-adds); m = m'
//   out = acc * (1 / l)
// over the block's keys the query sees, exp being common.h's exp_fp32. A query's output thus
// depends on its q, its own keys and values and D alone: not on L, on the queries and heads
// beside it, on the threads or on the path (every vector operation is lanes of the scalar one,
// fused multiply-adds where written, no contraction elsewhere): a prompt gets the same bits
// whole, in chunks of any length, and after a prefix hit.
//
// Why: torch's bmm over blocks of queries (`causal_blocks`) used a fraction of the machine's
// fused multiply-adds on a prompt's small matrices (docs/BENCHMARKS.md); here each (sequence,
// KV head)'s keys are transposed once for all its tasks, each row's 32 scores a block are two
// 16-lane fused multiply-add chains with 8 rows sharing each load, and the values' block is
// summed into 2 rows at a time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common.h"
#include "isa.h"
#include "lanes.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

constexpr int64_t kKeys = 2 * kLanes;  // keys a block: two vectors of scores a row
constexpr int64_t kRows = 64;          // rows (query heads x queries) a task, at most
constexpr float kNoScore = -std::numeric_limits<float>::infinity();

// Each path's broadcast, and its a * b + c lane by lane, rounded once: the same bits on both
// paths. (GCC lowers a vector built from a scalar in code of no target lane by lane.) Two
// paths: AVX-512, and the scalar one, which gives its bits anywhere (slowly); an AVX2 machine
// takes torch's `causal_blocks` instead (`qinfer.attention.sdpa`): fused multiply-adds on
// halves of these 16 lanes went through memory there.
struct FmaScalar {
  static constexpr int kScoreRows = 2, kValueVectors = 1;
  static QINFER_INLINE F16 splat(float x) {
    F16 v;
    for (int i = 0; i < kLanes; ++i) v[i] = x;
    return v;
  }
  static QINFER_INLINE F16 fma(F16 a, F16 b, F16 c) {
    for (int i = 0; i < kLanes; ++i) c[i] = std::fma(a[i], b[i], c[i]);
    return c;
  }
};
struct FmaAvx512 {
  // scores of 8 rows x 32 keys, values' sums of 2 rows x 128 elements: 16 of the 32 registers
  static constexpr int kScoreRows = 8, kValueVectors = 8;
  QINFER_AVX512 static inline F16 splat(float x) { return (F16)_mm512_set1_ps(x); }
  QINFER_AVX512 static inline F16 fma(F16 a, F16 b, F16 c) {
    return (F16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
  }
};

template <typename T>
QINFER_INLINE float widen(T x);
template <>
QINFER_INLINE float widen(float x) { return x; }
template <>
QINFER_INLINE float widen(uint16_t b) { return widen_bf16(b); }

template <typename T>
struct Problem {
  const float* q;
  int64_t q0, q1, q2;  // q's strides over B, Hq, L
  const T* k;
  const T* v;
  int64_t k0, k1, k2, v0, v1, v2;  // k's and v's strides over B, Hkv, S
  float* out;                      // (B, L, Hq, D)
  int64_t Hq, Hkv, L, S, D, Dp;    // Dp: D rounded up to whole vectors
  float scale;
  int64_t rep() const { return Hq / Hkv; }
  int64_t queries() const { return std::max<int64_t>(1, kRows / rep()); }  // a task's
};

// The keys and values of every (sequence, KV head), packed once for all its tasks: per block of
// kKeys keys, kt (D, kKeys) the keys transposed, vf (kKeys, Dp) the values; fp32, zeros past
// the S keys and the D dimensions.
struct Packed {
  float* kt;  // (B, Hkv, blocks, D, kKeys)
  float* vf;  // (B, Hkv, blocks * kKeys, Dp)
  int64_t blocks, D, Dp;
  float* keys(int64_t head, int64_t block) const {
    return kt + (head * blocks + block) * D * kKeys;
  }
  float* values(int64_t head, int64_t block) const {
    return vf + (head * blocks + block) * kKeys * Dp;
  }
};

// One task's rows: queries q0 .. q0 + nq - 1 of KV head h's query heads, row r = query
// (r / rep) and head h * rep + r % rep; buffers of Dp floats a row.
struct Rows {
  float* qs;         // (R, Dp) scaled queries
  float* acc;        // (R, Dp)
  float* m;          // (R,)
  float* l;          // (R,)
  float* p;          // (R, kKeys): a block's scores, then their exponentials
  const float* kt;   // (D, kKeys): the block's keys, transposed
  const float* vb;   // (kKeys, Dp): the block's values
};

// The largest of a block's kKeys scores (any order gives the same).
QINFER_INLINE float max_of(const float* p) {
  const F16 a = load16(p), b = load16(p + kLanes);
  const F16 v = a > b ? a : b;
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// The sum of a block's kKeys weights: lane l holds p[l] + p[l + 16], then lanes 16 -> 8 -> 4
// -> 2 -> 1, lane i plus lane i + width at each width.
QINFER_INLINE float sum_of(const float* p) {
  float v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = p[i] + p[i + kLanes];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) v[i] += v[i + width];
  return v[0];
}

// Scores of RT rows against the block's transposed keys: p[r][j] = qs[r] . k_j.
template <typename P, int RT>
QINFER_INLINE void scores(const Rows& w, int64_t r0, int64_t D, int64_t Dp) {
  F16 a[RT][2] = {};
  for (int64_t d = 0; d < D; ++d) {
    const F16 k0 = load16(w.kt + d * kKeys), k1 = load16(w.kt + d * kKeys + kLanes);
    for (int r = 0; r < RT; ++r) {
      const F16 qd = P::splat(w.qs[(r0 + r) * Dp + d]);
      a[r][0] = P::fma(qd, k0, a[r][0]);
      a[r][1] = P::fma(qd, k1, a[r][1]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    store16(w.p + (r0 + r) * kKeys, a[r][0]);
    store16(w.p + (r0 + r) * kKeys + kLanes, a[r][1]);
  }
}

// acc[r][i ..] += p[r][j] v_j[i ..] for j < n over U vectors from element i, rows r0 .. r0 +
// RT - 1 alike, the sums held in registers over the keys.
template <typename P, int RT, int U>
QINFER_INLINE void weigh_vectors(const Rows& w, int64_t r0, int64_t n, int64_t Dp, int64_t i) {
  F16 a[RT][U];
  for (int r = 0; r < RT; ++r)
    for (int u = 0; u < U; ++u) a[r][u] = load16(w.acc + (r0 + r) * Dp + i + u * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    F16 pj[RT];
    for (int r = 0; r < RT; ++r) pj[r] = P::splat(w.p[(r0 + r) * kKeys + j]);
    for (int u = 0; u < U; ++u) {
      const F16 vv = load16(w.vb + j * Dp + i + u * kLanes);
      for (int r = 0; r < RT; ++r) a[r][u] = P::fma(pj[r], vv, a[r][u]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int u = 0; u < U; ++u) store16(w.acc + (r0 + r) * Dp + i + u * kLanes, a[r][u]);
}

// acc[r] += p[r][j] v_j for j < n, rows r0 .. r0 + RT - 1 alike (each element's sum in key
// order, however many vectors a pass holds).
template <typename P, int RT>
QINFER_INLINE void weigh(const Rows& w, int64_t r0, int64_t n, int64_t Dp) {
  constexpr int U = P::kValueVectors;
  int64_t i = 0;
  for (; i + U * kLanes <= Dp; i += U * kLanes) weigh_vectors<P, RT, U>(w, r0, n, Dp, i);
  for (; i < Dp; i += kLanes) weigh_vectors<P, RT, 1>(w, r0, n, Dp, i);
}

// Task (b, h, queries q0 ..): every block of keys its last query sees.
template <typename P, typename T>
QINFER_INLINE void attend_task(const Problem<T>& pr, const Packed& packed, Rows& w, int64_t b,
                               int64_t h, int64_t q0) {
  const int64_t rep = pr.rep(), D = pr.D, Dp = pr.Dp;
  const int64_t nq = std::min(pr.queries(), pr.L - q0), R = nq * rep;
  const int64_t offset = pr.S - pr.L;  // query i's last key: offset + i
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = pr.q + b * pr.q0 + (h * rep + r % rep) * pr.q1 + (q0 + r / rep) * pr.q2;
    float* qs = w.qs + r * Dp;
    for (int64_t d = 0; d < D; ++d) qs[d] = qr[d] * pr.scale;
    std::fill(qs + D, qs + Dp, 0.0f);
    std::fill(w.acc + r * Dp, w.acc + (r + 1) * Dp, 0.0f);
    w.m[r] = kNoScore;
    w.l[r] = 0.0f;
  }
  const int64_t head = b * pr.Hkv + h;
  const int64_t last_key = offset + q0 + nq - 1;
  for (int64_t j0 = 0; j0 <= last_key; j0 += kKeys) {
    const int64_t n = std::min(kKeys, pr.S - j0);  // the block's keys
    w.kt = packed.keys(head, j0 / kKeys);
    w.vb = packed.values(head, j0 / kKeys);
    // the rows that see this block: those of queries whose last key is j0 or later
    const int64_t first_query = std::max<int64_t>(0, j0 - offset - q0);
    const int64_t r_first = first_query * rep;
    int64_t r = r_first;
    for (; r + P::kScoreRows <= R; r += P::kScoreRows) scores<P, P::kScoreRows>(w, r, D, Dp);
    for (; r < R; ++r) scores<P, 1>(w, r, D, Dp);
    // each row's softmax update over the keys it sees (seen of the block's): 16 lanes, the
    // keys past them -inf for the maximum and 0 for the sum, which adds lanes l and l + 16,
    // then a fixed tree
    for (r = r_first; r < R; ++r) {
      const int64_t seen = std::min(n, offset + q0 + r / rep - j0 + 1);
      float* p = w.p + r * kKeys;
      std::fill(p + seen, p + kKeys, kNoScore);
      const float m = std::max(w.m[r], max_of(p));
      const float f = w.m[r] == kNoScore ? 0.0f : exp_fp32(w.m[r] - m);
      for (int64_t j = 0; j < kKeys; ++j) p[j] = exp_fp32(p[j] - m);
      std::fill(p + seen, p + kKeys, 0.0f);
      w.l[r] = w.l[r] * f + sum_of(p);
      w.m[r] = m;
      float* acc = w.acc + r * Dp;
      for (int64_t d = 0; d < Dp; ++d) acc[d] *= f;
    }
    // the values: two rows at a time over the keys both see, then the one that sees more
    for (r = r_first; r < R; r += 2) {
      const int64_t seen0 = std::min(n, offset + q0 + r / rep - j0 + 1);
      if (r + 1 == R) {
        weigh<P, 1>(w, r, seen0, Dp);
        break;
      }
      const int64_t seen1 = std::min(n, offset + q0 + (r + 1) / rep - j0 + 1);
      weigh<P, 2>(w, r, seen0, Dp);  // seen1 >= seen0: row r + 1's query is not earlier
      if (seen1 > seen0) {
        // row r + 1's keys past row r's: its sum goes on from where the pair stopped
        Rows rest = w;
        rest.p = w.p + seen0;
        rest.vb = w.vb + seen0 * Dp;
        weigh<P, 1>(rest, r + 1, seen1 - seen0, Dp);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inverse = 1.0f / w.l[r];
    const float* acc = w.acc + r * Dp;
    float* o = pr.out + ((b * pr.L + q0 + r / rep) * pr.Hq + h * rep + r % rep) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inverse;
  }
}

// Packs the keys and values of (sequence, KV head) `head` = b * Hkv + h, block `block`.
template <typename T>
QINFER_INLINE void pack_block(const Problem<T>& pr, const Packed& packed, int64_t head,
                              int64_t block) {
  const int64_t D = pr.D, Dp = pr.Dp, j0 = block * kKeys, n = std::min(kKeys, pr.S - j0);
  const T* keys = pr.k + (head / pr.Hkv) * pr.k0 + (head % pr.Hkv) * pr.k1 + j0 * pr.k2;
  const T* values = pr.v + (head / pr.Hkv) * pr.v0 + (head % pr.Hkv) * pr.v1 + j0 * pr.v2;
  float* kt = packed.keys(head, block);
  float* vb = packed.values(head, block);
  std::fill(kt, kt + D * kKeys, 0.0f);
  std::fill(vb, vb + kKeys * Dp, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < D; ++d) kt[d * kKeys + j] = widen(keys[j * pr.k2 + d]);
    for (int64_t d = 0; d < D; ++d) vb[j * Dp + d] = widen(values[j * pr.v2 + d]);
  }
}

// The packing and the tasks, compiled once for each path of isa.h's vector ladder (flatten:
// the path's fused multiply-add inlined into the loops, which take its target).
#define QINFER_CAUSAL_LOOPS(NAME, TARGET, FMA)                                                  \
  struct NAME {                                                                                 \
    template <typename T>                                                                       \
    TARGET static void pack(const Problem<T>& pr, const Packed& packed, int64_t head,           \
                            int64_t block) {                                                    \
      pack_block(pr, packed, head, block);                                                      \
    }                                                                                           \
    template <typename T>                                                                       \
    TARGET __attribute__((flatten)) static void task(const Problem<T>& pr, const Packed& packed, Rows& w, int64_t b,     \
                            int64_t h, int64_t q0) {                                            \
      attend_task<FMA>(pr, packed, w, b, h, q0);                                                \
    }                                                                                           \
  };
QINFER_CAUSAL_LOOPS(LoopsScalar, , FmaScalar)
QINFER_CAUSAL_LOOPS(LoopsAvx512, QINFER_AVX512, FmaAvx512)

template <typename Loops, typename T>
void attend(const Problem<T>& pr, int64_t B) {
  // Every (sequence, KV head)'s keys and values packed, then the tasks: (sequence, KV head,
  // block of queries), each head's blocks in the order first, last, second, second to last,
  // ...: a causal prompt's later blocks see more keys, and threads take runs of tasks, which
  // this order evens out.
  const int64_t heads = B * pr.Hkv, key_blocks = (pr.S + kKeys - 1) / kKeys;
  // uninitialised: `pack_block` writes every element of every block, its padding included
  const std::unique_ptr<float[]> storage(new float[heads * key_blocks * kKeys * (pr.D + pr.Dp)]);
  const Packed packed{storage.get(), storage.get() + heads * key_blocks * kKeys * pr.D,
                      key_blocks, pr.D, pr.Dp};
  at::parallel_for(0, heads * key_blocks, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) Loops::pack(pr, packed, i / key_blocks, i % key_blocks);
  });
  const int64_t nq = pr.queries(), blocks = (pr.L + nq - 1) / nq;
  std::vector<int64_t> order(blocks);
  for (int64_t i = 0; i < blocks; ++i) order[i] = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
  const int64_t R = nq * pr.rep(), Dp = pr.Dp;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buffer(2 * R * Dp + 2 * R + R * kKeys);
    Rows w{buffer.data(), buffer.data() + R * Dp, buffer.data() + 2 * R * Dp,
           buffer.data() + 2 * R * Dp + R, buffer.data() + 2 * R * Dp + 2 * R, nullptr, nullptr};
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t head = t / blocks;
      Loops::task(pr, packed, w, head / pr.Hkv, head % pr.Hkv, order[t % blocks] * nq);
    }
  });
}

template <typename T>
void attend_best(const Problem<T>& pr, int64_t B) {
  if (best(kVectorPaths) == Isa::Avx512) {
    attend<LoopsAvx512>(pr, B);
  } else {
    attend<LoopsScalar>(pr, B);
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1 && t.is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "causal_attention: ", name,
              " must be (B, H, S, D) fp32 or bf16 on the CPU with its last dimension "
              "contiguous, got ", shape_str(t), " ", t.scalar_type());
}

}  // namespace

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.stride(3) == 1 && q.is_cpu(),
              "causal_attention: q must be (B, Hq, L, D) fp32 on the CPU with its last "
              "dimension contiguous, got ", shape_str(q), " ", q.scalar_type());
  check_heads(k, "k");
  check_heads(v, "v");
  const int64_t B = q.size(0), Hq = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && S >= L && Hkv > 0 && Hq % Hkv == 0,
              "causal_attention: k must be (", B, ", Hkv, S, ", D, ") with Hkv dividing ", Hq,
              " and S >= ", L, ", got ", shape_str(k));
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(),
              "causal_attention: v must match k ", shape_str(k), " ", k.scalar_type(), ", got ",
              shape_str(v), " ", v.scalar_type());
  at::Tensor out = at::empty({B, L, Hq, D}, q.options());
  if (B == 0 || L == 0 || Hq == 0 || D == 0) return out.transpose(1, 2);
  const int64_t Dp = (D + kLanes - 1) / kLanes * kLanes;
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const Problem<T> pr{q.data_ptr<float>(), q.stride(0), q.stride(1), q.stride(2),
                        reinterpret_cast<const T*>(k.data_ptr()),
                        reinterpret_cast<const T*>(v.data_ptr()),
                        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                        v.stride(2), out.data_ptr<float>(), Hq, Hkv, L, S, D, Dp,
                        static_cast<float>(scale)};
    attend_best(pr, B);
  };
  if (k.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(uint16_t{});
  }
  return out.transpose(1, 2);
}

}  // namespace qinfer_kernels
