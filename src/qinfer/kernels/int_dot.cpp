// int4 and int8 weights x int8 activations on integer dot products, the way llama.cpp
// multiplies Q4_1 weights by Q8_1 activations and Q8_0 by Q8_0; and int8 blocks and int4
// groups x fp32 activations in fp32. See qinfer/kernels/__init__.py for what they compute;
// the int8 rows', int8 blocks' and int4 groups' fp32 kernels are described above their tiles
// (Weights8, WeightsF, ActF4).
//
// Layouts (all row-major, contiguous):
//   weights   qs (N, K/2) uint8: per block of 32 input columns, 16 bytes; byte j holds
//             element j in its low nibble and element j + 16 in its high nibble (llama.cpp's
//             Q4 layout), so one 16-byte load unpacks into the block's 32 values in order.
//             d, m (N, K/32) fp32: w = d * q + m.
//   activations (made per call, never seen by Python): per row, per pair of blocks p
//             (blocks 2p, 2p + 1), 64 int8 in the order the unpacked weight pair has:
//             [2p: 0..15 | 2p+1: 0..15 | 2p: 16..31 | 2p+1: 16..31]; dx8 (8 fp32 per pair:
//             dx of block 2p four times, then of 2p + 1 four times: the scales of the int32
//             lanes a dot product of the pair leaves); s (per block, padded to a multiple of
//             16 with zeros): dx * sum(qx), which carries the weights' offset m.
//
// Per output (r, n), on every path, in this order (fp32, no contraction: -ffp-contract=off):
//   acc (lanes) = 0
//   for each block pair p (each block on the scalar path):
//       acc += float(int32 lanes of q . qx) * (d lanes * dx lanes)
//   for each chunk of blocks (16 for VNNI, 8 for AVX2, 1 for scalar): acc += m * s
//   out = horizontal sum of acc (a fixed tree of adds)
// The lanes differ between paths (16 for AVX512-VNNI, 8 for AVX2, 1 for scalar), so the paths
// round differently, but each output depends only on its own row of x and column of w: not
// on M, on which rows share a tile, on the thread count or on the split of N. That is the
// batch-invariance qinfer requires (a row's result must not change with the batch it is in).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using qinfer_kernels::shape_str;
using qinfer_kernels::widen_bf16;

constexpr int64_t kBlock = 32;

// The ISAs of each path, set per function so the file builds without -march flags and the
// baseline (scalar) code stays runnable on any x86-64.
#define QINFER_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define QINFER_AVX2 __attribute__((target("avx2,fma")))

enum class Path { Scalar, Avx2, Vnni };

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

// "auto" is the best path this CPU has; the same for every call, whatever M is, so that the
// rounding (which differs between paths) never depends on the batch.
Path resolve_path(const char* op, const std::string& name) {
  if (name == "auto") {
    return cpu_has_vnni() ? Path::Vnni : cpu_has_avx2() ? Path::Avx2 : Path::Scalar;
  }
  if (name == "scalar") return Path::Scalar;
  if (name == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), op, ": path 'avx2' needs AVX2 and FMA, which this CPU lacks");
    return Path::Avx2;
  }
  if (name == "vnni") {
    TORCH_CHECK(cpu_has_vnni(),
                op, ": path 'vnni' needs AVX512 F/BW/VL/DQ and VNNI, which this CPU lacks");
    return Path::Vnni;
  }
  TORCH_CHECK(false, op, ": path must be auto, scalar, avx2 or vnni, got '", name, "'");
  return Path::Scalar;
}

std::string paths_here() {
  std::string s = "scalar";
  if (cpu_has_avx2()) s += ",avx2";
  if (cpu_has_vnni()) s += ",vnni";
  return s;
}

// ---------------------------------------------------------------------------------------
// Activations: Q8_1-style quantization of each row, per block of 32.
// ---------------------------------------------------------------------------------------

struct Act {
  int64_t nb;   // blocks per row (K / 32)
  int64_t np;   // pairs per row (nb rounded up, halved)
  int64_t nbs;  // s entries per row (nb rounded up to 16)
  int8_t* qx;   // (M, np * 64)
  float* dx8;   // (M, np * 8)
  float* s;     // (M, nbs)
  int8_t* row_qx(int64_t r) const { return qx + r * np * 64; }
  float* row_dx8(int64_t r) const { return dx8 + r * np * 8; }
  float* row_s(int64_t r) const { return s + r * nbs; }
};

// Where element j (0..31) of block b lands in a row's qx: the int4 weight pair's unpacked
// order, or (Natural, for int8 weights, read as they are stored) the row's own order.
template <bool Natural = false>
inline int64_t qx_pos(int64_t b, int64_t j) {
  if constexpr (Natural) return b * kBlock + j;
  return (b >> 1) * 64 + (j >= 16 ? 32 : 0) + (b & 1) * 16 + (j & 15);
}

// The scale of one block: dx = amax / 127 and its reciprocal, computed in scalar code by
// every quantizer so that the paths quantize bit for bit alike. x * (1 / dx) rather than
// x / dx, as llama.cpp's quantize_row_q8_1 does.
inline void block_scale(float amax, float* dx, float* id) {
  *dx = amax / 127.0f;
  *id = *dx != 0.0f ? 1.0f / *dx : 0.0f;
}

// Round to nearest even by the MXCSR rounding (as the vector conversions round), NaN and
// out-of-range values to INT_MIN as they do, so scalar and vector quantizers agree.
inline int32_t round_ss(float v) { return _mm_cvtss_si32(_mm_set_ss(v)); }


// Writes a block's scale into dx8 and s, and the optional natural-order outputs.
inline void store_block(const Act& a, int64_t r, int64_t b, float dx, int32_t sum, float* dx_out,
                        int32_t* sum_out) {
  float* dx8 = a.row_dx8(r) + (b >> 1) * 8 + (b & 1) * 4;
  for (int i = 0; i < 4; ++i) dx8[i] = dx;
  a.row_s(r)[b] = dx * static_cast<float>(sum);
  if (dx_out) dx_out[b] = dx;
  if (sum_out) sum_out[b] = sum;
}

// Zeros what a row holds beyond its nb blocks: the second block of an odd last pair (a
// kernel reads the whole pair) and s up to nbs. The buffers are reused between calls.
template <bool Natural>
inline void pad_row(const Act& a, int64_t r) {
  if (a.nb & 1) {
    int8_t* q = a.row_qx(r) + (a.np - 1) * 64;
    if constexpr (Natural) {
      std::memset(q + 32, 0, 32);
    } else {
      std::memset(q + 16, 0, 16);
      std::memset(q + 48, 0, 16);
    }
    float* dx8 = a.row_dx8(r) + (a.np - 1) * 8 + 4;
    for (int i = 0; i < 4; ++i) dx8[i] = 0.0f;
  }
  for (int64_t b = a.nb; b < a.nbs; ++b) a.row_s(r)[b] = 0.0f;
}

template <typename T>
inline float load_scalar(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return x[i];
  } else {
    return widen_bf16(x[i]);
  }
}

template <bool Natural, typename T>
void quantize_row_scalar(const T* x, const Act& a, int64_t r, float* dx_out, int32_t* sum_out) {
  int8_t* qx = a.row_qx(r);
  for (int64_t b = 0; b < a.nb; ++b) {
    float amax = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) {
      float v = std::fabs(load_scalar(x, b * kBlock + j));
      amax = v > amax ? v : amax;
    }
    float dx, id;
    block_scale(amax, &dx, &id);
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      int32_t q = round_ss(load_scalar(x, b * kBlock + j) * id);
      qx[qx_pos<Natural>(b, j)] = static_cast<int8_t>(q);
      sum += static_cast<int8_t>(q);
    }
    store_block(a, r, b, dx, sum, dx_out, sum_out);
  }
  pad_row<Natural>(a, r);
}

template <typename T>
QINFER_AVX2 inline __m256 load8_avx2(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <bool Natural, typename T>
QINFER_AVX2 void quantize_row_avx2(const T* x, const Act& a, int64_t r, float* dx_out,
                                   int32_t* sum_out) {
  int8_t* qx = a.row_qx(r);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8_avx2(x + b * kBlock + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float dx, id;
    block_scale(_mm_cvtss_f32(m4), &dx, &id);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    // int32 -> int8 in order (|q| <= 127, so the saturating packs are exact), as in
    // llama.cpp's quantize_row_q8_0: the packs interleave 128-bit lanes, the permute undoes it
    __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
    __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos<Natural>(b, 0)),
                     _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos<Natural>(b, 16)),
                     _mm256_extracti128_si256(bytes, 1));
    store_block(a, r, b, dx, _mm_cvtsi128_si32(t), dx_out, sum_out);
  }
  pad_row<Natural>(a, r);
}

template <typename T>
QINFER_VNNI inline __m512 load16_avx512(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <bool Natural, typename T>
QINFER_VNNI void quantize_row_avx512(const T* x, const Act& a, int64_t r, float* dx_out,
                                     int32_t* sum_out) {
  int8_t* qx = a.row_qx(r);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512 lo = load16_avx512(x + b * kBlock);
    __m512 hi = load16_avx512(x + b * kBlock + 16);
    float dx, id;
    block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))), &dx,
                &id);
    const __m512 vid = _mm512_set1_ps(id);
    __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid));
    __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos<Natural>(b, 0)),
                     _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + qx_pos<Natural>(b, 16)),
                     _mm512_cvtepi32_epi8(qhi));
    int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    store_block(a, r, b, dx, sum, dx_out, sum_out);
  }
  pad_row<Natural>(a, r);
}

// Quantizes rows of x (M, K) into `a` with the path's own ISA, in parallel over rows, qx in
// the int4 pair order or (Natural) the row's. dx_out / sum_out (M, nb), natural order, are
// optional (the test's reference reads them).
template <bool Natural, typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, const Act& a, Path path, float* dx_out,
                   int32_t* sum_out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / K);
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      float* dxr = dx_out ? dx_out + r * a.nb : nullptr;
      int32_t* sr = sum_out ? sum_out + r * a.nb : nullptr;
      if (path == Path::Vnni) {
        quantize_row_avx512<Natural>(xr, a, r, dxr, sr);
      } else if (path == Path::Avx2) {
        quantize_row_avx2<Natural>(xr, a, r, dxr, sr);
      } else {
        quantize_row_scalar<Natural>(xr, a, r, dxr, sr);
      }
    }
  });
}

// The activation buffers of this calling thread, grown as needed and kept between calls (a
// decode step makes hundreds of calls; an allocation each costs more than a small one's work).
struct ActStorage {
  std::vector<int8_t> qx;
  std::vector<float> dx8, s;
  Act make(int64_t M, int64_t K) {
    Act a;
    a.nb = K / kBlock;
    a.np = (a.nb + 1) / 2;
    a.nbs = (a.nb + 15) / 16 * 16;
    qx.resize(static_cast<size_t>(M * a.np * 64));
    dx8.resize(static_cast<size_t>(M * a.np * 8));
    s.resize(static_cast<size_t>(M * a.nbs));
    a.qx = qx.data();
    a.dx8 = dx8.data();
    a.s = s.data();
    return a;
  }
};

// ---------------------------------------------------------------------------------------
// Dot products. A tile computes R rows x C columns of the output: each weight pair is
// loaded and unpacked once for R activation rows, each activation pair once for C columns,
// and the R * C accumulators are independent chains that hide each other's fused
// multiply-add latency. Each output has its own accumulator and the same instructions in
// the same order whatever R and C are (row invariance).
// ---------------------------------------------------------------------------------------

struct Weights {
  const uint8_t* qs;  // (N, K/2)
  const float* d;     // (N, nb)
  const float* m;     // (N, nb)
  int64_t nb;
};

// How far ahead of its loads a tile prefetches a weight row, in bytes (into the next rows at
// a row's end: they are the next columns). A prefetch never faults, so past the end is
// harmless. One row, one thread, weights from memory: 9.4-10.4 GB/s with it, 7-9.5 without
// (SmolLM2 and Qwen3-0.6B shapes, on a shared 2-core AVX512 EPYC).
constexpr int64_t kPrefetch = 512;

// A column's scales (d, and the int4 groups' m) are a short row of their own, read at the
// column's blocks or after them: the hardware's prefetcher missed them often enough that
// the AVX2 int4 tile ran 20% slower from memory than from cache. So each tile fetches the
// scales of the column at least 256 bytes (and two columns) past its last one, `count`
// floats a column: the tiles of a task step go through consecutive columns, so each
// column's scales are fetched a few tiles ahead of it (every other column's, where a tile
// holds two columns: those tiles are the prefill's, which reuse the columns anyway).
// Qwen3-0.6B's int4 shapes at one row, one thread, weights from memory: AVX2 41-48 -> 27
// ms, VNNI 30-33 -> 28-31 (2 threads 19-23 -> 17-20).
template <int C>
inline void prefetch_scales(const float* const* scales, int64_t count) {
  const int64_t ahead = std::max<int64_t>(2, (64 + count - 1) / count);  // columns
  // addresses as integers: the column may lie past the weight's end (a prefetch of it
  // never faults, but a pointer there would be undefined)
  const uintptr_t start = reinterpret_cast<uintptr_t>(scales[C - 1]) +
                          static_cast<uintptr_t>(ahead * count) * sizeof(float);
  const uintptr_t end = start + static_cast<uintptr_t>(count) * sizeof(float);
  for (uintptr_t line = start & ~uintptr_t{63}; line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}

// The tiles copy every pointer and count they loop over into locals first: the intrinsics'
// vector types may alias anything, so a field read through a reference inside the loop
// would be reloaded after every vector store. The loops over rows and columns are unrolled
// by pragma: gcc then keeps the accumulator arrays in registers (otherwise it stores every
// accumulator to the stack each step).

template <int R, int C>
QINFER_VNNI void tile_vnni(const Weights& w, int64_t n0, const Act& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t nb = w.nb, np = a.np, full = nb / 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // lanes 0-3 and 8-11 hold block 2p (low and high halves), 4-7 and 12-15 block 2p + 1
  const __m512i pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const uint8_t* qs[C];
  const float* d[C];
  const float* m[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    qs[c] = w.qs + (n0 + c) * nb * 16;
    d[c] = w.d + (n0 + c) * nb;
    m[c] = w.m + (n0 + c) * nb;
  }
  const int8_t* qx[R];
  const float* dx8[R];
  const float* s[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    qx[i] = a.row_qx(r0 + i);
    dx8[i] = a.row_dx8(r0 + i);
    s[i] = a.row_s(r0 + i);
  }
  __m512 acc[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512i x[R];
    __m512 dx[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      x[i] = _mm512_loadu_si512(qx[i] + p * 64);
      dx[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(dx8[i] + p * 8));
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m256i packed;
      __m128 d2;
      _mm_prefetch(reinterpret_cast<const char*>(qs[c] + p * 32 + kPrefetch), _MM_HINT_T0);
      if (p < full) {
        packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs[c] + p * 32));
        d2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d[c] + 2 * p)));
      } else {  // an odd last block: read only its own bytes (the next row may not exist)
        packed = _mm256_maskz_loadu_epi8(0xFFFF, qs[c] + p * 32);
        d2 = _mm_load_ss(d[c] + 2 * p);
      }
      // [2p lo | 2p+1 lo | 2p hi | 2p+1 hi] nibbles, 0..15 each: the u8 operand of dpbusd
      const __m512i wq = _mm512_and_si512(
          _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1),
          low4);
      const __m512 d16 = _mm512_permutexvar_ps(pair_lanes, _mm512_castps128_ps512(d2));
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, x[i]);
        acc[c][i] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d16, dx[i]), acc[c][i]);
      }
    }
  }
  // the offsets: sum over blocks of m * (dx * sum(qx)), 16 blocks a step
  for (int64_t b = 0; b < nb; b += 16) {
    const __mmask16 k = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
    __m512 sv[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) sv[i] = _mm512_loadu_ps(s[i] + b);
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 m16 = _mm512_maskz_loadu_ps(k, m[c] + b);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[c][i] = _mm512_fmadd_ps(m16, sv[i], acc[c][i]);
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[(r0 + i) * ldo + n0 + c] = _mm512_reduce_add_ps(acc[c][i]);
}

QINFER_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int R, int C>
QINFER_AVX2 void tile_avx2(const Weights& w, int64_t n0, const Act& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t nb = w.nb, np = a.np, full = nb / 2;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pair_lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const uint8_t* qs[C];
  const float* d[C];
  const float* m[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    qs[c] = w.qs + (n0 + c) * nb * 16;
    d[c] = w.d + (n0 + c) * nb;
    m[c] = w.m + (n0 + c) * nb;
  }
  const int8_t* qx[R];
  const float* dx8[R];
  const float* s[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    qx[i] = a.row_qx(r0 + i);
    dx8[i] = a.row_dx8(r0 + i);
    s[i] = a.row_s(r0 + i);
  }
  __m256 acc[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      __m256i packed;
      __m128 d2;
      _mm_prefetch(reinterpret_cast<const char*>(qs[c] + p * 32 + kPrefetch), _MM_HINT_T0);
      if (p < full) {
        packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs[c] + p * 32));
        d2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(d[c] + 2 * p)));
      } else {
        packed = _mm256_inserti128_si256(
            _mm256_setzero_si256(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs[c] + p * 32)),
            0);
        d2 = _mm_load_ss(d[c] + 2 * p);
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
    const int64_t left = std::min<int64_t>(8, nb - b);
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 m8 = _mm256_maskload_ps(m[c] + b, k);
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
void dot_scalar(const Weights& w, int64_t n, const Act& a, int64_t r, float* out, int64_t ldo) {
  const int64_t nb = w.nb;
  const uint8_t* qs = w.qs + n * nb * 16;
  const float* d = w.d + n * nb;
  const float* m = w.m + n * nb;
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
    acc += static_cast<float>(dot) * (d[b] * dx8[(b >> 1) * 8 + (b & 1) * 4]);
  }
  for (int64_t b = 0; b < nb; ++b) acc += m[b] * s[b];
  out[r * ldo + n] = acc;
}

// ---------------------------------------------------------------------------------------
// int8 weights (N, K) as stored, one scale per output row: y[r, n] = scale[n] * sum_b dx[r, b]
// * (q[n, b, :] . qx[r, b, :]), the activations in the row's own order (`qx_pos<true>`).
// The signed x signed products take llama.cpp's q8_0 trick: |w| (unsigned) times x with w's
// sign, so that VNNI's u8 x s8 dpbusd and AVX2's maddubs (127 * 128 * 2 < 2^15: no
// saturation) serve. Per output: acc (lanes) += float(dot lanes) * dx lanes, pair by pair;
// out = horizontal sum of acc (a fixed tree) times the row's scale.
// ---------------------------------------------------------------------------------------

struct Weights8 {
  const int8_t* q;     // (N, K)
  const float* scale;  // (N,)
  int64_t nb;
};

template <int R, int C>
QINFER_VNNI void tile_vnni(const Weights8& w, int64_t n0, const Act& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t K = w.nb * kBlock, np = a.np, full = w.nb / 2;
  // a pair's 64 bytes are block 2p (lanes 0-7) then 2p + 1 (lanes 8-15); dx8 holds their
  // scales four times each
  const __m512i pair_lanes = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i zero = _mm512_setzero_si512();
  const int8_t* q[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) q[c] = w.q + (n0 + c) * K;
  const int8_t* qx[R];
  const float* dx8[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    qx[i] = a.row_qx(r0 + i);
    dx8[i] = a.row_dx8(r0 + i);
  }
  __m512 acc[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512i x[R];
    __m512 dx[R];
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      x[i] = _mm512_loadu_si512(qx[i] + p * 64);
      dx[i] = _mm512_permutexvar_ps(pair_lanes,
                                    _mm512_castps256_ps512(_mm256_loadu_ps(dx8[i] + p * 8)));
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(q[c] + p * 64 + kPrefetch), _MM_HINT_T0);
      // an odd last block: read only its own 32 bytes (the next row may not exist)
      const __m512i wq = p < full ? _mm512_loadu_si512(q[c] + p * 64)
                                  : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, q[c] + p * 64);
      const __m512i magnitude = _mm512_abs_epi8(wq);
      const __mmask64 negative = _mm512_movepi8_mask(wq);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512i signed_x = _mm512_mask_sub_epi8(x[i], negative, zero, x[i]);
        const __m512i dot = _mm512_dpbusd_epi32(zero, magnitude, signed_x);
        acc[c][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx[i], acc[c][i]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = _mm512_reduce_add_ps(acc[c][i]) * w.scale[n0 + c];
}

template <int R, int C>
QINFER_AVX2 void tile_avx2(const Weights8& w, int64_t n0, const Act& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t K = w.nb * kBlock, np = a.np, full = w.nb / 2;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* q[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) q[c] = w.q + (n0 + c) * K;
  const int8_t* qx[R];
  const float* dx8[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    qx[i] = a.row_qx(r0 + i);
    dx8[i] = a.row_dx8(r0 + i);
  }
  __m256 acc[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(q[c] + p * 64 + kPrefetch), _MM_HINT_T0);
      __m256i wq[2];  // blocks 2p and 2p + 1 (zero past an odd last block)
      wq[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[c] + p * 64));
      wq[1] = p < full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[c] + p * 64 + 32))
                       : _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i x =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx[i] + p * 64 + 32 * h));
          const __m256i s16 =
              _mm256_maddubs_epi16(_mm256_abs_epi8(wq[h]), _mm256_sign_epi8(x, wq[h]));
          const __m256i dot = _mm256_madd_epi16(s16, ones);
          acc[c][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                      _mm256_broadcast_ss(dx8[i] + p * 8 + 4 * h), acc[c][i]);
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = hsum_avx2(acc[c][i]) * w.scale[n0 + c];
}

void dot_scalar(const Weights8& w, int64_t n, const Act& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = w.nb * kBlock;
  const int8_t* q = w.q + n * K;
  const int8_t* qx = a.row_qx(r);
  const float* dx8 = a.row_dx8(r);
  float acc = 0.0f;
  for (int64_t b = 0; b < w.nb; ++b) {
    int32_t dot = 0;
    for (int64_t j = 0; j < kBlock; ++j) dot += q[b * kBlock + j] * qx[qx_pos<true>(b, j)];
    acc += static_cast<float>(dot) * dx8[(b >> 1) * 8 + (b & 1) * 4];
  }
  out[r * ldo + n] = acc * w.scale[n];
}

// ---------------------------------------------------------------------------------------
// int8 weights with one fp32 scale per block of B = 16 or 32 elements (GGUF's Q8_0, Q5_0 and
// Q6_K values, kept exactly) times fp32 activations (bf16 ones widened exactly): neither
// operand is rounded, so the result is x @ W.T up to fp32 summation. Per output (r, n), on
// every path (lanes L: 16 AVX512, 8 AVX2, 1 scalar):
//   acc (lanes) = 0
//   for each block b:  t (lanes) = 0; t = fma(float(q chunk), x chunk, t) for its B / L chunks
//                      acc = fma(t, d[n, b], acc)
//   out = horizontal sum of acc (a fixed tree of adds)
// ---------------------------------------------------------------------------------------

struct WeightsF {
  const int8_t* q;  // (N, K)
  const float* d;   // (N, K/B)
  int64_t nb;       // K / 32 (the grain's measure of K, as the other kinds')
  int64_t B;        // 16 or 32
};

struct ActF {
  const float* x;  // (M, K), contiguous
};

// A tile's row pointers into the weight (its C columns' q and d) and the activations (its R
// rows), copied into locals once (see the note above the int4 tiles).
template <int R, int C>
struct TileRows {
  int64_t blocks;
  const int8_t* q[C];
  const float* d[C];
  const float* x[R];
  TileRows(const WeightsF& w, int64_t n0, const ActF& a, int64_t r0) {
    const int64_t K = w.nb * kBlock;
    blocks = K / w.B;
    for (int c = 0; c < C; ++c) {
      q[c] = w.q + (n0 + c) * K;
      d[c] = w.d + (n0 + c) * blocks;
    }
    for (int i = 0; i < R; ++i) x[i] = a.x + (r0 + i) * K;
  }
};

template <int R, int C>
QINFER_VNNI void tile_vnni(const WeightsF& w, int64_t n0, const ActF& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t B = w.B;
  TileRows<R, C> p(w, n0, a, r0);
  prefetch_scales<C>(p.d, p.blocks);
  __m512 acc[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m512 t[C][R];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) t[c][i] = _mm512_setzero_ps();
    for (int64_t k = b * B; k < (b + 1) * B; k += 16) {
      __m512 xv[R];
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) xv[i] = _mm512_loadu_ps(p.x[i] + k);
      #pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + k + kPrefetch), _MM_HINT_T0);
        const __m512 wv = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q[c] + k))));
        #pragma GCC unroll 8
        for (int i = 0; i < R; ++i) t[c][i] = _mm512_fmadd_ps(wv, xv[i], t[c][i]);
      }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 dv = _mm512_set1_ps(p.d[c][b]);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[c][i] = _mm512_fmadd_ps(t[c][i], dv, acc[c][i]);
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[(r0 + i) * ldo + n0 + c] = _mm512_reduce_add_ps(acc[c][i]);
}

template <int R, int C>
QINFER_AVX2 void tile_avx2(const WeightsF& w, int64_t n0, const ActF& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t B = w.B;
  TileRows<R, C> p(w, n0, a, r0);
  prefetch_scales<C>(p.d, p.blocks);
  __m256 acc[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[c][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.blocks; ++b) {
    __m256 t[C][R];
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) t[c][i] = _mm256_setzero_ps();
    for (int64_t k = b * B; k < (b + 1) * B; k += 8) {
      #pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(p.q[c] + k + kPrefetch), _MM_HINT_T0);
        const __m256 wv = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q[c] + k))));
        #pragma GCC unroll 8
        for (int i = 0; i < R; ++i)
          t[c][i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p.x[i] + k), t[c][i]);
      }
    }
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 dv = _mm256_set1_ps(p.d[c][b]);
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[c][i] = _mm256_fmadd_ps(t[c][i], dv, acc[c][i]);
    }
  }
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) out[(r0 + i) * ldo + n0 + c] = hsum_avx2(acc[c][i]);
}

void dot_scalar(const WeightsF& w, int64_t n, const ActF& a, int64_t r, float* out, int64_t ldo) {
  const int64_t K = w.nb * kBlock, B = w.B, blocks = K / B;
  const int8_t* q = w.q + n * K;
  const float* d = w.d + n * blocks;
  const float* x = a.x + r * K;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    float t = 0.0f;
    for (int64_t k = b * B; k < (b + 1) * B; ++k) t += static_cast<float>(q[k]) * x[k];
    acc += t * d[b];
  }
  out[r * ldo + n] = acc;
}

// ---------------------------------------------------------------------------------------
// int4 groups of 32 (`Weights`' layout: GGUF's Q4_0, Q4_1 and Q4_K values, kept exactly)
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
// The int4 groups' one-row tiles prefetch their nibbles further ahead than kPrefetch: at 512
// bytes a decode row's arithmetic and its reads barely overlapped. Qwen3-0.6B's shapes, one
// row, weights from memory, alternated runs: one thread 27-30 -> 22-24 ms, two 18-21 -> 15-19
// at 2,048 bytes (4,096 no better). Tiles of several rows spend that much longer on each
// byte and keep kPrefetch, as do the int8 blocks' tiles (bound by their reads, and not
// faster at 2,048).
template <int R>
constexpr int64_t kGroupsAhead = R == 1 ? 2048 : kPrefetch;

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

// The dwords and block scales of group g of a column, zeros past its nb blocks.
QINFER_VNNI inline __m512i group_vnni(const uint8_t* qs, int64_t g, int64_t nb) {
  const int64_t left = nb - 4 * g;
  if (left >= 4) return _mm512_loadu_si512(qs + g * 64);
  return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << (4 * left)) - 1), qs + g * 64);
}
QINFER_VNNI inline __m512 group_scales_vnni(const float* d, int64_t g, int64_t nb) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t left = std::min<int64_t>(4, nb - 4 * g);
  const __m128 four = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << left) - 1), d + g * 4);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(four));
}

template <int R, int C>
QINFER_VNNI void tile_vnni(const Weights& w, int64_t n0, const ActF4& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t nb = w.nb, ng = a.ng, nbs = a.nbs;
  constexpr int64_t ahead = kGroupsAhead<R>;
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* qs[C];
  const float* d[C];
  const float* m[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    qs[c] = w.qs + (n0 + c) * nb * 16;
    d[c] = w.d + (n0 + c) * nb;
    m[c] = w.m + (n0 + c) * nb;
  }
  const float* xp[R];
  const float* sx[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    xp[i] = a.row_xp(r0 + i);
    sx[i] = a.row_sx(r0 + i);
  }
  __m512 tot[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) tot[c][i] = _mm512_setzero_ps();
  prefetch_scales<C>(d, nb);
  prefetch_scales<C>(m, nb);
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
      const __m512 mv = _mm512_maskz_loadu_ps(
          static_cast<__mmask16>(nb - b >= 16 ? 0xFFFF : (1u << (nb - b)) - 1), m[c] + b);
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

template <int R, int C>
QINFER_AVX2 void tile_avx2(const Weights& w, int64_t n0, const ActF4& a, int64_t r0, float* out,
                           int64_t ldo) {
  const int64_t nb = w.nb, ng = a.ng, nbs = a.nbs;
  constexpr int64_t ahead = kGroupsAhead<R>;
  const __m256i low4 = _mm256_set1_epi32(15);
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const uint8_t* qs[C];
  const float* d[C];
  const float* m[C];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    qs[c] = w.qs + (n0 + c) * nb * 16;
    d[c] = w.d + (n0 + c) * nb;
    m[c] = w.m + (n0 + c) * nb;
  }
  const float* xp[R];
  const float* sx[R];
  #pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    xp[i] = a.row_xp(r0 + i);
    sx[i] = a.row_sx(r0 + i);
  }
  __m256 tot[C][R];
  #pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i) tot[c][i] = _mm256_setzero_ps();
  prefetch_scales<C>(d, nb);
  prefetch_scales<C>(m, nb);
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
        const __m128 two = _mm_maskload_ps(
            d[c] + 4 * g + 2 * h, _mm256_castsi256_si128(first_lanes_avx2(std::min<int64_t>(left, 2))));
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
      const __m256 mv = _mm256_maskload_ps(m[c] + b, first_lanes_avx2(nb - b));
      #pragma GCC unroll 8
      for (int i = 0; i < R; ++i) mt[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx[i] + b), mt[i]);
    }
    #pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      out[(r0 + i) * ldo + n0 + c] = hsum_avx2(_mm256_add_ps(tot[c][i], mt[i]));
  }
}

void dot_scalar(const Weights& w, int64_t n, const ActF4& a, int64_t r, float* out, int64_t ldo) {
  const int64_t nb = w.nb, K = nb * kBlock;
  const uint8_t* qs = w.qs + n * nb * 16;
  const float* d = w.d + n * nb;
  const float* m = w.m + n * nb;
  const float* x = a.x + r * K;
  const float* sx = a.row_sx(r);
  float tot = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    float t = 0.0f;
    for (int j = 0; j < 32; ++j) {
      const int q = j < 16 ? qs[b * 16 + j] & 15 : qs[b * 16 + j - 16] >> 4;
      t = std::fma(static_cast<float>(q), x[b * kBlock + j], t);
    }
    tot = std::fma(t, d[b], tot);
  }
  float mt = 0.0f;
  for (int64_t b = 0; b < nb; ++b) mt = std::fma(m[b], sx[b], mt);
  out[r * ldo + n] = tot + mt;
}

// Rows per tile: one unpacked weight pair serves up to this many rows.
constexpr int kRows = 4;
// Columns per task step: their weights (cols * K/2 bytes + scales) stay in L1/L2 while
// every row tile of the call passes over them.
constexpr int64_t kCols = 16;

// Columns per tile by rows. One row (decode): one column, the weight rows read one after
// the other; 4 interleaved columns ran twice as fast with the weights in cache but half as
// fast from memory (4 rows read K/2 bytes apart), and a decode step's weights come from
// memory. More rows: 2 columns (R * C accumulators and R activation pairs fit in VNNI's 32
// registers); AVX2's 16 registers take one column.
template <int R, typename W, typename A>
QINFER_VNNI void columns_vnni(const W& w, int64_t n0, int64_t n1, const A& a, int64_t r0,
                              float* out, int64_t ldo) {
  constexpr int C = R == 1 ? 1 : 2;
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile_vnni<R, C>(w, n, a, r0, out, ldo);
  if constexpr (C > 1) {
    for (; n < n1; ++n) tile_vnni<R, 1>(w, n, a, r0, out, ldo);
  }
}

template <int R, typename W, typename A>
QINFER_AVX2 void columns_avx2(const W& w, int64_t n0, int64_t n1, const A& a, int64_t r0,
                              float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) tile_avx2<R, 1>(w, n, a, r0, out, ldo);
}

template <int R, typename W, typename A>
void columns(Path path, const W& w, int64_t n0, int64_t n1, const A& a, int64_t r0,
             float* out, int64_t ldo) {
  if (path == Path::Vnni) {
    columns_vnni<R>(w, n0, n1, a, r0, out, ldo);
  } else {
    columns_avx2<R>(w, n0, n1, a, r0, out, ldo);
  }
}

// W: `Weights` (int4 pairs) or `Weights8` (int8 rows) with A = `Act` (int8 activations), or
// `WeightsF` (int8 blocks) with A = `ActF` (fp32 ones), or `Weights` (int4 groups) with
// A = `ActF4` (fp32 ones, reordered); their tiles and dot_scalar overloads.
template <typename W, typename A>
void matmul(Path path, const W& w, int64_t N, int64_t M, const A& a, float* out) {
  const int64_t K = w.nb * kBlock;
  // enough columns per task that the pool's wake-up is paid for (it changes which thread
  // computes a column, never how)
  const int64_t grain = std::max<int64_t>(kCols, (int64_t{1} << 17) / std::max<int64_t>(1, M * K));
  at::parallel_for(0, N, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0; n0 < c1; n0 += kCols) {
      const int64_t n1 = std::min(c1, n0 + kCols);
      if (path == Path::Scalar) {
        for (int64_t r = 0; r < M; ++r)
          for (int64_t n = n0; n < n1; ++n) dot_scalar(w, n, a, r, out, N);
        continue;
      }
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        switch (std::min<int64_t>(kRows, M - r0)) {
          case 4: columns<4>(path, w, n0, n1, a, r0, out, N); break;
          case 3: columns<3>(path, w, n0, n1, a, r0, out, N); break;
          case 2: columns<2>(path, w, n0, n1, a, r0, out, N); break;
          default: columns<1>(path, w, n0, n1, a, r0, out, N); break;
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------
// Ops
// ---------------------------------------------------------------------------------------

// torch's Python names, which the error messages speak in
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    default: return c10::toString(t);
  }
}

// `layout` says what the expected shape is made of, e.g. "(N, K/2) for x's K = 576".
void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                  int64_t rows, int64_t cols, const std::string& layout) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device().str());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
              " must have shape (", rows, ", ", cols, "), ", layout, ", got ", shape_str(t));
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device().str());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be torch.float32 or torch.bfloat16, got ", dtype_name(x.scalar_type()));
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (M, K), got shape ", shape_str(x));
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % kBlock == 0, op,
              ": x's K must be a positive multiple of 32, got shape ", shape_str(x));
}

// x (M, K) contiguous fp32 or bf16 into `a` (qx in int4 pair order, or Natural's).
template <bool Natural = false>
void quantize(const at::Tensor& x, const Act& a, Path path, float* dx_out = nullptr,
              int32_t* sum_out = nullptr) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    quantize_rows<Natural>(x.data_ptr<float>(), M, K, a, path, dx_out, sum_out);
  } else {
    quantize_rows<Natural>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, a,
                           path, dx_out, sum_out);
  }
}

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8_1(const at::Tensor& x_in,
                                                             const std::string& path_name_in) {
  check_x("quantize_q8_1", x_in);
  const Path path = resolve_path("quantize_q8_1", path_name_in);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  ActStorage storage;
  Act a = storage.make(M, K);
  at::Tensor dx = at::empty({M, nb}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({M, nb}, x.options().dtype(at::kInt));
  quantize(x, a, path, dx.data_ptr<float>(), sums.data_ptr<int32_t>());
  at::Tensor qx = at::empty({M, K}, x.options().dtype(at::kChar));
  int8_t* qp = qx.data_ptr<int8_t>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t j = 0; j < kBlock; ++j) qp[r * K + b * kBlock + j] = a.row_qx(r)[qx_pos(b, j)];
  return {qx, dx, sums};
}

// qs, d and m of an int4 weight in `Weights`' layout, checked against x (M, K) for `op`;
// returns the weight's N.
int64_t check_int4(const char* op, const at::Tensor& x, const at::Tensor& qs,
                   const at::Tensor& d, const at::Tensor& m) {
  const int64_t K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(qs.dim() == 2, op, ": qs must be 2-D (N, K/2), got shape ", shape_str(qs));
  const int64_t N = qs.size(0);
  const std::string k = "x's K = " + std::to_string(K);
  check_tensor(op, "qs", qs, at::kByte, N, K / 2, "(N, K/2) for " + k);
  check_tensor(op, "d", d, at::kFloat, N, nb, "(N, K/32) for " + k + " and qs's N");
  check_tensor(op, "m", m, at::kFloat, N, nb, "(N, K/32) for " + k + " and qs's N");
  return N;
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& qs_in, const at::Tensor& d_in,
                   const at::Tensor& m_in, const std::string& path_name_in) {
  check_x("int4_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1), nb = K / kBlock;
  const int64_t N = check_int4("int4_mm", x_in, qs_in, d_in, m_in);
  const Path path = resolve_path("int4_mm", path_name_in);
  const at::Tensor x = x_in.contiguous(), qs = qs_in.contiguous(), d = d_in.contiguous(),
                   m = m_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  static thread_local ActStorage storage;
  Act a = storage.make(M, K);
  quantize(x, a, path);
  const Weights w{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), nb};
  matmul(path, w, N, M, a, out.data_ptr<float>());
  return out;
}

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scales_in,
                   const std::string& path_name_in) {
  check_x("int8_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(q_in.dim() == 2, "int8_mm: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0);
  check_tensor("int8_mm", "q", q_in, at::kChar, N, K, "(N, K) for x's K = " + std::to_string(K));
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat, "int8_mm: scales must be torch.float32, got ",
              dtype_name(scales_in.scalar_type()));
  TORCH_CHECK(scales_in.dim() == 1 && scales_in.size(0) == N, "int8_mm: scales must have shape (",
              N, ",) for q's N, got ", shape_str(scales_in));
  const Path path = resolve_path("int8_mm", path_name_in);
  const at::Tensor x = x_in.contiguous(), q = q_in.contiguous(), sc = scales_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  static thread_local ActStorage storage;
  Act a = storage.make(M, K);
  quantize<true>(x, a, path);
  const Weights8 w{q.data_ptr<int8_t>(), sc.data_ptr<float>(), K / kBlock};
  matmul(path, w, N, M, a, out.data_ptr<float>());
  return out;
}

// x (M, K) as the fp32 kernels read it, held in `holder`: fp32 as it is (contiguous), bf16
// widened (exactly) by torch into a tensor of its own (64-byte aligned, as the kernels'
// 64-byte loads want, and freed with the call).
ActF fp32_activations(const at::Tensor& x, at::Tensor& holder) {
  holder = x.to(at::kFloat).contiguous();
  return ActF{holder.data_ptr<float>()};
}

at::Tensor int8_blocks_mm(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& d_in,
                          const std::string& path_name_in) {
  check_x("int8_blocks_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(q_in.dim() == 2, "int8_blocks_mm: q must be 2-D (N, K), got shape ", shape_str(q_in));
  const int64_t N = q_in.size(0);
  const std::string k = "x's K = " + std::to_string(K);
  check_tensor("int8_blocks_mm", "q", q_in, at::kChar, N, K, "(N, K) for " + k);
  TORCH_CHECK(d_in.dim() == 2 && (d_in.size(1) == K / 32 || d_in.size(1) == K / 16),
              "int8_blocks_mm: d must have shape (N, K/32) or (N, K/16) for ", k, ", got ",
              shape_str(d_in));
  const int64_t B = K / d_in.size(1);
  check_tensor("int8_blocks_mm", "d", d_in, at::kFloat, N, K / B,
               "(N, K/" + std::to_string(B) + ") for " + k + " and q's N");
  const Path path = resolve_path("int8_blocks_mm", path_name_in);
  const at::Tensor q = q_in.contiguous(), d = d_in.contiguous();
  at::Tensor out = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  at::Tensor x32;
  const WeightsF w{q.data_ptr<int8_t>(), d.data_ptr<float>(), K / kBlock, B};
  matmul(path, w, N, M, fp32_activations(x_in, x32), out.data_ptr<float>());
  return out;
}

at::Tensor int4_groups_mm(const at::Tensor& x_in, const at::Tensor& qs_in,
                          const at::Tensor& d_in, const at::Tensor& m_in,
                          const std::string& path_name_in) {
  check_x("int4_groups_mm", x_in);
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = check_int4("int4_groups_mm", x_in, qs_in, d_in, m_in);
  const Path path = resolve_path("int4_groups_mm", path_name_in);
  const at::Tensor qs = qs_in.contiguous(), d = d_in.contiguous(), m = m_in.contiguous();
  at::Tensor out = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  at::Tensor x32;
  static thread_local ActF4Storage storage;
  const ActF4 a = storage.make(fp32_activations(x_in, x32).x, M, K, path != Path::Scalar);
  const Weights w{qs.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), K / kBlock};
  matmul(path, w, N, M, a, out.data_ptr<float>());
  storage.trim();
  return out;
}

}  // namespace

TORCH_LIBRARY(qinfer, lib) {
  lib.def("pack_int4(Tensor q, Tensor scales, Tensor zeros) -> (Tensor, Tensor, Tensor)",
          &pack_int4);
  lib.def("quantize_q8_1(Tensor x, str path='auto') -> (Tensor, Tensor, Tensor)");
  lib.def("int4_mm(Tensor x, Tensor qs, Tensor d, Tensor m, str path='auto') -> Tensor");
  lib.def("int8_mm(Tensor x, Tensor q, Tensor scales, str path='auto') -> Tensor");
  lib.def("int8_blocks_mm(Tensor x, Tensor q, Tensor d, str path='auto') -> Tensor");
  lib.def("int4_groups_mm(Tensor x, Tensor qs, Tensor d, Tensor m, str path='auto') -> Tensor");
  lib.def("int4_paths() -> str", &paths_here);
}

// The ops that take tensors run under the CPU dispatch key, not as composite functions of
// every key: torch.compile and torch.export then trace them through the fake kernels that
// qinfer/kernels/__init__.py registers beside one-line refusals of other devices' tensors
// (`_register_python_kernels`).
TORCH_LIBRARY_IMPL(qinfer, CPU, lib) {
  lib.impl("quantize_q8_1", &quantize_q8_1);
  lib.impl("int4_mm", &int4_mm);
  lib.impl("int8_mm", &int8_mm);
  lib.impl("int8_blocks_mm", &int8_blocks_mm);
  lib.impl("int4_groups_mm", &int4_groups_mm);
}
