// The packed matmul on AVX2 (no VNNI): each 32-byte half of a code row (8 columns x 4 inputs) times four
// input digits through vpmaddubsw (unsigned codes x signed digits, pairs summed to 16 bits) and vpmaddwd
// (pairs summed to 32 bits), as llama.cpp's AVX2 dot products do. CPUs with AVX-VNNI take
// packed_avx2_vnni.h's tiles instead (Avx2 below chooses at compile time).
//
// vpmaddubsw saturates, so each product must stay small: 4-bit codes (0..15) times digits (-128..127)
// give at most 3,840 per pair, and eight steps of a block summed in 16 bits stay below 32,767. 6-bit
// codes go whole, two steps summed in 16 bits and then in 32. 8-bit codes go as their low nibble and the
// rest (c = 16 h + l), recombined in 32 bits; except times 16-bit inputs, which go through vpmaddwd on
// whole inputs (tile_wide). Every sum is exact, and the float epilogue is the VNNI path's, lane for lane:
// the result is bitwise the same.
#pragma once

#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "packed_common.h"

namespace kvflow::packed {

namespace avx2 {

// One block's Block inputs into v, and their largest magnitude.
template <int Block>
float load_block(const float* xb, __m256 v[Block / 8]) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < Block / 8; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    m = _mm256_max_ps(m, _mm256_and_ps(v[i], sign_off));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

template <int Block>
void quantize_row(const float* x, int64_t k, int8_t* hi, int8_t* lo, float* scale, float* sum) {
  const __m256i lim = _mm256_set1_epi32(kMaxInt), neg = _mm256_set1_epi32(-kMaxInt), c128 = _mm256_set1_epi32(128);
  for (int64_t b = 0; b < k / Block; ++b) {
    __m256 v[Block / 8];
    const float amax = load_block<Block>(x + b * Block, v);
    const float s = amax / kMaxInt;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kMaxInt / amax : 0.f);
    __m256i total = _mm256_setzero_si256();
    alignas(32) int32_t h32[8], l32[8];
    for (int i = 0; i < Block / 8; ++i) {
      __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest even
      q = _mm256_max_epi32(_mm256_min_epi32(q, lim), neg);
      const __m256i h = _mm256_srai_epi32(_mm256_add_epi32(q, c128), 8);
      const __m256i l = _mm256_sub_epi32(q, _mm256_slli_epi32(h, 8));
      total = _mm256_add_epi32(total, q);
      _mm256_store_si256(reinterpret_cast<__m256i*>(h32), h);
      _mm256_store_si256(reinterpret_cast<__m256i*>(l32), l);
      for (int j = 0; j < 8; ++j) {
        hi[b * Block + 8 * i + j] = static_cast<int8_t>(h32[j]);
        lo[b * Block + 8 * i + j] = static_cast<int8_t>(l32[j]);
      }
    }
    alignas(32) int32_t t32[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t32), total);
    int32_t sum_q = 0;
    for (int j = 0; j < 8; ++j) sum_q += t32[j];
    scale[b] = s;
    sum[b] = s * static_cast<float>(sum_q);
  }
}

// 8-bit inputs (one digit): quantize_row8_scalar's arithmetic, 8 inputs at a time.
template <int Block>
void quantize_row8(const float* x, int64_t k, int8_t* digits, float* scale, float* sum) {
  constexpr int V = Block / 8;
  const __m256i lim = _mm256_set1_epi32(kMaxInt8), neg = _mm256_set1_epi32(-kMaxInt8);
  for (int64_t b = 0; b < k / Block; ++b) {
    __m256 v[V];
    const float amax = load_block<Block>(x + b * Block, v);
    const float s = amax / kMaxInt8;
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? kMaxInt8 / amax : 0.f);
    __m256i q[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // a block of 16 fills the second half with zeros, not stored
      q[i] = i < V ? _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)), lim), neg)
                   : _mm256_setzero_si256();
      total = _mm256_add_epi32(total, q[i]);
    }
    // int32 -> int8, in order: pack to 16 bits (per 128-bit lane), then to 8, then undo the lane interleave.
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if constexpr (Block == 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(digits + b * Block), bytes);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(digits + b * Block), _mm256_castsi256_si128(bytes));
    alignas(32) int32_t t32[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t32), total);
    int32_t sum_q = 0;
    for (int j = 0; j < 8; ++j) sum_q += t32[j];
    scale[b] = s;
    sum[b] = s * static_cast<float>(sum_q);
  }
}

// The running 16-bit sums, kept as a chain in registers: integer adds reassociate, and GCC turned each
// block's eight steps into a tree over every product, which spilled them to the stack (the kernel ran at
// 60% of its port limit). The empty asm only pins the value; it emits nothing.
inline __m256i in_register(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

// Columns 8 half .. + 8 of block b's scales and offsets in group g (s: the block's bytes after its codes):
// the VNNI path's values (kvflow_cpu.h), lane for lane. offset null: not wanted.
inline void scales_offsets(const KvflowPackedWeight& w, int64_t g, int64_t b, const uint8_t* s, int half,
                           __m256* scale, __m256* offset) {
  auto halves = [](const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  auto bytes = [](const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  if (w.super_scales) {
    const uint8_t* d = super_at(w, g, b) + 16 * half;
    *scale = _mm256_mul_ps(halves(d), bytes(s + 8 * half));
    if (offset)  // -(dmin * m): a sign flip, as the scalar code's unary minus
      *offset = _mm256_xor_ps(_mm256_mul_ps(halves(d + 32), bytes(s + 16 + 8 * half)), _mm256_set1_ps(-0.f));
    return;
  }
  *scale = halves(s + 16 * half);
  if (offset)  // stored, or a centred weight's -centre * scale (exact: the same value)
    *offset = w.has_offset ? halves(s + 16 * half + 32)
                           : _mm256_mul_ps(*scale, _mm256_set1_ps(-static_cast<float>(w.centre)));
}

// Eight columns' results into out, of which `left` exist (the last group may hold fewer).
inline void store_columns(float* out, __m256 v, int64_t left) {
  if (left >= 8) {
    _mm256_storeu_ps(out, v);
  } else if (left > 0) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(out, tmp, sizeof(float) * left);
  }
}

// Half `half` of 6-bit row `row`'s codes as two vectors of whole codes (inputs 8 row .. +3, then +4 ..
// +7): each nibble with its top two bits put above it; the 16-bit shifts carry a neighbour byte's bits
// along, the masks drop them.
template <int Block>
inline void six_bit_codes(const uint8_t* block, int row, int half, __m256i* first, __m256i* second) {
  const __m256i low_nibble = _mm256_set1_epi8(0x0f), top_pair = _mm256_set1_epi8(0x30);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * row + 32 * half));
  const __m256i top =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + top_bits_at(Block) + 64 * (row / 2) + 32 * half));
  const __m256i top_first = row % 2 ? top : _mm256_slli_epi16(top, 4);  // its pair to bits 4, 5
  const __m256i top_second = row % 2 ? _mm256_srli_epi16(top, 2) : _mm256_slli_epi16(top, 2);
  *first = _mm256_or_si256(_mm256_and_si256(v, low_nibble), _mm256_and_si256(top_first, top_pair));
  *second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble),
                            _mm256_and_si256(top_second, top_pair));
}

inline __m256i broadcast4(const int8_t* p) {  // four input digits, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Columns 16 g + 8 half .. + 8 of group g for M rows, H halves (1 or 2) from `half` on. Two: two input
// digits (16-bit inputs), else one (8-bit). The code width (Bits) and the offset are template arguments too, so
// that only the sums a format uses are live: with run-time flags the compiler kept all of them and
// spilled the accumulators to the stack.
// Book: 4-bit indices into w.codebook, whose 8-bit codes go as their two nibbles (two vpshufb from the
// index, one per nibble's table), as 8-bit codes do.
template <int Block, int M, int H, bool Two, int Bits, bool HasOffset, bool Book = false>
void tile(const KvflowPackedWeight& w, int64_t g, int half, const Rows& rows, float* y, int64_t y_stride) {
  const int64_t nb = w.k / Block;
  const size_t chunk = chunk_bytes(w), codes_end = code_bytes(w);
  constexpr bool has_offset = HasOffset, four_bit = Bits == 4 && !Book;
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  const __m256i low_nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const CodebookNibbles& tables = kCodebookNibbles[Book ? w.codebook : 0];
  const __m256i book_low = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tables.low)));
  const __m256i book_high = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(tables.high)));
  __m256 acc[M][H];
  for (int r = 0; r < M; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const size_t at = static_cast<size_t>(b) * chunk;
    if (half == 0) prefetch_ahead(base + at, chunk);
    // 16-bit sums over the block: [digit][nibble] (nibble 1: what is above the low nibble of 6- and 8-bit
    // codes). Every index is a compile-time constant, so the sums stay in registers (a run-time nibble
    // index put them on the stack, and the kernel ran at half speed).
    __m256i s16[M][H][2][2];
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < 2; ++d) s16[r][h][d][0] = s16[r][h][d][1] = _mm256_setzero_si256();
    auto step = [&](int quad, auto nibble_constant, const __m256i* codes) {  // codes[h]: 8 columns x 4 inputs
      constexpr int nibble = decltype(nibble_constant)::value;
      for (int r = 0; r < M; ++r) {
        const __m256i xh = broadcast4(rows.hi + r * rows.stride + b * Block + 4 * quad);
        for (int h = 0; h < H; ++h)
          s16[r][h][0][nibble] = in_register(_mm256_add_epi16(s16[r][h][0][nibble], _mm256_maddubs_epi16(codes[h], xh)));
        if constexpr (Two) {
          const __m256i xl = broadcast4(rows.lo + r * rows.stride + b * Block + 4 * quad);
          for (int h = 0; h < H; ++h)
            s16[r][h][1][nibble] = in_register(_mm256_add_epi16(s16[r][h][1][nibble], _mm256_maddubs_epi16(codes[h], xl)));
        }
      }
    };
    constexpr std::integral_constant<int, 0> low;
    constexpr std::integral_constant<int, 1> high;
    if constexpr (Book) {
      for (int row = 0; row < Block / 8; ++row) {  // indices as the 4-bit rows; each looked up twice
        __m256i idx[2][H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + at + 64 * row + 32 * (half + h)));
          idx[0][h] = _mm256_and_si256(v, low_nibble);
          idx[1][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble);
        }
        for (int part = 0; part < 2; ++part) {
          __m256i lo[H], hi[H];
          for (int h = 0; h < H; ++h)
            lo[h] = _mm256_shuffle_epi8(book_low, idx[part][h]), hi[h] = _mm256_shuffle_epi8(book_high, idx[part][h]);
          step(2 * row + part, low, lo);
          step(2 * row + part, high, hi);
        }
      }
    } else if constexpr (four_bit) {
      for (int row = 0; row < Block / 8; ++row) {  // low nibbles are inputs 8 row .. +3, high ones +4 .. +7
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + at + 64 * row + 32 * (half + h)));
          lo[h] = _mm256_and_si256(v, low_nibble);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble);
        }
        step(2 * row, low, lo);
        step(2 * row + 1, low, hi);
      }
    } else if constexpr (Bits == 6) {
      // Whole codes (0..63): a vpmaddubsw pair is at most 2 x 63 x 128 = 16,128 in magnitude, so two steps'
      // products still sum exactly in 16 bits; each such sum goes on to 32 bits (s16[r][h][d][1]) at once.
      for (int row = 0; row < Block / 8; ++row) {
        __m256i first[H], second[H];
        for (int h = 0; h < H; ++h) six_bit_codes<Block>(base + at, row, half + h, &first[h], &second[h]);
        for (int r = 0; r < M; ++r) {
          const int8_t* digits = rows.hi + r * rows.stride + b * Block + 8 * row;
          for (int d = 0; d < (Two ? 2 : 1); ++d) {
            if (d == 1) digits = rows.lo + r * rows.stride + b * Block + 8 * row;
            const __m256i x0 = broadcast4(digits), x1 = broadcast4(digits + 4);
            for (int h = 0; h < H; ++h) {
              const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(first[h], x0), _mm256_maddubs_epi16(second[h], x1));
              s16[r][h][d][1] = in_register(_mm256_add_epi32(s16[r][h][d][1], _mm256_madd_epi16(pair, ones)));
            }
          }
        }
      }
    } else {
      for (int row = 0; row < Block / 4; ++row) {  // code c = 16 (c >> 4) + (c & 15): each nibble on its own
        __m256i lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + at + 64 * row + 32 * (half + h)));
          lo[h] = _mm256_and_si256(v, low_nibble);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibble);
        }
        step(row, low, lo);
        step(row, high, hi);
      }
    }
    for (int h = 0; h < H; ++h) {
      __m256 scale, offset = _mm256_setzero_ps();
      scales_offsets(w, g, b, base + at + codes_end, half + h, &scale, has_offset ? &offset : nullptr);
      for (int r = 0; r < M; ++r) {
        // Per digit: the 32-bit sums of whole 6-bit codes, else the 16-bit ones widened (and the nibble above
        // the low one, of 8-bit codes, shifted into place).
        auto digit_dot = [&](int d) {
          if constexpr (Bits == 6) {
            return s16[r][h][d][1];
          } else {
            __m256i dot_d = _mm256_madd_epi16(s16[r][h][d][0], ones);
            if constexpr (!four_bit)
              dot_d = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(s16[r][h][d][1], ones), 4), dot_d);
            return dot_d;
          }
        };
        __m256i dot = digit_dot(0);
        if constexpr (Two) dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), digit_dot(1));
        const __m256 col_scale = _mm256_mul_ps(scale, _mm256_set1_ps(rows.scale[r * rows.blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), col_scale, acc[r][h]);
        if constexpr (has_offset) acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(rows.sum[r * rows.blocks + b]), acc[r][h]);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t col = g * 16 + 8 * (half + h);
    for (int r = 0; r < M; ++r) store_columns(y + r * y_stride + col, acc[r][h], w.n - col);
  }
}

// Wide codes times 16-bit inputs: each code widened to 16 bits once (vpmovzxbw) and multiplied by the
// whole 16-bit input through vpmaddwd, 16 products a step, where vpmaddubsw needs the input's two digits
// and the code's two nibbles apart (four steps of 32 products for the same 32 weights and one row). The
// integer sums are the same exact integers, and the epilogue is tile's, so the result is bitwise the same.
// Columns 16 g .. + 16 for M (<= 2) rows. For 8-bit codes only: for 6-bit codes and codebook indices,
// building each 8-bit code first cost what it saved (benchmarks/RESULTS.md, session 26).
template <int Block, int M>
void tile_wide(const KvflowPackedWeight& w, int64_t g, const Rows& rows, float* y, int64_t y_stride) {
  static_assert(M >= 1 && M <= 2, "eight int32 accumulators a row");
  const int64_t nb = w.k / Block;
  const size_t chunk = chunk_bytes(w), codes_end = code_bytes(w);
  const bool any_offset = w.has_offset != 0 || w.centre != 0;
  const uint8_t* base = w.data + static_cast<size_t>(g) * nb * chunk;
  __m256 acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  alignas(32) int16_t x16[M][Block];  // each row's inputs of the block as 16-bit integers, 256 h + l
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = base + static_cast<size_t>(b) * chunk;
    prefetch_ahead(block, chunk);
    for (int r = 0; r < M; ++r)
      for (int i = 0; i < Block; i += 16) {
        const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.hi + r * rows.stride + b * Block + i)));
        const __m256i l = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows.lo + r * rows.stride + b * Block + i)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(x16[r] + i), _mm256_add_epi16(_mm256_slli_epi16(h, 8), l));
      }
    // sums[r][c]: columns 4 c .. 4 c + 3, two int32 lanes a column (inputs 4 q, +1 and 4 q + 2, +3).
    __m256i sums[M][4];
    for (int r = 0; r < M; ++r)
      for (int c = 0; c < 4; ++c) sums[r][c] = _mm256_setzero_si256();
    for (int quad = 0; quad < Block / 4; ++quad) {
      __m256i wide[4];  // four columns each, as 16-bit codes
      for (int c = 0; c < 4; ++c)  // the code row of inputs 4 quad .. + 3, four columns at a time
        wide[c] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 * quad + 16 * c)));
      for (int r = 0; r < M; ++r) {
        int64_t four;
        std::memcpy(&four, x16[r] + 4 * quad, 8);
        const __m256i x = _mm256_set1_epi64x(four);
        for (int c = 0; c < 4; ++c) sums[r][c] = _mm256_add_epi32(sums[r][c], _mm256_madd_epi16(wide[c], x));
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset = _mm256_setzero_ps();
      scales_offsets(w, g, b, block + codes_end, h, &scale, any_offset ? &offset : nullptr);
      for (int r = 0; r < M; ++r) {
        // Each column's two lanes summed, in column order: [c0 c1 c4 c5 | c2 c3 c6 c7] -> c0 .. c7.
        const __m256i dot = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sums[r][2 * h], sums[r][2 * h + 1]), 0xD8);
        const __m256 col_scale = _mm256_mul_ps(scale, _mm256_set1_ps(rows.scale[r * rows.blocks + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), col_scale, acc[r][h]);
        if (any_offset) acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(rows.sum[r * rows.blocks + b]), acc[r][h]);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t col = g * 16 + 8 * h;
    for (int r = 0; r < M; ++r) store_columns(y + r * y_stride + col, acc[r][h], w.n - col);
  }
}

}  // namespace avx2

}  // namespace kvflow::packed

#include "packed_avx2_vnni.h"  // after the helpers above, which it uses

namespace kvflow::packed {

struct Avx2 {
#ifdef KVFLOW_AVX2_VNNI  // a row's sums are int32 only (no 16-bit ones): more rows fit the 16 registers
  static constexpr int kRows = 6;
  static constexpr int kTwoDigitRows = 3;  // rows a pass with 16-bit inputs
#else
  static constexpr int kRows = 4;
  static constexpr int kTwoDigitRows = 2;
#endif
  static void quantize_row(const float* x, int64_t k, int block, int8_t* hi, int8_t* lo, float* scale, float* sum) {
    (block == kSmallBlock ? avx2::quantize_row<kSmallBlock> : avx2::quantize_row<kBlock>)(x, k, hi, lo, scale, sum);
  }
  static void quantize_row8(const float* x, int64_t k, int block, int8_t* digits, float* scale, float* sum) {
    (block == kSmallBlock ? avx2::quantize_row8<kSmallBlock> : avx2::quantize_row8<kBlock>)(x, k, digits, scale, sum);
  }
  template <int M>
  static void rows_block(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                         int64_t ys) {
    // Two digits need twice the accumulators: fewer rows a pass in the 16 registers.
    digit_passes<Avx2, kTwoDigitRows, M>(w, g_lo, g_hi, rows, y, ys);
  }
  template <int M, bool Two>
  static void blocks(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                     int64_t ys) {
    if (w.block == kSmallBlock)
      with_format<kSmallBlock, M, Two>(w, g_lo, g_hi, rows, y, ys);
    else
      with_format<kBlock, M, Two>(w, g_lo, g_hi, rows, y, ys);
  }
  template <int Block, int M, bool Two>
  static void with_format(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                          int64_t ys) {
#ifndef KVFLOW_AVX2_VNNI
    if constexpr (Two && M <= 2) {  // 8-bit codes times 16-bit inputs: vpmaddwd on whole inputs (tile_wide)
      if (w.bits == 8) {
        for (int64_t g = g_lo; g < g_hi; ++g) avx2::tile_wide<Block, M>(w, g, rows, y, ys);
        return;
      }
    }
#endif
    if (w.codebook)  // centred on 128: always an offset
      groups<Block, M, Two, 4, true, true>(w, g_lo, g_hi, rows, y, ys);
    else if (w.bits == 4)
      with_offset<Block, M, Two, 4>(w, g_lo, g_hi, rows, y, ys);
    else if (w.bits == 6)
      with_offset<Block, M, Two, 6>(w, g_lo, g_hi, rows, y, ys);
    else
      with_offset<Block, M, Two, 8>(w, g_lo, g_hi, rows, y, ys);
  }
  template <int Block, int M, bool Two, int Bits>
  static void with_offset(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y,
                          int64_t ys) {
    w.has_offset || w.centre ? groups<Block, M, Two, Bits, true>(w, g_lo, g_hi, rows, y, ys)
                             : groups<Block, M, Two, Bits, false>(w, g_lo, g_hi, rows, y, ys);
  }
  // Groups [g_lo, g_hi) for M rows: both halves of a group in one pass where its accumulators fit the 16
  // registers, else a half at a time. With VNNI a row and half holds one or two int32 sums and a float
  // result; without, 16-bit sums per digit and nibble as well: there only one row of 4- or 6-bit codes.
  template <int Block, int M, bool Two, int Bits, bool HasOffset, bool Book = false>
  static void groups(const KvflowPackedWeight& w, int64_t g_lo, int64_t g_hi, const Rows& rows, float* y, int64_t ys) {
#ifdef KVFLOW_AVX2_VNNI
    constexpr bool both = M * 2 * (Two ? 3 : 2) <= 8;
#else
    constexpr bool both = M == 1 && !Book && (Bits == 4 || Bits == 6);
#endif
    for (int64_t g = g_lo; g < g_hi; ++g) {
      if constexpr (both) {
        tile<Block, M, 2, Two, Bits, HasOffset, Book>(w, g, 0, rows, y, ys);
      } else {
        tile<Block, M, 1, Two, Bits, HasOffset, Book>(w, g, 0, rows, y, ys);
        tile<Block, M, 1, Two, Bits, HasOffset, Book>(w, g, 1, rows, y, ys);
      }
    }
  }
  // H halves of group g from `half` on, through this build's tile.
  template <int Block, int M, int H, bool Two, int Bits, bool HasOffset, bool Book>
  static void tile(const KvflowPackedWeight& w, int64_t g, int half, const Rows& rows, float* y, int64_t ys) {
#ifdef KVFLOW_AVX2_VNNI
    avx2::tile_vnni<Block, M, H, Two, Bits, HasOffset, Book>(w, g, half, rows, y, ys);
#else
    avx2::tile<Block, M, H, Two, Bits, HasOffset, Book>(w, g, half, rows, y, ys);
#endif
  }
};

}  // namespace kvflow::packed
