// The AVX2 tier's packed matmul where the CPU multiplies bytes into 32-bit sums on 256-bit vectors:
// AVX-VNNI (Intel Core from Alder Lake on, without AVX-512). One vpdpbusd takes a 32-byte half of a code
// row (8 columns x 4 inputs) times four input digits into 8 int32 column sums, where plain AVX2 needs
// vpmaddubsw, a 16-bit add and, once a block, vpmaddwd; and since vpdpbusd does not saturate, 6- and
// 8-bit codes go whole rather than a nibble at a time. The integer sums are the same exact integers and
// the epilogue is tile's (packed_avx2.h), so the result is bitwise the AVX2 tier's.
//
// AVX512-VNNI with AVX512VL has the same instruction on the same registers, EVEX-encoded. An AVX2 build
// with KVFLOW_AVX2_VNNI_EVEX defined compiles this file's functions for it (the rest of the library stays
// AVX2): that is how a CPU with AVX-512 but without AVX-VNNI (this project's AMD EPYC) runs and tests
// this path. Test builds only; a CPU with AVX-512 runs the avx512 tier.
#pragma once

#if defined(__AVXVNNI__)
#define KVFLOW_AVX2_VNNI 1
#elif defined(KVFLOW_AVX2_VNNI_EVEX) && defined(__GNUC__) && !defined(__clang__)
#define KVFLOW_AVX2_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx512vnni,avx512vl")
#endif

#ifdef KVFLOW_AVX2_VNNI

#include <immintrin.h>

#include "packed_common.h"

namespace kvflow::packed::avx2 {

inline __m256i dot_bytes(__m256i sum, __m256i codes, __m256i digits) {  // sum += codes . digits, 4 at a time
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sum, codes, digits);
#else
  return _mm256_dpbusd_epi32(sum, codes, digits);
#endif
}

// Columns 16 g + 8 half .. + 8 h of group g for M rows, H halves from `half` on; Two: 16-bit inputs (two
// digits), else 8-bit. Bits and Book as in tile; their 8-bit codes (codebook entries included) go whole.
template <int Block, int M, int H, bool Two, int Bits, bool HasOffset, bool Book>
void tile_vnni(const KvflowPackedWeight& w, int64_t g, int half, const Rows& rows, float* y, int64_t y_stride) {
  const int64_t nb = w.k / Block;
  const size_t chunk = chunk_bytes(w), codes_end = code_bytes(w);
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const __m256i low_nibble = _mm256_set1_epi8(0x0f);
  const __m256i book =
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kCodebook[Book ? w.codebook : 0])));
  __m256 acc[M][H];
  for (int r = 0; r < M; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = base + static_cast<size_t>(b) * chunk;
    if (half == 0) prefetch_ahead(block, chunk);
    __m256i sum_hi[M][H], sum_lo[M][H];
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < H; ++h) sum_hi[r][h] = sum_lo[r][h] = _mm256_setzero_si256();
    auto step = [&](int quad, const __m256i* codes) {  // codes[h]: 8 columns x inputs 4 quad .. + 3
      for (int r = 0; r < M; ++r) {
        const __m256i xh = broadcast4(rows.hi + r * rows.stride + b * Block + 4 * quad);
        for (int h = 0; h < H; ++h) sum_hi[r][h] = dot_bytes(sum_hi[r][h], codes[h], xh);
        if constexpr (Two) {
          const __m256i xl = broadcast4(rows.lo + r * rows.stride + b * Block + 4 * quad);
          for (int h = 0; h < H; ++h) sum_lo[r][h] = dot_bytes(sum_lo[r][h], codes[h], xl);
        }
      }
    };
    auto code_row = [&](int row, int h) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * row + 32 * (half + h)));
    };
    if constexpr (Bits == 4) {
      for (int row = 0; row < Block / 8; ++row) {  // low nibbles are inputs 8 row .. +3, high ones +4 .. +7
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = code_row(row, h);
          lo[h] = _mm256_and_si256(v, low_nibble);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble);
          if constexpr (Book) lo[h] = _mm256_shuffle_epi8(book, lo[h]), hi[h] = _mm256_shuffle_epi8(book, hi[h]);
        }
        step(2 * row, lo);
        step(2 * row + 1, hi);
      }
    } else if constexpr (Bits == 6) {
      for (int row = 0; row < Block / 8; ++row) {
        __m256i first[H], second[H];
        for (int h = 0; h < H; ++h) six_bit_codes<Block>(block, row, half + h, &first[h], &second[h]);
        step(2 * row, first);
        step(2 * row + 1, second);
      }
    } else {
      for (int row = 0; row < Block / 4; ++row) {
        __m256i codes[H];
        for (int h = 0; h < H; ++h) codes[h] = code_row(row, h);
        step(row, codes);
      }
    }
    for (int h = 0; h < H; ++h) {
      __m256 scale, offset = _mm256_setzero_ps();
      scales_offsets(w, g, b, block + codes_end, half + h, &scale, HasOffset ? &offset : nullptr);
      for (int r = 0; r < M; ++r) {
        const __m256i dot = Two ? _mm256_add_epi32(_mm256_slli_epi32(sum_hi[r][h], 8), sum_lo[r][h]) : sum_hi[r][h];
        const __m256 col_scale = _mm256_mul_ps(scale, _mm256_set1_ps(rows.scale[r * rows.blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), col_scale, acc[r][h]);
        if constexpr (HasOffset)
          acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(rows.sum[r * rows.blocks + b]), acc[r][h]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t col = g * 16 + 8 * (half + h);
    for (int r = 0; r < M; ++r) store_columns(y + r * y_stride + col, acc[r][h], w.n - col);
  }
}

}  // namespace kvflow::packed::avx2

#if !defined(__AVXVNNI__)
#pragma GCC pop_options
#endif

#endif
