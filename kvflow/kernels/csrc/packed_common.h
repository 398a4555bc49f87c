// What every tier of the packed matmul shares: the layout's sizes, the rows' input digits, prefetching,
// and the loop over column groups and rows. A tier supplies a Kernel (packed_vnni.h, packed_avx2.h,
// packed_neon.h, packed_generic.h) with quantize_row and rows_block<M>; all tiers compute the same exact
// integer block sums and the same float epilogue, operation for operation, so their results are bitwise
// equal (but for the generic tier on x86 without FMA, whose multiply-adds round twice).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kvflow_cpu.h"
#include "simd.h"

namespace kvflow::packed {

constexpr int kBlock = 32;       // inputs per scale of most formats
constexpr int kSmallBlock = 16;  // the K-quants whose scales cover 16 inputs (Q6_K, Q3_K, Q2_K)
constexpr int32_t kMaxInt = 32639;  // |x| <= this keeps the high digit h = (x + 128) >> 8 within a signed byte
constexpr int32_t kMaxInt8 = 127;   // 8-bit inputs: one signed digit
// How far ahead in each column group's bytes a tile asks for weights: the hardware prefetcher alone
// leaves a decode step's matrices well below DRAM bandwidth (figures: benchmarks/RESULTS.md, session 6).
// 4 KiB: on a Zen 4 EPYC whose memory streams at 55 GB/s, 1,280 bytes left the kernel at 40 to 46 GB/s
// and 4 KiB reached 43 to 60 (session 27); where memory is slower, the two are the same.
constexpr size_t kPrefetchBytes = 4096;

// The bytes kPrefetchBytes past block, into every cache level. Not non-temporally (PREFETCHNTA), even where
// no later pass reads them: on a Zen 4 EPYC that was worth 0 to 3% of a decode step, and on an AMX Xeon it
// left a decode step 2.6 times slower (session 33, benchmarks/RESULTS.md).
inline void prefetch_ahead(const uint8_t* block, size_t bytes) {
  for (size_t line = 0; line < bytes; line += 64) __builtin_prefetch(block + kPrefetchBytes + line, 0, 3);
}

struct Rows {  // the rows' inputs as digits h, l (int8 [m, k]; lo null for 8-bit inputs, a digit h alone) and
               // per block: scale and sum of the inputs
  const int8_t* hi;
  const int8_t* lo;
  int64_t stride;
  const float* scale;
  const float* sum;
  int64_t blocks;
  // The generic tier's: the inputs again as 16-bit integers 256 h + l, each 4 twice over (2 stride a row)
  const int16_t* wide = nullptr;

  Rows from(int r0) const {  // the rows from r0 on
    return {hi + r0 * stride, lo ? lo + r0 * stride : nullptr, stride, scale + r0 * blocks, sum + r0 * blocks, blocks,
            wide ? wide + 2 * r0 * stride : nullptr};
  }
};

inline size_t code_bytes(int block, int bits) { return static_cast<size_t>(2 * block * bits); }  // 16 columns

inline size_t code_bytes(const KvflowPackedWeight& w) { return code_bytes(w.block, w.bits); }

inline size_t chunk_bytes(const KvflowPackedWeight& w) {
  return code_bytes(w) + (w.has_offset && !w.super_scales ? 64 : 32);  // sc and m bytes: 32 with super_scales
}

constexpr int kSuperInputs = 256;  // inputs per d and dmin of the K-quants with mins

// Group g's 16 d then 16 dmin (float16) for block b, where the weight has super_scales.
inline const uint8_t* super_at(const KvflowPackedWeight& w, int64_t g, int64_t b) {
  return w.super_scales + (static_cast<size_t>(g) * (w.k / kSuperInputs) + b * w.block / kSuperInputs) * 64;
}

inline float half_value(const uint8_t* p) {
  kvflow::float16 h;
  __builtin_memcpy(&h, p, 2);
  return widen(h);
}

// Column c's scale and offset (w = scale * q + offset) in block b of group g, whose bytes start at `block`:
// what the vector tiers compute, value for value.
inline void column_scale_offset(const KvflowPackedWeight& w, int64_t g, int64_t b, const uint8_t* block, int c,
                                float* scale, float* offset) {
  const uint8_t* s = block + code_bytes(w);
  if (w.super_scales) {
    const uint8_t* d = super_at(w, g, b);
    *scale = half_value(d + 2 * c) * static_cast<float>(s[c]);
    *offset = -(half_value(d + 32 + 2 * c) * static_cast<float>(s[16 + c]));
    return;
  }
  *scale = half_value(s + 2 * c);
  *offset = w.has_offset ? half_value(s + 32 + 2 * c) : *scale * -static_cast<float>(w.centre);
}

inline bool valid_block(int32_t block) { return block == kBlock || block == kSmallBlock; }

inline bool valid_bits(int32_t bits) { return bits == 4 || bits == 6 || bits == 8; }

// The codebooks (kvflow_cpu.h): entry i is the 8-bit code (value + 128) of a nibble i. IQ4_NL's values are
// ggml's kvalues_iq4nl; MXFP4's are E2M1's {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives, doubled to
// whole numbers (the scale carries the half).
constexpr int kCodebooks = 2;
alignas(16) constexpr uint8_t kCodebook[kCodebooks + 1][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},  // no codebook: the nibble itself
    {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241},
    {128, 129, 130, 131, 132, 134, 136, 140, 128, 127, 126, 125, 124, 122, 120, 116},
};

// A weight's layout is one the kernels take: bits and block, and a codebook only on 4-bit codes.
inline bool valid_layout(const KvflowPackedWeight& w) {
  return valid_block(w.block) && valid_bits(w.bits) && w.k % w.block == 0 && w.codebook >= 0 &&
         w.codebook <= kCodebooks && (w.codebook == 0 || w.bits == 4);
}

// A codebook's low and high nibbles (code = 16 high + low), for tiers that take 8-bit codes a nibble at a
// time; computed at compile time, once per codebook (kCodebookNibbles).
struct CodebookNibbles {
  alignas(16) uint8_t low[16] = {}, high[16] = {};
  constexpr explicit CodebookNibbles(int book) {
    for (int i = 0; i < 16; ++i)
      low[i] = static_cast<uint8_t>(kCodebook[book][i] & 15), high[i] = static_cast<uint8_t>(kCodebook[book][i] >> 4);
  }
};
constexpr CodebookNibbles kCodebookNibbles[kCodebooks + 1] = {CodebookNibbles(0), CodebookNibbles(1), CodebookNibbles(2)};

// Where a 6-bit block's rows of top bits start: after its low nibbles, laid out as a 4-bit block's codes.
inline size_t top_bits_at(int block) { return code_bytes(block, 4); }

// The code of input `input` of column `column` in one block's bytes (the layout in kvflow_cpu.h).
inline int code_at(const uint8_t* block, int bits, int column, int input, int block_inputs, int codebook) {
  if (bits == 8) return block[64 * (input / 4) + 4 * column + input % 4];
  const uint8_t byte = block[64 * (input / 8) + 4 * column + input % 4];
  const int low = (input % 8) < 4 ? (byte & 0x0f) : (byte >> 4);
  if (bits == 4) return kCodebook[codebook][low];
  const uint8_t top = block[top_bits_at(block_inputs) + 64 * (input / 16) + 4 * column + input % 4];
  return low | (((top >> (2 * ((input % 16) / 4))) & 3) << 4);
}

inline float block_amax(const float* xb, int block) {  // the block's largest |x|
  float amax = 0.f;
  for (int i = 0; i < block; ++i) amax = std::fabs(xb[i]) > amax ? std::fabs(xb[i]) : amax;
  return amax;
}

// One row's inputs -> digits, per block of `block`: s = max|x| / kMaxInt, x_int = round(x / s) (nearest
// even), h = (x_int + 128) >> 8, l = x_int - 256 h. The vector tiers compute exactly this.
inline void quantize_row_scalar(const float* x, int64_t k, int block, int8_t* hi, int8_t* lo, float* scale,
                                float* sum) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    const float amax = block_amax(xb, block);
    const float s = amax / kMaxInt;
    const float inv = amax > 0.f ? kMaxInt / amax : 0.f;
    int32_t total = 0;
    for (int i = 0; i < block; ++i) {
      int32_t q = simd::round_to_int(xb[i] * inv);
      q = q > kMaxInt ? kMaxInt : (q < -kMaxInt ? -kMaxInt : q);  // x / s can round past the bound by an ulp
      const int32_t h = (q + 128) >= 0 ? (q + 128) / 256 : -((-(q + 128) + 255) / 256);  // floor division
      hi[b * block + i] = static_cast<int8_t>(h);
      lo[b * block + i] = static_cast<int8_t>(q - 256 * h);
      total += q;
    }
    scale[b] = s;
    sum[b] = s * static_cast<float>(total);
  }
}

// 8-bit inputs: s = max|x| / 127, x_int = round(x / s) (nearest even), one digit. Half the 16-bit
// inputs' work for the integer units, at llama.cpp's precision (its activations are 8-bit per 32 too).
inline void quantize_row8_scalar(const float* x, int64_t k, int block, int8_t* digits, float* scale, float* sum) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = x + b * block;
    const float amax = block_amax(xb, block);
    const float s = amax / kMaxInt8;
    const float inv = amax > 0.f ? kMaxInt8 / amax : 0.f;
    int32_t total = 0;
    for (int i = 0; i < block; ++i) {
      int32_t q = simd::round_to_int(xb[i] * inv);
      q = q > kMaxInt8 ? kMaxInt8 : (q < -kMaxInt8 ? -kMaxInt8 : q);
      digits[b * block + i] = static_cast<int8_t>(q);
      total += q;
    }
    scale[b] = s;
    sum[b] = s * static_cast<float>(total);
  }
}

// The row quantizers of the tiers without vector ones of their own (Generic, Neon derive from this).
struct ScalarQuantizer {
  static void quantize_row(const float* x, int64_t k, int block, int8_t* hi, int8_t* lo, float* scale, float* sum) {
    quantize_row_scalar(x, k, block, hi, lo, scale, sum);
  }
  static void quantize_row8(const float* x, int64_t k, int block, int8_t* digits, float* scale, float* sum) {
    quantize_row8_scalar(x, k, block, digits, scale, sum);
  }
};

// rows_block<M> for a tier whose kernel takes one- and two-digit inputs in separate passes
// (Tier::blocks<M, two_digits>): two digits need twice the accumulators, so at most TwoRows rows a pass.
template <typename Tier, int TwoRows, int M>
void digit_passes(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y, int64_t ys) {
  if (!rows.lo) return Tier::template blocks<M, false>(w, g_lo, g_hi, rows, y, ys);
  if constexpr (M > TwoRows) {
    Tier::template blocks<TwoRows, true>(w, g_lo, g_hi, rows, y, ys);
    digit_passes<Tier, TwoRows, M - TwoRows>(w, g_lo, g_hi, rows.from(TwoRows), y + TwoRows * ys, ys);
  } else {
    Tier::template blocks<M, true>(w, g_lo, g_hi, rows, y, ys);
  }
}

// Kernel::rows_block<M> for the M = rows (1 <= rows <= R) known only at run time.
template <typename Kernel, int R>
void rows_block_for(int rows, const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& part, float* y,
                    int64_t ys) {
  if constexpr (R > 1) {
    if (rows < R) return rows_block_for<Kernel, R - 1>(rows, w, g_lo, g_hi, part, y, ys);
  }
  Kernel::template rows_block<R>(w, g_lo, g_hi, part, y, ys);
}

// Groups [g_lo, g_hi) for rows [0, m): a few groups at a time, and for each, all rows Kernel::kRows at a
// time, so the groups' bytes come from memory once and stay in L1 for the later rows.
template <typename Kernel>
void run_groups(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, int m, float* y,
                int64_t ys) {
  constexpr int64_t kGroupsAtOnce = 4;
  constexpr int R = Kernel::kRows;
  for (int64_t g0 = g_lo; g0 < g_hi; g0 += kGroupsAtOnce) {
    const int64_t g1 = g0 + kGroupsAtOnce < g_hi ? g0 + kGroupsAtOnce : g_hi;
    for (int r0 = 0; r0 < m; r0 += R)
      rows_block_for<Kernel, R>(m - r0 >= R ? R : m - r0, w, g0, g1, rows.from(r0), y + r0 * ys, ys);
  }
}

}  // namespace kvflow::packed
