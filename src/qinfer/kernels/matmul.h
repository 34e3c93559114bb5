// What the matmul kernels share (int4_q8.cpp, int8_q8.cpp, int8_blocks.cpp,
// int4_groups.cpp): the block of 32 input columns, the scales, the fp32 activations, the
// argument checks, and the driver that splits an (M, N) output into tiles between threads
// (int8_blocks.cpp's; int4_q8.cpp, int4_groups.cpp and int8_q8.cpp run on column tiles,
// int4_tiles.h). What each computes, and in which order: docs/KERNELS.md and the comment
// above each kernel.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "common.h"
#include "isa.h"

namespace qinfer_kernels {

constexpr int64_t kBlock = 32;  // input columns per weight / activation block

// A weight's per-block scales (and the int4 groups' offsets m), S: at::Half, as GGUF files
// hold Q4_0's, Q4_1's, Q8_0's and Q5_0's (read as they are: a decode step reads 2 bytes a
// scale, a Q4_0 block 18 bytes as in the file, not 24), or float, where fp16 would round
// them (Q4_K's products d * sc; int8_scales.h keeps Q6_K's as stored). Either widens
// exactly to the same fp32 value, so every output is the same bits whichever a weight holds
// (the Python side picks fp16 where it is exact: `kernels.fp16_if_exact`).
template <typename S>
constexpr bool kHalf = std::is_same_v<S, at::Half>;

// One scale as fp32, exactly (c10's portable half -> float: no F16C needed on the scalar path).
QINFER_INLINE float widen(float s) { return s; }
QINFER_INLINE float widen(at::Half s) { return static_cast<float>(s); }

// The same in the vector paths' functions, by F16C's one instruction (c10's conversion is a
// dozen integer ones).
QINFER_AVX2 QINFER_INLINE float widen_f16c(float s) { return s; }
QINFER_AVX2 QINFER_INLINE float widen_f16c(at::Half s) { return _cvtsh_ss(s.x); }

// One scale in every lane: for fp16, a broadcast of its bits and one conversion (the int8
// blocks' fp32 tiles take one per block and column).
template <typename S>
QINFER_AVX2 QINFER_INLINE __m256 splat8(const S* p) {
  if constexpr (kHalf<S>) return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(p->x)));
  else return _mm256_broadcast_ss(p);
}
template <typename S>
QINFER_VNNI QINFER_INLINE __m512 splat16(const S* p) {
  if constexpr (kHalf<S>) return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(p->x)));
  else return _mm512_set1_ps(*p);
}

// The vector loads of scales read exactly n of them (n <= 0: none), the rest of the lanes
// zero: a column's last scales may end the tensor. No copy through the stack (a store then a
// wider load of it stalls on store forwarding: an fp32 int4_mm row ran 2.4x slower so).
//
// count (0..8) fp16 values from p as 8 16-bit lanes: dword masked loads of their pairs, an
// odd last one broadcast into its lane.
QINFER_AVX2 QINFER_INLINE __m128i halves(const at::Half* p, int64_t count) {
  if (count >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (count == 4) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (count == 2) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return _mm_cvtsi32_si128(pair);
  }
  const __m128i pairs = _mm_maskload_epi32(
      reinterpret_cast<const int*>(p),
      _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(count / 2)), _mm_setr_epi32(0, 1, 2, 3)));
  if (count % 2 == 0) return pairs;
  const __m128i last = _mm_cmpeq_epi16(_mm_set1_epi16(static_cast<int16_t>(count - 1)),
                                       _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm_or_si128(pairs, _mm_and_si128(_mm_set1_epi16(static_cast<int16_t>(p[count - 1].x)), last));
}

// the first count (..8) of 8 dword lanes
QINFER_AVX2 QINFER_INLINE __m256i first_dwords(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// n (..8) into 8 lanes
template <typename S>
QINFER_AVX2 QINFER_INLINE __m256 scales8(const S* p, int64_t n) {
  const int64_t count = std::clamp<int64_t>(n, 0, 8);
  if constexpr (kHalf<S>) {
    return _mm256_cvtph_ps(halves(p, count));
  } else {
    if (count == 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, first_dwords(count));
  }
}

// n (..16) into 16 lanes (masked loads: AVX512BW's for fp16)
template <typename S>
QINFER_VNNI QINFER_INLINE __m512 scales16(const S* p, int64_t n) {
  const __mmask16 k = n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
  if constexpr (kHalf<S>) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
  else return _mm512_maskz_loadu_ps(k, p);
}

// Block b's offset of a column (m, d: the column's; m null: symmetric) in fp32: m widened, or
// 0 - 8 d, what pack_int4 computes for a zero of +0 (8 d is exact; 0 - keeps m +0 where d is
// ±0), so a symmetric weight gives the bits of the same weight with its m held.
template <typename S>
QINFER_INLINE float offset(const S* m, const S* d, int64_t b) {
  return m ? widen(m[b]) : 0.0f - 8.0f * widen(d[b]);
}
// The same for n (..8 or ..16) blocks from b, as `scales8` / `scales16` load them: 0 - 8 d
// is one fused -(8 d) + 0, exact.
template <typename S>
QINFER_AVX2 QINFER_INLINE __m256 offsets8(const S* m, const S* d, int64_t b, int64_t n) {
  if (m) return scales8(m + b, n);
  return _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scales8(d + b, n), _mm256_setzero_ps());
}
template <typename S>
QINFER_VNNI QINFER_INLINE __m512 offsets16(const S* m, const S* d, int64_t b, int64_t n) {
  if (m) return scales16(m + b, n);
  return _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scales16(d + b, n), _mm512_setzero_ps());
}

// fp32 activations as the int8 blocks' and int4 groups' kernels read them.
struct ActF {
  const float* x;  // (M, K), contiguous
};

// ---------------------------------------------------------------------------------------
// Dot products. A tile computes R rows x C columns of the output: each weight pair is
// loaded and unpacked once for R activation rows, each activation pair once for C columns,
// and the R * C accumulators are independent chains that hide each other's fused
// multiply-add latency. Each output has its own accumulator and the same instructions in
// the same order whatever R and C are (row invariance).
// ---------------------------------------------------------------------------------------

// How far ahead of its loads a tile prefetches a weight row, in bytes (into the next rows at
// a row's end: they are the next columns). A prefetch never faults, so past the end is
// harmless. One row, one thread, weights from memory: 9.4-10.4 GB/s with it, 7-9.5 without
// (SmolLM2 and Qwen3-0.6B shapes, on a shared 2-core AVX512 EPYC).
constexpr int64_t kPrefetch = 512;
// One-row tiles (decode) prefetch further ahead: a row spends little arithmetic on each
// byte, so at 512 bytes its reads and its arithmetic barely overlap and a core waits on
// memory; at 2,048 every one-row kernel reads its weights 10-40% faster from memory, with
// one thread or two (docs/BENCHMARKS.md). Tiles of several rows spend R times as long on
// each byte and keep kPrefetch.
template <int R>
constexpr int64_t kPrefetchFor = R == 1 ? 2048 : kPrefetch;

// Fetches the lines of the `bytes` bytes from the address `at`, an integer: the span may lie
// past a weight's end (a prefetch of it never faults, but a pointer there would be undefined).
template <_mm_hint Hint = _MM_HINT_T0>
inline void prefetch_span(uintptr_t at, int64_t bytes) {
  const uintptr_t end = at + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = at & ~uintptr_t{63}; line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), Hint);
}

// A column's scales (d, and the int4 groups' m) are a short row of their own, read at the
// column's blocks or after them: the hardware's prefetcher missed them often enough that
// the AVX2 int4 tile ran 20% slower from memory than from cache. So each tile fetches the
// scales of the column at least 256 bytes (and two columns) past its last one, `count`
// scales a column: the tiles of a task step go through consecutive columns, so each
// column's scales are fetched a few tiles ahead of it (every other column's, where a tile
// holds two columns: those tiles are the prefill's, which reuse the columns anyway).
// Qwen3-0.6B's int4 shapes at one row, one thread, weights from memory: AVX2 41-48 -> 27
// ms, VNNI 30-33 -> 28-31 (2 threads 19-23 -> 17-20).
template <int C, typename S>
inline void prefetch_scales(const S* const* scales, int64_t count) {
  const int64_t ahead = std::max<int64_t>(2, (64 + count - 1) / count);  // columns
  prefetch_span(reinterpret_cast<uintptr_t>(scales[C - 1]) +
                    static_cast<uintptr_t>(ahead * count) * sizeof(S),
                count * static_cast<int64_t>(sizeof(S)));
}

// The tiles copy every pointer and count they loop over into locals first: the intrinsics'
// vector types may alias anything, so a field read through a reference inside the loop
// would be reloaded after every vector store. The loops over rows and columns are unrolled
// by pragma: gcc then keeps the accumulator arrays in registers (otherwise it stores every
// accumulator to the stack each step).

// torch's Python names, which the error messages speak in
inline std::string dtype_name(at::ScalarType t) {
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

// A layout's words: a string, or a function making one (only called for a refusal: a decode
// step checks some 200 weights, and building their strings each call cost ~0.5 µs a call).
template <typename L>
std::string describe(const L& layout) {
  if constexpr (std::is_invocable_v<const L&>) return layout();
  else return std::string(layout);
}

// `layout` says what the expected shape is made of, e.g. "(N, K) for x's K = 576".
template <typename L>
void check_tensor(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                  int64_t rows, int64_t cols, const L& layout) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device().str());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", got ",
              dtype_name(t.scalar_type()));
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name,
              " must have shape (", rows, ", ", cols, "), ", describe(layout), ", got ",
              shape_str(t));
}

inline void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU, got ", x.device().str());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be torch.float32 or torch.bfloat16, got ", dtype_name(x.scalar_type()));
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (M, K), got shape ", shape_str(x));
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % kBlock == 0, op,
              ": x's K must be a positive multiple of 32, got shape ", shape_str(x));
}

// A weight's scales (`kHalf` says why either): torch.float16 or torch.float32, (rows, cols).
template <typename L>
void check_scales(const char* op, const char* name, const at::Tensor& t, int64_t rows,
                  int64_t cols, const L& layout) {
  const at::ScalarType dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kFloat, op, ": ", name,
              " must be torch.float16 or torch.float32, got ", dtype_name(dtype));
  check_tensor(op, name, t, dtype, rows, cols, layout);
}

// f(S{}) with S the scales' element type (at::Half or float): the kernels' template argument,
// e.g. `with_scales(d, [&](auto s) { using S = decltype(s); ... })`.
template <typename F>
void with_scales(const at::Tensor& scales, F&& f) {
  if (scales.scalar_type() == at::kHalf) {
    f(at::Half{});
  } else {
    f(float{});
  }
}

// x (M, K) as the fp32 kernels read it, held in `holder`: fp32 as it is (contiguous), bf16
// widened (exactly) by torch into a tensor of its own (64-byte aligned, as the kernels'
// 64-byte loads want, and freed with the call).
inline ActF fp32_activations(const at::Tensor& x, at::Tensor& holder) {
  holder = x.to(at::kFloat).contiguous();
  return ActF{holder.data_ptr<float>()};
}

// What a matmul kernel (one weight format times one kind of activations) declares for
// `matmul`: its weights W and activations A; tiles of R rows by C columns of the output on
// AVX512-VNNI and AVX2 (out (M, ldo) at rows r0.., columns n0..); dot_scalar, one output at
// a time (the reference path).
#define QINFER_MATMUL_KERNEL(W, A)                                                        \
  using Weights = W;                                                                      \
  using Acts = A;                                                                         \
  template <int R, int C>                                                                 \
  QINFER_VNNI static void tile_vnni(const W& w, int64_t n0, const A& a, int64_t r0,       \
                                    float* out, int64_t ldo);                             \
  template <int R, int C>                                                                 \
  QINFER_AVX2 static void tile_avx2(const W& w, int64_t n0, const A& a, int64_t r0,       \
                                    float* out, int64_t ldo);                             \
  static void dot_scalar(const W& w, int64_t n, const A& a, int64_t r, float* out, int64_t ldo);

// Rows per tile: one weight chunk serves up to this many rows.
constexpr int kRows = 4;
// Columns per task step: their weights (cols * K bytes + scales) stay in L1/L2 while
// every row tile of the call passes over them.
constexpr int64_t kCols = 16;

// Columns per tile by rows. One row (decode): one column, the weight rows read one after
// the other; 4 interleaved columns ran twice as fast with the weights in cache but half as
// fast from memory (measured on int4 rows K/2 bytes apart), and a decode step's weights
// come from memory. More rows: 2 columns (R * C accumulators and R activation pairs fit in
// VNNI's 32 registers); AVX2's 16 registers take one column.
template <int R, typename Kernel>
QINFER_VNNI void columns_vnni(const typename Kernel::Weights& w, int64_t n0, int64_t n1,
                              const typename Kernel::Acts& a, int64_t r0, float* out, int64_t ldo) {
  constexpr int C = R == 1 ? 1 : 2;
  int64_t n = n0;
  for (; n + C <= n1; n += C) Kernel::template tile_vnni<R, C>(w, n, a, r0, out, ldo);
  if constexpr (C > 1) {
    for (; n < n1; ++n) Kernel::template tile_vnni<R, 1>(w, n, a, r0, out, ldo);
  }
}

template <int R, typename Kernel>
QINFER_AVX2 void columns_avx2(const typename Kernel::Weights& w, int64_t n0, int64_t n1,
                              const typename Kernel::Acts& a, int64_t r0, float* out, int64_t ldo) {
  for (int64_t n = n0; n < n1; ++n) Kernel::template tile_avx2<R, 1>(w, n, a, r0, out, ldo);
}

template <int R, typename Kernel>
void columns(Isa path, const typename Kernel::Weights& w, int64_t n0, int64_t n1,
             const typename Kernel::Acts& a, int64_t r0, float* out, int64_t ldo) {
  if (path == Isa::Vnni) {
    columns_vnni<R, Kernel>(w, n0, n1, a, r0, out, ldo);
  } else {
    columns_avx2<R, Kernel>(w, n0, n1, a, r0, out, ldo);
  }
}

// out (M, N) = the kernel's weights w (N, K) times its activations a (M, K), transposed:
// Kernel is int8_blocks.cpp's (`QINFER_MATMUL_KERNEL`). out's rows are ldo apart (default N:
// a slice of a wider output's columns takes that output's width).
template <typename Kernel>
void matmul(Isa path, const typename Kernel::Weights& w, int64_t N, int64_t M,
            const typename Kernel::Acts& a, float* out, int64_t ldo = -1) {
  if (ldo < 0) ldo = N;
  const int64_t K = w.nb * kBlock;
  // enough columns per task that the pool's wake-up is paid for (it changes which thread
  // computes a column, never how)
  const int64_t grain = std::max<int64_t>(kCols, (int64_t{1} << 17) / std::max<int64_t>(1, M * K));
  at::parallel_for(0, N, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0; n0 < c1; n0 += kCols) {
      const int64_t n1 = std::min(c1, n0 + kCols);
      if (path == Isa::Scalar) {
        for (int64_t r = 0; r < M; ++r)
          for (int64_t n = n0; n < n1; ++n) Kernel::dot_scalar(w, n, a, r, out, ldo);
        continue;
      }
      for (int64_t r0 = 0; r0 < M; r0 += kRows) {
        switch (std::min<int64_t>(kRows, M - r0)) {
          case 4: columns<4, Kernel>(path, w, n0, n1, a, r0, out, ldo); break;
          case 3: columns<3, Kernel>(path, w, n0, n1, a, r0, out, ldo); break;
          case 2: columns<2, Kernel>(path, w, n0, n1, a, r0, out, ldo); break;
          default: columns<1, Kernel>(path, w, n0, n1, a, r0, out, ldo); break;
        }
      }
    }
  });
}

}  // namespace qinfer_kernels
