// The packed matmul on ARM NEON with the dotprod extension: each 16-byte quarter of a code row (4 columns
// x 4 inputs) times four input digits through vdotq_s32 (signed bytes, four products summed per 32-bit
// lane), as llama.cpp's ARM dot products do. 4- and 6-bit codes (0..15, 0..63) are signed bytes as they
// are; 8-bit codes go as their two nibbles (c = 16 h + l), recombined in 32 bits. Every sum is exact and
// the float epilogue is the other tiers', lane for lane: the result is bitwise the same.
#pragma once

#include <arm_neon.h>

#include <cstring>
#include <type_traits>

#include "packed_common.h"
#include "quarter_scales.h"

namespace kvflow::packed {

namespace neon {

inline int8x16_t broadcast4(const int8_t* p) {  // four input digits, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

// A 6-bit block's codes of 4-bit row `row`, quarter q: its low nibbles (inputs 8 row .. + 3) and high
// ones (+ 4 .. + 7) given their top two bits, from row row / 2 of them, above each.
inline void add_top_bits(const uint8_t* block, int block_inputs, int row, int q, uint8x16_t* low, uint8x16_t* high) {
  const uint8x16_t top_pair = vdupq_n_u8(0x30);
  const uint8x16_t top = vld1q_u8(block + top_bits_at(block_inputs) + 64 * (row / 2) + 16 * q);
  const uint8x16_t pairs = row % 2 ? vshrq_n_u8(top, 4) : top;
  *low = vorrq_u8(*low, vandq_u8(vshlq_n_u8(pairs, 4), top_pair));
  *high = vorrq_u8(*high, vandq_u8(vshlq_n_u8(pairs, 2), top_pair));
}

// M rows' results for the 16 columns of group g, four a vector, as many as exist (the last group may hold
// fewer).
template <int M>
void store_quarters(const KvflowPackedWeight& w, int64_t g, const float32x4_t (&acc)[M][4], float* y,
                    int64_t y_stride) {
  for (int q = 0; q < 4; ++q) {
    const int64_t col = g * 16 + 4 * q;
    const int64_t left = w.n - col;
    for (int r = 0; r < M; ++r) {
      float tmp[4];
      vst1q_f32(tmp, acc[r][q]);
      for (int i = 0; i < 4 && i < left; ++i) y[r * y_stride + col + i] = tmp[i];
    }
  }
}

// The 16 columns of group g for M rows.
template <int M>
void tile(const KvflowPackedWeight& w, int64_t g, const Rows& rows, float* y, int64_t y_stride) {
  const int64_t nb = w.k / w.block;
  const size_t chunk = chunk_bytes(w);
  const bool any_offset = w.has_offset != 0 || w.centre != 0, eight_bit = w.bits == 8,
             six_bit = w.bits == 6, two = rows.lo != nullptr;
  const float32x4_t minus_centre = vdupq_n_f32(-static_cast<float>(w.centre));
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const uint8x16_t low_nibble = vdupq_n_u8(0x0f);
  const bool book = w.codebook != 0;  // 8-bit codes from 4-bit indices, a nibble at a time (as eight_bit)
  const CodebookNibbles& tables = kCodebookNibbles[w.codebook];
  const uint8x16_t book_low = vld1q_u8(tables.low), book_high = vld1q_u8(tables.high);
  float32x4_t acc[M][4];
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = base + static_cast<size_t>(b) * chunk;
    prefetch_ahead(block, chunk);
    int32x4_t dot_h[M][4], dot_l[M][4];  // [row][quarter: 4 columns]
    for (int r = 0; r < M; ++r)
      for (int q = 0; q < 4; ++q) dot_h[r][q] = dot_l[r][q] = vdupq_n_s32(0);
    // codes[q]: columns 4q .. 4q + 3 x 4 inputs; products scaled by 2^Shift (16 for high nibbles)
    auto step = [&](int quad, const int8x16_t* codes, auto shift) {
      constexpr int Shift = decltype(shift)::value;
      for (int r = 0; r < M; ++r) {
        const int8x16_t xh = broadcast4(rows.hi + r * rows.stride + b * w.block + 4 * quad);
        const int8x16_t xl = two ? broadcast4(rows.lo + r * rows.stride + b * w.block + 4 * quad) : xh;
        for (int q = 0; q < 4; ++q) {
          if constexpr (Shift == 0) {
            dot_h[r][q] = vdotq_s32(dot_h[r][q], codes[q], xh);
            if (two) dot_l[r][q] = vdotq_s32(dot_l[r][q], codes[q], xl);
          } else {
            const int32x4_t zero = vdupq_n_s32(0);
            dot_h[r][q] = vaddq_s32(dot_h[r][q], vshlq_n_s32(vdotq_s32(zero, codes[q], xh), Shift));
            if (two) dot_l[r][q] = vaddq_s32(dot_l[r][q], vshlq_n_s32(vdotq_s32(zero, codes[q], xl), Shift));
          }
        }
      }
    };
    const std::integral_constant<int, 0> plain;
    const std::integral_constant<int, 4> high;
    const int rows_per_block = eight_bit ? w.block / 4 : w.block / 8;
    if (book) {  // indices as the 4-bit rows; each looked up in the codebook's two nibble tables
      for (int row = 0; row < rows_per_block; ++row) {
        int8x16_t lo[4], hi[4], lo_top[4], hi_top[4];
        for (int q = 0; q < 4; ++q) {
          const uint8x16_t v = vld1q_u8(block + 64 * row + 16 * q);
          const uint8x16_t i_lo = vandq_u8(v, low_nibble), i_hi = vshrq_n_u8(v, 4);
          lo[q] = vreinterpretq_s8_u8(vqtbl1q_u8(book_low, i_lo));
          lo_top[q] = vreinterpretq_s8_u8(vqtbl1q_u8(book_high, i_lo));
          hi[q] = vreinterpretq_s8_u8(vqtbl1q_u8(book_low, i_hi));
          hi_top[q] = vreinterpretq_s8_u8(vqtbl1q_u8(book_high, i_hi));
        }
        step(2 * row, lo, plain);
        step(2 * row, lo_top, high);
        step(2 * row + 1, hi, plain);
        step(2 * row + 1, hi_top, high);
      }
    }
    for (int row = 0; row < (book ? 0 : rows_per_block); ++row) {
      int8x16_t lo[4], hi[4];
      for (int q = 0; q < 4; ++q) {
        const uint8x16_t v = vld1q_u8(block + 64 * row + 16 * q);
        uint8x16_t v_lo = vandq_u8(v, low_nibble), v_hi = vshrq_n_u8(v, 4);
        if (six_bit) add_top_bits(block, w.block, row, q, &v_lo, &v_hi);
        lo[q] = vreinterpretq_s8_u8(v_lo);
        hi[q] = vreinterpretq_s8_u8(v_hi);
      }
      if (!eight_bit) {  // low nibbles are inputs 8 row .. +3, high ones +4 .. +7
        step(2 * row, lo, plain);
        step(2 * row + 1, hi, plain);
      } else {  // code c = 16 (c >> 4) + (c & 15)
        step(row, lo, plain);
        step(row, hi, high);
      }
    }
    for (int q = 0; q < 4; ++q) {
      float32x4_t scale, offset;
      quarter_scales(w, g, b, block, q, minus_centre, &scale, &offset);
      for (int r = 0; r < M; ++r) {
        const int32x4_t dot = two ? vaddq_s32(vshlq_n_s32(dot_h[r][q], 8), dot_l[r][q]) : dot_h[r][q];
        const float32x4_t col_scale = vmulq_f32(scale, vdupq_n_f32(rows.scale[r * rows.blocks + b]));
        acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(dot), col_scale);
        if (any_offset) acc[r][q] = vfmaq_f32(acc[r][q], offset, vdupq_n_f32(rows.sum[r * rows.blocks + b]));
      }
    }
  }
  store_quarters<M>(w, g, acc, y, y_stride);
}

}  // namespace neon

}  // namespace kvflow::packed

#include "packed_neon_i8mm.h"  // after add_top_bits and store_quarters, which it uses

namespace kvflow::packed {

struct Neon : ScalarQuantizer {
  static constexpr int kRows = 2;
  template <int M>
  static void rows_block(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                         int64_t ys) {
#ifdef KVFLOW_NEON_I8MM
    if constexpr (M == 2) {  // a row pair through the int8 matrix multiply; one row stays on vdotq_s32
      for (int64_t g = g_lo; g < g_hi; ++g)
        rows.lo ? neon::tile_two_rows<true>(w, g, rows, y, ys) : neon::tile_two_rows<false>(w, g, rows, y, ys);
      return;
    }
#endif
    for (int64_t g = g_lo; g < g_hi; ++g) neon::tile<M>(w, g, rows, y, ys);
  }
};

}  // namespace kvflow::packed
