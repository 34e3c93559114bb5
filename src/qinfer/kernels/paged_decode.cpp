// Decode attention over the paged KV pool: the op paged_decode_attention (docs/KERNELS.md).
//
//   paged_decode_attention(q, k, v, keys, values, slots, positions, tables, totals,
//                          key_starts, block_size, window, scale) -> out
//     q (G, Hq, D), k, v (G, Hkv, D): one new token per sequence, fp32 or bf16
//     keys, values (Hkv, slots, D): one layer's pool, fp32 or bf16 (heads first)
//     slots (G,): where each token's k, v go (k, v and slots None: stored already);
//     positions (G,): each token's position
//     tables (G, W): each sequence's blocks of block_size slots
//     totals (G,): its history after the step; key_starts (G,) or None: the position of
//     each table's first block (a sliding-window space), window: the layer's or <= 0
//     out (G, Hq, D) in q's dtype: softmax(q k^T * scale) v over the visible keys
//
// What the attention computes, per (sequence, query head), every sum in key order (the
// query heads of one KV head go through its keys and values together, each alone in its sums):
//   store k, v at their slots (rounded to the pool's dtype, round half to even);
//   q' = q * scale in fp32; keys visible to a query at position p: positions in
//   [max(key_start, p - window + 1), min(total, p + 1)), read from the table's blocks, in
//   chunks of kChunk keys from the first (flash decoding: a long sequence's chunks are
//   tasks of their own, on every thread);
//   per chunk c: s_j = q' . k_j in 16 lanes (lane l sums elements l, l + 16, ...) then a
//   fixed tree; m_c = max s_j; e_j = exp(s_j - m_c) (`exp_minus`, within 2 ulp);
//   l_c = e_0 + e_1 + ...; acc_c = sum_j e_j v_j, in fp32;
//   then in chunk order: M = max m_c, f_c = exp(m_c - M), out = (sum_c f_c acc_c) *
//   (1 / sum_c f_c l_c), rounded once to q's dtype (one chunk: f = 1, out = acc * (1 / l)).
// A query's output depends only on its own q, its history and D: never on which sequences
// share the call, on their histories, on which query heads share a task or on the thread
// count (qinfer's batch invariance): the chunks are cut by the sequence's own keys alone,
// and the tasks (some query heads of one KV head over one chunk) are split between threads
// whole. Every sum is written as lanes of scalar fp32 operations (no contraction:
// -ffp-contract=off), so the loops compiled for AVX-512 and AVX2 (`QINFER_DECODE_LOOPS`)
// round exactly as the scalar ones.
//
// Why: torch runs this as ~20 ops a layer (the KV copy and its conversion, the keys'
// gather, the scaled bmm, the mask, the softmax, the values' embedding_bag), each a dispatch
// of a few µs at decode sizes, and rounds the weights and the sum to the pool's bf16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"
#include "isa.h"
#include "lanes.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {


QINFER_INLINE float widen(float x) { return x; }

QINFER_INLINE float widen(uint16_t b) { return widen_bf16(b); }

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) { *out = round_bf16(x); }

// A pool's 16 elements as lanes.h's F16 (the loops' `W::load`): fp32 as they are, bf16
// shifted into the top half of each lane, exact. GCC's generic conversion of 16 x u16 to u32
// cuts the vector in halves (5 instructions where AVX-512 needs 2), so the AVX-512 and AVX2
// loops take intrinsics; the portable one serves the scalar loops. The same values on every
// path. (Plain `inline`: GCC inlines a function of one target into that target's loops once
// the templates between are, where always_inline refuses at the target-neutral templates.)
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t B16 __attribute__((vector_size(32)));

struct WidenPortable {
  static QINFER_INLINE F16 load(const float* p) { return load16(p); }
  static QINFER_INLINE F16 load(const uint16_t* p) {
    B16 b;
    std::memcpy(&b, p, sizeof b);
    const U16 u = __builtin_convertvector(b, U16) << 16;
    F16 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
};
struct WidenAvx2 : WidenPortable {
  using WidenPortable::load;
  QINFER_AVX2 static inline F16 load(const uint16_t* p) {
    const __m256i lo = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
    const __m256i hi = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16);
    F16 v;
    std::memcpy(&v, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
    return v;
  }
};
struct WidenAvx512 : WidenPortable {
  using WidenPortable::load;
  QINFER_AVX512 static inline F16 load(const uint16_t* p) {
    const __m512i u = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    F16 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
  }
};

// lanes 16 -> 8 -> 4 -> 2 -> 1, lane l plus lane l + width at each width
QINFER_INLINE float tree(F16 v) {
  F8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const F8 s8 = lo + hi;
  F4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof lo4, sizeof hi4);
  const F4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Asks for the cache lines of [p, p + bytes) to be fetched: into L1 (Locality 3) or L2 (2).
template <int Locality, typename P>
QINFER_INLINE void prefetch(const P* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(c + at, 0, Locality);
}

// Up to this many query heads of one KV head go through a block together: each key and
// value row is read (and widened) once for all of them.
constexpr int kMaxHeads = 4;

// scores[r][j0 + j] = q[r] . keys[j] for the n consecutive key rows of one block and R
// queries: lane l sums q[i] * k[i] for i = l mod 16 (the D % 16 tail into lanes 0.. in
// order), then `tree`; each query's sums alone, as if it were the only one.
template <int R, typename W, typename K>
QINFER_INLINE void block_scores(const float* const* q, const K* keys, int64_t n, int64_t D,
                                float* const* scores, int64_t j0, const K* next_keys,
                                const K* next_values) {
  const int64_t body = D - D % kLanes;
  for (int64_t j = 0; j < n; ++j) {
    const K* k = keys + j * D;
    if (next_keys != nullptr) {
      prefetch<2>(next_keys + j * D, D * static_cast<int64_t>(sizeof(K)));
      prefetch<2>(next_values + j * D, D * static_cast<int64_t>(sizeof(K)));
    }
    F16 lanes[R] = {};
    for (int64_t i = 0; i < body; i += kLanes) {
      const F16 kv = W::load(k + i);
      for (int r = 0; r < R; ++r) lanes[r] += load16(q[r] + i) * kv;
    }
    for (int64_t i = body; i < D; ++i) {
      const float kw = widen(k[i]);
      for (int r = 0; r < R; ++r) lanes[r][i - body] += q[r][i] * kw;
    }
    for (int r = 0; r < R; ++r) scores[r][j0 + j] = tree(lanes[r]);
  }
}

// acc[r][i + e] += w[r][j0 + j] * values[j][i + e] for the U * 16 elements e from i, j in
// order, the sums held in registers over the block's rows.
template <int R, int U, typename W, typename K>
QINFER_INLINE void sum_chunks(const float* const* w, int64_t j0, const K* values, int64_t n,
                              int64_t D, float* const* acc, int64_t i) {
  F16 a[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) a[r][u] = load16(acc[r] + i + u * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    for (int u = 0; u < U; ++u) {
      const F16 vv = W::load(values + j * D + i + u * kLanes);
      for (int r = 0; r < R; ++r) a[r][u] += w[r][j0 + j] * vv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) std::memcpy(acc[r] + i + u * kLanes, &a[r][u], sizeof a[r][u]);
}

// acc[r][i] += w[r][j0 + j] * values[j][i] for the n consecutive value rows of one block, j
// in order (16 * U elements of each acc at a time, held in registers over the block's rows)
template <int R, typename W, typename K>
QINFER_INLINE void block_sum(const float* const* w, int64_t j0, const K* values, int64_t n,
                             int64_t D, float* const* acc) {
  const int64_t body = D - D % kLanes;
  // U chunks of 16 elements at once: each element's sum is a chain of dependent adds over
  // the keys, and R * U >= 4 chains keep the adder busy where R alone (one or two heads)
  // left it waiting on the previous add (Qwen3-0.6B, 2 heads of 128: ~4 cycles a key and
  // chunk). Each element is still summed alone in key order: the same bits for any U.
  constexpr int U = (4 + R - 1) / R;
  int64_t i = 0;
  for (; i + U * kLanes <= body; i += U * kLanes) sum_chunks<R, U, W>(w, j0, values, n, D, acc, i);
  for (; i < body; i += kLanes) sum_chunks<R, 1, W>(w, j0, values, n, D, acc, i);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = body; i < D; ++i) {
      const float vw = widen(values[j * D + i]);
      for (int r = 0; r < R; ++r) acc[r][i] += w[r][j0 + j] * vw;
    }
  }
}

// e[j] = exp(s[j] - m) for j < n, each element alone (no sum across them): common.h's
// exp_fp32, the same bits on every path.
QINFER_INLINE void exp_minus(float* s, int64_t n, float m) {
  for (int64_t j = 0; j < n; ++j) s[j] = exp_fp32(s[j] - m);
}

// out[r * D + i] = q[r * D + i] * scales[r * N + i / (D / N)] for `count` rows of an int8 pool
// (N fp16 scales a row): exact in fp32 (8 bits by 11), so the loops read the values an fp32
// pool of the dequantized rows holds.
QINFER_INLINE void dequantize_rows(const int8_t* q, const at::Half* scales, int64_t count,
                                   int64_t D, int64_t N, float* out) {
  const int64_t per = D / N;
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t n = 0; n < N; ++n) {
      const float scale = static_cast<float>(scales[r * N + n]);
      const int8_t* from = q + r * D + n * per;
      float* to = out + r * D + n * per;
      for (int64_t i = 0; i < per; ++i) to[i] = static_cast<float>(from[i]) * scale;
    }
  }
}

// The scores and the weighted sum of one block's keys for 1 to kMaxHeads query heads, K the
// pool's element (fp32 or bf16).
template <typename W, typename K>
QINFER_INLINE void scores_for_heads(int heads, const float* const* q, const K* k, int64_t n,
                                    int64_t D, float* const* s, int64_t j0, const K* nk,
                                    const K* nv) {
  switch (heads) {
    case 4: block_scores<4, W>(q, k, n, D, s, j0, nk, nv); break;
    case 3: block_scores<3, W>(q, k, n, D, s, j0, nk, nv); break;
    case 2: block_scores<2, W>(q, k, n, D, s, j0, nk, nv); break;
    default: block_scores<1, W>(q, k, n, D, s, j0, nk, nv); break;
  }
}
template <typename W, typename K>
QINFER_INLINE void sum_for_heads(int heads, const float* const* w, int64_t j0, const K* v,
                                 int64_t n, int64_t D, float* const* acc) {
  switch (heads) {
    case 4: block_sum<4, W>(w, j0, v, n, D, acc); break;
    case 3: block_sum<3, W>(w, j0, v, n, D, acc); break;
    case 2: block_sum<2, W>(w, j0, v, n, D, acc); break;
    default: block_sum<1, W>(w, j0, v, n, D, acc); break;
  }
}
// The inner loops, compiled once for each path of isa.h's vector ladder (scalar, AVX2,
// AVX-512) from the one source above: every ISA computes the same bits (lanes of scalar fp32
// operations, no contraction). `attend` takes one, picked once per call.
#define QINFER_DECODE_LOOPS(NAME, TARGET, WIDEN)                                         \
  struct NAME {                                                                         \
    template <typename K>                                                               \
    TARGET static void scores(int heads, const float* const* q, const K* k, int64_t n, \
                              int64_t D, float* const* s, int64_t j0, const K* nk,      \
                              const K* nv) {                                            \
      scores_for_heads<WIDEN>(heads, q, k, n, D, s, j0, nk, nv);                        \
    }                                                                                   \
    template <typename K>                                                               \
    TARGET static void sum(int heads, const float* const* w, int64_t j0, const K* v,    \
                           int64_t n, int64_t D, float* const* acc) {                   \
      sum_for_heads<WIDEN>(heads, w, j0, v, n, D, acc);                                 \
    }                                                                                   \
    TARGET static void exp(float* s, int64_t n, float m) { exp_minus(s, n, m); }         \
    TARGET static void dequantize(const int8_t* q, const at::Half* scales, int64_t count, \
                                  int64_t D, int64_t N, float* out) {                   \
      dequantize_rows(q, scales, count, D, N, out);                                     \
    }                                                                                   \
  };
QINFER_DECODE_LOOPS(LoopsScalar, , WidenPortable)
QINFER_DECODE_LOOPS(LoopsAvx2, QINFER_AVX2, WidenAvx2)
QINFER_DECODE_LOOPS(LoopsAvx512, QINFER_AVX512, WidenAvx512)

// The raw elements of an fp32 or bf16 tensor.
template <typename T>
T* raw(const at::Tensor& t);
template <>
float* raw<float>(const at::Tensor& t) { return t.data_ptr<float>(); }
template <>
uint16_t* raw<uint16_t>(const at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

template <>
int8_t* raw<int8_t>(const at::Tensor& t) { return t.data_ptr<int8_t>(); }

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

struct Layer {
  int64_t G, Hq, Hkv, D, block_size;
  const int64_t* slots;
  const int64_t* positions;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* totals;
  const int64_t* key_starts;  // or null: every table starts at position 0
  int64_t window;             // <= 0: none
  float scale;
  // an int8 pool's fp16 scales, (Hkv, slots, N) each (null for fp32 and bf16 pools)
  at::Half* key_scales;
  at::Half* value_scales;
  int64_t N;
};

// One (token, head) row x of D elements into the pool at `to`: rounded to an fp32 or bf16
// pool's dtype (round half to even); for an int8 pool, quantized as kv_quant's "int8" does
// (`KVFormat.quantize`, the same bits): per block of D / N elements, scale = fp16(absmax / 127)
// (round to nearest even) into `scales`, and each element round-half-to-even of x / scale
// clamped to [-127, 127] (the scale taken at least FLT_MIN: an all-zero block stores zeros).
// A block holding a NaN stores a NaN scale and zeros, as torch's amax and int8 cast leave it
// (and no NaN is cast to int8 here, which C++ leaves undefined).
template <typename Q, typename P>
void put_row(const Q* x, P* to, at::Half*, int64_t D, int64_t) {
  for (int64_t i = 0; i < D; ++i) narrow(widen(x[i]), to + i);
}
template <typename Q>
void put_row(const Q* x, int8_t* to, at::Half* scales, int64_t D, int64_t N) {
  const int64_t per = D / N;
  for (int64_t n = 0; n < N; ++n) {
    float absmax = 0.0f;
    for (int64_t i = n * per; i < (n + 1) * per; ++i) {
      const float a = std::fabs(widen(x[i]));
      absmax = std::isnan(a) || std::isnan(absmax) ? std::numeric_limits<float>::quiet_NaN()
                                                   : std::max(absmax, a);
    }
    scales[n] = at::Half(absmax / 127.0f);
    const float tiny = std::numeric_limits<float>::min();
    const float divisor = std::max(static_cast<float>(scales[n]), tiny);
    for (int64_t i = n * per; i < (n + 1) * per; ++i) {
      const float y = std::min(std::max(widen(x[i]) / divisor, -127.0f), 127.0f);
      to[i] = std::isnan(absmax) ? 0 : static_cast<int8_t>(std::nearbyint(y));
    }
  }
}

// k, v (G, Hkv, D) -> the pool's rows at their slots (`put_row`), an int8 pool's scales
// (Hkv, slots, N) beside.
template <typename Q, typename P>
void store(const Layer& L, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys,
           const at::Tensor& values) {
  const Q* kp = raw<Q>(k);
  const Q* vp = raw<Q>(v);
  P* keys_p = raw<P>(keys);
  P* values_p = raw<P>(values);
  const int64_t num_slots = keys.size(1);
  for (int64_t g = 0; g < L.G; ++g) {
    for (int64_t h = 0; h < L.Hkv; ++h) {
      const int64_t scales_at = (h * num_slots + L.slots[g]) * L.N;
      put_row(kp + g * k.stride(0) + h * k.stride(1),
              keys_p + h * keys.stride(0) + L.slots[g] * keys.stride(1),
              L.key_scales ? L.key_scales + scales_at : nullptr, L.D, L.N);
      put_row(vp + g * v.stride(0) + h * v.stride(1),
              values_p + h * values.stride(0) + L.slots[g] * values.stride(1),
              L.value_scales ? L.value_scales + scales_at : nullptr, L.D, L.N);
    }
  }
}

// The keys a query at position p of sequence g sees: [first, end) of its table's, whose
// first block starts at position `start`.
struct Visible {
  int64_t start, first, end;
  int64_t count() const { return std::max<int64_t>(end - first, 0); }
};

Visible visible(const Layer& L, int64_t g) {
  const int64_t p = L.positions[g];
  const int64_t start = L.key_starts ? L.key_starts[g] : 0;
  return {start, std::max(start, L.window > 0 ? p - L.window + 1 : start),
          std::min(L.totals[g], p + 1)};
}

// Keys per chunk of a sequence's visible keys: a task reads at most this many, so that one
// long sequence is shared between threads. Where the chunks start depends on the sequence
// alone (every kChunk keys from its first visible one), never on the batch or the threads.
constexpr int64_t kChunk = 256;

// What one chunk leaves for each of its query heads: acc = sum_j exp(s_j - m) v_j, then its
// largest score m and l = sum_j exp(s_j - m), in key order (D + 2 floats); each chunk's
// partials on cache lines of their own (threads write neighbouring chunks), acc 64-byte
// aligned. Sequence g's chunks start at
// offsets[g] (the chunks of the sequences before it), head h's at offsets[g] * Hq + h *
// chunks[g]: the buffer holds every task's partials and nothing more.
struct Partials {
  at::Tensor data;  // uninitialised: every partial that `combine` reads is written
  const std::vector<int64_t>& offsets;
  const std::vector<int64_t>& chunks;
  int64_t Hq, stride;
  Partials(const std::vector<int64_t>& offsets, const std::vector<int64_t>& chunks,
           int64_t total, int64_t Hq, int64_t D)
      : offsets(offsets), chunks(chunks), Hq(Hq), stride((D + 2 + 15) / 16 * 16) {
    data = at::empty({total * Hq * stride}, at::kFloat);
  }
  float* at(int64_t g, int64_t h, int64_t c) {
    return data.data_ptr<float>() + (offsets[g] * Hq + h * chunks[g] + c) * stride;
  }
};

// Query heads h0 .. h0 + heads - 1 of sequence g, all of one KV head, over chunk c of its
// visible keys: each head's scores, their exponentials and sums, the keys and values read
// once for them all.
template <typename Q, typename P, typename Loops>
void attend_chunk(const Layer& L, int64_t g, int64_t h0, int heads, int64_t c, const Q* q,
                  int64_t q_stride0, int64_t q_stride1, const P* keys, const P* values,
                  int64_t pool_stride0, Partials& partials) {
  const int64_t D = L.D, B = L.block_size;
  const Visible v = visible(L, g);
  const int64_t first = v.first + c * kChunk;
  const int64_t n = std::min(kChunk, v.end - first);
  float scores[kMaxHeads * kChunk];
  float* qs[kMaxHeads];
  float* acc[kMaxHeads];
  float* s[kMaxHeads];
  for (int r = 0; r < heads; ++r) {
    acc[r] = partials.at(g, h0 + r, c);
    qs[r] = acc[r];  // the scaled query, until the value pass overwrites it with sums
    s[r] = scores + r * kChunk;
    const Q* qh = q + g * q_stride0 + (h0 + r) * q_stride1;
    for (int64_t i = 0; i < D; ++i) qs[r][i] = widen(qh[i]) * L.scale;
  }
  const int64_t kv_head = h0 / (L.Hq / L.Hkv);
  const P* head_keys = keys + kv_head * pool_stride0;
  const P* head_values = values + kv_head * pool_stride0;
  const int64_t* table = L.tables + g * L.table_stride;
  // The chunk's keys, block by block: visit(j, count, row, next) for its keys j .. j + count
  // - 1, from the head's pool row `row` on, `next` the first row of the table's next block
  // (-1 at the chunk's last). A table's blocks lie anywhere in the pool, where the
  // hardware's prefetcher does not follow: while a block's keys are scored, the next
  // block's keys and values are fetched into L2 (the value pass reads the values), and that
  // pass fetches the next values into L1. Keys fetched into L1 stalled the scores on the
  // prefetches themselves (Qwen3-0.6B's heads, 32 sequences from memory: 20% slower).
  const int64_t last_block = (first + n - 1 - v.start) / B;
  const auto blocks = [&](auto&& visit) {
    for (int64_t j = 0; j < n;) {
      const int64_t key = first + j - v.start, in_block = key % B;
      const int64_t count = std::min(B - in_block, n - j);
      const int64_t next = key / B < last_block ? table[key / B + 1] * B * D : -1;
      visit(j, count, (table[key / B] * B + in_block) * D, next);
      j += count;
    }
  };
  // A block's rows as the loops read them: an fp32 or bf16 pool's where they lie, an int8
  // pool's dequantized into a buffer (read as an fp32 pool's rows).
  constexpr bool quantized = std::is_same_v<P, int8_t>;
  static thread_local std::vector<float> buffer;
  if constexpr (quantized) buffer.resize(static_cast<size_t>(B * D));
  const int64_t scales_offset = kv_head * (pool_stride0 / D) * L.N;
  const auto read = [&](const P* rows, const at::Half* scales, int64_t row, int64_t count) {
    if constexpr (quantized) {
      Loops::dequantize(rows + row, scales + scales_offset + row / D * L.N, count, D, L.N,
                        buffer.data());
      return static_cast<const float*>(buffer.data());
    } else {
      return rows + row;
    }
  };
  // The next block's rows, and an int8 pool's scales, fetched into L1 (Locality 3) or L2 (2).
  const auto fetch = [&](auto locality, const P* rows, const at::Half* scales, int64_t next) {
    constexpr int kLocality = decltype(locality)::value;
    prefetch<kLocality>(rows + next, B * D * static_cast<int64_t>(sizeof(P)));
    if constexpr (quantized)
      prefetch<kLocality>(scales + scales_offset + next / D * L.N,
                          B * L.N * static_cast<int64_t>(sizeof(at::Half)));
  };
  using IntoL1 = std::integral_constant<int, 3>;
  using IntoL2 = std::integral_constant<int, 2>;
  blocks([&](int64_t j, int64_t count, int64_t row, int64_t next) {
    if constexpr (quantized) {  // whole blocks fetched ahead (the rows are read once, widened)
      if (next >= 0) {
        fetch(IntoL2{}, head_keys, L.key_scales, next);
        fetch(IntoL2{}, head_values, L.value_scales, next);
      }
      const float* none = nullptr;
      Loops::scores(heads, qs, read(head_keys, L.key_scales, row, count), count, D, s, j, none,
                    none);
    } else {  // the next block's rows fetched as each key of this one is scored
      Loops::scores(heads, qs, head_keys + row, count, D, s, j,
                    next < 0 ? nullptr : head_keys + next,
                    next < 0 ? nullptr : head_values + next);
    }
  });
  for (int r = 0; r < heads; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[r][j]);
    if (m == -std::numeric_limits<float>::infinity()) {
      std::fill(s[r], s[r] + n, 0.0f);  // no weight here (-inf - -inf would be NaN)
    } else {
      Loops::exp(s[r], n, m);
    }
    float l = 0.0f;
    for (int64_t j = 0; j < n; ++j) l += s[r][j];
    acc[r][D] = m;
    acc[r][D + 1] = l;
    std::fill(acc[r], acc[r] + D, 0.0f);
  }
  blocks([&](int64_t j, int64_t count, int64_t row, int64_t next) {
    if (next >= 0) fetch(IntoL1{}, head_values, L.value_scales, next);
    Loops::sum(heads, s, j, read(head_values, L.value_scales, row, count), count, D, acc);
  });
}

// One query head's output from its chunks' partials (acc, then m and l, `stride` floats
// apart), in chunk order: with M the largest m, f_c = exp(m_c - M), out = (sum_c f_c acc_c)
// * (1 / sum_c f_c l_c), rounded once to Q.
template <typename Q, typename Loops>
void combine(const float* first_partial, int64_t chunks, int64_t stride, int64_t D,
             float* factors, float* sum, Q* out) {
  float M = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) M = std::max(M, first_partial[c * stride + D]);
  for (int64_t c = 0; c < chunks; ++c) factors[c] = first_partial[c * stride + D];
  Loops::exp(factors, chunks, M);
  float l = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) l += factors[c] * first_partial[c * stride + D + 1];
  std::fill(sum, sum + D, 0.0f);
  for (int64_t c = 0; c < chunks; ++c) {
    const float* acc = first_partial + c * stride;
    for (int64_t i = 0; i < D; ++i) sum[i] += factors[c] * acc[i];
  }
  const float inverse = 1.0f / l;
  for (int64_t i = 0; i < D; ++i) narrow(sum[i] * inverse, out + i);
}

template <typename Q, typename P, typename Loops>
void attend(const Layer& L, const at::Tensor& q, const at::Tensor* k, const at::Tensor* v,
            const at::Tensor& keys, const at::Tensor& values, at::Tensor& out) {
  if (k != nullptr) store<Q, P>(L, *k, *v, keys, values);
  const Q* qp = raw<Q>(q);
  const P* kp = raw<P>(keys);
  const P* vp = raw<P>(values);
  Q* op = raw<Q>(out);
  // Tasks: up to `per` query heads of one KV head over one chunk of one sequence's keys.
  // Fewer heads a task where there would be fewer tasks than twice the threads (Gemma 3
  // 270M: one KV head of 4 query heads); a query's arithmetic is the same in any grouping.
  std::vector<int64_t> chunks(L.G), offsets(L.G);
  int64_t most = 1, total = 0;
  for (int64_t g = 0; g < L.G; ++g) {
    chunks[g] = std::max<int64_t>(1, (visible(L, g).count() + kChunk - 1) / kChunk);
    offsets[g] = total;
    most = std::max(most, chunks[g]);
    total += chunks[g];
  }
  const int64_t rep = L.Hq / L.Hkv;
  int64_t per = std::min<int64_t>(rep, kMaxHeads);
  while (per > 1 && total * L.Hkv * ((rep + per - 1) / per) < 2 * at::get_num_threads()) --per;
  const int64_t groups = L.Hkv * ((rep + per - 1) / per);  // head groups of a sequence
  struct Task {
    int64_t g, h0, chunk;
    int heads;
  };
  std::vector<Task> tasks;
  tasks.reserve(total * groups);
  for (int64_t g = 0; g < L.G; ++g) {
    for (int64_t kv = 0; kv < L.Hkv; ++kv) {
      for (int64_t h0 = kv * rep; h0 < (kv + 1) * rep; h0 += per) {
        const int heads = static_cast<int>(std::min(per, (kv + 1) * rep - h0));
        for (int64_t c = 0; c < chunks[g]; ++c) tasks.push_back({g, h0, c, heads});
      }
    }
  }
  Partials partials(offsets, chunks, total, L.Hq, L.D);
  // Each thread claims the next task as it finishes one: tasks differ in length (a
  // sequence's last chunk is short), and a static split of a few of them (one sequence: a
  // KV head's chunks) left one thread with most of the keys. Each task writes its own
  // partials, so who runs it changes no bit.
  const int64_t count = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < count; t = next++) {
      const Task& task = tasks[t];
      attend_chunk<Q, P, Loops>(L, task.g, task.h0, task.heads, task.chunk, qp, q.stride(0),
                         q.stride(1), kp, vp, keys.stride(0), partials);
    }
  });
  at::parallel_for(0, L.G * L.Hq, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> factors(most), sum(L.D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t g = r / L.Hq, h = r % L.Hq;
      combine<Q, Loops>(partials.at(g, h, 0), chunks[g], partials.stride, L.D, factors.data(),
              sum.data(), op + r * L.D);
    }
  });
}

// `attend` with the loops of the fastest path this CPU runs (all compute the same bits).
template <typename Q, typename P>
void attend_best(const Layer& L, const at::Tensor& q, const at::Tensor* k, const at::Tensor* v,
                 const at::Tensor& keys, const at::Tensor& values, at::Tensor& out) {
  switch (best(kVectorPaths)) {
    case Isa::Avx512: attend<Q, P, LoopsAvx512>(L, q, k, v, keys, values, out); break;
    case Isa::Avx2: attend<Q, P, LoopsAvx2>(L, q, k, v, keys, values, out); break;
    default: attend<Q, P, LoopsScalar>(L, q, k, v, keys, values, out);
  }
}

void check_heads(const at::Tensor& t, const char* name, int64_t G, int64_t H, int64_t D,
                 at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == G && t.size(1) == H && t.size(2) == D &&
                  t.stride(2) == 1 && t.scalar_type() == dtype && t.is_cpu(),
              "paged_decode_attention: ", name, " must be (", G, ", ", H, ", ", D, ") ", dtype,
              " with its last dimension contiguous, got ", shape_str(t), " ", t.scalar_type());
}

void check_index(const at::Tensor& t, const char* name, int64_t G) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == G && t.scalar_type() == at::kLong && t.is_contiguous(),
              "paged_decode_attention: ", name, " must be (", G, ",) int64, got ",
              shape_str(t), " ", t.scalar_type());
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const c10::optional<at::Tensor>& k,
                                  const c10::optional<at::Tensor>& v, const at::Tensor& keys,
                                  const at::Tensor& values,
                                  const c10::optional<at::Tensor>& slots,
                                  const at::Tensor& positions,
                                  const at::Tensor& tables, const at::Tensor& totals,
                                  const c10::optional<at::Tensor>& key_starts,
                                  int64_t block_size, int64_t window, double scale,
                                  const c10::optional<at::Tensor>& key_scales,
                                  const c10::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(q.dim() == 3 && q.size(1) > 0 && q.size(2) > 0 && float_or_bf16(q) && q.is_cpu() &&
                  q.stride(2) == 1,
              "paged_decode_attention: q must be (G, Hq, D) fp32 or bf16 on the CPU with Hq, D > "
              "0 and its last dimension contiguous, got ", shape_str(q), " ", q.scalar_type());
  const int64_t G = q.size(0), Hq = q.size(1), D = q.size(2);
  const bool int8_pool = keys.scalar_type() == at::kChar;
  TORCH_CHECK(keys.dim() == 3 && keys.size(2) == D && keys.is_contiguous() &&
                  (float_or_bf16(keys) || int8_pool),
              "paged_decode_attention: keys must be a contiguous (Hkv, slots, ", D,
              ") fp32, bf16 or int8 pool, got ", shape_str(keys), " ", keys.scalar_type());
  const int64_t Hkv = keys.size(0), num_slots = keys.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_decode_attention: ", Hq,
              " query heads do not share ", Hkv, " KV heads evenly");
  TORCH_CHECK(values.sizes() == keys.sizes() && values.is_contiguous() &&
                  values.scalar_type() == keys.scalar_type(),
              "paged_decode_attention: values must match keys ", shape_str(keys), " ",
              keys.scalar_type(), ", got ", shape_str(values), " ", values.scalar_type());
  TORCH_CHECK(block_size > 0 && num_slots % block_size == 0, "paged_decode_attention: ",
              num_slots, " slots are not whole blocks of ", block_size);
  const bool stores = k.has_value();
  TORCH_CHECK(v.has_value() == stores && slots.has_value() == stores,
              "paged_decode_attention: k, v and slots are given together or not at all");
  // An int8 pool: fp16 scales (Hkv, slots, N), N dividing D, one per D / N elements of a row
  // (kv_quant's layout), written for the k and v it stores.
  const std::pair<const char*, const c10::optional<at::Tensor>*> given[] = {
      {"key_scales", &key_scales}, {"value_scales", &value_scales}};
  for (const auto& [name, t] : given)
    TORCH_CHECK(t->has_value() == int8_pool, "paged_decode_attention: ", name,
                " is given with an int8 pool and only then, got a ", keys.scalar_type(), " pool ",
                t->has_value() ? "with" : "without", " it");
  int64_t N = 0;
  if (int8_pool) {
    N = key_scales->dim() == 3 ? key_scales->size(2) : 0;
    for (const auto& [name, optional] : given) {
      const at::Tensor* t = &**optional;
      TORCH_CHECK(t->dim() == 3 && t->size(0) == Hkv && t->size(1) == num_slots && N > 0 &&
                      t->size(2) == N && D % N == 0 && t->is_contiguous() &&
                      t->scalar_type() == at::kHalf,
                  "paged_decode_attention: ", name, " must be contiguous (", Hkv, ", ",
                  num_slots, ", N) fp16 with N dividing ", D, " (key_scales' N), got ",
                  shape_str(*t), " ", t->scalar_type());
    }
  }
  if (stores) {
    check_heads(*k, "k", G, Hkv, D, q.scalar_type());
    check_heads(*v, "v", G, Hkv, D, q.scalar_type());
    check_index(*slots, "slots", G);
  }
  check_index(positions, "positions", G);
  check_index(totals, "totals", G);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == G && tables.size(1) > 0 &&
                  tables.scalar_type() == at::kLong && tables.stride(1) == 1,
              "paged_decode_attention: tables must be (", G, ", W) int64 with W > 0, got ",
              shape_str(tables), " ", tables.scalar_type());
  if (key_starts.has_value()) check_index(*key_starts, "key_starts", G);
  const Layer L{G,
                Hq,
                Hkv,
                D,
                block_size,
                stores ? slots->data_ptr<int64_t>() : nullptr,
                positions.data_ptr<int64_t>(),
                tables.data_ptr<int64_t>(),
                tables.stride(0),
                totals.data_ptr<int64_t>(),
                key_starts.has_value() ? key_starts->data_ptr<int64_t>() : nullptr,
                window,
                static_cast<float>(scale),
                int8_pool ? key_scales->data_ptr<at::Half>() : nullptr,
                int8_pool ? value_scales->data_ptr<at::Half>() : nullptr,
                N};
  // Every slot the call writes or reads is in the pool: a wrong table is an error here, not
  // a read past the pool's end.
  const int64_t W = tables.size(1), num_blocks = num_slots / block_size;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t start = L.key_starts ? L.key_starts[g] : 0;
    TORCH_CHECK(!stores || (L.slots[g] >= 0 && L.slots[g] < num_slots),
                "paged_decode_attention: slot ", stores ? L.slots[g] : 0, " of sequence ", g,
                " is outside the pool's ", num_slots);
    TORCH_CHECK(L.positions[g] >= start && L.totals[g] <= start + W * block_size &&
                    L.positions[g] < L.totals[g],
                "paged_decode_attention: sequence ", g, " at position ", L.positions[g],
                " with ", L.totals[g], " keys does not fit its table of ", W,
                " blocks from position ", start);
    for (int64_t b = 0; b < W; ++b) {
      const int64_t block = L.tables[g * L.table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block ", block,
                  " in the table of sequence ", g, " is outside the pool's ", num_blocks);
    }
  }
  at::Tensor out = at::empty({G, Hq, D}, q.options());
  const at::Tensor* kp = stores ? &*k : nullptr;
  const at::Tensor* vp = stores ? &*v : nullptr;
  const bool q32 = q.scalar_type() == at::kFloat, p32 = keys.scalar_type() == at::kFloat;
  if (int8_pool) {
    if (q32) attend_best<float, int8_t>(L, q, kp, vp, keys, values, out);
    else attend_best<uint16_t, int8_t>(L, q, kp, vp, keys, values, out);
    return out;
  }
  if (q32 && p32) attend_best<float, float>(L, q, kp, vp, keys, values, out);
  if (q32 && !p32) attend_best<float, uint16_t>(L, q, kp, vp, keys, values, out);
  if (!q32 && p32) attend_best<uint16_t, float>(L, q, kp, vp, keys, values, out);
  if (!q32 && !p32) attend_best<uint16_t, uint16_t>(L, q, kp, vp, keys, values, out);
  return out;
}

}  // namespace qinfer_kernels
