// The packed matmul of the generic tier: x86-64 CPUs without AVX2, ARMv8.0 cores without dotprod, and any
// other CPU, through int_vectors.h's 128-bit operations (SSE2, NEON, or plain C++).
//
// A row's two input digits are one 16-bit integer again here, x = 256 h + l (|x| <= kMaxInt fits 16
// bits; Generic::widened makes them once a call), so one pmaddwd-like step multiplies 8 codes (widened to
// 16 bits) by 8 inputs into 32-bit lanes: a block's sum of 32 products of codes below 256 and inputs below
// 2^15 stays below 2^31, and equals 256 dot(h) + dot(l), the other tiers' exact sum. The float epilogue is
// theirs, lane for lane: with a fused multiply-add (NEON, or an x86 CPU with FMA) the result is bitwise
// the same; without one (most x86 CPUs without AVX2), each multiply-add rounds twice and the result may
// differ in the last bits (tests/kernels/test_tiers.py bounds it).
#pragma once

#include <cstring>
#include <vector>

#include "int_vectors.h"
#include "packed_common.h"
#include "quarter_scales.h"

namespace kvflow::packed {

namespace generic {

// Inputs 4u .. 4u + 3 of columns 4q .. 4q + 3 (16 codes, column after column) from one block's bytes.
template <int Bits, bool Book, int Block>
inline ivec::u8x16 quarter_codes(const uint8_t* block, int u, int q, const uint8_t* book) {
  using namespace ivec;
  if constexpr (Bits == 8) {
    return load16(block + 64 * u + 16 * q);
  } else {
    const u8x16 v = load16(block + 64 * (u / 2) + 16 * q);  // low nibbles: inputs 8p .. +3, high: +4 .. +7
    u8x16 codes = u % 2 ? high_nibbles(v) : low_nibbles(v);
    if constexpr (Bits == 6) codes = bytes_or(codes, top_pair(load16(block + top_bits_at(Block) + 64 * (u / 4) + 16 * q), u % 4));
    if constexpr (Book) codes = lookup16(codes, book);
    return codes;
  }
}

// The 16 columns of group g for M rows, blocks of Block inputs (known here, so the loop over a block's
// units unrolls with every offset a constant).
template <int M, int Bits, bool Book, int Block>
void tile(const KvflowPackedWeight& w, int64_t g, const Rows& rows, float* y, int64_t y_stride) {
  using namespace ivec;
  constexpr int inputs = Block, units = Block / 4;
  const int64_t nb = w.k / inputs;
  const size_t chunk = chunk_bytes(w);
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const uint8_t* book = kCodebook[w.codebook];
  const bool any_offset = w.has_offset || w.centre;
  const f32x4 minus_centre = splat(-static_cast<float>(w.centre));
  f32x4 out[M][4];
  for (int r = 0; r < M; ++r)
    for (int q = 0; q < 4; ++q) out[r][q] = zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = base + static_cast<size_t>(b) * chunk;
    prefetch_ahead(block, chunk);
    const int16_t* x = rows.wide + 2 * b * inputs;  // row r's at x + 2 r stride
    for (int q = 0; q < 4; ++q) {
      dots acc[M][2];
      for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = zero_dots();
#pragma GCC unroll 8
      for (int u = 0; u < units; ++u) {
        i16x8 c0, c1;  // columns 4q, 4q + 1 and 4q + 2, 4q + 3
        widen(quarter_codes<Bits, Book, Block>(block, u, q, book), &c0, &c1);
        for (int r = 0; r < M; ++r) {
          const i16x8 xr = load8(x + 2 * r * rows.stride + 8 * u);
          acc[r][0] = add_products(acc[r][0], c0, xr);
          acc[r][1] = add_products(acc[r][1], c1, xr);
        }
      }
      f32x4 scale, offset;
      quarter_scales(w, g, b, block, q, minus_centre, &scale, &offset);
      for (int r = 0; r < M; ++r) {
        const f32x4 dot = to_float(column_sums(acc[r][0], acc[r][1]));
        out[r][q] = multiply_add(dot, mul(scale, splat(rows.scale[r * rows.blocks + b])), out[r][q]);
        if (any_offset) out[r][q] = multiply_add(offset, splat(rows.sum[r * rows.blocks + b]), out[r][q]);
      }
    }
  }
  const int columns = w.n - g * 16 < 16 ? static_cast<int>(w.n - g * 16) : 16;
  for (int r = 0; r < M; ++r) {
    alignas(16) float tmp[16];
    for (int q = 0; q < 4; ++q) store(tmp + 4 * q, out[r][q]);
    std::memcpy(y + r * y_stride + g * 16, tmp, sizeof(float) * columns);
  }
}

template <int M, int Bits, bool Book>
void tiles(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y, int64_t ys) {
  if (w.block == kSmallBlock) {
    for (int64_t g = g_lo; g < g_hi; ++g) tile<M, Bits, Book, kSmallBlock>(w, g, rows, y, ys);
  } else {
    for (int64_t g = g_lo; g < g_hi; ++g) tile<M, Bits, Book, kBlock>(w, g, rows, y, ys);
  }
}

}  // namespace generic

struct Generic : ScalarQuantizer {
  static constexpr int kRows = 4;
  // Rows with their inputs as 16-bit integers (Rows::wide), each unit of 4 twice over as one 16-bit step
  // takes it: made once a call, not once per column group. Valid until this thread's next call.
  static Rows widened(const Rows& rows, int m) {
    thread_local std::vector<int16_t> buffer;
    const int64_t k = rows.stride;
    buffer.resize(static_cast<size_t>(2 * m * k + 8));
    const size_t past = reinterpret_cast<uintptr_t>(buffer.data()) % 16 / sizeof(int16_t);
    int16_t* wide = buffer.data() + (8 - past) % 8;  // 16-byte aligned (load8)
    for (int r = 0; r < m; ++r) {
      const int8_t* h = rows.hi + r * k;
      const int8_t* l = rows.lo ? rows.lo + r * k : nullptr;
      int16_t* out = wide + 2 * r * k;
      for (int64_t i = 0; i < k; ++i) {
        const auto x = static_cast<int16_t>(l ? h[i] * 256 + l[i] : h[i]);
        out[8 * (i / 4) + i % 4] = out[8 * (i / 4) + i % 4 + 4] = x;
      }
    }
    Rows out = rows;
    out.wide = wide;
    return out;
  }
  template <int M>
  static void rows_block(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                         int64_t ys) {
    if (w.codebook) return generic::tiles<M, 4, true>(w, g_lo, g_hi, rows, y, ys);
    if (w.bits == 4) return generic::tiles<M, 4, false>(w, g_lo, g_hi, rows, y, ys);
    if (w.bits == 6) return generic::tiles<M, 6, false>(w, g_lo, g_hi, rows, y, ys);
    generic::tiles<M, 8, false>(w, g_lo, g_hi, rows, y, ys);
  }
};

}  // namespace kvflow::packed
