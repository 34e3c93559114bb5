// GGUF's Q6_K values at the file's 6 bits a weight (`kernels.pack_q6` writes the layout):
// the int8 block kernels take them beside Q6_K's int8 sub-scales (int8_scales.h) and unpack
// each chunk of 64 values in registers as they read it. A chunk's values u = q + 32 (0..63)
// are laid out for a 512-bit register R of 64 bytes whose dword l holds values l, 16 + l,
// 32 + l and 48 + l (byte r of R is u[16 (r % 4) + r / 4]): so the fp32 kernel takes block J
// of the chunk (values 16 J..) as R's dwords shifted right by 8 J, with no shuffle. In a row of
// K values, K / 64 chunks of 48 bytes:
//   bytes  0-31: byte i = R[i] & 15 | (R[i + 32] & 15) << 4   (the low nibbles)
//   bytes 32-47: byte i = sum over t = 0..3 of (R[i + 16 t] >> 4) << 2 t   (the high bits)
// R is two nibble halves and four shifted copies of the 16 high-bit bytes; 256-bit registers
// take its two halves. The int8 dot products want values in order: `q6_in_order` moves them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "common.h"

namespace qinfer_kernels {

constexpr int64_t kQ6Chunk = 64;  // values a chunk
constexpr int64_t kQ6Bytes = 48;  // bytes a chunk

// A packed row's bytes for K values (K a multiple of 64).
constexpr int64_t q6_row_bytes(int64_t K) { return K / kQ6Chunk * kQ6Bytes; }

// Value k of a packed row (the scalar path).
QINFER_INLINE int8_t q6_value(const uint8_t* row, int64_t k) {
  const uint8_t* chunk = row + k / kQ6Chunk * kQ6Bytes;
  const int64_t i = k % kQ6Chunk, r = 4 * (i % 16) + i / 16;  // its byte of R
  const int low = (chunk[r % 32] >> (4 * (r / 32))) & 15;
  const int high = (chunk[32 + r % 16] >> (2 * (r / 16))) & 3;
  return static_cast<int8_t>((low | high << 4) - 32);
}

// R of the chunk at `chunk`: u (0..63) in R's order.
QINFER_VNNI QINFER_INLINE __m512i q6_unpack64(const uint8_t* chunk) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i fifteen = _mm256_set1_epi8(15);
  const __m512i low = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_and_si256(nibbles, fifteen)),
      _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), fifteen), 1);
  // 128-bit lane t: the high-bit bytes shifted right by 2 t (a neighbour's bits that move into
  // the top of a byte are masked off), then moved to bits 4-5
  const __m512i copies =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 32)));
  const __m512i shifts = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0);
  const __m512i high = _mm512_slli_epi64(
      _mm512_and_si512(_mm512_srlv_epi64(copies, shifts), _mm512_set1_epi8(3)), 4);
  return _mm512_or_si512(low, high);
}

// The same as R's two 256-bit halves (dwords 0-7 and 8-15).
QINFER_AVX2 QINFER_INLINE void q6_unpack64(const uint8_t* chunk, __m256i (&half)[2]) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i fifteen = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
  const __m256i copies = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 32)));
  #pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    // half h's 128-bit lane j is R's lane t = 2 h + j: its high bits at 2 t
    const __m256i shift = _mm256_set_epi64x(4 * h + 2, 4 * h + 2, 4 * h, 4 * h);
    const __m256i high =
        _mm256_slli_epi64(_mm256_and_si256(_mm256_srlv_epi64(copies, shift), three), 4);
    const __m256i low =
        _mm256_and_si256(h == 0 ? nibbles : _mm256_srli_epi16(nibbles, 4), fifteen);
    half[h] = _mm256_or_si256(low, high);
  }
}

// u (0..63) in R's dword lanes, the byte at 8 J -> those values as fp32 lanes q = u - 32:
// 2^23 + u by its bits, minus 2^23 + 32, exact (no int -> float conversion: on cores whose
// conversions share the multiply-adds' ports, this leaves those ports to the products).
constexpr int32_t kQ6FloatBits = 0x4B000000;  // 2^23 as fp32
constexpr float kQ6FloatOffset = 8388608.0f + 32.0f;

template <int J>
QINFER_VNNI QINFER_INLINE __m512 q6_block_f32(__m512i r) {
  const __m512i byte = J == 0 ? r : _mm512_srli_epi32(r, 8 * J);
  // (byte & 0xFF) | 2^23's bits in one ternary-logic op: A & B | C is 0xEA
  const __m512i bits = _mm512_ternarylogic_epi32(byte, _mm512_set1_epi32(0xFF),
                                                 _mm512_set1_epi32(kQ6FloatBits), 0xEA);
  return _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kQ6FloatOffset));
}

template <int J>
QINFER_AVX2 QINFER_INLINE __m256 q6_block_f32(__m256i r) {
  const __m256i byte = J == 0 ? r : _mm256_srli_epi32(r, 8 * J);
  const __m256i bits = _mm256_or_si256(_mm256_and_si256(byte, _mm256_set1_epi32(0xFF)),
                                       _mm256_set1_epi32(kQ6FloatBits));
  return _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(kQ6FloatOffset));
}

// R -> the chunk's values q = u - 32 in order (byte i: value i), for the int8 dots: within
// each 128-bit lane t a 4 x 4 byte transpose (byte 4 m + J <- 4 J + m: values 16 J + 4 t + m
// now at lane t's dword J), then dword 4 J + t <- dword 4 t + J across the lanes.
QINFER_VNNI QINFER_INLINE __m512i q6_in_order(__m512i r) {
  const __m512i bytes = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i ordered = _mm512_permutexvar_epi32(dwords, _mm512_shuffle_epi8(r, bytes));
  return _mm512_sub_epi8(ordered, _mm512_set1_epi8(32));
}

// The same from R's halves into values 0-31 and 32-63.
QINFER_AVX2 QINFER_INLINE void q6_in_order(__m256i (&half)[2]) {
  const __m256i bytes = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  // after the byte transpose, half h holds lanes t = 2 h, 2 h + 1, each dwords J = 0..3
  const __m256i a = _mm256_shuffle_epi8(half[0], bytes), b = _mm256_shuffle_epi8(half[1], bytes);
  // dword (J, t) for t = 0..3: J's four dwords of lanes 0..3, in order of t
  const __m256i lo = _mm256_unpacklo_epi32(a, b);  // lane j: (J0,t=j) (J0,t=2+j) (J1,j) (J1,2+j)
  const __m256i hi = _mm256_unpackhi_epi32(a, b);  // the same for J = 2, 3
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i thirty_two = _mm256_set1_epi8(32);
  half[0] = _mm256_sub_epi8(_mm256_permutevar8x32_epi32(lo, order), thirty_two);
  half[1] = _mm256_sub_epi8(_mm256_permutevar8x32_epi32(hi, order), thirty_two);
}

}  // namespace qinfer_kernels
