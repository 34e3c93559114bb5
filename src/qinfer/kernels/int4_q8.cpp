// int4 weights (pack_int4's layout) x int8 activations on integer dot products, the way
// llama.cpp multiplies Q4_1 weights by Q8_1 activations: the op int4_mm, and pack_int4.
// docs/KERNELS.md says what they compute.
//
// Layouts (all row-major, contiguous):
//   weights   qs (N, K/2) uint8: per block of 32 input columns, 16 bytes; byte j holds
//             element j in its low nibble and element j + 16 in its high nibble (llama.cpp's
//             Q4 layout), so one 16-byte load unpacks into the block's 32 values in order.
//             d, m (N, K/32) fp16 or fp32 (matmul.h, `Int4Packed`): w = d * q + m; m
//             none where every block's is 0 - 8 d (Q4_0's), computed in the kernels.
//   activations (made per call, never seen by Python): AVX2 and scalar, per row, per pair
//             of blocks p (blocks 2p, 2p + 1), 64 int8 in the order the unpacked weight pair
//             has: [2p: 0..15 | 2p+1: 0..15 | 2p: 16..31 | 2p+1: 16..31]; dx8 (8 fp32 per
//             pair: dx of block 2p four times, then of 2p + 1 four times: the scales of the
//             int32 lanes a dot product of the pair leaves). VNNI (and AMX): the row's own
//             order, regrouped for the VNNI tiles (`Int4Act`). s (per block, padded to a
//             multiple of 16 with zeros): dx * sum(qx), which carries the weights' offset m.
//
// Per output (r, n), in this order (fp32, no contraction: -ffp-contract=off):
//   AVX2 and scalar:
//     acc (lanes) = 0
//     for each block pair p (each block on the scalar path):
//         acc += float(int32 lanes of q . qx) * (d lanes * dx lanes)
//     for each chunk of blocks (8 for AVX2, 1 for scalar): acc += m * s
//   VNNI and AMX (16 lanes, lane l holding blocks l, l + 16, ...):
//     for each block b: acc[b % 16] = fma(float(q . qx of block b, exact), d * dx, acc[b % 16])
//     for each block b: acc[b % 16] = fma(m, s, acc[b % 16])
//   out = horizontal sum of acc (a fixed tree of adds)
// The lanes differ between paths (16 for AVX512-VNNI and AMX, 8 for AVX2, 1 for scalar), so
// those paths round differently (VNNI's and AMX's alike), but each output depends only on its
// own row of x and column of w: not on M, on which rows share a tile, on the thread count or on
// the split of N. That is the batch-invariance qinfer requires (a row's result must not change
// with the batch it is in).

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

#include "int4_amx.h"
#include "matmul.h"
#include "ops.h"
#include "q8.h"

namespace qinfer_kernels {
namespace {

// The activations as the int4 kernels read them: q8 in the pairs' order (AVX2, scalar) or
// the row's own (VNNI, AMX; q8.h); for the VNNI tiles also regrouped (`regroup`): per row,
// per group g of 16 blocks, 512 bytes, dword k (elements 4k..4k+3) of block 16g + l at
// [k * 64 + l * 4] (zeros past nb), and dx per block (M, ng * 16), zeros past nb.
struct Int4Act {
  Act q8;
  int64_t ng = 0;             // groups of 16 blocks per row
  const int8_t* qg = nullptr;  // (M, ng * 512)
  const float* dxn = nullptr;  // (M, ng * 16)
};

// int4 pairs x int8 activations, scales S (`Int4Packed`)
template <typename S>
struct Int4Q8 {
  QINFER_MATMUL_KERNEL(Int4Packed<S>, Int4Act)
};

// A last group of at most kTailBlocks blocks (a K of 576 leaves 2, of 640 4): each block's
// exact dot product on its own, its 16 bytes unpacked into the 32 values in order times the
// row's own 32 int8 (one 256-bit dpbusd and a sum of its 8 lanes), into lane l of dot as the
// transposed group puts it: the same integers, so the same bits, for an eighth of a whole
// group's work where only two of its 16 blocks exist.
constexpr int64_t kTailBlocks = 4;

template <int R, int C>
QINFER_VNNI QINFER_INLINE void tail_dots(const uint8_t* const (&qs)[C], int64_t g, int64_t left,
                                         const int8_t* const (&qx)[R], __m512i (&dot)[C][R]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) dot[c][i] = _mm512_setzero_si512();
  for (int64_t l = 0; l < left; ++l) {
    const int64_t b = 16 * g + l;
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs[c] + b * 16));
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4),
                                         _mm_and_si128(packed, low4));  // values 0..31
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[i] + b * 32));
        const __m256i d8 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
        __m128i d4 = _mm_add_epi32(_mm256_castsi256_si128(d8), _mm256_extracti128_si256(d8, 1));
        d4 = _mm_add_epi32(d4, _mm_shuffle_epi32(d4, 0x4E));
        d4 = _mm_add_epi32(d4, _mm_shuffle_epi32(d4, 0xB1));
        dot[c][i] = _mm512_mask_set1_epi32(dot[c][i], static_cast<__mmask16>(1u << l),
                                           _mm_cvtsi128_si32(d4));
      }
    }
  }
}

// A group's exact dots into the accumulators: acc += float(dot) * (d * dx), lane by lane
// (left: the group's blocks, its d read only for them).
template <int R, int C, typename S>
QINFER_VNNI QINFER_INLINE void scale_group(const __m512i (&dot)[C][R], const float* const (&dxn)[R],
                                           const S* const (&d)[C], int64_t g, int64_t left,
                                           __m512 (&acc)[C][R]) {
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512 dx = _mm512_loadu_ps(dxn[i] + g * 16);
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 d16 = scales16(d[c] + g * 16, left);
      acc[c][i] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c][i]), _mm512_mul_ps(d16, dx), acc[c][i]);
    }
  }
}

// The VNNI tile, per group of 16 blocks: each column's 256 bytes are transposed so that lane
// l of register q holds dword q of block 16g + l (its low nibbles: elements 4q..4q+3, its high
// ones: 16 + 4q..), and 8 dpbusd into one int32 register leave each block's exact dot product
// in its lane; then acc += float(dot) * (d * dx), lane by lane (int4_amx.cpp repeats this).
template <typename S>
template <int R, int C>
QINFER_VNNI void Int4Q8<S>::tile_vnni(const Int4Packed<S>& w, int64_t n0, const Int4Act& act,
                                      int64_t r0, float* out, int64_t ldo) {
  const int64_t nb = w.nb, ng = act.ng;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // the transpose of 4 registers of 4 blocks x 4 dwords (lane 4j + q: block j, dword q) into
  // 4 of 16 blocks (lane l: block l): dwords 0, 1 then 2, 3 of two registers' blocks side by
  // side, then block lanes of four
  const __m512i dwords01 =
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 16, 20, 24, 28, 17, 21, 25, 29);
  const __m512i dwords23 =
      _mm512_setr_epi32(2, 6, 10, 14, 3, 7, 11, 15, 18, 22, 26, 30, 19, 23, 27, 31);
  const __m512i first =
      _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i second =
      _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const auto [qs, d, m] = Int4Columns<C, S>(w, n0);
  const int8_t* qg[R];
  const int8_t* qx[R];  // the row's own order, for the last group's few blocks
  const float* dxn[R];
  const float* s[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    qg[i] = act.qg + (r0 + i) * ng * 512;
    qx[i] = act.q8.row_qx(r0 + i);
    dxn[i] = act.dxn + (r0 + i) * ng * 16;
    s[i] = act.q8.row_s(r0 + i);
  }
  __m512 acc[C][R];
  clear(acc);
  // the groups, each whole or (the last) masked, but a last one of at most kTailBlocks
  // blocks, which tail_dots takes block by block
  const int64_t tail = nb % 16 != 0 && nb % 16 <= kTailBlocks ? nb % 16 : 0;
  const int64_t groups = tail ? ng - 1 : ng;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t left = nb - 16 * g;  // the group's blocks in the weight, 1..16 in the last
    __m512i t[C][4];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m512i p[4];
      #pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const uint8_t* src = qs[c] + g * 256 + 64 * i;
        _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchFor<R>), _MM_HINT_T0);
        if (left >= 16) {
          p[i] = _mm512_loadu_si512(src);
        } else {  // read only the column's own blocks (the next column may not exist)
          const int64_t blocks = std::clamp<int64_t>(left - 4 * i, 0, 4);
          p[i] = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (4 * blocks)) - 1), src);
        }
      }
      const __m512i a0 = _mm512_permutex2var_epi32(p[0], dwords01, p[1]);
      const __m512i a1 = _mm512_permutex2var_epi32(p[0], dwords23, p[1]);
      const __m512i b0 = _mm512_permutex2var_epi32(p[2], dwords01, p[3]);
      const __m512i b1 = _mm512_permutex2var_epi32(p[2], dwords23, p[3]);
      t[c][0] = _mm512_permutex2var_epi32(a0, first, b0);
      t[c][1] = _mm512_permutex2var_epi32(a0, second, b0);
      t[c][2] = _mm512_permutex2var_epi32(a1, first, b1);
      t[c][3] = _mm512_permutex2var_epi32(a1, second, b1);
    }
    __m512i dot[C][R];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) dot[c][i] = _mm512_setzero_si512();
    #pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      __m512i wk[C];
      #pragma GCC unroll 8
      for (int c = 0; c < C; ++c)  // the u8 operand: elements 4k..4k+3 of each block
        wk[c] = _mm512_and_si512(k < 4 ? t[c][k] : _mm512_srli_epi16(t[c][k - 4], 4), low4);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i x = _mm512_loadu_si512(qg[i] + g * 512 + k * 64);
        #pragma GCC unroll 8
        for (int c = 0; c < C; ++c) dot[c][i] = _mm512_dpbusd_epi32(dot[c][i], wk[c], x);
      }
    }
    scale_group<R, C, S>(dot, dxn, d, g, left, acc);
  }
  if (tail) {
    __m512i dot[C][R];
    tail_dots<R, C>(qs, groups, tail, qx, dot);
    scale_group<R, C, S>(dot, dxn, d, groups, tail, acc);
  }
  // the offsets: sum over blocks of m * (dx * sum(qx)), 16 blocks a step
  for (int64_t b = 0; b < nb; b += 16) {
    __m512 sv[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) sv[i] = _mm512_loadu_ps(s[i] + b);
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 m16 = offsets16(m[c], d[c], b, nb - b);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[c][i] = _mm512_fmadd_ps(m16, sv[i], acc[c][i]);
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[(r0 + i) * ldo + n0 + c] = _mm512_reduce_add_ps(acc[c][i]);
}

template <typename S>
template <int R, int C>
QINFER_AVX2 void Int4Q8<S>::tile_avx2(const Int4Packed<S>& w, int64_t n0, const Int4Act& act,
                                      int64_t r0, float* out, int64_t ldo) {
  const Act& a = act.q8;
  const int64_t nb = w.nb, np = a.np, full = nb / 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const auto [qs, d, m] = Int4Columns<C, S>(w, n0);
  const auto [qx, dx8, s] = Q8Rows<R>(a, r0);
  __m256 acc[C][R];
  clear(acc);
  for (int64_t p = 0; p < np; ++p) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m256i packed;
      __m128 d2;
      _mm_prefetch(reinterpret_cast<const char*>(qs[c] + p * 32 + kPrefetchFor<R>), _MM_HINT_T0);
      if (p < full) {
        packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs[c] + p * 32));
        d2 = scales4(d[c] + 2 * p, 2);
      } else {
        packed = _mm256_inserti128_si256(
            _mm256_setzero_si256(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs[c] + p * 32)),
            0);
        d2 = scales4(d[c] + 2 * p, 1);
      }
      const __m256i lo = _mm256_and_si256(packed, low4);                        // [2p lo | 2p+1 lo]
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);  // [2p hi | 2p+1 hi]
      const __m256 d8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2), pair_lanes);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[i] + p * 64));
        const __m256i xhi =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[i] + p * 64 + 32));
        // u8 x s8 pairs into int16 (at most 2 * 15 * 127 each, twice that after the add: no
        // saturation), then pairs of int16 into int32
        const __m256i s16 =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
        const __m256i dot = _mm256_madd_epi16(s16, ones);
        const __m256 scale = _mm256_mul_ps(d8, _mm256_loadu_ps(dx8[i] + p * 8));
        acc[c][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[c][i]);
      }
    }
  }
  for (int64_t b = 0; b < nb; b += 8) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 m8 = offsets8(m[c], d[c], b, nb - b);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        acc[c][i] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(s[i] + b), acc[c][i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[(r0 + i) * ldo + n0 + c] = hsum_avx2(acc[c][i]);
}

// The reference path: one output at a time, block by block.
template <typename S>
void Int4Q8<S>::dot_scalar(const Int4Packed<S>& w, int64_t n, const Int4Act& act, int64_t r,
                           float* out, int64_t ldo) {
  const Act& a = act.q8;
  const int64_t nb = w.nb;
  const uint8_t* qs = w.qs + n * nb * 16;
  const S* d = w.d + n * nb;
  const S* m = w.m_of(n);
  const int8_t* qx = a.row_qx(r);
  const float* dx8 = a.row_dx8(r);
  const float* s = a.row_s(r);
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = qs + b * 16;
    const int8_t* lo = qx + qx_pos(b, 0);
    const int8_t* hi = qx + qx_pos(b, 16);
    int32_t dot = 0;
    for (int j = 0; j < 16; ++j) dot += (wb[j] & 15) * lo[j] + (wb[j] >> 4) * hi[j];
    acc += static_cast<float>(dot) * (widen(d[b]) * dx8[(b >> 1) * 8 + (b & 1) * 4]);
  }
  for (int64_t b = 0; b < nb; ++b) acc += offset(m, d, b) * s[b];
  out[r * ldo + n] = acc;
}

// The VNNI tiles' activations (`Int4Act`) from the row's own order: a transpose of each
// row's groups of 16 blocks x 8 dwords, kept between calls as `ActStorage` is.
struct Regrouped {
  std::vector<int8_t> qg;
  std::vector<float> dxn;
  void make(Int4Act& act, int64_t M) {
    const Act& a = act.q8;
    const int64_t ng = (a.nb + 15) / 16;
    qg.resize(static_cast<size_t>(M * ng * 512));
    dxn.resize(static_cast<size_t>(M * ng * 16));
    int8_t* qgp = qg.data();
    float* dxp = dxn.data();
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / (a.nb * kBlock)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int8_t* qx = a.row_qx(r);
        for (int64_t b = 0; b < ng * 16; ++b) {
          const bool in = b < a.nb;
          dxp[r * ng * 16 + b] = in ? a.row_dx8(r)[(b >> 1) * 8 + (b & 1) * 4] : 0.0f;
          for (int64_t k = 0; k < 8; ++k) {
            int8_t* dst = qgp + r * ng * 512 + (b >> 4) * 512 + k * 64 + (b & 15) * 4;
            if (in) std::memcpy(dst, qx + qx_pos<true>(b, 4 * k), 4);
            else std::memset(dst, 0, 4);
          }
        }
      }
    });
    act.ng = ng;
    act.qg = qgp;
    act.dxn = dxp;
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_int4(const at::Tensor& q_in,
                                                         const at::Tensor& scales_in,
                                                         const at::Tensor& zeros_in) {
  TORCH_CHECK(q_in.dim() == 2, "pack_int4: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0), K = q_in.size(1);
  TORCH_CHECK(K > 0 && K % kBlock == 0, "pack_int4: q's K must be a positive multiple of 32, got shape ",
              shape_str(q_in));
  const int64_t nb = K / kBlock;
  const std::string layout = "(N, K/32) for q's shape " + shape_str(q_in);
  check_tensor("pack_int4", "q", q_in, at::kByte, N, K, "(N, K)");
  check_tensor("pack_int4", "scales", scales_in, at::kFloat, N, nb, layout);
  check_tensor("pack_int4", "zeros", zeros_in, at::kFloat, N, nb, layout);
  const at::Tensor q = q_in.contiguous(), sc = scales_in.contiguous(), z = zeros_in.contiguous();
  at::Tensor qs = at::empty({N, K / 2}, q.options());
  at::Tensor d = at::empty({N, nb}, sc.options());
  at::Tensor m = at::empty({N, nb}, sc.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  uint8_t* qsp = qs.data_ptr<uint8_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  uint8_t seen = 0;
  for (int64_t i = 0; i < N * nb; ++i) {
    const uint8_t* src = qp + i * kBlock;
    for (int j = 0; j < 16; ++j) {
      seen |= src[j] | src[j + 16];
      qsp[i * 16 + j] = static_cast<uint8_t>((src[j] & 15) | (src[j + 16] << 4));
    }
    // (q - 8) * scale + zero = scale * q + (zero - 8 * scale)
    dp[i] = sp[i];
    mp[i] = zp[i] - 8.0f * sp[i];
  }
  TORCH_CHECK(seen < 16, "pack_int4: q must hold values 0..15, it has one above 15");
  return {qs, d, m};
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                   const c10::optional<at::Tensor>& m_in, const std::string& path_name_in) {
  check_x("int4_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = check_int4("int4_mm", x_in, qs_in, d_in, m_in);
  const Isa path = resolve_path("int4_mm", path_name_in, kDotPaths);
  const at::Tensor x = x_in.contiguous(), qs = qs_in.contiguous(), d = d_in.contiguous(),
                   m = m_in ? m_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  // VNNI and AMX read the row's own order (AMX's tiles load it as it is), the others the pairs'
  const Isa vector = vector_isa(path);
  const bool amx = path == Isa::Amx && M >= kAmxRows;
  static thread_local ActStorage storage;
  static thread_local Regrouped regrouped;
  // AMX's tiles load kAmxSpan rows at a time: rows up to the next such exist (outputs unused)
  Int4Act act{storage.make(amx ? (M + kAmxSpan - 1) / kAmxSpan * kAmxSpan : M, K)};
  if (vector == Isa::Vnni) {
    quantize<true>(x, act.q8, vector);
    if (!amx) regrouped.make(act, M);
  } else {
    quantize(x, act.q8, vector);
  }
  with_scales(d, [&](auto tag) {
    using S = decltype(tag);
    const Int4Packed<S> w = int4_packed<S>(qs, d, m);
    if (amx) {
      int4_mm_amx(w, N, M, act.q8, out.data_ptr<float>());
    } else {
      matmul<Int4Q8<S>>(vector, w, N, M, act, out.data_ptr<float>());
    }
  });
  return out;
}

}  // namespace qinfer_kernels
