// int4 groups of 32 (pack_int4's layout: GGUF's Q4_0, Q4_1 and Q4_K values) x fp32
// activations in fp32: the op int4_groups_mm. docs/KERNELS.md says what it computes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "matmul.h"
#include "ops.h"

namespace qinfer_kernels {
namespace {

// ---------------------------------------------------------------------------------------
// int4 groups of 32 (`Int4Packed`'s layout: GGUF's Q4_0, Q4_1 and Q4_K values, kept exactly)
// times fp32 activations (bf16 ones widened exactly). The weight is d q + m per block, so
//   sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j:
// the nibbles q (0..15, exact in fp32) multiply x in fp32 fused multiply-adds, each block's
// sum is scaled by its d, and the m terms come from each block's sum of x (`ActF4::sx`, once
// per row for every column). Nothing is rounded but fp32 products and sums: the result is x
// @ W.T of the exact weight to fp32 accuracy (a few ulps of sum |d q x| + |m x|).
//
// Why this form: a decode row is bound by the vector ops per weight, not by the read (the
// previous form, a 16-entry table of d q + m per block picked by nibble, ran at 11-12 GB/s a
// core). Here a 64-byte load holds 4 blocks as 16 dwords, and slice k (0..7) of all 16 lanes
// is nibble k of each dword: one shift, one vpermps of the constant 0..15 (it reads only
// an index's low 4 bits, so no mask) and one fused multiply-add per 16 weights, the d of a
// lane's block applied once per group of 4 blocks (1.4x fewer ns per block measured on Zen 4).
// The activations are reordered once per call to match (`ActF4::xp`): slice k, lane i is
// element 4 (i % 4) + k / 2 + 16 (k % 2) of block 4 g + i / 4.
//
// Per output (r, n), on the vector paths (lanes L: 16 AVX512, 8 AVX2, which takes a group
// as two halves of 2 blocks):
//   tot (lanes) = 0
//   for each group of 4 blocks (the last padded with zero weights and activations):
//     a0 = q(slice 0) * x(slice 0); a1 = q(slice 1) * x(slice 1)
//     a0 = fma(q(slice k), x(slice k), a0) for k = 2, 4, 6; a1 the same for k = 3, 5, 7
//     tot = fma(a0 + a1, d of each lane's block, tot)      (AVX2: per half, low then high)
//   mt (lanes) = fma(m, sx, mt) over chunks of L blocks (padded with zeros)
//   out = horizontal sum of (tot + mt) (a fixed tree of adds)
// The scalar path, block by block in the natural order: t_b = fma(q_j, x_j, t_b) over j,
// tot = fma(t_b, d_b, tot); mt = fma(m_b, sx_b, mt) over b; out = tot + mt.
// ---------------------------------------------------------------------------------------

constexpr int64_t kGroup = 4 * kBlock;  // weights per 64-byte load of a column

struct ActF4 {
  const float* x;   // (M, K) as given (the scalar path's order)
  const float* xp;  // (M, ng * kGroup): each group's slices, zeros past K
  const float* sx;  // (M, nbs): each block's sum of x, zeros past nb
  int64_t ng, nbs;
  const float* row_xp(int64_t r) const { return xp + r * ng * kGroup; }
  const float* row_sx(int64_t r) const { return sx + r * nbs; }
};

// This thread's reordered activations, kept between calls up to kKeptFloats each (a decode
// step makes hundreds of calls; an allocation each costs more than a small one's work), a
// longer prompt's given back after its call. 64-byte aligned, as torch's tensors are: a
// tile's 64-byte loads of them then never straddle two cache lines (from a 16-byte aligned
// vector, the kernel ran up to 2x slower).
struct ActF4Storage {
  static constexpr int64_t kKeptFloats = int64_t{2} << 20;  // 8 MiB
  std::vector<float> xp_held, sx_held;
  static float* aligned(std::vector<float>& held, int64_t n) {
    held.resize(static_cast<size_t>(n + 16));
    const auto at = (reinterpret_cast<uintptr_t>(held.data()) + 63) & ~uintptr_t{63};
    return reinterpret_cast<float*>(at);
  }
  void trim() {
    for (std::vector<float>* held : {&xp_held, &sx_held})
      if (static_cast<int64_t>(held->size()) > kKeptFloats) std::vector<float>().swap(*held);
  }
  // reorder: false for the scalar path, which reads x as it is (and sx)
  ActF4 make(const float* x, int64_t M, int64_t K, bool reorder) {
    const int64_t nb = K / kBlock, ng = (nb + 3) / 4, nbs = (nb + 15) / 16 * 16;
    float* const xp = reorder ? aligned(xp_held, M * ng * kGroup) : nullptr;
    float* const sx = aligned(sx_held, M * nbs);
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * K;
        float* sxr = sx + r * nbs;
        std::fill(sxr + nb, sxr + nbs, 0.0f);
        for (int64_t b = 0; b < nb; ++b) {
          float s = 0.0f;
          for (int64_t j = 0; j < kBlock; ++j) s += xr[b * kBlock + j];
          sxr[b] = s;
        }
        if (!reorder) continue;
        float* xpr = xp + r * ng * kGroup;
        std::fill(xpr + (nb >> 2) * kGroup, xpr + ng * kGroup, 0.0f);  // a last partial group
        for (int64_t b = 0; b < nb; ++b) {
          const float* xb = xr + b * kBlock;
          float* group = xpr + (b >> 2) * kGroup + (b & 3) * 4;
          for (int64_t p = 0; p < 16; ++p) {  // the byte holding elements p and p + 16
            float* lane = group + (p & 3) * 32 + (p >> 2);
            lane[0] = xb[p];
            lane[16] = xb[p + 16];
          }
        }
      }
    });
    return ActF4{x, xp, sx, ng, nbs};
  }
};

// scales S: fp16 or fp32 (matmul.h, `Int4Packed`)
template <typename S>
struct Int4GroupsF32 {
  QINFER_MATMUL_KERNEL(Int4Packed<S>, ActF4)
};

// A tile's R rows of the activations (from row r0), copied into locals as Q8Rows are.
template <int R>
struct F4Rows {
  const float* xp[R];
  const float* sx[R];
  QINFER_INLINE F4Rows(const ActF4& a, int64_t r0) {
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      xp[i] = a.row_xp(r0 + i);
      sx[i] = a.row_sx(r0 + i);
    }
  }
};

// The dwords and block scales of group g of a column, zeros past its nb blocks.
QINFER_VNNI inline __m512i group_vnni(const uint8_t* qs, int64_t g, int64_t nb) {
  const int64_t left = nb - 4 * g;
  if (left >= 4) return _mm512_loadu_si512(qs + g * 64);
  return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (4 * left)) - 1), qs + g * 64);
}
template <typename S>
QINFER_VNNI inline __m512 group_scales_vnni(const S* d, int64_t g, int64_t nb) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(scales4(d + g * 4, nb - 4 * g)));
}

template <typename S>
template <int R, int C>
QINFER_VNNI void Int4GroupsF32<S>::tile_vnni(const Int4Packed<S>& w, int64_t n0, const ActF4& a,
                                             int64_t r0, float* out, int64_t ldo) {
  const int64_t nb = w.nb, ng = a.ng, nbs = a.nbs;
  constexpr int64_t ahead = kPrefetchFor<R>;
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const auto [qs, d, m] = Int4Columns<C, S>(w, n0);
  const auto [xp, sx] = F4Rows<R>(a, r0);
  __m512 tot[C][R];
  clear(tot);
  prefetch_scales<C, S>(d, nb);
  if (m[0]) prefetch_scales<C, S>(m, nb);
  for (int64_t g = 0; g < ng; ++g) {
    __m512i v[C];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(qs[c] + g * 64 + ahead), _MM_HINT_T0);
      v[c] = group_vnni(qs[c], g, nb);
    }
    __m512 a0[C][R], a1[C][R];
    #pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      __m512 q[C];
      #pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        q[c] = _mm512_permutexvar_ps(k ? _mm512_srli_epi32(v[c], 4 * k) : v[c], levels);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 xv = _mm512_loadu_ps(xp[i] + g * kGroup + 16 * k);
        #pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          __m512& acc = (k & 1) ? a1[c][i] : a0[c][i];
          acc = k < 2 ? _mm512_mul_ps(q[c], xv) : _mm512_fmadd_ps(q[c], xv, acc);
        }
      }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 dv = group_scales_vnni(d[c], g, nb);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i)
        tot[c][i] = _mm512_fmadd_ps(_mm512_add_ps(a0[c][i], a1[c][i]), dv, tot[c][i]);
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    __m512 mt[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) mt[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbs; b += 16) {
      const __m512 mv = offsets16(m[c], d[c], b, nb - b);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) mt[i] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(sx[i] + b), mt[i]);
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = _mm512_reduce_add_ps(_mm512_add_ps(tot[c][i], mt[i]));
  }
}

// AVX2 masks: the first n of 8 dword lanes (n <= 0: none).
QINFER_AVX2 inline __m256i first_lanes_avx2(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))), lane);
}

template <typename S>
template <int R, int C>
QINFER_AVX2 void Int4GroupsF32<S>::tile_avx2(const Int4Packed<S>& w, int64_t n0, const ActF4& a,
                                             int64_t r0, float* out, int64_t ldo) {
  const int64_t nb = w.nb, ng = a.ng, nbs = a.nbs;
  constexpr int64_t ahead = kPrefetchFor<R>;
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const auto [qs, d, m] = Int4Columns<C, S>(w, n0);
  const auto [xp, sx] = F4Rows<R>(a, r0);
  __m256 tot[C][R];
  clear(tot);
  prefetch_scales<C, S>(d, nb);
  if (m[0]) prefetch_scales<C, S>(m, nb);
  for (int64_t g = 0; g < ng; ++g) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(qs[c] + g * 64 + ahead), _MM_HINT_T0);
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // blocks 4g + 2h and 4g + 2h + 1
        const int64_t left = nb - 4 * g - 2 * h;  // blocks of the column from this half on
        const int* src = reinterpret_cast<const int*>(qs[c] + g * 64 + h * 32);
        const __m256i v = left >= 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                    : _mm256_maskload_epi32(src, first_lanes_avx2(4 * left));
        const __m128 two = scales4(d[c] + 4 * g + 2 * h, std::min<int64_t>(left, 2));
        const __m256 dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), pair);
        __m256 a0[R], a1[R];
        #pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          const __m256i s = k ? _mm256_srli_epi32(v, 4 * k) : v;
          const __m256 q = _mm256_cvtepi32_ps(k == 7 ? s : _mm256_and_si256(s, low4));
          #pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            const __m256 xv = _mm256_loadu_ps(xp[i] + g * kGroup + 16 * k + 8 * h);
            __m256& acc = (k & 1) ? a1[i] : a0[i];
            acc = k < 2 ? _mm256_mul_ps(q, xv) : _mm256_fmadd_ps(q, xv, acc);
          }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < R; ++i)
          tot[c][i] = _mm256_fmadd_ps(_mm256_add_ps(a0[i], a1[i]), dv, tot[c][i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    __m256 mt[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) mt[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbs; b += 8) {
      const __m256 mv = offsets8(m[c], d[c], b, nb - b);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) mt[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx[i] + b), mt[i]);
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = hsum_avx2(_mm256_add_ps(tot[c][i], mt[i]));
  }
}

template <typename S>
void Int4GroupsF32<S>::dot_scalar(const Int4Packed<S>& w, int64_t n, const ActF4& a, int64_t r,
                                  float* out, int64_t ldo) {
  const int64_t nb = w.nb, K = nb * kBlock;
  const uint8_t* qs = w.qs + n * nb * 16;
  const S* d = w.d + n * nb;
  const S* m = w.m_of(n);
  const float* x = a.x + r * K;
  const float* sx = a.row_sx(r);
  float tot = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float t = 0.0f;
    for (int j = 0; j < 32; ++j) {
      const int q = j < 16 ? qs[b * 16 + j] & 15 : qs[b * 16 + j - 16] >> 4;
      t = std::fma(static_cast<float>(q), x[b * kBlock + j], t);
    }
    tot = std::fma(t, widen(d[b]), tot);
  }
  float mt = 0.0f;
  for (int64_t b = 0; b < nb; ++b) mt = std::fma(offset(m, d, b), sx[b], mt);
  out[r * ldo + n] = tot + mt;
}

}  // namespace

at::Tensor int4_groups_mm(const at::Tensor& x_in, const at::Tensor& qs_in,
                          const at::Tensor& d_in, const c10::optional<at::Tensor>& m_in,
                          const std::string& path_name_in) {
  check_x("int4_groups_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = check_int4("int4_groups_mm", x_in, qs_in, d_in, m_in);
  const Isa path = vector_isa(resolve_path("int4_groups_mm", path_name_in, kDotPaths));
  const at::Tensor qs = qs_in.contiguous(), d = d_in.contiguous(),
                   m = m_in ? m_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  at::Tensor x32;
  static thread_local ActF4Storage storage;
  const ActF4 a = storage.make(fp32_activations(x_in, x32).x, M, K, path != Isa::Scalar);
  with_scales(d, [&](auto tag) {
    using S = decltype(tag);
    const Int4Packed<S> w = int4_packed<S>(qs, d, m);
    matmul<Int4GroupsF32<S>>(path, w, N, M, a, out.data_ptr<float>());
  });
  storage.trim();
  return out;
}

}  // namespace qinfer_kernels
