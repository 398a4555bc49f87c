// The packed matmul on AVX512-VNNI: one 64-byte code row (16 columns x 4 inputs) is the unsigned operand
// of one vpdpbusd against four input digits (see packed_matmul.cpp).
#pragma once

#include <immintrin.h>

#include <cstring>

#include "packed_common.h"

namespace kvflow::packed {

namespace vnni {

// One block's Block (16 or 32) inputs into v, and their largest magnitude.
template <int Block>
float load_block(const float* xb, __m512 v[Block / 16]) {
  const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < Block / 16; ++i) {
    v[i] = _mm512_loadu_ps(xb + 16 * i);
    m = _mm512_max_ps(m, _mm512_and_ps(v[i], sign_off));
  }
  return _mm512_reduce_max_ps(m);
}

// quantize_row_scalar (packed_common.h), a block at a time.
template <int Block>
void quantize_row(const float* x, int64_t k, int8_t* hi, int8_t* lo, float* scale, float* sum) {
  constexpr int V = Block / 16;
  const __m512i lim = _mm512_set1_epi32(kMaxInt), neg = _mm512_set1_epi32(-kMaxInt), c128 = _mm512_set1_epi32(128);
  for (int64_t b = 0; b < k / Block; ++b) {
    __m512 v[V];
    const float amax = load_block<Block>(x + b * Block, v);
    const float s = amax / kMaxInt;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? kMaxInt / amax : 0.f);
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < V; ++i) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  // round to nearest even
      q = _mm512_max_epi32(_mm512_min_epi32(q, lim), neg);     // x / s can round past the bound by an ulp
      const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, c128), 8);
      const __m512i l = _mm512_sub_epi32(q, _mm512_slli_epi32(h, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + b * Block + 16 * i), _mm512_cvtepi32_epi8(h));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + b * Block + 16 * i), _mm512_cvtepi32_epi8(l));
      total = _mm512_add_epi32(total, q);
    }
    scale[b] = s;
    sum[b] = s * static_cast<float>(_mm512_reduce_add_epi32(total));
  }
}

// A 6-bit block's codes of its 4-bit row `row` as two vectors of whole codes (inputs 8 row .. +3, then
// +4 .. +7): each nibble with its top two bits (from row row / 2 of the top bits) put above it. The
// 16-bit shifts carry a neighbour byte's bits along; the masks drop them.
template <int Block>
inline void six_bit_codes(const uint8_t* block, int row, __m512i* first, __m512i* second) {
  const __m512i low_nibble = _mm512_set1_epi8(0x0f), top_pair = _mm512_set1_epi8(0x30);
  const __m512i v = _mm512_loadu_si512(block + 64 * row);
  const __m512i top = _mm512_loadu_si512(block + top_bits_at(Block) + 64 * (row / 2));
  const __m512i top_first = row % 2 ? top : _mm512_slli_epi16(top, 4);  // its pair to bits 4, 5
  const __m512i top_second = row % 2 ? _mm512_srli_epi16(top, 2) : _mm512_slli_epi16(top, 2);
  *first = _mm512_or_si512(_mm512_and_si512(v, low_nibble), _mm512_and_si512(top_first, top_pair));
  *second =
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble), _mm512_and_si512(top_second, top_pair));
}

// Block b's 16 column scales and offsets in group g; s: the block's bytes after its codes. With super_scales
// (kvflow_cpu.h): d * sc and -(dmin * m), each product exact, the negation a sign flip (as the scalar
// code's unary minus, zeros included).
inline void scales_offsets(const KvflowPackedWeight& w, int64_t g, int64_t b, const uint8_t* s, __m512* scale,
                           __m512* offset) {
  auto halves = [](const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  auto bytes = [](const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  };
  if (w.super_scales) {
    const uint8_t* d = super_at(w, g, b);
    *scale = _mm512_mul_ps(halves(d), bytes(s));
    const __m512 min = _mm512_mul_ps(halves(d + 32), bytes(s + 16));
    *offset = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(min), _mm512_set1_epi32(INT32_MIN)));
    return;
  }
  *scale = halves(s);
  // A centred weight's offset -centre * scale is exact in float32: the value a stored offset would have.
  *offset = w.has_offset ? halves(s + 32) : _mm512_mul_ps(*scale, _mm512_set1_ps(-static_cast<float>(w.centre)));
}

inline __m512i codebook_vector(int book) {  // the codebook in each 128-bit lane, for vpshufb
  return _mm512_maskz_broadcast_i32x4(0xffff, _mm_load_si128(reinterpret_cast<const __m128i*>(kCodebook[book])));
}

inline __m512i broadcast4(const int8_t* p) {  // four input digits, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 8-bit inputs (one digit): s = max|x| / 127, x_int = round(x / s); quantize_row8_scalar's arithmetic.
template <int Block>
void quantize_row8(const float* x, int64_t k, int8_t* digits, float* scale, float* sum) {
  constexpr int V = Block / 16;
  const __m512i lim = _mm512_set1_epi32(kMaxInt8), neg = _mm512_set1_epi32(-kMaxInt8);
  for (int64_t b = 0; b < k / Block; ++b) {
    __m512 v[V];
    const float amax = load_block<Block>(x + b * Block, v);
    const float s = amax / kMaxInt8;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? kMaxInt8 / amax : 0.f);
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < V; ++i) {
      const __m512i q = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv)), lim), neg);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(digits + b * Block + 16 * i), _mm512_cvtepi32_epi8(q));
      total = _mm512_add_epi32(total, q);
    }
    scale[b] = s;
    sum[b] = s * static_cast<float>(_mm512_reduce_add_epi32(total));
  }
}

// Columns [16 g, 16 g + 16) for M rows: acc[r] holds them for row r. Two: two input digits (16-bit
// inputs), else one (8-bit). One column group at a time, so a thread's weights are one sequential stream
// (its groups lie end to end): interleaving four groups' streams left decode at batch 1 and 2 about 1.35x
// slower on an AMD EPYC (benchmarks/RESULTS.md, session 17).
template <int Block, int M, bool Two>
void tile_group(const KvflowPackedWeight& w, int64_t g, const Rows& rows, float* y, int64_t y_stride) {
  const int64_t nb = w.k / Block;
  const size_t chunk = chunk_bytes(w);
  const size_t code_bytes = packed::code_bytes(w);
  const bool any_offset = w.has_offset != 0 || w.centre != 0;
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const __m512i low_nibble = _mm512_set1_epi8(0x0f);
  const __m512i book = codebook_vector(w.codebook);
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sum_hi[M], sum_lo[M];
    for (int r = 0; r < M; ++r) sum_hi[r] = sum_lo[r] = _mm512_setzero_si512();
    const uint8_t* block = base + static_cast<size_t>(b) * chunk;
    prefetch_ahead(block, chunk);
    auto step = [&](int quad, __m512i codes) {  // codes: 16 columns x inputs 4 quad .. 4 quad + 3
      for (int r = 0; r < M; ++r) {
        sum_hi[r] = _mm512_dpbusd_epi32(sum_hi[r], codes, broadcast4(rows.hi + r * rows.stride + b * Block + 4 * quad));
        if constexpr (Two)
          sum_lo[r] = _mm512_dpbusd_epi32(sum_lo[r], codes, broadcast4(rows.lo + r * rows.stride + b * Block + 4 * quad));
      }
    };
    if (w.bits == 4 && w.codebook) {  // each nibble looked up in the codebook (one vpshufb)
      for (int row = 0; row < Block / 8; ++row) {
        const __m512i v = _mm512_loadu_si512(block + 64 * row);
        step(2 * row, _mm512_shuffle_epi8(book, _mm512_and_si512(v, low_nibble)));
        step(2 * row + 1, _mm512_shuffle_epi8(book, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble)));
      }
    } else if (w.bits == 4) {
      for (int row = 0; row < Block / 8; ++row) {  // 64 bytes: low nibbles are inputs 8 row .. +3, high +4 .. +7
        const __m512i v = _mm512_loadu_si512(block + 64 * row);
        step(2 * row, _mm512_and_si512(v, low_nibble));
        step(2 * row + 1, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibble));
      }
    } else if (w.bits == 6) {
      for (int row = 0; row < Block / 8; ++row) {
        __m512i first, second;
        six_bit_codes<Block>(block, row, &first, &second);
        step(2 * row, first);
        step(2 * row + 1, second);
      }
    } else {
      for (int row = 0; row < Block / 4; ++row) step(row, _mm512_loadu_si512(block + 64 * row));
    }
    __m512 scale, offset;
    scales_offsets(w, g, b, block + code_bytes, &scale, &offset);
    for (int r = 0; r < M; ++r) {
      // 256 h + l: below 2^24 in magnitude for 4-bit codes, so exact in float32 (wider codes round here,
      // the same way on every tier).
      const __m512i dot = Two ? _mm512_add_epi32(_mm512_slli_epi32(sum_hi[r], 8), sum_lo[r]) : sum_hi[r];
      const __m512 col_scale = _mm512_mul_ps(scale, _mm512_set1_ps(rows.scale[r * rows.blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), col_scale, acc[r]);
      if (any_offset) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(rows.sum[r * rows.blocks + b]), acc[r]);
    }
  }
  const int64_t col = g * 16;
  const int64_t left = w.n - col;
  const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  for (int r = 0; r < M; ++r) _mm512_mask_storeu_ps(y + r * y_stride + col, mask, acc[r]);
}

}  // namespace vnni

struct Vnni {
  static constexpr int kRows = 8;
  static constexpr int kTwoDigitRows = 4;  // rows a pass with 16-bit inputs
  static void quantize_row(const float* x, int64_t k, int block, int8_t* hi, int8_t* lo, float* scale, float* sum) {
    (block == kSmallBlock ? vnni::quantize_row<kSmallBlock> : vnni::quantize_row<kBlock>)(x, k, hi, lo, scale, sum);
  }
  static void quantize_row8(const float* x, int64_t k, int block, int8_t* digits, float* scale, float* sum) {
    (block == kSmallBlock ? vnni::quantize_row8<kSmallBlock> : vnni::quantize_row8<kBlock>)(x, k, digits, scale, sum);
  }
  template <int M>
  static void rows_block(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                         int64_t ys) {
    // Two digits need twice the accumulators: at most four rows a pass in the 32 registers.
    digit_passes<Vnni, kTwoDigitRows, M>(w, g_lo, g_hi, rows, y, ys);
  }
  template <int M, bool Two>
  static void blocks(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                     int64_t ys) {
    if (w.block == kSmallBlock)
      groups<kSmallBlock, M, Two>(w, g_lo, g_hi, rows, y, ys);
    else
      groups<kBlock, M, Two>(w, g_lo, g_hi, rows, y, ys);
  }
  template <int Block, int M, bool Two>
  static void groups(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y, int64_t ys) {
    for (int64_t g = g_lo; g < g_hi; ++g) vnni::tile_group<Block, M, Two>(w, g, rows, y, ys);
  }
};

}  // namespace kvflow::packed
