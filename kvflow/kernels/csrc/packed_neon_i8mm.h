// The NEON tier's packed matmul for two rows at once where the CPU has the int8 matrix multiply
// extension (i8mm: Apple M2 on, Graviton 3 and 4, Neoverse V1/V2/N2, Cortex-A710 on). One vusmmlaq_s32
// multiplies two columns' 8 codes (unsigned) by two rows' 8 input digits (signed) into their four 32-bit
// sums: 32 products an instruction, where vdotq_s32 makes 16. Unsigned codes go whole, so 8-bit codes
// and codebook entries need no split into nibbles. The integer sums are the same exact integers and the
// float epilogue is the other tiers', lane for lane: the result is bitwise the same. Included by
// packed_neon.h, whose add_top_bits and store_quarters it uses.
#pragma once

#if defined(__ARM_FEATURE_MATMUL_INT8)
#define KVFLOW_NEON_I8MM 1

#include <arm_neon.h>

#include "packed_common.h"
#include "quarter_scales.h"

namespace kvflow::packed::neon {

// Column pairs (0, 1) and (2, 3) of 4 columns, 8 inputs each, from two vectors of those columns x 4
// inputs (the first's inputs, then the second's): the unsigned operands of vusmmlaq_s32.
inline void column_pairs(uint8x16_t first, uint8x16_t second, uint8x16_t* pair01, uint8x16_t* pair23) {
  const uint32x4_t a = vreinterpretq_u32_u8(first), b = vreinterpretq_u32_u8(second);
  *pair01 = vreinterpretq_u8_u32(vzip1q_u32(a, b));
  *pair23 = vreinterpretq_u8_u32(vzip2q_u32(a, b));
}

// The 16 columns of group g for two rows; Two: 16-bit inputs (two digits), else 8-bit.
template <bool Two>
void tile_two_rows(const KvflowPackedWeight& w, int64_t g, const Rows& rows, float* y, int64_t y_stride) {
  const int64_t nb = w.k / w.block;
  const size_t chunk = chunk_bytes(w);
  const bool any_offset = w.has_offset != 0 || w.centre != 0, eight_bit = w.bits == 8, six_bit = w.bits == 6,
             book = w.codebook != 0;
  const float32x4_t minus_centre = vdupq_n_f32(-static_cast<float>(w.centre));
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const uint8x16_t low_nibble = vdupq_n_u8(0x0f), table = vld1q_u8(kCodebook[w.codebook]);
  float32x4_t acc[2][4];
  for (int r = 0; r < 2; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = base + static_cast<size_t>(b) * chunk;
    prefetch_ahead(block, chunk);
    // [column pair p: columns 2p, 2p + 1] -> {2p row 0, 2p row 1, 2p + 1 row 0, 2p + 1 row 1}
    int32x4_t sum_h[8], sum_l[8];
    for (int p = 0; p < 8; ++p) sum_h[p] = sum_l[p] = vdupq_n_s32(0);
    auto step = [&](int oct, const uint8x16_t* pairs) {  // inputs 8 oct .. + 7 of the 8 column pairs
      const int64_t at = b * w.block + 8 * oct;
      const int8x16_t xh = vcombine_s8(vld1_s8(rows.hi + at), vld1_s8(rows.hi + rows.stride + at));
      for (int p = 0; p < 8; ++p) sum_h[p] = vusmmlaq_s32(sum_h[p], pairs[p], xh);
      if constexpr (Two) {
        const int8x16_t xl = vcombine_s8(vld1_s8(rows.lo + at), vld1_s8(rows.lo + rows.stride + at));
        for (int p = 0; p < 8; ++p) sum_l[p] = vusmmlaq_s32(sum_l[p], pairs[p], xl);
      }
    };
    for (int oct = 0; oct < w.block / 8; ++oct) {
      uint8x16_t pairs[8];
      for (int q = 0; q < 4; ++q) {
        uint8x16_t first, second;
        if (eight_bit) {  // code rows 2 oct (inputs 8 oct .. + 3) and 2 oct + 1 (+ 4 .. + 7)
          first = vld1q_u8(block + 128 * oct + 16 * q);
          second = vld1q_u8(block + 128 * oct + 64 + 16 * q);
        } else {  // one code row: low nibbles are inputs 8 oct .. + 3, high ones + 4 .. + 7
          const uint8x16_t v = vld1q_u8(block + 64 * oct + 16 * q);
          first = vandq_u8(v, low_nibble), second = vshrq_n_u8(v, 4);
          if (six_bit) {
            add_top_bits(block, w.block, oct, q, &first, &second);
          } else if (book) {
            first = vqtbl1q_u8(table, first), second = vqtbl1q_u8(table, second);
          }
        }
        column_pairs(first, second, &pairs[2 * q], &pairs[2 * q + 1]);
      }
      step(oct, pairs);
    }
    for (int q = 0; q < 4; ++q) {
      float32x4_t scale, offset;
      quarter_scales(w, g, b, block, q, minus_centre, &scale, &offset);
      // Columns 4q .. 4q + 3 of each row, out of their two pairs' 2 x 2 sums.
      const int32x4_t hi[2] = {vuzp1q_s32(sum_h[2 * q], sum_h[2 * q + 1]), vuzp2q_s32(sum_h[2 * q], sum_h[2 * q + 1])};
      const int32x4_t lo[2] = {vuzp1q_s32(sum_l[2 * q], sum_l[2 * q + 1]), vuzp2q_s32(sum_l[2 * q], sum_l[2 * q + 1])};
      for (int r = 0; r < 2; ++r) {
        const int32x4_t dot = Two ? vaddq_s32(vshlq_n_s32(hi[r], 8), lo[r]) : hi[r];
        const float32x4_t col_scale = vmulq_f32(scale, vdupq_n_f32(rows.scale[r * rows.blocks + b]));
        acc[r][q] = vfmaq_f32(acc[r][q], vcvtq_f32_s32(dot), col_scale);
        if (any_offset) acc[r][q] = vfmaq_f32(acc[r][q], offset, vdupq_n_f32(rows.sum[r * rows.blocks + b]));
      }
    }
  }
  store_quarters<2>(w, g, acc, y, y_stride);
}

}  // namespace kvflow::packed::neon

#endif
