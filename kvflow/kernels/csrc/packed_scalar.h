// The packed matmul in plain C++ (the generic tier, and NEON without dotprod): the same exact integer
// block sums and the same float epilogue as the vector tiers, one column at a time.
#pragma once

#include <cmath>

#include "packed_common.h"
#include "simd.h"

namespace kvflow::packed {

namespace scalar {

// Columns of group g for M rows.
template <int M>
void tile(const KvflowPackedWeight& w, int64_t g, const Rows& rows, float* y, int64_t y_stride) {
  const int inputs = w.block;  // per block
  const int64_t nb = w.k / inputs;
  const size_t chunk = chunk_bytes(w);
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const int columns = w.n - g * 16 < 16 ? static_cast<int>(w.n - g * 16) : 16;
  for (int c = 0; c < columns; ++c) {
    float acc[M] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* block = base + static_cast<size_t>(b) * chunk;
      float scale, offset;
      column_scale_offset(w, g, b, block, c, &scale, &offset);
      for (int r = 0; r < M; ++r) {
        const int8_t* xh = rows.hi + r * rows.stride + b * inputs;
        const int8_t* xl = rows.lo ? rows.lo + r * rows.stride + b * inputs : nullptr;
        int32_t dot_h = 0, dot_l = 0;
        for (int i = 0; i < inputs; ++i) {
          const int q = code_at(block, w.bits, c, i, inputs, w.codebook);
          dot_h += q * xh[i];
          if (xl) dot_l += q * xl[i];
        }
        const int32_t dot = xl ? dot_h * 256 + dot_l : dot_h;
        acc[r] = std::fma(static_cast<float>(dot), scale * rows.scale[r * rows.blocks + b], acc[r]);
        if (w.has_offset || w.centre) acc[r] = std::fma(offset, rows.sum[r * rows.blocks + b], acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) y[r * y_stride + g * 16 + c] = acc[r];
  }
}

}  // namespace scalar

struct Scalar {
  static constexpr int kRows = 4;
  static constexpr int kTwoDigitRows = kRows;  // both digits in one pass
  static void quantize_row(const float* x, int64_t k, int block, int8_t* hi, int8_t* lo, float* scale, float* sum) {
    quantize_row_scalar(x, k, block, hi, lo, scale, sum);
  }
  static void quantize_row8(const float* x, int64_t k, int block, int8_t* digits, float* scale, float* sum) {
    quantize_row8_scalar(x, k, block, digits, scale, sum);
  }
  template <int M>
  static void rows_block(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                         int64_t ys) {
    for (int64_t g = g_lo; g < g_hi; ++g) scalar::tile<M>(w, g, rows, y, ys);
  }
};

}  // namespace kvflow::packed
